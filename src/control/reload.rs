//! Layer: control plane. Hot reload: a notify watcher on the directories of
//! every file the current generation was built from (so an editor's rename-over
//! is seen), plus SIGHUP. Symlinks are followed: the watcher also watches
//! every link on the way to each file (a file that is a link, a directory
//! component that is one) and the directory of the final target, so a
//! Kubernetes ConfigMap or Secret volume (kubelet swaps its `..data` link to
//! a new timestamped directory), an `ln -sfn` deploy and an edit of a link's
//! target all reload. Changes are debounced, then the whole configuration
//! is rebuilt and swapped by [`Gateway::reload`]; a bad change is rejected and
//! the old generation keeps serving.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::control::Gateway;

/// Links followed per file at most (as the kernel's `ELOOP` bound).
const MAX_LINKS: usize = 40;

/// The paths a change of `file` can come through: every symlink met while
/// resolving it (the file itself, a directory on the way, a link a link
/// points at), then the path it resolves to. A missing component ends the
/// walk with the path as it stands.
fn resolution(file: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut path = std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf());
    'walk: for _ in 0..MAX_LINKS {
        let comps: Vec<Component> = path.components().collect();
        let mut cur = PathBuf::new();
        for (i, c) in comps.iter().enumerate() {
            cur.push(c);
            let is_link = std::fs::symlink_metadata(&cur).is_ok_and(|m| m.is_symlink());
            if !is_link {
                continue;
            }
            let Ok(target) = std::fs::read_link(&cur) else {
                break;
            };
            out.push(cur.clone());
            // A relative target is relative to the link's directory.
            let mut next = cur.parent().map_or_else(PathBuf::new, Path::to_path_buf);
            next.push(target);
            next.extend(&comps[i + 1..]);
            path = next;
            continue 'walk;
        }
        break;
    }
    out.push(path);
    out
}

/// (canonical directory, file name) of every path worth a reload: each of
/// `files` and the links on the way to it.
fn interesting(files: &[PathBuf]) -> HashSet<(PathBuf, OsString)> {
    files
        .iter()
        .flat_map(|f| resolution(f))
        .filter_map(|p| key_of(&p))
        .collect()
}

fn key_of(path: &Path) -> Option<(PathBuf, OsString)> {
    let dir = path.parent()?.canonicalize().ok()?;
    Some((dir, path.file_name()?.to_os_string()))
}

/// The release state file, when it holds what the release controller last
/// wrote.
fn own_release_write(gw: &Gateway) -> Option<(PathBuf, OsString)> {
    let (path, text) = gw.releases.quiet_file()?;
    (std::fs::read_to_string(&path).ok()? == text)
        .then(|| key_of(&path))
        .flatten()
}

/// Starts the watcher and the SIGHUP handler; runs until the process ends.
pub async fn run(gw: Arc<Gateway>) -> notify::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<PathBuf>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            if ev.kind.is_access() {
                return;
            }
            for p in ev.paths {
                let _ = tx.send(p);
            }
        }
    })?;

    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(notify::Error::io)?;
    let mut watched_dirs: HashSet<PathBuf> = HashSet::new();
    let mut wanted = HashSet::new();
    refresh(&gw, &mut watcher, &mut watched_dirs, &mut wanted);

    loop {
        tokio::select! {
            Some(p) = rx.recv() => {
                if !key_of(&p).is_some_and(|k| wanted.contains(&k)) {
                    continue;
                }
                // Debounce: wait for quiet, gathering further events
                // (the quiet time as the serving generation says).
                let debounce = Duration::from_millis(gw.current().config.reload_debounce_ms);
                let mut paths = vec![p.clone()];
                while let Ok(Some(q)) = tokio::time::timeout(debounce, rx.recv()).await {
                    paths.push(q);
                }
                // The release controller's own write: it reloaded itself
                // if what routes changed.
                let own = own_release_write(&gw);
                if paths
                    .iter()
                    .filter_map(|q| key_of(q))
                    .filter(|k| wanted.contains(k))
                    .all(|k| own.as_ref() == Some(&k))
                {
                    continue;
                }
                tracing::info!(file = %p.display(), "change detected; reloading");
            }
            _ = hup.recv() => {
                tracing::info!("SIGHUP; reloading");
            }
        }
        let g = gw.clone();
        let _ = tokio::task::spawn_blocking(move || g.reload()).await;
        refresh(&gw, &mut watcher, &mut watched_dirs, &mut wanted);
    }
}

/// Watches the directories of the current generation's files (plus the
/// config file's) and of the links leading to them, dropping directories
/// no longer needed (a volume's previous timestamped directory).
fn refresh(
    gw: &Gateway,
    watcher: &mut impl Watcher,
    watched: &mut HashSet<PathBuf>,
    wanted: &mut HashSet<(PathBuf, OsString)>,
) {
    let gen = gw.current();
    let mut files = gen.files.clone();
    files.extend(gen.watch_paths.iter().cloned());
    files.push(gw.config_path.clone());
    *wanted = interesting(&files);
    let dirs: HashSet<PathBuf> = wanted.iter().map(|(d, _)| d.clone()).collect();
    for d in watched.difference(&dirs) {
        let _ = watcher.unwatch(d);
    }
    for d in dirs.difference(watched) {
        if let Err(e) = watcher.watch(d, RecursiveMode::NonRecursive) {
            tracing::warn!(dir = %d.display(), error = %e, "cannot watch directory");
        }
    }
    *watched = dirs;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn resolution_lists_every_link_then_the_target() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().canonicalize().unwrap();
        // kubelet: name -> ..data/name, ..data -> ..ts
        std::fs::create_dir(root.join("..ts")).unwrap();
        std::fs::write(root.join("..ts/a.yaml"), "x").unwrap();
        symlink("..ts", root.join("..data")).unwrap();
        symlink("..data/a.yaml", root.join("a.yaml")).unwrap();
        assert_eq!(
            resolution(&root.join("a.yaml")),
            [
                root.join("a.yaml"),
                root.join("..data"),
                root.join("..ts/a.yaml")
            ]
        );
        // A directory on the way that is a link (an absolute one).
        symlink(root.join("..ts"), root.join("current")).unwrap();
        assert_eq!(
            resolution(&root.join("current/a.yaml")),
            [root.join("current"), root.join("..ts/a.yaml")]
        );
        // No link: the path itself; a loop ends after MAX_LINKS.
        assert_eq!(
            resolution(&root.join("..ts/a.yaml")),
            [root.join("..ts/a.yaml")]
        );
        symlink("loop", root.join("loop")).unwrap();
        assert_eq!(resolution(&root.join("loop")).len(), MAX_LINKS + 1);
        // The watcher's keys cover the links and the target's directory.
        let keys = interesting(&[root.join("a.yaml")]);
        for (dir, name) in [
            (&root, "a.yaml"),
            (&root, "..data"),
            (&root.join("..ts"), "a.yaml"),
        ] {
            assert!(
                keys.contains(&(dir.clone(), OsString::from(name))),
                "{keys:?}"
            );
        }
    }
}
