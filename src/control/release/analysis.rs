//! Layer: control plane. The judgement of one window of traffic: gray
//! against formal, on errors and on the p99 latency, each check `pass`,
//! `fail` or undecided. The release controller and the dashboard's canary
//! panel both judge through [`judge`], on the fine per-lane histogram
//! (`observe::lanes`).
//!
//! The rule, in plain words:
//!
//! - **Sample minimums.** A check needs ten requests of the kind it is
//!   about in each lane: the p99 needs ten requests above it, so 1000
//!   requests per lane ([`min_latency_sample`]; `quantile: 0.9` needs 100); an error-rate margin of
//!   `max_error_delta_pp` needs ten errors at that rate, so 2000 requests
//!   per lane at 0.5 pp ([`min_error_sample`]). `min_requests` is a floor
//!   under both. Below them a check can still fail on a clear margin
//!   (errors), but never pass.
//! - **Fail only on evidence.** Errors fail when the lower 99.5 % confidence
//!   bound of gray's excess error rate (Agresti–Caffo two-proportion
//!   interval) is above `max_error_delta_pp`. Latency fails when the lower
//!   99.5 % bound of gray's p99 is above `max_p99_ratio` × the upper 99.5 %
//!   bound of formal's (distribution-free bounds from the order statistics)
//!   and above it by more than `min_p99_delta_ms`.
//! - **Pass on the estimate.** With its sample minimum met, a check passes
//!   when the measured value is within the threshold (a p99 difference of
//!   at most `min_p99_delta_ms` always is).
//! - Otherwise the check is undecided and the window is `inconclusive`: the
//!   controller keeps it open and adds the next interval to it, until it
//!   decides.

use crate::config::release::AnalysisSpec;
use crate::observe::lanes::{bucket_lower_us, bucket_upper_us, LaneSnapshot};

/// One-sided 99.5 % normal quantile: each confidence bound.
pub const Z: f64 = 2.576;
/// Requests "of the kind a check is about" each lane needs.
pub const EVENTS: f64 = 10.0;

/// Requests per lane the latency check needs: ten above its quantile
/// (1000 for the p99).
pub fn min_latency_sample(a: &AnalysisSpec) -> u64 {
    (EVENTS / (1.0 - a.quantile.clamp(0.0, 0.9999))).round() as u64
}

/// Requests per lane the error check needs: ten errors at the margin.
pub fn min_error_sample(a: &AnalysisSpec) -> u64 {
    let margin = (a.max_error_delta_pp / 100.0).max(1e-6);
    (EVENTS / margin).ceil() as u64
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

/// A window's judgement.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// `pass`, `fail`, `inconclusive` or `error`.
    pub outcome: &'static str,
    pub reason: String,
    /// `None`: not judged (no data).
    pub errors: Option<Check>,
    pub latency: Option<Check>,
}

impl Judgement {
    fn error(reason: &str) -> Judgement {
        Judgement {
            outcome: "error",
            reason: reason.into(),
            errors: None,
            latency: None,
        }
    }
}

/// Judges a window: gray's and formal's figures over the same time.
pub fn judge(
    a: &AnalysisSpec,
    gray: Option<&LaneSnapshot>,
    formal: Option<&LaneSnapshot>,
) -> Judgement {
    let (Some(g), Some(f)) = (gray, formal) else {
        return Judgement::error("no data for a lane (not tracked)");
    };
    if g.requests < a.min_requests || f.requests < a.min_requests {
        return Judgement {
            outcome: "inconclusive",
            reason: format!(
                "too few requests: gray {} / formal {} (minimum {} each)",
                g.requests, f.requests, a.min_requests
            ),
            errors: Some(Check::Undecided),
            latency: Some(Check::Undecided),
        };
    }
    let (errors, why_e) = error_check(a, g, f);
    let (latency, why_l) = latency_check(a, g, f);
    let outcome = match (errors, latency) {
        (Check::Fail, _) | (_, Check::Fail) => "fail",
        (Check::Pass, Check::Pass) => "pass",
        _ => "inconclusive",
    };
    Judgement {
        outcome,
        reason: format!(
            "errors {}: {why_e}; p{} {}: {why_l}",
            errors.as_str(),
            (a.quantile * 1000.0).round() / 10.0,
            latency.as_str()
        ),
        errors: Some(errors),
        latency: Some(latency),
    }
}

/// A rate with one success and one failure added (Agresti–Caffo): never 0
/// or 1, so a lane without errors still has an uncertainty.
fn adjusted(x: u64, n: u64) -> (f64, f64) {
    let p = (x as f64 + 1.0) / (n as f64 + 2.0);
    (p, p * (1.0 - p) / (n as f64 + 2.0))
}

