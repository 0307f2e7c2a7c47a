//! Layer: lane. The entry of a native lane script (one whose source does not
//! mention `ngx.`): the request values its source names as literals —
//! `req:header("NAME")`, `req:in_list("NAME")`, and with them
//! `graygate.bucket` of those header values — are read once per request in
//! Rust and handed to the lane call as its arguments, so the script's reads
//! of them are Lua calls that never leave the VM (a host call goes through
//! mlua's trampoline, argument conversion and result push). Any other name,
//! a name given in another case or built at run time, and every read after
//! `ngx.req.set_header` / `clear_header` in the same call go to the host
//! functions. The entry also empties the per-request globals and
//! checks the lane function's result type, in Lua.

use mlua::{BString, Function, IntoLua, IntoLuaMulti, Lua, LuaString, Table};

use super::lent::{request_string, Restore};
use super::RequestInfo;
use crate::base::lists::IpList;

/// Header names handed over per request, at most (more are read by host
/// calls).
const MAX_HEADERS: usize = 4;
/// Lists whose verdict is handed over per request, at most.
const MAX_LISTS: usize = 2;
/// Bits of one header value's `graygate.bucket` (0..=99) in the flags.
const BUCKET_BITS: usize = 7;
/// The flags' bit of list 0's verdict (list `i`'s is `LIST_BIT + i`),
/// above the buckets.
const LIST_BIT: usize = MAX_HEADERS * BUCKET_BITS;

/// What a native script's source names as literals (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Prefetch {
    /// `req:header("…")` names, as written (≤ [`MAX_HEADERS`]).
    headers: Vec<Vec<u8>>,
    /// The same names in lower case, as a request's header map holds them.
    lower: Vec<Vec<u8>>,
    /// `req:in_list("…")` names of lists that exist (≤ [`MAX_LISTS`]).
    lists: Vec<String>,
    /// `graygate.bucket` appears: each present value's bucket comes along.
    bucket: bool,
}

/// The string literals after `:method` in `texts` (the `req:method("…")`,
/// `req:method "…"` and `req:method('…')` forms), without escapes, first
/// mentions first, each once.
fn method_literals<'a>(texts: impl Iterator<Item = &'a str>, method: &str) -> Vec<Vec<u8>> {
    let re = regex::Regex::new(&format!(
        r#":\s*{method}\s*\(?\s*(?:"([^"\\\r\n]*)"|'([^'\\\r\n]*)')"#
    ))
    .expect("static regex");
    let mut out: Vec<Vec<u8>> = Vec::new();
    for text in texts {
        for c in re.captures_iter(text) {
            let lit = c.get(1).or_else(|| c.get(2)).map_or("", |m| m.as_str());
            if !out.iter().any(|o| o == lit.as_bytes()) {
                out.push(lit.as_bytes().to_vec());
            }
        }
    }
    out
}

