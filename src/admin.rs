//! The admin listener: `GET /status` (generation, last reload error, uptime).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::gateway::Gateway;
use crate::proxy::{boxed, plain, Body};

fn json(value: serde_json::Value) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from(value.to_string()))));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The `/status` document.
pub fn status(gw: &Gateway) -> serde_json::Value {
    let gen = gw.current();
    let st = gw.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let secs = |t: std::time::SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "generation": gen.id,
        "loaded_at": secs(gen.loaded_at),
        "last_reload_error": st.last_reload_error,
        "last_reload_at": st.last_reload_at.map(secs),
        "reloads_applied": st.applied,
        "reloads_rejected": st.rejected,
        "uptime_secs": gw.started.elapsed().as_secs(),
        "warnings": gen.warnings,
    })
}

async fn handle(gw: &Gateway, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/status") => json(status(gw)),
        (_, "/status") => plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
        _ => plain(StatusCode::NOT_FOUND, "not found\n"),
    })
}

/// Serves the admin API forever.
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let gw = gw.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let gw = gw.clone();
                async move { handle(&gw, req).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
