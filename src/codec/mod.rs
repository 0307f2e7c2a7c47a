//! Layer: codec (data plane, above base; below upstream and server). The
//! HTTP/1.1 wire format in one place, for both sides of the gateway: the
//! fast read of request and status heads ([`head`]), the strict
//! `Transfer-Encoding: chunked` decoder and the encoder ([`chunked`]), the
//! body-framing rules of RFC 9112 §6 with the strict Content-Length value
//! ([`framing`]), a request body's framing off the wire ([`body`]), header
//! fields and the proxy path's one response-fields type ([`fields`]), and the
//! per-thread pool of read buffers both sides read into ([`readbuf`]). The client
//! connections (`server`) and the node connections (`upstream`) frame
//! their messages with these; HTTP/2 stays hyper's.

pub mod body;
pub mod chunked;
pub mod fields;
pub mod framing;
pub mod head;
pub mod readbuf;
