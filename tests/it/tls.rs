//! TLS termination and HTTP/2 from clients, with real clients: curl over
//! TLS (`--http2`, `--http1.1`) and h2c, `openssl s_client` for SNI,
//! protocol versions and session resumption, certificate hot reload (a good
//! pair served to new connections, a broken or mismatched one rejected with
//! its file while the old one keeps serving).

use crate::harness::tls::*;
use crate::harness::*;

const SCRIPT: &str = r#"
return function(req)
  if req:header("x-probe") then
    local proto = ngx.var.server_protocol == "HTTP/2.0" and "h2" or "h1"
    return req.scheme .. "-" .. ngx.var.scheme .. "-" .. proto
  end
  if req:header("x-gray") == "1" then return "gray" end
  return nil
end
"#;

struct Setup {
    fx: Fixture,
    gw: Gateway,
    formal: Backend,
    gray: Backend,
    tls: std::net::SocketAddr,
    h2c: std::net::SocketAddr,
}

/// A gateway with a TLS listener (default cert for localhost, one for
/// api.example, a wildcard for *.wild.example) and a plain h2c listener.
async fn setup() -> Setup {
    let fx = Fixture::new();
    let [formal, gray] = backends([("f1", "formal"), ("g1", "gray")]).await;
    write_cert(&fx.path("certs"), "default", "localhost");
    write_cert(&fx.path("certs"), "api", "api.example");
    write_cert(&fx.path("certs"), "wild", "any.wild.example");
    fx.write("lane.lua", SCRIPT);
    fx.api_nodes(&[&formal, &gray]);
    fx.write("static/formal/index.html", "<h1>formal</h1>\n");
    fx.write("static/gray/index.html", "<h1>gray</h1>\n");
    let gw = Config::new()
        .script("lane.lua")
        .node_files(&["nodes.yaml"])
        .raw("access_log: { path: access.log, format: json }\n")
        .routes(&[
            Route::service("/api/", "api"),
            Route::static_dir("/", "static"),
        ])
        .listeners(&[
            Listener::tls()
                .cert("certs/default.crt", "certs/default.key")
                .cert_for("certs/api.crt", "certs/api.key", &["api.example"])
                .cert_for("certs/wild.crt", "certs/wild.key", &["*.wild.example"]),
            Listener::h2c(),
        ])
        .start(&fx, "graygate.yaml");
    let ls = listeners(&gw);
    assert_eq!(ls.len(), 2, "{}", gw.logs());
    Setup {
        tls: ls[0],
        h2c: ls[1],
        fx,
        gw,
        formal,
        gray,
    }
}

