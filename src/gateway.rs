//! The running gateway: the current [`Generation`] behind an `ArcSwap`,
//! reload status, node health, the upstream client, and nginx's worker
//! model — one single-threaded runtime per worker thread, each accepting on
//! its own SO_REUSEPORT listener, so a request never leaves the thread that
//! accepted it (per-thread Lua VM, per-thread upstream pool, no cross-thread
//! wake-ups). The accept loop enforces the connection cap, per-connection
//! timeouts and the graceful drain.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::access_log::AccessLog;
use crate::client_conn::{verdict, Activity, TimedIo, Tracked, Verdict};
use crate::config::{resolve, ConfigError};
use crate::generation::Generation;
use crate::health::{now_ms, HealthRegistry};
use crate::metrics::Metrics;
use crate::nodes::NodeStats;
use crate::proxy::{self, FallbackLog, UpstreamClient};

/// A live count (connections, tunnels) with a wake-up when it drops to 0.
#[derive(Default)]
pub struct Counter {
    n: AtomicUsize,
    changed: Notify,
}

impl Counter {
    pub fn get(&self) -> usize {
        self.n.load(Ordering::Relaxed)
    }
}

/// Holds one unit of a [`Counter`] until dropped.
pub struct Counted(Arc<Counter>);

impl Counted {
    pub fn new(c: Arc<Counter>) -> Counted {
        c.n.fetch_add(1, Ordering::Relaxed);
        Counted(c)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // Waiters only care about reaching zero (the drain).
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.changed.notify_waiters();
        }
    }
}

/// Outcome of the last reload attempt.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_reload_error: Option<String>,
    pub last_reload_at: Option<SystemTime>,
    pub applied: u64,
    pub rejected: u64,
}

pub struct Gateway {
    current: ArcSwap<Generation>,
    pub config_path: PathBuf,
    pub status: Mutex<ReloadStatus>,
    pub client: UpstreamClient,
    pub fallback_log: FallbackLog,
    pub started: Instant,
    /// Node health, kept across reloads.
    pub health: HealthRegistry,
    /// Open client connections (for the cap and the drain).
    pub connections: Arc<Counter>,
    /// Open upgraded (WebSocket) tunnels.
    pub tunnels: Arc<Counter>,
    shutdown: watch::Sender<bool>,
    /// Serialises reloads (watcher, SIGHUP).
    reload_lock: Mutex<()>,
    pub metrics: Metrics,
    /// Per-node counters, surviving reloads.
    pub node_stats: NodeStats,
    pub access_log: AccessLog,
    /// Traffic history for the dashboard.
    pub history: crate::admin::stats::History,
    /// Serialises admin changes to node files.
    pub edit_lock: tokio::sync::Mutex<()>,
}

impl Gateway {
    /// Loads generation 1 from `config_path`.
    pub fn load(config_path: &Path) -> Result<Arc<Gateway>, ConfigError> {
        let config_path = std::path::absolute(config_path).unwrap_or(config_path.to_path_buf());
        let mut gen = Generation::load(&config_path, 1)?;
        for w in &gen.warnings {
            tracing::warn!("{w}");
        }
        let client = proxy::build_client(&gen.config.upstream);
        let metrics = Metrics::new();
        metrics.generation.set(gen.id as i64);
        let access_log = match &gen.config.access_log {
            Some(cfg) => {
                let dir = config_path.parent().unwrap_or(Path::new("."));
                let root = gen
                    .config
                    .root
                    .as_ref()
                    .map_or(dir.to_path_buf(), |r| resolve(dir, r));
                AccessLog::start(cfg, &root, metrics.access_log_dropped.clone())
            }
            None => AccessLog::off(metrics.access_log_dropped.clone()),
        };
        let health = HealthRegistry::default();
        health.attach(&mut gen);
        let gw = Arc::new(Gateway {
            current: ArcSwap::from_pointee(gen),
            config_path,
            status: Mutex::new(ReloadStatus::default()),
            client,
            fallback_log: FallbackLog::default(),
            started: Instant::now(),
            health,
            connections: Arc::new(Counter::default()),
            tunnels: Arc::new(Counter::default()),
            shutdown: watch::channel(false).0,
            reload_lock: Mutex::new(()),
            metrics,
            node_stats: NodeStats::default(),
            access_log,
            history: Default::default(),
            edit_lock: tokio::sync::Mutex::new(()),
        });
        gw.health.sync(&gw.current(), &gw.client);
        Ok(gw)
    }

    /// The generation serving now.
    pub fn current(&self) -> Arc<Generation> {
        self.current.load_full()
    }

