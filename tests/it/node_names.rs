//! Node addresses by host name, resolved for real: `localhost` through the
//! system's resolver, and names under `gg.test` served by a real dnsmasq
//! on a loopback port (the gateway's `resolver:`), whose answers the tests
//! change. Backends of one name listen on one port of several loopback
//! addresses (127.0.0.2, 127.0.0.3), as the instances behind a DNS name do.

use std::net::SocketAddr;

use crate::harness::dnsmasq::Dnsmasq;
use crate::harness::*;

const NAME: &str = "canary.gg.test";

/// Backends `a` on 127.0.0.2 and `b` on 127.0.0.3, on the same port.
async fn pair() -> (Backend, Backend, u16) {
    for _ in 0..20 {
        let a = Backend::start_at("a", "", "127.0.0.2:0".parse().unwrap())
            .await
            .expect("bind 127.0.0.2");
        let port = a.addr.port();
        let at = SocketAddr::from(([127, 0, 0, 3], port));
        if let Some(b) = Backend::start_at("b", "", at).await {
            return (a, b, port);
        }
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
}

/// A gateway whose service `api` is `canary.gg.test:<port>` (of this
/// weight), resolved by `dns` every 100 ms.
fn gateway(fx: &Fixture, dns: &Dnsmasq, port: u16, weight: u32) -> Gateway {
    Nodes::new()
        .service(
            Service::new("api")
                .raw("    health:\n      passive: { max_fails: 1, cooldown_ms: 60000 }\n")
                .node(
                    Node::at(format!("{NAME}:{port}"))
                        .with("name", "c")
                        .with("weight", &weight.to_string()),
                ),
        )
        .write(fx, "nodes.yaml");
    Config::new()
        .set("resolver", dns.addr)
        .set("resolve_interval_ms", 100)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(fx, "gg.yaml")
}

/// The `/nodes` entries of service `api`.
async fn api_nodes(gw: &Gateway) -> Vec<serde_json::Value> {
    let doc = gw.admin_get("/nodes").await.json();
    doc["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "api")
        .map(|s| s["nodes"].as_array().unwrap().clone())
        .unwrap_or_default()
}

/// The `/nodes` document's entry for `NAME`.
async fn name_doc(gw: &Gateway) -> serde_json::Value {
    let doc = gw.admin_get("/nodes").await.json();
    doc["names"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["host"] == NAME)
        .cloned()
        .unwrap_or_else(|| panic!("no name {NAME} in {doc}"))
}

fn addrs(nodes: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = nodes
        .iter()
        .map(|n| n["addr"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn localhost_resolves_through_the_system_resolver() {
    let b = Backend::start("local", "").await;
    let fx = Fixture::new();
    let port = b.addr.port();
    Nodes::api([Node::at(format!("localhost:{port}"))]).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let nodes = api_nodes(&gw).await;
    let mine = nodes
        .iter()
        .find(|n| n["addr"] == format!("127.0.0.1:{port}"))
        .unwrap_or_else(|| panic!("no 127.0.0.1 node: {nodes:?}"));
    assert_eq!(mine["host"], format!("localhost:{port}"));
    assert_eq!(mine["lane"], "formal");
    // Every address of localhost is loopback (::1 too, where the hosts
    // file says so); the one the backend listens on answers.
    assert!(
        nodes
            .iter()
            .all(|n| n["addr"].as_str().unwrap().starts_with("127.")
                || n["addr"].as_str().unwrap().starts_with("[::1]")),
        "{nodes:?}"
    );
    let r = gw.get("/x").await;
    assert_eq!((r.status, r.node()), (200, "local".to_string()));
}

#[tokio::test]
async fn traffic_moves_to_the_new_address_without_a_reload() {
    let (_a, _b, port) = pair().await;
    let dns = Dnsmasq::start(&[(NAME, "127.0.0.2")]).await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &dns, port, 1);
    let r = gw.get("/x").await;
    assert_eq!((r.status, r.node()), (200, "a".to_string()));
    assert_eq!(addrs(&api_nodes(&gw).await), [format!("127.0.0.2:{port}")]);

    dns.set(&[(NAME, "127.0.0.3")], NAME).await;
    soon("requests go to the name's new address", || async {
        let r = gw.get("/x").await;
        r.status == 200 && r.node() == "b"
    })
    .await;
    let nodes = api_nodes(&gw).await;
    assert_eq!(addrs(&nodes), [format!("127.0.0.3:{port}")]);
    assert_eq!(nodes[0]["host"], format!("{NAME}:{port}"));
    assert_eq!(nodes[0]["name"], "c@127.0.0.3");
    assert_eq!(name_doc(&gw).await["state"], "ok");
    // Every request after the change reaches the new address.
    for _ in 0..5 {
        assert_eq!(gw.get("/x").await.node(), "b");
    }
    gw.wait_log("node host name resolves to new addresses")
        .await;
}

#[tokio::test]
async fn a_name_that_stops_resolving_keeps_its_last_good_addresses() {
    let (_a, _b, port) = pair().await;
    let dns = Dnsmasq::start(&[(NAME, "127.0.0.2")]).await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &dns, port, 1);
    assert_eq!(gw.get("/x").await.node(), "a");

    dns.set(&[("other.gg.test", "127.0.0.3")], NAME).await;
    soon("/nodes says the name fails", || async {
        name_doc(&gw).await["state"] == "failing"
    })
    .await;
    let doc = name_doc(&gw).await;
    assert!(doc["error"].as_str().unwrap().contains("NXDOMAIN"), "{doc}");
    assert!(doc["failing_since_unix_ms"].as_u64().is_some(), "{doc}");
    assert_eq!(
        doc["nodes"],
        serde_json::json!([format!("127.0.0.2:{port}")])
    );
    assert_eq!(addrs(&api_nodes(&gw).await), [format!("127.0.0.2:{port}")]);
    let r = gw.get("/x").await;
    assert_eq!((r.status, r.node()), (200, "a".to_string()));
    gw.wait_log("its last good addresses stay in use").await;

    // Back: the failure clears, and a new answer is taken again.
    dns.set(&[(NAME, "127.0.0.3")], NAME).await;
    soon("the name resolves again, to its new address", || async {
        let r = gw.get("/x").await;
        r.status == 200 && r.node() == "b"
    })
    .await;
    assert_eq!(name_doc(&gw).await["state"], "ok");
}

#[tokio::test]
async fn two_a_records_are_two_nodes_of_the_lane_with_health_of_their_own() {
    let (a, b, port) = pair().await;
    let dns = Dnsmasq::start(&[(NAME, "127.0.0.2"), (NAME, "127.0.0.3")]).await;
    let fx = Fixture::new();
    let gw = gateway(&fx, &dns, port, 3);
    let nodes = api_nodes(&gw).await;
    assert_eq!(
        addrs(&nodes),
        [format!("127.0.0.2:{port}"), format!("127.0.0.3:{port}")]
    );
    for n in &nodes {
        assert_eq!(
            (n["lane"].as_str(), n["weight"].as_u64()),
            (Some("formal"), Some(3)),
            "{n}"
        );
        assert_eq!(n["host"], format!("{NAME}:{port}"));
    }
    let mut names: Vec<&str> = nodes.iter().map(|n| n["name"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["c@127.0.0.2", "c@127.0.0.3"]);
    for _ in 0..6 {
        assert_eq!(gw.get("/x").await.status, 200);
    }
    assert!(
        a.count() > 0 && b.count() > 0,
        "{} {}",
        a.count(),
        b.count()
    );

    // Health is per address: b fails (503), only its node is ejected.
    b.set_status(503);
    let health = |nodes: &[serde_json::Value], ip: &str| {
        nodes
            .iter()
            .find(|n| n["addr"] == format!("{ip}:{port}"))
            .map(|n| n["health"].as_str().unwrap().to_string())
    };
    soon("b's address is ejected", || async {
        let _ = gw.get("/x").await;
        health(&api_nodes(&gw).await, "127.0.0.3").as_deref() == Some("unhealthy")
    })
    .await;
    let nodes = api_nodes(&gw).await;
    assert_eq!(health(&nodes, "127.0.0.2").as_deref(), Some("healthy"));
    for _ in 0..4 {
        let r = gw.get("/x").await;
        assert_eq!((r.status, r.node()), (200, "a".to_string()));
    }
}

#[tokio::test]
async fn a_name_that_does_not_resolve_at_start_or_in_a_reload_is_refused() {
    let dns = Dnsmasq::start(&[("other.gg.test", "127.0.0.2")]).await;
    let fx = Fixture::new();
    Nodes::api([Node::at(format!("{NAME}:7101"))]).write(&fx, "nodes.yaml");
    let cfg = Config::new()
        .set("resolver", dns.addr)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .write(&fx, "gg.yaml");
    let err = Gateway::try_start(&cfg).err().expect("start refused");
    assert!(err.contains("nodes.yaml:4:"), "{err}");
    assert!(err.contains(&format!("{NAME}:7101")), "{err}");
    assert!(err.contains("NXDOMAIN"), "{err}");

    // Started on an address, a reload naming the unknown name is rejected
    // and the old nodes keep serving.
    let b = Backend::start("b", "formal").await;
    fx.api_nodes(&[&b]);
    let gw = Gateway::start(&cfg);
    let g = gw.generation().await;
    Nodes::api([Node::at(format!("{NAME}:7101"))]).write(&fx, "nodes.yaml");
    soon("the reload is rejected", || async {
        let s = gw.status().await;
        s.to_string().contains("NXDOMAIN")
    })
    .await;
    assert_eq!(gw.generation().await, g);
    assert_eq!(gw.get("/x").await.node(), "b");
}
