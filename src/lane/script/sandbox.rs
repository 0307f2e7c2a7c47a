//! Layer: lane. Building a script's sandboxed VM: LuaJIT with its compiler
//! off (or checked on), loaders, the garbage collector's controls and the
//! environment escapes removed, an `os` subset, `graygate.*`, `ngx`, the
//! `req` object, read-only library tables (`lock.lua`), pcall & co. that
//! honour the budget (`prelude.lua`), `require` of the preloaded modules,
//! and the globals frozen after the top level ran.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use mlua::{Function, Lua, LuaOptions, MultiValue, StdLib, Table, Value};

use super::error::lua_error;
use super::limits::{budget_counter, classify, Guard, TOP_LEVEL_BUDGETS};
use super::load::{ScriptSource, BUILTIN_MODULES};
use super::req::req_object;
use crate::base::lists::IpList;
use crate::config::ConfigError;

/// A built VM: the lane function, bound to one script load.
pub(super) struct ScriptVm {
    pub(super) id: u64,
    pub(super) lua: Lua,
    pub(super) lane_fn: Function,
    /// `lane_fn` behind its entry, which empties the per-request globals
    /// before each call.
    pub(super) entry: Entry,
    /// The lists the VM was built with (a native entry's `in_list` verdicts).
    pub(super) lists: Arc<BTreeMap<String, IpList>>,
    /// The `ngx` glue's `reset`: empties the caches a call's host calls
    /// filled (`Current::ngx_cached`), after a native entry's call.
    pub(super) reset: Function,
    pub(super) guard: Rc<Guard>,
    pub(super) budget: i64,
    /// `jit.status()` once the VM was set up.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) jit_on: bool,
}

/// How a VM calls its lane function.
pub(super) enum Entry {
    /// A script that mentions `ngx.`: the `ngx` glue's entry, which also
    /// empties the `ngx` caches (see `ngx::PerRequest`); `req` is its
    /// upvalue.
    Ngx(Function),
    /// Any other script: `lane::native`'s entry, called with the request
    /// values the source names.
    Native(crate::lane::native::Prefetch, Function),
}

/// Base functions taken out of the sandbox: loaders (text or bytecode),
/// the garbage collector's controls, the function-environment escapes
/// (`getfenv(0)` is the real global table, `setfenv` could swap a
/// library function's), `newproxy` (userdata with a shared metatable),
/// and `jit` (after `jit_off.lua`).
const REMOVED_GLOBALS: [&str; 10] = [
    "dofile",
    "loadfile",
    "load",
    "loadstring",
    "collectgarbage",
    "gcinfo",
    "getfenv",
    "setfenv",
    "newproxy",
    "jit",
];

/// Library tables `lock.lua` wraps (inner ones first).
const LOCKED_LIBRARIES: [&str; 10] = [
    "ngx.req",
    "ngx.shared",
    "string",
    "table",
    "math",
    "bit",
    "coroutine",
    "os",
    "ngx",
    "graygate",
];

thread_local! {
    /// This thread's VM, built lazily for the serving generation.
    pub(super) static VM: std::cell::RefCell<Option<ScriptVm>> =
        const { std::cell::RefCell::new(None) };
}

impl ScriptSource {
    /// Compiles and runs the script's top level in a fresh VM, proving it
    /// yields a lane function. Errors carry the script's file:line.
    pub fn validate(&self, lists: &Arc<BTreeMap<String, IpList>>) -> Result<(), ConfigError> {
        ScriptVm::build(self, lists.clone()).map(|_| ())
    }
}

