//! Layer: control plane. Building a generation: every file reachable from the
//! main config is read, parsed, validated and compiled (the Lua top level runs
//! in a fresh sandbox) into one [`Generation`], or the first error is returned
//! with its file:line. A build has no effect on live state, whether it is
//! accepted or not: its shared dictionaries are build-private copies (the
//! script's top level runs against them) and what a generation shares with
//! the running gateway (dictionaries, health, counters) is attached by
//! `Gateway::install` only once it is accepted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use http::HeaderName;

use crate::base::lists::IpList;
use crate::config::docs::{Docs, FileDocs};
use crate::config::{
    find_line, parse_yaml, resolve, valid_lane, Balance, ConfigError, MainConfig, NodeAddr,
    NodeFile, ServiceConfig, FORMAL, ZONE_ENV,
};
use crate::config::{JitMode, NodeProtocol};
use crate::generation::{Generation, NodeName, Route, Target};
use crate::lane::rules::Rules;
use crate::lane::script::ScriptSource;
use crate::lane::shared_dict::{self, SharedDict};
use crate::lane::sticky::Sticky;
use crate::lane::LanePolicy;
use crate::nodes::hash::HashKey;
use crate::nodes::{Node, Select, Service};
use crate::static_files::{CacheSettings, StaticTree};
use crate::upstream::tls::{TlsConnect, Transport};

/// Services from a registry (e.g. etcd's `services/<svc>/nodes/<id>`):
/// the document each came from (for errors), its name and settings. A
/// registered service that a node file also defines gets its nodes appended.
pub type RegisteredServices = Vec<(PathBuf, String, ServiceConfig)>;

impl Generation {
    /// Loads, validates and compiles everything reachable from `config_path`.
    pub fn load(config_path: &Path, id: u64) -> Result<Generation, ConfigError> {
        Generation::build(&FileDocs, config_path, Vec::new(), id)
    }

