//! The benchmark harness's quick mode runs in the suite so it cannot rot:
//! all three gateways start, pass the same lane sanity checks, and carry
//! load without errors. (Figures are printed, never asserted.)

use std::process::Command;

/// Runs a bench script in quick mode on this build; returns what it printed.
fn quick(script: &str) -> String {
    let out = Command::new("python3")
        .args([
            script,
            "--quick",
            "--graygate",
            env!("CARGO_BIN_EXE_graygate"),
        ])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "harness failed:\n{stdout}\n{stderr}");
    println!("{stdout}");
    stdout
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

/// `bench/pgo.py --train-only`: the PGO build's training load (the native
/// script, both OpenResty scripts on the interpreter and with the JIT, every
/// load mix at 32 and 256 connections, static files from a lane's own tree
/// and by fallback) runs on this build with every request answered — the
/// script stops at the first run with an error, so a training load that
/// taught the optimized build the error path fails here.
#[test]
fn pgo_training_load_runs_without_errors() {
    let out = Command::new("python3")
        .args([
            "bench/pgo.py",
            "--train-only",
            env!("CARGO_BIN_EXE_graygate"),
            "--train-seconds",
            "1",
        ])
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "training failed:\n{stderr}");
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
