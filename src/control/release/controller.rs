//! Layer: control plane. The release controller: every release interval it
//! takes the per-lane counters (`observe::lanes`), judges gray against
//! formal on everything both served since the step began (`super::analysis`,
//! a sequential test valid at every look) — pass, fail, inconclusive (too
//! few requests, or undecided) or error (no data, formal without traffic,
//! or a lane nothing serves) —
//! records the decision with the values and thresholds behind it, and
//! steps, holds, promotes or rolls back. Only `fail` counts toward the
//! rollback threshold (in a row by default: a pass resets the count);
//! `inconclusive` and `error` never move a release by themselves. Admin actions (create, promote, pause, resume,
//! abort) go through the same state file, one change at a time. With a
//! store that shares release state (`source::Store::shared_releases`: etcd)
//! the state is the fleet's instead: the elected gateway ticks and judges
//! on every gateway's summed counters, any gateway applies an admin action
//! by compare-and-swap (`source::SharedReleases`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::analysis;
use super::{load, weight};
use crate::config::release::{
    Analysis, FailureCount, LaneFigures, Phase, ReleaseRecord, ReleaseSpec, ReleaseState,
    ReleasesFile,
};
use crate::config::FORMAL;
use crate::control::node_edit::{self, write_atomic};
use crate::control::source::{self as fleet, Guard, Leadership, Sample, SharedReleases};
use crate::control::Gateway;
use crate::observe::lanes::LaneSnapshot;

/// Decisions kept per release (newest last).
const HISTORY: usize = 500;
/// Decisions kept per release in etcd (the whole record is one value,
/// rewritten at every decision).
const FLEET_HISTORY: usize = 100;
/// Compare-and-swap attempts of an admin action before giving up.
const CAS_TRIES: usize = 5;

