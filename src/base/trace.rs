//! Layer: base. W3C Trace Context for one request: the inbound
//! `traceparent` continued (from any peer: trace ids are never trusted for
//! routing) or a new trace started, the gateway's own span id, the sampling
//! decision (parent-based, else by trace id ratio as OpenTelemetry's
//! `TraceIdRatioBased`), and the `traceparent` forwarded upstream with the
//! gateway's span as the parent.

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::config::otel::OtelConfig;

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// How new traces are sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// The share of traces sampled, by trace id (0.0–1.0).
    pub ratio: f64,
    /// An inbound parent's sampled flag decides.
    pub parent_based: bool,
}

impl Sampler {
    /// The sampler `otel:` configures: `traces:`'s, else every new trace
    /// (no span leaves the gateway then; the ids reach logs and nodes).
    pub fn of(o: &OtelConfig) -> Sampler {
        match &o.traces {
            Some(t) => Sampler {
                ratio: t.sample_ratio,
                parent_based: t.parent_based,
            },
            None => Sampler {
                ratio: 1.0,
                parent_based: true,
            },
        }
    }

    /// Whether a trace is sampled: the caller's flags (`parent_flags`, a
    /// continued trace) decide when parent-based, else the trace id.
    pub fn sampled(self, trace_id: &[u8; 16], parent_flags: Option<u8>) -> bool {
        match parent_flags {
            Some(flags) if self.parent_based => flags & 1 == 1,
            _ => ratio_sampled(trace_id, self.ratio),
        }
    }
}

/// One request's trace context.
#[derive(Debug, Clone)]
pub struct TraceCtx {
    pub trace_id: [u8; 16],
    /// The gateway's span.
    pub span_id: [u8; 8],
    /// The caller's span, when the request came with a valid `traceparent`.
    pub parent_span_id: Option<[u8; 8]>,
    pub sampled: bool,
    /// The caller's `tracestate`, forwarded as it came.
    pub tracestate: Option<HeaderValue>,
}

