//! A gRPC canary end to end with a real tonic client and real tonic
//! services as nodes: HTTP/2 to the nodes in h2c (prior knowledge) and over
//! TLS (ALPN h2, verified against a configured CA with SNI), bidirectional
//! streaming through the gateway (each reply comes back before the next
//! request message is sent, so neither direction is buffered), `grpc-status`
//! trailers passed through (after data and trailers-only), the lane tag sent
//! to the node as metadata, lane routing by metadata and the fallback to
//! formal for a lane without nodes; the client reaches the gateway both over
//! h2c and over TLS. The nodes' gRPC statuses count by the service's
//! `grpc_error_codes` (metrics, node errors, passive health), and a node
//! that dies mid-stream reaches the client as UNAVAILABLE.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::server::{StreamingService, UnaryService};
use tonic::{Code, Status, Streaming};
use tonic_prost::ProstCodec;

use crate::harness::tls::*;
use crate::harness::*;

/// The one message of the test service.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {
    #[prost(string, tag = "1")]
    pub text: String,
    #[prost(string, tag = "2")]
    pub node: String,
    /// The lane tag the node saw in its request metadata.
    #[prost(string, tag = "3")]
    pub tag: String,
}

type BoxStream = Pin<Box<dyn Stream<Item = Result<Msg, Status>> + Send>>;
type BoxFut<T> = Pin<Box<dyn Future<Output = Result<tonic::Response<T>, Status>> + Send>>;

/// `Chat`: one reply per message; a message "fail" ends the stream with
/// PERMISSION_DENIED, "status:N" with status N (a status in trailers after
/// data); "die" makes the node drop every connection it has (as a node
/// process that is killed).
#[derive(Clone)]
struct Chat {
    node: String,
    kill: Arc<watch::Sender<u64>>,
}

/// The status a message `status:N` asks for.
fn asked_status(text: &str) -> Option<Status> {
    let code: i32 = text.strip_prefix("status:")?.parse().ok()?;
    Some(Status::new(Code::from(code), format!("asked for {code}")))
}

impl StreamingService<Msg> for Chat {
    type Response = Msg;
    type ResponseStream = BoxStream;
    type Future = BoxFut<BoxStream>;

    fn call(&mut self, req: tonic::Request<Streaming<Msg>>) -> Self::Future {
        let tag = req
            .metadata()
            .get("x-gray-tag")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let node = self.node.clone();
        let kill = self.kill.clone();
        Box::pin(async move {
            let mut inbound = req.into_inner();
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(async move {
                while let Ok(Some(m)) = inbound.message().await {
                    if m.text == "die" {
                        kill.send_modify(|n| *n += 1);
                        // The reply stream stays open (its end would be
                        // an OK status): only the connection's loss ends it.
                        let _open = tx;
                        match std::future::pending::<Infallible>().await {}
                    }
                    let reply = if m.text == "fail" {
                        Err(Status::permission_denied("lane says no"))
                    } else if let Some(s) = asked_status(&m.text) {
                        Err(s)
                    } else {
                        Ok(Msg {
                            text: m.text,
                            node: node.clone(),
                            tag: tag.clone(),
                        })
                    };
                    let end = reply.is_err();
                    if tx.send(reply).await.is_err() || end {
                        break;
                    }
                }
            });
            Ok(tonic::Response::new(
                Box::pin(ReceiverStream::new(rx)) as BoxStream
            ))
        })
    }
}

/// `Deny`: a trailers-only PERMISSION_DENIED answer.
#[derive(Clone)]
struct Deny;

impl UnaryService<Msg> for Deny {
    type Response = Msg;
    type Future = BoxFut<Msg>;

    fn call(&mut self, _req: tonic::Request<Msg>) -> Self::Future {
        Box::pin(async { Err(Status::new(Code::FailedPrecondition, "not today")) })
    }
}

/// `Say`: a unary echo; the node's `fail_with` code (when not 0), or a
/// message "status:N", is answered trailers-only with that status.
#[derive(Clone)]
struct Say {
    node: String,
    fail_with: Arc<AtomicI32>,
}

impl UnaryService<Msg> for Say {
    type Response = Msg;
    type Future = BoxFut<Msg>;

