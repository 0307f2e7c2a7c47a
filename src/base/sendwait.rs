//! Layer: base. Whether the response stream being polled is waiting for its
//! client. An HTTP/2 server polls a response body only while the stream may
//! send, so a stalled client shows as silence, not as a wait the body could
//! time: the server layer (`server::h2guard`) keeps one [`Waiting`] per
//! stream, sets it around each poll of the stream's task, and cuts the stream
//! when it has waited for its client longer than the send timeout. Bodies
//! whose `Pending` means "my previous chunk is still with the server" (not
//! "my source has nothing yet") say so with [`client_wait`]; outside such a
//! scope (HTTP/1.1) that is a no-op.

use std::cell::Cell;

scoped_tls::scoped_thread_local!(static STREAM: Waiting);

/// One response stream's wait for its client.
#[derive(Debug, Default)]
pub struct Waiting {
    /// Since when (`now_ms`) the stream has been waiting for its client to
    /// take the next chunk; 0 = not waiting for the client.
    since: Cell<u64>,
    /// Set during one body poll by [`client_wait`].
    client: Cell<bool>,
}

impl Waiting {
    /// Since when the stream has waited for its client (0 = it is not).
    pub fn since(&self) -> u64 {
        self.since.get()
    }

    /// Runs `f` (one poll of the stream's task) with this stream current.
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        STREAM.set(self, f)
    }
}

/// What one poll of a response body came to, for the current stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polled {
    /// A chunk to send: from now the stream waits for its client to take it.
    Chunk,
    /// The body has nothing yet (waiting on its source, or on the client if
    /// it called [`client_wait`] meanwhile).
    Pending,
    /// Trailers, the end or an error: nothing more to send.
    Done,
}

/// Runs one body poll `f` for the current stream (if any) and records what
/// it came to at `now` (`now_ms`).
pub fn body_poll<R>(now: impl FnOnce() -> u64, f: impl FnOnce() -> (R, Polled)) -> R {
    if !STREAM.is_set() {
        return f().0;
    }
    STREAM.with(|w| w.client.set(false));
    let (r, polled) = f();
    STREAM.with(|w| match polled {
        Polled::Chunk => w.since.set(now()),
        Polled::Pending if w.client.get() => {
            if w.since.get() == 0 {
                w.since.set(now());
            }
        }
        Polled::Pending | Polled::Done => w.since.set(0),
    });
    r
}

/// Called by a body poll that returns `Pending` because the server still
/// holds the body's previous chunk (it is waiting for the client).
pub fn client_wait() {
    if STREAM.is_set() {
        STREAM.with(|w| w.client.set(true));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_starts_the_wait_a_source_wait_ends_it() {
        let w = Waiting::default();
        assert_eq!(w.since(), 0);
        w.enter(|| body_poll(|| 10, || ((), Polled::Chunk)));
        assert_eq!(w.since(), 10);
        // Still waiting for the client (the previous chunk is unsent): the
        // wait keeps its start, however often the body is polled.
        w.enter(|| {
            body_poll(
                || 20,
                || {
                    client_wait();
                    ((), Polled::Pending)
                },
            )
        });
        assert_eq!(w.since(), 10);
        // The next chunk: a fresh wait.
        w.enter(|| body_poll(|| 30, || ((), Polled::Chunk)));
        assert_eq!(w.since(), 30);
        // Waiting on the source (a slow node): not the client's doing.
        w.enter(|| body_poll(|| 40, || ((), Polled::Pending)));
        assert_eq!(w.since(), 0);
        // A client wait that begins with no chunk pending starts now.
        w.enter(|| {
            body_poll(
                || 50,
                || {
                    client_wait();
                    ((), Polled::Pending)
                },
            )
        });
        assert_eq!(w.since(), 50);
        w.enter(|| body_poll(|| 60, || ((), Polled::Done)));
        assert_eq!(w.since(), 0);
    }

    #[test]
    fn outside_a_stream_nothing_is_recorded() {
        client_wait();
        assert_eq!(body_poll(|| 1, || (7, Polled::Chunk)), 7);
    }
}
