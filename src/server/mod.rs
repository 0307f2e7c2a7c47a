//! Layer: server — the top of the data plane: listeners and client connections,
//! in nginx's worker model. One single-threaded runtime per worker thread, each
//! accepting on its own SO_REUSEPORT listener, so a request never leaves the
//! thread that accepted it (per-thread Lua VM, per-thread upstream pool, no
//! cross-thread wake-ups). The accept loop enforces the connection cap; each
//! connection's header-read and idle timeouts (`conn`) and the graceful drain
//! live here. Requests go to `proxy::handle` with the [`DataPlane`]; nothing
//! here reaches the control plane, which only flips the shutdown signal.
//! `handover` moves the listening sockets to a successor process (binary
//! upgrade).

pub mod conn;
mod h1;
mod inbox;
pub use h1::{decode_request, DecodedRequest};
pub mod h2guard;
pub mod handover;
pub mod tidy;
pub mod tls;
mod wheel;
mod wire;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::base::body::{Body, RequestBody};
use crate::base::clock::now_ms;
use crate::base::counter::{Counted, Counter};
use crate::base::fileslots::FileSlots;
use crate::base::ratelog::log_limited;
use crate::base::Https;
use crate::codec::fields::SentHead;
use crate::proxy::record::Recorded;
use crate::proxy::{self, Answer, DataPlane};
use conn::{Activity, TimedIoV, Tracked, Verdict};

/// What a client listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// HTTP/1.1 (the `listen` address).
    Plain,
    /// HTTP/1.1, or HTTP/2 with prior knowledge (h2c).
    H2c,
    /// TLS; HTTP/2 or HTTP/1.1 by ALPN. The index of the listener in
    /// `config.listeners` (and of its certificates in `Generation::tls`).
    Tls(usize),
}

/// What a listener's HTTP/1.1 connections serve: the proxy ([`Proxy`], the
/// client listeners), or one of the gateway's own services ([`Service`]:
/// the admin API, the demo nodes). Every one is served by the same
/// connection loop and codec (`h1`): the same head reading, refusals,
/// framing, keep-alive and timeouts.
pub trait App: Clone + Send + Sync + 'static {
    /// The answer to one request (`sent`: the client's head as read, for
    /// the fields passed on unchanged).
    fn call(
        &self,
        plane: Arc<DataPlane>,
        peer: SocketAddr,
        req: Request<RequestBody>,
        sent: Option<SentHead>,
    ) -> impl Future<Output = Result<Answer<Recorded>, Infallible>> + Send + 'static;
}

/// The client listeners' [`App`]: every request through `proxy::handle_with`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Proxy;

impl App for Proxy {
    #[inline(always)]
    fn call(
        &self,
        plane: Arc<DataPlane>,
        peer: SocketAddr,
        req: Request<RequestBody>,
        sent: Option<SentHead>,
    ) -> impl Future<Output = Result<Answer<Recorded>, Infallible>> + Send + 'static {
        proxy::handle_with(plane, peer, req, sent)
    }
}

/// One of the gateway's own HTTP/1.1 services as an [`App`]: `f` answers
/// each request (with its body still to read); nothing goes through the
/// proxy or its records.
pub struct Service<F>(Arc<F>);

impl<F> Service<F> {
    pub fn new(f: F) -> Service<F> {
        Service(Arc::new(f))
    }
}

impl<F> Clone for Service<F> {
    fn clone(&self) -> Self {
        Service(self.0.clone())
    }
}

impl<F, Fut> App for Service<F>
where
    F: Fn(SocketAddr, Request<RequestBody>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = http::Response<Body>> + Send + 'static,
{
    fn call(
        &self,
        plane: Arc<DataPlane>,
        peer: SocketAddr,
        mut req: Request<RequestBody>,
        _sent: Option<SentHead>,
    ) -> impl Future<Output = Result<Answer<Recorded>, Infallible>> + Send + 'static {
        // The proxy's refusals, with its answers (501, 414, 431, 400).
        let gen = plane.current();
        let refused = proxy::resolve::refusal(&mut req, &gen.config.client, &gen.lane.tag_header);
        let answer = match refused {
            Some(kind) => Err(crate::base::error::Error::new(kind).response()),
            None => Ok((self.0)(peer, req)),
        };
        async move {
            let resp = match answer {
                Ok(answer) => answer.await,
                Err(refused) => refused,
            };
            Ok(Answer::from(resp).map_body(Recorded::unrecorded))
        }
    }
}

