//! Layer: base. `Decision`: everything known about how one request was routed —
//! the per-request record that the proxy fills in and metrics, the access log
//! and `/explain` read.

use std::sync::Arc;

/// Who decided a request's lane.
///
/// Lane precedence (`lane::precedence`, the one place that applies it)
/// takes the first source that decides, in this order:
///
/// 1. [`TrustedTag`](Self::TrustedTag) — a trusted proxy's tag header
///    ([`InvalidLane`](Self::InvalidLane) when the tag is not a lane name);
///    then, with `otel:` baggage on, a trusted proxy's lane member of
///    W3C `baggage` ([`TrustedBaggage`](Self::TrustedBaggage); a header
///    with any problem is ignored);
/// 2. [`Deny`](Self::Deny) — a deny rule: formal, whatever else would match;
/// 3. [`StickyCookie`](Self::StickyCookie) — on sticky routes, a valid
///    cookie naming a lane still served and not rolled back, unless a
///    release step takes the request for another lane (the cookie pins only
///    outside a release's current share);
/// 4. [`Release`](Self::Release) — a progressive release's current step (a
///    share placed by the request's key, else by the draw a sticky cookie
///    recorded);
/// 5. [`Rule`](Self::Rule) / [`RuleFallback`](Self::RuleFallback) — the
///    declarative rules' verdict, handed to the script;
/// 6. [`Script`](Self::Script) — the script's lane, or nil to keep the rule
///    verdict ([`ScriptError`](Self::ScriptError) /
///    [`InvalidLane`](Self::InvalidLane) when it fails);
/// 7. the fallbacks: the rule verdict, else [`Default`](Self::Default).
///
/// Over all of them, a lane a release rolled back is never the answer:
/// [`RolledBack`](Self::RolledBack), formal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecidedBy {
    /// No script configured (or it returned nil): the baseline.
    Default,
    /// The Lua script returned the lane (nil counts as formal).
    Script,
    /// A trusted proxy sent the tag header.
    TrustedTag,
    /// A trusted proxy sent the lane as a W3C baggage member.
    TrustedBaggage,
    /// The script failed; the request went formal.
    ScriptError(String),
    /// The script (or tag) produced an unusable lane name; formal.
    InvalidLane(String),
    /// A deny rule (named) matched: formal, whatever else would match.
    Deny(Arc<str>),
    /// A declarative rule (named) matched and the script kept its lane.
    Rule(Arc<str>),
    /// Rules are enabled but none matched: their `fallback` lane.
    RuleFallback,
    /// A valid signed sticky cookie kept the lane of an earlier decision.
    StickyCookie,
    /// A progressive release's current step (named) took the request.
    Release(Arc<str>),
    /// The lane was rolled back by a release: the request went formal.
    RolledBack(Arc<str>),
}

impl DecidedBy {
    pub fn as_str(&self) -> &'static str {
        match self {
            DecidedBy::Default => "default",
            DecidedBy::Script => "script",
            DecidedBy::TrustedTag => "trusted_tag",
            DecidedBy::TrustedBaggage => "trusted_baggage",
            DecidedBy::ScriptError(_) => "script_error",
            DecidedBy::InvalidLane(_) => "invalid_lane",
            DecidedBy::StickyCookie => "sticky_cookie",
            DecidedBy::Deny(_) => "deny",
            DecidedBy::Rule(_) => "rule",
            DecidedBy::RuleFallback => "rule_fallback",
            DecidedBy::Release(_) => "release",
            DecidedBy::RolledBack(_) => "rolled_back",
        }
    }

    /// The deny or rule name, when a named rule decided.
    pub fn rule_name(&self) -> Option<&str> {
        match self {
            DecidedBy::Deny(n) | DecidedBy::Rule(n) | DecidedBy::Release(n) => Some(n),
            _ => None,
        }
    }
}

/// A decided lane's name without an allocation for the usual ones: a
/// `'static` name (`formal`), a shared name from the generation (a rule's or
/// release step's lane, an `Arc` clone), or an owned one (a script's or a
/// trusted tag's). Reads as a `&str`.
#[derive(Clone)]
pub struct LaneName(LaneRepr);

