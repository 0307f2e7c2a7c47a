//! Layer: proxy. What the proxy answers a request with ([`Answer`]): the
//! status, the fields as one type (`codec::fields::Fields`: a node's lines
//! kept as it sent them, then what the gateway set), the extensions (a
//! static file's `SendFile`) and the body. The HTTP/1.1 side writes the
//! fields as they are; the HTTP/2 side takes them as a map
//! ([`Answer::into_response`]).

use http::{Extensions, Response, StatusCode};

use crate::codec::fields::Fields;

/// The proxy's answer to one request.
#[derive(Debug)]
pub struct Answer<B> {
    pub status: StatusCode,
    pub fields: Fields,
    pub extensions: Extensions,
    pub body: B,
}

impl<B> From<Response<B>> for Answer<B> {
    fn from(r: Response<B>) -> Answer<B> {
        let (head, body) = r.into_parts();
        Answer {
            status: head.status,
            fields: Fields::from(head.headers),
            extensions: head.extensions,
            body,
        }
    }
}

impl<B> Answer<B> {
    /// As an `http` response (every field in its map, in order).
    pub fn into_response(self) -> Response<B> {
        let mut r = Response::new(self.body);
        *r.status_mut() = self.status;
        *r.headers_mut() = self.fields.into_map();
        *r.extensions_mut() = self.extensions;
        r
    }

    /// The same answer with the body `f` makes of this one's.
    pub fn map_body<C>(self, f: impl FnOnce(B) -> C) -> Answer<C> {
        Answer {
            status: self.status,
            fields: self.fields,
            extensions: self.extensions,
            body: f(self.body),
        }
    }
}
