//! Layer: control plane. Node management written back to the node files: a
//! change (add, remove, change lane/weight/drain) is applied to the node file's
//! YAML tree, validated with the same rules as a load, and written atomically
//! (temp file in the same directory, fsync, rename). The caller then reloads,
//! so the files stay the single source of truth.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_yaml::{Mapping, Value};

use crate::config::{
    parse_yaml, read_file, resolve, valid_lane, MainConfig, NodeAddr, NodeConfig, NodeFile, FORMAL,
};

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

/// How the log names a change, in the node file's words: `add api-2
/// 127.0.0.1:7102 lane gray weight 1`, `remove f1`, `update f1: weight 5,
/// drain true`.
impl std::fmt::Display for NodeChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeChange::Add(n) => {
                f.write_str("add ")?;
                if let Some(name) = &n.name {
                    write!(f, "{name} ")?;
                }
                write!(f, "{} lane {} weight {}", n.addr, n.lane, n.weight)?;
                if n.drain {
                    f.write_str(" drain true")?;
                }
                Ok(())
            }
            NodeChange::Remove(node) => write!(f, "remove {node}"),
            NodeChange::Update {
                node,
                lane,
                weight,
                drain,
            } => {
                let mut parts = Vec::new();
                if let Some(l) = lane {
                    parts.push(format!("lane {l}"));
                }
                if let Some(w) = weight {
                    parts.push(format!("weight {w}"));
                }
                if let Some(d) = drain {
                    parts.push(format!("drain {d}"));
                }
                if parts.is_empty() {
                    write!(f, "update {node}: nothing")
                } else {
                    write!(f, "update {node}: {}", parts.join(", "))
                }
            }
        }
    }
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

