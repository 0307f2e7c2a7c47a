//! Request → lane decision, end to end through `lane::decide` on a real
//! `Generation` loaded from files: the shipped `scripts/gray.lua`, the
//! OpenResty-style module `scripts/openresty_gray.lua`, declarative rules,
//! and a lookup in a 100,000-CIDR list.
//!
//! `ngx/<api> ×1` and `×10` measure each OpenResty API a script may call
//! (first use in a request, and nine repeated uses on top).
//!
//! `BENCH_CLOCK=cpu` times with the benchmark thread's CPU clock instead of
//! the wall clock, so figures on a shared, busy machine are not inflated by
//! waiting for a core (criterion still reports them as "time").

use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;

mod common;
use common::{config, timed};

use criterion::{criterion_group, criterion_main, Criterion};
use graygate::base::lists::IpList;
use graygate::generation::Generation;
use graygate::lane::{decide, RequestInfo};

fn request(uri: &str, ip: &str, headers: &[(&str, &str)]) -> RequestInfo {
    let mut b = http::Request::builder()
        .uri(uri)
        .header("host", "shop.example");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let (parts, _) = b.body(()).unwrap().into_parts();
    RequestInfo {
        parts,
        client_ip: ip.parse::<IpAddr>().unwrap(),
        host: "shop.example".into(),
        peer_trusted: false,
    }
}

/// 100,000 disjoint /24s spread over 10.0.0.0/8 and 172.16.0.0/12…
fn big_list_text() -> String {
    (0..100_000u32)
        .map(|i| {
            let n = i * 2; // every other /24: nothing merges
            format!("{}.{}.{}.0/24\n", 10 + (n >> 16), (n >> 8) & 0xff, n & 0xff)
        })
        .collect()
}

const RULES: &str = "\
uid: { header: X-User-Id }
deny:
  - name: blocked
    ip: { list: big }
