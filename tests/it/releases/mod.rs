//! Progressive releases with real traffic through the gateway to real
//! nodes: a gray node with 5% errors is rolled back after the failure
//! threshold and gets no request after; a healthy gray is promoted through
//! every step; too little traffic holds the release inconclusive; a webhook
//! answering 500 holds it; a restarted gateway resumes at its step; a
//! rising share or a promotion moves sticky formal users in while gray ones
//! stay, and a rollback unpins them; a gRPC gray answering UNAVAILABLE is
//! rolled back (`grpc`), and so is a gray that cuts its bodies short
//! (`truncated`); `graygate release …` drives them (`cli`).

mod cli;
mod fleet;
mod grpc;
mod judgement;
mod lifecycle;
mod low_traffic;
mod truncated;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::harness::*;
use http::StatusCode;

struct Setup {
    fx: Fixture,
    gw: Gateway,
    gray: Backend,
    _formal: Backend,
}

/// Formal `f1` and gray `g1`, never ejected (the release judges them).
pub fn release_nodes(formal: &Backend, gray: &Backend) -> Nodes {
    let api = Service::new("api").set("health", "{ passive: { max_fails: 0 } }");
    Nodes::new().service(api.nodes([
        Node::new("f1", formal.addr),
        Node::new("g1", gray.addr).lane("gray"),
    ]))
}

async fn setup(gray_fail_every: u64) -> Setup {
    let formal = Backend::text("formal", 0, StatusCode::OK).await;
    let gray = Backend::text("gray", gray_fail_every, StatusCode::OK).await;
    let fx = Fixture::new();
    release_nodes(&formal, &gray).write(&fx, "nodes.yaml");
    Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .raw("sticky: { key: 0123456789abcdef0123 }\n")
        .routes(&[Route::service("/api/", "api").sticky()])
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    Setup {
        fx,
        gw,
        gray,
        _formal: formal,
    }
}

/// POSTs `body` to the admin API's `path` (a release spec, an action).
pub async fn admin_post(gw: &Gateway, path: &str, body: &str) -> Resp {
    Req::get(path)
        .method("POST")
        .body(body.to_string())
        .send(gw.admin.unwrap())
        .await
}

async fn release(gw: &Gateway, name: &str) -> serde_json::Value {
    Req::get(&format!("/releases/{name}"))
        .send(gw.admin.unwrap())
        .await
        .json()
}

/// A release document rolled back on gray's error rate alone: a failed
/// analysis with gray errors and none of formal's, then the rollback.
pub fn assert_rolled_back_on_errors(doc: &serde_json::Value) {
    let analyses = doc["analyses"].as_array().unwrap();
    let fail = analyses
        .iter()
        .find(|a| a["outcome"] == "fail")
        .unwrap_or_else(|| panic!("{doc}"));
    assert!(fail["gray"]["errors"].as_u64().unwrap() >= 1, "{fail}");
    assert_eq!(fail["formal"]["errors"], 0, "{fail}");
    assert!(
        fail["reason"].as_str().unwrap().contains("error rate"),
        "{fail}"
    );
    assert_eq!(analyses.last().unwrap()["outcome"], "rollback");
}

