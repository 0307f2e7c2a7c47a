//! Layer: control plane. The etcd source. Key layout under `<prefix>`:
//!
//! ```text
//! <prefix>/config/main.yaml              main settings (the main file's format; listen,
//!                                        admin_listen and root come from the bootstrap)
//! <prefix>/config/<path>                 every document main.yaml names, by its relative
//!                                        path: scripts/gray.lua (+ modules), lists, node
//!                                        files, rules files
//! <prefix>/services/<svc>/config         registry: per-service settings (lane_key, health, …)
//! <prefix>/services/<svc>/nodes/<id>     registry: one instance (JSON), leased
//! <prefix>/status/<gateway-id>           each gateway's state (JSON), leased
//! ```
//!
//! A generation is built from ONE range read, `[<prefix>/config/,
//! <prefix>/services0)` at one revision (config and registry together; the
//! status keys sort after it and never trigger a build). The watch covers
//! the same range from the snapshot's revision + 1; events are debounced,
//! then the range is read again at the revision of the last event. A
//! compaction past the watch or a broken watch → a full re-read at the
//! current revision and a new watch; connections rotate across the
//! endpoints with backoff. Every applied snapshot is written atomically to
//! `<cache_dir>/snapshot.json`; a gateway that cannot reach etcd at start
//! serves that (`source_state: cached`) and catches up when etcd returns.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions, GetOptions, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::docs::MemDocs;
use crate::config::{parse_yaml, Bootstrap, ConfigError, EtcdSettings};
use crate::control::node_edit::EditError;
use crate::control::{registry, Gateway};
use crate::generation::Generation;

/// One value of a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Kv {
    #[serde(with = "b64")]
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// The keys of the config and registry range at one revision.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    pub prefix: String,
    /// The revision the range was read at (the watch resumes after it).
    pub read_revision: i64,
    /// The revision of the newest change it holds (what `/status` and
    /// `/fleet` report: equal on gateways holding the same state).
    pub revision: i64,
    pub kvs: BTreeMap<String, Kv>,
}

impl Snapshot {
    /// SHA-256 over the keys and values.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (k, kv) in &self.kvs {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(&kv.value);
            h.update([0]);
        }
        hex::encode(h.finalize())
    }
}

mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

/// `<prefix>` without a trailing slash.
pub fn norm_prefix(p: &str) -> String {
    p.trim_end_matches('/').to_string()
}

/// The range one snapshot reads: `[<prefix>/config/, <prefix>/services0)`.
pub fn range(prefix: &str) -> (String, String) {
    (format!("{prefix}/config/"), format!("{prefix}/services0"))
}

/// The key of the main settings.
pub fn main_key(prefix: &str) -> String {
    format!("{prefix}/config/main.yaml")
}

/// The status key of gateway `id`.
pub fn status_key(prefix: &str, id: &str) -> String {
    format!("{prefix}/status/{id}")
}

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

/// Reads the snapshot range at `at` (or the current revision).
pub async fn read(
    client: &mut Client,
    prefix: &str,
    at: Option<i64>,
    timeout: Duration,
) -> Result<Snapshot, String> {
    let (start, end) = range(prefix);
    let mut opts = GetOptions::new().with_range(end);
    if let Some(r) = at {
        opts = opts.with_revision(r);
    }
    let resp = tokio::time::timeout(timeout, client.get(start, Some(opts)))
        .await
        .map_err(|_| "etcd read timed out".to_string())?
        .map_err(err)?;
    let header = resp.header().map_or(0, |h| h.revision());
    let mut kvs = BTreeMap::new();
    let mut newest = at.unwrap_or(0);
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        newest = newest.max(kv.mod_revision());
        kvs.insert(
            key,
            Kv {
                value: kv.value().to_vec(),
                mod_revision: kv.mod_revision(),
            },
        );
    }
    Ok(Snapshot {
        prefix: prefix.to_string(),
        read_revision: at.unwrap_or(header),
        revision: newest,
        kvs,
    })
}

