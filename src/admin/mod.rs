//! Layer: admin — the top of the control plane; may use every layer below
//! (control, and the data plane's generation, lane, nodes, proxy resolve phase
//! for `/explain`). The admin listener: status, Prometheus metrics, nodes
//! (listing and management written back to the node files), explain (a dry-run
//! lane and node decision), traffic stats and the live dashboard. Every request
//! passes [`auth`] first.

pub mod auth;
pub mod client;
pub mod dashboard;
pub mod explain;
pub mod nodes;
pub mod releases;
pub mod rules;

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use tokio::net::TcpListener;

use crate::base::body::{boxed, plain, Body, RequestBody};
use crate::control::Gateway;
use crate::server::Service;

/// Largest admin request body accepted.
const MAX_BODY: usize = 64 * 1024;

pub fn json(value: serde_json::Value) -> Response<Body> {
    json_status(StatusCode::OK, value)
}

pub fn json_status(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from(value.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    r
}

/// A plain-text error with a dynamic message.
pub fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let mut m: String = msg.into();
    if !m.ends_with('\n') {
        m.push('\n');
    }
    let mut r = Response::new(boxed(Full::new(Bytes::from(m))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The analysis each lane's release judges it with, for the canary panel:
/// a running or promoted release's, else the latest rolled-back one's.
fn release_analyses(
    gw: &Gateway,
) -> std::collections::BTreeMap<String, (String, crate::config::release::AnalysisSpec)> {
    let mut out = std::collections::BTreeMap::new();
    let all = crate::control::release::controller::list(gw);
    let rolled_back = all
        .iter()
        .filter(|r| r.state.phase == crate::config::release::Phase::RolledBack);
    let holding = all.iter().filter(|r| r.state.phase.holds_routes());
    for r in rolled_back.chain(holding) {
        out.insert(
            r.spec.lane.clone(),
            (r.spec.name.clone(), r.spec.analysis.clone()),
        );
    }
    out
}

/// The `/status` document.
pub fn status(gw: &Gateway) -> serde_json::Value {
    let gen = gw.current();
    let st = gw.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let secs = |t: std::time::SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let src = gw.source.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut doc = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "generation": gen.id,
        "loaded_at": secs(gen.loaded_at),
        "last_reload_error": st.last_reload_error,
        "last_reload_at": st.last_reload_at.map(secs),
        "last_reload_result": match (&st.last_reload_at, &st.last_reload_error) {
            (None, _) => "none",
            (Some(_), None) => "applied",
            (Some(_), Some(_)) => "rejected",
        },
        "reloads_applied": st.applied,
        "reloads_rejected": st.rejected,
        "uptime_secs": gw.started.elapsed().as_secs(),
        "warnings": gen.warnings,
        // The lane script's VM: LuaJIT's compiler on (`script_limits.jit`
        // as it resolved here), null without a script.
        "script_jit": gen.lane.script.as_ref().map(|s| s.jit),
        "source": src.source,
    });
    if let Some(store) = &gw.store {
        // Whether `/fleet` lists this store's gateways.
        doc["fleet"] = store.keeps_fleet().into();
        doc["source_state"] = src.source_state.into();
        doc["revision"] = src.revision.into();
        doc["config_hash"] = src.config_hash.into();
        doc["store_error"] = src.store_error.into();
        doc["gateway_id"] = src.gateway_id.into();
        if let Some(ids) = src.listening {
            doc["listening"] = ids.into();
        }
    }
    if let Some((key, v)) = crate::control::source::discovery::status(gw) {
        doc[key] = v;
    }
    doc
}

/// `GET /fleet`: every gateway's status key and whether all run the same
/// revision (etcd source only).
async fn fleet(gw: &Gateway) -> Response<Body> {
    match &gw.store {
        None => text(
            StatusCode::NOT_FOUND,
            "no fleet: this gateway runs on files (start it from a bootstrap file)",
        ),
        Some(store) => match store.fleet().await {
            Ok(v) => json(v),
            Err((true, e)) => text(StatusCode::SERVICE_UNAVAILABLE, e),
            Err((false, e)) => text(StatusCode::NOT_FOUND, e),
        },
    }
}

/// A refused admin request: status and a short message.
pub struct Rejection(pub StatusCode, pub String);

impl Rejection {
    pub fn response(self) -> Response<Body> {
        text(self.0, self.1)
    }
}

/// Reads a request body of at most `max` bytes: 413 past it, 400 when
/// the body cannot be read (cut short, bad chunked framing, too slow).
pub async fn read_body(body: RequestBody, max: usize) -> Result<Bytes, Rejection> {
    match Limited::new(body, max).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(Rejection(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body over {} KiB", max / 1024),
        )),
        Err(e) => Err(Rejection(
            StatusCode::BAD_REQUEST,
            format!("request body unreadable: {e}"),
        )),
    }
}

