//! Layer: control plane. The command line of the configuration stores:
//! `--check` of what is in a store (`--etcd URL --prefix P`, or `--nacos
//! HOST:PORT …`), `push` and `pull` between files and a store, and the
//! `register` sidecar of the etcd registry. The binary flattens these
//! arguments in and hands the parsed commands back here, so it names no
//! store itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use super::etcd::registry::{self, Instance, Registration};
use super::{etcd, nacos_config, ConfigSource};

/// Directives that quiet a store client logging too much at info (the
/// Nacos client logs every push whole): its warnings only, unless
/// `RUST_LOG` names it.
pub fn quiet_clients() -> Vec<&'static str> {
    if std::env::var("RUST_LOG").is_ok_and(|v| v.contains("nacos_sdk")) {
        Vec::new()
    } else {
        vec!["nacos_sdk=warn"]
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn parse_meta(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("expected k=v")?;
    Ok((k.to_string(), v.to_string()))
}

/// `--check` of what is in a store instead of a file.
#[derive(clap::Args, Clone)]
pub struct CheckStore {
    /// With --check: check what is in etcd (this member's URL) instead.
    #[arg(long, requires = "prefix", conflicts_with = "nacos")]
    etcd: Option<String>,
    /// With --check --etcd: the key prefix.
    #[arg(long, requires = "etcd")]
    prefix: Option<String>,
    #[command(flatten)]
    nacos: NacosArgs,
}

impl CheckStore {
    /// The source the command line names: a store given directly (with
    /// `--check` only), else what the file `config` is.
    pub fn config_source(&self, check: bool, config: &Path) -> Result<ConfigSource, String> {
        if check && self.nacos.nacos.is_some() {
            return match self.nacos.place() {
                Some(Ok(place)) => Ok(ConfigSource::NacosStore(Box::new(place))),
                Some(Err(e)) => Err(e),
                None => Ok(ConfigSource::open(config)),
            };
        }
        match (&self.etcd, &self.prefix) {
            (Some(url), Some(prefix)) if check => Ok(ConfigSource::Store {
                endpoints: url.clone(),
                prefix: prefix.clone(),
            }),
            _ => Ok(ConfigSource::open(config)),
        }
    }
}

/// Where graygate's documents are in Nacos config (`--check`, `push`,
/// `pull`).
#[derive(clap::Args, Clone)]
pub struct NacosArgs {
    /// With --check, push or pull: graygate's documents in Nacos config
    /// (servers' HTTP host:port, comma-separated) instead of etcd.
    #[arg(long, value_name = "HOST:PORT")]
    nacos: Option<String>,
    /// With --nacos: the namespace (its id).
    #[arg(long, default_value = "public")]
    namespace: String,
    /// With --nacos: the group of the documents.
    #[arg(long, default_value = "DEFAULT_GROUP")]
    group: String,
    /// With --nacos: the data id of the main settings.
    #[arg(long, default_value = "graygate.yaml")]
    data_id: String,
    /// With --nacos: Nacos auth (with NACOS_PASSWORD in the environment).
    #[arg(long, env = "NACOS_USERNAME")]
    nacos_username: Option<String>,
}

impl NacosArgs {
    /// [`NacosArgs::place`] for `push`/`pull`: the place, or the exit (a
    /// message printed).
    fn place_or_exit(&self) -> Result<nacos_config::Place, ExitCode> {
        match self.place() {
            Some(Ok(p)) => Ok(p),
            Some(Err(e)) => {
                eprintln!("{e}");
                Err(ExitCode::FAILURE)
            }
            None => Err(ExitCode::FAILURE),
        }
    }

    /// The place the arguments name, or the message to print.
    fn place(&self) -> Option<Result<nacos_config::Place, String>> {
        let server_addr = self.nacos.clone()?;
        let password = std::env::var("NACOS_PASSWORD").ok();
        let settings = crate::config::nacos::NacosConfig {
            server_addr,
            grpc_port: None,
            namespace: self.namespace.clone(),
            username: self.nacos_username.clone(),
            password: password.filter(|_| self.nacos_username.is_some()),
            cache_dir: None,
            timeout_ms: 3_000,
            discovery: None,
            config: Some(crate::config::nacos::NacosConfigDocs {
                group: self.group.clone(),
                data_id: self.data_id.clone(),
            }),
        };
        if self.nacos_username.is_some() && settings.password.is_none() {
            return Some(Err(
                "--nacos-username: give the password in NACOS_PASSWORD".into()
            ));
        }
        Some(match settings.check() {
            Ok(()) => Ok(nacos_config::Place::of(&settings)),
            Err((_, m)) => Err(m),
        })
    }
}

/// `push`: a files configuration that `--check` accepts, uploaded.
#[derive(clap::Args)]
pub struct Push {
    #[arg(long, short)]
    config: PathBuf,
    /// Member URL(s), comma-separated: the first that answers is used.
    #[arg(
        long,
        requires = "prefix",
        required_unless_present = "nacos",
        conflicts_with = "nacos"
    )]
    etcd: Option<String>,
    #[arg(long, requires = "etcd")]
    prefix: Option<String>,
    #[command(flatten)]
    nacos: NacosArgs,
}

/// `pull`: the configuration in a store written back to files.
#[derive(clap::Args)]
pub struct Pull {
    /// Member URL(s), comma-separated: the first that answers is used.
    #[arg(
        long,
        requires = "prefix",
        required_unless_present = "nacos",
        conflicts_with = "nacos"
    )]
    etcd: Option<String>,
    #[arg(long, requires = "etcd")]
    prefix: Option<String>,
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    #[command(flatten)]
    nacos: NacosArgs,
}

