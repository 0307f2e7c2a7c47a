//! Layer: codec. Header fields, both sides: a wire name to a `HeaderName`
//! without `from_bytes` for the usual names ([`name_of`], [`name_eq`]), the
//! first value of a small map by a scan ([`first`], [`count_first`]), and
//! [`Fields`] — the one type of a response head's fields on the proxy
//! path. A node's plain head keeps its lines as sent ([`RawLines`]: wire
//! order, the node's case, written to an HTTP/1.1 client as they are, as
//! nginx passes them); what the gateway sets goes after them; and every
//! reader and editor goes through `Fields`' accessors, so no code sees a
//! map that lacks the node's fields. Taking the lines into a map
//! ([`Fields::into_map`], an edit of one of them) keeps their order. The
//! other way, a client's request head as received ([`SentHead`]) lets the
//! node side write the fields passed on unchanged as their lines came.

use std::cell::RefCell;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::base::freelist::FreeList;

/// A header name from the wire, as `HeaderName::from_bytes` makes it: the
/// names nearly every request or response carries are recognised by their
/// length and one case-insensitive compare (from_bytes lower-cases the
/// name into a scratch buffer and matches it against every standard name,
/// for each field on each side of every exchange).
pub fn name_of(b: &[u8]) -> Result<HeaderName, http::header::InvalidHeaderName> {
    match known_name(b) {
        Some(n) => Ok(n),
        None => HeaderName::from_bytes(b),
    }
}

/// The usual names [`name_of`] recognises without `from_bytes` (none of
/// them has a `_`).
pub fn known_name(b: &[u8]) -> Option<HeaderName> {
    let is = |lower: &[u8]| name_eq(b, lower);
    match b.len() {
        4 if is(b"host") => Some(header::HOST),
        4 if is(b"date") => Some(header::DATE),
        6 if is(b"server") => Some(header::SERVER),
        6 if is(b"accept") => Some(header::ACCEPT),
        6 if is(b"cookie") => Some(header::COOKIE),
        10 if is(b"user-agent") => Some(header::USER_AGENT),
        10 if is(b"connection") => Some(header::CONNECTION),
        12 if is(b"content-type") => Some(header::CONTENT_TYPE),
        14 if is(b"content-length") => Some(header::CONTENT_LENGTH),
        15 if is(b"accept-encoding") => Some(header::ACCEPT_ENCODING),
        _ => None,
    }
}

/// `b` equals `lower` (lower-case ASCII letters, digits and `-`) ignoring
/// ASCII case — `b.eq_ignore_ascii_case(lower)` for any bytes `b`, compared
/// a word at a time (two overlapping loads for 4–16 bytes) instead of
/// lower-casing byte by byte: names are compared against the usual ones on
/// every field of every request and response head.
///
/// OR-ing `0x20` into a byte lower-cases a letter and leaves `-` and the
/// digits alone; the only other bytes it maps onto one of those are
/// controls (`\r` onto `-`, `0x10..=0x19` onto the digits), the bytes that
/// have both bit 5 and bit 6 clear — refused by the second test.
#[inline]
pub fn name_eq(b: &[u8], lower: &[u8]) -> bool {
    #[inline(always)]
    fn word(x: u64, y: u64) -> bool {
        const LOW: u64 = 0x2020_2020_2020_2020;
        (x | LOW) == y && (!x & (!x >> 1) & LOW) == 0
    }
    let n = lower.len();
    if b.len() != n {
        return false;
    }
    let w8 = |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().unwrap_or([0; 8]));
    let w4 = |s: &[u8], at: usize| {
        u64::from(u32::from_le_bytes(
            s[at..at + 4].try_into().unwrap_or([0; 4]),
        )) | 0x2020_2020_0000_0000
    };
    match n {
        0..=3 => b
            .iter()
            .zip(lower)
            .all(|(&x, &y)| word(u64::from(x) | !0xff, u64::from(y) | !0xff)),
        4..=7 => word(w4(b, 0), w4(lower, 0)) && word(w4(b, n - 4), w4(lower, n - 4)),
        8..=16 => word(w8(b, 0), w8(lower, 0)) && word(w8(b, n - 8), w8(lower, n - 8)),
        _ => {
            (0..n - 8)
                .step_by(8)
                .all(|at| word(w8(b, at), w8(lower, at)))
                && word(w8(b, n - 8), w8(lower, n - 8))
        }
    }
}

