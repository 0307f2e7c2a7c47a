//! Layer: upstream (data plane, below node choice; uses observe, base, config).
//! Upstream HTTP/1.1 client with per-thread keep-alive pools (like nginx's
//! per-worker upstream keepalive): no shared lock, no cross-thread wake-ups on
//! the request path.
//!
//! Two engines: requests whose body is in hand (empty or buffered) and that ask
//! for no upgrade take the inline exchange in [`h1`]; streamed bodies (full
//! duplex) and upgrades take hyper's `client::conn::http1`.
//!
//! A connection goes back to its thread's pool when the response body has been
//! read to the end; one the upstream closed is dropped at checkout, and a
//! request that an idle connection could not even start sending is retried once
//! on a fresh connection (it never reached the upstream).

pub mod body;
pub mod fields;
mod h1;
pub use h1::RawHead;
pub use h1::{decode_response, Decoded};
mod h2;
mod pool;
pub mod tls;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;

pub use crate::base::body::BoxError;
use crate::base::deadline::{self, Deadline};
use crate::base::error::{Error, ErrorKind};
use crate::base::stall::Stall;
use crate::config::UpstreamConfig;
use crate::observe::metrics::NodeTracker;
use body::UpBody;
use fields::Added;

/// A hyper connection's sending half, with its place in the opening order.
struct Sender {
    tx: SendRequest<UpBody>,
    opened: u64,
}

impl pool::Opened for Sender {
    fn opened(&self) -> u64 {
        self.opened
    }
}

thread_local! {
    /// hyper's HTTP/1.1 connections by (node, TLS settings id; 0 = plain):
    /// a connection verified under one service's TLS settings is never
    /// handed to a service with others.
    static POOL: RefCell<pool::IdlePool<Sender, (SocketAddr, u64)>> = RefCell::new(pool::IdlePool::default());
}

/// `fut` within `limit` on the worker's coarse deadlines; past it, a
/// `ResponseTimeout`.
async fn within<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    deadline::timeout(limit, fut)
        .await
        .map_err(|_| Error::new(ErrorKind::ResponseTimeout))?
}

/// A request's head as it goes to a node, borrowed from the caller (the
/// same for every attempt).
pub struct OutHead<'a> {
    pub method: &'a http::Method,
    /// Origin-form target.
    pub target: &'a http::Uri,
    pub headers: &'a http::HeaderMap,
    /// When the attempt began, if the caller has read the clock already
    /// (the response timeout runs from then: one clock read fewer).
    pub start: Option<std::time::Instant>,
}

/// Frees the read buffers the thread's exchanges kept and did not take
/// again since the last call (the accept loop's tick, `now` its `now_ms`),
/// and closes the idle connections past `idle_timeout`, closed by the
/// node, or left over from a burst (`pool::IdlePool::trim`); how many.
pub fn trim_kept(now: u64, idle_timeout: Duration) -> usize {
    let hyper = POOL
        .try_with(|p| {
            p.borrow_mut()
                .trim(now, idle_timeout, |s| !s.tx.is_closed())
        })
        .unwrap_or(0);
    h1::trim_kept() + h1::trim_pool(now, idle_timeout) + hyper
}

/// The client. Cheap to share; the pools live in thread-locals. Its
/// connect and idle timeouts and pool size follow reloads ([`configure`]).
///
/// [`configure`]: Upstream::configure
#[derive(Debug, Clone, Default)]
pub struct Upstream {
    /// Shared by every clone (health probes hold one), so a reload reaches
    /// them all.
    live: std::sync::Arc<Live>,
}

/// The settings a reload changes in place.
#[derive(Debug, Default)]
struct Live {
    connect_timeout_ms: AtomicU64,
    idle_timeout_ms: AtomicU64,
    max_idle: AtomicUsize,
}

impl Upstream {
    pub fn new(cfg: &UpstreamConfig) -> Upstream {
        let u = Upstream::default();
        u.configure(cfg);
        u
    }

