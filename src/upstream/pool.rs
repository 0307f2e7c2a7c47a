//! Layer: upstream. The per-thread keep-alive pool both upstream engines keep
//! their idle connections in, keyed by node address: newest first, with an idle
//! timeout (on the coarse millisecond clock) and a per-node cap.

use std::net::SocketAddr;
use std::time::Duration;

use rustc_hash::FxHashMap;

use crate::base::clock::now_ms;

/// Idle connections of type `T` by node address. FxHash: an address is
/// hashed twice per request (checkout and checkin), and SipHash's flooding
/// resistance buys nothing for our own node list.
pub struct IdlePool<T, K = SocketAddr> {
    by_addr: FxHashMap<K, Vec<(T, u64)>>,
}

impl<T, K> Default for IdlePool<T, K> {
    fn default() -> Self {
        IdlePool {
            by_addr: FxHashMap::default(),
        }
    }
}

impl<T, K: std::hash::Hash + Eq> IdlePool<T, K> {
    /// The newest idle connection to `addr` that has been idle less than
    /// `idle_timeout` and is still `usable`; the others met on the way are
    /// dropped (closed).
    pub fn checkout(
        &mut self,
        addr: K,
        idle_timeout: Duration,
        usable: impl Fn(&T) -> bool,
    ) -> Option<T> {
        let list = self.by_addr.get_mut(&addr)?;
        let now = now_ms();
        while let Some((conn, since)) = list.pop() {
            if u128::from(now.saturating_sub(since)) < idle_timeout.as_millis() && usable(&conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for reuse unless `addr` already has `max_idle` idle.
    pub fn checkin(&mut self, addr: K, conn: T, max_idle: usize) {
        let list = self.by_addr.entry(addr).or_default();
        if list.len() < max_idle {
            list.push((conn, now_ms()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_first_capped_and_unusable_ones_dropped() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let mut p = IdlePool::default();
        for c in 1..=3 {
            p.checkin(a, c, 2);
        }
        let long = Duration::from_secs(60);
        assert_eq!(p.checkout(b, long, |_| true), None);
        assert_eq!(
            p.checkout(a, long, |&c| c != 2),
            Some(1),
            "2 unusable, 3 over the cap"
        );
        assert_eq!(p.checkout(a, long, |_| true), None);
        p.checkin(a, 4, 2);
        assert_eq!(
            p.checkout(a, Duration::ZERO, |_| true),
            None,
            "idle too long"
        );
    }
}
