#!/usr/bin/env python3
"""Side-by-side benchmark: graygate vs nginx+lua vs HAProxy+Lua doing the same
gray-release job on loopback.

Each gateway runs ONE worker pinned to CPU 1; the two backends (an nginx
serving fixed JSON for the formal and the gray lane) and wrk run on CPU 0
(pinning needs two CPUs and is off with --quick or --no-pin). Every listener
is on an ephemeral port: nginx and HAProxy get a socket this script bound
(inherited, never released and re-bound), graygate listens on port 0 and its
logged address is read back.
Decision for all three: client IP in 127.0.9.0/24 -> gray, `X-Gray: 1` -> gray,
10% of `X-User-Id` (MurmurHash3 bucket < 10) -> gray, else formal; the lane goes
upstream in X-Gray-Tag.

Usage:
  python3 bench/bench.py                 # full run (minutes)
  python3 bench/bench.py --quick         # a few seconds: the harness smoke test
  python3 bench/bench.py --graygate target/release/graygate --duration 10 --rounds 3
Prints a markdown table: median req/s, p50, p99, errors, gateway CPU time per
request (user+sys from /proc over the run / requests), peak RSS, ratios to the
best anchor.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
# The backends' ports, set by start_backends().
BACKEND_PORTS = {}
# Pin processes to CPUs (see main()); off unless asked for and possible.
PIN = {"on": False}
CLK = os.sysconf("SC_CLK_TCK")
MIXES = {
    "untagged": [],
    "user-id": ["-s", os.path.join(BENCH, "wrk_uid.lua")],
    "x-gray": ["-H", "X-Gray: 1"],
}
ANCHORS = ("nginx-lua", "haproxy-lua")


def murmur3(data: bytes) -> int:
    """MurmurHash3 x86 32-bit, seed 0, as a signed 32-bit int."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h, n = 0, len(data)
    rol = lambda x, r: ((x << r) | (x >> (32 - r))) & m
    for i in range(0, n - n % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (rol((k * c1) & m, 15) * c2) & m
        h = (rol(h ^ k, 13) * 5 + 0xE6546B64) & m
    tail = data[n - n % 4:]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= (rol((k * c1) & m, 15) * c2) & m
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


def bucket(s: str) -> int:
    return murmur3(s.encode()) % 100


# ---------------------------------------------------------------- processes

def listen_socket():
    """A listening socket on an ephemeral loopback port, to hand to a child."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8192)
    return s


def wait_http(port, proc, what, limit=20.0):
    """Waits until the process answers HTTP on the port (any status)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early (code {proc.returncode}); see its log in the work dir")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{what} did not answer on {port}")


def logged_port(log, proc, what, limit=20.0):
    """The port graygate logs it listens on ("graygate listening … addr=…")."""
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early (code {proc.returncode}); see its log in the work dir")
        with open(log, errors="replace") as f:
            for line in f:
                if "graygate listening" in line:
                    m = re.search(r"addr=127\.0\.0\.1:(\d+)", line)
                    if m:
                        return int(m.group(1))
        time.sleep(0.05)
    raise SystemExit(f"{what} logged no listening address")


def preexec(cpus):
    """New session, and (when pinning) the given CPUs."""
    def f():
        os.setsid()
        if PIN["on"] and cpus is not None:
            os.sched_setaffinity(0, cpus)
    return f


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d))
            except OSError:
                pass
    return out


def cpu_ticks(pids):
    """(user, system) clock ticks of the processes."""
    user = system = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user += int(fields[11])
            system += int(fields[12])
        except OSError:
            pass
    return user, system


