//! Layer: control plane. The release controller: every release interval it
//! takes the per-lane counters (`observe::lanes`), judges gray against
//! formal — pass, fail, inconclusive (too few requests in either lane) or
//! error (no data) — records the decision with the values and thresholds
//! behind it, and steps, holds, promotes or rolls back. Only `fail` counts
//! toward the rollback threshold; `inconclusive` and `error` never move a
//! release by themselves. Admin actions (create, promote, pause, resume,
//! abort) go through the same state file, one change at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{load, state_path, weight};
use crate::config::release::{
    Analysis, AnalysisSpec, LaneFigures, Phase, ReleaseRecord, ReleaseSpec, ReleaseState,
};
use crate::config::FORMAL;
use crate::control::node_edit::write_atomic;
use crate::control::Gateway;
use crate::observe::lanes::LaneSnapshot;

/// Decisions kept per release (newest last).
const HISTORY: usize = 500;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where each release's current interval started.
struct Mark {
    at: Instant,
    gray: Option<LaneSnapshot>,
    formal: Option<LaneSnapshot>,
}

/// The controller's in-memory side (the durable side is the state file).
#[derive(Default)]
pub struct Runtime {
    marks: Mutex<HashMap<String, Mark>>,
    /// When the next interval ends (the state file is read only then).
    next_due: Mutex<Option<Instant>>,
    /// One change of the state file at a time (controller and admin).
    pub lock: tokio::sync::Mutex<()>,
}

/// What an action or the controller asks of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Promote,
    Pause,
    Resume,
    Abort,
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "promote" => Action::Promote,
            "pause" => Action::Pause,
            "resume" => Action::Resume,
            "abort" | "rollback" => Action::Abort,
            _ => return None,
        })
    }
}

/// Why an admin request was refused.
#[derive(Debug)]
pub enum Refused {
    NotFound(String),
    Conflict(String),
    Invalid(String),
}

fn figures(s: &Option<LaneSnapshot>) -> LaneFigures {
    let Some(s) = s else {
        return LaneFigures::default();
    };
    LaneFigures {
        requests: s.requests,
        errors: s.errors,
        error_rate_pct: if s.requests == 0 {
            0.0
        } else {
            100.0 * s.errors as f64 / s.requests as f64
        },
        p99_ms: s.quantile_ms(0.99),
    }
}

/// Judges one interval: the outcome and why.
pub fn judge(
    a: &AnalysisSpec,
    gray: &Option<LaneSnapshot>,
    formal: &Option<LaneSnapshot>,
) -> (&'static str, String) {
    let (Some(_), Some(_)) = (gray, formal) else {
        return ("error", "no data for a lane (not tracked)".into());
    };
    let (g, f) = (figures(gray), figures(formal));
    if g.requests < a.min_requests || f.requests < a.min_requests {
        return (
            "inconclusive",
            format!(
                "too few requests: gray {} / formal {} (minimum {} each)",
                g.requests, f.requests, a.min_requests
            ),
        );
    }
    let (Some(gp), Some(fp)) = (g.p99_ms, f.p99_ms) else {
        return ("error", "no latency data".into());
    };
    let mut why = Vec::new();
    if g.error_rate_pct > f.error_rate_pct + a.max_error_delta_pp {
        why.push(format!(
            "error rate {:.2}% > formal {:.2}% + {} pp",
            g.error_rate_pct, f.error_rate_pct, a.max_error_delta_pp
        ));
    }
    if gp > a.max_p99_ratio * fp {
        why.push(format!(
            "p99 {gp:.3} ms > {} × formal {fp:.3} ms",
            a.max_p99_ratio
        ));
    }
    if let Some(c) = a.max_error_rate_pct.filter(|c| g.error_rate_pct > *c) {
        why.push(format!(
            "error rate {:.2}% > ceiling {c}%",
            g.error_rate_pct
        ));
    }
    if let Some(c) = a.max_p99_ms.filter(|c| gp > *c) {
        why.push(format!("p99 {gp:.3} ms > ceiling {c} ms"));
    }
    if why.is_empty() {
        (
            "pass",
            format!(
                "error rate {:.2}% vs {:.2}%, p99 {gp:.3} vs {fp:.3} ms",
                g.error_rate_pct, f.error_rate_pct
            ),
        )
    } else {
        ("fail", why.join("; "))
    }
}

