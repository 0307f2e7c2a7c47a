//! Fleet: etcd as the shared control plane, with a real etcd (Debian's
//! `etcd-server`, started here on free loopback ports, data in a temp dir,
//! killed at the end) and real graygate processes.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::browser::{wait_text, Driver};
use crate::harness::etcd::*;
use crate::harness::*;
use fantoccini::Locator;

const SCRIPT: &str =
    "return function(req)\n  if req:header('X-Gray') then return 'gray' end\nend\n";

async fn node_of(gw: &Gateway, gray: bool) -> String {
    let h = gray.then_some(("X-Gray", "1"));
    try_get(gw.addr, "/api/x", h).await.unwrap().node()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_converge_on_the_same_revision_after_a_push() {
    let etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f]), SCRIPT);
    let (_root, r1, [a, b]) = serve(&etcd, "/conv", &conf, ["gw-a", "gw-b"]).await;
    assert_eq!(a.status().await["source"], "etcd");
    assert_eq!(node_of(&a, true).await, "f1", "no gray node yet: formal");
    let gen_before = (
        a.status().await["generation"].clone(),
        b.status().await["generation"].clone(),
    );

    // One push changing two documents (nodes and script): one transaction,
    // one revision, one new generation on each gateway.
    conf.write("nodes.yaml", &nodes_yaml(&[&f, &g]));
    conf.write("gray.lua", "return function(req)\n  if req:header('X-Gray') then return 'gray' end\n  return nil\nend\n");
    let r2 = push(&etcd, "/conv", &conf);
    assert!(r2 > r1);
    a.wait_revision(r2).await;
    b.wait_revision(r2).await;
    assert_eq!(node_of(&a, true).await, "g1");
    assert_eq!(node_of(&b, true).await, "g1");
    assert_eq!(node_of(&b, false).await, "f1");
    assert_eq!(
        a.status().await["generation"],
        gen_before.0.as_u64().unwrap() + 1
    );
    assert_eq!(
        b.status().await["generation"],
        gen_before.1.as_u64().unwrap() + 1
    );
    let ha = a.status().await["config_hash"].clone();
    assert_eq!(ha, b.status().await["config_hash"]);

    // /fleet lists both, on the same revision.
    soon("fleet shows both on r2", || async {
        let fl = a.admin_get("/fleet").await.json();
        let gws = fl["gateways"].as_array().cloned().unwrap_or_default();
        gws.len() == 2
            && gws
                .iter()
                .all(|g| g["revision"] == r2 && g["config_hash"] == ha)
            && fl["same_revision"] == true
    })
    .await;
    let fl = b.admin_get("/fleet").await.json();
    let ids: Vec<&str> = fl["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["gw-a", "gw-b"]);
    assert!(fl["gateways"][0]["uptime_secs"].is_u64() && fl["gateways"][0]["version"].is_string());

    // --check of what is in etcd, and pull writes it back as pushed.
    let (ok, out) = graygate(&["--check", "--etcd", &etcd.url(), "--prefix", "/conv"]);
    assert!(ok && out.contains("configuration ok"), "{out}");
    let pulled = tempfile::tempdir().unwrap();
    let (ok, out) = graygate(&[
        "pull",
        "--etcd",
        &etcd.url(),
        "--prefix",
        "/conv",
        "--dir",
        pulled.path().to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    for f in ["main.yaml", "nodes.yaml", "gray.lua"] {
        assert_eq!(
            std::fs::read_to_string(pulled.path().join(f)).unwrap(),
            std::fs::read_to_string(conf.dir.path().join(f)).unwrap(),
            "{f}"
        );
    }
    // And the pulled files run as a files configuration (--check).
    let (ok, out) = graygate(&[
        "--check",
        "--config",
        pulled.path().join("main.yaml").to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_take_a_member_list_and_use_the_first_that_answers() {
    let etcd = Etcd::start(1).await;
    let [f] = backends([("f1", "formal")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f]), SCRIPT);
    // A member that is down comes first, as `register` and `--check` take them.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let list = format!("{dead},{}", etcd.url());
    let main = conf.main();
    let (ok, out) = graygate(&[
        "push",
        "--config",
        main.to_str().unwrap(),
        "--etcd",
        &list,
        "--prefix",
        "/list",
    ]);
    assert!(ok && out.contains("at revision"), "{out}");
    let (ok, out) = graygate(&["--check", "--etcd", &list, "--prefix", "/list"]);
    assert!(ok && out.contains("configuration ok"), "{out}");
    let pulled = tempfile::tempdir().unwrap();
    let dir = pulled.path().to_str().unwrap();
    let (ok, out) = graygate(&["pull", "--etcd", &list, "--prefix", "/list", "--dir", dir]);
    assert!(ok && out.contains("pulled 3 documents"), "{out}");
    assert_eq!(
        std::fs::read_to_string(pulled.path().join("gray.lua")).unwrap(),
        SCRIPT
    );
    // No member answering: an error naming each one tried, nothing written.
    let dead2 = format!("http://127.0.0.1:{}", free_port());
    let none = format!("{dead},{dead2}");
    let (ok, out) = graygate(&[
        "push",
        "--config",
        main.to_str().unwrap(),
        "--etcd",
        &none,
        "--prefix",
        "/list",
    ]);
    assert!(!ok && out.contains(&dead) && out.contains(&dead2), "{out}");
    let (ok, out) = graygate(&["pull", "--etcd", &none, "--prefix", "/list", "--dir", dir]);
    assert!(!ok && out.contains(&dead2), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broken_script_is_rejected_on_every_gateway_and_reported_per_gateway() {
    let etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &g]), SCRIPT);
    let (_root, r1, [a, b]) = serve(&etcd, "/bad", &conf, ["gw-a", "gw-b"]).await;

    // `push` refuses what --check refuses: nothing reaches etcd.
    conf.write(
        "gray.lua",
        "return function(req)\n  if req:header('X-Gray') then return 'gray'\nend\n",
    );
    let (ok, out) = try_push(&etcd, "/bad", &conf);
    assert!(!ok && out.contains("gray.lua:"), "{out}");
    assert_eq!(etcd.get("/bad/config/gray.lua").await.unwrap(), SCRIPT);

    // Written to etcd directly: every gateway rejects it with key:line, the
    // old generation keeps serving, the error shows in /status and /fleet.
    let key = "/bad/config/gray.lua";
    etcd.put(
        key,
        "return function(req)\n  if req:header('X-Gray') then return 'gray'\nend\n",
    )
    .await;
    for gw in [&a, &b] {
        soon("rejected", || async {
            gw.status().await["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.starts_with("/bad/config/gray.lua:"))
        })
        .await;
        let s = gw.status().await;
        assert_eq!(s["revision"], r1, "{s}");
        assert_eq!(s["last_reload_result"], "rejected");
        assert_eq!(
            node_of(gw, true).await,
            "g1",
            "the old script keeps serving"
        );
    }
    soon("fleet reports the error per gateway", || async {
        let fl = a.admin_get("/fleet").await.json();
        let gws = fl["gateways"].as_array().cloned().unwrap_or_default();
        gws.len() == 2
            && gws.iter().all(|g| {
                g["last_error"].as_str().is_some_and(|e| e.contains(key)) && g["revision"] == r1
            })
    })
    .await;
    let (ok, out) = graygate(&["--check", "--etcd", &etcd.url(), "--prefix", "/bad"]);
    assert!(!ok && out.contains("/bad/config/gray.lua:"), "{out}");

    // Fixed: applied on both, the error cleared.
    let r3 = etcd.put(key, "return function(req) return nil end\n").await;
    a.wait_revision(r3).await;
    b.wait_revision(r3).await;
    assert_eq!(node_of(&a, true).await, "f1");
    assert!(a.status().await["last_reload_error"].is_null());
}

/// The member that leads the cluster now.
async fn leader(etcd: &Etcd) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for (i, m) in etcd
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.child.is_some())
        {
            if let Ok(mut c) = etcd_client::Client::connect([m.client.as_str()], None).await {
                if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await {
                    if s.leader() != 0 && s.header().is_some_and(|h| h.member_id() == s.leader()) {
                        return i;
                    }
                }
            }
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_killed_watches_resume_without_a_request_error() {
    let mut etcd = Etcd::start(3).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &g]), SCRIPT);
    let r1 = push(&etcd, "/ha", &conf);
    // The gateways' first endpoint is the leader: killing it breaks their
    // connection, so they must move to another member.
    let l = leader(&etcd).await;
    etcd.first = Some(l);
    let root = tempfile::tempdir().unwrap();
    let a = etcd.gateway(root.path(), "gw-a", "/ha");
    let b = etcd.gateway(root.path(), "gw-b", "/ha");
    a.wait_revision(r1).await;
    b.wait_revision(r1).await;
    let load = Load::start(&[a.addr, b.addr]);
    load.wait_ok(20).await;

    // (Normally still the same member; on a busy machine an election may
    // have moved it: kill whichever leads now.)
    let l = leader(&etcd).await;
    etcd.kill(l);
    let new_leader = leader(&etcd).await;
    assert_ne!(new_leader, l);
    // A change after the failover reaches both gateways.
    let r2 = etcd
        .put_script("/ha", "return function(req) return 'gray' end\n")
        .await;
    a.wait_revision(r2).await;
    b.wait_revision(r2).await;
    assert_eq!(node_of(&a, false).await, "g1");
    assert_eq!(node_of(&b, false).await, "g1");
    load.wait_ok(20).await;
    load.stop_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_down_gateways_keep_serving_and_a_restart_serves_the_cached_snapshot() {
    let mut etcd = Etcd::start(3).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &g]), SCRIPT);
    let (root, r1, [a, mut b]) = serve(&etcd, "/down", &conf, ["gw-a", "gw-b"]).await;
    assert!(root.path().join("gw-b/cache/snapshot.json").is_file());

    // Every member stopped: both keep serving, the problem shows.
    etcd.kill_all();
    let load = Load::start(&[a.addr, b.addr]);
    for gw in [&a, &b] {
        eventually("store error shown", Duration::from_secs(15), || async {
            !gw.status().await["store_error"].is_null()
        })
        .await;
        // The state says it too: what serves may be behind the store.
        assert_eq!(gw.status().await["source_state"], "stale");
    }
    load.wait_ok(50).await;
    load.stop_clean().await;

    // Restarted while etcd is down: serves the cached snapshot, says so.
    b.restart();
    let s = b.status().await;
    assert_eq!(
        (s["source"].as_str(), s["source_state"].as_str()),
        (Some("etcd"), Some("cached")),
        "{s}"
    );
    assert_eq!(s["revision"], r1);
    assert_eq!(node_of(&b, true).await, "g1");
    assert_eq!(node_of(&b, false).await, "f1");

    // Without a cache it does not start (never an empty configuration).
    let boot = etcd.boot(root.path(), "gw-new", "/down", "");
    let (ok, out) = graygate(&["--config", boot.to_str().unwrap()]);
    assert!(!ok && out.contains("no usable cached snapshot"), "{out}");

    // etcd back, a change: both catch up, live.
    etcd.restart_all().await;
    let r2 = etcd
        .put_script("/down", "return function(req) return 'gray' end\n")
        .await;
    a.wait_revision(r2).await;
    b.wait_revision(r2).await;
    assert_eq!(node_of(&b, false).await, "g1");
    assert!(b.status().await["store_error"].is_null());
    assert_eq!(a.status().await["source_state"], "live");
}

