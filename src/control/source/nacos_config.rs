//! Layer: control plane. The Nacos config source (`nacos.config` in a
//! bootstrap file): the main settings are one data id of one group, and
//! every document they name (node files, IP lists, rules files, scripts
//! and their modules, certificates) is the data id of its relative path in
//! the same group. A snapshot is the content of every data id the main
//! settings reach ([`read_set`]: a build tells which documents it reads);
//! each of them (and each named one not there yet) is listened to with the
//! official client (`nacos-sdk`, Nacos 2.x gRPC), so a change is pushed,
//! validated whole and swapped in by `Gateway::install`; a rejected one
//! leaves the old configuration serving, its error (`nacos:<group>/<data
//! id>:<line>`) in `/status`. Every applied snapshot is written atomically
//! to `<cache_dir>/graygate-config.json`; a gateway that cannot reach Nacos
//! at start serves it (`source_state: cached`) and catches up when Nacos
//! returns. Release state stays on the gateway's disk, as with files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nacos_sdk::api::config::{
    ConfigChangeListener, ConfigResponse, ConfigService, ConfigServiceBuilder,
};
use nacos_sdk::api::props::ClientProps;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::config::docs::Docs;
use crate::config::nacos::{NacosBootstrap, NacosConfig};
use crate::config::{resolve, ConfigError};
use crate::control::Gateway;
use crate::generation::Generation;

/// How often the connection is checked (one small request).
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Quiet time after a push before rebuilding (data ids published together
/// make one build).
const DEBOUNCE: Duration = Duration::from_millis(20);
/// How long after a listener starts its data id is read again.
const VERIFY_AFTER: Duration = Duration::from_millis(100);
/// How often every listened data id is read again, in case a push was
/// lost: the Nacos client re-registers its listens only every 60 s after
/// it reconnects to another cluster member, and pushes in between go
/// nowhere. One small read per data id.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// The most documents one configuration may name (a bound on [`read_set`]).
const MAX_DOCS: usize = 512;

/// Where the documents are: servers, namespace, group, main data id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub settings: NacosConfig,
    pub group: String,
    pub data_id: String,
}

impl Place {
    /// The place a bootstrap's `nacos:` names.
    pub fn of(settings: &NacosConfig) -> Place {
        let c = settings.config.clone().unwrap_or_default();
        Place {
            settings: settings.clone(),
            group: c.group,
            data_id: c.data_id,
        }
    }

    /// The virtual directory documents are named under in a build (what
    /// errors show: `nacos:<group>/<data id>:<line>`).
    pub fn root(&self) -> PathBuf {
        PathBuf::from(format!("nacos:{}", self.group))
    }

    /// What `--check` and the logs call it.
    pub fn name(&self) -> String {
        format!(
            "nacos {} namespace {} group {} data id {}",
            self.settings.server_addr, self.settings.namespace, self.group, self.data_id
        )
    }
}

/// The content of every data id one configuration reads, at one moment.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snap {
    pub namespace: String,
    pub group: String,
    /// The main settings' data id.
    pub main: String,
    /// Data id → content.
    pub docs: BTreeMap<String, String>,
}

impl Snap {
    /// SHA-256 over the data ids and their content.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (k, v) in &self.docs {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(v.as_bytes());
            h.update([0]);
        }
        hex::encode(h.finalize())
    }

    /// Writes the snapshot to `path` atomically; a failure is logged, the
    /// gateway serves on.
    fn save(&self, path: &Path) {
        crate::control::source::save_snapshot(path, self);
    }

    /// The snapshot cached at `path`, if written for this place.
    fn load(path: &Path, place: &Place) -> Result<Snap, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let snap: Snap =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if snap.namespace != place.settings.namespace
            || snap.group != place.group
            || snap.main != place.data_id
        {
            return Err(format!(
                "{}: cached for namespace {} group {} data id {}, not this bootstrap's",
                path.display(),
                snap.namespace,
                snap.group,
                snap.main
            ));
        }
        Ok(snap)
    }
}

/// One snapshot seen as the documents of a build; the data ids a build
/// asked for and the snapshot lacks are recorded (so [`read_set`] fetches
/// them).
struct SnapDocs<'a> {
    snap: &'a Snap,
    root: PathBuf,
    main: Vec<u8>,
    local_root: PathBuf,
    missing: Mutex<BTreeSet<String>>,
    /// Every data id the build asked for (found or not).
    read: Mutex<BTreeSet<String>>,
}

