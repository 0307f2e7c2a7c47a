//! Layer: control plane. Discovery from Nacos naming (`nacos.discovery`): a
//! service a route names and no node file (or registry) defines is looked
//! up in Nacos and kept current by subscription — the server pushes every
//! change, nothing is polled. The client is the official one (`nacos-sdk`,
//! Nacos 2.x gRPC). As with node host names (`control::names`), a build
//! asks [`DIRECTORY`] for a service's instances (the last answer; none yet:
//! an empty node set) and [`run`] keeps the directory current, rebuilding
//! the configuration through [`Gateway::reload`] — the path every change
//! takes — when a push changes a service. Only instances `enabled` and
//! `healthy`, of the configured clusters, become nodes (filtered here, not
//! trusted to the server); the value of the metadata key `lane_key` is the
//! lane (missing, or one of `formal_values`: formal); `weight` 0 is never
//! chosen; the `zone` metadata is the node's zone. While Nacos cannot be
//! reached the last instances keep serving and `/status` says so. With
//! `cache_dir`, every change is also written to
//! `<cache_dir>/graygate-discovery.json`; a start finds its services there
//! at once (`state: cached` until Nacos answers), without waiting for the
//! client's own connection attempt (five seconds and more while Nacos is
//! down). (The
//! client also re-reads each subscribed service every few seconds, as
//! Nacos's Java client does, in case a push was lost; a change reaches
//! the gateway by the push, within the server's push delay.)

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nacos_sdk::api::naming::{
    NamingChangeEvent, NamingEventListener, NamingService, NamingServiceBuilder, ServiceInstance,
};
use nacos_sdk::api::props::ClientProps;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::config::nacos::{NacosConfig, NacosDiscovery};
use crate::config::{resolve, valid_lane, NodeAddr, NodeConfig, ServiceConfig, FORMAL};
use crate::control::Gateway;

/// What the gateway knows of Nacos: every subscribed service's instances
/// and the connection's state. Shared by the builds and [`run`].
pub static DIRECTORY: LazyLock<Directory> = LazyLock::new(Directory::default);

/// How often the connection is checked (one small request) while
/// subscriptions are held.
const CHECK_EVERY: Duration = Duration::from_secs(2);
/// Quiet time after a push before rebuilding (pushes of several services
/// in one tick make one rebuild).
const DEBOUNCE: Duration = Duration::from_millis(10);

/// A service as one server set, namespace and group know it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub server: String,
    pub namespace: String,
    pub group: String,
    pub service: String,
}

impl Key {
    fn new(n: &NacosConfig, d: &NacosDiscovery, service: &str) -> Key {
        Key {
            server: n.server_addr.clone(),
            namespace: n.namespace.clone(),
            group: d.group.clone(),
            service: service.to_string(),
        }
    }
}

/// One instance as Nacos gave it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub ip: String,
    pub port: i32,
    pub weight: f64,
    pub healthy: bool,
    pub enabled: bool,
    pub cluster: String,
    pub metadata: BTreeMap<String, String>,
}

impl From<&ServiceInstance> for Instance {
    fn from(i: &ServiceInstance) -> Instance {
        Instance {
            ip: i.ip.clone(),
            port: i.port,
            weight: i.weight,
            healthy: i.healthy,
            enabled: i.enabled,
            cluster: i
                .cluster_name
                .clone()
                .unwrap_or_else(|| "DEFAULT".to_string()),
            metadata: i
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }
}

/// What is known of one service.
#[derive(Debug, Clone)]
struct Entry {
    /// Sorted by address.
    instances: Vec<Instance>,
    /// When the last answer or push came.
    updated: SystemTime,
    /// A push came (an answer to the first query, older, is then ignored).
    pushed: bool,
    /// Read from the discovery snapshot at start; Nacos has not answered.
    cached: bool,
}

/// graygate's copy on disk of the instances (`<cache_dir>/graygate-discovery.json`):
/// of one server set and namespace.
#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    server_addr: String,
    namespace: String,
    services: Vec<SnapService>,
}

#[derive(Debug, Serialize, Deserialize)]
struct SnapService {
    group: String,
    service: String,
    instances: Vec<Instance>,
}