/// The release state the fleet shares through its store, if it does (else
/// this gateway's state file).
fn shared(gw: &Gateway) -> Option<SharedReleases> {
    gw.store.as_ref().and_then(|s| s.shared_releases())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where each release's current interval and window started: the window
/// (`sample`, `at_unix`) stays open over intervals until it decides.
struct Mark {
    /// The current interval's start.
    at: Instant,
    /// The window's start and the counters then.
    at_unix: u64,
    sample: Sample,
    /// Intervals in the window so far.
    intervals: u32,
    /// In a fleet: the release key's mod revision the interval belongs to
    /// (another writer's change starts a new interval).
    rev: i64,
}

/// The controller's in-memory side (the durable side is the state file).
#[derive(Default)]
pub struct Runtime {
    marks: Mutex<HashMap<String, Mark>>,
    /// When the next interval ends (the state file is read only then).
    next_due: Mutex<Option<Instant>>,
    /// One change of the state file at a time (controller and admin).
    pub lock: tokio::sync::Mutex<()>,
    /// In a fleet: the election as this gateway sees it.
    pub fleet: Mutex<Leadership>,
    /// The last state written (files).
    quiet: Mutex<Option<Quiet>>,
}

/// The release state the controller wrote last: the text the file watcher
/// recognises as the controller's own write (never a reason to reload:
/// the controller reloads itself when what routes changed), and, written
/// without a reload, what `list` shows while the generation it was
/// written under serves.
struct Quiet {
    generation: u64,
    path: std::path::PathBuf,
    text: String,
    records: Vec<ReleaseRecord>,
}

impl Runtime {
    /// The state file and the text the controller last wrote.
    pub fn quiet_file(&self) -> Option<(std::path::PathBuf, String)> {
        let q = self.quiet.lock().unwrap_or_else(|e| e.into_inner());
        q.as_ref().map(|q| (q.path.clone(), q.text.clone()))
    }

    fn quiet_records(&self, generation: u64) -> Option<Vec<ReleaseRecord>> {
        let q = self.quiet.lock().unwrap_or_else(|e| e.into_inner());
        q.as_ref()
            .filter(|q| q.generation == generation)
            .map(|q| q.records.clone())
    }
}

/// What an action or the controller asks of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Promote,
    Pause,
    Resume,
    Abort,
    /// Ends a promoted or rolled-back release; with `relabel_nodes` (node
    /// files only) a promoted lane's nodes become formal and the old
    /// formal nodes of its services drain, in the same swap.
    Finish {
        relabel_nodes: bool,
    },
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "promote" => Action::Promote,
            "pause" => Action::Pause,
            "resume" => Action::Resume,
            "abort" | "rollback" => Action::Abort,
            "finish" => Action::Finish {
                relabel_nodes: false,
            },
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
    /// The store cannot be reached (etcd down): nothing changed.
    Unavailable(String),
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

fn record(
    r: &mut ReleaseRecord,
    outcome: &str,
    reason: String,
    (g, f): (LaneFigures, LaneFigures),
    gateways: Option<usize>,
    (rise_pp, ratio): (Option<f64>, Option<f64>),
) {
    let entry = Analysis {
        at: unix_ms(),
        step: r.state.step,
        weight: weight(r),
        outcome: outcome.to_string(),
        gray: g,
        formal: f,
        thresholds: r.spec.analysis.clone(),
        reason,
        gateways,
        detectable_error_rise_pp: rise_pp,
        detectable_latency_ratio: ratio,
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
        gateways = entry.gateways.unwrap_or(1),
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
        Default::default(),
        None,
        (None, None),
    );
}

/// Calls a webhook with the release's situation: `Ok` on a 2xx in time.
async fn webhook(url: &str, r: &ReleaseRecord, event: &str) -> Result<(), String> {
    let body = serde_json::json!({
        "release": r.spec.name, "lane": r.spec.lane, "event": event,
        "step": r.state.step, "weight": weight(r), "phase": r.state.phase.as_str(),
    });
    let timeout = Duration::from_millis(r.spec.webhooks.timeout_ms);
    match tokio::time::timeout(timeout, post_json(url, body.to_string(), timeout)).await {
        Err(_) => Err(format!("webhook {url} timed out")),
        Ok(Err(e)) => Err(format!("webhook {url}: {e}")),
        Ok(Ok(status)) if status.is_success() => Ok(()),
        Ok(Ok(status)) => Err(format!("webhook {url} answered {status}")),
    }
}

/// POSTs `body` (JSON) to an `http://` URL with the gateway's own HTTP/1.1
/// client (`upstream`, the codec the nodes are reached with; no pool: a
/// webhook is called seldom) and gives the answer's status.
async fn post_json(url: &str, body: String, timeout: Duration) -> Result<http::StatusCode, String> {
    use crate::upstream::{body::UpBody, OutHead, Peer, Upstream};
    let hook = super::WebhookUrl::parse(url)?;
    let name = hook.name.as_str();
    let addr = tokio::net::lookup_host((name, hook.port))
        .await
        .map_err(|e| format!("cannot resolve {name}: {e}"))?
        .next()
        .ok_or_else(|| format!("{name} has no address"))?;
    let mut headers = http::HeaderMap::with_capacity(3);
    headers.insert(http::header::HOST, hook.host);
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static("graygate-webhook"),
    );
    let client = Upstream::new(&crate::config::UpstreamConfig {
        connect_timeout_ms: timeout.as_millis() as u64,
        pool_max_idle_per_host: 0,
        ..Default::default()
    });
    let head = OutHead::own(&http::Method::POST, &hook.target, &headers);
    let resp = client
        .send(
            Peer {
                addr,
                transport: None,
            },
            head,
            UpBody::Full(Some(bytes::Bytes::from(body))),
            (timeout, timeout),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(resp.status())
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
    // A next step of weight 100 is the promotion itself.
    let last = super::full_share(&r.spec, r.state.step + 1);
    let hook = if last {
        r.spec.webhooks.confirm.clone()
    } else {
        r.spec.webhooks.before_step.clone()
    };
    if let Some(url) = hook {
        if let Err(e) = webhook(&url, r, if last { "confirm" } else { "before_step" }).await {
            r.state.held = Some(e.clone());
            note(r, "held", e);
            return;
        }
    }
    r.state.held = None;
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
    r.state.held = None;
    note(r, "rollback", reason);
    if let Some(url) = r.spec.webhooks.rollback.clone() {
        if let Err(e) = webhook(&url, r, "rollback").await {
            tracing::warn!(release = %r.spec.name, error = %e, "rollback webhook failed");
        }
    }
}

/// Writes the state and reloads, so the change is live in one swap — or,
/// when nothing that routes changed (a decision, a count), writes it
/// without a reload: the generation stays, `list` shows the new state.
async fn commit(gw: &Arc<Gateway>, file: &ReleasesFile) -> Result<(), String> {
    let gen = gw.current();
    let path = gen.config.release_state_path(&gw.config_path);
    let text = serde_json::to_string_pretty(file).map_err(|e| e.to_string())?;
    let quiet =
        super::routing_signature(&file.releases) == super::routing_signature(&gen.release_records);
    // Before the write: the watcher must know it as ours (this commit
    // reloads itself when it must, once).
    *gw.releases.quiet.lock().unwrap_or_else(|e| e.into_inner()) = Some(Quiet {
        generation: if quiet { gen.id } else { u64::MAX },
        path: path.clone(),
        text: text.clone(),
        records: file.releases.clone(),
    });
    write_atomic(&path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    if quiet {
        return Ok(());
    }
    let g = gw.clone();
    match tokio::task::spawn_blocking(move || g.reload()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "release state written, but the reload was rejected: {e}"
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn publish(gw: &Gateway, releases: &[ReleaseRecord]) {
    let m = &gw.plane.metrics;
    for r in releases {
        let labels = [r.spec.name.as_str(), r.spec.lane.as_str()];
        m.release_step
            .with_label_values(&labels)
            .set(r.state.step as i64);
        m.release_weight.with_label_values(&labels).set(weight(r));
    }
}

/// This gateway's own counters of `lane` and formal (one "gateway").
fn local_sample(gw: &Gateway, lane: &str) -> Sample {
    let lanes = &gw.plane.metrics.lanes;
    let counts = fleet::GatewayCounts {
        boot: 0,
        lanes: [lane, FORMAL]
            .iter()
            .filter_map(|l| lanes.snapshot(l).map(|s| (l.to_string(), s)))
            .collect(),
    };
    Sample {
        gateways: [("local".to_string(), counts)].into_iter().collect(),
    }
}

fn marks(gw: &Gateway) -> std::sync::MutexGuard<'_, HashMap<String, Mark>> {
    gw.releases.marks.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_due(gw: &Gateway, at: Option<Instant>) {
    *gw.releases
        .next_due
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = at;
}

/// Every release and its key's mod revision (0 on files).
async fn load_all(gw: &Gateway) -> Result<Vec<(ReleaseRecord, i64)>, Refused> {
    match shared(gw) {
        Some(src) => Ok(src.load().await.map_err(Refused::Unavailable)?.0),
        None => {
            let path = gw.current().config.release_state_path(&gw.config_path);
            let (file, _) = load(&path).map_err(|e| Refused::Conflict(e.to_string()))?;
            Ok(file.releases.into_iter().map(|r| (r, 0)).collect())
        }
    }
}

/// Judges one due release on `sample` against its interval's mark, and
/// moves it. `None`: not due (or its interval just began).
async fn judge_due(
    gw: &Gateway,
    r: &mut ReleaseRecord,
    rev: i64,
    sample: &Result<Sample, String>,
    next: &mut Instant,
) -> Option<()> {
    let now = Instant::now();
    let interval = Duration::from_millis(r.spec.analysis.interval_ms);
    let fresh = |s: &Sample| Mark {
        at: now,
        at_unix: unix_ms(),
        sample: s.clone(),
        intervals: 0,
        rev,
    };
    let mark = {
        let mut marks = marks(gw);
        match (marks.get(&r.spec.name), sample) {
            (Some(m), _) if m.rev == rev && now.duration_since(m.at) < interval => {
                *next = (*next).min(m.at + interval);
                return None;
            }
            (Some(m), Ok(s)) if m.rev == rev => marks.insert(r.spec.name.clone(), fresh(s)),
            (Some(m), Err(_)) if m.rev == rev => marks.remove(&r.spec.name),
            (_, Ok(s)) => {
                marks.insert(r.spec.name.clone(), fresh(s));
                *next = (*next).min(now + interval);
                return None;
            }
            (_, Err(_)) => None,
        }
    };
    *next = (*next).min(now + interval);
    if super::full_share(&r.spec, r.state.step) {
        // Formal has none of the release's traffic left to judge against.
        r.state.phase = Phase::Promoted;
        r.state.awaiting_promote = false;
        note(r, "promote", "a step of weight 100 is promotion");
        return Some(());
    }
    let fleet = shared(gw).is_some();
    let mut detectable = (None, None);
    let (outcome, mut reason, figs, counted) = match (sample, &mark) {
        (Ok(s), Some(m)) => {
            let (dg, counted) = s.since(&m.sample, m.at_unix, &r.spec.lane);
            let (df, _) = s.since(&m.sample, m.at_unix, FORMAL);
            let served = gw.current().lane.served_lanes.contains(&r.spec.lane);
            let (o, mut why) = if served {
                let alpha = analysis::step_alpha(judged_steps(&r.spec));
                let j = analysis::judge_step(&r.spec.analysis, dg.as_ref(), df.as_ref(), alpha);
                detectable = (j.detectable_error_rise_pp, j.detectable_latency_ratio);
                (j.outcome, j.reason)
            } else {
                let why = format!(
                    "lane {:?} has no nodes and no static tree: nothing serves it",
                    r.spec.lane
                );
                ("error", why)
            };
            if m.intervals > 0 {
                why = format!("the step over {} intervals: {why}", m.intervals + 1);
            }
            (o, why, (figures(&dg), figures(&df)), Some(counted))
        }
        (Err(e), _) => (
            "error",
            format!("counters unavailable: {e}"),
            Default::default(),
            Some(0),
        ),
        (Ok(_), None) => return None,
    };
    // The step's sample stays open whatever the outcome (the sequential
    // test is valid at every look): the next interval adds to it, until
    // the step changes.
    let (step, phase) = (r.state.step, r.state.phase);
    let reopen = mark.map(|m| Mark {
        at: now,
        intervals: m.intervals + 1,
        ..m
    });
    let a = &r.spec.analysis;
    let mode = a.failures.as_str();
    match outcome {
        "fail" => {
            r.state.failures += 1;
            reason = format!(
                "{reason} — failure {} of {} ({mode})",
                r.state.failures, a.failure_threshold
            );
        }
        "pass" if a.failures == FailureCount::Consecutive && r.state.failures > 0 => {
            r.state.failures = 0;
            reason = format!("{reason} — failures reset (consecutive)");
        }
        _ => {}
    }
    gw.plane
        .metrics
        .release_analyses
        .with_label_values(&[r.spec.name.as_str(), outcome])
        .inc();
    record(
        r,
        outcome,
        reason,
        figs,
        counted.filter(|_| fleet),
        detectable,
    );
    match outcome {
        "pass" => {
            r.state.step_passes += 1;
            let min = r.spec.steps[r.state.step].min_duration_ms;
            if unix_ms().saturating_sub(r.state.step_started) >= min {
                advance(r).await;
            }
        }
        "fail" if r.state.failures >= r.spec.analysis.failure_threshold => {
            let why = format!(
                "{} {mode} failed windows (threshold {})",
                r.state.failures, r.spec.analysis.failure_threshold
            );
            roll_back(r, why).await;
        }
        _ => {}
    }
    // Moved on (or done): the next step's sample starts now (the fresh
    // mark); else the step's sample goes on.
    if let Some(m) = reopen.filter(|_| r.state.step == step && r.state.phase == phase) {
        marks(gw).insert(r.spec.name.clone(), m);
    }
    Some(())
}

/// The steps of a release that are judged (a last step of weight 100 is
/// the promotion itself): the release's false-failure budget is split
/// over them.
fn judged_steps(spec: &ReleaseSpec) -> usize {
    (0..spec.steps.len())
        .filter(|i| !super::full_share(spec, *i))
        .count()
}

/// The leader's write of a judged release, fenced by its term; the
/// interval goes on from the written revision (or starts again).
async fn write_judged(
    src: &SharedReleases,
    gw: &Gateway,
    r: &mut ReleaseRecord,
    rev: i64,
    fence: i64,
) {
    trim(r);
    let guard = Guard {
        fence: Some(fence),
        mod_revision: rev,
        range_read_at: None,
    };
    match src.write(r, &guard).await {
        Ok(Some(written)) => {
            if let Some(m) = marks(gw).get_mut(&r.spec.name) {
                m.rev = written;
            }
        }
        Ok(None) => {
            tracing::warn!(release = %r.spec.name, "release state not written: a concurrent change or a lost term");
            marks(gw).remove(&r.spec.name);
        }
        Err(e) => {
            tracing::error!(release = %r.spec.name, error = %e, "release state not written");
            marks(gw).remove(&r.spec.name);
        }
    }
}

fn trim(r: &mut ReleaseRecord) {
    let excess = r.state.history.len().saturating_sub(FLEET_HISTORY);
    r.state.history.drain(..excess);
}

/// One pass over every release: judge those whose interval is over. In a
/// fleet only the leader does, on every gateway's counters.
pub async fn tick(gw: &Arc<Gateway>) {
    let due = *gw
        .releases
        .next_due
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if due.is_some_and(|d| Instant::now() < d) {
        return;
    }
    let fence = gw
        .releases
        .fleet
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .fence();
    if shared(gw).is_some() && fence.is_none() {
        // Not (or no longer) leading: the next term starts new intervals.
        marks(gw).clear();
        return;
    }
    let _one = gw.releases.lock.lock().await;
    let Ok(mut all) = load_all(gw).await else {
        set_due(gw, Some(Instant::now() + Duration::from_secs(1)));
        return;
    };
    let mut changed = Vec::new();
    // Nothing running: look again in a second (creation wakes it sooner).
    let mut next = Instant::now() + Duration::from_secs(1);
    let mut fleet_sample = None;
    for (i, (r, rev)) in all.iter_mut().enumerate() {
        if r.state.phase != Phase::Progressing {
            continue;
        }
        let sample = match shared(gw) {
            Some(src) => {
                if fleet_sample.is_none() {
                    fleet_sample = Some(src.sample().await);
                }
                fleet_sample.clone().unwrap_or_else(|| Err(String::new()))
            }
            None => Ok(local_sample(gw, &r.spec.lane)),
        };
        if judge_due(gw, r, *rev, &sample, &mut next).await.is_some() {
            changed.push(i);
        }
    }
    match (shared(gw), fence) {
        (Some(src), Some(fence)) => {
            for i in changed {
                let (r, rev) = &mut all[i];
                write_judged(&src, gw, r, *rev, fence).await;
            }
        }
        _ if !changed.is_empty() => {
            let file = ReleasesFile {
                releases: all.into_iter().map(|(r, _)| r).collect(),
            };
            if let Err(e) = commit(gw, &file).await {
                tracing::error!(error = %e, "release state not applied");
            }
            publish(gw, &file.releases);
        }
        _ => {}
    }
    set_due(gw, Some(next));
}

/// Runs the controller until the process ends (in a fleet also the
/// election and the counters' publication).
pub async fn run(gw: Arc<Gateway>) {
    /// The fleet tasks end with the controller (e.g. at a handover).
    struct Tasks(Vec<tokio::task::JoinHandle<()>>);
    impl Drop for Tasks {
        fn drop(&mut self) {
            self.0.iter().for_each(|t| t.abort());
        }
    }
    let _tasks = Tasks(match shared(&gw) {
        Some(src) => vec![
            tokio::spawn(src.clone().campaign(gw.clone())),
            tokio::spawn(src.publish_counters(gw.clone())),
        ],
        None => Vec::new(),
    });
    publish(&gw, &list(&gw));
    let mut shown = 0;
    let mut every = tokio::time::interval(Duration::from_millis(100));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        tick(&gw).await;
        // Every gateway's gauges follow the state it serves.
        if let Some(rev) = shared(&gw).and_then(|s| s.serving_version()) {
            if rev != shown {
                shown = rev;
                publish(&gw, &list(&gw));
            }
        }
    }
}

/// Whether two route lists share requests (one prefix starts the other).
fn overlap<'a>(a: &'a [String], b: &'a [String]) -> Option<(&'a str, &'a str)> {
    a.iter()
        .flat_map(|x| b.iter().map(move |y| (x.as_str(), y.as_str())))
        .find(|(x, y)| x.starts_with(y) || y.starts_with(x))
}

/// Refuses a new release whose name is taken (a finished one's name may
/// be used again: the new release replaces its record), whose lane a
/// running or promoted release holds, or whose routes overlap one's.
fn check_new<'a>(
    mut existing: impl Iterator<Item = &'a ReleaseRecord>,
    spec: &ReleaseSpec,
) -> Result<(), Refused> {
    existing.try_for_each(|r| {
        let phase = r.state.phase;
        if r.spec.name == spec.name && phase != Phase::Finished {
            return Err(Refused::Conflict(format!(
                "release {:?} exists ({}); finish it first to use its name again",
                spec.name,
                phase.as_str()
            )));
        }
        if !phase.holds_routes() {
            return Ok(());
        }
        if r.spec.lane == spec.lane {
            return Err(Refused::Conflict(format!(
                "lane {:?} is held by release {:?} ({}); finish it first",
                spec.lane,
                r.spec.name,
                phase.as_str()
            )));
        }
        if let Some((mine, theirs)) = overlap(&spec.routes, &r.spec.routes) {
            return Err(Refused::Conflict(format!(
                "route {mine:?} overlaps route {theirs:?} of release {:?} ({}); finish it first",
                r.spec.name,
                phase.as_str()
            )));
        }
        Ok(())
    })
}

fn new_record(spec: ReleaseSpec) -> ReleaseRecord {
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
            held: None,
            created: now,
            history: Vec::new(),
        },
    };
    note(&mut rec, "step", "created: first step applied");
    rec
}

