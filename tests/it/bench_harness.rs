//! Every bench script's quick mode runs in the suite so none can rot: each
//! starts its gateways on this (debug) build, makes its own checks before
//! measuring, and carries its load without a failed request — a script
//! exits non-zero on one. Figures are printed, never asserted; the checks
//! here are only that a script ran to its table.

use std::process::{Command, Output};

/// Runs a bench script in quick mode on this build; returns its output.
fn run_quick(script: &str) -> Output {
    let out = Command::new("python3")
        .args([
            script,
            "--quick",
            "--graygate",
            env!("CARGO_BIN_EXE_graygate"),
        ])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} --quick failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    out
}

/// A bench script's quick mode; returns what it printed on stdout.
fn quick(script: &str) -> String {
    String::from_utf8_lossy(&run_quick(script).stdout).into_owned()
}

/// The cells of the table row of `stdout` starting with `prefix`.
fn row<'a>(stdout: &'a str, prefix: &str) -> Vec<&'a str> {
    stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no row {prefix}:\n{stdout}"))
        .split('|')
        .map(str::trim)
        .collect()
}

#[test]
fn bench_quick_mode_runs_all_targets() {
    let stdout = quick("bench/bench.py");
    for target in ["graygate", "nginx-lua", "haproxy-lua"] {
        for mix in ["untagged", "user-id", "x-gray"] {
            let row = stdout
                .lines()
                .find(|l| l.starts_with(&format!("| {mix} | 32 | {target} |")))
                .unwrap_or_else(|| panic!("no row for {target}/{mix}:\n{stdout}"));
            let cols: Vec<&str> = row.split('|').map(str::trim).collect();
            let rps: f64 = cols[4].parse().unwrap();
            assert!(rps > 0.0, "{row}");
            assert_eq!(cols[7], "0", "errors in {row}");
            let cpu: f64 = cols[8].parse().unwrap();
            assert!(cpu > 0.0, "CPU per request not measured: {row}");
        }
    }
    assert!(stdout.contains("| list | 100000 |"), "{stdout}");
}

/// The OpenResty-script benchmark in quick mode: both scripts start in
/// nginx+lua and in graygate, give the same lane and tag on every probe
/// request (the harness refuses to measure otherwise) and carry load
/// without errors.
#[test]
fn openresty_bench_quick_mode_agrees_with_nginx() {
    let stdout = quick("bench/openresty_bench.py");
    for script in ["simple", "heavy"] {
        for target in ["graygate", "nginx"] {
            for mix in ["untagged", "user-id", "x-gray"] {
                let prefix = format!("| {script} | {mix} | 32 | {target}-{script} |");
                let row = stdout
                    .lines()
                    .find(|l| l.starts_with(&prefix))
                    .unwrap_or_else(|| panic!("no row {prefix}:\n{stdout}"));
                let cols: Vec<&str> = row.split('|').map(str::trim).collect();
                assert!(cols[5].parse::<f64>().unwrap() > 0.0, "{row}");
                assert_eq!(cols[7], "0", "errors in {row}");
            }
        }
    }
}

/// `bench/static_bench.py --quick`: nginx and graygate serve the same bytes
/// of the lane's own file and of the formal fallback (checked by the script
/// before any load), and both rows carry load without errors.
#[test]
fn static_bench_quick_mode_runs_both_servers() {
    let stdout = quick("bench/static_bench.py");
    for tree in ["lane", "fallback"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| 2k | 32 | {tree} |")))
            .unwrap_or_else(|| panic!("no row for {tree}:\n{stdout}"));
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        for served in [cols[4], cols[5]] {
            let (rps, cpu) = served.split_once(" · ").expect("req/s · CPU");
            assert!(rps.replace(',', "").parse::<f64>().unwrap() > 0.0, "{row}");
            assert!(cpu.parse::<f64>().unwrap() > 0.0, "CPU not measured: {row}");
        }
        assert_eq!(cols[8], "0 / 0", "errors in {row}");
    }
}