/// The documents of a snapshot: `<prefix>/config/*` by key (the main
/// settings with the bootstrap's addresses), the registry's services.
pub fn documents(
    snap: &Snapshot,
    listen: Option<&Bootstrap>,
    local_root: &Path,
) -> Result<(MemDocs, PathBuf, super::super::build::RegisteredServices), ConfigError> {
    let prefix = &snap.prefix;
    let (cfg, _) = range(prefix);
    let main = main_key(prefix);
    let mut docs = MemDocs {
        docs: BTreeMap::new(),
        local_root: local_root.to_path_buf(),
        releases: Some(BTreeMap::new()),
    };
    let (rel, _) = crate::control::release::fleet::releases_range(prefix);
    for (k, kv) in &snap.kvs {
        if let (Some(_), Some(r)) = (k.strip_prefix(&rel), docs.releases.as_mut()) {
            r.insert(PathBuf::from(k), kv.value.clone());
            continue;
        }
        if !k.starts_with(&cfg) {
            continue;
        }
        let value = if *k == main {
            main_text(&kv.value, listen)
        } else {
            kv.value.clone()
        };
        docs.docs.insert(PathBuf::from(k), value);
    }
    if !snap.kvs.contains_key(&main) {
        return Err(ConfigError::new(
            &main,
            None,
            "no main settings in etcd (push a configuration first)",
        ));
    }
    let services = registry::services(
        prefix,
        snap.kvs
            .iter()
            .map(|(k, kv)| (k.as_str(), kv.value.as_slice())),
    )?;
    Ok((docs, PathBuf::from(main), services))
}

/// The main settings as a build sees them: the per-gateway keys (`listen`,
/// `admin_listen`, `root`) blanked line for line (so every other line keeps
/// its number) and the bootstrap's addresses appended.
fn main_text(value: &[u8], boot: Option<&Bootstrap>) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(value) else {
        return value.to_vec();
    };
    let mut out = String::with_capacity(text.len() + 64);
    let mut had_listen = false;
    for line in text.lines() {
        let local = ["listen:", "admin_listen:"]
            .iter()
            .any(|k| line.starts_with(k));
        if line.starts_with("root:") || (local && boot.is_some()) {
            out.push('#');
        } else if line.starts_with("listen:") {
            had_listen = true;
        }
        out.push_str(line);
        out.push('\n');
    }
    match boot {
        Some(b) => {
            out.push_str(&format!("listen: \"{}\"\n", b.listen));
            if let Some(a) = b.admin_listen {
                out.push_str(&format!("admin_listen: \"{a}\"\n"));
            }
        }
        // `--check` of what is in etcd: any address will do.
        None if !had_listen => out.push_str("listen: \"127.0.0.1:0\"\n"),
        None => {}
    }
    out.into_bytes()
}

