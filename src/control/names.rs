//! Layer: control plane. Node host names. A node-file entry `addr:
//! "canary-1.svc.internal:7101"` stands for every address the name
//! resolves to, each a node of the entry's lane (same service, weight,
//! zone; health and counters per address). The data plane never resolves:
//! a build asks [`NAMES`] for a name's addresses (the last good answer, or,
//! for a name not seen yet, a lookup made there and then), and [`run`]
//! asks again every `resolve_interval_ms` (sooner when an answer's TTL
//! runs out), rebuilding the configuration — as a reload does, through
//! [`Gateway::reload`] — when an answer differs from what the serving
//! generation holds. A name that stops resolving keeps its last good
//! addresses; `/nodes` and the log (at once, then at most once a minute)
//! say so. With `resolver:` names are asked of those DNS servers
//! (hickory-resolver, no cache of its own); without it, of the system's
//! resolver (getaddrinfo: `/etc/hosts`, nsswitch, `/etc/resolv.conf`).

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::config::Resolvers;
use crate::control::Gateway;

/// Every name's last answer, shared by the builds and [`run`].
pub static NAMES: LazyLock<Names> = LazyLock::new(Names::default);

/// How long one lookup may take (all servers, all attempts).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// A TTL shorter than this is read as this (no lookup storm on TTL 0).
const MIN_TTL: Duration = Duration::from_secs(1);
/// A name that keeps failing is logged again at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A name as asked of one set of servers (`None`: the system's resolver).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub resolver: Option<Resolvers>,
    pub host: String,
}

/// What is known of a name.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The last good answer: sorted, never empty.
    pub addrs: Vec<IpAddr>,
    /// When the last good answer came.
    pub resolved_at: SystemTime,
    /// Why the lookups since fail (`None`: the last one answered).
    pub error: Option<String>,
    /// When the lookups began to fail.
    pub failing_since: Option<SystemTime>,
    next_at: Instant,
    logged_at: Option<Instant>,
}

/// The answers of every name the builds asked for.
#[derive(Default)]
pub struct Names {
    entries: Mutex<HashMap<Key, Entry>>,
    /// Grows whenever a name's addresses change.
    version: AtomicU64,
}

/// One answer: the addresses and, where the resolver tells, their TTL.
type Answer = Result<(Vec<IpAddr>, Option<Duration>), String>;

impl Names {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The addresses of `host` for a build: the last good answer, else a
    /// lookup now (blocking; its failure is the build's error).
    pub fn addresses(
        &self,
        resolver: Option<&Resolvers>,
        host: &str,
        interval: Duration,
    ) -> Result<Vec<IpAddr>, String> {
        let key = Key {
            resolver: resolver.cloned(),
            host: host.to_string(),
        };
        if let Some(e) = self.lock().get(&key) {
            return Ok(e.addrs.clone());
        }
        let answer = lookup_blocking(resolver, host);
        if let Err(e) = &answer {
            return Err(format!("the name does not resolve: {e}"));
        }
        self.record(&key, answer, interval);
        Ok(self
            .lock()
            .get(&key)
            .map(|e| e.addrs.clone())
            .unwrap_or_default())
    }

    /// What is known of `host` asked of `resolver`.
    pub fn entry(&self, resolver: Option<&Resolvers>, host: &str) -> Option<Entry> {
        let key = Key {
            resolver: resolver.cloned(),
            host: host.to_string(),
        };
        self.lock().get(&key).cloned()
    }

    /// Takes in one answer for `key`; returns whether its addresses
    /// changed. A failure keeps the last good addresses (a name never
    /// answered is not kept).
    fn record(&self, key: &Key, answer: Answer, interval: Duration) -> bool {
        let now = Instant::now();
        let mut entries = self.lock();
        match answer {
            Ok((mut addrs, ttl)) => {
                addrs.sort();
                addrs.dedup();
                let due = ttl.map_or(interval, |t| interval.min(t.max(MIN_TTL)));
                let entry = entries.entry(key.clone()).or_insert_with(|| Entry {
                    addrs: Vec::new(),
                    resolved_at: SystemTime::now(),
                    error: None,
                    failing_since: None,
                    next_at: now,
                    logged_at: None,
                });
                if entry.error.take().is_some() {
                    tracing::info!(
                        host = %key.host,
                        addrs = ?addrs,
                        "node host name resolves again"
                    );
                }
                entry.failing_since = None;
                entry.resolved_at = SystemTime::now();
                entry.next_at = now + due;
                let changed = entry.addrs != addrs;
                if changed {
                    if !entry.addrs.is_empty() {
                        tracing::info!(
                            host = %key.host,
                            was = ?entry.addrs,
                            now = ?addrs,
                            "node host name resolves to new addresses"
                        );
                    }
                    entry.addrs = addrs;
                    self.version.fetch_add(1, Ordering::Relaxed);
                }
                changed
            }
            Err(why) => {
                let Some(entry) = entries.get_mut(key) else {
                    return false;
                };
                entry.next_at = now + interval;
                let first = entry.error.is_none();
                if first {
                    entry.failing_since = Some(SystemTime::now());
                }
                if first || entry.logged_at.is_none_or(|t| now >= t + LOG_EVERY) {
                    entry.logged_at = Some(now);
                    tracing::warn!(
                        host = %key.host,
                        error = %why,
                        kept = ?entry.addrs,
                        "node host name does not resolve; its last good addresses stay in use"
                    );
                }
                entry.error = Some(why);
                false
            }
        }
    }

