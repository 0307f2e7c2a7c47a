//! Discovery (`nacos.discovery`): a route names a service no node file
//! defines; its nodes are its Nacos instances, their lane the metadata's
//! `lane_key`, kept current by subscription.

use std::time::{Duration, Instant};

use crate::harness::nacos::*;
use crate::harness::*;

/// A main file routing `/` to `service`, discovered in `nacos`
/// (`discovery` holds extra `nacos.discovery` keys, `nacos_extra` extra
/// `nacos` keys, each indented for its place). Peers on loopback are
/// trusted with the tag header, so a test picks a request's lane.
fn config(nacos: &Nacos, service: &str, nacos_extra: &str, discovery: &str) -> String {
    main_config(&format!(
        "trusted_proxies: [127.0.0.0/8]\nroutes:\n  - {{ prefix: /, service: {service} }}\nnacos:\n  server_addr: {}\n{nacos_extra}  discovery:\n    formal_values: [v1]\n{discovery}",
        nacos.server_addr()
    ))
}

fn start(cfg: &str) -> (Fixture, Gateway) {
    let fx = Fixture::new();
    let path = fx.write("graygate.yaml", cfg);
    let gw = Gateway::start(&path);
    (fx, gw)
}

/// The node answering a request in `lane` (None: untagged), or the status
/// and body of an error.
async fn hit(gw: &Gateway, lane: Option<&str>) -> Result<String, (u16, String)> {
    let r = try_get(gw.addr, "/x", lane.map(|l| ("X-Gray-Tag", l)))
        .await
        .expect("gateway answers");
    if r.status == 200 {
        Ok(r.node())
    } else {
        Err((r.status, r.text()))
    }
}

