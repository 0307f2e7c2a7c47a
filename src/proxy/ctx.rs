//! Layer: proxy. The per-request context carried through every phase (as
//! Pingora's session + CTX): the client facts, the lane `Decision` and what was
//! done with it, the timings, and what the access log needs.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use http::header::HeaderValue;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::base::decision::Decision;
use crate::base::error::ErrorKind;
use crate::config::grpc::GrpcErrorCodes;
use crate::config::PassiveHealth;
use crate::lane::RequestInfo;
use crate::nodes::health::NodeHealth;
use crate::observe::node_stats::NodeCounters;
use crate::upstream::body::ClientFault;

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
    /// What failed, when the request did not end as the node answered.
    pub error: Option<ErrorKind>,
    /// The passive-health verdict on the node that answered, given when
    /// its response body ends (or fails).
    pub verdict: Option<Verdict>,
    /// A HEAD request (hyper sends no body for it).
    pub head_request: bool,
    /// Where the client's request body notes its failures (requests with
    /// a body).
    pub client_fault: Option<Arc<ClientFault>>,
    /// The request's trace context (`otel:` configured).
    pub trace: Option<Box<Traced>>,
}

/// A traced request: its W3C trace context, and what its span needs.
pub struct Traced {
    pub ctx: crate::base::trace::TraceCtx,
    /// The span is exported (sampled, and an exporter runs).
    pub export: bool,
    pub method: http::Method,
    /// The path, kept for an exported span.
    pub path: Option<String>,
    /// The wall-clock start (spans carry wall-clock times).
    pub start: std::time::SystemTime,
}

/// The node that answered a request, judged at the end of its body.
pub struct Verdict {
    pub health: Arc<NodeHealth>,
    pub node: Arc<str>,
    pub policy: PassiveHealth,
    /// The status alone already counts as a failure (5xx, `fail_on_5xx`).
    pub failed_status: bool,
    /// The node's counters (a broken body is one more error).
    pub counters: Arc<NodeCounters>,
    /// The service's gRPC statuses that count as errors (read at the end
    /// of a gRPC answer, by the `record` phase).
    pub grpc_error_codes: GrpcErrorCodes,
}

impl Verdict {
    /// The body ended as `body_ok` says: a success unless the status or the
    /// body failed.
    pub fn give(self, body_ok: bool) {
        if !body_ok {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        if body_ok && !self.failed_status {
            self.health.success(&self.node);
        } else {
            self.health.failure(&self.node, &self.policy);
        }
    }

    /// The node's gRPC answer ended with a counted error status: one more
    /// node error, and a passive-health failure as a 5xx would be (with
    /// `fail_on_5xx`).
    pub fn give_grpc_error(self) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if self.policy.fail_on_5xx {
            self.health.failure(&self.node, &self.policy);
        } else {
            self.health.success(&self.node);
        }
    }
}

impl RequestCtx {
    /// A fresh context for the request `info` describes (the resolve
    /// phase's result). Built straight into its box (`record::Pending::new`):
    /// no copy of the whole context per request.
    pub fn begin(info: &RequestInfo, peer: SocketAddr, start: Instant, log: bool) -> RequestCtx {
        RequestCtx {
            client: Client {
                peer,
                peer_trusted: info.peer_trusted,
                ip: info.client_ip,
                https: info.parts.extensions.get::<crate::base::Https>().is_some(),
            },
            start,
            serve_start: None,
            end: start,
            decision: None,
            set_cookie: None,
            log_head: log.then(|| {
                (
                    info.parts.method.to_string(),
                    info.parts.uri.path().to_string(),
                )
            }),
            upstream_route: false,
            error: None,
            verdict: None,
            head_request: info.parts.method == http::Method::HEAD,
            client_fault: None,
            trace: None,
        }
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
