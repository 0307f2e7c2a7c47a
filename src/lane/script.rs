//! Layer: lane. The Lua lane script: loading (with the modules it requires, so
//! a reload validates and watches them all), a sandboxed VM per worker thread
//! rebuilt lazily when the generation changes, and the synchronous lane call.
//! The VM is LuaJIT 2.1 — an interpreter by default, with its trace compiler
//! when `script_limits.jit` is set — with read-only library tables; the
//! instruction budget is kept by checks written into the source at load
//! (`lane::budget`), which compiled traces run like the rest of the code.
//!
//! Request data reaches Lua lazily: a single `req` table per VM whose fields
//! and methods read the request currently being decided (lent to the call
//! through a scoped thread-local); nothing is copied into Lua tables per
//! request. A native script's literally named values come as the call's
//! arguments instead (`lane::native`).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::time::{SystemTime, UNIX_EPOCH};

use mlua::{Function, Lua, LuaOptions, MultiValue, StdLib, Table, Value};

use super::shared_dict::SharedDict;
use super::RequestInfo;
use crate::base::lists::IpList;
use crate::config::{find_line, ConfigError};

use crate::config::{DEFAULT_INSTRUCTION_BUDGET, DEFAULT_MEMORY_LIMIT};
/// The script's top level (run once per load) may run this many budgets,
/// so building big tables at load time is fine.
const TOP_LEVEL_BUDGETS: i64 = 100;
/// What one budget check (one loop iteration, one function call) charges
/// to `instruction_budget`: about the bytecodes an empty loop's iteration
/// runs, its check included (~10 for `while true do end`), so the default
/// stops a runaway about as soon as the count hook did (criterion
/// `script/runaway`: 0.3 ms on the interpreter; at 2 per check it took
/// 1.5 ms). Straight-line code between checks is bounded by the script's
/// length and not charged.
pub const CHECK_WEIGHT: i64 = 10;
/// Checks the Lua side counts down between two host calls (`tick`): one
/// host call per ~100 loop iterations keeps hot loops fast, and places a
/// memory error as finely as the count hook (every 1,000 instructions)
/// did until the VM holds half its limit; above that every check ticks.
const TICK_EVERY: i64 = 100;

