//! Layer: server — the top of the data plane: listeners and client connections,
//! in nginx's worker model. One single-threaded runtime per worker thread, each
//! accepting on its own SO_REUSEPORT listener, so a request never leaves the
//! thread that accepted it (per-thread Lua VM, per-thread upstream pool, no
//! cross-thread wake-ups). The accept loop enforces the connection cap; each
//! connection's header-read and idle timeouts (`conn`) and the graceful drain
//! live here. Requests go to `proxy::handle` with the [`DataPlane`]; nothing
//! here reaches the control plane, which only flips the shutdown signal.

pub mod conn;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::base::clock::now_ms;
use crate::base::counter::{Counted, Counter};
use crate::base::ratelog::log_limited;
use crate::proxy::{self, DataPlane};
use conn::{verdict, Activity, TimedIo, Timeouts, Tracked, Verdict};

/// The client side of the gateway: what the workers serve with.
pub struct Server {
    pub plane: Arc<DataPlane>,
    /// Open client connections (for the cap and the drain).
    pub connections: Arc<Counter>,
    /// Becomes true when the graceful stop begins.
    shutdown: watch::Receiver<bool>,
}

impl Server {
    pub fn new(
        plane: Arc<DataPlane>,
        connections: Arc<Counter>,
        shutdown: watch::Receiver<bool>,
    ) -> Server {
        Server {
            plane,
            connections,
            shutdown,
        }
    }

    /// Accepts client connections until shutdown begins (then the listener
    /// is closed, so new connections are refused).
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        let mut shutdown = self.shutdown.clone();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait_for(|s| *s) => break,
            };
            let (mut stream, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let max = self.plane.current().config.client.max_connections;
            if self.connections.get() >= max {
                log_limited(&CAP_LOG, || {
                    tracing::warn!(max, "connection cap reached; refusing connections")
                });
                tokio::spawn(async move {
                    let msg = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 21\r\nconnection: close\r\n\r\ntoo many connections\n";
                    let _ = tokio::time::timeout(Duration::from_secs(1), async {
                        let _ = stream.write_all(msg).await;
                        let _ = stream.shutdown().await;
                    })
                    .await;
                });
                continue;
            }
            let guard = Counted::new(self.connections.clone());
            let server = self.clone();
            tokio::spawn(async move {
                server.serve_connection(stream, peer).await;
                drop(guard);
            });
            continue;
        }
        tracing::info!("stopped accepting connections");
    }

    /// Binds `n` listeners on `addr` with SO_REUSEPORT (the kernel spreads
    /// connections across them). Port 0 picks one port for all.
    pub fn bind_listeners(
        addr: SocketAddr,
        n: usize,
    ) -> std::io::Result<Vec<std::net::TcpListener>> {
        let mut out: Vec<std::net::TcpListener> = Vec::with_capacity(n);
        let mut addr = addr;
        for _ in 0..n.max(1) {
            let sock = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            sock.set_reuse_address(true)?;
            sock.set_reuse_port(true)?;
            sock.bind(&addr.into())?;
            sock.listen(4096)?;
            sock.set_nonblocking(true)?;
            let l: std::net::TcpListener = sock.into();
            addr = l.local_addr()?;
            out.push(l);
        }
        Ok(out)
    }

    /// Starts one worker thread per listener, each with its own
    /// single-threaded runtime serving that listener forever.
    pub fn spawn_workers(
        self: &Arc<Self>,
        listeners: Vec<std::net::TcpListener>,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let mut handles = Vec::new();
        for (i, l) in listeners.into_iter().enumerate() {
            let server = self.clone();
            let h = std::thread::Builder::new()
                .name(format!("graygate-worker-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "worker runtime failed to start");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        match TcpListener::from_std(l) {
                            Ok(l) => server.clone().serve(l).await,
                            Err(e) => tracing::error!(error = %e, "worker listener failed"),
                        }
                        // Keep this runtime (and its connections) alive
                        // while they drain; the process exits after that.
                        server.connections.zero().await;
                    });
                })?;
            handles.push(h);
        }
        Ok(handles)
    }

    async fn serve_connection(self: Arc<Self>, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let limits = self.plane.current().config.client.clone();
        let act = Activity::new();
        let plane = self.plane.clone();
        let svc_act = act.clone();
        let svc = service_fn(move |req| {
            let plane = plane.clone();
            let guard = svc_act.request_started();
            async move {
                let resp = proxy::handle(&plane, peer, req).await?;
                let (head, body) = resp.into_parts();
                Ok::<_, std::convert::Infallible>(http::Response::from_parts(
                    head,
                    Tracked::new(body, guard),
                ))
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        // The header timeout is enforced below (`verdict`), so hyper's own
        // per-request header timer is off: one timer fewer per request.
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .max_buf_size((limits.max_uri_bytes + limits.max_header_bytes + 4096).max(8192));
        let conn = builder
            .serve_connection(TokioIo::new(TimedIo::new(stream, act.clone())), svc)
            .with_upgrades();
        tokio::pin!(conn);
        let mut shutdown = self.shutdown.clone();
        let mut closing = false;
        let timeouts = Timeouts {
            header_ms: limits.header_timeout_ms,
            idle_ms: limits.idle_timeout_ms,
            send_ms: limits.send_timeout_ms,
        };
        loop {
            let wait = match verdict(&act, now_ms(), timeouts) {
                Verdict::Wait(d) => d,
                Verdict::HeaderTimeout => {
                    tracing::debug!(%peer, "request head not received in time; closing");
                    return;
                }
                Verdict::SendTimeout => {
                    log_limited(
                        &SEND_LOG,
                        || tracing::warn!(%peer, send_timeout_ms = timeouts.send_ms, "client stopped reading the response; closing"),
                    );
                    return;
                }
                Verdict::Idle => {
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    Duration::from_millis(limits.header_timeout_ms.max(10))
                }
            };
            // Re-check at least every half header timeout: a request head
            // may start arriving at any moment.
            let wait = wait.min(Duration::from_millis(
                (limits.header_timeout_ms / 2).max(10),
            ));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "client connection ended with an error");
                    }
                    return;
                }
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait_for(|s| *s), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

static CAP_LOG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static SEND_LOG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