/// Serves `app` on a plain HTTP/1.1 listener (the admin API, a demo node)
/// until the process ends, with the accept loop, connection loop and codec
/// of the client listeners: their header, idle and send timeouts and head
/// limits from the current configuration's `client:` section, and a
/// connection cap of `client.max_connections` counted by a server of its
/// own (client traffic at its cap never locks these out). No drain: a
/// graceful stop does not close it.
pub async fn serve_own<A: App>(plane: Arc<DataPlane>, listener: TcpListener, app: A) {
    // Never signalled, and kept until the loop ends (a dropped sender
    // would read as the shutdown signal).
    let (_never, stop) = watch::channel(false);
    let server = Arc::new(Server::new(plane, Arc::new(Counter::default()), stop));
    server.accept(listener, Kind::Plain, app).await
}

/// The client side of the gateway: what the workers serve with.
pub struct Server {
    pub plane: Arc<DataPlane>,
    /// Open client connections (for the cap and the drain).
    pub connections: Arc<Counter>,
    /// Becomes true when the graceful stop begins.
    shutdown: watch::Receiver<bool>,
    /// The same, read per response: while draining, every answer carries
    /// `Connection: close`.
    draining: AtomicBool,
    /// When the drain began (`now_ms`, at least 1); 0 = not draining. Idle
    /// keep-alive connections get `drain_idle_ms` from this moment.
    drain_since: AtomicU64,
    /// Accept loops still running (the drain waits for them, so no
    /// connection accepted at the last moment is missed).
    accepting: Arc<Counter>,
}

impl Server {
    pub fn new(
        plane: Arc<DataPlane>,
        connections: Arc<Counter>,
        shutdown: watch::Receiver<bool>,
    ) -> Server {
        Server {
            plane,
            connections,
            shutdown,
            draining: AtomicBool::new(false),
            drain_since: AtomicU64::new(0),
            accepting: Arc::new(Counter::default()),
        }
    }

    /// Waits until every accept loop has stopped and every client
    /// connection and WebSocket tunnel has closed (tunnels are counted
    /// before their connection ends, so none slips between the waits).
    pub async fn drained(&self) {
        self.accepting.zero().await;
        self.connections.zero().await;
        self.plane.tunnels.zero().await;
    }

    /// Marks the drain as begun (the control plane calls this with the
    /// shutdown signal): responses from now on close their connection.
    pub fn begin_drain(&self) {
        let _ = self.drain_since.compare_exchange(
            0,
            now_ms().max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.draining.store(true, Ordering::Relaxed);
    }

    /// When the drain began (now, if the shutdown signal came without
    /// [`begin_drain`](Self::begin_drain)); 0 while not draining.
    fn drain_since(&self) -> u64 {
        self.drain_since.load(Ordering::Relaxed)
    }

    fn drain_since_or_now(&self) -> u64 {
        match self.drain_since() {
            0 => now_ms().max(1),
            t => t,
        }
    }

    /// Accepts client connections until shutdown begins (then the listener
    /// is closed, so new connections are refused).
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        self.serve_kind(listener, Kind::Plain).await
    }

    /// [`serve`](Self::serve) for a listener of any [`Kind`].
    pub async fn serve_kind(self: Arc<Self>, listener: TcpListener, kind: Kind) {
        self.accept(listener, kind, Proxy).await
    }

