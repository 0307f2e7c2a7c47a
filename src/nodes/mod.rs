//! Layer: nodes — node choice (data plane, above upstream; uses upstream
//! for active probes, observe's node counters, lane's cookie parser, base,
//! config). API services and their nodes, grouped by lane, and the
//! selection rule: healthy nodes of the request's lane, else formal nodes
//! (never another gray lane); within that set the gateway's zone first
//! (`zone`), then the service's `balance` policy (`balance`: round-robin,
//! least-request, rendezvous hash, random, each policy's state in one
//! `Policy` variant; `hash`: the request key and the ranking), with slow
//! start for nodes that joined or were re-admitted.

pub mod balance;
pub mod hash;
pub mod health;
pub mod zone;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{HeaderMap, Uri};

use crate::config::grpc::GrpcErrorCodes;
use crate::config::{Balance, HealthConfig, NodeConfig, ServiceConfig, FORMAL};
use crate::observe::node_stats::NodeCounters;
use balance::{slow_start_factor, Members, Picker, Want};
use hash::{HashKey, KeyHash};
use health::NodeHealth;
use zone::{HealthyCount, ZoneStep};

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
    /// The node's zone, from its node file entry (or, later, a registry's
    /// metadata); `None` = in no zone.
    pub zone: Option<Arc<str>>,
}

impl Node {
    /// The node of entry `c` (the `idx`-th of `service`) at `addr`: the
    /// entry's own address, or one its host name resolved to (the node is
    /// then named `<name>@<ip>`).
    pub fn from_config(service: &str, idx: usize, c: &NodeConfig, addr: SocketAddr) -> Node {
        let name = c
            .name
            .clone()
            .unwrap_or_else(|| format!("{service}-{}-{idx}", c.lane));
        let name = match c.addr.ip() {
            Some(_) => name,
            None => format!("{name}@{}", addr.ip()),
        };
        Node {
            name: name.into(),
            addr,
            lane: c.lane.as_str().into(),
            weight: c.weight,
            drain: c.drain,
            zone: c.zone.as_deref().map(Into::into),
        }
    }
}

/// How a service picks nodes (its node-file keys, resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Select {
    pub balance: Balance,
    /// The request key of `balance: hash`.
    pub hash_key: Option<HashKey>,
    /// Slow-start window; 0 = off.
    pub slow_start_ms: u64,
    /// The gateway's zone (`None`: no zone preference).
    pub zone: Option<Arc<str>>,
    /// Healthy same-zone nodes needed to stay in the zone; 0 = off.
    pub zone_min_healthy: u32,
}

impl Default for Select {
    /// A node file's defaults, without a gateway zone.
    fn default() -> Select {
        let c = ServiceConfig::default();
        Select {
            balance: c.balance,
            hash_key: None,
            slow_start_ms: c.slow_start_ms,
            zone: None,
            zone_min_healthy: c.zone_min_healthy,
        }
    }
}

/// The nodes of one lane of a service with their selection state.
///
/// The policy's state (round-robin schedule, alias table or rendezvous set)
/// is computed once per generation, over all the lane's nodes and over
/// those in the gateway's zone; a pick reads it lock-free, O(1) in the
/// usual case however many nodes the lane has (`hash`: one pass over them).
#[derive(Debug)]
pub struct LaneNodes {
    pub nodes: Vec<Node>,
    /// Health of `nodes[i]`, shared with the registry across reloads.
    pub health: Vec<Arc<NodeHealth>>,
    /// Live counters of `nodes[i]` (in flight: least_request), shared with
    /// `observe::node_stats` across reloads.
    pub counters: Vec<Arc<NodeCounters>>,
    pub slow_start_ms: u64,
    pub zone_min_healthy: u32,
    /// Is zone preference on (the gateway has a zone, min_healthy > 0)?
    zone_pref: bool,
    all: Picker,
    /// Over the nodes in the gateway's zone, when there are any.
    local: Option<Picker>,
    local_healthy: HealthyCount,
}

impl Members for LaneNodes {
    fn weight(&self, i: usize) -> u32 {
        self.nodes[i].weight
    }

    fn eligible(&self, i: usize, w: &Want) -> bool {
        !w.tried.contains(&i) && (w.ignore_health || self.health[i].available(w.now))
    }

    fn factor(&self, i: usize, now: u64) -> f64 {
        slow_start_factor(self.health[i].warm_since(), now, self.slow_start_ms)
    }

