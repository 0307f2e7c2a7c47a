//! WebSocket (HTTP Upgrade) proxying with a real client and server
//! (tokio-tungstenite): the lane is decided at the upgrade request and the
//! connection stays on its node — and lane — for its whole life, reloads
//! notwithstanding.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::harness::*;
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::Message;

/// A WebSocket echo server: greets with `<name> tag=<lane tag>`, then
/// answers every text message with `<name>:<text>`.
async fn ws_node(name: &'static str) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let (addr, task, _) = ws_node_counted(name).await;
    (addr, task)
}

/// [`ws_node`], also counting the WebSocket connections that ended.
async fn ws_node_counted(
    name: &'static str,
) -> (SocketAddr, tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let ended_in = ended.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let ended = ended_in.clone();
            tokio::spawn(async move {
                let mut tag = String::new();
                #[allow(clippy::result_large_err)] // tungstenite's callback signature
                let cb = |req: &Request, resp: Response| {
                    tag = req
                        .headers()
                        .get("x-gray-tag")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-")
                        .to_string();
                    Ok(resp)
                };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(s, cb).await else {
                    return;
                };
                let _ = ws.send(Message::text(format!("{name} tag={tag}"))).await;
                while let Some(Ok(m)) = ws.next().await {
                    if let Message::Text(t) = m {
                        if ws
                            .send(Message::text(format!("{name}:{}", t.as_str())))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
                ended.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (addr, task, ended)
}

async fn connect(
    gw: SocketAddr,
    lane: Option<&str>,
) -> tokio_tungstenite::WebSocketStream<TcpStream> {
    let mut req = format!("ws://{gw}/chat").into_client_request().unwrap();
    if let Some(l) = lane {
        req.headers_mut().insert("X-Lane", l.parse().unwrap());
    }
    let tcp = TcpStream::connect(gw).await.unwrap();
    let (ws, resp) = tokio_tungstenite::client_async(req, tcp)
        .await
        .expect("upgrade through the gateway");
    assert_eq!(resp.status(), 101);
    ws
}

async fn next_text(ws: &mut tokio_tungstenite::WebSocketStream<TcpStream>) -> String {
    let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("message in time")
        .expect("stream open")
        .expect("valid frame");
    m.into_text().unwrap().as_str().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_keeps_its_lane_for_the_connection_life() {
    let (f_addr, _f) = ws_node("fws").await;
    let (g_addr, _g) = ws_node("gws").await;
    let fx = Fixture::new();
    fx.write(
        "lane.lua",
        "return function(req) return req:header('X-Lane') end\n",
    );
    let chat = Service::new("chat").nodes([
        Node::new("fws", f_addr),
        Node::new("gws", g_addr).lane("gray"),
    ]);
    Nodes::new().service(chat).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/", "chat")])
        .start(&fx, "gg.yaml");

    let mut gray = connect(gw.addr, Some("gray")).await;
    assert_eq!(next_text(&mut gray).await, "gws tag=gray");
    let mut formal = connect(gw.addr, None).await;
    assert_eq!(next_text(&mut formal).await, "fws tag=formal");
    gray.send(Message::text("hi")).await.unwrap();
    assert_eq!(next_text(&mut gray).await, "gws:hi");
    formal.send(Message::text("yo")).await.unwrap();
    assert_eq!(next_text(&mut formal).await, "fws:yo");

    // Reload: the script now sends everyone formal. New upgrades go formal;
    // the open gray connection stays on its gray node.
    fx.write_rename("lane.lua", "return function(req) return nil end\n");
    gw.wait_generation(1).await;
    let mut late = connect(gw.addr, Some("gray")).await;
    assert_eq!(next_text(&mut late).await, "fws tag=formal");
    for i in 0..5 {
        gray.send(Message::text(format!("m{i}"))).await.unwrap();
        assert_eq!(next_text(&mut gray).await, format!("gws:m{i}"));
    }
    gray.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_refused_by_the_node_is_passed_back() {
    // A plain HTTP node answers the upgrade request with 200: no tunnel, the
    // client gets the node's answer.
    let b = Backend::start("plain", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&b]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "gg.yaml");
    let r = Req::get("/x")
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.node(), "plain");
    // The node saw the upgrade request headers.
    let seen = b.last();
    assert_eq!(seen.header("upgrade").as_deref(), Some("websocket"));
}

fn chat_config(fx: &Fixture, addr: SocketAddr, drain_ms: u64) -> std::path::PathBuf {
    let chat = Service::new("chat").node(Node::new("fws", addr));
    Nodes::new().service(chat).write(fx, "nodes.yaml");
    Config::new()
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/", "chat")])
        .raw(&format!("client:\n  drain_timeout_ms: {drain_ms}\n"))
        .write(fx, "gg.yaml")
}

/// A graceful stop drains WebSocket tunnels: the conversation goes on
/// after SIGTERM, and the process exits once it has ended. (Before binary
/// upgrades, tunnels were cut at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_tunnels_are_drained_on_sigterm() {
    let (addr, _task, ended) = ws_node_counted("fws").await;
    let fx = Fixture::new();
    let cfg = chat_config(&fx, addr, 60000);
    let mut gw = Gateway::start(&cfg);
    let mut ws = connect(gw.addr, None).await;
    assert_eq!(next_text(&mut ws).await, "fws tag=formal");
    gw.signal("TERM");
    soon("listener closed", || async {
        TcpStream::connect(gw.addr).await.is_err()
    })
    .await;
    for m in ["during", "the", "drain"] {
        ws.send(Message::text(m)).await.unwrap();
        assert_eq!(next_text(&mut ws).await, format!("fws:{m}"));
    }
    assert!(gw.running().await, "exited with a tunnel open");
    ws.close(None).await.unwrap();
    drop(ws);
    gw.exits_cleanly("no exit after the tunnel ended", "drained; exiting")
        .await;
    soon("the node's side ended", || async {
        ended.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// A tunnel that outlives `drain_timeout_ms` is cut at exit, both ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_tunnels_are_cut_at_the_drain_time() {
    let (addr, _task, ended) = ws_node_counted("fws").await;
    let fx = Fixture::new();
    // A short drain: the open tunnel holds the exit up to it, not longer.
    let cfg = chat_config(&fx, addr, 300);
    let mut gw = Gateway::start(&cfg);
    let mut ws = connect(gw.addr, None).await;
    assert_eq!(next_text(&mut ws).await, "fws tag=formal");
    ws.send(Message::text("hi")).await.unwrap();
    assert_eq!(next_text(&mut ws).await, "fws:hi");
    gw.signal("TERM");
    gw.exits_cleanly("an open tunnel held up the exit", "drain time over")
        .await;
    // Both ends of the tunnel see it end.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match ws.next().await {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(end.is_ok(), "the client's tunnel stayed open");
    soon("the node's side ended", || async {
        ended.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// A WebSocket over a TLS listener: the HTTP/1.1-over-TLS connection (the
/// same loop as plain ones) turns into the client's side of the tunnel
/// after its 101, with the lane decided at the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_over_a_tls_listener_becomes_a_tunnel() {
    use crate::harness::tls::{connect, listeners, write_cert};
    let (f_addr, _f) = ws_node("fws").await;
    let (g_addr, _g) = ws_node("gws").await;
    let fx = Fixture::new();
    write_cert(&fx.path("certs"), "default", "localhost");
    fx.write(
        "lane.lua",
        "return function(req) return req:header('X-Lane') end\n",
    );
    let chat = Service::new("chat").nodes([
        Node::new("fws", f_addr),
        Node::new("gws", g_addr).lane("gray"),
    ]);
    Nodes::new().service(chat).write(&fx, "nodes.yaml");
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/", "chat")])
        .listeners(&[Listener::tls().cert("certs/default.crt", "certs/default.key")])
        .start(&fx, "gg.yaml");
    let tls_addr = listeners(&gw)[0];
    let stream = connect(tls_addr, &fx.path("certs/default.crt"), &[]).await;
    let mut req = format!("wss://localhost:{}/chat", tls_addr.port())
        .into_client_request()
        .unwrap();
    req.headers_mut().insert("X-Lane", "gray".parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::client_async(req, stream)
        .await
        .expect("upgrade through the gateway over TLS");
    assert_eq!(resp.status(), 101);
    let first = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("greeting in time")
        .expect("open")
        .expect("frame");
    assert_eq!(first.into_text().unwrap().as_str(), "gws tag=gray");
    for i in 0..3 {
        ws.send(Message::text(format!("t{i}"))).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("echo in time")
            .expect("open")
            .expect("frame");
        assert_eq!(m.into_text().unwrap().as_str(), format!("gws:t{i}"));
    }
    ws.close(None).await.unwrap();
}
