//! Layer: codec. `Transfer-Encoding: chunked` both ways: the encoder for a
//! request body of unknown length the gateway sends ([`SizeLine`],
//! [`LAST_CHUNK`], [`encode`]), and the incremental decoder for response
//! bodies: fed from the connection's read buffer, it hands out chunk
//! data without copying and drops chunk extensions and trailers (as nginx
//! does). Strict, as RFC 9112 §7.1 reads: every line ends in CRLF (a bare
//! LF is an error), sizes are hex digits only (httparse's chunk-size parser,
//! the one hyper uses; at most 15 digits), and size and trailer lines are
//! bounded.

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 8 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Size,
    Data(u64),
    DataEnd,
    Trailers,
    Done,
}

/// What one decoding step produced.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// A piece of body data.
    Data(Bytes),
    /// The buffer holds no complete next item: read more.
    More,
    /// The last chunk and the trailers have been read.
    Done,
}

/// Decoder state for one chunked body.
#[derive(Debug)]
pub struct Chunked {
    state: State,
}

impl Default for Chunked {
    fn default() -> Self {
        Chunked { state: State::Size }
    }
}

/// Takes one CRLF-terminated line (without its CRLF) off the front of
/// `buf`; a bare LF is an error.
fn line(buf: &mut BytesMut) -> Result<Option<Bytes>, &'static str> {
    Ok(line_end(buf)?.map(|i| {
        let mut l = buf.split_to(i + 1).freeze();
        l.truncate(i - 1);
        l
    }))
}

/// Where the CRLF-terminated line at the front of `buf` ends (its LF);
/// `None` when more bytes are needed; a bare LF is an error.
fn line_end(buf: &[u8]) -> Result<Option<usize>, &'static str> {
    match buf.iter().position(|&b| b == b'\n') {
        Some(i) if i > MAX_LINE => Err("chunk line too long"),
        Some(i) if i == 0 || buf[i - 1] != b'\r' => Err("bare LF in a chunked body"),
        Some(i) => Ok(Some(i)),
        None if buf.len() > MAX_LINE => Err("chunk line too long"),
        None => Ok(None),
    }
}

/// Checks the part of a chunked body already in `buf` (what came with the
/// response head) without consuming it: the error [`Chunked::step`] would
/// meet in these bytes, so that a broken body in hand is refused before
/// the head goes out (a 502, not a 200 cut short). `Ok` when the bytes are
/// well-formed as far as they go. One step per chunk, no copy.
pub fn check_in_hand(buf: &[u8]) -> Result<(), &'static str> {
    let mut at = 0usize;
    loop {
        let Some((used, size)) = parse_size(&buf[at..])? else {
            return Ok(());
        };
        at += used;
        if size == 0 {
            break;
        }
        let Some(end) = usize::try_from(size).ok().and_then(|n| at.checked_add(n)) else {
            return Ok(());
        };
        match buf.get(end..) {
            None | Some([]) | Some([b'\r']) => return Ok(()),
            Some([b'\r', b'\n', ..]) => at = end + 2,
            Some(_) => return Err("missing CRLF after chunk data"),
        }
    }
    // The trailers, up to the empty line that ends them.
    while let Some(i) = line_end(&buf[at..])? {
        if i == 1 {
            break;
        }
        at += i + 1;
    }
    Ok(())
}

/// Reads a chunk-size line at the front of `buf` without consuming it:
/// `Some((line length, size))` when complete, `None` when more bytes are
/// needed.
pub fn parse_size(buf: &[u8]) -> Result<Option<(usize, u64)>, &'static str> {
    if !buf.first().is_none_or(u8::is_ascii_hexdigit) {
        return Err("bad chunk size");
    }
    match httparse::parse_chunk_size(buf) {
        Ok(httparse::Status::Complete(r)) => Ok(Some(r)),
        Ok(httparse::Status::Partial) if buf.len() > MAX_LINE => Err("chunk line too long"),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(_) => Err("bad chunk size"),
    }
}

/// Takes a chunk-size line off the front of `buf`.
fn chunk_size(buf: &mut BytesMut) -> Result<Option<u64>, &'static str> {
    let parsed = parse_size(buf)?;
    Ok(parsed.map(|(used, size)| {
        buf.advance(used);
        size
    }))
}

