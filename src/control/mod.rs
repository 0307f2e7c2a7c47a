//! Layer: control plane — the only writer. Config sources (`source`: the
//! files, or a configuration store behind one seam, `source::Store`; and
//! service discovery) → generation build and validation (`build`) → swap
//! (`gateway`); the file watcher and SIGHUP (`reload`); node host names resolved and
//! kept current (`names`); admin edits written back to node
//! and rule documents (`node_edit`, `rule_edit`); traffic history for the
//! dashboard (`stats`); progressive releases (`release`); binary upgrade,
//! pid file and systemd notification (`upgrade`). It may use every
//! data-plane layer; none of them imports it.

pub mod build;
pub mod gateway;
pub mod names;
pub mod node_edit;
pub mod release;
pub mod reload;
pub mod rule_edit;
pub mod source;
pub mod stats;
pub mod upgrade;

pub use gateway::Gateway;

/// At a graceful stop (not a handover): a fleet gateway gives up the
/// release leadership, then leaves its configuration store
/// (`source::Store::leave`).
pub async fn leave(gw: &Gateway) {
    source::leave(gw).await;
}
