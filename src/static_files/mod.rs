//! Layer: static files (data plane, beside upstream; uses base, config).
//! Static-resource nodes: `root/<lane>/<path>` with per-file fallback to
//! `root/formal/<path>`, lane-aware resolution, traversal checks and
//! lane-tagged ETags (so caches never mix lanes). Every request is answered
//! on its worker thread: resolution and content come from the tree's
//! [`cache::FileCache`] (a hit costs no syscall), files too large for it are
//! read with positioned reads in bounded chunks ([`body::FileBody`]);
//! conditional requests, Range and multi-range are answered here.

pub mod body;
pub mod cache;

use std::collections::VecDeque;
use std::path::{Component, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use http_body_util::{Empty, Full};

use crate::base::body::{boxed, plain, Body};
use crate::base::decision::Decision;
use crate::base::error::{Error, ErrorKind};
use crate::base::fileslots::{FileSlot, FileSlots};
use crate::base::ratelog::log_limited;
use crate::config::{Precompressed, RouteConfig};
use body::{FileBody, Segment};
pub use cache::CacheSettings;
use cache::{Content, FileCache, FileInfo, Resolved};

/// A static tree: `root/<lane>/...` with per-file fallback to `root/formal/`.
#[derive(Debug, Clone)]
pub struct StaticTree {
    /// Canonical root directory.
    pub root: PathBuf,
    pub index: String,
    pub cache_control: HeaderValue,
    pub cache: Arc<FileCache>,
    /// Precompressed siblings served, in the order tried (none by default).
    pub precompressed: Vec<Precompressed>,
}

impl StaticTree {
    /// A tree and its cache (shared with earlier generations serving the same
    /// root, index and settings). A `cache_control` that is no valid header
    /// value falls back to the route default's.
    pub fn new(
        root: PathBuf,
        index: String,
        cache_control: &str,
        settings: CacheSettings,
    ) -> StaticTree {
        let cache = cache::cache_for(&root, &index, settings);
        StaticTree {
            cache_control: HeaderValue::from_str(cache_control).unwrap_or_else(|_| {
                HeaderValue::from_str(&RouteConfig::default().cache_control)
                    .expect("the default Cache-Control is a valid header value")
            }),
            root,
            index,
            cache,
            precompressed: Vec::new(),
        }
    }
}

/// Decodes and checks a URL path; `None` for anything that could escape the
/// tree or is not a plain relative path (`..`, backslashes, NUL, encoded
/// separators, double encoding).
pub fn safe_relative(url_path: &str, index: &str) -> Option<PathBuf> {
    let decoded = percent_encoding::percent_decode_str(url_path)
        .decode_utf8()
        .ok()?;
    if decoded.contains(['\\', '\0', '%']) {
        return None;
    }
    let mut rel = PathBuf::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => continue,
            ".." => return None,
            s => rel.push(s),
        }
    }
    // Every component must be a normal one (no roots or prefixes).
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return None;
    }
    if decoded.ends_with('/') {
        rel.push(index);
    }
    Some(rel)
}

fn etag_for(lane: &str, size: u64, modified: Option<std::time::SystemTime>) -> String {
    let (secs, nanos) = modified
        .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
        .map_or((0, 0), |d| (d.as_secs(), d.subsec_nanos()));
    format!("\"{lane}-{size:x}-{secs:x}.{nanos:x}\"")
}

fn etag_matches(header_value: &HeaderValue, etag: &[u8]) -> bool {
    header_value.as_bytes().split(|b| *b == b',').any(|t| {
        let t = t.trim_ascii();
        t == b"*" || t.strip_prefix(b"W/").unwrap_or(t) == etag
    })
}

