//! The allocator's side of giving memory back (`base::tidy`), on mimalloc
//! as the binary runs it: a burst of blocks in many size classes, all
//! freed, leaves a page per size class with the thread (mimalloc retires
//! the last page of a class instead of freeing it), and `tidy::collect`
//! frees them. Its own test binary: mimalloc's page count is the
//! process's, so no other test may allocate meanwhile.
#![forbid(unsafe_code)]

use graygate::base::tidy;

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

/// One test at a time: mimalloc's counts are the process's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn collect_frees_the_pages_a_burst_left_with_the_thread() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
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

/// mimalloc's count of pages abandoned so far (the process's).
fn abandoned() -> u64 {
    let json = mimalloc::MiMalloc::stats_json().expect("mimalloc's statistics");
    let v: serde_json::Value =
        serde_json::from_str(json.to_str().expect("UTF-8")).expect("mimalloc's JSON");
    v["pages_abandoned"]["total"]
        .as_u64()
        .unwrap_or_else(|| panic!("no pages_abandoned.total in {v}"))
}

/// Fills many pages of one size class on a thread of its own (as a
/// worker's burst does) and prints how many pages mimalloc abandoned.
/// Run by [`full_pages_stay_with_their_thread_under_graygates_option`] in
/// a child process, whose environment mimalloc reads as it loads.
#[test]
#[ignore = "run by full_pages_stay_with_their_thread_under_graygates_option"]
fn fill_pages_and_count_the_abandoned() {
    let n = std::thread::spawn(|| {
        let before = abandoned();
        let blocks: Vec<Box<[u8; 64]>> = (0..100_000).map(|_| Box::new([1u8; 64])).collect();
        let n = abandoned() - before;
        drop(std::hint::black_box(blocks));
        n
    })
    .join()
    .unwrap();
    println!("abandoned={n}");
}

/// What a child running [`fill_pages_and_count_the_abandoned`] with
/// `env` printed.
fn abandoned_in_child(env: Option<(&str, &str)>) -> u64 {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "fill_pages_and_count_the_abandoned",
        "--nocapture",
        "--test-threads=1",
    ])
    .env_remove("MIMALLOC_PAGE_FULL_RETAIN");
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let n = text
        .split("abandoned=")
        .nth(1)
        .unwrap_or_else(|| panic!("no abandoned= in {text}"));
    n[..n.find(|c: char| !c.is_ascii_digit()).unwrap_or(n.len())]
        .parse()
        .unwrap_or_else(|_| panic!("no count after abandoned= in {text}"))
}

/// The option graygate runs itself with (src/main.rs, `ALLOC_OPTION`):
/// mimalloc's default abandons full pages to the shared arena, where a
/// worker that frees most of their blocks does not allocate from them
/// again (a burst's scattered survivors keep them resident); with
/// `MIMALLOC_PAGE_FULL_RETAIN=-1` they stay with their thread.
#[test]
fn full_pages_stay_with_their_thread_under_graygates_option() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let by_default = abandoned_in_child(None);
    assert!(
        by_default > 10,
        "mimalloc's default abandoned {by_default} full pages: the test no longer shows \
         what the option is for"
    );
    assert_eq!(
        abandoned_in_child(Some(("MIMALLOC_PAGE_FULL_RETAIN", "-1"))),
        0,
        "full pages were abandoned under MIMALLOC_PAGE_FULL_RETAIN=-1"
    );
}
