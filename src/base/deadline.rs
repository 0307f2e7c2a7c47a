//! Layer: base. Coarse per-thread deadlines for request-path timeouts (the
//! upstream attempt's response timeout): like nginx's timer tree per worker,
//! not a tokio timer per request. A waiting request puts its deadline and
//! waker into its thread's table (a slab: no allocation once warm, no lock);
//! one ticker task per worker thread sleeps on a single tokio timer until the
//! earliest deadline and wakes the requests whose deadline has passed.
//!
//! Granularity: deadlines are read on the coarse millisecond clock
//! (`clock::now_ms`, `CLOCK_MONOTONIC_COARSE`: one kernel tick, 1–4 ms), and
//! each deadline is set one tick further for the reading's lag. That lag is
//! not bounded by the tick (delayed ticks on a VM or an idle CPU: 7 ms seen
//! with a 4 ms tick), so the coarse clock only says when to look: once it
//! reads a deadline passed, the precise clock (`Instant`, read at the
//! deadline's start and there) decides, and a deadline not yet due is
//! re-armed. A timeout never fires before its nominal time, and fires
//! about one coarse lag after it (plus tokio's 1 ms timer resolution for
//! the ticker).
//!
//! The table is thread-local, so only a current-thread runtime (every
//! graygate worker) uses it; elsewhere (a multi-thread runtime, where the
//! ticker could run on another thread) a [`Deadline`] takes a tokio timer
//! at its first wait.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};

use super::clock::{now_ms, tick_ms};

/// The timeout passed before the future finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

#[derive(Default)]
struct Table {
    /// Deadline (`now_ms`) and waker of each waiting request.
    slots: Vec<Option<(u64, Waker)>>,
    free: Vec<usize>,
    /// A ticker task runs on this thread.
    ticker: bool,
    /// When the ticker wakes next (`u64::MAX`: not armed).
    armed: u64,
    /// The ticker's waker, to re-arm it for an earlier deadline.
    ticker_waker: Option<Waker>,
    /// The shortest limit seen: the idle ticker sleeps that long, so a
    /// new deadline is never earlier than its wake-up (no wake per request).
    min_limit: u64,
}

thread_local! {
    static TABLE: RefCell<Table> = RefCell::new(Table {
        armed: u64::MAX,
        min_limit: u64::MAX,
        ..Table::default()
    });
}

impl Table {
    fn insert(&mut self, at: u64, waker: &Waker) -> usize {
        let entry = Some((at, waker.clone()));
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = entry;
                i
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, i: usize) {
        if let Some(slot) = self.slots.get_mut(i) {
            if slot.take().is_some() {
                self.free.push(i);
            }
        }
    }

    /// Wakes the entries due at `now`; the earliest deadline left.
    fn expire(&mut self, now: u64) -> Option<u64> {
        let mut next: Option<u64> = None;
        for slot in self.slots.iter_mut() {
            let Some((at, w)) = slot else { continue };
            if *at <= now {
                w.wake_by_ref();
                // Woken once: the request sees its deadline passed when
                // polled (and removes its entry then).
                *at = u64::MAX;
            } else if *at != u64::MAX {
                next = Some(next.map_or(*at, |n| n.min(*at)));
            }
        }
        next
    }
}

/// Gives back the slots a burst of waiting requests left on this thread's
/// table (the accept loop's coarse tick calls this): the free slots past
/// the last one in use go, and the table's capacity shrinks to fit; how
/// many slots went.
pub fn trim() -> usize {
    TABLE
        .try_with(|t| {
            let mut t = t.borrow_mut();
            let before = t.slots.len();
            while matches!(t.slots.last(), Some(None)) {
                t.slots.pop();
            }
            let len = t.slots.len();
            if len < before {
                t.free.retain(|&i| i < len);
            }
            if t.slots.capacity() > 2 * len + 16 {
                t.slots.shrink_to(len);
            }
            let free = t.free.len();
            if t.free.capacity() > 2 * free + 16 {
                t.free.shrink_to(free);
            }
            before - len
        })
        .unwrap_or(0)
}

/// The coarse clock's reading (`now_ms`); tests can make it lag further.
fn coarse_now() -> u64 {
    #[cfg(test)]
    return now_ms().saturating_sub(tests::EXTRA_LAG_MS.get());
    #[cfg(not(test))]
    now_ms()
}

