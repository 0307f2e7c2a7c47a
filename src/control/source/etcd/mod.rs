//! Layer: control plane. The etcd source: every document is a key under a
//! prefix (`keys`), a generation is built from ONE range read at one
//! revision (`snapshot`), the range is watched from that revision + 1
//! (`watch`), admin edits are written back with compare-and-swap (`edit`),
//! each gateway publishes its state under a lease (`status`), and the
//! command line checks, pushes and pulls configurations (`cli`). Every
//! applied snapshot is written atomically to `<cache_dir>/snapshot.json`; a
//! gateway that cannot reach etcd at start serves that (`source_state:
//! cached`) and catches up when etcd returns.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::config::{parse_yaml, Bootstrap, ConfigError, EtcdSettings};
use crate::control::Gateway;
use crate::generation::Generation;

mod cli;
mod edit;
pub mod fleet;
mod keys;
pub mod registry;
mod snapshot;
mod status;
mod watch;

pub use cli::{check, documents_of_files, pull, push};
pub use edit::{edit_node, edit_rules};
pub use keys::{
    endpoint_list, leader_key, main_key, norm_prefix, range, release_key, releases_range,
    stats_key, status_key,
};
pub use snapshot::{build, documents, read, Kv, Snapshot};
pub use status::{fleet, leave, status_doc};
pub use watch::run;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Connects to one endpoint (lazily: the first request tells).
pub async fn connect(endpoint: &str, timeout: Duration) -> Result<Client, String> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_keep_alive(Duration::from_secs(2), timeout)
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    Client::connect([endpoint], Some(opts)).await.map_err(err)
}

/// The running etcd source of one gateway.
pub struct EtcdSource {
    pub settings: EtcdSettings,
    pub bootstrap: Bootstrap,
    pub prefix: String,
    /// The bootstrap file's directory (static trees, cache_dir, access log).
    pub dir: PathBuf,
    pub id: String,
    /// The snapshot serving now.
    applied: Mutex<Option<Arc<Snapshot>>>,
    client: tokio::sync::Mutex<Option<Client>>,
    next_endpoint: AtomicUsize,
    /// The newest revision a build was attempted at (applied or rejected).
    seen: AtomicI64,
    /// Something `<prefix>/status/<id>` shows changed.
    pub changed: tokio::sync::Notify,
}

