//! Layer: codec. The fast read of an HTTP/1.x head in its strict, usual form
//! — a request line (`METHOD target HTTP/1.x`) or a status line (`HTTP/1.x
//! DDD reason`) and CRLF, then `name:` OWS `value` OWS CRLF lines, then CRLF
//! — in one pass, field values scanned a word (8 bytes) at a time. Anything
//! else (a bare LF, leading empty lines, a status line without a reason, a
//! target, reason or value byte httparse would reject or that is unusual —
//! obs-text in a target or reason —, obs-fold, white space before a colon, a
//! head not complete yet, more fields than allowed) is declined, and the
//! caller has `httparse` read the head: whatever this accepts, httparse
//! reads the same way (same method, target, status, version, length and
//! field positions; `tests` check it on random heads).
//!
//! Why a pass of its own: httparse walks the name bytes one at a time
//! through its iterator, on every head of every request and response; the
//! usual head needs none of the generality that costs.

/// Name start, name end, value start, value end of a header field.
pub type Span = (u32, u32, u32, u32);

/// Drops a field map; one that never had room for a field (a
/// `HeaderMap::new()`, which allocates nothing — e.g. the map a
/// `Request::new`/`Response::new` starts with, replaced by the parsed one)
/// is forgotten instead: its drop frees nothing but still walks the map's
/// three parts (and a request makes three such drops).
pub fn drop_map(map: http::HeaderMap) {
    if map.capacity() == 0 {
        std::mem::forget(map);
    }
}

/// A response head's status line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusLine {
    /// The head's length (through its empty line).
    pub len: usize,
    pub code: u16,
    /// `HTTP/1.0` (else `HTTP/1.1`).
    pub http10: bool,
}

/// httparse's `tchar` (RFC 9110 §5.6.2): the bytes of a field name.
const TOKEN: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = (c as u8).is_ascii_alphanumeric();
        c += 1;
    }
    let extra = b"!#$%&'*+-.^_`|~";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `x` below `0x20` or equal to `0x7f` — the
/// bytes that end or spoil a field value (CR, HTAB, controls, DEL) — exact
/// for the lowest such byte (the borrow of the subtraction only reaches
/// bytes above a true one).
#[inline(always)]
fn stops(x: u64) -> u64 {
    let below = x.wrapping_sub(ONES * 0x20) & !x & HIGH;
    let del = x ^ (ONES * 0x7f);
    let del = del.wrapping_sub(ONES) & !del & HIGH;
    below | del
}

/// The high bit of each byte of `x` that is an ASCII letter, digit or `-`
/// (the bytes of the usual field names; every one a [`TOKEN`] byte). For a
/// byte `b` below `0x80`, `b + (0x80 - lo)` has its high bit set iff
/// `b >= lo` and `b + (0x7f - hi)` iff `b > hi`; no sum carries into the
/// next byte (both addends stay below `0x80`). Bytes from `0x80` are
/// masked out.
#[inline(always)]
fn usual_name_bytes(x: u64) -> u64 {
    let ascii = !x & HIGH;
    let b = x & !HIGH;
    let within =
        |v: u64, lo: u64, hi: u64| (v + ONES * (0x80 - lo)) & !(v + ONES * (0x7f - hi)) & HIGH;
    // OR-ing 0x20 maps exactly the letters (either case) onto a..z.
    let letter = within(b | (ONES * 0x20), u64::from(b'a'), u64::from(b'z'));
    let digit = within(b, u64::from(b'0'), u64::from(b'9'));
    let hyphen = within(b, u64::from(b'-'), u64::from(b'-'));
    (letter | digit | hyphen) & ascii
}

/// The end of the field name (run of [`TOKEN`] bytes) from `at`: the
/// usual bytes skipped a word at a time, the others looked up one by one;
/// `None` when the buffer ends first.
#[inline(always)]
fn name_end(buf: &[u8], mut at: usize) -> Option<usize> {
    loop {
        if let Some(w) = buf.get(at..at + 8) {
            let usual = usual_name_bytes(u64::from_le_bytes(w.try_into().ok()?));
            if usual == HIGH {
                at += 8;
                continue;
            }
            at += ((!usual & HIGH).trailing_zeros() / 8) as usize;
        }
        if !TOKEN[usize::from(*buf.get(at)?)] {
            return Some(at);
        }
        at += 1;
    }
}

