//! Cross-check against real OpenResty semantics: the same module scripts
//! run in nginx + lua-nginx-module (LuaJIT) and in graygate, and the same
//! requests must give the same lane and the same value for every probed
//! `ngx.*` / `bit` expression. (nginx comes from `tools/test`'s packages.)

use std::path::Path;

use crate::harness::nginx::Nginx;
use crate::harness::*;

fn start_nginx(dir: &Path, lua_dir: &Path) -> Nginx {
    let main = "load_module /usr/lib/nginx/modules/ndk_http_module.so;\n\
                load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;";
    let http = format!(
        r#"
    lua_package_path "{lua}/?.lua;;";
    lua_shared_dict probe 1m;
    server {{
        listen 127.0.0.1:{{port}};
        location / {{
            content_by_lua_block {{
                local probe = require("probe").probe()
                local lane = require("openresty_gray").lane() or "formal"
                ngx.say(lane)
                ngx.say(table.concat(probe, "|"))
            }}
        }}
    }}
"#,
        lua = lua_dir.display(),
    );
    Nginx::start(dir, main, &http)
}

fn requests() -> Vec<Req> {
    let mut v = vec![
        Req::get("/"),
        Req::get("/x").from_ip("127.0.9.3"),
        Req::get("/x").header("X-Gray", "1"),
        Req::get("/api/v2/items?x=1"),
        Req::get("/a//b/../c%20d/?name=J%20o%2B&k=1&k=2&flag&sp=a+b&uid=1001"),
        Req::get("/?NAME=upper&Uid=42").header("Host", "Shop.Example.COM:8080"),
        Req::get("/?lane=canary"),
        Req::get("/?lane=canary").method("POST"),
        Req::get("/")
            .header("Accept", "a/b")
            .header("accept", "c/d")
            .header("X-User-Id", "298"),
        Req::get("/").header("Cookie", "UID=alice; sid=zz"),
        Req::get("/q")
            .header("X-Probe-Clear", "gone")
            .header("X-Probe-Nil", "gone too"),
        Req::get("/q?only").header("X-Probe-Set", "client"),
        // A bare `?`: no arguments (args nil, is_args "").
        Req::get("/p?"),
        Req::get("/p?&"),
        // Cookies with white space around `=` and `;`, kept raw by nginx.
        Req::get("/").header("Cookie", "uid = 7 ;sid= s1 ; x=1"),
        Req::get("/").header("Cookie", "  uid=  alice  ;  sid =zz"),
        Req::get("/").header("Cookie", "uid=a=b; sid=\"q\""),
        // Repeated and flag arguments, encoded paths and arguments.
        Req::get("/%7Euser/a%2Fb?uid=1&uid=2&flag&name=%41%20b&=x&k="),
        Req::get("/p?uid&uid=3&UID=4"),
        // Header names with underscores: nginx drops them (its default
        // `underscores_in_headers off`), so `http_x_user_id` does not see
        // an `X_User_Id` header, alone or beside the real one.
        Req::get("/").header("X_User_Id", "1001"),
        Req::get("/")
            .header("X_User_Id", "1001")
            .header("X-User-Id", "298"),
        // Repeated cookie headers, an encoded cookie value, a repeated
        // header that is read as an array by get_headers().
        Req::get("/")
            .header("Cookie", "x=1")
            .header("Cookie", "uid=%61lice; sid=s2"),
        Req::get("/p?a=%2F%3F%26&b=+&c=%zz&uid=%31%30%30%31"),
    ];
    for i in 0..30 {
        v.push(Req::get("/").header("X-User-Id", &format!("u{i}")));
        v.push(Req::get(&format!("/p?uid={i}")));
        v.push(Req::get("/").header("Cookie", &format!("x=1; sid=session-{i}")));
    }
    v
}

