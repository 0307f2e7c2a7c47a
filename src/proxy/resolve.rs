//! Layer: proxy — the first phase. Is the request acceptable (limits →
//! 414/431; RFC 9112's one-`Host` rule and an empty `Host` → 400; a
//! `Transfer-Encoding` other than one `chunked` → 501; header names with `_`
//! dropped, as nginx does), who is asking and for what: the host
//! (lower-case, no port; an absolute-form target's authority) and the
//! client address (from X-Forwarded-For only behind a trusted proxy).
//! Shared by real traffic, `/explain` and the fuzz entry.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Uri, Version};

use crate::base::body::RequestBody;
use crate::base::error::ErrorKind;
use crate::base::lists::IpList;
use crate::codec::fields::{count_first, first};
use crate::config::ClientConfig;
use crate::lane::RequestInfo;

/// The checks every request passes before routing: [`check_limits`], the
/// `Host` rule of RFC 9112 §3.2 (an HTTP/1.1 request has exactly one valid
/// `Host`; an absolute-form target's authority replaces it, §3.2.2), and
/// header names with underscores (dropped unless allowed; even when allowed,
/// no spelling of the tag header, `X-Forwarded-*`, `Forwarded` or
/// `X-Real-IP` with `_` passes: [`drop_underscored`]). The HTTP/1.1 side
/// applies that filter as it reads a head (it sees every name's bytes, and
/// calls it only for a head with a `_` in a name); here it runs for the
/// other heads (HTTP/2).
pub fn validate<B>(
    req: &mut Request<B>,
    limits: &ClientConfig,
    tag_header: &HeaderName,
) -> Option<ErrorKind> {
    if let Some(e) = check_limits(req, limits) {
        return Some(e);
    }
    if let Some(e) = check_host(req) {
        return Some(e);
    }
    if req.version() > Version::HTTP_11 {
        drop_underscored(req.headers_mut(), limits.underscores_in_headers, tag_header);
    }
    None
}

/// Why the request is refused, if it is: a body of a coding the HTTP/1.1
/// codec does not read (501; the codec closes the connection after the
/// answer), else [`validate`]'s (414, 431, 400). The proxy and the
/// gateway's own services (`server::Service`) refuse alike.
#[inline(always)]
pub fn refusal(
    req: &mut Request<RequestBody>,
    limits: &ClientConfig,
    tag_header: &HeaderName,
) -> Option<ErrorKind> {
    if matches!(req.body(), RequestBody::Refused) {
        Some(ErrorKind::TransferEncoding)
    } else {
        validate(req, limits, tag_header)
    }
}

/// RFC 9112 §3.2: one `Host` on HTTP/1.1, a valid authority (no userinfo);
/// the target's own authority wins over it. An empty `Host` is refused too
/// (as nginx does): nothing routes on it, and a node would read its own
/// default host into it.
fn check_host<B>(req: &mut Request<B>) -> Option<ErrorKind> {
    let (hosts, first) = count_first(req.headers(), &header::HOST);
    if hosts > 1 {
        return Some(ErrorKind::BadRequest);
    }
    match first {
        None if req.version() == Version::HTTP_11 => return Some(ErrorKind::BadRequest),
        Some(h) if h.is_empty() || !valid_authority(h.as_bytes()) => {
            return Some(ErrorKind::BadRequest)
        }
        _ => {}
    }
    if let Some(a) = req.uri().authority() {
        if a.as_str().contains('@') {
            return Some(ErrorKind::BadRequest);
        }
        let v = HeaderValue::from_str(a.as_str()).ok()?;
        req.headers_mut().insert(header::HOST, v);
    }
    None
}

/// Bytes of a Host field: RFC 3986 unreserved, sub-delims, pct-encoding,
/// and the `:` `[` `]` of ports and IPv6 literals.
const AUTHORITY: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = (c as u8).is_ascii_alphanumeric();
        c += 1;
    }
    let extra = b"-._~!$&'()*+,;=%:[]";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

/// `host[:port]` as a Host field may carry: reg-name, IPv4 or `[IPv6]`
/// bytes and a port — no userinfo (`@`), white space, `/`, `?`, `#` or
/// control bytes. One table lookup per byte (it runs on every request).
fn valid_authority(b: &[u8]) -> bool {
    b.iter().all(|&c| AUTHORITY[usize::from(c)])
}

