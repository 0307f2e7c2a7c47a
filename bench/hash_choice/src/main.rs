//! The `balance: hash` choice: per-pick cost and spread of three
//! consistent-hash tables over the same keys — Maglev (graygate's until
//! issue 33 item 15), weighted rendezvous (graygate's now; a copy of
//! `src/nodes/hash.rs`'s `Rendezvous`) and a ketama ring as nginx's
//! `hash … consistent` (160 points per unit of weight, binary search).
//!
//! `hash_choice spread [--quick]`: for 3, 10 and 100 nodes, equal weights
//! and weights 1, 2, 3, 1, 2, 3 …, each node's share of 1,000,000 keys
//! (`--quick`: 20,000) against its weight's (largest and rms deviation)
//! and how many of the survivors' keys move when node 0 is removed.
//!
//! `hash_choice cost <maglev|hrw|ring> <nodes> <0|1 weighted> <picks>`:
//! builds the table and makes `picks` picks over 1,024 keys; run it under
//! `valgrind --tool=callgrind` with 1 and 20,001 picks and divide the
//! difference of the totals by 20,000 for the instructions of one pick
//! (the driver's loop and indirect call included, a few instructions).

use std::hint::black_box;

fn key(u: u64) -> u64 {
    let (a, _) = mur3::murmurhash3_x64_128(format!("user-{u}").as_bytes(), 0);
    a.max(1)
}

// ---- Maglev (as src/nodes/hash.rs before rendezvous) ----
const TABLE: usize = 65_537;
struct Maglev {
    table: Vec<u32>,
}
impl Maglev {
    fn build(nodes: &[(u32, String, u32)]) -> Maglev {
        let size = TABLE;
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
    #[inline(never)]
    fn walk(&self, key: u64, members: usize, mut ok: impl FnMut(usize) -> bool) -> Option<usize> {
        let len = self.table.len();
        let start = (key % len as u64) as usize;
        let limit = len.min(64 + 4 * members);
        (0..limit)
            .map(|k| self.table[(start + k) % len] as usize)
            .find(|&i| ok(i))
    }
}

// ---- weighted rendezvous (as src/nodes/hash.rs) ----
#[derive(Debug, Clone, Copy)]
struct Member {
    lane: u32,
    seed: u64,
    inv_weight: f64,
}
struct Rendezvous {
    members: Vec<Member>,
    uniform: bool,
}

fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

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

impl Rendezvous {
    fn build(nodes: &[(u32, String, u32)]) -> Rendezvous {
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
    #[inline(never)]
    fn walk(&self, key: u64, mut ok: impl FnMut(usize) -> bool) -> Option<usize> {
        if self.uniform {
            let mut best: Option<(u64, u64, usize)> = None;
            for m in &self.members {
                let h = fmix64(key ^ m.seed);
                if best.is_none_or(|b| (h, m.seed) > (b.0, b.1)) && ok(m.lane as usize) {
                    best = Some((h, m.seed, m.lane as usize));
                }
            }
            best.map(|b| b.2)
        } else {
            let (mut best_d, mut best_seed, mut best) = (f64::INFINITY, 0, None);
            for m in &self.members {
                let h = fmix64(key ^ m.seed);
                let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
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
}

// ---- ketama ring (nginx `hash consistent`: 160 points per unit of weight) ----
struct Ring {
    points: Vec<(u32, u32)>,
}
impl Ring {
    fn build(nodes: &[(u32, String, u32)]) -> Ring {
        let mut points = Vec::new();
        for (lane, id, w) in nodes {
            for j in 0..160 * *w {
                let (a, _) = mur3::murmurhash3_x64_128(format!("{id}-{j}").as_bytes(), 0);
                points.push((a as u32, *lane));
            }
        }
        points.sort();
        Ring { points }
    }
    #[inline(never)]
    fn walk(&self, key: u64, mut ok: impl FnMut(usize) -> bool) -> Option<usize> {
        let h = key as u32;
        let start = self.points.partition_point(|p| p.0 < h);
        let len = self.points.len();
        (0..len)
            .map(|k| self.points[(start + k) % len].1 as usize)
            .find(|&i| ok(i))
    }
}

fn nodes(n: u32, weighted: bool) -> Vec<(u32, String, u32)> {
    (0..n)
        .map(|i| {
            let w = if weighted { 1 + i % 3 } else { 1 };
            (i, format!("10.0.{}.{}:8080", i >> 8, i & 255), w)
        })
        .collect()
}

fn picker(algo: &str, nodes: &[(u32, String, u32)]) -> Box<dyn Fn(u64) -> Option<usize>> {
    let n = nodes.len();
    match algo {
        "maglev" => {
            let t = Maglev::build(nodes);
            Box::new(move |k| t.walk(k, n, |_| true))
        }
        "hrw" => {
            let t = Rendezvous::build(nodes);
            Box::new(move |k| t.walk(k, |_| true))
        }
        "ring" => {
            let t = Ring::build(nodes);
            Box::new(move |k| t.walk(k, |_| true))
        }
        _ => panic!("algorithm: maglev, hrw or ring"),
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.get(1).map(String::as_str) == Some("cost") {
        let n: u32 = a[3].parse().unwrap();
        let pick = picker(&a[2], &nodes(n, a[4] == "1"));
        let picks: u64 = a[5].parse().unwrap();
        let keys: Vec<u64> = (0..1024).map(key).collect();
        let mut acc = 0usize;
        for p in 0..picks {
            acc = acc.wrapping_add(black_box(pick(black_box(keys[(p % 1024) as usize]))).unwrap());
        }
        println!("{acc}");
        return;
    }
    assert_eq!(
        a.get(1).map(String::as_str),
        Some("spread"),
        "spread [--quick] | cost …"
    );
    let nk: u64 = if a.iter().any(|x| x == "--quick") {
        20_000
    } else {
        1_000_000
    };
    let ks: Vec<u64> = (0..nk).map(key).collect();
    for algo in ["maglev", "hrw", "ring"] {
        for n in [3u32, 10, 100] {
            for weighted in [false, true] {
                let all = nodes(n, weighted);
                let pick = picker(algo, &all);
                let total_w: u32 = all.iter().map(|x| x.2).sum();
                let before: Vec<usize> = ks.iter().map(|&k| pick(k).unwrap()).collect();
                let mut count = vec![0u64; n as usize];
                for &b in &before {
                    count[b] += 1;
                }
                let dev: Vec<f64> = count
                    .iter()
                    .zip(&all)
                    .map(|(&c, x)| c as f64 / (nk as f64 * x.2 as f64 / total_w as f64) - 1.0)
                    .collect();
                let max_dev = dev.iter().fold(0.0f64, |m, d| m.max(d.abs()));
                let rms = (dev.iter().map(|d| d * d).sum::<f64>() / dev.len() as f64).sqrt();
                let rest = picker(algo, &all[1..]);
                let moved = ks
                    .iter()
                    .zip(&before)
                    .filter(|(&k, &b)| b != 0 && rest(k).unwrap() != b)
                    .count();
                println!(
                    "{algo} {n} nodes {}: share/fair - 1 max {:.2} % rms {:.2} %; removing node 0 moved {moved} survivors' keys",
                    if weighted { "weighted" } else { "equal" },
                    max_dev * 100.0,
                    rms * 100.0
                );
            }
        }
    }
}
