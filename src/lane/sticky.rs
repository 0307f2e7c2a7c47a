//! Layer: lane. The sticky-lane cookie:
//! `<lane>[~<release rule>=<draw>]….<expiry>.<hex HMAC-SHA256>` signed with a
//! key from the config or an environment variable. A valid, unexpired cookie
//! keeps a browser in its lane across pages, assets and API calls; anything
//! forged, tampered or stale is ignored and the lane is re-decided. The
//! draws are the user's buckets (0–99) in the releases' shares when the
//! cookie was set, so a request without the release's key can still be
//! placed by a rising share. Only the cookie's reading and writing live
//! here; when a cookie keeps its lane is lane precedence's call
//! (`lane::precedence`).

use hmac::{Hmac, Mac};
use http::HeaderValue;
use sha2::Sha256;

use super::cookie_value;
use crate::config::{valid_lane, StickyConfig};

type HmacSha256 = Hmac<Sha256>;

/// Shortest accepted key.
pub const MIN_KEY_BYTES: usize = 16;

/// Most draws one cookie carries (the first releases' are kept).
pub const MAX_DRAWS: usize = 16;

/// What a valid cookie holds: the lane it pins and the draws recorded with
/// it (the user's bucket in a release's share, by the release rule's name).
#[derive(Debug, Clone, Copy)]
pub struct Pin<'a> {
    pub lane: &'a str,
    /// `~name=draw` pairs, checked when the cookie was verified.
    draws: &'a str,
}

impl<'a> Pin<'a> {
    /// The draw recorded for the release rule `name`.
    pub fn draw(&self, name: &str) -> Option<u32> {
        self.draws().find(|(n, _)| *n == name).map(|(_, d)| d)
    }

    /// Every recorded draw.
    pub fn draws(&self) -> impl Iterator<Item = (&'a str, u32)> {
        self.draws
            .split('~')
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(n, d)| Some((n, d.parse().ok()?)))
    }
}

/// A release rule's name as a cookie carries it (letters, digits, `-_.:`).
fn valid_draw_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 128
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// Whether `d` is a draw list as [`Sticky::sign`] writes it.
fn valid_draws(d: &str) -> bool {
    d.is_empty()
        || d.strip_prefix('~').is_some_and(|d| {
            d.split('~').count() <= MAX_DRAWS
                && d.split('~').all(|kv| {
                    kv.split_once('=').is_some_and(|(n, v)| {
                        valid_draw_name(n)
                            && !v.is_empty()
                            && v.len() <= 2
                            && v.bytes().all(|b| b.is_ascii_digit())
                    })
                })
        })
}

/// A ready-to-use cookie signer/verifier.
#[derive(Clone)]
pub struct Sticky {
    pub cookie: String,
    mac: HmacSha256,
    pub max_age_secs: u64,
    pub secure: bool,
}

impl std::fmt::Debug for Sticky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sticky")
            .field("cookie", &self.cookie)
            .field("max_age_secs", &self.max_age_secs)
            .finish_non_exhaustive()
    }
}

impl Sticky {
    /// Builds from config; the key comes from `key`, else the environment
    /// variable `key_env`. Errors are plain messages (the caller locates them).
    pub fn from_config(cfg: &StickyConfig) -> Result<Sticky, String> {
        Sticky::from_config_with(cfg, |name| std::env::var(name).ok())
    }

