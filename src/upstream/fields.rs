//! Layer: upstream. What goes on the wire to a node besides the client's own
//! fields: the hop-by-hop fields that never pass a proxy (with `Expect`,
//! which the gateway answers itself), the fields the gateway adds (lane tag,
//! generation, X-Forwarded-*) and the forwarding fields an untrusted client
//! may not send, and which methods are safe to send twice.

use std::borrow::Cow;
use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Method;

use crate::codec::fields::{name_eq, SCAN_MAX};

/// Headers that describe one connection and must not be forwarded
/// (pre-parsed names: no per-request name parsing on the hot path);
/// `Transfer-Encoding` is framing, handled by each side's engine. The
/// inline upstream exchange drops these while parsing a response head.
pub const HOP_BY_HOP: [HeaderName; 8] = {
    let n = HOP_BY_HOP_NAMES;
    [
        HeaderName::from_static(n[0]),
        HeaderName::from_static(n[1]),
        HeaderName::from_static(n[2]),
        HeaderName::from_static(n[3]),
        HeaderName::from_static(n[4]),
        HeaderName::from_static(n[5]),
        HeaderName::from_static(n[6]),
        HeaderName::from_static(n[7]),
    ]
};

/// [`HOP_BY_HOP`]'s names as text.
const HOP_BY_HOP_NAMES: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// Bit `n` set: some [`HOP_BY_HOP`] name is `n` bytes long.
const HOP_BY_HOP_LENGTHS: u64 = {
    let mut m = 0u64;
    let mut i = 0;
    while i < HOP_BY_HOP_NAMES.len() {
        m |= 1 << HOP_BY_HOP_NAMES[i].len();
        i += 1;
    }
    m
};

/// Is the wire name `name` one of [`HOP_BY_HOP`] (any case)? Most names
/// are told apart by their length alone, no compare.
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    name.len() < 64
        && HOP_BY_HOP_LENGTHS >> name.len() & 1 == 1
        && HOP_BY_HOP_NAMES.iter().any(|h| name_eq(name, h.as_bytes()))
}
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// What the rewrite of a request reads of its fields ([`scan`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan<'h> {
    /// The first `Host` value.
    pub host: Option<&'h HeaderValue>,
    /// The first `Upgrade` value.
    pub upgrade: Option<&'h HeaderValue>,
    /// Some field is hop-by-hop or `Transfer-Encoding`
    /// ([`strip_hop_by_hop_found`] has work to do).
    pub hop_by_hop: bool,
}

/// [`first`] of `Host` and of `Upgrade` and whether any field is hop-by-hop
/// — one pass over a small map's names instead of three (hashed lookups
/// above [`SCAN_MAX`] values, as `first`).
pub fn scan(headers: &HeaderMap) -> Scan<'_> {
    if headers.len() > SCAN_MAX {
        return Scan {
            host: headers.get(header::HOST),
            upgrade: headers.get(header::UPGRADE),
            hop_by_hop: headers.keys().any(stripped),
        };
    }
    let mut s = Scan::default();
    for (n, v) in headers.iter() {
        if *n == header::HOST {
            s.host.get_or_insert(v);
        } else if !s.hop_by_hop || s.upgrade.is_none() {
            if *n == header::UPGRADE {
                s.upgrade.get_or_insert(v);
            }
            s.hop_by_hop |= stripped(n);
        }
    }
    s
}

/// Does [`strip_hop_by_hop`] remove fields named `n` (unless a
/// `Connection` field names others)? `Expect` too: the gateway's client
/// side answers `100 Continue` itself (hyper's server, once the body is
/// read), so the node never sees the expectation.
fn stripped(n: &HeaderName) -> bool {
    let b = n.as_str().as_bytes();
    is_hop_by_hop(b)
        || (b.len() == 17 && *n == header::TRANSFER_ENCODING)
        || (b.len() == 6 && *n == header::EXPECT)
}

/// Removes hop-by-hop headers, including those named in `Connection`
/// (from a node's response: nothing is kept from its tokens).
/// (`Transfer-Encoding` is framing that each side's engine owns.)
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass comparing names (cheap for the
    // standard ones) instead of nine hashed removals.
    if headers.keys().any(stripped) {
        strip_found(headers, None);
    }
}

