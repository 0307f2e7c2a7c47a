//! The client-side HTTP/1.1 server on raw sockets (`server::h1`): pipelining
//! in order, HTTP/1.0 and `Connection` keep-alive rules, HEAD, 204/304 and
//! chunked/close-delimited response framing, `Date`, bodies that arrive with
//! their head or after it, streamed bodies (chunked with trailers, `Expect:
//! 100-continue`, a large upload answered before its end) on a connection
//! that serves on, and the header timeout on a keep-alive connection's
//! second request.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::harness::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn find(buf: &[u8], pat: &[u8]) -> Option<usize> {
    buf.windows(pat.len()).position(|w| w == pat)
}

/// Request lines and the de-chunked bodies that came with them.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A scripted upstream: the last path segment picks the answer; it records
/// each request line and the de-chunked body it received.
struct Upstream {
    addr: SocketAddr,
    got: Received,
    /// Upstream connections that have ended.
    closed: Arc<std::sync::atomic::AtomicUsize>,
}

fn answer(line: &str) -> Vec<u8> {
    let path = line.split(' ').nth(1).unwrap_or("");
    match path.rsplit('/').next().unwrap_or("") {
        "len" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        "nocontent" => b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
        "notmod" => b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n".to_vec(),
        "chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n".to_vec(),
        _ => format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{line}", line.len()).into_bytes(),
    }
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>, need: impl Fn(&[u8]) -> bool) -> bool {
    while !need(buf) {
        let mut chunk = [0u8; 8192];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (g, c) = (got.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let g = g.clone();
                let c = c.clone();
                tokio::spawn(async move {
                    let _closed = Closed(c);
                    let mut buf = Vec::new();
                    loop {
                        if !fill(&mut s, &mut buf, |b| find(b, b"\r\n\r\n").is_some()).await {
                            return;
                        }
                        let end = find(&buf, b"\r\n\r\n").unwrap() + 4;
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let line = String::from_utf8_lossy(&buf[..find(&buf, b"\r\n").unwrap()])
                            .into_owned();
                        buf.drain(..end);
                        let mut body = Vec::new();
                        if head.contains("transfer-encoding: chunked") {
                            loop {
                                if !fill(&mut s, &mut buf, |b| find(b, b"\r\n").is_some()).await {
                                    return;
                                }
                                let l = find(&buf, b"\r\n").unwrap();
                                let size = usize::from_str_radix(
                                    String::from_utf8_lossy(&buf[..l]).trim(),
                                    16,
                                )
                                .unwrap();
                                if size == 0 {
                                    // Trailers up to the empty line.
                                    if !fill(&mut s, &mut buf, |b| find(b, b"\r\n\r\n").is_some())
                                        .await
                                    {
                                        return;
                                    }
                                    let t = find(&buf, b"\r\n\r\n").unwrap() + 4;
                                    buf.drain(..t);
                                    break;
                                }
                                let need = l + 2 + size + 2;
                                if !fill(&mut s, &mut buf, |b| b.len() >= need).await {
                                    return;
                                }
                                body.extend_from_slice(&buf[l + 2..l + 2 + size]);
                                buf.drain(..need);
                            }
                        } else if let Some(i) = head.find("content-length:") {
                            let n: usize = head[i + 15..]
                                .split("\r\n")
                                .next()
                                .unwrap()
                                .trim()
                                .parse()
                                .unwrap();
                            if !fill(&mut s, &mut buf, |b| b.len() >= n).await {
                                return;
                            }
                            body = buf.drain(..n).collect();
                        }
                        // `/hang`: never answered.
                        let hang = line.contains(" /hang ");
                        let reply = answer(&line);
                        g.lock().unwrap().push((line, body));
                        if hang {
                            continue;
                        }
                        if s.write_all(&reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Upstream { addr, got, closed }
    }

    fn body_of(&self, path: &str) -> Option<Vec<u8>> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .find(|(l, _)| l.split(' ').nth(1) == Some(path))
            .map(|(_, b)| b.clone())
    }
}

/// Counts an upstream connection as ended when dropped.
struct Closed(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Closed {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn gateway(fx: &Fixture, up: &Upstream, client: &str) -> Gateway {
    Nodes::api([Node::new("n1", up.addr).lane("formal")]).write(fx, "nodes.yaml");
    let cfg = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(client)
        .write(fx, "gg.yaml");
    Gateway::start(&cfg)
}

/// Where the head in `buf` ends and its Content-Length (0 without one),
/// once the whole head is there.
fn head_and_len(buf: &[u8]) -> Option<(usize, usize)> {
    let end = find(buf, b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let n = head
        .find("content-length:")
        .map(|i| {
            head[i + 15..]
                .split("\r\n")
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .unwrap_or(0);
    Some((end, n))
}

/// Reads one response with a Content-Length body (or none) off `s`.
async fn read_one(s: &mut TcpStream, buf: &mut Vec<u8>) -> String {
    let ok = tokio::time::timeout(Duration::from_secs(20), async {
        if !fill(s, buf, |b| find(b, b"\r\n\r\n").is_some()).await {
            return false;
        }
        let (end, n) = head_and_len(buf).unwrap();
        fill(s, buf, |b| b.len() >= end + n).await
    })
    .await;
    assert_eq!(
        ok,
        Ok(true),
        "no complete response: {}",
        String::from_utf8_lossy(buf)
    );
    let (end, n) = head_and_len(buf).unwrap();
    let text = String::from_utf8_lossy(&buf[..end + n]).into_owned();
    buf.drain(..end + n);
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order_with_date() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let mut req = Vec::new();
    for i in 0..5 {
        req.extend_from_slice(format!("GET /p{i} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes());
    }
    req.extend_from_slice(b"GET /last HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    let text = exchange_raw(gw.addr, &req).await;
    assert_eq!(text.matches("HTTP/1.1 200 OK\r\n").count(), 6, "{text}");
    let mut at = 0;
    for p in ["/p0", "/p1", "/p2", "/p3", "/p4", "/last"] {
        let i = text[at..].find(&format!("GET {p} HTTP/1.1")).expect(p) + at;
        at = i;
    }
    assert!(text.to_ascii_lowercase().contains("\r\ndate: "), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_closes_unless_keep_alive_is_asked_for() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    // Plain HTTP/1.0: answered as 1.0, then closed.
    let text = exchange_raw(gw.addr, b"GET /a HTTP/1.0\r\nHost: a\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.0 200 OK\r\n"), "{text}");
    assert!(!text.to_ascii_lowercase().contains("keep-alive"), "{text}");
    // Keep-Alive asked for: said so, and the connection serves again.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = Vec::new();
    for _ in 0..2 {
        s.write_all(b"GET /a HTTP/1.0\r\nHost: a\r\nConnection: Keep-Alive\r\n\r\n")
            .await
            .unwrap();
        let r = read_one(&mut s, &mut buf).await;
        assert!(r.starts_with("HTTP/1.0 200 OK\r\n"), "{r}");
        assert!(
            r.to_ascii_lowercase()
                .contains("connection: keep-alive\r\n"),
            "{r}"
        );
    }
    // A close token among others on HTTP/1.1 ends the connection.
    let text = exchange_raw(
        gw.addr,
        b"GET /a HTTP/1.1\r\nHost: a\r\nConnection: foo, close\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(text.matches("HTTP/1.1 200").count(), 1, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_204_and_304_carry_no_body() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let text = exchange_raw(
        gw.addr,
        b"HEAD /len HTTP/1.1\r\nHost: a\r\n\r\nGET /nocontent HTTP/1.1\r\nHost: a\r\n\r\nGET /notmod HTTP/1.1\r\nHost: a\r\n\r\nGET /end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    let parts: Vec<&str> = text.split("HTTP/1.1 ").skip(1).collect();
    assert_eq!(parts.len(), 4, "{text}");
    // HEAD: the length of the GET answer, no body bytes before the next.
    assert!(parts[0].starts_with("200 OK\r\n"), "{text}");
    assert!(
        parts[0]
            .to_ascii_lowercase()
            .contains("content-length: 5\r\n"),
        "{text}"
    );
    assert!(parts[0].ends_with("\r\n\r\n"), "{text}");
    assert!(parts[1].starts_with("204 No Content\r\n"), "{text}");
    assert!(
        !parts[1].to_ascii_lowercase().contains("content-length"),
        "{text}"
    );
    assert!(parts[1].ends_with("\r\n\r\n"), "{text}");
    assert!(parts[2].starts_with("304 Not Modified\r\n"), "{text}");
    assert!(
        parts[2].to_ascii_lowercase().contains("etag: \"v1\""),
        "{text}"
    );
    assert!(parts[2].ends_with("\r\n\r\n"), "{text}");
    assert!(
        parts[3].starts_with("200 OK\r\n") && parts[3].ends_with("GET /end HTTP/1.1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_length_bodies_are_chunked_or_close_delimited() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let text = exchange_raw(
        gw.addr,
        b"GET /chunked HTTP/1.1\r\nHost: a\r\n\r\nGET /end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    let lower = text.to_ascii_lowercase();
    assert!(lower.contains("transfer-encoding: chunked\r\n"), "{text}");
    let body_at = text.find("\r\n\r\n").unwrap() + 4;
    let second = text[body_at..].find("0\r\n\r\n").expect(&text) + body_at + 5;
    assert!(text[second..].starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    let body = &text[body_at..second];
    // Re-chunked or passed through: de-chunked it reads "hello world".
    let mut rest = body;
    let mut out = String::new();
    loop {
        let (size, tail) = rest.split_once("\r\n").expect(body);
        let n = usize::from_str_radix(size, 16).unwrap();
        if n == 0 {
            assert_eq!(tail, "\r\n", "{body:?}");
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    assert_eq!(out, "hello world");
    assert!(text.ends_with("GET /end HTTP/1.1"), "{text}");
    // HTTP/1.0 cannot take chunks: the body runs to the close.
    let text = exchange_raw(gw.addr, b"GET /chunked HTTP/1.0\r\nHost: a\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.0 200 OK\r\n"), "{text}");
    assert!(
        !text.to_ascii_lowercase().contains("transfer-encoding"),
        "{text}"
    );
    assert!(text.ends_with("\r\n\r\nhello world"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_with_or_after_the_head_and_streamed_bodies_on_one_connection() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = Vec::new();
    // 1. The body in the same write as its head.
    s.write_all(b"POST /with HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(
        r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("POST /with HTTP/1.1"),
        "{r}"
    );
    // 2. The head first, the body later.
    s.write_all(b"POST /after HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n")
        .await
        .unwrap();
    // Deliberately later (not a wait for anything): the body is not there
    // when the head is parsed.
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b"world").await.unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("POST /after HTTP/1.1"), "{r}");
    // 3. A chunked body with a trailer, then 4. `Expect: 100-continue`, then
    // 5. a plain GET: all on the same connection, in order.
    s.write_all(b"POST /chunks HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("POST /chunks HTTP/1.1"), "{r}");
    s.write_all(
        b"POST /expect HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let ok = tokio::time::timeout(
        Duration::from_secs(20),
        fill(&mut s, &mut buf, |b| find(b, b"\r\n\r\n").is_some()),
    )
    .await;
    assert_eq!(ok, Ok(true));
    let cont = find(&buf, b"\r\n\r\n").unwrap() + 4;
    assert_eq!(&buf[..cont], b"HTTP/1.1 100 Continue\r\n\r\n");
    buf.drain(..cont);
    s.write_all(b"xyz").await.unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("POST /expect HTTP/1.1"), "{r}");
    s.write_all(b"GET /plain HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("GET /plain HTTP/1.1"), "{r}");
    assert_eq!(up.body_of("/with").as_deref(), Some(&b"hello"[..]));
    assert_eq!(up.body_of("/after").as_deref(), Some(&b"world"[..]));
    assert_eq!(up.body_of("/chunks").as_deref(), Some(&b"abcde"[..]));
    assert_eq!(up.body_of("/expect").as_deref(), Some(&b"xyz"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connections_next_head_is_held_to_the_header_timeout() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(
        &fx,
        &up,
        "client:\n  header_timeout_ms: 300\n  idle_timeout_ms: 60000\n",
    );
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = Vec::new();
    s.write_all(b"GET /one HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("GET /one HTTP/1.1"), "{r}");
    // Idle for longer than the header timeout: still open.
    tokio::time::sleep(Duration::from_millis(600)).await;
    s.write_all(b"GET /two HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("GET /two HTTP/1.1"), "{r}");
    // A head that never completes is cut off.
    s.write_all(b"GET /three HTTP/1.1\r\nHost: a\r\nX-Slow: 1")
        .await
        .unwrap();
    let rest = read_to_close(&mut s).await;
    assert!(!rest.contains("HTTP/1.1"), "{rest}");
    assert!(up.body_of("/three").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_request_upstream() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let s = connect_with(gw.addr, b"GET /hang HTTP/1.1\r\nHost: a\r\n\r\n").await;
    soon("the request reached the upstream", || async {
        up.body_of("/hang").is_some()
    })
    .await;
    assert_eq!(up.closed.load(std::sync::atomic::Ordering::SeqCst), 0);
    drop(s);
    // The request is cancelled: its upstream connection is closed (never
    // pooled mid-exchange), long before any upstream timeout.
    soon("the upstream connection closed", || async {
        up.closed.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
}

/// Over TLS too (no peek there: the watch reads ahead): a client that
/// closes its connection mid-request — with `close_notify`, or by cutting
/// the socket — cancels the request upstream, long before any timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_that_goes_away_cancels_its_request_upstream() {
    use crate::harness::tls::{connect, listeners, write_cert};
    let up = Upstream::start().await;
    let fx = Fixture::new();
    write_cert(&fx.path("certs"), "default", "localhost");
    Nodes::api([Node::new("n1", up.addr).lane("formal")]).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .listeners(&[Listener::tls().cert("certs/default.crt", "certs/default.key")])
        .start(&fx, "gg.yaml");
    let tls = listeners(&gw)[0];
    for (round, notify) in [(1, true), (2, false)] {
        let mut s = connect(tls, &fx.path("certs/default.crt"), &[]).await;
        s.write_all(b"GET /hang HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        s.flush().await.unwrap();
        soon("the request reached the upstream", || async {
            up.got.lock().unwrap().len() == round
        })
        .await;
        assert_eq!(
            up.closed.load(std::sync::atomic::Ordering::SeqCst),
            round - 1
        );
        if notify {
            // close_notify, then the socket's end.
            s.shutdown().await.unwrap();
        }
        drop(s);
        soon("the upstream connection closed", || async {
            up.closed.load(std::sync::atomic::Ordering::SeqCst) == round
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_with_its_fin_is_cancelled_and_the_connection_closed() {
    // The head and the client's FIN arrive together: the read that drains
    // the head leaves the socket marked not readable, yet the close it has
    // seen still ends the watch (the request upstream is cancelled) and the
    // connection (long before the idle timeout).
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "client:\n  idle_timeout_ms: 60000\n");
    for round in 1..=3 {
        let mut s = connect_with(gw.addr, b"GET /hang HTTP/1.1\r\nHost: a\r\n\r\n").await;
        s.shutdown().await.unwrap();
        let rest = read_to_close(&mut s).await;
        assert!(!rest.contains("HTTP/1.1"), "{rest}");
        soon("the upstream connection closed", || async {
            up.closed.load(std::sync::atomic::Ordering::SeqCst) == round
        })
        .await;
    }
}

/// Bodies larger than any read: a `Content-Length` upload and a chunked
/// one, written in pieces while the gateway already forwards, reach the
/// node byte for byte, and the connection serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_uploads_stream_through_and_the_connection_serves_on() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = Vec::new();
    let data: Vec<u8> = (0..2_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    s.write_all(
        format!(
            "PUT /big HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n",
            data.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    for piece in data.chunks(100_000) {
        s.write_all(piece).await.unwrap();
    }
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    assert!(!r.to_ascii_lowercase().contains("connection: close"), "{r}");
    s.write_all(b"POST /bigchunks HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    for piece in data.chunks(65_536) {
        s.write_all(format!("{:x}\r\n", piece.len()).as_bytes())
            .await
            .unwrap();
        s.write_all(piece).await.unwrap();
        s.write_all(b"\r\n").await.unwrap();
    }
    s.write_all(b"0\r\n\r\nGET /after HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("POST /bigchunks HTTP/1.1"), "{r}");
    let r = read_one(&mut s, &mut buf).await;
    assert!(r.ends_with("GET /after HTTP/1.1"), "{r}");
    assert!(
        up.body_of("/big").unwrap() == data,
        "the length-framed upload differs"
    );
    assert!(
        up.body_of("/bigchunks").unwrap() == data,
        "the chunked upload differs"
    );
}

/// `CONNECT` is answered here (405, no forward proxying) and the
/// connection closed: nothing reaches a node, nothing after it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_and_the_connection_closed() {
    let up = Upstream::start().await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut all = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut all)).await;
    assert!(matches!(read, Ok(Ok(_))), "the connection was not closed");
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
        "{text}"
    );
    assert_eq!(text.matches("HTTP/1.1").count(), 1, "{text}");
    assert!(up.got.lock().unwrap().is_empty());
}
