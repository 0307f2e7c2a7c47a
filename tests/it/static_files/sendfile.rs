//! The static files' `sendfile(2)` path (whole files from `SENDFILE_MIN` on,
//! plain HTTP/1.1 connections) under the conditions that break hand-made
//! send loops: a client that reads slowly (every send partial, the socket
//! waited on again and again), clients that go away mid-file, a file cut
//! short while it is being sent, a client that stops reading. The gateway
//! is the real binary; `/proc/<pid>/io` tells that the file's bytes were read
//! by it, `/proc/net/tcp` how much the kernel holds for a stalled reader
//! (the sendfile path's `TCP_NOTSENT_LOWAT`).

use std::time::Duration;

use crate::harness::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A file bigger than the kernel's largest automatic send buffer
/// (`tcp_wmem` max, 4 MiB by default): sendfile cannot take it in one call.
const BIG: usize = 12 << 20;

/// (`rchar`, `syscr`) of process `pid`: bytes and calls of the read side
/// (`sendfile` counts its bytes and one call).
fn proc_io(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/io"))
    };
    (field("rchar:"), field("syscr:"))
}

/// Descriptors process `pid` holds open, and how many of them are `file`.
fn open_fds(pid: u32, file: &str) -> (usize, usize) {
    let fds: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect();
    let of_file = fds.iter().filter(|p| p.ends_with(file)).count();
    (fds.len(), of_file)
}

/// A gateway serving `site/formal/` with `big.bin` (`size` bytes, beyond the
/// content cache: sent from disk) and `small.txt`; `extra` is more config.
fn site(size: usize, extra: &str) -> (Fixture, Gateway, Vec<u8>) {
    let fx = Fixture::new();
    let big = pattern(size);
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    std::fs::write(fx.path("site/formal/big.bin"), &big).unwrap();
    fx.write("site/formal/small.txt", "small\n");
    let gw = Config::new()
        .set("static_cache", "{ max_file_size: 1m }")
        .raw(extra)
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    (fx, gw, big)
}

/// A connection whose receive buffer is small: the gateway's sends fill the
/// window at once and must wait for the client to read.
async fn slow_client(gw: &Gateway) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(8192).unwrap();
    sock.connect(gw.addr).await.unwrap()
}

const GET_BIG: &[u8] = b"GET /big.bin HTTP/1.1\r\nHost: t\r\n\r\n";
const GET_SMALL: &[u8] = b"GET /small.txt HTTP/1.1\r\nHost: t\r\n\r\n";

/// Reads from `s` into `buf` until it holds at least `n` bytes.
async fn read_at_least(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) {
    let mut chunk = vec![0u8; 4096];
    while buf.len() < n {
        let got = s.read(&mut chunk).await.unwrap();
        assert!(got > 0, "closed after {} bytes", buf.len());
        buf.extend_from_slice(&chunk[..got]);
    }
}

/// Reads from `s` into `buf` until the connection ends (EOF or a reset);
/// false if it is still open after `limit`.
async fn read_to_close(s: &mut TcpStream, buf: &mut Vec<u8>, limit: Duration) -> bool {
    let all = async {
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(limit, all).await.is_ok()
}

/// A client reading in small pieces through an 8 KiB window gets a 12 MiB
/// file byte-exact (sendfile returned short and the send loop waited for
/// the socket hundreds of times), and the pipelined request behind it is
/// answered next on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_a_big_file_byte_exact_by_sendfile() {
    let (_fx, gw, big) = site(BIG, "");
    assert_eq!(gw.get("/small.txt").await.status, 200);
    let mut s = slow_client(&gw).await;
    let (rchar, syscr) = proc_io(gw.pid());
    s.write_all(&[GET_BIG, GET_SMALL].concat()).await.unwrap();
    let mut buf = Vec::new();
    let (head, body) = tokio::time::timeout(Duration::from_secs(60), read_one(&mut s, &mut buf))
        .await
        .expect("the whole file within a minute");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body.len(), big.len());
    assert!(body == big, "bytes differ");
    let (rchar2, syscr2) = proc_io(gw.pid());
    assert!(
        rchar2 - rchar >= BIG as u64,
        "sent by sendfile (counted in rchar): {rchar} then {rchar2}, syscr {syscr} then {syscr2}"
    );
    assert!(syscr2 > syscr, "read-side calls counted");
    let (head, body) = read_one(&mut s, &mut buf).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, b"small\n");
    assert!(buf.is_empty(), "nothing after the last body");
}

