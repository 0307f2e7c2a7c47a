//! Layer: upstream. Request bodies sent upstream, and what makes retries safe:
//! an empty or small buffered body can be replayed on another node; a streamed
//! body is handed back only if the upstream client never read from it (a
//! connect failure), so a body that reached an upstream is never sent twice.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::sync::oneshot;

/// The body of one upstream attempt.
pub enum UpBody {
    Empty,
    Full(Option<Bytes>),
    Stream(TakeBack),
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
    inner: Option<Incoming>,
    touched: bool,
    back: Option<oneshot::Sender<Incoming>>,
}

impl Body for TakeBack {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
        body: Option<Incoming>,
        back: Option<oneshot::Receiver<Incoming>>,
    },
}

impl Replay {
    /// Empty bodies and (for idempotent requests) bodies with a
    /// Content-Length up to `limit` become replayable; larger ones stream.
    pub async fn new(
        body: Incoming,
        idempotent: bool,
        limit: usize,
    ) -> Result<Replay, hyper::Error> {
        if body.is_end_stream() {
            return Ok(Replay::Empty);
        }
        let small = body
            .size_hint()
            .exact()
            .is_some_and(|n| n as usize <= limit);
        if idempotent && small {
            let bytes = body.collect().await?.to_bytes();
            return Ok(Replay::Buffered(bytes));
        }
        Ok(Replay::Streaming {
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
            Replay::Streaming { body, back } => {
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
        if let Replay::Streaming { body, back } = self {
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

    /// Did a previous attempt start sending this body to an upstream?
    pub fn body_was_sent(&self) -> bool {
        matches!(self, Replay::Streaming { body: None, .. })
    }
}
