//! Layer: admin. `/releases`: create a progressive release (`POST`, YAML or
//! JSON spec), list them, show one with every decision and the values behind
//! it, and act on one (`POST /releases/NAME/promote|pause|resume|abort|finish`;
//! `DELETE /releases/NAME` finishes, `?relabel_nodes=true` with either).
//! The work is the release controller's (`control::release`).

use std::sync::Arc;

use crate::base::body::RequestBody;
use http::{Method, Request, Response, StatusCode};

use super::{json, json_status, text};
use crate::base::body::Body;
use crate::config::release::ReleaseRecord;
use crate::control::release::controller::{self, Action, Refused};
use crate::control::release::weight;
use crate::control::Gateway;

/// Largest release spec accepted.
const MAX_SPEC: usize = 256 * 1024;

fn view(r: &ReleaseRecord, full: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "name": r.spec.name,
        "lane": r.spec.lane,
        "routes": r.spec.routes,
        "state": r.state.name(),
        "held": r.state.held,
        "step": r.state.step,
        "steps": r.spec.steps.len(),
        "weight": weight(r),
        "failures": r.state.failures,
        "awaiting_promote": r.state.awaiting_promote,
        "last": r.state.history.last(),
    });
    if full {
        v["spec"] = serde_json::to_value(&r.spec).unwrap_or_default();
        v["analyses"] = serde_json::to_value(&r.state.history).unwrap_or_default();
    }
    v
}

fn refused(e: Refused) -> Response<Body> {
    match e {
        Refused::NotFound(m) => text(StatusCode::NOT_FOUND, m),
        Refused::Conflict(m) => text(StatusCode::CONFLICT, m),
        Refused::Invalid(m) => text(StatusCode::BAD_REQUEST, m),
        Refused::Unavailable(m) => text(StatusCode::SERVICE_UNAVAILABLE, m),
    }
}

async fn read_text(body: RequestBody) -> Result<String, Response<Body>> {
    let bytes = super::read_body(body, MAX_SPEC)
        .await
        .map_err(super::Rejection::response)?;
    String::from_utf8(bytes.to_vec())
        .map_err(|_| text(StatusCode::BAD_REQUEST, "spec is not UTF-8"))
}

/// Routes `/releases` requests (`rest` is the path after `releases`).
pub async fn handle(gw: &Arc<Gateway>, req: Request<RequestBody>, rest: &[&str]) -> Response<Body> {
    let method = req.method().clone();
    let relabel_nodes = req.uri().query().is_some_and(|q| {
        q.split('&').any(|kv| {
            matches!(
                kv,
                "relabel_nodes=true" | "relabel_nodes=1" | "relabel_nodes"
            )
        })
    });
    let act = |name: &str, a: Action| {
        let (gw, name) = (gw.clone(), name.to_string());
        async move {
            match controller::act(&gw, &name, a).await {
                Ok(r) => json(view(&r, true)),
                Err(e) => refused(e),
            }
        }
    };
    match (&method, rest) {
        (&Method::GET, []) => {
            let all: Vec<_> = controller::list(gw)
                .iter()
                .map(|r| view(r, false))
                .collect();
            let mut doc = serde_json::json!({ "releases": all, "source": "files" });
            if let Some(store) = &gw.store {
                doc["source"] = store.name().into();
                if store.shared_releases().is_some() {
                    doc["fleet"] = crate::control::source::leadership_view(gw);
                }
            }
            json(doc)
        }
        (&Method::POST, []) => {
            let spec = match read_text(req.into_body()).await {
                Ok(s) => s,
                Err(r) => return r,
            };
            match controller::create(gw, &spec).await {
                Ok(r) => json_status(StatusCode::CREATED, view(&r, true)),
                Err(e) => refused(e),
            }
        }
        (&Method::GET, [name]) => {
            match controller::list(gw).iter().find(|r| r.spec.name == *name) {
                Some(r) => json(view(r, true)),
                None => text(StatusCode::NOT_FOUND, format!("no release {name:?}")),
            }
        }
        (&Method::DELETE, [name]) => act(name, Action::Finish { relabel_nodes }).await,
        (&Method::POST, [name, action]) => match Action::parse(action) {
            Some(Action::Finish { .. }) => act(name, Action::Finish { relabel_nodes }).await,
            Some(a) => act(name, a).await,
            None => text(
                StatusCode::NOT_FOUND,
                "actions: promote, pause, resume, abort, finish",
            ),
        },
        (_, [] | [_] | [_, _]) => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => text(StatusCode::NOT_FOUND, "not found"),
    }
}