/// Serves a static request for the decided lane. `sendfile_ok`: the server
/// can send a whole file by `sendfile(2)` (the plain HTTP/1.1 one), so a
/// file of [`SENDFILE_MIN`] or more held in memory is opened for it; other
/// servers write the held bytes and open nothing.
///
/// A request carrying its connection's [`FileSlots`] (HTTP/2) takes a slot
/// before it opens a file; while none is free it waits, holding no
/// descriptor, at most the connection's wait (else
/// [`ErrorKind::FileSlotTimeout`]). A file that cannot be opened for want of
/// descriptors (or any error but its absence or permissions) is
/// [`ErrorKind::FileUnavailable`] (503), not a 404.
pub async fn serve(
    tree: &StaticTree,
    parts: &Parts,
    decision: &mut Decision,
    sendfile_ok: bool,
) -> Result<Response<Body>, Error> {
    let slots = parts.extensions.get::<FileSlots>();
    let mut files = Files { slots, slot: None };
    loop {
        match serve_now(tree, parts, decision, sendfile_ok, &mut files) {
            Ok(r) => return Ok(r),
            Err(Halt::NeedSlot) => {
                let slots = files.slots.expect("a slot is needed only where slots are");
                match slots.take().await {
                    Some(slot) => files.slot = Some(slot),
                    None => {
                        log_limited(&SLOT_LOG, || {
                            tracing::warn!(
                                path = parts.uri.path(),
                                "no open-file slot of the connection came free in time; answering 503"
                            )
                        });
                        return Err(Error::new(ErrorKind::FileSlotTimeout));
                    }
                }
            }
            Err(Halt::Unavailable(e)) => {
                log_limited(&OPEN_LOG, || {
                    tracing::warn!(
                        path = parts.uri.path(),
                        error = %e,
                        "static file could not be opened; answering 503"
                    )
                });
                return Err(Error::new(ErrorKind::FileUnavailable));
            }
        }
    }
}

static SLOT_LOG: AtomicU64 = AtomicU64::new(0);
static OPEN_LOG: AtomicU64 = AtomicU64::new(0);

/// The connection's open-file slots, and the slot this request holds.
struct Files<'a> {
    slots: Option<&'a FileSlots>,
    slot: Option<FileSlot>,
}

impl Files<'_> {
    /// Whether a file may be opened now (a slot held, or taken now, or no
    /// bound); else the request must wait for one.
    fn ready(&mut self) -> Result<(), Halt> {
        let Some(slots) = self.slots else {
            return Ok(());
        };
        if self.slot.is_none() {
            self.slot = Some(slots.try_take().ok_or(Halt::NeedSlot)?);
        }
        Ok(())
    }
}

/// Why an answer could not be made on the worker thread now.
enum Halt {
    /// A file must be opened and the connection has no slot free.
    NeedSlot,
    /// A file could not be opened (not for its absence).
    Unavailable(Arc<std::io::Error>),
}

/// Why [`respond`] made no answer.
enum Miss {
    /// The file on disk is not the cached version any more.
    Stale,
    Halt(Halt),
}

/// [`serve`]'s work, which never waits: everything happens on the worker
/// thread.
fn serve_now(
    tree: &StaticTree,
    parts: &Parts,
    decision: &mut Decision,
    sendfile_ok: bool,
    files: &mut Files<'_>,
) -> Result<Response<Body>, Halt> {
    if parts.method != Method::GET && parts.method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    let url_path = parts.uri.path();
    let resolve = |p: &str| safe_relative(p, &tree.index);
    let mut entry = tree
        .cache
        .get(&tree.root, &decision.lane, url_path, resolve);
    let mut retried = false;
    loop {
        let f = match &entry.resolved {
            Resolved::NotFound => return Ok(plain(StatusCode::NOT_FOUND, "not found\n")),
            Resolved::Directory => return Ok(redirect_to_slash(parts)),
            Resolved::Unavailable(e) => return Err(Halt::Unavailable(e.clone())),
            Resolved::File(f) => f,
        };
        if *f.served_lane != *decision.lane {
            decision.fallback = Some("static_file_from_formal");
        }
        decision.served_lane = Some(f.served_lane.clone());
        decision.node = Some(f.node.clone());
        if let Some(r) = precompressed(tree, parts, &decision.lane, f, sendfile_ok, files)? {
            return Ok(r);
        }
        match respond(tree, parts, f, None, sendfile_ok, files) {
            Ok(r) => return Ok(r),
            Err(Miss::Halt(h)) => return Err(h),
            // The file on disk is not the one cached: forget it, look again.
            Err(Miss::Stale) if !retried => {
                retried = true;
                tree.cache.forget(&decision.lane, url_path);
                entry = tree
                    .cache
                    .get(&tree.root, &decision.lane, url_path, resolve);
            }
            Err(Miss::Stale) => return Ok(plain(StatusCode::NOT_FOUND, "not found\n")),
        }
    }
}

