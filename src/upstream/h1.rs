//! Layer: upstream. The HTTP/1.1 engine for node connections, plain or TLS
//! ([`Stream`]): a [`Session`] is one connection, pooled or fresh
//! ([`connect`], [`fresh`]), and [`Session::send`] one exchange driven
//! inline by the request's own task (like an nginx upstream). No connection task, no channel between
//! the request and its connection: the request head and a buffered body go
//! out in one write, the response head is parsed with the codec's fast read
//! (`httparse` for the rest), and the body is handed to the client side
//! without copies (zero-copy slices of the read buffer), decoded from
//! Content-Length, chunked or close-delimited framing
//! ([`crate::codec::framing`]). At its end the connection goes back to the
//! thread's pool without a buffer: its read buffer goes back to the
//! thread's read-buffer pool (`codec::readbuf`, shared with the client
//! side and trimmed on the accept loop's tick), and the
//! request head is written from one per-thread buffer, so the connections a
//! burst left idle hold only their sockets.
//!
//! A streamed request body ([`Sending`]) goes out as it comes — by its
//! Content-Length when known, chunked otherwise — full duplex: the response
//! head is read while the body is still being sent, and the rest of the
//! body is sent while the response body is read (a node may answer before
//! it has read the whole body). A request that asked for an upgrade takes a
//! `101` as its final answer; its connection, with any bytes read past the
//! 101 head in front, becomes the node's side of the tunnel
//! ([`RawBody::take_upgraded`]).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::body::UpBody;
use super::fields::{is_hop_by_hop, Added};
use super::pool::{IdlePool, Opened};
use super::tls::TlsConnect;
use super::{BoxError, PooledBody};
use crate::base::deadline::Deadline;
use crate::base::error::{Error, ErrorKind};
use crate::base::stall::Stall;
use crate::codec::chunked::{self, Chunked, SizeLine, Step};
use crate::codec::fields::{is_plain_line, name_eq, RawLines, SentHead};
use crate::codec::framing::{self, BodyFraming, LengthFields};
use crate::codec::head::{Span, StatusLine};
use crate::codec::readbuf::Side;

/// Most response header fields parsed (hyper's default too).
const MAX_HEADERS: usize = 100;
/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// First read size of a connection (like nginx's one-page
/// `proxy_buffer_size`); doubled up to [`READ_MAX`] while reads fill it.
const READ_MIN: usize = 4 * 1024;
const READ_MAX: usize = 64 * 1024;
/// A buffered body up to this size goes out in the same write as the head.
const COALESCE: usize = 16 * 1024;

/// The request-head buffer's first capacity (the usual head fits).
const WRITE_BUF: usize = 1024;

/// A node connection's byte stream: plain TCP or TLS over it (boxed: the
/// TLS state is large, and the plain connection does not carry its size).
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, b),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write(cx, b),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// An upstream connection; while pooled, its read buffer is empty
/// (capacity 0: the buffer is on the thread's free list).
pub struct Conn {
    stream: Stream,
    rbuf: BytesMut,
    /// Current read size (adaptive, see [`READ_MIN`]).
    read_size: usize,
    /// Field positions of the head being parsed (reused: no allocation).
    spans: Vec<Span>,
    /// The last response head's fields as sent ([`RawLines`]), until the
    /// caller takes them: kept here, on the boxed connection, so the
    /// response that moves through the layers stays small.
    raw: Option<RawLines>,
    /// Its place in the opening order ([`super::pool::opening`]): a purge
    /// keeps the oldest.
    opened: u64,
    /// The TLS settings it was verified under ([`TlsConnect::id`]); 0 =
    /// plain. Which pool it goes back to.
    tls_id: u64,
}

impl Opened for Box<Conn> {
    fn opened(&self) -> u64 {
        self.opened
    }
}

thread_local! {
    /// Plain connections by node.
    static POOL: RefCell<IdlePool<Box<Conn>>> = RefCell::new(IdlePool::default());
    /// TLS connections by (node, TLS settings id): a connection verified
    /// under one service's TLS settings is never handed to a service with
    /// others.
    static TLS_POOL: RefCell<IdlePool<Box<Conn>, (SocketAddr, u64)>> = RefCell::new(IdlePool::default());
    static WRITE_BUF_KEPT: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// Closes the thread's pooled connections past `idle_timeout`, stale, or
/// left over from a burst ([`IdlePool::trim`]); how many.
pub(crate) fn trim_pool(now: u64, idle_timeout: Duration) -> usize {
    let plain = POOL
        .try_with(|p| p.borrow_mut().trim(now, idle_timeout, |c| !c.is_stale()))
        .unwrap_or(0);
    let tls = TLS_POOL
        .try_with(|p| p.borrow_mut().trim(now, idle_timeout, |c| !c.is_stale()))
        .unwrap_or(0);
    plain + tls
}

impl Conn {
    fn new(stream: Stream, tls_id: u64) -> Conn {
        Conn {
            stream,
            rbuf: BytesMut::new(),
            read_size: READ_MIN,
            spans: Vec::new(),
            raw: None,
            opened: super::pool::opening(),
            tls_id,
        }
    }

    /// True when the peer has sent something (EOF, a reset, stray bytes) on
    /// an idle connection: it cannot carry a new request. Reads tokio's
    /// cached readiness only — no system call, and (unlike a poll of the
    /// readiness) no waker put into the registration under its lock: the
    /// closure runs only when the socket is marked readable or closed.
    /// Under TLS a readiness left over from the last read is checked with a
    /// peek (a record that filled rustls' read exactly leaves the socket
    /// marked readable).
    fn is_stale(&self) -> bool {
        let tcp = self.stream.tcp();
        let readable = tcp.try_io(tokio::io::Interest::READABLE, || Ok(())).is_ok();
        let readable = readable && (self.tls_id == 0 || peeks_something(tcp));
        readable || !self.rbuf.is_empty()
    }

    /// Reads more into the read buffer. Goes through tokio's `poll_read`,
    /// which (like nginx) marks the socket drained after a short read, so
    /// no extra `EAGAIN` read is made per response.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.rbuf.capacity() == 0 {
            if let Some(b) = crate::codec::readbuf::take_kept(Side::Node) {
                self.rbuf = b;
            }
        }
        self.rbuf.reserve(self.read_size);
        let room = self.rbuf.capacity() - self.rbuf.len();
        let read = self.stream.read_buf(&mut self.rbuf);
        let n = ready!(std::pin::pin!(read).poll(cx))?;
        if n == room && self.read_size < READ_MAX {
            self.read_size *= 2;
        }
        Poll::Ready(Ok(n))
    }
}

/// Does an idle socket have anything to read (EOF, an error, bytes)? A
/// peek that does not wait (the idle connection has no task to wake).
fn peeks_something(tcp: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    tcp.poll_peek(&mut cx, &mut buf).is_ready()
}

