//! Layer: admin. `/nodes`: every service's nodes with lane, weight, drain,
//! health and live counters (and, for addresses resolved from a host
//! name, the name and how its lookups stand); and node management — `POST /nodes/{service}`
//! adds, `PATCH /nodes/{service}/{node}` changes lane/weight/drain, `POST
//! /nodes/{service}/{node}/drain|undrain`, `DELETE …/{node}` removes. Changes
//! are written back to the node file (see [`crate::control::node_edit`]) and
//! applied through [`Gateway::reload`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::base::body::RequestBody;
use http::{Method, Request, Response, StatusCode};
use serde::Deserialize;

use crate::base::body::Body;
use crate::config::{valid_lane, NodeAddr, NodeConfig, FORMAL};
use crate::control::names::NAMES;
use crate::control::node_edit::{self, EditError, NodeChange};
use crate::control::Gateway;
use crate::generation::Generation;

use super::{json, read_json, text};

/// Health of a node as far as the gateway knows: `healthy` while
/// selectable by its health checks, `unhealthy` when passive ejection or an
/// active check holds it down, `unknown` when the registry has no entry
/// (e.g. a draining or weight-0 node, which takes no traffic).
pub fn health(gw: &Gateway, service: &str, addr: SocketAddr) -> &'static str {
    match gw.plane.health.node(service, addr) {
        Some(h) if h.view().available => "healthy",
        Some(_) => "unhealthy",
        None => "unknown",
    }
}

fn health_detail(gw: &Gateway, service: &str, addr: SocketAddr) -> serde_json::Value {
    match gw.plane.health.node(service, addr) {
        Some(h) => {
            let v = h.view();
            serde_json::json!({
                "ejected": v.ejected,
                "on_trial": v.on_trial,
                "active_down": v.active_down,
                "consecutive_fails": v.consecutive_fails,
                "ejections": v.ejections,
            })
        }
        None => serde_json::Value::Null,
    }
}

/// The `/nodes` document.
pub fn list(gw: &Gateway) -> serde_json::Value {
    let gen = gw.current();
    let services: Vec<serde_json::Value> = gen
        .services
        .values()
        .map(|s| {
            let nodes: Vec<serde_json::Value> = s
                .all
                .iter()
                .map(|n| {
                    let (in_flight, requests, errors) = gw
                        .plane
                        .node_stats
                        .find(&s.name, n.addr)
                        .map_or((0, 0, 0), |c| c.snapshot());
                    serde_json::json!({
                        "name": n.name,
                        "addr": n.addr.to_string(),
                        "lane": n.lane,
                        "weight": n.weight,
                        "drain": n.drain,
                        "zone": n.zone.as_deref(),
                        "selectable": n.weight > 0 && !n.drain,
                        "health": health(gw, &s.name, n.addr),
                        "health_detail": health_detail(gw, &s.name, n.addr),
                        "in_flight": in_flight,
                        "requests": requests,
                        "errors": errors,
                        "host": host_of(&gen, &s.name, n.addr),
                    })
                })
                .collect();
            serde_json::json!({
                "name": s.name,
                "balance": s.select.balance.as_str(),
                // The discovery source whose instances the nodes are
                // (`nacos`; null: from node files or the registry).
                "discovery": gen
                    .discovered
                    .contains(&s.name)
                    .then(|| crate::control::source::discovery::name(&gen.config))
                    .flatten(),
                "nodes": nodes,
            })
        })
        .collect();
    serde_json::json!({
        "generation": gen.id,
        "services": services,
        "names": names(&gen),
    })
}

/// The `host:port` entry a node came from, when its address was resolved
/// from a host name (`null` for an address written as one).
fn host_of(gen: &Generation, service: &str, addr: SocketAddr) -> Option<String> {
    gen.node_names
        .iter()
        .find(|n| n.service == service && n.addrs.contains(&addr))
        .map(|n| format!("{}:{}", n.host, n.port))
}

/// Every node host name of the serving generation: what its nodes are,
/// what the name resolves to now, and whether its lookups fail (the nodes
/// then stay on the last good addresses).
fn names(gen: &Generation) -> Vec<serde_json::Value> {
    let ms = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    gen.node_names
        .iter()
        .map(|n| {
            let e = NAMES.entry(gen.config.resolver.as_ref(), &n.host);
            let state = match &e {
                Some(e) if e.error.is_some() => "failing",
                Some(_) => "ok",
                None => "unknown",
            };
            serde_json::json!({
                "service": n.service,
                "host": n.host,
                "port": n.port,
                "nodes": n.addrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "state": state,
                "resolved": e.as_ref().map(|e| e.addrs.iter().map(ToString::to_string).collect::<Vec<_>>()),
                "error": e.as_ref().and_then(|e| e.error.clone()),
                "last_resolved_unix_ms": e.as_ref().map(|e| ms(e.resolved_at)),
                "failing_since_unix_ms": e.as_ref().and_then(|e| e.failing_since.map(ms)),
            })
        })
        .collect()
}

