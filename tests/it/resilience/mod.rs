//! Health checks, same-lane retries and timeouts through the real binary.

mod client;
mod mid_request;
mod reload;
mod sticky;
mod ws;

use std::time::Duration;

use crate::harness::*;

const HEADER_SCRIPT: &str = "return function(req) return req:header('X-Lane') end\n";

struct Setup {
    fx: Fixture,
    gw: Gateway,
}

/// `service_extra` goes under `services: api:` (e.g. health, strict);
/// `main_extra` is appended to the main file.
fn nodes_file(service_extra: &str, nodes: &[&Backend]) -> String {
    api_file(service_extra, nodes_of(nodes.iter().copied()))
}

/// Service `api` with `service_extra` keys and these nodes.
fn api_file(service_extra: &str, nodes: impl IntoIterator<Item = Node>) -> String {
    let api = Service::new("api").raw(service_extra);
    Nodes::new().service(api.nodes(nodes)).to_yaml()
}

/// Passive health that never ejects (a test's dead node stays listed).
const NO_EJECTION: &str = "    health:\n      passive: { max_fails: 1000 }\n";

fn setup(service_extra: &str, nodes: &[&Backend]) -> Setup {
    setup_main(service_extra, nodes, "")
}

fn setup_main(service_extra: &str, nodes: &[&Backend], main_extra: &str) -> Setup {
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    fx.write("nodes.yaml", &nodes_file(service_extra, nodes));
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(main_extra)
        .start(&fx, "gg.yaml");
    Setup { fx, gw }
}

async fn get_lane(gw: &Gateway, lane: &str) -> Resp {
    let mut r = Req::get("/x");
    if !lane.is_empty() {
        r = r.header("X-Lane", lane);
    }
    r.send(gw.addr).await
}

/// Formal nodes f1 and f2, no retries, passive health ejecting after
/// `max_fails` failures for `cooldown_ms`.
async fn ejectable_pair(max_fails: u32, cooldown_ms: u64) -> ([Backend; 2], Setup) {
    let pair = full_backends([("f1", "formal"), ("f2", "formal")]).await;
    let keys = format!(
        "    retries: 0\n    health:\n      passive: {{ max_fails: {max_fails}, cooldown_ms: {cooldown_ms} }}\n"
    );
    let s = setup(&keys, &[&pair[0], &pair[1]]);
    (pair, s)
}

/// Asserts that a request for `lane` is answered 200 by `node`, with `tag`
/// as its lane tag when one is given.
async fn served_by(gw: &Gateway, lane: &str, node: &str, tag: Option<&str>) {
    let r = get_lane(gw, lane).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.node(), node);
    if let Some(tag) = tag {
        assert_eq!(r.json()["tag"], tag);
    }
}

/// `graygate_lane_fallbacks_total` of `lane` for `reason`.
async fn fallbacks(gw: &Gateway, lane: &str, reason: &str) -> Option<f64> {
    gw.metric(&format!(
        "graygate_lane_fallbacks_total{{lane=\"{lane}\",reason=\"{reason}\"}}"
    ))
    .await
}