impl SnapDocs<'_> {
    fn data_id(&self, path: &Path) -> Option<String> {
        let rel = path.strip_prefix(&self.root).ok()?;
        let parts: Vec<&str> = rel.iter().filter_map(|p| p.to_str()).collect();
        (!parts.is_empty()).then(|| parts.join(":"))
    }
}

impl Docs for SnapDocs<'_> {
    fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, ConfigError> {
        let Some(id) = self.data_id(path) else {
            return Err(ConfigError::new(
                path,
                None,
                format!(
                    "cannot read: not a data id of group {} (name documents by a relative path)",
                    self.snap.group
                ),
            ));
        };
        if id == self.snap.main {
            return Ok(self.main.clone());
        }
        self.read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone());
        match self.snap.docs.get(&id) {
            Some(v) => Ok(v.clone().into_bytes()),
            None => {
                self.missing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.clone());
                Err(ConfigError::new(
                    path,
                    None,
                    format!(
                        "cannot read: no data id {id:?} in Nacos config (group {}, namespace {})",
                        self.snap.group, self.snap.namespace
                    ),
                ))
            }
        }
    }

    fn local_root(&self) -> Option<&Path> {
        Some(&self.local_root)
    }
}

/// The data id of a document's relative path: Nacos data ids have no `/`,
/// so each `/` is a `:` (`nodes/api.yaml` → `nodes:api.yaml`).
pub fn data_id_of(rel: &str) -> String {
    rel.trim_start_matches("./").replace('/', ":")
}

/// An error of a build named as the operator finds it in Nacos:
/// `nacos:<group>/<data id>`.
fn name_data_id(mut e: ConfigError, root: &Path) -> ConfigError {
    if let Ok(rel) = e.file.strip_prefix(root) {
        let parts: Vec<&str> = rel.iter().filter_map(|p| p.to_str()).collect();
        if !parts.is_empty() {
            e.file = root.join(parts.join(":"));
        }
    }
    e
}

/// The main settings as a build sees them: the per-gateway keys (`listen`,
/// `admin_listen`, `root`) and the `nacos:` section blanked line for line
/// (so every other line keeps its number), the bootstrap's addresses and
/// `nacos:` (without `config:`) appended.
fn main_text(text: &str, boot: Option<&NacosBootstrap>) -> String {
    let addrs = boot.map(|b| (b.listen, b.admin_listen));
    let (mut out, had_nacos) = crate::control::source::store_main_text(text, addrs, Some("nacos:"));
    match boot {
        Some(b) => out.push_str(&format!("nacos: {}\n", b.nacos_json)),
        // Checked without a bootstrap (`--check --nacos`, `pull`): a
        // service no node file defines is a Nacos service (checked as
        // empty, as `--check` of files does).
        None if !had_nacos => {
            out.push_str("nacos: { server_addr: \"127.0.0.1:8848\", discovery: {} }\n")
        }
        None => {}
    }
    out
}

/// Builds a generation from a snapshot; the data ids the build asked for
/// and the snapshot lacks come back too.
pub fn build(
    snap: &Snap,
    boot: Option<&NacosBootstrap>,
    local_root: &Path,
    id: u64,
) -> (Result<Generation, ConfigError>, BTreeSet<String>) {
    let (res, missing, _) = build_reading(snap, boot, local_root, id);
    (res, missing)
}

/// [`build`], with every data id the build read (the ones the
/// configuration names now).
fn build_reading(
    snap: &Snap,
    boot: Option<&NacosBootstrap>,
    local_root: &Path,
    id: u64,
) -> (
    Result<Generation, ConfigError>,
    BTreeSet<String>,
    BTreeSet<String>,
) {
    let root = PathBuf::from(format!("nacos:{}", snap.group));
    let main_path = root.join(&snap.main);
    let Some(main) = snap.docs.get(&snap.main) else {
        let e = ConfigError::new(
            &main_path,
            None,
            format!(
                "no main settings in Nacos config (data id {}, group {}, namespace {}): publish them first (graygate push --nacos …)",
                snap.main, snap.group, snap.namespace
            ),
        );
        return (Err(e), BTreeSet::new(), BTreeSet::new());
    };
    let docs = SnapDocs {
        snap,
        main: main_text(main, boot).into_bytes(),
        root,
        local_root: local_root.to_path_buf(),
        missing: Mutex::new(BTreeSet::new()),
        read: Mutex::new(BTreeSet::new()),
    };
    let res = Generation::build(&docs, &main_path, Vec::new(), id)
        .map_err(|e| name_data_id(e, &docs.root));
    let missing = docs.missing.into_inner().unwrap_or_else(|e| e.into_inner());
    let read = docs.read.into_inner().unwrap_or_else(|e| e.into_inner());
    (res, missing, read)
}

