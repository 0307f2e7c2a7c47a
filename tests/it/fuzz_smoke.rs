//! Bounded, deterministic stable-Rust smoke run of the four fuzz entry
//! points (`graygate::fuzz_entry`, also driven by cargo-fuzz in `fuzz/`):
//! seed inputs plus seeded random mutations, checking that nothing panics
//! and that the entry points' invariants hold.

use std::path::Path;

use graygate::fuzz_entry::{load_config_input, request_decision, FILE_SEPARATOR};
use graygate::generation::Generation;

/// Tokens that tend to break parsers.
const TOKENS: &[&[u8]] = &[
    b"\n",
    b"\r\n",
    b": ",
    b"- ",
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b"'",
    b"\0",
    b"..",
    b"%2e",
    b"%252e",
    b"\\",
    b"/",
    b"#",
    b"-1",
    b"0",
    b"99999999999999999999",
    b"gray\r\nX: y",
    b"\xff\xfe",
    b"::",
    b"/33",
    b"  ",
    b"\t",
    b";",
    b"=",
    b",",
    b"end",
    b"return",
    b"(",
    b"X-Gray-Tag: ",
    b"Cookie: graygate_lane=gray.1.00",
    b"Host: other.example\r\n",
    b"X-Forwarded-For: 127.0.9.9, 1.2.3.4\r\n",
];

fn mutate(rng: &mut fastrand::Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = seeds[rng.usize(..seeds.len())].clone();
    for _ in 0..rng.usize(1..6) {
        match rng.u8(..6) {
            0 if !v.is_empty() => {
                let i = rng.usize(..v.len());
                v[i] ^= 1 << rng.u8(..8);
            }
            1 => {
                let i = rng.usize(..=v.len());
                let t = TOKENS[rng.usize(..TOKENS.len())];
                v.splice(i..i, t.iter().copied());
            }
            2 if !v.is_empty() => {
                let a = rng.usize(..v.len());
                let b = (a + rng.usize(..16)).min(v.len());
                v.drain(a..b);
            }
            3 if !v.is_empty() => v.truncate(rng.usize(..v.len())),
            4 => {
                // Splice in part of another seed.
                let o = &seeds[rng.usize(..seeds.len())];
                if !o.is_empty() {
                    let a = rng.usize(..o.len());
                    let i = rng.usize(..=v.len());
                    v.splice(i..i, o[a..].iter().copied().take(64));
                }
            }
            _ => {
                let i = rng.usize(..=v.len());
                v.insert(i, rng.u8(..));
            }
        }
    }
    v
}

fn seed_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seed"))
}

fn config_seed() -> Vec<u8> {
    let read = |n: &str| std::fs::read(seed_dir().join(n)).unwrap();
    let main = String::from_utf8(read("gg.yaml"))
        .unwrap()
        .replace("static: site", "service: api")
        .replace("sticky: true", "sticky: false");
    let mut v = main.into_bytes();
    for n in ["nodes.yaml", "ips.txt", "lane.lua", "rules.yaml"] {
        v.extend_from_slice(FILE_SEPARATOR);
        v.extend_from_slice(&read(n));
    }
    v
}

#[test]
fn config_loader_survives_mutated_configs() {
    let seed = config_seed();
    let dir = tempfile::tempdir().unwrap();
    // The seed itself loads.
    let gen = load_config_input(dir.path(), &seed).expect("seed paths are inside");
    gen.expect("seed config is valid");
    let seeds = vec![
        seed.clone(),
        b"listen: 127.0.0.1:0\nroutes:\n  - prefix: /\n    service: x\n".to_vec(),
        b"listen: 127.0.0.1:0\nupstream: { retries: 1 }\nclient: { max_connections: 1 }\n".to_vec(),
    ];
    let mut rng = fastrand::Rng::with_seed(0x6772_6179);
    let (mut ok, mut rejected, mut skipped) = (0, 0, 0);
    for _ in 0..400 {
        let input = mutate(&mut rng, &seeds);
        match load_config_input(dir.path(), &input) {
            Some(Ok(_)) => ok += 1,
            Some(Err(_)) => rejected += 1,
            None => skipped += 1,
        }
    }
    eprintln!("config inputs: {ok} loaded, {rejected} rejected, {skipped} skipped");
    assert!(ok > 0 && rejected > 0, "mutations exercise both paths");
}

