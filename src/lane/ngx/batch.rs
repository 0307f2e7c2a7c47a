//! Layer: lane. The batch: what a script's (and its modules') source
//! mentions of the `ngx` API is found at load ([`mentioned`]) and fetched
//! in one host call on a request's first `ngx.var` miss or first
//! `get_headers()` / `get_uri_args()` ([`fetch_all`]), packed into one
//! string that the glue's `fill` (`fill.lua`) stores into the cache.

use std::borrow::Cow;

use http::HeaderName;
use mlua::{Either, Lua, Table, Value};

use super::req::{args_packed, headers_packed};
use super::var::{header_name, header_values, var_bytes, variable};
use super::DEFAULT_MAX;
use crate::lane::lent::CookiesAndArgs;
use crate::lane::lent::{pushed, request_string, with_current, Pushed, Restore};
use crate::lane::RequestInfo;

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

/// A name [`mentioned_vars`] found, resolved at load: an `http_*` header's
/// name parsed once, not per request; any other read as [`var_bytes`] reads
/// it.
pub(super) enum VarName {
    Header(HeaderName),
    /// `remote_addr`: written into the batch's string as it is packed.
    RemoteAddr,
    Other(Vec<u8>),
}

impl VarName {
    pub(super) fn new(name: &[u8]) -> VarName {
        match name.strip_prefix(b"http_").and_then(header_name) {
            Some(h) => VarName::Header(h),
            None if name == b"remote_addr" => VarName::RemoteAddr,
            None => VarName::Other(name.to_vec()),
        }
    }

    /// Its value for `r` (as [`var_value`] gives it, before the Lua string).
    fn value<'a>(&self, r: &'a RequestInfo, split: &mut CookiesAndArgs) -> Option<Cow<'a, [u8]>> {
        match self {
            VarName::Header(h) => header_values(r, h),
            VarName::RemoteAddr => variable(r, b"remote_addr"),
            VarName::Other(n) => var_bytes(r, split, n),
        }
    }
}

/// The batch: the packed `get_headers()` entries (or nil: `headers`
/// false), likewise `get_uri_args()`'s, and all of `names`' values for the
/// current request, for the glue's `fill`: one string of records in order,
/// each a length byte (0: unset, else the value's length + 1) and the value
/// — one host string instead of a Lua string per value, each of which
/// mlua would reference and release — or, when a value is longer than
/// [`PACKED_VALUE_MAX`], a table of the values by position. Three values
/// always (a vararg glue is not compiled as well by LuaJIT).
pub(super) fn fetch_all(
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
                // At most 45 bytes (an IPv6 address): always packs,
                // written in place with no buffer of its own.
                let at = packed.len();
                packed.push(0);
                crate::lane::ip_text_into(r.client_ip, &mut packed);
                packed[at] = (packed.len() - at) as u8;
                continue;
            }
            match n.value(r, &mut c.cookies_args) {
                Some(v) if v.len() > PACKED_VALUE_MAX => {
                    let each = fetch_each(lua, r, &mut c.cookies_args, names)?;
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
    split: &mut CookiesAndArgs,
    names: &[VarName],
) -> mlua::Result<Table> {
    let t = lua.create_table()?;
    for (i, n) in names.iter().enumerate() {
        if let Some(v) = n.value(r, split) {
            t.raw_set(i + 1, request_string(lua, &v)?)?;
        }
    }
    Ok(t)
}

/// Lua source of `make_fill(DONE)` (`fill.lua`): a function storing `fetch_all`'s values
/// under `names` into the cache (the cache has no `__newindex`), from the
/// packed string by `byte`/`sub` — one statement per name, no loop — or
/// from the table of values. Names are identifier bytes
/// ([`mentioned_vars`]), so they are safe in a quoted literal.
pub(super) fn fill_source(names: &[Vec<u8>]) -> String {
    let mut packed = String::new();
    let mut each = String::new();
    for (i, n) in names.iter().enumerate() {
        let n = std::str::from_utf8(n).unwrap_or("");
        packed.push_str(&format!(
            "n = byte(s, p) if n ~= 0 then c[\"{n}\"] = sub(s, p + 1, p + n - 1) p = p + n else p = p + 1 end\n"
        ));
        each.push_str(&format!("c[\"{n}\"] = s[{}]\n", i + 1));
    }
    include_str!("fill.lua")
        .replace("--$PACKED\n", &packed)
        .replace("--$EACH\n", &each)
}

/// Most names [`mentioned_vars`] returns: a script mentioning more has the
/// rest fetched one by one.
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

#[cfg(test)]
mod tests {
    use super::super::testing::{eval, request, std_req};
    use super::*;
    use crate::lane::script::testing::{both_modes, jit, load_src};
    use crate::lane::script::{call_lane, RuleCtx};
    use http::HeaderValue;
    use std::collections::BTreeMap;
    use std::net::IpAddr;
    use std::sync::Arc;

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
    fn the_batch_writes_remote_addr_and_cookies_of_any_request() {
        both_modes(the_batch_writes_remote_addr_and_cookies_of_any_request_in);
    }

    /// `remote_addr` written straight into the batch's string, IPv4 and
    /// the longest IPv6 texts, before and after other values; two
    /// `cookie_*` reads with and without a Cookie header (the second read
    /// of a request without cookies scans nothing).
    fn the_batch_writes_remote_addr_and_cookies_of_any_request_in() {
        let (_d, mut src) = load_src(
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
}
