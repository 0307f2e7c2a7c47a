//! Layer: lane. Budget checks written into a script's source at load time,
//! so a runaway script is stopped even where LuaJIT's compiler has turned
//! its loop into machine code (compiled traces never call a count hook).
//!
//! The rewrite is token-level and keeps every line where it was (error and
//! log positions do not move): a check — a counter decremented and tested,
//! plain Lua that the JIT compiles like the rest — goes right after each
//! `do` (the bodies of `while` and `for`, and plain blocks), each `repeat`,
//! each function's parameter list, and each `::label::` (a backward `goto`
//! loops through its label). Every loop iteration and every call (so every
//! recursion, tail calls included) passes one. The counter is an upvalue of
//! the chunk — a local of a prologue that wraps the chunk in a function —
//! which no script can name: identifiers starting with `__gg` are refused.
//!
//! Not covered, as with the hook: time spent inside one C function
//! (`string.rep`, a pattern match); the memory limit bounds those.

use std::fmt;

/// The budget table's name inside rewritten chunks.
const B: &str = "__gg_b";
/// Identifiers scripts may not use (the rewrite's own).
const RESERVED: &str = "__gg";

/// Why a source was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewriteError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for RewriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// The check inserted at each point: one decrement, one test. `[1]` counts
/// down a chunk of checks; below zero `tick` is called, which takes the
/// next chunk from the host's budget and returns the new count, or raises
/// once the budget is spent (and at every later check, since the count
/// stays negative, so a script that catches the error cannot loop on).
fn check() -> String {
    format!(" {B}[1] = {B}[1] - 1 if {B}[1] < 0 then {B}[1] = {B}.tick() end ")
}

/// `src` with budget checks. The result expects the budget table as its
/// first chunk argument (`{ [1] = count, tick = function }`); the script
/// sees the remaining arguments as its `...`.
pub fn rewrite(src: &str) -> Result<String, RewriteError> {
    rewrite_with(src, false)
}

/// Whether every script text may have its `graygate.bucket(…)` calls
/// read `bucket` from the budget table instead ([`rewrite_with`]): true
/// when each global `graygate` in them is written `graygate.bucket(` (and
/// not after `function`), and no text names `_G` — so no chunk can
/// shadow, assign or define `graygate` (the library table itself is
/// read-only, and a global can only be written by its name or through
/// `_G`), and `graygate.bucket` is the same function at every use. False
/// when no text uses it, or one cannot be read.
pub fn direct_bucket<'a>(mut texts: impl Iterator<Item = &'a str>) -> bool {
    let mut used = false;
    let ok = texts.all(|text| {
        let mut lx = Lexer::new(text);
        let mut toks: Vec<Kind<'_>> = Vec::new();
        loop {
            match lx.next_token() {
                Ok(Some(t)) => toks.push(t.kind),
                Ok(None) => break,
                Err(_) => return false,
            }
        }
        toks.iter().enumerate().all(|(i, k)| {
            let prev = i.checked_sub(1).map(|p| toks[p]);
            // A field (`x.graygate`, `x:graygate`) is not the global.
            if matches!(prev, Some(Kind::Punct("." | ":"))) {
                return true;
            }
            match k {
                Kind::Name("_G") => false,
                Kind::Name("graygate") => {
                    used = true;
                    prev != Some(Kind::Name("function"))
                        && toks.get(i + 1..i + 4)
                            == Some(&[Kind::Punct("."), Kind::Name("bucket"), Kind::Punct("(")])
                }
                _ => true,
            }
        })
    });
    ok && used
}

