//! Request smuggling and framing, on raw sockets: every classic desync
//! attempt (CL.TE, TE.CL, obfuscated Transfer-Encoding lists → 501, bad
//! Content-Length, chunk tricks, bare LF, odd header names and methods,
//! HTTP/0.9, oversized heads and request lines, `Expect` with pipelined
//! bytes, the h2c upgrade, Host rules, chunked bodies on GET/HEAD) is sent to a
//! real gateway in front of a recording upstream. For each: the exact status,
//! the exact requests and bytes the upstream received, and that a follow-up
//! on the same connection (pipelined in the same write, so a desync would
//! show) and on a fresh one gets its own answer. The upstream side too: two
//! Content-Lengths, a broken chunk, TE + CL and a non-chunked coding from a
//! node, and that such a connection is never reused. And what reaches a
//! node besides: `Connection` tokens, forwarding fields, the underscore
//! filter on every path hyper parses (chunked, `Expect`, TLS, HTTP/2). And
//! a differential check: every raw request through nginx in front of the
//! same node gives the same outcome, except where graygate differs on
//! purpose (listed, with the reason).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the upstream received it.
#[derive(Debug, Clone, PartialEq)]
struct Got {
    line: String,
    /// The framing field as received: `content-length: N`,
    /// `transfer-encoding: chunked`, or "".
    framing: String,
    /// Every header line, lower-cased names.
    headers: Vec<String>,
    /// The body bytes exactly as they came (chunked framing included).
    body: Vec<u8>,
    /// Which upstream connection carried it.
    conn: usize,
}

/// A recording upstream: answers `200` with the request line as the body,
/// except for `/up/...` paths, which get the scripted broken answers below.
struct Recorder {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<Got>>>,
}

fn find(buf: &[u8], pat: &[u8]) -> Option<usize> {
    buf.windows(pat.len()).position(|w| w == pat)
}

async fn fill(sock: &mut TcpStream, buf: &mut Vec<u8>, need: impl Fn(&[u8]) -> bool) -> bool {
    while !need(buf) {
        let mut chunk = [0u8; 8192];
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// The scripted answers of the upstream side.
fn answer(line: &str) -> Vec<u8> {
    let path = line.split(' ').nth(1).unwrap_or("");
    let tail = path.rsplit('/').next().unwrap_or("");
    match tail {
        "two-lengths" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!".to_vec(),
        "broken-chunk" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n".to_vec(),
        "te-and-cl" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\nb\r\nhello world\r\n0\r\n\r\n".to_vec(),
        "gzip-only" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello".to_vec(),
        "bare-lf-chunk" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n".to_vec(),
        // A trailer line ended by a bare LF, then what a lenient parser
        // would take for the next response on the connection.
        "bare-lf-trailer" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: a\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled".to_vec(),
        _ => format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{line}", line.len()).into_bytes(),
    }
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let (g, c) = (got.clone(), connections);
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let conn = c.fetch_add(1, Ordering::SeqCst);
                let g = g.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        if !fill(&mut sock, &mut buf, |b| find(b, b"\r\n\r\n").is_some()).await {
                            return;
                        }
                        let end = find(&buf, b"\r\n\r\n").unwrap() + 4;
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end);
                        let mut lines = head.split("\r\n");
                        let line = lines.next().unwrap_or("").to_string();
                        let headers: Vec<String> = lines
                            .filter(|l| !l.is_empty())
                            .map(|l| match l.split_once(':') {
                                Some((k, v)) => format!("{}:{v}", k.to_ascii_lowercase()),
                                None => l.to_string(),
                            })
                            .collect();
                        let framing = headers
                            .iter()
                            .find(|h| {
                                h.starts_with("content-length:")
                                    || h.starts_with("transfer-encoding:")
                            })
                            .cloned()
                            .unwrap_or_default();
                        let body = if framing.starts_with("transfer-encoding") {
                            // Read chunk by chunk, keeping the framing bytes.
                            let mut body = Vec::new();
                            loop {
                                if !fill(&mut sock, &mut buf, |b| find(b, b"\r\n").is_some()).await
                                {
                                    return;
                                }
                                let l = find(&buf, b"\r\n").unwrap();
                                let size = usize::from_str_radix(
                                    String::from_utf8_lossy(&buf[..l])
                                        .split(';')
                                        .next()
                                        .unwrap()
                                        .trim(),
                                    16,
                                )
                                .unwrap();
                                let need = l + 2 + size + 2;
                                if !fill(&mut sock, &mut buf, |b| b.len() >= need).await {
                                    return;
                                }
                                body.extend(buf.drain(..need));
                                if size == 0 {
                                    break body;
                                }
                            }
                        } else if let Some(n) = framing.strip_prefix("content-length:") {
                            let n: usize = n.trim().parse().unwrap();
                            if !fill(&mut sock, &mut buf, |b| b.len() >= n).await {
                                return;
                            }
                            buf.drain(..n).collect()
                        } else {
                            Vec::new()
                        };
                        let reply = answer(&line);
                        g.lock().unwrap().push(Got {
                            line,
                            framing,
                            headers,
                            body,
                            conn,
                        });
                        if sock.write_all(&reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Recorder { addr, got }
    }

    /// Requests whose target starts with `prefix`.
    fn got(&self, prefix: &str) -> Vec<Got> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|g| {
                g.line
                    .split(' ')
                    .nth(1)
                    .is_some_and(|t| t == prefix || t.starts_with(&format!("{prefix}/")))
            })
            .cloned()
            .collect()
    }
}

