//! Layer: codec. The read buffers of HTTP/1.1 connections, both sides,
//! pooled per thread: a client connection takes one only while a head is
//! being read (or a streamed body pumped) and gives it back once the
//! request is parsed; a node connection takes one for an exchange and
//! gives it back when it goes idle into its pool. So an idle keep-alive
//! connection, of either side, holds no buffer (hyper kept its read and
//! write buffers for the connection's life; nginx keeps half a kilobyte
//! per idle client connection). What it buys is measured as memory per
//! idle connection (`bench/idle_conns.py`, docs: benchmarks → idle
//! connections: 0.63 KB) and as instructions per request (no allocation
//! per request: `bench/instructions.py`); what a burst left is freed on the
//! accept loop's tick ([`trim`]). Each side has its own pool: a client
//! connection's buffer comes back with the request's fields still alive at
//! its front (they are slices of it), a node connection's with the body's
//! frames still on their way; a buffer handed to the other side would make
//! its next read allocate a new one instead of reclaiming the old in place.

use std::cell::RefCell;

use bytes::BytesMut;

use crate::base::freelist::FreeList;

/// A pooled read buffer's size; a head longer than this grows it (up to the
/// connection's limit).
pub const READ_BUF: usize = 4096;
/// Read buffers kept per thread and side between requests (as many as a
/// burst of requests in flight used; what the load does not use again is
/// freed by [`trim`]).
const POOL_MAX: usize = 1024;
/// A node buffer grown past this (a node's large answers double its
/// connection's reads up to 64 KiB) is freed rather than kept.
const NODE_KEEP_MAX: usize = 64 * 1024;

/// Which side's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Client connections (`server::h1`).
    Client,
    /// Node connections (`upstream::h1`).
    Node,
}

thread_local! {
    static CLIENT: RefCell<FreeList<BytesMut>> = const { RefCell::new(FreeList::new(POOL_MAX)) };
    static NODE: RefCell<FreeList<BytesMut>> = const { RefCell::new(FreeList::new(POOL_MAX)) };
}

/// The thread's pool of `side`.
#[inline(always)]
fn pool<R>(side: Side, f: impl FnOnce(&mut FreeList<BytesMut>) -> R) -> R {
    match side {
        Side::Client => CLIENT.with(|p| f(&mut p.borrow_mut())),
        Side::Node => NODE.with(|p| f(&mut p.borrow_mut())),
    }
}

/// A kept buffer of `side`, if the thread has one.
#[inline(always)]
pub fn take_kept(side: Side) -> Option<BytesMut> {
    pool(side, FreeList::take)
}

/// A buffer from the thread's pool of `side` (or a new one of [`READ_BUF`]).
#[inline(always)]
pub fn take(side: Side) -> BytesMut {
    take_kept(side).unwrap_or_else(|| BytesMut::with_capacity(READ_BUF))
}

/// Gives `b` back to the thread's pool of `side`: a client buffer emptied
/// (one grown past 16 KiB is freed instead); a node buffer as it is (its
/// connection read it to the end; one grown past 64 KiB is freed).
#[inline(always)]
pub fn give(side: Side, mut b: BytesMut) {
    if side == Side::Node && b.capacity() > NODE_KEEP_MAX {
        return;
    }
    if side == Side::Client {
        b.clear();
        // The heads split off the front may still be alive (the request's
        // fields are slices of them): the rest of the allocation serves
        // the next heads, and once it runs low `reserve` takes the whole
        // allocation back (in place, when those heads are gone).
        if b.capacity() < 1024 {
            b.reserve(READ_BUF);
        }
        if b.capacity() > 4 * READ_BUF {
            return;
        }
    }
    // A full list gives it back: dropped here.
    drop(pool(side, |p| p.give(b)));
}

/// Frees the thread's kept buffers (both sides) that were not handed out
/// since the last call; how many were freed.
pub fn trim() -> usize {
    let trim = |p: &RefCell<FreeList<BytesMut>>| p.borrow_mut().trim();
    CLIENT.try_with(trim).unwrap_or(0) + NODE.try_with(trim).unwrap_or(0)
}

/// How many buffers the thread keeps for `side`.
#[cfg(test)]
pub fn kept(side: Side) -> usize {
    pool(side, |p| p.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tick's trim frees what a burst left and nothing took since the
    /// last trim.
    #[test]
    fn trim_frees_the_buffers_a_burst_left() {
        let bufs: Vec<_> = (0..40).map(|_| take(Side::Client)).collect();
        bufs.into_iter().for_each(|b| give(Side::Client, b));
        assert_eq!(kept(Side::Client), 40);
        assert_eq!(kept(Side::Node), 0, "a side's buffers go to its own pool");
        // One taken and given back since the first trim: it stays.
        trim();
        give(Side::Client, take(Side::Client));
        assert_eq!(trim(), 39, "the burst's buffers were not freed");
        assert_eq!(kept(Side::Client), 1);
    }

    /// A buffer grown past its side's cap is freed, not kept: a client's
    /// past 16 KiB, a node's past 64 KiB.
    #[test]
    fn grown_buffers_are_freed_not_kept() {
        trim();
        trim();
        give(Side::Client, BytesMut::with_capacity(4 * READ_BUF + 1));
        give(Side::Node, BytesMut::with_capacity(NODE_KEEP_MAX + 1));
        assert_eq!((kept(Side::Client), kept(Side::Node)), (0, 0));
        give(Side::Node, BytesMut::with_capacity(NODE_KEEP_MAX));
        assert_eq!(kept(Side::Node), 1);
    }
}