impl Prefetch {
    /// What `texts` (the script's and its modules' sources) name, among
    /// `lists`.
    pub(crate) fn mentioned<'a>(
        texts: impl Iterator<Item = &'a str> + Clone,
        lists: &std::collections::BTreeMap<String, IpList>,
    ) -> Prefetch {
        let mut headers = method_literals(texts.clone(), "header");
        headers.truncate(MAX_HEADERS);
        let mut names: Vec<String> = method_literals(texts.clone(), "in_list")
            .into_iter()
            .filter_map(|n| String::from_utf8(n).ok())
            .filter(|n| lists.contains_key(n))
            .collect();
        names.truncate(MAX_LISTS);
        Prefetch {
            bucket: !headers.is_empty() && texts.clone().any(|t| t.contains("graygate.bucket")),
            lower: headers.iter().map(|h| h.to_ascii_lowercase()).collect(),
            headers,
            lists: names,
        }
    }

    /// The flags argument for `r`: header `j`'s bucket (when present and
    /// `bucket`) is at bit `7 j`, list `i`'s verdict for the client at bit
    /// [`LIST_BIT`]` + i` (below 2^30: exact as a Lua number). The glue
    /// reads them with `%` and comparisons, so no call to `bit`.
    fn flags(&self, lists: &std::collections::BTreeMap<String, IpList>, r: &RequestInfo) -> i64 {
        let mut f = 0i64;
        for (i, name) in self.lists.iter().enumerate() {
            if lists.get(name).is_some_and(|l| l.contains(r.client_ip)) {
                f |= 1 << (LIST_BIT + i);
            }
        }
        f
    }

    /// The named headers' first values in `r` (`None` where absent), in
    /// the order of `headers`.
    fn found<'r>(&self, r: &'r RequestInfo) -> [Option<&'r [u8]>; MAX_HEADERS] {
        let mut found: [Option<&[u8]>; MAX_HEADERS] = Default::default();
        let h = &r.parts.headers;
        if h.keys_len() <= super::HEADER_SCAN_MAX {
            // One pass over a small map for all the names (what
            // `header_bytes` finds for each: the first value of the name,
            // any case; stored names are lower case).
            for (k, val) in h.iter() {
                let k = k.as_str().as_bytes();
                for (f, name) in found.iter_mut().zip(&self.lower) {
                    if f.is_none() && k == name.as_slice() {
                        *f = Some(val.as_bytes());
                    }
                }
            }
        } else {
            for (f, name) in found.iter_mut().zip(&self.headers) {
                *f = r.header_bytes(name).map(|v| v.as_bytes());
            }
        }
        found
    }

    /// Calls `entry` (the function [`install`] makes) for `r`: the flags
    /// (list verdicts, buckets) and the named headers' values as its
    /// arguments. Returns the lane function's result: a lane name or nil,
    /// and the type's name when it returned anything else.
    ///
    /// The values are pushed as they are read, with the VM's memory limit
    /// lifted for the pushes only (mlua pushes a `&str` straight onto the
    /// stack when no limit is set; a `LuaString` made first costs a
    /// reference slot, two moves between Lua threads and its release): the
    /// call's last argument, [`Restore`], pushes nothing and sets the limit
    /// back before the function runs. A value that is not UTF-8 takes the strings'
    /// protected path ([`request_string`]).
    pub(crate) fn call(
        &self,
        lua: &Lua,
        entry: &Function,
        lists: &std::collections::BTreeMap<String, IpList>,
        r: &RequestInfo,
    ) -> mlua::Result<(Option<BString>, Option<BString>)> {
        let mut flags = self.flags(lists, r);
        let found = self.found(r);
        let mut text: [Option<&str>; MAX_HEADERS] = Default::default();
        let mut all_text = true;
        for (j, b) in found.iter().enumerate() {
            if let Some(b) = *b {
                if self.bucket {
                    flags |= i64::from(super::bucket(b)) << (BUCKET_BITS * j);
                }
                match std::str::from_utf8(b) {
                    Ok(t) if b.len() <= super::lent::UNLIMITED_STRING_MAX => text[j] = Some(t),
                    _ => all_text = false,
                }
            }
        }
        let n = self.headers.len();
        if !found.iter().any(Option::is_some) {
            return call_n(entry, n, flags, text, ());
        }
        if all_text {
            let limit = lua.set_memory_limit(0)?;
            let r = call_n(entry, n, flags, text, Restore(Some(limit)));
            if r.is_err() {
                // Restore runs before the function does; an error before
                // it (none is known) must not leave the limit lifted.
                lua.set_memory_limit(limit)?;
            }
            return r;
        }
        let mut v: [Option<LuaString>; MAX_HEADERS] = Default::default();
        for (slot, b) in v.iter_mut().zip(found) {
            if let Some(b) = b {
                *slot = Some(request_string(lua, b)?);
            }
        }
        call_n(entry, n, flags, v, ())
    }

    /// The glue [`install`] runs (see `GLUE_HEAD`).
    fn glue_source(&self) -> String {
        let k = self.headers.len();
        let names = |p: &str, n: usize| -> String {
            (1..=n).map(|i| format!(", {p}{i}")).collect::<String>()
        };
        let mut s = String::from(GLUE_HEAD);
        s.push_str(&format!(
            "local _{}{} = select(6, ...)\nlocal flags{}\n",
            names("n", k),
            names("l", self.lists.len()),
            names("v", k)
        ));
        s.push_str("rawset(req, 'header', function(self, name)\n  if not stale then\n");
        for i in 1..=k {
            s.push_str(&format!("    if name == n{i} then return v{i} end\n"));
        }
        s.push_str("  end\n  return host_header(self, name)\nend)\n");
        s.push_str("rawset(req, 'in_list', function(self, name)\n");
        // Bit `b` of flags is set when flags % 2^(b+1) >= 2^b.
        for (i, _) in self.lists.iter().enumerate() {
            let b = LIST_BIT + i;
            s.push_str(&format!(
                "  if name == l{} then return flags % {} >= {} end\n",
                i + 1,
                1u64 << (b + 1),
                1u64 << b
            ));
        }
        s.push_str("  return host_in_list(self, name)\nend)\n");
        if self.bucket {
            s.push_str("rawset(gg, 'bucket', function(s)\n");
            // Bits shift..shift+7 of flags, by `%` and `/` (exact on
            // numbers below 2^53).
            for i in 1..=k {
                let shift = BUCKET_BITS * (i - 1);
                let (low, high) = (1u64 << shift, 1u64 << (shift + BUCKET_BITS));
                s.push_str(&format!(
                    "  if s == v{i} and v{i} ~= nil then return (flags % {high} - flags % {low}) / {low} end\n"
                ));
            }
            s.push_str("  return host_bucket(s)\nend)\n");
        }
        s.push_str(&format!(
            "return function(lane, env)\n  return function(f{})\n    flags{} = f{}\n    stale = false\n",
            names("a", k),
            names("v", k),
            names("a", k)
        ));
        s.push_str(GLUE_TAIL);
        s
    }
}