/// Takes an idle connection to `addr` (under TLS settings `tls_id`; 0 =
/// plain) that is still usable.
fn checkout(addr: SocketAddr, tls_id: u64, idle_timeout: Duration) -> Option<Box<Conn>> {
    if tls_id == 0 {
        POOL.with(|p| {
            p.borrow_mut()
                .checkout(addr, idle_timeout, |c| !c.is_stale())
        })
    } else {
        TLS_POOL.with(|p| {
            p.borrow_mut()
                .checkout((addr, tls_id), idle_timeout, |c| !c.is_stale())
        })
    }
}

/// Pools `conn` (its read buffer empty), its buffer kept apart.
fn checkin(addr: SocketAddr, mut conn: Box<Conn>, max_idle: usize) {
    let buf = std::mem::take(&mut conn.rbuf);
    if buf.capacity() > 0 {
        crate::codec::readbuf::give(Side::Node, buf);
    }
    match conn.tls_id {
        0 => POOL.with(|p| p.borrow_mut().checkin(addr, conn, max_idle)),
        id => TLS_POOL.with(|p| p.borrow_mut().checkin((addr, id), conn, max_idle)),
    }
}

/// Connects a fresh TCP connection to a node.
pub async fn connect_tcp(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, Error> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| Error::new(ErrorKind::Connect).with_source("timed out"))?
        .map_err(|e| Error::new(ErrorKind::Connect).with_source(e))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Opens a fresh connection to `addr`, with the TLS handshake when `tls`
/// is given (within the connect timeout too).
async fn open(
    addr: SocketAddr,
    tls: Option<&TlsConnect>,
    timeout: Duration,
) -> Result<Box<Conn>, Error> {
    let tcp = connect_tcp(addr, timeout).await?;
    let Some(t) = tls else {
        return Ok(Box::new(Conn::new(Stream::Plain(tcp), 0)));
    };
    let stream = tokio::time::timeout(timeout, t.connect(tcp, addr))
        .await
        .map_err(|_| Error::new(ErrorKind::Connect).with_source("TLS handshake timed out"))??;
    Ok(Box::new(Conn::new(Stream::Tls(Box::new(stream)), t.id)))
}

/// [`open`]'s future, boxed by a function of its own (never inlined): the
/// connect and TLS handshake state is built in this frame, not in the
/// stack frame of the exchange's poll that awaits it.
#[inline(never)]
fn open_boxed<'a>(
    addr: SocketAddr,
    tls: Option<&'a TlsConnect>,
    timeout: Duration,
) -> Pin<Box<impl Future<Output = Result<Box<Conn>, Error>> + 'a>> {
    Box::pin(open(addr, tls, timeout))
}

/// One request to send: everything borrowed from the caller.
pub struct Outgoing<'a> {
    pub method: &'a Method,
    pub path_and_query: &'a str,
    pub headers: &'a HeaderMap,
    /// The client's head as received: the lines of the fields passed on
    /// unchanged ([`SentHead::line`]).
    pub sent: Option<&'a SentHead>,
    /// The gateway's own fields, written after `headers`.
    pub added: &'a Added<'a>,
    /// A body in hand (a streamed one is a [`Sending`] beside this).
    pub body: Option<Bytes>,
    /// How a streamed body is framed (`None`: the body is in hand).
    pub streamed: Option<BodyFraming>,
    /// A plain response head keeps its lines as sent ([`RawLines`]).
    pub keep_lines: bool,
    /// The request asks for an upgrade: a `101` is its final answer.
    pub upgrade: bool,
}

/// `name: value` CRLF, the name as the map holds it (lower case).
#[inline(always)]
fn put_field(w: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) {
    w.extend_from_slice(name.as_str().as_bytes());
    w.extend_from_slice(b": ");
    w.extend_from_slice(value.as_bytes());
    w.extend_from_slice(b"\r\n");
}

/// Writes the client's lines gathered in `run` (and empties it).
#[inline(always)]
fn flush_run(w: &mut Vec<u8>, sent: Option<&SentHead>, run: &mut Option<(usize, usize)>) {
    if let (Some(r), Some(sent)) = (run.take(), sent) {
        w.extend_from_slice(sent.get(r));
    }
}

impl Outgoing<'_> {
    /// Serializes the request head (and a small body) into `w`. A
    /// function of its own: the per-field compares inline here (in the
    /// exchange's large poll they were calls).
    #[inline(never)]
    fn encode(&self, addr: SocketAddr, w: &mut Vec<u8>) {
        w.clear();
        w.extend_from_slice(self.method.as_str().as_bytes());
        w.push(b' ');
        w.extend_from_slice(self.path_and_query.as_bytes());
        w.extend_from_slice(b" HTTP/1.1\r\n");
        let (mut had_length, mut had_host) = (false, false);
        // The client's lines of the fields passed on unchanged, as they
        // came: a run of them next to each other in its head is one copy.
        let mut run: Option<(usize, usize)> = None;
        for (name, value) in self.headers.iter() {
            had_host |= name == header::HOST;
            if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
                had_length |= name == header::CONTENT_LENGTH;
                flush_run(w, self.sent, &mut run);
                continue;
            }
            if let Some((start, end)) = self.sent.and_then(|s| s.line(name, value)) {
                run = match run {
                    Some((s, e)) if e == start => Some((s, end)),
                    _ => {
                        flush_run(w, self.sent, &mut run);
                        Some((start, end))
                    }
                };
                continue;
            }
            flush_run(w, self.sent, &mut run);
            put_field(w, name, value);
        }
        flush_run(w, self.sent, &mut run);
        for (name, value) in self.added.iter() {
            had_host |= name == header::HOST;
            put_field(w, name, value);
        }
        if !had_host {
            let _ = write!(w, "host: {addr}\r\n");
        }
        let len = match self.streamed {
            None => self.body.as_ref().map_or(0, Bytes::len) as u64,
            Some(BodyFraming::Length(n)) => n,
            Some(BodyFraming::Chunked) => {
                w.extend_from_slice(b"transfer-encoding: chunked\r\n");
                had_length = false;
                0
            }
            Some(_) => 0,
        };
        if len > 0 || had_length {
            w.extend_from_slice(b"content-length: ");
            w.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
            w.extend_from_slice(b"\r\n");
        }
        w.extend_from_slice(b"\r\n");
        if let Some(b) = self.body.as_ref().filter(|b| b.len() <= COALESCE) {
            w.extend_from_slice(b);
        }
    }

    fn body_after_head(&self) -> Option<&Bytes> {
        self.body.as_ref().filter(|b| b.len() > COALESCE)
    }
}

