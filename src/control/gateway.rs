//! Layer: control plane. The running gateway: it owns the data plane's handles
//! ([`DataPlane`]: the live generation, upstream client, node health, metrics,
//! access log) and the client [`Server`], and is the only writer — it builds
//! generations (`control::build`), publishes them, keeps the reload status and
//! starts and stops health probes. Admin, the reload watcher and edits act
//! through it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tokio::sync::watch;

use super::source::{SourceStatus, Store};
use super::stats::History;
use crate::base::counter::Counter;
use crate::config::{resolve, ConfigError};
use crate::generation::{Generation, Live};
use crate::nodes::health::HealthRegistry;
use crate::observe::access_log::AccessLog;
use crate::observe::metrics::Metrics;
use crate::observe::node_stats::NodeStats;
use crate::proxy::{DataPlane, FallbackLog};
use crate::server::Server;
use crate::upstream::Upstream;

/// Outcome of the last reload attempt.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_reload_error: Option<String>,
    pub last_reload_at: Option<SystemTime>,
    pub applied: u64,
    pub rejected: u64,
}

pub struct Gateway {
    /// What the request path reads and records into.
    pub plane: Arc<DataPlane>,
    /// The client listeners' side (workers, connections, drain).
    pub server: Arc<Server>,
    pub config_path: PathBuf,
    pub status: Mutex<ReloadStatus>,
    pub started: Instant,
    /// Open client connections (for the cap and the drain).
    pub connections: Arc<Counter>,
    shutdown: watch::Sender<bool>,
    /// Serialises reloads (watcher, SIGHUP).
    reload_lock: Mutex<()>,
    /// Traffic history for the dashboard.
    pub history: History,
    /// The release controller's in-memory side.
    pub releases: super::release::controller::Runtime,
    /// Serialises admin changes to node files.
    pub edit_lock: tokio::sync::Mutex<()>,
    /// Where the configuration comes from and how that stands.
    pub source: Mutex<SourceStatus>,
    /// The configuration store, when the gateway was started from a
    /// bootstrap (none: files).
    pub store: Option<Store>,
    /// Start-only keys the command line set (`--listen`, `--pid-file`, …):
    /// the file's value of those is not what runs, so a reload may change
    /// it.
    pub pinned: std::sync::OnceLock<Vec<&'static str>>,
}

impl Gateway {
    /// Loads generation 1 from `config_path`.
    pub fn load(config_path: &Path) -> Result<Arc<Gateway>, ConfigError> {
        let config_path = std::path::absolute(config_path).unwrap_or(config_path.to_path_buf());
        Generation::prepare(&config_path);
        let gen = Generation::load(&config_path, 1)?;
        Ok(Gateway::with_generation(gen, config_path, None))
    }