/// Builds a generation from a snapshot.
pub fn build(
    snap: &Snapshot,
    boot: Option<&Bootstrap>,
    local_root: &Path,
    id: u64,
) -> Result<Generation, ConfigError> {
    let (docs, main, services) = documents(snap, boot, local_root)?;
    Generation::build(&docs, &main, services, id)
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

    /// Writes `snap` to the cache atomically (temp file, fsync, rename).
    fn write_cache(&self, snap: &Snapshot) {
        let path = self.cache_path();
        let res = (|| -> std::io::Result<()> {
            if let Some(d) = path.parent() {
                std::fs::create_dir_all(d)?;
            }
            let text = serde_json::to_string(snap).map_err(std::io::Error::other)?;
            crate::control::node_edit::write_atomic(&path, &text)
        })();
        if let Err(e) = res {
            tracing::warn!(file = %path.display(), error = %e, "cannot write the snapshot cache");
        }
    }

    fn read_cache(&self) -> Result<Snapshot, String> {
        let path = self.cache_path();
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let snap: Snapshot =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if snap.prefix != self.prefix {
            return Err(format!(
                "{}: cached for prefix {:?}, not {:?}",
                path.display(),
                snap.prefix,
                self.prefix
            ));
        }
        Ok(snap)
    }

    fn set_applied(&self, gw: &Gateway, snap: Arc<Snapshot>, live: bool) {
        {
            let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
            st.source_state = Some(if live { "live" } else { "cached" });
            st.revision = Some(snap.revision);
            st.config_hash = Some(snap.hash());
            st.gateway_id = Some(self.id.clone());
            if live {
                st.store_error = None;
            }
        }
        if live {
            self.write_cache(&snap);
        }
        *self.applied.lock().unwrap_or_else(|e| e.into_inner()) = Some(snap);
        self.changed.notify_one();
    }

    /// The store answered a watch from the serving snapshot's revision:
    /// live (a cached start caught up), no store error.
    fn mark_live(&self, gw: &Gateway) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.is_some() || st.source_state != Some("live") {
            if st.source_state == Some("cached") {
                tracing::info!(
                    revision = st.revision,
                    "etcd reached: the cached snapshot is current"
                );
            }
            st.store_error = None;
            st.source_state = Some("live");
            drop(st);
            self.changed.notify_one();
        }
    }

    fn set_store_error(&self, gw: &Gateway, e: &str) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.as_deref() != Some(e) {
            tracing::warn!(error = %e, "etcd: unreachable or failing; serving the last configuration");
        }
        st.store_error = Some(e.to_string());
    }

    /// Builds and applies `snap`; a rejected one leaves the old generation
    /// serving, its error in `/status` and the status key. Blocking.
    fn apply(&self, gw: &Gateway, snap: Snapshot) -> Result<u64, ConfigError> {
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

    /// The text and mod revision of `path` in the serving snapshot.
    pub fn document(&self, path: &Path) -> Result<(String, i64), EditError> {
        let snap = self
            .applied()
            .ok_or_else(|| EditError::Conflict("no snapshot applied yet".into()))?;
        let key = path.to_string_lossy();
        let kv = snap
            .kvs
            .get(key.as_ref())
            .ok_or_else(|| EditError::NotFound(format!("no key {key}")))?;
        let text = String::from_utf8(kv.value.clone())
            .map_err(|_| EditError::Conflict(format!("{key}: not valid UTF-8")))?;
        Ok((text, kv.mod_revision))
    }

    /// Writes `text` to `path`'s key if it still has `mod_revision`
    /// (compare-and-swap); a concurrent change → `Conflict` (409). Returns
    /// the revision written, once this gateway has applied it.
    pub async fn compare_and_put(
        &self,
        gw: &Gateway,
        path: &Path,
        text: &str,
        mod_revision: i64,
    ) -> Result<u64, EditError> {
        self.compare_and_swap(gw, path, Some(text), mod_revision)
            .await
    }

    /// Compare-and-swap on `path`'s mod revision: put `text` (keeping the
    /// key's lease, if any) or, with `None`, delete the key.
    pub async fn compare_and_swap(
        &self,
        gw: &Gateway,
        path: &Path,
        text: Option<&str>,
        mod_revision: i64,
    ) -> Result<u64, EditError> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let key = path.to_string_lossy().into_owned();
        let op = match text {
            Some(t) => {
                let leased = self
                    .applied()
                    .and_then(|s| s.kvs.get(&key).map(|_| ()))
                    .is_some()
                    && key.contains("/nodes/")
                    && key.starts_with(&format!("{}/services/", self.prefix));
                let opts = leased.then(|| PutOptions::new().with_ignore_lease());
                TxnOp::put(key.as_str(), t, opts)
            }
            None => TxnOp::delete(key.as_str(), None),
        };
        let mut c = self
            .client()
            .await
            .map_err(|e| EditError::Conflict(format!("etcd: {e}")))?;
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                mod_revision,
            )])
            .and_then(vec![op]);
        let resp = match tokio::time::timeout(self.timeout(), c.txn(txn)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.failed().await;
                return Err(EditError::Conflict(format!("etcd: {e}")));
            }
            Err(_) => {
                self.failed().await;
                return Err(EditError::Conflict("etcd: timed out".into()));
            }
        };
        if !resp.succeeded() {
            return Err(EditError::Conflict(format!(
                "{key} was changed since revision {mod_revision} (a concurrent edit); read it again"
            )));
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        self.wait_applied(gw, &key, rev)
            .await
            .map_err(EditError::Conflict)
    }

    /// Waits until this gateway applied revision `rev` (written to `key`),
    /// or rejected its build. Returns the generation serving.
    pub async fn wait_applied(&self, gw: &Gateway, key: &str, rev: i64) -> Result<u64, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if self.applied().is_some_and(|s| s.revision >= rev) {
                return Ok(gw.current().id);
            }
            if self.seen.load(Ordering::Acquire) >= rev {
                let e = gw
                    .status
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .last_reload_error
                    .clone()
                    .unwrap_or_default();
                return Err(format!(
                    "written to {key} at revision {rev}, but the build was rejected: {e}"
                ));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "written to {key} at revision {rev}, but not applied yet"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The revision an admin request says it read (`If-Match: <revision>`):
/// when given it must be the one this gateway serves, else 409.
fn check_if_match(src: &EtcdSource, if_match: Option<i64>) -> Result<(), EditError> {
    let serving = src.applied().map_or(0, |s| s.revision);
    match if_match {
        Some(r) if r != serving => Err(EditError::Conflict(format!(
            "you read revision {r}, this gateway serves revision {serving}: read again"
        ))),
        _ => Ok(()),
    }
}

/// An admin node edit when the source is etcd: the node document (the
/// `node_files` key defining the service) is edited as in the files case
/// and written back with compare-and-swap on the mod revision this
/// gateway's snapshot holds. A concurrent edit → 409, never a lost update.
pub async fn edit_node(
    gw: &Gateway,
    src: &EtcdSource,
    service: &str,
    change: crate::control::node_edit::NodeChange,
    if_match: Option<i64>,
) -> Result<serde_json::Value, EditError> {
    use crate::control::node_edit;
    check_if_match(src, if_match)?;
    // A registered instance: weight and drain (or removal) change its own
    // key, keeping its lease.
    if let node_edit::NodeChange::Update { node, .. } | node_edit::NodeChange::Remove(node) =
        &change
    {
        let key = PathBuf::from(registry::node_key(&src.prefix, service, node));
        if let Ok((text, rev)) = src.document(&key) {
            let new_text = match change {
                node_edit::NodeChange::Remove(_) => None,
                node_edit::NodeChange::Update {
                    lane,
                    weight,
                    drain,
                    ..
                } => {
                    if lane.is_some() {
                        return Err(EditError::Invalid(
                            "a registered instance's lane comes from its registration; register it again".into(),
                        ));
                    }
                    let mut inst: registry::Instance = serde_json::from_str(&text)
                        .map_err(|e| EditError::Conflict(format!("{}: {e}", key.display())))?;
                    if let Some(w) = weight {
                        inst.weight = w;
                    }
                    if let Some(d) = drain {
                        inst.drain = d;
                    }
                    Some(
                        serde_json::to_string(&inst)
                            .map_err(|e| EditError::Invalid(e.to_string()))?,
                    )
                }
                node_edit::NodeChange::Add(_) => unreachable!(),
            };
            let generation = src
                .compare_and_swap(gw, &key, new_text.as_deref(), rev)
                .await?;
            return Ok(serde_json::json!({
                "key": key,
                "generation": generation,
                "service": service,
                "revision": src.applied().map(|s| s.revision),
            }));
        }
    }
    let gen = gw.current();
    let root = node_edit::root_dir(&gen.config_path, &gen.config);
    let mut found = None;
    for p in &gen.config.node_files {
        let path = crate::config::resolve(&root, p);
        let (text, rev) = src.document(&path)?;
        let nf: crate::config::NodeFile =
            parse_yaml(&path, &text).map_err(|e| EditError::Conflict(e.to_string()))?;
        if nf.services.contains_key(service) {
            found = Some((path, text, rev));
            break;
        }
    }
    let (path, text, rev) = found.ok_or_else(|| {
        EditError::NotFound(format!(
            "no service {service:?} in any node document (registered instances change through their own keys)"
        ))
    })?;
    let new_text = node_edit::edit(&path, &text, service, change)?;
    let generation = src.compare_and_put(gw, &path, &new_text, rev).await?;
    Ok(serde_json::json!({
        "key": path,
        "generation": generation,
        "service": service,
        "revision": src.applied().map(|s| s.revision),
    }))
}

/// An admin rule edit when the source is etcd (compare-and-swap as above).
pub async fn edit_rules(
    gw: &Gateway,
    src: &EtcdSource,
    change: crate::control::rule_edit::RuleChange,
    if_match: Option<i64>,
) -> Result<serde_json::Value, EditError> {
    use crate::control::rule_edit;
    check_if_match(src, if_match)?;
    let gen = gw.current();
    let path = rule_edit::rules_file(&gen.config_path, &gen.config)?;
    let (text, rev) = src.document(&path)?;
    let new_text = rule_edit::apply(&path, &text, &change)?;
    rule_edit::validate(&path, &new_text, &gen.lane.lists)?;
    let generation = src.compare_and_put(gw, &path, &new_text, rev).await?;
    Ok(serde_json::json!({
        "key": path,
        "generation": generation,
        "revision": src.applied().map(|s| s.revision),
    }))
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
    let gw = Gateway::with_generation(gen, path, Some(src.clone()));
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

/// Keeps the gateway on the store's newest state: watch, debounce, re-read
/// at one revision, apply; reconnect with backoff across the endpoints.
/// Also publishes the gateway's status key. Runs until the process ends.
pub async fn run(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    tokio::spawn(publish_status(gw.clone(), src.clone()));
    tokio::spawn(sighup(gw.clone(), src.clone()));
    let debounce = Duration::from_millis(src.settings.debounce_ms);
    // Started from the cache (or live): the watch resumes after the
    // snapshot's revision, so no change made while this gateway was away is
    // missed (etcd replays them); a compaction past it → a full re-read.
    let mut need_full = false;
    // The newest revision seen (applied or rejected): the watch resumes after it.
    let mut seen = src.applied().map_or(0, |s| s.read_revision);
    let mut backoff = Duration::from_millis(100);
    loop {
        if need_full {
            match src.read_any(None).await {
                Ok(snap) => {
                    seen = snap.read_revision;
                    let (g, s) = (gw.clone(), src.clone());
                    let unchanged = src.applied().is_some_and(|a| a.kvs == snap.kvs);
                    if unchanged {
                        // Same content (e.g. after a broken watch): live again.
                        let mut snap = snap;
                        snap.revision = src.applied().map_or(snap.revision, |a| a.revision);
                        src.set_applied(&gw, Arc::new(snap), true);
                    } else {
                        let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap)).await;
                    }
                    need_full = false;
                    backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    src.set_store_error(&gw, &e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
            }
        }
        let mut client = match src.client().await {
            Ok(c) => c,
            Err(e) => {
                src.set_store_error(&gw, &e);
                src.failed().await;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(3));
                continue;
            }
        };
        let (start, end) = range(&src.prefix);
        let opts = WatchOptions::new()
            .with_range(end)
            .with_start_revision(seen + 1)
            .with_progress_notify();
        let mut stream =
            match tokio::time::timeout(src.timeout(), client.watch(start, Some(opts))).await {
                Ok(Ok(s)) => s,
                // No watch yet: try again from the same revision (nothing
                // is missed; a compaction meanwhile shows on the new watch).
                Ok(Err(e)) => {
                    src.set_store_error(&gw, &format!("watch: {e}"));
                    src.failed().await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
                Err(_) => {
                    src.set_store_error(&gw, "watch: timed out");
                    src.failed().await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
            };
        // The watch is established: etcd reachable.
        let mut pending: Option<i64> = None;
        loop {
            let msg = match pending {
                Some(_) => match tokio::time::timeout(debounce, stream.message()).await {
                    Ok(m) => m,
                    Err(_) => {
                        // Quiet: read at the last event's revision and apply.
                        let rev = pending.take().unwrap_or(seen);
                        match src.client().await {
                            Ok(mut c) => match read(&mut c, &src.prefix, Some(rev), src.timeout())
                                .await
                            {
                                Ok(snap) => {
                                    seen = rev;
                                    let (g, s) = (gw.clone(), src.clone());
                                    let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap))
                                        .await;
                                    continue;
                                }
                                Err(e) => {
                                    src.set_store_error(&gw, &e);
                                    src.failed().await;
                                    need_full = true;
                                    break;
                                }
                            },
                            Err(e) => {
                                src.set_store_error(&gw, &e);
                                need_full = true;
                                break;
                            }
                        }
                    }
                },
                None => stream.message().await,
            };
            match msg {
                Ok(Some(resp)) => {
                    if resp.compact_revision() > 0 || resp.canceled() {
                        tracing::warn!(
                            compact_revision = resp.compact_revision(),
                            reason = resp.cancel_reason(),
                            "etcd watch cancelled (compaction or leader loss); re-reading"
                        );
                        need_full = true;
                        break;
                    }
                    // The watch answers from the snapshot's revision on: the
                    // store is reached and nothing is missed.
                    src.mark_live(&gw);
                    for ev in resp.events() {
                        if let Some(kv) = ev.kv() {
                            let r = kv.mod_revision();
                            pending = Some(pending.map_or(r, |p| p.max(r)));
                        }
                    }
                }
                Ok(None) => {
                    src.set_store_error(&gw, "watch closed");
                    src.failed().await;
                    need_full = true;
                    break;
                }
                Err(e) => {
                    src.set_store_error(&gw, &format!("watch broken: {e}"));
                    src.failed().await;
                    need_full = true;
                    break;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(3));
    }
}

/// SIGHUP: a full re-read at the current revision (as a files gateway
/// reloads its files).
async fn sighup(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP; re-reading etcd");
        match src.read_any(None).await {
            Ok(snap) => {
                let (g, s) = (gw.clone(), src.clone());
                let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap)).await;
            }
            Err(e) => src.set_store_error(&gw, &e),
        }
    }
}

