//! Fuzzes the whole config loader: main file, node file, IP list and Lua
//! script (separated by `graygate::fuzz_entry::FILE_SEPARATOR`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let _ = graygate::fuzz_entry::load_config_input(dir.path(), data);
});
