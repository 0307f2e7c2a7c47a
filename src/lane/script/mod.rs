//! Layer: lane. The Lua lane script: loading (with the modules it requires,
//! so a reload validates and watches them all: `load`), a sandboxed VM per
//! worker thread rebuilt lazily when the generation changes (`sandbox`),
//! its limits (`limits`) and the synchronous lane call (`call`).
//! The VM is LuaJIT 2.1 — an interpreter by default, with its trace compiler
//! when `script_limits.jit` is set — with read-only library tables; the
//! instruction budget is kept by checks written into the source at load
//! (`lane::budget`), which compiled traces run like the rest of the code.
//!
//! Request data reaches Lua lazily: a single `req` table per VM (`req`)
//! whose fields and methods read the request currently being decided (lent
//! to the call through a scoped thread-local, `slot`); nothing is copied
//! into Lua tables per request. Request values become Lua strings with the
//! VM's memory limit lifted for that one allocation (`push`). A native
//! script's literally named values come as the call's arguments instead
//! (`lane::native`).

mod call;
mod error;
mod limits;
mod load;
mod push;
mod req;
mod sandbox;
mod slot;

#[cfg(test)]
pub(crate) mod testing;

use std::sync::Arc;

pub use call::call_lane;
pub(crate) use call::call_with;
pub use error::{Located, ScriptError};
pub use limits::{instruction_limit_hits, memory_limit_hits, script_errors, Limit, CHECK_WEIGHT};
pub use load::ScriptSource;
pub(crate) use push::{pushed, request_string, Pushed, Restore, UNLIMITED_STRING_MAX};
pub(crate) use slot::{with_current, with_edit, with_req};

/// The rule verdict handed to the script (`req.rule_lane`, `req.rule_name`).
#[derive(Debug, Clone, Default)]
pub struct RuleCtx {
    pub lane: Option<Arc<str>>,
    pub name: Option<Arc<str>>,
}
