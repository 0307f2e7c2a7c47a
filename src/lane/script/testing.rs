//! Layer: lane (tests). The VM mode (`script_limits.jit`) of the scripts a
//! test thread loads, shared by the script, `ngx` and `native` tests, and
//! the script tests' helpers (files, requests, calls).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::sandbox::VM;
use super::{call_lane, RuleCtx, ScriptError, ScriptSource};
use crate::config::ConfigError;
use crate::lane::RequestInfo;

thread_local! {
    static JIT: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread's tests load scripts with LuaJIT's compiler on.
pub(crate) fn jit() -> bool {
    JIT.with(Cell::get)
}

/// Runs a sandbox test on the interpreter (the default) and again with
/// LuaJIT's compiler on: every guarantee must hold in both.
pub(crate) fn both_modes(test: fn()) {
    for jit in [false, true] {
        JIT.with(|j| j.set(jit));
        test();
    }
    JIT.with(|j| j.set(false));
}

/// `text` as a script (`t.lua` in a temporary directory, kept while
/// the source is used), in this thread's VM mode.
pub(crate) fn load_src(text: &str) -> (tempfile::TempDir, ScriptSource) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.lua");
    std::fs::write(&p, text).unwrap();
    let mut src = ScriptSource::load(&p).unwrap();
    src.jit = jit();
    (d, src)
}

/// Writes `text` to `dir/name`, making its parent directories.
pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

/// Why the script at `p` fails to load.
pub(crate) fn validate_error(p: &Path) -> ConfigError {
    ScriptSource::load(p)
        .unwrap()
        .validate(&Arc::new(BTreeMap::new()))
        .unwrap_err()
}

/// Whether this thread's VM runs with LuaJIT's compiler on.
pub(crate) fn vm_jit_on() -> bool {
    VM.with(|v| v.borrow().as_ref().is_some_and(|vm| vm.jit_on))
}

pub(crate) fn req_with(header: Option<(&str, &str)>) -> RequestInfo {
    let mut b = http::Request::builder().uri("/");
    if let Some((k, v)) = header {
        b = b.header(k, v);
    }
    let (parts, _) = b.body(()).unwrap().into_parts();
    RequestInfo {
        parts,
        client_ip: "127.0.0.1".parse().unwrap(),
        host: "h".into(),
        peer_trusted: false,
    }
}

pub(crate) fn call(
    src: &ScriptSource,
    header: Option<(&str, &str)>,
) -> Result<Option<String>, ScriptError> {
    call_lane(
        src,
        &Arc::new(BTreeMap::new()),
        req_with(header),
        RuleCtx::default(),
    )
    .1
}

/// A script loaded with its own memory limit and instruction budget.
pub(crate) fn limited_src(
    text: &str,
    memory: usize,
    budget: u64,
) -> (tempfile::TempDir, ScriptSource) {
    let (d, mut src) = load_src(text);
    src.memory_limit = memory;
    src.instruction_budget = budget;
    (d, src)
}
