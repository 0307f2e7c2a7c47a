//! Layer: proxy — the first phase. Who is asking and for what: request limits
//! (414/431), the host (lower-case, no port) and the client address (from
//! X-Forwarded-For only behind a trusted proxy). Shared by real traffic,
//! `/explain` and the fuzz entry.

use std::net::IpAddr;

use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Request, Uri};

use crate::base::error::ErrorKind;
use crate::base::lists::IpList;
use crate::config::ClientConfig;
use crate::lane::RequestInfo;

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

/// Host without port, lower-case, from the Host header or the URI.
pub fn host_of(headers: &HeaderMap, uri: &Uri) -> String {
    let raw = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()))
        .unwrap_or("");
    let host = if let Some(rest) = raw.strip_prefix('[') {
        // [v6]:port
        rest.split(']').next().unwrap_or("")
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
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
        let forwarded = |peer: IpAddr, trusted: bool, host: Option<HeaderValue>| {
            let mut fwd = h.clone();
            let tag = (
                HeaderName::from_static("x-gray-tag"),
                HeaderValue::from_static("gray"),
            );
            let added = Added::new(&mut fwd, tag, HeaderValue::from(7u64), peer, trusted, host);
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
        let tag = (
            HeaderName::from_static("x-gray-tag"),
            HeaderValue::from_static("formal"),
        );
        let added = Added::new(
            &mut spoofed,
            tag,
            HeaderValue::from(7u64),
            other,
            false,
            None,
        );
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
