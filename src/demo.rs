//! Layer: tools (top; uses config, and the server layer's connection loop).
//! Demo API nodes run in-process when the config declares `demo_nodes`, so
//! the shipped example shows both lanes with one command. Each answers JSON
//! with its name, its lane and the tag header it received, served by the
//! client listeners' HTTP/1.1 connection loop and codec
//! (`server::serve_own`).

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderName, Request, Response};
use http_body_util::Full;
use tokio::net::TcpListener;

use crate::base::body::{boxed, Body, RequestBody};
use crate::config::DemoNode;
use crate::proxy::DataPlane;
use crate::server::Service;

fn answer(node: &DemoNode, tag_header: &HeaderName, req: &Request<RequestBody>) -> Response<Body> {
    let tag = req
        .headers()
        .get(tag_header)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let body = serde_json::json!({
        "node": node.name,
        "lane": node.lane,
        "tag": tag,
        "method": req.method().as_str(),
        "path": req.uri().path(),
    });
    let mut r = Response::new(boxed(Full::new(Bytes::from(format!("{body}\n")))));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Binds every demo node and serves it in the background. `listener`
/// gives the socket for an address (inherited on a binary upgrade, else
/// freshly bound); `plane` gives the connections their limits (the
/// client listeners' `client:` section).
pub async fn spawn(
    nodes: &[DemoNode],
    tag_header: HeaderName,
    plane: &Arc<DataPlane>,
    mut listener: impl FnMut(std::net::SocketAddr) -> std::io::Result<TcpListener>,
) -> std::io::Result<()> {
    for node in nodes {
        let listener = listener(node.addr)?;
        tracing::info!(node = %node.name, lane = %node.lane, addr = %node.addr, "demo node listening");
        let node = node.clone();
        let tag_header = tag_header.clone();
        let app = Service::new(move |_peer, req: Request<RequestBody>| {
            let r = answer(&node, &tag_header, &req);
            async move { r }
        });
        tokio::spawn(crate::server::serve_own(plane.clone(), listener, app));
    }
    Ok(())
}
