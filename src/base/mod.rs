//! Layer: base — the small shared vocabulary of both planes, above only
//! `config`: clocks, coarse per-thread deadlines, the response body type, the streamed request body of an HTTP/1.1 connection (`pipe`), the per-request `Decision`, the
//! typed request-path error, live counters, IP lists, rate-limited logging,
//! bounded free lists, a connection's open-file slots, the per-stream "waiting for the client" mark
//! of HTTP/2 responses, the two halves of an upgraded connection and the allocator nudge that returns freed memory.
//! Nothing here knows about generations, nodes or the gateway.

pub mod baggage;
pub mod body;
pub mod clock;
pub mod counter;
pub mod deadline;
pub mod decision;
pub mod error;
pub mod fileslots;
pub mod freelist;
pub mod grpc;
pub mod lists;
pub mod pipe;
pub mod ratelog;
pub mod sendwait;
pub mod stall;
pub mod trace;
pub mod upgrade;

/// Request extension: the request arrived over TLS (the server layer sets
/// it; `X-Forwarded-Proto`, `ngx.var.scheme` and `req.scheme` read it).
/// Absent on plain connections, so plain requests pay nothing for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Https;