/// The answer from `f`'s precompressed sibling: the first of the tree's
/// encodings the client accepts whose sibling lies beside `f` — in the same
/// lane's tree, never a fallback's (that would be another file's bytes).
/// `None`: none such (or it changed on disk: forgotten, `f` serves).
fn precompressed(
    tree: &StaticTree,
    parts: &Parts,
    lane: &str,
    f: &FileInfo,
    sendfile_ok: bool,
    files: &mut Files<'_>,
) -> Result<Option<Response<Body>>, Halt> {
    // (Only GET and HEAD get here: `serve_now` answered the rest.)
    if tree.precompressed.is_empty() {
        return Ok(None);
    }
    let accept = parts.headers.get_all(header::ACCEPT_ENCODING);
    let url_path = parts.uri.path();
    for &enc in &tree.precompressed {
        if !accepts(&accept, enc.token()) {
            continue;
        }
        // Its own cache entry, resolved as the file's own path plus the
        // suffix.
        let resolve = |p: &str| {
            let mut rel = safe_relative(p, &tree.index)?.into_os_string();
            rel.push(enc.suffix());
            Some(PathBuf::from(rel))
        };
        let entry = tree
            .cache
            .get_variant(&tree.root, lane, url_path, enc.suffix(), resolve);
        let sibling = match &entry.resolved {
            Resolved::File(sibling) => sibling,
            Resolved::Unavailable(e) => return Err(Halt::Unavailable(e.clone())),
            _ => continue,
        };
        if sibling.served_lane != f.served_lane {
            continue;
        }
        match respond(tree, parts, sibling, Some((enc, f)), sendfile_ok, files) {
            Ok(r) => return Ok(Some(r)),
            Err(Miss::Halt(h)) => return Err(h),
            Err(Miss::Stale) => tree.cache.forget_variant(lane, url_path, enc.suffix()),
        }
    }
    Ok(None)
}

