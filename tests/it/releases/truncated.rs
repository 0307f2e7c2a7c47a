//! A release judged on bodies its gray node breaks off: every gray answer
//! is a 200 head whose body the node cuts short (the connection closes
//! before its `Content-Length`). Recorded as the node's 502, that is gray's
//! error rate: the release fails its analysis on it and is rolled back;
//! formal keeps serving.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use super::{admin_post, release};
use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gray_that_cuts_its_bodies_short_is_rolled_back() {
    let formal = Backend::text("formal", 0, StatusCode::OK).await;
    let gray = raw_node(RawMode::Cut).await;
    let fx = Fixture::new();
    let api = Service::new("api").set("health", "{ passive: { max_fails: 0 } }");
    Nodes::new()
        .service(api.nodes([
            Node::new("f1", formal.addr),
            Node::new("g1", gray).lane("gray"),
        ]))
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    // Only the error rate can fail it: a wide p99 bound.
    let spec = "name: cut\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 250, min_requests: 20, failure_threshold: 2, max_error_delta_pp: 5, max_p99_ratio: 1000 }\n";
    let r = admin_post(&gw, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (addr, stop) = (gw.addr, stop.clone());
        tokio::spawn(async move {
            let (mut broken, mut sent) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let user = format!("u{}", sent % 997);
                if try_get(addr, "/api/x", Some(("X-User", &user)))
                    .await
                    .is_err()
                {
                    broken += 1;
                }
                sent += 1;
            }
            broken
        })
    };
    eventually("rolled back", Duration::from_secs(30), || async {
        release(&gw, "cut").await["state"] == "rolled_back"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    assert!(traffic.await.unwrap() > 0, "gray's bodies were cut short");
    let doc = release(&gw, "cut").await;
    super::assert_rolled_back_on_errors(&doc);
    // Rolled back: every user is formal's again, answered whole, once the
    // rollback's generation is live (its state is written just before).
    let all_formal = |from: u32| {
        let addr = gw.addr;
        async move {
            for i in from..from + 20 {
                let user = format!("r{i}");
                let r = try_get(addr, "/api/x", Some(("X-User", &user))).await;
                if r.map(|r| r.text()) != Ok("formal".to_string()) {
                    return false;
                }
            }
            true
        }
    };
    soon("the rollback is live", || all_formal(0)).await;
    assert!(all_formal(100).await, "a user still reached gray");
}