    fn in_flight(&self, i: usize) -> i64 {
        self.counters[i].in_flight.load(Ordering::Relaxed)
    }

    fn slow_start(&self) -> bool {
        self.slow_start_ms != 0
    }
}

impl LaneNodes {
    fn new(nodes: Vec<Node>, sel: &Select) -> LaneNodes {
        let n = nodes.len();
        let all = Picker::new(&nodes, (0..n as u32).collect(), sel.balance);
        let zone_pref = sel.zone.is_some() && sel.zone_min_healthy > 0;
        let local = sel.zone.as_ref().filter(|_| zone_pref).and_then(|z| {
            let members: Vec<u32> = (0..n as u32)
                .filter(|&i| nodes[i as usize].zone.as_ref() == Some(z))
                .collect();
            (!members.is_empty()).then(|| Picker::new(&nodes, members, sel.balance))
        });
        LaneNodes {
            health: (0..n).map(|_| Arc::new(NodeHealth::default())).collect(),
            counters: (0..n).map(|_| Arc::default()).collect(),
            slow_start_ms: sel.slow_start_ms,
            zone_min_healthy: sel.zone_min_healthy,
            zone_pref,
            all,
            local,
            local_healthy: HealthyCount::default(),
            nodes,
        }
    }

    /// Does any node pass its health checks at `now`?
    pub fn any_available(&self, now: u64) -> bool {
        self.health.iter().any(|h| h.available(now))
    }

    /// Lane-node indices of the nodes in the gateway's zone.
    pub fn local_members(&self) -> &[u32] {
        self.local.as_ref().map_or(&[], |l| &l.members)
    }

    /// Healthy same-zone nodes at `now` (recounted at most once a ms).
    pub fn local_healthy(&self, now: u64) -> u32 {
        let Some(local) = &self.local else {
            return 0;
        };
        self.local_healthy.get(now, || {
            local
                .members
                .iter()
                .filter(|&&i| self.health[i as usize].available(now))
                .count()
        })
    }

    /// The zone step for a request at `now`.
    pub fn zone_step(&self, now: u64, ignore_health: bool) -> ZoneStep {
        if !self.zone_pref {
            ZoneStep::Off
        } else if self.local.is_none() {
            ZoneStep::NoLocalNodes
        } else if ignore_health {
            ZoneStep::Panic
        } else if self.local_healthy(now) >= self.zone_min_healthy {
            ZoneStep::Local
        } else {
            ZoneStep::Spill
        }
    }

    /// The node the policy picks for `w` after zone step `step`: a
    /// same-zone node when the step is `local` (others once every
    /// same-zone node is down or tried), else any node of the set.
    pub fn pick_in(&self, step: ZoneStep, w: &Want) -> Option<usize> {
        if step == ZoneStep::Local {
            if let Some(i) = self.local.as_ref().and_then(|l| l.pick(self, w)) {
                return Some(i);
            }
        }
        self.all.pick(self, w)
    }

    /// A pick over the whole set without a key (round-robin order for
    /// `round_robin` and `hash`) of the nodes not in `tried` and (unless
    /// `ignore_health`) available at `now`. Returns the node's index.
    pub fn pick_for(&self, now: u64, tried: &[usize], ignore_health: bool) -> Option<usize> {
        let w = Want {
            now,
            tried,
            ignore_health,
            key: None,
            advance: true,
        };
        self.pick_in(ZoneStep::Off, &w)
    }

    /// The index [`pick_for`](Self::pick_for) would return next (with
    /// nothing tried yet), without moving the round-robin state — for dry
    /// runs such as `/explain`.
    pub fn peek_for(&self, now: u64, ignore_health: bool) -> Option<usize> {
        let w = Want {
            now,
            tried: &[],
            ignore_health,
            key: None,
            advance: false,
        };
        self.pick_in(ZoneStep::Off, &w)
    }