fn error_check(a: &AnalysisSpec, g: &LaneSnapshot, f: &LaneSnapshot) -> (Check, String) {
    let rate = |s: &LaneSnapshot| s.errors as f64 / s.requests.max(1) as f64;
    let (rg, rf) = (rate(g), rate(f));
    let (pg, vg) = adjusted(g.errors, g.requests);
    let (pf, vf) = adjusted(f.errors, f.requests);
    let margin = a.max_error_delta_pp / 100.0;
    let excess_low = pg - pf - Z * (vg + vf).sqrt();
    let gray_low = pg - Z * vg.sqrt();
    let need = min_error_sample(a).max(a.min_requests);
    let shown = format!("error rate {:.2}% vs formal {:.2}%", 100.0 * rg, 100.0 * rf);
    if excess_low > margin {
        return (
            Check::Fail,
            format!(
                "{shown}: gray's excess is at least {:.2} pp (99.5 % bound) > {} pp",
                100.0 * excess_low,
                a.max_error_delta_pp
            ),
        );
    }
    if let Some(c) = a.max_error_rate_pct.filter(|c| 100.0 * gray_low > *c) {
        return (
            Check::Fail,
            format!(
                "{shown}: gray's rate is at least {:.2}% (99.5 % bound) > ceiling {c}%",
                100.0 * gray_low
            ),
        );
    }
    if g.requests < need || f.requests < need {
        return (
            Check::Undecided,
            format!(
                "{shown}, too few requests to pass: gray {} / formal {} (needs {need} each: 10 errors at {} pp)",
                g.requests, f.requests, a.max_error_delta_pp
            ),
        );
    }
    let within_ceiling = a.max_error_rate_pct.is_none_or(|c| 100.0 * rg <= c);
    if rg - rf <= margin + 1e-12 && within_ceiling {
        (
            Check::Pass,
            format!("{shown}, within {} pp", a.max_error_delta_pp),
        )
    } else {
        (
            Check::Undecided,
            format!("{shown}: above the margin, not yet beyond its confidence bound"),
        )
    }
}

/// The value (ms) at `rank` (from 1) of a histogram: the lower or the
/// upper edge of its bucket; `None` past the last observation.
fn at_rank(s: &LaneSnapshot, rank: f64, upper: bool) -> Option<f64> {
    let i = s.bucket_of_rank(rank.max(1.0) as u64)?;
    Some(
        if upper {
            bucket_upper_us(i)
        } else {
            bucket_lower_us(i)
        } / 1000.0,
    )
}

/// The 99.5 % lower and upper bounds (ms) of a lane's p99 from its order
/// statistics: ranks n·q ∓ z·√(n·q·(1−q)) (the normal approximation of
/// the binomial count below the quantile). The upper is `None` when the
/// sample has no rank that high.
fn p99_bounds(s: &LaneSnapshot, n: u64, q: f64) -> (f64, Option<f64>) {
    let n = n as f64;
    let (m, sd) = (n * q, Z * (n * q * (1.0 - q)).sqrt());
    let low = at_rank(s, (m - sd).floor(), false).unwrap_or(0.0);
    let hi_rank = (m + sd).ceil() + 1.0;
    let high = (hi_rank <= n).then(|| at_rank(s, hi_rank, true)).flatten();
    (low, high)
}