/// Clients that close (FIN or RST) in the middle of a sendfile'd body leave
/// nothing behind: the gateway's descriptors (sockets and the files being
/// sent) go back to what they were, and the next client gets the whole file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_closing_mid_file_leave_no_descriptor_behind() {
    let (_fx, gw, big) = site(BIG, "");
    assert_eq!(gw.get("/small.txt").await.status, 200);
    let (before, _) = open_fds(gw.pid(), "big.bin");
    let mut clients = Vec::new();
    for _ in 0..16 {
        let mut s = slow_client(&gw).await;
        s.write_all(GET_BIG).await.unwrap();
        clients.push(s);
    }
    for (i, s) in clients.iter_mut().enumerate() {
        let mut buf = Vec::new();
        read_at_least(s, &mut buf, 256 << 10).await;
        assert!(buf.starts_with(b"HTTP/1.1 200"));
        if i % 2 == 0 {
            // RST on close.
            socket2::SockRef::from(&*s)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
        }
    }
    let (_, sending) = open_fds(gw.pid(), "big.bin");
    assert_eq!(sending, 16, "the file open once per response being sent");
    drop(clients);
    soon("descriptors given back", || async {
        let (fds, files) = open_fds(gw.pid(), "big.bin");
        fds <= before && files == 0
    })
    .await;
    let r = gw.get("/big.bin").await;
    assert_eq!(r.status, 200);
    assert!(r.body[..] == big[..], "the next client gets the whole file");
}

/// A file cut short on disk while it is being sent: the connection closes
/// short of the announced length (the client can tell the body is
/// incomplete), nothing of the pipelined request behind it is answered on
/// that connection, and the next request gets the file as it is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_truncated_while_sent_ends_the_connection_short() {
    let size = 16 << 20;
    let (fx, gw, big) = site(size, "");
    let mut s = slow_client(&gw).await;
    s.write_all(&[GET_BIG, GET_SMALL].concat()).await.unwrap();
    let mut buf = Vec::new();
    read_at_least(&mut s, &mut buf, 1 << 20).await;
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    assert!(head.contains(&format!("content-length: {size}")), "{head}");
    // At most the socket buffers' worth (a few MiB) is on its way: the
    // rest is still to be sent when the file shrinks to 2 MiB.
    let cut = 2 << 20;
    std::fs::OpenOptions::new()
        .write(true)
        .open(fx.path("site/formal/big.bin"))
        .unwrap()
        .set_len(cut as u64)
        .unwrap();
    let closed = read_to_close(&mut s, &mut buf, Duration::from_secs(30)).await;
    assert!(closed, "the connection must close, not wait");
    let body = &buf[end..];
    assert!(
        body.len() < size,
        "{} bytes after the head: a short body must not be followed by more",
        body.len()
    );
    let sent = body.len().min(cut);
    assert!(body[..sent] == big[..sent], "what was sent is the file");
    eventually("the file as it is now", Duration::from_secs(5), || async {
        let r = gw.get("/big.bin").await;
        r.status == 200 && r.body[..] == big[..cut]
    })
    .await;
}

/// A client that stops reading a sendfile'd body is cut off after the send
/// timeout, as on the write path; the gateway serves others meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_sendfile_body_is_cut_off() {
    let (_fx, gw, _) = site(BIG, "client: { send_timeout_ms: 300 }\n");
    let mut s = slow_client(&gw).await;
    s.write_all(GET_BIG).await.unwrap();
    let mut buf = Vec::new();
    read_at_least(&mut s, &mut buf, 64 << 10).await;
    // Never read again.
    soon("send timeout", || async {
        gw.logs().contains("client stopped reading the response")
    })
    .await;
    assert_eq!(gw.get("/small.txt").await.status, 200);
    // The connection was closed: what is buffered drains, then EOF (or a
    // reset), well short of the file.
    let closed = read_to_close(&mut s, &mut buf, Duration::from_secs(10)).await;
    assert!(closed, "closed by the gateway");
    assert!(buf.len() < BIG, "cut off before the end");
}

/// The gateway's queue (unsent + unacknowledged bytes, `tx_queue`) of the
/// connection from the gateway's `port` to the client's `peer` port.
fn tx_queue(port: u16, peer: u16) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let local = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
        let remote = u16::from_str_radix(f[2].rsplit(':').next()?, 16).ok()?;
        (local == port && remote == peer)
            .then(|| u64::from_str_radix(f[4].split(':').next()?, 16).ok())
            .flatten()
    })
}

