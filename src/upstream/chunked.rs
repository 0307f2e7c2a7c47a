//! Layer: upstream. Incremental decoder for `Transfer-Encoding: chunked`
//! response bodies: fed from the connection's read buffer, it hands out chunk
//! data without copying and drops chunk extensions and trailers (as nginx
//! does).

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

/// Takes one `\n`-terminated line (without `\r\n`) off the front of `buf`.
fn line(buf: &mut BytesMut) -> Result<Option<Bytes>, &'static str> {
    match buf.iter().position(|&b| b == b'\n') {
        Some(i) => {
            let mut l = buf.split_to(i + 1).freeze();
            l.truncate(i);
            if l.last() == Some(&b'\r') {
                l.truncate(i - 1);
            }
            Ok(Some(l))
        }
        None if buf.len() > MAX_LINE => Err("chunk line too long"),
        None => Ok(None),
    }
}

fn chunk_size(l: &[u8]) -> Result<u64, &'static str> {
    let digits = l.split(|&b| b == b';').next().unwrap_or_default();
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err("bad chunk size");
    }
    let s = std::str::from_utf8(digits).map_err(|_| "bad chunk size")?;
    u64::from_str_radix(s, 16).map_err(|_| "bad chunk size")
}

impl Chunked {
    /// Decodes as far as `buf` allows, consuming what it uses.
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, &'static str> {
        loop {
            match self.state {
                State::Done => return Ok(Step::Done),
                State::Size => {
                    let Some(l) = line(buf)? else {
                        return Ok(Step::More);
                    };
                    self.state = match chunk_size(&l)? {
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
                    Some(b'\n') => {
                        buf.advance(1);
                        self.state = State::Size;
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn rejects_garbage() {
        assert!(decode(b"zz\r\n", 4).is_err());
        assert!(decode(b"3\r\nabcX\r\n0\r\n\r\n", 64).is_err());
        assert!(decode(b"\r\n", 4).is_err());
        assert!(decode(&[b'1'; MAX_LINE + 10], 64).is_err());
        assert_eq!(decode(b"5\r\nab", 64), Err("truncated"));
    }
}
