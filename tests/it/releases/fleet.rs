//! Progressive releases in an etcd fleet, with a real etcd, real gateways
//! as processes and real traffic to real nodes: exactly one gateway leads;
//! both apply every step (their `/releases` and the lanes of real
//! requests); the leader judges on both gateways' summed counters (here the
//! traffic runs through the gateway that does not lead); the leader killed
//! → the other takes over within the lease TTL and the release goes on to
//! promotion; a failing gray is rolled back on both with no gray request
//! after; etcd down → both keep serving the step and the release does not
//! move until etcd is back (a gateway restarted meanwhile serves the step
//! from its cache); a restarted gateway resumes at the step, and an
//! abort through it applies on both.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::etcd::*;
use crate::harness::*;
use http::StatusCode;

/// Lease TTL of the election (and of the counters keys), seconds.
const TTL: u64 = 2;

struct Fleet {
    etcd: Etcd,
    _root: tempfile::TempDir,
    gws: Vec<Gateway>,
    gray: Backend,
    _formal: Backend,
    _conf: Conf,
}

fn extra() -> String {
    format!("  leader_ttl_secs: {TTL}\n  counters_ms: 100\n")
}

async fn fleet(prefix: &str, gray_fail_every: u64) -> Fleet {
    let etcd = Etcd::start(1).await;
    let formal = Backend::text("formal", 0, StatusCode::OK).await;
    let gray = Backend::text("gray", gray_fail_every, StatusCode::OK).await;
    let conf = Conf::new(&super::release_nodes(&formal, &gray).to_yaml(), "");
    let main = Config::empty()
        .listen("127.0.0.1:0")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")]);
    conf.write("main.yaml", &main.to_yaml());
    let rev = push(&etcd, prefix, &conf);
    let root = tempfile::tempdir().unwrap();
    let gws: Vec<Gateway> = ["gw-a", "gw-b"]
        .iter()
        .map(|id| etcd.gateway_with(root.path(), id, prefix, &extra()))
        .collect();
    for g in &gws {
        g.wait_revision(rev).await;
    }
    Fleet {
        etcd,
        _root: root,
        gws,
        gray,
        _formal: formal,
        _conf: conf,
    }
}

async fn releases(gw: &Gateway) -> serde_json::Value {
    gw.admin_get("/releases").await.json()
}

async fn release(gw: &Gateway, name: &str) -> serde_json::Value {
    gw.admin_get(&format!("/releases/{name}")).await.json()
}

async fn post(gw: &Gateway, path: &str, body: &str) -> Resp {
    Req::get(path)
        .method("POST")
        .body(body.to_string())
        .send(gw.admin.unwrap())
        .await
}

