//! Layer: control plane. Progressive releases: a named release moves one
//! lane through traffic steps on some routes, judged interval by interval
//! against formal, and promotes or rolls back by itself.
//!
//! The release state file (`release_state_file`, JSON) is the single source
//! of truth, like node and rule files: the controller ([`controller`])
//! writes a changed state atomically and reloads when what routes changed
//! (a step, a promotion, a rollback: [`routing_signature`]) — a decision
//! alone is written without a reload; the generation build
//! ([`compile`]) turns every release's current step into `release:<name>`
//! rules (scoped by path prefix to its routes) and the rolled-back lanes
//! into a revoked set, so a step, a promotion or a rollback goes live in one
//! generation swap — and survives a restart.

pub mod analysis;
pub mod controller;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::base::lists::IpList;
use crate::config::release::{Phase, ReleaseRecord, ReleaseSpec, ReleasesFile};
use crate::config::rules::{OneOrMany, RuleConfig, RulesConfig, SourceConfig};
use crate::config::{valid_lane, ConfigError, FORMAL};
use crate::lane::rules::Rules;

/// Reads the state file (no file: no releases).
pub fn load(path: &Path) -> Result<(ReleasesFile, String), ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((ReleasesFile::default(), String::new()))
        }
        Err(e) => return Err(ConfigError::new(path, None, format!("cannot read: {e}"))),
    };
    let file = serde_json::from_str(&text).map_err(|e| {
        ConfigError::new(path, Some(e.line()), format!("invalid release state: {e}"))
    })?;
    Ok((file, text))
}

/// The release records a store holds (key → JSON, one release per key,
/// `<prefix>/releases/<name>`): each checked, a bad one named by its key
/// and line. Returns them and the directory-like path errors name.
pub fn from_store(
    kvs: &BTreeMap<PathBuf, Vec<u8>>,
) -> Result<(ReleasesFile, PathBuf), ConfigError> {
    let mut file = ReleasesFile::default();
    let mut dir = PathBuf::from("releases");
    for (key, value) in kvs {
        let r: ReleaseRecord = serde_json::from_slice(value).map_err(|e| {
            ConfigError::new(key, Some(e.line()), format!("invalid release state: {e}"))
        })?;
        check_spec(&r.spec).map_err(|m| ConfigError::new(key, None, m))?;
        if key.file_name().and_then(|n| n.to_str()) != Some(r.spec.name.as_str()) {
            return Err(ConfigError::new(
                key,
                None,
                format!(
                    "holds release {:?}: the key must end in its name",
                    r.spec.name
                ),
            ));
        }
        if let Some(d) = key.parent() {
            dir = d.to_path_buf();
        }
        file.releases.push(r);
    }
    Ok((file, dir))
}

/// The traffic share of a release now: its step's weight while it runs,
/// 100 once promoted, 0 once rolled back (or on a match step).
pub fn weight(r: &ReleaseRecord) -> f64 {
    match r.state.phase {
        Phase::Promoted => 100.0,
        Phase::RolledBack | Phase::Finished => 0.0,
        _ => r
            .spec
            .steps
            .get(r.state.step)
            .and_then(|s| s.weight)
            .unwrap_or(0.0),
    }
}

pub use crate::config::release::routing_signature;

/// Whether step `i` gives the lane all of the release's traffic — a weight
/// of 100, or past the last step: that is promotion (formal would have no
/// traffic left to judge against), never a step to hold and judge.
pub fn full_share(spec: &ReleaseSpec, i: usize) -> bool {
    spec.steps
        .get(i)
        .is_none_or(|s| s.weight.is_some_and(|w| w >= 100.0))
}

