//! The OpenResty-compatible script API, shared dicts, sandbox and limits,
//! through the real binary with real backends.

mod jit_mdwe;
mod openresty;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::*;

/// Starts one backend per lane (each answers with its lane in JSON).
async fn lane_backends(lanes: &[&str]) -> Vec<Backend> {
    let mut v = Vec::new();
    for l in lanes {
        v.push(Backend::start(&format!("n-{l}"), l).await);
    }
    v
}

fn nodes_yaml(backends: &[Backend]) -> String {
    Nodes::api(nodes_of(backends)).to_yaml()
}

/// Writes the fixture and starts the gateway with `script` and `extra` config.
fn start(fx: &Fixture, backends: &[Backend], script: &str, extra: &str) -> Gateway {
    start_in(false, fx, backends, script, extra)
}

/// As [`start`], with `script_limits.jit: true` when `jit`, `false`
/// otherwise (the default, `auto`, would turn the compiler on here).
fn start_in(jit: bool, fx: &Fixture, backends: &[Backend], script: &str, extra: &str) -> Gateway {
    let line = format!("script_limits:\n  jit: {jit}\n");
    let extra = if extra.contains("script_limits:\n") {
        extra.replace("script_limits:\n", &line)
    } else {
        format!("{extra}{line}")
    };
    fx.write("scripts/main.lua", script);
    fx.write("nodes.yaml", &nodes_yaml(backends));
    let cfg = Config::new()
        .script("scripts/main.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw(&extra)
        .write(fx, "gg.yaml");
    Gateway::start(&cfg)
}

/// Runs each sandbox test twice: on LuaJIT's interpreter
/// (`script_limits.jit: false`) and with `script_limits.jit: true`; every
/// guarantee must hold in both.
macro_rules! in_both_vm_modes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn interpreter() {
                super::$name(false).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn jit() {
                super::$name(true).await
            }
        }
    )*};
}

in_both_vm_modes!(
    openresty_module_script_gives_openresty_lanes_end_to_end,
    hot_loop_and_memory_bomb_go_formal_worker_survives_logged,
    sandbox_breaches_are_rejected_or_go_formal,
    top_level_gets_a_hundred_budgets_and_no_more,
    sandbox_environment_isolation_and_unsupported_calls,
    require_resolves_only_modules_found_at_load,
);

// ------------------------------------------------------------------ reference

/// CRC-32 (IEEE, reflected, poly 0xEDB88320), bit by bit — written here
/// independently of the gateway's implementation.
fn crc32_ref(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xedb8_8320 & mask);
        }
    }
    !crc
}

/// What OpenResty decides for `scripts/openresty_gray.lua`, computed from
/// the policy's description.
fn expected_lane(
    ip: &str,
    method: &str,
    path: &str,
    query: &BTreeMap<&str, &str>,
    headers: &[(&str, &str)],
) -> &'static str {
    let header = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| *v)
    };
    let cookie = |n: &str| {
        header("cookie").and_then(|c| {
            c.split(';')
                .filter_map(|kv| kv.trim().split_once('='))
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v)
        })
    };
    if ip.starts_with("127.0.9.") {
        return "gray";
    }
    if header("x-gray") == Some("1") {
        return "gray";
    }
    if path.starts_with("/api/v2/") {
        return "v2";
    }
    let uid = cookie("uid")
        .or(header("x-user-id"))
        .or(query.get("uid").copied());
    if let Some(u) = uid {
        if ["1001", "1002", "alice"].contains(&u) {
            return "gray";
        }
        if let Ok(n) = u.parse::<i64>() {
            if n & 0xff == 0x2a {
                return "gray-b";
            }
        }
        if crc32_ref(u.as_bytes()) % 100 < 20 {
            return "gray";
        }
    }
    if let Some(sid) = cookie("sid") {
        let digest = md5_reference::compute(sid.as_bytes());
        if digest[0] < 0x20 {
            return "gray-a";
        }
    }
    if query.get("lane") == Some(&"canary") && method == "GET" {
        return "gray";
    }
    "formal"
}