    /// [`Sticky::from_config`] with the environment lookup passed in.
    pub fn from_config_with(
        cfg: &StickyConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Sticky, String> {
        let key = match &cfg.key {
            Some(k) => k.clone(),
            None => env(&cfg.key_env).ok_or_else(|| {
                format!(
                    "sticky: no `key` and environment variable {} is not set",
                    cfg.key_env
                )
            })?,
        };
        if key.len() < MIN_KEY_BYTES {
            return Err(format!(
                "sticky: key must be at least {MIN_KEY_BYTES} bytes"
            ));
        }
        if cfg.cookie.is_empty()
            || !cfg
                .cookie
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!("sticky: invalid cookie name {:?}", cfg.cookie));
        }
        Ok(Sticky::new(
            &cfg.cookie,
            key.as_bytes(),
            cfg.max_age_secs,
            cfg.secure,
        ))
    }

    pub fn new(cookie: &str, key: &[u8], max_age_secs: u64, secure: bool) -> Sticky {
        Sticky {
            cookie: cookie.to_string(),
            mac: HmacSha256::new_from_slice(key).expect("HMAC takes any key length"),
            max_age_secs,
            secure,
        }
    }

    /// The MAC of a cookie's head (lane and draws) and expiry; a cookie
    /// without draws signs exactly what cookies before draws signed.
    fn mac_for(&self, head: &str, expiry: u64) -> HmacSha256 {
        let mut m = self.mac.clone();
        m.update(self.cookie.as_bytes());
        m.update(b"\0");
        m.update(head.as_bytes());
        m.update(b"\0");
        m.update(expiry.to_string().as_bytes());
        m
    }

    /// The cookie value for `lane` with `draws` (release rule name, bucket;
    /// at most [`MAX_DRAWS`], invalid ones left out), valid until
    /// `now + max_age`.
    pub fn sign(&self, lane: &str, draws: &[(&str, u32)], now: u64) -> String {
        let expiry = now.saturating_add(self.max_age_secs);
        let mut head = lane.to_string();
        for (n, d) in draws
            .iter()
            .filter(|(n, d)| valid_draw_name(n) && *d < 100)
            .take(MAX_DRAWS)
        {
            head.push('~');
            head.push_str(n);
            head.push('=');
            head.push_str(&d.to_string());
        }
        let tag = self.mac_for(&head, expiry).finalize().into_bytes();
        format!("{head}.{expiry}.{}", hex::encode(tag))
    }

    /// What a cookie value pins when its signature verifies (in constant
    /// time) and it has not expired at `now`.
    pub fn verify<'a>(&self, value: &'a str, now: u64) -> Option<Pin<'a>> {
        let mut it = value.rsplitn(3, '.');
        let sig = hex::decode(it.next()?).ok()?;
        let expiry_s = it.next()?;
        let head = it.next()?;
        let (lane, draws) = head.find('~').map_or((head, ""), |i| head.split_at(i));
        if !valid_lane(lane)
            || !valid_draws(draws)
            || expiry_s.is_empty()
            || !expiry_s.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let expiry: u64 = expiry_s.parse().ok()?;
        self.mac_for(head, expiry).verify_slice(&sig).ok()?;
        (now < expiry).then_some(Pin {
            lane,
            draws: draws.strip_prefix('~').unwrap_or(""),
        })
    }

    /// What this signer's cookie in `headers` pins, when one verifies and
    /// has not expired at `now`. Whether its lane is kept is lane
    /// precedence's call (`lane::precedence`).
    pub fn pin_in<'h>(&self, headers: &'h http::HeaderMap, now: u64) -> Option<Pin<'h>> {
        cookie_value(headers, &self.cookie).and_then(|v| self.verify(v, now))
    }

    /// The `Set-Cookie` header value carrying `lane` and `draws`.
    pub fn set_cookie(&self, lane: &str, draws: &[(&str, u32)], now: u64) -> HeaderValue {
        let secure = if self.secure { "; Secure" } else { "" };
        let v = format!(
            "{}={}; Max-Age={}; Path=/; HttpOnly; SameSite=Lax{secure}",
            self.cookie,
            self.sign(lane, draws, now),
            self.max_age_secs
        );
        HeaderValue::from_str(&v).expect("cookie parts are header-safe")
    }
}

pub use crate::base::clock::unix_now;

#[cfg(test)]
mod tests {
    use super::*;

    fn s() -> Sticky {
        Sticky::new("gl", b"0123456789abcdef-key", 100, false)
    }

