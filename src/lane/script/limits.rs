//! Layer: lane. The sandbox's limits: the instruction budget (counted by
//! the checks `lane::budget` writes into the source, in chunks handed out
//! by a host `tick`), the VM's memory limit, and how a failed call is
//! classified and placed (`file:line`), with process-wide counters.

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use mlua::{Function, Lua, Table};

use super::error::{located, lua_error, Limit, Located};

/// The script's top level (run once per load) may run this many budgets,
/// so building big tables at load time is fine.
pub(super) const TOP_LEVEL_BUDGETS: i64 = 100;
/// What one budget check (one loop iteration, one function call) charges
/// to `instruction_budget`: about the bytecodes an empty loop's iteration
/// runs, its check included, so the budget means roughly what a count of
/// executed bytecodes would. Straight-line code between checks is bounded
/// by the script's length and not charged.
pub const CHECK_WEIGHT: i64 = 10;
/// Checks the Lua side counts down between two host calls (`tick`): a host
/// call every so many loop iterations keeps hot loops fast and still
/// places a memory error closely while the VM holds less than half its
/// limit; above that every check ticks.
pub(super) const TICK_EVERY: i64 = 100;

/// Why the last call was stopped by a limit.
#[derive(Debug, Default)]
pub(super) struct Guard {
    /// Budget (in instructions) left in this call beyond the chunk of
    /// checks the Lua side is counting down.
    pub(super) left: Cell<i64>,
    /// Above this many bytes every check ticks and records where it is.
    pub(super) locate_above: usize,
    /// Set once the budget is spent; pcall/coroutine.resume re-raise then.
    pub(super) killed: Cell<bool>,
    /// `file:line` where the budget ran out.
    pub(super) killed_at: RefCell<String>,
    /// Last `file:line` a tick saw above `locate_above` (locates memory
    /// errors).
    pub(super) last_at: RefCell<(String, usize)>,
}

impl Guard {
    /// A fresh `budget` for a call (or a load's top level).
    pub(super) fn arm(&self, budget: i64) {
        self.killed.set(false);
        self.last_at.borrow_mut().0.clear();
        self.left.set(budget);
    }
}

/// The table the checks written into the source count with (`lane::budget`):
/// `[1]` the checks left in the current chunk, `tick` the host function
/// called when it runs out. `tick` takes the next chunk from
/// `guard.left`, or — the budget spent — marks the call killed, records
/// where, and raises (every later check ticks again and raises again).
/// While the VM holds more than half its memory limit it records where the
/// script is at every check (to place a memory error) instead of every
/// [`TICK_EVERY`].
pub(super) fn budget_counter(lua: &Lua, guard: &Rc<Guard>) -> mlua::Result<Table> {
    let t = lua.create_table_with_capacity(1, 1)?;
    let g = guard.clone();
    let tick = lua.create_function(move |lua, ()| -> mlua::Result<i64> {
        let left = g.left.get();
        if g.killed.get() || left < CHECK_WEIGHT {
            if !g.killed.get() {
                g.killed.set(true);
                let (file, line) = script_position(lua);
                *g.killed_at.borrow_mut() = format!("{file}:{line}");
            }
            return Err(mlua::Error::runtime("instruction budget exceeded"));
        }
        let chunk = if lua.used_memory() > g.locate_above {
            let (file, line) = script_position(lua);
            let mut last = g.last_at.borrow_mut();
            if last.0 != file {
                last.0 = file;
            }
            last.1 = line;
            1
        } else {
            TICK_EVERY.min(left / CHECK_WEIGHT)
        };
        g.left.set(left - chunk * CHECK_WEIGHT);
        // This check is the chunk's first.
        Ok(chunk - 1)
    })?;
    t.raw_set("tick", tick)?;
    Ok(t)
}

/// `file:line` of the Lua function calling the current host function.
fn script_position(lua: &Lua) -> (String, usize) {
    lua.inspect_stack(1, |d| {
        let src = d.source();
        let file = src.source.as_deref().unwrap_or("?");
        let file = file.strip_prefix('@').unwrap_or(file).to_string();
        (file, d.current_line().unwrap_or(0))
    })
    .unwrap_or_default()
}

