//! Client-side resilience through the real binary: slowloris and idle
//! timeouts, 414/431/400, the connection cap, hostile lane names and static
//! paths, and graceful shutdown.

use std::sync::Arc;
use std::time::Duration;

use crate::harness::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn setup_with(fx: &Fixture, nodes: &[&Backend], script: &str, main_extra: &str) -> Gateway {
    fx.write("lane.lua", script);
    fx.api_nodes(nodes);
    let cfg = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(main_extra)
        .write(fx, "gg.yaml");
    Gateway::start(&cfg)
}

/// One formal node `f1` behind a gateway whose lane is the `X-Lane`
/// header, with `main_extra` in its main file.
async fn one_node(main_extra: &str) -> (Backend, Fixture, Gateway) {
    let f1 = Backend::full("f1", "formal").await;
    let fx = Fixture::new();
    let gw = setup_with(&fx, &[&f1], HEADER_SCRIPT, main_extra);
    (f1, fx, gw)
}

const HEADER_SCRIPT: &str = "return function(req) return req:header('X-Lane') end\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_head_is_cut_off_by_the_header_timeout() {
    let (f1, _fx, gw) =
        one_node("client:\n  header_timeout_ms: 300\n  idle_timeout_ms: 60000\n").await;
    let mut s = connect_with(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\nX-Slow: 1").await;
    // The head never completes: the gateway closes the connection.
    let text = read_to_close(&mut s).await;
    assert!(!text.contains("200"), "{text}");
    assert_eq!(f1.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keepalive_connections_are_closed() {
    let (_f1, _fx, gw) =
        one_node("client:\n  header_timeout_ms: 60000\n  idle_timeout_ms: 300\n").await;
    let mut s = connect_with(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    // One answer, then the idle connection is closed by the gateway.
    let text = read_to_close(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_shortens_the_idle_timeout_closes_idle_connections() {
    // An idle connection waits on the accept loop's tick that reaches its
    // deadline (`server::wheel`); a new configuration moves deadlines, so
    // every idle connection looks again. Ticks here are a second apart and
    // the wheel's lap a minute: without that look, the connection below
    // would stay open for its old minute.
    let before = "client:\n  idle_timeout_ms: 60000\n  drain_idle_ms: 600000\n";
    let (_f1, fx, gw) = one_node(before).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    assert!(one_answer(&mut s).await.starts_with("HTTP/1.1 200"));
    let gen0 = gw.generation().await;
    let cfg = std::fs::read_to_string(fx.path("gg.yaml")).unwrap();
    fx.write(
        "gg.yaml",
        &cfg.replace("idle_timeout_ms: 60000", "idle_timeout_ms: 300"),
    );
    gw.wait_generation(gen0).await;
    let closed = tokio::time::timeout(Duration::from_secs(10), read_to_close(&mut s)).await;
    assert_eq!(closed.expect("still open 10 s after the reload"), "");
}

/// Sends one GET on `s` and reads its answer (one read, bounded).
async fn one_answer(s: &mut TcpStream) -> String {
    s.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keepalive_connection_sleeps_between_ticks() {
    // The idle timeout is checked on the accept loop's tick, whose wake-up
    // each connection keeps registered across requests and renews once it
    // has fired. A fired wake-up left unrenewed would be ready forever: the
    // worker would spin on the idle connection instead of sleeping. With
    // `drain_idle_ms: 40` the tick is every 10 ms, so the second below
    // passes ~100 of them.
    let (f1, _fx, gw) =
        one_node("workers: 1\nclient:\n  idle_timeout_ms: 60000\n  drain_idle_ms: 40\n").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let text = one_answer(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // The connection idles (after a served request, as between a client's
    // requests) across ~100 ticks.
    let before = cpu_secs(gw.pid());
    let window = Duration::from_secs(1);
    tokio::time::sleep(window).await;
    let spent = Duration::from_secs_f64(cpu_secs(gw.pid()) - before);
    assert!(
        spent < window / 4,
        "the gateway used {spent:?} of CPU in {window:?} with one idle connection"
    );
    let text = one_answer(&mut s).await;
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "after the idle second: {text}"
    );
    assert_eq!(f1.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_requests_get_4xx() {
    let (f1, _fx, gw) =
        one_node("client:\n  max_uri_bytes: 1024\n  max_header_bytes: 2048\n").await;
    let long_path = format!("/{}", "a".repeat(1500));
    let r = Req::get(&long_path).send(gw.addr).await;
    assert_eq!(r.status, 414);
    assert_eq!(r.text(), "request target too long\n");
    let r = Req::get("/x")
        .header("X-Big", &"b".repeat(3000))
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 431);
    assert_eq!(r.text(), "request headers too large\n");
    // Far beyond the read buffer: hyper refuses it before parsing completes.
    let huge = format!(
        "GET /x HTTP/1.1\r\nHost: a\r\nX-Huge: {}\r\n\r\n",
        "c".repeat(64 * 1024)
    );
    let text = exchange_raw(gw.addr, huge.as_bytes()).await;
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /x HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"GET /x HTTP/1.1\r\nHost: a\r\nX: \x01\r\n\r\n",
    ] {
        let text = exchange_raw(gw.addr, bad).await;
        assert!(
            text.starts_with("HTTP/1.1 400"),
            "{:?} → {text}",
            String::from_utf8_lossy(bad)
        );
    }
    assert_eq!(f1.count(), 0, "nothing malformed reached a node");
    // The gateway still serves.
    assert_eq!(gw.get("/x").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_refuses_extra_connections() {
    let (_f1, _fx, gw) = one_node("client:\n  max_connections: 3\n").await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        // A full request proves each connection is being served.
        s.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        held.push(s);
    }
    let text = exchange_raw(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.ends_with("too many connections\n"), "{text}");
    // Closing one frees a slot.
    held.pop();
    soon("a slot frees up", || async {
        let text = exchange_raw(
            gw.addr,
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
        .await;
        text.starts_with("HTTP/1.1 200")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_lane_names_never_reach_a_header() {
    let [f1, g1] = full_backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    // The script passes through whatever the client sends, with CR/LF.
    let script = "return function(req)\n  local l = req:header('X-Lane')\n  if l == 'crlf' then return 'gray\\r\\nX-Evil: 1' end\n  if l == 'nul' then return 'gray\\0' end\n  if l == 'space' then return 'gray lane' end\n  return l\nend\n";
    let gw = setup_with(
        &fx,
        &[&f1, &g1],
        script,
        "trusted_proxies: [127.0.0.1/32]\n",
    );
    for l in ["crlf", "nul", "space", "gray/../x", "ünïcode"] {
        let r = Req::get("/x").header("X-Lane", l).send(gw.addr).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.node(), "f1", "{l}");
        assert_eq!(r.json()["tag"], "formal");
    }
    // A trusted proxy's tag with bytes outside the lane alphabet: formal
    // too, and the tag the node receives is formal, not the bad name.
    for bad in ["gray;x", "gray x", "gray,gray", "gray\"x"] {
        let r = Req::get("/x").header("X-Gray-Tag", bad).send(gw.addr).await;
        assert_eq!(r.node(), "f1", "{bad}");
        assert_eq!(r.json()["tag"], "formal", "{bad}");
        assert_eq!(
            f1.seen.lock().unwrap().last().unwrap().tag.as_deref(),
            Some("formal")
        );
    }
    // The same proxy's valid tag is honoured, so the formal above is the
    // validation's doing.
    let r = Req::get("/x")
        .header("X-Gray-Tag", "gray")
        .send(gw.addr)
        .await;
    assert_eq!(
        (r.node(), r.json()["tag"].clone()),
        ("g1".to_string(), "gray".into())
    );
    assert_eq!(g1.count(), 1);
    gw.wait_log("script returned an invalid lane name; using formal")
        .await;
    assert!(!gw.logs().contains("\nX-Evil"), "raw CR/LF reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_traversal_variants_are_404() {
    let fx = Fixture::new();
    fx.write("site/formal/index.html", "formal index");
    fx.write("site/gray/app.js", "gray js");
    fx.write("secret.txt", "top secret");
    let gw = Config::new()
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    assert_eq!(gw.get("/").await.text(), "formal index");
    for p in [
        "/%2e%2e/secret.txt",
        "/%2E%2E/secret.txt",
        "/..%2fsecret.txt",
        "/%2e%2e%2fsecret.txt",
        "/%252e%252e/secret.txt",
        "/%252e%252e%252fsecret.txt",
        "/..%5csecret.txt",
        "/..%255csecret.txt",
        "/formal%00/index.html",
        "/index.html%00.js",
        "/%c0%ae%c0%ae/secret.txt",
        "/../gray/app.js",
    ] {
        let r = gw.get(p).await;
        assert_eq!(r.status, 404, "{p}: {}", r.text());
        assert!(!r.text().contains("secret"), "{p}");
    }
    // Backslashes and a literal `..` on the wire.
    for p in ["/..\\secret.txt", "/a/../../secret.txt"] {
        let text = exchange_raw(
            gw.addr,
            format!("GET {p} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 404"), "{p}: {text}");
        assert!(!text.contains("top secret"), "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let slow = Backend::start_mode("slow", "formal", Mode::Gated(gate.clone())).await;
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    fx.api_nodes(&[&slow]);
    let mut gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("client:\n  drain_timeout_ms: 30000\n")
        .start(&fx, "gg.yaml");
    let addr = gw.addr;
    // An in-flight request: headers and the first chunk arrive, the rest
    // waits on the gate.
    let resp = Req::get("/slow").send_streaming(addr).await;
    assert_eq!(resp.status(), 200);
    // An idle connection, too: closed on shutdown once idle for
    // `drain_idle_ms` (1 s by default).
    let mut idle = TcpStream::connect(addr).await.unwrap();
    gw.signal("TERM");
    soon("listener closed", || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert_eq!(read_to_close(&mut idle).await, "", "idle connection closed");
    assert!(gw.running().await, "exited before draining");
    gate.notify_one();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("in-flight body completes")
        .to_bytes();
    assert_eq!(&body[..], b"first;rest");
    gw.exits_cleanly("graygate did not exit", "drained; exiting")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_time_bounds_the_shutdown() {
    let hang = Backend::start_mode("hang", "formal", Mode::Hang).await;
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    fx.api_nodes(&[&hang]);
    let mut gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("client:\n  drain_timeout_ms: 300\n")
        .start(&fx, "gg.yaml");
    let addr = gw.addr;
    let pending = tokio::spawn(async move { Req::get("/hang").send_streaming(addr).await });
    soon("request reached the node", || async { hang.count() == 1 }).await;
    // SIGTERM: the graceful stop whose drain is bounded (SIGINT is a fast
    // stop since binary upgrades came, as in nginx; see the `signals` module).
    gw.signal("TERM");
    let signalled = std::time::Instant::now();
    // The request never ends: only the configured 300 ms drain bound lets
    // the process exit this early (the default bound is 15 s).
    let status = gw
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| {
            panic!(
                "graygate still running {:?} after SIGTERM with drain_timeout_ms 300",
                signalled.elapsed()
            )
        });
    assert!(status.success(), "{status:?}");
    gw.wait_log("drain time over").await;
    pending.abort();
}
