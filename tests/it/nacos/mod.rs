//! Nacos: services discovered in Nacos naming, with a real Nacos-protocol
//! server (`rnacos`, started by `harness::nacos` on free loopback ports),
//! instances registered through its HTTP API or by Nacos's official
//! Python client, and the real graygate binary.

mod cluster;
mod config;
mod discovery;
mod store;
