//! Layer: upstream. Request bodies sent upstream, and what makes retries safe:
//! an empty or small buffered body can be replayed on another node; a streamed
//! body is handed back only if the upstream client never read from it (a
//! connect failure), so a body that reached an upstream is never sent twice.

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;

use super::BoxError;
use crate::base::body::{BodyError, RequestBody};
use crate::base::error::ErrorKind;
use crate::base::stall::Stall;

/// What went wrong with a client's request body, shared between the body
/// (wherever it is being read: buffering, or a node connection sending it)
/// and the request that decides whom to blame.
#[derive(Debug, Default)]
pub struct ClientFault(AtomicU8);

impl ClientFault {
    const NONE: u8 = 0;
    const BAD: u8 = 1;
    const ABORT: u8 = 2;
    const TIMEOUT: u8 = 3;

    fn set(&self, v: u8) {
        let _ = self
            .0
            .compare_exchange(Self::NONE, v, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The client's fault, if its body failed.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self.0.load(Ordering::Relaxed) {
            Self::BAD => Some(ErrorKind::ClientBody),
            Self::ABORT => Some(ErrorKind::ClientAbort),
            Self::TIMEOUT => Some(ErrorKind::ClientBodyTimeout),
            _ => None,
        }
    }
}

/// A client's request body as the gateway reads it: every error is noted
/// as the client's (bad framing, or the client went away), and a read that
/// waits longer than the body timeout fails it.
pub struct ClientBody {
    inner: RequestBody,
    stall: Stall,
    fault: Arc<ClientFault>,
}

impl ClientBody {
    pub fn new(inner: RequestBody, timeout: Duration) -> ClientBody {
        ClientBody {
            inner,
            stall: Stall::new(timeout),
            fault: Arc::default(),
        }
    }

    pub fn fault(&self) -> &Arc<ClientFault> {
        &self.fault
    }

    fn failed(&self, e: &BodyError) -> u8 {
        if e.is_gone() {
            ClientFault::ABORT
        } else {
            ClientFault::BAD
        }
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                this.fault.set(this.failed(&e));
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(r) => {
                this.stall.progress();
                Poll::Ready(r.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending if this.stall.stalled(cx) => {
                this.fault.set(ClientFault::TIMEOUT);
                Poll::Ready(Some(Err("client request body timed out".into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The body of one upstream attempt.
pub enum UpBody {
    Empty,
    Full(Option<Bytes>),
    Stream(TakeBack),
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpBody::Empty => Poll::Ready(None),
            UpBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            UpBody::Stream(t) => Pin::new(t).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpBody::Empty => true,
            UpBody::Full(b) => b.is_none(),
            UpBody::Stream(t) => t.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpBody::Empty => SizeHint::with_exact(0),
            UpBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            UpBody::Stream(t) => t.size_hint(),
        }
    }
}

/// A streamed client body that returns itself through a channel when it is
/// dropped before anything read it.
pub struct TakeBack {
    inner: Option<ClientBody>,
    touched: bool,
    back: Option<oneshot::Sender<ClientBody>>,
}

impl Body for TakeBack {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.touched = true;
        match self.inner.as_mut() {
            Some(b) => Pin::new(b).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or(SizeHint::with_exact(0), |b| b.size_hint())
    }
}

impl Drop for TakeBack {
    fn drop(&mut self) {
        if !self.touched {
            if let (Some(b), Some(tx)) = (self.inner.take(), self.back.take()) {
                let _ = tx.send(b);
            }
        }
    }
}

/// The client's body, kept so that a retry can send it again.
pub enum Replay {
    Empty,
    Buffered(Bytes),
    Streaming {
        body: Option<ClientBody>,
        back: Option<oneshot::Receiver<ClientBody>>,
        fault: Arc<ClientFault>,
    },
}

impl Replay {
    /// Empty bodies and (for idempotent requests) bodies with a
    /// Content-Length up to `limit` become replayable; larger ones stream.
    pub async fn new(
        body: ClientBody,
        idempotent: bool,
        limit: usize,
    ) -> Result<Replay, ErrorKind> {
        if body.is_end_stream() {
            return Ok(Replay::Empty);
        }
        let small = body
            .size_hint()
            .exact()
            .is_some_and(|n| n as usize <= limit);
        if idempotent && small {
            let fault = body.fault().clone();
            return match body.collect().await {
                Ok(c) => Ok(Replay::Buffered(c.to_bytes())),
                Err(_) => Err(fault.kind().unwrap_or(ErrorKind::ClientBody)),
            };
        }
        Ok(Replay::Streaming {
            fault: body.fault().clone(),
            body: Some(body),
            back: None,
        })
    }

    /// The body for the next attempt, or `None` when a streamed body has
    /// been (even partly) sent already.
    pub fn next_body(&mut self) -> Option<UpBody> {
        match self {
            Replay::Empty => Some(UpBody::Empty),
            Replay::Buffered(b) => Some(UpBody::Full(Some(b.clone()))),
            Replay::Streaming { body, back, .. } => {
                let inner = body.take()?;
                let (tx, rx) = oneshot::channel();
                *back = Some(rx);
                Some(UpBody::Stream(TakeBack {
                    inner: Some(inner),
                    touched: false,
                    back: Some(tx),
                }))
            }
        }
    }

    /// After a failed attempt: takes back a streamed body nobody read.
    pub fn recover(&mut self) {
        if let Replay::Streaming { body, back, .. } = self {
            if let Some(mut rx) = back.take() {
                if let Ok(b) = rx.try_recv() {
                    *body = Some(b);
                }
            }
        }
    }

    /// Can another attempt carry the body?
    pub fn replayable(&self) -> bool {
        match self {
            Replay::Empty | Replay::Buffered(_) => true,
            Replay::Streaming { body, .. } => body.is_some(),
        }
    }

    /// When an attempt failed: was it the client's body that failed it?
    pub fn client_fault(&self) -> Option<ErrorKind> {
        match self {
            Replay::Streaming { fault, .. } => fault.kind(),
            _ => None,
        }
    }

    /// Did a previous attempt start sending this body to an upstream?
    pub fn body_was_sent(&self) -> bool {
        matches!(self, Replay::Streaming { body: None, .. })
    }
}
