//! Layer: server. TLS termination on a client connection: the handshake with
//! the listener's rustls configuration from the serving generation (so new
//! certificates apply to new connections as soon as a reload swaps them in;
//! connections keep the certificate they were opened with), bounded by the
//! header timeout, then HTTP/2 (hyper) or HTTP/1.1 (the connection loop of
//! `h1`, as on plain listeners) by the negotiated ALPN protocol.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use super::wheel::Wheel;
use super::Server;

/// Serves one connection of TLS listener `index`.
pub(super) async fn serve(
    server: Arc<Server>,
    stream: TcpStream,
    peer: SocketAddr,
    index: usize,
    wheel: Arc<Wheel>,
) {
    let gen = server.plane.current();
    let Some(Some(config)) = gen.tls.get(index).cloned() else {
        tracing::error!(index, "no TLS configuration for this listener");
        return;
    };
    let timeout = Duration::from_millis(gen.config.client.header_timeout_ms);
    drop(gen);
    let tls = match tokio::time::timeout(timeout, TlsAcceptor::from(config).accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake not completed in time; closing");
            return;
        }
    };
    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
        server.serve_h2(tls, peer, true).await
    } else {
        super::h1::serve_tls(server, tls, peer, wheel).await
    }
}
