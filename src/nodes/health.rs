//! Layer: nodes. Node health that outlives generations: a registry keyed by
//! (service, node address) holding passive state (consecutive failures,
//! ejection with cool-down, trial re-admission) and active state (background
//! HTTP probes that follow reloads). Selection in `nodes` reads it lock-free.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use super::Service;
use crate::config::{ActiveHealth, PassiveHealth};
use crate::upstream::body::UpBody;
use crate::upstream::{OutHead, Peer, Upstream};

use crate::base::clock::now_ms;

/// The health of one node. All fields are atomics: selection reads them on
/// every request without locking.
#[derive(Debug, Default)]
pub struct NodeHealth {
    fails: AtomicU32,
    /// 0 = not ejected; else the `now_ms` when the cool-down ends. Past
    /// that moment the node is on trial: one success re-admits it, one
    /// failure ejects it again.
    ejected_until: AtomicU64,
    active_down: AtomicBool,
    ejections: AtomicU64,
    /// 0 = warm; else the `now_ms` when the node joined or was re-admitted,
    /// from which slow start ramps its weight (see `nodes::balance`).
    warm_since: AtomicU64,
}

/// A point-in-time view of a node's health (for status pages and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthView {
    pub available: bool,
    pub ejected: bool,
    pub on_trial: bool,
    pub active_down: bool,
    pub consecutive_fails: u32,
    pub ejections: u64,
}

impl NodeHealth {
    /// May selection use this node at `now` (a `now_ms` value)?
    pub fn available(&self, now: u64) -> bool {
        if self.active_down.load(Ordering::Relaxed) {
            return false;
        }
        let until = self.ejected_until.load(Ordering::Relaxed);
        until == 0 || now >= until
    }

    pub fn view(&self) -> HealthView {
        let now = now_ms();
        let until = self.ejected_until.load(Ordering::Relaxed);
        HealthView {
            available: self.available(now),
            ejected: until != 0 && now < until,
            on_trial: until != 0 && now >= until,
            active_down: self.active_down.load(Ordering::Relaxed),
            consecutive_fails: self.fails.load(Ordering::Relaxed),
            ejections: self.ejections.load(Ordering::Relaxed),
        }
    }

    /// A node new to the registry (or re-admitted) at `now`: slow start
    /// ramps its weight from here.
    pub fn joined(now: u64) -> NodeHealth {
        let h = NodeHealth::default();
        h.warm_since.store(now, Ordering::Relaxed);
        h
    }

    /// The `now_ms` from which the node's slow start runs (0 = none).
    pub fn warm_since(&self) -> u64 {
        self.warm_since.load(Ordering::Relaxed)
    }

    /// Starts (or restarts) the node's slow start at `now`.
    pub fn start_warming(&self, now: u64) {
        self.warm_since.store(now, Ordering::Relaxed);
    }

    /// A request reached the node and got an acceptable answer.
    pub fn success(&self, node: &str) {
        self.fails.store(0, Ordering::Relaxed);
        if self.ejected_until.swap(0, Ordering::Relaxed) != 0 {
            self.start_warming(now_ms());
            tracing::info!(node, "node passed its trial request; re-admitted");
        }
    }

    /// A request to the node failed (connect error, timeout, no response,
    /// or a 5xx when configured to count).
    pub fn failure(&self, node: &str, policy: &PassiveHealth) {
        if policy.max_fails == 0 {
            return;
        }
        let now = now_ms();
        let until = self.ejected_until.load(Ordering::Relaxed);
        if until != 0 {
            // Ejected: a failure of the trial request ejects it again; a late
            // failure of a request sent before the ejection changes nothing.
            if now >= until
                && self
                    .ejected_until
                    .compare_exchange(
                        until,
                        now + policy.cooldown_ms,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                self.ejections.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    node,
                    cooldown_ms = policy.cooldown_ms,
                    "node failed its trial request; ejected again"
                );
            }
            return;
        }
        let fails = self.fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails >= policy.max_fails
            && self
                .ejected_until
                .compare_exchange(
                    0,
                    now + policy.cooldown_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            self.fails.store(0, Ordering::Relaxed);
            self.ejections.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                node,
                fails,
                cooldown_ms = policy.cooldown_ms,
                "node ejected after consecutive failures"
            );
        }
    }

    fn set_active_down(&self, node: &str, down: bool) {
        if self.active_down.swap(down, Ordering::Relaxed) != down {
            if down {
                tracing::warn!(node, "active health check: node unhealthy");
            } else {
                self.start_warming(now_ms());
                tracing::info!(node, "active health check: node healthy again");
            }
        }
    }
}

type Key = (String, SocketAddr);