    /// The accept loop: connections of `kind`, their HTTP/1.1 requests
    /// served by `app` (HTTP/2 and TLS listeners are the proxy's only).
    async fn accept<A: App>(self: Arc<Self>, listener: TcpListener, kind: Kind, app: A) {
        let mut shutdown = self.shutdown.clone();
        // The coarse clock of this loop's idle HTTP/1.1 connections (their
        // idle timeout is checked when a tick reaches the slot of its
        // deadline, `h1`), and of giving closed connections' memory back
        // (`tidy`).
        let (period, longest, mut gen_seen) = {
            let gen = self.plane.current();
            let c = &gen.config.client;
            let period = (c.idle_timeout_ms.min(c.drain_idle_ms) / 4).clamp(10, 1000);
            let longest = c.idle_timeout_ms.max(c.drain_idle_ms);
            (period, longest, gen.id)
        };
        // Wakes this loop's idle HTTP/1.1 connections: those due on a tick,
        // and all of them when the drain begins.
        let wheel = Arc::new(wheel::Wheel::new(period, longest));
        let mut ticked = now_ms();
        let mut tick = tokio::time::interval(Duration::from_millis(period));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut tidy = crate::server::tidy::Tidy::default();
        // Connections accepted since this loop last let the queued tasks run.
        let mut in_row = 0;
        loop {
            if in_row == ACCEPTS_PER_TURN {
                in_row = 0;
                tokio::task::yield_now().await;
            }
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait_for(|s| *s) => break,
                _ = tick.tick() => {
                    let now = now_ms();
                    // A drain (it shortens every idle deadline) or a new
                    // configuration (its idle timeout may be shorter) wakes
                    // every idle connection to look again.
                    let gen = self.plane.current().id;
                    if self.draining.load(Ordering::Relaxed) || gen != gen_seen {
                        gen_seen = gen;
                        wheel.wake_all();
                    } else {
                        wheel.advance(ticked, now);
                    }
                    ticked = now;
                    // The read buffers (client and upstream side),
                    // request slots and deadline slots a burst left and
                    // the steady load did not use over the last second go
                    // back too (at most once a second however short the
                    // tick: a 10 ms window would free what the load takes
                    // again at once), and so do the idle upstream
                    // connections it left (`upstream::pool`).
                    if tidy.trim_due(now) {
                        let idle = Duration::from_millis(self.plane.current().config.upstream.idle_timeout_ms);
                        let freed = h1::trim_kept()
                            + crate::upstream::trim_kept(now, idle)
                            + crate::base::deadline::trim();
                        if freed > 0 {
                            tidy.freed();
                        }
                    }
                    use crate::server::tidy::{self, Give};
                    match tidy.tick(self.connections.get(), now) {
                        Give::None => {}
                        Give::Nudge => tidy::nudge(),
                        Give::Collect => {
                            tidy::collect();
                            tidy::nudge();
                        }
                    }
                    continue;
                }
            };
            let (mut stream, peer) = match accepted {
                Ok(c) => {
                    in_row += 1;
                    c
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let max = self.plane.current().config.client.max_connections;
            if self.connections.get() >= max {
                log_limited(&CAP_LOG, || {
                    tracing::warn!(max, "connection cap reached; refusing connections")
                });
                if matches!(kind, Kind::Tls(_)) {
                    // No plaintext answer on a TLS port: just close.
                    continue;
                }
                tokio::spawn(async move {
                    let msg = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 21\r\nconnection: close\r\n\r\ntoo many connections\n";
                    let _ = tokio::time::timeout(Duration::from_secs(1), async {
                        let _ = stream.write_all(msg).await;
                        let _ = stream.shutdown().await;
                    })
                    .await;
                });
                continue;
            }
            let guard = Counted::new(self.connections.clone());
            let server = self.clone();
            // Plain connections: the HTTP/1.1 loop is the task itself (no
            // wrapping future holding a second copy of its state).
            if kind == Kind::Plain {
                tokio::spawn(h1::serve(
                    server,
                    app.clone(),
                    stream,
                    peer,
                    wheel.clone(),
                    Some(guard),
                ));
                continue;
            }
            let wheel = wheel.clone();
            tokio::spawn(async move {
                match kind {
                    Kind::Plain | Kind::H2c => server.serve_h2c(stream, peer, wheel).await,
                    Kind::Tls(i) => tls::serve(server, stream, peer, i, wheel).await,
                }
                drop(guard);
            });
            continue;
        }
        drop(listener);
        tracing::info!("stopped accepting connections");
        // Draining: idle connections close on the shorter drain idle
        // timeout, checked on this loop's ticks until every one has gone.
        loop {
            wheel.wake_all();
            tokio::select! {
                _ = self.connections.zero() => break,
                _ = tick.tick() => {}
            }
        }
    }

    /// Binds `n` listeners on `addr` with SO_REUSEPORT (the kernel spreads
    /// connections across them). Port 0 picks one port for all.
    pub fn bind_listeners(
        addr: SocketAddr,
        n: usize,
    ) -> std::io::Result<Vec<std::net::TcpListener>> {
        let mut out: Vec<std::net::TcpListener> = Vec::with_capacity(n);
        let mut addr = addr;
        for _ in 0..n.max(1) {
            let sock = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            sock.set_reuse_address(true)?;
            sock.set_reuse_port(true)?;
            sock.bind(&addr.into())?;
            sock.listen(4096)?;
            sock.set_nonblocking(true)?;
            let l: std::net::TcpListener = sock.into();
            addr = l.local_addr()?;
            out.push(l);
        }
        Ok(out)
    }

    /// Binds `n` SO_REUSEPORT listeners on `addr` for this process alone:
    /// a listener of another process on that address (another graygate,
    /// whose SO_REUSEPORT would otherwise let both share the port) is an
    /// [`io::ErrorKind::AddrInUse`](std::io::ErrorKind::AddrInUse) error, as
    /// nginx and Envoy refuse. Two checks:
    ///
    /// 1. before binding, a probe socket *without* SO_REUSEPORT (with
    ///    SO_REUSEADDR, so connections in TIME_WAIT do not count) is bound
    ///    to `addr`: the kernel refuses it while any socket listens there or
    ///    on an overlapping wildcard, whoever owns it;
    /// 2. after binding, every listening socket on that address in
    ///    `/proc/net/tcp` (or `tcp6`) must be one of ours (by inode): this
    ///    closes the window between the probe and the bind, where two
    ///    processes starting at once would both pass the probe (both then
    ///    refuse, never both serve).
    ///
    /// A binary upgrade does not come here: the successor serves the
    /// sockets it inherited (the same kernel sockets), topped up with
    /// [`bind_listeners`](Self::bind_listeners).
    pub fn bind_exclusive(
        addr: SocketAddr,
        n: usize,
    ) -> std::io::Result<Vec<std::net::TcpListener>> {
        if addr.port() != 0 {
            let probe = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            probe.set_reuse_address(true)?;
            if let Err(e) = probe.bind(&addr.into()) {
                return Err(match e.kind() {
                    std::io::ErrorKind::AddrInUse => in_use(),
                    _ => e,
                });
            }
        }
        let out = Server::bind_listeners(addr, n)?;
        let ours: Vec<u64> = out.iter().filter_map(socket_inode).collect();
        let bound = out[0].local_addr()?;
        if foreign_listeners(bound, &ours) > 0 {
            return Err(in_use());
        }
        Ok(out)
    }

    /// Starts `workers` worker threads, each with its own single-threaded
    /// runtime serving its share of the listeners (normally one each; an
    /// upgrade from a process with more workers leaves some with more).
    pub fn spawn_workers(
        self: &Arc<Self>,
        listeners: Vec<std::net::TcpListener>,
        workers: usize,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        self.spawn_worker_groups(vec![(Kind::Plain, listeners)], workers)
    }

    /// Starts `workers` worker threads for several listener groups (each
    /// bound with [`bind_listeners`](Self::bind_listeners), or inherited at
    /// an upgrade): the `j`-th listener of every group goes to worker
    /// `j % workers` (normally one of each per worker; an upgrade from a
    /// process with more workers leaves some with more).
    pub fn spawn_worker_groups(
        self: &Arc<Self>,
        groups: Vec<(Kind, Vec<std::net::TcpListener>)>,
        workers: usize,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let most = groups.iter().map(|g| g.1.len()).max().unwrap_or(0);
        let workers = workers.clamp(1, most.max(1));
        let mut per_worker: Vec<Vec<(Kind, std::net::TcpListener)>> =
            (0..workers).map(|_| Vec::new()).collect();
        for (kind, ls) in groups {
            for (j, l) in ls.into_iter().enumerate() {
                per_worker[j % workers].push((kind, l));
            }
        }
        let mut handles = Vec::new();
        for (i, ls) in per_worker.into_iter().enumerate() {
            let server = self.clone();
            // Counted before the thread starts, so a drain never begins
            // between here and the first accept.
            let accepting = Counted::new(self.accepting.clone());
            let h = std::thread::Builder::new()
                .name(format!("graygate-worker-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .max_io_events_per_tick(IO_EVENTS_PER_TICK)
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "worker runtime failed to start");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let mut serving = tokio::task::JoinSet::new();
                        let mut ls = ls;
                        // One listener (the usual plain set-up): served
                        // inline, without a task of its own.
                        if ls.len() == 1 {
                            let (kind, l) = ls.remove(0);
                            match TcpListener::from_std(l) {
                                Ok(l) => server.clone().serve_kind(l, kind).await,
                                Err(e) => tracing::error!(error = %e, "worker listener failed"),
                            }
                        }
                        for (kind, l) in ls {
                            match TcpListener::from_std(l) {
                                Ok(l) => {
                                    serving.spawn(server.clone().serve_kind(l, kind));
                                }
                                Err(e) => tracing::error!(error = %e, "worker listener failed"),
                            }
                        }
                        while serving.join_next().await.is_some() {}
                        drop(accepting);
                        // Keep this runtime (its connections and WebSocket
                        // tunnels) alive while they drain; the process
                        // exits after that or at the drain time.
                        server.drained().await;
                    });
                })?;
            handles.push(h);
        }
        Ok(handles)
    }

    /// A plain connection on an h2c listener: the HTTP/2 preface → h2c,
    /// anything else → HTTP/1.1.
    async fn serve_h2c(
        self: Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        wheel: Arc<wheel::Wheel>,
    ) {
        let header_ms = self.plane.current().config.client.header_timeout_ms;
        let sniff = tokio::time::timeout(Duration::from_millis(header_ms), sniff_preface(&stream));
        match sniff.await {
            Ok(Ok(true)) => self.serve_h2(stream, peer, false).await,
            Ok(Ok(false)) => h1::serve(self, Proxy, stream, peer, wheel, None).await,
            Ok(Err(_)) | Err(_) => {}
        }
    }
}

