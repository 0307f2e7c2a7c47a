//! The signed sticky-lane cookie through the real binary: a browser keeps
//! its lane across API calls, pages and assets when its IP changes; forged,
//! tampered, stale or unserved-lane cookies are ignored and re-decided.

use crate::harness::*;
use graygate::lane::sticky::{unix_now, Sticky};

const KEY: &str = "test-sticky-key-0123456789";

struct Setup {
    fx: Fixture,
    gw: Gateway,
    f1: Backend,
    g1: Backend,
}

async fn setup() -> Setup {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("ips.txt", "127.0.9.0/24\n");
    fx.write(
        "lane.lua",
        "return function(req)\n  if graygate.in_list('gray_ips', req.ip) then return 'gray' end\nend\n",
    );
    fx.api_nodes(&[&f1, &g1]);
    fx.write("site/formal/index.html", "formal page");
    fx.write("site/formal/app.js", "formal js");
    fx.write("site/gray/index.html", "gray page");
    let gw = Config::new()
        .script("lane.lua")
        .raw("lists:\n  gray_ips: ips.txt\n")
        .node_files(&["nodes.yaml"])
        .raw(&format!("sticky:\n  key: {KEY}\n  max_age_secs: 3600\n"))
        .routes(&[
            Route::service("/api/", "api").sticky(),
            Route::service("/plain/", "api"),
            Route::static_dir("/", "site").sticky(),
        ])
        .start(&fx, "gg.yaml");
    Setup { fx, gw, f1, g1 }
}

/// The `name=value` part of the response's sticky Set-Cookie, if any.
fn cookie_of(r: &Resp) -> Option<String> {
    r.headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("graygate_lane="))
        .map(|v| v.split(';').next().unwrap().to_string())
}

