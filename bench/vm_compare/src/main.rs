//! The pure-Lua part of bench/openresty_heavy.lua (a plain table stands in
//! for `ngx`; `bit` is LuaJIT's own, or written on the VM's operators), per
//! VM that mlua can embed, with and without an instruction limiter; and
//! whether that limiter stops `while true do end`.
//!
//! ```sh
//! cd bench/vm_compare
//! cargo run --release --features lua54 -- ../openresty_heavy.lua          # plain
//! cargo run --release --features lua54 -- ../openresty_heavy.lua hook     # count hook every 1,000
//! cargo run --release --features lua54 -- ../openresty_heavy.lua hookbig  # count hook, never firing
//! cargo run --release --features luajit -- ../openresty_heavy.lua nojit   # LuaJIT interpreter
//! cargo run --release --features luajit -- ../openresty_heavy.lua nojithook  # …with the count hook
//! cargo run --release --features luau -- ../openresty_heavy.lua hook      # Luau interrupt
//! cargo run --release --features luajit -- ../openresty_heavy.lua runaway # stopped? (LuaJIT: no)
//! cargo run --features luajit -- ../openresty_heavy.lua --quick  # a fraction of the calls (CI)
//! ```
//! Not part of graygate's build (its own workspace; one VM per build).
use std::time::Instant;

use mlua::{Lua, Value};

const STUB: &str = r#"
local bitlib = ...
bit = bitlib
local HDR = { ["host"] = "127.0.0.1:8080", ["x-user-id"] = "12345" }
local ARGS = {}
local VARS = { remote_addr = "127.0.0.1" }
ngx = { var = VARS, req = { get_headers = function() return HDR end, get_uri_args = function() return ARGS end },
        crc32_short = function(s) return #s * 2654435761 % 4294967296 end }
"#;

fn main() {
    // --quick (anywhere): a hundredth of the calls, for CI.
    let quick = std::env::args().any(|a| a == "--quick");
    let args: Vec<String> = std::env::args().filter(|a| a != "--quick").collect();
    let lua = Lua::new();
    let heavy = std::fs::read_to_string(args.get(1).expect("path to openresty_heavy.lua")).unwrap();
    #[cfg(feature = "lua54")]
    let bitlib: Value = lua.load(BIT54).call(()).unwrap();
    #[cfg(feature = "luajit")]
    let bitlib: Value = lua.globals().get("bit").unwrap();
    #[cfg(feature = "luau")]
    let bitlib: Value = lua.load(BITLUAU).call(()).unwrap();
    lua.load(STUB).call::<()>(bitlib).unwrap();
    let heavy = heavy.replace("local bit = require(\"bit\")", "local bit = bit");
    let mode = args.get(2).cloned().unwrap_or_default();
    // "jitcheck": LuaJIT with its compiler on and no hook; instead a budget
    // check is written into the source at every loop body and function
    // entry (what a load-time rewriter would insert), which compiled traces
    // run like any other code.
    let heavy = if mode.starts_with("jitcheck") {
        with_checks(&heavy)
    } else {
        heavy
    };
    let m: mlua::Table = lua.load(&heavy).call(()).unwrap();
    let lane: mlua::Function = m.get("lane").unwrap();
    if mode == "jitcheck-runaway" {
        let t = Instant::now();
        let r = lua
            .load(with_checks(
                "__GG_B[1] = 300000 local x = 0 while true do x = x + 1 end",
            ))
            .exec();
        println!(
            "{} jitcheck runaway: {:?} after {:?}",
            VM,
            r.err().map(|e| e.to_string()),
            t.elapsed()
        );
        return;
    }
    if mode == "runaway" {
        // Is `while true do end` stopped by the VM's instruction limiter?
        let count = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let c = count.clone();
        #[cfg(not(feature = "luau"))]
        lua.set_global_hook(
            mlua::HookTriggers::new().every_nth_instruction(1000),
            move |_, _| {
                c.set(c.get() + 1);
                if c.get() > 300 {
                    Err(mlua::Error::runtime("budget"))
                } else {
                    Ok(mlua::VmState::Continue)
                }
            },
        )
        .unwrap();
        #[cfg(feature = "luau")]
        lua.set_interrupt(move |_| {
            c.set(c.get() + 1);
            if c.get() > 300_000 {
                Err(mlua::Error::runtime("budget"))
            } else {
                Ok(mlua::VmState::Continue)
            }
        });
        let t = Instant::now();
        let r = lua.load("local x = 0 while true do x = x + 1 end").exec();
        println!(
            "{} runaway: {:?} after {:?} ({} hook calls)",
            VM,
            r.err().map(|e| e.to_string()),
            t.elapsed(),
            count.get()
        );
        return;
    }
    match mode.as_str() {
        #[cfg(not(feature = "luau"))]
        "hook" => lua
            .set_global_hook(
                mlua::HookTriggers::new().every_nth_instruction(1000),
                |_, _| Ok(mlua::VmState::Continue),
            )
            .unwrap(),
        #[cfg(not(feature = "luau"))]
        "hookbig" => lua
            .set_global_hook(
                mlua::HookTriggers::new().every_nth_instruction(1_000_000),
                |_, _| Ok(mlua::VmState::Continue),
            )
            .unwrap(),
        #[cfg(not(feature = "luau"))]
        "callhook" => lua
            .set_global_hook(mlua::HookTriggers::new().on_calls(), |_, _| {
                Ok(mlua::VmState::Continue)
            })
            .unwrap(),
        #[cfg(feature = "luau")]
        "hook" => lua.set_interrupt(|_| Ok(mlua::VmState::Continue)),
        #[cfg(feature = "luajit")]
        "nojit" => {
            lua.load("jit.off()").exec().unwrap();
        }
        #[cfg(feature = "luajit")]
        "nojithook" => {
            lua.load("jit.off()").exec().unwrap();
            lua.set_global_hook(
                mlua::HookTriggers::new().every_nth_instruction(1000),
                |_, _| Ok(mlua::VmState::Continue),
            )
            .unwrap();
        }
        _ => {}
    }
    // Calls lane() N times from inside Lua (so the Rust->Lua call is not measured).
    let driver: mlua::Function = lua
        .load("local lane = ... return function(n) local x for i = 1, n do x = lane() end return x end")
        .call(lane)
        .unwrap();
    let scale = if quick { 100 } else { 1 };
    let _ = driver.call::<Value>(200_000 / scale).unwrap();
    let n = 3_000_000 / scale;
    let t = Instant::now();
    let c0 = cpu();
    let _ = driver.call::<Value>(n).unwrap();
    let cpu_ns = (cpu() - c0) * 1e9 / n as f64;
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "{} {}: {:.0} ns CPU ({:.0} ns wall) per decision",
        VM,
        if mode.is_empty() { "plain" } else { &mode },
        cpu_ns,
        ns
    );
}

