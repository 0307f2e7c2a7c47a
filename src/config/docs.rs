//! Layer: config. Where configuration documents come from. A build reads
//! every document (main file, node files, lists, rules, scripts and their
//! modules) through [`Docs`], so the same parsing and validation serve the
//! files on disk ([`FileDocs`]) and one consistent snapshot of a store
//! ([`MemDocs`], e.g. the keys of one etcd revision mapped to paths: an
//! error then names the key, and the line inside its value).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::ConfigError;

/// A set of named documents (path → bytes) for one build.
pub trait Docs: Sync {
    /// The document's bytes, or an error naming it.
    fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, ConfigError>;

    /// The document as UTF-8 text.
    fn read(&self, path: &Path) -> Result<String, ConfigError> {
        String::from_utf8(self.read_bytes(path)?)
            .map_err(|_| ConfigError::new(path, None, "cannot read: not valid UTF-8 text"))
    }

    /// Whether relative paths name files on this machine (static trees and
    /// the access log always do; for a store they resolve against
    /// [`Docs::local_root`]).
    fn local_root(&self) -> Option<&Path> {
        None
    }

    /// The release records held by the store (key → JSON), when releases
    /// live there rather than in the local state file.
    fn releases(&self) -> Option<&BTreeMap<PathBuf, Vec<u8>>> {
        None
    }
}

/// The files on disk.
pub struct FileDocs;

impl Docs for FileDocs {
    fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, ConfigError> {
        std::fs::read(path).map_err(|e| ConfigError::new(path, None, format!("cannot read: {e}")))
    }
}

/// Documents held in memory: one snapshot of a store.
#[derive(Debug, Clone, Default)]
pub struct MemDocs {
    pub docs: BTreeMap<PathBuf, Vec<u8>>,
    /// Directory on this machine for static trees and the access log.
    pub local_root: PathBuf,
    /// The store's release records (`<prefix>/releases/<name>`), if any.
    pub releases: Option<BTreeMap<PathBuf, Vec<u8>>>,
}

impl Docs for MemDocs {
    fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, ConfigError> {
        self.docs
            .get(path)
            .cloned()
            .ok_or_else(|| ConfigError::new(path, None, "cannot read: no such key"))
    }

    fn local_root(&self) -> Option<&Path> {
        Some(&self.local_root)
    }

    fn releases(&self) -> Option<&BTreeMap<PathBuf, Vec<u8>>> {
        self.releases.as_ref()
    }
}
