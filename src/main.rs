//! Layer: the binary (top). `graygate --config FILE` runs the gateway (a
//! main file, or a bootstrap naming a configuration store); `--check`
//! validates and exits; `push`, `pull` and `register` talk to a store
//! (`control::source::cli`); `--upgrade` takes over from a running
//! graygate (binary upgrade); `completions SHELL` and `manpage` print what
//! the package installs. Signals as nginx: HUP reload, USR1 reopen logs,
//! USR2 binary upgrade, TERM graceful stop, QUIT/INT fast stop.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use graygate::control::source::{self, ConfigSource};
use graygate::control::upgrade::{self, Paths, Predecessor, Upgrade};
use graygate::control::Gateway;
use graygate::generation::Generation;
use graygate::server::handover::{self, Inherited};
use graygate::server::Kind;
use graygate::{admin, demo};
use tokio::signal::unix::{signal, SignalKind};

// mimalloc: faster small allocations and lower fragmentation than glibc's
// malloc for a proxy's many short-lived buffers.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--version`'s PGO line: the profile tools/rustc-pgo gave this build.
#[cfg(graygate_pgo = "committed")]
macro_rules! pgo_line {
    () => {
        "profile-guided, the committed profile (pgo/graygate.profdata)"
    };
}
#[cfg(graygate_pgo = "use")]
macro_rules! pgo_line {
    () => {
        "profile-guided, a profile of its own (GRAYGATE_PGO=use:FILE)"
    };
}
#[cfg(graygate_pgo = "generate")]
macro_rules! pgo_line {
    () => {
        "instrumented (GRAYGATE_PGO=generate:DIR), writes a profile at exit"
    };
}
#[cfg(not(any(
    graygate_pgo = "committed",
    graygate_pgo = "use",
    graygate_pgo = "generate"
)))]
macro_rules! pgo_line {
    () => {
        "none"
    };
}

/// `--version`: version and how this binary was built (see build.rs).
const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit:   ",
    env!("GRAYGATE_BUILD_COMMIT"),
    "\nrustc:    ",
    env!("GRAYGATE_BUILD_RUSTC"),
    "\ntarget:   ",
    env!("GRAYGATE_BUILD_TARGET"),
    "\nprofile:  ",
    env!("GRAYGATE_BUILD_PROFILE"),
    "\npgo:      ",
    pgo_line!(),
    "\nfeatures: ",
    env!("GRAYGATE_BUILD_FEATURES"),
    "\nlua:      LuaJIT 2.1 (vendored; its compiler per script_limits.jit, auto by default)",
);