pub(super) static INSTRUCTION_LIMIT_HITS: AtomicU64 = AtomicU64::new(0);
pub(super) static MEMORY_LIMIT_HITS: AtomicU64 = AtomicU64::new(0);
pub(super) static SCRIPT_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Lane calls stopped by the instruction budget since start.
pub fn instruction_limit_hits() -> u64 {
    INSTRUCTION_LIMIT_HITS.load(Ordering::Relaxed)
}

/// Lane calls stopped by the VM memory limit since start.
pub fn memory_limit_hits() -> u64 {
    MEMORY_LIMIT_HITS.load(Ordering::Relaxed)
}

/// Lane calls that failed for any reason (limits included) since start.
pub fn script_errors() -> u64 {
    SCRIPT_ERRORS.load(Ordering::Relaxed)
}

/// Classifies a failed call: budget (located where the hook stopped it),
/// memory (located at the last place seen, or the lane function), or an
/// ordinary error located by Lua's own message.
pub(super) fn classify(
    guard: &Guard,
    file: &Path,
    err: &mlua::Error,
    lane_fn: Option<&Function>,
) -> (Option<Limit>, Located) {
    if guard.killed.get() {
        let at = guard.killed_at.borrow().clone();
        return (
            Some(Limit::Instructions),
            located(&at, file, "instruction budget exceeded"),
        );
    }
    if is_memory_error(err) {
        let last = guard.last_at.borrow().clone();
        let at = if !last.0.is_empty() {
            format!("{}:{}", last.0, last.1)
        } else if let Some(f) = lane_fn {
            let info = f.info();
            let src = info.source.unwrap_or_default();
            format!(
                "{}:{}",
                src.strip_prefix('@').unwrap_or(&src),
                info.line_defined.unwrap_or(0)
            )
        } else {
            String::new()
        };
        return (
            Some(Limit::Memory),
            located(&at, file, "memory limit exceeded"),
        );
    }
    (None, lua_error(file, err))
}