struct Checker {
    cfg: ActiveHealth,
    lane: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Checker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Health of every node of the current generation, kept across reloads.
#[derive(Default)]
pub struct HealthRegistry {
    nodes: Mutex<HashMap<Key, Arc<NodeHealth>>>,
    /// Set after the first generation: nodes first seen later have joined
    /// (slow start); those of the first generation start warm.
    primed: AtomicBool,
    checkers: Mutex<HashMap<Key, Checker>>,
}

impl HealthRegistry {
    /// Points every node of `gen` at its registry entry, so state carries
    /// over from the previous generation. Call before the swap.
    ///
    /// A node first seen after the first generation has *joined*: its
    /// slow start (if the service has one) runs from now.
    pub fn attach(&self, services: &mut BTreeMap<String, Service>) {
        let mut map = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let joined = self.primed.swap(true, Ordering::Relaxed);
        let now = now_ms();
        for (name, svc) in services.iter_mut() {
            svc.attach_health(|addr| {
                map.entry((name.clone(), addr))
                    .or_insert_with(|| {
                        Arc::new(if joined {
                            NodeHealth::joined(now)
                        } else {
                            NodeHealth::default()
                        })
                    })
                    .clone()
            });
        }
    }

    /// After a swap: forgets nodes no longer configured, stops their probes,
    /// starts probes for added nodes and restarts changed ones.
    /// Probes carry `tag_header` set to the node's lane.
    pub fn sync(
        &self,
        services: &BTreeMap<String, Service>,
        tag_header: &HeaderName,
        client: &Upstream,
    ) {
        #[allow(clippy::type_complexity)]
        let mut wanted: HashMap<
            Key,
            (
                ActiveHealth,
                String,
                Option<Arc<crate::upstream::tls::Transport>>,
            ),
        > = HashMap::new();
        let mut present: HashSet<Key> = HashSet::new();
        for (name, svc) in services {
            for (lane, set) in &svc.lanes {
                for node in &set.nodes {
                    let key = (name.clone(), node.addr);
                    present.insert(key.clone());
                    if let Some(a) = &svc.health.active {
                        wanted.insert(key, (a.clone(), lane.clone(), svc.transport.clone()));
                    }
                }
            }
        }
        let handles: HashMap<Key, Arc<NodeHealth>> = {
            let mut map = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
            map.retain(|k, _| present.contains(k));
            map.clone()
        };
        let mut checkers = self.checkers.lock().unwrap_or_else(|e| e.into_inner());
        checkers.retain(|k, c| {
            let keep = wanted
                .get(k)
                .is_some_and(|(cfg, lane, _)| *cfg == c.cfg && *lane == c.lane);
            if !keep {
                tracing::info!(service = %k.0, addr = %k.1, "health checker stopped");
            }
            keep
        });
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for (key, (cfg, lane, transport)) in wanted {
            if checkers.contains_key(&key) {
                continue;
            }
            let Some(health) = handles.get(&key).cloned() else {
                continue;
            };
            // Any active node is unknown until probed; start it healthy so
            // a reload never blackholes traffic.
            health.active_down.store(false, Ordering::Relaxed);
            tracing::info!(service = %key.0, addr = %key.1, path = %cfg.path, "health checker started");
            let task = rt.spawn(probe_loop(
                client.clone(),
                transport,
                tag_header.clone(),
                key.1,
                lane.clone(),
                cfg.clone(),
                health,
            ));
            checkers.insert(key, Checker { cfg, lane, task });
        }
        // Nodes without active checks are never held down by a probe.
        for (key, h) in &handles {
            if !checkers.contains_key(key) {
                h.active_down.store(false, Ordering::Relaxed);
            }
        }
    }

    /// The health of one node, if configured.
    pub fn node(&self, service: &str, addr: SocketAddr) -> Option<Arc<NodeHealth>> {
        let map = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(service.to_string(), addr)).cloned()
    }

    /// Every known node's health: (service, addr, view).
    pub fn snapshot(&self) -> Vec<(String, SocketAddr, HealthView)> {
        let map = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = map
            .iter()
            .map(|((s, a), h)| (s.clone(), *a, h.view()))
            .collect();
        v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        v
    }