impl Snapshot {
    /// `<cache_dir>/graygate-discovery.json` of `s` (none without
    /// `cache_dir`); `dir` is the directory `cache_dir` is relative to.
    fn path(s: &NacosConfig, dir: &Path) -> Option<PathBuf> {
        s.cache_dir
            .as_ref()
            .map(|c| resolve(dir, c).join("graygate-discovery.json"))
    }

    /// The snapshot at `path` if it is of `s`'s servers and namespace.
    fn load(path: &Path, s: &NacosConfig) -> Result<Snapshot, String> {
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        let snap: Snapshot = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        if snap.server_addr != s.server_addr || snap.namespace != s.namespace {
            return Err(format!(
                "written for server_addr {} namespace {}, not these settings'",
                snap.server_addr, snap.namespace
            ));
        }
        Ok(snap)
    }

    /// Writes it atomically; a failure is logged, the gateway serves on.
    fn save(&self, path: &Path) {
        crate::control::source::save_snapshot(path, self);
    }
}

/// The directory `cache_dir` is relative to: the main file's.
fn config_dir(gw: &Gateway) -> &Path {
    gw.config_path.parent().unwrap_or(Path::new("."))
}

/// The connection's state, for `/status`.
#[derive(Debug, Clone, Default)]
struct Conn {
    server: Option<String>,
    namespace: Option<String>,
    connected: bool,
    error: Option<String>,
    /// When the state last changed.
    since: Option<SystemTime>,
    pushes: u64,
}

#[derive(Default)]
pub struct Directory {
    entries: Mutex<HashMap<Key, Entry>>,
    conn: Mutex<Conn>,
}

impl Directory {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The instances of `key` (none if never answered).
    pub fn instances(&self, key: &Key) -> Vec<Instance> {
        self.entries()
            .get(key)
            .map(|e| e.instances.clone())
            .unwrap_or_default()
    }

    /// Takes in `instances` of `key` (`pushed`: a push or a read newer than
    /// every push; else a first answer, ignored once a push came);
    /// returns whether the instances that can be nodes (enabled, healthy)
    /// differ from what was known. (The server's pushes may leave out
    /// unhealthy instances that the client's own refresh lists: that is no
    /// change to route by.)
    fn record(&self, key: &Key, mut instances: Vec<Instance>, pushed: bool) -> bool {
        instances.sort_by(|a, b| (&a.ip, a.port).cmp(&(&b.ip, b.port)));
        let mut entries = self.entries();
        if let Some(e) = entries.get_mut(key) {
            if e.pushed && !pushed {
                return false;
            }
            e.pushed |= pushed;
            e.cached = false;
            e.updated = SystemTime::now();
            let up = |l: &[Instance]| -> Vec<Instance> {
                l.iter()
                    .filter(|i| i.enabled && i.healthy)
                    .cloned()
                    .collect()
            };
            let changed = up(&e.instances) != up(&instances);
            e.instances = instances;
            return changed;
        }
        entries.insert(
            key.clone(),
            Entry {
                instances,
                updated: SystemTime::now(),
                pushed,
                cached: false,
            },
        );
        true
    }

    /// Takes in the services of `keys` that `snap` holds and the directory
    /// does not (a start); returns whether it now knows every one.
    fn restore(&self, snap: &Snapshot, keys: &[Key]) -> bool {
        let mut entries = self.entries();
        for key in keys {
            if entries.contains_key(key) {
                continue;
            }
            if let Some(s) = snap
                .services
                .iter()
                .find(|s| s.group == key.group && s.service == key.service)
            {
                let mut instances = s.instances.clone();
                instances.sort_by(|a, b| (&a.ip, a.port).cmp(&(&b.ip, b.port)));
                entries.insert(
                    key.clone(),
                    Entry {
                        instances,
                        updated: SystemTime::now(),
                        pushed: false,
                        cached: true,
                    },
                );
            }
        }
        keys.iter().all(|k| entries.contains_key(k))
    }