    /// A gateway serving `gen` (generation 1). `config_path` is the main
    /// file, or the bootstrap file when a `store` is given.
    pub fn with_generation(
        mut gen: Generation,
        config_path: PathBuf,
        store: Option<Store>,
    ) -> Arc<Gateway> {
        for w in &gen.warnings {
            tracing::warn!("{w}");
        }
        let client = Upstream::new(&gen.config.upstream);
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
        health.attach(&mut gen.services);
        let node_stats = NodeStats::default();
        attach_counters(&node_stats, &mut gen);
        adopt_dicts(&mut gen);
        let spans = crate::observe::otel::Spans::new(metrics.otel_spans.clone());
        spans.configure(gen.config.otel.as_ref());
        let plane = Arc::new(DataPlane {
            generation: Live::new(gen),
            spans,
            client,
            health,
            metrics,
            node_stats,
            access_log,
            fallback_log: FallbackLog::default(),
            tunnels: Arc::new(Counter::default()),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        let connections = Arc::new(Counter::default());
        let server = Arc::new(Server::new(plane.clone(), connections.clone(), shutdown_rx));
        let gw = Arc::new(Gateway {
            plane,
            server,
            config_path,
            status: Mutex::new(ReloadStatus::default()),
            started: Instant::now(),
            connections,
            shutdown,
            reload_lock: Mutex::new(()),
            history: Default::default(),
            releases: Default::default(),
            edit_lock: tokio::sync::Mutex::new(()),
            source: Mutex::new(SourceStatus {
                source: store.as_ref().map_or("files", Store::name),
                ..Default::default()
            }),
            store,
            pinned: std::sync::OnceLock::new(),
        });
        gw.sync_health(&gw.current());
        gw
    }

    /// The generation serving now.
    pub fn current(&self) -> Arc<Generation> {
        self.plane.current()
    }

    /// Why the last reload was rejected ("" if it was not).
    pub fn last_reload_error(&self) -> String {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_reload_error
            .clone()
            .unwrap_or_default()
    }

    /// Starts, restarts and stops active probes to match `gen`.
    pub fn sync_health(&self, gen: &Generation) {
        self.plane
            .health
            .sync(&gen.services, &gen.lane.tag_header, &self.plane.client);
    }

    /// Builds a new generation from disk (a store: from its applied
    /// snapshot) and swaps it in; on any error the old one keeps serving
    /// and the error is recorded. Blocking.
    pub fn reload(&self) -> Result<u64, ConfigError> {
        if let Some(store) = &self.store {
            return store.rebuild_current(self);
        }
        self.install(|next| Generation::load(&self.config_path, next))
    }

    /// Builds the next generation with `build` (given its id) and swaps it
    /// in; on any error the old one keeps serving and the error is
    /// recorded. A build touches no live state: a generation rejected by
    /// the build or by the checks here (the listener layout) leaves the
    /// gateway exactly as it was; an accepted one is committed (health,
    /// counters, shared dictionaries) just before the swap. Blocking.
    pub fn install(
        &self,
        build: impl FnOnce(u64) -> Result<Generation, ConfigError>,
    ) -> Result<u64, ConfigError> {
        let _guard = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let next = self.plane.generation.id() + 1;
        let began = Instant::now();
        let result = build(next);
        let build_ms = began.elapsed().as_secs_f64() * 1e3;
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.last_reload_at = Some(SystemTime::now());
        // Listeners are bound at start: their layout cannot change under
        // the running workers (TLS listeners find their certificates by
        // position).
        let result = result.and_then(|gen| {
            let layout = |g: &Generation| {
                g.config
                    .listeners
                    .iter()
                    .map(|l| (l.listen, l.tls.is_some(), l.h2c))
                    .collect::<Vec<_>>()
            };
            if layout(&gen) == layout(&self.current()) {
                Ok(gen)
            } else {
                Err(ConfigError::new(
                    &self.config_path,
                    crate::config::find_line(
                        &std::fs::read_to_string(&self.config_path).unwrap_or_default(),
                        None,
                        "listeners:",
                    ),
                    "listeners: adding, removing or changing a listener's address, tls or h2c needs a restart, or `graygate --upgrade` (no connection is lost)",
                ))
            }
        });
        // Keys read only at start (sockets bound, threads started, files
        // the process owns): a reload that changes one is refused as a
        // whole, so what runs is always one file's configuration.
        let result = result.and_then(|gen| {
            let pinned = self.pinned.get().map_or(&[][..], Vec::as_slice);
            match start_only_changes(&self.current().config, &gen.config, pinned) {
                None => Ok(gen),
                Some((key, message)) => {
                    let text = std::fs::read_to_string(&self.config_path).unwrap_or_default();
                    Err(ConfigError::new(
                        &self.config_path,
                        top_level_line(&text, key),
                        message,
                    ))
                }
            }
        });
        match result {
            Ok(mut gen) => {
                for w in &gen.warnings {
                    tracing::warn!("{w}");
                }
                // Accepted: only now does it reach what outlives
                // generations (health, counters, shared dictionaries).
                self.plane.health.attach(&mut gen.services);
                attach_counters(&self.plane.node_stats, &mut gen);
                adopt_dicts(&mut gen);
                let gen = Arc::new(gen);
                self.plane.client.configure(&gen.config.upstream);
                self.plane.spans.configure(gen.config.otel.as_ref());
                self.plane.generation.publish(gen.clone());
                self.sync_health(&gen);
                status.last_reload_error = None;
                status.applied += 1;
                let metrics = &self.plane.metrics;
                metrics.reloads.with_label_values(&["applied"]).inc();
                metrics.generation.set(next as i64);
                tracing::info!(generation = next, build_ms, "configuration reloaded");
                Ok(next)
            }
            Err(e) => {
                tracing::error!(error = %e, "reload rejected; previous configuration keeps serving");
                status.last_reload_error = Some(e.to_string());
                status.rejected += 1;
                let metrics = &self.plane.metrics;
                metrics.reloads.with_label_values(&["rejected"]).inc();
                Err(e)
            }
        }
    }

    /// Starts the graceful shutdown: stop accepting, let connections finish
    /// their in-flight requests, close idle ones.
    pub fn begin_shutdown(&self) {
        self.server.begin_drain();
        self.shutdown.send_replace(true);
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Waits until the accept loops have stopped and every client
    /// connection and WebSocket tunnel has closed.
    pub async fn drained(&self) {
        self.server.drained().await
    }
}

/// The keys read only when the process starts, each with its value in
/// operators' words: the client and admin listeners (bound once; the
/// `listeners` layout is checked apart), the worker threads, the files the
/// process owns (pid file, upgrade socket, access log) and the demo nodes.
/// Everything else takes effect at the reload.
pub const START_ONLY: &[&str] = &[
    "listen",
    "admin_listen",
    "workers",
    "pid_file",
    "upgrade_socket",
    "access_log",
    "demo_nodes",
];

fn start_only_value(c: &crate::config::MainConfig, key: &str) -> String {
    let or = |v: Option<String>, none: &str| v.unwrap_or_else(|| none.to_string());
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    match key {
        "listen" => c.listen.to_string(),
        "admin_listen" => or(c.admin_listen.map(|a| a.to_string()), "none"),
        "workers" => or(c.workers.map(|w| w.to_string()), "one per CPU"),
        "pid_file" => or(path(&c.pid_file), "none"),
        "upgrade_socket" => or(path(&c.upgrade_socket), "none"),
        "access_log" => or(
            c.access_log.as_ref().map(|a| {
                let format = match a.format {
                    crate::config::AccessLogFormat::Text => "text",
                    crate::config::AccessLogFormat::Json => "json",
                };
                format!("{} ({format}, buffer {})", a.path.display(), a.buffer)
            }),
            "off",
        ),
        "demo_nodes" => {
            let nodes: Vec<String> = c
                .demo_nodes
                .iter()
                .map(|n| format!("{} {} ({})", n.name, n.addr, n.lane))
                .collect();
            if nodes.is_empty() {
                "none".to_string()
            } else {
                nodes.join(", ")
            }
        }
        _ => String::new(),
    }
}

/// The first start-only key `next` changes (the command line's `pinned`
/// ones aside) and the message refusing the reload, naming every changed
/// key with its running and its new value.
pub fn start_only_changes(
    running: &crate::config::MainConfig,
    next: &crate::config::MainConfig,
    pinned: &[&str],
) -> Option<(&'static str, String)> {
    let changed: Vec<(&'static str, String, String)> = START_ONLY
        .iter()
        .filter(|k| !pinned.contains(*k))
        .map(|&k| (k, start_only_value(running, k), start_only_value(next, k)))
        .filter(|(_, a, b)| a != b)
        .collect();
    let first = changed.first()?.0;
    let list: Vec<String> = changed
        .iter()
        .map(|(k, a, b)| format!("{k} (running: {a}; file: {b})"))
        .collect();
    let (what, it) = if changed.len() == 1 {
        ("a key read only at start changed", "it")
    } else {
        ("keys read only at start changed", "them")
    };
    Some((
        first,
        format!(
            "{what}: {}; restart graygate, or run `graygate --upgrade` (no connection is lost), \
             to apply {it}",
            list.join(", ")
        ),
    ))
}

/// Line of the top-level `key:` in a YAML text.
fn top_level_line(text: &str, key: &str) -> Option<usize> {
    let want = format!("{key}:");
    text.lines()
        .position(|l| l.starts_with(&want))
        .map(|i| i + 1)
}

/// Points every node of `gen` at its live counters (what least_request
/// reads in flight from), before the swap.
fn attach_counters(stats: &NodeStats, gen: &mut Generation) {
    for (name, svc) in gen.services.iter_mut() {
        svc.attach_counters(|addr| stats.get(name, addr));
    }
}

/// Gives an accepted generation the live `ngx.shared` dictionaries in place
/// of the build-private ones it was built with (resizing them to its sizes), in
/// the generation and in its script: the commit of what a build declared.
fn adopt_dicts(gen: &mut Generation) {
    crate::lane::shared_dict::adopt(&mut gen.dicts);
    if let Some(script) = &mut gen.lane.script {
        script.dicts = gen.dicts.clone();
    }
}