impl ScriptVm {
    pub(super) fn build(
        src: &ScriptSource,
        lists: Arc<BTreeMap<String, IpList>>,
    ) -> Result<ScriptVm, ConfigError> {
        let file = &src.path;
        let le = |e: mlua::Error| ConfigError::from(lua_error(file, &e));
        // LuaJIT 2.1 (OpenResty's branch, as nginx+lua runs). `jit` is
        // opened (that is what switches the compiler on), switched off
        // unless `src.jit`, and removed from the environment either way.
        let lua = Lua::new_with(
            StdLib::STRING | StdLib::TABLE | StdLib::MATH | StdLib::BIT | StdLib::JIT,
            LuaOptions::new(),
        )
        .map_err(le)?;
        lua.load(if src.jit {
            include_str!("jit_on.lua")
        } else {
            include_str!("jit_off.lua")
        })
        .set_name("=graygate_jit")
        .exec()
        .map_err(le)?;
        let jit_on: bool = lua
            .load("return jit.status()")
            .set_name("=graygate_jit")
            .eval()
            .map_err(le)?;
        lua.set_memory_limit(src.memory_limit).map_err(le)?;
        let globals = lua.globals();
        for name in REMOVED_GLOBALS {
            globals.raw_set(name, Value::Nil).map_err(le)?;
        }
        // string.dump makes bytecode; nothing may load it anyway.
        if let Ok(Value::Table(st)) = globals.raw_get::<Value>("string") {
            st.raw_set("dump", Value::Nil).map_err(le)?;
        }
        install_os_subset(&lua, &globals).map_err(le)?;
        // LuaJIT's `table.new` / `table.clear`, which OpenResty code takes by
        // `require "table.new"`: LuaJIT registers them as preloaded modules;
        // running each adds its field to `table` (before it is locked).
        let preload: Table = lua.named_registry_value("_PRELOAD").map_err(le)?;
        for m in ["table.new", "table.clear"] {
            let open: Function = preload.raw_get(m).map_err(le)?;
            open.call::<()>(m).map_err(le)?;
        }

        // graygate.* helpers.
        let gg = lua.create_table().map_err(le)?;
        let lists_for_fn = lists.clone();
        gg.raw_set(
            "in_list",
            lua.create_function(
                move |_, (name, ip): (mlua::LuaString, Option<mlua::LuaString>)| {
                    let name = name.to_str()?;
                    let list = lists_for_fn.get(&*name).ok_or_else(|| {
                        mlua::Error::runtime(format!("unknown list {:?}", &*name))
                    })?;
                    Ok(ip.is_some_and(|ip| ip.to_str().is_ok_and(|s| list.contains_str(&s))))
                },
            )
            .map_err(le)?,
        )
        .map_err(le)?;
        gg.raw_set(
            "bucket",
            lua.create_function(|_, s: mlua::BString| Ok(crate::lane::bucket(&s)))
                .map_err(le)?,
        )
        .map_err(le)?;
        gg.raw_set(
            "murmur3",
            lua.create_function(|_, s: mlua::BString| Ok(crate::lane::murmur3(&s)))
                .map_err(le)?,
        )
        .map_err(le)?;
        globals.raw_set("graygate", gg).map_err(le)?;
        let mentioned = crate::lane::ngx::mentioned(src.texts());
        let uses_ngx = mentioned.ngx;
        let per_request =
            crate::lane::ngx::install(&lua, &globals, &src.dicts, mentioned, jit_on).map_err(le)?;
        // A native script's named request values come as the call's
        // arguments (`lane::native`); its glue wraps `graygate.bucket` and
        // `ngx.req.set_header` before the libraries are locked.
        let req = req_object(&lua, lists.clone()).map_err(le)?;
        let native = match uses_ngx {
            false => {
                let p = crate::lane::native::Prefetch::mentioned(src.texts(), &lists);
                let make = crate::lane::native::install(&lua, &p, &req, &globals).map_err(le)?;
                Some((p, make))
            }
            true => None,
        };

        // Budget guard; the prelude makes pcall & co. honour it.
        let guard = Rc::new(Guard {
            locate_above: src.memory_limit / 2,
            ..Guard::default()
        });
        let counter = budget_counter(&lua, &guard).map_err(le)?;
        // `graygate.bucket(…)` calls read it from the budget table where
        // that is the same function (`budget::direct_bucket`): the one the
        // native glue installed, if it did, or the host's.
        let direct_bucket = crate::lane::budget::direct_bucket(src.texts());
        if direct_bucket {
            let bucket: Value = globals
                .raw_get::<Table>("graygate")
                .and_then(|g| g.raw_get("bucket"))
                .map_err(le)?;
            counter.raw_set("bucket", bucket).map_err(le)?;
        }
        let g = guard.clone();
        let killed = lua
            .create_function(move |_, ()| Ok(g.killed.get()))
            .map_err(le)?;
        let prelude_args = (
            globals.raw_get::<Value>("pcall").map_err(le)?,
            globals.raw_get::<Value>("xpcall").map_err(le)?,
            globals
                .raw_get::<Table>("coroutine")
                .and_then(|c| c.raw_get::<Value>("resume"))
                .map_err(le)?,
            killed,
            globals.raw_get::<Value>("error").map_err(le)?,
        );
        lua.load(include_str!("prelude.lua"))
            .set_name("=graygate_prelude")
            .call::<()>(prelude_args)
            .map_err(le)?;
        lua.load(include_str!("lock.lua"))
            .set_name("=graygate_lock")
            .call::<()>((&globals, LOCKED_LIBRARIES, &req))
            .map_err(le)?;

        // Globals: the script's chunks run in `env`. While loading, `env`
        // reads through to the base globals and keeps what the top level
        // defines; afterwards everything is frozen into `frozen` and `env`
        // only collects per-request writes, cleared after every call.
        let env = lua.create_table().map_err(le)?;
        let loading_mt = lua.create_table().map_err(le)?;
        loading_mt.raw_set("__index", &globals).map_err(le)?;
        env.set_metatable(Some(loading_mt)).map_err(le)?;

        // require: modules preloaded at load time, resolved inside the
        // scripts directory only, each run once.
        let loaded = lua.create_table().map_err(le)?;
        let modules: BTreeMap<String, (PathBuf, String)> = src.modules.clone();
        let menv = env.clone();
        let mcounter = counter.clone();
        let base = globals.clone();
        let require = lua
            .create_function(move |lua, name: String| {
                if BUILTIN_MODULES.contains(&name.as_str()) {
                    return match name.strip_prefix("table.") {
                        // `table.new` / `table.clear`: fields of `table`.
                        Some(field) => base.raw_get::<Table>("table")?.get::<Value>(field),
                        None => base.raw_get::<Value>(name.as_str()),
                    };
                }
                if let Ok(v) = loaded.raw_get::<Value>(name.as_str()) {
                    if !v.is_nil() {
                        return Ok(v);
                    }
                }
                let (path, text) = modules.get(&name).ok_or_else(|| {
                    mlua::Error::runtime(format!(
                        "module {name:?} not found in the scripts directory"
                    ))
                })?;
                let name_at = format!("@{}", path.display());
                syntax_check(lua, text, &name_at)?;
                let code = crate::lane::budget::rewrite_with(text, direct_bucket).map_err(|e| {
                    mlua::Error::runtime(format!("{}:{}: {}", path.display(), e.line, e.message))
                })?;
                let v: Value = lua
                    .load(code)
                    .set_name(name_at)
                    .set_mode(mlua::chunk::ChunkMode::Text)
                    .set_environment(menv.clone())
                    .call((mcounter.clone(), name.as_str()))?;
                let v = if v.is_nil() { Value::Boolean(true) } else { v };
                loaded.raw_set(name.as_str(), v.clone())?;
                Ok(v)
            })
            .map_err(le)?;
        globals.raw_set("require", require).map_err(le)?;

        let budget = i64::try_from(src.instruction_budget).unwrap_or(i64::MAX);
        syntax_check(&lua, &src.source, &format!("@{}", file.display())).map_err(le)?;
        let code = crate::lane::budget::rewrite_with(&src.source, direct_bucket)
            .map_err(|e| ConfigError::new(file, Some(e.line), e.message))?;
        // The top level's first check ticks and takes the first chunk.
        guard.arm(budget.saturating_mul(TOP_LEVEL_BUDGETS));
        counter.raw_set(1, 0).map_err(le)?;
        let top: MultiValue = lua
            .load(code)
            .set_name(format!("@{}", file.display()))
            .set_mode(mlua::chunk::ChunkMode::Text)
            .set_environment(env.clone())
            .call(counter.clone())
            .map_err(|e| ConfigError::from(classify(&guard, file, &e, None).1))?;
        let lane_fn =
            match top.into_iter().next() {
                Some(Value::Function(f)) => f,
                Some(Value::Table(t)) => match t.raw_get::<Value>("lane").map_err(le)? {
                    Value::Function(f) => f,
                    _ => {
                        return Err(ConfigError::new(
                            file,
                            None,
                            "the script's module table has no `lane` function",
                        ))
                    }
                },
                _ => return Err(ConfigError::new(
                    file,
                    None,
                    "the script must return a function lane(req) or a table with a `lane` function",
                )),
            };

        // Freeze: base globals plus what the top level defined.
        let frozen = lua.create_table().map_err(le)?;
        for t in [&globals, &env] {
            for pair in t.pairs::<Value, Value>() {
                let (k, v) = pair.map_err(le)?;
                frozen.raw_set(k, v).map_err(le)?;
            }
        }
        frozen.raw_set("_G", &env).map_err(le)?;
        env.clear().map_err(le)?;
        let mt = lua.create_table().map_err(le)?;
        mt.raw_set("__index", frozen).map_err(le)?;
        mt.raw_set("__metatable", false).map_err(le)?;
        env.set_metatable(Some(mt)).map_err(le)?;

        let entry = match native {
            Some((p, make)) => Entry::Native(
                p,
                make.call::<Function>((lane_fn.clone(), env.clone()))
                    .map_err(le)?,
            ),
            None => Entry::Ngx(
                per_request
                    .make_entry
                    .call::<Function>((lane_fn.clone(), env.clone(), &req))
                    .map_err(le)?,
            ),
        };
        Ok(ScriptVm {
            id: src.id,
            lua,
            lane_fn,
            entry,
            lists,
            reset: per_request.reset,
            guard,
            budget,
            jit_on,
        })
    }
}

