//! Layer: control plane. Configuration sources: where the documents of a
//! generation come from. `files` (the default): the main file and what it
//! names, watched with notify and SIGHUP. `etcd`: every document is a key
//! under a prefix, read at one revision (one range read: a consistent
//! snapshot), watched from that revision + 1, the last applied snapshot kept
//! on disk for starts while etcd is down. Both hand the same builder
//! (`control::build`) a set of named documents, so validation and errors
//! (document:line) are the same.

pub mod etcd;
pub mod files;

/// Which source a gateway runs on and how it stands, for `/status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SourceStatus {
    /// `files` or `etcd`.
    pub source: &'static str,
    /// etcd: `live` (applied from the store) or `cached` (from the
    /// last-known-good snapshot on disk, the store not reached yet).
    pub source_state: Option<&'static str>,
    /// etcd: the revision of the newest change the serving generation holds.
    pub revision: Option<i64>,
    /// etcd: SHA-256 of the snapshot's keys and values.
    pub config_hash: Option<String>,
    /// etcd: the last connection or watch problem (cleared once live).
    pub store_error: Option<String>,
    /// etcd: this gateway's id in `<prefix>/status/<id>`.
    pub gateway_id: Option<String>,
}
