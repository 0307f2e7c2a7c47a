//! Layer: upstream. The per-thread keep-alive pool both upstream engines keep
//! their idle connections in, keyed by node address: newest first, with an idle
//! timeout (on the coarse millisecond clock) and a per-node cap. What a burst
//! left beyond what the load uses is closed sooner ([`IdlePool::trim`],
//! on the accept loop's coarse tick): every [`PURGE_MS`], the connections
//! to a node that no request took during the whole period, all but one
//! (HAProxy's `pool-purge-delay`, 5 s by default, in its spirit). The one
//! kept is the oldest opened: its memory sits among what was there before
//! the burst, so closing the burst's own lets their allocator pages go
//! back whole.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustc_hash::FxHashMap;

use crate::base::clock::now_ms;

/// How often the connections no request took are closed.
pub const PURGE_MS: u64 = 5000;

/// Idle connections of type `T` by node address. FxHash: an address is
/// hashed twice per request (checkout and checkin), and SipHash's flooding
/// resistance buys nothing for our own node list.
pub struct IdlePool<T, K = SocketAddr> {
    by_addr: FxHashMap<K, Idle<T>>,
    /// The last purge (`now_ms`).
    purged: u64,
}

/// One node's idle connections, oldest first, with when each went idle.
struct Idle<T> {
    conns: Vec<(T, u64)>,
    /// The fewest idle since the last purge: the oldest that many were not
    /// taken meanwhile.
    low: usize,
}

/// What [`IdlePool::trim`] needs to know of a pooled connection.
pub trait Opened {
    /// Its place in the order connections were opened ([`opening`]).
    fn opened(&self) -> u64;
}