/// A client of the config service for `settings` (bounded: the first
/// connection is given at least 5 s).
pub async fn connect(
    settings: &NacosConfig,
    cache_dir: Option<&Path>,
) -> Result<ConfigService, String> {
    let mut props = ClientProps::new()
        .server_addr(settings.server_addr.clone())
        .namespace(settings.namespace.clone())
        .app_name("graygate")
        .env_first(false);
    if let Some(p) = settings.grpc_port {
        props = props.remote_grpc_port(p);
    }
    if let Some(d) = cache_dir {
        // The client's own copy (never read at start: the gateway's
        // snapshot is what a start during an outage serves); its
        // directory made first (the client does not).
        let _ = std::fs::create_dir_all(d.join("config").join(&settings.namespace));
        props = props.cache_dir(d.to_path_buf());
    }
    let mut builder = ConfigServiceBuilder::new(match (&settings.username, &settings.password) {
        (Some(u), Some(p)) => props.auth_username(u.clone()).auth_password(p.clone()),
        _ => props,
    });
    if settings.username.is_some() {
        builder = builder.enable_auth_plugin_http();
    }
    let timeout = Duration::from_millis(settings.timeout_ms.max(5_000));
    match tokio::time::timeout(timeout, builder.build()).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
    }
}

/// One data id's content: `Ok(None)` when Nacos has no such data id.
pub async fn get(
    client: &ConfigService,
    group: &str,
    data_id: &str,
    timeout: Duration,
) -> Result<Option<String>, String> {
    let ask = client.get_config(data_id.to_string(), group.to_string());
    match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(r)) => Ok(Some(r.content().clone())),
        Ok(Err(nacos_sdk::api::error::Error::ConfigNotFound(_))) => Ok(None),
        Ok(Err(e)) => Err(format!("data id {data_id}: {e}")),
        Err(_) => Err(format!(
            "data id {data_id}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}

/// Completes `snap` with every data id its build reads (fetching what it
/// lacks, again until a build asks for nothing new) and drops the data ids
/// it no longer reads (named again later, they are read fresh); the data
/// ids named but absent from Nacos are returned (the build's error names
/// them).
pub async fn complete(
    client: &ConfigService,
    snap: &mut Snap,
    boot: Option<&NacosBootstrap>,
    local_root: &Path,
    timeout: Duration,
) -> Result<BTreeSet<String>, String> {
    let mut absent = BTreeSet::new();
    if !snap.docs.contains_key(&snap.main) {
        match get(client, &snap.group, &snap.main, timeout).await? {
            Some(v) => {
                snap.docs.insert(snap.main.clone(), v);
            }
            None => {
                absent.insert(snap.main.clone());
                return Ok(absent);
            }
        }
    }
    for _ in 0..MAX_DOCS {
        let (_, missing, read) = build_reading(snap, boot, local_root, 0);
        let new: Vec<String> = missing.difference(&absent).cloned().collect();
        if new.is_empty() {
            let main = snap.main.clone();
            snap.docs.retain(|id, _| *id == main || read.contains(id));
            return Ok(absent);
        }
        for id in new {
            match get(client, &snap.group, &id, timeout).await? {
                Some(v) => {
                    snap.docs.insert(id, v);
                }
                None => {
                    absent.insert(id);
                }
            }
        }
    }
    Err(format!("more than {MAX_DOCS} documents named"))
}

/// Reads the main settings and every document they name, fresh.
pub async fn read_set(
    client: &ConfigService,
    place: &Place,
    boot: Option<&NacosBootstrap>,
    local_root: &Path,
) -> Result<(Snap, BTreeSet<String>), String> {
    let mut snap = Snap {
        namespace: place.settings.namespace.clone(),
        group: place.group.clone(),
        main: place.data_id.clone(),
        docs: BTreeMap::new(),
    };
    let timeout = Duration::from_millis(place.settings.timeout_ms.max(100));
    let absent = complete(client, &mut snap, boot, local_root, timeout).await?;
    Ok((snap, absent))
}

/// A push: the data id and its new content (empty: deleted).
type Push = (String, String);

struct Listener {
    tx: mpsc::UnboundedSender<Push>,
}

impl ConfigChangeListener for Listener {
    fn notify(&self, r: ConfigResponse) {
        let _ = self.tx.send((r.data_id().clone(), r.content().clone()));
    }
}

/// The running Nacos config source of one gateway.
pub struct NacosConfigSource {
    pub boot: NacosBootstrap,
    pub place: Place,
    /// The bootstrap file's directory (static trees, cache_dir, release
    /// state, access log).
    pub dir: PathBuf,
    /// The snapshot serving now.
    applied: Mutex<Option<Arc<Snap>>>,
    /// The newest content of every data id known (a rejected change
    /// included: the next push builds on it).
    latest: Mutex<Snap>,
    /// Named data ids Nacos does not have (listened to: their creation is
    /// pushed).
    absent: Mutex<BTreeSet<String>>,
    /// SIGHUP: read every data id again from the server.
    reread: tokio::sync::Notify,
    /// The client admin edits publish with (`nacos_edit`).
    pub(super) writer: tokio::sync::Mutex<Option<ConfigService>>,
}

impl NacosConfigSource {
    fn new(boot: NacosBootstrap, path: &Path) -> NacosConfigSource {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let place = Place::of(&boot.nacos);
        NacosConfigSource {
            boot,
            place,
            dir,
            applied: Mutex::new(None),
            latest: Mutex::new(Snap::default()),
            absent: Mutex::new(BTreeSet::new()),
            reread: tokio::sync::Notify::new(),
            writer: tokio::sync::Mutex::new(None),
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.boot.nacos.timeout_ms.max(100))
    }

    /// `<cache_dir>/graygate-config.json`, when `nacos.cache_dir` is set.
    pub fn cache_path(&self) -> Option<PathBuf> {
        self.boot
            .nacos
            .cache_dir
            .as_ref()
            .map(|c| resolve(&self.dir, c).join("graygate-config.json"))
    }

    /// `<cache_dir>/sdk`: the client's own copy of what it was pushed.
    fn sdk_cache(&self) -> Option<PathBuf> {
        self.boot
            .nacos
            .cache_dir
            .as_ref()
            .map(|c| resolve(&self.dir, c).join("sdk"))
    }

    fn build(&self, snap: &Snap, id: u64) -> Result<Generation, ConfigError> {
        build(snap, Some(&self.boot), &self.dir, id).0
    }

    /// Whether the newest content known of data id `id` is `text`.
    pub(super) fn latest_has(&self, id: &str, text: &str) -> bool {
        self.latest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .docs
            .get(id)
            .is_some_and(|t| t == text)
    }

    pub(super) fn applied(&self) -> Option<Arc<Snap>> {
        self.applied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_latest(&self, snap: &Snap, absent: BTreeSet<String>) {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = snap.clone();
        *self.absent.lock().unwrap_or_else(|e| e.into_inner()) = absent;
    }

    /// The data ids to listen to: every one known, and the named absent.
    fn listened(&self) -> BTreeSet<String> {
        let mut ids: BTreeSet<String> = self
            .latest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .docs
            .keys()
            .cloned()
            .collect();
        ids.insert(self.place.data_id.clone());
        ids.extend(
            self.absent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned(),
        );
        ids
    }

    fn set_applied(&self, gw: &Gateway, snap: Arc<Snap>, live: bool) {
        if live {
            if let Some(p) = self.cache_path() {
                snap.save(&p);
            }
        }
        {
            let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
            st.source_state = Some(if live { "live" } else { "cached" });
            st.config_hash = Some(snap.hash());
            if live {
                st.store_error = None;
            }
        }
        *self.applied.lock().unwrap_or_else(|e| e.into_inner()) = Some(snap);
    }

    fn set_store_error(&self, gw: &Gateway, e: &str) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.as_deref() != Some(e) {
            tracing::warn!(error = %e, "nacos config: unreachable or failing; serving the last configuration");
        }
        st.store_error = Some(e.to_string());
        if st.source_state == Some("live") {
            st.source_state = Some("stale");
        }
    }

    /// `/status` `listening`: the data ids listened to now.
    fn set_listening(&self, gw: &Gateway, ids: &BTreeSet<String>) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st
            .listening
            .as_ref()
            .is_none_or(|l| !l.iter().eq(ids.iter()))
        {
            st.listening = Some(ids.iter().cloned().collect());
        }
    }

    fn mark_live(&self, gw: &Gateway) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.is_some() {
            tracing::info!("nacos config: reached again");
        }
        st.store_error = None;
        if st.source_state == Some("stale") {
            st.source_state = Some("live");
        }
    }

    fn state(&self, gw: &Gateway) -> Option<&'static str> {
        gw.source
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .source_state
    }

    /// Builds and applies `snap` (if it differs from the serving one); a
    /// rejected one leaves the old generation serving, its error in
    /// `/status`. Blocking.
    fn apply(&self, gw: &Gateway, snap: Snap) -> Result<u64, ConfigError> {
        self.apply_as(gw, snap, false)
    }

    /// [`Self::apply`]; `always`: built even if it is the serving snapshot
    /// (SIGHUP: documents on disk, certificates, may have changed).
    fn apply_as(&self, gw: &Gateway, snap: Snap, always: bool) -> Result<u64, ConfigError> {
        if !always && self.applied().is_some_and(|a| *a == snap) {
            self.set_applied(gw, Arc::new(snap), true);
            return Ok(gw.current().id);
        }
        let res = gw.install(|id| self.build(&snap, id));
        if res.is_ok() {
            self.set_applied(gw, Arc::new(snap), true);
        }
        res
    }

    /// Rebuilds the serving snapshot (a discovery push, SIGHUP, a release
    /// step). Blocking.
    pub fn rebuild_current(&self, gw: &Gateway) -> Result<u64, ConfigError> {
        let snap = self
            .applied()
            .ok_or_else(|| ConfigError::new(self.place.root(), None, "no snapshot applied yet"))?;
        gw.install(|id| self.build(&snap, id))
    }
}

