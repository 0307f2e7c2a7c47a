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
//! pages. After connections closed or kept buffers, request slots or
//! pooled connections were freed, the accept loop collects once (at most
//! every few seconds: a free held back is collected later, never
//! skipped) and nudges once a second until past the purge delay of the
//! last collect (nothing is done on a steady worker that frees nothing).
//!
//! A third place, mimalloc's shared arena of abandoned full pages, is
//! kept empty by the option the binary runs with (`src/main.rs`,
//! `ALLOC_OPTION`).

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

/// When to give memory back. Memory freed (connections closed, kept
/// buffers or pooled connections trimmed) makes a collect due; it runs at
/// the first tick allowed (at most every [`Tidy::COLLECT_MS`]), so pages
/// freed while collects are held back are collected later, never left
/// behind. Nudges go on once a second for [`Tidy::SPAN_MS`] after the
/// last free and for [`Tidy::PURGE_MS`] after the last collect: past
/// mimalloc's purge delay counted from the end of the collect, so the
/// pages the collect freed are purged by a nudge that comes after them.
#[derive(Debug, Default)]
pub struct Tidy {
    last: usize,
    /// Nudge until then (`now_ms`).
    until: u64,
    /// The last nudge or collect (`now_ms`; 0: none yet).
    nudged: u64,
    /// The last collect (`now_ms`; 0: none yet).
    collected: u64,
    /// Memory was freed since the last collect.
    due: bool,
    /// The last [`trim_due`](Self::trim_due) that said yes (`now_ms`).
    trimmed: u64,
}

impl Tidy {
    /// How long to nudge after memory was freed: past the purge delay,
    /// and a little more for pages retired late.
    const SPAN_MS: u64 = 4000;
    /// How long to nudge after a collect: two nudges, the second surely
    /// past the purge delay of what the collect freed (the first comes a
    /// tick period after the collect began, which can be a hair short of
    /// the delay counted from its end).
    const PURGE_MS: u64 = 2500;
    /// The shortest time between two collects.
    pub const COLLECT_MS: u64 = 5000;
    /// "Once a second", with room for a tick that comes a little early.
    const SECOND_MS: u64 = 900;

    /// True at most once a second: when the kept free lists are trimmed.
    pub fn trim_due(&mut self, now: u64) -> bool {
        if self.trimmed == 0 || now >= self.trimmed + Self::SECOND_MS {
            self.trimmed = now;
            true
        } else {
            false
        }
    }

    /// Memory was freed at `now` (not by closed connections): collect and
    /// nudge as after closes.
    pub fn freed(&mut self, now: u64) {
        self.due = true;
        self.until = self.until.max(now + Self::SPAN_MS);
    }

    /// A tick at `now` (`now_ms`) with `open` connections: what to do.
    pub fn tick(&mut self, open: usize, now: u64) -> Give {
        if open < self.last {
            self.freed(now);
        }
        self.last = open;
        if self.nudged != 0 && now < self.nudged + Self::SECOND_MS {
            return Give::None;
        }
        if self.due && (self.collected == 0 || now >= self.collected + Self::COLLECT_MS) {
            self.due = false;
            self.collected = now;
            self.nudged = now;
            self.until = self.until.max(now + Self::PURGE_MS);
            return Give::Collect;
        }
        if now >= self.until {
            return Give::None;
        }
        self.nudged = now;
        Give::Nudge
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ticks of one second each from `from` (ms), `n` of them, with
    /// `open` connections: what each says.
    fn ticks(t: &mut Tidy, open: usize, from: u64, n: u64) -> Vec<Give> {
        (0..n).map(|i| t.tick(open, from + i * 1000)).collect()
    }

    #[test]
    fn collects_after_closes_then_nudges_past_the_purge_delay() {
        let mut t = Tidy::default();
        let t0 = 10_000;
        assert_eq!(t.tick(0, t0), Give::None, "nothing freed yet");
        assert_eq!(
            t.tick(10, t0 + 100),
            Give::None,
            "connections opening: nothing to give back"
        );
        assert_eq!(t.tick(3, t0 + 200), Give::Collect, "the first after closes");
        assert_eq!(t.tick(3, t0 + 300), Give::None, "at most once a second");
        use Give::*;
        assert_eq!(
            ticks(&mut t, 3, t0 + 1200, 4),
            [Nudge, Nudge, Nudge, None],
            "nudged for the span after the closes, then quiet"
        );
    }

    #[test]
    fn a_free_held_back_by_the_collect_interval_is_collected_later() {
        use Give::*;
        let mut t = Tidy::default();
        let c = 20_000;
        t.freed(c);
        assert_eq!(t.tick(5, c), Collect);
        // Freed a second after the collect (a burst's second trim): the
        // collect waits for the interval, and comes even though the
        // span of nudges ended before it.
        t.freed(c + 1000);
        assert_eq!(
            ticks(&mut t, 5, c + 1000, 8),
            [Nudge, Nudge, Nudge, Nudge, Collect, Nudge, Nudge, None],
            "the held-back free's collect, then two nudges past the delay"
        );
    }

    #[test]
    fn a_collect_is_followed_by_a_nudge_past_the_purge_delay() {
        use Give::*;
        let mut t = Tidy::default();
        let c = 30_000;
        t.freed(c - 5000);
        assert_eq!(t.tick(5, c - 5000), Collect);
        assert_eq!(ticks(&mut t, 5, c - 4000, 4), [Nudge, Nudge, Nudge, None]);
        // Freed at the span's very end: collected at once (5 s since the
        // last), and nudged after it though the free's own span is short.
        t.freed(c);
        assert_eq!(t.tick(5, c), Collect);
        let after: Vec<u64> = (1..=5u64)
            .filter(|i| t.tick(5, c + i * 1000) != None)
            .map(|i| i * 1000)
            .collect();
        assert!(
            after.iter().any(|ms| *ms >= PURGE_DELAY_MS + 1000),
            "no nudge a whole tick past the purge delay after the collect: {after:?}"
        );
    }

    /// mimalloc's default purge delay.
    const PURGE_DELAY_MS: u64 = 1000;

    #[test]
    fn a_tick_a_little_early_still_nudges() {
        let mut t = Tidy::default();
        t.freed(40_000);
        assert_eq!(t.tick(1, 40_000), Give::Collect);
        assert_eq!(t.tick(1, 40_995), Give::Nudge, "a tick 5 ms early");
        assert!(t.trim_due(40_000));
        assert!(!t.trim_due(40_010), "trimmed twice within a second");
        assert!(t.trim_due(40_995), "a tick 5 ms early");
    }

    #[test]
    fn closing_all_the_time_collects_every_five_seconds() {
        let mut t = Tidy::default();
        let t0 = 50_000;
        let gives: Vec<Give> = (0..10u64)
            .map(|i| t.tick(2 - (i % 2) as usize, t0 + i * 1000))
            .collect();
        let collects = gives.iter().filter(|g| **g == Give::Collect).count();
        assert_eq!(collects, 2, "{gives:?}");
        assert!(gives[1..].iter().all(|g| *g != Give::None), "{gives:?}");
        nudge();
        collect();
    }
}
