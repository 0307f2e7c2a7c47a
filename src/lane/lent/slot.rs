//! Layer: lane. This thread's slots beside a lane call: the request being
//! decided (lent to the call, never moved), its [`Current`] state and the
//! request as the script changed it; host functions reach them through
//! [`with_req`], [`with_current`] and [`with_edit`].

use std::cell::RefCell;

use super::RuleCtx;
use crate::lane::RequestInfo;

/// What a lane call keeps beside the request being decided.
#[derive(Default)]
pub(crate) struct Current {
    pub rule: RuleCtx,
    /// Cookies and arguments split once per request, on first use.
    pub cookies_args: super::CookiesAndArgs,
    /// Set by the `ngx` host calls that fill per-request caches in Lua;
    /// the call empties them afterwards (`ScriptVm::reset`).
    pub ngx_cached: bool,
}

/// This thread's slot beside the request being decided: the request as
/// the script changed it, and its [`Current`]. It lives as long as the
/// thread and is filled in place per call.
#[derive(Default)]
pub(crate) struct Slot {
    /// A copy of the request made at the first change
    /// (`ngx.req.set_header`, `ngx.var.args = …`), which every later read
    /// of the call sees; it replaces the request only when the call
    /// succeeds, so a failing script leaves the request untouched.
    pub(crate) edited: Option<Box<RequestInfo>>,
    pub(crate) cur: Current,
}

// Per-thread slots: the request being decided — borrowed for the call, so
// it is never moved in or out (moving it into a thread-local and back
// would copy the whole request several times) — and its slot. (This
// thread's VM is `lane::script`'s.)
scoped_tls::scoped_thread_local!(pub(crate) static REQ: RequestInfo);
thread_local! {
    pub(crate) static CURRENT: RefCell<Slot> = RefCell::new(Slot::default());
}

fn outside() -> mlua::Error {
    mlua::Error::runtime("request data used outside a lane call")
}

/// Runs `f` on the request lent to the call and this thread's slot; an
/// error outside a lane call.
#[inline(always)]
fn lent<R>(f: impl FnOnce(&RequestInfo, &RefCell<Slot>) -> R) -> mlua::Result<R> {
    if !REQ.is_set() {
        return Err(outside());
    }
    Ok(REQ.with(|r| CURRENT.with(|c| f(r, c))))
}

/// Runs `f` on the request being decided (as the script changed it).
pub(crate) fn with_req<R>(f: impl FnOnce(&RequestInfo) -> R) -> mlua::Result<R> {
    lent(|r, c| f(c.borrow().edited.as_deref().unwrap_or(r)))
}

/// Runs `f` on the request being decided and its [`Current`], mutably.
pub(crate) fn with_current<R>(f: impl FnOnce(&RequestInfo, &mut Current) -> R) -> mlua::Result<R> {
    lent(|r, c| {
        let slot = &mut *c.borrow_mut();
        f(slot.edited.as_deref().unwrap_or(r), &mut slot.cur)
    })
}

/// Runs `f` on the request being decided, to change it (e.g.
/// `ngx.req.set_header`): on the call's copy of it, made here the first
/// time (see [`Slot::edited`]).
pub(crate) fn with_edit<R>(f: impl FnOnce(&mut RequestInfo, &mut Current) -> R) -> mlua::Result<R> {
    lent(|r, c| {
        let slot = &mut *c.borrow_mut();
        let req = slot.edited.get_or_insert_with(|| Box::new(r.clone()));
        f(req, &mut slot.cur)
    })
}
