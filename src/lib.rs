//! graygate: a lane-routing edge gateway for gray (canary) releases.
//!
//! The request journey: [`config`] files are loaded into an immutable
//! [`generation::Generation`]; [`lane`] decides each request's lane (trusted
//! tag, Lua script); [`nodes`] picks a node of that lane (or formal);
//! [`proxy`] forwards it, or [`static_files`] serves the lane's asset;
//! [`reload`] swaps generations on file change; [`metrics`] and
//! [`access_log`] record each request; [`admin`] reports and controls.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod client_conn;
pub mod config;
pub mod demo;
pub mod fuzz_entry;
pub mod gateway;
pub mod generation;
pub mod health;
pub mod lane;
pub mod lists;
pub mod metrics;
pub mod node_edit;
pub mod nodes;
pub mod proxy;
pub mod reload;
pub mod rule_edit;
pub mod static_files;
pub mod sticky;
pub mod upbody;
pub mod upstream;
