//! Layer: config (bottom; imports nothing of the crate). Configuration files:
//! the main YAML file and the node files it names, parsed into plain structs.
//! Every error carries `file:line` so `graygate --check` reads like `nginx -t`.
//!
//! Each default is written once. A struct whose every key is optional says
//! `#[serde(default)]` and holds its defaults in its one `impl Default`; a
//! struct with a required key (serde cannot take the rest from `Default`)
//! names one function per default that is not the type's own.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use addr::{NodeAddr, Resolvers};

pub mod addr;
pub mod docs;
pub mod grpc;
pub mod nacos;
pub mod otel;
pub mod release;
pub mod rules;

/// What a single lane call may run before it is stopped, each loop
/// iteration or call charging 10 (the `script/runaway` benchmark measures
/// it in time).
pub const DEFAULT_INSTRUCTION_BUDGET: u64 = 300_000;
/// Memory a script VM may allocate.
pub const DEFAULT_MEMORY_LIMIT: usize = 64 * 1024 * 1024;

/// Parses a size like `10m`, `512k`, `1g` or a plain byte count.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1024),
        (i, 'm' | 'M') => (&s[..i], 1024 * 1024),
        (i, 'g' | 'G') => (&s[..i], 1024 * 1024 * 1024),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// Deserializes a size — a byte count, or a number with `k`, `m` or `g`
/// (`64m`, as [`parse_size`] reads it) — into the integer type of the key
/// (`#[serde(deserialize_with = "size")]`): every size key reads through
/// here, so each accepts what the reference documents.
pub fn size<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<u64>,
{
    use serde::de::Error;
    let n = d.deserialize_any(SizeVisitor)?;
    T::try_from(n).map_err(|_| D::Error::custom(format!("size {n} is too large for this key")))
}

struct SizeVisitor;

impl serde::de::Visitor<'_> for SizeVisitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a size: bytes, or a number with k, m or g (64m)")
    }
    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<u64, E> {
        Ok(n)
    }
    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<u64, E> {
        u64::try_from(n).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<u64, E> {
        parse_size(s)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| E::invalid_value(serde::de::Unexpected::Str(s), &self))
    }
}

/// The lane every request falls back to.
pub const FORMAL: &str = "formal";

/// A configuration error located in a file (and a line where known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl ConfigError {
    pub fn new(file: impl Into<PathBuf>, line: Option<usize>, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.into(),
            line,
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file.display(), line, self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The main configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MainConfig {
    /// Client-facing listener.
    pub listen: SocketAddr,
    /// Admin listener (`/status`).
    pub admin_listen: Option<SocketAddr>,
    /// Directory that relative paths are resolved against; itself relative to
    /// the config file's directory. Defaults to that directory.
    #[serde(default)]
    pub root: Option<PathBuf>,
    /// Header carrying the decided lane upstream.
    #[serde(default = "default_tag_header")]
    pub tag_header: String,
    /// Peers whose X-Forwarded-For and tag header are believed.
    #[serde(default)]
    pub trusted_proxies: Vec<IpNet>,
    /// Lua script deciding the lane (optional: without it every request is formal).
    #[serde(default)]
    pub script: Option<PathBuf>,
    /// Named IP/CIDR lists, one entry a line.
    #[serde(default)]
    pub lists: BTreeMap<String, PathBuf>,
    /// YAML files describing services and their nodes.
    #[serde(default)]
    pub node_files: Vec<PathBuf>,
    /// DNS servers asked for node host names (`ip` or `ip:port`, one or a
    /// list), as nginx's `resolver`. Absent: the system's resolver
    /// (`/etc/hosts`, `/etc/resolv.conf`).
    #[serde(default)]
    pub resolver: Option<Resolvers>,
    /// How often node host names are resolved again (sooner when an
    /// answer's TTL runs out first, at most once a second for that).
    #[serde(default = "default_resolve_interval_ms")]
    pub resolve_interval_ms: u64,
    /// Routes, matched by host and longest path prefix.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    /// Demo API nodes the gateway runs in-process (for the shipped example).
    #[serde(default)]
    pub demo_nodes: Vec<DemoNode>,
    /// Milliseconds of quiet after a file change before reloading.
    #[serde(default = "default_debounce_ms")]
    pub reload_debounce_ms: u64,
    /// Declarative gray rules, inline (format: `config::rules::RulesConfig`).
    #[serde(default)]
    pub rules: Option<rules::RulesConfig>,
    /// Declarative gray rules in their own hot-reloaded file.
    #[serde(default)]
    pub rules_file: Option<PathBuf>,
    /// Where progressive releases keep their state (JSON, written by the
    /// release controller; watched like every file). Default
    /// `releases.json` under `root`.
    #[serde(default)]
    pub release_state_file: Option<PathBuf>,
    /// `ngx.shared` dictionaries: name → size (`10m`, `512k` or bytes).
    #[serde(default)]
    pub shared_dicts: BTreeMap<String, SizeValue>,
    /// Per-call and per-VM limits of the Lua script.
    #[serde(default)]
    pub script_limits: ScriptLimits,
    /// Client-side limits and timeouts (slowloris, keep-alive, caps, drain).
    #[serde(default)]
    pub client: ClientConfig,
    /// Signed sticky-lane cookie for routes with `sticky: true`.
    #[serde(default)]
    pub sticky: Option<StickyConfig>,
    /// Worker threads serving requests (default: one per CPU). With 1 the
    /// gateway runs a single-threaded runtime, like one nginx worker.
    #[serde(default)]
    pub workers: Option<usize>,
    /// Bearer token for the admin API (also `GRAYGATE_ADMIN_TOKEN`).
    /// Required when `admin_listen` is not a loopback address.
    #[serde(default)]
    pub admin_token: Option<String>,
    /// Access log (off when absent).
    #[serde(default)]
    pub access_log: Option<AccessLogConfig>,
    /// Response header showing clients their lane (off when absent).
    #[serde(default)]
    pub lane_response_header: Option<HeaderNameConf>,
    /// More client listeners besides `listen`, each plain or TLS.
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    /// HTTP/2 limits of client connections (TLS with ALPN `h2`, or h2c).
    #[serde(default)]
    pub http2: Http2Config,
    /// File the process writes its pid to (read at start-up).
    #[serde(default)]
    pub pid_file: Option<PathBuf>,
    /// Unix socket a successor connects to for the listening sockets
    /// (binary upgrade); defaults to `graygate.sock` beside `pid_file`.
    #[serde(default)]
    pub upgrade_socket: Option<PathBuf>,
    /// The gateway's own zone (availability zone, rack, data centre): nodes
    /// of the same `zone` are preferred. `GRAYGATE_ZONE`, when set and not
    /// empty, wins over this key (one config file shipped to every zone).
    #[serde(default)]
    pub zone: Option<String>,
    /// The open-file and content cache of static trees (nginx's
    /// `open_file_cache`).
    #[serde(default)]
    pub static_cache: StaticCacheConfig,
    /// OpenTelemetry: the lane in W3C baggage, trace context, spans over
    /// OTLP (off when absent).
    #[serde(default)]
    pub otel: Option<otel::OtelConfig>,
    /// Nacos: services a route names and no node file defines, resolved in
    /// Nacos naming and kept current by subscription (absent: none).
    #[serde(default)]
    pub nacos: Option<nacos::NacosConfig>,
}

fn default_tag_header() -> String {
    "X-Gray-Tag".to_string()
}

/// Quiet time before a reload, after a file change or a watch event.
fn default_debounce_ms() -> u64 {
    150
}

/// Envoy's `dns_refresh_rate` default.
fn default_resolve_interval_ms() -> u64 {
    5_000
}

/// The open-file and content cache of each static tree.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StaticCacheConfig {
    /// File content one static tree's cache may hold in memory.
    pub max_size: SizeValue,
    /// Files larger than this are read in chunks per request, never held.
    pub max_file_size: SizeValue,
    /// (lane, path) entries one tree's cache may hold (files, directories
    /// and misses alike).
    pub max_entries: usize,
    /// A cached entry is checked against the disk (`stat`) when it is
    /// older than this.
    pub valid_ms: u64,
}