impl Chunked {
    /// Decodes as far as `buf` allows, consuming what it uses.
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, &'static str> {
        loop {
            match self.state {
                State::Done => return Ok(Step::Done),
                State::Size => {
                    let Some(size) = chunk_size(buf)? else {
                        return Ok(Step::More);
                    };
                    self.state = match size {
                        0 => State::Trailers,
                        n => State::Data(n),
                    };
                }
                State::Data(rem) => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    let n = rem.min(buf.len() as u64);
                    let data = buf.split_to(n as usize).freeze();
                    self.state = if n == rem {
                        State::DataEnd
                    } else {
                        State::Data(rem - n)
                    };
                    return Ok(Step::Data(data));
                }
                State::DataEnd => match buf.first() {
                    None => return Ok(Step::More),
                    Some(b'\r') if buf.len() < 2 => return Ok(Step::More),
                    Some(b'\r') if buf[1] == b'\n' => {
                        buf.advance(2);
                        self.state = State::Size;
                    }
                    Some(_) => return Err("missing CRLF after chunk data"),
                },
                State::Trailers => {
                    let Some(l) = line(buf)? else {
                        return Ok(Step::More);
                    };
                    if l.is_empty() {
                        self.state = State::Done;
                    }
                }
            }
        }
    }
}

/// The CRLF that ends a chunk's data.
pub const CRLF: &[u8] = b"\r\n";

/// The last chunk with no trailers: what ends a chunked body.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// The size line that opens a chunk of `len` bytes (lower-case hex, no
/// extension, CRLF), on the stack. A chunk of 0 bytes would end the body:
/// callers send none.
#[derive(Clone, Copy)]
pub struct SizeLine {
    buf: [u8; 18],
    len: u8,
}

