//! Layer: server. The accept loop's scheduler that gives memory freed by
//! closed connections (and the pools' trims) back to the OS.
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
//! every two seconds: a free held back is collected later, never
//! skipped) and nudges twice more, two seconds apart, so the last purge
//! comes after everything freed (nothing is done on a steady worker that
//! frees nothing).
//!
//! What it buys is measured as the memory an idle gateway holds after a
//! burst of connections has closed (`bench/idle_conns.py`, docs:
//! benchmarks → idle connections: without it, 2.11× the memory before the
//! burst) and checked by `tests/allocator.rs` and `tests/allocator_purge.rs`.

/// Above mimalloc's largest size class (512 KiB): a page of its own, whose
/// free runs the arena purge.
const HUGE: usize = 1 << 20;

/// The block [`collect`] cycles: above mimalloc's small fast path (1 KiB;
/// a larger block always takes the slow path, which counts the
/// housekeeping rounds), in its small pages (up to 10 KiB; this one's
/// class holds 8 to 10 KiB, which a doubling buffer never asks for).
/// The collect keeps the last page of its own class (its own cycling
/// retires it again and again): a small page pins at most 64 KiB of the
/// memory a burst freed and the arena hands back before purging it. A
/// large block (256 KiB) kept a 4 MiB page, which a burst's freed pages
/// could fill: 4 MB resident after every connection had closed.
const CYCLED: usize = 9 << 10;

/// Slow-path allocations for every retired page to expire: 16 rounds of
/// 1000, and one round more.
const ROUNDS: usize = 17 * 1000;

/// Allocates and frees one huge block (never touched: no page is faulted in).
pub fn nudge() {
    let v: Vec<u8> = Vec::with_capacity(HUGE);
    drop(std::hint::black_box(v));
}

