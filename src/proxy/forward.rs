//! Layer: proxy — the forward phases of a service route: select the candidate
//! set of the lane (or formal) → rewrite the request for the node (hop-by-hop
//! fields out; tag, generation and X-Forwarded-* in) → buffer the body when a
//! retry may need it → attempt on a node picked by the service's balance
//! policy, retrying on another node of the same set → respond (pass the
//! answer back, or join an upgraded tunnel).

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode, Uri};

use super::ctx::{Client, RequestCtx, Verdict};
use super::{lane_tag, DataPlane};
use crate::base::baggage::{self, BAGGAGE};
use crate::base::body::{boxed, Body, RequestBody};
use crate::base::clock::now_ms;
use crate::base::counter::Counted;
use crate::base::decision::Decision;
use crate::base::error::{Error, ErrorKind};
use crate::base::trace::{TRACEPARENT, TRACESTATE};
use crate::base::upgrade::ClientUpgrade;
use crate::codec::fields::SentHead;
use crate::config::{UpstreamConfig, FORMAL};
use crate::generation::Generation;
use crate::nodes::{Choice, Fallback, NoCandidates, Service};
use crate::observe::metrics::NodeTracker;
use crate::upstream::body::{ClientBody, Replay};
use crate::upstream::fields::{idempotent, scan, strip_hop_by_hop, strip_hop_by_hop_found, Added};
use crate::upstream::{OutHead, Peer, PooledBody};

use super::answer::Answer;
use crate::codec::fields::Fields;

/// Rate-limits the lane-fallback WARN to once per 10 s per (service,
/// lane): a slot per hash of the pair holding when it last logged — no
/// lock, no allocation (two pairs sharing a slot share the limit).
pub struct FallbackLog([AtomicU64; 256]);

impl Default for FallbackLog {
    fn default() -> Self {
        FallbackLog([const { AtomicU64::new(0) }; 256])
    }
}

