//! Layer: admin. `/rules`: the declarative rules as configured (switch, rules
//! with lane and percentage, deny names, fallback), and their management —
//! `PATCH /rules {"enabled": bool}` and `PATCH /rules/{name} {"percentage":
//! 0..100}` — written back to the rule file (see [`crate::control::rule_edit`])
//! and applied through [`Gateway::reload`].

use std::sync::Arc;

use crate::base::body::RequestBody;
use http::{Method, Request, Response, StatusCode};
use serde::Deserialize;

use crate::base::body::Body;
use crate::config::rules::RulesConfig;
use crate::config::{parse_yaml, FORMAL};
use crate::control::node_edit::{self, EditError};
use crate::control::rule_edit::{self, RuleChange};
use crate::control::Gateway;

use super::{json, read_json, text};

fn describe(cfg: &RulesConfig) -> serde_json::Value {
    serde_json::json!({
        "enabled": cfg.enabled,
        "rules": cfg.rules.iter().map(|r| serde_json::json!({
            "name": r.name,
            "lane": r.lane,
            "percentage": r.percentage,
        })).collect::<Vec<_>>(),
        "deny": cfg.deny.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
        "fallback": cfg.fallback.clone().unwrap_or_else(|| FORMAL.to_string()),
    })
}

/// The `/rules` document: where the rules live and what they say.
pub fn list(gw: &Gateway) -> serde_json::Value {
    let gen = gw.current();
    let mut doc = match (&gen.config.rules, &gen.config.rules_file) {
        (Some(cfg), _) => {
            let mut d = describe(cfg);
            d["source"] = "inline".into();
            d["file"] = gen.config_path.display().to_string().into();
            d["text"] = serde_json::Value::Null;
            d
        }
        (None, Some(_)) => match rule_edit::rules_file(&gen.config_path, &gen.config) {
            Ok(path) => {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let mut d = match parse_yaml::<RulesConfig>(&path, &text) {
                    Ok(cfg) => describe(&cfg),
                    Err(e) => serde_json::json!({"error": e.to_string()}),
                };
                d["source"] = "file".into();
                d["file"] = path.display().to_string().into();
                d["text"] = text.into();
                d
            }
            Err(e) => serde_json::json!({"error": e.to_string()}),
        },
        (None, None) => serde_json::json!({"source": null, "rules": [], "deny": []}),
    };
    doc["generation"] = gen.id.into();
    doc
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Switch {
    enabled: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Percentage {
    percentage: f64,
}

/// Routes `/rules` requests (`rest` is the path after `rules`).
pub async fn handle(gw: &Arc<Gateway>, req: Request<RequestBody>, rest: &[&str]) -> Response<Body> {
    let method = req.method().clone();
    let if_match = super::nodes::if_match(&req);
    let change = match (&method, rest) {
        (&Method::GET, []) => return json(list(gw)),
        (&Method::PATCH, []) => match read_json::<Switch>(req.into_body()).await {
            Ok(s) => RuleChange::Enabled(s.enabled),
            Err(r) => return r.response(),
        },
        (&Method::PATCH, [name]) => match read_json::<Percentage>(req.into_body()).await {
            Ok(p) => RuleChange::Percentage {
                rule: percent_encoding::percent_decode_str(name)
                    .decode_utf8_lossy()
                    .into_owned(),
                percentage: p.percentage,
            },
            Err(r) => return r.response(),
        },
        (_, [] | [_]) => return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => return text(StatusCode::NOT_FOUND, "not found"),
    };
    let result = match &gw.store {
        Some(store) => store.edit_rules(gw, change, if_match).await,
        None => edit(gw, change).await,
    };
    match result {
        Ok(v) => json(v),
        Err(EditError::NotFound(m)) => text(StatusCode::NOT_FOUND, m),
        Err(EditError::Invalid(m)) => text(StatusCode::BAD_REQUEST, m),
        Err(EditError::Conflict(m)) => text(StatusCode::CONFLICT, m),
    }
}

/// Validates, writes back and reloads. One change at a time (shared with
/// node management).
async fn edit(gw: &Arc<Gateway>, change: RuleChange) -> Result<serde_json::Value, EditError> {
    let _one_at_a_time = gw.edit_lock.lock().await;
    let gw2 = gw.clone();
    tokio::task::spawn_blocking(move || -> Result<serde_json::Value, EditError> {
        let gen = gw2.current();
        let path = rule_edit::rules_file(&gen.config_path, &gen.config)?;
        let text = rule_edit::read(&path)?;
        let new_text = rule_edit::apply(&path, &text, &change)?;
        rule_edit::validate(&path, &new_text, &gen.lane.lists)?;
        let generation = node_edit::commit(&gw2, &path, &new_text)?;
        tracing::info!(file = %path.display(), change = %change, "rule file changed through the admin API");
        Ok(serde_json::json!({
            "file": path,
            "generation": generation,
        }))
    })
    .await
    .map_err(|e| EditError::Conflict(format!("edit task failed: {e}")))?
}
