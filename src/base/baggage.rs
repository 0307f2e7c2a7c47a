//! Layer: base. W3C Baggage (`baggage: key=value;prop, key2=value2`): the
//! lane member read from a trusted peer, and the header forwarded upstream
//! with the gateway's lane member first and the client's other members
//! kept. Members that do not follow the grammar are dropped; the limits of
//! the specification (64 members, 8,192 bytes) are kept by dropping
//! members from the end. Any problem makes the header unusable for the lane
//! decision (it never breaks the request) and is reported for counting.

use http::{HeaderName, HeaderValue};

use crate::config::otel::valid_baggage_key as is_token;

pub const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

/// The most members a baggage header carries (W3C Baggage, "Limits").
pub const MAX_MEMBERS: usize = 64;
/// The most bytes of a baggage header.
pub const MAX_BYTES: usize = 8192;

/// What was wrong with a baggage header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// A member that does not follow the grammar.
    Malformed,
    /// A bad percent-encoding in a value.
    Encoding,
    /// More than [`MAX_MEMBERS`] members.
    TooMany,
    /// More than [`MAX_BYTES`] bytes.
    TooLong,
}

impl Problem {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Problem::Malformed => "malformed",
            Problem::Encoding => "encoding",
            Problem::TooMany => "too_many_members",
            Problem::TooLong => "too_long",
        }
    }
}

/// The lane member of a baggage header, as a trusted peer sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneMember {
    /// No lane member, or a header with a problem (ignored).
    Absent,
    /// The member's value, percent-decoded.
    Value(String),
}

/// A parsed baggage header: its well-formed members but the lane key's,
/// the lane member's value, and the first problem seen.
#[derive(Debug, Default)]
pub struct Baggage<'h> {
    /// Well-formed members other than the lane member, trimmed, in order.
    pub others: Vec<&'h str>,
    /// The lane member's raw (encoded) value, the first if repeated.
    pub lane: Option<&'h str>,
    pub problem: Option<Problem>,
}

fn ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c == ' ' || c == '\t')
}

/// `baggage-octet`: US-ASCII but controls, space, `"`, `,`, `;`, `\`.
fn is_value(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x21..=0x7e).contains(&b) && !matches!(b, b'"' | b',' | b';' | b'\\'))
}

/// A value's percent-encoding is well formed.
fn encoding_ok(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            if i + 2 >= b.len() || !(b[i + 1].is_ascii_hexdigit() && b[i + 2].is_ascii_hexdigit()) {
                return false;
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    true
}

/// `key OWS "=" OWS value`: the key and the value, or `None`.
fn key_value(s: &str) -> Option<(&str, &str)> {
    let (k, v) = s.split_once('=')?;
    let (k, v) = (trim(k), trim(v));
    (is_token(k) && is_value(v)).then_some((k, v))
}

/// One list member: its key and value, or the problem.
fn member(m: &str) -> Result<(&str, &str), Problem> {
    let mut parts = m.split(';');
    let (k, v) = key_value(parts.next().unwrap_or("")).ok_or(Problem::Malformed)?;
    for p in parts {
        let p = trim(p);
        if !(is_token(p) || key_value(p).is_some()) {
            return Err(Problem::Malformed);
        }
    }
    if !encoding_ok(v) {
        return Err(Problem::Encoding);
    }
    Ok((k, v))
}

/// Parses the request's baggage fields (several are one list), looking for
/// the member `key`.
pub fn parse<'h>(fields: impl Iterator<Item = &'h HeaderValue>, key: &str) -> Baggage<'h> {
    let mut b = Baggage::default();
    let mut bytes = 0usize;
    let mut members = 0usize;
    for field in fields {
        bytes += field.len();
        let Ok(text) = field.to_str() else {
            b.problem.get_or_insert(Problem::Malformed);
            continue;
        };
        for m in text.split(',') {
            let m = trim(m);
            if m.is_empty() {
                // `a=1,,b=2` or a trailing comma: not a member.
                if !text.bytes().all(ows) {
                    b.problem.get_or_insert(Problem::Malformed);
                }
                continue;
            }
            members += 1;
            match member(m) {
                Ok((k, v)) if k == key => {
                    b.lane.get_or_insert(v);
                }
                Ok(_) => b.others.push(m),
                Err(p) => {
                    b.problem.get_or_insert(p);
                }
            }
        }
    }
    if members > MAX_MEMBERS {
        b.problem.get_or_insert(Problem::TooMany);
    }
    if bytes > MAX_BYTES {
        b.problem.get_or_insert(Problem::TooLong);
    }
    b
}

