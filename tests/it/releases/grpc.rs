//! A gRPC release judged on gRPC statuses: a gray node answering every call
//! with UNAVAILABLE (HTTP 200, `grpc-status: 14`) fails the analysis on its
//! error rate and is rolled back; formal keeps serving.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::Code;

use super::{admin_post, release, ANALYSIS};
use crate::grpc::{channel, say, GrpcNode};
use crate::harness::tls::listeners;
use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_gray_answering_unavailable_is_rolled_back() {
    let formal = GrpcNode::start("f1", None).await;
    let gray = GrpcNode::start("g1", None).await;
    gray.fail_with
        .store(Code::Unavailable as i32, Ordering::SeqCst);
    let fx = Fixture::new();
    let api = Service::new("grpc")
        .set("protocol", "h2")
        .set("retries", 0)
        .set("health", "{ passive: { max_fails: 0 } }");
    Nodes::new()
        .service(api.nodes([formal.node("f1", "formal"), gray.node("g1", "gray")]))
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/demo.Echo/", "grpc")])
        .listeners(&[Listener::h2c()])
        .start(&fx, "graygate.yaml");
    let spec = format!(
        "name: grpc-bad\nlane: gray\nroutes: [/demo.Echo/]\nkey: {{ header: x-user }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 600000 }}\n{ANALYSIS}\n"
    );
    let r = admin_post(&gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let ch = channel(listeners(&gw)[0], false).await;
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (ch, stop) = (ch.clone(), stop.clone());
        tokio::spawn(async move {
            let mut unavailable = 0u64;
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let user = format!("u{}", sent % 997);
                let r = say(&ch, "/demo.Echo/Say", "hi", &[("x-user", &user)]).await;
                if r.is_err_and(|s| s.code() == Code::Unavailable) {
                    unavailable += 1;
                }
                sent += 1;
            }
            unavailable
        })
    };
    eventually("rolled back", Duration::from_secs(30), || async {
        release(&gw, "grpc-bad").await["state"] == "rolled_back"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        traffic.await.unwrap() > 0,
        "the gray node answered UNAVAILABLE"
    );
    let doc = release(&gw, "grpc-bad").await;
    super::assert_rolled_back_on_errors(&doc);
    // Rolled back: every user is formal's again.
    for i in 0..20 {
        let user = format!("r{i}");
        let m = say(&ch, "/demo.Echo/Say", "hi", &[("x-user", &user)]).await;
        assert_eq!(m.map(|m| m.node).map_err(|s| s.code()), Ok("f1".into()));
    }
}
