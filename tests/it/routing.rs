//! Lane isolation, propagation and proxying through the real binary.

use std::time::Duration;

use crate::harness::*;

/// Script: lane from the `X-Lane` header, else formal.
const HEADER_SCRIPT: &str = "return function(req) return req:header('X-Lane') end\n";

struct Setup {
    _fx: Fixture,
    gw: Gateway,
}

fn setup(nodes: impl IntoIterator<Item = Node>, extra: &str) -> Setup {
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    fx.write("ips.txt", "127.0.9.0/24\n");
    Nodes::api(nodes).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .raw("lists:\n  gray_ips: ips.txt\n")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .start(&fx, "gg.yaml");
    Setup { _fx: fx, gw }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lane_reaches_only_its_own_nodes() {
    let [f1, f2, g1, v1] = backends([
        ("f1", "formal"),
        ("f2", "formal"),
        ("g1", "gray"),
        ("v1", "v2"),
    ])
    .await;
    let s = setup(nodes_of([&f1, &f2, &g1, &v1]), "");
    for _ in 0..10 {
        let r = s.gw.get("/x").await;
        assert_eq!(r.status, 200);
        assert!(["f1", "f2"].contains(&r.node().as_str()), "{}", r.text());
        assert_eq!(r.json()["tag"], "formal");
    }
    for _ in 0..5 {
        let r = Req::get("/x")
            .header("X-Lane", "gray")
            .send(s.gw.addr)
            .await;
        assert_eq!(r.node(), "g1");
        assert_eq!(r.json()["tag"], "gray");
        let r = Req::get("/x").header("X-Lane", "v2").send(s.gw.addr).await;
        assert_eq!(r.node(), "v1");
    }
    // Equal weights alternate.
    assert_eq!(f1.count(), 5);
    assert_eq!(f2.count(), 5);
    // Gray nodes only ever saw their own lane.
    assert!(g1.tags().iter().all(|t| t.as_deref() == Some("gray")));
    assert!(v1.tags().iter().all(|t| t.as_deref() == Some("v2")));
    assert!(f1.tags().iter().all(|t| t.as_deref() == Some("formal")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_without_nodes_falls_back_to_formal_never_other_gray() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup(nodes_of([&f1, &g1]), "");
    for _ in 0..4 {
        let r = Req::get("/x")
            .header("X-Lane", "gray-b")
            .send(s.gw.addr)
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.node(), "f1");
        // The lane still travels upstream: services behind keep it.
        assert_eq!(r.json()["tag"], "gray-b");
    }
    assert_eq!(g1.count(), 0);
    s.gw.wait_log("no node serves this lane").await;
    let logs = s.gw.logs();
    let warn = logs
        .lines()
        .find(|l| l.contains("WARN") && l.contains("no node serves this lane"))
        .unwrap_or_else(|| panic!("no fallback WARN in:\n{logs}"));
    assert!(warn.contains("service=\"api\""), "{warn}");
    assert!(warn.contains("lane=gray-b"), "{warn}");
    assert!(warn.contains("formal_nodes=1"), "{warn}");
    assert!(warn.contains("lane_nodes=0"), "{warn}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smooth_weighted_round_robin_within_a_lane() {
    let [a, b] = backends([("a", "formal"), ("b", "formal")]).await;
    let nodes = [
        Node::new("a", a.addr).with("weight", "3"),
        Node::new("b", b.addr).with("weight", "1"),
    ];
    let s = setup(nodes, "");
    let mut seq = String::new();
    for _ in 0..8 {
        seq.push_str(&s.gw.get("/").await.node());
    }
    // nginx's smooth WRR for 3:1 interleaves: a a b a, a a b a.
    assert_eq!(seq, "aabaaaba");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_candidate_is_a_503_with_a_short_body() {
    let g1 = Backend::start("g1", "gray").await;
    let s = setup([g1.node()], "");
    let r = s.gw.get("/x").await;
    assert_eq!(r.status, 503);
    assert!(r.text().len() < 100 && !r.text().is_empty());
    // Gray traffic still reaches the gray node; no gray node takes formal.
    let r = Req::get("/x")
        .header("X-Lane", "gray")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "g1");
    assert_eq!(g1.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_list_decides_by_the_real_source_address() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("ips.txt", "127.0.9.0/24\n");
    fx.write(
        "lane.lua",
        "return function(req) if graygate.in_list('gray_ips', req.ip) then return 'gray' end end\n",
    );
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .script("lane.lua")
        .raw("lists: { gray_ips: ips.txt }\n")
        .node_files(&["nodes.yaml"])
        .raw("trusted_proxies: [127.0.0.2/32]\n")
        .route_all("api")
        .start(&fx, "gg.yaml");
    let r = Req::get("/").from_ip("127.0.9.5").send(gw.addr).await;
    assert_eq!(r.node(), "g1");
    let r = Req::get("/").from_ip("127.0.10.5").send(gw.addr).await;
    assert_eq!(r.node(), "f1");
    // A spoofed X-Forwarded-For from an untrusted peer is ignored...
    let r = Req::get("/")
        .from_ip("127.0.10.5")
        .header("X-Forwarded-For", "127.0.9.9")
        .send(gw.addr)
        .await;
    assert_eq!(r.node(), "f1");
    assert_eq!(
        f1.last().header("x-forwarded-for").as_deref(),
        Some("127.0.10.5")
    );
    // ...but believed from a trusted proxy.
    let r = Req::get("/")
        .from_ip("127.0.0.2")
        .header("X-Forwarded-For", "127.0.9.9")
        .send(gw.addr)
        .await;
    assert_eq!(r.node(), "g1");
    assert_eq!(
        g1.last().header("x-forwarded-for").as_deref(),
        Some("127.0.9.9, 127.0.0.2")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_header_replaced_from_clients_honoured_from_trusted_proxies() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup(nodes_of([&f1, &g1]), "trusted_proxies: [127.0.0.3/32]\n");
    // An untrusted client cannot pick its lane with the tag header.
    let r = Req::get("/")
        .from_ip("127.0.0.1")
        .header("X-Gray-Tag", "gray")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "f1");
    assert_eq!(r.json()["tag"], "formal");
    // A gateway deeper in the chain keeps the lane decided at the edge,
    // even where its own script would say otherwise.
    let r = Req::get("/")
        .from_ip("127.0.0.3")
        .header("X-Gray-Tag", "gray")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "g1");
    assert_eq!(r.json()["tag"], "gray");
    // An invalid tag from a trusted proxy never reaches a header: formal.
    let r = Req::get("/")
        .from_ip("127.0.0.3")
        .header("X-Gray-Tag", "gray a")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "f1");
    assert_eq!(r.json()["tag"], "formal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_rewritten_for_the_upstream() {
    let f1 = Backend::start("f1", "formal").await;
    let s = setup([f1.node()], "");
    let r = Req::get("/p?q=1")
        .header("Host", "shop.example:8443")
        .header("Connection", "keep-alive, X-Private")
        .header("X-Private", "secret")
        .header("Keep-Alive", "timeout=5")
        .header("TE", "trailers")
        .header("Proxy-Authorization", "Basic eA==")
        .header("X-Keep", "yes")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.status, 200);
    let seen = f1.last();
    assert_eq!(seen.path, "/p");
    assert_eq!(seen.header("host").as_deref(), Some("shop.example:8443"));
    assert_eq!(
        seen.header("x-forwarded-host").as_deref(),
        Some("shop.example:8443")
    );
    assert_eq!(seen.header("x-forwarded-proto").as_deref(), Some("http"));
    assert_eq!(seen.header("x-forwarded-for").as_deref(), Some("127.0.0.1"));
    assert_eq!(seen.header("x-keep").as_deref(), Some("yes"));
    for gone in ["x-private", "keep-alive", "te", "proxy-authorization"] {
        assert_eq!(seen.header(gone), None, "{gone} was forwarded");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_pooled() {
    let f1 = Backend::start("f1", "formal").await;
    // Pools are per worker thread: at most one connection per worker.
    let s = setup([f1.node()], "workers: 2\n");
    for _ in 0..20 {
        assert_eq!(s.gw.get("/").await.status, 200);
    }
    assert_eq!(f1.count(), 20);
    let conns = f1.connections.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=2).contains(&conns),
        "20 sequential requests opened {conns} upstream connections"
    );
    // One worker: exactly one connection, reused.
    let f2 = Backend::start("f2", "formal").await;
    let s1 = setup([f2.node()], "workers: 1\n");
    for _ in 0..10 {
        assert_eq!(s1.gw.get("/").await.status, 200);
    }
    assert_eq!(f2.connections.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_closing_its_connections_loses_no_request() {
    let c = Backend::start_mode("c", "formal", Mode::JsonClose).await;
    let s = setup([c.node()], "workers: 1\n");
    for _ in 0..30 {
        let r = s.gw.get("/").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(c.connections.load(std::sync::atomic::Ordering::SeqCst), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stream_both_ways() {
    use http_body_util::BodyExt;
    // Request body: 8 MiB echoed back intact.
    let echo = Backend::start_mode("e", "formal", Mode::Echo).await;
    let s = setup([echo.node()], "");
    let big: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let r = Req::get("/upload")
        .method("POST")
        .body(big.clone())
        .send(s.gw.addr)
        .await;
    assert_eq!(r.status, 200);
    assert!(r.body == big, "echoed body differs");

    // Response body: the first chunk reaches the client while the upstream
    // is still holding back the rest.
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let gated = Backend::start_mode("g", "formal", Mode::Gated(gate.clone())).await;
    let s2 = setup([gated.node()], "");
    let resp = Req::get("/stream").send_streaming(s2.gw.addr).await;
    let mut body = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("first chunk arrived before the upstream finished")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "first;");
    gate.notify_one();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "rest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_error_is_502_and_timeout_is_504() {
    let dead = closed_port();
    let hang = Backend::start_mode("h", "gray", Mode::Hang).await;
    let s = setup(
        [Node::new("dead", dead), hang.node()],
        "upstream: { response_timeout_ms: 300 }\n",
    );
    let r = s.gw.get("/").await;
    assert_eq!(r.status, 502);
    assert_eq!(r.text(), "upstream connect error\n");
    let r = Req::get("/").header("X-Lane", "gray").send(s.gw.addr).await;
    assert_eq!(r.status, 504);
    assert_eq!(r.text(), "upstream timed out\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_script_sends_the_request_formal_and_logs() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write(
        "lane.lua",
        "return function(req)\n  if req:header('X-Boom') then\n    error('kaboom')\n  end\n  if req:header('X-Bad') then return 'gray\\r\\nX-Evil: 1' end\n  return 'gray'\nend\n",
    );
    let gw = fx.start_scripted(&[&f1, &g1]);
    assert_eq!(gw.get("/").await.node(), "g1");
    let r = Req::get("/").header("X-Boom", "1").send(gw.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.node(), "f1");
    let r = Req::get("/").header("X-Bad", "1").send(gw.addr).await;
    assert_eq!(r.node(), "f1");
    assert_eq!(f1.last().header("x-evil"), None);
    gw.wait_log_line("script error with file:line", |l| {
        l.contains("ERROR") && l.contains("lane.lua:3") && l.contains("kaboom")
    })
    .await;
    // A script failing on every request does not flood the log: at most
    // one line a second, so a burst gives at most one line per second
    // mark it straddles, however long it takes.
    let burst = std::time::Instant::now();
    for _ in 0..30 {
        let r = Req::get("/").header("X-Boom", "1").send(gw.addr).await;
        assert_eq!(r.node(), "f1");
    }
    // Everything the burst logged is in once a later line is: the request
    // below logs nothing of its own, so wait on a reload's line instead.
    let took = burst.elapsed().as_secs() as usize;
    gw.signal("HUP");
    gw.wait_log("SIGHUP").await;
    let lines = gw
        .logs()
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("kaboom"))
        .count();
    // The first line, plus one per second mark the burst straddled.
    assert!(
        (1..=took + 3).contains(&lines),
        "{lines} error lines for 31 failures in {took} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_route_is_404() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/api/", "api"),
            Route::service("/", "api").host("admin.example"),
        ])
        .start(&fx, "gg.yaml");
    assert_eq!(gw.get("/other").await.status, 404);
    assert_eq!(gw.get("/api/x").await.status, 200);
    let r = Req::get("/other")
        .header("Host", "ADMIN.example:80")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_hashed_node_keeps_the_survivors_keys() {
    // Gray nodes hashed on a cookie, unnamed in the node file (their default
    // names carry their position, which shifts when one goes).
    let [f1, h1, h2, h3] = backends([
        ("f1", "formal"),
        ("h1", "gray"),
        ("h2", "gray"),
        ("h3", "gray"),
    ])
    .await;
    let nodes = |bs: &[&Backend]| {
        let api = Service::new("api")
            .raw("    balance: hash\n    hash_key: cookie:uid\n")
            .nodes(bs.iter().map(|b| Node::at(b.addr).lane(&b.lane)));
        Nodes::new().service(api)
    };
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    nodes(&[&f1, &h1, &h2, &h3]).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let users: Vec<String> = (0..150).map(|u| format!("user-{u}")).collect();
    let addr = gw.addr;
    let node_of = |uid: &str| {
        let req = Req::get("/x")
            .header("X-Lane", "gray")
            .header("Cookie", &format!("theme=dark; uid={uid}"));
        async move {
            let r = req.send(addr).await;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.json()["tag"], "gray");
            r.node()
        }
    };
    let mut before = Vec::new();
    for u in &users {
        before.push(node_of(u).await);
    }
    let spread: std::collections::BTreeSet<&str> = before.iter().map(String::as_str).collect();
    assert_eq!(spread.len(), 3, "keys spread over every gray node");
    // The first gray node leaves: the others' positions (and default
    // names) shift, their addresses do not.
    let gen = gw.generation().await;
    fx.write_rename("nodes.yaml", &nodes(&[&f1, &h2, &h3]).to_yaml());
    gw.wait_generation(gen).await;
    let (mut moved, mut survivors_keys) = (Vec::new(), 0);
    for (u, was) in users.iter().zip(&before) {
        let now = node_of(u).await;
        assert_ne!(now, "h1");
        if was != "h1" {
            survivors_keys += 1;
            if &now != was {
                moved.push(format!("{u}: {was} -> {now}"));
            }
        }
    }
    // Not one survivor's key moves; nodes identified by position or
    // default name move about 3 in 4.
    assert!(
        moved.is_empty(),
        "{} of the survivors' {survivors_keys} keys moved: {moved:?}",
        moved.len()
    );
    assert_eq!(f1.count(), 0, "gray keys never go formal");
}
