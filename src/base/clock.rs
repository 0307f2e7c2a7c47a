//! Layer: base. The clocks read on the request path.

use std::sync::OnceLock;

/// Milliseconds since the process's health clock started (never 0).
///
/// A coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`, a few ms of
/// resolution): it is read several times per request for health, node
/// choice and connection activity, where milliseconds are plenty, and it
/// costs a memory read instead of a timestamp-counter read.
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<coarsetime::Instant> = OnceLock::new();
    let e = *EPOCH.get_or_init(coarsetime::Instant::now);
    coarsetime::Instant::now().duration_since(e).as_millis() + 1
}

/// One step of [`now_ms`]'s clock (`CLOCK_MONOTONIC_COARSE`'s resolution,
/// the kernel tick: 1–4 ms), in whole milliseconds, at least 1.
pub fn tick_ms() -> u64 {
    static TICK: OnceLock<u64> = OnceLock::new();
    *TICK.get_or_init(|| {
        let r = rustix::time::clock_getres(rustix::time::ClockId::MonotonicCoarse);
        let ns = (r.tv_sec.max(0) as u64) * 1_000_000_000 + r.tv_nsec.max(0) as u64;
        ns.div_ceil(1_000_000).max(1)
    })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
