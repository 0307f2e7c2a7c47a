//! Configuration from Nacos config (`nacos.config` in a bootstrap file):
//! the main settings and every document they name are data ids of one
//! group, each change pushed, validated whole and swapped in; a bad one
//! rejected with its data id and line; the last applied snapshot on disk
//! serves a start while Nacos is down.

use std::time::{Duration, Instant};

use crate::harness::nacos::*;
use crate::harness::*;

const GROUP: &str = "GRAYGATE";

/// A bootstrap file as the issue writes it (`extra`: more `nacos:` keys,
/// indented for their place).
fn bootstrap(nacos: &Nacos, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nnacos:\n  server_addr: {}\n  namespace: public\n  cache_dir: cache\n  timeout_ms: 500\n{extra}  discovery:\n    group: DEFAULT_GROUP\n    lane_key: version\n    formal_values: [v1]\n  config:\n    group: {GROUP}\n    data_id: graygate.yaml\n",
        nacos.server_addr()
    )
}

/// The rules of seed 004: an IP whitelist and a list of user ids to
/// `gray-1.0`.
fn rules(uids: &str) -> String {
    format!(
        "uid: {{ header: X-User-Id }}\nrules:\n  - {{ name: testers, lane: gray-1.0, ip: [127.0.9.0/24] }}\n  - {{ name: beta-users, lane: gray-1.0, uid: {{ in: [{uids}] }} }}\n"
    )
}

/// The node answering a request of user `uid`.
async fn user(gw: &Gateway, uid: &str) -> String {
    Req::get("/orders/1")
        .header("X-User-Id", uid)
        .send(gw.addr)
        .await
        .node()
}

/// Steady load from `users` (each `(X-User-Id, the node it must reach)`)
/// until `stop`: every answer that is not 200 from that node.
fn steady(
    addr: std::net::SocketAddr,
    users: &'static [(&'static str, &'static str)],
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let (mut n, mut bad) = (0, Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for (uid, want) in users {
                n += 1;
                // A transport failure panics: the test fails with it.
                let r = Req::get("/orders/1")
                    .header("X-User-Id", uid)
                    .send(addr)
                    .await;
                if r.status != 200 || r.node() != *want {
                    bad.push(format!("user {uid}: {} {}", r.status, r.text()));
                }
            }
        }
        (n, bad)
    })
}