/// What a new release must also meet (a stored one is only
/// [`check_spec`]ed, so a release written by an older version still
/// loads): a weight of 100 only as the last step and not the first, and a
/// lane something serves (`served`: lanes with nodes or a static tree).
pub fn check_new_spec(spec: &ReleaseSpec, served: &BTreeSet<String>) -> Result<(), String> {
    check_spec(spec)?;
    let full: Vec<usize> = (0..spec.steps.len())
        .filter(|i| full_share(spec, *i))
        .collect();
    if full.iter().any(|i| *i + 1 != spec.steps.len()) || full == [0] {
        return Err(format!(
            "release {:?}: a step of weight 100 is promotion, so it may only be the last step, after one that is judged",
            spec.name
        ));
    }
    if !served.contains(&spec.lane) {
        return Err(format!(
            "release {:?}: lane {:?} has no nodes and no static tree, so nothing would serve it (add its nodes first)",
            spec.name, spec.lane
        ));
    }
    Ok(())
}

/// The rule standing for a release's current step (none once rolled back).
fn step_rule(r: &ReleaseRecord) -> Option<RuleConfig> {
    let spec = &r.spec;
    let mut rule = RuleConfig {
        name: format!("release:{}", spec.name),
        lane: Some(spec.lane.clone()),
        ip: None,
        header: None,
        cookie: None,
        query: None,
        uid: None,
        path_prefix: Some(OneOrMany::Many(spec.routes.clone())),
        percentage: None,
        key: None,
    };
    let key = || {
        spec.key.clone().unwrap_or(SourceConfig {
            header: None,
            cookie: None,
            query: None,
            ip: true,
        })
    };
    match r.state.phase {
        Phase::RolledBack | Phase::Finished => return None,
        // Every request on the routes, with the key or without it (and so
        // past any sticky cookie naming another lane).
        Phase::Promoted => {}
        Phase::Progressing | Phase::Paused => {
            let step = spec.steps.get(r.state.step)?;
            match (&step.weight, &step.matches) {
                (Some(w), _) => {
                    rule.percentage = Some(*w);
                    rule.key = Some(key());
                }
                (None, Some(m)) => {
                    rule.header = m.header.clone();
                    rule.cookie = m.cookie.clone();
                    rule.query = m.query.clone();
                    rule.ip = m.ip.clone();
                }
                (None, None) => return None,
            }
        }
    }
    Some(rule)
}

/// What the generation takes from the release state: the current steps as
/// rules and the rolled-back lanes.
pub fn compile(
    file: &ReleasesFile,
    path: &Path,
    text: &str,
    lists: &BTreeMap<String, IpList>,
) -> Result<(Option<Rules>, BTreeSet<String>), ConfigError> {
    let mut revoked = BTreeSet::new();
    let mut rules = Vec::new();
    for r in &file.releases {
        check_spec(&r.spec).map_err(|m| ConfigError::new(path, None, m))?;
        if r.state.phase == Phase::RolledBack {
            revoked.insert(r.spec.lane.clone());
        }
        rules.extend(step_rule(r));
    }
    // A lane promoted or in progress in another release is not revoked (a
    // finished release neither revokes nor clears a revocation).
    for r in &file.releases {
        if r.state.phase.holds_routes() {
            revoked.remove(&r.spec.lane);
        }
    }
    if rules.is_empty() {
        return Ok((None, revoked));
    }
    let cfg = RulesConfig {
        enabled: true,
        uid: None,
        deny: Vec::new(),
        rules,
        fallback: None,
    };
    Ok((
        Some(Rules::compile(&cfg, path, text, None, lists)?),
        revoked,
    ))
}

/// A webhook's URL, as the release controller calls it: `http://` with a
/// host (the gateway's own HTTP/1.1 client; no TLS to webhooks).
pub struct WebhookUrl {
    /// The name or address to resolve (an IPv6 literal without brackets).
    pub name: String,
    pub port: u16,
    /// The `Host` field: the URL's authority.
    pub host: http::HeaderValue,
    /// The origin-form target: path and query.
    pub target: http::Uri,
}