/// `bench/pgo.py --quick`: its dry run (the build's prerequisites checked
/// — a missing llvm package is named, not fatal — and the four steps'
/// commands printed), then the PGO build's training load (the native
/// script, both OpenResty scripts on the interpreter and with the JIT,
/// every load mix at 32 and 256 connections, static files from a lane's
/// own tree and by fallback) on this build, one second a run, with every
/// request answered — the script stops at the first run with an error, so
/// a training load that taught the optimized build the error path fails
/// here.
#[test]
fn pgo_quick_mode_plans_the_build_and_runs_the_training_load() {
    let out = run_quick("bench/pgo.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("pgo.py dry run"), "{stdout}");
    assert!(
        stdout.contains("build prerequisites: all found")
            || stdout.contains("missing for the build"),
        "{stdout}"
    );
    for (step, needle) in [
        ("step 1:", "GRAYGATE_PGO=generate:"),
        ("step 1:", "-Cprofile-generate="),
        ("step 2:", "training load on"),
        ("step 3:", " merge -o "),
        ("step 4:", "GRAYGATE_PGO=use:"),
        ("step 4:", "-Cprofile-use="),
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(step) && l.contains(needle)),
            "{step} {needle}:\n{stdout}"
        );
    }
    for part in [
        "native",
        "simple",
        "simple-jit",
        "heavy",
        "heavy-jit",
        "static",
    ] {
        assert!(
            stderr.lines().any(|l| l == format!("trained: {part}")),
            "{part} not trained:\n{stderr}"
        );
    }
}

/// The argv tools/rustc-pgo runs for `args` under `GRAYGATE_PGO=pgo`
/// (`None`: unset), with `echo` as the compiler; (exit code, argv, stderr).
fn rustc_pgo(pgo: Option<&str>, args: &[&str]) -> (Option<i32>, Vec<String>, String) {
    let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tools/rustc-pgo"));
    cmd.arg("echo").args(args).env_remove("GRAYGATE_PGO");
    if let Some(p) = pgo {
        cmd.env("GRAYGATE_PGO", p);
    }
    let out = cmd.output().unwrap();
    let argv = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), argv, err)
}

/// The rustc wrapper of .cargo/config.toml: an optimized crate (`-C
/// opt-level=3`, the release build) gets the committed profile and the cfg
/// `--version` reports; GRAYGATE_PGO=off gives none, `use:FILE` and
/// `generate:DIR` their flags; debug crates, cargo's probes and commands that
/// carry their own profile flag pass unchanged; a bad value is refused.
#[test]
fn rustc_pgo_gives_the_committed_profile_to_release_crates_only() {
    let release = ["--crate-name", "x", "-C", "opt-level=3", "src/lib.rs"];
    let profile = concat!(env!("CARGO_MANIFEST_DIR"), "/pgo/graygate.profdata");
    let committed = std::path::Path::new(profile).is_file();
    let (code, argv, err) = rustc_pgo(None, &release);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(&argv[..5], &release[..]);
    if committed {
        assert_eq!(
            &argv[5..],
            [
                format!("-Cprofile-use={profile}"),
                "--cfg".into(),
                "graygate_pgo=\"committed\"".into()
            ]
        );
    } else {
        assert_eq!(argv.len(), 5, "{argv:?}");
    }
    let (_, argv, _) = rustc_pgo(Some("use"), &release);
    assert_eq!(argv.len(), if committed { 8 } else { 5 }, "{argv:?}");
    let (_, argv, _) = rustc_pgo(Some("off"), &release);
    assert_eq!(argv, release);
    let (_, argv, _) = rustc_pgo(Some("use:/p/x.profdata"), &release);
    assert_eq!(
        &argv[5..],
        [
            "-Cprofile-use=/p/x.profdata",
            "--cfg",
            "graygate_pgo=\"use\""
        ]
    );
    let (_, argv, _) = rustc_pgo(Some("generate:/p/raw"), &release);
    assert_eq!(
        &argv[5..],
        [
            "-Cprofile-generate=/p/raw",
            "--cfg",
            "graygate_pgo=\"generate\""
        ]
    );
    for unchanged in [
        &["--crate-name", "x", "-C", "opt-level=0", "src/lib.rs"][..],
        &["--crate-name", "build_script_build", "build.rs"][..],
        &["-vV"][..],
        &[
            "-C",
            "opt-level=3",
            "-Cprofile-use=/mine.profdata",
            "src/lib.rs",
        ][..],
    ] {
        let (code, argv, _) = rustc_pgo(Some("generate:/p/raw"), unchanged);
        assert_eq!(code, Some(0), "{unchanged:?}");
        assert_eq!(argv, unchanged, "{unchanged:?}");
    }
    let (code, _, err) = rustc_pgo(Some("sometimes"), &release);
    assert_eq!(code, Some(2));
    assert!(err.contains("GRAYGATE_PGO=sometimes"), "{err}");
}

