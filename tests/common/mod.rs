//! Shared test harness: real hyper backends on loopback, the real graygate
//! binary on an ephemeral port, a real HTTP/1.1 client that can bind to any
//! 127.0.0.0/8 source address, and bounded polling.
#![allow(dead_code)]

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket};

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// What a backend saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }
}

/// How a backend answers.
#[derive(Clone)]
pub enum Mode {
    /// JSON `{node, lane, tag}`.
    Json,
    /// Accepts the request and never answers.
    Hang,
    /// JSON, then closes the connection (`Connection: close`).
    JsonClose,
    /// Streams the request body back.
    Echo,
    /// Sends "first;" at once, then "rest" when the notify fires.
    Gated(Arc<tokio::sync::Notify>),
}

/// A real HTTP backend on 127.0.0.1.
pub struct Backend {
    pub addr: SocketAddr,
    pub name: String,
    pub lane: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub connections: Arc<AtomicUsize>,
    /// Connections that have ended.
    pub closed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Backend {
    pub async fn start(name: &str, lane: &str) -> Backend {
        Backend::start_mode(name, lane, Mode::Json).await
    }

    pub async fn start_mode(name: &str, lane: &str, mode: Mode) -> Backend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (n, l, s, c, cl) = (
            name.to_string(),
            lane.to_string(),
            seen.clone(),
            connections.clone(),
            closed.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                c.fetch_add(1, Ordering::SeqCst);
                let (n, l, s, mode) = (n.clone(), l.clone(), s.clone(), mode.clone());
                let cl = cl.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (n, l, s, mode) = (n.clone(), l.clone(), s.clone(), mode.clone());
                        async move { Ok::<_, Infallible>(answer(&n, &l, &s, mode, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .with_upgrades()
                        .await;
                    cl.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Backend {
            addr,
            name: name.to_string(),
            lane: lane.to_string(),
            seen,
            connections,
            closed,
            task,
        }
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub fn tags(&self) -> Vec<Option<String>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.header("x-gray-tag"))
            .collect()
    }

    pub fn last(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("backend saw a request")
    }

    /// A node-file entry for this backend.
    pub fn node_yaml(&self) -> String {
        format!(
            "      - {{ name: {}, addr: \"{}\", lane: {} }}\n",
            self.name, self.addr, self.lane
        )
    }
}

async fn answer(
    name: &str,
    lane: &str,
    seen: &Mutex<Vec<Seen>>,
    mode: Mode,
    req: Request<Incoming>,
) -> Response<BoxBody> {
    seen.lock().unwrap().push(Seen {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        query: req.uri().query().map(str::to_string),
        headers: req.headers().clone(),
    });
    match mode {
        Mode::Json => {
            let tag = req
                .headers()
                .get("x-gray-tag")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            let body = serde_json::json!({"node": name, "lane": lane, "tag": tag});
            Response::new(full(body.to_string()))
        }
        Mode::Hang => std::future::pending().await,
        Mode::JsonClose => {
            let mut r = Response::new(full(format!("{{\"node\":\"{name}\",\"lane\":\"{lane}\"}}")));
            r.headers_mut()
                .insert("connection", http::HeaderValue::from_static("close"));
            r
        }
        Mode::Echo => Response::new(req.into_body().boxed()),
        Mode::Gated(gate) => {
            let (mut tx, body) = http_body_util::channel::Channel::<Bytes, hyper::Error>::new(4);
            tokio::spawn(async move {
                let _ = tx.send_data(Bytes::from_static(b"first;")).await;
                gate.notified().await;
                let _ = tx.send_data(Bytes::from_static(b"rest")).await;
            });
            Response::new(body.boxed())
        }
    }
}

pub fn full(s: impl Into<Bytes>) -> BoxBody {
    Full::new(s.into()).map_err(|never| match never {}).boxed()
}

/// A port on 127.0.0.1 with nothing listening: a socket stays bound to it
/// (never listening) for the life of the test process, so connects are
/// refused and no other test or process can take the port meanwhile.
pub fn closed_port() -> SocketAddr {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    std::mem::forget(s);
    addr
}

/// A temporary directory holding a gateway's files.
pub struct Fixture {
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub fn new() -> Fixture {
        Fixture {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Writes a file in place (truncate + write).
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.path(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Writes a file the way editors save: a temp file renamed over it.
    pub fn write_rename(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.path(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let tmp = p.with_extension("swp-tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        p
    }
}

/// A running graygate process.
pub struct Gateway {
    child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    logs: Arc<Mutex<String>>,
    /// Everything the process wrote to stdout, and whether stdout has
    /// reached its end (the process exited).
    stdout: Arc<Mutex<(String, bool)>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn addr_in(line: &str) -> Option<SocketAddr> {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix("addr="))
        .and_then(|a| a.parse().ok())
}

impl Gateway {
    /// Starts `graygate --config <config>` and waits until it listens.
    pub fn start(config: &Path) -> Gateway {
        Gateway::start_env(config, &[])
    }

    /// Like [`Gateway::start`], with extra environment variables.
    pub fn start_env(config: &Path, env: &[(&str, &str)]) -> Gateway {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_graygate"));
        // The suite's own environment never configures the gateway.
        cmd.env_remove("GRAYGATE_ADMIN_TOKEN")
            .envs(env.iter().copied());
        Gateway::start_cmd(cmd, config, &[])
    }

    /// Starts `cmd --config <config> <args…>` (any graygate binary, e.g. a
    /// copy or an unpacked package's) and waits until it listens.
    pub fn start_cmd(mut cmd: Command, config: &Path, args: &[&str]) -> Gateway {
        let mut child = cmd
            .arg("--config")
            .arg(config)
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn graygate");
        let stdout = Arc::new(Mutex::new((String::new(), false)));
        let out = child.stdout.take().unwrap();
        let o = stdout.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let mut g = o.lock().unwrap();
                g.0.push_str(&line);
                g.0.push('\n');
            }
            o.lock().unwrap().1 = true;
        });
        let logs = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let l = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut g = l.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            {
                let text = logs.lock().unwrap().clone();
                let addr = text
                    .lines()
                    .find(|l| l.contains("graygate listening"))
                    .and_then(addr_in);
                if let Some(addr) = addr {
                    let admin = text
                        .lines()
                        .find(|l| l.contains("admin listening"))
                        .and_then(addr_in);
                    let wants_admin = std::fs::read_to_string(config)
                        .map(|c| c.contains("admin_listen"))
                        .unwrap_or(false);
                    if admin.is_some() || !wants_admin {
                        return Gateway {
                            child,
                            addr,
                            admin,
                            logs,
                            stdout,
                        };
                    }
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("graygate exited with {status}:\n{}", logs.lock().unwrap());
            }
            assert!(
                Instant::now() < deadline,
                "graygate did not start:\n{}",
                logs.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    /// Waits (up to 10 s) until a log line satisfies `pred`: lines reach
    /// [`Gateway::logs`] through a pipe and a reader thread, after the
    /// response that caused them may already be in hand.
    pub async fn wait_log_line(&self, what: &str, pred: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.logs().lines().any(&pred) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no log line {what} in:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (up to 10 s) until the log contains `needle`.
    pub async fn wait_log(&self, needle: &str) {
        self.wait_log_line(needle, |l| l.contains(needle)).await;
    }

    /// What the process has written to stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().0.clone()
    }

    /// Stops the process with SIGTERM and returns all it wrote to stdout.
    pub async fn stop_and_read_stdout(&mut self) -> String {
        self.signal("TERM");
        let status = self.wait_exit(Duration::from_secs(20)).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "graygate did not exit cleanly: {status:?}\n{}",
            self.logs()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.stdout.lock().unwrap().1 {
            assert!(Instant::now() < deadline, "stdout never reached its end");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.stdout()
    }

    /// Sends a signal with the system `kill` command.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    pub async fn status(&self) -> serde_json::Value {
        let admin = self.admin.expect("admin listener configured");
        Req::get("/status").send(admin).await.json()
    }

    pub async fn get(&self, path: &str) -> Resp {
        Req::get(path).send(self.addr).await
    }
}

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

/// Polls `check` until it returns true, failing after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A main config with the common parts filled in.
pub fn main_config(extra: &str) -> String {
    format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nreload_debounce_ms: 50\n{extra}")
}

impl Gateway {
    /// Waits (bounded by `limit`) for the process to exit on its own.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A node answering the text `<name>` with `status`; every `fail_every`-th answer is a 503.
pub struct PlainNode {
    pub addr: SocketAddr,
    pub count: Arc<std::sync::atomic::AtomicU64>,
}

pub async fn plain_node(
    name: &'static str,
    fail_every: u64,
    status: http::StatusCode,
) -> PlainNode {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: Request<Incoming>| {
                    let n = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    async move {
                        let mut r = Response::new(Full::new(Bytes::from(name)));
                        if fail_every > 0 && n.is_multiple_of(fail_every) {
                            *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                        } else {
                            *r.status_mut() = status;
                        }
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    PlainNode { addr, count }
}

/// Sends requests from many users (header `X-User`) until stopped.
pub fn user_traffic(
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
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

/// A file of `n` bytes that shows where each byte came from.
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| b"0123456789abcdefghijklmnopqrstuvwxyz"[(i + i / 997) % 36])
        .collect()
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

/// User + system CPU seconds of process `pid` so far (`/proc/PID/stat`).
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime are fields 14 and 15 (1-based) = 11, 12 after the name.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // In clock ticks of USER_HZ, 100 per second in Linux's /proc ABI.
    ticks / 100.0
}
