//! A Nacos cluster (three rnacos members, raft) with one member lost: the
//! gateway names every member in `server_addr`; the member its clients
//! are connected to is killed; discovery and config pushes go on through
//! the others.

use crate::harness::nacos::*;
use crate::harness::*;

const GROUP: &str = "GRAYGATE";

/// Three members: the first initialises the raft, the others join it.
async fn cluster() -> Vec<Nacos> {
    let first = Nacos::start_env(&[
        ("RNACOS_RAFT_NODE_ID", "1"),
        ("RNACOS_RAFT_AUTO_INIT", "true"),
    ])
    .await;
    let join = format!("127.0.0.1:{}", first.grpc);
    let mut members = vec![first];
    for id in ["2", "3"] {
        members.push(
            Nacos::start_env(&[
                ("RNACOS_RAFT_NODE_ID", id),
                ("RNACOS_RAFT_AUTO_INIT", "false"),
                ("RNACOS_RAFT_JOIN_ADDR", &join),
            ])
            .await,
        );
    }
    members
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_member_lost_is_survived() {
    let mut members = cluster().await;
    let [f, g, h] = backends([("v1", "formal"), ("g1", "gray"), ("g2", "gray2")]).await;
    let svc = "orders";
    let (fi, gi, hi) = (
        Inst::new(svc, f.addr).meta("version", "v1"),
        Inst::new(svc, g.addr).meta("version", "gray"),
        Inst::new(svc, h.addr).meta("version", "gray2"),
    );
    members[0].register(&fi).await;
    members[0].register(&gi).await;
    members[0]
        .publish(
            GROUP,
            "graygate.yaml",
            &format!("rules_file: rules.yaml\nroutes:\n  - {{ prefix: /, service: {svc} }}\n"),
        )
        .await;
    let rules = |lane: &str| {
        format!("uid: {{ header: X-User-Id }}\nrules:\n  - {{ name: beta, lane: {lane}, uid: {{ in: [7] }} }}\n")
    };
    members[0]
        .publish(GROUP, "rules.yaml", &rules("gray"))
        .await;
    // Replicated: every member holds the documents and the instances.
    for m in &members {
        soon("every member holds what the first was given", || async {
            m.config(GROUP, "rules.yaml").await == Some(rules("gray"))
                && m.config(GROUP, "graygate.yaml").await.is_some()
                && m.instances(svc, "DEFAULT_GROUP", "public").await.len() == 2
        })
        .await;
    }
    let servers: Vec<String> = members.iter().map(|m| m.server_addr()).collect();
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write(
        "bootstrap.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nnacos:\n  server_addr: \"{}\"\n  namespace: public\n  cache_dir: cache\n  timeout_ms: 1000\n  discovery:\n    group: DEFAULT_GROUP\n    lane_key: version\n    formal_values: [v1]\n  config:\n    group: {GROUP}\n    data_id: graygate.yaml\n",
            servers.join(",")
        ),
    ));
    let user7 = || async {
        Req::get("/x")
            .header("X-User-Id", "7")
            .send(gw.addr)
            .await
            .node()
    };
    soon("both instances and the rules served", || async {
        user7().await == "g1" && gw.get("/x").await.node() == "v1"
    })
    .await;
    // The member most of the gateway's connections go to, killed.
    let ports: Vec<u16> = members.iter().map(|m| m.grpc).collect();
    let conns = connections_of(gw.pid(), &ports);
    let (&port, _) = conns
        .iter()
        .max_by_key(|(_, n)| **n)
        .unwrap_or_else(|| panic!("no connection to a member: {conns:?}"));
    let lost = members.iter().position(|m| m.grpc == port).unwrap();
    eprintln!(
        "gateway connections by member gRPC port: {conns:?}; killing member {}",
        lost + 1
    );
    members[lost].kill();
    let alive = &members[(lost + 1) % members.len()];
    let nodes = || async {
        let doc = gw.admin_get("/nodes").await.json();
        let mut names: Vec<String> = doc["services"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["name"] == svc)
            .flat_map(|s| s["nodes"].as_array().cloned().unwrap_or_default())
            .filter_map(|n| n["lane"].as_str().map(str::to_string))
            .collect();
        names.sort();
        names
    };
    // The clients of the lost member fail over: the client's health
    // check (every 5 s, 3 s to answer) notices, then it reconnects to
    // another member and subscribes again.
    let within = std::time::Duration::from_secs(30);
    // Discovery: an instance registered and one deregistered through a
    // surviving member (retried while the raft elects a new leader).
    eventually(
        "the cluster takes a registration after the loss",
        within,
        || async {
            alive.try_register(&hi).await.is_ok()
                && alive.instances(svc, "DEFAULT_GROUP", "public").await.len() == 3
        },
    )
    .await;
    eventually("an instance registered after the loss", within, || async {
        nodes().await == ["formal", "gray", "gray2"]
    })
    .await;
    eventually(
        "an instance deregistered after the loss",
        within,
        || async {
            let _ = alive.try_deregister(&gi).await;
            nodes().await == ["formal", "gray2"]
        },
    )
    .await;
    // Config: a change published through a surviving member is pushed.
    eventually("a config change pushed after the loss", within, || async {
        let _ = alive
            .try_publish(GROUP, "rules.yaml", &rules("gray2"))
            .await;
        user7().await == "g2"
    })
    .await;
    assert_eq!(gw.get("/x").await.node(), "v1");
    let st = gw.status().await;
    assert_eq!(st["source_state"], "live", "{st}");
}
