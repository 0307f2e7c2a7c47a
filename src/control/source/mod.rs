//! Layer: control plane. Configuration sources: where the documents of a
//! generation come from, and where the services no node file defines are
//! discovered. `files` (the default): the main file and what it names,
//! watched with notify and SIGHUP. `etcd`: every document is a key under a
//! prefix, read at one revision (one range read: a consistent snapshot),
//! watched from that revision + 1, the last applied snapshot kept on disk
//! for starts while etcd is down; its service registry (`etcd::registry`)
//! and the fleet's shared releases (`etcd::fleet`) are there too.
//! `nacos_config`: every document is a data id of one group in Nacos
//! config, each listened to (pushed), the last applied snapshot kept on
//! disk as with etcd; admin edits published back (`nacos_edit`). `nacos`:
//! the services discovered in Nacos naming. Every source hands the same
//! builder (`control::build`) a set of named documents, so validation and
//! errors (document:line) are the same.
//!
//! The seams: [`ConfigSource`] is what the binary uses (check, start on
//! generation 1; once started [`watch`] keeps the gateway current and
//! [`leave`] takes it out of its fleet); [`Store`] is the one method set
//! the rest of the control plane uses on a running gateway's store (edits,
//! reloads, releases, status, fleet); `discovery` is what the build and
//! the admin API ask of service discovery; `cli` holds the stores' command
//! line. Nothing outside this module names a store
//! (`tests/it/layering.rs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::MainConfig;
use crate::control::node_edit;
use crate::control::Gateway;

pub mod cli;
pub mod discovery;
pub mod etcd;
pub mod files;
pub mod nacos;
pub mod nacos_config;
mod nacos_edit;
pub mod store;

pub use store::{leadership_view, GatewayCounts, Guard, Leadership, Sample, SharedReleases, Store};

/// Services from a registry (etcd's `services/<svc>/nodes/<id>`): the
/// document each came from (for errors), its name and settings. A
/// registered service that a node file also defines gets its nodes appended.
pub type RegisteredServices = Vec<(PathBuf, String, crate::config::ServiceConfig)>;

/// Which source a gateway runs on and how it stands, for `/status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SourceStatus {
    /// `files`, `etcd` or `nacos`.
    pub source: &'static str,
    /// etcd: `live` (applied from the store, the store answering), `stale`
    /// (applied from the store, which is unreachable or failing since: the
    /// configuration may be behind it) or `cached` (from the last-known-good
    /// snapshot on disk, the store not reached yet).
    pub source_state: Option<&'static str>,
    /// etcd: the revision of the newest change the serving generation holds.
    pub revision: Option<i64>,
    /// etcd: SHA-256 of the snapshot's keys and values.
    pub config_hash: Option<String>,
    /// etcd: the last connection or watch problem (cleared once live).
    pub store_error: Option<String>,
    /// etcd: this gateway's id in `<prefix>/status/<id>`.
    pub gateway_id: Option<String>,
    /// Nacos config: the data ids listened to now.
    pub listening: Option<Vec<String>>,
}

/// Where a gateway's configuration comes from.
#[derive(Debug, Clone)]
pub enum ConfigSource {
    /// A main file and every document it names.
    Files(PathBuf),
    /// A bootstrap file (it has `etcd:`): the documents are keys in etcd.
    Etcd(PathBuf),
    /// A bootstrap file whose `nacos:` has `config:`: the documents are
    /// data ids in Nacos config.
    Nacos(PathBuf),
    /// Servers, namespace, group and data id given directly (`--check
    /// --nacos …`): only checked, never served.
    NacosStore(Box<nacos_config::Place>),
    /// Members and a prefix given directly (`--check --etcd … --prefix …`):
    /// only checked, never served.
    Store { endpoints: String, prefix: String },
}

/// A configuration that passed `--check`.
#[derive(Debug)]
pub struct Checked {
    /// What was checked: the file, or `<members> <prefix>`.
    pub name: String,
    /// etcd: the revision checked.
    pub revision: Option<i64>,
    pub warnings: Vec<String>,
    /// Files: the main settings, for the checks the admin layer owns (its
    /// listener's address).
    pub config: Option<MainConfig>,
}

/// A configuration that failed `--check`.
#[derive(Debug)]
pub struct CheckFailed {
    /// What was checked, when it could be told (not for a file that looks
    /// like a bootstrap but does not parse as one).
    pub name: Option<String>,
    pub error: String,
}

