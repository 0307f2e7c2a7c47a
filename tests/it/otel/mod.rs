//! OpenTelemetry (`otel:`): the lane rides in W3C baggage through ordinary
//! Python services instrumented by OpenTelemetry's own packages (no lane
//! code), and the gateways' spans reach a real OTLP receiver that decodes
//! them with OpenTelemetry's proto definitions. The Python packages are
//! pinned in `tools/requirements-otel.txt` (installed by `tools/test`).

mod chain;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A Python helper process (`svc.py`, `otlp_receiver.py`), killed on drop.
pub struct Py {
    child: Child,
    /// Held open: `svc.py` runs until its stdin closes.
    _stdin: Option<ChildStdin>,
    /// The first line it printed (`ready name=port …`, `port N`).
    pub first_line: String,
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn script(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/otel")
        .join(name)
        .display()
        .to_string()
}

impl Py {
    /// Starts `python3 tests/it/otel/<name> <args…>` and waits (60 s at
    /// most) for its first line; a process that exits first fails the test
    /// with what it wrote.
    pub fn start(name: &str, args: &[&str]) -> Py {
        let mut child = Command::new("python3")
            .arg(script(name))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            for _ in lines {}
        });
        let errors = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let e2 = errors.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut e = e2.lock().unwrap();
                if e.len() < 20_000 {
                    e.push_str(&l);
                    e.push('\n');
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(first_line) => Py {
                _stdin: child.stdin.take(),
                child,
                first_line,
            },
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "{name} did not start (is tools/requirements-otel.txt installed? tools/test installs it):\n{}",
                    errors.lock().unwrap()
                );
            }
        }
    }

    /// The port named `name` on the `ready` line (`svc.py`).
    pub fn port_of(&self, name: &str) -> u16 {
        self.first_line
            .split_whitespace()
            .find_map(|t| t.strip_prefix(&format!("{name}=")))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port for {name} in {:?}", self.first_line))
    }
}

/// `n` random bytes in lower-case hex (a trace or span id).
pub fn hex_id(n: usize) -> String {
    (0..n)
        .map(|_| format!("{:02x}", fastrand::u8(1..)))
        .collect()
}

/// A real OTLP/HTTP receiver (`otlp_receiver.py`).
pub struct Receiver {
    _py: Py,
    pub port: u16,
}

impl Receiver {
    pub fn start() -> Receiver {
        let py = Py::start("otlp_receiver.py", &[]);
        let port = py
            .first_line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("receiver said {:?}", py.first_line));
        Receiver { _py: py, port }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/v1/traces", self.port)
    }

    /// Every span received so far.
    pub async fn spans(&self) -> Vec<serde_json::Value> {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let r = crate::harness::Req::get("/spans").send(addr).await;
        assert_eq!(r.status, 200);
        r.json().as_array().cloned().unwrap_or_default()
    }
}
