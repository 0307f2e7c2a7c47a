//! Layer: server. The HTTP/2 connection's guards against clients that stop
//! reading and clients that flood it, around hyper's h2 server:
//!
//! - [`StreamExec`], the executor hyper spawns each stream's task with: the
//!   task runs under a watchdog that resets the stream (the task is dropped,
//!   h2 sends `RST_STREAM(CANCEL)` and the response body — an open file
//!   among others — goes with it) once it has waited for its client longer
//!   than `client.send_timeout_ms` (nginx's `send_timeout` on an HTTP/2
//!   stream). hyper polls a response body only while the stream may send,
//!   so a stalled client is seen from the body's side ([`Watch`]): a chunk
//!   handed out and not taken, or a body waiting for the server to write its
//!   previous chunk (`base::sendwait`). A stream waiting on a slow node is
//!   not waiting for its client and is never cut.
//! - [`H2Io`], the I/O wrapper under the codec: it reads the frame heads of
//!   what the client sends and counts PING and SETTINGS frames (not their
//!   acknowledgements); more than `http2.max_control_frames_per_second` in
//!   one second and the connection gets `GOAWAY(ENHANCE_YOUR_CALM)`, written
//!   at the next frame boundary of what the server sends (it follows their
//!   heads too), then the write side is shut and the rest the client sends is
//!   read and dropped until it closes, for at most [`FLOOD_LINGER_MS`]. It
//!   also records since when a write has waited for the socket, which the
//!   connection's loop turns into a close after `client.send_timeout_ms`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::base::clock::now_ms;
use crate::base::ratelog::log_limited;
use crate::base::sendwait::{self, Polled, Waiting};

/// After a flood's GOAWAY, how long the connection lingers for the client
/// to read it (reading and dropping what it still sends) before it is
/// dropped. Closing at once, with the client's frames unread, would make
/// the kernel answer with a reset that can overtake the GOAWAY.
pub const FLOOD_LINGER_MS: u64 = 2_000;

/// The client connection preface (RFC 9113 3.4).
const PREFACE_LEN: u8 = 24;

const FRAME_HEAD: usize = 9;
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const ACK: u8 = 0x1;
const GOAWAY: u8 = 0x7;
const ENHANCE_YOUR_CALM: u32 = 0xb;
const DAY_MS: u64 = 86_400_000;

// ---------------------------------------------------------------------------
// Streams: the send timeout.

/// The executor of one HTTP/2 connection's stream tasks: each runs under a
/// send-timeout watchdog ([`Watched`]). `limit_ms` 0 = no watchdog.
#[derive(Clone, Copy, Debug)]
pub struct StreamExec {
    pub limit_ms: u64,
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Watched::new(fut, self.limit_ms, now_ms));
    }
}

pin_project_lite::pin_project! {
    /// A stream's task under its watchdog: polled with its [`Waiting`]
    /// current; dropped (which resets the stream) once that has marked a
    /// wait for the client older than `limit_ms`.
    pub struct Watched<F> {
        #[pin]
        fut: F,
        waiting: Waiting,
        limit_ms: u64,
        // The clock `waiting` is read against (`now_ms`; a test's own).
        clock: fn() -> u64,
        // Armed on the first wait for the client and re-armed only when it
        // fires early (the wait it was armed for ended meanwhile): at most
        // one timer firing per `limit_ms` per stream, not one reset per chunk.
        timer: Option<Pin<Box<Sleep>>>,
    }
}

impl<F> Watched<F> {
    /// `fut` under a watchdog of `limit_ms` (0: none) on `clock`.
    pub fn new(fut: F, limit_ms: u64, clock: fn() -> u64) -> Watched<F> {
        Watched {
            fut,
            waiting: Waiting::default(),
            limit_ms,
            clock,
            timer: None,
        }
    }
}