    fn lane<'a>(st: &Sticky, v: &'a str, now: u64) -> Option<&'a str> {
        st.verify(v, now).map(|p| p.lane)
    }

    #[test]
    fn round_trip_and_expiry() {
        let st = s();
        let v = st.sign("gray-a.1", &[], 1000);
        assert_eq!(lane(&st, &v, 1000), Some("gray-a.1"));
        assert_eq!(lane(&st, &v, 1099), Some("gray-a.1"));
        assert!(st.verify(&v, 1100).is_none(), "stale");
    }

    #[test]
    fn forged_and_tampered_are_rejected() {
        let st = s();
        let v = st.sign("gray", &[], 1000);
        // Another lane with the same signature.
        let forged = v.replacen("gray", "v2", 1);
        assert!(st.verify(&forged, 1000).is_none());
        // A longer life.
        let (head, sig) = v.rsplit_once('.').unwrap();
        let (lane, _) = head.rsplit_once('.').unwrap();
        assert!(st.verify(&format!("{lane}.99999999.{sig}"), 1000).is_none());
        // Flipped signature byte, truncated, garbage, another key.
        let mut bad = v.clone().into_bytes();
        let last = bad.len() - 1;
        bad[last] = if bad[last] == b'0' { b'1' } else { b'0' };
        assert!(st
            .verify(std::str::from_utf8(&bad).unwrap(), 1000)
            .is_none());
        assert!(st.verify(&v[..v.len() - 2], 1000).is_none());
        for junk in [
            "",
            "gray",
            "gray.1.",
            ".1.00",
            "gray\r\n.1.ab",
            "gray.-1.00",
        ] {
            assert!(st.verify(junk, 0).is_none(), "{junk:?}");
        }
        let other = Sticky::new("gl", b"another-key-0123456", 100, false);
        assert!(other.verify(&v, 1000).is_none());
    }

    #[test]
    fn key_from_config_or_environment() {
        let mut cfg = StickyConfig {
            cookie: "gl".into(),
            key: None,
            key_env: "GRAYGATE_STICKY_UNIT_TEST_KEY".into(),
            max_age_secs: 10,
            secure: true,
        };
        let err = Sticky::from_config_with(&cfg, |_| None).unwrap_err();
        assert!(err.contains("GRAYGATE_STICKY_UNIT_TEST_KEY"), "{err}");
        let env = |name: &str| {
            (name == "GRAYGATE_STICKY_UNIT_TEST_KEY").then(|| "env-key-0123456789".to_string())
        };
        let from_env = Sticky::from_config_with(&cfg, env).unwrap();
        let direct = Sticky::new("gl", b"env-key-0123456789", 10, true);
        assert_eq!(
            lane(&direct, &from_env.sign("gray", &[], 1), 2),
            Some("gray")
        );
        assert!(from_env
            .set_cookie("gray", &[], 1)
            .to_str()
            .unwrap()
            .ends_with("; Secure"));
        cfg.key = Some("short".into());
        assert!(Sticky::from_config(&cfg)
            .unwrap_err()
            .contains("at least 16"));
        cfg.key = Some("long-enough-key-0123".into());
        cfg.cookie = "bad name;".into();
        assert!(Sticky::from_config(&cfg).is_err());
    }

    #[test]
    fn set_cookie_attributes() {
        let h = s().set_cookie("gray", &[], 5);
        let t = h.to_str().unwrap();
        assert!(t.starts_with("gl=gray.105."), "{t}");
        assert!(t.contains("HttpOnly") && t.contains("Max-Age=100") && t.contains("Path=/"));
    }

    #[test]
    fn draws_are_signed_with_the_lane() {
        let st = s();
        let v = st.sign("gray", &[("release:a", 7), ("release:v2.1", 99)], 1000);
        assert!(
            v.starts_with("gray~release:a=7~release:v2.1=99.1100."),
            "{v}"
        );
        let p = st.verify(&v, 1000).unwrap();
        assert_eq!(p.lane, "gray");
        assert_eq!(p.draw("release:a"), Some(7));
        assert_eq!(p.draw("release:v2.1"), Some(99));
        assert_eq!(p.draw("release:b"), None);
        assert_eq!(p.draws().count(), 2);
        // A changed draw (or one added, or removed) breaks the signature.
        assert!(st.verify(&v.replacen("=7~", "=1~", 1), 1000).is_none());
        assert!(st
            .verify(&v.replacen("~release:a=7", "", 1), 1000)
            .is_none());
        // A cookie written before draws existed still verifies, without any.
        let old = st.sign("gray", &[], 1000);
        assert!(!old.contains('~'));
        assert_eq!(st.verify(&old, 1000).unwrap().draws().count(), 0);
        // Invalid draws are never written; too many are cut.
        let v = st.sign("gray", &[("bad name", 1), ("r", 100)], 1000);
        assert!(v.starts_with("gray.1100."), "{v}");
        let many: Vec<String> = (0..40).map(|i| format!("r{i}")).collect();
        let many: Vec<(&str, u32)> = many.iter().map(|n| (n.as_str(), 1)).collect();
        let v = st.sign("gray", &many, 1000);
        assert_eq!(st.verify(&v, 1000).unwrap().draws().count(), MAX_DRAWS);
    }
}