#[cfg(feature = "lua54")]
const VM: &str = "lua54";
#[cfg(feature = "luajit")]
const VM: &str = "luajit";
#[cfg(feature = "luau")]
const VM: &str = "luau";

#[cfg(feature = "lua54")]
const BIT54: &str = r#"
local mtype, toint = math.type, math.tointeger
local function tobit(x)
  if mtype(x) ~= "integer" then x = toint(x) end
  x = x & 0xffffffff
  if x >= 0x80000000 then return x - 0x100000000 end
  return x
end
local function s32(x) x = x & 0xffffffff if x >= 0x80000000 then return x - 0x100000000 end return x end
return {
  bor = function(a, b, c, d)
    local r = tobit(a) | tobit(b)
    if c then r = r | tobit(c) end
    if d then r = r | tobit(d) end
    return s32(r)
  end,
  lshift = function(x, n) return s32(tobit(x) << (tobit(n) & 31)) end,
}
"#;

#[cfg(feature = "luau")]
const BITLUAU: &str = r#"
return {
  bor = function(a, b, c, d) local r = bit32.bor(a, b, c or 0, d or 0) if r >= 0x80000000 then r = r - 0x100000000 end return r end,
  lshift = function(x, n) local r = bit32.lshift(x, n) if r >= 0x80000000 then r = r - 0x100000000 end return r end,
}
"#;

/// The budget check after every `do`, `repeat`, `then`-less loop head and
/// function header of `src` (a line-based stand-in for a real rewriter;
/// enough for openresty_heavy.lua and the runaway loop).
fn with_checks(src: &str) -> String {
    const CHECK: &str =
        " local __b = __GG_B __b[1] = __b[1] - 1 if __b[1] < 0 then error('budget') end ";
    let mut out = String::from("__GG_B = __GG_B or {1e15}\n");
    for line in src.lines() {
        let mut l = line.to_string();
        let t = l.trim_end();
        let is_fn = t.contains("function") && t.ends_with(')') && !t.trim_start().starts_with("--");
        if t.ends_with(" do") || t.ends_with("repeat") || is_fn {
            l.push_str(CHECK);
        } else if let Some(i) = l.find(" do ") {
            l.insert_str(i + 4, CHECK);
        }
        out.push_str(&l);
        out.push('\n');
    }
    out
}

/// This process's user+system CPU seconds (clock ticks of 10 ms).
fn cpu() -> f64 {
    let st = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = st.rsplit_once(')').unwrap().1.split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}
