//! Hot reload through the real binary: file watcher (in-place writes and
//! editor-style rename-over), SIGHUP, rejection of bad changes with
//! file:line while the old generation keeps serving; and `--check`.

use std::process::Command;
use std::time::Duration;

use crate::harness::*;

const LIMIT: Duration = Duration::from_secs(10);

struct Env {
    fx: Fixture,
    gw: Gateway,
    _f: Backend,
    _g: Backend,
    _g2: Backend,
    nodes_formal_gray: String,
    g2_yaml: String,
}

async fn setup() -> Env {
    let [f, g, g2] = backends([("f1", "formal"), ("g1", "gray"), ("g2", "gray")]).await;
    let fx = Fixture::new();
    fx.write("scripts/lib/rules.lua", "return { lane = 'gray' }\n");
    fx.write(
        "scripts/lane.lua",
        "local rules = require('lib.rules')\nreturn function(req)\n  if graygate.in_list('testers', req.ip) then return rules.lane end\n  return req:header('X-Lane')\nend\n",
    );
    fx.write("lists/testers.txt", "127.0.9.0/24\n");
    let nodes_formal_gray = Nodes::api(nodes_of([&f, &g])).to_yaml();
    fx.write("nodes.yaml", &nodes_formal_gray);
    let gw = Config::new()
        .script("scripts/lane.lua")
        .raw("lists: { testers: lists/testers.txt }\n")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let g2_yaml = g2.node_yaml();
    Env {
        fx,
        gw,
        _f: f,
        _g: g,
        _g2: g2,
        nodes_formal_gray,
        g2_yaml,
    }
}

async fn node_for(gw: &Gateway, req: Req) -> String {
    let r = req.send(gw.addr).await;
    if r.status == 200 {
        r.node()
    } else {
        format!("status {}", r.status)
    }
}

async fn generation(gw: &Gateway) -> u64 {
    gw.status().await["generation"].as_u64().unwrap()
}

