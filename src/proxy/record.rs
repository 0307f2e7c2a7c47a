//! Layer: proxy — the last phase of every request. At the response head the
//! optional lane header is added ([`respond`]); the request is *recorded*
//! when its response body ends, fails or is dropped ([`Recorded`]): the
//! passive-health verdict on the node, metrics, the access log — so a body
//! the node cuts off, a stalled node, or a client that goes away shows with
//! its real outcome, and only a node's own failure counts against it.
//!
//! A node's gRPC answer (HTTP 200, `application/grpc…`) is judged by its
//! `grpc-status`, read from the head (trailers-only) or the trailers: a
//! status the service counts (`grpc_error_codes`) is the node's error,
//! recorded as its HTTP equivalent (`base::grpc::recorded_status`). One the
//! node breaks off after its head ends with the gateway's status in
//! trailers (UNAVAILABLE), never a bare stream reset.
//!
//! Any answer whose body the node breaks off after its head (EOF, reset, a
//! stalled read) is likewise recorded as the gateway's status for that
//! failure (502 `upstream_body`, 504 `upstream_body_timeout`) in metrics,
//! the lane counters and the access log, while the client keeps the head
//! it already got: a node that truncates its answers is a failing node to
//! everything that judges it. The access log adds the status the client
//! was sent (`sent_status`) where it differs.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::StatusCode;
use hyper::body::{Body as _, Frame, SizeHint};

use super::answer::Answer;
use super::ctx::RequestCtx;
use super::DataPlane;
use crate::base::body::{Body, BoxError};
use crate::base::error::{Error, ErrorKind, Side};
use crate::base::grpc;
use crate::config::grpc::{GrpcErrorCodes, UNKNOWN};
use crate::generation::Generation;
use crate::observe::access_log::Entry;
use crate::observe::metrics::Observation;

/// A request's context and what is left to do once its body is done —
/// boxed when the request begins, so the context is written once and never
/// moved again (it is large: each move would be a copy of all of it).
pub struct Pending {
    plane: Arc<DataPlane>,
    gen: Arc<Generation>,
    ctx: RequestCtx,
    /// The status recorded: the head's, unless the node's answer failed
    /// after it ([`Pending::finish`]).
    status: u16,
    /// The status the client's head said.
    sent: u16,
    /// The node's answer is gRPC: its status decides the outcome.
    grpc: Option<GrpcAnswer>,
}

/// A node's gRPC answer: the codes its service counts as errors, and the
/// `grpc-status` seen so far (head or trailers).
#[derive(Clone, Copy)]
struct GrpcAnswer {
    counted: GrpcErrorCodes,
    status: Option<u8>,
    /// gRPC-Web: only a trailers-only head's status is read (the others
    /// are inside the body).
    web: bool,
}

impl GrpcAnswer {
    /// The answer ended as its node sent it: an error if its status is
    /// counted. None at all reads as UNKNOWN, as gRPC clients read it —
    /// but for gRPC-Web, whose status may be in the body.
    fn outcome(self) -> Result<(), ErrorKind> {
        let code = match (self.status, self.web) {
            (Some(c), _) => c,
            (None, false) => UNKNOWN,
            (None, true) => return Ok(()),
        };
        if self.counted.counts(code) {
            Err(ErrorKind::Grpc(code))
        } else {
            Ok(())
        }
    }
}

impl Pending {
    /// The box is allocated before the context is built (`ctx`), so the
    /// context is written into it in place.
    pub fn new(
        plane: Arc<DataPlane>,
        gen: Arc<Generation>,
        ctx: impl FnOnce() -> RequestCtx,
    ) -> Box<Pending> {
        let slot = Box::new_uninit();
        Box::write(
            slot,
            Pending {
                plane,
                gen,
                ctx: ctx(),
                status: 0,
                sent: 0,
                grpc: None,
            },
        )
    }

    /// The data plane and generation serving the request, and its context.
    pub fn parts_mut(&mut self) -> (&DataPlane, &Generation, &mut RequestCtx) {
        (&self.plane, &self.gen, &mut self.ctx)
    }
}

