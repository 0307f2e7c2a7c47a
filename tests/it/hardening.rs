//! Whose fault is it: a client's broken, aborted or stalled request body is
//! the client's (400 / 499 / 408) and never counts against a node, however
//! many arrive; a node that breaks off or stalls its response body is the
//! node's fault (counted, ejected, logged with the real outcome when the body
//! ends); a client that stops reading is cut off by the send timeout without
//! blaming the node.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A node that reads the whole request body before it answers (so a broken
/// client body breaks the exchange), answering with the body's length.
async fn collecting_node() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let d = d.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let d = d.clone();
                    async move {
                        let body = req.into_body().collect().await;
                        let n = body.map(|b| b.to_bytes().len()).unwrap_or(0);
                        d.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(n.to_string()))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, done)
}

struct Setup {
    fx: Fixture,
    gw: Gateway,
    api: Arc<AtomicUsize>,
}

async fn setup() -> Setup {
    let (api, done) = collecting_node().await;
    let cut = raw_node(RawMode::Cut).await;
    let stall = raw_node(RawMode::Stall).await;
    let big = raw_node(RawMode::Big).await;
    let fx = Fixture::new();
    let health = "{ passive: { max_fails: 3, cooldown_ms: 60000 } }";
    Nodes::new()
        .service(
            Service::new("api")
                .set("health", health)
                .node(Node::new("api-1", api)),
        )
        .service(
            Service::new("cut")
                .set("health", health)
                .node(Node::new("cut-1", cut)),
        )
        .service(
            Service::new("stall")
                .set("read_timeout_ms", 300)
                .node(Node::new("stall-1", stall)),
        )
        .service(Service::new("big").node(Node::new("big-1", big)))
        .write(&fx, "nodes.yaml");
    Config::new().set("workers", 1).node_files(&["nodes.yaml"]).raw("access_log: { path: access.log, format: json }\nclient: { body_timeout_ms: 300, send_timeout_ms: 300 }\n").routes(&[Route::service("/api/", "api"), Route::service("/cut/", "cut"), Route::service("/stall/", "stall"), Route::service("/big/", "big")]).write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    Setup { fx, gw, api: done }
}

/// Sends `raw`, optionally closes the write side early, and returns the
/// status of the answer (None: the connection closed without one).
async fn send(addr: SocketAddr, raw: &[u8], close_after: bool) -> Option<u16> {
    let mut s = connect_with(addr, raw).await;
    if close_after {
        drop(s);
        return None;
    }
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(line) = buf
            .split(|&b| b == b'\n')
            .next()
            .filter(|_| buf.contains(&b'\n'))
        {
            let text = String::from_utf8_lossy(line);
            return text.split(' ').nth(1).and_then(|c| c.parse().ok());
        }
        let mut chunk = [0u8; 4096];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return None,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("no answer within 10 s"),
        }
    }
}

const BAD_CHUNK: &[u8] =
    b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n";
const BARE_LF: &[u8] =
    b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n";
const SHORT_CHUNK: &[u8] =
    b"PUT /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nhello\r\n0\r\n\r\n";
const ABORTED: &[u8] = b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\npartial";
const ABORTED_SMALL: &[u8] =
    b"PUT /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\npartial";