impl Default for StaticCacheConfig {
    fn default() -> Self {
        StaticCacheConfig {
            max_size: SizeValue::Bytes(64 << 20),
            max_file_size: SizeValue::Bytes(1 << 20),
            max_entries: 10_000,
            valid_ms: 500,
        }
    }
}

/// Environment variable naming the gateway's zone; it wins over `zone:`.
pub const ZONE_ENV: &str = "GRAYGATE_ZONE";

impl MainConfig {
    /// The directory relative paths resolve against: `root`, itself
    /// relative to the directory of `config_path` (the main file).
    pub fn root_dir(&self, config_path: &Path) -> PathBuf {
        let dir = config_path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        self.root
            .as_ref()
            .map_or(dir.to_path_buf(), |r| resolve(dir, r))
    }

    /// The release state file (`release_state_file`, default
    /// `releases.json` under [`root_dir`](Self::root_dir)).
    pub fn release_state_path(&self, config_path: &Path) -> PathBuf {
        resolve(
            &self.root_dir(config_path),
            self.release_state_file
                .as_deref()
                .unwrap_or(Path::new("releases.json")),
        )
    }

    /// The gateway's zone: `GRAYGATE_ZONE` if set and not empty, else the
    /// `zone` key; `None` means no zone preference.
    pub fn gateway_zone(&self) -> Option<String> {
        std::env::var(ZONE_ENV)
            .ok()
            .map(|z| z.trim().to_string())
            .filter(|z| !z.is_empty())
            .or_else(|| self.zone.clone().filter(|z| !z.is_empty()))
    }
}

/// One more client listener: plain (optionally accepting h2c with prior
/// knowledge) or TLS (HTTP/2 and HTTP/1.1 by ALPN).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub listen: SocketAddr,
    /// TLS termination; absent = plain HTTP.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Plain listener only: accept HTTP/2 with prior knowledge (h2c) besides
    /// HTTP/1.1.
    #[serde(default)]
    pub h2c: bool,
    /// TLS listener only: offer `h2` in ALPN (else HTTP/1.1 only).
    #[serde(default = "yes")]
    pub http2: bool,
}

/// Certificates of a TLS listener, chosen by SNI.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub certificates: Vec<CertConfig>,
    /// Oldest protocol version accepted: `"1.2"` or `"1.3"`.
    #[serde(default = "default_min_tls")]
    pub min_version: String,
    /// Stateless session tickets (TLS 1.3 and 1.2) besides the
    /// server-side session cache.
    #[serde(default = "yes")]
    pub session_tickets: bool,
}

fn default_min_tls() -> String {
    "1.2".to_string()
}

/// A certificate chain and its key (PEM files, relative to `root`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// SNI names this certificate answers (`*.example.com` wildcards);
    /// empty = only as the default.
    #[serde(default)]
    pub server_names: Vec<String>,
    /// The certificate for clients whose SNI matches no name (or that send
    /// none). Default: the first certificate.
    #[serde(default)]
    pub default: bool,
    /// Demo: generate a self-signed pair for localhost at start when both
    /// files are missing.
    #[serde(default)]
    pub self_signed: bool,
}