#[test]
fn reference_implementations_match_known_vectors() {
    assert_eq!(
        crc32_ref(b"The quick brown fox jumps over the lazy dog"),
        0x414f_a339
    );
    assert_eq!(crc32_ref(b"123456789"), 0xcbf4_3926);
    assert_eq!(
        format!("{:x}", md5_reference::compute(b"")),
        "d41d8cd98f00b204e9800998ecf8427e"
    );
}

async fn openresty_module_script_gives_openresty_lanes_end_to_end(jit: bool) {
    let backends = lane_backends(&["formal", "gray", "gray-a", "gray-b", "v2"]).await;
    let fx = Fixture::new();
    let script = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/openresty_gray.lua"),
    )
    .unwrap();
    let gw = start_in(jit, &fx, &backends, &script, "");

    struct Case {
        ip: &'static str,
        method: &'static str,
        path: String,
        query: BTreeMap<&'static str, &'static str>,
        headers: Vec<(&'static str, String)>,
    }
    let mut cases = Vec::new();
    let plain = |path: &str| Case {
        ip: "127.0.0.1",
        method: "GET",
        path: path.to_string(),
        query: BTreeMap::new(),
        headers: Vec::new(),
    };
    cases.push(plain("/"));
    cases.push(Case {
        ip: "127.0.9.3",
        ..plain("/x")
    });
    cases.push(Case {
        headers: vec![("X-Gray", "1".into())],
        ..plain("/x")
    });
    cases.push(plain("/api/v2/items"));
    cases.push(plain("/api/v3/items"));
    for uid in ["1001", "alice", "298", "42", "bob"] {
        cases.push(Case {
            headers: vec![("X-User-Id", uid.to_string())],
            ..plain("/")
        });
    }
    let mut q = BTreeMap::new();
    q.insert("lane", "canary");
    cases.push(Case {
        query: q.clone(),
        ..plain("/")
    });
    cases.push(Case {
        method: "POST",
        query: q,
        ..plain("/")
    });
    // Many uids (via cookie, header and query) and session ids: the crc32
    // 20% bucket and the md5 1/8 split both show up.
    for i in 0..40 {
        let uid: &'static str = Box::leak(format!("u{i}").into_boxed_str());
        let case = match i % 3 {
            0 => Case {
                headers: vec![("Cookie", format!("uid={uid}"))],
                ..plain("/")
            },
            1 => Case {
                headers: vec![("X-User-Id", uid.to_string())],
                ..plain("/")
            },
            _ => {
                let mut q = BTreeMap::new();
                q.insert("uid", uid);
                Case {
                    query: q,
                    ..plain("/")
                }
            }
        };
        cases.push(case);
        cases.push(Case {
            headers: vec![("Cookie", format!("a=b; sid=s{i}"))],
            ..plain("/")
        });
    }

    let mut seen = BTreeMap::new();
    for c in &cases {
        let qs: Vec<String> = c.query.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let uri = if qs.is_empty() {
            c.path.clone()
        } else {
            format!("{}?{}", c.path, qs.join("&"))
        };
        let mut req = Req::get(&uri).method(c.method).from_ip(c.ip);
        for (k, v) in &c.headers {
            req = req.header(k, v);
        }
        let r = req.send(gw.addr).await;
        assert_eq!(r.status, 200, "{uri}: {}", r.text());
        let hdrs: Vec<(&str, &str)> = c.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let want = expected_lane(c.ip, c.method, &c.path, &c.query, &hdrs);
        assert_eq!(
            r.json()["tag"],
            want,
            "{} {uri} from {} with {:?}",
            c.method,
            c.ip,
            c.headers
        );
        assert_eq!(r.json()["lane"], want);
        *seen.entry(want).or_insert(0) += 1;
    }
    // Every branch of the policy was exercised.
    for lane in ["formal", "gray", "gray-a", "gray-b", "v2"] {
        assert!(seen.contains_key(lane), "{lane} never decided: {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_header_reaches_upstream_and_ngx_log_is_located() {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    let gw = start(
        &fx,
        &backends,
        "return function()\n  local uid = ngx.var.http_x_user_id\n  ngx.log(ngx.WARN, 'deciding uid=', uid)\n  print('printed ', uid, ' ', true)\n  ngx.req.set_header('X-Gray-Reason', 'uid-' .. tostring(uid))\n  if ngx.var.arg_evil then ngx.req.set_header('X-Evil', 'a\\r\\nInjected: 1') end\n  return 'gray'\nend\n",
        "",
    );
    let r = Req::get("/x").header("X-User-Id", "77").send(gw.addr).await;
    assert_eq!(r.json()["tag"], "gray");
    let seen = backends[1].last();
    assert_eq!(seen.header("x-gray-reason").as_deref(), Some("uid-77"));
    eventually("ngx.log line", Duration::from_secs(5), || async {
        gw.logs().lines().any(|l| {
            l.contains("WARN") && l.contains("deciding uid=77") && l.contains("main.lua:3")
        })
    })
    .await;
    // `print` is ngx.log at NOTICE, as in OpenResty (not stdout).
    eventually("print line", Duration::from_secs(5), || async {
        gw.logs().lines().any(|l| {
            l.contains("INFO") && l.contains("printed 77 true") && l.contains("main.lua:4")
        })
    })
    .await;

    // CR/LF cannot split a header: percent-encoded, as lua-nginx-module
    // does; no injected field reaches the node.
    let r = Req::get("/x?evil=1")
        .header("X-User-Id", "78")
        .send(gw.addr)
        .await;
    assert_eq!(r.json()["tag"], "gray");
    let seen = backends[1].last();
    assert_eq!(seen.header("x-evil").as_deref(), Some("a%0D%0AInjected: 1"));
    assert_eq!(seen.header("injected"), None);

    // A script that fails after setting headers leaves the request as it
    // came: formal, nothing it set travels upstream.
    let fx2 = Fixture::new();
    let gw2 = start(
        &fx2,
        &backends,
        "return function()
  ngx.req.set_header('X-Half', 'set')
  ngx.var.args = 'rewritten=1'
  error('boom')
end
",
        "",
    );
    let r = Req::get("/y?orig=1").send(gw2.addr).await;
    assert_eq!(r.json()["tag"], "formal");
    let seen = backends[0].last();
    assert_eq!(seen.header("x-half"), None);
    assert_eq!(
        seen.query.as_deref(),
        Some("orig=1"),
        "the request target is restored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_dict_is_shared_across_workers_and_survives_reload() {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    // `vm` names the worker thread's VM (a table address of its own).
    let script = "local vm = tostring({})\nreturn function()\n  local n = ngx.shared.hits:incr('n', 1, 0)\n  ngx.req.set_header('X-Hits', n)\n  ngx.req.set_header('X-VM', vm)\n  return (n % 2 == 0) and 'gray' or nil\nend\n";
    let gw = start(
        &fx,
        &backends,
        script,
        "workers: 2\nshared_dicts:\n  hits: 1m\n",
    );
    let seen = || -> Vec<(u64, String, bool)> {
        backends
            .iter()
            .flat_map(|b| {
                let gray = b.lane == "gray";
                b.seen.lock().unwrap().clone().into_iter().map(move |s| {
                    (
                        s.header("x-hits").unwrap().parse().unwrap(),
                        s.header("x-vm").unwrap(),
                        gray,
                    )
                })
            })
            .collect()
    };
    // Concurrent requests, each on its own connection, until both worker
    // threads' VMs have served some (the kernel spreads connections over
    // the two SO_REUSEPORT listeners).
    eventually("both workers served", Duration::from_secs(30), || async {
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let addr = gw.addr;
            tasks.push(tokio::spawn(async move { Req::get("/").send(addr).await }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().status, 200);
        }
        let vms: std::collections::BTreeSet<String> = seen().into_iter().map(|s| s.1).collect();
        vms.len() >= 2
    })
    .await;
    let all = seen();
    let vms: std::collections::BTreeSet<&str> = all.iter().map(|s| s.1.as_str()).collect();
    assert_eq!(vms.len(), 2, "two workers, two VMs: {vms:?}");
    // One counter: every request got its own number, 1..=n, whichever VM
    // ran it.
    let mut hits: Vec<u64> = all.iter().map(|s| s.0).collect();
    hits.sort_unstable();
    let n = hits.len() as u64;
    assert_eq!(hits, (1..=n).collect::<Vec<u64>>());
    // Even counts went gray, odd ones formal.
    for (h, vm, gray) in &all {
        assert_eq!(*gray, h % 2 == 0, "hit {h} on {vm}");
    }
    assert_eq!(backends[1].count() as u64, n / 2);
    assert_eq!(backends[0].count() as u64, n - n / 2);

    // A reload (new script text, new generation) keeps the dict's contents.
    let g0 = gw.status().await["generation"].as_u64().unwrap();
    fx.write_rename("scripts/main.lua", &format!("-- v2\n{script}"));
    soon("reload applied", || async {
        gw.status().await["generation"].as_u64().unwrap() > g0
    })
    .await;
    Req::get("/").send(gw.addr).await;
    let last = backends
        .iter()
        .flat_map(|b| b.seen.lock().unwrap().clone())
        .filter_map(|s| s.header("x-hits"))
        .map(|h| h.parse::<u64>().unwrap())
        .max()
        .unwrap();
    assert_eq!(last, n + 1);
}

async fn hot_loop_and_memory_bomb_go_formal_worker_survives_logged(jit: bool) {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    let gw = start_in(jit,
        &fx,
        &backends,
        "return function()\n  if ngx.var.http_x_loop then\n    while true do end\n  end\n  if ngx.var.http_x_bomb then\n    local t = {}\n    while true do t[#t + 1] = string.rep('x', 65536) .. #t end\n  end\n  return 'gray'\nend\n",
        "script_limits:\n  instruction_budget: 200000\n  memory_limit: 8m\n",
    );
    // Several runaway requests at once: each stopped, each formal.
    let mut tasks = Vec::new();
    for i in 0..6 {
        let addr = gw.addr;
        let h = if i % 2 == 0 { "X-Loop" } else { "X-Bomb" };
        tasks.push(tokio::spawn(async move {
            Req::get("/").header(h, "1").send(addr).await
        }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["tag"], "formal");
    }
    // The workers live on and the script keeps deciding.
    for _ in 0..4 {
        assert_eq!(gw.get("/").await.json()["tag"], "gray");
    }
    eventually(
        "limit events logged with file:line",
        Duration::from_secs(5),
        || async {
            let logs = gw.logs();
            let budget = logs.lines().any(|l| {
                l.contains("sandbox limit") && l.contains("main.lua:3: instruction budget exceeded")
            });
            let memory = logs.lines().any(|l| {
                l.contains("sandbox limit")
                    && l.contains("memory limit exceeded")
                    && l.contains("main.lua:7")
            });
            budget && memory
        },
    )
    .await;
    assert!(!gw.logs().contains("panicked"), "{}", gw.logs());
}

async fn sandbox_breaches_are_rejected_or_go_formal(jit: bool) {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    let good = "return function() return 'gray' end\n";
    let gw = start_in(jit, &fx, &backends, good, "");
    assert_eq!(gw.get("/").await.json()["tag"], "gray");

    // Reloads the gateway would reject: each names the file and line.
    let lua = mlua::Lua::new();
    let bytecode = lua
        .load("return function() return 'v2' end")
        .into_function()
        .unwrap()
        .dump(true);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "io",
            b"local f = io.open('/etc/passwd')\nreturn function() return 'v2' end\n".to_vec(),
            "main.lua:1:",
        ),
        (
            "os.execute",
            b"os.execute('true')\nreturn function() return 'v2' end\n".to_vec(),
            "main.lua:1:",
        ),
        (
            "require outside",
            b"local x = require('..secret')\nreturn function() return 'v2' end\n".to_vec(),
            "main.lua:1:",
        ),
        (
            "require absolute",
            b"local x = require('/etc/passwd')\nreturn function() return 'v2' end\n".to_vec(),
            "main.lua:1:",
        ),
        ("bytecode", bytecode, "main.lua:1:"),
    ];
    for (what, text, located) in cases {
        std::fs::write(fx.path("scripts/main.lua.tmp"), &text).unwrap();
        std::fs::rename(fx.path("scripts/main.lua.tmp"), fx.path("scripts/main.lua")).unwrap();
        soon(&format!("{what} rejected"), || async {
            let st = gw.status().await;
            st["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.contains(located))
        })
        .await;
        // The old script keeps serving.
        assert_eq!(gw.get("/").await.json()["tag"], "gray", "{what}");
        // Reset to the good script so the next case is a fresh rejection.
        fx.write_rename("scripts/main.lua", good);
        soon("good script back", || async {
            gw.status().await["last_reload_error"].is_null()
        })
        .await;
    }

    // At request time: os.execute does not exist, so the call fails and the
    // request goes formal; nothing ran.
    let marker = fx.path("pwned");
    fx.write_rename(
        "scripts/main.lua",
        &format!(
            "return function()\n  if ngx.var.http_x_try then os.execute('touch {}') end\n  return 'gray'\nend\n",
            marker.display()
        ),
    );
    soon("breach script loaded", || async {
        let r = Req::get("/").header("X-Try", "1").send(gw.addr).await;
        r.json()["tag"] == "formal" && gw.get("/").await.json()["tag"] == "gray"
    })
    .await;
    assert!(!marker.exists());
}

async fn top_level_gets_a_hundred_budgets_and_no_more(jit: bool) {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    // Each loop iteration charges 10 (one budget check): 50k iterations
    // are ~50 budgets of 10,000, 500k iterations ~500.
    let script = |n: u64| {
        format!(
            "local function work(n)\n  local x = 0\n  for i = 1, n do x = x + i end\n  return x\nend\nlocal total = work({n})\nreturn function()\n  if ngx.var.http_x_work then work(50000) end\n  return total > 0 and 'gray' or nil\nend\n"
        )
    };
    let gw = start_in(
        jit,
        &fx,
        &backends,
        &script(50_000),
        "script_limits:\n  instruction_budget: 10000\n",
    );
    // ~50 budgets at the top level: loaded, and serving.
    assert_eq!(gw.get("/").await.json()["tag"], "gray");
    // The same work inside one lane call exceeds that call's single budget.
    let r = Req::get("/").header("X-Work", "1").send(gw.addr).await;
    assert_eq!(r.json()["tag"], "formal");
    eventually("budget stop logged", Duration::from_secs(5), || async {
        gw.logs().lines().any(|l| {
            l.contains("sandbox limit") && l.contains("main.lua:3: instruction budget exceeded")
        })
    })
    .await;
    // ~500 budgets at the top level: the load is rejected with file:line,
    // and the loaded script keeps serving.
    fx.write_rename("scripts/main.lua", &script(500_000));
    eventually("rejected", Duration::from_secs(30), || async {
        gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("main.lua:3:") && e.contains("instruction budget exceeded"))
    })
    .await;
    assert_eq!(gw.get("/").await.json()["tag"], "gray");
}

async fn sandbox_environment_isolation_and_unsupported_calls(jit: bool) {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    let script = r#"
local function present()
  local p = {}
  for _, name in ipairs({'io', 'debug', 'package', 'load', 'loadfile', 'dofile',
                         'loadstring', 'collectgarbage', 'gcinfo', 'ffi', 'jit',
                         'getfenv', 'setfenv', 'newproxy', 'module'}) do
    if _G[name] ~= nil then p[#p + 1] = name end
  end
  if string.dump ~= nil then p[#p + 1] = 'string.dump' end
  -- os is a read-only proxy (pairs sees nothing): probe LuaJIT's os names.
  for _, k in ipairs({'execute', 'exit', 'getenv', 'remove', 'rename', 'tmpname',
                      'date', 'difftime', 'setlocale'}) do
    if os[k] ~= nil then p[#p + 1] = 'os.' .. k end
  end
  if type(os.time()) ~= 'number' or type(os.clock()) ~= 'number' then p[#p + 1] = 'no os.time/clock' end
  if require('bit') ~= bit or require('ngx') ~= ngx then p[#p + 1] = 'require builtins' end
  for _, lib in ipairs({'string', 'table', 'math', 'bit', 'coroutine'}) do
    if type(_G[lib]) ~= 'table' then p[#p + 1] = 'missing ' .. lib end
  end
  return table.concat(p, ',')
end
local at_load = present()
counter = 0
return function()
  local h = ngx.var.http_x_case
  ngx.req.set_header('X-Present', at_load .. '|' .. present())
  if h == 'pcall' then pcall(function() while true do end end) end
  if h == 'xpcall' then xpcall(function() while true do end end, function() return 1 end) end
  if h == 'coroutine' then coroutine.resume(coroutine.create(function() while true do end end)) end
  if h == 'globals' then
    counter = counter + 1
    leaked = (leaked or 0) + 1
    ngx.req.set_header('X-Counts', counter .. ',' .. leaked)
  end
  if h == 'meta' then setmetatable(_G, {}) end
  if h == 'say' then ngx.say('hello') end
  if h == 'exit' then ngx.exit(200) end
  if h == 're' then ngx.re.match('a', 'a') end
  return 'gray'
end
"#;
    let gw = start_in(
        jit,
        &fx,
        &backends,
        script,
        "script_limits:\n  instruction_budget: 100000\n",
    );
    let r = gw.get("/").await;
    assert_eq!(r.json()["tag"], "gray");
    assert_eq!(backends[1].last().header("x-present").as_deref(), Some("|"));
    // The budget cannot be swallowed by pcall, xpcall or a coroutine;
    // unsupported OpenResty calls and replacing _G's metatable fail the
    // call. Each goes formal, and nothing the failed call set reaches the
    // node.
    for case in ["pcall", "xpcall", "coroutine", "meta", "say", "exit", "re"] {
        let r = Req::get("/").header("X-Case", case).send(gw.addr).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["tag"], "formal", "{case}");
        assert_eq!(backends[0].last().header("x-present"), None, "{case}");
    }
    // Globals: a top-level one reads as its load-time value in every call,
    // one created in a call is gone by the next.
    for _ in 0..3 {
        let r = Req::get("/")
            .header("X-Case", "globals")
            .send(gw.addr)
            .await;
        assert_eq!(r.json()["tag"], "gray");
        assert_eq!(
            backends[1].last().header("x-counts").as_deref(),
            Some("1,1")
        );
    }
    assert!(!gw.logs().contains("panicked"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_dict_evicts_lru_when_full_expires_items_and_resizes_on_reload() {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    let script = r#"return function()
  local d = ngx.shared.small
  local case = ngx.var.http_x_case
  if case == 'fill' then
    local forced = false
    for i = 1, 200 do
      local ok, err, forcible = d:set('k' .. i, string.rep('v', 100))
      if not ok then error(err) end
      forced = forced or forcible
    end
    ngx.req.set_header('X-Result', tostring(forced) .. ',' .. tostring(d:get('k1') ~= nil)
      .. ',' .. tostring(d:get('k200') ~= nil))
  elseif case == 'expire' then
    d:set('e', 'soon', 0.2)
    d:set('stays', 'here')
    ngx.req.set_header('X-Result', tostring(d:get('e')))
  else
    ngx.req.set_header('X-Result', tostring(d:get('e')) .. ',' .. tostring(d:get('stays')))
  end
  return 'gray'
end
"#;
    let extra = |size: &str| format!("shared_dicts:\n  small: {size}\n");
    let gw = start(&fx, &backends, script, &extra("10k"));
    let result = |case: &'static str| {
        let addr = gw.addr;
        let gray = &backends[1];
        async move {
            let r = Req::get("/").header("X-Case", case).send(addr).await;
            assert_eq!(r.json()["tag"], "gray", "{case}");
            gray.last().header("x-result").unwrap()
        }
    };
    // 200 items of ~170 bytes do not fit in 10 KiB: the least recently
    // used go (reported as forcible), the newest stay.
    assert_eq!(result("fill").await, "true,false,true");
    // exptime: the item is there, then (polled) gone; others stay.
    assert_eq!(result("expire").await, "soon");
    soon("the item expired", || async {
        result("read").await == "nil,here"
    })
    .await;
    // A reload with a larger size resizes the same dictionary: its contents
    // stay, and 200 items now fit.
    let g0 = gw.status().await["generation"].as_u64().unwrap();
    let cfg = std::fs::read_to_string(fx.path("gg.yaml")).unwrap();
    fx.write_rename("gg.yaml", &cfg.replace("small: 10k", "small: 1m"));
    soon("reloaded", || async {
        gw.status().await["generation"].as_u64().unwrap() > g0
    })
    .await;
    assert_eq!(
        result("read").await,
        "nil,here",
        "contents kept across the resize"
    );
    assert_eq!(result("fill").await, "false,true,true");
}

async fn require_resolves_only_modules_found_at_load(jit: bool) {
    let backends = lane_backends(&["formal", "gray"]).await;
    let fx = Fixture::new();
    fx.write("scripts/mods/a.lua", "return { lane = 'gray' }\n");
    fx.write("scripts/mods/b.lua", "return { lane = 'gray' }\n");
    let main = "local a = require('mods.a')\nreturn function()\n  local name = ngx.var.http_x_mod\n  if name then return require(name).lane end\n  return a.lane\nend\n";
    let gw = start_in(jit, &fx, &backends, main, "");
    assert_eq!(gw.get("/").await.json()["tag"], "gray");
    // A name computed at run time resolves among the modules found at load
    // (mods.a), not to another file in the directory (mods.b).
    let tag = |m: &'static str| {
        let addr = gw.addr;
        async move {
            Req::get("/").header("X-Mod", m).send(addr).await.json()["tag"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    assert_eq!(tag("mods.a").await, "gray");
    assert_eq!(tag("mods.b").await, "formal");
    assert_eq!(tag("bit").await, "formal", "a built-in has no `lane`");
    // At load: a missing module and a precompiled module are rejected with
    // file:line; the loaded script keeps serving.
    let lua = mlua::Lua::new();
    let bytecode = lua
        .load("return { lane = 'v2' }")
        .into_function()
        .unwrap()
        .dump(true);
    std::fs::write(fx.path("scripts/mods/bc.lua"), bytecode).unwrap();
    for (text, located) in [
        (
            "local x = require('mods.nope')\nreturn function() return 'v2' end\n",
            "main.lua:1:",
        ),
        // Located at the require (the module named in the message).
        (
            "\nlocal x = require('mods.bc')\nreturn function() return x.lane end\n",
            "main.lua:2: require \"mods.bc\": precompiled Lua bytecode is not allowed",
        ),
    ] {
        fx.write_rename("scripts/main.lua", text);
        soon(located, || async {
            gw.status().await["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.contains(located))
        })
        .await;
        assert_eq!(gw.get("/").await.json()["tag"], "gray");
        fx.write_rename("scripts/main.lua", main);
        soon("good script back", || async {
            gw.status().await["last_reload_error"].is_null()
        })
        .await;
    }
}

#[test]
fn an_unknown_or_ill_typed_jit_setting_is_rejected_with_its_line() {
    let fx = Fixture::new();
    fx.write("scripts/main.lua", "return function() return 'gray' end\n");
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    for (limits, needle) in [
        ("script_limits:\n  jit: maybe\n", "jit"),
        ("script_limits:\n  jit: 1\n", "jit"),
        ("script_limits:\n  jit_on: true\n", "unknown field"),
    ] {
        let cfg = Config::new()
            .script("scripts/main.lua")
            .raw(&format!(
                "{limits}routes:\n  - prefix: /\n    static: site\n"
            ))
            .write(&fx, "gg.yaml");
        let e = load_config(&cfg).unwrap_err();
        assert_eq!(e.line, Some(6), "{limits}: {e}");
        assert!(e.message.contains(needle), "{limits}: {e}");
    }
    // The three values load.
    for jit in ["true", "false", "auto"] {
        let cfg = Config::new()
            .script("scripts/main.lua")
            .raw(&format!("script_limits:\n  jit: {jit}\n"))
            .routes(&[Route::static_dir("/", "site")])
            .write(&fx, "gg.yaml");
        load_config(&cfg).unwrap();
    }
}