    /// The names of `keys` due for a lookup at `now`, and the next moment
    /// one is due.
    fn due(
        &self,
        keys: &BTreeSet<(Option<Resolvers>, String)>,
        now: Instant,
    ) -> (Vec<Key>, Option<Instant>) {
        let entries = self.lock();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for (resolver, host) in keys {
            let key = Key {
                resolver: resolver.clone(),
                host: host.clone(),
            };
            match entries.get(&key) {
                Some(e) if e.next_at > now => {
                    next = Some(next.map_or(e.next_at, |n| n.min(e.next_at)));
                }
                _ => due.push(key),
            }
        }
        (due, next)
    }

    /// Forgets the names no generation uses any more.
    fn retain(&self, keys: &BTreeSet<(Option<Resolvers>, String)>) {
        self.lock()
            .retain(|k, _| keys.contains(&(k.resolver.clone(), k.host.clone())));
    }
}

/// The names of `gen`'s nodes, as [`NAMES`] keys them.
fn names_of(gen: &crate::generation::Generation) -> BTreeSet<(Option<Resolvers>, String)> {
    gen.node_names
        .iter()
        .map(|n| (gen.config.resolver.clone(), n.host.clone()))
        .collect()
}

/// Does every host-name entry of `gen` stand for what its name resolves
/// to now?
fn current(gen: &crate::generation::Generation) -> bool {
    gen.node_names.iter().all(|n| {
        let Some(e) = NAMES.entry(gen.config.resolver.as_ref(), &n.host) else {
            return true;
        };
        e.addrs.len() == n.addrs.len()
            && e.addrs
                .iter()
                .zip(&n.addrs)
                .all(|(ip, a)| *ip == a.ip() && a.port() == n.port)
    })
}

/// Keeps the serving generation's host names resolved: each name is asked
/// again when due, and the configuration is rebuilt (as a reload) when an
/// answer no longer matches the nodes serving. A rebuild that fails (the
/// files are being edited) is tried again at the next change of an answer
/// or of the files. Runs until the process ends.
pub async fn run(gw: Arc<Gateway>) {
    let mut tried_version = None;
    loop {
        let gen = gw.current();
        let keys = names_of(&gen);
        NAMES.retain(&keys);
        let interval = Duration::from_millis(gen.config.resolve_interval_ms);
        let (due, next) = NAMES.due(&keys, Instant::now());
        let mut lookups = tokio::task::JoinSet::new();
        for key in due {
            lookups.spawn(async move {
                let answer = lookup(key.resolver.as_ref(), &key.host).await;
                (key, answer)
            });
        }
        while let Some(done) = lookups.join_next().await {
            if let Ok((key, answer)) = done {
                NAMES.record(&key, answer, interval);
            }
        }
        let version = NAMES.version.load(Ordering::Relaxed);
        if !current(&gen) && tried_version != Some(version) && !gw.shutting_down() {
            tried_version = Some(version);
            tracing::info!("node host names resolve to new addresses; rebuilding the node sets");
            let g = gw.clone();
            let _ = tokio::task::spawn_blocking(move || g.reload()).await;
        }
        // Wake when a name is due, and at least once a second to see a new
        // generation's names.
        let now = Instant::now();
        let wake = next
            .unwrap_or(now + interval)
            .min(now + Duration::from_secs(1))
            .max(now + Duration::from_millis(10));
        tokio::time::sleep_until(wake.into()).await;
    }
}

/// One lookup of `host`, on a thread of its own (a build may run on a
/// runtime's thread or on none).
fn lookup_blocking(resolver: Option<&Resolvers>, host: &str) -> Answer {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start a resolver: {e}"))?;
            rt.block_on(lookup(resolver, host))
        })
        .join()
        .unwrap_or_else(|_| Err("the lookup failed".to_string()))
    })
}

/// One lookup of `host`'s IPv4 and IPv6 addresses.
pub async fn lookup(resolver: Option<&Resolvers>, host: &str) -> Answer {
    let work = async {
        match resolver {
            None => system_lookup(host).await,
            Some(servers) => dns_lookup(servers, host).await,
        }
    };
    match tokio::time::timeout(LOOKUP_TIMEOUT, work).await {
        Ok(Ok((addrs, _))) if addrs.is_empty() => Err("no addresses".to_string()),
        Ok(answer) => answer,
        Err(_) => Err(format!("no answer within {} s", LOOKUP_TIMEOUT.as_secs())),
    }
}