/// HTTP/2 server limits (client side).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Http2Config {
    /// SETTINGS_MAX_CONCURRENT_STREAMS per connection.
    pub max_concurrent_streams: u32,
    /// SETTINGS_MAX_HEADER_LIST_SIZE (decoded header bytes of one request).
    #[serde(deserialize_with = "size")]
    pub max_header_list_size: u32,
    /// Flow-control window of one stream (request body bytes in flight).
    #[serde(deserialize_with = "size")]
    pub initial_stream_window_bytes: u32,
    /// Flow-control window of the whole connection.
    #[serde(deserialize_with = "size")]
    pub initial_connection_window_bytes: u32,
    /// Largest frame payload the gateway accepts.
    #[serde(deserialize_with = "size")]
    pub max_frame_size: u32,
    /// Streams the client may reset before the gateway accepted them
    /// (rapid reset, CVE-2023-44487); beyond, GOAWAY and close.
    pub max_pending_accept_reset_streams: usize,
    /// Streams the gateway may reset because of client protocol errors
    /// before it closes the connection.
    pub max_local_error_reset_streams: usize,
    /// PING an idle connection this often (0 = off).
    pub keepalive_interval_ms: u64,
    /// PING and SETTINGS frames (acknowledgements aside) a client may send
    /// per second on one connection; beyond, GOAWAY ENHANCE_YOUR_CALM and
    /// close (0 = no limit).
    pub max_control_frames_per_second: u32,
    /// Files the answers of one connection may hold open at once; a stream
    /// needing one more waits (holding none) for one to be given back, at
    /// most `client.send_timeout_ms`, else 503 (0 = only
    /// `max_concurrent_streams` bounds them).
    pub max_open_files_per_connection: u32,
}

impl Default for Http2Config {
    fn default() -> Self {
        Http2Config {
            max_concurrent_streams: 128,
            max_header_list_size: 32 * 1024,
            initial_stream_window_bytes: 256 * 1024,
            initial_connection_window_bytes: 1024 * 1024,
            max_frame_size: 16 * 1024,
            max_pending_accept_reset_streams: 20,
            max_local_error_reset_streams: 1024,
            keepalive_interval_ms: 0,
            max_control_frames_per_second: 1000,
            max_open_files_per_connection: 16,
        }
    }
}

/// A header name checked at parse time (so errors carry file:line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNameConf(pub http::HeaderName);

impl<'de> Deserialize<'de> for HeaderNameConf {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        http::HeaderName::from_bytes(s.as_bytes())
            .map(HeaderNameConf)
            .map_err(|_| serde::de::Error::custom(format!("invalid header name {s:?}")))
    }
}

/// Where and how the access log is written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    /// File to append to (relative to `root`), or `stdout` / `stderr`.
    pub path: PathBuf,
    #[serde(default)]
    pub format: AccessLogFormat,
    /// Lines buffered between requests and the writer; beyond, lines are
    /// dropped (and counted) rather than slowing requests.
    #[serde(default = "default_access_log_buffer")]
    pub buffer: usize,
}

fn default_access_log_buffer() -> usize {
    8192
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    #[default]
    Text,
    Json,
}

/// A size in bytes, written as a number or with a `k`/`m`/`g` suffix (read
/// by [`size`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for SizeValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        size(d).map(SizeValue::Bytes)
    }
}

impl fmt::Display for SizeValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeValue::Bytes(b) => write!(f, "{b}"),
            SizeValue::Text(t) => f.write_str(t),
        }
    }
}

