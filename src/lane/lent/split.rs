//! Layer: lane. The request's cookies and query arguments as `name=value`
//! pairs, split once per lane call on first use (by `ngx.var.cookie_*` /
//! `ngx.var.arg_*`, in `lane::ngx::var`) and kept beside the call.

/// A `name=value` pair found in a Cookie header or the query string, as
/// byte offsets into it (`src`: which Cookie header).
#[derive(Clone, Copy)]
pub(crate) struct Pair {
    pub src: u16,
    pub name: (u32, u32),
    pub value: (u32, u32),
}

/// The request's cookies and query arguments, split into pairs once per
/// request on first use.
#[derive(Default)]
pub(crate) struct CookiesAndArgs {
    pub cookies: Option<Vec<Pair>>,
    pub args: Option<Vec<Pair>>,
}

impl CookiesAndArgs {
    /// Headers changed (`ngx.req.set_header`): cookies are parsed again.
    pub(crate) fn headers_changed(&mut self) {
        self.cookies = None;
    }
}
