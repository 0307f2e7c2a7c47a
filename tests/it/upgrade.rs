//! Binary upgrade without loss: a new graygate process takes the listening
//! sockets of the running one (over its upgrade socket, SCM_RIGHTS), the old
//! one stops accepting, finishes in-flight requests, closes keep-alive
//! connections with `Connection: close`, lets a WebSocket conversation end,
//! then exits. Real processes, real sockets, continuous load.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::*;
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// A process the test did not spawn itself (the successor started by the
/// old gateway): killed when the test ends, however it ends.
struct Orphan(u32);

impl Drop for Orphan {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-KILL")
            .arg(self.0.to_string())
            .status();
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
}

/// Inodes of the listening TCP sockets on `port` (from /proc/net/tcp): the
/// kernel objects themselves, so an upgrade that hands the sockets over keeps
/// them, while one that binds anew (SO_REUSEPORT) shows new ones.
fn listening_inodes(port: u16) -> std::collections::BTreeSet<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let suffix = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 9 && f[1].ends_with(&suffix) && f[3] == "0A").then(|| f[9].parse().ok())?
        })
        .collect()
}

/// Copies the built binary to `path` through a temporary file renamed over
/// it — what a package upgrade does to /usr/bin/graygate.
fn install_binary(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("new");
    // Copied by `cp`, not by this process: a file open for writing here
    // could leak into a process another test forks at that moment, and
    // exec would then fail with "text file busy".
    let ok = Command::new("cp")
        .arg(env!("CARGO_BIN_EXE_graygate"))
        .arg(&tmp)
        .status()
        .unwrap()
        .success();
    assert!(ok, "cp failed");
    std::fs::rename(&tmp, path).unwrap();
}

/// A WebSocket echo node: answers every text message with `chat:<text>`.
async fn ws_node() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if let Message::Text(t) = m {
                        let reply = Message::text(format!("chat:{}", t.as_str()));
                        if ws.send(reply).await.is_err() {
                            break;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// What the load clients saw.
#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    failures: Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }
    fn ok(&self) -> usize {
        self.ok.load(Ordering::SeqCst)
    }
}

/// One request per connection (`Connection: close`), over and over.
async fn plain_client(addr: SocketAddr, tally: Arc<Tally>, stop: Arc<AtomicBool>, id: usize) {
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let r = tokio::time::timeout(Duration::from_secs(20), async {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(
                format!("GET /api/p{id}-{n} HTTP/1.1\r\nHost: gg\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await?;
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).into_owned())
        })
        .await;
        match r {
            Ok(Ok(text))
                if text.starts_with("HTTP/1.1 200") && text.contains("\"node\":\"f1\"") =>
            {
                tally.ok.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Ok(text)) => tally.fail(format!("plain {id}: unexpected answer {text:?}")),
            Ok(Err(e)) => tally.fail(format!("plain {id}: {e}")),
            Err(_) => tally.fail(format!("plain {id}: no answer in 20 s")),
        }
    }
}

/// Requests on a keep-alive connection; a new connection only when the
/// gateway answered `Connection: close` (as a well-behaved client does).
async fn keepalive_client(addr: SocketAddr, tally: Arc<Tally>, stop: Arc<AtomicBool>, id: usize) {
    let mut n = 0;
    let mut sender: Option<hyper::client::conn::http1::SendRequest<Empty<Bytes>>> = None;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let r = tokio::time::timeout(Duration::from_secs(20), async {
            if sender.is_none() {
                let s = TcpStream::connect(addr)
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
                tokio::spawn(conn);
                sender = Some(tx);
            }
            let tx = sender.as_mut().unwrap();
            tx.ready()
                .await
                .map_err(|e| format!("connection not ready: {e}"))?;
            let req = http::Request::get(format!("/api/k{id}-{n}"))
                .header("host", "gg")
                .body(Empty::new())
                .unwrap();
            let resp = tx
                .send_request(req)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let close = resp
                .headers()
                .get("connection")
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("body: {e}"))?;
            if close {
                sender = None;
            }
            let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
            if status == 200 && text.contains("\"node\":\"f1\"") {
                Ok(())
            } else {
                Err(format!("unexpected answer {status} {text:?}"))
            }
        })
        .await;
        match r {
            Ok(Ok(())) => {
                tally.ok.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Err(e)) => {
                sender = None;
                tally.fail(format!("keep-alive {id}: {e}"));
            }
            Err(_) => {
                sender = None;
                tally.fail(format!("keep-alive {id}: no answer in 20 s"));
            }
        }
    }
}

type Ws = tokio_tungstenite::WebSocketStream<TcpStream>;

