//! Layer: tools (top; uses the data plane's phases, never the control plane).
//! Entry points shared by the cargo-fuzz targets in `fuzz/` and the bounded
//! stable-Rust smoke test (`tests/it/fuzz_smoke.rs`): config files → loader,
//! raw request bytes → route and lane decision, and a node's raw response
//! bytes → the upstream HTTP/1.1 response codec, and a request body → the
//! chunked encoder the node connections send with → the strict decoder.
//! Each checks invariants and panics when one breaks, which is what a
//! fuzzer looks for.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Component, Path};

use http::{HeaderName, HeaderValue, Method, Request, Uri};

use crate::base::decision::Decision;
use crate::config::{parse_yaml, valid_lane, ConfigError, MainConfig};
use crate::generation::{Generation, Target};
use crate::lane::decide_on_route;
use crate::proxy::resolve::{filter_underscores, resolve_request, validate};

/// Separates the files inside one fuzz input.
pub const FILE_SEPARATOR: &[u8] = b"\n%%%%\n";

/// The files a config input is split into, in order.
pub const FILES: [&str; 5] = ["gg.yaml", "nodes.yaml", "ips.txt", "lane.lua", "rules.yaml"];

fn relative_inside(p: &Path) -> bool {
    p.components().all(|c| matches!(c, Component::Normal(_)))
}

/// Splits `data` into the main file, a node file, an IP list, a Lua script
/// and a rule file, writes them into `dir` and loads a generation from them. Inputs
/// whose main file names paths outside `dir` are skipped (`None`): the
/// loader would read them, which is not what is being fuzzed.
pub fn load_config_input(dir: &Path, data: &[u8]) -> Option<Result<Generation, ConfigError>> {
    let mut parts: Vec<&[u8]> = Vec::new();
    let mut rest = data;
    while parts.len() < FILES.len() - 1 {
        match rest
            .windows(FILE_SEPARATOR.len())
            .position(|w| w == FILE_SEPARATOR)
        {
            Some(i) => {
                parts.push(&rest[..i]);
                rest = &rest[i + FILE_SEPARATOR.len()..];
            }
            None => break,
        }
    }
    parts.push(rest);
    let main_text = String::from_utf8_lossy(parts[0]);
    if let Ok(cfg) = parse_yaml::<MainConfig>(Path::new("gg.yaml"), &main_text) {
        let mut paths: Vec<&Path> = cfg.lists.values().map(|p| p.as_path()).collect();
        paths.extend(cfg.node_files.iter().map(|p| p.as_path()));
        paths.extend(cfg.script.iter().map(|p| p.as_path()));
        paths.extend(cfg.rules_file.iter().map(|p| p.as_path()));
        paths.extend(cfg.root.iter().map(|p| p.as_path()));
        paths.extend(cfg.routes.iter().filter_map(|r| r.static_root.as_deref()));
        if !paths.into_iter().all(relative_inside) {
            return None;
        }
    }
    for (name, part) in FILES.iter().zip(parts.iter()) {
        std::fs::write(dir.join(name), part).ok()?;
    }
    let main = dir.join(FILES[0]);
    let result = Generation::load(&main, 1);
    if let Err(e) = &result {
        // Every error names the file it is about.
        let text = e.to_string();
        assert!(
            text.starts_with(&*e.file.to_string_lossy()),
            "error without its file: {text}"
        );
        if let Some(l) = e.line {
            assert!(l >= 1, "line numbers are 1-based: {text}");
        }
    }
    Some(result)
}

