//! Layer: control plane. Building a generation: every file reachable from the
//! main config is read, parsed, validated and compiled (the Lua top level runs
//! in a fresh sandbox) into one [`Generation`], or the first error is returned
//! with its file:line. [`Generation::build`] is a list of named steps over
//! one `Build` context (main document, lists, zone, services and their
//! nodes, routes, rules, releases, dictionaries, script, otel, sticky,
//! listener TLS), in a fixed order so the first error is always the same
//! one. A build has no effect on live state, whether it is
//! accepted or not: its shared dictionaries are build-private copies (the
//! script's top level runs against them) and what a generation shares with
//! the running gateway (dictionaries, health, counters) is attached by
//! `Gateway::install` only once it is accepted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::SystemTime;

use http::HeaderName;

use crate::base::lists::IpList;
use crate::config::docs::{Docs, FileDocs};
use crate::config::release::ReleaseRecord;
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

pub use super::source::RegisteredServices;

/// What a node file (or a registry) says of one service: the document, its
/// text (for lines in errors), the service's name and settings.
type ServiceDef = (PathBuf, Rc<String>, String, ServiceConfig);

/// One build under way: the main document and what the steps add to as
/// they go (files to watch, warnings). Each step reads its part of the
/// configuration and returns it compiled, or the first error.
struct Build<'a> {
    docs: &'a dyn Docs,
    config_path: &'a Path,
    text: String,
    config: MainConfig,
    root: PathBuf,
    files: Vec<PathBuf>,
    watch_paths: Vec<PathBuf>,
    warnings: Vec<String>,
    /// Services a route names and only Nacos defines (`nacos.discovery`).
    discovered: Vec<String>,
}

impl Generation {
    /// Loads, validates and compiles everything reachable from `config_path`.
    pub fn load(config_path: &Path, id: u64) -> Result<Generation, ConfigError> {
        Generation::build(&FileDocs, config_path, Vec::new(), id)
    }