/// Decodes `%XX` escapes (the encoding was checked by [`parse`]).
fn decode(v: &str) -> Option<String> {
    percent_encoding::percent_decode_str(v)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

impl Baggage<'_> {
    /// The lane member a trusted peer sent: ignored when the header has a
    /// problem.
    pub fn lane_member(&self) -> LaneMember {
        match (self.problem, self.lane) {
            (None, Some(v)) => decode(v).map_or(LaneMember::Absent, LaneMember::Value),
            _ => LaneMember::Absent,
        }
    }

    /// The header to forward: `key=lane` first, then the other members
    /// while the limits allow. Also says whether members were dropped for
    /// the limits.
    pub fn outbound(&self, key: &str, lane: &str) -> (HeaderValue, bool) {
        let mut out = String::with_capacity(
            key.len() + lane.len() + 1 + self.others.iter().map(|m| m.len() + 1).sum::<usize>(),
        );
        out.push_str(key);
        out.push('=');
        out.push_str(lane);
        let mut count = 1;
        let mut dropped = false;
        for m in &self.others {
            if count >= MAX_MEMBERS || out.len() + 1 + m.len() > MAX_BYTES {
                dropped = true;
                continue;
            }
            out.push(',');
            out.push_str(m);
            count += 1;
        }
        let v = HeaderValue::from_str(&out).expect("members are visible ASCII");
        (v, dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    fn parsed(fields: &[&str]) -> (Vec<String>, Option<String>, Option<Problem>, LaneMember) {
        let v: Vec<HeaderValue> = fields.iter().map(|f| hv(f)).collect();
        let b = parse(v.iter(), "graygate.lane");
        (
            b.others.iter().map(|s| s.to_string()).collect(),
            b.lane.map(str::to_string),
            b.problem,
            b.lane_member(),
        )
    }

    #[test]
    fn members_are_read_from_every_field_and_the_lane_member_is_found() {
        let (others, lane, problem, member) = parsed(&[
            "userId=alice, graygate.lane = gray-a ;p",
            "serverNode=DF%2028,isProduction=false",
        ]);
        assert_eq!(
            others,
            ["userId=alice", "serverNode=DF%2028", "isProduction=false"]
        );
        assert_eq!(lane.as_deref(), Some("gray-a"));
        assert_eq!(problem, None);
        assert_eq!(member, LaneMember::Value("gray-a".into()));
        // Percent-encoded lane values are decoded.
        assert_eq!(
            parsed(&["graygate.lane=v%32"]).3,
            LaneMember::Value("v2".into())
        );
    }

    #[test]
    fn a_header_with_any_problem_is_never_believed() {
        for (fields, p) in [
            (vec!["graygate.lane=gray,=x"], Problem::Malformed),
            (vec!["graygate.lane=gray,a b=1"], Problem::Malformed),
            (vec!["graygate.lane=gray,a=\"q\""], Problem::Malformed),
            (vec!["graygate.lane=gray,a=1;=p"], Problem::Malformed),
            (vec!["graygate.lane=gray,,a=1"], Problem::Malformed),
            (vec!["graygate.lane=gray,a=%zz"], Problem::Encoding),
            (vec!["graygate.lane=gr%4"], Problem::Encoding),
            (vec!["graygate.lane=gray%"], Problem::Encoding),
        ] {
            let (_, _, problem, member) = parsed(&fields);
            assert_eq!(problem, Some(p), "{fields:?}");
            assert_eq!(member, LaneMember::Absent, "{fields:?}");
        }
        let many: Vec<String> = (0..70).map(|i| format!("k{i}=v")).collect();
        let mut fields = vec!["graygate.lane=gray".to_string()];
        fields.extend(many);
        let refs: Vec<&str> = fields.iter().map(String::as_str).collect();
        let (_, _, problem, member) = parsed(&refs);
        assert_eq!(
            (problem, member),
            (Some(Problem::TooMany), LaneMember::Absent)
        );
        let long = format!("graygate.lane=gray,big={}", "x".repeat(MAX_BYTES));
        assert_eq!(parsed(&[&long]).2, Some(Problem::TooLong));
        // Bytes that are not text: a problem, nothing panics.
        let raw = HeaderValue::from_bytes(b"graygate.lane=gray,k=\xff").unwrap();
        assert_eq!(
            parse([&raw].into_iter(), "graygate.lane").problem,
            Some(Problem::Malformed)
        );
    }

    #[test]
    fn the_forwarded_header_puts_the_lane_first_and_keeps_the_limits() {
        let v = [hv("a=1;p, graygate.lane=forged, b=2")];
        let b = parse(v.iter(), "graygate.lane");
        let (out, dropped) = b.outbound("graygate.lane", "formal");
        assert_eq!(out, "graygate.lane=formal,a=1;p,b=2");
        assert!(!dropped);
        // Malformed members are not forwarded; good ones are.
        let v = [hv("a=1, bad, c=%zz, d=4")];
        let b = parse(v.iter(), "graygate.lane");
        assert_eq!(
            b.outbound("graygate.lane", "gray").0,
            "graygate.lane=gray,a=1,d=4"
        );
        // 64 members at most, ours included.
        let many: Vec<HeaderValue> = (0..80).map(|i| hv(&format!("k{i}=v"))).collect();
        let b = parse(many.iter(), "graygate.lane");
        let (out, dropped) = b.outbound("graygate.lane", "gray");
        assert!(dropped);
        assert_eq!(out.to_str().unwrap().split(',').count(), MAX_MEMBERS);
        assert!(out
            .to_str()
            .unwrap()
            .starts_with("graygate.lane=gray,k0=v,"));
        // 8,192 bytes at most.
        let big: Vec<HeaderValue> = (0..4)
            .map(|i| hv(&format!("k{i}={}", "x".repeat(3000))))
            .collect();
        let b = parse(big.iter(), "graygate.lane");
        let (out, dropped) = b.outbound("graygate.lane", "gray");
        assert!(dropped && out.len() <= MAX_BYTES, "{}", out.len());
        // No baggage at all: the lane member alone.
        let b = parse(std::iter::empty(), "graygate.lane");
        assert_eq!(
            b.outbound("graygate.lane", "gray"),
            (hv("graygate.lane=gray"), false)
        );
    }
}