    /// Builds a generation from `docs` (the files, or one snapshot of a
    /// store), `config_path` naming the main document, plus `registered`
    /// services. The same validation whatever the source.
    pub fn build(
        docs: &dyn Docs,
        config_path: &Path,
        registered: RegisteredServices,
        id: u64,
    ) -> Result<Generation, ConfigError> {
        let text = docs.read(config_path)?;
        let config: MainConfig = parse_yaml(config_path, &text)?;
        let config_dir = config_path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let root = match &config.root {
            Some(r) => resolve(config_dir, r),
            None => config_dir.to_path_buf(),
        };
        let at = |needle: &str| find_line(&text, None, needle);
        let mut files = vec![config_path.to_path_buf()];
        let mut watch_paths = Vec::new();
        let mut warnings = Vec::new();

        let tag_header = HeaderName::from_bytes(config.tag_header.as_bytes()).map_err(|_| {
            ConfigError::new(
                config_path,
                at("tag_header"),
                format!("invalid header name {:?}", config.tag_header),
            )
        })?;

        let mut lists = BTreeMap::new();
        for (name, p) in &config.lists {
            let path = resolve(&root, p);
            lists.insert(name.clone(), IpList::load_from(docs, &path)?);
            files.push(path);
        }
        let lists = Arc::new(lists);

        let gateway_zone: Option<Arc<str>> = match config.gateway_zone() {
            Some(z) if !valid_lane(&z) => {
                let from_env = std::env::var(ZONE_ENV).is_ok_and(|e| !e.trim().is_empty());
                return Err(ConfigError::new(
                    config_path,
                    if from_env { None } else { at("zone:") },
                    format!(
                        "invalid zone name {z:?}{} (letters, digits, - _ . only)",
                        if from_env { " in GRAYGATE_ZONE" } else { "" }
                    ),
                ));
            }
            z => z.map(Into::into),
        };

        if config.resolve_interval_ms < 100 {
            return Err(ConfigError::new(
                config_path,
                at("resolve_interval_ms"),
                "resolve_interval_ms must be at least 100",
            ));
        }
        let resolve_interval = std::time::Duration::from_millis(config.resolve_interval_ms);
        let mut node_names = Vec::new();
        let mut services: BTreeMap<String, Service> = BTreeMap::new();
        let mut service_file: BTreeMap<String, PathBuf> = BTreeMap::new();
        // (document, its text, service name, settings), node files first.
        let mut defs: Vec<(PathBuf, std::rc::Rc<String>, String, ServiceConfig)> = Vec::new();
        for p in &config.node_files {
            let path = resolve(&root, p);
            let ntext = docs.read(&path)?;
            let nf: NodeFile = parse_yaml(&path, &ntext)?;
            let ntext = std::rc::Rc::new(ntext);
            for (name, svc) in nf.services {
                if let Some(prev) = service_file.get(&name) {
                    return Err(ConfigError::new(
                        &path,
                        find_line(&ntext, None, &format!("{name}:")),
                        format!("service {name:?} is also defined in {}", prev.display()),
                    ));
                }
                service_file.insert(name.clone(), path.clone());
                defs.push((path.clone(), ntext.clone(), name, svc));
            }
            files.push(path);
        }
        for (key, name, svc) in registered {
            match defs.iter_mut().find(|d| d.2 == name) {
                Some(d) => d.3.nodes.extend(svc.nodes),
                None => defs.push((key, Default::default(), name, svc)),
            }
        }
        // Services a route names and nothing above defines: from Nacos
        // naming, when `nacos.discovery` is set (an unknown service is an
        // empty node set, kept current by the subscription).
        let mut discovered = Vec::new();
        if let Some((nacos, disc)) = config
            .nacos
            .as_ref()
            .and_then(|n| n.discovery.as_ref().map(|d| (n, d)))
        {
            for r in &config.routes {
                let Some(name) = &r.service else { continue };
                if defs.iter().any(|d| &d.2 == name) {
                    continue;
                }
                let (svc, mut w) = super::source::nacos::service(nacos, disc, name);
                warnings.append(&mut w);
                discovered.push(name.clone());
                defs.push((
                    config_path.to_path_buf(),
                    Default::default(),
                    name.clone(),
                    svc,
                ));
            }
        }
        for (path, ntext, name, svc) in defs {
            {
                let mut nodes = Vec::new();
                for (i, n) in svc.nodes.iter().enumerate() {
                    if !valid_lane(&n.lane) {
                        return Err(ConfigError::new(
                            &path,
                            find_line(&ntext, Some(&format!("{name}:")), &n.lane),
                            format!(
                                "invalid lane name {:?} (letters, digits, - _ . only)",
                                n.lane
                            ),
                        ));
                    }
                    if let Some(z) = n.zone.as_deref().filter(|z| !valid_lane(z)) {
                        return Err(ConfigError::new(
                            &path,
                            find_line(&ntext, Some(&format!("{name}:")), z),
                            format!("invalid zone name {z:?} (letters, digits, - _ . only)"),
                        ));
                    }
                    match &n.addr {
                        NodeAddr::Ip(a) => nodes.push(Node::from_config(&name, i, n, *a)),
                        NodeAddr::Name { host, port } => {
                            let ips = super::names::NAMES
                                .addresses(config.resolver.as_ref(), host, resolve_interval)
                                .map_err(|e| {
                                    ConfigError::new(
                                        &path,
                                        find_line(&ntext, Some(&format!("{name}:")), host),
                                        format!("service {name:?}: node address {}: {e}", n.addr),
                                    )
                                })?;
                            let mut addrs = Vec::new();
                            for ip in ips {
                                let a = SocketAddr::new(ip, *port);
                                addrs.push(a);
                                if nodes.iter().any(|m: &Node| m.addr == a) {
                                    warnings.push(format!(
                                        "{}: service {name:?}: {} resolves to {a}, already a node of the service: listed once",
                                        path.display(),
                                        n.addr
                                    ));
                                    continue;
                                }
                                nodes.push(Node::from_config(&name, i, n, a));
                            }
                            node_names.push(NodeName {
                                service: name.clone(),
                                host: host.clone(),
                                port: *port,
                                addrs,
                            });
                        }
                    }
                }
                let service_line =
                    |needle: &str| find_line(&ntext, Some(&format!("{name}:")), needle);
                let hash_key = match &svc.hash_key {
                    Some(k) => Some(k.parse::<HashKey>().map_err(|m| {
                        ConfigError::new(
                            &path,
                            service_line("hash_key:"),
                            format!("service {name:?}: {m}"),
                        )
                    })?),
                    None => None,
                };
                match (svc.balance, &hash_key) {
                    (Balance::Hash, None) => {
                        return Err(ConfigError::new(
                            &path,
                            service_line("balance:"),
                            format!(
                                "service {name:?}: balance: hash needs a hash_key \
                                 (header:<name>, cookie:<name>, arg:<name> or client_ip)"
                            ),
                        ))
                    }
                    (b, Some(k)) if b != Balance::Hash => warnings.push(format!(
                        "{}: service {name:?}: hash_key {k} is unused with balance: {}",
                        path.display(),
                        b.as_str()
                    )),
                    _ => {}
                }
                let select = Select {
                    balance: svc.balance,
                    hash_key,
                    slow_start_ms: svc.slow_start_ms,
                    zone: gateway_zone.clone(),
                    zone_min_healthy: svc.zone_min_healthy,
                };
                let mut service = Service::with_select(&name, nodes, select);
                service.health = svc.health.clone();
                service.strict = svc.strict;
                service.retries = svc.retries;
                service.read_timeout_ms = svc.read_timeout_ms;
                service.grpc_error_codes = svc.grpc_error_codes;
                service.transport = transport(&svc, &root, &path, &ntext, &name)?;
                if let Some(a) = &svc.health.active {
                    if !a.path.starts_with('/') {
                        return Err(ConfigError::new(
                            &path,
                            find_line(&ntext, Some(&format!("{name}:")), "path:"),
                            format!("health check path {:?} must start with /", a.path),
                        ));
                    }
                }
                // (A Nacos service's instances come and go: `/status`
                // shows them under `nacos`.)
                if service.count(FORMAL) == 0 && !discovered.contains(&name) {
                    warnings.push(format!(
                        "{}: service {name:?} has no formal node: untagged requests get 503",
                        path.display()
                    ));
                }
                services.insert(name, service);
            }
        }

        let static_cache = static_cache_settings(&config, config_path, &text)?;
        let mut routes = Vec::new();
        for r in &config.routes {
            let line = find_line(&text, Some("routes:"), &r.prefix);
            if !r.prefix.starts_with('/') {
                return Err(ConfigError::new(
                    config_path,
                    line,
                    format!("route prefix {:?} must start with /", r.prefix),
                ));
            }
            let target = match (&r.service, &r.static_root) {
                (Some(s), None) => {
                    if !services.contains_key(s) {
                        return Err(ConfigError::new(
                            config_path,
                            find_line(&text, Some("routes:"), &format!("service: {s}")),
                            format!("route {:?} names unknown service {s:?}", r.prefix),
                        ));
                    }
                    Target::Service(s.as_str().into())
                }
                (None, Some(dir)) => {
                    if http::HeaderValue::from_str(&r.cache_control).is_err() {
                        return Err(ConfigError::new(
                            config_path,
                            find_line(&text, Some("routes:"), "cache_control"),
                            format!(
                                "route {:?}: cache_control {:?} is not a valid header value",
                                r.prefix, r.cache_control
                            ),
                        ));
                    }
                    let path = resolve(docs.local_root().unwrap_or(&root), dir);
                    let canon = path.canonicalize().map_err(|e| {
                        ConfigError::new(
                            config_path,
                            line,
                            format!("static root {}: {e}", path.display()),
                        )
                    })?;
                    watch_paths.push(path);
                    if !canon.join(FORMAL).is_dir() {
                        warnings.push(format!(
                            "static root {} has no {FORMAL}/ directory",
                            canon.display()
                        ));
                    }
                    let mut tree =
                        StaticTree::new(canon, r.index.clone(), &r.cache_control, static_cache);
                    tree.precompressed = r.precompressed.clone();
                    Target::Static(tree)
                }
                _ => {
                    return Err(ConfigError::new(
                        config_path,
                        line,
                        format!(
                            "route {:?} needs exactly one of `service` or `static`",
                            r.prefix
                        ),
                    ))
                }
            };
            if r.sticky && config.sticky.is_none() {
                return Err(ConfigError::new(
                    config_path,
                    line,
                    format!(
                        "route {:?} is sticky but there is no `sticky:` section",
                        r.prefix
                    ),
                ));
            }
            routes.push(Route {
                host: r.host.as_ref().map(|h| h.to_ascii_lowercase()),
                prefix: r.prefix.as_str().into(),
                target,
                sticky: r.sticky,
                upgrades: r.upgrades.iter().map(|u| u.to_ascii_lowercase()).collect(),
            });
        }

        let rules = match (&config.rules, &config.rules_file) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    config_path,
                    at("rules_file"),
                    "use either inline `rules` or `rules_file`, not both",
                ))
            }
            (Some(cfg), None) => Some(Rules::compile(
                cfg,
                config_path,
                &text,
                Some("rules:"),
                &lists,
            )?),
            (None, Some(p)) => {
                let path = resolve(&root, p);
                let rtext = docs.read(&path)?;
                let cfg = parse_yaml(&path, &rtext)?;
                files.push(path.clone());
                Some(Rules::compile(&cfg, &path, &rtext, None, &lists)?)
            }
            (None, None) => None,
        };
        if let Some(r) = &rules {
            for lane in r.lanes() {
                if lane != FORMAL && !services.values().any(|s| s.count(lane) > 0) {
                    warnings.push(format!(
                        "rules: lane {lane:?} is served by no node (its requests go to formal nodes)"
                    ));
                }
            }
        }

        // The release state: the store's release keys (etcd), else the
        // local state file next to the rules.
        let (release_file, release_path, release_text) = match docs.releases() {
            Some(kvs) => {
                let (file, path) = super::release::from_store(kvs)?;
                (file, path, String::new())
            }
            None => {
                let path = super::release::state_path(config_path, &config);
                let (file, text) = super::release::load(&path)?;
                files.push(path.clone());
                (file, path, text)
            }
        };
        let (releases, revoked) =
            super::release::compile(&release_file, &release_path, &release_text, &lists)?;
        for r in &release_file.releases {
            if !services.values().any(|s| s.count(&r.spec.lane) > 0) {
                warnings.push(format!(
                    "release {:?}: lane {:?} is served by no node (its requests go to formal nodes)",
                    r.spec.name, r.spec.lane
                ));
            }
        }

        let mut dict_sizes = Vec::new();
        for (name, size) in &config.shared_dicts {
            let bytes = size.bytes().filter(|b| *b > 0).ok_or_else(|| {
                ConfigError::new(
                    config_path,
                    find_line(&text, Some("shared_dicts:"), name),
                    format!("shared dict {name:?}: bad size {size} (e.g. 10m, 512k)"),
                )
            })?;
            dict_sizes.push((name.clone(), bytes));
        }
        let memory_limit = config
            .script_limits
            .memory_limit
            .bytes()
            .filter(|b| *b >= 1 << 20)
            .ok_or_else(|| {
                ConfigError::new(
                    config_path,
                    at("memory_limit"),
                    "script_limits.memory_limit must be at least 1m",
                )
            })?;
        if config.script_limits.instruction_budget < 1_000 {
            return Err(ConfigError::new(
                config_path,
                at("instruction_budget"),
                "script_limits.instruction_budget must be at least 1000",
            ));
        }
        let dicts: BTreeMap<String, Arc<SharedDict>> = dict_sizes
            .iter()
            .map(|(name, bytes)| (name.clone(), shared_dict::pending(name, *bytes)))
            .collect();

        // Where LuaJIT cannot make its code executable it would end the
        // process at the first compiled trace: `true` is refused there,
        // `auto` runs the interpreter.
        let jit = match (config.script_limits.jit, config.script.is_some()) {
            (JitMode::Off, _) | (_, false) => false,
            (JitMode::On, true) => {
                crate::lane::jit_probe::available().map_err(|why| {
                    ConfigError::new(config_path, at("jit"), format!("script_limits.jit: {why}"))
                })?;
                true
            }
            (JitMode::Auto, true) => match crate::lane::jit_probe::available() {
                Ok(()) => true,
                Err(why) => {
                    warnings.push(format!(
                        "script_limits.jit: auto: scripts run on LuaJIT's interpreter: {why} \
                         (script_limits.jit: false says so and skips this check)"
                    ));
                    false
                }
            },
        };
        let script = match &config.script {
            Some(p) => {
                let path = resolve(&root, p);
                let mut src = ScriptSource::load_from(docs, &path)?;
                src.instruction_budget = config.script_limits.instruction_budget;
                src.memory_limit = memory_limit;
                src.jit = jit;
                src.dicts = dicts.clone();
                src.validate(&lists)?;
                files.extend(src.files());
                Some(src)
            }
            None => None,
        };

        if let Some(n) = &config.nacos {
            n.check().map_err(|(key, m)| {
                ConfigError::new(config_path, find_line(&text, Some("nacos:"), key), m)
            })?;
        }
        if let Some(o) = &config.otel {
            o.check().map_err(|(key, m)| {
                ConfigError::new(config_path, find_line(&text, Some("otel:"), key), m)
            })?;
        }
        let sticky = match &config.sticky {
            Some(c) => Some(
                Sticky::from_config(c)
                    .map_err(|m| ConfigError::new(config_path, at("sticky:"), m))?,
            ),
            None => None,
        };
        let mut served_lanes: std::collections::BTreeSet<String> =
            std::iter::once(FORMAL.to_string()).collect();
        for svc in services.values() {
            served_lanes.extend(svc.lanes.keys().cloned());
        }
        for r in &routes {
            if let Target::Static(t) = &r.target {
                if let Ok(rd) = std::fs::read_dir(&t.root) {
                    for e in rd.flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        if e.path().is_dir() && valid_lane(&name) {
                            served_lanes.insert(name);
                        }
                    }
                }
            }
        }

        let mut tls = Vec::with_capacity(config.listeners.len());
        for l in &config.listeners {
            let line = find_line(&text, Some("listeners:"), &l.listen.to_string());
            if l.tls.is_some() && l.h2c {
                return Err(ConfigError::new(
                    config_path,
                    line,
                    format!(
                        "listener {}: h2c is for plain listeners (TLS negotiates h2 by ALPN)",
                        l.listen
                    ),
                ));
            }
            match crate::generation::tls::server_config(l, &root, config_path, line)? {
                Some((cfg, tls_files)) => {
                    files.extend(tls_files);
                    tls.push(Some(cfg));
                }
                None => tls.push(None),
            }
        }
        let trusted = IpList::from_nets(config.trusted_proxies.iter().copied());
        let baggage_on = config.otel.as_ref().filter(|o| o.baggage);
        let baggage_key = baggage_on.map(|o| o.baggage_key.as_str().into());
        let lane_tags: BTreeMap<String, http::HeaderValue> = served_lanes
            .iter()
            .map(String::as_str)
            .chain([FORMAL])
            .filter_map(|l| Some((l.to_string(), http::HeaderValue::from_str(l).ok()?)))
            .collect();
        let lane_baggage = match baggage_on {
            Some(o) => lane_tags
                .keys()
                .filter_map(|l: &String| {
                    let v = http::HeaderValue::from_str(&format!("{}={l}", o.baggage_key)).ok()?;
                    Some((l.clone(), v))
                })
                .collect(),
            None => Default::default(),
        };
        Ok(Generation {
            id,
            lane_baggage,
            config_path: config_path.to_path_buf(),
            config,
            trusted,
            lane: LanePolicy {
                tag_header,
                baggage_key,
                lists,
                rules,
                script,
                sticky,
                served_lanes,
                releases,
                revoked,
            },
            services,
            node_names,
            routes,
            dicts,
            files,
            watch_paths,
            loaded_at: SystemTime::now(),
            warnings,
            lane_tags,
            id_tag: http::HeaderValue::from(id),
            release_records: release_file.releases.clone(),
            tls,
            discovered,
        })
    }

    /// Before the first load: creates the self-signed demo certificates
    /// (`self_signed: true`) whose files are both missing. Errors are
    /// left for the load to report.
    pub fn prepare(config_path: &Path) {
        let Ok(text) = std::fs::read_to_string(config_path) else {
            return;
        };
        let Ok(config) = parse_yaml::<MainConfig>(config_path, &text) else {
            return;
        };
        let config_dir = config_path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let root = match &config.root {
            Some(r) => resolve(config_dir, r),
            None => config_dir.to_path_buf(),
        };
        for l in &config.listeners {
            for c in l.tls.iter().flat_map(|t| &t.certificates) {
                if !c.self_signed {
                    continue;
                }
                let (cert, key) = (resolve(&root, &c.cert), resolve(&root, &c.key));
                match crate::generation::tls::ensure_self_signed(&cert, &key) {
                    Ok(true) => tracing::info!(
                        cert = %cert.display(),
                        "generated a self-signed demo certificate for localhost"
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot generate the demo certificate"),
                }
            }
        }
    }
}

