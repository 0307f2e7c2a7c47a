#!/usr/bin/env python3
"""A/B two or more graygate builds on the same backends (no anchors).

The machine this was written on is a noisy 2-core VM: a single run swings
±15%. To judge a change, alternate builds over several rounds and compare the
median and the minimum CPU per request (the minimum is the run with the least
interference).

Usage:
  cp target/release/graygate /tmp/gg-before   # build, change, rebuild, then:
  python3 bench/ab.py /tmp/gg-before target/release/graygate --rounds 5 --mix untagged --conns 32,256
  python3 bench/ab.py --quick --graygate target/debug/graygate   # seconds (CI): the build against itself
"""
import argparse
import os
import shutil
import statistics
import tempfile

import lib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="*", help="the builds (two or more; --quick: --graygate twice)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--mix", default="untagged", choices=sorted(lib.MIXES))
    ap.add_argument("--conns", default="32,256")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.duration, a.conns = 1, 1, "32"
        a.binaries = a.binaries or [a.graygate, a.graygate]
    if len(a.binaries) < 2:
        ap.error("name two or more builds (or --quick)")
    lib.require(("nginx", "wrk"), a.binaries)
    conns = [int(c) for c in a.conns.split(",")]
    # Pinned like bench.py's full run when CPUs 0 and 1 are there.
    lib.PIN["on"] = not a.quick and {0, 1} <= os.sched_getaffinity(0)
    work = tempfile.mkdtemp(prefix="graygate-ab-")
    backends = lib.start_backends(work)
    runs = {}
    try:
        for _ in range(a.rounds):
            for i, b in enumerate(a.binaries):
                t = lib.start_graygate(work, b)
                try:
                    lib.sanity_check(t)
                    for c in conns:
                        runs.setdefault((c, i, b), []).append(lib.measure(t, a.mix, c, a.duration))
                finally:
                    t.stop()
    finally:
        backends.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("| conns | build | req/s (median) | CPU µs/req median | min | user / sys µs | p99 ms | errors | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (c, i, b), rs in sorted(runs.items()):
        med = lambda k: statistics.median(r[k] for r in rs)
        print(f"| {c} | {b} | {med('rps'):.0f} | {med('cpu_us'):.1f} | {min(r['cpu_us'] for r in rs):.1f} | "
              f"{med('user_us'):.1f} / {med('sys_us'):.1f} | {med('p99'):.2f} | {sum(r['errors'] for r in rs)} | "
              f"{max(r['rss_mb'] for r in rs):.1f} |")
    lib.fail_on_errors(sum(r["errors"] for rs in runs.values() for r in rs))


if __name__ == "__main__":
    main()
