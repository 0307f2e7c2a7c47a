//! Layer: base. Gives memory freed by closed connections back to the OS.
//!
//! mimalloc (the global allocator) returns ("purges") the pages a burst of
//! closed connections freed only `purge_delay` (1 s) after they were freed,
//! and only when it next frees a page of its own: on a worker that has gone
//! quiet that never happens, and the process would keep its peak RSS (after
//! many idle connections closed) for good. [`nudge`] frees one huge
//! block, which runs mimalloc's purge of everything that has expired; the
//! accept loop calls it once a second for a few seconds after connections
//! closed or kept request slots were freed (nothing is done on a steady
//! worker that frees nothing).

/// Above mimalloc's largest size class (512 KiB): a page of its own, whose
/// free runs the arena purge.
const HUGE: usize = 1 << 20;

/// Allocates and frees one huge block (never touched: no page is faulted in).
pub fn nudge() {
    let v: Vec<u8> = Vec::with_capacity(HUGE);
    drop(std::hint::black_box(v));
}

/// When to nudge: once a second for a few seconds after the open-connection
/// count fell.
#[derive(Debug, Default)]
pub struct Tidy {
    last: usize,
    /// Nudge until then (`now_ms`).
    until: u64,
    nudged: u64,
    /// The last [`trim_due`](Self::trim_due) that said yes (`now_ms`).
    trimmed: u64,
}

impl Tidy {
    /// How long after connections closed: past the purge delay, and a
    /// little more for pages retired late.
    const SPAN_MS: u64 = 4000;

    /// True at most once a second: when the kept free lists are trimmed.
    pub fn trim_due(&mut self, now: u64) -> bool {
        if now >= self.trimmed + 1000 {
            self.trimmed = now;
            true
        } else {
            false
        }
    }

    /// Memory was freed at `now` (not by closed connections): nudge for
    /// the next few seconds as after closes.
    pub fn freed(&mut self, now: u64) {
        self.until = now + Self::SPAN_MS;
    }

    /// A tick at `now` (`now_ms`) with `open` connections: true when to
    /// [`nudge`].
    pub fn tick(&mut self, open: usize, now: u64) -> bool {
        if open < self.last {
            self.until = now + Self::SPAN_MS;
        }
        self.last = open;
        if now < self.until && now >= self.nudged + 1000 {
            self.nudged = now;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nudges_once_a_second_for_a_few_seconds_after_closes() {
        let mut t = Tidy::default();
        let t0 = 10_000;
        assert!(!t.tick(0, t0));
        assert!(
            !t.tick(10, t0 + 100),
            "connections opening: nothing to give back"
        );
        assert!(t.tick(3, t0 + 200));
        assert!(!t.tick(3, t0 + 300), "at most once a second");
        assert!(t.tick(3, t0 + 1200));
        assert!(t.tick(3, t0 + 2200));
        assert!(t.tick(3, t0 + 3200));
        assert!(!t.tick(3, t0 + 4200), "quiet again");
        t.freed(t0 + 4300);
        assert!(t.tick(3, t0 + 4300), "freed memory: nudged as after closes");
        assert!(t.tick(3, t0 + 8200));
        assert!(!t.tick(3, t0 + 9200), "quiet again");
        assert!(t.trim_due(t0));
        assert!(!t.trim_due(t0 + 10), "trimmed twice within a second");
        assert!(t.trim_due(t0 + 1000));
        nudge();
    }
}
