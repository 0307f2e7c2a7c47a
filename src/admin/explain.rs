//! Layer: admin (control plane, top; may use everything below). `/explain`: a
//! dry run of the request path for a described request — the route, the lane
//! and what decided it, the candidate nodes, the node that would be chosen next
//! and any fallback, with the balance policy, the hash key, the zone step and
//! each candidate's zone and slow-start factor. It calls the same
//! `lane::decide`, candidate choice and pick as real traffic, but only `peek`s
//! the round-robin state and records no metric or node counter (`random` and
//! `least_request` draw afresh, so their `chosen` is one possible pick).

use std::collections::BTreeMap;
use std::net::IpAddr;

use http::{Request, Response, StatusCode};
use serde::Deserialize;

use crate::base::body::Body;
use crate::base::decision::DecidedBy;
use crate::config::{Balance, FORMAL};
use crate::control::Gateway;
use crate::generation::Target;
use crate::lane::{decide_on_route, Decided};
use crate::nodes::balance::slow_start_factor;
use crate::nodes::NoCandidates;
use crate::proxy::resolve::resolve_request;

use super::{json, text};

/// A described request.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Query {
    #[serde(default)]
    pub method: Option<String>,
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub query: Option<String>,
    /// The connecting peer's address (default 127.0.0.1).
    #[serde(default)]
    pub ip: Option<IpAddr>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub cookies: BTreeMap<String, String>,
}

/// `GET /explain?method=&host=&path=&query=&ip=&header=Name:%20v&cookie=n=v&traceparent=`.
pub fn get(gw: &Gateway, raw: &str) -> Response<Body> {
    let mut q = Query::default();
    for (k, v) in form_urlencoded::parse(raw.as_bytes()) {
        match k.as_ref() {
            "method" => q.method = Some(v.into_owned()),
            "host" => q.host = Some(v.into_owned()),
            "path" => q.path = Some(v.into_owned()),
            "query" => q.query = Some(v.into_owned()),
            "ip" => match v.parse() {
                Ok(ip) => q.ip = Some(ip),
                Err(_) => return text(StatusCode::BAD_REQUEST, format!("invalid ip {v:?}")),
            },
            "header" => match v.split_once(':') {
                Some((n, val)) => {
                    q.headers
                        .insert(n.trim().to_string(), val.trim().to_string());
                }
                None => return text(StatusCode::BAD_REQUEST, "header must be Name: value"),
            },
            "traceparent" => {
                q.headers.insert("traceparent".into(), v.trim().to_string());
            }
            "cookie" => match v.split_once('=') {
                Some((n, val)) => {
                    q.cookies
                        .insert(n.trim().to_string(), val.trim().to_string());
                }
                None => return text(StatusCode::BAD_REQUEST, "cookie must be name=value"),
            },
            other => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("unknown parameter {other:?}"),
                )
            }
        }
    }
    run(gw, q)
}

/// Builds the request head that `q` describes.
fn build(q: &Query) -> Result<http::request::Parts, String> {
    let path = q.path.as_deref().unwrap_or("/");
    if !path.starts_with('/') {
        return Err("path must start with /".into());
    }
    let target = match q.query.as_deref().filter(|s| !s.is_empty()) {
        Some(query) => format!("{path}?{}", query.trim_start_matches('?')),
        None => path.to_string(),
    };
    let mut b = Request::builder()
        .method(q.method.as_deref().unwrap_or("GET"))
        .uri(target);
    if let Some(h) = &q.host {
        b = b.header(http::header::HOST, h);
    }
    for (k, v) in &q.headers {
        if k.eq_ignore_ascii_case("host") && q.host.is_some() {
            continue;
        }
        b = b.header(k, v);
    }
    if !q.cookies.is_empty() {
        let c: Vec<String> = q.cookies.iter().map(|(k, v)| format!("{k}={v}")).collect();
        b = b.header(http::header::COOKIE, c.join("; "));
    }
    b.body(())
        .map(|r| r.into_parts().0)
        .map_err(|e| format!("invalid request: {e}"))
}

