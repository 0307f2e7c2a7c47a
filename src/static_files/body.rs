//! Layer: static files. The body of a file the cache does not hold: read on
//! the worker thread with positioned reads (`pread`, no blocking-pool hop),
//! one chunk at a time, in a buffer lent to the server layer and handed back
//! when the server has written it — so a connection holds at most one chunk
//! (`CHUNK` bytes) of the file however slowly its client reads. Parts held in
//! memory (multipart headers, cached content) pass through as slices of at
//! most a chunk.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use crate::base::fileslots::FileSlot;

/// Bytes read from disk per frame (and the most one connection buffers).
pub const CHUNK: usize = 16 * 1024;

/// The largest frame cut from a part already in memory (a slice, no copy).
pub const MEM_FRAME: usize = 16 * 1024;

/// One part of a response body.
pub enum Segment {
    /// Bytes already in memory.
    Mem(Bytes),
    /// `len` bytes of the file from `offset`.
    File { offset: u64, len: u64 },
}

/// The buffer shared between a body and the frame the server holds.
#[derive(Default)]
struct Gate {
    inner: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    /// The buffer, when it is back from the server.
    spare: Option<Vec<u8>>,
    /// A frame holding the buffer is still with the server.
    lent: bool,
    waker: Option<Waker>,
}

