//! Layer: control plane. Progressive releases in an etcd fleet. Keys under
//! the fleet's prefix:
//!
//! ```text
//! <prefix>/releases/<name>        one release: spec and state (JSON). Inside the
//!                                 snapshot range, so every gateway's watch builds
//!                                 it into its next generation (the step's rule)
//! <prefix>/stats/<gateway-id>     each gateway's per-lane counters (JSON, leased)
//! <prefix>/tasks/releases/leader  the id of the gateway that drives every release
//!                                 (leased; its create revision fences the writes)
//! ```
//!
//! Election is lease + transaction: a gateway whose put-if-absent of the
//! leader key succeeds leads while it keeps its lease alive; it ticks the
//! analysis and writes release state only with a transaction that compares
//! the leader key's create revision (its term) and the release key's mod
//! revision, so a leader that lost its lease cannot write. Every gateway
//! publishes its cumulative lane counters; the leader judges an interval on
//! the sum of every gateway's difference over it (a gateway whose key
//! vanished is not counted). Admin actions on any gateway are
//! compare-and-swap writes of the release key.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use super::{leader_key, release_key, releases_range, stats_key, EtcdSource};
use crate::config::release::ReleaseRecord;
use crate::control::Gateway;
use crate::observe::lanes::{LaneSnapshot, BUCKETS};

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// One lane's cumulative counters as published (buckets sparse).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LaneDoc {
    pub requests: u64,
    pub errors: u64,
    /// `[bucket index, count]` for every non-empty bucket.
    pub buckets: Vec<(usize, u64)>,
}

impl LaneDoc {
    fn of(s: &LaneSnapshot) -> LaneDoc {
        LaneDoc {
            requests: s.requests,
            errors: s.errors,
            buckets: s
                .buckets
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| (i, *n))
                .collect(),
        }
    }

    fn snapshot(&self) -> LaneSnapshot {
        let mut buckets = vec![0; BUCKETS];
        for (i, n) in &self.buckets {
            if let Some(b) = buckets.get_mut(*i) {
                *b = *n;
            }
        }
        LaneSnapshot {
            requests: self.requests,
            errors: self.errors,
            buckets,
        }
    }
}

/// `<prefix>/stats/<id>`: one gateway's counters since it started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CountersDoc {
    pub id: String,
    /// Unix ms when this process started counting (a restart resets).
    pub boot: u64,
    /// Unix ms of this publication.
    pub at: u64,
    pub lanes: BTreeMap<String, LaneDoc>,
}

/// One gateway's counters at one moment.
#[derive(Debug, Clone, Default)]
pub struct GatewayCounts {
    pub boot: u64,
    pub lanes: HashMap<String, LaneSnapshot>,
}

/// Every gateway's counters at one moment (on files: one entry).
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub gateways: BTreeMap<String, GatewayCounts>,
}

impl Sample {
    /// The sum over every gateway of what `lane` did since `then` (taken at
    /// unix ms `then_at`), and how many gateways were counted: those in
    /// both samples with the same boot, and those started since `then`.
    /// A gateway gone since, or back with counts not comparable, is not
    /// counted. `None`: no counted gateway tracks the lane.
    pub fn since(&self, then: &Sample, then_at: u64, lane: &str) -> (Option<LaneSnapshot>, usize) {
        let mut sum: Option<LaneSnapshot> = None;
        let mut counted = 0;
        for (id, now) in &self.gateways {
            let base = match then.gateways.get(id) {
                Some(t) if t.boot == now.boot => t.lanes.get(lane),
                _ if now.boot >= then_at && then_at > 0 => None,
                _ => continue,
            };
            counted += 1;
            let Some(n) = now.lanes.get(lane) else {
                continue;
            };
            let d = match base {
                Some(b) => n.since(b),
                None => n.clone(),
            };
            sum = Some(match sum {
                None => d,
                Some(s) => LaneSnapshot {
                    requests: s.requests + d.requests,
                    errors: s.errors + d.errors,
                    buckets: s
                        .buckets
                        .iter()
                        .zip(&d.buckets)
                        .map(|(a, b)| a + b)
                        .collect(),
                },
            });
        }
        (sum, counted)
    }
}

/// This gateway's view of the election.
#[derive(Debug, Default)]
pub struct Leadership {
    /// The leader at the last look (`None`: unknown, e.g. etcd down).
    pub leader: Option<String>,
    /// This gateway's term: the leader key's create revision and until
    /// when the lease is surely alive.
    term: Option<(i64, Instant)>,
    /// Why the last look failed.
    pub error: Option<String>,
}