/// `d` in whole milliseconds, rounded up.
fn ms_ceil(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX / 2)
}

/// The coarse reading at which a deadline `limit_ms` from now is looked at:
/// one tick further for the reading's usual lag.
fn coarse_at(limit_ms: u64) -> u64 {
    coarse_now()
        .saturating_add(limit_ms)
        .saturating_add(tick_ms())
}

/// A deadline on this thread's table: polled by a waiting operation, which
/// learns whether it has passed (and is woken when it does). Not tied to a
/// future: the inline upstream exchange checks it at each of its waits.
/// On a runtime other than a current-thread one (no per-thread ticker), a
/// tokio timer is used instead, allocated at the first wait.
pub struct Deadline {
    /// When to look (coarse clock, `now_ms`).
    at: u64,
    /// When it passes (precise clock).
    end: Instant,
    limit_ms: u64,
    entry: Entry,
    fallback: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Deadline {
    /// `limit` from now, never sooner (see the module's summary: a
    /// deadline read early on the coarse clock once let an attempt capped
    /// by a request's total deadline end before it, and be retried).
    pub fn after(limit: Duration) -> Deadline {
        Deadline::after_from(Instant::now(), limit)
    }

    /// `limit` from `start`, a precise reading the caller already took
    /// (not later than now): ends at `start + limit` exactly; the coarse
    /// clock is looked at from now, as in [`after`](Self::after), so the
    /// deadline is never looked at sooner than there.
    pub fn after_from(start: Instant, limit: Duration) -> Deadline {
        let limit_ms = ms_ceil(limit);
        Deadline {
            at: coarse_at(limit_ms),
            end: start + limit,
            limit_ms,
            entry: Entry { slot: None },
            fallback: None,
        }
    }

    /// Called when the guarded operation is pending: true once the
    /// deadline has passed; else the task is woken when it does.
    pub fn passed(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(sleep) = &mut self.fallback {
            return sleep.as_mut().poll(cx).is_ready();
        }
        if coarse_now() >= self.at {
            let now = Instant::now();
            if now >= self.end {
                return true;
            }
            // The coarse clock ran ahead of its usual lag: look again then.
            self.at = coarse_at(ms_ceil(self.end - now));
        }
        match self.entry.slot {
            Some(i) => refresh(i, self.at, cx.waker()),
            None => {
                let coarse = Handle::try_current()
                    .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread);
                if !coarse {
                    let mut sleep = Box::pin(tokio::time::sleep_until(self.end.into()));
                    let fired = sleep.as_mut().poll(cx).is_ready();
                    self.fallback = Some(sleep);
                    return fired;
                }
                self.entry.slot = Some(register(self.at, self.limit_ms, cx.waker()));
            }
        }
        false
    }

    /// Runs `fut` until it finishes or this deadline passes: one deadline
    /// guards each wait of an exchange in turn (connect, write, head read).
    pub async fn within<F: Future>(&mut self, fut: F) -> Result<F::Output, Elapsed> {
        let mut fut = pin!(fut);
        poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Ok(out)),
            Poll::Pending if self.passed(cx) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        })
        .await
    }
}

/// Runs `fut` for at most `limit` ([`Deadline`]).
pub fn timeout<F: Future>(limit: Duration, fut: F) -> Timeout<F> {
    Timeout {
        fut,
        deadline: Deadline::after(limit),
    }
}

pin_project_lite::pin_project! {
    /// The future of [`timeout`].
    pub struct Timeout<F> {
        #[pin]
        fut: F,
        deadline: Deadline,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        if this.deadline.passed(cx) {
            return Poll::Ready(Err(Elapsed));
        }
        Poll::Pending
    }
}

/// Takes a slot for `at`, making sure this thread's ticker runs and wakes
/// by then.
fn register(at: u64, limit_ms: u64, waker: &Waker) -> usize {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let i = t.insert(at, waker);
        t.min_limit = t.min_limit.min(limit_ms.max(1));
        if !t.ticker {
            t.ticker = true;
            t.armed = at;
            tokio::spawn(ticker());
        } else if at < t.armed {
            t.armed = at;
            if let Some(w) = &t.ticker_waker {
                w.wake_by_ref();
            }
        }
        i
    })
}

