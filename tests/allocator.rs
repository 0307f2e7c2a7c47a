//! The allocator's side of giving memory back (`server::tidy`), on mimalloc
//! as the binary runs it: a burst of blocks in many size classes, all
//! freed, leaves a page per size class with the thread (mimalloc retires
//! the last page of a class instead of freeing it), and `tidy::collect`
//! frees them. Its own test binary: mimalloc's page count is the
//! process's, so no other test may allocate meanwhile.
#![forbid(unsafe_code)]

use graygate::server::tidy;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's count of pages in use (the process's).
fn pages() -> u64 {
    let json = mimalloc::MiMalloc::stats_json().expect("mimalloc's statistics");
    let v: serde_json::Value =
        serde_json::from_str(json.to_str().expect("UTF-8")).expect("mimalloc's JSON");
    v["pages"]["current"]
        .as_u64()
        .unwrap_or_else(|| panic!("no pages.current in {v}"))
}

/// Blocks of 40 size classes (16 B to 8 KiB), 2000 of each, all freed.
fn burst() {
    let blocks: Vec<Vec<u8>> = (0..80_000)
        .map(|i| {
            let mut b = Vec::with_capacity(16 + (i % 40) * 200);
            b.push(1);
            b
        })
        .collect();
    drop(std::hint::black_box(blocks));
}

#[test]
fn collect_frees_the_pages_a_burst_left_with_the_thread() {
    // On a thread of its own, as a worker is.
    std::thread::spawn(|| {
        burst();
        tidy::collect();
        let before = pages();
        burst();
        let left = pages();
        assert!(
            left >= before + 10,
            "the burst's size classes kept no pages ({before} before, {left} after): \
             the test no longer shows what collect is for"
        );
        tidy::collect();
        let after = pages();
        assert!(
            after <= before + 2,
            "collect left {after} pages in use, {before} before the burst"
        );
    })
    .join()
    .unwrap();
}