/// Creates a release from its spec (YAML or JSON): validated like a reload
/// (the whole state must compile), then live at its first step. In a
/// fleet: written to its key if no release changed meanwhile, answered
/// once this gateway serves it.
pub async fn create(gw: &Arc<Gateway>, spec_text: &str) -> Result<ReleaseRecord, Refused> {
    // Named `release spec` with its line, as a file would be: the command
    // line's `release create` puts the spec file's name in its place.
    let spec: ReleaseSpec = serde_yaml::from_str(spec_text).map_err(|e| {
        let (line, msg) = crate::config::yaml_error(&e);
        Refused::Invalid(match line {
            Some(l) => format!("release spec:{l}: {msg}"),
            None => format!("release spec: {msg}"),
        })
    })?;
    let _one = gw.releases.lock.lock().await;
    let gen = gw.current();
    super::check_new_spec(&spec, &gen.lane.served_lanes).map_err(Refused::Invalid)?;
    let path = match shared(gw) {
        Some(src) => src.key_path(&spec.name),
        None => gen.config.release_state_path(&gw.config_path),
    };
    let compiles = |releases: Vec<ReleaseRecord>| {
        super::compile(&ReleasesFile { releases }, &path, "", &gen.lane.lists)
            .map_err(|e| Refused::Invalid(e.to_string()))
    };
    let Some(src) = shared(gw) else {
        let (mut file, _) = load(&path).map_err(|e| Refused::Conflict(e.to_string()))?;
        check_new(file.releases.iter(), &spec)?;
        file.releases.retain(|r| r.spec.name != spec.name);
        let rec = new_record(spec);
        file.releases.push(rec.clone());
        compiles(file.releases.clone())?;
        commit(gw, &file).await.map_err(Refused::Conflict)?;
        publish(gw, &file.releases);
        set_due(gw, None);
        return Ok(rec);
    };
    for _ in 0..CAS_TRIES {
        let (all, at) = src.load().await.map_err(Refused::Unavailable)?;
        check_new(all.iter().map(|(r, _)| r), &spec)?;
        // A finished release of the same name: its key is overwritten.
        let replaced = all
            .iter()
            .find(|(r, _)| r.spec.name == spec.name)
            .map_or(0, |(_, rev)| *rev);
        let rec = new_record(spec.clone());
        let mut releases: Vec<_> = all
            .into_iter()
            .map(|(r, _)| r)
            .filter(|r| r.spec.name != spec.name)
            .collect();
        releases.push(rec.clone());
        compiles(releases)?;
        let guard = Guard {
            fence: None,
            mod_revision: replaced,
            range_read_at: Some(at),
        };
        if let Some(rev) = src
            .write(&rec, &guard)
            .await
            .map_err(Refused::Unavailable)?
        {
            return applied(gw, &src, rec, rev).await;
        }
    }
    Err(Refused::Conflict(format!(
        "the releases in {} kept changing; try again",
        src.title()
    )))
}

