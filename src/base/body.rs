//! Layer: base. The one response-body type every layer answers with, the boxing
//! helper, a body that holds a guard until its end, and short plain-text
//! answers.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the gateway sends.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A response extension: the whole body is the first `len` bytes of `file`
/// (already checked to be the file the validators describe). A server that
/// owns a plain socket may send it with `sendfile(2)` instead of polling the
/// body; every other server ignores it and streams the body as usual.
#[derive(Clone, Debug)]
pub struct SendFile {
    pub file: std::sync::Arc<std::fs::File>,
    pub len: u64,
}

pub use super::pipe::BodyError;

/// A client's request body as the request path receives it: from hyper's
/// HTTP/2 server, whole from the HTTP/1.1 connection (`server::h1`: no
/// body, or a `Content-Length` body that arrived with its head), or
/// streamed by it ([`pipe`](super::pipe): the rest).
#[derive(Debug)]
pub enum RequestBody {
    Hyper(hyper::body::Incoming),
    Full(Option<Bytes>),
    Stream(super::pipe::PipeReader),
    /// A body whose framing the HTTP/1.1 side refuses (a
    /// `Transfer-Encoding` other than one `chunked` field,
    /// `codec::framing::request_received`): nothing of it is read; the
    /// request is answered 501 and the connection closes.
    Refused,
}

impl From<hyper::body::Incoming> for RequestBody {
    fn from(b: hyper::body::Incoming) -> Self {
        RequestBody::Hyper(b)
    }
}

impl hyper::body::Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            RequestBody::Hyper(b) => std::pin::Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|e| hyper_body_error(&e)))),
            RequestBody::Full(b) => {
                std::task::Poll::Ready(b.take().map(|d| Ok(hyper::body::Frame::data(d))))
            }
            RequestBody::Stream(b) => std::pin::Pin::new(b).poll_frame(cx),
            RequestBody::Refused => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Hyper(b) => b.is_end_stream(),
            RequestBody::Full(b) => b.is_none(),
            RequestBody::Stream(b) => b.is_end_stream(),
            RequestBody::Refused => true,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            RequestBody::Hyper(b) => b.size_hint(),
            RequestBody::Full(b) => {
                hyper::body::SizeHint::with_exact(b.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestBody::Stream(b) => b.size_hint(),
            RequestBody::Refused => hyper::body::SizeHint::with_exact(0),
        }
    }
}

/// A body error of hyper's server in the gateway's terms: the client gone
/// (an incomplete message, a reset or broken connection) or bad bytes.
fn hyper_body_error(e: &hyper::Error) -> BodyError {
    let gone = e.is_incomplete_message()
        || std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::BrokenPipe
                )
            });
    BodyError::new(gone, e.to_string())
}

/// Boxes any body into [`Body`].
pub fn boxed<B>(b: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// A response body that holds `guard` (an in-flight marker) until the body
/// has been sent to its end, or is dropped.
pub struct Guarded<G, B = Body> {
    inner: B,
    guard: Option<G>,
}

impl<G, B> Guarded<G, B> {
    pub fn new(inner: B, guard: G) -> Guarded<G, B> {
        Guarded {
            inner,
            guard: Some(guard),
        }
    }
}

impl<G: Unpin, B> hyper::body::Body for Guarded<G, B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, B::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(None) = r {
            self.guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A short plain-text response.
pub fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(boxed(Full::new(Bytes::from_static(text.as_bytes()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
