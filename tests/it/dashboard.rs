//! The admin dashboard end to end in headless Chromium (Debian's
//! `chromium` + `chromium-driver`), driven over WebDriver by fantoccini.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::browser::{wait_text, Driver};
use crate::harness::*;
use fantoccini::Locator;

const SCRIPT: &str = "return function(req) return req:header('X-Lane') end\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_live_split_canary_nodes_rules_reloads_and_explains() {
    let [f1, v1] = backends([("f1", "formal"), ("v1", "v2")]).await;
    let dead = closed_port();
    let fx = Fixture::new();
    fx.write("lane.lua", SCRIPT);
    fx.write(
        "rules.yaml",
        "uid: { header: X-User-Id }\nrules:\n  - { name: staff, lane: gray, header: { name: X-Staff, values: [\"1\"] } }\n  - { name: canary, lane: gray, percentage: 5 }\n",
    );
    let api = Service::new("api")
        .set(
            "health",
            "{ passive: { max_fails: 3, cooldown_ms: 600000 } }",
        )
        .nodes([f1.node(), v1.node(), Node::new("g1", dead).lane("gray")]);
    Nodes::new().service(api).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .rules_file("rules.yaml")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    // The page first: the live split shows the last 10 s, and a browser's
    // start and first load on a loaded machine can take longer than that.
    let driver = Driver::start().await;
    let c = driver.browser().await;
    c.goto(&format!("http://{admin}/")).await.unwrap();
    assert_eq!(c.title().await.unwrap(), "graygate dashboard");
    // Traffic: formal healthy, v2 healthy, gray failing: its only node is
    // down, so 3 requests fail (502) until passive health ejects it and the
    // lane falls back to formal.
    for _ in 0..10 {
        assert_eq!(gw.get("/api/x").await.status, 200);
    }
    for i in 0..5 {
        let r = Req::get("/api/x")
            .header("X-Lane", "gray")
            .send(gw.addr)
            .await;
        assert_eq!(r.status, if i < 3 { 502 } else { 200 });
        let r = Req::get("/api/x")
            .header("X-Lane", "v2")
            .send(gw.addr)
            .await;
        assert_eq!(r.node(), "v1");
    }

    // Live split per lane.
    wait_text(
        &c,
        "#lanes tr[data-lane=formal] .total",
        "formal total",
        |t| t == "10",
    )
    .await;
    wait_text(&c, "#lanes tr[data-lane=gray] .total", "gray total", |t| {
        t == "5"
    })
    .await;
    wait_text(&c, "#lanes tr[data-lane=v2] .total", "v2 total", |t| {
        t == "5"
    })
    .await;
    wait_text(
        &c,
        "#lanes tr[data-lane=gray] .error-rate",
        "gray error rate",
        |t| t == "60.00 %",
    )
    .await;
    // Gray against formal as a release would judge it: a handful of
    // requests is too few to pass or fail.
    wait_text(
        &c,
        "#canary tr[data-lane=gray] .verdict",
        "gray verdict",
        |t| t == "inconclusive",
    )
    .await;
    wait_text(
        &c,
        "#canary tr[data-lane=gray] .error-check",
        "gray error check",
        |t| t == "inconclusive",
    )
    .await;
    wait_text(
        &c,
        "#canary tr[data-lane=v2] .latency-check",
        "v2 latency check",
        |t| t == "inconclusive",
    )
    .await;
    // Nodes with health and counters.
    wait_text(&c, "#nodes tr[data-node=g1] .errors", "g1 errors", |t| {
        t == "3"
    })
    .await;
    wait_text(&c, "#nodes tr[data-node=g1] .health", "g1 health", |t| {
        t == "unhealthy"
    })
    .await;
    // Its failed answers by status class (from `/stats`, sampled every 2 s).
    let by_class = wait_text(
        &c,
        "#nodes tr[data-node=g1] .by-class",
        "g1 answers by class",
        |t| t != "–",
    )
    .await;
    assert!(by_class.contains("5xx"), "{by_class}");
    wait_text(
        &c,
        "#nodes tr[data-node=f1] .requests",
        "f1 requests",
        |t| t == "12",
    )
    .await;
    wait_text(&c, "#nodes tr[data-node=f1] .health", "f1 health", |t| {
        t == "healthy"
    })
    .await;
    // Rules and script, status.
    wait_text(&c, "#script", "script source", |t| {
        t.contains("req:header('X-Lane')")
    })
    .await;
    wait_text(&c, "#routes tbody", "routes", |t| {
        t.contains("/api/") && t.contains("service api")
    })
    .await;
    wait_text(&c, "#generation", "generation", |t| t == "1").await;

    // The declarative rules, live: a percentage changed through the API
    // shows up.
    wait_text(&c, "#rules-state", "rules state", |t| {
        t.starts_with("enabled")
    })
    .await;
    wait_text(
        &c,
        "#rules tr[data-rule=canary] .percentage",
        "canary %",
        |t| t == "5 %",
    )
    .await;
    let r = Req::get("/rules/canary")
        .method("PATCH")
        .body(r#"{"percentage": 50}"#)
        .send(admin)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    wait_text(
        &c,
        "#rules tr[data-rule=canary] .percentage",
        "canary %",
        |t| t == "50 %",
    )
    .await;

    // The chart draws the formal lane's line over time. Formal traffic
    // keeps flowing meanwhile, so its line stands apart from the other
    // lanes' (at zero, drawn over it) however the first requests fell
    // into the sampler's intervals.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert_eq!(gw.get("/api/x").await.status, 200);
        let drawn = c
            .execute(
                "const c = document.getElementById('chart');
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let n = 0;
                 for (let i = 0; i < d.length; i += 4) if (d[i] == 0x1f && d[i+1] == 0x6f && d[i+2] == 0xeb) n++;
                 return n;",
                vec![],
            )
            .await
            .unwrap();
        if drawn.as_u64().unwrap_or(0) > 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the chart never drew the formal line"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The explain form.
    let form = c.find(Locator::Id("explain-form")).await.unwrap();
    let path = form.find(Locator::Css("input[name=path]")).await.unwrap();
    path.clear().await.unwrap();
    path.send_keys("/api/x").await.unwrap();
    form.find(Locator::Css("textarea[name=headers]"))
        .await
        .unwrap()
        .send_keys("X-Lane: v2")
        .await
        .unwrap();
    c.find(Locator::Id("explain-submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_text(&c, "dd[data-field=lane]", "explained lane", |t| t == "v2").await;
    wait_text(&c, "dd[data-field=chosen]", "explained node", |t| t == "v1").await;
    wait_text(&c, "dd[data-field=decided_by]", "explained decider", |t| {
        t == "script"
    })
    .await;
    assert_eq!(v1.count(), 5, "explain sent nothing to the node");

    // A rejected reload shows up with its file:line.
    fx.write_rename("lane.lua", "return function(req)\n  return (\nend\n");
    wait_text(&c, "#reload-result", "reload result", |t| {
        t.starts_with("rejected")
    })
    .await;
    wait_text(&c, "#reload-error", "reload error", |t| {
        t.contains("lane.lua:")
    })
    .await;

    let png = c.screenshot().await.unwrap();
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    std::fs::write(&shot, png).unwrap();
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_works_behind_the_admin_token_with_http_basic() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let gw = Config::new()
        .set("admin_token", "tok3n")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    assert_eq!(gw.get("/api/x").await.status, 200);
    assert_eq!(Req::get("/").send(admin).await.status, 401);

    let driver = Driver::start().await;
    let c = driver.browser().await;
    // Without credentials the browser gets the 401, not the dashboard.
    c.goto(&format!("http://{admin}/")).await.unwrap();
    assert_ne!(c.title().await.unwrap(), "graygate dashboard");
    // With the token as the Basic password the page and its data load.
    c.goto(&format!("http://operator:tok3n@{admin}/"))
        .await
        .unwrap();
    assert_eq!(c.title().await.unwrap(), "graygate dashboard");
    wait_text(&c, "#generation", "generation", |t| t == "1").await;
    wait_text(
        &c,
        "#nodes tr[data-node=f1] .requests",
        "f1 requests",
        |t| t == "1",
    )
    .await;
    wait_text(
        &c,
        "#lanes tr[data-lane=formal] .total",
        "formal total",
        |t| t == "1",
    )
    .await;
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_releases_and_their_decision_timeline() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    let spec = "name: web-v2\nlane: gray\nkey: { header: X-User }\nsteps:\n  - { weight: 30, min_duration_ms: 600000 }\nanalysis: { interval_ms: 200, min_requests: 1000000 }\n";
    let r = crate::releases::admin_post(&gw, "/releases", spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    for i in 0..20 {
        Req::get("/api/x")
            .header("X-User", &format!("d{i}"))
            .send(gw.addr)
            .await;
    }
    let driver = Driver::start().await;
    let c = driver.browser().await;
    c.goto(&format!("http://{admin}/")).await.unwrap();
    let row = wait_text(
        &c,
        "#releases tr[data-release='web-v2']",
        "the release row",
        |t| t.contains("progressing") && t.contains("30.0 %"),
    )
    .await;
    assert!(row.contains("gray"), "{row}");
    // The step as the API counts it (the index in the spec's `steps`, from 0).
    let api = Req::get("/releases").send(admin).await.json();
    let api_step = api["releases"][0]["step"].as_u64().unwrap();
    assert_eq!(api_step, 0, "{api}");
    let cell = wait_text(
        &c,
        "#releases tr[data-release='web-v2'] .step",
        "the step cell",
        |t| !t.is_empty(),
    )
    .await;
    assert_eq!(cell, format!("{api_step} (of 1, from 0)"));
    // The timeline shows judged intervals with their values and reasons.
    let tl = wait_text(&c, "#release-timeline", "inconclusive decisions", |t| {
        t.contains("inconclusive") && t.contains("too few requests")
    })
    .await;
    assert!(tl.contains(&format!("step {api_step} (30.0 %)")), "{tl}");
    // An abort shows as rolled back.
    let r = Req::get("/releases/web-v2/abort")
        .method("POST")
        .send(admin)
        .await;
    assert_eq!(r.status, 200);
    wait_text(
        &c,
        "#releases tr[data-release='web-v2'] .state",
        "rolled back",
        |t| t == "rolled_back",
    )
    .await;
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_a_release_held_by_its_webhook_and_why() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let hook = Backend::text("hook", 0, http::StatusCode::SERVICE_UNAVAILABLE).await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    let spec = format!(
        "name: hooked\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 50, min_duration_ms: 1 }}\n  - {{ weight: 80 }}\nwebhooks: {{ before_step: \"http://{}/ok\" }}\n{}\n",
        hook.addr,
        crate::releases::LIFECYCLE
    );
    let r = crate::releases::admin_post(&gw, "/releases", &spec).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t = user_traffic(gw.addr, stop.clone());
    let driver = Driver::start().await;
    let c = driver.browser().await;
    c.goto(&format!("http://{admin}/")).await.unwrap();
    wait_text(
        &c,
        "#releases tr[data-release='hooked'] .state",
        "held",
        |t| t == "held",
    )
    .await;
    let why = wait_text(
        &c,
        "#releases tr[data-release='hooked'] .last",
        "the hold's reason",
        |t| t.starts_with("held: "),
    )
    .await;
    assert!(why.contains("503"), "{why}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.await.unwrap();
    c.close().await.unwrap();
}

/// The canary entry of `lane` in `/stats`, once it counts `at_least`
/// gray requests.
async fn canary(admin: std::net::SocketAddr, lane: &str, at_least: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = Req::get("/stats").send(admin).await.json();
        let found = st["canary"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["lane"] == lane).cloned());
        if let Some(c) = found.filter(|c| c["gray"]["requests"].as_u64() >= Some(at_least)) {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no canary entry for {lane}: {st}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canary_panel_judges_like_a_release_on_the_fine_histogram() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1, &g1]);
    fx.write(
        "rules.yaml",
        "uid: { header: X-User }\nrules:\n  - { name: half, lane: gray, percentage: 50 }\n",
    );
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .rules_file("rules.yaml")
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    // A few healthy gray requests: inconclusive, not a pass.
    let mut gray = 0;
    for i in 0..12 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("c{i}"))
            .send(gw.addr)
            .await;
        gray += u64::from(r.node() == "g1");
    }
    assert!(gray > 0);
    let c = canary(admin, "gray", gray).await;
    assert_eq!(c["verdict"], "inconclusive", "{c}");
    assert_eq!(c["errors"], "inconclusive", "{c}");
    assert!(
        c["reason"].as_str().unwrap().contains("too few requests"),
        "{c}"
    );
    // Past the sample minimums (2000 per lane for errors), healthy: pass.
    let stop = Arc::new(AtomicBool::new(false));
    let users: Vec<_> = (0..4)
        .map(|_| user_traffic(gw.addr, stop.clone()))
        .collect();
    let st = Req::get("/stats").send(admin).await.json();
    // A healthy gray's error check passes on about 735 requests per lane
    // (its excess bounded within 0.5 pp); `min_requests` is only a floor.
    assert_eq!(st["thresholds"]["min_requests_errors"], 735, "{st}");
    assert_eq!(st["thresholds"]["min_requests_latency"], 20, "{st}");
    let mut c = canary(admin, "gray", 2000).await;
    while c["formal"]["requests"].as_u64().unwrap() < 2000 {
        c = canary(admin, "gray", c["gray"]["requests"].as_u64().unwrap() + 1).await;
    }
    stop.store(true, Ordering::Relaxed);
    for u in users {
        u.await.unwrap();
    }
    assert_eq!(c["verdict"], "pass", "{c}");
    assert_eq!(
        (&c["errors"], &c["latency"]),
        (&"pass".into(), &"pass".into()),
        "{c}"
    );
    // The p99 is a bound of the fine histogram (50 µs × 1.08^k), not an
    // interpolation inside Prometheus' coarse buckets.
    for lane in ["gray", "formal"] {
        let us = c[lane]["p99_ms"].as_f64().unwrap() * 1000.0;
        let k = (us / 50.0).ln() / 1.08f64.ln();
        assert!((k - k.round()).abs() < 0.05, "{lane} p99 {us} µs: {c}");
    }
}

