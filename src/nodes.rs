//! API services and their nodes, grouped by lane, and the selection rule:
//! healthy nodes of the request's lane, else formal nodes (never another
//! gray lane), picked by smooth weighted round-robin (nginx's algorithm).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::config::{HealthConfig, NodeConfig, FORMAL};
use crate::health::NodeHealth;

/// One upstream node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub addr: SocketAddr,
    pub lane: String,
    pub weight: u32,
}

impl Node {
    pub fn from_config(service: &str, idx: usize, c: &NodeConfig) -> Node {
        Node {
            name: c
                .name
                .clone()
                .unwrap_or_else(|| format!("{service}-{}-{idx}", c.lane)),
            addr: c.addr,
            lane: c.lane.clone(),
            weight: c.weight,
        }
    }
}

/// The nodes of one lane of a service with their round-robin state.
#[derive(Debug)]
pub struct LaneNodes {
    pub nodes: Vec<Node>,
    /// Health of `nodes[i]`, shared with the registry across reloads.
    pub health: Vec<Arc<NodeHealth>>,
    current: Mutex<Vec<i64>>,
}

impl LaneNodes {
    fn new(nodes: Vec<Node>) -> LaneNodes {
        let n = nodes.len();
        LaneNodes {
            health: (0..n).map(|_| Arc::new(NodeHealth::default())).collect(),
            nodes,
            current: Mutex::new(vec![0; n]),
        }
    }

    /// Does any node pass its health checks at `now`?
    pub fn any_available(&self, now: u64) -> bool {
        self.health.iter().any(|h| h.available(now))
    }

    /// Smooth weighted round-robin over the nodes not in `tried` and (unless
    /// `ignore_health`) available at `now`. Returns the node's index.
    pub fn pick_for(&self, now: u64, tried: &[usize], ignore_health: bool) -> Option<usize> {
        let eligible =
            |i: usize| !tried.contains(&i) && (ignore_health || self.health[i].available(now));
        if self.nodes.len() == 1 {
            return eligible(0).then_some(0);
        }
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0i64;
        let mut best: Option<usize> = None;
        for (i, node) in self.nodes.iter().enumerate() {
            if !eligible(i) {
                continue;
            }
            let w = i64::from(node.weight);
            cur[i] += w;
            total += w;
            if best.is_none_or(|b| cur[i] > cur[b]) {
                best = Some(i);
            }
        }
        let b = best?;
        cur[b] -= total;
        Some(b)
    }

    /// Smooth weighted round-robin: every node gains its weight, the largest
    /// current wins and pays back the total. Spreads picks evenly in time.
    pub fn pick(&self) -> Option<&Node> {
        match self.nodes.len() {
            0 => None,
            1 => Some(&self.nodes[0]),
            _ => {
                let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
                let mut total = 0i64;
                let mut best = 0usize;
                for (i, node) in self.nodes.iter().enumerate() {
                    let w = i64::from(node.weight);
                    cur[i] += w;
                    total += w;
                    if cur[i] > cur[best] {
                        best = i;
                    }
                }
                cur[best] -= total;
                Some(&self.nodes[best])
            }
        }
    }
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
    pub health: HealthConfig,
    /// All nodes of a gray lane down → 503 rather than formal.
    pub strict: bool,
    /// Per-service retry count (else `upstream.retries`).
    pub retries: Option<u32>,
}

impl Service {
    pub fn new(name: &str, nodes: Vec<Node>) -> Service {
        let mut by_lane: BTreeMap<String, Vec<Node>> = BTreeMap::new();
        for n in nodes.into_iter().filter(|n| n.weight > 0) {
            by_lane.entry(n.lane.clone()).or_default().push(n);
        }
        Service {
            name: name.to_string(),
            lanes: by_lane
                .into_iter()
                .map(|(lane, nodes)| (lane, LaneNodes::new(nodes)))
                .collect(),
            health: HealthConfig::default(),
            strict: false,
            retries: None,
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
        }
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
        let seq: String = (0..7).map(|_| set.pick().unwrap().name.clone()).collect();
        assert_eq!(seq, "aabacaa");
    }

    #[test]
    fn lane_then_formal_never_other_gray() {
        let s = Service::new("s", vec![node("f", FORMAL, 1), node("g", "gray", 1)]);
        let (set, fb) = s.candidates("gray").unwrap();
        assert_eq!(set.pick().unwrap().name, "g");
        assert_eq!(fb, None);
        let (set, fb) = s.candidates("v2").unwrap();
        assert_eq!(set.pick().unwrap().name, "f");
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
        let now = crate::health::now_ms();
        let gray = &s.lanes["gray"];
        gray.health[0].failure("g1", &p);
        // One gray node down: the other takes every pick.
        let c = s.choose("gray", now).unwrap();
        assert!(c.fallback.is_none());
        for _ in 0..4 {
            let i = c.set.pick_for(now, &[], c.ignore_health).unwrap();
            assert_eq!(c.set.nodes[i].name, "g2");
        }
        gray.health[1].failure("g2", &p);
        let c = s.choose("gray", now).unwrap();
        assert_eq!(c.fallback, Some(Fallback::LaneUnhealthy));
        assert_eq!(c.set.nodes[0].name, "f");
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
        assert_eq!(c.set.nodes[0].lane, "gray");
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
        let now = crate::health::now_ms();
        let mut tried = Vec::new();
        while let Some(i) = set.pick_for(now, &tried, false) {
            tried.push(i);
        }
        tried.sort();
        assert_eq!(tried, vec![0, 1, 2]);
    }

    #[test]
    fn zero_weight_nodes_are_skipped() {
        let s = Service::new("s", vec![node("f", FORMAL, 1), node("z", FORMAL, 0)]);
        assert_eq!(s.count(FORMAL), 1);
    }
}
