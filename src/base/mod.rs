//! Layer: base — the small shared vocabulary of both planes, above only
//! `config`: clocks, the response body type, the per-request `Decision`, the
//! typed request-path error, live counters, IP lists and rate-limited logging.
//! Nothing here knows about generations, nodes or the gateway.

pub mod body;
pub mod clock;
pub mod counter;
pub mod decision;
pub mod error;
pub mod lists;
pub mod ratelog;
pub mod stall;