    fn call(&mut self, req: tonic::Request<Msg>) -> Self::Future {
        let code = self.fail_with.load(Ordering::SeqCst);
        let node = self.node.clone();
        Box::pin(async move {
            let m = req.into_inner();
            if code != 0 {
                return Err(Status::new(Code::from(code), "the node says so"));
            }
            if let Some(s) = asked_status(&m.text) {
                return Err(s);
            }
            Ok(tonic::Response::new(Msg {
                text: m.text,
                node,
                tag: String::new(),
            }))
        })
    }
}

/// A tonic node on 127.0.0.1 (h2c, or TLS with ALPN h2).
pub struct GrpcNode {
    pub addr: SocketAddr,
    pub calls: Arc<AtomicUsize>,
    /// The status `Say` answers with (0: it echoes).
    pub fail_with: Arc<AtomicI32>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GrpcNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GrpcNode {
    pub async fn start(name: &str, tls: Option<Arc<rustls::ServerConfig>>) -> GrpcNode {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let fail_with = Arc::new(AtomicI32::new(0));
        let kill = Arc::new(watch::channel(0u64).0);
        let (name, c, fail) = (name.to_string(), calls.clone(), fail_with.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (name, c, tls, fail) = (name.clone(), c.clone(), tls.clone(), fail.clone());
                let kill = kill.clone();
                let mut killed = kill.subscribe();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let (name, c, fail) = (name.clone(), c.clone(), fail.clone());
                            let kill = kill.clone();
                            async move {
                                c.fetch_add(1, Ordering::SeqCst);
                                let codec = ProstCodec::<Msg, Msg>::default;
                                let resp = match req.uri().path() {
                                    p if p.ends_with("/Chat") => {
                                        let chat = Chat { node: name, kill };
                                        tonic::server::Grpc::new(codec()).streaming(chat, req).await
                                    }
                                    p if p.ends_with("/Say") => {
                                        let say = Say {
                                            node: name,
                                            fail_with: fail,
                                        };
                                        tonic::server::Grpc::new(codec()).unary(say, req).await
                                    }
                                    _ => {
                                        tonic::server::Grpc::new(ProstCodec::<Msg, Msg>::default())
                                            .unary(Deny, req)
                                            .await
                                    }
                                };
                                Ok::<_, Infallible>(resp)
                            }
                        },
                    );
                    let b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                    // A "die" drops the connection wherever it is: its
                    // streams end without a status, as on a killed node.
                    let died = killed.changed();
                    match tls {
                        None => {
                            tokio::select! {
                                _ = b.serve_connection(TokioIo::new(stream), svc) => {}
                                _ = died => {}
                            }
                        }
                        Some(cfg) => {
                            let Ok(s) = tokio_rustls::TlsAcceptor::from(cfg).accept(stream).await
                            else {
                                return;
                            };
                            tokio::select! {
                                _ = b.serve_connection(TokioIo::new(s), svc) => {}
                                _ = died => {}
                            }
                        }
                    }
                });
            }
        });
        GrpcNode {
            addr,
            calls,
            fail_with,
            task,
        }
    }

    pub fn node(&self, name: &str, lane: &str) -> Node {
        Node::new(name, self.addr).lane(lane)
    }
}

fn node_tls(fx: &Fixture) -> Arc<rustls::ServerConfig> {
    write_cert(&fx.path("certs"), "node", "node.example");
    server_config(
        &fx.path("certs/node.crt"),
        &fx.path("certs/node.key"),
        &[b"h2"],
    )
}

/// A tonic channel to the gateway: h2c, or TLS (ALPN h2, the gateway's
/// self-signed certificate accepted) through a custom connector.
pub async fn channel(addr: SocketAddr, tls: bool) -> tonic::transport::Channel {
    let ep = tonic::transport::Endpoint::from_shared(format!("http://localhost:{}", addr.port()))
        .unwrap()
        .connect_timeout(Duration::from_secs(10));
    if !tls {
        return ep.connect().await.expect("h2c channel to the gateway");
    }
    let connector = tower::service_fn(move |_uri: http::Uri| async move {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = graygate::upstream::tls::TlsConnect::new(None, Some("localhost"), true, true)
            .map_err(std::io::Error::other)?;
        let s = tls
            .connect(tcp, addr)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok::<_, std::io::Error>(TokioIo::new(s))
    });
    ep.connect_with_connector(connector)
        .await
        .expect("TLS channel to the gateway")
}