impl SizeValue {
    pub fn bytes(&self) -> Option<usize> {
        match self {
            SizeValue::Bytes(b) => usize::try_from(*b).ok(),
            SizeValue::Text(t) => parse_size(t),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScriptLimits {
    /// What one lane call may run: each loop iteration or function call
    /// (a budget check, `lane::budget`) charges 10.
    pub instruction_budget: u64,
    /// Memory one worker's Lua VM may hold.
    pub memory_limit: SizeValue,
    /// LuaJIT's trace compiler: `auto` (on where the process may make
    /// machine code executable, LuaJIT's interpreter elsewhere), `true`
    /// (on; refused where it cannot run) or `false` (the interpreter).
    pub jit: JitMode,
}

/// `script_limits.jit`: `auto`, `true` or `false`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum JitMode {
    /// On where the compiler can run (`jit_probe`), the interpreter elsewhere.
    #[default]
    Auto,
    On,
    Off,
}

impl<'de> Deserialize<'de> for JitMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = JitMode;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or auto")
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<JitMode, E> {
                Ok(if b { JitMode::On } else { JitMode::Off })
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<JitMode, E> {
                match s {
                    "auto" => Ok(JitMode::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(s), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Default for ScriptLimits {
    fn default() -> Self {
        ScriptLimits {
            instruction_budget: DEFAULT_INSTRUCTION_BUDGET,
            memory_limit: SizeValue::Bytes(DEFAULT_MEMORY_LIMIT as u64),
            jit: JitMode::Auto,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouteConfig {
    /// Host to match (case-insensitive, port ignored); absent = any host.
    pub host: Option<String>,
    /// Path prefix; longest wins.
    pub prefix: String,
    /// Name of an API service from a node file.
    pub service: Option<String>,
    /// Static tree root holding one directory per lane.
    #[serde(rename = "static")]
    pub static_root: Option<PathBuf>,
    /// File served for a path ending in `/`.
    pub index: String,
    /// Cache-Control for static responses.
    pub cache_control: String,
    /// Precompressed siblings (`app.js.br`, `.zst`, `.gz`) a static route
    /// serves, in the order tried, to clients whose `Accept-Encoding` takes
    /// them (nginx's `gzip_static`/`brotli_static`, Caddy's
    /// `precompressed`); empty: none.
    pub precompressed: Vec<Precompressed>,
    /// Keep a browser in its decided lane with a signed cookie.
    pub sticky: bool,
    /// Protocols a client may upgrade to on this route (`Upgrade` tokens,
    /// case-insensitive). Any other upgrade request is proxied as a plain
    /// request with its `Upgrade`/`Connection` tokens removed.
    pub upgrades: Vec<String>,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            host: None,
            prefix: "/".to_string(),
            service: None,
            static_root: None,
            index: "index.html".to_string(),
            cache_control: "private, no-cache".to_string(),
            precompressed: Vec::new(),
            sticky: false,
            upgrades: vec!["websocket".to_string()],
        }
    }
}

/// A content coding a static file may be stored precompressed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precompressed {
    Br,
    Zstd,
    Gzip,
}

impl Precompressed {
    /// The `Accept-Encoding` / `Content-Encoding` token.
    pub fn token(self) -> &'static str {
        match self {
            Precompressed::Br => "br",
            Precompressed::Zstd => "zstd",
            Precompressed::Gzip => "gzip",
        }
    }

    /// The sibling's file-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Precompressed::Br => ".br",
            Precompressed::Zstd => ".zst",
            Precompressed::Gzip => ".gz",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    pub connect_timeout_ms: u64,
    /// Time allowed for the upstream's response headers.
    pub response_timeout_ms: u64,
    /// Idle pooled upstream connections are closed after this.
    pub idle_timeout_ms: u64,
    pub pool_max_idle_per_host: usize,
    /// Extra attempts on other nodes of the same candidate set.
    pub retries: u32,
    /// Deadline for a response head, across all attempts.
    pub total_timeout_ms: u64,
    /// Idempotent request bodies up to this size are buffered so they can be
    /// replayed on a retry.
    #[serde(deserialize_with = "size")]
    pub retry_buffer_bytes: usize,
    /// Longest wait between two reads of an upstream response body (nginx's
    /// `proxy_read_timeout`); the exchange then ends and counts against the
    /// node. A service may override it.
    pub read_timeout_ms: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2_000,
            response_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            pool_max_idle_per_host: 256,
            retries: 2,
            total_timeout_ms: 60_000,
            retry_buffer_bytes: 64 * 1024,
            read_timeout_ms: 60_000,
        }
    }
}

/// Client-facing limits and timeouts.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Time from a request's first byte to its complete head (slowloris).
    pub header_timeout_ms: u64,
    /// An idle keep-alive connection is closed after this.
    pub idle_timeout_ms: u64,
    /// Concurrent client connections; more are answered 503 and closed.
    pub max_connections: usize,
    /// Longest request target (path + query) → 414.
    #[serde(deserialize_with = "size")]
    pub max_uri_bytes: usize,
    /// Largest request head (all header names and values) → 431.
    #[serde(deserialize_with = "size")]
    pub max_header_bytes: usize,
    /// On SIGTERM/SIGINT, in-flight requests get this long to finish.
    pub drain_timeout_ms: u64,
    /// While draining, a keep-alive connection idle this long is closed
    /// (one that sends sooner gets its answer with `Connection: close`).
    pub drain_idle_ms: u64,
    /// Longest wait between two reads of a client's request body (nginx's
    /// `client_body_timeout`): then 408, never charged to a node.
    pub body_timeout_ms: u64,
    /// Longest a response write to the client may stall (nginx's
    /// `send_timeout`): then the connection is closed.
    pub send_timeout_ms: u64,
    /// Pass header fields whose names contain `_` (nginx's
    /// `underscores_in_headers`); off: they are dropped before routing,
    /// scripts and forwarding.
    pub underscores_in_headers: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            header_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_connections: 10_000,
            max_uri_bytes: 8 * 1024,
            max_header_bytes: 32 * 1024,
            drain_timeout_ms: 15_000,
            drain_idle_ms: 1_000,
            body_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
            underscores_in_headers: false,
        }
    }
}

/// The sticky-lane cookie.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StickyConfig {
    pub cookie: String,
    /// HMAC key (at least 16 bytes). Prefer `key_env`.
    pub key: Option<String>,
    /// Environment variable holding the key when `key` is absent.
    pub key_env: String,
    /// Lifetime of a cookie; older ones are ignored and re-decided.
    pub max_age_secs: u64,
    /// Add the `Secure` attribute (set when TLS terminates in front).
    pub secure: bool,
}

impl Default for StickyConfig {
    fn default() -> Self {
        StickyConfig {
            cookie: "graygate_lane".to_string(),
            key: None,
            key_env: "GRAYGATE_STICKY_KEY".to_string(),
            max_age_secs: 86_400,
            secure: false,
        }
    }
}

/// Health checking of a service's nodes.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    pub passive: PassiveHealth,
    /// Background probes; off unless configured.
    pub active: Option<ActiveHealth>,
}

/// Ejection on consecutive failures seen by real traffic.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct PassiveHealth {
    /// Consecutive failures (connect errors, timeouts, 5xx) that eject a
    /// node; 0 disables passive ejection.
    pub max_fails: u32,
    /// How long an ejected node is skipped before a trial request.
    pub cooldown_ms: u64,
    /// Whether a 5xx response counts as a failure.
    pub fail_on_5xx: bool,
}

/// `true`, for keys that default to on.
fn yes() -> bool {
    true
}

impl Default for PassiveHealth {
    fn default() -> Self {
        PassiveHealth {
            max_fails: 3,
            cooldown_ms: 10_000,
            fail_on_5xx: true,
        }
    }
}