impl ConfigSource {
    /// What `path` names: a bootstrap (a YAML document with `etcd:`) or a
    /// main file (anything else, an unreadable file included: its error
    /// comes from the build).
    pub fn open(path: &Path) -> ConfigSource {
        let text = std::fs::read_to_string(path);
        if text
            .as_ref()
            .is_ok_and(|t| crate::config::nacos::is_nacos_bootstrap(t))
        {
            ConfigSource::Nacos(path.to_path_buf())
        } else if text.is_ok_and(|t| crate::config::is_bootstrap(&t)) {
            ConfigSource::Etcd(path.to_path_buf())
        } else {
            ConfigSource::Files(path.to_path_buf())
        }
    }

    /// Builds the configuration as a start would, without serving it.
    /// Blocking (etcd: on a runtime of its own).
    pub fn check(&self) -> Result<Checked, CheckFailed> {
        match self {
            ConfigSource::Files(main) => {
                let name = main.display().to_string();
                match files::check(main) {
                    Ok(gen) => Ok(Checked {
                        name,
                        revision: None,
                        warnings: gen.warnings,
                        config: Some(gen.config),
                    }),
                    Err(e) => Err(CheckFailed {
                        name: Some(name),
                        error: e.to_string(),
                    }),
                }
            }
            ConfigSource::Etcd(path) => match read_bootstrap(path) {
                Some(b) => check_store(&b.etcd.endpoints.join(","), &b.etcd.prefix),
                None => Err(CheckFailed {
                    name: None,
                    error: format!("{}: not a valid bootstrap file", path.display()),
                }),
            },
            ConfigSource::Store { endpoints, prefix } => check_store(endpoints, prefix),
            ConfigSource::Nacos(path) => {
                let boot = std::fs::read_to_string(path)
                    .map_err(|e| e.to_string())
                    .and_then(|t| {
                        crate::config::nacos::NacosBootstrap::parse(path, &t)
                            .map_err(|e| e.to_string())
                    });
                match boot {
                    Ok(b) => {
                        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
                        check_nacos(&nacos_config::Place::of(&b.nacos), Some((&b, &dir)))
                    }
                    Err(e) => Err(CheckFailed {
                        name: None,
                        error: format!("not a valid bootstrap file: {e}"),
                    }),
                }
            }
            ConfigSource::NacosStore(place) => check_nacos(place, None),
        }
    }

    /// A gateway serving generation 1 (etcd: read from the store, or from
    /// the cached snapshot while the store cannot be reached). Files load
    /// outside `rt`; etcd is read on it. The error is the line to print.
    pub fn start(&self, rt: &tokio::runtime::Runtime) -> Result<Arc<Gateway>, String> {
        let gw = self.start_source(rt)?;
        // Services from Nacos: their first answer before serving.
        rt.block_on(nacos::prime(&gw));
        Ok(gw)
    }

    fn start_source(&self, rt: &tokio::runtime::Runtime) -> Result<Arc<Gateway>, String> {
        match self {
            ConfigSource::Files(main) => files::start(main).map_err(|e| e.to_string()),
            ConfigSource::Etcd(path) => rt
                .block_on(etcd::start(path))
                .map(|(gw, _)| gw)
                .map_err(|e| format!("{}: {e}", path.display())),
            ConfigSource::Store { endpoints, prefix } => Err(format!(
                "{endpoints} {prefix}: members and a prefix are only checked; start from a bootstrap file"
            )),
            ConfigSource::Nacos(path) => rt
                .block_on(nacos_config::start(path))
                .map(|(gw, _)| gw)
                .map_err(|e| format!("{}: {e}", path.display())),
            ConfigSource::NacosStore(place) => Err(format!(
                "{}: only checked; start from a bootstrap file",
                place.name()
            )),
        }
    }
}

/// Starts what keeps `gw` on its source's newest state, on the current
/// runtime: files — the file watcher and SIGHUP; etcd — the watch, SIGHUP
/// and this gateway's status key; either — node host names resolved again
/// (`control::names`) and the Nacos subscriptions (`nacos`). Returns at
/// once.
pub fn watch(gw: &Arc<Gateway>) {
    tokio::spawn(crate::control::names::run(gw.clone()));
    tokio::spawn(nacos::run(gw.clone()));
    match &gw.store {
        Some(store) => store.watch(gw),
        None => files::spawn_watch(gw.clone()),
    }
}

/// At a graceful stop (not a handover): a fleet gateway gives up the
/// release leadership, then leaves its store (an etcd gateway removes its
/// status key); a files gateway has nothing to leave.
pub async fn leave(gw: &Gateway) {
    if let Some(store) = &gw.store {
        store.leave(gw).await;
    }
}

fn read_bootstrap(path: &Path) -> Option<crate::config::Bootstrap> {
    let text = std::fs::read_to_string(path).ok()?;
    if !crate::config::is_bootstrap(&text) {
        return None;
    }
    crate::config::parse_yaml(path, &text).ok()
}

