//! Layer: control plane. The judgement of a release step: gray against
//! formal on everything both lanes served since the step began, on errors
//! and on latency, each check `pass`, `fail` or undecided. The release
//! controller and the dashboard's canary panel both judge through
//! [`judge`], on the fine per-lane histogram (`observe::lanes`).
//!
//! The rule, in plain words (the guide states it for operators):
//!
//! - **Errors: one sequential test of the difference.** Errors fail when
//!   the evidence rejects "gray's error rate is at most formal's +
//!   `max_error_delta_pp`" (`rejects`). For every rate r formal might
//!   have, gray's e-process against "gray ≤ r + margin" times formal's
//!   against "formal ≥ r"; the test takes the smallest product over all
//!   r (certified, not sampled: each factor is monotone in r) and fails
//!   at 1/α. Each lane's e-process is an equal-weight mixture of Bernoulli
//!   likelihood ratios over steps of the log odds (`tilts`: from 4 ×
//!   the margin, the smallest step the margin can need, up to 16), a
//!   nonnegative supermartingale under any rate on its null side; at the
//!   true rates the product is one (each request moves one lane's
//!   factor), and the smallest product is at most it, so by Ville's
//!   inequality a healthy gray fails at some look with probability at
//!   most α: looking every interval costs nothing. The likelihoods are
//!   exact: a formal without errors has evidence only as strong as its
//!   requests make it (kayenta#799), no normal approximation.
//! - **Assumption.** There is one rate r with formal's chance of an
//!   error at least r and gray's at most r + margin at every request,
//!   given everything before it (independent requests at a rate constant
//!   over the step are the ordinary case), and which lane serves a
//!   request does not depend on whether it will fail.
//! - **Latency: anytime-valid bounds.** The share of formal below a
//!   latency and the share of gray above one are bounded by a confidence
//!   sequence: the Beta(½, ½) mixture of Bernoulli likelihood ratios
//!   ([`upper`], [`lower`]), a nonnegative martingale under the true rate
//!   (Ville's inequality again).
//! - **Latency fails** when, at the judged quantile q or a lower level
//!   (0.9, 0.5), more than the share 1 − level of gray's requests is
//!   certainly above max(`max_p99_ratio` × formal's level, formal's
//!   level + `min_p99_delta_ms`), formal's level taken at its upper
//!   bound: an 8× slower gray fails on the median after a few dozen
//!   requests, long before formal's p99 can be bounded.
//! - **The budget.** [`ALPHA`] (1 %) over the whole release: split evenly
//!   over its judged steps, then between the two checks ([`ERROR_SHARE`],
//!   ¾, to errors: latency's large effects need little), then over
//!   latency's bounds (union bound; errors spend theirs on the one test,
//!   or ¾ of it when `max_error_rate_pct` adds a ceiling test). So a
//!   healthy gray is rolled back with probability at most 1 % however
//!   long the release runs and however often it is looked at (each start
//!   of a step's sequence — a restart, a new fleet leader, an operator's
//!   action — spends the step's share again).
//! - **Pass on enough evidence.** Errors pass when the mirror test
//!   rejects "gray's rate is at least formal's + `max_error_delta_pp`" at
//!   [`PASS_LEVEL`] (90 %): gray's excess is within the margin. Latency
//!   passes when the estimate is within the threshold and the sample
//!   could have caught a gray [`DETECT_FACTOR`] times the threshold's
//!   ratio slower (`max_p99_ratio`, or more where
//!   `min_p99_delta_ms` dominates a fast formal). Every judgement states
//!   the smallest error-rate rise and latency ratio its sample could have
//!   detected.
//! - Otherwise the check is undecided and the step's sample stays open.

use crate::config::release::AnalysisSpec;
use crate::observe::lanes::{bucket_lower_us, bucket_upper_us, LaneSnapshot};

/// The chance of rolling back a healthy gray, over a whole release.
pub const ALPHA: f64 = 0.01;
/// The chance of a pass on the error rate of a gray whose rise is beyond
/// `max_error_delta_pp`: the pass test is at 90 %.
pub const PASS_LEVEL: f64 = 0.1;
/// A latency pass needs a sample that would have caught a gray this many
/// times `max_p99_ratio` slower.
pub const DETECT_FACTOR: f64 = 2.0;
/// The error check's share of a step's α; latency has the rest.
pub const ERROR_SHARE: f64 = 0.75;
/// The latency bounds' mixture prior: Beta(½, ½).
const PRIOR: f64 = 0.5;

/// ln Γ(x), x > 0 (Lanczos, g = 7).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

fn ln_beta(a: f64, b: f64) -> f64 {
    ln_gamma(a) + ln_gamma(b) - ln_gamma(a + b)
}

/// ln of the mixture likelihood ratio against a rate `p`, after `x`
/// events in `n` trials.
fn ln_evidence(x: f64, n: f64, p: f64) -> f64 {
    let mix = ln_beta(PRIOR + x, PRIOR + n - x) - ln_beta(PRIOR, PRIOR);
    let ll =
        if x > 0.0 { x * p.ln() } else { 0.0 } + if n > x { (n - x) * (1.0 - p).ln() } else { 0.0 };
    mix - ll
}