/// A map's values one by one, each with its field's name (`HeaderMap`'s
/// owning iterators name a field once and give its further values `None`).
pub fn named(
    fields: impl Iterator<Item = (Option<HeaderName>, HeaderValue)>,
) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
    let mut last: Option<HeaderName> = None;
    fields.filter_map(move |(n, v)| {
        if n.is_some() {
            last = n;
        }
        Some((last.clone()?, v))
    })
}

/// Maps up to this many values are searched by a scan of their names
/// (standard names compare as one enum tag) instead of a hashed lookup.
pub const SCAN_MAX: usize = 8;

/// The first value of `name` — what `HeaderMap::get` returns. A request
/// carries a handful of fields, and several are looked up on every request
/// (Host, Upgrade): a scan is cheaper than hashing the name.
pub fn first<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h HeaderValue> {
    if headers.len() > SCAN_MAX {
        return headers.get(name);
    }
    headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
}

/// How many values `name` has, and the first (`get_all` counted), by the
/// same scan as [`first`].
pub fn count_first<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> (usize, Option<&'h HeaderValue>) {
    if headers.len() > SCAN_MAX {
        let all = headers.get_all(name);
        return (all.iter().count(), all.iter().next());
    }
    let mut found = headers.iter().filter(|(n, _)| *n == name).map(|(_, v)| v);
    let first = found.next();
    (first.map_or(0, |_| 1 + found.count()), first)
}

/// Is the field line whose name ends at `ne` and whose value is
/// `vs..ve` in `head` exactly `name: value` CRLF (the form a map's encoder
/// writes: a line of it can be copied as it is)?
#[inline(always)]
pub fn is_plain_line(head: &[u8], ne: usize, vs: usize, ve: usize) -> bool {
    vs == ne + 2 && head.get(ne..vs) == Some(b": ") && head.get(ve..ve + 2) == Some(b"\r\n")
}

/// Most runs of consecutive kept lines a [`RawLines`] holds (a head whose
/// end-to-end fields are split by more hop-by-hop lines takes the map).
pub const RAW_RUNS: usize = 4;

/// A response head's end-to-end fields as the node sent them: runs of
/// whole `name: value\r\n` lines of its head, hop-by-hop lines left out —
/// written to an HTTP/1.1 client as they are instead of a `HeaderMap` built
/// and encoded again. The node side makes them only for a plain head
/// (every kept line exactly `name: value` + CRLF, no `Connection` naming
/// other fields, at most one Content-Length and none beside a
/// Transfer-Encoding, a status with a body); anything else takes the map
/// ([`RawLines::to_map`] gives the same map on the way back).
#[derive(Clone, Debug)]
pub struct RawLines {
    head: Bytes,
    runs: [(u32, u32); RAW_RUNS],
    n: u8,
    /// The Content-Length field's value, if one is among the lines.
    pub length: Option<u64>,
    /// A Date field is among the lines.
    pub has_date: bool,
    /// Where the first Content-Type value is in the head, if among the
    /// lines (read on every answer: is it gRPC?).
    content_type: Option<(u32, u32)>,
}

impl RawLines {
    /// No lines yet, of the head `head`.
    pub fn new(head: Bytes) -> RawLines {
        RawLines {
            head,
            runs: [(0, 0); RAW_RUNS],
            n: 0,
            length: None,
            has_date: false,
            content_type: None,
        }
    }

