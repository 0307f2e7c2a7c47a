//! Layer: base. A bound on the files one client connection's responses hold
//! open at once. An HTTP/2 connection may carry `max_concurrent_streams`
//! answers together, each of which could keep a file open while its client
//! holds its window shut; the server layer gives each connection one
//! [`FileSlots`] (a request extension) and a static answer takes a
//! [`FileSlot`] before it opens a file — waiting for one without holding a
//! descriptor — and gives it back when its body ends or is dropped.
//! HTTP/1.1 answers one request at a time and carries none.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a stream waits for a slot when the send timeout is off: the
/// streams holding the slots are then never cut, so a bound of its own.
pub const UNTIMED_WAIT_MS: u64 = 60_000;

/// One connection's file slots (cheap to clone: shared).
#[derive(Debug, Clone)]
pub struct FileSlots {
    sem: Arc<Semaphore>,
    wait_ms: u64,
}

/// One open file's place in its connection's bound, given back on drop.
#[derive(Debug)]
pub struct FileSlot {
    _permit: OwnedSemaphorePermit,
}

impl FileSlots {
    /// `limit` slots (`None` for 0: no bound of its own), a slot waited for
    /// at most `wait_ms` ([`UNTIMED_WAIT_MS`] for 0).
    pub fn new(limit: usize, wait_ms: u64) -> Option<FileSlots> {
        (limit > 0).then(|| FileSlots {
            sem: Arc::new(Semaphore::new(limit)),
            wait_ms: if wait_ms == 0 {
                UNTIMED_WAIT_MS
            } else {
                wait_ms
            },
        })
    }

    /// A slot if one is free now.
    pub fn try_take(&self) -> Option<FileSlot> {
        self.sem
            .clone()
            .try_acquire_owned()
            .ok()
            .map(|p| FileSlot { _permit: p })
    }

    /// A slot, waited for at most the connection's wait; `None` when none
    /// came free in time.
    pub async fn take(&self) -> Option<FileSlot> {
        let wait = Duration::from_millis(self.wait_ms);
        match tokio::time::timeout(wait, self.sem.clone().acquire_owned()).await {
            Ok(Ok(p)) => Some(FileSlot { _permit: p }),
            _ => None,
        }
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.sem.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn slots_are_bounded_given_back_on_drop_and_waited_for_in_time() {
        assert!(FileSlots::new(0, 100).is_none());
        let s = FileSlots::new(2, 100).unwrap();
        let a = s.try_take().unwrap();
        let _b = s.try_take().unwrap();
        assert!(s.try_take().is_none());
        assert!(s.take().await.is_none(), "none free within the wait");
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.take().await.is_some() });
        tokio::task::yield_now().await;
        drop(a);
        assert!(waiter.await.unwrap(), "a slot given back goes to a waiter");
        assert_eq!(s.free(), 1);
    }
}
