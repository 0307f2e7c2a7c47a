//! HTTP/2 under load and abuse: an h2load burst over TLS (every request
//! served, the same lanes), and a rapid-reset flood (CVE-2023-44487: HEADERS
//! immediately followed by RST_STREAM, thousands per connection) that the
//! gateway answers with GOAWAY ENHANCE_YOUR_CALM, without passing the reset
//! streams on to the nodes, with bounded memory and less CPU per reset stream
//! than per real request — and it keeps serving. Clients that stop taking
//! what they asked for (a shut stream window, a socket never read) against
//! the send timeout, per stream and per connection, with the gateway's
//! descriptors counted in `/proc/<pid>/fd`; PING and SETTINGS floods against
//! the control-frame bound, and a normal client's pings and a slow node's
//! stream left alone.

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

/// HPACK for `GET http://localhost<path>` (static-table indices and
/// literals without indexing; `path` shorter than 127 bytes).
fn request_block(path: &str) -> Vec<u8> {
    let mut b = vec![0x82, 0x86]; // :method GET, :scheme http
    b.push(0x04); // :path, literal without indexing
    b.push(path.len() as u8);
    b.extend_from_slice(path.as_bytes());
    b.push(0x01); // :authority
    b.push(9);
    b.extend_from_slice(b"localhost");
    b
}

/// A frame the gateway sent.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    /// The error code of a GOAWAY or RST_STREAM frame.
    fn code(&self, kind: u8) -> Option<u32> {
        let at = if kind == 0x7 { 4 } else { 0 };
        (self.kind == kind && self.payload.len() >= at + 4)
            .then(|| u32::from_be_bytes(self.payload[at..at + 4].try_into().unwrap()))
    }

    fn goaway_code(&self) -> Option<u32> {
        self.code(0x7)
    }
}

/// The first whole frame of `data`, taken off it.
fn take_frame(data: &mut Vec<u8>) -> Option<Frame> {
    if data.len() < 9 {
        return None;
    }
    let d = &data[..];
    let len = u32::from_be_bytes([0, d[0], d[1], d[2]]) as usize;
    if d.len() < 9 + len {
        return None;
    }
    let f = Frame {
        kind: d[3],
        flags: d[4],
        stream: u32::from_be_bytes([d[5], d[6], d[7], d[8]]) & 0x7fff_ffff,
        payload: d[9..9 + len].to_vec(),
    };
    data.drain(..9 + len);
    Some(f)
}

/// Reads the frames the gateway sends on a connection, whole, until it
/// ends (EOF, a reset or the read timeout).
struct FrameReader {
    s: TcpStream,
    data: Vec<u8>,
}

impl FrameReader {
    fn new(s: TcpStream) -> FrameReader {
        FrameReader {
            s,
            data: Vec::new(),
        }
    }

