//! Layer: observe (uses base, config). The gateway's spans over OTLP/HTTP
//! (protobuf), with the OpenTelemetry crates: `opentelemetry-otlp`'s span
//! exporter (through hyper) fed by a dedicated thread. A request hands its
//! finished span over a bounded channel and never waits: when the queue is
//! full the span is dropped and counted (`graygate_otel_spans_total
//! {outcome="dropped"}`), as the access log does with its lines. The thread
//! sends a batch when it is full (`batch_size`) or every
//! `flush_interval_ms`; a failed export is counted (`outcome="failed"`) and
//! logged (rate-limited), never retried into a growing queue.
//!
//! The exporter outlives generations: a reload that keeps `otel:` as it was
//! keeps it; one that changes it starts a new one, and the old thread sends
//! what it holds and ends.

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwapOption;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use prometheus::IntCounterVec;

use crate::base::ratelog::log_limited;
use crate::config::otel::{OtelConfig, TracesConfig};

/// One request's span, as the request path hands it over.
#[derive(Debug)]
pub struct FinishedSpan {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// The caller's span (a remote parent), if the request continued a trace.
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<KeyValue>,
    /// The request failed (5xx or a gateway error): span status ERROR.
    pub error: bool,
}

/// What a running exporter was started for, and the way to it.
struct Sink {
    tx: SyncSender<FinishedSpan>,
    started_for: (TracesConfig, String),
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The request side: off, or a bounded queue to the exporter thread.
pub struct Spans {
    sink: ArcSwapOption<Sink>,
    /// `graygate_otel_spans_total` by outcome: exported, dropped, failed.
    counts: IntCounterVec,
}

static EXPORT_LOG: AtomicU64 = AtomicU64::new(0);

impl Spans {
    pub fn new(counts: IntCounterVec) -> Spans {
        Spans {
            sink: ArcSwapOption::empty(),
            counts,
        }
    }

    /// Starts, keeps or stops the exporter for the serving configuration.
    pub fn configure(&self, otel: Option<&OtelConfig>) {
        let wanted = otel.and_then(|o| Some((o.traces.clone()?, o.service_name.clone())));
        let current = self.sink.load();
        if current.as_ref().map(|s| &s.started_for) == wanted.as_ref() {
            return;
        }
        let next = wanted.map(|(traces, service)| Arc::new(self.start(traces, service)));
        let old = self.sink.swap(next);
        // The old thread sends what it holds once its queue closes.
        drop(old);
    }

    fn start(&self, traces: TracesConfig, service: String) -> Sink {
        let (tx, rx) = sync_channel(traces.queue_size);
        let counts = self.counts.clone();
        let (cfg, name) = (traces.clone(), service.clone());
        let thread = std::thread::Builder::new()
            .name("graygate-otlp".into())
            .spawn(move || run(rx, &cfg, &name, &counts))
            .ok();
        Sink {
            tx,
            started_for: (traces, service),
            thread: Mutex::new(thread),
        }
    }

    /// Spans are exported (an endpoint is configured).
    pub fn enabled(&self) -> bool {
        self.sink.load().is_some()
    }

    /// Hands a span over without waiting (dropped and counted when the
    /// queue is full).
    pub fn send(&self, span: FinishedSpan) {
        let sink = self.sink.load();
        let Some(sink) = sink.as_ref() else {
            return;
        };
        match sink.tx.try_send(span) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.counts.with_label_values(&["dropped"]).inc();
            }
        }
    }

    /// Stops exporting: the queued spans are sent first, waiting at most
    /// `timeout` for them (at shutdown).
    pub fn shutdown(&self, timeout: Duration) {
        let Some(sink) = self.sink.swap(None) else {
            return;
        };
        let thread = sink.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(sink);
        if let Some(t) = thread {
            let deadline = Instant::now() + timeout;
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The exporter thread: batches of spans to the collector until the queue
/// closes.
fn run(rx: Receiver<FinishedSpan>, cfg: &TracesConfig, service: &str, counts: &IntCounterVec) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the span exporter; spans are dropped");
            return;
        }
    };
    let headers = cfg
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let built = rt.block_on(async {
        opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(cfg.endpoint.clone())
            .with_timeout(Duration::from_millis(cfg.timeout_ms))
            .with_headers(headers)
            .build()
    });
    let mut exporter = match built {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = %e, endpoint = %cfg.endpoint, "cannot start the span exporter; spans are dropped");
            return;
        }
    };
    exporter.set_resource(
        &opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(service.to_string())
            .build(),
    );
    let scope = InstrumentationScope::builder("graygate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let every = Duration::from_millis(cfg.flush_interval_ms);
    let mut open = true;
    while open {
        // Nothing waiting: sleep until a span comes (or the queue closes).
        let Ok(first) = rx.recv() else {
            break;
        };
        let mut batch = vec![to_span_data(first, &scope)];
        let due = Instant::now() + every;
        while batch.len() < cfg.batch_size {
            match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                Ok(s) => batch.push(to_span_data(s, &scope)),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let n = batch.len() as u64;
        match rt.block_on(exporter.export(batch)) {
            Ok(()) => counts.with_label_values(&["exported"]).inc_by(n),
            Err(e) => {
                counts.with_label_values(&["failed"]).inc_by(n);
                log_limited(
                    &EXPORT_LOG,
                    || tracing::warn!(error = %e, endpoint = %cfg.endpoint, spans = n, "span export failed; these spans are lost"),
                );
            }
        }
    }
    let _ = exporter.shutdown();
}

/// The exporter's form of a span.
fn to_span_data(s: FinishedSpan, scope: &InstrumentationScope) -> SpanData {
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(s.trace_id),
            SpanId::from_bytes(s.span_id),
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        ),
        parent_span_id: s.parent.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: s.parent.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(s.name),
        start_time: s.start,
        end_time: s.end,
        attributes: s.attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: if s.error {
            Status::error("")
        } else {
            Status::Unset
        },
        instrumentation_scope: scope.clone(),
    }
}