impl Leadership {
    /// This gateway's term (the fence for its writes) while it leads.
    pub fn fence(&self) -> Option<i64> {
        self.term
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(f, _)| f)
    }
}

/// The election as `GET /releases` and `/fleet` show it.
pub fn leadership_view(gw: &Gateway) -> serde_json::Value {
    let l = gw.releases.fleet.lock().unwrap_or_else(|e| e.into_inner());
    serde_json::json!({
        "leader": l.leader,
        "this_gateway_leads": l.fence().is_some(),
        "election_error": l.error,
    })
}

/// One look at the leader key: put it (with our lease) if absent, else read
/// who holds it. Returns the holder's id and, if it is us, our term.
async fn campaign_once(
    src: &EtcdSource,
    key: &str,
    ttl: i64,
    lease: &mut Option<i64>,
) -> Result<(String, Option<i64>), String> {
    let mut c = src.client().await?;
    let id = match *lease {
        Some(l) => {
            if let Err(e) = super::registry::keep_alive(&mut c, l).await {
                *lease = None;
                return Err(e);
            }
            l
        }
        None => {
            let l = tokio::time::timeout(src.timeout(), c.lease_grant(ttl, None))
                .await
                .map_err(|_| "lease grant timed out".to_string())?
                .map_err(err)?
                .id();
            *lease = Some(l);
            l
        }
    };
    let txn = Txn::new()
        .when(vec![Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then(vec![TxnOp::put(
            key,
            src.id.as_str(),
            Some(PutOptions::new().with_lease(id)),
        )])
        .or_else(vec![TxnOp::get(key, None)]);
    let resp = tokio::time::timeout(src.timeout(), c.txn(txn))
        .await
        .map_err(|_| "leader transaction timed out".to_string())?
        .map_err(err)?;
    if resp.succeeded() {
        let rev = resp.header().map_or(0, |h| h.revision());
        return Ok((src.id.clone(), Some(rev)));
    }
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(g) = op {
            if let Some(kv) = g.kvs().first() {
                let holder = String::from_utf8_lossy(kv.value()).into_owned();
                let ours = kv.lease() == id && holder == src.id;
                return Ok((holder, ours.then(|| kv.create_revision())));
            }
        }
    }
    Err("leader key vanished during the transaction".into())
}

/// Campaigns for the release leadership until the process ends: leads
/// while its lease lives, stops leading at once when a renewal fails.
pub async fn campaign(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    let key = leader_key(&src.prefix);
    let ttl = src.settings.leader_ttl_secs.max(2);
    let beat = Duration::from_millis(ttl as u64 * 1000 / 3);
    let poll = beat.min(Duration::from_millis(250));
    let mut lease = None;
    loop {
        let sent = Instant::now();
        let res = campaign_once(&src, &key, ttl, &mut lease).await;
        let leads = {
            let mut l = gw.releases.fleet.lock().unwrap_or_else(|e| e.into_inner());
            let was = l.fence().is_some();
            match res {
                Ok((holder, term)) => {
                    l.leader = Some(holder);
                    l.term = term.map(|f| (f, sent + Duration::from_secs(ttl as u64)));
                    l.error = None;
                }
                Err(e) => {
                    l.leader = None;
                    l.term = None;
                    l.error = Some(e);
                }
            }
            let now = l.fence().is_some();
            if now != was {
                tracing::info!(
                    gateway = %src.id,
                    leads = now,
                    leader = l.leader.as_deref().unwrap_or("unknown"),
                    error = l.error.as_deref().unwrap_or(""),
                    "release leadership changed"
                );
            }
            now
        };
        tokio::time::sleep(if leads { beat } else { poll }).await;
    }
}

/// At a graceful stop: give the leadership up (the key is deleted only if
/// it is still this gateway's term).
pub async fn resign(gw: &Gateway, src: &EtcdSource) {
    let Some(fence) = gw
        .releases
        .fleet
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .fence()
    else {
        return;
    };
    let key = leader_key(&src.prefix);
    if let Ok(mut c) = src.client().await {
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                key.as_str(),
                CompareOp::Equal,
                fence,
            )])
            .and_then(vec![TxnOp::delete(key.as_str(), None)]);
        let _ = tokio::time::timeout(Duration::from_secs(1), c.txn(txn)).await;
    }
}

