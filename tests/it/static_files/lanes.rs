//! Static-resource nodes: per-lane trees with per-file fallback to formal,
//! caching validators that never mix lanes, ranges, HEAD and traversal.

use crate::harness::*;

const LANE_SCRIPT: &str = "return function(req) return req:header('X-Lane') end\n";

fn setup() -> (Fixture, Gateway) {
    let fx = Fixture::new();
    fx.write("site/formal/index.html", "<h1>formal home</h1>\n");
    fx.write("site/gray/index.html", "<h1>GRAY home</h1>\n");
    fx.write("site/formal/app.css", "body { color: black }\n");
    fx.write("site/formal/app.js", "console.log('formal');\n");
    // Same size as formal's app.js: only the lane can tell them apart.
    fx.write("site/gray/app.js", "console.log('grayy!');\n");
    fx.write("site/formal/docs/index.html", "docs\n");
    fx.write("site/formal/data.bin", "0123456789abcdef");
    fx.write("secret.txt", "top secret\n");
    std::os::unix::fs::symlink(fx.path("secret.txt"), fx.path("site/gray/leak.txt")).unwrap();
    std::os::unix::fs::symlink(
        fx.path("site/formal/app.css"),
        fx.path("site/gray/alias.css"),
    )
    .unwrap();
    fx.write("lane.lua", LANE_SCRIPT);
    let gw = Config::new()
        .script("lane.lua")
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    (fx, gw)
}