#[derive(Parser)]
#[command(
    name = "graygate",
    version,
    long_version = LONG_VERSION,
    about = "Lane-routing edge gateway for gray releases",
    after_help = "Signals: HUP reload the configuration, USR1 reopen the access log, \
USR2 binary upgrade (start the binary again with --upgrade), TERM graceful stop \
(drain up to client.drain_timeout_ms), QUIT or INT fast stop."
)]
struct Cli {
    /// Main configuration file (installed as `<root>/usr/bin/graygate`:
    /// `<root>/etc/graygate/graygate.yaml`, else config/graygate.yaml).
    #[arg(long, short, default_value_os_t = default_config())]
    config: PathBuf,
    /// Listen on this address instead of the configuration's `listen`.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Serve the admin API on this address instead of `admin_listen`.
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<SocketAddr>,
    /// Validate the configuration (YAML, node files, lists, Lua) and exit.
    #[arg(long, short = 't')]
    check: bool,
    /// Take over the listening sockets of the graygate running on the
    /// upgrade socket, serve, then let it drain and exit (binary upgrade).
    #[arg(long)]
    upgrade: bool,
    /// Unix socket for binary upgrades (overrides `upgrade_socket`).
    #[arg(long, value_name = "PATH")]
    upgrade_socket: Option<PathBuf>,
    /// Pid file (overrides `pid_file`).
    #[arg(long, value_name = "PATH")]
    pid_file: Option<PathBuf>,
    #[command(flatten)]
    store: source::cli::CheckStore,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Progressive releases, through a running gateway's admin API.
    #[command(
        after_help = "Which gateway: --admin ADDR, else the admin_listen of the file -c names \
(a main file or a bootstrap), else 127.0.0.1:9080; stderr names the one that answered. \
The token: --token, else GRAYGATE_ADMIN_TOKEN, else that file's admin_token."
    )]
    Release {
        /// The gateway's configuration file (main file or etcd bootstrap):
        /// talk to its `admin_listen`, with its `admin_token`.
        // An id of its own: a global argument shares its values with any
        // argument of the same id up the tree (the gateway's `--config`
        // and its default).
        #[arg(
            id = "release_config",
            long = "config",
            short = 'c',
            value_name = "FILE",
            global = true
        )]
        config: Option<PathBuf>,
        /// The admin listener (wins over --config) [default: 127.0.0.1:9080].
        #[arg(long, value_name = "ADDR", global = true)]
        admin: Option<String>,
        /// Admin bearer token (else `GRAYGATE_ADMIN_TOKEN`, else the
        /// configuration's `admin_token`).
        #[arg(
            long,
            env = "GRAYGATE_ADMIN_TOKEN",
            hide_env_values = true,
            global = true
        )]
        token: Option<String>,
        /// Output: `table` (for people) or `json` (the API's JSON as it
        /// came, for scripts).
        #[arg(long, short, value_enum, value_name = "FORMAT", default_value_t = OutputFormat::Table, global = true)]
        output: OutputFormat,
        #[command(subcommand)]
        action: ReleaseAction,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff, section 1).
    Manpage,
    /// Internal: whether LuaJIT's compiler can run in this process
    /// (`script_limits.jit`); prints `ok`.
    #[command(name = "jit-probe", hide = true)]
    JitProbe,
    /// Upload a files configuration (what --check accepts) to etcd in one
    /// transaction, or to Nacos config (--nacos: one data id a document).
    Push(source::cli::Push),
    /// Write the configuration in etcd (or Nacos config: --nacos) back to
    /// files (DIR/main.yaml, …).
    Pull(source::cli::Pull),
    /// Sidecar: register an instance under a lease and keep it alive; on
    /// SIGTERM deregister first, wait the drain period, exit.
    Register(source::cli::Register),
}

#[derive(clap::Subcommand)]
enum ReleaseAction {
    /// Every release: name, lane, state, step, weight, failures, last decision.
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
    /// Finishes a promoted or rolled-back release: it lets go of its
    /// routes, lane and name (`DELETE /releases/NAME` is the same).
    Finish {
        name: String,
        /// In the same change, the promoted lane's nodes become formal in
        /// the node files and the old formal nodes drain.
        #[arg(long)]
        relabel_nodes: bool,
    },
}

/// `graygate release -o`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum OutputFormat {
    Table,
    Json,
}

/// Where `graygate release` sends its requests and how it prints.
struct ReleaseArgs {
    config: Option<PathBuf>,
    admin: Option<String>,
    token: Option<String>,
    output: OutputFormat,
}

