//! The upstream HTTP/1.1 engine against hand-written upstream
//! responses on real sockets: chunked, close-delimited, HTTP/1.0, interim
//! 1xx, HEAD, large and broken bodies, and pooled connections the upstream
//! closed while idle; the response-head pass-through to HTTP/1.1 clients
//! (byte for byte, and each case that takes the map way).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the wire backend sends for one request head, and whether it then
/// closes the connection.
type Answer = fn(&str) -> (Vec<u8>, bool);

/// An upstream that answers with exactly the bytes it is told to.
struct Wire {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    /// Connections the gateway has closed (read to its end).
    ended: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<String>>>,
}

impl Wire {
    async fn start(answer: Answer) -> Wire {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let ended = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (c, h, e) = (connections.clone(), heads.clone(), ended.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                c.fetch_add(1, Ordering::SeqCst);
                let (h, e) = (h.clone(), e.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            let mut chunk = [0u8; 4096];
                            match sock.read(&mut chunk).await {
                                Ok(0) | Err(_) => {
                                    e.fetch_add(1, Ordering::SeqCst);
                                    return;
                                }
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
                        buf.drain(..end + 4);
                        h.lock().unwrap().push(head.clone());
                        let (bytes, close) = answer(&head);
                        // Byte by byte for the head, so the gateway parses
                        // partial heads; the rest in one write.
                        let split = bytes
                            .windows(4)
                            .position(|w| w == b"\r\n\r\n")
                            .map_or(0, |p| p + 4);
                        for b in &bytes[..split] {
                            if sock.write_all(&[*b]).await.is_err() {
                                return;
                            }
                        }
                        if sock.write_all(&bytes[split..]).await.is_err() {
                            return;
                        }
                        if close {
                            // Our side closed; the gateway's ends when it
                            // closes the connection (read to its end).
                            let _ = sock.shutdown().await;
                            let mut rest = [0u8; 4096];
                            while matches!(sock.read(&mut rest).await, Ok(n) if n > 0) {}
                            e.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                });
            }
        });
        Wire {
            addr,
            connections,
            ended,
            heads,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

struct Setup {
    _fx: Fixture,
    gw: Gateway,
}

fn setup(wire: &Wire) -> Setup {
    setup_addr(wire.addr)
}

fn setup_addr(addr: SocketAddr) -> Setup {
    setup_extra(addr, "")
}

/// [`setup_addr`] with more of the gateway's configuration.
fn setup_extra(addr: SocketAddr, extra: &str) -> Setup {
    let fx = Fixture::new();
    Nodes::api([Node::new("w", addr).lane("formal")]).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .start(&fx, "gg.yaml");
    Setup { _fx: fx, gw }
}

#[tokio::test]
async fn chunked_bodies_are_decoded_and_the_connection_reused() {
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-up: 1\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n".to_vec(),
            false,
        )
    })
    .await;
    let s = setup(&wire);
    for _ in 0..3 {
        let r = s.gw.get("/c").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), "hello world");
        assert_eq!(r.header("x-up").as_deref(), Some("1"));
    }
    assert_eq!(
        wire.connections(),
        1,
        "the connection was pooled and reused"
    );
    let head = wire.heads.lock().unwrap()[0].clone();
    assert!(head.starts_with("GET /c HTTP/1.1\r\n"), "{head}");
    assert!(head.contains("x-gray-tag: formal\r\n"), "{head}");
}

#[tokio::test]
async fn close_delimited_and_http10_bodies_arrive_whole_and_are_not_reused() {
    let wire = Wire::start(|head| {
        let body = if head.contains("/old") {
            b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nold".to_vec()
        } else {
            b"HTTP/1.1 200 OK\r\n\r\nread until the upstream closes".to_vec()
        };
        (body, true)
    })
    .await;
    let s = setup(&wire);
    for _ in 0..2 {
        let r = s.gw.get("/eof").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), "read until the upstream closes");
        let r = s.gw.get("/old").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), "old");
    }
    assert_eq!(wire.connections(), 4, "no connection was reused");
}

#[tokio::test]
async fn interim_responses_are_skipped() {
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok".to_vec(),
            false,
        )
    })
    .await;
    let s = setup(&wire);
    let r = s.gw.get("/i").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.text(), "ok");
    assert_eq!(s.gw.get("/i").await.text(), "ok");
    assert_eq!(wire.connections(), 1);
}

