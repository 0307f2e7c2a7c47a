//! Layer: lane. The OpenResty-compatible subset scripts see: `ngx.var.*`,
//! `ngx.req.*`, `ngx.log`, `ngx.crc32_*`, `ngx.md5`, `ngx.time/now`,
//! `ngx.shared.<dict>` (`bit` is LuaJIT's own library, opened by the script
//! module). Everything reads the request
//! being decided through the script module's thread-local slot, lazily: nothing
//! is built per request unless the script asks for it, and what it asks for is
//! built once per request (`ngx.var` values, `get_headers()`, `get_uri_args()`
//! are kept in per-request Lua tables, emptied after the call).
//! Semantics follow nginx/lua-nginx-module (see the README's "OpenResty
//! compatibility" section for the exact subset).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderName, HeaderValue};
use md5::{Digest, Md5};
use mlua::{Either, Function, Lua, LuaString, MultiValue, Table, UserData, UserDataMethods, Value};
use percent_encoding::percent_decode;

use super::script::{pushed, request_string, with_current, with_edit, with_req, Pushed, Restore};
use super::shared_dict::{DictError, DictValue, SharedDict, MAX_KEY_LEN};
use super::RequestInfo;

// nginx log levels, as OpenResty numbers them.
const LEVELS: [(&str, i64); 9] = [
    ("STDERR", 0),
    ("EMERG", 1),
    ("ALERT", 2),
    ("CRIT", 3),
    ("ERR", 4),
    ("WARN", 5),
    ("NOTICE", 6),
    ("INFO", 7),
    ("DEBUG", 8),
];

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
/// (and empties `env`) before each call, in Lua. The entry pays for itself
/// where the script reads `ngx.*` (~300 instructions a call less than
/// `reset` from Rust) and costs ~120 where it does not, so it is used for
/// scripts whose source mentions `ngx.`; the others are reset from Rust
/// when a host call filled a cache (`Current::ngx_cached`). Either way is
/// complete on its own: the mention only chooses the cheaper one.
pub(crate) struct PerRequest {
    pub reset: Function,
    pub make_entry: Function,
}

/// What a script's and its modules' source mention of the `ngx` API
/// ([`mentioned`]): all of it is fetched in one host call, the batch, on a
/// request's first `ngx.var` miss or first `get_headers()` /
/// `get_uri_args()`.
#[derive(Default)]
pub(crate) struct Mentioned {
    /// `ngx.var` names ([`mentioned_vars`]).
    pub vars: Vec<Vec<u8>>,
    /// `get_headers` appears: its entries come with the batch.
    pub headers: bool,
    /// `get_uri_args` appears: likewise.
    pub args: bool,
    /// `ngx.` appears: the call's entry empties the caches (see
    /// [`PerRequest`]).
    pub ngx: bool,
}

/// What `texts` mention (see [`Mentioned`]).
pub(crate) fn mentioned<'a>(texts: impl IntoIterator<Item = &'a str> + Clone) -> Mentioned {
    let has = |word: &str| texts.clone().into_iter().any(|t| t.contains(word));
    Mentioned {
        vars: mentioned_vars(texts.clone()),
        headers: has("get_headers"),
        args: has("get_uri_args"),
        ngx: has("ngx."),
    }
}

/// `ngx.crc32_short` / `crc32_long` with LuaJIT's compiler on: CRC-32
/// (IEEE, reflected, as zlib's and nginx's `ngx_crc32_*`) of a string of
/// at most [`CRC32_LUA_MAX`] bytes computed in Lua by table, so the JIT
/// compiles it into the script's trace; a host call (mlua's trampoline, the
/// argument copied, the trace ended and stitched) costs ~450 instructions.
/// The steps are written out, one per byte (a loop of a few iterations
/// per call ran its first iteration in the interpreter every time: a loop
/// trace is entered from its loop-back only). Longer strings and anything
/// not a string (a number is hashed as its text, anything else raises the
/// host's error) go to the host function. On the interpreter every byte
/// costs a dozen bytecodes and four fast-function calls, so the host
/// function serves there.
fn crc32_source() -> String {
    let mut steps = String::new();
    for i in 1..=CRC32_LUA_MAX {
        steps.push_str(&format!(
            "  b = byte(s, {i}) if not b then goto done end c = bxor(rshift(c, 8), T[band(bxor(c, b), 255)])\n"
        ));
    }
    format!(
        r#"local host, bit = ...
local band, bxor, rshift, bnot = bit.band, bit.bxor, bit.rshift, bit.bnot
local byte, type = string.byte, type
local T = {{}}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) == 1 then c = bxor(rshift(c, 1), 0xEDB88320) else c = rshift(c, 1) end
  end
  T[i] = c
end
return function(s)
  if type(s) ~= "string" or #s > {CRC32_LUA_MAX} then return host(s) end
  local c, b = -1
{steps}  ::done::
  c = bnot(c)
  if c < 0 then c = c + 4294967296 end
  return c
end
"#
    )
}

/// Longest string [`crc32_source`] hashes in Lua (~10 instructions a byte
/// compiled, against a host call's ~450 and crc32fast's fraction of one).
const CRC32_LUA_MAX: usize = 32;