fn https(addr: std::net::SocketAddr, path: &str) -> String {
    format!("https://localhost:{}{path}", addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_over_h2_and_http1_routes_lanes_static_and_forwarded_proto() {
    let s = setup().await;
    // HTTP/2 by ALPN: same lanes as plain HTTP/1.1.
    let r = curl(&["--http2"], &https(s.tls, "/api/hello"));
    assert!(r.ok, "curl failed");
    assert_eq!(r.version, "2", "ALPN h2");
    let j: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(j["lane"], "formal");
    let seen = s.formal.last();
    assert_eq!(seen.header("x-forwarded-proto").as_deref(), Some("https"));
    assert_eq!(seen.header("x-gray-tag").as_deref(), Some("formal"));
    assert_eq!(
        seen.header("host"),
        Some(format!("localhost:{}", s.tls.port())),
        ":authority goes upstream as Host"
    );
    let r = curl(&["--http2", "-H", "X-Gray: 1"], &https(s.tls, "/api/hello"));
    assert_eq!(r.version, "2");
    assert!(r.body.contains("\"node\":\"g1\""), "{}", r.body);
    assert_eq!(s.gray.last().header("x-gray-tag").as_deref(), Some("gray"));
    // HTTP/1.1 over TLS.
    let r = curl(
        &["--http1.1", "-H", "X-Gray: 1"],
        &https(s.tls, "/api/hello"),
    );
    assert_eq!(r.version, "1.1");
    assert!(r.body.contains("\"node\":\"g1\""), "{}", r.body);
    assert_eq!(
        s.gray.last().header("x-forwarded-proto").as_deref(),
        Some("https")
    );
    // The script sees the scheme and protocol: req.scheme, ngx.var.scheme,
    // ngx.var.server_protocol.
    for (args, want) in [
        (vec!["--http2"], "https-https-h2"),
        (vec!["--http1.1"], "https-https-h1"),
    ] {
        let mut a = args.clone();
        a.extend(["-H", "X-Probe: 1"]);
        let r = curl(&a, &https(s.tls, "/api/probe"));
        assert!(r.ok);
        assert_eq!(s.formal.last().header("x-gray-tag").as_deref(), Some(want));
    }
    let r = curl(
        &["--http2-prior-knowledge", "-H", "X-Probe: 1"],
        &format!("http://127.0.0.1:{}/api/probe", s.h2c.port()),
    );
    assert_eq!(r.version, "2", "h2c with prior knowledge");
    assert_eq!(
        s.formal.last().header("x-gray-tag").as_deref(),
        Some("http-http-h2")
    );
    assert_eq!(
        s.formal.last().header("x-forwarded-proto").as_deref(),
        Some("http")
    );
    // Static files over h2, per lane.
    let r = curl(&["--http2"], &https(s.tls, "/"));
    assert_eq!(
        (r.version.as_str(), r.body.as_str()),
        ("2", "<h1>formal</h1>\n")
    );
    let r = curl(&["--http2", "-H", "X-Gray: 1"], &https(s.tls, "/"));
    assert_eq!(
        (r.version.as_str(), r.body.as_str()),
        ("2", "<h1>gray</h1>\n")
    );
    // Several streams on one connection, each its own request in metrics
    // and the access log.
    let url = https(s.tls, "/api/multi");
    let text = curl_h2_write_out(
        "%{http_version} %{num_connects}\n",
        &[],
        &[&url, &url, &url],
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("2 ")).count(),
        3,
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| *l == "2 0").count(),
        2,
        "one connection reused: {text}"
    );
    let metrics = s.gw.metrics().await;
    let served: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("graygate_requests_total{") && l.contains("route=\"/api/\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(served >= 9.0, "every stream counted: {served}\n{metrics}");
    let log_path = s.fx.path("access.log");
    soon("three access-log lines for /api/multi", || {
        let p = log_path.clone();
        async move {
            std::fs::read_to_string(&p)
                .map(|t| t.lines().filter(|l| l.contains("\"/api/multi\"")).count() == 3)
                .unwrap_or(false)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_chooses_the_certificate_with_a_default() {
    let s = setup().await;
    assert_eq!(served_cn(s.tls, Some("api.example")), "api.example");
    assert_eq!(
        served_cn(s.tls, Some("API.Example")),
        "api.example",
        "case-insensitive"
    );
    assert_eq!(
        served_cn(s.tls, Some("x.wild.example")),
        "any.wild.example",
        "wildcard"
    );
    assert_eq!(
        served_cn(s.tls, Some("other.example")),
        "localhost",
        "unknown name → default"
    );
    assert_eq!(served_cn(s.tls, None), "localhost", "no SNI → default");
    // And the chosen certificate is the one requests are served with.
    let out = std::process::Command::new("curl")
        .args(["-s", "--http2", "--cacert"])
        .arg(s.fx.path("certs/api.crt"))
        .args([
            "--resolve",
            &format!("api.example:{}:127.0.0.1", s.tls.port()),
        ])
        .arg(format!("https://api.example:{}/api/x", s.tls.port()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "verified against api.example's certificate"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"lane\":\"formal\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls12_tls13_and_session_resumption() {
    let s = setup().await;
    let req = "GET /api/x HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    for (flag, name) in [("-tls1_2", "TLSv1.2"), ("-tls1_3", "TLSv1.3")] {
        let sess = s.fx.path(&format!("sess{flag}"));
        let sess = sess.to_str().unwrap();
        let first = s_client(
            s.tls,
            &[flag, "-servername", "localhost", "-sess_out", sess],
            req,
        );
        assert!(
            first.contains(&format!("New, {name}")),
            "{name} handshake:\n{first}"
        );
        assert!(first.contains("200 OK"), "{first}");
        let second = s_client(
            s.tls,
            &[flag, "-servername", "localhost", "-sess_in", sess],
            req,
        );
        assert!(
            second.contains(&format!("Reused, {name}")),
            "{name} resumption:\n{second}"
        );
    }
    // ALPN offers h2 and http/1.1.
    let out = s_client(
        s.tls,
        &["-alpn", "h2,http/1.1", "-servername", "localhost"],
        "",
    );
    assert!(out.contains("ALPN protocol: h2"), "{out}");
    let out = s_client(
        s.tls,
        &["-alpn", "http/1.1", "-servername", "localhost"],
        "",
    );
    assert!(out.contains("ALPN protocol: http/1.1"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_needs_its_listener_switch() {
    let s = setup().await;
    let r = curl(
        &["--http1.1"],
        &format!("http://127.0.0.1:{}/api/x", s.h2c.port()),
    );
    assert_eq!(
        r.version, "1.1",
        "HTTP/1.1 still served on the h2c listener"
    );
    assert!(r.body.contains("\"lane\":\"formal\""));
    let r = curl(
        &["--http2-prior-knowledge"],
        &format!("http://127.0.0.1:{}/api/x", s.gw.addr.port()),
    );
    assert!(
        !r.ok || r.version != "2",
        "no h2c on the plain listener without h2c: true"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_and_bad_pairs_rejected_with_their_file() {
    let fx = Fixture::new();
    let formal = Backend::start("f1", "formal").await;
    write_cert(&fx.path("certs"), "site", "one.example");
    fx.api_nodes(&[&formal]);
    let cfg = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .listeners(&[Listener::tls().cert("certs/site.crt", "certs/site.key")])
        .write(&fx, "graygate.yaml");
    let gw = Gateway::start(&cfg);
    let tls = listeners(&gw)[0];
    assert_eq!(served_cn(tls, Some("localhost")), "one.example");
    let gen0 = gw.status().await["generation"].as_u64().unwrap();

    // A new pair: new connections get it (the watcher reloads).
    write_cert(&fx.path("certs"), "site", "two.example");
    soon("the new certificate is served", || async {
        served_cn(tls, Some("localhost")) == "two.example"
    })
    .await;
    let st = gw.status().await;
    assert!(st["generation"].as_u64().unwrap() > gen0);
    assert!(st["last_reload_error"].is_null(), "{st}");

    // A broken key: rejected naming the key file; the old pair serves on.
    let key = fx.write_rename(
        "certs/site.key",
        "-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n",
    );
    soon("broken key rejected", || async {
        let st = gw.status().await;
        st["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains(key.to_str().unwrap()))
    })
    .await;
    assert_eq!(
        served_cn(tls, Some("localhost")),
        "two.example",
        "old pair keeps serving"
    );
    let r = curl(&["--http2"], &format!("https://localhost:{}/x", tls.port()));
    assert!(
        r.body.contains("\"node\":\"f1\""),
        "requests still served: {}",
        r.body
    );

    // A mismatched pair (another certificate's key): rejected with the key
    // file and the reason.
    let other = fx.path("other");
    write_cert(&other, "o", "three.example");
    let rejected = gw.status().await["reloads_rejected"].as_u64().unwrap();
    let key_text = std::fs::read_to_string(other.join("o.key")).unwrap();
    fx.write_rename("certs/site.key", &key_text);
    soon("mismatched key rejected", || async {
        let st = gw.status().await;
        st["reloads_rejected"].as_u64().unwrap() > rejected
            && st["last_reload_error"]
                .as_str()
                .is_some_and(|e| e.contains("does not match") && e.contains("site.key"))
    })
    .await;
    assert_eq!(served_cn(tls, Some("localhost")), "two.example");
    // A broken certificate file names the certificate.
    write_cert(&fx.path("certs"), "site", "four.example");
    soon("good pair again", || async {
        served_cn(tls, Some("localhost")) == "four.example"
    })
    .await;
    let crt = fx.write_rename("certs/site.crt", "garbage\n");
    soon("broken certificate rejected", || async {
        let st = gw.status().await;
        st["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains(crt.to_str().unwrap()))
    })
    .await;
    assert_eq!(served_cn(tls, Some("localhost")), "four.example");
    // `--check` reports the same error with the file.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["--check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("site.crt"));
}

/// An HTTP/1.1 node behind TLS: answers `{node, tag, proto}` and counts
/// connections.
async fn tls_h1_node(
    name: &'static str,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(cert, key, &[]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let c = c.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let tag = req
                            .headers()
                            .get("x-gray-tag")
                            .map(|v| v.to_str().unwrap_or("").to_string());
                        let body = serde_json::json!({"node": name, "tag": tag}).to_string();
                        Ok::<_, std::convert::Infallible>(http::Response::new(full(body)))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, conns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_nodes_verified_by_ca_and_sni_or_insecure_for_tests() {
    let fx = Fixture::new();
    write_cert(&fx.path("certs"), "ip", "127.0.0.1");
    write_cert(&fx.path("certs"), "named", "node.internal");
    write_cert(&fx.path("certs"), "stranger", "stranger.example");
    let (ip_node, ip_conns) = tls_h1_node(
        "ip-node",
        &fx.path("certs/ip.crt"),
        &fx.path("certs/ip.key"),
    )
    .await;
    let (named_node, _) = tls_h1_node(
        "named-node",
        &fx.path("certs/named.crt"),
        &fx.path("certs/named.key"),
    )
    .await;
    let named = || Node::new("named-node", named_node);
    Nodes::new()
        .service(
            Service::new("by-ip")
                .set("tls", "{ ca: certs/ip.crt }")
                .node(Node::new("ip-node", ip_node)),
        )
        .service(
            Service::new("by-name")
                .set("tls", "{ ca: certs/named.crt, server_name: node.internal }")
                .node(named()),
        )
        .service(
            Service::new("insecure")
                .set("tls", "{ insecure_skip_verify: true }")
                .node(named()),
        )
        .service(
            Service::new("wrong-ca")
                .set("retries", 0)
                .set(
                    "tls",
                    "{ ca: certs/stranger.crt, server_name: node.internal }",
                )
                .node(named()),
        )
        .write(&fx, "nodes.yaml");
    let gw = Config::new()
        .set("workers", 1)
        .node_files(&["nodes.yaml"])
        .routes(&[
            Route::service("/ip/", "by-ip"),
            Route::service("/name/", "by-name"),
            Route::service("/insecure/", "insecure"),
            Route::service("/wrong/", "wrong-ca"),
        ])
        .start(&fx, "graygate.yaml");
    for _ in 0..5 {
        let r = gw.get("/ip/x").await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["node"], "ip-node");
        assert_eq!(r.json()["tag"], "formal", "lane tag over TLS");
    }
    assert_eq!(
        ip_conns.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the TLS connection is kept alive and reused"
    );
    assert_eq!(
        gw.get("/name/x").await.json()["node"],
        "named-node",
        "SNI + name verified"
    );
    assert_eq!(gw.get("/insecure/x").await.json()["node"], "named-node");
    let r = gw.get("/wrong/x").await;
    assert_eq!(
        r.status, 502,
        "a certificate the CA did not sign is refused"
    );
    // The insecure switch is logged.
    gw.wait_log("insecure_skip_verify").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_layout_changes_need_a_restart() {
    let s = setup().await;
    let cfg = s.fx.path("graygate.yaml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let changed = text.replace(
        "{ listen: 127.0.0.1:0, h2c: true }",
        "{ listen: 127.0.0.1:0, h2c: false }",
    );
    assert_ne!(text, changed);
    s.fx.write_rename("graygate.yaml", &changed);
    soon("layout change rejected", || async {
        s.gw.status().await["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("needs a restart") && e.contains("graygate.yaml"))
    })
    .await;
    // The running listeners are untouched.
    let r = curl(
        &["--http2-prior-knowledge"],
        &format!("http://127.0.0.1:{}/api/x", s.h2c.port()),
    );
    assert_eq!(r.version, "2");
    assert_eq!(curl(&["--http2"], &https(s.tls, "/api/x")).version, "2");
}

/// Whole files big enough for `sendfile` on plain HTTP/1.1 still go out
/// byte-exact where the socket is not plain: over TLS (HTTP/1.1 and
/// HTTP/2) and HTTP/2 over h2c, the body is streamed as frames (a file sent
/// past TLS or h2 framing would break the connection); plain HTTP/1.1 on
/// the h2c listener gets the same bytes by sendfile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_static_files_over_tls_and_h2_are_streamed_whole() {
    let s = setup().await;
    // 600 kB held by the content cache; 3 MB beyond it (read from disk).
    let files = [("cached.txt", 600_000), ("disk.txt", 3_000_000)];
    for (name, n) in files {
        std::fs::write(s.fx.path(&format!("static/formal/{name}")), pattern(n)).unwrap();
    }
    let h2c = |path: &str| format!("http://127.0.0.1:{}{path}", s.h2c.port());
    for (name, n) in files {
        let want = String::from_utf8(pattern(n)).unwrap();
        let path = format!("/{name}");
        for (args, url, version) in [
            (["--http2"], https(s.tls, &path), "2"),
            (["--http1.1"], https(s.tls, &path), "1.1"),
            (["--http2-prior-knowledge"], h2c(&path), "2"),
            (["--http1.1"], h2c(&path), "1.1"),
        ] {
            let r = curl(&args, &url);
            assert!(r.ok, "{url} {args:?}: curl failed");
            assert_eq!(r.version, version, "{url} {args:?}");
            assert_eq!(r.body.len(), n, "{url} {args:?}");
            assert!(r.body == want, "{url} {args:?}: bytes differ");
        }
    }
}

/// HTTP/1.1 over TLS runs on the same connection loop and codec as plain
/// HTTP/1.1: a 2 MB upload with `Expect: 100-continue` (curl's default for
/// a body that large) and a chunked one come back whole from an echoing
/// node; a head that never ends is cut at the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_over_tls_streams_uploads_and_keeps_the_header_timeout() {
    let fx = Fixture::new();
    let echo = Backend::start_mode("e", "formal", Mode::Echo).await;
    write_cert(&fx.path("certs"), "default", "localhost");
    fx.api_nodes(&[&echo]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .raw("client: { header_timeout_ms: 1500 }\n")
        .routes(&[Route::service("/", "api")])
        .listeners(&[Listener::tls().cert("certs/default.crt", "certs/default.key")])
        .start(&fx, "graygate.yaml");
    let tls = listeners(&gw)[0];
    let data = pattern(2_000_000);
    fx.write("upload.bin", std::str::from_utf8(&data).unwrap());
    let upload = format!("@{}", fx.path("upload.bin").display());
    for extra in [&[][..], &["-H", "Transfer-Encoding: chunked"][..]] {
        let mut args = vec!["--http1.1", "--data-binary", &upload];
        args.extend_from_slice(extra);
        let r = curl(&args, &https(tls, "/up"));
        assert!(r.ok, "{extra:?}: curl failed");
        assert_eq!(r.version, "1.1");
        assert!(
            r.body.as_bytes() == data,
            "{extra:?}: {} bytes came back",
            r.body.len()
        );
    }
    // A head that never ends: closed at the header timeout (the client's
    // read ends), not held open.
    let started = std::time::Instant::now();
    let out = s_client(
        tls,
        &["-quiet"],
        "GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: 1\r\n",
    );
    assert!(!out.contains("HTTP/1.1 200"), "{out}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "a slow head was held {:?}",
        started.elapsed()
    );
}

/// A TLS connection the gateway closes (after a `Connection: close`
/// answer, and an idle one at its timeout) ends with TLS's `close_notify`,
/// so a client reading to the close can tell it from a cut (Python's `ssl`
/// with ragged EOFs not suppressed raises on a close without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_tls_connections_end_with_close_notify() {
    let fx = Fixture::new();
    let node = Backend::start("n", "formal").await;
    write_cert(&fx.path("certs"), "default", "localhost");
    fx.api_nodes(&[&node]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .raw("client: { idle_timeout_ms: 1000 }\n")
        .routes(&[Route::service("/", "api")])
        .listeners(&[Listener::tls().cert("certs/default.crt", "certs/default.key")])
        .start(&fx, "graygate.yaml");
    let tls = listeners(&gw)[0];
    let script = r#"
import socket, ssl, sys
port, request = int(sys.argv[1]), sys.argv[2].encode().decode("unicode_escape").encode()
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
raw = socket.create_connection(("127.0.0.1", port), timeout=20)
s = ctx.wrap_socket(raw, server_hostname="localhost", suppress_ragged_eofs=False)
if request:
    s.sendall(request)
got = b""
try:
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    print("clean", got.split(b"\r\n")[0].decode() if got else "idle")
except ssl.SSLEOFError as e:
    print("cut", e)
"#;
    let run = |request: &str| {
        let out = std::process::Command::new("python3")
            .args(["-c", script, &tls.port().to_string(), request])
            .output()
            .expect("run python3");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let answered = run("GET /x HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n");
    assert!(answered.starts_with("clean HTTP/1.1 200"), "{answered}");
    // Nothing sent: closed at the idle timeout, with the alert too.
    let idle = run("");
    assert!(idle.starts_with("clean idle"), "{idle}");
}