/// p-th percentile (0–100) of sorted samples.
fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p / 100.0).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Seed 004 end to end: instances registered by Nacos's official client
/// with their version in the metadata, the rule file kept in Nacos config;
/// the operator edits it in Nacos and the next requests follow it (the
/// time from the publish to the first request that follows it measured);
/// a bad edit is rejected with its data id and line while the last good
/// rules keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_004_rules_in_nacos_config_follow_an_operators_edit() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("v1", "formal"), ("gray-1.0", "gray-1.0")]).await;
    let svc = "orders";
    let _py = PyClient::start(
        &nacos,
        "public",
        &[
            Inst::new(svc, f.addr).meta("version", "v1"),
            Inst::new(svc, g.addr).meta("version", "gray-1.0"),
        ],
    )
    .await;
    nacos
        .publish(
            GROUP,
            "graygate.yaml",
            &format!("rules_file: rules.yaml\nroutes:\n  - {{ prefix: /, service: {svc} }}\n"),
        )
        .await;
    nacos
        .publish(GROUP, "rules.yaml", &rules("1001, 1002, 1003"))
        .await;
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write("bootstrap.yaml", &bootstrap(&nacos, "")));
    let st = gw.status().await;
    assert_eq!(st["source"], "nacos", "{st}");
    assert_eq!(st["source_state"], "live", "{st}");
    soon("both instances served", || async {
        user(&gw, "1002").await == "gray-1.0" && user(&gw, "2000").await == "v1"
    })
    .await;
    let from_tester = Req::get("/orders/1")
        .from_ip("127.0.9.5")
        .send(gw.addr)
        .await;
    assert_eq!(from_tester.node(), "gray-1.0");
    assert_eq!(gw.get("/orders/1").await.node(), "v1");
    // What is in Nacos checks, through the bootstrap and directly (the
    // service only Nacos defines checked as empty), and pulls to files.
    let (ok, out) = graygate(&["--check", "-c", fx.path("bootstrap.yaml").to_str().unwrap()]);
    assert!(ok, "{out}");
    let server = nacos.server_addr();
    let (ok, out) = graygate(&["--check", "--nacos", &server, "--group", GROUP]);
    assert!(ok, "{out}");
    let pulled = fx.path("pulled");
    let (ok, out) = graygate(&[
        "pull",
        "--nacos",
        &server,
        "--group",
        GROUP,
        "--dir",
        pulled.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(pulled.join("rules.yaml").exists(), "{out}");

    // The operator edits the rule in Nacos: user 2000 in, then out again;
    // each time, from the publish to the first request that follows it.
    // Meanwhile users the edits do not touch: no request lost or sent to
    // another lane through 20 swaps.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = steady(
        gw.addr,
        &[("1002", "gray-1.0"), ("3000", "v1")],
        stop.clone(),
    );
    let mut samples = Vec::new();
    for round in 0..10 {
        for (uids, want) in [
            ("1001, 1002, 1003, 2000", "gray-1.0"),
            ("1001, 1002, 1003", "v1"),
        ] {
            let uids = format!("{uids}, {}", 9000 + round);
            let t0 = Instant::now();
            nacos.publish(GROUP, "rules.yaml", &rules(&uids)).await;
            while user(&gw, "2000").await != want {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "edit not followed in 10 s: {}\n{}",
                    gw.status().await,
                    gw.logs()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            samples.push(t0.elapsed());
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, bad) = load.await.unwrap();
    assert!(sent > 20, "{sent}");
    assert!(
        bad.is_empty(),
        "{} of {sent}: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    samples.sort();
    let (p50, p99) = (pct(&samples, 50.0), pct(&samples, 99.0));
    println!(
        "nacos config publish → first request that follows it, {} changes ({sent} requests of untouched users meanwhile, none lost or mis-laned): p50 {:.3} s, p99 {:.3} s, max {:.3} s",
        samples.len(),
        p50.as_secs_f64(),
        p99.as_secs_f64(),
        samples[samples.len() - 1].as_secs_f64()
    );
    assert!(
        p99 <= Duration::from_millis(1500),
        "p99 {p99:?} (p50 {p50:?}): {samples:?}"
    );

    // A bad edit (an unknown lane on line 4): rejected with the data id
    // and the line; the last good rules keep serving.
    let rejected = gw.status().await["reloads_rejected"].as_u64().unwrap();
    let bad = rules("1001").replace("lane: gray-1.0, uid", "lane: nowhere!, uid");
    nacos.publish(GROUP, "rules.yaml", &bad).await;
    soon("the bad edit is rejected", || async {
        gw.status().await["reloads_rejected"].as_u64().unwrap() > rejected
    })
    .await;
    let st = gw.status().await;
    let err = st["last_reload_error"].as_str().unwrap_or_default();
    assert!(
        err.starts_with(&format!("nacos:{GROUP}/rules.yaml:4:")),
        "{st}"
    );
    assert_eq!(st["source_state"], "live", "{st}");
    assert_eq!(user(&gw, "1002").await, "gray-1.0");
    assert_eq!(user(&gw, "2000").await, "v1");
    // Fixed: applied.
    nacos
        .publish(GROUP, "rules.yaml", &rules("1001, 2000"))
        .await;
    soon("the fixed rules apply", || async {
        user(&gw, "2000").await == "gray-1.0"
    })
    .await;
    assert_eq!(
        gw.status().await["last_reload_error"],
        serde_json::Value::Null
    );
    // An admin edit is published to the data id in Nacos.
    let r = Req::get("/rules/beta-users")
        .method("PATCH")
        .header("content-type", "application/json")
        .body(r#"{"percentage": 5}"#)
        .send(gw.admin.unwrap())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data_id"], "rules.yaml");
    let stored = nacos.config(GROUP, "rules.yaml").await.unwrap();
    assert!(stored.contains("percentage: 5"), "{stored}");
}

/// Every document the main settings name is a data id: a node file, an IP
/// list and a rules file; one named later (a new list) is read and
/// listened to as well; one named but missing is an error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_named_document_is_a_data_id_and_a_new_one_is_followed() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let main = |lists: &str| {
        format!(
            "node_files: [nodes/api.yaml]\nlists:\n{lists}rules_file: rules.yaml\nroutes:\n  - {{ prefix: /, service: api }}\n"
        )
    };
    nacos
        .publish(
            GROUP,
            "graygate.yaml",
            &main("  office: lists/office.txt\n"),
        )
        .await;
    nacos
        .publish(
            GROUP,
            // A path's `/` is a `:` in its data id.
            "nodes:api.yaml",
            &format!(
                "services:\n  api:\n    nodes:\n      - {{ addr: \"{}\", lane: formal }}\n      - {{ addr: \"{}\", lane: gray }}\n",
                f.addr, g.addr
            ),
        )
        .await;
    nacos
        .publish(GROUP, "lists:office.txt", "127.0.7.0/24\n")
        .await;
    nacos
        .publish(
            GROUP,
            "rules.yaml",
            "rules:\n  - { name: office, lane: gray, ip: { list: office } }\n",
        )
        .await;
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write("bootstrap.yaml", &bootstrap(&nacos, "")));
    let from = |ip: &'static str| {
        let addr = gw.addr;
        async move { Req::get("/x").from_ip(ip).send(addr).await.node() }
    };
    assert_eq!(from("127.0.7.9").await, "g");
    assert_eq!(from("127.0.8.9").await, "f");
    // The list changes in Nacos: pushed.
    nacos
        .publish(GROUP, "lists:office.txt", "127.0.8.0/24\n")
        .await;
    soon("the new list applies", || async {
        from("127.0.8.9").await == "g"
    })
    .await;
    assert_eq!(from("127.0.7.9").await, "f");
    // The rules name a list the main settings do not have yet: rejected,
    // naming the key; then a new list data id, named, is read and followed.
    nacos
        .publish(
            GROUP,
            "graygate.yaml",
            &main("  office: lists/office.txt\n  lab: lists/lab.txt\n"),
        )
        .await;
    soon("a named but missing data id is rejected", || async {
        gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("lists:lab.txt") && e.contains("no data id"))
    })
    .await;
    nacos
        .publish(GROUP, "lists:lab.txt", "127.0.6.0/24\n")
        .await;
    nacos
        .publish(
            GROUP,
            "rules.yaml",
            "rules:\n  - { name: office, lane: gray, ip: { list: office } }\n  - { name: lab, lane: gray, ip: { list: lab } }\n",
        )
        .await;
    soon("the new list is read", || async {
        from("127.0.6.9").await == "g"
    })
    .await;
    nacos
        .publish(GROUP, "lists:lab.txt", "127.0.5.0/24\n")
        .await;
    soon("and followed", || async { from("127.0.5.9").await == "g" }).await;
    assert_eq!(
        gw.status().await["last_reload_error"],
        serde_json::Value::Null
    );
}