#[derive(Clone)]
enum LaneRepr {
    Static(&'static str),
    Shared(Arc<str>),
    Owned(String),
}

impl LaneName {
    pub fn as_str(&self) -> &str {
        match &self.0 {
            LaneRepr::Static(s) => s,
            LaneRepr::Shared(s) => s,
            LaneRepr::Owned(s) => s,
        }
    }
}

impl std::ops::Deref for LaneName {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for LaneName {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<std::path::Path> for LaneName {
    fn as_ref(&self) -> &std::path::Path {
        self.as_str().as_ref()
    }
}

impl From<LaneName> for serde_json::Value {
    fn from(l: LaneName) -> serde_json::Value {
        l.as_str().into()
    }
}

impl PartialEq<LaneName> for &str {
    fn eq(&self, o: &LaneName) -> bool {
        *self == o.as_str()
    }
}

impl PartialEq<LaneName> for str {
    fn eq(&self, o: &LaneName) -> bool {
        self == o.as_str()
    }
}

impl std::fmt::Debug for LaneName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for LaneName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq for LaneName {
    fn eq(&self, o: &LaneName) -> bool {
        self.as_str() == o.as_str()
    }
}

impl Eq for LaneName {}

impl PartialEq<str> for LaneName {
    fn eq(&self, o: &str) -> bool {
        self.as_str() == o
    }
}

impl PartialEq<&str> for LaneName {
    fn eq(&self, o: &&str) -> bool {
        self.as_str() == *o
    }
}

impl PartialEq<String> for LaneName {
    fn eq(&self, o: &String) -> bool {
        self.as_str() == o
    }
}

impl From<&'static str> for LaneName {
    fn from(s: &'static str) -> LaneName {
        LaneName(LaneRepr::Static(s))
    }
}

impl From<String> for LaneName {
    fn from(s: String) -> LaneName {
        LaneName(LaneRepr::Owned(s))
    }
}

impl From<Arc<str>> for LaneName {
    fn from(s: Arc<str>) -> LaneName {
        LaneName(LaneRepr::Shared(s))
    }
}

impl From<&Arc<str>> for LaneName {
    fn from(s: &Arc<str>) -> LaneName {
        LaneName(LaneRepr::Shared(s.clone()))
    }
}

/// Everything known about how one request was routed.
#[derive(Debug, Clone)]
pub struct Decision {
    /// The decided lane (no allocation for `formal` or a rule's lane).
    pub lane: LaneName,
    pub decided_by: DecidedBy,
    /// Prefix of the matched route.
    pub route: Option<Arc<str>>,
    /// Service name (API routes).
    pub service: Option<Arc<str>>,
    /// Lane of the candidate set used (differs from `lane` on fallback).
    pub served_lane: Option<Arc<str>>,
    /// Number of candidate nodes.
    pub candidates: usize,
    /// Name of the chosen node, or the static file served.
    pub node: Option<Arc<str>>,
    /// Why the request did not go to its own lane.
    pub fallback: Option<&'static str>,
    /// Nodes tried (1 + retries; 0 before any attempt).
    pub attempts: u32,
}

impl Decision {
    pub fn new(lane: impl Into<LaneName>, decided_by: DecidedBy) -> Decision {
        Decision {
            lane: lane.into(),
            decided_by,
            route: None,
            service: None,
            served_lane: None,
            candidates: 0,
            node: None,
            fallback: None,
            attempts: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_names_read_alike_whatever_holds_them() {
        let shared: Arc<str> = "gray".into();
        let lanes = [
            LaneName::from("gray"),
            LaneName::from(String::from("gray")),
            LaneName::from(shared.clone()),
            LaneName::from(&shared),
        ];
        for l in &lanes {
            assert_eq!(l.as_str(), "gray");
            assert_eq!(*l, "gray");
            assert!("gray" == *l);
            assert_eq!(*l, String::from("gray"));
            assert_eq!(*l, lanes[0]);
            assert_ne!(*l, "formal");
            // Formatted as the name itself (logs, /explain), as a String was.
            assert_eq!(format!("{l:?} {l}"), "\"gray\" gray");
            assert_eq!(serde_json::Value::from(l.clone()), "gray");
            assert_eq!(
                AsRef::<std::path::Path>::as_ref(l),
                std::path::Path::new("gray")
            );
        }
        let d = Decision::new(crate::config::FORMAL, DecidedBy::Default);
        assert_eq!(d.lane, "formal");
    }
}