impl FallbackLog {
    fn should_log(&self, service: &str, lane: &str) -> bool {
        let mut h = rustc_hash::FxHasher::default();
        (service, lane).hash(&mut h);
        let slot = &self.0[(h.finish() % 256) as usize];
        let now = now_ms();
        let last = slot.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= 10_000)
            && slot
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// Sends the request to a node of its lane (or formal) and returns the
/// node's answer, retrying on another node of the same set when safe.
pub async fn forward(
    plane: &DataPlane,
    gen: &Generation,
    ctx: &mut RequestCtx,
    (service_name, upgrades): (&Arc<str>, &[String]),
    (parts, sent): (&mut Parts, Option<&SentHead>),
    body: RequestBody,
) -> Result<Answer<Body>, Error> {
    let client = &ctx.client;
    let decision = ctx.decision.as_mut().expect("decided before forwarding");
    decision.service = Some(service_name.clone());
    let service = gen
        .services
        .get(&**service_name)
        .ok_or(ErrorKind::NoSuchService)?;
    let choice = select_node(plane, service, decision)?;
    let upstream = &gen.config.upstream;
    // The serve phase's start (one clock read fewer per request).
    let t0 = ctx.serve_start.unwrap_or_else(Instant::now);
    let mut out = rewrite_request(gen, (client, t0), decision, parts, upstream, upgrades);
    out.sent = sent;
    if let Some(o) = &gen.config.otel {
        let trace = ctx.trace.as_deref().map(|t| &t.ctx);
        otel_fields(plane, gen, o, (&decision.lane, trace), &mut out.headers);
    }
    // No body (the common GET): nothing to wait for, no timer.
    let replay = if hyper::body::Body::is_end_stream(&body) {
        Replay::Empty
    } else {
        let timeout = Duration::from_millis(gen.config.client.body_timeout_ms);
        let body = ClientBody::new(body, timeout);
        // Kept for the record: a client body that fails after the node's
        // head arrived still makes the failure the client's.
        ctx.client_fault = Some(body.fault().clone());
        buffer_body(body, out.idempotent, out.deadline, upstream).await?
    };
    let verdict = &mut ctx.verdict;
    attempt_all(
        plane,
        service,
        (choice, client),
        (decision, verdict),
        // Borrowed: the request's fields (a large value) are not moved
        // again.
        &mut out,
        replay,
        upstream,
    )
    .await
}

/// The node-choice phase: the lane's healthy nodes, else formal (never
/// another gray lane), else the lane's nodes in panic mode; strict
/// services answer 503 instead of falling back. Fallbacks are counted and
/// logged (rate-limited).
fn select_node<'g>(
    plane: &DataPlane,
    service: &'g Service,
    decision: &mut Decision,
) -> Result<Choice<'g>, Error> {
    let service_name = service.name.as_str();
    let choice = match service.choose(&decision.lane, now_ms()) {
        Ok(c) => c,
        Err(NoCandidates::NoNodes) => return Err(ErrorKind::NoNodes.into()),
        Err(NoCandidates::StrictUnhealthy) => {
            decision.fallback = Some("lane_unhealthy_strict");
            if plane.fallback_log.should_log(service_name, &decision.lane) {
                tracing::warn!(
                    service = service_name,
                    lane = %decision.lane,
                    "every node of this lane is down and the service is strict; answering 503"
                );
            }
            return Err(ErrorKind::LaneUnhealthyStrict.into());
        }
    };
    if let Some(fb) = choice.fallback {
        decision.fallback = Some(fb.as_str());
        if plane.fallback_log.should_log(service_name, &decision.lane) {
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
    decision.candidates = choice.set.nodes.len();
    Ok(choice)
}

/// The request as it goes to a node (the same for every attempt).
struct Outbound<'g> {
    method: Method,
    /// The client's head as received (HTTP/1.1): its lines for the fields
    /// passed on unchanged.
    sent: Option<&'g SentHead>,
    /// Origin-form target, built once.
    target: Uri,
    /// The client's end-to-end fields (hop-by-hop removed).
    headers: HeaderMap,
    /// The gateway's own fields, written after the client's.
    added: Added<'g>,
    idempotent: bool,
    /// The protocol the client asked to upgrade to (kept for the node).
    upgrade: Option<HeaderValue>,
    client_upgrade: Option<ClientUpgrade>,
    t0: Instant,
    /// `upstream.total_timeout_ms` from `t0`.
    deadline: Instant,
}

/// The rewrite phase: hop-by-hop fields out (an allowed upgrade's kept),
/// the lane tag, generation and X-Forwarded-* computed (client copies
/// removed). The method and fields are taken out of `parts` (borrowed: the
/// request's head is not moved again).
fn rewrite_request<'g>(
    gen: &'g Generation,
    (client, t0): (&Client, Instant),
    decision: &Decision,
    parts: &mut Parts,
    upstream: &UpstreamConfig,
    upgrades: &[String],
) -> Outbound<'g> {
    // Host, Upgrade and the hop-by-hop check in one pass over the fields.
    let scan = scan(&parts.headers);
    let original_host = scan.host.cloned();
    let upgrade = scan
        .upgrade
        .and_then(|u| upgrade_requested(&parts.headers, u))
        .filter(|u| upgrade_allowed(u, upgrades));
    let hop_by_hop = scan.hop_by_hop;
    let client_upgrade = upgrade
        .as_ref()
        .and_then(|_| parts.extensions.remove::<ClientUpgrade>());
    if hop_by_hop {
        strip_hop_by_hop_found(&mut parts.headers, &gen.lane.tag_header);
    }
    if let Some(u) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, u.clone());
    }
    // The gateway's own fields replace any the client sent; they are kept
    // apart from the client's map and written after it (no map inserts).
    let mut added = Added::new(
        &mut parts.headers,
        (&gen.lane.tag_header, lane_tag(gen, decision)),
        &gen.id_tag,
        client.peer.ip(),
        client.peer_trusted,
        original_host,
    );
    if client.https {
        added.https();
    }
    // An origin-form target (the usual request) is the node's as it is:
    // taken, not rebuilt (its path is not read after this phase).
    let origin_form = parts.uri.scheme().is_none()
        && parts.uri.authority().is_none()
        && parts.uri.path_and_query().is_some();
    let target = if origin_form {
        std::mem::take(&mut parts.uri)
    } else {
        Uri::from(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        )
    };
    Outbound {
        sent: None,
        idempotent: idempotent(&parts.method),
        method: std::mem::take(&mut parts.method),
        target,
        headers: std::mem::take(&mut parts.headers),
        added,
        upgrade,
        client_upgrade,
        t0,
        deadline: t0 + Duration::from_millis(upstream.total_timeout_ms),
    }
}