/// Starts a gateway from a Nacos bootstrap file: generation 1 from Nacos
/// config, or from the last-known-good snapshot when Nacos cannot be read;
/// with neither, an error (never an empty configuration).
pub async fn start(
    bootstrap_path: &Path,
) -> Result<(Arc<Gateway>, Arc<NacosConfigSource>), String> {
    let path = std::path::absolute(bootstrap_path).unwrap_or(bootstrap_path.to_path_buf());
    let text = crate::config::read_file(&path).map_err(|e| e.to_string())?;
    let boot = NacosBootstrap::parse(&path, &text).map_err(|e| e.to_string())?;
    boot.nacos
        .check()
        .map_err(|(_, m)| format!("{}: {m}", path.display()))?;
    let src = Arc::new(NacosConfigSource::new(boot, &path));
    let read = match connect(&src.boot.nacos, src.sdk_cache().as_deref()).await {
        Ok(client) => read_set(&client, &src.place, Some(&src.boot), &src.dir).await,
        Err(e) => Err(e),
    };
    let (snap, gen, live, first_error) = match read {
        Ok((snap, absent)) => {
            src.set_latest(&snap, absent);
            match src.build(&snap, 1) {
                Ok(gen) => (Some(snap), Some(gen), true, None),
                Err(e) => (None, None, true, Some(e.to_string())),
            }
        }
        Err(e) => (None, None, false, Some(format!("nacos unreachable: {e}"))),
    };
    let (snap, gen, live) = match (snap, gen) {
        (Some(s), Some(g)) => (s, g, live),
        _ => {
            let why = first_error.clone().unwrap_or_default();
            let cache = src
                .cache_path()
                .ok_or_else(|| format!("{why}; and no cache (nacos.cache_dir is not set)"))?;
            let cached = Snap::load(&cache, &src.place)
                .map_err(|e| format!("{why}; and no usable cached snapshot: {e}"))?;
            let gen = src
                .build(&cached, 1)
                .map_err(|e| format!("{why}; and the cached snapshot does not build: {e}"))?;
            tracing::warn!(file = %cache.display(), "{why}: serving the cached snapshot");
            if !live {
                src.set_latest(&cached, BTreeSet::new());
            }
            (cached, gen, false)
        }
    };
    let gw = Gateway::with_generation(gen, path, Some(super::Store::Nacos(src.clone())));
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

/// Keeps `gw` on the newest documents in Nacos config: listens to every
/// data id the configuration reads (and stops listening to those it no
/// longer names), applies each push (debounced), reads every listened
/// data id again every [`SWEEP_EVERY`] (a push lost), checks the connection,
/// catches a cached start up; at SIGHUP reads every data id afresh from
/// the server through the client admin edits use (it listens to none, so
/// it never answers from a cache, and its connection is not the one
/// pushes come on) and builds again. No client is replaced: the client
/// library has no way to close one, so a new one would leave the old
/// connection open. Runs until the process ends.
pub async fn run(gw: Arc<Gateway>, src: Arc<NacosConfigSource>) {
    tokio::spawn(sighup(src.clone()));
    let mut reread = false;
    let (tx, mut rx) = mpsc::unbounded_channel::<Push>();
    // Two clients: one listens; the other reads (the listening one
    // answers listened data ids from its own cache).
    let mut client: Option<(ConfigService, ConfigService)> = None;
    // Data ids listened to since the last check: their content is read
    // again on the next tick (a change published between the read and
    // the listener's start is never pushed).
    let mut verify: BTreeSet<String> = BTreeSet::new();
    let mut listening: BTreeSet<String> = BTreeSet::new();
    let mut swept = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut retry_at = Instant::now();
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let listener = Arc::new(Listener { tx });
    loop {
        let mut pushes = Vec::new();
        tokio::select! {
            got = rx.recv() => {
                let Some(p) = got else { return };
                pushes.push(p);
                while let Ok(Some(p)) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {
                    pushes.push(p);
                }
            }
            _ = tick.tick() => {}
            _ = src.reread.notified() => {
                reread = true;
                retry_at = Instant::now();
            }
        }
        if client.is_none() {
            if Instant::now() < retry_at {
                continue;
            }
            let both = match connect(&src.boot.nacos, src.sdk_cache().as_deref()).await {
                Ok(l) => connect(&src.boot.nacos, None).await.map(|r| (l, r)),
                Err(e) => Err(e),
            };
            match both {
                Ok(c) => {
                    backoff = Duration::from_millis(200);
                    client = Some(c);
                    listening.clear();
                }
                Err(e) => {
                    src.set_store_error(&gw, &e);
                    retry_at = Instant::now() + backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    if std::mem::take(&mut reread) {
                        // SIGHUP while Nacos is unreachable: what is
                        // served built again (documents on disk).
                        tracing::warn!(error = %e, "SIGHUP: Nacos config unreachable; rebuilding what is served");
                        let g = gw.clone();
                        let _ = tokio::task::spawn_blocking(move || g.reload()).await;
                    }
                    continue;
                }
            }
        }
        let (c, reader) = client.as_ref().expect("connected above");
        let timeout = src.timeout();
        if std::mem::take(&mut reread) {
            let read = match src.writer().await {
                Ok(w) => read_set(&w, &src.place, Some(&src.boot), &src.dir).await,
                Err(e) => Err(e.to_string()),
            };
            match read {
                Ok((snap, absent)) => {
                    tracing::info!(
                        data_ids = snap.docs.len(),
                        "SIGHUP: Nacos config read again"
                    );
                    src.set_latest(&snap, absent);
                    src.mark_live(&gw);
                    let (g, s) = (gw.clone(), src.clone());
                    let _ = tokio::task::spawn_blocking(move || s.apply_as(&g, snap, true)).await;
                }
                Err(e) => {
                    src.set_store_error(&gw, &e);
                    let g = gw.clone();
                    let _ = tokio::task::spawn_blocking(move || g.reload()).await;
                }
            }
        }
        if !pushes.is_empty() {
            let mut snap = src.latest.lock().unwrap_or_else(|e| e.into_inner()).clone();
            for (id, content) in pushes {
                tracing::info!(data_id = %id, "Nacos pushed a change");
                if content.is_empty() {
                    snap.docs.remove(&id);
                } else {
                    snap.docs.insert(id, content);
                }
            }
            apply_latest(&gw, &src, reader, snap, timeout).await;
        } else {
            // The connection: a data id nobody listens to is asked of the
            // server (the client answers listened ones from its cache).
            let probe = get(
                reader,
                &src.place.group,
                "graygate.connection-check",
                timeout,
            )
            .await;
            match probe {
                Ok(_) => {
                    if src.state(&gw) == Some("cached") {
                        match read_set(reader, &src.place, Some(&src.boot), &src.dir).await {
                            Ok((snap, _)) => {
                                tracing::info!("nacos config reached: catching up");
                                apply_latest(&gw, &src, reader, snap, timeout).await;
                                if src.state(&gw) == Some("cached") {
                                    // Rejected: the cache keeps serving,
                                    // but Nacos answers.
                                    let mut st =
                                        gw.source.lock().unwrap_or_else(|e| e.into_inner());
                                    st.source_state = Some("live");
                                    st.store_error = None;
                                }
                            }
                            Err(e) => src.set_store_error(&gw, &e),
                        }
                    } else {
                        src.mark_live(&gw);
                    }
                    if swept.elapsed() >= SWEEP_EVERY {
                        swept = Instant::now();
                        verify.extend(listening.iter().cloned());
                    }
                    for id in std::mem::take(&mut verify) {
                        let known = src
                            .latest
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .docs
                            .get(&id)
                            .cloned();
                        match get(reader, &src.place.group, &id, timeout).await {
                            Ok(now) if now != known => {
                                let _ = listener.tx.send((id, now.unwrap_or_default()));
                            }
                            Ok(_) => {}
                            Err(_) => {
                                verify.insert(id);
                            }
                        }
                    }
                }
                Err(e) => src.set_store_error(&gw, &e),
            }
        }
        // Stop listening to the data ids the configuration no longer
        // names, then listen to every one it reads.
        let named = src.listened();
        for id in listening.difference(&named).cloned().collect::<Vec<_>>() {
            let remove = c.remove_listener(id.clone(), src.place.group.clone(), listener.clone());
            match tokio::time::timeout(timeout, remove).await {
                Ok(Ok(())) => {
                    tracing::info!(data_id = %id, group = %src.place.group, "no longer named: not listened to");
                    listening.remove(&id);
                    verify.remove(&id);
                }
                Ok(Err(e)) => src.set_store_error(&gw, &format!("stop listening {id}: {e}")),
                Err(_) => src.set_store_error(&gw, &format!("stop listening {id}: no answer")),
            }
        }
        src.set_listening(&gw, &listening);
        for id in named {
            if listening.contains(&id) {
                continue;
            }
            let add = c.add_listener(id.clone(), src.place.group.clone(), listener.clone());
            match tokio::time::timeout(timeout, add).await {
                Ok(Ok(())) => {
                    tracing::info!(data_id = %id, group = %src.place.group, "listening in Nacos config");
                    listening.insert(id.clone());
                    verify.insert(id);
                    src.set_listening(&gw, &listening);
                }
                Ok(Err(e)) => src.set_store_error(&gw, &format!("listen {id}: {e}")),
                Err(_) => src.set_store_error(&gw, &format!("listen {id}: no answer")),
            }
        }
        if !verify.is_empty() {
            // Soon, not on the next second: the listeners are registered
            // by then.
            tick.reset_after(VERIFY_AFTER);
        }
    }
}

/// Completes `snap` with any newly named data id, records it as the newest
/// state and applies it (on the blocking pool).
async fn apply_latest(
    gw: &Arc<Gateway>,
    src: &Arc<NacosConfigSource>,
    c: &ConfigService,
    mut snap: Snap,
    timeout: Duration,
) {
    match complete(c, &mut snap, Some(&src.boot), &src.dir, timeout).await {
        Ok(absent) => src.set_latest(&snap, absent),
        Err(e) => {
            src.set_store_error(gw, &e);
            return;
        }
    }
    let (g, s) = (gw.clone(), src.clone());
    let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap)).await;
}