/// The committed profile was trained with the pinned toolchain: a profile
/// names functions by their symbols, which another rustc spells otherwise,
/// so a toolchain change must come with `bench/pgo.py --refresh`.
#[test]
fn the_committed_profile_matches_the_pinned_toolchain() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let toolchain = std::fs::read_to_string(format!("{dir}/rust-toolchain.toml")).unwrap();
    let pinned = toolchain
        .lines()
        .find_map(|l| l.strip_prefix("channel = "))
        .unwrap()
        .trim_matches('"');
    let source = std::fs::read_to_string(format!("{dir}/pgo/source")).unwrap();
    let rustc = source
        .lines()
        .find_map(|l| l.strip_prefix("rustc: "))
        .unwrap();
    assert_eq!(rustc, pinned, "pgo/source:\n{source}");
    let profile = std::fs::metadata(format!("{dir}/pgo/graygate.profdata")).unwrap();
    assert!(profile.len() > 0);
}

/// `bench/pgo.py` checks every prerequisite before it builds or runs
/// anything, and names all that are missing in one message (here: a PATH
/// holding only the interpreter).
#[test]
fn pgo_names_every_missing_prerequisite_at_once() {
    let bare = tempfile::tempdir().unwrap();
    let python = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    let python = String::from_utf8(python.stdout).unwrap();
    std::os::unix::fs::symlink(python.trim(), bare.path().join("python3")).unwrap();
    let out = Command::new(bare.path().join("python3"))
        .arg("bench/pgo.py")
        .env("PATH", bare.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    for tool in ["nginx", "wrk", "cargo", "rustc"] {
        assert!(
            stderr.contains(&format!("{tool} not found")),
            "{tool} not named:\n{stderr}"
        );
    }
    assert!(!stderr.contains("Traceback"), "{stderr}");
}

/// `bench/ab.py --quick`: the build against itself, one row each, no errors.
#[test]
fn ab_quick_mode_compares_builds() {
    let stdout = quick("bench/ab.py");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| 32 |")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for r in rows {
        let cols: Vec<&str> = r.split('|').map(str::trim).collect();
        assert_eq!(cols[8], "0", "errors in {r}");
    }
}

/// `bench/fleet.py --quick`: an etcd on loopback, pushes reach both
/// gateways, a small registry is built, and both sources carry load.
#[test]
fn fleet_quick_mode_runs_all_three_parts() {
    let stdout = quick("bench/fleet.py");
    for part in [
        "## push -> every gateway serving it",
        "services x 2 nodes read from etcd",
        "## request CPU, etcd source vs files",
    ] {
        assert!(stdout.contains(part), "{part} missing:\n{stdout}");
    }
    assert!(stdout.contains("| etcd | "), "{stdout}");
}

/// `bench/release_fleet.py --quick`: a three-step release is stepped by
/// the elected gateway and promoted (the script fails otherwise).
#[test]
fn release_fleet_quick_mode_promotes() {
    let stdout = quick("bench/release_fleet.py");
    assert!(stdout.starts_with("state promoted"), "{stdout}");
}