    /// Builds a generation from `docs` (the files, or one snapshot of a
    /// store), `config_path` naming the main document, plus `registered`
    /// services. The same validation whatever the source; the steps run in
    /// this order, so the first error is always the same one.
    pub fn build(
        docs: &dyn Docs,
        config_path: &Path,
        registered: RegisteredServices,
        id: u64,
    ) -> Result<Generation, ConfigError> {
        let mut b = Build::main(docs, config_path)?;
        let tag_header = b.tag_header()?;
        let lists = b.lists()?;
        let zone = b.gateway_zone()?;
        let (services, node_names) = b.services(registered, zone)?;
        let routes = b.routes(&services)?;
        let rules = b.rules(&lists, &services)?;
        let (release_records, releases, revoked) = b.releases(&lists, &services)?;
        let dicts = b.dicts()?;
        let memory_limit = b.script_limits()?;
        let script = b.script(&lists, &dicts, memory_limit)?;
        b.otel()?;
        b.discovery()?;
        let sticky = b.sticky()?;
        let served_lanes = served_lanes(&services, &routes);
        let tls = b.listener_tls()?;
        let lane_tags = lane_tags(&served_lanes);
        let baggage_on = b.config.otel.as_ref().filter(|o| o.baggage);
        let lane_baggage = match baggage_on {
            Some(o) => lane_baggage(&o.baggage_key, &lane_tags),
            None => Default::default(),
        };
        let baggage_key = baggage_on.map(|o| o.baggage_key.as_str().into());
        let trusted = IpList::from_nets(b.config.trusted_proxies.iter().copied());
        Ok(Generation {
            id,
            lane_baggage,
            config_path: config_path.to_path_buf(),
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
            config: b.config,
            services,
            node_names,
            routes,
            dicts,
            files: b.files,
            watch_paths: b.watch_paths,
            loaded_at: SystemTime::now(),
            warnings: b.warnings,
            lane_tags,
            id_tag: http::HeaderValue::from(id),
            release_records,
            tls,
            discovered: b.discovered,
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

impl<'a> Build<'a> {
    /// Step 1: the main document, parsed, and the root its paths resolve
    /// against.
    fn main(docs: &'a dyn Docs, config_path: &'a Path) -> Result<Build<'a>, ConfigError> {
        let text = docs.read(config_path)?;
        let config: MainConfig = parse_yaml(config_path, &text)?;
        let root = config.root_dir(config_path);
        Ok(Build {
            docs,
            config_path,
            text,
            config,
            root,
            files: vec![config_path.to_path_buf()],
            watch_paths: Vec::new(),
            warnings: Vec::new(),
            discovered: Vec::new(),
        })
    }

    /// The line of the main document holding `needle`.
    fn at(&self, needle: &str) -> Option<usize> {
        find_line(&self.text, None, needle)
    }

    /// The line of the main document holding `needle` after `section`.
    fn at_in(&self, section: &str, needle: &str) -> Option<usize> {
        find_line(&self.text, Some(section), needle)
    }

    /// An error in the main document.
    fn error(&self, line: Option<usize>, message: impl Into<String>) -> ConfigError {
        ConfigError::new(self.config_path, line, message)
    }

    fn tag_header(&self) -> Result<HeaderName, ConfigError> {
        let name = HeaderName::from_bytes(self.config.tag_header.as_bytes()).map_err(|_| {
            self.error(
                self.at("tag_header"),
                format!("invalid header name {:?}", self.config.tag_header),
            )
        })?;
        if let Some(why) = owned_field(&name) {
            return Err(self.error(
                self.at("tag_header"),
                format!(
                    "tag_header {:?} is {why}: the lane would overwrite it on every request \
                     (pick a name of its own, e.g. X-Gray-Tag)",
                    self.config.tag_header
                ),
            ));
        }
        Ok(name)
    }

    /// The named IP lists (`lists:`), each from its file.
    fn lists(&mut self) -> Result<Arc<BTreeMap<String, IpList>>, ConfigError> {
        let mut lists = BTreeMap::new();
        for (name, p) in &self.config.lists {
            let path = resolve(&self.root, p);
            lists.insert(name.clone(), IpList::load_from(self.docs, &path)?);
            self.files.push(path);
        }
        Ok(Arc::new(lists))
    }

    /// The gateway's zone (`GRAYGATE_ZONE` or `zone:`), checked.
    fn gateway_zone(&self) -> Result<Option<Arc<str>>, ConfigError> {
        match self.config.gateway_zone() {
            Some(z) if !valid_lane(&z) => {
                let from_env = std::env::var(ZONE_ENV).is_ok_and(|e| !e.trim().is_empty());
                Err(self.error(
                    if from_env { None } else { self.at("zone:") },
                    format!(
                        "invalid zone name {z:?}{} (letters, digits, - _ . only)",
                        if from_env { " in GRAYGATE_ZONE" } else { "" }
                    ),
                ))
            }
            z => Ok(z.map(Into::into)),
        }
    }

    /// The services: those of the node files (each defined once), with the
    /// `registered` ones added (a registered service a node file also
    /// defines gets its nodes appended), each compiled; and the node
    /// addresses written as host names.
    fn services(
        &mut self,
        registered: RegisteredServices,
        zone: Option<Arc<str>>,
    ) -> Result<(BTreeMap<String, Service>, Vec<NodeName>), ConfigError> {
        if self.config.resolve_interval_ms < 100 {
            return Err(self.error(
                self.at("resolve_interval_ms"),
                "resolve_interval_ms must be at least 100",
            ));
        }
        let mut defs = self.node_files()?;
        for (key, name, svc) in registered {
            match defs.iter_mut().find(|d| d.2 == name) {
                Some(d) => d.3.nodes.extend(svc.nodes),
                None => defs.push((key, Default::default(), name, svc)),
            }
        }
        self.discovered(&mut defs);
        let mut services = BTreeMap::new();
        let mut node_names = Vec::new();
        for def in defs {
            let service = self.service(def, &zone, &mut node_names)?;
            services.insert(service.name.to_string(), service);
        }
        Ok((services, node_names))
    }

    /// The services the node files define, in order; a service defined in
    /// two files is an error.
    fn node_files(&mut self) -> Result<Vec<ServiceDef>, ConfigError> {
        let mut defs: Vec<ServiceDef> = Vec::new();
        let mut service_file: BTreeMap<String, PathBuf> = BTreeMap::new();
        for p in &self.config.node_files {
            let path = resolve(&self.root, p);
            let ntext = self.docs.read(&path)?;
            let nf: NodeFile = parse_yaml(&path, &ntext)?;
            let ntext = Rc::new(ntext);
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
            self.files.push(path);
        }
        Ok(defs)
    }

    /// One service compiled: its nodes, selection, health and transport.
    fn service(
        &mut self,
        (path, ntext, name, svc): ServiceDef,
        zone: &Option<Arc<str>>,
        node_names: &mut Vec<NodeName>,
    ) -> Result<Service, ConfigError> {
        let service_line = |needle: &str| find_line(&ntext, Some(&format!("{name}:")), needle);
        let nodes = self.nodes(&path, &ntext, &name, &svc, node_names)?;
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
            (b, Some(k)) if b != Balance::Hash => self.warnings.push(format!(
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
            zone: zone.clone(),
            zone_min_healthy: svc.zone_min_healthy,
        };
        let mut service = Service::with_select(&name, nodes, select);
        service.health = svc.health.clone();
        service.strict = svc.strict;
        service.retries = svc.retries;
        service.read_timeout_ms = svc.read_timeout_ms;
        service.grpc_error_codes = svc.grpc_error_codes;
        service.transport = transport(&svc, &self.root, &path, &ntext, &name)?;
        if let Some(a) = &svc.health.active {
            if !a.path.starts_with('/') {
                return Err(ConfigError::new(
                    &path,
                    service_line("path:"),
                    format!("health check path {:?} must start with /", a.path),
                ));
            }
        }
        // (A Nacos service's instances come and go: `/status` shows them
        // under `nacos`.)
        if service.count(FORMAL) == 0 && !self.discovered.contains(&name) {
            self.warnings.push(format!(
                "{}: service {name:?} has no formal node: untagged requests get 503",
                path.display()
            ));
        }
        Ok(service)
    }

    /// A service's nodes: lanes and zones checked, host names resolved (a
    /// node per address, an address listed once).
    fn nodes(
        &mut self,
        path: &Path,
        ntext: &str,
        name: &str,
        svc: &ServiceConfig,
        node_names: &mut Vec<NodeName>,
    ) -> Result<Vec<Node>, ConfigError> {
        let line = |needle: &str| find_line(ntext, Some(&format!("{name}:")), needle);
        let interval = std::time::Duration::from_millis(self.config.resolve_interval_ms);
        let mut nodes = Vec::new();
        for (i, n) in svc.nodes.iter().enumerate() {
            if !valid_lane(&n.lane) {
                return Err(ConfigError::new(
                    path,
                    line(&n.lane),
                    format!(
                        "invalid lane name {:?} (letters, digits, - _ . only)",
                        n.lane
                    ),
                ));
            }
            if let Some(z) = n.zone.as_deref().filter(|z| !valid_lane(z)) {
                return Err(ConfigError::new(
                    path,
                    line(z),
                    format!("invalid zone name {z:?} (letters, digits, - _ . only)"),
                ));
            }
            match &n.addr {
                NodeAddr::Ip(a) => nodes.push(Node::from_config(name, i, n, *a)),
                NodeAddr::Name { host, port } => {
                    let ips = super::names::NAMES
                        .addresses(self.config.resolver.as_ref(), host, interval)
                        .map_err(|e| {
                            ConfigError::new(
                                path,
                                line(host),
                                format!("service {name:?}: node address {}: {e}", n.addr),
                            )
                        })?;
                    let mut addrs = Vec::new();
                    for ip in ips {
                        let a = SocketAddr::new(ip, *port);
                        addrs.push(a);
                        if nodes.iter().any(|m: &Node| m.addr == a) {
                            self.warnings.push(format!(
                                "{}: service {name:?}: {} resolves to {a}, already a node of the service: listed once",
                                path.display(),
                                n.addr
                            ));
                            continue;
                        }
                        nodes.push(Node::from_config(name, i, n, a));
                    }
                    node_names.push(NodeName {
                        service: name.to_string(),
                        host: host.clone(),
                        port: *port,
                        addrs,
                    });
                }
            }
        }
        Ok(nodes)
    }

    /// The routes, each to a known service or a static root.
    fn routes(&mut self, services: &BTreeMap<String, Service>) -> Result<Vec<Route>, ConfigError> {
        let static_cache = static_cache_settings(&self.config, self.config_path, &self.text)?;
        let mut routes = Vec::new();
        for r in &self.config.routes {
            let line = self.at_in("routes:", &r.prefix);
            if !r.prefix.starts_with('/') {
                return Err(self.error(
                    line,
                    format!("route prefix {:?} must start with /", r.prefix),
                ));
            }
            let target = match (&r.service, &r.static_root) {
                (Some(s), None) => {
                    if !services.contains_key(s) {
                        return Err(self.error(
                            self.at_in("routes:", &format!("service: {s}")),
                            format!("route {:?} names unknown service {s:?}", r.prefix),
                        ));
                    }
                    Target::Service(s.as_str().into())
                }
                (None, Some(dir)) => {
                    if http::HeaderValue::from_str(&r.cache_control).is_err() {
                        return Err(self.error(
                            self.at_in("routes:", "cache_control"),
                            format!(
                                "route {:?}: cache_control {:?} is not a valid header value",
                                r.prefix, r.cache_control
                            ),
                        ));
                    }
                    let path = resolve(self.docs.local_root().unwrap_or(&self.root), dir);
                    let canon = path.canonicalize().map_err(|e| {
                        self.error(line, format!("static root {}: {e}", path.display()))
                    })?;
                    self.watch_paths.push(path);
                    if !canon.join(FORMAL).is_dir() {
                        self.warnings.push(format!(
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
                    return Err(self.error(
                        line,
                        format!(
                            "route {:?} needs exactly one of `service` or `static`",
                            r.prefix
                        ),
                    ))
                }
            };
            if r.sticky && self.config.sticky.is_none() {
                return Err(self.error(
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
        Ok(routes)
    }

    /// The declarative rules, inline (`rules:`) or from `rules_file`.
    fn rules(
        &mut self,
        lists: &Arc<BTreeMap<String, IpList>>,
        services: &BTreeMap<String, Service>,
    ) -> Result<Option<Rules>, ConfigError> {
        let rules = match (&self.config.rules, &self.config.rules_file) {
            (Some(_), Some(_)) => {
                return Err(self.error(
                    self.at("rules_file"),
                    "use either inline `rules` or `rules_file`, not both",
                ))
            }
            (Some(cfg), None) => Some(Rules::compile(
                cfg,
                self.config_path,
                &self.text,
                Some("rules:"),
                lists,
            )?),
            (None, Some(p)) => {
                let path = resolve(&self.root, p);
                let rtext = self.docs.read(&path)?;
                let cfg = parse_yaml(&path, &rtext)?;
                self.files.push(path.clone());
                Some(Rules::compile(&cfg, &path, &rtext, None, lists)?)
            }
            (None, None) => None,
        };
        if let Some(r) = &rules {
            for lane in r.lanes() {
                if lane != FORMAL && !services.values().any(|s| s.count(lane) > 0) {
                    self.warnings.push(format!(
                        "rules: lane {lane:?} is served by no node (its requests go to formal nodes)"
                    ));
                }
            }
        }
        Ok(rules)
    }

    /// The release state: the store's release keys (etcd), else the local
    /// state file; its records, compiled releases and revoked lanes.
    #[allow(clippy::type_complexity)]
    fn releases(
        &mut self,
        lists: &Arc<BTreeMap<String, IpList>>,
        services: &BTreeMap<String, Service>,
    ) -> Result<(Vec<ReleaseRecord>, Option<Rules>, BTreeSet<String>), ConfigError> {
        let (release_file, release_path, release_text) = match self.docs.releases() {
            Some(kvs) => {
                let (file, path) = super::release::from_store(kvs)?;
                (file, path, String::new())
            }
            None => {
                // A store without release records (Nacos config): the
                // state file on this gateway's disk, as with files.
                let path = match self.docs.local_root() {
                    Some(dir) => resolve(
                        dir,
                        self.config
                            .release_state_file
                            .as_deref()
                            .unwrap_or(Path::new("releases.json")),
                    ),
                    None => self.config.release_state_path(self.config_path),
                };
                let (file, text) = super::release::load(&path)?;
                self.files.push(path.clone());
                (file, path, text)
            }
        };
        let (releases, revoked) =
            super::release::compile(&release_file, &release_path, &release_text, lists)?;
        for r in &release_file.releases {
            if !services.values().any(|s| s.count(&r.spec.lane) > 0) {
                self.warnings.push(format!(
                    "release {:?}: lane {:?} is served by no node (its requests go to formal nodes)",
                    r.spec.name, r.spec.lane
                ));
            }
        }
        Ok((release_file.releases, releases, revoked))
    }

    /// The shared dictionaries (`shared_dicts:`), build-private until the
    /// generation is installed.
    fn dicts(&self) -> Result<BTreeMap<String, Arc<SharedDict>>, ConfigError> {
        let mut dicts = BTreeMap::new();
        for (name, size) in &self.config.shared_dicts {
            let bytes = size.bytes().filter(|b| *b > 0).ok_or_else(|| {
                self.error(
                    self.at_in("shared_dicts:", name),
                    format!("shared dict {name:?}: bad size {size} (e.g. 10m, 512k)"),
                )
            })?;
            dicts.insert(name.clone(), bytes);
        }
        Ok(dicts
            .into_iter()
            .map(|(name, bytes)| {
                let d = shared_dict::pending(&name, bytes);
                (name, d)
            })
            .collect())
    }

    /// `script_limits`, checked: the memory limit in bytes (at least 1m)
    /// and an instruction budget of at least 1000.
    fn script_limits(&self) -> Result<usize, ConfigError> {
        let limits = &self.config.script_limits;
        let memory_limit = limits
            .memory_limit
            .bytes()
            .filter(|b| *b >= 1 << 20)
            .ok_or_else(|| {
                self.error(
                    self.at("memory_limit"),
                    "script_limits.memory_limit must be at least 1m",
                )
            })?;
        if limits.instruction_budget < 1_000 {
            return Err(self.error(
                self.at("instruction_budget"),
                "script_limits.instruction_budget must be at least 1000",
            ));
        }
        Ok(memory_limit)
    }

    /// Whether the script runs on LuaJIT's trace compiler. Where LuaJIT
    /// cannot make its code executable it would end the process at the
    /// first compiled trace: `true` is refused there, `auto` runs the
    /// interpreter.
    fn jit(&mut self) -> Result<bool, ConfigError> {
        match (self.config.script_limits.jit, self.config.script.is_some()) {
            (JitMode::Off, _) | (_, false) => Ok(false),
            (JitMode::On, true) => {
                crate::lane::jit_probe::available().map_err(|why| {
                    self.error(self.at("jit"), format!("script_limits.jit: {why}"))
                })?;
                Ok(true)
            }
            (JitMode::Auto, true) => match crate::lane::jit_probe::available() {
                Ok(()) => Ok(true),
                Err(why) => {
                    self.warnings.push(format!(
                        "script_limits.jit: auto: scripts run on LuaJIT's interpreter: {why} \
                         (script_limits.jit: false says so and skips this check)"
                    ));
                    Ok(false)
                }
            },
        }
    }

    /// The lane script with its modules, its top level run once in a
    /// fresh VM to prove it yields a lane function.
    fn script(
        &mut self,
        lists: &Arc<BTreeMap<String, IpList>>,
        dicts: &BTreeMap<String, Arc<SharedDict>>,
        memory_limit: usize,
    ) -> Result<Option<ScriptSource>, ConfigError> {
        let jit = self.jit()?;
        let Some(p) = &self.config.script else {
            return Ok(None);
        };
        let path = resolve(&self.root, p);
        let mut src = ScriptSource::load_from(self.docs, &path)?;
        src.instruction_budget = self.config.script_limits.instruction_budget;
        src.memory_limit = memory_limit;
        src.jit = jit;
        src.dicts = dicts.clone();
        src.validate(lists)?;
        self.files.extend(src.files());
        Ok(Some(src))
    }

    /// Services a route names and nothing else defines: from service
    /// discovery (`source::discovery`), when configured (an unknown service
    /// is an empty node set, kept current by the discovery source).
    fn discovered(&mut self, defs: &mut Vec<ServiceDef>) {
        if !super::source::discovery::enabled(&self.config) {
            return;
        }
        for r in &self.config.routes {
            let Some(name) = &r.service else { continue };
            if defs.iter().any(|d| &d.2 == name) {
                continue;
            }
            let Some((svc, mut w)) = super::source::discovery::service(&self.config, name) else {
                return;
            };
            self.warnings.append(&mut w);
            self.discovered.push(name.clone());
            defs.push((
                self.config_path.to_path_buf(),
                Default::default(),
                name.clone(),
                svc,
            ));
        }
    }

    /// The discovery settings checked.
    fn discovery(&self) -> Result<(), ConfigError> {
        super::source::discovery::check(&self.config)
            .map_err(|e| self.error(self.at_in(e.section, &e.key), e.message))
    }

    fn otel(&self) -> Result<(), ConfigError> {
        if let Some(o) = &self.config.otel {
            o.check()
                .map_err(|(key, m)| self.error(self.at_in("otel:", key), m))?;
        }
        Ok(())
    }

    fn sticky(&self) -> Result<Option<Sticky>, ConfigError> {
        self.config
            .sticky
            .as_ref()
            .map(|c| Sticky::from_config(c).map_err(|m| self.error(self.at("sticky:"), m)))
            .transpose()
    }

    /// Each listener's TLS settings (`None`: plain), their files watched.
    #[allow(clippy::type_complexity)]
    fn listener_tls(&mut self) -> Result<Vec<Option<Arc<rustls::ServerConfig>>>, ConfigError> {
        let mut tls = Vec::with_capacity(self.config.listeners.len());
        for l in &self.config.listeners {
            let line = self.at_in("listeners:", &l.listen.to_string());
            if l.tls.is_some() && l.h2c {
                return Err(self.error(
                    line,
                    format!(
                        "listener {}: h2c is for plain listeners (TLS negotiates h2 by ALPN)",
                        l.listen
                    ),
                ));
            }
            match crate::generation::tls::server_config(l, &self.root, self.config_path, line)? {
                Some((cfg, tls_files)) => {
                    self.files.extend(tls_files);
                    tls.push(Some(cfg));
                }
                None => tls.push(None),
            }
        }
        Ok(tls)
    }
}

/// The lanes something serves: formal, every node's lane and every lane
/// directory of a static root.
fn served_lanes(services: &BTreeMap<String, Service>, routes: &[Route]) -> BTreeSet<String> {
    let mut served: BTreeSet<String> = std::iter::once(FORMAL.to_string()).collect();
    for svc in services.values() {
        served.extend(svc.lanes.keys().cloned());
    }
    for r in routes {
        if let Target::Static(t) = &r.target {
            if let Ok(rd) = std::fs::read_dir(&t.root) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if e.path().is_dir() && valid_lane(&name) {
                        served.insert(name);
                    }
                }
            }
        }
    }
    served
}

/// Each served lane's tag header value, made once.
fn lane_tags(served: &BTreeSet<String>) -> BTreeMap<String, http::HeaderValue> {
    served
        .iter()
        .map(String::as_str)
        .chain([FORMAL])
        .filter_map(|l| Some((l.to_string(), http::HeaderValue::from_str(l).ok()?)))
        .collect()
}

/// Each lane's baggage member (`key=lane`), made once.
fn lane_baggage(
    key: &str,
    lane_tags: &BTreeMap<String, http::HeaderValue>,
) -> BTreeMap<String, http::HeaderValue> {
    lane_tags
        .keys()
        .filter_map(|l| {
            let v = http::HeaderValue::from_str(&format!("{key}={l}")).ok()?;
            Some((l.clone(), v))
        })
        .collect()
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

/// Why `name` cannot carry the lane: a field HTTP itself or the gateway
/// owns, which the tag would overwrite upstream.
fn owned_field(name: &HeaderName) -> Option<&'static str> {
    use crate::upstream::fields as f;
    use http::header;
    let framing = [
        header::HOST,
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
        header::EXPECT,
    ];
    let gateway = [
        f::X_FORWARDED_FOR,
        f::X_FORWARDED_PROTO,
        f::X_FORWARDED_HOST,
        f::GENERATION_HEADER,
        crate::base::trace::TRACEPARENT,
        crate::base::trace::TRACESTATE,
        crate::base::baggage::BAGGAGE,
    ];
    if framing.contains(name) {
        Some("a field that routes or frames the request")
    } else if f::HOP_BY_HOP.contains(name) {
        Some("a hop-by-hop field")
    } else if gateway.contains(name) {
        Some("a field the gateway writes itself")
    } else {
        None
    }
}
