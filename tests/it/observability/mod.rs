//! Metrics, the admin API (auth, status, nodes, explain, node management
//! written back to files), the access log and the lane response header,
//! through the real binary; what a node's broken-off body and a client's
//! abort are recorded as (`broken_bodies`).

mod broken_bodies;
mod rules;

use std::net::SocketAddr;
use std::time::Duration;

use crate::harness::*;

/// Script: lane from the `X-Lane` header, else formal; `X-Boom` fails.
const SCRIPT: &str = "return function(req)\n  if req:header('X-Boom') then error('boom') end\n  if req:header('X-Loop') then while true do end end\n  if req:header('X-Hog') then return string.rep('x', 256 * 1024 * 1024) end\n  return req:header('X-Lane')\nend\n";

struct Setup {
    fx: Fixture,
    gw: Gateway,
}

impl Setup {
    fn admin(&self) -> SocketAddr {
        self.gw.admin.expect("admin listener")
    }

    async fn admin_get(&self, path: &str) -> Resp {
        Req::get(path).send(self.admin()).await
    }

    async fn metrics(&self) -> String {
        let r = self.admin_get("/metrics").await;
        assert_eq!(r.status, 200);
        r.text()
    }

    fn nodes_file(&self) -> String {
        std::fs::read_to_string(self.fx.path("nodes.yaml")).unwrap()
    }
}

fn setup(nodes: &[&Backend], extra: &str) -> Setup {
    let fx = Fixture::new();
    fx.write("lane.lua", SCRIPT);
    fx.api_nodes(nodes);
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .raw(extra)
        .start(&fx, "gg.yaml");
    Setup { fx, gw }
}

/// The value of the sample `name{labels}` (labels in exposition order).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