/// [`rewrite`]; with `direct_bucket` (see [`direct_bucket`]) each global
/// `graygate` of a `graygate.bucket(` call is the budget table, whose
/// `bucket` is `graygate.bucket`: one table read, where the global and
/// the library's read-only proxy are two metatable lookups each.
pub fn rewrite_with(src: &str, direct_bucket: bool) -> Result<String, RewriteError> {
    let check = check();
    let mut out = String::with_capacity(src.len() + src.len() / 4 + 64);
    // A `#!` first line stays first (the loader skips it only there).
    let header = if src.starts_with('#') {
        src.find('\n').map_or(src.len(), |i| i + 1)
    } else {
        0
    };
    out.push_str(&src[..header]);
    // Same line as the script's first: positions stay put.
    out.push_str(&format!("local {B} = ... return (function(...) "));
    let mut lx = Lexer::new(src);
    // After `function`: waiting for its parameter list's `(`, then `)`.
    let mut function_head = 0u8;
    let mut copied = header;
    let mut prev = Kind::Punct(";");
    while let Some(tok) = lx.next_token()? {
        let field = matches!(prev, Kind::Punct("." | ":"));
        prev = tok.kind;
        if direct_bucket && !field && tok.kind == Kind::Name("graygate") {
            // `direct_bucket` holds: this is `graygate.bucket(`.
            out.push_str(&src[copied..tok.end - "graygate".len()]);
            out.push_str(B);
            copied = tok.end;
            continue;
        }
        let insert = match tok.kind {
            Kind::Name(name) => {
                if name.starts_with(RESERVED) {
                    return Err(RewriteError {
                        line: tok.line,
                        message: format!("`{name}`: names starting with `{RESERVED}` are reserved"),
                    });
                }
                match name {
                    "do" | "repeat" => true,
                    "function" => {
                        function_head = 1;
                        false
                    }
                    _ => false,
                }
            }
            Kind::Punct("(") if function_head == 1 => {
                function_head = 2;
                false
            }
            Kind::Punct(")") if function_head == 2 => {
                function_head = 0;
                true
            }
            Kind::Label => true,
            _ => false,
        };
        if insert {
            out.push_str(&src[copied..tok.end]);
            out.push_str(&check);
            copied = tok.end;
        }
    }
    out.push_str(&src[copied..]);
    // On a line of its own: a last line that is a comment stays one.
    out.push_str("\nend)(select(2, ...))");
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind<'a> {
    /// A name or keyword.
    Name(&'a str),
    /// `::name::`.
    Label,
    Punct(&'a str),
    /// A string or number literal.
    Literal,
}

#[derive(Debug, Clone, Copy)]
struct Token<'a> {
    kind: Kind<'a>,
    /// Byte offset just past the token.
    end: usize,
    line: usize,
}

/// Lua 5.1 / LuaJIT tokens: names, literals (short and long strings,
/// numbers with LuaJIT's suffixes), punctuation; comments skipped.
struct Lexer<'a> {
    src: &'a str,
    b: &'a [u8],
    i: usize,
    line: usize,
}

