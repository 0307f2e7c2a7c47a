//! The request path, in phases: resolve the client and route, decide the
//! lane, pick a node of that lane (or formal), rewrite the request for the
//! upstream (tag header, X-Forwarded-*, hop-by-hop headers), stream it there
//! and stream the answer back. Static routes hand off to `static_files`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::config::{ClientConfig, UpstreamConfig, FORMAL};
use crate::gateway::Gateway;
use crate::generation::{Generation, Target};
use crate::health::now_ms;
use crate::lane::{self, DecidedBy, Decision, RequestInfo};
use crate::lists::IpList;
use crate::metrics::NodeTracker;
use crate::nodes::{Fallback, NoCandidates};
use crate::sticky::{unix_now, Sticky};
use crate::upbody::Replay;
pub use crate::upbody::UpBody;
use crate::upstream::PooledBody;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the gateway sends.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Boxes any body into [`Body`].
pub fn boxed<B>(b: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// A response body that holds `guard` (an in-flight marker) until the body
/// has been sent to its end, or is dropped.
pub struct Guarded<G> {
    inner: Body,
    guard: Option<G>,
}

impl<G> Guarded<G> {
    pub fn new(inner: Body, guard: G) -> Guarded<G> {
        Guarded {
            inner,
            guard: Some(guard),
        }
    }
}

impl<G: Unpin> hyper::body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(None) = r {
            self.guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A short plain-text response.
pub fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from_static(text.as_bytes()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The pooled upstream client (per-thread keep-alive pools).
pub type UpstreamClient = crate::upstream::Upstream;

pub fn build_client(cfg: &UpstreamConfig) -> UpstreamClient {
    crate::upstream::Upstream::new(cfg)
}

/// Host without port, lower-case, from the Host header or the URI.
pub fn host_of(headers: &HeaderMap, uri: &Uri) -> String {
    let raw = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()))
        .unwrap_or("");
    let host = if let Some(rest) = raw.strip_prefix('[') {
        // [v6]:port
        rest.split(']').next().unwrap_or("")
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
    };
    host.to_ascii_lowercase()
}

/// The client address behind trusted proxies: the right-most
/// X-Forwarded-For entry that is not itself a trusted proxy.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &IpList) -> IpAddr {
    if !trusted.contains(peer) {
        return peer;
    }
    client_behind(peer, headers, trusted)
}

