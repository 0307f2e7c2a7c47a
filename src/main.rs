//! Layer: the binary (top). `graygate --config FILE` runs the gateway (a
//! main file, or a bootstrap with `etcd:`); `--check` validates and exits;
//! `push`, `pull` and `register` talk to etcd.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use graygate::control::registry::{self, Instance, Registration};
use graygate::control::source::etcd::{self, EtcdSource};
use graygate::control::{reload, Gateway};
use graygate::generation::Generation;
use graygate::server::Server;
use graygate::{admin, demo};

// mimalloc: faster small allocations and lower fragmentation than glibc's
// malloc for a proxy's many short-lived buffers (see README, Design).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(version, about = "Lane-routing edge gateway for gray releases")]
struct Cli {
    /// Main configuration file.
    #[arg(long, short, default_value = "config/graygate.yaml")]
    config: PathBuf,
    /// Validate the configuration (YAML, node files, lists, Lua) and exit.
    #[arg(long, short = 't')]
    check: bool,
    /// With --check: check what is in etcd (this member's URL) instead.
    #[arg(long, requires = "prefix")]
    etcd: Option<String>,
    /// With --check --etcd: the key prefix.
    #[arg(long, requires = "etcd")]
    prefix: Option<String>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Progressive releases, through a running gateway's admin API.
    Release {
        /// The admin listener.
        #[arg(long, default_value = "127.0.0.1:9080", global = true)]
        admin: String,
        /// Admin bearer token (else `GRAYGATE_ADMIN_TOKEN`).
        #[arg(long, env = "GRAYGATE_ADMIN_TOKEN", global = true)]
        token: Option<String>,
        #[command(subcommand)]
        action: ReleaseAction,
    },
    /// Upload a files configuration (what --check accepts) to etcd in one
    /// transaction.
    Push {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        etcd: String,
        #[arg(long)]
        prefix: String,
    },
    /// Write the configuration in etcd back to files (DIR/main.yaml, …).
    Pull {
        #[arg(long)]
        etcd: String,
        #[arg(long)]
        prefix: String,
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Sidecar: register an instance under a lease and keep it alive; on
    /// SIGTERM deregister first, wait the drain period, exit.
    Register {
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
    },
}

#[derive(clap::Subcommand)]
enum ReleaseAction {
    /// Every release, with its state, step and weight.
    List,
    /// One release with every decision and the values behind it.
    Show { name: String },
    /// Starts a release from a spec file (YAML or JSON).
    Create { spec: PathBuf },
    /// Ends a release now: its lane takes all of the release's traffic.
    Promote { name: String },
    /// Holds a release at its step.
    Pause { name: String },
    /// Continues a paused release (past a manual gate: the next step).
    Resume { name: String },
    /// Rolls a release back now.
    Abort { name: String },
}

fn release_command(admin: &str, token: Option<&str>, action: ReleaseAction) -> ExitCode {
    use graygate::admin::client::{release, ReleaseCommand as C};
    let cmd = match action {
        ReleaseAction::List => C::List,
        ReleaseAction::Show { name } => C::Show(name),
        ReleaseAction::Create { spec } => C::Create(spec),
        ReleaseAction::Promote { name } => C::Act(name, "promote".into()),
        ReleaseAction::Pause { name } => C::Act(name, "pause".into()),
        ReleaseAction::Resume { name } => C::Act(name, "resume".into()),
        ReleaseAction::Abort { name } => C::Act(name, "abort".into()),
    };
    match release(admin, token, cmd) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("graygate release: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_meta(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("expected k=v")?;
    Ok((k.to_string(), v.to_string()))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn subcommand(cmd: Cmd) -> ExitCode {
    if let Cmd::Release {
        admin,
        token,
        action,
    } = cmd
    {
        return release_command(&admin, token.as_deref(), action);
    }
    let rt = runtime();
    match cmd {
        Cmd::Release { .. } => ExitCode::FAILURE,
        Cmd::Push {
            config,
            etcd: url,
            prefix,
        } => {
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
        Cmd::Pull {
            etcd: url,
            prefix,
            dir,
        } => match rt.block_on(etcd::pull(&url, &prefix, &dir)) {
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
        },
        Cmd::Register {
            etcd: url,
            prefix,
            service,
            addr,
            lane,
            meta,
            ttl,
            id,
            weight,
            drain,
        } => {
            let id = id.unwrap_or_else(|| addr.to_string());
            if !registry::valid_segment(&service) || !registry::valid_segment(&id) {
                eprintln!("service and id: letters, digits, - _ . : only");
                return ExitCode::FAILURE;
            }
            if let Some(l) = lane.as_deref().filter(|l| !graygate::config::valid_lane(l)) {
                eprintln!("invalid lane name {l:?}");
                return ExitCode::FAILURE;
            }
            let reg = Registration {
                endpoints: url.split(',').map(str::to_string).collect(),
                prefix: etcd::norm_prefix(&prefix),
                service,
                id,
                instance: Instance {
                    addr,
                    lane,
                    weight,
                    drain: false,
                    metadata: meta.into_iter().collect(),
                },
                ttl_secs: ttl.max(1),
                drain: Duration::from_secs_f64(drain.max(0.0)),
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
}

/// `--check` of what is in etcd.
fn check_etcd(url: &str, prefix: &str) -> ExitCode {
    match runtime().block_on(etcd::check(url, prefix)) {
        Ok((rev, warnings)) => {
            for w in &warnings {
                eprintln!("warning: {w}");
            }
            println!("{url} {prefix} (revision {rev}): configuration ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            println!("{url} {prefix}: configuration test failed");
            ExitCode::FAILURE
        }
    }
}

fn read_bootstrap(path: &Path) -> Option<graygate::config::Bootstrap> {
    let text = std::fs::read_to_string(path).ok()?;
    if !graygate::config::is_bootstrap(&text) {
        return None;
    }
    graygate::config::parse_yaml(path, &text).ok()
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    if let Some(cmd) = cli.cmd {
        return subcommand(cmd);
    }
    let bootstrap =
        std::fs::read_to_string(&cli.config).is_ok_and(|t| graygate::config::is_bootstrap(&t));
    if cli.check {
        if let (Some(url), Some(prefix)) = (&cli.etcd, &cli.prefix) {
            return check_etcd(url, prefix);
        }
        if bootstrap {
            return match read_bootstrap(&cli.config) {
                Some(b) => check_etcd(&b.etcd.endpoints.join(","), &b.etcd.prefix),
                None => {
                    eprintln!("{}: not a valid bootstrap file", cli.config.display());
                    ExitCode::FAILURE
                }
            };
        }
        return match Generation::load(&cli.config, 0) {
            Ok(gen) => {
                for w in &gen.warnings {
                    eprintln!("warning: {w}");
                }
                if let Some(Err(e)) = gen
                    .config
                    .admin_listen
                    .map(|a| admin::auth::check_bind(a, &gen.config))
                {
                    eprintln!("{}: {e}", cli.config.display());
                    println!("{}: configuration test failed", cli.config.display());
                    return ExitCode::FAILURE;
                }
                println!("{}: configuration ok", cli.config.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                println!("{}: configuration test failed", cli.config.display());
                ExitCode::FAILURE
            }
        };
    }
    // Control-plane runtime: admin, reload watcher or etcd watch, signals,
    // demo nodes. Requests are served by the worker threads.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (gw, src) = if bootstrap {
        match rt.block_on(etcd::start(&cli.config)) {
            Ok((gw, src)) => (gw, Some(src)),
            Err(e) => {
                eprintln!("{}: {e}", cli.config.display());
                return ExitCode::FAILURE;
            }
        }
    } else {
        match Gateway::load(&cli.config) {
            Ok(gw) => (gw, None),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let workers = gw
        .current()
        .config
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    rt.block_on(run(gw, workers, src))
}

async fn run(gw: Arc<Gateway>, workers: usize, src: Option<Arc<EtcdSource>>) -> ExitCode {
    let gen = gw.current();
    if let Err(e) = demo::spawn(&gen.config.demo_nodes, gen.lane.tag_header.clone()).await {
        eprintln!("cannot start demo nodes: {e}");
        return ExitCode::FAILURE;
    }
    let listeners = match Server::bind_listeners(gen.config.listen, workers) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {}: {e}", gen.config.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listeners[0]
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    if let Some(admin_addr) = gen.config.admin_listen {
        if let Err(e) = admin::auth::check_bind(admin_addr, &gen.config) {
            eprintln!("{}: {e}", gw.config_path.display());
            return ExitCode::FAILURE;
        }
        match tokio::net::TcpListener::bind(admin_addr).await {
            Ok(l) => {
                let a = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::info!(addr = %a, "admin listening");
                tokio::spawn(admin::serve(gw.clone(), l));
            }
            Err(e) => {
                eprintln!("cannot listen on {admin_addr}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    tokio::spawn(graygate::control::release::controller::run(gw.clone()));
    let watcher_gw = gw.clone();
    match src.clone() {
        Some(src) => {
            tokio::spawn(etcd::run(watcher_gw, src));
        }
        None => {
            tokio::spawn(async move {
                if let Err(e) = reload::run(watcher_gw).await {
                    tracing::error!(error = %e, "file watcher failed; reload with SIGHUP only");
                }
            });
        }
    }
    // Let the watcher (or the etcd task) install itself before "listening"
    // is logged: a file changed right after start is then never missed.
    tokio::task::yield_now().await;
    if let Err(e) = gw.server.spawn_workers(listeners) {
        eprintln!("cannot start workers: {e}");
        return ExitCode::FAILURE;
    }
    // Active health checks run on this control-plane runtime.
    gw.sync_health(&gen);
    tracing::info!(%addr, workers, generation = gen.id, "graygate listening");
    drop(gen);
    shutdown_signal().await;
    // Graceful stop: close the listeners, let in-flight requests finish
    // (idle keep-alive connections close at once), exit 0 within the drain
    // time.
    let drain = Duration::from_millis(gw.current().config.client.drain_timeout_ms);
    tracing::info!(
        connections = gw.connections.get(),
        drain_ms = drain.as_millis() as u64,
        "shutting down: draining connections"
    );
    gw.begin_shutdown();
    match tokio::time::timeout(drain, gw.drained()).await {
        Ok(()) => tracing::info!("drained; exiting"),
        Err(_) => tracing::warn!(
            connections = gw.connections.get(),
            "drain time over; closing remaining connections"
        ),
    }
    if let Some(src) = src {
        etcd::leave(&src).await;
    }
    ExitCode::SUCCESS
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