/// The OpenTelemetry fields going upstream (`otel:`): the lane as the first
/// member of `baggage` (the client's other well-formed members kept, its
/// own lane member never), and `traceparent` naming the gateway's span,
/// with the caller's `tracestate`. A baggage header with a problem is
/// counted.
fn otel_fields(
    plane: &DataPlane,
    gen: &Generation,
    o: &crate::config::otel::OtelConfig,
    (lane, trace): (&str, Option<&crate::base::trace::TraceCtx>),
    headers: &mut HeaderMap,
) {
    if o.baggage {
        let ready = gen
            .lane_baggage
            .get(lane)
            .filter(|_| !headers.contains_key(BAGGAGE));
        let value = match ready {
            // No baggage from the client: the lane's ready-made value.
            Some(v) => v.clone(),
            None => {
                let (value, problem) = {
                    let parsed = baggage::parse(headers.get_all(BAGGAGE).iter(), &o.baggage_key);
                    (parsed.outbound(&o.baggage_key, lane).0, parsed.problem)
                };
                if let Some(p) = problem {
                    plane
                        .metrics
                        .baggage_problems
                        .with_label_values(&[p.as_str()])
                        .inc();
                }
                value
            }
        };
        headers.insert(BAGGAGE, value);
    }
    if let Some(t) = trace {
        headers.insert(TRACEPARENT, t.traceparent());
        match &t.tracestate {
            Some(ts) => {
                headers.insert(TRACESTATE, ts.clone());
            }
            None => {
                headers.remove(TRACESTATE);
            }
        }
    }
}

/// The body phase (for a request with a body): an idempotent body up to
/// `retry_buffer_bytes` is buffered for replay, a larger one streams. A
/// failing client body is the client's error (400, 408, or 499 when the
/// client went away), never a node's.
async fn buffer_body(
    body: ClientBody,
    idempotent: bool,
    deadline: Instant,
    upstream: &UpstreamConfig,
) -> Result<Replay, Error> {
    match tokio::time::timeout_at(
        deadline.into(),
        Replay::new(body, idempotent, upstream.retry_buffer_bytes),
    )
    .await
    {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(kind)) => Err(kind.into()),
        Err(_) => Err(ErrorKind::ClientBodyTimeout.into()),
    }
}