impl<F: Future<Output = ()>> Future for Watched<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let me = self.project();
        let waiting: &Waiting = me.waiting;
        let fut = me.fut;
        if waiting.enter(|| fut.poll(cx)).is_ready() {
            return Poll::Ready(());
        }
        if *me.limit_ms == 0 {
            return Poll::Pending;
        }
        loop {
            let since = waiting.since();
            if since == 0 {
                return Poll::Pending;
            }
            let due = since.saturating_add(*me.limit_ms);
            let now = (me.clock)();
            if now >= due {
                log_limited(&STALL_LOG, || {
                    tracing::warn!(
                        send_timeout_ms = *me.limit_ms,
                        "HTTP/2 client stopped taking a response; stream reset"
                    )
                });
                return Poll::Ready(());
            }
            // (Capped: a day is as good as an absurdly large limit, and an
            // `Instant` that far ahead would overflow.)
            let at = tokio::time::Instant::now() + Duration::from_millis((due - now).min(DAY_MS));
            let timer = me
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
            match timer.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // Fired for an earlier wait: re-armed for this one.
                Poll::Ready(()) => timer.as_mut().reset(at + Duration::from_millis(1)),
            }
        }
    }
}

/// A response body that tells its stream's watchdog when it hands out a
/// chunk (from then the stream waits for its client to take it) and when it
/// waits on its source.
pub struct Watch<B> {
    inner: B,
}

impl<B> Watch<B> {
    pub fn new(inner: B) -> Watch<B> {
        Watch { inner }
    }
}

