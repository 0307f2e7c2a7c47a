//! Shared by the criterion benches: the clock choice (`BENCH_CLOCK=cpu`)
//! and the run length (`BENCH_WARMUP_SECS`, `BENCH_MEASURE_SECS`).

use std::time::Duration;

use criterion::Criterion;

/// Runs `f` per iteration, timed by the wall clock or (`BENCH_CLOCK=cpu`)
/// by this thread's CPU clock.
pub fn timed(b: &mut criterion::Bencher<'_>, mut f: impl FnMut()) {
    if std::env::var("BENCH_CLOCK").as_deref() == Ok("cpu") {
        b.iter_custom(|iters| {
            let start = cpu_time::ThreadTime::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed()
        })
    } else {
        b.iter(f)
    }
}

/// Criterion with the warm-up and measurement times the environment asks for.
pub fn config() -> Criterion {
    let secs = |var: &str, default: u64| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Criterion::default()
        .warm_up_time(Duration::from_secs(secs("BENCH_WARMUP_SECS", 1)))
        .measurement_time(Duration::from_secs(secs("BENCH_MEASURE_SECS", 3)))
}