impl<'a> Lexer<'a> {
    fn new(src: &'a str) -> Lexer<'a> {
        let mut lx = Lexer {
            src,
            b: src.as_bytes(),
            i: 0,
            line: 1,
        };
        // A first line starting with `#` is skipped by Lua's loader.
        if lx.b.first() == Some(&b'#') {
            while lx.i < lx.b.len() && lx.b[lx.i] != b'\n' {
                lx.i += 1;
            }
        }
        lx
    }

    fn err(&self, message: &str) -> RewriteError {
        RewriteError {
            line: self.line,
            message: message.to_string(),
        }
    }

    fn peek(&self, k: usize) -> u8 {
        self.b.get(self.i + k).copied().unwrap_or(0)
    }

    fn next_token(&mut self) -> Result<Option<Token<'a>>, RewriteError> {
        loop {
            let c = self.peek(0);
            match c {
                0 if self.i >= self.b.len() => return Ok(None),
                b'\n' => {
                    self.line += 1;
                    self.i += 1;
                }
                b' ' | b'\t' | b'\r' | 0x0b | 0x0c => self.i += 1,
                b'-' if self.peek(1) == b'-' => {
                    self.i += 2;
                    if self.peek(0) == b'[' {
                        if let Some(level) = self.long_bracket_level() {
                            self.long_bracket(level, "an unfinished long comment")?;
                            continue;
                        }
                    }
                    while self.i < self.b.len() && self.b[self.i] != b'\n' {
                        self.i += 1;
                    }
                }
                _ => break,
            }
        }
        let line = self.line;
        let start = self.i;
        let c = self.peek(0);
        let kind = if c.is_ascii_alphabetic() || c == b'_' {
            while self.peek(0).is_ascii_alphanumeric() || self.peek(0) == b'_' {
                self.i += 1;
            }
            Kind::Name(&self.src[start..self.i])
        } else if c.is_ascii_digit() || (c == b'.' && self.peek(1).is_ascii_digit()) {
            self.number();
            Kind::Literal
        } else if c == b'"' || c == b'\'' {
            self.short_string(c)?;
            Kind::Literal
        } else if c == b'[' && self.long_bracket_level().is_some() {
            let level = self.long_bracket_level().unwrap_or(0);
            self.long_bracket(level, "an unfinished long string")?;
            Kind::Literal
        } else if c == b':' && self.peek(1) == b':' {
            // `::name::`, with spaces allowed around the name.
            self.i += 2;
            self.skip_spaces();
            while self.peek(0).is_ascii_alphanumeric() || self.peek(0) == b'_' {
                self.i += 1;
            }
            self.skip_spaces();
            if self.peek(0) != b':' || self.peek(1) != b':' {
                return Err(self.err("a label without its closing `::`"));
            }
            self.i += 2;
            Kind::Label
        } else {
            let three = self.src.get(start..start + 3);
            let two = self.src.get(start..start + 2);
            let len = if three == Some("...") {
                3
            } else if matches!(two, Some("==" | "~=" | "<=" | ">=" | "..")) {
                2
            } else {
                1
            };
            // Multi-byte UTF-8 outside strings is a syntax error Lua reports.
            let len = if c.is_ascii() {
                len
            } else {
                self.src[start..].chars().next().map_or(1, char::len_utf8)
            };
            self.i += len;
            Kind::Punct(&self.src[start..self.i])
        };
        Ok(Some(Token {
            kind,
            end: self.i,
            line,
        }))
    }

    fn skip_spaces(&mut self) {
        while matches!(self.peek(0), b' ' | b'\t' | b'\r' | b'\n') {
            if self.peek(0) == b'\n' {
                self.line += 1;
            }
            self.i += 1;
        }
    }

    /// At `[`: the level of a long bracket `[==[` starting here, if any.
    fn long_bracket_level(&self) -> Option<usize> {
        let mut k = 1;
        while self.peek(k) == b'=' {
            k += 1;
        }
        (self.peek(k) == b'[').then_some(k - 1)
    }

    /// Skips `[==[ … ]==]` of `level`.
    fn long_bracket(&mut self, level: usize, unfinished: &str) -> Result<(), RewriteError> {
        self.i += level + 2;
        loop {
            match self.peek(0) {
                0 if self.i >= self.b.len() => return Err(self.err(unfinished)),
                b'\n' => self.line += 1,
                b']' => {
                    let mut k = 1;
                    while self.peek(k) == b'=' {
                        k += 1;
                    }
                    if k - 1 == level && self.peek(k) == b']' {
                        self.i += k + 1;
                        return Ok(());
                    }
                }
                _ => {}
            }
            self.i += 1;
        }
    }

    fn short_string(&mut self, quote: u8) -> Result<(), RewriteError> {
        self.i += 1;
        loop {
            match self.peek(0) {
                0 if self.i >= self.b.len() => return Err(self.err("an unfinished string")),
                b'\n' => return Err(self.err("an unfinished string")),
                b'\\' => {
                    // The escaped byte (a newline continues the string).
                    if self.peek(1) == b'\n' {
                        self.line += 1;
                    }
                    self.i += 2;
                    continue;
                }
                c if c == quote => {
                    self.i += 1;
                    return Ok(());
                }
                _ => {}
            }
            self.i += 1;
        }
    }

