//! The suite's HTTP clients: one request on a fresh HTTP/1.1 connection
//! (optionally from any 127.0.0.0/8 source address), a request that may
//! fail, raw-socket helpers, and request loops.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::eventually;

/// A response, fully read.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.text()))
    }

    /// `node` of a demo/test backend's JSON answer.
    pub fn node(&self) -> String {
        self.json()["node"].as_str().unwrap_or_default().to_string()
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }
}

/// A request to send with a fresh connection.
#[derive(Clone)]
pub struct Req {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    pub bind: Option<IpAddr>,
}

impl Req {
    pub fn get(path: &str) -> Req {
        Req {
            method: "GET".into(),
            path: path.into(),
            headers: Vec::new(),
            body: Bytes::new(),
            bind: None,
        }
    }

    pub fn method(mut self, m: &str) -> Req {
        self.method = m.into();
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Req {
        self.headers.push((k.into(), v.into()));
        self
    }

    pub fn body(mut self, b: impl Into<Bytes>) -> Req {
        self.body = b.into();
        self
    }

    /// Binds the client socket to this source address (e.g. 127.0.9.5).
    #[allow(clippy::wrong_self_convention)] // reads as "request from IP"
    pub fn from_ip(mut self, ip: &str) -> Req {
        self.bind = Some(ip.parse().unwrap());
        self
    }

    fn build(&self, addr: SocketAddr) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(self.method.as_str())
            .uri(self.path.as_str());
        if !self
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("host"))
        {
            b = b.header("host", addr.to_string());
        }
        for (k, v) in &self.headers {
            b = b.header(k.as_str(), v.as_str());
        }
        b.body(Full::new(self.body.clone())).unwrap()
    }

    /// Opens a connection (bound as asked) and returns the response head
    /// with its body still streaming.
    pub async fn send_streaming(&self, addr: SocketAddr) -> Response<Incoming> {
        let sock = TcpSocket::new_v4().unwrap();
        if let Some(ip) = self.bind {
            sock.bind(SocketAddr::new(ip, 0)).unwrap();
        }
        let stream = sock.connect(addr).await.expect("connect to gateway");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        sender
            .send_request(self.build(addr))
            .await
            .expect("response")
    }

    /// Like [`Req::send_streaming`], the failure returned instead of a
    /// panic (for a request the gateway is expected to cut).
    pub async fn send_streaming_result(
        &self,
        addr: SocketAddr,
    ) -> Result<Response<Incoming>, hyper::Error> {
        let stream = TcpSocket::new_v4()
            .unwrap()
            .connect(addr)
            .await
            .expect("connect to gateway");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(self.build(addr)).await
    }

    pub async fn send(&self, addr: SocketAddr) -> Resp {
        let resp = tokio::time::timeout(Duration::from_secs(30), async {
            let resp = self.send_streaming(addr).await;
            let (head, body) = resp.into_parts();
            let body = body.collect().await.expect("body").to_bytes();
            Resp {
                status: head.status.as_u16(),
                headers: head.headers,
                body,
            }
        })
        .await;
        resp.expect("request finished within 30 s")
    }
}

/// Sends requests from many users (header `X-User`) until stopped.
pub fn user_traffic(addr: SocketAddr, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut sent = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let user = format!("u{}", sent % 997);
            let _ = Req::get("/api/x").header("X-User", &user).send(addr).await;
            sent += 1;
        }
        sent
    })
}