    /// The next node in round-robin order, ignoring health.
    pub fn pick(&self) -> Option<&Node> {
        self.pick_for(0, &[], true).map(|i| &self.nodes[i])
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
    /// The zone step inside the set.
    pub zone: ZoneStep,
}

impl<'a> Choice<'a> {
    fn new(set: &'a LaneNodes, fallback: Option<Fallback>, ignore: bool, now: u64) -> Choice<'a> {
        Choice {
            set,
            fallback,
            ignore_health: ignore,
            zone: set.zone_step(now, ignore),
        }
    }

    /// The node for the next attempt of a request with hash key `key`
    /// (`Service::request_key`): the policy's pick among the set's nodes not
    /// in `tried` (same zone first when the step says so).
    pub fn pick(&self, now: u64, tried: &[usize], key: Option<KeyHash>) -> Option<usize> {
        self.pick_with(now, tried, key, true)
    }

    /// What [`pick`](Self::pick) would return for a first attempt, without
    /// moving the round-robin state (random policies draw afresh).
    pub fn peek(&self, now: u64, key: Option<KeyHash>) -> Option<usize> {
        self.pick_with(now, &[], key, false)
    }

    fn pick_with(
        &self,
        now: u64,
        tried: &[usize],
        key: Option<KeyHash>,
        advance: bool,
    ) -> Option<usize> {
        let w = Want {
            now,
            tried,
            ignore_health: self.ignore_health,
            key,
            advance,
        };
        self.set.pick_in(self.zone, &w)
    }
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
    /// Balance policy, hash key, slow start and zone preference.
    pub select: Select,
    /// The nodes' gRPC statuses that count as errors.
    pub grpc_error_codes: GrpcErrorCodes,
}

impl Service {
    pub fn new(name: &str, nodes: Vec<Node>) -> Service {
        Service::with_select(name, nodes, Select::default())
    }

    /// A service whose lanes pick nodes as `select` says.
    pub fn with_select(name: &str, nodes: Vec<Node>, select: Select) -> Service {
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
                .map(|(lane, nodes)| (lane, LaneNodes::new(nodes, &select)))
                .collect(),
            health: HealthConfig::default(),
            strict: false,
            retries: None,
            read_timeout_ms: None,
            transport: None,
            select,
            grpc_error_codes: GrpcErrorCodes::default(),
        }
    }

    /// The request's hash key when the service balances by `hash` (and the
    /// request carries the key).
    pub fn request_key(
        &self,
        headers: &HeaderMap,
        uri: &Uri,
        client_ip: IpAddr,
    ) -> Option<KeyHash> {
        if self.select.balance != Balance::Hash {
            return None;
        }
        self.select.hash_key.as_ref()?.hash(headers, uri, client_ip)
    }

    /// Replaces each node's counters with `lookup(addr)` (the ones the
    /// request path counts in flight into).
    pub fn attach_counters(&mut self, mut lookup: impl FnMut(SocketAddr) -> Arc<NodeCounters>) {
        for set in self.lanes.values_mut() {
            set.counters = set.nodes.iter().map(|n| lookup(n.addr)).collect();
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
            let fallback = (lane != FORMAL).then_some(Fallback::LaneHasNoNodes);
            return Ok(Choice::new(set, fallback, !set.any_available(now), now));
        };
        if own.any_available(now) {
            return Ok(Choice::new(own, None, false, now));
        }
        if lane != FORMAL {
            if self.strict {
                return Err(NoCandidates::StrictUnhealthy);
            }
            if let Some(f) = formal.filter(|f| f.any_available(now)) {
                return Ok(Choice::new(f, Some(Fallback::LaneUnhealthy), false, now));
            }
        }
        Ok(Choice::new(own, Some(Fallback::AllUnhealthy), true, now))
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
            zone: None,
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
        let seq: String = (0..7)
            .map(|_| set.pick().unwrap().name.to_string())
            .collect();
        assert_eq!(seq, "aabacaa");
    }

    /// What a request of `lane` can reach through `choose` (the request
    /// path's choice) and every retry after it: the nodes' names, the
    /// fallback, panic mode.
    fn reachable(
        s: &Service,
        lane: &str,
        now: u64,
    ) -> Result<(std::collections::BTreeSet<String>, Option<Fallback>, bool), NoCandidates> {
        let c = s.choose(lane, now)?;
        let mut tried = Vec::new();
        while let Some(i) = c.pick(now, &tried, None) {
            tried.push(i);
        }
        let names = tried.iter().map(|&i| c.set.nodes[i].name.to_string());
        Ok((names.collect(), c.fallback, c.ignore_health))
    }