/// The next place in the order upstream connections are opened (a
/// counter, not a clock: two opened in the same millisecond still differ).
pub fn opening() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl<T, K> Default for IdlePool<T, K> {
    fn default() -> Self {
        IdlePool {
            by_addr: FxHashMap::default(),
            purged: 0,
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
        let mut found = None;
        while let Some((conn, since)) = list.conns.pop() {
            if fresh(now, since, idle_timeout) && usable(&conn) {
                found = Some(conn);
                break;
            }
        }
        list.low = list.low.min(list.conns.len());
        found
    }

    /// Keeps `conn` for reuse unless `addr` already has `max_idle` idle.
    pub fn checkin(&mut self, addr: K, conn: T, max_idle: usize) {
        let list = self.by_addr.entry(addr).or_insert_with(|| Idle {
            conns: Vec::new(),
            low: 0,
        });
        if list.conns.len() < max_idle {
            list.conns.push((conn, now_ms()));
        }
    }
}

impl<T: Opened, K: std::hash::Hash + Eq> IdlePool<T, K> {
    /// Closes (drops) the idle connections past `idle_timeout` or no
    /// longer `usable`, and every [`PURGE_MS`] those no request took during
    /// the period; of a node none of whose was taken, all but the oldest
    /// opened (the burst's connections go, and their memory with them,
    /// while the one kept holds memory from before); how many.
    pub fn trim(&mut self, now: u64, idle_timeout: Duration, usable: impl Fn(&T) -> bool) -> usize {
        let purge = now >= self.purged + PURGE_MS;
        if purge {
            self.purged = now;
        }
        let mut closed = 0;
        self.by_addr.retain(|_, list| {
            let before = list.conns.len();
            if purge {
                if list.low >= before && before > 1 {
                    let oldest = (0..before)
                        .min_by_key(|&i| list.conns[i].0.opened())
                        .unwrap_or(0);
                    list.conns.swap(oldest, before - 1);
                }
                let unused = list.low.min(before.saturating_sub(1));
                list.conns.drain(..unused);
            }
            list.conns
                .retain(|(conn, since)| fresh(now, *since, idle_timeout) && usable(conn));
            let len = list.conns.len();
            closed += before - len;
            if purge {
                list.low = len;
                if list.conns.capacity() > 2 * len + 8 {
                    list.conns.shrink_to(len);
                }
            }
            len > 0
        });
        closed
    }
}

/// Idle since `since` (`now_ms`), less than `idle_timeout` by `now`.
fn fresh(now: u64, since: u64, idle_timeout: Duration) -> bool {
    u128::from(now.saturating_sub(since)) < idle_timeout.as_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test connections are numbers, opened in their order.
    impl Opened for i32 {
        fn opened(&self) -> u64 {
            *self as u64
        }
    }

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

    /// A purge closes what no request took during the period (of a node
    /// none of whose was taken, all but the oldest opened), keeps what the
    /// load took; a trim between purges closes only the expired and the
    /// unusable.
    #[test]
    fn trim_closes_what_a_burst_left_and_keeps_what_the_load_takes() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let long = Duration::from_secs(60);
        let mut p = IdlePool::default();
        let t0 = now_ms() + PURGE_MS;
        assert_eq!(p.trim(t0, long, |_| true), 0, "an empty pool");
        // A burst left 100 connections to `a`, one to `b`.
        for c in 0..100 {
            p.checkin(a, c, 256);
        }
        p.checkin(b, 1000, 256);
        assert_eq!(p.trim(t0 + 1000, long, |_| true), 0, "no purge yet");
        assert_eq!(
            p.trim(t0 + 1000, long, |&c| c != 99),
            1,
            "an unusable one is closed on any trim"
        );
        // Held from before the last purge: none counts as unused yet.
        assert_eq!(p.trim(t0 + PURGE_MS, long, |_| true), 0);
        // The steady load: at most 3 out at once.
        for _ in 0..10 {
            let three: Vec<_> = (0..3)
                .filter_map(|_| p.checkout(a, long, |_| true))
                .collect();
            assert_eq!(three.len(), 3);
            three.into_iter().for_each(|c| p.checkin(a, c, 256));
        }
        assert_eq!(
            p.trim(t0 + 2 * PURGE_MS, long, |_| true),
            96,
            "the 96 not taken go; b's only one stays"
        );
        let mut left: Vec<_> = std::iter::from_fn(|| p.checkout(a, long, |_| true)).collect();
        left.sort();
        assert_eq!(left, vec![96, 97, 98], "the load's three were kept");
        assert_eq!(p.checkout(b, long, |_| true), Some(1000));
        // Untaken for a period: all but the oldest opened go (checked in
        // second from the bottom: the pool's order is not the opening's).
        for c in [1, 0, 2, 3, 4] {
            p.checkin(a, c, 256);
        }
        assert_eq!(
            p.trim(t0 + 3 * PURGE_MS, long, |_| true),
            0,
            "checked in after the purge"
        );
        assert_eq!(p.trim(t0 + 4 * PURGE_MS, long, |_| true), 4);
        assert_eq!(p.checkout(a, long, |_| true), Some(0), "the oldest stays");
        assert_eq!(p.checkout(a, long, |_| true), None);
        // The newest was taken during the period (and put back): it is the
        // load's, so it stays, however young.
        for c in [9, 5, 8] {
            p.checkin(a, c, 256);
        }
        assert_eq!(p.trim(t0 + 5 * PURGE_MS, long, |_| true), 0);
        let top = p.checkout(a, long, |_| true).unwrap();
        p.checkin(a, top, 256);
        assert_eq!(p.trim(t0 + 6 * PURGE_MS, long, |_| true), 2);
        assert_eq!(
            p.checkout(a, long, |_| true),
            Some(8),
            "the one taken stays"
        );
        // The idle timeout holds between purges too.
        p.checkin(a, 7, 256);
        let short = Duration::from_millis(10);
        assert_eq!(p.trim(now_ms() + 11, short, |_| true), 1, "idle too long");
        assert!(p.by_addr.is_empty(), "a node with none idle is forgotten");
    }
}