/// The node file (path, text, parsed) that defines `service`.
pub fn find_service_file(
    config_path: &Path,
    config: &MainConfig,
    service: &str,
) -> Result<(PathBuf, String, NodeFile), EditError> {
    let root = config.root_dir(config_path);
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

/// What a relabelling would write: each changed file's path and new text,
/// how many nodes became formal, how many drain.
pub struct Relabel {
    pub files: Vec<(PathBuf, String)>,
    pub promoted: usize,
    pub drained: usize,
}

/// A finished release's relabelling: in the node files, every service of
/// `services` with nodes of `lane` gets those nodes as formal and its old
/// formal nodes draining (the operator removes them once drained).
/// Nothing is written.
pub fn relabel_lane(
    config_path: &Path,
    config: &MainConfig,
    services: &std::collections::BTreeSet<String>,
    lane: &str,
) -> Result<Relabel, EditError> {
    let root = config.root_dir(config_path);
    let (mut files, mut promoted, mut drained) = (Vec::new(), 0, 0);
    for p in &config.node_files {
        let path = resolve(&root, p);
        let mut text = read_file(&path).map_err(|e| EditError::Conflict(e.to_string()))?;
        let nf: NodeFile =
            parse_yaml(&path, &text).map_err(|e| EditError::Conflict(e.to_string()))?;
        let mut changed = false;
        for (service, svc) in &nf.services {
            if !services.contains(service) || !svc.nodes.iter().any(|n| n.lane == lane) {
                continue;
            }
            for i in 0..svc.nodes.len() {
                // Read again: an edit may have pinned the node's name.
                let now: NodeFile =
                    parse_yaml(&path, &text).map_err(|e| EditError::Conflict(e.to_string()))?;
                let n = &now.services[service].nodes[i];
                let (lane_to, drain) = match n.lane.as_str() {
                    l if l == lane => (Some(FORMAL.to_string()), None),
                    FORMAL if !n.drain => (None, Some(true)),
                    _ => continue,
                };
                promoted += usize::from(lane_to.is_some());
                drained += usize::from(drain.is_some());
                let change = NodeChange::Update {
                    node: effective_name(service, i, n),
                    lane: lane_to,
                    weight: None,
                    drain,
                };
                text = edit(&path, &text, service, change)?;
                changed = true;
            }
        }
        if changed {
            files.push((path, text));
        }
    }
    Ok(Relabel {
        files,
        promoted,
        drained,
    })
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

/// Applies `change` to `service` in the node file `text` (at `path`) and
/// returns the new text. The change is made on the YAML tree, so every
/// other key (service health, retries, …) is kept as it was; the result is
/// validated and must parse back to exactly the intended nodes.
pub fn edit(
    path: &Path,
    text: &str,
    service: &str,
    change: NodeChange,
) -> Result<String, EditError> {
    let nf: NodeFile = parse_yaml(path, text).map_err(|e| EditError::Conflict(e.to_string()))?;
    let mut nodes = nf
        .services
        .get(service)
        .ok_or_else(|| EditError::NotFound(format!("no service {service:?}")))?
        .nodes
        .clone();
    let mut root: Value =
        serde_yaml::from_str(text).map_err(|e| EditError::Conflict(e.to_string()))?;
    let svc = root
        .get_mut("services")
        .and_then(|s| s.get_mut(service))
        .ok_or_else(|| EditError::NotFound(format!("no service {service:?}")))?;
    if svc.is_null() {
        *svc = Value::Mapping(Mapping::new());
    }
    let svc = svc
        .as_mapping_mut()
        .ok_or_else(|| EditError::Conflict(format!("service {service:?} is not a mapping")))?;
    let seq = svc
        .entry(Value::from("nodes"))
        .or_insert_with(|| Value::Sequence(Vec::new()));
    if seq.is_null() {
        *seq = Value::Sequence(Vec::new());
    }
    let seq = seq
        .as_sequence_mut()
        .ok_or_else(|| EditError::Conflict(format!("nodes of {service:?} are not a list")))?;
    let find = |nodes: &[NodeConfig], key: &str| {
        nodes
            .iter()
            .enumerate()
            .position(|(i, n)| effective_name(service, i, n) == key || n.addr.to_string() == key)
    };
    let set =
        |seq: &mut Vec<Value>, i: usize, key: &str, v: Option<Value>| -> Result<(), EditError> {
            let m = seq[i].as_mapping_mut().ok_or_else(|| {
                EditError::Conflict(format!("node {i} of {service:?} is not a mapping"))
            })?;
            match v {
                Some(v) => {
                    m.insert(Value::from(key), v);
                }
                None => {
                    m.remove(key);
                }
            }
            Ok(())
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
            seq.push(serde_yaml::to_value(&node).map_err(|e| EditError::Invalid(e.to_string()))?);
            nodes.push(node);
        }
        NodeChange::Remove(key) => {
            let i = find(&nodes, &key)
                .ok_or_else(|| EditError::NotFound(format!("no node {key:?} in {service:?}")))?;
            // Later unnamed nodes keep their names: pin them before shifting.
            for (j, n) in nodes.iter_mut().enumerate().skip(i + 1) {
                if n.name.is_none() {
                    let name = effective_name(service, j, n);
                    set(seq, j, "name", Some(Value::from(name.clone())))?;
                    n.name = Some(name);
                }
            }
            nodes.remove(i);
            seq.remove(i);
        }
        NodeChange::Update {
            node,
            lane,
            weight,
            drain,
        } => {
            let i = find(&nodes, &node)
                .ok_or_else(|| EditError::NotFound(format!("no node {node:?} in {service:?}")))?;
            if lane.is_some() && nodes[i].name.is_none() {
                // Its default name contains the lane: keep the name stable.
                let name = effective_name(service, i, &nodes[i]);
                set(seq, i, "name", Some(Value::from(name.clone())))?;
                nodes[i].name = Some(name);
            }
            if let Some(l) = lane {
                set(seq, i, "lane", Some(Value::from(l.clone())))?;
                nodes[i].lane = l;
            }
            if let Some(w) = weight {
                set(seq, i, "weight", Some(Value::from(w)))?;
                nodes[i].weight = w;
            }
            if let Some(d) = drain {
                set(seq, i, "drain", d.then_some(Value::Bool(true)))?;
                nodes[i].drain = d;
            }
        }
    }
    validate(&nodes, service)?;
    let body = serde_yaml::to_string(&root).map_err(|e| EditError::Invalid(e.to_string()))?;
    let out = format!("# Written by graygate's admin API (comments are not kept).\n{body}");
    let back: NodeFile = parse_yaml(path, &out).map_err(|e| EditError::Invalid(e.to_string()))?;
    if back.services.get(service).map(|s| &s.nodes) != Some(&nodes) {
        return Err(EditError::Invalid(
            "the node file does not round-trip".into(),
        ));
    }
    Ok(out)
}

/// The node-file rules of a load, plus unique names and addresses.
fn validate(nodes: &[NodeConfig], service: &str) -> Result<(), EditError> {
    let mut names = std::collections::HashSet::new();
    let mut addrs: std::collections::HashSet<&NodeAddr> = std::collections::HashSet::new();
    for (i, n) in nodes.iter().enumerate() {
        if !valid_lane(&n.lane) {
            return Err(EditError::Invalid(format!(
                "invalid lane name {:?} (letters, digits, - _ . only)",
                n.lane
            )));
        }
        if let Some(z) = n.zone.as_deref().filter(|z| !valid_lane(z)) {
            return Err(EditError::Invalid(format!(
                "invalid zone name {z:?} (letters, digits, - _ . only)"
            )));
        }
        let name = effective_name(service, i, n);
        if !names.insert(name.clone()) {
            return Err(EditError::Invalid(format!(
                "node name {name:?} is used twice in {service:?}"
            )));
        }
        if !addrs.insert(&n.addr) {
            return Err(EditError::Invalid(format!(
                "address {} is used twice in {service:?}",
                n.addr
            )));
        }
    }
    Ok(())
}

/// Commits an admin edit: the configuration on disk must load as a whole
/// (else the change could not be applied: refuse rather than write), then
/// `new_text` replaces `path` atomically and the gateway reloads through
/// the usual path. Returns the new generation. Blocking.
pub fn commit(gw: &crate::control::Gateway, path: &Path, new_text: &str) -> Result<u64, EditError> {
    crate::generation::Generation::load(&gw.config_path, 0).map_err(|e| {
        EditError::Conflict(format!(
            "the configuration on disk does not load, fix it first: {e}"
        ))
    })?;
    write_atomic(path, new_text)
        .map_err(|e| EditError::Conflict(format!("cannot write {}: {e}", path.display())))?;
    gw.reload().map_err(|e| {
        EditError::Conflict(format!(
            "written to {}, but the reload was rejected: {e}",
            path.display()
        ))
    })
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

    const FILE: &str = "services:\n  api:\n    retries: 2\n    nodes:\n      - { name: f1, addr: \"127.0.0.1:1\" }\n      - { addr: \"127.0.0.1:2\", lane: gray }\n      - { addr: \"127.0.0.1:3\", lane: gray }\n";

    fn node(addr: &str, lane: &str) -> NodeConfig {
        NodeConfig {
            name: None,
            addr: addr.parse().unwrap(),
            lane: lane.into(),
            weight: 1,
            drain: false,
            zone: None,
        }
    }

    fn nodes(text: &str) -> Vec<NodeConfig> {
        let nf: NodeFile = parse_yaml(Path::new("n.yaml"), text).unwrap();
        nf.services["api"].nodes.clone()
    }

    fn run(text: &str, change: NodeChange) -> Result<String, EditError> {
        edit(Path::new("n.yaml"), text, "api", change)
    }

    #[test]
    fn add_update_remove_by_name_or_addr() {
        let t = run(FILE, NodeChange::Add(node("127.0.0.1:4", "v2"))).unwrap();
        assert_eq!(nodes(&t).len(), 4);
        assert!(t.contains("retries: 2"), "other keys are kept: {t}");
        let up = NodeChange::Update {
            node: "api-gray-1".into(),
            lane: None,
            weight: Some(5),
            drain: Some(true),
        };
        let t = run(&t, up).unwrap();
        assert_eq!(nodes(&t)[1].weight, 5);
        assert!(nodes(&t)[1].drain);
        let t = run(&t, NodeChange::Remove("127.0.0.1:1".into())).unwrap();
        let n = nodes(&t);
        assert_eq!(n.len(), 3);
        // Unnamed nodes after the removed one keep their effective names.
        assert_eq!(n[1].name.as_deref(), Some("api-gray-2"));
        let undrain = NodeChange::Update {
            node: "api-gray-1".into(),
            lane: None,
            weight: None,
            drain: Some(false),
        };
        let t = run(&t, undrain).unwrap();
        assert!(!t.contains("drain"), "{t}");
    }

    #[test]
    fn invalid_changes_are_refused() {
        let bad_lane = NodeChange::Update {
            node: "f1".into(),
            lane: Some("gray\r\nx".into()),
            weight: None,
            drain: None,
        };
        assert!(matches!(run(FILE, bad_lane), Err(EditError::Invalid(_))));
        let dup = NodeChange::Add(node("127.0.0.1:1", "formal"));
        assert!(matches!(run(FILE, dup), Err(EditError::Invalid(_))));
        let mut named = node("127.0.0.1:9", "formal");
        named.name = Some("f1".into());
        assert!(matches!(
            run(FILE, NodeChange::Add(named)),
            Err(EditError::Invalid(_))
        ));
        assert!(matches!(
            edit(
                Path::new("n.yaml"),
                FILE,
                "nope",
                NodeChange::Remove("f1".into())
            ),
            Err(EditError::NotFound(_))
        ));
        assert!(matches!(
            run(FILE, NodeChange::Remove("zz".into())),
            Err(EditError::NotFound(_))
        ));
    }

    #[test]
    fn write_is_atomic_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("n.yaml");
        std::fs::write(&p, FILE).unwrap();
        let t = run(FILE, NodeChange::Add(node("127.0.0.1:4", "v2"))).unwrap();
        write_atomic(&p, &t).unwrap();
        assert_eq!(nodes(&std::fs::read_to_string(&p).unwrap()).len(), 4);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
    }
}
