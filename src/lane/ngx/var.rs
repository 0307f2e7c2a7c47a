//! Layer: lane. `ngx.var.*`: nginx's variables of the request being
//! decided (`remote_addr`, `uri`, `args`, `http_*`, `cookie_*`, `arg_*`,
//! …) with nginx's semantics, read lazily through the script module's
//! slot; `ngx.var.args = …` is the one write, as in nginx. Cookies and
//! arguments are split into pairs once per request ([`CookiesAndArgs`]).

use std::borrow::Cow;

use http::{HeaderName, HeaderValue};
use mlua::{Either, Lua, LuaString, Value};
use percent_encoding::percent_decode;

use crate::lane::lent::{request_string, with_current, with_edit, CookiesAndArgs, Pair};
use crate::lane::RequestInfo;

/// `ngx.var` reads: the variable's value for the current request.
pub(super) fn fetch(lua: &Lua, name: LuaString) -> mlua::Result<Value> {
    let name = name.as_bytes();
    with_current(|r, c| {
        c.ngx_cached = true;
        var_value(lua, r, &mut c.cookies_args, &name)
    })?
}

/// `ngx.var.NAME` of `r` as a Lua value (nil where unset).
fn var_value(
    lua: &Lua,
    r: &RequestInfo,
    split: &mut CookiesAndArgs,
    name: &[u8],
) -> mlua::Result<Value> {
    match var_bytes(r, split, name) {
        Some(v) => Ok(Value::String(request_string(lua, &v)?)),
        None => Ok(Value::Nil),
    }
}

/// `ngx.var.NAME` of `r`; cookies and arguments split once per request
/// into `split`.
pub(super) fn var_bytes<'a>(
    r: &'a RequestInfo,
    split: &mut CookiesAndArgs,
    name: &[u8],
) -> Option<Cow<'a, [u8]>> {
    match name {
        n if n.starts_with(b"cookie_") => cookie_var(r, split, &n[7..]).map(Cow::Borrowed),
        n if n.starts_with(b"arg_") => arg_var(r, split, &n[4..]).map(Cow::Borrowed),
        n => variable(r, n),
    }
}

/// `ngx.var.x = v`: only `args` (`query_string`) is changeable, as in nginx.
pub(super) fn store(lua: &Lua, name: &[u8], value: Value) -> mlua::Result<()> {
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
        c.cookies_args.args = None;
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
        b"remote_addr" => Some(Cow::Owned(crate::lane::ip_text(r.client_ip))),
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
                let v = cookie_var(r, &mut CookiesAndArgs::default(), c)?;
                Some(Cow::Borrowed(v))
            } else if let Some(a) = name.strip_prefix(b"arg_") {
                let v = arg_var(r, &mut CookiesAndArgs::default(), a)?;
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
pub(super) fn header_name(name: &[u8]) -> Option<HeaderName> {
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
pub(super) fn header_values<'a>(r: &'a RequestInfo, hname: &HeaderName) -> Option<Cow<'a, [u8]>> {
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
/// (a `HeaderName` compare per entry) instead of hashed (`get_all` hashes
/// the name and probes on every lookup), as `RequestInfo::header_bytes`
/// does.
fn values_of<'a, 'n>(
    h: &'a http::HeaderMap,
    name: &'n HeaderName,
) -> impl Iterator<Item = &'a HeaderValue> + use<'a, 'n> {
    if h.keys_len() <= crate::lane::HEADER_SCAN_MAX {
        Either::Left(h.iter().filter(move |(k, _)| *k == name).map(|(_, v)| v))
    } else {
        Either::Right(h.get_all(name).iter())
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
fn cookie_var<'a>(r: &'a RequestInfo, split: &mut CookiesAndArgs, name: &[u8]) -> Option<&'a [u8]> {
    let headers = || values_of(&r.parts.headers, &http::header::COOKIE);
    if split.cookies.as_ref().is_some_and(Vec::is_empty) {
        // No cookies (split before): no header scan.
        return None;
    }
    let pairs = split.cookies.get_or_insert_with(|| {
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
fn arg_var<'a>(r: &'a RequestInfo, split: &mut CookiesAndArgs, name: &[u8]) -> Option<&'a [u8]> {
    let q = r.parts.uri.query()?.as_bytes();
    let pairs = split.args.get_or_insert_with(|| {
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

#[cfg(test)]
mod tests {
    use super::super::testing::{eval, request, run_with, std_req};
    use super::*;
    use std::collections::BTreeMap;

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
}
