//! Layer: config. gRPC status codes by name, and a service's
//! `grpc_error_codes`: the non-OK statuses of its nodes' gRPC answers that
//! count as errors (metrics, node errors, passive health, release
//! analysis). By default UNAVAILABLE, INTERNAL, UNKNOWN, DEADLINE_EXCEEDED,
//! DATA_LOSS and RESOURCE_EXHAUSTED count: the statuses that say the node
//! (or what it depends on) failed. The others (NOT_FOUND, INVALID_ARGUMENT,
//! PERMISSION_DENIED, …) are the caller's business, as a 4xx is for HTTP.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// The names of the gRPC status codes 0–16, as the gRPC specification
/// spells them (the index is the code).
pub const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The same names as metric label values (`kind` of
/// `graygate_request_errors_total`).
pub const LABELS: [&str; 17] = [
    "grpc_ok",
    "grpc_cancelled",
    "grpc_unknown",
    "grpc_invalid_argument",
    "grpc_deadline_exceeded",
    "grpc_not_found",
    "grpc_already_exists",
    "grpc_permission_denied",
    "grpc_resource_exhausted",
    "grpc_failed_precondition",
    "grpc_aborted",
    "grpc_out_of_range",
    "grpc_unimplemented",
    "grpc_internal",
    "grpc_unavailable",
    "grpc_data_loss",
    "grpc_unauthenticated",
];

pub const UNKNOWN: u8 = 2;
pub const DEADLINE_EXCEEDED: u8 = 4;
pub const RESOURCE_EXHAUSTED: u8 = 8;
pub const INTERNAL: u8 = 13;
pub const UNAVAILABLE: u8 = 14;
pub const DATA_LOSS: u8 = 15;

/// The codes a service counts as errors: bit `c` set = code `c` counts
/// (OK never does).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct GrpcErrorCodes(u32);

impl Default for GrpcErrorCodes {
    fn default() -> Self {
        GrpcErrorCodes::of(&[
            UNAVAILABLE,
            INTERNAL,
            UNKNOWN,
            DEADLINE_EXCEEDED,
            DATA_LOSS,
            RESOURCE_EXHAUSTED,
        ])
    }
}

impl GrpcErrorCodes {
    /// Exactly these codes (each 1–16).
    pub fn of(codes: &[u8]) -> GrpcErrorCodes {
        GrpcErrorCodes(
            codes
                .iter()
                .filter(|c| (1..=16).contains(*c))
                .fold(0, |m, c| m | 1 << c),
        )
    }

    /// Does `code` count as an error?
    pub fn counts(self, code: u8) -> bool {
        code != 0 && code <= 16 && self.0 & (1 << code) != 0
    }
}

impl fmt::Debug for GrpcErrorCodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                (1..=16u8)
                    .filter(|c| self.counts(*c))
                    .map(|c| NAMES[c as usize]),
            )
            .finish()
    }
}

/// A code by name (any case) or number.
fn code_of(s: &str) -> Option<u8> {
    let s = s.trim();
    if let Ok(n) = s.parse::<u8>() {
        return (n <= 16).then_some(n);
    }
    NAMES
        .iter()
        .position(|n| n.eq_ignore_ascii_case(s))
        .map(|i| i as u8)
}

impl<'de> Deserialize<'de> for GrpcErrorCodes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Codes;

        #[derive(Deserialize)]
        #[serde(untagged)]
        enum One {
            Number(u64),
            Name(String),
        }

        impl<'de> Visitor<'de> for Codes {
            type Value = GrpcErrorCodes;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of gRPC status codes (names like UNAVAILABLE, or numbers 1-16)")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut codes = Vec::new();
                while let Some(one) = seq.next_element::<One>()? {
                    let code = match &one {
                        One::Number(n) => u8::try_from(*n).ok().filter(|n| *n <= 16),
                        One::Name(s) => code_of(s),
                    };
                    let shown = match &one {
                        One::Number(n) => n.to_string(),
                        One::Name(s) => format!("{s:?}"),
                    };
                    match code {
                        Some(0) => {
                            return Err(de::Error::custom(
                                "grpc_error_codes: OK (0) is never an error",
                            ))
                        }
                        Some(c) => codes.push(c),
                        None => {
                            return Err(de::Error::custom(format!(
                            "grpc_error_codes: unknown gRPC status {shown} (names: {}; or 1-16)",
                            NAMES[1..].join(", ")
                        )))
                        }
                    }
                }
                Ok(GrpcErrorCodes::of(&codes))
            }
        }

        d.deserialize_seq(Codes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_counts_the_failures_of_the_node() {
        let d = GrpcErrorCodes::default();
        let counted: Vec<&str> = (0..=16u8)
            .filter(|c| d.counts(*c))
            .map(|c| NAMES[c as usize])
            .collect();
        assert_eq!(
            counted,
            [
                "UNKNOWN",
                "DEADLINE_EXCEEDED",
                "RESOURCE_EXHAUSTED",
                "INTERNAL",
                "UNAVAILABLE",
                "DATA_LOSS"
            ]
        );
        assert!(!d.counts(0) && !d.counts(17) && !d.counts(255));
    }

    #[test]
    fn codes_parse_by_name_or_number_and_ok_is_refused() {
        let p = |t: &str| serde_yaml::from_str::<GrpcErrorCodes>(t).map_err(|e| e.to_string());
        assert_eq!(
            p("[unavailable, 5, NOT_FOUND]").unwrap(),
            GrpcErrorCodes::of(&[14, 5])
        );
        assert_eq!(p("[]").unwrap(), GrpcErrorCodes::of(&[]));
        assert!(p("[OK]").unwrap_err().contains("OK (0) is never an error"));
        assert!(p("[0]").unwrap_err().contains("never an error"));
        assert!(p("[17]").unwrap_err().contains("unknown gRPC status 17"));
        let e = p("[UNAVAILBLE]").unwrap_err();
        assert!(e.contains("unknown gRPC status \"UNAVAILBLE\""), "{e}");
        assert!(p("UNAVAILABLE").is_err(), "a list, not one name");
    }

    #[test]
    fn a_bad_code_in_a_node_file_is_located() {
        let text = "services:\n  api:\n    protocol: h2\n    grpc_error_codes: [UNAVAILABLE, OK]\n";
        let e = super::super::parse_yaml::<super::super::NodeFile>(
            std::path::Path::new("nodes.yaml"),
            text,
        )
        .unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.message.contains("OK (0) is never an error"), "{e}");
    }
}
