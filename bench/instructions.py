#!/usr/bin/env python3
"""User-space instructions per request, counted by valgrind (callgrind).

The wrk figures on a shared 2-vCPU VM swing by 10-20% from run to run; an
instruction count does not. Each gateway runs under `valgrind --tool=callgrind`
with instrumentation off; after 200 warm-up requests instrumentation is
switched on, N requests are sent one after another on one keep-alive
connection (for each load mix), and the gateway's total instruction count is
divided by N. Kernel work (the sockets) is not counted: this is the part of
the CPU cost each gateway's own code decides.

Usage:
  cargo build --release
  python3 bench/instructions.py                       # graygate, nginx+lua, HAProxy+Lua
  python3 bench/instructions.py --graygate /tmp/gg-old --only graygate   # A/B a change
"""
import argparse
import glob
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time

import bench


def count(cmd, sock, nginx, mixes, n, out):
    """`sock`: the listening socket the target inherits (None: graygate on
    port 0, its logged address read back)."""
    for f in glob.glob(out + "*"):
        os.remove(f)
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = dict(os.environ, RUST_LOG=bench.GRAYGATE_LOG)
    fds = (sock.fileno(),) if sock else ()
    if nginx:
        env["NGINX"] = f"{sock.fileno()};"
    log = out + ".log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(vg + cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, pass_fds=fds)
    if sock:
        port = sock.getsockname()[1]
        sock.close()
    try:
        if not sock:
            port = bench.logged_port(log, proc, cmd[0], limit=120)
        bench.wait_http(port, proc, cmd[0], limit=120)
        results = {}
        for mix, headers in mixes.items():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

            def send(k):
                for i in range(k):
                    h = {k2: v.replace("{i}", str(i)) for k2, v in headers.items()}
                    conn.request("GET", "/api/x", headers=h)
                    r = conn.getresponse()
                    r.read()
                    if r.status != 200:
                        raise SystemExit(f"{cmd[0]}: status {r.status}")

            send(200)
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], capture_output=True)
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True)
            send(n)
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True)
            before = set(glob.glob(out + "*"))
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True)
            conn.close()
            deadline = time.time() + 30
            total = None
            while total is None and time.time() < deadline:
                for f in set(glob.glob(out + "*")) - before:
                    with open(f) as fh:
                        for line in fh:
                            if line.startswith("totals:"):
                                total = int(line.split()[1])
                if total is None:
                    time.sleep(0.1)
            if total is None:
                raise SystemExit(f"{cmd[0]}: no callgrind dump")
            results[mix] = total / n
        return results
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graygate", default=os.path.join(bench.REPO, "target", "release", "graygate"))
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--only", help="comma-separated: graygate,nginx-lua,haproxy-lua")
    a = ap.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind not found: apt-get install valgrind")
    mixes = {"untagged": {}, "user-id": {"X-User-Id": "u{i}"}, "x-gray": {"X-Gray": "1"}}
    work = tempfile.mkdtemp(prefix="graygate-instr-")
    backends = bench.start_backends(work)
    try:
        # The regular config writers; the anchors then run in one process
        # (no master) under valgrind, each on a socket bound here.
        def graygate():
            gg = bench.write_graygate_config(work, "graygate", 1)
            return [a.graygate, "--config", gg], None, False

        def nginx():
            sock = bench.listen_socket()
            ng = bench.nginx_lua_conf(work, sock.getsockname()[1])
            with open(ng) as f:
                conf = f.read().replace("master_process on;", "master_process off;")
            with open(ng, "w") as f:
                f.write(conf)
            return ["nginx", "-p", work, "-e", "stderr", "-c", ng], sock, True

        def haproxy():
            sock = bench.listen_socket()
            return ["haproxy", "-db", "-f", bench.haproxy_conf(work, sock.fileno())], sock, False

        targets = {"graygate": graygate, "nginx-lua": nginx, "haproxy-lua": haproxy}
        names = a.only.split(",") if a.only else list(targets)
        rows = {}
        for name in names:
            cmd, sock, is_nginx = targets[name]()
            rows[name] = count(cmd, sock, is_nginx, mixes, a.requests,
                               os.path.join(work, f"cg-{name}.out"))
            print(f"done: {name}", file=sys.stderr, flush=True)
    finally:
        backends.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"User-space instructions per request (callgrind, {a.requests} sequential requests "
          f"on one keep-alive connection per mix)\n")
    print("| target | " + " | ".join(mixes) + " |")
    print("|---|" + "---|" * len(mixes))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[m]:,.0f}" for m in mixes) + " |")


if __name__ == "__main__":
    main()
