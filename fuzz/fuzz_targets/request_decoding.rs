//! Fuzzes a client's raw request bytes through the server side of the
//! HTTP/1.1 codec (head, framing, chunked body), fed in reads of several
//! sizes (`graygate::fuzz_entry::request_decoding` holds the checks).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = graygate::fuzz_entry::request_decoding(data);
});
