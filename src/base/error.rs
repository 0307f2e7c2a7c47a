//! Layer: base. The one runtime error of the request path: what failed
//! (`ErrorKind`), whether any of the request reached a node, whether another
//! attempt may follow, and the underlying cause — with one mapping to the
//! status and short body the client gets. (Configuration errors are
//! `config::ConfigError`, located at file:line; script failures are
//! `lane::script::ScriptError` and never fail a request.)

use std::fmt;

use http::{Response, StatusCode};

use super::body::{plain, Body, BoxError};

/// What went wrong while serving one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request breaks RFC 9112 (missing, repeated or invalid `Host`).
    BadRequest,
    /// No route matches the host and path.
    NoRoute,
    /// The request target is over `client.max_uri_bytes`.
    UriTooLong,
    /// The request head is over `client.max_header_bytes`.
    HeadersTooLarge,
    /// The request's `Transfer-Encoding` is anything but one `chunked`
    /// field (`gzip, chunked`, `chunked, chunked`, two fields, …): 501, as
    /// nginx answers; the connection closes.
    TransferEncoding,
    /// The client's request body failed (bad framing, reset).
    ClientBody,
    /// The client stalled mid-body longer than `client.body_timeout_ms`
    /// (or the body outlasted `upstream.total_timeout_ms`).
    ClientBodyTimeout,
    /// The client went away before its request or response was complete.
    ClientAbort,
    /// The route names a service this generation does not have.
    NoSuchService,
    /// Neither the request's lane nor formal has nodes.
    NoNodes,
    /// Every node of the lane is down and the service is strict.
    LaneUnhealthyStrict,
    /// No node was left to try.
    NoNodeAvailable,
    /// Connecting to the node failed (refused, unreachable, timed out).
    Connect,
    /// Connected, but the exchange failed before a response head arrived.
    Exchange,
    /// No response head within `upstream.response_timeout_ms`.
    ResponseTimeout,
    /// `upstream.total_timeout_ms` ran out before another attempt.
    TotalTimeout,
    /// The node accepted an upgrade the client connection cannot complete.
    UpgradeUnavailable,
    /// The node's response body failed after its head (reset, bad framing).
    UpstreamBody,
    /// The node's response body stalled longer than the read timeout.
    UpstreamBodyTimeout,
    /// The node's gRPC answer ended with this non-OK `grpc-status`, one
    /// its service counts as an error (`grpc_error_codes`).
    Grpc(u8),
    /// A static file could not be opened for a reason other than its
    /// absence or its permissions (out of descriptors, an I/O error).
    FileUnavailable,
    /// No open-file slot of the connection came free within the wait
    /// (`http2.max_open_files_per_connection`).
    FileSlotTimeout,
}

/// Whose fault an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The client's request or connection: never charged to a node.
    Client,
    /// The node: counts against its health.
    Upstream,
    /// The gateway's own answer (no route, no nodes, deadlines).
    Gateway,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Upstream => "upstream",
            Side::Gateway => "gateway",
        }
    }
}

