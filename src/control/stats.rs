//! Layer: control plane (reads observe's metrics). Traffic history for the
//! dashboard: every [`INTERVAL`] the request counters and latency histograms
//! are sampled per lane and per node into a ring of [`KEEP`] snapshots;
//! `/stats` turns consecutive snapshots into requests/s, error rate (5xx share)
//! and p99 series, and judges each gray lane against formal over the canary
//! window with the releases' own analysis (`release::analysis`: the default
//! thresholds, the same sample minimums, the fine per-lane histogram).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;

use crate::config::release::AnalysisSpec;
use crate::control::release::analysis;
use crate::control::Gateway;
use crate::observe::lanes::LaneSnapshot;
use crate::observe::metrics::BUCKETS;

/// Sampling period.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// Snapshots kept (5 minutes).
pub const KEEP: usize = 150;
/// Window of the "now" figures.
pub const NOW_WINDOW_SECS: f64 = 10.0;
/// Window of the canary verdict.
pub const CANARY_WINDOW_SECS: f64 = 60.0;

/// Cumulative figures of one lane or node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cum {
    pub requests: u64,
    pub errors: u64,
    /// Answers that were not 1xx–3xx, by status class (`4xx`, `5xx`).
    pub by_class: BTreeMap<String, u64>,
    /// Cumulative counts per [`BUCKETS`] bound, then +Inf.
    pub buckets: Vec<u64>,
}

#[derive(Debug, Clone)]
struct Snapshot {
    t: f64,
    lanes: BTreeMap<String, Cum>,
    nodes: BTreeMap<String, Cum>,
    /// Per served lane, the releases' counters (fine histogram).
    fine: BTreeMap<String, LaneSnapshot>,
}

/// The ring of snapshots.
#[derive(Debug, Default)]
pub struct History(Mutex<VecDeque<Snapshot>>);

/// Figures over an interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub secs: f64,
    pub requests: u64,
    pub errors: u64,
    /// Seconds; `None` without requests.
    pub p99: Option<f64>,
}

impl Window {
    pub fn between(a: Option<&Cum>, b: &Cum, secs: f64) -> Window {
        let zero = Cum::default();
        let a = a.unwrap_or(&zero);
        let requests = b.requests.saturating_sub(a.requests);
        let buckets: Vec<u64> = b
            .buckets
            .iter()
            .enumerate()
            .map(|(i, &c)| c.saturating_sub(a.buckets.get(i).copied().unwrap_or(0)))
            .collect();
        Window {
            secs,
            requests,
            errors: b.errors.saturating_sub(a.errors),
            p99: quantile(0.99, &BUCKETS, &buckets),
        }
    }

    pub fn rps(&self) -> f64 {
        if self.secs > 0.0 {
            self.requests as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Share of 5xx, 0..1; `None` without requests.
    pub fn error_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.errors as f64 / self.requests as f64)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "requests": self.requests,
            "rps": round(self.rps(), 3),
            "error_rate": self.error_rate().map(|e| round(e, 6)),
            "p99_ms": self.p99.map(|p| round(p * 1000.0, 3)),
        })
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// Prometheus' `histogram_quantile`: the `q` quantile from cumulative
/// bucket counts (one per bound, then +Inf), interpolating linearly inside
/// the bucket. Observations above the last bound report that bound.
pub fn quantile(q: f64, bounds: &[f64], cumulative: &[u64]) -> Option<f64> {
    let total = *cumulative.last()?;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let i = cumulative.iter().position(|&c| c as f64 >= rank)?;
    if i >= bounds.len() {
        return bounds.last().copied();
    }
    let (lower, below) = if i == 0 {
        (0.0, 0)
    } else {
        (bounds[i - 1], cumulative[i - 1])
    };
    let in_bucket = cumulative[i] - below;
    if in_bucket == 0 {
        return Some(bounds[i]);
    }
    Some(lower + (bounds[i] - lower) * (rank - below as f64) / in_bucket as f64)
}

fn lanes_of(s: &Snapshot) -> &BTreeMap<String, Cum> {
    &s.lanes
}