/// A streamed request body on its way to the node: framed by its length or
/// chunked ([`crate::codec::chunked`]), written piece by piece as the
/// client's body yields it, the pieces not yet written queued.
pub struct Sending {
    body: UpBody,
    chunked: bool,
    /// Bytes still due by the Content-Length.
    left: u64,
    out: VecDeque<Bytes>,
    /// The body has been read from (it can no longer go to another
    /// connection).
    polled: bool,
    /// The body ended and its end is queued.
    ended: bool,
    /// All of it is written.
    finished: bool,
}

/// Why sending a streamed body stopped.
enum SendError {
    /// The client's body failed (its fault is noted on the body).
    Body(BoxError),
    /// The connection refused more (the node may have answered already).
    Write(io::Error),
}

impl Sending {
    /// A streamed body framed as `framing` says ([`framing::request`]).
    pub fn new(body: UpBody, framing: BodyFraming) -> Sending {
        let (chunked, left, ended) = match framing {
            BodyFraming::Chunked => (true, 0, false),
            BodyFraming::Length(n) => (false, n, false),
            _ => (false, 0, true),
        };
        Sending {
            body,
            chunked,
            left,
            out: VecDeque::new(),
            polled: false,
            ended,
            finished: ended,
        }
    }

    /// How the body is framed (for the head).
    pub fn framing(&self) -> BodyFraming {
        match (self.chunked, self.finished) {
            (true, _) => BodyFraming::Chunked,
            (false, true) => BodyFraming::None,
            (false, false) => BodyFraming::Length(self.left),
        }
    }

    /// Sends as much of the body as the client has given and the
    /// connection takes; `Ready(Ok)` once all of it is written and flushed.
    fn poll_send(
        &mut self,
        stream: &mut Stream,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), SendError>> {
        loop {
            while let Some(front) = self.out.front_mut() {
                let n = ready!(Pin::new(&mut *stream).poll_write(cx, front))
                    .map_err(SendError::Write)?;
                if n == 0 {
                    return Poll::Ready(Err(SendError::Write(io::ErrorKind::WriteZero.into())));
                }
                front.advance(n);
                if front.is_empty() {
                    self.out.pop_front();
                }
            }
            // What is written leaves TLS's buffer before the next wait.
            ready!(Pin::new(&mut *stream).poll_flush(cx)).map_err(SendError::Write)?;
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            self.polled = true;
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers of the client's body are not passed on.
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.is_empty() {
                        continue;
                    }
                    if self.chunked {
                        let line = SizeLine::new(data.len());
                        self.out.push_back(Bytes::copy_from_slice(line.as_bytes()));
                        self.out.push_back(data);
                        self.out.push_back(Bytes::from_static(chunked::CRLF));
                    } else {
                        let n = data.len() as u64;
                        if n > self.left {
                            return Poll::Ready(Err(SendError::Body(
                                "request body longer than its content-length".into(),
                            )));
                        }
                        self.left -= n;
                        self.out.push_back(data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(SendError::Body(e))),
                None => {
                    if self.chunked {
                        self.out.push_back(Bytes::from_static(chunked::LAST_CHUNK));
                    } else if self.left > 0 {
                        return Poll::Ready(Err(SendError::Body(
                            "request body shorter than its content-length".into(),
                        )));
                    }
                    self.ended = true;
                }
            }
        }
    }
}

/// Why one exchange on one connection failed.
struct Failed {
    /// Nothing at all came back (write error, or EOF/reset before any byte
    /// of a response): on a reused connection this is the idle-close race.
    nothing_back: bool,
    /// The attempt's response timeout passed (never retried here).
    timed_out: bool,
    error: BoxError,
}

impl Failed {
    fn io(e: io::Error, nothing_back: bool) -> Failed {
        Failed {
            nothing_back,
            timed_out: false,
            error: e.into(),
        }
    }

    fn timeout() -> Failed {
        Failed {
            nothing_back: false,
            timed_out: true,
            error: "response timeout".into(),
        }
    }

    fn other(error: BoxError) -> Failed {
        Failed {
            nothing_back: false,
            timed_out: false,
            error,
        }
    }
}

/// Pool settings the exchange needs.
pub struct Settings {
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_idle: usize,
    /// Longest wait between two reads of the response body.
    pub read_timeout: Duration,
}

/// An HTTP/1.1 session to a node: one connection, taken from the thread's
/// pool or freshly opened, carrying one exchange at a time ([`connect`],
/// [`Session::send`]).
pub struct Session {
    conn: Box<Conn>,
    /// Taken from the pool: the node may have closed it meanwhile.
    reused: bool,
}

/// Why a session's exchange failed.
pub enum Failure {
    /// A pooled connection the node had already closed, found so before
    /// anything came back and before anything was sent that cannot be sent
    /// again: a fresh session may carry the request (as nginx does for its
    /// cached connections).
    Stale,
    Failed(Error),
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Error {
        match f {
            Failure::Stale => Error::new(ErrorKind::Exchange)
                .with_source("the node closed the connection before a response"),
            Failure::Failed(e) => e,
        }
    }
}

/// A session to `addr` (over TLS with `tls`): an idle pooled connection
/// still usable, else a fresh one ([`fresh`]).
pub async fn connect(
    addr: SocketAddr,
    tls: Option<&TlsConnect>,
    s: &Settings,
    deadline: &mut Deadline,
) -> Result<Session, Error> {
    match pooled(addr, tls, s.idle_timeout) {
        Some(session) => Ok(session),
        None => fresh(addr, tls, s, deadline).await,
    }
}

/// A session on an idle pooled connection to `addr` (under `tls`) still
/// usable, if there is one: no future, no wait.
pub fn pooled(
    addr: SocketAddr,
    tls: Option<&TlsConnect>,
    idle_timeout: Duration,
) -> Option<Session> {
    let conn = checkout(addr, tls.map_or(0, |t| t.id), idle_timeout)?;
    Some(Session { conn, reused: true })
}

/// A session on a new connection (TCP, and the TLS handshake with `tls`),
/// within the connect timeout and the attempt's deadline.
pub async fn fresh(
    addr: SocketAddr,
    tls: Option<&TlsConnect>,
    s: &Settings,
    deadline: &mut Deadline,
) -> Result<Session, Error> {
    // Boxed once per connection: the response body (which owns the
    // connection until its end) stays small to move. (The connect future
    // boxed too: only new connections pay for it, and the exchange's
    // future stays small to move.)
    let conn = deadline
        .within(open_boxed(addr, tls, s.connect_timeout))
        .await
        .map_err(|_| Error::new(ErrorKind::ResponseTimeout))??;
    Ok(Session {
        conn,
        reused: false,
    })
}

