#!/usr/bin/env python3
"""Fleet benchmark (etcd source), not a timed test. On loopback, with a real
etcd (Debian's etcd-server) this script starts on free ports:

1. push -> every gateway serving the new revision: median and p99 over N
   pushes (default 50), two gateways, each push one transaction changing the
   script (`graygate push`-style, via the etcd v3 JSON gateway), timed until
   both gateways' /status show the push's revision;
2. generation build time and RSS for 1,000 services x 10 nodes read from etcd
   (registry keys `<prefix>/services/<svc>/nodes/<id>`): `build_ms` from the
   gateway's "configuration reloaded" log line, RSS from /proc;
3. request CPU with an etcd source vs files, side by side in one run: the same
   configuration (pulled from etcd) served by a files gateway and an etcd
   gateway, wrk against each in turn, gateway CPU (user+sys from /proc) per
   request.

Usage:
  python3 bench/fleet.py --graygate target/release/graygate [--pushes 50] [--duration 5]
  python3 bench/fleet.py --quick --graygate target/debug/graygate   # seconds (CI): fails on errors
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import lib
from lib import Etcd, b64, pct, start_upstream, write_nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pushes", type=int, default=50)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--duration", type=int, default=5)
    lib.add_quick(ap)
    args = ap.parse_args()
    if args.quick:
        args.pushes, args.services, args.nodes, args.duration = 3, 20, 2, 1
    lib.require(("etcd", "wrk"), [args.graygate])
    errors = 0
    tmp = tempfile.mkdtemp(prefix="graygate-fleet-")
    procs = []
    etcd = Etcd(tmp)
    try:
        gg = os.path.abspath(args.graygate)
        # Upstream: a graygate running only demo nodes (fast, fixed JSON).
        up = start_upstream(gg, tmp, procs)

        prefix = "/bench"
        conf = os.path.join(tmp, "conf")
        os.makedirs(conf)
        with open(os.path.join(conf, "main.yaml"), "w") as f:
            f.write("listen: 127.0.0.1:0\nscript: gray.lua\nnode_files: [nodes.yaml]\nworkers: 1\n"
                    "routes:\n  - { prefix: /, service: api }\n")
        write_nodes(conf, up)
        script = "return function(req)\n  if req:header('X-Gray') then return 'gray' end\n  -- v{n}\nend\n"
        with open(os.path.join(conf, "gray.lua"), "w") as f:
            f.write(script.format(n=0))
        lib.push_config(gg, conf, etcd, prefix)

        def boot(name):
            return lib.etcd_boot_config(tmp, name, etcd, prefix)

        gws = [lib.GatewayProc([gg, "--config", boot(f"gw{i}-admin")], tmp, f"gw{i}-admin") for i in (1, 2)]
        procs += gws

        # 1. push -> both serving the new revision.
        lat = []
        for n in range(1, args.pushes + 1):
            t0 = time.perf_counter()
            rev = etcd.txn_puts([(f"{prefix}/config/gray.lua", script.format(n=n))])
            pending = set(range(len(gws)))
            deadline = time.time() + 20
            while pending:
                for i in list(pending):
                    if gws[i].status().get("revision") == rev:
                        pending.discard(i)
                if time.time() > deadline:
                    raise SystemExit(f"push {n} (revision {rev}) not applied")
                if pending:
                    time.sleep(0.001)
            lat.append((time.perf_counter() - t0) * 1e3)
        print(f"## push -> every gateway serving it ({args.pushes} pushes, 2 gateways, debounce 150 ms)\n")
        print("| median | p99 | min | max |\n|---|---|---|---|")
        print(f"| {statistics.median(lat):.1f} ms | {pct(lat, 99):.1f} ms | {min(lat):.1f} ms | {max(lat):.1f} ms |\n")

        # 2. 1,000 services x 10 nodes from the registry.
        rss0 = gws[0].rss_mb()
        kvs = []
        for s in range(args.services):
            for n in range(args.nodes):
                inst = {"addr": f"127.0.0.{1 + n}:{20000 + s}", "lane": "gray" if n == 0 else "formal",
                        "metadata": {"version": "v1", "zone": "hz"}}
                kvs.append((f"{prefix}/services/svc-{s:04}/nodes/n{n}", json.dumps(inst)))
        t0 = time.perf_counter()
        for i in range(0, len(kvs), 100):
            etcd.txn_puts(kvs[i:i + 100])
        last = etcd.put(f"{prefix}/config/gray.lua", script.format(n="big"))
        write_s = time.perf_counter() - t0
        deadline = time.time() + 120
        while any(g.status().get("revision") != last for g in gws):
            if time.time() > deadline:
                raise SystemExit("registry not applied")
            time.sleep(0.05)
        builds = [float(m) for m in re.findall(r"build_ms=([0-9.]+)", gws[0].text())]
        print(f"## {args.services} services x {args.nodes} nodes read from etcd ({len(kvs)} registry keys)\n")
        print("| build (last generation) | RSS before | RSS after | keys written in |\n|---|---|---|---|")
        print(f"| {builds[-1]:.1f} ms | {rss0:.1f} MB | {gws[0].rss_mb():.1f} MB | {write_s:.1f} s |\n")
        for g in gws:
            g.stop()
        procs = [p for p in procs if p not in gws]
        # Drop the registry again for the CPU comparison (same small config).
        etcd.call("/v3/kv/deleterange", {"key": b64(f"{prefix}/services/"), "range_end": b64(f"{prefix}/services0")})

        # 3. request CPU: etcd source vs files, same configuration.
        pulled = os.path.join(tmp, "pulled")
        subprocess.run([gg, "pull", "--etcd", etcd.url, "--prefix", prefix, "--dir", pulled], check=True,
                       capture_output=True)
        # The same admin listener as the etcd gateway's (its stats history
        # runs either way), so only the source differs.
        with open(os.path.join(pulled, "main.yaml"), "a") as f:
            f.write("admin_listen: 127.0.0.1:0\n")
        files_gw = lib.GatewayProc([gg, "--config", os.path.join(pulled, "main.yaml")], tmp, "files-admin")
        etcd_gw = lib.GatewayProc([gg, "--config", boot("etcd-admin")], tmp, "etcd-admin")
        procs += [files_gw, etcd_gw]
        print(f"## request CPU, etcd source vs files (wrk -t1 -c16 -d{args.duration}s, 1 worker each, same config)\n")
        print("| source | req/s | CPU per request |\n|---|---|---|")
        for name, g in (("files", files_gw), ("etcd", etcd_gw), ("files", files_gw), ("etcd", etcd_gw)):
            c0 = g.cpu()
            out = subprocess.run(["wrk", "-t1", "-c16", f"-d{args.duration}s", f"http://{g.addr}/api/x"],
                                 capture_output=True, text=True).stdout
            cpu = g.cpu() - c0
            reqs = int(re.search(r"(\d+) requests in", out).group(1))
            rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
            errors += lib.wrk_errors(out)
            print(f"| {name} | {rps:.0f} | {cpu / reqs * 1e6:.1f} µs |")
    finally:
        for p in procs:
            p.stop()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lib.fail_on_errors(errors)


if __name__ == "__main__":
    sys.exit(main())
