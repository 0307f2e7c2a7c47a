//! HTTP/2 under load and abuse: an h2load burst over TLS (every request
//! served, the same lanes), and a rapid-reset flood (CVE-2023-44487: HEADERS
//! immediately followed by RST_STREAM, thousands per connection) that the
//! gateway answers with GOAWAY ENHANCE_YOUR_CALM, without passing the reset
//! streams on to the nodes, with bounded memory and less CPU per reset stream
//! than per real request — and it keeps serving.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::harness::tls::*;
use crate::harness::*;

async fn setup() -> (Fixture, Gateway, Backend, SocketAddr, SocketAddr) {
    let fx = Fixture::new();
    let formal = Backend::start("f1", "formal").await;
    write_cert(&fx.path("certs"), "site", "localhost");
    fx.api_nodes(&[&formal]);
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .listeners(&[
            Listener::tls().cert("certs/site.crt", "certs/site.key"),
            Listener::h2c(),
        ])
        .start(&fx, "graygate.yaml");
    let ls = listeners(&gw);
    (fx, gw, formal, ls[0], ls[1])
}

fn rss_kb(pid: u32) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    st.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Runs h2load and returns (succeeded, failed, errored).
fn h2load(args: &[&str], url: &str) -> (u64, u64, u64, String) {
    let out = std::process::Command::new("h2load")
        .args(args)
        .arg(url)
        .output()
        .expect("h2load (Debian nghttp2-client) is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.starts_with("requests:"))
        .unwrap_or_else(|| panic!("h2load output:\n{text}"))
        .to_string();
    let num = |word: &str| -> u64 {
        line.split(',')
            .find(|p| p.trim().ends_with(word))
            .and_then(|p| p.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{word} in {line}"))
    };
    (num("succeeded"), num("failed"), num("errored"), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2load_burst_over_tls_is_served_completely() {
    let (_fx, gw, formal, tls, _) = setup().await;
    let url = format!("https://localhost:{}/api/burst", tls.port());
    let (ok, failed, errored, text) = h2load(&["-n", "4000", "-c", "8", "-m", "64"], &url);
    assert_eq!((ok, failed, errored), (4000, 0, 0), "{text}");
    assert!(text.contains("4000 2xx"), "{text}");
    assert!(text.contains("h2"), "negotiated h2: {text}");
    assert_eq!(formal.count(), 4000, "every stream reached the node once");
    // Concurrent streams beyond the limit wait instead of failing.
    let (ok, failed, errored, text) = h2load(&["-n", "2000", "-c", "1", "-m", "500"], &url);
    assert_eq!((ok, failed, errored), (2000, 0, 0), "{text}");
    assert_eq!(gw.get("/api/after").await.status, 200);
    // The header list limit (http2.max_header_list_size, 32 KiB): 431.
    let seen = formal.count();
    let code = |size: usize| {
        let big = format!("X-Big: {}", "a".repeat(size));
        let url = format!("https://localhost:{}/api/big", tls.port());
        curl_h2_write_out("%{http_code} %{http_version}", &["-H", &big], &[&url])
    };
    assert_eq!(code(40_000), "431 2");
    assert_eq!(formal.count(), seen, "refused before the node");
    assert_eq!(code(20_000), "200 2");
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK for `GET http://localhost/api/reset` (static-table indices and
/// literals without indexing).
fn request_block() -> Vec<u8> {
    let mut b = vec![0x82, 0x86]; // :method GET, :scheme http
    b.push(0x04); // :path, literal without indexing
    b.push(10);
    b.extend_from_slice(b"/api/reset");
    b.push(0x01); // :authority
    b.push(9);
    b.extend_from_slice(b"localhost");
    b
}

/// One connection's flood: `pairs` × (HEADERS, RST_STREAM CANCEL). Returns
/// the GOAWAY error code the gateway sent, if any.
fn flood(addr: SocketAddr, pairs: u32) -> Option<u32> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    let block = request_block();
    let mut buf = Vec::new();
    for i in 0..pairs {
        let id = 1 + 2 * i;
        buf.extend(frame(0x1, 0x5, id, &block)); // HEADERS, END_STREAM|END_HEADERS
        buf.extend(frame(0x3, 0, id, &8u32.to_be_bytes())); // RST_STREAM CANCEL
    }
    out.extend(buf);
    let writer = {
        let mut w = s.try_clone().unwrap();
        std::thread::spawn(move || {
            // The gateway may close mid-write: that is the point.
            let _ = w.write_all(&out);
        })
    };
    let mut goaway = None;
    let mut data = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => data.extend_from_slice(&chunk[..n]),
        }
        // Parse whole frames.
        let mut at = 0;
        while data.len() >= at + 9 {
            let len = ((data[at] as usize) << 16)
                | ((data[at + 1] as usize) << 8)
                | data[at + 2] as usize;
            if data.len() < at + 9 + len {
                break;
            }
            if data[at + 3] == 0x7 && len >= 8 {
                let p = &data[at + 9..at + 17];
                goaway = Some(u32::from_be_bytes([p[4], p[5], p[6], p[7]]));
            }
            at += 9 + len;
        }
        data.drain(..at);
        if goaway.is_some() {
            break;
        }
    }
    drop(s);
    let _ = writer.join();
    goaway
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_flood_is_cut_off_and_bounded() {
    let (_fx, gw, formal, tls, h2c) = setup().await;
    let pid = gw.pid();
    // The cost of real work, measured the same way: CPU per served request.
    let url = format!("https://localhost:{}/api/real", tls.port());
    let cpu0 = cpu_secs(pid);
    let (ok, ..) = h2load(&["-n", "3000", "-c", "4", "-m", "32"], &url);
    assert_eq!(ok, 3000);
    let per_request = (cpu_secs(pid) - cpu0) / 3000.0;
    let served_before = formal.count();

    let rss0 = rss_kb(pid);
    let (conns, pairs) = (40u32, 5000u32);
    let cpu1 = cpu_secs(pid);
    let codes: Vec<Option<u32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..conns).map(|_| sc.spawn(|| flood(h2c, pairs))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let attack_cpu = cpu_secs(pid) - cpu1;
    let sent = u64::from(conns * pairs);
    // Every flooding connection was told to calm down and closed.
    assert!(
        codes.iter().all(|c| *c == Some(0xb)),
        "GOAWAY ENHANCE_YOUR_CALM on every connection: {codes:?}"
    );
    let reached = formal.count() - served_before;
    assert!(
        (reached as u64) * 100 < sent,
        "reset streams mostly never reach a node: {reached} of {sent}"
    );
    let per_reset = attack_cpu / sent as f64;
    eprintln!(
        "rapid reset: {sent} HEADERS+RST pairs, {reached} reached the node, gateway CPU {attack_cpu:.3} s \
         ({:.2} µs per pair, {:.2} µs per served request), RSS {rss0} → {} kB",
        per_reset * 1e6,
        per_request * 1e6,
        rss_kb(pid)
    );
    assert!(
        per_reset < per_request,
        "a reset stream costs less than a served request ({per_reset} vs {per_request} s)"
    );
    let rss1 = rss_kb(pid);
    assert!(
        rss1 < rss0 + 64 * 1024,
        "memory bounded: {rss0} → {rss1} kB"
    );
    // Still serving, over h2 and HTTP/1.1.
    let r = curl(
        &["--http2"],
        &format!("https://localhost:{}/api/after", tls.port()),
    );
    assert_eq!(r.version, "2");
    assert!(r.body.contains("\"node\":\"f1\""));
    assert_eq!(gw.get("/api/after").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_larger_than_the_windows_stream_both_ways_over_h2() {
    let fx = Fixture::new();
    let echo = Backend::start_mode("echo", "formal", Mode::Echo).await;
    write_cert(&fx.path("certs"), "site", "localhost");
    fx.api_nodes(&[&echo]);
    let gw = Config::new().node_files(&["nodes.yaml"]).route_all("api").raw("http2: { initial_stream_window_bytes: 65535, initial_connection_window_bytes: 131072 }\n").listeners(&[Listener::tls().cert("certs/site.crt", "certs/site.key")])
    .start(&fx, "graygate.yaml");
    let tls = listeners(&gw)[0];
    // 3 MiB: 48 stream windows' worth, so flow control must move it.
    let body: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let file = fx.path("upload.bin");
    std::fs::write(&file, &body).unwrap();
    let out = std::process::Command::new("curl")
        .args(["-sk", "--http2", "--data-binary"])
        .arg(format!("@{}", file.display()))
        .arg(format!("https://localhost:{}/upload", tls.port()))
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(out.stdout.len(), body.len(), "the whole body came back");
    assert!(out.stdout == body, "byte for byte");
}
