//! Layer: proxy — the request phases (data plane, above generation, lane,
//! nodes, upstream and static files; never imports the control plane).
//!
//! One request's story, each phase a named function around one [`RequestCtx`]:
//! [`resolve`] (limits, host, client address) → route → decide the lane (lane
//! precedence, `lane::precedence`) → serve: [`forward`] (select node →
//! rewrite request → buffer body → attempt → respond) or `static_files` →
//! [`record`] (metrics, access log, lane header). Failures are typed
//! (`base::error::Error`) and become the client's answer in one place.
//!
//! What the path needs comes in a [`DataPlane`]: the live generation, the
//! upstream client (per-thread pools), node health, metric handles, the access
//! log — never the whole gateway.

pub mod answer;
pub mod ctx;
pub mod forward;
pub mod record;
pub mod resolve;

use std::borrow::Cow;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderValue};
use http::{Request, Response};

use crate::base::body::RequestBody;
use crate::base::counter::Counter;
use crate::base::decision::Decision;
use crate::base::error::{Error, ErrorKind};
use crate::base::trace::{Sampler, TraceCtx};
use crate::codec::fields::SentHead;
use crate::generation::{Generation, Live, Route, Target};
use crate::lane::{self, RequestInfo};
use crate::nodes::health::HealthRegistry;
use crate::observe::access_log::AccessLog;
use crate::observe::metrics::Metrics;
use crate::observe::node_stats::NodeStats;
use crate::upstream::Upstream;

pub use answer::Answer;
pub use ctx::{Client, RequestCtx};
pub use forward::FallbackLog;

/// Everything the request path reads or records into, handed down by the
/// control plane (which alone publishes generations).
pub struct DataPlane {
    /// The serving generation.
    pub generation: Live,
    /// Upstream client; its keep-alive pools live per worker thread.
    pub client: Upstream,
    /// Node health, kept across reloads.
    pub health: HealthRegistry,
    pub metrics: Metrics,
    /// Per-node counters, surviving reloads.
    pub node_stats: NodeStats,
    pub access_log: AccessLog,
    /// The gateway's spans to the OTLP exporter (`otel.traces`).
    pub spans: crate::observe::otel::Spans,
    /// Rate limit of the lane-fallback WARN.
    pub fallback_log: FallbackLog,
    /// Open upgraded (WebSocket) tunnels.
    pub tunnels: Arc<Counter>,
}

impl DataPlane {
    /// The generation serving now.
    pub fn current(&self) -> Arc<Generation> {
        self.generation.load()
    }
}

/// Serves one client request, phase by phase, as an `http` response (the
/// HTTP/2 side). The response body records the request when it ends
/// ([`record::Recorded`]).
pub async fn handle(
    plane: &Arc<DataPlane>,
    peer: SocketAddr,
    req: Request<RequestBody>,
) -> Result<Response<record::Recorded>, Infallible> {
    let answer = handle_with(plane.clone(), peer, req, None).await?;
    Ok(answer.into_response())
}

/// Serves one client request, phase by phase, as an [`Answer`] (the
/// HTTP/1.1 side writes its fields as they are). `sent`: an HTTP/1.1
/// request's head as received, whose lines go to the node as they came
/// for the fields passed on unchanged. The future owns what it needs
/// (`plane` too): it borrows nothing.
pub async fn handle_with(
    plane: Arc<DataPlane>,
    peer: SocketAddr,
    mut req: Request<RequestBody>,
    sent: Option<SentHead>,
) -> Result<Answer<record::Recorded>, Infallible> {
    let start = Instant::now();
    let gen = plane.current();
    let invalid = resolve::refusal(&mut req, &gen.config.client, &gen.lane.tag_header);
    let (parts, body) = req.into_parts();
    let info = resolve::resolve_request(parts, peer.ip(), &gen.trusted);
    let log = plane.access_log.enabled();
    let mut pending =
        record::Pending::new(plane, gen, || RequestCtx::begin(&info, peer, start, log));
    let (plane, gen, ctx) = pending.parts_mut();
    if let Some(o) = &gen.config.otel {
        ctx.trace = Some(Box::new(traced(plane, o, &info.parts)));
    }
    // The request's fields stay in `info` (moved only where the lane phase
    // takes them): each move of it copies the whole value.
    let routed = match invalid {
        Some(kind) => Err(Error::new(kind)),
        None => route(gen, &info),
    };
    let served = match routed {
        Err(e) => Err(e),
        Ok(route) => {
            let mut info = decide(gen, route, ctx, info);
            ctx.upstream_route = matches!(route.target, Target::Service(_));
            ctx.serve_start = Some(Instant::now());
            match &route.target {
                Target::Service(name) => {
                    let service = (name, &route.upgrades[..]);
                    let request = (&mut info.parts, sent.as_ref());
                    forward::forward(plane, gen, ctx, service, request, body).await
                }
                Target::Static(tree) => {
                    let decision = ctx.decision.as_mut().expect("decided above");
                    // Only the HTTP/1.1 side can sendfile.
                    let sendfile_ok = info.parts.version != http::Version::HTTP_2;
                    crate::static_files::serve(tree, &info.parts, decision, sendfile_ok)
                        .await
                        .map(Answer::from)
                }
            }
        }
    };
    let mut resp = served.unwrap_or_else(|e| {
        ctx.error = Some(e.kind());
        Answer::from(e.response())
    });
    if let Some(c) = ctx.set_cookie.take() {
        resp.fields.append(header::SET_COOKIE, c);
    }
    ctx.end = Instant::now();
    Ok(record::respond(pending, resp))
}

/// The trace phase (`otel:`): the caller's trace continued or a new one
/// started, sampled as `otel.traces` says (every new trace without it: the
/// ids reach the logs and the nodes, no span is exported).
fn traced(
    plane: &DataPlane,
    o: &crate::config::otel::OtelConfig,
    parts: &http::request::Parts,
) -> ctx::Traced {
    let trace = TraceCtx::begin(&parts.headers, Sampler::of(o));
    let export = trace.sampled && plane.spans.enabled();
    ctx::Traced {
        export,
        method: parts.method.clone(),
        path: export.then(|| parts.uri.path().to_string()),
        start: std::time::SystemTime::now(),
        ctx: trace,
    }
}

/// The route phase: the route for host and path (404 without one).
fn route<'g>(gen: &'g Generation, info: &RequestInfo) -> Result<&'g Route, Error> {
    Ok(gen
        .route(&info.host, info.parts.uri.path())
        .ok_or(ErrorKind::NoRoute)?)
}

/// The lane phase: lane precedence on the route (`lane::decide_on_route`;
/// the order is documented on `DecidedBy`).
fn decide(gen: &Generation, route: &Route, ctx: &mut RequestCtx, info: RequestInfo) -> RequestInfo {
    let mut decided = lane::decide_on_route(&gen.lane, route.sticky, info);
    decided.decision.route = Some(route.prefix.clone());
    ctx.set_cookie = decided.set_cookie;
    ctx.decision = Some(decided.decision);
    decided.info
}

/// The lane as a header value: ready-made for served lanes, built for
/// others (lane names are header-safe by validation).
pub fn lane_tag<'g>(gen: &'g Generation, d: &Decision) -> Cow<'g, HeaderValue> {
    match gen.lane_tags.get(d.lane.as_str()) {
        Some(t) => Cow::Borrowed(t),
        None => Cow::Owned(HeaderValue::from_str(&d.lane).expect("lane names are header-safe")),
    }
}