/// This gateway's status document (`<prefix>/status/<id>`).
pub fn status_doc(gw: &Gateway, src: &EtcdSource) -> serde_json::Value {
    let st = gw.source.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let reload = gw.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    serde_json::json!({
        "id": src.id,
        "revision": st.revision,
        "config_hash": st.config_hash,
        "last_error": reload.last_reload_error,
        "store_error": st.store_error,
        "source_state": st.source_state,
        "generation": gw.current().id,
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_secs": gw.started.elapsed().as_secs(),
        "updated_at": now,
        "listen": src.bootstrap.listen,
        "admin_listen": src.bootstrap.admin_listen,
    })
}

/// Keeps `<prefix>/status/<id>` current under a lease: written on every
/// change and every third of the TTL (keeping the lease alive).
async fn publish_status(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    let key = status_key(&src.prefix, &src.id);
    let ttl = src.settings.status_ttl_secs.max(2);
    let beat = Duration::from_millis(ttl as u64 * 1000 / 3);
    let mut lease: Option<i64> = None;
    loop {
        let doc = status_doc(&gw, &src).to_string();
        let res: Result<(), String> = async {
            let mut c = src.client().await?;
            let id = match lease {
                Some(id) => {
                    super::super::registry::keep_alive(&mut c, id).await?;
                    id
                }
                None => {
                    let id = c.lease_grant(ttl, None).await.map_err(err)?.id();
                    lease = Some(id);
                    id
                }
            };
            c.put(key.as_str(), doc, Some(PutOptions::new().with_lease(id)))
                .await
                .map_err(err)?;
            Ok(())
        }
        .await;
        let res = match res {
            Ok(()) => Ok(()),
            Err(e) => {
                lease = None;
                Err(e)
            }
        };
        if res.is_err() {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        tokio::select! {
            _ = src.changed.notified() => {}
            _ = tokio::time::sleep(beat) => {}
        }
    }
}

/// At a graceful stop: remove this gateway's status key (best effort; its
/// lease would expire it anyway).
pub async fn leave(src: &EtcdSource) {
    let key = status_key(&src.prefix, &src.id);
    if let Ok(mut c) = src.client().await {
        let _ = tokio::time::timeout(Duration::from_secs(1), c.delete(key, None)).await;
    }
}

/// Every gateway's status document under the prefix, and whether all run
/// the same revision and configuration.
pub async fn fleet(src: &EtcdSource) -> Result<serde_json::Value, String> {
    let mut c = src.client().await?;
    let prefix = format!("{}/status/", src.prefix);
    let resp = match tokio::time::timeout(
        src.timeout(),
        c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            src.failed().await;
            return Err(e.to_string());
        }
        Err(_) => {
            src.failed().await;
            return Err("etcd read timed out".into());
        }
    };
    let gateways: Vec<serde_json::Value> = resp
        .kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
        .collect();
    let revs: std::collections::BTreeSet<String> =
        gateways.iter().map(|g| g["revision"].to_string()).collect();
    // Who drives the releases (the leader key's holder).
    let leader_key = crate::control::release::fleet::leader_key(&src.prefix);
    let release_leader = match tokio::time::timeout(src.timeout(), c.get(leader_key, None)).await {
        Ok(Ok(r)) => r
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
        _ => None,
    };
    let hashes: std::collections::BTreeSet<String> = gateways
        .iter()
        .map(|g| g["config_hash"].to_string())
        .collect();
    Ok(serde_json::json!({
        "prefix": src.prefix,
        "gateways": gateways,
        "same_revision": revs.len() <= 1,
        "same_config": hashes.len() <= 1,
        "release_leader": release_leader,
        "revisions": revs.iter().filter_map(|r| r.parse::<i64>().ok()).collect::<Vec<_>>(),
    }))
}

