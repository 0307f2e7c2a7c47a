//! `script_limits.jit` where executable code is denied
//! (`MemoryDenyWriteExecute`, here `prctl(PR_SET_MDWE)` set before the exec,
//! as systemd does when the kernel has it): LuaJIT would end the whole
//! process at its first compiled trace, so graygate refuses `jit: true`
//! there (at `--check`, at start and at reload, the old configuration
//! serving on), while the interpreter serves a hot loop under the same
//! restriction. Without the restriction, `jit: true` serves. The default,
//! `auto`, is the compiler where it can run and the interpreter (with a
//! warning) where it cannot.

use std::process::Command;

use crate::harness::*;

/// `python3` sets `PR_SET_MDWE` (`PR_MDWE_REFUSE_EXEC_GAIN`) and execs
/// graygate with the arguments after it; the setting is inherited across
/// the exec and by graygate's own children (the probe).
fn under_mdwe() -> Command {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        "import ctypes, os, sys\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         if libc.prctl(65, 1, 0, 0, 0) != 0:\n\
         \x20   sys.exit('prctl(PR_SET_MDWE) failed: errno %d' % ctypes.get_errno())\n\
         os.execv(sys.argv[1], sys.argv[1:])",
        env!("CARGO_BIN_EXE_graygate"),
    ])
    .env_remove("GRAYGATE_ADMIN_TOKEN");
    cmd
}

/// A script whose lane function runs a loop the JIT compiles within a few
/// requests; static trees that answer with their lane's name.
fn fixture(jit: Option<bool>) -> Fixture {
    let fx = Fixture::new();
    fx.write(
        "gray.lua",
        "return function(req)\n\
         \x20 local s = 0\n\
         \x20 for i = 1, 3000 do s = s + i % 3 end\n\
         \x20 if s > 0 and req:header(\"x-gray\") == \"1\" then return \"gray\" end\n\
         \x20 return \"formal\"\n\
         end\n",
    );
    fx.write("static/formal/a.txt", "formal\n");
    fx.write("static/gray/a.txt", "gray\n");
    write_main(&fx, jit);
    fx
}

/// `jit`: `script_limits.jit` (line 6); `None`: the key left out.
fn write_main(fx: &Fixture, jit: Option<bool>) {
    let root = fx.path("static");
    let limits = jit.map_or(String::new(), |j| format!("script_limits:\n  jit: {j}\n"));
    fx.write(
        "main.yaml",
        &main_config(&format!(
            "script: gray.lua\n{limits}routes:\n  - prefix: /\n    static: {}\n",
            root.display()
        )),
    );
}

/// Enough requests for the loop to be hot many times over; every one in
/// its lane.
async fn serves_lanes(gw: &Gateway) {
    for i in 0..60 {
        let (h, want) = if i % 2 == 0 {
            ("1", "gray\n")
        } else {
            ("0", "formal\n")
        };
        let r = Req::get("/a.txt").header("X-Gray", h).send(gw.addr).await;
        assert_eq!(r.text(), want, "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jit_is_refused_where_code_may_not_become_executable_and_the_interpreter_serves_there() {
    // --check refuses it with the key's line.
    let fx = fixture(Some(true));
    let out = under_mdwe()
        .arg("--check")
        .arg("--config")
        .arg(fx.path("main.yaml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "--check passed under MDWE: {err}");
    assert!(
        err.contains("main.yaml:6: script_limits.jit:") && err.contains("MemoryDenyWriteExecute"),
        "{err}"
    );

    // The interpreter (jit: false) serves under the same restriction.
    write_main(&fx, Some(false));
    let gw = Gateway::start_cmd(under_mdwe(), &fx.path("main.yaml"), &[]);
    serves_lanes(&gw).await;
    assert_eq!(gw.status().await["script_jit"], false);

    // A reload to jit: true is rejected; the process and its lanes go on.
    write_main(&fx, Some(true));
    soon("the jit reload rejected", || async {
        gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("script_limits.jit"))
    })
    .await;
    serves_lanes(&gw).await;
    let err = gw.status().await["last_reload_error"].to_string();
    assert!(err.contains("main.yaml:6:"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jit_serves_where_the_compiler_may_run() {
    let fx = fixture(Some(true));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_graygate"));
    cmd.env_remove("GRAYGATE_ADMIN_TOKEN");
    let gw = Gateway::start_cmd(cmd, &fx.path("main.yaml"), &[]);
    serves_lanes(&gw).await;
    let st = gw.status().await;
    assert!(st["last_reload_error"].is_null());
    assert_eq!(st["script_jit"], true);
}

/// The default (`auto`): LuaJIT's compiler where it may run, without a
/// warning; under the restriction, `--check` passes, the interpreter serves
/// and a warning says why (at start and after a reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jit_by_default_where_the_compiler_may_run_and_the_interpreter_elsewhere() {
    let fx = fixture(None);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_graygate"));
    cmd.env_remove("GRAYGATE_ADMIN_TOKEN");
    let gw = Gateway::start_cmd(cmd, &fx.path("main.yaml"), &[]);
    serves_lanes(&gw).await;
    let st = gw.status().await;
    assert_eq!(st["script_jit"], true, "{st}");
    assert_eq!(st["warnings"], serde_json::json!([]), "{st}");
    drop(gw);

    let out = under_mdwe()
        .arg("--check")
        .arg("--config")
        .arg(fx.path("main.yaml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "--check refused auto under MDWE: {err}"
    );

    let gw = Gateway::start_cmd(under_mdwe(), &fx.path("main.yaml"), &[]);
    serves_lanes(&gw).await;
    let st = gw.status().await;
    assert_eq!(st["script_jit"], false, "{st}");
    let warned = |st: &serde_json::Value| {
        st["warnings"].as_array().is_some_and(|w| {
            w.iter().any(|w| {
                w.as_str().is_some_and(|w| {
                    w.contains("script_limits.jit: auto") && w.contains("MemoryDenyWriteExecute")
                })
            })
        })
    };
    assert!(warned(&st), "{st}");
    // A reload (the script edited) keeps the interpreter, and the warning.
    fx.write(
        "gray.lua",
        "return function(req)\n\
         \x20 local s = 0\n\
         \x20 for i = 1, 3000 do s = s + i % 5 end\n\
         \x20 if s > 0 and req:header(\"x-gray\") == \"1\" then return \"gray\" end\n\
         \x20 return \"formal\"\n\
         end\n",
    );
    let first = st["generation"].as_u64().unwrap();
    soon("the edited script applied", || async {
        gw.status().await["generation"].as_u64().unwrap() > first
    })
    .await;
    serves_lanes(&gw).await;
    let st = gw.status().await;
    assert_eq!(st["script_jit"], false, "{st}");
    assert!(warned(&st), "{st}");
}