impl WebhookUrl {
    pub fn parse(url: &str) -> Result<WebhookUrl, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|_| format!("webhook {url:?} is not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "webhook {url:?}: only http:// URLs are supported (no TLS to webhooks)"
            ));
        }
        let (Some(name), Some(authority)) = (uri.host(), uri.authority()) else {
            return Err(format!("webhook {url:?} has no host"));
        };
        if authority.as_str().contains('@') {
            return Err(format!("webhook {url:?}: no user:password@ in the URL"));
        }
        let host = http::HeaderValue::from_str(authority.as_str())
            .map_err(|_| format!("webhook {url:?} is not a URL"))?;
        let target = uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(|_| format!("webhook {url:?} is not a URL"))?;
        Ok(WebhookUrl {
            name: name
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port: uri.port_u16().unwrap_or(80),
            host,
            target,
        })
    }
}

/// A spec's own sanity (the rule compiler checks keys and matchers).
pub fn check_spec(spec: &ReleaseSpec) -> Result<(), String> {
    let name_ok = !spec.name.is_empty()
        && spec
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !name_ok {
        return Err(format!(
            "release name {:?}: letters, digits, - _ . only",
            spec.name
        ));
    }
    if !valid_lane(&spec.lane) || spec.lane == FORMAL {
        return Err(format!(
            "release {:?}: lane {:?} must be a gray lane name",
            spec.name, spec.lane
        ));
    }
    if spec.routes.is_empty() || spec.routes.iter().any(|r| !r.starts_with('/')) {
        return Err(format!(
            "release {:?}: routes are path prefixes starting with /",
            spec.name
        ));
    }
    if spec.steps.is_empty() {
        return Err(format!("release {:?}: no steps", spec.name));
    }
    let mut last = 0.0;
    for (i, s) in spec.steps.iter().enumerate() {
        match (&s.weight, &s.matches) {
            (Some(w), None) => {
                if !(*w > 0.0 && *w <= 100.0) || *w < last {
                    return Err(format!(
                        "release {:?} step {i}: weight {w} must be in (0, 100] and never fall",
                        spec.name
                    ));
                }
                last = *w;
            }
            (None, Some(_)) => {}
            _ => {
                return Err(format!(
                    "release {:?} step {i}: exactly one of `weight` or `match`",
                    spec.name
                ))
            }
        }
        if s.gate.as_deref().is_some_and(|g| g != "manual") {
            return Err(format!(
                "release {:?} step {i}: gate must be `manual`",
                spec.name
            ));
        }
    }
    let a = &spec.analysis;
    if a.interval_ms == 0 || a.failure_threshold == 0 || a.max_p99_ratio <= 0.0 {
        return Err(format!(
            "release {:?}: analysis interval, failure threshold and p99 ratio must be positive",
            spec.name
        ));
    }
    if !(0.5..=0.999).contains(&a.quantile) {
        return Err(format!(
            "release {:?}: analysis quantile must be in [0.5, 0.999]",
            spec.name
        ));
    }
    if a.min_p99_delta_ms.is_nan() || a.min_p99_delta_ms < 0.0 {
        return Err(format!(
            "release {:?}: analysis min_p99_delta_ms must not be negative",
            spec.name
        ));
    }
    let w = &spec.webhooks;
    for url in [&w.before_step, &w.confirm, &w.rollback]
        .into_iter()
        .flatten()
    {
        WebhookUrl::parse(url).map_err(|e| format!("release {:?}: {e}", spec.name))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::release::{ReleaseState, StepSpec};

    fn rec(phase: Phase, step: usize) -> ReleaseRecord {
        ReleaseRecord {
            spec: ReleaseSpec {
                name: "r1".into(),
                lane: "gray".into(),
                routes: vec!["/api/".into()],
                key: None,
                steps: vec![
                    StepSpec {
                        weight: Some(10.0),
                        matches: None,
                        min_duration_ms: 1,
                        gate: None,
                    },
                    StepSpec {
                        weight: Some(50.0),
                        matches: None,
                        min_duration_ms: 1,
                        gate: None,
                    },
                ],
                analysis: Default::default(),
                webhooks: Default::default(),
            },
            state: ReleaseState {
                phase,
                step,
                step_started: 0,
                failures: 0,
                step_passes: 0,
                awaiting_promote: false,
                held: None,
                created: 0,
                history: vec![],
            },
        }
    }

    #[test]
    fn phases_compile_to_shares_and_revocations() {
        let lists = BTreeMap::new();
        let p = Path::new("releases.json");
        let one = |r| ReleasesFile { releases: vec![r] };
        let (rules, revoked) = compile(&one(rec(Phase::Progressing, 1)), p, "", &lists).unwrap();
        assert!(rules.is_some() && revoked.is_empty());
        assert_eq!(weight(&rec(Phase::Progressing, 1)), 50.0);
        assert_eq!(weight(&rec(Phase::Promoted, 0)), 100.0);
        let (rules, revoked) = compile(&one(rec(Phase::RolledBack, 1)), p, "", &lists).unwrap();
        assert!(rules.is_none());
        assert!(revoked.contains("gray"));
    }

    #[test]
    fn store_records_are_named_by_their_key_when_bad() {
        let good = serde_json::to_vec(&rec(Phase::Progressing, 1)).unwrap();
        let key = PathBuf::from("/g/releases/r1");
        let kvs = BTreeMap::from([(key.clone(), good.clone())]);
        let (file, dir) = from_store(&kvs).unwrap();
        assert_eq!(file.releases.len(), 1);
        assert_eq!(dir, PathBuf::from("/g/releases"));
        // Broken JSON: the key and the line.
        let kvs = BTreeMap::from([(key.clone(), b"{\n  \"spec\": 1\n}".to_vec())]);
        let e = from_store(&kvs).unwrap_err().to_string();
        assert!(e.starts_with("/g/releases/r1:2:"), "{e}");
        // A record under another release's name.
        let kvs = BTreeMap::from([(PathBuf::from("/g/releases/other"), good)]);
        let e = from_store(&kvs).unwrap_err().to_string();
        assert!(e.contains("must end in its name"), "{e}");
    }

    #[test]
    fn bad_specs_are_refused() {
        let mut r = rec(Phase::Progressing, 0);
        r.spec.steps[1].weight = Some(5.0);
        assert!(check_spec(&r.spec).unwrap_err().contains("never fall"));
        let mut r = rec(Phase::Progressing, 0);
        r.spec.lane = "formal".into();
        assert!(check_spec(&r.spec).is_err());
        let mut r = rec(Phase::Progressing, 0);
        r.spec.routes = vec!["api".into()];
        assert!(check_spec(&r.spec).is_err());
    }

    #[test]
    fn webhook_urls_are_checked_with_the_spec() {
        let refused = [
            ("https://hooks.example/ok", "only http://"),
            ("hooks.example/ok", "not a URL"),
            ("http:///ok", "not a URL"),
            ("http://u:p@hooks.example/ok", "user:password@"),
            ("not a url", "not a URL"),
        ];
        for (url, why) in refused {
            let mut r = rec(Phase::Progressing, 0);
            r.spec.webhooks.confirm = Some(url.into());
            let e = check_spec(&r.spec).unwrap_err();
            assert!(e.starts_with("release \"r1\": webhook "), "{url}: {e}");
            assert!(e.contains(why), "{url}: {e}");
        }
        let mut r = rec(Phase::Progressing, 0);
        r.spec.webhooks.rollback = Some("http://hooks.example:8080/a?b=1".into());
        check_spec(&r.spec).unwrap();
        let w = WebhookUrl::parse("http://hooks.example:8080/a?b=1").unwrap();
        assert_eq!(
            (w.port, w.host.to_str().unwrap()),
            (8080, "hooks.example:8080")
        );
        assert_eq!(w.target.to_string(), "/a?b=1");
        let w = WebhookUrl::parse("http://[::1]").unwrap();
        assert_eq!((w.port, w.target.to_string().as_str()), (80, "/"));
        assert_eq!(w.name, "::1");
    }
}
