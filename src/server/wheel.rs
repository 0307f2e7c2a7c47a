//! Layer: server. The idle wake-up wheel of one accept loop: an idle
//! HTTP/1.1 connection waits on the slot of the accept loop's first tick
//! at or past its idle deadline, and a tick wakes only the slots it has
//! reached (a hashed timing wheel, as nginx's timer tree or tokio's wheel,
//! with the accept loop's coarse tick as its clock and no timer per
//! connection). Waking every idle connection on every tick cost a task
//! poll per connection per tick and, with thousands idle, grew the
//! worker's run queue to hold them all at once (128 KiB for 9,500, kept
//! for good by the runtime). A lap of the wheel spans the idle timeout
//! (its slots are as wide as a tick, or wider when the timeout is long),
//! so a connection is not woken a lap early, as all those that went idle
//! in the same slot would be together.

use std::sync::Arc;

use tokio::sync::Notify;

/// Slots (64 bytes each): a deadline further than a lap away wakes its
/// connection once a lap early (it then waits again on the same slot).
const SLOTS: u64 = 256;

/// The wheel: one wake-up per slot, each slot `width` ms of deadlines.
#[derive(Debug)]
pub struct Wheel {
    slots: Box<[Arc<Notify>]>,
    width: u64,
}

impl Wheel {
    /// A wheel for ticks every `period_ms`, whose lap spans `longest_ms`
    /// (the longest idle timeout) and a slot more: slots a tick wide, or
    /// wider when the timeout is longer than the slots' ticks (a
    /// connection is then closed up to a slot's width past its deadline,
    /// under 1% of the timeout).
    pub fn new(period_ms: u64, longest_ms: u64) -> Wheel {
        Wheel {
            slots: (0..SLOTS).map(|_| Arc::new(Notify::new())).collect(),
            width: period_ms.max(longest_ms.div_ceil(SLOTS - 2)).max(1),
        }
    }

    /// The slot boundary (its number) that first reaches `due` (`now_ms`):
    /// the first at or past it.
    fn tick_of(&self, due: u64) -> u64 {
        due.div_ceil(self.width)
    }

    /// The wake-up of a connection to be closed at `due` (`now_ms`).
    pub fn slot(&self, due: u64) -> &Arc<Notify> {
        &self.slots[(self.tick_of(due) % SLOTS) as usize]
    }

    /// The tick at `now` (`now_ms`) after one at `last`: wakes the slots
    /// whose boundaries it passed since (every slot after a lap or more).
    pub fn advance(&self, last: u64, now: u64) {
        let (from, to) = (last / self.width, now / self.width);
        if to.saturating_sub(from) >= SLOTS {
            return self.wake_all();
        }
        for t in from + 1..=to {
            self.slots[(t % SLOTS) as usize].notify_waiters();
        }
    }

    /// Wakes every waiting connection (the drain began, or a new
    /// configuration may have moved their deadlines).
    pub fn wake_all(&self) {
        for s in self.slots.iter() {
            s.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};

    /// Whether a wait registered on `wheel.slot(due)` has been woken after
    /// `ticks` (pairs of `advance` arguments).
    fn woken(wheel: &Wheel, due: u64, ticks: &[(u64, u64)]) -> bool {
        let mut wait = pin!(wheel.slot(due).clone().notified_owned());
        wait.as_mut().enable();
        for &(last, now) in ticks {
            wheel.advance(last, now);
        }
        let mut cx = Context::from_waker(Waker::noop());
        wait.as_mut().poll(&mut cx).is_ready()
    }

    #[test]
    fn a_tick_wakes_the_connections_due_by_it_and_no_others() {
        let w = Wheel::new(250, 1000);
        // Due at 1100: the tick reaching it is the one at 1250 (tick 5).
        assert!(!woken(&w, 1100, &[(750, 1000)]), "woken before its due");
        assert!(!woken(&w, 1100, &[(1000, 1249)]), "woken before its tick");
        assert!(woken(&w, 1100, &[(1000, 1250)]));
        // A late tick reaches every slot it passed.
        assert!(woken(&w, 1100, &[(1000, 1700)]));
        // Due exactly on a tick: that tick.
        assert!(woken(&w, 1000, &[(999, 1000)]));
        assert!(!woken(&w, 1001, &[(999, 1000)]));
    }

    #[test]
    fn a_tick_after_a_lap_or_more_wakes_everyone() {
        let w = Wheel::new(10, 0);
        assert!(woken(&w, 5_000, &[(0, SLOTS * 10)]));
        // Due further than a lap: woken a lap early (its slot comes round
        // first), never late.
        let due = 10 * (SLOTS + 3);
        assert!(woken(&w, due, &[(0, 30)]));
    }

    #[test]
    fn a_lap_spans_the_longest_idle_timeout() {
        // A tick every 250 ms and a 600 s timeout: slots of 2.4 s, so a
        // connection idle since 0 is not woken before its deadline (a lap
        // of 64 slots, as for 250 ms slots, would wake it at 16 s).
        let w = Wheel::new(250, 600_000);
        assert!(!woken(&w, 600_000, &[(0, 599_000)]));
        assert!(woken(&w, 600_000, &[(599_000, 602_400)]));
    }

    #[test]
    fn wake_all_reaches_every_slot() {
        let w = Wheel::new(100, 0);
        let mut waits: Vec<_> = (0..SLOTS)
            .map(|t| Box::pin(w.slot(t * 100).clone().notified_owned()))
            .collect();
        for wait in &mut waits {
            wait.as_mut().enable();
        }
        w.wake_all();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(waits
            .iter_mut()
            .all(|w| w.as_mut().poll(&mut cx).is_ready()));
    }
}