const ANALYSIS: &str = "analysis: { interval_ms: 250, min_requests: 20, failure_threshold: 2 }";
/// A coarse detectable effect, so a healthy gray passes on a few hundred
/// requests: for the tests of the lifecycle, not of the judgement
/// (`judgement.rs`, `low_traffic.rs`). The latency thresholds are the
/// defaults.
pub const LIFECYCLE: &str =
    "analysis: { interval_ms: 250, failure_threshold: 2, max_error_delta_pp: 5 }";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gray_with_five_percent_errors_is_rolled_back_and_gets_nothing_after() {
    let s = setup(20).await;
    let spec = format!(
        "name: bad\nlane: gray\nroutes: [/api/]\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 600000 }}\n{ANALYSIS}\n"
    );
    let r = admin_post(&s.gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("rolled back", Duration::from_secs(30), || async {
        release(&s.gw, "bad").await["state"] == "rolled_back"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let doc = release(&s.gw, "bad").await;
    let analyses = doc["analyses"].as_array().unwrap();
    let fails: Vec<_> = analyses.iter().filter(|a| a["outcome"] == "fail").collect();
    assert_eq!(fails.len(), 2, "{doc}");
    // Every decision shows the values and thresholds behind it.
    let f = fails[0];
    // One answer in 20 fails: an analysis window holds one error or more,
    // whatever the traffic's rate.
    let (errors, requests) = (
        f["gray"]["errors"].as_f64().unwrap(),
        f["gray"]["requests"].as_f64().unwrap(),
    );
    assert!(errors >= 1.0, "{f}");
    let rate = f["gray"]["error_rate_pct"].as_f64().unwrap();
    assert!((rate - 100.0 * errors / requests).abs() < 1e-6, "{f}");
    assert_eq!(f["formal"]["errors"], 0);
    assert!(f["gray"]["requests"].as_u64().unwrap() >= 20);
    assert_eq!(f["thresholds"]["max_error_delta_pp"], 0.5);
    assert!(f["reason"].as_str().unwrap().contains("error rate"));
    assert_eq!(analyses.last().unwrap()["outcome"], "rollback");
    // No request reaches gray once the rollback generation is live.
    let before = s.gray.answered();
    for i in 0..200 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("u{i}"))
            .send(s.gw.addr)
            .await;
        assert_eq!(r.text(), "formal");
    }
    assert_eq!(s.gray.answered(), before);
    // A finished release never moves again.
    let r = admin_post(&s.gw, "/releases/bad/resume", "").await;
    assert_eq!(r.status, 409);
    let m = s.gw.metrics().await;
    assert!(
        m.contains(r#"graygate_release_analyses_total{outcome="fail",release="bad"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"graygate_release_weight{lane="gray",release="bad"} 0"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_gray_is_promoted_through_every_step() {
    let s = setup(0).await;
    let spec = format!(
        "name: good\nlane: gray\nroutes: [/api/]\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 10, min_duration_ms: 300 }}\n  - {{ weight: 50, min_duration_ms: 300 }}\n{LIFECYCLE}\n"
    );
    assert_eq!(admin_post(&s.gw, "/releases", &spec).await.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("promoted", Duration::from_secs(30), || async {
        release(&s.gw, "good").await["state"] == "promoted"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let doc = release(&s.gw, "good").await;
    let outcomes: Vec<&str> = doc["analyses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    let steps = outcomes.iter().filter(|o| **o == "step").count();
    assert_eq!(steps, 2, "created + one step: {outcomes:?}");
    assert_eq!(outcomes.last(), Some(&"promote"));
    assert!(!outcomes.contains(&"fail"), "{outcomes:?}");
    // Promoted: the lane takes all of the release's traffic.
    for i in 0..50 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("p{i}"))
            .send(s.gw.addr)
            .await;
        assert_eq!(r.text(), "gray");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_little_traffic_is_inconclusive_and_holds_the_release() {
    let s = setup(0).await;
    let spec = "name: quiet\nlane: gray\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 1 }\n  - { weight: 100 }\nanalysis: { interval_ms: 200, min_requests: 1000000 }\n";
    assert_eq!(admin_post(&s.gw, "/releases", spec).await.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually(
        "three inconclusive intervals",
        Duration::from_secs(30),
        || async {
            let doc = release(&s.gw, "quiet").await;
            doc["analyses"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|a| a["outcome"] == "inconclusive")
                .count()
                >= 3
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let doc = release(&s.gw, "quiet").await;
    assert_eq!(doc["state"], "progressing");
    assert_eq!(doc["step"], 0, "never promoted on too little data");
    assert_eq!(doc["failures"], 0, "never failed on too little data");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_answering_500_holds_the_release() {
    let s = setup(0).await;
    let hook = Backend::text("hook", 0, StatusCode::INTERNAL_SERVER_ERROR).await;
    let spec = format!(
        "name: hooked\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 10, min_duration_ms: 1 }}\n  - {{ weight: 50 }}\nwebhooks: {{ before_step: \"http://{}/check\" }}\n{LIFECYCLE}\n",
        hook.addr
    );
    assert_eq!(admin_post(&s.gw, "/releases", &spec).await.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("held twice", Duration::from_secs(30), || async {
        let doc = release(&s.gw, "hooked").await;
        doc["analyses"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["outcome"] == "held")
            .count()
            >= 2
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let doc = release(&s.gw, "hooked").await;
    assert_eq!(doc["step"], 0, "{doc}");
    assert!(hook.answered() >= 2);
    let held = doc["analyses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["outcome"] == "held")
        .unwrap()
        .clone();
    assert!(held["reason"].as_str().unwrap().contains("500"), "{held}");
    // The release says it is held, and why: in one release, the list and
    // the command line.
    assert_eq!(doc["state"], "held", "{doc}");
    assert!(doc["held"].as_str().unwrap().contains("500"), "{doc}");
    let list = Req::get("/releases").send(s.gw.admin.unwrap()).await.json();
    assert_eq!(list["releases"][0]["state"], "held", "{list}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["release", "show", "hooked", "--admin"])
        .arg(s.gw.admin.unwrap().to_string())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.lines().any(|l| l == "state:    held"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("held:     ") && l.contains("500")),
        "{out}"
    );
    // The webhook agrees at the next passing interval: on to the next step,
    // no longer held.
    hook.set_status(200);
    stop.store(false, Ordering::Relaxed);
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("stepped on", Duration::from_secs(30), || async {
        release(&s.gw, "hooked").await["step"] == 1
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let doc = release(&s.gw, "hooked").await;
    assert_eq!(doc["state"], "progressing", "{doc}");
    assert!(doc["held"].is_null(), "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_resumes_the_release_at_its_step() {
    let mut s = setup(0).await;
    let spec = format!(
        "name: durable\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 10, min_duration_ms: 1 }}\n  - {{ weight: 30, gate: manual, min_duration_ms: 1 }}\n  - {{ weight: 60, min_duration_ms: 1 }}\n{LIFECYCLE}\n"
    );
    assert_eq!(admin_post(&s.gw, "/releases", &spec).await.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let users: Vec<_> = (0..4)
        .map(|_| user_traffic(s.gw.addr, stop.clone()))
        .collect();
    // The first step passes on evidence (a sample that would have caught
    // a gray 2.4× slower): the bound is generous for a loaded machine.
    eventually("at the manual gate", Duration::from_secs(120), || async {
        let doc = release(&s.gw, "durable").await;
        doc["awaiting_promote"] == true && doc["step"] == 1
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in users {
        t.await.unwrap();
    }
    // Restart on the same files.
    drop(std::mem::replace(
        &mut s.gw,
        Gateway::start(&s.fx.path("gg.yaml")),
    ));
    let doc = release(&s.gw, "durable").await;
    assert_eq!(
        (doc["step"].clone(), doc["state"].clone()),
        (1.into(), "paused".into())
    );
    assert_eq!(doc["weight"], 30.0);
    // The gate opens on resume: the next step.
    let r = admin_post(&s.gw, "/releases/durable/resume", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["step"], 2);
    assert_eq!(r.json()["state"], "progressing");
}

/// Users `s0..s{n}` (header `X-User`) at the release's current step: each
/// one's bucket, the lane it got and the sticky cookie it was given.
async fn sticky_users(gw: &Gateway, n: usize) -> Vec<(u32, String, String)> {
    let mut out = Vec::new();
    for i in 0..n {
        let user = format!("s{i}");
        let r = Req::get("/api/x")
            .header("X-User", &user)
            .send(gw.addr)
            .await;
        let cookie = r
            .header("set-cookie")
            .map(|c| c.split(';').next().unwrap().to_string())
            .unwrap_or_else(|| panic!("{user}: no sticky cookie"));
        out.push((graygate::lane::bucket(user.as_bytes()), r.text(), cookie));
    }
    out
}

/// The lane each cookie gets now, on requests without the release's key.
async fn lanes_by_cookie(gw: &Gateway, users: &[(u32, String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (_, _, cookie) in users {
        let r = Req::get("/api/x")
            .header("Cookie", cookie)
            .send(gw.addr)
            .await;
        out.push(r.text());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_formal_users_join_as_the_share_rises_gray_users_stay_and_a_rollback_unpins() {
    let s = setup(0).await;
    // The lifecycle's small samples: this test is about cookies, not the
    // judgement, and the default minimums want thousands of requests.
    let spec = format!(
        "name: sticky\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 20, min_duration_ms: 1, gate: manual }}\n  - {{ weight: 80, min_duration_ms: 600000 }}\n{LIFECYCLE}\n"
    );
    assert_eq!(admin_post(&s.gw, "/releases", &spec).await.status, 201);
    // The first step passes and waits at its gate (still at 20 %).
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("at the manual gate", Duration::from_secs(30), || async {
        release(&s.gw, "sticky").await["awaiting_promote"] == true
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
    let users = sticky_users(&s.gw, 100).await;
    for (b, lane, _) in &users {
        assert_eq!(lane, if *b < 20 { "gray" } else { "formal" }, "bucket {b}");
    }
    assert!(users.iter().any(|u| (20..80).contains(&u.0)));
    // With the cookie alone, everyone keeps the lane of the 20 % step.
    let lanes = lanes_by_cookie(&s.gw, &users).await;
    assert!(
        users.iter().zip(&lanes).all(|(u, l)| &u.1 == l),
        "{lanes:?}"
    );
    // The share rises to 80 %: formal users whose draw (recorded in their
    // cookie) is now inside join, with or without the key; gray users stay.
    let r = admin_post(&s.gw, "/releases/sticky/resume", "").await;
    assert_eq!(r.json()["step"], 1, "{}", r.text());
    let lanes = lanes_by_cookie(&s.gw, &users).await;
    for ((b, _, _), lane) in users.iter().zip(&lanes) {
        assert_eq!(
            lane,
            if *b < 80 { "gray" } else { "formal" },
            "bucket {b} by cookie"
        );
    }
    for (i, (b, _, cookie)) in users.iter().enumerate() {
        let r = Req::get("/api/x")
            .header("Cookie", cookie)
            .header("X-User", &format!("s{i}"))
            .send(s.gw.addr)
            .await;
        assert_eq!(
            r.text(),
            if *b < 80 { "gray" } else { "formal" },
            "bucket {b} by key"
        );
    }
    // Abort: no cookie pins the rolled-back lane.
    let r = admin_post(&s.gw, "/releases/sticky/abort", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let lanes = lanes_by_cookie(&s.gw, &users).await;
    assert!(lanes.iter().all(|l| l == "formal"), "{lanes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_reaches_users_holding_a_formal_sticky_cookie_and_requests_without_the_key() {
    let s = setup(0).await;
    let spec = "name: promo\nlane: gray\nkey: { header: X-User }\nsteps:\n  - { weight: 20, min_duration_ms: 600000 }\nanalysis: { interval_ms: 100000 }\n";
    assert_eq!(admin_post(&s.gw, "/releases", spec).await.status, 201);
    let users = sticky_users(&s.gw, 40).await;
    assert!(users.iter().filter(|u| u.1 == "formal").count() >= 20);
    let r = admin_post(&s.gw, "/releases/promo/promote", "").await;
    assert_eq!(r.json()["state"], "promoted", "{}", r.text());
    let lanes = lanes_by_cookie(&s.gw, &users).await;
    assert!(lanes.iter().all(|l| l == "gray"), "{lanes:?}");
    // Nor does a request without the key stay formal.
    assert_eq!(Req::get("/api/x").send(s.gw.addr).await.text(), "gray");
}

/// One request per decision source that can name a lane past the release
/// rule and the sticky cookie: the script, a rule, a trusted proxy's tag.
fn each_source() -> [(&'static str, Req); 3] {
    [
        ("script", Req::get("/api/x").header("X-Lane", "gray")),
        ("rule", Req::get("/api/x").header("X-Beta", "1")),
        (
            "trusted_tag",
            Req::get("/api/x")
                .from_ip("127.0.0.3")
                .header("X-Gray-Tag", "gray"),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_lane_is_refused_to_the_script_a_rule_and_a_trusted_tag() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1, &g1]);
    fx.write(
        "lane.lua",
        "return function(req) return req:header('X-Lane') end\n",
    );
    let gw = Config::new()
        .set("workers", 1)
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("trusted_proxies: [127.0.0.3/32]\n")
        .raw("rules:\n  enabled: true\n  rules:\n    - { name: beta, lane: gray, header: { name: X-Beta, values: [\"1\"] } }\n")
        .start(&fx, "gg.yaml");
    // Each source sends its request to gray while the lane is live.
    for (by, req) in each_source() {
        let r = req.send(gw.addr).await;
        assert_eq!(r.node(), "g1", "{by}");
    }
    let spec =
        "name: revoke\nlane: gray\nsteps:\n  - { weight: 10 }\nanalysis: { interval_ms: 100000 }\n";
    assert_eq!(admin_post(&gw, "/releases", spec).await.status, 201);
    let r = admin_post(&gw, "/releases/revoke/abort", "").await;
    assert_eq!(r.json()["state"], "rolled_back", "{}", r.text());
    // Rolled back: every source is refused the lane; formal serves, tagged
    // formal, and gray gets nothing.
    let before = g1.count();
    let mut leaks = Vec::new();
    for (by, req) in each_source() {
        let r = req.send(gw.addr).await;
        if r.node() != "f1" || r.json()["tag"] != "formal" {
            leaks.push(format!("{by}: {}", r.text()));
        }
    }
    assert!(leaks.is_empty(), "the revoked lane leaked: {leaks:?}");
    assert_eq!(g1.count(), before);
    let m = gw.metrics().await;
    assert!(
        m.contains(r#"graygate_decisions_total{decided_by="rolled_back",lane="formal",rule=""} 3"#),
        "{m}"
    );
}

/// The admin API shows the release state the gateway serves, not the state
/// file ahead of its reload: a state written to disk (by the controller's
/// commit or by hand) reads as such only once its generation is live, so
/// `rolled_back` is never shown while a request can still reach the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_shows_the_state_that_serves_not_the_file_ahead_of_its_reload() {
    let formal = Backend::text("formal", 0, StatusCode::OK).await;
    let gray = Backend::text("gray", 0, StatusCode::OK).await;
    let fx = Fixture::new();
    release_nodes(&formal, &gray).write(&fx, "nodes.yaml");
    // A long debounce: a hand edit of the state file waits 3 s for its
    // reload, the window in which the API must still show the old state.
    Config::new()
        .set("workers", 1)
        .set("reload_debounce_ms", 3000)
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&fx.path("gg.yaml"));
    let spec = format!(
        "name: held\nlane: gray\nroutes: [/api/]\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 600000 }}\n  - {{ weight: 80 }}\n{LIFECYCLE}\n"
    );
    let r = admin_post(&gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Paused: the controller writes nothing more on its own.
    let r = admin_post(&gw, "/releases/held/pause", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(release(&gw, "held").await["state"], "paused");
    let generation = gw.generation().await;
    let path = fx.path("releases.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["releases"][0]["state"]["phase"] = "rolled_back".into();
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    // Within the debounce the generation is the old one, and so is the state.
    let shown = release(&gw, "held").await;
    assert_eq!(
        gw.generation().await,
        generation,
        "reloaded within the debounce"
    );
    assert_eq!(shown["state"], "paused", "{shown}");
    // Once the edit's generation serves, the API shows it, and gray is gone.
    eventually(
        "the rollback generation",
        Duration::from_secs(30),
        || async { release(&gw, "held").await["state"] == "rolled_back" },
    )
    .await;
    assert!(gw.generation().await > generation);
    let before = gray.answered();
    for i in 0..50 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("u{i}"))
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(gray.answered(), before);
}