/// HTTP GET probes: 2xx/3xx is a success.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ActiveHealth {
    pub path: String,
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "default_probe_timeout_ms")]
    pub timeout_ms: u64,
    /// Consecutive successes that mark an unhealthy node healthy again.
    #[serde(default = "default_healthy")]
    pub healthy: u32,
    /// Consecutive failures that mark a node unhealthy.
    #[serde(default = "default_unhealthy")]
    pub unhealthy: u32,
}

fn default_interval_ms() -> u64 {
    2_000
}
fn default_probe_timeout_ms() -> u64 {
    1_000
}
fn default_healthy() -> u32 {
    2
}
fn default_unhealthy() -> u32 {
    3
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DemoNode {
    pub name: String,
    pub addr: SocketAddr,
    #[serde(default = "default_lane")]
    pub lane: String,
}

fn default_lane() -> String {
    FORMAL.to_string()
}

/// A node file: services and their nodes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeFile {
    pub services: BTreeMap<String, ServiceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceConfig {
    pub nodes: Vec<NodeConfig>,
    pub health: HealthConfig,
    /// When every node of a gray lane is down: 503 instead of formal.
    pub strict: bool,
    /// Overrides `upstream.retries` for this service.
    pub retries: Option<u32>,
    /// Overrides `upstream.read_timeout_ms` for this service.
    pub read_timeout_ms: Option<u64>,
    /// How the gateway talks to the nodes: `http1` (default) or `h2`
    /// (h2c with prior knowledge, or h2 by ALPN over TLS; e.g. gRPC).
    pub protocol: NodeProtocol,
    /// TLS to the nodes (absent = plain TCP).
    pub tls: Option<NodeTlsConfig>,
    /// How a node is picked among the candidates of the lane.
    pub balance: Balance,
    /// The request key of `balance: hash`: `header:<name>`, `cookie:<name>`,
    /// `arg:<name>` (query argument) or `client_ip`.
    pub hash_key: Option<String>,
    /// A node that joins (new in a reload) or is re-admitted after ejection
    /// ramps its weight from 10% to 100% over this time; 0 = off.
    pub slow_start_ms: u64,
    /// The gateway's zone is used while at least this many of the lane's
    /// same-zone nodes are healthy; below, every zone of the lane. 0 turns
    /// zone preference off for the service.
    pub zone_min_healthy: u32,
    /// The non-OK `grpc-status` values of the nodes' gRPC answers that
    /// count as errors (`grpc::GrpcErrorCodes`; the rest pass as answers).
    pub grpc_error_codes: grpc::GrpcErrorCodes,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            nodes: Vec::new(),
            health: HealthConfig::default(),
            strict: false,
            retries: None,
            read_timeout_ms: None,
            protocol: NodeProtocol::default(),
            tls: None,
            balance: Balance::default(),
            hash_key: None,
            slow_start_ms: 0,
            zone_min_healthy: 1,
            grpc_error_codes: grpc::GrpcErrorCodes::default(),
        }
    }
}

/// Node selection policy within the candidate set of a lane.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// Smooth weighted round-robin (nginx's), precomputed per generation.
    #[default]
    RoundRobin,
    /// Power of two choices over in-flight requests, weight-aware.
    LeastRequest,
    /// Consistent hashing (weighted rendezvous) on `hash_key`.
    Hash,
    /// Weighted random.
    Random,
}

impl Balance {
    pub fn as_str(self) -> &'static str {
        match self {
            Balance::RoundRobin => "round_robin",
            Balance::LeastRequest => "least_request",
            Balance::Hash => "hash",
            Balance::Random => "random",
        }
    }
}

/// The protocol spoken to a service's nodes.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NodeProtocol {
    #[default]
    Http1,
    H2,
}

/// TLS to a service's nodes.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct NodeTlsConfig {
    /// SNI and the name verified in the node's certificate (default: the
    /// node's IP address, verified against the certificate's IP SANs, no
    /// SNI sent).
    pub server_name: Option<String>,
    /// PEM file of CA certificates to verify against (default: the
    /// system's roots).
    pub ca: Option<PathBuf>,
    /// Accept any certificate. For tests only; logged as a warning.
    pub insecure_skip_verify: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `ip:port`, or `host:port`: one node per address the name resolves to.
    pub addr: NodeAddr,
    #[serde(default = "default_lane")]
    pub lane: String,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Draining: selection skips the node; requests in flight finish.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
    /// The node's zone (compared with the gateway's); none = no zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

fn default_weight() -> u32 {
    1
}

/// The local bootstrap of a gateway whose configuration lives in etcd: its
/// own addresses and where the store is. Everything else comes from keys
/// under `etcd.prefix` (the key layout is in the fleet-on-etcd guide).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bootstrap {
    pub listen: SocketAddr,
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    pub etcd: EtcdSettings,
}

/// `etcd:` in a bootstrap file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdSettings {
    /// Client URLs of the cluster's members (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix, e.g. `/graygate` (no trailing slash).
    pub prefix: String,
    /// Directory for the last-known-good snapshot (relative to the
    /// bootstrap file).
    pub cache_dir: PathBuf,
    /// This gateway's id in `<prefix>/status/<id>` (default: host name and
    /// listen address).
    #[serde(default)]
    pub id: Option<String>,
    /// Quiet time after a watch event before re-reading.
    #[serde(default = "default_debounce_ms")]
    pub debounce_ms: u64,
    /// TTL of the gateway's status key's lease.
    #[serde(default = "default_status_ttl")]
    pub status_ttl_secs: i64,
    /// Timeout of one connection attempt or request to a member.
    #[serde(default = "default_etcd_timeout")]
    pub timeout_ms: u64,
    /// TTL of the release leader's lease (and of each gateway's counters
    /// key): a leader that stops renewing is replaced within it.
    #[serde(default = "default_leader_ttl")]
    pub leader_ttl_secs: i64,
    /// How often each gateway publishes its per-lane counters.
    #[serde(default = "default_counters_ms")]
    pub counters_ms: u64,
}

