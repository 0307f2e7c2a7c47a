//! Layer: nodes. Consistent hashing for `balance: hash`: the request key
//! (`hash_key`: a header, a cookie, a query argument or the client IP), its
//! MurmurHash3 (x64 128, first 64 bits; stable across builds and gateways,
//! so every replica pins a key to the same node), and weighted rendezvous
//! (highest random weight) hashing over the lane's nodes.
//!
//! Why rendezvous rather than Maglev or a ketama ring: removing, adding or
//! skipping a node never moves a key between the other nodes (each node's
//! score for a key depends on the key and that node alone; Maglev's
//! rebuilt table hands a few survivors' keys to each other), the spread
//! follows the weights with no table or points to size (a ring's spread
//! depends on its points per node), and a node that is down or tried is
//! simply left out, so its keys spread over the others by weight. The
//! price is a pass over the lane's nodes per pick — one multiply-xor mix
//! per node, plus a logarithm when weights differ — which the lanes this
//! is for (a handful to a hundred nodes) pay in well under a microsecond.
//! Nodes are identified by address, not by name: default names carry an
//! index that shifts when a node is removed.

use std::fmt;
use std::net::IpAddr;
use std::num::NonZeroU64;
use std::str::FromStr;

use http::{HeaderMap, HeaderName, Uri};

/// Where the hash key of a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashKey {
    /// `header:<name>` — the first value of a request header.
    Header(HeaderName),
    /// `cookie:<name>`.
    Cookie(String),
    /// `arg:<name>` — a query argument, percent-decoded.
    Arg(String),
    /// `client_ip` — the client address (behind trusted proxies, from
    /// X-Forwarded-For).
    ClientIp,
}

impl FromStr for HashKey {
    type Err = String;

    fn from_str(s: &str) -> Result<HashKey, String> {
        let s = s.trim();
        if s == "client_ip" {
            return Ok(HashKey::ClientIp);
        }
        let bad = || {
            format!(
                "invalid hash_key {s:?} (header:<name>, cookie:<name>, arg:<name> or client_ip)"
            )
        };
        let (kind, name) = s.split_once(':').ok_or_else(bad)?;
        let name = name.trim();
        if name.is_empty() {
            return Err(bad());
        }
        match kind.trim() {
            "header" => HeaderName::from_bytes(name.as_bytes())
                .map(HashKey::Header)
                .map_err(|_| format!("invalid header name {name:?} in hash_key")),
            "cookie" => Ok(HashKey::Cookie(name.to_string())),
            "arg" => Ok(HashKey::Arg(name.to_string())),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for HashKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashKey::Header(h) => write!(f, "header:{h}"),
            HashKey::Cookie(c) => write!(f, "cookie:{c}"),
            HashKey::Arg(a) => write!(f, "arg:{a}"),
            HashKey::ClientIp => f.write_str("client_ip"),
        }
    }
}

impl HashKey {
    /// The request's key hashed, or `None` when the request has no such
    /// key (absent or empty): such a request is picked by round-robin.
    pub fn hash(&self, headers: &HeaderMap, uri: &Uri, client_ip: IpAddr) -> Option<KeyHash> {
        match self {
            HashKey::Header(h) => {
                let v = headers.get(h)?.as_bytes();
                (!v.is_empty()).then(|| KeyHash::of(v))
            }
            HashKey::Cookie(c) => crate::lane::cookie_value(headers, c)
                .filter(|v| !v.is_empty())
                .map(|v| KeyHash::of(v.as_bytes())),
            HashKey::Arg(a) => {
                let q = uri.query()?;
                form_urlencoded::parse(q.as_bytes())
                    .find(|(k, _)| k == a.as_str())
                    .filter(|(_, v)| !v.is_empty())
                    .map(|(_, v)| KeyHash::of(v.as_bytes()))
            }
            HashKey::ClientIp => Some(match client_ip {
                IpAddr::V4(v4) => KeyHash::of(&v4.octets()),
                IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                    Some(v4) => KeyHash::of(&v4.octets()),
                    None => KeyHash::of(&v6.octets()),
                },
            }),
        }
    }
}

