//! Layer: codec (data plane, above base; below upstream and server). The
//! HTTP/1.1 wire format in one place, for both sides of the gateway: the
//! fast read of request and status heads ([`head`]) and the strict
//! `Transfer-Encoding: chunked` decoder ([`chunked`]) and a request body's
//! framing on top of it ([`body`]). The client
//! connections (`server`) and the node connections (`upstream`) frame
//! their messages with these; HTTP/2 stays hyper's.

pub mod body;
pub mod chunked;
pub mod head;