/// Removes a client request's hop-by-hop headers once one is known to be
/// there ([`Scan::hop_by_hop`]), including those its `Connection` names —
/// except the fields the gateway routes on or sets itself ([`protected`],
/// and `tag_header`): a `Connection: host` must not make the node see
/// another host than the one the request was routed on.
pub fn strip_hop_by_hop_found(headers: &mut HeaderMap, tag_header: &HeaderName) {
    strip_found(headers, Some(tag_header));
}

fn strip_found(headers: &mut HeaderMap, tag_header: Option<&HeaderName>) {
    if headers.contains_key(header::CONNECTION) {
        strip_connection_named(headers, tag_header);
    }
    for n in &HOP_BY_HOP {
        headers.remove(n);
    }
    headers.remove(header::TRANSFER_ENCODING);
    headers.remove(header::EXPECT);
}

/// Fields a request's `Connection` tokens never remove: `Host` (what the
/// request was routed on) and the fields the gateway sets or reads from a
/// trusted proxy (the generation, `X-Forwarded-*`, `Forwarded`,
/// `X-Real-IP`); with `tag_header`, the lane tag.
fn protected(n: &HeaderName, tag_header: &HeaderName) -> bool {
    *n == header::HOST || n == tag_header || *n == GENERATION_HEADER || forwarding(n)
}

fn strip_connection_named(headers: &mut HeaderMap, tag_header: Option<&HeaderName>) {
    // `keep-alive`, `close` and `upgrade` are the usual tokens; the first
    // and last are removed anyway, `close` names no header.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| {
            !["keep-alive", "close", "upgrade"]
                .iter()
                .any(|k| t.eq_ignore_ascii_case(k))
        })
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .filter(|n| tag_header.is_none_or(|tag| !protected(n, tag)))
        .collect();
    for n in named {
        headers.remove(n);
    }
}

/// A forwarding field: `X-Forwarded-*` (any suffix), `Forwarded` or
/// `X-Real-IP` — what a node may take for the gateway's word about the
/// client. Names are lower-case; most are told apart by length or their
/// first byte.
pub fn forwarding(n: &HeaderName) -> bool {
    let b = n.as_str().as_bytes();
    match b.first() {
        Some(b'x') => {
            (b.len() >= 12 && b.starts_with(b"x-forwarded-")) || (b.len() == 9 && b == b"x-real-ip")
        }
        Some(b'f') => *n == header::FORWARDED,
        _ => false,
    }
}

/// Header carrying the serving generation's id upstream, so a backend (and
/// the reload tests) can tell which configuration routed a request.
pub const GENERATION_HEADER: HeaderName = HeaderName::from_static("x-graygate-generation");

/// Methods safe to send twice (RFC 9110 9.2.2).
pub fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// `ip` as a header value; the last one is cached per thread (a worker's
/// clients are mostly few, often one load balancer).
fn ip_header_value(ip: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((cached, v)) if *cached == ip => v.clone(),
            _ => {
                let v = HeaderValue::from_str(&ip.to_string()).expect("an IP is a header value");
                *last = Some((ip, v.clone()));
                v
            }
        }
    })
}

/// Names of the fields [`Added`] sets, as statics it can borrow.
static XFF_NAME: HeaderName = X_FORWARDED_FOR;
static PROTO_NAME: HeaderName = X_FORWARDED_PROTO;
static HOST_NAME: HeaderName = X_FORWARDED_HOST;
static GENERATION_NAME: HeaderName = GENERATION_HEADER;

/// The fields the gateway sets on an upstream request: the lane tag, the
/// generation, and X-Forwarded-For/-Proto/-Host. From a trusted proxy the
/// X-Forwarded-For chain is extended and its -Proto/-Host (and other
/// forwarding fields) are kept; from anyone else client-supplied values are
/// replaced, and its other forwarding fields removed. Names and values the
/// generation holds (the tag header, a served lane's tag, the generation
/// id) are borrowed, not cloned per request.
pub struct Added<'a> {
    fields: [Option<(&'a HeaderName, Cow<'a, HeaderValue>)>; 5],
}