async fn with_cookie(gw: &Gateway, path: &str, cookie: &str) -> Resp {
    Req::get(path).header("Cookie", cookie).send(gw.addr).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_keeps_pages_assets_and_api_in_one_lane() {
    let s = setup().await;
    // Decided gray by source IP; the gateway hands out the cookie.
    let r = Req::get("/api/x")
        .from_ip("127.0.9.5")
        .send(s.gw.addr)
        .await;
    assert_eq!(r.node(), "g1");
    let cookie = cookie_of(&r).expect("sticky cookie set");
    assert!(cookie.starts_with("graygate_lane=gray."), "{cookie}");
    let raw = r.header("set-cookie").unwrap();
    assert!(
        raw.contains("HttpOnly") && raw.contains("Max-Age=3600"),
        "{raw}"
    );

    // Same browser, new IP (not in the gray list): still gray everywhere.
    let r = with_cookie(&s.gw, "/api/y", &format!("a=b; {cookie}")).await;
    assert_eq!(r.node(), "g1");
    assert_eq!(r.json()["tag"], "gray");
    assert!(cookie_of(&r).is_none(), "a valid cookie is not re-issued");
    let r = with_cookie(&s.gw, "/", &cookie).await;
    assert_eq!(r.text(), "gray page");
    let r = with_cookie(&s.gw, "/app.js", &cookie).await;
    assert_eq!(
        r.text(),
        "formal js",
        "per-file fallback within the gray lane"
    );
    assert!(r.header("etag").unwrap().starts_with("\"formal-"));
    // Without the cookie this IP is formal.
    let r = s.gw.get("/").await;
    assert_eq!(r.text(), "formal page");
    let formal_cookie = cookie_of(&r).expect("formal is sticky too");
    assert!(formal_cookie.starts_with("graygate_lane=formal."));
    // A non-sticky route ignores the cookie and sets none.
    let r = with_cookie(&s.gw, "/plain/z", &cookie).await;
    assert_eq!(r.node(), "f1");
    assert!(cookie_of(&r).is_none());
    assert!(s.g1.count() == 2 && s.f1.count() == 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_tampered_stale_and_unserved_cookies_are_ignored() {
    let s = setup().await;
    let r = s.gw.get("/api/x").await;
    let formal = cookie_of(&r).unwrap();
    let value = formal.strip_prefix("graygate_lane=").unwrap();
    let now = unix_now();
    let right_key = Sticky::new("graygate_lane", KEY.as_bytes(), 3600, false);
    let wrong_key = Sticky::new("graygate_lane", b"some-other-key-0123456", 3600, false);
    let tampered = value.replacen("formal", "gray", 1);
    let stale = right_key.sign("gray", &[], now - 7200);
    let unserved = right_key.sign("v9", &[], now);
    let forged = wrong_key.sign("gray", &[], now);
    for bad in [
        tampered.as_str(),
        stale.as_str(),
        unserved.as_str(),
        forged.as_str(),
        "gray",
        "gray.99999999999.00",
    ] {
        let r = with_cookie(&s.gw, "/api/x", &format!("graygate_lane={bad}")).await;
        assert_eq!(r.node(), "f1", "{bad}");
        let fresh = cookie_of(&r).unwrap_or_else(|| panic!("re-decided and re-issued: {bad}"));
        assert!(fresh.starts_with("graygate_lane=formal."), "{fresh}");
    }
    assert_eq!(s.g1.count(), 0);
    // A correctly signed gray cookie is honoured.
    let good = right_key.sign("gray", &[], now);
    let r = with_cookie(&s.gw, "/api/x", &format!("graygate_lane={good}")).await;
    assert_eq!(r.node(), "g1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_lives_while_a_node_or_static_tree_serves_its_lane() {
    let s = setup().await;
    let r = Req::get("/").from_ip("127.0.9.7").send(s.gw.addr).await;
    assert_eq!(r.text(), "gray page");
    let cookie = cookie_of(&r).unwrap();
    // The gray node goes away; the gray static tree still serves the lane,
    // so the cookie still holds: pages gray, API calls formal with the gray tag.
    s.fx.write_rename("nodes.yaml", &Nodes::api([s.f1.node()]).to_yaml());
    s.gw.wait_generation(1).await;
    assert_eq!(with_cookie(&s.gw, "/", &cookie).await.text(), "gray page");
    let r = with_cookie(&s.gw, "/api/x", &cookie).await;
    assert_eq!(r.node(), "f1");
    assert_eq!(r.json()["tag"], "gray");
    // Now nothing serves gray: the cookie is ignored and the lane re-decided.
    std::fs::remove_dir_all(s.fx.path("site/gray")).unwrap();
    let again = Nodes::api([s.f1.node()]).comment("again");
    s.fx.write_rename("nodes.yaml", &again.to_yaml());
    s.gw.wait_generation(2).await;
    let r = with_cookie(&s.gw, "/api/x", &cookie).await;
    assert_eq!(r.json()["tag"], "formal");
    assert!(cookie_of(&r).unwrap().starts_with("graygate_lane=formal."));
}

#[test]
fn sticky_route_without_a_key_is_rejected_with_file_and_line() {
    let fx = Fixture::new();
    fx.write("site/formal/index.html", "x");
    let cfg = fx.write(
        "gg.yaml",
        &main_config("sticky:\n  key_env: GRAYGATE_TEST_UNSET_KEY_VAR\nroutes:\n  - prefix: /\n    static: site\n    sticky: true\n"),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .env_remove("GRAYGATE_TEST_UNSET_KEY_VAR")
        .arg("--check")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gg.yaml:4:") && err.contains("GRAYGATE_TEST_UNSET_KEY_VAR"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_tag_beats_the_cookie_and_a_script_failure_sets_none() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("ips.txt", "127.0.9.0/24\n");
    fx.write(
        "lane.lua",
        "return function(req)\n  if req:header('X-Boom') then error('boom') end\n  if req:in_list('gray_ips') then return 'gray' end\nend\n",
    );
    fx.api_nodes(&[&f1, &g1]);
    // 127.0.0.1 is a trusted proxy; 127.0.9.x clients are not.
    let gw = Config::new()
        .script("lane.lua")
        .raw("lists:\n  gray_ips: ips.txt\ntrusted_proxies: [127.0.0.1/32]\n")
        .node_files(&["nodes.yaml"])
        .raw(&format!("sticky:\n  key: {KEY}\n"))
        .routes(&[Route::service("/", "api").sticky()])
        .start(&fx, "gg.yaml");
    let gray = cookie_of(&Req::get("/a").from_ip("127.0.9.5").send(gw.addr).await).unwrap();
    assert!(gray.starts_with("graygate_lane=gray."), "{gray}");
    let formal = cookie_of(&gw.get("/a").await).unwrap();
    assert!(formal.starts_with("graygate_lane=formal."), "{formal}");
    // The cookies hold on their own (from the trusted peer, without a tag)…
    assert_eq!(with_cookie(&gw, "/b", &gray).await.node(), "g1");
    assert_eq!(with_cookie(&gw, "/b", &formal).await.node(), "f1");
    // …but the trusted proxy's tag wins over either.
    for (cookie, tag, node) in [(&gray, "formal", "f1"), (&formal, "gray", "g1")] {
        let r = Req::get("/c")
            .header("Cookie", cookie)
            .header("X-Gray-Tag", tag)
            .send(gw.addr)
            .await;
        assert_eq!(r.node(), node, "cookie {cookie}, tag {tag}");
        assert_eq!(r.json()["tag"], tag);
    }

    // A script failure goes formal and pins nothing; the same request
    // without the failure gets a cookie.
    for _ in 0..2 {
        let r = Req::get("/d")
            .from_ip("127.0.9.6")
            .header("X-Boom", "1")
            .send(gw.addr)
            .await;
        assert_eq!(r.node(), "f1");
        assert_eq!(cookie_of(&r), None, "no cookie after a script failure");
        assert!(r.header("set-cookie").is_none());
    }
    let r = Req::get("/d").from_ip("127.0.9.6").send(gw.addr).await;
    assert_eq!(r.node(), "g1");
    assert!(cookie_of(&r).unwrap().starts_with("graygate_lane=gray."));
}