impl Server {
    /// HTTP/2 on a TLS stream (ALPN `h2`) or a plain one (h2c), with the
    /// configured stream, header-list, window and reset limits. Each stream
    /// is one request through `proxy::handle`, as on HTTP/1.1.
    async fn serve_h2<I>(self: Arc<Self>, stream: I, peer: SocketAddr, secure: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let gen = self.plane.current();
        let limits = gen.config.client.clone();
        let h2 = gen.config.http2.clone();
        drop(gen);
        let act = Activity::new();
        let plane = self.plane.clone();
        let svc_act = act.clone();
        // The connection's bound on open files (below its stream limit: one
        // per stream otherwise), waited for at most the send timeout.
        let slots = (h2.max_open_files_per_connection < h2.max_concurrent_streams)
            .then(|| {
                FileSlots::new(
                    h2.max_open_files_per_connection as usize,
                    limits.send_timeout_ms,
                )
            })
            .flatten();
        let svc = service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let plane = plane.clone();
            let guard = svc_act.request_started();
            if secure {
                req.extensions_mut().insert(Https);
            }
            // hyper's side of an upgrade, in the proxy's terms.
            if let Some(up) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() {
                let pending: crate::base::upgrade::Pending = Box::pin(async move {
                    let io = up.await.ok()?;
                    Some(Box::new(TokioIo::new(io)) as crate::base::upgrade::Tunnel)
                });
                req.extensions_mut()
                    .insert(crate::base::upgrade::ClientUpgrade::new(pending));
            }
            if let Some(s) = &slots {
                req.extensions_mut().insert(s.clone());
            }
            // `:authority` stands for Host (as nginx's $host): routes, the
            // lane script and the node see it as a Host field.
            if !req.headers().contains_key(http::header::HOST) {
                let host = req
                    .uri()
                    .authority()
                    .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok());
                if let Some(h) = host {
                    req.headers_mut().insert(http::header::HOST, h);
                }
            }
            let grpc = is_grpc(req.headers());
            async move {
                // Boxed: hyper spawns each stream as a task, and moving the
                // whole request future into it costs more than a box.
                let mut resp = Box::pin(proxy::handle(&plane, peer, req.map(Into::into))).await?;
                if grpc && !is_grpc(resp.headers()) && resp.status().as_u16() >= 400 {
                    resp = grpc_error(resp);
                }
                let (head, body) = resp.into_parts();
                Ok::<_, std::convert::Infallible>(http::Response::from_parts(
                    head,
                    h2guard::Watch::new(Tracked::new(body, guard)),
                ))
            }
        });
        // Each stream's task runs under the send timeout's watchdog.
        let exec = h2guard::StreamExec {
            limit_ms: limits.send_timeout_ms,
        };
        let mut builder = hyper::server::conn::http2::Builder::new(exec);
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(h2.max_concurrent_streams)
            .max_header_list_size(h2.max_header_list_size)
            .initial_stream_window_size(h2.initial_stream_window_bytes)
            .initial_connection_window_size(h2.initial_connection_window_bytes)
            .max_frame_size(h2.max_frame_size)
            .max_pending_accept_reset_streams(h2.max_pending_accept_reset_streams)
            .max_local_error_reset_streams(h2.max_local_error_reset_streams);
        if h2.keepalive_interval_ms > 0 {
            builder
                .keep_alive_interval(Duration::from_millis(h2.keepalive_interval_ms))
                .keep_alive_timeout(Duration::from_millis(h2.keepalive_interval_ms.max(1000)));
        }
        let watch = Arc::new(h2guard::ConnWatch::default());
        let io = h2guard::H2Io::new(stream, watch.clone(), h2.max_control_frames_per_second);
        let conn = builder.serve_connection(TokioIo::new(TimedIoV::new(io, act.clone())), svc);
        tokio::pin!(conn);
        let mut shutdown = self.shutdown.clone();
        let mut closing = false;
        // A write waiting for the socket is checked at least this often.
        let send_check = Duration::from_millis((limits.send_timeout_ms / 2).max(10));
        loop {
            let now = now_ms();
            if watch.send_stalled(now, limits.send_timeout_ms) {
                log_limited(
                    &SEND_LOG,
                    || tracing::warn!(%peer, send_timeout_ms = limits.send_timeout_ms, "HTTP/2 client stopped reading; closing"),
                );
                return;
            }
            if watch.flood_done(now) {
                return;
            }
            let wait = match conn::idle_verdict(&act, now, limits.idle_timeout_ms) {
                Verdict::Wait(d) => d,
                _ => {
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    Duration::from_millis(limits.header_timeout_ms.max(10))
                }
            };
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "HTTP/2 client connection ended with an error");
                    }
                    return;
                }
                _ = tokio::time::sleep(if watch.flooded() { wait.min(FLOOD_CHECK) } else { wait.min(send_check) }) => {}
                _ = shutdown.wait_for(|s| *s), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