/// The attempt loop: pick a node not tried yet, send, judge the outcome
/// for health; on a retryable failure with a replayable body, try the next
/// node of the same candidate set.
async fn attempt_all(
    plane: &DataPlane,
    service: &Service,
    (choice, client): (Choice<'_>, &Client),
    (decision, verdict): (&mut Decision, &mut Option<Verdict>),
    out: &mut Outbound<'_>,
    mut replay: Replay,
    upstream: &UpstreamConfig,
) -> Result<Answer<Body>, Error> {
    // The hash key (balance: hash) from the fields going upstream.
    let key = service.request_key(&out.headers, &out.target, client.ip);
    let set = choice.set;
    let policy = &service.health.passive;
    let retries = service.retries.unwrap_or(upstream.retries) as usize;
    let max_attempts = (retries + 1).min(set.nodes.len());
    let read_timeout =
        Duration::from_millis(service.read_timeout_ms.unwrap_or(upstream.read_timeout_ms));
    // No body was buffered: the serve phase's reading (`t0`) is still
    // this first attempt's start.
    let t0_fresh = matches!(replay, Replay::Empty);
    let mut tried = Tried::default();
    let mut last_error = None;
    while tried.len() < max_attempts {
        let Some(idx) = choice.pick(now_ms(), tried.as_slice(), key) else {
            break;
        };
        let Some(up_body) = replay.next_body() else {
            break;
        };
        tried.push(idx);
        let node = &set.nodes[idx];
        let health = &set.health[idx];
        // Attached to the lane at each swap: no shared lookup per attempt.
        let counters = match set.counters.get(idx) {
            Some(c) => c.clone(),
            None => plane.node_stats.get(&service.name, node.addr),
        };
        let tracker = NodeTracker::begin(counters.clone());
        decision.served_lane = Some(node.lane.clone());
        decision.node = Some(node.name.clone());
        decision.attempts = tried.len() as u32;
        // One clock read fewer for the usual single attempt.
        let now = if tried.len() == 1 {
            out.t0
        } else {
            Instant::now()
        };
        if now >= out.deadline {
            return Err(ErrorKind::TotalTimeout.into());
        }
        let per_try = Duration::from_millis(upstream.response_timeout_ms).min(out.deadline - now);
        // The HTTP/1.1 engine checks `per_try` itself at each of its waits
        // (no wrapper future to move, no timer).
        let timeouts = (read_timeout, per_try);
        // The head is borrowed: no request built, no fields cloned or
        // moved per attempt.
        let head = OutHead {
            method: &out.method,
            target: &out.target,
            headers: &out.headers,
            sent: out.sent,
            added: &out.added,
            // The response timeout runs from this attempt's reading (`t0`
            // only when nothing was awaited since it was read).
            start: (tried.len() > 1 || t0_fresh).then_some(now),
            // A plain head's lines are kept as sent (`Fields`).
            keep_lines: true,
            upgrade: out.upgrade.is_some(),
        };
        let peer = Peer {
            addr: node.addr,
            transport: service.transport.as_deref(),
        };
        let outcome = plane.client.send(peer, head, up_body, timeouts).await;
        let e = match outcome {
            Ok(r) => {
                // Judged when the body ends (`record`): a body the node
                // breaks off is its failure too.
                *verdict = Some(Verdict {
                    health: health.clone(),
                    node: node.name.clone(),
                    policy: policy.clone(),
                    failed_status: policy.fail_on_5xx && r.status().is_server_error(),
                    counters,
                    grpc_error_codes: service.grpc_error_codes,
                });
                let client_upgrade = out.client_upgrade.take();
                return respond(plane, r, client_upgrade, out.upgrade.is_some(), tracker);
            }
            Err(e) => e,
        };
        // The client's body failed the exchange (bad framing, gone,
        // stalled): the client's error — no node blamed, no retry.
        if let Some(kind) = replay.client_fault() {
            tracing::debug!(node = %node.name, error = %e, kind = kind.as_str(), "client body failed the upstream exchange");
            return Err(Error::new(kind).with_source(e));
        }
        match e.kind() {
            ErrorKind::Connect => {
                tracing::warn!(node = %node.name, addr = %node.addr, error = %e, "upstream connect failed")
            }
            ErrorKind::ResponseTimeout => {
                tracing::warn!(node = %node.name, addr = %node.addr, "upstream timed out")
            }
            _ => {
                tracing::warn!(node = %node.name, addr = %node.addr, error = %e, "upstream failed")
            }
        }
        if e.node_fault() {
            health.failure(&node.name, policy);
        }
        tracker.fail();
        let retry_ok = e.retryable(out.idempotent);
        last_error = Some(e);
        replay.recover();
        if !retry_ok || !replay.replayable() {
            break;
        }
        if tried.len() < max_attempts {
            tracing::info!(node = %node.name, attempt = tried.len() + 1, "retrying on another node of the same lane");
        }
    }
    Err(last_error.unwrap_or_else(|| ErrorKind::NoNodeAvailable.into()))
}

/// Nodes a request tried so far (indices into the candidate set): the
/// first few inline — no allocation for the usual one or two attempts —,
/// a `Vec` past that.
#[derive(Default)]
struct Tried {
    inline: [usize; TRIED_INLINE],
    len: usize,
    more: Vec<usize>,
}

/// Attempts [`Tried`] holds inline.
const TRIED_INLINE: usize = 4;

impl Tried {
    fn push(&mut self, idx: usize) {
        if self.len < TRIED_INLINE {
            self.inline[self.len] = idx;
        } else {
            if self.len == TRIED_INLINE {
                self.more.extend_from_slice(&self.inline);
            }
            self.more.push(idx);
        }
        self.len += 1;
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_slice(&self) -> &[usize] {
        if self.len <= TRIED_INLINE {
            &self.inline[..self.len]
        } else {
            &self.more
        }
    }
}

/// The respond phase: passes the node's answer back, keeping the node in
/// flight until its body is done; a `101 Switching Protocols` answer to an
/// upgrade request joins the two connections into a tunnel that keeps the
/// node (and so the lane) for the connection's life.
fn respond(
    plane: &DataPlane,
    mut resp: Response<PooledBody>,
    client_upgrade: Option<ClientUpgrade>,
    upgrade_requested: bool,
    tracker: NodeTracker,
) -> Result<Answer<Body>, Error> {
    tracker.count_status(resp.status());
    let switched = upgrade_requested && resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if switched {
        let Some(client_up) = client_upgrade else {
            tracker.count_status(StatusCode::BAD_GATEWAY);
            return Err(ErrorKind::UpgradeUnavailable.into());
        };
        let Some(client_up) = client_up.take() else {
            tracker.count_status(StatusCode::BAD_GATEWAY);
            return Err(ErrorKind::UpgradeUnavailable.into());
        };
        let upstream_up = crate::upstream::take_upgrade(&mut resp);
        // Counted from now, while the client connection is still counted
        // too, so a drain never sees a gap between the two.
        let guard = Counted::new(plane.tunnels.clone());
        tokio::spawn(async move {
            let _guard = guard;
            let (Some(mut c), Some(mut u)) = tokio::join!(client_up, upstream_up) else {
                tracing::debug!("upgrade handshake did not complete");
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
        });
    }
    let (mut head, mut body) = resp.into_parts();
    // The node's plain head: its lines as it sent them (hop-by-hop lines
    // left out already); else the map — whole for a 101, whose Upgrade and
    // Connection say what was agreed.
    let raw = body.take_lines();
    if raw.is_none() && !switched {
        strip_hop_by_hop(&mut head.headers);
    }
    // One box for the upstream body and the node's in-flight marker.
    Ok(Answer {
        status: head.status,
        fields: Fields::new(raw, head.headers),
        extensions: head.extensions,
        body: boxed(body.tracked(tracker)),
    })
}

/// Is every protocol of an `Upgrade` value (`name[/version]`, comma
/// separated) in the route's allow-list? Others — `h2c` above all, the
/// known smuggling tunnel — are not upgraded: the request goes on as a
/// plain one, its `Upgrade`/`Connection` tokens removed.
fn upgrade_allowed(value: &HeaderValue, allowed: &[String]) -> bool {
    let Ok(v) = value.to_str() else {
        return false;
    };
    let mut protocols = v
        .split(',')
        .map(|p| p.trim().split('/').next().unwrap_or(""));
    protocols.all(|p| !p.is_empty() && allowed.iter().any(|a| a.eq_ignore_ascii_case(p)))
}

/// The `Upgrade` value `upgrade` (the first), if a `Connection` field
/// names `upgrade` too.
fn upgrade_requested(h: &HeaderMap, upgrade: &HeaderValue) -> Option<HeaderValue> {
    // Usually no Upgrade field at all (the caller's scan): no Connection
    // lookup then.
    let conn_upgrade = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    conn_upgrade.then(|| upgrade.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Tried` keeps every pushed index in order, inline and past it.
    #[test]
    fn tried_keeps_every_index_in_order() {
        let mut t = Tried::default();
        let mut want = Vec::new();
        assert!(t.as_slice().is_empty());
        for i in 0..TRIED_INLINE * 3 {
            let idx = i * 7 % 5 + i;
            t.push(idx);
            want.push(idx);
            assert_eq!(t.len(), want.len());
            assert_eq!(t.as_slice(), &want[..], "after {} pushes", i + 1);
        }
    }
}
