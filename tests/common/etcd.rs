//! Shared by the etcd tests (tests/etcd_fleet.rs, tests/release_fleet.rs):
//! a cluster of real `etcd` processes on free loopback ports, a files
//! configuration pushed with `graygate push`, gateways started from a
//! bootstrap, a request that may fail and a request loop.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::common::*;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Member {
    pub name: String,
    pub client: String,
    pub peer: String,
    pub child: Option<Child>,
}

/// An etcd cluster of real `etcd` processes; every one is killed on drop.
pub struct Etcd {
    pub dir: tempfile::TempDir,
    pub members: Vec<Member>,
    pub cluster: String,
    /// The member bootstraps list first.
    pub first: Option<usize>,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Etcd {
    pub async fn start(n: usize) -> Etcd {
        // Members' data on tmpfs where there is one: etcd fsyncs every
        // write, and on a loaded disk one fsync can outlast the gateways'
        // 500 ms etcd timeout (an admin action then fails with 503).
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .unwrap();
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: format!("http://127.0.0.1:{}", free_port()),
                peer: format!("http://127.0.0.1:{}", free_port()),
                child: None,
            })
            .collect();
        let cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut e = Etcd {
            dir,
            members,
            cluster,
            first: None,
        };
        for i in 0..n {
            e.spawn(i);
        }
        e.wait_healthy().await;
        e
    }

    pub fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let data = self.dir.path().join(&m.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", m.name))).unwrap();
        let child = Command::new("etcd")
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &m.client])
            .args(["--advertise-client-urls", &m.client])
            .args(["--listen-peer-urls", &m.peer])
            .args(["--initial-advertise-peer-urls", &m.peer])
            .args(["--initial-cluster", &self.cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "graygate-test"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd (Debian package etcd-server) must be installed");
        self.members[i].child = Some(child);
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    pub async fn restart_all(&mut self) {
        for i in 0..self.members.len() {
            self.spawn(i);
        }
        self.wait_healthy().await;
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client.clone()).collect()
    }

    pub fn url(&self) -> String {
        self.members[0].client.clone()
    }

    /// A client on any running member.
    pub async fn client(&self) -> etcd_client::Client {
        let live: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| m.client.clone())
            .collect();
        etcd_client::Client::connect(live, None).await.unwrap()
    }

    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            loop {
                let ok = async {
                    let mut c = etcd_client::Client::connect([m.client.as_str()], None)
                        .await
                        .ok()?;
                    tokio::time::timeout(Duration::from_secs(1), c.get("health", None))
                        .await
                        .ok()?
                        .ok()
                }
                .await;
                if ok.is_some() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd member {} not healthy",
                    m.name
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Puts a key through any live member (retrying during an election);
    /// returns the revision.
    pub async fn put(&self, key: &str, value: &str) -> i64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut c = self.client().await;
            if let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(2), c.put(key, value, None)).await
            {
                return r.header().unwrap().revision();
            }
            assert!(Instant::now() < deadline, "put {key} failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn get(&self, key: &str) -> Option<String> {
        let mut c = self.client().await;
        let r = c.get(key, None).await.unwrap();
        r.kvs()
            .first()
            .map(|kv| kv.value_str().unwrap().to_string())
    }
}

/// A files configuration to push: main.yaml, nodes.yaml, gray.lua.
pub struct Conf {
    pub dir: tempfile::TempDir,
}

impl Conf {
    pub fn new(nodes: &str, script: &str) -> Conf {
        let dir = tempfile::tempdir().unwrap();
        let c = Conf { dir };
        c.write(
            "main.yaml",
            "listen: 127.0.0.1:0\nscript: gray.lua\nnode_files: [nodes.yaml]\nroutes:\n  - { prefix: /, service: api }\n",
        );
        c.write("nodes.yaml", nodes);
        c.write("gray.lua", script);
        c
    }

    pub fn write(&self, rel: &str, text: &str) {
        std::fs::write(self.dir.path().join(rel), text).unwrap();
    }

    pub fn main(&self) -> PathBuf {
        self.dir.path().join("main.yaml")
    }
}

pub fn nodes_yaml(nodes: &[&Backend]) -> String {
    let mut s = "services:\n  api:\n    nodes:\n".to_string();
    for b in nodes {
        s.push_str(&format!(
            "      - {{ name: {}, addr: \"{}\", lane: {} }}\n",
            b.name, b.addr, b.lane
        ));
    }
    s
}

pub fn graygate(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `graygate push`; returns the revision it printed.
pub fn push(etcd: &Etcd, prefix: &str, conf: &Conf) -> i64 {
    let (ok, out) = graygate(&[
        "push",
        "--config",
        conf.main().to_str().unwrap(),
        "--etcd",
        &etcd.url(),
        "--prefix",
        prefix,
    ]);
    assert!(ok, "push failed: {out}");
    out.split("at revision ")
        .nth(1)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or_else(|| panic!("no revision in {out:?}"))
}

/// A gateway started from a bootstrap in its own directory.
pub struct Gw {
    pub dir: PathBuf,
    pub gw: Option<Gateway>,
}

impl Gw {
    pub fn boot(root: &Path, id: &str, etcd: &Etcd, prefix: &str) -> PathBuf {
        Gw::boot_with(root, id, etcd, prefix, "")
    }

    /// A bootstrap with `extra` lines (indented) added to its `etcd:`.
    pub fn boot_with(root: &Path, id: &str, etcd: &Etcd, prefix: &str, extra: &str) -> PathBuf {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut eps = etcd.endpoints();
        // Gateways connect to the first endpoint first: the leader, when one
        // is named (so killing it exercises the rotation).
        if let Some(l) = etcd.first {
            eps.rotate_left(l);
        }
        let eps = eps
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let boot = dir.join("boot.yaml");
        std::fs::write(
            &boot,
            format!(
                "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\netcd:\n  endpoints: [{eps}]\n  prefix: {prefix}\n  cache_dir: cache\n  id: {id}\n  timeout_ms: 500\n  status_ttl_secs: 3\n{extra}"
            ),
        )
        .unwrap();
        boot
    }

    pub fn start(root: &Path, id: &str, etcd: &Etcd, prefix: &str) -> Gw {
        Gw::start_with(root, id, etcd, prefix, "")
    }

    pub fn start_with(root: &Path, id: &str, etcd: &Etcd, prefix: &str, extra: &str) -> Gw {
        let boot = Gw::boot_with(root, id, etcd, prefix, extra);
        Gw {
            dir: root.join(id),
            gw: Some(Gateway::start(&boot)),
        }
    }

    pub fn g(&self) -> &Gateway {
        self.gw.as_ref().unwrap()
    }

    pub fn restart(&mut self) {
        self.gw = None;
        self.gw = Some(Gateway::start(&self.dir.join("boot.yaml")));
    }

    pub async fn status(&self) -> serde_json::Value {
        self.g().status().await
    }

    pub async fn admin(&self, path: &str) -> Resp {
        Req::get(path).send(self.g().admin.unwrap()).await
    }

    /// Waits until the gateway serves `revision`, live.
    pub async fn wait_revision(&self, revision: i64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.status().await;
            if s["revision"] == revision && s["source_state"] == "live" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "gateway never served revision {revision}: {s}\n{}",
                self.g().logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
    pub stop: Arc<std::sync::atomic::AtomicBool>,
    pub ok: Arc<AtomicUsize>,
    pub errors: Arc<std::sync::Mutex<Vec<String>>>,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(addrs: &[SocketAddr]) -> Load {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
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

    pub async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        let errors = self.errors.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), errors)
    }
}
