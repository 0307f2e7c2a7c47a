//! TLS helpers for the edge-protocol tests: certificates made with rcgen
//! (a name of our choosing as CN and SAN), the gateway's extra listeners read
//! from its log, and curl / openssl run as real clients.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use crate::harness::Gateway;

/// Writes a self-signed certificate for `name` (CN and SAN) and its key.
pub fn write_cert(dir: &Path, stem: &str, name: &str) {
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name.to_string());
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        params.subject_alt_names = vec![rcgen::SanType::IpAddress(ip)];
    }
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    // Written as editors do (temp + rename), so a watcher never reads a
    // half-written file.
    for (ext, text) in [("crt", cert.pem()), ("key", key.serialize_pem())] {
        let p = dir.join(format!("{stem}.{ext}"));
        let tmp = dir.join(format!(".{stem}.{ext}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }
}

/// A TLS connection to `addr` as a rustls client of `localhost` that
/// trusts the certificate in `cert` (PEM) and offers `alpn`.
pub async fn connect(
    addr: SocketAddr,
    cert: &Path,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(cert).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(name, tcp)
        .await
        .expect("TLS handshake")
}

/// The extra listeners' bound addresses, in config order (from the
/// gateway's `listening addr=… proto=…` lines).
pub fn listeners(gw: &Gateway) -> Vec<SocketAddr> {
    gw.logs()
        .lines()
        .filter(|l| l.contains(" listening ") && l.contains("proto="))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|t| t.strip_prefix("addr="))
                .and_then(|a| a.parse().ok())
        })
        .collect()
}

/// What curl printed: body, then the `%{http_version}` it used.
pub struct Curl {
    pub body: String,
    pub version: String,
    pub ok: bool,
}

/// `curl -sk <args> <url>` with `-w '\n%{http_version}'`.
pub fn curl(args: &[&str], url: &str) -> Curl {
    let out = Command::new("curl")
        .args(["-sk", "--max-time", "20", "-w", "\n%{http_version}"])
        .args(args)
        .arg(url)
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, version) = text.rsplit_once('\n').unwrap_or(("", &text));
    Curl {
        body: body.to_string(),
        version: version.trim().to_string(),
        ok: out.status.success(),
    }
}

/// `openssl s_client` against `addr`: its whole output (stdout + stderr).
/// `input` is written to the connection (then s_client waits for the
/// server to close).
pub fn s_client(addr: SocketAddr, args: &[&str], input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .arg("s_client")
        .arg("-connect")
        .arg(addr.to_string())
        .args(args)
        .args(if input.is_empty() {
            &[][..]
        } else {
            &["-ign_eof"][..]
        })
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run openssl s_client");
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.write_all(input.as_bytes());
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The subject CN of the certificate `addr` presents for `sni` (none:
/// no SNI sent).
pub fn served_cn(addr: SocketAddr, sni: Option<&str>) -> String {
    let mut args = vec![];
    match sni {
        Some(n) => args.extend(["-servername", n]),
        None => args.push("-noservername"),
    }
    let out = s_client(addr, &args, "");
    out.lines()
        .find_map(|l| {
            l.strip_prefix("subject=CN = ")
                .or(l.strip_prefix("subject=CN="))
        })
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| format!("<no certificate: {out}>"))
}

/// A rustls server configuration for the certificate and key files
/// `cert`, `key` (PEM), offering `alpn` (e.g. `h2`; none: empty).
pub fn server_config(
    cert: &Path,
    key: &Path,
    alpn: &[&[u8]],
) -> std::sync::Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).unwrap();
    let mut cfg = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    std::sync::Arc::new(cfg)
}

/// `curl -sk --http2 -w <write_out> <args> <urls>` with every body
/// discarded: what `-w` printed.
pub fn curl_h2_write_out(write_out: &str, args: &[&str], urls: &[&str]) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sk", "--http2", "-w", write_out]).args(args);
    for u in urls {
        cmd.args(["-o", "/dev/null", u]);
    }
    let out = cmd.output().expect("run curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}