fn is_grpc(h: &http::HeaderMap) -> bool {
    crate::base::grpc::is_grpc(h)
}

/// The gateway's own error answer (no route, no node, 502/503/504…) to a
/// gRPC request, as gRPC clients expect it: a trailers-only response,
/// HTTP 200, `grpc-status` mapped from the HTTP status as gRPC's
/// HTTP-to-gRPC mapping says, the reason in `grpc-message`
/// (`base::grpc::status_fields`).
fn grpc_error(resp: http::Response<Recorded>) -> http::Response<Recorded> {
    let status = resp.status();
    let empty = http_body_util::Empty::<bytes::Bytes>::new()
        .map_err(|never| -> crate::base::body::BoxError { match never {} });
    let (head, mut body) = resp.into_parts();
    // The request is still recorded as what it was (its real status).
    body.set_inner(crate::base::body::boxed(empty), http::StatusCode::OK);
    let mut out = http::Response::new(body);
    let h = out.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    h.extend(crate::base::grpc::status_fields(status));
    for (k, v) in &head.headers {
        // Keep the gateway's own annotations (e.g. the lane header).
        if k != http::header::CONTENT_TYPE && k != http::header::CONTENT_LENGTH {
            h.entry(k).or_insert(v.clone());
        }
    }
    out
}

