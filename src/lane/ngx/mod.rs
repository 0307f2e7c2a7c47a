//! Layer: lane. The OpenResty-compatible subset scripts see: `ngx.var.*`
//! (`var`), `ngx.req.*` (`req`), `ngx.log` and `print` (`log`),
//! `ngx.crc32_*` and `ngx.md5*` (`digest`), `ngx.time/now`,
//! `ngx.shared.<dict>` (`shared`); `bit` is LuaJIT's own library, opened
//! by the script module. Everything reads the request being decided
//! through the script module's thread-local slot, lazily: nothing is built
//! per request unless the script asks for it, and what it asks for is
//! built once per request (`ngx.var` values, `get_headers()`,
//! `get_uri_args()` are kept in per-request Lua tables, emptied after the
//! call; what the source mentions comes in one host call, `batch`).
//! This module installs the lot and runs the Lua glue (`glue.lua`) that
//! keeps those tables and makes the per-request entry (`PerRequest`).
//! Semantics follow nginx/lua-nginx-module (see the README's "OpenResty
//! compatibility" section for the exact subset).

mod batch;
mod digest;
mod log;
mod req;
mod shared;
mod var;

#[cfg(test)]
pub(crate) mod testing;

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use mlua::{Function, Lua, LuaString, Table, Value};

use super::shared_dict::SharedDict;

pub(crate) use batch::{mentioned, Mentioned};
pub use var::{normalize_uri, variable};

/// Default cap of `get_headers()` / `get_uri_args()` entries (OpenResty's).
const DEFAULT_MAX: usize = 100;

/// Tables that hold one request's data (`ngx.var` and its cache, the
/// cached `get_headers()` / `get_uri_args()`).
struct Caches([Table; 3]);

impl Caches {
    /// Forgets what was cached for the request (when `set_header` /
    /// `ngx.var.args = …` changed what it was built from).
    fn clear(&self) {
        for t in &self.0 {
            let _ = t.clear();
        }
    }
}

/// What the lane call needs of the `ngx` layer, so no request sees
/// another's values: `reset` empties the caches a request left; `make_entry`
/// (lane function, env, req) wraps a lane function into an entry that does so
/// (and empties `env`) before each call, in Lua. The entry is cheaper than
/// `reset` from Rust where the script reads `ngx.*`, and a small cost of
/// its own where it does not, so it is used for scripts whose source
/// mentions `ngx.`; the others are reset from Rust when a host call filled
/// a cache (`Current::ngx_cached`). Either way is complete on its own: the
/// mention only chooses the cheaper one.
pub(crate) struct PerRequest {
    pub reset: Function,
    pub make_entry: Function,
}

/// Installs `ngx` and `print` into `g` (`bit` is LuaJIT's own library);
/// `mentioned` says what the batch fetches; `jit`: LuaJIT's compiler is on.
pub(crate) fn install(
    lua: &Lua,
    g: &Table,
    dicts: &BTreeMap<String, Arc<SharedDict>>,
    mentioned: Mentioned,
    jit: bool,
) -> mlua::Result<PerRequest> {
    let ngx = lua.create_table()?;
    for (name, n) in log::LEVELS {
        ngx.raw_set(name, n)?;
    }
    let var = lua.create_table()?;
    // rcache's four slots in its array part: no new hash key per request.
    let caches = Rc::new(Caches([
        var.clone(),
        lua.create_table()?,
        lua.create_table_with_capacity(4, 0)?,
    ]));
    ngx.raw_set("var", var)?;
    let (get_headers, get_uri_args, reset, make_entry) = glue(lua, &caches, mentioned)?;
    ngx.raw_set("req", req::table(lua, &caches, get_headers, get_uri_args)?)?;
    ngx.raw_set("log", lua.create_function(log::log)?)?;
    digest::install(lua, &ngx, g, jit)?;
    ngx.raw_set(
        "time",
        lua.create_function(|_, ()| Ok(unix_now().as_secs() as i64))?,
    )?;
    ngx.raw_set(
        "now",
        lua.create_function(|_, ()| Ok(unix_now().as_millis() as f64 / 1000.0))?,
    )?;
    ngx.raw_set("update_time", lua.create_function(|_, ()| Ok(()))?)?;
    ngx.raw_set("shared", shared::table(lua, dicts)?)?;
    g.raw_set("ngx", ngx)?;
    // OpenResty's `print`: ngx.log at NOTICE (never the process's stdout).
    g.raw_set("print", log::print(lua)?)?;
    Ok(PerRequest { reset, make_entry })
}