/// Installs `ngx` into `g` (`bit` is LuaJIT's own library); `mentioned`
/// says what the batch fetches; `jit`: LuaJIT's compiler is on.
pub(crate) fn install(
    lua: &Lua,
    g: &Table,
    dicts: &BTreeMap<String, Arc<SharedDict>>,
    mentioned: Mentioned,
    jit: bool,
) -> mlua::Result<PerRequest> {
    let ngx = lua.create_table()?;
    for (name, n) in LEVELS {
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
    let (req, reset, make_entry) = req_table(lua, &caches, mentioned)?;
    ngx.raw_set("req", req)?;
    ngx.raw_set("log", lua.create_function(log)?)?;
    // Bytes, not a `LuaString`: a short copy costs less than mlua's
    // reference to the argument.
    let crc32 = lua.create_function(|_, s: mlua::BString| Ok(i64::from(crc32fast::hash(&s))))?;
    let crc32 = match jit {
        true => lua
            .load(crc32_source())
            .set_name("=graygate_crc32")
            .call::<Function>((crc32, g.raw_get::<Table>("bit")?))?,
        false => crc32,
    };
    ngx.raw_set("crc32_short", &crc32)?;
    ngx.raw_set("crc32_long", crc32)?;
    ngx.raw_set(
        "md5",
        lua.create_function(|lua, s: LuaString| {
            let d = Md5::digest(&*s.as_bytes());
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            let mut hex = [0u8; 32];
            for (i, b) in d.iter().enumerate() {
                hex[2 * i] = DIGITS[usize::from(b >> 4)];
                hex[2 * i + 1] = DIGITS[usize::from(b & 0xf)];
            }
            lua.create_string(hex)
        })?,
    )?;
    ngx.raw_set(
        "md5_bin",
        lua.create_function(|lua, s: LuaString| {
            lua.create_string(Md5::digest(&*s.as_bytes()).as_slice())
        })?,
    )?;
    ngx.raw_set(
        "time",
        lua.create_function(|_, ()| Ok(unix_now().as_secs() as i64))?,
    )?;
    ngx.raw_set(
        "now",
        lua.create_function(|_, ()| Ok(unix_now().as_millis() as f64 / 1000.0))?,
    )?;
    ngx.raw_set("update_time", lua.create_function(|_, ()| Ok(()))?)?;
    let shared = lua.create_table()?;
    for (name, d) in dicts {
        shared.raw_set(name.as_str(), DictUd(d.clone()))?;
    }
    ngx.raw_set("shared", shared)?;
    g.raw_set("ngx", ngx)?;
    // OpenResty's `print`: ngx.log at NOTICE (never the process's stdout).
    g.raw_set(
        "print",
        lua.create_function(|lua, mut args: MultiValue| {
            args.push_front(Value::Integer(6));
            log(lua, args)
        })?,
    )?;
    Ok(PerRequest { reset, make_entry })
}

fn unix_now() -> std::time::Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

// ---------------------------------------------------------------- ngx.var

/// Lua side of `ngx.var` and `ngx.req.get_headers/get_uri_args`: values
/// are fetched from Rust once per request and kept in per-request tables,
/// so a second read of the same variable is a plain table hit (no host
/// call); `ngx.var` itself stays empty so every write reaches `__newindex`.
const GLUE: &str = r#"
local var, vcache, rcache, fetch, store, build_headers, build_args, names, fetch_all, make_fill = ...
local rawget, rawset, setmetatable, type, next = rawget, rawset, setmetatable, type, next
local lower, gsub, find, sub, byte = string.lower, string.gsub, string.find, string.sub, string.byte
-- Empties what a request left in the caches, in Lua (mlua's `Table::clear`
-- is a protected call per table, ~800 instructions). A script that
-- mentions `ngx.` runs behind `make_entry`'s entry, which resets before
-- the script when `dirty`; any other is reset from Rust after a call whose
-- host calls filled the caches (`Current::ngx_cached`).
local dirty = false
local function reset()
  for k in next, vcache do rawset(vcache, k, nil) end
  for i = 1, 4 do rawset(rcache, i, nil) end
  dirty = false
end
-- The builders hand over one packed string (see `Packed` in ngx.rs):
-- records `name \0 = value \0` or `name \0 !` (a bare flag); a repeated
-- name becomes an array in order. A table is already built.
local function unpack_entries(s)
  if type(s) == "table" then return s end
  local t, pos, n = {}, 1, #s
  while pos <= n do
    local e = find(s, "\0", pos, true)
    local k, v = sub(s, pos, e - 1), true
    if byte(s, e + 1) == 33 then
      pos = e + 2
    else
      local e2 = find(s, "\0", e + 2, true)
      v, pos = sub(s, e + 2, e2 - 1), e2 + 1
    end
    local old = rawget(t, k)
    if old == nil then
      rawset(t, k, v)
    elseif type(old) == "table" then
      old[#old + 1] = v
    else
      rawset(t, k, { old, v })
    end
  end
  return t
end
-- The get_headers() / get_uri_args() table of a request whose packed
-- entries are the last such request's (the same interned string: a
-- pointer compare) is copied from that table's keys and values, kept here
-- (arrays copied too: a script's table is its own), instead of split
-- again: every substring made is an interned string (LuaJIT hashes it and
-- looks it up, ~125 instructions) and the splitting's `find`s. `last` is
-- cleared while the copy is rebuilt, so a rebuild stopped half-way (a
-- memory error) is never reused. The copy is a table of its own, as
-- unpacking makes one.
local new_tab = table.new
local function copy_array(v)
  local a = new_tab(#v, 0)
  for j = 1, #v do a[j] = v[j] end
  return a
end
local function memo_entries()
  local last, keys, vals, n = nil, {}, {}, 0
  return function(p)
    if p == last then
      local t = new_tab(0, n)
      for i = 1, n do
        local v = vals[i]
        if type(v) == "table" then v = copy_array(v) end
        t[keys[i]] = v
      end
      return t
    end
    local t = unpack_entries(p)
    if type(p) == "string" then
      last = nil
      local m = 0
      for k, v in next, t do
        m = m + 1
        if type(v) == "table" then v = copy_array(v) end
        keys[m], vals[m] = k, v
      end
      for i = m + 1, n do keys[i], vals[i] = nil, nil end
      n, last = m, p
    end
    return t
  end
end
local headers_entries, args_entries = memo_entries(), memo_entries()
-- The names the source mentions (`names`, a set too) are fetched together
-- on the request's first miss or first get_headers()/get_uri_args(), the
-- batch; `DONE` (a key no script can reach) marks the cache filled, so a
-- mentioned name that is nil needs no host call either. Any other name is
-- fetched alone. The batch also brings the packed get_headers() and
-- get_uri_args() entries where the source mentions those (kept in
-- rcache[3] / [4] until they are asked for). `clear` empties the lot.
local DONE, mentioned = {}, {}
for i = 1, #names do mentioned[names[i]] = true end
local fill = make_fill(DONE)
local function take(h, a, s)
  if h ~= nil then rawset(rcache, 3, h) end
  if a ~= nil then rawset(rcache, 4, a) end
  fill(vcache, s)
end
local function batch()
  dirty = true
  take(fetch_all())
end
-- The packed entries of rcache[i] (3: headers, 4: args) from the batch, if
-- it has not run yet; nil if it ran without them.
local function batched(i)
  local p = rawget(rcache, i)
  if p == nil and not rawget(vcache, DONE) then
    batch()
    p = rawget(rcache, i)
  end
  return p
end
setmetatable(vcache, { __index = function(c, k)
  dirty = true
  if mentioned[k] then
    if rawget(c, DONE) then return nil end
    batch()
    return rawget(c, k)
  end
  local v = fetch(k)
  if v ~= nil then c[k] = v end
  return v
end })
setmetatable(var, { __index = vcache, __newindex = store, __metatable = false })
-- Header tables are keyed in lower case; lookups accept any case and `_`.
-- Each table gets a metatable of its own (as OpenResty's): a script that
-- changes it changes only its own request's table.
-- `gsub` only for a name with `_` in it: a pattern call per miss cost
-- ~1,000 instructions (callgrind), a plain `find` a few dozen.
local function hdr_index(t, k)
  if type(k) ~= "string" then return nil end
  local n = k
  if find(k, "_", 1, true) then n = gsub(k, "_", "-") end
  n = lower(n)
  if n ~= k then return rawget(t, n) end
  return nil
end
local function get_headers(max)
  if max == nil then
    local h = rawget(rcache, 1)
    if h == nil then
      dirty = true
      local p = batched(3) or build_headers(nil)
      h = setmetatable(headers_entries(p), { __index = hdr_index })
      rawset(rcache, 1, h)
    end
    return h
  end
  return setmetatable(unpack_entries(build_headers(max)), { __index = hdr_index })
end
local function get_uri_args(max)
  if max == nil then
    local a = rawget(rcache, 2)
    if a == nil then
      dirty = true
      a = args_entries(batched(4) or build_args(nil))
      rawset(rcache, 2, a)
    end
    return a
  end
  return unpack_entries(build_args(max))
end
-- The entry of a script that mentions `ngx.`: empties what the last
-- request left — these caches and the globals it wrote (`env`, where
-- per-request global writes land) — then calls the lane function with
-- `req` (an upvalue: nothing to push per call) and checks its result here:
-- a string or nil as it is, anything else as nil and its type's name (read
-- by Rust from the stack as bytes, no reference to a Lua value). Errors
-- and positions are the script's own. A call stopped by an error or a
-- limit is cleaned up all the same, before the next one.
local function make_entry(lane, env, req)
  return function()
    if dirty then reset() end
    if next(env) ~= nil then
      for k in next, env do rawset(env, k, nil) end
    end
    local r = lane(req)
    if r == nil or type(r) == "string" then return r end
    return nil, type(r)
  end
end
return get_headers, get_uri_args, reset, make_entry
"#;

/// `ngx.var` reads: the variable's value for the current request.
fn fetch(lua: &Lua, name: LuaString) -> mlua::Result<Value> {
    let name = name.as_bytes();
    with_current(|r, c| {
        c.ngx_cached = true;
        var_value(lua, r, &mut c.parsed, &name)
    })?
}

/// `ngx.var.NAME` of `r` as a Lua value (nil where unset).
fn var_value(lua: &Lua, r: &RequestInfo, parsed: &mut Parsed, name: &[u8]) -> mlua::Result<Value> {
    match var_bytes(r, parsed, name) {
        Some(v) => Ok(Value::String(request_string(lua, &v)?)),
        None => Ok(Value::Nil),
    }
}

/// `ngx.var.NAME` of `r`; cookies and arguments split once per request
/// into `parsed`.
fn var_bytes<'a>(r: &'a RequestInfo, parsed: &mut Parsed, name: &[u8]) -> Option<Cow<'a, [u8]>> {
    match name {
        n if n.starts_with(b"cookie_") => cookie_var(r, parsed, &n[7..]).map(Cow::Borrowed),
        n if n.starts_with(b"arg_") => arg_var(r, parsed, &n[4..]).map(Cow::Borrowed),
        n => variable(r, n),
    }
}

/// A name [`mentioned_vars`] found, resolved at load: an `http_*` header's
/// name parsed once, not per request; any other read as [`var_bytes`] reads
/// it.
enum VarName {
    Header(HeaderName),
    /// `remote_addr`: written into the batch's string as it is packed.
    RemoteAddr,
    Other(Vec<u8>),
}

impl VarName {
    fn new(name: &[u8]) -> VarName {
        match name.strip_prefix(b"http_").and_then(header_name) {
            Some(h) => VarName::Header(h),
            None if name == b"remote_addr" => VarName::RemoteAddr,
            None => VarName::Other(name.to_vec()),
        }
    }

    /// Its value for `r` (as [`var_value`] gives it, before the Lua string).
    fn value<'a>(&self, r: &'a RequestInfo, parsed: &mut Parsed) -> Option<Cow<'a, [u8]>> {
        match self {
            VarName::Header(h) => header_values(r, h),
            VarName::RemoteAddr => variable(r, b"remote_addr"),
            VarName::Other(n) => var_bytes(r, parsed, n),
        }
    }
}

/// The batch: the packed `get_headers()` entries (or nil: `headers`
/// false), likewise `get_uri_args()`'s, and all of `names`' values for the
/// current request, for the glue's `fill`: one string of records in order,
/// each a length byte (0: unset, else the value's length + 1) and the value
/// — one host string where a value each cost ~500 instructions (mlua's
/// references to each, callgrind) — or, when a value is longer than
/// [`PACKED_VALUE_MAX`], a table of the values by position. Three values
/// always (a vararg glue is not compiled as well by LuaJIT).
fn fetch_all(
    lua: &Lua,
    names: &[VarName],
    headers: bool,
    args: bool,
) -> mlua::Result<(Pushed, Pushed, Pushed, Restore)> {
    let (h, a, v) = with_current(|r, c| -> mlua::Result<_> {
        c.ngx_cached = true;
        let h = match headers {
            true => Either::Left(headers_packed(r, DEFAULT_MAX)),
            false => Either::Right(Value::Nil),
        };
        let a = match args {
            true => args_packed(lua, r, DEFAULT_MAX)?,
            false => Either::Right(Value::Nil),
        };
        let mut packed = Vec::with_capacity(128);
        for n in names {
            if let VarName::RemoteAddr = n {
                // At most 45 bytes (an IPv6 address): always packs; no
                // buffer of its own (~100 instructions less).
                let at = packed.len();
                packed.push(0);
                super::ip_text_into(r.client_ip, &mut packed);
                packed[at] = (packed.len() - at) as u8;
                continue;
            }
            match n.value(r, &mut c.parsed) {
                Some(v) if v.len() > PACKED_VALUE_MAX => {
                    let each = fetch_each(lua, r, &mut c.parsed, names)?;
                    return Ok((h, a, Either::Right(Value::Table(each))));
                }
                Some(v) => {
                    packed.push(v.len() as u8 + 1);
                    packed.extend_from_slice(&v);
                }
                None => packed.push(0),
            }
        }
        Ok((h, a, Either::Left(packed)))
    })??;
    let (h, a, v) = (pushed(lua, h)?, pushed(lua, a)?, pushed(lua, v)?);
    // The last fallible step: the three are pushed with the limit lifted
    // and `Restore` sets it back (a host function has LUA_MINSTACK slots,
    // so the pushes cannot fail).
    let direct = [&h, &a, &v].iter().any(|p| p.is_left());
    let limit = if direct {
        Some(lua.set_memory_limit(0)?)
    } else {
        None
    };
    Ok((h, a, v, Restore(limit)))
}

