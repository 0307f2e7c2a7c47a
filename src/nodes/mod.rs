//! Layer: node choice (data plane, above upstream; uses upstream for active
//! probes, base, config). API services and their nodes, grouped by lane, and
//! the selection rule: healthy nodes of the request's lane, else formal nodes
//! (never another gray lane), picked by smooth weighted round-robin (nginx's
//! algorithm).

pub mod health;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::{HealthConfig, NodeConfig, FORMAL};
use health::NodeHealth;

/// One upstream node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Shared strings: the per-request `Decision` takes a reference-counted
    /// copy instead of allocating.
    pub name: Arc<str>,
    pub addr: SocketAddr,
    pub lane: Arc<str>,
    pub weight: u32,
    /// Draining nodes are listed but never selected.
    pub drain: bool,
}

impl Node {
    pub fn from_config(service: &str, idx: usize, c: &NodeConfig) -> Node {
        Node {
            name: c
                .name
                .clone()
                .unwrap_or_else(|| format!("{service}-{}-{idx}", c.lane))
                .into(),
            addr: c.addr,
            lane: c.lane.as_str().into(),
            weight: c.weight,
            drain: c.drain,
        }
    }
}

/// Longest precomputed round-robin schedule (entries); a lane whose total
/// weight is larger falls back to computing smooth WRR per pick.
const MAX_SCHEDULE: u64 = 1 << 16;
/// Most work (total weight × nodes) spent precomputing a schedule.
const MAX_SCHEDULE_WORK: u64 = 1 << 26;

/// The nodes of one lane of a service with their round-robin state.
///
/// Smooth weighted round-robin (nginx's algorithm) is periodic with period
/// = total weight, so the whole sequence is computed once per generation
/// and a pick is one atomic increment plus, when some nodes are down or
/// already tried, a scan to the next eligible entry — O(1) in the usual
/// case however many nodes the lane has, and lock-free.
#[derive(Debug)]
pub struct LaneNodes {
    pub nodes: Vec<Node>,
    /// Health of `nodes[i]`, shared with the registry across reloads.
    pub health: Vec<Arc<NodeHealth>>,
    schedule: Option<Vec<u32>>,
    cursor: AtomicUsize,
    /// Live smooth-WRR state, for lanes too heavy to precompute.
    current: Mutex<Vec<i64>>,
}

/// One full period of smooth weighted round-robin over `weights`.
fn smooth_schedule(weights: &[u32]) -> Option<Vec<u32>> {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if total == 0
        || total > MAX_SCHEDULE
        || total.saturating_mul(weights.len() as u64) > MAX_SCHEDULE_WORK
    {
        return None;
    }
    let mut cur = vec![0i64; weights.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0usize;
        for (i, &w) in weights.iter().enumerate() {
            cur[i] += i64::from(w);
            if cur[i] > cur[best] {
                best = i;
            }
        }
        cur[best] -= total as i64;
        out.push(best as u32);
    }
    Some(out)
}

impl LaneNodes {
    fn new(nodes: Vec<Node>) -> LaneNodes {
        let n = nodes.len();
        let weights: Vec<u32> = nodes.iter().map(|n| n.weight).collect();
        LaneNodes {
            health: (0..n).map(|_| Arc::new(NodeHealth::default())).collect(),
            schedule: smooth_schedule(&weights),
            cursor: AtomicUsize::new(0),
            nodes,
            current: Mutex::new(vec![0; n]),
        }
    }

    /// Does any node pass its health checks at `now`?
    pub fn any_available(&self, now: u64) -> bool {
        self.health.iter().any(|h| h.available(now))
    }

    fn eligible(&self, i: usize, now: u64, tried: &[usize], ignore_health: bool) -> bool {
        !tried.contains(&i) && (ignore_health || self.health[i].available(now))
    }

    /// Smooth weighted round-robin over the nodes not in `tried` and (unless
    /// `ignore_health`) available at `now`. Returns the node's index.
    pub fn pick_for(&self, now: u64, tried: &[usize], ignore_health: bool) -> Option<usize> {
        if self.nodes.len() == 1 {
            return self.eligible(0, now, tried, ignore_health).then_some(0);
        }
        match &self.schedule {
            Some(seq) => {
                let start = self.cursor.fetch_add(1, Ordering::Relaxed);
                scan(seq, start, |i| self.eligible(i, now, tried, ignore_health))
            }
            None => self.live_pick(|i| self.eligible(i, now, tried, ignore_health), true),
        }
    }