/// A service's transport to its nodes (TLS, HTTP/2), `None` for plain
/// HTTP/1.1.
fn transport(
    svc: &crate::config::ServiceConfig,
    root: &Path,
    path: &Path,
    text: &str,
    name: &str,
) -> Result<Option<Arc<Transport>>, ConfigError> {
    let h2 = svc.protocol == NodeProtocol::H2;
    let tls = match &svc.tls {
        None => None,
        Some(t) => {
            let ca = t.ca.as_ref().map(|p| resolve(root, p));
            if t.insecure_skip_verify {
                tracing::warn!(
                    service = name,
                    "TLS to nodes without certificate verification (insecure_skip_verify)"
                );
            }
            Some(
                TlsConnect::new(
                    ca.as_deref(),
                    t.server_name.as_deref(),
                    t.insecure_skip_verify,
                    h2,
                )
                .map_err(|m| {
                    let file = ca.clone().unwrap_or_else(|| path.to_path_buf());
                    let line = if ca.is_some() {
                        None
                    } else {
                        find_line(text, Some(&format!("{name}:")), "tls")
                    };
                    ConfigError::new(file, line, format!("service {name:?}: {m}"))
                })?,
            )
        }
    };
    Ok((h2 || tls.is_some()).then(|| Arc::new(Transport { h2, tls })))
}