    /// A number: digits, `.`, hex, exponents with signs, and LuaJIT's
    /// `LL`/`ULL`/`i` suffixes.
    fn number(&mut self) {
        let hex = self.peek(0) == b'0' && matches!(self.peek(1), b'x' | b'X');
        if hex {
            self.i += 2;
        }
        loop {
            let c = self.peek(0);
            let exp = if hex {
                matches!(c, b'p' | b'P')
            } else {
                matches!(c, b'e' | b'E')
            };
            if exp && matches!(self.peek(1), b'+' | b'-') {
                self.i += 2;
            } else if c.is_ascii_alphanumeric() || c == b'.' {
                self.i += 1;
            } else {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlua::{Function, Lua, Table, Value};

    /// A LuaJIT VM with its compiler ON and no hook, and a budget table
    /// whose `tick` raises "budget".
    fn vm() -> (Lua, Table) {
        let lua = Lua::new();
        let on: bool = lua
            .load("jit.on() return jit.status()")
            .eval()
            .expect("jit");
        assert!(on, "LuaJIT's compiler is on");
        let b = lua.create_table().unwrap();
        b.raw_set(1, 1_000_000_000i64).unwrap();
        b.raw_set(
            "tick",
            lua.create_function(|_, ()| -> mlua::Result<i64> {
                Err(mlua::Error::runtime("budget"))
            })
            .unwrap(),
        )
        .unwrap();
        (lua, b)
    }

    fn load(lua: &Lua, b: &Table, src: &str) -> mlua::Result<Value> {
        let code = rewrite(src).unwrap_or_else(|e| panic!("{e}: {src}"));
        let f: Function = lua.load(code).set_name("=t.lua").into_function()?;
        f.call((b.clone(), "modname"))
    }

    /// Runs `src` with a budget of 300,000 checks on a thread of its own:
    /// a loop the rewrite missed runs forever in compiled code, so the
    /// answer is awaited with a deadline (a miss fails, it does not hang).
    fn stopped(src: &'static str) {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (lua, b) = vm();
            b.raw_set(1, 300_000i64).unwrap();
            let _ = tx.send(load(&lua, &b, src).map(|_| ()).map_err(|e| e.to_string()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("not stopped within 20 s: {src}"));
        let e = r.expect_err(src);
        // Deep non-tail recursion may hit Lua's stack limit first: stopped too.
        assert!(
            e.contains("budget") || e.contains("stack overflow"),
            "{src}: {e}"
        );
    }

    #[test]
    fn runaway_loops_of_every_shape_are_stopped_with_the_jit_on() {
        for src in [
            "while true do end",
            "local x = 0 while true do x = x + 1 end",
            "repeat local y = 1 until false",
            "for i = 1, math.huge do end",
            "for i = 1, 1e300, 0.5 do local z = i * 2 end",
            "local function it() return 1 end for k in it do end",
            "for k, v in pairs(setmetatable({}, {__index = function() return 1 end})) do end while 1 do end",
            "local function f(n) return f(n + 1) end return f(1)",
            "local function f() f() end f()",
            "local function f() return 1 + f() end return f()",
            "local t = setmetatable({}, {__index = function(t, k) return t[k + 1] end}) return t[1]",
            "::top:: goto top",
            "do ::a:: local q = 1 goto a end",
            "local co = coroutine.wrap(function() while true do end end) co()",
            // Catching the budget's error does not buy more loops.
            "while true do pcall(function() while true do end end) end",
            "for i = 1, 10 do pcall(error) end while true do pcall(error, 'x') end",
            "local s = ('x'):rep(10) while true do s:gsub('x', function(c) return c end) end",
            "table.sort({3, 2, 1}, function(a, b) while true do end end)",
        ] {
            stopped(src);
        }
    }

    /// The line-based results of real scripts do not change, nor do their
    /// positions: an error raised on line 3 still says line 3.
    #[test]
    fn scripts_behave_as_before_and_keep_their_line_numbers() {
        let (lua, b) = vm();
        let src = "local M = {}\nfunction M.lane(n)\n  if n == 3 then error('three') end\n  local s = 0\n  for i = 1, n do s = s + i end\n  return s\nend\nreturn M -- last line a comment";
        let m: Table = load(&lua, &b, src).unwrap().as_table().unwrap().clone();
        let lane: Function = m.get("lane").unwrap();
        assert_eq!(lane.call::<i64>(10).unwrap(), 55);
        let e = lane.call::<i64>(3).unwrap_err().to_string();
        assert!(e.contains("t.lua:3:"), "{e}");
        // The chunk's own `...` is what the loader passed after the budget.
        let v: String = lua
            .unpack(load(&lua, &b, "local name = ... return name").unwrap())
            .unwrap();
        assert_eq!(v, "modname");
        // A `#!` first line stays first; the next line keeps its number.
        let e = load(&lua, &b, "#!/usr/bin/env lua\nerror('two')")
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.lua:2:"), "{e}");
        // Strings, long strings and comments holding keywords are copied,
        // not instrumented.
        let src = "local a = 'do repeat' local b = [[ function() do ]] --[==[ while true do end ]==]\n-- do\nreturn a .. b";
        let v: String = lua.unpack(load(&lua, &b, src).unwrap()).unwrap();
        assert_eq!(v, "do repeat function() do ");
        assert_eq!(
            rewrite("x = \"do\" -- do")
                .unwrap()
                .matches(".tick()")
                .count(),
            0
        );
    }

    #[test]
    fn the_bench_scripts_run_alike_rewritten() {
        for file in ["bench/openresty_simple.lua", "bench/openresty_heavy.lua"] {
            let src = std::fs::read_to_string(file).unwrap();
            let code = rewrite(&src).unwrap();
            assert!(code.matches(".tick()").count() >= 2, "{file}");
            // One line more, at the end: every line of the script stays put.
            assert_eq!(
                code.matches('\n').count(),
                src.matches('\n').count() + 1,
                "{file}"
            );
        }
    }

    #[test]
    fn graygate_bucket_is_read_from_the_budget_table_only_where_nothing_can_shadow_it() {
        let yes = |texts: &[&str]| direct_bucket(texts.iter().copied());
        assert!(yes(&[
            "return function(req) return graygate.bucket(req.ip) < 10 end"
        ]));
        assert!(yes(&[
            "local u = graygate . bucket ( 'a' ) x.graygate = 1 t:graygate()",
            "-- graygate = {} _G\nlocal s = '_G graygate'",
            "return function() end",
        ]));
        for no in [
            // Not used at all: nothing to gain.
            "return function() end",
            "local graygate = { bucket = function() return 1 end } return graygate.bucket('a')",
            "graygate = { bucket = print } return function() return graygate.bucket('a') end",
            "local b = graygate.bucket return function() return graygate.bucket('a') end",
            "function graygate.bucket(s) end return function() return graygate.bucket('a') end",
            "_G.x = 1 return function() return graygate.bucket('a') end",
            "return function(graygate) return graygate.bucket('a') end",
            "return graygate:bucket('a')",
            "local s = 'unfinished",
        ] {
            assert!(!yes(&[no]), "{no}");
        }
        // One text that could shadow it is enough to keep the global.
        assert!(!yes(&["return graygate.bucket('a')", "_G.graygate = {}"]));
        let code = rewrite_with("return graygate.bucket(x) + y.graygate", true).unwrap();
        assert!(
            code.contains(&format!("return {B}.bucket(x) + y.graygate")),
            "{code}"
        );
        assert!(rewrite("return graygate.bucket(x)")
            .unwrap()
            .contains("return graygate.bucket(x)"));
    }

    #[test]
    fn reserved_names_and_broken_tokens_are_refused_with_their_line() {
        let e = rewrite("local x = 1\nlocal __gg_b = {}").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.message.contains("reserved"), "{e}");
        assert_eq!(rewrite("\n\nx = 'open").unwrap_err().line, 3);
        assert_eq!(rewrite("x = [[ never closed").unwrap_err().line, 1);
        assert_eq!(rewrite("--[[ open\n\n").unwrap_err().line, 3);
    }

    #[test]
    fn the_check_is_cheap_enough_for_the_jit_to_keep_it() {
        // Not a timing: the loop is long, its checks all pass, and the
        // counter went down by exactly one per iteration.
        let (lua, b) = vm();
        let before = 1_000_000_000i64;
        load(
            &lua,
            &b,
            "local s = 0 for i = 1, 100000 do s = s + i end return s",
        )
        .unwrap();
        let after: i64 = b.raw_get(1).unwrap();
        assert_eq!(before - after, 100_000);
    }
}
