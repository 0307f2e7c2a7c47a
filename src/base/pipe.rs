//! Layer: base. The request body of an HTTP/1.1 client connection that
//! streams it (a `Content-Length` body not all in hand, or a chunked one):
//! a one-frame hand-off between the connection, which reads and decodes
//! the bytes only when the body asks for more (so `Expect: 100-continue`
//! is answered on the first demand, and a slow node slows the client's
//! upload instead of filling memory), and the request path, which reads
//! it as any body. One frame at most waits in between. Its failures
//! ([`BodyError`]) are those of every client body.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

/// Why a client's request body failed: the client went away (or broke
/// off) mid-body, or it sent bytes that are not a body (bad framing).
#[derive(Debug)]
pub struct BodyError {
    gone: bool,
    what: std::borrow::Cow<'static, str>,
}

impl BodyError {
    /// The client went away before the body's end.
    pub fn gone(what: &'static str) -> BodyError {
        BodyError {
            gone: true,
            what: what.into(),
        }
    }

    /// The bytes are not a body (bad chunked framing).
    pub fn bad(what: &'static str) -> BodyError {
        BodyError {
            gone: false,
            what: what.into(),
        }
    }

    /// A failure of either kind, described by `what`.
    pub fn new(gone: bool, what: String) -> BodyError {
        BodyError {
            gone,
            what: what.into(),
        }
    }

    /// Was it the client going away (not bad bytes)?
    pub fn is_gone(&self) -> bool {
        self.gone
    }
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

impl std::error::Error for BodyError {}

#[derive(Default, Debug)]
struct Shared {
    /// The next frame, decoded and not yet taken.
    frame: Option<Result<Bytes, BodyError>>,
    /// The body's end was decoded (after `frame`, if one waits).
    ended: bool,
    /// The reader waits for a frame.
    wanted: bool,
    /// The reader is gone (dropped before the end).
    dropped: bool,
    reader: Option<Waker>,
    writer: Option<Waker>,
}

/// The connection's end.
pub struct PipeWriter(Arc<Mutex<Shared>>);

/// The request path's end: a body of exactly `len` bytes when known.
#[derive(Debug)]
pub struct PipeReader {
    shared: Arc<Mutex<Shared>>,
    len: Option<u64>,
    done: bool,
}

/// A new pipe for a body of `len` bytes (`None`: chunked).
pub fn pipe(len: Option<u64>) -> (PipeWriter, PipeReader) {
    let shared = Arc::new(Mutex::new(Shared::default()));
    (
        PipeWriter(shared.clone()),
        PipeReader {
            shared,
            len,
            done: false,
        },
    )
}

fn lock(s: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl PipeWriter {
    /// Ready when the reader wants a frame and none waits; `false` when the
    /// reader is gone (nothing more is read for it).
    pub fn poll_want(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut s = lock(&self.0);
        if s.dropped {
            return Poll::Ready(false);
        }
        if s.wanted && s.frame.is_none() {
            return Poll::Ready(true);
        }
        s.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Has the reader asked for a frame yet?
    pub fn wanted(&self) -> bool {
        lock(&self.0).wanted
    }

    /// Hands over one frame (data or the failure that ends the body).
    pub fn send(&self, frame: Result<Bytes, BodyError>) {
        let mut s = lock(&self.0);
        s.frame = Some(frame);
        s.wanted = false;
        if let Some(w) = s.reader.take() {
            w.wake();
        }
    }

    /// The body's end was decoded.
    pub fn end(&self) {
        let mut s = lock(&self.0);
        s.ended = true;
        if let Some(w) = s.reader.take() {
            w.wake();
        }
    }
}

impl Drop for PipeWriter {
    fn drop(&mut self) {
        let mut s = lock(&self.0);
        if !s.ended && s.frame.is_none() {
            // The connection went away mid-body.
            s.frame = Some(Err(BodyError::gone("client connection closed mid-body")));
        }
        if let Some(w) = s.reader.take() {
            w.wake();
        }
    }
}

impl Drop for PipeReader {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.dropped = true;
        if let Some(w) = s.writer.take() {
            w.wake();
        }
    }
}

impl hyper::body::Body for PipeReader {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut s = lock(&self.shared);
        match s.frame.take() {
            Some(Ok(data)) => {
                drop(s);
                if let Some(len) = &mut self.len {
                    *len = len.saturating_sub(data.len() as u64);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Some(Err(e)) => {
                drop(s);
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            None if s.ended => {
                drop(s);
                self.done = true;
                Poll::Ready(None)
            }
            None => {
                s.wanted = true;
                s.reader = Some(cx.waker().clone());
                if let Some(w) = s.writer.take() {
                    w.wake();
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.len == Some(0) && lock(&self.shared).ended
    }

    fn size_hint(&self) -> SizeHint {
        match self.len {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn frames_pass_one_at_a_time_on_demand() {
        let (w, mut r) = pipe(Some(5));
        assert!(!w.wanted());
        let want = std::future::poll_fn(|cx| w.poll_want(cx));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(f) = r.frame().await {
                got.extend_from_slice(&f.unwrap().into_data().unwrap());
            }
            got
        });
        assert!(want.await);
        w.send(Ok(Bytes::from_static(b"hel")));
        assert!(std::future::poll_fn(|cx| w.poll_want(cx)).await);
        w.send(Ok(Bytes::from_static(b"lo")));
        w.end();
        assert_eq!(reader.await.unwrap(), b"hello");
    }

    #[tokio::test]
    async fn a_writer_gone_mid_body_is_an_error_and_a_reader_gone_stops_the_writer() {
        let (w, mut r) = pipe(None);
        drop(w);
        let e = r.frame().await.unwrap().unwrap_err();
        assert!(e.is_gone());
        let (w, r) = pipe(None);
        drop(r);
        assert!(!std::future::poll_fn(|cx| w.poll_want(cx)).await);
    }
}
