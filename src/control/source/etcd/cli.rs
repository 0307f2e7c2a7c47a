//! Layer: control plane. The etcd side of the command line: `--check`
//! of what is in etcd, `push` (a files configuration uploaded in one
//! transaction) and `pull` (the configuration in etcd written back to
//! files). Each takes the members as a comma-separated list and uses the
//! first that answers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Client, GetOptions, GetResponse};

use super::keys::norm_prefix;
use super::snapshot::{build, read};
use super::{connect, err};
use crate::generation::Generation;

/// `--check --etcd`: builds what is in etcd. Returns the revision.
pub async fn check(endpoints: &str, prefix: &str) -> Result<(i64, Vec<String>), String> {
    let prefix = norm_prefix(prefix);
    let mut last = String::from("no endpoint");
    let mut snap = None;
    for ep in super::endpoint_list(endpoints) {
        let res = async {
            let mut c = connect(ep, Duration::from_secs(3)).await?;
            read(&mut c, &prefix, None, Duration::from_secs(5)).await
        };
        match res.await {
            Ok(s) => {
                snap = Some(s);
                break;
            }
            Err(e) => last = format!("{ep}: {e}"),
        }
    }
    let snap = snap.ok_or(last)?;
    let gen = build(&snap, None, Path::new("."), 0).map_err(err)?;
    Ok((snap.revision, gen.warnings))
}

/// Reads every key under `base` from the first of `endpoints`
/// (comma-separated) that answers; returns that member's client too. An
/// error names each member tried.
async fn read_config(endpoints: &str, base: &str) -> Result<(Client, GetResponse), String> {
    let mut failed = Vec::new();
    for ep in super::endpoint_list(endpoints) {
        let res = async {
            let mut c = connect(ep, Duration::from_secs(3)).await?;
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                c.get(base, Some(GetOptions::new().with_prefix())),
            )
            .await
            .map_err(|_| "etcd read timed out".to_string())?
            .map_err(err)?;
            Ok::<_, String>((c, r))
        };
        match res.await {
            Ok(ok) => return Ok(ok),
            Err(e) => failed.push(format!("{ep}: {e}")),
        }
    }
    if failed.is_empty() {
        return Err("no etcd endpoint given".into());
    }
    Err(failed.join("; "))
}

/// `push`: the documents of a files configuration that `--check` accepts,
/// as keys (main file → `config/main.yaml`, every other file by its path
/// relative to the root).
pub fn documents_of_files(config: &Path) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let config = std::path::absolute(config).unwrap_or(config.to_path_buf());
    let gen = Generation::load(&config, 0).map_err(err)?;
    let root = gen.config.root_dir(&config);
    let mut docs = BTreeMap::new();
    docs.insert(
        "main.yaml".to_string(),
        std::fs::read(&config).map_err(|e| format!("{}: {e}", config.display()))?,
    );
    // The release state is each gateway's own local file, not configuration.
    let release_state = gen.config.release_state_path(&config);
    for f in &gen.files {
        if *f == config || *f == release_state {
            continue;
        }
        let rel = f.strip_prefix(&root).map_err(|_| {
            format!(
                "{}: outside the configuration's root {} (etcd keys are relative paths)",
                f.display(),
                root.display()
            )
        })?;
        let rel = rel.to_string_lossy().into_owned();
        if rel == "main.yaml" {
            return Err(format!(
                "{}: the name main.yaml is taken by the main settings",
                f.display()
            ));
        }
        docs.insert(
            rel,
            std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?,
        );
    }
    Ok(docs)
}

/// Uploads `docs` (relative path → bytes) under `<prefix>/config/` in one
/// transaction: changed keys put, keys no longer present deleted, guarded
/// by the revisions read (a concurrent push fails instead of mixing).
/// Returns the revision written.
pub async fn push(
    endpoints: &str,
    prefix: &str,
    docs: &BTreeMap<String, Vec<u8>>,
) -> Result<i64, String> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let prefix = norm_prefix(prefix);
    let base = format!("{prefix}/config/");
    let (mut c, cur) = read_config(endpoints, &base).await?;
    let t = Duration::from_secs(10);
    let mut compares = Vec::new();
    let mut ops = Vec::new();
    let mut existing = BTreeMap::new();
    for kv in cur.kvs() {
        let k = String::from_utf8_lossy(kv.key()).into_owned();
        compares.push(Compare::mod_revision(
            k.as_str(),
            CompareOp::Equal,
            kv.mod_revision(),
        ));
        existing.insert(k, kv.value().to_vec());
    }
    for (rel, v) in docs {
        let k = format!("{base}{rel}");
        if existing.get(&k) != Some(v) {
            if !existing.contains_key(&k) {
                compares.push(Compare::create_revision(k.as_str(), CompareOp::Equal, 0));
            }
            ops.push(TxnOp::put(k, v.clone(), None));
        }
    }
    for k in existing.keys() {
        if !docs.contains_key(&k[base.len()..]) {
            ops.push(TxnOp::delete(k.as_str(), None));
        }
    }
    if ops.is_empty() {
        return Ok(cur.header().map_or(0, |h| h.revision()));
    }
    let resp = tokio::time::timeout(t, c.txn(Txn::new().when(compares).and_then(ops)))
        .await
        .map_err(|_| "etcd transaction timed out".to_string())?
        .map_err(err)?;
    if !resp.succeeded() {
        return Err("the configuration in etcd changed while pushing; push again".into());
    }
    Ok(resp.header().map_or(0, |h| h.revision()))
}

/// `pull`: writes every `<prefix>/config/` key to `dir/<path>`. Returns
/// the revision and the files written.
pub async fn pull(
    endpoints: &str,
    prefix: &str,
    dir: &Path,
) -> Result<(i64, Vec<PathBuf>), String> {
    let prefix = norm_prefix(prefix);
    let base = format!("{prefix}/config/");
    let (_, resp) = read_config(endpoints, &base).await?;
    let mut written = Vec::new();
    for kv in resp.kvs() {
        let k = String::from_utf8_lossy(kv.key()).into_owned();
        let rel = &k[base.len()..];
        if rel.is_empty()
            || rel.starts_with('/')
            || rel
                .split('/')
                .any(|s| s == ".." || s == "." || s.is_empty())
        {
            return Err(format!("{k}: not a relative path; refusing to write it"));
        }
        let path = dir.join(rel);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(&path, kv.value()).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    Ok((resp.header().map_or(0, |h| h.revision()), written))
}
