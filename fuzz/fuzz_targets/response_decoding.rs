//! Fuzzes a node's raw response bytes → the upstream HTTP/1.1 response
//! codec (head, interim 1xx, framing, chunked body and trailers), read all
//! at once and in small reads: the same verdict and message either way, no
//! hop-by-hop field or CR/LF passed on, what follows the message intact.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = graygate::fuzz_entry::response_decoding(data);
});