fn record(r: &mut ReleaseRecord, outcome: &str, reason: String, g: LaneFigures, f: LaneFigures) {
    let entry = Analysis {
        at: unix_ms(),
        step: r.state.step,
        weight: weight(r),
        outcome: outcome.to_string(),
        gray: g,
        formal: f,
        thresholds: r.spec.analysis.clone(),
        reason,
    };
    tracing::info!(
        release = %r.spec.name,
        step = entry.step,
        weight = entry.weight,
        outcome = %entry.outcome,
        gray_requests = entry.gray.requests,
        gray_error_pct = entry.gray.error_rate_pct,
        gray_p99_ms = entry.gray.p99_ms.unwrap_or(f64::NAN),
        formal_requests = entry.formal.requests,
        formal_error_pct = entry.formal.error_rate_pct,
        formal_p99_ms = entry.formal.p99_ms.unwrap_or(f64::NAN),
        reason = %entry.reason,
        "release decision"
    );
    r.state.history.push(entry);
    let excess = r.state.history.len().saturating_sub(HISTORY);
    r.state.history.drain(..excess);
}

fn note(r: &mut ReleaseRecord, outcome: &str, reason: impl Into<String>) {
    record(
        r,
        outcome,
        reason.into(),
        LaneFigures::default(),
        LaneFigures::default(),
    );
}

/// Calls a webhook with the release's situation: `Ok` on a 2xx in time.
async fn webhook(url: &str, r: &ReleaseRecord, event: &str) -> Result<(), String> {
    let body = serde_json::json!({
        "release": r.spec.name, "lane": r.spec.lane, "event": event,
        "step": r.state.step, "weight": weight(r), "phase": r.state.phase.as_str(),
    });
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .map_err(|e| format!("webhook {url}: {e}"))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let timeout = Duration::from_millis(r.spec.webhooks.timeout_ms);
    match tokio::time::timeout(timeout, client.request(req)).await {
        Err(_) => Err(format!("webhook {url} timed out")),
        Ok(Err(e)) => Err(format!("webhook {url}: {e}")),
        Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
        Ok(Ok(resp)) => Err(format!("webhook {url} answered {}", resp.status())),
    }
}

/// Moves a release that passed its step on: the next step, a manual gate,
/// or promotion — after the webhook, if any, agrees.
async fn advance(r: &mut ReleaseRecord) {
    let step = &r.spec.steps[r.state.step];
    if step.gate.as_deref() == Some("manual") && !r.state.awaiting_promote {
        r.state.awaiting_promote = true;
        r.state.phase = Phase::Paused;
        note(
            r,
            "pause",
            "manual gate: waiting for resume (next step) or promote",
        );
        return;
    }
    let last = r.state.step + 1 >= r.spec.steps.len();
    let hook = if last {
        r.spec.webhooks.confirm.clone()
    } else {
        r.spec.webhooks.before_step.clone()
    };
    if let Some(url) = hook {
        if let Err(e) = webhook(&url, r, if last { "confirm" } else { "before_step" }).await {
            note(r, "held", e);
            return;
        }
    }
    r.state.awaiting_promote = false;
    if last {
        r.state.phase = Phase::Promoted;
        note(r, "promote", "every step passed");
    } else {
        r.state.step += 1;
        r.state.step_started = unix_ms();
        r.state.step_passes = 0;
        note(r, "step", format!("step {} passed", r.state.step - 1));
    }
}

async fn roll_back(r: &mut ReleaseRecord, reason: String) {
    r.state.phase = Phase::RolledBack;
    r.state.awaiting_promote = false;
    note(r, "rollback", reason);
    if let Some(url) = r.spec.webhooks.rollback.clone() {
        if let Err(e) = webhook(&url, r, "rollback").await {
            tracing::warn!(release = %r.spec.name, error = %e, "rollback webhook failed");
        }
    }
}