    fn next(&mut self) -> Option<Frame> {
        let mut chunk = [0u8; 16384];
        loop {
            if let Some(f) = take_frame(&mut self.data) {
                return Some(f);
            }
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.data.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// One connection's flood: `pairs` × (HEADERS, RST_STREAM CANCEL). Returns
/// the GOAWAY error code the gateway sent, if any.
fn flood(addr: SocketAddr, pairs: u32) -> Option<u32> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    let block = request_block("/api/reset");
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
    let mut frames = FrameReader::new(s.try_clone().unwrap());
    while let Some(f) = frames.next() {
        if let Some(code) = f.goaway_code() {
            goaway = Some(code);
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

/// A gateway serving `site/formal/` over h2c: `big.bin` (beyond the content
/// cache: sent from disk, one descriptor per answer) and `small.txt`; and
/// `/api` from `api`, if given.
fn static_site(extra: &str, api: Option<&Backend>) -> (Fixture, Gateway, SocketAddr) {
    let fx = Fixture::new();
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    std::fs::write(fx.path("site/formal/big.bin"), pattern(4 << 20)).unwrap();
    fx.write("site/formal/small.txt", "small\n");
    let mut routes = vec![Route::static_dir("/", "site")];
    let mut config = Config::new();
    if let Some(b) = api {
        fx.api_nodes(&[b]);
        routes.insert(0, Route::service("/api", "api"));
        config = config.node_files(&["nodes.yaml"]);
    }
    let gw = config
        .set("workers", 1)
        .raw(extra)
        .routes(&routes)
        .listeners(&[Listener::h2c()])
        .start(&fx, "gg.yaml");
    let h2c = listeners(&gw)[0];
    (fx, gw, h2c)
}

/// Descriptors process `pid` holds open, and how many of them are `big.bin`.
fn open_fds(pid: u32) -> (usize, usize) {
    let fds: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect();
    let big = fds.iter().filter(|p| p.ends_with("big.bin")).count();
    (fds.len(), big)
}

/// The gateway's descriptors once a warm-up request has opened what it
/// keeps open (and closed what it does not).
async fn fd_baseline(gw: &Gateway, h2c: SocketAddr) -> usize {
    assert!(curl_h2c(h2c, "/small.txt").ok);
    assert_eq!(gw.get("/small.txt").await.status, 200);
    let mut last = usize::MAX;
    eventually("descriptors settle", Duration::from_secs(10), || {
        let now = open_fds(gw.pid()).0;
        let same = now == last;
        last = now;
        async move { same }
    })
    .await;
    last
}

fn curl_h2c(addr: SocketAddr, path: &str) -> Curl {
    let r = curl(
        &["--http2-prior-knowledge"],
        &format!("http://127.0.0.1:{}{path}", addr.port()),
    );
    assert_eq!(r.version, "2", "h2c");
    r
}

/// An h2c connection that has sent its preface and SETTINGS (`settings`:
/// identifier, value), with a receive buffer of `rcvbuf` bytes if given.
fn h2c_client(addr: SocketAddr, settings: &[(u16, u32)], rcvbuf: Option<usize>) -> TcpStream {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    if let Some(n) = rcvbuf {
        sock.set_recv_buffer_size(n).unwrap();
    }
    sock.connect(&addr.into()).unwrap();
    let mut s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let mut p = Vec::new();
    for (id, v) in settings {
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&v.to_be_bytes());
    }
    out.extend(frame(0x4, 0, 0, &p));
    s.write_all(&out).unwrap();
    s
}

/// HEADERS (END_STREAM, END_HEADERS) for `GET <path>` on each of `streams`.
fn gets(s: &mut TcpStream, path: &str, streams: impl IntoIterator<Item = u32>) {
    let block = request_block(path);
    let mut out = Vec::new();
    for id in streams {
        out.extend(frame(0x1, 0x5, id, &block));
    }
    s.write_all(&out).unwrap();
}

/// What a client read off one connection (by a reader thread).
#[derive(Default)]
struct Seen {
    /// Streams answered with HEADERS.
    answered: std::collections::BTreeSet<u32>,
    /// The header block of each stream's answer.
    blocks: std::collections::BTreeMap<u32, Vec<u8>>,
    /// Streams reset, and how.
    reset: std::collections::BTreeMap<u32, u32>,
    /// DATA bytes, and the streams that ended.
    data: usize,
    ended: std::collections::BTreeSet<u32>,
    ping_acks: usize,
    settings_acks: usize,
    goaway: Option<u32>,
    closed: bool,
    /// When each (frame type, stream) was first seen.
    first: std::collections::BTreeMap<(u8, u32), std::time::Instant>,
}

fn watch_frames(s: &TcpStream) -> std::sync::Arc<std::sync::Mutex<Seen>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let mut frames = FrameReader::new(s.try_clone().unwrap());
    let out = seen.clone();
    std::thread::spawn(move || {
        while let Some(f) = frames.next() {
            let mut s = out.lock().unwrap();
            s.first
                .entry((f.kind, f.stream))
                .or_insert_with(std::time::Instant::now);
            match f.kind {
                0x0 => {
                    s.data += f.payload.len();
                    if f.flags & 0x1 != 0 {
                        s.ended.insert(f.stream);
                    }
                }
                0x1 => {
                    s.answered.insert(f.stream);
                    s.blocks.entry(f.stream).or_insert(f.payload);
                }
                0x3 => {
                    s.reset.insert(f.stream, f.code(0x3).unwrap());
                }
                0x6 if f.flags & 0x1 != 0 => s.ping_acks += 1,
                0x4 if f.flags & 0x1 != 0 => s.settings_acks += 1,
                0x7 => s.goaway = f.goaway_code(),
                _ => {}
            }
        }
        out.lock().unwrap().closed = true;
    });
    seen
}

/// Issue 33, item 8: streams whose client never opens its window on a file
/// sent from disk are reset (CANCEL) once they have waited
/// `client.send_timeout_ms`, and their files closed; the connections stay,
/// and other clients are served meanwhile. Two windows: 0 (the first chunk
/// never leaves) and 1 byte (a chunk leaves a byte at a time and the body
/// waits for the server to let go of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_a_client_never_lets_send_are_reset_at_the_send_timeout() {
    // Every stream opens its file here (no per-connection bound: that is
    // `a_connection_holds_no_more_files_open_than_its_bound`).
    let (_fx, gw, h2c) = static_site(
        "client: { send_timeout_ms: 1500 }\nhttp2: { max_open_files_per_connection: 0 }\n",
        None,
    );
    let pid = gw.pid();
    let base = fd_baseline(&gw, h2c).await;
    let n = 64u32;
    let mut conns = Vec::new();
    for window in [0u32, 1] {
        let mut c = h2c_client(h2c, &[(0x4, window)], None);
        let seen = watch_frames(&c);
        gets(&mut c, "/big.bin", (0..n).map(|i| 1 + 2 * i));
        conns.push((window, c, seen));
    }
    for (_, _, seen) in &conns {
        soon("every stream answered", || {
            let all = seen.lock().unwrap().answered.len() == n as usize;
            async move { all }
        })
        .await;
    }
    // One descriptor per stalled stream at most.
    let (_, big) = open_fds(pid);
    assert!(big <= 2 * n as usize, "{big} descriptors of big.bin");
    // Other clients are served meanwhile, over HTTP/1.1 and h2c.
    assert_eq!(gw.get("/small.txt").await.text(), "small\n");
    assert_eq!(curl_h2c(h2c, "/small.txt").body, "small\n");
    for (window, _, seen) in &conns {
        eventually(
            &format!("every stalled stream reset (window {window})"),
            Duration::from_secs(30),
            || {
                let done = seen.lock().unwrap().reset.len() == n as usize;
                async move { done }
            },
        )
        .await;
        let s = seen.lock().unwrap();
        assert!(s.reset.values().all(|&c| c == 0x8), "RST_STREAM CANCEL");
        assert_eq!(s.data, (window * n) as usize, "the window's worth passed");
        assert!(s.goaway.is_none() && !s.closed, "the connection stays");
    }
    soon("the files closed", || async move {
        open_fds(pid) == (base + 2, 0)
    })
    .await;
    for (_, c, _) in conns {
        // (The reader thread holds a handle too: shut it, not just dropped.)
        c.shutdown(std::net::Shutdown::Both).unwrap();
    }
    soon(
        "back to the baseline",
        || async move { open_fds(pid).0 == base },
    )
    .await;
}

/// Issue 50: the per-stream send timeout is armed relative to now. In a
/// gateway that has run a while (the watchdog's clock counts from its
/// start), a stream whose client never lets it send is reset
/// `client.send_timeout_ms` after its answer began, within a clock tick and
/// a loaded machine's scheduling — not the gateway's age later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_is_reset_at_its_send_timeout_in_a_gateway_that_has_run_a_while() {
    let limit = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let (_fx, gw, h2c) = static_site(
        &format!("client: {{ send_timeout_ms: {} }}\n", limit.as_millis()),
        None,
    );
    // Five seconds of serving: a timer armed at the absolute due time
    // would fire five seconds late.
    let age = Duration::from_secs(5);
    while started.elapsed() < age {
        assert_eq!(gw.get("/small.txt").await.text(), "small\n");
    }
    for round in 0..3u32 {
        let mut c = h2c_client(h2c, &[(0x4, 0)], None);
        let seen = watch_frames(&c);
        gets(&mut c, "/big.bin", [1]);
        eventually("the stalled stream reset", Duration::from_secs(30), || {
            let done = seen.lock().unwrap().reset.contains_key(&1);
            async move { done }
        })
        .await;
        let s = seen.lock().unwrap();
        let waited = s.first[&(0x3, 1)] - s.first[&(0x1, 1)];
        assert!(
            waited >= limit - Duration::from_millis(20) && waited < limit + Duration::from_secs(1),
            "round {round}: reset {waited:?} after the answer began, the limit is {limit:?}"
        );
        assert_eq!(s.reset[&1], 0x8, "RST_STREAM CANCEL");
    }
}

/// Issue 33, item 8: one connection's answers hold at most
/// `http2.max_open_files_per_connection` files open, however many of its
/// streams the client stalls. 100 streams on a file sent from disk with the
/// client's stream window shut: 4 get a slot, open the file and are reset
/// (CANCEL) at the send timeout; the others wait for a slot holding no
/// descriptor — those whose slot does not come within the send timeout are
/// answered 503, those that get one are served (and, stalled too, reset in
/// turn). Never more than 4 descriptors of the file at once, none after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_no_more_files_open_than_its_bound() {
    let (_fx, gw, h2c) = static_site(
        "client: { send_timeout_ms: 1500 }\nhttp2: { max_open_files_per_connection: 4 }\n",
        None,
    );
    let pid = gw.pid();
    let base = fd_baseline(&gw, h2c).await;
    let n = 100u32;
    let mut c = h2c_client(h2c, &[(0x4, 0)], None);
    let seen = watch_frames(&c);
    gets(&mut c, "/big.bin", (0..n).map(|i| 1 + 2 * i));
    let mut most = 0;
    eventually(
        "every stream answered and reset",
        Duration::from_secs(60),
        || {
            most = most.max(open_fds(pid).1);
            let s = seen.lock().unwrap();
            let done = s.answered.len() == n as usize && s.reset.len() == n as usize;
            async move { done }
        },
    )
    .await;
    assert!(most <= 4, "{most} descriptors of big.bin at once");
    {
        let s = seen.lock().unwrap();
        assert!(s.reset.values().all(|&c| c == 0x8), "RST_STREAM CANCEL");
        // `:status 200` is HPACK static index 8; the rest are 503s.
        let served = s
            .blocks
            .values()
            .filter(|b| b.first() == Some(&0x88))
            .count();
        let refused: Vec<_> = s
            .blocks
            .values()
            .filter(|b| b.first() != Some(&0x88))
            .collect();
        assert!(served >= 4, "{served} streams got a slot");
        assert!(
            !refused.is_empty(),
            "some streams waited past the send timeout"
        );
        // The first 503 carries its value (raw or Huffman-coded), the rest an
        // index into the connection's HPACK table.
        let huffman_503 = [0x83, 0x6c, 0x0c, 0xff];
        assert!(
            refused
                .iter()
                .any(|b| b.windows(4).any(|w| w == b"\x03503" || w == huffman_503)),
            "the refused streams are 503s: {refused:x?}"
        );
        assert!(s.goaway.is_none() && !s.closed, "the connection stays");
    }
    soon("the files closed", || async move {
        open_fds(pid) == (base + 1, 0)
    })
    .await;
    c.shutdown(std::net::Shutdown::Both).unwrap();
}