/// `--check --etcd`: builds what is in etcd. Returns the revision.
pub async fn check(endpoints: &str, prefix: &str) -> Result<(i64, Vec<String>), String> {
    let prefix = norm_prefix(prefix);
    let mut last = String::from("no endpoint");
    let mut snap = None;
    for ep in endpoints.split(',') {
        let res = async {
            let mut c = connect(ep, Duration::from_secs(3)).await?;
            read(&mut c, &prefix, None, Duration::from_secs(5)).await
        };
        match res.await {
            Ok(s) => {
                snap = Some(s);
                break;
            }
            Err(e) => last = format!("{ep}: {e}"),
        }
    }
    let snap = snap.ok_or(last)?;
    let gen = build(&snap, None, Path::new("."), 0).map_err(err)?;
    Ok((snap.revision, gen.warnings))
}

/// `push`: the documents of a files configuration that `--check` accepts,
/// as keys (main file → `config/main.yaml`, every other file by its path
/// relative to the root).
pub fn documents_of_files(config: &Path) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let config = std::path::absolute(config).unwrap_or(config.to_path_buf());
    let gen = Generation::load(&config, 0).map_err(err)?;
    let root = crate::control::node_edit::root_dir(&config, &gen.config);
    let mut docs = BTreeMap::new();
    docs.insert(
        "main.yaml".to_string(),
        std::fs::read(&config).map_err(|e| format!("{}: {e}", config.display()))?,
    );
    // The release state is each gateway's own local file, not configuration.
    let release_state = crate::control::release::state_path(&config, &gen.config);
    for f in &gen.files {
        if *f == config || *f == release_state {
            continue;
        }
        let rel = f.strip_prefix(&root).map_err(|_| {
            format!(
                "{}: outside the configuration's root {} (etcd keys are relative paths)",
                f.display(),
                root.display()
            )
        })?;
        let rel = rel.to_string_lossy().into_owned();
        if rel == "main.yaml" {
            return Err(format!(
                "{}: the name main.yaml is taken by the main settings",
                f.display()
            ));
        }
        docs.insert(
            rel,
            std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?,
        );
    }
    Ok(docs)
}