/// [`client_ip`] for a peer already known to be a trusted proxy.
fn client_behind(peer: IpAddr, headers: &HeaderMap, trusted: &IpList) -> IpAddr {
    let mut client = peer;
    let entries = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for e in entries.iter().rev() {
        match e.parse::<IpAddr>() {
            Ok(ip) => {
                client = ip;
                if !trusted.contains(ip) {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    client
}

/// The request-resolution phase shared by real traffic, `/explain` and the
/// fuzz entry: host (lower-case, no port) and the client address (from
/// X-Forwarded-For only behind a trusted proxy). Also returns whether the
/// peer itself is a trusted proxy.
pub fn resolve_request(parts: Parts, peer: IpAddr, trusted: &IpList) -> (RequestInfo, bool) {
    let peer_trusted = trusted.contains(peer);
    let client_ip = if peer_trusted {
        client_behind(peer, &parts.headers, trusted)
    } else {
        peer
    };
    let host = host_of(&parts.headers, &parts.uri);
    let info = RequestInfo {
        parts,
        client_ip,
        host,
    };
    (info, peer_trusted)
}

/// Headers that describe one connection and must not be forwarded
/// (pre-parsed names: no per-request name parsing on the hot path);
/// `Transfer-Encoding` is framing, handled by each side's engine. The
/// inline upstream exchange drops these while parsing a response head.
pub(crate) const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes hop-by-hop headers, including those named in `Connection`.
/// (`Transfer-Encoding` is framing that hyper owns on each side.)
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass comparing names (cheap for the
    // standard ones) instead of nine hashed removals.
    let any = headers
        .keys()
        .any(|n| n == header::TRANSFER_ENCODING || HOP_BY_HOP.contains(n));
    if !any {
        return;
    }
    if headers.contains_key(header::CONNECTION) {
        strip_connection_named(headers);
    }
    for n in &HOP_BY_HOP {
        headers.remove(n);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

fn strip_connection_named(headers: &mut HeaderMap) {
    // `keep-alive`, `close` and `upgrade` are the usual tokens; the first
    // and last are removed anyway, `close` names no header.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| {
            !["keep-alive", "close", "upgrade"]
                .iter()
                .any(|k| t.eq_ignore_ascii_case(k))
        })
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
}

/// Rate-limits the lane-fallback WARN per (service, lane).
#[derive(Default)]
pub struct FallbackLog(Mutex<HashMap<(String, String), Instant>>);

impl FallbackLog {
    fn should_log(&self, service: &str, lane: &str) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let key = (service.to_string(), lane.to_string());
        match m.get(&key) {
            Some(t) if now.duration_since(*t) < Duration::from_secs(10) => false,
            _ => {
                m.insert(key, now);
                true
            }
        }
    }
}

/// Header carrying the serving generation's id upstream, so a backend (and
/// the reload tests) can tell which configuration routed a request.
pub const GENERATION_HEADER: HeaderName = HeaderName::from_static("x-graygate-generation");

/// 414/431 for request targets or heads over the configured limits.
pub fn check_limits<B>(req: &Request<B>, limits: &ClientConfig) -> Option<Response<Body>> {
    let target = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len())
        + req.uri().authority().map_or(0, |a| a.as_str().len());
    if target > limits.max_uri_bytes {
        return Some(plain(StatusCode::URI_TOO_LONG, "request target too long\n"));
    }
    let head: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if head > limits.max_header_bytes {
        return Some(plain(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request headers too large\n",
        ));
    }
    None
}

/// Serves one client request.
pub async fn handle(
    gw: &Gateway,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let start = Instant::now();
    let gen = gw.current();
    if let Some(r) = check_limits(&req, &gen.config.client) {
        return Ok(r);
    }
    let (parts, body) = req.into_parts();
    let (info, peer_trusted) = resolve_request(parts, peer.ip(), &gen.trusted);
    let client = info.client_ip;
    // Only copied when the access log is on.
    let log_head = gw.access_log.enabled().then(|| {
        (
            info.parts.method.to_string(),
            info.parts.uri.path().to_string(),
        )
    });
    let Some(route) = gen.route(&info.host, info.parts.uri.path()) else {
        let resp = plain(StatusCode::NOT_FOUND, "no route\n");
        return Ok(finish(
            gw,
            &gen,
            None,
            resp,
            start,
            Instant::now(),
            None,
            client,
            log_head,
        ));
    };
    let sticky = gen.sticky.as_ref().filter(|_| route.sticky);
    let (info, mut decision, set_cookie) = match sticky {
        Some(st) => decide_sticky(&gen, st, info, peer_trusted),
        None => {
            let (i, d) = lane::decide(&gen, info, peer_trusted);
            (i, d, None)
        }
    };
    decision.route = Some(route.prefix.clone());
    let upstream_start = Instant::now();
    let mut resp = match &route.target {
        Target::Service(name) => {
            forward(
                gw,
                &gen,
                name,
                info,
                body,
                peer,
                peer_trusted,
                &mut decision,
            )
            .await
        }
        Target::Static(tree) => crate::static_files::serve(tree, &info.parts, &mut decision).await,
    };
    let end = Instant::now();
    let upstream = matches!(route.target, Target::Service(_)).then(|| end - upstream_start);
    if let Some(c) = set_cookie {
        resp.headers_mut().append(header::SET_COOKIE, c);
    }
    tracing::debug!(
        generation = gen.id,
        lane = %decision.lane,
        decided_by = decision.decided_by.as_str(),
        node = decision.node.as_deref().unwrap_or("-"),
        fallback = decision.fallback.unwrap_or("-"),
        status = resp.status().as_u16(),
        "request"
    );
    Ok(finish(
        gw,
        &gen,
        Some(&decision),
        resp,
        start,
        end,
        upstream,
        client,
        log_head,
    ))
}

/// The end of every request: metrics, the access log and the optional
/// lane response header, all from the decision, status and timings.
#[allow(clippy::too_many_arguments)]
fn finish(
    gw: &Gateway,
    gen: &Generation,
    decision: Option<&Decision>,
    mut resp: Response<Body>,
    start: Instant,
    end: Instant,
    upstream: Option<Duration>,
    client: IpAddr,
    log_head: Option<(String, String)>,
) -> Response<Body> {
    let total = end.saturating_duration_since(start);
    let status = resp.status().as_u16();
    gw.metrics.observe(&crate::metrics::Observation {
        decision,
        rule: decision.and_then(|d| d.decided_by.rule_name()),
        status,
        total,
        upstream,
    });
    if let Some((method, path)) = log_head {
        gw.access_log.log(crate::access_log::Entry {
            time: crate::access_log::Entry::now_string(),
            client_ip: client,
            method,
            path,
            status,
            lane: decision.map_or("-", |d| d.lane.as_str()).to_string(),
            decided_by: decision.map_or("-", |d| d.decided_by.as_str()).to_string(),
            rule: decision
                .and_then(|d| d.decided_by.rule_name())
                .map(str::to_string),
            node: decision
                .and_then(|d| d.node.as_deref())
                .unwrap_or("-")
                .to_string(),
            upstream_ms: upstream.map(crate::access_log::Entry::ms),
            total_ms: crate::access_log::Entry::ms(total),
        });
    }
    if let (Some(h), Some(d)) = (&gen.config.lane_response_header, decision) {
        if let Ok(v) = HeaderValue::from_str(&d.lane) {
            resp.headers_mut().insert(h.0.clone(), v);
        }
    }
    resp
}

/// Sticky routes: a valid cookie naming a lane this generation still serves
/// keeps that lane; otherwise the lane is decided as usual and (for a real
/// decision, not a script failure) a fresh cookie is returned to set. A tag
/// from a trusted proxy always wins.
pub fn decide_sticky(
    gen: &Generation,
    st: &Sticky,
    info: RequestInfo,
    peer_trusted: bool,
) -> (RequestInfo, Decision, Option<HeaderValue>) {
    let tagged = peer_trusted && info.parts.headers.contains_key(&gen.tag_header);
    let now = unix_now();
    // A deny rule beats a sticky cookie too (and pins no cookie).
    let denied = gen
        .rules
        .as_ref()
        .is_some_and(|r| r.denied(&info).is_some());
    if !tagged && !denied {
        let kept = lane::cookie_value(&info.parts.headers, &st.cookie)
            .and_then(|v| st.verify(v, now))
            .filter(|l| gen.served_lanes.contains(*l))
            .map(str::to_string);
        if let Some(l) = kept {
            return (info, Decision::new(l, DecidedBy::StickyCookie), None);
        }
    }
    let (info, d) = lane::decide(gen, info, peer_trusted);
    let cookie = matches!(
        d.decided_by,
        DecidedBy::Script | DecidedBy::Default | DecidedBy::Rule(_) | DecidedBy::RuleFallback
    )
    .then(|| st.set_cookie(&d.lane, now));
    (info, d, cookie)
}

/// Methods safe to send twice (RFC 9110 9.2.2).
pub fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

fn upgrade_requested(h: &HeaderMap) -> Option<HeaderValue> {
    let conn_upgrade = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if conn_upgrade {
        h.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// How one upstream attempt ended (for health and retry decisions).
// Lives on the stack for one attempt; boxing the response would cost an
// allocation per request.
#[allow(clippy::large_enum_variant)]
enum Outcome {
    Response(Response<PooledBody>),
    Connect(String),
    NoResponse(String),
    Timeout,
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    gw: &Gateway,
    gen: &Generation,
    service_name: &Arc<str>,
    info: RequestInfo,
    body: Incoming,
    peer: SocketAddr,
    peer_trusted: bool,
    decision: &mut Decision,
) -> Response<Body> {
    decision.service = Some(service_name.clone());
    let service_name: &str = service_name;
    let Some(service) = gen.services.get(service_name) else {
        return plain(StatusCode::SERVICE_UNAVAILABLE, "no such service\n");
    };
    let choice = match service.choose(&decision.lane, now_ms()) {
        Ok(c) => c,
        Err(NoCandidates::NoNodes) => {
            return plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "no upstream node for this lane\n",
            )
        }
        Err(NoCandidates::StrictUnhealthy) => {
            decision.fallback = Some("lane_unhealthy_strict");
            if gw.fallback_log.should_log(service_name, &decision.lane) {
                tracing::warn!(
                    service = service_name,
                    lane = %decision.lane,
                    "every node of this lane is down and the service is strict; answering 503"
                );
            }
            return plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy upstream node for this lane\n",
            );
        }
    };
    let set = choice.set;
    if let Some(fb) = choice.fallback {
        decision.fallback = Some(fb.as_str());
        if fb == Fallback::LaneUnhealthy {
            gw.health.count_fallback(service_name);
        }
        if gw.fallback_log.should_log(service_name, &decision.lane) {
            let (lane_nodes, formal_nodes) = (service.count(&decision.lane), service.count(FORMAL));
            let what = match fb {
                Fallback::LaneHasNoNodes => "no node serves this lane; sending to formal",
                Fallback::LaneUnhealthy => "every node of this lane is down; sending to formal",
                Fallback::AllUnhealthy => {
                    "every candidate node is down; trying the lane's nodes anyway"
                }
            };
            tracing::warn!(
                service = service_name,
                lane = %decision.lane,
                lane_nodes,
                formal_nodes,
                "{what}"
            );
        }
    }
    decision.candidates = set.nodes.len();

    let upstream = &gen.config.upstream;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(upstream.total_timeout_ms);
    let RequestInfo { mut parts, .. } = info;
    let original_host = parts.headers.get(header::HOST).cloned();
    let upgrade = upgrade_requested(&parts.headers);
    let client_upgrade = upgrade
        .as_ref()
        .and_then(|_| parts.extensions.remove::<hyper::upgrade::OnUpgrade>());
    strip_hop_by_hop(&mut parts.headers);
    if let Some(u) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, u.clone());
    }
    let tag = match gen.lane_tags.get(&decision.lane) {
        Some(t) => t.clone(),
        None => HeaderValue::from_str(&decision.lane).expect("lane names are header-safe"),
    };
    // The gateway's own fields replace any the client sent; they are kept
    // apart from the client's map and written after it (no map inserts).
    let added = Added::new(
        &mut parts.headers,
        (gen.tag_header.clone(), tag),
        gen.id_tag.clone(),
        peer.ip(),
        peer_trusted,
        original_host,
    );
    // Origin-form request target, built once for all attempts.
    let target = Uri::from(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    let method = parts.method.clone();
    let idem = idempotent(&method);
    let policy = &service.health.passive;

    // No body (the common GET): no timer needed to wait for it.
    let replay = if hyper::body::Body::is_end_stream(&body) {
        Ok(Ok(Replay::Empty))
    } else {
        tokio::time::timeout_at(
            deadline.into(),
            Replay::new(body, idem, upstream.retry_buffer_bytes),
        )
        .await
    };
    let mut replay = match replay {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => return plain(StatusCode::BAD_REQUEST, "request body error\n"),
        Err(_) => return plain(StatusCode::REQUEST_TIMEOUT, "request body timed out\n"),
    };
    let retries = service.retries.unwrap_or(upstream.retries) as usize;
    let max_attempts = (retries + 1).min(set.nodes.len());
    let mut tried: Vec<usize> = Vec::with_capacity(max_attempts);
    let mut last_error = None;
    while tried.len() < max_attempts {
        let Some(idx) = set.pick_for(now_ms(), &tried, choice.ignore_health) else {
            break;
        };
        let Some(up_body) = replay.next_body() else {
            break;
        };
        tried.push(idx);
        let node = &set.nodes[idx];
        let health = &set.health[idx];
        let tracker = NodeTracker::begin(gw.node_stats.get(service_name, node.addr));
        decision.served_lane = Some(node.lane.clone());
        decision.node = Some(node.name.clone());
        let mut req = Request::new(up_body);
        *req.method_mut() = method.clone();
        *req.uri_mut() = target.clone();
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = if tried.len() < max_attempts {
            parts.headers.clone()
        } else {
            std::mem::take(&mut parts.headers)
        };

        // One clock read fewer for the usual single attempt.
        let now = if tried.len() == 1 { t0 } else { Instant::now() };
        if now >= deadline {
            return plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n");
        }
        let per_try = Duration::from_millis(upstream.response_timeout_ms).min(deadline - now);
        let outcome =
            match tokio::time::timeout(per_try, gw.client.request(node.addr, req, &added)).await {
                Err(_) => Outcome::Timeout,
                Ok(Ok(r)) => Outcome::Response(r),
                Ok(Err(e)) if e.is_connect() => Outcome::Connect(e.to_string()),
                Ok(Err(e)) => Outcome::NoResponse(e.to_string()),
            };
        let (retry_ok, resp) = match outcome {
            Outcome::Response(r) => {
                if policy.fail_on_5xx && r.status().is_server_error() {
                    health.failure(&node.name, policy);
                } else {
                    health.success(&node.name);
                }
                return respond(r, client_upgrade, upgrade.is_some(), gw, tracker);
            }
            Outcome::Connect(e) => {
                tracing::warn!(node = %node.name, addr = %node.addr, error = %e, "upstream connect failed");
                health.failure(&node.name, policy);
                (
                    true,
                    plain(StatusCode::BAD_GATEWAY, "upstream connect error\n"),
                )
            }
            Outcome::NoResponse(e) => {
                tracing::warn!(node = %node.name, addr = %node.addr, error = %e, "upstream failed");
                health.failure(&node.name, policy);
                (idem, plain(StatusCode::BAD_GATEWAY, "upstream error\n"))
            }
            Outcome::Timeout => {
                tracing::warn!(node = %node.name, addr = %node.addr, "upstream timed out");
                health.failure(&node.name, policy);
                (
                    idem,
                    plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n"),
                )
            }
        };
        tracker.fail();
        last_error = Some(resp);
        replay.recover();
        if !retry_ok || !replay.replayable() {
            break;
        }
        if tried.len() < max_attempts {
            tracing::info!(node = %node.name, attempt = tried.len() + 1, "retrying on another node of the same lane");
        }
    }
    last_error.unwrap_or_else(|| plain(StatusCode::BAD_GATEWAY, "no upstream node available\n"))
}

/// Passes the upstream response back, keeping the node in flight until its
/// body is done; a `101 Switching Protocols` answer to an upgrade request
/// joins the two connections into a tunnel that keeps the node (and so the
/// lane) for the connection's life.
fn respond(
    mut resp: Response<PooledBody>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    upgrade_requested: bool,
    gw: &Gateway,
    tracker: NodeTracker,
) -> Response<Body> {
    tracker.count_status(resp.status());
    if upgrade_requested && resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_up) = client_upgrade else {
            tracker.count_status(StatusCode::BAD_GATEWAY);
            return plain(StatusCode::BAD_GATEWAY, "upgrade unavailable\n");
        };
        let upstream_up = hyper::upgrade::on(&mut resp);
        let tunnels = gw.tunnels.clone();
        tokio::spawn(async move {
            let (Ok(c), Ok(u)) = tokio::join!(client_up, upstream_up) else {
                tracing::debug!("upgrade handshake did not complete");
                return;
            };
            let _guard = crate::gateway::Counted::new(tunnels);
            let mut c = TokioIo::new(c);
            let mut u = TokioIo::new(u);
            let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
        });
        let (head, body) = resp.into_parts();
        return Response::from_parts(head, boxed(body.tracked(tracker)));
    }
    let (mut head, body) = resp.into_parts();
    strip_hop_by_hop(&mut head.headers);
    // One box for the upstream body and the node's in-flight marker.
    Response::from_parts(head, boxed(body.tracked(tracker)))
}

