//! Layer: control plane. Admin edits when the source is etcd: a node or
//! rule document is edited as in the files case and written back with
//! compare-and-swap on the mod revision this gateway's snapshot holds, so a
//! concurrent edit is a 409, never a lost update; the answer comes once this
//! gateway has applied (or rejected) the revision written.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::PutOptions;

use super::registry;
use super::EtcdSource;
use crate::control::node_edit::EditError;
use crate::control::Gateway;

impl EtcdSource {
    /// The text and mod revision of `path` in the serving snapshot.
    pub fn document(&self, path: &Path) -> Result<(String, i64), EditError> {
        let snap = self
            .applied()
            .ok_or_else(|| EditError::Conflict("no snapshot applied yet".into()))?;
        let key = path.to_string_lossy();
        let kv = snap
            .kvs
            .get(key.as_ref())
            .ok_or_else(|| EditError::NotFound(format!("no key {key}")))?;
        let text = String::from_utf8(kv.value.clone())
            .map_err(|_| EditError::Conflict(format!("{key}: not valid UTF-8")))?;
        Ok((text, kv.mod_revision))
    }

    /// Writes `text` to `path`'s key if it still has `mod_revision`
    /// (compare-and-swap); a concurrent change → `Conflict` (409). Returns
    /// the revision written, once this gateway has applied it.
    pub async fn compare_and_put(
        &self,
        gw: &Gateway,
        path: &Path,
        text: &str,
        mod_revision: i64,
    ) -> Result<u64, EditError> {
        self.compare_and_swap(gw, path, Some(text), mod_revision)
            .await
    }

    /// Compare-and-swap on `path`'s mod revision: put `text` (keeping the
    /// key's lease, if any) or, with `None`, delete the key.
    pub async fn compare_and_swap(
        &self,
        gw: &Gateway,
        path: &Path,
        text: Option<&str>,
        mod_revision: i64,
    ) -> Result<u64, EditError> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let key = path.to_string_lossy().into_owned();
        let op = match text {
            Some(t) => {
                let leased = self
                    .applied()
                    .and_then(|s| s.kvs.get(&key).map(|_| ()))
                    .is_some()
                    && key.contains("/nodes/")
                    && key.starts_with(&format!("{}/services/", self.prefix));
                let opts = leased.then(|| PutOptions::new().with_ignore_lease());
                TxnOp::put(key.as_str(), t, opts)
            }
            None => TxnOp::delete(key.as_str(), None),
        };
        let mut c = self
            .client()
            .await
            .map_err(|e| EditError::Conflict(format!("etcd: {e}")))?;
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                mod_revision,
            )])
            .and_then(vec![op]);
        let resp = match tokio::time::timeout(self.timeout(), c.txn(txn)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.failed().await;
                return Err(EditError::Conflict(format!("etcd: {e}")));
            }
            Err(_) => {
                self.failed().await;
                return Err(EditError::Conflict("etcd: timed out".into()));
            }
        };
        if !resp.succeeded() {
            return Err(EditError::Conflict(format!(
                "{key} was changed since revision {mod_revision} (a concurrent edit); read it again"
            )));
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        self.wait_applied(gw, &key, rev)
            .await
            .map_err(EditError::Conflict)
    }

    /// Waits until this gateway applied revision `rev` (written to `key`),
    /// or rejected its build. Returns the generation serving.
    pub async fn wait_applied(&self, gw: &Gateway, key: &str, rev: i64) -> Result<u64, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if self.applied().is_some_and(|s| s.revision >= rev) {
                return Ok(gw.current().id);
            }
            if self.seen.load(Ordering::Acquire) >= rev {
                let e = gw.last_reload_error();
                return Err(format!(
                    "written to {key} at revision {rev}, but the build was rejected: {e}"
                ));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "written to {key} at revision {rev}, but not applied yet"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The revision an admin request says it read (`If-Match: <revision>`):
/// when given it must be the one this gateway serves, else 409.
fn check_if_match(src: &EtcdSource, if_match: Option<i64>) -> Result<(), EditError> {
    let serving = src.applied().map_or(0, |s| s.revision);
    match if_match {
        Some(r) if r != serving => Err(EditError::Conflict(format!(
            "you read revision {r}, this gateway serves revision {serving}: read again"
        ))),
        _ => Ok(()),
    }
}

/// An admin node edit when the source is etcd: the node document (the
/// `node_files` key defining the service) is edited as in the files case
/// and written back with compare-and-swap on the mod revision this
/// gateway's snapshot holds. A concurrent edit → 409, never a lost update.
pub async fn edit_node(
    gw: &Gateway,
    src: &EtcdSource,
    service: &str,
    change: crate::control::node_edit::NodeChange,
    if_match: Option<i64>,
) -> Result<serde_json::Value, EditError> {
    use crate::control::node_edit;
    check_if_match(src, if_match)?;
    // A registered instance: weight and drain (or removal) change its own
    // key, keeping its lease.
    if let node_edit::NodeChange::Update { node, .. } | node_edit::NodeChange::Remove(node) =
        &change
    {
        let key = PathBuf::from(registry::node_key(&src.prefix, service, node));
        if let Ok((text, rev)) = src.document(&key) {
            let new_text = match change {
                node_edit::NodeChange::Remove(_) => None,
                node_edit::NodeChange::Update {
                    lane,
                    weight,
                    drain,
                    ..
                } => {
                    if lane.is_some() {
                        return Err(EditError::Invalid(
                            "a registered instance's lane comes from its registration; register it again".into(),
                        ));
                    }
                    let mut inst: registry::Instance = serde_json::from_str(&text)
                        .map_err(|e| EditError::Conflict(format!("{}: {e}", key.display())))?;
                    if let Some(w) = weight {
                        inst.weight = w;
                    }
                    if let Some(d) = drain {
                        inst.drain = d;
                    }
                    Some(
                        serde_json::to_string(&inst)
                            .map_err(|e| EditError::Invalid(e.to_string()))?,
                    )
                }
                node_edit::NodeChange::Add(_) => unreachable!(),
            };
            let generation = src
                .compare_and_swap(gw, &key, new_text.as_deref(), rev)
                .await?;
            return Ok(serde_json::json!({
                "key": key,
                "generation": generation,
                "service": service,
                "revision": src.applied().map(|s| s.revision),
            }));
        }
    }
    let (path, text, rev) = super::super::node_document_of(
        gw,
        service,
        |path| src.document(path),
        "registered instances change through their own keys",
    )?;
    let new_text = node_edit::edit(&path, &text, service, change)?;
    let generation = src.compare_and_put(gw, &path, &new_text, rev).await?;
    Ok(serde_json::json!({
        "key": path,
        "generation": generation,
        "service": service,
        "revision": src.applied().map(|s| s.revision),
    }))
}

/// An admin rule edit when the source is etcd (compare-and-swap as above).
pub async fn edit_rules(
    gw: &Gateway,
    src: &EtcdSource,
    change: crate::control::rule_edit::RuleChange,
    if_match: Option<i64>,
) -> Result<serde_json::Value, EditError> {
    use crate::control::rule_edit;
    check_if_match(src, if_match)?;
    let gen = gw.current();
    let path = rule_edit::rules_file(&gen.config_path, &gen.config)?;
    let (text, rev) = src.document(&path)?;
    let new_text = rule_edit::apply(&path, &text, &change)?;
    rule_edit::validate(&path, &new_text, &gen.lane.lists)?;
    let generation = src.compare_and_put(gw, &path, &new_text, rev).await?;
    Ok(serde_json::json!({
        "key": path,
        "generation": generation,
        "revision": src.applied().map(|s| s.revision),
    }))
}