/// Issue 33, item 8: streams waiting for one of their connection's file
/// slots are served as slots are given back: 24 concurrent streams of a
/// 4 MiB file with 2 slots all complete (h2load, one connection), never more
/// than 2 descriptors of the file open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_waiting_for_a_file_slot_are_served_as_slots_free() {
    let (_fx, gw, h2c) = static_site(
        "client: { send_timeout_ms: 20000 }\nhttp2: { max_open_files_per_connection: 2 }\n",
        None,
    );
    let pid = gw.pid();
    let url = format!("http://127.0.0.1:{}/big.bin", h2c.port());
    let load = std::thread::spawn(move || h2load(&["-n", "24", "-c", "1", "-m", "24"], &url));
    let mut most = 0;
    while !load.is_finished() {
        most = most.max(open_fds(pid).1);
        // (A sampling interval, not a wait for anything.)
        std::thread::sleep(Duration::from_millis(2));
    }
    let (ok, failed, errored, text) = load.join().unwrap();
    assert_eq!((ok, failed, errored), (24, 0, 0), "{text}");
    assert!(most <= 2, "{most} descriptors of big.bin at once");
}

/// Issue 33, item 8: a client that stops reading the socket (its windows
/// wide open) has its connection closed once a write has waited
/// `client.send_timeout_ms`: its socket and files are given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_client_stops_reading_is_closed_at_the_send_timeout() {
    let (_fx, gw, h2c) = static_site("client: { send_timeout_ms: 1000 }\n", None);
    let pid = gw.pid();
    let base = fd_baseline(&gw, h2c).await;
    let mut c = h2c_client(h2c, &[(0x4, 0x7fff_ffff)], Some(4096));
    // The connection window wide open too.
    c.write_all(&frame(0x8, 0, 0, &(0x7fff_ffffu32 - 65_535).to_be_bytes()))
        .unwrap();
    gets(&mut c, "/big.bin", (0..10).map(|i| 1 + 2 * i));
    soon("the files opened", || async move { open_fds(pid).1 > 0 }).await;
    // Never read: the gateway's writes wait, then it lets go.
    eventually(
        "the connection closed, its files with it",
        Duration::from_secs(30),
        || async move { open_fds(pid) == (base, 0) },
    )
    .await;
    assert_eq!(curl_h2c(h2c, "/small.txt").body, "small\n");
    drop(c);
}