/// `ip` as a header value; the last one is cached per thread (a worker's
/// clients are mostly few, often one load balancer).
fn ip_header_value(ip: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((cached, v)) if *cached == ip => v.clone(),
            _ => {
                let v = HeaderValue::from_str(&ip.to_string()).expect("an IP is a header value");
                *last = Some((ip, v.clone()));
                v
            }
        }
    })
}

/// The fields the gateway sets on an upstream request: the lane tag, the
/// generation, and X-Forwarded-For/-Proto/-Host. From a trusted proxy the
/// X-Forwarded-For chain is extended and its -Proto/-Host are kept; from
/// anyone else client-supplied values are replaced.
pub struct Added {
    fields: [Option<(HeaderName, HeaderValue)>; 5],
}

impl Added {
    /// Computes the fields and removes from `headers` the client's copies
    /// they replace.
    pub fn new(
        headers: &mut HeaderMap,
        tag: (HeaderName, HeaderValue),
        generation: HeaderValue,
        peer: IpAddr,
        peer_trusted: bool,
        original_host: Option<HeaderValue>,
    ) -> Added {
        let prior = if peer_trusted {
            let joined: Vec<&str> = headers
                .get_all(X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            (!joined.is_empty()).then(|| joined.join(", "))
        } else {
            None
        };
        let xff = match prior {
            Some(p) => HeaderValue::from_str(&format!("{p}, {peer}")).ok(),
            None => Some(ip_header_value(peer)),
        };
        let keep_proto = peer_trusted && headers.contains_key(X_FORWARDED_PROTO);
        let keep_host = peer_trusted && headers.contains_key(X_FORWARDED_HOST);
        let replaced = |n: &HeaderName| {
            *n == tag.0
                || *n == GENERATION_HEADER
                || *n == X_FORWARDED_FOR
                || (!keep_proto && *n == X_FORWARDED_PROTO)
                || (!keep_host && *n == X_FORWARDED_HOST)
        };
        // Usually the client sent none of them: one pass over the names.
        if headers.keys().any(replaced) {
            let names: Vec<HeaderName> = headers.keys().filter(|n| replaced(n)).cloned().collect();
            for n in names {
                headers.remove(n);
            }
        }
        Added {
            fields: [
                Some(tag),
                Some((GENERATION_HEADER, generation)),
                xff.map(|v| (X_FORWARDED_FOR, v)),
                (!keep_proto).then(|| (X_FORWARDED_PROTO, HeaderValue::from_static("http"))),
                original_host
                    .filter(|_| !keep_host)
                    .map(|h| (X_FORWARDED_HOST, h)),
            ],
        }
    }

    /// No fields (health probes).
    pub fn none() -> Added {
        Added {
            fields: [None, None, None, None, None],
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.fields.iter().flatten().map(|(n, v)| (n, v))
    }

    /// Puts the fields into `headers` (for engines that take a whole map).
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in self.iter() {
            headers.insert(n.clone(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        let mut h = HeaderMap::new();
        let uri: Uri = "/x".parse().unwrap();
        h.insert(header::HOST, "Example.COM:8080".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "example.com");
        h.insert(header::HOST, "[::1]:8080".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "::1");
        h.insert(header::HOST, "a.b".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "a.b");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, X-Secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-keep", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn xff_from_trusted_proxies_only() {
        let trusted = IpList::from_nets(["10.0.0.0/8".parse().unwrap()]);
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "1.2.3.4, 10.0.0.7".parse().unwrap());
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let other: IpAddr = "8.8.8.8".parse().unwrap();
        assert_eq!(
            client_ip(proxy, &h, &trusted),
            "1.2.3.4".parse::<IpAddr>().unwrap()
        );
        assert_eq!(client_ip(other, &h, &trusted), other);
        let forwarded = |peer: IpAddr, trusted: bool, host: Option<HeaderValue>| {
            let mut fwd = h.clone();
            let tag = (
                HeaderName::from_static("x-gray-tag"),
                HeaderValue::from_static("gray"),
            );
            let added = Added::new(&mut fwd, tag, HeaderValue::from(7u64), peer, trusted, host);
            added.apply(&mut fwd);
            fwd
        };
        let fwd = forwarded(proxy, true, None);
        assert_eq!(fwd["x-forwarded-for"], "1.2.3.4, 10.0.0.7, 10.0.0.1");
        assert_eq!(fwd["x-gray-tag"], "gray");
        assert_eq!(fwd["x-graygate-generation"], "7");
        let mut spoofed = h.clone();
        spoofed.insert("x-gray-tag", "v2".parse().unwrap());
        spoofed.insert("x-forwarded-host", "evil".parse().unwrap());
        spoofed.append("x-forwarded-for", "6.6.6.6".parse().unwrap());
        let tag = (
            HeaderName::from_static("x-gray-tag"),
            HeaderValue::from_static("formal"),
        );
        let added = Added::new(
            &mut spoofed,
            tag,
            HeaderValue::from(7u64),
            other,
            false,
            None,
        );
        assert!(spoofed.get("x-gray-tag").is_none(), "client tag removed");
        assert!(spoofed.get("x-forwarded-host").is_none());
        assert!(spoofed.get("x-forwarded-for").is_none());
        added.apply(&mut spoofed);
        assert_eq!(spoofed["x-gray-tag"], "formal");
        assert_eq!(spoofed.get_all("x-forwarded-for").iter().count(), 1);
        let fwd = forwarded(other, false, Some("h".parse().unwrap()));
        assert_eq!(fwd["x-forwarded-for"], "8.8.8.8");
        assert_eq!(fwd["x-forwarded-host"], "h");
        assert_eq!(fwd["x-forwarded-proto"], "http");
    }
}
