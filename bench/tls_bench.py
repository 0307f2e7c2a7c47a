#!/usr/bin/env python3
"""HTTPS benchmark: graygate vs nginx+lua, TLS termination side by side.

Same job and pinning as bench/lib.py: each gateway runs ONE worker pinned
to CPU 1, the two nginx backends (fixed JSON for formal and gray) and the
load generators run on CPU 0; the lane decision is the shipped
scripts/gray.lua for graygate and bench/nginx_gray.lua for nginx. Both
terminate TLS with the same ECDSA P-256 certificate, TLS 1.3, session cache
and tickets on.

Measured, alternating the targets over rounds (median reported):
  h2      HTTPS + HTTP/2 with h2load (-c 32 -m 10, one thread): req/s and the
          gateway's CPU time per request (user+sys from /proc ÷ requests);
  h1-tls  HTTPS + HTTP/1.1 keep-alive with h2load --h1 (-c 32);
  handshakes  new full TLS handshakes per second with `openssl s_time -new`
          (two clients), and the gateway's CPU time per handshake.

Every listener is on an ephemeral port: nginx gets a socket bound here
(inherited), graygate's TLS listener is on port 0 and its logged address is
read back. Pinning needs two CPUs and is off with --quick or --no-pin.

Usage:
  apt-get install nginx-core libnginx-mod-http-lua nghttp2-client   # once
  cargo build --release
  python3 bench/tls_lib.py                 # ~2 minutes
  python3 bench/tls_lib.py --duration 3 --rounds 1   # quicker
  python3 bench/tls_lib.py --quick --graygate target/debug/graygate   # seconds (CI): fails on errors
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import lib

CLK = os.sysconf("SC_CLK_TCK")


def make_cert(work):
    cert, key = os.path.join(work, "lib.crt"), os.path.join(work, "lib.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "30", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


def tls_port(log, proc, limit=20.0):
    """The port of graygate's TLS listener ("listening addr=… proto=\"https …")."""
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"graygate exited early (code {proc.returncode}); see {log}")
        with open(log, errors="replace") as f:
            m = re.search(r"listening addr=127\.0\.0\.1:(\d+) proto=\"?https", f.read())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise SystemExit("graygate logged no TLS listener")


def start_graygate(work, binary, cert, key):
    """graygate (shipped script) with a TLS listener on port 0; its `port`
    is that listener's."""
    cfg = lib.write_graygate_config(work, "graygate-tls", 1)
    with open(cfg, "a") as f:
        f.write(f"""listeners:
  - listen: 127.0.0.1:0
    tls:
      certificates:
        - {{ cert: {cert}, key: {key} }}
""")
    env = dict(os.environ, RUST_LOG=lib.GRAYGATE_LOG)
    log = os.path.join(work, "graygate-tls.log")
    t = lib.Target("graygate", [binary, "--config", cfg], log, env=env)
    t.port = tls_port(log, t.proc)
    return t


def start_nginx(work, cert, key):
    sock = lib.listen_socket()
    port = sock.getsockname()[1]
    path = lib.nginx_lua_conf(work, port, name="nginx-tls", listen_opts="ssl http2", server_extra=f"""
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:SSL:10m;
        ssl_session_tickets on;
        http2_max_concurrent_streams 128;""")
    return lib.Target("nginx-lua", ["nginx", "-p", work, "-e", "stderr", "-c", path],
                      os.path.join(work, "nginx-tls.log"), socks=[sock], nginx=True)


def check(port, name):
    """Both lanes over HTTPS + h2 before measuring."""
    for hdr, want in (([], "formal"), (["-H", "X-Gray: 1"], "gray")):
        out = subprocess.run(["curl", "-sk", "--http2", "-w", "\n%{http_version}", *hdr,
                              f"https://localhost:{port}/api/x"], capture_output=True, text=True)
        body, _, ver = out.stdout.rpartition("\n")
        if ver.strip() != "2" or f'"lane":"{want}"' not in body or f'"tag":"{want}"' not in body:
            raise SystemExit(f"{name}: {hdr} -> {out.stdout!r}, expected h2 and lane {want}")


def cpu(target):
    u, s = lib.cpu_ticks(target.pids())
    return (u + s) / CLK


def client_cpus():
    """The load generators' CPU pinning prefix (none when not pinning)."""
    return ["taskset", "-c", "0"] if lib.PIN["on"] else []


