//! The release judgement on real traffic: two identical healthy nodes never
//! fail in 200 looks at the default thresholds, while an 8× slower gray
//! and a gray with 1 pp more errors fail once the sample can tell; both lanes
//! are timed from the lane decision (a slow lane script on formal's
//! requests does not hide a slow gray); a last step of weight 100 is
//! promotion; a release on a lane nothing serves is refused, or judged
//! `error` when its state is edited so.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{admin_post, release, release_nodes, LIFECYCLE};
use crate::harness::*;
use http::StatusCode;

/// `n` concurrent clients of [`user_traffic`].
struct Users {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<u64>>,
}

impl Users {
    fn start(gw: &Gateway, n: usize) -> Users {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|_| user_traffic(gw.addr, stop.clone()))
            .collect();
        Users { stop, tasks }
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let mut sent = 0;
        for t in self.tasks {
            sent += t.await.unwrap();
        }
        sent
    }
}

/// Formal `f1` and gray `g1` on `/api/`; `extra` goes into the main file.
fn gateway(fx: &Fixture, formal: &Backend, gray: &Backend, extra: &str) -> Gateway {
    release_nodes(formal, gray).write(fx, "nodes.yaml");
    Config::new()
        .set("workers", 2)
        .node_files(&["nodes.yaml"])
        .raw(extra)
        .routes(&[Route::service("/api/", "api")])
        .write(fx, "gg.yaml");
    Gateway::start(&fx.path("gg.yaml"))
}

/// The judged windows of a release (not its actions).
fn windows(doc: &serde_json::Value) -> Vec<serde_json::Value> {
    doc["analyses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| {
            ["pass", "fail", "inconclusive", "error"].contains(&a["outcome"].as_str().unwrap())
        })
        .cloned()
        .collect()
}

