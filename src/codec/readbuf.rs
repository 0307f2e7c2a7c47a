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
//! accept loop's tick ([`trim`]).

use std::cell::RefCell;

use bytes::BytesMut;

use crate::base::freelist::FreeList;

/// A pooled read buffer's size; a head longer than this grows it (up to the
/// connection's limit).
pub const READ_BUF: usize = 4096;
/// Read buffers kept per thread between requests (as many as a burst of
/// requests in flight used; what the load does not use again is freed by
/// [`trim`]).
const POOL_MAX: usize = 1024;
/// A buffer grown past this (a node's large answers double a connection's
/// reads up to 64 KiB) is freed rather than kept.
const KEEP_MAX: usize = 64 * 1024;

thread_local! {
    static READ_POOL: RefCell<FreeList<BytesMut>> = const { RefCell::new(FreeList::new(POOL_MAX)) };
}

/// A buffer from the thread's pool (or a new one of [`READ_BUF`]).
pub fn take() -> BytesMut {
    READ_POOL
        .with(|p| p.borrow_mut().take())
        .unwrap_or_else(|| BytesMut::with_capacity(READ_BUF))
}

/// Gives `b` back to the thread's pool (emptied; one grown past 64 KiB is
/// freed instead).
pub fn give(mut b: BytesMut) {
    b.clear();
    // The heads split off the front may still be alive (the request's
    // fields are slices of them): the rest of the allocation serves the
    // next heads, and once it runs low `reserve` takes the whole
    // allocation back (in place, when those heads are gone).
    if b.capacity() < 1024 {
        b.reserve(READ_BUF);
    }
    if b.capacity() > KEEP_MAX {
        return;
    }
    // A full list gives it back: dropped here.
    drop(READ_POOL.with(|p| p.borrow_mut().give(b)));
}

/// Frees the thread's kept buffers that were not handed out since the last
/// call; how many were freed.
pub fn trim() -> usize {
    READ_POOL.try_with(|p| p.borrow_mut().trim()).unwrap_or(0)
}

/// How many buffers the thread keeps.
#[cfg(test)]
pub fn kept() -> usize {
    READ_POOL.with(|p| p.borrow().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tick's trim frees what a burst left and nothing took since the
    /// last trim.
    #[test]
    fn trim_frees_the_buffers_a_burst_left() {
        let bufs: Vec<_> = (0..40).map(|_| take()).collect();
        bufs.into_iter().for_each(give);
        assert_eq!(kept(), 40);
        // One taken and given back since the first trim: it stays.
        trim();
        give(take());
        assert_eq!(trim(), 39, "the burst's buffers were not freed");
        assert_eq!(kept(), 1);
    }
}
