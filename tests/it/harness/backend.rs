//! The one test backend: a real hyper HTTP/1.1 server on 127.0.0.1 that
//! records what it saw (requests, health probes, connections) and answers
//! as its [`Mode`] says; mode, status, health status and delay can be
//! switched while it runs. And [`raw_node`]: a node that writes exact bytes
//! (a response it breaks off, stalls, or a large one).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// A body of one piece.
pub fn full(s: impl Into<Bytes>) -> BoxBody {
    Full::new(s.into()).map_err(|never| match never {}).boxed()
}

/// What a backend saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    /// The lane tag (`X-Gray-Tag`) the gateway sent.
    pub tag: Option<String>,
    /// The request body, in the modes that read it ([`Mode::Full`],
    /// [`Mode::Drop`], [`Mode::HoldDrop`]); empty otherwise.
    pub body: Bytes,
    /// When the request arrived.
    pub at: Instant,
    /// The connection it came on, by order of acceptance (0: the first).
    pub conn: usize,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }
}

/// One health probe (a request on `/health…`) as a backend received it.
#[derive(Debug, Clone)]
pub struct Probe {
    pub path: String,
    pub tag: Option<String>,
    pub user_agent: Option<String>,
}

/// How a backend answers (requests on `/health…` are health probes in
/// every mode: answered `health` with the health status).
#[derive(Clone)]
pub enum Mode {
    /// JSON `{node, lane, tag}` with the status; the body is left unread
    /// and the request recorded as it arrives.
    Json,
    /// Reads the body, records the request, then JSON
    /// `{node, lane, tag, gen, body}` with the status.
    Full,
    /// The text `<name>` with the status; every `fail_every`-th answer is
    /// a 503 ([`Backend::set_fail_every`]).
    Text,
    /// Accepts the request and never answers.
    Hang,
    /// Reads the request (and its body), then closes the connection
    /// unanswered.
    Drop,
    /// Like [`Mode::Drop`], but holds each request until the notify lets
    /// it go (`notify_one`: one request a call, kept if none waits yet):
    /// a node that fails in the middle of a request, when the test says.
    HoldDrop(Arc<tokio::sync::Notify>),
    /// JSON, then closes the connection (`Connection: close`).
    JsonClose,
    /// Streams the request body back.
    Echo,
    /// Sends "first;" at once, then "rest" when the notify fires.
    Gated(Arc<tokio::sync::Notify>),
}

/// State the serving tasks share with the test.
struct State {
    name: String,
    lane: String,
    mode: Mutex<Mode>,
    status: AtomicU16,
    health_status: AtomicU16,
    delay_ms: AtomicU64,
    fail_every: AtomicU64,
    seen: Arc<Mutex<Vec<Seen>>>,
    probes: Mutex<Vec<Probe>>,
    arrived: AtomicUsize,
    answered: AtomicUsize,
}

/// A real HTTP backend on 127.0.0.1, stopped on drop.
pub struct Backend {
    pub addr: SocketAddr,
    pub name: String,
    pub lane: String,
    /// Every request (not health probes) it recorded.
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub connections: Arc<AtomicUsize>,
    /// Connections that have ended.
    pub closed: Arc<AtomicUsize>,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Backend {
    /// A backend answering [`Mode::Json`].
    pub async fn start(name: &str, lane: &str) -> Backend {
        Backend::start_mode(name, lane, Mode::Json).await
    }

    /// A backend answering [`Mode::Full`] (reads bodies, echoes the
    /// generation header), its mode switchable to [`Mode::Hang`] or
    /// [`Mode::Drop`].
    pub async fn full(name: &str, lane: &str) -> Backend {
        Backend::start_mode(name, lane, Mode::Full).await
    }

    /// A backend answering [`Mode::Text`] with `status`, every
    /// `fail_every`-th answer a 503.
    pub async fn text(name: &str, fail_every: u64, status: StatusCode) -> Backend {
        let b = Backend::start_mode(name, "", Mode::Text).await;
        b.set_status(status.as_u16());
        b.set_fail_every(fail_every);
        b
    }

    pub async fn start_mode(name: &str, lane: &str, mode: Mode) -> Backend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Backend::on_listener(name, lane, mode, listener)
    }