// Both of graygate's VM modes: LuaJIT's interpreter (the default) and its
// compiler (`script_limits.jit: true`) give nginx's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_lanes_and_values_as_nginx_lua_interpreter() {
    same_lanes_and_values_as_nginx_lua(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_lanes_and_values_as_nginx_lua_jit() {
    same_lanes_and_values_as_nginx_lua(true).await
}

async fn same_lanes_and_values_as_nginx_lua(jit: bool) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fx = Fixture::new();
    // The shipped module and the probe, side by side for both gateways.
    let policy = std::fs::read_to_string(repo.join("scripts/openresty_gray.lua")).unwrap();
    let probe = std::fs::read_to_string(repo.join("tests/it/scripting/probe.lua")).unwrap();
    fx.write("lua/openresty_gray.lua", &policy);
    fx.write("lua/probe.lua", &probe);
    fx.write(
        "lua/main.lua",
        "local probe = require('probe')\nlocal policy = require('openresty_gray')\nreturn { lane = function()\n  ngx.req.set_header('X-Probe', table.concat(probe.probe(), '|'))\n  return policy.lane()\nend }\n",
    );
    let backend = Backend::start("b", "formal").await;
    fx.api_nodes(&[&backend]);
    let gw = Config::new()
        .script("lua/main.lua")
        .raw(&format!(
            "script_limits:\n  jit: {jit}\nshared_dicts:\n  probe: 1m\n"
        ))
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    std::fs::create_dir_all(fx.path("nginx")).unwrap();
    let nginx = start_nginx(&fx.path("nginx"), &fx.path("lua"));
    let nginx_addr = nginx.addr();

    let mut lanes = std::collections::BTreeSet::new();
    let mut mismatches = Vec::new();
    for req in requests() {
        let want = req.send(nginx_addr).await;
        assert_eq!(
            want.status,
            200,
            "nginx: {}\n{}",
            want.text(),
            std::fs::read_to_string(nginx.dir.join("error.log")).unwrap_or_default()
        );
        let text = want.text();
        let mut lines = text.lines();
        let want_lane = lines.next().unwrap().to_string();
        let want_probe = lines.next().unwrap().to_string();

        let got = req.send(gw.addr).await;
        assert_eq!(got.status, 200, "{}", got.text());
        let got_lane = got.json()["tag"].as_str().unwrap().to_string();
        let got_probe = backend.last().header("x-probe").unwrap();

        // Compare value by value (the port in Host differs, nothing else).
        let w: Vec<&str> = want_probe.split('|').collect();
        let g: Vec<&str> = got_probe.split('|').collect();
        assert_eq!(w.len(), g.len());
        let repeated_accept = req
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("accept"))
            .count()
            > 1;
        for (w, g) in w.iter().zip(&g) {
            if repeated_accept && w.starts_with("http_accept=") {
                // nginx < 1.23 gives the first of repeated headers; graygate
                // joins them with ", " as nginx >= 1.23 (OpenResty >= 1.25)
                // does — see the README. Checked against the joined form.
                assert_eq!(*g, "http_accept=a/b, c/d");
                continue;
            }
            if g != w {
                mismatches.push(format!(
                    "{} {}: nginx {w:?}, graygate {g:?}",
                    req.method, req.path
                ));
            }
        }
        if got_lane != want_lane {
            mismatches.push(format!(
                "{} {} {:?}: lane nginx {want_lane:?}, graygate {got_lane:?}",
                req.method, req.path, req.headers
            ));
        }
        lanes.insert(want_lane);
    }
    assert!(
        mismatches.is_empty(),
        "values differ:\n{}",
        mismatches.join("\n")
    );

    // ngx.log: each level lands in both logs at the same file:line, at
    // nginx's level in nginx and at the README's level in graygate (the
    // level is the token after graygate's timestamp).
    let nginx_log = std::fs::read_to_string(nginx.dir.join("error.log")).unwrap();
    for (name, nginx_level, graygate_level) in [
        ("STDERR", "[]", "ERROR"), // nginx prints no name for STDERR
        ("EMERG", "[emerg]", "ERROR"),
        ("ALERT", "[alert]", "ERROR"),
        ("CRIT", "[crit]", "ERROR"),
        ("ERR", "[error]", "ERROR"),
        ("WARN", "[warn]", "WARN"),
        ("NOTICE", "[notice]", "INFO"),
        ("INFO", "[info]", "INFO"),
    ] {
        let msg = format!("probe level {name}");
        let line = nginx_log
            .lines()
            .find(|l| l.contains(&format!("{msg},")))
            .unwrap_or_else(|| panic!("nginx logged no {msg:?}:\n{nginx_log}"));
        assert!(line.contains(nginx_level), "{line}");
        let at = line
            .split_whitespace()
            .find(|w| w.starts_with("probe.lua:"))
            .unwrap_or_else(|| panic!("no file:line in {line}"))
            .trim_end_matches(':')
            .to_string();
        gw.wait_log_line(&format!("{msg} at {at} ({graygate_level})"), |l| {
            l.split_whitespace().nth(1) == Some(graygate_level)
                && l.contains(&at)
                && l.contains(&format!("{msg} "))
        })
        .await;
    }
    let multi = nginx_log
        .lines()
        .find(|l| l.contains("probe log 42 nil true"))
        .expect("nginx logged the multi-argument line");
    assert!(multi.contains("[error]"), "{multi}");
    gw.wait_log_line("probe log 42 nil true (ERROR)", |l| {
        l.split_whitespace().nth(1) == Some("ERROR") && l.contains("probe log 42 nil true")
    })
    .await;
    // Numbers in a log line print as LuaJIT's tostring does, in both.
    let num = "probe num 0.33333333333333 5 2147483648 0";
    assert!(
        nginx_log.lines().any(|l| l.contains(&format!("{num},"))),
        "nginx logged no {num:?}:\n{nginx_log}"
    );
    gw.wait_log_line(num, |l| l.contains(&format!("{num} ")) || l.ends_with(num))
        .await;
    for l in ["formal", "gray", "gray-a", "gray-b", "v2"] {
        assert!(lanes.contains(l), "{l} never decided: {lanes:?}");
    }
}