/// Reads one `Content-Length` response off `s` (after `buf`'s leftovers);
/// returns (head, body) and keeps what follows in `buf`.
pub async fn read_one(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> (String, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a content-length");
            while buf.len() < end + 4 + len {
                let mut chunk = vec![0u8; 64 * 1024];
                let n = s.read(&mut chunk).await.unwrap();
                assert!(n > 0, "connection closed inside a body");
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[end + 4..end + 4 + len].to_vec();
            buf.drain(..end + 4 + len);
            return (head, body);
        }
        let mut chunk = vec![0u8; 64 * 1024];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before a head");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// One request that may fail: Err on any transport error.
pub async fn try_get(
    addr: SocketAddr,
    path: &str,
    header: Option<(&str, &str)>,
) -> Result<Resp, String> {
    let work = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut b = http::Request::builder().uri(path).header("host", "t");
        if let Some((k, v)) = header {
            b = b.header(k, v);
        }
        let resp = sender
            .send_request(b.body(Full::new(Bytes::new())).unwrap())
            .await
            .map_err(|e| e.to_string())?;
        let (head, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Resp {
            status: head.status.as_u16(),
            headers: head.headers,
            body,
        })
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| "timeout".to_string())?
}

/// Requests in a loop against `addrs` until stopped: (ok, errors, last error).
pub struct Load {
    pub stop: Arc<AtomicBool>,
    pub ok: Arc<AtomicUsize>,
    pub errors: Arc<Mutex<Vec<String>>>,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(addrs: &[SocketAddr]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let tasks = addrs
            .iter()
            .map(|&a| {
                let (stop, ok, errors) = (stop.clone(), ok.clone(), errors.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match try_get(a, "/api/x", None).await {
                            Ok(r) if r.status == 200 => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(r) => errors.lock().unwrap().push(format!(
                                "{a}: {} {}",
                                r.status,
                                r.text()
                            )),
                            Err(e) => errors.lock().unwrap().push(format!("{a}: {e}")),
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            errors,
            tasks,
        }
    }

    pub async fn wait_ok(&self, n: usize) {
        let start = self.ok.load(Ordering::Relaxed);
        eventually("load requests", Duration::from_secs(20), || async {
            self.ok.load(Ordering::Relaxed) >= start + n
        })
        .await;
    }

    /// Stops the loop and fails on any error; returns the successes.
    pub async fn stop_clean(self) -> usize {
        let (ok, errors) = self.stop().await;
        assert!(
            errors.is_empty(),
            "{} errors (of {ok}): {:?}",
            errors.len(),
            &errors[..errors.len().min(5)]
        );
        ok
    }

    pub async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        let errors = self.errors.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), errors)
    }
}

/// A new connection with `bytes` written on it.
pub async fn connect_with(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

/// Writes `bytes` on a new connection and reads until the peer closes.
pub async fn exchange_raw(addr: SocketAddr, bytes: &[u8]) -> String {
    read_to_close(&mut connect_with(addr, bytes).await).await
}

/// Reads until the peer closes the connection (bounded: 20 s).
pub async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await;
    assert!(r.is_ok(), "the peer did not close the connection");
    String::from_utf8_lossy(&out).into_owned()
}

/// One real HTTP/1.1 keep-alive client connection (hyper's) and the task
/// driving it, for tests that reuse a connection across gateway events.
pub struct KeepAlive {
    pub tx: hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>,
    pub conn: tokio::task::JoinHandle<hyper::Result<()>>,
}

impl KeepAlive {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        KeepAlive {
            tx,
            conn: tokio::spawn(conn),
        }
    }

    /// GETs `path` (Host `gg`) and reads the whole answer; returns its head.
    pub async fn get(&mut self, path: &str) -> http::response::Parts {
        let req = Request::get(path)
            .header("host", "gg")
            .body(http_body_util::Empty::new())
            .unwrap();
        let r = self
            .tx
            .send_request(req)
            .await
            .expect("answered, not reset");
        let (head, body) = r.into_parts();
        body.collect().await.unwrap();
        head
    }

    /// While the gateway drains: `path` on this (idle) connection is
    /// answered 200 with `Connection: close`, and then the gateway closes
    /// the connection.
    pub async fn answered_with_close_then_closed(mut self, path: &str) {
        self.tx
            .ready()
            .await
            .expect("the idle connection is still open during the drain");
        let head = self.get(path).await;
        assert_eq!(head.status, 200);
        assert_eq!(
            head.headers.get("connection").map(|v| v.as_bytes()),
            Some(&b"close"[..])
        );
        tokio::time::timeout(Duration::from_secs(10), self.conn)
            .await
            .expect("the gateway closed the connection after that answer")
            .unwrap()
            .unwrap();
    }
}