#[tokio::test]
async fn idle_connections_the_upstream_closed_are_replaced() {
    // Answers with a length-delimited body and then closes without saying
    // so: the pooled connection is dead by the next request.
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody".to_vec(),
            true,
        )
    })
    .await;
    let s = setup(&wire);
    for i in 0..20 {
        let r = s.gw.get("/x").await;
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.text(), "body");
    }
    assert_eq!(wire.connections(), 20);
}

/// A pooled connection the node closed is closed by the gateway on its
/// next coarse tick, not held (in CLOSE_WAIT) until a request comes for it.
#[tokio::test]
async fn an_idle_connection_the_upstream_closed_is_closed_with_no_request() {
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody".to_vec(),
            true,
        )
    })
    .await;
    let s = setup(&wire);
    let r = s.gw.get("/x").await;
    assert_eq!(r.status, 200, "{}", r.text());
    soon("the gateway closed its side", || async {
        wire.ended.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(wire.connections(), 1);
}

#[tokio::test]
async fn bodiless_answers_keep_their_fields_on_a_reused_connection() {
    // A head with no body after it takes the map on the way out; the
    // head's fields must not stay with the pooled connection for the next
    // answer, nor be lost.
    let wire = Wire::start(|head| {
        if head.starts_with("GET /empty") {
            (
                b"HTTP/1.1 200 OK\r\nX-Mixed-Case: a\r\ncontent-length: 0\r\n\r\n".to_vec(),
                false,
            )
        } else {
            (
                b"HTTP/1.1 200 OK\r\nX-Other: b\r\ncontent-length: 4\r\n\r\nbody".to_vec(),
                false,
            )
        }
    })
    .await;
    let s = setup(&wire);
    for round in 0..3 {
        let r = s.gw.get("/empty").await;
        assert_eq!(r.status, 200, "round {round}");
        assert_eq!(
            r.header("x-mixed-case").as_deref(),
            Some("a"),
            "round {round}"
        );
        assert_eq!(r.header("x-other"), None, "round {round}");
        assert!(r.body.is_empty());
        let r = s.gw.get("/full").await;
        assert_eq!(r.text(), "body", "round {round}");
        assert_eq!(r.header("x-other").as_deref(), Some("b"), "round {round}");
        assert_eq!(r.header("x-mixed-case"), None, "round {round}");
    }
    assert_eq!(wire.connections(), 1);
}

#[tokio::test]
async fn a_request_head_larger_than_one_write_arrives_whole() {
    // A node with a small receive buffer and 6 MB of one field: the
    // first try writes only part of the head into the socket, the rest
    // goes out by the waiting write as the node reads.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    sock.listen(16).unwrap();
    sock.set_nonblocking(true).unwrap();
    let listener = TcpListener::from_std(sock.into()).unwrap();
    let addr = listener.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Vec::<usize>::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        let (mut c, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            let n = match c.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let from = buf.len().saturating_sub(3);
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
                seen.lock().unwrap().push(from + p + 4);
                buf.clear();
                let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if c.write_all(ok).await.is_err() {
                    return;
                }
            }
        }
    });
    let s = setup_extra(addr, "client:\n  max_header_bytes: 8000000\n");
    let big = "a".repeat(6_000_000);
    for round in 0..2 {
        let r = Req::get("/big-head")
            .header("x-big", &big)
            .send(s.gw.addr)
            .await;
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        assert_eq!(r.text(), "ok");
        let lens = got.lock().unwrap().clone();
        assert_eq!(lens.len(), round + 1, "round {round}: {lens:?}");
        assert!(
            lens[round] > 600_000,
            "round {round}: the head arrived cut: {lens:?}"
        );
    }
}