    /// A backend answering [`Mode::Json`] on `addr` (another loopback
    /// address, a given port), or `None` when it cannot be bound.
    pub async fn start_at(name: &str, lane: &str, addr: SocketAddr) -> Option<Backend> {
        let listener = TcpListener::bind(addr).await.ok()?;
        Some(Backend::on_listener(name, lane, Mode::Json, listener))
    }

    fn on_listener(name: &str, lane: &str, mode: Mode, listener: TcpListener) -> Backend {
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let state = Arc::new(State {
            name: name.to_string(),
            lane: lane.to_string(),
            mode: Mutex::new(mode),
            status: AtomicU16::new(200),
            health_status: AtomicU16::new(200),
            delay_ms: AtomicU64::new(0),
            fail_every: AtomicU64::new(0),
            seen: seen.clone(),
            probes: Mutex::new(Vec::new()),
            arrived: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
        });
        let (st, c, cl) = (state.clone(), connections.clone(), closed.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let conn = c.fetch_add(1, Ordering::SeqCst);
                let (st, cl) = (st.clone(), cl.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { st.answer(req, conn).await }
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
            state,
            task,
        }
    }

    /// Requests recorded.
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The lane tag of every request recorded.
    pub fn tags(&self) -> Vec<Option<String>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.tag.clone())
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

    /// Requests (not health probes) that arrived, counted before the mode
    /// applies: a hanging or dropping backend counts them too.
    pub fn arrived(&self) -> usize {
        self.state.arrived.load(Ordering::SeqCst)
    }

    /// Requests answered (not hung, not dropped).
    pub fn answered(&self) -> usize {
        self.state.answered.load(Ordering::SeqCst)
    }

    pub fn probes(&self) -> Vec<Probe> {
        self.state.probes.lock().unwrap().clone()
    }

    /// Health probes received on `path`.
    pub fn probes_on(&self, path: &str) -> usize {
        self.probes().iter().filter(|p| p.path == path).count()
    }

    pub fn health_hits(&self) -> usize {
        self.state.probes.lock().unwrap().len()
    }

    pub fn set_mode(&self, m: Mode) {
        *self.state.mode.lock().unwrap() = m;
    }

    /// Status of ordinary answers.
    pub fn set_status(&self, s: u16) {
        self.state.status.store(s, Ordering::SeqCst);
    }

    /// Status of health-probe answers.
    pub fn set_health(&self, s: u16) {
        self.state.health_status.store(s, Ordering::SeqCst);
    }

    /// A wait before each answer.
    pub fn set_delay(&self, d: Duration) {
        self.state
            .delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Every `n`-th answer (0: none) is a 503.
    pub fn set_fail_every(&self, n: u64) {
        self.state.fail_every.store(n, Ordering::SeqCst);
    }

    /// This backend as a node-file entry (name, addr, lane).
    pub fn node(&self) -> super::config::Node {
        super::config::Node::new(&self.name, self.addr).lane(&self.lane)
    }

    /// A node-file entry line for this backend.
    pub fn node_yaml(&self) -> String {
        self.node().to_yaml()
    }
}

impl State {
    fn json(&self, tag: &Option<String>) -> serde_json::Value {
        serde_json::json!({"node": self.name, "lane": self.lane, "tag": tag})
    }

