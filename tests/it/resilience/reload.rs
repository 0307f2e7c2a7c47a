//! 100 reloads (alternating node files and scripts) under continuous
//! concurrent load: zero failed requests, and every response came from a
//! node that the generation which routed it allows for the request's lane.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::harness::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Script version `v`: header `X-Lane: g` means gray-a (even) or gray-b (odd).
fn script(v: usize) -> String {
    let lane = if v.is_multiple_of(2) {
        "gray-a"
    } else {
        "gray-b"
    };
    format!("-- version {v}\nreturn function(req)\n  if req:header('X-Lane') == 'g' then return '{lane}' end\n  return nil\nend\n")
}

/// Node-set version `v` (even/odd): lane → node names.
fn node_set(v: usize) -> BTreeMap<&'static str, Vec<&'static str>> {
    if v.is_multiple_of(2) {
        BTreeMap::from([
            ("formal", vec!["f1", "f2"]),
            ("gray-a", vec!["ga1"]),
            ("gray-b", vec!["gb1"]),
        ])
    } else {
        BTreeMap::from([
            ("formal", vec!["f2", "f3"]),
            ("gray-a", vec!["ga2"]),
            ("gray-b", vec!["gb1", "gb2"]),
        ])
    }
}

fn nodes_yaml(v: usize, nodes: &BTreeMap<String, Backend>) -> String {
    let set = node_set(v);
    let ns = set.values().flatten().map(|n| nodes[*n].node());
    Nodes::api(ns).comment(&format!("version {v}")).to_yaml()
}

#[derive(Debug)]
struct Seen {
    status: u16,
    gray: bool,
    node: String,
    tag: String,
    gen: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_reloads_under_load_fail_nothing_and_stay_in_lane() {
    let mut nodes = BTreeMap::new();
    for (name, lane) in [
        ("f1", "formal"),
        ("f2", "formal"),
        ("f3", "formal"),
        ("ga1", "gray-a"),
        ("ga2", "gray-a"),
        ("gb1", "gray-b"),
        ("gb2", "gray-b"),
    ] {
        nodes.insert(name.to_string(), Backend::full(name, lane).await);
    }
    let fx = Fixture::new();
    fx.write("lane.lua", &script(0));
    fx.write("nodes.yaml", &nodes_yaml(0, &nodes));
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let addr = gw.addr;

    // Load: 4 workers on pooled keep-alive connections, half of the
    // requests gray.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (stop, seen) = (stop.clone(), seen.clone());
        workers.push(tokio::spawn(async move {
            let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let gray = (i + w).is_multiple_of(2);
                let mut req = http::Request::get(format!("http://{addr}/r/{w}/{i}"));
                if gray {
                    req = req.header("X-Lane", "g");
                }
                let req = req.body(Full::new(Bytes::new())).unwrap();
                let s = match client.request(req).await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let body = resp.into_body().collect().await.unwrap().to_bytes();
                        let v: serde_json::Value =
                            serde_json::from_slice(&body).unwrap_or_default();
                        Seen {
                            status,
                            gray,
                            node: v["node"].as_str().unwrap_or("").to_string(),
                            tag: v["tag"].as_str().unwrap_or("").to_string(),
                            gen: v["gen"].as_str().and_then(|g| g.parse().ok()).unwrap_or(0),
                        }
                    }
                    Err(e) => Seen {
                        status: 0,
                        gray,
                        node: format!("client error: {e}"),
                        tag: String::new(),
                        gen: 0,
                    },
                };
                seen.lock().unwrap().push(s);
            }
        }));
    }

    // generation_of[k] = the first generation built from version k's files.
    let mut generation_of = vec![1u64];
    let (mut script_v, mut nodes_v) = (0usize, 0usize);
    let mut versions = vec![(0usize, 0usize)];
    for k in 1..=100usize {
        if !k.is_multiple_of(2) {
            nodes_v += 1;
            fx.write_rename("nodes.yaml", &nodes_yaml(nodes_v, &nodes));
        } else {
            script_v += 1;
            fx.write_rename("lane.lua", &script(script_v));
        }
        versions.push((script_v, nodes_v));
        let prev = *generation_of.last().unwrap();
        let now = Arc::new(std::sync::atomic::AtomicU64::new(prev));
        eventually(
            &format!("reload {k} applied"),
            Duration::from_secs(20),
            || {
                let (gw, now) = (&gw, now.clone());
                async move {
                    let st = gw.status().await;
                    assert!(st["last_reload_error"].is_null(), "{st}");
                    let g = st["generation"].as_u64().unwrap();
                    now.store(g, Ordering::SeqCst);
                    g > prev
                }
            },
        )
        .await;
        generation_of.push(now.load(Ordering::SeqCst));
        // Let some load run on this generation before the next change.
        let before = seen.lock().unwrap().len();
        eventually(
            "traffic on the new generation",
            Duration::from_secs(20),
            || async { seen.lock().unwrap().len() >= before + 8 },
        )
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    let seen = seen.lock().unwrap();
    assert!(seen.len() >= 800, "only {} requests", seen.len());
    let failed: Vec<&Seen> = seen.iter().filter(|s| s.status != 200).collect();
    assert!(
        failed.is_empty(),
        "{} failed, e.g. {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let mut gens_seen = std::collections::BTreeSet::new();
    for s in seen.iter() {
        assert!(s.gen >= 1, "{s:?}");
        gens_seen.insert(s.gen);
        let k = generation_of.iter().rposition(|g| *g <= s.gen).unwrap();
        let (sv, nv) = versions[k];
        let lane = match (s.gray, sv % 2) {
            (false, _) => "formal",
            (true, 0) => "gray-a",
            (true, _) => "gray-b",
        };
        assert_eq!(s.tag, lane, "generation {} (version {k}): {s:?}", s.gen);
        let allowed = &node_set(nv)[lane];
        assert!(
            allowed.contains(&s.node.as_str()),
            "generation {} (version {k}) lane {lane} allows {allowed:?}, got {s:?}",
            s.gen
        );
    }
    eprintln!(
        "{} requests, 0 failed, across {} generations",
        seen.len(),
        gens_seen.len()
    );
    assert!(
        gens_seen.len() >= 90,
        "load spanned only {} generations",
        gens_seen.len()
    );
}