/// Does the stream start with the HTTP/2 connection preface? Peeks (the
/// bytes stay for the protocol that serves the connection).
async fn sniff_preface(stream: &TcpStream) -> std::io::Result<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut buf = [0u8; 24];
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if buf[..n] != PREFACE[..n] {
            return Ok(false);
        }
        if n == PREFACE.len() {
            return Ok(true);
        }
        // A prefix of the preface so far: wait for more bytes.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Readiness events a worker's runtime takes from the kernel per poll
/// (tokio's default is 1,024). The runtime polls every 61 tasks; when
/// thousands of sockets are ready at once (a burst's requests, every
/// client closing), 1,024 woken tasks a poll outgrow that and the run
/// queue grows to hold them all, a buffer tokio keeps for good (16–32 KiB
/// after 9,500 closes, whose block took a fresh 512 KiB allocator page).
/// 64 a poll keeps the queue about as long as what runs between polls.
const IO_EVENTS_PER_TICK: usize = 64;

/// Connections an accept loop takes in a row before it lets the tasks
/// already queued run (tokio's budget alone allows 128). A worker's
/// runtime polls the kernel every 61 tasks, and a loop that yields runs
/// again after that poll: at 128 a turn, a connect storm queued 128 new
/// connections for every 61 tasks run, and the run queue grew to thousands
/// (a 64 KiB buffer after 9,500 connects at once, which the runtime keeps
/// for good, on a page of its own). 32 a turn is fewer than run between
/// polls, so the queue stays short.
const ACCEPTS_PER_TURN: usize = 32;