async fn wait_error(gw: &Gateway, needle: &str) -> String {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let err = gw.status().await["last_reload_error"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if err.contains(needle) {
            return err;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no last_reload_error containing {needle:?}; last: {err:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_module_list_and_node_changes_apply_without_restart() {
    let e = setup().await;
    let gw = &e.gw;
    assert_eq!(generation(gw).await, 1);
    assert_eq!(node_for(gw, Req::get("/")).await, "f1");

    // Script edited in place.
    e.fx.write(
        "scripts/lane.lua",
        "local rules = require('lib.rules')\nreturn function(req) return 'gray' end\n",
    );
    eventually("script change serving", LIMIT, || async {
        node_for(gw, Req::get("/")).await == "g1"
    })
    .await;
    assert!(generation(gw).await >= 2);

    // A required module, saved by rename-over.
    e.fx.write(
        "scripts/lane.lua",
        "local rules = require('lib.rules')\nreturn function(req) return rules.lane end\n",
    );
    e.fx.write_rename("scripts/lib/rules.lua", "return { lane = 'formal' }\n");
    eventually("module change serving", LIMIT, || async {
        node_for(gw, Req::get("/")).await == "f1"
    })
    .await;

    // Node file, rename-over: a second gray node joins.
    e.fx.write(
        "scripts/lane.lua",
        "return function(req) return req:header('X-Lane') end\n",
    );
    e.fx.write_rename(
        "nodes.yaml",
        &format!("{}{}", e.nodes_formal_gray, e.g2_yaml),
    );
    eventually("new node serving", LIMIT, || async {
        node_for(gw, Req::get("/").header("X-Lane", "gray")).await == "g2"
    })
    .await;
    assert!(gw.status().await["last_reload_error"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_list_change_applies() {
    let e = setup().await;
    let gw = &e.gw;
    let from = |ip: &str| Req::get("/").from_ip(ip);
    assert_eq!(node_for(gw, from("127.0.9.7")).await, "g1");
    assert_eq!(node_for(gw, from("127.0.11.7")).await, "f1");
    e.fx.write("lists/testers.txt", "# moved\n127.0.11.0/24\n");
    eventually("list change serving", LIMIT, || async {
        node_for(gw, from("127.0.11.7")).await == "g1"
    })
    .await;
    assert_eq!(node_for(gw, from("127.0.9.7")).await, "f1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_changes_are_rejected_and_the_old_generation_keeps_serving() {
    let e = setup().await;
    let gw = &e.gw;
    let gray = || Req::get("/").header("X-Lane", "gray");
    assert_eq!(node_for(gw, gray()).await, "g1");
    let gen0 = generation(gw).await;
    let good_script = std::fs::read_to_string(e.fx.path("scripts/lane.lua")).unwrap();

    // Lua syntax error: rejected with the script's file:line.
    e.fx.write("scripts/lane.lua", "return function(req)\n  if then\nend\n");
    let err = wait_error(gw, "lane.lua:2").await;
    assert!(err.contains("scripts/lane.lua:2:"), "{err}");
    assert_eq!(node_for(gw, gray()).await, "g1");
    assert_eq!(generation(gw).await, gen0);
    e.fx.write("scripts/lane.lua", &good_script);
    eventually("recovery", LIMIT, || async {
        gw.status().await["last_reload_error"].is_null()
    })
    .await;

    // Bad CIDR in a list.
    e.fx.write("lists/testers.txt", "127.0.9.0/24\n10.0.0.0/99\n");
    let err = wait_error(gw, "testers.txt:2").await;
    assert!(err.contains("10.0.0.0/99"), "{err}");
    assert_eq!(node_for(gw, Req::get("/").from_ip("127.0.9.3")).await, "g1");

    // Bad YAML in the node file (the list fixed first: the first error wins).
    e.fx.write("lists/testers.txt", "127.0.9.0/24\n");
    e.fx.write("nodes.yaml", "services:\n  api:\n    nodes: [ {addr: \n");
    wait_error(gw, "nodes.yaml:").await;
    assert_eq!(node_for(gw, gray()).await, "g1");

    // A route naming an unknown service, in the main config.
    e.fx.write("nodes.yaml", &e.nodes_formal_gray);
    let cfg = std::fs::read_to_string(e.fx.path("gg.yaml")).unwrap();
    e.fx.write("gg.yaml", &cfg.replace("service: api", "service: nope"));
    let err = wait_error(gw, "unknown service").await;
    assert!(err.contains("gg.yaml:"), "{err}");
    assert_eq!(node_for(gw, gray()).await, "g1");
    gw.wait_log_line("reload rejected: unknown service", |l| {
        l.contains("reload rejected") && l.contains("unknown service")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads() {
    let e = setup().await;
    let gw = &e.gw;
    let gen0 = generation(gw).await;
    gw.signal("HUP");
    eventually("generation grows after SIGHUP", LIMIT, || async {
        generation(gw).await > gen0
    })
    .await;
    gw.wait_log("SIGHUP").await;
}

fn check(config: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--check")
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

#[test]
fn check_mode_validates_like_nginx_t() {
    let (ok, out) = check(std::path::Path::new("config/graygate.yaml"));
    assert!(ok, "{out}");
    assert!(out.contains("configuration ok"));

    let fx = Fixture::new();
    fx.write("s.lua", "return function(req)\n  return 'gray'\nend end\n");
    let cfg = fx.write("gg.yaml", &main_config("script: s.lua\n"));
    let (ok, out) = check(&cfg);
    assert!(!ok);
    assert!(out.contains("s.lua:3:"), "{out}");

    let cfg = fx.write(
        "gg2.yaml",
        "listen: 127.0.0.1:0\ntrusted_proxies:\n  - 300.1.1.1/8\n",
    );
    let (ok, out) = check(&cfg);
    assert!(!ok);
    assert!(out.contains("gg2.yaml:3:"), "{out}");

    fx.write(
        "n.yaml",
        "services:\n  a:\n    nodes:\n      - { addr: \"127.0.0.1:1\", lane: \"bad lane\" }\n",
    );
    let cfg = fx.write("gg3.yaml", "listen: 127.0.0.1:0\nnode_files: [n.yaml]\n");
    let (ok, out) = check(&cfg);
    assert!(!ok);
    assert!(
        out.contains("n.yaml:4:") && out.contains("invalid lane"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_finish_on_their_generation() {
    use http_body_util::BodyExt;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let slow = Backend::start_mode("slow", "formal", Mode::Gated(gate.clone())).await;
    let fast = Backend::start("fast", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&slow]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let resp = Req::get("/").send_streaming(gw.addr).await;
    assert_eq!(resp.status(), 200);
    // Swap the only node out while the response is still streaming.
    let started = std::time::Instant::now();
    fx.write_rename("nodes.yaml", &Nodes::api([fast.node()]).to_yaml());
    eventually("new generation applied", LIMIT, || async {
        generation(&gw).await >= 2
    })
    .await;
    eprintln!("reload applied after {:?}", started.elapsed());
    assert_eq!(gw.get("/").await.node(), "fast");
    gate.notify_one();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "first;rest");
    assert_eq!(slow.count(), 1);
}

/// A certificate for `name` (CN and SAN) and its key, as PEM text.
fn cert_pair(name: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    crate::harness::tls::write_cert(dir.path(), "c", name);
    let read = |ext: &str| std::fs::read_to_string(dir.path().join(format!("c.{ext}"))).unwrap();
    (read("crt"), read("key"))
}

/// Three volumes laid out and updated as kubelet does (ConfigMap `cfg`:
/// main file, node file, script; Secret `tls`: certificate and key;
/// ConfigMap `www`: a static tree in a subdirectory). The gateway is
/// started on the `cfg/graygate.yaml` symlink; each volume's update alone
/// reloads it, and the directory each update replaced is removed while it
/// serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_volume_updates_reload_config_script_static_and_certificates() {
    use crate::harness::tls::{listeners, served_cn};
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    let nodes = Nodes::api(nodes_of([&f, &g])).to_yaml();
    let tls = fx.path("tls");
    let www = fx.path("www");
    let main = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/api/", "api"),
            Route::static_dir("/", &format!("{}/site", www.display())),
        ])
        .listeners(&[Listener::tls().cert(
            &format!("{}/tls.crt", tls.display()),
            &format!("{}/tls.key", tls.display()),
        )])
        .to_yaml();
    let script = |lane: &str| format!("return function(req) return {lane} end\n");
    let cfg_files = |lane: &str| {
        [
            ("graygate.yaml", main.clone()),
            ("nodes.yaml", nodes.clone()),
            ("lane.lua", script(lane)),
        ]
    };
    let publish = |vol: &str, files: &[(&str, String)]| {
        let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (*n, t.as_str())).collect();
        fx.kube_publish(vol, &files)
    };
    let (crt, key) = cert_pair("one.example");
    publish("tls", &[("tls.crt", crt), ("tls.key", key)]);
    publish("www", &[("site/formal/index.html", "<h1>v1</h1>\n".into())]);
    publish("cfg", &cfg_files("nil"));
    let config = fx.path("cfg/graygate.yaml");
    assert!(std::fs::symlink_metadata(&config).unwrap().is_symlink());
    let gw = Gateway::start(&config);
    let addr = listeners(&gw)[0];
    let api = || async { gw.get("/api/x").await.node() };
    let page = || async { gw.get("/").await.text() };
    assert_eq!(api().await, "f1");
    assert_eq!(page().await, "<h1>v1</h1>\n");
    assert_eq!(served_cn(addr, Some("localhost")), "one.example");

    // The ConfigMap: a new script.
    let gen = gw.generation().await;
    let old = publish("cfg", &cfg_files("'gray'")).unwrap();
    gw.wait_generation(gen).await;
    soon("the new script", || async { api().await == "g1" }).await;
    std::fs::remove_dir_all(old).unwrap();

    // The Secret: the new certificate is served to new connections.
    let gen = gw.generation().await;
    let (crt, key) = cert_pair("two.example");
    let old = publish("tls", &[("tls.crt", crt), ("tls.key", key)]).unwrap();
    gw.wait_generation(gen).await;
    soon("the new certificate is served", || async {
        served_cn(addr, Some("localhost")) == "two.example"
    })
    .await;
    std::fs::remove_dir_all(old).unwrap();

    // The static tree's volume: its root is a link into `..data`.
    let gen = gw.generation().await;
    let old = publish("www", &[("site/formal/index.html", "<h1>v2</h1>\n".into())]).unwrap();
    gw.wait_generation(gen).await;
    soon("the new page", || async { page().await == "<h1>v2</h1>\n" }).await;
    std::fs::remove_dir_all(old).unwrap();

    // Every replaced directory gone: all serves on, a rebuild (SIGHUP)
    // reads the new directories, and a further update is seen.
    let gen = gw.generation().await;
    gw.signal("HUP");
    gw.wait_generation(gen).await;
    assert_eq!(api().await, "g1");
    assert_eq!(page().await, "<h1>v2</h1>\n");
    assert_eq!(served_cn(addr, Some("localhost")), "two.example");
    let gen = gw.generation().await;
    publish("cfg", &cfg_files("nil"));
    gw.wait_generation(gen).await;
    soon("the script after the removals", || async {
        api().await == "f1"
    })
    .await;
    assert!(gw.status().await["last_reload_error"].is_null());
}

/// A deploy that switches a `current` symlink to a new release directory
/// with `ln -sfn`: the gateway, started on `current/graygate.yaml`,
/// reloads onto the new release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ln_sfn_deploy_of_a_release_directory_reloads() {
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    for (release, lane) in [("v1", "nil"), ("v2", "'gray'")] {
        fx.write(
            &format!("releases/{release}/lane.lua"),
            &format!("return function(req) return {lane} end\n"),
        );
        Nodes::api(nodes_of([&f, &g])).write(&fx, &format!("releases/{release}/nodes.yaml"));
        Config::new()
            .script("lane.lua")
            .node_files(&["nodes.yaml"])
            .route_all("api")
            .write(&fx, &format!("releases/{release}/graygate.yaml"));
    }
    let ln = |release: &str| {
        let ok = Command::new("ln")
            .arg("-sfn")
            .arg(format!("releases/{release}"))
            .arg("current")
            .current_dir(fx.dir.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "ln -sfn failed");
    };
    ln("v1");
    let gw = Gateway::start(&fx.path("current/graygate.yaml"));
    assert_eq!(gw.get("/").await.node(), "f1");
    let gen = gw.generation().await;
    ln("v2");
    gw.wait_generation(gen).await;
    assert_eq!(gw.get("/").await.node(), "g1");
    // And back.
    let gen = gw.generation().await;
    ln("v1");
    gw.wait_generation(gen).await;
    assert_eq!(gw.get("/").await.node(), "f1");
}

/// A reload rejected after its build (here: a listener change, which needs
/// a restart) leaves every live thing as it was: a shared dictionary is
/// neither resized (its items evicted) by the rejected generation's
/// smaller size nor written by its script's top level; an accepted reload
/// does resize it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_reload_leaves_shared_dictionaries_alone() {
    let f = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f]);
    let script = "return function(req)\n  local d = ngx.shared.d\n  local batch = tonumber(req:header('X-Fill'))\n  if batch then\n    for i = batch * 100 + 1, batch * 100 + 100 do d:set('k' .. i, string.rep('v', 100)) end\n  end\n  ngx.req.set_header('X-Count', #d:get_keys(0))\nend\n";
    fx.write("lane.lua", script);
    let main = |size: &str, extra_listener: bool| {
        let c = Config::new()
            .script("lane.lua")
            .node_files(&["nodes.yaml"])
            .route_all("api")
            .raw(&format!("shared_dicts:\n  d: {size}\n"));
        if extra_listener {
            c.listeners(&[Listener::h2c()])
        } else {
            c
        }
    };
    let gw = main("1m", false).start(&fx, "gg.yaml");
    let count = || async {
        assert_eq!(gw.get("/").await.status, 200);
        f.last()
            .header("x-count")
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    for batch in 0..5 {
        let r = Req::get("/")
            .header("X-Fill", &batch.to_string())
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(count().await, 500);
    let rejected = || async { gw.status().await["reloads_rejected"].as_u64().unwrap() };
    let gen = generation(&gw).await;

    // 16k holds about a hundred such items; the listener change is refused.
    let before = rejected().await;
    main("16k", true).write_rename(&fx, "gg.yaml");
    eventually(
        "the resize with a listener change rejected",
        LIMIT,
        || async { rejected().await > before },
    )
    .await;
    assert!(wait_error(&gw, "needs a restart").await.contains("gg.yaml"));
    assert_eq!(
        count().await,
        500,
        "a rejected generation resized the dictionary"
    );

    // A script whose top level empties the dictionary, rejected with it.
    let before = rejected().await;
    fx.write_rename("lane.lua", &format!("ngx.shared.d:flush_all()\n{script}"));
    eventually("the flushing script rejected", LIMIT, || async {
        rejected().await > before
    })
    .await;
    assert_eq!(
        count().await,
        500,
        "a rejected script's top level wrote to the dictionary"
    );
    assert_eq!(generation(&gw).await, gen);

    // Accepted (same listeners, the first script): resized now.
    fx.write_rename("lane.lua", script);
    main("16k", false).write_rename(&fx, "gg.yaml");
    gw.wait_generation(gen).await;
    eventually("the accepted resize evicts", LIMIT, || async {
        let n = count().await;
        n > 0 && n < 150
    })
    .await;
}
