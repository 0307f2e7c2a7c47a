//! A release's lifecycle ends: a promoted release is finished (`DELETE`,
//! or `finish`), optionally relabelling the node files so the promoted
//! lane's nodes become formal and the old formal nodes drain; a rolled-back
//! one is finished and its lane is no longer revoked; a new release on a
//! lane or routes that a running or promoted release holds is refused with
//! the reason; and a judged decision is written without a reload, so the
//! generation still says when the configuration changed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{admin_post, release, release_nodes};
use crate::harness::*;

struct Lifecycle {
    fx: Fixture,
    gw: Gateway,
    formal: Backend,
    gray: Backend,
}

/// Formal `f1` and gray `g1` behind `/api/` (node file `nodes.yaml`).
async fn setup() -> Lifecycle {
    let formal = Backend::start("f1", "formal").await;
    let gray = Backend::start("g1", "gray").await;
    let fx = Fixture::new();
    release_nodes(&formal, &gray).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    Lifecycle {
        fx,
        gw,
        formal,
        gray,
    }
}

/// A release `name` on `lane` and `routes`, judged rarely (these tests
/// drive it by hand).
fn spec(name: &str, lane: &str, routes: &str) -> String {
    format!(
        "name: {name}\nlane: {lane}\nroutes: {routes}\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 600000 }}\nanalysis: {{ interval_ms: 600000 }}\n"
    )
}

async fn admin(gw: &Gateway, method: &str, path: &str) -> Resp {
    Req::get(path).method(method).send(gw.admin.unwrap()).await
}

/// The node each of `n` users gets on `/api/x`.
async fn served_by(gw: &Gateway, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..n {
        let r = Req::get("/api/x")
            .header("X-User", &format!("u{i}"))
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        out.push(r.node());
    }
    out
}