/// A response body that records its request when it ends. (What is left
/// to do is boxed: the body moves several times on its way into hyper.)
pub struct Recorded {
    inner: Body,
    pending: Option<Box<Pending>>,
    /// The status trailers that replaced a broken gRPC answer's rest went
    /// out: nothing more.
    ended: bool,
}

/// The response head's last touches (the lane response header), and the
/// body that will record the request at its end.
pub fn respond(mut pending: Box<Pending>, mut resp: Answer<Body>) -> Answer<Recorded> {
    let p = &mut *pending;
    if let Some(h) = &p.gen.config.lane_response_header {
        let lane = p
            .ctx
            .decision
            .as_ref()
            .map(|d| HeaderValue::from_str(&d.lane));
        if let Some(Ok(v)) = lane {
            resp.fields.insert(h.0.clone(), v);
        }
    }
    p.status = resp.status.as_u16();
    p.sent = p.status;
    // Only a node's answer (the gateway's own errors are recorded by their
    // HTTP status).
    let content_type = resp.fields.content_type();
    p.grpc = match &p.ctx.verdict {
        Some(v) if resp.status == StatusCode::OK && grpc::is_grpc_type(content_type) => {
            Some(GrpcAnswer {
                counted: v.grpc_error_codes,
                status: grpc::status_value(resp.fields.get(&grpc::GRPC_STATUS)),
                web: grpc::is_grpc_web_type(content_type),
            })
        }
        _ => None,
    };
    resp.map_body(|inner| Recorded {
        inner,
        pending: Some(pending),
        ended: false,
    })
}

impl Recorded {
    /// A body that records nothing (an answer of the gateway's own
    /// services: the admin API, the demo nodes).
    pub fn unrecorded(inner: Body) -> Recorded {
        Recorded {
            inner,
            pending: None,
            ended: false,
        }
    }

    /// Replaces what the client is sent, under a head saying `sent` (the
    /// record stays: e.g. a gateway error reshaped for gRPC is still
    /// recorded with its own status).
    pub fn set_inner(&mut self, inner: Body, sent: StatusCode) {
        self.inner = inner;
        if let Some(p) = &mut self.pending {
            p.sent = sent.as_u16();
        }
    }

    /// The whole body went out by another way than polling it (the HTTP/1.1
    /// server's `sendfile`): records the request as served.
    pub fn sent_whole(&mut self) {
        self.record(Ok(()));
    }

    fn record(&mut self, outcome: Result<(), ErrorKind>) {
        if let Some(mut p) = self.pending.take() {
            p.finish(outcome);
        }
    }

    /// Trailers passing through: a gRPC answer's status.
    fn trailers(&mut self, t: &HeaderMap) {
        let answer = self.pending.as_mut().and_then(|p| p.grpc.as_mut());
        if let (Some(a), Some(code)) = (answer, grpc::status_of(t)) {
            a.status = Some(code);
        }
    }
}

impl hyper::body::Body for Recorded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(None) => this.record(Ok(())),
            Poll::Ready(Some(Ok(f))) => {
                if let Some(t) = f.trailers_ref() {
                    this.trailers(t);
                }
                if this.inner.is_end_stream() {
                    this.record(Ok(()));
                }
            }
            Poll::Ready(Some(Err(e))) => {
                let kind = e
                    .downcast_ref::<Error>()
                    .map_or(ErrorKind::UpstreamBody, Error::kind);
                tracing::warn!(error = %e, "response body failed");
                let grpc = this
                    .pending
                    .as_ref()
                    .and_then(|p| p.grpc)
                    .is_some_and(|a| !a.web);
                this.record(Err(kind));
                if grpc {
                    // The head went out as a gRPC answer: its client is
                    // told why in the status trailers (UNAVAILABLE for a
                    // node that went away or stalled) instead of a reset
                    // stream it can only report as INTERNAL.
                    this.ended = true;
                    let fields = grpc::status_fields(kind.status());
                    return Poll::Ready(Some(Ok(Frame::trailers(fields))));
                }
            }
            Poll::Pending => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let Some(p) = &self.pending else { return };
        // Nothing is sent for these: not an abort.
        let s = p.status;
        let bodiless = p.ctx.head_request
            || s < 200
            || s == StatusCode::NO_CONTENT.as_u16()
            || s == StatusCode::NOT_MODIFIED.as_u16();
        let outcome = if bodiless || self.inner.is_end_stream() {
            Ok(())
        } else {
            Err(ErrorKind::ClientAbort)
        };
        self.record(outcome);
    }
}

