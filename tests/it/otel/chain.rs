//! client → edge graygate (lane by script) → service A (Python, OTel
//! instrumented, no lane code; calls B from a thread pool) → internal
//! graygate (trusts A's address, no script: the lane comes from baggage
//! alone) → service B. Each tier has one instance per lane, named
//! `a-<lane>` / `b-<lane>`. Every process sends its spans to one OTLP
//! receiver.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{Py, Receiver};
use crate::harness::*;

const LANES: [&str; 3] = ["formal", "gray", "gray-a"];

struct Chain {
    fx: Fixture,
    edge: Gateway,
    internal: Gateway,
    receiver: Receiver,
    _a: Py,
    _b: Py,
}

fn otel(service: &str, r: &Receiver) -> String {
    format!(
        "otel:\n  service_name: {service}\n  traces:\n    endpoint: {}\n    sample_ratio: 1.0\n    flush_interval_ms: 100\n",
        r.endpoint()
    )
}

/// One tier of services (`a` or `b`), an instance per lane.
fn tier(name: &str, receiver: &Receiver, next: Option<&str>) -> Py {
    let serve: Vec<String> = LANES.iter().map(|l| format!("{name}-{l}:0")).collect();
    let service_name = format!("svc-{name}");
    let endpoint = receiver.endpoint();
    let mut args: Vec<&str> = Vec::new();
    for s in &serve {
        args.extend(["--serve", s]);
    }
    args.extend(["--otlp", &endpoint, "--service-name", &service_name]);
    if let Some(n) = next {
        args.extend(["--next", n]);
    }
    Py::start("svc.py", &args)
}

/// The tier's node file: service `name`, a node per lane.
fn tier_nodes(fx: &Fixture, py: &Py, name: &str) {
    let nodes = LANES.map(|l| {
        let node = format!("{name}-{l}");
        let addr = SocketAddr::from(([127, 0, 0, 1], py.port_of(&node)));
        Node::new(&node, addr).lane(l)
    });
    Nodes::new()
        .service(Service::new(name).nodes(nodes))
        .write(fx, &format!("{name}-nodes.yaml"));
}

fn start() -> Chain {
    let receiver = Receiver::start();
    let fx = Fixture::new();
    let b = tier("b", &receiver, None);
    tier_nodes(&fx, &b, "b");
    let internal = Config::new()
        .node_files(&["b-nodes.yaml"])
        .route_all("b")
        .raw("trusted_proxies: [127.0.0.1/32]\n")
        .raw("access_log: { path: internal.log, format: json }\n")
        .raw(&otel("graygate-internal", &receiver))
        .start(&fx, "internal.yaml");
    let next = format!("http://{}/", internal.addr);
    let a = tier("a", &receiver, Some(&next));
    tier_nodes(&fx, &a, "a");
    fx.write(
        "lane.lua",
        "return function(req) return req:header('X-Lane') end\n",
    );
    let edge = Config::new()
        .script("lane.lua")
        .node_files(&["a-nodes.yaml"])
        .route_all("a")
        .raw("access_log: { path: edge.log, format: json }\n")
        .raw(&otel("graygate-edge", &receiver))
        .start(&fx, "edge.yaml");
    Chain {
        fx,
        edge,
        internal,
        receiver,
        _a: a,
        _b: b,
    }
}