/// The anytime-valid upper bound of a rate after `x` events in `n`:
/// every rate above it has evidence against it of at least 1/`alpha`.
pub fn upper(x: u64, n: u64, alpha: f64) -> f64 {
    if n == 0 || x >= n {
        return 1.0;
    }
    let (x, n, need) = (x as f64, n as f64, (1.0 / alpha).ln());
    let (mut lo, mut hi) = (x / n, 1.0);
    for _ in 0..50 {
        let mid = 0.5 * (lo + hi);
        if ln_evidence(x, n, mid) >= need {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// The anytime-valid lower bound of a rate after `x` events in `n`.
pub fn lower(x: u64, n: u64, alpha: f64) -> f64 {
    if x == 0 {
        return 0.0;
    }
    1.0 - upper(n - x.min(n), n, alpha)
}

/// Whether the lower bound of a rate after `x` events in `n` is above `p`
/// (what `lower(x, n, alpha) > p` says, without the search: the evidence
/// falls toward the estimate, so the bound is above `p` exactly when the
/// estimate is and the evidence against `p` is enough).
pub fn certainly_above(x: u64, n: u64, p: f64, alpha: f64) -> bool {
    n > 0
        && ((p <= 0.0 && x > 0)
            || ((x as f64 / n as f64) > p
                && ln_evidence(x as f64, n as f64, p) >= (1.0 / alpha).ln()))
}

/// The α of one judged step of a release of `spec`'s steps (every step
/// but a last one of weight 100 is judged).
pub fn step_alpha(judged_steps: usize) -> f64 {
    ALPHA / judged_steps.max(1) as f64
}

/// Kept for the dashboard: the requests per lane a healthy gray without
/// errors needs, against a formal without errors, for the error check to
/// pass.
pub fn min_error_sample(a: &AnalysisSpec) -> u64 {
    let margin = (a.max_error_delta_pp / 100.0).max(1e-6);
    let t = tilts(margin);
    let passes = |n: u64| {
        rejects(
            &t,
            (0.0, n as f64),
            (0.0, n as f64),
            margin,
            false,
            PASS_LEVEL,
        )
    };
    let (mut lo, mut hi) = (1u64, 1u64 << 40);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if passes(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo.max(a.min_requests)
}

/// Kept for the dashboard: the floor on looking.
pub fn min_latency_sample(a: &AnalysisSpec) -> u64 {
    a.min_requests
}

/// One check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    Pass,
    Fail,
    Undecided,
}

impl Check {
    pub fn as_str(self) -> &'static str {
        match self {
            Check::Pass => "pass",
            Check::Fail => "fail",
            Check::Undecided => "inconclusive",
        }
    }
}

/// A judgement.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// `pass`, `fail`, `inconclusive` or `error`.
    pub outcome: &'static str,
    pub reason: String,
    /// `None`: not judged (no data).
    pub errors: Option<Check>,
    pub latency: Option<Check>,
    /// The smallest rise of gray's error rate over formal's (percentage
    /// points) this sample would have failed; `None`: none yet.
    pub detectable_error_rise_pp: Option<f64>,
    /// The smallest slowdown (gray = this × formal's latencies) this
    /// sample would have failed; `None`: none yet.
    pub detectable_latency_ratio: Option<f64>,
}

impl Judgement {
    fn bare(outcome: &'static str, reason: String) -> Judgement {
        Judgement {
            outcome,
            reason,
            errors: None,
            latency: None,
            detectable_error_rise_pp: None,
            detectable_latency_ratio: None,
        }
    }
}

/// Judges one look with the whole budget (a single look, as the
/// dashboard's canary panel takes).
pub fn judge(
    a: &AnalysisSpec,
    gray: Option<&LaneSnapshot>,
    formal: Option<&LaneSnapshot>,
) -> Judgement {
    judge_step(a, gray, formal, ALPHA)
}

/// Judges a step's sample (everything since the step began) with the
/// step's share `alpha` of the release's budget ([`step_alpha`]).
pub fn judge_step(
    a: &AnalysisSpec,
    gray: Option<&LaneSnapshot>,
    formal: Option<&LaneSnapshot>,
    alpha: f64,
) -> Judgement {
    decide(a, gray, formal, alpha, true)
}

/// [`judge_step`], the detectable effects computed only when `detect`
/// (the simulation benchmark skips them).
pub fn decide(
    a: &AnalysisSpec,
    gray: Option<&LaneSnapshot>,
    formal: Option<&LaneSnapshot>,
    alpha: f64,
    detect: bool,
) -> Judgement {
    let (Some(g), Some(f)) = (gray, formal) else {
        return Judgement::bare("error", "no data for a lane (not tracked)".into());
    };
    if f.requests == 0 && g.requests > 0 {
        return Judgement::bare(
            "error",
            format!(
                "formal has no traffic (gray {}): nothing to judge gray against — is formal served on the release's routes?",
                g.requests
            ),
        );
    }
    if g.requests < a.min_requests.max(1) || f.requests < a.min_requests.max(1) {
        return Judgement {
            errors: Some(Check::Undecided),
            latency: Some(Check::Undecided),
            ..Judgement::bare(
                "inconclusive",
                format!(
                    "too few requests: gray {} / formal {} (minimum {} each)",
                    g.requests,
                    f.requests,
                    a.min_requests.max(1)
                ),
            )
        };
    }
    let (errors, why_e, rise) = error_check(a, g, f, alpha * ERROR_SHARE, detect);
    let (latency, why_l, ratio) = latency_check(a, g, f, alpha * (1.0 - ERROR_SHARE), detect);
    let outcome = match (errors, latency) {
        (Check::Fail, _) | (_, Check::Fail) => "fail",
        (Check::Pass, Check::Pass) => "pass",
        _ => "inconclusive",
    };
    let shown = |v: Option<f64>, unit: &str| match v {
        Some(v) => format!("{v:.2}{unit}"),
        None => "none yet".into(),
    };
    let detectable = if detect {
        format!(
            "; detectable: +{} errors, {} latency",
            shown(rise, " pp"),
            shown(ratio, "×")
        )
    } else {
        String::new()
    };
    Judgement {
        outcome,
        reason: format!(
            "errors {}: {why_e}; p{} {}: {why_l}{detectable}",
            errors.as_str(),
            (a.quantile * 1000.0).round() / 10.0,
            latency.as_str()
        ),
        errors: Some(errors),
        latency: Some(latency),
        detectable_error_rise_pp: rise,
        detectable_latency_ratio: ratio,
    }
}

/// The error test's mixture: steps λ of the natural parameter (the log
/// odds, logit(p′) − logit(p)), from the smallest a margin `d` can need
/// (4·d: a rise of the whole margin at a rate of 50 %, where the log
/// odds move slowest) up by [`TILT_RATIO`] to [`TILT_MAX`] (a rate of
/// 0.5 % tilted to 99.99 %), each of the same weight.
fn tilts(d: f64) -> Vec<f64> {
    let min = (4.0 * d).clamp(1e-4, 1.0);
    std::iter::successors(Some(min), |t| Some(t * TILT_RATIO))
        .take_while(|t| *t <= TILT_MAX)
        .collect()
}

const TILT_MAX: f64 = 16.0;
const TILT_RATIO: f64 = 1.1;

/// ln of the one-sided mixture e-process of a lane with `x` errors in
/// `n` against its rate being at most `p` (`up`: alternatives above `p`)
/// or at least `p` (`!up`: alternatives below). Each term is the
/// likelihood ratio of Bernoulli(p′) to Bernoulli(p), p′ = p tilted by a
/// step λ of the log odds: exp(±λx − n ln(1 − p + p e^{±λ})). Under any
/// rate on the null side each term's expected factor per request is at
/// most 1, so the mixture ([`AT_REST`] on λ = 0, the rest in equal
/// parts) is a nonnegative supermartingale, never below [`AT_REST`].
/// Decreasing in `p` when `up`, increasing when not.
fn ln_tilted(tilts: &[f64], x: f64, n: f64, p: f64, up: bool) -> f64 {
    let p = p.clamp(0.0, 1.0);
    let s = if up { 1.0 } else { -1.0 };
    let terms = tilts
        .iter()
        .map(|t| s * t * x - n * (p * (s * t).exp_m1()).ln_1p());
    let mut top = f64::NEG_INFINITY;
    let mut sum = 0.0;
    for v in terms {
        if v > top {
            sum = sum * (top - v).exp() + 1.0;
            top = v;
        } else {
            sum += (v - top).exp();
        }
    }
    // [`AT_REST`] of the weight on λ = 0 (the factor 1): a lane whose own
    // data says nothing about `p` costs the other lane ln 8, never more.
    let w = (1.0 - AT_REST) / tilts.len() as f64;
    let (a, b) = (top + (sum * w).ln(), AT_REST.ln());
    a.max(b) + (-(a - b).abs()).exp().ln_1p()
}

/// The share of each lane's error mixture on no tilt at all.
const AT_REST: f64 = 0.125;

/// Whether `dec(r) + inc(r) ≥ need` for every `r` in `[r0, r1]`, `dec`
/// non-increasing and `inc` non-decreasing: on an interval the sum is at
/// least `dec(hi) + inc(lo)`, refined where that is not enough. `probe`
/// is tried first (where the sum is likely smallest: most answers are a
/// quick no). `false` when it cannot tell within its budget of
/// evaluations (the safe side).
fn everywhere_above(
    dec: impl Fn(f64) -> f64,
    inc: impl Fn(f64) -> f64,
    [r0, r1, probe]: [f64; 3],
    need: f64,
) -> bool {
    // A point: r and (dec(r), inc(r)).
    type Point = (f64, (f64, f64));
    if r1 < r0 {
        return false;
    }
    let eval = |r: f64| (dec(r), inc(r));
    let p = eval(probe.clamp(r0, r1));
    if p.0 + p.1 < need {
        return false;
    }
    // Seeds: r0, and r0 + (r1 − r0) / 4^k, finest first.
    let mut pts: Vec<Point> = Vec::with_capacity(16);
    for k in (0..=13).rev() {
        let r = if k == 13 {
            r0
        } else {
            r0 + (r1 - r0) / (1u64 << (2 * k)) as f64
        };
        let v = eval(r);
        if v.0 + v.1 < need {
            return false;
        }
        pts.push((r, v));
    }
    let mut todo: Vec<(Point, Point)> = pts
        .windows(2)
        .map(|w| (w[0], w[1]))
        .filter(|(lo, hi)| hi.1 .0 + lo.1 .1 < need)
        .collect();
    let mut budget = 400;
    while let Some((lo, hi)) = todo.pop() {
        budget -= 1;
        // Halved in ratio where the interval spans scales, else in width.
        let m = if lo.0 > r0 && hi.0 > 2.0 * lo.0 {
            (lo.0 * hi.0).sqrt()
        } else {
            0.5 * (lo.0 + hi.0)
        };
        if budget == 0 || !(lo.0 < m && m < hi.0) {
            return false;
        }
        let v = eval(m);
        if v.0 + v.1 < need {
            return false;
        }
        let mid = (m, v);
        for (a, b) in [(lo, mid), (mid, hi)] {
            if b.1 .0 + a.1 .1 < need {
                todo.push((a, b));
            }
        }
    }
    true
}

/// Errors of a lane: (errors, requests).
type Count = (f64, f64);

/// Whether the evidence rejects "gray's error rate − formal's ≤ `d`"
/// (`above`) or "≥ `d`" (`!above`) at `alpha`, at every look at once.
///
/// The test: for each rate r formal might have, gray's e-process against
/// r + `d` (gray at most that when `above`) times formal's against r
/// (formal at least r); the null is rejected when the smallest product
/// over all r reaches 1/`alpha`. Under the null, the product at the true
/// rates is a nonnegative supermartingale (each request moves one lane's
/// factor), and the smallest product is at most it: by Ville's
/// inequality it ever reaches 1/`alpha` with probability at most `alpha`.
fn rejects(t: &[f64], g: Count, f: Count, d: f64, above: bool, alpha: f64) -> bool {
    let (rg, rf) = (g.0 / g.1.max(1.0), f.0 / f.1.max(1.0));
    // At formal's own estimate both factors are at most 1.
    if (above && rg - rf <= d) || (!above && rg - rf >= d) {
        return false;
    }
    let need = (1.0 / alpha).ln();
    let (r0, r1) = ((-d).max(0.0), (1.0 - d).min(1.0));
    if above {
        everywhere_above(
            |r| ln_tilted(t, g.0, g.1, r + d, true),
            |r| ln_tilted(t, f.0, f.1, r, false),
            [r0, r1, rf],
            need,
        )
    } else {
        everywhere_above(
            |r| ln_tilted(t, f.0, f.1, r, true),
            |r| ln_tilted(t, g.0, g.1, r + d, false),
            [r0, r1, rf],
            need,
        )
    }
}

/// The bound of gray's excess over formal (rate difference) at `alpha`:
/// the largest `d` rejected from above (`lower`), or the smallest from
/// below.
fn excess_bound(t: &[f64], g: Count, f: Count, alpha: f64, lower: bool) -> f64 {
    let est = g.0 / g.1.max(1.0) - f.0 / f.1.max(1.0);
    // lower: rejected below the bound b, not from b; upper: not up to b,
    // then rejected.
    // To within 0.01 pp: 2^-14 of the widest bracket.
    let (mut lo, mut hi) = if lower {
        (est - 1.0, est)
    } else {
        (est, est + 1.0)
    };
    for _ in 0..14 {
        let mid = 0.5 * (lo + hi);
        if rejects(t, g, f, mid, lower, alpha) == lower {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if lower {
        lo
    } else {
        hi
    }
}

/// The error check with its share `alpha`: the verdict, why, and the
/// smallest rise (pp) that would have failed.
fn error_check(
    a: &AnalysisSpec,
    g: &LaneSnapshot,
    f: &LaneSnapshot,
    alpha: f64,
    detect: bool,
) -> (Check, String, Option<f64>) {
    let count = |s: &LaneSnapshot| (s.errors as f64, s.requests as f64);
    let (cg, cf) = (count(g), count(f));
    let (rg, rf) = (cg.0 / cg.1.max(1.0), cf.0 / cf.1.max(1.0));
    let margin = a.max_error_delta_pp / 100.0;
    // A ceiling is one more test: it takes a quarter of the share.
    let (each, ceiling_alpha) = match a.max_error_rate_pct {
        Some(_) => (alpha * 0.75, alpha * 0.25),
        None => (alpha, 0.0),
    };
    let t = tilts(margin);
    let fails = |x: u64| rejects(&t, (x as f64, cg.1), cf, margin, true, each);
    let rise = detect
        .then(|| {
            // The fewest gray errors that fail, as a rise over formal's rate.
            let (mut lo, mut hi) = (0u64, g.requests);
            if !fails(hi) {
                return None;
            }
            while lo < hi {
                let mid = (lo + hi) / 2;
                if fails(mid) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            Some(100.0 * (lo as f64 / g.requests as f64 - rf).max(0.0))
        })
        .flatten();
    let shown = format!("error rate {:.2}% vs formal {:.2}%", 100.0 * rg, 100.0 * rf);
    let pct = |v: f64| format!("{:.2}", 100.0 * v);
    if fails(g.errors) {
        let why = if detect {
            format!(
                "gray's excess is at least {} pp > {} pp",
                pct(excess_bound(&t, cg, cf, each, true)),
                a.max_error_delta_pp
            )
        } else {
            format!(
                "gray's excess is certainly above {} pp",
                a.max_error_delta_pp
            )
        };
        return (Check::Fail, format!("{shown}: {why}"), rise);
    }
    if let Some(c) = a.max_error_rate_pct {
        let need = (1.0 / ceiling_alpha).ln();
        if rg > c / 100.0 && ln_tilted(&t, cg.0, cg.1, c / 100.0, true) >= need {
            return (
                Check::Fail,
                format!("{shown}: gray's rate is certainly above the ceiling {c}%"),
                rise,
            );
        }
    }
    let within_ceiling = a.max_error_rate_pct.is_none_or(|c| 100.0 * rg <= c);
    let passes = rejects(&t, cg, cf, margin, false, PASS_LEVEL) && within_ceiling;
    // The bound shown is the mirror test's: the smallest excess it rejects.
    let high = detect.then(|| pct(excess_bound(&t, cg, cf, PASS_LEVEL, false)));
    let m = a.max_error_delta_pp;
    let why = match (passes, high) {
        (true, Some(h)) => format!("gray's excess is at most {h} pp (90 %), within {m} pp"),
        (true, None) => format!("gray's excess is within {m} pp (90 %)"),
        (false, Some(h)) => format!("gray's excess could still be up to {h} pp (90 %) > {m} pp"),
        (false, None) => format!("gray's excess could still be above {m} pp (90 %)"),
    };
    let check = if passes {
        Check::Pass
    } else {
        Check::Undecided
    };
    (check, format!("{shown}: {why}"), rise)
}

/// The levels latency is judged at: the configured quantile, and 0.9 and
/// the median below it.
fn levels(q: f64) -> Vec<f64> {
    let mut l: Vec<f64> = [0.5, 0.9].into_iter().filter(|l| *l < q - 1e-9).collect();
    l.push(q);
    l
}

/// Requests of a lane whose latency is certainly above `ms`: those in
/// buckets starting at or above it.
fn above(s: &LaneSnapshot, ms: f64) -> u64 {
    let us = ms * 1000.0;
    s.buckets
        .iter()
        .enumerate()
        .filter(|(i, _)| bucket_lower_us(*i) >= us)
        .map(|(_, n)| n)
        .sum()
}

/// An anytime-valid upper bound (ms) of formal's `level` quantile: the
/// smallest bucket edge with at least that share certainly at or below
/// it; `None` while the sample cannot tell.
fn quantile_upper(s: &LaneSnapshot, n: u64, level: f64, alpha: f64) -> Option<f64> {
    let mut seen = 0;
    for (i, c) in s.buckets.iter().enumerate() {
        seen += c;
        if *c > 0 && certainly_above(seen, n, level, alpha) {
            return Some(bucket_upper_us(i) / 1000.0);
        }
    }
    None
}

/// An anytime-valid lower bound (ms) of a lane's `level` quantile: the
/// highest bucket edge with more than `1 − level` of the sample certainly
/// at or above it; `None` while the sample cannot tell.
fn quantile_lower(s: &LaneSnapshot, n: u64, level: f64, alpha: f64) -> Option<f64> {
    let mut seen = 0;
    for (i, c) in s.buckets.iter().enumerate().rev() {
        seen += c;
        if *c > 0 && certainly_above(seen, n, 1.0 - level, alpha) {
            return Some(bucket_lower_us(i) / 1000.0);
        }
    }
    None
}

fn latency_check(
    a: &AnalysisSpec,
    g: &LaneSnapshot,
    f: &LaneSnapshot,
    alpha: f64,
    detect: bool,
) -> (Check, String, Option<f64>) {
    let (ng, nf) = (g.buckets.iter().sum::<u64>(), f.buckets.iter().sum::<u64>());
    let q = a.quantile;
    let name = |l: f64| format!("p{}", (l * 1000.0).round() / 10.0);
    let (Some(pg), Some(pf)) = (g.quantile_ms(q), f.quantile_ms(q)) else {
        return (Check::Undecided, "no latency data".into(), None);
    };
    let shown = format!("{pg:.3} ms vs formal {pf:.3} ms");
    let lv = levels(q);
    let shares = lv.len() + usize::from(a.max_p99_ms.is_some());
    // Per level: half for formal's quantile bound, half for gray's share.
    let each = alpha / shares as f64 / 2.0;
    let floor = a.min_p99_delta_ms;
    let threshold = |fq: f64| (a.max_p99_ratio * fq).max(fq + floor);
    let bounds: Vec<(f64, f64)> = lv
        .iter()
        .filter_map(|l| quantile_upper(f, nf, *l, each).map(|fq| (*l, threshold(fq))))
        .collect();
    let fails_at = |l: f64, x: u64| certainly_above(x, ng, 1.0 - l, each);
    // The gray the sample must be able to catch: DETECT_FACTOR times the
    // threshold's own ratio, which the absolute floor raises for a fast
    // formal (0.1 ms and +0.5 ms: a gray 6× slower is still within).
    let target = DETECT_FACTOR * (threshold(pf) / pf.max(1e-9)).max(a.max_p99_ratio);
    // The smallest k for which gray = k × formal would fail now: formal's
    // share above t / k stands for gray's share above t.
    let ratio = detect
        .then(|| {
            let fails = |k: f64| {
                bounds.iter().any(|(l, t)| {
                    let share = above(f, t / k) as f64 / nf.max(1) as f64;
                    fails_at(*l, (share * ng as f64).floor() as u64)
                })
            };
            // Searched up to well past the target, so a coarse
            // `max_p99_ratio` (1000 to judge on errors alone) can pass.
            let (mut lo, mut hi) = (1.0f64, (4.0 * target).max(1000.0));
            if !fails(hi) {
                return None;
            }
            for _ in 0..30 {
                let mid = (lo * hi).sqrt();
                if fails(mid) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            Some(hi)
        })
        .flatten();
    for (l, t) in &bounds {
        let x = above(g, *t);
        if fails_at(*l, x) {
            return (
                Check::Fail,
                format!(
                    "{shown}: at least {:.1} % of gray's requests are above {t:.3} ms ({} × or +{floor} ms over formal's {} bound), more than {:.1} %",
                    100.0 * lower(x, ng, each),
                    a.max_p99_ratio,
                    name(*l),
                    100.0 * (1.0 - l)
                ),
                ratio,
            );
        }
    }
    if let Some(c) = a.max_p99_ms {
        let x = above(g, c);
        if certainly_above(x, ng, 1.0 - q, each) {
            return (
                Check::Fail,
                format!(
                    "{shown}: at least {:.1} % of gray's requests are above the ceiling {c} ms",
                    100.0 * lower(x, ng, each)
                ),
                ratio,
            );
        }
    }
    let within = pg <= a.max_p99_ratio * pf + 1e-9 || pg - pf <= floor + 1e-9;
    let within_ceiling = a.max_p99_ms.is_none_or(|c| pg <= c);
    // Enough evidence: the sample would have caught a gray `target` ×
    // slower, or it rules one out directly (gray's quantile is certainly
    // below `target` × formal's; the way through for a heavy-tailed
    // formal, whose sparse tail makes a shifted copy hard to tell apart).
    let ruled_out = || {
        let gu = quantile_upper(g, ng, q, each);
        let fl = quantile_lower(f, nf, q, each);
        matches!((gu, fl), (Some(gu), Some(fl)) if gu <= target * fl)
    };
    let enough = ratio.is_some_and(|r| r <= target) || ruled_out();
    if within && within_ceiling && enough {
        (
            Check::Pass,
            format!("{shown}, within {} × or {floor} ms", a.max_p99_ratio),
            ratio,
        )
    } else if within && within_ceiling {
        (
            Check::Undecided,
            format!(
                "{shown}, within {} × or {floor} ms, but too few requests to have caught a gray {:.1}× slower",
                a.max_p99_ratio, target
            ),
            ratio,
        )
    } else {
        (
            Check::Undecided,
            format!("{shown}: above the threshold, not beyond its confidence bounds"),
            ratio,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::lanes::{bucket_of, BUCKETS};
    use std::time::Duration;

    /// A lane of `requests` answers, `errors` of them 5xx, `slow` of them
    /// taking `slow_ms` and the rest `ms`.
    fn lane(requests: u64, errors: u64, ms: f64, slow: u64, slow_ms: f64) -> LaneSnapshot {
        let mut buckets = vec![0; BUCKETS];
        let at = |ms: f64| bucket_of(Duration::from_secs_f64(ms / 1000.0));
        buckets[at(ms)] += requests - slow;
        buckets[at(slow_ms)] += slow;
        LaneSnapshot {
            requests,
            errors,
            buckets,
        }
    }

    /// A deterministic generator (xorshift) and realistic latencies:
    /// lognormal around `median_ms`, one request in 50 from a Pareto tail.
    struct Rng(u64);
    impl Rng {
        fn unit(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn latency_ms(&mut self, median_ms: f64) -> f64 {
            if self.unit() < 0.02 {
                return median_ms * 3.0 * self.unit().powf(-1.0 / 1.5);
            }
            let z =
                (-2.0 * self.unit().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.unit()).cos();
            median_ms * (0.4 * z).exp()
        }
    }

    fn sampled(rng: &mut Rng, n: u64, error_rate: f64, median_ms: f64) -> LaneSnapshot {
        let mut s = lane(0, 0, 1.0, 0, 1.0);
        for _ in 0..n {
            s.requests += 1;
            s.errors += u64::from(rng.unit() < error_rate);
            let ms = rng.latency_ms(median_ms);
            s.buckets[bucket_of(Duration::from_secs_f64(ms / 1000.0))] += 1;
        }
        s
    }

    #[test]
    fn the_bounds_are_the_mixture_boundaries() {
        // No event in n: the upper bound shrinks like ln(1/α)/n.
        let u = upper(0, 1000, 0.01);
        assert!((0.004..0.01).contains(&u), "{u}");
        assert_eq!(lower(0, 1000, 0.01), 0.0);
        // Symmetric, ordered, and around the estimate.
        let (l, u) = (lower(50, 1000, 0.01), upper(50, 1000, 0.01));
        assert!(l < 0.05 && 0.05 < u, "{l} {u}");
        assert!((lower(950, 1000, 0.01) - (1.0 - u)).abs() < 1e-9);
        // A smaller α is a wider bound.
        assert!(upper(50, 1000, 0.001) > u);
        // The shortcut agrees with the search.
        for (x, n, p) in [
            (50, 1000, 0.02),
            (50, 1000, l - 1e-6),
            (50, 1000, l + 1e-6),
            (3, 10, 0.01),
        ] {
            assert_eq!(
                certainly_above(x, n, p, 0.01),
                lower(x, n, 0.01) > p,
                "{x} {n} {p}"
            );
        }
        // ln Γ against known values.
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-10);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-10);
    }

    #[test]
    fn a_confidence_sequence_holds_at_every_look() {
        // 400 streams of 2000 Bernoulli(1 %) draws, looked at after every
        // draw: either bound at α = 5 % is crossed in at most 10 % of
        // them (usually far fewer: Ville's inequality is conservative).
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut crossed = 0;
        for _ in 0..400 {
            let mut x = 0;
            for n in 1..=2000u64 {
                x += u64::from(rng.unit() < 0.01);
                // lower > 1 % or upper < 1 %, without the searches.
                if certainly_above(x, n, 0.01, 0.05) || certainly_above(n - x, n, 0.99, 0.05) {
                    crossed += 1;
                    break;
                }
            }
        }
        assert!(crossed <= 40, "{crossed} of 400");
    }

    #[test]
    fn an_eight_times_slower_gray_fails_on_a_few_dozen_requests() {
        let a = AnalysisSpec::default();
        let mut rng = Rng(7);
        let f = sampled(&mut rng, 150, 0.0, 5.0);
        let g = sampled(&mut rng, 40, 0.0, 40.0);
        let j = judge_step(&a, Some(&g), Some(&f), step_alpha(5));
        assert_eq!((j.outcome, j.latency), ("fail", Some(Check::Fail)), "{j:?}");
        assert!(j.reason.contains("p50 bound"), "{}", j.reason);
        // An identical gray on 25 requests: neither fails nor passes (so
        // few cannot tell a 2.4× slower gray).
        let g = sampled(&mut rng, 25, 0.0, 5.0);
        let j = judge_step(&a, Some(&g), Some(&f), step_alpha(5));
        assert_eq!(j.latency, Some(Check::Undecided), "{j:?}");
        assert!(j.detectable_latency_ratio.is_some(), "{j:?}");
    }

    #[test]
    fn a_coarse_latency_ratio_passes_on_an_ordinary_sample() {
        // `max_p99_ratio: 1000` judges on errors alone: identical lanes
        // pass latency instead of waiting for a sample that could catch a
        // gray 2000× slower beyond the searched range.
        let a = AnalysisSpec {
            max_p99_ratio: 1000.0,
            ..Default::default()
        };
        let mut rng = Rng(11);
        let f = sampled(&mut rng, 2000, 0.0, 5.0);
        let g = sampled(&mut rng, 2000, 0.0, 5.0);
        let j = judge_step(&a, Some(&g), Some(&f), step_alpha(5));
        assert_eq!(j.latency, Some(Check::Pass), "{j:?}");
        assert!(
            j.detectable_latency_ratio.is_some_and(|r| r > 1000.0),
            "{j:?}"
        );
    }

    #[test]
    fn errors_fail_on_evidence_even_against_a_formal_without_errors() {
        let a = AnalysisSpec::default();
        // 0.1 % → 5.1 %: 25 errors in 500 against none in 2000.
        let j = judge(
            &a,
            Some(&lane(500, 25, 1.0, 0, 1.0)),
            Some(&lane(2000, 0, 1.0, 0, 1.0)),
        );
        assert_eq!((j.outcome, j.errors), ("fail", Some(Check::Fail)), "{j:?}");
        assert!(j.reason.contains("excess is at least"), "{}", j.reason);
        // +1 pp over 1000: not yet, and not a pass either.
        let j = judge(
            &a,
            Some(&lane(1000, 10, 1.0, 0, 1.0)),
            Some(&lane(1000, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.errors, Some(Check::Undecided), "{j:?}");
        // +1 pp over 8000 each: failed (a fixed-sample test would have
        // at 3000: the price of looking at will).
        let j = judge(
            &a,
            Some(&lane(8000, 88, 1.0, 0, 1.0)),
            Some(&lane(8000, 8, 1.0, 0, 1.0)),
        );
        assert_eq!(j.errors, Some(Check::Fail), "{j:?}");
        // +0.1 pp over 10000: the pass bound is within 0.5 pp.
        let j = judge(
            &a,
            Some(&lane(10000, 12, 1.0, 0, 1.0)),
            Some(&lane(10000, 2, 1.0, 0, 1.0)),
        );
        assert_eq!(j.errors, Some(Check::Pass), "{j:?}");
        assert!(j.reason.contains("(90 %), within 0.5 pp"), "{}", j.reason);
        // A coarse margin passes on a small sample.
        let coarse = AnalysisSpec {
            max_error_delta_pp: 5.0,
            ..Default::default()
        };
        let j = judge(
            &coarse,
            Some(&lane(150, 0, 1.0, 0, 1.0)),
            Some(&lane(600, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.errors, Some(Check::Pass), "{j:?}");
        let rise = j.detectable_error_rise_pp.unwrap();
        assert!(rise > 5.0 && rise < 20.0, "{j:?}");
        // A ceiling fails a gray certainly above it.
        let capped = AnalysisSpec {
            max_error_delta_pp: 50.0,
            max_error_rate_pct: Some(1.0),
            ..Default::default()
        };
        let j = judge(
            &capped,
            Some(&lane(2000, 60, 1.0, 0, 1.0)),
            Some(&lane(2000, 50, 1.0, 0, 1.0)),
        );
        assert_eq!(j.errors, Some(Check::Fail), "{j:?}");
        assert!(j.reason.contains("above the ceiling 1%"), "{}", j.reason);
    }

    #[test]
    fn a_small_step_passes_against_a_formal_with_nine_times_its_traffic() {
        // A 10 % step: formal's sample dwarfs gray's, and neither has an
        // error. Formal's own data says nothing about a high rate; it may
        // not drown gray's evidence there.
        let a = AnalysisSpec {
            max_error_delta_pp: 5.0,
            ..AnalysisSpec::default()
        };
        for (ng, nf) in [(300, 2_700), (2_925, 24_532), (10_000, 200_000)] {
            let j = judge_step(
                &a,
                Some(&lane(ng, 0, 1.0, 0, 1.0)),
                Some(&lane(nf, 0, 1.0, 0, 1.0)),
                step_alpha(2),
            );
            assert_eq!(j.errors, Some(Check::Pass), "{ng} vs {nf}: {j:?}");
        }
        let t = tilts(0.05);
        let high = excess_bound(&t, (0.0, 2_925.0), (0.0, 24_532.0), PASS_LEVEL, false);
        assert!(high < 0.005, "{high}");
    }

    #[test]
    fn a_formal_without_errors_is_not_over_trusted() {
        // Kayenta#799: formal at 0 errors. A few gray errors on a tiny
        // sample are not evidence of a 0.5 pp rise...
        let a = AnalysisSpec::default();
        for (gx, n) in [(1, 20), (2, 30), (3, 50), (2, 100)] {
            let j = judge_step(
                &a,
                Some(&lane(n, gx, 1.0, 0, 1.0)),
                Some(&lane(n, 0, 1.0, 0, 1.0)),
                step_alpha(5),
            );
            assert_ne!(j.errors, Some(Check::Fail), "{gx} of {n}: {j:?}");
        }
        // ...but a gray at 10 % against that formal fails on evidence, on
        // a couple of hundred requests, and the detectable rise says so.
        let first = (10..=1000u64)
            .step_by(10)
            .find(|n| {
                let j = judge_step(
                    &a,
                    Some(&lane(*n, n / 10, 1.0, 0, 1.0)),
                    Some(&lane(*n, 0, 1.0, 0, 1.0)),
                    step_alpha(5),
                );
                j.errors == Some(Check::Fail)
            })
            .expect("fails");
        assert!((60..=300).contains(&first), "{first}");
        let j = judge_step(
            &a,
            Some(&lane(first, first / 10, 1.0, 0, 1.0)),
            Some(&lane(first, 0, 1.0, 0, 1.0)),
            step_alpha(5),
        );
        assert!(
            j.detectable_error_rise_pp.is_some_and(|r| r <= 10.0),
            "{j:?}"
        );
    }

    #[test]
    fn the_error_test_holds_at_every_look_at_the_edge_of_its_null() {
        // Gray exactly `d` above formal — the hardest healthy gray — at a
        // few formal rates, 0 included; looked at every 10 requests of
        // each lane up to 1500: the fail test at α = 5 % and the pass
        // test (its mirror) at 10 % each cross in at most their α of the
        // streams (Ville's inequality; usually far fewer).
        let d = 0.005;
        let t = tilts(d);
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for pf in [0.0, 0.001, 0.02] {
            let (mut failed, mut passed) = (0, 0);
            let streams = 200;
            for _ in 0..streams {
                let (mut g, mut f) = ((0.0, 0.0), (0.0, 0.0));
                let (mut fail_seen, mut pass_seen) = (false, false);
                for i in 1..=1500 {
                    g.1 += 1.0;
                    g.0 += f64::from(u8::from(rng.unit() < pf + d));
                    f.1 += 1.0;
                    f.0 += f64::from(u8::from(rng.unit() < pf));
                    if i % 10 == 0 {
                        fail_seen |= rejects(&t, g, f, d, true, 0.05);
                        pass_seen |= rejects(&t, g, f, d, false, 0.1);
                    }
                }
                failed += usize::from(fail_seen);
                passed += usize::from(pass_seen);
            }
            assert!(failed <= streams / 20, "formal {pf}: {failed} of {streams}");
            assert!(passed <= streams / 10, "formal {pf}: {passed} of {streams}");
        }
    }

    #[test]
    fn the_error_test_is_monotone_and_its_bounds_bracket_the_estimate() {
        let t = tilts(0.005);
        // The lane factors move the way the certification relies on.
        for up in [true, false] {
            let v: Vec<f64> = [0.0, 0.001, 0.01, 0.1, 0.5, 0.99]
                .iter()
                .map(|p| ln_tilted(&t, 7.0, 900.0, *p, up))
                .collect();
            assert!(
                v.windows(2)
                    .all(|w| if up { w[1] <= w[0] } else { w[1] >= w[0] }),
                "{up} {v:?}"
            );
        }
        let (g, f) = ((40.0, 2000.0), (10.0, 3000.0));
        let est = 0.02 - 1.0 / 300.0;
        let (lo, hi) = (
            excess_bound(&t, g, f, 0.01, true),
            excess_bound(&t, g, f, 0.01, false),
        );
        assert!(lo < est && est < hi, "{lo} {est} {hi}");
        assert!(rejects(&t, g, f, lo - 1e-4, true, 0.01));
        assert!(!rejects(&t, g, f, lo + 1e-4, true, 0.01));
        // The dashboard's pass sample at the default margin.
        let n = min_error_sample(&AnalysisSpec::default());
        assert!((600..=900).contains(&n), "{n}");
    }

    #[test]
    fn min_requests_is_a_floor_as_written_and_formal_without_traffic_is_an_error() {
        let a = AnalysisSpec {
            min_requests: 7,
            ..Default::default()
        };
        let j = judge(
            &a,
            Some(&lane(6, 6, 50.0, 0, 1.0)),
            Some(&lane(100, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "inconclusive", "{j:?}");
        assert!(j.reason.contains("minimum 7 each"), "{}", j.reason);
        // At the floor, the same clear regression fails.
        let j = judge(
            &a,
            Some(&lane(7, 7, 50.0, 0, 1.0)),
            Some(&lane(100, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "fail", "{j:?}");
        let j = judge(
            &a,
            Some(&lane(50, 0, 1.0, 0, 1.0)),
            Some(&lane(0, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "error", "{j:?}");
        assert!(j.reason.contains("formal has no traffic"), "{}", j.reason);
        assert_eq!(
            judge(&a, None, Some(&lane(10, 0, 1.0, 0, 1.0))).outcome,
            "error"
        );
    }

    #[test]
    fn a_tail_of_a_few_requests_never_fails_and_a_small_difference_never_does() {
        let a = AnalysisSpec::default();
        // Gray's 12 slowest of 1000 at 5 ms, formal's 10 of 2000.
        let g = lane(1000, 0, 1.0, 12, 5.0);
        let f = lane(2000, 0, 1.0, 19, 1.0);
        assert_ne!(judge(&a, Some(&g), Some(&f)).outcome, "fail");
        // Under the absolute floor nothing fails, and enough passes.
        let g = lane(5000, 0, 0.4, 0, 0.4);
        let f = lane(5000, 0, 0.1, 0, 0.1);
        let j = judge(&a, Some(&g), Some(&f));
        assert_eq!(j.outcome, "pass", "{j:?}");
    }

    #[test]
    fn identical_lanes_looked_at_often_rarely_fail() {
        // 200 releases of 5 steps, 3000 requests a step in each lane,
        // looked at every 100: at most a few false failures in 200 (the
        // budget is 1 % of releases; the benchmark runs 1000).
        let a = AnalysisSpec::default();
        let mut rng = Rng(42);
        let mut failed = 0;
        for _ in 0..200 {
            'release: for _ in 0..5 {
                let mut g = lane(0, 0, 1.0, 0, 1.0);
                let mut f = lane(0, 0, 1.0, 0, 1.0);
                for _ in 0..30 {
                    let dg = sampled(&mut rng, 100, 0.001, 2.0);
                    let df = sampled(&mut rng, 100, 0.001, 2.0);
                    for (s, d) in [(&mut g, dg), (&mut f, df)] {
                        s.requests += d.requests;
                        s.errors += d.errors;
                        s.buckets
                            .iter_mut()
                            .zip(d.buckets)
                            .for_each(|(b, n)| *b += n);
                    }
                    if decide(&a, Some(&g), Some(&f), step_alpha(5), false).outcome == "fail" {
                        failed += 1;
                        break 'release;
                    }
                }
            }
        }
        assert!(failed <= 4, "{failed} of 200 releases failed");
    }
}