/// SIGHUP: Nacos config read again from the server (the run loop does
/// it).
async fn sighup(src: Arc<NacosConfigSource>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP; reading Nacos config again");
        src.reread.notify_one();
    }
}

/// `--check` of what is in Nacos config at `place` (as the gateway of
/// `boot` would build it, when given): the warnings, or the error to
/// print.
pub async fn check(
    place: &Place,
    boot: Option<&NacosBootstrap>,
    local_root: &Path,
) -> Result<Vec<String>, String> {
    let client = connect(&place.settings, None).await?;
    let (snap, _) = read_set(&client, place, boot, local_root).await?;
    build(&snap, boot, local_root, 1)
        .0
        .map(|g| g.warnings)
        .map_err(|e| e.to_string())
}

/// `push --nacos`: publishes the documents of a files configuration that
/// `--check` accepts (relative path → bytes, the main file as
/// `main.yaml`, as `etcd::documents_of_files` gives them): each under the
/// data id of its path, the main settings under `place`'s data id, last
/// (a document is there before the settings name it). Nacos config has no
/// transaction: documents are published one by one and only those that
/// differ. Returns (published, unchanged).
pub async fn push(
    place: &Place,
    docs: &BTreeMap<String, Vec<u8>>,
) -> Result<(usize, usize), String> {
    let mut texts = Vec::new();
    for (rel, bytes) in docs {
        let text = String::from_utf8(bytes.clone())
            .map_err(|_| format!("{rel}: not UTF-8 text (Nacos config holds text)"))?;
        if text.trim().is_empty() {
            return Err(format!(
                "{rel}: empty; Nacos config cannot hold an empty document (write a comment line)"
            ));
        }
        let id = if rel == "main.yaml" {
            place.data_id.clone()
        } else {
            if rel.contains(':') {
                return Err(format!(
                    "{rel}: a path with `:` has no data id (each `/` becomes `:`)"
                ));
            }
            data_id_of(rel)
        };
        if id != place.data_id && id.eq_ignore_ascii_case(&place.data_id) {
            return Err(format!("{rel}: its data id {id} is the main settings'"));
        }
        texts.push((id, text));
    }
    // The main settings last.
    texts.sort_by_key(|(id, _)| *id == place.data_id);
    let client = connect(&place.settings, None).await?;
    let timeout = Duration::from_millis(place.settings.timeout_ms.max(3_000));
    let (mut published, mut unchanged) = (0, 0);
    for (id, text) in texts {
        if get(&client, &place.group, &id, timeout).await?.as_deref() == Some(text.as_str()) {
            unchanged += 1;
            continue;
        }
        let put = client.publish_config(
            id.clone(),
            place.group.clone(),
            text,
            Some("text".to_string()),
        );
        match tokio::time::timeout(timeout, put).await {
            Ok(Ok(true)) => published += 1,
            Ok(Ok(false)) => return Err(format!("data id {id}: Nacos refused the publish")),
            Ok(Err(e)) => return Err(format!("data id {id}: {e}")),
            Err(_) => return Err(format!("data id {id}: no answer")),
        }
    }
    Ok((published, unchanged))
}