    /// What the directory holds of `s`'s servers and namespace, as a
    /// snapshot (none while a service is only known from the snapshot:
    /// it is on disk already).
    fn snapshot(&self, s: &NacosConfig) -> Option<Snapshot> {
        let entries = self.entries();
        let mut services: Vec<SnapService> = entries
            .iter()
            .filter(|(k, _)| k.server == s.server_addr && k.namespace == s.namespace)
            .map(|(k, e)| SnapService {
                group: k.group.clone(),
                service: k.service.clone(),
                instances: e.instances.clone(),
            })
            .collect();
        if entries.values().all(|e| e.cached) {
            return None;
        }
        services.sort_by(|a, b| (&a.group, &a.service).cmp(&(&b.group, &b.service)));
        Some(Snapshot {
            server_addr: s.server_addr.clone(),
            namespace: s.namespace.clone(),
            services,
        })
    }

    fn set_conn(&self, connected: bool, error: Option<String>) {
        let mut c = self.conn();
        if c.connected != connected || c.since.is_none() {
            c.since = Some(SystemTime::now());
            if connected {
                tracing::info!(server = ?c.server, "Nacos reached");
            } else {
                tracing::warn!(
                    server = ?c.server,
                    error = ?error,
                    "Nacos unreachable; the last instances keep serving"
                );
            }
        }
        c.connected = connected;
        c.error = error;
    }
}

/// A service for a build: its settings and, as nodes, the instances known
/// now (none yet: an empty node set, so the lane fallback rules and the 503
/// of an empty service apply). Instances that cannot be nodes are left out
/// with a warning: the configuration stands whatever Nacos holds.
pub fn service(
    nacos: &NacosConfig,
    disc: &NacosDiscovery,
    name: &str,
) -> (ServiceConfig, Vec<String>) {
    let key = Key::new(nacos, disc, name);
    let own = disc.services.get(name).cloned().unwrap_or_default();
    let lane_key = own.lane_key.as_deref().unwrap_or(&disc.lane_key);
    let formal = own.formal_values.as_ref().unwrap_or(&disc.formal_values);
    let instances: Vec<Instance> = DIRECTORY
        .instances(&key)
        .into_iter()
        .filter(|i| routable(i, &disc.clusters))
        .collect();
    let mut warnings = Vec::new();
    let scale = weight_scale(&instances);
    let mut nodes = Vec::new();
    for i in &instances {
        let addr = match (i.ip.parse::<IpAddr>(), u16::try_from(i.port)) {
            (Ok(ip), Ok(port)) if port > 0 => SocketAddr::new(ip, port),
            _ => {
                warnings.push(format!(
                    "nacos: service {name:?}: instance {}:{} is no ip:port; left out",
                    i.ip, i.port
                ));
                continue;
            }
        };
        let lane = match i.metadata.get(lane_key) {
            None => FORMAL.to_string(),
            Some(v) if formal.contains(v) => FORMAL.to_string(),
            Some(v) if valid_lane(v) => v.clone(),
            Some(v) => {
                warnings.push(format!(
                    "nacos: service {name:?}: instance {addr}: {lane_key} {v:?} is no lane name \
                     (letters, digits, - _ . only); left out"
                ));
                continue;
            }
        };
        let zone = i.metadata.get("zone").filter(|z| valid_lane(z)).cloned();
        nodes.push(NodeConfig {
            name: Some(addr.to_string()),
            addr: NodeAddr::Ip(addr),
            lane,
            weight: scale(i.weight),
            drain: false,
            zone,
        });
    }
    let svc = ServiceConfig {
        nodes,
        health: own.health,
        strict: own.strict,
        retries: own.retries,
        ..ServiceConfig::default()
    };
    (svc, warnings)
}

/// Is `i` a node: enabled, healthy, of one of `clusters` (empty: any)?
fn routable(i: &Instance, clusters: &[String]) -> bool {
    i.enabled && i.healthy && (clusters.is_empty() || clusters.contains(&i.cluster))
}

/// Nacos weights are decimals (1.0 by default, 0.5, 2.5…); nodes' are
/// whole numbers. Each weight is taken to hundredths and the service's
/// weights divided by their greatest common divisor (1.0 everywhere → 1);
/// a weight of 0 (or below) stays 0: never chosen.
fn weight_scale(instances: &[Instance]) -> impl Fn(f64) -> u32 {
    let hundredths = |w: f64| -> u32 {
        if w.is_finite() && w > 0.0 {
            (w * 100.0).round().clamp(1.0, 1_000_000.0) as u32
        } else {
            0
        }
    };
    fn gcd(a: u32, b: u32) -> u32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let g = instances
        .iter()
        .map(|i| hundredths(i.weight))
        .filter(|w| *w > 0)
        .fold(0, gcd)
        .max(1);
    move |w| hundredths(w) / g
}

