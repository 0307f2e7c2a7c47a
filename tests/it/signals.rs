//! Signals as nginx: USR1 reopens the access log (logrotate renames the
//! file, then signals), INT and QUIT stop at once, TERM drains — and a fast
//! signal during a drain cuts it short. HUP reload is in the `reload` module.

use std::time::Duration;

use crate::harness::*;

fn hang_config(fx: &Fixture, node: &Backend, extra: &str) -> std::path::PathBuf {
    fx.api_nodes(&[node]);
    Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .write(fx, "gg.yaml")
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr1_reopens_the_access_log_after_logrotate_renamed_it() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    let cfg = hang_config(&fx, &f1, "access_log: { path: logs/access.log }\n");
    std::fs::create_dir_all(fx.path("logs")).unwrap();
    let gw = Gateway::start(&cfg);
    let log = fx.path("logs/access.log");
    let rotated = fx.path("logs/access.log.1");

    assert_eq!(gw.get("/before").await.status, 200);
    soon("first line written", || async {
        read(&log).contains("\"GET /before\"")
    })
    .await;
    // logrotate: rename. Until the signal, lines follow the open file.
    std::fs::rename(&log, &rotated).unwrap();
    assert_eq!(gw.get("/between").await.status, 200);
    soon("line in the renamed file", || async {
        read(&rotated).contains("\"GET /between\"")
    })
    .await;
    assert!(!log.exists());

    gw.signal("USR1");
    soon("access log reopened by path", || async { log.exists() }).await;
    gw.wait_log("access log reopened").await;
    assert_eq!(gw.get("/after").await.status, 200);
    soon("new line in the new file", || async {
        read(&log).contains("\"GET /after\"")
    })
    .await;
    let (old, new) = (read(&rotated), read(&log));
    assert!(!old.contains("/after"), "{old}");
    assert!(
        !new.contains("/before") && !new.contains("/between"),
        "{new}"
    );
    // USR1 did not stop the process (its default action would).
    assert_eq!(gw.get("/still").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_and_sigquit_stop_at_once_without_draining() {
    for sig in ["INT", "QUIT"] {
        let hang = Backend::start_mode("hang", "formal", Mode::Hang).await;
        let fx = Fixture::new();
        // A drain of 10 minutes: only a fast stop ends the process below.
        let cfg = hang_config(&fx, &hang, "client:\n  drain_timeout_ms: 600000\n");
        let mut gw = Gateway::start(&cfg);
        let addr = gw.addr;
        let pending = tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_secs(60),
                Req::get("/hang").send_streaming_result(addr),
            )
            .await
        });
        soon("request reached the node", || async { hang.count() == 1 }).await;
        gw.signal(sig);
        gw.exits_cleanly(
            &format!("SIG{sig} did not stop graygate at once"),
            "fast shutdown",
        )
        .await;
        // The in-flight request was cut, not answered.
        let r = pending.await.unwrap().expect("client saw the close");
        assert!(r.is_err(), "{sig}: the request was answered");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_until_a_fast_signal_cuts_it_short() {
    let hang = Backend::start_mode("hang", "formal", Mode::Hang).await;
    let fx = Fixture::new();
    let cfg = hang_config(&fx, &hang, "client:\n  drain_timeout_ms: 600000\n");
    let mut gw = Gateway::start(&cfg);
    let addr = gw.addr;
    let pending = tokio::spawn(async move { Req::get("/hang").send_streaming_result(addr).await });
    soon("request reached the node", || async { hang.count() == 1 }).await;
    gw.signal("TERM");
    gw.wait_log("shutting down: draining connections").await;
    soon("listener closed", || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    // Draining: the in-flight request keeps the process alive.
    assert!(gw.running().await);
    assert!(!pending.is_finished());
    gw.signal("INT");
    gw.exits_cleanly(
        "SIGINT did not cut the drain short",
        "fast shutdown during the drain",
    )
    .await;
    pending.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_answers_a_keep_alive_request_with_connection_close() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    // Idle connections are not closed for a minute while draining: the
    // request below arrives on a connection that was idle when the drain
    // began (closing it then would race the client's request).
    let cfg = hang_config(
        &fx,
        &f1,
        "client:\n  drain_timeout_ms: 600000\n  drain_idle_ms: 60000\n",
    );
    let mut gw = Gateway::start(&cfg);
    let mut ka = KeepAlive::open(gw.addr).await;
    let first = ka.get("/first").await;
    assert_eq!(first.status, 200);
    assert!(first.headers.get("connection").is_none());

    gw.signal("TERM");
    gw.wait_log("shutting down: draining connections").await;
    soon("listener closed", || async {
        tokio::net::TcpStream::connect(gw.addr).await.is_err()
    })
    .await;
    // The idle keep-alive connection still answers, and says it closes.
    ka.answered_with_close_then_closed("/second").await;
    // That was the last connection: the drain is over.
    gw.exits_cleanly(
        "no exit after the last connection closed",
        "drained; exiting",
    )
    .await;
}