/// Parses raw request bytes like the HTTP/1 server would, then routes and
/// decides the lane under `gen`. The first byte picks the peer address
/// (odd = inside 127.0.9.0/24) and whether the peer is treated as trusted.
/// Returns `None` for bytes that are not a complete, valid request head.
pub fn request_decision(gen: &Generation, data: &[u8]) -> Option<Decision> {
    let (&sel, raw) = data.split_first()?;
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut parsed = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(_) = parsed.parse(raw).ok()? else {
        return None;
    };
    let method = Method::from_bytes(parsed.method?.as_bytes()).ok()?;
    let uri: Uri = parsed.path?.parse().ok()?;
    let mut req = Request::builder().method(method).uri(uri).body(()).ok()?;
    for h in parsed.headers.iter() {
        let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return None;
        };
        req.headers_mut().append(n, v);
    }
    filter_underscores(&mut req, &gen.config.client, &gen.lane.tag_header);
    if let Some(kind) = validate(&mut req, &gen.config.client, &gen.lane.tag_header) {
        assert!(crate::base::error::Error::new(kind)
            .status()
            .is_client_error());
        return None;
    }
    let peer = IpAddr::V4(if sel & 1 == 1 {
        Ipv4Addr::new(127, 0, 9, sel)
    } else {
        Ipv4Addr::LOCALHOST
    });
    let (parts, ()) = req.into_parts();
    let mut info = resolve_request(parts, peer, &gen.trusted);
    info.peer_trusted = sel & 2 == 2;
    let route = gen.route(&info.host, info.parts.uri.path())?;
    let decided = decide_on_route(&gen.lane, route.sticky, info);
    let (info, decision) = (decided.info, decided.decision);
    if let Some(c) = decided.set_cookie {
        assert!(c.to_str().is_ok());
    }
    // The lane always becomes a valid header value.
    assert!(valid_lane(&decision.lane), "{:?}", decision.lane);
    HeaderValue::from_str(&decision.lane).expect("lane is header-safe");
    match &route.target {
        Target::Service(name) => {
            if let Some(svc) = gen.services.get(&**name) {
                if let Ok(c) = svc.choose(&decision.lane, crate::base::clock::now_ms()) {
                    // Never another gray lane.
                    let set_lane = &c.set.nodes[0].lane;
                    assert!(**set_lane == *decision.lane || &**set_lane == crate::config::FORMAL);
                }
            }
        }
        Target::Static(tree) => {
            if let Some(rel) =
                crate::static_files::safe_relative(info.parts.uri.path(), &tree.index)
            {
                assert!(relative_inside(&rel), "{rel:?} escapes the tree");
            }
        }
    }
    Some(decision)
}

/// A node's raw response (`data[0]` bit 0: the request was HEAD; `data[1]`:
/// the size of the connection's reads, 0 for all at once; the rest: the
/// bytes) through the upstream response codec. Checks that the verdict and
/// the message do not depend on how the bytes were split into reads, that
/// no hop-by-hop field and no CR or LF is passed on, that a length-framed
/// body is its length, and that what follows the message is the input's
/// tail. Returns the decoded message.
pub fn response_decoding(data: &[u8]) -> Option<crate::upstream::Decoded> {
    let (&flags, rest) = data.split_first()?;
    let (&piece, wire) = rest.split_first()?;
    let head_request = flags & 1 == 1;
    let decode = |piece: usize| crate::upstream::decode_response(wire, piece, head_request);
    let whole = decode(wire.len());
    for piece in [usize::from(piece), 1, 7] {
        if piece == 0 {
            continue;
        }
        let split = decode(piece);
        assert_eq!(
            whole.as_ref().ok(),
            split.as_ref().ok(),
            "reads of {piece} bytes decode otherwise: {whole:?} vs {split:?}"
        );
    }
    let d = whole.ok()?;
    for (name, value) in &d.fields {
        assert!(
            !crate::upstream::fields::is_hop_by_hop(name.as_bytes()),
            "hop-by-hop {name} passed on: {:?}",
            String::from_utf8_lossy(wire)
        );
        assert!(
            !value.iter().any(|&b| b == b'\r' || b == b'\n'),
            "CR or LF in {name}"
        );
    }
    if let Some(rest) = &d.rest {
        assert!(wire.ends_with(rest), "the rest is not the input's tail");
        assert!(d.body.len() + rest.len() <= wire.len());
    }
    Some(d)
}

