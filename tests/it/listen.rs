//! The gateway's listening addresses belong to one process: a second
//! gateway started on an address in use (the main `listen`, a TLS listener,
//! `admin_listen`) is refused with the key and the address named, instead
//! of sharing the port through SO_REUSEPORT; and a reload that changes a key
//! read only at start is refused, not reported applied. Real processes,
//! real sockets.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use crate::harness::tls::{listeners, write_cert};
use crate::harness::*;

/// Inodes of the sockets listening on `port` (IPv4), from /proc/net/tcp.
fn listening_inodes(port: u16) -> BTreeSet<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let suffix = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 9 && f[1].ends_with(&suffix) && f[3] == "0A").then(|| f[9].parse().ok())?
        })
        .collect()
}

/// Inodes of the sockets process `pid` holds.
fn socket_inodes_of(pid: u32) -> BTreeSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| {
            let link = std::fs::read_link(e.ok()?.path()).ok()?;
            link.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// A second gateway on these settings fails to start, and what it printed.
fn refused(fx: &Fixture, rel: &str, cfg: &Config) -> String {
    match Gateway::try_start(&cfg.write(fx, rel)) {
        Ok(gw) => panic!(
            "the second gateway started and shares the port:\n{}",
            gw.logs()
        ),
        Err(log) => log,
    }
}

#[tokio::test]
async fn a_second_gateway_on_an_address_in_use_is_refused() {
    let fx = Fixture::new();
    write_cert(&fx.path("certs"), "site", "localhost");
    let first = Config::new()
        .listeners(&[Listener::tls().cert("certs/site.crt", "certs/site.key")])
        .start(&fx, "first.yaml");
    let tls = listeners(&first)[0];
    let admin = first.admin_addr();
    let answers = |addr: SocketAddr| async move { Req::get("/").send(addr).await.status };
    let before = answers(first.addr).await;

    // The main listener.
    let log = refused(
        &fx,
        "main.yaml",
        &Config::new().listen(&first.addr.to_string()),
    );
    let want = format!(
        "listen: cannot listen on {}: address already in use by another process",
        first.addr
    );
    assert!(log.contains(&want), "{log}");
    assert!(log.contains("exit status: 1"), "{log}");

    // A TLS listener.
    let log = refused(
        &fx,
        "tls.yaml",
        &Config::new().raw(&format!(
            "listeners:\n  - listen: {tls}\n    tls:\n      certificates:\n        - {{ cert: certs/site.crt, key: certs/site.key }}\n"
        )),
    );
    let want = format!(
        "listeners[0].listen: cannot listen on {tls}: address already in use by another process"
    );
    assert!(log.contains(&want), "{log}");

    // The admin listener.
    let log = refused(&fx, "admin.yaml", &Config::new().set("admin_listen", admin));
    let want = format!(
        "admin_listen: cannot listen on {admin}: address already in use by another process"
    );
    assert!(log.contains(&want), "{log}");

    // Only the first gateway listens on its ports, and it still answers.
    let mine = socket_inodes_of(first.pid());
    for addr in [first.addr, tls, admin] {
        let on_port = listening_inodes(addr.port());
        assert!(
            !on_port.is_empty() && on_port.is_subset(&mine),
            "{addr}: {on_port:?} not all of {mine:?}"
        );
    }
    assert_eq!(answers(first.addr).await, before);
}

/// Writes `cfg` over the running file, sends SIGHUP (the watcher may
/// reload too) and waits until `/status` satisfies `done`; returns it.
async fn reload_until(
    gw: &Gateway,
    fx: &Fixture,
    cfg: &Config,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    cfg.write(fx, "graygate.yaml");
    gw.signal("HUP");
    eventually(
        "the reload's outcome",
        std::time::Duration::from_secs(10),
        || async { done(&gw.status().await) },
    )
    .await;
    gw.status().await
}

fn error_has(st: &serde_json::Value, want: &str) -> bool {
    st["last_reload_result"] == "rejected"
        && st["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains(want))
}

#[tokio::test]
async fn a_reload_changing_a_key_read_only_at_start_is_refused() {
    let fx = Fixture::new();
    let base = Config::new().set("workers", 2);
    let gw = base.start(&fx, "graygate.yaml");
    let served = gw.addr;
    let generation = gw.generation().await;
    let answer = Req::get("/").send(served).await.status;

    // A new listen address: refused, named with both values; nothing is
    // bound there, the old address keeps serving.
    let port = free_port();
    let moved = format!("127.0.0.1:{port}");
    let want = format!(
        "graygate.yaml:1: a key read only at start changed: listen (running: 127.0.0.1:0; file: {moved}); \
         restart graygate, or run `graygate --upgrade` (no connection is lost), to apply it"
    );
    let st = reload_until(&gw, &fx, &base.clone().listen(&moved), |st| {
        st["reloads_rejected"].as_u64() > Some(0)
    })
    .await;
    assert!(error_has(&st, &want), "{st}");
    assert_eq!(gw.generation().await, generation);
    gw.wait_log("reload rejected").await;
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    assert_eq!(Req::get("/").send(served).await.status, answer);

    // Several at once: every one named.
    let want = "keys read only at start changed: workers (running: 2; file: 3), \
                pid_file (running: none; file: gw.pid)";
    let st = reload_until(
        &gw,
        &fx,
        &base.clone().set("workers", 3).set("pid_file", "gw.pid"),
        |st| error_has(st, want),
    )
    .await;
    assert_eq!(st["generation"].as_u64(), Some(generation));

    // A key that reloads (upstream's connect timeout) is applied.
    let st = reload_until(
        &gw,
        &fx,
        &base.clone().raw("upstream: { connect_timeout_ms: 500 }"),
        |st| st["last_reload_result"] == "applied",
    )
    .await;
    assert!(st["generation"].as_u64() > Some(generation), "{st}");
}
