//! Nacos for the discovery tests: a real `rnacos` server (a Nacos-protocol
//! server: Nacos 2.x gRPC for the clients, the v1 HTTP open API) on free
//! loopback ports, instances registered through its HTTP API (exact
//! control) or by Nacos's official Python client (as users' services do).
//!
//! rnacos is found in `$RNACOS`, on `PATH`, or in cargo's bin directory
//! (`tools/test` installs it there). It runs from an empty working
//! directory (it reads `.env`) on a fresh data directory, its HTTP port
//! from [`free_port`] and its gRPC port 1000 above (the clients' rule).
//! Started with `RNACOS_ENABLE_OPEN_API_AUTH=true`, the harness logs in as
//! the initial admin and its own API calls carry the token.
//!
//! A known hazard of rnacos: about one cold start in four panics in its
//! raft apply and then answers writes without storing them. [`Nacos::start`]
//! checks each start — no `panicked` in its log, and a persistent instance
//! written and then read back — and on failure starts again on new ports
//! and a fresh data directory, up to [`START_ATTEMPTS`] times. Assertions
//! are never retried.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use super::*;

/// Fresh servers tried before a broken start fails the test. The panic is
/// a start-up race in rnacos (its raft apply runs before its managers are
/// wired), far more frequent on a loaded machine: a start takes about a
/// second, so many are tried.
pub const START_ATTEMPTS: usize = 20;

/// The rnacos binary: `$RNACOS`, else `rnacos` on PATH, else cargo's bin
/// directory.
pub fn rnacos_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("RNACOS").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let p = dir.join("rnacos");
            if p.is_file() {
                return p;
            }
        }
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_default();
    let p = cargo_home.join("bin/rnacos");
    assert!(
        p.is_file(),
        "rnacos not found ($RNACOS, PATH, {}): tools/test installs it",
        p.display()
    );
    p
}

/// A running rnacos, killed on drop.
pub struct Nacos {
    pub http: u16,
    pub grpc: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    env: Vec<(String, String)>,
    /// With `RNACOS_ENABLE_OPEN_API_AUTH=true`: the token the harness's
    /// own API calls carry (logged in as the initial admin).
    token: Option<String>,
    /// Launches so far: each has its own data directory and log.
    starts: usize,
}

impl Drop for Nacos {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One HTTP exchange with a server; Err on a transport error.
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> Result<Resp, String> {
    let work = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
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

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An instance as the HTTP API registers it.
#[derive(Clone, Debug)]
pub struct Inst {
    pub service: String,
    pub group: String,
    pub namespace: String,
    pub addr: SocketAddr,
    pub weight: f64,
    pub enabled: bool,
    pub cluster: String,
    pub metadata: Vec<(String, String)>,
    /// Ephemeral: kept healthy by heartbeats (this harness sends none, so
    /// the server marks it unhealthy after its health timeout).
    pub ephemeral: bool,
}

impl Inst {
    /// A persistent (non-ephemeral: no heartbeat needed) instance of
    /// `service` in DEFAULT_GROUP of `public`, weight 1, enabled.
    pub fn new(service: &str, addr: SocketAddr) -> Inst {
        Inst {
            service: service.into(),
            group: "DEFAULT_GROUP".into(),
            namespace: "public".into(),
            addr,
            weight: 1.0,
            enabled: true,
            cluster: "DEFAULT".into(),
            metadata: Vec::new(),
            ephemeral: false,
        }
    }

    pub fn meta(mut self, k: &str, v: &str) -> Inst {
        self.metadata.push((k.into(), v.into()));
        self
    }

    pub fn group(mut self, g: &str) -> Inst {
        self.group = g.into();
        self
    }

    pub fn namespace(mut self, n: &str) -> Inst {
        self.namespace = n.into();
        self
    }

    pub fn weight(mut self, w: f64) -> Inst {
        self.weight = w;
        self
    }

    pub fn ephemeral(mut self) -> Inst {
        self.ephemeral = true;
        self
    }

    pub fn enabled(mut self, e: bool) -> Inst {
        self.enabled = e;
        self
    }

    fn query(&self) -> String {
        let meta: serde_json::Map<String, serde_json::Value> = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::from(v.as_str())))
            .collect();
        format!(
            "serviceName={}&groupName={}&namespaceId={}&ip={}&port={}&weight={}&enabled={}&ephemeral={}&clusterName={}&metadata={}",
            enc(&self.service),
            enc(&self.group),
            enc(&self.namespace),
            self.addr.ip(),
            self.addr.port(),
            self.weight,
            self.enabled,
            self.ephemeral,
            enc(&self.cluster),
            enc(&serde_json::Value::Object(meta).to_string()),
        )
    }
}