def machine_busy_ticks():
    """Busy clock ticks of the whole machine (every CPU, /proc/stat: all but
    idle and iowait) -- the client and the kernel's softirq work included."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]


def peak_rss_kb(pids):
    best = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        best = max(best, int(line.split()[1]))
        except OSError:
            pass
    return best


class Target:
    """A gateway or backend process. `socks` are listening sockets it
    inherits (for nginx also named in $NGINX); without them it listens on
    port 0 and logs the address (graygate)."""

    def __init__(self, name, cmd, log, cpus=frozenset({1}), env=None, socks=(), nginx=False):
        self.name = name
        self.log = open(log, "w")
        env = dict(env if env is not None else os.environ)
        fds = tuple(s.fileno() for s in socks)
        self.ports = [s.getsockname()[1] for s in socks]
        if nginx and fds:
            env["NGINX"] = "".join(f"{fd};" for fd in fds)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     pass_fds=fds, preexec_fn=preexec(cpus))
        for s in socks:
            s.close()  # the child holds its own copy
        try:
            self.port = self.ports[0] if self.ports else logged_port(log, self.proc, name)
            for port in self.ports or [self.port]:
                wait_http(port, self.proc, name)
        except SystemExit:
            self.log.close()
            with open(log) as f:
                sys.stderr.write(f.read())
            self.stop()
            raise

    def pids(self):
        return [self.proc.pid] + children(self.proc.pid)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()


def nginx_common(work, name):
    tmp = os.path.join(work, f"{name}-tmp")
    os.makedirs(tmp, exist_ok=True)
    return f"""
worker_processes 1;
daemon off;
master_process on;
pid {work}/{name}.pid;
error_log {work}/{name}-error.log warn;
events {{ worker_connections 16384; }}
""", f"""
    access_log off;
    client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp};
    uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
    keepalive_requests 100000000;
    keepalive_timeout 120s;
"""


def start_backends(work):
    """The formal and gray backends (one nginx); their ports go to BACKEND_PORTS."""
    formal, gray = listen_socket(), listen_socket()
    BACKEND_PORTS["formal"] = formal.getsockname()[1]
    BACKEND_PORTS["gray"] = gray.getsockname()[1]
    main, http = nginx_common(work, "backends")
    conf = main + f"""
http {{
{http}
    default_type application/json;
    server {{ listen 127.0.0.1:{BACKEND_PORTS['formal']} backlog=8192;
             location / {{ return 200 '{{"lane":"formal","tag":"$http_x_gray_tag"}}'; }} }}
    server {{ listen 127.0.0.1:{BACKEND_PORTS['gray']} backlog=8192;
             location / {{ return 200 '{{"lane":"gray","tag":"$http_x_gray_tag"}}'; }} }}
}}
"""
    path = os.path.join(work, "backends.conf")
    with open(path, "w") as f:
        f.write(conf)
    return Target("backends", ["nginx", "-p", work, "-e", "stderr", "-c", path],
                  os.path.join(work, "backends.log"), cpus={0}, socks=[formal, gray], nginx=True)


def nginx_lua_conf(work, port, name="nginx-lua", access=None):
    """Writes the nginx+lua gateway's config for `port`; returns its path.
    `access` replaces the access phase directive (default: bench/nginx_gray.lua)."""
    main, http = nginx_common(work, name)
    access = access or f"access_by_lua_file {BENCH}/nginx_gray.lua;"
    conf = """
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
""" + main + f"""
http {{
{http}
    lua_package_path "{BENCH}/?.lua;;";
    upstream formal {{ server 127.0.0.1:{BACKEND_PORTS['formal']}; keepalive 1024; keepalive_requests 100000000; }}
    upstream gray   {{ server 127.0.0.1:{BACKEND_PORTS['gray']}; keepalive 1024; keepalive_requests 100000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=8192;
        location / {{
            set $lane formal;
            {access}
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Gray-Tag $lane;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_pass http://$lane;
        }}
    }}
}}
"""
    path = os.path.join(work, f"{name}.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def start_nginx(work, name="nginx-lua", access=None):
    sock = listen_socket()
    path = nginx_lua_conf(work, sock.getsockname()[1], name=name, access=access)
    return Target(name, ["nginx", "-p", work, "-e", "stderr", "-c", path],
                  os.path.join(work, f"{name}.log"), socks=[sock], nginx=True)


def haproxy_conf(work, fd):
    """Writes the HAProxy+Lua config listening on inherited socket `fd`."""
    conf = f"""
global
    nbthread 1
    maxconn 8000
    lua-load {BENCH}/haproxy_gray.lua
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    option http-keep-alive
    http-reuse always
frontend fe
    bind fd@{fd}
    http-request set-var(txn.lane) lua.gray_lane
    http-request set-header X-Gray-Tag %[var(txn.lane)]
    http-request set-header X-Forwarded-Proto http
    http-request set-header X-Forwarded-Host %[req.hdr(host)]
    option forwardfor
    use_backend gray if {{ var(txn.lane) -m str gray }}
    default_backend formal
