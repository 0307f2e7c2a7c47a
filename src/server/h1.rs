//! Layer: server. The hand-written HTTP/1.1 server connection for plain
//! listeners (and the HTTP/1.1 side of h2c ones): a small loop instead of
//! hyper's server connection, for two reasons — an idle keep-alive
//! connection holds no buffer (hyper keeps its read and write buffers for the
//! connection's life), and a request does less work (no dispatcher task
//! state, no per-request timers, heads parsed straight into the `http` types
//! and encoded into a reused per-thread buffer).
//!
//! Every request on such a connection is served here, with the shared
//! codec (`codec`): the head read by `codec::head` (httparse where the
//! fast read declines), a body that arrived with its head handed over
//! whole, any other `Content-Length` or chunked body streamed from the
//! socket as the request path asks for it (`codec::body` through a
//! `base::pipe`, `Expect: 100-continue` answered on the first demand), an
//! `Upgrade` request turned into the client's side of a tunnel once its
//! `101` is out. Heads that are no request are answered here and the
//! connection closed: 400 (syntax, a bad field, conflicting lengths,
//! chunked on HTTP/1.0), 414 (a target longer than any URI, or a request
//! line that fills the whole read buffer), 431 (too many fields, a head
//! over the buffer), 405 (`CONNECT`: no forward proxying); a
//! `Transfer-Encoding` other than one `chunked` field goes through the
//! proxy to its 501. No connection changes engine mid-life.
//!
//! Between requests a connection is a small future awaiting readability: a
//! read buffer is taken from a per-thread pool only while a head is being
//! read, and given back once the request is parsed (unless pipelined bytes
//! follow); the response head is written from a per-thread buffer. The idle
//! timeout is checked on the accept loop's coarse tick (no timer per
//! connection or request); header-read and send timeouts arm a timer only
//! while a read or a write actually waits. The tuned machinery sits in
//! modules of its own, each saying what it buys and where that is
//! measured: the pooled read buffers (`readbuf`), the request futures'
//! reused heap slots (`inbox`); the stream (plain or TLS) is reached
//! through `wire`.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use hyper::body::Body as _;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::inbox::{self, InBox};
use super::wheel::Wheel;
use super::wire::{TlsWire, Wire};
use super::{App, Proxy, Server};
use crate::base::body::{BodyError, RequestBody, SendFile};
use crate::base::clock::now_ms;
use crate::base::counter::Counted;
use crate::base::pipe::{pipe, PipeWriter};
use crate::base::ratelog::log_limited;
use crate::base::upgrade::{ClientUpgrade, Tunnel};
use crate::base::Https;
use crate::codec::body::{BodyDecoder, Piece};
use crate::codec::fields::{name_eq, RawLines, SentHead};
use crate::codec::framing::{self, content_length, RequestBody as Framed};
use crate::codec::head::{httparse_spans, span_in, RequestLine, Span};
use crate::codec::readbuf::{self, Side, READ_BUF};
use crate::proxy;
use crate::proxy::record::Recorded;
use crate::proxy::Answer;
use tokio_rustls::server::TlsStream;

/// `TCP_NOTSENT_LOWAT` of a connection once it sends a file by sendfile(2):
/// enough unsent bytes queued to keep the link busy, few enough that a
/// slow reader does not pin a large socket buffer (the static-files
/// benchmark page has the runs behind the value).
const SENDFILE_LOWAT: u32 = 32 * 1024;
/// Fields a head may have (hyper's default limit too); more: 431.
const MAX_HEADERS: usize = 100;
/// The longest request target taken (hyper's limit too); longer: 414.
const MAX_URI_LEN: usize = (u16::MAX - 1) as usize;
/// Room made for each read of a streamed request body.
const BODY_READ: usize = 16 * 1024;
/// A body frame up to this size is copied behind its head (one write).
const COALESCE: usize = 16 * 1024;

thread_local! {
    static WRITE_BUF: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((0, [0; 29])) };
    static SPANS: Cell<Vec<Span>> = const { Cell::new(Vec::new()) };
    static SEEN: RefCell<SeenNames> = RefCell::new(SeenNames::default());
}

/// Names [`seen_name`] keeps per thread.
const SEEN_NAMES: usize = 8;
/// The longest name kept there.
const SEEN_NAME_MAX: usize = 64;

/// The thread's last few request field names outside
/// `fields::known_name` (an application's `X-User-Id`, a lane tag): each
/// `HeaderName::from_bytes` of one lower-cases it, matches it against the
/// standard names and allocates its copy; a clone of a kept one is a
/// reference count.
#[derive(Default)]
struct SeenNames {
    names: Vec<HeaderName>,
    /// The slot replaced next once full.
    next: usize,
}

/// A kept name equal to the wire name `b` (any case), as
/// `HeaderName::from_bytes(b)` would make it.
fn seen_name(b: &[u8]) -> Option<HeaderName> {
    SEEN.with(|s| {
        let s = s.borrow();
        // Kept names are lower-case letters, digits and `-` only, as
        // `name_eq` needs of its second operand.
        s.names
            .iter()
            .find(|n| name_eq(b, n.as_str().as_bytes()))
            .cloned()
    })
}

/// Keeps `n` for [`seen_name`] (names of other bytes, e.g. with `_`, and
/// long ones are not kept).
fn remember_name(n: &HeaderName) {
    let text = n.as_str().as_bytes();
    if text.len() > SEEN_NAME_MAX
        || !text
            .iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
    {
        return;
    }
    SEEN.with(|s| {
        let mut s = s.borrow_mut();
        if s.names.len() < SEEN_NAMES {
            s.names.push(n.clone());
        } else {
            let i = s.next;
            s.names[i] = n.clone();
            s.next = (i + 1) % SEEN_NAMES;
        }
    })
}

/// The `Date` value, formatted once per second per thread (as hyper does).
fn date(out: &mut Vec<u8>) {
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        let now = now_ms();
        if now >= d.0 {
            let wall = std::time::SystemTime::now();
            let s = httpdate::fmt_http_date(wall);
            let n = s.len().min(29);
            d.1[..n].copy_from_slice(&s.as_bytes()[..n]);
            let sub = wall
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.subsec_millis() as u64);
            d.0 = now + (1000 - sub).max(1);
        }
        out.extend_from_slice(&d.1);
    });
}

/// What a connection does after an exchange.
enum Next {
    KeepAlive,
    Close,
    /// A `101` went out: the connection (its unread bytes in front) is the
    /// client's side of the tunnel now.
    Upgrade(oneshot::Sender<Tunnel>),
}

/// One HTTP/1.1 client connection (plain, or TLS: [`Wire`]): its idle
/// state.
struct Conn<W: Wire = TcpStream, A: App = Proxy> {
    server: Arc<Server>,
    /// What the requests are served by (the proxy: nothing stored).
    app: A,
    stream: W,
    peer: SocketAddr,
    /// Bytes read past the last request (pipelining); `None` when idle
    /// (boxed: rare, and the idle connection stays small).
    pending: Option<Box<BytesMut>>,
    /// Last read or write (`now_ms`).
    last: u64,
    /// The accept loop's idle wake-up wheel: the connection waits on the
    /// slot of its idle deadline (all are woken when the drain begins).
    wheel: Arc<Wheel>,
    /// Counts the connection (for the cap and the drain) until it ends.
    _open: Option<Counted>,
    /// `TCP_NOTSENT_LOWAT` was set (at the first sendfile'd answer).
    lowat: bool,
    /// Over TLS (requests carry the `Https` mark).
    secure: bool,
}

/// Serves a plain connection: the accept loop spawns this future as the
/// connection's task. The connection's state is boxed before the spawn, so
/// the task holds a pointer to it (and the exchange takes the box and hands
/// it back, a pointer's move).
pub(super) fn serve<A: App>(
    server: Arc<Server>,
    app: A,
    stream: TcpStream,
    peer: SocketAddr,
    wheel: Arc<Wheel>,
    open: Option<Counted>,
) -> impl Future<Output = ()> + Send {
    run(Box::new(Conn {
        server,
        app,
        stream,
        peer,
        pending: None,
        last: now_ms(),
        wheel,
        _open: open,
        lowat: false,
        secure: false,
    }))
}

