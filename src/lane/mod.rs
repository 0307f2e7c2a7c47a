//! Layer: lane decision (data plane, beside nodes; uses base and config).
//! Request → lane. The sources — a trusted proxy's tag, deny rules, a sticky
//! cookie, release steps, declarative rules, the Lua script — are walked in
//! one order ([`precedence`], documented on [`DecidedBy`]); anything
//! missing, invalid or failing means `formal`. The outcome is a
//! [`Decision`] that the proxy, logs, metrics and the explain endpoint read.
//! This module holds what the sources read: the request ([`RequestInfo`])
//! and the generation's [`LanePolicy`].

pub mod budget;
pub mod jit_probe;
pub(crate) mod lent;
mod native;
pub mod ngx;
pub mod precedence;
pub mod rules;
pub mod script;
pub mod shared_dict;
pub mod sticky;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderName, HeaderValue};

use crate::base::lists::IpList;

/// What a lane decision reads: the request head plus the resolved client.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub parts: Parts,
    /// The client address: the peer, or from X-Forwarded-For when the peer
    /// is a trusted proxy.
    pub client_ip: IpAddr,
    /// Host without port, lower-case.
    pub host: String,
    /// Is the direct peer a trusted proxy (whose tag header is honoured)?
    pub peer_trusted: bool,
}

/// `ip` as text, as its `Display` writes it (`ngx.var.remote_addr`): an
/// IPv4 address by hand, since `to_string` pads each octet through the
/// formatter at several times the cost.
pub(crate) fn ip_text(ip: std::net::IpAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(15);
    ip_text_into(ip, &mut out);
    out
}

/// [`ip_text`] appended to `out` (no buffer of its own).
pub(crate) fn ip_text_into(ip: std::net::IpAddr, out: &mut Vec<u8>) {
    let std::net::IpAddr::V4(v4) = ip else {
        out.extend_from_slice(ip.to_string().as_bytes());
        return;
    };
    for (i, o) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            out.push(b'.');
        }
        if o >= 100 {
            out.push(b'0' + o / 100);
        }
        if o >= 10 {
            out.push(b'0' + o / 10 % 10);
        }
        out.push(b'0' + o % 10);
    }
}

/// `https` for a request that came over TLS, else `http`
/// (`ngx.var.scheme`, `req.scheme`).
pub fn scheme(r: &RequestInfo) -> &'static str {
    if r.parts.extensions.get::<crate::base::Https>().is_some() {
        "https"
    } else {
        "http"
    }
}

impl RequestInfo {
    /// Header by name, case-insensitive (the first value when repeated).
    pub fn header(&self, name: &str) -> Option<&HeaderValue> {
        self.header_bytes(name.as_bytes())
    }

    /// [`RequestInfo::header`] for a name given as bytes (from Lua).
    ///
    /// A request with few distinct header names is scanned, comparing
    /// lengths first and then bytes case-insensitively: cheaper than
    /// `HeaderMap::get(&str)`, which lower-cases the name into a buffer,
    /// hashes it and probes, where a scanned entry costs a length compare.
    /// Larger maps are hashed. A name
    /// that is not a valid header name matches nothing either way (stored
    /// names are valid lower-case tokens).
    pub fn header_bytes(&self, name: &[u8]) -> Option<&HeaderValue> {
        let h = &self.parts.headers;
        if h.keys_len() <= HEADER_SCAN_MAX {
            h.iter()
                .find(|(k, _)| {
                    let k = k.as_str().as_bytes();
                    k.len() == name.len() && k.eq_ignore_ascii_case(name)
                })
                .map(|(_, v)| v)
        } else {
            std::str::from_utf8(name).ok().and_then(|n| h.get(n))
        }
    }

    /// Cookie value by exact name, from any Cookie header.
    pub fn cookie(&self, name: &str) -> Option<&str> {
        cookie_value(&self.parts.headers, name)
    }

    /// First query argument `name`, percent-decoded.
    pub fn arg(&self, name: &str) -> Option<String> {
        let q = self.parts.uri.query()?;
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    }
}

/// Up to this many distinct header names a lookup scans the map instead of
/// hashing the name (see [`RequestInfo::header_bytes`]).
const HEADER_SCAN_MAX: usize = 16;

/// Finds a cookie by name in the request's Cookie headers.
pub fn cookie_value<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim_matches('"'))
}

pub use crate::base::decision::{DecidedBy, Decision, LaneName};
pub use precedence::{decide, decide_on_route, Decided};

