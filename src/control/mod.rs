//! Layer: control plane — the only writer. Config sources (`source`: the
//! files, or etcd) → generation build and validation (`build`) → swap
//! (`gateway`); the file watcher and SIGHUP (`reload`); the etcd service
//! registry and its sidecar (`registry`); node host names resolved and
//! kept current (`names`); admin edits written back to node
//! and rule documents (`node_edit`, `rule_edit`); traffic history for the
//! dashboard (`stats`); progressive releases (`release`); binary upgrade,
//! pid file and systemd notification (`upgrade`). It may use every
//! data-plane layer; none of them imports it.

pub mod build;
pub mod gateway;
pub mod names;
pub mod node_edit;
pub mod registry;
pub mod release;
pub mod reload;
pub mod rule_edit;
pub mod source;
pub mod stats;
pub mod upgrade;

pub use gateway::Gateway;

/// At a graceful stop (not a handover): a fleet gateway gives up the
/// release leadership, then leaves its configuration source (an etcd
/// gateway removes its status key).
pub async fn leave(gw: &Gateway) {
    if let Some(src) = &gw.etcd {
        release::fleet::resign(gw, src).await;
    }
    source::leave(gw).await;
}
