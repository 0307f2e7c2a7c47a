//! The README's run command on the shipped config shows both lanes, for API
//! and static, with nothing else started; and the Lua `req` API end to end.

use std::collections::BTreeSet;
use std::path::Path;

use crate::harness::*;

/// Ports on 127.0.0.1 that process `pid` listens on, read from /proc.
fn listening_ports(pid: u32) -> BTreeSet<u16> {
    let mut inodes = BTreeSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let Ok(e) = e else { continue };
        if let Ok(target) = std::fs::read_link(e.path()) {
            let t = target.to_string_lossy();
            if let Some(i) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                inodes.insert(i.to_string());
            }
        }
    }
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // sl local_address rem_address st … inode: state 0A = LISTEN.
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                return None;
            }
            let (ip, port) = f[1].split_once(':')?;
            (ip == "0100007F").then(|| u16::from_str_radix(port, 16).unwrap())
        })
        .collect()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// The shipped example's addresses: the README's tour uses these.
const SHIPPED: [(&str, &str); 5] = [
    ("listen", "127.0.0.1:8080"),
    ("admin_listen", "127.0.0.1:9080"),
    ("api-formal-1", "127.0.0.1:18081"),
    ("api-formal-2", "127.0.0.1:18082"),
    ("api-gray-1", "127.0.0.1:18091"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_config_shows_formal_and_gray() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let main = std::fs::read_to_string(repo.join("config/graygate.yaml")).unwrap();
    let nodes = std::fs::read_to_string(repo.join("config/nodes.yaml")).unwrap();
    // The shipped files say what the README says…
    assert!(main.contains("\nlisten: 127.0.0.1:8080\n"), "{main}");
    assert!(main.contains("\nadmin_listen: 127.0.0.1:9080 "), "{main}");
    for (name, addr) in &SHIPPED[2..] {
        let demo = format!("{{ name: {name}, addr: \"{addr}\", lane: ");
        assert!(main.contains(&demo), "demo node {name} at {addr}");
        let node = format!("{{ name: {name}, addr: \"{addr}\", lane: ");
        assert!(nodes.contains(&node), "node {name} at {addr}");
    }
    // …and run, unchanged but for the addresses, on ports of their own: a
    // copy with the listeners and demo nodes on port 0, and the node file
    // first pointing at reserved closed ports, then (once the demo nodes'
    // ports are known) at them.
    let fx = Fixture::new();
    for dir in ["config", "scripts", "static"] {
        copy_tree(&repo.join(dir), &fx.path(dir));
    }
    let mut copy = main.clone();
    for (_, addr) in SHIPPED {
        assert_eq!(copy.matches(addr).count(), 1, "{addr}");
        copy = copy.replace(addr, "127.0.0.1:0");
    }
    // The HTTPS listener of the README's tour, on a port of its own too.
    assert!(main.contains("  - listen: 127.0.0.1:8443\n"), "{main}");
    copy = copy.replace("  - listen: 127.0.0.1:8443\n", "  - listen: 127.0.0.1:0\n");
    fx.write("config/graygate.yaml", &copy);
    let mut first = nodes.clone();
    for (_, shipped) in &SHIPPED[2..] {
        first = first.replace(shipped, &closed_port().to_string());
    }
    fx.write("config/nodes.yaml", &first);
    let gw = Gateway::start(&fx.path("config/graygate.yaml"));
    // The HTTPS listener's port, as the gateway logs it.
    let https: std::net::SocketAddr = gw
        .logs()
        .lines()
        .find(|l| l.contains(" listening ") && l.contains("https"))
        .and_then(|l| l.split_whitespace().find_map(|t| t.strip_prefix("addr=")))
        .and_then(|a| a.parse().ok())
        .expect("the HTTPS listener is logged");
    // The demo nodes' ports, read back from the process; each names itself.
    let known: BTreeSet<u16> = [gw.addr.port(), gw.admin.unwrap().port(), https.port()].into();
    let mut demo = std::collections::BTreeMap::new();
    soon("three demo nodes listening", || {
        let ports: Vec<u16> = listening_ports(gw.pid())
            .difference(&known)
            .copied()
            .collect();
        async move { ports.len() == 3 }
    })
    .await;
    for port in listening_ports(gw.pid()).difference(&known) {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], *port));
        let name = Req::get("/").send(addr).await.node();
        demo.insert(name, addr.to_string());
    }
    let mut live = nodes.clone();
    for (name, shipped) in &SHIPPED[2..] {
        live = live.replace(shipped, &demo[*name]);
    }
    assert_ne!(live, nodes);
    fx.write_rename("config/nodes.yaml", &live);
    soon("node file reloaded", || async {
        gw.status().await["generation"] == 2
    })
    .await;

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
    assert_eq!(st["generation"], 2);
    assert!(st["last_reload_error"].is_null());

    // HTTPS + HTTP/2 on 8443 with the generated self-signed certificate,
    // exactly as the README's tour runs it.
    assert!(
        fx.path("config/certs/demo.crt").exists(),
        "generated at start"
    );
    let url = |path: &str| format!("https://localhost:{}{path}", https.port());
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
    let (body, version) = curl(&[&url("/api/hello")]);
    assert_eq!(version, "2", "HTTP/2 over TLS");
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (j["lane"].as_str(), j["tag"].as_str()),
        (Some("formal"), Some("formal"))
    );
    let (body, _) = curl(&["-H", "X-Gray: 1", &url("/api/hello")]);
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (j["lane"].as_str(), j["node"].as_str()),
        (Some("gray"), Some("api-gray-1"))
    );
    let (body, version) = curl(&["-H", "X-Gray: 1", &url("/")]);
    assert_eq!(version, "2");
    assert!(body.contains("Gray lane"), "static files over h2: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_request_api() {
    let [f, g] = backends([("f1", "formal"), ("g1", "gray")]).await;
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
    let gw = fx.start_scripted(&[&f, &g]);
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