#[tokio::test]
async fn head_responses_have_no_body_and_keep_the_connection() {
    let wire = Wire::start(|head| {
        let body = if head.starts_with("HEAD") {
            b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n".to_vec()
        } else {
            b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()
        };
        (body, false)
    })
    .await;
    let s = setup(&wire);
    let r = Req::get("/h").method("HEAD").send(s.gw.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length").as_deref(), Some("1000"));
    assert!(r.body.is_empty());
    let r = s.gw.get("/h").await;
    assert_eq!(r.status, 204);
    let r = Req::get("/h").method("HEAD").send(s.gw.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(wire.connections(), 1);
}

#[tokio::test]
async fn large_bodies_arrive_intact() {
    let wire = Wire::start(|_| {
        let body: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();
        let mut out =
            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        out.extend_from_slice(&body);
        (out, false)
    })
    .await;
    let s = setup(&wire);
    let want: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    for _ in 0..2 {
        let r = s.gw.get("/big").await;
        assert_eq!(r.status, 200);
        assert!(r.body == want, "body differs ({} bytes)", r.body.len());
    }
    assert_eq!(wire.connections(), 1);
}

#[tokio::test]
async fn broken_response_heads_are_502() {
    for answer in [
        (|_: &str| {
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd".to_vec(),
                false,
            )
        }) as Answer,
        |_| (b"HTTP/1.1 2x0 OK\r\n\r\n".to_vec(), false),
        |_| (b"not http at all\r\n\r\n".to_vec(), false),
        |_| {
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n".to_vec(),
                false,
            )
        },
    ] {
        let wire = Wire::start(answer).await;
        let s = setup(&wire);
        let r = s.gw.get("/b").await;
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(r.text(), "upstream error\n");
    }
}

/// An upstream that answers the first request with `bytes`, then holds the
/// connection open until `cut` fires and closes it mid-body.
async fn cut_after(bytes: &'static [u8], cut: Arc<tokio::sync::Notify>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let Ok((mut sock, _)) = listener.accept().await else {
            return;
        };
        let mut buf = Vec::new();
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        if sock.write_all(bytes).await.is_err() {
            return;
        }
        cut.notified().await;
        let _ = sock.shutdown().await;
    });
    addr
}

/// Reads from `sock` into `got` until `done(got)` holds (`None`), or until
/// the connection ends (`Some(how)`), within 10 s.
async fn read_until(
    sock: &mut tokio::net::TcpStream,
    got: &mut Vec<u8>,
    done: impl Fn(&[u8]) -> bool,
) -> Option<String> {
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        while !done(got) {
            match sock.read(&mut buf).await {
                Ok(0) => return Some("closed".to_string()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                // A reset ends the response as surely as a close; what
                // arrived before it is in `got`.
                Err(e) => return Some(format!("error: {e}")),
            }
        }
        None
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "nothing conclusive within 10 s: {:?}",
            String::from_utf8_lossy(got)
        )
    })
}

#[tokio::test]
async fn a_body_cut_short_fails_the_client_response() {
    // Content-Length and chunked framing: the gateway has passed the head
    // and the first bytes on to the client when the upstream breaks off;
    // the client's response must then end without being complete — no more
    // bytes than arrived, no chunked terminator.
    for (upstream, framing, sent) in [
        (
            &b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten.."[..],
            "content-length: 100",
            &b"only ten.."[..],
        ),
        (
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"[..],
            "transfer-encoding: chunked",
            &b"5\r\nhello\r\n"[..],
        ),
    ] {
        let cut = Arc::new(tokio::sync::Notify::new());
        let s = setup_addr(cut_after(upstream, cut.clone()).await);
        let mut sock = connect_with(s.gw.addr, b"GET /short HTTP/1.1\r\nhost: t\r\n\r\n").await;
        let body_start = |got: &[u8]| got.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
        let mut got = Vec::new();
        let early = read_until(&mut sock, &mut got, |g| {
            body_start(g).is_some_and(|b| g.len() - b >= sent.len())
        })
        .await;
        let text = String::from_utf8_lossy(&got).into_owned();
        assert_eq!(early, None, "ended before the upstream broke off: {text:?}");
        cut.notify_one();
        // Read to the end of the connection, or to a complete body (which
        // would be the failure this test is about).
        let complete = |g: &[u8]| {
            body_start(g).is_some_and(|b| g.len() - b >= 100 || g.ends_with(b"\r\n0\r\n\r\n"))
        };
        let ended = read_until(&mut sock, &mut got, complete).await;
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(ended.is_some(), "a complete response: {text:?}");
        let start = body_start(&got).unwrap();
        let head = text[..start].to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{text}");
        assert!(head.contains(framing), "{framing}: {text:?}");
        assert_eq!(
            &got[start..],
            sent,
            "{framing}: the client got what the upstream sent and no end of body"
        );
    }

    // Cut at once, with the head: whatever the gateway managed to send,
    // the connection ends without a complete response.
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..".to_vec(),
            true,
        )
    })
    .await;
    let s = setup(&wire);
    let mut sock = connect_with(s.gw.addr, b"GET /short HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let mut got = Vec::new();
    let ended = read_until(&mut sock, &mut got, |_| false).await;
    assert!(ended.is_some());
    let text = String::from_utf8_lossy(&got);
    if let Some(end) = text.find("\r\n\r\n") {
        assert!(text.contains("content-length: 100"), "{text}");
        assert!(
            got.len() - (end + 4) < 100,
            "a complete body was claimed: {text}"
        );
    }
}

