//! The running gateway: the current [`Generation`] behind an `ArcSwap`,
//! reload status, the shared upstream client, and the client-facing accept
//! loop that hands each connection to hyper with `proxy::handle`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::access_log::AccessLog;
use crate::config::{resolve, ConfigError};
use crate::generation::Generation;
use crate::metrics::Metrics;
use crate::nodes::NodeStats;
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
        let gen = Generation::load(&config_path, 1)?;
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
        Ok(Arc::new(Gateway {
            current: ArcSwap::from_pointee(gen),
            config_path,
            status: Mutex::new(ReloadStatus::default()),
            client,
            fallback_log: FallbackLog::default(),
            started: Instant::now(),
            reload_lock: Mutex::new(()),
            metrics,
            node_stats: NodeStats::default(),
            access_log,
            history: Default::default(),
            edit_lock: tokio::sync::Mutex::new(()),
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