/// Answers a fleet write once this gateway serves it.
async fn applied(
    gw: &Gateway,
    src: &SharedReleases,
    rec: ReleaseRecord,
    rev: i64,
) -> Result<ReleaseRecord, Refused> {
    let key = src.key_path(&rec.spec.name);
    src.wait_applied(gw, &key.to_string_lossy(), rev)
        .await
        .map_err(Refused::Conflict)?;
    set_due(gw, None);
    Ok(rec)
}

/// Applies an operator's action to the release record.
async fn apply_action(r: &mut ReleaseRecord, action: Action) -> Result<(), Refused> {
    if let Action::Finish { relabel_nodes } = action {
        return finish(r, relabel_nodes);
    }
    if r.state.phase.is_final() {
        return Err(Refused::Conflict(format!(
            "release {:?} is {} and never moves again",
            r.spec.name,
            r.state.phase.as_str()
        )));
    }
    // An operator's action ends a hold (a resume past a failing webhook
    // asks it again, and may hold again).
    r.state.held = None;
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
        Action::Finish { .. } => unreachable!("handled above"),
    }
    Ok(())
}

/// Ends a promoted or rolled-back release (the nodes, if relabelled, are
/// the caller's part).
fn finish(r: &mut ReleaseRecord, relabel_nodes: bool) -> Result<(), Refused> {
    let name = &r.spec.name;
    match r.state.phase {
        Phase::Progressing | Phase::Paused => Err(Refused::Conflict(format!(
            "release {name:?} is {}: promote or abort it first, then finish",
            r.state.phase.as_str()
        ))),
        Phase::Finished => Err(Refused::Conflict(format!(
            "release {name:?} is already finished"
        ))),
        Phase::RolledBack if relabel_nodes => Err(Refused::Invalid(format!(
            "release {name:?} was rolled back: relabel_nodes applies to a promoted release"
        ))),
        Phase::Promoted | Phase::RolledBack => {
            let was = r.state.phase;
            r.state.phase = Phase::Finished;
            r.state.awaiting_promote = false;
            r.state.held = None;
            let why = match (was, relabel_nodes) {
                (Phase::Promoted, true) => {
                    "finished by the operator: the lane's nodes are formal now, the old formal nodes drain"
                }
                (Phase::Promoted, false) => {
                    "finished by the operator: the routes follow the rules again (the new version must be formal by now)"
                }
                _ => "finished by the operator: the lane is no longer revoked",
            };
            note(r, "finish", why);
            Ok(())
        }
    }
}