/// The listener of one subscription: each push goes to [`run`].
struct Listener {
    key: Key,
    tx: mpsc::UnboundedSender<(Key, Vec<Instance>)>,
}

impl NamingEventListener for Listener {
    fn event(&self, e: Arc<NamingChangeEvent>) {
        let list = e
            .instances
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(Instance::from)
            .collect();
        let _ = self.tx.send((self.key.clone(), list));
    }
}

/// The client and its subscriptions, for the settings it was made with.
struct Client {
    settings: NacosConfig,
    group: String,
    naming: NamingService,
    subs: HashMap<Key, Arc<Listener>>,
    checked: Option<Instant>,
}

/// The settings and the services the serving generation wants.
fn wanted(gw: &Gateway) -> Option<(NacosConfig, Vec<Key>)> {
    let gen = gw.current();
    let nacos = gen.config.nacos.as_ref()?;
    let disc = nacos.discovery.as_ref()?;
    if gen.discovered.is_empty() {
        return None;
    }
    let keys = gen
        .discovered
        .iter()
        .map(|s| Key::new(nacos, disc, s))
        .collect();
    Some((nacos.clone(), keys))
}

/// What keeps the subscriptions: the client (remade when the settings
/// change) and the channel pushes arrive on.
struct Runner {
    client: Option<Client>,
    tx: mpsc::UnboundedSender<(Key, Vec<Instance>)>,
    rx: Option<mpsc::UnboundedReceiver<(Key, Vec<Instance>)>>,
    retry_at: Option<Instant>,
    backoff: Duration,
}

static RUNNER: LazyLock<tokio::sync::Mutex<Runner>> = LazyLock::new(|| {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::sync::Mutex::new(Runner {
        client: None,
        tx,
        rx: Some(rx),
        retry_at: None,
        backoff: Duration::from_millis(200),
    })
});

async fn connect(s: &NacosConfig, dir: &std::path::Path) -> Result<NamingService, String> {
    let mut props = ClientProps::new()
        .server_addr(s.server_addr.clone())
        .namespace(s.namespace.clone())
        .app_name("graygate")
        // The settings are the file's, not the environment's.
        .env_first(false)
        // An empty push is the truth (every instance gone), not an error.
        .naming_push_empty_protection(false);
    if let Some(p) = s.grpc_port {
        props = props.remote_grpc_port(p);
    }
    if let Some(c) = &s.cache_dir {
        // The client's own copy of what it was pushed, beside graygate's
        // snapshot (which is what a start reads: the client's copy is
        // read only after its connection attempt).
        props = props.cache_dir(resolve(dir, c).join("sdk"));
    }
    let mut builder = NamingServiceBuilder::new(match (&s.username, &s.password) {
        (Some(u), Some(p)) => props.auth_username(u.clone()).auth_password(p.clone()),
        _ => props,
    });
    if s.username.is_some() {
        builder = builder.enable_auth_plugin_http();
    }
    // The client's first connection makes one attempt of its own: bounded
    // by 5 s at least.
    let timeout = Duration::from_millis(s.timeout_ms.max(5_000));
    match tokio::time::timeout(timeout, builder.build()).await {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
    }
}

