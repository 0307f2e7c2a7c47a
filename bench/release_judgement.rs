//! The release judgement's simulation benchmark: seeded simulated traffic
//! replayed through the real analysis (`control::release::analysis`), with
//! continuous monitoring (a look every few requests, far more often than
//! any release interval).
//!
//! - **A/A:** releases of 5 steps, gray and formal drawn from the same
//!   distributions (latency: lognormal, one request in 50 from a Pareto
//!   tail; 0.1 % errors): the share of releases with a failed look (a
//!   rollback needs two; this counts one) must stay under 1 %.
//! - **Detection:** a gray 8× slower, one at 5.1 % errors, one at 1.1 %
//!   (formal 0.1 %), at a 50 % step: gray requests until the first failed
//!   look, median and 95th percentile.
//!
//! `cargo run --example release_judgement -- [--releases N] [--trials N]
//! [--step-requests N] [--look N] [--seed N]` (results page:
//! docs/src/benchmarks/release-judgement.md).

use std::time::{Duration, Instant};

use graygate::config::release::AnalysisSpec;
use graygate::control::release::analysis::{decide, step_alpha};
use graygate::observe::lanes::{bucket_of, LaneSnapshot, BUCKETS};

/// xorshift64: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        (-2.0 * self.unit().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.unit()).cos()
    }
}

/// A lane's behaviour: median latency (ms) and error rate.
#[derive(Clone, Copy)]
struct Lane {
    median_ms: f64,
    error_rate: f64,
}

impl Lane {
    /// Lognormal (σ 0.5) around the median; one request in 50 from a
    /// Pareto tail (shape 1.5) starting at 3 × the median; at most 60 s.
    fn latency_ms(&self, rng: &mut Rng) -> f64 {
        let ms = if rng.unit() < 0.02 {
            self.median_ms * 3.0 * rng.unit().powf(-1.0 / 1.5)
        } else {
            self.median_ms * (0.5 * rng.normal()).exp()
        };
        ms.min(60_000.0)
    }

    fn serve(&self, rng: &mut Rng, s: &mut LaneSnapshot) {
        s.requests += 1;
        s.errors += u64::from(rng.unit() < self.error_rate);
        let ms = self.latency_ms(rng);
        s.buckets[bucket_of(Duration::from_secs_f64(ms / 1000.0))] += 1;
    }
}

fn empty() -> LaneSnapshot {
    LaneSnapshot {
        requests: 0,
        errors: 0,
        buckets: vec![0; BUCKETS],
    }
}

/// One step at `weight` % of `requests`, looked at every `look` requests:
/// the gray requests at the first failed look, if any.
#[allow(clippy::too_many_arguments)]
fn step(
    rng: &mut Rng,
    a: &AnalysisSpec,
    alpha: f64,
    weight: f64,
    requests: u64,
    look: u64,
    gray: Lane,
    formal: Lane,
) -> Option<u64> {
    let (mut g, mut f) = (empty(), empty());
    for i in 1..=requests {
        if rng.unit() * 100.0 < weight {
            gray.serve(rng, &mut g);
        } else {
            formal.serve(rng, &mut f);
        }
        if i % look == 0 && decide(a, Some(&g), Some(&f), alpha, false).outcome == "fail" {
            return Some(g.requests);
        }
    }
    None
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let releases = arg("--releases", 1000);
    let trials = arg("--trials", 500);
    let step_requests = arg("--step-requests", 3000);
    let look = arg("--look", 25);
    let mut rng = Rng(arg("--seed", 1).max(1));
    let a = AnalysisSpec::default();
    let weights = [5.0, 10.0, 25.0, 50.0, 75.0];
    let alpha = step_alpha(weights.len());
    let healthy = Lane {
        median_ms: 20.0,
        error_rate: 0.001,
    };
    let started = Instant::now();
    let mut failed = 0;
    for _ in 0..releases {
        if weights.iter().any(|w| {
            step(
                &mut rng,
                &a,
                alpha,
                *w,
                step_requests,
                look,
                healthy,
                healthy,
            )
            .is_some()
        }) {
            failed += 1;
        }
    }
    println!(
        "A/A: {releases} releases of {} steps ({step_requests} requests a step, a look every {look}): {failed} with a failed look ({:.2} %) [{:.0} s]",
        weights.len(),
        100.0 * failed as f64 / releases as f64,
        started.elapsed().as_secs_f64()
    );
    let cases = [
        (
            "8x slower",
            Lane {
                median_ms: 160.0,
                ..healthy
            },
            5,
        ),
        (
            "errors 0.1 % -> 5.1 %",
            Lane {
                error_rate: 0.051,
                ..healthy
            },
            10,
        ),
        (
            "errors 0.1 % -> 1.1 %",
            Lane {
                error_rate: 0.011,
                ..healthy
            },
            25,
        ),
    ];
    for (name, gray, look) in cases {
        let started = Instant::now();
        let mut at: Vec<u64> = Vec::new();
        let mut missed = 0;
        for _ in 0..trials {
            match step(&mut rng, &a, alpha, 50.0, 100_000, look, gray, healthy) {
                Some(n) => at.push(n),
                None => missed += 1,
            }
        }
        at.sort_unstable();
        if at.is_empty() {
            println!("{name}: no trial failed within 100000 requests");
            continue;
        }
        println!(
            "{name}: gray requests to the first failed look (50 % step, a look every {look}): median {}, p95 {}, max {} over {} trials ({missed} not failed within 100000 requests) [{:.0} s]",
            percentile(&at, 0.5),
            percentile(&at, 0.95),
            at.last().unwrap(),
            trials,
            started.elapsed().as_secs_f64()
        );
    }
}
