//! The Nacos config source behind the store seam: admin edits published
//! back to their data id (compare-and-swap on what the gateway serves) and
//! coming back as a push; SIGHUP reading Nacos config again on new
//! connections; data ids the main settings no longer name no longer
//! listened to; release state on each gateway's own disk.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::harness::nacos::*;
use crate::harness::*;

const GROUP: &str = "GRAYGATE";

/// A bootstrap on `nacos`, its gRPC connections to `grpc` (a proxy, or
/// the server's own port).
fn bootstrap(nacos: &Nacos, grpc: u16) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nnacos:\n  server_addr: {}\n  grpc_port: {grpc}\n  namespace: public\n  cache_dir: cache\n  timeout_ms: 500\n  config:\n    group: {GROUP}\n    data_id: graygate.yaml\n",
        nacos.server_addr()
    )
}

const MAIN: &str = "node_files: [nodes/api.yaml]\nrules_file: rules.yaml\nroutes:\n  - { prefix: /, service: api }\n";

fn rules(percentage: u32) -> String {
    format!(
        "uid: {{ header: X-User-Id }}\nrules:\n  - name: everyone\n    lane: gray\n    percentage: {percentage}\n    key: {{ ip: true }}\n"
    )
}

/// Publishes the main settings, the node file (`f` formal, `g` gray) and
/// the rules (`percentage` of everyone to gray).
async fn publish_all(nacos: &Nacos, f: &Backend, g: &Backend, percentage: u32) {
    nacos
        .publish(
            GROUP,
            "nodes:api.yaml",
            &format!(
                "services:\n  api:\n    nodes:\n      - {{ name: f, addr: \"{}\", lane: formal }}\n      - {{ name: g, addr: \"{}\", lane: gray }}\n",
                f.addr, g.addr
            ),
        )
        .await;
    nacos.publish(GROUP, "rules.yaml", &rules(percentage)).await;
    nacos.publish(GROUP, "graygate.yaml", MAIN).await;
}

fn patch(path: &str, body: &str) -> Req {
    Req::get(path)
        .method("PATCH")
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Admin edits on a Nacos-config gateway go to Nacos: a rule edit and a
/// node edit are published to their data id, come back through the
/// listener and are served when the answer comes; an invalid edit is
/// refused and Nacos keeps what it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_edits_are_published_to_nacos_and_come_back_as_a_push() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    publish_all(&nacos, &f, &g, 0).await;
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write("bootstrap.yaml", &bootstrap(&nacos, nacos.grpc)));
    let admin = gw.admin_addr();
    assert_eq!(gw.get("/x").await.node(), "f");
    // A rule edit: published, pushed back, applied before the answer.
    let r = patch("/rules/everyone", "{\"percentage\": 100}")
        .send(admin)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let doc = r.json();
    assert_eq!(doc["data_id"], "rules.yaml", "{doc}");
    let stored = nacos.config(GROUP, "rules.yaml").await.unwrap();
    assert!(stored.contains("percentage: 100"), "{stored}");
    assert_eq!(gw.get("/x").await.node(), "g", "served when answered");
    // A node edit: the node file's data id.
    let r = patch("/nodes/api/g", "{\"weight\": 7}").send(admin).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data_id"], "nodes:api.yaml");
    let stored = nacos.config(GROUP, "nodes:api.yaml").await.unwrap();
    assert!(stored.contains("weight: 7"), "{stored}");
    assert_eq!(gw.node_doc("g").await["weight"], 7);
    // Invalid: refused in the operator's words, Nacos unchanged.
    let r = patch("/rules/everyone", "{\"percentage\": 300}")
        .send(admin)
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let stored = nacos.config(GROUP, "rules.yaml").await.unwrap();
    assert!(stored.contains("percentage: 100"), "{stored}");
    // A service no node document defines.
    let r = patch("/nodes/other/x", "{\"weight\": 1}").send(admin).await;
    assert_eq!(r.status, 404, "{}", r.text());
}

/// A TCP forwarder to `to` whose connections opened before a freeze stop
/// passing the server's bytes (a push or an answer on them is lost; new
/// connections pass).
struct Freezer {
    addr: SocketAddr,
    frozen_below: Arc<AtomicU64>,
    next: Arc<AtomicU64>,
}

