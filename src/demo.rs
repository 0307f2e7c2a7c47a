//! Layer: tools (top; uses config only). Demo API nodes run in-process when the
//! config declares `demo_nodes`, so the shipped example shows both lanes with
//! one command. Each answers JSON with its name, its lane and the tag header it
//! received.

use std::convert::Infallible;

use bytes::Bytes;
use http::{header, HeaderName, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::config::DemoNode;

fn answer(
    node: &DemoNode,
    tag_header: &HeaderName,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
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
    let mut r = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Binds every demo node and serves it in the background. `listener`
/// gives the socket for an address (inherited on a binary upgrade, else
/// freshly bound).
pub async fn spawn(
    nodes: &[DemoNode],
    tag_header: HeaderName,
    mut listener: impl FnMut(std::net::SocketAddr) -> std::io::Result<TcpListener>,
) -> std::io::Result<()> {
    for node in nodes {
        let listener = listener(node.addr)?;
        tracing::info!(node = %node.name, lane = %node.lane, addr = %node.addr, "demo node listening");
        let node = node.clone();
        let tag_header = tag_header.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let node = node.clone();
                let tag_header = tag_header.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let r = answer(&node, &tag_header, &req);
                        async move { Ok::<_, Infallible>(r) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    }
    Ok(())
}