/// The trace context the request would get: continued (the caller's
/// trace id and span as the parent) or new; the gateway's span id is
/// drawn per request, so none is shown.
fn trace(o: &crate::config::otel::OtelConfig, headers: &http::HeaderMap) -> serde_json::Value {
    use crate::base::trace::{hex, parse_traceparent, Sampler, TRACEPARENT};
    let given = headers.get(TRACEPARENT);
    let parsed = given.and_then(|v| parse_traceparent(v.as_bytes()));
    let sampler = Sampler::of(o);
    match parsed {
        Some((trace_id, parent, flags)) => serde_json::json!({
            "continued": true,
            "trace_id": hex(&trace_id),
            "parent_span_id": hex(&parent),
            "sampled": sampler.sampled(&trace_id, Some(flags)),
            "exported": o.traces.is_some(),
        }),
        None => serde_json::json!({
            "continued": false,
            "invalid_traceparent": given.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            "note": "a new trace is started (its id is drawn per request)",
            "sample_ratio": sampler.ratio,
            "exported": o.traces.is_some(),
        }),
    }
}

/// What the request's baggage says of the lane, and whether it is believed.
fn baggage(
    o: &crate::config::otel::OtelConfig,
    headers: &http::HeaderMap,
    peer_trusted: bool,
) -> serde_json::Value {
    use crate::base::baggage::{parse, LaneMember, BAGGAGE};
    let b = parse(headers.get_all(BAGGAGE).iter(), &o.baggage_key);
    let believable = matches!(b.lane_member(), LaneMember::Value(_));
    serde_json::json!({
        "key": o.baggage_key,
        "lane_member": b.lane,
        "problem": b.problem.map(|p| p.as_str()),
        "believed": peer_trusted && believable,
        "note": if !peer_trusted && b.lane.is_some() {
            Some("the peer is not a trusted proxy: its lane member is replaced, not believed")
        } else {
            None
        },
    })
}

