//! Declarative gray rules through the real binary: deny → rules → script,
//! fallback, the enabled switch, hot reload and rejection of bad files.

use crate::harness::*;

const RULES: &str = "\
enabled: true
uid: { header: X-User-Id }
deny:
  - name: blocked-office
    ip: [127.0.8.0/24]
rules:
  - name: testers
    lane: gray
    ip: { list: testers }
  - name: beta-header
    lane: gray-a
    header: { name: X-Beta, values: [\"1\"] }
  - name: vip-uids
    lane: gray
    uid: { in: [42], ranges: [[1000, 1099]] }
  - name: v2-api
    lane: v2
    path_prefix: /api/v2/
  - name: ghost
    lane: ghost
    path_prefix: /ghost/
fallback: formal
";

async fn backends() -> Vec<Backend> {
    let mut v = Vec::new();
    for l in ["formal", "gray", "gray-a", "gray-b", "v2"] {
        v.push(Backend::start(&format!("n-{l}"), l).await);
    }
    v
}

fn write_common(fx: &Fixture, bs: &[Backend]) {
    fx.write("testers.txt", "127.0.8.0/24\n127.0.9.0/24\n");
    Nodes::api(nodes_of(bs)).write(fx, "nodes.yaml");
}

async fn tag(gw: &Gateway, req: Req) -> String {
    let r = req.send(gw.addr).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["tag"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_file_deny_first_ordered_rules_fallback_and_hot_reload() {
    let bs = backends().await;
    let fx = Fixture::new();
    write_common(&fx, &bs);
    fx.write("rules.yaml", RULES);
    let cfg = fx.write(
        "gg.yaml",
        &main_config(
            "lists:\n  testers: testers.txt\nrules_file: rules.yaml\nnode_files: [nodes.yaml]\nroutes:\n  - prefix: /\n    service: api\n",
        ),
    );
    let gw = Gateway::start(&cfg);

    // Deny wins over every rule that would match (testers list, header, uid).
    let denied = Req::get("/api/v2/x")
        .from_ip("127.0.8.5")
        .header("X-Beta", "1")
        .header("X-User-Id", "42");
    assert_eq!(tag(&gw, denied).await, "formal");
    // First match wins, in file order.
    let both = Req::get("/").from_ip("127.0.9.5").header("X-Beta", "1");
    assert_eq!(tag(&gw, both).await, "gray");
    assert_eq!(
        tag(&gw, Req::get("/").header("X-Beta", "1")).await,
        "gray-a"
    );
    assert_eq!(
        tag(&gw, Req::get("/").header("X-Beta", "2")).await,
        "formal"
    );
    assert_eq!(
        tag(&gw, Req::get("/").header("X-User-Id", "42")).await,
        "gray"
    );
    assert_eq!(
        tag(&gw, Req::get("/").header("X-User-Id", "1050")).await,
        "gray"
    );
    assert_eq!(
        tag(&gw, Req::get("/").header("X-User-Id", "1100")).await,
        "formal"
    );
    assert_eq!(tag(&gw, Req::get("/api/v2/items")).await, "v2");
    assert_eq!(tag(&gw, Req::get("/api/v1/items")).await, "formal");
    // A lane nothing serves: warned at load, formal nodes carry it.
    let r = Req::get("/ghost/x").send(gw.addr).await;
    assert_eq!(r.json()["tag"], "ghost");
    assert_eq!(r.json()["lane"], "formal");
    gw.wait_log_line("ghost lane warning", |l| {
        l.contains("WARN") && l.contains("lane \"ghost\" is served by no node")
    })
    .await;

    // Hot reload of the rule file: a new fallback.
    let g0 = gw.status().await["generation"].as_u64().unwrap();
    fx.write_rename(
        "rules.yaml",
        &RULES.replace("fallback: formal", "fallback: gray-b"),
    );
    soon("new fallback applied", || async {
        gw.status().await["generation"].as_u64().unwrap() > g0
            && tag(&gw, Req::get("/")).await == "gray-b"
    })
    .await;
    // Deny still sends to formal, not to the fallback.
    assert_eq!(tag(&gw, Req::get("/").from_ip("127.0.8.9")).await, "formal");

    // A bad file is rejected with file:line; the previous rules keep serving.
    let bad = RULES.replace("[127.0.8.0/24]", "[127.0.8.0/24, 300.1.1.1/8]");
    fx.write_rename("rules.yaml", &bad);
    soon("bad CIDR rejected", || async {
        gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("rules.yaml:5:") && e.contains("300.1.1.1/8"))
    })
    .await;
    assert_eq!(tag(&gw, Req::get("/")).await, "gray-b");
    for (what, text, line) in [
        (
            "percentage",
            RULES.replace(
                "    path_prefix: /ghost/\n",
                "    percentage: 120\n    key: { ip: true }\n",
            ),
            "rules.yaml:21:",
        ),
        (
            "regex",
            RULES.replace("values: [\"1\"]", "regex: \"[unclosed\""),
            "rules.yaml:12:",
        ),
        (
            "source",
            RULES.replace("uid: { header: X-User-Id }", "uid: { body: uid }"),
            "rules.yaml:2:",
        ),
    ] {
        fx.write_rename("rules.yaml", &text);
        soon(&format!("bad {what} rejected"), || async {
            gw.status().await["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.contains(line))
        })
        .await;
        assert_eq!(tag(&gw, Req::get("/")).await, "gray-b", "{what}");
    }

    // enabled: false switches every rule off (deny included): no script → formal.
    fx.write_rename(
        "rules.yaml",
        &RULES.replace("enabled: true", "enabled: false"),
    );
    soon("rules disabled", || async {
        gw.status().await["last_reload_error"].is_null()
            && tag(&gw, Req::get("/").from_ip("127.0.9.5")).await == "formal"
    })
    .await;
    assert_eq!(tag(&gw, Req::get("/api/v2/x")).await, "formal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_runs_after_rules_sees_the_verdict_and_may_override() {
    let bs = backends().await;
    let fx = Fixture::new();
    write_common(&fx, &bs);
    fx.write(
        "lane.lua",
        "return function(req)\n  if req:header('X-Override') then return 'v2' end\n  if req.rule_name then ngx.req.set_header('X-Rule', req.rule_name .. '=' .. req.rule_lane) end\n  return nil -- keep the rules' verdict\nend\n",
    );
    let inline = RULES
        .lines()
        .map(|l| format!("  {l}\n"))
        .collect::<String>();
    let gw = Config::new()
        .raw("lists:\n  testers: testers.txt\n")
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(&format!("rules:\n{inline}\n"))
        .start(&fx, "gg.yaml");

    // The rule decides; the script keeps it and sees its name and lane.
    assert_eq!(tag(&gw, Req::get("/").from_ip("127.0.9.5")).await, "gray");
    assert_eq!(
        bs[1].last().header("x-rule").as_deref(),
        Some("testers=gray")
    );
    // The script overrides a rule and the fallback alike.
    let r = Req::get("/").from_ip("127.0.9.5").header("X-Override", "1");
    assert_eq!(tag(&gw, r).await, "v2");
    assert_eq!(
        tag(&gw, Req::get("/").header("X-Override", "1")).await,
        "v2"
    );
    // No rule matched: the fallback, and the script saw no rule name.
    assert_eq!(tag(&gw, Req::get("/")).await, "formal");
    assert_eq!(bs[0].last().header("x-rule"), None);
    // Deny is final: the script is not consulted.
    let r = Req::get("/").from_ip("127.0.8.5").header("X-Override", "1");
    assert_eq!(tag(&gw, r).await, "formal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_pin_sticky_cookies_and_deny_beats_a_sticky_cookie() {
    let bs = backends().await;
    let fx = Fixture::new();
    write_common(&fx, &bs);
    fx.write("rules.yaml", RULES);
    let gw = Config::new()
        .raw("lists:\n  testers: testers.txt\n")
        .rules_file("rules.yaml")
        .node_files(&["nodes.yaml"])
        .raw("sticky:\n  key: test-sticky-key-0123456789\n")
        .routes(&[Route::service("/", "api").sticky()])
        .start(&fx, "gg.yaml");
    // A rule decides gray and the lane is pinned in a cookie.
    let r = Req::get("/").from_ip("127.0.9.5").send(gw.addr).await;
    assert_eq!(r.json()["tag"], "gray");
    let set = r
        .header("set-cookie")
        .expect("sticky cookie set for a rule decision");
    let cookie = set.split(';').next().unwrap().to_string();
    // The cookie keeps the lane where no rule would match…
    let r = Req::get("/").header("Cookie", &cookie).send(gw.addr).await;
    assert_eq!(r.json()["tag"], "gray");
    // …but a deny rule still wins, and pins nothing.
    let r = Req::get("/")
        .from_ip("127.0.8.5")
        .header("Cookie", &cookie)
        .send(gw.addr)
        .await;
    assert_eq!(r.json()["tag"], "formal");
    assert_eq!(r.header("set-cookie"), None);
}
