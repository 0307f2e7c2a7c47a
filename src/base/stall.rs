//! Layer: base. A stall timer for reads and writes: armed when an operation
//! starts waiting, disarmed by progress, fired when one wait outlasts the
//! limit — nginx's `client_body_timeout` / `proxy_read_timeout` /
//! `send_timeout` ("between two successive operations", not for the whole
//! transfer). The timer is allocated on the first wait only.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

pub struct Stall {
    limit: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl Stall {
    pub fn new(limit: Duration) -> Stall {
        Stall {
            limit,
            timer: None,
            armed: false,
        }
    }

    /// The operation made progress: the next wait starts a fresh limit.
    pub fn progress(&mut self) {
        self.armed = false;
    }

    /// The operation returned `Pending`: arms the timer if this wait is new
    /// and registers for its wake-up. True when the wait outlasted the
    /// limit.
    pub fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = Instant::now() + self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        matches!(timer.as_mut().poll(cx), Poll::Ready(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn fires_only_for_one_long_wait() {
        let mut s = Stall::new(Duration::from_millis(100));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(!s.stalled(&mut cx));
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(!s.stalled(&mut cx));
        s.progress();
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(!s.stalled(&mut cx), "progress restarted the limit");
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(!s.stalled(&mut cx));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert!(s.stalled(&mut cx), "one wait of 110 ms");
    }
}