/// The owner of a frame's bytes: gives the buffer back when dropped.
struct Lent {
    buf: Vec<u8>,
    len: usize,
    gate: Arc<Gate>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let waker = {
            let mut g = self.gate.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.spare = Some(buf);
            g.lent = false;
            g.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// A response body made of segments, file segments read from `file`. The
/// next chunk is read once the frame holding the previous one is dropped, as
/// a server does once it has written it; a consumer that keeps every frame
/// (collecting the body) must not be given one.
pub struct FileBody {
    file: Option<Arc<File>>,
    segments: VecDeque<Segment>,
    remaining: u64,
    gate: Arc<Gate>,
    /// The connection's open-file slot the file holds, if it is bounded:
    /// given back with the file when the body ends (or is dropped).
    slot: Option<FileSlot>,
}

impl FileBody {
    pub fn new(file: Option<File>, segments: VecDeque<Segment>) -> FileBody {
        Self::with(file.map(Arc::new), segments)
    }

    /// As [`FileBody::new`], the file shared (e.g. with a `SendFile`).
    pub fn shared(file: Arc<File>, segments: VecDeque<Segment>) -> FileBody {
        Self::with(Some(file), segments)
    }

    fn with(file: Option<Arc<File>>, segments: VecDeque<Segment>) -> FileBody {
        let remaining = segments
            .iter()
            .map(|s| match s {
                Segment::Mem(b) => b.len() as u64,
                Segment::File { len, .. } => *len,
            })
            .sum();
        FileBody {
            file,
            segments,
            remaining,
            gate: Arc::default(),
            slot: None,
        }
    }

    /// The body holding `slot` until it ends.
    pub fn with_slot(mut self, slot: Option<FileSlot>) -> FileBody {
        self.slot = slot;
        self
    }

    /// Its file and slot given back: nothing more is read.
    fn close(&mut self) {
        self.file = None;
        self.slot = None;
    }

    /// The buffer to read the next chunk into, or `None` (and the waker
    /// registered) while the previous chunk is still with the server.
    fn take_buffer(&self, cx: &Context<'_>) -> Option<Vec<u8>> {
        let mut g = self.gate.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.lent {
            g.waker = Some(cx.waker().clone());
            // The server has not written the previous chunk: this wait is
            // the client's (an HTTP/2 stream's send timeout counts it).
            crate::base::sendwait::client_wait();
            return None;
        }
        g.lent = true;
        Some(g.spare.take().unwrap_or_else(|| vec![0; CHUNK]))
    }
}

fn shrank() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank while being sent")
}

impl hyper::body::Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        let (offset, len) = match this.segments.front_mut() {
            None => {
                this.close();
                return Poll::Ready(None);
            }
            Some(Segment::Mem(b)) => {
                // At most a chunk per frame (a slice, not a copy): a server
                // that copies frames into its write buffer then holds a
                // chunk, not the whole file, per connection.
                let part = if b.len() > MEM_FRAME {
                    b.split_to(MEM_FRAME)
                } else {
                    let part = std::mem::take(b);
                    this.segments.pop_front();
                    part
                };
                this.remaining -= part.len() as u64;
                return Poll::Ready(Some(Ok(Frame::data(part))));
            }
            Some(Segment::File { offset, len }) => (*offset, *len),
        };
        let Some(mut buf) = this.take_buffer(cx) else {
            return Poll::Pending;
        };
        let want = len.min(CHUNK as u64) as usize;
        let mut got = 0;
        let file = this.file.as_ref().expect("file segments come with a file");
        let read = loop {
            if got == want {
                break Ok(());
            }
            match file.read_at(&mut buf[got..want], offset + got as u64) {
                Ok(0) => break Err(shrank()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        let lent = Lent {
            buf,
            len: got,
            gate: this.gate.clone(),
        };
        if let Err(e) = read {
            drop(lent);
            this.segments.clear();
            this.remaining = 0;
            this.close();
            return Poll::Ready(Some(Err(e)));
        }
        match this.segments.front_mut() {
            Some(Segment::File { offset, len }) if *len > want as u64 => {
                *offset += want as u64;
                *len -= want as u64;
            }
            _ => {
                this.segments.pop_front();
            }
        }
        this.remaining -= want as u64;
        if !this
            .segments
            .iter()
            .any(|s| matches!(s, Segment::File { .. }))
        {
            // The last read from the file: it (and its slot) need not wait
            // for the client to take the rest.
            this.close();
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(lent)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::io::Write;

    /// Reads the body as a server does: each frame dropped once "written"
    /// (a consumer holding every frame would wait for ever: one buffer).
    async fn drain(mut body: FileBody) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.extend_from_slice(&frame?.into_data().unwrap());
        }
        Ok(out)
    }

    fn file_with(data: &[u8]) -> (tempfile::NamedTempFile, File) {
        let mut t = tempfile::NamedTempFile::new().unwrap();
        t.write_all(data).unwrap();
        let f = File::open(t.path()).unwrap();
        (t, f)
    }

    #[tokio::test]
    async fn segments_come_out_in_order_and_whole() {
        let data: Vec<u8> = (0..3 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let (_t, f) = file_with(&data);
        let segs = VecDeque::from([
            Segment::Mem(Bytes::from_static(b"head")),
            Segment::File {
                offset: 5,
                len: (2 * CHUNK + 3) as u64,
            },
            Segment::Mem(Bytes::from_static(b"mid")),
            Segment::File {
                offset: 0,
                len: data.len() as u64,
            },
        ]);
        let body = FileBody::new(Some(f), segs);
        assert_eq!(
            hyper::body::Body::size_hint(&body).exact(),
            Some((7 + 5 * CHUNK + 3 + 17) as u64)
        );
        let got = drain(body).await.unwrap();
        let mut want = b"head".to_vec();
        want.extend_from_slice(&data[5..5 + 2 * CHUNK + 3]);
        want.extend_from_slice(b"mid");
        want.extend_from_slice(&data);
        assert_eq!(got.len(), want.len());
        assert!(got == want);
    }

    #[tokio::test]
    async fn memory_parts_go_out_a_chunk_at_most_per_frame() {
        let data = Bytes::from((0..2 * MEM_FRAME + 5).map(|i| i as u8).collect::<Vec<u8>>());
        let mut body = FileBody::new(None, VecDeque::from([Segment::Mem(data.clone())]));
        let mut sizes = Vec::new();
        let mut out = Vec::new();
        while let Some(f) = body.frame().await {
            let d = f.unwrap().into_data().unwrap();
            sizes.push(d.len());
            out.extend_from_slice(&d);
        }
        assert_eq!(sizes, [MEM_FRAME, MEM_FRAME, 5]);
        assert!(out == data);
    }

    #[test]
    fn one_chunk_at_a_time_until_the_server_lets_go() {
        let data = vec![7u8; 3 * CHUNK];
        let (_t, f) = file_with(&data);
        let segs = VecDeque::from([Segment::File {
            offset: 0,
            len: data.len() as u64,
        }]);
        let mut body = FileBody::new(Some(f), segs);
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut poll = |b: &mut FileBody| hyper::body::Body::poll_frame(Pin::new(b), &mut cx);
        let Poll::Ready(Some(Ok(first))) = poll(&mut body) else {
            panic!("first chunk")
        };
        // The server still holds the first chunk: no second read.
        assert!(poll(&mut body).is_pending());
        assert!(poll(&mut body).is_pending());
        drop(first);
        let Poll::Ready(Some(Ok(second))) = poll(&mut body) else {
            panic!("second chunk")
        };
        assert_eq!(second.into_data().unwrap().len(), CHUNK);
    }

    #[tokio::test]
    async fn a_file_that_shrank_is_an_error_not_a_short_body() {
        let (_t, f) = file_with(b"0123456789");
        let segs = VecDeque::from([Segment::File { offset: 0, len: 20 }]);
        assert!(drain(FileBody::new(Some(f), segs)).await.is_err());
    }
}
