#!/usr/bin/env python3
"""Side-by-side benchmark: graygate vs nginx+lua vs HAProxy+Lua doing the same
gray-release job on loopback.

Each gateway runs ONE worker pinned to CPU 1; the two backends (an nginx
serving fixed JSON for the formal and the gray lane) and wrk run on CPU 0
(pinning needs two CPUs and is off with --quick or --no-pin). Ports, the
lane decision and the helpers: bench/lib.py.

Usage:
  python3 bench/bench.py                 # full run (minutes)
  python3 bench/bench.py --quick         # seconds (CI): exits non-zero on any failed request
  python3 bench/bench.py --graygate target/release/graygate --duration 10 --rounds 3
Prints a markdown table: median req/s, p50, p99, errors, gateway CPU time per
request (user+sys from /proc over the run / requests), peak RSS, ratios to the
best anchor.
"""

import argparse
import json
import os
import sys
import tempfile

import lib

# The anchors each row's ratios are taken against (the best of them).
ANCHORS = ("nginx-lua", "haproxy-lua")


def table(results, names):
    lines = []
    for (mix, conns), per in results.items():
        anchors = [per[a] for a in ANCHORS if a in per]
        best_rps = max((a["rps"] for a in anchors), default=None)
        best_cpu = min((a["cpu_us"] for a in anchors), default=None)
        best_p99 = min((a["p99"] for a in anchors), default=None)
        for n in names:
            if n not in per:
                continue
            s = per[n]
            ratio = lambda v, b: f"{v / b:.2f}" if b else "-"
            lines.append(f"| {mix} | {conns} | {n} | {s['rps']:.0f} | {s['p50']:.2f} | {s['p99']:.2f} | "
                         f"{s['errors']} | {s['cpu_us']:.1f} | {s['user_us']:.1f} / {s['sys_us']:.1f} | "
                         f"{s['rss_mb']:.1f} | {ratio(s['rps'], best_rps)} | "
                         f"{ratio(s['cpu_us'], best_cpu)} | {ratio(s['p99'], best_p99)} |")
    head = ("| mix | conns | target | req/s (median) | p50 ms | p99 ms | errors | CPU µs/req "
            "| user / sys µs | peak RSS MB | req/s ÷ best anchor | CPU ÷ best anchor | p99 ÷ best anchor |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", default="32,256")
    ap.add_argument("--mixes", default="untagged,user-id,x-gray")
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--json", help="also write results here")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.duration, a.rounds, a.conns = 1, 1, "32"
    lib.require(("nginx", "nginx-lua", "haproxy", "wrk"), [a.graygate])
    # Pinning needs CPUs 0 and 1; the quick mode (CI) never pins.
    lib.PIN["on"] = not (a.quick or a.no_pin) and {0, 1} <= os.sched_getaffinity(0)
    dur = max(1, int(a.duration))
    conns = [int(c) for c in a.conns.split(",")]
    mixes = a.mixes.split(",")
    work = tempfile.mkdtemp(prefix="graygate-bench-")
    started = []
    try:
        started.append(lib.start_backends(work))
        targets = []
        starters = [lambda: lib.start_graygate(work, a.graygate), lambda: lib.start_nginx(work),
                    lambda: lib.start_haproxy(work)]
        if not a.quick:
            starters.append(lambda: lib.start_graygate(work, a.graygate, name="graygate-2w", workers=2,
                                                   cpus={0, 1}))
        for start in starters:
            targets.append(start())
            started.append(targets[-1])
        for t in targets:
            lib.sanity_check(t)
        names = [t.name for t in targets]
        results = {}
        for mix in mixes:
            for c in conns:
                runs = {t.name: [] for t in targets}
                for rnd in range(a.rounds):
                    order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                    for t in order:
                        runs[t.name].append(lib.measure(t, mix, c, dur))
                results[(mix, c)] = {n: lib.summarize(r) for n, r in runs.items()}
                print(f"done: {mix} @ {c}", file=sys.stderr, flush=True)
        for t in targets:
            t.stop()
            started.remove(t)
        print("## graygate vs nginx+lua vs HAProxy+Lua\n")
        pinning = ("gateways pinned to CPU 1, backends and wrk to CPU 0 (graygate-2w: 2 workers on CPUs 0,1)"
                   if lib.PIN["on"] else "nothing pinned")
        print(f"wrk -t1, {dur}s per run, {a.rounds} round(s), targets alternated; {pinning}.\n")
        print(table(results, names))
        scaling = []
        if not a.no_scaling:
            points = [("list", 10), ("list", 100000)] if a.quick else \
                [("list", 10), ("list", 1000), ("list", 100000), ("nodes", 10), ("nodes", 1000)]
            # All sizes run side by side (own ports, same CPU) and alternate
            # over the rounds, like the main table, so machine noise falls
            # on every size alike.
            scale_targets = []
            for kind, n in points:
                kw = {"list_entries": n} if kind == "list" else {"nodes_per_lane": n}
                name = f"graygate-{kind}-{n}"
                t = lib.start_graygate(work, a.graygate, name=name, **kw)
                started.append(t)
                lib.sanity_check(t)
                scale_targets.append((kind, n, t))
            scale_runs = {t.name: [] for _, _, t in scale_targets}
            for rnd in range(a.rounds):
                order = scale_targets[rnd % len(scale_targets):] + scale_targets[:rnd % len(scale_targets)]
                for _, _, t in order:
                    scale_runs[t.name].append(lib.measure(t, "untagged", conns[0], dur))
            for kind, n, t in scale_targets:
                t.stop()
                started.remove(t)
                scaling.append((kind, n, lib.summarize(scale_runs[t.name])))
            print("\n## graygate CPU per request vs whitelist entries and nodes\n")
            print("| varied | size | req/s | CPU µs/req | user / sys µs | errors |\n|---|---|---|---|---|---|")
            for kind, n, s in scaling:
                print(f"| {kind} | {n} | {s['rps']:.0f} | {s['cpu_us']:.1f} | "
                      f"{s['user_us']:.1f} / {s['sys_us']:.1f} | {s['errors']} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"results": {f"{m}@{c}": v for (m, c), v in results.items()},
                           "scaling": [{"kind": k, "size": n, **s} for k, n, s in scaling]}, f, indent=1)
    finally:
        lib.stop_all(started, work)
    lib.fail_on_errors(sum(s["errors"] for per in results.values() for s in per.values())
                       + sum(s["errors"] for _, _, s in scaling))


if __name__ == "__main__":
    main()
