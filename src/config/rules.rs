//! Layer: config (bottom). The YAML form of the declarative gray rules (inline
//! `rules:` or a `rules_file`); `lane::rules` compiles it.
//!
//! Two forms are read: the mapping (`uid`, `deny`, `rules`, `fallback`,
//! `enabled`) and, as a shorthand, a bare list of rules — what an operator
//! writes under the main file's `rules:` key, the way nginx and APISIX list
//! their rules. The list is the mapping's `rules` with everything else at its
//! default (no uid source, no deny rules, fallback formal).

use std::fmt;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A rule file (or the inline `rules:` block of the main config): the
/// mapping, or a bare list of rules (see the module note).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(remote = "Self", default, deny_unknown_fields)]
pub struct RulesConfig {
    /// Master switch: `false` skips deny, rules and fallback alike.
    pub enabled: bool,
    /// Where the uid comes from (header, cookie or query argument).
    pub uid: Option<SourceConfig>,
    /// Checked first; a match sends the request to formal, final.
    pub deny: Vec<RuleConfig>,
    /// Ordered; the first rule whose conditions all hold decides.
    pub rules: Vec<RuleConfig>,
    /// Lane when no rule matches (default formal).
    pub fallback: Option<String>,
}

impl<'de> Deserialize<'de> for RulesConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Form;
        impl<'de> Visitor<'de> for Form {
            type Value = RulesConfig;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of rules, or a mapping of `rules`, `uid`, `deny`, `fallback` and `enabled`")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<RulesConfig, A::Error> {
                let rules = Vec::<RuleConfig>::deserialize(SeqAccessDeserializer::new(seq))?;
                Ok(RulesConfig {
                    rules,
                    ..RulesConfig::default()
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RulesConfig, A::Error> {
                RulesConfig::deserialize(MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_any(Form)
    }
}

impl Serialize for RulesConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RulesConfig::serialize(self, s)
    }
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            enabled: true,
            uid: None,
            deny: Vec::new(),
            rules: Vec::new(),
            fallback: None,
        }
    }
}

/// Exactly one of `header`, `cookie`, `query` (and, for percentage keys
/// only, `ip: true`).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SourceConfig {
    pub header: Option<String>,
    pub cookie: Option<String>,
    pub query: Option<String>,
    pub ip: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// A YAML scalar taken as text (`42` and `"42"` alike).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Scalar {
    Int(i64),
    Text(String),
}

impl Scalar {
    pub fn text(&self) -> String {
        match self {
            Scalar::Int(i) => i.to_string(),
            Scalar::Text(s) => s.clone(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub name: String,
    /// Required for `rules`, absent for `deny`.
    #[serde(default)]
    pub lane: Option<String>,
    #[serde(default)]
    pub ip: Option<IpConfig>,
    #[serde(default)]
    pub header: Option<OneOrMany<MatchConfig>>,
    #[serde(default)]
    pub cookie: Option<OneOrMany<MatchConfig>>,
    #[serde(default)]
    pub query: Option<OneOrMany<MatchConfig>>,
    #[serde(default)]
    pub uid: Option<UidConfig>,
    #[serde(default)]
    pub path_prefix: Option<OneOrMany<String>>,
    /// 0–100: the request matches when bucket(key) < percentage.
    #[serde(default)]
    pub percentage: Option<f64>,
    /// Key of the percentage bucket (default: the uid source).
    #[serde(default)]
    pub key: Option<SourceConfig>,
}

/// CIDRs/addresses, or `{ list: name }` naming a configured IP list.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum IpConfig {
    Cidrs(Vec<String>),
    List { list: String },
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    pub name: String,
    #[serde(default)]
    pub values: Option<Vec<Scalar>>,
    #[serde(default)]
    pub regex: Option<String>,
}

/// ABTestingGateway's uidappoint (`in`), uidrange (`ranges`) and
/// uidsuffix (`suffix`); the condition holds when any given form matches.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UidConfig {
    #[serde(rename = "in")]
    pub list: Vec<Scalar>,
    pub ranges: Vec<RangeConfig>,
    pub suffix: Vec<Scalar>,
}

/// `[lo, hi]` or `"lo-hi"`, inclusive.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum RangeConfig {
    Pair([u64; 2]),
    Text(String),
}