fn nodes_of(s: &Snapshot) -> &BTreeMap<String, Cum> {
    &s.nodes
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl History {
    /// Records the current counters.
    pub fn sample(&self, gw: &Gateway) {
        let mut lanes: BTreeMap<String, Cum> = BTreeMap::new();
        let mut nodes: BTreeMap<String, Cum> = BTreeMap::new();
        let label = |m: &prometheus::proto::Metric, name: &str| {
            m.get_label()
                .iter()
                .find(|l| l.name() == name)
                .map(|l| l.value().to_string())
                .unwrap_or_default()
        };
        for fam in gw.plane.metrics.requests.collect() {
            for m in fam.get_metric() {
                let v = m.get_counter().get_value() as u64;
                let class = label(m, "status_class");
                let err = class == "5xx";
                for (map, key) in [
                    (&mut lanes, label(m, "lane")),
                    (&mut nodes, label(m, "node")),
                ] {
                    let c = map.entry(key).or_default();
                    c.requests += v;
                    if err {
                        c.errors += v;
                    }
                    if matches!(class.as_str(), "4xx" | "5xx") && v > 0 {
                        *c.by_class.entry(class.clone()).or_default() += v;
                    }
                }
            }
        }
        for fam in gw.plane.metrics.duration.collect() {
            for m in fam.get_metric() {
                let h = m.get_histogram();
                let mut counts: Vec<u64> = h
                    .get_bucket()
                    .iter()
                    .map(|b| b.cumulative_count())
                    .collect();
                counts.push(h.get_sample_count());
                for (map, key) in [
                    (&mut lanes, label(m, "lane")),
                    (&mut nodes, label(m, "node")),
                ] {
                    let c = map.entry(key).or_default();
                    if c.buckets.len() < counts.len() {
                        c.buckets.resize(counts.len(), 0);
                    }
                    for (i, n) in counts.iter().enumerate() {
                        c.buckets[i] += n;
                    }
                }
            }
        }
        lanes.remove("-");
        nodes.remove("-");
        let stats = &gw.plane.metrics.lanes;
        let fine = stats
            .lanes()
            .into_iter()
            .filter_map(|l| stats.snapshot(&l).map(|s| (l, s)))
            .collect();
        let mut ring = self.0.lock().unwrap_or_else(|e| e.into_inner());
        ring.push_back(Snapshot {
            t: now_secs(),
            lanes,
            nodes,
            fine,
        });
        while ring.len() > KEEP {
            ring.pop_front();
        }
    }

    /// The `/stats` document.
    /// `releases`: the analysis a release judges each lane with (by lane:
    /// the release's name and its thresholds); other lanes are judged at
    /// a release's defaults.
    pub fn report(&self, releases: &BTreeMap<String, (String, AnalysisSpec)>) -> serde_json::Value {
        let ring = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(last) = ring.back() else {
            return serde_json::json!({"lanes": [], "nodes": [], "canary": []});
        };
        // The oldest snapshot still inside `secs` of the last.
        let base = |secs: f64| {
            ring.iter()
                .find(|s| last.t - s.t <= secs + 0.5)
                .filter(|s| s.t < last.t)
        };
        let window = |pick: fn(&Snapshot) -> &BTreeMap<String, Cum>, key: &str, secs: f64| {
            let cur = pick(last).get(key)?;
            let b = base(secs)?;
            Some(Window::between(pick(b).get(key), cur, last.t - b.t))
        };
        let series = |pick: fn(&Snapshot) -> &BTreeMap<String, Cum>, key: &str| {
            ring.iter()
                .zip(ring.iter().skip(1))
                .filter_map(|(a, b)| {
                    let cur = pick(b).get(key)?;
                    let w = Window::between(pick(a).get(key), cur, b.t - a.t);
                    let mut j = w.json();
                    j["t"] = round(b.t, 3).into();
                    Some(j)
                })
                .collect::<Vec<_>>()
        };
        let group = |pick: fn(&Snapshot) -> &BTreeMap<String, Cum>| {
            pick(last)
                .iter()
                .map(|(k, total)| {
                    let now = window(pick, k, NOW_WINDOW_SECS).map(|w| w.json());
                    serde_json::json!({
                        "name": k,
                        "total_requests": total.requests,
                        "total_errors": total.errors,
                        "total_by_class": total.by_class,
                        "now": now,
                        "series": series(pick, k),
                    })
                })
                .collect::<Vec<_>>()
        };
        let canary = canary(&ring, last, releases);
        serde_json::json!({
            "t": round(last.t, 3),
            "interval_secs": INTERVAL.as_secs_f64(),
            "now_window_secs": NOW_WINDOW_SECS,
            "canary_window_secs": CANARY_WINDOW_SECS,
            "thresholds": canary_thresholds(),
            "lanes": group(lanes_of),
            "nodes": group(nodes_of),
            "canary": canary,
        })
    }
}

/// The canary panel's thresholds: a release's defaults.
fn canary_thresholds() -> serde_json::Value {
    let a = AnalysisSpec::default();
    serde_json::json!({
        "max_error_rate_delta_pp": a.max_error_delta_pp,
        "max_p99_ratio": a.max_p99_ratio,
        "min_p99_delta_ms": a.min_p99_delta_ms,
        "min_requests_latency": analysis::min_latency_sample(&a).max(a.min_requests),
        "min_requests_errors": analysis::min_error_sample(&a).max(a.min_requests),
    })
}

/// Each gray lane against formal over the canary window, judged as a
/// release's window is (the fine per-lane counters, by served lane).
fn canary(
    ring: &VecDeque<Snapshot>,
    last: &Snapshot,
    releases: &BTreeMap<String, (String, AnalysisSpec)>,
) -> Vec<serde_json::Value> {
    let base = ring
        .iter()
        .find(|s| last.t - s.t <= CANARY_WINDOW_SECS + 0.5)
        .filter(|s| s.t < last.t);
    let Some(base) = base else {
        return Vec::new();
    };
    let secs = last.t - base.t;
    let window = |lane: &str| {
        let now = last.fine.get(lane)?;
        Some(match base.fine.get(lane) {
            Some(b) => now.since(b),
            None => now.clone(),
        })
    };
    let json = |w: &Option<LaneSnapshot>| {
        w.as_ref().map(|w| {
            serde_json::json!({
                "requests": w.requests,
                "rps": round(w.requests as f64 / secs.max(1e-9), 3),
                "error_rate": (w.requests > 0)
                    .then(|| round(w.errors as f64 / w.requests as f64, 6)),
                "p99_ms": w.quantile_ms(AnalysisSpec::default().quantile).map(|p| round(p, 3)),
            })
        })
    };
    let formal = window(crate::config::FORMAL);
    let defaults = AnalysisSpec::default();
    last.fine
        .keys()
        .filter(|k| k.as_str() != crate::config::FORMAL)
        .map(|k| {
            let gray = window(k);
            let (release, a) = match releases.get(k) {
                Some((name, a)) => (Some(name.as_str()), a),
                None => (None, &defaults),
            };
            let j = analysis::judge(a, gray.as_ref(), formal.as_ref());
            let check = |c: Option<analysis::Check>| c.map(analysis::Check::as_str);
            serde_json::json!({
                "lane": k,
                "gray": json(&gray),
                "formal": json(&formal),
                "errors": check(j.errors),
                "latency": check(j.latency),
                "verdict": j.outcome,
                "reason": j.reason,
                "release": release,
                "max_error_delta_pp": a.max_error_delta_pp,
                "max_p99_ratio": a.max_p99_ratio,
            })
        })
        .collect()
}

/// Samples every [`INTERVAL`] forever.
pub async fn sample_forever(gw: Arc<Gateway>) {
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        gw.history.sample(&gw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_like_prometheus() {
        let bounds = [0.1, 0.2, 0.4];
        // 100 observations: 50 ≤ 0.1, 40 in (0.1, 0.2], 10 in (0.2, 0.4].
        let cum = [50, 90, 100, 100];
        assert!((quantile(0.5, &bounds, &cum).unwrap() - 0.1).abs() < 1e-9);
        // rank 99 lies 9/10 into (0.2, 0.4].
        assert!((quantile(0.99, &bounds, &cum).unwrap() - 0.38).abs() < 1e-9);
        assert_eq!(quantile(0.99, &bounds, &[0, 0, 0, 0]), None);
        // Everything above the last bound: the last bound.
        assert_eq!(quantile(0.99, &bounds, &[0, 0, 0, 5]), Some(0.4));
    }

    #[test]
    fn window_between_snapshots() {
        let a = Cum {
            requests: 10,
            errors: 1,
            buckets: vec![10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10],
            by_class: BTreeMap::new(),
        };
        let mut b = a.clone();
        b.requests = 30;
        b.errors = 3;
        // 20 new observations in the first bucket (≤ 1 ms).
        for c in b.buckets.iter_mut() {
            *c += 20;
        }
        let win = Window::between(Some(&a), &b, 2.0);
        assert_eq!(win.requests, 20);
        assert_eq!(win.rps(), 10.0);
        assert_eq!(win.error_rate(), Some(0.1));
        assert!(win.p99.unwrap() <= 0.001);
    }
}