/// A request key's hash: the first 64 bits of its MurmurHash3 x64 128
/// (seed 0), never 0 (so `Option<KeyHash>` is one word). Mixed with each
/// node's identity it ranks the nodes; a remix of it decides slow-start
/// admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(NonZeroU64);

impl KeyHash {
    pub fn of(key: &[u8]) -> KeyHash {
        let (a, _) = mur3::murmurhash3_x64_128(key, 0);
        KeyHash(NonZeroU64::new(a).unwrap_or(NonZeroU64::MIN))
    }

    /// The hash value.
    pub fn get(self) -> u64 {
        self.0.get()
    }

    /// Does a node warming at `factor` take this key yet? The keys it takes
    /// grow with the factor, so each key moves to a new node once.
    pub fn admits(self, factor: f64) -> bool {
        // A second, independent-looking value from the same hash
        // (splitmix64's finaliser), so admission does not follow the
        // node ranking.
        let mut z = self.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        factor >= 1.0 || ((z >> 11) as f64 / (1u64 << 53) as f64) < factor
    }
}

/// One member of a [`Rendezvous`] set.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// Lane-node index.
    lane: u32,
    /// Hash of the node's identity (its address).
    seed: u64,
    /// 1 / weight.
    inv_weight: f64,
}

/// Weighted rendezvous (highest random weight) hashing over a lane's
/// members: every node scores the key, `weight / -ln(u)` with `u` uniform
/// from the key and the node's identity, and the best score wins.
#[derive(Debug)]
pub struct Rendezvous {
    members: Vec<Member>,
    /// Every weight equal: the raw mixed hashes rank the nodes as the
    /// scores would, without a logarithm per node.
    uniform: bool,
}