/// A request head's request line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLine {
    /// The head's length (through its empty line).
    pub len: usize,
    /// Start and end of the method.
    pub method: (usize, usize),
    /// Start and end of the request target.
    pub target: (usize, usize),
    /// `HTTP/1.0` (else `HTTP/1.1`).
    pub http10: bool,
}

/// Reads the response head at the front of `buf` into `spans` (every
/// field, in order, at most `max`); `None`: not the strict form or not
/// complete — httparse decides.
pub fn response(buf: &[u8], spans: &mut Vec<Span>, max: usize) -> Option<StatusLine> {
    // "HTTP/1.x DDD " then the reason (visible ASCII and spaces), CRLF.
    let line = buf.get(..13)?;
    if &line[..7] != b"HTTP/1." || line[8] != b' ' || line[12] != b' ' {
        return None;
    }
    let http10 = version_digit(line[7])?;
    let mut code: u16 = 0;
    for &d in &line[9..12] {
        if !d.is_ascii_digit() {
            return None;
        }
        code = code * 10 + u16::from(d - b'0');
    }
    let mut at = 13;
    loop {
        match *buf.get(at)? {
            b'\r' => break,
            b' '..=b'~' => at += 1,
            _ => return None,
        }
    }
    let len = fields(buf, crlf(buf, at)?, spans, max)?;
    Some(StatusLine { len, code, http10 })
}

/// Reads the request head at the front of `buf` into `spans` (as
/// [`response`]): a token method, one space, a target of visible ASCII,
/// one space, `HTTP/1.0` or `HTTP/1.1`, CRLF.
pub fn request(buf: &[u8], spans: &mut Vec<Span>, max: usize) -> Option<RequestLine> {
    let mut at = 0;
    while TOKEN[usize::from(*buf.get(at)?)] {
        at += 1;
    }
    if at == 0 || buf[at] != b' ' {
        return None;
    }
    let method = (0, at);
    at += 1;
    let ts = at;
    while matches!(*buf.get(at)?, b'!'..=b'~') {
        at += 1;
    }
    if at == ts || buf[at] != b' ' {
        return None;
    }
    let target = (ts, at);
    let version = buf.get(at + 1..at + 9)?;
    if &version[..7] != b"HTTP/1." {
        return None;
    }
    let http10 = version_digit(version[7])?;
    let len = fields(buf, crlf(buf, at + 9)?, spans, max)?;
    Some(RequestLine {
        len,
        method,
        target,
        http10,
    })
}

/// Start and end of `part`, a slice of `buf`, in `buf`.
pub fn span_in(buf: &[u8], part: &[u8]) -> (usize, usize) {
    let start = part.as_ptr() as usize - buf.as_ptr() as usize;
    (start, start + part.len())
}

