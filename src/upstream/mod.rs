//! Layer: upstream (data plane, below node choice; uses observe, codec, base,
//! config). The client to the nodes, as sessions: [`Upstream::send`] takes a
//! request to a [`Peer`], connects a [`Session`] ([`Upstream::connect`]) —
//! HTTP/1.1 over plain TCP or TLS (one engine, [`h1`], on the shared wire
//! format of `codec`) or HTTP/2 (hyper, [`h2`]) — and runs the exchange
//! there, with per-thread keep-alive pools (like nginx's per-worker upstream
//! keepalive): no shared lock, no cross-thread wake-ups on the request path.
//! One path for every request: bodies in hand or streamed (full duplex),
//! upgrades, health probes.
//!
//! A connection goes back to its thread's pool when the response body has been
//! read to the end; one the upstream closed is dropped at checkout, and a
//! request that an idle connection could not even start sending is retried once
//! on a fresh connection (it never reached the upstream).

pub mod body;
pub mod fields;
mod h1;

pub use h1::{decode_response, Decoded};
mod h2;
mod pool;
pub mod tls;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};

pub use crate::base::body::BoxError;
use crate::base::deadline::{self, Deadline};
use crate::base::error::{Error, ErrorKind};
use crate::base::stall::Stall;
use crate::codec::fields::{RawLines, SentHead};
use crate::config::UpstreamConfig;
use crate::observe::metrics::NodeTracker;
use body::UpBody;
use fields::Added;

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

/// Where a request goes: a node's address and how its service reaches it
/// (`None`: plain HTTP/1.1).
#[derive(Clone, Copy)]
pub struct Peer<'a> {
    pub addr: SocketAddr,
    pub transport: Option<&'a tls::Transport>,
}

/// A request's head as it goes to a node, borrowed from the caller (the
/// same for every attempt).
pub struct OutHead<'a> {
    pub method: &'a http::Method,
    /// Origin-form target.
    pub target: &'a http::Uri,
    pub headers: &'a http::HeaderMap,
    /// The client's HTTP/1.1 head as received: the fields of `headers` it
    /// still holds unchanged go to an HTTP/1.1 node as their lines came
    /// (the client's case).
    pub sent: Option<&'a SentHead>,
    /// The gateway's own fields, written after `headers`.
    pub added: &'a Added<'a>,
    /// When the attempt began, if the caller has read the clock already
    /// (the response timeout runs from then: one clock read fewer).
    pub start: Option<std::time::Instant>,
    /// A plain HTTP/1.1 response head keeps its lines as sent
    /// ([`RawLines`], taken with [`PooledBody::take_lines`]: the response's
    /// map holds the rest of the head, none of those lines); the proxy
    /// makes them its `codec::fields::Fields`. (Health checks read the
    /// status only.)
    pub keep_lines: bool,
    /// The request asks for an upgrade (`Upgrade` kept in `headers`): a
    /// `101` answer hands the connection over ([`take_upgrade`]).
    pub upgrade: bool,
}

/// The added fields of a request the gateway makes itself.
static NO_FIELDS: Added<'static> = Added::none();

impl<'a> OutHead<'a> {
    /// A request the gateway makes itself (health probes, webhooks): these
    /// fields only, no client head, no added fields, the status read.
    pub fn own(
        method: &'a http::Method,
        target: &'a http::Uri,
        headers: &'a http::HeaderMap,
    ) -> OutHead<'a> {
        OutHead {
            method,
            target,
            headers,
            sent: None,
            added: &NO_FIELDS,
            start: None,
            keep_lines: false,
            upgrade: false,
        }
    }
}

/// A session to a node ([`Upstream::connect`]): an HTTP/1.1 connection,
/// plain or TLS (one engine, [`h1`]), taken from the thread's keep-alive
/// pool or freshly opened; or an HTTP/2 node (h2c or h2 over TLS, [`h2`]),
/// whose one multiplexed connection per thread is taken (or opened) when
/// the request's stream goes out.
pub enum Session<'a> {
    H1(h1::Session),
    H2 {
        addr: SocketAddr,
        transport: &'a tls::Transport,
    },
}