/// Longest value [`fetch_all`] packs (its length byte holds length + 1).
const PACKED_VALUE_MAX: usize = 254;

/// [`fetch_all`]'s values in a table by position (rare: a long value).
fn fetch_each(
    lua: &Lua,
    r: &RequestInfo,
    parsed: &mut Parsed,
    names: &[VarName],
) -> mlua::Result<Table> {
    let t = lua.create_table()?;
    for (i, n) in names.iter().enumerate() {
        if let Some(v) = n.value(r, parsed) {
            t.raw_set(i + 1, request_string(lua, &v)?)?;
        }
    }
    Ok(t)
}

/// Lua source of `make_fill(DONE)`: a function storing `fetch_all`'s values
/// under `names` into the cache (the cache has no `__newindex`), from the
/// packed string by `byte`/`sub` — one statement per name, no loop — or
/// from the table of values. Names are identifier bytes
/// ([`mentioned_vars`]), so they are safe in a quoted literal.
fn fill_source(names: &[Vec<u8>]) -> String {
    let mut packed = String::new();
    let mut each = String::new();
    for (i, n) in names.iter().enumerate() {
        let n = std::str::from_utf8(n).unwrap_or("");
        packed.push_str(&format!(
            "n = byte(s, p) if n ~= 0 then c[\"{n}\"] = sub(s, p + 1, p + n - 1) p = p + n else p = p + 1 end\n"
        ));
        each.push_str(&format!("c[\"{n}\"] = s[{}]\n", i + 1));
    }
    format!(
        "local DONE = ...\nlocal byte, sub, type = string.byte, string.sub, type\n\
         return function(c, s)\nif type(s) == \"string\" then\nlocal p, n = 1\n{packed}else\n{each}end\n\
         c[DONE] = true\nend\n"
    )
}

/// Most names [`mentioned_vars`] returns: a script mentioning more has the
/// rest fetched one by one, as before.
const MAX_MENTIONED: usize = 32;

/// The `ngx.var` names `text` mentions as `ngx.var.NAME`, `ngx.var["NAME"]`
/// or `ngx.var['NAME']` (assignments and comments too: a name fetched and
/// not read costs a string, never a different value). Sorted, unique.
pub(crate) fn mentioned_vars<'a>(texts: impl IntoIterator<Item = &'a str>) -> Vec<Vec<u8>> {
    let ident = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    let mut names = std::collections::BTreeSet::new();
    for text in texts {
        let t = text.as_bytes();
        let mut from = 0;
        while let Some(i) = find(&t[from..], b"ngx.var") {
            let start = from + i;
            let at = start + b"ngx.var".len();
            from = at;
            if start > 0 && ident(&t[start - 1]) {
                continue; // `xngx.var`
            }
            let rest = &t[at..];
            let name: &[u8] = match rest.first() {
                Some(b'.') => {
                    let n = rest[1..].iter().take_while(|b| ident(b)).count();
                    &rest[1..1 + n]
                }
                Some(b'[') => match rest.get(1) {
                    Some(&q @ (b'"' | b'\'')) => {
                        let body = &rest[2..];
                        let n = body.iter().take_while(|b| ident(b)).count();
                        if body.get(n) != Some(&q) {
                            continue;
                        }
                        &body[..n]
                    }
                    _ => continue,
                },
                _ => continue,
            };
            if !name.is_empty() && !name[0].is_ascii_digit() {
                names.insert(name.to_vec());
            }
        }
    }
    names.into_iter().take(MAX_MENTIONED).collect()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `ngx.var.x = v`: only `args` (`query_string`) is changeable, as in nginx.
fn store(lua: &Lua, name: &[u8], value: Value) -> mlua::Result<()> {
    match name {
        b"args" | b"query_string" => set_args(lua, value),
        other => Err(mlua::Error::runtime(format!(
            "variable \"{}\" not changeable",
            String::from_utf8_lossy(other)
        ))),
    }
}

/// The query string, `None` when absent or empty (as nginx's `$args`).
fn query(r: &RequestInfo) -> Option<&str> {
    r.parts.uri.query().filter(|q| !q.is_empty())
}

/// `ngx.var.args = …`: the query string sent upstream (a string, a number,
/// or nil/"" for none), as nginx's changeable `$args`.
fn set_args(lua: &Lua, value: Value) -> mlua::Result<()> {
    let q = match value {
        Value::Nil => String::new(),
        v @ (Value::String(_) | Value::Integer(_) | Value::Number(_)) => lua
            .coerce_string(v)?
            .map(|s| s.to_string_lossy())
            .unwrap_or_default(),
        other => {
            return Err(mlua::Error::runtime(format!(
                "bad args value type {}",
                other.type_name()
            )))
        }
    };
    with_edit(|r, c| -> mlua::Result<()> {
        let uri = &r.parts.uri;
        let target = if q.is_empty() {
            uri.path().to_string()
        } else {
            format!("{}?{}", uri.path(), escape_target(&q))
        };
        let mut parts = uri.clone().into_parts();
        parts.path_and_query = Some(
            target
                .parse()
                .map_err(|_| mlua::Error::runtime("bad args value"))?,
        );
        let new =
            http::Uri::from_parts(parts).map_err(|_| mlua::Error::runtime("bad args value"))?;
        r.parts.uri = new;
        c.parsed.args = None;
        Ok(())
    })?
}

/// Bytes a request target cannot carry raw, percent-encoded (nginx sends
/// them as they are; a URI type cannot hold them).
fn escape_target(q: &str) -> Cow<'_, str> {
    const RAW: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
        .add(b' ')
        .add(b'"')
        .add(b'#')
        .add(b'<')
        .add(b'>')
        .add(b'`')
        .add(b'{')
        .add(b'}');
    percent_encoding::utf8_percent_encode(q, RAW).into()
}

/// The value of nginx variable `name` for `r`, or `None` (nil).
pub fn variable<'a>(r: &'a RequestInfo, name: &[u8]) -> Option<Cow<'a, [u8]>> {
    let b = |s: &'a str| Some(Cow::Borrowed(s.as_bytes()));
    match name {
        b"remote_addr" => Some(Cow::Owned(super::ip_text(r.client_ip))),
        b"uri" | b"document_uri" => Some(Cow::Owned(normalize_uri(r.parts.uri.path()))),
        b"request_uri" => b(r
            .parts
            .uri
            .path_and_query()
            .map_or(r.parts.uri.path(), |pq| pq.as_str())),
        // nginx: a bare `?` is no arguments (nil, and `is_args` "").
        b"args" | b"query_string" => query(r).and_then(b),
        b"is_args" => b(if query(r).is_some() { "?" } else { "" }),
        b"host" => b(&r.host),
        b"request_method" => b(r.parts.method.as_str()),
        b"scheme" => b(crate::lane::scheme(r)),
        b"server_protocol" => b(match r.parts.version {
            http::Version::HTTP_10 => "HTTP/1.0",
            http::Version::HTTP_2 => "HTTP/2.0",
            _ => "HTTP/1.1",
        }),
        _ => {
            if let Some(h) = name.strip_prefix(b"http_") {
                http_var(r, h)
            } else if let Some(c) = name.strip_prefix(b"cookie_") {
                let v = cookie_var(r, &mut Parsed::default(), c)?;
                Some(Cow::Borrowed(v))
            } else if let Some(a) = name.strip_prefix(b"arg_") {
                let v = arg_var(r, &mut Parsed::default(), a)?;
                Some(Cow::Borrowed(v))
            } else {
                None
            }
        }
    }
}

/// `$http_<name>`: `_` stands for `-`; repeated headers are joined with
/// ", " (cookies with "; "), as nginx ≥ 1.23 does.
fn http_var<'a>(r: &'a RequestInfo, name: &[u8]) -> Option<Cow<'a, [u8]>> {
    header_values(r, &header_name(name)?)
}

/// The header `$http_<name>` reads: `_` stands for `-`; none for a name
/// longer than [`HTTP_VAR_MAX`] or not a header name.
fn header_name(name: &[u8]) -> Option<HeaderName> {
    // Converted on the stack: this runs for every `ngx.var.http_*` read.
    let mut buf = [0u8; HTTP_VAR_MAX];
    let dst = buf.get_mut(..name.len())?;
    for (d, &c) in dst.iter_mut().zip(name) {
        *d = if c == b'_' {
            b'-'
        } else {
            c.to_ascii_lowercase()
        };
    }
    HeaderName::from_bytes(dst).ok()
}

/// Longest `$http_<name>` name [`header_name`] converts (longer: nil).
const HTTP_VAR_MAX: usize = 96;

/// The values of header `hname` as `$http_*` gives them.
fn header_values<'a>(r: &'a RequestInfo, hname: &HeaderName) -> Option<Cow<'a, [u8]>> {
    let mut values = values_of(&r.parts.headers, hname);
    let first = values.next()?;
    let rest: Vec<&HeaderValue> = values.collect();
    if rest.is_empty() {
        return Some(Cow::Borrowed(first.as_bytes()));
    }
    let sep: &[u8] = if *hname == http::header::COOKIE {
        b"; "
    } else {
        b", "
    };
    let mut out = first.as_bytes().to_vec();
    for v in rest {
        out.extend_from_slice(sep);
        out.extend_from_slice(v.as_bytes());
    }
    Some(Cow::Owned(out))
}

/// The values of `name` in `h`, in order. A map of few names is scanned
/// (a `HeaderName` compare per entry, ~10 instructions) instead of hashed
/// (`get_all`, ~110 per lookup, callgrind; `$cookie_*` looked the Cookie
/// header up once per name), as `RequestInfo::header_bytes` does.
fn values_of<'a, 'n>(
    h: &'a http::HeaderMap,
    name: &'n HeaderName,
) -> impl Iterator<Item = &'a HeaderValue> + use<'a, 'n> {
    if h.keys_len() <= super::HEADER_SCAN_MAX {
        Either::Left(h.iter().filter(move |(k, _)| *k == name).map(|(_, v)| v))
    } else {
        Either::Right(h.get_all(name).iter())
    }
}

