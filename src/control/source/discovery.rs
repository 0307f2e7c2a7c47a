//! Layer: control plane. The discovery seam: where the nodes of a service
//! a route names come from when no node file (nor a store's registry)
//! defines it. Today one discovery source, Nacos naming (`nacos.discovery`,
//! kept current by subscription in `super::nacos`); the build, `/nodes`
//! and `/status` ask here and never name it. The etcd registry is not
//! here: its instances are keys of the etcd snapshot, handed to the build
//! with the documents (`super::RegisteredServices`).

use crate::config::{MainConfig, ServiceConfig};
use crate::control::Gateway;

/// A problem in a discovery section of the main settings: the section
/// (`nacos:`), the key and the message.
pub struct SectionError {
    pub section: &'static str,
    pub key: String,
    pub message: String,
}

/// The discovery settings of `config` checked.
pub fn check(config: &MainConfig) -> Result<(), SectionError> {
    match &config.nacos {
        Some(n) => n.check().map_err(|(key, message)| SectionError {
            section: "nacos:",
            key: key.to_string(),
            message,
        }),
        None => Ok(()),
    }
}

/// Whether `config` discovers services (a route naming an unknown service
/// then gets an empty node set kept current, not an error).
pub fn enabled(config: &MainConfig) -> bool {
    config.nacos.as_ref().is_some_and(|n| n.discovery.is_some())
}

/// The name of the discovery source `config` uses (`/nodes`
/// `discovery`), if any.
pub fn name(config: &MainConfig) -> Option<&'static str> {
    enabled(config).then_some("nacos")
}

/// Service `name` as discovery knows it now: its settings with the
/// instances as nodes, and warnings for instances left out. `None`:
/// `config` discovers nothing.
pub fn service(config: &MainConfig, name: &str) -> Option<(ServiceConfig, Vec<String>)> {
    let nacos = config.nacos.as_ref()?;
    let disc = nacos.discovery.as_ref()?;
    Some(super::nacos::service(nacos, disc, name))
}

/// The discovery section of `/status` (its key and value), if any.
pub fn status(gw: &Gateway) -> Option<(&'static str, serde_json::Value)> {
    super::nacos::status(gw).map(|v| ("nacos", v))
}