/// Issue 33, item 9: a PING flood, and a SETTINGS flood, get GOAWAY
/// ENHANCE_YOUR_CALM (beyond `http2.max_control_frames_per_second`, 1000 by
/// default) and the connection closes; the gateway serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_and_settings_floods_get_goaway_enhance_your_calm() {
    let (_fx, gw, h2c) = static_site("", None);
    let sent = 100_000usize;
    for (name, f) in [
        ("PING", frame(0x6, 0, 0, &[7; 8])),
        ("SETTINGS", frame(0x4, 0, 0, &[])),
    ] {
        let c = h2c_client(h2c, &[], None);
        let seen = watch_frames(&c);
        let mut w = c.try_clone().unwrap();
        let flood = f.repeat(sent);
        // The gateway closes mid-write: that is the point.
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(&flood);
        });
        eventually("the connection closed", Duration::from_secs(30), || {
            let closed = seen.lock().unwrap().closed;
            async move { closed }
        })
        .await;
        let _ = writer.join();
        let s = seen.lock().unwrap();
        assert_eq!(
            s.goaway,
            Some(0xb),
            "{name} flood: GOAWAY ENHANCE_YOUR_CALM"
        );
        eprintln!(
            "{name} flood: {sent} sent, {} PING and {} SETTINGS ACKs before the GOAWAY",
            s.ping_acks, s.settings_acks
        );
        assert!(
            s.ping_acks.max(s.settings_acks) < sent,
            "{name} flood cut off"
        );
    }
    assert_eq!(gw.get("/small.txt").await.text(), "small\n");
    assert_eq!(curl_h2c(h2c, "/small.txt").body, "small\n");
}

