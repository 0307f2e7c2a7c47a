//! Layer: observe (uses base, config). Prometheus metrics (the `prometheus`
//! crate's registry and text encoder) and per-request accounting: one
//! [`Metrics::observe`] call per request from its [`Decision`], status and
//! timings, plus the per-node in-flight tracker whose guard rides on the
//! response body until it is sent.

use std::cell::RefCell;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use rustc_hash::{FxHashMap, FxHasher};

use crate::base::decision::{DecidedBy, Decision};
use crate::base::error::ErrorKind;
use crate::observe::node_stats::NodeCounters;

/// Latency buckets in seconds (1 ms … 30 s).
pub const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every metric the gateway exports.
pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub upstream_duration: HistogramVec,
    pub decisions: IntCounterVec,
    pub fallbacks: IntCounterVec,
    pub script_errors: IntCounterVec,
    pub reloads: IntCounterVec,
    pub generation: IntGauge,
    pub node_health: IntGaugeVec,
    pub node_in_flight: IntGaugeVec,
    pub node_weight: IntGaugeVec,
    pub access_log_dropped: IntCounter,
    /// Spans by outcome: exported, dropped (queue full), failed (export).
    pub otel_spans: IntCounterVec,
    /// Inbound `baggage` headers with a problem, by problem.
    pub baggage_problems: IntCounterVec,
    pub errors: IntCounterVec,
    /// Per-lane counts and fine latency (release analysis).
    pub lanes: super::lanes::LaneStats,
    /// Release progress: current step index, weight (percent), and each
    /// judged interval by outcome.
    pub release_step: IntGaugeVec,
    pub release_weight: prometheus::GaugeVec,
    pub release_analyses: IntCounterVec,
    /// Lane label values seen so far (bounded; see [`MAX_LANE_LABELS`]).
    lanes_seen: RwLock<HashSet<String>>,
    /// Distinguishes instances in the per-thread handle cache.
    id: u64,
}

/// The per-request series of one label combination, resolved once per
/// worker thread: a request then costs a hash of its labels instead of
/// four label-vector lookups (each a hash, a lock and a reference count).
struct Handles {
    labels: Labels,
    requests: IntCounter,
    duration: Histogram,
    upstream: Option<Histogram>,
    decisions: Option<IntCounter>,
    /// The serving lane's release-analysis counters (`observe::lanes`).
    lane_counters: Option<Arc<super::lanes::LaneCounters>>,
}

/// What selects the series of one request (raw values; the lane label is
/// derived from `lane` on a miss).
struct Labels {
    metrics: u64,
    route: Box<str>,
    lane: Option<Box<str>>,
    node: Box<str>,
    status: &'static str,
    decided_by: &'static str,
    rule: Box<str>,
    upstream: bool,
    /// The lane that served (the candidate set's; differs on fallback).
    served: Option<Box<str>>,
}

/// Entries per thread; beyond, requests take the uncached path.
const HANDLE_CACHE_MAX: usize = 4096;

thread_local! {
    static HANDLES: RefCell<FxHashMap<u64, Vec<Rc<Handles>>>> = RefCell::new(FxHashMap::default());
    /// The series the thread's last two label sets took, the latest first.
    static LAST: RefCell<[Option<Last>; 2]> = const { RefCell::new([None, None]) };
}

/// A recent request's series on this thread, kept with the shared names
/// that selected them: a request of the same route, node and lane as one
/// of the last two label sets (most of them, in steady traffic; two, so
/// that traffic alternating between two lanes stays on this path) takes its
/// series after a few pointer and short string compares — no hash of its
/// labels. The names are held (`Arc` clones), so an equal pointer is the
/// same allocation and so the same text; anything else takes the hashed
/// cache.
struct Last {
    metrics: u64,
    route: Option<Arc<str>>,
    node: Option<Arc<str>>,
    served: Option<Arc<str>>,
    /// With the other labels (`Handles::labels`).
    handles: Rc<Handles>,
}

