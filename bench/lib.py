"""The shared library of the bench/ scripts: processes on ephemeral ports,
the gray job's backends and gateways (graygate, nginx+lua, HAProxy+Lua), wrk
runs and CPU accounting from /proc, static file trees, an etcd on loopback,
and the checks every script makes before it measures.

Not a script: each bench/*.py imports it (`import lib`; a script's own
folder is first on its module path). Every listener is on an ephemeral
port: nginx and HAProxy get a socket bound here (inherited, never released
and re-bound), graygate listens on port 0 and its logged address is read
back. The gray job everywhere: client IP in 127.0.9.0/24 -> gray,
`X-Gray: 1` -> gray, 10% of `X-User-Id` (MurmurHash3 bucket < 10) -> gray,
else formal; the lane goes upstream in X-Gray-Tag.
"""

import base64
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

# bench/ and the repository.
BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
# The backends' ports, set by start_backends().
BACKEND_PORTS = {}
# Pin processes to CPUs (see main()); off unless asked for and possible.
PIN = {"on": False}
CLK = os.sysconf("SC_CLK_TCK")
# The load mixes: wrk's extra arguments for each.
MIXES = {
    "untagged": [],
    "user-id": ["-s", os.path.join(BENCH, "wrk_uid.lua")],
    "x-gray": ["-H", "X-Gray: 1"],
}
# The OpenResty module scripts of bench/, run unchanged by nginx+lua and graygate.
OPENRESTY_SCRIPTS = {"simple": "openresty_simple", "heavy": "openresty_heavy"}


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


# ---------------------------------------------------------------- prerequisites

# What each tool a script may need is installed with (Debian packages).
TOOL_HINTS = {
    "nginx": "apt-get install nginx-core libnginx-mod-http-lua",
    "haproxy": "apt-get install haproxy",
    "wrk": "apt-get install wrk",
    "h2load": "apt-get install nghttp2-client",
    "openssl": "apt-get install openssl",
    "curl": "apt-get install curl",
    "taskset": "apt-get install util-linux",
    "etcd": "apt-get install etcd-server",
    "valgrind": "apt-get install valgrind",
    "callgrind_control": "apt-get install valgrind",
    "cargo": "the Rust toolchain (rustup)",
    "rustc": "the Rust toolchain (rustup)",
}
NGINX_LUA_MODULE = "/usr/lib/nginx/modules/ngx_http_lua_module.so"


def missing_tools(tools):
    """One line per tool of `tools` not on PATH ("X not found: how to get it");
    "nginx-lua" stands for nginx's Lua module."""
    out = []
    for t in tools:
        if t == "nginx-lua":
            if not os.path.exists(NGINX_LUA_MODULE):
                out.append(f"{NGINX_LUA_MODULE} not found: apt-get install libnginx-mod-http-lua")
        elif not shutil.which(t):
            out.append(f"{t} not found: {TOOL_HINTS.get(t, 'install it')}")
    return out


def require(tools=(), binaries=(), more=()):
    """Exits with one message naming every missing prerequisite: tools on
    PATH, graygate binaries, and `more` (lines of the caller's own checks)."""
    missing = missing_tools(tools) + list(more)
    for b in binaries:
        if not os.path.exists(b):
            missing.append(f"{b} not found: cargo build --release (or --graygate PATH)")
    if missing:
        name = os.path.basename(sys.argv[0])
        raise SystemExit(f"{name}: missing prerequisites:\n  " + "\n  ".join(missing))


def fail_on_errors(errors, what="requests"):
    """Exits non-zero when a run had errors (a quick mode's one check)."""
    if errors:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {errors} failed {what}")


def add_quick(ap, graygate=True):
    """The options every script has: --quick (seconds, for CI: figures printed,
    never asserted; non-zero exit on errors) and --graygate PATH."""
    ap.add_argument("--quick", action="store_true",
                    help="a few seconds, for CI (nothing pinned; exits non-zero on errors)")
    if graygate:
        ap.add_argument("--graygate", default=os.path.join(REPO, "target", "release", "graygate"),
                        help="the graygate binary (a debug build works for --quick)")


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