impl EtcdSource {
    pub fn new(bootstrap: Bootstrap, bootstrap_path: &Path) -> EtcdSource {
        let dir = bootstrap_path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let settings = bootstrap.etcd.clone();
        let id = settings.id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "gateway".into());
            format!("{host}:{}", bootstrap.listen.port())
        });
        EtcdSource {
            prefix: norm_prefix(&settings.prefix),
            settings,
            bootstrap,
            dir,
            id,
            applied: Mutex::new(None),
            client: tokio::sync::Mutex::new(None),
            next_endpoint: AtomicUsize::new(0),
            seen: AtomicI64::new(0),
            changed: tokio::sync::Notify::new(),
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.settings.timeout_ms.max(100))
    }

    pub fn cache_path(&self) -> PathBuf {
        crate::config::resolve(&self.dir, &self.settings.cache_dir).join("snapshot.json")
    }

    /// The snapshot serving now.
    pub fn applied(&self) -> Option<Arc<Snapshot>> {
        self.applied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A client for the current endpoint (connecting to the next one after
    /// a failure, see [`EtcdSource::failed`]).
    pub async fn client(&self) -> Result<Client, String> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let eps = &self.settings.endpoints;
        if eps.is_empty() {
            return Err("etcd.endpoints is empty".into());
        }
        let ep = &eps[self.next_endpoint.load(Ordering::Relaxed) % eps.len()];
        let c = connect(ep, self.timeout()).await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// The current endpoint failed: the next call connects to the next one.
    pub async fn failed(&self) {
        *self.client.lock().await = None;
        self.next_endpoint.fetch_add(1, Ordering::Relaxed);
    }

    /// One read of the whole range, trying every endpoint once.
    async fn read_any(&self, at: Option<i64>) -> Result<Snapshot, String> {
        let mut last = String::new();
        for _ in 0..self.settings.endpoints.len().max(1) {
            match self.client().await {
                Ok(mut c) => match read(&mut c, &self.prefix, at, self.timeout()).await {
                    Ok(s) => return Ok(s),
                    Err(e) => last = e,
                },
                Err(e) => last = e,
            }
            self.failed().await;
        }
        Err(last)
    }

    fn build(&self, snap: &Snapshot, id: u64) -> Result<Generation, ConfigError> {
        build(snap, Some(&self.bootstrap), &self.dir, id)
    }

    /// The last-known-good snapshot on disk, if written for this prefix.
    fn read_cache(&self) -> Result<Snapshot, String> {
        Snapshot::load(&self.cache_path(), &self.prefix)
    }

    /// Builds and applies `snap`; a rejected one leaves the old generation
    /// serving, its error in `/status` and the status key. Blocking.
    fn apply(&self, gw: &Gateway, snap: Snapshot) -> Result<u64, ConfigError> {
        if self
            .applied()
            .is_some_and(|cur| cur.only_release_decisions(&snap))
        {
            let rev = snap.revision;
            self.set_applied(gw, Arc::new(snap), true);
            self.seen.fetch_max(rev, Ordering::AcqRel);
            return Ok(gw.current().id);
        }
        let res = gw.install(|id| self.build(&snap, id));
        let rev = snap.revision;
        match &res {
            Ok(_) => self.set_applied(gw, Arc::new(snap), true),
            // The old generation keeps serving; the error shows in /status
            // and the status key.
            Err(_) => self.changed.notify_one(),
        }
        self.seen.fetch_max(rev, Ordering::AcqRel);
        res
    }

    /// Rebuilds the serving snapshot (SIGHUP, admin). Blocking.
    pub fn rebuild_current(&self, gw: &Gateway) -> Result<u64, ConfigError> {
        let snap = self.applied().ok_or_else(|| {
            ConfigError::new(main_key(&self.prefix), None, "no snapshot applied yet")
        })?;
        gw.install(|id| self.build(&snap, id))
    }
}

/// Starts a gateway from a bootstrap file: generation 1 from etcd, or from
/// the last-known-good snapshot when etcd cannot be read; with neither, an
/// error (never an empty configuration).
pub async fn start(bootstrap_path: &Path) -> Result<(Arc<Gateway>, Arc<EtcdSource>), String> {
    let path = std::path::absolute(bootstrap_path).unwrap_or(bootstrap_path.to_path_buf());
    let text = crate::config::read_file(&path).map_err(err)?;
    let boot: Bootstrap = parse_yaml(&path, &text).map_err(err)?;
    let src = Arc::new(EtcdSource::new(boot, &path));
    let (snap, live, first_error) = match src.read_any(None).await {
        Ok(snap) => match src.build(&snap, 1) {
            Ok(gen) => (Some((snap, gen)), true, None),
            Err(e) => (None, true, Some(e.to_string())),
        },
        Err(e) => (None, false, Some(format!("etcd unreachable: {e}"))),
    };
    let (snap, gen, live) = match snap {
        Some((s, g)) => (s, g, live),
        None => {
            let why = first_error.clone().unwrap_or_default();
            let cached = src
                .read_cache()
                .map_err(|e| format!("{why}; and no usable cached snapshot: {e}"))?;
            let gen = src
                .build(&cached, 1)
                .map_err(|e| format!("{why}; and the cached snapshot does not build: {e}"))?;
            tracing::warn!(
                revision = cached.revision,
                file = %src.cache_path().display(),
                "{why}: serving the cached snapshot"
            );
            (cached, gen, false)
        }
    };
    let gw = Gateway::with_generation(gen, path, Some(super::Store::Etcd(src.clone())));
    src.set_applied(&gw, Arc::new(snap), live);
    if let Some(e) = first_error {
        if live {
            gw.status
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .last_reload_error = Some(e);
        } else {
            src.set_store_error(&gw, &e);
        }
    }
    Ok((gw, src))
}