/// The nodes of `service` in `/nodes`, by address.
async fn nodes(gw: &Gateway, service: &str) -> Vec<serde_json::Value> {
    let doc = gw.admin_get("/nodes").await.json();
    doc["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == service)
        .and_then(|s| s["nodes"].as_array().cloned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_lanes_weights_and_disabled_instances() {
    let nacos = Nacos::start().await;
    let [f1, f2, g1, g2, z, d] = backends([
        ("f1", "formal"),
        ("f2", "formal"),
        ("g1", "gray-1.0"),
        ("g2", "gray-2.0"),
        ("zero", "formal"),
        ("off", "formal"),
    ])
    .await;
    let svc = "orders";
    let off = Inst::new(svc, d.addr).meta("version", "v1").enabled(false);
    for i in [
        Inst::new(svc, f1.addr)
            .meta("version", "v1")
            .meta("zone", "hz"),
        // No `version`: formal.
        Inst::new(svc, f2.addr),
        Inst::new(svc, g1.addr).meta("version", "gray-1.0"),
        Inst::new(svc, g2.addr).meta("version", "gray-2.0"),
        Inst::new(svc, z.addr).meta("version", "v1").weight(0.0),
        off.clone(),
    ] {
        nacos.register(&i).await;
    }
    let (_fx, gw) = start(&config(&nacos, svc, "", ""));
    soon("the five enabled instances are nodes", || async {
        nodes(&gw, svc).await.len() == 5
    })
    .await;
    let doc = gw.admin_get("/nodes").await.json();
    let s = doc["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == svc)
        .unwrap()
        .clone();
    assert_eq!(s["discovery"], "nacos", "{s}");
    let lane_of = |addr: std::net::SocketAddr| {
        s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["addr"] == addr.to_string())
            .map(|n| (n["lane"].clone(), n["weight"].clone(), n["zone"].clone()))
    };
    assert_eq!(
        lane_of(f1.addr),
        Some(("formal".into(), 1.into(), "hz".into()))
    );
    assert_eq!(lane_of(f2.addr).unwrap().0, "formal");
    assert_eq!(lane_of(g1.addr).unwrap().0, "gray-1.0");
    assert_eq!(lane_of(g2.addr).unwrap().0, "gray-2.0");
    assert_eq!(lane_of(z.addr).unwrap().1, 0);
    assert_eq!(lane_of(d.addr), None, "a disabled instance is no node");

    // Untagged: the formal instances, never weight 0, never disabled.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        seen.insert(hit(&gw, None).await.unwrap());
    }
    assert_eq!(
        seen,
        ["f1", "f2"].iter().map(|s| s.to_string()).collect(),
        "formal: v1 (formal_values) and no version"
    );
    for _ in 0..10 {
        assert_eq!(hit(&gw, Some("gray-1.0")).await.unwrap(), "g1");
        assert_eq!(hit(&gw, Some("gray-2.0")).await.unwrap(), "g2");
    }
    assert_eq!(z.count() + d.count(), 0);

    let st = gw.status().await;
    let n = &st["nacos"];
    assert_eq!(n["connected"], true, "{st}");
    assert_eq!(n["services"][0]["name"], svc);
    // What the server lists (rnacos leaves the disabled one out; Nacos
    // lists it, and graygate leaves it out).
    let listed = n["services"][0]["instances"].as_u64().unwrap();
    assert!(listed == 5 || listed == 6, "{st}");
    assert_eq!(n["services"][0]["nodes"], 5, "{st}");
    assert_eq!(n["services"][0]["lanes"]["gray-1.0"], 1, "{st}");

    // Enabled in Nacos: chosen (pushed, no restart, no reload).
    nacos.update(&off.clone().enabled(true)).await;
    soon("the enabled instance takes formal traffic", || async {
        hit(&gw, None).await.unwrap() == "off"
    })
    .await;
    // Re-weighted to 0: never chosen again.
    nacos.update(&off.clone().enabled(true).weight(0.0)).await;
    soon("weight 0 pushed", || async {
        nodes(&gw, svc)
            .await
            .iter()
            .any(|n| n["addr"] == d.addr.to_string() && n["weight"] == 0)
    })
    .await;
    let before = d.count();
    for _ in 0..30 {
        assert_ne!(hit(&gw, None).await.unwrap(), "off");
    }
    assert_eq!(d.count(), before);
}

/// A request of the steady load: the lane asked, the node that answered
/// or the error.
type Answer = (&'static str, Result<String, String>);

/// p-th percentile (0–100) of sorted samples.
fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p / 100.0).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_changes_reach_requests_within_a_second() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let svc = "latency";
    nacos.register(&Inst::new(svc, f.addr)).await;
    let gray = Inst::new(svc, g.addr).meta("version", "gray");
    let (_fx, gw) = start(&config(&nacos, svc, "", ""));
    soon("formal instance served", || async {
        hit(&gw, None).await.is_ok()
    })
    .await;
    // Each round: register the gray instance, then deregister it; the
    // time from the Nacos change to the first gray-tagged request that
    // follows it.
    let mut samples = Vec::new();
    for _ in 0..10 {
        for (change, want) in [(true, "g"), (false, "f")] {
            let t0 = Instant::now();
            if change {
                nacos.register(&gray).await;
            } else {
                nacos.deregister(&gray).await;
            }
            loop {
                if hit(&gw, Some("gray")).await.unwrap() == want {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "change not seen in 10 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            samples.push(t0.elapsed());
        }
    }
    samples.sort();
    let (p50, p99, max) = (
        pct(&samples, 50.0),
        pct(&samples, 99.0),
        samples[samples.len() - 1],
    );
    println!(
        "nacos change → first request that sees it, {} changes: p50 {:.3} s, p99 {:.3} s, max {:.3} s",
        samples.len(),
        p50.as_secs_f64(),
        p99.as_secs_f64(),
        max.as_secs_f64()
    );
    // rnacos pushes on a tick of about a second; the gateway adds a
    // rebuild (milliseconds).
    assert!(
        p99 <= Duration::from_millis(1500),
        "p99 {p99:?} (p50 {p50:?}): {samples:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_client_takes_its_ephemeral_instances_along() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray-1.0")]).await;
    let svc = "pyshop";
    let mut py = PyClient::start(
        &nacos,
        "public",
        &[
            Inst::new(svc, f.addr).meta("version", "v1"),
            Inst::new(svc, g.addr).meta("version", "gray-1.0"),
        ],
    )
    .await;
    let (_fx, gw) = start(&config(&nacos, svc, "", ""));
    soon("both instances served", || async {
        hit(&gw, Some("gray-1.0")).await == Ok("g".into()) && hit(&gw, None).await == Ok("f".into())
    })
    .await;
    // SIGKILL: no deregistration; the server drops the instances of the
    // connection that went.
    py.kill();
    eventually(
        "the instances are gone",
        Duration::from_secs(30),
        || async { nodes(&gw, svc).await.is_empty() },
    )
    .await;
    let (status, body) = hit(&gw, None).await.unwrap_err();
    assert_eq!(status, 503);
    assert!(body.contains("no upstream node"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_and_namespaces_are_isolated() {
    let nacos = Nacos::start().await;
    let [a, b, c] = backends([
        ("in-group", "formal"),
        ("in-dev", "formal"),
        ("default", "formal"),
    ])
    .await;
    let svc = "iso";
    nacos.register(&Inst::new(svc, a.addr).group("G1")).await;
    nacos
        .register(&Inst::new(svc, b.addr).namespace("dev"))
        .await;
    nacos.register(&Inst::new(svc, c.addr)).await;
    let (_f1, g1) = start(&config(&nacos, svc, "", "    group: G1\n"));
    let (_f2, dev) = start(&config(&nacos, svc, "  namespace: dev\n", ""));
    let (_f3, def) = start(&config(&nacos, svc, "", ""));
    for (gw, want) in [(&g1, "in-group"), (&dev, "in-dev"), (&def, "default")] {
        soon("served", || async { hit(gw, None).await.is_ok() }).await;
        for _ in 0..5 {
            assert_eq!(hit(gw, None).await.unwrap(), want);
        }
        assert_eq!(nodes(gw, svc).await.len(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_service_is_empty_until_registered() {
    let nacos = Nacos::start().await;
    let (_fx, gw) = start(&config(&nacos, "ghost", "", ""));
    soon("connected", || async {
        gw.status().await["nacos"]["connected"] == true
    })
    .await;
    let (status, body) = hit(&gw, None).await.unwrap_err();
    assert_eq!(status, 503);
    assert_eq!(body, "no upstream node for this lane\n");
    let st = gw.status().await;
    let s = &st["nacos"]["services"][0];
    assert_eq!(
        (s["name"].clone(), s["instances"].clone()),
        ("ghost".into(), 0.into()),
        "{st}"
    );
    let doc = gw.admin_get("/nodes").await.json();
    let ghost = doc["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "ghost")
        .cloned()
        .expect("ghost in /nodes");
    assert_eq!(ghost["discovery"], "nacos");
    assert_eq!(ghost["nodes"], serde_json::json!([]));
    // Registered later: the subscription delivers it.
    let f = Backend::start("late", "formal").await;
    nacos.register(&Inst::new("ghost", f.addr)).await;
    soon("the late instance is served", || async {
        hit(&gw, None).await == Ok("late".into())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacos_down_keeps_the_last_instances() {
    let mut nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let svc = "steady";
    nacos.register(&Inst::new(svc, f.addr)).await;
    nacos
        .register(&Inst::new(svc, g.addr).meta("version", "gray"))
        .await;
    let (_fx, gw) = start(&config(&nacos, svc, "  timeout_ms: 500\n", ""));
    soon("served", || async {
        hit(&gw, Some("gray")).await == Ok("g".into())
            && gw.status().await["nacos"]["connected"] == true
    })
    .await;
    nacos.kill();
    soon("/status says Nacos is unreachable", || async {
        let st = gw.status().await;
        st["nacos"]["connected"] == false && st["nacos"]["state"] == "stale"
    })
    .await;
    let st = gw.status().await;
    assert!(st["nacos"]["error"].is_string(), "{st}");
    assert_eq!(st["nacos"]["services"][0]["nodes"], 2, "{st}");
    for _ in 0..20 {
        assert_eq!(hit(&gw, None).await.unwrap(), "f");
        assert_eq!(hit(&gw, Some("gray")).await.unwrap(), "g");
    }
    // Nacos back (a fresh server on the same address: the services
    // register again, one gray instance replaced): live again, and the
    // subscription, renewed by the client, brings the change.
    nacos.restart_fresh().await;
    let g2 = Backend::start("g2", "gray").await;
    nacos.register(&Inst::new(svc, f.addr)).await;
    nacos
        .register(&Inst::new(svc, g2.addr).meta("version", "gray"))
        .await;
    soon("live again, the new instance served", || async {
        gw.status().await["nacos"]["state"] == "live"
            && hit(&gw, Some("gray")).await == Ok("g2".into())
    })
    .await;
    assert_eq!(nodes(&gw, svc).await.len(), 2);
    // Pushed as before: one more change reaches the gateway.
    nacos
        .deregister(&Inst::new(svc, g2.addr).meta("version", "gray"))
        .await;
    soon("the deregistration pushed", || async {
        hit(&gw, Some("gray")).await == Ok("f".into())
    })
    .await;
}

#[test]
fn bad_nacos_settings_are_refused_with_their_line() {
    let fx = Fixture::new();
    let load = |extra: &str| {
        let text = format!(
            "listen: 127.0.0.1:0\nroutes:\n  - {{ prefix: /, service: api }}\nnacos:\n  server_addr: 127.0.0.1:8848\n{extra}"
        );
        let path = fx.write("graygate.yaml", &text);
        load_config(&path).map(drop).map_err(|e| e.to_string())
    };
    // Without nacos.discovery a route may not name an unknown service.
    let e = load("").unwrap_err();
    assert!(e.contains("unknown service \"api\""), "{e}");
    // With it, the service is Nacos's (no instance known yet: empty).
    load("  discovery: {}\n").unwrap();
    let e = load("  discovery:\n    lane_kye: version\n").unwrap_err();
    assert!(
        e.contains("graygate.yaml:7") && e.contains("unknown field `lane_kye`"),
        "{e}"
    );
    let e = load("  username: nacos\n  discovery: {}\n").unwrap_err();
    assert!(
        e.contains("graygate.yaml:6") && e.contains("both username and password"),
        "{e}"
    );
    let e = load("  discovery:\n    services:\n      api: { retries: many }\n").unwrap_err();
    assert!(e.contains("graygate.yaml:8"), "{e}");
    let text = "listen: 127.0.0.1:0\nnacos:\n  server_addr: nacos-without-port\n";
    let path = fx.write("graygate.yaml", text);
    let e = load_config(&path).map(drop).unwrap_err().to_string();
    assert!(
        e.contains("graygate.yaml:3") && e.contains("not host:port"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_nacos_is_down_serves_the_cached_instances() {
    let mut nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let svc = "cached";
    nacos.register(&Inst::new(svc, f.addr)).await;
    nacos
        .register(&Inst::new(svc, g.addr).meta("version", "gray"))
        .await;
    let cfg = config(
        &nacos,
        svc,
        "  cache_dir: nacos-cache\n  timeout_ms: 500\n",
        "",
    );
    let (fx, mut gw) = start(&cfg);
    soon("served", || async {
        hit(&gw, Some("gray")).await == Ok("g".into()) && hit(&gw, None).await == Ok("f".into())
    })
    .await;
    let snapshot = fx.path("nacos-cache/graygate-discovery.json");
    soon("the discovery snapshot is on disk", || async {
        std::fs::read_to_string(&snapshot).is_ok_and(|t| t.contains(&g.addr.port().to_string()))
    })
    .await;
    nacos.kill();
    // The restart serves the snapshot as soon as it listens: Nacos not
    // answering costs `timeout_ms`, not the client's connection attempt.
    gw.restart();
    assert_eq!(hit(&gw, Some("gray")).await, Ok("g".into()));
    assert_eq!(hit(&gw, None).await, Ok("f".into()));
    let st = gw.status().await;
    assert_eq!(st["nacos"]["connected"], false, "{st}");
    assert_eq!(st["nacos"]["state"], "cached", "{st}");
    assert_eq!(st["nacos"]["services"][0]["cached"], true, "{st}");
    assert_eq!(st["nacos"]["services"][0]["nodes"], 2, "{st}");
    // Nacos back: its answer replaces the snapshot.
    nacos.restart_fresh().await;
    nacos.register(&Inst::new(svc, f.addr)).await;
    soon("Nacos's answer replaces the snapshot", || async {
        let st = gw.status().await;
        st["nacos"]["state"] == "live" && st["nacos"]["services"][0]["cached"] == false
    })
    .await;
    soon("the gray instance, not re-registered, is gone", || async {
        hit(&gw, Some("gray")).await == Ok("f".into())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_instance_is_no_node() {
    // Instances without a heartbeat for 1 s (+ the server's 3 s grace)
    // turn unhealthy.
    let nacos = Nacos::start_env(&[("RNACOS_NAMING_HEALTH_TIMEOUT_SECOND", "1")]).await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    let svc = "beats";
    nacos.register(&Inst::new(svc, f.addr)).await;
    // Ephemeral over HTTP: healthy while its heartbeats come; none come.
    nacos
        .register(&Inst::new(svc, g.addr).meta("version", "gray").ephemeral())
        .await;
    let (_fx, gw) = start(&config(&nacos, svc, "", ""));
    soon("the gray instance serves while healthy", || async {
        hit(&gw, Some("gray")).await == Ok("g".into())
    })
    .await;
    eventually(
        "the unhealthy instance is no node",
        Duration::from_secs(20),
        || async { hit(&gw, Some("gray")).await == Ok("f".into()) },
    )
    .await;
    let listed = nacos.instances(svc, "DEFAULT_GROUP", "public").await;
    assert!(
        listed
            .iter()
            .any(|i| i["port"] == g.addr.port() && i["healthy"] == false),
        "Nacos still lists it, unhealthy: {listed:?}"
    );
    for _ in 0..10 {
        assert_eq!(hit(&gw, Some("gray")).await.unwrap(), "f");
    }
    assert_eq!(nodes(&gw, svc).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_send_users_and_ips_to_a_lane_registered_by_a_nacos_client() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("v1", "formal"), ("gray-1.0", "gray-1.0")]).await;
    let svc = "orders";
    // The services register themselves, as Spring Cloud's do, with their
    // version in the metadata.
    let _py = PyClient::start(
        &nacos,
        "public",
        &[
            Inst::new(svc, f.addr).meta("version", "v1"),
            Inst::new(svc, g.addr).meta("version", "gray-1.0"),
        ],
    )
    .await;
    let fx = Fixture::new();
    let rules = |uids: &str| {
        format!(
            "uid: {{ header: X-User-Id }}\nrules:\n  - {{ name: testers, lane: gray-1.0, ip: [127.0.9.0/24] }}\n  - {{ name: beta-users, lane: gray-1.0, uid: {{ in: [{uids}] }} }}\n"
        )
    };
    fx.write("rules.yaml", &rules("1001, 1002, 1003"));
    let main = main_config(&format!(
        "rules_file: rules.yaml\nroutes:\n  - {{ prefix: /, service: {svc} }}\nnacos:\n  server_addr: {}\n  discovery:\n    formal_values: [v1]\n",
        nacos.server_addr()
    ));
    let gw = Gateway::start(&fx.write("graygate.yaml", &main));
    let user = |uid: &'static str| {
        let addr = gw.addr;
        async move {
            Req::get("/orders/1")
                .header("X-User-Id", uid)
                .send(addr)
                .await
                .node()
        }
    };
    soon("both instances known", || async {
        nodes(&gw, svc).await.len() == 2
    })
    .await;
    assert_eq!(user("1002").await, "gray-1.0");
    assert_eq!(user("2000").await, "v1");
    let from_tester = Req::get("/orders/1")
        .from_ip("127.0.9.5")
        .send(gw.addr)
        .await;
    assert_eq!(from_tester.node(), "gray-1.0");
    assert_eq!(gw.get("/orders/1").await.node(), "v1");
    // The operator adds a user: once the edit is applied, the user's
    // requests follow the rule.
    let gen = gw.generation().await;
    fx.write("rules.yaml", &rules("1001, 1002, 1003, 2000"));
    gw.wait_generation(gen).await;
    soon("the edited rule applies", || async {
        user("2000").await == "gray-1.0"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_request_lost_or_mislaned_through_changes_and_an_outage() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let mut nacos = Nacos::start().await;
    let [f1, f2, g1, g2] = backends([
        ("f1", "formal"),
        ("f2", "formal"),
        ("g1", "gray"),
        ("g2", "gray"),
    ])
    .await;
    let svc = "steady";
    let fi = |b: &Backend| Inst::new(svc, b.addr).meta("version", "v1");
    let gi = |b: &Backend| Inst::new(svc, b.addr).meta("version", "gray");
    nacos.register(&fi(&f1)).await;
    nacos.register(&fi(&f2)).await;
    nacos.register(&gi(&g1)).await;
    let (_fx, gw) = start(&config(&nacos, svc, "  timeout_ms: 500\n", ""));
    soon("three nodes", || async { nodes(&gw, svc).await.len() == 3 }).await;

    // Steady load, gray-tagged and untagged: (lane asked, answer).
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<Answer>>> = Default::default();
    let tasks: Vec<_> = [Some("gray"), None]
        .into_iter()
        .map(|lane| {
            let (stop, seen, addr) = (stop.clone(), seen.clone(), gw.addr);
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let r = match try_get(addr, "/x", lane.map(|l| ("X-Gray-Tag", l))).await {
                        Ok(r) if r.status == 200 => Ok(r.node()),
                        Ok(r) => Err(format!("{} {}", r.status, r.text())),
                        Err(e) => Err(e),
                    };
                    seen.lock().unwrap().push((lane.unwrap_or("formal"), r));
                }
            })
        })
        .collect();
    let count = |b: &Backend| b.count();
    let served = |n: usize| {
        let seen = seen.clone();
        async move {
            let start = seen.lock().unwrap().len();
            eventually("load goes on", Duration::from_secs(10), || async {
                seen.lock().unwrap().len() >= start + n
            })
            .await;
        }
    };
    served(50).await;

    // A gray instance replaced: the new one registers, the old one
    // deregisters and stops only once the gateway has let it go.
    nacos.register(&gi(&g2)).await;
    soon("g2 takes gray traffic", || async { count(&g2) > 0 }).await;
    nacos.deregister(&gi(&g1)).await;
    soon("g1 is no node", || async {
        nodes(&gw, svc)
            .await
            .iter()
            .all(|n| n["addr"] != g1.addr.to_string())
    })
    .await;
    drop(g1);
    // A formal instance leaves the same way.
    nacos.deregister(&fi(&f2)).await;
    soon("f2 is no node", || async {
        nodes(&gw, svc)
            .await
            .iter()
            .all(|n| n["addr"] != f2.addr.to_string())
    })
    .await;
    drop(f2);
    served(50).await;

    // Nacos goes away: the last instances serve on.
    nacos.kill();
    soon("Nacos seen down", || async {
        gw.status().await["nacos"]["connected"] == false
    })
    .await;
    served(100).await;

    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap();
    let lane_of = |node: &str| {
        if node.starts_with('g') {
            "gray"
        } else {
            "formal"
        }
    };
    let bad: Vec<_> = seen
        .iter()
        .filter(|(lane, r)| !matches!(r, Ok(node) if lane_of(node) == *lane))
        .collect();
    println!("{} requests through the changes and the outage", seen.len());
    assert!(
        bad.is_empty(),
        "{} of {} requests lost or mis-laned: {:?}",
        bad.len(),
        seen.len(),
        &bad[..bad.len().min(5)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_on_the_gateway_logs_in() {
    let nacos = Nacos::start_env(&[
        ("RNACOS_ENABLE_OPEN_API_AUTH", "true"),
        ("RNACOS_INIT_ADMIN_USERNAME", "nacos"),
        ("RNACOS_INIT_ADMIN_PASSWORD", "s3cret-pass"),
    ])
    .await;
    let f = Backend::start("f", "formal").await;
    let svc = "guarded";
    nacos.register(&Inst::new(svc, f.addr)).await;
    let creds = |pass: &str| format!("  username: nacos\n  password: {pass}\n");
    let (_f1, gw) = start(&config(&nacos, svc, &creds("s3cret-pass"), ""));
    soon("served with the right password", || async {
        hit(&gw, None).await == Ok("f".into())
    })
    .await;
    assert_eq!(gw.status().await["nacos"]["connected"], true);
    // A wrong password: refused, nothing served, /status says why.
    let (_f2, bad) = start(&config(&nacos, svc, &creds("wrong"), ""));
    soon("refused", || async {
        let st = bad.status().await;
        st["nacos"]["connected"] == false && st["nacos"]["error"].is_string()
    })
    .await;
    let st = bad.status().await;
    assert_eq!(st["nacos"]["services"][0]["nodes"], 0, "{st}");
    assert_eq!(hit(&bad, None).await.unwrap_err().0, 503);
}
