#!/usr/bin/env python3
"""Memory held by slow readers: N clients each request a large static file
and never read it. Reports graygate's RSS before, while they hang (after the
kernel's socket buffers and graygate's own buffers have filled), and after
the send timeout has cut them off. Not a test: a measurement for docs/src/benchmarks/slow-readers.md.

Usage:
  cargo build --release
  python3 bench/slow_readers.py [--clients 1000] [--size-mb 4] [--send-timeout-ms 5000]
  python3 bench/slow_readers.py --quick --graygate target/debug/graygate   # seconds (CI)
Before the slow readers, one client reads the whole file (the run fails
unless it gets every byte).
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import lib


def read_bytes(pid):
    """Bytes the process has read (files and sockets): still growing while
    it is filling its buffers and the kernel's."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def settle(pid, secs=3.0):
    """RSS once it has stopped growing and the process has stopped reading
    for `secs` (sampled every 200 ms; at most a minute)."""
    last, stable_since = (lib.rss_kb([pid]), read_bytes(pid)), time.time()
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.2)
        now = (lib.rss_kb([pid]), read_bytes(pid))
        if abs(now[0] - last[0]) > 256 or now[1] != last[1]:
            last, stable_since = now, time.time()
        elif time.time() - stable_since >= secs:
            return now[0]
    return last[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graygate", "--binary", dest="graygate", default="target/release/graygate",
                    help="the graygate binary (--binary: the older name)")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--size-mb", type=int, default=4)
    ap.add_argument("--send-timeout-ms", type=int, default=5000)
    ap.add_argument("--quick", action="store_true",
                    help="a few seconds, for CI (exits non-zero on errors)")
    a = ap.parse_args()
    settle_secs = 3.0
    if a.quick:
        a.clients, a.size_mb, a.send_timeout_ms, settle_secs = 50, 1, 1000, 0.5
    lib.require(binaries=[a.graygate])
    work = tempfile.mkdtemp(prefix="graygate-slow-")
    os.makedirs(os.path.join(work, "static", "formal"))
    with open(os.path.join(work, "static", "formal", "big.bin"), "wb") as f:
        f.write(os.urandom(a.size_mb << 20))
    cfg = os.path.join(work, "gg.yaml")
    with open(cfg, "w") as f:
        f.write(
            "listen: 127.0.0.1:0\nworkers: 1\n"
            f"client: {{ send_timeout_ms: {a.send_timeout_ms}, max_connections: {a.clients + 100} }}\n"
            "routes:\n  - { prefix: /, static: static }\n"
        )
    # The log goes to a file: a pipe nobody reads once the port is known
    # would fill with the send-timeout warnings and stall the gateway.
    log = os.path.join(work, "graygate.log")
    with open(log, "w") as err:
        proc = subprocess.Popen([a.graygate, "--config", cfg], stderr=err,
                                env=dict(os.environ, RUST_LOG="info"))
    port = None
    deadline = time.time() + 20
    while port is None and time.time() < deadline:
        with open(log) as f:
            for line in f:
                if "graygate listening" in line:
                    port = int(line.split("addr=")[1].split()[0].rsplit(":", 1)[1])
        time.sleep(0.05)
    if port is None:
        proc.kill()
        raise SystemExit(f"graygate did not start:\n{open(log).read()}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/big.bin", timeout=30) as r:
            got = len(r.read())
    except OSError as e:
        proc.kill()
        raise SystemExit(f"slow_readers.py: a full read of /big.bin failed: {e}")
    if got != a.size_mb << 20:
        proc.kill()
        raise SystemExit(f"slow_readers.py: /big.bin gave {got} bytes, not {a.size_mb << 20}")
    base = settle(proc.pid, min(1.0, settle_secs))
    socks = []
    for _ in range(a.clients):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /big.bin HTTP/1.1\r\nHost: a\r\n\r\n")
        socks.append(s)
    held = settle(proc.pid, settle_secs)
    # The send timeout cuts them off; RSS after.
    time.sleep(a.send_timeout_ms / 1000 + 2)
    after = settle(proc.pid, settle_secs)
    for s in socks:
        s.close()
    crashed = proc.poll()
    proc.terminate()
    proc.wait()
    shutil.rmtree(work, ignore_errors=True)
    if crashed is not None:
        raise SystemExit(f"slow_readers.py: graygate exited (code {crashed}) during the run")
    per = (held - base) / a.clients
    print(f"slow readers: {a.clients} x {a.size_mb} MiB static file, send_timeout_ms={a.send_timeout_ms}")
    print(f"RSS idle {base/1024:.1f} MB, with readers hanging {held/1024:.1f} MB "
          f"(+{(held-base)/1024:.1f} MB, {per:.1f} KB each), after the send timeout {after/1024:.1f} MB")


if __name__ == "__main__":
    sys.exit(main())