/// The flood bound leaves a normal client alone: a few PINGs with its
/// requests, all acknowledged, every answer whole, no GOAWAY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_few_pings_is_unaffected() {
    let (_fx, _gw, h2c) = static_site("", None);
    let mut c = h2c_client(h2c, &[], None);
    let seen = watch_frames(&c);
    for round in 0..5u32 {
        let pings: Vec<u8> = (0..10).flat_map(|_| frame(0x6, 0, 0, &[1; 8])).collect();
        c.write_all(&pings).unwrap();
        gets(&mut c, "/small.txt", [1 + 2 * round]);
        soon("the answer and the PING ACKs", || {
            let s = seen.lock().unwrap();
            let done =
                s.ended.contains(&(1 + 2 * round)) && s.ping_acks == 10 * (round as usize + 1);
            async move { done }
        })
        .await;
    }
    let s = seen.lock().unwrap();
    assert_eq!(s.data, 5 * "small\n".len());
    assert!(s.goaway.is_none() && !s.closed && s.reset.is_empty());
}

/// The send timeout is the client's, never the node's: a stream whose node
/// pauses mid-body longer than `client.send_timeout_ms` is not cut (while a
/// stream stalled by its client, started later, is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_on_a_slow_node_is_not_cut() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let slow = Backend::start_mode("slow", "formal", Mode::Gated(gate.clone())).await;
    let (_fx, _gw, h2c) = static_site("client: { send_timeout_ms: 500 }\n", Some(&slow));
    let mut c = h2c_client(h2c, &[], None);
    let seen = watch_frames(&c);
    gets(&mut c, "/api/slow", [1]);
    soon("the node's first part", || {
        let got = seen.lock().unwrap().data == "first;".len();
        async move { got }
    })
    .await;
    // A clock without a sleep: a stream stalled by its client, started now,
    // is reset once the send timeout has passed.
    let mut stalled = h2c_client(h2c, &[(0x4, 0)], None);
    let stalled_seen = watch_frames(&stalled);
    gets(&mut stalled, "/big.bin", [1]);
    soon("the stalled stream reset", || {
        let done = stalled_seen.lock().unwrap().reset.contains_key(&1);
        async move { done }
    })
    .await;
    assert!(
        seen.lock().unwrap().reset.is_empty(),
        "the slow node's stream lives"
    );
    gate.notify_one();
    soon("the node's answer whole", || {
        let s = seen.lock().unwrap();
        let done = s.ended.contains(&1) && s.data == "first;rest".len();
        async move { done }
    })
    .await;
    assert!(seen.lock().unwrap().reset.is_empty());
    c.shutdown(std::net::Shutdown::Both).unwrap();
    stalled.shutdown(std::net::Shutdown::Both).unwrap();
}

