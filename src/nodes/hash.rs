//! Layer: nodes. Consistent hashing for `balance: hash`: the request key
//! (`hash_key`: a header, a cookie, a query argument or the client IP), its
//! MurmurHash3 (x64 128, first 64 bits; stable across builds and gateways,
//! so every replica pins a key to the same node), and a weighted Maglev
//! table.
//!
//! Why Maglev rather than a ketama ring: a lookup is one table index however
//! many nodes the lane has (a ring is a binary search over nodes × points),
//! the spread over nodes is even (the table keeps about 100 entries a
//! node), and it is weighted the way Envoy's is. Adding or removing one of
//! N nodes moves about 1/N of the keys (a little more than a ring's
//! minimum; the tests below bound it). Nodes are identified by address, not by name: default
//! names carry an index that shifts when a node is removed.

use std::fmt;
use std::net::IpAddr;
use std::num::NonZeroU64;
use std::str::FromStr;

use http::{HeaderMap, HeaderName, Uri};

/// Entries of a Maglev table (a prime; Envoy's default). Lanes of more than
/// [`SMALL_TABLE_NODES`] nodes use [`LARGE_TABLE`] so that every node keeps
/// about 100 entries.
pub const TABLE: usize = 65_537;
pub const SMALL_TABLE_NODES: usize = 655;
pub const LARGE_TABLE: usize = 655_373;

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
/// (seed 0), never 0 (so `Option<KeyHash>` is one word). It picks the table
/// entry; a remix of it decides slow-start admission.
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
        // table position.
        let mut z = self.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        factor >= 1.0 || ((z >> 11) as f64 / (1u64 << 53) as f64) < factor
    }
}

/// A weighted Maglev lookup table of lane-node indices.
#[derive(Debug)]
pub struct Maglev {
    table: Vec<u32>,
}