#[test]
fn request_decision_survives_mutated_requests() {
    let gen = Generation::load(&seed_dir().join("gg.yaml"), 1).expect("seed config");
    let reqs: Vec<&[u8]> = vec![
        b"\x00GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n",
        b"\x01GET /api/x?lane=gray HTTP/1.1\r\nHost: a\r\nX-User-Id: 42\r\n\r\n",
        b"\x02GET / HTTP/1.1\r\nHost: a\r\nX-Gray-Tag: v2\r\n\r\n",
        b"\x03GET /%2e%2e/x HTTP/1.1\r\nHost: other.example\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n",
        b"\x00GET /index.html HTTP/1.1\r\nHost: a\r\nCookie: a=1; graygate_lane=gray.99999999999.deadbeef\r\n\r\n",
        b"\x00POST /v2/thing HTTP/1.1\r\nHost: a\r\nX-Lane: gray\r\nContent-Length: 0\r\n\r\n",
    ];
    let seeds: Vec<Vec<u8>> = reqs.iter().map(|r| r.to_vec()).collect();
    // The seeds decide as expected.
    assert_eq!(request_decision(&gen, &seeds[0]).unwrap().lane, "formal");
    assert_eq!(request_decision(&gen, &seeds[1]).unwrap().lane, "gray");
    assert_eq!(request_decision(&gen, &seeds[2]).unwrap().lane, "v2");
    assert_eq!(request_decision(&gen, &seeds[5]).unwrap().lane, "gray");
    let mut rng = fastrand::Rng::with_seed(0x6c61_6e65);
    let mut decided = 0;
    for _ in 0..5000 {
        let input = mutate(&mut rng, &seeds);
        if request_decision(&gen, &input).is_some() {
            decided += 1;
        }
    }
    eprintln!("request inputs: {decided} of 5000 reached a decision");
    // Most mutations are refused before routing (400/414/431: a repeated,
    // missing or mangled Host is one since the RFC 9112 checks); enough
    // still reach the lane and node choice to exercise them.
    assert!(decided > 400);
}

