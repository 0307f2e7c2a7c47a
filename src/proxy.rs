//! The request path, in phases: resolve the client and route, decide the
//! lane, pick a node of that lane (or formal), rewrite the request for the
//! upstream (tag header, X-Forwarded-*, hop-by-hop headers), stream it there
//! and stream the answer back. Static routes hand off to `static_files`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::Incoming;

use crate::config::{UpstreamConfig, FORMAL};
use crate::gateway::Gateway;
use crate::generation::{Generation, Target};
use crate::lane::{self, Decision, RequestInfo};
use crate::lists::IpList;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the gateway sends.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Boxes any body into [`Body`].
pub fn boxed<B>(b: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// A short plain-text response.
pub fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from_static(text.as_bytes()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The pooled upstream client (per-thread keep-alive pools).
pub type UpstreamClient = crate::upstream::Upstream;

pub fn build_client(cfg: &UpstreamConfig) -> UpstreamClient {
    crate::upstream::Upstream::new(cfg)
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

/// Headers that describe one connection and must not be forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// Removes hop-by-hop headers, including those named in `Connection`.
/// (`Transfer-Encoding` is framing that hyper owns on each side.)
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in HOP_BY_HOP {
        headers.remove(n);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

/// Rate-limits the lane-fallback WARN per (service, lane).
#[derive(Default)]
pub struct FallbackLog(Mutex<HashMap<(String, String), Instant>>);

impl FallbackLog {
    fn should_log(&self, service: &str, lane: &str) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let key = (service.to_string(), lane.to_string());
        match m.get(&key) {
            Some(t) if now.duration_since(*t) < Duration::from_secs(10) => false,
            _ => {
                m.insert(key, now);
                true
            }
        }
    }
}

/// Serves one client request.
pub async fn handle(
    gw: &Gateway,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let gen = gw.current();
    let (parts, body) = req.into_parts();
    let host = host_of(&parts.headers, &parts.uri);
    let peer_trusted = gen.trusted.contains(peer.ip());
    let client = client_ip(peer.ip(), &parts.headers, &gen.trusted);
    let Some(route) = gen.route(&host, parts.uri.path()) else {
        return Ok(plain(StatusCode::NOT_FOUND, "no route\n"));
    };
    let info = RequestInfo {
        parts,
        client_ip: client,
        host,
    };
    let (info, mut decision) = lane::decide(&gen, info, peer_trusted);
    decision.route = Some(route.prefix.clone());
    let resp = match &route.target {
        Target::Service(name) => {
            forward(
                gw,
                &gen,
                name,
                info,
                body,
                peer,
                peer_trusted,
                &mut decision,
            )
            .await
        }
        Target::Static(tree) => crate::static_files::serve(tree, &info.parts, &mut decision).await,
    };
    tracing::debug!(
        generation = gen.id,
        lane = %decision.lane,
        decided_by = decision.decided_by.as_str(),
        node = decision.node.as_deref().unwrap_or("-"),
        fallback = decision.fallback.unwrap_or("-"),
        status = resp.status().as_u16(),
        "request"
    );
    Ok(resp)
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    gw: &Gateway,
    gen: &Generation,
    service_name: &str,
    info: RequestInfo,
    body: Incoming,
    peer: SocketAddr,
    peer_trusted: bool,
    decision: &mut Decision,
) -> Response<Body> {
    decision.service = Some(service_name.to_string());
    let Some(service) = gen.services.get(service_name) else {
        return plain(StatusCode::SERVICE_UNAVAILABLE, "no such service\n");
    };
    let Some((set, fallback)) = service.candidates(&decision.lane) else {
        return plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "no upstream node for this lane\n",
        );
    };
    if let Some(fb) = fallback {
        decision.fallback = Some(fb.as_str());
        if gw.fallback_log.should_log(service_name, &decision.lane) {
            tracing::warn!(
                service = service_name,
                lane = %decision.lane,
                lane_nodes = service.count(&decision.lane),
                formal_nodes = service.count(FORMAL),
                "no node serves this lane; sending to formal"
            );
        }
    }
    let node = set.pick().expect("candidate sets are never empty");
    decision.candidates = set.nodes.len();
    decision.served_lane = Some(node.lane.clone());
    decision.node = Some(node.name.clone());

    let RequestInfo {
        mut parts, host: _, ..
    } = info;
    let original_host = parts.headers.get(header::HOST).cloned();
    strip_hop_by_hop(&mut parts.headers);
    let tag = HeaderValue::from_str(&decision.lane).expect("lane names are header-safe");
    parts.headers.insert(gen.tag_header.clone(), tag);
    set_forwarded(&mut parts.headers, peer.ip(), peer_trusted, original_host);

    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let uri = match Uri::builder()
        .scheme("http")
        .authority(node.addr.to_string())
        .path_and_query(path_and_query)
        .build()
    {
        Ok(u) => u,
        Err(_) => return plain(StatusCode::BAD_REQUEST, "bad request target\n"),
    };
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    let upstream_req = Request::from_parts(parts, body);

    let timeout = Duration::from_millis(gen.config.upstream.response_timeout_ms);
    match tokio::time::timeout(timeout, gw.client.request(upstream_req)).await {
        Err(_) => {
            tracing::warn!(node = %node.name, addr = %node.addr, "upstream timed out");
            plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n")
        }
        Ok(Err(e)) => {
            tracing::warn!(node = %node.name, addr = %node.addr, error = %e, "upstream failed");
            if e.is_connect() {
                plain(StatusCode::BAD_GATEWAY, "upstream connect error\n")
            } else {
                plain(StatusCode::BAD_GATEWAY, "upstream error\n")
            }
        }
        Ok(Ok(resp)) => {
            let (mut head, body) = resp.into_parts();
            strip_hop_by_hop(&mut head.headers);
            Response::from_parts(head, boxed(body))
        }
    }
}

/// Sets X-Forwarded-For/-Proto/-Host. From a trusted proxy the chain is
/// extended; from anyone else client-supplied values are replaced.
fn set_forwarded(
    headers: &mut HeaderMap,
    peer: IpAddr,
    peer_trusted: bool,
    original_host: Option<HeaderValue>,
) {
    let xff = "x-forwarded-for";
    let prior = if peer_trusted {
        let joined: Vec<&str> = headers
            .get_all(xff)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        (!joined.is_empty()).then(|| joined.join(", "))
    } else {
        None
    };
    let value = match prior {
        Some(p) => format!("{p}, {peer}"),
        None => peer.to_string(),
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert(xff, v);
    }
    if !(peer_trusted && headers.contains_key("x-forwarded-proto")) {
        headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    }
    if !(peer_trusted && headers.contains_key("x-forwarded-host")) {
        match original_host {
            Some(h) => {
                headers.insert("x-forwarded-host", h);
            }
            None => {
                headers.remove("x-forwarded-host");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut fwd = h.clone();
        set_forwarded(&mut fwd, proxy, true, None);
        assert_eq!(fwd["x-forwarded-for"], "1.2.3.4, 10.0.0.7, 10.0.0.1");
        let mut fwd = h.clone();
        set_forwarded(&mut fwd, other, false, Some("h".parse().unwrap()));
        assert_eq!(fwd["x-forwarded-for"], "8.8.8.8");
        assert_eq!(fwd["x-forwarded-host"], "h");
        assert_eq!(fwd["x-forwarded-proto"], "http");
    }
}