/// Runs the dry run.
pub fn run(gw: &Gateway, q: Query) -> Response<Body> {
    let parts = match build(&q) {
        Ok(p) => p,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    let gen = gw.current();
    let peer = q.ip.unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let info = resolve_request(parts, peer, &gen.trusted);
    let peer_trusted = info.peer_trusted;
    let path = info.parts.uri.path();
    let mut out = serde_json::json!({
        "generation": gen.id,
        "request": {
            "method": info.parts.method.as_str(),
            "host": info.host,
            "path": path,
            "query": info.parts.uri.query(),
            "peer_ip": peer,
            "client_ip": info.client_ip,
            "peer_trusted": peer_trusted,
        },
    });
    if let Some(o) = &gen.config.otel {
        out["trace"] = trace(o, &info.parts.headers);
        if o.baggage {
            out["baggage"] = baggage(o, &info.parts.headers, peer_trusted);
        }
    } else if info
        .parts
        .headers
        .contains_key(crate::base::trace::TRACEPARENT)
    {
        out["trace"] = serde_json::json!({
            "note": "no otel: section: the gateway does not read or forward trace context",
        });
    }
    let Some(route) = gen.route(&info.host, path) else {
        out["route"] = serde_json::Value::Null;
        out["error"] = "no route".into();
        return json(out);
    };
    // Sticky routes: a valid lane cookie wins, exactly as for real traffic.
    let Decided {
        info,
        decision,
        set_cookie,
    } = decide_on_route(&gen.lane, route.sticky, info);
    out["sticky_cookie_set"] = set_cookie.is_some().into();
    out["route"] = serde_json::json!({"host": route.host, "prefix": route.prefix});
    out["lane"] = decision.lane.clone().into();
    out["decided_by"] = decision.decided_by.as_str().into();
    out["rule"] = decision.decided_by.rule_name().into();
    out["detail"] = match &decision.decided_by {
        DecidedBy::ScriptError(e) | DecidedBy::InvalidLane(e) => e.clone().into(),
        _ => serde_json::Value::Null,
    };
    match &route.target {
        Target::Service(name) => {
            out["target"] = serde_json::json!({"service": name});
            let now = crate::base::clock::now_ms();
            let service = gen.services.get(&**name);
            let picked = service.map(|s| s.choose(&decision.lane, now));
            let key = service
                .and_then(|s| s.request_key(&info.parts.headers, &info.parts.uri, info.client_ip));
            if let Some(s) = service {
                let hashing = s.select.balance == Balance::Hash;
                out["balance"] = serde_json::json!({
                    "policy": s.select.balance.as_str(),
                    "hash_key": s.select.hash_key.as_ref().filter(|_| hashing).map(|k| k.to_string()),
                    "key_present": hashing.then_some(key.is_some()),
                    "slow_start_ms": s.select.slow_start_ms,
                });
                if hashing && key.is_none() {
                    out["balance"]["note"] =
                        "the request has no hash key: picked by round_robin".into();
                }
            }
            match picked {
                Some(Ok(choice)) => {
                    let service = service.expect("a choice comes from a service");
                    let set = choice.set;
                    let fallback = choice.fallback;
                    let chosen = choice.peek(now, key).map(|i| &set.nodes[i]);
                    out["zone"] = serde_json::json!({
                        "gateway_zone": service.select.zone.as_deref(),
                        "step": choice.zone.as_str(),
                        "local_nodes": set.local_members().len(),
                        "local_healthy": set.local_healthy(now),
                        "min_healthy": service.select.zone_min_healthy,
                    });
                    out["candidates"] = set
                        .nodes
                        .iter()
                        .zip(&set.health)
                        .map(|(n, h)| {
                            serde_json::json!({
                                "name": n.name, "addr": n.addr.to_string(),
                                "lane": n.lane, "weight": n.weight,
                                "zone": n.zone.as_deref(),
                                "available": h.available(now),
                                "slow_start_factor": slow_start_factor(
                                    h.warm_since(), now, set.slow_start_ms),
                            })
                        })
                        .collect();
                    out["chosen"] = chosen.map(|n| n.name.to_string()).into();
                    out["served_lane"] = chosen.map(|n| n.lane.to_string()).into();
                    out["fallback"] = fallback.map(|f| f.as_str()).into();
                }
                Some(Err(no)) => {
                    out["candidates"] = serde_json::json!([]);
                    out["chosen"] = serde_json::Value::Null;
                    out["fallback"] = match no {
                        NoCandidates::StrictUnhealthy => "lane_unhealthy_strict".into(),
                        NoCandidates::NoNodes => serde_json::Value::Null,
                    };
                    out["error"] = match no {
                        NoCandidates::StrictUnhealthy => {
                            "every node of this lane is down and the service is strict (503)"
                        }
                        NoCandidates::NoNodes => "no upstream node for this lane (503)",
                    }
                    .into();
                }
                None => {
                    out["candidates"] = serde_json::json!([]);
                    out["chosen"] = serde_json::Value::Null;
                    out["error"] = "no such service (503)".into();
                }
            }
        }
        Target::Static(tree) => {
            let rel = info.parts.uri.path().trim_start_matches('/');
            if rel.split('/').any(|seg| seg == "..") {
                return text(StatusCode::BAD_REQUEST, "path must not contain ..");
            }
            let rel = if rel.is_empty() || rel.ends_with('/') {
                format!("{rel}{}", tree.index)
            } else {
                rel.to_string()
            };
            let own = tree.root.join(&decision.lane).join(&rel).is_file();
            let served = if own { decision.lane.as_str() } else { FORMAL };
            out["target"] = serde_json::json!({"static": tree.root});
            out["candidates"] = serde_json::json!([]);
            out["chosen"] = format!("static:{served}").into();
            out["served_lane"] = served.into();
            out["fallback"] = if served != decision.lane {
                "static_file_from_formal".into()
            } else {
                serde_json::Value::Null
            };
        }
    }
    json(out)
}