/// A client's raw request (`data[0]`: the size of the connection's reads,
/// 0 for all at once; the rest: the bytes) through the server side of the
/// HTTP/1.1 codec. Checks that the verdict and the message do not depend on
/// how the bytes were split into reads, that no field value holds a CR, LF
/// or NUL, that a length-framed body is its length, that a chunked body
/// never carries its framing's bytes when the chunks hold none, and that
/// what follows the message is the input's tail. Returns the decoded
/// request.
pub fn request_decoding(data: &[u8]) -> Option<crate::server::DecodedRequest> {
    let (&piece, wire) = data.split_first()?;
    let decode = |piece: usize| crate::server::decode_request(wire, piece);
    let whole = decode(wire.len());
    for piece in [usize::from(piece), 1, 7] {
        if piece == 0 {
            continue;
        }
        let split = decode(piece);
        assert_eq!(whole, split, "reads of {piece} bytes decode otherwise");
    }
    let d = whole.ok()?;
    for (name, value) in &d.fields {
        assert!(
            !value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
            "{name}: a value with CR, LF or NUL passed: {value:?}"
        );
    }
    let length = d
        .fields
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<usize>().ok());
    let chunked = d.fields.iter().any(|(n, _)| n == "transfer-encoding");
    if let (Some(len), false, false) = (length, chunked, d.bad_te) {
        assert_eq!(d.body.len(), len, "a length-framed body is its length");
    }
    if d.bad_te {
        assert!(
            d.body.is_empty() && !d.keep_alive,
            "a refused coding reads no body"
        );
    }
    assert!(
        wire.ends_with(&d.rest),
        "what follows the message is the input's tail"
    );
    Some(d)
}

/// A request body through the chunked encoder the node connections send a
/// body of unknown length with, and back through the strict decoder
/// (`data[0]`: the size of the client's pieces, 0 for one piece;
/// `data[1]`: the size of the reads the decoder is fed, 0 for all at
/// once; the rest: the body). The body comes back whole and exact, the
/// encoded bytes pass the check a node's answer gets, and what follows the
/// last chunk is left untouched. Returns the encoded bytes.
pub fn chunked_round_trip(data: &[u8]) -> Option<Vec<u8>> {
    use crate::codec::chunked::{check_in_hand, encode, Chunked, Step, LAST_CHUNK};
    let (&piece, rest) = data.split_first()?;
    let (&read, body) = rest.split_first()?;
    let piece = if piece == 0 {
        body.len().max(1)
    } else {
        usize::from(piece)
    };
    let mut wire = Vec::with_capacity(body.len() + 64);
    for part in body.chunks(piece) {
        encode(part, &mut wire);
    }
    wire.extend_from_slice(LAST_CHUNK);
    assert_eq!(
        check_in_hand(&wire),
        Ok(()),
        "the encoder's bytes are refused"
    );
    let tail = b"HTTP/1.1 200 OK\r\n\r\n";
    let mut fed = wire.clone();
    fed.extend_from_slice(tail);
    let read = if read == 0 {
        fed.len()
    } else {
        usize::from(read)
    };
    let mut decoder = Chunked::default();
    let mut buf = bytes::BytesMut::new();
    let mut at = 0;
    let mut out = Vec::with_capacity(body.len());
    loop {
        match decoder
            .step(&mut buf)
            .expect("the decoder refuses the encoder's bytes")
        {
            Step::Data(d) => out.extend_from_slice(&d),
            Step::Done => break,
            Step::More => {
                assert!(
                    at < fed.len(),
                    "the decoder wants more than the encoder wrote"
                );
                let end = (at + read).min(fed.len());
                buf.extend_from_slice(&fed[at..end]);
                at = end;
            }
        }
    }
    assert!(out == body, "the body came back otherwise");
    let mut left = buf.to_vec();
    left.extend_from_slice(&fed[at..]);
    assert_eq!(&left[..], &tail[..], "what follows the body was touched");
    Some(wire)
}