/// `static_cache`, checked: sizes that parse, a file limit within the total
/// (unless the total is 0: no content held),
/// at least one entry per shard, a re-check interval of at most a minute.
fn static_cache_settings(
    config: &MainConfig,
    config_path: &Path,
    text: &str,
) -> Result<CacheSettings, ConfigError> {
    let c = &config.static_cache;
    let err = |key: &str, msg: String| {
        ConfigError::new(config_path, find_line(text, Some("static_cache"), key), msg)
    };
    let max_size = c.max_size.bytes().ok_or_else(|| {
        err(
            "max_size",
            format!(
                "static_cache.max_size: bad size {} (e.g. 64m, 512k, 0 = hold no content)",
                c.max_size
            ),
        )
    })?;
    let max_file_size = c.max_file_size.bytes().ok_or_else(|| {
        err(
            "max_file_size",
            format!(
                "static_cache.max_file_size: bad size {} (e.g. 1m)",
                c.max_file_size
            ),
        )
    })?;
    if max_size > 0 && max_file_size > max_size {
        return Err(err(
            "max_file_size",
            format!("static_cache.max_file_size ({max_file_size} bytes) exceeds max_size ({max_size} bytes)"),
        ));
    }
    if c.max_entries < 16 {
        return Err(err(
            "max_entries",
            "static_cache.max_entries must be at least 16".to_string(),
        ));
    }
    if c.valid_ms > 60_000 {
        return Err(err(
            "valid_ms",
            "static_cache.valid_ms must be at most 60000 (a minute)".to_string(),
        ));
    }
    Ok(CacheSettings {
        max_size,
        max_file_size,
        max_entries: c.max_entries,
        valid_ms: c.valid_ms,
    })
}