async fn status(gw: &Gateway) -> serde_json::Value {
    Req::get("/status").send(gw.admin.unwrap()).await.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_release_is_finished_and_its_routes_follow_the_rules_again() {
    let s = setup().await;
    let r = admin_post(&s.gw, "/releases", &spec("r1", "gray", "[/api/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    // A running release cannot be finished: promote or abort it first.
    let r = admin(&s.gw, "DELETE", "/releases/r1").await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.text().contains("promote or abort it first"),
        "{}",
        r.text()
    );

    let r = admin_post(&s.gw, "/releases/r1/promote", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(served_by(&s.gw, 10).await.iter().all(|n| n == "g1"));

    let r = admin(&s.gw, "DELETE", "/releases/r1").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "finished");
    // The release's rule is gone: the routes follow the rules (formal).
    assert!(served_by(&s.gw, 10).await.iter().all(|n| n == "f1"));
    let doc = release(&s.gw, "r1").await;
    assert_eq!(doc["state"], "finished");
    assert_eq!(doc["weight"], 0.0);
    let last = doc["analyses"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["outcome"], "finish", "{last}");
    // Finished is the end: no action moves it, a second finish is refused.
    for path in ["/releases/r1/abort", "/releases/r1/finish"] {
        let r = admin_post(&s.gw, path, "").await;
        assert_eq!(r.status, 409, "{path}: {}", r.text());
    }
    // Its name may be used again.
    let r = admin_post(&s.gw, "/releases", &spec("r1", "gray", "[/api/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["state"], "progressing");
    let all = Req::get("/releases").send(s.gw.admin.unwrap()).await.json();
    assert_eq!(all["releases"].as_array().unwrap().len(), 1, "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finishing_with_relabel_nodes_makes_the_new_version_formal_and_drains_the_old() {
    let s = setup().await;
    let r = admin_post(&s.gw, "/releases", &spec("r1", "gray", "[/api/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Relabelling applies to a promoted release only.
    let r = admin_post(&s.gw, "/releases/r1/finish?relabel_nodes=true", "").await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(
        admin_post(&s.gw, "/releases/r1/promote", "").await.status,
        200
    );

    let r = admin_post(&s.gw, "/releases/r1/finish?relabel_nodes=true", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "finished");
    // The node file: g1 is formal now (its name kept), f1 drains.
    let file: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(s.fx.path("nodes.yaml")).unwrap()).unwrap();
    let nodes = file["services"]["api"]["nodes"].as_sequence().unwrap();
    let by_name = |n: &str| {
        nodes
            .iter()
            .find(|x| x["name"].as_str() == Some(n))
            .unwrap_or_else(|| panic!("{n} in {file:?}"))
            .clone()
    };
    assert_eq!(by_name("g1")["lane"].as_str(), Some("formal"));
    assert_eq!(by_name("f1")["drain"].as_bool(), Some(true));
    // Every request goes to the new version, none to the old one, and
    // `/nodes` says so.
    let before = s.formal.count();
    assert!(served_by(&s.gw, 20).await.iter().all(|n| n == "g1"));
    assert_eq!(s.formal.count(), before);
    let nodes = Req::get("/nodes").send(s.gw.admin.unwrap()).await.json();
    let text = nodes.to_string();
    assert!(text.contains("\"drain\":true"), "{text}");
    let _ = &s.gray;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_rollback_lifts_the_lanes_revocation() {
    let formal = Backend::start("f1", "formal").await;
    let gray = Backend::start("g1", "gray").await;
    let fx = Fixture::new();
    release_nodes(&formal, &gray).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .raw("rules:\n  enabled: true\n  rules:\n    - { name: beta, lane: gray, header: { name: X-Beta, values: [\"1\"] } }\n")
        .start(&fx, "gg.yaml");
    let req = Req::get("/api/x").header("X-Beta", "1");
    let beta = || req.send(gw.addr);
    assert_eq!(beta().await.node(), "g1");
    let r = admin_post(&gw, "/releases", &spec("r1", "gray", "[/api/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(admin_post(&gw, "/releases/r1/abort", "").await.status, 200);
    assert_eq!(beta().await.node(), "f1", "a rolled-back lane is revoked");
    // Relabelling a rolled-back release makes no sense.
    let r = admin_post(&gw, "/releases/r1/finish?relabel_nodes=true", "").await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = admin(&gw, "DELETE", "/releases/r1").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "finished");
    // Finished: the rule reaches the lane again.
    assert_eq!(beta().await.node(), "g1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_held_lane_or_overlapping_routes_is_refused_with_the_reason() {
    let formal = Backend::start("f1", "formal").await;
    let gray = Backend::start("g1", "gray").await;
    let other = Backend::start("b1", "gray-b").await;
    let fx = Fixture::new();
    let api = Service::new("api").set("health", "{ passive: { max_fails: 0 } }");
    Nodes::new()
        .service(api.nodes([
            Node::new("f1", formal.addr),
            Node::new("g1", gray.addr).lane("gray"),
            Node::new("b1", other.addr).lane("gray-b"),
        ]))
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/", "api")])
        .start(&fx, "gg.yaml");
    let r = admin_post(&gw, "/releases", &spec("r1", "gray", "[/api/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        admin_post(&gw, "/releases/r1/promote", "").await.status,
        200
    );
    // Routes inside the promoted release's: refused, with the reason.
    let r = admin_post(&gw, "/releases", &spec("r2", "gray-b", "[/api/v1/]")).await;
    assert_eq!(r.status, 409, "{}", r.text());
    let why = r.text();
    assert!(
        why.contains("overlaps")
            && why.contains("\"r1\" (promoted)")
            && why.contains("finish it first"),
        "{why}"
    );
    // The same lane elsewhere: refused.
    let r = admin_post(&gw, "/releases", &spec("r3", "gray", "[/web/]")).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.text().contains("lane \"gray\" is held by release \"r1\""),
        "{}",
        r.text()
    );
    // Other routes and another lane: fine.
    let r = admin_post(&gw, "/releases", &spec("r4", "gray-b", "[/web/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Once r1 is finished its routes are free.
    assert_eq!(admin(&gw, "DELETE", "/releases/r1").await.status, 200);
    let r = admin_post(&gw, "/releases", &spec("r2", "gray", "[/api/v1/]")).await;
    assert_eq!(r.status, 201, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judged_decisions_are_written_without_a_reload() {
    let s = setup().await;
    let spec = "name: quiet\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\n  - { weight: 80 }\nanalysis: { interval_ms: 100 }\n";
    let r = admin_post(&s.gw, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let st = status(&s.gw).await;
    let (generation, applied) = (st["generation"].clone(), st["reloads_applied"].clone());
    let stop = Arc::new(AtomicBool::new(false));
    let t = user_traffic(s.gw.addr, stop.clone());
    // Twenty judged intervals, each written to the state file.
    eventually("twenty decisions", Duration::from_secs(60), || async {
        release(&s.gw, "quiet").await["analyses"]
            .as_array()
            .is_some_and(|a| a.len() > 20)
    })
    .await;
    let on_disk = std::fs::read_to_string(s.fx.path("releases.json")).unwrap();
    let file: serde_json::Value = serde_json::from_str(&on_disk).unwrap();
    assert!(
        file["releases"][0]["state"]["history"]
            .as_array()
            .unwrap()
            .len()
            > 20,
        "the decisions are on disk"
    );
    // Had the watcher taken the controller's writes for changes, twenty
    // of them would have reloaded by now.
    let st = status(&s.gw).await;
    assert_eq!(st["generation"], generation, "{st}");
    assert_eq!(st["reloads_applied"], applied, "{st}");
    // A step is a change of what routes: one reload.
    let r = admin_post(&s.gw, "/releases/quiet/promote", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let st = status(&s.gw).await;
    assert!(st["generation"].as_u64() > generation.as_u64(), "{st}");
    stop.store(true, Ordering::Relaxed);
    t.await.unwrap();
}