impl Session {
    /// Sends `req` to `addr` on the session and returns the response with
    /// its body streaming from the connection; a streamed body comes in
    /// `sending`, and what is left of it when the head arrives is sent
    /// while the response body is read. [`Failure::Stale`] when a pooled
    /// connection turned out closed and the request may go again: nothing
    /// came back, and it was either never written or is idempotent, and no
    /// byte of a streamed body was taken (`sending` is left in place).
    pub async fn send(
        self,
        addr: SocketAddr,
        req: &Outgoing<'_>,
        sending: &mut Option<Box<Sending>>,
        s: &Settings,
        deadline: &mut Deadline,
    ) -> Result<Response<PooledBody>, Failure> {
        let mut conn = self.conn;
        match exchange(&mut conn, addr, req, sending.as_deref_mut(), deadline).await {
            Ok(head) => {
                let head_request = *req.method == Method::HEAD;
                finish(head, conn, addr, head_request, sending.take(), s).map_err(Failure::Failed)
            }
            Err((f, _)) if f.timed_out => Err(Failure::Failed(ErrorKind::ResponseTimeout.into())),
            Err((f, written))
                if self.reused
                    && f.nothing_back
                    && (!written || super::fields::idempotent(req.method))
                    && !sending.as_ref().is_some_and(|b| b.polled) =>
            {
                tracing::debug!(%addr, error = %f.error, "pooled upstream connection was closed; reconnecting");
                Err(Failure::Stale)
            }
            Err((f, _)) => Err(Failure::Failed(
                Error::new(ErrorKind::Exchange).with_source(f.error),
            )),
        }
    }
}

/// A parsed response head.
struct Head {
    status: StatusCode,
    version: Version,
    /// End-to-end fields only (empty when the connection's `raw` holds
    /// them); every field of a `101`.
    headers: HeaderMap,
    meta: Meta,
    /// Writing a streamed body failed before the head came (the node
    /// answered without reading it all): the connection is not reused.
    send_failed: bool,
}

/// Writes the request and reads the final response head (sending a
/// streamed body meanwhile). On failure also says whether the request was
/// (at least partly) written.
async fn exchange(
    conn: &mut Conn,
    addr: SocketAddr,
    req: &Outgoing<'_>,
    sending: Option<&mut Sending>,
    deadline: &mut Deadline,
) -> Result<Head, (Failed, bool)> {
    // The thread's head buffer (a fresh one while another exchange's write
    // waits with it).
    let mut wbuf = WRITE_BUF_KEPT.take();
    if wbuf.capacity() == 0 {
        wbuf.reserve(WRITE_BUF);
    }
    req.encode(addr, &mut wbuf);
    // The usual head fits the socket's send buffer: one try first, no
    // write future (its readiness poll and budget check) unless it waits.
    let first = match &conn.stream {
        Stream::Plain(s) => match s.try_write(&wbuf) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        },
        Stream::Tls(_) => Ok(0),
    };
    let written = match first {
        Ok(n) if n == wbuf.len() => Ok(Ok(())),
        Ok(n) => {
            let stream = &mut conn.stream;
            deadline
                .within(async {
                    stream.write_all(&wbuf[n..]).await?;
                    stream.flush().await
                })
                .await
        }
        Err(e) => Ok(Err(e)),
    };
    WRITE_BUF_KEPT.set(wbuf);
    written
        .map_err(|_| (Failed::timeout(), true))?
        .map_err(|e| (Failed::io(e, true), false))?;
    if let Some(b) = req.body_after_head() {
        let stream = &mut conn.stream;
        deadline
            .within(async {
                stream.write_all(b).await?;
                stream.flush().await
            })
            .await
            .map_err(|_| (Failed::timeout(), true))?
            .map_err(|e| (Failed::io(e, true), true))?;
    }
    if let Some(sending) = sending {
        // Boxed: the exchange of a body in hand does not carry the duplex
        // loop's state.
        return Box::pin(duplex(conn, req, sending, deadline)).await;
    }
    loop {
        if let Some(head) = parsed(conn, req).map_err(|e| (e, true))? {
            return Ok(head);
        }
        let got_some = !conn.rbuf.is_empty();
        let Ok(filled) = deadline
            .within(std::future::poll_fn(|cx| conn.poll_fill(cx)))
            .await
        else {
            return Err((Failed::timeout(), true));
        };
        filled_ok(filled, got_some).map_err(|e| (e, true))?;
    }
}

/// The final response head at the front of the read buffer, if it is all
/// there; an error for a broken or too large one.
fn parsed(conn: &mut Conn, req: &Outgoing<'_>) -> Result<Option<Head>, Failed> {
    if !conn.rbuf.is_empty() {
        let raw_to = req.keep_lines.then_some(&mut conn.raw);
        if let Some(head) = parse_head(&mut conn.rbuf, &mut conn.spans, raw_to, req.upgrade)? {
            return Ok(Some(head));
        }
    }
    if conn.rbuf.len() > MAX_HEAD {
        return Err(Failed::other("response head too large".into()));
    }
    Ok(None)
}

/// A read while waiting for the head: an EOF or an error fails the
/// exchange (`nothing_back` when no byte of a response had come).
fn filled_ok(filled: io::Result<usize>, got_some: bool) -> Result<(), Failed> {
    match filled {
        Ok(0) => Err(Failed {
            nothing_back: !got_some,
            timed_out: false,
            error: "upstream closed the connection before a response".into(),
        }),
        Ok(_) => Ok(()),
        Err(e) => Err(Failed::io(e, !got_some)),
    }
}

/// Reads the response head while the streamed body is sent (full duplex).
/// A client body that fails ends the exchange; a write the node refuses
/// only stops the sending (the node may be answering: its head is still
/// read).
async fn duplex(
    conn: &mut Conn,
    req: &Outgoing<'_>,
    sending: &mut Sending,
    deadline: &mut Deadline,
) -> Result<Head, (Failed, bool)> {
    let mut send_failed = None;
    let mut sent = false;
    let wait = std::future::poll_fn(|cx| {
        if !sent && send_failed.is_none() {
            match sending.poll_send(&mut conn.stream, cx) {
                Poll::Ready(Ok(())) => {
                    sent = true;
                    sending.finished = true;
                }
                Poll::Ready(Err(SendError::Body(e))) => {
                    return Poll::Ready(Err(Failed::other(e)));
                }
                Poll::Ready(Err(SendError::Write(e))) => send_failed = Some(e),
                Poll::Pending => {}
            }
        }
        loop {
            if let Some(mut head) = parsed(conn, req)? {
                head.send_failed = send_failed.is_some();
                return Poll::Ready(Ok(head));
            }
            let got_some = !conn.rbuf.is_empty();
            let filled = ready!(conn.poll_fill(cx));
            if let Err(mut f) = filled_ok(filled, got_some) {
                // Nothing more to read after the node refused the body:
                // its write error says more.
                if let Some(e) = send_failed.take() {
                    f.error = e.into();
                }
                return Poll::Ready(Err(f));
            }
        }
    });
    match deadline.within(wait).await {
        Ok(r) => r.map_err(|e| (e, true)),
        Err(_) => Err((Failed::timeout(), true)),
    }
}