/// One response as the client read it.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses one final response off the front of `buf` (1xx skipped):
/// `Some((answer, used))`, or `None` while incomplete.
fn parse_response(buf: &[u8], eof: bool) -> Option<(Answer, usize)> {
    let mut start = 0;
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut fields);
        let n = match r.parse(&buf[start..]).ok()? {
            httparse::Status::Complete(n) => n,
            httparse::Status::Partial => return None,
        };
        let status = r.code?;
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_string(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        let at = start + n;
        if (100..200).contains(&status) {
            start = at;
            continue;
        }
        let get = |k: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(k))
                .map(|(_, v)| v.clone())
        };
        if let Some(len) = get("content-length") {
            let len: usize = len.trim().parse().ok()?;
            if buf.len() < at + len {
                return None;
            }
            let body = buf[at..at + len].to_vec();
            return Some((
                Answer {
                    status,
                    headers,
                    body,
                },
                at + len,
            ));
        }
        if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
            let mut body = Vec::new();
            let mut p = at;
            loop {
                let l = find(&buf[p..], b"\r\n")?;
                let size = usize::from_str_radix(
                    String::from_utf8_lossy(&buf[p..p + l])
                        .split(';')
                        .next()?
                        .trim(),
                    16,
                )
                .ok()?;
                if buf.len() < p + l + 2 + size + 2 {
                    return None;
                }
                body.extend_from_slice(&buf[p + l + 2..p + l + 2 + size]);
                p += l + 2 + size + 2;
                if size == 0 {
                    return Some((
                        Answer {
                            status,
                            headers,
                            body,
                        },
                        p,
                    ));
                }
            }
        }
        if status == 204 || status == 304 {
            return Some((
                Answer {
                    status,
                    headers,
                    body: Vec::new(),
                },
                at,
            ));
        }
        // Close-delimited.
        return eof.then(|| {
            (
                Answer {
                    status,
                    headers,
                    body: buf[at..].to_vec(),
                },
                buf.len(),
            )
        });
    }
}

/// What came back on one connection: the responses, and whether the
/// gateway closed it.
struct Conversation {
    answers: Vec<Answer>,
    closed: bool,
}

/// Sends `raw` on a fresh connection and reads until `want` responses have
/// arrived or the gateway closes (bounded).
async fn converse(addr: SocketAddr, raw: &[u8], want: usize) -> Conversation {
    let mut s = connect_with(addr, raw).await;
    let mut buf = Vec::new();
    let mut answers = Vec::new();
    let mut closed = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        while let Some((a, used)) = parse_response(&buf, closed) {
            buf.drain(..used);
            answers.push(a);
        }
        if answers.len() >= want || closed {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no answer in time; got {answers:?}");
        let mut chunk = [0u8; 65536];
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed = true,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("no answer in time; got {answers:?}"),
        }
    }
    if !closed && answers.len() >= want {
        // Is the connection still open? A read that would block says yes.
        let mut one = [0u8; 1];
        closed = matches!(
            tokio::time::timeout(Duration::from_millis(50), s.read(&mut one)).await,
            Ok(Ok(0)) | Ok(Err(_))
        );
    }
    Conversation { answers, closed }
}