/// Serves an HTTP/1.1 connection over TLS (after the handshake chose
/// HTTP/1.1) with the same codec and loop as a plain one; its opener
/// counts it.
pub(super) fn serve_tls(
    server: Arc<Server>,
    stream: TlsStream<TcpStream>,
    peer: SocketAddr,
    wheel: Arc<Wheel>,
) -> impl Future<Output = ()> + Send {
    run(Box::new(Conn {
        server,
        app: Proxy,
        stream: TlsWire::new(stream),
        peer,
        pending: None,
        last: now_ms(),
        wheel,
        _open: None,
        lowat: false,
        secure: true,
    }))
}

async fn run<W: Wire, A: App>(conn: Box<Conn<W, A>>) {
    // Served here until the connection closes or becomes a tunnel (the
    // tick's registration is dropped with `plain`'s state first).
    let Some((conn, tunnel)) = plain(conn).await else {
        return;
    };
    let Conn {
        stream, pending, ..
    } = *conn;
    let io = stream.into_tunnel(pending.map_or_else(Bytes::new, |b| b.freeze()));
    // The proxy's tunnel task takes it from here (counted as a tunnel from
    // the 101 on, so the drain sees no gap).
    let _ = tunnel.send(io);
}

/// The connection's requests; `Some`: it became a tunnel (after a `101`),
/// to be handed to the proxy's side.
async fn plain<W: Wire, A: App>(
    mut conn: Box<Conn<W, A>>,
) -> Option<(Box<Conn<W, A>>, oneshot::Sender<Tunnel>)> {
    // The tick's wake-up, kept registered across requests (renewed only
    // once it has fired): no waiter put into and taken out of the accept
    // loop's list per request. A request moves the deadline later, so the
    // slot it waits on comes no later than the deadline's.
    let mut tick = std::pin::pin!(conn.wheel.slot(conn.idle_due()).clone().notified_owned());
    loop {
        if conn.pending.is_none() && !poll_fn(|cx| conn.poll_idle(tick.as_mut(), cx)).await {
            if W::BUFFERED {
                Box::pin(conn.close()).await;
            }
            return None;
        }
        // Boxed: the exchange's state (the head being read, the response
        // being written) lives only while a request does; the idle
        // connection's task stays small. The exchange owns the connection
        // meanwhile (its future borrows nothing, so its heap slot can serve
        // the thread's next request: [`InBox`]).
        let (back, next) = InBox::new(move || conn.exchange_owned()).await;
        conn = back;
        match next {
            Next::KeepAlive => {}
            Next::Close => {
                if W::BUFFERED {
                    Box::pin(conn.close()).await;
                }
                return None;
            }
            Next::Upgrade(tunnel) => return Some((conn, tunnel)),
        }
    }
}

/// Frees the thread's kept read buffers and request slots that were not
/// handed out since the last call (the accept loop calls this on its tick);
/// how many were freed.
pub(crate) fn trim_kept() -> usize {
    inbox::trim() + readbuf::trim() + crate::codec::fields::trim()
}