/// The main settings, a node file and a rules file sending `gray_ip` to
/// the gray node.
async fn publish_all(nacos: &Nacos, f: &Backend, g: &Backend, gray_ip: &str) {
    let main = "node_files: [nodes.yaml]\nrules_file: rules.yaml\nroutes:\n  - { prefix: /, service: api }\n";
    let nodes = format!(
        "services:\n  api:\n    nodes:\n      - {{ addr: \"{}\", lane: formal }}\n      - {{ addr: \"{}\", lane: gray }}\n",
        f.addr, g.addr
    );
    let rules = format!("rules:\n  - {{ name: lab, lane: gray, ip: [{gray_ip}] }}\n");
    nacos.publish(GROUP, "graygate.yaml", main).await;
    nacos.publish(GROUP, "nodes.yaml", &nodes).await;
    nacos.publish(GROUP, "rules.yaml", &rules).await;
}

/// The promises of the etcd source: Nacos killed — the gateway keeps
/// serving, `stale`; restarted during the outage — it serves its cached
/// snapshot, `cached`; Nacos back — `live`, and a change made meanwhile
/// applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacos_outage_is_survived_and_a_restart_serves_the_cache() {
    let mut nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    publish_all(&nacos, &f, &g, "127.0.7.0/24").await;
    let fx = Fixture::new();
    let boot = fx.write("bootstrap.yaml", &bootstrap(&nacos, ""));
    let mut gw = Gateway::start(&boot);
    let from = |addr: std::net::SocketAddr, ip: &'static str| async move {
        Req::get("/x").from_ip(ip).send(addr).await.node()
    };
    assert_eq!(from(gw.addr, "127.0.7.9").await, "g");
    assert!(fx.path("cache/graygate-config.json").exists());

    // Steady load from both sides while Nacos dies: none lost, none on
    // the other lane.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let load = {
        let (stop, count, addr) = (stop.clone(), count.clone(), gw.addr);
        tokio::spawn(async move {
            let (mut n, mut bad) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                for (ip, want) in [("127.0.7.9", "g"), ("127.0.8.9", "f")] {
                    n += 1;
                    count.fetch_add(1, Ordering::Relaxed);
                    let r = Req::get("/x").from_ip(ip).send(addr).await;
                    if r.status != 200 || r.node() != want {
                        bad.push(format!("from {ip}: {} {}", r.status, r.text()));
                    }
                }
            }
            (n, bad)
        })
    };
    nacos.kill();
    soon("stale once Nacos is gone", || async {
        gw.status().await["source_state"] == "stale"
    })
    .await;
    // And on, stale, for a few hundred requests more.
    let at_stale = count.load(Ordering::Relaxed);
    soon("load goes on while stale", || async {
        count.load(Ordering::Relaxed) >= at_stale + 300
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (sent, bad) = load.await.unwrap();
    assert!(bad.is_empty(), "{} of {sent}: {bad:?}", bad.len());
    let st = gw.status().await;
    assert!(st["store_error"].is_string(), "{st}");
    assert_eq!(from(gw.addr, "127.0.7.9").await, "g");
    assert_eq!(from(gw.addr, "127.0.8.9").await, "f");

    // A restart during the outage: the cached snapshot.
    gw.kill();
    let gw = Gateway::start(&boot);
    let st = gw.status().await;
    assert_eq!(st["source_state"], "cached", "{st}");
    assert_eq!(from(gw.addr, "127.0.7.9").await, "g");

    // Nacos back (a fresh server: the configuration published again, the
    // rule changed meanwhile): live, the change applied.
    nacos.restart_fresh().await;
    publish_all(&nacos, &f, &g, "127.0.8.0/24").await;
    eventually("live again", Duration::from_secs(20), || async {
        gw.status().await["source_state"] == "live"
    })
    .await;
    soon("the change made during the outage applies", || async {
        from(gw.addr, "127.0.8.9").await == "g"
    })
    .await;
    assert_eq!(from(gw.addr, "127.0.7.9").await, "f");
}

/// `graygate …` with `args`: (success, stdout + stderr).
fn graygate(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(args)
        .env_remove("NACOS_USERNAME")
        .output()
        .expect("run graygate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `push --nacos` uploads exactly what `--check` accepts (one data id a
/// document, the main settings under `--data-id`), `--check --nacos`
/// builds what is in Nacos (a bad data id named with its line), `pull
/// --nacos` writes it back to files that check as they were, and a
/// gateway starts on what was pushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_check_and_pull_with_nacos() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let fx = Fixture::new();
    fx.write(
        "nodes/api.yaml",
        &format!(
            "services:\n  api:\n    nodes:\n      - {{ addr: \"{}\", lane: formal }}\n      - {{ addr: \"{}\", lane: gray }}\n",
            f.addr, g.addr
        ),
    );
    fx.write("lists/office.txt", "127.0.7.0/24\n");
    fx.write(
        "rules.yaml",
        "rules:\n  - { name: office, lane: gray, ip: { list: office } }\n",
    );
    let main = fx.write(
        "graygate.yaml",
        &main_config(
            "node_files: [nodes/api.yaml]\nlists:\n  office: lists/office.txt\nrules_file: rules.yaml\nroutes:\n  - { prefix: /, service: api }\n",
        ),
    );
    let server = nacos.server_addr();
    let at = [
        "--nacos",
        server.as_str(),
        "--group",
        GROUP,
        "--data-id",
        "graygate.yaml",
    ];
    let push = |main: &std::path::Path| {
        let mut args = vec!["push", "-c", main.to_str().unwrap()];
        args.extend(at);
        graygate(&args)
    };
    let (ok, out) = push(&main);
    assert!(ok, "{out}");
    assert!(out.contains("pushed 4 documents"), "{out}");
    assert_eq!(
        nacos.config(GROUP, "lists:office.txt").await.as_deref(),
        Some("127.0.7.0/24\n")
    );
    assert!(nacos
        .config(GROUP, "graygate.yaml")
        .await
        .unwrap()
        .contains("rules_file: rules.yaml"));
    let mut check = vec!["--check"];
    check.extend(at);
    let (ok, out) = graygate(&check);
    assert!(ok, "{out}");
    assert!(out.contains("configuration ok"), "{out}");

    // A configuration --check refuses is not pushed.
    fx.write(
        "rules.yaml",
        "rules:\n  - { name: office, lane: gray, ip: { list: nowhere } }\n",
    );
    let (ok, out) = push(&main);
    assert!(!ok, "{out}");
    assert!(out.contains("nothing pushed"), "{out}");
    assert!(nacos
        .config(GROUP, "rules.yaml")
        .await
        .unwrap()
        .contains("list: office"));

    // A gateway on what was pushed.
    let gw = Gateway::start(&fx.write("boot/bootstrap.yaml", &bootstrap(&nacos, "")));
    let r = Req::get("/x").from_ip("127.0.7.9").send(gw.addr).await;
    assert_eq!(r.node(), "g");

    // Pulled back to files: the same documents, by path.
    let out_dir = fx.path("pulled");
    let mut pull = vec!["pull", "--dir", out_dir.to_str().unwrap()];
    pull.extend(at);
    let (ok, out) = graygate(&pull);
    assert!(ok, "{out}");
    assert!(out.contains("pulled 4 documents"), "{out}");
    assert_eq!(
        std::fs::read_to_string(out_dir.join("lists/office.txt")).unwrap(),
        "127.0.7.0/24\n"
    );
    assert!(std::fs::read_to_string(out_dir.join("nodes/api.yaml"))
        .unwrap()
        .contains(&f.addr.to_string()));
    assert!(std::fs::read_to_string(out_dir.join("rules.yaml"))
        .unwrap()
        .contains("list: office"));
    let pulled_main = out_dir.join("graygate.yaml");
    let (ok, out) = graygate(&["--check", "-c", pulled_main.to_str().unwrap()]);
    assert!(ok, "{out}");

    // A bad edit in Nacos: --check names the data id and the line.
    nacos
        .publish(
            GROUP,
            "nodes:api.yaml",
            "services:\n  api:\n    nodes:\n      - { addr: nope }\n",
        )
        .await;
    let (ok, out) = graygate(&check);
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!("nacos:{GROUP}/nodes:api.yaml:4:")),
        "{out}"
    );
    assert!(out.contains("configuration test failed"), "{out}");

    // Pulled while it does not build: what was found, and the error.
    let (ok, out) = graygate(&pull);
    assert!(!ok, "{out}");
    assert!(out.contains("pull incomplete"), "{out}");
}

