//! Layer: the binary (top). `graygate --config FILE` runs the gateway;
//! `--check` validates and exits.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use graygate::control::{reload, Gateway};
use graygate::generation::Generation;
use graygate::server::{Kind, Server};
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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand)]
enum Command {
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
    if let Some(Command::Release {
        admin,
        token,
        action,
    }) = cli.command
    {
        return release_command(&admin, token.as_deref(), action);
    }
    if cli.check {
        // The demo certificate is made as at start, so the shipped example
        // checks before its first run too.
        Generation::prepare(&cli.config);
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
    let gw = match Gateway::load(&cli.config) {
        Ok(gw) => gw,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let workers = gw
        .current()
        .config
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Control-plane runtime: admin, reload watcher, signals, demo nodes.
    // Requests are served by the worker threads.
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
    rt.block_on(run(gw, workers))
}

async fn run(gw: Arc<Gateway>, workers: usize) -> ExitCode {
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
    let mut groups = vec![(Kind::Plain, listeners)];
    for (i, l) in gen.config.listeners.iter().enumerate() {
        let kind = match (&l.tls, l.h2c) {
            (Some(_), _) => Kind::Tls(i),
            (None, true) => Kind::H2c,
            (None, false) => Kind::Plain,
        };
        match Server::bind_listeners(l.listen, workers) {
            Ok(ls) => {
                let a = ls[0]
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                let proto = match kind {
                    Kind::Tls(_) if l.http2 => "https (h2, http/1.1)",
                    Kind::Tls(_) => "https (http/1.1)",
                    Kind::H2c => "http (http/1.1, h2c)",
                    Kind::Plain => "http (http/1.1)",
                };
                tracing::info!(addr = %a, proto, "listening");
                groups.push((kind, ls));
            }
            Err(e) => {
                eprintln!("cannot listen on {}: {e}", l.listen);
                return ExitCode::FAILURE;
            }
        }
    }
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
    tokio::spawn(async move {
        if let Err(e) = reload::run(watcher_gw).await {
            tracing::error!(error = %e, "file watcher failed; reload with SIGHUP only");
        }
    });
    if let Err(e) = gw.server.spawn_worker_groups(groups) {
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