async fn ws_connect(addr: SocketAddr) -> Ws {
    let req = format!("ws://{addr}/ws/chat")
        .into_client_request()
        .unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (ws, resp) = tokio_tungstenite::client_async(req, tcp)
        .await
        .expect("upgrade through the gateway");
    assert_eq!(resp.status(), 101);
    ws
}

async fn ws_exchange(ws: &mut Ws, i: usize) {
    ws.send(Message::text(format!("m{i}"))).await.expect("send");
    let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("echo in time")
        .expect("stream open")
        .expect("valid frame");
    assert_eq!(m.into_text().unwrap().as_str(), format!("chat:m{i}"));
}

/// Waits until `tally` counts `more` successes beyond `from`.
async fn more_ok(tally: &Tally, from: usize, more: usize, what: &str) {
    eventually(what, Duration::from_secs(30), || async {
        tally.ok() >= from + more
    })
    .await;
}

fn pid_in(logs: &str, needle: &str, key: &str) -> Option<u32> {
    logs.lines()
        .find(|l| l.contains(needle))?
        .split_whitespace()
        .find_map(|t| t.strip_prefix(key))
        .and_then(|p| p.parse().ok())
}

struct Setup {
    fx: Fixture,
    cfg: PathBuf,
    _api: Backend,
}

