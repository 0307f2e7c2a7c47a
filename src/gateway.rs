//! The running gateway: the current [`Generation`] behind an `ArcSwap`,
//! reload status, the upstream client, and nginx's worker model — one
//! single-threaded runtime per worker thread, each accepting on its own
//! SO_REUSEPORT listener, so a request never leaves the thread that
//! accepted it (per-thread Lua VM, per-thread upstream pool, no
//! cross-thread wake-ups).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::config::ConfigError;
use crate::generation::Generation;
use crate::proxy::{self, FallbackLog, UpstreamClient};

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
    /// Serialises reloads (watcher, SIGHUP).
    reload_lock: Mutex<()>,
}

impl Gateway {
    /// Loads generation 1 from `config_path`.
    pub fn load(config_path: &Path) -> Result<Arc<Gateway>, ConfigError> {
        let config_path = std::path::absolute(config_path).unwrap_or(config_path.to_path_buf());
        let gen = Generation::load(&config_path, 1)?;
        for w in &gen.warnings {
            tracing::warn!("{w}");
        }
        let client = proxy::build_client(&gen.config.upstream);
        Ok(Arc::new(Gateway {
            current: ArcSwap::from_pointee(gen),
            config_path,
            status: Mutex::new(ReloadStatus::default()),
            client,
            fallback_log: FallbackLog::default(),
            started: Instant::now(),
            reload_lock: Mutex::new(()),
        }))
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
            Ok(gen) => {
                for w in &gen.warnings {
                    tracing::warn!("{w}");
                }
                self.current.store(Arc::new(gen));
                status.last_reload_error = None;
                status.applied += 1;
                tracing::info!(generation = next, "configuration reloaded");
                Ok(next)
            }
            Err(e) => {
                tracing::error!(error = %e, "reload rejected; previous configuration keeps serving");
                status.last_reload_error = Some(e.to_string());
                status.rejected += 1;
                Err(e)
            }
        }
    }

    /// Accepts client connections forever.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let gw = self.clone();
            tokio::spawn(async move { gw.serve_connection(stream, peer).await });
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
                            Ok(l) => gw.serve(l).await,
                            Err(e) => tracing::error!(error = %e, "worker listener failed"),
                        }
                    });
                })?;
            handles.push(h);
        }
        Ok(handles)
    }

    async fn serve_connection(self: Arc<Self>, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let gw = self.clone();
        let svc = service_fn(move |req| {
            let gw = gw.clone();
            async move { proxy::handle(&gw, peer, req).await }
        });
        let result = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(10))
            .serve_connection(TokioIo::new(stream), svc)
            .with_upgrades()
            .await;
        if let Err(e) = result {
            tracing::debug!(%peer, error = %e, "client connection ended with an error");
        }
    }
}
