//! Layer: nodes. How one node is picked among the candidates of a lane (the
//! set `Service::choose` returned — the request's lane or formal, never
//! another gray lane), per service `balance:`:
//!
//! - `round_robin` (default): smooth weighted round-robin (nginx's), one
//!   period precomputed per generation; a pick is an atomic increment.
//! - `random`: weighted random from a Walker/Vose alias table (O(1)).
//! - `least_request`: power of two choices — two weighted draws, the one
//!   with fewer requests in flight per unit of weight wins, a tie goes to the
//!   first draw (so an idle lane is weighted random).
//! - `hash`: weighted rendezvous hashing on a request key (`nodes::hash`;
//!   a pass over the members); a request without the key is picked by
//!   `round_robin`.
//!
//! Every policy skips nodes that are down (unless the choice is in panic
//! mode) and nodes already tried by this request, spreading their share
//! over the eligible nodes by weight, and applies slow start: a
//! warming node's weight is scaled by [`slow_start_factor`]. Every pick but
//! `hash`'s is O(1) in the usual case however many nodes the lane has; only when most
//! draws (or, for `round_robin`, the schedule's entry) land on nodes that
//! are down or tried does a pick fall back to one exact pass over the
//! members.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::hash::{KeyHash, Rendezvous};
use super::Node;
use crate::config::Balance;

/// A warming node starts at this share of its weight (Envoy's
/// `min_weight_percent` default, 10%).
pub const SLOW_START_MIN: f64 = 0.1;

/// Weighted draws tried before the exact pass.
const DRAWS: usize = 8;

/// Longest precomputed round-robin schedule (entries); a lane whose total
/// weight is larger falls back to computing smooth WRR per pick.
const MAX_SCHEDULE: u64 = 1 << 16;
/// Most work (total weight × nodes) spent precomputing a schedule.
const MAX_SCHEDULE_WORK: u64 = 1 << 26;

/// The share of its weight a node warming since `since` (a `now_ms` value;
/// 0 = not warming) carries at `now`, over a slow-start window of
/// `window_ms`: Envoy's linear ramp, `max(10%, elapsed / window)`, and 1.0
/// once the window has passed (or with no window).
pub fn slow_start_factor(since: u64, now: u64, window_ms: u64) -> f64 {
    if window_ms == 0 || since == 0 {
        return 1.0;
    }
    let elapsed = now.saturating_sub(since);
    if elapsed >= window_ms {
        return 1.0;
    }
    (elapsed as f64 / window_ms as f64).max(SLOW_START_MIN)
}

/// What one pick must respect.
#[derive(Debug, Clone, Copy)]
pub struct Want<'t> {
    pub now: u64,
    /// Lane-node indices this request already tried.
    pub tried: &'t [usize],
    /// Panic mode: pick among nodes that are down too.
    pub ignore_health: bool,
    /// The request's hash key (policy `hash`).
    pub key: Option<KeyHash>,
    /// Move the round-robin cursor (false for `/explain`'s dry run).
    pub advance: bool,
}

/// What a picker reads of the lane: its nodes and their live state.
pub trait Members {
    fn weight(&self, i: usize) -> u32;
    /// Selectable for `w` (not tried; healthy unless panic mode).
    fn eligible(&self, i: usize, w: &Want) -> bool;
    /// Slow-start share of the weight at `now` (1.0 when warm).
    fn factor(&self, i: usize, now: u64) -> f64;
    /// Requests in flight to node `i`.
    fn in_flight(&self, i: usize) -> i64;
    /// Is slow start configured at all (skips every `factor` call if not)?
    fn slow_start(&self) -> bool;
}

/// Precomputed selection state over some members of a lane (all of them,
/// or those in the gateway's zone), built once per generation.
#[derive(Debug)]
pub struct Picker {
    /// Lane-node indices of the members.
    pub members: Vec<u32>,
    /// Sum of the members' weights.
    pub total_weight: u64,
    /// The service's policy with the state it needs, and only that.
    policy: Policy,
}

