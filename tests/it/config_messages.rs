//! What `graygate --check` and the running gateway say about a
//! configuration: sizes with `k`, `m` or `g` wherever a size is read, and
//! errors in operators' words (no Rust type names, the close key for a
//! misspelled one, the release spec's file named). The real binary.

use std::process::Command;

use crate::harness::*;

/// `graygate --check --config <file>`: success, and what it printed.
fn check(config: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--check")
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

/// Words of Rust's type system an operator should never read.
const RUST_WORDS: &[&str] = &[
    "struct ",
    "enum ",
    "variant",
    "u32",
    "u64",
    "usize",
    "i64",
    "RulesConfig",
    "Some(",
    "None",
];

fn assert_operator_words(text: &str) {
    for w in RUST_WORDS {
        assert!(!text.contains(w), "{w:?} in {text}");
    }
}

#[test]
fn every_size_key_takes_k_m_and_g() {
    let fx = Fixture::new();
    let cfg = Config::new()
        .raw(
            "client: { max_header_bytes: 1k, max_uri_bytes: 2K }\n\
             upstream: { retry_buffer_bytes: 64k }\n\
             http2:\n  max_header_list_size: 16k\n  initial_stream_window_bytes: 256k\n  \
             initial_connection_window_bytes: 1m\n  max_frame_size: 16k\n\
             shared_dicts: { hits: 1m }\n\
             static_cache: { max_size: 1g, max_file_size: 512k }\n\
             script_limits: { memory_limit: 32m }\n",
        )
        .write(&fx, "graygate.yaml");
    let (ok, out) = check(&cfg);
    assert!(ok, "{out}");

    // A size that is none: the key's line, and what a size is.
    let bad = Config::new()
        .raw("client:\n  max_header_bytes: 1x\n")
        .write(&fx, "bad.yaml");
    let (ok, out) = check(&bad);
    assert!(!ok, "{out}");
    assert!(
        out.contains("bad.yaml:5: client.max_header_bytes: invalid value: string \"1x\", expected a size: bytes, or a number with k, m or g (64m)"),
        "{out}"
    );
    // Too large for the key.
    let big = Config::new()
        .raw("http2: { max_frame_size: 8g }\n")
        .write(&fx, "big.yaml");
    let (ok, out) = check(&big);
    assert!(!ok && out.contains("too large"), "{out}");
}

#[tokio::test]
async fn a_size_with_a_suffix_is_what_the_gateway_enforces() {
    let fx = Fixture::new();
    let gw = Config::new()
        .raw("client: { max_header_bytes: 1k }\n")
        .start(&fx, "graygate.yaml");
    let small = Req::get("/")
        .header("x-pad", &"a".repeat(200))
        .send(gw.addr)
        .await;
    assert_ne!(small.status, 431);
    let large = Req::get("/")
        .header("x-pad", &"a".repeat(1500))
        .send(gw.addr)
        .await;
    assert_eq!(large.status, 431);
}

#[test]
fn errors_name_no_rust_types_and_suggest_the_close_key() {
    let fx = Fixture::new();
    let cases: &[(&str, &str)] = &[
        // The issue's three (a list of rules is valid since the guide's
        // snippet may be pasted into the main file; a scalar is not).
        (
            "rules: 5\n",
            "g.yaml:4: rules: invalid type: integer `5`, expected a list of rules, or a mapping of",
        ),
        ("rules:\n  - lane: gray\n", "g.yaml:5: rules[0]: missing key `name`"),
        (
            "upstream: { retries: -1 }\n",
            "g.yaml:4: upstream.retries: invalid type: integer `-1`, expected a whole number, 0 or more",
        ),
        (
            "node_file: [nodes.yaml]\n",
            "g.yaml:4: unknown field `node_file` (did you mean `node_files`?)",
        ),
        // A misspelled value.
        (
            "access_log: { path: a.log, format: jsno }\n",
            "unknown value `jsno` (did you mean `json`?)",
        ),
        // A key with nothing after it.
        ("client:\n  idle_timeout_ms:\n", "invalid type: an empty value"),
        // `otel:` values, named with their line.
        (
            "otel:\n  traces:\n    endpoint: https://collector:4318/v1/traces\n",
            "g.yaml:6: otel.traces.endpoint \"https://collector:4318/v1/traces\": give an http:// URL",
        ),
        (
            "otel:\n  baggage_key: \"graygate lane\"\n",
            "g.yaml:5: otel.baggage_key \"graygate lane\" is not a baggage key",
        ),
        (
            "otel:\n  traces: { endpoint: \"http://c:4318/v1/traces\", sample_ratio: 2 }\n",
            "otel.traces.sample_ratio 2 must be between 0.0 and 1.0",
        ),
        ("otel: { trace: {} }\n", "unknown field `trace` (did you mean `traces`?)"),
    ];
    for (yaml, want) in cases {
        let cfg = Config::new().raw(yaml).write(&fx, "g.yaml");
        let (ok, out) = check(&cfg);
        assert!(!ok, "{yaml}: {out}");
        assert!(out.contains(want), "{yaml}: want {want:?} in {out}");
        assert_operator_words(&out.replace(&fx.dir.path().display().to_string(), ""));
    }
}

#[tokio::test]
async fn a_refused_release_spec_names_its_file_and_line() {
    let fx = Fixture::new();
    let gw = Config::new().start(&fx, "graygate.yaml");
    let file = fx.write(
        "canary.yaml",
        "name: canary\nlane: gray\nstep:\n  - { weight: 10 }\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(["release", "create", file.to_str().unwrap()])
        .args(["--admin", &gw.admin.unwrap().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "{}:3: unknown field `step` (did you mean `steps`?)",
            file.display()
        )),
        "{err}"
    );
}

#[tokio::test]
async fn the_log_names_an_admin_node_change_in_the_node_files_words() {
    let [f1] = backends([("f1", "formal")]).await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let gw = Config::new()
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .start(&fx, "graygate.yaml");
    let r = Req::get("/nodes/api/f1")
        .method("PATCH")
        .body(r#"{"weight":5,"drain":true}"#)
        .send(gw.admin_addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    gw.wait_log("node file changed through the admin API").await;
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("node file changed through the admin API"))
        .unwrap();
    assert!(
        line.contains("change=update f1: weight 5, drain true"),
        "{line}"
    );
    assert!(
        !line.contains("Update {") && !line.contains("Some("),
        "{line}"
    );
    // The file's path is written plainly.
    assert!(!line.contains("/./"), "{line}");
}

#[test]
fn a_tag_header_the_gateway_or_http_owns_is_refused_with_its_line() {
    let fx = Fixture::new();
    for (name, why) in [
        ("Host", "routes or frames the request"),
        ("Content-Length", "routes or frames the request"),
        ("Connection", "hop-by-hop"),
        ("X-Forwarded-For", "the gateway writes itself"),
        ("baggage", "the gateway writes itself"),
    ] {
        let cfg = Config::new()
            .set("tag_header", name)
            .write(&fx, "graygate.yaml");
        let (ok, out) = check(&cfg);
        assert!(!ok, "{name}: {out}");
        assert!(
            out.contains(&format!("graygate.yaml:4: tag_header {name:?} is ")),
            "{name}: {out}"
        );
        assert!(out.contains(why), "{name}: {out}");
        assert_operator_words(&out);
    }
    let cfg = Config::new()
        .set("tag_header", "X-Lane")
        .write(&fx, "graygate.yaml");
    let (ok, out) = check(&cfg);
    assert!(ok, "{out}");
}
