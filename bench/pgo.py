#!/usr/bin/env python3
"""A profile-guided (PGO) release build of graygate.

rustc's own PGO, in three steps, through tools/rustc-pgo (the rustc wrapper
of .cargo/config.toml, which adds the profile flags to the optimized crates;
cargo's own flags stay those of `cargo build --release`, so the symbols
the profile names are the ones that build has):
  1. an instrumented release build (`GRAYGATE_PGO=generate:DIR`: the wrapper
     adds `-Cprofile-generate=DIR`; its own target dir target/pgo-gen, so
     the release build's cache is not touched);
  2. a training load on it: the request path as operators run it — the
     shipped native script (scripts/gray.lua, the default script_limits),
     the two OpenResty scripts of bench/ on LuaJIT's interpreter
     (`script_limits.jit: false`) and with its compiler (`true`), each
     under the three load mixes at 32 and 256 connections, and static files
     (2 KiB, 100 KiB; a lane's own file and the fallback to formal); graygate
     is stopped with SIGTERM, which writes its profile;
  3. `llvm-profdata merge` (the LLVM major version rustc reports: Debian's
     package `llvm-<major>`) and the optimized release build
     (`GRAYGATE_PGO=use:FILE`: `-Cprofile-use=FILE`, target dir target/pgo-use).
With --refresh the merged profile replaces the committed one,
pgo/graygate.profdata (and pgo/source says what it was trained on): the
profile every `cargo build --release` of this checkout then uses.
The training's wrk runs are short and unpinned: only which code runs how
often matters, not its speed.

Every prerequisite (nginx with its Lua module, wrk; for the build also cargo,
rustc and the matching llvm-profdata) is checked before anything runs; one
message names all that are missing.

Usage:
  python3 bench/pgo.py                 # ~15 minutes on 2 cores; prints the binary's path
  python3 bench/pgo.py --refresh       # the same, and the result becomes the committed profile
  python3 bench/pgo.py --train-seconds 1
  python3 bench/pgo.py --dry-run       # the prerequisites and the commands, nothing built
  python3 bench/pgo.py --train-only target/debug/graygate --train-seconds 1   # the load alone
  python3 bench/pgo.py --quick --graygate target/debug/graygate   # CI's check: --dry-run, then
                                       # the training load on that build, one second a run
A dry run names what is missing for the build (e.g. the llvm package) and
exits 0: the plan is printed either way.
  packaging/build-deb.sh --binary "$(python3 bench/pgo.py)"
The benchmarks take the result with --graygate target/pgo-use/release/graygate.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import lib


def rustc_field(name):
    """A field of `rustc -vV` ("release", "LLVM version"): None without rustc,
    "" when rustc does not name it."""
    try:
        out = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(rf"^{name}: (.*)$", out, re.M)
    return m.group(1).strip() if m else ""


def profdata_tool():
    """(llvm-profdata of rustc's LLVM major version, None) -- a profile is read
    only by its own -- or (None, what is missing)."""
    llvm = rustc_field("LLVM version")
    if llvm is None:
        return None, "rustc not found: the Rust toolchain (rustup)"
    if not llvm:
        return None, "rustc -vV names no LLVM version"
    major = llvm.split(".")[0]
    for name in (f"llvm-profdata-{major}", f"/usr/lib/llvm-{major}/bin/llvm-profdata"):
        if shutil.which(name):
            return name, None
    return None, f"llvm-profdata for LLVM {major} not found: apt-get install llvm-{major}"


COMMITTED = os.path.join(lib.REPO, "pgo", "graygate.profdata")
SOURCE = os.path.join(lib.REPO, "pgo", "source")


def cargo_command(target_dir, pgo):
    """(environment, argv) of one release build into `target_dir`, with
    tools/rustc-pgo's choice `pgo` (GRAYGATE_PGO: generate:DIR or use:FILE)."""
    env = dict(os.environ)
    env["GRAYGATE_PGO"] = pgo
    return env, ["cargo", "build", "--release", "--locked", "--target-dir", target_dir]


def cargo_build(target_dir, pgo):
    env, argv = cargo_command(target_dir, pgo)
    subprocess.run(argv, cwd=lib.REPO, env=env, check=True, stdout=sys.stderr)
    return os.path.join(target_dir, "release", "graygate")


def write_source(path):
    """pgo/source: the commit and toolchain the committed profile was trained on."""
    def out(*argv):
        return subprocess.run(argv, cwd=lib.REPO, capture_output=True, text=True).stdout.strip()
    commit = out("git", "rev-parse", "--short=12", "HEAD") or "unknown"
    # pgo/ itself is what --refresh has just replaced: not a change of the
    # tree the profile was trained on.
    if out("git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!pgo"):
        commit += " (with uncommitted changes)"
    with open(path, "w") as f:
        f.write("# What pgo/graygate.profdata was trained on (written by bench/pgo.py --refresh).\n")
        f.write(f"commit: {commit}\n")
        f.write(f"rustc: {rustc_field('release') or 'unknown'}\n")
        f.write(f"llvm: {rustc_field('LLVM version') or 'unknown'}\n")


class Plan:
    """The build's paths and the commands of its steps."""

    def __init__(self, data, tool):
        target = os.path.join(lib.REPO, "target")
        self.data = os.path.abspath(data or os.path.join(target, "pgo-data"))
        self.gen_dir = os.path.join(target, "pgo-gen")
        self.use_dir = os.path.join(target, "pgo-use")
        self.merged = os.path.join(target, "pgo.profdata")
        self.gen_pgo = f"generate:{self.data}"
        self.use_pgo = f"use:{self.merged}"
        self.tool = tool

    def steps(self):
        """The commands as one would type them (for --dry-run)."""
        gen_env, gen = cargo_command(self.gen_dir, self.gen_pgo)
        use_env, use = cargo_command(self.use_dir, self.use_pgo)
        tool = self.tool or "llvm-profdata-<N>"
        return [
            f"GRAYGATE_PGO={gen_env['GRAYGATE_PGO']} {' '.join(gen)} "
            f"(tools/rustc-pgo adds -Cprofile-generate={self.data})",
            f"training load on {os.path.join(self.gen_dir, 'release', 'graygate')} "
            f"(profiles into {self.data})",
            f"{tool} merge -o {self.merged} {self.data}/*.profraw",
            f"GRAYGATE_PGO={use_env['GRAYGATE_PGO']} {' '.join(use)} "
            f"(tools/rustc-pgo adds -Cprofile-use={self.merged})",
        ]


def dry_run(a):
    """Prints the prerequisites' state and the steps; builds nothing. Only
    the training's tools are required (they are what --quick runs)."""
    tool, missing = profdata_tool()
    build_missing = lib.missing_tools(("cargo",)) + ([missing] if missing else [])
    print("pgo.py dry run: nothing is built")
    if build_missing:
        print("missing for the build (it would stop before building):")
        for m in build_missing:
            print(f"  {m}")
    else:
        print(f"build prerequisites: all found (profile tool {tool})")
    for i, step in enumerate(Plan(a.data, tool).steps(), 1):
        print(f"step {i}: {step}")
    sys.stdout.flush()


def load(port, seconds, what, mix=None, conns=32, **wrk):
    """One training run; every request must be answered 2xx/3xx (a training
    load of errors would teach the build the error path)."""
    r = lib.run_wrk(port, mix, conns, seconds, **wrk)
    if r["errors"] or not r["requests"]:
        raise SystemExit(f"training run {what}: {r['errors']} errors in {r['requests']} requests")


def train(binary, seconds):
    """Runs the training load on the instrumented `binary` (in a temporary
    directory of its own, removed by `lib.stop_all`)."""
    lib.PIN["on"] = False
    work = tempfile.mkdtemp(prefix="graygate-pgo-train-")
    started = [lib.start_backends(work)]
    try:
        scripts = [("native", os.path.join(lib.REPO, "scripts", "gray.lua"), None)]
        for name, module in lib.OPENRESTY_SCRIPTS.items():
            for jit in (False, True):
                scripts.append((f"{name}{'-jit' if jit else ''}",
                                os.path.join(lib.BENCH, f"{module}.lua"), jit))
        for name, script, jit in scripts:
            t = lib.start_graygate(work, binary, name=f"pgo-{name}", script=script, jit=jit)
            started.append(t)
            for mix in ("untagged", "user-id", "x-gray"):
                for conns in (32, 256):
                    load(t.port, seconds, f"{name} {mix} @ {conns}", mix=mix, conns=conns)
            t.stop()
            started.remove(t)
            print(f"trained: {name}", file=sys.stderr, flush=True)
        root = lib.make_static_tree(work, {k: lib.STATIC_SIZES[k] for k in ("2k", "100k")})
        t = lib.start_static_graygate(work, binary, root)
        started.append(t)
        for size in ("2k", "100k"):
            for tree in lib.STATIC_TREES:
                load(t.port, seconds, f"static {size} {tree}", path=lib.static_url_path(tree, size),
                     args=["-H", "X-Gray: 1"])
        t.stop()
        started.remove(t)
        print("trained: static", file=sys.stderr, flush=True)
    finally:
        lib.stop_all(started, work)  # removes `work` too


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-seconds", type=int, default=2, help="wrk seconds per training run")
    ap.add_argument("--train-only", metavar="BINARY",
                    help="only run the training load on BINARY (no build): the harness's own check")
    ap.add_argument("--data", help="where the instrumented build writes its profile "
                                   "(default target/pgo-data; part of its flags, so keep it "
                                   "the same to reuse that build)")
    ap.add_argument("--refresh", action="store_true",
                    help="make the merged profile the committed one (pgo/graygate.profdata, "
                         "pgo/source), which every `cargo build --release` then uses")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the prerequisites and print the steps' commands; build nothing")
    lib.add_quick(ap)
    a = ap.parse_args()
    load_tools = ("nginx", "nginx-lua", "wrk")
    if a.quick:  # the dry run, then the training load on --graygate, one second a run
        a.train_only, a.train_seconds = a.train_only or a.graygate, 1
        lib.require(load_tools, [a.train_only])
        dry_run(a)
    if a.dry_run and not a.quick:
        lib.require(load_tools)
        dry_run(a)
        return
    if a.train_only:
        lib.require(load_tools, [a.train_only])
        train(a.train_only, a.train_seconds)
        return
    tool, missing = profdata_tool()
    lib.require(load_tools + ("cargo",), more=[missing] if missing else [])
    plan = Plan(a.data, tool)
    shutil.rmtree(plan.data, ignore_errors=True)
    os.makedirs(plan.data)
    gen = cargo_build(plan.gen_dir, plan.gen_pgo)
    train(gen, a.train_seconds)
    raws = glob.glob(os.path.join(plan.data, "*.profraw"))
    if not raws:
        raise SystemExit("the training wrote no profile (graygate did not exit cleanly?)")
    subprocess.run([tool, "merge", "-o", plan.merged] + raws, check=True)
    print(f"profile: {len(raws)} raw file(s) merged into {plan.merged}", file=sys.stderr)
    if a.refresh:
        shutil.copyfile(plan.merged, COMMITTED)
        write_source(SOURCE)
        print(f"committed profile replaced: {COMMITTED} (see {SOURCE})", file=sys.stderr)
    print(cargo_build(plan.use_dir, plan.use_pgo))


if __name__ == "__main__":
    main()