fn unix_now() -> std::time::Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Runs the glue (`glue.lua`), the Lua side of `ngx.var` and
/// `ngx.req.get_headers/get_uri_args`: values are fetched from Rust once
/// per request and kept in per-request tables, so a second read of the
/// same variable is a plain table hit (no host call); `ngx.var` itself
/// stays empty so every write reaches `__newindex`. Returns the glue's
/// `get_headers`, `get_uri_args`, and its `reset` and `make_entry` (see
/// [`PerRequest`]).
fn glue(
    lua: &Lua,
    caches: &Rc<Caches>,
    mentioned: Mentioned,
) -> mlua::Result<(Function, Function, Function, Function)> {
    let Mentioned {
        vars: names,
        headers,
        args,
        ..
    } = mentioned;
    let [var, vcache, rcache] = &caches.0;
    let pr = caches.clone();
    let store = lua.create_function(move |lua, (_, name, value): (bool, LuaString, Value)| {
        var::store(lua, &name.as_bytes(), value)?;
        pr.clear();
        Ok(())
    })?;
    let (build_headers, build_args) = req::builders(lua)?;
    let resolved: Vec<batch::VarName> = names.iter().map(|n| batch::VarName::new(n)).collect();
    let make_fill = lua
        .load(batch::fill_source(&names))
        .set_name("=graygate_ngx_fill")
        .into_function()?;
    lua.load(include_str!("glue.lua"))
        .set_name("=graygate_ngx")
        .call((
            var,
            vcache,
            rcache,
            lua.create_function(var::fetch)?,
            store,
            build_headers,
            build_args,
            lua.create_sequence_from(
                names
                    .iter()
                    .map(|n| lua.create_string(n))
                    .collect::<mlua::Result<Vec<_>>>()?,
            )?,
            lua.create_function(move |lua, ()| batch::fetch_all(lua, &resolved, headers, args))?,
            make_fill,
        ))
}

#[cfg(test)]
mod tests {
    use super::testing::{eval, request, std_req};
    use crate::lane::script::testing::{both_modes, jit};
    use crate::lane::script::{call_lane, RuleCtx, ScriptSource};
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::{SystemTime, UNIX_EPOCH};

    #[test]
    fn ngx_time() {
        let q = |e: &str| eval(&format!("return tostring({e})"), std_req());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let t: f64 = q("ngx.time()").parse().unwrap();
        let n: f64 = q("ngx.now()").parse().unwrap();
        assert!(
            (t - now).abs() < 5.0 && (n - now).abs() < 5.0,
            "{t} {n} {now}"
        );
        assert_eq!(q("tostring(ngx.time() == math.floor(ngx.time()))"), "true");
    }

    #[test]
    fn caches_and_globals_are_emptied_between_requests() {
        both_modes(caches_and_globals_are_emptied_between_requests_in);
    }

    fn caches_and_globals_are_emptied_between_requests_in() {
        // The first script mentions `ngx.` (its entry empties what the last
        // call left, before the next); the second reaches `ngx` without
        // naming it (emptied from Rust after each call). Each call sees
        // only its own request: values, tables, globals — after a call
        // that failed half-way too.
        let body = "return function(req)
               local v = N.var
               local seen = tostring(leak) .. tostring(rawget(_G, 'raw'))
               leak = V(v)
               rawset(_G, 'raw', 1)
               local h = N.req.get_headers()['x-user-id']
               local a = N.req.get_uri_args().uid
               if v.arg_fail == '1' then error('boom') end
               return seen .. '|' .. tostring(V(v)) .. '|' .. tostring(h) .. '|' .. tostring(a)
                   .. '|' .. tostring(v.cookie_sid)
             end";
        let scripts = [
            format!("local N = ngx\nlocal function V(v) return ngx.var.http_x_user_id end\n{body}\n"),
            format!(
                "local N = _G['ng' .. 'x']\nlocal function V(v) return v['http_' .. 'x_user_id'] end\n{body}\n"
            ),
        ];
        for text in scripts {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("t.lua");
            std::fs::write(&p, &text).unwrap();
            let mut src = ScriptSource::load(&p).unwrap();
            src.jit = jit();
            let lists = Arc::new(BTreeMap::new());
            let call = |uri: &str, headers: &[(&str, &str)]| {
                let req = request(uri, "10.1.2.3", headers);
                call_lane(&src, &lists, req, RuleCtx::default()).1
            };
            let ok = |uri: &str, headers: &[(&str, &str)]| call(uri, headers).unwrap().unwrap();
            assert_eq!(
                ok("/?uid=1", &[("X-User-Id", "u1"), ("Cookie", "sid=s1")]),
                "nilnil|u1|u1|1|s1",
                "{text}"
            );
            assert_eq!(ok("/?uid=2", &[("X-User-Id", "u2")]), "nilnil|u2|u2|2|nil");
            assert_eq!(ok("/", &[]), "nilnil|nil|nil|nil|nil");
            let failed = call(
                "/?fail=1&uid=9",
                &[("X-User-Id", "u9"), ("Cookie", "sid=s9")],
            );
            assert!(failed.unwrap_err().message.contains("boom"));
            assert_eq!(ok("/?uid=3", &[("X-User-Id", "u3")]), "nilnil|u3|u3|3|nil");
        }
    }