/// `entry(flags, values[..n]…, last…)`.
fn call_n<T: IntoLua, L: IntoLuaMulti>(
    entry: &Function,
    n: usize,
    flags: i64,
    [a, b, c, d]: [Option<T>; MAX_HEADERS],
    last: L,
) -> mlua::Result<(Option<BString>, Option<BString>)> {
    match n {
        0 => entry.call((flags, last)),
        1 => entry.call((flags, a, last)),
        2 => entry.call((flags, a, b, last)),
        3 => entry.call((flags, a, b, c, last)),
        _ => entry.call((flags, a, b, c, d, last)),
    }
}

/// The glue's fixed start: its arguments (the `req` table, the real
/// `graygate` and `ngx.req` tables before they are locked, and the host
/// functions it stands in front of; then the names, from the 7th), and the
/// `set_header` / `clear_header` wrappers that mark the handed-over header
/// values stale for the rest of the call.
const GLUE_HEAD: &str = r#"
local req, gg, ngx_req, host_header, host_in_list, host_bucket = ...
local rawset, next, type = rawset, next, type
local stale = false
for _, name in ipairs({ "set_header", "clear_header" }) do
  local raw = ngx_req[name]
  rawset(ngx_req, name, function(...)
    stale = true
    return raw(...)
  end)
end
"#;

/// The entry's end: per-request globals emptied (writes land in `env`),
/// the lane function called, its result checked in Lua (a string or nil
/// as it is, anything else as nil and its type's name).
const GLUE_TAIL: &str = r#"    if next(env) ~= nil then
      for k in next, env do rawset(env, k, nil) end
    end
    local r = lane(req)
    if r == nil or type(r) == "string" then return r end
    return nil, type(r)
  end
end
"#;

