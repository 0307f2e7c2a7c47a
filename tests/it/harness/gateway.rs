//! The one gateway type: the real graygate binary started on a config
//! whose listeners are on free ports (`127.0.0.1:0`, the bound addresses
//! read from its log), waited for until it listens, its logs and stdout
//! kept, admin access, signals, restart and stop.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::client::{Req, Resp};

/// A temporary directory holding a gateway's files.
pub struct Fixture {
    pub dir: tempfile::TempDir,
}

impl Default for Fixture {
    fn default() -> Self {
        Fixture::new()
    }
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

    /// The JSON lines of the file `rel` (an access log with `format: json`)
    /// written so far; none while it does not exist.
    pub fn json_lines(&self, rel: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.path(rel))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
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

impl Fixture {
    /// Publishes `files` (path relative to the volume → contents) as
    /// kubelet's atomic writer updates a ConfigMap or Secret volume at
    /// `rel`: a new `..<UTC timestamp>` directory holding the files, a
    /// `..data_tmp` symlink to it renamed over `..data`, and each
    /// top-level name a symlink into `..data` (made once). Returns the
    /// directory `..data` pointed at before (kubelet removes it next; the
    /// test does, when it chooses).
    pub fn kube_publish(&self, rel: &str, files: &[(&str, &str)]) -> Option<PathBuf> {
        use std::os::unix::fs::symlink;
        let vol = self.path(rel);
        std::fs::create_dir_all(&vol).unwrap();
        let stamp = humantime::format_rfc3339_nanos(std::time::SystemTime::now())
            .to_string()
            .trim_end_matches('Z')
            .replace(['-', 'T', ':'], "_");
        let ts = format!("..{stamp}");
        for (name, text) in files {
            let p = vol.join(&ts).join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let data = vol.join("..data");
        let old = std::fs::read_link(&data).ok().map(|t| vol.join(t));
        let tmp = vol.join("..data_tmp");
        symlink(&ts, &tmp).unwrap();
        std::fs::rename(&tmp, &data).unwrap();
        for (name, _) in files {
            let top = Path::new(name).components().next().unwrap().as_os_str();
            let link = vol.join(top);
            if std::fs::symlink_metadata(&link).is_err() {
                symlink(Path::new("..data").join(top), &link).unwrap();
            }
        }
        old
    }
}

/// How a gateway was started, to start it again.
struct Launch {
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    config: PathBuf,
    extra: Vec<String>,
}

impl Launch {
    fn of(cmd: &Command, config: &Path, extra: &[&str]) -> Launch {
        Launch {
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(|a| a.to_owned()).collect(),
            env: cmd
                .get_envs()
                .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
                .collect(),
            config: config.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        for (k, v) in &self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd
    }
}

/// A running graygate process, killed on drop.
pub struct Gateway {
    child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    logs: Arc<Mutex<String>>,
    /// Everything the process wrote to stdout, and whether stdout has
    /// reached its end (the process exited).
    stdout: Arc<Mutex<(String, bool)>>,
    launch: Launch,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

fn addr_in(line: &str) -> Option<SocketAddr> {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix("addr="))
        .and_then(|a| a.parse().ok())
}

/// A thread that appends each line of `from` to a shared text.
fn collect_lines(
    from: impl std::io::Read + Send + 'static,
    into: impl Fn(&str) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            into(&line);
        }
    })
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
    pub fn start_cmd(cmd: Command, config: &Path, args: &[&str]) -> Gateway {
        Gateway::try_start_cmd(cmd, config, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Gateway::start`]; a process that exits before it listens is
    /// an `Err` with its log.
    pub fn try_start(config: &Path) -> Result<Gateway, String> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_graygate"));
        cmd.env_remove("GRAYGATE_ADMIN_TOKEN");
        Gateway::try_start_cmd(cmd, config, &[])
    }

    fn try_start_cmd(mut cmd: Command, config: &Path, args: &[&str]) -> Result<Gateway, String> {
        let launch = Launch::of(&cmd, config, args);
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
        let o = stdout.clone();
        let out = child.stdout.take().unwrap();
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
        let l = logs.clone();
        let stderr_reader = collect_lines(child.stderr.take().unwrap(), move |line| {
            let mut g = l.lock().unwrap();
            g.push_str(line);
            g.push('\n');
        });
        let wants_admin = std::fs::read_to_string(config)
            .map(|c| c.contains("admin_listen"))
            .unwrap_or(false);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            {
                let text = logs.lock().unwrap().clone();
                let find = |what: &str| text.lines().find(|l| l.contains(what)).and_then(addr_in);
                if let Some(addr) = find("graygate listening") {
                    let admin = find("admin listening");
                    if admin.is_some() || !wants_admin {
                        return Ok(Gateway {
                            child,
                            addr,
                            admin,
                            logs,
                            stdout,
                            launch,
                        });
                    }
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                // What it wrote last may still be in the pipe: read to its end.
                let _ = stderr_reader.join();
                return Err(format!(
                    "graygate exited with {status}:\n{}",
                    logs.lock().unwrap()
                ));
            }
            assert!(
                Instant::now() < deadline,
                "graygate did not start:\n{}",
                logs.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the process and starts it again the same way (same binary,
    /// environment, config and arguments); its new addresses replace the
    /// old.
    pub fn restart(&mut self) {
        self.kill();
        let l = &self.launch;
        let extra: Vec<&str> = l.extra.iter().map(String::as_str).collect();
        *self = Gateway::start_cmd(l.command(), &l.config.clone(), &extra);
    }

    /// The directory of its config file.
    pub fn dir(&self) -> &Path {
        self.launch.config.parent().unwrap()
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

    /// Waits (bounded by `limit`) for the process to exit on its own.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
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

    /// Waits (up to 20 s) for the process to exit with success, then for
    /// `log` in its log; `why` says what should have ended it.
    pub async fn exits_cleanly(&mut self, why: &str, log: &str) {
        let status = self
            .wait_exit(Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("{why}: still running:\n{}", self.logs()));
        assert!(status.success(), "{why}: {status:?}\n{}", self.logs());
        self.wait_log(log).await;
    }

    /// Whether the process is still running (it has not exited yet).
    pub async fn running(&mut self) -> bool {
        self.wait_exit(Duration::from_millis(1)).await.is_none()
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("admin listener configured")
    }

    /// `GET <path>` on the admin listener.
    pub async fn admin_get(&self, path: &str) -> Resp {
        Req::get(path).send(self.admin_addr()).await
    }

    /// `GET /status` on the admin listener, as JSON.
    pub async fn status(&self) -> serde_json::Value {
        self.admin_get("/status").await.json()
    }

    /// The generation it serves (from `/status`).
    pub async fn generation(&self) -> u64 {
        self.status().await["generation"].as_u64().unwrap_or(0)
    }

    /// Waits until a reload to a generation after `after` took effect
    /// (up to 10 s).
    pub async fn wait_generation(&self, after: u64) {
        super::soon("a new generation", || async {
            self.generation().await > after
        })
        .await;
    }

    /// The Prometheus text of `/metrics` on the admin listener.
    pub async fn metrics(&self) -> String {
        self.admin_get("/metrics").await.text()
    }

    /// The value of one series (its full name with labels), if present.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// The sum of every series whose name (with labels) starts with
    /// `prefix`.
    pub async fn metric_sum(&self, prefix: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The node `name` in the admin `/nodes` document (the first service
    /// that has one of that name).
    pub async fn node_doc(&self, name: &str) -> serde_json::Value {
        let doc = self.admin_get("/nodes").await.json();
        doc["services"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["nodes"].as_array().unwrap().iter())
            .find(|n| n["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no node {name}: {doc}"))
    }

    /// `GET <path>` on the main listener.
    pub async fn get(&self, path: &str) -> Resp {
        Req::get(path).send(self.addr).await
    }
}