#[tokio::test]
async fn hop_by_hop_response_fields_stay_behind() {
    let wire = Wire::start(|head| {
        let body = if head.contains("/named") {
            b"HTTP/1.1 200 OK\r\nconnection: keep-alive, X-Internal\r\nx-internal: secret\r\nkeep-alive: timeout=5\r\nx-kept: 1\r\ncontent-length: 2\r\n\r\nok".to_vec()
        } else {
            b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\nKeep-Alive: timeout=5\r\nTrailer: x-t\r\nx-kept: 2\r\nContent-Length: 2\r\n\r\nok".to_vec()
        };
        (body, false)
    })
    .await;
    let s = setup(&wire);
    for (path, kept) in [("/named", "1"), ("/plain", "2")] {
        let r = s.gw.get(path).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), "ok");
        assert_eq!(r.header("x-kept").as_deref(), Some(kept), "{path}");
        for gone in ["x-internal", "keep-alive", "trailer"] {
            assert!(r.header(gone).is_none(), "{path}: {gone} was passed on");
        }
        assert_ne!(
            r.header("connection").as_deref(),
            Some("keep-alive, X-Internal"),
            "{path}"
        );
    }
    assert_eq!(
        wire.connections(),
        1,
        "keep-alive upstream connection reused"
    );
}

#[tokio::test]
async fn bodiless_statuses_and_head_ignore_framing_fields() {
    let wire = Wire::start(|head| {
        let body = if head.starts_with("HEAD") {
            // A HEAD answer announcing a chunked body it must not send.
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec()
        } else if head.contains("/nc") {
            b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n".to_vec()
        } else {
            b"HTTP/1.1 304 Not Modified\r\netag: \"x\"\r\ncontent-length: 10\r\n\r\n".to_vec()
        };
        (body, false)
    })
    .await;
    let s = setup(&wire);
    for _ in 0..2 {
        let r = Req::get("/h").method("HEAD").send(s.gw.addr).await;
        assert_eq!(r.status, 200);
        assert!(r.body.is_empty());
        let r = s.gw.get("/nc").await;
        assert_eq!(r.status, 204);
        let r = s.gw.get("/nm").await;
        assert_eq!(r.status, 304);
        assert_eq!(r.header("etag").as_deref(), Some("\"x\""));
        assert!(r.body.is_empty());
    }
    assert_eq!(
        wire.connections(),
        1,
        "each answer left the connection reusable"
    );
}

#[tokio::test]
async fn requests_without_host_get_the_node_address() {
    let wire = Wire::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
            true,
        )
    })
    .await;
    let s = setup(&wire);
    // An HTTP/1.0 client may send no Host: a bodiless GET (a body in
    // hand) and a POST whose body streams.
    for raw in [
        &b"GET /a HTTP/1.0\r\n\r\n"[..],
        &b"POST /b HTTP/1.0\r\ncontent-length: 3\r\n\r\nabc"[..],
    ] {
        let mut sock = connect_with(s.gw.addr, raw).await;
        let mut got = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            sock.read_to_end(&mut got),
        )
        .await
        .expect("response")
        .unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.0 200"), "{text}");
    }
    let heads = wire.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2);
    for h in heads {
        assert!(
            h.to_ascii_lowercase()
                .contains(&format!("host: {}\r\n", wire.addr)),
            "{h}"
        );
    }
}

