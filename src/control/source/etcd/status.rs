//! Layer: control plane. How an etcd gateway stands and who hears of it:
//! the `/status` fields (`source_state` live, stale or cached, revision,
//! config hash, store error), this gateway's leased `<prefix>/status/<id>` key,
//! and `/fleet` (every gateway's key, and whether all serve the same
//! revision and configuration).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{GetOptions, PutOptions};

use super::keys::status_key;
use super::{err, EtcdSource, Snapshot};
use crate::control::Gateway;

impl EtcdSource {
    pub(super) fn set_applied(&self, gw: &Gateway, snap: Arc<Snapshot>, live: bool) {
        // The cache first: a revision `/status` shows is already on disk.
        if live {
            snap.save(&self.cache_path());
        }
        {
            let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
            st.source_state = Some(if live { "live" } else { "cached" });
            st.revision = Some(snap.revision);
            st.config_hash = Some(snap.hash());
            st.gateway_id = Some(self.id.clone());
            if live {
                st.store_error = None;
            }
        }
        *self.applied.lock().unwrap_or_else(|e| e.into_inner()) = Some(snap);
        self.changed.notify_one();
    }

    /// The store answered a watch from the serving snapshot's revision:
    /// live (a cached start caught up), no store error.
    pub(super) fn mark_live(&self, gw: &Gateway) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.is_some() || st.source_state != Some("live") {
            if st.source_state == Some("cached") {
                tracing::info!(
                    revision = st.revision,
                    "etcd reached: the cached snapshot is current"
                );
            }
            st.store_error = None;
            st.source_state = Some("live");
            drop(st);
            self.changed.notify_one();
        }
    }

    /// The store failed: its error shows, and a live gateway is `stale`
    /// until the store answers again (a cached one stays `cached`).
    pub(super) fn set_store_error(&self, gw: &Gateway, e: &str) {
        let mut st = gw.source.lock().unwrap_or_else(|e| e.into_inner());
        if st.store_error.as_deref() != Some(e) {
            tracing::warn!(error = %e, "etcd: unreachable or failing; serving the last configuration");
        }
        st.store_error = Some(e.to_string());
        if st.source_state == Some("live") {
            st.source_state = Some("stale");
        }
    }
}

/// This gateway's status document (`<prefix>/status/<id>`).
pub fn status_doc(gw: &Gateway, src: &EtcdSource) -> serde_json::Value {
    let st = gw.source.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let reload = gw.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    serde_json::json!({
        "id": src.id,
        "revision": st.revision,
        "config_hash": st.config_hash,
        "last_error": reload.last_reload_error,
        "store_error": st.store_error,
        "source_state": st.source_state,
        "generation": gw.current().id,
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_secs": gw.started.elapsed().as_secs(),
        "updated_at": now,
        "listen": src.bootstrap.listen,
        "admin_listen": src.bootstrap.admin_listen,
    })
}

/// Keeps `<prefix>/status/<id>` current under a lease: written on every
/// change and every third of the TTL (keeping the lease alive).
pub(super) async fn publish_status(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    let key = status_key(&src.prefix, &src.id);
    let ttl = src.settings.status_ttl_secs.max(2);
    let beat = Duration::from_millis(ttl as u64 * 1000 / 3);
    let mut lease: Option<i64> = None;
    loop {
        let doc = status_doc(&gw, &src).to_string();
        let res: Result<(), String> = async {
            let mut c = src.client().await?;
            let id = match lease {
                Some(id) => {
                    super::registry::keep_alive(&mut c, id).await?;
                    id
                }
                None => {
                    let id = c.lease_grant(ttl, None).await.map_err(err)?.id();
                    lease = Some(id);
                    id
                }
            };
            c.put(key.as_str(), doc, Some(PutOptions::new().with_lease(id)))
                .await
                .map_err(err)?;
            Ok(())
        }
        .await;
        let res = match res {
            Ok(()) => Ok(()),
            Err(e) => {
                lease = None;
                Err(e)
            }
        };
        if res.is_err() {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        tokio::select! {
            _ = src.changed.notified() => {}
            _ = tokio::time::sleep(beat) => {}
        }
    }
}

/// At a graceful stop: remove this gateway's status key (best effort; its
/// lease would expire it anyway).
pub async fn leave(src: &EtcdSource) {
    let key = status_key(&src.prefix, &src.id);
    if let Ok(mut c) = src.client().await {
        let _ = tokio::time::timeout(Duration::from_secs(1), c.delete(key, None)).await;
    }
}

/// Every gateway's status document under the prefix, and whether all run
/// the same revision and configuration.
pub async fn fleet(src: &EtcdSource) -> Result<serde_json::Value, String> {
    let mut c = src.client().await?;
    let prefix = format!("{}/status/", src.prefix);
    let resp = match tokio::time::timeout(
        src.timeout(),
        c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            src.failed().await;
            return Err(e.to_string());
        }
        Err(_) => {
            src.failed().await;
            return Err("etcd read timed out".into());
        }
    };
    let gateways: Vec<serde_json::Value> = resp
        .kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
        .collect();
    let revs: std::collections::BTreeSet<String> =
        gateways.iter().map(|g| g["revision"].to_string()).collect();
    // Who drives the releases (the leader key's holder).
    let leader_key = super::keys::leader_key(&src.prefix);
    let release_leader = match tokio::time::timeout(src.timeout(), c.get(leader_key, None)).await {
        Ok(Ok(r)) => r
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
        _ => None,
    };
    let hashes: std::collections::BTreeSet<String> = gateways
        .iter()
        .map(|g| g["config_hash"].to_string())
        .collect();
    Ok(serde_json::json!({
        "prefix": src.prefix,
        "gateways": gateways,
        "same_revision": revs.len() <= 1,
        "same_config": hashes.len() <= 1,
        "release_leader": release_leader,
        "revisions": revs.iter().filter_map(|r| r.parse::<i64>().ok()).collect::<Vec<_>>(),
    }))
}
