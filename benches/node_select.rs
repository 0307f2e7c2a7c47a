//! Node selection cost by policy and lane size: one `Choice::pick` (the call
//! each upstream attempt makes) for round_robin, least_request, hash and
//! random over 10, 100 and 1,000 nodes — flat in the node count — plus
//! round_robin with zone preference and with a node in slow start.
//!
//! `BENCH_CLOCK=cpu` times with this thread's CPU clock (a shared, busy
//! machine then does not inflate the figures); `BENCH_WARMUP_SECS` and
//! `BENCH_MEASURE_SECS` shorten the run.

use std::hint::black_box;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

mod common;
use common::{config, timed};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use graygate::config::{Balance, FORMAL};
use graygate::nodes::hash::{HashKey, KeyHash};
use graygate::nodes::health::NodeHealth;
use graygate::nodes::{Node, Select, Service};

fn service(n: usize, select: Select) -> Service {
    let nodes = (0..n)
        .map(|i| Node {
            name: format!("n{i}").into(),
            addr: SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8080)),
            lane: FORMAL.into(),
            weight: 1 + (i % 3) as u32,
            drain: false,
            zone: Some(if i % 2 == 0 { "a" } else { "b" }.into()),
        })
        .collect();
    Service::with_select("api", nodes, select)
}

fn bench(c: &mut Criterion) {
    let keys: Vec<KeyHash> = (0..1024)
        .map(|u| KeyHash::of(format!("user-{u}").as_bytes()))
        .collect();
    let ip: IpAddr = "10.0.0.1".parse().unwrap();
    let mut g = c.benchmark_group("node_select");
    for policy in [
        Balance::RoundRobin,
        Balance::LeastRequest,
        Balance::Hash,
        Balance::Random,
    ] {
        for n in [10usize, 100, 1000] {
            let select = Select {
                balance: policy,
                hash_key: Some(HashKey::ClientIp),
                ..Select::default()
            };
            let s = service(n, select);
            let now = graygate::base::clock::now_ms();
            let mut k = 0usize;
            g.bench_with_input(BenchmarkId::new(policy.as_str(), n), &n, |b, _| {
                timed(b, || {
                    let choice = s.choose(FORMAL, now).unwrap();
                    let key = (policy == Balance::Hash).then(|| keys[k % keys.len()]);
                    k += 1;
                    black_box(choice.pick(now, &[], key));
                })
            });
        }
    }
    // Zone preference (half the nodes local) and slow start (one node
    // warming) on the default policy.
    for n in [10usize, 100, 1000] {
        let zoned = service(
            n,
            Select {
                zone: Some("a".into()),
                ..Select::default()
            },
        );
        let mut warming = service(
            n,
            Select {
                slow_start_ms: 60_000,
                ..Select::default()
            },
        );
        let now = graygate::base::clock::now_ms();
        warming.attach_health(|addr| {
            Arc::new(if addr.ip().to_string().ends_with(".0") {
                NodeHealth::joined(now)
            } else {
                NodeHealth::default()
            })
        });
        g.bench_with_input(BenchmarkId::new("round_robin+zone", n), &n, |b, _| {
            timed(b, || {
                let choice = zoned.choose(FORMAL, now).unwrap();
                black_box(choice.pick(now, &[], None));
            })
        });
        g.bench_with_input(BenchmarkId::new("round_robin+slow_start", n), &n, |b, _| {
            timed(b, || {
                let choice = warming.choose(FORMAL, now).unwrap();
                black_box(choice.pick(now, &[], None));
            })
        });
    }
    // A retry: the first pick's node already tried.
    for n in [10usize, 1000] {
        let s = service(
            n,
            Select {
                balance: Balance::Hash,
                hash_key: Some(HashKey::ClientIp),
                ..Select::default()
            },
        );
        let now = graygate::base::clock::now_ms();
        let key = s.request_key(&http::HeaderMap::new(), &http::Uri::from_static("/"), ip);
        let first = s.choose(FORMAL, now).unwrap().pick(now, &[], key).unwrap();
        g.bench_with_input(BenchmarkId::new("hash_retry", n), &n, |b, _| {
            timed(b, || {
                let choice = s.choose(FORMAL, now).unwrap();
                black_box(choice.pick(now, &[first], key));
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench
}
criterion_main!(benches);
