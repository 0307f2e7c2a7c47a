//! API services and their nodes, grouped by lane, and the selection rule:
//! nodes of the request's lane, else formal nodes (never another gray lane),
//! picked by smooth weighted round-robin (nginx's algorithm).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::config::{NodeConfig, FORMAL};

/// One upstream node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub addr: SocketAddr,
    pub lane: String,
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
                .unwrap_or_else(|| format!("{service}-{}-{idx}", c.lane)),
            addr: c.addr,
            lane: c.lane.clone(),
            weight: c.weight,
            drain: c.drain,
        }
    }
}

/// The nodes of one lane of a service with their round-robin state.
#[derive(Debug)]
pub struct LaneNodes {
    pub nodes: Vec<Node>,
    current: Mutex<Vec<i64>>,
}

impl LaneNodes {
    fn new(nodes: Vec<Node>) -> LaneNodes {
        let n = nodes.len();
        LaneNodes {
            nodes,
            current: Mutex::new(vec![0; n]),
        }
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

    /// The node [`pick`](Self::pick) would choose next, without moving the
    /// round-robin state (for dry runs such as `/explain`).
    pub fn peek(&self) -> Option<&Node> {
        match self.nodes.len() {
            0 => None,
            1 => Some(&self.nodes[0]),
            _ => {
                let cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
                let mut best = 0usize;
                let mut best_val = i64::MIN;
                for (i, node) in self.nodes.iter().enumerate() {
                    let v = cur[i] + i64::from(node.weight);
                    if v > best_val {
                        best = i;
                        best_val = v;
                    }
                }
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
}

impl Fallback {
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::LaneHasNoNodes => "lane_has_no_nodes",
        }
    }
}

/// A named service: its nodes split by lane.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub lanes: BTreeMap<String, LaneNodes>,
    /// Every configured node, including weight-0 and draining ones.
    pub all: Vec<Node>,
}

impl Service {
    pub fn new(name: &str, nodes: Vec<Node>) -> Service {
        let mut by_lane: BTreeMap<String, Vec<Node>> = BTreeMap::new();
        let all = nodes.clone();
        for n in nodes.into_iter().filter(|n| n.weight > 0 && !n.drain) {
            by_lane.entry(n.lane.clone()).or_default().push(n);
        }
        Service {
            name: name.to_string(),
            all,
            lanes: by_lane
                .into_iter()
                .map(|(lane, nodes)| (lane, LaneNodes::new(nodes)))
                .collect(),
        }
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

/// Live counters of one node. They live outside the [`Generation`]
/// (keyed by service and address) so they survive reloads.
///
/// [`Generation`]: crate::generation::Generation
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub in_flight: AtomicI64,
    pub requests: AtomicU64,
    pub errors: AtomicU64,
}

impl NodeCounters {
    pub fn snapshot(&self) -> (i64, u64, u64) {
        (
            self.in_flight.load(Ordering::Relaxed),
            self.requests.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
        )
    }
}

/// The counters of the services sharing one address.
type ByService = Vec<(String, Arc<NodeCounters>)>;

/// Every node's counters, by address then service.
#[derive(Debug, Default)]
pub struct NodeStats(RwLock<HashMap<SocketAddr, ByService>>);

impl NodeStats {
    /// The counters of (`service`, `addr`), created on first use.
    pub fn get(&self, service: &str, addr: SocketAddr) -> Arc<NodeCounters> {
        if let Some(c) = self.find(service, addr) {
            return c;
        }
        let mut m = self.0.write().unwrap_or_else(|e| e.into_inner());
        let list = m.entry(addr).or_default();
        if let Some((_, c)) = list.iter().find(|(s, _)| s == service) {
            return c.clone();
        }
        let c = Arc::new(NodeCounters::default());
        list.push((service.to_string(), c.clone()));
        c
    }

    /// The counters of (`service`, `addr`) if it ever served a request.
    pub fn find(&self, service: &str, addr: SocketAddr) -> Option<Arc<NodeCounters>> {
        let m = self.0.read().unwrap_or_else(|e| e.into_inner());
        m.get(&addr)?
            .iter()
            .find(|(s, _)| s == service)
            .map(|(_, c)| c.clone())
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
    fn peek_shows_the_next_pick_without_moving() {
        let s = Service::new("s", vec![node("a", FORMAL, 2), node("b", FORMAL, 1)]);
        let (set, _) = s.candidates(FORMAL).unwrap();
        for _ in 0..6 {
            let peeked = set.peek().unwrap().name.clone();
            assert_eq!(set.peek().unwrap().name, peeked, "peek is stable");
            assert_eq!(set.pick().unwrap().name, peeked);
        }
    }

    #[test]
    fn draining_nodes_are_listed_but_never_chosen() {
        let mut d = node("d", FORMAL, 1);
        d.drain = true;
        let s = Service::new("s", vec![node("f", FORMAL, 1), d]);
        assert_eq!(s.count(FORMAL), 1);
        assert_eq!(s.all.len(), 2);
        let (set, _) = s.candidates(FORMAL).unwrap();
        assert!((0..4).all(|_| set.pick().unwrap().name == "f"));
    }

    #[test]
    fn node_stats_survive_by_service_and_addr() {
        let stats = NodeStats::default();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        stats.get("s", a).requests.fetch_add(1, Ordering::Relaxed);
        assert_eq!(stats.get("s", a).snapshot().1, 1);
        assert_eq!(stats.get("t", a).snapshot().1, 0);
        assert!(stats.find("u", a).is_none());
    }

    #[test]
    fn zero_weight_nodes_are_skipped() {
        let s = Service::new("s", vec![node("f", FORMAL, 1), node("z", FORMAL, 0)]);
        assert_eq!(s.count(FORMAL), 1);
    }
}
