//! Layer: lane. Lane precedence: the one place that walks the sources of a
//! request's lane in order and takes the first that decides. The order is
//! documented on [`DecidedBy`]; [`decide_on_route`] is the only entry
//! (real traffic, `/explain` and the fuzz entry all decide through it).

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use http::HeaderValue;

use super::sticky::{unix_now, Pin};
use super::{rules, script, DecidedBy, Decision, LanePolicy, RequestInfo};
use crate::base::baggage::BAGGAGE;
use crate::base::ratelog::log_limited;
use crate::config::{valid_lane, FORMAL};

/// A decided request: the request handed back (as the script left it —
/// `ngx.req.set_header` edits included), its [`Decision`], and for sticky
/// routes a fresh cookie to set.
#[derive(Debug)]
pub struct Decided {
    pub info: RequestInfo,
    pub decision: Decision,
    pub set_cookie: Option<HeaderValue>,
}

/// Decides the lane of `req` under `gen`, as on a route that is not sticky.
pub fn decide(gen: &LanePolicy, req: RequestInfo) -> Decided {
    decide_on_route(gen, false, req)
}

/// Decides the lane of `req` on a route: on a sticky route (`sticky_route`,
/// with a signer configured) a valid cookie may keep an earlier lane, and a
/// real decision (not a tag, a deny, a kept cookie, a failure or a
/// rolled-back lane) comes with a fresh cookie to set, carrying the user's
/// draws in the releases' shares.
pub fn decide_on_route(gen: &LanePolicy, sticky_route: bool, mut req: RequestInfo) -> Decided {
    let sticky = gen
        .sticky
        .as_ref()
        .filter(|_| sticky_route)
        .map(|st| (st, unix_now()));
    let pin = sticky.and_then(|(st, now)| st.pin_in(&req.parts.headers, now));
    // The request is only borrowed until here, and moved once, into the
    // `Decided` (each move of it copies the whole head).
    let (decision, edited) = precedence(gen, pin.as_ref(), &req);
    let set_cookie = match sticky {
        Some((st, now)) if pins_cookie(&decision.decided_by) => {
            let draws = draws(gen, &req, pin.as_ref());
            Some(st.set_cookie(&decision.lane, &draws, now))
        }
        _ => None,
    };
    if let Some(e) = edited {
        req = *e;
    }
    Decided {
        info: req,
        decision,
        set_cookie,
    }
}

/// The draws a fresh cookie records: for every release share, the user's
/// bucket from this request's key, else the one the old cookie recorded.
fn draws<'a>(gen: &'a LanePolicy, req: &RequestInfo, pin: Option<&Pin<'_>>) -> Vec<(&'a str, u32)> {
    let Some(releases) = &gen.releases else {
        return Vec::new();
    };
    releases
        .rules
        .iter()
        .filter(|r| r.has_share())
        .filter_map(|r| {
            let d = r.draw(req).or_else(|| pin.and_then(|p| p.draw(&r.name)))?;
            Some((&*r.name, d))
        })
        .collect()
}

/// Whether a decision is pinned by a fresh sticky cookie: a real decision
/// is; a trusted tag, a deny, a kept cookie, a failure or a rolled-back lane
/// is not.
fn pins_cookie(by: &DecidedBy) -> bool {
    matches!(
        by,
        DecidedBy::Script
            | DecidedBy::Default
            | DecidedBy::Rule(_)
            | DecidedBy::RuleFallback
            | DecidedBy::Release(_)
    )
}

/// The lane precedence (the order on [`DecidedBy`]): the first source
/// that decides, then the veto of a rolled-back lane over whatever
/// decided. Also returns the request as a script changed it.
fn precedence(
    gen: &LanePolicy,
    pin: Option<&Pin<'_>>,
    req: &RequestInfo,
) -> (Decision, Option<Box<RequestInfo>>) {
    let (decision, edited) = first_decided(gen, pin, req);
    if !gen.revoked.is_empty() && gen.revoked.contains(decision.lane.as_str()) {
        let lane: Arc<str> = decision.lane.as_str().into();
        return (Decision::new(FORMAL, DecidedBy::RolledBack(lane)), edited);
    }
    (decision, edited)
}