/// The last-known-good snapshot cached by gateway `id` under `root`: its
/// revision and the script `gray.lua` it holds.
fn cached(root: &std::path::Path, id: &str, prefix: &str) -> (i64, String) {
    use base64::Engine;
    let path = root.join(id).join("cache/snapshot.json");
    let snap: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let script = snap["kvs"][format!("{prefix}/config/gray.lua")]["value"]
        .as_str()
        .map(|v| base64::engine::general_purpose::STANDARD.decode(v).unwrap())
        .unwrap_or_default();
    (
        snap["revision"].as_i64().unwrap(),
        String::from_utf8(script).unwrap(),
    )
}

async fn wait_rejected(gw: &Gateway, needle: &str) {
    soon("the snapshot rejected", || async {
        gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains(needle))
    })
    .await
}

/// A snapshot the gateway rejects, by its build (a broken script) or after
/// it (a listener change), is never written to the last-known-good cache:
/// a restart while etcd is down serves the good configuration before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rejected_snapshot_never_replaces_the_cached_one() {
    let mut etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &g]), SCRIPT);
    let (root, r1, [mut a]) = serve(&etcd, "/lkg", &conf, ["gw-a"]).await;
    assert_eq!(
        cached(root.path(), "gw-a", "/lkg"),
        (r1, SCRIPT.to_string())
    );
    // Rejected by the build.
    etcd.put_script("/lkg", "return function(req)\n  if then\nend\n")
        .await;
    wait_rejected(&a, "/lkg/config/gray.lua:2").await;
    assert_eq!(
        cached(root.path(), "gw-a", "/lkg"),
        (r1, SCRIPT.to_string())
    );
    etcd.kill_all();
    a.restart();
    let s = a.status().await;
    assert_eq!(
        (s["source_state"].as_str(), &s["revision"]),
        (Some("cached"), &r1.into()),
        "{s}"
    );
    assert_eq!(node_of(&a, true).await, "g1");
    assert_eq!(node_of(&a, false).await, "f1");

    // etcd back: the broken script is seen and rejected again; a good one
    // is applied and cached.
    etcd.restart_all().await;
    wait_rejected(&a, "/lkg/config/gray.lua:2").await;
    let good = "return function(req) return 'gray' end\n";
    let r3 = etcd.put_script("/lkg", good).await;
    a.wait_revision(r3).await;
    assert_eq!(cached(root.path(), "gw-a", "/lkg"), (r3, good.to_string()));

    // Built, then rejected by the gateway (listeners need a restart).
    let main = etcd.get("/lkg/config/main.yaml").await.unwrap();
    etcd.put(
        "/lkg/config/main.yaml",
        &format!("{main}listeners:\n  - {{ listen: 127.0.0.1:0, h2c: true }}\n"),
    )
    .await;
    wait_rejected(&a, "needs a restart").await;
    assert_eq!(cached(root.path(), "gw-a", "/lkg"), (r3, good.to_string()));
    etcd.kill_all();
    a.restart();
    let s = a.status().await;
    assert_eq!(
        (s["source_state"].as_str(), &s["revision"]),
        (Some("cached"), &r3.into()),
        "{s}"
    );
    assert_eq!(node_of(&a, false).await, "g1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compaction_past_the_watch_forces_a_full_reread() {
    let mut etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &g]), SCRIPT);
    let (_root, _r1, [mut a]) = serve(&etcd, "/cmp", &conf, ["gw-a"]).await;
    a.kill(); // stopped, its cache at r1

    // Changes while it is away, then their history compacted away.
    etcd.put_script("/cmp", "return function(req) return nil end\n")
        .await;
    let r3 = etcd
        .put_script("/cmp", "return function(req) return 'gray' end\n")
        .await;
    let mut c = etcd.client().await;
    c.compact(
        r3,
        Some(etcd_client::CompactionOptions::new().with_physical()),
    )
    .await
    .unwrap();
    drop(c);

    // It starts from the cache while etcd is down, then watches from r1 + 1
    // when etcd is back: compacted → a full re-read at the current revision.
    etcd.kill_all();
    a.restart();
    assert_eq!(a.status().await["source_state"], "cached");
    assert_eq!(node_of(&a, false).await, "f1");
    etcd.restart_all().await;
    a.wait_revision(r3).await;
    assert_eq!(node_of(&a, false).await, "g1");
    a.wait_log("compact_revision=").await;
    // And the watch goes on after the re-read.
    let r4 = etcd
        .put_script("/cmp", "return function(req) return nil end\n")
        .await;
    a.wait_revision(r4).await;
    assert_eq!(node_of(&a, false).await, "f1");
}