/// Both absent, or the same allocation.
fn same_arc(a: &Option<Arc<str>>, b: &Option<Arc<str>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

impl Last {
    /// Does the request `d` (with these other labels) select this series?
    fn selects(
        &self,
        metrics: u64,
        d: &Decision,
        (status, decided_by, rule, upstream): (&str, &str, &str, bool),
    ) -> bool {
        let l = &self.handles.labels;
        self.metrics == metrics
            && l.status == status
            && l.upstream == upstream
            && same_arc(&self.route, &d.route)
            && same_arc(&self.node, &d.node)
            && same_arc(&self.served, &d.served_lane)
            && l.lane.as_deref() == Some(d.lane.as_str())
            && l.decided_by == decided_by
            && *l.rule == *rule
    }
}

static METRICS_IDS: AtomicU64 = AtomicU64::new(0);

/// Distinct lane label values; lanes beyond are counted as `other`, so a
/// script echoing a client header cannot blow up the series count.
pub const MAX_LANE_LABELS: usize = 64;

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn histogram_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()),
        labels,
    )
    .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let requests = counter_vec(
            &r,
            "graygate_requests_total",
            "Requests served, by route prefix, decided lane, node and status class.",
            &["route", "lane", "node", "status_class"],
        );
        let duration = histogram_vec(
            &r,
            "graygate_request_duration_seconds",
            "Time from request head to the end of the response body, by lane and node.",
            &["lane", "node"],
        );
        let upstream_duration = histogram_vec(
            &r,
            "graygate_upstream_duration_seconds",
            "Time waiting for the upstream's response head, by lane and node.",
            &["lane", "node"],
        );
        let decisions = counter_vec(
            &r,
            "graygate_decisions_total",
            "Lane decisions, by what decided (script, trusted_tag, rule, ...), rule name and lane.",
            &["decided_by", "rule", "lane"],
        );
        let fallbacks = counter_vec(
            &r,
            "graygate_lane_fallbacks_total",
            "Requests not served by their own lane, by reason and lane.",
            &["reason", "lane"],
        );
        let script_errors = counter_vec(
            &r,
            "graygate_script_errors_total",
            "Lane script failures (request went formal), by kind: error, instruction_limit, memory_limit, invalid_lane.",
            &["kind"],
        );
        let reloads = counter_vec(
            &r,
            "graygate_reloads_total",
            "Configuration reloads, by result (applied, rejected).",
            &["result"],
        );
        for result in ["applied", "rejected"] {
            reloads.with_label_values(&[result]);
        }
        let generation = IntGauge::new(
            "graygate_generation",
            "Id of the configuration generation serving now.",
        )
        .expect("valid metric");
        r.register(Box::new(generation.clone()))
            .expect("unique metric");
        let node_health = gauge_vec(
            &r,
            "graygate_node_health",
            "1 for the node's current health state (healthy, unhealthy, unknown), 0 otherwise.",
            &["service", "node", "lane", "state"],
        );
        let node_in_flight = gauge_vec(
            &r,
            "graygate_node_in_flight",
            "Requests in flight to the node.",
            &["service", "node", "lane"],
        );
        let node_weight = gauge_vec(
            &r,
            "graygate_node_weight",
            "Configured weight of the node (0 while draining).",
            &["service", "node", "lane"],
        );
        let errors = counter_vec(
            &r,
            "graygate_request_errors_total",
            "Requests that did not end as the node answered, by side (client: bad request, aborted or stalled body, never charged to a node; upstream: the node's failure; gateway: no route, no node, deadline) and kind.",
            &["side", "kind"],
        );
        let release_step = gauge_vec(
            &r,
            "graygate_release_step",
            "Current step (index from 0) of each progressive release.",
            &["release", "lane"],
        );
        let release_weight = prometheus::GaugeVec::new(
            Opts::new(
                "graygate_release_weight",
                "Traffic share (percent of the release's routes) its lane gets now.",
            ),
            &["release", "lane"],
        )
        .expect("valid metric");
        r.register(Box::new(release_weight.clone()))
            .expect("unique metric");
        let release_analyses = counter_vec(
            &r,
            "graygate_release_analyses_total",
            "Judged release intervals and actions, by outcome (pass, fail, inconclusive, error, step, promote, rollback, held).",
            &["release", "outcome"],
        );
        let access_log_dropped = IntCounter::new(
            "graygate_access_log_dropped_total",
            "Access log lines dropped because the writer fell behind.",
        )
        .expect("valid metric");
        r.register(Box::new(access_log_dropped.clone()))
            .expect("unique metric");
        let otel_spans = counter_vec(
            &r,
            "graygate_otel_spans_total",
            "Gateway spans by outcome: exported, dropped (the export queue was full), failed (the collector did not take them).",
            &["outcome"],
        );
        let baggage_problems = counter_vec(
            &r,
            "graygate_baggage_problems_total",
            "Requests whose baggage header had a problem (malformed, encoding, too_many_members, too_long): ignored for the lane, bad members not forwarded.",
            &["problem"],
        );
        Metrics {
            registry: r,
            otel_spans,
            baggage_problems,
            requests,
            duration,
            upstream_duration,
            decisions,
            fallbacks,
            script_errors,
            reloads,
            generation,
            node_health,
            node_in_flight,
            node_weight,
            access_log_dropped,
            errors,
            lanes_seen: RwLock::new(HashSet::new()),
            lanes: Default::default(),
            release_step,
            release_weight,
            release_analyses,
            id: METRICS_IDS.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// `lane` as a label value: itself while fewer than
    /// [`MAX_LANE_LABELS`] lanes have been seen, else `other`.
    fn lane_label<'a>(&self, lane: &'a str) -> &'a str {
        if self
            .lanes_seen
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(lane)
        {
            return lane;
        }
        let mut seen = self.lanes_seen.write().unwrap_or_else(|e| e.into_inner());
        if seen.len() < MAX_LANE_LABELS {
            seen.insert(lane.to_string());
            lane
        } else {
            "other"
        }
    }

    /// Records one finished request.
    pub fn observe(&self, o: &Observation<'_>) {
        let status = status_class(o.status);
        let decided_by = o.decision.map_or("", |d| d.decided_by.as_str());
        let rule = o.rule.unwrap_or("");
        let upstream = o.upstream.is_some();
        let labels = (status, decided_by, rule, upstream);
        let hit = o.decision.is_some_and(|d| {
            LAST.with(|last| {
                let mut last = last.borrow_mut();
                let selects =
                    |l: &Option<Last>| l.as_ref().is_some_and(|l| l.selects(self.id, d, labels));
                if !selects(&last[0]) {
                    if !selects(&last[1]) {
                        return false;
                    }
                    // The latest first.
                    last.swap(0, 1);
                }
                if let Some(l) = &last[0] {
                    self.record(&l.handles, o);
                }
                true
            })
        });
        if !hit {
            self.observe_hashed(o, labels);
        }
        if let Some(kind) = o.error {
            self.errors
                .with_label_values(&[kind.side().as_str(), kind.as_str()])
                .inc();
        }
        let Some(d) = o.decision else { return };
        if let Some(reason) = d.fallback {
            let lane = self.lane_label(&d.lane);
            self.fallbacks.with_label_values(&[reason, lane]).inc();
        }
        if let Some(kind) = script_error_kind(&d.decided_by) {
            self.script_errors.with_label_values(&[kind]).inc();
        }
    }

    /// The series of a request the last one's do not fit: a hash of its
    /// labels into the per-thread cache (resolved on a miss); they become
    /// the thread's [`Last`].
    fn observe_hashed(
        &self,
        o: &Observation<'_>,
        (status, decided_by, rule, upstream): (&'static str, &'static str, &str, bool),
    ) {
        let raw_lane = o.decision.map(|d| d.lane.as_str());
        let node = o.decision.and_then(|d| d.node.as_deref()).unwrap_or("-");
        let route = o.decision.and_then(|d| d.route.as_deref()).unwrap_or("-");
        let served = o
            .decision
            .map(|d| d.served_lane.as_deref().unwrap_or(d.lane.as_str()));
        let mut h = FxHasher::default();
        (
            self.id, route, raw_lane, node, status, decided_by, rule, upstream, served,
        )
            .hash(&mut h);
        let key = h.finish();
        let matches = |l: &Labels| {
            l.metrics == self.id
                && &*l.route == route
                && l.lane.as_deref() == raw_lane
                && &*l.node == node
                && l.status == status
                && l.decided_by == decided_by
                && &*l.rule == rule
                && l.upstream == upstream
                && l.served.as_deref() == served
        };
        let handles = HANDLES.with(|cache| {
            let mut cache = cache.borrow_mut();
            if let Some(h) = cache
                .get(&key)
                .and_then(|v| v.iter().find(|h| matches(&h.labels)))
            {
                self.record(h, o);
                return h.clone();
            }
            let handles = Rc::new(self.resolve(Labels {
                metrics: self.id,
                route: route.into(),
                lane: raw_lane.map(Into::into),
                node: node.into(),
                status,
                decided_by,
                rule: rule.into(),
                upstream,
                served: served.map(Into::into),
            }));
            self.record(&handles, o);
            // Past the cap (label churn), series are resolved per request.
            if cache.len() < HANDLE_CACHE_MAX {
                cache.entry(key).or_default().push(handles.clone());
            }
            handles
        });
        let Some(d) = o.decision else { return };
        LAST.with(|last| {
            let mut last = last.borrow_mut();
            last[1] = last[0].take();
            last[0] = Some(Last {
                metrics: self.id,
                route: d.route.clone(),
                node: d.node.clone(),
                served: d.served_lane.clone(),
                handles,
            });
        });
    }

    fn record(&self, h: &Handles, o: &Observation<'_>) {
        h.requests.inc();
        h.duration.observe(o.total.as_secs_f64());
        if let (Some(hist), Some(up)) = (&h.upstream, o.upstream) {
            hist.observe(up.as_secs_f64());
        }
        if let Some(c) = &h.decisions {
            c.inc();
        }
        if let Some(c) = &h.lane_counters {
            c.record(o.status, o.served);
        }
    }

    /// The series `labels` select (the lane label bounded by
    /// [`lane_label`](Self::lane_label)).
    fn resolve(&self, labels: Labels) -> Handles {
        let lane = labels.lane.as_deref().map_or("-", |l| self.lane_label(l));
        let (route, node) = (&*labels.route, &*labels.node);
        Handles {
            requests: self
                .requests
                .with_label_values(&[route, lane, node, labels.status]),
            duration: self.duration.with_label_values(&[lane, node]),
            upstream: labels
                .upstream
                .then(|| self.upstream_duration.with_label_values(&[lane, node])),
            decisions: labels.lane.is_some().then(|| {
                self.decisions
                    .with_label_values(&[labels.decided_by, &labels.rule, lane])
            }),
            lane_counters: labels
                .served
                .as_deref()
                .and_then(|l| self.lanes.counters(l)),
            labels,
        }
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// What [`Metrics::observe`] and the access log read about one request.
pub struct Observation<'a> {
    /// `None` when no route matched.
    pub decision: Option<&'a Decision>,
    /// Name of the deciding rule, where a rule decided.
    pub rule: Option<&'a str>,
    pub status: u16,
    pub total: Duration,
    /// From the lane decision to the end of the body: what the per-lane
    /// counters take, so every lane is timed from the same point whatever
    /// decided it (a release's step decides before the script runs; formal
    /// requests on its routes run it).
    pub served: Duration,
    pub upstream: Option<Duration>,
    /// What failed, if anything.
    pub error: Option<ErrorKind>,
}

pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// The kind of a script failure, if the decision was one.
pub fn script_error_kind(d: &DecidedBy) -> Option<&'static str> {
    match d {
        DecidedBy::ScriptError(msg) => Some(if msg.contains("instruction budget") {
            "instruction_limit"
        } else if msg.contains("memory") {
            "memory_limit"
        } else {
            "error"
        }),
        DecidedBy::InvalidLane(_) => Some("invalid_lane"),
        _ => None,
    }
}

/// One request to a node: counted at start, in flight until the response
/// body is done (or the request failed).
pub struct NodeTracker(Arc<NodeCounters>);

impl NodeTracker {
    pub fn begin(counters: Arc<NodeCounters>) -> NodeTracker {
        counters.in_flight.fetch_add(1, Ordering::Relaxed);
        counters.requests.fetch_add(1, Ordering::Relaxed);
        NodeTracker(counters)
    }

    /// The attempt failed without a response to pass on (e.g. before a
    /// retry on another node): one error, no longer in flight.
    pub fn fail(self) {
        self.0.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a 5xx response as a node error. (The tracker itself then goes
    /// into the response body, in flight until the body is done.)
    pub fn count_status(&self, status: http::StatusCode) {
        if status.is_server_error() {
            self.0.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for NodeTracker {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};

    #[test]
    fn observe_counts_by_labels_and_encodes_text() {
        let m = Metrics::new();
        let mut d = Decision::new("gray", DecidedBy::Script);
        d.route = Some("/api/".into());
        d.node = Some("g1".into());
        d.fallback = Some("lane_has_no_nodes");
        let o = Observation {
            decision: Some(&d),
            rule: None,
            status: 503,
            total: Duration::from_millis(3),
            served: Duration::from_millis(3),
            upstream: Some(Duration::from_millis(2)),
            error: None,
        };
        m.observe(&o);
        m.observe(&o);
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(text.contains(
            r#"graygate_requests_total{lane="gray",node="g1",route="/api/",status_class="5xx"} 2"#
        ));
        assert!(text.contains(
            r#"graygate_request_duration_seconds_bucket{lane="gray",node="g1",le="0.005"} 2"#
        ));
        assert!(text.contains(
            r#"graygate_lane_fallbacks_total{lane="gray",reason="lane_has_no_nodes"} 2"#
        ));
        assert!(
            text.contains(r#"graygate_decisions_total{decided_by="script",lane="gray",rule=""} 2"#)
        );
    }

    #[test]
    fn lane_labels_are_bounded() {
        let m = Metrics::new();
        for i in 0..MAX_LANE_LABELS + 10 {
            let lane = format!("lane{i}");
            let want = if i < MAX_LANE_LABELS {
                lane.as_str()
            } else {
                "other"
            };
            assert_eq!(m.lane_label(&lane), want);
        }
        assert_eq!(m.lane_label("lane0"), "lane0");
    }

    #[test]
    fn script_failures_are_classified() {
        let k = |m: &str| script_error_kind(&DecidedBy::ScriptError(m.into()));
        assert_eq!(
            k("x.lua:3: instruction budget exceeded"),
            Some("instruction_limit")
        );
        assert_eq!(k("not enough memory"), Some("memory_limit"));
        assert_eq!(k("attempt to index a nil value"), Some("error"));
        assert_eq!(script_error_kind(&DecidedBy::Script), None);
    }

    #[test]
    fn cached_series_count_per_instance_and_per_label_set() {
        let (a, b) = (Metrics::new(), Metrics::new());
        let mut d = Decision::new("gray", DecidedBy::Script);
        d.route = Some("/api/".into());
        d.node = Some("g1".into());
        let obs = |status, upstream| Observation {
            decision: Some(&d),
            rule: None,
            status,
            total: Duration::from_millis(3),
            served: Duration::from_millis(3),
            upstream,
            error: None,
        };
        for _ in 0..3 {
            a.observe(&obs(200, Some(Duration::from_millis(2))));
        }
        a.observe(&obs(502, None));
        b.observe(&obs(200, Some(Duration::from_millis(2))));
        let count = |m: &Metrics, status| {
            m.requests
                .with_label_values(&["/api/", "gray", "g1", status])
                .get()
        };
        assert_eq!((count(&a, "2xx"), count(&a, "5xx")), (3, 1));
        assert_eq!((count(&b, "2xx"), count(&b, "5xx")), (1, 0));
        let up = a.upstream_duration.with_label_values(&["gray", "g1"]);
        assert_eq!(up.get_sample_count(), 3, "the 502 had no upstream time");
        let dec = a.decisions.with_label_values(&["script", "", "gray"]).get();
        assert_eq!(dec, 4);
    }

    /// The thread's last series is taken again only by a request every
    /// label of which selects it: each variant below follows the base
    /// request (so the base is the thread's last) and must count in its own
    /// series; the same names in fresh allocations count in the base's.
    #[test]
    fn last_series_is_reused_only_for_the_same_labels() {
        let m = Metrics::new();
        let mut base = Decision::new("gray", DecidedBy::Script);
        base.route = Some("/api/".into());
        base.node = Some("g1".into());
        let with = |f: &dyn Fn(&mut Decision)| {
            let mut d = base.clone();
            f(&mut d);
            d
        };
        let fresh = with(&|d| {
            d.route = Some("/api/".into());
            d.node = Some("g1".into());
        });
        let variants = [
            with(&|d| d.node = Some("g2".into())),
            with(&|d| d.node = None),
            with(&|d| d.route = Some("/web/".into())),
            with(&|d| d.lane = "blue".into()),
            with(&|d| d.served_lane = Some("formal".into())),
            with(&|d| d.decided_by = DecidedBy::Default),
            with(&|d| d.decided_by = DecidedBy::Rule("r1".into())),
        ];
        let observe = |d: &Decision, status, upstream: bool| {
            m.observe(&Observation {
                decision: Some(d),
                rule: d.decided_by.rule_name(),
                status,
                total: Duration::from_millis(3),
                served: Duration::from_millis(3),
                upstream: upstream.then(|| Duration::from_millis(1)),
                error: None,
            })
        };
        for v in &variants {
            observe(&base, 200, true);
            observe(v, 200, true);
        }
        observe(&base, 200, true);
        observe(&base, 503, true);
        observe(&base, 200, false);
        observe(&fresh, 200, true);
        let count = |route, lane, node, status| {
            m.requests
                .with_label_values(&[route, lane, node, status])
                .get()
        };
        // 9 base 2xx requests (one without an upstream time), the fresh
        // copy, and the served-lane, decided-by and rule variants (which
        // share these labels).
        assert_eq!(count("/api/", "gray", "g1", "2xx"), 13);
        assert_eq!(count("/api/", "gray", "g1", "5xx"), 1);
        assert_eq!(count("/api/", "gray", "g2", "2xx"), 1);
        assert_eq!(count("/api/", "gray", "-", "2xx"), 1);
        assert_eq!(count("/web/", "gray", "g1", "2xx"), 1);
        assert_eq!(count("/api/", "blue", "g1", "2xx"), 1);
        let up = m.upstream_duration.with_label_values(&["gray", "g1"]);
        // Every gray/g1 request (any route) but the one without an upstream
        // time.
        assert_eq!(up.get_sample_count(), 14);
        let dec = |by, rule| m.decisions.with_label_values(&[by, rule, "gray"]).get();
        assert_eq!(dec("default", ""), 1);
        assert_eq!(dec("rule", "r1"), 1);
        assert_eq!(dec("script", ""), 15);
        let served = |lane: &str| m.lanes.snapshot(lane).map(|s| s.requests);
        assert_eq!(served("formal"), Some(1));
    }

    #[tokio::test]
    async fn tracker_counts_5xx_and_stays_in_flight_while_held() {
        use crate::base::body::{boxed, Guarded};
        let c = Arc::new(NodeCounters::default());
        let t = NodeTracker::begin(c.clone());
        assert_eq!(c.snapshot(), (1, 1, 0));
        t.count_status(http::StatusCode::OK);
        assert_eq!(c.snapshot(), (1, 1, 0));
        t.count_status(http::StatusCode::BAD_GATEWAY);
        assert_eq!(c.snapshot(), (1, 1, 1));
        let body = Guarded::new(boxed(Full::new(Bytes::from_static(b"x"))), t);
        assert_eq!(c.snapshot(), (1, 1, 1));
        let body = body.collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"x");
        assert_eq!(c.snapshot(), (0, 1, 1));
    }
}