/// Reads a JSON request body (at most [`MAX_BODY`] bytes).
pub async fn read_json<T: serde::de::DeserializeOwned>(body: RequestBody) -> Result<T, Rejection> {
    let bytes = read_body(body, MAX_BODY).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Rejection(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")))
}

async fn route(gw: &Arc<Gateway>, req: Request<RequestBody>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method().clone();
    match (&method, segs.as_slice()) {
        (&Method::GET, [""]) => dashboard::page(),
        (&Method::GET, [asset]) if dashboard::is_asset(asset) => dashboard::asset(asset),
        (&Method::GET, ["status"]) => json(status(gw)),
        (&Method::GET, ["metrics"]) => {
            nodes::refresh_gauges(gw);
            let mut r = Response::new(boxed(Full::new(Bytes::from(gw.plane.metrics.encode()))));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        (&Method::GET, ["stats"]) => json(gw.history.report(&release_analyses(gw))),
        (&Method::GET, ["fleet"]) => fleet(gw).await,
        (&Method::GET, ["config"]) => json(dashboard::config_doc(gw)),
        (&Method::GET, ["nodes"]) => json(nodes::list(gw)),
        (&Method::GET, ["explain"]) => explain::get(gw, req.uri().query().unwrap_or("")),
        (&Method::POST, ["explain"]) => match read_json(req.into_body()).await {
            Ok(q) => explain::run(gw, q),
            Err(r) => r.response(),
        },
        (_, ["nodes", ..]) => nodes::manage(gw, req, &segs[1..]).await,
        (_, ["rules", ..]) => rules::handle(gw, req, &segs[1..]).await,
        (_, ["releases", ..]) => releases::handle(gw, req, &segs[1..]).await,
        (_, ["status" | "metrics" | "stats" | "config" | "explain" | "fleet"]) => {
            plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => plain(StatusCode::NOT_FOUND, "not found\n"),
    }
}

async fn handle(
    gw: &Arc<Gateway>,
    guard: &auth::Guard,
    req: Request<RequestBody>,
) -> Response<Body> {
    if let Some(resp) = guard.deny(gw, req.headers()) {
        return resp;
    }
    route(gw, req).await
}

/// Serves the admin API forever (and samples traffic for the dashboard),
/// on the client listeners' connection loop and HTTP/1.1 codec
/// (`server::serve_own`: their `client:` limits, a connection cap of its
/// own, no drain).
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener) {
    let local = listener.local_addr().map_or(true, |a| a.ip().is_loopback());
    let guard = Arc::new(auth::Guard::new(!local));
    tokio::spawn(crate::control::stats::sample_forever(gw.clone()));
    let plane = gw.plane.clone();
    let app = Service::new(move |_peer, req| {
        let gw = gw.clone();
        let guard = guard.clone();
        async move { handle(&gw, &guard, req).await }
    });
    crate::server::serve_own(plane, listener, app).await
}