fn default_leader_ttl() -> i64 {
    5
}
fn default_counters_ms() -> u64 {
    500
}

fn default_status_ttl() -> i64 {
    10
}
fn default_etcd_timeout() -> u64 {
    2_000
}

/// Does this YAML text look like a bootstrap (a top-level `etcd:` key)?
pub fn is_bootstrap(text: &str) -> bool {
    serde_yaml::from_str::<serde_yaml::Value>(text)
        .ok()
        .is_some_and(|v| v.get("etcd").is_some())
}

/// Is `s` usable as a lane name (and so as a header value)?
pub fn valid_lane(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Reads a file, mapping I/O errors to a located error.
pub fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(path, None, format!("cannot read: {e}")))
}

/// Parses YAML text, reporting the line of any syntax or type error.
pub fn parse_yaml<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| {
        let line = e.location().map(|l| l.line());
        let mut msg = e.to_string();
        // serde_yaml appends " at line X column Y"; the prefix already says it.
        if let Some(idx) = msg.find(" at line ") {
            msg.truncate(idx);
        }
        // A duplicate key is reported at the start of its mapping; the
        // duplicate's own line is what the reader needs.
        let line = match (duplicate_key(&msg), e.location()) {
            (Some(key), Some(at)) => duplicate_line(text, at.line(), at.column(), key).or(line),
            _ => line,
        };
        ConfigError::new(path, line, operator_words(&msg))
    })
}

/// The key a serde_yaml duplicate-key message names, if it is one.
fn duplicate_key(msg: &str) -> Option<&str> {
    let (open, close) = if let Some(i) = msg.find("duplicate field `") {
        (i + "duplicate field `".len(), '`')
    } else if let Some(i) = msg.find("duplicate entry with key \"") {
        (i + "duplicate entry with key \"".len(), '"')
    } else {
        return None;
    };
    let rest = &msg[open..];
    rest.find(close).map(|end| &rest[..end])
}

/// The line (1-based) of the second `key:` of the block mapping starting at
/// `line`, `column` (1-based, where serde_yaml locates the mapping): its keys
/// sit at that column; the mapping ends at the first line indented less.
fn duplicate_line(text: &str, line: usize, column: usize, key: &str) -> Option<usize> {
    let indent = column.checked_sub(1)?;
    let is_key = |rest: &str| {
        [
            format!("{key}:"),
            format!("\"{key}\":"),
            format!("'{key}':"),
        ]
        .iter()
        .any(|k| {
            rest.strip_prefix(k.as_str())
                .is_some_and(|after| after.is_empty() || after.starts_with([' ', '\t']))
        })
    };
    let mut seen = false;
    for (n, l) in text.lines().enumerate().skip(line.checked_sub(1)?) {
        let body = l.trim_start_matches(' ');
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        let rest = if n + 1 == line {
            l.get(indent..)?
        } else {
            let depth = l.len() - body.len();
            if depth < indent {
                break;
            }
            if depth > indent {
                continue;
            }
            body
        };
        if is_key(rest) {
            if seen {
                return Some(n + 1);
            }
            seen = true;
        }
    }
    None
}

/// A serde_yaml error as `(line, message)`: the message without its
/// trailing position and in operators' words ([`operator_words`]).
pub fn yaml_error(e: &serde_yaml::Error) -> (Option<usize>, String) {
    let mut msg = e.to_string();
    if let Some(idx) = msg.find(" at line ") {
        msg.truncate(idx);
    }
    (e.location().map(|l| l.line()), operator_words(&msg))
}

/// Rewrites a serde message for the operator reading it: no Rust types
/// (`expected struct RulesConfig` → `expected a mapping of keys`, `expected
/// u32` → `expected a whole number`, an untagged enum → what is accepted),
/// YAML's names for YAML's things (a list, a mapping), and a misspelled key
/// or value answered with the close one (`did you mean `node_files`?`)
/// instead of the whole list.
pub fn operator_words(msg: &str) -> String {
    // An unknown key or value: the closest of the expected ones, if close.
    for (head, says) in [
        ("unknown field `", "unknown field"),
        ("unknown variant `", "unknown value"),
    ] {
        if let Some(at) = msg.find(head) {
            let rest = &msg[at + head.len()..];
            let Some(end) = rest.find('`') else { break };
            let got = &rest[..end];
            let tail = &rest[end + 1..];
            let expected: Vec<&str> = tail.split('`').skip(1).step_by(2).collect();
            let prefix = &msg[..at];
            if let Some(close) = closest(got, &expected) {
                return format!("{prefix}{says} `{got}` (did you mean `{close}`?)");
            }
            let tail = tail
                .replace(", there are no fields", ": no keys are accepted here")
                .replace(", there are no variants", ": no value is accepted here");
            return format!("{prefix}{says} `{got}`{tail}");
        }
    }
    let mut out = msg.to_string();
    if let Some(at) = out.find("data did not match any variant of untagged enum") {
        out.truncate(at);
        out.push_str("not one of the forms accepted here (see the configuration reference)");
    }
    out = out.replace("missing field `", "missing key `");
    out = out.replace("duplicate field `", "duplicate key `");
    for (rust, words) in [
        ("unit value", "an empty value"),
        ("invalid type: sequence", "invalid type: a list"),
        ("invalid type: map", "invalid type: a mapping"),
        ("expected a sequence", "expected a list"),
        ("expected a map", "expected a mapping"),
        ("expected option", "expected a value"),
    ] {
        out = out.replace(rust, words);
    }
    // `expected struct X` / `expected enum X` / `expected u32` …
    let mut result = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("expected ") {
        result.push_str(&rest[..at + "expected ".len()]);
        rest = &rest[at + "expected ".len()..];
        let word_end = |s: &str| {
            s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(s.len())
        };
        let first = &rest[..word_end(rest)];
        let (replacement, used) = match first {
            "struct" | "enum" | "tuple" => {
                let after = rest[first.len()..].trim_start_matches(' ');
                let name_len = word_end(after);
                let used = rest.len() - after.len() + name_len;
                let what = match first {
                    "struct" => "a mapping of keys",
                    "enum" => "one of the values accepted here",
                    _ => "a list",
                };
                (what, used)
            }
            "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => {
                ("a whole number, 0 or more", first.len())
            }
            "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => ("a whole number", first.len()),
            "f32" | "f64" => ("a number", first.len()),
            "char" => ("a single character", first.len()),
            _ => ("", 0),
        };
        result.push_str(replacement);
        rest = &rest[used..];
    }
    result.push_str(rest);
    result
}