/// This gateway's counters document now.
pub fn counters_doc(gw: &Gateway, id: &str, boot: u64) -> CountersDoc {
    let lanes = &gw.plane.metrics.lanes;
    CountersDoc {
        id: id.to_string(),
        boot,
        at: unix_ms(),
        lanes: lanes
            .lanes()
            .into_iter()
            .filter_map(|l| lanes.snapshot(&l).map(|s| (l, LaneDoc::of(&s))))
            .collect(),
    }
}

/// Publishes this gateway's lane counters every `counters_ms` under its
/// own lease (TTL `leader_ttl_secs`: a dead gateway's counters expire).
pub async fn publish_counters(gw: Arc<Gateway>, src: Arc<EtcdSource>) {
    let key = stats_key(&src.prefix, &src.id);
    let ttl = src.settings.leader_ttl_secs.max(2);
    let beat = Duration::from_millis(ttl as u64 * 1000 / 3);
    let every = Duration::from_millis(src.settings.counters_ms.max(50));
    let boot = unix_ms();
    let mut lease: Option<(i64, Instant)> = None;
    let mut last: Option<BTreeMap<String, LaneDoc>> = None;
    loop {
        let doc = counters_doc(&gw, &src.id, boot);
        let res: Result<(), String> = async {
            let mut c = src.client().await?;
            let id = match lease {
                Some((id, renewed)) if renewed.elapsed() < beat => id,
                Some((id, _)) => {
                    super::registry::keep_alive(&mut c, id).await?;
                    lease = Some((id, Instant::now()));
                    id
                }
                None => {
                    let id = c.lease_grant(ttl, None).await.map_err(err)?.id();
                    lease = Some((id, Instant::now()));
                    last = None;
                    id
                }
            };
            if last.as_ref() != Some(&doc.lanes) {
                let text = serde_json::to_string(&doc).map_err(err)?;
                tokio::time::timeout(
                    src.timeout(),
                    c.put(key.as_str(), text, Some(PutOptions::new().with_lease(id))),
                )
                .await
                .map_err(|_| "counters put timed out".to_string())?
                .map_err(err)?;
                last = Some(doc.lanes);
            }
            Ok(())
        }
        .await;
        if res.is_err() {
            lease = None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Every gateway's published counters (the leader's sample).
pub async fn sample(src: &EtcdSource) -> Result<Sample, String> {
    let mut c = src.client().await?;
    let prefix = format!("{}/stats/", src.prefix);
    let resp = tokio::time::timeout(
        src.timeout(),
        c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| "etcd read timed out".to_string())?
    .map_err(err)?;
    let mut s = Sample::default();
    for kv in resp.kvs() {
        let Ok(doc) = serde_json::from_slice::<CountersDoc>(kv.value()) else {
            tracing::warn!(key = %String::from_utf8_lossy(kv.key()), "unreadable counters key: not counted");
            continue;
        };
        s.gateways.insert(
            doc.id.clone(),
            GatewayCounts {
                boot: doc.boot,
                lanes: doc
                    .lanes
                    .iter()
                    .map(|(l, d)| (l.clone(), d.snapshot()))
                    .collect(),
            },
        );
    }
    if s.gateways.is_empty() {
        return Err("no gateway published counters".into());
    }
    Ok(s)
}

/// Every release in etcd now, with its key's mod revision, and the
/// revision read at.
pub async fn load(src: &EtcdSource) -> Result<(Vec<(ReleaseRecord, i64)>, i64), String> {
    let mut c = src.client().await?;
    let (start, end) = releases_range(&src.prefix);
    let resp = tokio::time::timeout(
        src.timeout(),
        c.get(start.as_str(), Some(GetOptions::new().with_range(end))),
    )
    .await
    .map_err(|_| "etcd read timed out".to_string())?
    .map_err(err)?;
    let mut out = Vec::new();
    for kv in resp.kvs() {
        match serde_json::from_slice::<ReleaseRecord>(kv.value()) {
            Ok(r) => out.push((r, kv.mod_revision())),
            Err(e) => tracing::warn!(
                key = %String::from_utf8_lossy(kv.key()),
                error = %e,
                "unreadable release key: skipped"
            ),
        }
    }
    Ok((out, resp.header().map_or(0, |h| h.revision())))
}

/// Every release in the snapshot this gateway serves.
pub fn list(src: &EtcdSource) -> Vec<ReleaseRecord> {
    let Some(snap) = src.applied() else {
        return Vec::new();
    };
    let (start, end) = releases_range(&src.prefix);
    snap.kvs
        .range(start..end)
        .filter_map(|(_, kv)| serde_json::from_slice(&kv.value).ok())
        .collect()
}

/// The guard of a write: the leader's term, the key's mod revision it read
/// (0: the key must not exist yet), and for a creation the revision the
/// whole release range was read at (no release changed since).
pub struct Guard {
    pub fence: Option<i64>,
    pub mod_revision: i64,
    pub range_read_at: Option<i64>,
}

/// Writes release `r` if `guard` holds. `Ok(Some(revision))` written,
/// `Ok(None)` the guard failed (a concurrent change or a lost term).
pub async fn write(
    src: &EtcdSource,
    r: &ReleaseRecord,
    guard: &Guard,
) -> Result<Option<i64>, String> {
    let key = release_key(&src.prefix, &r.spec.name);
    let mut when = vec![Compare::mod_revision(
        key.as_str(),
        CompareOp::Equal,
        guard.mod_revision,
    )];
    if let Some(f) = guard.fence {
        when.push(Compare::create_revision(
            leader_key(&src.prefix),
            CompareOp::Equal,
            f,
        ));
    }
    if let Some(at) = guard.range_read_at {
        let (start, end) = releases_range(&src.prefix);
        when.push(Compare::mod_revision(start, CompareOp::Less, at + 1).with_range(end));
    }
    let text = serde_json::to_string(r).map_err(err)?;
    let mut c = src.client().await?;
    let resp = match tokio::time::timeout(
        src.timeout(),
        c.txn(
            Txn::new()
                .when(when)
                .and_then(vec![TxnOp::put(key, text, None)]),
        ),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            src.failed().await;
            return Err(err(e));
        }
        Err(_) => {
            src.failed().await;
            return Err("etcd transaction timed out".into());
        }
    };
    Ok(resp
        .succeeded()
        .then(|| resp.header().map_or(0, |h| h.revision())))
}

/// Where a release key lives, as a path (for errors).
pub fn key_path(src: &EtcdSource, name: &str) -> PathBuf {
    PathBuf::from(release_key(&src.prefix, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(boot: u64, requests: u64) -> GatewayCounts {
        let mut buckets = vec![0; BUCKETS];
        buckets[3] = requests;
        let s = LaneSnapshot {
            requests,
            errors: 0,
            buckets,
        };
        GatewayCounts {
            boot,
            lanes: [("gray".to_string(), s)].into_iter().collect(),
        }
    }

    fn sample(entries: &[(&str, GatewayCounts)]) -> Sample {
        Sample {
            gateways: entries
                .iter()
                .map(|(id, c)| (id.to_string(), c.clone()))
                .collect(),
        }
    }

    #[test]
    fn the_sum_counts_every_comparable_gateway_and_only_those() {
        let then = sample(&[
            ("a", counts(1, 10)),
            ("b", counts(1, 100)),
            ("c", counts(1, 5)),
        ]);
        // a: +5; b: restarted at 2000 (after the mark at 1000) → all 7;
        // c: gone; d: new since the mark → all 3; e: present before the
        // mark but not in it → not comparable.
        let now = sample(&[
            ("a", counts(1, 15)),
            ("b", counts(2000, 7)),
            ("d", counts(1500, 3)),
            ("e", counts(500, 40)),
        ]);
        let (sum, n) = now.since(&then, 1000, "gray");
        let sum = sum.unwrap();
        assert_eq!(n, 3);
        assert_eq!(sum.requests, 15);
        assert_eq!(sum.buckets[3], 15);
        // A lane no counted gateway tracks: no data.
        assert!(now.since(&then, 1000, "blue").0.is_none());
    }

    #[test]
    fn sparse_buckets_round_trip() {
        let mut buckets = vec![0; BUCKETS];
        buckets[0] = 2;
        buckets[BUCKETS - 1] = 9;
        let s = LaneSnapshot {
            requests: 11,
            errors: 1,
            buckets,
        };
        let d = LaneDoc::of(&s);
        assert_eq!(d.buckets, vec![(0, 2), (BUCKETS - 1, 9)]);
        assert_eq!(d.snapshot(), s);
    }
}
