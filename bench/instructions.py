#!/usr/bin/env python3
"""User-space instructions per request, counted by valgrind (callgrind).

The wrk figures on a shared 2-vCPU VM swing by 10-20% from run to run; an
instruction count does not. Each gateway runs under `valgrind --tool=callgrind`
with instrumentation off; after 200 warm-up requests instrumentation is
switched on, N requests are sent one after another on one keep-alive
connection (for each load mix), and the gateway's total instruction count is
divided by N. Kernel work (the sockets) is not counted: this is the part of
the CPU cost each gateway's own code decides.

No fixed ports: graygate listens on port 0 (its logged address is read back),
HAProxy on a socket bound here and inherited, nginx (one process, as
callgrind needs) on a unix socket.

Usage:
  cargo build --release
  python3 bench/instructions.py                       # graygate, nginx+lua, HAProxy+Lua
  python3 bench/instructions.py --graygate /tmp/gg-old --only graygate   # A/B a change
  python3 bench/instructions.py --script openresty_heavy   # an OpenResty module, unchanged
                                                           # in graygate and nginx+lua
  python3 bench/instructions.py --interp              # adds graygate-interp: script_limits.jit: false
                                                      # (graygate itself runs the default, jit: auto)
  python3 bench/instructions.py --otel --only graygate   # adds graygate-otel (otel: baggage and
                                                      # trace context, no span export) and
                                                      # graygate-otel-export (spans to a local OTLP sink)
  python3 bench/instructions.py --quick --graygate target/debug/graygate   # 20 requests (CI)
With --script NAME, graygate runs bench/NAME.lua as its script and nginx runs
`access_by_lua_block { ngx.var.lane = require("NAME").lane() or "formal" }`
(as bench/openresty_lib.py does); HAProxy has no such script and is left out.
nginx's peer is "unix:" there, so a script's client-address checks take the
not-in-range branch in nginx and the 127.0.0.1 one in graygate.
"""
import argparse
import glob
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import lib


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (nginx under valgrind, see main())."""

    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def wait_unix(path, proc, what, limit):
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early (code {proc.returncode})")
        try:
            c = UnixHTTPConnection(path, 1)
            c.request("GET", "/")
            c.getresponse().read()
            c.close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not answer on {path}")


def count(cmd, sock, unix, mixes, n, out, port=None, warmup=200):
    """`sock`: the listening socket the target inherits; `unix`: the unix
    socket it listens on; `port`: a loopback port it binds itself; none:
    graygate on port 0, its logged address read back."""
    for f in glob.glob(out + "*"):
        os.remove(f)
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = dict(os.environ, RUST_LOG=lib.GRAYGATE_LOG)
    fds = (sock.fileno(),) if sock else ()
    log = out + ".log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(vg + cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, pass_fds=fds)
    if sock:
        port = sock.getsockname()[1]
        sock.close()
    try:
        if unix:
            wait_unix(unix, proc, cmd[0], limit=120)
        else:
            if port is None:
                port = lib.logged_port(log, proc, cmd[0], limit=120)
            lib.wait_http(port, proc, cmd[0], limit=120)
        pid = proc.pid
        results = {}
        for mix, headers in mixes.items():
            conn = (UnixHTTPConnection(unix, 60) if unix
                    else http.client.HTTPConnection("127.0.0.1", port, timeout=60))

            def send(k):
                for i in range(k):
                    h = {k2: v.replace("{i}", str(i)) for k2, v in headers.items()}
                    conn.request("GET", "/api/x", headers=h)
                    r = conn.getresponse()
                    r.read()
                    if r.status != 200:
                        raise SystemExit(f"{cmd[0]}: status {r.status}")

            send(warmup)
            subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True)
            subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True)
            send(n)
            subprocess.run(["callgrind_control", "-i", "off", str(pid)], capture_output=True)
            before = set(glob.glob(out + "*"))
            subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True)
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


def otlp_sink():
    """An OTLP/HTTP endpoint in this process that takes every export (an
    empty ExportTraceServiceResponse, 200); returns its port."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Sink(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv.server_address[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--only", help="comma-separated: graygate,nginx-lua,haproxy-lua")
    ap.add_argument("--script", help="an OpenResty module in bench/ (e.g. openresty_heavy) "
                                     "run unchanged by graygate and nginx+lua")
    ap.add_argument("--interp", action="store_true",
                    help="also graygate-interp: the same build with script_limits.jit: false "
                         "(graygate runs the shipped default, jit: auto: the compiler where it can run)")
    ap.add_argument("--otel", action="store_true",
                    help="also graygate-otel (otel: on, no export) and graygate-otel-export "
                         "(every span exported over OTLP/HTTP to a sink in this process)")
    lib.add_quick(ap)
    a = ap.parse_args()
    warmup = 200
    if a.quick:
        a.requests, warmup = 20, 20
    lib.require(("valgrind", "callgrind_control", "nginx", "nginx-lua", "haproxy"), [a.graygate])
    mixes = {"untagged": {}, "user-id": {"X-User-Id": "u{i}"}, "x-gray": {"X-Gray": "1"}}
    work = tempfile.mkdtemp(prefix="graygate-instr-")
    backends = lib.start_backends(work)
    try:
        # The regular config writers; each target runs under valgrind in one
        # process. graygate listens on port 0, HAProxy on a socket bound
        # here; nginx on a unix socket (nginx 1.22 crashes on an inherited
        # socket without a master, and a master's forked worker is not
        # reachable by callgrind_control). User-space work per request is
        # the same but for the peer address, which is "unix:" (formal).
        # With --script, nginx binds a loopback TCP port itself (found free
        # just before; no inherited socket): an OpenResty script reads
        # ngx.var.remote_addr, which must be an address as in graygate.
        def graygate(jit=None, otel=None):
            """`jit`: None leaves script_limits.jit at its default (auto).
            `otel`: "on" (baggage, trace context, no export) or "export"."""
            kw = {"script": os.path.join(lib.BENCH, f"{a.script}.lua")} if a.script else {}
            name = {None: "graygate", False: "graygate-interp", True: "graygate-jit"}[jit]
            if otel:
                name = {"on": "graygate-otel", "export": "graygate-otel-export"}[otel]
            gg = lib.write_graygate_config(work, name, 1, **kw)
            if jit is not None:
                with open(gg, "a") as f:
                    f.write(f"script_limits:\n  jit: {str(jit).lower()}\n")
            if otel:
                with open(gg, "a") as f:
                    f.write("otel:\n  service_name: graygate-bench\n")
                    if otel == "export":
                        f.write(f"  traces:\n    endpoint: http://127.0.0.1:{otlp_sink()}/v1/traces\n"
                                "    flush_interval_ms: 200\n")
            return [a.graygate, "--config", gg], None, None, None

        def nginx():
            if a.script:
                probe = lib.listen_socket()
                port = probe.getsockname()[1]
                probe.close()
                listen = f"listen 127.0.0.1:{port} backlog=8192;"
            else:
                port = None
                unix = os.path.join(work, "nginx-lua.sock")
                listen = f"listen unix:{unix} backlog=8192;"
            access = (f"access_by_lua_block {{ ngx.var.lane = require(\"{a.script}\").lane()"
                      f" or \"formal\" }}") if a.script else None
            ng = lib.nginx_lua_conf(work, 1, access=access)
            with open(ng) as f:
                conf = f.read().replace("master_process on;", "master_process off;")
                conf = conf.replace("listen 127.0.0.1:1 backlog=8192;", listen)
            with open(ng, "w") as f:
                f.write(conf)
            return ["nginx", "-p", work, "-e", "stderr", "-c", ng], None, (None if port else unix), port

        def haproxy():
            sock = lib.listen_socket()
            return ["haproxy", "-db", "-f", lib.haproxy_conf(work, sock.fileno())], sock, None, None

        targets = {"graygate": graygate, "graygate-interp": lambda: graygate(jit=False),
                   "graygate-otel": lambda: graygate(otel="on"),
                   "graygate-otel-export": lambda: graygate(otel="export"),
                   "graygate-jit": lambda: graygate(jit=True),
                   "nginx-lua": nginx, "haproxy-lua": haproxy}
        if a.script:
            del targets["haproxy-lua"]
        extra = ("graygate-interp", "graygate-jit", "graygate-otel", "graygate-otel-export")
        names = a.only.split(",") if a.only else [t for t in targets if t not in extra]
        if a.otel:
            at = names.index("graygate") + 1 if "graygate" in names else 0
            names[at:at] = [n for n in ("graygate-otel", "graygate-otel-export") if n not in names]
        if a.interp and "graygate-interp" not in names:
            names.insert(names.index("graygate") + 1 if "graygate" in names else 0, "graygate-interp")
        rows = {}
        for name in names:
            cmd, sock, unix, port = targets[name]()
            rows[name] = count(cmd, sock, unix, mixes, a.requests,
                               os.path.join(work, f"cg-{name}.out"), port=port, warmup=warmup)
            print(f"done: {name}", file=sys.stderr, flush=True)
    finally:
        backends.stop()
        shutil.rmtree(work, ignore_errors=True)
    script = f", script bench/{a.script}.lua" if a.script else ""
    print(f"User-space instructions per request (callgrind, {a.requests} sequential requests "
          f"on one keep-alive connection per mix{script})\n")
    print("| target | " + " | ".join(mixes) + " |")
    print("|---|" + "---|" * len(mixes))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[m]:,.0f}" for m in mixes) + " |")


if __name__ == "__main__":
    main()