/// The release step taking `req`, if any: a share placed by the request's
/// key, else by the draw the sticky cookie recorded.
fn release_step<'g>(
    gen: &'g LanePolicy,
    pin: Option<&Pin<'_>>,
    req: &RequestInfo,
) -> Option<&'g rules::Rule> {
    let releases = gen.releases.as_ref()?;
    match pin {
        Some(p) => releases.first_match_drawn(req, |name| p.draw(name)),
        None => releases.first_match(req),
    }
}

/// The sources in order — trusted tag, deny rules, sticky cookie, release
/// steps, rules, script — and the fallbacks when none decides.
fn first_decided(
    gen: &LanePolicy,
    pin: Option<&Pin<'_>>,
    req: &RequestInfo,
) -> (Decision, Option<Box<RequestInfo>>) {
    // 1. A tag from a trusted proxy (an invalid one means formal).
    if req.peer_trusted {
        if let Some(v) = req.parts.headers.get(&gen.tag_header) {
            return (trusted_tag(v), None);
        }
        // … or its lane member of W3C baggage.
        if let Some(d) = gen
            .baggage_key
            .as_deref()
            .and_then(|k| trusted_baggage(req, k))
        {
            return (d, None);
        }
    }
    // 2. Deny rules: formal, and no sticky cookie keeps a lane.
    let rules = gen.rules.as_ref();
    if let Some(name) = rules.and_then(|r| r.denied(req)) {
        return (Decision::new(FORMAL, DecidedBy::Deny(name.clone())), None);
    }
    // 3. A valid sticky cookie naming a lane still served and not rolled
    //    back — unless a release step takes the request for another lane:
    //    the cookie pins only outside a release's current share, so a
    //    rising share (or a promotion) moves formal users in, and users
    //    already in stay in.
    let step = release_step(gen, pin, req);
    if let Some(p) = pin {
        let l = p.lane;
        let kept = gen.served_lanes.contains(l) && !gen.revoked.contains(l);
        if kept && step.is_none_or(|s| &*s.lane == l) {
            return (Decision::new(l.to_string(), DecidedBy::StickyCookie), None);
        }
    }
    // 4. A progressive release's current step.
    if let Some(step) = step {
        let d = Decision::new(&step.lane, DecidedBy::Release(step.name.clone()));
        return (d, None);
    }
    // 5. The declarative rules' verdict (a rule or their fallback lane).
    let verdict = rules.map_or(rules::Verdict::Disabled, |r| r.matched(req));
    let rule_decision = rule_verdict(&verdict);
    // 6. The script, which sees the rule verdict and may keep it (nil) or
    //    override it.
    let Some(src) = &gen.script else {
        // 7. No script: the rule verdict, else the default.
        let d = rule_decision.unwrap_or_else(|| Decision::new(FORMAL, DecidedBy::Default));
        return (d, None);
    };
    let rule_ctx = match verdict {
        rules::Verdict::Rule { name, lane } => script::RuleCtx {
            lane: Some(lane),
            name: Some(name),
        },
        rules::Verdict::Fallback(lane) => script::RuleCtx {
            lane: Some(lane),
            name: None,
        },
        _ => script::RuleCtx::default(),
    };
    let (result, edited) = script::call_with(src, &gen.lists, req, rule_ctx);
    (script_decision(result, rule_decision), edited)
}

