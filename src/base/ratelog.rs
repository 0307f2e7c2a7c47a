//! Layer: base. Rate-limited logging: a failing script or a refusing listener
//! must not flood the log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Runs `log` at most once per second per `slot` (a last-logged timestamp),
/// so a failing script cannot flood the log.
pub fn log_limited(slot: &AtomicU64, log: impl FnOnce()) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = slot.load(Ordering::Relaxed);
    if now > last
        && slot
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        log();
    }
}
