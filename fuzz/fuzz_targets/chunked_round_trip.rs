//! Fuzzes a request body → the chunked encoder the node connections send a
//! body of unknown length with → the strict decoder, at any piece and read
//! size: the body comes back exact and what follows the last chunk intact.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = graygate::fuzz_entry::chunked_round_trip(data);
});
