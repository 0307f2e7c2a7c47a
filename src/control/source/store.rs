//! Layer: control plane. The configuration-store seam: a gateway started
//! from a bootstrap holds one [`Store`] (etcd keys or Nacos config data
//! ids), and everything outside `control::source` — admin edits, reloads,
//! releases, `/status`, `/fleet`, the stop — acts through its one method
//! set, never on a store by name. A files gateway has no store: its
//! documents are on disk (`node_edit`, `rule_edit`, `reload`).
//!
//! What differs between stores is said by what the methods return: the
//! store's [`name`](Store::name), whether it takes compare-and-swap edits
//! (both do: etcd by mod revision, Nacos config by the content's MD5),
//! and whether it shares release state across a fleet
//! ([`Store::shared_releases`]: etcd's release keys; with Nacos config each
//! gateway keeps release state on its own disk).

use std::path::PathBuf;
use std::sync::Arc;

use super::etcd::{self, EtcdSource};
use super::nacos_config::{self, NacosConfigSource};
use super::nacos_edit;
use crate::config::release::ReleaseRecord;
use crate::config::ConfigError;
use crate::control::node_edit::{EditError, NodeChange};
use crate::control::rule_edit::RuleChange;
use crate::control::Gateway;

pub use super::etcd::fleet::{leadership_view, GatewayCounts, Guard, Leadership, Sample};

/// The configuration store a gateway runs on.
#[derive(Clone)]
pub enum Store {
    /// Every document a key under a prefix (one revision a snapshot).
    Etcd(Arc<EtcdSource>),
    /// Every document a data id of one group in Nacos config.
    Nacos(Arc<NacosConfigSource>),
}

impl Store {
    /// The store's name as operators know it (`/status` `source`, errors).
    pub fn name(&self) -> &'static str {
        match self {
            Store::Etcd(_) => "etcd",
            Store::Nacos(_) => "nacos",
        }
    }

    /// The store's name for messages (`etcd`, `Nacos config`).
    pub fn title(&self) -> &'static str {
        match self {
            Store::Etcd(_) => "etcd",
            Store::Nacos(_) => "Nacos config",
        }
    }

    /// A rebuild of what the gateway serves (a release step, a discovery
    /// push): the applied snapshot built again, the store not read.
    /// Blocking.
    pub fn rebuild_current(&self, gw: &Gateway) -> Result<u64, ConfigError> {
        match self {
            Store::Etcd(s) => s.rebuild_current(gw),
            Store::Nacos(s) => s.rebuild_current(gw),
        }
    }

    /// An admin node edit written back to the store with compare-and-swap
    /// (`if_match`: the revision the caller read, where the store has
    /// revisions; Nacos config: the content's MD5). The change comes back
    /// through the watch.
    pub async fn edit_node(
        &self,
        gw: &Gateway,
        service: &str,
        change: NodeChange,
        if_match: Option<i64>,
    ) -> Result<serde_json::Value, EditError> {
        let _one_at_a_time = gw.edit_lock.lock().await;
        match self {
            Store::Etcd(s) => etcd::edit_node(gw, s, service, change, if_match).await,
            Store::Nacos(s) => nacos_edit::edit_node(gw, s, service, change).await,
        }
    }

    /// An admin rule edit written back to the store (as [`Self::edit_node`]).
    pub async fn edit_rules(
        &self,
        gw: &Gateway,
        change: RuleChange,
        if_match: Option<i64>,
    ) -> Result<serde_json::Value, EditError> {
        let _one_at_a_time = gw.edit_lock.lock().await;
        match self {
            Store::Etcd(s) => etcd::edit_rules(gw, s, change, if_match).await,
            Store::Nacos(s) => nacos_edit::edit_rules(gw, s, change).await,
        }
    }

    /// Whether the store keeps a list of its gateways (`/fleet`).
    pub fn keeps_fleet(&self) -> bool {
        matches!(self, Store::Etcd(_))
    }

    /// `GET /fleet`: every gateway of the store's fleet, or why there is
    /// none (`Err((found, message))`: `found` false when the store keeps
    /// no fleet).
    pub async fn fleet(&self) -> Result<serde_json::Value, (bool, String)> {
        match self {
            Store::Etcd(s) => etcd::fleet(s).await.map_err(|e| (true, format!("etcd: {e}"))),
            Store::Nacos(_) => Err((
                false,
                "no fleet: the Nacos config source keeps no gateway list (each gateway's /status shows its own state)".into(),
            )),
        }
    }

    /// Release state shared by the fleet through the store, when it does
    /// (etcd); `None`: each gateway keeps it in its own state file.
    pub fn shared_releases(&self) -> Option<SharedReleases> {
        match self {
            Store::Etcd(s) => Some(SharedReleases(s.clone())),
            Store::Nacos(_) => None,
        }
    }

    /// Keeps `gw` on the store's newest state (and SIGHUP re-reading it).
    pub(super) fn watch(&self, gw: &Arc<Gateway>) {
        match self {
            Store::Etcd(s) => {
                tokio::spawn(etcd::run(gw.clone(), s.clone()));
            }
            Store::Nacos(s) => {
                tokio::spawn(nacos_config::run(gw.clone(), s.clone()));
            }
        }
    }

    /// At a graceful stop: the release leadership given up, then the
    /// gateway's own status in the store removed.
    pub async fn leave(&self, gw: &Gateway) {
        if let Some(r) = self.shared_releases() {
            etcd::fleet::resign(gw, &r.0).await;
        }
        if let Store::Etcd(s) = self {
            etcd::leave(s).await;
        }
    }
}