/// Bidirectional chat: each message is answered before the next is sent.
async fn chat(
    ch: &tonic::transport::Channel,
    path: &'static str,
    gray: bool,
    texts: &[&str],
) -> (Vec<Msg>, Result<(), Status>) {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let (tx, rx) = mpsc::channel::<Msg>(1);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    if gray {
        req.metadata_mut().insert("x-gray", "1".parse().unwrap());
    }
    tx.send(Msg {
        text: texts[0].to_string(),
        ..Default::default()
    })
    .await
    .unwrap();
    let resp = grpc
        .streaming(
            req,
            PathAndQuery::from_static(path),
            ProstCodec::<Msg, Msg>::default(),
        )
        .await;
    let mut inbound = match resp {
        Ok(r) => r.into_inner(),
        Err(s) => return (Vec::new(), Err(s)),
    };
    let mut got = Vec::new();
    for next in texts[1..].iter().map(Some).chain([None]) {
        match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
            Ok(Ok(Some(m))) => got.push(m),
            Ok(Ok(None)) => return (got, Ok(())),
            Ok(Err(s)) => return (got, Err(s)),
            Err(_) => panic!("no reply within 10 s: a direction is buffered"),
        }
        match next {
            Some(t) => {
                let _ = tx
                    .send(Msg {
                        text: t.to_string(),
                        ..Default::default()
                    })
                    .await;
            }
            None => break,
        }
    }
    drop(tx);
    // The end of the stream: trailers with grpc-status.
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await
        .expect("stream ends");
    match end {
        Ok(None) => (got, Ok(())),
        Ok(Some(m)) => panic!("unexpected extra message {m:?}"),
        Err(s) => (got, Err(s)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_canary_over_h2c_and_tls_nodes() {
    let fx = Fixture::new();
    let tls_cfg = node_tls(&fx);
    let formal = GrpcNode::start("grpc-formal", None).await;
    let gray = GrpcNode::start("grpc-gray", None).await;
    let sformal = GrpcNode::start("tls-formal", Some(tls_cfg.clone())).await;
    let sgray = GrpcNode::start("tls-gray", Some(tls_cfg)).await;
    let lonely = GrpcNode::start("lonely-formal", None).await;
    write_cert(&fx.path("certs"), "gw", "localhost");
    fx.write(
        "lane.lua",
        "return function(req) if req:header('x-gray') == '1' then return 'gray' end end\n",
    );
    let h2 = |name: &str| Service::new(name).set("protocol", "h2");
    let node_ca = "{ ca: certs/node.crt, server_name: node.example }";
    Nodes::new()
        .service(h2("grpc").nodes([
            formal.node("grpc-formal", "formal"),
            gray.node("grpc-gray", "gray"),
        ]))
        .service(h2("grpc-tls").set("tls", node_ca).nodes([
            sformal.node("tls-formal", "formal"),
            sgray.node("tls-gray", "gray"),
        ]))
        .service(h2("lonely").node(lonely.node("lonely-formal", "formal")))
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/demo.Echo/", "grpc"),
            Route::service("/demo.SecureEcho/", "grpc-tls"),
            Route::service("/demo.Lonely/", "lonely"),
        ])
        .listeners(&[
            Listener::h2c(),
            Listener::tls().cert("certs/gw.crt", "certs/gw.key"),
        ])
        .start(&fx, "graygate.yaml");
    let ls = listeners(&gw);
    let (h2c, tls) = (ls[0], ls[1]);

    for (client_tls, ch) in [
        (false, channel(h2c, false).await),
        (true, channel(tls, true).await),
    ] {
        let via = if client_tls { "TLS" } else { "h2c" };
        // Formal and gray lanes, h2c nodes; the tag arrives as metadata.
        let (got, end) = chat(&ch, "/demo.Echo/Chat", false, &["a", "b", "c"]).await;
        assert_eq!(end.map_err(|s| s.code()), Ok(()), "{via}");
        assert_eq!(
            got.iter().map(|m| m.text.as_str()).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert!(
            got.iter()
                .all(|m| m.node == "grpc-formal" && m.tag == "formal"),
            "{via} {got:?}"
        );
        let (got, end) = chat(&ch, "/demo.Echo/Chat", true, &["x", "y"]).await;
        assert!(end.is_ok(), "{via} {end:?}");
        assert!(
            got.iter().all(|m| m.node == "grpc-gray" && m.tag == "gray"),
            "{via} {got:?}"
        );
        // TLS nodes (CA + SNI verified), both lanes.
        let (got, end) = chat(&ch, "/demo.SecureEcho/Chat", true, &["s1", "s2"]).await;
        assert!(end.is_ok(), "{via} {end:?}");
        assert_eq!(got.len(), 2);
        assert!(
            got.iter().all(|m| m.node == "tls-gray" && m.tag == "gray"),
            "{via} {got:?}"
        );
        let (got, _) = chat(&ch, "/demo.SecureEcho/Chat", false, &["s3"]).await;
        assert_eq!(got[0].node, "tls-formal");
        // A status in trailers after data passes through.
        let (got, end) = chat(&ch, "/demo.Echo/Chat", true, &["ok", "fail"]).await;
        assert_eq!(got.len(), 1, "{via}");
        let s = end.expect_err("PERMISSION_DENIED after data");
        assert_eq!(
            (s.code(), s.message()),
            (Code::PermissionDenied, "lane says no"),
            "{via}"
        );
        // Trailers-only answer.
        let mut grpc = tonic::client::Grpc::new(ch.clone());
        grpc.ready().await.unwrap();
        let r: Result<tonic::Response<Msg>, Status> = grpc
            .unary(
                tonic::Request::new(Msg::default()),
                PathAndQuery::from_static("/demo.Echo/Deny"),
                ProstCodec::<Msg, Msg>::default(),
            )
            .await;
        let s = r.expect_err("FAILED_PRECONDITION");
        assert_eq!(
            (s.code(), s.message()),
            (Code::FailedPrecondition, "not today"),
            "{via}"
        );
        // A lane without nodes falls back to formal, still tagged gray.
        let (got, end) = chat(&ch, "/demo.Lonely/Chat", true, &["l"]).await;
        assert!(end.is_ok(), "{via} {end:?}");
        assert_eq!(
            (got[0].node.as_str(), got[0].tag.as_str()),
            ("lonely-formal", "gray"),
            "{via}"
        );
    }
    assert!(gray.calls.load(Ordering::SeqCst) >= 4);
    assert!(sgray.calls.load(Ordering::SeqCst) >= 2);
    // Many concurrent streams share the per-thread node connection.
    let ch = channel(h2c, false).await;
    let mut tasks = Vec::new();
    for i in 0..32 {
        let ch = ch.clone();
        tasks.push(tokio::spawn(async move {
            let t = format!("m{i}");
            chat(&ch, "/demo.Echo/Chat", i % 2 == 0, &[t.as_str()]).await
        }));
    }
    for t in tasks {
        let (got, end) = t.await.unwrap();
        assert!(end.is_ok() && got.len() == 1, "{end:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_that_does_not_verify_is_unavailable_in_grpc_terms() {
    let fx = Fixture::new();
    let tls_cfg = node_tls(&fx);
    let node = GrpcNode::start("tls-formal", Some(tls_cfg)).await;
    write_cert(&fx.path("other"), "ca", "someone.else");
    let grpc = Service::new("grpc")
        .set("protocol", "h2")
        .set("retries", 0)
        .set("tls", "{ ca: other/ca.crt, server_name: node.example }")
        .node(node.node("tls-formal", "formal"));
    Nodes::new().service(grpc).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/", "grpc")])
        .raw("access_log: { path: access.log, format: json }\n")
        .listeners(&[Listener::h2c()])
        .start(&fx, "graygate.yaml");
    let ch = channel(listeners(&gw)[0], false).await;
    let (_, end) = chat(&ch, "/demo.Echo/Chat", false, &["a"]).await;
    let s = end.expect_err("the node's certificate is not signed by the configured CA");
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert_eq!(
        s.message(),
        "gateway: 502 Bad Gateway",
        "the gateway's 502 as a gRPC status"
    );
    assert_eq!(
        node.calls.load(Ordering::SeqCst),
        0,
        "no request reached the unverified node"
    );
    gw.wait_log("upstream connect failed").await;
    // Logged as what it was, a 502, sent as gRPC's HTTP 200.
    soon("the 502 logged", || async {
        fx.json_lines("access.log").iter().any(|l| {
            (&l["status"], &l["sent_status"], &l["error"])
                == (&502.into(), &200.into(), &"connect".into())
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_node_that_never_answers_times_out_at_the_response_timeout() {
    // A node that takes the connection and says nothing (not even its
    // SETTINGS): the attempt ends at `response_timeout_ms` with a 504, as
    // on an HTTP/1.1 node, long before the total timeout.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            held.push(s);
        }
    });
    let fx = Fixture::new();
    let api = Service::new("api").set("protocol", "h2").set("retries", 0);
    let api = api.node(Node::new("s1", addr).lane("formal"));
    Nodes::new().service(api).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .raw("upstream:\n  response_timeout_ms: 300\n  total_timeout_ms: 30000\n")
        .start(&fx, "graygate.yaml");
    let t0 = std::time::Instant::now();
    let r = Req::get("/x").send(gw.addr).await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.text(), "upstream timed out\n");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// A unary `Say` call on `path` with `text`, the metadata `meta` sent with
/// it: the node's reply, or the status the client got.
pub async fn say(
    ch: &tonic::transport::Channel,
    path: &'static str,
    text: &str,
    meta: &[(&'static str, &str)],
) -> Result<Msg, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.to_string()))?;
    let mut req = tonic::Request::new(Msg {
        text: text.to_string(),
        ..Default::default()
    });
    for (k, v) in meta {
        req.metadata_mut().insert(*k, v.parse().unwrap());
    }
    grpc.unary(
        req,
        PathAndQuery::from_static(path),
        ProstCodec::<Msg, Msg>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_statuses_count_as_errors_by_the_service_mapping() {
    // `grpc` counts the default statuses; `picky` only NOT_FOUND. Each
    // node is its service's only one, never retried.
    let n1 = GrpcNode::start("n1", None).await;
    let p1 = GrpcNode::start("p1", None).await;
    let fx = Fixture::new();
    let passive = "{ passive: { max_fails: 3, cooldown_ms: 600000 } }";
    let svc = |name: &str| {
        Service::new(name)
            .set("protocol", "h2")
            .set("retries", 0)
            .set("health", passive)
    };
    Nodes::new()
        .service(svc("grpc").node(n1.node("n1", "formal")))
        .service(
            svc("picky")
                .set("grpc_error_codes", "[NOT_FOUND]")
                .node(p1.node("p1", "formal")),
        )
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/demo.Echo/", "grpc"),
            Route::service("/demo.Picky/", "picky"),
        ])
        .raw("access_log: { path: access.log, format: json }\n")
        .listeners(&[Listener::h2c()])
        .start(&fx, "graygate.yaml");
    let ch = channel(listeners(&gw)[0], false).await;
    let code = |r: Result<Msg, Status>| r.map(|m| m.node).map_err(|s| s.code());

    // OK and a status the service does not count: answers, no errors.
    for _ in 0..3 {
        assert_eq!(
            code(say(&ch, "/demo.Echo/Say", "hi", &[]).await),
            Ok("n1".into())
        );
        let r = say(&ch, "/demo.Echo/Say", "status:5", &[]).await;
        assert_eq!(code(r), Err(Code::NotFound));
    }
    // UNAVAILABLE trailers-only, twice; INTERNAL in trailers after data.
    for _ in 0..2 {
        let r = say(&ch, "/demo.Echo/Say", "status:14", &[]).await;
        let s = r.expect_err("UNAVAILABLE");
        assert_eq!((s.code(), s.message()), (Code::Unavailable, "asked for 14"));
    }
    let (got, end) = chat(&ch, "/demo.Echo/Chat", false, &["a", "status:13"]).await;
    assert_eq!(got.len(), 1);
    assert_eq!(end.map_err(|s| s.code()), Err(Code::Internal));

    let errors = r#"graygate_request_errors_total{kind="grpc_unavailable",side="upstream"}"#;
    soon("the statuses recorded", || async {
        gw.metric(errors).await == Some(2.0)
    })
    .await;
    let m = gw.metrics().await;
    let series = |status: &str| {
        format!(
            r#"graygate_requests_total{{lane="formal",node="n1",route="/demo.Echo/",status_class="{status}"}}"#
        )
    };
    let value = |s: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(s)?.strip_prefix(' ')?.parse::<f64>().ok())
    };
    assert_eq!(
        value(r#"graygate_request_errors_total{kind="grpc_internal",side="upstream"}"#),
        Some(1.0),
        "{m}"
    );
    assert_eq!(value(&series("5xx")), Some(3.0), "{m}");
    assert_eq!(value(&series("2xx")), Some(6.0), "OK and NOT_FOUND: {m}");
    assert!(!m.contains("grpc_not_found"), "{m}");
    // The node's errors, and three failures in a row eject it.
    let n = gw.node_doc("n1").await;
    assert_eq!(
        (n["requests"].as_u64(), n["errors"].as_u64()),
        (Some(9), Some(3)),
        "{n}"
    );
    assert_eq!(n["health"], "unhealthy", "{n}");
    // The access log: a counted status as its HTTP equivalent, the 200
    // the client's head said as `sent_status`.
    soon("nine n1 lines", || async {
        let lines = fx.json_lines("access.log");
        lines.iter().filter(|l| l["node"] == "n1").count() == 9
    })
    .await;
    let lines = fx.json_lines("access.log");
    let logged = |error: &str| -> Vec<(serde_json::Value, serde_json::Value)> {
        lines
            .iter()
            .filter(|l| l["node"] == "n1" && l["error"] == error)
            .map(|l| (l["status"].clone(), l["sent_status"].clone()))
            .collect()
    };
    let unavailable = (503.into(), 200.into());
    assert_eq!(logged("grpc_unavailable"), vec![unavailable.clone(); 2]);
    assert_eq!(logged("grpc_internal"), vec![(500.into(), 200.into())]);
    let answers = lines
        .iter()
        .filter(|l| l["node"] == "n1" && l["error"].is_null());
    assert!(answers
        .map(|l| (&l["status"], &l["sent_status"]))
        .all(|s| s == (&200.into(), &serde_json::Value::Null)));

    // `picky`: NOT_FOUND counts, UNAVAILABLE does not.
    for _ in 0..2 {
        let r = say(&ch, "/demo.Picky/Say", "status:14", &[]).await;
        assert_eq!(code(r), Err(Code::Unavailable));
    }
    let r = say(&ch, "/demo.Picky/Say", "status:5", &[]).await;
    assert_eq!(code(r), Err(Code::NotFound));
    soon("NOT_FOUND counted for picky", || async {
        gw.node_doc("p1").await["errors"] == 1
    })
    .await;
    let p = gw.node_doc("p1").await;
    assert_eq!(
        (p["requests"].as_u64(), p["health"].as_str()),
        (Some(3), Some("healthy")),
        "{p}"
    );
    let m = gw.metrics().await;
    assert!(
        m.contains(r#"graygate_request_errors_total{kind="grpc_not_found",side="upstream"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"graygate_request_errors_total{kind="grpc_unavailable",side="upstream"} 2"#),
        "picky's UNAVAILABLE are not counted: {m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_stream_reaches_the_client_as_unavailable() {
    let n1 = GrpcNode::start("n1", None).await;
    let fx = Fixture::new();
    let svc = Service::new("grpc")
        .set("protocol", "h2")
        .set("retries", 0)
        .node(n1.node("n1", "formal"));
    Nodes::new().service(svc).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("grpc")
        .listeners(&[Listener::h2c()])
        .start(&fx, "graygate.yaml");
    let ch = channel(listeners(&gw)[0], false).await;
    // A reply, then the node's connections drop with the stream open.
    let (got, end) = chat(&ch, "/demo.Echo/Chat", false, &["a", "die"]).await;
    assert_eq!(got.len(), 1);
    let s = end.expect_err("the node died mid-stream");
    assert_eq!(
        (s.code(), s.message()),
        (Code::Unavailable, "gateway: 502 Bad Gateway"),
        "a gRPC status in trailers, not a reset stream: {s:?}"
    );
    // Recorded as the node's failure, and the gateway goes on serving.
    soon("the broken stream recorded", || async {
        gw.node_doc("n1").await["errors"] == 1
    })
    .await;
    let m = gw.metrics().await;
    assert!(
        m.contains(r#"graygate_request_errors_total{kind="upstream_body",side="upstream"} 1"#),
        "{m}"
    );
    assert!(m.contains(r#"status_class="5xx"} 1"#), "{m}");
    let (got, end) = chat(&ch, "/demo.Echo/Chat", false, &["b"]).await;
    assert_eq!((got.len(), end.map_err(|s| s.code())), (1, Ok(())));
}