/// Closes the thread's idle connections past `idle_timeout`, closed by
/// the node, or left over from a burst (`pool::IdlePool::trim`; the
/// accept loop's tick, `now` its `now_ms`); how many. (Their read buffers
/// are the codec's pool, trimmed with the client side's.)
pub fn trim_kept(now: u64, idle_timeout: Duration) -> usize {
    h1::trim_pool(now, idle_timeout)
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

    /// A session to `peer`: for HTTP/1.1 (plain or TLS) an idle pooled
    /// connection still usable, else a fresh one, connected within
    /// `deadline`.
    pub async fn connect<'a>(
        &self,
        peer: Peer<'a>,
        s: &h1::Settings,
        deadline: &mut Deadline,
    ) -> Result<Session<'a>, Error> {
        match peer.transport {
            Some(t) if t.h2 => Ok(Session::H2 {
                addr: peer.addr,
                transport: t,
            }),
            t => {
                let tls = t.and_then(|t| t.tls.as_ref());
                Ok(Session::H1(h1::connect(peer.addr, tls, s, deadline).await?))
            }
        }
    }

    /// Sends a request to `peer` — the one way to a node, proxy and health
    /// probes alike — on a session ([`connect`](Self::connect)) and returns
    /// the response with its body still streaming; a body read that waits
    /// longer than `read_timeout` fails the body. No response head within
    /// `limit` (connect included) is a `ResponseTimeout` — on the HTTP/1.1
    /// engine checked at each of its waits on the thread's coarse
    /// deadlines (`base::deadline`): no timer, no wrapper future per
    /// request.
    ///
    /// A body in hand (empty or buffered) goes out with the head; a
    /// streamed one as it comes, and is taken only by the connection that
    /// sends it: a connect failure leaves it untouched, so the caller can
    /// take it back for another node ([`body::Replay::recover`]), while a
    /// body that reached a node is never sent twice. A pooled HTTP/1.1
    /// connection the node had closed is replaced by a fresh one when the
    /// request may go again ([`h1::Failure::Stale`]).
    pub async fn send(
        &self,
        peer: Peer<'_>,
        head: OutHead<'_>,
        body: UpBody,
        (read_timeout, limit): (Duration, Duration),
    ) -> Result<Response<PooledBody>, Error> {
        let tls = match peer.transport {
            // Boxed, and built in a frame of its own: neither the HTTP/1.1
            // path's future nor its poll's stack grows by h2's state.
            Some(t) if t.h2 => {
                return self
                    .send_h2(peer.addr, t, head, body, (read_timeout, limit))
                    .await
            }
            t => t.and_then(|t| t.tls.as_ref()),
        };
        let mut deadline =
            Deadline::after_from(head.start.unwrap_or_else(std::time::Instant::now), limit);
        let settings = self.settings(read_timeout);
        // An idle pooled connection is taken in place (the usual
        // keep-alive case: no connect future built, polled and moved).
        let session = match h1::pooled(peer.addr, tls, settings.idle_timeout) {
            Some(session) => session,
            None => h1::fresh(peer.addr, tls, &settings, &mut deadline).await?,
        };
        let (body, mut sending) = match body {
            UpBody::Empty => (None, None),
            UpBody::Full(b) => (b, None),
            stream @ UpBody::Stream(_) => {
                let framing = crate::codec::framing::request(
                    stream.is_end_stream(),
                    stream.size_hint().exact(),
                );
                (None, Some(Box::new(h1::Sending::new(stream, framing))))
            }
        };
        let out = h1::Outgoing {
            method: head.method,
            path_and_query: head.target.path_and_query().map_or("/", |p| p.as_str()),
            headers: head.headers,
            sent: head.sent,
            added: head.added,
            body,
            streamed: sending.as_ref().map(|s| s.framing()),
            keep_lines: head.keep_lines,
            upgrade: head.upgrade,
        };
        let addr = peer.addr;
        match session
            .send(addr, &out, &mut sending, &settings, &mut deadline)
            .await
        {
            Ok(r) => Ok(r),
            Err(h1::Failure::Stale) => Ok(h1::fresh(addr, tls, &settings, &mut deadline)
                .await?
                .send(addr, &out, &mut sending, &settings, &mut deadline)
                .await?),
            Err(h1::Failure::Failed(e)) => Err(e),
        }
    }

    /// An HTTP/2 session's exchange ([`h2`]), boxed by a function of its
    /// own (never inlined): the h2 future is built in this frame, not in
    /// the caller's poll.
    #[inline(never)]
    fn send_h2<'a>(
        &'a self,
        addr: SocketAddr,
        transport: &'a tls::Transport,
        head: OutHead<'a>,
        body: UpBody,
        (read_timeout, limit): (Duration, Duration),
    ) -> Pin<Box<impl std::future::Future<Output = Result<Response<PooledBody>, Error>> + 'a>> {
        Box::pin(async move {
            let mut req = Request::new(body);
            *req.method_mut() = head.method.clone();
            *req.uri_mut() = head.target.clone();
            *req.headers_mut() = head.headers.clone();
            let call = h2::request(addr, transport, req, head.added, self.connect_timeout());
            let resp = within(limit, call).await?;
            let (parts, body) = resp.into_parts();
            let body = H2Body {
                inner: body,
                stall: Stall::new(read_timeout),
            };
            Ok(Response::from_parts(parts, PooledBody::H2(body, None)))
        })
    }
}

