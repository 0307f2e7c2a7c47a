//! Layer: control plane. Hot reload: a notify watcher on the directories of
//! every file the current generation was built from (so an editor's rename-over
//! is seen), plus SIGHUP. Changes are debounced, then the whole configuration
//! is rebuilt and swapped by [`Gateway::reload`]; a bad change is rejected and
//! the old generation keeps serving.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::control::Gateway;

/// (canonical directory, file name) of every file worth a reload.
fn interesting(files: &[PathBuf]) -> HashSet<(PathBuf, OsString)> {
    files
        .iter()
        .filter_map(|f| {
            let dir = f.parent()?.canonicalize().ok()?;
            Some((dir, f.file_name()?.to_os_string()))
        })
        .collect()
}

fn key_of(path: &Path) -> Option<(PathBuf, OsString)> {
    let dir = path.parent()?.canonicalize().ok()?;
    Some((dir, path.file_name()?.to_os_string()))
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
    let debounce = Duration::from_millis(gw.current().config.reload_debounce_ms);
    let mut watched_dirs: HashSet<PathBuf> = HashSet::new();
    let mut wanted = HashSet::new();
    refresh(&gw, &mut watcher, &mut watched_dirs, &mut wanted);

    loop {
        tokio::select! {
            Some(p) = rx.recv() => {
                if !key_of(&p).is_some_and(|k| wanted.contains(&k)) {
                    continue;
                }
                // Debounce: wait for quiet, swallowing further events.
                while let Ok(Some(_)) = tokio::time::timeout(debounce, rx.recv()).await {}
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
/// config file's), dropping directories no longer needed.
fn refresh(
    gw: &Gateway,
    watcher: &mut impl Watcher,
    watched: &mut HashSet<PathBuf>,
    wanted: &mut HashSet<(PathBuf, OsString)>,
) {
    let gen = gw.current();
    let mut files = gen.files.clone();
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
