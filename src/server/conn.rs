//! Layer: server. The bookkeeping of an HTTP/2 client connection (hyper's):
//! an I/O wrapper that records activity, a response-body guard that marks
//! streams in flight, and the idle verdict its watchdog closes it by; and the
//! keep-alive idle deadline both HTTP versions use (shortened while
//! draining). The HTTP/1.1 connection (`h1`) keeps its own timers.

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
    /// Requests whose response has not been fully sent.
    in_flight: AtomicUsize,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        let a = Activity::default();
        a.last.store(now_ms(), Ordering::Relaxed);
        Arc::new(a)
    }

    /// A request (stream) began.
    pub fn request_started(self: &Arc<Self>) -> InFlight {
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
            self.act.last.store(now_ms(), Ordering::Relaxed);
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
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.act.last.store(now_ms(), Ordering::Relaxed);
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
/// two.
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
    /// Idle keep-alive connection: close it gracefully.
    Idle,
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
    }

    #[test]
    fn an_http2_connection_is_idle_only_with_no_stream_open() {
        let a = Activity::new();
        let t0 = a.last.load(Ordering::Relaxed);
        assert!(matches!(idle_verdict(&a, t0 + 10, 1000), Verdict::Wait(_)));
        assert_eq!(idle_verdict(&a, t0 + 1000, 1000), Verdict::Idle);
        let g = a.request_started();
        assert!(matches!(
            idle_verdict(&a, t0 + 99_999, 1000),
            Verdict::Wait(_)
        ));
        drop(g);
        assert_eq!(idle_verdict(&a, now_ms() + 1000, 1000), Verdict::Idle);
    }
}