/// Whether `Accept-Encoding` takes `token`: listed (or `*`, the token not
/// listed itself) with a q-value above 0 (RFC 9110 12.5.3).
fn accepts(values: &header::GetAll<'_, HeaderValue>, token: &str) -> bool {
    let mut star = false;
    for item in values
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
    {
        let mut params = item.split(|b| *b == b';');
        let name = params.next().unwrap_or_default().trim_ascii();
        let q_zero = params.any(|p| {
            let p = p.trim_ascii();
            let Some(q) = p.strip_prefix(b"q=").or_else(|| p.strip_prefix(b"Q=")) else {
                return false;
            };
            std::str::from_utf8(q)
                .ok()
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        if name.eq_ignore_ascii_case(token.as_bytes()) {
            return !q_zero;
        }
        if name == b"*" {
            star = !q_zero;
        }
    }
    star
}

fn redirect_to_slash(parts: &Parts) -> Response<Body> {
    let mut loc = format!("{}/", parts.uri.path());
    if let Some(q) = parts.uri.query() {
        loc.push('?');
        loc.push_str(q);
    }
    let mut r = plain(StatusCode::MOVED_PERMANENTLY, "moved\n");
    if let Ok(v) = HeaderValue::from_str(&loc) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// Where a response's bytes come from.
enum Source {
    Mem(Bytes),
    Disk(Arc<std::fs::File>),
}

impl Source {
    fn segment(&self, start: u64, len: u64) -> Segment {
        match self {
            Source::Mem(b) => Segment::Mem(b.slice(start as usize..(start + len) as usize)),
            Source::Disk(_) => Segment::File { offset: start, len },
        }
    }
}

/// The response for a resolved file; [`Miss::Stale`] when the file on disk
/// is not the cached version any more. With `encoded`, `f` is the
/// precompressed sibling of the file given beside it (whose type the
/// response carries). A file opened takes one of `files`' slots first.
fn respond(
    tree: &StaticTree,
    parts: &Parts,
    f: &FileInfo,
    encoded: Option<(Precompressed, &FileInfo)>,
    sendfile_ok: bool,
    files: &mut Files<'_>,
) -> Result<Response<Body>, Miss> {
    let h = &parts.headers;
    let mut head = HeaderMap::with_capacity(8);
    head.insert(header::ETAG, f.etag.clone());
    head.insert(header::CACHE_CONTROL, tree.cache_control.clone());
    if !tree.precompressed.is_empty() {
        // The answer depends on Accept-Encoding for every file of the tree.
        head.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    }
    let content_type = match encoded {
        Some((enc, orig)) => {
            head.insert(
                header::CONTENT_ENCODING,
                HeaderValue::from_static(enc.token()),
            );
            &orig.content_type
        }
        None => &f.content_type,
    };
    if let Some(lm) = &f.last_modified {
        head.insert(header::LAST_MODIFIED, lm.clone());
    }
    let inm = h.get(header::IF_NONE_MATCH);
    let not_modified = match inm {
        Some(v) => etag_matches(v, f.etag.as_bytes()),
        // If-None-Match, when present, decides alone (RFC 9110 13.2.2);
        // dates compare in whole seconds, as HTTP dates carry no fraction.
        None => h
            .get(header::IF_MODIFIED_SINCE)
            .and_then(|v| httpdate::parse_http_date(v.to_str().ok()?).ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .zip(f.modified_secs)
            .is_some_and(|(since, m)| m <= since.as_secs()),
    };
    if not_modified {
        return Ok(finish(StatusCode::NOT_MODIFIED, head, boxed(Empty::new())));
    }
    head.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if parts.method == Method::HEAD {
        head.insert(header::CONTENT_LENGTH, f.content_length.clone());
        if let Some(ct) = content_type {
            head.insert(header::CONTENT_TYPE, ct.clone());
        }
        return Ok(finish(StatusCode::OK, head, boxed(Empty::new())));
    }
    let ranges = match ranges(h, f) {
        Ranges::Whole => None,
        Ranges::Unsatisfiable => {
            let cr = HeaderValue::from_str(&format!("bytes */{}", f.size)).expect("ASCII");
            head.insert(header::CONTENT_RANGE, cr);
            return Ok(finish(
                StatusCode::RANGE_NOT_SATISFIABLE,
                head,
                boxed(Empty::new()),
            ));
        }
        Ranges::Some(r) => Some(r),
    };
    let source = match &f.content {
        Content::Mem(b) => Source::Mem(b.clone()),
        Content::Disk => {
            files.ready().map_err(Miss::Halt)?;
            match open_same(f) {
                Ok(Some(file)) => Source::Disk(file),
                Ok(None) => return Err(Miss::Stale),
                Err(e) => return Err(Miss::Halt(Halt::Unavailable(Arc::new(e)))),
            }
        }
    };
    let Some(ranges) = ranges else {
        if let Some(ct) = content_type {
            head.insert(header::CONTENT_TYPE, ct.clone());
        }
        head.insert(header::CONTENT_LENGTH, f.content_length.clone());
        let mut sendfile = None;
        let body = match source {
            Source::Mem(b) if b.len() <= body::MEM_FRAME => boxed(Full::new(b)),
            Source::Mem(b) => boxed(FileBody::new(None, VecDeque::from([Segment::Mem(b)]))),
            Source::Disk(file) => {
                sendfile = Some(file.clone());
                boxed(
                    FileBody::shared(
                        file,
                        VecDeque::from([Segment::File {
                            offset: 0,
                            len: f.size,
                        }]),
                    )
                    .with_slot(files.slot.take()),
                )
            }
        };
        let mut r = finish(StatusCode::OK, head, body);
        if f.size >= SENDFILE_MIN && sendfile_ok {
            let file = match sendfile {
                Some(file) => Some(file),
                // (A held descriptor, or none: sendfile is only an option.)
                None => open_same(f).ok().flatten(),
            };
            if let Some(file) = file {
                r.extensions_mut()
                    .insert(crate::base::body::SendFile { file, len: f.size });
            }
        }
        return Ok(r);
    };
    let mut segments = VecDeque::new();
    if let [r] = ranges[..] {
        let cr = format!("bytes {}-{}/{}", r.start, r.start + r.length - 1, f.size);
        head.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&cr).expect("ASCII"),
        );
        if let Some(ct) = content_type {
            head.insert(header::CONTENT_TYPE, ct.clone());
        }
        segments.push_back(source.segment(r.start, r.length));
    } else {
        // multipart/byteranges (RFC 9110 14.6), each part with its range
        // and the file's type.
        let boundary: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(32)
            .collect();
        let ct = HeaderValue::from_str(&format!("multipart/byteranges; boundary={boundary}"))
            .expect("ASCII");
        head.insert(header::CONTENT_TYPE, ct);
        let part_type = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .map(|t| format!("Content-Type: {t}\r\n"))
            .unwrap_or_default();
        for (i, r) in ranges.iter().enumerate() {
            let sep = if i == 0 { "" } else { "\r\n" };
            let part = format!(
                "{sep}--{boundary}\r\nContent-Range: bytes {}-{}/{}\r\n{part_type}\r\n",
                r.start,
                r.start + r.length - 1,
                f.size
            );
            segments.push_back(Segment::Mem(Bytes::from(part)));
            segments.push_back(source.segment(r.start, r.length));
        }
        segments.push_back(Segment::Mem(Bytes::from(format!("\r\n--{boundary}--\r\n"))));
    }
    let body = match source {
        Source::Disk(file) => FileBody::shared(file, segments).with_slot(files.slot.take()),
        Source::Mem(_) => FileBody::new(None, segments),
    };
    head.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(hyper::body::Body::size_hint(&body).exact().unwrap_or(0)),
    );
    Ok(finish(StatusCode::PARTIAL_CONTENT, head, boxed(body)))
}

/// Whole files from this size on carry a [`crate::base::body::SendFile`]
/// for the HTTP/1.1 server of plain listeners: one copy less than writing
/// the body (nginx's `sendfile on`); smaller ones are cheaper as a write.
pub const SENDFILE_MIN: u64 = 64 * 1024;

/// The file at `f.path` if it is still the one `f` describes (inode, size,
/// mtime), else `None` (the caller revalidates): the descriptor the entry
/// holds, after an `fstat` (a file rewritten in place is not sent under the
/// old validators), else the path opened now. An error when it could not
/// be opened for another reason than its absence ([`cache::OpenError`]).
fn open_same(f: &cache::FileInfo) -> std::io::Result<Option<Arc<std::fs::File>>> {
    if let Some(held) = &f.open {
        let Ok(meta) = held.file.metadata() else {
            return Ok(None);
        };
        return Ok((cache::FileId::of(&meta) == f.id).then(|| held.file.clone()));
    }
    match cache::open_regular(&f.path) {
        Ok((file, meta)) => Ok((cache::FileId::of(&meta) == f.id).then(|| Arc::new(file))),
        Err(cache::OpenError::Gone) => Ok(None),
        Err(cache::OpenError::Failed(e)) => Err(e),
    }
}

fn finish(status: StatusCode, headers: HeaderMap, body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

enum Ranges {
    Whole,
    Unsatisfiable,
    Some(Vec<http_range::HttpRange>),
}

/// The ranges to send: `Whole` without a Range header, with one that does
/// not parse, with an If-Range validator other than ours, or when the ranges
/// add up to more than the file (nginx's rule: no amplification by
/// overlapping ranges).
fn ranges(h: &HeaderMap, f: &FileInfo) -> Ranges {
    let Some(range) = h.get(header::RANGE).and_then(|v| v.to_str().ok()) else {
        return Ranges::Whole;
    };
    if let Some(ir) = h.get(header::IF_RANGE) {
        let ours = ir == f.etag || f.last_modified.as_ref().is_some_and(|lm| ir == lm);
        if !ours {
            return Ranges::Whole;
        }
    }
    match http_range::HttpRange::parse(range, f.size) {
        Ok(r) if r.is_empty() => Ranges::Whole,
        Ok(r) if r.iter().map(|r| r.length).sum::<u64>() > f.size => Ranges::Whole,
        Ok(r) => Ranges::Some(r),
        Err(http_range::HttpRangeParseError::NoOverlap) => Ranges::Unsatisfiable,
        Err(http_range::HttpRangeParseError::InvalidRange) => Ranges::Whole,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FORMAL;

    #[test]
    fn traversal_and_odd_bytes_are_refused() {
        for bad in [
            "/../etc/passwd",
            "/a/../../x",
            "/%2e%2e/secret",
            "/%2E%2E%2Fsecret",
            "/%252e%252e/secret",
            "/a\\b",
            "/a%5cb",
            "/a%00b",
            "/%ff",
        ] {
            assert_eq!(safe_relative(bad, "index.html"), None, "{bad}");
        }
        assert_eq!(
            safe_relative("/", "index.html"),
            Some(PathBuf::from("index.html"))
        );
        assert_eq!(
            safe_relative("/js/app%20x.js", "index.html"),
            Some(PathBuf::from("js/app x.js"))
        );
        assert_eq!(
            safe_relative("/docs/", "index.html"),
            Some(PathBuf::from("docs/index.html"))
        );
    }

    #[test]
    fn etags_differ_by_lane() {
        let t = Some(UNIX_EPOCH + std::time::Duration::from_secs(1000));
        assert_ne!(etag_for("gray", 10, t), etag_for(FORMAL, 10, t));
        let v = HeaderValue::from_str(&etag_for("gray", 10, t)).unwrap();
        assert!(etag_matches(&v, etag_for("gray", 10, t).as_bytes()));
        assert!(!etag_matches(&v, etag_for(FORMAL, 10, t).as_bytes()));
    }
}
