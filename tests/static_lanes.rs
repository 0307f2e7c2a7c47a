//! Static-resource nodes: per-lane trees with per-file fallback to formal,
//! caching validators that never mix lanes, ranges, HEAD and traversal.

mod common;

use common::*;

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
    let cfg = fx.write(
        "gg.yaml",
        &main_config("script: lane.lua\nroutes:\n  - prefix: /\n    static: site\n"),
    );
    let gw = Gateway::start(&cfg);
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
