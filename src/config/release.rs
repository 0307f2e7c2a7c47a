//! Layer: config. A progressive release as written by its operator (YAML or
//! JSON), and the release's durable state as the controller keeps it in the
//! release state file (JSON; one file holds every release).

use serde::{Deserialize, Serialize};

use super::rules::{IpConfig, MatchConfig, OneOrMany, SourceConfig};

/// A named release: one lane on some routes, stepped by traffic share or
/// by match, judged interval by interval against formal.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReleaseSpec {
    pub name: String,
    /// The lane being released (its nodes and static tree already exist).
    pub lane: String,
    /// Route prefixes the release covers (API and static); default `/`.
    #[serde(default = "default_routes")]
    pub routes: Vec<String>,
    /// What the traffic share hashes (stable bucket 0–99, so raising the
    /// share only adds users); default the client IP.
    #[serde(default)]
    pub key: Option<SourceConfig>,
    pub steps: Vec<StepSpec>,
    #[serde(default)]
    pub analysis: AnalysisSpec,
    #[serde(default)]
    pub webhooks: WebhooksSpec,
}

fn default_routes() -> Vec<String> {
    vec!["/".to_string()]
}

/// One step: a traffic share (`weight`, percent of the key's buckets) or a
/// match (A/B style), held at least `min_duration_ms`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StepSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    #[serde(rename = "match", skip_serializing_if = "Option::is_none")]
    pub matches: Option<MatchSpec>,
    pub min_duration_ms: u64,
    /// `manual`: after this step's analysis passes, wait for `promote`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gate: Option<String>,
}

impl Default for StepSpec {
    fn default() -> Self {
        StepSpec {
            weight: None,
            matches: None,
            min_duration_ms: 60_000,
            gate: None,
        }
    }
}

/// The requests a match step sends to the lane (every condition holds).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MatchSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header: Option<OneOrMany<MatchConfig>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cookie: Option<OneOrMany<MatchConfig>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<OneOrMany<MatchConfig>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpConfig>,
}

/// How each window is judged: gray against formal, both live at once
/// (the rule and its sample minimums: `control::release::analysis`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AnalysisSpec {
    pub interval_ms: u64,
    /// Fewer requests than this in either lane (over the step so far): not
    /// judged yet, `inconclusive`. Only a floor on looking: the sequential
    /// test is valid from the first request.
    pub min_requests: u64,
    /// Gray's error rate may exceed formal's by this many percentage points.
    pub max_error_delta_pp: f64,
    /// Gray's p99 may be at most this multiple of formal's.
    pub max_p99_ratio: f64,
    /// The latency quantile judged (0.99: the p99; `max_p99_ratio`,
    /// `max_p99_ms` and `min_p99_delta_ms` apply to it, and to 0.9 and the
    /// median below it).
    pub quantile: f64,
    /// Optional absolute ceilings for gray.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_error_rate_pct: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_p99_ms: Option<f64>,
    /// A p99 difference (gray over formal) at most this many milliseconds
    /// never fails, whatever the ratio.
    pub min_p99_delta_ms: f64,
    /// Failed windows that roll the release back.
    pub failure_threshold: u32,
    /// How failures count toward the threshold.
    pub failures: FailureCount,
}

/// How failed windows count toward `failure_threshold`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FailureCount {
    /// In a row: a passing window starts the count again.
    #[default]
    Consecutive,
    /// Over the whole release.
    Total,
}

impl FailureCount {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCount::Consecutive => "consecutive",
            FailureCount::Total => "total",
        }
    }
}

impl Default for AnalysisSpec {
    fn default() -> Self {
        AnalysisSpec {
            interval_ms: 10_000,
            min_requests: 20,
            max_error_delta_pp: 0.5,
            max_p99_ratio: 1.2,
            quantile: 0.99,
            max_error_rate_pct: None,
            max_p99_ms: None,
            min_p99_delta_ms: 0.5,
            failure_threshold: 2,
            failures: FailureCount::Consecutive,
        }
    }
}

/// URLs called with a JSON POST; a non-2xx answer or a timeout holds the
/// release where it is.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WebhooksSpec {
    /// Before each step is applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before_step: Option<String>,
    /// Before promotion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirm: Option<String>,
    /// After a rollback (informational: its answer cannot hold anything).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollback: Option<String>,
    pub timeout_ms: u64,
}