/// `--check` of what is in etcd under `prefix`.
fn check_store(endpoints: &str, prefix: &str) -> Result<Checked, CheckFailed> {
    let name = format!("{endpoints} {prefix}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(etcd::check(endpoints, prefix)) {
        Ok((rev, warnings)) => Ok(Checked {
            name,
            revision: Some(rev),
            warnings,
            config: None,
        }),
        Err(error) => Err(CheckFailed {
            name: Some(name),
            error,
        }),
    }
}

/// `--check` of what is in Nacos config at `place`.
fn check_nacos(
    place: &nacos_config::Place,
    boot: Option<(&crate::config::nacos::NacosBootstrap, &PathBuf)>,
) -> Result<Checked, CheckFailed> {
    let name = place.name();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (boot, dir) = match boot {
        Some((b, d)) => (Some(b), d.as_path()),
        None => (None, Path::new(".")),
    };
    match rt.block_on(nacos_config::check(place, boot, dir)) {
        Ok(warnings) => Ok(Checked {
            name,
            revision: None,
            warnings,
            config: None,
        }),
        Err(error) => Err(CheckFailed {
            name: Some(name),
            error,
        }),
    }
}

/// A store's main settings as a build sees them: the per-gateway keys
/// (`listen`, `admin_listen`, `root`) — and, with a bootstrap, its own
/// top-level `section` (e.g. `nacos:`) — blanked line for line (so every
/// other line keeps its number), then the bootstrap's addresses
/// (`listen`, `admin_listen`) appended, or without one (a `--check` of
/// what is in the store) any address. Returns the text and whether the
/// store's text had `section`.
pub(crate) fn store_main_text(
    text: &str,
    addrs: Option<(SocketAddr, Option<SocketAddr>)>,
    section: Option<&str>,
) -> (String, bool) {
    let mut out = String::with_capacity(text.len() + 64);
    let (mut had_listen, mut had_section, mut in_section) = (false, false, false);
    for line in text.lines() {
        if !line.starts_with([' ', '\t', '#', '-']) && !line.trim().is_empty() {
            in_section = section.is_some_and(|s| line.starts_with(s));
            had_section |= in_section;
        }
        let local = ["listen:", "admin_listen:"]
            .iter()
            .any(|k| line.starts_with(k));
        if line.starts_with("root:") || ((local || in_section) && addrs.is_some()) {
            out.push('#');
        } else if line.starts_with("listen:") {
            had_listen = true;
        }
        out.push_str(line);
        out.push('\n');
    }
    match addrs {
        Some((listen, admin)) => {
            out.push_str(&format!("listen: \"{listen}\"\n"));
            if let Some(a) = admin {
                out.push_str(&format!("admin_listen: \"{a}\"\n"));
            }
        }
        None if !had_listen => out.push_str("listen: \"127.0.0.1:0\"\n"),
        None => {}
    }
    (out, had_section)
}

/// The node document (one of `node_files`, read from the store by `read`,
/// which gives its text first) that defines `service`, with what `read`
/// gave for it; `NotFound` with `elsewhere` (where such a service changes
/// instead) when none does. The stores' admin node edits start here.
fn node_document_of<T>(
    gw: &Gateway,
    service: &str,
    mut read: impl FnMut(&Path) -> Result<(String, T), node_edit::EditError>,
    elsewhere: &str,
) -> Result<(PathBuf, String, T), node_edit::EditError> {
    use node_edit::EditError;
    let gen = gw.current();
    let root = gen.config.root_dir(&gen.config_path);
    for p in &gen.config.node_files {
        let path = crate::config::resolve(&root, p);
        let (text, extra) = read(&path)?;
        let nf: crate::config::NodeFile = crate::config::parse_yaml(&path, &text)
            .map_err(|e| EditError::Conflict(e.to_string()))?;
        if nf.services.contains_key(service) {
            return Ok((path, text, extra));
        }
    }
    Err(EditError::NotFound(format!(
        "no service {service:?} in any node document ({elsewhere})"
    )))
}

/// Writes `value` as JSON to `path` atomically (its directory made, then
/// a temp file, fsync, rename): a store's last-known-good snapshot. A
/// failure is logged and the gateway serves on.
pub(crate) fn save_snapshot(path: &Path, value: &impl serde::Serialize) {
    let res = (|| -> std::io::Result<()> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let text = serde_json::to_string(value).map_err(std::io::Error::other)?;
        node_edit::write_atomic(path, &text)
    })();
    if let Err(e) = res {
        tracing::warn!(file = %path.display(), error = %e, "cannot write the snapshot cache");
    }
}