fn register(etcd: &Etcd, prefix: &str, b: &Backend, extra: &[&str]) -> Child {
    let eps = etcd.endpoints().join(",");
    let addr = b.addr.to_string();
    let mut args = vec![
        "register",
        "--etcd",
        &eps,
        "--prefix",
        prefix,
        "--service",
        "api",
        "--addr",
        &addr,
        "--id",
        &b.name,
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(&args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

struct Killer(Option<Child>);
impl Drop for Killer {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn node_names(gw: &Gateway) -> Vec<String> {
    let n = gw.admin_get("/nodes").await.json();
    n["services"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["name"] == "api")
        .flat_map(|s| s["nodes"].as_array().cloned().unwrap_or_default())
        .map(|n| {
            format!(
                "{}:{}",
                n["name"].as_str().unwrap(),
                n["lane"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_instances_carry_lane_metadata_and_leave_when_their_lease_expires() {
    let etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f]), SCRIPT);
    let r1 = push(&etcd, "/reg", &conf);
    // Spring-Cloud style: the lane is the `version` metadata.
    etcd.put("/reg/services/api/config", "lane_key: version\n")
        .await;
    let root = tempfile::tempdir().unwrap();
    let a = etcd.gateway(root.path(), "gw-a", "/reg");
    a.wait_revision(r1 + 1).await;
    let mut side = Killer(Some(register(
        &etcd,
        "/reg",
        &g,
        // A TTL of 2 s expired once mid-test under a loaded CI machine (the
        // sidecar's keep-alives every TTL/3 came late): 4 s.
        &["--meta", "version=gray", "--meta", "zone=hz", "--ttl", "4"],
    )));
    soon("registered", || async {
        node_names(&a).await.contains(&"g1:gray".to_string())
    })
    .await;
    let v: serde_json::Value =
        serde_json::from_str(&etcd.get("/reg/services/api/nodes/g1").await.unwrap()).unwrap();
    assert_eq!(v["metadata"]["zone"], "hz");
    assert_eq!(node_of(&a, true).await, "g1");

    // Drained through the admin API: the instance's own key changes (its
    // lease kept), so gray goes to formal.
    // The edit handler can see the registration a moment after `/nodes`
    // lists it (404 "no node"): asked again until it does.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let drain = Req::get("/nodes/api/g1/drain")
            .method("POST")
            .send(a.admin.unwrap())
            .await;
        if drain.status == 200 {
            break;
        }
        assert!(
            drain.status == 404 && Instant::now() < deadline,
            "{} {}",
            drain.status,
            drain.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v: serde_json::Value =
        serde_json::from_str(&etcd.get("/reg/services/api/nodes/g1").await.unwrap()).unwrap();
    assert_eq!(v["drain"], true, "{v}");
    let mut c = etcd.client().await;
    let kv = c.get("/reg/services/api/nodes/g1", None).await.unwrap();
    assert_ne!(kv.kvs()[0].lease(), 0, "the lease is kept");
    assert_eq!(node_of(&a, true).await, "f1");

    // The sidecar dies without deregistering: the lease expires (TTL 4 s)
    // and the instance leaves the candidate set.
    let mut child = side.0.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    eventually(
        "lease expiry removes the instance",
        Duration::from_secs(15),
        || async { !node_names(&a).await.iter().any(|n| n.starts_with("g1:")) },
    )
    .await;
    assert!(etcd.get("/reg/services/api/nodes/g1").await.is_none());
    assert_eq!(node_of(&a, true).await, "f1", "gray falls back to formal");
    eprintln!(
        "instance gone {:?} after the sidecar died (TTL 4 s)",
        killed.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_deregisters_before_the_instance_stops_with_zero_client_errors() {
    let etcd = Etcd::start(1).await;
    let [keep, leaving] = backends([("keep", "formal"), ("leaving", "formal")]).await;
    // A service without retries whose nodes all come from the registry: a
    // request sent to a stopped node would be a client error.
    let conf = Conf::new("services:\n  api: { retries: 0 }\n", SCRIPT);
    let mut s1 = Killer(Some(register(&etcd, "/term", &keep, &["--ttl", "5"])));
    let mut s2 = Killer(Some(register(
        &etcd,
        "/term",
        &leaving,
        &["--ttl", "5", "--drain", "1.5"],
    )));
    soon("both registered", || async {
        etcd.get("/term/services/api/nodes/keep").await.is_some()
            && etcd.get("/term/services/api/nodes/leaving").await.is_some()
    })
    .await;
    let (_root, _r, [a]) = serve(&etcd, "/term", &conf, ["gw-a"]).await;
    let load = Load::start(&[a.addr, a.addr]);
    eventually("both serve", Duration::from_secs(20), || async {
        keep.count() > 10 && leaving.count() > 10
    })
    .await;

    let pid = s2.0.as_ref().unwrap().id();
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    eventually("deregistered first", Duration::from_secs(5), || async {
        etcd.get("/term/services/api/nodes/leaving").await.is_none()
    })
    .await;
    let mut child = s2.0.take().unwrap();
    let st = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(st.success(), "sidecar exit {st}");
    // By the time the sidecar exits (after its drain period) the gateway
    // has dropped the instance; only now does the instance stop.
    assert_eq!(node_names(&a).await, ["keep:formal"]);
    let served = leaving.count();
    drop(leaving);
    load.wait_ok(100).await;
    load.stop_clean().await;
    assert!(served > 10);
    drop(s1.0.take().map(|mut c| {
        let _ = c.kill();
        c.wait()
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admin_edits_one_gets_409() {
    let etcd = Etcd::start(1).await;
    let [f, f2] = backends([("f1", "formal"), ("f2", "formal")]).await;
    let conf = Conf::new(&nodes_yaml(&[&f, &f2]), SCRIPT);
    let (_root, r1, [a, b]) = serve(&etcd, "/cas", &conf, ["gw-a", "gw-b"]).await;
    async fn patch(gw: &Gateway, weight: u32, rev: i64) -> Resp {
        let req = Req::get("/nodes/api/f1")
            .method("PATCH")
            .header("If-Match", &rev.to_string())
            .header("content-type", "application/json")
            .body(format!("{{\"weight\": {weight}}}"));
        req.send(gw.admin.unwrap()).await
    }
    // Both read revision r1; the first write wins, the second is refused.
    let first = patch(&a, 5, r1).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let second = patch(&b, 7, r1).await;
    assert_eq!(second.status, 409, "{}", second.text());
    let stored = etcd.get("/cas/config/nodes.yaml").await.unwrap();
    assert!(
        stored.contains("weight: 5") && !stored.contains("weight: 7"),
        "{stored}"
    );
    // The edit reached every gateway through etcd.
    let rev = a.status().await["revision"].as_i64().unwrap();
    assert!(rev > r1);
    b.wait_revision(rev).await;
    let n = b.admin_get("/nodes").await.json();
    assert_eq!(n["services"][0]["nodes"][0]["weight"], 5, "{n}");
    // Read again, retried: accepted. A gateway's `/status` can name the
    // new revision a moment before its edit check serves it (the check
    // then answers 409 "read again"), so the client reads again until the
    // two agree, as a client would.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let again = patch(&b, 7, rev).await;
        if again.status == 200 {
            break;
        }
        assert!(
            again.status == 409
                && again.text().contains(&format!("you read revision {rev}"))
                && std::time::Instant::now() < deadline,
            "{} {}",
            again.status,
            again.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Two edits at the same moment, each on what its gateway serves: the
    // compare-and-swap lets at most one through, never both silently.
    let rev = b.status().await["revision"].as_i64().unwrap();
    a.wait_revision(rev).await;
    let edit = |w: u32| {
        Req::get("/nodes/api/f2")
            .method("PATCH")
            .header("content-type", "application/json")
            .body(format!("{{\"weight\": {w}}}"))
    };
    let (ea, eb) = (edit(3), edit(4));
    let (x, y) = tokio::join!(ea.send(a.admin.unwrap()), eb.send(b.admin.unwrap()));
    let mut codes = [x.status, y.status];
    codes.sort();
    let stored = etcd.get("/cas/config/nodes.yaml").await.unwrap();
    if codes == [200, 200] {
        // Only possible if one gateway already served the other's edit
        // when it read: then the later one's value is stored.
        assert!(
            stored.contains("weight: 3") || stored.contains("weight: 4"),
            "{stored}"
        );
    } else {
        assert_eq!(codes, [200, 409], "{} / {}", x.text(), y.text());
    }
}

#[test]
fn without_etcd_nothing_changes_status_says_files() {
    // The files default: /status has source "files" and no etcd fields
    // (the shipped example itself is covered by the `example` module).
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let f = Backend::start("f1", "formal").await;
        let conf = Conf::new(&nodes_yaml(&[&f]), SCRIPT);
        let main = Config::empty()
            .listen("127.0.0.1:0")
            .set("admin_listen", "127.0.0.1:0")
            .script("gray.lua")
            .node_files(&["nodes.yaml"])
            .route_all("api");
        conf.write("main.yaml", &main.to_yaml());
        let gw = Gateway::start(&conf.main());
        let s = gw.status().await;
        assert_eq!(s["source"], "files");
        assert!(
            s.get("source_state").is_none() && s.get("revision").is_none(),
            "{s}"
        );
        let fleet = Req::get("/fleet").send(gw.admin.unwrap()).await;
        assert_eq!(fleet.status, 404);
        assert_eq!(gw.get("/x").await.node(), "f1");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_rule_edits_are_written_to_etcd_with_compare_and_swap() {
    let etcd = Etcd::start(1).await;
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let conf = Conf::new(
        &nodes_yaml(&[&f, &g]),
        "return function(req) return nil end\n",
    );
    let main = Config::empty()
        .listen("127.0.0.1:0")
        .script("gray.lua")
        .node_files(&["nodes.yaml"])
        .rules_file("rules.yaml")
        .route_all("api");
    conf.write("main.yaml", &main.to_yaml());
    conf.write(
        "rules.yaml",
        "uid: { header: X-User-Id }\nrules:\n  - name: everyone\n    lane: gray\n    percentage: 0\n    key: { ip: true }\n",
    );
    let (_root, r1, [a, b]) = serve(&etcd, "/rules", &conf, ["gw-a", "gw-b"]).await;
    assert_eq!(node_of(&b, false).await, "f1");
    let set = |pct: u32, rev: i64| {
        Req::get("/rules/everyone")
            .method("PATCH")
            .header("If-Match", &rev.to_string())
            .header("content-type", "application/json")
            .body(format!("{{\"percentage\": {pct}}}"))
    };
    let (first, second) = (set(100, r1), set(50, r1));
    let ok = first.send(a.admin.unwrap()).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let stale = second.send(b.admin.unwrap()).await;
    assert_eq!(stale.status, 409, "{}", stale.text());
    let stored = etcd.get("/rules/config/rules.yaml").await.unwrap();
    assert!(stored.contains("percentage: 100"), "{stored}");
    let rev = a.status().await["revision"].as_i64().unwrap();
    b.wait_revision(rev).await;
    assert_eq!(
        node_of(&b, false).await,
        "g1",
        "the edit reached the other gateway"
    );
}

// The dashboard's fleet panel in headless Chromium (Debian's `chromium` +
// `chromium-driver`, as the `dashboard` module).

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_lists_every_gateway_and_whether_all_run_the_same_revision() {
    let etcd = Etcd::start(1).await;
    let f = Backend::start("f1", "formal").await;
    let conf = Conf::new(&nodes_yaml(&[&f]), SCRIPT);
    let (_root, r1, [a, _b]) = serve(&etcd, "/dash", &conf, ["gw-a", "gw-b"]).await;
    let driver = Driver::start().await;
    let c = driver.browser().await;
    c.goto(&format!("http://{}/", a.admin.unwrap()))
        .await
        .unwrap();
    let want = format!("all 2 gateways on revision {r1}");
    wait_text(&c, "#fleet-summary", "fleet summary", |t| t == want).await;
    for id in ["gw-a", "gw-b"] {
        let css = format!("tr[data-gateway='{id}'] td.revision");
        wait_text(&c, &css, "revision cell", |t| t == r1.to_string()).await;
    }
    // A rejected change: still one revision, the error in each row.
    etcd.put_script("/dash", "return function(req)\n").await;
    let css = "tr[data-gateway='gw-b'] td:last-child";
    let err = wait_text(&c, css, "error cell", |t| {
        t.contains("/dash/config/gray.lua:")
    })
    .await;
    assert!(err.contains("/dash/config/gray.lua:"), "{err}");
    let cell = c.find(Locator::Css(css)).await.unwrap();
    assert_eq!(cell.attr("class").await.unwrap().as_deref(), Some("fail"));
    wait_text(&c, "#fleet-summary", "fleet summary", |t| t == want).await;
    c.close().await.unwrap();
}

/// Kills a process by pid at the end (the successor of an upgrade is not
/// the harness's child).
struct KillPid(Option<u32>);
impl Drop for KillPid {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binary_upgrade_on_an_etcd_sourced_config_loses_no_request() {
    let etcd = Etcd::start(1).await;
    let f1 = Backend::start("f1", "formal").await;
    let conf = Conf::new(&nodes_yaml(&[&f1]), SCRIPT);
    let rev = push(&etcd, "/up", &conf);
    let root = tempfile::tempdir().unwrap();
    let boot = etcd.boot(root.path(), "g1", "/up", "");
    let dir = root.path().join("g1");
    let pid_file = dir.join("graygate.pid");
    let sock = dir.join("graygate.sock");
    let (pid_arg, sock_arg) = (pid_file.display().to_string(), sock.display().to_string());
    let mut gw = Gateway::start_cmd(
        Command::new(env!("CARGO_BIN_EXE_graygate")),
        &boot,
        &["--pid-file", &pid_arg, "--upgrade-socket", &sock_arg],
    );
    let old = gw.pid();
    let admin = gw.admin.unwrap();
    eventually(
        "serving the pushed revision",
        Duration::from_secs(20),
        || async {
            let s = Req::get("/status").send(admin).await.json();
            s["source"] == "etcd" && s["revision"] == rev
        },
    )
    .await;
    let load = Load::start(&[gw.addr, gw.addr, gw.addr]);
    load.wait_ok(100).await;
    // USR2: the running process starts its own binary with --upgrade; the
    // successor loads its configuration from etcd, takes the sockets, and
    // the old process drains and exits.
    gw.signal("USR2");
    let read_pid = || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
    };
    eventually(
        "the successor's pid file",
        Duration::from_secs(30),
        || async { read_pid().is_some_and(|p| p != old) },
    )
    .await;
    let _successor = KillPid(read_pid());
    assert!(
        gw.wait_exit(Duration::from_secs(30))
            .await
            .is_some_and(|s| s.success()),
        "the old process drains and exits 0:\n{}",
        gw.logs()
    );
    // Served by the successor now: same sockets, same etcd revision.
    load.wait_ok(100).await;
    let (ok, errors) = load.stop().await;
    assert!(
        errors.is_empty(),
        "{} failed of {}: {:?}",
        errors.len(),
        ok,
        &errors[..errors.len().min(5)]
    );
    let s = Req::get("/status").send(admin).await.json();
    assert_eq!(s["source"], "etcd");
    assert_eq!(s["revision"], rev);
    assert_eq!(s["source_state"], "live");
    assert_ne!(read_pid(), Some(old));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_starts_again_on_new_ports_when_its_port_was_taken() {
    // The first client port handed out is held by a listener here, as
    // another process might have taken it: that member cannot bind, and
    // the cluster comes up on new ports.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port();
    let mut first = true;
    let etcd = Etcd::start_on(1, || {
        if std::mem::take(&mut first) {
            busy
        } else {
            free_port()
        }
    })
    .await;
    assert!(!etcd.url().ends_with(&format!(":{busy}")), "{}", etcd.url());
    let rev = etcd.put("/retry/k", "v").await;
    assert!(rev > 0);
    assert_eq!(etcd.get("/retry/k").await.as_deref(), Some("v"));
}