/// Sets the node gauges (health, in-flight, weight) before a scrape.
pub fn refresh_gauges(gw: &Gateway) {
    let m = &gw.plane.metrics;
    m.node_health.reset();
    m.node_in_flight.reset();
    m.node_weight.reset();
    let gen = gw.current();
    for s in gen.services.values() {
        for n in &s.all {
            let labels = [s.name.as_str(), &*n.name, &*n.lane];
            let h = health(gw, &s.name, n.addr);
            for state in ["healthy", "unhealthy", "unknown"] {
                m.node_health
                    .with_label_values(&[labels[0], labels[1], labels[2], state])
                    .set(i64::from(state == h));
            }
            let in_flight = gw
                .plane
                .node_stats
                .find(&s.name, n.addr)
                .map_or(0, |c| c.snapshot().0);
            m.node_in_flight.with_label_values(&labels).set(in_flight);
            let w = if n.drain { 0 } else { i64::from(n.weight) };
            m.node_weight.with_label_values(&labels).set(w);
        }
    }
}

/// Body of `POST /nodes/{service}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddNode {
    addr: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    lane: Option<String>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    drain: bool,
    #[serde(default)]
    zone: Option<String>,
}

/// Body of `PATCH /nodes/{service}/{node}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchNode {
    #[serde(default)]
    lane: Option<String>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    drain: Option<bool>,
}

/// Routes `/nodes/...` management requests (`rest` is the path after `nodes`).
pub async fn manage(gw: &Arc<Gateway>, req: Request<RequestBody>, rest: &[&str]) -> Response<Body> {
    let method = req.method().clone();
    let if_match = if_match(&req);
    let change = match (&method, rest) {
        (&Method::POST, [service]) => {
            let add: AddNode = match read_json(req.into_body()).await {
                Ok(a) => a,
                Err(r) => return r.response(),
            };
            let addr: NodeAddr = match add.addr.parse() {
                Ok(a) => a,
                Err(e) => return text(StatusCode::BAD_REQUEST, e),
            };
            let lane = add.lane.unwrap_or_else(|| FORMAL.to_string());
            (
                *service,
                NodeChange::Add(NodeConfig {
                    name: add.name,
                    addr,
                    lane,
                    weight: add.weight.unwrap_or(1),
                    drain: add.drain,
                    zone: add.zone,
                }),
            )
        }
        (&Method::PATCH, [service, node]) => {
            let p: PatchNode = match read_json(req.into_body()).await {
                Ok(p) => p,
                Err(r) => return r.response(),
            };
            if p.lane.is_none() && p.weight.is_none() && p.drain.is_none() {
                return text(
                    StatusCode::BAD_REQUEST,
                    "nothing to change (lane, weight, drain)",
                );
            }
            if let Some(l) = p.lane.as_deref().filter(|l| !valid_lane(l)) {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("invalid lane name {l:?} (letters, digits, - _ . only)"),
                );
            }
            (
                *service,
                NodeChange::Update {
                    node: node.to_string(),
                    lane: p.lane,
                    weight: p.weight,
                    drain: p.drain,
                },
            )
        }
        (&Method::POST, [service, node, action @ ("drain" | "undrain")]) => (
            *service,
            NodeChange::Update {
                node: node.to_string(),
                lane: None,
                weight: None,
                drain: Some(*action == "drain"),
            },
        ),
        (&Method::DELETE, [service, node]) => (*service, NodeChange::Remove(node.to_string())),
        (_, [] | [_] | [_, _] | [_, _, "drain" | "undrain"]) => {
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => return text(StatusCode::NOT_FOUND, "not found"),
    };
    let (service, change) = change;
    let service = percent_decode(service);
    let change = match change {
        NodeChange::Update {
            node,
            lane,
            weight,
            drain,
        } => NodeChange::Update {
            node: percent_decode(&node),
            lane,
            weight,
            drain,
        },
        NodeChange::Remove(n) => NodeChange::Remove(percent_decode(&n)),
        other => other,
    };
    let result = match &gw.store {
        Some(store) => store.edit_node(gw, &service, change, if_match).await,
        None => edit(gw, &service, change).await,
    };
    match result {
        Ok(v) => json(v),
        Err(EditError::NotFound(m)) => text(StatusCode::NOT_FOUND, m),
        Err(EditError::Invalid(m)) => text(StatusCode::BAD_REQUEST, m),
        Err(EditError::Conflict(m)) => text(StatusCode::CONFLICT, m),
    }
}

/// `If-Match: <revision>`: the etcd revision the caller read (quotes
/// allowed, as for an ETag).
pub fn if_match<B>(req: &Request<B>) -> Option<i64> {
    req.headers()
        .get(http::header::IF_MATCH)?
        .to_str()
        .ok()?
        .trim()
        .trim_matches('"')
        .parse()
        .ok()
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// Validates, writes back and reloads. One change at a time.
async fn edit(
    gw: &Arc<Gateway>,
    service: &str,
    change: NodeChange,
) -> Result<serde_json::Value, EditError> {
    let _one_at_a_time = gw.edit_lock.lock().await;
    let gw2 = gw.clone();
    let service = service.to_string();
    let summary = change.to_string();
    tokio::task::spawn_blocking(move || -> Result<serde_json::Value, EditError> {
        let gen = gw2.current();
        let (path, text, _) =
            node_edit::find_service_file(&gen.config_path, &gen.config, &service)?;
        let new_text = node_edit::edit(&path, &text, &service, change)?;
        let generation = node_edit::commit(&gw2, &path, &new_text)?;
        tracing::info!(file = %path.display(), service = %service, change = %summary, "node file changed through the admin API");
        Ok(serde_json::json!({
            "file": path,
            "generation": generation,
            "service": service,
        }))
    })
    .await
    .map_err(|e| EditError::Conflict(format!("edit task failed: {e}")))?
}