impl<B> Body for Watch<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let inner = &mut self.inner;
        sendwait::body_poll(now_ms, || {
            let r = Pin::new(inner).poll_frame(cx);
            let polled = match &r {
                Poll::Ready(Some(Ok(f))) if f.data_ref().is_some_and(|d| !d.is_empty()) => {
                    Polled::Chunk
                }
                Poll::Pending => Polled::Pending,
                Poll::Ready(_) => Polled::Done,
            };
            (r, polled)
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

// ---------------------------------------------------------------------------
// Frames: reading their heads in a byte stream cut anywhere.

/// A frame head (RFC 9113 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    pub len: u32,
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
}

impl FrameHead {
    fn parse(b: &[u8; FRAME_HEAD]) -> FrameHead {
        FrameHead {
            len: u32::from_be_bytes([0, b[0], b[1], b[2]]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        }
    }
}

/// Follows frame boundaries in a byte stream fed in pieces of any size:
/// collects each head, skips each payload (padding included: it is in the
/// length).
#[derive(Debug, Clone, Default)]
pub struct Frames {
    /// Bytes of the client preface still to skip.
    preface: u8,
    head: [u8; FRAME_HEAD],
    head_len: usize,
    /// Payload bytes of the current frame still to skip.
    skip: u32,
}

impl Frames {
    /// The frames a client sends: after its preface.
    pub fn client() -> Frames {
        Frames {
            preface: PREFACE_LEN,
            ..Frames::default()
        }
    }

    /// The frames a server sends (its preface is a SETTINGS frame).
    pub fn server() -> Frames {
        Frames::default()
    }

    /// Between two frames (nothing of one written or read half-way).
    pub fn at_boundary(&self) -> bool {
        self.preface == 0 && self.head_len == 0 && self.skip == 0
    }

    /// Consumes `data`, calling `on_head` with each complete head. With
    /// `stop`, stops at the first frame boundary reached after at least one
    /// byte. Returns the bytes consumed.
    pub fn feed(&mut self, data: &[u8], stop: bool, mut on_head: impl FnMut(FrameHead)) -> usize {
        let mut at = 0;
        while at < data.len() {
            if self.preface > 0 {
                let n = (self.preface as usize).min(data.len() - at);
                self.preface -= n as u8;
                at += n;
            } else if self.skip > 0 {
                let n = (self.skip as usize).min(data.len() - at);
                self.skip -= n as u32;
                at += n;
            } else {
                let n = (FRAME_HEAD - self.head_len).min(data.len() - at);
                self.head[self.head_len..self.head_len + n].copy_from_slice(&data[at..at + n]);
                self.head_len += n;
                at += n;
                if self.head_len == FRAME_HEAD {
                    self.head_len = 0;
                    let h = FrameHead::parse(&self.head);
                    self.skip = h.len;
                    on_head(h);
                }
            }
            if stop && self.at_boundary() {
                break;
            }
        }
        at
    }

    /// How many of `data`'s first bytes finish the current frame (all of
    /// them if they do not).
    pub fn to_boundary(&self, data: &[u8]) -> usize {
        if self.at_boundary() {
            return 0;
        }
        self.clone().feed(data, true, |_| {})
    }
}

/// Counts a client's PING and SETTINGS frames (acknowledgements aside) per
/// one-second window.
#[derive(Debug, Clone)]
pub struct ControlBudget {
    /// Allowed per window; 0 = no limit.
    max: u32,
    window_start: u64,
    count: u32,
}

impl ControlBudget {
    pub fn new(max: u32) -> ControlBudget {
        ControlBudget {
            max,
            window_start: 0,
            count: 0,
        }
    }

    /// One frame head read at `now` (`now_ms`): true when it is a control
    /// frame beyond the budget.
    pub fn over(&mut self, h: FrameHead, now: impl FnOnce() -> u64) -> bool {
        if self.max == 0 || !matches!(h.kind, PING | SETTINGS) || h.flags & ACK != 0 {
            return false;
        }
        let now = now();
        if now.saturating_sub(self.window_start) >= 1000 {
            self.window_start = now;
            self.count = 0;
        }
        self.count += 1;
        self.count > self.max
    }
}

/// `GOAWAY(ENHANCE_YOUR_CALM)` naming `last_stream` as the last stream
/// processed.
fn goaway(last_stream: u32) -> [u8; FRAME_HEAD + 8] {
    let mut f = [0u8; FRAME_HEAD + 8];
    f[2] = 8;
    f[3] = GOAWAY;
    f[9..13].copy_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    f[13..17].copy_from_slice(&ENHANCE_YOUR_CALM.to_be_bytes());
    f
}

// ---------------------------------------------------------------------------
// The connection's I/O.

/// What the connection's loop reads of its [`H2Io`].
#[derive(Debug, Default)]
pub struct ConnWatch {
    /// Since when (`now_ms`) a write has waited for the socket; 0 = none.
    write_blocked: AtomicU64,
    /// When a control-frame flood was detected (`now_ms`); 0 = never.
    flooded: AtomicU64,
}

impl ConnWatch {
    /// A write has waited for the client longer than `send_ms`.
    pub fn send_stalled(&self, now: u64, send_ms: u64) -> bool {
        let b = self.write_blocked.load(Ordering::Relaxed);
        b != 0 && now >= b.saturating_add(send_ms)
    }

    /// A flood was cut off and the GOAWAY has had its linger time.
    pub fn flood_done(&self, now: u64) -> bool {
        let f = self.flooded.load(Ordering::Relaxed);
        f != 0 && now >= f + FLOOD_LINGER_MS
    }

    /// A flood was cut off.
    pub fn flooded(&self) -> bool {
        self.flooded.load(Ordering::Relaxed) != 0
    }

    fn blocked(&self) {
        let _ =
            self.write_blocked
                .compare_exchange(0, now_ms(), Ordering::Relaxed, Ordering::Relaxed);
    }

    fn wrote(&self) {
        self.write_blocked.store(0, Ordering::Relaxed);
    }
}

/// Where the connection stands with a flood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Calm {
    /// No flood.
    No,
    /// The GOAWAY is due; this much of it is written.
    Goaway(usize),
    /// Written; the write side is being flushed and shut.
    Shutting,
    /// Shut: further writes are dropped, reads drained until EOF.
    Shut,
}

/// A client stream under hyper's h2 server, with the frame-level guards
/// described in the module summary.
pub struct H2Io<T> {
    inner: T,
    watch: Arc<ConnWatch>,
    inbound: Frames,
    outbound: Frames,
    budget: ControlBudget,
    /// The highest stream a client HEADERS frame opened (of the bytes
    /// passed on).
    last_stream: u32,
    calm: Calm,
    goaway: [u8; FRAME_HEAD + 8],
}

impl<T> H2Io<T> {
    pub fn new(inner: T, watch: Arc<ConnWatch>, max_control_per_second: u32) -> H2Io<T> {
        H2Io {
            inner,
            watch,
            inbound: Frames::client(),
            outbound: Frames::server(),
            budget: ControlBudget::new(max_control_per_second),
            last_stream: 0,
            calm: Calm::No,
            goaway: [0; FRAME_HEAD + 8],
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> H2Io<T> {
    /// Scans bytes the client sent; true when they make a flood.
    fn scan(&mut self, data: &[u8]) -> bool {
        let mut flood = false;
        let mut last = self.last_stream;
        let budget = &mut self.budget;
        self.inbound.feed(data, false, |h| {
            if h.kind == HEADERS && h.stream > last {
                last = h.stream;
            }
            if budget.over(h, now_ms) {
                flood = true;
            }
        });
        if !flood {
            self.last_stream = last;
        }
        flood
    }

    fn begin_calm(&mut self) {
        log_limited(&FLOOD_LOG, || {
            tracing::warn!(
                max_per_second = self.budget.max,
                "HTTP/2 client flooded PING/SETTINGS frames; GOAWAY ENHANCE_YOUR_CALM"
            )
        });
        self.goaway = goaway(self.last_stream);
        self.calm = Calm::Goaway(0);
        self.watch.flooded.store(now_ms(), Ordering::Relaxed);
    }

    /// Drives the GOAWAY out once the server's frames are at a boundary,
    /// then flushes and shuts the write side. Ready once shut (or when
    /// writing failed: the connection is lost anyway).
    fn poll_calm(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match self.calm {
                Calm::No | Calm::Shut => return Poll::Ready(()),
                Calm::Goaway(_) if !self.outbound.at_boundary() => return Poll::Pending,
                Calm::Goaway(done) if done == self.goaway.len() => self.calm = Calm::Shutting,
                Calm::Goaway(done) => {
                    match Pin::new(&mut self.inner).poll_write(cx, &self.goaway[done..]) {
                        Poll::Ready(Ok(n)) if n > 0 => {
                            self.watch.wrote();
                            self.calm = Calm::Goaway(done + n);
                        }
                        Poll::Ready(_) => self.calm = Calm::Shut,
                        Poll::Pending => {
                            self.watch.blocked();
                            return Poll::Pending;
                        }
                    }
                }
                Calm::Shutting => match Pin::new(&mut self.inner).poll_flush(cx) {
                    Poll::Ready(Ok(())) => {
                        self.watch.wrote();
                        // The FIN (over TLS also close_notify) after the GOAWAY.
                        let _ = Pin::new(&mut self.inner).poll_shutdown(cx);
                        self.calm = Calm::Shut;
                    }
                    Poll::Ready(Err(_)) => self.calm = Calm::Shut,
                    Poll::Pending => {
                        self.watch.blocked();
                        return Poll::Pending;
                    }
                },
            }
        }
    }

    /// After a flood: reads and drops what the client still sends, EOF
    /// passed on (the codec then ends the connection).
    fn poll_drain(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let _ = self.poll_calm(cx);
        loop {
            let before = buf.filled().len();
            if buf.remaining() == 0 {
                return Poll::Pending;
            }
            match Pin::new(&mut self.inner).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() > before => buf.set_filled(before),
                Poll::Ready(r) => return Poll::Ready(r),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn track_write(&mut self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Ready(Ok(n)) if *n > 0 => self.watch.wrote(),
            Poll::Pending => self.watch.blocked(),
            _ => {}
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for H2Io<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.calm != Calm::No {
            return me.poll_drain(cx, buf);
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut me.inner).poll_read(cx, buf);
        if buf.filled().len() > before && me.scan(&buf.filled()[before..]) {
            // What came with the flood is not passed on.
            buf.set_filled(before);
            me.begin_calm();
            return me.poll_drain(cx, buf);
        }
        r
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for H2Io<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        let buf = match me.calm {
            Calm::No => buf,
            Calm::Goaway(_) if !me.outbound.at_boundary() => {
                // Only the rest of the frame under way; the GOAWAY follows.
                &buf[..me.outbound.to_boundary(buf)]
            }
            _ => {
                // The codec's frames after the GOAWAY are dropped.
                return match me.poll_calm(cx) {
                    Poll::Ready(()) => Poll::Ready(Ok(buf.len())),
                    Poll::Pending => Poll::Pending,
                };
            }
        };
        let r = Pin::new(&mut me.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            me.outbound.feed(&buf[..n], false, |_| {});
        }
        me.track_write(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        if me.calm != Calm::No {
            // Rare: one slice at a time, cut at the frame boundary.
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &**b);
            return Pin::new(me).poll_write(cx, first);
        }
        let r = Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            let mut left = n;
            for b in bufs {
                if left == 0 {
                    break;
                }
                let k = left.min(b.len());
                me.outbound.feed(&b[..k], false, |_| {});
                left -= k;
            }
        }
        me.track_write(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        match me.calm {
            Calm::No => {}
            Calm::Goaway(_) if !me.outbound.at_boundary() => {}
            _ => return me.poll_calm(cx).map(Ok),
        }
        let r = Pin::new(&mut me.inner).poll_flush(cx);
        match r {
            Poll::Ready(Ok(())) => me.watch.wrote(),
            Poll::Pending => me.watch.blocked(),
            Poll::Ready(Err(_)) => {}
        }
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.calm != Calm::No {
            return me.poll_calm(cx).map(Ok);
        }
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

static STALL_LOG: AtomicU64 = AtomicU64::new(0);
static FLOOD_LOG: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = len.to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn head(kind: u8, flags: u8, stream: u32, len: u32) -> FrameHead {
        FrameHead {
            len,
            kind,
            flags,
            stream,
        }
    }

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// A client's bytes: the preface, then frames of every shape (empty,
    /// padded, payload bytes that look like frame heads, a reserved bit set
    /// in the stream id).
    fn client_bytes() -> (Vec<u8>, Vec<FrameHead>) {
        let mut b = PREFACE.to_vec();
        let mut heads = Vec::new();
        let mut add = |kind, flags, stream: u32, payload: &[u8]| {
            b.extend(frame(kind, flags, stream, payload));
            heads.push(head(
                kind,
                flags,
                stream & 0x7fff_ffff,
                payload.len() as u32,
            ));
        };
        add(SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 0]);
        add(SETTINGS, ACK, 0, &[]);
        // HEADERS, PADDED: pad length 5, a block, 5 bytes of padding that
        // spell a PING head.
        let mut padded = vec![5, 0x82, 0x86];
        padded.extend_from_slice(&[0, 0, 8, PING, 0]);
        add(HEADERS, 0x8 | 0x4, 1, &padded);
        // A DATA payload made of frame heads.
        add(0x0, 0, 1, &frame(PING, 0, 0, &[0; 8]));
        add(PING, 0, 0, &[1; 8]);
        add(PING, ACK, 0, &[1; 8]);
        add(0x8, 0, 0x8000_0003, &[0, 0, 1, 0]);
        add(GOAWAY, 0, 0, &[0; 8]);
        (b, heads)
    }

    fn heads_of(f: &mut Frames, pieces: &[&[u8]]) -> Vec<FrameHead> {
        let mut out = Vec::new();
        for p in pieces {
            assert_eq!(f.feed(p, false, |h| out.push(h)), p.len());
        }
        out
    }

    #[test]
    fn heads_are_found_however_the_bytes_are_cut() {
        let (bytes, want) = client_bytes();
        assert_eq!(heads_of(&mut Frames::client(), &[&bytes]), want);
        // Cut once at every byte boundary.
        for cut in 0..=bytes.len() {
            let mut f = Frames::client();
            let got = heads_of(&mut f, &[&bytes[..cut], &bytes[cut..]]);
            assert_eq!(got, want, "cut at {cut}");
            assert!(f.at_boundary());
        }
        // Cut twice at every pair of boundaries.
        for a in 0..=bytes.len() {
            for b in a..=bytes.len() {
                let mut f = Frames::client();
                let got = heads_of(&mut f, &[&bytes[..a], &bytes[a..b], &bytes[b..]]);
                assert_eq!(got, want, "cuts at {a}, {b}");
            }
        }
        // One byte at a time.
        let mut f = Frames::client();
        let ones: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(heads_of(&mut f, &ones), want);
    }

    #[test]
    fn the_largest_frame_is_skipped_to_its_last_byte() {
        let max = (1u32 << 24) - 1;
        let mut f = Frames::server();
        let mut got = Vec::new();
        f.feed(&frame(0x0, 0, 1, &[])[..], false, |h| got.push(h));
        // Patch the length: a head announcing 2^24 - 1 bytes.
        let mut big = frame(0x0, 0x1, 3, &[]);
        big[..3].copy_from_slice(&max.to_be_bytes()[1..]);
        f.feed(&big, false, |h| got.push(h));
        let zeros = vec![0u8; 65_536];
        let mut left = max as usize;
        while left > 0 {
            let n = left.min(zeros.len() - 7);
            assert!(!f.at_boundary());
            f.feed(&zeros[..n], false, |h| got.push(h));
            left -= n;
        }
        assert!(f.at_boundary());
        f.feed(&frame(PING, 0, 0, &[9; 8]), false, |h| got.push(h));
        assert_eq!(
            got,
            [head(0, 0, 1, 0), head(0, 1, 3, max), head(PING, 0, 0, 8)]
        );
    }

    #[test]
    fn the_rest_of_a_frame_under_way_is_measured() {
        let a = frame(0x0, 0, 1, &[7; 100]);
        let b = frame(PING, ACK, 0, &[0; 8]);
        let both = [a.clone(), b.clone()].concat();
        let f = Frames::server();
        assert!(f.at_boundary());
        assert_eq!(f.to_boundary(&both), 0);
        // Written up to any byte of the first frame: the rest of it, no more.
        for k in 1..a.len() {
            let mut f = Frames::server();
            f.feed(&both[..k], false, |_| {});
            assert!(!f.at_boundary());
            assert_eq!(f.to_boundary(&both[k..]), a.len() - k, "after {k}");
            // A buffer that ends before the frame does: all of it.
            let short = &both[k..(k + 1).min(a.len())];
            assert_eq!(f.to_boundary(short), short.len());
        }
        // `stop` halts at a zero-length frame's end too.
        let mut f = Frames::server();
        let empty = frame(SETTINGS, ACK, 0, &[]);
        let two = [empty.clone(), b].concat();
        assert_eq!(f.feed(&two, true, |_| {}), empty.len());
    }

    #[test]
    fn control_frames_beyond_the_budget_are_a_flood() {
        let mut b = ControlBudget::new(3);
        let ping = head(PING, 0, 0, 8);
        let settings = head(SETTINGS, 0, 0, 0);
        // Acknowledgements and other frames do not count.
        for _ in 0..100 {
            assert!(!b.over(head(PING, ACK, 0, 8), || 1000));
            assert!(!b.over(head(SETTINGS, ACK, 0, 0), || 1000));
            assert!(!b.over(head(0x8, 0, 1, 4), || 1000));
        }
        assert!(!b.over(ping, || 1000));
        assert!(!b.over(settings, || 1100));
        assert!(!b.over(ping, || 1900));
        assert!(b.over(ping, || 1999), "a fourth within one second");
        // A new second, a new budget.
        assert!(!b.over(ping, || 2000));
        assert!(!b.over(ping, || 2001));
        assert!(!b.over(ping, || 2002));
        assert!(b.over(ping, || 2003));
        let mut off = ControlBudget::new(0);
        assert!((0..10_000).all(|_| !off.over(ping, || 5)));
    }

    /// Reads frames from a byte stream until EOF.
    async fn frames_until_eof(s: &mut tokio::io::DuplexStream) -> Vec<(FrameHead, Vec<u8>)> {
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        let mut out = Vec::new();
        let mut at = 0;
        while at + FRAME_HEAD <= all.len() {
            let h = FrameHead::parse(all[at..at + FRAME_HEAD].try_into().unwrap());
            let end = at + FRAME_HEAD + h.len as usize;
            out.push((h, all[at + FRAME_HEAD..end].to_vec()));
            at = end;
        }
        assert_eq!(at, all.len(), "whole frames only");
        out
    }

    fn goaway_of(frames: &[(FrameHead, Vec<u8>)]) -> Option<(u32, u32)> {
        frames.iter().find(|(h, _)| h.kind == GOAWAY).map(|(_, p)| {
            (
                u32::from_be_bytes(p[..4].try_into().unwrap()),
                u32::from_be_bytes(p[4..8].try_into().unwrap()),
            )
        })
    }

    fn hello() -> Vec<u8> {
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        hello.extend(frame(HEADERS, 0x5, 1, &[0x82]));
        hello.extend(frame(HEADERS, 0x5, 3, &[0x82]));
        hello
    }

    fn pings(n: usize) -> Vec<u8> {
        (0..n).flat_map(|_| frame(PING, 0, 0, &[1; 8])).collect()
    }

    #[tokio::test]
    async fn a_flood_gets_goaway_after_the_frame_under_way_then_eof() {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let watch = Arc::new(ConnWatch::default());
        let mut io = H2Io::new(server, watch.clone(), 10);
        // The codec has written part of a DATA frame when the flood comes.
        let data = frame(0x0, 0, 1, &[5; 1000]);
        io.write_all(&data[..300]).await.unwrap();
        client.write_all(&hello()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], &hello()[..], "within the budget: passed on");
        assert!(!watch.flooded());
        // Eleven PINGs in a second (and a HEADERS among them), then the
        // client stops sending.
        let mut flood = pings(5);
        flood.extend(frame(HEADERS, 0x5, 5, &[0x82]));
        flood.extend(pings(15));
        client.write_all(&flood).await.unwrap();
        client.shutdown().await.unwrap();
        // The flood is not passed on: the codec reads EOF.
        assert_eq!(io.read(&mut buf).await.unwrap(), 0);
        assert!(watch.flooded());
        // The codec finishes its frame and goes on writing (a PING ACK):
        // its frame's rest goes out, then the GOAWAY, then nothing.
        let mut rest = data[300..].to_vec();
        rest.extend(frame(PING, ACK, 0, &[1; 8]));
        io.write_all(&rest).await.unwrap();
        io.flush().await.unwrap();
        io.shutdown().await.unwrap();
        let frames = frames_until_eof(&mut client).await;
        let kinds: Vec<u8> = frames.iter().map(|(h, _)| h.kind).collect();
        assert_eq!(kinds, [0x0, GOAWAY]);
        assert_eq!(frames[0].1, vec![5; 1000], "the DATA frame whole");
        // The last stream processed: 3 (stream 5 came with the flood).
        assert_eq!(goaway_of(&frames), Some((3, ENHANCE_YOUR_CALM)));
    }

    #[tokio::test]
    async fn between_frames_the_goaway_goes_out_at_once() {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let watch = Arc::new(ConnWatch::default());
        // The client's SETTINGS and ten PINGs are within the budget.
        let mut io = H2Io::new(server, watch.clone(), 11);
        io.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        let mut all = hello();
        all.extend(pings(11));
        // The flood's frames cut across reads, a byte at a time.
        let writer = tokio::spawn(async move {
            for b in all {
                client.write_all(&[b]).await.unwrap();
                tokio::task::yield_now().await;
            }
            client.shutdown().await.unwrap();
            client
        });
        let mut buf = vec![0u8; 4096];
        let mut passed = 0;
        loop {
            let n = io.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            passed += n;
        }
        // Ten PINGs passed on, and of the eleventh the bytes read before
        // its head was whole (the codec then reads EOF: it never sees it).
        assert_eq!(passed, hello().len() + 10 * 17 + 8);
        let mut client = writer.await.unwrap();
        let frames = frames_until_eof(&mut client).await;
        let kinds: Vec<u8> = frames.iter().map(|(h, _)| h.kind).collect();
        assert_eq!(kinds, [SETTINGS, GOAWAY]);
        assert_eq!(goaway_of(&frames), Some((3, ENHANCE_YOUR_CALM)));
        // Writes after it are dropped, not errors.
        io.write_all(&frame(PING, ACK, 0, &[0; 8])).await.unwrap();
    }

    /// The stream's deadline is relative: on the clock of a gateway that
    /// has run for three days, a stream that starts waiting for its client
    /// is dropped `limit_ms` later (on tokio's paused clock: exactly), not
    /// three days and `limit_ms` later.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_stream_is_dropped_at_its_limit_on_a_clock_far_from_zero() {
        static START: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        fn uptime_ms() -> u64 {
            let start = *START.get_or_init(tokio::time::Instant::now);
            3 * DAY_MS + start.elapsed().as_millis() as u64
        }
        uptime_ms();
        for limit in [1, 300, 5_000] {
            // The stream hands out a chunk and then waits for its client.
            let stalled = std::future::poll_fn(|_| {
                crate::base::sendwait::body_poll(uptime_ms, || {
                    crate::base::sendwait::client_wait();
                    ((), crate::base::sendwait::Polled::Pending)
                });
                Poll::<()>::Pending
            });
            let from = tokio::time::Instant::now();
            Watched::new(stalled, limit, uptime_ms).await;
            let took = from.elapsed().as_millis() as u64;
            assert!(
                (limit..=limit + 1).contains(&took),
                "limit {limit}: {took} ms"
            );
        }
    }

    #[test]
    fn a_write_that_waits_for_the_socket_is_timed() {
        let (_client, server) = tokio::io::duplex(64);
        let watch = Arc::new(ConnWatch::default());
        let mut io = H2Io::new(server, watch.clone(), 10);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let big = frame(0x0, 0, 1, &[0; 1000]);
        let Poll::Ready(Ok(n)) = Pin::new(&mut io).poll_write(&mut cx, &big) else {
            panic!("the first write fills the buffer")
        };
        assert!(n < big.len());
        let now = now_ms();
        assert!(!watch.send_stalled(now + 1_000_000, 100), "not waiting yet");
        assert!(Pin::new(&mut io)
            .poll_write(&mut cx, &big[n..])
            .is_pending());
        assert!(!watch.send_stalled(now, 100));
        assert!(watch.send_stalled(now_ms() + 100, 100));
    }
}