/// Applies an operator's action (in a fleet: compare-and-swap on the
/// release's key, whichever gateway leads; the leader's interval starts
/// again).
pub async fn act(gw: &Arc<Gateway>, name: &str, action: Action) -> Result<ReleaseRecord, Refused> {
    let relabel = action
        == Action::Finish {
            relabel_nodes: true,
        };
    if let Some(src) = shared(gw).filter(|_| relabel) {
        return Err(Refused::Invalid(format!(
            "relabel_nodes works on node files; with {} the nodes are registered: redeploy the new version as formal, then finish",
            src.title()
        )));
    }
    let _one = gw.releases.lock.lock().await;
    let not_found = || Refused::NotFound(format!("no release {name:?}"));
    let Some(src) = shared(gw) else {
        let path = gw.current().config.release_state_path(&gw.config_path);
        let (mut file, _) = load(&path).map_err(|e| Refused::Conflict(e.to_string()))?;
        let r = file
            .releases
            .iter_mut()
            .find(|r| r.spec.name == name)
            .ok_or_else(not_found)?;
        apply_action(r, action).await?;
        let out = r.clone();
        if relabel {
            // The node files first: until the state swaps, the promoted
            // rule sends the lane's requests to formal, which is the new
            // version already.
            let _edits = gw.edit_lock.lock().await;
            relabel_nodes(gw, &out)?;
        }
        marks(gw).remove(name);
        commit(gw, &file).await.map_err(Refused::Conflict)?;
        publish(gw, &file.releases);
        set_due(gw, None);
        return Ok(out);
    };
    for _ in 0..CAS_TRIES {
        let (all, _) = src.load().await.map_err(Refused::Unavailable)?;
        let (mut r, rev) = all
            .into_iter()
            .find(|(r, _)| r.spec.name == name)
            .ok_or_else(not_found)?;
        apply_action(&mut r, action).await?;
        trim(&mut r);
        let guard = Guard {
            fence: None,
            mod_revision: rev,
            range_read_at: None,
        };
        if let Some(written) = src.write(&r, &guard).await.map_err(Refused::Unavailable)? {
            return applied(gw, &src, r, written).await;
        }
    }
    Err(Refused::Conflict(format!(
        "release {name:?} kept changing in {}; try again",
        src.title()
    )))
}