fn is_memory_error(err: &mlua::Error) -> bool {
    match err {
        mlua::Error::MemoryError(_) => true,
        mlua::Error::CallbackError { cause, .. } => is_memory_error(cause),
        mlua::Error::WithContext { cause, .. } => is_memory_error(cause),
        other => other.to_string().contains("not enough memory"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::load::NEXT_ID;
    use super::super::testing::{both_modes, call, jit, limited_src, load_src, vm_jit_on};
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    #[test]
    fn hot_infinite_loop_is_stopped_located_and_counted() {
        both_modes(hot_infinite_loop_is_stopped_located_and_counted_in);
    }

    fn hot_infinite_loop_is_stopped_located_and_counted_in() {
        let (_d, src) = load_src(
            "return function(req)\n  if req:header('x-loop') then\n    while true do end\n  end\n  return 'gray'\nend\n",
        );
        let before = instruction_limit_hits();
        let e = call(&src, Some(("x-loop", "1"))).unwrap_err();
        assert_eq!(e.limit, Some(Limit::Instructions), "{e}");
        assert!(
            e.message.contains("t.lua:3: instruction budget exceeded"),
            "{e}"
        );
        assert!(instruction_limit_hits() > before);
        // The same VM keeps serving.
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
    }

    #[test]
    fn pcall_and_coroutines_cannot_swallow_the_budget() {
        both_modes(pcall_and_coroutines_cannot_swallow_the_budget_in);
    }

    fn pcall_and_coroutines_cannot_swallow_the_budget_in() {
        for body in [
            "while true do pcall(function() while true do end end) end",
            "while true do xpcall(function() while true do end end, function(e) return e end) end",
            "while true do coroutine.resume(coroutine.create(function() while true do end end)) end",
            "local f = coroutine.wrap(function() while true do end end)\n f()",
            // Caught once, with no check left to pass afterwards: the
            // wrappers re-raise.
            "local ok = pcall(function() while true do end end)\n return 'swallowed'",
            "xpcall(function() while true do end end, function(e) return e end)\n return 'swallowed'",
            "coroutine.resume(coroutine.create(function() while true do end end))\n return 'swallowed'",
        ] {
            let (_d, src) = load_src(&format!("return function()\n{body}\nend\n"));
            let e = call(&src, None).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Instructions), "{body}: {e}");
        }
    }

    #[test]
    fn top_level_gets_a_larger_but_finite_budget() {
        both_modes(top_level_gets_a_larger_but_finite_budget_in);
    }

    fn top_level_gets_a_larger_but_finite_budget_in() {
        // 100,000 checks at load (1M of budget): more than one call's
        // budget, fine.
        let (_d, src) = load_src(
            "local t = {}\nfor i = 1, 100000 do t[i] = i * 2 end\nreturn function() return t[100000] == 200000 and 'gray' or nil end\n",
        );
        src.validate(&Arc::new(BTreeMap::new())).unwrap();
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        // A runaway top level is stopped and the load rejected, located.
        let (_d, src) =
            load_src("local x = 0\nwhile true do x = x + 1 end\nreturn function() end\n");
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.message.contains("instruction budget exceeded"), "{err}");
    }

    #[test]
    fn budget_is_configurable() {
        both_modes(budget_is_configurable_in);
    }

    fn budget_is_configurable_in() {
        // 1,000 checks (10,000 of budget): fine under the default, stopped
        // under 1000.
        let text = "return function()\n local x = 0\n for i = 1, 1000 do x = x + i end\n return 'gray'\nend\n";
        let (_d, mut src) = load_src(text);
        assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        src.instruction_budget = 1_000;
        src.id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        assert_eq!(
            call(&src, None).unwrap_err().limit,
            Some(Limit::Instructions)
        );
    }

    #[test]
    fn memory_bomb_is_stopped_by_the_vm_limit() {
        both_modes(memory_bomb_is_stopped_by_the_vm_limit_in);
    }

    fn memory_bomb_is_stopped_by_the_vm_limit_in() {
        for body in [
            "local t = {}\n  while true do t[#t + 1] = string.rep('x', 2^20) .. #t end",
            "return string.rep('x', 2^28)",
            // Table growth: one array doubling after another.
            "local t, i = {}, 0\n  while true do i = i + 1 t[i] = i end",
            // Hash part growth, and a string doubling itself.
            "local t, i = {}, 0\n  while true do i = i + 1 t['k' .. i] = true end",
            "local s = 'x'\n  while true do s = s .. s end",
        ] {
            let (_d, src) = limited_src(
                &format!("return function(req)\n  if req:header('x-bomb') then\n  {body}\n  end\n  return 'gray'\nend\n"),
                16 << 20,
                100_000_000,
            );
            let before = memory_limit_hits();
            let e = call(&src, Some(("x-bomb", "1"))).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Memory), "{body}: {e}");
            assert!(e.message.contains("t.lua:"), "{e}");
            assert!(e.message.contains("memory limit exceeded"), "{e}");
            assert!(memory_limit_hits() > before);
            assert_eq!(call(&src, None).unwrap().as_deref(), Some("gray"));
        }
    }

    #[test]
    fn a_loop_hot_enough_to_be_jit_compiled_is_still_stopped() {
        both_modes(a_loop_hot_enough_to_be_jit_compiled_is_still_stopped_in);
    }

    fn a_loop_hot_enough_to_be_jit_compiled_is_still_stopped_in() {
        // With LuaJIT's compiler on (`jit: true`), this loop becomes a
        // trace after a few dozen iterations: a count hook would never run
        // again and the call would return "done" (3e8 iterations take well
        // under a second compiled). The budget checks written into the
        // source are compiled into the trace and stop it.
        let (_d, src) = load_src(
            "return function()\n  local x = 0\n  for i = 1, 3e8 do x = x + i end\n  return 'done'\nend\n",
        );
        for _ in 0..3 {
            let e = call(&src, None).unwrap_err();
            assert_eq!(e.limit, Some(Limit::Instructions), "{e}");
            assert!(e.message.contains("t.lua:3:"), "{e}");
        }
        // The mode asked for is the mode the VM runs in.
        assert_eq!(vm_jit_on(), jit());
        // A hot inner function called from a loop, likewise.
        let (_d, src) = load_src(
            "local function f(x) return x + 1 end\nreturn function()\n  local x = 0\n  while x < 3e8 do x = f(x) end\n  return 'done'\nend\n",
        );
        assert_eq!(
            call(&src, None).unwrap_err().limit,
            Some(Limit::Instructions)
        );
    }
}
