//! Layer: lane. Request values handed into the VM under its memory limit:
//! a bounded value is allocated with the limit lifted for that one
//! allocation ([`request_string`]) or pushed straight onto the stack with
//! the limit set back by the last value ([`Restore`]), so mlua skips its
//! protected path and no script code runs without the limit.

use mlua::{Lua, MultiValue, Value};

/// Longest request value [`request_string`] creates outside the VM's
/// memory limit; a longer one takes mlua's protected path.
pub(crate) const UNLIMITED_STRING_MAX: usize = 64 << 10;

/// A Lua string holding a value read from the request being decided (a
/// header, cookie, argument or variable).
///
/// With a memory limit set, mlua creates every string inside a protected
/// call (a `lua_pcall` plus its protected C functions, several times the
/// cost of the string itself), so an
/// allocation failure cannot unwind through Rust frames. A request value
/// is bounded by the request size limits (and here by
/// `UNLIMITED_STRING_MAX`), so the limit is lifted for this one
/// allocation — mlua then pushes the string directly, as it does in a VM
/// with no limit — and set again at once. Memory bombs stay stopped: the
/// VM's usage is still counted, so any allocation of the script's own
/// beyond the limit fails all the same; a host string can overshoot it by at
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
/// reference slot, two moves between Lua threads and its release). As with [`request_string`], only
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lane::script::testing::{both_modes, call, limited_src, load_src};
    use crate::lane::script::Limit;

    #[test]
    fn request_strings_leave_the_memory_limit_in_force() {
        both_modes(request_strings_leave_the_memory_limit_in_force_in);
    }

    fn request_strings_leave_the_memory_limit_in_force_in() {
        // Each iteration reads request values (created with the limit lifted
        // for the allocation, see `request_string`) and keeps 1 MiB made
        // from them: the limit still stops the call, long before the
        // instruction budget would (about 130 iterations, 130 MiB, without it).
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
}
