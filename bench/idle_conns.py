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

Two ways of opening (`--opening`, both by default, each on a fresh process):
  serial  one connection after the other, each request answered before the
          next connection opens: at most one request in flight;
  burst   every connection's connect sent at once, then the requests of half
          of them written together and their answers read as they come: as
          many requests in flight as the gateway lets in at once, so what a
          burst leaves behind (buffers, upstream connections, allocator
          pages) shows in the RSS that is left once they are idle.

Usage:
  cargo build --release
  python3 bench/idle_conns.py [--conns 10000] [--only graygate,nginx-lua] [--opening burst]
  python3 bench/idle_conns.py --conns 9500 --opening burst   # issue 36's burst figure
  python3 bench/idle_conns.py --conns 9500 --opening burst --pause 1.2   # a connect phase over 1 s
  python3 bench/idle_conns.py --quick --graygate target/debug/graygate   # 200 connections (CI)
"""
import argparse
import json
import os
import resource
import selectors
import shutil
import socket
import sys
import tempfile
import time

import lib

# How long RSS must hold still to count as settled (--quick: shorter).
# Longer than graygate takes to give a burst's memory back: its kept
# buffers and request slots are freed on the first tick a second after the
# burst, their pages purged a second later (mimalloc's purge delay), so RSS
# holds at its burst peak for about 2 s before it falls (a 2 s window
# sometimes read the peak: 2.5 KB per connection instead of 0.8).
SETTLE = {"secs": 4.0}


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
    s.sendall(REQUEST)
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


# Handshakes in flight at once in a burst (below the default SYN backlog).
WAVE = 512
REQUEST = b"GET /api/x HTTP/1.1\r\nHost: bench\r\n\r\n"


def open_serial(port, n):
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2 == 1:
            one_request(s)
        socks.append(s)
    return socks


def open_burst(port, n, limit=120.0, pause=0.0):
    """The connects in waves of at most WAVE handshakes in flight (more
    would overflow the kernel's SYN and accept queues and lose connections
    the client believes open), then the odd ones' requests written together;
    returns once each is connected and every response was read in full.
    `pause` (s): a stop after the first 4000 connects, or half of them if
    fewer (as when the accept queue overflows and the dropped SYNs come
    back a second later)."""
    t0 = time.time()
    sel = selectors.DefaultSelector()
    socks = []
    deadline = time.time() + limit
    pending = 0
    while len(socks) < n or pending:
        while len(socks) < n and pending < WAVE:
            if pause and len(socks) == min(4000, n // 2):
                time.sleep(pause)
                pause = 0.0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(("127.0.0.1", port))
            if err not in (0, 115):  # EINPROGRESS
                raise SystemExit(f"connect: {os.strerror(err)}")
            socks.append(s)
            sel.register(s, selectors.EVENT_WRITE)
            pending += 1
        if time.time() > deadline:
            raise SystemExit(f"burst: {pending} connections not established")
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise SystemExit(f"burst connect: {os.strerror(err)}")
            sel.unregister(s)
            pending -= 1
    t1 = time.time()
    # The requests of half of them, written back to back.
    got = {}
    for i in range(1, n, 2):
        socks[i].sendall(REQUEST)
        got[i] = b""
        sel.register(socks[i], selectors.EVENT_READ, i)
    while got:
        if time.time() > deadline:
            raise SystemExit(f"burst: {len(got)} responses not complete")
        for key, _ in sel.select(timeout=1.0):
            i = key.data
            chunk = key.fileobj.recv(65536)
            if not chunk:
                raise SystemExit("connection closed before its response")
            got[i] += chunk
            if response_done(got[i]):
                sel.unregister(key.fileobj)
                del got[i]
    sel.close()
    for s in socks:
        s.setblocking(True)
    print(f"burst: {n} connected in {t1 - t0:.1f} s, {n // 2} answered {time.time() - t1:.1f} s later",
          file=sys.stderr, flush=True)
    return socks


def response_done(data):
    """True once `data` holds a whole 200 response (head and Content-Length body)."""
    if b"\r\n\r\n" not in data:
        return False
    head, body = data.split(b"\r\n\r\n", 1)
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"unexpected answer: {head[:80]!r}")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(body) >= int(v.strip())
    raise SystemExit("response without Content-Length")


def measure(target, n, opening, pause=0.0):
    pids = target.pids()
    # The worker(s): nginx's master holds no client connection.
    workers = [p for p in pids if p != target.proc.pid] or pids
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", target.port))
        one_request(s)
        s.close()
    base = settle(workers)
    if opening == "burst":
        socks = open_burst(target.port, n, pause=pause)
    else:
        socks = open_serial(target.port, n)
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
    ap.add_argument("--opening", default="serial,burst",
                    help="comma-separated: serial (one after the other), burst (all at once)")
    ap.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                    help="burst: stop this long after the first 4000 connects (half, if fewer)")
    ap.add_argument("--json", help="also write the rows here")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.conns, SETTLE["secs"] = 200, 0.5
    lib.require(("nginx", "nginx-lua"), [a.graygate])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The targets inherit the limit: a client connection each, and in a
    # burst as many upstream connections as requests in flight (half).
    want = a.conns + a.conns // 2 + 1024
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
                conf = f.read().replace("worker_connections 16384;", f"worker_connections {a.conns + a.conns // 2 + 1000};")
                conf = conf.replace("keepalive_timeout 120s;", "keepalive_timeout 600s;")
            with open(path, "w") as f:
                f.write(conf)
            # worker_connections counts upstream connections too (a burst
            # has one per request in flight); fewer, and nginx closes idle
            # client connections to make room.
            return lib.Target("nginx-lua", ["nginx", "-p", work, "-e", "stderr", "-c", path],
                                os.path.join(work, "nginx-lua.log"), cpus=None, socks=[sock], nginx=True)

        targets = {"graygate": graygate, "nginx-lua": nginx}
        for opening in a.opening.split(","):
            if opening not in ("serial", "burst"):
                raise SystemExit(f"--opening: serial or burst, not {opening!r}")
            for name in (a.only.split(",") if a.only else list(targets)):
                t = targets[name]()
                try:
                    rows[(name, opening)] = measure(t, a.conns, opening, a.pause)
                finally:
                    t.stop()
                print(f"done: {name} {opening}", file=sys.stderr, flush=True)
    finally:
        backends.stop()
        shutil.rmtree(work, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"Idle keep-alive connections: {a.conns} (half after one request), one worker each; "
          f"load average {load}\n")
    print("| target | opening | RSS idle MB | RSS with connections MB | KB per connection "
          "| RSS after close MB | after close ÷ idle | connections alive |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, opening), (base, held, after, alive) in rows.items():
        per = (held - base) / a.conns
        print(f"| {name} | {opening} | {base/1024:.1f} | {held/1024:.1f} | {per:.2f} | {after/1024:.1f} "
              f"| {after/base:.2f} | {alive} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"conns": a.conns, "load": load,
                       "rows": [{"target": name, "opening": opening, "rss_idle_kb": base,
                                 "rss_with_conns_kb": held, "kb_per_conn": round((held - base) / a.conns, 3),
                                 "rss_after_close_kb": after, "after_close_ratio": round(after / base, 3),
                                 "alive": alive}
                                for (name, opening), (base, held, after, alive) in rows.items()]},
                      f, indent=1)
    lib.fail_on_errors(sum(a.conns - alive for _, _, _, alive in rows.values()), "connections (closed while idle)")


if __name__ == "__main__":
    sys.exit(main())