/// A `name=value` pair found in a Cookie header or the query string, as
/// byte offsets into it (`src`: which Cookie header).
#[derive(Clone, Copy)]
struct Pair {
    src: u16,
    name: (u32, u32),
    value: (u32, u32),
}

/// The request's cookies and query arguments, split into pairs once per
/// request on first use (by `ngx.var.cookie_*` / `ngx.var.arg_*`).
#[derive(Default)]
pub(crate) struct Parsed {
    cookies: Option<Vec<Pair>>,
    args: Option<Vec<Pair>>,
}

impl Parsed {
    /// Headers changed (`ngx.req.set_header`): cookies are parsed again.
    pub(crate) fn headers_changed(&mut self) {
        self.cookies = None;
    }
}

fn span(whole: &[u8], part: &[u8]) -> (u32, u32) {
    let start = part.as_ptr() as usize - whole.as_ptr() as usize;
    (start as u32, (start + part.len()) as u32)
}

fn at(b: &[u8], (s, e): (u32, u32)) -> &[u8] {
    &b[s as usize..e as usize]
}

/// `$cookie_<name>`: case-insensitive name (white space around it
/// ignored), the value raw as nginx keeps it: leading white space skipped,
/// everything up to the `;` kept (`a = 7 ;` gives `"7 "`).
fn cookie_var<'a>(r: &'a RequestInfo, parsed: &mut Parsed, name: &[u8]) -> Option<&'a [u8]> {
    let headers = || values_of(&r.parts.headers, &http::header::COOKIE);
    if parsed.cookies.as_ref().is_some_and(Vec::is_empty) {
        // No cookies (split before): no header scan.
        return None;
    }
    let pairs = parsed.cookies.get_or_insert_with(|| {
        let mut out = Vec::new();
        for (src, v) in headers().enumerate() {
            let whole = v.as_bytes();
            for kv in whole.split(|&c| c == b';') {
                let Some(eq) = kv.iter().position(|&c| c == b'=') else {
                    continue;
                };
                out.push(Pair {
                    src: src as u16,
                    name: span(whole, kv[..eq].trim_ascii()),
                    value: span(whole, kv[eq + 1..].trim_ascii_start()),
                });
            }
        }
        out
    });
    let mut values = headers();
    let (mut src, mut whole) = (0u16, values.next()?.as_bytes());
    for p in pairs.iter() {
        while src < p.src {
            src += 1;
            whole = values.next()?.as_bytes();
        }
        if at(whole, p.name).eq_ignore_ascii_case(name) {
            return Some(at(whole, p.value));
        }
    }
    None
}

/// `$arg_<name>`: first `name=` argument, case-insensitive, not decoded.
fn arg_var<'a>(r: &'a RequestInfo, parsed: &mut Parsed, name: &[u8]) -> Option<&'a [u8]> {
    let q = r.parts.uri.query()?.as_bytes();
    let pairs = parsed.args.get_or_insert_with(|| {
        q.split(|&c| c == b'&')
            .filter_map(|kv| {
                let eq = kv.iter().position(|&c| c == b'=')?;
                Some(Pair {
                    src: 0,
                    name: span(q, &kv[..eq]),
                    value: span(q, &kv[eq + 1..]),
                })
            })
            .collect()
    });
    pairs
        .iter()
        .find(|p| at(q, p.name).eq_ignore_ascii_case(name))
        .map(|p| at(q, p.value))
}

/// nginx's `$uri`: percent-decoded, slashes merged, `.`/`..` resolved.
pub fn normalize_uri(path: &str) -> Vec<u8> {
    let decoded: Vec<u8> = percent_decode(path.as_bytes()).collect();
    let mut segs: Vec<&[u8]> = Vec::new();
    let mut trailing = false;
    for seg in decoded.split(|&c| c == b'/') {
        trailing = false;
        match seg {
            b"" => trailing = true,
            b"." => trailing = true,
            b".." => {
                segs.pop();
                trailing = true;
            }
            s => segs.push(s),
        }
    }
    let mut out = Vec::with_capacity(decoded.len());
    for s in &segs {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if trailing || segs.is_empty() {
        out.push(b'/');
    }
    out
}

/// URI-component unescaping as `ngx.req.get_uri_args` does: `+` is a space.
fn unescape(s: &[u8]) -> Cow<'_, [u8]> {
    if !s.iter().any(|&c| c == b'+' || c == b'%') {
        return Cow::Borrowed(s);
    }
    let plus: Vec<u8> = s
        .iter()
        .map(|&c| if c == b'+' { b' ' } else { c })
        .collect();
    Cow::Owned(percent_decode(&plus).collect())
}

// ---------------------------------------------------------------- ngx.req

/// `max` of `get_headers` / `get_uri_args`: OpenResty's 100 by default,
/// 0 or less for no limit.
fn limit(max: Option<i64>) -> usize {
    max.map_or(
        DEFAULT_MAX,
        |m| if m <= 0 { usize::MAX } else { m as usize },
    )
}

/// The entries of a `get_headers()` / `get_uri_args()` table packed into
/// one string, which the glue's `unpack_entries` turns into the table: one
/// host string instead of a protected Lua call per name and value (each of
/// which allocates two C closures on LuaJIT). Records are `name \0 = value
/// \0`, or `name \0 !` for a bare flag.
#[derive(Default)]
struct Packed(Vec<u8>);

impl Packed {
    /// Adds one entry; false if a name or value holds a NUL byte, which
    /// the packing cannot carry (a decoded `%00`).
    fn push(&mut self, name: &[u8], value: Option<&[u8]>) -> bool {
        if name.contains(&0) || value.is_some_and(|v| v.contains(&0)) {
            return false;
        }
        match value {
            Some(v) => self.push_unchecked(name, v),
            None => {
                self.0.extend_from_slice(name);
                self.0.extend_from_slice(b"\0!");
            }
        }
        true
    }

    /// Adds a `name = value` entry known to hold no NUL byte (a header's:
    /// `http` refuses NUL in names and values).
    fn push_unchecked(&mut self, name: &[u8], value: &[u8]) {
        self.0.extend_from_slice(name);
        self.0.extend_from_slice(b"\0=");
        self.0.extend_from_slice(value);
        self.0.push(0);
    }
}

/// `ngx.req.get_headers()`: lower-case names, repeated headers as arrays
/// (in order); `max` counts header lines. Header names and values never
/// hold NUL, so they always pack.
fn headers_table(lua: &Lua, r: &RequestInfo, max: usize) -> mlua::Result<Value> {
    Ok(Value::String(request_string(lua, &headers_packed(r, max))?))
}

/// [`headers_table`]'s packed entries.
fn headers_packed(r: &RequestInfo, max: usize) -> Vec<u8> {
    let h = &r.parts.headers;
    let mut p = Packed(Vec::with_capacity(512));
    for (name, value) in h.iter().take(max) {
        p.push_unchecked(name.as_str().as_bytes(), value.as_bytes());
    }
    p.0
}

/// `ngx.req.get_uri_args()`: decoded (`+` is a space), repeated as arrays,
/// a bare `flag` as `true`. A decoded NUL falls back to building the table
/// here.
fn args_table(lua: &Lua, r: &RequestInfo, max: usize) -> mlua::Result<Value> {
    match args_packed(lua, r, max)? {
        Either::Left(p) => Ok(Value::String(request_string(lua, &p)?)),
        Either::Right(t) => Ok(t),
    }
}

/// [`args_table`]'s packed entries, or its table where they do not pack.
fn args_packed(lua: &Lua, r: &RequestInfo, max: usize) -> mlua::Result<Either<Vec<u8>, Value>> {
    let Some(q) = r.parts.uri.query() else {
        return Ok(Either::Left(Vec::new()));
    };
    let parts = || q.as_bytes().split(|&c| c == b'&').filter(|p| !p.is_empty());
    // Borrowed unless an escape was decoded.
    fn split(part: &[u8]) -> (Cow<'_, [u8]>, Option<Cow<'_, [u8]>>) {
        match part.iter().position(|&c| c == b'=') {
            Some(eq) => (unescape(&part[..eq]), Some(unescape(&part[eq + 1..]))),
            None => (unescape(part), None),
        }
    }
    let mut p = Packed(Vec::with_capacity(q.len() + 16));
    let mut packed = true;
    for part in parts().take(max) {
        let (k, v) = split(part);
        if !k.is_empty() && !p.push(&k, v.as_deref()) {
            packed = false;
            break;
        }
    }
    if packed {
        return Ok(Either::Left(p.0));
    }
    let t = lua.create_table()?;
    for part in parts().take(max) {
        let (k, v) = split(part);
        if k.is_empty() {
            continue;
        }
        let v = match v {
            Some(v) => Value::String(lua.create_string(v)?),
            None => Value::Boolean(true),
        };
        match t.raw_get::<Value>(lua.create_string(&k)?)? {
            Value::Nil => t.raw_set(lua.create_string(&k)?, v)?,
            Value::Table(many) => many.raw_push(v)?,
            one => t.raw_set(lua.create_string(&k)?, lua.create_sequence_from([one, v])?)?,
        }
    }
    Ok(Either::Right(Value::Table(t)))
}