    /// Adds the whole line `start..end` of the head (CRLF included), after
    /// those added before; `false` when it would take a run more than
    /// [`RAW_RUNS`].
    pub fn push(&mut self, start: u32, end: u32) -> bool {
        match self.n {
            0 => {}
            k if self.runs[k as usize - 1].1 == start => {
                self.runs[k as usize - 1].1 = end;
                return true;
            }
            k if k as usize == RAW_RUNS => return false,
            _ => {}
        }
        self.runs[self.n as usize] = (start, end);
        self.n += 1;
        true
    }

    /// Notes that the first Content-Type value is at `start..end` of the
    /// head (the builder reads every name anyway; [`Fields::content_type`]
    /// then finds it without a scan).
    pub fn content_type_at(&mut self, start: u32, end: u32) {
        if self.content_type.is_none() {
            self.content_type = Some((start, end));
        }
    }

    /// The field lines, in order (each run ends with CRLF).
    pub fn runs(&self) -> impl Iterator<Item = &[u8]> {
        self.runs[..self.n as usize]
            .iter()
            .map(|&(s, e)| &self.head[s as usize..e as usize])
    }

    /// Each line's name and value's place in the head, in order. Each line
    /// is `name: value\r\n` (checked when it was pushed; httparse checked
    /// the name's and value's bytes).
    fn lines(&self) -> impl Iterator<Item = (&[u8], std::ops::Range<usize>)> {
        self.runs[..self.n as usize]
            .iter()
            .flat_map(move |&(start, end)| {
                let mut at = start as usize;
                let end = end as usize;
                std::iter::from_fn(move || {
                    if at >= end {
                        return None;
                    }
                    let line = &self.head[at..end];
                    let colon = line.iter().position(|&b| b == b':').unwrap_or(0);
                    let eol = line
                        .iter()
                        .position(|&b| b == b'\n')
                        .map_or(line.len(), |i| i + 1);
                    let item = (&line[..colon], at + colon + 2..at + eol - 2);
                    at += eol;
                    Some(item)
                })
            })
    }

    /// The first value of `name`.
    fn get(&self, name: &HeaderName) -> Option<&[u8]> {
        if name == header::CONTENT_TYPE {
            return self.content_type();
        }
        let want = name.as_str().as_bytes();
        self.lines()
            .find(|(n, _)| name_eq(n, want))
            .map(|(_, v)| &self.head[v])
    }

    /// The Content-Type value, as noted by the builder.
    #[inline]
    fn content_type(&self) -> Option<&[u8]> {
        self.content_type
            .map(|(s, e)| &self.head[s as usize..e as usize])
    }

    /// The same fields as a map (what the head would have been without
    /// the pass-through), in order.
    pub fn to_map(&self) -> HeaderMap {
        let mut h = HeaderMap::with_capacity(8);
        for (n, v) in self.lines() {
            if let (Ok(n), Ok(v)) = (
                name_of(n),
                HeaderValue::from_maybe_shared(self.head.slice(v)),
            ) {
                h.append(n, v);
            }
        }
        h
    }
}

/// Heap slots for [`RawLines`] kept per thread (as many as a burst of
/// answers in flight used; what the load does not take again is freed on
/// the accept loop's tick, [`trim`]): an answer's fields move through
/// several layers, so the lines are boxed, and a box from the allocator
/// for each answer costs more than the copies it saves.
const SLOTS_MAX: usize = 1024;

thread_local! {
    static SLOTS: RefCell<FreeList<Box<RawLines>>> = const { RefCell::new(FreeList::new(SLOTS_MAX)) };
}

/// [`RawLines`] in a kept heap slot; the slot goes back to the thread's
/// kept ones when dropped (holding no head).
#[derive(Debug)]
pub struct KeptLines(Option<Box<RawLines>>);

