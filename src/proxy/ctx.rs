//! Layer: proxy. The per-request context carried through every phase (as
//! Pingora's session + CTX): the client facts, the lane `Decision` and what was
//! done with it, the timings, and what the access log needs.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use http::header::HeaderValue;
use http::request::Parts;

use super::resolve::resolve_request;
use crate::base::decision::Decision;
use crate::generation::Generation;
use crate::lane::RequestInfo;
use crate::observe::access_log::AccessLog;

/// Who sent the request.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    /// The direct peer.
    pub peer: SocketAddr,
    /// Is the peer a trusted proxy (its X-Forwarded-For and tag believed)?
    pub peer_trusted: bool,
    /// The client address: the peer, or from X-Forwarded-For behind a
    /// trusted proxy.
    pub ip: IpAddr,
    /// The request came over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
}

/// One request's context.
pub struct RequestCtx {
    pub client: Client,
    /// When the request head was handed to the gateway.
    pub start: Instant,
    /// When the route's handler (upstream or static) started.
    pub serve_start: Option<Instant>,
    /// When the response head was ready.
    pub end: Instant,
    /// The lane decision and routing record; `None` until routed.
    pub decision: Option<Decision>,
    /// A fresh sticky cookie to set on the response.
    pub set_cookie: Option<HeaderValue>,
    /// Method and path, copied only when the access log is on.
    pub log_head: Option<(String, String)>,
    /// The route sends to a service (upstream time is recorded).
    pub upstream_route: bool,
}

impl RequestCtx {
    /// The resolve phase: host and client address, and a fresh context.
    pub fn begin(
        gen: &Generation,
        parts: Parts,
        peer: SocketAddr,
        start: Instant,
        log: &AccessLog,
    ) -> (RequestInfo, RequestCtx) {
        let https = parts.extensions.get::<crate::base::Https>().is_some();
        let info = resolve_request(parts, peer.ip(), &gen.trusted);
        let log_head = log.enabled().then(|| {
            (
                info.parts.method.to_string(),
                info.parts.uri.path().to_string(),
            )
        });
        let ctx = RequestCtx {
            client: Client {
                peer,
                peer_trusted: info.peer_trusted,
                ip: info.client_ip,
                https,
            },
            start,
            serve_start: None,
            end: start,
            decision: None,
            set_cookie: None,
            log_head,
            upstream_route: false,
        };
        (info, ctx)
    }

    /// Time spent in the upstream exchange, for service routes.
    pub fn upstream_time(&self) -> Option<Duration> {
        let s = self.serve_start.filter(|_| self.upstream_route)?;
        Some(self.end - s)
    }

    pub fn total(&self) -> Duration {
        self.end.saturating_duration_since(self.start)
    }
}
