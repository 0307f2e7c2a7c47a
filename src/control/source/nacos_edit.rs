//! Layer: control plane. Admin edits when the source is Nacos config: a
//! node or rule document is edited as in the files case and published
//! back to its data id with compare-and-swap — the data id must still
//! hold what this gateway serves (read first), and the publish carries
//! that content's MD5 (`publish_config_cas`: a Nacos server refuses it if
//! the data id changed in between). The change then comes back through
//! the listener like any push; the answer comes once this gateway has
//! applied (or rejected) it.

use std::path::Path;
use std::time::Duration;

use nacos_sdk::api::config::ConfigService;

use super::nacos_config::{connect, NacosConfigSource};
use crate::control::node_edit::{self, EditError, NodeChange};
use crate::control::rule_edit::{self, RuleChange};
use crate::control::Gateway;

/// How long an edit waits for its own push to be applied.
const APPLY_WITHIN: Duration = Duration::from_secs(10);

impl NacosConfigSource {
    /// The data id and the serving text of the document at `path` (a path
    /// under the build's `nacos:<group>` root).
    fn document(&self, path: &Path) -> Result<(String, String), EditError> {
        let snap = self
            .applied()
            .ok_or_else(|| EditError::Conflict("no snapshot applied yet".into()))?;
        let id = path
            .strip_prefix(self.place.root())
            .ok()
            .map(|rel| {
                rel.iter()
                    .filter_map(|p| p.to_str())
                    .collect::<Vec<_>>()
                    .join(":")
            })
            .filter(|id| !id.is_empty())
            .ok_or_else(|| {
                EditError::Conflict(format!("{}: not a data id of this gateway", path.display()))
            })?;
        let text = snap.docs.get(&id).cloned().ok_or_else(|| {
            EditError::NotFound(format!(
                "no data id {id} in group {} of Nacos config",
                self.place.group
            ))
        })?;
        Ok((id, text))
    }

    /// The client edits publish with, and SIGHUP reads with (made on
    /// first use, kept: its connection is not the listening one, which
    /// may be the one that stopped delivering).
    pub(super) async fn writer(&self) -> Result<ConfigService, EditError> {
        let mut w = self.writer.lock().await;
        if let Some(c) = w.as_ref() {
            return Ok(c.clone());
        }
        let c = connect(&self.boot.nacos, None)
            .await
            .map_err(|e| EditError::Conflict(format!("Nacos config: {e}")))?;
        *w = Some(c.clone());
        Ok(c)
    }

    /// Publishes `new` to data id `id` if it still holds `old` (what this
    /// gateway serves), then waits until this gateway applied it (or
    /// rejected the build). Returns the generation serving.
    async fn publish_edit(
        &self,
        gw: &Gateway,
        id: &str,
        old: &str,
        new: &str,
    ) -> Result<u64, EditError> {
        let client = self.writer().await?;
        let group = self.place.group.clone();
        let timeout = Duration::from_millis(self.boot.nacos.timeout_ms.max(3_000));
        let nacos = |e: String| EditError::Conflict(format!("Nacos config, data id {id}: {e}"));
        let now = tokio::time::timeout(timeout, client.get_config(id.into(), group.clone()))
            .await
            .map_err(|_| nacos("no answer".into()))?
            .map_err(|e| nacos(e.to_string()))?;
        if now.content() != old {
            return Err(EditError::Conflict(format!(
                "data id {id} (group {group}) changed in Nacos since this gateway applied it (a concurrent edit): read it again"
            )));
        }
        let rejected_before = self.rejected(gw);
        let put = client.publish_config_cas(
            id.into(),
            group.clone(),
            new.into(),
            Some("text".into()),
            now.md5().clone(),
        );
        match tokio::time::timeout(timeout, put).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                return Err(EditError::Conflict(format!(
                    "data id {id} (group {group}): Nacos refused the compare-and-swap publish (a concurrent edit): read it again"
                )))
            }
            Ok(Err(e)) => return Err(nacos(e.to_string())),
            Err(_) => return Err(nacos("no answer to the publish".into())),
        }
        tracing::info!(data_id = %id, group = %group, "admin edit published to Nacos config");
        let deadline = tokio::time::Instant::now() + APPLY_WITHIN;
        loop {
            let applied = self
                .applied()
                .is_some_and(|s| s.docs.get(id).map(String::as_str) == Some(new));
            if applied {
                return Ok(gw.current().id);
            }
            if self.latest_has(id, new) && self.rejected(gw) > rejected_before {
                let e = gw.last_reload_error();
                return Err(EditError::Conflict(format!(
                    "published to data id {id}, but the build was rejected: {e}"
                )));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(EditError::Conflict(format!(
                    "published to data id {id}, but not pushed back and applied within {} s",
                    APPLY_WITHIN.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn rejected(&self, gw: &Gateway) -> u64 {
        gw.status.lock().unwrap_or_else(|e| e.into_inner()).rejected
    }
}

/// An admin node edit on the Nacos config source: the node document (the
/// `node_files` data id defining the service) edited and published back.
pub async fn edit_node(
    gw: &Gateway,
    src: &NacosConfigSource,
    service: &str,
    change: NodeChange,
) -> Result<serde_json::Value, EditError> {
    let (path, text, id) = super::node_document_of(
        gw,
        service,
        |path| src.document(path).map(|(id, text)| (text, id)),
        "a service discovered in Nacos naming changes there",
    )?;
    let new_text = node_edit::edit(&path, &text, service, change)?;
    let generation = src.publish_edit(gw, &id, &text, &new_text).await?;
    Ok(serde_json::json!({
        "key": path,
        "data_id": id,
        "group": src.place.group,
        "generation": generation,
        "service": service,
    }))
}

/// An admin rule edit on the Nacos config source (published back as
/// above).
pub async fn edit_rules(
    gw: &Gateway,
    src: &NacosConfigSource,
    change: RuleChange,
) -> Result<serde_json::Value, EditError> {
    let gen = gw.current();
    let path = rule_edit::rules_file(&gen.config_path, &gen.config)?;
    let (id, text) = src.document(&path)?;
    let new_text = rule_edit::apply(&path, &text, &change)?;
    rule_edit::validate(&path, &new_text, &gen.lane.lists)?;
    let generation = src.publish_edit(gw, &id, &text, &new_text).await?;
    Ok(serde_json::json!({
        "key": path,
        "data_id": id,
        "group": src.place.group,
        "generation": generation,
    }))
}
