//! Layer: server. Request futures built in place in reused heap slots
//! (`InBox`): a plain HTTP/1.1 request's futures — the exchange and the
//! proxy's handling — are a few kilobytes each, past mimalloc's small-block
//! fast path, and `Box::pin(f)` would build each on the stack and copy it
//! in. Here a slot is taken from the thread's kept ones (or allocated
//! before the future is written into it), and a finished or dropped
//! future's slot is kept for the thread's next future of the same type.
//! What it buys is measured as instructions per request
//! (`bench/instructions.py`, docs: benchmarks → instructions per request);
//! a burst's slots go back on the accept loop's tick ([`trim`]).

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::base::freelist::FreeList;

/// Heap slots of finished [`InBox`] futures, kept per thread for the next
/// request's future of the same type: a request's futures are larger than
/// mimalloc's small blocks, so each allocation would leave its fast path.
/// One free list per future type (a request uses two), each holding at most
/// [`SLOTS_MAX`]: enough for a burst of requests in flight at once on the
/// thread, so many connections take kept slots as a few do. What a list did
/// not hand out over a whole period of the accept loop's tick is freed then
/// ([`trim_kept`]): after a burst the thread keeps only what its steady load
/// uses.
const SLOTS_MAX: usize = 1024;

thread_local! {
    static SLOTS: RefCell<Vec<(TypeId, Box<dyn Slots>)>> = const { RefCell::new(Vec::new()) };
}

/// One future type's kept slots.
type Free<F> = FreeList<Pin<Box<Option<F>>>>;

/// A free list of any future type (for [`trim_kept`]).
trait Slots: Any {
    /// Frees the slots not handed out since the last trim; how many.
    fn trim(&mut self) -> usize;
}

impl<F: 'static> Slots for Free<F> {
    fn trim(&mut self) -> usize {
        FreeList::trim(self)
    }
}

/// Runs `f` on the thread's free list for futures of type `F` (made empty
/// the first time). A list is found by its type's id, kept beside it (a
/// compare of constants, not a call through each list's vtable).
#[inline(always)]
fn with_free<F: 'static, R>(f: impl FnOnce(&mut Free<F>) -> R) -> Option<R> {
    let id = TypeId::of::<Free<F>>();
    SLOTS
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let at = match s.iter().position(|(t, _)| *t == id) {
                Some(at) => at,
                None => {
                    s.push((id, Box::new(Free::<F>::new(SLOTS_MAX))));
                    s.len() - 1
                }
            };
            let list = (&mut *s[at].1 as &mut dyn Any).downcast_mut::<Free<F>>()?;
            Some(f(list))
        })
        .ok()
        .flatten()
}

/// A kept slot for futures of type `F`, if the thread has one.
fn take_slot<F: 'static>() -> Option<Pin<Box<Option<F>>>> {
    with_free::<F, _>(Free::take).flatten()
}

/// Keeps an emptied slot for the thread's next future of its type (or frees
/// it, with [`SLOTS_MAX`] kept already).
fn keep_slot<F: 'static>(slot: Pin<Box<Option<F>>>) {
    // A full list gives the (empty) slot back: freed here.
    drop(with_free::<F, _>(|l| l.give(slot)));
}

/// Frees the thread's kept slots that were not handed out since the last
/// call; how many were freed.
pub(super) fn trim() -> usize {
    SLOTS
        .try_with(|s| s.borrow_mut().iter_mut().map(|(_, l)| l.trim()).sum())
        .unwrap_or(0)
}

/// A future built in place in its heap slot: already built when this is
/// made, so moving it moves a pointer (not the unstarted future's captured
/// values). The slot is allocated before the future is built (`Box::pin(f)`
/// builds it on the stack and copies it in: a large memcpy per request),
/// or taken from the thread's kept ones; once the
/// future is done or dropped, its state is dropped in place and the empty
/// slot kept for the next ([`keep_slot`]).
pub(super) struct InBox<F: Future + 'static>(Option<Pin<Box<Option<F>>>>);

impl<F: Future + 'static> InBox<F> {
    pub(super) fn new(make: impl FnOnce() -> F) -> InBox<F> {
        // Allocated before `None` is written: `Box::pin(None)` would write
        // it on the stack and copy the whole slot into the box.
        let mut slot =
            take_slot::<F>().unwrap_or_else(|| Box::into_pin(Box::write(Box::new_uninit(), None)));
        slot.as_mut().set(Some(make()));
        InBox(Some(slot))
    }
}

