//! The graceful drain and idle keep-alive connections (issue 37): a
//! connection that was idle longer than `drain_idle_ms` when the drain began
//! is not closed at once — a client reusing it within `drain_idle_ms` of
//! the drain's start is answered (with `Connection: close`), and one that
//! never comes back is closed `drain_idle_ms` after the drain's start.

use std::time::{Duration, Instant};

use crate::harness::*;

const DRAIN_IDLE_MS: u64 = 1_500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_idle_past_drain_idle_is_kept_for_drain_idle_from_the_drain_start() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let cfg = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(&format!(
            "client:\n  drain_timeout_ms: 600000\n  drain_idle_ms: {DRAIN_IDLE_MS}\n"
        ))
        .write(&fx, "gg.yaml");
    let mut gw = Gateway::start(&cfg);

    // Two keep-alive connections (a real HTTP/1.1 client each): `reused`
    // comes back during the drain, `abandoned` never does.
    let mut reused = KeepAlive::open(gw.addr).await;
    let mut abandoned = KeepAlive::open(gw.addr).await;
    assert_eq!(reused.get("/before").await.status, 200);
    assert_eq!(abandoned.get("/before").await.status, 200);
    // The condition under test is the idle time itself: both connections
    // stay idle longer than `drain_idle_ms` before the drain begins.
    tokio::time::sleep(Duration::from_millis(DRAIN_IDLE_MS + 300)).await;

    gw.signal("TERM");
    gw.wait_log("shutting down: draining connections").await;
    let drain_seen = Instant::now();
    // Well past the accept loop's idle checks (a quarter of
    // `drain_idle_ms` apart), well before `drain_idle_ms` from the drain's
    // start: a close counted from the last request has happened by now.
    tokio::time::sleep_until((drain_seen + Duration::from_millis(DRAIN_IDLE_MS / 2)).into()).await;
    reused
        .answered_with_close_then_closed("/during-drain")
        .await;
    // The abandoned connection is closed `drain_idle_ms` after the drain's
    // start, and then the drain is over.
    tokio::time::timeout(Duration::from_secs(10), abandoned.conn)
        .await
        .expect("the abandoned connection was closed")
        .unwrap()
        .unwrap();
    assert!(
        drain_seen.elapsed() >= Duration::from_millis(DRAIN_IDLE_MS / 2),
        "closed too early"
    );
    gw.exits_cleanly(
        "no exit after the last connection closed",
        "drained; exiting",
    )
    .await;
}