    /// The index [`pick_for`](Self::pick_for) would return next (with
    /// nothing tried yet), without moving the round-robin state — for dry
    /// runs such as `/explain`.
    pub fn peek_for(&self, now: u64, ignore_health: bool) -> Option<usize> {
        if self.nodes.len() == 1 {
            return self.eligible(0, now, &[], ignore_health).then_some(0);
        }
        match &self.schedule {
            Some(seq) => {
                let start = self.cursor.load(Ordering::Relaxed);
                scan(seq, start, |i| self.eligible(i, now, &[], ignore_health))
            }
            None => self.live_pick(|i| self.eligible(i, now, &[], ignore_health), false),
        }
    }

    /// Smooth WRR computed live (lanes too heavy to precompute).
    fn live_pick(&self, eligible: impl Fn(usize) -> bool, advance: bool) -> Option<usize> {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0i64;
        let mut best: Option<(usize, i64)> = None;
        for (i, node) in self.nodes.iter().enumerate() {
            if !eligible(i) {
                continue;
            }
            let w = i64::from(node.weight);
            total += w;
            let v = cur[i] + w;
            if advance {
                cur[i] = v;
            }
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        let (b, _) = best?;
        if advance {
            cur[b] -= total;
        }
        Some(b)
    }

    /// The next node in round-robin order, ignoring health.
    pub fn pick(&self) -> Option<&Node> {
        self.pick_for(0, &[], true).map(|i| &self.nodes[i])
    }
}

/// The first entry of `seq` from `start` (wrapping) that is `eligible`.
fn scan(seq: &[u32], start: usize, eligible: impl Fn(usize) -> bool) -> Option<usize> {
    let len = seq.len();
    (0..len)
        .map(|k| seq[(start + k) % len] as usize)
        .find(|&i| eligible(i))
}

/// Why a request did not go to nodes of its own lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The service has no node of the request's lane; formal served it.
    LaneHasNoNodes,
    /// Every node of the request's gray lane is down; formal served it.
    LaneUnhealthy,
    /// Every candidate is down (formal too): the lane's own nodes are tried
    /// anyway ("panic mode") rather than refusing all traffic.
    AllUnhealthy,
}

impl Fallback {
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::LaneHasNoNodes => "lane_has_no_nodes",
            Fallback::LaneUnhealthy => "lane_unhealthy",
            Fallback::AllUnhealthy => "all_unhealthy",
        }
    }
}

/// Why no candidate set was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoCandidates {
    /// Neither the lane nor formal has nodes.
    NoNodes,
    /// The lane's nodes are all down and the service is `strict`.
    StrictUnhealthy,
}

/// The candidate set chosen for a request.
#[derive(Debug, Clone, Copy)]
pub struct Choice<'a> {
    pub set: &'a LaneNodes,
    pub fallback: Option<Fallback>,
    /// Panic mode: health is ignored because nothing is healthy.
    pub ignore_health: bool,
}

/// A named service: its nodes split by lane.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub lanes: BTreeMap<String, LaneNodes>,
    /// Every configured node, including weight-0 and draining ones.
    pub all: Vec<Node>,
    pub health: HealthConfig,
    /// All nodes of a gray lane down → 503 rather than formal.
    pub strict: bool,
    /// Per-service retry count (else `upstream.retries`).
    pub retries: Option<u32>,
    /// Per-service body read timeout (else `upstream.read_timeout_ms`).
    pub read_timeout_ms: Option<u64>,
    /// TLS and/or HTTP/2 to the nodes; `None` = plain HTTP/1.1.
    pub transport: Option<Arc<crate::upstream::tls::Transport>>,
}

impl Service {
    pub fn new(name: &str, nodes: Vec<Node>) -> Service {
        let mut by_lane: BTreeMap<String, Vec<Node>> = BTreeMap::new();
        let all = nodes.clone();
        for n in nodes.into_iter().filter(|n| n.weight > 0 && !n.drain) {
            by_lane.entry(n.lane.to_string()).or_default().push(n);
        }
        Service {
            name: name.to_string(),
            all,
            lanes: by_lane
                .into_iter()
                .map(|(lane, nodes)| (lane, LaneNodes::new(nodes)))
                .collect(),
            health: HealthConfig::default(),
            strict: false,
            retries: None,
            read_timeout_ms: None,
            transport: None,
        }
    }