/// A later poll of a waiting request: the waker may have changed, and a
/// woken entry whose deadline the clock had not quite reached is re-armed.
fn refresh(i: usize, at: u64, waker: &Waker) {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let mut rearm = false;
        if let Some(Some((a, w))) = t.slots.get_mut(i) {
            if !w.will_wake(waker) {
                w.clone_from(waker);
            }
            if *a == u64::MAX {
                *a = at;
                rearm = true;
            }
        }
        if rearm && at < t.armed {
            t.armed = at;
            if let Some(w) = &t.ticker_waker {
                w.wake_by_ref();
            }
        }
    })
}

/// A request's slot, given back when it finishes, times out or is dropped.
struct Entry {
    slot: Option<usize>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            // `try_with`: a thread being torn down has no table left.
            let _ = TABLE.try_with(|t| t.borrow_mut().remove(i));
        }
    }
}

/// Marks the thread's ticker gone when its task is dropped (its runtime
/// shut down): the next deadline starts another.
struct TickerAlive;

impl Drop for TickerAlive {
    fn drop(&mut self) {
        let _ = TABLE.try_with(|t| {
            let mut t = t.borrow_mut();
            t.ticker = false;
            t.ticker_waker = None;
            t.armed = u64::MAX;
        });
    }
}

/// The thread's ticker: sleeps until the earliest deadline (or, with none
/// waiting, for the shortest limit seen) and wakes the requests due.
async fn ticker() {
    let _alive = TickerAlive;
    let sleep = tokio::time::sleep(Duration::ZERO);
    let mut sleep = pin!(sleep);
    let mut wake_at = 0;
    poll_fn(|cx| loop {
        let now = coarse_now();
        let next = TABLE.with(|t| {
            let mut t = t.borrow_mut();
            let due = t.expire(now);
            let next = if t.armed > now && t.armed != u64::MAX {
                // Re-armed for an earlier deadline meanwhile.
                due.map_or(t.armed, |d| d.min(t.armed))
            } else {
                due.unwrap_or_else(|| now.saturating_add(t.min_limit))
            };
            t.armed = next;
            if !t
                .ticker_waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                t.ticker_waker = Some(cx.waker().clone());
            }
            next
        });
        if next != wake_at {
            wake_at = next;
            let left = Duration::from_millis(next.saturating_sub(now));
            sleep.as_mut().reset(tokio::time::Instant::now() + left);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Pending => return Poll::<()>::Pending,
            // Due (as the coarse clock may read a little behind tokio's,
            // an early wake-up just looks again).
            Poll::Ready(()) => wake_at = 0,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Fails (instead of hanging) when the deadline never fires.
    async fn bounded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(5), f)
            .await
            .expect("the deadline never fired")
    }

    fn waiting() -> usize {
        TABLE.with(|t| t.borrow().slots.iter().filter(|s| s.is_some()).count())
    }

    #[tokio::test]
    async fn a_stuck_future_times_out_within_the_clock_granularity() {
        let t0 = Instant::now();
        let r = bounded(timeout(
            Duration::from_millis(60),
            std::future::pending::<()>(),
        ))
        .await;
        let took = t0.elapsed();
        assert_eq!(r, Err(Elapsed));
        // One coarse tick (≤ 4 ms at HZ=250; 10 ms allows HZ=100) early at
        // most; late only by scheduling.
        assert!(took >= Duration::from_millis(50), "fired early: {took:?}");
        assert_eq!(waiting(), 0, "entry given back");
    }

    thread_local! {
        /// Subtracted from the coarse clock's readings ([`coarse_now`]).
        pub(super) static EXTRA_LAG_MS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// A coarse reading that lagged far behind (a delayed tick) when the
    /// deadline started does not make it pass early: the precise clock
    /// decides.
    #[tokio::test]
    async fn a_coarse_clock_lagging_at_the_start_does_not_pass_a_deadline_early() {
        // The lag must fit under the reading (it starts at 1 with the
        // process's first): at most 15 ms of this loop, once.
        while now_ms() <= 15 {
            std::thread::yield_now();
        }
        let limit = Duration::from_millis(20);
        let t0 = Instant::now();
        EXTRA_LAG_MS.set(15);
        let stuck = timeout(limit, std::future::pending::<()>());
        EXTRA_LAG_MS.set(0);
        let r = bounded(stuck).await;
        let took = t0.elapsed();
        assert_eq!(r, Err(Elapsed));
        assert!(took >= limit, "passed early: {took:?} < {limit:?}");
        assert_eq!(waiting(), 0, "entry given back");
    }

    /// Never before its nominal time on the precise clock, however the
    /// coarse clock's readings fall (many short limits, each started at a
    /// different point of a tick).
    #[tokio::test]
    async fn a_deadline_never_passes_before_its_limit() {
        for i in 0..300u64 {
            let limit = Duration::from_micros(1_000 + i * 37 % 3_000);
            let t0 = Instant::now();
            let r = bounded(timeout(limit, std::future::pending::<()>())).await;
            let took = t0.elapsed();
            assert_eq!(r, Err(Elapsed));
            assert!(took >= limit, "passed early: {took:?} < {limit:?}");
        }
    }

    #[tokio::test]
    async fn a_finished_future_wins_and_gives_its_slot_back() {
        let r = timeout(Duration::from_secs(30), async {
            tokio::task::yield_now().await;
            7
        })
        .await;
        assert_eq!(r, Ok(7));
        assert_eq!(waiting(), 0);
        // A dropped waiter gives its slot back too.
        let f = timeout(Duration::from_secs(30), std::future::pending::<()>());
        let polled = tokio::time::timeout(Duration::from_millis(20), f).await;
        assert!(polled.is_err());
        assert_eq!(waiting(), 0);
    }

    /// What a burst of waiters left goes back at a trim: the free slots
    /// past the last one in use, and the table's room; a waiter still in
    /// the table keeps its slot and still fires, and new waiters find
    /// their slots after the trim.
    #[tokio::test]
    async fn a_trim_gives_back_what_a_burst_of_waiters_left() {
        let mut cx = Context::from_waker(Waker::noop());
        let mut burst: Vec<_> = (0..1000)
            .map(|i| {
                let limit = Duration::from_millis(if i == 0 { 30 } else { 30_000 });
                Box::pin(timeout(limit, std::future::pending::<()>()))
            })
            .collect();
        for w in &mut burst {
            assert!(w.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(waiting(), 1000);
        let last = burst.pop().unwrap();
        let first = burst.remove(0);
        drop(burst);
        assert_eq!(trim(), 0, "the last slot is in use");
        drop(last);
        assert_eq!(trim(), 999, "every slot after the first one's");
        let (len, room) = TABLE.with(|t| (t.borrow().slots.len(), t.borrow().slots.capacity()));
        assert_eq!(len, 1);
        assert!(room <= 16, "the table kept room for {room}");
        // Waiters after the trim: slots of their own (the first's is taken).
        let mut after: Vec<_> = (0..3)
            .map(|_| {
                Box::pin(timeout(
                    Duration::from_secs(30),
                    std::future::pending::<()>(),
                ))
            })
            .collect();
        for w in &mut after {
            assert!(w.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(waiting(), 4);
        assert_eq!(
            bounded(first).await,
            Err(Elapsed),
            "the one in use still fires"
        );
        drop(after);
        assert_eq!(waiting(), 0);
        assert_eq!(trim(), 4);
        assert_eq!(TABLE.with(|t| t.borrow().free.len()), 0);
    }

    /// A short limit registered while the ticker sleeps for a long one
    /// still fires on time (the ticker is re-armed earlier).
    #[tokio::test]
    async fn an_earlier_deadline_rearms_the_ticker() {
        let long = tokio::spawn(timeout(
            Duration::from_secs(30),
            std::future::pending::<()>(),
        ));
        tokio::task::yield_now().await;
        let t0 = Instant::now();
        let r = bounded(timeout(
            Duration::from_millis(40),
            std::future::pending::<()>(),
        ))
        .await;
        assert_eq!(r, Err(Elapsed));
        assert!(t0.elapsed() >= Duration::from_millis(30));
        long.abort();
    }

    /// Off a current-thread runtime the deadline takes a tokio timer (the
    /// thread's table is not used).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_a_multi_thread_runtime_a_tokio_timer_fires() {
        let r = bounded(timeout(
            Duration::from_millis(30),
            std::future::pending::<()>(),
        ))
        .await;
        assert_eq!(r, Err(Elapsed));
        assert!(!TABLE.with(|t| t.borrow().ticker), "no ticker started");
    }
}
