//! Streamed request bodies, upgrades and early answers on the one HTTP/1.1
//! engine to nodes, plain and TLS (issue 50): what the node receives on the
//! wire (exactly the client's bytes, by length or chunked), a 101 through a
//! TLS node with the bytes after its head, a node that answers before it
//! has read the body, and one that closes mid-body (502, never sent twice).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::tls::{server_config, write_cert};
use crate::harness::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a node does with a request.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Reads the whole body (by its framing, strictly) and answers
    /// `got <n>`; keeps the connection.
    Record,
    /// Answers `early` right after the head, then reads the rest to EOF.
    Early,
    /// Reads the head and some of the body, then closes.
    CloseMidBody,
    /// Answers 101 with `node-first` after the head, then echoes.
    Upgrade,
}

/// One request as the node saw it.
#[derive(Clone, Debug)]
struct Got {
    head: String,
    /// The body's bytes on the wire (chunk framing included).
    wire: Vec<u8>,
    /// The body, de-chunked.
    body: Vec<u8>,
}

#[derive(Clone, Default)]
struct Seen {
    requests: Arc<Mutex<Vec<Got>>>,
    conns: Arc<AtomicUsize>,
}

impl Seen {
    fn got(&self) -> Vec<Got> {
        self.requests.lock().unwrap().clone()
    }
}

/// Reads into `buf` until `enough` says so; false at EOF or an error.
async fn fill<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>, want: usize) -> bool {
    while buf.len() < want {
        let mut chunk = [0u8; 8192];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// Reads a head off the front of `buf` (reading more as needed).
async fn read_head<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            buf.drain(..end + 4);
            return Some(head);
        }
        let len = buf.len();
        if !fill(s, buf, len + 1).await {
            return None;
        }
    }
}

fn field(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// Reads a strictly framed chunked body: (wire bytes, body); `None` when
/// the framing is broken or cut short.
async fn read_chunked<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut Vec<u8>,
) -> Option<(Vec<u8>, Vec<u8>)> {
    let (mut wire, mut body) = (Vec::new(), Vec::new());
    loop {
        let line_end = loop {
            if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            let len = buf.len();
            if !fill(s, buf, len + 1).await {
                return None;
            }
        };
        let size = usize::from_str_radix(std::str::from_utf8(&buf[..line_end]).ok()?, 16).ok()?;
        let total = line_end + 2 + size + 2;
        if !fill(s, buf, total).await {
            return None;
        }
        if &buf[total - 2..total] != b"\r\n" {
            return None;
        }
        body.extend_from_slice(&buf[line_end + 2..line_end + 2 + size]);
        wire.extend(buf.drain(..total));
        if size == 0 {
            return Some((wire, body));
        }
    }
}

/// Serves one connection in `mode`, recording into `seen`.
async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, mode: Mode, seen: Seen) {
    seen.conns.fetch_add(1, Ordering::SeqCst);
    let mut buf = Vec::new();
    while let Some(head) = read_head(&mut s, &mut buf).await {
        let chunked = field(&head, "transfer-encoding").is_some_and(|v| v == "chunked");
        let length: usize = field(&head, "content-length").map_or(0, |v| v.parse().unwrap());
        match mode {
            Mode::Record => {
                let (wire, body) = if chunked {
                    let Some(got) = read_chunked(&mut s, &mut buf).await else {
                        return;
                    };
                    got
                } else {
                    if !fill(&mut s, &mut buf, length).await {
                        return;
                    }
                    let b: Vec<u8> = buf.drain(..length).collect();
                    (b.clone(), b)
                };
                let answer = format!("got {}", body.len());
                seen.requests.lock().unwrap().push(Got { head, wire, body });
                let out = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{answer}",
                    answer.len()
                );
                if s.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
            }
            Mode::Early => {
                seen.requests.lock().unwrap().push(Got {
                    head,
                    wire: Vec::new(),
                    body: Vec::new(),
                });
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nearly")
                    .await;
                let _ = s.flush().await;
                let mut rest = [0u8; 8192];
                while matches!(s.read(&mut rest).await, Ok(n) if n > 0) {}
                return;
            }
            Mode::CloseMidBody => {
                let len = buf.len();
                fill(&mut s, &mut buf, len + 1).await;
                seen.requests.lock().unwrap().push(Got {
                    head,
                    wire: buf.clone(),
                    body: Vec::new(),
                });
                return;
            }
            Mode::Upgrade => {
                seen.requests.lock().unwrap().push(Got {
                    head,
                    wire: Vec::new(),
                    body: Vec::new(),
                });
                let answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nnode-first";
                if s.write_all(answer).await.is_err() || s.flush().await.is_err() {
                    return;
                }
                // Echo, prefixed (what the client wrote first may already
                // be in `buf`).
                loop {
                    if !buf.is_empty() {
                        let mut out = b"echo:".to_vec();
                        out.append(&mut buf);
                        if s.write_all(&out).await.is_err() || s.flush().await.is_err() {
                            return;
                        }
                    }
                    if !fill(&mut s, &mut buf, 1).await {
                        return;
                    }
                }
            }
        }
    }
}