impl Default for WebhooksSpec {
    fn default() -> Self {
        WebhooksSpec {
            before_step: None,
            confirm: None,
            rollback: None,
            timeout_ms: 2_000,
        }
    }
}

/// Where a release is.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Progressing,
    Paused,
    Promoted,
    RolledBack,
    /// Ended by the operator (`finish`): no rule, no revocation, kept for
    /// the record; its routes and lane are free for a new release.
    Finished,
}

impl Phase {
    /// Promoted, rolled-back and finished releases never step again.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Promoted | Phase::RolledBack | Phase::Finished)
    }

    /// Whether the release still holds its routes (a running or promoted
    /// one: another release on them would fight it).
    pub fn holds_routes(self) -> bool {
        matches!(self, Phase::Progressing | Phase::Paused | Phase::Promoted)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Progressing => "progressing",
            Phase::Paused => "paused",
            Phase::Promoted => "promoted",
            Phase::RolledBack => "rolled_back",
            Phase::Finished => "finished",
        }
    }
}

/// One lane's figures over one interval.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct LaneFigures {
    pub requests: u64,
    pub errors: u64,
    pub error_rate_pct: f64,
    /// `None` without requests.
    pub p99_ms: Option<f64>,
}

/// One judged interval (or an action), with the values behind it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct Analysis {
    /// Unix milliseconds.
    pub at: u64,
    pub step: usize,
    pub weight: f64,
    /// `pass`, `fail`, `inconclusive`, `error`, or an action (`step`,
    /// `promote`, `rollback`, `pause`, `resume`, `held`).
    pub outcome: String,
    pub gray: LaneFigures,
    pub formal: LaneFigures,
    pub thresholds: AnalysisSpec,
    pub reason: String,
    /// In a fleet: how many gateways' counters were summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateways: Option<usize>,
    /// The smallest rise of gray's error rate over formal's (percentage
    /// points) the step's sample could have failed; absent: none yet (or
    /// not a judged decision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detectable_error_rise_pp: Option<f64>,
    /// The smallest slowdown (gray = this × formal's latencies) the step's
    /// sample could have failed; absent: none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detectable_latency_ratio: Option<f64>,
}

/// The durable state of one release.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct ReleaseState {
    pub phase: Phase,
    /// Index into `steps`.
    pub step: usize,
    /// Unix milliseconds when the current step was applied.
    pub step_started: u64,
    /// Failed windows counting toward the threshold (in a row, or in
    /// all, as `analysis.failures` says).
    pub failures: u32,
    /// Passed intervals in the current step.
    #[serde(default)]
    pub step_passes: u32,
    /// A manual gate is waiting for `promote`.
    #[serde(default)]
    pub awaiting_promote: bool,
    /// Why a passed step is held where it is (a `before_step` or `confirm`
    /// webhook refused or failed); retried at the next passing interval,
    /// cleared when the release moves or an operator acts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
    pub created: u64,
    /// Newest last, capped.
    pub history: Vec<Analysis>,
}

/// A release: what the operator asked for and where it stands.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct ReleaseRecord {
    pub spec: ReleaseSpec,
    pub state: ReleaseState,
}

impl ReleaseState {
    /// The state operators see: the phase, or `held` for a progressing
    /// release whose webhook holds it at its step.
    pub fn name(&self) -> &'static str {
        match (self.phase, &self.held) {
            (Phase::Progressing, Some(_)) => "held",
            (p, _) => p.as_str(),
        }
    }
}

/// The release state file.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default)]
pub struct ReleasesFile {
    pub releases: Vec<ReleaseRecord>,
}

/// What the generation routes by in a release state: each release's spec,
/// phase and step — not its decisions, counts, failures or holds. A state
/// change that keeps it is written without a reload
/// (the release controller: the generation number then still says only that the
/// configuration changed).
pub fn routing_signature(releases: &[ReleaseRecord]) -> Vec<(String, Phase, usize)> {
    releases
        .iter()
        .map(|r| {
            let spec = serde_json::to_string(&r.spec).unwrap_or_default();
            (spec, r.state.phase, r.state.step)
        })
        .collect()
}