impl Pending {
    /// Records the finished request: the node verdict, metrics, the access
    /// log (and a debug line).
    fn finish(&mut self, outcome: Result<(), ErrorKind>) {
        let ctx = &mut self.ctx;
        // A gRPC answer that ended as its node sent it: its status says.
        let outcome = match (outcome, self.grpc) {
            (Ok(()), Some(answer)) => answer.outcome(),
            (o, _) => o,
        };
        // A failure while the client's own body was failing is the
        // client's, whatever broke first on the upstream side.
        let outcome = match (outcome, ctx.client_fault.as_ref().and_then(|f| f.kind())) {
            (Err(_), Some(client)) => Err(client),
            (o, _) => o,
        };
        // The node's failure after its head (a body it broke off or
        // stalled, a gRPC answer's counted status) is recorded as its HTTP
        // equivalent whatever the head said: counted with the 5xx answers
        // everywhere (metrics, lane counters, access log). A 5xx head
        // already counts so and keeps the node's own status.
        if let Err(kind) = outcome {
            if kind.side() == Side::Upstream && self.status < 500 {
                self.status = kind.status().as_u16();
            }
        }
        let error = match outcome {
            Ok(()) => ctx.error,
            Err(kind) => Some(ctx.error.unwrap_or(kind)),
        };
        // The node is judged on what it did: a body it broke off is its
        // failure; a client that went away says nothing about it.
        if let Some(v) = ctx.verdict.take() {
            match outcome {
                Ok(()) => v.give(true),
                Err(ErrorKind::Grpc(_)) => v.give_grpc_error(),
                Err(kind) if kind.side() == Side::Upstream => v.give(false),
                Err(_) => {}
            }
        }
        let now = Instant::now();
        let total = now.saturating_duration_since(ctx.start);
        let served = ctx
            .serve_start
            .map_or(total, |s| now.saturating_duration_since(s));
        let upstream = ctx.upstream_time();
        let status = self.status;
        let decision = ctx.decision.as_ref();
        if let Some(d) = decision {
            tracing::debug!(
                generation = self.gen.id,
                lane = %d.lane,
                decided_by = d.decided_by.as_str(),
                node = d.node.as_deref().unwrap_or("-"),
                fallback = d.fallback.unwrap_or("-"),
                status,
                error = error.map_or("-", ErrorKind::as_str),
                "request"
            );
        }
        let plane = &self.plane;
        plane.metrics.observe(&Observation {
            decision,
            rule: decision.and_then(|d| d.decided_by.rule_name()),
            status,
            total,
            served,
            upstream,
            error,
        });
        if let Some((method, path)) = ctx.log_head.take() {
            plane.access_log.log(Entry {
                time: Entry::now_string(),
                client_ip: ctx.client.ip,
                method,
                path,
                status,
                sent_status: (self.sent != status).then_some(self.sent),
                lane: decision.map_or("-", |d| d.lane.as_str()).to_string(),
                decided_by: decision.map_or("-", |d| d.decided_by.as_str()).to_string(),
                rule: decision
                    .and_then(|d| d.decided_by.rule_name())
                    .map(str::to_string),
                node: decision
                    .and_then(|d| d.node.as_deref())
                    .unwrap_or("-")
                    .to_string(),
                upstream_ms: upstream.map(Entry::ms),
                total_ms: Entry::ms(total),
                error: error.map(ErrorKind::as_str),
                trace_id: ctx.trace.as_ref().map(|t| t.ctx.trace_id_hex()),
                span_id: ctx.trace.as_ref().map(|t| t.ctx.span_id_hex()),
            });
        }
        if let Some(t) = ctx.trace.take().filter(|t| t.export) {
            plane.spans.send(span(*t, decision, status, error, total));
        }
    }
}