impl Rendezvous {
    /// The set over `(lane index, identity, weight)` entries; nodes of
    /// weight 0 take no keys.
    pub fn build(nodes: &[(u32, String, u32)]) -> Rendezvous {
        let members: Vec<Member> = nodes
            .iter()
            .filter(|n| n.2 > 0)
            .map(|(lane, id, w)| {
                let (seed, _) = mur3::murmurhash3_x64_128(id.as_bytes(), 0x6872_7700);
                Member {
                    lane: *lane,
                    seed,
                    inv_weight: 1.0 / f64::from(*w),
                }
            })
            .collect();
        let uniform = members
            .windows(2)
            .all(|p| p[0].inv_weight == p[1].inv_weight);
        Rendezvous { members, uniform }
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The best-scoring node for `key` that `ok` accepts (`None` when `ok`
    /// accepts none). Leaving nodes out never reorders the others, so a
    /// node that is down, tried or removed moves only its own keys, and a
    /// retry's next node is the key's next in rank. `ok` is asked only
    /// about nodes that beat the best accepted so far.
    pub fn walk(&self, key: KeyHash, mut ok: impl FnMut(usize) -> bool) -> Option<usize> {
        let k = key.get();
        // Ties (equal scores) go to the larger identity hash, never to a
        // position.
        if self.uniform {
            let mut best: Option<(u64, u64, u32)> = None;
            for m in &self.members {
                let h = mix(k ^ m.seed);
                if best.is_none_or(|b| (h, m.seed) > (b.0, b.1)) && ok(m.lane as usize) {
                    best = Some((h, m.seed, m.lane));
                }
            }
            best.map(|b| b.2 as usize)
        } else {
            // The smallest -ln(u) / weight is the largest weight / -ln(u).
            let (mut best_d, mut best_seed, mut best) = (f64::INFINITY, 0, None);
            for m in &self.members {
                let h = mix(k ^ m.seed);
                let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
                // -ln(u) ≥ 1 - u: a node already beaten on that bound needs
                // no logarithm (the margin is far above the rounding of
                // either side, so the winner is the one the full
                // computation finds).
                if (1.0 - u) * m.inv_weight * (1.0 - 1e-9) > best_d {
                    continue;
                }
                let d = neg_ln(u) * m.inv_weight;
                if (d < best_d || (d == best_d && m.seed > best_seed)) && ok(m.lane as usize) {
                    (best_d, best_seed, best) = (d, m.seed, Some(m.lane as usize));
                }
            }
            best
        }
    }

    /// The key's node with every node acceptable.
    pub fn lookup(&self, key: KeyHash) -> Option<usize> {
        self.walk(key, |_| true)
    }
}

/// MurmurHash3's 64-bit finaliser: a bijection whose every output bit
/// depends on every input bit, so one key's values for two nodes look
/// independent.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// `-ln(u)` for `u` in (0, 1), from IEEE-754 basic operations only (each
/// correctly rounded), so every platform and libm computes the same bits
/// and every replica ranks a key's nodes alike. `u = m · 2^e` with `m`
/// in (√½, √2]; `ln m = 2 atanh(s)`, `s = (m - 1) / (m + 1)`, `|s| < 0.172`,
/// whose series to `s^15` is within 1e-13 of it.
fn neg_ln(u: f64) -> f64 {
    let bits = u.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let p = s2
        * (1.0 / 3.0
            + s2 * (1.0 / 5.0
                + s2 * (1.0 / 7.0
                    + s2 * (1.0 / 9.0
                        + s2 * (1.0 / 11.0 + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0)))))));
    -(e as f64 * std::f64::consts::LN_2 + 2.0 * s * (1.0 + p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(ids: &[u32]) -> Rendezvous {
        weighted(&ids.iter().map(|&i| (i, 1)).collect::<Vec<_>>())
    }

    fn weighted(ids: &[(u32, u32)]) -> Rendezvous {
        let entries: Vec<(u32, String, u32)> = ids
            .iter()
            .map(|&(i, w)| (i, format!("10.0.0.{i}:80"), w))
            .collect();
        Rendezvous::build(&entries)
    }

    fn keys() -> Vec<KeyHash> {
        (0..20_000)
            .map(|u| KeyHash::of(format!("user-{u}").as_bytes()))
            .collect()
    }

    #[test]
    fn hash_keys_parse_and_print() {
        for s in ["header:x-user-id", "cookie:uid", "arg:uid", "client_ip"] {
            assert_eq!(s.parse::<HashKey>().unwrap().to_string(), s);
        }
        assert_eq!(
            "header:X-User-Id".parse::<HashKey>().unwrap(),
            HashKey::Header(HeaderName::from_static("x-user-id"))
        );
        for bad in ["", "uid", "header:", "query:uid", "header:bad header"] {
            assert!(bad.parse::<HashKey>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keys_come_from_header_cookie_arg_and_ip() {
        let req = http::Request::builder()
            .uri("/x?a=1&uid=u%2042")
            .header("x-user-id", "42")
            .header("cookie", "sid=abc; uid=u 42")
            .body(())
            .unwrap();
        let (parts, _) = req.into_parts();
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let k = |s: &str| {
            s.parse::<HashKey>()
                .unwrap()
                .hash(&parts.headers, &parts.uri, ip)
        };
        assert_eq!(k("header:X-User-Id"), Some(KeyHash::of(b"42")));
        assert_eq!(k("cookie:uid"), Some(KeyHash::of(b"u 42")));
        assert_eq!(k("arg:uid"), Some(KeyHash::of(b"u 42")), "percent-decoded");
        assert_eq!(k("client_ip"), Some(KeyHash::of(&[10, 1, 2, 3])));
        // IPv4-mapped IPv6 is the same client.
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(
            HashKey::ClientIp.hash(&parts.headers, &parts.uri, mapped),
            Some(KeyHash::of(&[10, 1, 2, 3]))
        );
        for missing in ["header:x-other", "cookie:nope", "arg:nope"] {
            assert_eq!(k(missing), None, "{missing}");
        }
        // The key is stable across builds (MurmurHash3 x64 128, seed 0).
        assert_eq!(KeyHash::of(b"hello").get(), 0xcbd8a7b341bd9b02);
        assert_eq!(std::mem::size_of::<Option<KeyHash>>(), 8);
    }

    #[test]
    fn rendezvous_spreads_keys_evenly() {
        let t = table(&(0..10).collect::<Vec<_>>());
        let mut c = [0usize; 10];
        for k in keys() {
            c[t.lookup(k).unwrap()] += 1;
        }
        for n in c {
            assert!((1_800..2_200).contains(&n), "{c:?}");
        }
    }

    #[test]
    fn weighted_rendezvous_follows_weights() {
        // Weights 3, 1, 2, 1, 0: shares 3/7, 1/7, 2/7, 1/7, none.
        let t = weighted(&[(0, 3), (1, 1), (2, 2), (3, 1), (4, 0)]);
        assert_eq!(t.len(), 4, "weight 0 takes no keys");
        let keys = keys();
        let mut c = [0usize; 5];
        for &k in &keys {
            c[t.lookup(k).unwrap()] += 1;
        }
        for (n, share) in c.iter().zip([3.0, 1.0, 2.0, 1.0, 0.0]) {
            let got = *n as f64 / keys.len() as f64;
            assert!((got - share / 7.0).abs() < 0.015, "{c:?}");
        }
    }

    #[test]
    fn adding_or_removing_a_node_moves_only_its_keys() {
        for w in [[1, 1, 1], [3, 1, 2]] {
            let ids: Vec<(u32, u32)> = (0..10).map(|i| (i, w[i as usize % 3])).collect();
            let ten = weighted(&ids);
            let eleven = weighted(&[&ids[..], &[(10, 2)]].concat());
            let nine = weighted(&ids[1..]);
            let keys = keys();
            let (mut to_new, mut own) = (0, 0);
            for &k in &keys {
                let before = ten.lookup(k).unwrap();
                // Added: a key moves only to the new node.
                let a = eleven.lookup(k).unwrap();
                if a != before {
                    assert_eq!(a, 10);
                    to_new += 1;
                }
                // Removed: only node 0's keys move.
                let r = nine.lookup(k).unwrap();
                if before == 0 {
                    assert_ne!(r, 0);
                    own += 1;
                } else {
                    assert_eq!(r, before, "{w:?}");
                }
            }
            let total: u32 = ids.iter().map(|n| n.1).sum();
            let share = |n: usize, of: f64| n as f64 / keys.len() as f64 / of;
            let new = share(to_new, 2.0 / f64::from(total + 2));
            let gone = share(own, f64::from(w[0]) / f64::from(total));
            assert!((0.85..1.15).contains(&new), "{w:?}: {new}");
            assert!((0.85..1.15).contains(&gone), "{w:?}: {gone}");
        }
    }

    /// `user-1`'s nodes in rank order over `10.0.0.0:80` … `10.0.0.4:80`,
    /// of equal weights and of weights 3, 1, 2, 1, 5.
    const PLAIN_RANKING: [usize; 5] = [3, 1, 4, 2, 0];
    const HEAVY_RANKING: [usize; 5] = [4, 3, 1, 0, 2];

    #[test]
    fn rankings_are_fixed_across_builds_and_platforms() {
        // Replicas must rank a key's nodes alike: the identity hash, the
        // mix and the logarithm are plain integer and IEEE-754 arithmetic.
        // These rankings must never change between releases.
        let ranking = |t: &Rendezvous, k: &[u8]| {
            let key = KeyHash::of(k);
            let mut out = Vec::new();
            while let Some(i) = t.walk(key, |i| !out.contains(&i)) {
                out.push(i);
            }
            out
        };
        let plain = table(&[0, 1, 2, 3, 4]);
        let heavy = weighted(&[(0, 3), (1, 1), (2, 2), (3, 1), (4, 5)]);
        assert_eq!(ranking(&plain, b"user-1"), PLAIN_RANKING);
        assert_eq!(ranking(&heavy, b"user-1"), HEAVY_RANKING);
        // Skipping the logarithm of nodes beaten on its bound changes no
        // winner: the full computation over every node agrees.
        let ids: Vec<(u32, u32)> = (0..20).map(|i| (i, 1 + i % 4)).collect();
        let t = weighted(&ids);
        for k in keys().into_iter().take(5_000) {
            let full = t
                .members
                .iter()
                .map(|m| {
                    let h = mix(k.get() ^ m.seed);
                    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
                    (neg_ln(u) * m.inv_weight, m.lane as usize)
                })
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .unwrap();
            assert_eq!(t.lookup(k), Some(full.1));
        }
        // The logarithm: within 1e-12 of libm's.
        for i in 1..100_000u64 {
            let u = ((mix(i) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
            let (got, want) = (neg_ln(u), -u.ln());
            assert!((got - want).abs() <= 1e-12 * want.max(1e-300), "{u}");
        }
    }

    #[test]
    fn removing_one_of_three_nodes_keeps_the_survivors_keys() {
        // Through the service's own table building (the identity each node
        // gets there), with unnamed nodes: their default names carry their
        // position, which shifts when a node before them goes.
        use crate::config::{Balance, NodeConfig, FORMAL};
        use crate::nodes::{Node, Select, Service};
        use std::collections::BTreeMap;
        use std::net::SocketAddr;
        let service = |addrs: &[SocketAddr]| {
            let nodes = addrs
                .iter()
                .enumerate()
                .map(|(i, &addr)| {
                    let c = NodeConfig {
                        name: None,
                        addr: addr.into(),
                        lane: FORMAL.into(),
                        weight: 1,
                        drain: false,
                        zone: None,
                    };
                    Node::from_config("api", i, &c, addr)
                })
                .collect();
            let select = Select {
                balance: Balance::Hash,
                hash_key: Some(HashKey::ClientIp),
                ..Select::default()
            };
            Service::with_select("api", nodes, select)
        };
        let owner = |s: &Service, key: KeyHash| {
            let c = s.choose(FORMAL, 0).unwrap();
            c.set.nodes[c.pick(0, &[], Some(key)).unwrap()].addr
        };
        let addrs: Vec<SocketAddr> = (1..=3)
            .map(|i| format!("10.0.0.{i}:80").parse().unwrap())
            .collect();
        let keys = keys();
        let three = service(&addrs);
        for gone in &addrs {
            let rest: Vec<SocketAddr> = addrs.iter().copied().filter(|a| a != gone).collect();
            let two = service(&rest);
            let (mut survivors_keys, mut moved) = (0, 0);
            let mut spread: BTreeMap<SocketAddr, usize> = BTreeMap::new();
            for &k in &keys {
                let (before, after) = (owner(&three, k), owner(&two, k));
                if before == *gone {
                    *spread.entry(after).or_default() += 1;
                } else {
                    survivors_keys += 1;
                    moved += usize::from(after != before);
                }
            }
            // Not one: a survivor identified by anything but its address
            // loses most of them.
            assert_eq!(
                moved, 0,
                "removing {gone} moved {moved} of the survivors' {survivors_keys} keys"
            );
            // The removed node's keys spread over both survivors.
            assert_eq!(spread.len(), 2, "{gone}: {spread:?}");
        }
    }

    #[test]
    fn a_missing_node_moves_only_its_own_keys() {
        // Leaving out a node that is down (no rebuild): keys of the other
        // nodes stay exactly where they were.
        let keys = keys();
        let t = table(&(0..10).collect::<Vec<_>>());
        let mut spread = [0usize; 10];
        for &k in &keys {
            let before = t.lookup(k).unwrap();
            let after = t.walk(k, |i| i != 3).unwrap();
            if before == 3 {
                spread[after] += 1;
            } else {
                assert_eq!(after, before);
            }
        }
        // Node 3's keys spread over all nine others.
        assert!(
            spread
                .iter()
                .enumerate()
                .all(|(i, &n)| (i == 3) == (n == 0)),
            "{spread:?}"
        );
    }

    #[test]
    fn slow_start_admits_a_growing_set_of_keys() {
        let keys = keys();
        let admitted = |f: f64| keys.iter().filter(|k| k.admits(f)).count();
        let (a, b, c) = (admitted(0.1), admitted(0.5), admitted(1.0));
        assert!((1_700..2_300).contains(&a), "{a}");
        assert!((9_500..10_500).contains(&b), "{b}");
        assert_eq!(c, keys.len());
        // Monotone: a key admitted at 10% is admitted at 50%.
        assert!(keys.iter().all(|k| !k.admits(0.1) || k.admits(0.5)));
    }
}