impl<F: Future + 'static> Future for InBox<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self
            .get_mut()
            .0
            .as_mut()
            .and_then(|s| s.as_mut().as_pin_mut())
        {
            Some(f) => f.poll(cx),
            None => unreachable!("set when made"),
        }
    }
}

impl<F: Future + 'static> Drop for InBox<F> {
    fn drop(&mut self) {
        if let Some(mut slot) = self.0.take() {
            // The future's state goes now, as it would with its box.
            slot.as_mut().set(None);
            keep_slot(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::future::poll_fn;

    /// A future type of its own for the slot tests (the same type at each
    /// call).
    async fn job(x: u32, guard: Option<DropCount>) -> u32 {
        let _guard = guard;
        // One wait before the answer, so a test can drop it midway.
        let mut waited = false;
        poll_fn(|cx| {
            if waited {
                return Poll::Ready(());
            }
            waited = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await;
        x
    }

    async fn other_job() -> u32 {
        7
    }

    /// Counts its drops.
    struct DropCount(std::rc::Rc<Cell<u32>>);

    impl Drop for DropCount {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    fn addr<F: Future + 'static>(b: &InBox<F>) -> usize {
        let slot: &Option<F> = b.0.as_ref().expect("made");
        slot as *const Option<F> as usize
    }

    /// Slots kept for the futures `_make` makes.
    fn kept_slots<F: Future + 'static>(_make: fn(u32, Option<DropCount>) -> F) -> usize {
        with_free::<F, _>(|l| l.len()).unwrap_or(0)
    }

    fn run_to_end<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }

    /// A finished or dropped future's heap slot serves the thread's next
    /// future of the same type (not one of another type); a future dropped
    /// midway has its state dropped then, not when the slot is reused.
    #[test]
    fn inbox_slots_are_kept_per_type_and_reused() {
        let first = InBox::new(|| job(1, None));
        let at = addr(&first);
        assert_eq!(kept_slots(job), 0);
        assert_eq!(run_to_end(first), 1);
        assert_eq!(
            kept_slots(job),
            1,
            "the finished future's slot was not kept"
        );
        let other = InBox::new(other_job);
        assert_ne!(addr(&other), at, "another type took the kept slot");
        assert_eq!(kept_slots(job), 1);
        assert_eq!(run_to_end(other), 7);
        let again = InBox::new(|| job(2, None));
        assert_eq!(addr(&again), at, "the kept slot was not reused");
        assert_eq!(kept_slots(job), 0);
        // Two at once: the second takes a fresh slot; both are kept after.
        let beside = InBox::new(|| job(3, None));
        assert_ne!(addr(&beside), at);
        assert_eq!(run_to_end(again) + run_to_end(beside), 5);
        assert_eq!(kept_slots(job), 2, "the emptied holder was not refilled");
        // Dropped midway: its state (the guard) goes with the drop.
        let drops = std::rc::Rc::new(Cell::new(0));
        let mut midway = Box::pin(InBox::new(|| job(4, Some(DropCount(drops.clone())))));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(midway.as_mut().poll(&mut cx).is_pending());
        assert_eq!(kept_slots(job), 1);
        drop(midway);
        assert_eq!(drops.get(), 1, "the dropped future's state outlived it");
        assert_eq!(kept_slots(job), 2);
    }

    /// At most `SLOTS_MAX` slots are kept per thread.
    #[test]
    fn inbox_keeps_at_most_slots_max() {
        let many: Vec<_> = (0..SLOTS_MAX as u32 + 5)
            .map(|i| InBox::new(move || job(i, None)))
            .collect();
        let sum: u32 = many.into_iter().map(run_to_end).sum();
        assert_eq!(sum, (0..SLOTS_MAX as u32 + 5).sum::<u32>());
        assert_eq!(kept_slots(job), SLOTS_MAX);
    }

    /// The tick's trim frees what a burst left and nothing took since the
    /// last trim.
    #[test]
    fn trim_frees_the_slots_a_burst_left() {
        let burst: Vec<_> = (0..40).map(|i| InBox::new(move || job(i, None))).collect();
        burst.into_iter().for_each(|f| {
            run_to_end(f);
        });
        assert_eq!(kept_slots(job), 40);
        // One taken and given back since the first trim: it stays.
        trim();
        let f = InBox::new(|| job(1, None));
        assert_eq!(run_to_end(f), 1);
        assert_eq!(trim(), 39, "the burst's slots were not freed");
        assert_eq!(kept_slots(job), 1);
    }
}