/// Frees this thread's retired pages: [`ROUNDS`] blocks of [`CYCLED`]
/// bytes allocated and freed (never touched; well under a millisecond).
/// Their pages go back to the OS at a [`nudge`] past the purge delay.
pub fn collect() {
    for _ in 0..ROUNDS {
        let v: Vec<u8> = Vec::with_capacity(CYCLED);
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
/// the first tick allowed, so pages freed while collects are held back
/// are collected later, never left behind. A collect is a nudge too, and
/// nudges come at most every [`Tidy::NUDGE_MS`] (so collects do as
/// well), [`Tidy::NUDGES`] of them after the last free or collect. Their
/// spacing is mimalloc's: a nudge purges what was scheduled a purge delay
/// (1 s) before it, and its own freed block schedules the next purge then;
/// nudges one second apart purge only every other time, and the last
/// could leave what came since the one before it resident for good. Two
/// seconds apart, each nudge purges everything freed since the one
/// before, and the second after a free comes surely past its delay.
#[derive(Debug, Default)]
pub struct Tidy {
    last: usize,
    /// Nudges still to give.
    nudges: u8,
    /// The last nudge or collect (`now_ms`; 0: none yet).
    nudged: u64,
    /// Memory was freed since the last collect.
    due: bool,
    /// The last [`trim_due`](Self::trim_due) that said yes (`now_ms`).
    trimmed: u64,
}

impl Tidy {
    /// Nudges after the last free or collect.
    const NUDGES: u8 = 2;
    /// The time between two nudges (a collect nudges too, so it is also
    /// the shortest time between two collects): twice mimalloc's purge
    /// delay, less room for a tick that comes a little early.
    pub const NUDGE_MS: u64 = 1900;
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

    /// Memory was freed (not by closed connections): collect and nudge as
    /// after closes.
    pub fn freed(&mut self) {
        self.due = true;
        self.nudges = Self::NUDGES;
    }

    /// A tick at `now` (`now_ms`) with `open` connections: what to do.
    pub fn tick(&mut self, open: usize, now: u64) -> Give {
        if open < self.last {
            self.freed();
        }
        self.last = open;
        if self.nudged != 0 && now < self.nudged + Self::NUDGE_MS {
            return Give::None;
        }
        if self.due {
            self.due = false;
            self.nudged = now;
            self.nudges = Self::NUDGES;
            return Give::Collect;
        }
        if self.nudges == 0 {
            return Give::None;
        }
        self.nudges -= 1;
        self.nudged = now;
        Give::Nudge
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Give::{Collect, Nudge};

    /// The ticks of one second each from `from` (ms), `n` of them, with
    /// `open` connections: what each says.
    fn ticks(t: &mut Tidy, open: usize, from: u64, n: u64) -> Vec<Give> {
        (0..n).map(|i| t.tick(open, from + i * 1000)).collect()
    }

    #[test]
    fn collects_after_closes_then_nudges_every_other_second() {
        let mut t = Tidy::default();
        let t0 = 10_000;
        assert_eq!(t.tick(0, t0), Give::None, "nothing freed yet");
        assert_eq!(
            t.tick(10, t0 + 100),
            Give::None,
            "connections opening: nothing to give back"
        );
        assert_eq!(t.tick(3, t0 + 200), Collect, "the first after closes");
        assert_eq!(t.tick(3, t0 + 300), Give::None);
        assert_eq!(
            ticks(&mut t, 3, t0 + 1200, 6),
            [Give::None, Nudge, Give::None, Nudge, Give::None, Give::None],
            "two nudges two seconds apart after the collect, then quiet"
        );
    }

    #[test]
    fn a_free_held_back_by_the_collect_interval_is_collected_later() {
        let mut t = Tidy::default();
        let c = 20_000;
        t.freed();
        assert_eq!(t.tick(5, c), Collect);
        // Freed a second after the collect (a burst's second trim): the
        // collect waits for the interval, then comes, and two nudges
        // after it.
        t.freed();
        assert_eq!(
            ticks(&mut t, 5, c + 1000, 7),
            [
                Give::None,
                Collect,
                Give::None,
                Nudge,
                Give::None,
                Nudge,
                Give::None
            ]
        );
    }

    /// mimalloc's purge delay.
    const PURGE_DELAY_MS: u64 = 1000;

    /// Every nudge comes at least twice the purge delay (less a tick's
    /// earliness) after the one before, and the second after a free comes
    /// past the delay from the free, however the free falls between
    /// ticks.
    #[test]
    fn nudges_are_spaced_past_the_purge_delay() {
        // The free on the tick of a nudge, or on the tick between two.
        for free_tick in [2u64, 3] {
            let mut t = Tidy::default();
            let t0 = 30_000;
            let last_free = t0 + free_tick * 1000;
            t.freed();
            assert_eq!(t.tick(1, t0), Collect);
            let mut at = vec![t0];
            for i in 1..12u64 {
                let now = t0 + i * 1000;
                if now == last_free {
                    t.freed();
                }
                if t.tick(1, now) != Give::None {
                    at.push(now);
                }
            }
            for w in at.windows(2) {
                assert!(w[1] - w[0] >= 2 * PURGE_DELAY_MS - 100, "{at:?}");
            }
            let after: Vec<&u64> = at.iter().filter(|n| **n >= last_free).collect();
            assert!(
                after.len() >= 2 && *after[1] >= last_free + PURGE_DELAY_MS,
                "no second nudge past the delay after the free at {last_free}: {at:?}"
            );
        }
    }

    #[test]
    fn a_tick_a_little_early_still_nudges() {
        let mut t = Tidy::default();
        t.freed();
        assert_eq!(t.tick(1, 40_000), Collect);
        assert_eq!(t.tick(1, 41_995), Nudge, "a tick 5 ms early");
        assert!(t.trim_due(40_000));
        assert!(!t.trim_due(40_010), "trimmed twice within a second");
        assert!(t.trim_due(40_995), "a tick 5 ms early");
    }

    #[test]
    fn closing_all_the_time_collects_every_other_second() {
        let mut t = Tidy::default();
        let t0 = 50_000;
        let gives: Vec<Give> = (0..10u64)
            .map(|i| t.tick(2 - (i % 2) as usize, t0 + i * 1000))
            .collect();
        let at: Vec<usize> = (0..10).filter(|i| gives[*i] == Collect).collect();
        assert_eq!(at, [1, 3, 5, 7, 9], "{gives:?}");
        nudge();
        collect();
    }
}
