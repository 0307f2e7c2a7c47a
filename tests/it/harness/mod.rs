//! The suite's harness, one of each: [`Gateway`] (the real graygate
//! binary on free ports), [`Backend`] (a real hyper backend on loopback
//! recording what it saw), the clients ([`Req`], [`try_get`], raw
//! sockets), the typed config builder ([`Config`], [`Nodes`]), bounded
//! polling ([`eventually`]); etcd clusters, a Nacos server (rnacos), a DNS
//! server (dnsmasq), TLS tools and a browser in their own modules.

pub mod backend;
pub mod browser;
pub mod client;
pub mod config;
pub mod dnsmasq;
pub mod etcd;
pub mod gateway;
pub mod nacos;
pub mod nginx;
pub mod tls;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use backend::*;
pub use client::*;
pub use config::*;
pub use gateway::*;

/// A port on 127.0.0.1 with nothing listening: a socket stays bound to it
/// (never listening) for the life of the test process, so connects are
/// refused and no other test or process can take the port meanwhile.
pub fn closed_port() -> SocketAddr {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    std::mem::forget(s);
    addr
}

/// A port on 127.0.0.1 that was free a moment ago, below the kernel's
/// ephemeral range (`ip_local_port_range`), where every `:0` bind of the
/// suite and every outgoing connection's local port land: nothing in the
/// suite takes it before its user binds it, nor while that user is down
/// (an etcd member killed for a restart). Another process still may, so
/// its user must cope with losing it. Successive calls hand out different
/// ports (a cursor from a per-process start).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let base: u16 = if ephemeral > 26000 { 20000 } else { 1024 };
    let span = ephemeral.saturating_sub(base).max(1);
    let start = (std::process::id() % 5000) as u16;
    for _ in 0..span {
        let next = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = base + start.wrapping_add(next) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below {ephemeral}");
}

/// Polls `check` until it returns true, failing after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// [`eventually`] within 10 s, the suite's usual bound.
pub async fn soon<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually(what, Duration::from_secs(10), check).await
}

/// Why a configuration does not load (file, line, message).
pub type LoadError = graygate::config::ConfigError;

/// Loads a configuration in this process (graygate's library), as the
/// binary does at start: for tests of what the loader accepts. The one
/// place the suite names the loader's types.
pub fn load_config(main: &std::path::Path) -> Result<graygate::generation::Generation, LoadError> {
    graygate::generation::Generation::load(main, 1)
}

/// A main config with the common parts filled in, as text: for the tests
/// whose `file:line` expectations or YAML text the builder must not
/// change.
pub fn main_config(extra: &str) -> String {
    format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nreload_debounce_ms: 50\n{extra}")
}

/// A datagram socket at `path` for systemd's readiness messages
/// (`NOTIFY_SOCKET`), reads bounded by 20 s.
pub fn notify_socket(path: &std::path::Path) -> std::os::unix::net::UnixDatagram {
    let notify = std::os::unix::net::UnixDatagram::bind(path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    notify
}

/// A file of `n` bytes that shows where each byte came from.
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| b"0123456789abcdefghijklmnopqrstuvwxyz"[(i + i / 997) % 36])
        .collect()
}

/// User + system CPU seconds of process `pid` so far (`/proc/PID/stat`).
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime are fields 14 and 15 (1-based) = 11, 12 after the name.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // In clock ticks of USER_HZ, 100 per second in Linux's /proc ABI.
    ticks / 100.0
}

/// The files under `dir` (recursively) whose extension is one of `exts`, sorted.
pub fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    fn walk(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, exts, out);
            } else if p.extension().is_some_and(|x| exts.iter().any(|e| x == *e)) {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, exts, &mut out);
    out.sort();
    out
}