/// The baggage a service saw starts with the gateway's lane member.
fn lane_member_first(seen: &serde_json::Value, lane: &str) -> bool {
    seen.as_str()
        .is_some_and(|b| b.split(',').next() == Some(&format!("graygate.lane={lane}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lane_rides_in_baggage_through_instrumented_services_with_no_lane_code() {
    let c = start();
    // Forged baggage from the outside client: formal at both gateways, the
    // client's other members kept all the way.
    let r = Req::get("/")
        .header("baggage", "graygate.lane=gray,userId=7")
        .send(c.edge.addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(
        (&j["svc"], &j["next"]["svc"]),
        (&"a-formal".into(), &"b-formal".into()),
        "{j}"
    );
    assert_eq!(j["baggage"], "graygate.lane=formal,userId=7", "{j}");
    assert!(lane_member_first(&j["next"]["baggage"], "formal"), "{j}");
    assert!(
        j["next"]["baggage"].as_str().unwrap().contains("userId=7"),
        "{j}"
    );
    // … and straight at the internal gateway from an address it does not trust.
    let r = Req::get("/")
        .from_ip("127.0.0.5")
        .header("baggage", "graygate.lane=gray")
        .send(c.internal.addr)
        .await;
    assert_eq!(r.json()["svc"], "b-formal");
    assert_eq!(r.json()["baggage"], "graygate.lane=formal");
    // From its trusted peer the member decides, as /explain says; from
    // anyone else it is not believed.
    for (ip, lane, by, believed) in [
        ("127.0.0.1", "gray-a", "trusted_baggage", true),
        ("127.0.0.5", "formal", "default", false),
    ] {
        let e = c
            .internal
            .admin_get(&format!(
                "/explain?ip={ip}&header=baggage:%20graygate.lane%3Dgray-a"
            ))
            .await
            .json();
        assert_eq!(
            (&e["lane"], &e["decided_by"]),
            (&lane.into(), &by.into()),
            "{e}"
        );
        assert_eq!(e["baggage"]["believed"], believed, "{e}");
    }
    // Malformed baggage, even from the trusted peer, is ignored (formal),
    // counted, and its bad member not forwarded.
    let r = Req::get("/")
        .header("baggage", "graygate.lane=gray,not a member")
        .send(c.internal.addr)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["svc"], "b-formal");
    assert_eq!(r.json()["baggage"], "graygate.lane=formal");
    assert_eq!(
        c.internal
            .metric("graygate_baggage_problems_total{problem=\"malformed\"}")
            .await,
        Some(1.0)
    );

    // Randomized: lanes, forged members, 8 clients at once; the lane at B
    // must be the one the edge decided, every time.
    const TOTAL: usize = 2000;
    let next = Arc::new(AtomicUsize::new(0));
    let addr = c.edge.addr;
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let next = next.clone();
            tokio::spawn(async move {
                let mut wrong = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < TOTAL {
                    let lane = LANES[fastrand::usize(..3)];
                    let mut req = Req::get("/").header("X-Lane", lane);
                    let forged = fastrand::bool();
                    let user = fastrand::u32(..);
                    if forged {
                        let other = LANES[fastrand::usize(..3)];
                        req =
                            req.header("baggage", &format!("graygate.lane={other},userId={user}"));
                    }
                    let r = req.send(addr).await;
                    let j = r.json();
                    let ok = r.status == 200
                        && j["svc"] == format!("a-{lane}")
                        && j["next"]["svc"] == format!("b-{lane}")
                        && lane_member_first(&j["baggage"], lane)
                        && lane_member_first(&j["next"]["baggage"], lane)
                        && (!forged
                            || j["next"]["baggage"]
                                .as_str()
                                .is_some_and(|b| b.contains(&format!("userId={user}"))));
                    if !ok {
                        wrong.push(format!("{lane} forged={forged}: {} {}", r.status, r.text()));
                    }
                }
                wrong
            })
        })
        .collect();
    let mut wrong = Vec::new();
    for c in clients {
        wrong.extend(c.await.unwrap());
    }
    assert!(
        wrong.is_empty(),
        "{} of {TOTAL} requests crossed lanes or lost baggage, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
    // The internal gateway decided every one of them by trusted baggage.
    let by: Vec<serde_json::Value> = c.fx.json_lines("internal.log");
    let trusted = by
        .iter()
        .filter(|l| l["decided_by"] == "trusted_baggage")
        .count();
    assert!(trusted > TOTAL, "{trusted} lines decided by baggage");
}

fn attr<'a>(span: &'a serde_json::Value, key: &str) -> &'a serde_json::Value {
    &span["attributes"][key]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_spans_reach_an_otlp_receiver_with_their_attributes_and_parents() {
    let c = start();
    let mut sent = Vec::new();
    for i in 0..9 {
        let lane = LANES[i % 3];
        let trace_id = super::hex_id(16);
        let client_span = super::hex_id(8);
        let r = Req::get("/")
            .header("X-Lane", lane)
            .header("traceparent", &format!("00-{trace_id}-{client_span}-01"))
            .header("tracestate", "vendor=opaque")
            .send(c.edge.addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        sent.push((trace_id, client_span, lane, r.json()));
    }
    let of = |spans: &[serde_json::Value], trace: &str, svc: &str| -> Vec<serde_json::Value> {
        spans
            .iter()
            .filter(|s| s["trace_id"] == trace && s["service"] == svc)
            .cloned()
            .collect()
    };
    let complete = |spans: &[serde_json::Value]| {
        sent.iter().all(|(t, ..)| {
            ["graygate-edge", "graygate-internal", "svc-a", "svc-b"]
                .iter()
                .all(|svc| !of(spans, t, svc).is_empty())
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = c.receiver.spans().await;
        if complete(&spans) {
            break spans;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not every hop's span reached the receiver in 30 s: {spans:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = c.fx.json_lines("edge.log");
    for (trace, client_span, lane, seen) in &sent {
        // One gateway span per request at each gateway.
        let edge = of(&spans, trace, "graygate-edge");
        assert_eq!(edge.len(), 1, "{edge:?}");
        let e = &edge[0];
        // The edge continues the client's trace: its parent is the client's span.
        assert_eq!(e["parent_span_id"], *client_span, "{e}");
        assert_eq!(e["kind"], 2, "a server span: {e}");
        assert_eq!(e["name"], "GET /");
        assert_eq!(e["scope"], "graygate");
        assert_eq!(attr(e, "graygate.lane"), lane);
        assert_eq!(attr(e, "graygate.decided_by"), "script");
        assert_eq!(attr(e, "http.route"), "/");
        assert_eq!(attr(e, "graygate.service"), "a");
        assert_eq!(attr(e, "graygate.node"), &format!("a-{lane}"));
        assert_eq!(attr(e, "http.response.status_code"), 200);
        assert_eq!(attr(e, "graygate.upstream_status"), 200);
        assert_eq!(attr(e, "graygate.retries"), 0);
        // A was called with the edge's span as its parent, and its server
        // span says so.
        let edge_span = e["span_id"].as_str().unwrap();
        assert_eq!(seen["traceparent"], format!("00-{trace}-{edge_span}-01"));
        assert_eq!(
            seen["tracestate"], "vendor=opaque",
            "the caller's tracestate goes on"
        );
        let a = of(&spans, trace, "svc-a");
        assert!(a.iter().any(|s| s["parent_span_id"] == edge_span), "{a:?}");
        // The internal gateway's span hangs under one of A's spans (its
        // outbound call), and B's server span under it.
        let internal = of(&spans, trace, "graygate-internal");
        assert_eq!(internal.len(), 1, "{internal:?}");
        let i = &internal[0];
        assert!(
            a.iter().any(|s| s["span_id"] == i["parent_span_id"]),
            "{i} under {a:?}"
        );
        assert_eq!(attr(i, "graygate.decided_by"), "trusted_baggage");
        assert_eq!(attr(i, "graygate.lane"), lane);
        assert_eq!(attr(i, "graygate.node"), &format!("b-{lane}"));
        let internal_span = i["span_id"].as_str().unwrap();
        assert_eq!(
            seen["next"]["traceparent"],
            format!("00-{trace}-{internal_span}-01")
        );
        let b = of(&spans, trace, "svc-b");
        assert!(
            b.iter().any(|s| s["parent_span_id"] == internal_span),
            "{b:?}"
        );
        // The access log line carries the same ids.
        let line = log
            .iter()
            .find(|l| l["trace_id"] == *trace)
            .expect("logged");
        assert_eq!(line["span_id"], edge_span);
    }
    assert!(
        c.edge
            .metric("graygate_otel_spans_total{outcome=\"exported\"}")
            .await
            .unwrap_or(0.0)
            >= 9.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_requests_nothing_and_spans_are_counted() {
    // A collector that takes connections and never answers.
    let stuck = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stuck_addr = stuck.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = stuck.accept().await {
            held.push(s);
        }
    });
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let config = Config::new().node_files(&["nodes.yaml"]).route_all("api");
    let gw = config
        .clone()
        .raw(&format!(
            "otel:\n  traces:\n    endpoint: http://{stuck_addr}/v1/traces\n    queue_size: 4\n    batch_size: 1\n    timeout_ms: 600000\n"
        ))
        .start(&fx, "gg.yaml");
    for _ in 0..100 {
        let r = gw.get("/").await;
        assert_eq!(r.status, 200);
        // The node still gets the trace context and the lane.
        assert!(f1.last().header("traceparent").is_some());
        assert_eq!(
            f1.last().header("baggage").as_deref(),
            Some("graygate.lane=formal")
        );
    }
    // One span is stuck in export, four wait: the rest were dropped.
    let dropped = gw
        .metric("graygate_otel_spans_total{outcome=\"dropped\"}")
        .await
        .unwrap_or(0.0);
    assert!(dropped >= 90.0, "{dropped} spans dropped of 100");
    // A reload turns baggage off and export with it, live: the node keeps
    // getting trace context, and baggage passes as the client sent it.
    let before = gw.generation().await;
    config
        .clone()
        .raw("otel: { baggage: false }\n")
        .write_rename(&fx, "gg.yaml");
    gw.wait_generation(before).await;
    let r = Req::get("/")
        .header("baggage", "graygate.lane=gray")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        f1.last().header("baggage").as_deref(),
        Some("graygate.lane=gray")
    );
    assert!(f1.last().header("traceparent").is_some());
    let e = gw
        .admin_get("/explain?traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .await
        .json();
    assert_eq!(
        e["trace"]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
        "{e}"
    );
    assert_eq!(e["trace"]["parent_span_id"], "00f067aa0ba902b7", "{e}");
    assert_eq!(e["trace"]["exported"], false, "{e}");
    assert!(e.get("baggage").is_none(), "{e}");
    // The baggage key and the sampling are the configuration's: a key of
    // the operator's own, and ratio 0 for new traces while a caller's
    // sampled flag still decides (parent-based).
    let before = gw.generation().await;
    config
        .raw(&format!(
            "otel:\n  baggage_key: lane\n  traces:\n    endpoint: http://{stuck_addr}/v1/traces\n    sample_ratio: 0.0\n"
        ))
        .write_rename(&fx, "gg.yaml");
    gw.wait_generation(before).await;
    assert_eq!(gw.get("/").await.status, 200);
    assert_eq!(f1.last().header("baggage").as_deref(), Some("lane=formal"));
    let tp = f1.last().header("traceparent").unwrap();
    assert!(
        tp.ends_with("-00"),
        "a new trace at ratio 0 is not sampled: {tp}"
    );
    let r = Req::get("/")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
    let tp = f1.last().header("traceparent").unwrap();
    assert!(
        tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && tp.ends_with("-01"),
        "the caller's sampled flag decides: {tp}"
    );
}