/// The positions in `buf` of the fields httparse read from it (the head
/// the fast read declined), into `spans`.
pub fn httparse_spans(buf: &[u8], fields: &[httparse::Header<'_>], spans: &mut Vec<Span>) {
    spans.clear();
    spans.extend(fields.iter().map(|h| {
        let (ns, ne) = span_in(buf, h.name.as_bytes());
        let (vs, ve) = span_in(buf, h.value);
        // Heads are capped far below 4 GiB (each caller's limit).
        (ns as u32, ne as u32, vs as u32, ve as u32)
    }));
}

/// `HTTP/1.0` or `HTTP/1.1` by its last digit.
fn version_digit(d: u8) -> Option<bool> {
    match d {
        b'0' => Some(true),
        b'1' => Some(false),
        _ => None,
    }
}

/// The position after the CRLF at `at`.
fn crlf(buf: &[u8], at: usize) -> Option<usize> {
    (buf.get(at..at + 2)? == b"\r\n").then_some(at + 2)
}

/// Reads the field lines from `at` through the empty line into `spans`;
/// the head's length.
fn fields(buf: &[u8], mut at: usize, spans: &mut Vec<Span>, max: usize) -> Option<usize> {
    spans.clear();
    loop {
        // The empty line ends the head.
        if *buf.get(at)? == b'\r' {
            return crlf(buf, at);
        }
        let ns = at;
        at = name_end(buf, at)?;
        if at == ns || buf[at] != b':' {
            return None;
        }
        let ne = at;
        at += 1;
        while matches!(*buf.get(at)?, b' ' | b'\t') {
            at += 1;
        }
        let vs = at;
        // The value: a word at a time up to the first byte below 0x20 or
        // DEL; a tab goes on, CR LF ends it, anything else is declined.
        loop {
            if let Some(w) = buf.get(at..at + 8) {
                let s = stops(u64::from_le_bytes(w.try_into().ok()?));
                if s == 0 {
                    at += 8;
                    continue;
                }
                at += (s.trailing_zeros() / 8) as usize;
            } else {
                while matches!(*buf.get(at)?, b' '..=b'~' | 0x80..=0xff) {
                    at += 1;
                }
            }
            match buf[at] {
                b'\t' => at += 1,
                b'\r' => break,
                _ => return None,
            }
        }
        let next = crlf(buf, at)?;
        let mut ve = at;
        while ve > vs && matches!(buf[ve - 1], b' ' | b'\t') {
            ve -= 1;
        }
        if spans.len() == max {
            return None;
        }
        // Heads are capped far below 4 GiB (each caller's limit).
        spans.push((ns as u32, ne as u32, vs as u32, ve as u32));
        at = next;
    }
}

#[cfg(test)]
mod tests {
    /// A map that had room is dropped (its values' bytes released); a
    /// fresh one is empty and has none.
    #[test]
    fn drop_map_drops_maps_that_had_room() {
        let bytes = bytes::Bytes::from(b"value".to_vec());
        let mut m = http::HeaderMap::new();
        assert_eq!(m.capacity(), 0);
        m.insert(
            http::header::HOST,
            http::HeaderValue::from_maybe_shared(bytes.clone()).unwrap(),
        );
        assert!(!bytes.is_unique());
        drop_map(m);
        assert!(bytes.is_unique(), "the map's values were not dropped");
        let mut emptied = http::HeaderMap::with_capacity(2);
        emptied.insert(
            http::header::HOST,
            http::HeaderValue::from_maybe_shared(bytes.clone()).unwrap(),
        );
        emptied.clear();
        assert!(emptied.capacity() > 0);
        drop_map(emptied);
        drop_map(http::HeaderMap::new());
        assert!(bytes.is_unique());
    }

    use super::*;

    const MAX: usize = 100;

    /// The word-at-a-time name test says, for every byte value at every
    /// position of a word (whatever its neighbours), whether it is a
    /// letter, digit or `-`; and the name scan stops where the byte loop
    /// did, on names of every length and at every kind of stop.
    #[test]
    fn usual_name_bytes_are_told_exactly() {
        let mut rng = fastrand::Rng::with_seed(5);
        for pos in 0..8 {
            for b in 0..=255u8 {
                for _ in 0..8 {
                    let mut w = [0u8; 8];
                    rng.fill(&mut w);
                    w[pos] = b;
                    let got = (usual_name_bytes(u64::from_le_bytes(w)) >> (pos * 8 + 7)) & 1 == 1;
                    let want = b.is_ascii_alphanumeric() || b == b'-';
                    assert_eq!(got, want, "byte {b:#04x} at {pos} in {w:?}");
                }
            }
        }
        let bytes = b"aZ09-_.!~^`|'#$%&*+:;@[{ \t\r\x00\x7f\x80\xff";
        for _ in 0..20_000 {
            let buf: Vec<u8> = (0..rng.usize(0..24))
                .map(|_| bytes[rng.usize(0..bytes.len())])
                .collect();
            let at = rng.usize(0..=buf.len());
            let mut end = at;
            let want = loop {
                match buf.get(end) {
                    None => break None,
                    Some(&c) if TOKEN[usize::from(c)] => end += 1,
                    Some(_) => break Some(end),
                }
            };
            assert_eq!(name_end(&buf, at), want, "{buf:?} from {at}");
        }
    }

    /// What httparse reads: status line and field positions.
    fn httparse_reads(raw: &[u8]) -> Option<(StatusLine, Vec<Span>)> {
        let mut fields = [httparse::EMPTY_HEADER; MAX];
        let mut r = httparse::Response::new(&mut fields);
        let Ok(httparse::Status::Complete(len)) = r.parse(raw) else {
            return None;
        };
        let mut spans = Vec::new();
        httparse_spans(raw, r.headers, &mut spans);
        let line = StatusLine {
            len,
            code: r.code?,
            http10: r.version? == 0,
        };
        Some((line, spans))
    }

    fn fast(raw: &[u8]) -> Option<(StatusLine, Vec<Span>)> {
        let mut spans = Vec::new();
        response(raw, &mut spans, MAX).map(|l| (l, spans))
    }

    /// The heads nodes usually send take this path and read as httparse
    /// reads them.
    #[test]
    fn usual_heads_are_read_as_httparse_reads_them() {
        for raw in [
            &b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 23:00:00 GMT\r\nContent-Type: application/json\r\nContent-Length: 33\r\nConnection: keep-alive\r\n\r\n{}"[..],
            b"HTTP/1.0 404 Not Found\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\nX-Empty:\r\nX-Sp:   \r\nX-Tab:\tv\t \r\nX-Obs: caf\xc3\xa9 \xff\r\n\r\n",
            b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\nX-A-Very-Long-Field-Name-Indeed: a value longer than sixteen bytes, with, commas\r\n\r\n0\r\n\r\n",
        ] {
            let got = fast(raw);
            assert!(got.is_some(), "declined: {:?}", String::from_utf8_lossy(raw));
            assert_eq!(got, httparse_reads(raw), "{:?}", String::from_utf8_lossy(raw));
        }
    }

    /// Unusual or broken heads, and heads not complete yet, are left to
    /// httparse.
    #[test]
    fn unusual_heads_are_declined() {
        for raw in [
            &b"HTTP/1.1 200 OK\r\nServer: x\r\n"[..],
            b"HTTP/1.1 200 OK\r\nServer: x\r\n\r",
            b"HTTP/1.1 200 OK\r\nServer: x",
            b"HTTP/1.1 200 OK\nServer: x\n\n",
            b"HTTP/1.1 200 OK\r\nServer: x\n\r\n",
            b"HTTP/1.1 200\r\n\r\n",
            b"HTTP/1.1  200 OK\r\n\r\n",
            b"HTTP/2.0 200 OK\r\n\r\n",
            b"HTTP/1.1 2x0 OK\r\n\r\n",
            b"HTTP/1.1 200 O\x7fK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nServer : x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n Server: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nServer: x\r\n folded\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nSer\"ver: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nServer: a\x00b\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nServer: a\x7fb and more bytes\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nServer: a\rb\r\n\r\n",
            b"\r\nHTTP/1.1 200 OK\r\n\r\n",
        ] {
            assert_eq!(fast(raw), None, "{:?}", String::from_utf8_lossy(raw));
        }
        let fields = |k: usize| -> Vec<u8> {
            [&b"HTTP/1.1 200 OK\r\n"[..]]
                .into_iter()
                .chain(std::iter::repeat_n(&b"X: 1\r\n"[..], k))
                .chain([&b"\r\n"[..]])
                .flatten()
                .copied()
                .collect()
        };
        assert_eq!(fast(&fields(MAX + 1)), None, "more fields than allowed");
        assert!(fast(&fields(MAX)).is_some(), "exactly as many as allowed");
    }

    /// Random mutations of valid heads (bytes flipped, inserted, cut, the
    /// head cut short): whatever the fast read accepts, httparse reads
    /// the same way — status, version, length and every field's position.
    #[test]
    fn mutated_heads_are_read_as_httparse_reads_them_or_declined() {
        let seeds: [&[u8]; 4] = [
            b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 23:00:00 GMT\r\nContent-Type: application/json\r\nContent-Length: 33\r\nConnection: keep-alive\r\n\r\nbody",
            b"HTTP/1.0 302 Found\r\nLocation: /x?a=1\r\nX-E:\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\t \r\nX-Long: abcdefghijklmnopqrstuvwxyz0123456789\r\n\r\n",
        ];
        let alphabet = b"\r\n :\t\x00\x7f\x80\xffAaZz09-_/\"HTP.1";
        differential(&seeds, alphabet, 16, httparse_reads, fast);
    }

    /// Mutates the `seeds` 100,000 times (bytes from `alphabet` flipped or
    /// inserted, bytes removed, the head cut short): whatever `fast`
    /// accepts, `reference` (httparse) reads the same way; enough heads
    /// take the fast read, and enough valid ones are declined, for the
    /// check to mean something.
    fn differential<T: PartialEq + std::fmt::Debug>(
        seeds: &[&[u8]],
        alphabet: &[u8],
        seed: u64,
        reference: impl Fn(&[u8]) -> Option<T>,
        fast: impl Fn(&[u8]) -> Option<T>,
    ) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let (mut accepted, mut declined_valid) = (0, 0);
        for round in 0..100_000 {
            let mut raw = seeds[round % seeds.len()].to_vec();
            for _ in 0..rng.usize(0..4) {
                if raw.is_empty() {
                    break;
                }
                let at = rng.usize(0..raw.len());
                match rng.u8(0..4) {
                    0 => raw[at] = alphabet[rng.usize(0..alphabet.len())],
                    1 => raw.insert(at, alphabet[rng.usize(0..alphabet.len())]),
                    2 => {
                        raw.remove(at);
                    }
                    _ => raw.truncate(at),
                }
            }
            let want = reference(&raw);
            match fast(&raw) {
                Some(got) => {
                    accepted += 1;
                    assert_eq!(Some(got), want, "{:?}", String::from_utf8_lossy(&raw));
                }
                None => declined_valid += usize::from(want.is_some()),
            }
        }
        assert!(
            accepted > 20_000,
            "only {accepted} heads took the fast read"
        );
        assert!(
            declined_valid > 1_000,
            "only {declined_valid} valid heads were declined"
        );
    }

    /// What httparse reads of a request: request line and field positions.
    fn httparse_request(raw: &[u8]) -> Option<(RequestLine, Vec<Span>)> {
        let mut fields = [httparse::EMPTY_HEADER; MAX];
        let mut r = httparse::Request::new(&mut fields);
        let Ok(httparse::Status::Complete(len)) = r.parse(raw) else {
            return None;
        };
        let at = |part: &str| span_in(raw, part.as_bytes());
        let mut spans = Vec::new();
        httparse_spans(raw, r.headers, &mut spans);
        let line = RequestLine {
            len,
            method: at(r.method?),
            target: at(r.path?),
            http10: r.version? == 0,
        };
        Some((line, spans))
    }

    fn fast_request(raw: &[u8]) -> Option<(RequestLine, Vec<Span>)> {
        let mut spans = Vec::new();
        request(raw, &mut spans, MAX).map(|l| (l, spans))
    }

    #[test]
    fn usual_requests_are_read_as_httparse_reads_them() {
        for raw in [
            &b"GET /api/x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept-Encoding: identity\r\n\r\n"[..],
            b"POST /p?a=1&b=%20 HTTP/1.0\r\nContent-Length: 3\r\nX-Gray:1\r\n\r\nabc",
            b"M-SEARCH * HTTP/1.1\r\n\r\n",
            b"OPTIONS http://a.example/x HTTP/1.1\r\nCookie: a=1; b=2\r\n\r\n",
        ] {
            let got = fast_request(raw);
            assert!(
                got.is_some(),
                "declined: {:?}",
                String::from_utf8_lossy(raw)
            );
            assert_eq!(
                got,
                httparse_request(raw),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
        for raw in [
            &b"\r\nGET / HTTP/1.1\r\n\r\n"[..],
            b"GET  / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\n\n",
            b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"GET / HTTP/1.1 \r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
        ] {
            assert_eq!(
                fast_request(raw),
                None,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    /// As for responses: whatever the fast read accepts of a mutated
    /// request head, httparse reads the same way.
    #[test]
    fn mutated_requests_are_read_as_httparse_reads_them_or_declined() {
        let seeds: [&[u8]; 4] = [
            b"GET /api/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept-Encoding: identity\r\nX-User-Id: u17\r\n\r\n",
            b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
            b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nCookie: a=1; b=2\r\n\r\n",
            b"HEAD /h HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ];
        let alphabet = b"\r\n :\t\x00\x7f\x80\xffAaZz09-_/?%\"HTP.1";
        differential(&seeds, alphabet, 17, httparse_request, fast_request);
    }
}
