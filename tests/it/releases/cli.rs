//! `graygate release …`, the binary against real gateways (and, for the
//! exact requests of `finish`, against a recording backend): tables by
//! default and the API's JSON with `-o json`; the
//! gateway of `-c FILE` (its `admin_listen` and `admin_token`, a main file
//! or an etcd bootstrap), `--admin` winning, the default 127.0.0.1:9080,
//! stderr naming the gateway that answered; a file that names no usable
//! admin listener refused in one line naming it; `finish` and
//! `--relabel-nodes` as requests; a closed stdout (`| head -1`) ends the
//! command quietly.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use super::*;

/// What one `graygate` run printed, and how it ended.
struct Run {
    code: Option<i32>,
    out: String,
    err: String,
}

impl Run {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

/// A `graygate` command with none of the suite's environment deciding
/// the token.
fn graygate_cmd(args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_graygate"));
    cmd.args(args).env_remove("GRAYGATE_ADMIN_TOKEN");
    cmd
}

async fn run_cmd(mut cmd: tokio::process::Command) -> Run {
    let out = cmd.output().await.unwrap();
    let run = Run {
        code: out.status.code(),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(!run.err.contains("panicked"), "{}", run.err);
    run
}

async fn graygate(args: &[&str]) -> Run {
    run_cmd(graygate_cmd(args)).await
}

/// `graygate ARGS…` with its stdout a pipe whose reader is gone before
/// it starts: every write fails with EPIPE. (std's `output` keeps a
/// stdout that is set; tokio's would make it a pipe of its own.)
async fn to_a_closed_pipe(args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
            .args(&args)
            .env_remove("GRAYGATE_ADMIN_TOKEN")
            .stdout(writer)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let run = Run {
        code: out.status.code(),
        out: String::new(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(!run.err.contains("panicked"), "{}", run.err);
    run
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The row of `table` whose first cell is `name`, split on the column gaps.
fn row<'a>(table: &'a str, name: &str) -> Vec<&'a str> {
    let line = table
        .lines()
        .find(|l| l.split("  ").next() == Some(name))
        .unwrap_or_else(|| panic!("no row {name} in\n{table}"));
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_command_line_drives_the_admin_api() {
    let s = setup(0).await;
    let admin = s.gw.admin.unwrap().to_string();
    let spec = s.fx.write(
        "rel.yaml",
        "name: cli\nlane: gray\nsteps:\n  - { weight: 5 }\n  - { weight: 50 }\nanalysis: { interval_ms: 100000 }\n",
    );
    let release = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["release"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--admin", &admin]);
        all.iter().map(|a| a.to_string()).collect()
    };
    let run = |args: &[&str]| {
        let args = release(args);
        async move { graygate(&args.iter().map(String::as_str).collect::<Vec<_>>()).await }
    };
    let answered = format!("graygate at {admin} (--admin)\n");

    // Actions: one line each, what the release is at now.
    let r = run(&["create", path(&spec)]).await;
    assert!(r.ok(), "{}{}", r.out, r.err);
    assert_eq!(
        r.out,
        "release cli created: progressing at step 0 (of 2, from 0), weight 5%\n"
    );
    assert_eq!(r.err, answered);

    // list: a table, the header and a row.
    let r = run(&["list"]).await;
    assert!(r.ok(), "{}", r.err);
    let header: Vec<&str> = r.out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "LANE", "STATE", "STEP", "WEIGHT", "FAILURES", "LAST"]
    );
    assert_eq!(
        row(&r.out, "cli"),
        [
            "cli",
            "gray",
            "progressing",
            "0 (of 2, from 0)",
            "5%",
            "0",
            "created: first step applied"
        ]
    );
    // -o json / --output json: the API's document as it came.
    let api = s.gw.admin_get("/releases").await.text();
    for flag in ["-o", "--output"] {
        let r = run(&["list", flag, "json"]).await;
        assert!(r.ok(), "{}", r.err);
        assert_eq!(r.out.trim_end(), api.trim_end());
        assert_eq!(r.err, answered);
    }

    // show: the header block, then the decisions as rows.
    let r = run(&["show", "cli"]).await;
    assert!(r.ok(), "{}", r.err);
    for line in [
        "name:     cli",
        "lane:     gray",
        "routes:   /",
        "state:    progressing",
        "step:     0 (of 2, from 0)",
        "weight:   5%",
        "failures: 0",
    ] {
        assert!(r.out.lines().any(|l| l == line), "{line:?} in\n{}", r.out);
    }
    let decisions: Vec<&str> = r
        .out
        .lines()
        .skip_while(|l| !l.starts_with("TIME"))
        .collect();
    assert_eq!(decisions.len(), 2, "{}", r.out);
    let created: Vec<&str> = decisions[1].split_whitespace().collect();
    assert_eq!(created[1..4], ["0", "5%", "step"], "{}", r.out);
    assert!(decisions[1].ends_with("created: first step applied"));
    let r = run(&["show", "cli", "-o", "json"]).await;
    let doc: serde_json::Value = serde_json::from_str(&r.out).unwrap();
    assert_eq!(doc["analyses"][0]["outcome"], "step", "{}", r.out);

    let r = run(&["pause", "cli"]).await;
    assert!(r.ok(), "{}", r.err);
    assert_eq!(
        r.out,
        "release cli paused: paused at step 0 (of 2, from 0), weight 5%\n"
    );
    let r = run(&["resume", "cli", "-o", "json"]).await;
    assert!(r.ok(), "{}", r.err);
    let doc: serde_json::Value = serde_json::from_str(&r.out).unwrap();
    assert_eq!(doc["state"], "progressing", "{}", r.out);
    // A running release is not finished: the gateway's 409, exit 1.
    let r = run(&["finish", "cli"]).await;
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert!(r.err.contains("graygate release: 409: "), "{}", r.err);
    let r = run(&["abort", "cli"]).await;
    assert!(r.ok(), "{}", r.err);
    assert!(
        r.out
            .starts_with("release cli aborted: rolled_back at step 0 (of 2, from 0), weight 0%"),
        "{}",
        r.out
    );

    // A refused action fails with the API's answer, naming the gateway.
    let r = run(&["resume", "cli"]).await;
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert!(r.err.starts_with(&answered), "{}", r.err);
    assert!(r.err.contains("graygate release: 409: "), "{}", r.err);
    assert!(r.out.is_empty(), "{}", r.out);
    let r = run(&["show", "nope"]).await;
    assert_eq!(r.code, Some(1));
    assert!(r.err.contains("404"), "{}", r.err);

    // finish: a rolled-back release lets go of its lane and name.
    let r = run(&["finish", "cli"]).await;
    assert!(r.ok(), "{}", r.err);
    assert_eq!(
        r.out,
        "release cli finished: finished at step 0 (of 2, from 0), weight 0%\n"
    );
    let r = run(&["list"]).await;
    assert_eq!(row(&r.out, "cli")[2], "finished", "{}", r.out);
    // --relabel-nodes reaches the gateway: a promoted release's nodes
    // become formal in the node file, the old formal ones drain.
    let spec = s.fx.write(
        "rel2.yaml",
        "name: cli2\nlane: gray\nsteps:\n  - { weight: 5 }\nanalysis: { interval_ms: 100000 }\n",
    );
    assert!(run(&["create", path(&spec)]).await.ok());
    let r = run(&["promote", "cli2"]).await;
    assert!(r.ok(), "{}", r.err);
    assert!(
        r.out.starts_with("release cli2 promoted: promoted at step"),
        "{}",
        r.out
    );
    let r = run(&["finish", "cli2", "--relabel-nodes"]).await;
    assert!(r.ok(), "{}", r.err);
    assert!(
        r.out.starts_with("release cli2 finished: finished"),
        "{}",
        r.out
    );
    let nodes = std::fs::read_to_string(s.fx.path("nodes.yaml")).unwrap();
    assert!(
        !nodes.contains("lane: gray") && nodes.contains("drain: true"),
        "{nodes}"
    );

    // A reader gone before the answer (`| head -1`): quiet, exit 0.
    for args in [&["list"][..], &["show", "cli"], &["list", "-o", "json"]] {
        let r =
            to_a_closed_pipe(&release(args).iter().map(String::as_str).collect::<Vec<_>>()).await;
        assert!(r.ok(), "{args:?}: {:?} {}", r.code, r.err);
    }
}

/// A gateway whose admin listener is on a port of the test's choosing
/// (another process may take a free port first: then another one).
fn gateway_on_a_known_admin_port(fx: &Fixture, extra: &str) -> (Gateway, u16) {
    for _ in 0..5 {
        let port = free_port();
        Config::new()
            .set("workers", 1)
            .set("admin_listen", format!("127.0.0.1:{port}"))
            .raw(extra)
            .write(fx, "gg.yaml");
        if let Ok(gw) = Gateway::try_start(&fx.path("gg.yaml")) {
            return (gw, port);
        }
    }
    panic!("no admin port could be bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dash_c_talks_to_the_admin_listener_of_that_gateway_with_its_token() {
    let formal = Backend::text("formal", 0, StatusCode::OK).await;
    let gray = Backend::text("gray", 0, StatusCode::OK).await;
    let fx = Fixture::new();
    release_nodes(&formal, &gray).write(&fx, "nodes.yaml");
    let (_gw, port) = gateway_on_a_known_admin_port(
        &fx,
        "admin_token: s3cret\nnode_files: [nodes.yaml]\nroutes:\n  - { prefix: /api/, service: api }\n",
    );
    let config = fx.path("gg.yaml");
    let config = path(&config);
    let spec = fx.write(
        "rel.yaml",
        "name: web\nlane: gray\nroutes: [/api/]\nsteps:\n  - { weight: 20 }\nanalysis: { interval_ms: 100000 }\n",
    );
    let answered = format!("graygate at 127.0.0.1:{port} (from {config})\n");

    // The file's admin_listen and admin_token: no --admin, no --token.
    let r = graygate(&["release", "-c", config, "create", path(&spec)]).await;
    assert!(r.ok(), "{}{}", r.out, r.err);
    assert_eq!(r.err, answered);
    assert!(
        r.out.starts_with("release web created: progressing"),
        "{}",
        r.out
    );
    // --config after the action, and before the command as `nginx -c`.
    for args in [
        &["release", "list", "--config", config][..],
        &["-c", config, "release", "list"],
    ] {
        let r = graygate(args).await;
        assert!(r.ok(), "{args:?}: {}", r.err);
        assert_eq!(r.err, answered);
        assert_eq!(row(&r.out, "web")[..3], ["web", "gray", "progressing"]);
    }

    // --token, and the environment, win over the file's token.
    let r = graygate(&["release", "-c", config, "list", "--token", "wrong"]).await;
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert!(r.err.contains("graygate release: 401"), "{}", r.err);
    let mut cmd = graygate_cmd(&["release", "-c", config, "list"]);
    cmd.env("GRAYGATE_ADMIN_TOKEN", "wrong");
    let r = run_cmd(cmd).await;
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert!(r.err.contains("401"), "{}", r.err);

    // --admin wins over the file's listener (here, nothing listens).
    let closed = closed_port().to_string();
    let r = graygate(&["release", "-c", config, "--admin", &closed, "list"]).await;
    assert_eq!(r.code, Some(1));
    assert!(
        r.err.starts_with(&format!(
            "graygate release: cannot reach graygate at {closed} (--admin): "
        )),
        "{}",
        r.err
    );
    assert_eq!(r.err.lines().count(), 1, "{}", r.err);

    // An etcd bootstrap names the admin listener the same way (its token
    // is in etcd: --token). A wildcard listener is reached on loopback.
    let boot = fx.write(
        "boot.yaml",
        &format!("listen: 127.0.0.1:0\nadmin_listen: 0.0.0.0:{port}\netcd:\n  endpoints: [http://127.0.0.1:2379]\n  prefix: /graygate\n  cache_dir: cache\n"),
    );
    let r = graygate(&[
        "release",
        "-c",
        path(&boot),
        "--token",
        "s3cret",
        "show",
        "web",
    ])
    .await;
    assert!(r.ok(), "{}", r.err);
    assert_eq!(
        r.err,
        format!("graygate at 127.0.0.1:{port} (from {})\n", path(&boot))
    );
    assert!(r.out.starts_with("name:     web\n"), "{}", r.out);
}

#[tokio::test]
async fn a_file_that_names_no_usable_admin_listener_is_refused_in_one_line() {
    let fx = Fixture::new();
    let missing = fx.path("missing.yaml");
    let cases = [
        (missing.clone(), "cannot read"),
        (
            fx.write("plain.yaml", "listen: 127.0.0.1:8000\n"),
            "no admin_listen",
        ),
        (
            fx.write(
                "boot.yaml",
                "listen: 127.0.0.1:8000\netcd: { endpoints: [http://127.0.0.1:2379], prefix: /g, cache_dir: c }\n",
            ),
            "no admin_listen",
        ),
        (
            fx.write("zero.yaml", "listen: 127.0.0.1:8000\nadmin_listen: 127.0.0.1:0\n"),
            "a port the system picks at start",
        ),
        (
            fx.write("list.yaml", "listen: 127.0.0.1:8000\nadmin_listen: [1, 2]\n"),
            ":2: admin_listen: invalid type: a list",
        ),
        (
            fx.write("typo.yaml", "listen: 127.0.0.1:8000\nadmin_listn: 127.0.0.1:9080\n"),
            "did you mean `admin_listen`?",
        ),
    ];
    for (file, want) in cases {
        let r = graygate(&["release", "-c", path(&file), "list"]).await;
        assert_eq!(r.code, Some(1), "{}: {}", file.display(), r.out);
        assert!(r.out.is_empty(), "{}", r.out);
        assert_eq!(r.err.lines().count(), 1, "{}", r.err);
        assert!(
            r.err
                .starts_with(&format!("graygate release: {}", file.display())),
            "{}",
            r.err
        );
        assert!(r.err.contains(want), "{want:?} in {}", r.err);
        for rust in ["struct", "SocketAddr", "Option", "Error {", "::"] {
            assert!(!r.err.contains(rust), "{rust:?} in {}", r.err);
        }
    }
    // Neither -c nor --admin: 127.0.0.1:9080, said whether or not a
    // gateway is there.
    let r = graygate(&["release", "list"]).await;
    assert!(r.err.contains("127.0.0.1:9080 (default)"), "{}", r.err);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_posts_to_the_release_and_a_refusal_fails_with_its_answer() {
    let node = Backend::text("", 0, StatusCode::OK).await;
    let admin = node.addr.to_string();
    let r = graygate(&["release", "finish", "web", "--admin", &admin]).await;
    assert!(r.ok(), "{}", r.err);
    assert_eq!(r.out, "release web: finished\n");
    let r = graygate(&[
        "release",
        "--admin",
        &admin,
        "finish",
        "web",
        "--relabel-nodes",
    ])
    .await;
    assert!(r.ok(), "{}", r.err);
    let seen: Vec<(String, String, Option<String>)> = node
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.method.clone(), s.path.clone(), s.query.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            ("POST".into(), "/releases/web/finish".into(), None),
            (
                "POST".into(),
                "/releases/web/finish".into(),
                Some("relabel_nodes=true".into())
            ),
        ]
    );
    // A refusal: its body on stderr, exit 1.
    let refusing = Backend::text(
        "release \"web\" is progressing: promote or abort it first",
        0,
        StatusCode::CONFLICT,
    )
    .await;
    let admin = refusing.addr.to_string();
    let r = graygate(&["release", "finish", "web", "--admin", &admin]).await;
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert!(r.out.is_empty(), "{}", r.out);
    assert_eq!(
        r.err,
        format!("graygate at {admin} (--admin)\ngraygate release: 409: release \"web\" is progressing: promote or abort it first\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_cut_short_by_its_reader_ends_quietly() {
    // Far more rows than a pipe holds: the reader takes one line and goes.
    let releases: Vec<serde_json::Value> = (0..5000)
        .map(|i| {
            serde_json::json!({
                "name": format!("r{i}"), "lane": format!("l{i}"), "state": "progressing",
                "step": 0, "steps": 3, "weight": 10, "failures": 0,
                "last": { "reason": "error rate 0.10% vs formal 0.09%: within 0.5 pp" },
            })
        })
        .collect();
    let doc = serde_json::json!({ "releases": releases, "source": "files" }).to_string();
    let node = Backend::text(&doc, 0, StatusCode::OK).await;
    let admin = node.addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_graygate"))
            .args(["release", "list", "--admin", &admin])
            .env_remove("GRAYGATE_ADMIN_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(first.starts_with("NAME"), "{first}");
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}
