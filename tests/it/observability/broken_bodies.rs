//! A body the node breaks off after its 200 head — the connection closed
//! before its `Content-Length`, or a read stalled past `read_timeout_ms` —
//! is the node's error wherever the request is counted: `5xx` in
//! `graygate_requests_total`, the `/stats` error counts, the access log's
//! `status` (502 / 504, with the 200 the client got as `sent_status`), the
//! node's errors. A client that goes away mid-body is its own abort: a 2xx
//! with `error: client_abort`, nothing charged to the node.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use crate::harness::*;

/// Sends `GET path` on a raw socket and reads until the connection ends.
async fn read_all(addr: SocketAddr, path: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n");
    let mut c = connect_with(addr, req.as_bytes()).await;
    let mut got = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut got)).await;
    assert!(end.is_ok(), "the connection never ended");
    String::from_utf8_lossy(&got).into_owned()
}

/// `graygate_requests_total` of `node` in `class`.
fn requests(metrics: &str, node: &str, class: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("graygate_requests_total{"))
        .filter(|l| l.contains(&format!("node=\"{node}\"")))
        .filter(|l| l.contains(&format!("status_class=\"{class}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_the_node_breaks_off_is_a_5xx_everywhere_and_a_client_abort_is_not() {
    let cut = raw_node(RawMode::Cut).await;
    let stall = raw_node(RawMode::Stall).await;
    let big = raw_node(RawMode::Big).await;
    let fx = Fixture::new();
    // Never ejected: every request reaches its node.
    let keep = "{ passive: { max_fails: 0 } }";
    Nodes::new()
        .service(
            Service::new("cut")
                .set("health", keep)
                .node(Node::new("cut-1", cut)),
        )
        .service(
            Service::new("stall")
                .set("health", keep)
                .set("read_timeout_ms", 300)
                .node(Node::new("stall-1", stall)),
        )
        .service(Service::new("big").node(Node::new("big-1", big)))
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .raw("access_log: { path: access.log, format: json }\n")
        .routes(&[
            Route::service("/cut/", "cut"),
            Route::service("/stall/", "stall"),
            Route::service("/big/", "big"),
        ])
        .start(&fx, "gg.yaml");

    // The client keeps what it got: the 200 head and the bytes before the
    // break (or nothing, when the head had not been flushed) — never a
    // 502 after a 200, never a body passed as whole.
    for _ in 0..3 {
        let text = read_all(gw.addr, "/cut/x").await;
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 200"),
            "{text}"
        );
        assert!(!text.contains("502"), "{text}");
    }
    let text = read_all(gw.addr, "/stall/x").await;
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("seven.."),
        "{text}"
    );
    // A client that reads the head and a little of a large body, then
    // goes away.
    let mut c = connect_with(gw.addr, b"GET /big/x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    let mut got = Vec::new();
    while got.len() < 64 * 1024 {
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut chunk))
            .await
            .expect("the large body flows")
            .unwrap();
        assert!(n > 0, "the large body ended early");
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"));
    drop(c);

    soon("five requests logged", || async {
        fx.json_lines("access.log").len() == 5
    })
    .await;
    let lines = fx.json_lines("access.log");
    let of = |node: &str| -> Vec<&serde_json::Value> {
        lines.iter().filter(|l| l["node"] == node).collect()
    };
    for l in of("cut-1") {
        assert_eq!(
            (&l["status"], &l["sent_status"], &l["error"]),
            (&502.into(), &200.into(), &"upstream_body".into()),
            "{l}"
        );
    }
    let stalled = of("stall-1");
    assert_eq!(stalled.len(), 1);
    assert_eq!(
        (
            &stalled[0]["status"],
            &stalled[0]["sent_status"],
            &stalled[0]["error"]
        ),
        (&504.into(), &200.into(), &"upstream_body_timeout".into()),
        "{}",
        stalled[0]
    );
    let aborted = of("big-1");
    assert_eq!(aborted.len(), 1);
    assert_eq!(aborted[0]["status"], 200, "{}", aborted[0]);
    assert_eq!(aborted[0]["sent_status"], serde_json::Value::Null);
    assert_eq!(aborted[0]["error"], "client_abort");

    let m = gw.metrics().await;
    assert_eq!(requests(&m, "cut-1", "5xx"), 3.0, "{m}");
    assert_eq!(requests(&m, "cut-1", "2xx"), 0.0, "{m}");
    assert_eq!(requests(&m, "stall-1", "5xx"), 1.0, "{m}");
    assert_eq!(requests(&m, "stall-1", "2xx"), 0.0, "{m}");
    assert_eq!(requests(&m, "big-1", "2xx"), 1.0, "{m}");
    assert_eq!(requests(&m, "big-1", "5xx"), 0.0, "{m}");
    for (series, n) in [
        (r#"{kind="upstream_body",side="upstream"}"#, 3.0),
        (r#"{kind="upstream_body_timeout",side="upstream"}"#, 1.0),
        (r#"{kind="client_abort",side="client"}"#, 1.0),
    ] {
        let v = gw
            .metric(&format!("graygate_request_errors_total{series}"))
            .await;
        assert_eq!(v, Some(n), "{series}: {m}");
    }
    assert_eq!(gw.node_doc("cut-1").await["errors"], 3);
    assert_eq!(gw.node_doc("stall-1").await["errors"], 1);
    let b = gw.node_doc("big-1").await;
    assert_eq!((&b["errors"], &b["health"]), (&0.into(), &"healthy".into()));

    // `/stats` (sampled every 2 s) counts the same: errors are 5xx.
    let node_stats = |doc: &serde_json::Value, name: &str| {
        doc["nodes"]
            .as_array()
            .and_then(|ns| ns.iter().find(|n| n["name"] == name).cloned())
    };
    eventually(
        "/stats has every request",
        Duration::from_secs(20),
        || async {
            let doc = gw.admin_get("/stats").await.json();
            node_stats(&doc, "big-1").is_some_and(|n| n["total_requests"] == 1)
                && node_stats(&doc, "cut-1").is_some_and(|n| n["total_requests"] == 3)
                && node_stats(&doc, "stall-1").is_some_and(|n| n["total_requests"] == 1)
        },
    )
    .await;
    let doc = gw.admin_get("/stats").await.json();
    let errors = |name| node_stats(&doc, name).unwrap()["total_errors"].clone();
    assert_eq!(
        (errors("cut-1"), errors("stall-1"), errors("big-1")),
        (3.into(), 1.into(), 0.into()),
        "{doc}"
    );
}
