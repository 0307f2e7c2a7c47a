//! Layer: static files (data plane, beside upstream; uses base, config).
//! Static-resource nodes: `root/<lane>/<path>` with per-file fallback to
//! `root/formal/<path>`. File bodies, Range and If-Modified-Since come from
//! hyper-staticfile; lane-aware resolution, traversal checks and lane-tagged
//! ETags (so caches never mix lanes) are ours.

use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use hyper_staticfile::util::FileResponseBuilder;
use hyper_staticfile::ResolvedFile;

use crate::base::body::{boxed, plain, Body};
use crate::base::decision::Decision;
use crate::config::FORMAL;

/// A static tree: `root/<lane>/...` with per-file fallback to `root/formal/`.
#[derive(Debug, Clone)]
pub struct StaticTree {
    /// Canonical root directory.
    pub root: PathBuf,
    pub index: String,
    pub cache_control: String,
}

/// A file chosen for a request: where it is and which lane's tree held it.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    Found {
        path: PathBuf,
        lane: String,
    },
    /// A directory requested without its trailing slash.
    Directory,
    NotFound,
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

/// Finds `rel` in the lane's tree, else formal's; symlinks leading out of
/// the tree are treated as missing.
pub fn lookup(tree: &StaticTree, lane: &str, rel: &Path) -> Lookup {
    let lanes: &[&str] = if lane == FORMAL {
        &[FORMAL]
    } else {
        &[lane, FORMAL]
    };
    let mut saw_dir = false;
    for l in lanes {
        let candidate = tree.root.join(l).join(rel);
        let Ok(canon) = candidate.canonicalize() else {
            continue;
        };
        if !canon.starts_with(&tree.root) {
            continue;
        }
        match std::fs::metadata(&canon) {
            Ok(m) if m.is_file() => {
                return Lookup::Found {
                    path: canon,
                    lane: (*l).to_string(),
                }
            }
            Ok(m) if m.is_dir() => saw_dir = true,
            _ => {}
        }
    }
    if saw_dir {
        Lookup::Directory
    } else {
        Lookup::NotFound
    }
}

fn etag_for(lane: &str, size: u64, modified: Option<std::time::SystemTime>) -> String {
    let (secs, nanos) = modified
        .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
        .map_or((0, 0), |d| (d.as_secs(), d.subsec_nanos()));
    format!("\"{lane}-{size:x}-{secs:x}.{nanos:x}\"")
}

fn etag_matches(header_value: &HeaderValue, etag: &str) -> bool {
    let Ok(v) = header_value.to_str() else {
        return false;
    };
    v.split(',')
        .map(str::trim)
        .any(|t| t == "*" || t.strip_prefix("W/").unwrap_or(t) == etag)
}

/// Serves a static request for the decided lane.
pub async fn serve(tree: &StaticTree, parts: &Parts, decision: &mut Decision) -> Response<Body> {
    if parts.method != Method::GET && parts.method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let Some(rel) = safe_relative(parts.uri.path(), &tree.index) else {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    };
    let lane = decision.lane.clone();
    let (path, served_lane) = // Path resolution is a few stat calls on local disk, as nginx does inline.
    match lookup(tree, &lane, &rel) {
        Lookup::Found { path, lane } => (path, lane),
        Lookup::Directory => {
            let mut loc = format!("{}/", parts.uri.path());
            if let Some(q) = parts.uri.query() {
                loc.push('?');
                loc.push_str(q);
            }
            let mut r = plain(StatusCode::MOVED_PERMANENTLY, "moved\n");
            if let Ok(v) = HeaderValue::from_str(&loc) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            return r;
        }
        Lookup::NotFound => return plain(StatusCode::NOT_FOUND, "not found\n"),
    };
    if served_lane != decision.lane {
        decision.fallback = Some("static_file_from_formal");
    }
    decision.served_lane = Some(served_lane.as_str().into());
    decision.node = Some(format!("static:{served_lane}").into());

    let file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(_) => return plain(StatusCode::NOT_FOUND, "not found\n"),
    };
    let meta = match file.metadata().await {
        Ok(m) => m,
        Err(_) => return plain(StatusCode::NOT_FOUND, "not found\n"),
    };
    let modified = meta.modified().ok();
    let etag = etag_for(&served_lane, meta.len(), modified);
    let etag_value = HeaderValue::from_str(&etag).expect("etag is ASCII");
    let cache_control = HeaderValue::from_str(&tree.cache_control)
        .unwrap_or(HeaderValue::from_static("private, no-cache"));

    let inm = parts.headers.get(header::IF_NONE_MATCH);
    if let Some(v) = inm {
        if etag_matches(v, &etag) {
            let mut r = Response::new(boxed(http_body_util::Empty::new()));
            *r.status_mut() = StatusCode::NOT_MODIFIED;
            r.headers_mut().insert(header::ETAG, etag_value);
            r.headers_mut().insert(header::CACHE_CONTROL, cache_control);
            return r;
        }
    }

    // If-Range: a validator other than ours means "send the whole file".
    let range = parts.headers.get(header::RANGE).filter(|_| {
        parts.headers.get(header::IF_RANGE).is_none_or(|ir| {
            let lm = modified.map(httpdate::fmt_http_date);
            ir.to_str()
                .is_ok_and(|s| s == etag || lm.as_deref() == Some(s))
        })
    });

    let content_type = mime_guess::from_path(&path)
        .first()
        .map(|m| match m.type_() {
            mime_guess::mime::TEXT => format!("{m}; charset=utf-8"),
            _ if m.subtype() == mime_guess::mime::JAVASCRIPT => format!("{m}; charset=utf-8"),
            _ => m.to_string(),
        });
    let resolved = ResolvedFile {
        handle: file,
        path: path.clone(),
        size: meta.len(),
        modified,
        content_type,
        encoding: None,
    };
    let mut builder = FileResponseBuilder::new();
    builder
        .is_head(parts.method == Method::HEAD)
        .range_header(range)
        // If-None-Match, when present, decides alone (RFC 9110 13.2.2).
        .if_modified_since_header(if inm.is_none() {
            parts.headers.get(header::IF_MODIFIED_SINCE)
        } else {
            None
        });
    match builder.build(resolved) {
        Ok(resp) => {
            let (mut head, body) = resp.into_parts();
            head.headers.insert(header::ETAG, etag_value);
            head.headers.insert(header::CACHE_CONTROL, cache_control);
            Response::from_parts(head, boxed(body))
        }
        Err(e) => {
            tracing::error!(error = %e, file = %path.display(), "static response failed");
            plain(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(etag_matches(&v, &etag_for("gray", 10, t)));
        assert!(!etag_matches(&v, &etag_for(FORMAL, 10, t)));
    }
}
