//! Layer: generation. A generation's TLS material for client listeners: the
//! certificate/key pairs of each TLS listener loaded from PEM files and
//! checked (parsable, key matches certificate — else a `ConfigError` naming
//! the file), an SNI resolver (exact names, `*.` wildcards, a default), ALPN
//! and protocol versions, as one rustls `ServerConfig` per listener. The
//! session cache and ticket keys are process-wide, so sessions resume across
//! reloads. Also the self-signed demo pair made at first start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ProducesTickets, ResolvesServerCert, StoresServerSessions};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

use crate::config::{resolve, ConfigError, ListenerConfig};

/// The certificate for a ClientHello: its SNI name exactly, then a
/// `*.parent` wildcard, then the default.
#[derive(Debug)]
pub struct SniResolver {
    exact: HashMap<String, Arc<CertifiedKey>>,
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
}

impl SniResolver {
    fn pick(&self, sni: Option<&str>) -> Arc<CertifiedKey> {
        if let Some(name) = sni {
            let name = name.to_ascii_lowercase();
            if let Some(k) = self.exact.get(&name) {
                return k.clone();
            }
            if let Some((_, parent)) = name.split_once('.') {
                if let Some(k) = self.wildcard.get(parent) {
                    return k.clone();
                }
            }
        }
        self.default.clone()
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.pick(hello.server_name()))
    }
}

fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// Server-side session cache shared by every listener and generation.
fn session_cache() -> Arc<dyn StoresServerSessions> {
    static C: OnceLock<Arc<dyn StoresServerSessions>> = OnceLock::new();
    C.get_or_init(|| rustls::server::ServerSessionMemoryCache::new(16 * 1024))
        .clone()
}

/// Ticket keys (rotated by rustls every 6 hours) shared likewise.
fn ticketer() -> Option<Arc<dyn ProducesTickets>> {
    static T: OnceLock<Option<Arc<dyn ProducesTickets>>> = OnceLock::new();
    T.get_or_init(|| rustls::crypto::ring::Ticketer::new().ok())
        .clone()
}

/// Loads one PEM certificate chain and its private key, checking that they
/// belong together.
pub fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, ConfigError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| ConfigError::new(cert, None, format!("cannot read certificate: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::new(cert, None, format!("bad PEM certificate: {e}")))?;
    if chain.is_empty() {
        return Err(ConfigError::new(cert, None, "no certificate in file"));
    }
    let der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| ConfigError::new(key, None, format!("no usable private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| ConfigError::new(key, None, format!("unsupported private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match().map_err(|e| {
        ConfigError::new(
            key,
            None,
            format!(
                "private key does not match certificate {}: {e}",
                cert.display()
            ),
        )
    })?;
    Ok(Arc::new(ck))
}

/// A listener's rustls configuration and the files it was read from.
pub type Loaded = (Arc<ServerConfig>, Vec<PathBuf>);

/// The rustls server configuration of one TLS listener, and the files it
/// was read from.
pub fn server_config(
    listener: &ListenerConfig,
    root: &Path,
    config_path: &Path,
    line: Option<usize>,
) -> Result<Option<Loaded>, ConfigError> {
    let Some(tls) = &listener.tls else {
        return Ok(None);
    };
    let err = |m: String| ConfigError::new(config_path, line, m);
    if tls.certificates.is_empty() {
        return Err(err(format!(
            "listener {}: tls needs at least one certificate",
            listener.listen
        )));
    }
    let mut files = Vec::new();
    let mut exact = HashMap::new();
    let mut wildcard = HashMap::new();
    let mut default = None;
    let mut first = None;
    for c in &tls.certificates {
        let (cert, key) = (resolve(root, &c.cert), resolve(root, &c.key));
        let ck = load_pair(&cert, &key)?;
        files.push(cert);
        files.push(key);
        for n in &c.server_names {
            let n = n.to_ascii_lowercase();
            match n.strip_prefix("*.") {
                Some(parent) => wildcard.insert(parent.to_string(), ck.clone()),
                None => exact.insert(n, ck.clone()),
            };
        }
        if c.default {
            if default.is_some() {
                return Err(err(format!(
                    "listener {}: more than one default certificate",
                    listener.listen
                )));
            }
            default = Some(ck.clone());
        }
        first.get_or_insert(ck);
    }
    let versions: &[&'static rustls::SupportedProtocolVersion] = match tls.min_version.as_str() {
        "1.2" => &[&rustls::version::TLS13, &rustls::version::TLS12],
        "1.3" => &[&rustls::version::TLS13],
        v => {
            return Err(err(format!(
                "listener {}: min_version {v:?} (use \"1.2\" or \"1.3\")",
                listener.listen
            )))
        }
    };
    let resolver = SniResolver {
        exact,
        wildcard,
        default: default.or(first).expect("at least one certificate"),
    };
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .map_err(|e| err(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    cfg.alpn_protocols = if listener.http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    cfg.session_storage = session_cache();
    if tls.session_tickets {
        if let Some(t) = ticketer() {
            cfg.ticketer = t;
            cfg.send_tls13_tickets = 2;
        }
    }
    Ok(Some((Arc::new(cfg), files)))
}

/// Writes a self-signed certificate for `localhost`, 127.0.0.1 and ::1 and
/// its key (mode 0600) when neither file exists (the demo listener).
pub fn ensure_self_signed(cert: &Path, key: &Path) -> Result<bool, String> {
    if cert.exists() || key.exists() {
        return Ok(false);
    }
    let names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let ck = rcgen::generate_simple_self_signed(names).map_err(|e| e.to_string())?;
    for p in [cert, key] {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
    }
    std::fs::write(cert, ck.cert.pem()).map_err(|e| format!("{}: {e}", cert.display()))?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    use std::io::Write;
    opts.open(key)
        .and_then(|mut f| f.write_all(ck.signing_key.serialize_pem().as_bytes()))
        .map_err(|e| format!("{}: {e}", key.display()))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sni_picks_exact_then_wildcard_then_default() {
        let dir = tempfile::tempdir().unwrap();
        let mk = |n: &str| {
            let (c, k) = (
                dir.path().join(format!("{n}.crt")),
                dir.path().join(format!("{n}.key")),
            );
            ensure_self_signed(&c, &k).unwrap();
            load_pair(&c, &k).unwrap()
        };
        let (a, b, d) = (mk("a"), mk("b"), mk("d"));
        let r = SniResolver {
            exact: [("a.example".to_string(), a.clone())].into(),
            wildcard: [("b.example".to_string(), b.clone())].into(),
            default: d.clone(),
        };
        assert!(Arc::ptr_eq(&r.pick(Some("A.example")), &a));
        assert!(Arc::ptr_eq(&r.pick(Some("x.b.example")), &b));
        assert!(
            Arc::ptr_eq(&r.pick(Some("b.example")), &d),
            "a wildcard is one label"
        );
        assert!(Arc::ptr_eq(&r.pick(None), &d));
    }

    #[test]
    fn mismatched_key_names_the_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        ensure_self_signed(&p("a.crt"), &p("a.key")).unwrap();
        ensure_self_signed(&p("b.crt"), &p("b.key")).unwrap();
        let e = load_pair(&p("a.crt"), &p("b.key")).unwrap_err();
        assert_eq!(e.file, p("b.key"));
        assert!(e.message.contains("does not match"), "{e}");
        std::fs::write(p("c.crt"), "garbage").unwrap();
        let e = load_pair(&p("c.crt"), &p("a.key")).unwrap_err();
        assert_eq!(e.file, p("c.crt"), "{e}");
    }
}
