//! Layer: base. Gives memory freed by closed connections back to the OS.
//!
//! mimalloc (the global allocator) keeps freed memory in two places a
//! quiet worker never empties:
//! - the last page of each size class, once all its blocks are free, stays
//!   with the thread ("retired") until 16 of mimalloc's housekeeping
//!   rounds have passed, one round per 1000 allocations that leave its
//!   fast path: after a burst of closed connections, each size class the
//!   burst used keeps a 64 KiB page;
//! - free pages go back to the OS ("purged") only `purge_delay` (1 s)
//!   after they were freed, and only when mimalloc next frees a page of
//!   its own.
//!
//! [`nudge`] frees one huge block, which runs the purge of everything that
//! has expired; [`collect`] runs enough housekeeping rounds, each on the
//! cheapest allocation that takes the slow path, to free the retired
//! pages. The accept loop nudges once a second for a few seconds after
//! connections closed or kept request slots were freed, and collects at
//! most every few seconds meanwhile (nothing is done on a steady worker
//! that frees nothing).

/// Above mimalloc's largest size class (512 KiB): a page of its own, whose
/// free runs the arena purge.
const HUGE: usize = 1 << 20;

/// A large block (above mimalloc's medium size classes, below its huge
/// ones): freed, it waits on its page's local free list, so the next one
/// leaves the fast path to take it back; no other page is touched.
const LARGE: usize = 256 << 10;

/// Slow-path allocations for every retired page to expire: 16 rounds of
/// 1000, and one round more.
const ROUNDS: usize = 17 * 1000;

/// Allocates and frees one huge block (never touched: no page is faulted in).
pub fn nudge() {
    let v: Vec<u8> = Vec::with_capacity(HUGE);
    drop(std::hint::black_box(v));
}

/// Frees this thread's retired pages: [`ROUNDS`] large blocks allocated and
/// freed (never touched; well under a millisecond). Their pages go back to
/// the OS at a [`nudge`] past the purge delay.
pub fn collect() {
    for _ in 0..ROUNDS {
        let v: Vec<u8> = Vec::with_capacity(LARGE);
        drop(std::hint::black_box(v));
    }
}

/// What a tick should do to give memory back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Give {
    /// Nothing.
    None,
    /// [`nudge`].
    Nudge,
    /// [`collect`], then [`nudge`].
    Collect,
}

/// When to nudge: once a second for a few seconds after the open-connection
/// count fell; when to collect: at the first of those nudges, and at most
/// every [`Tidy::COLLECT_MS`] while they go on.
#[derive(Debug, Default)]
pub struct Tidy {
    last: usize,
    /// Nudge until then (`now_ms`).
    until: u64,
    nudged: u64,
    /// The last collect (`now_ms`; 0: none yet).
    collected: u64,
    /// The last [`trim_due`](Self::trim_due) that said yes (`now_ms`).
    trimmed: u64,
}

impl Tidy {
    /// How long after connections closed: past the purge delay, and a
    /// little more for pages retired late.
    const SPAN_MS: u64 = 4000;
    /// The shortest time between two collects.
    pub const COLLECT_MS: u64 = 5000;

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

    /// A tick at `now` (`now_ms`) with `open` connections: what to do.
    pub fn tick(&mut self, open: usize, now: u64) -> Give {
        if open < self.last {
            self.until = now + Self::SPAN_MS;
        }
        self.last = open;
        if now >= self.until || now < self.nudged + 1000 {
            return Give::None;
        }
        self.nudged = now;
        if self.collected == 0 || now >= self.collected + Self::COLLECT_MS {
            self.collected = now;
            // A nudge past the purge delay gives the collected pages back.
            self.until = self.until.max(now + 2000);
            Give::Collect
        } else {
            Give::Nudge
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
        assert_eq!(t.tick(0, t0), Give::None);
        assert_eq!(
            t.tick(10, t0 + 100),
            Give::None,
            "connections opening: nothing to give back"
        );
        assert_eq!(t.tick(3, t0 + 200), Give::Collect, "the first after closes");
        assert_eq!(t.tick(3, t0 + 300), Give::None, "at most once a second");
        assert_eq!(t.tick(3, t0 + 1200), Give::Nudge);
        assert_eq!(t.tick(3, t0 + 2200), Give::Nudge);
        assert_eq!(t.tick(3, t0 + 3200), Give::Nudge);
        assert_eq!(t.tick(3, t0 + 4200), Give::None, "quiet again");
        t.freed(t0 + 4300);
        assert_eq!(
            t.tick(3, t0 + 4300),
            Give::Nudge,
            "freed memory: nudged as after closes, collected 5 s ago at most once"
        );
        assert_eq!(t.tick(3, t0 + 5300), Give::Collect, "5 s since the last");
        assert_eq!(t.tick(3, t0 + 6300), Give::Nudge);
        assert_eq!(
            t.tick(3, t0 + 7300),
            Give::Nudge,
            "the collect's pages purged past the delay"
        );
        assert_eq!(t.tick(3, t0 + 8300), Give::None, "quiet again");
        // A collect near a span's end: the span goes on past the purge delay.
        t.freed(t0 + 10_000);
        assert_eq!(t.tick(3, t0 + 13_500), Give::Collect);
        assert_eq!(
            t.tick(3, t0 + 14_500),
            Give::Nudge,
            "the span goes on past the delay"
        );
        assert_eq!(t.tick(3, t0 + 15_500), Give::None);
        // Closing all the time: a collect every 5 s, a nudge every second.
        let gives: Vec<Give> = (0..10u64)
            .map(|i| t.tick(2 - (i % 2) as usize, t0 + 20_000 + i * 1000))
            .collect();
        let collects = gives.iter().filter(|g| **g == Give::Collect).count();
        assert_eq!(collects, 2, "{gives:?}");
        assert!(gives.iter().all(|g| *g != Give::None), "{gives:?}");
        assert!(t.trim_due(t0));
        assert!(!t.trim_due(t0 + 10), "trimmed twice within a second");
        assert!(t.trim_due(t0 + 1000));
        nudge();
        collect();
    }
}