impl ErrorKind {
    /// Short machine-readable name (logs).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::NoRoute => "no_route",
            ErrorKind::UriTooLong => "uri_too_long",
            ErrorKind::HeadersTooLarge => "headers_too_large",
            ErrorKind::TransferEncoding => "transfer_encoding",
            ErrorKind::ClientBody => "client_body",
            ErrorKind::ClientBodyTimeout => "client_body_timeout",
            ErrorKind::ClientAbort => "client_abort",
            ErrorKind::NoSuchService => "no_such_service",
            ErrorKind::NoNodes => "no_nodes",
            ErrorKind::LaneUnhealthyStrict => "lane_unhealthy_strict",
            ErrorKind::NoNodeAvailable => "no_node_available",
            ErrorKind::Connect => "connect",
            ErrorKind::Exchange => "exchange",
            ErrorKind::ResponseTimeout => "response_timeout",
            ErrorKind::TotalTimeout => "total_timeout",
            ErrorKind::UpgradeUnavailable => "upgrade_unavailable",
            ErrorKind::UpstreamBody => "upstream_body",
            ErrorKind::UpstreamBodyTimeout => "upstream_body_timeout",
            ErrorKind::Grpc(code) => crate::config::grpc::LABELS
                .get(code as usize)
                .copied()
                .unwrap_or("grpc_unknown"),
            ErrorKind::FileUnavailable => "file_unavailable",
            ErrorKind::FileSlotTimeout => "file_slot_timeout",
        }
    }

    /// Whose fault it is.
    pub fn side(self) -> Side {
        match self {
            ErrorKind::BadRequest
            | ErrorKind::UriTooLong
            | ErrorKind::HeadersTooLarge
            | ErrorKind::TransferEncoding
            | ErrorKind::ClientBody
            | ErrorKind::ClientBodyTimeout
            | ErrorKind::ClientAbort => Side::Client,
            ErrorKind::Connect
            | ErrorKind::Exchange
            | ErrorKind::ResponseTimeout
            | ErrorKind::UpstreamBody
            | ErrorKind::UpstreamBodyTimeout
            | ErrorKind::Grpc(_) => Side::Upstream,
            _ => Side::Gateway,
        }
    }

    /// The status the client gets for this kind (what it is recorded as).
    pub fn status(self) -> StatusCode {
        self.answer().0
    }

    /// The client's status and short body for this kind.
    pub fn answer(self) -> (StatusCode, &'static str) {
        match self {
            ErrorKind::BadRequest => (StatusCode::BAD_REQUEST, "bad request\n"),
            ErrorKind::NoRoute => (StatusCode::NOT_FOUND, "no route\n"),
            ErrorKind::UriTooLong => (StatusCode::URI_TOO_LONG, "request target too long\n"),
            ErrorKind::HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request headers too large\n",
            ),
            ErrorKind::TransferEncoding => (
                StatusCode::NOT_IMPLEMENTED,
                "unsupported transfer-encoding\n",
            ),
            ErrorKind::ClientBody => (StatusCode::BAD_REQUEST, "request body error\n"),
            ErrorKind::ClientBodyTimeout => {
                (StatusCode::REQUEST_TIMEOUT, "request body timed out\n")
            }
            // nginx's 499: nobody reads it, but logs and metrics show it.
            ErrorKind::ClientAbort => (CLIENT_CLOSED, "client closed request\n"),
            ErrorKind::NoSuchService => (StatusCode::SERVICE_UNAVAILABLE, "no such service\n"),
            ErrorKind::NoNodes => (
                StatusCode::SERVICE_UNAVAILABLE,
                "no upstream node for this lane\n",
            ),
            ErrorKind::LaneUnhealthyStrict => (
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy upstream node for this lane\n",
            ),
            ErrorKind::NoNodeAvailable => (StatusCode::BAD_GATEWAY, "no upstream node available\n"),
            ErrorKind::Connect => (StatusCode::BAD_GATEWAY, "upstream connect error\n"),
            ErrorKind::Exchange => (StatusCode::BAD_GATEWAY, "upstream error\n"),
            ErrorKind::ResponseTimeout | ErrorKind::TotalTimeout => {
                (StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n")
            }
            ErrorKind::UpgradeUnavailable => (StatusCode::BAD_GATEWAY, "upgrade unavailable\n"),
            ErrorKind::UpstreamBody => (StatusCode::BAD_GATEWAY, "upstream error\n"),
            ErrorKind::UpstreamBodyTimeout => (StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n"),
            // Known only at the answer's end, after its head was sent: the
            // status it is recorded as (`base::grpc::recorded_status`).
            ErrorKind::Grpc(code) => (
                StatusCode::from_u16(super::grpc::recorded_status(code))
                    .unwrap_or(StatusCode::BAD_GATEWAY),
                "upstream error\n",
            ),
            ErrorKind::FileUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "file temporarily unavailable\n",
            ),
            ErrorKind::FileSlotTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "too many files open on this connection\n",
            ),
        }
    }
}

/// nginx's "client closed request" status (logged, never sent).
pub const CLIENT_CLOSED: StatusCode = match StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// A request-path failure.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    /// Some of the request may have reached the node.
    written: bool,
    source: Option<BoxError>,
}

impl Error {
    /// An error of `kind`; a failed exchange or timeout counts as written
    /// (the node may have seen the request), anything else as not.
    pub fn new(kind: ErrorKind) -> Error {
        Error {
            kind,
            written: matches!(kind, ErrorKind::Exchange | ErrorKind::ResponseTimeout),
            source: None,
        }
    }

    /// The same error with its underlying cause.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Error {
        self.source = Some(source.into());
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// May part of the request have reached the node?
    pub fn written(&self) -> bool {
        self.written
    }

    /// True when no connection could be made: the request never left.
    pub fn is_connect(&self) -> bool {
        self.kind == ErrorKind::Connect
    }

    /// May the request be sent to another node of its lane? Always when it
    /// never left; after that only when the method is idempotent.
    pub fn retryable(&self, idempotent: bool) -> bool {
        match self.kind {
            ErrorKind::Connect => true,
            ErrorKind::Exchange | ErrorKind::ResponseTimeout => idempotent,
            _ => false,
        }
    }

    /// Is the node to blame (passive health, node error counters)?
    pub fn node_fault(&self) -> bool {
        self.kind.side() == Side::Upstream
    }

    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The client's answer: the status and a short plain-text body.
    pub fn response(&self) -> Response<Body> {
        let (status, text) = self.kind.answer();
        plain(status, text)
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Error {
        Error::new(kind)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.as_str())?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_and_blame_follow_the_kind() {
        let connect = Error::new(ErrorKind::Connect).with_source("refused");
        assert!(connect.retryable(false) && !connect.written() && connect.node_fault());
        assert_eq!(connect.to_string(), "connect: refused");
        let exchange = Error::new(ErrorKind::Exchange);
        assert!(exchange.written() && exchange.retryable(true) && !exchange.retryable(false));
        let body = Error::new(ErrorKind::ClientBody);
        assert!(!body.node_fault() && !body.retryable(true));
        assert_eq!(body.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            Error::new(ErrorKind::TotalTimeout).status(),
            StatusCode::GATEWAY_TIMEOUT
        );
    }
}