impl Runner {
    /// One step: the client for the serving generation's settings, a
    /// subscription (and a first query) per wanted service, none for the
    /// others, the connection checked when due. Returns whether the
    /// directory changed.
    async fn sync(&mut self, gw: &Gateway) -> bool {
        let Some((settings, keys)) = wanted(gw) else {
            if self.client.take().is_some() {
                tracing::info!("no service from Nacos any more; client closed");
                *DIRECTORY.conn() = Conn::default();
            }
            return false;
        };
        let group = keys[0].group.clone();
        if self
            .client
            .as_ref()
            .is_some_and(|c| c.settings != settings || c.group != group)
        {
            tracing::info!("nacos settings changed; reconnecting");
            self.client = None;
            DIRECTORY.entries().retain(|k, _| keys.contains(k));
        }
        if self.client.is_none() {
            if self.retry_at.is_some_and(|t| Instant::now() < t) {
                return false;
            }
            {
                let mut c = DIRECTORY.conn();
                c.server = Some(settings.server_addr.clone());
                c.namespace = Some(settings.namespace.clone());
            }
            match connect(&settings, config_dir(gw)).await {
                Ok(naming) => {
                    self.retry_at = None;
                    self.backoff = Duration::from_millis(200);
                    self.client = Some(Client {
                        settings: settings.clone(),
                        group,
                        naming,
                        subs: HashMap::new(),
                        checked: None,
                    });
                }
                Err(e) => {
                    DIRECTORY.set_conn(false, Some(e));
                    self.retry_at = Some(Instant::now() + self.backoff);
                    self.backoff = (self.backoff * 2).min(Duration::from_secs(3));
                    return false;
                }
            }
        }
        let client = self.client.as_mut().expect("connected above");
        let timeout = Duration::from_millis(settings.timeout_ms.max(100));
        let mut changed = false;
        // The connection, checked when due; back after a loss, every
        // subscription is asked again (the client subscribes again itself;
        // a change made meanwhile may come before its next push).
        let due = client.checked.is_none_or(|t| t.elapsed() >= CHECK_EVERY);
        if due {
            client.checked = Some(Instant::now());
            let probe = client
                .naming
                .get_service_list(1, 1, Some(client.group.clone()));
            let ok = match tokio::time::timeout(timeout, probe).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
            };
            let was = DIRECTORY.conn().connected;
            match ok {
                Ok(()) => {
                    DIRECTORY.set_conn(true, None);
                    if !was {
                        for key in client.subs.keys().cloned().collect::<Vec<_>>() {
                            changed |= query(client, &key, timeout, true).await;
                        }
                    }
                }
                Err(e) => DIRECTORY.set_conn(false, Some(e)),
            }
        }
        for key in &keys {
            if client.subs.contains_key(key) {
                continue;
            }
            let listener = Arc::new(Listener {
                key: key.clone(),
                tx: self.tx.clone(),
            });
            let sub = client.naming.subscribe(
                key.service.clone(),
                Some(key.group.clone()),
                Vec::new(),
                listener.clone(),
            );
            match tokio::time::timeout(timeout, sub).await {
                Ok(Ok(())) => {
                    tracing::info!(service = %key.service, group = %key.group, "subscribed in Nacos");
                    client.subs.insert(key.clone(), listener);
                    // The state now (pushes come on change only).
                    changed |= query(client, key, timeout, false).await;
                }
                Ok(Err(e)) => {
                    DIRECTORY.set_conn(false, Some(e.to_string()));
                }
                Err(_) => DIRECTORY.set_conn(false, Some("subscribe: no answer".into())),
            }
        }
        let gone: Vec<Key> = client
            .subs
            .keys()
            .filter(|k| !keys.contains(k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(l) = client.subs.remove(&key) {
                let unsub = client.naming.unsubscribe(
                    key.service.clone(),
                    Some(key.group.clone()),
                    Vec::new(),
                    l,
                );
                let _ = tokio::time::timeout(timeout, unsub).await;
            }
            DIRECTORY.entries().remove(&key);
        }
        changed
    }
}

/// Asks Nacos for every instance of `key` (healthy or not: the filter is
/// the gateway's); returns whether the directory changed. A first answer
/// (`newest` false) yields to a push that came meanwhile; a read after a
/// lost connection (`newest`) is newer than every push before it.
async fn query(client: &Client, key: &Key, timeout: Duration, newest: bool) -> bool {
    let ask = client.naming.get_all_instances(
        key.service.clone(),
        Some(key.group.clone()),
        Vec::new(),
        false,
    );
    let why = match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(list)) => {
            return DIRECTORY.record(key, list.iter().map(Instance::from).collect(), newest)
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer".to_string(),
    };
    tracing::warn!(service = %key.service, error = %why, "Nacos query failed");
    false
}

/// Rebuilds the configuration (the directory changed) and, with
/// `cache_dir`, writes the discovery snapshot. Blocking work on the
/// blocking pool; a rejected build leaves the old generation serving.
async fn rebuild(gw: &Arc<Gateway>) {
    let g = gw.clone();
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(s) = g.current().config.nacos.as_ref() {
            if let (Some(path), Some(snap)) =
                (Snapshot::path(s, config_dir(&g)), DIRECTORY.snapshot(s))
            {
                snap.save(&path);
            }
        }
        g.reload()
    })
    .await;
}