/// Parses a final response head off the front of `buf`, skipping interim
/// `1xx` responses. `Ok(None)`: incomplete.
/// With `raw_to`, a plain head's fields go there as [`RawLines`] (the
/// head's map is empty then).
fn parse_head(
    buf: &mut BytesMut,
    spans: &mut Vec<Span>,
    raw_to: Option<&mut Option<RawLines>>,
    upgrade: bool,
) -> Result<Option<Head>, Failed> {
    loop {
        // The usual strict head is read in one pass (`head`); anything else
        // by httparse. Either way `spans` holds every field.
        let line = match crate::codec::head::response(buf, spans, MAX_HEADERS) {
            Some(line) => line,
            None => match httparse_head(buf, spans)? {
                Some(line) => line,
                None => return Ok(None),
            },
        };
        let n = line.len;
        let bad = |what: &str| Failed {
            nothing_back: false,
            timed_out: false,
            error: format!("invalid response head: {what}").into(),
        };
        let status = StatusCode::from_u16(line.code).map_err(|_| bad("status"))?;
        // A 101 is the final answer to an upgrade request (its fields all
        // go to the client: Upgrade and Connection say what was agreed).
        let switching = status == StatusCode::SWITCHING_PROTOCOLS;
        if status.is_informational() {
            if !switching {
                let _ = buf.split_to(n);
                continue;
            }
            if !upgrade {
                return Err(bad("101 without an upgrade request"));
            }
        }
        let version = if line.http10 {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        // Hop-by-hop fields are read here (framing, keep-alive) and not
        // passed on; the positions of the fields kept stay in `spans` (on
        // the connection: no allocation), moved down by a loop of its own
        // (`retain`'s closure was a call per field). Header values become
        // zero-copy slices of the head's bytes once it is split off.
        let mut meta = Meta::default();
        let mut kept = 0;
        for i in 0..spans.len() {
            let (ns, ne, vs, ve) = spans[i];
            let name = &buf[ns as usize..ne as usize];
            if meta.note(name, &buf[vs as usize..ve as usize]) || switching {
                spans[kept] = spans[i];
                kept += 1;
            }
        }
        spans.truncate(kept);
        let head = buf.split_to(n).freeze();
        if let Some(to) = raw_to.filter(|_| !switching) {
            if let Some(raw) = raw_lines(&head, spans, &meta, status) {
                *to = Some(raw);
                return Ok(Some(Head {
                    status,
                    version,
                    headers: HeaderMap::new(),
                    meta,
                    send_failed: false,
                }));
            }
        }
        let headers = fields_map(&head, spans, &meta).map_err(bad)?;
        return Ok(Some(Head {
            status,
            version,
            headers,
            meta,
            send_failed: false,
        }));
    }
}

/// httparse's read of a head the fast read declined: every field's
/// position into `spans`; `Ok(None)`: incomplete.
fn httparse_head(buf: &[u8], spans: &mut Vec<Span>) -> Result<Option<StatusLine>, Failed> {
    // Left uninitialized: filling 100 empty fields per parse costs more
    // than the parse.
    let mut fields =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut fields,
    );
    let len = match parsed {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(Failed {
                nothing_back: false,
                timed_out: false,
                error: format!("invalid response head: {e}").into(),
            })
        }
    };
    crate::codec::head::httparse_spans(buf, resp.headers, spans);
    Ok(Some(StatusLine {
        len,
        code: resp.code.unwrap_or(0),
        http10: resp.version == Some(0),
    }))
}

/// The end-to-end fields at `spans` of `head` as a map (dropping a
/// Content-Length that Transfer-Encoding overrides: RFC 9112 §6.3, the
/// body goes out de-chunked).
fn fields_map(head: &Bytes, spans: &[Span], meta: &Meta) -> Result<HeaderMap, &'static str> {
    let mut headers = HeaderMap::with_capacity(spans.len());
    let drop_length = meta.chunked.is_some() && meta.saw_length;
    for &(ns, ne, vs, ve) in spans {
        let (ns, ne, vs, ve) = (ns as usize, ne as usize, vs as usize, ve as usize);
        if drop_length && name_eq(&head[ns..ne], b"content-length") {
            continue;
        }
        let name = crate::codec::fields::name_of(&head[ns..ne]).map_err(|_| "header name")?;
        let value =
            HeaderValue::from_maybe_shared(head.slice(vs..ve)).map_err(|_| "header value")?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// The node's plain head's end-to-end lines as it sent them
/// ([`RawLines`]: written to an HTTP/1.1 client as they are); `None` when
/// the head is not plain — a line not exactly `name: value` + CRLF, a
/// `Connection` field (it may name other fields), more than one
/// Content-Length or one beside a Transfer-Encoding, a status without a
/// body, more runs than kept — and takes the map.
fn raw_lines(head: &Bytes, spans: &[Span], meta: &Meta, status: StatusCode) -> Option<RawLines> {
    if meta.length_error.is_some()
        || (meta.chunked.is_some() && meta.saw_length)
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return None;
    }
    let mut raw = RawLines::new(head.clone());
    let mut lengths = 0;
    for &(ns, ne, vs, ve) in spans {
        let name = &head[ns as usize..ne as usize];
        if !is_plain_line(head, ne as usize, vs as usize, ve as usize) {
            return None;
        }
        match name.len() {
            10 if name_eq(name, b"connection") => return None,
            4 if name_eq(name, b"date") => raw.has_date = true,
            12 if name_eq(name, b"content-type") => raw.content_type_at(vs, ve),
            14 if name_eq(name, b"content-length") => {
                lengths += 1;
                raw.length = meta.length;
            }
            _ => {}
        }
        if !raw.push(ns, ve + 2) {
            return None;
        }
    }
    (lengths <= 1).then_some(raw)
}

/// What the hop-by-hop and length fields of a response head say.
#[derive(Default)]
struct Meta {
    /// `Connection: close`.
    close: bool,
    /// `Connection: keep-alive`.
    keep_alive: bool,
    /// Transfer-Encoding present: is its last coding `chunked`?
    chunked: Option<bool>,
    /// Content-Length, if any.
    length: Option<u64>,
    /// Some Content-Length field was present (valid or not).
    saw_length: bool,
    /// A malformed or conflicting Content-Length.
    length_error: Option<&'static str>,
}