impl<W: Wire, A: App> Conn<W, A> {
    /// Ready (holding no buffer, no timer) once the client sends; false
    /// when the connection is to close: idle timeout (shortened while
    /// draining) or an error. The idle timeout is checked when the accept
    /// loop's coarse tick reaches the wheel slot the connection waits on
    /// (every slot is woken when the drain begins): no timer per
    /// connection or request.
    /// `tick`: the wheel's wake-up, registered here (it stays registered
    /// while the connection serves; once it has fired it is renewed, on
    /// the slot of the deadline then).
    /// A poll function, not an `async fn`: its state would be part of the
    /// idle connection's task (its 64 bytes take the task past a 256-byte
    /// cell).
    fn poll_idle(
        &mut self,
        mut tick: Pin<&mut tokio::sync::futures::OwnedNotified>,
        cx: &mut Context<'_>,
    ) -> Poll<bool> {
        loop {
            // Registered before the timeout is checked: a tick between the
            // check and the wait is not missed. (A no-op once registered.)
            tick.as_mut().enable();
            // What the client sent is served even when the timeout passed
            // since the last tick (the tick, not the exact time, closes an
            // idle connection). The readiness waker sits in the socket's
            // registration: no waiter node or future of its own while idle.
            if let Poll::Ready(r) = self.stream.poll_read_ready(cx) {
                return Poll::Ready(r.is_ok());
            }
            let due = self.idle_due();
            if now_ms() >= due {
                return Poll::Ready(false);
            }
            match tick.as_mut().poll(cx) {
                Poll::Ready(()) => tick.set(self.wheel.slot(due).clone().notified_owned()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Ends the stream's session before the socket closes (TLS: the
    /// `close_notify` alert, so a client reading to the close can tell it
    /// from a cut), bounded by the send timeout. Plain sockets have nothing
    /// to say: they are only dropped.
    async fn close(&self) {
        let send = Duration::from_millis(self.server.plane.current().config.client.send_timeout_ms);
        let shut = poll_fn(|cx| self.stream.poll_shutdown(cx));
        let _ = crate::base::deadline::timeout(send.min(Duration::from_secs(1)), shut).await;
    }

    /// When the connection, idle since its last read or write, is closed
    /// (`now_ms`): the current configuration's idle timeout, shortened
    /// while draining.
    fn idle_due(&self) -> u64 {
        let gen = self.server.plane.current();
        let limits = &gen.config.client;
        let since = if self.server.draining.load(Ordering::Relaxed) {
            self.server.drain_since_or_now()
        } else {
            0
        };
        super::conn::idle_due(
            self.last,
            limits.idle_timeout_ms,
            since,
            limits.drain_idle_ms,
        )
    }

    /// Answers a head that is no request this path serves (a
    /// [`Refusal`]) with its status, the gateway's short body and
    /// `Connection: close`; the connection closes after it. The head was
    /// never a request, so nothing is recorded (nginx logs these as 400s
    /// with no request; hyper did not log them either).
    async fn refuse(&mut self, refusal: Refusal) {
        let send_ms = self.server.plane.current().config.client.send_timeout_ms;
        let (status, text) = refusal.answer();
        let mut w = WRITE_BUF.take();
        w.clear();
        w.extend_from_slice(b"HTTP/1.1 ");
        w.extend_from_slice(status.as_str().as_bytes());
        w.push(b' ');
        w.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        w.extend_from_slice(b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: ");
        w.extend_from_slice(itoa::Buffer::new().format(text.len()).as_bytes());
        w.extend_from_slice(b"\r\nconnection: close\r\ndate: ");
        date(&mut w);
        w.extend_from_slice(b"\r\n\r\n");
        w.extend_from_slice(text.as_bytes());
        let mut out = Out {
            stream: &self.stream,
            send: Duration::from_millis(send_ms),
            peer: self.peer,
            lowat: &mut self.lowat,
        };
        let _ = out.write(&[&w]).await;
        WRITE_BUF.set(w);
    }

    /// [`Self::exchange`] on the connection it owns meanwhile (handed back
    /// with the outcome).
    async fn exchange_owned(mut self: Box<Self>) -> (Box<Conn<W, A>>, Next) {
        let next = self.exchange().await;
        (self, next)
    }

    /// One request: read its head, serve it, write the answer.
    async fn exchange(&mut self) -> Next {
        let (max_buf, header_ms, send_ms) = {
            let gen = self.server.plane.current();
            let l = &gen.config.client;
            let max_buf = (l.max_uri_bytes + l.max_header_bytes + 4096).max(8192);
            (max_buf, l.header_timeout_ms, l.send_timeout_ms)
        };
        let mut buf = self
            .pending
            .take()
            .map_or_else(|| readbuf::take(Side::Client), |b| *b);
        let mut head_due: Option<Instant> = None;
        // The last read returned less than it had room for: the socket's
        // queue was empty then (nginx's `rev->ready = 0` after a short recv).
        let mut drained = false;
        let parsed = loop {
            if !buf.is_empty() {
                match parse(&mut buf) {
                    Parse::Partial => {}
                    Parse::Refuse(r) => {
                        self.refuse(r).await;
                        return Next::Close;
                    }
                    Parse::Done(p) => break p,
                }
                if buf.len() >= max_buf {
                    // A request line that alone fills the buffer is a
                    // target too long (414, as nginx answers), not a head
                    // too large (431).
                    let r = if buf.contains(&b'\n') {
                        Refusal::TooLarge
                    } else {
                        Refusal::UriTooLong
                    };
                    self.refuse(r).await;
                    return Next::Close;
                }
            }
            if buf.capacity() - buf.len() < 1024 {
                buf.reserve(READ_BUF.max(buf.capacity()).min(max_buf));
            }
            let room = buf.capacity() - buf.len();
            match self.stream.try_read_buf(&mut buf) {
                Ok(0) => {
                    readbuf::give(Side::Client, buf);
                    return Next::Close;
                }
                Ok(n) => {
                    self.last = now_ms();
                    drained = n < room;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Next::Close,
            }
            // A spurious wake-up (nothing to read yet): back to idle, the
            // buffer back to the pool.
            if buf.is_empty() {
                readbuf::give(Side::Client, buf);
                return Next::KeepAlive;
            }
            // The head has started: the header timer runs from its first byte.
            let due =
                *head_due.get_or_insert_with(|| Instant::now() + Duration::from_millis(header_ms));
            let readable = poll_fn(|cx| self.stream.poll_read_ready(cx));
            match tokio::time::timeout_at(due, readable).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Next::Close,
                Err(_) => {
                    tracing::debug!(peer = %self.peer, "request head not received in time; closing");
                    return Next::Close;
                }
            }
        };
        let ParsedHead {
            mut req,
            sent,
            keep_alive,
            body,
            has_underscores,
            expect_continue,
            upgrade,
        } = parsed;
        // The body: whole when it arrived with the head (the usual case),
        // else read from the socket as the request path asks for it.
        let mut pump = None;
        let refused = body == Framed::Unsupported;
        let body = match body {
            Framed::Unsupported => RequestBody::Refused,
            Framed::Length(0) => RequestBody::Full(None),
            Framed::Length(n) if buf.len() as u64 >= n => {
                RequestBody::Full(Some(buf.split_to(n as usize).freeze()))
            }
            framing => {
                let (len, left) = match framing {
                    Framed::Length(n) => (Some(n), BodyDecoder::length(n)),
                    _ => (None, BodyDecoder::chunked()),
                };
                let (writer, reader) = pipe(len);
                pump = Some(Pump {
                    writer,
                    buf: std::mem::take(&mut buf),
                    left,
                    cont: expect_continue.then_some(0),
                    state: PumpState::Running,
                });
                RequestBody::Stream(reader)
            }
        };
        if pump.is_none() {
            if buf.is_empty() {
                readbuf::give(Side::Client, buf);
                if drained {
                    self.stream.forget_readable();
                }
            } else {
                self.pending = Some(Box::new(buf));
            }
        }
        // The client's side of an upgrade, handed over once a 101 is out.
        let mut tunnel = None;
        if upgrade {
            let (tx, rx) = oneshot::channel::<Tunnel>();
            tunnel = Some(tx);
            req.extensions_mut()
                .insert(ClientUpgrade::new(Box::pin(async move { rx.await.ok() })));
        }
        if self.secure {
            req.extensions_mut().insert(Https);
        }
        let method_head = req.method() == Method::HEAD;
        let version = req.version();
        // Boxed on its own: the exchange's future stays small. It owns a
        // handle on the data plane (borrows nothing): its slot serves the
        // thread's next request ([`InBox`]).
        // A client that goes away meanwhile cancels the request (as on
        // hyper's connections).
        let plane = self.server.plane.clone();
        if has_underscores {
            // The underscore filter, for the heads that need it (the proxy
            // runs it on the other sides' heads).
            let gen = plane.current();
            let limits = &gen.config.client;
            proxy::resolve::filter_underscores(&mut req, limits, &gen.lane.tag_header);
        }
        let handled = drive(
            &self.stream,
            pump.as_mut(),
            true,
            InBox::new(|| {
                self.app
                    .call(plane, self.peer, req.map(|()| body), Some(sent))
            }),
        );
        let Some(Ok(mut resp)) = handled.await else {
            return Next::Close;
        };
        let status = resp.status;
        // A body still unread when the answer is ready: the connection
        // cannot be reused (nothing tells where the next request starts
        // until it is read), so the answer says so.
        let unread = pump.as_ref().is_some_and(|p| !p.finished());
        // A body of unknown framing (refused, 501): the connection cannot
        // go on. Draining: this answer ends the keep-alive connection.
        if (unread || refused || self.server.draining.load(Ordering::Relaxed))
            && status != StatusCode::SWITCHING_PROTOCOLS
        {
            resp.fields
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        let framing = Framing {
            head: method_head,
            http10: version == Version::HTTP_10,
            keep_alive: keep_alive && !unread,
        };
        let mut out = Out {
            stream: &self.stream,
            send: Duration::from_millis(send_ms),
            peer: self.peer,
            lowat: &mut self.lowat,
        };
        // No `100 Continue` after a final answer: a body not asked for yet
        // is read when asked, without one (half of one sent: the
        // connection cannot go on).
        if let Some(p) = pump.as_mut() {
            match p.cont {
                Some(0) => p.cont = None,
                Some(at) if at < CONTINUE.len() => return Next::Close,
                _ => {}
            }
        }
        // The body goes on being read while the answer is written (a node
        // may answer before it has the whole upload).
        let keep = drive(
            &self.stream,
            pump.as_mut(),
            false,
            out.respond(resp, framing),
        )
        .await
        .unwrap_or(Ok(false));
        self.last = now_ms();
        if let Some(p) = pump {
            // What the client sent past the body is its next request.
            match p.into_rest() {
                Some(rest) if !rest.is_empty() => self.pending = Some(Box::new(rest)),
                Some(rest) => readbuf::give(Side::Client, rest),
                None => return Next::Close,
            }
        }
        match (keep, tunnel) {
            (Ok(_), Some(tx)) if status == StatusCode::SWITCHING_PROTOCOLS => Next::Upgrade(tx),
            (Ok(true), _) if status != StatusCode::SWITCHING_PROTOCOLS => Next::KeepAlive,
            _ => Next::Close,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PumpState {
    Running,
    /// The body's end was read: what follows in `buf` is the next request.
    Done,
    /// Bad framing, the client gone, or the reader gone: the connection
    /// ends after this request.
    Stopped,
}

/// `100 Continue`, sent before the first read of an `Expect`ing body.
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Reads a streamed request body from the connection into its [`pipe`],
/// one frame at a time as the request path asks: polled beside the
/// request's handling and the answer's writing ([`drive`]).
struct Pump {
    writer: PipeWriter,
    /// Bytes read and not yet decoded (then, after the end: the next
    /// request's).
    buf: BytesMut,
    left: BodyDecoder,
    /// How much of [`CONTINUE`] went out (`None`: not asked for).
    cont: Option<usize>,
    state: PumpState,
}

impl Pump {
    fn finished(&self) -> bool {
        self.state == PumpState::Done
    }

    /// The bytes past the body, once it was read to its end.
    fn into_rest(self) -> Option<BytesMut> {
        (self.state == PumpState::Done).then_some(self.buf)
    }

    fn stop(&mut self, e: BodyError) -> Poll<()> {
        self.writer.send(Err(e));
        self.state = PumpState::Stopped;
        Poll::Ready(())
    }

    /// Moves the body along; ready once it is done (read to its end, or
    /// stopped).
    fn poll<W: Wire>(&mut self, stream: &W, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.state != PumpState::Running {
                return Poll::Ready(());
            }
            match self.writer.poll_want(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(false) => {
                    // Nobody reads it any more: the rest stays unread and
                    // the connection ends after this request.
                    self.state = PumpState::Stopped;
                    return Poll::Ready(());
                }
                Poll::Ready(true) => {}
            }
            match self.left.step(&mut self.buf) {
                Err(e) => return self.stop(BodyError::bad(e)),
                Ok(Piece::End) => {
                    self.writer.end();
                    self.state = PumpState::Done;
                    return Poll::Ready(());
                }
                Ok(Piece::Data(d)) => {
                    self.writer.send(Ok(d));
                    if self.left.ended() {
                        self.writer.end();
                        self.state = PumpState::Done;
                        return Poll::Ready(());
                    }
                    continue;
                }
                Ok(Piece::More) => {}
            }
            // The body's bytes are still to come: first the `100 Continue`
            // the client waits for.
            if let Some(at) = self.cont {
                if W::BUFFERED && at == CONTINUE.len() {
                    match stream.poll_flush(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(())) => self.cont = Some(at + 1),
                        Poll::Ready(Err(_)) => {
                            return self.stop(BodyError::gone("client connection failed"))
                        }
                    }
                    continue;
                }
                if at < CONTINUE.len() {
                    match stream.try_write(&CONTINUE[at..]) {
                        Ok(n) => self.cont = Some(at + n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            match stream.poll_write_ready(cx) {
                                Poll::Pending => return Poll::Pending,
                                Poll::Ready(Ok(())) => {}
                                Poll::Ready(Err(_)) => {
                                    return self.stop(BodyError::gone("client connection failed"))
                                }
                            }
                        }
                        Err(_) => return self.stop(BodyError::gone("client connection failed")),
                    }
                    continue;
                }
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(BODY_READ);
            }
            match stream.try_read_buf(&mut self.buf) {
                Ok(0) => {
                    return self.stop(BodyError::gone("client closed the connection mid-body"))
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match stream.poll_read_ready(cx)
                {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(_)) => {
                        return self.stop(BodyError::gone("client connection failed"))
                    }
                },
                Err(_) => return self.stop(BodyError::gone("client connection failed")),
            }
        }
    }
}

/// A client's request as a connection decodes it (the codec's request
/// direction, for the fuzz target and its smoke test).
#[derive(Debug, PartialEq, Eq)]
pub struct DecodedRequest {
    pub method: String,
    pub target: String,
    /// Field names as the map holds them, values as sent.
    pub fields: Vec<(String, Vec<u8>)>,
    pub keep_alive: bool,
    /// Refused for its `Transfer-Encoding` (501, no body read).
    pub bad_te: bool,
    pub body: Vec<u8>,
    /// What followed the body (the next request's bytes).
    pub rest: Vec<u8>,
}

/// Decodes `wire` fed `piece` bytes at a time (`piece` ≥ 1), as a
/// connection reads it: `Err` with the status the head is refused with
/// (400, 414, 431, 405), 400 for a body that is not one, or 0 when the
/// bytes end before the message does.
pub fn decode_request(wire: &[u8], piece: usize) -> Result<DecodedRequest, u16> {
    let piece = piece.max(1);
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut feed = |buf: &mut BytesMut| {
        let n = piece.min(wire.len() - fed);
        buf.extend_from_slice(&wire[fed..fed + n]);
        fed += n;
        n > 0
    };
    let p = loop {
        if !buf.is_empty() {
            match parse(&mut buf) {
                Parse::Done(p) => break p,
                Parse::Refuse(r) => return Err(r.answer().0.as_u16()),
                Parse::Partial => {}
            }
        }
        if !feed(&mut buf) {
            return Err(0);
        }
    };
    let mut body = Vec::new();
    let mut decoder = match p.body {
        Framed::Unsupported => BodyDecoder::length(0),
        Framed::Length(n) => BodyDecoder::length(n),
        Framed::Chunked { .. } => BodyDecoder::chunked(),
    };
    loop {
        match decoder.step(&mut buf) {
            Err(_) => return Err(400),
            Ok(Piece::Data(d)) => body.extend_from_slice(&d),
            Ok(Piece::End) => break,
            Ok(Piece::More) => {
                if !feed(&mut buf) {
                    return Err(0);
                }
            }
        }
    }
    buf.extend_from_slice(&wire[fed..]);
    Ok(DecodedRequest {
        method: p.req.method().to_string(),
        target: p.req.uri().to_string(),
        fields: p
            .req
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect(),
        keep_alive: p.keep_alive,
        bad_te: p.body == Framed::Unsupported,
        body,
        rest: buf.to_vec(),
    })
}

/// Runs `fut` while moving a streamed request body along (`pump`) and, with
/// `watch`, watching the client: `None` when it closed its side or the
/// connection failed (a peek at the socket once the body is read: bytes it
/// pipelined stay unread, and once some are there the watch ends).
async fn drive<W: Wire, F: Future>(
    stream: &W,
    mut pump: Option<&mut Pump>,
    mut watch: bool,
    fut: F,
) -> Option<F::Output> {
    tokio::pin!(fut);
    poll_fn(|cx| {
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        if let Some(p) = pump.as_deref_mut() {
            if p.poll(stream, cx).is_pending() {
                // The body's reads see the client go.
                return Poll::Pending;
            }
            if !p.finished() {
                return Poll::Pending;
            }
        }
        if watch {
            match stream.poll_gone(cx) {
                Poll::Ready(true) => return Poll::Ready(None),
                Poll::Ready(false) => watch = false,
                Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}

/// A request head this path parsed, with its body's framing.
struct ParsedHead {
    req: Request<()>,
    /// The head as received: the fields passed on unchanged keep their
    /// lines (the client's case).
    sent: SentHead,
    keep_alive: bool,
    /// The body's framing (RFC 9112 §6.3; `Unsupported`: a
    /// `Transfer-Encoding` other than one `chunked` field, refused).
    body: Framed,
    /// Some field name has a `_` (every name was looked at).
    has_underscores: bool,
    /// `Expect: 100-continue` on HTTP/1.1: a `100 Continue` goes out before
    /// the body is read from the socket.
    expect_continue: bool,
    /// An `Upgrade` field: the connection may become a tunnel.
    upgrade: bool,
}

/// A head answered here without a request (hyper's answers, nginx's
/// statuses): the connection closes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Not an HTTP/1.x head (syntax, a bad field, conflicting lengths).
    BadRequest,
    /// More fields than the parser holds, or a head longer than its buffer.
    TooLarge,
    /// A request target longer than any URI the parser takes.
    UriTooLong,
    /// `CONNECT`: the gateway is no forward proxy.
    Connect,
}

impl Refusal {
    fn answer(self) -> (StatusCode, &'static str) {
        use crate::base::error::ErrorKind;
        match self {
            Refusal::BadRequest => ErrorKind::BadRequest.answer(),
            Refusal::UriTooLong => ErrorKind::UriTooLong.answer(),
            Refusal::TooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request header fields too large\n",
            ),
            Refusal::Connect => (StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
        }
    }
}

// Returned once per request and matched at once: a box would cost an
// allocation per request for nothing.
#[allow(clippy::large_enum_variant)]
enum Parse {
    Partial,
    /// Answered here, then the connection closes.
    Refuse(Refusal),
    Done(ParsedHead),
}

/// Parses the head at the front of `buf`; on success it is split off (the
/// fields are slices of it, as in hyper) and `buf` starts at the body.
fn parse(buf: &mut BytesMut) -> Parse {
    // The field positions' list is the thread's (no allocation per head).
    let mut spans = SPANS.take();
    let parsed = parse_into(buf, &mut spans);
    SPANS.set(spans);
    parsed
}

/// httparse's read of a head the fast read (`codec::head`) declined: its
/// fields' positions into `spans`; `Err`: not a head this path takes.
fn httparse_request(buf: &[u8], spans: &mut Vec<Span>) -> Result<Option<RequestLine>, Refusal> {
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut r = httparse::Request::new(&mut []);
    let len = match r.parse_with_uninit_headers(buf, &mut fields) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(Refusal::TooLarge),
        Err(_) => return Err(Refusal::BadRequest),
    };
    let (Some(method), Some(path), Some(v)) = (r.method, r.path, r.version) else {
        return Err(Refusal::BadRequest);
    };
    let at = |part: &str| span_in(buf, part.as_bytes());
    httparse_spans(buf, r.headers, spans);
    Ok(Some(RequestLine {
        len,
        method: at(method),
        target: at(path),
        http10: v == 0,
    }))
}

fn parse_into(buf: &mut BytesMut, spans: &mut Vec<Span>) -> Parse {
    // The usual strict head is read in one pass; anything else by
    // httparse.
    let line = match crate::codec::head::request(buf, spans, MAX_HEADERS) {
        Some(line) => line,
        None => match httparse_request(buf, spans) {
            Ok(Some(line)) => line,
            Ok(None) => return Parse::Partial,
            Err(r) => return Parse::Refuse(r),
        },
    };
    let len = line.len;
    // Offsets into the head: the map is built from slices of it once split.
    let path_at = (line.target.0, line.target.1 - line.target.0);
    if path_at.1 > MAX_URI_LEN {
        return Parse::Refuse(Refusal::UriTooLong);
    }
    let Ok(method) = Method::from_bytes(&buf[line.method.0..line.method.1]) else {
        return Parse::Refuse(Refusal::BadRequest);
    };
    if method == Method::CONNECT {
        return Parse::Refuse(Refusal::Connect);
    }
    let http11 = !line.http10;
    let mut keep_alive = http11;
    let mut close = false;
    let mut length: Result<Option<u64>, ()> = Ok(None);
    let (mut te_fields, mut te_chunked) = (0u32, false);
    let (mut expect_continue, mut upgrade) = (false, false);
    for &(ns, ne, vs, ve) in spans.iter() {
        let name = &buf[ns as usize..ne as usize];
        let value = &buf[vs as usize..ve as usize];
        // Matched by length first: one word compare per field.
        let is = |lower: &[u8]| name_eq(name, lower);
        match name.len() {
            // Only one field of exactly `chunked` is a chunked body; any
            // other coding or list is refused below (501).
            17 if is(b"transfer-encoding") => {
                te_fields += 1;
                te_chunked = name_eq(value, b"chunked");
            }
            6 if is(b"expect") => expect_continue |= name_eq(value, b"100-continue"),
            7 if is(b"upgrade") => upgrade = true,
            // Repeated fields must agree (hyper's rule); a list, a sign or
            // any other byte is not a length.
            14 if is(b"content-length") => {
                length = match (length, content_length(value)) {
                    (Ok(None), Some(l)) => Ok(Some(l)),
                    (Ok(Some(a)), Some(b)) if a == b => Ok(Some(a)),
                    _ => Err(()),
                }
            }
            10 if is(b"connection") => {
                if close || has_token(value, b"close") {
                    close = true;
                    keep_alive = false;
                } else if !keep_alive {
                    keep_alive = has_token(value, b"keep-alive");
                }
            }
            _ => {}
        }
    }
    // The body's framing (RFC 9112 §6, `codec::framing`). A refused
    // coding: the head is answered (501) and the connection closes; nothing
    // of what follows is read as a body.
    let body = match framing::request_received(te_fields, te_chunked, length, http11) {
        Ok(r) => r,
        Err(_) => return Parse::Refuse(Refusal::BadRequest),
    };
    // Chunked beside a Content-Length: the length goes (§6.3 item 3).
    let drop_length = body == (Framed::Chunked { close: true });
    if drop_length || body == Framed::Unsupported {
        keep_alive = false;
    }
    let head: Bytes = buf.split_to(len).freeze();
    let Ok(uri) = Uri::from_maybe_shared(head.slice(path_at.0..path_at.0 + path_at.1)) else {
        return Parse::Refuse(Refusal::BadRequest);
    };
    let mut headers = HeaderMap::with_capacity(spans.len());
    let mut has_underscores = false;
    for &(ns, ne, vs, ve) in spans.iter() {
        let bytes = &head[ns as usize..ne as usize];
        // The usual names have no `_`: only the others are searched.
        let name = crate::codec::fields::known_name(bytes)
            .or_else(|| seen_name(bytes))
            .ok_or(())
            .or_else(|()| {
                has_underscores |= bytes.contains(&b'_');
                let name = HeaderName::from_bytes(bytes);
                if let Ok(n) = &name {
                    remember_name(n);
                }
                name
            });
        let Ok(name) = name else {
            return Parse::Refuse(Refusal::BadRequest);
        };
        if drop_length && name == header::CONTENT_LENGTH {
            continue;
        }
        // httparse checked the value's bytes.
        let value = HeaderValue::from_maybe_shared(head.slice(vs as usize..ve as usize));
        match value {
            Ok(v) => {
                headers.append(name, v);
            }
            Err(_) => return Parse::Refuse(Refusal::BadRequest),
        }
    }
    let mut req = Request::new(());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = if http11 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    crate::codec::head::drop_map(std::mem::replace(req.headers_mut(), headers));
    Parse::Done(ParsedHead {
        req,
        sent: SentHead::new(head),
        keep_alive,
        body,
        has_underscores,
        expect_continue: expect_continue
            && http11
            && !matches!(body, Framed::Length(0) | Framed::Unsupported),
        upgrade,
    })
}

/// Runs `fut` while watching the client: `None` when it closed its side or
/// the connection failed (a peek at the socket: bytes it pipelined stay
/// unread, and once some are there the watch ends).
async fn unless_gone<W: Wire, F: Future>(stream: &W, fut: F) -> Option<F::Output> {
    drive(stream, None, true, fut).await
}

/// Is `token` (lower-case) one of the comma-separated values
/// (case-insensitive)?
fn has_token(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| name_eq(t.trim_ascii(), token))
}

/// How the answer is framed for this request.
#[derive(Clone, Copy)]
struct Framing {
    /// A HEAD request: no body.
    head: bool,
    /// An HTTP/1.0 client: answered as HTTP/1.0, no chunked coding.
    http10: bool,
    keep_alive: bool,
}

/// How the body goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coding {
    Length(u64),
    Chunked,
    /// Until the connection closes (HTTP/1.0, unknown length).
    Close,
}

/// Where a response is written.
struct Out<'a, W: Wire> {
    stream: &'a W,
    send: Duration,
    peer: SocketAddr,
    /// The connection's `Conn::lowat`.
    lowat: &'a mut bool,
}

impl<W: Wire> Out<'_, W> {
    /// Writes the answer; `Ok(true)` when the connection may serve
    /// another request. Framing as hyper's server encodes it.
    async fn respond(&mut self, answer: Answer<Recorded>, f: Framing) -> io::Result<bool> {
        let mut w = WRITE_BUF.take();
        w.clear();
        let Answer {
            status,
            fields,
            extensions,
            mut body,
        } = answer;
        let bodiless = f.head
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let end = body.is_end_stream();
        let sendfile = extensions.get::<SendFile>().cloned();
        // A node's plain head goes out as its lines; the cases where this
        // side rewrites a field (no body, HEAD, a length that is not the
        // body's) take the map.
        let rewrites = fields.lines().is_some_and(|raw| {
            let exact = body.size_hint().exact();
            end || f.head || raw.length.is_some_and(|l| exact != Some(l))
        });
        let (raw, headers) = if rewrites {
            (None, fields.into_map())
        } else {
            fields.into_parts()
        };
        let (coding, mut keep) =
            encode_head(&mut w, (status, headers), raw.as_deref(), &body, f, end);
        let coding = if bodiless || end {
            Coding::Length(0)
        } else {
            coding
        };
        if coding == Coding::Length(0) {
            drop(body);
            let r = self.write(&[&w]).await;
            WRITE_BUF.set(w);
            return r.map(|()| keep);
        }
        if let (Some(sf), Coding::Length(n), Some(tcp)) = (&sendfile, coding, self.stream.tcp()) {
            if sf.len == n {
                // The head, then the file by sendfile(2): one copy less. A
                // file that shrank meanwhile ends short: the connection
                // closes, the client never takes it as whole.
                let r = match self.send_more(tcp, &w).await {
                    Ok(()) => self.send_file(tcp, &sf.file, n).await,
                    Err(e) => Err(e),
                };
                WRITE_BUF.set(w);
                if r.is_ok() {
                    body.sent_whole();
                }
                drop(body);
                return r.map(|()| keep);
            }
        }
        // The first frame, if ready, goes out with the head; a body that
        // fails before anything was sent closes the connection without an
        // answer (never a head followed by a truncated body).
        let mut sent: u64 = 0;
        let first = poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
        let mut done = matches!(first, Poll::Ready(None));
        let mut pending = match first {
            Poll::Ready(Some(Err(_))) => {
                WRITE_BUF.set(w);
                return Ok(false);
            }
            Poll::Ready(Some(Ok(frame))) => frame.into_data().ok(),
            Poll::Ready(None) => None,
            Poll::Pending => {
                let r = self.write(&[&w]).await;
                if r.is_err() {
                    WRITE_BUF.set(w);
                    return Ok(false);
                }
                w.clear();
                Some(Bytes::new())
            }
        };
        loop {
            if let Some(data) = pending.take() {
                if !data.is_empty() {
                    sent += data.len() as u64;
                    if let Coding::Length(n) = coding {
                        if sent > n {
                            // More than the announced length: cut off.
                            WRITE_BUF.set(w);
                            return Ok(false);
                        }
                    }
                    if let Err(e) = self.frame(&mut w, &data, coding).await {
                        WRITE_BUF.set(w);
                        return Err(e);
                    }
                    w.clear();
                } else if !w.is_empty() {
                    if let Err(e) = self.write(&[&w]).await {
                        WRITE_BUF.set(w);
                        return Err(e);
                    }
                    w.clear();
                }
            }
            if done {
                break;
            }
            // A client gone while the body is awaited drops it (recorded as
            // the client's abort), as hyper's connections do.
            let next = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
            let Some(next) = unless_gone(self.stream, next).await else {
                WRITE_BUF.set(w);
                return Ok(false);
            };
            match next {
                None => done = true,
                Some(Ok(frame)) => pending = frame.into_data().ok(),
                Some(Err(_)) => {
                    WRITE_BUF.set(w);
                    return Ok(false);
                }
            }
        }
        let r = match coding {
            Coding::Chunked => {
                w.extend_from_slice(b"0\r\n\r\n");
                self.write(&[&w]).await
            }
            Coding::Length(n) if sent != n => {
                // The body ended short of its length: the client must not
                // take it as whole.
                keep = false;
                Err(io::ErrorKind::UnexpectedEof.into())
            }
            _ if !w.is_empty() => self.write(&[&w]).await,
            _ => Ok(()),
        };
        WRITE_BUF.set(w);
        drop(body);
        r.map(|()| keep && coding != Coding::Close)
    }

    /// One body frame, behind whatever is in `w` (the head, at first).
    async fn frame(&mut self, w: &mut Vec<u8>, data: &[u8], coding: Coding) -> io::Result<()> {
        let chunked = coding == Coding::Chunked;
        if chunked {
            w.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        }
        if data.len() <= COALESCE {
            w.extend_from_slice(data);
            if chunked {
                w.extend_from_slice(b"\r\n");
            }
            self.write(&[w]).await
        } else if chunked {
            self.write(&[w, data, b"\r\n"]).await
        } else {
            self.write(&[w, data]).await
        }
    }

    /// Sends the first `len` bytes of `file` with `sendfile(2)` from this
    /// thread (the page cache's pages go to the socket, no copy through
    /// user space); the send timeout applies as to [`Self::write`].
    async fn send_file(
        &mut self,
        tcp: &TcpStream,
        file: &std::fs::File,
        len: u64,
    ) -> io::Result<()> {
        if !*self.lowat {
            // Only this much not-yet-sent data is queued on the socket; the
            // worker tops it up when the client's ACKs drain it. Without it a
            // sendfile queues up to the whole send buffer, and the segments
            // the client's ACKs release are then transmitted on the client's
            // CPU (loopback) or held in kernel memory per slow reader.
            let _ = socket2::SockRef::from(tcp).set_tcp_notsent_lowat(SENDFILE_LOWAT);
            *self.lowat = true;
        }
        let mut off: u64 = 0;
        while off < len {
            let want = (len - off).min(1 << 30) as usize;
            let r = tcp.try_io(tokio::io::Interest::WRITABLE, || {
                rustix::fs::sendfile(tcp, file, Some(&mut off), want).map_err(io::Error::from)
            });
            match r {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_writable().await?,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes every byte of `head` with `MSG_MORE`: it leaves in the same
    /// segment as the start of the body that follows (nginx's
    /// `tcp_nopush`), never as a small segment of its own.
    async fn send_more(&mut self, tcp: &TcpStream, head: &[u8]) -> io::Result<()> {
        let mut done = 0;
        while done < head.len() {
            let r = tcp.try_io(tokio::io::Interest::WRITABLE, || {
                rustix::net::send(tcp, &head[done..], rustix::net::SendFlags::MORE)
                    .map_err(io::Error::from)
            });
            match r {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_writable().await?,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Waits until the client reads; longer than the send timeout fails the
    /// connection (logged, rate-limited).
    async fn wait_writable(&self) -> io::Result<()> {
        // The worker's coarse deadlines: no tokio timer per wait (a big
        // file waits once per low-water refill).
        let writable = poll_fn(|cx| self.stream.poll_write_ready(cx));
        match crate::base::deadline::timeout(self.send, writable).await {
            Ok(r) => r,
            Err(_) => {
                let send_ms = self.send.as_millis() as u64;
                log_limited(
                    &super::SEND_LOG,
                    || tracing::warn!(peer = %self.peer, send_timeout_ms = send_ms, "client stopped reading the response; closing"),
                );
                Err(io::ErrorKind::TimedOut.into())
            }
        }
    }

    /// Writes every byte of `bufs`; a write that waits longer than the
    /// send timeout for the client to read fails the connection.
    async fn write(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut done = 0;
        while done < total {
            let mut skip = done;
            let mut slices: [IoSlice<'_>; 3] = [IoSlice::new(&[]); 3];
            let mut k = 0;
            for b in bufs {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                slices[k] = IoSlice::new(&b[skip..]);
                skip = 0;
                k += 1;
            }
            match self.stream.try_write_vectored(&slices[..k]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_writable().await?,
                Err(e) => return Err(e),
            }
        }
        // Over TLS, the records the socket could not take yet go out now
        // (a plain socket holds nothing back).
        if W::BUFFERED {
            self.wait_writable().await?;
        }
        Ok(())
    }
}

/// Encodes the status line and fields into `w` as hyper's server does
/// (lower-case names, `Content-Length` or chunked from the body's size,
/// `Date`); returns the body's coding and whether the connection may stay.
fn encode_head(
    w: &mut Vec<u8>,
    (status, mut headers): (StatusCode, HeaderMap),
    raw: Option<&RawLines>,
    body: &Recorded,
    f: Framing,
    end: bool,
) -> (Coding, bool) {
    let mut keep = f.keep_alive;
    if f.http10 {
        w.extend_from_slice(b"HTTP/1.0 ");
    } else {
        w.extend_from_slice(b"HTTP/1.1 ");
    }
    w.extend_from_slice(status.as_str().as_bytes());
    w.push(b' ');
    w.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    w.extend_from_slice(b"\r\n");
    let can_chunk = !(f.head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED);
    let can_length = !(status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED);
    let exact = if end { None } else { body.size_hint().exact() };
    let mut coding: Option<Coding> = None;
    let mut wrote_date = false;
    let mut conn_keep_alive = false;
    let mut te_seen = false;
    // The node's own lines first (as the map would hold them: before any
    // field this side added), then the map.
    if let Some(raw) = raw {
        for line in raw.runs() {
            w.extend_from_slice(line);
        }
        coding = raw.length.map(Coding::Length);
        wrote_date = raw.has_date;
    }
    for (name, value) in crate::codec::fields::named(headers.drain()) {
        match name {
            header::CONTENT_LENGTH => {
                if end && !f.head {
                    continue;
                }
                if coding.is_some() {
                    continue;
                }
                let len = match exact {
                    Some(l) => l,
                    None if end => 0,
                    None => match content_length(value.as_bytes()) {
                        Some(l) => l,
                        None => {
                            keep = false;
                            continue;
                        }
                    },
                };
                coding = Some(Coding::Length(len));
            }
            header::TRANSFER_ENCODING => {
                if f.http10 || !can_chunk || te_seen || coding.is_some() {
                    continue;
                }
                te_seen = true;
                coding = Some(Coding::Chunked);
                w.extend_from_slice(b"transfer-encoding: ");
                w.extend_from_slice(value.as_bytes());
                if !value.as_bytes().ends_with(b"chunked") {
                    w.extend_from_slice(b", chunked");
                }
                w.extend_from_slice(b"\r\n");
                continue;
            }
            header::CONNECTION => {
                if has_token(value.as_bytes(), b"close") {
                    keep = false;
                }
                if has_token(value.as_bytes(), b"keep-alive") {
                    conn_keep_alive = true;
                }
            }
            header::DATE => wrote_date = true,
            header::TRAILER if f.http10 || !can_chunk => continue,
            _ => {}
        }
        w.extend_from_slice(name.as_str().as_bytes());
        w.extend_from_slice(b": ");
        w.extend_from_slice(value.as_bytes());
        w.extend_from_slice(b"\r\n");
    }
    let coding = match coding {
        Some(c) => c,
        None if end || exact == Some(0) => {
            if can_length && !f.head {
                w.extend_from_slice(b"content-length: 0\r\n");
            }
            Coding::Length(0)
        }
        None => match exact {
            Some(len) => {
                if can_length {
                    w.extend_from_slice(b"content-length: ");
                    w.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
                    w.extend_from_slice(b"\r\n");
                }
                Coding::Length(len)
            }
            None if f.http10 || !can_chunk => Coding::Close,
            None => {
                w.extend_from_slice(b"transfer-encoding: chunked\r\n");
                Coding::Chunked
            }
        },
    };
    // An HTTP/1.0 client asked to keep the connection: say so (hyper does).
    if f.http10 && keep && !conn_keep_alive {
        w.extend_from_slice(b"connection: keep-alive\r\n");
    }
    if !wrote_date {
        w.extend_from_slice(b"date: ");
        date(w);
        w.extend_from_slice(b"\r\n");
    }
    w.extend_from_slice(b"\r\n");
    // Empty now; never had room when the node's lines went out raw.
    crate::codec::head::drop_map(headers);
    (coding, keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(raw: &[u8]) -> Parse {
        let mut b = BytesMut::from(raw);
        parse(&mut b)
    }

    #[test]
    fn simple_head_is_parsed_and_split_off() {
        let mut b = BytesMut::from(&b"GET /a?b HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\r\nGET"[..]);
        let Parse::Done(p) = parse(&mut b) else {
            panic!("not parsed")
        };
        assert_eq!(p.req.uri(), "/a?b");
        assert_eq!(p.req.headers()["x-a"], "1");
        assert!(p.keep_alive);
        assert_eq!(&b[..], b"GET");
    }

    /// Field names outside `known_name` come from the thread's kept names
    /// once seen: the same names (every case of the wire name), the
    /// underscore flag still raised for a name with `_` (never kept), and
    /// kept names replaced in turn once more are seen than are kept.
    #[test]
    fn seen_names_read_as_from_bytes() {
        let fields = |raw: &[u8]| match parsed(raw) {
            Parse::Done(p) => (
                p.req
                    .headers()
                    .iter()
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect::<Vec<_>>(),
                p.has_underscores,
            ),
            _ => panic!("not parsed: {}", String::from_utf8_lossy(raw)),
        };
        let mut names: Vec<String> = (0..3 * SEEN_NAMES).map(|i| format!("X-Name-{i}")).collect();
        names.push("X-Under_Score".into());
        names.push("Accept-Language".into());
        names.push(format!("X-{}", "L".repeat(SEEN_NAME_MAX)));
        for round in 0..3 {
            for (i, name) in names.iter().enumerate() {
                // Each name in another case each time, beside a kept one.
                let wire: String = name
                    .chars()
                    .enumerate()
                    .map(|(k, c)| {
                        if (k + round) % 2 == 0 {
                            c.to_ascii_uppercase()
                        } else {
                            c.to_ascii_lowercase()
                        }
                    })
                    .collect();
                let prev = &names[i.saturating_sub(1)];
                let raw = format!("GET / HTTP/1.1\r\nHost: x\r\n{wire}: {i}\r\n{prev}: p\r\n\r\n");
                let (got, has_underscores) = fields(raw.as_bytes());
                let want = [
                    ("host", "x".to_string()),
                    (&*name.to_ascii_lowercase(), i.to_string()),
                    (&*prev.to_ascii_lowercase(), "p".to_string()),
                ];
                let got: Vec<(String, String)> = got
                    .iter()
                    .map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap().to_string()))
                    .collect();
                let want: Vec<(String, String)> = want
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.clone()))
                    .collect();
                assert_eq!(got, want, "{raw}");
                assert_eq!(
                    has_underscores,
                    name.contains('_') || prev.contains('_'),
                    "{raw}"
                );
            }
        }
        SEEN.with(|s| {
            let s = s.borrow();
            assert_eq!(s.names.len(), SEEN_NAMES);
            assert!(s
                .names
                .iter()
                .all(|n| !n.as_str().contains('_') && n.as_str().len() <= SEEN_NAME_MAX));
        });
        // A kept name is never taken for a longer or a shorter one.
        let raw = b"GET / HTTP/1.1\r\nx-name-1: a\r\nX-Name-1x: b\r\nx-name-: c\r\n\r\n";
        let Parse::Done(p) = parsed(raw) else {
            panic!("not parsed")
        };
        let names: Vec<&str> = p.req.headers().keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["x-name-1", "x-name-1x", "x-name-"]);
    }

    /// What the parse makes of the heads that went to hyper before the one
    /// codec: bodies, `Expect` and `Upgrade` are served here; bad heads
    /// get the status hyper (and nginx) gave them.
    #[test]
    fn every_head_is_served_or_refused_here() {
        let done = |raw: &[u8]| match parsed(raw) {
            Parse::Done(p) => p,
            _ => panic!("not parsed: {}", String::from_utf8_lossy(raw)),
        };
        let p = done(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(p.body == Framed::Chunked { close: false } && p.keep_alive);
        let p = done(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab");
        assert_eq!(p.body, Framed::Length(5));
        let p =
            done(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na");
        assert_eq!(p.body, Framed::Length(1));
        assert!(done(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n").upgrade);
        // `Expect` only matters when a body is to come.
        assert!(
            !done(b"GET / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n").expect_continue
        );
        assert!(
            done(b"PUT / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n")
                .expect_continue
        );
        assert!(
            !done(
                b"PUT / HTTP/1.0\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
            )
            .expect_continue
        );
        // Both framings: chunked wins, the length goes, the connection ends.
        let p = done(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(p.body == Framed::Chunked { close: true } && !p.keep_alive);
        assert!(p.req.headers().get(header::CONTENT_LENGTH).is_none());
        let refused = |raw: &[u8]| match parsed(raw) {
            Parse::Refuse(r) => r,
            _ => panic!("not refused: {}", String::from_utf8_lossy(raw)),
        };
        for (raw, want) in [
            (
                &b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\na"[..],
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\na",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 1\r\n\r\na",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                Refusal::BadRequest,
            ),
            (b"CONNECT x:1 HTTP/1.1\r\nHost: x\r\n\r\n", Refusal::Connect),
            (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", Refusal::BadRequest),
            (b"GET /\r\n\r\n", Refusal::BadRequest),
        ] {
            assert_eq!(refused(raw), want, "{}", String::from_utf8_lossy(raw));
        }
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(refused(&many), Refusal::TooLarge);
    }

    /// One `chunked` field is a chunked body; every other coding, list or
    /// repetition is flagged for the 501, with no body and no keep-alive
    /// (whatever a Content-Length says).
    #[test]
    fn transfer_encodings_but_one_chunked_are_refused() {
        for raw in [
            &b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: ChunKed \r\n\r\n",
        ] {
            assert!(
                matches!(parsed(raw), Parse::Done(p) if p.body == Framed::Chunked { close: false })
            );
        }
        for te in [
            "Transfer-Encoding: gzip, chunked",
            "Transfer-Encoding: identity, chunked",
            "Transfer-Encoding: chunked, chunked",
            "Transfer-Encoding: ,chunked",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
            "Transfer-Encoding: gzip",
            "Transfer-Encoding: chunked, identity",
            "Transfer-Encoding: chunked;q=1",
            "Transfer-Encoding:",
            "Content-Length: 3\r\nTransfer-Encoding: gzip",
        ] {
            let raw = format!("POST / HTTP/1.1\r\nHost: x\r\n{te}\r\n\r\nabc");
            let Parse::Done(p) = parsed(raw.as_bytes()) else {
                panic!("{te}: not parsed here")
            };
            assert!(p.body == Framed::Unsupported && !p.keep_alive, "{te}");
        }
    }

    #[test]
    fn keep_alive_follows_version_and_connection_tokens() {
        let ka = |raw: &[u8]| match parsed(raw) {
            Parse::Done(p) => p.keep_alive,
            _ => panic!("not parsed"),
        };
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: foo, close\r\n\r\n"));
        assert!(!ka(
            b"GET / HTTP/1.1\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n"
        ));
    }

    /// Random mutations of valid heads (bytes flipped, inserted, cut): the
    /// parser never panics; whatever it accepts is what httparse reads
    /// (method, target, every field in order), with a framing this path
    /// serves — else the head is refused.
    #[test]
    fn mutated_heads_are_parsed_as_httparse_reads_them_or_refused() {
        let seeds: [&[u8]; 4] = [
            b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Gray: 1\r\n\r\n",
            b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
            b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nCookie: a=1; b=2\r\n\r\n",
            b"HEAD /h HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ];
        let alphabet = b"\r\n :;,\t\x00\x7fAaZz09-_/?%Hh";
        let mut rng = fastrand::Rng::with_seed(16);
        let mut accepted = 0;
        for round in 0..20_000 {
            let mut raw = seeds[round % seeds.len()].to_vec();
            for _ in 0..rng.usize(1..4) {
                let at = rng.usize(0..raw.len());
                match rng.u8(0..3) {
                    0 => raw[at] = alphabet[rng.usize(0..alphabet.len())],
                    1 => raw.insert(at, alphabet[rng.usize(0..alphabet.len())]),
                    _ => {
                        raw.remove(at);
                    }
                }
            }
            let mut b = BytesMut::from(&raw[..]);
            let Parse::Done(p) = parse(&mut b) else {
                continue;
            };
            accepted += 1;
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut r = httparse::Request::new(&mut fields);
            let Ok(httparse::Status::Complete(n)) = r.parse(&raw) else {
                panic!(
                    "accepted what httparse does not: {:?}",
                    String::from_utf8_lossy(&raw)
                );
            };
            let what = String::from_utf8_lossy(&raw).into_owned();
            assert_eq!(p.req.method().as_str(), r.method.unwrap(), "{what:?}");
            assert_eq!(p.req.uri().to_string(), r.path.unwrap(), "{what:?}");
            let got: Vec<(String, Vec<u8>)> = p
                .req
                .headers()
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec()))
                .collect();
            let want: Vec<(String, Vec<u8>)> = r
                .headers
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect();
            let mut got_sorted = got.clone();
            got_sorted.sort();
            let mut want_sorted = want.clone();
            want_sorted.sort();
            assert_eq!(got_sorted, want_sorted, "{what:?}");
            // A Transfer-Encoding of one `chunked` field is a chunked
            // body; any other is refused.
            let te: Vec<&[u8]> = want
                .iter()
                .filter(|(k, _)| k == "transfer-encoding")
                .map(|(_, v)| &v[..])
                .collect();
            let one_chunked = te.len() == 1 && te[0].trim_ascii().eq_ignore_ascii_case(b"chunked");
            assert_eq!(
                matches!(p.body, Framed::Chunked { .. }),
                one_chunked,
                "{what:?}"
            );
            let refused = p.body == Framed::Unsupported;
            assert_eq!(refused, !te.is_empty() && !one_chunked, "{what:?}");
            if refused {
                assert!(!p.keep_alive, "{what:?}");
            }
            // The body starts where the head ends.
            assert_eq!(b.len(), raw.len() - n, "{what:?}");
        }
        assert!(
            accepted > 2_000,
            "only {accepted} mutated heads were parsed"
        );
    }

    #[test]
    fn partial_heads_wait() {
        assert!(matches!(
            parsed(b"GET / HTTP/1.1\r\nHost: x\r\n"),
            Parse::Partial
        ));
    }

    /// The parse notes whether any field name has a `_` (the proxy skips
    /// its underscore filter when none has): the usual names are known
    /// not to, any other is searched.
    #[test]
    fn parse_notes_underscored_names() {
        let has_underscores = |raw: &[u8]| match parsed(raw) {
            Parse::Done(p) => p.has_underscores,
            _ => panic!("not parsed: {:?}", String::from_utf8_lossy(raw)),
        };
        assert!(!has_underscores(
            b"GET / HTTP/1.1\r\nHost: x\r\nAccept-Encoding: id\r\n\r\n"
        ));
        assert!(!has_underscores(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-User-Id: 7\r\n\r\n"
        ));
        assert!(has_underscores(
            b"GET / HTTP/1.1\r\nHost: x\r\nX_User_Id: 7\r\n\r\n"
        ));
        assert!(has_underscores(
            b"GET / HTTP/1.1\r\nx_gray_tag: v2\r\nHost: x\r\n\r\n"
        ));
    }
}

#[cfg(test)]
mod task_size {
    /// The size of the future `f` returns (without calling it).
    fn future_size<A, Fut, F: FnOnce(A) -> Fut>(_: F) -> usize {
        std::mem::size_of::<Fut>()
    }

    /// An idle plain connection is its task (tokio's cell: 96 bytes of
    /// header, scheduler, id and trailer around the future, rounded up to
    /// 128 on x86-64), its boxed `Conn` and the socket's registration. A
    /// future over 160 bytes takes the cell from 256 to 384 bytes per idle
    /// connection.
    #[test]
    fn an_idle_connections_future_fits_a_256_byte_task_cell() {
        let run = future_size(super::run::<tokio::net::TcpStream, super::Proxy>);
        assert!(run <= 160, "run: {run} bytes");
        assert!(std::mem::size_of::<super::Conn>() <= 128);
    }
}