impl Nacos {
    /// A healthy rnacos on free ports (see the module's note on restarts).
    pub async fn start() -> Nacos {
        Nacos::start_env(&[]).await
    }

    /// Like [`Nacos::start`], with extra environment variables (e.g.
    /// `RNACOS_NAMING_HEALTH_TIMEOUT_SECOND`).
    pub async fn start_env(env: &[(&str, &str)]) -> Nacos {
        let mut last = String::new();
        for attempt in 1..=START_ATTEMPTS {
            let mut n = Nacos::spawn(env);
            match n.wait_up().await {
                Ok(()) => return n,
                Err(why) => {
                    eprintln!("rnacos start {attempt} failed ({why}); starting a fresh one");
                    last = format!("{why}\n{}", n.log());
                    n.kill();
                }
            }
        }
        panic!("rnacos did not start in {START_ATTEMPTS} attempts; last:\n{last}");
    }

    fn spawn(env: &[(&str, &str)]) -> Nacos {
        let dir = tempfile::tempdir().unwrap();
        let http = loop {
            let p = free_port();
            // The gRPC port is the HTTP port + 1000 (the clients' rule).
            if p < 64000 && std::net::TcpListener::bind(("127.0.0.1", p + 1000)).is_ok() {
                break p;
            }
        };
        let mut n = Nacos {
            http,
            grpc: http + 1000,
            dir,
            child: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            token: None,
            starts: 0,
        };
        n.launch();
        n
    }

