//! Layer: base. The two halves of an upgraded connection (`101 Switching
//! Protocols`, e.g. WebSocket) as the proxy joins them, whatever engine
//! served each side: the server puts a [`ClientUpgrade`] into an upgrade
//! request's extensions, the upstream client hands its side over once the
//! node has answered 101, and the proxy copies bytes between the two
//! [`Tunnel`]s for the connection's life.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncWrite};

/// Any byte stream an upgraded connection continues on.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// One side of an upgraded connection: its stream, with any bytes that
/// arrived after the 101 already in front.
pub type Tunnel = Box<dyn Io>;

/// A side that becomes a [`Tunnel`] once its 101 has gone out (client) or
/// come in (node); `None` when the handshake did not complete.
pub type Pending = Pin<Box<dyn Future<Output = Option<Tunnel>> + Send>>;

/// Request extension: the client's side of an upgrade request, ready once
/// the server has written the 101 answer. (Extensions must be `Clone` and
/// `Sync`: the first [`take`](Self::take) gets it.)
#[derive(Clone)]
pub struct ClientUpgrade(Arc<Mutex<Option<Pending>>>);

impl ClientUpgrade {
    pub fn new(pending: Pending) -> ClientUpgrade {
        ClientUpgrade(Arc::new(Mutex::new(Some(pending))))
    }

    /// The pending side (once).
    pub fn take(&self) -> Option<Pending> {
        self.0.lock().ok().and_then(|mut p| p.take())
    }
}