impl Freezer {
    async fn start(to: SocketAddr) -> Freezer {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let frozen_below = Arc::new(AtomicU64::new(0));
        let next = Arc::new(AtomicU64::new(0));
        let (fb, nx) = (frozen_below.clone(), next.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                let id = nx.fetch_add(1, Ordering::SeqCst);
                let fb = fb.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut buf = vec![0u8; 16 * 1024];
                    while let Ok(n) = sr.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        // Frozen: read and dropped.
                        if id >= fb.load(Ordering::SeqCst) && cw.write_all(&buf[..n]).await.is_err()
                        {
                            break;
                        }
                    }
                });
            }
        });
        Freezer {
            addr,
            frozen_below,
            next,
        }
    }

    /// Every connection open now stops passing the server's bytes.
    fn freeze(&self) {
        self.frozen_below
            .store(self.next.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// SIGHUP reads Nacos config again: with the gateway's connections
/// frozen (a change published in Nacos never pushed to it), an admin edit
/// is refused as a concurrent change (the edit reads Nacos first, on the
/// client edits use), and a SIGHUP reads every data id through that client
/// and serves the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reads_nacos_again_and_an_edit_on_a_stale_document_is_refused() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    publish_all(&nacos, &f, &g, 0).await;
    let proxy = Freezer::start(SocketAddr::from(([127, 0, 0, 1], nacos.grpc))).await;
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write("bootstrap.yaml", &bootstrap(&nacos, proxy.addr.port())));
    assert_eq!(gw.get("/x").await.node(), "f");
    soon("listening to every data id", || async {
        gw.status().await["listening"]
            .as_array()
            .map_or(0, Vec::len)
            == 3
    })
    .await;
    proxy.freeze();
    nacos.publish(GROUP, "rules.yaml", &rules(100)).await;
    // The edit reads the data id first: it no longer holds what this
    // gateway serves.
    let r = patch("/rules/everyone", "{\"percentage\": 50}")
        .send(gw.admin_addr())
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("changed in Nacos"), "{}", r.text());
    let stored = nacos.config(GROUP, "rules.yaml").await.unwrap();
    assert!(
        stored.contains("percentage: 100"),
        "not overwritten: {stored}"
    );
    let before = gw.generation().await;
    gw.signal("HUP");
    soon("SIGHUP read the change", || async {
        gw.get("/x").await.node() == "g"
    })
    .await;
    assert!(gw.generation().await > before);
    gw.wait_log("SIGHUP: Nacos config read again").await;
    // SIGHUP with nothing changed still builds again (documents on disk),
    // on the connections it has.
    let open = || {
        connections_of(gw.pid(), &[proxy.addr.port()])
            .values()
            .sum::<usize>()
    };
    let after_one = open();
    for _ in 0..3 {
        let before = gw.generation().await;
        gw.signal("HUP");
        gw.wait_generation(before).await;
    }
    assert_eq!(open(), after_one, "SIGHUP opens no connection");
}

/// Data ids the main settings stop naming are no longer listened to (and
/// a later change to one has no effect); named again, one is read afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_ids_no_longer_named_are_no_longer_listened_to() {
    let nacos = Nacos::start().await;
    let [f, g] = backends([("f", "formal"), ("g", "gray")]).await;
    publish_all(&nacos, &f, &g, 100).await;
    let fx = Fixture::new();
    let gw = Gateway::start(&fx.write("bootstrap.yaml", &bootstrap(&nacos, nacos.grpc)));
    let listening = || async {
        let st = gw.status().await;
        let mut ids: Vec<String> = st["listening"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        ids.sort();
        ids
    };
    soon("listening to every data id", || async {
        listening().await == ["graygate.yaml", "nodes:api.yaml", "rules.yaml"]
    })
    .await;
    assert_eq!(gw.get("/x").await.node(), "g");
    // The main settings drop the rules file.
    nacos
        .publish(
            GROUP,
            "graygate.yaml",
            "node_files: [nodes/api.yaml]\nroutes:\n  - { prefix: /, service: api }\n",
        )
        .await;
    soon("rules.yaml no longer listened to", || async {
        listening().await == ["graygate.yaml", "nodes:api.yaml"]
    })
    .await;
    assert_eq!(gw.get("/x").await.node(), "f");
    gw.wait_log("no longer named: not listened to").await;
    // Changed while not named, then named again: read afresh.
    nacos.publish(GROUP, "rules.yaml", &rules(0)).await;
    let gen = gw.generation().await;
    nacos.publish(GROUP, "graygate.yaml", MAIN).await;
    gw.wait_generation(gen).await;
    soon("rules.yaml listened to again", || async {
        listening().await == ["graygate.yaml", "nodes:api.yaml", "rules.yaml"]
    })
    .await;
    assert_eq!(
        gw.get("/x").await.node(),
        "f",
        "the rules as Nacos holds them now (0 %), not as last seen (100 %)"
    );
}
