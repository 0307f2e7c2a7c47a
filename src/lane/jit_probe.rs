//! Layer: lane. Whether LuaJIT's trace compiler can work in this process.
//!
//! Under systemd's `MemoryDenyWriteExecute=yes` (a seccomp filter, or
//! `prctl(PR_SET_MDWE)`) LuaJIT cannot turn the machine code it wrote into
//! executable code, and it then exits the whole process at its first
//! compiled trace (`lj_mcode.c`: `mcode_protfail` → `exit(1)`). So before a
//! VM is built with `script_limits.jit: true`, the graygate binary runs
//! itself once as a probe (`graygate jit-probe`: a VM with the JIT on and a
//! loop hot enough to be compiled); if the probe does not come back with
//! `ok`, such a configuration is rejected and the running one keeps serving.
//! The answer is kept for the life of the process (a process's
//! `MemoryDenyWriteExecute` cannot be lifted). A library embedder that
//! installs no probe ([`set_probe`]) answers for its own process.

use std::sync::OnceLock;

/// The hidden subcommand the binary runs the probe with.
pub const SUBCOMMAND: &str = "jit-probe";

static PROBE: OnceLock<fn() -> Result<(), String>> = OnceLock::new();
static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();

/// Installs how [`available`] finds out (the binary: [`in_child`]).
pub fn set_probe(probe: fn() -> Result<(), String>) {
    let _ = PROBE.set(probe);
}

/// `Ok` when LuaJIT's compiler can run here; the reason otherwise. Asked
/// once per process (the first VM built with the JIT on), then remembered.
pub fn available() -> Result<(), String> {
    ANSWER
        .get_or_init(|| PROBE.get().map_or(Ok(()), |probe| probe()))
        .clone()
}

/// Runs `current_exe() jit-probe` and reads its answer.
pub fn in_child() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let out = std::process::Command::new(exe)
        .arg(SUBCOMMAND)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run the JIT probe: {e}"))?;
    if out.status.success() && out.stdout.starts_with(b"ok") {
        Ok(())
    } else {
        Err(format!(
            "LuaJIT's compiler cannot make its machine code executable in this process \
             (the probe ended with {}; under systemd this is MemoryDenyWriteExecute=yes); \
             set script_limits.jit: false, or MemoryDenyWriteExecute=no in the unit",
            out.status
        ))
    }
}

/// The probe itself (the child's side): compiles a hot loop with the JIT
/// on, then prints `ok`. Where executable code is denied, LuaJIT exits
/// this process before the print.
pub fn probe_main() -> std::process::ExitCode {
    let run = || -> mlua::Result<bool> {
        let lua = mlua::Lua::new();
        lua.load(
            "jit.on() local s = 0 for i = 1, 1000000 do s = s + i % 7 end \
             return jit.status() and s > 0",
        )
        .set_name("=graygate_jit_probe")
        .eval()
    };
    match run() {
        Ok(true) => {
            println!("ok");
            std::process::ExitCode::SUCCESS
        }
        _ => std::process::ExitCode::FAILURE,
    }
}
