//! Layer: lane. `ngx.crc32_short`, `ngx.crc32_long`, `ngx.md5` and
//! `ngx.md5_bin`: CRC-32 (IEEE, reflected, as zlib's and nginx's
//! `ngx_crc32_*`) and MD5 of a string, as lua-nginx-module returns them.

use md5::{Digest, Md5};
use mlua::{Function, Lua, LuaString, Table};

/// Longest string [`crc32_source`] hashes in Lua: each byte is a compiled
/// step there, so past this length the host call's fixed cost (then
/// crc32fast's fraction of a step per byte) is the cheaper one.
const CRC32_LUA_MAX: usize = 32;

/// Adds the digest functions to `ngx`; `jit`: LuaJIT's compiler is on
/// (`bit` is read from `g`).
pub(super) fn install(lua: &Lua, ngx: &Table, g: &Table, jit: bool) -> mlua::Result<()> {
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
    Ok(())
}

/// `ngx.crc32_short` / `crc32_long` with LuaJIT's compiler on
/// (`crc32.lua`): the CRC of a string of at most [`CRC32_LUA_MAX`] bytes
/// computed in Lua by table, so the JIT compiles it into the script's
/// trace instead of ending the trace at a host call (mlua's trampoline,
/// the argument copied, the trace stitched). The steps are written out,
/// one per byte: a loop of a few iterations per call would run its first
/// iteration in the interpreter every time, since a loop trace is entered
/// from its loop-back only. Longer strings and anything not a string (a
/// number is hashed as its text, anything else raises the host's error)
/// go to the host function. On the interpreter every byte costs a dozen
/// bytecodes and four fast-function calls, so the host function serves
/// there.
fn crc32_source() -> String {
    let mut steps = String::new();
    for i in 1..=CRC32_LUA_MAX {
        steps.push_str(&format!(
            "  b = byte(s, {i}) if not b then goto done end c = bxor(rshift(c, 8), T[band(bxor(c, b), 255)])\n"
        ));
    }
    include_str!("crc32.lua")
        .replace("$MAX", &CRC32_LUA_MAX.to_string())
        .replace("--$STEPS\n", &steps)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{eval, std_req};
    use crate::lane::script::testing::both_modes;

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
    fn ngx_hashes() {
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
    }
}