async fn setup() -> Setup {
    let api = Backend::start("f1", "formal").await;
    let ws = ws_node().await;
    let fx = Fixture::new();
    Nodes::new()
        .service(Service::new("api").node(api.node()))
        .service(Service::new("chat").node(Node::new("ws1", ws)))
        .write(&fx, "nodes.yaml");
    let sock = fx.path("run/graygate.sock");
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    let cfg = Config::new()
        .set("workers", 2)
        .set("pid_file", "run/graygate.pid")
        .set("upgrade_socket", sock.display())
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/ws/", "chat"), Route::service("/", "api")])
        .raw("client:\n  drain_timeout_ms: 60000\n")
        .write(&fx, "gg.yaml");
    Setup { fx, cfg, _api: api }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binary_upgrade_under_load_loses_no_request_and_lets_the_websocket_finish() {
    let s = setup().await;
    let exe = s.fx.path("bin/graygate");
    install_binary(&exe);
    // systemd's notification socket (Type=notify, NotifyAccess=all): the
    // successor inherits it and must announce itself as the main process.
    let notify_path = s.fx.path("run/notify.sock");
    let notify = notify_socket(&notify_path);
    let mut cmd = Command::new(&exe);
    cmd.env("NOTIFY_SOCKET", &notify_path);
    let mut old = Gateway::start_cmd(cmd, &s.cfg, &[]);
    let (addr, admin) = (old.addr, old.admin.unwrap());
    let old_pid = old.pid();
    let mut buf = [0u8; 256];
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!("READY=1\nMAINPID={old_pid}")
    );
    let sockets = listening_inodes(addr.port());
    assert_eq!(sockets.len(), 2, "one listener per worker");
    let pid_file = s.fx.path("run/graygate.pid");
    soon("pid file written", || async {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.trim() == old_pid.to_string())
    })
    .await;

    // Continuous load: new connections and keep-alive connections.
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for id in 0..4 {
        clients.push(tokio::spawn(plain_client(
            addr,
            tally.clone(),
            stop.clone(),
            id,
        )));
        clients.push(tokio::spawn(keepalive_client(
            addr,
            tally.clone(),
            stop.clone(),
            id,
        )));
    }
    // A WebSocket conversation, begun on the old process.
    let mut ws = ws_connect(addr).await;
    let mut i = 0;
    while i < 3 {
        ws_exchange(&mut ws, i).await;
        i += 1;
    }
    more_ok(&tally, 0, 200, "load running on the old process").await;

    // A new release replaces the file; SIGUSR2 starts it.
    install_binary(&exe);
    old.signal("USR2");
    old.wait_log("binary upgrade done: stopped accepting").await;
    // The successor writes to the same stderr.
    old.wait_log("took over the listening sockets").await;
    let logs = old.logs();
    let new_pid = pid_in(&logs, "SIGUSR2; starting the new binary", "successor=")
        .expect("successor pid logged");
    let _reap = Orphan(new_pid);
    assert_ne!(new_pid, old_pid);
    assert!(
        logs.contains(&format!("pid={new_pid}"))
            && logs.contains("took over the listening sockets"),
        "{logs}"
    );

    // The old process drains: the WebSocket conversation goes on through it
    // and keeps the old process alive (drain time is 60 s).
    let upgraded_at = tally.ok();
    while i < 8 {
        ws_exchange(&mut ws, i).await;
        i += 1;
    }
    more_ok(&tally, upgraded_at, 200, "load running during the handover").await;
    assert!(
        old.wait_exit(Duration::from_millis(1)).await.is_none(),
        "the old process exited with a WebSocket tunnel open:\n{}",
        old.logs()
    );
    ws.close(None).await.expect("close handshake");
    while let Some(m) = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("close answered in time")
    {
        if m.is_err() {
            break;
        }
    }
    // The close handshake is done: the client closes its TCP connection.
    drop(ws);

    // With the tunnel gone, the old process exits by itself, 0.
    let status = old
        .wait_exit(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("old process did not exit:\n{}", old.logs()));
    assert!(status.success(), "{status:?}");
    old.wait_log("drained; exiting").await;

    // Only the new process serves now: on the very sockets the old one
    // listened on (its accept queue included), same admin listener.
    assert_eq!(
        listening_inodes(addr.port()),
        sockets,
        "the listening sockets were handed over"
    );
    let after_exit = tally.ok();
    more_ok(
        &tally,
        after_exit,
        200,
        "load served by the new process alone",
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        tokio::time::timeout(Duration::from_secs(30), c)
            .await
            .expect("client stops")
            .unwrap();
    }
    let failures = tally.failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failed of {} requests: {:#?}\n{}",
        failures.len(),
        tally.ok() + failures.len(),
        &failures[..failures.len().min(20)],
        old.logs()
    );
    let status = Req::get("/status").send(admin).await;
    assert_eq!(status.status, 200);
    let mut ws = ws_connect(addr).await;
    ws_exchange(&mut ws, 100).await;
    drop(ws);
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap().trim(),
        new_pid.to_string(),
        "the pid file names the new process"
    );
    assert!(alive(new_pid));
    // systemd heard of the new main process, and never of a stop.
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!("READY=1\nMAINPID={new_pid}")
    );
    notify.set_nonblocking(true).unwrap();
    assert!(
        notify.recv(&mut buf).is_err(),
        "nothing else was sent to systemd"
    );

    // The new process can be upgraded again (its own upgrade socket).
    let mut again = Gateway::start_cmd(Command::new(&exe), &s.cfg, &["--upgrade"]);
    assert_eq!(again.addr, addr);
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(new_pid) {
        assert!(
            Instant::now() < deadline,
            "second upgrade: the predecessor did not exit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(again.get("/api/x").await.status, 200);
    let _ = again.stop_and_read_stdout().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_that_fails_leaves_the_running_process_serving() {
    let s = setup().await;
    let mut old = Gateway::start(&s.cfg);
    let addr = old.addr;
    assert_eq!(old.get("/api/x").await.status, 200);

    // A broken new configuration: rejected before the old process is
    // even contacted.
    let broken = s.fx.write("broken.yaml", "listen: [not an address\n");
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["--upgrade", "--upgrade-socket"])
        .arg(s.fx.path("run/graygate.sock"))
        .arg("--config")
        .arg(&broken)
        .output()
        .unwrap();
    assert!(!out.status.success());

    // A successor that takes the sockets and then cannot start (its demo
    // node's address is taken): the old process keeps serving.
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let text = std::fs::read_to_string(&s.cfg).unwrap();
    let bad = s.fx.write(
        "bad.yaml",
        &format!(
            "{text}demo_nodes:\n  - {{ name: d, addr: \"{}\", lane: formal }}\n",
            taken.local_addr().unwrap()
        ),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["--upgrade", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    old.wait_log("binary upgrade aborted; this process keeps serving")
        .await;
    assert_eq!(old.get("/api/x").await.status, 200);
    assert!(old.wait_exit(Duration::from_millis(1)).await.is_none());

    // No running process to take over from: a clear error.
    let lonely = Config::new()
        .set("upgrade_socket", s.fx.path("run/nobody.sock").display())
        .write(&s.fx, "lonely.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["--upgrade", "--config"])
        .arg(&lonely)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no running graygate answers"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `graygate --upgrade` itself, on the good config, takes over.
    let mut new = Gateway::start_cmd(
        Command::new(env!("CARGO_BIN_EXE_graygate")),
        &s.cfg,
        &["--upgrade"],
    );
    assert_eq!(new.addr, addr);
    let status = old
        .wait_exit(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("old process did not exit:\n{}", old.logs()));
    assert!(status.success());
    assert_eq!(new.get("/api/x").await.status, 200);
    let _ = new.stop_and_read_stdout().await;
}