// ---- The response-head pass-through of the plain HTTP/1.1 path: a node's
// plain head reaches the client as the node's own lines (names in its case,
// hop-by-hop lines left out), byte for byte; every head the pass-through
// does not take goes the map way (names lower-case, as before). A raw
// client reads exactly what the gateway wrote.

const DATE: &str = "Date: Tue, 01 Dec 2026 10:00:00 GMT\r\n";

/// The pass-through tests' node: its answer for a request path.
fn passthrough_answer(path: &str) -> Vec<u8> {
    let head = match path {
        // Plain: kept as sent, repeated Set-Cookie in order; the trailing
        // Connection line is left out.
        "/plain" => format!(
            "HTTP/1.1 200 OK\r\nServer: wire\r\n{DATE}Content-Type: text/plain\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Mixed-Case: Value  with  spaces\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n"
        ),
        // Hop-by-hop lines among the others: three runs of kept lines.
        "/hop" => format!(
            "HTTP/1.1 200 OK\r\nX-A: 1\r\nKeep-Alive: timeout=5\r\nX-B: 2\r\n{DATE}Proxy-Authenticate: Basic\r\nTrailer: X-T\r\nContent-Length: 2\r\n\r\n"
        ),
        // The gateway's lane response header, sent by the node too.
        "/lane" => format!(
            "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-Gray-Lane: node\r\n{DATE}Content-Length: 2\r\n\r\n"
        ),
        // Five runs: more than the pass-through holds → the map.
        "/runs" => format!(
            "HTTP/1.1 200 OK\r\nX-A: 1\r\nKeep-Alive: a\r\nX-B: 2\r\nKeep-Alive: b\r\nX-C: 3\r\nKeep-Alive: c\r\nX-D: 4\r\nKeep-Alive: d\r\n{DATE}Content-Length: 2\r\n\r\n"
        ),
        // Connection naming a field → the map, the named field removed.
        "/named" => format!(
            "HTTP/1.1 200 OK\r\nConnection: X-Private\r\nX-Private: secret\r\nX-Kept: 1\r\n{DATE}Content-Length: 2\r\n\r\n"
        ),
        // Not exactly `name: value` + CRLF → the map (which normalises).
        "/spacing" => format!(
            "HTTP/1.1 200 OK\r\nX-Tight:1\r\nX-Wide:   2\r\n{DATE}Content-Length: 2\r\n\r\n"
        ),
        "/lf" => format!(
            "HTTP/1.1 200 OK\nX-Lf: 1\n{}Content-Length: 2\n\n",
            DATE.replace("\r\n", "\n")
        ),
        // Chunked from the node: its lines kept, this side's own framing.
        "/chunked" => format!(
            "HTTP/1.1 200 OK\r\nX-Up: 1\r\n{DATE}Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
        ),
        // No Date: the gateway's, after the node's lines.
        "/nodate" => "HTTP/1.1 200 OK\r\nX-Up: 1\r\nContent-Length: 2\r\n\r\n".to_string(),
        // Repeated Content-Length → the map (one length goes out).
        "/twolengths" => format!(
            "HTTP/1.1 200 OK\r\nX-Up: 1\r\n{DATE}Content-Length: 2\r\nContent-Length: 2\r\n\r\n"
        ),
        // Transfer-Encoding beside Content-Length → the map, length dropped.
        "/te-cl" => format!(
            "HTTP/1.1 200 OK\r\nX-Up: 1\r\n{DATE}Content-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
        ),
        "/nocontent" => format!("HTTP/1.1 204 No Content\r\nX-Up: 1\r\n{DATE}\r\n"),
        "/notmodified" => format!("HTTP/1.1 304 Not Modified\r\nETag: \"v\"\r\n{DATE}\r\n"),
        "/empty" => format!("HTTP/1.1 200 OK\r\nX-Up: 1\r\n{DATE}Content-Length: 0\r\n\r\n"),
        // Interim answers are skipped; the final head passes.
        "/interim" => format!(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nX-Up: 1\r\n{DATE}Content-Length: 2\r\n\r\n"
        ),
        // obs-fold is refused by the upstream parser: 502.
        "/fold" => format!("HTTP/1.1 200 OK\r\nX-Fold: a\r\n b\r\n{DATE}Content-Length: 2\r\n\r\n"),
        _ => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string(),
    };
    let mut out = head.into_bytes();
    if !path.starts_with("/chunked")
        && !path.starts_with("/te-cl")
        && !matches!(path, "/nocontent" | "/notmodified" | "/empty")
    {
        out.extend_from_slice(b"ok");
    }
    out
}