/// Before serving: the first answer for every Nacos service of the
/// generation the gateway starts on, so it does not start with empty
/// services while Nacos answers. With a discovery snapshot holding every
/// service, that wait is bounded by `timeout_ms` and the snapshot serves
/// if Nacos has not answered by then (a start during an outage serves at
/// once); without one, by the client's first connection attempt. Nothing
/// to do without `nacos.discovery`.
pub async fn prime(gw: &Arc<Gateway>) {
    let Some((settings, keys)) = wanted(gw) else {
        return;
    };
    let restored = Snapshot::path(&settings, config_dir(gw)).is_some_and(|path| {
        match Snapshot::load(&path, &settings) {
            Ok(snap) => DIRECTORY.restore(&snap, &keys),
            Err(e) => {
                if path.exists() {
                    tracing::warn!(file = %path.display(), error = %e, "discovery snapshot not used");
                }
                false
            }
        }
    });
    let sync = async { RUNNER.lock().await.sync(gw).await };
    let changed = if restored {
        let bound = Duration::from_millis(settings.timeout_ms);
        match tokio::time::timeout(bound, sync).await {
            Ok(changed) => changed,
            Err(_) => {
                tracing::warn!(
                    "Nacos has not answered within {} ms: serving the discovery snapshot",
                    bound.as_millis()
                );
                true
            }
        }
    } else {
        sync.await
    };
    if changed || restored {
        rebuild(gw).await;
    }
}

/// Keeps the Nacos services current: subscriptions follow the serving
/// generation, each push updates the directory and rebuilds the
/// configuration. Runs until the process ends.
pub async fn run(gw: Arc<Gateway>) {
    let Some(mut rx) = RUNNER.lock().await.rx.take() else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut changed = false;
        tokio::select! {
            got = rx.recv() => {
                let Some((key, list)) = got else { return };
                changed |= take_push(&key, list);
                // Pushes that come together make one rebuild.
                while let Ok(Some((key, list))) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {
                    changed |= take_push(&key, list);
                }
            }
            _ = tick.tick() => {
                changed |= RUNNER.lock().await.sync(&gw).await;
            }
        }
        if changed {
            rebuild(&gw).await;
        }
    }
}

fn take_push(key: &Key, list: Vec<Instance>) -> bool {
    DIRECTORY.conn().pushes += 1;
    let changed = DIRECTORY.record(key, list, true);
    if changed {
        tracing::info!(service = %key.service, group = %key.group, "Nacos pushed a change");
    }
    changed
}

