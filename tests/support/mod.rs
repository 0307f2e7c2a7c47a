//! Backends for the resilience tests: real hyper servers whose answer
//! status, health-check status and behaviour (answer, hang, drop the
//! connection) can be switched while they run, and which echo the lane tag
//! and the generation that routed each request.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Answer normally.
pub const NORMAL: u8 = 0;
/// Never answer.
pub const HANG: u8 = 1;
/// Read the request (and its body), then close the connection unanswered.
pub const DROP: u8 = 2;

/// What a node received.
#[derive(Debug, Clone)]
pub struct Got {
    pub method: String,
    pub path: String,
    pub body: Bytes,
    pub tag: Option<String>,
    /// When it arrived.
    pub at: std::time::Instant,
}

pub struct Node {
    pub addr: SocketAddr,
    pub name: String,
    pub lane: String,
    /// Status of ordinary answers.
    pub status: Arc<AtomicU16>,
    /// Status of `/health` answers.
    pub health_status: Arc<AtomicU16>,
    pub mode: Arc<AtomicU8>,
    pub got: Arc<Mutex<Vec<Got>>>,
    pub health_hits: Arc<AtomicUsize>,
    /// Every health probe: path, lane tag and User-Agent.
    pub probes: Arc<Mutex<Vec<Probe>>>,
    /// Requests (not health probes) that arrived, counted before the mode
    /// applies: a hanging or dropping node counts them too.
    pub arrived: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// One health probe as a node received it.
#[derive(Debug, Clone)]
pub struct Probe {
    pub path: String,
    pub tag: Option<String>,
    pub user_agent: Option<String>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Node {
    pub async fn start(name: &str, lane: &str) -> Node {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let status = Arc::new(AtomicU16::new(200));
        let health_status = Arc::new(AtomicU16::new(200));
        let mode = Arc::new(AtomicU8::new(NORMAL));
        let got = Arc::new(Mutex::new(Vec::new()));
        let health_hits = Arc::new(AtomicUsize::new(0));
        let probes = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(AtomicUsize::new(0));
        let st = Shared {
            probes: probes.clone(),
            arrived: arrived.clone(),
            name: name.to_string(),
            lane: lane.to_string(),
            status: status.clone(),
            health_status: health_status.clone(),
            mode: mode.clone(),
            got: got.clone(),
            health_hits: health_hits.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { st.answer(req).await }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Node {
            addr,
            name: name.to_string(),
            lane: lane.to_string(),
            status,
            health_status,
            mode,
            got,
            health_hits,
            probes,
            arrived,
            task,
        }
    }

    /// Requests that reached this node, answered or not.
    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    pub fn probes(&self) -> Vec<Probe> {
        self.probes.lock().unwrap().clone()
    }

    /// Health probes received on `path`.
    pub fn probes_on(&self, path: &str) -> usize {
        self.probes().iter().filter(|p| p.path == path).count()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }

    pub fn set_mode(&self, m: u8) {
        self.mode.store(m, Ordering::SeqCst);
    }

    pub fn set_status(&self, s: u16) {
        self.status.store(s, Ordering::SeqCst);
    }

    pub fn set_health(&self, s: u16) {
        self.health_status.store(s, Ordering::SeqCst);
    }

    pub fn health_hits(&self) -> usize {
        self.health_hits.load(Ordering::SeqCst)
    }

    pub fn yaml(&self) -> String {
        format!(
            "      - {{ name: {}, addr: \"{}\", lane: {} }}\n",
            self.name, self.addr, self.lane
        )
    }
}

#[derive(Clone)]
struct Shared {
    name: String,
    lane: String,
    status: Arc<AtomicU16>,
    health_status: Arc<AtomicU16>,
    mode: Arc<AtomicU8>,
    got: Arc<Mutex<Vec<Got>>>,
    health_hits: Arc<AtomicUsize>,
    probes: Arc<Mutex<Vec<Probe>>>,
    arrived: Arc<AtomicUsize>,
}

impl Shared {
    async fn answer(
        &self,
        req: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, std::io::Error> {
        let header = |n: &str| {
            req.headers()
                .get(n)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let tag = header("x-gray-tag");
        let gen = header("x-graygate-generation");
        if req.uri().path().starts_with("/health") {
            self.probes.lock().unwrap().push(Probe {
                path: req.uri().path().to_string(),
                tag: tag.clone(),
                user_agent: header("user-agent"),
            });
            self.health_hits.fetch_add(1, Ordering::SeqCst);
            let s = self.health_status.load(Ordering::SeqCst);
            let mut r = Response::new(Full::new(Bytes::from_static(b"health")));
            *r.status_mut() = http::StatusCode::from_u16(s).unwrap();
            return Ok(r);
        }
        let at = std::time::Instant::now();
        let method = req.method().to_string();
        let path = req.uri().path().to_string();
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mode = self.mode.load(Ordering::SeqCst);
        if mode == HANG {
            std::future::pending::<()>().await;
        }
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        self.got.lock().unwrap().push(Got {
            method,
            path,
            body: body.clone(),
            tag: tag.clone(),
            at,
        });
        if mode == DROP {
            // A service error makes hyper close the connection unanswered.
            return Err(std::io::Error::other("dropping the connection"));
        }
        let json = serde_json::json!({
            "node": self.name,
            "lane": self.lane,
            "tag": tag,
            "gen": gen,
            "body": String::from_utf8_lossy(&body),
        });
        let mut r = Response::new(Full::new(Bytes::from(json.to_string())));
        *r.status_mut() = http::StatusCode::from_u16(self.status.load(Ordering::SeqCst)).unwrap();
        Ok(r)
    }
}