/// [`passthrough_answer`] for a request head (HEAD: the same head, no body).
fn passthrough_wire(head: &str) -> (Vec<u8>, bool) {
    let mut words = head.split(' ');
    let method = words.next().unwrap_or("");
    let mut bytes = passthrough_answer(words.next().unwrap_or(""));
    if method == "HEAD" {
        let at = bytes.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        bytes.truncate(at + 4);
    }
    (bytes, false)
}

/// One response as the gateway wrote it: the head's text and the body's
/// bytes as framed on the wire.
struct Written {
    head: String,
    body: Vec<u8>,
}

/// Sends `request` on `sock` and reads one whole response (framed by its
/// Content-Length or chunked coding; `bodiless` for HEAD/204/304).
async fn exchange(sock: &mut TcpStream, request: &str, bodiless: bool) -> Written {
    sock.write_all(request.as_bytes()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = Vec::new();
    let end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        read_more(sock, &mut buf, deadline).await;
    };
    let head = String::from_utf8(buf[..end].to_vec()).unwrap();
    let lower = head.to_ascii_lowercase();
    let done = |b: &[u8]| -> bool {
        if bodiless {
            return true;
        }
        if lower.contains("transfer-encoding: chunked") {
            return b.ends_with(b"0\r\n\r\n");
        }
        let len = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |v| v.trim().parse::<usize>().unwrap());
        b.len() >= len
    };
    while !done(&buf[end..]) {
        read_more(sock, &mut buf, deadline).await;
    }
    Written {
        head,
        body: buf[end..].to_vec(),
    }
}

async fn read_more(sock: &mut TcpStream, buf: &mut Vec<u8>, deadline: Instant) {
    let mut chunk = [0u8; 4096];
    let left = deadline.saturating_duration_since(Instant::now());
    let n = tokio::time::timeout(left, sock.read(&mut chunk))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no response within 10 s: {:?}",
                String::from_utf8_lossy(buf)
            )
        })
        .unwrap();
    assert!(n > 0, "gateway closed: {:?}", String::from_utf8_lossy(buf));
    buf.extend_from_slice(&chunk[..n]);
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n")
}

/// The gateway's own Date line (any value), checked and cut out.
fn without_gateway_date(head: &str) -> String {
    let at = head.find("\r\ndate: ").expect("the gateway's date");
    let end = at + 2 + head[at + 2..].find("\r\n").unwrap() + 2;
    format!("{}{}", &head[..at + 2], &head[end..])
}

#[tokio::test]
async fn plain_heads_pass_through_byte_for_byte() {
    let wire = Wire::start(passthrough_wire).await;
    let s = setup_extra(wire.addr, "");
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    // Several on one connection: the pooled node connection and the kept
    // client connection serve each in turn.
    for _ in 0..3 {
        let r = exchange(&mut sock, &get("/plain"), false).await;
        assert_eq!(
            r.head,
            format!("HTTP/1.1 200 OK\r\nServer: wire\r\n{DATE}Content-Type: text/plain\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Mixed-Case: Value  with  spaces\r\nContent-Length: 2\r\n\r\n")
        );
        assert_eq!(r.body, b"ok");
        let r = exchange(&mut sock, &get("/hop"), false).await;
        assert_eq!(
            r.head,
            format!("HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\n{DATE}Content-Length: 2\r\n\r\n")
        );
        assert_eq!(r.body, b"ok");
        let r = exchange(&mut sock, &get("/chunked"), false).await;
        assert_eq!(
            r.head,
            format!("HTTP/1.1 200 OK\r\nX-Up: 1\r\n{DATE}transfer-encoding: chunked\r\n\r\n")
        );
        assert_eq!(r.body, b"2\r\nok\r\n0\r\n\r\n");
        let r = exchange(&mut sock, &get("/nodate"), false).await;
        assert!(
            r.head
                .starts_with("HTTP/1.1 200 OK\r\nX-Up: 1\r\nContent-Length: 2\r\ndate: "),
            "{}",
            r.head
        );
        assert_eq!(
            without_gateway_date(&r.head),
            "HTTP/1.1 200 OK\r\nX-Up: 1\r\nContent-Length: 2\r\n\r\n"
        );
        let r = exchange(&mut sock, &get("/interim"), false).await;
        assert_eq!(
            r.head,
            format!("HTTP/1.1 201 Created\r\nX-Up: 1\r\n{DATE}Content-Length: 2\r\n\r\n")
        );
    }
    // An HTTP/1.0 client that asks to keep the connection: told so after
    // the node's lines.
    let r = exchange(
        &mut sock,
        "GET /plain HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(
        r.head,
        format!("HTTP/1.0 200 OK\r\nServer: wire\r\n{DATE}Content-Type: text/plain\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Mixed-Case: Value  with  spaces\r\nContent-Length: 2\r\nconnection: keep-alive\r\n\r\n")
    );
    assert_eq!(r.body, b"ok");
}

