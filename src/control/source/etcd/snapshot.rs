//! Layer: control plane. Snapshots: the keys of the config and registry
//! range read at ONE revision (one range read, `[<prefix>/config/,
//! <prefix>/services0)`: config and registry together, consistent), turned
//! into the named documents a generation is built from. The serving
//! snapshot is also kept on disk (`<cache_dir>/snapshot.json`, written
//! atomically) so a gateway that cannot reach etcd at start serves it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::err;
use super::keys::{main_key, range};
use super::registry;
use crate::config::docs::MemDocs;
use crate::config::{Bootstrap, ConfigError};
use crate::control::source::RegisteredServices;
use crate::generation::Generation;

/// One value of a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Kv {
    #[serde(with = "b64")]
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// The keys of the config and registry range at one revision.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    pub prefix: String,
    /// The revision the range was read at (the watch resumes after it).
    pub read_revision: i64,
    /// The revision of the newest change it holds (what `/status` and
    /// `/fleet` report: equal on gateways holding the same state).
    pub revision: i64,
    pub kvs: BTreeMap<String, Kv>,
}

impl Snapshot {
    /// Whether `next` differs from this snapshot only in release records
    /// whose routing is the same (a leader's decision, a count): applied
    /// without a rebuild, so the generation still means a changed
    /// configuration.
    pub fn only_release_decisions(&self, next: &Snapshot) -> bool {
        use super::keys::releases_range;
        use crate::config::release::routing_signature;
        let (start, end) = releases_range(&next.prefix);
        let release = |k: &str| k >= start.as_str() && k < end.as_str();
        let rest = |s: &Snapshot| {
            s.kvs
                .iter()
                .filter(|(k, _)| !release(k))
                .map(|(k, kv)| (k.clone(), kv.value.clone()))
                .collect::<Vec<_>>()
        };
        let records = |s: &Snapshot| {
            s.kvs
                .range(start.clone()..end.clone())
                .map(|(_, kv)| serde_json::from_slice(&kv.value).ok())
                .collect::<Option<Vec<_>>>()
        };
        rest(self) == rest(next)
            && matches!((records(self), records(next)), (Some(a), Some(b)) if routing_signature(&a) == routing_signature(&b))
    }

    /// SHA-256 over the keys and values.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (k, kv) in &self.kvs {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(&kv.value);
            h.update([0]);
        }
        hex::encode(h.finalize())
    }

    /// Writes the snapshot to `path` atomically (temp file, fsync, rename);
    /// a failure is logged, the gateway serves on.
    pub fn save(&self, path: &Path) {
        crate::control::source::save_snapshot(path, self);
    }

    /// The snapshot cached at `path`, if it was written for `prefix`.
    pub fn load(path: &Path, prefix: &str) -> Result<Snapshot, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let snap: Snapshot =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if snap.prefix != prefix {
            return Err(format!(
                "{}: cached for prefix {:?}, not {:?}",
                path.display(),
                snap.prefix,
                prefix
            ));
        }
        Ok(snap)
    }
}

mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

/// Reads the snapshot range at `at` (or the current revision).
pub async fn read(
    client: &mut Client,
    prefix: &str,
    at: Option<i64>,
    timeout: Duration,
) -> Result<Snapshot, String> {
    let (start, end) = range(prefix);
    let mut opts = GetOptions::new().with_range(end);
    if let Some(r) = at {
        opts = opts.with_revision(r);
    }
    let resp = tokio::time::timeout(timeout, client.get(start, Some(opts)))
        .await
        .map_err(|_| "etcd read timed out".to_string())?
        .map_err(err)?;
    let header = resp.header().map_or(0, |h| h.revision());
    let mut kvs = BTreeMap::new();
    let mut newest = at.unwrap_or(0);
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        newest = newest.max(kv.mod_revision());
        kvs.insert(
            key,
            Kv {
                value: kv.value().to_vec(),
                mod_revision: kv.mod_revision(),
            },
        );
    }
    Ok(Snapshot {
        prefix: prefix.to_string(),
        read_revision: at.unwrap_or(header),
        revision: newest,
        kvs,
    })
}