    #[test]
    fn cached_values_do_not_outlive_the_request() {
        // One VM, two requests: each sees only its own values, whatever
        // the first one read (and so cached) or wrote.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.lua");
        std::fs::write(
            &p,
            "return function()
               local h, a = ngx.req.get_headers(), ngx.req.get_uri_args()
               local out = table.concat({ tostring(ngx.var.http_x_user_id), tostring(h['x-user-id']),
                 tostring(ngx.var.cookie_sid), tostring(ngx.var.arg_uid), tostring(a.uid),
                 tostring(ngx.var.remote_addr), tostring(ngx.var.uri) }, '|')
               h.injected = 'x'
               a.injected = 'y'
               return out .. '|' .. tostring(ngx.req.get_headers().injected)
                 .. tostring(ngx.req.get_uri_args().injected)
             end\n",
        )
        .unwrap();
        let src = ScriptSource::load(&p).unwrap();
        let lists = Arc::new(BTreeMap::new());
        let call = |req| call_lane(&src, &lists, req, RuleCtx::default()).1.unwrap();
        let first = request(
            "/one?uid=1",
            "10.0.0.1",
            &[("X-User-Id", "a"), ("Cookie", "sid=s1")],
        );
        let second = request("/two?uid=2", "10.0.0.2", &[("X-User-Id", "b")]);
        assert_eq!(call(first).as_deref(), Some("a|a|s1|1|1|10.0.0.1|/one|xy"));
        assert_eq!(
            call(second).as_deref(),
            Some("b|b|nil|2|2|10.0.0.2|/two|xy")
        );
        let third = request("/", "::1", &[]);
        assert_eq!(call(third).as_deref(), Some("nil|nil|nil|nil|nil|::1|/|xy"));
    }

    #[test]
    fn a_request_cannot_leave_state_in_ngx_var_or_the_header_lookup() {
        // The first request tries the raw writers on `ngx.var` and changes
        // its headers table's metatable; the next request sees none of it.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.lua");
        std::fs::write(
            &p,
            "return function()
               local h = ngx.req.get_headers()
               if ngx.var.arg_evil then
                 local a = pcall(rawset, ngx.var, 'remote_addr', 'forged')
                 local b = pcall(table.insert, ngx.var, 'x')
                 getmetatable(h).__index = function() return 'forged' end
                 return tostring(a) .. tostring(b) .. h.X_User_Id
               end
               return tostring(ngx.var.remote_addr) .. '|' .. tostring(rawget(ngx.var, 1))
                 .. '|' .. tostring(h.X_User_Id) .. '|' .. tostring(h.Missing)
             end\n",
        )
        .unwrap();
        let src = ScriptSource::load(&p).unwrap();
        let lists = Arc::new(BTreeMap::new());
        let call = |req| call_lane(&src, &lists, req, RuleCtx::default()).1.unwrap();
        let evil = request("/?evil=1", "10.0.0.1", &[("X-User-Id", "a")]);
        assert_eq!(call(evil).as_deref(), Some("falsefalseforged"));
        let next = request("/", "10.0.0.2", &[("X-User-Id", "b")]);
        assert_eq!(call(next).as_deref(), Some("10.0.0.2|nil|b|nil"));
    }

    #[test]
    fn bit_library_like_luajit() {
        let q = |e: &str| eval(&format!("return tostring({e})"), std_req());
        assert_eq!(q("bit.tobit(0xffffffff)"), "-1");
        assert_eq!(q("bit.tobit(0xffffffff + 1)"), "0");
        assert_eq!(q("bit.band(0x12345678, 0xff)"), "120");
        assert_eq!(q("bit.bor(1, 2, 4)"), "7");
        assert_eq!(q("bit.tohex(bit.bxor(0xa5a5f0f0, 0xaa55ff00))"), "0ff00ff0");
        assert_eq!(q("bit.lshift(1, 0)"), "1");
        assert_eq!(q("bit.lshift(1, 31)"), "-2147483648");
        assert_eq!(q("bit.lshift(1, 40)"), "256");
        assert_eq!(q("bit.rshift(-1, 28)"), "15");
        assert_eq!(q("bit.arshift(-256, 8)"), "-1");
        assert_eq!(q("bit.bnot(0)"), "-1");
        assert_eq!(q("bit.tohex(1)"), "00000001");
        assert_eq!(q("bit.tohex(-1, -4)"), "FFFF");
        assert_eq!(q("bit.tohex(0x87654321, 4)"), "4321");
        assert_eq!(q("bit.tohex(bit.bswap(0x12345678))"), "78563412");
        assert_eq!(q("bit.tohex(bit.rol(0x12345678, 12))"), "45678123");
        assert_eq!(q("bit.band('7', 3)"), "3");
    }
}