impl Meta {
    /// Notes one field; false when it is hop-by-hop and must not be passed
    /// on. A Connection header naming other fields is kept, so the proxy's
    /// hop-by-hop pass removes those fields and it.
    fn note(&mut self, name: &[u8], value: &[u8]) -> bool {
        // Byte-level: one response per request passes here, and the usual
        // values (`keep-alive`, a length) need no UTF-8 pass or trimming.
        // The name is matched by its length first: one word compare.
        let is = |lower: &[u8]| name_eq(name, lower);
        match name.len() {
            10 if is(b"connection") => {
                // The usual value, one compare; a list is split.
                if name_eq(value, b"keep-alive") {
                    self.keep_alive = true;
                    return false;
                }
                let mut names_others = false;
                for t in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    if name_eq(t, b"close") {
                        self.close = true;
                    } else if name_eq(t, b"keep-alive") {
                        self.keep_alive = true;
                    } else if !t.is_empty() && !name_eq(t, b"upgrade") {
                        names_others = true;
                    }
                }
                names_others
            }
            17 if is(b"transfer-encoding") => {
                let last = value.rsplit(|&b| b == b',').next().unwrap_or(b"");
                self.chunked = Some(name_eq(last.trim_ascii(), b"chunked"));
                false
            }
            14 if is(b"content-length") => {
                self.saw_length = true;
                match framing::content_length(value) {
                    Some(n) if self.length.is_none_or(|l| l == n) => self.length = Some(n),
                    Some(_) => self.length_error = Some("conflicting content-length"),
                    None => self.length_error = Some("bad content-length"),
                }
                true
            }
            _ => !is_hop_by_hop(name),
        }
    }

    /// The body's framing (RFC 9112 §6.3, [`crate::codec::framing`]).
    fn framing(&self, status: StatusCode, head_request: bool) -> Result<Framing, &'static str> {
        let fields = LengthFields {
            chunked: self.chunked,
            length: self.length,
            length_error: self.length_error,
        };
        Ok(
            match framing::response(status.as_u16(), head_request, &fields)? {
                BodyFraming::None => Framing::Done,
                BodyFraming::Length(n) => Framing::Length(n),
                BodyFraming::Chunked => Framing::Chunked(Chunked::default()),
                BodyFraming::UntilClose => Framing::UntilClose,
            },
        )
    }
}

/// One node response as the engine reads it, decoded off raw
/// bytes without a socket (the response codec on its own: fuzz targets
/// and codec tests drive it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub status: u16,
    /// The end-to-end fields as the proxy passes them on (hop-by-hop
    /// fields and those a Connection names dropped), in the header map's
    /// order.
    pub fields: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// The bytes after the message; `None` when it ends at the close.
    pub rest: Option<Vec<u8>>,
}

/// Decodes the response at the front of `wire` as the engine does
/// — interim `1xx` skipped, the head's framing, the chunked body that came
/// with the head checked before the head would go out — with `wire`
/// arriving `piece` bytes at a time (the connection's reads). `Err`: what
/// the exchange answers 502 for (a message cut short included).
pub fn decode_response(wire: &[u8], piece: usize, head_request: bool) -> Result<Decoded, String> {
    let piece = piece.max(1);
    let mut fed = 0;
    let mut buf = BytesMut::new();
    let mut feed = |buf: &mut BytesMut| -> bool {
        if fed == wire.len() {
            return false;
        }
        let end = (fed + piece).min(wire.len());
        buf.extend_from_slice(&wire[fed..end]);
        fed = end;
        true
    };
    let mut spans = Vec::new();
    let head = loop {
        match parse_head(&mut buf, &mut spans, None, false).map_err(|f| f.error.to_string())? {
            Some(h) => break h,
            None if buf.len() > MAX_HEAD => return Err("response head too large".into()),
            None if !feed(&mut buf) => return Err("cut short in the head".into()),
            None => {}
        }
    };
    let bad = |e: &str| format!("invalid response: {e}");
    let framing = head.meta.framing(head.status, head_request).map_err(bad)?;
    if matches!(framing, Framing::Chunked(_)) {
        crate::codec::chunked::check_in_hand(&buf).map_err(bad)?;
    }
    // As the proxy passes them on: the fields a Connection names go too.
    let mut headers = head.headers;
    super::fields::strip_hop_by_hop(&mut headers);
    let fields = headers
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
        .collect();
    let mut body = Vec::new();
    match framing {
        Framing::Done => {}
        Framing::Length(n) => {
            while (buf.len() as u64) < n {
                if !feed(&mut buf) {
                    return Err("cut short in the body".into());
                }
            }
            body.extend_from_slice(&buf.split_to(n as usize));
        }
        Framing::Chunked(mut c) => loop {
            match c.step(&mut buf).map_err(bad)? {
                Step::Data(d) => body.extend_from_slice(&d),
                Step::Done => break,
                Step::More => {
                    if !feed(&mut buf) {
                        return Err("cut short in the body".into());
                    }
                }
            }
        },
        Framing::UntilClose => {
            while feed(&mut buf) {}
            body.extend_from_slice(&buf);
            return Ok(Decoded {
                status: head.status.as_u16(),
                fields,
                body,
                rest: None,
            });
        }
    }
    let mut rest = buf.to_vec();
    rest.extend_from_slice(&wire[fed..]);
    Ok(Decoded {
        status: head.status.as_u16(),
        fields,
        body,
        rest: Some(rest),
    })
}

/// How the response body is delimited.
enum Framing {
    Length(u64),
    Chunked(Chunked),
    UntilClose,
    Done,
}

fn finish(
    head: Head,
    conn: Box<Conn>,
    addr: SocketAddr,
    head_request: bool,
    sending: Option<Box<Sending>>,
    s: &Settings,
) -> Result<Response<PooledBody>, Error> {
    let bad =
        |e: &str| Error::new(ErrorKind::Exchange).with_source(format!("invalid response: {e}"));
    let framing = head.meta.framing(head.status, head_request).map_err(bad)?;
    // A broken chunked body, as far as it came with the head, is refused
    // before the head goes out (a 502, not a truncated 200).
    if matches!(framing, Framing::Chunked(_)) {
        crate::codec::chunked::check_in_hand(&conn.rbuf).map_err(bad)?;
    }
    // An upstream that sent both Transfer-Encoding and Content-Length may
    // disagree with us about where its message ends: never reuse it.
    let ambiguous = head.meta.chunked.is_some() && head.meta.saw_length;
    let switched = head.status == StatusCode::SWITCHING_PROTOCOLS;
    let keep_alive = !matches!(framing, Framing::UntilClose)
        && !ambiguous
        && !head.send_failed
        && !switched
        && match head.version {
            Version::HTTP_10 => head.meta.keep_alive,
            _ => !head.meta.close,
        };
    let mut conn = conn;
    let mut headers = head.headers;
    if matches!(framing, Framing::Done) {
        // No body to follow: the client side would put the fields into
        // the map anyway (it rewrites such a head); done here, before the
        // connection goes back to the pool with them.
        if let Some(raw) = conn.raw.take() {
            headers = raw.to_map();
        }
    }
    let mut body = RawBody {
        conn: Some(conn),
        framing,
        keep_alive,
        addr,
        max_idle: s.max_idle,
        stall: Stall::new(s.read_timeout),
        // What is left of a streamed body goes out while the response
        // body is read.
        sending: sending.filter(|b| !b.finished && !head.send_failed),
    };
    // The connection of a 101 waits for `take_upgraded`.
    if !switched {
        body.release_if_done();
    }
    // Built as the client's type here: the response is not moved again
    // to be wrapped.
    let mut resp = Response::new(PooledBody::Raw(body, None));
    *resp.status_mut() = head.status;
    *resp.version_mut() = head.version;
    crate::codec::head::drop_map(std::mem::replace(resp.headers_mut(), headers));
    Ok(resp)
}