fn release_command(args: ReleaseArgs, action: ReleaseAction) -> ExitCode {
    use graygate::admin::client::{release, Output, ReleaseCommand as C, Target};
    let cmd = match action {
        ReleaseAction::List => C::List,
        ReleaseAction::Show { name } => C::Show(name),
        ReleaseAction::Create { spec } => C::Create(spec),
        ReleaseAction::Promote { name } => C::Act(name, "promote".into()),
        ReleaseAction::Pause { name } => C::Act(name, "pause".into()),
        ReleaseAction::Resume { name } => C::Act(name, "resume".into()),
        ReleaseAction::Abort { name } => C::Act(name, "abort".into()),
        ReleaseAction::Finish {
            name,
            relabel_nodes,
        } => C::Finish {
            name,
            relabel_nodes,
        },
    };
    let output = match args.output {
        OutputFormat::Table => Output::Table,
        OutputFormat::Json => Output::Json,
    };
    let target = match Target::resolve(args.admin, args.config.as_deref(), args.token) {
        Ok(t) => t,
        Err(e) => {
            say(&format!("graygate release: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let answer = release(&target, cmd, output);
    if answer.as_ref().map_or_else(|f| f.answered, |_| true) {
        say(&format!("graygate at {}", target.describe()));
    }
    match answer {
        Ok(text) => print_out(text.as_bytes()),
        Err(f) => {
            say(&format!("graygate release: {}", f.message));
            ExitCode::FAILURE
        }
    }
}

/// A line on stderr (never a panic, whoever closed it).
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Writes `bytes` to stdout. A reader that went away (`| head -1`) is not
/// an error: what it did not read, it did not want.
fn print_out(bytes: &[u8]) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            say(&format!("cannot write to stdout: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// `--check`: builds the configuration as a start would and says so.
fn check(source: &ConfigSource) -> ExitCode {
    match source.check() {
        Ok(c) => {
            for w in &c.warnings {
                eprintln!("warning: {w}");
            }
            // A files configuration's admin listener is checked as at start.
            if let Some(cfg) = &c.config {
                if let Some(Err(e)) = cfg.admin_listen.map(|a| admin::auth::check_bind(a, cfg)) {
                    eprintln!("{}: {e}", c.name);
                    println!("{}: configuration test failed", c.name);
                    return ExitCode::FAILURE;
                }
            }
            match c.revision {
                Some(rev) => println!("{} (revision {rev}): configuration ok", c.name),
                None => println!("{}: configuration ok", c.name),
            }
            ExitCode::SUCCESS
        }
        Err(f) => {
            eprintln!("{}", f.error);
            if let Some(name) = f.name {
                println!("{name}: configuration test failed");
            }
            ExitCode::FAILURE
        }
    }
}

/// The default `--config`: the packaged path when the binary runs from an
/// installed tree (`/usr/bin/graygate` reads `/etc/graygate/graygate.yaml`,
/// wherever the unit or a shell starts it), else the repository's example.
fn default_config() -> PathBuf {
    std::env::current_exe()
        .ok()
        .filter(|exe| exe.parent().is_some_and(|d| d.ends_with("usr/bin")))
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf()))
        .map_or_else(
            || PathBuf::from("config/graygate.yaml"),
            |root| root.join("etc/graygate/graygate.yaml"),
        )
}

/// `--listen` and `--admin-listen`, read where the listeners are bound.
static LISTEN_OVERRIDES: std::sync::OnceLock<(Option<SocketAddr>, Option<SocketAddr>)> =
    std::sync::OnceLock::new();

fn listen_overrides() -> (Option<SocketAddr>, Option<SocketAddr>) {
    LISTEN_OVERRIDES.get().copied().unwrap_or_default()
}

/// Log lines start with the time and the process id, as one token
/// (`…Z[pid]`, so the level stays the line's second word for what splits
/// lines on spaces): during a binary upgrade two processes write to the
/// same journal.
struct TimeAndPid;

impl tracing_subscriber::fmt::time::FormatTime for TimeAndPid {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        tracing_subscriber::fmt::time::SystemTime.format_time(w)?;
        write!(w, "[{}]", std::process::id())
    }
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // `-c` given before a command (the default names no gateway).
    let top_config = (matches.value_source("config")
        == Some(clap::parser::ValueSource::CommandLine))
    .then(|| cli.config.clone());
    let _ = LISTEN_OVERRIDES.set((cli.listen, cli.admin_listen));
    // `script_limits.jit` is accepted only where LuaJIT's compiler can run:
    // this binary asks a child of itself once (see lane::jit_probe).
    graygate::lane::jit_probe::set_probe(graygate::lane::jit_probe::in_child);
    match &cli.command {
        Some(Command::JitProbe) => return graygate::lane::jit_probe::probe_main(),
        Some(Command::Completions { shell }) => {
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "graygate", &mut script);
            return print_out(&script);
        }
        Some(Command::Manpage) => {
            let man = clap_mangen::Man::new(Cli::command());
            let mut page = Vec::new();
            return match man.render(&mut page) {
                Ok(()) => print_out(&page),
                Err(e) => {
                    eprintln!("cannot write the man page: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Store clients that log too much at info: their warnings only,
    // unless RUST_LOG names them.
    for d in source::cli::quiet_clients() {
        filter = filter.add_directive(d.parse().expect("a valid directive"));
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_timer(TimeAndPid)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Some(Command::Release {
            config,
            admin,
            token,
            output,
            action,
        }) => {
            // `graygate -c FILE release …` as `nginx -c FILE -s reload`:
            // the gateway's file, given before the command.
            let config = config.or(top_config);
            let args = ReleaseArgs {
                config,
                admin,
                token,
                output,
            };
            return release_command(args, action);
        }
        Some(Command::Push(a)) => return a.run(),
        Some(Command::Pull(a)) => return a.run(),
        Some(Command::Register(a)) => return a.run(),
        Some(Command::Completions { .. } | Command::Manpage | Command::JitProbe) => {
            return ExitCode::FAILURE
        }
        None => {}
    }
    let source = match cli.store.config_source(cli.check, &cli.config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if cli.check {
        return check(&source);
    }
    start(&cli, &source)
}

/// Starts the gateway on `source`, takes the sockets over at `--upgrade`,
/// serves until a stop signal.
fn start(cli: &Cli, source: &ConfigSource) -> ExitCode {
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
    let gw = match source.start(&rt) {
        Ok(gw) => gw,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // What the command line sets is what runs: a reload may change the
    // file's value of those start-only keys.
    let pinned = [
        ("listen", cli.listen.is_some()),
        ("admin_listen", cli.admin_listen.is_some()),
        ("pid_file", cli.pid_file.is_some()),
        ("upgrade_socket", cli.upgrade_socket.is_some()),
    ];
    let _ = gw
        .pinned
        .set(pinned.iter().filter(|p| p.1).map(|p| p.0).collect());
    let paths = Paths::new(
        &gw.config_path,
        &gw.current().config,
        cli.pid_file.clone(),
        cli.upgrade_socket.clone(),
    );
    // A successor validates its configuration first (above), then takes the
    // sockets: a broken new config never disturbs the running process.
    let (predecessor, inherited) = if cli.upgrade {
        let Some(path) = paths.upgrade_socket.clone() else {
            eprintln!(
                "--upgrade needs upgrade_socket (or pid_file) in the config, or --upgrade-socket"
            );
            return ExitCode::FAILURE;
        };
        match upgrade::take_over(&path) {
            Ok((p, inh)) => (Some(p), inh),
            Err(e) => {
                eprintln!("binary upgrade failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        (None, Inherited::default())
    };
    let workers = gw
        .current()
        .config
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let up = Arc::new(Upgrade::new(paths));
    let code = rt.block_on(run(gw, workers, up, predecessor, inherited));
    // Do not wait for blocking tasks (an upgrade attempt in progress).
    rt.shutdown_background();
    code
}

/// The signals the process acts on besides HUP (`control::reload`).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

enum Sig {
    Graceful,
    Fast(&'static str),
    Reopen,
    Upgrade,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }

    async fn next(&mut self) -> Sig {
        tokio::select! {
            _ = self.term.recv() => Sig::Graceful,
            _ = self.int.recv() => Sig::Fast("SIGINT"),
            _ = self.quit.recv() => Sig::Fast("SIGQUIT"),
            _ = self.usr1.recv() => Sig::Reopen,
            _ = self.usr2.recv() => Sig::Upgrade,
        }
    }

    /// During a drain only the fast-stop signals matter (a second TERM is
    /// ignored; USR1 still reopens the log).
    async fn fast(&mut self, gw: &Gateway) -> &'static str {
        loop {
            match self.next().await {
                Sig::Fast(name) => return name,
                Sig::Reopen => gw.plane.access_log.reopen().await,
                Sig::Graceful | Sig::Upgrade => {}
            }
        }
    }
}

/// What [`bind`] opened: the client listeners by kind, the main listener's
/// address, and the admin listener.
struct Bound {
    groups: Vec<(Kind, Vec<std::net::TcpListener>)>,
    addr: String,
    admin: Option<tokio::net::TcpListener>,
}

/// Serving: the tasks a stop ends, and the successor of a binary upgrade
/// under way.
struct Serving {
    admin_task: Option<tokio::task::JoinHandle<()>>,
    release_task: tokio::task::JoinHandle<()>,
    /// Answers a successor on the upgrade socket; ends with its pid.
    upgrade_wait: Option<tokio::task::JoinHandle<u32>>,
    successor: Option<tokio::process::Child>,
}

/// How serving ended.
enum Stop {
    /// TERM: drain, then leave.
    Graceful,
    /// A successor took the sockets over (its pid): drain, stay in the fleet.
    HandedOver(u32),
    /// INT or QUIT: exit now.
    Fast,
}

async fn run(
    gw: Arc<Gateway>,
    workers: usize,
    up: Arc<Upgrade>,
    predecessor: Option<Predecessor>,
    inherited: Inherited,
) -> ExitCode {
    // Handlers first: USR1/USR2 would otherwise kill the process.
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gen = gw.current();
    let bound = match bind(&gw, &gen, workers, &up, inherited).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut serving = match serve(&gw, gen, bound, workers, &up, predecessor).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let handed_over = match wait_for_stop(&gw, &up, &mut serving, &mut signals).await {
        Stop::Fast => {
            up.cleanup();
            return ExitCode::SUCCESS;
        }
        Stop::Graceful => None,
        Stop::HandedOver(pid) => Some(pid),
    };
    drain(&gw, &up, serving, handed_over, &mut signals).await;
    // A gateway that stops (not one handing over) leaves the fleet.
    if handed_over.is_none() {
        graygate::control::leave(&gw).await;
    }
    up.cleanup();
    ExitCode::SUCCESS
}

/// Opens every socket the configuration names — demo nodes, client
/// listeners, admin — taking inherited ones first (binary upgrade). The
/// error is the line to print.
async fn bind(
    gw: &Gateway,
    gen: &Generation,
    workers: usize,
    up: &Upgrade,
    mut inherited: Inherited,
) -> Result<Bound, String> {
    demo::spawn(
        &gen.config.demo_nodes,
        gen.lane.tag_header.clone(),
        &gw.plane,
        |addr| {
            let l = match inherited.take("demo", addr).pop() {
                Some(l) => tokio::net::TcpListener::from_std(l)?,
                None => {
                    let s = std::net::TcpListener::bind(addr)?;
                    s.set_nonblocking(true)?;
                    tokio::net::TcpListener::from_std(s)?
                }
            };
            up.register("demo", l.local_addr()?, &l);
            Ok(l)
        },
    )
    .await
    .map_err(|e| format!("cannot start demo nodes: {e}"))?;
    let listen = listen_overrides().0.unwrap_or(gen.config.listen);
    let taken = inherited.take("client", listen);
    let listeners = handover::client_listeners(listen, workers, taken)
        .map_err(|e| listen_error("listen", listen, &e))?;
    for l in &listeners {
        if let Ok(a) = l.local_addr() {
            up.register("client", a, l);
        }
    }
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
        // Inherited at an upgrade like the main listener (by address).
        let taken = inherited.take("client", l.listen);
        let ls = handover::client_listeners(l.listen, workers, taken)
            .map_err(|e| listen_error(&format!("listeners[{i}].listen"), l.listen, &e))?;
        for s in &ls {
            if let Ok(a) = s.local_addr() {
                up.register("client", a, s);
            }
        }
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
    let mut admin = None;
    if let Some(admin_addr) = listen_overrides().1.or(gen.config.admin_listen) {
        admin::auth::check_bind(admin_addr, &gen.config)
            .map_err(|e| format!("{}: {e}", gw.config_path.display()))?;
        let bound = match inherited.take("admin", admin_addr).pop() {
            Some(l) => tokio::net::TcpListener::from_std(l),
            None => tokio::net::TcpListener::bind(admin_addr).await,
        };
        let l = bound.map_err(|e| listen_error("admin_listen", admin_addr, &e))?;
        let a = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        if let Ok(sa) = l.local_addr() {
            up.register("admin", sa, &l);
        }
        tracing::info!(addr = %a, "admin listening");
        admin = Some(l);
    }
    for e in inherited.leftover() {
        tracing::warn!(role = %e.role, addr = %e.addr, "inherited socket not in the new configuration; closed");
    }
    Ok(Bound {
        groups,
        addr,
        admin,
    })
}

/// The line printed when `key`'s address `addr` cannot be bound. An address
/// another process listens on is named so (graygate never shares a port
/// with a process that did not hand it over), with the way to replace a
/// running graygate.
fn listen_error(key: &str, addr: SocketAddr, e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        format!(
            "{key}: cannot listen on {addr}: address already in use by another process \
             (stop it, or replace a running graygate with `graygate --upgrade`)"
        )
    } else {
        format!("{key}: cannot listen on {addr}: {e}")
    }
}

/// Starts serving on what [`bind`] opened: admin, the release controller,
/// the source's watch, the workers, health checks; then the pid file,
/// systemd, the predecessor of an upgrade told to go, and the upgrade
/// socket. The error is the line to print.
async fn serve(
    gw: &Arc<Gateway>,
    gen: Arc<Generation>,
    bound: Bound,
    workers: usize,
    up: &Arc<Upgrade>,
    predecessor: Option<Predecessor>,
) -> Result<Serving, String> {
    let admin_task = bound
        .admin
        .map(|l| tokio::spawn(admin::serve(gw.clone(), l)));
    // Progressive releases: stopped in the old process at a handover, so
    // only one controller steps them.
    let release_task = tokio::spawn(graygate::control::release::controller::run(gw.clone()));
    source::watch(gw);
    // Let the watcher (or the etcd task) install itself before "listening"
    // is logged: a file changed right after start is then never missed.
    tokio::task::yield_now().await;
    gw.server
        .spawn_worker_groups(bound.groups, workers)
        .map_err(|e| format!("cannot start workers: {e}"))?;
    // Active health checks run on this control-plane runtime.
    gw.sync_health(&gen);
    let pid = std::process::id();
    let addr = bound.addr;
    tracing::info!(%addr, workers, generation = gen.id, pid, "graygate listening");
    drop(gen);
    // Serving: the pid file, then systemd (Type=notify, NotifyAccess=all).
    // After an upgrade the new process becomes the unit's main process —
    // announced before the old one is told to go, so systemd knows the new
    // main pid before the old process exits.
    if let Err(e) = up.write_pid_file() {
        tracing::error!(error = %e, "cannot write the pid file");
    }
    upgrade::notify_systemd(&format!("READY=1\nMAINPID={pid}"));
    if let Some(p) = predecessor {
        let from = p.pid;
        match tokio::task::spawn_blocking(move || p.ready()).await {
            Ok(Ok(())) => {
                tracing::info!(
                    predecessor = from,
                    "binary upgrade: took over the listening sockets; the old process drains"
                )
            }
            Ok(Err(e)) => {
                tracing::warn!(predecessor = from, error = %e, "binary upgrade: no answer from the old process")
            }
            Err(e) => tracing::warn!(error = %e, "binary upgrade: ready task failed"),
        }
    }
    let upgrade_wait = match up.bind() {
        Ok(Some(l)) => Some(tokio::spawn(up.clone().serve(l))),
        Ok(None) => None,
        Err(e) => {
            tracing::error!(error = %e, "cannot bind the upgrade socket; binary upgrades are off");
            None
        }
    };
    Ok(Serving {
        admin_task,
        release_task,
        upgrade_wait,
        successor: None,
    })
}

/// Acts on signals until one stops serving: USR1 reopens the access log,
/// USR2 starts the new binary (which then takes over on the upgrade
/// socket), TERM and a takeover end in a drain, INT and QUIT at once.
async fn wait_for_stop(
    gw: &Gateway,
    up: &Upgrade,
    serving: &mut Serving,
    signals: &mut Signals,
) -> Stop {
    loop {
        tokio::select! {
            sig = signals.next() => match sig {
                Sig::Graceful => return Stop::Graceful,
                Sig::Fast(name) => {
                    tracing::info!(signal = name, "fast shutdown: closing every connection now");
                    return Stop::Fast;
                }
                Sig::Reopen => {
                    tracing::info!("SIGUSR1; reopening the access log");
                    gw.plane.access_log.reopen().await;
                }
                Sig::Upgrade => {
                    if serving.upgrade_wait.is_none() {
                        tracing::warn!("SIGUSR2 ignored: binary upgrade needs upgrade_socket (or pid_file)");
                    } else if serving.successor.is_some() {
                        tracing::warn!("SIGUSR2 ignored: an upgrade is in progress");
                    } else {
                        match up.spawn_successor() {
                            Ok(c) => {
                                tracing::info!(successor = c.id().unwrap_or(0), "SIGUSR2; starting the new binary");
                                serving.successor = Some(c);
                            }
                            Err(e) => tracing::error!(error = %e, "SIGUSR2: cannot start the new binary"),
                        }
                    }
                }
            },
            pid = async { serving.upgrade_wait.as_mut().expect("guarded").await }, if serving.upgrade_wait.is_some() => {
                match pid {
                    Ok(pid) => return Stop::HandedOver(pid),
                    Err(_) => return Stop::Graceful,
                }
            }
            status = async { serving.successor.as_mut().expect("guarded").wait().await }, if serving.successor.is_some() => {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                tracing::error!(%status, "the new binary exited before taking over; this process keeps serving");
                serving.successor = None;
            }
        }
    }
}

/// Graceful stop (SIGTERM) or handover: stop accepting (the listeners
/// close — or live on in the successor), let in-flight requests finish,
/// close keep-alive connections cleanly, wait for WebSocket tunnels,
/// within the drain time. INT/QUIT meanwhile turn it into a fast stop.
async fn drain(
    gw: &Gateway,
    up: &Upgrade,
    mut serving: Serving,
    handed_over: Option<u32>,
    signals: &mut Signals,
) {
    let drain = Duration::from_millis(gw.current().config.client.drain_timeout_ms);
    match handed_over {
        Some(to) => {
            tracing::info!(
                successor = to,
                connections = gw.connections.get(),
                tunnels = gw.plane.tunnels.get(),
                drain_ms = drain.as_millis() as u64,
                "binary upgrade done: stopped accepting, draining"
            );
            // The successor serves admin now, and steps the releases.
            if let Some(t) = serving.admin_task.take() {
                t.abort();
            }
            serving.release_task.abort();
        }
        None => {
            upgrade::notify_systemd("STOPPING=1");
            tracing::info!(
                connections = gw.connections.get(),
                tunnels = gw.plane.tunnels.get(),
                drain_ms = drain.as_millis() as u64,
                "shutting down: draining connections"
            );
        }
    }
    if let Some(t) = serving.upgrade_wait.take() {
        t.abort();
    }
    up.release();
    gw.begin_shutdown();
    tokio::select! {
        r = tokio::time::timeout(drain, gw.drained()) => match r {
            Ok(()) => tracing::info!("drained; exiting"),
            Err(_) => tracing::warn!(
                connections = gw.connections.get(),
                tunnels = gw.plane.tunnels.get(),
                "drain time over; closing remaining connections"
            ),
        },
        name = signals.fast(gw) => {
            tracing::info!(signal = name, "fast shutdown during the drain: closing every connection now");
        }
    }
    // The spans of the last requests go out (a collector that does not
    // answer holds the exit at most 2 s).
    let plane = gw.plane.clone();
    let _ = tokio::task::spawn_blocking(move || plane.spans.shutdown(Duration::from_secs(2))).await;
}