async fn lane_req(gw: &Gateway, lane: &str) -> Resp {
    Req::get("/api/x")
        .header("X-Lane", lane)
        .send(gw.addr)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_decisions_fallbacks_script_errors_and_reloads() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup(&[&f1, &g1], "");
    for _ in 0..3 {
        assert_eq!(s.gw.get("/api/x").await.status, 200);
    }
    for _ in 0..2 {
        assert_eq!(lane_req(&s.gw, "gray").await.node(), "g1");
    }
    assert_eq!(lane_req(&s.gw, "v2").await.node(), "f1");
    let r = Req::get("/api/x")
        .header("X-Boom", "1")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "f1");
    assert_eq!(s.gw.get("/nowhere").await.status, 404);
    // Limit hits: the instruction budget and the memory limit.
    let r = Req::get("/api/x")
        .header("X-Loop", "1")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "f1");
    let r = Req::get("/api/x")
        .header("X-Hog", "1")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "f1");

    let m = s.metrics().await;
    let req = |lane: &str, node: &str, class: &str| {
        sample(
            &m,
            &format!("graygate_requests_total{{lane=\"{lane}\",node=\"{node}\",route=\"/api/\",status_class=\"{class}\"}}"),
        )
    };
    assert_eq!(req("formal", "f1", "2xx"), Some(6.0), "{m}");
    assert_eq!(req("gray", "g1", "2xx"), Some(2.0), "{m}");
    assert_eq!(req("v2", "f1", "2xx"), Some(1.0), "{m}");
    assert_eq!(
        sample(
            &m,
            "graygate_requests_total{lane=\"-\",node=\"-\",route=\"-\",status_class=\"4xx\"}"
        ),
        Some(1.0)
    );
    // The "gray matched" counter.
    assert_eq!(
        sample(
            &m,
            "graygate_decisions_total{decided_by=\"script\",lane=\"gray\",rule=\"\"}"
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "graygate_decisions_total{decided_by=\"script_error\",lane=\"formal\",rule=\"\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &m,
            "graygate_lane_fallbacks_total{lane=\"v2\",reason=\"lane_has_no_nodes\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&m, "graygate_script_errors_total{kind=\"error\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &m,
            "graygate_script_errors_total{kind=\"instruction_limit\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "graygate_script_errors_total{kind=\"memory_limit\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "graygate_request_duration_seconds_count{lane=\"gray\",node=\"g1\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &m,
            "graygate_request_duration_seconds_bucket{lane=\"gray\",node=\"g1\",le=\"+Inf\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &m,
            "graygate_upstream_duration_seconds_count{lane=\"formal\",node=\"f1\"}"
        ),
        Some(6.0)
    );
    assert_eq!(
        sample(
            &m,
            "graygate_node_health{lane=\"gray\",node=\"g1\",service=\"api\",state=\"healthy\"}"
        ),
        Some(1.0)
    );
    assert_eq!(sample(&m, "graygate_generation"), Some(1.0));
    assert_eq!(
        sample(&m, "graygate_reloads_total{result=\"applied\"}"),
        Some(0.0)
    );

    // A rejected and an applied reload show up.
    s.fx.write_rename("lane.lua", "return function(req) return (\n");
    soon("rejected reload counted", || async {
        sample(
            &s.metrics().await,
            "graygate_reloads_total{result=\"rejected\"}",
        ) == Some(1.0)
    })
    .await;
    s.fx.write_rename("lane.lua", "return function(req) return 'gray' end\n");
    soon("applied reload counted", || async {
        let m = s.metrics().await;
        sample(&m, "graygate_reloads_total{result=\"applied\"}") == Some(1.0)
            && sample(&m, "graygate_generation") == Some(2.0)
    })
    .await;
    // The rule change took effect: the gray-matched counter moves.
    assert_eq!(s.gw.get("/api/x").await.node(), "g1");
    let m = s.metrics().await;
    assert_eq!(
        sample(
            &m,
            "graygate_decisions_total{decided_by=\"script\",lane=\"gray\",rule=\"\"}"
        ),
        Some(3.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_is_required_and_compared() {
    let f1 = Backend::start("f1", "formal").await;
    let s = setup(&[&f1], "admin_token: s3cret-token\n");
    for path in [
        "/status",
        "/metrics",
        "/nodes",
        "/explain?path=/api/x",
        "/",
        "/stats",
    ] {
        let r = s.admin_get(path).await;
        assert_eq!(r.status, 401, "{path}");
        let challenges: Vec<_> = r.headers.get_all("www-authenticate").iter().collect();
        assert_eq!(
            challenges,
            [
                "Basic realm=\"graygate admin\"",
                "Bearer realm=\"graygate admin\""
            ]
        );
        let r = Req::get(path)
            .header("Authorization", "Bearer wrong-token!")
            .send(s.admin())
            .await;
        assert_eq!(r.status, 401, "{path}");
        let r = Req::get(path)
            .header("Authorization", "Bearer s3cret-token")
            .send(s.admin())
            .await;
        assert_eq!(r.status, 200, "{path}");
    }
    // HTTP Basic with the token as password (what a browser sends).
    let r = Req::get("/status")
        .header("Authorization", "Basic YWRtaW46czNjcmV0LXRva2Vu") // admin:s3cret-token
        .send(s.admin())
        .await;
    assert_eq!(r.status, 200);
    // Management is guarded too, and nothing is written without the token.
    let before = s.nodes_file();
    let r = Req::get("/nodes/api")
        .method("POST")
        .body(r#"{"addr":"127.0.0.1:9"}"#)
        .send(s.admin())
        .await;
    assert_eq!(r.status, 401);
    assert_eq!(s.nodes_file(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_loopback_admin_needs_a_token_and_env_token_works() {
    let fx = Fixture::new();
    let cfg = Config::empty()
        .listen("127.0.0.1:0")
        .set("admin_listen", "0.0.0.0:0")
        .set("routes", "[]")
        .write(&fx, "gg.yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--config")
        .arg(&cfg)
        .env_remove("GRAYGATE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a loopback address"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--check")
        .arg("--config")
        .arg(&cfg)
        .env_remove("GRAYGATE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success(), "--check refuses it too");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--check")
        .arg("--config")
        .arg(&cfg)
        .env("GRAYGATE_ADMIN_TOKEN", "t")
        .output()
        .unwrap();
    assert!(out.status.success(), "with a token it is fine");

    // The token may come from the environment.
    let cfg = Config::new().set("routes", "[]").write(&fx, "gg2.yaml");
    let gw = Gateway::start_env(&cfg, &[("GRAYGATE_ADMIN_TOKEN", "from-env")]);
    let admin = gw.admin.unwrap();
    assert_eq!(Req::get("/status").send(admin).await.status, 401);
    let r = Req::get("/status")
        .header("Authorization", "Bearer from-env")
        .send(admin)
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_version_generation_reload_and_uptime() {
    let f1 = Backend::start("f1", "formal").await;
    let s = setup(&[&f1], "");
    let st = s.gw.status().await;
    assert_eq!(st["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(st["generation"], 1);
    assert!(st["loaded_at"].as_u64().unwrap() > 1_600_000_000);
    assert!(st["uptime_secs"].is_u64());
    assert!(st["last_reload_error"].is_null());
    assert_eq!(s.admin_get("/nope").await.status, 404);
    let r = Req::get("/status").method("POST").send(s.admin()).await;
    assert_eq!(r.status, 405);
    let r = Req::get("/nodes").method("PUT").send(s.admin()).await;
    assert_eq!(r.status, 405);
    let r = s.admin_get("/metrics").await;
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    s.fx.write_rename(
        "nodes.yaml",
        "services:\n  api:\n    nodes:\n      - { addr: nope }\n",
    );
    soon("reload error shown", || async {
        let st = s.gw.status().await;
        st["last_reload_result"] == "rejected"
            && st["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.contains("nodes.yaml:4"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_show_lane_weight_health_in_flight_requests_and_errors() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let f1 = Backend::start_mode("f1", "formal", Mode::Gated(gate.clone())).await;
    let g1 = Backend::start("g1", "gray").await;
    let dead = closed_port();
    let dead = Node::new("dead", dead).lane("v2").with("weight", "3");
    let fx = Fixture::new();
    fx.write("lane.lua", SCRIPT);
    // The default max_fails (3); a cool-down no test run outlasts.
    let api = Service::new("api").raw("    health:\n      passive: { cooldown_ms: 600000 }\n");
    let api = api.nodes([f1.node(), g1.node(), dead]);
    Nodes::new().service(api).write(&fx, "nodes.yaml");
    let cfg = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .write(&fx, "gg.yaml");
    let s = Setup {
        gw: Gateway::start(&cfg),
        fx,
    };
    // A request held open by the gated backend is in flight.
    let held = Req::get("/api/x").send_streaming(s.gw.addr).await;
    assert_eq!(held.status(), 200);
    let doc = s.admin_get("/nodes").await.json();
    assert_eq!(doc["services"][0]["name"], "api");
    let f = s.gw.node_doc("f1").await;
    assert_eq!(f["in_flight"], 1, "{doc}");
    assert_eq!(f["requests"], 1);
    assert_eq!(f["lane"], "formal");
    assert_eq!(f["health"], "healthy");
    let d = s.gw.node_doc("dead").await;
    assert_eq!(
        (d["lane"].clone(), d["weight"].clone()),
        ("v2".into(), 3.into())
    );
    assert_eq!(d["requests"], 0);
    assert!(s
        .metrics()
        .await
        .contains("graygate_node_in_flight{lane=\"formal\",node=\"f1\",service=\"api\"} 1"));
    // The held request finishes: no longer in flight.
    gate.notify_one();
    let body = http_body_util::BodyExt::collect(held.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"first;rest");
    eventually("in-flight back to 0", Duration::from_secs(5), || async {
        s.gw.node_doc("f1").await["in_flight"] == 0
    })
    .await;
    // Errors: the dead node answers 502 through the gateway.
    assert_eq!(lane_req(&s.gw, "v2").await.status, 502);
    assert_eq!(lane_req(&s.gw, "v2").await.status, 502);
    let d = s.gw.node_doc("dead").await;
    assert_eq!(
        (d["requests"].clone(), d["errors"].clone()),
        (2.into(), 2.into())
    );
    assert_eq!(d["health"], "healthy", "2 failures do not eject yet");
    // The third consecutive failure ejects it (passive health).
    assert_eq!(lane_req(&s.gw, "v2").await.status, 502);
    let d = s.gw.node_doc("dead").await;
    assert_eq!(d["health"], "unhealthy", "{d}");
    assert_eq!(d["health_detail"]["ejected"], true);
    let m = s.metrics().await;
    assert_eq!(
        sample(
            &m,
            "graygate_node_health{lane=\"v2\",node=\"dead\",service=\"api\",state=\"unhealthy\"}"
        ),
        Some(1.0),
        "{m}"
    );
    // Ejected: v2 now falls back to formal, counted by reason.
    // (f1 holds its answer open: only the head is awaited.)
    let held = Req::get("/api/x")
        .header("X-Lane", "v2")
        .send_streaming(s.gw.addr)
        .await;
    assert_eq!(held.status(), 200);
    drop(held);
    // A request is recorded when its response body ends — here when the
    // client drops it.
    soon("the fallback counted", || async {
        let m = s.metrics().await;
        sample(
            &m,
            "graygate_lane_fallbacks_total{lane=\"v2\",reason=\"lane_unhealthy\"}",
        ) == Some(1.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_is_a_dry_run_of_lane_and_node_choice() {
    let [f1, f2, g1] = backends([("f1", "formal"), ("f2", "formal"), ("g1", "gray")]).await;
    let s = setup(&[&f1, &f2, &g1], "");
    let metrics_before = s.metrics().await;

    let e = s
        .admin_get("/explain?path=/api/x&header=X-Lane:%20gray")
        .await
        .json();
    assert_eq!(e["lane"], "gray", "{e}");
    assert_eq!(e["decided_by"], "script");
    assert_eq!(e["route"]["prefix"], "/api/");
    assert_eq!(e["chosen"], "g1");
    assert_eq!(e["candidates"].as_array().unwrap().len(), 1);
    assert!(e["fallback"].is_null());

    let post = |body: &'static str| Req::get("/explain").method("POST").body(body);
    let e = post(r#"{"path":"/api/x","headers":{"X-Lane":"v2"},"ip":"127.0.9.9"}"#)
        .send(s.admin())
        .await
        .json();
    assert_eq!(e["lane"], "v2");
    assert_eq!(e["fallback"], "lane_has_no_nodes");
    assert_eq!(e["served_lane"], "formal");
    assert_eq!(e["request"]["client_ip"], "127.0.9.9");
    let names: Vec<&str> = e["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["f1", "f2"]);
    let e = post(r#"{"path":"/api/x","headers":{"X-Boom":"1"}}"#)
        .send(s.admin())
        .await
        .json();
    assert_eq!(
        (e["lane"].clone(), e["decided_by"].clone()),
        ("formal".into(), "script_error".into())
    );
    assert!(e["detail"].as_str().unwrap().contains("boom"));
    let e = post(r#"{"path":"/elsewhere"}"#)
        .send(s.admin())
        .await
        .json();
    assert!(e["route"].is_null());
    // Bad input is a 400 with a short message.
    let r = post(r#"{"path": 5}"#).send(s.admin()).await;
    assert_eq!(r.status, 400);
    assert_eq!(s.admin_get("/explain?ip=not-an-ip").await.status, 400);

    // Explaining repeatedly names the same next node and moves nothing:
    // the real request then goes exactly there.
    async fn next(s: &Setup) -> String {
        s.admin_get("/explain?path=/api/x").await.json()["chosen"]
            .as_str()
            .unwrap()
            .to_string()
    }
    for _ in 0..3 {
        let predicted = next(&s).await;
        assert_eq!(next(&s).await, predicted);
        assert_eq!(s.gw.get("/api/x").await.node(), predicted);
    }
    assert_eq!(f1.count() + f2.count(), 3);
    assert_eq!(g1.count(), 0, "explain reached no node");
    // No counter moved because of explain: only the 3 real requests.
    let m = s.metrics().await;
    let formal_total = |m: &str| {
        sample(m, "graygate_requests_total{lane=\"formal\",node=\"f1\",route=\"/api/\",status_class=\"2xx\"}").unwrap_or(0.0)
            + sample(m, "graygate_requests_total{lane=\"formal\",node=\"f2\",route=\"/api/\",status_class=\"2xx\"}").unwrap_or(0.0)
    };
    assert_eq!(formal_total(&metrics_before), 0.0);
    assert_eq!(formal_total(&m), 3.0);
    assert!(
        !m.lines()
            .any(|l| l.starts_with("graygate_requests_total") && l.contains("lane=\"gray\"")),
        "explain counted nothing gray: {m}"
    );
    let doc = s.admin_get("/nodes").await.json();
    assert_eq!(doc["services"][0]["nodes"][2]["requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_management_writes_the_file_back_and_applies_it() {
    let [f1, g1, g2] = backends([("f1", "formal"), ("g1", "gray"), ("g2", "gray")]).await;
    let s = setup(&[&f1, &g1], "");
    let admin = s.admin();
    let send = |m: &str, path: &str, body: &str| {
        let req = Req::get(path).method(m).body(body.to_string());
        async move { req.send(admin).await }
    };

    // Add a gray node.
    let body = format!(
        r#"{{"name":"g2","addr":"{}","lane":"gray","weight":2}}"#,
        g2.addr
    );
    let r = send("POST", "/nodes/api", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Applied through a reload (the file watcher may add one of its own).
    assert!(r.json()["generation"].as_u64().unwrap() >= 2);
    let file: serde_yaml::Value = serde_yaml::from_str(&s.nodes_file()).unwrap();
    let nodes = file["services"]["api"]["nodes"].as_sequence().unwrap();
    assert_eq!(nodes.len(), 3);
    assert_eq!(nodes[2]["name"].as_str(), Some("g2"));
    assert_eq!(nodes[2]["weight"].as_u64(), Some(2));
    for _ in 0..6 {
        lane_req(&s.gw, "gray").await;
    }
    assert_eq!((g1.count(), g2.count()), (2, 4), "weights 1:2");

    // Change its lane: it leaves gray.
    let r = send("PATCH", "/nodes/api/g2", r#"{"lane":"v2"}"#).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(lane_req(&s.gw, "v2").await.node(), "g2");
    assert!(s.nodes_file().contains("lane: v2"));

    // Invalid changes: 400 (or 404), nothing written, nothing reloaded.
    let before = s.nodes_file();
    let rejected = s.gw.status().await["reloads_rejected"].clone();
    for (m, path, body, want) in [
        ("PATCH", "/nodes/api/g2", r#"{"lane":"bad lane"}"#, 400),
        ("PATCH", "/nodes/api/g2", r#"{"weight":-1}"#, 400),
        ("PATCH", "/nodes/api/g2", "{}", 400),
        ("POST", "/nodes/api", r#"{"addr":"not-an-addr"}"#, 400),
        (
            "POST",
            "/nodes/api",
            &format!(r#"{{"addr":"{}"}}"#, f1.addr),
            400,
        ),
        (
            "POST",
            "/nodes/api",
            r#"{"name":"f1","addr":"127.0.0.1:9"}"#,
            400,
        ),
        ("POST", "/nodes/api", "not json", 400),
        ("POST", "/nodes/nosuch", r#"{"addr":"127.0.0.1:9"}"#, 404),
        ("DELETE", "/nodes/api/nosuch", "", 404),
    ] {
        let r = send(m, path, body).await;
        assert_eq!(r.status, want, "{m} {path} {body}: {}", r.text());
        assert!(!r.text().is_empty());
    }
    assert_eq!(s.nodes_file(), before, "refused changes write nothing");
    assert_eq!(s.gw.status().await["reloads_rejected"], rejected);

    // Weight 0 by PATCH: written back, and g2 takes no traffic (v2 has no
    // other node, so it falls back to formal).
    let g2_before = g2.count();
    let r = send("PATCH", "/nodes/api/g2", r#"{"weight":0}"#).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let file: serde_yaml::Value = serde_yaml::from_str(&s.nodes_file()).unwrap();
    let g2_entry = file["services"]["api"]["nodes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|n| n["name"].as_str() == Some("g2"))
        .cloned()
        .unwrap();
    assert_eq!(g2_entry["weight"].as_u64(), Some(0));
    for _ in 0..4 {
        assert_eq!(lane_req(&s.gw, "v2").await.node(), "f1");
    }
    assert_eq!(g2.count(), g2_before, "a weight-0 node takes no traffic");

    // Then remove it.
    let r = send("DELETE", "/nodes/api/g2", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(!s.nodes_file().contains(&g2.addr.to_string()));
    let r = lane_req(&s.gw, "v2").await;
    assert_eq!(r.node(), "f1", "v2 falls back to formal once g2 is gone");
    // No temp file is left next to the node file.
    let names: Vec<String> = std::fs::read_dir(s.fx.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("tmp")), "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_node_lets_in_flight_finish_and_sends_new_requests_elsewhere() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let f1 = Backend::start_mode("f1", "formal", Mode::Gated(gate.clone())).await;
    let f2 = Backend::start("f2", "formal").await;
    let s = setup(&[&f1, &f2], "");
    // Round-robin starts at f1: hold that request open.
    let held = Req::get("/api/x").send_streaming(s.gw.addr).await;
    assert_eq!(f1.count(), 1);
    let r = Req::get("/nodes/api/f1/drain")
        .method("POST")
        .send(s.admin())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(s.nodes_file().contains("drain: true"));
    let doc = s.admin_get("/nodes").await.json();
    let f = &doc["services"][0]["nodes"][0];
    assert_eq!(
        (f["drain"].clone(), f["in_flight"].clone()),
        (true.into(), 1.into())
    );
    for _ in 0..4 {
        assert_eq!(s.gw.get("/api/x").await.node(), "f2");
    }
    assert_eq!(f1.count(), 1, "no new request reached the draining node");
    gate.notify_one();
    let body = http_body_util::BodyExt::collect(held.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"first;rest", "the in-flight request finished");
    let r = Req::get("/nodes/api/f1/undrain")
        .method("POST")
        .send(s.admin())
        .await;
    assert_eq!(r.status, 200);
    assert!(!s.nodes_file().contains("drain"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_json_and_text_and_off_by_default() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup(
        &[&f1, &g1],
        "access_log: { path: access.log, format: json }\n",
    );
    lane_req(&s.gw, "gray").await;
    Req::get("/api/y?q=1")
        .from_ip("127.0.9.7")
        .send(s.gw.addr)
        .await;
    let path = s.fx.path("access.log");
    soon("two log lines", || async {
        std::fs::read_to_string(&path).is_ok_and(|t| t.lines().count() == 2)
    })
    .await;
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["lane"], "gray");
    assert_eq!(lines[0]["node"], "g1");
    assert_eq!(lines[0]["decided_by"], "script");
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[0]["method"], "GET");
    assert!(lines[0]["upstream_ms"].as_f64().unwrap() <= lines[0]["total_ms"].as_f64().unwrap());
    assert!(lines[0]["time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(lines[1]["client_ip"], "127.0.9.7");
    assert_eq!(lines[1]["path"], "/api/y");
    assert_eq!(lines[1]["lane"], "formal");

    let t = setup(&[&f1], "access_log: { path: text.log }\n");
    t.gw.get("/api/z").await;
    let path = t.fx.path("text.log");
    soon("text line", || async {
        std::fs::read_to_string(&path).is_ok_and(|t| t.lines().count() == 1)
    })
    .await;
    let line = std::fs::read_to_string(&path).unwrap();
    assert!(
        line.contains(
            " 127.0.0.1 \"GET /api/z\" 200 lane=formal decided_by=script rule=- node=f1 upstream_ms="
        ),
        "{line}"
    );

    // `stdout` as the target: the line arrives there (this also shows the
    // harness sees what the process writes to stdout, and that a line
    // written before a graceful exit is kept).
    let mut o = setup(&[&f1], "access_log: { path: stdout }\n");
    o.gw.get("/api/to-stdout").await;
    soon("line on stdout", || async {
        o.gw.stdout()
            .contains("\"GET /api/to-stdout\" 200 lane=formal")
    })
    .await;
    let out = o.gw.stop_and_read_stdout().await;
    assert_eq!(out.lines().count(), 1, "{out}");

    // Off by default: no file appears, and nothing goes to stdout or to
    // the gateway's own log (stderr) up to a graceful exit.
    let mut u = setup(&[&f1], "");
    for _ in 0..3 {
        assert_eq!(u.gw.get("/api/z").await.status, 200);
    }
    let out = u.gw.stop_and_read_stdout().await;
    assert_eq!(out, "", "no access log on stdout by default");
    let logs = u.gw.logs();
    assert!(
        !logs.contains("/api/z"),
        "no access log on stderr by default: {logs}"
    );
    let files: Vec<String> = std::fs::read_dir(u.fx.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(files.iter().all(|f| !f.ends_with(".log")), "{files:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_access_log_drops_lines_and_never_blocks_requests() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    // A FIFO nobody reads: the writer blocks opening it, forever.
    let fifo = fx.path("stuck.log");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    fx.api_nodes(&[&f1]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .raw("access_log: { path: stuck.log, buffer: 4 }\n")
        .route_all("api")
        .start(&fx, "gg.yaml");
    for _ in 0..20 {
        assert_eq!(gw.get("/x").await.status, 200);
    }
    let m = gw.metrics().await;
    assert_eq!(
        sample(&m, "graygate_access_log_dropped_total"),
        Some(16.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_response_header_is_off_by_default_and_configurable() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let s = setup(&[&f1, &g1], "");
    assert_eq!(lane_req(&s.gw, "gray").await.header("x-gray-lane"), None);
    let t = setup(&[&f1, &g1], "lane_response_header: X-Gray-Lane\n");
    assert_eq!(
        lane_req(&t.gw, "gray")
            .await
            .header("x-gray-lane")
            .as_deref(),
        Some("gray")
    );
    assert_eq!(
        t.gw.get("/api/x").await.header("x-gray-lane").as_deref(),
        Some("formal")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_follows_the_sticky_lane_cookie_like_real_traffic() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("lane.lua", SCRIPT);
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .raw("sticky:\n  key: explain-sticky-key-0123456789\n")
        .routes(&[Route::service("/api/", "api").sticky()])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    // A real gray request gets the signed lane cookie.
    let r = lane_req(&gw, "gray").await;
    let set = r.header("set-cookie").expect("sticky cookie set");
    let cookie = set.split(';').next().unwrap().to_string();
    let (name, value) = cookie.split_once('=').unwrap();

    let post = |body: serde_json::Value| Req::get("/explain").method("POST").body(body.to_string());
    let e = post(serde_json::json!({"path": "/api/x", "cookies": {name: value}}))
        .send(admin)
        .await
        .json();
    assert_eq!(e["lane"], "gray", "{e}");
    assert_eq!(e["decided_by"], "sticky_cookie");
    assert_eq!(e["chosen"], "g1");
    assert_eq!(e["sticky_cookie_set"], false);
    // The real request with that cookie agrees.
    let r = Req::get("/api/x")
        .header("Cookie", &cookie)
        .send(gw.addr)
        .await;
    assert_eq!(r.node(), "g1");
    // Without the cookie the script decides and a cookie would be set.
    let e = post(serde_json::json!({"path": "/api/x"}))
        .send(admin)
        .await
        .json();
    assert_eq!(
        (e["lane"].clone(), e["decided_by"].clone()),
        ("formal".into(), "script".into())
    );
    assert_eq!(e["sticky_cookie_set"], true);
}