impl KeptLines {
    fn new(raw: RawLines) -> KeptLines {
        let slot = SLOTS.with(|s| s.borrow_mut().take());
        KeptLines(Some(match slot {
            Some(mut b) => {
                *b = raw;
                b
            }
            None => Box::new(raw),
        }))
    }
}

impl std::ops::Deref for KeptLines {
    type Target = RawLines;
    fn deref(&self) -> &RawLines {
        self.0.as_deref().expect("taken only by drop")
    }
}

impl Drop for KeptLines {
    fn drop(&mut self) {
        if let Some(mut b) = self.0.take() {
            b.head = Bytes::new();
            // A full list (or a thread ending) frees it.
            let _ = SLOTS.try_with(|s| drop(s.borrow_mut().give(b)));
        }
    }
}

/// Frees the thread's kept slots that were not taken since the last call;
/// how many.
pub fn trim() -> usize {
    SLOTS.try_with(|s| s.borrow_mut().trim()).unwrap_or(0)
}

/// A response head's fields on the proxy path: the node's lines as it
/// sent them (first, when its head was plain), then the fields set since —
/// or every field in the map (a head that was not plain, an HTTP/2 node,
/// the gateway's own answers). Read and edited only through its methods.
#[derive(Debug, Default)]
pub struct Fields {
    /// Boxed ([`KeptLines`]): an answer moves through several layers, and
    /// the lines are as large as the rest of the head.
    raw: Option<KeptLines>,
    map: HeaderMap,
}

impl From<HeaderMap> for Fields {
    fn from(map: HeaderMap) -> Fields {
        Fields { raw: None, map }
    }
}

impl From<RawLines> for Fields {
    fn from(raw: RawLines) -> Fields {
        Fields {
            raw: Some(KeptLines::new(raw)),
            map: HeaderMap::new(),
        }
    }
}

impl Fields {
    /// The node's lines as it sent them (if kept so), then `map`'s fields.
    pub fn new(raw: Option<RawLines>, map: HeaderMap) -> Fields {
        Fields {
            raw: raw.map(KeptLines::new),
            map,
        }
    }

    /// The first value of `name`.
    pub fn get(&self, name: &HeaderName) -> Option<&[u8]> {
        if let Some(v) = self.raw.as_ref().and_then(|r| r.get(name)) {
            return Some(v);
        }
        first(&self.map, name).map(HeaderValue::as_bytes)
    }

    /// The first Content-Type value (read of every answer: is it gRPC?;
    /// among the node's lines it was noted when they were read).
    #[inline]
    pub fn content_type(&self) -> Option<&[u8]> {
        self.get(&header::CONTENT_TYPE)
    }

    /// Sets `name` to `value` alone (its other values go).
    pub fn insert(&mut self, name: HeaderName, value: HeaderValue) {
        if self.raw.as_ref().is_some_and(|r| r.get(&name).is_some()) {
            self.take_lines_in();
        }
        self.map.insert(name, value);
    }

    /// Adds a value of `name` after every field there is.
    pub fn append(&mut self, name: HeaderName, value: HeaderValue) {
        self.map.append(name, value);
    }

    /// Every field as a map, in order (the HTTP/2 side's head).
    pub fn into_map(mut self) -> HeaderMap {
        self.take_lines_in();
        self.map
    }

    /// The node's lines to write as they are, then the map (the HTTP/1.1
    /// side's encoder: [`RawLines::runs`] first, then the map's fields).
    pub fn into_parts(self) -> (Option<KeptLines>, HeaderMap) {
        (self.raw, self.map)
    }

    /// The node's lines, if they are kept as sent.
    pub fn lines(&self) -> Option<&RawLines> {
        self.raw.as_deref()
    }

    /// Moves the node's lines into the map, before the fields it holds
    /// (which were set after them).
    fn take_lines_in(&mut self) {
        if let Some(raw) = self.raw.take() {
            let added = std::mem::replace(&mut self.map, raw.to_map());
            for (n, v) in named(added.into_iter()) {
                self.map.append(n, v);
            }
        }
    }
}

