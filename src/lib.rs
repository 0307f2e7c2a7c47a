//! graygate: a lane-routing edge gateway for gray (canary) releases.
//!
//! The layers, each importing only from those below it (a test,
//! `tests/it/layering.rs`, keeps it so):
//!
//! ```text
//!  demo, fuzz_entry          tools for the shipped example and the fuzzers
//!  admin                     admin API, dashboard           ┐
//!  control                   build → swap, reload, edits    ┘ control plane
//!  server                    listeners, client connections  ┐
//!  proxy                     the request phases             │
//!  generation                the immutable snapshot         │ data plane
//!  lane · nodes              lane decision · node choice    │
//!  upstream · static_files   node exchange · lane assets    ┘
//!  observe                   metrics, access log, node counters
//!  base                      body, clock, decision, error, lists
//!  config                    YAML types, file:line errors
//! ```
#![forbid(unsafe_code)]

pub mod admin;
pub mod base;
pub mod codec;
pub mod config;
pub mod control;
pub mod demo;
pub mod fuzz_entry;
pub mod generation;
pub mod lane;
pub mod nodes;
pub mod observe;
pub mod proxy;
pub mod server;
pub mod static_files;
pub mod upstream;
