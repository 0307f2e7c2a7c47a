//! Layer: server. What the HTTP/1.1 connection (`h1`) needs of its byte
//! stream, for a plain socket and for TLS alike: non-blocking reads and
//! writes with readiness waits (so the connection's reads of a streamed body
//! and its writes of the answer can share the stream without a lock or a
//! split on the plain path), a peek for a client gone, the socket itself
//! where the kernel can do more (sendfile, `MSG_MORE`), and the hand-over
//! to a tunnel after a `101`.
//!
//! A plain `TcpStream` does all of it directly. A TLS stream is rustls
//! (through `tokio-rustls`) behind a lock the connection's one task never
//! contends: a read is a `poll_read` whose `Pending` is "would block" (the
//! socket's readiness is registered by the wait that follows), a readiness
//! wait reads ahead into a small stash (rustls may hold decrypted bytes
//! while the socket has none), and a write's records that the socket could
//! not take yet are pushed out by [`Wire::poll_flush`] before an answer
//! counts as sent.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use crate::base::upgrade::Tunnel;

/// A client connection's byte stream as `h1` uses it.
pub(super) trait Wire: Send + Sync + Sized + 'static {
    /// Writes may wait in the stream (TLS records) until flushed.
    const BUFFERED: bool = false;
    /// Ready once a read would not block (data, the client's close or an
    /// error).
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Reads into `buf`'s spare room; `WouldBlock` when nothing is there.
    fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize>;
    /// Ready once a write would make progress.
    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Ready once everything written has left for the socket.
    fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Ends the session on the stream before the socket closes (TLS:
    /// `close_notify`); a plain socket is only dropped.
    fn poll_shutdown(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    /// `Ready(true)`: the client closed its side (or the connection
    /// failed); `Ready(false)`: it sent more (stop watching); `Pending`:
    /// can't tell yet.
    fn poll_gone(&self, cx: &mut Context<'_>) -> Poll<bool>;
    /// After a read that drained the socket: no readiness left to re-check.
    fn forget_readable(&self) {}
    /// The plain socket, where the kernel can send a file or hold a head
    /// for the body behind it.
    fn tcp(&self) -> Option<&TcpStream>;
    /// The stream after a `101`, the bytes already read (`pre`) in front.
    fn into_tunnel(self, pre: Bytes) -> Tunnel;
}

impl Wire for TcpStream {
    #[inline]
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }

    #[inline]
    fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize> {
        TcpStream::try_read_buf(self, buf)
    }

    #[inline]
    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        TcpStream::poll_write_ready(self, cx)
    }

    #[inline]
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        TcpStream::try_write(self, buf)
    }

    #[inline]
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        TcpStream::try_write_vectored(self, bufs)
    }

    #[inline]
    fn poll_flush(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    #[inline]
    fn poll_gone(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut one = [0u8; 1];
        let mut peek = ReadBuf::new(&mut one);
        match self.poll_peek(cx, &mut peek) {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => Poll::Ready(true),
            Poll::Ready(Ok(_)) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Marks the socket not readable after a read that drained it, so the
    /// client watch and the idle wait register for the next readiness
    /// event instead of each first paying a `recv` that says EAGAIN. Sound
    /// because nothing between that read and this call (same poll, one
    /// thread per runtime) lets the I/O driver record a newer event, and
    /// tokio keeps a seen close (`READ_CLOSED`) through a clear.
    #[inline]
    fn forget_readable(&self) {
        let _ = self.try_io(tokio::io::Interest::READABLE, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
    }

    #[inline]
    fn tcp(&self) -> Option<&TcpStream> {
        Some(self)
    }

    #[inline]
    fn into_tunnel(self, pre: Bytes) -> Tunnel {
        Box::new(Rewind { pre, inner: self })
    }
}

/// A TLS client stream for `h1`.
pub(super) struct TlsWire(Mutex<TlsState>);

struct TlsState {
    io: TlsStream<TcpStream>,
    /// Bytes a readiness wait read ahead.
    stash: BytesMut,
    /// A readiness wait saw the client's close.
    eof: bool,
}

/// Room a readiness wait reads ahead into.
const STASH: usize = 4096;

impl TlsWire {
    pub(super) fn new(io: TlsStream<TcpStream>) -> TlsWire {
        TlsWire(Mutex::new(TlsState {
            io,
            stash: BytesMut::new(),
            eof: false,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TlsState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A context whose wake-ups go nowhere: a `try_` call's poll (the wait
/// after a `WouldBlock` registers the connection's own waker).
fn no_wake() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

/// One `poll_read` of `io`, appended to `buf` (through a copy: the
/// plain path reads straight into its buffer, TLS decrypts into rustls's
/// first anyway).
fn read_into(
    io: &mut TlsStream<TcpStream>,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let mut room = [0u8; STASH];
    let mut rb = ReadBuf::new(&mut room);
    match Pin::new(io).poll_read(cx, &mut rb) {
        Poll::Ready(Ok(())) => {
            buf.extend_from_slice(rb.filled());
            Poll::Ready(Ok(rb.filled().len()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        Poll::Pending => Poll::Pending,
    }
}

impl Wire for TlsWire {
    const BUFFERED: bool = true;

    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.lock();
        if !s.stash.is_empty() || s.eof {
            return Poll::Ready(Ok(()));
        }
        let TlsState { io, stash, eof } = &mut *s;
        match read_into(io, cx, stash) {
            Poll::Ready(Ok(0)) => {
                *eof = true;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize> {
        let mut s = self.lock();
        if !s.stash.is_empty() {
            let n = s.stash.len();
            buf.extend_from_slice(&s.stash);
            s.stash.clear();
            return Ok(n);
        }
        if s.eof {
            return Ok(0);
        }
        match read_into(&mut s.io, &mut no_wake(), buf) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Writable again once the records rustls holds have gone out.
        self.poll_flush(cx)
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match Pin::new(&mut self.lock().io).poll_write(&mut no_wake(), buf) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match Pin::new(&mut self.lock().io).poll_write_vectored(&mut no_wake(), bufs) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.lock().io).poll_flush(cx)
    }

    /// No peek under TLS: a read ahead into the stash instead (what it
    /// reads is the next request's, served from there). The client's
    /// close (`close_notify` or the socket's end) or a failed read is
    /// gone; bytes read end the watch.
    fn poll_gone(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut s = self.lock();
        if s.eof {
            return Poll::Ready(true);
        }
        if !s.stash.is_empty() {
            return Poll::Ready(false);
        }
        let TlsState { io, stash, eof } = &mut *s;
        match read_into(io, cx, stash) {
            Poll::Ready(Ok(0)) => {
                *eof = true;
                Poll::Ready(true)
            }
            Poll::Ready(Ok(_)) => Poll::Ready(false),
            Poll::Ready(Err(_)) => Poll::Ready(true),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_shutdown(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.lock().io).poll_shutdown(cx)
    }

    fn tcp(&self) -> Option<&TcpStream> {
        None
    }

    fn into_tunnel(self, pre: Bytes) -> Tunnel {
        let s = self.0.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut front = BytesMut::from(&pre[..]);
        front.extend_from_slice(&s.stash);
        Box::new(Rewind {
            pre: front.freeze(),
            inner: s.io,
        })
    }
}

/// A stream with bytes already read put back in front of it.
pub(super) struct Rewind<T> {
    pre: Bytes,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Rewind<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.pre.is_empty() {
            let n = self.pre.len().min(buf.remaining());
            buf.put_slice(&self.pre[..n]);
            self.pre.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Rewind<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