/// Polls the release (a few times a second: its document grows with every
/// interval) until `done` holds, failing after `limit` with its windows.
async fn wait_for(
    gw: &Gateway,
    name: &str,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let doc = release(gw, name).await;
        if done(&doc) {
            return doc;
        }
        if std::time::Instant::now() > deadline {
            let ws: Vec<String> = windows(&doc)
                .iter()
                .map(|a| {
                    format!(
                        "{} g{} f{} {}",
                        a["outcome"], a["gray"]["requests"], a["formal"]["requests"], a["reason"]
                    )
                })
                .collect();
            panic!(
                "release {name} timed out: state {}\n{}",
                doc["state"],
                ws.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn count(ws: &[serde_json::Value], outcome: &str) -> usize {
    ws.iter().filter(|a| a["outcome"] == outcome).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_healthy_nodes_never_fail_a_window_in_200_intervals() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 0, StatusCode::OK).await,
    );
    let fx = Fixture::new();
    let gw = gateway(&fx, &formal, &gray, "");
    // The default thresholds; only the interval is short.
    let spec = "name: same\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 100 }\n";
    let r = admin_post(&gw, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let users = Users::start(&gw, 4);
    let doc = wait_for(&gw, "same", Duration::from_secs(120), |doc| {
        let ws = windows(doc);
        ws.len() >= 200 && count(&ws, "pass") >= 1
    })
    .await;
    users.stop().await;
    let ws = windows(&doc);
    let fails: Vec<_> = ws.iter().filter(|a| a["outcome"] == "fail").collect();
    assert!(fails.is_empty(), "{fails:#?}");
    assert_eq!(doc["state"], "progressing");
    assert_eq!(doc["failures"], 0);
    // Every pass had the evidence behind it: a sample that would have
    // caught a gray 2.4 × slower, and gray's excess error rate bounded
    // within 0.5 pp (which takes about 720 requests per lane).
    for p in ws.iter().filter(|a| a["outcome"] == "pass") {
        assert!(
            p["detectable_latency_ratio"].as_f64().unwrap() <= 2.4,
            "{p}"
        );
        assert!(p["detectable_error_rise_pp"].as_f64().is_some(), "{p}");
        for lane in ["gray", "formal"] {
            assert!(p[lane]["requests"].as_u64().unwrap() >= 700, "{p}");
        }
    }
    eprintln!(
        "identical nodes: {} intervals, {} passed, {} inconclusive, 0 failed",
        ws.len(),
        count(&ws, "pass"),
        count(&ws, "inconclusive")
    );
}

/// Runs `spec` on real traffic until the release is rolled back; returns
/// its judged windows. The release must be rolled back before gray has
/// served `max_gray` requests: the test bounds the sample, not the time a
/// loaded machine takes to send it (the wall-clock limit is only a guard).
/// (A few clients: a saturated gateway's queueing, not the nodes, would be
/// the tail of both lanes.)
async fn rolled_back(
    gw: &Gateway,
    name: &str,
    spec: &str,
    clients: usize,
    max_gray: u64,
) -> Vec<serde_json::Value> {
    let r = admin_post(gw, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let users = Users::start(gw, clients);
    let gray = |d: &serde_json::Value| {
        windows(d)
            .last()
            .and_then(|a| a["gray"]["requests"].as_u64())
            .unwrap_or(0)
    };
    let doc = wait_for(gw, name, Duration::from_secs(600), |d| {
        d["state"] == "rolled_back" || gray(d) > max_gray
    })
    .await;
    users.stop().await;
    let ws = windows(&doc);
    assert_eq!(
        doc["state"], "rolled_back",
        "not rolled back within {max_gray} gray requests: {ws:#?}"
    );
    ws
}

/// The first failed window came no later than the third interval — or,
/// on a machine too slow to carry the sample that decides (`need` gray
/// requests) in one interval, within three intervals of the first window
/// that carried it. A failure on a window smaller than `need` came
/// sooner than that, and passes.
fn failed_within_three_intervals(ws: &[serde_json::Value], need: u64) {
    let first = ws.iter().position(|a| a["outcome"] == "fail").unwrap();
    let sufficient = ws
        .iter()
        .position(|a| a["gray"]["requests"].as_u64().unwrap() >= need)
        .unwrap_or(first);
    assert!(
        first <= sufficient + 2,
        "first failure at interval {}, the minimum met at {}: {ws:#?}",
        first + 1,
        sufficient + 1
    );
    eprintln!(
        "failed at interval {} (the sample minimum met at {})",
        first + 1,
        sufficient + 1
    );
    assert_eq!(count(ws, "pass"), 0, "{ws:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eight_times_slower_gray_fails_within_three_intervals() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 0, StatusCode::OK).await,
    );
    // Delays well above a loaded machine's scheduling tail (tens of
    // milliseconds under a busy suite), so 8x stays visible in the p99.
    formal.set_delay(Duration::from_millis(5));
    gray.set_delay(Duration::from_millis(40));
    let fx = Fixture::new();
    let gw = gateway(&fx, &formal, &gray, "");
    let spec = "name: slow\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 4000 }\n";
    let ws = rolled_back(&gw, "slow", spec, 8, 2_000).await;
    failed_within_three_intervals(&ws, 100);
    let fail = ws.iter().find(|a| a["outcome"] == "fail").unwrap();
    assert!(
        fail["reason"].as_str().unwrap().contains("p99 fail"),
        "{fail}"
    );
    assert!(
        fail["reason"]
            .as_str()
            .unwrap()
            .contains("failure 1 of 2 (consecutive)"),
        "{fail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gray_with_one_point_more_errors_fails_once_its_sample_can_tell() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 100, StatusCode::OK).await,
    );
    let fx = Fixture::new();
    let gw = gateway(&fx, &formal, &gray, "");
    let spec = "name: errs\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 2000 }\n";
    let ws = rolled_back(&gw, "errs", spec, 16, 40_000).await;
    // The sequential test fails a +1 pp gray once its sample could detect
    // a 1 pp rise (each look states it): about 4,000 gray requests with
    // formal at 0 errors and the default 0.5 pp margin.
    let need = ws
        .iter()
        .find(|a| {
            a["detectable_error_rise_pp"]
                .as_f64()
                .is_some_and(|d| d <= 1.0)
        })
        .map_or(u64::MAX, |a| a["gray"]["requests"].as_u64().unwrap());
    failed_within_three_intervals(&ws, need);
    let fail = ws.iter().find(|a| a["outcome"] == "fail").unwrap();
    assert!(
        fail["reason"].as_str().unwrap().contains("errors fail"),
        "{fail}"
    );
    let rate = fail["gray"]["error_rate_pct"].as_f64().unwrap();
    assert!((0.9..1.1).contains(&rate), "{fail}");
}

/// Busy work in the lane script: every formal-bucket request on the
/// release's routes runs it; a request in the release's share does not.
const SLOW_SCRIPT: &str = "return function(req)\n  local s = 0\n  for i = 1, 6000000 do s = s + i % 7 end\n  return nil\nend\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_script_on_formal_requests_does_not_hide_a_slow_gray() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 0, StatusCode::OK).await,
    );
    let fx = Fixture::new();
    fx.write("lane.lua", SLOW_SCRIPT);
    let gw = gateway(
        &fx,
        &formal,
        &gray,
        "script: lane.lua\nscript_limits: { instruction_budget: 500000000 }\n",
    );
    // Calibration, not a speed check: the script's time on this machine
    // (the median of formal requests before the release). Gray is slower
    // by half of it from the lane decision on, and faster from the
    // connection's start (gray's requests skip the script) — so only a
    // lane timed from the decision fails it, above a loaded machine's
    // scheduling noise.
    let mut took = Vec::new();
    for i in 0..15 {
        let at = std::time::Instant::now();
        let r = Req::get("/api/x")
            .header("X-User", &format!("c{i}"))
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200);
        took.push(at.elapsed());
    }
    took.sort();
    let script = took[took.len() / 2];
    gray.set_delay(script / 2);
    eprintln!(
        "slow script: {script:?} per formal request; gray delayed {:?}",
        script / 2
    );
    // One step that would promote on a pass.
    let spec = "name: timed\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 1 }\nanalysis: { interval_ms: 1000, quantile: 0.5, max_error_delta_pp: 5 }\n";
    // One client: no request waits behind another's script run.
    let ws = rolled_back(&gw, "timed", spec, 1, 2_000).await;
    // Formal's requests spent the script's time before the lane was
    // decided; from the decision on, formal is the faster lane. (The
    // median: the tails of a loaded machine are the scheduler's.)
    let fail = ws.iter().find(|a| a["outcome"] == "fail").unwrap();
    let reason = fail["reason"].as_str().unwrap();
    assert!(reason.contains("p50 fail"), "{fail}");
    eprintln!("slow script: {reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_step_of_weight_100_is_promotion() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 0, StatusCode::OK).await,
    );
    let fx = Fixture::new();
    let gw = gateway(&fx, &formal, &gray, "");
    // Weight 100 anywhere but last, or as the only step: refused.
    for steps in [
        "[{ weight: 100 }]",
        "[{ weight: 50 }, { weight: 100 }, { weight: 100 }]",
    ] {
        let spec = format!("name: bad\nlane: gray\nsteps: {steps}\n");
        let r = admin_post(&gw, "/releases", &spec).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains("weight 100 is promotion"), "{}", r.text());
    }
    let spec = format!(
        "name: full\nlane: gray\nroutes: [/api/]\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 1 }}\n  - {{ weight: 100 }}\n{LIFECYCLE}\n"
    );
    let r = admin_post(&gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let users = Users::start(&gw, 2);
    let doc = wait_for(&gw, "full", Duration::from_secs(30), |d| {
        d["state"] == "promoted"
    })
    .await;
    users.stop().await;
    let last = doc["analyses"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["outcome"], "promote", "{doc}");
    assert_eq!(doc["weight"], 100.0);
    assert!(windows(&doc).iter().all(|a| a["weight"] == 50.0), "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_lane_nothing_serves_is_refused_or_judged_error() {
    let (formal, gray) = (
        Backend::text("formal", 0, StatusCode::OK).await,
        Backend::text("gray", 0, StatusCode::OK).await,
    );
    let fx = Fixture::new();
    let gw = gateway(&fx, &formal, &gray, "");
    let spec = "name: nobody\nlane: blue\nsteps:\n  - { weight: 10 }\n";
    let r = admin_post(&gw, "/releases", spec).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("lane \"blue\" has no nodes"),
        "{}",
        r.text()
    );
    // The command line says the same.
    let file = fx.write("nobody.yaml", spec);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["release", "create", file.to_str().unwrap()])
        .args(["--admin", &gw.admin.unwrap().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("400") && err.contains("no nodes"),
        "{err}"
    );
    // The state edited by hand (as an etcd edit would): judged `error`.
    let spec = "name: edited\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 200, min_requests: 1 }\n";
    assert_eq!(admin_post(&gw, "/releases", spec).await.status, 201);
    let state = fx.path("releases.json");
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(text.contains("\"lane\": \"gray\""), "{text}");
    std::fs::write(
        &state,
        text.replace("\"lane\": \"gray\"", "\"lane\": \"blue\""),
    )
    .unwrap();
    let users = Users::start(&gw, 1);
    eventually("judged error", Duration::from_secs(30), || async {
        let doc = release(&gw, "edited").await;
        doc["lane"] == "blue"
            && windows(&doc).iter().any(|a| {
                a["outcome"] == "error"
                    && a["reason"].as_str().unwrap().contains("nothing serves it")
            })
    })
    .await;
    users.stop().await;
    let doc = release(&gw, "edited").await;
    assert_eq!(doc["state"], "progressing");
    assert_eq!(doc["failures"], 0);
}