    #[test]
    fn lane_then_formal_never_other_gray() {
        let now = crate::base::clock::now_ms();
        let s = Service::new(
            "s",
            vec![
                node("f", FORMAL, 1),
                node("g1", "gray", 1),
                node("g2", "gray", 1),
            ],
        );
        let (set, fb) = s.candidates("gray").unwrap();
        assert_eq!((set.nodes[0].name.as_ref(), fb), ("g1", None));
        let (set, fb) = s.candidates("v2").unwrap();
        assert_eq!(set.nodes[0].name.as_ref(), "f");
        assert_eq!(fb, Some(Fallback::LaneHasNoNodes));
        let lane = |l| reachable(&s, l, now).unwrap();
        assert_eq!(lane("gray"), (set_of(&["g1", "g2"]), None, false));
        assert_eq!(lane(FORMAL), (set_of(&["f"]), None, false));
        // A lane without nodes: formal, never the gray lane that has some.
        let no_nodes = Some(Fallback::LaneHasNoNodes);
        assert_eq!(lane("v2"), (set_of(&["f"]), no_nodes, false));
        // ... and formal's nodes in panic mode when they are all down.
        s.lanes[FORMAL].health[0].failure("f", &eject_on_first_failure());
        assert_eq!(lane("v2"), (set_of(&["f"]), no_nodes, true));
        // No formal node: nothing, never another lane's nodes.
        let only_gray = Service::new("s", vec![node("g", "gray", 1)]);
        for l in ["v2", FORMAL] {
            assert_eq!(
                reachable(&only_gray, l, now),
                Err(NoCandidates::NoNodes),
                "{l}"
            );
            assert!(only_gray.candidates(l).is_none(), "{l}");
        }
        assert_eq!(
            reachable(&only_gray, "gray", now),
            Ok((set_of(&["g"]), None, false))
        );
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

    fn zoned(name: &str, zone: Option<&str>) -> Node {
        Node {
            zone: zone.map(Into::into),
            ..node(name, FORMAL, 1)
        }
    }

    fn zone_service(min_healthy: u32, zone: Option<&str>, balance: Balance) -> Service {
        let mut nodes = vec![
            zoned("a1", Some("a")),
            zoned("a2", Some("a")),
            zoned("b1", Some("b")),
            zoned("none", None),
        ];
        for (i, n) in nodes.iter_mut().enumerate() {
            n.addr = format!("127.0.0.{}:80", i + 1).parse().unwrap();
        }
        let select = Select {
            balance,
            hash_key: Some(HashKey::ClientIp),
            zone: zone.map(Into::into),
            zone_min_healthy: min_healthy,
            ..Select::default()
        };
        Service::with_select("s", nodes, select)
    }

    fn names(c: &Choice, now: u64, n: usize) -> std::collections::BTreeSet<String> {
        (0..n)
            .map(|_| {
                c.set.nodes[c.pick(now, &[], None).unwrap()]
                    .name
                    .to_string()
            })
            .collect()
    }

    const ALL_BALANCES: [Balance; 4] = [
        Balance::RoundRobin,
        Balance::LeastRequest,
        Balance::Random,
        Balance::Hash,
    ];

    /// Passive health that ejects a node at its first failure.
    fn eject_on_first_failure() -> crate::config::PassiveHealth {
        crate::config::PassiveHealth {
            max_fails: 1,
            cooldown_ms: 60_000,
            fail_on_5xx: true,
        }
    }

    fn set_of(names: &[&str]) -> std::collections::BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn same_zone_first_then_every_zone_below_min_healthy() {
        let p = eject_on_first_failure();
        for balance in ALL_BALANCES {
            fastrand::seed(9);
            let s = zone_service(2, Some("a"), balance);
            let now = crate::base::clock::now_ms();
            let c = s.choose(FORMAL, now).unwrap();
            assert_eq!(c.zone, ZoneStep::Local, "{balance:?}");
            assert_eq!(names(&c, now, 50), set_of(&["a1", "a2"]), "{balance:?}");
            // Retries leave the zone only once its nodes are all tried.
            let tried: Vec<usize> = vec![0, 1];
            let next = c.pick(now, &tried, None).unwrap();
            assert!(next >= 2, "{balance:?}");
            // One of two same-zone nodes down: below min_healthy 2, so every
            // zone (the healthy same-zone node, the other zone and the node
            // without a zone).
            s.lanes[FORMAL].health[0].failure("a1", &p);
            let later = now + 1;
            let c = s.choose(FORMAL, later).unwrap();
            assert_eq!(c.zone, ZoneStep::Spill, "{balance:?}");
            // (Keyless hash requests are round-robin.)
            let want = set_of(&["a2", "b1", "none"]);
            assert_eq!(names(&c, later, 200), want, "{balance:?}");
        }
    }

    #[test]
    fn zone_spill_spreads_a_down_nodes_share_by_weight() {
        // Two zones of two; the gateway in `a`, min_healthy 2; a1 down:
        // spill over a2, b1 and b2, a third each (nginx spreads a down
        // peer's share over the rest by weight).
        let mut nodes: Vec<Node> = ["a1", "a2", "b1", "b2"]
            .iter()
            .map(|n| zoned(n, Some(&n[..1])))
            .collect();
        for (i, n) in nodes.iter_mut().enumerate() {
            n.addr = format!("127.0.0.{}:80", i + 1).parse().unwrap();
        }
        let select = Select {
            zone: Some("a".into()),
            zone_min_healthy: 2,
            ..Select::default()
        };
        let s = Service::with_select("s", nodes, select);
        s.lanes[FORMAL].health[0].failure("a1", &eject_on_first_failure());
        let now = crate::base::clock::now_ms() + 1;
        let c = s.choose(FORMAL, now).unwrap();
        assert_eq!(c.zone, ZoneStep::Spill);
        let mut count = [0u64; 4];
        let n = 3_000;
        for _ in 0..n {
            count[c.pick(now, &[], None).unwrap()] += 1;
        }
        assert_eq!(count[0], 0, "{count:?}");
        let e = n as f64 / 3.0;
        let chi: f64 = count[1..].iter().map(|&o| (o as f64 - e).powi(2) / e).sum();
        // 2 degrees of freedom, p = 0.001.
        assert!(chi < 13.82, "χ² = {chi}, {count:?}");
    }

    #[test]
    fn zone_steps_never_empty_the_set() {
        let now = crate::base::clock::now_ms();
        // The gateway has no zone: every node.
        let s = zone_service(1, None, Balance::RoundRobin);
        let c = s.choose(FORMAL, now).unwrap();
        assert_eq!(c.zone, ZoneStep::Off);
        assert_eq!(names(&c, now, 8), set_of(&["a1", "a2", "b1", "none"]));
        // min_healthy 0 turns the preference off.
        let s = zone_service(0, Some("a"), Balance::RoundRobin);
        assert_eq!(s.choose(FORMAL, now).unwrap().zone, ZoneStep::Off);
        // No candidate in the gateway's zone: every zone, zone-less nodes
        // included.
        let s = zone_service(1, Some("c"), Balance::RoundRobin);
        let c = s.choose(FORMAL, now).unwrap();
        assert_eq!(c.zone, ZoneStep::NoLocalNodes);
        assert_eq!(names(&c, now, 8), set_of(&["a1", "a2", "b1", "none"]));
        // Everything down: panic mode spans every zone.
        let p = crate::config::PassiveHealth {
            max_fails: 1,
            cooldown_ms: 60_000,
            fail_on_5xx: true,
        };
        let s = zone_service(1, Some("a"), Balance::RoundRobin);
        for (i, h) in s.lanes[FORMAL].health.iter().enumerate() {
            h.failure(&i.to_string(), &p);
        }
        let c = s.choose(FORMAL, now).unwrap();
        assert_eq!(c.zone, ZoneStep::Panic);
        assert_eq!(names(&c, now, 8), set_of(&["a1", "a2", "b1", "none"]));
    }

    #[test]
    fn slow_start_ramps_a_joined_node_with_an_injected_clock() {
        // Deterministic: a fixed seed and clock values passed in.
        fastrand::seed(21);
        for balance in [Balance::RoundRobin, Balance::Random, Balance::LeastRequest] {
            let select = Select {
                balance,
                slow_start_ms: 10_000,
                ..Select::default()
            };
            let mut a = node("old", FORMAL, 1);
            a.addr = "127.0.0.1:1".parse().unwrap();
            let mut b = node("new", FORMAL, 1);
            b.addr = "127.0.0.1:2".parse().unwrap();
            let mut s = Service::with_select("s", vec![a, b], select);
            let joined_at = 1_000;
            s.attach_health(|addr| {
                Arc::new(if addr.port() == 2 {
                    NodeHealth::joined(joined_at)
                } else {
                    NodeHealth::default()
                })
            });
            let share = |now: u64| {
                let c = s.choose(FORMAL, now).unwrap();
                let n = 20_000;
                let new = (0..n).filter(|_| c.pick(now, &[], None) == Some(1)).count();
                new as f64 / n as f64
            };
            // Effective weights old 1 : new f → share f / (1 + f).
            for (now, f) in [(1_000, 0.1), (3_500, 0.25), (6_000, 0.5), (8_500, 0.75)] {
                let got = share(now);
                let want = f / (1.0 + f);
                assert!(
                    (got - want).abs() < 0.02,
                    "{balance:?} at {now}: {got} vs {want}"
                );
            }
            // The window has passed: full weight.
            let got = share(11_000);
            assert!((got - 0.5).abs() < 0.02, "{balance:?}: {got}");
            if balance == Balance::RoundRobin {
                assert_eq!(got, 0.5, "warm round-robin is exact");
            }
        }
    }

    #[test]
    fn hash_pins_keys_and_retries_walk_to_the_next_node() {
        let nodes: Vec<Node> = (0..5)
            .map(|i| {
                let mut n = node(&format!("n{i}"), FORMAL, 1);
                n.addr = format!("127.0.0.{}:80", i + 1).parse().unwrap();
                n
            })
            .collect();
        let select = Select {
            balance: Balance::Hash,
            hash_key: Some("header:x-user-id".parse().unwrap()),
            ..Select::default()
        };
        let s = Service::with_select("s", nodes, select);
        let now = crate::base::clock::now_ms();
        let req = |uid: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-user-id", uid.parse().unwrap());
            h
        };
        let uri = Uri::from_static("/");
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let key = s.request_key(&req("u-7"), &uri, ip);
        assert!(key.is_some());
        let c = s.choose(FORMAL, now).unwrap();
        let first = c.pick(now, &[], key).unwrap();
        assert!(
            (0..20).all(|_| c.pick(now, &[], key) == Some(first)),
            "pinned"
        );
        assert_eq!(c.peek(now, key), Some(first));
        // A retry walks on, deterministically, never to a tried node.
        let second = c.pick(now, &[first], key).unwrap();
        assert_ne!(second, first);
        assert_eq!(c.pick(now, &[first], key), Some(second));
        // No key: round-robin over the lane.
        let c = s.choose(FORMAL, now).unwrap();
        let none = s.request_key(&req(""), &uri, ip);
        assert!(none.is_none());
        let spread: std::collections::BTreeSet<usize> =
            (0..5).map(|_| c.pick(now, &[], none).unwrap()).collect();
        assert_eq!(spread.len(), 5);
        // Other policies never hash.
        assert_eq!(
            Service::new("t", vec![]).request_key(&req("u-7"), &uri, ip),
            None
        );
    }

