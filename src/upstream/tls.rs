//! Layer: upstream. How a service's nodes are reached: plain or TLS, HTTP/1.1
//! or HTTP/2 ([`Transport`]), and the rustls client side — verification
//! against the system roots or a configured CA, SNI, ALPN, and an explicit
//! insecure switch for tests. Built once per generation by the control plane;
//! the request path only connects with it.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::base::error::{Error, ErrorKind};

/// How the gateway talks to one service's nodes.
#[derive(Debug, Clone)]
pub struct Transport {
    /// HTTP/2 (h2c prior knowledge in plain, ALPN `h2` over TLS).
    pub h2: bool,
    /// TLS to the node; `None` = plain TCP.
    pub tls: Option<TlsConnect>,
}

/// A TLS client configuration and the name to present and verify.
#[derive(Clone)]
pub struct TlsConnect {
    pub config: Arc<ClientConfig>,
    /// Fixed server name (SNI + verification); `None` = the node's IP.
    pub server_name: Option<ServerName<'static>>,
    /// Identifies these settings (CA contents, name, insecure, ALPN) in the
    /// connection pools, so a connection is only reused under the settings
    /// it was verified with — across reloads too. Never 0.
    pub id: u64,
}

impl std::fmt::Debug for TlsConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConnect")
            .field("server_name", &self.server_name)
            .field("alpn", &self.config.alpn_protocols)
            .finish()
    }
}

impl TlsConnect {
    /// Builds the client side: `ca` (PEM) or the system roots, ALPN `h2` or
    /// `http/1.1`, `insecure` skips verification.
    pub fn new(
        ca: Option<&Path>,
        server_name: Option<&str>,
        insecure: bool,
        h2: bool,
    ) -> Result<TlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let mut config = if insecure {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
                .with_no_client_auth()
        } else {
            let roots = match ca {
                Some(path) => {
                    let mut roots = RootCertStore::empty();
                    let certs = CertificateDer::pem_file_iter(path)
                        .map_err(|e| format!("cannot read CA file: {e}"))?
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("bad PEM in CA file: {e}"))?;
                    if certs.is_empty() {
                        return Err("no certificate in CA file".into());
                    }
                    for c in certs {
                        roots
                            .add(c)
                            .map_err(|e| format!("bad CA certificate: {e}"))?;
                    }
                    Arc::new(roots)
                }
                None => system_roots(),
            };
            builder.with_root_certificates(roots).with_no_client_auth()
        };
        config.alpn_protocols = if h2 {
            vec![b"h2".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(server_name, insecure, h2), &mut hasher);
        if let Some(path) = ca {
            std::hash::Hash::hash(&std::fs::read(path).unwrap_or_default(), &mut hasher);
        }
        let id = std::hash::Hasher::finish(&hasher).max(1);
        let server_name = match server_name {
            Some(n) => Some(
                ServerName::try_from(n.to_string())
                    .map_err(|_| format!("invalid server_name {n:?}"))?,
            ),
            None => None,
        };
        Ok(TlsConnect {
            config: Arc::new(config),
            server_name,
            id,
        })
    }

    /// The TLS handshake on a connected stream.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        addr: SocketAddr,
    ) -> Result<TlsStream<TcpStream>, Error> {
        let name = self
            .server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(ip_name(addr.ip())));
        TlsConnector::from(self.config.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| Error::new(ErrorKind::Connect).with_source(e))
    }
}

fn ip_name(ip: IpAddr) -> rustls::pki_types::IpAddr {
    rustls::pki_types::IpAddr::from(ip)
}

/// The system's trusted roots, read once per process.
fn system_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::warn!(
                    "no system root certificates found; TLS to nodes without a `ca` will fail"
                );
            }
            Arc::new(roots)
        })
        .clone()
}

/// `insecure_skip_verify`: any certificate is accepted (signatures on the
/// handshake are still checked, so the connection is at least consistent).
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