/// One balance policy and its selection state: a pick matches it once.
/// (`repr(u8)`: a plain tag to match, not one folded into a field's niche,
/// which takes decoding on every pick.)
#[derive(Debug)]
#[repr(u8)]
enum Policy {
    /// `round_robin`.
    RoundRobin(RoundRobin),
    /// `random`: weighted draws (member positions).
    Random(Alias),
    /// `least_request`: two weighted draws (member positions) per pick.
    LeastRequest(Alias),
    /// `hash`: the members' identities and weights; requests without the
    /// key go round-robin.
    Hash {
        table: Rendezvous,
        keyless: RoundRobin,
    },
}

/// Smooth weighted round-robin state (`repr(u8)` as [`Policy`]).
#[derive(Debug)]
#[repr(u8)]
enum RoundRobin {
    /// One period precomputed (lane-node indices) and the position in it,
    /// with live smooth-WRR state (by member position) for the entries of
    /// nodes that are down or tried: those entries go to smooth WRR over
    /// the eligible members, so a missing node's share is spread over the
    /// rest by weight (nginx's behaviour), not handed to the next entry.
    Schedule {
        seq: Vec<u32>,
        cursor: AtomicUsize,
        spill: Mutex<Vec<i64>>,
    },
    /// Live smooth-WRR state (by member position) for lanes too heavy to
    /// precompute.
    Live(Mutex<Vec<i64>>),
}

impl RoundRobin {
    /// The schedule over `members` (weights `weights`), or live state when
    /// the lane is too heavy to precompute.
    fn new(members: &[u32], weights: &[u32]) -> RoundRobin {
        match smooth_schedule(weights) {
            Some(s) => RoundRobin::Schedule {
                seq: s.into_iter().map(|m| members[m as usize]).collect(),
                cursor: AtomicUsize::new(0),
                spill: Mutex::new(vec![0; members.len()]),
            },
            None => RoundRobin::Live(Mutex::new(vec![0; members.len()])),
        }
    }
}

impl Picker {
    /// Builds the state `policy` needs over `members` (indices into `nodes`).
    pub fn new(nodes: &[Node], members: Vec<u32>, policy: Balance) -> Picker {
        let weights: Vec<u32> = members.iter().map(|&i| nodes[i as usize].weight).collect();
        let policy = match policy {
            Balance::RoundRobin => Policy::RoundRobin(RoundRobin::new(&members, &weights)),
            Balance::Random => Policy::Random(Alias::new(&weights)),
            Balance::LeastRequest => Policy::LeastRequest(Alias::new(&weights)),
            Balance::Hash => {
                let entries: Vec<(u32, String, u32)> = members
                    .iter()
                    .map(|&i| {
                        let n = &nodes[i as usize];
                        (i, n.addr.to_string(), n.weight)
                    })
                    .collect();
                Policy::Hash {
                    table: Rendezvous::build(&entries),
                    keyless: RoundRobin::new(&members, &weights),
                }
            }
        };
        Picker {
            total_weight: weights.iter().map(|&w| u64::from(w)).sum(),
            members,
            policy,
        }
    }

    /// The lane-node index the policy picks for `w`, if any member is
    /// eligible.
    pub fn pick(&self, set: &impl Members, w: &Want) -> Option<usize> {
        if let [only] = self.members[..] {
            let i = only as usize;
            return set.eligible(i, w).then_some(i);
        }
        match &self.policy {
            Policy::RoundRobin(rr) => self.round_robin(rr, set, w),
            Policy::Hash { table, keyless } => match w.key {
                Some(k) => self.hash(table, set, w, k),
                None => self.round_robin(keyless, set, w),
            },
            Policy::Random(alias) => self.random(alias, set, w, None),
            Policy::LeastRequest(alias) => self.least_request(alias, set, w),
        }
    }

