//! Layer: control plane. Keeping an etcd gateway current: the watch over
//! the snapshot range from the serving snapshot's revision + 1, events
//! debounced, then the range read again at the last event's revision and
//! applied. A compaction past the watch or a broken watch → a full re-read
//! at the current revision and a new watch; connections rotate across the
//! endpoints with backoff. SIGHUP re-reads as a files gateway reloads.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::WatchOptions;

use super::keys::range;
use super::snapshot::read;
use super::status::publish_status;
use super::EtcdSource;
use crate::control::Gateway;

/// Keeps the gateway on the store's newest state: watch, debounce, re-read
/// at one revision, apply; reconnect with backoff across the endpoints.
/// Also publishes the gateway's status key. Runs until the process ends.
pub async fn run(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    tokio::spawn(publish_status(gw.clone(), src.clone()));
    tokio::spawn(sighup(gw.clone(), src.clone()));
    let debounce = Duration::from_millis(src.settings.debounce_ms);
    // Started from the cache (or live): the watch resumes after the
    // snapshot's revision, so no change made while this gateway was away is
    // missed (etcd replays them); a compaction past it → a full re-read.
    let mut need_full = false;
    // The newest revision seen (applied or rejected): the watch resumes after it.
    let mut seen = src.applied().map_or(0, |s| s.read_revision);
    let mut backoff = Duration::from_millis(100);
    loop {
        if need_full {
            match src.read_any(None).await {
                Ok(snap) => {
                    seen = snap.read_revision;
                    let (g, s) = (gw.clone(), src.clone());
                    let unchanged = src.applied().is_some_and(|a| a.kvs == snap.kvs);
                    if unchanged {
                        // Same content (e.g. after a broken watch): live again.
                        let mut snap = snap;
                        snap.revision = src.applied().map_or(snap.revision, |a| a.revision);
                        src.set_applied(&gw, Arc::new(snap), true);
                    } else {
                        let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap)).await;
                    }
                    need_full = false;
                    backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    src.set_store_error(&gw, &e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
            }
        }
        let mut client = match src.client().await {
            Ok(c) => c,
            Err(e) => {
                src.set_store_error(&gw, &e);
                src.failed().await;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(3));
                continue;
            }
        };
        let (start, end) = range(&src.prefix);
        let opts = WatchOptions::new()
            .with_range(end)
            .with_start_revision(seen + 1)
            .with_progress_notify();
        let mut stream =
            match tokio::time::timeout(src.timeout(), client.watch(start, Some(opts))).await {
                Ok(Ok(s)) => s,
                // No watch yet: try again from the same revision (nothing
                // is missed; a compaction meanwhile shows on the new watch).
                Ok(Err(e)) => {
                    src.set_store_error(&gw, &format!("watch: {e}"));
                    src.failed().await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
                Err(_) => {
                    src.set_store_error(&gw, "watch: timed out");
                    src.failed().await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                    continue;
                }
            };
        // The watch is established: etcd reachable.
        let mut pending: Option<i64> = None;
        loop {
            let msg = match pending {
                Some(_) => match tokio::time::timeout(debounce, stream.message()).await {
                    Ok(m) => m,
                    Err(_) => {
                        // Quiet: read at the last event's revision and apply.
                        let rev = pending.take().unwrap_or(seen);
                        match src.client().await {
                            Ok(mut c) => match read(&mut c, &src.prefix, Some(rev), src.timeout())
                                .await
                            {
                                Ok(snap) => {
                                    seen = rev;
                                    let (g, s) = (gw.clone(), src.clone());
                                    let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap))
                                        .await;
                                    continue;
                                }
                                Err(e) => {
                                    src.set_store_error(&gw, &e);
                                    src.failed().await;
                                    need_full = true;
                                    break;
                                }
                            },
                            Err(e) => {
                                src.set_store_error(&gw, &e);
                                need_full = true;
                                break;
                            }
                        }
                    }
                },
                None => stream.message().await,
            };
            match msg {
                Ok(Some(resp)) => {
                    if resp.compact_revision() > 0 || resp.canceled() {
                        tracing::warn!(
                            compact_revision = resp.compact_revision(),
                            reason = resp.cancel_reason(),
                            "etcd watch cancelled (compaction or leader loss); re-reading"
                        );
                        need_full = true;
                        break;
                    }
                    // The watch answers from the snapshot's revision on: the
                    // store is reached and nothing is missed.
                    src.mark_live(&gw);
                    for ev in resp.events() {
                        if let Some(kv) = ev.kv() {
                            let r = kv.mod_revision();
                            pending = Some(pending.map_or(r, |p| p.max(r)));
                        }
                    }
                }
                Ok(None) => {
                    src.set_store_error(&gw, "watch closed");
                    src.failed().await;
                    need_full = true;
                    break;
                }
                Err(e) => {
                    src.set_store_error(&gw, &format!("watch broken: {e}"));
                    src.failed().await;
                    need_full = true;
                    break;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(3));
    }
}

/// SIGHUP: a full re-read at the current revision (as a files gateway
/// reloads its files).
async fn sighup(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP; re-reading etcd");
        match src.read_any(None).await {
            Ok(snap) => {
                let (g, s) = (gw.clone(), src.clone());
                let _ = tokio::task::spawn_blocking(move || s.apply(&g, snap)).await;
            }
            Err(e) => src.set_store_error(&gw, &e),
        }
    }
}
