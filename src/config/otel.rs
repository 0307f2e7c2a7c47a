//! Layer: config. The `otel:` section: the lane in W3C baggage, W3C trace
//! context, and the gateway's spans over OTLP/HTTP. Absent: none of it (the
//! request path does not look at `baggage` or `traceparent`).

use std::collections::BTreeMap;

use serde::Deserialize;

/// OpenTelemetry context: baggage, trace context, span export.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OtelConfig {
    /// Write the decided lane into the upstream `baggage` header (and read
    /// it from trusted peers). `false` leaves `baggage` untouched.
    pub baggage: bool,
    /// The baggage member naming the lane.
    pub baggage_key: String,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Span export (absent: the gateway continues or starts traces and logs
    /// their ids, but exports no span).
    pub traces: Option<TracesConfig>,
}

impl Default for OtelConfig {
    fn default() -> Self {
        OtelConfig {
            baggage: true,
            baggage_key: "graygate.lane".into(),
            service_name: "graygate".into(),
            traces: None,
        }
    }
}

/// Where and how spans are exported (OTLP over HTTP, protobuf).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracesConfig {
    /// The collector's OTLP/HTTP traces URL (`http://host:4318/v1/traces`).
    pub endpoint: String,
    /// The share of new traces sampled (0.0–1.0), by trace id.
    pub sample_ratio: f64,
    /// An inbound `traceparent` decides: sampled when the caller sampled.
    pub parent_based: bool,
    /// Spans waiting for export at most; more are dropped and counted.
    pub queue_size: usize,
    /// Spans per export request at most.
    pub batch_size: usize,
    /// Export at least this often while spans wait.
    pub flush_interval_ms: u64,
    /// One export request's time limit.
    pub timeout_ms: u64,
    /// Extra fields of every export request (e.g. `Authorization`).
    pub headers: BTreeMap<String, String>,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            endpoint: String::new(),
            sample_ratio: 1.0,
            parent_based: true,
            queue_size: 2048,
            batch_size: 512,
            flush_interval_ms: 5000,
            timeout_ms: 10_000,
            headers: BTreeMap::new(),
        }
    }
}

/// A W3C baggage key: an RFC 9110 token.
pub fn valid_baggage_key(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(is_tchar)
}

/// An RFC 9110 `tchar`.
pub fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

impl OtelConfig {
    /// The first problem, as (key, message) in the operator's words.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !valid_baggage_key(&self.baggage_key) {
            return Err((
                "baggage_key",
                format!(
                    "otel.baggage_key {:?} is not a baggage key (letters, digits and !#$%&'*+-.^_`|~ only)",
                    self.baggage_key
                ),
            ));
        }
        if self.service_name.trim().is_empty() {
            return Err(("service_name", "otel.service_name must not be empty".into()));
        }
        let Some(t) = &self.traces else {
            return Ok(());
        };
        let uri: http::Uri = t.endpoint.parse().map_err(|_| {
            (
                "endpoint",
                format!(
                    "otel.traces.endpoint {:?} is not a URL (e.g. http://127.0.0.1:4318/v1/traces)",
                    t.endpoint
                ),
            )
        })?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err((
                "endpoint",
                format!(
                    "otel.traces.endpoint {:?}: give an http:// URL with a host (OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces; for TLS, export to a local collector)",
                    t.endpoint
                ),
            ));
        }
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            return Err((
                "sample_ratio",
                format!(
                    "otel.traces.sample_ratio {} must be between 0.0 and 1.0",
                    t.sample_ratio
                ),
            ));
        }
        if t.queue_size == 0 || t.batch_size == 0 {
            return Err((
                "queue_size",
                "otel.traces.queue_size and batch_size must be at least 1".into(),
            ));
        }
        if t.flush_interval_ms == 0 || t.timeout_ms == 0 {
            return Err((
                "flush_interval_ms",
                "otel.traces.flush_interval_ms and timeout_ms must be at least 1".into(),
            ));
        }
        for (k, v) in &t.headers {
            if http::HeaderName::from_bytes(k.as_bytes()).is_err()
                || http::HeaderValue::from_str(v).is_err()
            {
                return Err((
                    "headers",
                    format!("otel.traces.headers: {k:?} is not a valid header field"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(yaml: &str) -> OtelConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_and_the_documented_interface() {
        let c = parsed(
            "baggage_key: graygate.lane\nservice_name: graygate-edge\ntraces:\n  endpoint: http://127.0.0.1:4318/v1/traces\n  sample_ratio: 1.0\n",
        );
        assert!(c.baggage);
        assert_eq!(c.service_name, "graygate-edge");
        let t = c.traces.as_ref().unwrap();
        assert_eq!(
            (t.queue_size, t.batch_size, t.parent_based),
            (2048, 512, true)
        );
        assert_eq!(c.check(), Ok(()));
        assert!(!parsed("baggage: false").baggage);
        assert_eq!(parsed("{}"), OtelConfig::default());
    }

    #[test]
    fn bad_values_are_named() {
        let bad = |y: &str| parsed(y).check().unwrap_err();
        assert_eq!(bad("baggage_key: 'a b'").0, "baggage_key");
        assert_eq!(
            bad("traces: {endpoint: 'https://c:4318/v1/traces'}").0,
            "endpoint"
        );
        assert_eq!(bad("traces: {endpoint: 'nope'}").0, "endpoint");
        assert_eq!(
            bad("traces: {endpoint: 'http://c:4318/v1/traces', sample_ratio: 1.5}").0,
            "sample_ratio"
        );
        assert_eq!(
            bad("traces: {endpoint: 'http://c:4318/v1/traces', queue_size: 0}").0,
            "queue_size"
        );
        assert!(
            bad("traces: {endpoint: 'http://c/v1/traces', headers: {'a b': x}}")
                .1
                .contains("a b")
        );
    }
}
