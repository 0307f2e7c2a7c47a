#!/usr/bin/env python3
"""The same OpenResty script in nginx + lua-nginx-module and in graygate.

Two module scripts in bench/ run unchanged as the same file in both gateways:
  simple  bench/openresty_simple.lua  ngx.var.remote_addr + bit.band CIDR check,
                                      ngx.var.http_*, ngx.crc32_short bucket
  heavy   bench/openresty_heavy.lua   ABTestingGateway-style chain: iprange by bit
                                      ops, get_headers(), get_uri_args(), cookies,
                                      uid in a set / ranges / by suffix, crc32
                                      percentage; every request walks it all
nginx runs `access_by_lua_block { ngx.var.lane = require(...).lane() or "formal" }`
and proxies to the lane's upstream; graygate runs the file as its `script:`.
Set-up as bench/bench.py (helpers: bench/lib.py): one worker each pinned to
CPU 1, the backends and wrk on CPU 0, ephemeral ports, wrk -t1, targets
alternated over the rounds, medians. Before measuring, both gateways must give
the same lane (and tag) on a set of probe requests.

Usage:
  python3 bench/openresty_bench.py                          # 3 rounds x 4 s, ~4 minutes
  python3 bench/openresty_bench.py --scripts heavy --duration 5
  python3 bench/openresty_bench.py --extra before=/tmp/graygate-old   # another build side by side
  python3 bench/openresty_bench.py --quick                  # seconds, unpinned (CI; fails on errors)
  python3 bench/openresty_bench.py --interp                 # also each build with script_limits.jit: false
  python3 bench/openresty_bench.py --jit                    # also each build with script_limits.jit: true
  python3 bench/openresty_bench.py --jit-only               # each build with script_limits.jit: true only
The rows named for a build alone run the configuration as shipped (no
script_limits.jit key: auto, LuaJIT's compiler where it can run).
"""

import argparse
import http.client
import json
import os
import sys
import tempfile

import lib


def probe_cases():
    """Requests on which both gateways must agree: (source ip, path, headers)."""
    cases = [("127.0.0.1", "/api/x", {}), ("127.0.9.7", "/api/x", {}),
             ("127.0.0.1", "/api/x", {"X-Gray": "1"}), ("127.0.0.1", "/api/x", {"X-Gray": "0"}),
             ("127.0.0.1", "/api/x?lane=canary", {}), ("127.0.0.1", "/api/x?uid=5001", {}),
             ("127.0.0.1", "/api/x", {"Cookie": "ver=v2"}),
             ("127.0.0.1", "/api/x", {"Cookie": "a=1; uid=1001"}),
             ("127.0.0.1", "/api/x?uid=3", {"Cookie": "uid=70123", "X-User-Id": "8"})]
    cases += [("127.0.0.1", "/api/x", {"X-User-Id": str(i)}) for i in range(1, 60)]
    return cases


def lane_of(port, ip, path, headers):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(ip, 0))
    try:
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        body = json.loads(r.read())
        return f"{body.get('lane')}/{body.get('tag')}"
    finally:
        c.close()


def same_lanes(targets):
    """Every target gives the same lane and tag on every probe; both lanes occur."""
    seen = set()
    for ip, path, headers in probe_cases():
        got = {t.name: lane_of(t.port, ip, path, headers) for t in targets}
        if len(set(got.values())) != 1:
            raise SystemExit(f"lanes differ for {ip} {path} {headers}: {got}")
        seen |= set(got.values())
    if not {"formal/formal", "gray/gray"} <= seen:
        raise SystemExit(f"the probes never gave both lanes: {seen}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=PATH",
                    help="another graygate build measured side by side")
    ap.add_argument("--scripts", default="simple,heavy")
    ap.add_argument("--duration", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", default="32,256")
    ap.add_argument("--mixes", default="untagged,user-id,x-gray")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--interp", action="store_true",
                    help="also run each build with script_limits.jit: false (rows NAME-interp)")
    ap.add_argument("--jit", action="store_true",
                    help="also run each build with script_limits.jit: true (rows NAME-jit)")
    ap.add_argument("--jit-only", action="store_true",
                    help="run each build with script_limits.jit: true only (rows NAME-jit)")
    ap.add_argument("--json", help="also write the results here")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.duration, a.rounds, a.conns = 1, 1, "32"
    builds = [("graygate", a.graygate)] + [tuple(e.split("=", 1)) for e in a.extra]
    lib.require(("nginx", "nginx-lua", "wrk"), [path for _, path in builds])
    lib.PIN["on"] = not (a.quick or a.no_pin) and {0, 1} <= os.sched_getaffinity(0)
    dur = max(1, int(a.duration))
    conns = [int(c) for c in a.conns.split(",")]
    mixes = a.mixes.split(",")
    work = tempfile.mkdtemp(prefix="graygate-openresty-bench-")
    started = []
    out = {}
    try:
        started.append(lib.start_backends(work))
        for script in a.scripts.split(","):
            module = lib.OPENRESTY_SCRIPTS[script]
            targets = []
            for name, path in builds:
                modes = [True] if a.jit_only else [None] + [True] * a.jit
                modes += [False] * a.interp
                for jit in modes:
                    suffix = {None: "", True: "-jit", False: "-interp"}[jit]
                    targets.append(lib.start_graygate(work, path, name=f"{name}{suffix}-{script}",
                                                      script=os.path.join(lib.BENCH, f"{module}.lua"), jit=jit))
                    started.append(targets[-1])
            access = (f"access_by_lua_block {{ ngx.var.lane = require(\"{module}\").lane()"
                      f" or \"formal\" }}")
            targets.append(lib.start_nginx(work, name=f"nginx-{script}", access=access))
            started.append(targets[-1])
            same_lanes(targets)
            anchor = targets[-1].name
            for mix in mixes:
                for c in conns:
                    runs = {t.name: [] for t in targets}
                    for rnd in range(a.rounds):
                        order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                        for t in order:
                            runs[t.name].append(lib.measure(t, mix, c, dur))
                    per = {n: lib.summarize(r) for n, r in runs.items()}
                    out[(script, mix, c)] = (anchor, per)
                    print(f"done: {script} {mix} @ {c}", file=sys.stderr, flush=True)
            for t in targets:
                t.stop()
                started.remove(t)
        pinning = "gateways pinned to CPU 1, backends and wrk to CPU 0" if lib.PIN["on"] else "nothing pinned"
        print(f"wrk -t1, {dur}s per run, {a.rounds} round(s), targets alternated; {pinning}.\n")
        print("| script | mix | conns | target | req/s (median) | p99 ms | errors | CPU µs/req "
              "| user / sys µs | req/s ÷ nginx | CPU ÷ nginx |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for (script, mix, c), (anchor, per) in out.items():
            base = per[anchor]
            for n, s in per.items():
                print(f"| {script} | {mix} | {c} | {n} | {s['rps']:.0f} | {s['p99']:.2f} | {s['errors']} | "
                      f"{s['cpu_us']:.1f} | {s['user_us']:.1f} / {s['sys_us']:.1f} | "
                      f"{s['rps'] / base['rps']:.2f} | {s['cpu_us'] / base['cpu_us']:.2f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({f"{s}/{m}@{c}": per for (s, m, c), (_, per) in out.items()}, f, indent=1)
    finally:
        lib.stop_all(started, work)
    lib.fail_on_errors(sum(s["errors"] for _, per in out.values() for s in per.values()))


if __name__ == "__main__":
    main()