/// `pull --nacos`: writes the main settings (`dir/<data id>`) and every
/// document they name (`dir/<path>`, each `:` of its data id a `/`).
/// Returns the files written and, when what is in Nacos does not build,
/// its error (documents named after it are not found, so not written).
pub async fn pull(place: &Place, dir: &Path) -> Result<(Vec<PathBuf>, Option<String>), String> {
    let client = connect(&place.settings, None).await?;
    let (snap, _) = read_set(&client, place, None, Path::new(".")).await?;
    if !snap.docs.contains_key(&place.data_id) {
        return Err(format!(
            "no data id {} in group {} (namespace {})",
            place.data_id, place.group, place.settings.namespace
        ));
    }
    let mut written = Vec::new();
    for (id, text) in &snap.docs {
        let rel = if *id == place.data_id {
            id.clone()
        } else {
            id.replace(':', "/")
        };
        if rel.starts_with('/')
            || rel
                .split('/')
                .any(|s| s == ".." || s == "." || s.is_empty())
        {
            return Err(format!(
                "data id {id}: not a relative path; refusing to write it"
            ));
        }
        let path = dir.join(&rel);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    let broken = build(&snap, None, Path::new("."), 0)
        .0
        .err()
        .map(|e| e.to_string());
    Ok((written, broken))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(docs: &[(&str, &str)]) -> Snap {
        Snap {
            namespace: "public".into(),
            group: "G".into(),
            main: "graygate.yaml".into(),
            docs: docs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn a_build_names_the_data_id_and_line_and_asks_for_what_is_missing() {
        let s = snap(&[(
            "graygate.yaml",
            "listen: 1.2.3.4:5\nnode_files: [nodes.yaml]\n",
        )]);
        let (res, missing) = build(&s, None, Path::new("."), 1);
        let e = res.unwrap_err().to_string();
        assert!(e.starts_with("nacos:G/nodes.yaml"), "{e}");
        assert!(e.contains("no data id \"nodes.yaml\""), "{e}");
        assert_eq!(missing.into_iter().collect::<Vec<_>>(), ["nodes.yaml"]);
        let s = snap(&[
            (
                "graygate.yaml",
                "listen: 1.2.3.4:5\nnode_files: [nodes.yaml]\n",
            ),
            (
                "nodes.yaml",
                "services:\n  api:\n    nodes:\n      - { addr: nope }\n",
            ),
        ]);
        let e = build(&s, None, Path::new("."), 1).0.unwrap_err();
        assert!(e.to_string().starts_with("nacos:G/nodes.yaml:4:"), "{e}");
    }

    #[test]
    fn the_bootstraps_addresses_and_nacos_replace_the_data_ids_and_keep_line_numbers() {
        let boot = NacosBootstrap::parse(
            Path::new("b.yaml"),
            "listen: 127.0.0.1:7000\nnacos:\n  server_addr: 127.0.0.1:8848\n  discovery: { lane_key: version, formal_values: [v1] }\n  config: { group: G, data_id: graygate.yaml }\n",
        )
        .unwrap();
        let s = snap(&[(
            "graygate.yaml",
            "listen: 1.2.3.4:5\nnacos:\n  server_addr: elsewhere:1\nroutes:\n  - { prefix: nope, service: x }\n",
        )]);
        let e = build(&s, Some(&boot), Path::new("."), 1).0.unwrap_err();
        assert_eq!(e.line, Some(5), "{e}");
        let ok = snap(&[("graygate.yaml", "listen: 1.2.3.4:5\n")]);
        let g = build(&ok, Some(&boot), Path::new("."), 1).0.unwrap();
        assert_eq!(g.config.listen.to_string(), "127.0.0.1:7000");
        let n = g.config.nacos.as_ref().unwrap();
        assert_eq!(n.server_addr, "127.0.0.1:8848");
        assert!(n.config.is_none());
        assert_eq!(n.discovery.as_ref().unwrap().formal_values, ["v1"]);
    }
}
