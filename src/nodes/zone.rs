//! Layer: nodes. Zone preference inside a candidate set. The gateway knows
//! its zone (`zone:` in the main file, or `GRAYGATE_ZONE`, which wins); nodes
//! carry a `zone` (node files; a registry's metadata later). Of the lane's
//! candidates, those in the gateway's zone are picked first while at least
//! `zone_min_healthy` of them are healthy; otherwise every zone of the lane
//! is used (the whole set, the healthy same-zone nodes included). A node
//! without a zone is in no zone: it is never "local", and is used whenever
//! the choice spans every zone — so zone preference can never empty the set.

use std::sync::atomic::{AtomicU64, Ordering};

/// The zone step taken for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneStep {
    /// No zone preference: the gateway has no zone, or the service turned
    /// it off (`zone_min_healthy: 0`).
    Off,
    /// No candidate is in the gateway's zone: every zone.
    NoLocalNodes,
    /// Same-zone candidates first (others only once they are all tried).
    Local,
    /// Too few same-zone candidates are healthy: every zone.
    Spill,
    /// Every candidate is down (panic mode): every zone.
    Panic,
}

impl ZoneStep {
    pub fn as_str(self) -> &'static str {
        match self {
            ZoneStep::Off => "off",
            ZoneStep::NoLocalNodes => "no_local_nodes",
            ZoneStep::Local => "local",
            ZoneStep::Spill => "spill",
            ZoneStep::Panic => "panic",
        }
    }
}

/// The number of healthy same-zone nodes, recounted at most once per
/// millisecond of the coarse clock (so the per-request cost does not grow
/// with the zone's size): `now_ms << 24 | count`.
#[derive(Debug, Default)]
pub struct HealthyCount(AtomicU64);

const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

impl HealthyCount {
    /// The count at `now`, from the cache or from `count()`.
    pub fn get(&self, now: u64, count: impl FnOnce() -> usize) -> u32 {
        let c = self.0.load(Ordering::Relaxed);
        if c != 0 && c >> COUNT_BITS == now {
            return (c & COUNT_MASK) as u32;
        }
        let n = (count() as u64).min(COUNT_MASK);
        self.0.store((now << COUNT_BITS) | n, Ordering::Relaxed);
        n as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_count_is_cached_per_millisecond() {
        let c = HealthyCount::default();
        assert_eq!(c.get(5, || 3), 3);
        assert_eq!(c.get(5, || unreachable!()), 3);
        assert_eq!(c.get(6, || 1), 1);
        assert_eq!(c.get(6, || unreachable!()), 1);
    }
}