/// Uploads `docs` (relative path → bytes) under `<prefix>/config/` in one
/// transaction: changed keys put, keys no longer present deleted, guarded
/// by the revisions read (a concurrent push fails instead of mixing).
/// Returns the revision written.
pub async fn push(
    endpoint: &str,
    prefix: &str,
    docs: &BTreeMap<String, Vec<u8>>,
) -> Result<i64, String> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let prefix = norm_prefix(prefix);
    let base = format!("{prefix}/config/");
    let mut c = connect(endpoint, Duration::from_secs(3)).await?;
    let t = Duration::from_secs(10);
    let cur = tokio::time::timeout(
        t,
        c.get(base.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| "etcd read timed out".to_string())?
    .map_err(err)?;
    let mut compares = Vec::new();
    let mut ops = Vec::new();
    let mut existing = BTreeMap::new();
    for kv in cur.kvs() {
        let k = String::from_utf8_lossy(kv.key()).into_owned();
        compares.push(Compare::mod_revision(
            k.as_str(),
            CompareOp::Equal,
            kv.mod_revision(),
        ));
        existing.insert(k, kv.value().to_vec());
    }
    for (rel, v) in docs {
        let k = format!("{base}{rel}");
        if existing.get(&k) != Some(v) {
            if !existing.contains_key(&k) {
                compares.push(Compare::create_revision(k.as_str(), CompareOp::Equal, 0));
            }
            ops.push(TxnOp::put(k, v.clone(), None));
        }
    }
    for k in existing.keys() {
        if !docs.contains_key(&k[base.len()..]) {
            ops.push(TxnOp::delete(k.as_str(), None));
        }
    }
    if ops.is_empty() {
        return Ok(cur.header().map_or(0, |h| h.revision()));
    }
    let resp = tokio::time::timeout(t, c.txn(Txn::new().when(compares).and_then(ops)))
        .await
        .map_err(|_| "etcd transaction timed out".to_string())?
        .map_err(err)?;
    if !resp.succeeded() {
        return Err("the configuration in etcd changed while pushing; push again".into());
    }
    Ok(resp.header().map_or(0, |h| h.revision()))
}