/// The system's resolver (getaddrinfo); it tells no TTL.
async fn system_lookup(host: &str) -> Answer {
    let addrs = tokio::net::lookup_host((host, 0))
        .await
        .map_err(|e| e.to_string())?;
    Ok((addrs.map(|a| a.ip()).collect(), None))
}

/// The DNS servers of `resolver:`, asked for A and AAAA records.
async fn dns_lookup(servers: &Resolvers, host: &str) -> Answer {
    use hickory_resolver::config::{
        LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
    };
    use hickory_resolver::name_server::TokioConnectionProvider;
    use hickory_resolver::proto::xfer::Protocol;
    let mut config = ResolverConfig::new();
    for s in &servers.0 {
        config.add_name_server(NameServerConfig::new(*s, Protocol::Udp));
        config.add_name_server(NameServerConfig::new(*s, Protocol::Tcp));
    }
    let mut builder =
        hickory_resolver::Resolver::builder_with_config(config, TokioConnectionProvider::default());
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.use_hosts_file = ResolveHosts::Never;
    opts.cache_size = 0;
    opts.timeout = Duration::from_secs(2);
    opts.attempts = 1;
    // A fully qualified name: no search domains.
    opts.ndots = 0;
    let resolver = builder.build();
    let name = format!("{host}.");
    let answer = resolver
        .lookup_ip(name.as_str())
        .await
        .map_err(|e| describe(&e))?;
    let ttl = answer
        .valid_until()
        .checked_duration_since(Instant::now())
        .unwrap_or_default();
    Ok((answer.iter().collect(), Some(ttl)))
}

/// A resolver error in an operator's words.
fn describe(e: &hickory_resolver::ResolveError) -> String {
    use hickory_resolver::proto::op::ResponseCode;
    use hickory_resolver::proto::ProtoErrorKind;
    if let Some(proto) = e.proto() {
        match proto.kind() {
            ProtoErrorKind::NoRecordsFound { response_code, .. } => {
                return match *response_code {
                    ResponseCode::NXDomain => "no such name (NXDOMAIN)".to_string(),
                    ResponseCode::NoError => "no A or AAAA record".to_string(),
                    other => format!("the DNS server answered {other}"),
                };
            }
            ProtoErrorKind::Timeout => return "no answer from the DNS servers".to_string(),
            _ => {}
        }
    }
    e.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(host: &str) -> Key {
        Key {
            resolver: None,
            host: host.into(),
        }
    }

    #[test]
    fn a_failure_keeps_the_last_good_addresses() {
        let names = Names::default();
        let k = key("a.test");
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let i = Duration::from_secs(5);
        // Never answered: nothing kept.
        assert!(!names.record(&k, Err("nope".into()), i));
        assert!(names.lock().get(&k).is_none());
        assert!(names.record(&k, Ok((vec![ip("10.0.0.2"), ip("10.0.0.1")], None)), i));
        assert!(!names.record(&k, Ok((vec![ip("10.0.0.1"), ip("10.0.0.2")], None)), i));
        assert!(!names.record(&k, Err("NXDOMAIN".into()), i));
        let e = names.lock().get(&k).cloned().unwrap();
        assert_eq!(e.addrs, [ip("10.0.0.1"), ip("10.0.0.2")]);
        assert_eq!(e.error.as_deref(), Some("NXDOMAIN"));
        assert!(e.failing_since.is_some());
        assert!(names.record(&k, Ok((vec![ip("10.0.0.3")], None)), i));
        let e = names.lock().get(&k).cloned().unwrap();
        assert_eq!((e.addrs, e.error), (vec![ip("10.0.0.3")], None));
    }

    #[test]
    fn a_short_ttl_brings_the_next_lookup_forward_but_not_below_a_second() {
        let names = Names::default();
        let k = key("a.test");
        let ip = vec!["10.0.0.1".parse().unwrap()];
        let keys = BTreeSet::from([(None, "a.test".to_string())]);
        let at = Instant::now();
        names.record(
            &k,
            Ok((ip.clone(), Some(Duration::ZERO))),
            Duration::from_secs(30),
        );
        let (due, next) = names.due(&keys, at);
        assert!(due.is_empty());
        let next = next.unwrap();
        assert!(
            next >= at + MIN_TTL && next < at + Duration::from_secs(5),
            "{:?}",
            next - at
        );
        assert_eq!(names.due(&keys, next).0, std::slice::from_ref(&k));
        names.record(&k, Ok((ip, None)), Duration::from_millis(200));
        let next = names.due(&keys, Instant::now()).1.unwrap();
        assert!(next < Instant::now() + Duration::from_millis(250));
    }

    #[test]
    fn localhost_resolves_through_the_system() {
        let addrs = NAMES
            .addresses(None, "localhost", Duration::from_secs(5))
            .unwrap();
        assert!(addrs.iter().all(|a| a.is_loopback()), "{addrs:?}");
        assert!(addrs.contains(&"127.0.0.1".parse().unwrap()), "{addrs:?}");
    }
}