/// Writes the state and reloads, so the change is live in one swap.
async fn commit(
    gw: &Arc<Gateway>,
    file: &crate::config::release::ReleasesFile,
) -> Result<(), String> {
    let gen = gw.current();
    let path = state_path(&gw.config_path, &gen.config);
    let text = serde_json::to_string_pretty(file).map_err(|e| e.to_string())?;
    write_atomic(&path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let g = gw.clone();
    match tokio::task::spawn_blocking(move || g.reload()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "release state written, but the reload was rejected: {e}"
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn publish(gw: &Gateway, file: &crate::config::release::ReleasesFile) {
    let m = &gw.plane.metrics;
    for r in &file.releases {
        let labels = [r.spec.name.as_str(), r.spec.lane.as_str()];
        m.release_step
            .with_label_values(&labels)
            .set(r.state.step as i64);
        m.release_weight.with_label_values(&labels).set(weight(r));
    }
}

/// One pass over every release: judge those whose interval is over.
pub async fn tick(gw: &Arc<Gateway>) {
    let due = *gw
        .releases
        .next_due
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if due.is_some_and(|d| Instant::now() < d) {
        return;
    }
    let _one = gw.releases.lock.lock().await;
    let gen = gw.current();
    let path = state_path(&gw.config_path, &gen.config);
    let Ok((mut file, _)) = load(&path) else {
        return;
    };
    let lanes = &gw.plane.metrics.lanes;
    let mut changed = false;
    // Nothing running: look again in a second (creation wakes it sooner).
    let mut next = Instant::now() + Duration::from_secs(1);
    for r in file.releases.iter_mut() {
        if r.state.phase != Phase::Progressing {
            continue;
        }
        let now = Instant::now();
        let interval = Duration::from_millis(r.spec.analysis.interval_ms);
        let (gray, formal) = (lanes.snapshot(&r.spec.lane), lanes.snapshot(FORMAL));
        let mark = {
            let mut marks = gw.releases.marks.lock().unwrap_or_else(|e| e.into_inner());
            match marks.get(&r.spec.name) {
                Some(m) if now.duration_since(m.at) < interval => {
                    next = next.min(m.at + interval);
                    continue;
                }
                Some(_) => marks.insert(
                    r.spec.name.clone(),
                    Mark {
                        at: now,
                        gray: gray.clone(),
                        formal: formal.clone(),
                    },
                ),
                None => {
                    marks.insert(
                        r.spec.name.clone(),
                        Mark {
                            at: now,
                            gray,
                            formal,
                        },
                    );
                    next = next.min(now + interval);
                    continue;
                }
            }
        };
        next = next.min(now + interval);
        let Some(mark) = mark else { continue };
        let delta = |now: &Option<LaneSnapshot>, then: &Option<LaneSnapshot>| match (now, then) {
            (Some(n), Some(t)) => Some(n.since(t)),
            _ => None,
        };
        let (dg, df) = (delta(&gray, &mark.gray), delta(&formal, &mark.formal));
        let (outcome, reason) = judge(&r.spec.analysis, &dg, &df);
        gw.plane
            .metrics
            .release_analyses
            .with_label_values(&[r.spec.name.as_str(), outcome])
            .inc();
        record(r, outcome, reason, figures(&dg), figures(&df));
        changed = true;
        match outcome {
            "pass" => {
                r.state.step_passes += 1;
                let min = r.spec.steps[r.state.step].min_duration_ms;
                if unix_ms().saturating_sub(r.state.step_started) >= min {
                    advance(r).await;
                }
            }
            "fail" => {
                r.state.failures += 1;
                if r.state.failures >= r.spec.analysis.failure_threshold {
                    let why = format!(
                        "{} failed intervals (threshold {})",
                        r.state.failures, r.spec.analysis.failure_threshold
                    );
                    roll_back(r, why).await;
                }
            }
            _ => {}
        }
    }
    if changed {
        if let Err(e) = commit(gw, &file).await {
            tracing::error!(error = %e, "release state not applied");
        }
        publish(gw, &file);
    }
    *gw.releases
        .next_due
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(next);
}

/// Makes the controller look at the state file at its next tick.
fn wake(gw: &Gateway) {
    *gw.releases
        .next_due
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = None;
}

/// Runs the controller until the process ends.
pub async fn run(gw: Arc<Gateway>) {
    if let Ok((file, _)) = load(&state_path(&gw.config_path, &gw.current().config)) {
        publish(&gw, &file);
    }
    let mut every = tokio::time::interval(Duration::from_millis(100));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        tick(&gw).await;
    }
}

/// Creates a release from its spec (YAML or JSON): validated like a reload
/// (the whole state must compile), then live at its first step.
pub async fn create(gw: &Arc<Gateway>, spec_text: &str) -> Result<ReleaseRecord, Refused> {
    let spec: ReleaseSpec = serde_yaml::from_str(spec_text)
        .map_err(|e| Refused::Invalid(format!("release spec: {e}")))?;
    super::check_spec(&spec).map_err(Refused::Invalid)?;
    let _one = gw.releases.lock.lock().await;
    let gen = gw.current();
    let path = state_path(&gw.config_path, &gen.config);
    let (mut file, _) = load(&path).map_err(|e| Refused::Conflict(e.to_string()))?;
    if file.releases.iter().any(|r| r.spec.name == spec.name) {
        return Err(Refused::Conflict(format!("release {:?} exists", spec.name)));
    }
    if let Some(r) = file
        .releases
        .iter()
        .find(|r| r.spec.lane == spec.lane && !r.state.phase.is_final())
    {
        return Err(Refused::Conflict(format!(
            "lane {:?} is already being released by {:?}",
            spec.lane, r.spec.name
        )));
    }
    let now = unix_ms();
    let mut rec = ReleaseRecord {
        spec,
        state: ReleaseState {
            phase: Phase::Progressing,
            step: 0,
            step_started: now,
            failures: 0,
            step_passes: 0,
            awaiting_promote: false,
            created: now,
            history: Vec::new(),
        },
    };
    note(&mut rec, "step", "created: first step applied");
    file.releases.push(rec.clone());
    super::compile(&file, &path, "", &gen.lane.lists)
        .map_err(|e| Refused::Invalid(e.to_string()))?;
    commit(gw, &file).await.map_err(Refused::Conflict)?;
    publish(gw, &file);
    wake(gw);
    Ok(rec)
}

/// Applies an operator's action.
pub async fn act(gw: &Arc<Gateway>, name: &str, action: Action) -> Result<ReleaseRecord, Refused> {
    let _one = gw.releases.lock.lock().await;
    let gen = gw.current();
    let path = state_path(&gw.config_path, &gen.config);
    let (mut file, _) = load(&path).map_err(|e| Refused::Conflict(e.to_string()))?;
    let r = file
        .releases
        .iter_mut()
        .find(|r| r.spec.name == name)
        .ok_or_else(|| Refused::NotFound(format!("no release {name:?}")))?;
    if r.state.phase.is_final() {
        return Err(Refused::Conflict(format!(
            "release {name:?} is {} and never moves again",
            r.state.phase.as_str()
        )));
    }
    match action {
        Action::Promote => {
            r.state.phase = Phase::Promoted;
            r.state.awaiting_promote = false;
            note(r, "promote", "promoted by the operator");
        }
        Action::Pause => {
            r.state.phase = Phase::Paused;
            note(r, "pause", "paused by the operator");
        }
        Action::Resume => {
            r.state.phase = Phase::Progressing;
            if r.state.awaiting_promote {
                // Past a manual gate: on to the next step (or promotion).
                advance(r).await;
            } else {
                note(r, "resume", "resumed by the operator");
            }
        }
        Action::Abort => roll_back(r, "aborted by the operator".into()).await,
    }
    let out = r.clone();
    gw.releases
        .marks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(name);
    commit(gw, &file).await.map_err(Refused::Conflict)?;
    publish(gw, &file);
    wake(gw);
    Ok(out)
}

/// Every release (spec and state).
pub fn list(gw: &Gateway) -> Vec<ReleaseRecord> {
    load(&state_path(&gw.config_path, &gw.current().config))
        .map(|(f, _)| f.releases)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(requests: u64, errors: u64, ms: f64) -> Option<LaneSnapshot> {
        let mut buckets = vec![0; crate::observe::lanes::BUCKETS];
        let i = (0..buckets.len())
            .find(|i| crate::observe::lanes::bucket_upper_us(*i) >= ms * 1000.0)
            .unwrap();
        buckets[i] = requests;
        Some(LaneSnapshot {
            requests,
            errors,
            buckets,
        })
    }

    #[test]
    fn four_outcomes_with_their_reasons() {
        let a = AnalysisSpec {
            min_requests: 50,
            ..Default::default()
        };
        assert_eq!(
            judge(&a, &snap(10, 0, 1.0), &snap(500, 0, 1.0)).0,
            "inconclusive"
        );
        assert_eq!(judge(&a, &None, &snap(500, 0, 1.0)).0, "error");
        assert_eq!(judge(&a, &snap(100, 0, 1.0), &snap(500, 0, 1.0)).0, "pass");
        // 5% errors against 0%: fail, and the reason says so.
        let (o, why) = judge(&a, &snap(100, 5, 1.0), &snap(500, 0, 1.0));
        assert_eq!(o, "fail");
        assert!(why.contains("error rate 5.00%"), "{why}");
        // 0.4 pp more errors is within 0.5 pp.
        assert_eq!(
            judge(&a, &snap(1000, 4, 1.0), &snap(1000, 0, 1.0)).0,
            "pass"
        );
        // p99 1.3× formal's fails, 1.1× passes — below a millisecond too.
        assert_eq!(judge(&a, &snap(100, 0, 0.65), &snap(100, 0, 0.5)).0, "fail");
        assert_eq!(judge(&a, &snap(100, 0, 0.55), &snap(100, 0, 0.5)).0, "pass");
    }
}
