//! etcd for the fleet tests: a cluster of real `etcd` processes on free
//! loopback ports, a files configuration pushed with `graygate push`, and
//! gateways started from a bootstrap.
//!
//! Ports, race-free: a member's ports come from [`free_port`] (below the
//! kernel's ephemeral range, where no outgoing connection's local port
//! and no listener bound to `:0` comes from; bound and let go), so
//! another process may still take one before etcd binds it. etcd then
//! exits at start with `bind: address already in use` in
//! its log; [`Etcd::start`] sees that (a member that exited, that text in
//! its log) while it waits for the cluster to be healthy, kills the whole
//! attempt and starts a new cluster on new ports in a new data directory,
//! up to [`START_ATTEMPTS`] times. Any other failure fails the test at
//! once. A restart of existing members ([`Etcd::restart_all`]) must keep
//! their ports (the cluster's membership names them); it retries the
//! same ports for a while instead.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// New clusters tried before a port clash fails the test.
pub const START_ATTEMPTS: usize = 5;

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
        self.kill_all();
    }
}

/// Why a cluster did not come up.
enum NotUp {
    /// A member could not bind its ports: try new ones.
    PortTaken(String),
}

impl Etcd {
    /// A healthy cluster of `n` members on free ports.
    pub async fn start(n: usize) -> Etcd {
        Etcd::start_on(n, free_port).await
    }

    /// Like [`Etcd::start`], each port taken from `port` (a test of the
    /// retry hands out a port that is in use first).
    pub async fn start_on(n: usize, mut port: impl FnMut() -> u16) -> Etcd {
        for attempt in 1.. {
            let mut e = Etcd::on_new_ports(n, &mut port);
            for i in 0..n {
                e.spawn(i);
            }
            match e.wait_up().await {
                Ok(()) => return e,
                Err(NotUp::PortTaken(log)) => assert!(
                    attempt < START_ATTEMPTS,
                    "etcd lost its ports {attempt} times; last log:\n{log}"
                ),
            }
        }
        unreachable!()
    }

