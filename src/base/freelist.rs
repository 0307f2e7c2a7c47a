//! Layer: base. A bounded free list of reusable values (read buffers, a
//! request's future slots) that gives back what a burst left behind.
//!
//! A worker keeps what its requests in flight used, so a steady load takes
//! kept values instead of allocating; [`FreeList::trim`], called on the
//! accept loop's coarse tick, frees the values no one took since the last
//! trim (the list's low-water mark over the period): after a burst of
//! thousands of requests at once the thread keeps only what its load still
//! uses, and what was freed goes back to the OS with `tidy`'s nudge.

/// At most `max` kept values, most recently given first out.
#[derive(Debug)]
pub struct FreeList<T> {
    items: Vec<T>,
    /// The fewest values the list held since the last trim: that many
    /// were not taken meanwhile.
    low: usize,
    max: usize,
}

impl<T> FreeList<T> {
    /// An empty list keeping at most `max`.
    pub const fn new(max: usize) -> FreeList<T> {
        FreeList {
            items: Vec::new(),
            low: 0,
            max,
        }
    }

    /// A kept value, if any.
    pub fn take(&mut self) -> Option<T> {
        let t = self.items.pop();
        self.low = self.low.min(self.items.len());
        t
    }

    /// Keeps `t` for the next [`take`](Self::take); gives it back when
    /// `max` are kept already (the caller drops it).
    pub fn give(&mut self, t: T) -> Option<T> {
        if self.items.len() < self.max {
            self.items.push(t);
            None
        } else {
            Some(t)
        }
    }

    /// Frees the values not taken since the last trim; how many.
    pub fn trim(&mut self) -> usize {
        let unused = self.low.min(self.items.len());
        self.items.truncate(self.items.len() - unused);
        self.low = self.items.len();
        if self.items.capacity() > 2 * self.items.len() + 8 {
            self.items.shrink_to(self.items.len());
        }
        unused
    }

    /// How many are kept.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when none are kept.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trim frees what was not taken since the last one and keeps what a
    /// steady load took, however many a burst left; `max` bounds the list.
    #[test]
    fn trim_frees_only_what_was_not_taken_since_the_last_trim() {
        let mut l = FreeList::new(50);
        for i in 0..60 {
            let back = l.give(i);
            assert_eq!(back.is_some(), i >= 50, "max not kept to");
        }
        assert_eq!(l.len(), 50);
        assert_eq!(
            l.trim(),
            0,
            "never taken, but held from before the first trim"
        );
        // A steady load: at most 3 out at once.
        for _ in 0..5 {
            let three: Vec<_> = (0..3).filter_map(|_| l.take()).collect();
            assert_eq!(three.len(), 3);
            three.into_iter().for_each(|t| assert!(l.give(t).is_none()));
        }
        assert_eq!(l.len(), 50);
        assert_eq!(l.trim(), 47, "the unused ones were not freed");
        assert_eq!(l.len(), 3, "the steady load's were freed");
        assert!(
            l.items.capacity() < 50,
            "the list's own room was not given back"
        );
        assert_eq!(l.trim(), 3, "nothing taken since: all go");
        assert!(l.is_empty());
        assert!(l.items.capacity() <= 8);
        assert_eq!(l.trim(), 0);
        assert_eq!(l.take(), None);
    }
}