/// `ngx.req`, and the glue's `reset` and `make_entry` (see [`PerRequest`]).
fn req_table(
    lua: &Lua,
    caches: &Rc<Caches>,
    mentioned: Mentioned,
) -> mlua::Result<(Table, Function, Function)> {
    let Mentioned {
        vars: names,
        headers,
        args,
        ..
    } = mentioned;
    let t = lua.create_table()?;
    let [var, vcache, rcache] = &caches.0;
    let pr = caches.clone();
    let store = lua.create_function(move |lua, (_, name, value): (bool, LuaString, Value)| {
        store(lua, &name.as_bytes(), value)?;
        pr.clear();
        Ok(())
    })?;
    type Build = fn(&Lua, &RequestInfo, usize) -> mlua::Result<Value>;
    let builder = |build: Build| {
        lua.create_function(move |lua, max: Option<i64>| {
            with_current(|r, c| {
                c.ngx_cached = true;
                build(lua, r, limit(max))
            })?
        })
    };
    let build_headers = builder(headers_table)?;
    let build_args = builder(args_table)?;
    let resolved: Vec<VarName> = names.iter().map(|n| VarName::new(n)).collect();
    let make_fill = lua
        .load(fill_source(&names))
        .set_name("=graygate_ngx_fill")
        .into_function()?;
    let (get_headers, get_uri_args, reset, make_entry): (Function, Function, Function, Function) =
        lua.load(GLUE).set_name("=graygate_ngx").call((
            var,
            vcache,
            rcache,
            lua.create_function(fetch)?,
            store,
            build_headers,
            build_args,
            lua.create_sequence_from(
                names
                    .iter()
                    .map(|n| lua.create_string(n))
                    .collect::<mlua::Result<Vec<_>>>()?,
            )?,
            lua.create_function(move |lua, ()| fetch_all(lua, &resolved, headers, args))?,
            make_fill,
        ))?;
    t.raw_set("get_headers", get_headers)?;
    t.raw_set("get_uri_args", get_uri_args)?;
    let pr = caches.clone();
    t.raw_set(
        "get_method",
        lua.create_function(|lua, ()| {
            with_req(|r| request_string(lua, r.parts.method.as_str().as_bytes()))?
        })?,
    )?;
    t.raw_set(
        "set_header",
        lua.create_function(move |lua, (name, value): (LuaString, Value)| {
            set_header(lua, &name, value)?;
            pr.clear();
            Ok(())
        })?,
    )?;
    let pr = caches.clone();
    t.raw_set(
        "clear_header",
        lua.create_function(move |lua, name: LuaString| {
            set_header(lua, &name, Value::Nil)?;
            pr.clear();
            Ok(())
        })?,
    )?;
    Ok((t, reset, make_entry))
}

fn has_crlf(b: &[u8]) -> bool {
    b.iter().any(|&c| c == b'\r' || c == b'\n')
}