static CAP_LOG: AtomicU64 = AtomicU64::new(0);
static SEND_LOG: AtomicU64 = AtomicU64::new(0);

/// How often a connection cut off for a flood checks its linger time.
const FLOOD_CHECK: Duration = Duration::from_millis(100);

/// The error of a listening address held by another process.
fn in_use() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "address already in use by another process",
    )
}

/// The inode of a socket (`socket:[N]` in `/proc/self/fd`).
fn socket_inode(l: &std::net::TcpListener) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let link = std::fs::read_link(format!("/proc/self/fd/{}", l.as_raw_fd())).ok()?;
    let link = link.to_str()?;
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Listening sockets on `addr` (or a wildcard address of its family on its
/// port, or on `addr`'s port when `addr` is the wildcard) whose inode is not
/// in `ours`. Without a readable `/proc/net/tcp` (no procfs), 0: the probe
/// bind alone then guards.
fn foreign_listeners(addr: SocketAddr, ours: &[u64]) -> usize {
    let table = if addr.is_ipv4() {
        "/proc/net/tcp"
    } else {
        "/proc/net/tcp6"
    };
    let Ok(text) = std::fs::read_to_string(table) else {
        return 0;
    };
    listeners_in(&text)
        .filter(|(a, inode)| {
            a.port() == addr.port()
                && (a.ip() == addr.ip() || a.ip().is_unspecified() || addr.ip().is_unspecified())
                && !ours.contains(inode)
        })
        .count()
}

/// (local address, inode) of every listening socket in a `/proc/net/tcp`
/// or `tcp6` table. Addresses are printed as host-order 32-bit words.
fn listeners_in(table: &str) -> impl Iterator<Item = (SocketAddr, u64)> + '_ {
    table.lines().skip(1).filter_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || f[3] != "0A" {
            return None;
        }
        let (ip, port) = f[1].split_once(':')?;
        let port = u16::from_str_radix(port, 16).ok()?;
        let mut bytes = Vec::with_capacity(16);
        for i in (0..ip.len()).step_by(8) {
            let word = u32::from_str_radix(ip.get(i..i + 8)?, 16).ok()?;
            bytes.extend_from_slice(&word.to_ne_bytes());
        }
        let ip: std::net::IpAddr = match bytes.len() {
            4 => <[u8; 4]>::try_from(bytes).ok()?.into(),
            16 => <[u8; 16]>::try_from(bytes).ok()?.into(),
            _ => return None,
        };
        Some((SocketAddr::new(ip, port), f[9].parse().ok()?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_of_another_owner_refuses_an_exclusive_bind() {
        // SO_REUSEPORT listeners as another graygate's: a plain
        // SO_REUSEPORT bind joins them, an exclusive one is refused.
        let other = Server::bind_listeners("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = other[0].local_addr().unwrap();
        assert!(Server::bind_listeners(addr, 1).is_ok());
        let e = Server::bind_exclusive(addr, 2).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert_eq!(e.to_string(), "address already in use by another process");
        // The check after the bind sees them too (the race the probe
        // cannot close), and not our own.
        let ours: Vec<u64> = other.iter().filter_map(socket_inode).collect();
        assert_eq!(ours.len(), 2);
        assert_eq!(foreign_listeners(addr, &ours), 0);
        assert_eq!(foreign_listeners(addr, &ours[..1]), 1);
        let wildcard = SocketAddr::new("0.0.0.0".parse().unwrap(), addr.port());
        assert_eq!(foreign_listeners(wildcard, &[]), 2);
        // Closed: free again, for this process alone.
        drop(other);
        let mine = Server::bind_exclusive(addr, 2).unwrap();
        assert_eq!(mine.len(), 2);
    }

    #[test]
    fn proc_net_tcp_lines_are_read() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0\n\
             1: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0000000000000000 100 0 0 10 0\n";
        let got: Vec<_> = listeners_in(table).collect();
        if cfg!(target_endian = "little") {
            assert_eq!(got, [("127.0.0.1:8000".parse().unwrap(), 4242)]);
        }
        let v6 = "  sl  local_address\n   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 77 1\n";
        let got: Vec<_> = listeners_in(v6).collect();
        if cfg!(target_endian = "little") {
            assert_eq!(got, [("[::1]:8080".parse().unwrap(), 77)]);
        }
    }
}
