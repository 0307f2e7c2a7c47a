#!/usr/bin/env python3
"""Memory held by idle keep-alive client connections: graygate vs nginx+lua,
one worker each, the same gray job as bench/lib.py.

For each target: RSS of its worker once it has served a few requests (the
idle baseline), then N connections are opened and left idle — half of them
only connected, half after one served request on them (keep-alive) — and
RSS is read once it stops growing; then every connection is closed and RSS
is read again once it settles. Reported: RSS added per idle connection, and
RSS after the close as a multiple of the idle baseline. Not a test: a
measurement for docs/src/benchmarks/idle-connections.md (RSS of a process cannot be asserted on a shared
machine).

Usage:
  cargo build --release
  python3 bench/idle_conns.py [--conns 10000] [--only graygate,nginx-lua]
  python3 bench/idle_conns.py --quick --graygate target/debug/graygate   # 200 connections (CI)
"""
import argparse
import os
import resource
import shutil
import socket
import sys
import tempfile
import time

import lib

# How long RSS must hold still to count as settled (--quick: shorter).
SETTLE = {"secs": 2.0}


def settle(pids, secs=None, limit=60.0):
    """RSS once it has not moved by more than 64 KB for `secs` (sampled every 100 ms)."""
    secs = SETTLE["secs"] if secs is None else secs
    last, stable_since = lib.rss_kb(pids), time.time()
    deadline = time.time() + limit
    while time.time() < deadline:
        time.sleep(0.1)
        now = lib.rss_kb(pids)
        if abs(now - last) > 64:
            last, stable_since = now, time.time()
        elif time.time() - stable_since >= secs:
            return now
    return last


def one_request(s):
    """One keep-alive request on `s`; reads the whole response."""
    s.sendall(b"GET /api/x HTTP/1.1\r\nHost: bench\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise SystemExit("connection closed before the response head")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"unexpected answer: {head[:80]!r}")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            raise SystemExit("connection closed mid-body")
        body += chunk


def measure(target, n):
    pids = target.pids()
    # The worker(s): nginx's master holds no client connection.
    workers = [p for p in pids if p != target.proc.pid] or pids
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", target.port))
        one_request(s)
        s.close()
    base = settle(workers)
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", target.port))
        if i % 2 == 1:
            one_request(s)
        socks.append(s)
    held = settle(workers)
    # Every connection still open (none closed by an idle timeout meanwhile).
    alive = 0
    for s in socks:
        s.setblocking(False)
        try:
            alive += s.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    for s in socks:
        s.close()
    after = settle(workers, secs=SETTLE["secs"] * 1.5)
    return base, held, after, alive


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conns", type=int, default=10000)
    ap.add_argument("--only", help="comma-separated: graygate,nginx-lua")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.conns, SETTLE["secs"] = 200, 0.5
    lib.require(("nginx", "nginx-lua"), [a.graygate])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = a.conns + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            raise SystemExit(f"RLIMIT_NOFILE hard limit {hard} < {want}: raise it (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    work = tempfile.mkdtemp(prefix="graygate-idle-")
    backends = lib.start_backends(work)
    rows = {}
    try:
        def graygate():
            cfg = lib.write_graygate_config(work, "graygate", 1)
            with open(cfg, "a") as f:
                # Room for every connection; nothing times out during the run.
                f.write(f"client: {{ max_connections: {a.conns + 1000}, idle_timeout_ms: 600000 }}\n")
            env = dict(os.environ, RUST_LOG=lib.GRAYGATE_LOG)
            return lib.Target("graygate", [a.graygate, "--config", cfg],
                                os.path.join(work, "graygate.log"), cpus=None, env=env)

        def nginx():
            sock = lib.listen_socket()
            path = lib.nginx_lua_conf(work, sock.getsockname()[1])
            with open(path) as f:
                conf = f.read().replace("worker_connections 16384;", f"worker_connections {a.conns + 1000};")
                conf = conf.replace("keepalive_timeout 120s;", "keepalive_timeout 600s;")
            with open(path, "w") as f:
                f.write(conf)
            return lib.Target("nginx-lua", ["nginx", "-p", work, "-e", "stderr", "-c", path],
                                os.path.join(work, "nginx-lua.log"), cpus=None, socks=[sock], nginx=True)

        targets = {"graygate": graygate, "nginx-lua": nginx}
        for name in (a.only.split(",") if a.only else list(targets)):
            t = targets[name]()
            try:
                rows[name] = measure(t, a.conns)
            finally:
                t.stop()
            print(f"done: {name}", file=sys.stderr, flush=True)
    finally:
        backends.stop()
        shutil.rmtree(work, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"Idle keep-alive connections: {a.conns} (half after one request), one worker each; "
          f"load average {load}\n")
    print("| target | RSS idle MB | RSS with connections MB | KB per connection | RSS after close MB "
          "| after close ÷ idle | connections alive |")
    print("|---|---|---|---|---|---|---|")
    for name, (base, held, after, alive) in rows.items():
        per = (held - base) / a.conns
        print(f"| {name} | {base/1024:.1f} | {held/1024:.1f} | {per:.2f} | {after/1024:.1f} "
              f"| {after/base:.2f} | {alive} |")
    lib.fail_on_errors(sum(a.conns - alive for _, _, _, alive in rows.values()), "connections (closed while idle)")


if __name__ == "__main__":
    sys.exit(main())