/// `pull`: writes every `<prefix>/config/` key to `dir/<path>`. Returns
/// the revision and the files written.
pub async fn pull(endpoint: &str, prefix: &str, dir: &Path) -> Result<(i64, Vec<PathBuf>), String> {
    let prefix = norm_prefix(prefix);
    let base = format!("{prefix}/config/");
    let mut c = connect(endpoint, Duration::from_secs(3)).await?;
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        c.get(base.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| "etcd read timed out".to_string())?
    .map_err(err)?;
    let mut written = Vec::new();
    for kv in resp.kvs() {
        let k = String::from_utf8_lossy(kv.key()).into_owned();
        let rel = &k[base.len()..];
        if rel.is_empty()
            || rel.starts_with('/')
            || rel
                .split('/')
                .any(|s| s == ".." || s == "." || s.is_empty())
        {
            return Err(format!("{k}: not a relative path; refusing to write it"));
        }
        let path = dir.join(rel);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(&path, kv.value()).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    Ok((resp.header().map_or(0, |h| h.revision()), written))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(kvs: &[(&str, &str)]) -> Snapshot {
        Snapshot {
            prefix: "/g".into(),
            read_revision: 9,
            revision: 9,
            kvs: kvs
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Kv {
                            value: v.as_bytes().to_vec(),
                            mod_revision: 1,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn errors_name_the_key_and_the_line_inside_it() {
        let s = snap(&[
            (
                "/g/config/main.yaml",
                "listen: 1.2.3.4:5\nnode_files: [nodes.yaml]\n",
            ),
            (
                "/g/config/nodes.yaml",
                "services:\n  api:\n    nodes:\n      - { addr: nope }\n",
            ),
        ]);
        let e = build(&s, None, Path::new("."), 1).unwrap_err();
        assert!(e.to_string().starts_with("/g/config/nodes.yaml:4:"), "{e}");
    }

    #[test]
    fn bootstrap_addresses_replace_the_stores_and_keep_line_numbers() {
        let boot: Bootstrap = serde_yaml::from_str(
            "listen: 127.0.0.1:7000\netcd: { endpoints: [x], prefix: /g, cache_dir: c }\n",
        )
        .unwrap();
        let s = snap(&[(
            "/g/config/main.yaml",
            "listen: 1.2.3.4:5\nroot: /elsewhere\nroutes:\n  - { prefix: nope, service: x }\n",
        )]);
        let e = build(&s, Some(&boot), Path::new("."), 1).unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        let ok = snap(&[("/g/config/main.yaml", "listen: 1.2.3.4:5\n")]);
        let g = build(&ok, Some(&boot), Path::new("."), 1).unwrap();
        assert_eq!(g.config.listen.to_string(), "127.0.0.1:7000");
        assert!(snap(&[]).hash() != ok.hash());
    }
}