/// A plain node in `mode`.
async fn plain_node(mode: Mode) -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(serve(sock, mode, s.clone()));
        }
    });
    (addr, seen)
}

/// A TLS node in `mode`, its certificate for 127.0.0.1 at `certs/ip.*`.
async fn tls_node(mode: Mode, certs: &Path) -> (SocketAddr, Seen) {
    write_cert(certs, "ip", "127.0.0.1");
    let config = server_config(&certs.join("ip.crt"), &certs.join("ip.key"), &[]);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (acceptor, s) = (acceptor.clone(), s.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(sock).await {
                    serve(tls, mode, s).await;
                }
            });
        }
    });
    (addr, seen)
}

/// A gateway in front of `nodes` (one service `api`, its TLS settings
/// `tls` when given), with `extra` main configuration.
fn gateway(fx: &Fixture, nodes: &[SocketAddr], tls: Option<&str>, extra: &str) -> Gateway {
    gateway_with(fx, nodes, tls, extra, &[])
}

/// [`gateway`] with more settings of the service.
fn gateway_with(
    fx: &Fixture,
    nodes: &[SocketAddr],
    tls: Option<&str>,
    extra: &str,
    service: &[(&str, &str)],
) -> Gateway {
    let mut svc = Service::new("api");
    if let Some(t) = tls {
        svc = svc.set("tls", t);
    }
    for (k, v) in service {
        svc = svc.set(k, v);
    }
    for (i, addr) in nodes.iter().enumerate() {
        svc = svc.node(Node::new(&format!("n{i}"), *addr));
    }
    Nodes::new().service(svc).write(fx, "nodes.yaml");
    Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .start(fx, "gg.yaml")
}

/// Reads one answer (head, body by Content-Length or to the close) within
/// 20 s.
async fn answer(sock: &mut TcpStream) -> (String, Vec<u8>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = Vec::new();
    let head = tokio::time::timeout_at(deadline.into(), read_head(sock, &mut buf))
        .await
        .expect("an answer in time")
        .expect("an answer head");
    let len = field(&head, "content-length").map(|v| v.parse::<usize>().unwrap());
    match len {
        Some(n) => {
            let ok = tokio::time::timeout_at(deadline.into(), fill(sock, &mut buf, n))
                .await
                .expect("the body in time");
            assert!(ok, "cut short: {head}");
            buf.truncate(n);
        }
        None => {
            let _ = tokio::time::timeout_at(deadline.into(), sock.read_to_end(&mut buf)).await;
        }
    }
    (head, buf)
}

/// The client's body in pieces, sent with its own framing.
fn pieces() -> Vec<Vec<u8>> {
    (0..6u8)
        .map(|i| {
            let n = [1usize, 7, 300, 4096, 70_000, 2][i as usize];
            (0..n)
                .map(|j| b'a' + ((j + i as usize) % 26) as u8)
                .collect()
        })
        .collect()
}

