//! Layer: observe. Per-lane request counts, 5xx errors and a fine latency
//! histogram, for judging a release's lane against formal. The histogram is
//! log-linear: buckets grow by 8% from 50 µs to about 2 minutes (each bucket
//! at most 8% wide), so a 1.2× p99 ratio is measurable for sub-millisecond
//! requests too (Prometheus' 2.5× buckets put all of them in one bucket).
//! Lanes are bounded like the metric labels; every counter is an atomic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Smallest bucket bound, in microseconds.
const BASE_US: f64 = 50.0;
/// Growth per bucket.
const GROWTH: f64 = 1.08;
/// Buckets (the last holds everything above about 2 minutes).
pub const BUCKETS: usize = 200;
/// Lanes tracked at most (more are not tracked; their analyses say so).
const MAX_LANES: usize = 64;

/// The upper bound (µs) of bucket `i`.
pub fn bucket_upper_us(i: usize) -> f64 {
    BASE_US * GROWTH.powi(i as i32 + 1)
}

/// The lower bound (µs) of bucket `i` (the first starts at 0).
pub fn bucket_lower_us(i: usize) -> f64 {
    match i {
        0 => 0.0,
        _ => bucket_upper_us(i - 1),
    }
}

/// The bucket a duration falls in.
pub fn bucket_of(d: Duration) -> usize {
    let us = d.as_secs_f64() * 1e6;
    if us <= BASE_US {
        return 0;
    }
    let i = ((us / BASE_US).ln() / GROWTH.ln()).floor() as usize;
    i.min(BUCKETS - 1)
}

/// One lane's live counters.
pub struct LaneCounters {
    requests: AtomicU64,
    errors: AtomicU64,
    buckets: Box<[AtomicU64]>,
}

impl LaneCounters {
    /// Counts one finished request.
    pub fn record(&self, status: u16, total: Duration) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if status >= 500 {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.buckets[bucket_of(total)].fetch_add(1, Ordering::Relaxed);
    }
}

impl Default for LaneCounters {
    fn default() -> Self {
        LaneCounters {
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// A lane's counters at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneSnapshot {
    pub requests: u64,
    pub errors: u64,
    pub buckets: Vec<u64>,
}

impl LaneSnapshot {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &LaneSnapshot) -> LaneSnapshot {
        LaneSnapshot {
            requests: self.requests.saturating_sub(earlier.requests),
            errors: self.errors.saturating_sub(earlier.errors),
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
        }
    }

    /// The `q` quantile (0–1) in milliseconds: the upper bound of the
    /// bucket holding it; `None` without observations.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        self.bucket_of_rank(rank)
            .map(|i| bucket_upper_us(i) / 1000.0)
    }

    /// The bucket holding the `rank`-th smallest observation (from 1);
    /// `None` past the last.
    pub fn bucket_of_rank(&self, rank: u64) -> Option<usize> {
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank.max(1) {
                return Some(i);
            }
        }
        None
    }
}

/// Every lane's counters.
#[derive(Default)]
pub struct LaneStats(RwLock<HashMap<String, Arc<LaneCounters>>>);

impl LaneStats {
    /// The lane's counters, created on first use (`None` past the lane
    /// cap). Resolved once per label set and worker thread by the metrics
    /// handle cache, not per request.
    pub fn counters(&self, lane: &str) -> Option<Arc<LaneCounters>> {
        if let Some(c) = self.0.read().unwrap_or_else(|e| e.into_inner()).get(lane) {
            return Some(c.clone());
        }
        let mut m = self.0.write().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_LANES && !m.contains_key(lane) {
            return None;
        }
        Some(m.entry(lane.to_string()).or_default().clone())
    }

    /// Counts one finished request of `lane`.
    pub fn record(&self, lane: &str, status: u16, total: Duration) {
        if let Some(c) = self.counters(lane) {
            c.record(status, total);
        }
    }

    /// The lanes tracked so far.
    pub fn lanes(&self) -> Vec<String> {
        let m = self.0.read().unwrap_or_else(|e| e.into_inner());
        m.keys().cloned().collect()
    }

    /// The lane's counters now (`None`: the lane is not tracked).
    pub fn snapshot(&self, lane: &str) -> Option<LaneSnapshot> {
        let c = self.counters(lane)?;
        Some(LaneSnapshot {
            requests: c.requests.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            buckets: c
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_narrow_enough_for_a_1_2_ratio() {
        for i in 0..BUCKETS - 1 {
            let (lo, hi) = (bucket_upper_us(i), bucket_upper_us(i + 1));
            assert!(hi / lo <= 1.081, "bucket {i}");
        }
        // 1.0 ms and 1.2 ms land in different buckets, several apart.
        let a = bucket_of(Duration::from_micros(1000));
        let b = bucket_of(Duration::from_micros(1200));
        assert!(b >= a + 2, "{a} {b}");
        assert!(bucket_upper_us(BUCKETS - 1) > 60e6);
    }

    #[test]
    fn quantiles_and_deltas() {
        let s = LaneStats::default();
        for i in 1..=100u64 {
            s.record(
                "gray",
                if i <= 5 { 503 } else { 200 },
                Duration::from_micros(i * 100),
            );
        }
        let snap = s.snapshot("gray").unwrap();
        assert_eq!((snap.requests, snap.errors), (100, 5));
        let p99 = snap.quantile_ms(0.99).unwrap();
        assert!((9.9..=10.7).contains(&p99), "{p99}");
        let later = {
            s.record("gray", 200, Duration::from_millis(50));
            s.snapshot("gray").unwrap()
        };
        let d = later.since(&snap);
        assert_eq!(d.requests, 1);
        assert!((50.0..=54.0).contains(&d.quantile_ms(0.99).unwrap()));
        assert_eq!(s.snapshot("formal").unwrap().quantile_ms(0.99), None);
    }
}
