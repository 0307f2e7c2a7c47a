//! Layer: admin. The live dashboard: one HTML page with plain JS and CSS
//! embedded in the binary (no build step). The page polls `/stats`, `/nodes`,
//! `/status` and `/config` every two seconds and posts its explain form to
//! `/explain`.

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use http_body_util::Full;

use crate::base::body::{boxed, Body};
use crate::control::Gateway;
use crate::generation::Target;

const PAGE: &str = include_str!("assets/dashboard.html");
const SCRIPT: &str = include_str!("assets/dashboard.js");
const STYLE: &str = include_str!("assets/dashboard.css");

fn send(body: &'static str, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from_static(body.as_bytes()))));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub fn page() -> Response<Body> {
    send(PAGE, "text/html; charset=utf-8")
}

pub fn is_asset(name: &str) -> bool {
    matches!(name, "dashboard.js" | "dashboard.css")
}

pub fn asset(name: &str) -> Response<Body> {
    match name {
        "dashboard.js" => send(SCRIPT, "text/javascript; charset=utf-8"),
        _ => send(STYLE, "text/css; charset=utf-8"),
    }
}

/// `/config`: routes, lists, node files and the lane script's source.
pub fn config_doc(gw: &Gateway) -> serde_json::Value {
    let gen = gw.current();
    let routes: Vec<serde_json::Value> = gen
        .routes
        .iter()
        .map(|r| {
            let target = match &r.target {
                Target::Service(s) => serde_json::json!({"service": s}),
                Target::Static(t) => serde_json::json!({"static": t.root}),
            };
            serde_json::json!({"host": r.host, "prefix": r.prefix, "target": target})
        })
        .collect();
    let script = gen.lane.script.as_ref().map(|s| {
        serde_json::json!({
            "path": s.path,
            "source": s.source,
            "modules": s.modules.iter().map(|(name, (path, src))| {
                serde_json::json!({"name": name, "path": path, "source": src})
            }).collect::<Vec<_>>(),
        })
    });
    serde_json::json!({
        "generation": gen.id,
        "config_path": gen.config_path,
        "tag_header": gen.lane.tag_header.as_str(),
        "routes": routes,
        "lists": gen.config.lists,
        "node_files": gen.config.node_files,
        "script": script,
        "rules": super::rules::list(gw),
    })
}
