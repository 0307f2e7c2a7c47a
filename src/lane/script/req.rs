//! Layer: lane. The `req` object scripts see: methods (`header`, `cookie`,
//! `arg`, `in_list`) and fields (`ip`, `path`, `rule_lane`, …) that read the
//! request being decided through this thread's slot; read-only.

use std::collections::BTreeMap;
use std::sync::Arc;

use mlua::{Lua, Table, Value};

use crate::base::lists::IpList;
use crate::lane::lent::{request_string, with_current, with_req};

fn opt_str(lua: &Lua, s: Option<&[u8]>) -> mlua::Result<Value> {
    match s {
        Some(b) => Ok(Value::String(request_string(lua, b)?)),
        None => Ok(Value::Nil),
    }
}

/// Builds the `req` object scripts see: a table whose methods (`header`,
/// `cookie`, `arg`, `in_list`) are plain functions and whose fields (`ip`,
/// `path`, …) come from an `__index` function; both read the request being
/// decided (`with_req`), so nothing is copied per request. Writes are
/// refused, so a script cannot leave state on it.
///
/// Each callback takes `self` as a `bool` (Lua truthiness, read in place)
/// and its argument as an owned string: cheaper than the registry
/// references a `Value`/`LuaString` argument costs. `header` takes bytes
/// (`BString`): a header name needs no UTF-8 check.
pub(super) fn req_object(lua: &Lua, lists: Arc<BTreeMap<String, IpList>>) -> mlua::Result<Table> {
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

#[cfg(test)]
mod tests {
    use super::super::testing::{both_modes, call, load_src, req_with, write};
    use super::super::{call_lane, RuleCtx, ScriptSource};
    use super::*;
    use std::path::Path;

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