    /// Smooth WRR: the next schedule entry. An entry whose node is down or
    /// tried is picked by live smooth WRR over the eligible members instead
    /// (so each eligible node gets its weight's share of the missing
    /// node's entries, and no neighbour gets them all). A warming node's
    /// entry is kept with probability `factor`; a rejected entry restarts
    /// the scan at a random position of the schedule (a weighted draw), so
    /// the node gets exactly `factor × weight` against the others' weights
    /// and what it gives up is spread over them by weight.
    fn round_robin(&self, rr: &RoundRobin, set: &impl Members, w: &Want) -> Option<usize> {
        let (seq, cursor, spill) = match rr {
            RoundRobin::Schedule { seq, cursor, spill } => (seq, cursor, spill),
            RoundRobin::Live(current) => return self.live_round_robin(current, set, w),
        };
        let mut start = if w.advance {
            cursor.fetch_add(1, Ordering::Relaxed)
        } else {
            cursor.load(Ordering::Relaxed)
        };
        let len = seq.len();
        let slow = set.slow_start();
        let mut spare = None;
        let mut restarts = 0;
        let mut k = 0;
        while k < len {
            let i = seq[(start + k) % len] as usize;
            k += 1;
            if !set.eligible(i, w) {
                return self.live_round_robin(spill, set, w).or(spare);
            }
            if slow {
                let f = set.factor(i, w.now);
                if f < 1.0 && !coin(f) {
                    spare.get_or_insert(i);
                    if restarts < DRAWS {
                        restarts += 1;
                        start = fastrand::usize(..len);
                        k = 0;
                    }
                    continue;
                }
            }
            return Some(i);
        }
        spare
    }

    /// Smooth WRR computed live (lanes too heavy to precompute), with
    /// slow-start weights applied exactly.
    fn live_round_robin(
        &self,
        current: &Mutex<Vec<i64>>,
        set: &impl Members,
        w: &Want,
    ) -> Option<usize> {
        let mut cur = current.lock().unwrap_or_else(|e| e.into_inner());
        let slow = set.slow_start();
        let mut total = 0i64;
        let mut best: Option<(usize, i64)> = None;
        for (m, &i) in self.members.iter().enumerate() {
            let i = i as usize;
            if !set.eligible(i, w) {
                continue;
            }
            let mut weight = i64::from(set.weight(i));
            if slow {
                weight = ((weight as f64 * set.factor(i, w.now)) as i64).max(1);
            }
            total += weight;
            let v = cur[m] + weight;
            if w.advance {
                cur[m] = v;
            }
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((m, v));
            }
        }
        let (b, _) = best?;
        if w.advance {
            cur[b] -= total;
        }
        Some(self.members[b] as usize)
    }

    /// Weighted random: alias-table draws, a warming node kept with
    /// probability `factor` (rejection sampling: exact effective weights).
    fn random(
        &self,
        alias: &Alias,
        set: &impl Members,
        w: &Want,
        exclude: Option<usize>,
    ) -> Option<usize> {
        let slow = set.slow_start();
        for _ in 0..DRAWS {
            let i = self.members[alias.sample()] as usize;
            if Some(i) == exclude || !set.eligible(i, w) {
                continue;
            }
            if slow {
                let f = set.factor(i, w.now);
                if f < 1.0 && !coin(f) {
                    continue;
                }
            }
            return Some(i);
        }
        self.weighted_scan(set, w, exclude)
    }

    /// One exact weighted draw over the eligible members (the slow path
    /// when draws keep landing on nodes that are down or tried).
    fn weighted_scan(&self, set: &impl Members, w: &Want, exclude: Option<usize>) -> Option<usize> {
        let ok = |i: usize| Some(i) != exclude && set.eligible(i, w);
        let eff = |i: usize| f64::from(set.weight(i)) * set.factor(i, w.now);
        let total: f64 = self
            .members
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| ok(i))
            .map(eff)
            .sum();
        if total <= 0.0 {
            return None;
        }
        let mut x = fastrand::f64() * total;
        let mut last = None;
        for i in self.members.iter().map(|&i| i as usize).filter(|&i| ok(i)) {
            x -= eff(i);
            last = Some(i);
            if x < 0.0 {
                break;
            }
        }
        last
    }

    /// Power of two choices: two distinct weighted draws; the second wins
    /// only with strictly fewer requests in flight per unit of effective
    /// weight.
    fn least_request(&self, alias: &Alias, set: &impl Members, w: &Want) -> Option<usize> {
        let a = self.random(alias, set, w, None)?;
        let Some(b) = self.random(alias, set, w, Some(a)) else {
            return Some(a);
        };
        let eff = |i: usize| f64::from(set.weight(i)) * set.factor(i, w.now);
        let (la, lb) = (set.in_flight(a) as f64, set.in_flight(b) as f64);
        Some(if lb * eff(a) < la * eff(b) { b } else { a })
    }

    /// Consistent hashing: the key's best-ranked node that is eligible (so
    /// only the keys of a node that is down or tried move, spread over the
    /// others by weight, and a retry goes to the key's next node). A
    /// warming node takes the keys whose second hash falls under its
    /// factor — each key moves to it once, as the factor rises.
    fn hash(
        &self,
        table: &Rendezvous,
        set: &impl Members,
        w: &Want,
        key: KeyHash,
    ) -> Option<usize> {
        let found = if set.slow_start() {
            table
                .walk(key, |i| {
                    set.eligible(i, w) && key.admits(set.factor(i, w.now))
                })
                .or_else(|| table.walk(key, |i| set.eligible(i, w)))
        } else {
            table.walk(key, |i| set.eligible(i, w))
        };
        if found.is_some() {
            return found;
        }
        // Only nodes of weight 0 left: the first eligible member from the
        // key's position.
        let n = self.members.len();
        let start = (key.get() % n as u64) as usize;
        (0..n)
            .map(|k| self.members[(start + k) % n] as usize)
            .find(|&i| set.eligible(i, w))
    }
}

