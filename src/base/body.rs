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
