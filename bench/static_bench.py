#!/usr/bin/env python3
"""Static files side by side: nginx (Debian defaults: `sendfile on`,
`tcp_nopush on`, no open_file_cache) vs graygate serving the same lane trees.

Each server runs ONE worker pinned to CPU 1, wrk runs on CPU 0 (pinning needs
two CPUs and is off with --quick or --no-pin). Both decide the lane the same
way (`X-Gray: 1` -> gray; nginx with a `map`, graygate with a rule) and serve
`static/<lane>/<path>` with per-file fallback to `static/formal/` (nginx:
`try_files /$lane$uri /formal$uri =404`). Every request carries `X-Gray: 1`:
the "lane" rows ask for a file in gray's own tree, the "fallback" rows for one
only formal has. Files of 2 KB, 100 KB and 1 MiB, at 32 and 256 keep-alive
connections; rounds alternate the servers.

Usage:
  cargo build --release
  python3 bench/static_bench.py                       # full run (~5 minutes)
  python3 bench/static_bench.py --quick               # seconds (CI): fails on any error
  python3 bench/static_bench.py --duration 4 --rounds 3 --json out.json
Prints a markdown table: median req/s and CPU µs per request (user+sys from
/proc over the run ÷ requests) of each, and graygate ÷ nginx. The last column
is the whole machine's busy CPU per request (/proc/stat, both CPUs: wrk and
the kernel's softirq work included). On loopback the receiving side's TCP work
runs in the softirq of the CPU that transmits, so a server that transmits at
send time (graygate's TCP_NOTSENT_LOWAT) is charged the client's receive
processing, and one that leaves transmission to the client's ACKs (nginx) is
not: this column shows whether work was added or only moved.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

import lib

SIZES, TREES = lib.STATIC_SIZES, lib.STATIC_TREES
url_path = lib.static_url_path


def start_nginx(work, root):
    main, http = lib.nginx_common(work, "nginx-static")
    sock = lib.listen_socket()
    port = sock.getsockname()[1]
    conf = main + f"""
http {{
{http}
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    map $http_x_gray $lane {{ default formal; "1" gray; }}
    server {{
        listen 127.0.0.1:{port} backlog=8192;
        root {root};
        location / {{ try_files /$lane$uri /formal$uri =404; }}
    }}
}}
"""
    path = os.path.join(work, "nginx-static.conf")
    with open(path, "w") as f:
        f.write(conf)
    return lib.Target("nginx", ["nginx", "-p", work, "-e", "stderr", "-c", path],
                    os.path.join(work, "nginx-static.log"), socks=[sock], nginx=True)


def sanity_check(target, root, sizes):
    """Both serve the same bytes: gray's own file, formal's fallback file."""
    for size in sizes:
        for tree in TREES:
            req = urllib.request.Request(f"http://127.0.0.1:{target.port}{url_path(tree, size)}",
                                         headers={"X-Gray": "1"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    got = r.read()
            except OSError as e:
                raise SystemExit(f"{target.name}: {url_path(tree, size)}: {e}")
            lane = "gray/own" if tree == "lane" else "formal/fb"
            with open(os.path.join(root, lane, f"{size}.bin"), "rb") as f:
                if got != f.read():
                    raise SystemExit(f"{target.name}: {url_path(tree, size)} is not {lane}'s file")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", default="32,256")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json", help="also write results here")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.duration, a.rounds, a.conns, a.sizes = 1, 1, "32", "2k"
    lib.require(("nginx", "wrk"), [a.graygate])
    lib.PIN["on"] = not (a.quick or a.no_pin) and {0, 1} <= os.sched_getaffinity(0)
    sizes = {s: SIZES[s] for s in a.sizes.split(",")}
    conns = [int(c) for c in a.conns.split(",")]
    dur = max(1, int(a.duration))
    work = tempfile.mkdtemp(prefix="graygate-static-bench-")
    os.chmod(work, 0o755)  # nginx's workers run as an unprivileged user
    started = []
    try:
        root = lib.make_static_tree(work, sizes)
        for start in (lambda: lib.start_static_graygate(work, a.graygate, root), lambda: start_nginx(work, root)):
            started.append(start())
            sanity_check(started[-1], root, sizes)
        targets = list(started)
        rows = []
        for size in sizes:
            for c in conns:
                for tree in TREES:
                    runs = {t.name: [] for t in targets}
                    for rnd in range(a.rounds):
                        order = targets[rnd % 2:] + targets[:rnd % 2]
                        for t in order:
                            runs[t.name].append(lib.measure(t, None, c, dur, path=url_path(tree, size),
                                                          args=["-H", "X-Gray: 1"]))
                    rows.append((size, c, tree, {n: lib.summarize(r) for n, r in runs.items()}))
                    print(f"done: {size} @ {c} {tree}", file=sys.stderr, flush=True)
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        pinning = "each server one worker pinned to CPU 1, wrk on CPU 0" if lib.PIN["on"] else "nothing pinned"
        print("## Static files: graygate vs nginx (sendfile on)\n")
        print(f"wrk -t1, {dur}s per run, {a.rounds} round(s), medians, servers alternated; {pinning}; "
              f"`X-Gray: 1` on every request. Load after the run: {load}\n")
        print("| file | conns | tree | nginx req/s · CPU µs/req | graygate req/s · CPU µs/req "
              "| req/s ÷ nginx | CPU ÷ nginx | errors (nginx / graygate) "
              "| machine CPU µs/req: nginx · graygate (÷) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for size, c, tree, per in rows:
            n, g = per["nginx"], per["graygate"]
            print(f"| {size} | {c} | {tree} | {n['rps']:,.0f} · {n['cpu_us']:.1f} | "
                  f"{g['rps']:,.0f} · {g['cpu_us']:.1f} | {g['rps'] / n['rps']:.2f} | "
                  f"{g['cpu_us'] / n['cpu_us']:.2f} | {n['errors']} / {g['errors']} | "
                  f"{n['machine_us']:.1f} · {g['machine_us']:.1f} ({g['machine_us'] / n['machine_us']:.2f}) |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump([{"file": s, "conns": c, "tree": t, **per} for s, c, t, per in rows], f, indent=1)
    finally:
        lib.stop_all(started, work)
    lib.fail_on_errors(sum(s["errors"] for _, _, _, per in rows for s in per.values()))


if __name__ == "__main__":
    main()