/// One attack: the raw bytes (`{P}` stands for the case's own path), the
/// status it must get, what the upstream must have received (request line,
/// framing field, exact body bytes), and whether the connection survives.
struct Case {
    name: &'static str,
    raw: &'static str,
    status: u16,
    upstream: &'static [(&'static str, &'static str, &'static [u8])],
    keeps_connection: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "CL.TE: Transfer-Encoding wins, Content-Length dropped, connection closed",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX",
        status: 200,
        upstream: &[("POST {P} HTTP/1.1", "transfer-encoding: chunked", b"0\r\n\r\n")],
        keeps_connection: false,
    },
    Case {
        name: "TE.CL: the chunked body is the body, nothing is smuggled",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
        status: 200,
        upstream: &[("POST {P} HTTP/1.1", "transfer-encoding: chunked", b"8\r\nSMUGGLED\r\n0\r\n\r\n")],
        keeps_connection: false,
    },
    Case {
        name: "space before the colon",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "tab as white space is allowed",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\tchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 200,
        upstream: &[("POST {P} HTTP/1.1", "transfer-encoding: chunked", b"3\r\nabc\r\n0\r\n\r\n")],
        keeps_connection: true,
    },
    Case {
        name: "two Transfer-Encoding: chunked fields: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: gzip, chunked: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: identity, chunked: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: chunked, chunked: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: ,chunked: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: ,chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: gzip, chunked with a Content-Length too: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "a chunked body on GET reaches the node",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        status: 200,
        upstream: &[("GET {P} HTTP/1.1", "transfer-encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n")],
        keeps_connection: true,
    },
    Case {
        name: "a chunked body on OPTIONS reaches the node",
        raw: "OPTIONS {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        status: 200,
        upstream: &[("OPTIONS {P} HTTP/1.1", "transfer-encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n")],
        keeps_connection: true,
    },
    Case {
        name: "obs-fold",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "chunked, identity: final coding not chunked: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Transfer-Encoding: gzip alone: 501",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        status: 501,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "duplicate equal Content-Length",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
        status: 200,
        upstream: &[("POST {P} HTTP/1.1", "content-length: 3", b"abc")],
        keeps_connection: true,
    },
    Case {
        name: "two different Content-Lengths",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Content-Length: +3",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\nabc",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Content-Length list",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "Content-Length with leading junk",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nContent-Length: x3\r\n\r\nabc",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "chunk-size overflow",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff1\r\nabc\r\n0\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "bare LF in a chunk line",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "bare LF ending a trailer line",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\nX-U: 2\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "a chunk shorter than its size",
        raw: "POST {P} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab\r\n0\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "bare LF line ends in the head (accepted, as nginx does: RFC 9112 §2.2 MAY)",
        raw: "GET {P} HTTP/1.1\nHost: a\nX-A: 1\n\n",
        status: 200,
        upstream: &[("GET {P} HTTP/1.1", "", b"")],
        keeps_connection: true,
    },
    Case {
        name: "NUL in a header name",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nX-\0A: 1\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "space in a header name",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nX A: 1\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "a method with a byte no token has",
        raw: "G{T {P} HTTP/1.1\r\nHost: a\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "a method with a control byte",
        raw: "GE\x01T {P} HTTP/1.1\r\nHost: a\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "HTTP/0.9 request line",
        raw: "GET {P}\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "request target over max_uri_bytes",
        raw: "GET {P}/LONGURI HTTP/1.1\r\nHost: a\r\n\r\n",
        status: 414,
        upstream: &[],
        keeps_connection: true,
    },
    Case {
        name: "request line longer than the read buffer: 414, not 431",
        raw: "GET {P}/HUGEURI HTTP/1.1\r\nHost: a\r\n\r\n",
        status: 414,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "head over the parser's buffer",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nX-Big: BIGHEADER\r\n\r\n",
        status: 431,
        upstream: &[],
        keeps_connection: false,
    },
    Case {
        name: "two Host fields",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: true,
    },
    Case {
        name: "no Host on HTTP/1.1",
        raw: "GET {P} HTTP/1.1\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: true,
    },
    Case {
        name: "empty Host",
        raw: "GET {P} HTTP/1.1\r\nHost:\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: true,
    },
    Case {
        name: "Host with userinfo",
        raw: "GET {P} HTTP/1.1\r\nHost: evil@a\r\n\r\n",
        status: 400,
        upstream: &[],
        keeps_connection: true,
    },
    Case {
        name: "h2c upgrade goes upstream as a plain request",
        raw: "GET {P} HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        status: 200,
        upstream: &[("GET {P} HTTP/1.1", "", b"")],
        keeps_connection: true,
    },
];

fn expand(s: &str, path: &str) -> String {
    s.replace("{P}", path)
        .replace("/LONGURI", &format!("/{}", "u".repeat(9000)))
        .replace("/HUGEURI", &format!("/{}", "u".repeat(70_000)))
        .replace("BIGHEADER", &"h".repeat(70_000))
}

