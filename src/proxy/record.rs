//! Layer: proxy — the last phase of every request: metrics, the access log and
//! the optional lane response header, all read from the context's `Decision`,
//! status and timings.

use http::header::HeaderValue;
use http::Response;

use super::ctx::RequestCtx;
use super::DataPlane;
use crate::base::body::Body;
use crate::generation::Generation;
use crate::observe::access_log::Entry;
use crate::observe::metrics::Observation;

/// Records the request and returns its response (with the lane header
/// when configured).
pub fn finish(
    plane: &DataPlane,
    gen: &Generation,
    ctx: &mut RequestCtx,
    mut resp: Response<Body>,
) -> Response<Body> {
    let total = ctx.total();
    let upstream = ctx.upstream_time();
    let status = resp.status().as_u16();
    let decision = ctx.decision.as_ref();
    if let Some(d) = decision {
        tracing::debug!(
            generation = gen.id,
            lane = %d.lane,
            decided_by = d.decided_by.as_str(),
            node = d.node.as_deref().unwrap_or("-"),
            fallback = d.fallback.unwrap_or("-"),
            status,
            "request"
        );
    }
    plane.metrics.observe(&Observation {
        decision,
        rule: decision.and_then(|d| d.decided_by.rule_name()),
        status,
        total,
        upstream,
    });
    if let Some((method, path)) = ctx.log_head.take() {
        plane.access_log.log(Entry {
            time: Entry::now_string(),
            client_ip: ctx.client.ip,
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
            upstream_ms: upstream.map(Entry::ms),
            total_ms: Entry::ms(total),
        });
    }
    if let (Some(h), Some(d)) = (&gen.config.lane_response_header, decision) {
        if let Ok(v) = HeaderValue::from_str(&d.lane) {
            resp.headers_mut().insert(h.0.clone(), v);
        }
    }
    resp
}