/// The script and every module it requires, read from disk at load time.
#[derive(Debug)]
pub struct ScriptSource {
    pub path: PathBuf,
    pub dir: PathBuf,
    pub source: String,
    /// Module name → (file, source), resolved inside `dir` only.
    pub modules: BTreeMap<String, (PathBuf, String)>,
    pub instruction_budget: u64,
    pub memory_limit: usize,
    /// LuaJIT's trace compiler on (`script_limits.jit`).
    pub jit: bool,
    /// `ngx.shared` dictionaries the script may use.
    pub dicts: BTreeMap<String, Arc<SharedDict>>,
    /// Unique per load; a VM built for another id is rebuilt.
    pub id: u64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl ScriptSource {
    /// Reads the script and, transitively, the modules it `require`s.
    pub fn load(path: &Path) -> Result<ScriptSource, ConfigError> {
        Self::load_from(&crate::config::docs::FileDocs, path)
    }

    /// As [`ScriptSource::load`], reading the script and its modules from
    /// `docs` (files or a store's snapshot).
    pub fn load_from(
        docs: &dyn crate::config::docs::Docs,
        path: &Path,
    ) -> Result<ScriptSource, ConfigError> {
        let source = read_script(docs, path)?;
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let mut modules = BTreeMap::new();
        let mut pending = vec![(path.to_path_buf(), source.clone())];
        while let Some((file, text)) = pending.pop() {
            for name in required_modules(&text) {
                if modules.contains_key(&name) || BUILTIN_MODULES.contains(&name.as_str()) {
                    continue;
                }
                let mpath = module_path(&dir, &name).ok_or_else(|| {
                    ConfigError::new(
                        &file,
                        find_line(&text, None, &name),
                        format!("invalid module name {name:?} (letters, digits, _ and . only)"),
                    )
                })?;
                let mtext = read_script(docs, &mpath).map_err(|e| {
                    ConfigError::new(
                        &file,
                        find_line(&text, None, &name),
                        format!("require {name:?}: {}", e.message),
                    )
                })?;
                pending.push((mpath.clone(), mtext.clone()));
                modules.insert(name, (mpath, mtext));
            }
        }
        Ok(ScriptSource {
            path: path.to_path_buf(),
            dir,
            source,
            modules,
            instruction_budget: DEFAULT_INSTRUCTION_BUDGET,
            memory_limit: DEFAULT_MEMORY_LIMIT,
            jit: false,
            dicts: BTreeMap::new(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The script's and its modules' source text.
    pub(crate) fn texts(&self) -> impl Iterator<Item = &str> + Clone {
        std::iter::once(self.source.as_str())
            .chain(self.modules.values().map(|(_, text)| text.as_str()))
    }

    /// Every file this script was built from (for the reload watcher).
    pub fn files(&self) -> Vec<PathBuf> {
        let mut v = vec![self.path.clone()];
        v.extend(self.modules.values().map(|(p, _)| p.clone()));
        v
    }

    /// Compiles and runs the script's top level in a fresh VM, proving it
    /// yields a lane function. Errors carry the script's file:line.
    pub fn validate(&self, lists: &Arc<BTreeMap<String, IpList>>) -> Result<(), ConfigError> {
        ScriptVm::build(self, lists.clone()).map(|_| ())
    }
}

/// Libraries `require` returns from the sandbox itself (OpenResty scripts
/// often start with `local bit = require "bit"`).
const BUILTIN_MODULES: [&str; 8] = [
    "bit",
    "ngx",
    "string",
    "table",
    "math",
    "coroutine",
    "table.new",
    "table.clear",
];

/// Reads Lua source text; precompiled bytecode is refused.
fn read_script(docs: &dyn crate::config::docs::Docs, path: &Path) -> Result<String, ConfigError> {
    let bytes = docs.read_bytes(path)?;
    if bytes.first() == Some(&0x1b) {
        return Err(ConfigError::new(
            path,
            Some(1),
            "precompiled Lua bytecode is not allowed; ship the source",
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| ConfigError::new(path, None, "cannot read: not valid UTF-8 text"))
}

fn required_modules(text: &str) -> Vec<String> {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| {
        regex::Regex::new(r#"require\s*\(?\s*["']([^"']+)["']"#).expect("static regex")
    });
    static COMMENTS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let comments = COMMENTS
        .get_or_init(|| regex::Regex::new(r"(?s)--\[\[.*?\]\]|--[^\n]*").expect("static regex"));
    let code = comments.replace_all(text, "");
    re.captures_iter(&code).map(|c| c[1].to_string()).collect()
}

fn module_path(dir: &Path, name: &str) -> Option<PathBuf> {
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
        && !name.starts_with('.')
        && !name.contains("..");
    ok.then(|| dir.join(format!("{}.lua", name.replace('.', "/"))))
}

/// Converts an mlua error into a located message, pulling `file:line`
/// out of Lua's own message when it carries one.
fn lua_error(default_file: &Path, err: &mlua::Error) -> Located {
    let msg = err.to_string();
    let first = msg.lines().next().unwrap_or("").trim();
    // Lua messages look like "path/to/file.lua:12: message" (possibly after
    // "syntax error: " or "runtime error: ").
    let body = first
        .trim_start_matches("syntax error: ")
        .trim_start_matches("runtime error: ");
    if let Some((file, rest)) = body.split_once(".lua:") {
        if let Some((line, message)) = rest.split_once(':') {
            if let Ok(n) = line.parse::<usize>() {
                return Located::new(format!("{file}.lua"), Some(n), message.trim());
            }
        }
    }
    Located::new(default_file, None, first)
}

/// The rule verdict handed to the script (`req.rule_lane`, `req.rule_name`).
#[derive(Debug, Clone, Default)]
pub struct RuleCtx {
    pub lane: Option<Arc<str>>,
    pub name: Option<Arc<str>>,
}

/// What a lane call keeps beside the request being decided.
#[derive(Default)]
pub(crate) struct Current {
    pub rule: RuleCtx,
    /// Cookies and arguments split once per request, on first use.
    pub cookies_args: super::ngx::CookiesAndArgs,
    /// Set by the `ngx` host calls that fill per-request caches in Lua;
    /// the call empties them afterwards (`ScriptVm::reset`).
    pub ngx_cached: bool,
}

/// This thread's slot beside the request being decided: the request as
/// the script changed it, and its [`Current`]. It lives as long as the
/// thread and is filled in place per call.
#[derive(Default)]
struct Slot {
    /// A copy of the request made at the first change
    /// (`ngx.req.set_header`, `ngx.var.args = …`), which every later read
    /// of the call sees; it replaces the request only when the call
    /// succeeds, so a failing script leaves the request untouched.
    edited: Option<Box<RequestInfo>>,
    cur: Current,
}

// Per-thread slots: the request being decided — borrowed for the call, so
// it is never moved in or out (moving it into a thread-local and back
// cost ~8 copies of it, ~450 instructions, callgrind) — its slot, and this
// thread's VM.
scoped_tls::scoped_thread_local!(static REQ: RequestInfo);
thread_local! {
    static CURRENT: RefCell<Slot> = RefCell::new(Slot::default());
    static VM: RefCell<Option<ScriptVm>> = const { RefCell::new(None) };
}

fn outside() -> mlua::Error {
    mlua::Error::runtime("request data used outside a lane call")
}

/// Runs `f` on the request lent to the call and this thread's slot; an
/// error outside a lane call.
#[inline(always)]
fn lent<R>(f: impl FnOnce(&RequestInfo, &RefCell<Slot>) -> R) -> mlua::Result<R> {
    if !REQ.is_set() {
        return Err(outside());
    }
    Ok(REQ.with(|r| CURRENT.with(|c| f(r, c))))
}

/// Runs `f` on the request being decided (as the script changed it).
pub(crate) fn with_req<R>(f: impl FnOnce(&RequestInfo) -> R) -> mlua::Result<R> {
    lent(|r, c| f(c.borrow().edited.as_deref().unwrap_or(r)))
}

/// Runs `f` on the request being decided and its [`Current`], mutably.
pub(crate) fn with_current<R>(f: impl FnOnce(&RequestInfo, &mut Current) -> R) -> mlua::Result<R> {
    lent(|r, c| {
        let slot = &mut *c.borrow_mut();
        f(slot.edited.as_deref().unwrap_or(r), &mut slot.cur)
    })
}

/// Runs `f` on the request being decided, to change it (e.g.
/// `ngx.req.set_header`): on the call's copy of it, made here the first
/// time (see [`Slot::edited`]).
pub(crate) fn with_edit<R>(f: impl FnOnce(&mut RequestInfo, &mut Current) -> R) -> mlua::Result<R> {
    lent(|r, c| {
        let slot = &mut *c.borrow_mut();
        let req = slot.edited.get_or_insert_with(|| Box::new(r.clone()));
        f(req, &mut slot.cur)
    })
}

/// A lane function's string result that is not UTF-8.
fn not_utf8() -> mlua::Error {
    mlua::Error::runtime("lane() returned a string that is not UTF-8")
}

/// A lane function's result of type `ty` (neither a string nor nil).
fn wrong_type(ty: &str) -> mlua::Error {
    mlua::Error::runtime(format!("lane() returned a {ty} (expected a string or nil)"))
}

fn opt_str(lua: &Lua, s: Option<&[u8]>) -> mlua::Result<Value> {
    match s {
        Some(b) => Ok(Value::String(request_string(lua, b)?)),
        None => Ok(Value::Nil),
    }
}

/// Longest request value [`request_string`] creates outside the VM's
/// memory limit; a longer one takes mlua's protected path.
pub(crate) const UNLIMITED_STRING_MAX: usize = 64 << 10;

/// A Lua string holding a value read from the request being decided (a
/// header, cookie, argument or variable).
///
/// With a memory limit set, mlua creates every string inside a protected
/// call (a `lua_pcall` plus its protected C functions: ~1,700 instructions
/// per string, callgrind, against ~500 for the string itself), so an
/// allocation failure cannot unwind through Rust frames. A request value
/// is bounded by the request size limits (and here by
/// `UNLIMITED_STRING_MAX`), so the limit is lifted for this one
/// allocation — mlua then pushes the string directly, as it does in a VM
/// with no limit — and set again at once. Memory bombs stay stopped: the
/// VM's usage is still counted, so any allocation of the script's own
/// beyond the limit fails as before; a host string can overshoot it by at
/// most one bounded value.
pub(crate) fn request_string(lua: &Lua, b: &[u8]) -> mlua::Result<mlua::LuaString> {
    if b.len() > UNLIMITED_STRING_MAX {
        return lua.create_string(b);
    }
    let limit = lua.set_memory_limit(0)?;
    let s = lua.create_string(b);
    lua.set_memory_limit(limit)?;
    s
}

/// The last of the values a host pushes (a call's arguments, a host
/// function's results) with the VM's memory limit lifted: it pushes
/// nothing and sets the limit (when `Some`) back. mlua pushes the values
/// in order, this one last, before anything runs in the VM again, so no
/// script code runs without the limit; a `String` or `&str` among them is
/// pushed straight onto the stack (a `LuaString` made first costs a
/// reference slot, two moves between Lua threads and its release, ~250
/// instructions a value, callgrind). As with [`request_string`], only
/// bounded request values are pushed that way.
pub(crate) struct Restore(pub Option<usize>);

impl mlua::IntoLuaMulti for Restore {
    fn into_lua_multi(self, lua: &Lua) -> mlua::Result<MultiValue> {
        if let Some(limit) = self.0 {
            lua.set_memory_limit(limit)?;
        }
        Ok(MultiValue::new())
    }
}

/// A host function's result that [`Restore`] lets mlua push directly:
/// packed request bytes as a `String` where they are UTF-8 and within
/// [`UNLIMITED_STRING_MAX`], else a Lua string made by
/// [`request_string`] (or any other value as it is).
pub(crate) type Pushed = mlua::Either<String, Value>;

/// `v` as a [`Pushed`] (see there).
pub(crate) fn pushed(lua: &Lua, v: mlua::Either<Vec<u8>, Value>) -> mlua::Result<Pushed> {
    match v {
        mlua::Either::Left(b) if b.len() <= UNLIMITED_STRING_MAX => match String::from_utf8(b) {
            Ok(s) => Ok(mlua::Either::Left(s)),
            Err(e) => Ok(mlua::Either::Right(Value::String(request_string(
                lua,
                e.as_bytes(),
            )?))),
        },
        mlua::Either::Left(b) => Ok(mlua::Either::Right(Value::String(request_string(lua, &b)?))),
        mlua::Either::Right(v) => Ok(mlua::Either::Right(v)),
    }
}

/// Builds the `req` object scripts see: a table whose methods (`header`,
/// `cookie`, `arg`, `in_list`) are plain functions and whose fields (`ip`,
/// `path`, …) come from an `__index` function; both read the request being
/// decided (`with_req`), so nothing is copied per request. Writes are
/// refused, so a script cannot leave state on it.
///
/// Speed: each callback takes `self` as a `bool` (Lua truthiness, read in
/// place) and its argument as an owned string — cheaper than the registry
/// references a `Value`/`LuaString` argument costs (1.09 → 0.73 µs for the
/// shipped script in `benches/lane_decision.rs`). `header` takes bytes
/// (`BString`): a header name needs no UTF-8 check (~75 instructions per
/// call, callgrind).
fn req_object(lua: &Lua, lists: Arc<BTreeMap<String, IpList>>) -> mlua::Result<Table> {
    let req = lua.create_table()?;
    req.raw_set(
        "header",
        lua.create_function(|lua, (_, name): (bool, mlua::BString)| {
            with_req(|r| opt_str(lua, r.header_bytes(&name).map(|v| v.as_bytes())))?
        })?,
    )?;
    req.raw_set(
        "cookie",
        lua.create_function(|lua, (_, name): (bool, String)| {
            with_req(|r| opt_str(lua, r.cookie(&name).map(str::as_bytes)))?
        })?,
    )?;
    req.raw_set(
        "arg",
        lua.create_function(|lua, (_, name): (bool, String)| {
            with_req(|r| opt_str(lua, r.arg(&name).as_deref().map(str::as_bytes)))?
        })?,
    )?;
    req.raw_set(
        "in_list",
        lua.create_function(move |_, (_, name): (bool, mlua::BString)| {
            let list = list_named(&lists, &name).ok_or_else(|| {
                mlua::Error::runtime(format!("unknown list {:?}", String::from_utf8_lossy(&name)))
            })?;
            with_req(|r| list.contains(r.client_ip))
        })?,
    )?;
    let mt = lua.create_table()?;
    mt.raw_set(
        "__index",
        lua.create_function(
            |lua, (_, key): (bool, mlua::BString)| match key.as_slice() {
                b"rule_lane" => {
                    with_current(|_, c| opt_str(lua, c.rule.lane.as_deref().map(str::as_bytes)))?
                }
                b"rule_name" => {
                    with_current(|_, c| opt_str(lua, c.rule.name.as_deref().map(str::as_bytes)))?
                }
                k => with_req(|r| {
                    let v: Option<std::borrow::Cow<'_, str>> = match k {
                        b"ip" => Some(r.client_ip.to_string().into()),
                        b"method" => Some(r.parts.method.as_str().into()),
                        b"host" => Some(r.host.as_str().into()),
                        b"path" => Some(r.parts.uri.path().into()),
                        b"query" => Some(r.parts.uri.query().unwrap_or("").into()),
                        b"scheme" => Some(crate::lane::scheme(r).into()),
                        _ => None,
                    };
                    opt_str(lua, v.as_deref().map(str::as_bytes))
                })?,
            },
        )?,
    )?;
    mt.raw_set(
        "__newindex",
        lua.create_function(|_, (_, key): (Value, Value)| -> mlua::Result<()> {
            Err(mlua::Error::runtime(format!(
                "req is read-only (assigning {})",
                key.to_string().unwrap_or_default()
            )))
        })?,
    )?;
    mt.raw_set("__metatable", false)?;
    req.set_metatable(Some(mt))?;
    Ok(req)
}

/// The list called `name`: a handful of lists are scanned by bytes (no
/// UTF-8 check of the name per call), more are looked up.
fn list_named<'a>(lists: &'a BTreeMap<String, IpList>, name: &[u8]) -> Option<&'a IpList> {
    if lists.len() <= 8 {
        lists
            .iter()
            .find(|(k, _)| k.as_bytes() == name)
            .map(|(_, l)| l)
    } else {
        lists.get(std::str::from_utf8(name).ok()?)
    }
}

/// Why the last call was stopped by a limit.
#[derive(Debug, Default)]
struct Guard {
    /// Budget (in instructions) left in this call beyond the chunk of
    /// checks the Lua side is counting down.
    left: Cell<i64>,
    /// Above this many bytes every check ticks and records where it is.
    locate_above: usize,
    /// Set once the budget is spent; pcall/coroutine.resume re-raise then.
    killed: Cell<bool>,
    /// `file:line` where the budget ran out.
    killed_at: RefCell<String>,
    /// Last `file:line` a tick saw above `locate_above` (locates memory
    /// errors).
    last_at: RefCell<(String, usize)>,
}

impl Guard {
    /// A fresh `budget` for a call (or a load's top level).
    fn arm(&self, budget: i64) {
        self.killed.set(false);
        self.last_at.borrow_mut().0.clear();
        self.left.set(budget);
    }
}

/// A built VM: the lane function, bound to one script load.
struct ScriptVm {
    id: u64,
    lua: Lua,
    lane_fn: Function,
    /// `lane_fn` behind its entry, which empties the per-request globals
    /// before each call.
    entry: Entry,
    /// The lists the VM was built with (a native entry's `in_list` verdicts).
    lists: Arc<BTreeMap<String, IpList>>,
    /// The `ngx` glue's `reset`: empties the caches a call's host calls
    /// filled (`Current::ngx_cached`), after a native entry's call.
    reset: Function,
    guard: Rc<Guard>,
    budget: i64,
    /// `jit.status()` once the VM was set up.
    #[cfg_attr(not(test), allow(dead_code))]
    jit_on: bool,
}

/// How a VM calls its lane function.
enum Entry {
    /// A script that mentions `ngx.`: the `ngx` glue's entry, which also
    /// empties the `ngx` caches (see `ngx::PerRequest`); `req` is its
    /// upvalue.
    Ngx(Function),
    /// Any other script: `lane::native`'s entry, called with the request
    /// values the source names.
    Native(super::native::Prefetch, Function),
}

/// Switches LuaJIT's trace compiler off for the whole VM (`jit: false`,
/// the default: no machine code is made, so `MemoryDenyWriteExecute`
/// holds), before `jit` is hidden. Refuses to go on if the JIT is still on.
const JIT_OFF: &str = r#"
jit.off()
jit.flush()
if jit.status() then error("LuaJIT's compiler could not be switched off") end
"#;

/// With `jit: true`: the compiler must really be on (LuaJIT switches it on
/// when its `jit` library opens, if the CPU is supported).
const JIT_ON: &str = r#"
if not jit.status() then error("LuaJIT's compiler is not available on this machine") end
"#;

/// Base functions taken out of the sandbox: loaders (text or bytecode),
/// the garbage collector's controls, the function-environment escapes
/// (`getfenv(0)` is the real global table, `setfenv` could swap a
/// library function's), `newproxy` (userdata with a shared metatable),
/// and `jit` (after `JIT_OFF`).
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

/// Makes the shared library tables read-only for scripts: each library
/// (and `ngx.req`, `ngx.shared`) becomes an empty proxy that reads through
/// to the real table and refuses writes (so `pairs(string)` sees an empty
/// table); `rawset` and `table.insert`, the two raw writers, refuse the
/// proxies; the string metatable is hidden. So no request can leave
/// anything in them for the next one.
const LOCK_LIBRARIES: &str = r#"
local G, names, req = ...
local error, setmetatable, tostring = error, setmetatable, tostring
local raw_rawset, raw_insert = rawset, table.insert
local locked = setmetatable({}, { __mode = "k" })
local function refuse(t, k)
  if locked[t] then
    error(locked[t] .. " is read-only (assigning " .. tostring(k) .. ")", 3)
  end
end
G.rawset = function(t, k, v)
  refuse(t, k)
  return raw_rawset(t, k, v)
end
table.insert = function(t, ...)
  refuse(t, "an element")
  return raw_insert(t, ...)
end
for _, name in ipairs(names) do
  local parent, key = G, name
  local dot = name:find(".", 1, true)
  if dot then parent, key = G[name:sub(1, dot - 1)], name:sub(dot + 1) end
  local lib = parent[key]
  local proxy = setmetatable({}, {
    __index = lib,
    __newindex = function(_, k)
      error(name .. " is read-only (assigning " .. tostring(k) .. ")", 2)
    end,
    __metatable = false,
  })
  locked[proxy] = name
  raw_rawset(parent, key, proxy)
end
getmetatable("").__metatable = false
-- `ngx.var` stays an empty table whose writes go to `__newindex`: a raw
-- field would outlive the request.
locked[G.ngx.var] = "ngx.var"
-- `req` is one table per VM: a raw field would reach the next request.
locked[req] = "req"
"#;

/// Library tables `LOCK_LIBRARIES` wraps (inner ones first).
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

/// Lua prelude wrapping the error-catching primitives so a script cannot
/// swallow the budget error: after the budget is spent they re-raise.
const PRELUDE: &str = r#"
local raw_pcall, raw_xpcall, raw_resume, killed, error = ...
local function check(...)
  if killed() then error("instruction budget exceeded", 0) end
  return ...
end
pcall = function(...) return check(raw_pcall(...)) end
xpcall = function(...) return check(raw_xpcall(...)) end
coroutine.resume = function(...) return check(raw_resume(...)) end
"#;

impl ScriptVm {
    fn build(
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
        lua.load(if src.jit { JIT_ON } else { JIT_OFF })
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
            lua.create_function(|_, s: mlua::BString| Ok(super::bucket(&s)))
                .map_err(le)?,
        )
        .map_err(le)?;
        gg.raw_set(
            "murmur3",
            lua.create_function(|_, s: mlua::BString| Ok(super::murmur3(&s)))
                .map_err(le)?,
        )
        .map_err(le)?;
        globals.raw_set("graygate", gg).map_err(le)?;
        let mentioned = super::ngx::mentioned(src.texts());
        let uses_ngx = mentioned.ngx;
        let per_request =
            super::ngx::install(&lua, &globals, &src.dicts, mentioned, jit_on).map_err(le)?;
        // A native script's named request values come as the call's
        // arguments (`lane::native`); its glue wraps `graygate.bucket` and
        // `ngx.req.set_header` before the libraries are locked.
        let req = req_object(&lua, lists.clone()).map_err(le)?;
        let native = match uses_ngx {
            false => {
                let p = super::native::Prefetch::mentioned(src.texts(), &lists);
                let make = super::native::install(&lua, &p, &req, &globals).map_err(le)?;
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
        let direct_bucket = super::budget::direct_bucket(src.texts());
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
        lua.load(PRELUDE)
            .set_name("=graygate_prelude")
            .call::<()>(prelude_args)
            .map_err(le)?;
        lua.load(LOCK_LIBRARIES)
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
                let code = super::budget::rewrite_with(text, direct_bucket).map_err(|e| {
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
        let code = super::budget::rewrite_with(&src.source, direct_bucket)
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

    fn call(&self, req: &RequestInfo) -> mlua::Result<Option<String>> {
        // The Lua counter keeps what the last call left of its chunk (at
        // most TICK_EVERY checks, so a call may run up to that many checks
        // beyond its budget): arming it per call — `Table::raw_set` is a
        // protected call under a memory limit, ~1,600 instructions; a Lua
        // entry function taking it as an argument, ~160 — cost more than
        // the count hook did on the shipped script.
        self.guard.arm(self.budget);
        // Either entry checks the result's type in Lua; it is read from
        // the stack as bytes: no reference to a Lua value is made (~200
        // instructions, callgrind).
        let r = match &self.entry {
            // `req` is the entry's upvalue: no argument to push.
            Entry::Ngx(entry) => entry.call(())?,
            Entry::Native(p, entry) => {
                let r = p.call(&self.lua, entry, &self.lists, req);
                // `ngx` reached by a computed name filled its caches.
                if with_current(|_, c| c.ngx_cached).unwrap_or(true) {
                    let _ = self.reset.call::<()>(());
                }
                r?
            }
        };
        match r {
            (Some(lane), _) => String::from_utf8(lane.into())
                .map(Some)
                .map_err(|_| not_utf8()),
            (None, None) => Ok(None),
            (None, Some(ty)) => Err(wrong_type(&String::from_utf8_lossy(&ty))),
        }
    }
}

/// The table the checks written into the source count with (`lane::budget`):
/// `[1]` the checks left in the current chunk, `tick` the host function
/// called when it runs out. `tick` takes the next chunk from
/// `guard.left`, or — the budget spent — marks the call killed, records
/// where, and raises (every later check ticks again and raises again).
/// While the VM holds more than half its memory limit it records where the
/// script is at every check (to place a memory error) instead of every
/// [`TICK_EVERY`].
fn budget_counter(lua: &Lua, guard: &Rc<Guard>) -> mlua::Result<Table> {
    let t = lua.create_table_with_capacity(1, 1)?;
    let g = guard.clone();
    let tick = lua.create_function(move |lua, ()| -> mlua::Result<i64> {
        let left = g.left.get();
        if g.killed.get() || left < CHECK_WEIGHT {
            if !g.killed.get() {
                g.killed.set(true);
                let (file, line) = script_position(lua);
                *g.killed_at.borrow_mut() = format!("{file}:{line}");
            }
            return Err(mlua::Error::runtime("instruction budget exceeded"));
        }
        let chunk = if lua.used_memory() > g.locate_above {
            let (file, line) = script_position(lua);
            let mut last = g.last_at.borrow_mut();
            if last.0 != file {
                last.0 = file;
            }
            last.1 = line;
            1
        } else {
            TICK_EVERY.min(left / CHECK_WEIGHT)
        };
        g.left.set(left - chunk * CHECK_WEIGHT);
        // This check is the chunk's first.
        Ok(chunk - 1)
    })?;
    t.raw_set("tick", tick)?;
    Ok(t)
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

/// `file:line` of the Lua function calling the current host function.
fn script_position(lua: &Lua) -> (String, usize) {
    lua.inspect_stack(1, |d| {
        let src = d.source();
        let file = src.source.as_deref().unwrap_or("?");
        let file = file.strip_prefix('@').unwrap_or(file).to_string();
        (file, d.current_line().unwrap_or(0))
    })
    .unwrap_or_default()
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

/// Which limit stopped a call, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Instructions,
    Memory,
}

static INSTRUCTION_LIMIT_HITS: AtomicU64 = AtomicU64::new(0);
static MEMORY_LIMIT_HITS: AtomicU64 = AtomicU64::new(0);
static SCRIPT_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Lane calls stopped by the instruction budget since start.
pub fn instruction_limit_hits() -> u64 {
    INSTRUCTION_LIMIT_HITS.load(Ordering::Relaxed)
}

/// Lane calls stopped by the VM memory limit since start.
pub fn memory_limit_hits() -> u64 {
    MEMORY_LIMIT_HITS.load(Ordering::Relaxed)
}

/// Lane calls that failed for any reason (limits included) since start.
pub fn script_errors() -> u64 {
    SCRIPT_ERRORS.load(Ordering::Relaxed)
}

/// Classifies a failed call: budget (located where the hook stopped it),
/// memory (located at the last place seen, or the lane function), or an
/// ordinary error located by Lua's own message.
fn classify(
    guard: &Guard,
    file: &Path,
    err: &mlua::Error,
    lane_fn: Option<&Function>,
) -> (Option<Limit>, Located) {
    if guard.killed.get() {
        let at = guard.killed_at.borrow().clone();
        return (
            Some(Limit::Instructions),
            located(&at, file, "instruction budget exceeded"),
        );
    }
    if is_memory_error(err) {
        let last = guard.last_at.borrow().clone();
        let at = if !last.0.is_empty() {
            format!("{}:{}", last.0, last.1)
        } else if let Some(f) = lane_fn {
            let info = f.info();
            let src = info.source.unwrap_or_default();
            format!(
                "{}:{}",
                src.strip_prefix('@').unwrap_or(&src),
                info.line_defined.unwrap_or(0)
            )
        } else {
            String::new()
        };
        return (
            Some(Limit::Memory),
            located(&at, file, "memory limit exceeded"),
        );
    }
    (None, lua_error(file, err))
}

fn is_memory_error(err: &mlua::Error) -> bool {
    match err {
        mlua::Error::MemoryError(_) => true,
        mlua::Error::CallbackError { cause, .. } => is_memory_error(cause),
        mlua::Error::WithContext { cause, .. } => is_memory_error(cause),
        other => other.to_string().contains("not enough memory"),
    }
}

fn located(at: &str, default_file: &Path, message: &str) -> Located {
    if let Some((file, line)) = at.rsplit_once(':') {
        if let Ok(n) = line.parse::<usize>() {
            if !file.is_empty() {
                return Located::new(file, Some(n), message);
            }
        }
    }
    Located::new(default_file, None, message)
}

/// A message placed in a script file (and line, where known): the form of
/// both load-time errors (turned into a [`ConfigError`]) and runtime
/// failures (a [`ScriptError`] message), printed `file:line: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl Located {
    fn new(file: impl Into<PathBuf>, line: Option<usize>, message: impl Into<String>) -> Located {
        Located {
            file: file.into(),
            line,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file.display(), line, self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl From<Located> for ConfigError {
    fn from(l: Located) -> ConfigError {
        ConfigError::new(l.file, l.line, l.message)
    }
}

/// Error from one lane call, already formatted with the script location.
#[derive(Debug, Clone)]
pub struct ScriptError {
    pub message: String,
    /// Set when a sandbox limit stopped the call.
    pub limit: Option<Limit>,
}

impl std::fmt::Display for ScriptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Runs the lane function of `src` for `req` on this thread's VM, building
/// the VM if it belongs to another load. Returns the request back (with
/// any `ngx.req.set_header` changes when the call succeeded).
pub fn call_lane(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    mut req: RequestInfo,
    rule: RuleCtx,
) -> (RequestInfo, Result<Option<String>, ScriptError>) {
    let (result, edited) = call_with(src, lists, &req, rule);
    if let Some(e) = edited {
        req = *e;
    }
    (req, result)
}

/// [`call_lane`] on a borrowed request: the result, and the request as
/// the script changed it when it did and the call succeeded (boxed: an
/// `Option<RequestInfo>` is copied whole at every move, `None` too).
pub(crate) fn call_with(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    req: &RequestInfo,
    rule: RuleCtx,
) -> (
    Result<Option<String>, ScriptError>,
    Option<Box<RequestInfo>>,
) {
    CURRENT.with(|c| c.borrow_mut().cur.rule = rule);
    let result = REQ.set(req, || run(src, lists, req));
    let edited = CURRENT.with(|c| {
        let slot = &mut *c.borrow_mut();
        let cur = &mut slot.cur;
        cur.rule = RuleCtx::default();
        cur.cookies_args = Default::default();
        cur.ngx_cached = false;
        slot.edited.take()
    });
    let edited = edited.filter(|_| result.is_ok());
    (result, edited)
}

/// The call itself, with `req` set as the request being decided.
fn run(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    req: &RequestInfo,
) -> Result<Option<String>, ScriptError> {
    VM.with(|vm| {
        let mut slot = vm.borrow_mut();
        if slot.as_ref().is_none_or(|v| v.id != src.id) {
            *slot = None;
            match ScriptVm::build(src, lists.clone()) {
                Ok(v) => *slot = Some(v),
                Err(e) => {
                    return Err(ScriptError {
                        message: e.to_string(),
                        limit: None,
                    })
                }
            }
        }
        let vm = slot.as_ref().expect("built above");
        let r = vm.call(req).map_err(|e| {
            let (limit, located) = classify(&vm.guard, &src.path, &e, Some(&vm.lane_fn));
            ScriptError {
                message: located.to_string(),
                limit,
            }
        });
        if let Err(e) = &r {
            SCRIPT_ERRORS.fetch_add(1, Ordering::Relaxed);
            match e.limit {
                Some(Limit::Instructions) => {
                    INSTRUCTION_LIMIT_HITS.fetch_add(1, Ordering::Relaxed);
                }
                Some(Limit::Memory) => {
                    MEMORY_LIMIT_HITS.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
            // After a memory error reclaim what the call left; a VM still
            // near its limit is dropped so the next call starts clean.
            if e.limit == Some(Limit::Memory) {
                let _ = vm.lua.gc_collect();
                if vm.lua.used_memory() > src.memory_limit / 2 {
                    *slot = None;
                }
            }
        }
        r
    })
}

/// Tests: the VM mode (`script_limits.jit`) of the scripts a test thread
/// loads, shared by this module's and `ngx`'s tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::Cell;

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
    pub(crate) fn load_src(text: &str) -> (tempfile::TempDir, super::ScriptSource) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.lua");
        std::fs::write(&p, text).unwrap();
        let mut src = super::ScriptSource::load(&p).unwrap();
        src.jit = jit();
        (d, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
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

    #[test]
    fn syntax_error_is_located() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "s.lua", "return function(req)\n  if then\nend\n");
        let src = ScriptSource::load(&p).unwrap();
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.file.ends_with("s.lua"), "{err}");
        // A stray `end`, in the script and in a module: Lua's own message
        // and line, not the budget rewrite's wrapper's.
        let extra_end = "return function(req)\n  return 'gray'\nend end\n";
        let p = write(d.path(), "e.lua", extra_end);
        let err = validate_error(&p);
        assert_eq!(err.line, Some(3), "{err}");
        assert!(err.message.contains("'<eof>' expected"), "{err}");
        write(d.path(), "m.lua", extra_end);
        let p = write(d.path(), "main.lua", "local m = require('m')\nreturn m\n");
        let err = validate_error(&p);
        assert!(err.file.ends_with("m.lua"), "{err}");
        assert_eq!(err.line, Some(3), "{err}");
    }

    #[test]
    fn modules_are_found_and_recorded() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "lib/util.lua", "return { x = 1 }\n");
        let p = write(
            d.path(),
            "main.lua",
            "local u = require('lib.util')\nreturn function() return u.x == 1 and 'gray' or nil end\n",
        );
        let src = ScriptSource::load(&p).unwrap();
        assert_eq!(src.files().len(), 2);
        src.validate(&Arc::new(BTreeMap::new())).unwrap();
    }

    #[test]
    fn requires_in_comments_are_ignored() {
        assert_eq!(
            required_modules(
                "-- require('a')\n--[[ require('b')\n]] local c = require 'c' -- require('d')\n"
            ),
            vec!["c".to_string()]
        );
    }

    #[test]
    fn require_outside_scripts_dir_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "main.lua",
            "local u = require('..secret')\nreturn function() end\n",
        );
        let err = ScriptSource::load(&p).unwrap_err();
        assert!(err.message.contains("invalid module name"), "{err}");
    }

    /// Why the script at `p` fails to load.
    fn validate_error(p: &Path) -> ConfigError {
        ScriptSource::load(p)
            .unwrap()
            .validate(&Arc::new(BTreeMap::new()))
            .unwrap_err()
    }

    #[test]
    fn must_return_a_function() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "main.lua", "return 42\n");
        let err = validate_error(&p);
        assert!(err.message.contains("must return a function"), "{err}");
    }

    use super::testing::{both_modes, jit, load_src};

    /// Whether this thread's VM runs with LuaJIT's compiler on.
    fn vm_jit_on() -> bool {
        VM.with(|v| v.borrow().as_ref().is_some_and(|vm| vm.jit_on))
    }

    fn req_with(header: Option<(&str, &str)>) -> RequestInfo {
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

    fn call(
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
    fn hot_infinite_loop_is_stopped_located_and_counted() {
        both_modes(hot_infinite_loop_is_stopped_located_and_counted_in);
    }

    fn hot_infinite_loop_is_stopped_located_and_counted_in() {
        let (_d, src) = load_src(
            "return function(req)\n  if req:header('x-loop') then\n    while true do end\n  end\n  return 'gray'\nend\n",
        );
        let before = instruction_limit_hits();
        let e = call(&src, Some(("x-loop", "1"))).unwrap_err();
        assert_eq!(e.limit, Some(Limit::Instructions), "{e}");
        assert!(
            e.message.contains("t.lua:3: instruction budget exceeded"),
            "{e}"
        );
        assert!(instruction_limit_hits() > before);
        // The same VM keeps serving.
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
    }

    #[test]
    fn pcall_and_coroutines_cannot_swallow_the_budget() {
        both_modes(pcall_and_coroutines_cannot_swallow_the_budget_in);
    }

    fn pcall_and_coroutines_cannot_swallow_the_budget_in() {
        for body in [
            "while true do pcall(function() while true do end end) end",
            "while true do xpcall(function() while true do end end, function(e) return e end) end",
            "while true do coroutine.resume(coroutine.create(function() while true do end end)) end",
            "local f = coroutine.wrap(function() while true do end end)\n f()",
            // Caught once, with no check left to pass afterwards: the
            // wrappers re-raise.
            "local ok = pcall(function() while true do end end)\n return 'swallowed'",
            "xpcall(function() while true do end end, function(e) return e end)\n return 'swallowed'",
            "coroutine.resume(coroutine.create(function() while true do end end))\n return 'swallowed'",
        ] {
            let (_d, src) = load_src(&format!("return function()\n{body}\nend\n"));
            let e = call(&src, None).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Instructions), "{body}: {e}");
        }
    }

    #[test]
    fn top_level_gets_a_larger_but_finite_budget() {
        both_modes(top_level_gets_a_larger_but_finite_budget_in);
    }

    fn top_level_gets_a_larger_but_finite_budget_in() {
        // 100,000 checks at load (1M of budget): more than one call's
        // budget, fine.
        let (_d, src) = load_src(
            "local t = {}\nfor i = 1, 100000 do t[i] = i * 2 end\nreturn function() return t[100000] == 200000 and 'gray' or nil end\n",
        );
        src.validate(&Arc::new(BTreeMap::new())).unwrap();
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        // A runaway top level is stopped and the load rejected, located.
        let (_d, src) =
            load_src("local x = 0\nwhile true do x = x + 1 end\nreturn function() end\n");
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.message.contains("instruction budget exceeded"), "{err}");
    }

    #[test]
    fn budget_is_configurable() {
        both_modes(budget_is_configurable_in);
    }

    fn budget_is_configurable_in() {
        // 1,000 checks (10,000 of budget): fine under the default, stopped
        // under 1000.
        let text = "return function()\n local x = 0\n for i = 1, 1000 do x = x + i end\n return 'gray'\nend\n";
        let (_d, mut src) = load_src(text);
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        src.instruction_budget = 1_000;
        src.id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        assert_eq!(
            call(&src, None).unwrap_err().limit,
            Some(Limit::Instructions)
        );
    }

    /// A script loaded with its own memory limit and instruction budget.
    fn limited_src(text: &str, memory: usize, budget: u64) -> (tempfile::TempDir, ScriptSource) {
        let (d, mut src) = load_src(text);
        src.memory_limit = memory;
        src.instruction_budget = budget;
        (d, src)
    }

    #[test]
    fn memory_bomb_is_stopped_by_the_vm_limit() {
        both_modes(memory_bomb_is_stopped_by_the_vm_limit_in);
    }

    fn memory_bomb_is_stopped_by_the_vm_limit_in() {
        for body in [
            "local t = {}\n  while true do t[#t + 1] = string.rep('x', 2^20) .. #t end",
            "return string.rep('x', 2^28)",
            // Table growth: one array doubling after another.
            "local t, i = {}, 0\n  while true do i = i + 1 t[i] = i end",
            // Hash part growth, and a string doubling itself.
            "local t, i = {}, 0\n  while true do i = i + 1 t['k' .. i] = true end",
            "local s = 'x'\n  while true do s = s .. s end",
        ] {
            let (_d, src) = limited_src(
                &format!("return function(req)\n  if req:header('x-bomb') then\n  {body}\n  end\n  return 'gray'\nend\n"),
                16 << 20,
                100_000_000,
            );
            let before = memory_limit_hits();
            let e = call(&src, Some(("x-bomb", "1"))).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Memory), "{body}: {e}");
            assert!(e.message.contains("t.lua:"), "{e}");
            assert!(e.message.contains("memory limit exceeded"), "{e}");
            assert!(memory_limit_hits() > before);
            assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        }
    }

    #[test]
    fn request_strings_leave_the_memory_limit_in_force() {
        both_modes(request_strings_leave_the_memory_limit_in_force_in);
    }

    fn request_strings_leave_the_memory_limit_in_force_in() {
        // Each iteration reads request values (created with the limit lifted
        // for the allocation, see `request_string`) and keeps 1 MiB made
        // from them: the limit still stops the call, long before the
        // instruction budget would (~130 iterations, 130 MiB, without it).
        for read in [
            "req:header('x-bomb')",
            "ngx.var.http_x_bomb",
            "ngx.req.get_method()",
        ] {
            let (_d, src) = limited_src(
                &format!("return function(req)\n  local t = {{}}\n  while true do t[#t + 1] = string.rep({read}, 2^20) .. req.path .. #t end\nend\n"),
                4 << 20,
                2_000,
            );
            let e = call(&src, Some(("x-bomb", "1"))).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Memory), "{read}: {e}");
        }
        // Values longer than the bound take mlua's protected path.
        let (_d, src) = load_src("return function(req) return #req:header('x-big') .. '' end\n");
        let big = "v".repeat(UNLIMITED_STRING_MAX + 1);
        let r = call(&src, Some(("x-big", &big))).unwrap();
        assert_eq!(r.as_deref(), Some(&*(UNLIMITED_STRING_MAX + 1).to_string()));
    }

    #[test]
    fn a_loop_hot_enough_to_be_jit_compiled_is_still_stopped() {
        both_modes(a_loop_hot_enough_to_be_jit_compiled_is_still_stopped_in);
    }

    fn a_loop_hot_enough_to_be_jit_compiled_is_still_stopped_in() {
        // With LuaJIT's compiler on (`jit: true`), this loop becomes a
        // trace after a few dozen iterations: a count hook would never run
        // again and the call would return "done" (3e8 iterations take well
        // under a second compiled). The budget checks written into the
        // source are compiled into the trace and stop it.
        let (_d, src) = load_src(
            "return function()\n  local x = 0\n  for i = 1, 3e8 do x = x + i end\n  return 'done'\nend\n",
        );
        for _ in 0..3 {
            let e = call(&src, None).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Instructions), "{e}");
            assert!(e.message.contains("t.lua:3:"), "{e}");
        }
        // The mode asked for is the mode the VM runs in.
        assert_eq!(vm_jit_on(), jit());
        // A hot inner function called from a loop, likewise.
        let (_d, src) = load_src(
            "local function f(x) return x + 1 end\nreturn function()\n  local x = 0\n  while x < 3e8 do x = f(x) end\n  return 'done'\nend\n",
        );
        assert_eq!(
            call(&src, None).unwrap_err().limit,
            Some(Limit::Instructions)
        );
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

    #[test]
    fn the_rewrites_reserved_names_are_refused_at_load_with_file_and_line() {
        let (_d, src) = load_src("local x = 1\nlocal __gg_b = {}\nreturn function() end\n");
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.message.contains("reserved"), "{err}");
        // In a required module too, placed in the module's file.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "m.lua", "local t = {}\n\nt.__gg = 1\nreturn t\n");
        let p = write(
            d.path(),
            "main.lua",
            "local m = require('m')\nreturn function() end\n",
        );
        let err = validate_error(&p);
        assert!(err.file.ends_with("m.lua"), "{err}");
        assert_eq!(err.line, Some(3), "{err}");
    }

    #[test]
    fn bytecode_is_refused() {
        let lua = Lua::new();
        let f = lua
            .load("return function() return 'gray' end")
            .into_function()
            .unwrap();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("b.lua");
        std::fs::write(&p, f.dump(false)).unwrap();
        let err = ScriptSource::load(&p).unwrap_err();
        assert!(err.message.contains("bytecode"), "{err}");
        // ...as a required module too.
        std::fs::write(d.path().join("m.lua"), f.dump(true)).unwrap();
        let main = write(d.path(), "main.lua", "local m = require('m')\nreturn m\n");
        let err = ScriptSource::load(&main).unwrap_err();
        assert!(err.message.contains("bytecode"), "{err}");
    }

    #[test]
    fn req_in_list_tests_the_client_address() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "t.lua",
            "return function(req)\n  return tostring(req:in_list('office')) .. tostring(graygate.in_list('office', req.ip))\nend\n",
        );
        let src = ScriptSource::load(&p).unwrap();
        let mut lists = BTreeMap::new();
        lists.insert(
            "office".to_string(),
            IpList::parse(Path::new("l"), "127.0.0.0/24\n").unwrap(),
        );
        let lists = Arc::new(lists);
        let r = call_lane(&src, &lists, req_with(None), RuleCtx::default()).1;
        assert_eq!(r.unwrap().as_deref(), Some("truetrue"));
        let mut other = req_with(None);
        other.client_ip = "10.0.0.1".parse().unwrap();
        let r = call_lane(&src, &lists, other, RuleCtx::default()).1;
        assert_eq!(r.unwrap().as_deref(), Some("falsefalse"));
        let (_d2, bad) = load_src("return function(req) return req:in_list('nope') end\n");
        assert!(call(&bad, None)
            .unwrap_err()
            .message
            .contains("unknown list"));
    }

    #[test]
    fn lists_are_found_by_name_however_many() {
        // A few lists are scanned by bytes, more are looked up: same answer.
        for extra in [0, 12] {
            // A fresh load each time: a thread's VM keeps the lists it was
            // built with.
            let (_d, src) = load_src(
                "return function(req)\n  return tostring(req:in_list('office')) .. tostring(req:in_list('vpn'))\nend\n",
            );
            let mut lists = BTreeMap::new();
            lists.insert(
                "office".to_string(),
                IpList::parse(Path::new("l"), "127.0.0.0/24\n").unwrap(),
            );
            lists.insert(
                "vpn".to_string(),
                IpList::parse(Path::new("l"), "10.0.0.0/8\n").unwrap(),
            );
            for i in 0..extra {
                lists.insert(
                    format!("other{i}"),
                    IpList::parse(Path::new("l"), "127.0.0.0/8\n").unwrap(),
                );
            }
            let lists = Arc::new(lists);
            let (_, r) = call_lane(&src, &lists, req_with(None), RuleCtx::default());
            assert_eq!(r.unwrap().as_deref(), Some("truefalse"), "{extra}");
            assert!(list_named(&lists, b"offic").is_none());
            assert!(list_named(&lists, b"office\xff").is_none());
        }
    }

    #[test]
    fn script_sees_the_rule_verdict() {
        both_modes(script_sees_the_rule_verdict_in);
    }

    fn script_sees_the_rule_verdict_in() {
        let (_d, src) = load_src(
            "return function(req)\n  return tostring(req.rule_lane) .. '/' .. tostring(req.rule_name)\nend\n",
        );
        let ctx = RuleCtx {
            lane: Some("gray".into()),
            name: Some("testers".into()),
        };
        let r = call_lane(&src, &Arc::new(BTreeMap::new()), req_with(None), ctx).1;
        assert_eq!(r.unwrap().as_deref(), Some("gray/testers"));
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("nil/nil"));
    }
}
