//! Layer: codec. Where an HTTP/1.1 message body ends (RFC 9112 §6): the
//! framing decision for a response as its head announces it (§6.3), for a
//! request body the gateway sends (its length known or not) and one it
//! receives, and the strict Content-Length value. Both sides read these rules here instead of each
//! deciding them on its own.

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body at all.
    None,
    /// Exactly this many bytes (`Content-Length`).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (responses only).
    UntilClose,
}

/// What a response head said about its body's length.
#[derive(Debug, Clone, Copy, Default)]
pub struct LengthFields {
    /// Transfer-Encoding present: is its last coding `chunked`?
    pub chunked: Option<bool>,
    /// The Content-Length value (all present ones agreeing).
    pub length: Option<u64>,
    /// A malformed or conflicting Content-Length.
    pub length_error: Option<&'static str>,
}

/// The body framing of a response with `status` to a request (RFC 9112
/// §6.3, in its order): a response to HEAD, a `1xx`, 204 or 304 has no
/// body; Transfer-Encoding wins over Content-Length, and a final coding
/// other than `chunked` cannot be delimited by a proxy (refused); a bad or
/// conflicting Content-Length is refused; no length at all reads until
/// the close.
pub fn response(
    status: u16,
    head_request: bool,
    f: &LengthFields,
) -> Result<BodyFraming, &'static str> {
    if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(BodyFraming::None);
    }
    if let Some(chunked) = f.chunked {
        return if chunked {
            Ok(BodyFraming::Chunked)
        } else {
            Err("transfer-encoding does not end in chunked")
        };
    }
    if let Some(e) = f.length_error {
        return Err(e);
    }
    Ok(match f.length {
        None => BodyFraming::UntilClose,
        Some(0) => BodyFraming::None,
        Some(n) => BodyFraming::Length(n),
    })
}

/// The framing of a request body the gateway sends (RFC 9112 §6.1, §6.2):
/// none when it is known to be empty, its length when known in advance,
/// chunked otherwise — whatever the method (a GET's body of unknown
/// length goes out chunked too, never dropped).
pub fn request(ended: bool, exact: Option<u64>) -> BodyFraming {
    match exact {
        _ if ended => BodyFraming::None,
        Some(0) => BodyFraming::None,
        Some(n) => BodyFraming::Length(n),
        None => BodyFraming::Chunked,
    }
}

/// What a client's request head says about its body (RFC 9112 §6.1–6.3),
/// as the server reads it: `Transfer-Encoding` fields seen (`te_fields`)
/// and whether the only one is exactly `chunked`; `Content-Length` as read
/// (`Err`: a malformed value or fields that disagree); the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestBody {
    /// `Content-Length` bytes (0: none).
    Length(u64),
    /// Chunked; `close`: a `Content-Length` came too, so it is dropped and
    /// the connection ends after this request (§6.3 item 3).
    Chunked { close: bool },
    /// A coding other than one `chunked` field: answered 501 and the
    /// connection closed, no body read (nginx answers these too; a proxy
    /// cannot delimit them).
    Unsupported,
}

/// The framing of a received request body; `Err`: no request (400) —
/// a bad or conflicting `Content-Length`, or chunked on HTTP/1.0.
pub fn request_received(
    te_fields: u32,
    te_chunked: bool,
    length: Result<Option<u64>, ()>,
    http11: bool,
) -> Result<RequestBody, &'static str> {
    if te_fields > 1 || (te_fields == 1 && !te_chunked) {
        return Ok(RequestBody::Unsupported);
    }
    let length = length.map_err(|()| "bad or conflicting content-length")?;
    if te_fields == 1 {
        if !http11 {
            return Err("transfer-encoding on HTTP/1.0");
        }
        return Ok(RequestBody::Chunked {
            close: length.is_some(),
        });
    }
    Ok(RequestBody::Length(length.unwrap_or(0)))
}

/// A Content-Length value: ASCII digits (white space around allowed) that
/// fit in a u64; anything else (a sign, a list, hex) is `None`.
pub fn content_length(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        if !b.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_requests_framing_follows_rfc_9112() {
        use RequestBody::*;
        assert_eq!(request_received(0, false, Ok(None), true), Ok(Length(0)));
        assert_eq!(request_received(0, false, Ok(Some(5)), true), Ok(Length(5)));
        assert_eq!(
            request_received(1, true, Ok(None), true),
            Ok(Chunked { close: false })
        );
        assert_eq!(
            request_received(1, true, Ok(Some(6)), true),
            Ok(Chunked { close: true })
        );
        assert_eq!(request_received(1, false, Ok(None), true), Ok(Unsupported));
        assert_eq!(request_received(2, true, Ok(None), true), Ok(Unsupported));
        // A refused coding is answered whatever the length says.
        assert_eq!(request_received(2, true, Err(()), true), Ok(Unsupported));
        assert!(request_received(0, false, Err(()), true).is_err());
        assert!(request_received(1, true, Ok(None), false).is_err());
    }

    fn fields(
        chunked: Option<bool>,
        length: Option<u64>,
        err: Option<&'static str>,
    ) -> LengthFields {
        LengthFields {
            chunked,
            length,
            length_error: err,
        }
    }

    #[test]
    fn content_length_is_digits_only() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b" 42 "), Some(42));
        assert_eq!(content_length(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b" ",
            b"+1",
            b"-1",
            b"1 2",
            b"1,1",
            b"0x10",
            b"18446744073709551616",
            b"\xff1",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn bodiless_responses_ignore_their_framing_fields() {
        let f = fields(Some(true), Some(5), Some("bad content-length"));
        for status in [100, 101, 204, 304] {
            assert_eq!(
                response(status, false, &f),
                Ok(BodyFraming::None),
                "{status}"
            );
        }
        assert_eq!(response(200, true, &f), Ok(BodyFraming::None), "HEAD");
    }

    #[test]
    fn transfer_encoding_wins_and_must_end_in_chunked() {
        let chunked = fields(Some(true), Some(5), None);
        assert_eq!(response(200, false, &chunked), Ok(BodyFraming::Chunked));
        // Even beside a broken length: the length is not read.
        let broken = fields(Some(true), None, Some("bad content-length"));
        assert_eq!(response(200, false, &broken), Ok(BodyFraming::Chunked));
        let gzip = fields(Some(false), Some(5), None);
        assert!(response(200, false, &gzip).is_err());
    }

    #[test]
    fn content_length_or_the_close() {
        assert_eq!(
            response(200, false, &fields(None, Some(7), None)),
            Ok(BodyFraming::Length(7))
        );
        assert_eq!(
            response(200, false, &fields(None, Some(0), None)),
            Ok(BodyFraming::None)
        );
        assert_eq!(
            response(200, false, &fields(None, None, None)),
            Ok(BodyFraming::UntilClose)
        );
        assert_eq!(
            response(
                502,
                false,
                &fields(None, Some(7), Some("conflicting content-length"))
            ),
            Err("conflicting content-length")
        );
    }

    #[test]
    fn request_bodies_go_out_by_length_or_chunked() {
        assert_eq!(request(true, None), BodyFraming::None);
        assert_eq!(request(true, Some(3)), BodyFraming::None);
        assert_eq!(request(false, Some(0)), BodyFraming::None);
        assert_eq!(request(false, Some(3)), BodyFraming::Length(3));
        assert_eq!(request(false, None), BodyFraming::Chunked);
    }
}
