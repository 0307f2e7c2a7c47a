//! Node management written back to the node files: a change (add, remove,
//! change lane/weight/drain) is applied to the parsed node file, validated
//! with the same rules as a load, and written atomically (temp file in the
//! same directory, fsync, rename). The caller then reloads, so the files
//! stay the single source of truth.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::config::{parse_yaml, read_file, resolve, valid_lane, MainConfig, NodeConfig, NodeFile};

/// A requested change to one service's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    Add(NodeConfig),
    /// Remove the node named (or addressed) so.
    Remove(String),
    /// Change fields of the node named (or addressed) so.
    Update {
        node: String,
        lane: Option<String>,
        weight: Option<u32>,
        drain: Option<bool>,
    },
}

/// Why a change was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EditError {
    /// No such service or node (404).
    NotFound(String),
    /// The change is invalid (400).
    Invalid(String),
    /// The files on disk cannot be changed now (409).
    Conflict(String),
}

impl std::fmt::Display for EditError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EditError::NotFound(m) | EditError::Invalid(m) | EditError::Conflict(m) => {
                f.write_str(m)
            }
        }
    }
}

/// The directory relative paths of `config` resolve against.
pub fn root_dir(config_path: &Path, config: &MainConfig) -> PathBuf {
    let dir = config_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    config
        .root
        .as_ref()
        .map_or(dir.to_path_buf(), |r| resolve(dir, r))
}

/// The node file (path, text, parsed) that defines `service`.
pub fn find_service_file(
    config_path: &Path,
    config: &MainConfig,
    service: &str,
) -> Result<(PathBuf, String, NodeFile), EditError> {
    let root = root_dir(config_path, config);
    for p in &config.node_files {
        let path = resolve(&root, p);
        let text = read_file(&path).map_err(|e| EditError::Conflict(e.to_string()))?;
        let nf: NodeFile =
            parse_yaml(&path, &text).map_err(|e| EditError::Conflict(e.to_string()))?;
        if nf.services.contains_key(service) {
            return Ok((path, text, nf));
        }
    }
    Err(EditError::NotFound(format!(
        "no service {service:?} in any node file"
    )))
}

/// The effective name of the `idx`-th node of `service` (as a load names it).
fn effective_name(service: &str, idx: usize, n: &NodeConfig) -> String {
    n.name
        .clone()
        .unwrap_or_else(|| format!("{service}-{}-{idx}", n.lane))
}

fn valid_name(s: &str) -> bool {
    valid_lane(s)
}

/// Applies `change` to `service` in `nf`, validating the result.
pub fn apply(nf: &mut NodeFile, service: &str, change: NodeChange) -> Result<(), EditError> {
    let svc = nf
        .services
        .get_mut(service)
        .ok_or_else(|| EditError::NotFound(format!("no service {service:?}")))?;
    let find = |nodes: &[NodeConfig], key: &str| {
        nodes
            .iter()
            .enumerate()
            .position(|(i, n)| effective_name(service, i, n) == key || n.addr.to_string() == key)
    };
    match change {
        NodeChange::Add(node) => {
            if let Some(name) = &node.name {
                if !valid_name(name) {
                    return Err(EditError::Invalid(format!(
                        "invalid node name {name:?} (letters, digits, - _ . only)"
                    )));
                }
            }
            svc.nodes.push(node);
        }
        NodeChange::Remove(key) => {
            let i = find(&svc.nodes, &key)
                .ok_or_else(|| EditError::NotFound(format!("no node {key:?} in {service:?}")))?;
            // Later unnamed nodes keep their names: pin them before shifting.
            for (j, n) in svc.nodes.iter_mut().enumerate().skip(i + 1) {
                if n.name.is_none() {
                    n.name = Some(effective_name(service, j, n));
                }
            }
            svc.nodes.remove(i);
        }
        NodeChange::Update {
            node,
            lane,
            weight,
            drain,
        } => {
            let i = find(&svc.nodes, &node)
                .ok_or_else(|| EditError::NotFound(format!("no node {node:?} in {service:?}")))?;
            let n = &mut svc.nodes[i];
            if lane.is_some() && n.name.is_none() {
                // Its default name contains the lane: keep the name stable.
                n.name = Some(effective_name(service, i, n));
            }
            if let Some(l) = lane {
                n.lane = l;
            }
            if let Some(w) = weight {
                n.weight = w;
            }
            if let Some(d) = drain {
                n.drain = d;
            }
        }
    }
    validate(nf, service)
}