/// The request's span: named `METHOD route` (OpenTelemetry's HTTP server
/// span name), with the lane, what decided it, the rule, route, service,
/// node, status and retries as attributes.
fn span(
    t: super::ctx::Traced,
    decision: Option<&crate::base::decision::Decision>,
    status: u16,
    error: Option<ErrorKind>,
    total: std::time::Duration,
) -> crate::observe::otel::FinishedSpan {
    use opentelemetry::KeyValue;
    let route = decision.and_then(|d| d.route.as_deref());
    let mut a = vec![
        KeyValue::new("http.request.method", t.method.to_string()),
        KeyValue::new("http.response.status_code", i64::from(status)),
    ];
    if let Some(p) = t.path {
        a.push(KeyValue::new("url.path", p));
    }
    if let Some(r) = route {
        a.push(KeyValue::new("http.route", r.to_string()));
    }
    if let Some(d) = decision {
        a.push(KeyValue::new("graygate.lane", d.lane.to_string()));
        a.push(KeyValue::new("graygate.decided_by", d.decided_by.as_str()));
        if let Some(r) = d.decided_by.rule_name() {
            a.push(KeyValue::new("graygate.rule", r.to_string()));
        }
        if let Some(s) = &d.service {
            a.push(KeyValue::new("graygate.service", s.to_string()));
        }
        if let Some(n) = &d.node {
            a.push(KeyValue::new("graygate.node", n.to_string()));
        }
        if let Some(l) = &d.served_lane {
            a.push(KeyValue::new("graygate.served_lane", l.to_string()));
        }
        if let Some(f) = d.fallback {
            a.push(KeyValue::new("graygate.fallback", f));
        }
        if d.attempts > 0 {
            a.push(KeyValue::new("graygate.retries", i64::from(d.attempts - 1)));
            if error.is_none() {
                a.push(KeyValue::new("graygate.upstream_status", i64::from(status)));
            }
        }
    }
    if let Some(e) = error {
        a.push(KeyValue::new("graygate.error", e.as_str()));
    }
    let name = match route {
        Some(r) => format!("{} {r}", t.method),
        None => t.method.to_string(),
    };
    crate::observe::otel::FinishedSpan {
        trace_id: t.ctx.trace_id,
        span_id: t.ctx.span_id,
        parent: t.ctx.parent_span_id,
        name,
        start: t.start,
        end: t.start + total,
        attributes: a,
        error: status >= 500 || error.is_some_and(|e| e.side() != Side::Client),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_answer_s_outcome_is_its_counted_status() {
        let answer = |status, web| GrpcAnswer {
            counted: GrpcErrorCodes::default(),
            status,
            web,
        };
        assert_eq!(answer(Some(0), false).outcome(), Ok(()));
        assert_eq!(answer(Some(5), false).outcome(), Ok(()), "NOT_FOUND");
        assert_eq!(answer(Some(14), false).outcome(), Err(ErrorKind::Grpc(14)));
        // No status at all: UNKNOWN; gRPC-Web keeps its own in the body.
        assert_eq!(answer(None, false).outcome(), Err(ErrorKind::Grpc(2)));
        assert_eq!(answer(None, true).outcome(), Ok(()));
        assert_eq!(answer(Some(13), true).outcome(), Err(ErrorKind::Grpc(13)));
        let picky = GrpcAnswer {
            counted: GrpcErrorCodes::of(&[5]),
            status: Some(14),
            web: false,
        };
        assert_eq!(picky.outcome(), Ok(()));
        assert_eq!(ErrorKind::Grpc(14).as_str(), "grpc_unavailable");
        assert_eq!(
            Error::new(ErrorKind::Grpc(4)).status(),
            StatusCode::GATEWAY_TIMEOUT
        );
    }
}