fn gray(path: &str) -> Req {
    Req::get(path).header("X-Lane", "gray")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_tree_first_then_formal_per_file() {
    let (_fx, gw) = setup();
    let r = gw.get("/").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "<h1>formal home</h1>\n");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("text/html; charset=utf-8")
    );
    let r = gray("/").send(gw.addr).await;
    assert_eq!(r.text(), "<h1>GRAY home</h1>\n");
    // Only formal has app.css: gray falls back to it.
    let r = gray("/app.css").send(gw.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "body { color: black }\n");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("text/css; charset=utf-8")
    );
    let r = gray("/app.js").send(gw.addr).await;
    assert_eq!(r.text(), "console.log('grayy!');\n");
    assert!(r.header("content-type").unwrap().contains("javascript"));
    // A lane with no tree at all serves formal.
    let r = Req::get("/").header("X-Lane", "v9").send(gw.addr).await;
    assert_eq!(r.text(), "<h1>formal home</h1>\n");
    // Directory index and the redirect for a directory without its slash.
    assert_eq!(gw.get("/docs/").await.text(), "docs\n");
    let r = gw.get("/docs?x=1").await;
    assert_eq!(r.status, 301);
    assert_eq!(r.header("location").as_deref(), Some("/docs/?x=1"));
    assert_eq!(gw.get("/missing.png").await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etags_never_shared_across_lanes_and_conditional_requests_work() {
    let (_fx, gw) = setup();
    let formal = gw.get("/app.js").await;
    let grayr = gray("/app.js").send(gw.addr).await;
    let fe = formal.header("etag").unwrap();
    let ge = grayr.header("etag").unwrap();
    assert_ne!(fe, ge, "same URL, different lanes' files, same ETag");
    assert!(formal.header("last-modified").is_some());
    assert_eq!(
        formal.header("cache-control").as_deref(),
        Some("private, no-cache")
    );

    // Revalidation with the right lane's ETag: 304.
    let r = Req::get("/app.js")
        .header("If-None-Match", &fe)
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 304);
    assert!(r.body.is_empty());
    assert_eq!(r.header("etag").as_deref(), Some(fe.as_str()));
    // A client that cached the gray file and is now formal gets formal's file.
    let r = Req::get("/app.js")
        .header("If-None-Match", &ge)
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "console.log('formal');\n");
    // Fallback files keep formal's ETag (same bytes, shareable).
    let gcss = gray("/app.css").send(gw.addr).await.header("etag").unwrap();
    let fcss = gw.get("/app.css").await.header("etag").unwrap();
    assert_eq!(gcss, fcss);
    // If-Modified-Since.
    let lm = formal.header("last-modified").unwrap();
    let r = Req::get("/app.js")
        .header("If-Modified-Since", &lm)
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 304);
    let r = Req::get("/app.js")
        .header("If-Modified-Since", "Thu, 01 Jan 1998 00:00:00 GMT")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_and_head() {
    let (_fx, gw) = setup();
    let r = Req::get("/data.bin")
        .header("Range", "bytes=2-5")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 206);
    assert_eq!(r.text(), "2345");
    assert_eq!(r.header("content-range").as_deref(), Some("bytes 2-5/16"));
    let r = Req::get("/data.bin")
        .header("Range", "bytes=100-")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 416);
    // If-Range with a stale validator: the whole file.
    let r = Req::get("/data.bin")
        .header("Range", "bytes=2-5")
        .header("If-Range", "\"formal-0-0.0\"")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "0123456789abcdef");
    let etag = gw.get("/data.bin").await.header("etag").unwrap();
    let r = Req::get("/data.bin")
        .header("Range", "bytes=0-1")
        .header("If-Range", &etag)
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 206);
    let r = Req::get("/data.bin").method("HEAD").send(gw.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length").as_deref(), Some("16"));
    assert!(r.body.is_empty());
    let r = Req::get("/data.bin").method("POST").send(gw.addr).await;
    assert_eq!(r.status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traversal_and_escaping_symlinks_are_404() {
    let (_fx, gw) = setup();
    for path in [
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/%2E%2E%2Fsecret.txt",
        "/..%2fsecret.txt",
        "/%252e%252e/secret.txt",
        "/..\\secret.txt",
        "/a%00.html",
        "/app.css%5c..%5c..%5csecret.txt",
    ] {
        let r = gray(path).send(gw.addr).await;
        assert_eq!(r.status, 404, "{path}");
        assert!(!r.text().contains("top secret"));
    }
    // A symlink leading out of the tree is missing; one inside is followed.
    let r = gray("/leak.txt").send(gw.addr).await;
    assert_eq!(r.status, 404);
    let r = gray("/alias.css").send(gw.addr).await;
    assert_eq!(r.status, 200);
}

/// Within a second of a change on disk, the gateway serves the disk: the
/// cache re-checks an entry older than `static_cache.valid_ms` (500 ms).
const FRESH: std::time::Duration = std::time::Duration::from_secs(1);

async fn text_of(gw: &Gateway, req: Req) -> (u16, String) {
    let r = req.send(gw.addr).await;
    (r.status, r.text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_replaced_or_deleted_on_disk_are_served_new_within_a_second() {
    let (fx, gw) = setup();
    // Cached first (twice: a hit), then changed three ways.
    for _ in 0..2 {
        assert_eq!(gw.get("/app.css").await.text(), "body { color: black }\n");
        assert_eq!(
            gray("/app.js").send(gw.addr).await.text(),
            "console.log('grayy!');\n"
        );
        assert_eq!(gw.get("/data.bin").await.text(), "0123456789abcdef");
    }
    let old_etag = gw.get("/app.css").await.header("etag").unwrap();
    // In place, same size: only the validators tell.
    fx.write("site/formal/app.css", "body { color: white }\n");
    // An editor's save: a new file renamed over the old one.
    fx.write_rename("site/gray/app.js", "console.log('GRAY2');\n");
    std::fs::remove_file(fx.path("site/formal/data.bin")).unwrap();
    eventually("the changes on disk served", FRESH, || async {
        let css = gw.get("/app.css").await;
        let js = gray("/app.js").send(gw.addr).await;
        let bin = gw.get("/data.bin").await;
        css.text() == "body { color: white }\n"
            && css.header("etag").unwrap() != old_etag
            && js.text() == "console.log('GRAY2');\n"
            && bin.status == 404
    })
    .await;
    // And a file created where there was none.
    fx.write("site/formal/new.txt", "new\n");
    eventually("a new file served", FRESH, || async {
        text_of(&gw, Req::get("/new.txt")).await == (200, "new\n".into())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_is_cached_apart_from_the_lanes_own_file() {
    let (fx, gw) = setup();
    // gray has no app.css: formal's, cached for gray and for formal.
    let g = gray("/app.css").send(gw.addr).await;
    assert_eq!(g.text(), "body { color: black }\n");
    let formal_etag = g.header("etag").unwrap();
    assert!(formal_etag.starts_with("\"formal-"), "{formal_etag}");
    assert_eq!(
        gw.get("/app.css").await.header("etag").unwrap(),
        formal_etag
    );
    // gray gets its own app.css: gray serves it (its own ETag), formal keeps
    // formal's.
    fx.write("site/gray/app.css", "body { color: gray }\n");
    eventually("gray's own app.css served", FRESH, || async {
        let r = gray("/app.css").send(gw.addr).await;
        r.text() == "body { color: gray }\n"
            && r.header("etag").is_some_and(|e| e.starts_with("\"gray-"))
    })
    .await;
    for _ in 0..3 {
        let f = gw.get("/app.css").await;
        assert_eq!(f.text(), "body { color: black }\n");
        assert_eq!(f.header("etag").unwrap(), formal_etag);
    }
    // Removed again: gray falls back to formal once more.
    std::fs::remove_file(fx.path("site/gray/app.css")).unwrap();
    eventually("gray back on formal's app.css", FRESH, || async {
        gray("/app.css").send(gw.addr).await.header("etag") == Some(formal_etag.clone())
    })
    .await;
}

/// The parts of a multipart/byteranges body: (Content-Range, bytes).
fn multipart(r: &Resp) -> Vec<(String, Vec<u8>)> {
    let ct = r.header("content-type").unwrap();
    let boundary = ct
        .split("boundary=")
        .nth(1)
        .expect("a boundary")
        .to_string();
    let delim = format!("--{boundary}");
    let body = &r.body[..];
    let mut parts = Vec::new();
    let find = |hay: &[u8], needle: &[u8], from: usize| {
        hay[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let mut at = find(body, delim.as_bytes(), 0).expect("first delimiter");
    loop {
        at += delim.len();
        if body[at..].starts_with(b"--") {
            assert_eq!(&body[at..], b"--\r\n", "epilogue");
            return parts;
        }
        let head_end = find(body, b"\r\n\r\n", at).unwrap();
        let head = String::from_utf8_lossy(&body[at..head_end]).to_string();
        let range = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Range: "))
            .expect("a Content-Range")
            .to_string();
        let next = find(body, format!("\r\n{delim}").as_bytes(), head_end).unwrap();
        parts.push((range, body[head_end + 4..next].to_vec()));
        at = next + 2;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_larger_than_the_cache_limit_are_served_whole_and_in_ranges() {
    let fx = Fixture::new();
    // 300 KB: beyond max_file_size, read in 64 KiB chunks per request.
    let big = pattern(300_000);
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    std::fs::write(fx.path("site/formal/big.bin"), &big).unwrap();
    fx.write("site/formal/small.txt", "0123456789abcdef");
    let gw = Config::new()
        .raw("static_cache: { max_size: 128k, max_file_size: 64k, valid_ms: 200 }\n")
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    for _ in 0..2 {
        let r = gw.get("/big.bin").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-length").as_deref(), Some("300000"));
        assert!(r.body[..] == big[..], "whole big file");
    }
    // A range across chunk boundaries, a suffix, an open end.
    for (spec, start, end) in [
        ("bytes=65000-200000", 65_000, 200_000),
        ("bytes=-10", 299_990, 299_999),
        ("bytes=299000-", 299_000, 299_999),
    ] {
        let r = Req::get("/big.bin")
            .header("Range", spec)
            .send(gw.addr)
            .await;
        assert_eq!(r.status, 206, "{spec}");
        assert_eq!(
            r.header("content-range").unwrap(),
            format!("bytes {start}-{end}/300000")
        );
        assert!(r.body[..] == big[start..=end], "{spec}");
    }
    // Multi-range, from disk and from memory.
    let r = Req::get("/big.bin")
        .header("Range", "bytes=0-9,100000-165535,-5")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 206);
    assert_eq!(
        r.header("content-length").unwrap(),
        r.body.len().to_string()
    );
    let parts = multipart(&r);
    assert_eq!(parts.len(), 3);
    assert_eq!(parts[0], ("bytes 0-9/300000".into(), big[..10].to_vec()));
    assert_eq!(parts[1].0, "bytes 100000-165535/300000");
    assert!(parts[1].1 == big[100_000..165_536]);
    assert_eq!(
        parts[2],
        ("bytes 299995-299999/300000".into(), big[299_995..].to_vec())
    );
    let r = Req::get("/small.txt")
        .header("Range", "bytes=1-2,10-")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 206);
    assert_eq!(
        multipart(&r),
        vec![
            ("bytes 1-2/16".into(), b"12".to_vec()),
            ("bytes 10-15/16".into(), b"abcdef".to_vec())
        ]
    );
    // Ranges adding up to more than the file: the whole file, once.
    let r = Req::get("/small.txt")
        .header("Range", "bytes=0-,0-,0-")
        .send(gw.addr)
        .await;
    assert_eq!((r.status, r.text().as_str()), (200, "0123456789abcdef"));
    let r = Req::get("/small.txt")
        .header("Range", "bytes=16-")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 416);
    assert_eq!(r.header("content-range").as_deref(), Some("bytes */16"));
    // HEAD of the big file: its length and type, no body.
    let r = Req::get("/big.bin").method("HEAD").send(gw.addr).await;
    assert_eq!(r.header("content-length").as_deref(), Some("300000"));
    assert!(r.body.is_empty());
    // Replaced on disk by a smaller file: served new, never the old length.
    let small = pattern(70_000);
    std::fs::write(fx.path("site/formal/big.tmp"), &small[..]).unwrap();
    std::fs::rename(
        fx.path("site/formal/big.tmp"),
        fx.path("site/formal/big.bin"),
    )
    .unwrap();
    eventually("the new big.bin served", FRESH, || async {
        let r = gw.get("/big.bin").await;
        r.status == 200 && r.body[..] == small[..]
    })
    .await;
}

#[test]
fn bad_static_cache_settings_are_rejected_with_their_line() {
    let fx = Fixture::new();
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    for (cache, line, needle) in [
        ("static_cache:\n  max_size: lots\n", 5, "max_size"),
        (
            "static_cache:\n  max_size: 1m\n  max_file_size: 2m\n",
            6,
            "exceeds max_size",
        ),
        ("static_cache:\n  max_entries: 3\n", 5, "max_entries"),
        ("static_cache:\n  valid_ms: 600000\n", 5, "valid_ms"),
        ("static_cache:\n  max_bytes: 1m\n", 5, "unknown field"),
    ] {
        let cfg = fx.write(
            "gg.yaml",
            &main_config(&format!(
                "{cache}routes:\n  - prefix: /\n    static: site\n"
            )),
        );
        let e = load_config(&cfg).unwrap_err();
        assert_eq!(e.line, Some(line), "{cache}: {e}");
        assert!(e.message.contains(needle), "{cache}: {e}");
    }
    let e = rejected_route(&fx, "    cache_control: \"a\\nb\"\n");
    assert!(e.message.contains("cache_control"), "{e}");
    assert_eq!(e.line, Some(7), "{e}");
}

/// Whole files from 64 KiB on go out by sendfile(2) on plain HTTP/1.1
/// connections, whether the cache holds them or not: pipelined requests on
/// one keep-alive connection get exact bodies one after another (the head
/// then the file, nothing more), HEAD gets none, a lane's own file and the
/// formal fallback each their own bytes, and a file replaced on disk is
/// sent new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_whole_files_go_out_by_sendfile_on_a_kept_alive_connection() {
    use tokio::io::AsyncWriteExt;
    let fx = Fixture::new();
    let cached = pattern(600_000);
    let mut gray_own = pattern(300_000);
    gray_own.reverse();
    let on_disk = pattern(1_500_000);
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    std::fs::create_dir_all(fx.path("site/gray")).unwrap();
    std::fs::write(fx.path("site/formal/cached.bin"), &cached).unwrap();
    std::fs::write(fx.path("site/formal/own.bin"), &cached[..300_000]).unwrap();
    std::fs::write(fx.path("site/gray/own.bin"), &gray_own).unwrap();
    std::fs::write(fx.path("site/formal/disk.bin"), &on_disk).unwrap();
    fx.write("lane.lua", LANE_SCRIPT);
    let gw = Config::new()
        .script("lane.lua")
        .raw("static_cache: { max_size: 4m, max_file_size: 1m, valid_ms: 200 }\n")
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = |path: &str, method: &str, lane: &str| {
        format!("{method} {path} HTTP/1.1\r\nHost: t\r\nX-Lane: {lane}\r\n\r\n")
    };
    let mut all = String::new();
    for _ in 0..2 {
        all += &req("/cached.bin", "GET", "formal");
        all += &req("/disk.bin", "GET", "formal");
        all += &req("/own.bin", "GET", "gray");
        all += &req("/own.bin", "GET", "formal");
        all += &req("/cached.bin", "GET", "gray"); // fallback
    }
    s.write_all(all.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    for round in 0..2 {
        for (want, what) in [
            (&cached[..], "cached"),
            (&on_disk[..], "disk"),
            (&gray_own[..], "gray's own"),
            (&cached[..300_000], "formal's own"),
            (&cached[..], "fallback"),
        ] {
            let (head, body) = read_one(&mut s, &mut buf).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{what} #{round}: {head}");
            assert_eq!(body.len(), want.len(), "{what} #{round}");
            assert!(body == want, "{what} #{round}: bytes differ");
        }
    }
    // HEAD: the head only; the next response follows it directly.
    let both = req("/cached.bin", "HEAD", "formal") + &req("/own.bin", "GET", "gray");
    s.write_all(both.as_bytes()).await.unwrap();
    let end = loop {
        if let Some(e) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break e;
        }
        let mut chunk = vec![0u8; 4096];
        let n = tokio::io::AsyncReadExt::read(&mut s, &mut chunk)
            .await
            .unwrap();
        assert!(n > 0);
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    assert!(head.contains("content-length: 600000"), "{head}");
    buf.drain(..end + 4);
    let (_, body) = read_one(&mut s, &mut buf).await;
    assert!(body == gray_own, "after HEAD");
    assert!(buf.is_empty(), "nothing after the last body");
    // Replaced on disk: sent new.
    let newer = pattern(700_000).into_iter().rev().collect::<Vec<u8>>();
    std::fs::write(fx.path("site/formal/cached.bin.tmp"), &newer).unwrap();
    std::fs::rename(
        fx.path("site/formal/cached.bin.tmp"),
        fx.path("site/formal/cached.bin"),
    )
    .unwrap();
    eventually("the replaced big file sent new", FRESH, || async {
        gw.get("/cached.bin").await.body[..] == newer[..]
    })
    .await;
}

/// `precompressed: [br, gzip]`: a client whose `Accept-Encoding` takes an
/// encoding gets the file's sibling (`.br`, `.gz`; the first the route
/// lists that the client takes) with `Content-Encoding`, the original's
/// type and the sibling's own validators; every answer of the tree varies
/// on `Accept-Encoding`. A sibling is only used from the file's own tree: a
/// gray file never gets formal's compressed bytes. curl decodes the gzip
/// sibling back to the file; a sibling deleted on disk stops being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precompressed_siblings_follow_accept_encoding_from_the_files_own_tree() {
    let fx = Fixture::new();
    let js = "console.log('formal, and long enough to be worth compressing');\n".repeat(20);
    fx.write("site/formal/app.js", &js);
    let gz = std::process::Command::new("gzip")
        .args(["-k", "-n", "-9"])
        .arg(fx.path("site/formal/app.js"))
        .status()
        .expect("gzip runs");
    assert!(gz.success());
    let gz_bytes = std::fs::read(fx.path("site/formal/app.js.gz")).unwrap();
    assert!(gz_bytes.len() < js.len());
    // The gateway never decodes: any bytes stand for a brotli file.
    fx.write("site/formal/app.js.br", "BROTLI BYTES");
    fx.write("site/gray/app.js", "console.log('gray');\n");
    fx.write("site/formal/plain.txt", "no siblings\n");
    fx.write("lane.lua", LANE_SCRIPT);
    let cfg = Config::new()
        .script("lane.lua")
        .raw("routes:\n  - prefix: /\n    static: site\n    precompressed: [br, gzip]\n")
        .write(&fx, "gg.yaml");
    let gw = Gateway::start(&cfg);
    let ae = |path: &str, v: &str| Req::get(path).header("Accept-Encoding", v);

    let identity = gw.get("/app.js").await;
    assert_eq!(identity.text(), js);
    assert_eq!(identity.header("content-encoding"), None);
    assert_eq!(identity.header("vary").as_deref(), Some("Accept-Encoding"));
    let js_type = identity.header("content-type").unwrap();
    assert!(js_type.contains("javascript"), "{js_type}");

    let br = ae("/app.js", "gzip, deflate, br").send(gw.addr).await;
    assert_eq!(br.status, 200);
    assert_eq!(br.text(), "BROTLI BYTES");
    assert_eq!(br.header("content-encoding").as_deref(), Some("br"));
    assert_eq!(br.header("content-type"), Some(js_type.clone()));
    assert_eq!(br.header("vary").as_deref(), Some("Accept-Encoding"));
    assert_ne!(br.header("etag"), identity.header("etag"));

    // Which encoding, by the client's list and q-values.
    for (accept, want) in [
        ("gzip", Some("gzip")),
        ("GZIP;q=0.5", Some("gzip")),
        ("br;q=0, gzip", Some("gzip")),
        ("*", Some("br")),
        ("*, br;q=0", Some("gzip")),
        ("br;q=0.0, gzip;q=0", None),
        ("identity", None),
        ("deflate", None),
    ] {
        let r = ae("/app.js", accept).send(gw.addr).await;
        assert_eq!(r.header("content-encoding").as_deref(), want, "{accept}");
        let body: &[u8] = match want {
            Some("br") => b"BROTLI BYTES",
            Some(_) => &gz_bytes,
            None => js.as_bytes(),
        };
        assert_eq!(&r.body[..], body, "{accept}");
    }

    // Gray has its own app.js and no siblings: formal's are not its bytes.
    let r = ae("/app.js", "br, gzip")
        .header("X-Lane", "gray")
        .send(gw.addr)
        .await;
    assert_eq!(r.text(), "console.log('gray');\n");
    assert_eq!(r.header("content-encoding"), None);
    // A file without siblings is served as it is.
    let r = ae("/plain.txt", "br, gzip").send(gw.addr).await;
    assert_eq!(
        (r.text().as_str(), r.header("content-encoding")),
        ("no siblings\n", None)
    );

    // Validators, HEAD and Range are the sibling's.
    let etag = br.header("etag").unwrap();
    let r = ae("/app.js", "br")
        .header("If-None-Match", &etag)
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 304);
    let r = ae("/app.js", "br").method("HEAD").send(gw.addr).await;
    assert_eq!(r.header("content-length").as_deref(), Some("12"));
    assert_eq!(r.header("content-encoding").as_deref(), Some("br"));
    let r = ae("/app.js", "gzip")
        .header("Range", "bytes=0-1")
        .send(gw.addr)
        .await;
    assert_eq!(r.status, 206);
    assert_eq!(&r.body[..], &gz_bytes[..2]);
    assert_eq!(
        r.header("content-range"),
        Some(format!("bytes 0-1/{}", gz_bytes.len()))
    );

    // A real client decodes the gzip sibling back to the file.
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "--compressed",
            "-H",
            "Accept-Encoding: gzip",
            "-D",
            "-",
        ])
        .arg(format!("http://{}/app.js", gw.addr))
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.to_ascii_lowercase().contains("content-encoding: gzip"),
        "{text}"
    );
    assert!(
        text.ends_with(&js),
        "curl did not decode the sibling: {text}"
    );

    // The sibling deleted: the file itself is served again.
    std::fs::remove_file(fx.path("site/formal/app.js.br")).unwrap();
    eventually("the deleted sibling no longer served", FRESH, || async {
        let r = ae("/app.js", "br, gzip").send(gw.addr).await;
        r.header("content-encoding").as_deref() == Some("gzip") && r.body[..] == gz_bytes[..]
    })
    .await;
}

/// The load error of a config whose one static route (on `site`) has
/// `extra` lines.
fn rejected_route(fx: &Fixture, extra: &str) -> LoadError {
    let cfg = Config::new()
        .routes(&[Route::static_dir("/", "site")])
        .raw(extra)
        .write(fx, "gg.yaml");
    load_config(&cfg).unwrap_err()
}

#[test]
fn an_unknown_precompressed_encoding_is_rejected_with_its_line() {
    let fx = Fixture::new();
    std::fs::create_dir_all(fx.path("site/formal")).unwrap();
    let e = rejected_route(&fx, "    precompressed: [br, lz4]\n");
    assert!(e.message.contains("lz4"), "{e}");
    assert_eq!(e.line, Some(7), "{e}");
}

/// A file of 64 KiB or more held in memory goes to an HTTP/2 client from
/// memory: only the plain HTTP/1.1 server can use `sendfile(2)`, so only it
/// touches the file. The proof: once the file is cached (a long `valid_ms`,
/// so no `stat` in between) its path becomes a FIFO, whose `open` would
/// block until a writer comes — the h2c answer must still come, whole. The
/// plain HTTP/1.1 server sends it by sendfile from the descriptor its cache
/// entry keeps (the original file's), never opening the FIFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_big_file_goes_to_http2_clients_from_memory_without_opening_it() {
    let fx = Fixture::new();
    let bytes = String::from_utf8(pattern(100 * 1024)).unwrap();
    fx.write("site/formal/big.txt", &bytes);
    let gw = Config::new()
        .raw("static_cache: { max_file_size: 1m, valid_ms: 60000 }\n")
        .listeners(&[Listener::h2c()])
        .routes(&[Route::static_dir("/", "site")])
        .start(&fx, "gg.yaml");
    let h2c = crate::harness::tls::listeners(&gw)[0];
    let url = format!("http://{h2c}/big.txt");
    let first = crate::harness::tls::curl(&["--http2-prior-knowledge"], &url);
    assert_eq!((first.ok, first.version.as_str()), (true, "2"));
    assert!(first.body == bytes, "first answer not the file");
    let path = fx.path("site/formal/big.txt");
    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success());
    let again = crate::harness::tls::curl(&["--http2-prior-knowledge", "--max-time", "5"], &url);
    assert_eq!(
        (again.ok, again.version.as_str()),
        (true, "2"),
        "h2c request hung"
    );
    assert!(
        again.body == bytes,
        "not served from memory: {:.80}",
        again.body
    );
    // The plain HTTP/1.1 server sends from the kept descriptor: no worker
    // stuck in `open` on the FIFO, the held bytes sent.
    let plain =
        crate::harness::tls::curl(&["--max-time", "5"], &format!("http://{}/big.txt", gw.addr));
    assert_eq!(
        (plain.ok, plain.version.as_str()),
        (true, "1.1"),
        "plain request hung"
    );
    assert!(
        plain.body == bytes,
        "plain: not the held file: {:.80}",
        plain.body
    );
}