backend formal
    server f1 127.0.0.1:{BACKEND_PORTS['formal']}
backend gray
    server g1 127.0.0.1:{BACKEND_PORTS['gray']}
"""
    path = os.path.join(work, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(conf)
    return path


def start_haproxy(work):
    sock = listen_socket()
    path = haproxy_conf(work, sock.fileno())
    return Target("haproxy-lua", ["haproxy", "-db", "-f", path], os.path.join(work, "haproxy.log"),
                  socks=[sock])


def write_graygate_config(work, name, workers, list_entries=1, nodes_per_lane=1,
                          script="scripts/gray.lua"):
    """graygate's config (listening on port 0: the address is logged)."""
    lst = os.path.join(work, f"{name}-ips.txt")
    with open(lst, "w") as f:
        f.write("127.0.9.0/24\n")
        for i in range(list_entries - 1):
            f.write(f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}\n")
    nodes = os.path.join(work, f"{name}-nodes.yaml")
    with open(nodes, "w") as f:
        f.write("services:\n  api:\n    nodes:\n")
        for i in range(nodes_per_lane):
            f.write(f"      - {{ name: f{i}, addr: \"127.0.0.1:{BACKEND_PORTS['formal']}\", lane: formal }}\n")
            f.write(f"      - {{ name: g{i}, addr: \"127.0.0.1:{BACKEND_PORTS['gray']}\", lane: gray }}\n")
    cfg = os.path.join(work, f"{name}.yaml")
    with open(cfg, "w") as f:
        f.write(f"""listen: 127.0.0.1:0
workers: {workers}
root: {REPO}
script: {script}
lists:
  gray_ips: {lst}
node_files: [{nodes}]
routes:
  - prefix: /
    service: api
""")
    return cfg


# Warnings, plus graygate's start-up lines (the listening address).
GRAYGATE_LOG = "warn,graygate=info"


def start_graygate(work, binary, name="graygate", workers=1, cpus=frozenset({1}), **kw):
    cfg = write_graygate_config(work, name, workers, **kw)
    env = dict(os.environ, RUST_LOG=GRAYGATE_LOG)
    return Target(name, [binary, "--config", cfg], os.path.join(work, f"{name}.log"),
                  cpus=cpus, env=env)


# ---------------------------------------------------------------- checks

def fetch(port, headers):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/x", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def sanity_check(target):
    gray_uid = next(str(i) for i in range(1000) if bucket(str(i)) < 10)
    formal_uid = next(str(i) for i in range(1000) if bucket(str(i)) >= 10)
    cases = [({}, "formal"), ({"X-Gray": "1"}, "gray"), ({"X-User-Id": gray_uid}, "gray"),
             ({"X-User-Id": formal_uid}, "formal"), ({"X-Gray-Tag": "gray"}, "formal")]
    for headers, want in cases:
        got = fetch(target.port, headers)
        if got.get("lane") != want or got.get("tag") != want:
            raise SystemExit(f"{target.name}: {headers} -> {got}, expected lane and tag {want}")


# ---------------------------------------------------------------- wrk

def to_ms(s):
    m = re.match(r"([\d.]+)(us|ms|s)", s)
    v, unit = float(m.group(1)), m.group(2)
    return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v


def run_wrk(port, mix, conns, duration, path="/api/x", args=None):
    """wrk on CPU 0 against `path` with the mix's arguments (or `args`)."""
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency",
           "--timeout", "5s"] + (MIXES[mix] if args is None else args) + [f"http://127.0.0.1:{port}{path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         preexec_fn=preexec({0})).stdout
    res = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
           "requests": int(re.search(r"(\d+) requests in", out).group(1))}
    for pct in ("50", "99"):
        res[f"p{pct}"] = to_ms(re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M).group(1))
    errors = 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errors += int(m.group(1))
    res["errors"] = errors
    return res