/// The one of `candidates` closest to `got` by edit distance, if close
/// enough to be a slip (at most a third of its length, at least 1; a
/// candidate that contains it or is contained counts too).
fn closest<'a>(got: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = (got.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| (edit_distance(got, c), *c))
        .filter(|(d, c)| *d <= limit || (got.len() >= 3 && (c.contains(got) || got.contains(c))))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Edit distance (characters): insertions, deletions, substitutions and
/// swaps of two neighbours (`jsno` → `json` is one slip).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// Finds the first line (1-based) containing `needle` after a line containing
/// `anchor` (when given). Used to locate semantic errors that serde cannot.
pub fn find_line(text: &str, anchor: Option<&str>, needle: &str) -> Option<usize> {
    let mut armed = anchor.is_none();
    for (i, line) in text.lines().enumerate() {
        if !armed {
            if let Some(a) = anchor {
                if line.contains(a) {
                    armed = true;
                } else {
                    continue;
                }
            }
        }
        if line.contains(needle) {
            return Some(i + 1);
        }
    }
    None
}

/// Resolves `p` against `base` unless it is absolute, written plainly
/// (`a/./b` and `a//b` as `a/b`; `..` is kept, as a symlink on the way
/// could make it mean another directory): what logs and errors show.
pub fn resolve(base: &Path, p: &Path) -> PathBuf {
    let joined = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    joined.components().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_errors_carry_the_line() {
        let text = "listen: 127.0.0.1:8080\ntrusted_proxies:\n  - 10.0.0.0/33\n";
        let err = parse_yaml::<MainConfig>(Path::new("g.yaml"), text).unwrap_err();
        assert_eq!(err.line, Some(3), "{err}");
        assert!(err.to_string().starts_with("g.yaml:3:"), "{err}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let text = "listen: 127.0.0.1:8080\nlisten_typo: 1\n";
        let err = parse_yaml::<MainConfig>(Path::new("g.yaml"), text).unwrap_err();
        assert_eq!(err.line, Some(2));
    }

    /// Each struct whose every key is optional: `{}` parses to its
    /// `Default`, so the one `impl Default` is what an absent key reads.
    #[test]
    fn an_empty_section_parses_to_its_default() {
        fn same<T: serde::de::DeserializeOwned + Default + fmt::Debug>() {
            let parsed: T = parse_yaml(Path::new("g.yaml"), "{}").unwrap();
            let name = std::any::type_name::<T>();
            assert_eq!(
                format!("{parsed:?}"),
                format!("{:?}", T::default()),
                "{name}"
            );
        }
        same::<StaticCacheConfig>();
        same::<Http2Config>();
        same::<ScriptLimits>();
        same::<RouteConfig>();
        same::<UpstreamConfig>();
        same::<ClientConfig>();
        same::<StickyConfig>();
        same::<HealthConfig>();
        same::<PassiveHealth>();
        same::<NodeFile>();
        same::<ServiceConfig>();
        same::<NodeTlsConfig>();
        same::<rules::RulesConfig>();
        same::<rules::SourceConfig>();
        same::<rules::UidConfig>();
        same::<release::StepSpec>();
        same::<release::MatchSpec>();
        same::<release::AnalysisSpec>();
        same::<release::WebhooksSpec>();
        same::<release::ReleasesFile>();
    }

    #[test]
    fn defaulted_sections_still_reject_unknown_keys() {
        let text = "listen: 127.0.0.1:8080\nclient:\n  idle_timeout_ms: 5\n  idle_timeot_ms: 5\n";
        let err = parse_yaml::<MainConfig>(Path::new("g.yaml"), text).unwrap_err();
        assert_eq!(err.line, Some(4), "{err}");
        assert!(err.message.contains("idle_timeot_ms"), "{err}");
        let c = parse_yaml::<MainConfig>(
            Path::new("g.yaml"),
            "listen: 127.0.0.1:8080\nclient:\n  idle_timeout_ms: 5\n",
        )
        .unwrap()
        .client;
        assert_eq!(c.idle_timeout_ms, 5);
        assert_eq!(
            c.header_timeout_ms,
            ClientConfig::default().header_timeout_ms
        );
    }

    #[test]
    fn a_duplicate_key_names_the_duplicates_line() {
        let cases = [
            ("listen: 127.0.0.1:8080\nworkers: 2\nlisten: 127.0.0.1:8081\n", 3),
            (
                "listen: 127.0.0.1:8080\nclient:\n  idle_timeout_ms: 5\n  # note\n\n  header_timeout_ms: 9\n  idle_timeout_ms: 6\n",
                7,
            ),
        ];
        for (text, line) in cases {
            let err = parse_yaml::<MainConfig>(Path::new("g.yaml"), text).unwrap_err();
            assert!(err.message.contains("duplicate"), "{err}");
            assert_eq!(err.line, Some(line), "{err}");
        }
        // Untyped values report `duplicate entry`; the same line.
        let text = "a:\n  - b: 1\n    c:\n      b: 1\n    b: 2\n";
        let err = parse_yaml::<serde_yaml::Value>(Path::new("g.yaml"), text).unwrap_err();
        assert_eq!(err.line, Some(5), "{err}");
    }

    #[test]
    fn every_size_key_reads_suffixes() {
        let c: MainConfig = parse_yaml(
            Path::new("g.yaml"),
            "listen: 127.0.0.1:0\nclient: { max_header_bytes: 1k, max_uri_bytes: 2048 }\n\
             upstream: { retry_buffer_bytes: 1M }\n\
             http2: { max_header_list_size: 16k, initial_stream_window_bytes: 1m, \
             initial_connection_window_bytes: 2m, max_frame_size: 32k }\n\
             shared_dicts: { a: 10m, b: 4096 }\nscript_limits: { memory_limit: 1g }\n\
             static_cache: { max_size: 0, max_file_size: 64k }\n",
        )
        .unwrap();
        assert_eq!(c.client.max_header_bytes, 1024);
        assert_eq!(c.client.max_uri_bytes, 2048);
        assert_eq!(c.upstream.retry_buffer_bytes, 1 << 20);
        assert_eq!(c.http2.max_header_list_size, 16 << 10);
        assert_eq!(c.http2.initial_stream_window_bytes, 1 << 20);
        assert_eq!(c.http2.initial_connection_window_bytes, 2 << 20);
        assert_eq!(c.http2.max_frame_size, 32 << 10);
        assert_eq!(c.shared_dicts["a"].bytes(), Some(10 << 20));
        assert_eq!(c.shared_dicts["b"].bytes(), Some(4096));
        assert_eq!(c.script_limits.memory_limit.bytes(), Some(1 << 30));
        assert_eq!(c.static_cache.max_size.bytes(), Some(0));
        assert_eq!(c.static_cache.max_file_size.bytes(), Some(64 << 10));
        let err = |yaml: &str| {
            parse_yaml::<MainConfig>(Path::new("g.yaml"), &format!("listen: 127.0.0.1:0\n{yaml}"))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("client: { max_uri_bytes: 1q }"),
            "g.yaml:2: client.max_uri_bytes: invalid value: string \"1q\", \
             expected a size: bytes, or a number with k, m or g (64m)"
        );
        assert!(err("client: { max_uri_bytes: -1 }").contains("integer `-1`, expected a size"));
        assert!(err("http2: { max_frame_size: 4g }").contains("size 4294967296 is too large"));
        assert!(err("shared_dicts: { a: 1x }").contains("expected a size"));
    }

    #[test]
    fn serde_messages_are_put_in_operators_words() {
        let cases = [
            (
                "rules: invalid type: sequence, expected struct RulesConfig",
                "rules: invalid type: a list, expected a mapping of keys",
            ),
            (
                "client.max_header_bytes: invalid type: string \"1k\", expected usize",
                "client.max_header_bytes: invalid type: string \"1k\", expected a whole number, 0 or more",
            ),
            (
                "upstream.retries: invalid value: integer `-1`, expected u32",
                "upstream.retries: invalid value: integer `-1`, expected a whole number, 0 or more",
            ),
            (
                "unknown field `node_file`, expected one of `listen`, `node_files`, `routes`",
                "unknown field `node_file` (did you mean `node_files`?)",
            ),
            (
                "unknown field `bogus`, expected one of `lane_key`, `health`",
                "unknown field `bogus`, expected one of `lane_key`, `health`",
            ),
            (
                "format: unknown variant `jsno`, expected `text` or `json`",
                "format: unknown value `jsno` (did you mean `json`?)",
            ),
            (
                "x: data did not match any variant of untagged enum Matcher",
                "x: not one of the forms accepted here (see the configuration reference)",
            ),
            ("missing field `listen`", "missing key `listen`"),
            (
                "a: invalid type: unit value, expected f64",
                "a: invalid type: an empty value, expected a number",
            ),
            (
                "a: invalid type: map, expected a sequence",
                "a: invalid type: a mapping, expected a list",
            ),
            ("b: invalid type: integer `1`, expected enum Kind", "b: invalid type: integer `1`, expected one of the values accepted here"),
        ];
        for (serde, words) in cases {
            assert_eq!(operator_words(serde), words);
        }
        assert_eq!(edit_distance("jsno", "json"), 1);
        assert_eq!(edit_distance("node_file", "node_files"), 1);
        assert_eq!(closest("zzz", &["listen"]), None);
    }

    #[test]
    fn resolved_paths_are_written_plainly() {
        assert_eq!(
            resolve(Path::new("/etc/gg/."), Path::new("./nodes//a.yaml")),
            PathBuf::from("/etc/gg/nodes/a.yaml")
        );
        assert_eq!(
            resolve(Path::new("/etc/gg"), Path::new("../x.yaml")),
            PathBuf::from("/etc/gg/../x.yaml")
        );
    }

    #[test]
    fn lane_names() {
        assert!(valid_lane("gray-a"));
        assert!(valid_lane("v2"));
        assert!(!valid_lane(""));
        assert!(!valid_lane("gray\r\nx: y"));
        assert!(!valid_lane("a b"));
    }

    #[test]
    fn find_line_after_anchor() {
        let text = "a: 1\nroutes:\n  - service: x\n  - service: nope\n";
        assert_eq!(find_line(text, Some("routes:"), "nope"), Some(4));
        assert_eq!(find_line(text, None, "zzz"), None);
    }
}