    #[test]
    fn every_policy_keeps_the_lane_guarantee() {
        let p = eject_on_first_failure();
        for balance in ALL_BALANCES {
            let nodes: Vec<Node> = [
                ("f1", FORMAL),
                ("f2", FORMAL),
                ("g1", "gray"),
                ("g2", "gray"),
                ("v", "v2"),
            ]
            .iter()
            .enumerate()
            .map(|(i, (n, l))| Node {
                addr: format!("127.0.0.{}:80", i + 1).parse().unwrap(),
                zone: Some(if i % 2 == 0 { "a" } else { "b" }.into()),
                ..node(n, l, 1)
            })
            .collect();
            let select = Select {
                balance,
                hash_key: Some(HashKey::ClientIp),
                zone: Some("a".into()),
                slow_start_ms: 5_000,
                ..Select::default()
            };
            let s = Service::with_select("s", nodes, select);
            let now = crate::base::clock::now_ms();
            let key = Some(KeyHash::of(b"k"));
            let lanes_of = |lane: &str, now: u64| {
                let c = s.choose(lane, now).unwrap();
                let mut tried = Vec::new();
                while let Some(i) = c.pick(now, &tried, key) {
                    assert!(!tried.contains(&i));
                    tried.push(i);
                }
                tried
                    .iter()
                    .map(|&i| c.set.nodes[i].lane.to_string())
                    .collect::<std::collections::BTreeSet<_>>()
            };
            assert_eq!(lanes_of("gray", now), set_of(&["gray"]), "{balance:?}");
            assert_eq!(lanes_of("gray-b", now), set_of(&[FORMAL]), "{balance:?}");
            // Gray down: formal, never v2.
            for h in &s.lanes["gray"].health {
                h.failure("g", &p);
            }
            assert_eq!(lanes_of("gray", now + 1), set_of(&[FORMAL]), "{balance:?}");
        }
    }
}
