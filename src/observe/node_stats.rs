//! Layer: observe. Per-node request counters (in flight, requests, errors),
//! kept outside generations so they survive reloads.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Live counters of one node. They live outside the generation (keyed by
/// service and address) so they survive reloads.
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub in_flight: AtomicI64,
    pub requests: AtomicU64,
    pub errors: AtomicU64,
}

impl NodeCounters {
    pub fn snapshot(&self) -> (i64, u64, u64) {
        (
            self.in_flight.load(Ordering::Relaxed),
            self.requests.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
        )
    }
}

/// The counters of the services sharing one address.
type ByService = Vec<(String, Arc<NodeCounters>)>;

/// Every node's counters, by address then service.
#[derive(Debug, Default)]
pub struct NodeStats(RwLock<rustc_hash::FxHashMap<SocketAddr, ByService>>);

impl NodeStats {
    /// The counters of (`service`, `addr`), created on first use.
    pub fn get(&self, service: &str, addr: SocketAddr) -> Arc<NodeCounters> {
        if let Some(c) = self.find(service, addr) {
            return c;
        }
        let mut m = self.0.write().unwrap_or_else(|e| e.into_inner());
        let list = m.entry(addr).or_default();
        if let Some((_, c)) = list.iter().find(|(s, _)| s == service) {
            return c.clone();
        }
        let c = Arc::new(NodeCounters::default());
        list.push((service.to_string(), c.clone()));
        c
    }

    /// The counters of (`service`, `addr`) if it ever served a request.
    pub fn find(&self, service: &str, addr: SocketAddr) -> Option<Arc<NodeCounters>> {
        let m = self.0.read().unwrap_or_else(|e| e.into_inner());
        m.get(&addr)?
            .iter()
            .find(|(s, _)| s == service)
            .map(|(_, c)| c.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_stats_survive_by_service_and_addr() {
        let stats = NodeStats::default();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        stats.get("s", a).requests.fetch_add(1, Ordering::Relaxed);
        assert_eq!(stats.get("s", a).snapshot().1, 1);
        assert_eq!(stats.get("t", a).snapshot().1, 0);
        assert!(stats.find("u", a).is_none());
    }
}