#[tokio::test]
async fn unusual_heads_take_the_map_as_before() {
    let wire = Wire::start(passthrough_wire).await;
    let s = setup_extra(wire.addr, "");
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    let date = DATE.replacen("Date", "date", 1);
    let cases: [(&str, bool, String); 9] = [
        (
            "/runs",
            false,
            format!("HTTP/1.1 200 OK\r\nx-a: 1\r\nx-b: 2\r\nx-c: 3\r\nx-d: 4\r\n{date}content-length: 2\r\n\r\n"),
        ),
        (
            "/named",
            false,
            // (The map's removal reorders the rest, as before.)
            format!("HTTP/1.1 200 OK\r\n{date}content-length: 2\r\nx-kept: 1\r\n\r\n"),
        ),
        (
            "/spacing",
            false,
            format!("HTTP/1.1 200 OK\r\nx-tight: 1\r\nx-wide: 2\r\n{date}content-length: 2\r\n\r\n"),
        ),
        (
            "/lf",
            false,
            format!("HTTP/1.1 200 OK\r\nx-lf: 1\r\n{date}content-length: 2\r\n\r\n"),
        ),
        (
            "/twolengths",
            false,
            format!("HTTP/1.1 200 OK\r\nx-up: 1\r\n{date}content-length: 2\r\n\r\n"),
        ),
        (
            "/te-cl",
            false,
            format!("HTTP/1.1 200 OK\r\nx-up: 1\r\n{date}transfer-encoding: chunked\r\n\r\n"),
        ),
        (
            "/nocontent",
            true,
            format!("HTTP/1.1 204 No Content\r\nx-up: 1\r\n{date}\r\n"),
        ),
        (
            "/notmodified",
            true,
            format!("HTTP/1.1 304 Not Modified\r\netag: \"v\"\r\n{date}\r\n"),
        ),
        (
            "/empty",
            false,
            format!("HTTP/1.1 200 OK\r\nx-up: 1\r\n{date}content-length: 0\r\n\r\n"),
        ),
    ];
    for (path, bodiless, want) in &cases {
        let r = exchange(&mut sock, &get(path), *bodiless).await;
        assert_eq!(&r.head, want, "{path}");
    }
    // HEAD: the node's length kept, no body; the map way.
    let r = exchange(&mut sock, "HEAD /plain HTTP/1.1\r\nHost: t\r\n\r\n", true).await;
    assert_eq!(
        r.head,
        format!("HTTP/1.1 200 OK\r\nserver: wire\r\n{date}content-type: text/plain\r\nset-cookie: a=1\r\nset-cookie: b=2\r\nx-mixed-case: Value  with  spaces\r\ncontent-length: 2\r\n\r\n")
    );
    // The same connection still serves a plain head as sent.
    let r = exchange(&mut sock, &get("/hop"), false).await;
    assert_eq!(
        r.head,
        format!("HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\n{DATE}Content-Length: 2\r\n\r\n")
    );
    // obs-fold from a node: refused (502), never passed on.
    let r = exchange(&mut sock, &get("/fold"), false).await;
    assert!(r.head.starts_with("HTTP/1.1 502 "), "{}", r.head);
    assert!(
        !r.head.to_ascii_lowercase().contains("x-fold"),
        "{}",
        r.head
    );
}