/// A chunked client body and one with a Content-Length reach a node whole,
/// streamed (a POST is never buffered): chunked to the node when the
/// client's length is unknown (strict framing, the same bytes), by its
/// length when known.
async fn streamed_bodies_arrive_exactly(
    nodes: (SocketAddr, Seen),
    fx: &Fixture,
    tls: Option<&str>,
) {
    let (addr, seen) = nodes;
    let gw = gateway(fx, &[addr], tls, "");
    let pieces = pieces();
    let whole: Vec<u8> = pieces.concat();
    // Chunked from the client, each piece its own write.
    let mut sock = TcpStream::connect(gw.addr).await.unwrap();
    sock.write_all(b"POST /chunked HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    for p in &pieces {
        sock.write_all(format!("{:x}\r\n", p.len()).as_bytes())
            .await
            .unwrap();
        sock.write_all(p).await.unwrap();
        sock.write_all(b"\r\n").await.unwrap();
    }
    sock.write_all(b"0\r\n\r\n").await.unwrap();
    let (head, body) = answer(&mut sock).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, format!("got {}", whole.len()).as_bytes());
    let got = seen.got();
    let g = &got[0];
    assert_eq!(
        field(&g.head, "transfer-encoding").as_deref(),
        Some("chunked"),
        "{}",
        g.head
    );
    assert_eq!(field(&g.head, "content-length"), None, "{}", g.head);
    assert!(
        g.body == whole,
        "the node's body differs ({} bytes)",
        g.body.len()
    );
    // Its wire ends with the last chunk, nothing after it.
    assert!(g.wire.ends_with(b"\r\n0\r\n\r\n"));
    // With a Content-Length: the same length to the node, the bytes as is.
    let mut req = format!(
        "POST /length HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n",
        whole.len()
    )
    .into_bytes();
    sock.write_all(&req).await.unwrap();
    for p in &pieces {
        sock.write_all(p).await.unwrap();
    }
    let (head, body) = answer(&mut sock).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, format!("got {}", whole.len()).as_bytes());
    let got = seen.got();
    let g = &got[1];
    assert_eq!(
        field(&g.head, "content-length"),
        Some(whole.len().to_string()),
        "{}",
        g.head
    );
    assert_eq!(field(&g.head, "transfer-encoding"), None, "{}", g.head);
    assert!(g.wire == whole, "the node's bytes differ");
    // Both on one node connection, kept alive.
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "the connection was not reused"
    );
    req.clear();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bodies_reach_a_plain_node_exactly() {
    let fx = Fixture::new();
    streamed_bodies_arrive_exactly(plain_node(Mode::Record).await, &fx, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bodies_reach_a_tls_node_exactly() {
    let fx = Fixture::new();
    let node = tls_node(Mode::Record, &fx.path("certs")).await;
    streamed_bodies_arrive_exactly(node, &fx, Some("{ ca: certs/ip.crt }")).await;
}

/// A WebSocket-style upgrade through a TLS node: the client gets the 101
/// with its Upgrade fields, then the bytes the node sent right after its
/// head, then the node's echo of what the client sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_through_a_tls_node_carries_the_bytes_after_the_101() {
    let fx = Fixture::new();
    let (addr, seen) = tls_node(Mode::Upgrade, &fx.path("certs")).await;
    let gw = gateway(&fx, &[addr], Some("{ ca: certs/ip.crt }"), "");
    let mut sock = TcpStream::connect(gw.addr).await.unwrap();
    sock.write_all(
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = Vec::new();
    let head = tokio::time::timeout_at(deadline.into(), read_head(&mut sock, &mut buf))
        .await
        .unwrap()
        .expect("a 101");
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(
        field(&head, "upgrade").as_deref(),
        Some("websocket"),
        "{head}"
    );
    assert!(
        tokio::time::timeout_at(deadline.into(), fill(&mut sock, &mut buf, 10))
            .await
            .unwrap(),
        "the node's first bytes"
    );
    assert_eq!(&buf[..10], b"node-first");
    buf.drain(..10);
    sock.write_all(b"ping").await.unwrap();
    let want = b"echo:ping";
    assert!(
        tokio::time::timeout_at(deadline.into(), fill(&mut sock, &mut buf, want.len()))
            .await
            .unwrap(),
        "the echo"
    );
    assert_eq!(&buf[..], want);
    let got = seen.got();
    assert_eq!(field(&got[0].head, "upgrade").as_deref(), Some("websocket"));
}

/// A node that answers as soon as it has the head, before reading the
/// body: the client gets that answer while its body is still on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_answering_before_reading_the_body_is_passed_on() {
    let fx = Fixture::new();
    let (addr, seen) = plain_node(Mode::Early).await;
    let gw = gateway(&fx, &[addr], None, "");
    let mut sock = TcpStream::connect(gw.addr).await.unwrap();
    let total = 4 << 20;
    sock.write_all(
        format!("POST /early HTTP/1.1\r\nHost: a\r\nContent-Length: {total}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    sock.write_all(&[b'x'; 1024]).await.unwrap();
    // The rest of the body is sent meanwhile; the answer comes anyway.
    let (mut rd, mut wr) = sock.into_split();
    let writer = tokio::spawn(async move {
        let block = vec![b'y'; 64 * 1024];
        let mut sent = 1024;
        while sent < total {
            let n = block.len().min(total - sent);
            if wr.write_all(&block[..n]).await.is_err() {
                return;
            }
            sent += n;
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = Vec::new();
    let head = tokio::time::timeout_at(deadline.into(), read_head(&mut rd, &mut buf))
        .await
        .expect("the early answer in time")
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        tokio::time::timeout_at(deadline.into(), fill(&mut rd, &mut buf, 5))
            .await
            .unwrap()
    );
    assert_eq!(&buf[..5], b"early");
    assert_eq!(seen.got().len(), 1);
    writer.abort();
}

/// A node that closes in the middle of a streamed body: the client gets a
/// 502, and the body, which reached a node, is sent to no other (the
/// request is idempotent and retries are on: only the body stops it); the
/// node is charged once (one error, one passive-health failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_closing_mid_body_is_a_502_and_the_body_is_not_sent_again() {
    let fx = Fixture::new();
    let (a, seen_a) = plain_node(Mode::CloseMidBody).await;
    let (b, seen_b) = plain_node(Mode::CloseMidBody).await;
    let health = "{ passive: { max_fails: 5, cooldown_ms: 60000 } }";
    let gw = gateway_with(
        &fx,
        &[a, b],
        None,
        "upstream: { retries: 2 }\n",
        &[("health", health)],
    );
    let mut sock = TcpStream::connect(gw.addr).await.unwrap();
    // A chunked PUT: idempotent, but of unknown length, so it streams.
    sock.write_all(
        b"PUT /mid HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let (mut rd, mut wr) = sock.into_split();
    let writer = tokio::spawn(async move {
        // More of the body as the gateway takes it, never its end.
        let chunk = format!("1000\r\n{}\r\n", "z".repeat(4096));
        for _ in 0..256 {
            if wr.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = Vec::new();
    let head = tokio::time::timeout_at(deadline.into(), read_head(&mut rd, &mut buf))
        .await
        .expect("an answer in time")
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    let (na, nb) = (seen_a.got().len(), seen_b.got().len());
    assert_eq!(na + nb, 1, "the body went to {na} + {nb} nodes");
    assert_eq!(
        seen_a.conns.load(Ordering::SeqCst) + seen_b.conns.load(Ordering::SeqCst),
        1,
        "a second connection was opened"
    );
    writer.abort();
    // Charged once: one error and one failure, on the node that had it.
    let charged = |doc: &serde_json::Value, key: &str| -> u64 {
        doc["services"][0]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                n[key]
                    .as_u64()
                    .or_else(|| n["health_detail"][key].as_u64())
                    .unwrap_or(0)
            })
            .sum()
    };
    soon("the node's error recorded", || async {
        charged(&gw.admin_get("/nodes").await.json(), "errors") >= 1
    })
    .await;
    let doc = gw.admin_get("/nodes").await.json();
    assert_eq!(charged(&doc, "errors"), 1, "{doc}");
    assert_eq!(charged(&doc, "consecutive_fails"), 1, "{doc}");
    assert_eq!(charged(&doc, "requests"), 1, "{doc}");
}
