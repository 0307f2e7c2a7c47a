//! Layer: lane. `ngx.shared.<dict>`: the Lua face of the process-wide
//! dictionaries (`lane::shared_dict`), with OpenResty's methods and return
//! values (`ok, err, forcible`; `nil, err` for a bad key).

use std::collections::BTreeMap;
use std::sync::Arc;

use mlua::{Lua, MultiValue, Table, UserData, UserDataMethods, Value};

use crate::lane::shared_dict::{DictError, DictValue, SharedDict, MAX_KEY_LEN};

/// `ngx.shared`: one entry per dictionary the config declares.
pub(super) fn table(lua: &Lua, dicts: &BTreeMap<String, Arc<SharedDict>>) -> mlua::Result<Table> {
    let shared = lua.create_table()?;
    for (name, d) in dicts {
        shared.raw_set(name.as_str(), DictUd(d.clone()))?;
    }
    Ok(shared)
}

/// A dictionary as Lua userdata.
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
mod tests {
    use super::super::testing::{run_with, std_req};
    use super::*;

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