/// The `nacos` section of `/status` (none without `nacos.discovery`):
/// the servers, whether they answer, and per subscribed service the
/// instances Nacos holds and those that are nodes, by lane.
pub fn status(gw: &Gateway) -> Option<serde_json::Value> {
    let gen = gw.current();
    let nacos = gen.config.nacos.as_ref()?;
    let disc = nacos.discovery.as_ref()?;
    let conn = DIRECTORY.conn().clone();
    let ms = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let entries = DIRECTORY.entries();
    let cached = !conn.connected && entries.values().any(|e| e.cached);
    let services: Vec<serde_json::Value> = gen
        .discovered
        .iter()
        .map(|name| {
            let key = Key::new(nacos, disc, name);
            let e = entries.get(&key);
            let lanes: BTreeMap<String, usize> = gen
                .services
                .get(name)
                .map(|s| {
                    s.all.iter().fold(BTreeMap::new(), |mut m, n| {
                        *m.entry(n.lane.to_string()).or_default() += 1;
                        m
                    })
                })
                .unwrap_or_default();
            serde_json::json!({
                "name": name,
                "group": disc.group,
                "known": e.is_some(),
                "cached": e.is_some_and(|e| e.cached),
                "instances": e.map_or(0, |e| e.instances.len()),
                "nodes": gen.services.get(name).map_or(0, |s| s.all.len()),
                "lanes": lanes,
                "updated_unix_ms": e.map(|e| ms(e.updated)),
            })
        })
        .collect();
    Some(serde_json::json!({
        "server_addr": nacos.server_addr,
        "namespace": nacos.namespace,
        "group": disc.group,
        "connected": conn.connected,
        "state": if conn.connected {
            "live"
        } else if cached {
            "cached"
        } else {
            "stale"
        },
        "error": conn.error,
        "since_unix_ms": conn.since.map(ms),
        "pushes": conn.pushes,
        "services": services,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(ip: &str, port: i32, weight: f64, meta: &[(&str, &str)]) -> Instance {
        Instance {
            ip: ip.into(),
            port,
            weight,
            healthy: true,
            enabled: true,
            cluster: "DEFAULT".into(),
            metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn a_first_answer_yields_to_a_push_and_only_routable_changes_count() {
        let dir = Directory::default();
        let key = Key {
            server: "s".into(),
            namespace: "public".into(),
            group: "G".into(),
            service: "x".into(),
        };
        let a = inst("10.0.0.1", 1, 1.0, &[]);
        let mut sick = inst("10.0.0.2", 1, 1.0, &[]);
        sick.healthy = false;
        assert!(dir.record(&key, vec![a.clone()], true));
        // An older first answer does not undo the push.
        assert!(!dir.record(&key, vec![], false));
        assert_eq!(dir.instances(&key).len(), 1);
        // An unhealthy instance listed or not: nothing to route by.
        assert!(!dir.record(&key, vec![a.clone(), sick], true));
        assert_eq!(dir.instances(&key).len(), 2);
        // Every instance gone: a change.
        assert!(dir.record(&key, vec![], true));
        assert!(dir.instances(&key).is_empty());
    }

    #[test]
    fn the_discovery_snapshot_restores_only_its_own_servers_and_what_is_unknown() {
        let nacos: NacosConfig =
            serde_yaml::from_str("server_addr: 127.0.0.1:1\ndiscovery: {}\n").unwrap();
        let disc = nacos.discovery.clone().unwrap();
        let (api, web) = (
            Key::new(&nacos, &disc, "api"),
            Key::new(&nacos, &disc, "web"),
        );
        let dir = Directory::default();
        // Nothing from Nacos yet: nothing to write.
        assert!(dir.snapshot(&nacos).is_none());
        dir.record(&api, vec![inst("10.0.0.1", 1, 1.0, &[])], true);
        let snap = dir.snapshot(&nacos).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c/graygate-discovery.json");
        snap.save(&path);
        let back = Snapshot::load(&path, &nacos).unwrap();
        // A start knowing nothing: api restored (cached), web unknown.
        let fresh = Directory::default();
        assert!(!fresh.restore(&back, &[api.clone(), web.clone()]));
        assert!(fresh.entries()[&api].cached);
        assert_eq!(fresh.instances(&api), dir.instances(&api));
        // Only cached entries: nothing new to write.
        assert!(fresh.snapshot(&nacos).is_none());
        // Nacos's answer replaces the snapshot's, even an older first one.
        assert!(fresh.record(&api, vec![], false));
        assert!(!fresh.entries()[&api].cached);
        // Another server set or namespace: not used.
        let other: NacosConfig =
            serde_yaml::from_str("server_addr: 127.0.0.1:2\ndiscovery: {}\n").unwrap();
        let e = Snapshot::load(&path, &other).unwrap_err();
        assert!(e.contains("127.0.0.1:1"), "{e}");
    }

    #[test]
    fn weights_become_whole_numbers_in_their_ratio() {
        let l = [
            inst("10.0.0.1", 1, 1.0, &[]),
            inst("10.0.0.2", 1, 0.5, &[]),
            inst("10.0.0.3", 1, 0.0, &[]),
        ];
        let s = weight_scale(&l);
        assert_eq!((s(1.0), s(0.5), s(0.0), s(-1.0)), (2, 1, 0, 0));
        let s = weight_scale(&l[..1]);
        assert_eq!(s(1.0), 1);
    }

    #[test]
    fn instances_become_nodes_with_their_lane() {
        let nacos: NacosConfig = serde_yaml::from_str(
            "server_addr: 127.0.0.1:1\ndiscovery:\n  formal_values: [v1]\n  clusters: [A]\n  services:\n    web: { lane_key: lane }\n",
        )
        .unwrap();
        let disc = nacos.discovery.clone().unwrap();
        let key = Key::new(&nacos, &disc, "api");
        let mut down = inst("10.0.0.9", 1, 1.0, &[]);
        down.healthy = false;
        let mut off = inst("10.0.0.8", 1, 1.0, &[]);
        off.enabled = false;
        let mut other = inst("10.0.0.7", 1, 1.0, &[]);
        other.cluster = "B".into();
        let list = vec![
            inst("10.0.0.1", 80, 1.0, &[("version", "v1"), ("zone", "hz")]),
            inst("10.0.0.2", 80, 1.0, &[("version", "gray-1.0")]),
            inst("10.0.0.3", 80, 1.0, &[]),
            inst("10.0.0.4", 80, 1.0, &[("version", "bad lane")]),
            down,
            off,
            other,
        ];
        let list: Vec<Instance> = list
            .into_iter()
            .map(|mut i| {
                if i.cluster == "DEFAULT" {
                    i.cluster = "A".into();
                }
                i
            })
            .collect();
        DIRECTORY.record(&key, list, true);
        let (svc, warnings) = service(&nacos, &disc, "api");
        let lanes: Vec<(String, &str)> = svc
            .nodes
            .iter()
            .map(|n| (n.addr.to_string(), n.lane.as_str()))
            .collect();
        assert_eq!(
            lanes,
            [
                ("10.0.0.1:80".to_string(), "formal"),
                ("10.0.0.2:80".to_string(), "gray-1.0"),
                ("10.0.0.3:80".to_string(), "formal"),
            ]
        );
        assert_eq!(svc.nodes[0].zone.as_deref(), Some("hz"));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        // Unknown: an empty node set.
        assert!(service(&nacos, &disc, "nobody").0.nodes.is_empty());
    }

    /// A service's own `formal_values`, `health`, `strict` and `retries`
    /// reach its node set; another service keeps the defaults.
    #[test]
    fn per_service_settings_reach_their_service_only() {
        let nacos: NacosConfig = serde_yaml::from_str(
            "server_addr: 127.0.0.1:1\ndiscovery:\n  services:\n    pay:\n      formal_values: [v2]\n      health: { passive: { max_fails: 7 } }\n      strict: true\n      retries: 0\n",
        )
        .unwrap();
        let disc = nacos.discovery.clone().unwrap();
        for svc in ["pay", "cart"] {
            let list = vec![inst("10.0.2.1", 80, 1.0, &[("version", "v2")])];
            DIRECTORY.record(&Key::new(&nacos, &disc, svc), list, true);
        }
        let (pay, _) = service(&nacos, &disc, "pay");
        assert_eq!(pay.nodes[0].lane, "formal");
        assert_eq!(pay.health.passive.max_fails, 7);
        assert!(pay.strict);
        assert_eq!(pay.retries, Some(0));
        let (cart, _) = service(&nacos, &disc, "cart");
        assert_eq!(cart.nodes[0].lane, "v2");
        assert_eq!(cart.health, crate::config::HealthConfig::default());
        assert!(!cart.strict);
        assert_eq!(cart.retries, None);
    }

    /// A per-service `lane_key` replaces the discovery-wide one for that
    /// service only.
    #[test]
    fn a_per_service_lane_key_applies_to_its_service_only() {
        let nacos: NacosConfig = serde_yaml::from_str(
            "server_addr: 127.0.0.1:1\ndiscovery:\n  formal_values: [v1]\n  services:\n    web: { lane_key: lane }\n",
        )
        .unwrap();
        let disc = nacos.discovery.clone().unwrap();
        let both = || {
            vec![
                inst(
                    "10.0.1.1",
                    80,
                    1.0,
                    &[("version", "v2"), ("lane", "gray-a")],
                ),
                inst("10.0.1.2", 80, 1.0, &[("version", "v3")]),
            ]
        };
        for (svc, want) in [("web", ["gray-a", "formal"]), ("shop", ["v2", "v3"])] {
            DIRECTORY.record(&Key::new(&nacos, &disc, svc), both(), true);
            let (s, _) = service(&nacos, &disc, svc);
            let lanes: Vec<&str> = s.nodes.iter().map(|n| n.lane.as_str()).collect();
            assert_eq!(lanes, want, "{svc}");
        }
    }
}