/// An admin request with the token as a Bearer credential.
async fn admin_call(admin: std::net::SocketAddr, method: &str, path: &str, body: &str) -> Resp {
    Req::get(path)
        .method(method)
        .header("Authorization", "Bearer tok3n")
        .body(body.to_string())
        .send(admin)
        .await
}

/// The `state` of release `name` as `GET /releases/NAME` says it.
async fn api_state(admin: std::net::SocketAddr, name: &str) -> String {
    let r = admin_call(admin, "GET", &format!("/releases/{name}"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["state"].as_str().unwrap_or_default().to_string()
}

/// The actions of the buttons in release `name`'s row, in page order.
async fn buttons(c: &fantoccini::Client, name: &str) -> Vec<String> {
    let v = c
        .execute(
            "return [...document.querySelectorAll(`#releases tr[data-release='${arguments[0]}'] button`)].map((b) => b.dataset.action);",
            vec![name.into()],
        )
        .await
        .unwrap();
    serde_json::from_value(v).unwrap()
}

/// Clicks release `name`'s `action` button (found afresh on each try: the
/// page redraws its rows every 2 s) and, with `confirm`, accepts the
/// confirmation it asks for.
async fn click_action(c: &fantoccini::Client, name: &str, action: &str, confirm: bool) {
    let css = format!("#releases tr[data-release='{name}'] button[data-action={action}]");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(b) = c.find(Locator::Css(&css)).await {
            if b.click().await.is_ok() {
                break;
            }
        }
        assert!(Instant::now() < deadline, "no {action} button for {name}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if !confirm {
        return;
    }
    loop {
        if let Ok(text) = c.get_alert_text().await {
            assert!(text.contains(name), "{text}");
            c.accept_alert().await.unwrap();
            return;
        }
        assert!(Instant::now() < deadline, "no confirmation for {action}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits, with a deadline, until the page shows release `name` in `state`
/// with exactly the buttons `expected`, and the API agrees on the state.
async fn reached(
    c: &fantoccini::Client,
    admin: std::net::SocketAddr,
    name: &str,
    state: &str,
    expected: &[&str],
) {
    wait_text(
        c,
        &format!("#releases tr[data-release='{name}'] .state"),
        state,
        |t| t == state,
    )
    .await;
    assert_eq!(api_state(admin, name).await, state);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = buttons(c, name).await;
        if got == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} {state}: buttons {got:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_drives_a_release_with_its_buttons_behind_the_admin_token() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("lane.lua", SCRIPT);
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .set("admin_token", "tok3n")
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    // A long interval and an unreachable sample: the release moves only
    // when the operator moves it. Its own threshold (5 pp) is not the
    // default (0.5 pp).
    let spec = |name: &str| {
        format!(
            "name: {name}\nlane: gray\nkey: {{ header: X-User }}\nsteps:\n  - {{ weight: 30, min_duration_ms: 600000 }}\n  - {{ weight: 60 }}\nanalysis: {{ interval_ms: 600000, min_requests: 1000000, max_error_delta_pp: 5 }}\n"
        )
    };
    let r = admin_call(admin, "POST", "/releases", &spec("web-v2")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let mut gray = 0;
    for i in 0..20 {
        let r = Req::get("/api/x")
            .header("X-User", &format!("d{i}"))
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200);
        gray += u32::from(r.node() == "g1");
    }
    assert!(gray > 0, "the 30 % step sent none of 20 users to gray");

    let driver = Driver::start().await;
    let c = driver.browser().await;
    c.goto(&format!("http://operator:tok3n@{admin}/"))
        .await
        .unwrap();
    assert_eq!(c.title().await.unwrap(), "graygate dashboard");
    reached(
        &c,
        admin,
        "web-v2",
        "progressing",
        &["pause", "promote", "abort"],
    )
    .await;
    wait_text(
        &c,
        "#lanes tr[data-lane=gray] .release",
        "gray's release",
        |t| t == "web-v2: progressing 30.0 %",
    )
    .await;
    // The canary panel judges the lane by the release, with its thresholds.
    let judged = wait_text(
        &c,
        "#canary tr[data-lane=gray] .judged-by",
        "the canary judged by the release",
        |t| t.starts_with("release web-v2 (progressing)"),
    )
    .await;
    assert!(judged.contains("±5 pp"), "{judged}");
    // The server judges the lane's last 60 s with the release's analysis.
    let st = admin_call(admin, "GET", "/stats", "").await.json();
    let row = st["canary"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["lane"] == "gray")
        .cloned()
        .unwrap_or_else(|| panic!("{st}"));
    assert_eq!(row["release"], "web-v2", "{row}");
    assert_eq!(row["max_error_delta_pp"], 5.0, "{row}");

    // Pause, resume: each reached on the page and in the API.
    click_action(&c, "web-v2", "pause", false).await;
    reached(
        &c,
        admin,
        "web-v2",
        "paused",
        &["resume", "promote", "abort"],
    )
    .await;
    wait_text(
        &c,
        "#releases tr[data-release='web-v2'] .action-msg",
        "pause done",
        |t| t == "pause: done",
    )
    .await;
    click_action(&c, "web-v2", "resume", false).await;
    reached(
        &c,
        admin,
        "web-v2",
        "progressing",
        &["pause", "promote", "abort"],
    )
    .await;
    click_action(&c, "web-v2", "promote", false).await;
    reached(&c, admin, "web-v2", "promoted", &["finish"]).await;
    // The moves and the last reload are marked on the request chart.
    let events = wait_text(&c, "#chart-events", "the chart's events", |t| {
        t.contains("web-v2 promote") && t.contains("reload (generation")
    })
    .await;
    for kind in ["pause", "resume"] {
        assert!(events.contains(&format!("web-v2 {kind}")), "{events}");
    }
    let promote = wait_text(
        &c,
        "#chart-events li[data-kind=promote]",
        "the promotion on the chart",
        |t| t.ends_with("web-v2 promote"),
    )
    .await;
    assert!(!promote.is_empty());
    // A refused action (as from a page that had not refreshed yet after
    // another operator promoted): the server's 409 and its words stay in
    // the row, and the release is unchanged.
    c.execute("window.releaseAction('web-v2', 'pause'); return 0;", vec![])
        .await
        .unwrap();
    let msg = wait_text(
        &c,
        "#releases tr[data-release='web-v2'] .action-msg",
        "the refusal",
        |t| t.starts_with("pause refused (409)"),
    )
    .await;
    assert!(msg.contains("never moves again"), "{msg}");
    assert_eq!(api_state(admin, "web-v2").await, "promoted");
    // Finish (after its confirmation): no buttons left.
    click_action(&c, "web-v2", "finish", true).await;
    reached(&c, admin, "web-v2", "finished", &[]).await;

    // A second release on the freed lane, aborted: the lane shows revoked,
    // and the canary panel the release's rollback instead of a verdict at
    // the defaults.
    let r = admin_call(admin, "POST", "/releases", &spec("web-v3")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    reached(
        &c,
        admin,
        "web-v3",
        "progressing",
        &["pause", "promote", "abort"],
    )
    .await;
    click_action(&c, "web-v3", "abort", true).await;
    reached(&c, admin, "web-v3", "rolled_back", &["finish"]).await;
    wait_text(
        &c,
        "#lanes tr[data-lane=gray] .release",
        "gray revoked",
        |t| t == "revoked (release web-v3 rolled back)",
    )
    .await;
    let revoked = c
        .execute(
            "return document.querySelector('#lanes tr[data-lane=gray]').classList.contains('revoked');",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(revoked, serde_json::Value::Bool(true));
    wait_text(
        &c,
        "#canary tr[data-lane=gray] .verdict",
        "the release's rollback",
        |t| t == "rollback",
    )
    .await;
    let judged = wait_text(
        &c,
        "#canary tr[data-lane=gray] .judged-by",
        "judged by web-v3",
        |t| t.starts_with("release web-v3 (rolled_back)"),
    )
    .await;
    assert!(judged.contains("aborted by the operator"), "{judged}");
    let png = c.screenshot().await.unwrap();
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-release.png");
    std::fs::write(&shot, png).unwrap();
    // Finishing the rolled-back release frees the lane.
    click_action(&c, "web-v3", "finish", true).await;
    reached(&c, admin, "web-v3", "finished", &[]).await;
    wait_text(&c, "#lanes tr[data-lane=gray] .release", "gray free", |t| {
        t.is_empty()
    })
    .await;
    wait_text(
        &c,
        "#canary tr[data-lane=gray] .judged-by",
        "judged at the defaults",
        |t| t.starts_with("defaults"),
    )
    .await;

    // A lane without nodes shows while it has traffic, and goes once it is
    // stale (no node, no request in the last 10 s).
    for _ in 0..3 {
        let r = Req::get("/api/x")
            .header("X-Lane", "ghost")
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 200);
    }
    wait_text(&c, "#lanes tr[data-lane=ghost] .total", "ghost lane", |t| {
        t == "3"
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while c
        .find(Locator::Css("#lanes tr[data-lane=ghost]"))
        .await
        .is_ok()
    {
        assert!(Instant::now() < deadline, "the stale ghost lane stayed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Lanes with nodes stay, traffic or not.
    assert!(c
        .find(Locator::Css("#lanes tr[data-lane=gray]"))
        .await
        .is_ok());
    c.close().await.unwrap();
}