const STALLED: &[u8] = b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\npartial";
const STALLED_SMALL: &[u8] =
    b"PUT /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\npartial";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_broken_client_bodies_leaves_every_node_healthy() {
    let s = setup().await;
    let addr = s.gw.addr;
    let mut tasks = Vec::new();
    for _ in 0..12 {
        for (raw, close, want) in [
            (BAD_CHUNK, false, Some(400)),
            (BARE_LF, false, Some(400)),
            (SHORT_CHUNK, false, Some(400)),
            (ABORTED, true, None),
            (ABORTED_SMALL, true, None),
            (STALLED, false, Some(408)),
            (STALLED_SMALL, false, Some(408)),
        ] {
            tasks.push(tokio::spawn(async move {
                let got = send(addr, raw, close).await;
                if !close {
                    assert_eq!(got, want, "{}", String::from_utf8_lossy(raw));
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Every failure is the client's: booked as such, once each.
    let client = r#"graygate_request_errors_total{kind="#;
    soon("client errors counted", || async {
        let aborts =
            s.gw.metric_sum(&format!("{client}\"client_abort\",side=\"client\"}}"))
                .await;
        let bad =
            s.gw.metric_sum(&format!("{client}\"client_body\",side=\"client\"}}"))
                .await;
        let slow =
            s.gw.metric_sum(&format!(
                "{client}\"client_body_timeout\",side=\"client\"}}"
            ))
            .await;
        aborts >= 24.0 && bad >= 36.0 && slow >= 24.0
    })
    .await;
    assert_eq!(
        s.gw.metric_sum(r#"graygate_request_errors_total{kind="exchange",side="upstream"}"#)
            .await,
        0.0
    );
    let n = s.gw.node_doc("api-1").await;
    assert_eq!(n["health"], "healthy", "{n}");
    assert_eq!(n["errors"], 0, "{n}");
    assert_eq!(n["health_detail"]["ejections"], 0, "{n}");
    // A good request still gets through (and the node read only good bodies).
    let ok = send(
        addr,
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nok",
        false,
    )
    .await;
    assert_eq!(ok, Some(200));
    assert!(s.api.load(Ordering::SeqCst) >= 1);
    // The access log names each outcome.
    soon("log lines", || async {
        let lines = s.fx.json_lines("access.log");
        ["client_body", "client_abort", "client_body_timeout"]
            .iter()
            .all(|k| lines.iter().any(|l| l["error"] == *k))
    })
    .await;

    // A real node failure still counts and ejects: a node that breaks off
    // its response body, three times.
    for _ in 0..3 {
        let mut c = connect_with(addr, b"GET /cut/x HTTP/1.1\r\nHost: a\r\n\r\n").await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut sink)).await;
        // hyper drops the buffered head and first bytes when the body fails
        // before they were flushed: the client sees the connection end —
        // never a complete response.
        let text = String::from_utf8_lossy(&sink);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 200"),
            "{text}"
        );
        assert!(
            !text.contains("seven..") || text.ends_with("seven.."),
            "{text}"
        );
    }
    soon("cut node ejected", || async {
        let n = s.gw.node_doc("cut-1").await;
        n["health"] == "unhealthy" && n["errors"] == 3
    })
    .await;
    soon("cut bodies logged", || async {
        s.fx.json_lines("access.log")
            .iter()
            .filter(|l| {
                // Recorded as the node's failure; the client had its 200.
                l["node"] == "cut-1"
                    && l["status"] == 502
                    && l["sent_status"] == 200
                    && l["error"] == "upstream_body"
            })
            .count()
            == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_node_body_ends_at_the_read_timeout_and_counts_against_the_node() {
    let s = setup().await;
    let started = Instant::now();
    let mut c = connect_with(s.gw.addr, b"GET /stall/x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    let mut got = Vec::new();
    // The gateway ends the exchange (the client sees the connection end
    // with the body incomplete) — long before our own 20 s bound.
    let end = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut got)).await;
    assert!(end.is_ok(), "the stalled body never ended");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("seven.."),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    soon("stall counted", || async {
        s.gw.node_doc("stall-1").await["errors"] == 1
    })
    .await;
    soon("stall logged", || async {
        s.fx.json_lines("access.log")
            .iter()
            .any(|l| l["node"] == "stall-1" && l["error"] == "upstream_body_timeout")
    })
    .await;
    let m =
        s.gw.metric_sum(
            r#"graygate_request_errors_total{kind="upstream_body_timeout",side="upstream"}"#,
        )
        .await;
    assert_eq!(m, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_and_the_node_is_not_blamed() {
    let s = setup().await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut c = sock.connect(s.gw.addr).await.unwrap();
    c.write_all(b"GET /big/x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    // Never read: the gateway's writes block, the send timeout fires.
    eventually("send timeout", Duration::from_secs(20), || async {
        s.gw.logs().contains("client stopped reading the response")
    })
    .await;
    soon("recorded as the client's abort", || async {
        s.fx.json_lines("access.log")
            .iter()
            .any(|l| l["node"] == "big-1" && l["error"] == "client_abort")
    })
    .await;
    let n = s.gw.node_doc("big-1").await;
    assert_eq!(n["errors"], 0, "{n}");
    assert_eq!(n["health"], "healthy", "{n}");
    drop(c);
}
