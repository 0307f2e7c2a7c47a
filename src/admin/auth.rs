//! Layer: admin. Admin authentication. The token comes from
//! `GRAYGATE_ADMIN_TOKEN` or the config's `admin_token`. With a token set,
//! every admin request must carry it — `Authorization: Bearer <token>`, or HTTP
//! Basic with the token as the password (so a browser can open the dashboard) —
//! compared in constant time; otherwise 401. A non-loopback admin listener
//! without a token is refused at start-up, and denies everything should a
//! reload drop it.

use std::net::SocketAddr;

use base64::Engine;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use subtle::ConstantTimeEq;

use crate::base::body::{plain, Body};
use crate::config::MainConfig;
use crate::control::Gateway;

/// The environment variable holding the admin token.
pub const TOKEN_ENV: &str = "GRAYGATE_ADMIN_TOKEN";

fn env_token() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// The token in force: environment first, then config.
pub fn token(config: &MainConfig) -> Option<String> {
    env_token().or_else(|| config.admin_token.clone().filter(|t| !t.is_empty()))
}

/// Refuses an admin listener on a non-loopback address without a token.
pub fn check_bind(addr: SocketAddr, config: &MainConfig) -> Result<(), String> {
    if !addr.ip().is_loopback() && token(config).is_none() {
        return Err(format!(
            "admin_listen {addr} is not a loopback address: set admin_token or {TOKEN_ENV}"
        ));
    }
    Ok(())
}

/// Constant-time comparison of a presented credential with the token.
pub fn token_matches(presented: &[u8], token: &str) -> bool {
    bool::from(presented.ct_eq(token.as_bytes()))
}

/// Does `headers` carry `token` (Bearer, or Basic with it as password)?
pub fn authorized(headers: &HeaderMap, token: &str) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
    else {
        return false;
    };
    let (scheme, rest) = match v.iter().position(|&b| b == b' ') {
        Some(i) => (&v[..i], v[i + 1..].trim_ascii()),
        None => return false,
    };
    if scheme.eq_ignore_ascii_case(b"bearer") {
        return token_matches(rest, token);
    }
    if scheme.eq_ignore_ascii_case(b"basic") {
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(rest) else {
            return false;
        };
        let password = match decoded.iter().position(|&b| b == b':') {
            Some(i) => &decoded[i + 1..],
            None => &decoded[..],
        };
        return token_matches(password, token);
    }
    false
}

/// The per-listener check.
pub struct Guard {
    /// Bound to a non-loopback address: a token is mandatory.
    required: bool,
}

impl Guard {
    pub fn new(required: bool) -> Guard {
        Guard { required }
    }

    /// `None` to let the request through, else the 401 to send.
    pub fn deny(&self, gw: &Gateway, headers: &HeaderMap) -> Option<Response<Body>> {
        match token(&gw.current().config) {
            Some(t) if authorized(headers, &t) => None,
            None if !self.required => None,
            _ => {
                let mut r = plain(StatusCode::UNAUTHORIZED, "unauthorized\n");
                // Basic first: browsers then prompt for the token.
                r.headers_mut().append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"graygate admin\""),
                );
                r.headers_mut().append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"graygate admin\""),
                );
                Some(r)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::AUTHORIZATION, v.parse().unwrap());
        m
    }

    #[test]
    fn bearer_and_basic() {
        assert!(authorized(&h("Bearer s3cret"), "s3cret"));
        assert!(authorized(&h("bearer  s3cret"), "s3cret"));
        assert!(!authorized(&h("Bearer s3cre"), "s3cret"));
        assert!(!authorized(&h("Bearer s3cretX"), "s3cret"));
        assert!(!authorized(&HeaderMap::new(), "s3cret"));
        let basic = base64::engine::general_purpose::STANDARD.encode("admin:s3cret");
        assert!(authorized(&h(&format!("Basic {basic}")), "s3cret"));
        let wrong = base64::engine::general_purpose::STANDARD.encode("s3cret:nope");
        assert!(!authorized(&h(&format!("Basic {wrong}")), "s3cret"));
        assert!(!authorized(&h("Token s3cret"), "s3cret"));
    }
}
