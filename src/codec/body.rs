//! Layer: codec. A request body's framing read off the wire: a
//! `Content-Length` count or the strict chunked decoder ([`super::chunked`]),
//! fed from the connection's read buffer; data is split off the buffer
//! without copying, and once the body ends the buffer holds what followed
//! it (the next pipelined request).

use bytes::{Bytes, BytesMut};

use super::chunked::{Chunked, Step};

/// Where a body stands.
#[derive(Debug)]
pub enum BodyDecoder {
    /// This many bytes still to come.
    Length(u64),
    Chunked(Chunked),
}

/// One decoding step's outcome.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Body bytes (never empty).
    Data(Bytes),
    /// The buffer holds no complete next piece: read more.
    More,
    /// The body ended; the buffer starts after it.
    End,
}

impl BodyDecoder {
    /// A body of `len` bytes.
    pub fn length(len: u64) -> BodyDecoder {
        BodyDecoder::Length(len)
    }

    /// A chunked body.
    pub fn chunked() -> BodyDecoder {
        BodyDecoder::Chunked(Chunked::default())
    }

    /// Takes the next piece off the front of `buf`; `Err`: the bytes are no
    /// chunked body (the connection cannot go on).
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Piece, &'static str> {
        match self {
            BodyDecoder::Length(0) => Ok(Piece::End),
            BodyDecoder::Length(_) if buf.is_empty() => Ok(Piece::More),
            BodyDecoder::Length(n) => {
                let take = (*n).min(buf.len() as u64) as usize;
                *n -= take as u64;
                Ok(Piece::Data(buf.split_to(take).freeze()))
            }
            BodyDecoder::Chunked(c) => Ok(match c.step(buf)? {
                Step::Data(d) if d.is_empty() => Piece::More,
                Step::Data(d) => Piece::Data(d),
                Step::More => Piece::More,
                Step::Done => Piece::End,
            }),
        }
    }

    /// Is the body read to its end (nothing more to decode)?
    pub fn ended(&self) -> bool {
        matches!(self, BodyDecoder::Length(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `wire` fed `piece` bytes at a time: the body, what follows.
    fn decode(
        mut d: BodyDecoder,
        wire: &[u8],
        piece: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), &'static str> {
        let mut buf = BytesMut::new();
        let mut fed = 0;
        let mut body = Vec::new();
        loop {
            match d.step(&mut buf)? {
                Piece::Data(b) => body.extend_from_slice(&b),
                Piece::End => {
                    let mut rest = buf.to_vec();
                    rest.extend_from_slice(&wire[fed..]);
                    return Ok((body, rest));
                }
                Piece::More if fed == wire.len() => return Err("cut short"),
                Piece::More => {
                    let n = piece.min(wire.len() - fed);
                    buf.extend_from_slice(&wire[fed..fed + n]);
                    fed += n;
                }
            }
        }
    }

    #[test]
    fn lengths_and_chunks_end_where_the_body_ends_however_the_bytes_arrive() {
        for piece in [1, 2, 3, 7, 1000] {
            let (b, rest) = decode(BodyDecoder::length(5), b"helloGET /", piece).unwrap();
            assert_eq!(
                (&b[..], &rest[..]),
                (&b"hello"[..], &b"GET /"[..]),
                "{piece}"
            );
            let wire = b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nX-T: 1\r\n\r\nnext";
            let (b, rest) = decode(BodyDecoder::chunked(), wire, piece).unwrap();
            assert_eq!(
                (&b[..], &rest[..]),
                (&b"abcde"[..], &b"next"[..]),
                "{piece}"
            );
            assert!(decode(BodyDecoder::chunked(), b"3\nabc\r\n0\r\n\r\n", piece).is_err());
            assert!(decode(BodyDecoder::chunked(), b"5\r\nab\r\n0\r\n\r\n", piece).is_err());
            assert!(decode(BodyDecoder::length(5), b"abc", piece).is_err());
        }
        // No body: what follows is all the next request's.
        let (b, rest) = decode(BodyDecoder::length(0), b"x", 1).unwrap();
        assert!(b.is_empty() && rest == b"x");
    }
}
