//! The README's run command on the shipped config shows both lanes, for API
//! and static, with nothing else started; and the Lua `req` API end to end.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_config_shows_formal_and_gray() {
    let gw = Gateway::start(std::path::Path::new("config/graygate.yaml"));
    assert_eq!(gw.addr.to_string(), "127.0.0.1:8080");
    let mut formal_nodes = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let r = gw.get("/api/hello").await;
        assert_eq!(r.json()["lane"], "formal");
        assert_eq!(r.json()["tag"], "formal");
        formal_nodes.insert(r.node());
    }
    assert_eq!(formal_nodes.len(), 2, "both formal nodes take turns");
    let r = Req::get("/api/hello")
        .header("X-Gray", "1")
        .send(gw.addr)
        .await;
    assert_eq!(r.json()["lane"], "gray");
    assert_eq!(r.json()["tag"], "gray");
    assert_eq!(r.node(), "api-gray-1");
    let r = Req::get("/api/hello")
        .from_ip("127.0.9.1")
        .send(gw.addr)
        .await;
    assert_eq!(r.json()["lane"], "gray");
    // About 10% of user ids are gray, always the same ones.
    let mut gray_users = 0;
    for uid in 0..200 {
        let uid = uid.to_string();
        let r = Req::get("/api/")
            .header("X-User-Id", &uid)
            .send(gw.addr)
            .await;
        let lane = r.json()["lane"].as_str().unwrap().to_string();
        let expect = if graygate::lane::bucket(uid.as_bytes()) < 10 {
            "gray"
        } else {
            "formal"
        };
        assert_eq!(lane, expect, "user {uid}");
        gray_users += usize::from(lane == "gray");
    }
    assert!((5..=40).contains(&gray_users), "{gray_users} of 200 gray");

    let formal_home = gw.get("/").await.text();
    let gray_home = Req::get("/")
        .header("X-Gray", "1")
        .send(gw.addr)
        .await
        .text();
    assert!(formal_home.contains("Formal lane"));
    assert!(gray_home.contains("Gray lane"));
    let css = Req::get("/app.css")
        .header("X-Gray", "1")
        .send(gw.addr)
        .await;
    assert_eq!(css.status, 200);
    assert!(css.header("etag").unwrap().starts_with("\"formal-"));
    let st = gw.status().await;
    assert_eq!(st["generation"], 1);
    assert!(st["last_reload_error"].is_null());

    // HTTPS + HTTP/2 on 8443 with the generated self-signed certificate,
    // exactly as the README's tour runs it.
    assert!(std::path::Path::new("config/certs/demo.crt").exists());
    let curl = |args: &[&str]| {
        let out = std::process::Command::new("curl")
            .args(["-sk", "--http2"])
            .args(args)
            .args(["-w", "\n%{http_version}"])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, version) = text.rsplit_once('\n').unwrap_or(("", ""));
        (body.to_string(), version.to_string())
    };
    let (body, version) = curl(&["https://localhost:8443/api/hello"]);
    assert_eq!(version, "2", "HTTP/2 over TLS");
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (j["lane"].as_str(), j["tag"].as_str()),
        (Some("formal"), Some("formal"))
    );
    let (body, _) = curl(&["-H", "X-Gray: 1", "https://localhost:8443/api/hello"]);
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (j["lane"].as_str(), j["node"].as_str()),
        (Some("gray"), Some("api-gray-1"))
    );
    let (body, version) = curl(&["-H", "X-Gray: 1", "https://localhost:8443/"]);
    assert_eq!(version, "2");
    assert!(body.contains("Gray lane"), "static files over h2: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_request_api() {
    let f = Backend::start("f1", "formal").await;
    let g = Backend::start("g1", "gray").await;
    let fx = Fixture::new();
    fx.write(
        "lane.lua",
        r#"return {
  lane = function(req)
    local ok = req.method == "POST"
      and req.host == "shop.example"
      and req.path == "/api/cart"
      and req.query == "a=1&who=J%20Doe"
      and req:arg("who") == "J Doe"
      and req:arg("nope") == nil
      and req:header("x-MiXeD") == "v"
      and req:header("absent") == nil
      and req:cookie("uid") == "42"
      and req:cookie("none") == nil
      and req.ip == "127.0.0.1"
      and graygate.bucket("hello") == 51
      and graygate.murmur3("hello") == 0x248bfa47
    if ok then return "gray" end
  end
}
"#,
    );
    fx.write(
        "nodes.yaml",
        &format!(
            "services:\n  api:\n    nodes:\n{}{}",
            f.node_yaml(),
            g.node_yaml()
        ),
    );
    let cfg = fx.write(
        "gg.yaml",
        &main_config(
            "script: lane.lua\nnode_files: [nodes.yaml]\nroutes: [{ prefix: /, service: api }]\n",
        ),
    );
    let gw = Gateway::start(&cfg);
    let req = Req::get("/api/cart?a=1&who=J%20Doe")
        .method("POST")
        .header("Host", "Shop.Example:8080")
        .header("X-Mixed", "v")
        .header("Cookie", "a=b; uid=42");
    assert_eq!(req.send(gw.addr).await.node(), "g1");
    let other = req.clone().header("Cookie", "x=y");
    let mut other = other;
    other
        .headers
        .retain(|(k, v)| !(k == "Cookie" && v.contains("uid")));
    assert_eq!(other.send(gw.addr).await.node(), "f1");
}