/// The underscore filter of [`validate`] for a head the HTTP/1.1 side read
/// with a `_` in some name, before the request is handed over. A head over
/// the limits keeps its fields: `validate` answers it 431 on the whole
/// head, as for any other.
pub fn filter_underscores<B>(req: &mut Request<B>, limits: &ClientConfig, tag_header: &HeaderName) {
    if check_limits(req, limits).is_none() {
        drop_underscored(req.headers_mut(), limits.underscores_in_headers, tag_header);
    }
}

/// Removes header fields whose names contain `_` (nginx's default
/// `underscores_in_headers off`). With `allow`, only those that would read
/// as a field the gateway sets or trusts once `_` becomes `-` go.
fn drop_underscored(headers: &mut HeaderMap, allow: bool, tag_header: &HeaderName) {
    let underscored = |n: &HeaderName| n.as_str().as_bytes().contains(&b'_');
    if !headers.keys().any(underscored) {
        return;
    }
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| underscored(n))
        .filter(|n| !allow || impersonates(n.as_str(), tag_header.as_str()))
        .cloned()
        .collect();
    for n in doomed {
        headers.remove(n);
    }
}

/// Does `name` (lower-case) read as the tag header or a forwarding field
/// with `_` for `-`?
fn impersonates(name: &str, tag_header: &str) -> bool {
    let normal = name.replace('_', "-");
    normal == tag_header
        || normal.starts_with("x-forwarded-")
        || normal == "forwarded"
        || normal == "x-real-ip"
}

/// 414/431 for request targets or heads over the configured limits.
pub fn check_limits<B>(req: &Request<B>, limits: &ClientConfig) -> Option<ErrorKind> {
    let target = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len())
        + req.uri().authority().map_or(0, |a| a.as_str().len());
    if target > limits.max_uri_bytes {
        return Some(ErrorKind::UriTooLong);
    }
    let head: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if head > limits.max_header_bytes {
        return Some(ErrorKind::HeadersTooLarge);
    }
    None
}

/// Host without port, lower-case: an absolute-form target's authority
/// (RFC 9112 §3.2.2), else the Host header.
pub fn host_of(headers: &HeaderMap, uri: &Uri) -> String {
    let raw = uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| first(headers, &header::HOST).and_then(|h| h.to_str().ok()))
        .unwrap_or("");
    // Byte searches for the ASCII delimiters (cut points are char
    // boundaries): cheaper than `str` patterns on a path every request takes.
    let b = raw.as_bytes();
    let host = if b.first() == Some(&b'[') {
        // [v6]:port
        &raw[1..b.iter().position(|&c| c == b']').unwrap_or(b.len())]
    } else {
        &raw[..b.iter().rposition(|&c| c == b':').unwrap_or(b.len())]
    };
    host.to_ascii_lowercase()
}

/// The client address behind trusted proxies: the right-most
/// X-Forwarded-For entry that is not itself a trusted proxy.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &IpList) -> IpAddr {
    if !trusted.contains(peer) {
        return peer;
    }
    client_behind(peer, headers, trusted)
}

