//! Layer: base. What the request path reads of gRPC: is a message gRPC (its
//! content type), the `grpc-status` of a header block (the response head of
//! a trailers-only answer, or the trailers), the HTTP status an erroring
//! gRPC answer is recorded as, and the trailers the gateway sends in place
//! of an answer that failed (gRPC's HTTP-to-gRPC status mapping).

use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use http::StatusCode;

use crate::config::grpc::{DEADLINE_EXCEEDED, UNAVAILABLE, UNKNOWN};

/// The `grpc-status` field's name.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Is this message gRPC (`application/grpc`, `application/grpc+proto`,
/// `application/grpc-web…`)?
pub fn is_grpc(h: &HeaderMap) -> bool {
    is_grpc_type(h.get(CONTENT_TYPE).map(HeaderValue::as_bytes))
}

/// Is a message of this content type gRPC?
pub fn is_grpc_type(content_type: Option<&[u8]>) -> bool {
    content_type.is_some_and(|v| v.starts_with(b"application/grpc"))
}

/// Is a message of this content type gRPC-Web (`application/grpc-web…`:
/// its trailers travel in the body, not as HTTP trailers)?
pub fn is_grpc_web_type(content_type: Option<&[u8]>) -> bool {
    content_type.is_some_and(|v| v.starts_with(b"application/grpc-web"))
}

/// The `grpc-status` of a header block, if it has one: a value that is not
/// a code 0–16 reads as UNKNOWN (as gRPC clients read it).
pub fn status_of(h: &HeaderMap) -> Option<u8> {
    status_value(h.get(GRPC_STATUS).map(HeaderValue::as_bytes))
}

/// A `grpc-status` value read as [`status_of`] does.
pub fn status_value(v: Option<&[u8]>) -> Option<u8> {
    Some(
        std::str::from_utf8(v?)
            .ok()
            .and_then(|s| s.trim().parse::<u8>().ok())
            .filter(|c| *c <= 16)
            .unwrap_or(UNKNOWN),
    )
}

/// The HTTP status a gRPC answer with the counted error `code` is recorded
/// as (metrics, access log, release analysis): 503 for UNAVAILABLE, 504
/// for DEADLINE_EXCEEDED, 500 for any other.
pub fn recorded_status(code: u8) -> u16 {
    match code {
        UNAVAILABLE => 503,
        DEADLINE_EXCEEDED => 504,
        _ => 500,
    }
}

/// The gRPC code a client gets for the gateway's own HTTP error `status`
/// (gRPC's HTTP-to-gRPC mapping).
pub fn code_for_http(status: StatusCode) -> u8 {
    match status.as_u16() {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502..=504 => UNAVAILABLE,
        _ => UNKNOWN,
    }
}

/// The status fields of the gateway's own error `status` in gRPC terms:
/// `grpc-status` mapped from it ([`code_for_http`]) and `grpc-message`
/// naming it — the head of a trailers-only answer, or the trailers of an
/// answer the node broke off.
pub fn status_fields(status: StatusCode) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(2);
    h.insert(
        "grpc-status",
        HeaderValue::from(u16::from(code_for_http(status))),
    );
    let reason = status.canonical_reason().unwrap_or("error");
    if let Ok(v) = HeaderValue::from_str(&format!("gateway: {} {reason}", status.as_u16())) {
        h.insert("grpc-message", v);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_values_read_as_grpc_clients_read_them() {
        let mut h = HeaderMap::new();
        assert_eq!(status_of(&h), None);
        for (v, want) in [
            ("0", 0),
            ("14", 14),
            (" 5 ", 5),
            ("17", 2),
            ("x", 2),
            ("", 2),
        ] {
            h.insert("grpc-status", HeaderValue::from_str(v).unwrap());
            assert_eq!(status_of(&h), Some(want), "{v:?}");
        }
    }

    #[test]
    fn the_gateway_s_errors_in_grpc_terms() {
        let h = status_fields(StatusCode::BAD_GATEWAY);
        assert_eq!(h["grpc-status"], "14");
        assert_eq!(h["grpc-message"], "gateway: 502 Bad Gateway");
        assert_eq!(code_for_http(StatusCode::GATEWAY_TIMEOUT), UNAVAILABLE);
        assert_eq!(code_for_http(StatusCode::NOT_FOUND), 12);
        assert_eq!(code_for_http(StatusCode::INTERNAL_SERVER_ERROR), UNKNOWN);
        assert_eq!(
            (recorded_status(14), recorded_status(4), recorded_status(13)),
            (503, 504, 500)
        );
    }
}
