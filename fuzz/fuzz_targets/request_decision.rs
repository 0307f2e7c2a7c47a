//! Fuzzes raw request bytes → route → lane decision (trusted tag, Lua
//! script, sticky cookie) → candidate set / static path, under a fixed
//! generation built from the seed config in `fuzz/seed/`.
#![no_main]

use std::sync::OnceLock;

use graygate::generation::Generation;
use libfuzzer_sys::fuzz_target;

fn generation() -> &'static Generation {
    static GEN: OnceLock<Generation> = OnceLock::new();
    GEN.get_or_init(|| {
        let seed = concat!(env!("CARGO_MANIFEST_DIR"), "/seed/gg.yaml");
        Generation::load(std::path::Path::new(seed), 1).expect("seed config loads")
    })
}

fuzz_target!(|data: &[u8]| {
    let _ = graygate::fuzz_entry::request_decision(generation(), data);
});