/// [`client_ip`] for a peer already known to be a trusted proxy.
fn client_behind(peer: IpAddr, headers: &HeaderMap, trusted: &IpList) -> IpAddr {
    let mut client = peer;
    let entries = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for e in entries.iter().rev() {
        match e.parse::<IpAddr>() {
            Ok(ip) => {
                client = ip;
                if !trusted.contains(ip) {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    client
}

/// The request-resolution phase shared by real traffic, `/explain` and the
/// fuzz entry: host (lower-case, no port) and the client address (from
/// X-Forwarded-For only behind a trusted proxy), and whether the peer itself
/// is a trusted proxy (`peer_trusted`).
pub fn resolve_request(parts: Parts, peer: IpAddr, trusted: &IpList) -> RequestInfo {
    let peer_trusted = trusted.contains(peer);
    let client_ip = if peer_trusted {
        client_behind(peer, &parts.headers, trusted)
    } else {
        peer
    };
    let host = host_of(&parts.headers, &parts.uri);
    RequestInfo {
        parts,
        client_ip,
        host,
        peer_trusted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::fields::Added;
    use http::header::{HeaderName, HeaderValue};
    use std::borrow::Cow;

    #[test]
    fn host_values() {
        for ok in [
            "a",
            "shop.example:8080",
            "127.0.0.1:80",
            "[::1]:8443",
            "xn--bcher-kva.ch",
        ] {
            assert!(valid_authority(ok.as_bytes()), "{ok}");
        }
        for bad in ["evil@a", "a b", "a/b", "a?b", "a#b", "a\tb"] {
            assert!(!valid_authority(bad.as_bytes()), "{bad}");
        }
    }

    /// An empty `Host` is a 400 like a missing one (HTTP/1.0 too, and
    /// beside an absolute-form target); an HTTP/1.0 request may omit it.
    #[test]
    fn empty_host_is_refused() {
        let check = |uri: &str, version: Version, host: Option<&str>| {
            let mut b = Request::builder().uri(uri).version(version);
            if let Some(h) = host {
                b = b.header(header::HOST, h);
            }
            check_host(&mut b.body(()).unwrap())
        };
        for v in [Version::HTTP_11, Version::HTTP_10] {
            assert_eq!(check("/", v, Some("")), Some(ErrorKind::BadRequest));
            assert_eq!(check("http://a/", v, Some("")), Some(ErrorKind::BadRequest));
            assert_eq!(check("/", v, Some("a")), None);
        }
        assert_eq!(check("/", Version::HTTP_10, None), None);
        assert_eq!(
            check("/", Version::HTTP_11, None),
            Some(ErrorKind::BadRequest)
        );
    }

    #[test]
    fn underscored_names_go_and_impersonations_always() {
        let tag = HeaderName::from_static("x-gray-tag");
        let mut h = HeaderMap::new();
        for n in [
            "x_gray_tag",
            "x_forwarded_for",
            "x_real_ip",
            "x_custom",
            "x-fine",
        ] {
            h.insert(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                "1".parse().unwrap(),
            );
        }
        let mut allowed = h.clone();
        drop_underscored(&mut h, false, &tag);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-fine"]);
        drop_underscored(&mut allowed, true, &tag);
        let mut left: Vec<&str> = allowed.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["x-fine", "x_custom"]);
    }

    #[test]
    fn hosts() {
        let mut h = HeaderMap::new();
        let uri: Uri = "/x".parse().unwrap();
        h.insert(header::HOST, "Example.COM:8080".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "example.com");
        h.insert(header::HOST, "[::1]:8080".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "::1");
        h.insert(header::HOST, "a.b".parse().unwrap());
        assert_eq!(host_of(&h, &uri), "a.b");
    }

    #[test]
    fn xff_from_trusted_proxies_only() {
        let trusted = IpList::from_nets(["10.0.0.0/8".parse().unwrap()]);
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "1.2.3.4, 10.0.0.7".parse().unwrap());
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let other: IpAddr = "8.8.8.8".parse().unwrap();
        assert_eq!(
            client_ip(proxy, &h, &trusted),
            "1.2.3.4".parse::<IpAddr>().unwrap()
        );
        assert_eq!(client_ip(other, &h, &trusted), other);
        let tag_name = HeaderName::from_static("x-gray-tag");
        let generation = HeaderValue::from(7u64);
        let forwarded = |peer: IpAddr, trusted: bool, host: Option<HeaderValue>| {
            let mut fwd = h.clone();
            let tag = (&tag_name, Cow::Owned(HeaderValue::from_static("gray")));
            let added = Added::new(&mut fwd, tag, &generation, peer, trusted, host);
            added.apply(&mut fwd);
            fwd
        };
        let fwd = forwarded(proxy, true, None);
        assert_eq!(fwd["x-forwarded-for"], "1.2.3.4, 10.0.0.7, 10.0.0.1");
        assert_eq!(fwd["x-gray-tag"], "gray");
        assert_eq!(fwd["x-graygate-generation"], "7");
        let mut spoofed = h.clone();
        spoofed.insert("x-gray-tag", "v2".parse().unwrap());
        spoofed.insert("x-forwarded-host", "evil".parse().unwrap());
        spoofed.append("x-forwarded-for", "6.6.6.6".parse().unwrap());
        let formal = HeaderValue::from_static("formal");
        let tag = (&tag_name, Cow::Borrowed(&formal));
        let added = Added::new(&mut spoofed, tag, &generation, other, false, None);
        assert!(spoofed.get("x-gray-tag").is_none(), "client tag removed");
        assert!(spoofed.get("x-forwarded-host").is_none());
        assert!(spoofed.get("x-forwarded-for").is_none());
        added.apply(&mut spoofed);
        assert_eq!(spoofed["x-gray-tag"], "formal");
        assert_eq!(spoofed.get_all("x-forwarded-for").iter().count(), 1);
        let fwd = forwarded(other, false, Some("h".parse().unwrap()));
        assert_eq!(fwd["x-forwarded-for"], "8.8.8.8");
        assert_eq!(fwd["x-forwarded-host"], "h");
        assert_eq!(fwd["x-forwarded-proto"], "http");
    }
}
