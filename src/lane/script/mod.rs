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
mod req;
mod sandbox;

#[cfg(test)]
pub(crate) mod testing;

pub use crate::lane::lent::RuleCtx;
pub use call::call_lane;
pub(crate) use call::call_with;
pub use error::{Limit, Located, ScriptError};
pub use limits::{instruction_limit_hits, memory_limit_hits, script_errors, CHECK_WEIGHT};
pub use load::ScriptSource;