    /// Takes a (reloaded) configuration's connect and idle timeouts and
    /// pool size, for connections opened and pooled from now on.
    pub fn configure(&self, cfg: &UpstreamConfig) {
        let l = &self.live;
        l.connect_timeout_ms
            .store(cfg.connect_timeout_ms, Ordering::Relaxed);
        l.idle_timeout_ms
            .store(cfg.idle_timeout_ms, Ordering::Relaxed);
        l.max_idle
            .store(cfg.pool_max_idle_per_host, Ordering::Relaxed);
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.live.connect_timeout_ms.load(Ordering::Relaxed))
    }

    fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.live.idle_timeout_ms.load(Ordering::Relaxed))
    }

    fn max_idle(&self) -> usize {
        self.live.max_idle.load(Ordering::Relaxed)
    }

    fn settings(&self, read_timeout: Duration) -> h1::Settings {
        h1::Settings {
            connect_timeout: self.connect_timeout(),
            idle_timeout: self.idle_timeout(),
            max_idle: self.max_idle(),
            read_timeout,
        }
    }

    /// Sends `req` (origin-form URI) to the node at `addr` and returns the
    /// response with its body still streaming; a body read that waits
    /// longer than `read_timeout` fails the body. No response head within
    /// `limit` (connect included) is a `ResponseTimeout` — checked at each
    /// wait of the inline exchange on the thread's coarse deadlines
    /// (`base::deadline`): no timer, no wrapper future per request.
    pub async fn request(
        &self,
        addr: SocketAddr,
        req: Request<UpBody>,
        added: &Added<'_>,
        timeouts: (Duration, Duration),
    ) -> Result<Response<PooledBody>, Error> {
        if Self::inline_ok(req.headers(), req.body()) {
            let (parts, body) = req.into_parts();
            let head = OutHead {
                method: &parts.method,
                target: &parts.uri,
                headers: &parts.headers,
                start: None,
            };
            return self
                .request_ref(addr, head, body, added, timeouts, false)
                .await;
        }
        let (read_timeout, limit) = timeouts;
        let mut req = req;
        added.apply(req.headers_mut());
        self.hyper_within(addr, req, read_timeout, limit).await
    }

    /// Can [`request_ref`](Self::request_ref) send a request with these
    /// fields and this body (the inline exchange: no upgrade asked, the
    /// body in hand)?
    pub fn inline_ok(headers: &http::HeaderMap, body: &UpBody) -> bool {
        Self::inline_body(body) && fields::first(headers, &http::header::UPGRADE).is_none()
    }

    /// Can the inline exchange send this body (in hand, not streamed)?
    pub fn inline_body(body: &UpBody) -> bool {
        !matches!(body, UpBody::Stream(_))
    }

    /// The inline exchange for a request whose head is borrowed (see
    /// [`inline_ok`](Self::inline_ok); anything else takes
    /// [`request`](Self::request)). With `raw_ok` a plain response head's
    /// fields may come as [`RawHead`] (taken with
    /// [`PooledBody::take_raw_head`]; the response's map is empty then).
    pub async fn request_ref(
        &self,
        addr: SocketAddr,
        head: OutHead<'_>,
        body: UpBody,
        added: &Added<'_>,
        (read_timeout, limit): (Duration, Duration),
        raw_ok: bool,
    ) -> Result<Response<PooledBody>, Error> {
        let body = match body {
            UpBody::Empty => None,
            UpBody::Full(b) => b,
            UpBody::Stream(_) => {
                return Err(Error::new(ErrorKind::Exchange)
                    .with_source("a streamed body cannot take the inline exchange"))
            }
        };
        let out = h1::Outgoing {
            method: head.method,
            path_and_query: head.target.path_and_query().map_or("/", |p| p.as_str()),
            headers: head.headers,
            added,
            body,
            raw_ok,
        };
        let mut deadline =
            Deadline::after_from(head.start.unwrap_or_else(std::time::Instant::now), limit);
        let settings = self.settings(read_timeout);
        let resp = h1::request(addr, out, &settings, &mut deadline).await?;
        Ok(resp.map(|b| PooledBody::Raw(b, None)))
    }

    /// The hyper path within `limit` (boxed: hyper's client futures would
    /// make the inline path's future large, copied on every move).
    async fn hyper_within(
        &self,
        addr: SocketAddr,
        req: Request<UpBody>,
        read_timeout: Duration,
        limit: Duration,
    ) -> Result<Response<PooledBody>, Error> {
        within(limit, Box::pin(self.request_hyper(addr, req, read_timeout))).await
    }

    /// [`request`](Self::request) over a service's [`tls::Transport`]:
    /// HTTP/2 (h2c or h2 over TLS), HTTP/1.1 over TLS, or (`None`) the
    /// plain HTTP/1.1 engines.
    pub async fn request_via(
        &self,
        addr: SocketAddr,
        transport: Option<&tls::Transport>,
        req: Request<UpBody>,
        added: &Added<'_>,
        timeouts: (Duration, Duration),
    ) -> Result<Response<PooledBody>, Error> {
        match transport {
            None => self.request(addr, req, added, timeouts).await,
            // Boxed: the plain path's future does not grow by the TLS and
            // h2 paths' state.
            Some(t) => Box::pin(self.request_transport(addr, t, req, added, timeouts)).await,
        }
    }

    /// HTTP/2 or TLS to the node (a service with a [`tls::Transport`]); no
    /// response head within `limit` is a `ResponseTimeout`, as on the plain
    /// path.
    async fn request_transport(
        &self,
        addr: SocketAddr,
        t: &tls::Transport,
        req: Request<UpBody>,
        added: &Added<'_>,
        (read_timeout, limit): (Duration, Duration),
    ) -> Result<Response<PooledBody>, Error> {
        if t.h2 {
            let call = h2::request(addr, t, req, added, self.connect_timeout());
            let resp = within(limit, call).await?;
            let (head, body) = resp.into_parts();
            let body = HyperBody {
                inner: body,
                stall: Stall::new(read_timeout),
                slot: None,
            };
            return Ok(Response::from_parts(head, PooledBody::Hyper(body, None)));
        }
        let Some(tls) = &t.tls else {
            return self.request(addr, req, added, (read_timeout, limit)).await;
        };
        let mut req = req;
        added.apply(req.headers_mut());
        within(
            limit,
            self.request_hyper_on(addr, req, Some(tls), read_timeout),
        )
        .await
    }

    /// The full-duplex path over hyper's client connection.
    async fn request_hyper(
        &self,
        addr: SocketAddr,
        req: Request<UpBody>,
        read_timeout: Duration,
    ) -> Result<Response<PooledBody>, Error> {
        self.request_hyper_on(addr, req, None, read_timeout).await
    }

    /// hyper's HTTP/1.1 client connection, plain or over TLS.
    async fn request_hyper_on(
        &self,
        addr: SocketAddr,
        req: Request<UpBody>,
        tls: Option<&tls::TlsConnect>,
        read_timeout: Duration,
    ) -> Result<Response<PooledBody>, Error> {
        let key = (addr, tls.map_or(0, |t| t.id));
        let mut req = req;
        // The target is origin-form: a client that sent no Host (HTTP/1.0)
        // gets the node's address, as on the inline path.
        if !req.headers().contains_key(http::header::HOST) {
            if let Ok(v) = http::HeaderValue::from_str(&addr.to_string()) {
                req.headers_mut().insert(http::header::HOST, v);
            }
        }
        mark_chunked(&mut req);
        while let Some(mut sender) = self.checkout(key) {
            if sender.tx.ready().await.is_err() {
                continue;
            }
            match sender.tx.try_send_request(req).await {
                Ok(resp) => return Ok(self.wrap(resp, sender, key, read_timeout)),
                Err(mut e) => match e.take_message() {
                    // Never sent: safe to try another connection.
                    Some(r) => req = r,
                    None => return Err(Error::new(ErrorKind::Exchange).with_source(e.into_error())),
                },
            }
        }
        let mut sender = self.connect(addr, tls).await?;
        let resp = sender
            .tx
            .send_request(req)
            .await
            .map_err(|e| Error::new(ErrorKind::Exchange).with_source(e))?;
        Ok(self.wrap(resp, sender, key, read_timeout))
    }

    async fn connect(
        &self,
        addr: SocketAddr,
        tls: Option<&tls::TlsConnect>,
    ) -> Result<Sender, Error> {
        let stream = h1::connect(addr, self.connect_timeout()).await?;
        let connect_err = |e: hyper::Error| Error::new(ErrorKind::Connect).with_source(e);
        let tx = match tls {
            None => {
                let (sender, conn) = http1::Builder::new()
                    .handshake(TokioIo::new(stream))
                    .await
                    .map_err(connect_err)?;
                tokio::spawn(async move {
                    let _ = conn.with_upgrades().await;
                });
                sender
            }
            Some(t) => {
                let stream = tokio::time::timeout(self.connect_timeout(), t.connect(stream, addr))
                    .await
                    .map_err(|_| {
                        Error::new(ErrorKind::Connect).with_source("TLS handshake timed out")
                    })??;
                let (sender, conn) = http1::Builder::new()
                    .handshake(TokioIo::new(stream))
                    .await
                    .map_err(connect_err)?;
                tokio::spawn(async move {
                    let _ = conn.with_upgrades().await;
                });
                sender
            }
        };
        Ok(Sender {
            tx,
            opened: pool::opening(),
        })
    }

    fn checkout(&self, addr: (SocketAddr, u64)) -> Option<Sender> {
        POOL.with(|p| {
            p.borrow_mut()
                .checkout(addr, self.idle_timeout(), |s| !s.tx.is_closed())
        })
    }

    fn wrap(
        &self,
        resp: Response<Incoming>,
        sender: Sender,
        addr: (SocketAddr, u64),
        read_timeout: Duration,
    ) -> Response<PooledBody> {
        let (head, body) = resp.into_parts();
        let reusable = head.status != http::StatusCode::SWITCHING_PROTOCOLS;
        let mut pooled = HyperBody {
            inner: body,
            stall: Stall::new(read_timeout),
            slot: reusable.then_some(Slot {
                sender,
                addr,
                max_idle: self.max_idle(),
            }),
        };
        if pooled.inner.is_end_stream() {
            pooled.release();
        }
        Response::from_parts(head, PooledBody::Hyper(pooled, None))
    }
}