fn log_has(gw: &Gateway, needle: &str) -> bool {
    gw.logs().contains(needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_ejection_then_trial_readmission() {
    let ([_f1, f2], s) = ejectable_pair(2, 1500).await;
    f2.set_status(500);
    // f2 answers 500 until it has failed twice in a row: then it is ejected
    // and every request goes to f1.
    soon("f2 ejected", || async {
        let mut all_f1 = true;
        for _ in 0..6 {
            let r = get_lane(&s.gw, "").await;
            all_f1 &= r.status == 200 && r.node() == "f1";
        }
        all_f1
    })
    .await;
    // Exactly max_fails requests reached f2 before it was ejected: any
    // later one is a trial, a whole cool-down after the ejection (however
    // slowly the requests above ran).
    let at: Vec<std::time::Instant> = f2.seen.lock().unwrap().iter().map(|g| g.at).collect();
    assert!(at.len() >= 2);
    for later in &at[2..] {
        assert!(
            *later - at[1] >= Duration::from_millis(1500),
            "f2 got a request {:?} after its ejection",
            *later - at[1]
        );
    }
    s.gw.wait_log("node ejected after consecutive failures")
        .await;
    // Healed: after the cool-down a trial request reaches f2 and re-admits it.
    f2.set_status(200);
    soon("f2 re-admitted", || async {
        get_lane(&s.gw, "").await.node() == "f2"
    })
    .await;
    eventually("re-admission logged", Duration::from_secs(5), || async {
        log_has(&s.gw, "node passed its trial request; re-admitted")
    })
    .await;
    // Back in rotation: both nodes serve again.
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        seen.insert(get_lane(&s.gw, "").await.node());
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_trial_ejects_again() {
    let ([_f1, f2], s) = ejectable_pair(1, 300).await;
    f2.set_status(503);
    soon("f2 failed twice (ejection, failed trial)", || async {
        get_lane(&s.gw, "").await;
        f2.count() >= 2
    })
    .await;
    eventually("re-ejection logged", Duration::from_secs(5), || async {
        log_has(&s.gw, "node failed its trial request; ejected again")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_gray_lane_goes_formal_never_other_gray_and_recovers() {
    let [f1, g1, g2, v1] = full_backends([
        ("f1", "formal"),
        ("g1", "gray"),
        ("g2", "gray"),
        ("v1", "v2"),
    ])
    .await;
    let s = setup("    health:\n      active: { path: /health, interval_ms: 40, timeout_ms: 500, healthy: 1, unhealthy: 2 }\n", &[&f1, &g1, &g2, &v1]);
    // One gray node down: the other gray node takes all gray traffic.
    g1.set_health(503);
    soon("g1 marked down", || async {
        log_has(&s.gw, "active health check: node unhealthy")
    })
    .await;
    for _ in 0..6 {
        let r = get_lane(&s.gw, "gray").await;
        assert_eq!(r.node(), "g2");
    }
    // Whole lane down: gray traffic goes formal (tag still says gray),
    // never to the other gray lane v2.
    g2.set_health(500);
    soon("gray lane falls back to formal", || async {
        get_lane(&s.gw, "gray").await.node() == "f1"
    })
    .await;
    for _ in 0..6 {
        let r = get_lane(&s.gw, "gray").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.node(), "f1");
        assert_eq!(r.json()["tag"], "gray");
    }
    assert_eq!(v1.count(), 0, "another gray lane never serves gray");
    eventually("fallback WARN", Duration::from_secs(5), || async {
        let logs = s.gw.logs();
        logs.lines().any(|l| {
            l.contains("WARN")
                && l.contains("every node of this lane is down; sending to formal")
                && l.contains("lane=gray")
        })
    })
    .await;
    // Healthy again: gray comes home.
    g1.set_health(200);
    soon("gray back on g1", || async {
        get_lane(&s.gw, "gray").await.node() == "g1"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_service_answers_503_when_its_lane_is_down() {
    let [f1, g1] = full_backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup("    strict: true\n    health:\n      active: { path: /health, interval_ms: 40, timeout_ms: 500, healthy: 1, unhealthy: 1 }\n", &[&f1, &g1]);
    g1.set_health(503);
    soon("strict 503", || async {
        get_lane(&s.gw, "gray").await.status == 503
    })
    .await;
    let r = get_lane(&s.gw, "gray").await;
    assert_eq!(r.status, 503);
    assert!(
        r.text().contains("no healthy upstream node"),
        "{}",
        r.text()
    );
    assert_eq!(f1.count(), 0, "strict never sends gray traffic to formal");
    // Formal traffic is unaffected.
    assert_eq!(get_lane(&s.gw, "").await.node(), "f1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_checkers_follow_reloads() {
    let [f1, g1, g2] = full_backends([("f1", "formal"), ("g1", "gray"), ("g2", "gray")]).await;
    let health = "    health:\n      active: { path: /health, interval_ms: 30, timeout_ms: 500 }\n";
    let s = setup(health, &[&f1, &g1]);
    soon("g1 probed", || async { g1.health_hits() >= 2 }).await;
    assert_eq!(g2.health_hits(), 0);
    // Reload: g1 removed, g2 added.
    s.fx.write_rename("nodes.yaml", &nodes_file(health, &[&f1, &g2]));
    soon("g2 probed", || async { g2.health_hits() >= 2 }).await;
    s.gw.wait_log("health checker stopped").await;
    // g1's checker is gone: while f1 gets several more probes, g1 gets at
    // most one that was already under way.
    let (g1_then, f1_then) = (g1.health_hits(), f1.health_hits());
    soon("f1 probed 4 more times", || async {
        f1.health_hits() >= f1_then + 4
    })
    .await;
    assert!(g1.health_hits() <= g1_then + 1, "g1 still probed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_retry_on_the_same_lane_even_for_post() {
    let [f1, g2, v1] = full_backends([("f1", "formal"), ("g2", "gray"), ("v1", "v2")]).await;
    let dead = closed_port();
    let dead = Node::new("g-dead", dead).lane("gray");
    let nodes = api_file(NO_EJECTION, [dead, g2.node(), f1.node(), v1.node()]);
    let s = setup("", &[]);
    s.fx.write_rename("nodes.yaml", &nodes);
    s.gw.wait_generation(1).await;
    for i in 0..6 {
        let body = format!("payload-{i}");
        let r = Req::get("/x")
            .method("POST")
            .header("X-Lane", "gray")
            .body(body.clone())
            .send(s.gw.addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.node(), "g2");
        assert_eq!(r.json()["body"], body.as_str(), "body intact after retry");
    }
    assert_eq!(g2.count(), 6);
    assert_eq!(f1.count() + v1.count(), 0, "retries never leave the lane");
    s.gw.wait_log("retrying on another node of the same lane")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_requests_retry_after_no_response_post_does_not() {
    let [a, b, f1, v1] =
        full_backends([("a", "gray"), ("b", "gray"), ("f1", "formal"), ("v1", "v2")]).await;
    let s = setup(
        "    health:\n      passive: { max_fails: 1000 }\n",
        &[&a, &b, &f1, &v1],
    );
    a.set_mode(Mode::Drop);
    // GET and PUT (idempotent): whichever node is tried first, the answer
    // comes from b.
    for m in ["GET", "PUT", "DELETE"] {
        for _ in 0..2 {
            let r = Req::get("/x")
                .method(m)
                .header("X-Lane", "gray")
                .body("idem")
                .send(s.gw.addr)
                .await;
            assert_eq!(r.status, 200, "{m}: {}", r.text());
            assert_eq!(r.node(), "b");
        }
    }
    // POST: a body that reached `a` is never sent again.
    let (mut failed, mut ok) = (0, 0);
    for _ in 0..4 {
        let before_b = b.count();
        let r = Req::get("/x")
            .method("POST")
            .header("X-Lane", "gray")
            .body("once")
            .send(s.gw.addr)
            .await;
        if r.status == 502 {
            failed += 1;
            assert_eq!(b.count(), before_b, "POST was retried after reaching a");
        } else {
            ok += 1;
            assert_eq!(r.node(), "b");
        }
    }
    assert!(
        failed >= 1 && ok >= 1,
        "round-robin hits both: {failed} {ok}"
    );
    let posts_at_a = a
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|g| g.method == "POST")
        .count();
    assert_eq!(posts_at_a, failed);
    assert_eq!(f1.count() + v1.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_bounded_by_the_configured_count() {
    let mut nodes = Vec::new();
    for i in 0..4 {
        nodes.push(Backend::full(&format!("d{i}"), "formal").await);
    }
    for n in &nodes {
        n.set_mode(Mode::Drop);
    }
    let refs: Vec<&Backend> = nodes.iter().collect();
    let s = setup(
        "    retries: 2\n    health:\n      passive: { max_fails: 1000 }\n",
        &refs,
    );
    let r = get_lane(&s.gw, "").await;
    assert_eq!(r.status, 502);
    let total: usize = nodes.iter().map(Backend::count).sum();
    assert_eq!(total, 3, "1 try + 2 retries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_response_and_total_timeouts() {
    let [h1, h2, g1] = full_backends([("h1", "formal"), ("h2", "formal"), ("g1", "gray")]).await;
    h1.set_mode(Mode::Hang);
    h2.set_mode(Mode::Hang);
    let s = setup_main(
        "    health:\n      passive: { max_fails: 1000 }\n",
        &[&h1, &h2, &g1],
        "upstream:\n  response_timeout_ms: 300\n  total_timeout_ms: 20000\n",
    );
    let arrived = || h1.arrived() + h2.arrived();
    // GET is idempotent: after the first node's response timeout it is
    // retried on the other formal node, which times out too.
    let r = get_lane(&s.gw, "").await;
    assert_eq!(r.status, 504);
    assert_eq!(r.text(), "upstream timed out\n");
    assert_eq!(
        (h1.arrived(), h2.arrived()),
        (1, 1),
        "the GET was retried on the other node after the response timeout"
    );
    // POST is not: one attempt only.
    let r = Req::get("/x").method("POST").send(s.gw.addr).await;
    assert_eq!(r.status, 504);
    assert_eq!(
        arrived(),
        3,
        "a POST is never retried after a response timeout"
    );
    // Total timeout shorter than one try: 504 once the total deadline is
    // over, long before the 30 s per-attempt timeout, after one attempt.
    Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("upstream:\n  response_timeout_ms: 30000\n  total_timeout_ms: 300\n")
        .write_rename(&s.fx, "gg.yaml");
    s.gw.wait_generation(1).await;
    let started = std::time::Instant::now();
    let r = get_lane(&s.gw, "").await;
    let took = started.elapsed();
    assert_eq!(r.status, 504);
    assert!(
        took < Duration::from_secs(15),
        "the total deadline (300 ms) did not end the wait: {took:?}"
    );
    assert_eq!(arrived(), 4, "no retry once the total deadline is spent");
    // Gray is unaffected by formal's hanging nodes.
    assert_eq!(get_lane(&s.gw, "gray").await.node(), "g1");
}

/// A listener whose accept queue is full, so new connects hang in SYN_SENT
/// (the kernel drops their SYNs): a stand-in for a black-holed node.
async fn blackhole() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..16 {
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => held.push(s),
            _ => return (l, held),
        }
    }
    panic!("accept queue never filled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_then_retry_on_the_same_lane() {
    let (hole, _held) = blackhole().await;
    let [g2, f1] = full_backends([("g2", "gray"), ("f1", "formal")]).await;
    let hole = Node::new("g-hole", hole.local_addr().unwrap()).lane("gray");
    let nodes = api_file(NO_EJECTION, [hole, g2.node(), f1.node()]);
    let s = setup_main("", &[], "upstream:\n  connect_timeout_ms: 200\n");
    s.fx.write_rename("nodes.yaml", &nodes);
    s.gw.wait_generation(1).await;
    for _ in 0..4 {
        let r = get_lane(&s.gw, "gray").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.node(), "g2");
    }
    assert_eq!(f1.count(), 0);
    s.gw.wait_log_line("connect failed at g-hole", |l| {
        l.contains("upstream connect failed") && l.contains("g-hole")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_state_survives_reloads() {
    let [f1, f2, f3] = full_backends([("f1", "formal"), ("f2", "formal"), ("f3", "formal")]).await;
    let passive =
        "    retries: 0\n    health:\n      passive: { max_fails: 1, cooldown_ms: 600000 }\n";
    let s = setup(passive, &[&f1, &f2]);
    f2.set_status(500);
    soon("f2 ejected", || async {
        get_lane(&s.gw, "").await;
        f2.count() == 1
    })
    .await;
    f2.set_status(200);
    // A reload that adds f3 keeps f2's ejection (same service and address).
    s.fx.write_rename("nodes.yaml", &nodes_file(passive, &[&f1, &f2, &f3]));
    soon("f3 serves", || async {
        get_lane(&s.gw, "").await.node() == "f3"
    })
    .await;
    for _ in 0..6 {
        assert_ne!(get_lane(&s.gw, "").await.node(), "f2");
    }
    assert_eq!(
        f2.count(),
        1,
        "the ejected node stayed ejected across the reload"
    );
}

/// The value of the sample `series` (labels in exposition order), if any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_service_lane_without_nodes_still_uses_formal() {
    let [f1, g1] = full_backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup("    strict: true\n", &[&f1, &g1]);
    // v9 has no node at all: formal serves it, strict or not, with the
    // request's own lane in the tag.
    for _ in 0..3 {
        served_by(&s.gw, "v9", "f1", Some("v9")).await;
    }
    assert_eq!(g1.count(), 0);
    assert_eq!(fallbacks(&s.gw, "v9", "lane_has_no_nodes").await, Some(3.0));
    // Its gray lane, which has a node, is still gray.
    assert_eq!(get_lane(&s.gw, "gray").await.node(), "g1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_unhealthy_tries_the_lanes_own_nodes_panic_mode() {
    let [f1, g1, v1] = full_backends([("f1", "formal"), ("g1", "gray"), ("v1", "v2")]).await;
    let s = setup("    health:\n      active: { path: /health, interval_ms: 40, timeout_ms: 500, healthy: 1, unhealthy: 1 }\n", &[&f1, &g1, &v1]);
    // Gray and formal both fail their checks; only the other gray lane
    // (v2) is healthy.
    f1.set_health(503);
    g1.set_health(503);
    let down = |name: &'static str| {
        format!("graygate_node_health{{lane=\"{}\",node=\"{name}\",service=\"api\",state=\"unhealthy\"}}",
            if name == "f1" { "formal" } else { "gray" })
    };
    soon("f1 and g1 marked down", || async {
        s.gw.metric(&down("f1")).await == Some(1.0) && s.gw.metric(&down("g1")).await == Some(1.0)
    })
    .await;
    // Nothing healthy for gray: its own node is tried anyway (not refused,
    // and never v2); formal likewise.
    for _ in 0..3 {
        served_by(&s.gw, "gray", "g1", Some("gray")).await;
        served_by(&s.gw, "", "f1", None).await;
    }
    assert_eq!(
        v1.count(),
        0,
        "panic mode never crosses into another gray lane"
    );
    assert_eq!(fallbacks(&s.gw, "gray", "all_unhealthy").await, Some(3.0));
    assert_eq!(get_lane(&s.gw, "v2").await.node(), "v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_probes_carry_the_lane_tag_and_user_agent_and_restart_on_change() {
    let [f1, g1] = full_backends([("f1", "formal"), ("g1", "gray")]).await;
    let check = |path: &str| {
        format!("    health:\n      active: {{ path: {path}, interval_ms: 30, timeout_ms: 500 }}\n")
    };
    let s = setup(&check("/health"), &[&f1, &g1]);
    soon("both probed", || async {
        f1.probes_on("/health") >= 2 && g1.probes_on("/health") >= 2
    })
    .await;
    for (node, lane) in [(&f1, "formal"), (&g1, "gray")] {
        for p in node.probes() {
            assert_eq!(p.tag.as_deref(), Some(lane), "{} {p:?}", node.name);
            assert_eq!(p.user_agent.as_deref(), Some("graygate-health"), "{p:?}");
        }
    }
    // A changed check (new path) restarts the checkers: probes move to the
    // new path and the old ones stop.
    s.fx.write_rename("nodes.yaml", &nodes_file(&check("/health-b"), &[&f1, &g1]));
    soon("probes on the new path", || async {
        f1.probes_on("/health-b") >= 1 && g1.probes_on("/health-b") >= 1
    })
    .await;
    let old = (f1.probes_on("/health"), g1.probes_on("/health"));
    let new = (f1.probes_on("/health-b"), g1.probes_on("/health-b"));
    soon("4 more probes on the new path", || async {
        f1.probes_on("/health-b") >= new.0 + 4 && g1.probes_on("/health-b") >= new.1 + 4
    })
    .await;
    // At most one probe on the old path that was already under way.
    assert!(f1.probes_on("/health") <= old.0 + 1, "old check still runs");
    assert!(g1.probes_on("/health") <= old.1 + 1, "old check still runs");
    for p in g1.probes() {
        assert_eq!(p.tag.as_deref(), Some("gray"), "{p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_retry_buffer_stream_and_retry_only_after_connect_failure() {
    let limit = 1024;
    let body = |n: usize| "b".repeat(n);
    let put = |gw_addr, n: usize| async move {
        Req::get("/x")
            .method("PUT")
            .header("X-Lane", "gray")
            .body(body(n))
            .send(gw_addr)
            .await
    };
    let main = format!("upstream:\n  retry_buffer_bytes: {limit}\n");
    let passive = "    health:\n      passive: { max_fails: 1000 }\n";

    // A node that refuses connections: even a streamed body (over the
    // buffer) is retried on the other node, whole — it never left.
    let [b, f1] = full_backends([("b", "gray"), ("f1", "formal")]).await;
    let dead = closed_port();
    let s = setup_main(passive, &[&f1], &main);
    s.fx.write_rename(
        "nodes.yaml",
        &api_file(
            passive,
            [Node::new("g-dead", dead).lane("gray"), b.node(), f1.node()],
        ),
    );
    s.gw.wait_generation(1).await;
    for _ in 0..4 {
        let r = put(s.gw.addr, 4 * limit).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.node(), "b");
        assert_eq!(r.json()["body"], body(4 * limit).as_str());
    }
    s.gw.wait_log("retrying on another node of the same lane")
        .await;
    drop(s);

    // A node that reads the body and closes without answering: a PUT up
    // to the buffer size is replayed on the other node; one byte more
    // streams, so it is not retried once a node has read it.
    let a = Backend::full("a", "gray").await;
    a.set_mode(Mode::Drop);
    let s = setup_main(passive, &[&a, &b, &f1], &main);
    let b_before = b.count();
    for _ in 0..4 {
        let r = put(s.gw.addr, limit).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.node(), "b");
        assert_eq!(r.json()["body"], body(limit).as_str());
    }
    assert!(a.count() >= 1, "round-robin tried a");
    assert_eq!(b.count(), b_before + 4);
    let (mut failed, mut ok) = (0, 0);
    for _ in 0..4 {
        let (a0, b0) = (a.count(), b.count());
        let r = put(s.gw.addr, limit + 1).await;
        if r.status == 502 {
            failed += 1;
            assert_eq!(
                (a.count(), b.count()),
                (a0 + 1, b0),
                "the streamed body was sent once"
            );
            assert_eq!(
                a.seen.lock().unwrap().last().unwrap().body.len(),
                limit + 1,
                "a read the whole body"
            );
        } else {
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.node(), "b");
            ok += 1;
        }
    }
    assert!(
        failed >= 1 && ok >= 1,
        "round-robin hits both: {failed} {ok}"
    );
    assert_eq!(f1.count(), 0, "never formal");
}

/// The admin API's view of node `name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_xx_is_passed_back_not_retried() {
    let [a, b] = full_backends([("a", "formal"), ("b", "formal")]).await;
    let s = setup(
        "    retries: 2\n    health:\n      passive: { max_fails: 1000 }\n",
        &[&a, &b],
    );
    a.set_status(500);
    let (mut five, mut ok) = (0, 0);
    for _ in 0..4 {
        let (a0, b0) = (a.arrived(), b.arrived());
        let r = get_lane(&s.gw, "").await;
        if r.status == 500 {
            five += 1;
            assert_eq!(r.node(), "a", "the node's own 5xx answer");
            assert_eq!(
                (a.arrived(), b.arrived()),
                (a0 + 1, b0),
                "a 5xx is not retried"
            );
        } else {
            assert_eq!((r.status, r.node()), (200, "b".to_string()));
            ok += 1;
        }
    }
    assert!(five >= 1 && ok >= 1, "round-robin hits both: {five} {ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_resets_the_failure_count() {
    let f1 = Backend::full("f1", "formal").await;
    let s = setup(
        "    retries: 0\n    health:\n      passive: { max_fails: 2, cooldown_ms: 600000 }\n",
        &[&f1],
    );
    // fail, succeed, fail: never two in a row, so never ejected.
    for status in [500, 200, 500] {
        f1.set_status(status);
        assert_eq!(get_lane(&s.gw, "").await.status, status);
    }
    assert_eq!(s.gw.node_doc("f1").await["health"], "healthy");
    // A second failure in a row ejects it.
    assert_eq!(get_lane(&s.gw, "").await.status, 500);
    assert_eq!(s.gw.node_doc("f1").await["health"], "unhealthy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_added_by_reload_starts_healthy_under_active_checks() {
    let [f1, g1] = full_backends([("f1", "formal"), ("g1", "gray")]).await;
    // Its checks fail, but three failures 60 s apart are needed to mark
    // it down: until then it takes traffic.
    g1.set_health(503);
    let health = "    health:\n      active: { path: /health, interval_ms: 60000, timeout_ms: 500, unhealthy: 3 }\n";
    let s = setup(health, &[&f1]);
    assert_eq!(get_lane(&s.gw, "gray").await.node(), "f1");
    s.fx.write_rename("nodes.yaml", &nodes_file(health, &[&f1, &g1]));
    soon("g1 added", || async {
        get_lane(&s.gw, "gray").await.node() == "g1"
    })
    .await;
    assert_eq!(s.gw.node_doc("g1").await["health"], "healthy");
    for _ in 0..3 {
        assert_eq!(get_lane(&s.gw, "gray").await.node(), "g1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pooled_upstream_connections_are_closed() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.write("lane.lua", HEADER_SCRIPT);
    fx.api_nodes(&[&f1]);
    let gw = Config::new()
        .set("workers", 1)
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("upstream:\n  idle_timeout_ms: 300\n")
        .start(&fx, "gg.yaml");
    use std::sync::atomic::Ordering;
    let conns = || f1.connections.load(Ordering::SeqCst);
    assert_eq!(gw.get("/x").await.status, 200);
    assert_eq!(conns(), 1);
    // Every request resets the idle clock, so poll with growing gaps: once
    // a gap exceeds 300 ms the pooled connection is not reused but closed
    // and replaced (the default, 60 s, would keep it for the whole test).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut gap = Duration::from_millis(25);
    while conns() == 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle connection was reused after gaps up to {gap:?}"
        );
        tokio::time::sleep(gap).await;
        gap *= 2;
        assert_eq!(gw.get("/x").await.status, 200);
    }
    assert_eq!(conns(), 2, "a fresh connection");
    soon("the idle one closed", || async {
        f1.closed.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// A gateway with one worker and `f1` as its only API node.
fn one_node_gateway(fx: &Fixture, f1: &Backend, extra: &str) -> Gateway {
    fx.api_nodes(&[f1]);
    Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(extra)
        .start(fx, "gg.yaml")
}

/// Past its idle timeout a pooled connection is closed even when no
/// request comes to find it so (nginx's keepalive_timeout): a quiet
/// gateway holds no upstream connections (and their memory) for good.
#[tokio::test]
async fn pooled_upstream_connections_past_their_idle_timeout_close_with_no_request() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    let gw = one_node_gateway(&fx, &f1, "upstream:\n  idle_timeout_ms: 300\n");
    use std::sync::atomic::Ordering;
    assert_eq!(gw.get("/x").await.status, 200);
    assert_eq!(f1.connections.load(Ordering::SeqCst), 1);
    soon("the idle connection closed", || async {
        f1.closed.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// The upstream connections a burst opened are closed once no request
/// has taken them for a purge period (5 s), all but one, which the next
/// request still reuses: the oldest opened (it was there before the burst,
/// its memory too); the default idle timeout (60 s) would keep them all.
#[tokio::test]
async fn the_upstream_connections_a_burst_left_are_closed_but_one() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    let gw = one_node_gateway(&fx, &f1, "");
    use std::sync::atomic::Ordering;
    let conns = || f1.connections.load(Ordering::SeqCst);
    let closed = || f1.closed.load(Ordering::SeqCst);
    // The steady load's connection, opened first.
    assert_eq!(gw.get("/x").await.status, 200);
    assert_eq!(f1.last().conn, 0);
    // Twenty at once, each answered after the last arrived: twenty
    // upstream connections, the first and nineteen new.
    f1.set_delay(Duration::from_millis(500));
    let burst: Vec<_> = (0..20).map(|_| gw.get("/x")).collect();
    for r in futures_util::future::join_all(burst).await {
        assert_eq!(r.status, 200);
    }
    assert_eq!(conns(), 20, "one upstream connection per request in flight");
    assert_eq!(closed(), 0);
    f1.set_delay(Duration::ZERO);
    eventually(
        "the burst's connections closed",
        Duration::from_secs(20),
        || async { closed() == 19 },
    )
    .await;
    assert_eq!(gw.get("/x").await.status, 200);
    assert_eq!(conns(), 20, "one was kept and reused");
    assert_eq!(f1.last().conn, 0, "the one kept is the oldest");
    assert_eq!(closed(), 19);
}