/// Releases on a Nacos config source work as on files: created through
/// the admin API, their state in `releases.json` beside the bootstrap
/// file (this gateway's own), kept through a pushed change and a restart.
/// The supported mode's consequence for a fleet: another gateway on the
/// same Nacos config does not have the release (each gateway's releases
/// are its own; `/releases` names no fleet, `/fleet` has none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_keep_their_state_on_the_gateways_disk() {
    use crate::releases::{admin_post, LIFECYCLE};
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let nodes = |comment: &str| {
        format!(
            "# {comment}\nservices:\n  api:\n    health: {{ passive: {{ max_fails: 0 }} }}\n    nodes:\n      - {{ addr: \"{}\", lane: formal }}\n      - {{ addr: \"{}\", lane: gray }}\n",
            f.addr, g.addr
        )
    };
    nacos
        .publish(
            GROUP,
            "graygate.yaml",
            "node_files: [nodes.yaml]\nroutes:\n  - { prefix: /api/, service: api }\n",
        )
        .await;
    nacos.publish(GROUP, "nodes.yaml", &nodes("one")).await;
    let fx = Fixture::new();
    let boot = fx.write("bootstrap.yaml", &bootstrap(&nacos, ""));
    let mut gw = Gateway::start(&boot);
    let spec = format!(
        "name: r1\nlane: gray\nroutes: [/api/]\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 600000 }}\n{LIFECYCLE}\n"
    );
    let r = admin_post(&gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(fx.path("releases.json").exists());
    let gray_users = |addr: std::net::SocketAddr| async move {
        let mut n = 0;
        for i in 0..100 {
            let r = Req::get("/api/x")
                .header("X-User", &format!("u{i}"))
                .send(addr)
                .await;
            n += usize::from(r.node() == "g");
        }
        n
    };
    let share = gray_users(gw.addr).await;
    assert!((20..=80).contains(&share), "{share} of 100 users on gray");
    // A second gateway on the same Nacos config: not its release.
    let fx_b = Fixture::new();
    let gw_b = Gateway::start(&fx_b.write("bootstrap.yaml", &bootstrap(&nacos, "")));
    let b_admin = gw_b.admin.unwrap();
    let r = Req::get("/releases/r1").send(b_admin).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(gray_users(gw_b.addr).await, 0, "no release on gateway b");
    let list = Req::get("/releases").send(b_admin).await.json();
    assert_eq!(list["source"], "nacos", "{list}");
    assert!(list.get("fleet").is_none(), "{list}");
    assert_eq!(gw_b.status().await["fleet"], false);
    let r = Req::get("/fleet").send(b_admin).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.text().contains("no fleet"), "{}", r.text());
    drop(gw_b);
    let release = |gw: &Gateway| {
        let admin = gw.admin.unwrap();
        async move { Req::get("/releases/r1").send(admin).await.json() }
    };
    // A change pushed from Nacos: the release goes on.
    let gen = gw.generation().await;
    nacos.publish(GROUP, "nodes.yaml", &nodes("two")).await;
    gw.wait_generation(gen).await;
    assert_eq!(release(&gw).await["weight"], 50.0);
    assert_eq!(gray_users(gw.addr).await, share);
    // A restart: the state from the disk.
    gw.kill();
    let gw = Gateway::start(&boot);
    let doc = release(&gw).await;
    assert_eq!(doc["weight"], 50.0, "{doc}");
    assert_eq!(doc["state"], "progressing", "{doc}");
    assert_eq!(gray_users(gw.addr).await, share);
}