impl SizeLine {
    pub fn new(len: usize) -> SizeLine {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut buf = [0u8; 18];
        let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1) as usize;
        for (i, b) in buf[..digits].iter_mut().enumerate() {
            *b = HEX[(len >> (4 * (digits - 1 - i))) & 0xf];
        }
        buf[digits] = b'\r';
        buf[digits + 1] = b'\n';
        SizeLine {
            buf,
            len: digits as u8 + 2,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

/// Appends `data` as one chunk to `out` (nothing for empty data: an empty
/// chunk is the last one).
pub fn encode(data: &[u8], out: &mut Vec<u8>) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(SizeLine::new(data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(CRLF);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_lines_are_bare_lower_case_hex() {
        for (n, want) in [
            (1usize, "1\r\n"),
            (15, "f\r\n"),
            (16, "10\r\n"),
            (255, "ff\r\n"),
            (4096, "1000\r\n"),
            (0xdead_beef, "deadbeef\r\n"),
        ] {
            assert_eq!(SizeLine::new(n).as_bytes(), want.as_bytes(), "{n}");
        }
        let max = SizeLine::new(usize::MAX);
        assert_eq!(max.as_bytes().len(), usize::BITS as usize / 4 + 2);
        // What the strict decoder reads back.
        for n in [1usize, 9, 10, 4095, 1 << 20] {
            let line = SizeLine::new(n);
            assert_eq!(
                parse_size(line.as_bytes()),
                Ok(Some((line.as_bytes().len(), n as u64)))
            );
        }
    }

    /// Every split of the data into chunks decodes back to the same bytes,
    /// fed to the decoder at every piece size, with nothing left over.
    #[test]
    fn encoded_bodies_decode_back() {
        let data: Vec<u8> = (0..=255u8).cycle().take(300).collect();
        for split in [1usize, 7, 16, 299, 300, 1000] {
            let mut wire = Vec::new();
            for part in data.chunks(split) {
                encode(part, &mut wire);
            }
            encode(b"", &mut wire);
            wire.extend_from_slice(LAST_CHUNK);
            for piece in [1usize, 3, 64, wire.len()] {
                let (body, left) = decode(&wire, piece).unwrap();
                assert_eq!(body, data, "split {split} piece {piece}");
                assert_eq!(left, 0);
            }
        }
    }

    /// Feeds `wire` in pieces of `piece` bytes and collects the body.
    fn decode(wire: &[u8], piece: usize) -> Result<(Vec<u8>, usize), &'static str> {
        let mut c = Chunked::default();
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match c.step(&mut buf)? {
                Step::Data(d) => out.extend_from_slice(&d),
                Step::Done => return Ok((out, buf.len())),
                Step::More => {
                    if fed == wire.len() {
                        return Err("truncated");
                    }
                    let end = (fed + piece).min(wire.len());
                    buf.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
            }
        }
    }

    #[test]
    fn decodes_at_every_split() {
        let wire =
            b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: t\r\n\r\n";
        for piece in 1..wire.len() {
            let (body, left) = decode(wire, piece).unwrap();
            assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz", "piece {piece}");
            assert_eq!(left, 0);
        }
    }

    #[test]
    fn leaves_what_follows_the_body() {
        let mut buf = BytesMut::from(&b"0\r\n\r\nHTTP/1.1"[..]);
        let mut c = Chunked::default();
        assert_eq!(c.step(&mut buf).unwrap(), Step::Done);
        assert_eq!(c.state, State::Done);
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    #[test]
    fn strict_lines() {
        for bad in [
            &b"5\nhello\r\n0\r\n\r\n"[..],      // bare LF after the size
            b"5\r\nhello\n0\r\n\r\n",           // bare LF after the data
            b"5\r\nhello\r\n0\r\n\n",           // bare LF ending the trailers
            b"5\r\nhello\r\n0\r\nX-T: a\n\r\n", // bare LF ending a trailer line
            b"0\r\nX-T: a\r\nX-U: b\n\r\n",     // … the second one
            b" 5\r\nhello\r\n0\r\n\r\n",        // leading space
            b"+5\r\nhello\r\n0\r\n\r\n",        // sign
            b"0x5\r\nhello\r\n0\r\n\r\n",       // prefix
            b"5 6\r\nhello\r\n0\r\n\r\n",       // digits after white space
            b"ffffffffffffffffff\r\n",          // 18 digits: overflow
        ] {
            assert!(
                decode(bad, 64).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Extensions and white space before them are allowed.
        assert_eq!(
            decode(b"5 ;a=b\r\nhello\r\n0\r\n\r\n", 3).unwrap().0,
            b"hello"
        );
        // A long extension is bounded even when no LF has arrived.
        let mut long = b"5;".to_vec();
        long.extend(std::iter::repeat_n(b'x', MAX_LINE + 10));
        assert!(decode(&long, 64).is_err());
    }

    #[test]
    fn the_body_in_hand_is_checked_as_the_decoder_would() {
        let good: &[&[u8]] = &[
            b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"0\r\n\r\nHTTP/1.1 200 OK\r\n\n",
        ];
        let bad: &[&[u8]] = &[
            b"5\r\nhello\r\n0\r\nX-T: a\n\r\n",
            b"0\r\nX-T: a\r\nX-U: b\n\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"3\r\nabcX\r\n0\r\n\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"0\r\n\n",
        ];
        for wire in good.iter().chain(bad) {
            // Every prefix: an error exactly when the decoder meets one.
            for cut in 0..=wire.len() {
                let part = &wire[..cut];
                let mut c = Chunked::default();
                let mut buf = BytesMut::from(part);
                let decoder = loop {
                    match c.step(&mut buf) {
                        Ok(Step::Data(_)) => continue,
                        Ok(_) => break Ok(()),
                        Err(e) => break Err(e),
                    }
                };
                assert_eq!(
                    check_in_hand(part),
                    decoder,
                    "{:?}",
                    String::from_utf8_lossy(part)
                );
            }
        }
    }

    #[test]
    fn rejects_garbage() {
        assert!(decode(b"zz\r\n", 4).is_err());
        assert!(decode(b"3\r\nabcX\r\n0\r\n\r\n", 64).is_err());
        assert!(decode(b"\r\n", 4).is_err());
        assert!(decode(&[b'1'; MAX_LINE + 10], 64).is_err());
        assert_eq!(decode(b"5\r\nab", 64), Err("truncated"));
    }
}