/// `version-traceid-parentid-flags` of a valid `traceparent`.
pub fn parse_traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    // Version 00 is exactly 55 bytes; a later version may add fields
    // after a dash, which are ignored.
    if v.len() < 55 || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    let version = hex_byte(&v[0..2])?;
    if version == 0xff || (version == 0 && v.len() != 55) {
        return None;
    }
    if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let mut trace = [0u8; 16];
    for (i, b) in trace.iter_mut().enumerate() {
        *b = hex_byte(&v[3 + 2 * i..5 + 2 * i])?;
    }
    let mut span = [0u8; 8];
    for (i, b) in span.iter_mut().enumerate() {
        *b = hex_byte(&v[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&v[53..55])?;
    if trace == [0; 16] || span == [0; 8] {
        return None;
    }
    Some((trace, span, flags))
}

/// Two lower-case hex digits.
fn hex_byte(d: &[u8]) -> Option<u8> {
    let n = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(n(d[0])? << 4 | n(d[1])?)
}

fn nonzero<const N: usize>() -> [u8; N] {
    loop {
        let mut b = [0u8; N];
        fastrand::fill(&mut b);
        if b != [0; N] {
            return b;
        }
    }
}

/// Lower-case hex of `b` into `out` (twice as long).
fn hex_into(b: &[u8], out: &mut [u8]) {
    const D: &[u8; 16] = b"0123456789abcdef";
    for (x, o) in b.iter().zip(out.chunks_exact_mut(2)) {
        o[0] = D[(x >> 4) as usize];
        o[1] = D[(x & 15) as usize];
    }
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    let mut out = vec![0u8; b.len() * 2];
    hex_into(b, &mut out);
    String::from_utf8(out).expect("hex digits are text")
}

/// Sampled by trace id, as OpenTelemetry's `TraceIdRatioBased`: the trace
/// id's lower 8 bytes (shifted right by one) below ratio × 2⁶³.
pub fn ratio_sampled(trace_id: &[u8; 16], ratio: f64) -> bool {
    let bound = (ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64;
    let low = u64::from_be_bytes(trace_id[8..16].try_into().expect("8 bytes")) >> 1;
    low < bound
}

impl TraceCtx {
    /// Continues the request's trace (one valid `traceparent`) or starts
    /// one.
    pub fn begin(headers: &HeaderMap, sampler: Sampler) -> TraceCtx {
        let mut fields = headers.get_all(TRACEPARENT).iter();
        let parent = match (fields.next(), fields.next()) {
            (Some(v), None) => parse_traceparent(v.as_bytes()),
            _ => None,
        };
        match parent {
            Some((trace_id, parent, flags)) => TraceCtx {
                sampled: sampler.sampled(&trace_id, Some(flags)),
                trace_id,
                span_id: nonzero(),
                parent_span_id: Some(parent),
                tracestate: tracestate(headers),
            },
            None => {
                let trace_id = nonzero();
                TraceCtx {
                    sampled: sampler.sampled(&trace_id, None),
                    trace_id,
                    span_id: nonzero(),
                    parent_span_id: None,
                    tracestate: None,
                }
            }
        }
    }

    /// The `traceparent` sent upstream: this trace, the gateway's span.
    pub fn traceparent(&self) -> HeaderValue {
        let mut b = [0u8; 55];
        b[..3].copy_from_slice(b"00-");
        hex_into(&self.trace_id, &mut b[3..35]);
        b[35] = b'-';
        hex_into(&self.span_id, &mut b[36..52]);
        b[52..].copy_from_slice(if self.sampled { b"-01" } else { b"-00" });
        HeaderValue::from_bytes(&b).expect("hex is a header value")
    }

    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    pub fn span_id_hex(&self) -> String {
        hex(&self.span_id)
    }
}

/// The caller's `tracestate` fields as one value (dropped when over 8 KiB).
fn tracestate(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut fields = headers.get_all(TRACESTATE).iter();
    let first = fields.next()?;
    let rest: Vec<&HeaderValue> = fields.collect();
    if rest.is_empty() {
        return (first.len() <= 8192).then(|| first.clone());
    }
    let mut joined = first.as_bytes().to_vec();
    for f in rest {
        joined.push(b',');
        joined.extend_from_slice(f.as_bytes());
    }
    (joined.len() <= 8192)
        .then(|| HeaderValue::from_bytes(&joined).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in fields {
            h.append(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    const ALL: Sampler = Sampler {
        ratio: 1.0,
        parent_based: true,
    };

    #[test]
    fn a_valid_traceparent_is_continued_with_a_new_span() {
        let h = headers(&[("traceparent", TP), ("tracestate", "congo=t61rcWkgMzE")]);
        let t = TraceCtx::begin(&h, ALL);
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&t.parent_span_id.unwrap()), "00f067aa0ba902b7");
        assert_ne!(t.span_id_hex(), "00f067aa0ba902b7");
        assert!(t.sampled);
        assert_eq!(t.tracestate.as_ref().unwrap(), "congo=t61rcWkgMzE");
        let up = t.traceparent();
        let up = up.to_str().unwrap();
        assert!(
            up.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{up}"
        );
        assert!(up.ends_with(&format!("{}-01", t.span_id_hex())), "{up}");
        // Parent-based: the caller's "not sampled" is kept, whatever the ratio.
        let h = headers(&[("traceparent", &TP.replace("-01", "-00"))]);
        assert!(!TraceCtx::begin(&h, ALL).sampled);
        assert!(
            TraceCtx::begin(
                &h,
                Sampler {
                    ratio: 1.0,
                    parent_based: false
                }
            )
            .sampled
        );
        // A later version with more fields is read; its extra fields are not.
        let later = format!("cc{}-what-ever", &TP[2..]);
        assert!(parse_traceparent(later.as_bytes()).is_some());
    }

    #[test]
    fn an_invalid_traceparent_starts_a_new_trace_and_drops_tracestate() {
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ] {
            let h = headers(&[("traceparent", bad), ("tracestate", "a=b")]);
            let t = TraceCtx::begin(&h, ALL);
            assert!(t.parent_span_id.is_none(), "{bad}");
            assert!(t.tracestate.is_none(), "{bad}");
            assert_ne!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        }
        // Two traceparent fields: which one is meant is unknown.
        let h = headers(&[("traceparent", TP), ("traceparent", TP)]);
        assert!(TraceCtx::begin(&h, ALL).parent_span_id.is_none());
    }

    #[test]
    fn new_traces_are_sampled_by_ratio_of_the_trace_id() {
        let none = Sampler {
            ratio: 0.0,
            parent_based: true,
        };
        let h = HeaderMap::new();
        assert!((0..200).all(|_| !TraceCtx::begin(&h, none).sampled));
        assert!((0..200).all(|_| TraceCtx::begin(&h, ALL).sampled));
        let half = Sampler {
            ratio: 0.5,
            parent_based: true,
        };
        let n = (0..4000)
            .filter(|_| TraceCtx::begin(&h, half).sampled)
            .count();
        assert!((1700..2300).contains(&n), "{n} of 4000 at 0.5");
        // The same trace id always gets the same answer (every hop agrees).
        let mut id = [0u8; 16];
        id[8] = 0x7f;
        assert!(ratio_sampled(&id, 0.5));
        id[8] = 0x81;
        assert!(!ratio_sampled(&id, 0.5));
    }
}