/// Release state kept in the store and shared by every gateway of the
/// fleet: one elected gateway ticks the releases on everyone's summed
/// counters; any gateway's admin action is a compare-and-swap write.
#[derive(Clone)]
pub struct SharedReleases(Arc<EtcdSource>);

impl SharedReleases {
    /// The store's name for messages.
    pub fn title(&self) -> &'static str {
        "etcd"
    }

    /// Every release in the store now, with its version, and the version
    /// of the whole read.
    pub async fn load(&self) -> Result<(Vec<(ReleaseRecord, i64)>, i64), String> {
        etcd::fleet::load(&self.0).await
    }

    /// Every release in the snapshot this gateway serves.
    pub fn list(&self) -> Vec<ReleaseRecord> {
        etcd::fleet::list(&self.0)
    }

    /// Writes `r` if `guard` holds: `Ok(Some(version))` written, `Ok(None)`
    /// a concurrent change or a lost term.
    pub async fn write(&self, r: &ReleaseRecord, guard: &Guard) -> Result<Option<i64>, String> {
        etcd::fleet::write(&self.0, r, guard).await
    }

    /// Every gateway's summed counters now.
    pub async fn sample(&self) -> Result<Sample, String> {
        etcd::fleet::sample(&self.0).await
    }

    /// The version of the store this gateway serves (its releases
    /// included).
    pub fn serving_version(&self) -> Option<i64> {
        self.0.applied().map(|s| s.revision)
    }

    /// Where release `name` lives in the store (for errors).
    pub fn key_path(&self, name: &str) -> PathBuf {
        etcd::fleet::key_path(&self.0, name)
    }

    /// Waits until this gateway applied version `rev` written to `key`.
    pub async fn wait_applied(&self, gw: &Gateway, key: &str, rev: i64) -> Result<u64, String> {
        self.0.wait_applied(gw, key, rev).await
    }

    /// The election, run until the process ends.
    pub async fn campaign(self, gw: Arc<Gateway>) {
        etcd::fleet::campaign(gw, self.0).await
    }

    /// This gateway's counters published, until the process ends.
    pub async fn publish_counters(self, gw: Arc<Gateway>) {
        etcd::fleet::publish_counters(gw, self.0).await
    }
}