impl<'a> Added<'a> {
    /// Computes the fields and removes from `headers` the client's copies
    /// they replace.
    pub fn new(
        headers: &mut HeaderMap,
        tag: (&'a HeaderName, Cow<'a, HeaderValue>),
        generation: &'a HeaderValue,
        peer: IpAddr,
        peer_trusted: bool,
        original_host: Option<HeaderValue>,
    ) -> Added<'a> {
        let prior = if peer_trusted {
            let joined: Vec<&str> = headers
                .get_all(X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            (!joined.is_empty()).then(|| joined.join(", "))
        } else {
            None
        };
        let xff = match prior {
            Some(p) => HeaderValue::from_str(&format!("{p}, {peer}")).ok(),
            None => Some(ip_header_value(peer)),
        };
        let keep_proto = peer_trusted && headers.contains_key(X_FORWARDED_PROTO);
        let keep_host = peer_trusted && headers.contains_key(X_FORWARDED_HOST);
        // From anyone but a trusted proxy every forwarding field goes
        // (`X-Forwarded-Port`, `-Prefix`, `Forwarded`, `X-Real-IP`, …): the
        // node reads only what the gateway itself says about the client.
        let replaced = |n: &HeaderName| {
            n == tag.0
                || *n == GENERATION_HEADER
                || *n == X_FORWARDED_FOR
                || (!keep_proto && *n == X_FORWARDED_PROTO)
                || (!keep_host && *n == X_FORWARDED_HOST)
                || (!peer_trusted && forwarding(n))
        };
        // Usually the client sent none of them: one pass over the names.
        if headers.keys().any(replaced) {
            let names: Vec<HeaderName> = headers.keys().filter(|n| replaced(n)).cloned().collect();
            for n in names {
                headers.remove(n);
            }
        }
        Added {
            fields: [
                Some(tag),
                Some((&GENERATION_NAME, Cow::Borrowed(generation))),
                xff.map(|v| (&XFF_NAME, Cow::Owned(v))),
                (!keep_proto).then(|| (&PROTO_NAME, Cow::Owned(HeaderValue::from_static("http")))),
                original_host
                    .filter(|_| !keep_host)
                    .map(|h| (&HOST_NAME, Cow::Owned(h))),
            ],
        }
    }

    /// The client came over TLS: `X-Forwarded-Proto: https` (unless a
    /// trusted proxy's own value is kept).
    pub fn https(&mut self) {
        if let Some((n, v)) = &mut self.fields[3] {
            if **n == X_FORWARDED_PROTO {
                *v = Cow::Owned(HeaderValue::from_static("https"));
            }
        }
    }

    /// No fields (the gateway's own requests: health probes, webhooks).
    pub const fn none() -> Added<'static> {
        Added {
            fields: [None, None, None, None, None],
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.fields.iter().flatten().map(|(n, v)| (*n, v.as_ref()))
    }

