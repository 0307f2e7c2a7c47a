//! Layer: lane. `ngx.log(level, ...)`, OpenResty's `print` and the
//! `ngx.ERR`-style level constants: a script's messages go to the
//! gateway's log (target `graygate::script`, with the script's
//! `file:line`), never to the process's stdout.

use mlua::{Function, Lua, MultiValue, Value};

/// nginx log levels, as OpenResty numbers them.
pub(super) const LEVELS: [(&str, i64); 9] = [
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

/// OpenResty's `print`: `ngx.log` at NOTICE.
pub(super) fn print(lua: &Lua) -> mlua::Result<Function> {
    lua.create_function(|lua, mut args: MultiValue| {
        args.push_front(Value::Integer(6));
        log(lua, args)
    })
}

/// `ngx.log(level, ...)`: the arguments joined as lua-nginx-module joins
/// them, logged at the level's severity.
pub(super) fn log(lua: &Lua, args: MultiValue) -> mlua::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::super::testing::{eval, run_with, std_req};
    use std::collections::BTreeMap;

    #[test]
    fn ngx_log_levels_and_messages() {
        let q = |e: &str| eval(&format!("return tostring({e})"), std_req());
        assert_eq!(q("ngx.ERR .. ngx.WARN .. ngx.INFO .. ngx.DEBUG"), "4578");
        assert_eq!(
            q("ngx.log(ngx.INFO, 'hello ', 1, nil, true) == nil"),
            "true"
        );
        assert!(run_with("ngx.log(ngx.ERR, {})", std_req(), BTreeMap::new())
            .1
            .is_err());
    }
}