/// A response body that returns its connection to the pool at its end,
/// and can carry the node's in-flight marker until then.
// The whole body is boxed once by the proxy; boxing the large variant too
// would cost a second allocation per response.
#[allow(clippy::large_enum_variant)]
pub enum PooledBody {
    /// From the HTTP/1.1 engine ([`h1`]).
    Raw(h1::RawBody, Option<NodeTracker>),
    /// From an HTTP/2 stream.
    H2(H2Body, Option<NodeTracker>),
}

impl PooledBody {
    /// The response head's lines as the node sent them, if kept so
    /// ([`OutHead::keep_lines`]).
    pub fn take_lines(&mut self) -> Option<RawLines> {
        match self {
            PooledBody::Raw(b, _) => b.take_lines(),
            PooledBody::H2(..) => None,
        }
    }

    /// Keeps `tracker` (the node's request in flight) until the body ends.
    pub fn tracked(mut self, tracker: NodeTracker) -> PooledBody {
        match &mut self {
            PooledBody::Raw(_, t) | PooledBody::H2(_, t) => *t = Some(tracker),
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
            PooledBody::H2(b, t) => (Pin::new(b).poll_frame(cx), t),
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
            PooledBody::H2(b, _) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            PooledBody::Raw(b, _) => b.size_hint(),
            PooledBody::H2(b, _) => b.size_hint(),
        }
    }
}

/// The node's side of an upgrade its response accepted (`101`): the
/// connection it came on, any bytes read past the 101 head in front.
/// `None` once taken, or for an answer that came any other way.
pub fn take_upgrade(resp: &mut Response<PooledBody>) -> crate::base::upgrade::Pending {
    let up = match resp.body_mut() {
        PooledBody::Raw(b, _) => b.take_upgraded(),
        PooledBody::H2(..) => None,
    };
    Box::pin(std::future::ready(
        up.map(|u| Box::new(u) as crate::base::upgrade::Tunnel),
    ))
}

/// An HTTP/2 response body, with the read timeout between its frames.
pub struct H2Body {
    inner: Incoming,
    stall: Stall,
}

impl Body for H2Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(_))) => this.stall.progress(),
            Poll::Pending if this.stall.stalled(cx) => {
                let e = Error::new(ErrorKind::UpstreamBodyTimeout);
                return Poll::Ready(Some(Err(e.into())));
            }
            _ => {}
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
