//! Layer: lane. The lane call: this thread's VM (built, or rebuilt for a
//! new load) runs the lane function on the request lent to it, and the
//! result, the request as the script changed it, and any failure come
//! back classified and counted.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::error::{Limit, ScriptError};
use super::limits::{classify, INSTRUCTION_LIMIT_HITS, MEMORY_LIMIT_HITS, SCRIPT_ERRORS};
use super::load::ScriptSource;
use super::sandbox::{Entry, ScriptVm, VM};
use crate::base::lists::IpList;
use crate::lane::lent::{with_current, RuleCtx, CURRENT, REQ};
use crate::lane::RequestInfo;

/// A lane function's string result that is not UTF-8.
fn not_utf8() -> mlua::Error {
    mlua::Error::runtime("lane() returned a string that is not UTF-8")
}

/// A lane function's result of type `ty` (neither a string nor nil).
fn wrong_type(ty: &str) -> mlua::Error {
    mlua::Error::runtime(format!("lane() returned a {ty} (expected a string or nil)"))
}

impl ScriptVm {
    /// Runs the lane function for `req` (lent as the call's request).
    fn call(&self, req: &RequestInfo) -> mlua::Result<Option<String>> {
        // The Lua counter keeps what the last call left of its chunk (at
        // most TICK_EVERY checks, so a call may run up to that many checks
        // beyond its budget): arming it per call would take a
        // `Table::raw_set` (a protected call under a memory limit) or an
        // extra argument to the entry on every call.
        self.guard.arm(self.budget);
        // Either entry checks the result's type in Lua; it is read from
        // the stack as bytes: no reference to a Lua value is made.
        let r = match &self.entry {
            // `req` is the entry's upvalue: no argument to push.
            Entry::Ngx(entry) => entry.call(())?,
            Entry::Native(p, entry) => {
                let r = p.call(&self.lua, entry, &self.lists, req);
                // `ngx` reached by a computed name filled its caches.
                if with_current(|_, c| c.ngx_cached).unwrap_or(true) {
                    let _ = self.reset.call::<()>(());
                }
                r?
            }
        };
        match r {
            (Some(lane), _) => String::from_utf8(lane.into())
                .map(Some)
                .map_err(|_| not_utf8()),
            (None, None) => Ok(None),
            (None, Some(ty)) => Err(wrong_type(&String::from_utf8_lossy(&ty))),
        }
    }
}

/// Runs the lane function of `src` for `req` on this thread's VM, building
/// the VM if it belongs to another load. Returns the request back (with
/// any `ngx.req.set_header` changes when the call succeeded).
pub fn call_lane(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    mut req: RequestInfo,
    rule: RuleCtx,
) -> (RequestInfo, Result<Option<String>, ScriptError>) {
    let (result, edited) = call_with(src, lists, &req, rule);
    if let Some(e) = edited {
        req = *e;
    }
    (req, result)
}

/// [`call_lane`] on a borrowed request: the result, and the request as
/// the script changed it when it did and the call succeeded (boxed: an
/// `Option<RequestInfo>` is copied whole at every move, `None` too).
pub(crate) fn call_with(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    req: &RequestInfo,
    rule: RuleCtx,
) -> (
    Result<Option<String>, ScriptError>,
    Option<Box<RequestInfo>>,
) {
    CURRENT.with(|c| c.borrow_mut().cur.rule = rule);
    let result = REQ.set(req, || run(src, lists, req));
    let edited = CURRENT.with(|c| {
        let slot = &mut *c.borrow_mut();
        let cur = &mut slot.cur;
        cur.rule = RuleCtx::default();
        cur.cookies_args = Default::default();
        cur.ngx_cached = false;
        slot.edited.take()
    });
    let edited = edited.filter(|_| result.is_ok());
    (result, edited)
}

/// The call itself, with `req` set as the request being decided.
fn run(
    src: &ScriptSource,
    lists: &Arc<BTreeMap<String, IpList>>,
    req: &RequestInfo,
) -> Result<Option<String>, ScriptError> {
    VM.with(|vm| {
        let mut slot = vm.borrow_mut();
        if slot.as_ref().is_none_or(|v| v.id != src.id) {
            *slot = None;
            match ScriptVm::build(src, lists.clone()) {
                Ok(v) => *slot = Some(v),
                Err(e) => {
                    return Err(ScriptError {
                        message: e.to_string(),
                        limit: None,
                    })
                }
            }
        }
        let vm = slot.as_ref().expect("built above");
        let r = vm.call(req).map_err(|e| {
            let (limit, located) = classify(&vm.guard, &src.path, &e, Some(&vm.lane_fn));
            ScriptError {
                message: located.to_string(),
                limit,
            }
        });
        if let Err(e) = &r {
            SCRIPT_ERRORS.fetch_add(1, Ordering::Relaxed);
            match e.limit {
                Some(Limit::Instructions) => {
                    INSTRUCTION_LIMIT_HITS.fetch_add(1, Ordering::Relaxed);
                }
                Some(Limit::Memory) => {
                    MEMORY_LIMIT_HITS.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
            // After a memory error reclaim what the call left; a VM still
            // near its limit is dropped so the next call starts clean.
            if e.limit == Some(Limit::Memory) {
                let _ = vm.lua.gc_collect();
                if vm.lua.used_memory() > src.memory_limit / 2 {
                    *slot = None;
                }
            }
        }
        r
    })
}