def free_port():
    """A free loopback port (bound and released: only for programs that
    cannot take an inherited socket, such as etcd)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


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


def status_kb(pid, field):
    """A `kB` field of /proc/PID/status (VmRSS, VmHWM, ...); 0 once the
    process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb(pids):
    """Current RSS of the processes, summed."""
    return sum(status_kb(p, "VmRSS") for p in pids)


def peak_rss_kb(pids):
    """The largest peak RSS among the processes."""
    return max((status_kb(p, "VmHWM") for p in pids), default=0)


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


def nginx_lua_conf(work, port, name="nginx-lua", access=None, listen_opts="", server_extra=""):
    """Writes the nginx+lua gateway's config for `port`; returns its path.
    `access` replaces the access phase directive (default: bench/nginx_gray.lua);
    `listen_opts` (e.g. "ssl http2") and `server_extra` (directives of the
    server block, e.g. the certificate) serve the TLS benchmark."""
    main, http = nginx_common(work, name)
    access = access or f"access_by_lua_file {BENCH}/nginx_gray.lua;"
    opts = f" {listen_opts}" if listen_opts else ""
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
        listen 127.0.0.1:{port}{opts} backlog=8192;
{server_extra}
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


def start_graygate(work, binary, name="graygate", workers=1, cpus=frozenset({1}), jit=None, **kw):
    """graygate with `write_graygate_config`'s config (`kw` goes there);
    `jit`: `script_limits.jit` true or false (None: the default, auto)."""
    cfg = write_graygate_config(work, name, workers, **kw)
    if jit is not None:
        with open(cfg, "a") as f:
            f.write(f"script_limits:\n  jit: {str(jit).lower()}\n")
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


# ---------------------------------------------------------------- load (wrk)

def to_ms(s):
    m = re.match(r"([\d.]+)(us|ms|s)", s)
    v, unit = float(m.group(1)), m.group(2)
    return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v


def wrk_errors(out):
    """Socket errors and non-2xx/3xx responses in wrk's output."""
    errors = 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errors += int(m.group(1))
    return errors


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
    res["errors"] = wrk_errors(out)
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


def stop_all(started, work):
    """Stops every started target and removes the work directory."""
    for t in started:
        t.stop()
    shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- static files

# File sizes of the static benchmarks, and the two trees a file comes from.
STATIC_SIZES = {"2k": 2 * 1024, "100k": 100 * 1024, "1m": 1024 * 1024}
STATIC_TREES = ("lane", "fallback")


def make_static_tree(work, sizes):
    """static/{formal,gray}/own/<size>.bin and static/formal/fb/<size>.bin;
    gray's own files differ from formal's (first byte)."""
    root = os.path.join(work, "static")
    for size, n in sizes.items():
        data = bytearray(os.urandom(n))
        for rel in (f"formal/own/{size}.bin", f"formal/fb/{size}.bin", f"gray/own/{size}.bin"):
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data[0] = ord("G") if rel.startswith("gray") else ord("F")
            with open(path, "wb") as f:
                f.write(data)
    return root


def static_url_path(tree, size):
    return f"/{'own' if tree == 'lane' else 'fb'}/{size}.bin"


def start_static_graygate(work, binary, root):
    """graygate serving `root` (static/<lane>/ with fallback to formal);
    `X-Gray: 1` picks gray."""
    cfg = os.path.join(work, "graygate-static.yaml")
    with open(cfg, "w") as f:
        f.write(f"""listen: 127.0.0.1:0
workers: 1
rules:
  rules:
    - {{ name: testers, lane: gray, header: {{ name: X-Gray, values: ["1"] }} }}
routes:
  - prefix: /
    static: {root}
""")
    env = dict(os.environ, RUST_LOG=GRAYGATE_LOG)
    return Target("graygate", [binary, "--config", cfg], os.path.join(work, "graygate-static.log"),
                  env=env)


# ---------------------------------------------------------------- etcd fleet