    fn status(&self) -> StatusCode {
        let n = self.answered.fetch_add(1, Ordering::SeqCst) as u64 + 1;
        let every = self.fail_every.load(Ordering::SeqCst);
        if every > 0 && n.is_multiple_of(every) {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        StatusCode::from_u16(self.status.load(Ordering::SeqCst)).unwrap()
    }

    async fn answer(
        &self,
        req: Request<Incoming>,
        conn: usize,
    ) -> Result<Response<BoxBody>, std::io::Error> {
        let header = |n: &str| {
            req.headers()
                .get(n)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let tag = header("x-gray-tag");
        if req.uri().path().starts_with("/health") {
            self.probes.lock().unwrap().push(Probe {
                path: req.uri().path().to_string(),
                tag,
                user_agent: header("user-agent"),
            });
            let mut r = Response::new(full("health"));
            *r.status_mut() =
                StatusCode::from_u16(self.health_status.load(Ordering::SeqCst)).unwrap();
            return Ok(r);
        }
        let gen = header("x-graygate-generation");
        let seen = Seen {
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
            query: req.uri().query().map(str::to_string),
            headers: req.headers().clone(),
            tag: tag.clone(),
            body: Bytes::new(),
            at: Instant::now(),
            conn,
        };
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mode = self.mode.lock().unwrap().clone();
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if !matches!(mode, Mode::Full | Mode::Drop | Mode::HoldDrop(_)) {
            self.seen.lock().unwrap().push(seen.clone());
        }
        let mut r = match mode {
            Mode::Json => Response::new(full(self.json(&tag).to_string())),
            Mode::Full | Mode::Drop | Mode::HoldDrop(_) => {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                self.seen.lock().unwrap().push(Seen {
                    body: body.clone(),
                    ..seen
                });
                if let Mode::HoldDrop(gate) = &mode {
                    gate.notified().await;
                }
                if matches!(mode, Mode::Drop | Mode::HoldDrop(_)) {
                    // A service error makes hyper close the connection unanswered.
                    return Err(std::io::Error::other("dropping the connection"));
                }
                let mut json = self.json(&tag);
                json["gen"] = gen.into();
                json["body"] = String::from_utf8_lossy(&body).into();
                Response::new(full(json.to_string()))
            }
            Mode::Text => Response::new(full(self.name.clone())),
            Mode::Hang => std::future::pending().await,
            Mode::JsonClose => {
                let mut r = Response::new(full(format!(
                    "{{\"node\":\"{}\",\"lane\":\"{}\"}}",
                    self.name, self.lane
                )));
                r.headers_mut()
                    .insert("connection", http::HeaderValue::from_static("close"));
                r
            }
            Mode::Echo => Response::new(req.into_body().boxed()),
            Mode::Gated(gate) => {
                let (mut tx, body) =
                    http_body_util::channel::Channel::<Bytes, hyper::Error>::new(4);
                tokio::spawn(async move {
                    let _ = tx.send_data(Bytes::from_static(b"first;")).await;
                    gate.notified().await;
                    let _ = tx.send_data(Bytes::from_static(b"rest")).await;
                });
                Response::new(body.boxed())
            }
        };
        *r.status_mut() = self.status();
        Ok(r)
    }
}

/// One [`Backend::start`] backend per `(name, lane)`.
pub async fn backends<const N: usize>(specs: [(&str, &str); N]) -> [Backend; N] {
    let mut all = Vec::with_capacity(N);
    for (name, lane) in specs {
        all.push(Backend::start(name, lane).await);
    }
    all.try_into().unwrap_or_else(|_| unreachable!())
}

/// One [`Backend::full`] backend per `(name, lane)`.
pub async fn full_backends<const N: usize>(specs: [(&str, &str); N]) -> [Backend; N] {
    let mut all = Vec::with_capacity(N);
    for (name, lane) in specs {
        all.push(Backend::full(name, lane).await);
    }
    all.try_into().unwrap_or_else(|_| unreachable!())
}

/// How a [`raw_node`] answers every request.
#[derive(Clone, Copy)]
pub enum RawMode {
    /// `Content-Length: 100`, 7 bytes, then the connection closes.
    Cut,
    /// `Content-Length: 100`, 7 bytes, then nothing.
    Stall,
    /// A 64 MiB body written as fast as the gateway takes it.
    Big,
}

/// A node on raw TCP on 127.0.0.1 (no HTTP library: its bytes exactly as
/// [`RawMode`] says) answering the first request of each connection;
/// it runs as long as the test's runtime.
pub async fn raw_node(mode: RawMode) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut chunk = [0u8; 4096];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                match mode {
                    RawMode::Cut | RawMode::Stall => {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nseven..")
                            .await;
                        if let RawMode::Stall = mode {
                            let mut sink = [0u8; 64];
                            while let Ok(n) = s.read(&mut sink).await {
                                if n == 0 {
                                    break;
                                }
                            }
                        }
                    }
                    RawMode::Big => {
                        let total = 64usize << 20;
                        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n");
                        if s.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        let block = vec![b'x'; 64 * 1024];
                        for _ in 0..total / block.len() {
                            if s.write_all(&block).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}