struct Slot {
    sender: Sender,
    /// The pool key: node and TLS settings id.
    addr: (SocketAddr, u64),
    max_idle: usize,
}

/// A response body that returns its connection to the pool at its end,
/// and can carry the node's in-flight marker until then.
// The whole body is boxed once by the proxy; boxing the large variant too
// would cost a second allocation per response.
#[allow(clippy::large_enum_variant)]
pub enum PooledBody {
    /// From the inline exchange.
    Raw(h1::RawBody, Option<NodeTracker>),
    /// From hyper's client connection.
    Hyper(HyperBody, Option<NodeTracker>),
}

impl PooledBody {
    /// The response head's fields as the node sent them, if they came so
    /// ([`Upstream::request_ref`] with `raw_ok`).
    pub fn take_raw_head(&mut self) -> Option<RawHead> {
        match self {
            PooledBody::Raw(b, _) => b.take_raw_head(),
            PooledBody::Hyper(..) => None,
        }
    }

    /// Keeps `tracker` (the node's request in flight) until the body ends.
    pub fn tracked(mut self, tracker: NodeTracker) -> PooledBody {
        match &mut self {
            PooledBody::Raw(_, t) | PooledBody::Hyper(_, t) => *t = Some(tracker),
        }
        self
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let (r, tracker) = match self.get_mut() {
            PooledBody::Raw(b, t) => (Pin::new(b).poll_frame(cx), t),
            PooledBody::Hyper(b, t) => (Pin::new(b).poll_frame(cx), t),
        };
        // At the end or on an error the node's request is no longer in
        // flight (whose error it was is judged when it is recorded).
        if let Poll::Ready(None | Some(Err(_))) = &r {
            *tracker = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        match self {
            PooledBody::Raw(b, _) => b.is_end_stream(),
            PooledBody::Hyper(b, _) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            PooledBody::Raw(b, _) => b.size_hint(),
            PooledBody::Hyper(b, _) => b.size_hint(),
        }
    }
}

/// The node's side of an upgrade its response accepted (`101`), ready once
/// the response's connection gives it up.
pub fn take_upgrade<B>(resp: &mut Response<B>) -> crate::base::upgrade::Pending {
    let up = hyper::upgrade::on(resp);
    Box::pin(async move {
        let io = up.await.ok()?;
        Some(Box::new(TokioIo::new(io)) as crate::base::upgrade::Tunnel)
    })
}

/// hyper's response body plus the connection it came on.
pub struct HyperBody {
    inner: Incoming,
    stall: Stall,
    slot: Option<Slot>,
}

impl HyperBody {
    fn release(&mut self) {
        if let Some(slot) = self.slot.take() {
            if slot.sender.tx.is_closed() {
                return;
            }
            POOL.with(|p| {
                p.borrow_mut()
                    .checkin(slot.addr, slot.sender, slot.max_idle)
            });
        }
    }
}

impl Body for HyperBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(None) => this.release(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.release(),
            Poll::Ready(Some(Err(_))) => this.slot = None,
            Poll::Ready(Some(Ok(_))) => this.stall.progress(),
            Poll::Pending if this.stall.stalled(cx) => {
                this.slot = None;
                let e = Error::new(ErrorKind::UpstreamBodyTimeout);
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Pending => {}
        }
        r.map_err(|e| Error::new(ErrorKind::UpstreamBody).with_source(e).into())
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A body of unknown length (a client's chunked one) goes out chunked
/// whatever the method: hyper's client sends a GET, HEAD or CONNECT with no
/// length of its own as bodiless (`Content-Length: 0` framing), which would
/// drop the client's body on the floor. A set `Transfer-Encoding` is what
/// hyper frames by.
fn mark_chunked(req: &mut Request<UpBody>) {
    let unknown = !req.body().is_end_stream() && req.body().size_hint().exact().is_none();
    if unknown {
        req.headers_mut().insert(
            http::header::TRANSFER_ENCODING,
            http::HeaderValue::from_static("chunked"),
        );
    }
}