/// Waits until exactly one gateway leads and every gateway names it.
async fn leader_of(gws: &[&Gateway]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut views = Vec::new();
        for g in gws {
            views.push(releases(g).await["fleet"].clone());
        }
        let leading: Vec<usize> = (0..gws.len())
            .filter(|i| views[*i]["this_gateway_leads"] == true)
            .collect();
        let named: std::collections::BTreeSet<String> =
            views.iter().map(|v| v["leader"].to_string()).collect();
        if leading.len() == 1 && named.len() == 1 {
            let l = leading[0];
            let id = gws[l]
                .dir()
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(views[l]["leader"], id, "{views:?}");
            return l;
        }
        assert!(Instant::now() < deadline, "no single leader: {views:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Requests from many users (`X-User`) through each of `addrs` until
/// stopped; a gateway that is gone just fails them.
struct Traffic {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    fn start(addrs: &[SocketAddr]) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = addrs
            .iter()
            .map(|&a| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let user = format!("u{}", n % 997);
                        if try_get(a, "/api/x", Some(("X-User", &user))).await.is_err() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        Traffic { stop, tasks }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Which of users u0..u(n-1) this gateway sends to gray.
async fn gray_users(gw: &Gateway, n: usize) -> Vec<bool> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let user = format!("u{i}");
        let r = try_get(gw.addr, "/api/x", Some(("X-User", &user)))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        out.push(r.text() == "gray");
    }
    out
}

/// `/releases/NAME`, or null while this gateway has not seen it yet (a
/// release created through another gateway reaches it by the etcd watch).
async fn release_seen(gw: &Gateway, name: &str) -> serde_json::Value {
    let r = gw.admin_get(&format!("/releases/{name}")).await;
    if r.status == 404 {
        return serde_json::Value::Null;
    }
    r.json()
}

/// Waits until every gateway's `/releases/NAME` satisfies `pred`; returns
/// how long the slowest took after the first.
async fn on_all(
    gws: &[&Gateway],
    name: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Duration {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut first: Option<Instant> = None;
    let mut done = vec![false; gws.len()];
    loop {
        for (i, g) in gws.iter().enumerate() {
            if !done[i] && pred(&release_seen(g, name).await) {
                done[i] = true;
                first.get_or_insert_with(Instant::now);
            }
        }
        if done.iter().all(|d| *d) {
            return first.map_or(Duration::ZERO, |f| f.elapsed());
        }
        // Once one gateway applied it, every other must follow from the
        // same watch event (how fast is measured by bench/, not here: the
        // bound only catches a gateway that never applies it).
        if let Some(f) = first {
            assert!(
                f.elapsed() < Duration::from_secs(15),
                "{what}: applied by one gateway, not by all within 15 s: {done:?}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not on every gateway: {done:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn analyses(doc: &serde_json::Value, outcome: &str) -> Vec<serde_json::Value> {
    doc["analyses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["outcome"] == outcome)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_leader_both_gateways_apply_every_step_judged_on_both_gateways_counts() {
    let f = fleet("/rf1", 0).await;
    let all: Vec<&Gateway> = f.gws.iter().collect();
    let l = leader_of(&all).await;
    let (lead, other) = (&f.gws[l], &f.gws[1 - l]);
    // Created through the gateway that does not lead.
    let spec = "name: r1\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 10, min_duration_ms: 1000 }\n  - { weight: 30, min_duration_ms: 1000 }\n  - { weight: 60, min_duration_ms: 1000 }\nanalysis: { interval_ms: 400, min_requests: 10, failure_threshold: 2, max_error_delta_pp: 5 }\n";
    let r = post(other, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    // The state lives in etcd, under the fleet's prefix.
    let stored: serde_json::Value =
        serde_json::from_str(&f.etcd.get("/rf1/releases/r1").await.unwrap()).unwrap();
    assert_eq!(stored["spec"]["name"], "r1");
    // Traffic only through the gateway that does not lead: the leader can
    // pass an interval only on the summed counters.
    let traffic = Traffic::start(&[other.addr]);
    let mut before: Vec<bool> = vec![false; 200];
    for (step, weight) in [(0, 10), (1, 30), (2, 60)] {
        on_all(&all, "r1", &format!("step {step}"), |d| {
            d["step"] == step && d["state"] == "progressing"
        })
        .await;
        // Held (through the leader) while the lanes of real requests are
        // compared on both gateways.
        let r = post(lead, "/releases/r1/pause", "").await;
        assert_eq!(r.status, 200, "{}", r.text());
        on_all(&all, "r1", "paused", |d| d["state"] == "paused").await;
        let (a, b) = (gray_users(lead, 200).await, gray_users(other, 200).await);
        assert_eq!(a, b, "both gateways serve step {step} alike");
        let n = a.iter().filter(|g| **g).count();
        assert!(
            n >= weight && n <= weight * 3,
            "{n} of 200 users gray at {weight}%"
        );
        // Raising the share only adds users.
        assert!(before.iter().zip(&a).all(|(was, is)| !was || *is));
        before = a;
        let r = post(other, "/releases/r1/resume", "").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    on_all(&all, "r1", "promoted", |d| d["state"] == "promoted").await;
    traffic.stop().await;
    assert!(gray_users(lead, 100).await.iter().all(|g| *g));
    assert!(gray_users(other, 100).await.iter().all(|g| *g));
    // The same state on both, with who leads.
    let (ra, rb) = (releases(lead).await, releases(other).await);
    assert_eq!(ra["releases"], rb["releases"]);
    assert_eq!(ra["fleet"]["leader"], rb["fleet"]["leader"]);
    let fleet_doc = lead.admin_get("/fleet").await.json();
    assert_eq!(fleet_doc["release_leader"], ra["fleet"]["leader"]);
    // Every pass summed both gateways' counts, with enough gray requests.
    let doc = release(lead, "r1").await;
    let passes = analyses(&doc, "pass");
    assert!(passes.len() >= 3, "{doc}");
    for p in &passes {
        assert_eq!(p["gateways"], 2, "{p}");
        assert!(p["gray"]["requests"].as_u64().unwrap() >= 10, "{p}");
    }
    // The leader's log has its judgements; the other's has none (only the
    // operator's actions it applied).
    let judged = |l: &str| l.contains("release decision") && l.contains("outcome=pass");
    lead.wait_log_line("a pass", judged).await;
    assert!(!other.logs().lines().any(judged));
    // Each judged interval rewrote the release's key, but only the steps
    // and the operator's actions (what routes) rebuilt a generation.
    let entries = doc["analyses"].as_array().unwrap();
    let windows = entries
        .iter()
        .filter(|a| {
            ["pass", "fail", "inconclusive", "error"].contains(&a["outcome"].as_str().unwrap())
        })
        .count();
    let moves = entries.len() - windows;
    for gw in [lead, other] {
        let st = gw.admin_get("/status").await.json();
        let applied = st["reloads_applied"].as_u64().unwrap() as usize;
        assert!(
            applied <= moves + 1 && applied < windows,
            "{applied} reloads for {moves} moves and {windows} judged intervals: {st}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_killed_the_other_takes_over_and_the_release_goes_on_to_promotion() {
    let mut f = fleet("/rf2", 0).await;
    let l = {
        let all: Vec<&Gateway> = f.gws.iter().collect();
        leader_of(&all).await
    };
    let spec = "name: r2\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 20, min_duration_ms: 300 }\n  - { weight: 50, min_duration_ms: 300 }\n  - { weight: 80, min_duration_ms: 4000 }\nanalysis: { interval_ms: 300, min_requests: 10, failure_threshold: 2, max_error_delta_pp: 5 }\n";
    let r = post(&f.gws[l], "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let traffic = Traffic::start(&[f.gws[0].addr, f.gws[1].addr]);
    {
        let all: Vec<&Gateway> = f.gws.iter().collect();
        on_all(&all, "r2", "step 1", |d| d["step"].as_u64() >= Some(1)).await;
    }
    // SIGKILL: no resignation, the lease must expire.
    f.gws[l].kill();
    let killed = Instant::now();
    let other = &f.gws[1 - l];
    eventually(
        "the other gateway leads",
        Duration::from_secs(TTL + 3),
        || async { releases(other).await["fleet"]["this_gateway_leads"] == true },
    )
    .await;
    let takeover = killed.elapsed();
    eprintln!("takeover after {takeover:?} (lease TTL {TTL} s)");
    eventually("promoted", Duration::from_secs(30), || async {
        release(other, "r2").await["state"] == "promoted"
    })
    .await;
    traffic.stop().await;
    let doc = release(other, "r2").await;
    // The dead gateway's counters expired with its lease: the last
    // intervals summed one gateway.
    let passes = analyses(&doc, "pass");
    assert_eq!(passes.last().unwrap()["gateways"], 1, "{doc}");
    assert!(passes.iter().any(|p| p["gateways"] == 2), "{doc}");
    // The killed gateway, restarted, resumes from etcd: promoted.
    f.gws[l].restart();
    let back = &f.gws[l];
    assert_eq!(release(back, "r2").await["state"], "promoted");
    assert!(gray_users(back, 50).await.iter().all(|g| *g));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_gray_is_rolled_back_on_both_gateways_and_gets_no_request_after() {
    let f = fleet("/rf3", 10).await;
    let all: Vec<&Gateway> = f.gws.iter().collect();
    let l = leader_of(&all).await;
    let spec = "name: bad\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 400, min_requests: 10, failure_threshold: 2 }\n";
    let r = post(&f.gws[1 - l], "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let traffic = Traffic::start(&[f.gws[0].addr, f.gws[1].addr]);
    on_all(&all, "bad", "rolled back", |d| d["state"] == "rolled_back").await;
    traffic.stop().await;
    let before = f.gray.answered();
    for g in &all {
        assert!(gray_users(g, 200).await.iter().all(|g| !*g));
    }
    assert_eq!(f.gray.answered(), before);
    let doc = release(&f.gws[l], "bad").await;
    let fails = analyses(&doc, "fail");
    assert_eq!(fails.len(), 2, "{doc}");
    assert_eq!(fails[0]["gateways"], 2);
    assert!(fails[0]["gray"]["error_rate_pct"].as_f64().unwrap() >= 4.0);
    assert!(fails[0]["reason"].as_str().unwrap().contains("error rate"));
    // Never moves again, whichever gateway is asked.
    for g in &all {
        assert_eq!(post(g, "/releases/bad/resume", "").await.status, 409);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_down_both_keep_serving_the_step_and_the_release_waits_for_etcd() {
    let mut f = fleet("/rf4", 0).await;
    let all: Vec<&Gateway> = f.gws.iter().collect();
    let l = leader_of(&all).await;
    let spec = "name: r4\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 30, min_duration_ms: 300 }\n  - { weight: 60, min_duration_ms: 300 }\nanalysis: { interval_ms: 300, min_requests: 10, failure_threshold: 1, max_error_delta_pp: 5 }\n";
    let r = post(&f.gws[l], "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    on_all(&all, "r4", "created", |d| d["state"] == "progressing").await;
    f.etcd.kill_all();
    let at_kill: Vec<serde_json::Value> = {
        let mut v = Vec::new();
        for g in &f.gws {
            v.push(release(g, "r4").await);
        }
        v
    };
    // Nobody leads without etcd (the leader stops within its lease).
    eventually("no leader", Duration::from_secs(TTL + 3), || async {
        for g in &f.gws {
            if releases(g).await["fleet"]["this_gateway_leads"] == true {
                return false;
            }
        }
        true
    })
    .await;
    // Both keep serving the step they had, alike, under real traffic that
    // would pass an interval.
    let traffic = Traffic::start(&[f.gws[0].addr, f.gws[1].addr]);
    let (a, b) = (
        gray_users(&f.gws[0], 200).await,
        gray_users(&f.gws[1], 200).await,
    );
    assert_eq!(a, b);
    assert!(a.iter().any(|g| *g));
    for (g, then) in f.gws.iter().zip(&at_kill) {
        assert_eq!(&release(g, "r4").await, then, "moved without etcd");
        // An operator's action cannot be stored: 503, nothing changed.
        let r = post(g, "/releases/r4/pause", "").await;
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(&release(g, "r4").await, then);
    }
    // A gateway restarted while etcd is down serves the release's step
    // from its last-known-good snapshot.
    f.gws[0].restart();
    assert_eq!(gray_users(&f.gws[0], 200).await, b);
    // Back: led again, and the release goes on — with no failed interval
    // from the outage.
    f.etcd.restart_all().await;
    let all: Vec<&Gateway> = f.gws.iter().collect();
    on_all(&all, "r4", "promoted", |d| d["state"] == "promoted").await;
    traffic.stop().await;
    let doc = release(&f.gws[0], "r4").await;
    assert!(analyses(&doc, "fail").is_empty(), "{doc}");
    assert!(analyses(&doc, "rollback").is_empty(), "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_gateway_resumes_at_the_step_and_an_abort_through_it_applies_on_both() {
    let mut f = fleet("/rf5", 0).await;
    let l = {
        let all: Vec<&Gateway> = f.gws.iter().collect();
        leader_of(&all).await
    };
    let spec = "name: r5\nlane: gray\nroutes: [/api/]\nkey: { header: X-User }\nsteps:\n  - { weight: 20, min_duration_ms: 300 }\n  - { weight: 50, min_duration_ms: 600000 }\nanalysis: { interval_ms: 300, min_requests: 10, failure_threshold: 2, max_error_delta_pp: 5 }\n";
    let r = post(&f.gws[1 - l], "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let traffic = Traffic::start(&[f.gws[0].addr, f.gws[1].addr]);
    {
        let all: Vec<&Gateway> = f.gws.iter().collect();
        on_all(&all, "r5", "step 1", |d| d["step"] == 1).await;
    }
    // The leader stopped gracefully (it resigns) and started again.
    f.gws[l].signal("TERM");
    let status = f.gws[l].wait_exit(Duration::from_secs(20)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    f.gws[l].restart();
    traffic.stop().await;
    let all: Vec<&Gateway> = f.gws.iter().collect();
    let back = &f.gws[l];
    let doc = release(back, "r5").await;
    assert_eq!(
        (doc["step"].as_u64(), doc["state"].as_str()),
        (Some(1), Some("progressing")),
        "{doc}"
    );
    let (a, b) = (
        gray_users(back, 200).await,
        gray_users(&f.gws[1 - l], 200).await,
    );
    assert_eq!(a, b);
    assert!(a.iter().filter(|g| **g).count() >= 50);
    // An abort through the restarted gateway: rolled back on both, and no
    // gray request after on either.
    let r = post(back, "/releases/r5/abort", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "rolled_back");
    on_all(&all, "r5", "rolled back", |d| d["state"] == "rolled_back").await;
    let before = f.gray.answered();
    for g in &all {
        assert!(gray_users(g, 200).await.iter().all(|g| !*g));
    }
    assert_eq!(f.gray.answered(), before);
}