#[test]
fn the_response_codec_survives_mutated_node_answers() {
    use graygate::fuzz_entry::response_decoding;
    // (flags: bit 0 = HEAD request, read size, the node's bytes)
    let answers: Vec<&[u8]> = vec![
        b"\x00\x03HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\n",
        b"\x00\x05HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;e=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: t\r\n\r\nrest",
        b"\x00\x00HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        b"\x00\x02HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nold",
        b"\x00\x04HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the close",
        b"\x01\x01HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
        b"\x00\x09HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\nnext",
        b"\x00\x00HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\nb\r\nhello world\r\n0\r\n\r\n",
    ];
    let seeds: Vec<Vec<u8>> = answers.iter().map(|a| a.to_vec()).collect();
    // The seeds decode as the exchange reads them.
    let d = response_decoding(&seeds[0]).unwrap();
    assert_eq!((d.status, &d.body[..]), (200, &b"hello"[..]));
    assert_eq!(d.rest.as_deref(), Some(&b"HTTP/1.1 200 OK\r\n\r\n"[..]));
    let d = response_decoding(&seeds[1]).unwrap();
    assert_eq!(d.body, b"helloabcdefghijklmnopqrstuvwxyz");
    assert_eq!(d.rest.as_deref(), Some(&b"rest"[..]));
    assert_eq!(response_decoding(&seeds[2]).unwrap().status, 201);
    assert_eq!(response_decoding(&seeds[4]).unwrap().rest, None);
    assert!(response_decoding(&seeds[5]).unwrap().body.is_empty());
    let d = response_decoding(&seeds[7]).unwrap();
    assert!(d.fields.iter().all(|(n, _)| n != "content-length"), "{d:?}");
    // Broken framing is refused, whatever the reads.
    for bad in [
        &b"\x00\x01HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: a\n\r\n"[..],
        b"\x00\x00HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"\x00\x03HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello",
        b"\x00\x00HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
    ] {
        assert!(
            response_decoding(bad).is_none(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    let mut rng = fastrand::Rng::with_seed(0x636f_6465);
    let mut decoded = 0;
    for _ in 0..20_000 {
        let input = mutate(&mut rng, &seeds);
        if response_decoding(&input).is_some() {
            decoded += 1;
        }
    }
    eprintln!("response inputs: {decoded} of 20000 decoded");
    assert!(decoded > 1000, "mutations exercise the accepting paths");
}

#[test]
fn the_request_codec_survives_mutated_client_requests() {
    use graygate::fuzz_entry::request_decoding;
    // (read size, the client's bytes)
    let requests: Vec<&[u8]> = vec![
        b"\x03GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Gray: 1\r\n\r\nGET /next HTTP/1.1\r\n\r\n",
        b"\x05POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloGET /n HTTP/1.1\r\n\r\n",
        b"\x02POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\nrest",
        b"\x00GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"\x01POST /both HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX",
        b"\x04PUT /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nxyz",
        b"\x00POST /g HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    ];
    let seeds: Vec<Vec<u8>> = requests.iter().map(|r| r.to_vec()).collect();
    // The seeds decode as a connection reads them.
    let d = request_decoding(&seeds[0]).unwrap();
    assert_eq!((d.method.as_str(), d.target.as_str()), ("GET", "/a?b=1"));
    assert_eq!(d.rest, b"GET /next HTTP/1.1\r\n\r\n");
    let d = request_decoding(&seeds[1]).unwrap();
    assert_eq!(
        (&d.body[..], &d.rest[..]),
        (&b"hello"[..], &b"GET /n HTTP/1.1\r\n\r\n"[..])
    );
    let d = request_decoding(&seeds[2]).unwrap();
    assert_eq!((&d.body[..], &d.rest[..]), (&b"abcde"[..], &b"rest"[..]));
    assert!(request_decoding(&seeds[3]).unwrap().keep_alive);
    let d = request_decoding(&seeds[4]).unwrap();
    assert!(d.body.is_empty() && d.rest == b"X" && !d.keep_alive);
    assert!(d.fields.iter().all(|(n, _)| n != "content-length"), "{d:?}");
    assert_eq!(request_decoding(&seeds[5]).unwrap().body, b"xyz");
    assert!(request_decoding(&seeds[6]).unwrap().bad_te);
    // Broken heads and bodies are refused, whatever the reads.
    for bad in [
        &b"\x01POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n"
            [..],
        b"\x00POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"\x03GET / HTTP/1.1\r\nHost : x\r\n\r\n",
        b"\x00CONNECT x:1 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x02POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nshort",
    ] {
        assert!(
            request_decoding(bad).is_none(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    let mut rng = fastrand::Rng::with_seed(0x7265_7175);
    let mut decoded = 0;
    for _ in 0..20_000 {
        let input = mutate(&mut rng, &seeds);
        if request_decoding(&input).is_some() {
            decoded += 1;
        }
    }
    eprintln!("request inputs: {decoded} of 20000 decoded");
    assert!(decoded > 1000, "mutations exercise the accepting paths");
}

#[test]
fn the_chunked_encoder_round_trips_mutated_bodies() {
    use graygate::fuzz_entry::chunked_round_trip;
    // (the client's piece size, the decoder's read size, the body)
    let seeds: Vec<Vec<u8>> = vec![
        b"\x00\x00hello".to_vec(),
        b"\x01\x01abc".to_vec(),
        b"\x07\x03\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n".to_vec(),
        [&[16u8, 5][..], &[0u8; 300][..]].concat(),
        b"\x00\x02".to_vec(),
    ];
    let wire = chunked_round_trip(&seeds[0]).unwrap();
    assert_eq!(wire, b"5\r\nhello\r\n0\r\n\r\n");
    assert_eq!(chunked_round_trip(&seeds[4]).unwrap(), b"0\r\n\r\n");
    let mut rng = fastrand::Rng::with_seed(50);
    for _ in 0..3000 {
        let input = mutate(&mut rng, &seeds);
        if input.len() >= 2 {
            assert!(chunked_round_trip(&input).is_some());
        }
    }
}
