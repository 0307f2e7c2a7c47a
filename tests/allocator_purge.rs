//! The allocator's side of giving memory back after a burst (`server::tidy`),
//! on mimalloc as the binary runs it: a collect soon after a burst keeps
//! none of the burst's freed memory resident beyond one small page (its
//! own size class's last page). Its own test binary: the resident size is
//! the process's, so no other test may run meanwhile.
#![forbid(unsafe_code)]

use graygate::server::tidy;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The process's resident size (bytes), from /proc/self/statm.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("statm's resident field");
    pages * 4096
}

/// Nudges every 100 ms (mimalloc purges a second after a free, at a
/// nudge) until the resident size is at most `limit` and has not moved
/// for 1.5 s, or 15 s have passed; the last size seen.
fn nudge_down_to(limit: u64) -> u64 {
    let start = Instant::now();
    let (mut last, mut since) = (rss(), Instant::now());
    loop {
        tidy::nudge();
        let now = rss();
        if now != last {
            (last, since) = (now, Instant::now());
        }
        let still = since.elapsed() > Duration::from_millis(1500);
        if (now <= limit && still) || start.elapsed() > Duration::from_secs(15) {
            return now;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A burst as a worker's: 12 MB of large blocks (a table or queue grown
/// with the connections), every byte written, and 5000 blocks above 1 KiB,
/// all freed. Blocks above 1 KiB take mimalloc's slow path and count its
/// housekeeping rounds: the page the last collect kept expires during the
/// burst, so the next collect takes a fresh page, which the arena carves
/// from the burst's freed (still resident) pages.
fn burst() {
    let large: Vec<Vec<u8>> = (0..60).map(|_| vec![7u8; 200 << 10]).collect();
    let small: Vec<Vec<u8>> = (0..5000).map(|_| Vec::with_capacity(2048)).collect();
    drop(std::hint::black_box((large, small)));
}

#[test]
fn a_collect_after_a_burst_keeps_none_of_its_freed_memory() {
    // On a thread of its own, as a worker is.
    std::thread::spawn(|| {
        burst();
        tidy::collect();
        let before = nudge_down_to(u64::MAX);
        burst();
        // The accept loop collects at its first tick after closes, and the
        // purge comes at the nudges past mimalloc's purge delay. A collect
        // that kept a 4 MiB page of its own there (its block was 256 KiB)
        // left up to 4 MB of the burst resident for good.
        tidy::collect();
        let limit = before + (1 << 20);
        let after = nudge_down_to(limit);
        assert!(
            after <= limit,
            "{} KiB resident after the burst's memory was purged, {} KiB before it",
            after >> 10,
            before >> 10
        );
    })
    .join()
    .unwrap();
}