/// CR and LF percent-encoded, as lua-nginx-module does for header names
/// and values (so a script cannot split a header).
fn escape_crlf(b: &[u8]) -> Cow<'_, [u8]> {
    if !has_crlf(b) {
        return Cow::Borrowed(b);
    }
    let mut out = Vec::with_capacity(b.len() + 8);
    for &c in b {
        match c {
            b'\r' => out.extend_from_slice(b"%0D"),
            b'\n' => out.extend_from_slice(b"%0A"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `ngx.req.set_header`: replaces (or with nil removes) a request header
/// that goes upstream. CR/LF are percent-encoded (as lua-nginx-module
/// does); other invalid bytes are refused.
fn set_header(lua: &Lua, name: &LuaString, value: Value) -> mlua::Result<()> {
    let name_b = name.as_bytes();
    let name_b = escape_crlf(&name_b);
    let hname = HeaderName::from_bytes(&name_b).map_err(|_| {
        mlua::Error::runtime(format!("invalid header name {:?}", name.to_string_lossy()))
    })?;
    let mut values: Vec<HeaderValue> = Vec::new();
    let mut add = |v: Value| -> mlua::Result<()> {
        let s = match &v {
            Value::String(_) | Value::Integer(_) | Value::Number(_) => lua
                .coerce_string(v)?
                .ok_or_else(|| mlua::Error::runtime("bad header value"))?,
            other => {
                return Err(mlua::Error::runtime(format!(
                    "bad header value type {}",
                    other.type_name()
                )))
            }
        };
        let b = s.as_bytes();
        let b = escape_crlf(&b);
        values.push(HeaderValue::from_bytes(&b).map_err(|_| {
            mlua::Error::runtime(format!("invalid value for header {:?}", hname.as_str()))
        })?);
        Ok(())
    };
    match value {
        Value::Nil => {}
        Value::Table(t) => {
            for v in t.sequence_values::<Value>() {
                add(v?)?;
            }
        }
        v => add(v)?,
    }
    with_edit(|r, c| {
        let h = &mut r.parts.headers;
        h.remove(&hname);
        for v in values {
            h.append(hname.clone(), v);
        }
        c.parsed.headers_changed();
    })
}

// ---------------------------------------------------------------- ngx.log

fn log(lua: &Lua, args: MultiValue) -> mlua::Result<()> {
    let mut it = args.into_iter();
    let level = match it.next() {
        Some(Value::Integer(n)) => n,
        Some(Value::Number(n)) => n as i64,
        _ => return Err(mlua::Error::runtime("ngx.log: bad log level")),
    };
    let mut msg = String::new();
    for v in it {
        match &v {
            Value::Table(t) if t.metatable().is_none() => {
                return Err(mlua::Error::runtime(
                    "ngx.log: expected table to have __tostring metamethod",
                ))
            }
            // Numbers as lua-nginx-module writes them: a whole number in
            // the 32-bit range as an integer (so -0 is "0"), anything else
            // as `%.14g` (Lua's `tostring`), not Rust's shortest round trip.
            Value::Number(n) if *n == f64::from(*n as i32) => {
                msg.push_str(&(*n as i32).to_string());
            }
            Value::Number(_) | Value::Integer(_) => {
                if let Some(s) = lua.coerce_string(v)? {
                    msg.push_str(&s.to_string_lossy());
                }
            }
            _ => msg.push_str(&v.to_string()?),
        }
    }
    let at = lua
        .inspect_stack(1, |d| {
            let src = d.source();
            let file = src
                .source
                .as_deref()
                .map(|s| s.strip_prefix('@').unwrap_or(s).to_string())
                .unwrap_or_default();
            format!("{file}:{}", d.current_line().unwrap_or(0))
        })
        .unwrap_or_default();
    match level {
        ..=4 => tracing::error!(target: "graygate::script", script = %at, "{msg}"),
        5 => tracing::warn!(target: "graygate::script", script = %at, "{msg}"),
        6 | 7 => tracing::info!(target: "graygate::script", script = %at, "{msg}"),
        _ => tracing::debug!(target: "graygate::script", script = %at, "{msg}"),
    }
    Ok(())
}

// ---------------------------------------------------------------- ngx.shared

struct DictUd(Arc<SharedDict>);

fn dict_key(lua: &Lua, k: Value) -> mlua::Result<Result<Vec<u8>, &'static str>> {
    let s = match k {
        Value::String(_) | Value::Integer(_) | Value::Number(_) => lua.coerce_string(k)?,
        _ => None,
    };
    let Some(s) = s else {
        return Err(mlua::Error::runtime("bad key type (string expected)"));
    };
    let b = s.as_bytes().to_vec();
    if b.is_empty() {
        return Ok(Err("empty key"));
    }
    if b.len() > MAX_KEY_LEN {
        return Ok(Err("key too long"));
    }
    Ok(Ok(b))
}

fn to_dict_value(v: Value) -> mlua::Result<Option<DictValue>> {
    Ok(match v {
        Value::Nil => None,
        Value::Integer(i) => Some(DictValue::Int(i)),
        Value::Number(n) => Some(DictValue::Num(n)),
        Value::Boolean(b) => Some(DictValue::Bool(b)),
        Value::String(s) => Some(DictValue::Str(s.as_bytes().to_vec())),
        other => {
            return Err(mlua::Error::runtime(format!(
                "bad value type {}",
                other.type_name()
            )))
        }
    })
}

fn from_dict_value(lua: &Lua, v: DictValue) -> mlua::Result<Value> {
    Ok(match v {
        DictValue::Int(i) => Value::Integer(i),
        DictValue::Num(n) => Value::Number(n),
        DictValue::Bool(b) => Value::Boolean(b),
        DictValue::Str(s) => Value::String(lua.create_string(s)?),
    })
}

/// `ok, err, forcible` as OpenResty's write methods return them.
fn write_result(lua: &Lua, r: Result<bool, DictError>) -> mlua::Result<MultiValue> {
    Ok(match r {
        Ok(forcible) => {
            MultiValue::from_iter([Value::Boolean(true), Value::Nil, Value::Boolean(forcible)])
        }
        Err(e) => MultiValue::from_iter([
            Value::Boolean(false),
            Value::String(lua.create_string(e.as_str())?),
            Value::Boolean(false),
        ]),
    })
}

fn bad_key(lua: &Lua, msg: &str) -> mlua::Result<MultiValue> {
    Ok(MultiValue::from_iter([
        Value::Nil,
        Value::String(lua.create_string(msg)?),
    ]))
}

type WriteFn = fn(&SharedDict, &[u8], DictValue, Option<f64>) -> Result<bool, DictError>;

impl UserData for DictUd {
    fn add_methods<M: UserDataMethods<Self>>(m: &mut M) {
        m.add_method("get", |lua, d, k: Value| {
            let k = match dict_key(lua, k)? {
                Ok(k) => k,
                Err(e) => return bad_key(lua, e),
            };
            match d.0.get(&k) {
                Some(v) => Ok(MultiValue::from_iter([from_dict_value(lua, v)?])),
                None => Ok(MultiValue::from_iter([Value::Nil])),
            }
        });
        m.add_method("set", |lua, d, (k, v, ttl): (Value, Value, Option<f64>)| {
            let k = match dict_key(lua, k)? {
                Ok(k) => k,
                Err(e) => return write_result_err(lua, e),
            };
            write_result(lua, d.0.set(&k, to_dict_value(v)?, ttl))
        });
        let writers: [(&str, WriteFn); 2] = [
            ("add", |d, k, v, t| d.add(k, v, t)),
            ("replace", |d, k, v, t| d.replace(k, v, t)),
        ];
        for (name, f) in writers {
            m.add_method(
                name,
                move |lua, d, (k, v, ttl): (Value, Value, Option<f64>)| {
                    let k = match dict_key(lua, k)? {
                        Ok(k) => k,
                        Err(e) => return write_result_err(lua, e),
                    };
                    let Some(v) = to_dict_value(v)? else {
                        return Err(mlua::Error::runtime("attempt to store nil"));
                    };
                    write_result(lua, f(&d.0, &k, v, ttl))
                },
            );
        }
        m.add_method(
            "incr",
            |lua, d, (k, by, init, init_ttl): (Value, Value, Value, Option<f64>)| {
                let k = match dict_key(lua, k)? {
                    Ok(k) => k,
                    Err(e) => return bad_key(lua, e),
                };
                let number = |v: Value| -> mlua::Result<Option<DictValue>> {
                    match v {
                        Value::Nil => Ok(None),
                        Value::Integer(i) => Ok(Some(DictValue::Int(i))),
                        Value::Number(n) => Ok(Some(DictValue::Num(n))),
                        _ => Err(mlua::Error::runtime("incr: value is not a number")),
                    }
                };
                let Some(by) = number(by)? else {
                    return Err(mlua::Error::runtime("incr: value is not a number"));
                };
                match d.0.incr(&k, by, number(init)?, init_ttl) {
                    Ok(v) => Ok(MultiValue::from_iter([from_dict_value(lua, v)?])),
                    Err(e) => bad_key(lua, e.as_str()),
                }
            },
        );
        m.add_method("delete", |lua, d, k: Value| {
            if let Ok(k) = dict_key(lua, k)? {
                d.0.delete(&k);
            }
            Ok(())
        });
        m.add_method("flush_all", |_, d, ()| {
            d.0.flush_all();
            Ok(())
        });
        m.add_method("get_keys", |lua, d, max: Option<usize>| {
            let keys = d.0.keys(max.unwrap_or(1024));
            lua.create_sequence_from(
                keys.into_iter()
                    .map(|k| lua.create_string(k))
                    .collect::<mlua::Result<Vec<_>>>()?,
            )
        });
    }
}

fn write_result_err(lua: &Lua, e: &str) -> mlua::Result<MultiValue> {
    Ok(MultiValue::from_iter([
        Value::Boolean(false),
        Value::String(lua.create_string(e)?),
        Value::Boolean(false),
    ]))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn uri_normalisation_like_nginx() {
        let n = |p: &str| String::from_utf8(normalize_uri(p)).unwrap();
        assert_eq!(n("/"), "/");
        assert_eq!(n("/a//b"), "/a/b");
        assert_eq!(n("/a/./b/../c"), "/a/c");
        assert_eq!(n("/a/b/"), "/a/b/");
        assert_eq!(n("/a/b/.."), "/a/");
        assert_eq!(n("/caf%C3%A9/x%20y"), "/café/x y");
        assert_eq!(n("/../x"), "/x");
    }

    // ------------------------------------------------ through real Lua

    use crate::lane::script::{call_lane, RuleCtx, ScriptError, ScriptSource};
    use std::collections::BTreeMap;
    use std::net::IpAddr;
    use std::sync::Arc;

    pub(crate) fn request(uri: &str, ip: &str, headers: &[(&str, &str)]) -> RequestInfo {
        let mut b = http::Request::builder().method("POST").uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (parts, _) = b.body(()).unwrap().into_parts();
        RequestInfo {
            parts,
            client_ip: ip.parse::<IpAddr>().unwrap(),
            host: "shop.example".into(),
            peer_trusted: false,
        }
    }

    use crate::lane::script::vm_mode::{both_modes, jit};

    /// Runs `body` as the lane function on `req`; returns its string result.
    fn run_with(
        body: &str,
        req: RequestInfo,
        dicts: BTreeMap<String, Arc<SharedDict>>,
    ) -> (RequestInfo, Result<Option<String>, ScriptError>) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.lua");
        std::fs::write(&p, format!("return function(req)\n{body}\nend\n")).unwrap();
        let mut src = ScriptSource::load(&p).unwrap();
        src.dicts = dicts;
        src.jit = jit();
        call_lane(&src, &Arc::new(BTreeMap::new()), req, RuleCtx::default())
    }

    fn eval(body: &str, req: RequestInfo) -> String {
        let (_, r) = run_with(body, req, BTreeMap::new());
        r.unwrap_or_else(|e| panic!("{body}: {e}"))
            .unwrap_or_else(|| "<nil>".into())
    }

    fn std_req() -> RequestInfo {
        request(
            "/a//b/../c%20d?Name=J%20o&name=x&flag&uid=42",
            "10.1.2.3",
            &[
                ("X-User-Id", "u-7"),
                ("Cookie", "sid=abc; Ver=\"v2\""),
                ("Accept", "a"),
                ("accept", "b"),
            ],
        )
    }

    #[test]
    fn crc32_is_the_hosts_on_both_sides_of_the_lua_length() {
        both_modes(crc32_is_the_hosts_on_both_sides_of_the_lua_length_in);
    }

    /// With the JIT on, strings up to CRC32_LUA_MAX bytes are hashed in
    /// Lua: every length up to past it, every byte value, each string
    /// hashed often enough to be compiled; numbers are hashed as their text.
    fn crc32_is_the_hosts_on_both_sides_of_the_lua_length_in() {
        let text =
            |n: usize| -> Vec<u8> { (1..=n).map(|i| ((i * 37 + n * 11) % 256) as u8).collect() };
        let body = r#"
            local out = {}
            for n = 0, 40 do
              local t = {}
              for i = 1, n do t[i] = string.char((i * 37 + n * 11) % 256) end
              local s = table.concat(t)
              local a
              for _ = 1, 60 do a = ngx.crc32_short(s) end
              out[#out + 1] = type(a) .. string.format("%.0f/%.0f", a, ngx.crc32_long(s))
            end
            out[#out + 1] = tostring(ngx.crc32_short(12345)) .. tostring(ngx.crc32_long(-1.5))
            out[#out + 1] = tostring(pcall(ngx.crc32_short, {}))
            return table.concat(out, ",")
        "#;
        let mut want: Vec<String> = (0..=40)
            .map(|n| {
                let c = crc32fast::hash(&text(n));
                format!("number{c}/{c}")
            })
            .collect();
        want.push(format!(
            "{}{}",
            crc32fast::hash(b"12345"),
            crc32fast::hash(b"-1.5")
        ));
        want.push("false".into());
        assert_eq!(eval(body, std_req()), want.join(","));
    }

    #[test]
    fn ngx_var_fields() {
        let v = |name: &str| eval(&format!("return tostring(ngx.var.{name})"), std_req());
        assert_eq!(v("remote_addr"), "10.1.2.3");
        assert_eq!(v("uri"), "/a/c d");
        assert_eq!(
            v("request_uri"),
            "/a//b/../c%20d?Name=J%20o&name=x&flag&uid=42"
        );
        assert_eq!(v("args"), "Name=J%20o&name=x&flag&uid=42");
        assert_eq!(v("host"), "shop.example");
        assert_eq!(v("request_method"), "POST");
        assert_eq!(v("scheme"), "http");
        assert_eq!(v("http_x_user_id"), "u-7");
        assert_eq!(v("http_accept"), "a, b");
        assert_eq!(v("http_missing"), "nil");
        // $cookie_: case-insensitive name, raw value.
        assert_eq!(v("cookie_sid"), "abc");
        assert_eq!(v("cookie_ver"), "\"v2\"");
        assert_eq!(v("cookie_nope"), "nil");
        // $arg_: first match, case-insensitive, not decoded; `flag` has no value.
        assert_eq!(v("arg_name"), "J%20o");
        assert_eq!(v("arg_uid"), "42");
        assert_eq!(v("arg_flag"), "nil");
        assert_eq!(v("no_such_variable"), "nil");
        let no_args = request("/x", "::1", &[]);
        assert_eq!(eval("return tostring(ngx.var.args)", no_args), "nil");
        let bare = request("/x?", "::1", &[]);
        assert_eq!(
            eval(
                "return tostring(ngx.var.args) .. '|' .. ngx.var.is_args",
                bare
            ),
            "nil|"
        );
        // Only `$args` is changeable, as in nginx.
        let (_, r) = run_with("ngx.var.uri = '/x'", std_req(), BTreeMap::new());
        assert!(r.unwrap_err().message.contains("not changeable"));
        let (req, r) = run_with(
            "ngx.var.args = 'a=1&b=x y'\nreturn ngx.var.args .. '|' .. ngx.var.arg_b",
            std_req(),
            BTreeMap::new(),
        );
        assert_eq!(r.unwrap().as_deref(), Some("a=1&b=x%20y|x%20y"));
        assert_eq!(req.parts.uri.query(), Some("a=1&b=x%20y"));
        let (req, r) = run_with(
            "ngx.var.args = nil\nreturn tostring(ngx.var.args)",
            std_req(),
            BTreeMap::new(),
        );
        assert_eq!(r.unwrap().as_deref(), Some("nil"));
        assert_eq!(req.parts.uri.query(), None);
    }

    #[test]
    fn repeated_headers_and_cookies_on_both_sides_of_the_scan_threshold() {
        // A small map is scanned for a name's values, a large one hashed:
        // the same values in the same order either way.
        let filler: Vec<String> = (0..crate::lane::HEADER_SCAN_MAX + 2)
            .map(|i| format!("x-filler-{i}"))
            .collect();
        for extra in [0, filler.len()] {
            let mut hs = vec![
                ("Cookie", "a=1"),
                ("X-R", "x"),
                ("cookie", "b=2; a=3"),
                ("x-r", "y"),
            ];
            hs.extend(filler[..extra].iter().map(|f| (f.as_str(), "z")));
            let r = request("/p", "10.0.0.1", &hs);
            assert_eq!(
                r.parts.headers.keys_len() > crate::lane::HEADER_SCAN_MAX,
                extra > 0
            );
            let got = eval(
                "return ngx.var.cookie_a .. ngx.var.cookie_b .. '|' .. ngx.var.http_x_r .. '|' ..
                   ngx.var.http_cookie .. '|' .. tostring(ngx.var.cookie_c)",
                r,
            );
            assert_eq!(got, "12|x, y|a=1; b=2; a=3|nil", "{extra}");
        }
    }

    #[test]
    fn batched_values_that_are_not_utf8_come_as_their_bytes() {
        both_modes(batched_values_that_are_not_utf8_come_as_their_bytes_in);
    }

    fn batched_values_that_are_not_utf8_come_as_their_bytes_in() {
        // The batch's strings are pushed as they are where UTF-8; a header
        // value with obs-text, a decoded %E9 and a value of 127 bytes or
        // more (its length byte is not UTF-8) take the Lua-string path,
        // beside UTF-8 ones in the same call.
        let long = "v".repeat(200);
        let mut r = request(
            &format!("/p?a=%E9&b=ok&c={long}"),
            "10.0.0.1",
            &[("x-b", "ok"), ("x-long", &long)],
        );
        let raw = HeaderValue::from_bytes(b"\xe9t\xe9").unwrap();
        r.parts.headers.insert("x-a", raw);
        let got = eval(
            "local h, a = ngx.req.get_headers(), ngx.req.get_uri_args()
             local v = ngx.var.http_x_a
             return table.concat({ h['x-a']:byte(1), #h['x-a'], h['x-b'], #h['x-long'],
               a.a:byte(1), #a.a, a.b, #a.c, v:byte(1), #v, ngx.var.http_x_b,
               #ngx.var.http_x_long, #ngx.var.arg_c }, ' ')",
            r,
        );
        assert_eq!(got, "233 3 ok 200 233 1 ok 200 233 3 ok 200 200");
    }

    #[test]
    fn ngx_req_get_headers_uri_args_method() {
        let r = eval(
            "local h = ngx.req.get_headers()
             return h['x-user-id'] .. '|' .. h['X-User-Id'] .. '|' .. h.x_user_id .. '|' ..
                    type(h.accept) .. #h.accept .. h.accept[2] .. '|' .. tostring(h.nope)",
            std_req(),
        );
        assert_eq!(r, "u-7|u-7|u-7|table2b|nil");
        let r = eval(
            "local a = ngx.req.get_uri_args()
             return a.Name .. '|' .. a.name .. '|' .. tostring(a.flag) .. '|' .. a.uid .. '|' .. tostring(a.other)",
            std_req(),
        );
        assert_eq!(r, "J o|x|true|42|nil");
        let r = eval(
            "local a = ngx.req.get_uri_args()
             return type(a.k) .. a.k[1] .. a.k[2] .. a.p",
            request("/?k=1&k=2&p=a+b%2B", "::1", &[]),
        );
        assert_eq!(r, "table12a b+");
        // Repeated names mixing flags and values, empty values and names,
        // `=` inside a value, and a decoded NUL (built without packing).
        let q = "local a = ngx.req.get_uri_args()
             local function s(v) if type(v) == 'table' then return '{' .. tostring(v[1]) .. ',' .. tostring(v[2]) .. ',' .. tostring(v[3]) .. '}' end return tostring(v) end
             return s(a.k) .. s(a.e) .. s(a.x) .. s(a.n) .. s(a[''])";
        let r = eval(q, request("/?k&k=1&k&e=&x=a=b&n=%00z&n=2&=v", "::1", &[]));
        assert_eq!(r, "{true,1,true}a=b{\0z,2,nil}nil");
        assert_eq!(eval("return ngx.req.get_method()", std_req()), "POST");
    }

    #[test]
    fn ngx_req_set_header_goes_upstream_and_escapes_crlf() {
        let (req, r) = run_with(
            "ngx.req.set_header('X-Gray-Reason', 'uid')
             ngx.req.set_header('X-Multi', {'a', 'b'})
             ngx.req.set_header('X-Num', 7)
             ngx.req.clear_header('Accept')
             return ngx.var.http_x_gray_reason",
            std_req(),
            BTreeMap::new(),
        );
        assert_eq!(r.unwrap().as_deref(), Some("uid"));
        let h = &req.parts.headers;
        assert_eq!(h["x-gray-reason"], "uid");
        assert_eq!(h.get_all("x-multi").iter().count(), 2);
        assert_eq!(h["x-num"], "7");
        assert!(!h.contains_key("accept"));

        // CR/LF are percent-encoded (lua-nginx-module): no header splits.
        let (req, r) = run_with(
            "ngx.req.set_header('X-A', 'v\\r\\nX-Evil: 1')\nngx.req.set_header('X-B\\n', 'w')\nreturn 'gray'",
            std_req(),
            BTreeMap::new(),
        );
        assert!(r.is_ok());
        assert_eq!(req.parts.headers["x-a"], "v%0D%0AX-Evil: 1");
        assert_eq!(req.parts.headers["x-b%0a"], "w");
        assert!(!req.parts.headers.contains_key("x-evil"));
        for bad in [
            "ngx.req.set_header('X A', 'v')",
            "ngx.req.set_header('X-A', 'v\\0')",
        ] {
            let body = format!("ngx.req.set_header('X-Before', '1')\n{bad}\nreturn 'gray'");
            let (req, r) = run_with(&body, std_req(), BTreeMap::new());
            assert!(r.is_err(), "{bad}");
            // A failing call leaves the request as it came.
            assert!(!req.parts.headers.contains_key("x-before"), "{bad}");
            assert!(!req.parts.headers.contains_key("x-evil"), "{bad}");
        }
    }

    #[test]
    fn mentioned_var_names_are_found_in_the_source() {
        let names = mentioned_vars([
            "local a = ngx.var.remote_addr .. ngx.var['http_x_a'] .. ngx.var[\"cookie_b\"]
             -- ngx.var.arg_c in a comment counts too
             local x = myngx.var.nope; ngx.var[k] = 1; ngx.var['a b'] = 2; ngx.var.uri = ngx.var.uri",
            "return ngx.var.remote_addr, ngx.var .. ''",
        ]);
        let names: Vec<&str> = names
            .iter()
            .map(|n| std::str::from_utf8(n).unwrap())
            .collect();
        assert_eq!(
            names,
            ["arg_c", "cookie_b", "http_x_a", "remote_addr", "uri"]
        );
        let many: String = (0..40).map(|i| format!("ngx.var.v{i:02} ")).collect();
        assert_eq!(mentioned_vars([many.as_str()]).len(), MAX_MENTIONED);
    }

    #[test]
    fn mentioned_and_other_names_read_alike() {
        both_modes(mentioned_and_other_names_read_alike_in);
    }

    fn mentioned_and_other_names_read_alike_in() {
        // Names the source mentions are fetched together on the first miss;
        // names built at run time (`'http_' .. h`) one by one; both give the
        // same values, nil included, read once or again, before and after
        // a change to the request.
        let r = eval(
            "local v = ngx.var
             local dyn = 'http_' .. 'x_user_id'
             local a = { tostring(v[dyn]), tostring(ngx.var.cookie_none), tostring(ngx.var.cookie_none),
                 ngx.var.http_x_user_id, tostring(v['arg_' .. 'uid']), ngx.var.remote_addr,
                 tostring(v['cookie_' .. 'sid']), tostring(v.http_absent) }
             ngx.req.set_header('X-User-Id', 'new')
             local b = { ngx.var.http_x_user_id, v[dyn], tostring(ngx.var.cookie_none) }
             -- Hot enough for a trace: the reads are then compiled table loads.
             local n = 0
             for _ = 1, 500 do
               if ngx.var.http_x_user_id == 'new' and ngx.var.cookie_none == nil then n = n + 1 end
             end
             return table.concat(a, '|') .. ' -> ' .. table.concat(b, '|') .. ' ' .. n",
            std_req(),
        );
        assert_eq!(r, "u-7|nil|nil|u-7|42|10.1.2.3|abc|nil -> new|new|nil 500");
    }

    #[test]
    fn fetched_together_empty_nul_and_unset_values() {
        both_modes(fetched_together_empty_nul_and_unset_values_in);
    }

    fn fetched_together_empty_nul_and_unset_values_in() {
        let body = "return ngx.var.uri .. '|' .. ngx.var.remote_addr .. '|'
             .. tostring(ngx.var.cookie_none) .. '|[' .. ngx.var.http_x_e .. ']|' .. ngx.var.http_x_user_id";
        let headers = [("X-User-Id", "u-7"), ("X-E", "")];
        // Packed: one string of records.
        let plain = request("/x/y", "10.1.2.3", &headers);
        assert_eq!(eval(body, plain), "/x/y|10.1.2.3|nil|[]|u-7");
        // Length-delimited: a decoded NUL packs too.
        let nul = request("/x%00y", "10.1.2.3", &headers);
        assert_eq!(eval(body, nul), "/x\0y|10.1.2.3|nil|[]|u-7");
        // Longer than a length byte holds: the values come one by one.
        let long = "v".repeat(PACKED_VALUE_MAX + 1);
        let headers = [("X-User-Id", long.as_str()), ("X-E", "")];
        let r = eval(body, request("/x/y", "10.1.2.3", &headers));
        assert_eq!(r, format!("/x/y|10.1.2.3|nil|[]|{long}"));
        let fits = "w".repeat(PACKED_VALUE_MAX);
        let headers = [("X-User-Id", fits.as_str()), ("X-E", "")];
        let r = eval(body, request("/x/y", "10.1.2.3", &headers));
        assert_eq!(r, format!("/x/y|10.1.2.3|nil|[]|{fits}"));
    }

    #[test]
    fn headers_and_args_come_with_the_batch_or_alone() {
        both_modes(headers_and_args_come_with_the_batch_or_alone_in);
    }

    fn headers_and_args_come_with_the_batch_or_alone_in() {
        // The batch brings get_headers()/get_uri_args() where the source
        // names them, whichever is asked for first; a script reaching them
        // by a built name gets them by their own host calls. All alike.
        let tail = "return table.concat({ tostring(v), h['x-user-id'], h.Accept[2], tostring(a.uid),
                 a.Name, tostring(ngx.var.cookie_sid), tostring(ngx.req.get_headers(1)['x-user-id']) }, '|')";
        let want = "u-7|u-7|b|42|J o|abc|u-7";
        for (get_h, get_a) in [
            ("ngx.req.get_headers", "ngx.req.get_uri_args"),
            (
                "ngx.req['get_' .. 'headers']",
                "ngx.req['get_' .. 'uri_args']",
            ),
        ] {
            for order in [
                format!("local v = ngx.var.http_x_user_id local h = {get_h}() local a = {get_a}()"),
                format!("local h = {get_h}() local v = ngx.var.http_x_user_id local a = {get_a}()"),
                format!("local a = {get_a}() local h = {get_h}() local v = ngx.var.http_x_user_id"),
            ] {
                assert_eq!(
                    eval(&format!("{order}\n{tail}"), std_req()),
                    want,
                    "{order}"
                );
            }
        }
        // Changed after the batch: asked for later, they are rebuilt.
        let r = eval(
            "local v = ngx.var.http_x_user_id
             ngx.req.set_header('X-User-Id', 'new')
             ngx.var.args = 'uid=9'
             return v .. '|' .. ngx.req.get_headers()['x-user-id'] .. '|' .. ngx.req.get_uri_args().uid",
            std_req(),
        );
        assert_eq!(r, "u-7|new|9");
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
    fn the_batch_writes_remote_addr_and_cookies_of_any_request() {
        both_modes(the_batch_writes_remote_addr_and_cookies_of_any_request_in);
    }

    /// `remote_addr` written straight into the batch's string, IPv4 and
    /// the longest IPv6 texts, before and after other values; two
    /// `cookie_*` reads with and without a Cookie header (the second read
    /// of a request without cookies scans nothing).
    fn the_batch_writes_remote_addr_and_cookies_of_any_request_in() {
        let (_d, mut src) = crate::lane::script::vm_mode::load_src(
            "return function()
               return table.concat({ tostring(ngx.var.cookie_a), ngx.var.remote_addr,
                 tostring(ngx.var.cookie_b), tostring(ngx.var.http_x_user_id) }, '|')
             end\n",
        );
        src.jit = jit();
        let lists = Arc::new(BTreeMap::new());
        for ip in [
            "10.1.2.3",
            "255.255.255.255",
            "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255",
            "2001:db8:85a3:1234:5678:8a2e:370:7334",
            "::1",
        ] {
            for (headers, want) in [
                (vec![], "nil|IP|nil|nil"),
                (vec![("Cookie", "b=2; a=1"), ("X-User-Id", "u")], "1|IP|2|u"),
                (vec![("Cookie", "c=3"), ("X-User-Id", "u")], "nil|IP|nil|u"),
            ] {
                let text = ip.parse::<IpAddr>().unwrap().to_string();
                let req = request("/", ip, &headers);
                let got = call_lane(&src, &lists, req, RuleCtx::default()).1.unwrap();
                assert_eq!(got.unwrap(), want.replace("IP", &text), "{ip} {headers:?}");
            }
        }
    }

    #[test]
    fn tables_of_unchanged_entries_are_fresh_copies() {
        both_modes(tables_of_unchanged_entries_are_fresh_copies_in);
    }

    /// One VM, requests whose packed get_headers() / get_uri_args()
    /// entries repeat (the table is copied from the last one's entries):
    /// each request sees its own table with the request's values, however
    /// the one before changed its tables (fields added, changed, removed,
    /// repeated values' arrays written), hot enough for the JIT.
    fn tables_of_unchanged_entries_are_fresh_copies_in() {
        let (_d, mut src) = crate::lane::script::vm_mode::load_src(
            "local function list(t)
               local keys = {}
               for k in pairs(t) do keys[#keys + 1] = k end
               table.sort(keys)
               for i, k in ipairs(keys) do
                 local v = t[k]
                 if type(v) == 'table' then v = table.concat(v, '+') end
                 keys[i] = k .. '=' .. tostring(v)
               end
               return table.concat(keys, ' ')
             end
             return function()
               local h, a = ngx.req.get_headers(), ngx.req.get_uri_args()
               local out = list(h) .. ' | ' .. list(a)
               h.injected, h.accept[1], h['x-user-id'], h.host = 'x', 'changed', nil, 'h'
               a.injected, a.name[2], a.flag, a.uid = 'x', 'changed', nil, 'u'
               table.insert(h.accept, 'more')
               return out
             end\n",
        );
        src.jit = jit();
        let lists = Arc::new(BTreeMap::new());
        let one = |uid: &str| {
            let req = request(
                &format!("/p?name=a&name=b%20c&flag&uid={uid}"),
                "10.1.2.3",
                &[("X-User-Id", uid), ("Accept", "a"), ("accept", "b")],
            );
            call_lane(&src, &lists, req, RuleCtx::default())
                .1
                .unwrap()
                .unwrap()
        };
        let want =
            |uid: &str| format!("accept=a+b x-user-id={uid} | flag=true name=a+b c uid={uid}");
        for i in 0..150 {
            // Runs of the same entries, then a change.
            let uid = format!("u{}", i / 50);
            assert_eq!(one(&uid), want(&uid), "request {i}");
        }
    }

    #[test]
    fn cached_values_follow_set_header_and_args() {
        both_modes(cached_values_follow_set_header_and_args_in);
    }

    fn cached_values_follow_set_header_and_args_in() {
        let (req, r) = run_with(
            "local before = { ngx.var.http_x_user_id, ngx.req.get_headers()['x-user-id'],
                 ngx.var.cookie_sid, ngx.var.arg_uid, ngx.req.get_uri_args().uid, ngx.var.args }
             ngx.req.set_header('X-User-Id', 'new')
             ngx.req.set_header('Cookie', 'sid=zz')
             local mid = { ngx.var.http_x_user_id, ngx.req.get_headers()['x-user-id'],
                 ngx.var.cookie_sid, ngx.var.arg_uid, ngx.req.get_uri_args().uid }
             ngx.var.args = 'uid=9'
             local after = { ngx.var.arg_uid, ngx.req.get_uri_args().uid, ngx.var.args }
             return table.concat(before, '|') .. ' -> ' .. table.concat(mid, '|')
                 .. ' -> ' .. table.concat(after, '|')",
            std_req(),
            BTreeMap::new(),
        );
        assert_eq!(
            r.unwrap().as_deref(),
            Some(
                "u-7|u-7|abc|42|42|Name=J%20o&name=x&flag&uid=42 -> new|new|zz|42|42 -> 9|9|uid=9"
            )
        );
        assert_eq!(req.parts.headers["x-user-id"], "new");
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
    fn ngx_hashes_and_time() {
        let q = |e: &str| eval(&format!("return tostring({e})"), std_req());
        // Known CRC-32 (IEEE) and MD5 vectors.
        assert_eq!(
            q("ngx.crc32_short('The quick brown fox jumps over the lazy dog')"),
            "1095738169"
        );
        assert_eq!(
            q("ngx.crc32_long('The quick brown fox jumps over the lazy dog')"),
            "1095738169"
        );
        assert_eq!(q("ngx.crc32_short('')"), "0");
        assert_eq!(q("ngx.md5('')"), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(
            q("ngx.md5('The quick brown fox jumps over the lazy dog')"),
            "9e107d9d372bb6826bd81d3542a419d6"
        );
        assert_eq!(q("#ngx.md5_bin('x')"), "16");
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
        assert_eq!(q("ngx.ERR .. ngx.WARN .. ngx.INFO .. ngx.DEBUG"), "4578");
        assert_eq!(
            q("ngx.log(ngx.INFO, 'hello ', 1, nil, true) == nil"),
            "true"
        );
        assert!(run_with("ngx.log(ngx.ERR, {})", std_req(), BTreeMap::new())
            .1
            .is_err());
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

    #[test]
    fn shared_dict_methods() {
        let mut dicts = BTreeMap::new();
        dicts.insert("g".to_string(), Arc::new(SharedDict::new("g", 1 << 20)));
        let (_, r) = run_with(
            "local d = ngx.shared.g
             local out = {}
             local function put(...) for i = 1, select('#', ...) do out[#out+1] = tostring((select(i, ...))) end end
             put(d:get('k'))
             put(d:set('k', 'v'))
             put(d:get('k'))
             put(d:add('k', 'w'))
             put(d:add('n', 10))
             put(d:incr('n', 5))
             put(d:incr('missing', 1))
             put(d:incr('m2', 1, 100))
             put(d:incr('k', 1))
             put(d:replace('zz', 1))
             put(d:set('b', false))
             put(d:get('b'))
             d:delete('k')
             put(d:get('k'))
             put(d:set('', 1))
             put(ngx.shared.unknown)
             return table.concat(out, ',')",
            std_req(),
            dicts.clone(),
        );
        assert_eq!(
            r.unwrap().unwrap(),
            "nil,true,nil,false,v,false,exists,false,true,nil,false,15,nil,not found,101,nil,not a number,false,not found,false,true,nil,false,false,nil,false,empty key,false,nil"
        );
        // The values live in the Rust-side dict (shared across VMs).
        assert_eq!(dicts["g"].get(b"n"), Some(DictValue::Int(15)));
    }
}