impl Maglev {
    /// Builds the table over `(lane index, identity, weight)` entries:
    /// every node fills the table along its own permutation (offset and
    /// skip from its identity's hash), heavier nodes more often (Envoy's
    /// weighted construction).
    pub fn build(nodes: &[(u32, String, u32)]) -> Maglev {
        let size = if nodes.len() > SMALL_TABLE_NODES {
            LARGE_TABLE
        } else {
            TABLE
        };
        if nodes.iter().all(|n| n.2 == 0) {
            return Maglev { table: Vec::new() };
        }
        let mut table = vec![u32::MAX; size];
        let perm: Vec<(u64, u64)> = nodes
            .iter()
            .map(|(_, id, _)| {
                let (a, b) = mur3::murmurhash3_x64_128(id.as_bytes(), 0x6d61_676c);
                (a % size as u64, b % (size as u64 - 1) + 1)
            })
            .collect();
        let max_w = nodes
            .iter()
            .map(|n| u64::from(n.2))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut next = vec![0u64; nodes.len()];
        let mut target = vec![0u64; nodes.len()];
        let mut filled = 0usize;
        let mut round = 1u64;
        while filled < size {
            for (n, (idx, _, w)) in nodes.iter().enumerate() {
                if filled == size {
                    break;
                }
                // A node of weight max_w fills one entry a round, one of
                // weight max_w / 3 every third round.
                if round * u64::from(*w) < target[n] || *w == 0 {
                    continue;
                }
                target[n] += max_w;
                let (offset, skip) = perm[n];
                loop {
                    let c = ((offset + skip * next[n]) % size as u64) as usize;
                    next[n] += 1;
                    if table[c] == u32::MAX {
                        table[c] = *idx;
                        filled += 1;
                        break;
                    }
                }
            }
            round += 1;
        }
        Maglev { table }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The key's node: its entry, or the first entry after it that `ok`
    /// accepts (looking at no more than a bounded number of entries;
    /// `None` then, and the caller scans the members).
    pub fn walk(
        &self,
        key: KeyHash,
        members: usize,
        mut ok: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let len = self.table.len();
        if len == 0 {
            return None;
        }
        let start = (key.get() % len as u64) as usize;
        let limit = len.min(64 + 4 * members);
        (0..limit)
            .map(|k| self.table[(start + k) % len] as usize)
            .find(|&i| ok(i))
    }

    /// The key's node with every node acceptable.
    pub fn lookup(&self, key: KeyHash) -> Option<usize> {
        self.walk(key, 0, |_| true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(ids: &[u32]) -> Maglev {
        let entries: Vec<(u32, String, u32)> = ids
            .iter()
            .map(|&i| (i, format!("10.0.0.{i}:80"), 1))
            .collect();
        Maglev::build(&entries)
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
    fn maglev_spreads_keys_evenly() {
        let t = table(&(0..10).collect::<Vec<_>>());
        let mut c = [0usize; 10];
        for k in keys() {
            c[t.lookup(k).unwrap()] += 1;
        }
        for n in c {
            assert!((1_600..2_400).contains(&n), "{c:?}");
        }
    }

    #[test]
    fn weighted_maglev_follows_weights() {
        let entries: Vec<(u32, String, u32)> = (0..4)
            .map(|i| (i, format!("10.0.0.{i}:80"), if i == 0 { 3 } else { 1 }))
            .collect();
        let t = Maglev::build(&entries);
        let heavy = t.table.iter().filter(|&&i| i == 0).count();
        // 3 / 6 of the table, within 1%.
        assert!(
            (heavy as f64 / t.len() as f64 - 0.5).abs() < 0.01,
            "{heavy}"
        );
    }

    #[test]
    fn adding_or_removing_one_of_n_nodes_moves_about_one_nth_of_keys() {
        let keys = keys();
        let ten = table(&(0..10).collect::<Vec<_>>());
        let eleven = table(&(0..11).collect::<Vec<_>>());
        let nine = table(&(1..10).collect::<Vec<_>>());
        let before: Vec<usize> = keys.iter().map(|&k| ten.lookup(k).unwrap()).collect();
        // Add node 10: about 1/11 of the keys move, nearly all of them to it.
        let mut moved = 0;
        let mut to_new = 0;
        for (k, &b) in keys.iter().zip(&before) {
            let a = eleven.lookup(*k).unwrap();
            if a != b {
                moved += 1;
                to_new += usize::from(a == 10);
            }
        }
        let share = moved as f64 / keys.len() as f64;
        assert!(
            share > 1.0 / 11.0 * 0.8 && share < 1.0 / 11.0 * 1.3,
            "{share}"
        );
        assert!(to_new as f64 > 0.9 * moved as f64, "{to_new} of {moved}");
        // Remove node 0: its keys move (spread), few others do.
        let mut others_moved = 0;
        let mut own = 0;
        for (k, &b) in keys.iter().zip(&before) {
            let a = nine.lookup(*k).unwrap();
            if b == 0 {
                own += 1;
                assert_ne!(a, 0);
            } else if a != b {
                others_moved += 1;
            }
        }
        let share = (own + others_moved) as f64 / keys.len() as f64;
        assert!(
            share > 1.0 / 10.0 * 0.8 && share < 1.0 / 10.0 * 1.3,
            "{share}"
        );
        assert!(
            (others_moved as f64) < 0.03 * keys.len() as f64,
            "{others_moved}"
        );
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
                        addr,
                        lane: FORMAL.into(),
                        weight: 1,
                        drain: false,
                        zone: None,
                    };
                    Node::from_config("api", i, &c)
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
            // A rebuilt Maglev table hands a few of a survivor's entries to
            // the other survivor (not a ring's exact minimum); a survivor
            // identified by anything but its address loses most of them.
            assert!(
                moved * 100 <= survivors_keys,
                "removing {gone} moved {moved} of the survivors' {survivors_keys} keys"
            );
            // The removed node's keys spread over both survivors.
            assert_eq!(spread.len(), 2, "{gone}: {spread:?}");
        }
    }

    #[test]
    fn a_missing_node_moves_only_its_own_keys() {
        // Walking past a node that is down (no table rebuild): keys of the
        // other nodes stay exactly where they were.
        let keys = keys();
        let t = table(&(0..10).collect::<Vec<_>>());
        let mut spread = [0usize; 10];
        for &k in &keys {
            let before = t.lookup(k).unwrap();
            let after = t.walk(k, 10, |i| i != 3).unwrap();
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