/// An HTTP/2 connection over TLS (ALPN `h2`, the fixture's `certs/site.crt`
/// trusted for `localhost`).
async fn tls_h2(
    addr: SocketAddr,
    fx: &Fixture,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let s = crate::harness::tls::connect(addr, &fx.path("certs/site.crt"), &[b"h2"]).await;
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    s
}

/// Issue 33, item 9, over TLS (the GOAWAY goes through the TLS layer, then
/// its close_notify): a PING flood gets GOAWAY ENHANCE_YOUR_CALM and the
/// connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_over_tls_gets_goaway_enhance_your_calm() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (fx, gw, _formal, tls, _) = setup().await;
    let (mut rd, mut wr) = tokio::io::split(tls_h2(tls, &fx).await);
    let sent = 100_000;
    let writer = tokio::spawn(async move {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(0x4, 0, 0, &[]));
        out.extend(frame(0x6, 0, 0, &[7; 8]).repeat(sent));
        // The gateway closes mid-write: that is the point.
        let _ = wr.write_all(&out).await;
        wr
    });
    let mut data = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        let mut chunk = vec![0u8; 16384];
        loop {
            match rd.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => data.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the connection ended");
    let mut frames = Vec::new();
    while let Some(f) = take_frame(&mut data) {
        frames.push(f);
    }
    let acks = frames
        .iter()
        .filter(|f| f.kind == 0x6 && f.flags & 0x1 != 0)
        .count();
    let goaway = frames.iter().find_map(Frame::goaway_code);
    assert_eq!(
        goaway,
        Some(0xb),
        "GOAWAY ENHANCE_YOUR_CALM ({acks} PING ACKs)"
    );
    assert!(acks < sent, "cut off: {acks} PING ACKs");
    drop(writer.await.unwrap());
    let r = curl(
        &["--http2"],
        &format!("https://localhost:{}/api/after", tls.port()),
    );
    assert_eq!(r.version, "2");
    assert_eq!(gw.get("/api/after").await.status, 200);
}
