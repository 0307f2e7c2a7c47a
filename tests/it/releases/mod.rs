//! Progressive releases with real traffic through the gateway to real
//! nodes: a gray node with 5% errors is rolled back after the failure
//! threshold and gets no request after; a healthy gray is promoted through
//! every step; too little traffic holds the release inconclusive; a webhook
//! answering 500 holds it; a restarted gateway resumes at its step; sticky
//! users keep their lane while the share rises and lose it at a rollback.

mod fleet;
mod judgement;

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

async fn admin_post(gw: &Gateway, path: &str, body: &str) -> Resp {
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

const ANALYSIS: &str =
    "analysis: { interval_ms: 250, min_requests: 20, failure_threshold: 2, max_p99_ratio: 50 }";
/// Thresholds so lax that a healthy gray passes on little traffic: for the
/// tests of the lifecycle, not of the judgement (`judgement.rs`).
pub const LIFECYCLE: &str = "analysis: { interval_ms: 250, min_requests: 20, failure_threshold: 2, max_p99_ratio: 50, quantile: 0.5, max_error_delta_pp: 50 }";

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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_resumes_the_release_at_its_step() {
    let mut s = setup(0).await;
    let spec = format!(
        "name: durable\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 10, min_duration_ms: 1 }}\n  - {{ weight: 30, gate: manual, min_duration_ms: 1 }}\n  - {{ weight: 60, min_duration_ms: 1 }}\n{LIFECYCLE}\n"
    );
    assert_eq!(admin_post(&s.gw, "/releases", &spec).await.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    eventually("at the manual gate", Duration::from_secs(30), || async {
        let doc = release(&s.gw, "durable").await;
        doc["awaiting_promote"] == true && doc["step"] == 1
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_users_keep_their_lane_as_the_share_rises_and_lose_it_at_rollback() {
    let s = setup(0).await;
    let spec = "name: sticky\nlane: gray\nkey: { header: X-User }\nsteps:\n  - { weight: 20, min_duration_ms: 600000 }\n  - { weight: 80 }\nanalysis: { interval_ms: 100000, min_requests: 1 }\n";
    assert_eq!(admin_post(&s.gw, "/releases", spec).await.status, 201);
    // Find a user in the 20% and keep their cookie.
    let mut pinned = None;
    for i in 0..200 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("s{i}"))
            .send(s.gw.addr)
            .await;
        if r.text() == "gray" {
            pinned = r
                .header("set-cookie")
                .map(|c| c.split(';').next().unwrap().to_string());
            break;
        }
    }
    let cookie = pinned.expect("someone is in the 20%");
    // With the cookie and without the header, the user stays gray.
    for _ in 0..5 {
        let r = Req::get("/api/x")
            .header("Cookie", &cookie)
            .send(s.gw.addr)
            .await;
        assert_eq!(r.text(), "gray");
    }
    // Abort: the cookie no longer pins the rolled-back lane.
    let r = admin_post(&s.gw, "/releases/sticky/abort", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    for _ in 0..5 {
        let r = Req::get("/api/x")
            .header("Cookie", &cookie)
            .send(s.gw.addr)
            .await;
        assert_eq!(r.text(), "formal");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_command_line_drives_the_admin_api() {
    let s = setup(0).await;
    let admin = s.gw.admin.unwrap().to_string();
    let spec = s.fx.write(
        "rel.yaml",
        "name: cli\nlane: gray\nsteps:\n  - { weight: 5 }\nanalysis: { interval_ms: 100000 }\n",
    );
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
            .arg("release")
            .args(args)
            .args(["--admin", &admin])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = run(&["create", spec.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("\"state\":\"progressing\""), "{out}");
    let (ok, out, _) = run(&["list"]);
    assert!(ok && out.contains("\"name\":\"cli\""), "{out}");
    let (ok, out, _) = run(&["pause", "cli"]);
    assert!(ok && out.contains("\"state\":\"paused\""), "{out}");
    let (ok, out, _) = run(&["abort", "cli"]);
    assert!(ok && out.contains("\"state\":\"rolled_back\""), "{out}");
    // A refused action fails with the API's answer.
    let (ok, _, err) = run(&["resume", "cli"]);
    assert!(!ok && err.contains("409"), "{err}");
    let (ok, _, err) = run(&["show", "nope"]);
    assert!(!ok && err.contains("404"), "{err}");
}