/// Loads the glue for `p` into `lua` (before the libraries are locked and
/// before the script's top level runs, so a script that keeps
/// `graygate.bucket` in a local keeps the fast one): `req`'s `header` and
/// `in_list` and `graygate.bucket` become Lua functions answering the
/// named values, and the returned function makes the entry of a lane
/// function, `make(lane, env)`.
pub(crate) fn install(
    lua: &Lua,
    p: &Prefetch,
    req: &Table,
    globals: &Table,
) -> mlua::Result<Function> {
    let gg: Table = globals.raw_get("graygate")?;
    let ngx_req: Table = globals.raw_get::<Table>("ngx")?.raw_get("req")?;
    let mut args = mlua::MultiValue::new();
    let host_header: Function = req.raw_get("header")?;
    let host_in_list: Function = req.raw_get("in_list")?;
    let host_bucket: Function = gg.raw_get("bucket")?;
    for v in [
        mlua::Value::Table(req.clone()),
        mlua::Value::Table(gg),
        mlua::Value::Table(ngx_req),
        mlua::Value::Function(host_header),
        mlua::Value::Function(host_in_list),
        mlua::Value::Function(host_bucket),
    ] {
        args.push_back(v);
    }
    for n in &p.headers {
        args.push_back(mlua::Value::String(lua.create_string(n)?));
    }
    for n in &p.lists {
        args.push_back(mlua::Value::String(lua.create_string(n)?));
    }
    lua.load(p.glue_source())
        .set_name("=graygate_native")
        .call(args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lane::script::testing::{both_modes, load_src};
    use crate::lane::script::{call_lane, RuleCtx};
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::sync::Arc;

    fn lists() -> Arc<BTreeMap<String, IpList>> {
        let mut l = BTreeMap::new();
        for (name, net) in [("office", "127.0.0.0/24\n"), ("vpn", "10.0.0.0/8\n")] {
            l.insert(
                name.to_string(),
                IpList::parse(Path::new("l"), net).unwrap(),
            );
        }
        Arc::new(l)
    }

    /// A request for `/` from `ip` with `headers`.
    fn request(ip: &str, headers: &[(&str, &str)]) -> RequestInfo {
        let mut b = http::Request::builder().uri("/");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (parts, _) = b.body(()).unwrap().into_parts();
        RequestInfo {
            parts,
            client_ip: ip.parse().unwrap(),
            host: "h".into(),
            peer_trusted: false,
        }
    }

    /// Runs `text`'s lane function for a request from `ip` with `headers`.
    fn run(text: &str, ip: &str, headers: &[(&str, &str)]) -> Result<Option<String>, String> {
        let (_d, src) = load_src(text);
        call_lane(&src, &lists(), request(ip, headers), RuleCtx::default())
            .1
            .map_err(|e| e.message)
    }

    #[test]
    fn the_source_names_are_found_in_each_call_form() {
        let texts = [
            "local a = req:header(\"X-Gray\") .. req:header 'X-User-Id'\n",
            "req : header ( 'X-Gray' ) req:header(\"a\\\"b\") req:in_list('office') req:in_list \"nope\"\n",
            "graygate.bucket(x) req:in_list('vpn') req:in_list('office')",
        ];
        let p = Prefetch::mentioned(texts.iter().copied(), &lists());
        assert_eq!(p.headers, [b"X-Gray".to_vec(), b"X-User-Id".to_vec()]);
        assert_eq!(p.lower, [b"x-gray".to_vec(), b"x-user-id".to_vec()]);
        assert_eq!(p.lists, ["office", "vpn"]);
        assert!(p.bucket);
        // No header named: no bucket to hand over; at most MAX_HEADERS.
        let p = Prefetch::mentioned(["graygate.bucket(req.ip)"].into_iter(), &lists());
        assert!(!p.bucket && p.headers.is_empty());
        let many: String = (0..9).map(|i| format!("req:header('h{i}') ")).collect();
        let p = Prefetch::mentioned([many.as_str()].into_iter(), &lists());
        assert_eq!(p.headers.len(), MAX_HEADERS);
    }

    #[test]
    fn named_values_are_what_the_host_calls_give() {
        both_modes(named_values_are_what_the_host_calls_give_in);
    }

    fn named_values_are_what_the_host_calls_give_in() {
        // Each named read next to the same read by a name the source does
        // not name (another case: a host call), for six names (two beyond
        // MAX_HEADERS), present, absent and repeated, and both lists.
        let text = "return function(req)\n  local out = {}\n  for _, n in ipairs({ 'X-A', 'X-B', 'X-C', 'X-D', 'X-E', 'X-F' }) do\n    out[#out + 1] = tostring(req:header(n)) .. '=' .. tostring(req:header(string.lower(n)))\n  end\n  local a, b, c, d, e, f = req:header('X-A'), req:header('X-B'), req:header('X-C'), req:header('X-D'), req:header('X-E'), req:header('X-F')\n  out[#out + 1] = tostring(req:in_list('office')) .. tostring(req:in_list('vpn'))\n  out[#out + 1] = tostring(req:in_list(string.lower('OFFICE'))) .. tostring(req:in_list(string.lower('VPN')))\n  return table.concat(out, ' ')\nend\n";
        // Both sides of HEADER_SCAN_MAX (a small map is scanned once for
        // all the names, a large one looked up by name).
        let filler: Vec<String> = (0..crate::lane::HEADER_SCAN_MAX + 2)
            .map(|i| format!("x-filler-{i}"))
            .collect();
        for extra in [0, filler.len()] {
            let mut hs = vec![
                ("x-a", "1"),
                ("X-C", "c1"),
                ("x-c", "c2"),
                ("X-D", ""),
                ("x-f", "f"),
            ];
            hs.extend(filler[..extra].iter().map(|f| (f.as_str(), "z")));
            let got = run(text, "127.0.0.1", &hs);
            assert_eq!(
                got.unwrap().as_deref(),
                Some("1=1 nil=nil c1=c1 = nil=nil f=f truefalse truefalse"),
                "{extra}"
            );
        }
        let got = run(text, "10.1.2.3", &[("x-b", "2")]);
        assert_eq!(
            got.unwrap().as_deref(),
            Some("nil=nil 2=2 nil=nil nil=nil nil=nil nil=nil falsetrue falsetrue")
        );
    }

    #[test]
    fn a_named_value_that_is_not_utf8_is_its_bytes() {
        both_modes(a_named_value_that_is_not_utf8_is_its_bytes_in);
    }

    fn a_named_value_that_is_not_utf8_is_its_bytes_in() {
        // Such a value takes the protected string path; a UTF-8 one beside
        // it in the same call too.
        let text = "return function(req)\n  local a, b = req:header('X-A'), req:header('X-B')\n  return tostring(a == req:header(string.lower('X-A'))) .. #a .. b .. graygate.bucket(a)\nend\n";
        let (_d, src) = load_src(text);
        let mut r = request("127.0.0.1", &[("x-b", "b")]);
        let raw = http::HeaderValue::from_bytes(b"\xe9t\xe9").unwrap();
        r.parts.headers.insert("x-a", raw);
        let got = call_lane(&src, &lists(), r, RuleCtx::default()).1.unwrap();
        let want = format!("true3b{}", crate::lane::bucket(b"\xe9t\xe9"));
        assert_eq!(got, Some(want));
    }

    #[test]
    fn graygate_bucket_is_the_scripts_own_where_it_shadows_it() {
        both_modes(graygate_bucket_is_the_scripts_own_where_it_shadows_it_in);
    }

    fn graygate_bucket_is_the_scripts_own_where_it_shadows_it_in() {
        // Read from the budget table (`budget::direct_bucket`) or as the
        // global, `graygate.bucket` is what the script would see.
        let mine = "{ bucket = function() return 'mine' end }";
        for (text, want) in [
            (
                "return function(req) return graygate.bucket('abc') .. graygate.bucket(req:header('X-A')) end\n".to_string(),
                Ok(format!("{}{}", crate::lane::bucket(b"abc"), crate::lane::bucket(b"1"))),
            ),
            (
                format!("local graygate = {mine}\nreturn function() return graygate.bucket('abc') end\n"),
                Ok("mine".to_string()),
            ),
            (
                format!("return function() graygate = {mine} return graygate.bucket('abc') end\n"),
                Ok("mine".to_string()),
            ),
            (
                format!("return function() _G.graygate = {mine} return graygate.bucket('abc') end\n"),
                Ok("mine".to_string()),
            ),
            (
                "return function() function graygate.bucket() return 'mine' end return graygate.bucket('abc') end\n".to_string(),
                Err("graygate is read-only"),
            ),
        ] {
            let got = run(&text, "127.0.0.1", &[("x-a", "1")]);
            match want {
                Ok(w) => assert_eq!(got, Ok(Some(w)), "{text}"),
                Err(w) => assert!(got.as_ref().unwrap_err().contains(w), "{text}: {got:?}"),
            }
        }
    }

    #[test]
    fn buckets_of_named_values_are_graygate_bucket() {
        both_modes(buckets_of_named_values_are_graygate_bucket_in);
    }

    fn buckets_of_named_values_are_graygate_bucket_in() {
        // Two lists and four named headers: every header's bucket field in
        // the flags, each checked against the Rust function; an unnamed
        // string's bucket comes from the host.
        let text = "return function(req)\n  local l = tostring(req:in_list('office')) .. tostring(req:in_list('vpn'))\n  local a, b, c, d = req:header('X-A'), req:header('X-B'), req:header('X-C'), req:header('X-D')\n  return l .. ' ' .. graygate.bucket(a) .. ' ' .. graygate.bucket(b) .. ' ' .. graygate.bucket(c) .. ' ' .. graygate.bucket(d) .. ' ' .. graygate.bucket(a .. '!')\nend\n";
        for i in 0..40 {
            let v: Vec<String> = (0..4).map(|j| format!("user-{i}-{j}")).collect();
            let hs: Vec<(&str, &str)> = ["X-A", "X-B", "X-C", "X-D"]
                .into_iter()
                .zip(v.iter().map(String::as_str))
                .collect();
            let want = format!(
                "truefalse {} {} {} {} {}",
                crate::lane::bucket(v[0].as_bytes()),
                crate::lane::bucket(v[1].as_bytes()),
                crate::lane::bucket(v[2].as_bytes()),
                crate::lane::bucket(v[3].as_bytes()),
                crate::lane::bucket(format!("{}!", v[0]).as_bytes()),
            );
            assert_eq!(run(text, "127.0.0.1", &hs).unwrap(), Some(want));
        }
        // An absent value is nil, and bucket(nil) fails as it did.
        let e = run(text, "127.0.0.1", &[]).unwrap_err();
        assert!(e.contains("t.lua:"), "{e}");
    }

    #[test]
    fn a_header_set_in_the_call_is_read_back_and_nothing_outlives_a_request() {
        both_modes(a_header_set_in_the_call_is_read_back_in);
    }

    fn a_header_set_in_the_call_is_read_back_in() {
        // `ngx` by a computed name keeps the native entry: after
        // set_header / clear_header the named header is read from the
        // request as it now is.
        let text = "return function(req)\n  local n = _G['ng' .. 'x']\n  local a = tostring(req:header('X-Gray'))\n  n.req.set_header('X-Gray', '2')\n  local b = tostring(req:header('X-Gray'))\n  n.req.clear_header('X-Gray')\n  return a .. b .. tostring(req:header('X-Gray'))\nend\n";
        assert_eq!(
            run(text, "127.0.0.1", &[("x-gray", "1")])
                .unwrap()
                .as_deref(),
            Some("12nil")
        );
        // The next request (same VM) sees its own values.
        let text = "return function(req)\n  return tostring(req:header('X-Gray')) .. tostring(req:in_list('office'))\nend\n";
        let (_d, src) = load_src(text);
        let lists = lists();
        for (ip, h, want) in [
            ("127.0.0.1", Some("1"), "1true"),
            ("10.0.0.1", None, "nilfalse"),
            ("127.0.0.9", Some("x"), "xtrue"),
            ("10.0.0.1", None, "nilfalse"),
        ] {
            let headers: Vec<(&str, &str)> = h.map(|v| ("X-Gray", v)).into_iter().collect();
            let r = request(ip, &headers);
            let got = call_lane(&src, &lists, r, RuleCtx::default()).1.unwrap();
            assert_eq!(got.as_deref(), Some(want));
        }
    }

    #[test]
    fn the_lane_functions_result_is_checked() {
        both_modes(the_lane_functions_result_is_checked_in);
    }

    /// Both entries: the native one, and the `ngx` glue's (a script that
    /// mentions `ngx.`), which has `req` as its upvalue.
    fn the_lane_functions_result_is_checked_in() {
        for read in ["", "local _ = ngx.var.uri "] {
            the_lane_functions_result_is_checked_by(read);
        }
    }

    fn the_lane_functions_result_is_checked_by(read: &str) {
        for (ret, want) in [
            ("'gray'", Ok(Some("gray".to_string()))),
            ("req.ip", Ok(Some("127.0.0.1".to_string()))),
            ("nil", Ok(None)),
            ("", Ok(None)),
            (
                "5",
                Err("lane() returned a number (expected a string or nil)"),
            ),
            (
                "{}",
                Err("lane() returned a table (expected a string or nil)"),
            ),
            (
                "false",
                Err("lane() returned a boolean (expected a string or nil)"),
            ),
            ("'\\255'", Err("lane() returned a string that is not UTF-8")),
        ] {
            let got = run(
                &format!("return function(req) {read}return {ret} end\n"),
                "127.0.0.1",
                &[],
            );
            match want {
                Ok(w) => assert_eq!(got, Ok(w), "{read}{ret}"),
                Err(w) => assert!(
                    got.as_ref().unwrap_err().contains(w),
                    "{read}{ret}: {got:?}"
                ),
            }
        }
    }
}