    /// Number of running active checkers.
    pub fn checker_count(&self) -> usize {
        self.checkers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

async fn probe_loop(
    client: Upstream,
    transport: Option<Arc<crate::upstream::tls::Transport>>,
    tag_header: HeaderName,
    addr: SocketAddr,
    lane: String,
    cfg: ActiveHealth,
    health: Arc<NodeHealth>,
) {
    let label = addr.to_string();
    let mut successes = 0u32;
    let mut failures = 0u32;
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms.max(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let ok = probe(
            &client,
            transport.as_deref(),
            &tag_header,
            addr,
            &lane,
            &cfg,
        )
        .await;
        if ok {
            failures = 0;
            successes = successes.saturating_add(1);
            if successes >= cfg.healthy.max(1) {
                health.set_active_down(&label, false);
            }
        } else {
            successes = 0;
            failures = failures.saturating_add(1);
            if failures >= cfg.unhealthy.max(1) {
                health.set_active_down(&label, true);
            }
        }
    }
}

async fn probe(
    client: &Upstream,
    transport: Option<&crate::upstream::tls::Transport>,
    tag_header: &HeaderName,
    addr: SocketAddr,
    lane: &str,
    cfg: &ActiveHealth,
) -> bool {
    let Ok(target) = http::Uri::try_from(cfg.path.as_str()) else {
        return false;
    };
    let mut headers = http::HeaderMap::with_capacity(2);
    if let Ok(v) = HeaderValue::from_str(lane) {
        headers.insert(tag_header.clone(), v);
    }
    headers.insert(
        http::header::USER_AGENT,
        HeaderValue::from_static("graygate-health"),
    );
    let fut = async {
        let read_timeout = Duration::from_millis(cfg.timeout_ms);
        let head = OutHead::own(&http::Method::GET, &target, &headers);
        let resp = client
            .send(
                Peer { addr, transport },
                head,
                UpBody::Empty,
                (read_timeout, read_timeout),
            )
            .await
            .ok()?;
        let ok = resp.status().is_success() || resp.status().is_redirection();
        // Drain the body so the connection can be reused.
        let _ = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_else(|_| Bytes::new());
        Some(ok)
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(cfg.timeout_ms), fut).await,
        Ok(Some(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max_fails: u32, cooldown_ms: u64) -> PassiveHealth {
        PassiveHealth {
            max_fails,
            cooldown_ms,
            fail_on_5xx: true,
        }
    }

    #[test]
    fn ejects_after_consecutive_failures_only() {
        let h = NodeHealth::default();
        let p = policy(3, 60_000);
        h.failure("n", &p);
        h.failure("n", &p);
        h.success("n");
        h.failure("n", &p);
        h.failure("n", &p);
        assert!(h.available(now_ms()), "a success resets the count");
        h.failure("n", &p);
        assert!(!h.available(now_ms()));
        assert_eq!(h.view().ejections, 1);
        assert!(h.view().ejected);
    }

    #[test]
    fn trial_after_cooldown_readmits_or_reejects() {
        let h = NodeHealth::default();
        let p = policy(1, 0);
        h.failure("n", &p);
        // Cool-down of 0: on trial at once.
        assert!(h.available(now_ms()));
        assert!(h.view().on_trial);
        // The trial fails: ejected again (a long cool-down this time).
        h.failure("n", &policy(1, 60_000));
        assert!(!h.available(now_ms()));
        assert_eq!(h.view().ejections, 2);
        // Force the cool-down over, then a trial success re-admits fully.
        h.ejected_until.store(1, Ordering::Relaxed);
        assert!(h.view().on_trial);
        h.success("n");
        assert!(!h.view().on_trial && !h.view().ejected);
    }

    #[test]
    fn active_down_overrides_passive() {
        let h = NodeHealth::default();
        h.set_active_down("n", true);
        assert!(!h.available(now_ms()));
        h.set_active_down("n", false);
        assert!(h.available(now_ms()));
    }

    #[test]
    fn disabled_passive_never_ejects() {
        let h = NodeHealth::default();
        for _ in 0..10 {
            h.failure("n", &policy(0, 1000));
        }
        assert!(h.available(now_ms()));
    }

    #[test]
    fn readmission_and_joining_start_slow_start() {
        let h = NodeHealth::default();
        assert_eq!(h.warm_since(), 0, "warm unless it joined");
        h.failure("n", &policy(1, 0));
        assert_eq!(h.warm_since(), 0, "ejection alone does not warm");
        h.success("n");
        assert_ne!(h.warm_since(), 0, "a passed trial restarts the ramp");
        let a = NodeHealth::default();
        a.set_active_down("n", true);
        a.set_active_down("n", false);
        assert_ne!(a.warm_since(), 0, "back from an active check: ramp");
    }

    #[test]
    fn nodes_joining_after_the_first_generation_warm_up() {
        use crate::nodes::{Node, Service};
        let node = |port: u16| Node {
            name: format!("n{port}").into(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            lane: "formal".into(),
            weight: 1,
            drain: false,
            zone: None,
        };
        let reg = HealthRegistry::default();
        let mut first = BTreeMap::from([("s".to_string(), Service::new("s", vec![node(1)]))]);
        reg.attach(&mut first);
        assert_eq!(first["s"].lanes["formal"].health[0].warm_since(), 0);
        let mut second =
            BTreeMap::from([("s".to_string(), Service::new("s", vec![node(1), node(2)]))]);
        reg.attach(&mut second);
        let set = &second["s"].lanes["formal"];
        assert_eq!(set.health[0].warm_since(), 0, "kept: still warm");
        assert_ne!(set.health[1].warm_since(), 0, "joined: warming");
    }
}