/// Everything the lane decision reads from a generation.
#[derive(Debug)]
pub struct LanePolicy {
    /// Header carrying the lane upstream (and, from trusted proxies, in).
    pub tag_header: HeaderName,
    /// The W3C baggage member carrying the lane (`otel.baggage_key`), when
    /// baggage is on: believed from trusted proxies, after the tag header.
    pub baggage_key: Option<Arc<str>>,
    /// Named IP lists (`graygate.in_list`, rule conditions).
    pub lists: Arc<BTreeMap<String, IpList>>,
    /// Declarative gray rules (inline or from `rules_file`).
    pub rules: Option<rules::Rules>,
    pub script: Option<script::ScriptSource>,
    /// The sticky-cookie signer, when configured.
    pub sticky: Option<sticky::Sticky>,
    /// Lanes some node or static tree serves (a sticky cookie naming any
    /// other lane is ignored).
    pub served_lanes: BTreeSet<String>,
    /// Progressive releases' current steps, as rules (`release:<name>`,
    /// scoped to the release's routes by path prefix).
    pub releases: Option<rules::Rules>,
    /// Lanes rolled back by a release: never decided, never kept by a
    /// sticky cookie.
    pub revoked: BTreeSet<String>,
}

/// MurmurHash3 x86 32-bit, seed 0.
pub fn murmur3(data: &[u8]) -> u32 {
    mur3::murmurhash3_x86_32(data, 0)
}

/// Stable percentage bucket 0..=99: floorMod(hash as a signed 32-bit int,
/// 100), as Java-based gray systems compute it.
pub fn bucket(data: &[u8]) -> u32 {
    (murmur3(data) as i32).rem_euclid(100) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_text_writes_what_display_writes() {
        let mut ips: Vec<std::net::IpAddr> = ["::1", "2001:db8::7", "::ffff:10.0.0.1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        for o in [0u8, 1, 9, 10, 42, 99, 100, 109, 110, 199, 200, 250, 255] {
            ips.push(std::net::Ipv4Addr::new(o, 255 - o, o / 2, 7).into());
        }
        for ip in ips {
            assert_eq!(ip_text(ip), ip.to_string().into_bytes(), "{ip}");
        }
    }

    #[test]
    fn murmur3_reference_vectors() {
        assert_eq!(murmur3(b""), 0);
        assert_eq!(murmur3(b"hello"), 0x248b_fa47);
        assert_eq!(
            murmur3(b"The quick brown fox jumps over the lazy dog"),
            0x2e4f_f723
        );
    }

    #[test]
    fn bucket_is_floor_mod_of_signed_hash() {
        // 0x248bfa47 is 613153351, whose floorMod by 100 is 51.
        assert_eq!(bucket(b"hello"), 51);
        // A hash with the top bit set is negative as an i32: floorMod keeps
        // the bucket in 0..100.
        for i in 0..2000 {
            let s = format!("user-{i}");
            let h = murmur3(s.as_bytes()) as i32;
            let b = bucket(s.as_bytes());
            assert!(b < 100);
            assert_eq!(i64::from(b), (i64::from(h) % 100 + 100) % 100);
        }
    }

    #[test]
    fn header_lookup_scans_small_maps_and_hashes_large_ones_alike() {
        // Both sides of HEADER_SCAN_MAX: case-insensitive, the first of
        // repeated values, nothing for absent or invalid names.
        for extra in [0, HEADER_SCAN_MAX + 4] {
            let mut b = http::Request::builder().uri("/");
            for i in 0..extra {
                b = b.header(format!("x-filler-{i}"), "f");
            }
            b = b
                .header("X-Gray", "1")
                .header("accept", "a")
                .header("Accept", "b")
                .header("x-gra", "short");
            let (parts, _) = b.body(()).unwrap().into_parts();
            let r = RequestInfo {
                parts,
                client_ip: "127.0.0.1".parse().unwrap(),
                host: "h".into(),
                peer_trusted: false,
            };
            assert_eq!(r.parts.headers.keys_len() > HEADER_SCAN_MAX, extra > 0);
            let get = |n: &str| r.header(n).map(|v| v.to_str().unwrap().to_string());
            assert_eq!(get("x-gray").as_deref(), Some("1"), "{extra}");
            assert_eq!(get("X-GRAY").as_deref(), Some("1"), "{extra}");
            assert_eq!(get("X-Gra").as_deref(), Some("short"), "{extra}");
            assert_eq!(get("ACCEPT").as_deref(), Some("a"), "{extra}");
            assert_eq!(get("x-gray-"), None, "{extra}");
            assert_eq!(get("x gray"), None, "{extra}");
            assert_eq!(get(""), None, "{extra}");
            assert_eq!(r.header_bytes(b"X-GR\xc1Y"), None, "{extra}");
        }
    }

    #[test]
    fn cookies_by_exact_name() {
        let mut h = http::HeaderMap::new();
        h.append(http::header::COOKIE, "a=1; gray=yes".parse().unwrap());
        h.append(http::header::COOKIE, "uid=\"42\"".parse().unwrap());
        assert_eq!(cookie_value(&h, "gray"), Some("yes"));
        assert_eq!(cookie_value(&h, "uid"), Some("42"));
        assert_eq!(cookie_value(&h, "Gray"), None);
    }
}
