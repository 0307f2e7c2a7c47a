//! Layer: base. Live counts (open connections, tunnels) that a drain can wait
//! on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// A live count (connections, tunnels) with a wake-up when it drops to 0.
#[derive(Default)]
pub struct Counter {
    n: AtomicUsize,
    changed: Notify,
}

impl Counter {
    pub fn get(&self) -> usize {
        self.n.load(Ordering::Relaxed)
    }

    /// Waits until the count is 0.
    pub async fn zero(&self) {
        loop {
            let notified = self.changed.notified();
            if self.get() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Holds one unit of a [`Counter`] until dropped.
pub struct Counted(Arc<Counter>);

impl Counted {
    pub fn new(c: Arc<Counter>) -> Counted {
        c.n.fetch_add(1, Ordering::Relaxed);
        Counted(c)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // Waiters only care about reaching zero (the drain).
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.changed.notify_waiters();
        }
    }
}