/// A response body read straight off the upstream connection.
pub struct RawBody {
    conn: Option<Box<Conn>>,
    framing: Framing,
    keep_alive: bool,
    addr: SocketAddr,
    max_idle: usize,
    /// The read timeout between two reads of the body.
    stall: Stall,
    /// The rest of a streamed request body, sent as the body is read.
    sending: Option<Box<Sending>>,
}

impl RawBody {
    /// The connection of a `101` answer, as the node's side of the
    /// upgraded connection (any bytes read past the 101 head in front).
    pub fn take_upgraded(&mut self) -> Option<Upgraded> {
        let mut conn = self.conn.take()?;
        self.framing = Framing::Done;
        Some(Upgraded {
            pre: std::mem::take(&mut conn.rbuf),
            conn,
        })
    }

    /// Sends more of a streamed request body, if any is left: the client's
    /// body failing fails the response too; the node refusing more only
    /// keeps the connection from being reused.
    fn poll_sending(&mut self, cx: &mut Context<'_>) -> Result<(), Error> {
        let (Some(sending), Some(conn)) = (self.sending.as_mut(), self.conn.as_mut()) else {
            return Ok(());
        };
        match sending.poll_send(&mut conn.stream, cx) {
            Poll::Pending => Ok(()),
            Poll::Ready(Ok(())) => {
                self.sending = None;
                Ok(())
            }
            Poll::Ready(Err(SendError::Write(e))) => {
                tracing::debug!(error = %e, "the node took no more of the request body");
                self.sending = None;
                self.keep_alive = false;
                Ok(())
            }
            Poll::Ready(Err(SendError::Body(e))) => {
                Err(Error::new(ErrorKind::UpstreamBody).with_source(e))
            }
        }
    }
    /// The response head's lines as the node sent them, when the request
    /// asked for them and the head was plain ([`RawLines`]; the response's
    /// map holds none of them).
    pub fn take_lines(&mut self) -> Option<RawLines> {
        self.conn.as_mut()?.raw.take()
    }

    /// At the body's end: the connection goes back to the pool when the
    /// exchange left it clean, and is closed otherwise.
    fn release_if_done(&mut self) {
        if !matches!(self.framing, Framing::Done) {
            return;
        }
        if let Some(mut conn) = self.conn.take() {
            // A request body not all sent leaves the connection unusable.
            if self.keep_alive && conn.rbuf.is_empty() && self.sending.is_none() {
                // A head's fields not taken are not the next response's.
                conn.raw = None;
                checkin(self.addr, conn, self.max_idle);
            }
        }
    }

    /// Ends the body with an error; the connection is closed, never
    /// reused.
    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.conn = None;
        self.sending = None;
        self.framing = Framing::Done;
        Poll::Ready(Some(Err(e.into())))
    }
}