def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class Etcd:
    """One etcd member on loopback (client and peer ports found free just
    before; etcd takes no inherited socket), talked to through its v3 JSON
    gateway."""

    def __init__(self, tmp):
        self.url = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "b0", "--data-dir", os.path.join(tmp, "etcd"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"b0={peer}", "--quota-backend-bytes", str(4 << 30)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "etcd.log"), "w"))
        deadline = time.time() + 30
        while True:
            try:
                self.call("/v3/kv/range", {"key": b64("x")})
                break
            except Exception:
                if self.proc.poll() is not None:
                    raise SystemExit(f"etcd exited early (code {self.proc.returncode}); "
                                     f"see {os.path.join(tmp, 'etcd.log')}")
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def call(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)

    def put(self, key, value):
        return int(self.call("/v3/kv/put", {"key": b64(key), "value": b64(value)})["header"]["revision"])

    def txn_puts(self, kvs):
        ops = [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in kvs]
        return int(self.call("/v3/kv/txn", {"success": ops})["header"]["revision"])

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class GatewayProc:
    """A graygate process for the fleet scripts; its stderr collected to a
    file, its listening (and admin) address read from it."""

    def __init__(self, args, tmp, name):
        self.log = os.path.join(tmp, name + ".log")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     env=dict(os.environ, RUST_LOG="info"))
        deadline = time.time() + 30
        while True:
            text = self.text()
            m = re.search(r"graygate listening addr=(\S+)", text)
            a = re.search(r"admin listening addr=(\S+)", text)
            if m and (a or "admin" not in name):
                self.addr = m.group(1)
                self.admin = a.group(1) if a else None
                return
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{name} did not start:\n{text}")
            time.sleep(0.02)

    def text(self):
        with open(self.log) as f:
            return f.read()

    def status(self):
        with urllib.request.urlopen(f"http://{self.admin}/status", timeout=5) as r:
            return json.load(r)

    def cpu(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK

    def rss_mb(self):
        return rss_kb([self.proc.pid]) / 1024

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def pct(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def start_upstream(gg, tmp, procs):
    """A graygate running only demo nodes (fast, fixed JSON) for formal and
    gray on free ports; returns the two ports."""
    up = [free_port(), free_port()]
    updir = os.path.join(tmp, "up")
    os.makedirs(updir)
    with open(os.path.join(updir, "up.yaml"), "w") as f:
        f.write(f"listen: 127.0.0.1:0\ndemo_nodes:\n  - {{ name: f1, addr: \"127.0.0.1:{up[0]}\", lane: formal }}\n"
                f"  - {{ name: g1, addr: \"127.0.0.1:{up[1]}\", lane: gray }}\n")
    procs.append(GatewayProc([gg, "--config", os.path.join(updir, "up.yaml")], tmp, "upstream"))
    return up


def write_nodes(conf, up):
    """conf/nodes.yaml: service `api` with the upstream's formal and gray node."""
    with open(os.path.join(conf, "nodes.yaml"), "w") as f:
        f.write(f"services:\n  api:\n    nodes:\n      - {{ name: f1, addr: \"127.0.0.1:{up[0]}\", lane: formal }}\n"
                f"      - {{ name: g1, addr: \"127.0.0.1:{up[1]}\", lane: gray }}\n")


def push_config(gg, conf, etcd, prefix):
    """`graygate push` of conf/main.yaml and what it names to etcd."""
    out = subprocess.run([gg, "push", "--config", os.path.join(conf, "main.yaml"), "--etcd", etcd.url,
                          "--prefix", prefix], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)


def etcd_boot_config(tmp, name, etcd, prefix, extra=""):
    """A gateway's bootstrap file for the etcd source (own folder, admin on
    port 0); `extra`: more lines under `etcd:`."""
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "boot.yaml")
    with open(p, "w") as f:
        f.write(f"listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\netcd:\n  endpoints: [\"{etcd.url}\"]\n"
                f"  prefix: {prefix}\n  cache_dir: cache\n  id: {name}\n{extra}")
    return p