/// The documents of a snapshot: `<prefix>/config/*` by key (the main
/// settings with the bootstrap's addresses), the registry's services.
pub fn documents(
    snap: &Snapshot,
    listen: Option<&Bootstrap>,
    local_root: &Path,
) -> Result<(MemDocs, PathBuf, RegisteredServices), ConfigError> {
    let prefix = &snap.prefix;
    let (cfg, _) = range(prefix);
    let main = main_key(prefix);
    let mut docs = MemDocs {
        docs: BTreeMap::new(),
        local_root: local_root.to_path_buf(),
        releases: Some(BTreeMap::new()),
    };
    let (rel, _) = super::keys::releases_range(prefix);
    for (k, kv) in &snap.kvs {
        if let (Some(_), Some(r)) = (k.strip_prefix(&rel), docs.releases.as_mut()) {
            r.insert(PathBuf::from(k), kv.value.clone());
            continue;
        }
        if !k.starts_with(&cfg) {
            continue;
        }
        let value = if *k == main {
            main_text(&kv.value, listen)
        } else {
            kv.value.clone()
        };
        docs.docs.insert(PathBuf::from(k), value);
    }
    if !snap.kvs.contains_key(&main) {
        return Err(ConfigError::new(
            &main,
            None,
            "no main settings in etcd (push a configuration first)",
        ));
    }
    let services = registry::services(
        prefix,
        snap.kvs
            .iter()
            .map(|(k, kv)| (k.as_str(), kv.value.as_slice())),
    )?;
    Ok((docs, PathBuf::from(main), services))
}

/// The main settings as a build sees them: the per-gateway keys (`listen`,
/// `admin_listen`, `root`) blanked line for line (so every other line keeps
/// its number) and the bootstrap's addresses appended.
fn main_text(value: &[u8], boot: Option<&Bootstrap>) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(value) else {
        return value.to_vec();
    };
    let addrs = boot.map(|b| (b.listen, b.admin_listen));
    crate::control::source::store_main_text(text, addrs, None)
        .0
        .into_bytes()
}

/// Builds a generation from a snapshot.
pub fn build(
    snap: &Snapshot,
    boot: Option<&Bootstrap>,
    local_root: &Path,
    id: u64,
) -> Result<Generation, ConfigError> {
    let (docs, main, services) = documents(snap, boot, local_root)?;
    Generation::build(&docs, &main, services, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(kvs: &[(&str, &str)]) -> Snapshot {
        Snapshot {
            prefix: "/g".into(),
            read_revision: 9,
            revision: 9,
            kvs: kvs
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Kv {
                            value: v.as_bytes().to_vec(),
                            mod_revision: 1,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn errors_name_the_key_and_the_line_inside_it() {
        let s = snap(&[
            (
                "/g/config/main.yaml",
                "listen: 1.2.3.4:5\nnode_files: [nodes.yaml]\n",
            ),
            (
                "/g/config/nodes.yaml",
                "services:\n  api:\n    nodes:\n      - { addr: nope }\n",
            ),
        ]);
        let e = build(&s, None, Path::new("."), 1).unwrap_err();
        assert!(e.to_string().starts_with("/g/config/nodes.yaml:4:"), "{e}");
    }

    #[test]
    fn bootstrap_addresses_replace_the_stores_and_keep_line_numbers() {
        let boot: Bootstrap = serde_yaml::from_str(
            "listen: 127.0.0.1:7000\netcd: { endpoints: [x], prefix: /g, cache_dir: c }\n",
        )
        .unwrap();
        let s = snap(&[(
            "/g/config/main.yaml",
            "listen: 1.2.3.4:5\nroot: /elsewhere\nroutes:\n  - { prefix: nope, service: x }\n",
        )]);
        let e = build(&s, Some(&boot), Path::new("."), 1).unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        let ok = snap(&[("/g/config/main.yaml", "listen: 1.2.3.4:5\n")]);
        let g = build(&ok, Some(&boot), Path::new("."), 1).unwrap();
        assert_eq!(g.config.listen.to_string(), "127.0.0.1:7000");
        assert!(snap(&[]).hash() != ok.hash());
    }
}
