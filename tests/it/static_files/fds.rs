//! Static files when the gateway runs out of file descriptors (issue 33,
//! item 8): the gateway runs under a low `RLIMIT_NOFILE` (`prlimit`), client
//! connections take every descriptor, and a static request on a connection
//! already open gets 503 (a gateway error, logged), never 404 — neither for
//! a file sent from disk nor for one not yet in the cache — and both are
//! served again once descriptors are free (nothing "missing" was cached).

use std::process::Command;
use std::time::Duration;

use crate::harness::*;

/// The gateway's descriptor limit in this test.
const NOFILE: usize = 64;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// `path`'s status on the kept connection, once it is ready for another.
async fn get(kept: &mut KeepAlive, path: &str) -> http::StatusCode {
    kept.tx.ready().await.expect("the connection stays");
    kept.get(path).await.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_a_static_file_is_503_not_404_and_recovers() {
    let fx = Fixture::new();
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    let big = pattern(2 << 20);
    std::fs::write(fx.path("site/formal/big.bin"), &big).unwrap();
    fx.write("site/formal/small.txt", "small\n");
    let cfg = Config::new()
        .set("workers", 1)
        .set("static_cache", "{ max_file_size: 1m }")
        .routes(&[Route::static_dir("/", "site")])
        .write(&fx, "gg.yaml");
    let mut cmd = Command::new("prlimit");
    cmd.arg(format!("--nofile={NOFILE}:{NOFILE}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_graygate"));
    let gw = Gateway::start_cmd(cmd, &cfg, &[]);
    let pid = gw.pid();
    let mut kept = KeepAlive::open(gw.addr).await;
    assert_eq!(get(&mut kept, "/big.bin").await, 200);
    // Connections until the gateway holds every descriptor it may.
    let mut hogs = Vec::new();
    eventually("every descriptor taken", Duration::from_secs(30), || {
        let full = open_fds(pid) >= NOFILE;
        if !full {
            for _ in 0..8 {
                hogs.push(std::net::TcpStream::connect(gw.addr).unwrap());
            }
        }
        async move { full }
    })
    .await;
    // From disk (opened per answer), and a file the cache has not seen.
    assert_eq!(get(&mut kept, "/big.bin").await, 503);
    assert_eq!(get(&mut kept, "/small.txt").await, 503);
    gw.wait_log("static file could not be opened").await;
    // Descriptors given back: both are served at once.
    drop(hogs);
    eventually("served again", Duration::from_secs(30), || {
        let ok = open_fds(pid) < NOFILE - 8;
        async move { ok }
    })
    .await;
    assert_eq!(get(&mut kept, "/small.txt").await, 200);
    assert_eq!(get(&mut kept, "/big.bin").await, 200);
    assert_eq!(gw.get("/small.txt").await.text(), "small\n");
    let errors = r#"graygate_request_errors_total{kind="file_unavailable",side="gateway"}"#;
    assert_eq!(
        gw.metric(errors).await,
        Some(2.0),
        "counted as the gateway's"
    );
}