    /// Puts the fields into `headers` (for engines that take a whole map).
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in self.iter() {
            headers.insert(n.clone(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::fields::first;

    /// The fast names are exactly what `from_bytes` makes, in any case;
    /// anything else goes to `from_bytes`.
    #[test]
    fn is_hop_by_hop_matches_the_list() {
        for h in &HOP_BY_HOP {
            let n = h.as_str().as_bytes();
            assert!(
                is_hop_by_hop(n) && is_hop_by_hop(&n.to_ascii_uppercase()),
                "{h}"
            );
        }
        for n in [
            "content-type",
            "x-te",
            "teh",
            "connections",
            "trailers",
            "",
            "t",
        ] {
            assert!(!is_hop_by_hop(n.as_bytes()), "{n}");
        }
        assert!(!is_hop_by_hop(&[b'a'; 70]));
    }

    /// `scan` reads what `first(Host)`, `first(Upgrade)` and
    /// `strip_hop_by_hop`'s check read, on small and large maps, with each
    /// hop-by-hop name (any position, repeated values) and none.
    #[test]
    fn scan_agrees_with_first_and_the_hop_by_hop_check() {
        let hop: Vec<Option<HeaderName>> = std::iter::once(None)
            .chain(HOP_BY_HOP.iter().cloned().map(Some))
            .chain([Some(header::TRANSFER_ENCODING)])
            .collect();
        for extra in [0usize, 2, SCAN_MAX + 3] {
            for h_name in &hop {
                for at in [0usize, 1, extra] {
                    let mut h = HeaderMap::new();
                    for i in 0..extra.max(at) {
                        if i == at {
                            if let Some(n) = h_name {
                                h.append(n.clone(), HeaderValue::from_static("h1"));
                            }
                        }
                        h.append(
                            HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap(),
                            HeaderValue::from_static("v"),
                        );
                    }
                    h.append(header::HOST, HeaderValue::from_static("a"));
                    h.append(header::HOST, HeaderValue::from_static("b"));
                    if let Some(n) = h_name {
                        h.append(n.clone(), HeaderValue::from_static("h2"));
                    }
                    let want = Scan {
                        host: first(&h, &header::HOST),
                        upgrade: first(&h, &header::UPGRADE),
                        hop_by_hop: h
                            .keys()
                            .any(|n| n == header::TRANSFER_ENCODING || HOP_BY_HOP.contains(n)),
                    };
                    assert_eq!(want.hop_by_hop, h_name.is_some());
                    assert_eq!(scan(&h), want, "{h_name:?} at {at} with {extra}");
                }
            }
        }
    }

    #[test]
    fn https_sets_forwarded_proto_unless_a_trusted_proxy_said_it() {
        let name = HeaderName::from_static("x-gray-tag");
        let tag = || (&name, Cow::Owned(HeaderValue::from_static("formal")));
        let generation = HeaderValue::from(1u64);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let mut h = HeaderMap::new();
        let mut a = Added::new(&mut h, tag(), &generation, peer, false, None);
        a.https();
        a.apply(&mut h);
        assert_eq!(h[X_FORWARDED_PROTO], "https");
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        let mut a = Added::new(&mut h, tag(), &generation, peer, true, None);
        a.https();
        a.apply(&mut h);
        assert_eq!(
            h[X_FORWARDED_PROTO], "http",
            "the trusted proxy's own value is kept"
        );
    }

    /// A request's `Connection` tokens remove what they name, except Host,
    /// the tag header and the fields the gateway sets or trusts; `Expect`
    /// goes with the hop-by-hop fields. A response's tokens keep nothing.
    #[test]
    fn connection_tokens_never_remove_what_the_gateway_routes_on_or_sets() {
        let tag = HeaderName::from_static("x-gray-tag");
        let request = || {
            let mut h = HeaderMap::new();
            h.insert(
                header::CONNECTION,
                "host, X-Gray-Tag, x-graygate-generation, x-forwarded-for, x-forwarded-port, forwarded, x-real-ip, x-secret"
                    .parse()
                    .unwrap(),
            );
            for n in [
                "host",
                "x-gray-tag",
                "x-graygate-generation",
                "x-forwarded-for",
                "x-forwarded-port",
                "forwarded",
                "x-real-ip",
                "x-secret",
                "expect",
            ] {
                h.insert(HeaderName::from_static(n), "1".parse().unwrap());
            }
            h
        };
        let mut h = request();
        assert!(scan(&h).hop_by_hop);
        strip_hop_by_hop_found(&mut h, &tag);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(
            left,
            [
                "forwarded",
                "host",
                "x-forwarded-for",
                "x-forwarded-port",
                "x-gray-tag",
                "x-graygate-generation",
                "x-real-ip"
            ]
        );
        let mut h = request();
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        let mut h = HeaderMap::new();
        h.insert(header::EXPECT, "100-continue".parse().unwrap());
        assert!(scan(&h).hop_by_hop);
    }

    /// From an untrusted peer every forwarding field is removed (or
    /// replaced by the gateway's own); a trusted proxy's are kept.
    #[test]
    fn forwarding_fields_of_untrusted_peers_go() {
        let name = HeaderName::from_static("x-gray-tag");
        let generation = HeaderValue::from(1u64);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let fields = [
            "x-real-ip",
            "forwarded",
            "x-forwarded-port",
            "x-forwarded-prefix",
            "x-forwarded-ssl",
            "x-forwarded-for",
            "x-forwarded-proto",
            "x-forwarded-host",
        ];
        for trusted in [false, true] {
            let mut h = HeaderMap::new();
            for n in fields {
                h.insert(HeaderName::from_static(n), "6.6.6.6".parse().unwrap());
            }
            h.insert("x-forwarded", "k".parse().unwrap());
            h.insert("x-real-ipx", "k".parse().unwrap());
            let tag = (&name, Cow::Owned(HeaderValue::from_static("formal")));
            let added = Added::new(&mut h, tag, &generation, peer, trusted, None);
            added.apply(&mut h);
            for n in fields {
                let spoofed = h.get_all(n).iter().any(|v| v == "6.6.6.6");
                let want = trusted && n != "x-forwarded-for";
                assert_eq!(spoofed, want, "{n}, trusted {trusted}: {h:?}");
            }
            assert_eq!(
                h["x-forwarded-for"],
                if trusted {
                    "6.6.6.6, 10.0.0.1"
                } else {
                    "10.0.0.1"
                }
            );
            assert!(h.contains_key("x-forwarded") && h.contains_key("x-real-ipx"));
        }
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, X-Secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-keep", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }
}
