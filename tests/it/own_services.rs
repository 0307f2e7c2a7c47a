//! The gateway's own HTTP/1.1 services — the admin listener and the demo
//! nodes — are served by the client listeners' connection loop and codec:
//! pipelined requests answered in order, the same refusals with the same
//! short bodies (400, 431, 501), and the `client:` section's limits.

use std::time::Duration;

use crate::harness::*;

/// The whole of what `s` sends until it closes, read under a deadline of
/// `limit` (a connection the gateway should have closed by then).
async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let r = tokio::time::timeout(limit, s.read_to_end(&mut out)).await;
    assert!(r.is_ok(), "the connection is still open after {limit:?}");
    String::from_utf8_lossy(&out).into_owned()
}

/// Pipelined GETs of `paths` on one connection to `addr`: each answer's
/// (status line, body), in order.
async fn pipelined(addr: std::net::SocketAddr, paths: &[&str]) -> Vec<(String, String)> {
    let mut wire = String::new();
    for p in paths {
        wire.push_str(&format!("GET {p} HTTP/1.1\r\nHost: a\r\n\r\n"));
    }
    let mut s = connect_with(addr, wire.as_bytes()).await;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    for _ in paths {
        let (head, body) = read_one(&mut s, &mut buf).await;
        let status = head.lines().next().unwrap().to_string();
        out.push((status, String::from_utf8_lossy(&body).into_owned()));
    }
    out
}

/// The refusals every listener's codec gives, on `addr`.
async fn refuses_like_the_client_listeners(addr: std::net::SocketAddr) {
    // A coding the codec does not read: 501 and the connection closed.
    let r = exchange_raw(
        addr,
        b"POST /rules HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nxyz",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 501 "), "{r}");
    assert!(
        r.ends_with("\r\n\r\nunsupported transfer-encoding\n"),
        "{r}"
    );
    assert!(r.contains("\r\nconnection: close\r\n"), "{r}");
    // A field name with a space in it: 400, the codec's body.
    let r = exchange_raw(
        addr,
        b"GET /status HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
    assert!(r.ends_with("\r\n\r\nbad request\n"), "{r}");
    // A head past `client.max_header_bytes` (4 KiB here): 431.
    let big = format!(
        "GET /status HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
        "b".repeat(8 * 1024)
    );
    let r = exchange_raw(addr, big.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    assert!(r.ends_with("\r\n\r\nrequest headers too large\n"), "{r}");
    // HTTP/1.1 without `Host`: 400.
    let r = exchange_raw(addr, b"GET /status HTTP/1.1\r\nConnection: close\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
    assert!(r.ends_with("\r\n\r\nbad request\n"), "{r}");
    // A head that never completes is cut off at `client.header_timeout_ms`
    // (300 ms here; the bound is far above it and far below a default of
    // ten seconds).
    let mut s = connect_with(addr, b"GET /status HTTP/1.1\r\nHost: a\r\nX-Slow: 1").await;
    let rest = closed_within(&mut s, Duration::from_secs(5)).await;
    assert!(!rest.contains("200"), "{rest}");
}

const LIMITS: &str = "client:\n  header_timeout_ms: 300\n  max_header_bytes: 4096\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_speaks_through_the_codec() {
    let fx = Fixture::new();
    let up = Backend::start("n1", "formal").await;
    fx.api_nodes(&[&up]);
    let cfg = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(LIMITS)
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&cfg);
    let admin = gw.admin_addr();
    let got = pipelined(admin, &["/status", "/no-such-page", "/status"]).await;
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].0, "HTTP/1.1 200 OK", "{got:?}");
    assert!(got[0].1.contains("\"generation\""), "{got:?}");
    assert!(got[1].0.starts_with("HTTP/1.1 404 "), "{got:?}");
    assert_eq!(got[2], got[0].clone(), "the same answer, in order");
    refuses_like_the_client_listeners(admin).await;
    // Bodies through the codec: chunked, then one over the admin's 64 KiB,
    // then one whose chunked framing is broken.
    let json = r#"{"method":"GET","path":"/api/x","headers":{"X-Gray":"1"}}"#;
    let chunked = format!(
        "POST /explain HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{json}\r\n0\r\n\r\n",
        json.len()
    );
    let r = exchange_raw(admin, chunked.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 200 "), "{r}");
    assert!(r.contains("\"route\""), "{r}");
    let big = format!(
        "POST /explain HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
        70 * 1024,
        " ".repeat(70 * 1024)
    );
    let r = exchange_raw(admin, big.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 413 "), "{r}");
    assert!(r.contains("body over 64 KiB"), "{r}");
    let broken = "POST /explain HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n";
    let r = exchange_raw(admin, broken.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
    assert!(r.contains("request body unreadable"), "{r}");
    // The client listener refuses the same way, with the same limits.
    refuses_like_the_client_listeners(gw.addr).await;
    // The admin still works after all that.
    assert_eq!(gw.status().await["generation"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_node_speaks_through_the_codec() {
    let fx = Fixture::new();
    let demo: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    Nodes::api([Node::new("demo-formal", demo).lane("formal")]).write(&fx, "nodes.yaml");
    let cfg = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(LIMITS)
        .raw(&format!(
            "demo_nodes:\n  - {{ name: demo-formal, addr: \"{demo}\", lane: formal }}\n"
        ))
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&cfg);
    soon("the demo node answers", || async {
        try_get(demo, "/up", None).await.is_ok()
    })
    .await;
    let got = pipelined(demo, &["/a", "/b"]).await;
    for ((status, body), path) in got.iter().zip(["/a", "/b"]) {
        assert_eq!(status, "HTTP/1.1 200 OK");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["node"], "demo-formal");
        assert_eq!(v["path"], path, "answers in order: {got:?}");
    }
    refuses_like_the_client_listeners(demo).await;
    // Through the gateway, the tag header reaches it.
    let r = gw.get("/api/x").await;
    assert_eq!(r.json()["node"], "demo-formal");
    assert!(r.json()["tag"].is_string(), "{}", r.text());
}
