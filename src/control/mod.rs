//! Layer: control plane — the only writer. Config sources (the files today) →
//! generation build and validation (`build`) → swap (`gateway`); the reload
//! watcher and SIGHUP (`reload`); admin edits written back to node and rule
//! files (`node_edit`, `rule_edit`); traffic history for the dashboard
//! (`stats`); binary upgrade, pid file and systemd notification (`upgrade`). It may use every data-plane layer; none of them imports it.

pub mod build;
pub mod gateway;
pub mod node_edit;
pub mod release;
pub mod reload;
pub mod rule_edit;
pub mod stats;
pub mod upgrade;

pub use gateway::Gateway;
