//! Layer: config. The `nacos:` section: where the Nacos servers are and, under
//! `discovery:`, how services a route names but no node file defines are
//! resolved in Nacos naming (group, clusters, the metadata key that is the
//! lane, per-service settings); in a bootstrap file, under `config:`, the
//! group and data id graygate's own documents are read from (a bootstrap
//! is `listen`, `admin_listen` and `nacos:` with `config:`). Plain data;
//! `control::source::nacos` and `control::source::nacos_config` use it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::HealthConfig;

/// `nacos:` in the main file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NacosConfig {
    /// `host:port` of the servers' HTTP port, comma-separated for a cluster
    /// (`10.0.0.1:8848,10.0.0.2:8848`).
    pub server_addr: String,
    /// The servers' gRPC port (default: each server's HTTP port + 1000, as
    /// Nacos 2.x and later listen).
    #[serde(default)]
    pub grpc_port: Option<u16>,
    /// The namespace (its id) services are looked up in.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Nacos auth (optional): both or neither.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Directory of graygate's snapshots (relative to the main file): the
    /// discovered instances, read at start (a gateway started while Nacos
    /// is down serves them), and with `config` the documents; the client's
    /// own copy in `sdk/`. None: no snapshot, the client's copy in
    /// `~/nacos`.
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// Timeout of one request to a server (the first answer of a
    /// subscription, the connection check; the first connection is given
    /// at least 5 s).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Services resolved in Nacos naming (absent: none).
    #[serde(default)]
    pub discovery: Option<NacosDiscovery>,
    /// graygate's own documents from Nacos config (bootstrap files only).
    #[serde(default)]
    pub config: Option<NacosConfigDocs>,
}

/// `nacos.config:` in a bootstrap file: where the main settings are (one
/// data id of one group); every document they name is the data id of its
/// relative path in the same group.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NacosConfigDocs {
    pub group: String,
    pub data_id: String,
}

impl Default for NacosConfigDocs {
    fn default() -> Self {
        NacosConfigDocs {
            group: "DEFAULT_GROUP".into(),
            data_id: "graygate.yaml".into(),
        }
    }
}

/// The local bootstrap of a gateway whose documents live in Nacos config:
/// its own addresses and the `nacos:` section (with `config:`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NacosBootstrap {
    pub listen: SocketAddr,
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    pub nacos: NacosConfig,
    /// `nacos:` as written, without `config:`, as one JSON (= YAML flow)
    /// mapping: what a build of the main settings gets as its `nacos:`.
    #[serde(skip)]
    pub nacos_json: String,
}

impl NacosBootstrap {
    /// Parses a bootstrap file's text (errors name `path` and the line).
    pub fn parse(path: &std::path::Path, text: &str) -> Result<NacosBootstrap, super::ConfigError> {
        let mut b: NacosBootstrap = super::parse_yaml(path, text)?;
        let mut v: serde_yaml::Value = super::parse_yaml(path, text)?;
        let mut n = v.get_mut("nacos").map(std::mem::take).unwrap_or_default();
        if let Some(m) = n.as_mapping_mut() {
            m.remove("config");
        }
        b.nacos_json = serde_json::to_string(&n).unwrap_or_else(|_| "{}".into());
        Ok(b)
    }
}

/// Does this YAML text look like a Nacos bootstrap (a top-level `nacos:`
/// with `config:` in it)?
pub fn is_nacos_bootstrap(text: &str) -> bool {
    serde_yaml::from_str::<serde_yaml::Value>(text)
        .ok()
        .and_then(|v| v.get("nacos").map(|n| n.get("config").is_some()))
        .unwrap_or(false)
}

impl NacosConfig {
    /// Checks what serde cannot: the key at fault and the message.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let addrs: Vec<&str> = self.server_addr.split(',').map(str::trim).collect();
        if let Some(a) = addrs.iter().find(|a| {
            a.rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        }) {
            return Err((
                "server_addr",
                format!(
                    "nacos.server_addr: {a:?} is not host:port (e.g. 10.0.0.1:8848, comma-separated for a cluster)"
                ),
            ));
        }
        if self.username.is_some() != self.password.is_some() {
            return Err((
                if self.username.is_some() {
                    "username"
                } else {
                    "password"
                },
                "nacos: give both username and password, or neither".into(),
            ));
        }
        if self.timeout_ms < 100 {
            return Err(("timeout_ms", "nacos.timeout_ms must be at least 100".into()));
        }
        if let Some(c) = &self.config {
            if c.group.trim().is_empty() {
                return Err(("group", "nacos.config.group must not be empty".into()));
            }
            if c.data_id.trim().is_empty() || c.data_id.starts_with('/') {
                return Err((
                    "data_id",
                    "nacos.config.data_id must be a relative name (e.g. graygate.yaml)".into(),
                ));
            }
        }
        if let Some(d) = &self.discovery {
            if d.group.trim().is_empty() {
                return Err(("group", "nacos.discovery.group must not be empty".into()));
            }
            let keys = std::iter::once(&d.lane_key)
                .chain(d.services.values().filter_map(|s| s.lane_key.as_ref()));
            for k in keys {
                if k.trim().is_empty() {
                    return Err(("lane_key", "nacos: lane_key must not be empty".into()));
                }
            }
        }
        Ok(())
    }
}

fn default_namespace() -> String {
    "public".into()
}

fn default_timeout_ms() -> u64 {
    3_000
}

/// `nacos.discovery:`: services from Nacos naming.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NacosDiscovery {
    /// The group services are looked up in.
    pub group: String,
    /// Only instances of these clusters (empty: every cluster). Filtered by
    /// the gateway, whatever the server does with the list.
    pub clusters: Vec<String>,
    /// The instance metadata key whose value is the instance's lane
    /// (`version: gray-1.0` → lane `gray-1.0`).
    pub lane_key: String,
    /// Values of `lane_key` that mean formal (an instance without the key
    /// is formal too).
    pub formal_values: Vec<String>,
    /// Per-service settings, by service name.
    pub services: BTreeMap<String, NacosService>,
}

impl Default for NacosDiscovery {
    fn default() -> Self {
        NacosDiscovery {
            group: "DEFAULT_GROUP".into(),
            clusters: Vec::new(),
            lane_key: "version".into(),
            formal_values: Vec::new(),
            services: BTreeMap::new(),
        }
    }
}

/// `nacos.discovery.services.<name>:`: one service's settings; what is not
/// set is the discovery's (`lane_key`, `formal_values`) or a node file's
/// default (`health`, `strict`, `retries`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NacosService {
    pub lane_key: Option<String>,
    pub formal_values: Option<Vec<String>>,
    pub health: HealthConfig,
    /// When every node of a gray lane is down: 503 instead of formal.
    pub strict: bool,
    /// Overrides `upstream.retries` for this service.
    pub retries: Option<u32>,
}