    /// Replaces each node's health handle with `lookup(addr)`.
    pub fn attach_health(&mut self, mut lookup: impl FnMut(SocketAddr) -> Arc<NodeHealth>) {
        for set in self.lanes.values_mut() {
            set.health = set.nodes.iter().map(|n| lookup(n.addr)).collect();
        }
    }

    /// The health-aware candidate set for `lane` at `now`: the lane's nodes
    /// while any is up; when all are down, formal (or 503 if `strict`);
    /// never another gray lane. A lane without nodes uses formal.
    pub fn choose(&self, lane: &str, now: u64) -> Result<Choice<'_>, NoCandidates> {
        let formal = self.lanes.get(FORMAL).filter(|s| !s.nodes.is_empty());
        let Some(own) = self.lanes.get(lane).filter(|s| !s.nodes.is_empty()) else {
            let set = formal.ok_or(NoCandidates::NoNodes)?;
            return Ok(Choice {
                set,
                fallback: (lane != FORMAL).then_some(Fallback::LaneHasNoNodes),
                ignore_health: !set.any_available(now),
            });
        };
        if own.any_available(now) {
            return Ok(Choice {
                set: own,
                fallback: None,
                ignore_health: false,
            });
        }
        if lane != FORMAL {
            if self.strict {
                return Err(NoCandidates::StrictUnhealthy);
            }
            if let Some(f) = formal.filter(|f| f.any_available(now)) {
                return Ok(Choice {
                    set: f,
                    fallback: Some(Fallback::LaneUnhealthy),
                    ignore_health: false,
                });
            }
        }
        Ok(Choice {
            set: own,
            fallback: Some(Fallback::AllUnhealthy),
            ignore_health: true,
        })
    }

    /// The candidate set for `lane`: that lane's nodes, else formal's.
    /// Returns the set's lane and the fallback taken, if any.
    pub fn candidates(&self, lane: &str) -> Option<(&LaneNodes, Option<Fallback>)> {
        if let Some(set) = self.lanes.get(lane).filter(|s| !s.nodes.is_empty()) {
            return Some((set, None));
        }
        let formal = self.lanes.get(FORMAL).filter(|s| !s.nodes.is_empty())?;
        let fallback = (lane != FORMAL).then_some(Fallback::LaneHasNoNodes);
        Some((formal, fallback))
    }

    pub fn count(&self, lane: &str) -> usize {
        self.lanes.get(lane).map_or(0, |s| s.nodes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, lane: &str, weight: u32) -> Node {
        Node {
            name: name.into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            lane: lane.into(),
            weight,
            drain: false,
        }
    }

    #[test]
    fn precomputed_schedule_equals_live_smooth_wrr() {
        for weights in [
            vec![5, 1, 1],
            vec![3, 2],
            vec![1; 1000],
            vec![7, 3, 9, 1, 4],
        ] {
            let nodes: Vec<Node> = weights
                .iter()
                .enumerate()
                .map(|(i, &w)| node(&format!("n{i}"), FORMAL, w))
                .collect();
            let set = LaneNodes::new(nodes);
            assert!(set.schedule.is_some());
            let total: u32 = weights.iter().sum();
            for _ in 0..2 * total {
                let live = set.live_pick(|_| true, true).unwrap();
                assert_eq!(set.pick_for(0, &[], true), Some(live), "{weights:?}");
            }
        }
        // Too heavy to precompute: live smooth WRR still spreads by weight.
        let heavy = LaneNodes::new(vec![node("a", FORMAL, 100_000), node("b", FORMAL, 50_000)]);
        assert!(heavy.schedule.is_none());
        let a = (0..300)
            .filter(|_| heavy.pick().unwrap().name.as_ref() == "a")
            .count();
        assert_eq!(a, 200);
    }

    #[test]
    fn smooth_weighted_round_robin_matches_nginx() {
        // nginx's example: weights 5,1,1 give a a b a c a a.
        let s = Service::new(
            "s",
            vec![
                node("a", FORMAL, 5),
                node("b", FORMAL, 1),
                node("c", FORMAL, 1),
            ],
        );
        let (set, _) = s.candidates(FORMAL).unwrap();
        let seq: String = (0..7)
            .map(|_| set.pick().unwrap().name.to_string())
            .collect();
        assert_eq!(seq, "aabacaa");
    }

    #[test]
    fn lane_then_formal_never_other_gray() {
        let s = Service::new("s", vec![node("f", FORMAL, 1), node("g", "gray", 1)]);
        let (set, fb) = s.candidates("gray").unwrap();
        assert_eq!(set.pick().unwrap().name.as_ref(), "g");
        assert_eq!(fb, None);
        let (set, fb) = s.candidates("v2").unwrap();
        assert_eq!(set.pick().unwrap().name.as_ref(), "f");
        assert_eq!(fb, Some(Fallback::LaneHasNoNodes));
        let only_gray = Service::new("s", vec![node("g", "gray", 1)]);
        assert!(only_gray.candidates("v2").is_none());
        assert!(only_gray.candidates(FORMAL).is_none());
    }

    #[test]
    fn unhealthy_lane_goes_formal_never_other_gray() {
        use crate::config::PassiveHealth;
        let p = PassiveHealth {
            max_fails: 1,
            cooldown_ms: 60_000,
            fail_on_5xx: true,
        };
        let mut s = Service::new(
            "s",
            vec![
                node("f", FORMAL, 1),
                node("g1", "gray", 1),
                node("g2", "gray", 1),
                node("v", "v2", 1),
            ],
        );
        let now = crate::base::clock::now_ms();
        let gray = &s.lanes["gray"];
        gray.health[0].failure("g1", &p);
        // One gray node down: the other takes every pick.
        let c = s.choose("gray", now).unwrap();
        assert!(c.fallback.is_none());
        for _ in 0..4 {
            let i = c.set.pick_for(now, &[], c.ignore_health).unwrap();
            assert_eq!(c.set.nodes[i].name.as_ref(), "g2");
        }
        gray.health[1].failure("g2", &p);
        let c = s.choose("gray", now).unwrap();
        assert_eq!(c.fallback, Some(Fallback::LaneUnhealthy));
        assert_eq!(c.set.nodes[0].name.as_ref(), "f");
        s.strict = true;
        assert_eq!(
            s.choose("gray", now).unwrap_err(),
            NoCandidates::StrictUnhealthy
        );
        // Formal down too: panic mode inside the request's own lane.
        s.strict = false;
        s.lanes[FORMAL].health[0].failure("f", &p);
        let c = s.choose("gray", now).unwrap();
        assert_eq!(c.fallback, Some(Fallback::AllUnhealthy));
        assert!(c.ignore_health);
        assert_eq!(c.set.nodes[0].lane.as_ref(), "gray");
    }

    #[test]
    fn retries_skip_tried_nodes() {
        let s = Service::new(
            "s",
            vec![
                node("a", FORMAL, 1),
                node("b", FORMAL, 1),
                node("c", FORMAL, 1),
            ],
        );
        let set = &s.lanes[FORMAL];
        let now = crate::base::clock::now_ms();
        let mut tried = Vec::new();
        while let Some(i) = set.pick_for(now, &tried, false) {
            tried.push(i);
        }
        tried.sort();
        assert_eq!(tried, vec![0, 1, 2]);
    }

    #[test]
    fn peek_shows_the_next_pick_without_moving() {
        let s = Service::new("s", vec![node("a", FORMAL, 2), node("b", FORMAL, 1)]);
        let set = &s.lanes[FORMAL];
        let now = crate::base::clock::now_ms();
        for _ in 0..6 {
            let peeked = set.peek_for(now, false).unwrap();
            assert_eq!(set.peek_for(now, false), Some(peeked), "peek is stable");
            assert_eq!(set.pick_for(now, &[], false), Some(peeked));
        }
        // A node that is down is skipped by both.
        let p = crate::config::PassiveHealth {
            max_fails: 1,
            cooldown_ms: 60_000,
            fail_on_5xx: true,
        };
        set.health[0].failure("a", &p);
        assert_eq!(set.peek_for(now, false), Some(1));
        assert_eq!(set.pick_for(now, &[], false), Some(1));
    }

    #[test]
    fn draining_nodes_are_listed_but_never_chosen() {
        let mut d = node("d", FORMAL, 1);
        d.drain = true;
        let s = Service::new("s", vec![node("f", FORMAL, 1), d]);
        assert_eq!(s.count(FORMAL), 1);
        assert_eq!(s.all.len(), 2);
        let (set, _) = s.candidates(FORMAL).unwrap();
        assert!((0..4).all(|_| set.pick().unwrap().name.as_ref() == "f"));
    }

    #[test]
    fn zero_weight_nodes_are_skipped() {
        let s = Service::new("s", vec![node("f", FORMAL, 1), node("z", FORMAL, 0)]);
        assert_eq!(s.count(FORMAL), 1);
    }
}