    /// Builds a new generation from disk and swaps it in; on any error the
    /// old one keeps serving and the error is recorded. Blocking.
    pub fn reload(&self) -> Result<u64, ConfigError> {
        let _guard = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let next = self.current.load().id + 1;
        let result = Generation::load(&self.config_path, next);
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.last_reload_at = Some(SystemTime::now());
        match result {
            Ok(mut gen) => {
                for w in &gen.warnings {
                    tracing::warn!("{w}");
                }
                self.health.attach(&mut gen);
                let gen = Arc::new(gen);
                self.current.store(gen.clone());
                self.health.sync(&gen, &self.client);
                status.last_reload_error = None;
                status.applied += 1;
                self.metrics.reloads.with_label_values(&["applied"]).inc();
                self.metrics.generation.set(next as i64);
                tracing::info!(generation = next, "configuration reloaded");
                Ok(next)
            }
            Err(e) => {
                tracing::error!(error = %e, "reload rejected; previous configuration keeps serving");
                status.last_reload_error = Some(e.to_string());
                status.rejected += 1;
                self.metrics.reloads.with_label_values(&["rejected"]).inc();
                Err(e)
            }
        }
    }

    /// Starts the graceful shutdown: stop accepting, let connections finish
    /// their in-flight requests, close idle ones.
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Waits until every client connection has closed.
    pub async fn drained(&self) {
        loop {
            let notified = self.connections.changed.notified();
            if self.connections.get() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Accepts client connections until shutdown begins (then the listener
    /// is closed, so new connections are refused).
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        let mut shutdown = self.shutdown.subscribe();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait_for(|s| *s) => break,
            };
            let (mut stream, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let max = self.current().config.client.max_connections;
            if self.connections.get() >= max {
                crate::lane::log_limited(&CAP_LOG, || {
                    tracing::warn!(max, "connection cap reached; refusing connections")
                });
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
            let gw = self.clone();
            tokio::spawn(async move {
                gw.serve_connection(stream, peer).await;
                drop(guard);
            });
            continue;
        }
        tracing::info!("stopped accepting connections");
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

    /// Starts one worker thread per listener, each with its own
    /// single-threaded runtime serving that listener forever.
    pub fn spawn_workers(
        self: &Arc<Self>,
        listeners: Vec<std::net::TcpListener>,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let mut handles = Vec::new();
        for (i, l) in listeners.into_iter().enumerate() {
            let gw = self.clone();
            let h = std::thread::Builder::new()
                .name(format!("graygate-worker-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "worker runtime failed to start");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        match TcpListener::from_std(l) {
                            Ok(l) => gw.clone().serve(l).await,
                            Err(e) => tracing::error!(error = %e, "worker listener failed"),
                        }
                        // Keep this runtime (and its connections) alive
                        // while they drain; the process exits after that.
                        gw.drained().await;
                    });
                })?;
            handles.push(h);
        }
        Ok(handles)
    }

    async fn serve_connection(self: Arc<Self>, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let limits = self.current().config.client.clone();
        let act = Activity::new();
        let gw = self.clone();
        let svc_act = act.clone();
        let svc = service_fn(move |req| {
            let gw = gw.clone();
            let guard = svc_act.request_started();
            async move {
                let resp = proxy::handle(&gw, peer, req).await?;
                let (head, body) = resp.into_parts();
                Ok::<_, std::convert::Infallible>(http::Response::from_parts(
                    head,
                    Tracked::new(body, guard),
                ))
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        // The header timeout is enforced below (`verdict`), so hyper's own
        // per-request header timer is off: one timer fewer per request.
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .max_buf_size((limits.max_uri_bytes + limits.max_header_bytes + 4096).max(8192));
        let conn = builder
            .serve_connection(TokioIo::new(TimedIo::new(stream, act.clone())), svc)
            .with_upgrades();
        tokio::pin!(conn);
        let mut shutdown = self.shutdown.subscribe();
        let mut closing = false;
        loop {
            let wait = match verdict(
                &act,
                now_ms(),
                limits.header_timeout_ms,
                limits.idle_timeout_ms,
            ) {
                Verdict::Wait(d) => d,
                Verdict::HeaderTimeout => {
                    tracing::debug!(%peer, "request head not received in time; closing");
                    return;
                }
                Verdict::Idle => {
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    Duration::from_millis(limits.header_timeout_ms.max(10))
                }
            };
            // Re-check at least every half header timeout: a request head
            // may start arriving at any moment.
            let wait = wait.min(Duration::from_millis(
                (limits.header_timeout_ms / 2).max(10),
            ));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "client connection ended with an error");
                    }
                    return;
                }
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait_for(|s| *s), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

static CAP_LOG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