/// `register`: the etcd registry's sidecar.
#[derive(clap::Args)]
pub struct Register {
    /// Member URL(s), comma-separated.
    #[arg(long)]
    etcd: String,
    #[arg(long)]
    prefix: String,
    #[arg(long)]
    service: String,
    #[arg(long)]
    addr: SocketAddr,
    #[arg(long)]
    lane: Option<String>,
    /// Free metadata, `k=v` (repeatable).
    #[arg(long = "meta", value_parser = parse_meta)]
    meta: Vec<(String, String)>,
    /// Lease TTL: an instance whose sidecar dies leaves within it.
    #[arg(long, default_value_t = 10)]
    ttl: i64,
    /// Instance id (default: the address).
    #[arg(long)]
    id: Option<String>,
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// Seconds between deregistering and exiting.
    #[arg(long, default_value_t = 5.0)]
    drain: f64,
}

impl Push {
    /// Runs the command; the exit code to end with.
    pub fn run(self) -> ExitCode {
        let rt = runtime();
        if self.nacos.nacos.is_some() {
            return nacos_push(&rt, &self.config, &self.nacos);
        }
        let (Some(url), Some(prefix)) = (self.etcd, self.prefix) else {
            eprintln!("give --etcd URLS --prefix P, or --nacos HOST:PORT");
            return ExitCode::FAILURE;
        };
        let config = self.config;
        let docs = match etcd::documents_of_files(&config) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("{e}");
                println!(
                    "{}: configuration test failed; nothing pushed",
                    config.display()
                );
                return ExitCode::FAILURE;
            }
        };
        match rt.block_on(etcd::push(&url, &prefix, &docs)) {
            Ok(rev) => {
                println!(
                    "pushed {} documents to {url} under {prefix}/config/ at revision {rev}",
                    docs.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("push failed: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

impl Pull {
    /// Runs the command; the exit code to end with.
    pub fn run(self) -> ExitCode {
        let rt = runtime();
        if self.nacos.nacos.is_some() {
            return nacos_pull(&rt, &self.dir, &self.nacos);
        }
        let (Some(url), Some(prefix)) = (self.etcd, self.prefix) else {
            eprintln!("give --etcd URLS --prefix P, or --nacos HOST:PORT");
            return ExitCode::FAILURE;
        };
        match rt.block_on(etcd::pull(&url, &prefix, &self.dir)) {
            Ok((rev, files)) => {
                for f in &files {
                    println!("{}", f.display());
                }
                println!("pulled {} documents at revision {rev}", files.len());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("pull failed: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

impl Register {
    /// Runs the sidecar until SIGTERM; the exit code to end with.
    pub fn run(self) -> ExitCode {
        let rt = runtime();
        let id = self.id.unwrap_or_else(|| self.addr.to_string());
        if !registry::valid_segment(&self.service) || !registry::valid_segment(&id) {
            eprintln!("service and id: letters, digits, - _ . : only");
            return ExitCode::FAILURE;
        }
        if let Some(l) = self
            .lane
            .as_deref()
            .filter(|l| !crate::config::valid_lane(l))
        {
            eprintln!("invalid lane name {l:?}");
            return ExitCode::FAILURE;
        }
        let reg = Registration {
            endpoints: etcd::endpoint_list(&self.etcd)
                .map(str::to_string)
                .collect(),
            prefix: etcd::norm_prefix(&self.prefix),
            service: self.service,
            id,
            instance: Instance {
                addr: self.addr,
                lane: self.lane,
                weight: self.weight,
                drain: false,
                metadata: self.meta.into_iter().collect(),
            },
            ttl_secs: self.ttl.max(1),
            drain: Duration::from_secs_f64(self.drain.max(0.0)),
        };
        match rt.block_on(registry::run_sidecar(reg)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("register: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

/// `push --nacos`: what `--check` accepts, published to Nacos config.
fn nacos_push(rt: &tokio::runtime::Runtime, config: &std::path::Path, n: &NacosArgs) -> ExitCode {
    let place = match n.place_or_exit() {
        Ok(p) => p,
        Err(code) => return code,
    };
    let docs = match etcd::documents_of_files(config) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("{e}");
            println!(
                "{}: configuration test failed; nothing pushed",
                config.display()
            );
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(nacos_config::push(&place, &docs)) {
        Ok((published, unchanged)) => {
            println!(
                "pushed {} documents to {} ({published} published, {unchanged} unchanged)",
                docs.len(),
                place.name()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("push failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `pull --nacos`: the documents in Nacos config written back to files.
fn nacos_pull(rt: &tokio::runtime::Runtime, dir: &std::path::Path, n: &NacosArgs) -> ExitCode {
    let place = match n.place_or_exit() {
        Ok(p) => p,
        Err(code) => return code,
    };
    match rt.block_on(nacos_config::pull(&place, dir)) {
        Ok((files, broken)) => {
            for f in &files {
                println!("{}", f.display());
            }
            println!("pulled {} documents from {}", files.len(), place.name());
            match broken {
                None => ExitCode::SUCCESS,
                Some(e) => {
                    eprintln!("{e}");
                    eprintln!("pull incomplete: the configuration in Nacos does not build; documents named after this error were not pulled");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("pull failed: {e}");
            ExitCode::FAILURE
        }
    }
}