/// The lane response header goes after the node's lines, which stay as
/// the node sent them; a node's own field of that name is replaced, and its
/// head then takes the map (in its order).
#[tokio::test]
async fn a_lane_response_header_follows_the_nodes_lines_or_replaces_its_field() {
    let wire = Wire::start(passthrough_wire).await;
    let s = setup_extra(wire.addr, "lane_response_header: X-Gray-Lane\n");
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    let r = exchange(&mut sock, &get("/hop"), false).await;
    assert_eq!(
        r.head,
        format!("HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\n{DATE}Content-Length: 2\r\nx-gray-lane: formal\r\n\r\n")
    );
    assert_eq!(r.body, b"ok");
    let date = DATE.replacen("Date", "date", 1);
    let r = exchange(&mut sock, &get("/lane"), false).await;
    assert_eq!(
        r.head,
        format!(
            "HTTP/1.1 200 OK\r\nx-a: 1\r\nx-gray-lane: formal\r\n{date}content-length: 2\r\n\r\n"
        )
    );
    assert_eq!(r.body, b"ok");
}

/// A gRPC-Web answer from an HTTP/1.1 node whose plain head goes out as
/// sent is still read as gRPC: its trailers-only `grpc-status` 14 is a
/// counted error (recorded as 503), its lines reach the client as the node
/// sent them. (When the node's lines went out raw, the response's map was
/// empty and the answer was recorded as a plain 200.)
#[tokio::test]
async fn a_grpc_web_answer_kept_as_sent_is_still_read_as_grpc() {
    let wire = Wire::start(|_| {
        (
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/grpc-web+proto\r\nGrpc-Status: 14\r\n{DATE}Content-Length: 2\r\n\r\nok").into_bytes(),
            false,
        )
    })
    .await;
    let s = setup_extra(
        wire.addr,
        "access_log: { path: access.log, format: json }\n",
    );
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    let r = exchange(&mut sock, &get("/grpc.web/Call"), false).await;
    assert_eq!(
        r.head,
        format!("HTTP/1.1 200 OK\r\nContent-Type: application/grpc-web+proto\r\nGrpc-Status: 14\r\n{DATE}Content-Length: 2\r\n\r\n")
    );
    soon("the answer recorded as gRPC UNAVAILABLE", || async {
        s._fx
            .json_lines("access.log")
            .iter()
            .any(|l| (&l["status"], &l["sent_status"]) == (&503.into(), &200.into()))
    })
    .await;
}

/// A client's request fields reach the node as their lines came when the
/// gateway passes them on unchanged — the client's case, as nginx passes
/// request fields — and the gateway's own fields (the lane tag, the
/// forwarding fields) follow them. A field the gateway replaces (the
/// client's own `X-Forwarded-For`: the peer is not trusted) and a
/// hop-by-hop one are not among them.
#[tokio::test]
async fn a_clients_request_lines_reach_the_node_as_sent() {
    let wire = Wire::start(passthrough_wire).await;
    let s = setup(&wire);
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    let request = "GET /plain HTTP/1.1\r\nHost: t\r\nX-User-Id: 7\r\nAccept: */*\r\n\
                   X-Forwarded-For: 10.0.0.1\r\nConnection: keep-alive\r\nUser-Agent: Probe/1.0\r\n\r\n";
    let r = exchange(&mut sock, request, false).await;
    assert!(r.head.starts_with("HTTP/1.1 200 "), "{}", r.head);
    let head = wire.heads.lock().unwrap()[0].clone();
    assert!(
        head.starts_with(
            "GET /plain HTTP/1.1\r\nHost: t\r\nX-User-Id: 7\r\nAccept: */*\r\nUser-Agent: Probe/1.0\r\n"
        ),
        "{head}"
    );
    assert!(head.contains("\r\nx-gray-tag: formal\r\n"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{head}"
    );
    assert!(
        !head.contains("10.0.0.1"),
        "the client's field went on: {head}"
    );
    assert!(!head.to_ascii_lowercase().contains("connection:"), "{head}");
}
