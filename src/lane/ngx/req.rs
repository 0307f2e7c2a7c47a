//! Layer: lane. `ngx.req.*`: `get_headers()` and `get_uri_args()` (built
//! here as packed entries, turned into tables by the glue), `get_method()`,
//! and `set_header` / `clear_header`, which change the request that goes
//! upstream (on the call's copy of it, kept only when the call succeeds).

use std::borrow::Cow;
use std::rc::Rc;

use http::{HeaderName, HeaderValue};
use mlua::{Either, Function, Lua, LuaString, Table, Value};
use percent_encoding::percent_decode;

use super::{Caches, DEFAULT_MAX};
use crate::lane::lent::{request_string, with_current, with_edit, with_req};
use crate::lane::RequestInfo;

/// `ngx.req`: the glue's `get_headers` / `get_uri_args`, and the host's
/// `get_method`, `set_header` and `clear_header` (each of the last two
/// empties the request's caches: they were built from the old headers).
pub(super) fn table(
    lua: &Lua,
    caches: &Rc<Caches>,
    get_headers: Function,
    get_uri_args: Function,
) -> mlua::Result<Table> {
    let t = lua.create_table()?;
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
    Ok(t)
}

/// The glue's `build_headers` and `build_args`: `get_headers(max)` /
/// `get_uri_args(max)`'s packed entries for the current request.
pub(super) fn builders(lua: &Lua) -> mlua::Result<(Function, Function)> {
    type Build = fn(&Lua, &RequestInfo, usize) -> mlua::Result<Value>;
    let builder = |build: Build| {
        lua.create_function(move |lua, max: Option<i64>| {
            with_current(|r, c| {
                c.ngx_cached = true;
                build(lua, r, limit(max))
            })?
        })
    };
    Ok((builder(headers_table)?, builder(args_table)?))
}

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
pub(super) fn headers_packed(r: &RequestInfo, max: usize) -> Vec<u8> {
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
pub(super) fn args_packed(
    lua: &Lua,
    r: &RequestInfo,
    max: usize,
) -> mlua::Result<Either<Vec<u8>, Value>> {
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
        c.cookies_args.headers_changed();
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{eval, request, run_with, std_req};
    use crate::lane::script::testing::{both_modes, jit, load_src};
    use crate::lane::script::{call_lane, RuleCtx};
    use std::collections::BTreeMap;
    use std::sync::Arc;

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
    fn tables_of_unchanged_entries_are_fresh_copies() {
        both_modes(tables_of_unchanged_entries_are_fresh_copies_in);
    }

    /// One VM, requests whose packed get_headers() / get_uri_args()
    /// entries repeat (the table is copied from the last one's entries):
    /// each request sees its own table with the request's values, however
    /// the one before changed its tables (fields added, changed, removed,
    /// repeated values' arrays written), hot enough for the JIT.
    fn tables_of_unchanged_entries_are_fresh_copies_in() {
        let (_d, mut src) = load_src(
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
}