/// A client that asks for a big file and reads nothing: the kernel holds
/// little of it for that connection (`TCP_NOTSENT_LOWAT`, set by the
/// sendfile path: at most 32 KiB not yet sent, plus what is in flight in
/// the client's small window), where a plain send buffer takes megabytes
/// per stalled reader (`tcp_wmem` autotuning: ~4 MiB here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_holds_little_kernel_memory() {
    let (_fx, gw, _big) = site(BIG, "");
    let mut s = slow_client(&gw).await;
    let peer = s.local_addr().unwrap().port();
    s.write_all(GET_BIG).await.unwrap();
    // Until the gateway's queue for it stops growing (the send waits).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut last, mut since) = (0, std::time::Instant::now());
    loop {
        let q = tx_queue(gw.addr.port(), peer).expect("the connection in /proc/net/tcp");
        if q != last {
            (last, since) = (q, std::time::Instant::now());
        } else if q > 0 && since.elapsed() > Duration::from_millis(300) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queue never settled: {q}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        last <= 256 << 10,
        "{last} bytes queued in the kernel for a reader that reads nothing"
    );
    // It is still served once it reads.
    let mut buf = Vec::new();
    let (head, body) = tokio::time::timeout(Duration::from_secs(60), read_one(&mut s, &mut buf))
        .await
        .expect("the whole file within a minute");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body.len(), BIG);
}

/// Descriptors of process `pid` open on `file`, a deleted one included
/// (its link then reads `… (deleted)`).
fn fds_on(pid: u32, file: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().contains(file))
        .count()
}

/// A gateway holding `site/formal/big.bin` (`size` bytes, within the content
/// cache) with entries checked against the disk every `valid_ms`.
fn held_site(size: usize, valid_ms: u64) -> (Fixture, Gateway, Vec<u8>) {
    let fx = Fixture::new();
    let big = pattern(size);
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    std::fs::write(fx.path("site/formal/big.bin"), &big).unwrap();
    let gw = Config::new()
        .raw(&format!(
            "static_cache: {{ max_file_size: 1m, valid_ms: {valid_ms} }}\n"
        ))
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    (fx, gw, big)
}

/// A whole file whose content the cache holds (from `SENDFILE_MIN` up to
/// `max_file_size`) goes out by sendfile from one descriptor its cache entry
/// keeps (nginx's `open_file_cache`), not a new `open` per answer. Each
/// answer checks the descriptor (`fstat`): once the file is rewritten in
/// place, the answers until the entry's next check (`valid_ms`) are the
/// cached version whole, from memory — never the disk's new bytes under the
/// cached validators.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_file_is_sent_from_one_kept_descriptor_checked_per_answer() {
    let (fx, gw, big) = held_site(300 << 10, 60_000);
    let first = gw.get("/big.bin").await;
    assert!(first.status == 200 && first.body[..] == big[..]);
    for i in 0..3 {
        let (rchar, _) = proc_io(gw.pid());
        let r = gw.get("/big.bin").await;
        assert!(r.status == 200 && r.body[..] == big[..], "answer {i}");
        assert!(
            proc_io(gw.pid()).0 - rchar >= big.len() as u64,
            "sent by sendfile (counted in rchar)"
        );
        // Between answers the entry keeps exactly one descriptor on it.
        assert_eq!(fds_on(gw.pid(), "big.bin"), 1, "one descriptor kept");
    }
    let mut rewritten = big.clone();
    rewritten.reverse();
    std::fs::write(fx.path("site/formal/big.bin"), &rewritten).unwrap();
    let r = gw.get("/big.bin").await;
    assert_eq!(r.header("etag"), first.header("etag"), "not yet checked");
    assert!(
        r.body[..] == big[..],
        "the disk's new bytes under the cached validators"
    );
    assert_eq!(fds_on(gw.pid(), "big.bin"), 1);
}

/// The kept descriptor follows the file's path: replaced by a rename or
/// deleted, the new bytes (or a 404) are served within a second (issue 19's
/// bound) and the old inode's descriptor is let go — a deleted file's space is not pinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_descriptor_follows_a_file_replaced_or_deleted() {
    let (fx, gw, big) = held_site(300 << 10, 200);
    let path = fx.path("site/formal/big.bin");
    for _ in 0..2 {
        assert!(gw.get("/big.bin").await.body[..] == big[..]);
    }
    assert_eq!(fds_on(gw.pid(), "big.bin"), 1, "one descriptor kept");
    let replaced = pattern(200 << 10);
    std::fs::write(fx.path("site/formal/big.bin.tmp"), &replaced).unwrap();
    std::fs::rename(fx.path("site/formal/big.bin.tmp"), &path).unwrap();
    eventually("replaced by a rename", Duration::from_secs(1), || async {
        gw.get("/big.bin").await.body[..] == replaced[..] && fds_on(gw.pid(), "big.bin") == 1
    })
    .await;
    std::fs::remove_file(&path).unwrap();
    eventually("deleted", Duration::from_secs(1), || async {
        gw.get("/big.bin").await.status == 404 && fds_on(gw.pid(), "big.bin") == 0
    })
    .await;
}
