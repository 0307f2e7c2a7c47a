//! Layer: observe — below both planes, above `base` and `config`: Prometheus
//! metrics and per-request observation, per-node counters, and the non-blocking
//! access log. The data plane writes into it; admin reads it.

pub mod access_log;
pub mod lanes;
pub mod metrics;
pub mod node_stats;
pub mod otel;