/// `bench/idle_conns.py --quick`: both servers hold every idle connection
/// open (the script fails on one closed), opened one after the other and
/// in a burst (every connect at once, half their requests together).
#[test]
fn idle_conns_quick_mode_holds_connections() {
    let stdout = quick("bench/idle_conns.py");
    for target in ["graygate", "nginx-lua"] {
        for opening in ["serial", "burst"] {
            let cols = row(&stdout, &format!("| {target} | {opening} |"));
            assert_eq!(cols[8], "200", "connections alive: {cols:?}");
        }
    }
}

/// `bench/slow_readers.py --quick`: a full read of the file, then slow
/// readers cut off by the send timeout, graygate still up.
#[test]
fn slow_readers_quick_mode_runs() {
    let stdout = quick("bench/slow_readers.py");
    assert!(stdout.contains("after the send timeout"), "{stdout}");
}

/// `bench/instructions.py --quick`: each gateway under callgrind answers
/// every request with 200 and yields a count for each mix.
#[test]
fn instructions_quick_mode_counts_every_target() {
    let stdout = quick("bench/instructions.py");
    for target in ["graygate", "nginx-lua", "haproxy-lua"] {
        let cols = row(&stdout, &format!("| {target} |"));
        for c in &cols[2..5] {
            assert!(c.replace(',', "").parse::<f64>().unwrap() > 0.0, "{cols:?}");
        }
    }
}

/// `bench/tls_bench.py --quick`: both gateways terminate TLS on ephemeral
/// ports, pass the h2 lane check, and carry h2, HTTP/1.1-over-TLS and
/// handshake load without errors.
#[test]
fn tls_bench_quick_mode_runs_both_gateways() {
    let stdout = quick("bench/tls_bench.py");
    for test in ["h2 (", "h1-tls (", "new TLS 1.3 handshakes"] {
        for target in ["graygate", "nginx-lua"] {
            let line = stdout
                .lines()
                .find(|l| {
                    l.starts_with(&format!("| {test}")) && l.contains(&format!("| {target} |"))
                })
                .unwrap_or_else(|| panic!("no row {test} {target}:\n{stdout}"));
            let cols: Vec<&str> = line.split('|').map(str::trim).collect();
            assert_eq!(cols[4], "0", "errors in {line}");
        }
    }
}

/// `bench/vm_compare --quick` (its own Cargo project, built here with the
/// LuaJIT feature into this suite's scratch folder): the heavy chain's
/// pure-Lua part runs plainly and with the count hook on the interpreter.
#[test]
fn vm_compare_quick_mode_runs_luajit() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("vm_compare");
    for mode in ["plain", "nojithook"] {
        let out = Command::new(&cargo)
            .args([
                "run",
                "--quiet",
                "--locked",
                "--manifest-path",
                "bench/vm_compare/Cargo.toml",
                "--features",
                "luajit",
                "--target-dir",
            ])
            .arg(&target)
            .args(["--", "bench/openresty_heavy.lua", "--quick"])
            .args((mode != "plain").then_some(mode))
            .output()
            .expect("cargo runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "vm_compare {mode}:\n{stdout}\n{stderr}"
        );
        println!("{stdout}");
        assert!(stdout.contains(&format!("luajit {mode}: ")), "{stdout}");
    }
}

/// `bench/hash_choice spread --quick` (its own Cargo project, built into
/// this suite's scratch folder): the comparison behind `balance: hash`
/// runs, and the two exact algorithms move no survivor's key.
#[test]
fn hash_choice_quick_mode_runs() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hash_choice");
    let out = Command::new(&cargo)
        .args([
            "run",
            "--quiet",
            "--locked",
            "--manifest-path",
            "bench/hash_choice/Cargo.toml",
            "--target-dir",
        ])
        .arg(&target)
        .args(["--", "spread", "--quick"])
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "hash_choice:\n{stdout}\n{stderr}");
    println!("{stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 18, "{stdout}");
    for line in lines.iter().filter(|l| !l.starts_with("maglev")) {
        assert!(line.ends_with("moved 0 survivors' keys"), "{line}");
    }
}