/// Compiles `text` as written, before its budget checks are: a syntax error
/// is reported as Lua reports it for the file (the rewrite's wrapper would
/// turn a stray `end` into "')' expected" on a line past the end).
fn syntax_check(lua: &Lua, text: &str, name: &str) -> mlua::Result<()> {
    lua.load(text)
        .set_name(name)
        .set_mode(mlua::chunk::ChunkMode::Text)
        .into_function()
        .map(drop)
}

/// `os` without anything that touches the process or files.
fn install_os_subset(lua: &Lua, globals: &Table) -> mlua::Result<()> {
    let os = lua.create_table()?;
    os.raw_set(
        "time",
        lua.create_function(|_, t: Option<Table>| {
            if t.is_some() {
                return Err(mlua::Error::runtime(
                    "os.time(table) is not supported; use ngx.time()",
                ));
            }
            Ok(SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64))
        })?,
    )?;
    let start = std::time::Instant::now();
    os.raw_set(
        "clock",
        lua.create_function(move |_, ()| Ok(start.elapsed().as_secs_f64()))?,
    )?;
    globals.raw_set("os", os)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{both_modes, call, load_src};
    use super::super::Limit;

    #[test]
    fn table_new_and_clear_as_openresty_requires_them() {
        both_modes(table_new_and_clear_as_openresty_requires_them_in);
    }

    fn table_new_and_clear_as_openresty_requires_them_in() {
        let (_d, src) = load_src(
            "local new_tab = require 'table.new'\nlocal clear_tab = require('table.clear')\n\
             return function()\n  local t = new_tab(4, 2)\n  t[1], t.k = 1, 2\n\
             local n = #t\n  clear_tab(t)\n\
             return n .. tostring(next(t)) .. tostring(table.new == new_tab and table.clear == clear_tab)\nend\n",
        );
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("1niltrue"));
        // Preallocation is still under the VM's memory limit.
        let (_d, src) = load_src(
            "local new_tab = require 'table.new'\nreturn function() local t = new_tab(2^27, 0) return 'x' end\n",
        );
        assert_eq!(call(&src, None).unwrap_err().limit, Some(Limit::Memory));
    }

    #[test]
    fn libraries_and_the_string_metatable_cannot_carry_state() {
        both_modes(libraries_and_the_string_metatable_cannot_carry_state_in);
    }

    fn libraries_and_the_string_metatable_cannot_carry_state_in() {
        for (write, err) in [
            ("string.leak = 1", "string is read-only"),
            ("table.leak = 1", "table is read-only"),
            ("math.leak = 1", "math is read-only"),
            ("bit.leak = 1", "bit is read-only"),
            ("os.leak = 1", "os is read-only"),
            ("ngx.leak = 1", "ngx is read-only"),
            ("ngx.req.leak = 1", "ngx.req is read-only"),
            ("ngx.shared.leak = 1", "ngx.shared is read-only"),
            ("coroutine.leak = 1", "coroutine is read-only"),
            ("graygate.leak = 1", "graygate is read-only"),
            ("rawset(string, 'leak', 1)", "string is read-only"),
            ("table.insert(math, 1)", "math is read-only"),
            ("getmetatable('').__index.leak = 1", "attempt to index"),
            ("setmetatable(string, nil)", "protected metatable"),
        ] {
            let (_d, src) = load_src(&format!(
                "return function(req)\n  if req:header('x-w') then {write} end\n  return tostring(string.leak) .. tostring(math[1]) .. tostring(('').leak)\nend\n"
            ));
            let e = call(&src, Some(("x-w", "1"))).unwrap_err();
            assert!(e.message.contains(err), "{write}: {e}");
            assert!(e.message.contains("t.lua:2:"), "{write}: {e}");
            assert_eq!(
                call(&src, None).unwrap().as_deref(),
                Some("nilnilnil"),
                "{write}"
            );
        }
        // Reading through the proxies still works, rawset on the
        // per-request globals too (cleared after the call).
        let (_d, src) = load_src(
            "return function()\n  local t = {} table.insert(t, 'a') rawset(_G, 'g', (rawget(_G, 'g') or 0) + 1)\n  return string.upper(t[1]) .. ('b'):upper() .. math.floor(2.5) .. bit.band(7, 3) .. g\nend\n",
        );
        for _ in 0..2 {
            assert_eq!(call(&src, None).unwrap().as_deref(), Some("AB231"));
        }
    }

    #[test]
    fn globals_do_not_leak_between_requests() {
        both_modes(globals_do_not_leak_between_requests_in);
    }

    fn globals_do_not_leak_between_requests_in() {
        let (_d, src) = load_src(
            "base = 10\nreturn function()\n  hits = (hits or 0) + 1\n  base = base + 1\n  _G.other = (_G.other or 0) + 1\n  return hits .. '-' .. base .. '-' .. other\nend\n",
        );
        for _ in 0..3 {
            assert_eq!(call(&src, None).unwrap().as_deref(), Some("1-11-1"));
        }
        // The req object is read-only: nothing can be left on it.
        let (_d, src) = load_src("return function(req) req.ip = 'x' return 'gray' end\n");
        assert!(call(&src, None).unwrap_err().message.contains("read-only"));
        // Not by rawset either (it reached the next request).
        let (_d, src) = load_src(
            "return function(req)\n  local seen = tostring(rawget(req, 'x'))\n  if req:header('x-w') then rawset(req, 'x', 1) end\n  return seen\nend\n",
        );
        let e = call(&src, Some(("x-w", "1"))).unwrap_err();
        assert!(e.message.contains("req is read-only"), "{e}");
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("nil"));
        let (_d, src) = load_src(
            "return function(req) return req.method .. req.host .. req.path .. req.query .. tostring(req.nope) end\n",
        );
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("GETh/nil"));
        // The protected environment cannot be swapped out.
        let (_d, src) = load_src("return function() setmetatable(_G, nil) return 'x' end\n");
        assert!(call(&src, None).is_err());
    }

    #[test]
    fn sandbox_has_no_process_file_or_loader_access() {
        both_modes(sandbox_has_no_process_file_or_loader_access_in);
    }

    fn sandbox_has_no_process_file_or_loader_access_in() {
        for (expr, want) in [
            ("type(io)", "nil"),
            ("type(os.execute)", "nil"),
            ("type(os.getenv)", "nil"),
            ("type(os.remove)", "nil"),
            ("type(debug)", "nil"),
            ("type(ffi)", "nil"),
            ("type(jit)", "nil"),
            // LuaJIT preloads these; `require` resolves only built-ins and
            // the scripts directory.
            ("tostring((pcall(require, 'jit')))", "false"),
            ("tostring((pcall(require, 'jit.util')))", "false"),
            ("tostring((pcall(require, 'jit.opt')))", "false"),
            ("type(package)", "nil"),
            ("type(dofile)", "nil"),
            ("type(loadfile)", "nil"),
            ("type(load)", "nil"),
            ("type(loadstring)", "nil"),
            ("type(string.dump)", "nil"),
            ("type(collectgarbage)", "nil"),
            ("type(getfenv)", "nil"),
            ("type(setfenv)", "nil"),
            ("type(newproxy)", "nil"),
            ("type(gcinfo)", "nil"),
            ("type(module)", "nil"),
            ("tostring(os.time() == math.floor(os.time()))", "true"),
        ] {
            let (_d, src) = load_src(&format!("return function() return {expr} end\n"));
            assert_eq!(call(&src, None).unwrap().as_deref(), Some(want), "{expr}");
        }
        // A module name computed at run time resolves only among the
        // modules found in the scripts directory at load time.
        let (_d, src) =
            load_src("return function() local m = '/etc/passwd' return require(m) end\n");
        let e = call(&src, None).unwrap_err();
        assert!(
            e.message.contains("not found in the scripts directory"),
            "{e}"
        );
    }
}