rules:
  - name: testers
    lane: gray
    ip: [127.0.9.0/24, 192.168.7.0/24]
  - name: beta
    lane: gray-a
    header: { name: X-Beta, values: [\"1\", \"yes\"] }
  - name: vip
    lane: gray
    uid: { in: [1001, 1002, 1003], ranges: [[5000, 5999]], suffix: [7] }
  - name: v2-api
    lane: v2
    path_prefix: /api/v2/
  - name: ten-percent
    lane: gray
    percentage: 10
";

fn load(dir: &Path, extra: &str) -> Generation {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = dir.join("gg.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\nlists:\n  gray_ips: {}\n  big: big.txt\n{extra}",
            repo.join("config/gray_ips.txt").display()
        ),
    )
    .unwrap();
    Generation::load(&cfg, 1).unwrap()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.txt"), big_list_text()).unwrap();
    std::fs::write(dir.path().join("rules.yaml"), RULES).unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));

    let mut run = |name: &str, gen: &Generation, req: RequestInfo, want: &str| {
        let decided = decide(&gen.lane, req);
        let d = &decided.decision;
        assert_eq!(d.lane, want, "{name}: {:?}", d.decided_by);
        let mut slot = Some(decided.info);
        c.bench_function(name, |b| {
            timed(b, || {
                let req = slot.take().unwrap();
                let decided = decide(&gen.lane, black_box(req));
                black_box(&decided.decision);
                slot = Some(decided.info);
            })
        });
    };

    let shipped = load(
        dir.path(),
        &format!("script: {}\n", repo.join("scripts/gray.lua").display()),
    );
    // Not in the list, no X-Gray: the whole script runs (bucket of the uid).
    let uid = (0..)
        .map(|i| format!("user-{i}"))
        .find(|u| graygate::lane::bucket(u.as_bytes()) >= 10)
        .unwrap();
    run(
        "script/shipped gray.lua",
        &shipped,
        request("/api/items", "10.200.1.1", &[("x-user-id", &uid)]),
        "formal",
    );

    let module = load(
        dir.path(),
        &format!(
            "script: {}\n",
            repo.join("scripts/openresty_gray.lua").display()
        ),
    );
    // Falls through every branch to formal: ngx.var, get_headers,
    // crc32, md5, get_uri_args all run.
    let sid = (0..)
        .map(|i| format!("s{i}"))
        .find(|s| {
            use md5::Digest;
            md5::Md5::digest(s.as_bytes())[0] >= 0x20
        })
        .unwrap();
    let uid = (0..)
        .map(|i| format!("9{i}"))
        .find(|u| {
            let n: i64 = u.parse().unwrap();
            n & 0xff != 0x2a && crc32fast::hash(u.as_bytes()) % 100 >= 20
        })
        .unwrap();
    run(
        "script/openresty module",
        &module,
        request(
            "/api/items?x=1",
            "10.200.1.1",
            &[
                ("x-user-id", &uid),
                ("cookie", &format!("sid={sid}")),
                ("accept", "*/*"),
                ("user-agent", "bench"),
            ],
        ),
        "formal",
    );

    // The two OpenResty scripts of bench/openresty_bench.py, as wrk sends
    // its requests (a uid that no policy picks: the whole chain runs).
    for (name, file, pct) in [
        (
            "script/bench openresty_simple.lua",
            "bench/openresty_simple.lua",
            10,
        ),
        (
            "script/bench openresty_heavy.lua",
            "bench/openresty_heavy.lua",
            5,
        ),
    ] {
        let gen = load(
            dir.path(),
            &format!("script: {}\n", repo.join(file).display()),
        );
        let uid = (100_000..)
            .map(|i: u32| i.to_string())
            .find(|u| !u.ends_with('7') && crc32fast::hash(u.as_bytes()) % 100 >= pct)
            .unwrap();
        run(
            name,
            &gen,
            request("/api/x", "127.0.0.1", &[("x-user-id", &uid)]),
            "formal",
        );
    }

    let rules = load(dir.path(), "rules_file: rules.yaml\n");
    // Passes the 100k-CIDR deny list and every rule up to the percentage.
    let uid = (0..)
        .map(|i| format!("{}", 100_000 + i * 10 + 1))
        .find(|u| graygate::lane::bucket(u.as_bytes()) < 10)
        .unwrap();
    run(
        "rules/declarative (6 rules, last matches)",
        &rules,
        request("/api/items", "192.0.2.1", &[("x-user-id", &uid)]),
        "gray",
    );

    // The fixed cost of calling into Lua: a lane function that returns nil.
    std::fs::write(
        dir.path().join("empty.lua"),
        "return function() return nil end\n",
    )
    .unwrap();
    let empty = load(dir.path(), "script: empty.lua\n");
    run(
        "script/empty (fixed cost of a Lua call)",
        &empty,
        request("/", "10.200.1.1", &[]),
        "formal",
    );

    // The cost of a runaway script: `while true do end` run until the
    // default instruction budget stops it (so: what the budget is in time).
    std::fs::write(
        dir.path().join("runaway.lua"),
        "return function() while true do end end\n",
    )
    .unwrap();
    let runaway = load(dir.path(), "script: runaway.lua\n");
    run(
        "script/runaway stopped by the default budget",
        &runaway,
        request("/", "10.200.1.1", &[]),
        "formal",
    );
    // The same with LuaJIT's compiler on: the loop is a compiled trace
    // within a few dozen iterations, and its budget checks with it.
    let runaway_jit = load(
        dir.path(),
        "script: runaway.lua\nscript_limits:\n  jit: true\n",
    );
    run(
        "script/runaway stopped by the default budget, jit: true",
        &runaway_jit,
        request("/", "10.200.1.1", &[]),
        "formal",
    );

    // Each `ngx` API's cost: a lane function that calls it 10 times, against
    // the same loop doing nothing (`ngx/loop only`): (t - t_loop) / 10 is one
    // call. The request carries headers, cookies and arguments to read.
    let api_req = || {
        request(
            "/api/items?uid=42&name=J%20o&flag&k=1&k=2",
            "10.200.1.1",
            &[
                ("x-user-id", "42"),
                ("cookie", "sid=abc; uid=7; ver=v2"),
                ("accept", "*/*"),
                ("user-agent", "bench"),
                ("x-forwarded-for", "1.2.3.4"),
            ],
        )
    };
    let apis = [
        ("loop only", "local _ = i"),
        ("ngx.var.remote_addr", "local _ = ngx.var.remote_addr"),
        ("ngx.var.http_x_user_id", "local _ = ngx.var.http_x_user_id"),
        ("ngx.var.cookie_uid", "local _ = ngx.var.cookie_uid"),
        ("ngx.var.arg_uid", "local _ = ngx.var.arg_uid"),
        ("ngx.var.uri", "local _ = ngx.var.uri"),
        ("ngx.var.http_missing", "local _ = ngx.var.http_x_missing"),
        ("ngx.req.get_headers()", "local _ = ngx.req.get_headers()"),
        ("ngx.req.get_uri_args()", "local _ = ngx.req.get_uri_args()"),
        ("ngx.crc32_short", "local _ = ngx.crc32_short('user-42')"),
        ("ngx.md5", "local _ = ngx.md5('user-42')"),
        ("ngx.shared get", "local _ = ngx.shared.d:get('k')"),
        ("ngx.shared set", "ngx.shared.d:set('k', i)"),
        ("bit.band", "local _ = bit.band(i, 0xff)"),
        ("bit.lshift", "local _ = bit.lshift(i, 8)"),
    ];
    // ×1 is the first use in a request (values are fetched and cached
    // then), ×10 adds nine repeated uses.
    for (name, call) in apis {
        for reps in [1, 10] {
            let file = format!(
                "api-{}-{reps}.lua",
                name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
            );
            std::fs::write(
                dir.path().join(&file),
                format!(
                    "return function()\n  for i = 1, {reps} do {call} end\n  return nil\nend\n"
                ),
            )
            .unwrap();
            let gen = load(
                dir.path(),
                &format!("script: {file}\nshared_dicts: {{ d: 1m }}\n"),
            );
            run(&format!("ngx/{name} ×{reps}"), &gen, api_req(), "formal");
        }
    }

    let list = IpList::parse(Path::new("big.txt"), &big_list_text()).unwrap();
    assert_eq!(list.len(), 100_000);
    let ips: Vec<IpAddr> = (0..1024u32)
        .map(|i| {
            let n = i.wrapping_mul(2_654_435_761) % 200_000;
            IpAddr::from([(10 + (n >> 16)) as u8, (n >> 8) as u8, n as u8, 7])
        })
        .collect();
    let hits = ips.iter().filter(|ip| list.contains(**ip)).count();
    assert!(hits > 300 && hits < 724, "{hits}");
    let mut i = 0;
    c.bench_function("list/100k CIDRs lookup", |b| {
        timed(b, || {
            i = (i + 1) & 1023;
            black_box(list.contains(black_box(ips[i])));
        })
    });
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench
}
criterion_main!(benches);