fn latency_check(a: &AnalysisSpec, g: &LaneSnapshot, f: &LaneSnapshot) -> (Check, String) {
    let (ng, nf) = (g.buckets.iter().sum::<u64>(), f.buckets.iter().sum::<u64>());
    let need = min_latency_sample(a).max(a.min_requests);
    let q = a.quantile;
    let name = format!("p{}", (q * 1000.0).round() / 10.0);
    let (Some(pg), Some(pf)) = (g.quantile_ms(q), f.quantile_ms(q)) else {
        return (Check::Undecided, "no latency data".into());
    };
    let shown = format!("{pg:.3} ms vs formal {pf:.3} ms");
    if ng < need || nf < need {
        return (
            Check::Undecided,
            format!(
                "{shown}, too few requests: gray {ng} / formal {nf} (needs {need} each: 10 above the quantile)"
            ),
        );
    }
    let (g_low, _) = p99_bounds(g, ng, q);
    let (_, f_high) = p99_bounds(f, nf, q);
    let floor = a.min_p99_delta_ms;
    if let Some(fh) = f_high {
        if g_low > a.max_p99_ratio * fh && g_low - fh > floor {
            return (
                Check::Fail,
                format!(
                    "{shown}: gray's {name} ≥ {g_low:.3} ms > {} × formal's ≤ {fh:.3} ms (99.5 % bounds), by more than {floor} ms",
                    a.max_p99_ratio
                ),
            );
        }
    }
    if let Some(c) = a.max_p99_ms.filter(|c| g_low > *c) {
        return (
            Check::Fail,
            format!("{shown}: gray's {name} ≥ {g_low:.3} ms (99.5 % bound) > ceiling {c} ms"),
        );
    }
    let within = pg <= a.max_p99_ratio * pf + 1e-9 || pg - pf <= floor + 1e-9;
    let within_ceiling = a.max_p99_ms.is_none_or(|c| pg <= c);
    if within && within_ceiling {
        (
            Check::Pass,
            format!("{shown}, within {} × or {floor} ms", a.max_p99_ratio),
        )
    } else {
        (
            Check::Undecided,
            format!("{shown}: above the threshold, not beyond its confidence bounds"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::lanes::BUCKETS;

    /// A lane of `requests` answers, `errors` of them 5xx, `slow` of them
    /// taking `slow_ms` and the rest `ms`.
    fn lane(requests: u64, errors: u64, ms: f64, slow: u64, slow_ms: f64) -> LaneSnapshot {
        let mut buckets = vec![0; BUCKETS];
        let at = |ms: f64| {
            (0..BUCKETS)
                .find(|i| bucket_upper_us(*i) >= ms * 1000.0)
                .unwrap()
        };
        buckets[at(ms)] += requests - slow;
        buckets[at(slow_ms)] += slow;
        LaneSnapshot {
            requests,
            errors,
            buckets,
        }
    }

    fn outcome(a: &AnalysisSpec, g: &LaneSnapshot, f: &LaneSnapshot) -> &'static str {
        judge(a, Some(g), Some(f)).outcome
    }

    #[test]
    fn sample_minimums() {
        let a = AnalysisSpec::default();
        assert_eq!(min_latency_sample(&a), 1000);
        let median = AnalysisSpec {
            quantile: 0.5,
            ..Default::default()
        };
        assert_eq!(min_latency_sample(&median), 20);
        assert_eq!(min_error_sample(&a), 2000);
        // Healthy and equal, but 999 requests: the p99 has too thin a tail.
        let (g, f) = (lane(999, 0, 1.0, 0, 1.0), lane(5000, 0, 1.0, 0, 1.0));
        let j = judge(&a, Some(&g), Some(&f));
        assert_eq!(j.outcome, "inconclusive", "{j:?}");
        assert!(j.reason.contains("10 above the quantile"), "{}", j.reason);
        let g = lane(2000, 0, 1.0, 0, 1.0);
        assert_eq!(outcome(&a, &g, &f), "pass");
    }

    #[test]
    fn a_tail_of_a_few_requests_never_fails() {
        let a = AnalysisSpec::default();
        // Gray's 12 slowest of 1000 at 5 ms, formal's 10 of 1000: the
        // estimates differ 5×, the bounds overlap.
        let g = lane(1000, 0, 1.0, 12, 5.0);
        let f = lane(2000, 0, 1.0, 19, 1.0);
        assert_ne!(outcome(&a, &g, &f), "fail");
        // An 8× slower gray fails at the sample minimum.
        let g = lane(1000, 0, 8.0, 0, 8.0);
        let f = lane(2000, 0, 1.0, 20, 3.0);
        let j = judge(&a, Some(&g), Some(&f));
        assert_eq!((j.outcome, j.latency), ("fail", Some(Check::Fail)), "{j:?}");
        // Under the absolute floor nothing fails.
        let g = lane(5000, 0, 0.4, 0, 0.4);
        let f = lane(5000, 0, 0.1, 0, 0.1);
        assert_eq!(outcome(&a, &g, &f), "pass");
    }

    #[test]
    fn errors_fail_on_evidence_and_pass_on_the_estimate() {
        let a = AnalysisSpec::default();
        // +1 pp over 3000 requests: beyond the bound.
        let j = judge(
            &a,
            Some(&lane(3000, 30, 1.0, 0, 1.0)),
            Some(&lane(3000, 0, 1.0, 0, 1.0)),
        );
        assert_eq!((j.outcome, j.errors), ("fail", Some(Check::Fail)), "{j:?}");
        // +1 pp over 1000: not yet, and not a pass either.
        let j = judge(
            &a,
            Some(&lane(1000, 10, 1.0, 0, 1.0)),
            Some(&lane(1000, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "inconclusive", "{j:?}");
        // 5 % over 300: clear at once.
        let j = judge(
            &a,
            Some(&lane(300, 15, 1.0, 0, 1.0)),
            Some(&lane(300, 0, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "fail", "{j:?}");
        // +0.3 pp over 4000: within the margin.
        let j = judge(
            &a,
            Some(&lane(4000, 16, 1.0, 0, 1.0)),
            Some(&lane(4000, 4, 1.0, 0, 1.0)),
        );
        assert_eq!(j.outcome, "pass", "{j:?}");
        assert_eq!(
            judge(&a, None, Some(&lane(10, 0, 1.0, 0, 1.0))).outcome,
            "error"
        );
    }
}