def measure(target, mix, conns, duration, **wrk):
    """One wrk run, with the target's CPU time (user+sys) per request."""
    pids = target.pids()
    u0, s0 = cpu_ticks(pids)
    m0 = machine_busy_ticks()
    r = run_wrk(target.port, mix, conns, duration, **wrk)
    m1 = machine_busy_ticks()
    u1, s1 = cpu_ticks(pids)
    per_req = lambda ticks: ticks / CLK * 1e6 / max(r["requests"], 1)
    r["user_us"], r["sys_us"] = per_req(u1 - u0), per_req(s1 - s0)
    r["machine_us"] = per_req(m1 - m0)
    r["cpu_us"] = r["user_us"] + r["sys_us"]
    r["rss_mb"] = peak_rss_kb(pids) / 1024
    return r


def summarize(runs):
    med = lambda k: statistics.median(r[k] for r in runs)
    return {"rps": med("rps"), "p50": med("p50"), "p99": med("p99"), "cpu_us": med("cpu_us"),
            "user_us": med("user_us"), "sys_us": med("sys_us"), "machine_us": med("machine_us"),
            "errors": sum(r["errors"] for r in runs), "rss_mb": max(r["rss_mb"] for r in runs)}


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


def stop_all(started, work):
    """Stops every started target and removes the work directory."""
    for t in started:
        t.stop()
    shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graygate", default=os.path.join(REPO, "target", "release", "graygate"))
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", default="32,256")
    ap.add_argument("--mixes", default="untagged,user-id,x-gray")
    ap.add_argument("--quick", action="store_true", help="a few seconds, for the test suite (no pinning)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--json", help="also write results here")
    a = ap.parse_args()
    if a.quick:
        a.duration, a.rounds, a.conns = 1, 1, "32"
    for tool in ("nginx", "haproxy", "wrk"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found: apt-get install nginx-core libnginx-mod-http-lua haproxy wrk")
    # Pinning needs CPUs 0 and 1; the quick mode (the test suite) never pins.
    PIN["on"] = not (a.quick or a.no_pin) and {0, 1} <= os.sched_getaffinity(0)
    if not os.path.exists(a.graygate):
        raise SystemExit(f"{a.graygate} not found: cargo build --release")
    dur = max(1, int(a.duration))
    conns = [int(c) for c in a.conns.split(",")]
    mixes = a.mixes.split(",")
    work = tempfile.mkdtemp(prefix="graygate-bench-")
    started = []
    try:
        started.append(start_backends(work))
        targets = []
        starters = [lambda: start_graygate(work, a.graygate), lambda: start_nginx(work),
                    lambda: start_haproxy(work)]
        if not a.quick:
            starters.append(lambda: start_graygate(work, a.graygate, name="graygate-2w", workers=2,
                                                   cpus={0, 1}))
        for start in starters:
            targets.append(start())
            started.append(targets[-1])
        for t in targets:
            sanity_check(t)
        names = [t.name for t in targets]
        results = {}
        for mix in mixes:
            for c in conns:
                runs = {t.name: [] for t in targets}
                for rnd in range(a.rounds):
                    order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                    for t in order:
                        runs[t.name].append(measure(t, mix, c, dur))
                results[(mix, c)] = {n: summarize(r) for n, r in runs.items()}
                print(f"done: {mix} @ {c}", file=sys.stderr, flush=True)
        for t in targets:
            t.stop()
            started.remove(t)
        print("## graygate vs nginx+lua vs HAProxy+Lua\n")
        pinning = ("gateways pinned to CPU 1, backends and wrk to CPU 0 (graygate-2w: 2 workers on CPUs 0,1)"
                   if PIN["on"] else "nothing pinned")
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
                t = start_graygate(work, a.graygate, name=name, **kw)
                started.append(t)
                sanity_check(t)
                scale_targets.append((kind, n, t))
            scale_runs = {t.name: [] for _, _, t in scale_targets}
            for rnd in range(a.rounds):
                order = scale_targets[rnd % len(scale_targets):] + scale_targets[:rnd % len(scale_targets)]
                for _, _, t in order:
                    scale_runs[t.name].append(measure(t, "untagged", conns[0], dur))
            for kind, n, t in scale_targets:
                t.stop()
                started.remove(t)
                scaling.append((kind, n, summarize(scale_runs[t.name])))
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
        stop_all(started, work)


if __name__ == "__main__":
    main()
