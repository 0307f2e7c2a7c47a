//! Layer: control plane. Rule management written back to the rule file: the
//! `enabled` switch and a rule's `percentage`. The change is made on the file's
//! YAML tree, validated by compiling the rules exactly as a load does, written
//! atomically, then applied through the reload path.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

use crate::base::lists::IpList;
use crate::config::rules::RulesConfig;
use crate::config::{parse_yaml, read_file, resolve, MainConfig};
use crate::control::node_edit::EditError;
use crate::lane::rules::Rules;

/// A requested change to the rules.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleChange {
    Enabled(bool),
    Percentage { rule: String, percentage: f64 },
}

/// How the log names a change: `enabled: false`, `rule "beta" percentage: 25`.
impl std::fmt::Display for RuleChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuleChange::Enabled(on) => write!(f, "enabled: {on}"),
            RuleChange::Percentage { rule, percentage } => {
                write!(f, "rule {rule:?} percentage: {percentage}")
            }
        }
    }
}

/// The rule file of `config`. Inline rules live in the main config, whose
/// comments and layout an automatic rewrite would destroy: refused.
pub fn rules_file(config_path: &Path, config: &MainConfig) -> Result<PathBuf, EditError> {
    match (&config.rules, &config.rules_file) {
        (_, Some(p)) => Ok(resolve(&config.root_dir(config_path), p)),
        (Some(_), None) => Err(EditError::Conflict(
            "the rules are inline in the main config; move them to a `rules_file` to manage them through the API".into(),
        )),
        (None, None) => Err(EditError::NotFound("no rules are configured".into())),
    }
}

/// Applies `change` to the rule file's text, returning the new text.
pub fn apply(path: &Path, text: &str, change: &RuleChange) -> Result<String, EditError> {
    let mut root: Value = serde_yaml::from_str(text)
        .map_err(|e| EditError::Conflict(format!("{}: {e}", path.display())))?;
    let map = root
        .as_mapping_mut()
        .ok_or_else(|| EditError::Conflict(format!("{}: not a mapping", path.display())))?;
    match change {
        RuleChange::Enabled(on) => {
            map.insert(Value::from("enabled"), Value::Bool(*on));
        }
        RuleChange::Percentage { rule, percentage } => {
            if !percentage.is_finite() || !(0.0..=100.0).contains(percentage) {
                return Err(EditError::Invalid(format!(
                    "percentage must be between 0 and 100, not {percentage}"
                )));
            }
            let rules = map
                .get_mut("rules")
                .and_then(Value::as_sequence_mut)
                .ok_or_else(|| EditError::NotFound(format!("no rule {rule:?}")))?;
            let r = rules
                .iter_mut()
                .filter_map(Value::as_mapping_mut)
                .find(|m| m.get("name").and_then(Value::as_str) == Some(rule.as_str()))
                .ok_or_else(|| EditError::NotFound(format!("no rule {rule:?}")))?;
            let pct = if percentage.fract() == 0.0 {
                Value::from(*percentage as u64)
            } else {
                Value::from(*percentage)
            };
            r.insert(Value::from("percentage"), pct);
        }
    }
    let body = serde_yaml::to_string(&root).map_err(|e| EditError::Invalid(e.to_string()))?;
    Ok(format!(
        "# Written by graygate's admin API (comments are not kept).\n{body}"
    ))
}

/// Compiles `text` as a rule file, as a load would.
pub fn validate(
    path: &Path,
    text: &str,
    lists: &std::collections::BTreeMap<String, IpList>,
) -> Result<(), EditError> {
    let cfg: RulesConfig = parse_yaml(path, text).map_err(|e| EditError::Invalid(e.to_string()))?;
    Rules::compile(&cfg, path, text, None, lists)
        .map(|_| ())
        .map_err(|e| EditError::Invalid(e.to_string()))
}

/// Reads the rule file.
pub fn read(path: &Path) -> Result<String, EditError> {
    read_file(path).map_err(|e| EditError::Conflict(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "enabled: true\nuid: { header: X-User-Id }\nrules:\n  - name: beta\n    lane: gray\n    percentage: 10\n  - name: staff\n    lane: gray\n    header: { name: X-Staff, values: [\"1\"] }\n";

    #[test]
    fn switch_and_percentage() {
        let p = Path::new("r.yaml");
        let t = apply(p, FILE, &RuleChange::Enabled(false)).unwrap();
        let v: Value = serde_yaml::from_str(&t).unwrap();
        assert_eq!(v["enabled"], Value::Bool(false));
        let t = apply(
            p,
            FILE,
            &RuleChange::Percentage {
                rule: "beta".into(),
                percentage: 25.0,
            },
        )
        .unwrap();
        let v: Value = serde_yaml::from_str(&t).unwrap();
        assert_eq!(v["rules"][0]["percentage"].as_u64(), Some(25));
        validate(p, &t, &Default::default()).unwrap();
    }

    #[test]
    fn bad_changes_are_refused() {
        let p = Path::new("r.yaml");
        let bad = |pct: f64| RuleChange::Percentage {
            rule: "beta".into(),
            percentage: pct,
        };
        assert!(matches!(
            apply(p, FILE, &bad(101.0)),
            Err(EditError::Invalid(_))
        ));
        assert!(matches!(
            apply(p, FILE, &bad(-1.0)),
            Err(EditError::Invalid(_))
        ));
        assert!(matches!(
            apply(p, FILE, &bad(f64::NAN)),
            Err(EditError::Invalid(_))
        ));
        let missing = RuleChange::Percentage {
            rule: "nope".into(),
            percentage: 5.0,
        };
        assert!(matches!(
            apply(p, FILE, &missing),
            Err(EditError::NotFound(_))
        ));
    }
}