/// The decision a trusted tag header stands for.
fn trusted_tag(v: &HeaderValue) -> Decision {
    let tag = v.to_str().unwrap_or("");
    if valid_lane(tag) {
        return Decision::new(tag.to_string(), DecidedBy::TrustedTag);
    }
    log_limited(
        &INVALID_LOG,
        || tracing::warn!(tag = %String::from_utf8_lossy(v.as_bytes()), "invalid lane in trusted tag header; using formal"),
    );
    Decision::new(FORMAL, DecidedBy::InvalidLane(lossy(v.as_bytes()).into()))
}

/// The decision a trusted proxy's baggage lane member stands for (none
/// without one, or when the header has a problem: malformed baggage is
/// ignored, never a failure).
fn trusted_baggage(req: &RequestInfo, key: &str) -> Option<Decision> {
    let headers = &req.parts.headers;
    if !headers.contains_key(BAGGAGE) {
        return None;
    }
    match crate::base::baggage::parse(headers.get_all(BAGGAGE).iter(), key).lane_member() {
        crate::base::baggage::LaneMember::Absent => None,
        crate::base::baggage::LaneMember::Value(v) if valid_lane(&v) => {
            Some(Decision::new(v, DecidedBy::TrustedBaggage))
        }
        crate::base::baggage::LaneMember::Value(v) => {
            log_limited(
                &INVALID_LOG,
                || tracing::warn!(lane = %v.escape_debug(), "invalid lane in a trusted baggage member; using formal"),
            );
            Some(Decision::new(FORMAL, DecidedBy::InvalidLane(v)))
        }
    }
}

/// The decision a rule verdict stands for (none when rules are off).
fn rule_verdict(verdict: &rules::Verdict) -> Option<Decision> {
    match verdict {
        rules::Verdict::Deny(name) => Some(Decision::new(FORMAL, DecidedBy::Deny(name.clone()))),
        rules::Verdict::Disabled => None,
        rules::Verdict::Rule { name, lane } => {
            Some(Decision::new(lane, DecidedBy::Rule(name.clone())))
        }
        rules::Verdict::Fallback(lane) => Some(Decision::new(lane, DecidedBy::RuleFallback)),
    }
}

/// The decision a script's result stands for: nil keeps the rule verdict
/// (formal when there are no rules); a failure or an invalid name is
/// formal.
fn script_decision(
    result: Result<Option<String>, script::ScriptError>,
    rule_decision: Option<Decision>,
) -> Decision {
    match result {
        Ok(None) => rule_decision.unwrap_or_else(|| Decision::new(FORMAL, DecidedBy::Script)),
        Ok(Some(lane)) if valid_lane(&lane) => Decision::new(lane, DecidedBy::Script),
        Ok(Some(lane)) => {
            log_limited(
                &INVALID_LOG,
                || tracing::warn!(lane = %lane.escape_debug(), "script returned an invalid lane name; using formal"),
            );
            Decision::new(FORMAL, DecidedBy::InvalidLane(lane))
        }
        Err(e) => {
            match e.limit {
                Some(limit) => log_limited(
                    if limit == script::Limit::Memory {
                        &MEMORY_LOG
                    } else {
                        &BUDGET_LOG
                    },
                    || {
                        tracing::error!(
                            error = %e.message,
                            limit = if limit == script::Limit::Memory { "script_limits.memory_limit" } else { "script_limits.instruction_budget" },
                            "lane script stopped by a sandbox limit; request goes formal"
                        )
                    },
                ),
                None => log_limited(
                    &SCRIPT_ERR_LOG,
                    || tracing::error!(error = %e.message, "lane script failed; request goes formal"),
                ),
            }
            Decision::new(FORMAL, DecidedBy::ScriptError(e.message))
        }
    }
}

fn lossy(b: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(b)
}

static SCRIPT_ERR_LOG: AtomicU64 = AtomicU64::new(0);
static INVALID_LOG: AtomicU64 = AtomicU64::new(0);
static BUDGET_LOG: AtomicU64 = AtomicU64::new(0);
static MEMORY_LOG: AtomicU64 = AtomicU64::new(0);