def run_h2load(target, args, duration):
    t0 = cpu(target)
    out = subprocess.run([*client_cpus(), "h2load", "-t", "1", "-D", f"{duration:g}",
                          "--warm-up-time", "1", *args, f"https://localhost:{target.port}/api/x"],
                         capture_output=True, text=True)
    used = cpu(target) - t0
    text = out.stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", text)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", text)
    if not m or not done:
        raise SystemExit(f"h2load output:\n{text}\n{out.stderr}")
    ok, failed, errored = int(done.group(2)), int(done.group(3)), int(done.group(4))
    # CPU is sampled over warm-up + measurement; requests counted are the
    # measured ones, so scale by the measured share of the time.
    share = duration / (duration + 1.0)
    return {"rps": float(m.group(1)), "errors": failed + errored,
            "cpu_us": used * share / max(ok, 1) * 1e6}


def run_handshakes(target, duration, clients=2):
    t0 = cpu(target)
    procs = [subprocess.Popen([*client_cpus(), "openssl", "s_time", "-connect",
                               f"127.0.0.1:{target.port}", "-new", "-time", str(duration)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(clients)]
    total = 0.0
    conns = 0
    for p in procs:
        out, _ = p.communicate()
        m2 = re.search(r"(\d+) connections in (\d+) real seconds", out)
        if not m2:
            raise SystemExit(f"s_time output:\n{out}")
        conns += int(m2.group(1))
        total += int(m2.group(1)) / max(int(m2.group(2)), 1)
    used = cpu(target) - t0
    return {"hs": total, "cpu_us": used / max(conns, 1) * 1e6}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    lib.add_quick(ap)
    a = ap.parse_args()
    if a.quick:
        a.duration, a.rounds = 1, 1
    lib.require(("nginx", "nginx-lua", "h2load", "openssl", "curl", "taskset"), [a.graygate])
    lib.PIN["on"] = not (a.quick or a.no_pin) and {0, 1} <= os.sched_getaffinity(0)
    work = tempfile.mkdtemp(prefix="gg-tls-bench-")
    os.chmod(work, 0o755)  # nginx's workers (an unprivileged user) read the certificate
    cert, key = make_cert(work)
    targets = []
    backends = None
    errors = 0
    try:
        backends = lib.start_backends(work)
        targets = [start_graygate(work, a.graygate, cert, key), start_nginx(work, cert, key)]
        for t in targets:
            check(t.port, t.name)
        tests = {
            "h2 (HTTPS + HTTP/2, 32 conns × 10 streams)": lambda t: run_h2load(t, ["-c", "32", "-m", "10"], a.duration),
            "h1-tls (HTTPS + HTTP/1.1 keep-alive, 32 conns)": lambda t: run_h2load(t, ["--h1", "-c", "32"], a.duration),
            "new TLS 1.3 handshakes (2 × openssl s_time -new)": lambda t: run_handshakes(t, int(max(a.duration, 2))),
        }
        results = {(test, t.name): [] for test in tests for t in targets}
        for r in range(a.rounds):
            for test, fn in tests.items():
                order = targets if r % 2 == 0 else list(reversed(targets))
                for t in order:
                    results[(test, t.name)].append(fn(t))
                    time.sleep(0.5)
        pinning = "one worker each on CPU 1" if lib.PIN["on"] else "one worker each, nothing pinned"
        print(f"\nTLS benchmark, {a.rounds} rounds × {a.duration:g} s, medians; {pinning}\n")
        print("| test | target | rate (req/s or handshakes/s) | errors | gateway CPU µs per request/handshake | rate ÷ nginx | CPU ÷ nginx |")
        print("|---|---|---|---|---|---|---|")
        for test in tests:
            med = {}
            for t in targets:
                runs = results[(test, t.name)]
                key_rate = "hs" if "hs" in runs[0] else "rps"
                med[t.name] = (statistics.median(x[key_rate] for x in runs),
                               statistics.median(x["cpu_us"] for x in runs),
                               sum(x.get("errors", 0) for x in runs))
            base = med["nginx-lua"]
            for t in targets:
                rate, c, err = med[t.name]
                errors += err
                print(f"| {test} | {t.name} | {rate:.0f} | {err} | {c:.1f} | {rate / base[0]:.2f} | {c / base[1]:.2f} |")
        sys.stdout.flush()
    finally:
        lib.stop_all(targets + ([backends] if backends else []), work)
    lib.fail_on_errors(errors)


if __name__ == "__main__":
    main()