/// A client's HTTP/1.1 request head as it was received. The request's
/// field values are slices of it, so a field the gateway passes on
/// unchanged is found again by its value, and its line goes to the node as
/// the client sent it: the name in the client's case (as nginx passes
/// request fields), the unchanged lines next to each other copied at once.
/// A field the gateway set, changed or copied under another name is not
/// one of its lines and is written from the map.
#[derive(Debug, Clone)]
pub struct SentHead(Bytes);

impl SentHead {
    pub fn new(head: Bytes) -> SentHead {
        SentHead(head)
    }

    /// Where `name: value` CRLF sits in the head (through its CRLF) when
    /// `value` is the one the client sent in a line of exactly that form
    /// for the field `name` (any case); `None` otherwise.
    #[inline(always)]
    pub fn line(&self, name: &HeaderName, value: &HeaderValue) -> Option<(usize, usize)> {
        let head = &self.0[..];
        let v = value.as_bytes();
        // A slice of the head, found by address (no byte is read
        // outside it).
        let vs = (v.as_ptr() as usize).checked_sub(head.as_ptr() as usize)?;
        let ve = vs + v.len();
        let name = name.as_str().as_bytes();
        let ne = vs.checked_sub(2)?;
        let ns = ne.checked_sub(name.len())?;
        // The plain-line check first: it bounds `vs..ve + 2` by the head,
        // so the bytes before the value can be indexed.
        (ns > 0
            && is_plain_line(head, ne, vs, ve)
            && head[ns - 1] == b'\n'
            && name_eq(&head[ns..ne], name))
        .then_some((ns, ve + 2))
    }

