//! Layer: upstream. HTTP/2 to nodes (gRPC and other h2 services): h2c with
//! prior knowledge over plain TCP, or h2 negotiated by ALPN over TLS. One
//! multiplexed connection per node and worker thread (kept in a thread-local
//! map, like the HTTP/1.1 pools), opened on first use and replaced when it
//! closes. Bodies stream both ways and trailers (`grpc-status`) pass through.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustc_hash::FxHashMap;

use super::body::UpBody;
use super::fields::Added;
use super::tls::Transport;
use crate::base::error::{Error, ErrorKind};

type Sender = SendRequest<UpBody>;

thread_local! {
    /// (node, TLS settings id; 0 = h2c) → this thread's connection to it.
    static CONNS: RefCell<FxHashMap<(SocketAddr, u64), Sender>> = RefCell::new(FxHashMap::default());
}

/// Headers that HTTP/2 forbids (RFC 9113 8.2.2) beyond the hop-by-hop
/// fields the proxy already removed.
const CONNECTION_SPECIFIC: [header::HeaderName; 4] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HeaderName::from_static("keep-alive"),
];

/// Sends `req` (origin-form target) to `addr` over HTTP/2.
pub async fn request(
    addr: SocketAddr,
    transport: &Transport,
    req: Request<UpBody>,
    added: &Added<'_>,
    connect_timeout: Duration,
) -> Result<Response<Incoming>, Error> {
    let tls = transport.tls.is_some();
    let key = (addr, transport.tls.as_ref().map_or(0, |t| t.id));
    let mut req = to_h2(addr, tls, req, added);
    if let Some(mut sender) = checkout(key) {
        if sender.ready().await.is_ok() {
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    // Never sent (the connection went away): a fresh one.
                    Some(r) => req = r,
                    None => return Err(Error::new(ErrorKind::Exchange).with_source(e.into_error())),
                },
            }
        }
        CONNS.with(|c| c.borrow_mut().remove(&key));
    }
    let mut sender = connect(addr, transport, connect_timeout).await?;
    CONNS.with(|c| c.borrow_mut().insert(key, sender.clone()));
    sender
        .ready()
        .await
        .map_err(|e| Error::new(ErrorKind::Connect).with_source(e))?;
    sender
        .send_request(req)
        .await
        .map_err(|e| Error::new(ErrorKind::Exchange).with_source(e))
}

fn checkout(key: (SocketAddr, u64)) -> Option<Sender> {
    CONNS.with(|c| {
        let mut c = c.borrow_mut();
        match c.get(&key) {
            Some(s) if !s.is_closed() => Some(s.clone()),
            Some(_) => {
                c.remove(&key);
                None
            }
            None => None,
        }
    })
}

async fn connect(
    addr: SocketAddr,
    transport: &Transport,
    connect_timeout: Duration,
) -> Result<Sender, Error> {
    let tcp = super::h1::connect_tcp(addr, connect_timeout).await?;
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(false);
    let connect_err = |e: hyper::Error| Error::new(ErrorKind::Connect).with_source(e);
    match &transport.tls {
        None => {
            let (sender, conn) = builder
                .handshake(TokioIo::new(tcp))
                .await
                .map_err(connect_err)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok(sender)
        }
        Some(t) => {
            let stream = tokio::time::timeout(connect_timeout, t.connect(tcp, addr))
                .await
                .map_err(|_| {
                    Error::new(ErrorKind::Connect).with_source("TLS handshake timed out")
                })??;
            if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(Error::new(ErrorKind::Connect)
                    .with_source("the node did not negotiate h2 (ALPN)"));
            }
            let (sender, conn) = builder
                .handshake(TokioIo::new(stream))
                .await
                .map_err(connect_err)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok(sender)
        }
    }
}

/// The request as HTTP/2 wants it: absolute URI (`:scheme`, `:authority`
/// from the Host field or the node's address), no connection-specific
/// fields, `te: trailers` for gRPC.
fn to_h2(addr: SocketAddr, tls: bool, req: Request<UpBody>, added: &Added<'_>) -> Request<UpBody> {
    let (mut parts, body) = req.into_parts();
    added.apply(&mut parts.headers);
    let authority = parts
        .headers
        .remove(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .or_else(|| Authority::try_from(addr.to_string()).ok());
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(if tls { Scheme::HTTPS } else { Scheme::HTTP });
    uri.authority = authority;
    uri.path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .or_else(|| Some(http::uri::PathAndQuery::from_static("/")));
    if let Ok(u) = Uri::from_parts(uri) {
        parts.uri = u;
    }
    for n in &CONNECTION_SPECIFIC {
        parts.headers.remove(n);
    }
    let grpc = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        parts
            .headers
            .insert(header::TE, HeaderValue::from_static("trailers"));
    }
    parts.version = Version::HTTP_2;
    Request::from_parts(parts, body)
}