/// True with probability `p` (thread-local generator).
fn coin(p: f64) -> bool {
    fastrand::f64() < p
}

/// One full period of smooth weighted round-robin over `weights` (positions).
pub fn smooth_schedule(weights: &[u32]) -> Option<Vec<u32>> {
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

/// Walker's alias method (Vose's construction, exact integer arithmetic):
/// a weighted draw is one uniform index and one coin.
#[derive(Debug)]
pub struct Alias {
    /// Chance (× 2³²) of keeping column `i` rather than its alias.
    keep: Vec<u64>,
    alias: Vec<u32>,
}

impl Alias {
    pub fn new(weights: &[u32]) -> Alias {
        let n = weights.len();
        let total: u128 = weights.iter().map(|&w| u128::from(w)).sum::<u128>().max(1);
        let mut scaled: Vec<u128> = weights.iter().map(|&w| u128::from(w) * n as u128).collect();
        let mut keep = vec![1u64 << 32; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| scaled[i] < total);
        while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
            small.pop();
            keep[s] = ((scaled[s] << 32) / total) as u64;
            alias[s] = l as u32;
            scaled[l] = scaled[l] + scaled[s] - total;
            if scaled[l] < total {
                large.pop();
                small.push(l);
            }
        }
        Alias { keep, alias }
    }

    /// A position drawn with probability weight / total.
    pub fn sample(&self) -> usize {
        let i = fastrand::usize(..self.keep.len());
        if u64::from(fastrand::u32(..)) < self.keep[i] {
            i
        } else {
            self.alias[i] as usize
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A lane for the pickers: weights, which are down, warming factors and
    /// in-flight counts set by hand.
    pub struct Fake {
        pub weights: Vec<u32>,
        pub down: Vec<bool>,
        pub factor: Vec<f64>,
        pub in_flight: Vec<i64>,
    }

    impl Fake {
        pub fn new(weights: &[u32]) -> Fake {
            let n = weights.len();
            Fake {
                weights: weights.to_vec(),
                down: vec![false; n],
                factor: vec![1.0; n],
                in_flight: vec![0; n],
            }
        }

        pub fn nodes(&self) -> Vec<Node> {
            self.weights
                .iter()
                .enumerate()
                .map(|(i, &w)| Node {
                    name: format!("n{i}").into(),
                    addr: format!("10.0.{}.{}:80", i / 250, i % 250 + 1)
                        .parse()
                        .unwrap(),
                    lane: "formal".into(),
                    weight: w,
                    drain: false,
                    zone: None,
                })
                .collect()
        }

        pub fn picker(&self, policy: Balance) -> Picker {
            let n = self.weights.len() as u32;
            Picker::new(&self.nodes(), (0..n).collect(), policy)
        }
    }

    impl Members for Fake {
        fn weight(&self, i: usize) -> u32 {
            self.weights[i]
        }
        fn eligible(&self, i: usize, w: &Want) -> bool {
            !w.tried.contains(&i) && (w.ignore_health || !self.down[i])
        }
        fn factor(&self, i: usize, _now: u64) -> f64 {
            self.factor[i]
        }
        fn in_flight(&self, i: usize) -> i64 {
            self.in_flight[i]
        }
        fn slow_start(&self) -> bool {
            self.factor.iter().any(|&f| f < 1.0)
        }
    }

    impl Picker {
        /// Is the round-robin schedule precomputed?
        fn precomputed(&self) -> bool {
            matches!(self.policy, Policy::RoundRobin(RoundRobin::Schedule { .. }))
        }
    }

    pub fn want(tried: &[usize]) -> Want<'_> {
        Want {
            now: 1,
            tried,
            ignore_health: false,
            key: None,
            advance: true,
        }
    }

    fn counts(f: &Fake, p: &Picker, n: usize) -> Vec<u64> {
        let mut c = vec![0u64; f.weights.len()];
        for _ in 0..n {
            c[p.pick(f, &want(&[])).unwrap()] += 1;
        }
        c
    }

    /// Pearson's chi-square of `observed` against `expected_share`.
    fn chi_square(observed: &[u64], expected_share: &[f64]) -> f64 {
        let n: u64 = observed.iter().sum();
        observed
            .iter()
            .zip(expected_share)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn shares(weights: &[f64]) -> Vec<f64> {
        let t: f64 = weights.iter().sum();
        weights.iter().map(|w| w / t).collect()
    }

    /// χ² critical value at p = 0.001 for 4 degrees of freedom.
    const CHI2_4DF_P001: f64 = 18.47;

    #[test]
    fn precomputed_schedule_equals_live_smooth_wrr() {
        for weights in [
            vec![5, 1, 1],
            vec![3, 2],
            vec![1; 1000],
            vec![7, 3, 9, 1, 4],
        ] {
            let f = Fake::new(&weights);
            let p = f.picker(Balance::RoundRobin);
            assert!(p.precomputed());
            let mut live = f.picker(Balance::RoundRobin);
            live.policy = Policy::RoundRobin(RoundRobin::Live(Mutex::new(vec![0; weights.len()])));
            let total: u32 = weights.iter().sum();
            for _ in 0..2 * total {
                let w = want(&[]);
                assert_eq!(p.pick(&f, &w), live.pick(&f, &w), "{weights:?}");
            }
        }
        // Too heavy to precompute: live smooth WRR still spreads by weight.
        let f = Fake::new(&[100_000, 50_000]);
        let heavy = f.picker(Balance::RoundRobin);
        assert!(!heavy.precomputed());
        let c = counts(&f, &heavy, 300);
        assert_eq!(c, vec![200, 100]);
    }

    #[test]
    fn round_robin_follows_weights_exactly() {
        let f = Fake::new(&[5, 1, 1, 3, 2]);
        let p = f.picker(Balance::RoundRobin);
        // Whole periods: smooth WRR is exact, χ² = 0.
        let c = counts(&f, &p, 12 * 1000);
        assert_eq!(c, vec![5000, 1000, 1000, 3000, 2000]);
        assert!(chi_square(&c, &shares(&[5.0, 1.0, 1.0, 3.0, 2.0])) < 1e-9);
    }

    /// nginx's `ngx_http_upstream_get_peer`: smooth WRR computed per pick
    /// over the peers that are up, a down peer skipped in the loop.
    fn nginx_counts(weights: &[u32], down: &[bool], n: usize) -> Vec<u64> {
        let mut cur = vec![0i64; weights.len()];
        let mut c = vec![0u64; weights.len()];
        for _ in 0..n {
            let (mut total, mut best) = (0i64, None::<usize>);
            for i in (0..weights.len()).filter(|&i| !down[i]) {
                cur[i] += i64::from(weights[i]);
                total += i64::from(weights[i]);
                if best.is_none_or(|b| cur[i] > cur[b]) {
                    best = Some(i);
                }
            }
            let b = best.unwrap();
            cur[b] -= total;
            c[b] += 1;
        }
        c
    }

    /// χ² critical values at p = 0.001, by degrees of freedom (index).
    const CHI2_P001: [f64; 5] = [0.0, 10.83, 13.82, 16.27, CHI2_4DF_P001];

    #[test]
    fn round_robin_spreads_a_down_nodes_share_by_weight() {
        let cases: [(&[u32], &[usize]); 5] = [
            (&[1, 1, 1, 1, 1], &[0, 1, 2]),
            (&[1, 1, 1, 1, 1], &[1]),
            (&[5, 1, 1, 3, 2], &[0]),
            (&[5, 1, 1, 3, 2], &[0, 2, 4]),
            (&[2, 3, 4], &[1]),
        ];
        for (weights, down_ids) in cases {
            let mut f = Fake::new(weights);
            for &d in down_ids {
                f.down[d] = true;
            }
            let p = f.picker(Balance::RoundRobin);
            assert!(p.precomputed());
            let n = 6_000;
            let ours = counts(&f, &p, n);
            let nginx = nginx_counts(weights, &f.down, n);
            // Over the nodes that are up: shares by weight, as nginx's.
            let up: Vec<usize> = (0..weights.len()).filter(|&i| !f.down[i]).collect();
            let expect = shares(
                &up.iter()
                    .map(|&i| f64::from(weights[i]))
                    .collect::<Vec<_>>(),
            );
            let limit = CHI2_P001[up.len() - 1];
            for (who, c) in [("graygate", &ours), ("nginx", &nginx)] {
                let observed: Vec<u64> = up.iter().map(|&i| c[i]).collect();
                let chi = chi_square(&observed, &expect);
                assert!(
                    chi < limit,
                    "{who} {weights:?} down {down_ids:?}: χ² = {chi}, {c:?}"
                );
            }
            for &d in down_ids {
                assert_eq!(ours[d], 0);
            }
        }
    }

    #[test]
    fn weighted_random_follows_weights_chi_square() {
        fastrand::seed(17);
        let weights = [5, 1, 1, 3, 2];
        let f = Fake::new(&weights);
        let p = f.picker(Balance::Random);
        let c = counts(&f, &p, 120_000);
        let chi = chi_square(&c, &shares(&[5.0, 1.0, 1.0, 3.0, 2.0]));
        assert!(chi < CHI2_4DF_P001, "χ² = {chi}, counts {c:?}");
        // …and the test can fail: uniform shares are far off.
        let uniform = chi_square(&c, &[0.2; 5]);
        assert!(uniform > 100.0 * CHI2_4DF_P001, "uniform χ² = {uniform}");
    }

    #[test]
    fn alias_table_is_exact() {
        // Column probabilities recombine to the weights exactly.
        let weights = [7u32, 1, 0, 13, 2, 2];
        let a = Alias::new(&weights);
        let n = weights.len() as f64;
        let mut mass = vec![0f64; weights.len()];
        for i in 0..weights.len() {
            let keep = a.keep[i] as f64 / (1u64 << 32) as f64;
            mass[i] += keep / n;
            mass[a.alias[i] as usize] += (1.0 - keep) / n;
        }
        let total: u32 = weights.iter().sum();
        for (m, &w) in mass.iter().zip(&weights) {
            assert!(
                (m - f64::from(w) / f64::from(total)).abs() < 1e-9,
                "{mass:?}"
            );
        }
    }

    #[test]
    fn slow_start_scales_random_and_round_robin_weights() {
        fastrand::seed(3);
        // Node 2 warming at 25%: effective weights 4, 4, 1.
        let mut f = Fake::new(&[4, 4, 4]);
        f.factor[2] = 0.25;
        let expect = shares(&[4.0, 4.0, 1.0]);
        for policy in [Balance::Random, Balance::RoundRobin] {
            let p = f.picker(policy);
            let c = counts(&f, &p, 90_000);
            let chi = chi_square(&c, &expect);
            // 2 degrees of freedom, p = 0.001.
            assert!(chi < 13.82, "{policy:?}: χ² = {chi}, {c:?}");
        }
    }

    #[test]
    fn every_policy_skips_down_and_tried_nodes() {
        fastrand::seed(5);
        let mut f = Fake::new(&[1, 1, 1, 1]);
        f.down[1] = true;
        for policy in [
            Balance::RoundRobin,
            Balance::Random,
            Balance::LeastRequest,
            Balance::Hash,
        ] {
            let p = f.picker(policy);
            let mut tried = Vec::new();
            let mut w = want(&[]);
            w.key = Some(KeyHash::of(b"user-1"));
            loop {
                let w = Want { tried: &tried, ..w };
                let Some(i) = p.pick(&f, &w) else {
                    break;
                };
                assert!(i != 1 && !tried.contains(&i), "{policy:?}");
                tried.push(i);
            }
            tried.sort();
            assert_eq!(tried, vec![0, 2, 3], "{policy:?}");
            // Panic mode takes the down node too.
            let all: Vec<usize> = vec![0, 2, 3];
            let w = Want {
                tried: &all,
                ignore_health: true,
                ..w
            };
            assert_eq!(p.pick(&f, &w), Some(1), "{policy:?}");
        }
    }

    #[test]
    fn least_request_prefers_fewer_in_flight_per_weight() {
        fastrand::seed(11);
        let mut f = Fake::new(&[1, 1, 1, 1]);
        f.in_flight = vec![0, 9, 9, 9];
        let p = f.picker(Balance::LeastRequest);
        let c = counts(&f, &p, 10_000);
        // Node 0 wins whenever drawn (7/16 of pairs include it).
        assert!(c[0] > 4_000, "{c:?}");
        // Weight-aware: a node of weight 4 with 2 in flight (0.5 per unit)
        // beats a node of weight 1 with 1 in flight.
        let mut g = Fake::new(&[4, 1]);
        g.in_flight = vec![2, 1];
        let p = g.picker(Balance::LeastRequest);
        let c = counts(&g, &p, 1_000);
        assert_eq!(c, vec![1_000, 0]);
        // Idle: weighted random.
        g.in_flight = vec![0, 0];
        let c = counts(&g, &p, 50_000);
        let chi = chi_square(&c, &shares(&[4.0, 1.0]));
        assert!(chi < 10.83, "χ² = {chi}, {c:?}");
    }

    #[test]
    fn slow_start_factor_ramps_linearly_from_ten_percent() {
        assert_eq!(slow_start_factor(0, 5_000, 10_000), 1.0, "not warming");
        assert_eq!(slow_start_factor(1_000, 5_000, 0), 1.0, "no window");
        assert_eq!(slow_start_factor(1_000, 1_000, 10_000), SLOW_START_MIN);
        assert_eq!(slow_start_factor(1_000, 1_500, 10_000), SLOW_START_MIN);
        assert!((slow_start_factor(1_000, 3_500, 10_000) - 0.25).abs() < 1e-12);
        assert!((slow_start_factor(1_000, 8_500, 10_000) - 0.75).abs() < 1e-12);
        assert_eq!(slow_start_factor(1_000, 11_000, 10_000), 1.0);
        assert_eq!(slow_start_factor(1_000, 900, 10_000), SLOW_START_MIN);
    }
}