impl Body for RawBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.sending.is_some() {
            if let Err(e) = this.poll_sending(cx) {
                return this.fail(e);
            }
        }
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let data = match &mut this.framing {
                Framing::Done => None,
                Framing::Length(rem) if !conn.rbuf.is_empty() => {
                    let n = (*rem).min(conn.rbuf.len() as u64);
                    *rem -= n;
                    let d = conn.rbuf.split_to(n as usize).freeze();
                    if *rem == 0 {
                        this.framing = Framing::Done;
                    }
                    Some(d)
                }
                Framing::Length(_) => None,
                Framing::Chunked(c) => match c.step(&mut conn.rbuf) {
                    Ok(Step::Data(d)) => Some(d),
                    Ok(Step::Done) => {
                        this.framing = Framing::Done;
                        None
                    }
                    Ok(Step::More) => None,
                    Err(e) => return this.fail(Error::new(ErrorKind::UpstreamBody).with_source(e)),
                },
                Framing::UntilClose => (!conn.rbuf.is_empty()).then(|| conn.rbuf.split().freeze()),
            };
            if let Some(d) = data {
                this.release_if_done();
                return Poll::Ready(Some(Ok(Frame::data(d))));
            }
            if matches!(this.framing, Framing::Done) {
                this.release_if_done();
                this.conn = None;
                return Poll::Ready(None);
            }
            let filled = match conn.poll_fill(cx) {
                Poll::Ready(r) => r,
                Poll::Pending if this.stall.stalled(cx) => {
                    return this.fail(Error::new(ErrorKind::UpstreamBodyTimeout));
                }
                Poll::Pending => return Poll::Pending,
            };
            this.stall.progress();
            match filled {
                Ok(0) if matches!(this.framing, Framing::UntilClose) => {
                    this.conn = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    let e = Error::new(ErrorKind::UpstreamBody)
                        .with_source("upstream closed the connection mid-body");
                    return this.fail(e);
                }
                Ok(_) => {}
                Err(e) => return this.fail(Error::new(ErrorKind::UpstreamBody).with_source(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Done => SizeHint::with_exact(0),
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

/// The node's side of an upgraded connection: the connection, with the
/// bytes read past the 101 head given out first.
pub struct Upgraded {
    pre: BytesMut,
    conn: Box<Conn>,
}

impl AsyncRead for Upgraded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.pre.is_empty() {
            let n = this.pre.len().min(buf.remaining());
            buf.put_slice(&this.pre.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.conn.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().conn.stream).poll_write(cx, b)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().conn.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().conn.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled connection is stale once its peer closed it or sent
    /// stray bytes (seen through the I/O driver's readiness), and not
    /// before.
    #[tokio::test]
    async fn is_stale_sees_a_close_and_stray_bytes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for stray in [false, true] {
            let stream = TcpStream::connect(addr).await.unwrap();
            let (mut peer, _) = listener.accept().await.unwrap();
            let conn = Conn::new(Stream::Plain(stream), 0);
            // A round trip on the connection: the driver has polled it.
            peer.write_all(b"").await.unwrap();
            tokio::task::yield_now().await;
            assert!(!conn.is_stale(), "a quiet connection is usable");
            if stray {
                peer.write_all(b"x").await.unwrap();
            } else {
                drop(peer);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !conn.is_stale() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "stray {stray}: never stale"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// A pooled connection holds no read buffer: its buffer waits on the
    /// thread's free list, the next fill takes it back, and a trim frees
    /// one that no exchange took over a whole period.
    #[tokio::test]
    async fn a_pooled_connection_keeps_no_buffer_and_the_kept_one_is_trimmed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        use crate::codec::readbuf;
        let kept = || readbuf::kept(Side::Node);
        let mut conn = Box::new(Conn::new(Stream::Plain(stream), 0));
        peer.write_all(b"x").await.unwrap();
        let n = std::future::poll_fn(|cx| conn.poll_fill(cx)).await.unwrap();
        assert_eq!(n, 1);
        conn.rbuf.clear();
        assert!(conn.rbuf.capacity() >= READ_MIN);

        checkin(addr, conn, 8);
        assert_eq!(kept(), 1, "the buffer went to the free list");
        let mut conn = checkout(addr, 0, Duration::from_secs(60)).expect("pooled");
        assert_eq!(
            conn.rbuf.capacity(),
            0,
            "a pooled connection holds a buffer"
        );

        // The next fill takes the kept buffer (no new one).
        peer.write_all(b"y").await.unwrap();
        std::future::poll_fn(|cx| conn.poll_fill(cx)).await.unwrap();
        assert_eq!(kept(), 0, "the kept buffer was not taken");
        conn.rbuf.clear();
        checkin(addr, conn, 8);
        assert_eq!(kept(), 1);

        // Not taken over a whole period: freed by the second trim.
        assert_eq!(readbuf::trim(), 0);
        assert_eq!(readbuf::trim(), 1);
        assert_eq!(kept(), 0);
    }

    /// The client's fields passed on unchanged go out as their lines came
    /// (its case; lines next to each other in one copy); a field changed,
    /// a value copied under another name, a line not exactly
    /// `name: value` CRLF and the gateway's own fields go out from the map.
    #[test]
    fn a_clients_unchanged_lines_go_out_as_sent() {
        let sent = Bytes::from_static(
            b"GET /p HTTP/1.1\r\nHost: a\r\nX-User-Id: 7\r\nContent-Length: 0\r\n\
              Accept:  */*\r\nX-Copy: q\r\nX-Last: z\r\n\r\n",
        );
        let value = |text: &str| {
            let at = sent
                .windows(text.len())
                .position(|w| w == text.as_bytes())
                .unwrap();
            HeaderValue::from_maybe_shared(sent.slice(at..at + text.len())).unwrap()
        };
        let mut headers = HeaderMap::new();
        headers.append(header::HOST, value("a"));
        headers.append("x-user-id", value("7"));
        headers.append(header::CONTENT_LENGTH, value("0"));
        headers.append(header::ACCEPT, value("*/*"));
        headers.append("x-copy", HeaderValue::from_static("changed"));
        headers.append("x-other", value("7"));
        headers.append("x-last", value("z"));
        let added = Added::none();
        let sent = SentHead::new(sent.clone());
        let out = Outgoing {
            method: &Method::GET,
            path_and_query: "/p",
            headers: &headers,
            sent: Some(&sent),
            added: &added,
            body: None,
            streamed: None,
            keep_lines: false,
            upgrade: false,
        };
        let mut w = Vec::new();
        out.encode("127.0.0.1:9".parse().unwrap(), &mut w);
        assert_eq!(
            String::from_utf8(w).unwrap(),
            "GET /p HTTP/1.1\r\nHost: a\r\nX-User-Id: 7\r\naccept: */*\r\n\
             x-copy: changed\r\nx-other: 7\r\nX-Last: z\r\ncontent-length: 0\r\n\r\n"
        );
    }

    /// The head of a streamed body says its framing once: chunked (the
    /// client's own length and coding fields dropped) or the known length;
    /// a body in hand its own length.
    #[test]
    fn the_head_frames_the_body_once() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("gzip"));
        headers.insert(header::HOST, HeaderValue::from_static("a"));
        let added = Added::none();
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let head = |streamed: Option<BodyFraming>, body: Option<Bytes>| {
            let out = Outgoing {
                method: &Method::POST,
                path_and_query: "/p",
                headers: &headers,
                sent: None,
                added: &added,
                body,
                streamed,
                keep_lines: false,
                upgrade: false,
            };
            let mut w = Vec::new();
            out.encode(addr, &mut w);
            String::from_utf8(w).unwrap()
        };
        let framing = |h: &str| {
            h.lines()
                .filter(|l| {
                    let l = l.to_ascii_lowercase();
                    l.starts_with("content-length") || l.starts_with("transfer-encoding")
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let chunked = head(Some(BodyFraming::Chunked), None);
        assert!(
            chunked.starts_with("POST /p HTTP/1.1\r\nhost: a\r\n"),
            "{chunked}"
        );
        assert_eq!(framing(&chunked), ["transfer-encoding: chunked"]);
        assert!(chunked.ends_with("\r\n\r\n"));
        assert_eq!(
            framing(&head(Some(BodyFraming::Length(70000)), None)),
            ["content-length: 70000"]
        );
        let in_hand = head(None, Some(Bytes::from_static(b"hello")));
        assert_eq!(framing(&in_hand), ["content-length: 5"]);
        assert!(in_hand.ends_with("\r\n\r\nhello"));
    }

    #[test]
    fn hop_by_hop_fields_are_read_and_dropped() {
        let mut m = Meta::default();
        assert!(!m.note(b"Connection", b"keep-alive"));
        assert!(m.keep_alive && !m.close);
        assert!(!m.note(b"connection", b" Upgrade ,CLOSE"));
        assert!(m.close);
        // A Connection naming other fields is kept for the proxy's pass.
        assert!(m.note(b"Connection", b"close, x-private"));
        assert!(!m.note(b"Transfer-Encoding", b"gzip, Chunked "));
        assert_eq!(m.chunked, Some(true));
        assert!(!m.note(b"transfer-encoding", b"chunked, gzip"));
        assert_eq!(m.chunked, Some(false));
        assert!(!m.note(b"Keep-Alive", b"timeout=5"));
        assert!(m.note(b"Content-Type", b"text/plain"));
        let mut l = Meta::default();
        assert!(l.note(b"Content-Length", b"7"));
        assert!(l.note(b"content-length", b"7"));
        assert_eq!((l.length, l.length_error), (Some(7), None));
        assert!(l.note(b"content-length", b"8"));
        assert_eq!(l.length_error, Some("conflicting content-length"));
        let mut b = Meta::default();
        b.note(b"content-length", b"1,1");
        assert_eq!(b.length_error, Some("bad content-length"));
        assert!(b.saw_length);
    }
}