    /// Starts the process on this server's ports and data directory.
    fn launch(&mut self) {
        let cwd = self.dir.path().join("cwd");
        std::fs::create_dir_all(&cwd).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let child = Command::new(rnacos_bin())
            .current_dir(&cwd)
            .env("RNACOS_HTTP_PORT", self.http.to_string())
            .env("RNACOS_GRPC_PORT", self.grpc.to_string())
            .env("RNACOS_HTTP_CONSOLE_PORT", "0")
            .env("RNACOS_SDK_HOST", "127.0.0.1")
            .env(
                "RNACOS_DATA_DIR",
                self.dir.path().join(format!("data-{}", self.starts)),
            )
            .env("RUST_LOG", "warn")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn rnacos");
        self.child = Some(child);
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("rnacos-{}.log", self.starts))
    }

    /// What the server wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `host:port` of the HTTP port (what `nacos.server_addr` names).
    pub fn server_addr(&self) -> String {
        format!("127.0.0.1:{}", self.http)
    }

    fn http_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.http))
    }

    /// Up: the HTTP API answers, a persistent instance written is read
    /// back, and the log shows no panic.
    async fn wait_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let probe = Inst::new("graygate-start-probe", "127.0.0.1:9".parse().unwrap());
        let env = |k: &str| self.env.iter().find(|e| e.0 == k).map(|e| e.1.clone());
        let auth = env("RNACOS_ENABLE_OPEN_API_AUTH").is_some_and(|v| v == "true");
        let user = env("RNACOS_INIT_ADMIN_USERNAME").unwrap_or_else(|| "admin".into());
        let pass = env("RNACOS_INIT_ADMIN_PASSWORD").unwrap_or_else(|| "admin".into());
        loop {
            if self.log().contains("panicked") {
                return Err("panicked (log)".into());
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("exited with {st}"));
            }
            if Instant::now() > deadline {
                return Err("not up within 30 s".into());
            }
            if auth && self.token.is_none() {
                self.token = self.login(&user, &pass).await;
            }
            if (!auth || self.token.is_some()) && self.try_register(&probe).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Publish-then-read: a broken raft answers the write but stores
        // nothing.
        let read = Instant::now() + Duration::from_secs(5);
        loop {
            if self.log().contains("panicked") {
                return Err("panicked (log)".into());
            }
            if self
                .instances(&probe.service, "DEFAULT_GROUP", "public")
                .await
                .len()
                == 1
            {
                break;
            }
            if Instant::now() > read {
                return Err("a registered instance is not read back".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.deregister(&probe).await;
        Ok(())
    }

    /// Logs in; the access token, if the server gave one.
    pub async fn login(&self, user: &str, pass: &str) -> Option<String> {
        let path = format!(
            "/nacos/v1/auth/login?username={}&password={}",
            enc(user),
            enc(pass)
        );
        let r = http(self.http_addr(), "POST", &path).await.ok()?;
        let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
        v["accessToken"].as_str().map(String::from)
    }

    /// `path` with the harness's access token, when auth is on.
    fn authed(&self, path: String) -> String {
        match &self.token {
            Some(t) => format!("{path}&accessToken={}", enc(t)),
            None => path,
        }
    }

    /// Registers `i`; the error instead of a panic (a cluster electing a
    /// leader refuses writes for a while).
    pub async fn try_register(&self, i: &Inst) -> Result<(), String> {
        self.try_call("POST", format!("/nacos/v1/ns/instance?{}", i.query()))
            .await
    }

    /// Deregisters `i`; the error instead of a panic.
    pub async fn try_deregister(&self, i: &Inst) -> Result<(), String> {
        self.try_call("DELETE", format!("/nacos/v1/ns/instance?{}", i.query()))
            .await
    }

    /// Publishes a config; the error instead of a panic.
    pub async fn try_publish(
        &self,
        group: &str,
        data_id: &str,
        content: &str,
    ) -> Result<(), String> {
        self.try_call(
            "POST",
            format!(
                "/nacos/v1/cs/configs?dataId={}&group={}&content={}",
                enc(data_id),
                enc(group),
                enc(content)
            ),
        )
        .await
    }

    async fn try_call(&self, method: &str, path: String) -> Result<(), String> {
        let r = http(self.http_addr(), method, &self.authed(path)).await?;
        if r.status == 200 {
            Ok(())
        } else {
            Err(format!("{} {}", r.status, r.text()))
        }
    }

    /// Registers (or updates: weight, enabled, metadata) `i` through the
    /// HTTP API.
    pub async fn register(&self, i: &Inst) {
        self.try_register(i)
            .await
            .unwrap_or_else(|e| panic!("register {i:?}: {e}"));
    }

    /// Publishes a config (`data_id` in `group` of the public namespace)
    /// through the HTTP API, as an operator's edit in the console does.
    /// A server whose raft has no leader yet (just started, on a loaded
    /// machine) is asked again for up to 10 s; any other refusal fails.
    pub async fn publish(&self, group: &str, data_id: &str, content: &str) {
        let path = self.authed(format!(
            "/nacos/v1/cs/configs?dataId={}&group={}&content={}",
            enc(data_id),
            enc(group),
            enc(content)
        ));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = http(self.http_addr(), "POST", &path)
                .await
                .unwrap_or_else(|e| panic!("publish {group}/{data_id}: {e}"));
            if r.status != 200 && r.text().contains("raft leader") && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            assert_eq!(r.status, 200, "publish {group}/{data_id}: {}", r.text());
            return;
        }
    }

    /// The content of a config, if Nacos has it.
    pub async fn config(&self, group: &str, data_id: &str) -> Option<String> {
        let path = self.authed(format!(
            "/nacos/v1/cs/configs?dataId={}&group={}",
            enc(data_id),
            enc(group)
        ));
        let r = http(self.http_addr(), "GET", &path).await.ok()?;
        (r.status == 200).then(|| r.text())
    }

    /// Changes `i` in place (PUT: weight, enabled, metadata).
    pub async fn update(&self, i: &Inst) {
        let r = http(
            self.http_addr(),
            "PUT",
            &self.authed(format!("/nacos/v1/ns/instance?{}", i.query())),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "update {i:?}: {}", r.text());
    }

    pub async fn deregister(&self, i: &Inst) {
        let r = http(
            self.http_addr(),
            "DELETE",
            &self.authed(format!("/nacos/v1/ns/instance?{}", i.query())),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "deregister {i:?}: {}", r.text());
    }

    /// Every instance of a service (healthy or not), as the HTTP API lists
    /// them (`hosts`).
    pub async fn instances(
        &self,
        service: &str,
        group: &str,
        namespace: &str,
    ) -> Vec<serde_json::Value> {
        let path = format!(
            "/nacos/v1/ns/instance/list?serviceName={}&groupName={}&namespaceId={}&healthyOnly=false",
            enc(service),
            enc(group),
            enc(namespace)
        );
        match http(self.http_addr(), "GET", &self.authed(path)).await {
            Ok(r) if r.status == 200 => serde_json::from_slice::<serde_json::Value>(&r.body)
                .ok()
                .and_then(|v| v["hosts"].as_array().cloned())
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// A new server on the same ports, on a fresh data directory (what a
    /// client sees as the server coming back, its instances to register
    /// again); a broken start is replaced as at [`Nacos::start`].
    pub async fn restart_fresh(&mut self) {
        for attempt in 1..=START_ATTEMPTS {
            self.kill();
            self.starts += 1;
            self.token = None;
            self.launch();
            match self.wait_up().await {
                Ok(()) => return,
                Err(why) => eprintln!("rnacos restart {attempt} failed ({why}); again"),
            }
        }
        panic!(
            "rnacos did not restart in {START_ATTEMPTS} attempts:\n{}",
            self.log()
        );
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A Python process registering instances with Nacos's official client
/// (`nacos-sdk-python`, gRPC), ephemeral as a service's own registration
/// is, and holding them until killed.
pub struct PyClient {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for PyClient {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The Python program: registers each instance given as JSON, prints
/// `registered`, then sleeps until killed.
const PY_CLIENT: &str = r#"
import asyncio, json, sys
from v2.nacos import ClientConfigBuilder, GRPCConfig, NacosNamingService, RegisterInstanceParam

async def main():
    server, namespace, instances = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = (ClientConfigBuilder().server_address(server).namespace_id(namespace)
           .log_level("WARNING").grpc_config(GRPCConfig(grpc_timeout=5000)).build())
    naming = await NacosNamingService.create_naming_service(cfg)
    for i in instances:
        ok = await naming.register_instance(RegisterInstanceParam(
            service_name=i["service"], group_name=i["group"], ip=i["ip"], port=i["port"],
            weight=i.get("weight", 1.0), cluster_name="DEFAULT", metadata=i.get("metadata", {}),
            enabled=True, healthy=True, ephemeral=True))
        assert ok, i
    print("registered", flush=True)
    while True:
        await asyncio.sleep(3600)

asyncio.run(main())
"#;

impl PyClient {
    /// Starts the client; returns once it has registered every instance.
    pub async fn start(nacos: &Nacos, namespace: &str, instances: &[Inst]) -> PyClient {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("register.py");
        std::fs::write(&script, PY_CLIENT).unwrap();
        let list: Vec<serde_json::Value> = instances
            .iter()
            .map(|i| {
                let meta: serde_json::Map<String, serde_json::Value> = i
                    .metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().into()))
                    .collect();
                serde_json::json!({
                    "service": i.service, "group": i.group,
                    "ip": i.addr.ip().to_string(), "port": i.addr.port(),
                    "weight": i.weight, "metadata": meta,
                })
            })
            .collect();
        let out = dir.path().join("out.log");
        let log = std::fs::File::create(&out).unwrap();
        let child = Command::new("python3")
            .arg(&script)
            .arg(nacos.server_addr())
            .arg(namespace)
            .arg(serde_json::Value::from(list).to_string())
            // The client's logs and caches go under this directory.
            .env("HOME", dir.path())
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn python3");
        let mut c = PyClient { child, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if text.contains("registered") {
                return c;
            }
            if let Ok(Some(st)) = c.child.try_wait() {
                panic!("the Python Nacos client exited with {st}:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "the Python Nacos client did not register within 30 s:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the client (SIGKILL: no deregistration; the server drops its
    /// ephemeral instances when the connection goes).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The gRPC ports `pid` has established connections to, with their count
/// (from `/proc`: its socket inodes matched in `/proc/net/tcp`).
pub fn connections_of(pid: u32, ports: &[u16]) -> std::collections::BTreeMap<u16, usize> {
    let mut inodes = std::collections::BTreeSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path()) {
                let l = link.to_string_lossy();
                if let Some(ino) = l.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    inodes.insert(ino.to_string());
                }
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || f[3] != "01" || !inodes.contains(f[9]) {
            continue;
        }
        let port = f[2]
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            .unwrap_or(0);
        if ports.contains(&port) {
            *out.entry(port).or_default() += 1;
        }
    }
    out
}