async fn setup(extra: &str) -> (Fixture, Gateway, Recorder) {
    let up = Recorder::start().await;
    let fx = Fixture::new();
    Nodes::api([Node::new("n1", up.addr)]).write(&fx, "nodes.yaml");
    Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    (fx, gw, up)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_desync_attempts_get_exact_answers() {
    let (_fx, gw, up) = setup("").await;
    let mut failures = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let path = format!("/c{i}");
        let follow = format!("GET {path}/follow HTTP/1.1\r\nHost: a\r\n\r\n");
        // The follow-up rides in the same write: a desync would swallow it
        // into the first body or answer it twice.
        let raw = format!("{}{follow}", expand(case.raw, &path));
        let want = if case.keeps_connection { 2 } else { 1 };
        let conv = converse(gw.addr, raw.as_bytes(), want).await;
        let mut bad = |what: String| failures.push(format!("{}: {what}", case.name));
        match conv.answers.first() {
            Some(a) if a.status == case.status => {}
            other => bad(format!(
                "status {:?}, want {}",
                other.map(|a| a.status),
                case.status
            )),
        }
        if case.keeps_connection {
            let second = conv.answers.get(1);
            let want_body = format!("GET {path}/follow HTTP/1.1");
            if !second.is_some_and(|a| a.status == 200 && a.body == want_body.as_bytes()) {
                bad(format!("follow-up on the same connection got {second:?}"));
            }
        } else if !conv.closed || conv.answers.len() != 1 {
            bad(format!(
                "connection should close after one answer: closed={} answers={}",
                conv.closed,
                conv.answers.len()
            ));
        }
        // A fresh connection is served normally.
        let fresh = format!("GET {path}/fresh HTTP/1.1\r\nHost: a\r\n\r\n");
        let f = converse(gw.addr, fresh.as_bytes(), 1).await;
        let want_body = format!("GET {path}/fresh HTTP/1.1");
        if !f
            .answers
            .first()
            .is_some_and(|a| a.status == 200 && a.body == want_body.as_bytes())
        {
            bad(format!("fresh connection got {:?}", f.answers.first()));
        }
        // Exactly what the case allows reached the upstream.
        let got: Vec<(String, String, Vec<u8>)> = up
            .got(&path)
            .into_iter()
            .filter(|g| !g.line.contains("/follow ") && !g.line.contains("/fresh "))
            .map(|g| (g.line, g.framing, g.body))
            .collect();
        let want: Vec<(String, String, Vec<u8>)> = case
            .upstream
            .iter()
            .map(|(l, f, b)| (expand(l, &path), f.to_string(), b.to_vec()))
            .collect();
        if got != want {
            bad(format!("upstream received {got:?}, want {want:?}"));
        }
        let follows = up.got(&format!("{path}/follow")).len();
        if follows != usize::from(case.keeps_connection) {
            bad(format!(
                "the follow-up reached the upstream {follows} times"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_continue_with_pipelined_bytes_answers_each_request() {
    let (_fx, gw, up) = setup("").await;
    let raw = "POST /e HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\nabcGET /e/p HTTP/1.1\r\nHost: a\r\n\r\n";
    let conv = converse(gw.addr, raw.as_bytes(), 2).await;
    assert_eq!(conv.answers.len(), 2, "{:?}", conv.answers);
    assert_eq!(conv.answers[0].status, 200);
    assert_eq!(conv.answers[0].body, b"POST /e HTTP/1.1");
    assert_eq!(conv.answers[1].body, b"GET /e/p HTTP/1.1");
    let got = up.got("/e");
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].body, b"abc");
    assert_eq!(got[0].framing, "content-length: 3");
    assert!(got[1].body.is_empty());
    // The gateway answered the expectation itself: it is not the node's.
    assert!(
        !got[0].headers.iter().any(|l| l.starts_with("expect:")),
        "{:?}",
        got[0].headers
    );
}

/// Requests with streamed bodies (a chunked body, `Expect`, the next
/// request on such a connection, a refused coding on it) are held to the
/// same rules as the rest: the underscore filter, 501 for a
/// `Transfer-Encoding` but one `chunked`, 400 for a method that is no
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_streamed_bodies_get_the_same_checks() {
    let (_fx, gw, up) = setup("").await;
    let chunked = "POST /h/chunked HTTP/1.1\r\nHost: a\r\nX_Custom: 1\r\nX_Forwarded_For: 6.6.6.6\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    let expect = "POST /h/expect HTTP/1.1\r\nHost: a\r\nX_Custom: 1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\nabc";
    // On the same connection: a plain GET, then a refused coding (one a
    // lenient parser would accept: it ends in `chunked`).
    let next = "GET /h/next HTTP/1.1\r\nHost: a\r\nX_Custom: 1\r\n\r\n";
    let gzip = "POST /h/gzip HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    let conv = converse(
        gw.addr,
        format!("{chunked}{expect}{next}{gzip}").as_bytes(),
        4,
    )
    .await;
    let statuses: Vec<u16> = conv.answers.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [200, 200, 200, 501], "{:?}", conv.answers);
    assert!(conv.closed, "the 501 closes the connection");
    assert_eq!(conv.answers[3].header("connection"), Some("close"));
    for path in ["/h/chunked", "/h/expect", "/h/next"] {
        let got = up.got(path);
        assert_eq!(got.len(), 1, "{path}: {got:?}");
        assert!(
            !got[0].headers.iter().any(|l| l.contains('_')),
            "{path}: {:?}",
            got[0].headers
        );
    }
    assert!(up.got("/h/gzip").is_empty());
    // Two Transfer-Encoding fields, and a method no token spells, on such
    // a connection.
    for (second, status) in [
        ("POST /h/two HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        ("G{T /h/method HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        ("GET /h/empty-host HTTP/1.1\r\nHost:\r\n\r\n", 400),
    ] {
        let conv = converse(gw.addr, format!("{chunked}{second}").as_bytes(), 2).await;
        let statuses: Vec<u16> = conv.answers.iter().map(|a| a.status).collect();
        assert_eq!(statuses, [200, status], "{second:?}: {:?}", conv.answers);
    }
    assert!(up.got("/h/two").is_empty() && up.got("/h/method").is_empty());
    assert!(up.got("/h/empty-host").is_empty());
}

/// `Connection` may name fields as hop-by-hop, but never the host the
/// request was routed on, the lane tag or the fields the gateway sets:
/// the node sees the client's Host, not its own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_tokens_never_remove_host_tag_or_forwarding_fields() {
    let (_fx, gw, up) = setup("").await;
    let raw = "GET /ct HTTP/1.1\r\nHost: a\r\nConnection: host, X-Gray-Tag, x-forwarded-for, x-forwarded-host, x-graygate-generation, x-other\r\nX-Other: 1\r\nX-Kept: 2\r\n\r\n";
    // Also on hyper's path (after a chunked request).
    let chunked = "POST /ct/c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    let hyper_raw = raw.replace("/ct ", "/ct/h ");
    for (bytes, path, want) in [
        (raw.to_string(), "/ct", 1),
        (format!("{chunked}{hyper_raw}"), "/ct/h", 2),
    ] {
        let conv = converse(gw.addr, bytes.as_bytes(), want).await;
        assert!(
            conv.answers.iter().all(|a| a.status == 200),
            "{:?}",
            conv.answers
        );
        let got = up.got(path);
        let h = &got.last().unwrap().headers;
        for line in [
            "host: a",
            "x-gray-tag: formal",
            "x-forwarded-for: 127.0.0.1",
            "x-forwarded-host: a",
            "x-kept: 2",
        ] {
            assert!(h.iter().any(|l| l == line), "{path}: {line} missing: {h:?}");
        }
        assert!(
            h.iter().any(|l| l.starts_with("x-graygate-generation:")),
            "{h:?}"
        );
        assert!(
            !h.iter()
                .any(|l| l.starts_with("x-other") || l.starts_with("connection")),
            "{path}: {h:?}"
        );
    }
}

/// From an untrusted peer no forwarding field of the client's reaches a
/// node (`X-Real-IP`, `Forwarded`, `X-Forwarded-Port`, `-Prefix`, any
/// other `X-Forwarded-*`), only the gateway's own; a trusted proxy's are
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_fields_pass_only_from_trusted_proxies() {
    let spoofed = [
        "x-real-ip: 6.6.6.6",
        "forwarded: for=6.6.6.6",
        "x-forwarded-port: 6666",
        "x-forwarded-prefix: /evil",
        "x-forwarded-ssl: on",
        "x-forwarded-proto: https",
        "x-forwarded-host: evil",
    ];
    let fields: String = spoofed.iter().map(|l| format!("{l}\r\n")).collect();
    for (extra, trusted) in [("", false), ("trusted_proxies: [127.0.0.1/32]\n", true)] {
        let (_fx, gw, up) = setup(extra).await;
        let raw = format!("GET /fw HTTP/1.1\r\nHost: a\r\n{fields}\r\n");
        let conv = converse(gw.addr, raw.as_bytes(), 1).await;
        assert_eq!(conv.answers[0].status, 200);
        let h = &up.got("/fw")[0].headers;
        for line in spoofed {
            assert_eq!(
                h.iter().any(|l| l == line),
                trusted,
                "{line} (trusted peer: {trusted}): {h:?}"
            );
        }
        if !trusted {
            assert!(h.iter().any(|l| l == "x-forwarded-proto: http"), "{h:?}");
            assert!(h.iter().any(|l| l == "x-forwarded-host: a"), "{h:?}");
        }
    }
}

/// The underscore filter on the requests hyper parses from the start:
/// HTTP/1.1 over TLS and HTTP/2 (curl as the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscore_filter_holds_over_tls_and_http2() {
    use crate::harness::tls::*;
    let up = Recorder::start().await;
    let fx = Fixture::new();
    write_cert(&fx.path("certs"), "site", "localhost");
    Nodes::api([Node::new("n1", up.addr)]).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .listeners(&[Listener::tls().cert("certs/site.crt", "certs/site.key")])
        .start(&fx, "gg.yaml");
    let tls = listeners(&gw)[0];
    for (flag, path, version) in [("--http1.1", "/tls/h1", "1.1"), ("--http2", "/tls/h2", "2")] {
        let url = format!("https://localhost:{}{path}", tls.port());
        let out = tokio::task::spawn_blocking(move || {
            curl(
                &[
                    flag,
                    "-H",
                    "X_Custom: 1",
                    "-H",
                    "X_Gray_Tag: gray",
                    "-H",
                    "X-Fine: 1",
                ],
                &url,
            )
        })
        .await
        .unwrap();
        assert!(
            out.ok && out.version == version,
            "{flag}: {:?} {}",
            out.body,
            out.version
        );
        let got = up.got(path);
        assert_eq!(got.len(), 1, "{path}");
        let h = &got[0].headers;
        assert!(!h.iter().any(|l| l.contains('_')), "{path}: {h:?}");
        assert!(h.iter().any(|l| l == "x-fine: 1"), "{path}: {h:?}");
        assert!(h.iter().any(|l| l == "x-gray-tag: formal"), "{path}: {h:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_forwarding_fields_with_underscores_never_reach_a_node() {
    for (extra, allowed) in [
        ("", false),
        ("client: { underscores_in_headers: true }\n", true),
    ] {
        let (_fx, gw, up) = setup(extra).await;
        let raw = "GET /u HTTP/1.1\r\nHost: a\r\nX_Gray_Tag: gray\r\nX_Forwarded_For: 6.6.6.6\r\nX_Real_IP: 6.6.6.6\r\nForwarded_: x\r\nX_Custom: kept-if-allowed\r\n\r\n";
        let conv = converse(gw.addr, raw.as_bytes(), 1).await;
        assert_eq!(conv.answers[0].status, 200);
        let got = up.got("/u");
        assert_eq!(got.len(), 1);
        let h = &got[0].headers;
        assert!(
            !h.iter()
                .any(|l| l.contains("6.6.6.6") || l.starts_with("x_gray_tag")),
            "{h:?}"
        );
        assert!(h.iter().any(|l| l == "x-gray-tag: formal"), "{h:?}");
        assert_eq!(
            h.iter().any(|l| l.starts_with("x_custom")),
            allowed,
            "other underscored names pass only when allowed: {h:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_authority_is_the_host_for_routing_and_upstream() {
    let up = Recorder::start().await;
    let other = Recorder::start().await;
    let fx = Fixture::new();
    Nodes::new()
        .service(Service::new("real").node(Node::at(up.addr)))
        .service(Service::new("fake").node(Node::at(other.addr)))
        .write(&fx, "nodes.yaml");
    Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/", "real").host("real.example"),
            Route::service("/", "fake").host("fake"),
        ])
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    let raw = "GET http://real.example/abs HTTP/1.1\r\nHost: fake\r\n\r\n";
    let conv = converse(gw.addr, raw.as_bytes(), 1).await;
    assert_eq!(conv.answers[0].status, 200);
    let got = up.got("/abs");
    assert_eq!(got.len(), 1, "routed by the target's authority");
    assert!(
        got[0].headers.iter().any(|l| l == "host: real.example"),
        "{:?}",
        got[0].headers
    );
    assert!(other.got("/abs").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_are_allowed_per_route() {
    let up = Recorder::start().await;
    let fx = Fixture::new();
    Nodes::api([Node::at(up.addr)]).write(&fx, "nodes.yaml");
    Config::new().node_files(&["nodes.yaml"]).raw("routes:\n  - { prefix: /, service: api }\n  - { prefix: /custom/, service: api, upgrades: [websocket, my-proto] }\n").write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    // Not allowed on `/`: forwarded as a plain request, tokens removed.
    let raw = "GET /plain HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: my-proto\r\n\r\n";
    let conv = converse(gw.addr, raw.as_bytes(), 1).await;
    assert_eq!(conv.answers[0].status, 200);
    let h = &up.got("/plain")[0].headers;
    assert!(
        !h.iter()
            .any(|l| l.starts_with("upgrade") || l.starts_with("connection")),
        "{h:?}"
    );
    // Allowed on `/custom/`: the upgrade is asked of the node.
    let raw =
        "GET /custom/x HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: my-proto\r\n\r\n";
    let conv = converse(gw.addr, raw.as_bytes(), 1).await;
    assert_eq!(conv.answers[0].status, 200);
    let h = &up.got("/custom/x")[0].headers;
    assert!(h.iter().any(|l| l == "upgrade: my-proto"), "{h:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_upstream_framing_is_a_502_and_the_connection_is_not_reused() {
    let (_fx, gw, up) = setup("").await;
    let client = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n");
    // A healthy exchange first: its connection is pooled and reused.
    converse(gw.addr, client("/up/warm").as_bytes(), 1).await;
    converse(gw.addr, client("/up/warm").as_bytes(), 1).await;
    let warm = up.got("/up/warm");
    assert_eq!(warm[0].conn, warm[1].conn, "a clean connection is reused");
    for path in [
        "/up/two-lengths",
        "/up/broken-chunk",
        "/up/gzip-only",
        "/up/bare-lf-chunk",
    ] {
        let conv = converse(gw.addr, client(path).as_bytes(), 1).await;
        assert_eq!(conv.answers[0].status, 502, "{path}: {:?}", conv.answers[0]);
        let broken = up.got(path)[0].conn;
        // The next request needs a new upstream connection.
        let next = format!("{path}/next");
        let conv = converse(gw.addr, client(&next).as_bytes(), 1).await;
        assert_eq!(conv.answers[0].status, 200);
        assert_ne!(
            up.got(&next)[0].conn,
            broken,
            "{path}: the connection was reused"
        );
    }
    // Transfer-Encoding and Content-Length from a node: the body is the
    // chunked one, passed on without the received length; no reuse.
    let conv = converse(gw.addr, client("/up/te-and-cl").as_bytes(), 1).await;
    let a = &conv.answers[0];
    assert_eq!(a.status, 200);
    assert_eq!(a.body, b"hello world");
    assert_ne!(a.header("content-length"), Some("5"), "{:?}", a.headers);
    let conv = converse(gw.addr, client("/up/after-te").as_bytes(), 1).await;
    assert_eq!(conv.answers[0].status, 200);
    let after = up.got("/up/after-te");
    assert_ne!(
        after[0].conn,
        up.got("/up/te-and-cl")[0].conn,
        "the TE+CL connection was reused"
    );
}

/// Issue 50: a node's chunked answer whose trailer line ends in a bare LF
/// (`0\r\nX-T: a\n\r\n`), followed on its connection by what a lenient
/// parser would take for the next answer. On every HTTP/1.1 engine that
/// reads a node's answer — a body in hand (a GET) and a streamed one (a
/// chunked request body), both on the one engine now — nothing of it is
/// smuggled: the connection is never reused and the next request gets its
/// own answer. The engine checks the body that came with the head before
/// the head goes out: a 502 on both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_lf_ending_a_nodes_trailer_line_smuggles_nothing_on_any_path() {
    let (_fx, gw, up) = setup("").await;
    // (engine, the status its client gets, the request for a path)
    type Path = (&'static str, u16, fn(&str) -> String);
    let paths: [Path; 2] = [
        ("inline", 502, |p| {
            format!("GET {p} HTTP/1.1\r\nHost: a\r\n\r\n")
        }),
        ("streamed", 502, |p| {
            format!("POST {p} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        }),
    ];
    for (engine, status, request) in paths {
        let path = format!("/up/{engine}/bare-lf-trailer");
        let conv = converse(gw.addr, request(&path).as_bytes(), 1).await;
        let a = &conv.answers[0];
        assert_eq!(a.status, status, "{engine}: {a:?}");
        assert_ne!(a.body, b"smuggled", "{engine}: {a:?}");
        let broken = up.got(&path)[0].conn;
        for i in 0..3 {
            let next = format!("/up/{engine}/after{i}");
            let conv = converse(gw.addr, request(&next).as_bytes(), 1).await;
            let a = &conv.answers[0];
            assert_eq!(a.status, 200, "{engine}: {a:?}");
            assert!(
                a.body.ends_with(format!("{next} HTTP/1.1").as_bytes()),
                "{engine}: not the node's answer to {next}: {a:?}"
            );
            assert_ne!(
                up.got(&next)[0].conn,
                broken,
                "{engine}: the connection was reused"
            );
        }
    }
}

/// A chunked body on HEAD (and GET) reaches a real node whole (hyper's
/// client would send those methods bodiless): the node reads `hello`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bodies_on_head_and_get_reach_the_node() {
    let fx = Fixture::new();
    let node = Backend::full("n1", "formal").await;
    fx.api_nodes(&[&node]);
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    for method in ["HEAD", "GET"] {
        let raw = format!(
            "{method} /b HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        );
        let mut s = connect_with(gw.addr, raw.as_bytes()).await;
        // The head is enough (a HEAD answer has a length but no body).
        let mut buf = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while find(&buf, b"\r\n\r\n").is_none() {
            let mut chunk = [0u8; 4096];
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                other => panic!("{method}: no answer: {other:?}"),
            }
        }
        let head = String::from_utf8_lossy(&buf);
        assert!(head.starts_with("HTTP/1.1 200"), "{method}: {head}");
        let seen = node.last();
        assert_eq!(seen.method, method);
        assert_eq!(&seen.body[..], b"hello", "{method}: the body was dropped");
    }
}

/// A chunked body without its framing (sizes, extensions, trailers).
fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut p = 0;
    while let Some(l) = find(&body[p..], b"\r\n") {
        let line = String::from_utf8_lossy(&body[p..p + l]);
        let Ok(size) = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
        else {
            break;
        };
        if size == 0 || body.len() < p + l + 2 + size {
            break;
        }
        out.extend_from_slice(&body[p + l + 2..p + l + 2 + size]);
        p += l + 2 + size + 2;
    }
    out
}

/// What one front end made of a raw request and its pipelined follow-up:
/// whether the first answer was a success, what the node received for
/// it (request line with the case's path cut, body without its framing),
/// and whether the follow-up reached the node.
#[derive(Debug, PartialEq)]
struct Outcome {
    accepted: bool,
    node_got: Vec<(String, Vec<u8>)>,
    follow_reached: bool,
}

async fn outcome(front: SocketAddr, up: &Recorder, raw: &str, path: &str) -> Outcome {
    let follow = format!("GET {path}/follow HTTP/1.1\r\nHost: a\r\n\r\n");
    let conv = converse(
        front,
        format!("{}{follow}", expand(raw, path)).as_bytes(),
        2,
    )
    .await;
    let accepted = conv
        .answers
        .first()
        .is_some_and(|a| (200..300).contains(&a.status));
    // (What reaches the node is settled once the front end answered.)
    let node_got = up
        .got(path)
        .into_iter()
        .filter(|g| !g.line.contains("/follow "))
        .map(|g| {
            let body = if g.framing.starts_with("transfer-encoding") {
                dechunk(&g.body)
            } else {
                g.body
            };
            (g.line.replacen(path, "{P}", 1), body)
        })
        .collect();
    let follow_reached = !up.got(&format!("{path}/follow")).is_empty();
    Outcome {
        accepted,
        node_got,
        follow_reached,
    }
}

/// Where graygate answers a raw request otherwise than nginx in front of
/// the same node, on purpose, and why. Every other case must agree.
const NGINX_DIFFERS: &[(&str, &str)] = &[
    (
        "CL.TE: Transfer-Encoding wins, Content-Length dropped, connection closed",
        "RFC 9112 §6.3: Transfer-Encoding wins and the connection closes after; nginx refuses both fields (400). Neither lets the follow-up through",
    ),
    (
        "TE.CL: the chunked body is the body, nothing is smuggled",
        "as CL.TE",
    ),
    (
        "tab as white space is allowed",
        "RFC 9110 §5.6.3: white space around a field value is spaces and tabs; nginx takes `\tchunked` for an unknown coding",
    ),
    (
        "duplicate equal Content-Length",
        "RFC 9112 §6.3 allows one value repeated; nginx refuses any duplicate",
    ),
    (
        "bare LF in a chunk line",
        "RFC 9112 §7.1: chunk lines end in CRLF; nginx takes a bare LF",
    ),
    ("bare LF ending a trailer line", "as the chunk line"),
    (
        "HTTP/0.9 request line",
        "graygate refuses HTTP/0.9 (400); nginx serves it, an answer without a status line",
    ),
    (
        "request target over max_uri_bytes",
        "a refusal of a request read whole keeps the connection (its follow-up is served, as the exact-answers test says); nginx closes",
    ),
    ("two Host fields", "as max_uri_bytes: refused, connection kept"),
    ("no Host on HTTP/1.1", "as max_uri_bytes: refused, connection kept"),
    ("empty Host", "as max_uri_bytes: refused, connection kept"),
    (
        "Host with userinfo",
        "RFC 9110 §4.2.4: userinfo is not part of a Host; nginx passes it on",
    ),
];

/// Issue 50's differential check: every raw request of [`CASES`], with a
/// follow-up pipelined in the same write, sent to graygate and to nginx
/// (`proxy_pass`, HTTP/1.1 upstream) in front of the same recording node.
/// Each front end's outcome — success or refusal, what the node received
/// (request line and body bytes, whatever the framing), whether the
/// follow-up reached the node — must be the same, except where
/// [`NGINX_DIFFERS`] says why not (and those must still differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_requests_get_the_outcomes_nginx_gives() {
    let (fx, gw, up) = setup("").await;
    let dir = fx.path("nginx");
    std::fs::create_dir_all(&dir).unwrap();
    let http = format!(
        "    server {{\n        listen 127.0.0.1:{{port}};\n        location / {{\n            proxy_pass http://{};\n            proxy_http_version 1.1;\n            proxy_set_header Connection \"\";\n        }}\n    }}\n",
        up.addr
    );
    let nginx = crate::harness::nginx::Nginx::start(&dir, "", &http);
    let mut report = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let ours = outcome(gw.addr, &up, case.raw, &format!("/g{i}")).await;
        let theirs = outcome(nginx.addr(), &up, case.raw, &format!("/n{i}")).await;
        let listed = NGINX_DIFFERS.iter().any(|(name, _)| *name == case.name);
        match (ours == theirs, listed) {
            (true, false) | (false, true) => {}
            (false, false) => report.push(format!(
                "{}: graygate {ours:?}, nginx {theirs:?}",
                case.name
            )),
            (true, true) => report.push(format!(
                "{}: listed as differing from nginx but agrees: {ours:?}",
                case.name
            )),
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}