/// The node-file rules of a load, plus unique names and addresses.
fn validate(nf: &NodeFile, service: &str) -> Result<(), EditError> {
    let svc = &nf.services[service];
    let mut names = std::collections::HashSet::new();
    let mut addrs: std::collections::HashSet<SocketAddr> = std::collections::HashSet::new();
    for (i, n) in svc.nodes.iter().enumerate() {
        if !valid_lane(&n.lane) {
            return Err(EditError::Invalid(format!(
                "invalid lane name {:?} (letters, digits, - _ . only)",
                n.lane
            )));
        }
        let name = effective_name(service, i, n);
        if !names.insert(name.clone()) {
            return Err(EditError::Invalid(format!(
                "node name {name:?} is used twice in {service:?}"
            )));
        }
        if !addrs.insert(n.addr) {
            return Err(EditError::Invalid(format!(
                "address {} is used twice in {service:?}",
                n.addr
            )));
        }
    }
    Ok(())
}

/// The YAML text of `nf`, proven to parse back to the same value.
pub fn render(path: &Path, nf: &NodeFile) -> Result<String, EditError> {
    let body = serde_yaml::to_string(nf).map_err(|e| EditError::Invalid(e.to_string()))?;
    let text = format!("# Written by graygate's admin API (comments are not kept).\n{body}");
    let back: NodeFile = parse_yaml(path, &text).map_err(|e| EditError::Invalid(e.to_string()))?;
    if serde_yaml::to_string(&back).ok().as_deref() != Some(body.as_str()) {
        return Err(EditError::Invalid("node file does not round-trip".into()));
    }
    Ok(text)
}

/// Replaces `path` with `text` atomically: a temp file in the same
/// directory (same permissions), fsync, rename over.
pub fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.graygate-tmp"));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            let _ = f.set_permissions(meta.permissions());
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "services:\n  api:\n    nodes:\n      - { name: f1, addr: \"127.0.0.1:1\" }\n      - { addr: \"127.0.0.1:2\", lane: gray }\n      - { addr: \"127.0.0.1:3\", lane: gray }\n";

    fn nf() -> NodeFile {
        parse_yaml(Path::new("n.yaml"), FILE).unwrap()
    }

    fn node(addr: &str, lane: &str) -> NodeConfig {
        NodeConfig {
            name: None,
            addr: addr.parse().unwrap(),
            lane: lane.into(),
            weight: 1,
            drain: false,
        }
    }

    #[test]
    fn add_update_remove_by_name_or_addr() {
        let mut f = nf();
        apply(&mut f, "api", NodeChange::Add(node("127.0.0.1:4", "v2"))).unwrap();
        assert_eq!(f.services["api"].nodes.len(), 4);
        let up = NodeChange::Update {
            node: "api-gray-1".into(),
            lane: None,
            weight: Some(5),
            drain: Some(true),
        };
        apply(&mut f, "api", up).unwrap();
        assert_eq!(f.services["api"].nodes[1].weight, 5);
        assert!(f.services["api"].nodes[1].drain);
        apply(&mut f, "api", NodeChange::Remove("127.0.0.1:1".into())).unwrap();
        let nodes = &f.services["api"].nodes;
        assert_eq!(nodes.len(), 3);
        // Unnamed nodes after the removed one keep their effective names.
        assert_eq!(nodes[1].name.as_deref(), Some("api-gray-2"));
    }

    #[test]
    fn invalid_changes_are_refused() {
        let mut f = nf();
        let bad_lane = NodeChange::Update {
            node: "f1".into(),
            lane: Some("gray\r\nx".into()),
            weight: None,
            drain: None,
        };
        assert!(matches!(
            apply(&mut f, "api", bad_lane),
            Err(EditError::Invalid(_))
        ));
        let mut f = nf();
        let dup = NodeChange::Add(node("127.0.0.1:1", "formal"));
        assert!(matches!(
            apply(&mut f, "api", dup),
            Err(EditError::Invalid(_))
        ));
        let mut f = nf();
        let mut named = node("127.0.0.1:9", "formal");
        named.name = Some("f1".into());
        assert!(matches!(
            apply(&mut f, "api", NodeChange::Add(named)),
            Err(EditError::Invalid(_))
        ));
        let mut f = nf();
        assert!(matches!(
            apply(&mut f, "nope", NodeChange::Remove("f1".into())),
            Err(EditError::NotFound(_))
        ));
        assert!(matches!(
            apply(&mut f, "api", NodeChange::Remove("zz".into())),
            Err(EditError::NotFound(_))
        ));
    }

    #[test]
    fn render_round_trips_and_write_is_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("n.yaml");
        std::fs::write(&p, FILE).unwrap();
        let mut f = nf();
        apply(&mut f, "api", NodeChange::Add(node("127.0.0.1:4", "v2"))).unwrap();
        let text = render(&p, &f).unwrap();
        write_atomic(&p, &text).unwrap();
        let back: NodeFile = parse_yaml(&p, &std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(back.services["api"].nodes, f.services["api"].nodes);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
    }
}