/// The services behind a release's routes (a route whose prefix and one of
/// the release's overlap).
fn routed_services(gw: &Gateway, routes: &[String]) -> std::collections::BTreeSet<String> {
    gw.current()
        .routes
        .iter()
        .filter(|rt| {
            routes
                .iter()
                .any(|p| p.starts_with(&*rt.prefix) || rt.prefix.starts_with(p.as_str()))
        })
        .filter_map(|rt| match &rt.target {
            crate::generation::Target::Service(s) => Some(s.to_string()),
            crate::generation::Target::Static(_) => None,
        })
        .collect()
}

/// Writes the relabelled node files of a finished release (the state's
/// commit reloads them with it).
fn relabel_nodes(gw: &Gateway, r: &ReleaseRecord) -> Result<(), Refused> {
    let gen = gw.current();
    let services = routed_services(gw, &r.spec.routes);
    let node_edit::Relabel {
        files,
        promoted,
        drained,
    } = node_edit::relabel_lane(&gw.config_path, &gen.config, &services, &r.spec.lane)
        .map_err(|e| Refused::Conflict(e.to_string()))?;
    if promoted == 0 {
        return Err(Refused::Conflict(format!(
            "no node of lane {:?} in the node files of the release's services ({}): nothing to relabel; finish without relabel_nodes",
            r.spec.lane,
            services.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    for (path, text) in &files {
        write_atomic(path, text)
            .map_err(|e| Refused::Conflict(format!("cannot write {}: {e}", path.display())))?;
        tracing::info!(release = %r.spec.name, file = %path.display(), "node file relabelled: the promoted lane's nodes are formal, the old formal nodes drain");
    }
    tracing::info!(release = %r.spec.name, lane = %r.spec.lane, formal = promoted, draining = drained, "release finished with its nodes relabelled");
    Ok(())
}

/// Every release (spec and state) this gateway serves.
pub fn list(gw: &Gateway) -> Vec<ReleaseRecord> {
    if let Some(src) = shared(gw) {
        return src.list();
    }
    // The serving generation's records, not the state file: a state
    // written by `commit` is shown once its reload serves it (a rollback
    // reads `rolled_back` only when no request can reach the lane) — or,
    // written without a reload, at once.
    let gen = gw.current();
    gw.releases
        .quiet_records(gen.id)
        .unwrap_or_else(|| gen.release_records.clone())
}