    /// The head's bytes from `start` to `end` (ranges from [`Self::line`]).
    pub fn get(&self, (start, end): (usize, usize)) -> &[u8] {
        &self.0[start..end]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire-name test answers as the pre-parsed names do, any case.
    #[test]
    fn name_of_is_from_bytes() {
        let mut names: Vec<Vec<u8>> = [
            "host",
            "date",
            "server",
            "accept",
            "cookie",
            "user-agent",
            "connection",
            "content-type",
            "content-length",
            "accept-encoding",
            "hosts",
            "x-gray",
            "dat",
            "content-lengtH",
            "accept-encodinG",
            "x_user",
            "bad name",
            "",
            "é",
        ]
        .iter()
        .map(|n| n.as_bytes().to_vec())
        .collect();
        let upper: Vec<Vec<u8>> = names.iter().map(|n| n.to_ascii_uppercase()).collect();
        names.extend(upper);
        names.push(b"Content-Type".to_vec());
        names.push(b"hOsT".to_vec());
        for n in &names {
            let want = HeaderName::from_bytes(n).ok();
            assert_eq!(name_of(n).ok(), want, "{:?}", String::from_utf8_lossy(n));
        }
    }

    /// `name_eq` is `eq_ignore_ascii_case` against lower-case names, for
    /// any bytes: every length from 0 to 24, each position of each name
    /// replaced by each of the 256 byte values, and random strings.
    #[test]
    fn name_eq_is_eq_ignore_ascii_case() {
        let names: Vec<Vec<u8>> = (0..=24)
            .map(|n| {
                (0..n)
                    .map(|i| b"abcdefghijklmnopqrstuvwxyz-0123456789"[(i * 7 + n) % 37])
                    .collect()
            })
            .chain(
                [
                    "connection",
                    "keep-alive",
                    "proxy-connection",
                    "te",
                    "trailer",
                    "upgrade",
                    "transfer-encoding",
                    "content-length",
                    "x-12",
                ]
                .map(|n| n.as_bytes().to_vec()),
            )
            .collect();
        let mut rng = fastrand::Rng::with_seed(16);
        for lower in &names {
            let upper = lower.to_ascii_uppercase();
            assert!(name_eq(lower, lower) && name_eq(&upper, lower));
            for at in 0..lower.len() {
                for b in 0..=255u8 {
                    for case in [lower, &upper] {
                        let mut x = case.clone();
                        x[at] = b;
                        assert_eq!(
                            name_eq(&x, lower),
                            x.eq_ignore_ascii_case(lower),
                            "{x:?} {lower:?}"
                        );
                    }
                }
            }
            for _ in 0..200 {
                let len = lower.len().saturating_sub(1) + rng.usize(0..3);
                let x: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                assert_eq!(
                    name_eq(&x, lower),
                    x.eq_ignore_ascii_case(lower),
                    "{x:?} {lower:?}"
                );
            }
        }
    }

    /// The scan answers as the hashed lookups do, on small maps and on
    /// maps past the scan limit.
    #[test]
    fn first_and_count_first_agree_with_get_and_get_all() {
        for extra in [0usize, 3, SCAN_MAX + 4] {
            let mut h = HeaderMap::new();
            for i in 0..extra {
                h.append(
                    HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("v"),
                );
            }
            h.append(header::HOST, HeaderValue::from_static("a"));
            h.append("x-custom", HeaderValue::from_static("c"));
            h.append(header::HOST, HeaderValue::from_static("b"));
            for name in [
                header::HOST,
                HeaderName::from_static("x-custom"),
                header::UPGRADE,
            ] {
                assert_eq!(first(&h, &name), h.get(&name), "{name} with {extra}");
                let all = h.get_all(&name);
                assert_eq!(
                    count_first(&h, &name),
                    (all.iter().count(), all.iter().next()),
                    "{name} with {extra}"
                );
            }
        }
    }

    /// `text`'s lines as the node side keeps them: every line but a
    /// Connection one, Content-Type's value noted.
    fn lines(text: &str) -> RawLines {
        let head = Bytes::copy_from_slice(text.as_bytes());
        let mut raw = RawLines::new(head.clone());
        let mut at = 0;
        for line in text.split_inclusive("\r\n") {
            let end = at + line.len();
            let lower = line.to_ascii_lowercase();
            if lower.starts_with("content-type: ") {
                raw.content_type_at((at + 14) as u32, (end - 2) as u32);
            }
            if !lower.starts_with("connection") {
                assert!(raw.push(at as u32, end as u32));
            }
            at = end;
        }
        raw
    }

    /// The node's lines keep their order and case through reads and
    /// appends; an edit of one of them takes them into the map in order,
    /// with what was set since after them.
    #[test]
    fn fields_read_and_edit_the_nodes_lines_in_order() {
        let raw = lines("Content-Type: text/plain\r\nConnection: close\r\nX-A: 1\r\nX-a: 2\r\n");
        // Two runs: the Connection line is left out.
        assert_eq!(raw.runs().count(), 2);
        let mut f = Fields::from(raw);
        assert_eq!(f.get(&header::CONTENT_TYPE), Some(&b"text/plain"[..]));
        assert_eq!(f.get(&HeaderName::from_static("x-a")), Some(&b"1"[..]));
        assert!(f.get(&header::CONNECTION).is_none());
        f.append(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        f.insert(
            HeaderName::from_static("x-lane"),
            HeaderValue::from_static("gray"),
        );
        // Neither touched a node's line: they are still written as sent.
        let wire: Vec<u8> = f.lines().unwrap().runs().flatten().copied().collect();
        assert_eq!(wire, b"Content-Type: text/plain\r\nX-A: 1\r\nX-a: 2\r\n");
        assert_eq!(f.get(&header::SET_COOKIE), Some(&b"s=1"[..]));
        // Replacing a node's field: the lines go into the map, in order.
        f.insert(
            HeaderName::from_static("x-a"),
            HeaderValue::from_static("3"),
        );
        assert!(f.lines().is_none());
        let map = f.into_map();
        let order: Vec<(&str, &[u8])> = map
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(
            order,
            [
                ("content-type", &b"text/plain"[..]),
                ("x-a", b"3"),
                ("set-cookie", b"s=1"),
                ("x-lane", b"gray"),
            ]
        );
    }

    /// The lines' heap slot goes back to the thread when the fields are
    /// dropped (holding no head), the next answer's lines take it, and a
    /// trim frees one that nothing took over a whole period.
    #[test]
    fn the_lines_slot_is_kept_and_trimmed() {
        let kept = || SLOTS.with(|s| s.borrow().len());
        let head = Bytes::from_static(b"X-A: 1\r\n");
        let mut raw = RawLines::new(head.clone());
        assert!(raw.push(0, 8));
        drop(Fields::from(raw.clone()));
        assert_eq!(kept(), 1);
        let f = Fields::from(raw);
        assert_eq!(kept(), 0, "the kept slot was not taken");
        assert_eq!(f.get(&HeaderName::from_static("x-a")), Some(&b"1"[..]));
        drop(f);
        SLOTS.with(|s| assert!(s.borrow_mut().take().is_some_and(|b| b.head.is_empty())));
        drop(Fields::from(lines("X-B: 2\r\n")));
        assert_eq!(trim(), 0);
        assert_eq!(trim(), 1);
        assert_eq!(kept(), 0);
    }

    /// A line past the kept runs is refused (the head then takes the map).
    #[test]
    fn lines_split_into_more_runs_than_kept_are_refused() {
        let mut raw = RawLines::new(Bytes::from_static(&[0; 64]));
        for i in 0..RAW_RUNS as u32 {
            assert!(raw.push(i * 10, i * 10 + 5));
        }
        assert!(raw.push(35, 38), "joined to the last run");
        assert!(!raw.push(50, 55));
    }

    /// A sent line is found by its value only for its own field, in the
    /// exact `name: value` CRLF form (an empty value too); a value of
    /// another head and an equal value made elsewhere are not lines.
    #[test]
    fn a_sent_line_is_found_by_its_own_value_only() {
        let head =
            Bytes::from_static(b"GET / HTTP/1.1\r\nX-Id: 7\r\nX-Wide:  8\r\nEmpty: \r\n\r\n");
        let sent = SentHead::new(head.clone());
        let at = |t: &str| {
            head.windows(t.len())
                .position(|w| w == t.as_bytes())
                .unwrap()
        };
        let slice =
            |t: &str| HeaderValue::from_maybe_shared(head.slice(at(t)..at(t) + t.len())).unwrap();
        let id = HeaderName::from_static("x-id");
        let line = sent.line(&id, &slice("7")).unwrap();
        assert_eq!(sent.get(line), b"X-Id: 7\r\n");
        // The same bytes under another name (a copy into another field).
        assert_eq!(
            sent.line(&HeaderName::from_static("x-ie"), &slice("7")),
            None
        );
        assert_eq!(
            sent.line(&HeaderName::from_static("x-idd"), &slice("7")),
            None
        );
        // Two spaces after the colon: not the exact form.
        assert_eq!(
            sent.line(&HeaderName::from_static("x-wide"), &slice("8")),
            None
        );
        // An equal value that is not the head's.
        assert_eq!(sent.line(&id, &HeaderValue::from_static("7")), None);
        let other = Bytes::from_static(b"X-Id: 7\r\n");
        let v = HeaderValue::from_maybe_shared(other.slice(6..7)).unwrap();
        assert_eq!(sent.line(&id, &v), None);
        let empty =
            HeaderValue::from_maybe_shared(head.slice(at("Empty: ") + 7..at("Empty: ") + 7))
                .unwrap();
        let line = sent.line(&HeaderName::from_static("empty"), &empty);
        assert_eq!(line.map(|l| sent.get(l)), Some(&b"Empty: \r\n"[..]));
    }
}
