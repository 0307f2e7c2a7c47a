//! The response-head pass-through of the plain HTTP/1.1 path: a node's plain
//! head reaches the client as the node's own lines (names in its case,
//! hop-by-hop lines left out), byte for byte; every head the pass-through
//! does not take goes the map way (names lower-case, as before). Real
//! sockets on both sides: a hand-written node that sends exactly the bytes
//! given, and a raw client that reads exactly what the gateway wrote.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DATE: &str = "Date: Tue, 01 Dec 2026 10:00:00 GMT\r\n";

/// The node's answer for a request path.
fn answer(path: &str) -> Vec<u8> {
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

/// A node that answers each request with [`answer`] for its path (not
/// for HEAD: the same head, no body).
async fn node() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
                    buf.drain(..end + 4);
                    let mut words = head.split(' ');
                    let method = words.next().unwrap_or("");
                    let path = words.next().unwrap_or("");
                    let mut bytes = answer(path);
                    if method == "HEAD" {
                        let at = bytes.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
                        bytes.truncate(at + 4);
                    }
                    if sock.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

struct Setup {
    _fx: Fixture,
    gw: Gateway,
}

fn setup(node: SocketAddr, extra: &str) -> Setup {
    let fx = Fixture::new();
    fx.write(
        "nodes.yaml",
        &format!(
            "services:\n  api:\n    nodes:\n      - {{ name: w, addr: \"{node}\", lane: formal }}\n"
        ),
    );
    let cfg = fx.write(
        "gg.yaml",
        &main_config(&format!(
            "workers: 1\nnode_files: [nodes.yaml]\nroutes:\n  - prefix: /\n    service: api\n{extra}"
        )),
    );
    let gw = Gateway::start(&cfg);
    Setup { _fx: fx, gw }
}

/// One response as the gateway wrote it: the head's text and the body's
/// bytes as framed on the wire.
struct Wire {
    head: String,
    body: Vec<u8>,
}

/// Sends `request` on `sock` and reads one whole response (framed by its
/// Content-Length or chunked coding; `bodiless` for HEAD/204/304).
async fn exchange(sock: &mut TcpStream, request: &str, bodiless: bool) -> Wire {
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
    Wire {
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
    let s = setup(node().await, "");
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
    let s = setup(node().await, "");
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

#[tokio::test]
async fn a_lane_response_header_takes_the_map() {
    let s = setup(node().await, "lane_response_header: X-Gray-Lane\n");
    let mut sock = TcpStream::connect(s.gw.addr).await.unwrap();
    let date = DATE.replacen("Date", "date", 1);
    let r = exchange(&mut sock, &get("/hop"), false).await;
    assert_eq!(
        r.head,
        format!("HTTP/1.1 200 OK\r\nx-a: 1\r\nx-b: 2\r\n{date}content-length: 2\r\nx-gray-lane: formal\r\n\r\n")
    );
    assert_eq!(r.body, b"ok");
}