    fn on_new_ports(n: usize, port: &mut impl FnMut() -> u16) -> Etcd {
        // Members' data on tmpfs where there is one: etcd fsyncs every
        // write, and on a loaded disk one fsync can outlast the gateways'
        // 500 ms etcd timeout (an admin action then fails with 503).
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .unwrap();
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: format!("http://127.0.0.1:{}", port()),
                peer: format!("http://127.0.0.1:{}", port()),
                child: None,
            })
            .collect();
        let cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        Etcd {
            dir,
            members,
            cluster,
            first: None,
        }
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    pub fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let data = self.dir.path().join(&m.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))
            .unwrap();
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

    /// A member that has exited because its ports were taken: its log.
    fn lost_port(&mut self) -> Option<(usize, String)> {
        for i in 0..self.members.len() {
            let exited = match self.members[i].child.as_mut() {
                Some(c) => matches!(c.try_wait(), Ok(Some(_))),
                None => false,
            };
            if exited {
                let log = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
                assert!(
                    log.contains("address already in use"),
                    "etcd member {} exited:\n{log}",
                    self.members[i].name
                );
                return Some((i, log));
            }
        }
        None
    }

    /// Waits until every running member answers; a member that lost its
    /// ports ends the wait.
    async fn wait_up(&mut self) -> Result<(), NotUp> {
        let deadline = Instant::now() + Duration::from_secs(30);
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                continue;
            }
            let url = self.members[i].client.clone();
            while !Etcd::answers(&url).await {
                if let Some((_, log)) = self.lost_port() {
                    return Err(NotUp::PortTaken(log));
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd member {} not healthy",
                    self.members[i].name
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    async fn answers(url: &str) -> bool {
        let ok = async {
            let mut c = etcd_client::Client::connect([url], None).await.ok()?;
            tokio::time::timeout(Duration::from_secs(1), c.get("health", None))
                .await
                .ok()?
                .ok()
        }
        .await;
        ok.is_some()
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

    /// Starts every member again on its own ports; one whose port was
    /// taken meanwhile is started again until the port is back (bounded).
    pub async fn restart_all(&mut self) {
        for i in 0..self.members.len() {
            self.spawn(i);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(NotUp::PortTaken(log)) = self.wait_up().await {
            assert!(
                Instant::now() < deadline,
                "etcd could not get its ports back:\n{log}"
            );
            if let Some((i, _)) = self.lost_port() {
                self.kill(i);
                tokio::time::sleep(Duration::from_millis(100)).await;
                self.spawn(i);
            }
        }
    }

    /// The bootstrap for gateway `id` in `root/id/boot.yaml`: this cluster
    /// under `prefix`, `extra` lines (indented) added to its `etcd:`.
    pub fn boot(&self, root: &Path, id: &str, prefix: &str, extra: &str) -> PathBuf {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut eps = self.endpoints();
        // Gateways connect to the first endpoint first: the leader, when one
        // is named (so killing it exercises the rotation).
        if let Some(l) = self.first {
            eps.rotate_left(l);
        }
        let eps = eps
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let boot = dir.join("boot.yaml");
        let text = Config::empty()
            .listen("127.0.0.1:0")
            .set("admin_listen", "127.0.0.1:0")
            .raw(&format!(
                "etcd:\n  endpoints: [{eps}]\n  prefix: {prefix}\n  cache_dir: cache\n  id: {id}\n  timeout_ms: 500\n  status_ttl_secs: 3\n{extra}"
            ))
            .to_yaml();
        std::fs::write(&boot, text).unwrap();
        boot
    }

    /// A gateway started from [`Etcd::boot`].
    pub fn gateway(&self, root: &Path, id: &str, prefix: &str) -> Gateway {
        self.gateway_with(root, id, prefix, "")
    }

    ///
    /// A first start needs etcd to answer within the bootstrap's
    /// `timeout_ms`; on a loaded machine it may not, and a gateway without
    /// a cached snapshot then exits ("etcd unreachable"): started again,
    /// a few times.
    pub fn gateway_with(&self, root: &Path, id: &str, prefix: &str, extra: &str) -> Gateway {
        let boot = self.boot(root, id, prefix, extra);
        let mut tries = 0;
        loop {
            tries += 1;
            match Gateway::try_start(&boot) {
                Ok(gw) => return gw,
                Err(e) if tries < 3 && e.contains("etcd unreachable") => continue,
                Err(e) => panic!("{e}"),
            }
        }
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

    /// Puts the script `gray.lua` of the configuration under `prefix`;
    /// returns the revision.
    pub async fn put_script(&self, prefix: &str, text: &str) -> i64 {
        self.put(&format!("{prefix}/config/gray.lua"), text).await
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
            &Config::empty()
                .listen("127.0.0.1:0")
                .script("gray.lua")
                .node_files(&["nodes.yaml"])
                .route_all("api")
                .to_yaml(),
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

/// A node file: service `api` with these backends.
pub fn nodes_yaml(nodes: &[&Backend]) -> String {
    Nodes::api(nodes_of(nodes.iter().copied())).to_yaml()
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

/// `graygate push` of `conf` under `prefix`: whether it succeeded, and
/// what it printed.
pub fn try_push(etcd: &Etcd, prefix: &str, conf: &Conf) -> (bool, String) {
    let main = conf.main();
    let url = etcd.url();
    graygate(&[
        "push",
        "--config",
        main.to_str().unwrap(),
        "--etcd",
        &url,
        "--prefix",
        prefix,
    ])
}

/// `graygate push`; returns the revision it printed.
pub fn push(etcd: &Etcd, prefix: &str, conf: &Conf) -> i64 {
    let (ok, out) = try_push(etcd, prefix, conf);
    assert!(ok, "push failed: {out}");
    out.split("at revision ")
        .nth(1)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or_else(|| panic!("no revision in {out:?}"))
}

impl Gateway {
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
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Pushes `conf` under `prefix` and starts gateways `ids` from bootstraps
/// in a new directory (returned: it holds their caches); returns once
/// each serves the pushed revision.
pub async fn serve<const N: usize>(
    etcd: &Etcd,
    prefix: &str,
    conf: &Conf,
    ids: [&str; N],
) -> (tempfile::TempDir, i64, [Gateway; N]) {
    let revision = push(etcd, prefix, conf);
    let root = tempfile::tempdir().unwrap();
    let gws = ids.map(|id| etcd.gateway(root.path(), id, prefix));
    for g in &gws {
        g.wait_revision(revision).await;
    }
    (root, revision, gws)
}
