//! Layer: server. One client connection: an I/O wrapper that records activity,
//! a response-body guard that marks requests in flight, and the watchdog that
//! enforces the header-read (slowloris), send (a client that stops reading)
//! and idle keep-alive timeouts and turns a shutdown signal into hyper's
//! graceful close.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::base::clock::now_ms;

/// What the watchdog knows about a connection.
#[derive(Debug, Default)]
pub struct Activity {
    /// Last read or write (`now_ms`).
    last: AtomicU64,
    /// When the first byte of a not-yet-parsed request head arrived; 0 = none.
    head_started: AtomicU64,
    /// Requests whose response has not been fully sent.
    in_flight: AtomicUsize,
    /// Since when a write has been waiting for the client to read; 0 = none.
    write_blocked: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        let a = Activity::default();
        a.last.store(now_ms(), Ordering::Relaxed);
        Arc::new(a)
    }

    /// A request head was parsed: the header timer stops.
    pub fn request_started(self: &Arc<Self>) -> InFlight {
        self.head_started.store(0, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

/// Held by a response body until it is fully sent (or dropped).
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last.store(now_ms(), Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request "in flight" until done.
pub type Tracked = crate::base::body::Guarded<InFlight, crate::proxy::record::Recorded>;

/// A client stream that records reads and writes in [`Activity`].
pub struct TimedIo<T> {
    inner: T,
    act: Arc<Activity>,
}

impl<T> TimedIo<T> {
    pub fn new(inner: T, act: Arc<Activity>) -> TimedIo<T> {
        TimedIo { inner, act }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for TimedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let now = now_ms();
            let a = &self.act;
            a.last.store(now, Ordering::Relaxed);
            if a.in_flight.load(Ordering::Relaxed) == 0 {
                let _ =
                    a.head_started
                        .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TimedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        match r {
            Poll::Ready(Ok(n)) if n > 0 => {
                self.act.last.store(now_ms(), Ordering::Relaxed);
                self.act.write_blocked.store(0, Ordering::Relaxed);
            }
            Poll::Pending => {
                let _ = self.act.write_blocked.compare_exchange(
                    0,
                    now_ms(),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            _ => {}
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A [`TimedIo`] that also passes vectored writes through, for HTTP/2: the
/// h2 codec writes a frame head and its payload as two buffers, which then
/// go out in one write (over TLS: one record, one system call) instead of
/// two. HTTP/1.1 keeps the plain [`TimedIo`], whose single flattened write
/// per response hyper chooses for it.
pub struct TimedIoV<T>(TimedIo<T>);

impl<T> TimedIoV<T> {
    pub fn new(inner: T, act: Arc<Activity>) -> TimedIoV<T> {
        TimedIoV(TimedIo::new(inner, act))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for TimedIoV<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TimedIoV<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let io = &mut self.0;
        let r = Pin::new(&mut io.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            io.act.last.store(now_ms(), Ordering::Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.0.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// What the watchdog decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing due; look again after this long.
    Wait(Duration),
    /// A request head has been arriving for too long: drop the connection.
    HeaderTimeout,
    /// A response write has waited for the client too long: drop it.
    SendTimeout,
    /// Idle keep-alive connection: close it gracefully.
    Idle,
}

/// The connection's timeouts, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub header_ms: u64,
    pub idle_ms: u64,
    pub send_ms: u64,
    /// When the drain began (`now_ms`); 0 = not draining.
    pub drain_since: u64,
    /// While draining, how long an idle connection is kept.
    pub drain_idle_ms: u64,
}

impl Timeouts {
    /// When a connection idle since `last` is closed.
    pub fn idle_due(&self, last: u64) -> u64 {
        idle_due(last, self.idle_ms, self.drain_since, self.drain_idle_ms)
    }
}

/// When a keep-alive connection idle since `last` is closed: after
/// `idle_ms`, and while draining (since `drain_since`, 0 = not) also
/// `drain_idle_ms` after the later of the last activity and the drain's
/// start. Counting from the drain's start rather than from the last request
/// gives a client that holds a long-idle connection `drain_idle_ms` to reuse
/// it (its request then gets `Connection: close`) before the close, instead
/// of a close the moment the drain begins that its next request races.
pub fn idle_due(last: u64, idle_ms: u64, drain_since: u64, drain_idle_ms: u64) -> u64 {
    let normal = last + idle_ms;
    if drain_since == 0 {
        return normal;
    }
    normal.min(last.max(drain_since) + drain_idle_ms)
}

/// Decides what to do with a connection at `now`.
pub fn verdict(act: &Activity, now: u64, t: Timeouts) -> Verdict {
    let Timeouts {
        header_ms,
        idle_ms,
        send_ms,
        ..
    } = t;
    let blocked = act.write_blocked.load(Ordering::Relaxed);
    if blocked != 0 && now >= blocked + send_ms {
        return Verdict::SendTimeout;
    }
    let started = act.head_started.load(Ordering::Relaxed);
    if started != 0 {
        let due = started + header_ms;
        return if now >= due {
            Verdict::HeaderTimeout
        } else {
            Verdict::Wait(Duration::from_millis(due - now))
        };
    }
    if act.in_flight.load(Ordering::Relaxed) > 0 {
        let next = idle_ms.min(header_ms).min(send_ms).max(10);
        return Verdict::Wait(Duration::from_millis(next));
    }
    let due = t.idle_due(act.last.load(Ordering::Relaxed));
    if now >= due {
        Verdict::Idle
    } else {
        Verdict::Wait(Duration::from_millis(due - now))
    }
}

/// The watchdog of an HTTP/2 connection: no header timer (its streams'
/// heads arrive as frames between others'), only the idle timeout while no
/// stream is open.
pub fn idle_verdict(act: &Activity, now: u64, idle_ms: u64) -> Verdict {
    if act.in_flight.load(Ordering::Relaxed) > 0 {
        return Verdict::Wait(Duration::from_millis(idle_ms.max(10)));
    }
    let due = act.last.load(Ordering::Relaxed) + idle_ms;
    if now >= due {
        Verdict::Idle
    } else {
        Verdict::Wait(Duration::from_millis(due - now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts = Timeouts {
        header_ms: 100,
        idle_ms: 1000,
        send_ms: 100_000,
        drain_since: 0,
        drain_idle_ms: 1000,
    };

    #[test]
    fn drain_idle_counts_from_the_drain_start() {
        // Idle since t0; the drain begins 5 s later: the connection gets
        // `drain_idle_ms` from the drain's start, not a close at once.
        let t0 = 1_000_000;
        let idle = 60_000;
        let d = t0 + 5_000;
        assert_eq!(idle_due(t0, idle, 0, 1_000), t0 + idle);
        assert_eq!(idle_due(t0, idle, d, 1_000), d + 1_000);
        // A request after the drain began: from its end.
        assert_eq!(idle_due(d + 300, idle, d, 1_000), d + 1_300);
        // The normal idle timeout still ends it sooner when it is due first.
        assert_eq!(idle_due(t0, 5_500, d, 1_000), t0 + 5_500);
        let a = Activity::new();
        let last = a.last.load(Ordering::Relaxed);
        let t = Timeouts {
            idle_ms: idle,
            drain_since: last + 5_000,
            ..T
        };
        assert!(matches!(verdict(&a, last + 5_000, t), Verdict::Wait(_)));
        assert_eq!(verdict(&a, last + 6_000, t), Verdict::Idle);
    }

    #[test]
    fn send_timer_runs_only_while_a_write_waits() {
        let a = Activity::new();
        let t0 = a.last.load(Ordering::Relaxed);
        let _g = a.request_started();
        let t = Timeouts { send_ms: 50, ..T };
        assert!(matches!(verdict(&a, t0 + 10_000, t), Verdict::Wait(_)));
        a.write_blocked.store(t0, Ordering::Relaxed);
        assert!(matches!(verdict(&a, t0 + 40, t), Verdict::Wait(_)));
        assert_eq!(verdict(&a, t0 + 50, t), Verdict::SendTimeout);
    }

    #[test]
    fn header_timer_runs_only_while_a_head_arrives() {
        let a = Activity::new();
        let t0 = a.last.load(Ordering::Relaxed);
        assert!(matches!(verdict(&a, t0, T), Verdict::Wait(_)));
        assert_eq!(verdict(&a, t0 + 1000, T), Verdict::Idle);
        a.head_started.store(t0 + 500, Ordering::Relaxed);
        assert!(matches!(verdict(&a, t0 + 550, T), Verdict::Wait(_)));
        assert_eq!(verdict(&a, t0 + 600, T), Verdict::HeaderTimeout);
        let g = a.request_started();
        assert!(matches!(verdict(&a, t0 + 9999, T), Verdict::Wait(_)));
        drop(g);
        assert_eq!(
            verdict(&a, now_ms() + 1000, T),
            Verdict::Idle,
            "idle counts from the end of the response"
        );
    }
}