/// With Nacos auth on: the gateway logs in (the bootstrap's `username` and
/// `password`) and follows a pushed change; `push --nacos` logs in with
/// `--nacos-username` and `NACOS_PASSWORD`; a wrong password does not
/// start a gateway without a cache (never an empty configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_on_the_gateway_and_push_log_in() {
    let nacos = Nacos::start_env(&[
        ("RNACOS_ENABLE_OPEN_API_AUTH", "true"),
        ("RNACOS_INIT_ADMIN_USERNAME", "nacos"),
        ("RNACOS_INIT_ADMIN_PASSWORD", "s3cret-pass"),
    ])
    .await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let fx = Fixture::new();
    fx.write(
        "nodes.yaml",
        &format!(
            "services:\n  api:\n    nodes:\n      - {{ addr: \"{}\", lane: formal }}\n      - {{ addr: \"{}\", lane: gray }}\n",
            f.addr, g.addr
        ),
    );
    fx.write(
        "rules.yaml",
        "rules:\n  - { name: lab, lane: gray, ip: [127.0.7.0/24] }\n",
    );
    let main = fx.write(
        "graygate.yaml",
        &main_config(
            "node_files: [nodes.yaml]\nrules_file: rules.yaml\nroutes:\n  - { prefix: /, service: api }\n",
        ),
    );
    let server = nacos.server_addr();
    let push = |pass: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
            .args(["push", "-c", main.to_str().unwrap(), "--nacos", &server])
            .args(["--group", GROUP, "--nacos-username", "nacos"])
            .env("NACOS_PASSWORD", pass)
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (ok, out) = push("wrong");
    assert!(!ok, "{out}");
    let (ok, out) = push("s3cret-pass");
    assert!(ok, "{out}");
    let creds = |pass: &str| format!("  username: nacos\n  password: {pass}\n");
    let gw = Gateway::start(&fx.write(
        "a/bootstrap.yaml",
        &bootstrap(&nacos, &creds("s3cret-pass")),
    ));
    let from = |ip: &'static str| {
        let addr = gw.addr;
        async move { Req::get("/x").from_ip(ip).send(addr).await.node() }
    };
    assert_eq!(from("127.0.7.9").await, "g");
    nacos
        .publish(
            GROUP,
            "rules.yaml",
            "rules:\n  - { name: lab, lane: gray, ip: [127.0.8.0/24] }\n",
        )
        .await;
    soon("the pushed change applies", || async {
        from("127.0.8.9").await == "g"
    })
    .await;
    // A wrong password and no cache: no start.
    let bad =
        Gateway::try_start(&fx.write("b/bootstrap.yaml", &bootstrap(&nacos, &creds("wrong"))));
    let err = bad.err().expect("no start with a wrong password");
    assert!(err.contains("no usable cached snapshot"), "{err}");
}
