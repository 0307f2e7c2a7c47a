//! Layer: lane. What a lane call lends its host functions, below the script
//! runtime (`lane::script`) and the APIs it installs (`lane::ngx`,
//! `lane::native`), which all reach the request through here: the request
//! being decided and its per-call state in this thread's slots (`slot`),
//! request values pushed into the VM under its memory limit (`push`), the
//! cookies and arguments split once per call (`split`), and the rule
//! verdict handed to the script ([`RuleCtx`]).

mod push;
mod slot;
mod split;

use std::sync::Arc;

pub(crate) use push::{pushed, request_string, Pushed, Restore, UNLIMITED_STRING_MAX};
pub(crate) use slot::{with_current, with_edit, with_req, CURRENT, REQ};
pub(crate) use split::{CookiesAndArgs, Pair};

/// The rule verdict handed to the script (`req.rule_lane`, `req.rule_name`).
#[derive(Debug, Clone, Default)]
pub struct RuleCtx {
    pub lane: Option<Arc<str>>,
    pub name: Option<Arc<str>>,
}
