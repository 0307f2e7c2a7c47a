//! Layer: generation (data plane, above lane, nodes and static files; uses
//! them, base and config). A `Generation` is one immutable, fully validated
//! snapshot of everything the gateway routes by — config, lane policy (lists,
//! rules, script, sticky cookie), services, routes. The control plane builds it
//! whole (`control::build`) and swaps it in through [`Live`]; the request path
//! only reads it, and a request in flight keeps the generation it started with.

pub mod tls;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::base::lists::IpList;
use crate::config::MainConfig;
use crate::lane::shared_dict::SharedDict;
use crate::lane::LanePolicy;
use crate::nodes::Service;
use crate::static_files::StaticTree;

/// Where a route sends its requests.
#[derive(Debug)]
pub enum Target {
    Service(Arc<str>),
    Static(StaticTree),
}

#[derive(Debug)]
pub struct Route {
    pub host: Option<String>,
    pub prefix: Arc<str>,
    pub target: Target,
    /// Keep browsers in their lane with the signed cookie.
    pub sticky: bool,
    /// Upgrade protocols allowed (lower-case); others are not upgraded.
    pub upgrades: Vec<String>,
}

#[derive(Debug)]
pub struct Generation {
    /// Grows with every applied reload.
    pub id: u64,
    pub config_path: PathBuf,
    pub config: MainConfig,
    /// Client addresses whose X-Forwarded-For and tag header are believed.
    pub trusted: IpList,
    /// What the lane decision reads (tag header, lists, rules, script,
    /// sticky cookie, served lanes).
    pub lane: LanePolicy,
    pub services: BTreeMap<String, Service>,
    pub routes: Vec<Route>,
    /// `ngx.shared` dictionaries (process-wide; they outlive generations).
    pub dicts: BTreeMap<String, Arc<SharedDict>>,
    /// Every file this generation was built from (watched for changes).
    pub files: Vec<PathBuf>,
    /// Paths watched besides `files` but not read as documents: each
    /// static root as configured (before it was made canonical), so that
    /// swapping a link on its way (a volume update, a deploy) rebuilds the
    /// tree on its new target.
    pub watch_paths: Vec<PathBuf>,
    pub loaded_at: SystemTime,
    /// Non-fatal findings (e.g. a lane nothing serves).
    pub warnings: Vec<String>,
    /// Ready-made upstream tag values for the served lanes and formal (no
    /// per-request allocation for them).
    pub lane_tags: BTreeMap<String, http::HeaderValue>,
    /// With `otel:` baggage on: the upstream `baggage` value of a request
    /// that came without one (`graygate.lane=<lane>`), ready-made for the
    /// served lanes and formal.
    pub lane_baggage: BTreeMap<String, http::HeaderValue>,
    /// This generation's id as a header value.
    pub id_tag: http::HeaderValue,
    /// TLS server configuration of each `config.listeners` entry (`None`
    /// for plain ones), read at each TLS handshake.
    pub tls: Vec<Option<Arc<rustls::ServerConfig>>>,
    /// The release records this generation was built from: what the
    /// admin API shows, so a state is reported only once it serves.
    pub release_records: Vec<crate::config::release::ReleaseRecord>,
    /// Node addresses written as host names, and what each stood for when
    /// this generation was built (the control plane resolves them again).
    pub node_names: Vec<NodeName>,
    /// Services whose nodes a discovery service gave (a route names them,
    /// no node file defines them): the control plane keeps them current.
    pub discovered: Vec<String>,
}

/// A node-file entry whose address is a host name: its service, the name,
/// the port, and the nodes (addresses) it became in this generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeName {
    pub service: String,
    pub host: String,
    pub port: u16,
    pub addrs: Vec<std::net::SocketAddr>,
}

impl Generation {
    /// The route for `host` (lower-case, no port) and `path`: routes naming
    /// the host win over host-less ones; within them the longest prefix.
    pub fn route(&self, host: &str, path: &str) -> Option<&Route> {
        let best = |want_host: bool| {
            self.routes
                .iter()
                .filter(|r| match &r.host {
                    Some(h) => want_host && h == host,
                    None => !want_host,
                })
                .filter(|r| path.starts_with(&*r.prefix))
                .max_by_key(|r| r.prefix.len())
        };
        best(true).or_else(|| best(false))
    }
}

/// The generation serving now. The control plane publishes a new one; the
/// data plane loads it once per request (or connection) and keeps that
/// `Arc` to the end.
pub struct Live(ArcSwap<Generation>);

impl Live {
    pub fn new(gen: Generation) -> Live {
        Live(ArcSwap::from_pointee(gen))
    }

    /// The generation serving now.
    pub fn load(&self) -> Arc<Generation> {
        self.0.load_full()
    }

    /// Its id, without taking a reference.
    pub fn id(&self) -> u64 {
        self.0.load().id
    }

    /// Makes `gen` the serving generation (control plane only).
    pub fn publish(&self, gen: Arc<Generation>) {
        self.0.store(gen);
    }
}
