#!/usr/bin/env python3
"""Release step propagation in an etcd fleet, not a timed test. On loopback,
with a real etcd (Debian's etcd-server) on free ports, an upstream of demo
nodes and two gateways on the etcd source, this script creates a release of
N steps (weights rising from 50 to 50+N-1, no minimum duration, 200 ms
intervals) and sends traffic through both gateways (wrk, a different
X-User-Id per request, so both lanes pass every interval). The elected
gateway steps the release; a poller per gateway reads its GET /releases
every 2 ms and notes when each step first shows. Propagation of a step to a
gateway = that moment minus the `at` of the leader's "step" decision (unix
ms, written just before its etcd transaction; same machine clock).

Usage:
  python3 bench/release_fleet.py --graygate target/release/graygate [--steps 40]
  python3 bench/release_fleet.py --quick --graygate target/debug/graygate   # 3 steps (CI)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import lib
from lib import Etcd, pct, start_upstream, write_nodes


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    lib.add_quick(ap)
    args = ap.parse_args()
    if args.quick:
        args.steps = 3
    lib.require(("etcd", "wrk"), [args.graygate])
    tmp = tempfile.mkdtemp(prefix="graygate-release-fleet-")
    procs = []
    etcd = Etcd(tmp)
    try:
        gg = os.path.abspath(args.graygate)
        up = start_upstream(gg, tmp, procs)
        prefix = "/bench"
        conf = os.path.join(tmp, "conf")
        os.makedirs(conf)
        with open(os.path.join(conf, "main.yaml"), "w") as f:
            f.write("listen: 127.0.0.1:0\nnode_files: [nodes.yaml]\nworkers: 1\n"
                    "routes:\n  - { prefix: /, service: api }\n")
        write_nodes(conf, up)
        lib.push_config(gg, conf, etcd, prefix)

        def boot(name):
            return lib.etcd_boot_config(tmp, name, etcd, prefix, extra="  counters_ms: 100\n")

        gws = [lib.GatewayProc([gg, "--config", boot(f"gw{i}-admin")], tmp, f"gw{i}-admin") for i in (1, 2)]
        procs += gws
        deadline = time.time() + 30
        while not any(get(f"http://{g.admin}/releases")["fleet"]["this_gateway_leads"] for g in gws):
            if time.time() > deadline:
                raise SystemExit("no leader")
            time.sleep(0.05)

        steps = "".join(f"  - {{ weight: {50 + i}, min_duration_ms: 0 }}\n" for i in range(args.steps))
        spec = ("name: bench\nlane: gray\nkey: { header: X-User-Id }\nsteps:\n" + steps +
                "analysis: { interval_ms: 200, min_requests: 5, max_p99_ratio: 1000 }\n")
        lua = os.path.join(tmp, "uid.lua")
        with open(lua, "w") as f:
            f.write("local n = 0\nrequest = function()\n  n = n + 1\n"
                    "  return wrk.format(nil, nil, { [\"X-User-Id\"] = tostring(n) })\nend\n")
        wrks = [subprocess.Popen(["wrk", "-t1", "-c4", "-d600s", "-s", lua, f"http://{g.addr}/"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for g in gws]
        seen = [dict() for _ in gws]
        done = threading.Event()

        def poll(i):
            url = f"http://{gws[i].admin}/releases"
            while not done.is_set():
                for r in get(url)["releases"]:
                    key = (r["step"], r["state"])
                    seen[i].setdefault(key, time.time())
                time.sleep(0.002)

        threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(len(gws))]
        for t in threads:
            t.start()
        req = urllib.request.Request(f"http://{gws[0].admin}/releases", data=spec.encode(), method="POST")
        urllib.request.urlopen(req, timeout=10).read()
        deadline = time.time() + 60 + args.steps
        while True:
            doc = get(f"http://{gws[0].admin}/releases/bench")
            if doc["state"] in ("promoted", "rolled_back"):
                break
            if time.time() > deadline:
                raise SystemExit(f"release did not finish: {json.dumps(doc)[:2000]}")
            time.sleep(0.1)
        time.sleep(0.2)
        done.set()
        for w in wrks:
            w.kill()
            w.wait()
        lat = []
        for a in doc["analyses"]:
            if a["outcome"] == "step" and a["reason"].startswith("step "):
                key = (a["step"], "progressing")
                for i in range(len(gws)):
                    if key in seen[i]:
                        lat.append(seen[i][key] * 1000 - a["at"])
            elif a["outcome"] == "promote":
                for i in range(len(gws)):
                    key = (doc["step"], "promoted")
                    if key in seen[i]:
                        lat.append(seen[i][key] * 1000 - a["at"])
        load = open("/proc/loadavg").read().split()[:3]
        print(f"state {doc['state']}, {len(lat)} step observations over 2 gateways "
              f"(of {args.steps} steps + promotion), load average {' '.join(load)}")
        if lat:
            print(f"step decision -> visible on a gateway: median {statistics.median(lat):.1f} ms, "
                  f"p99 {pct(lat, 99):.1f} ms, min {min(lat):.1f}, max {max(lat):.1f}")
    finally:
        for p in procs:
            p.stop()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if doc["state"] != "promoted":
        raise SystemExit(f"release_fleet.py: the release ended {doc['state']}, not promoted")


if __name__ == "__main__":
    main()
