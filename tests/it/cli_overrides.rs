//! Command-line conveniences of issue 37: `--listen` and `--admin-listen`
//! override the configuration's addresses (quick runs), log lines carry the
//! process id (an upgrade's two processes share one journal), and a binary
//! in an installed tree defaults `--config` to its `etc/graygate`.

use std::process::Command;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_overrides_and_the_pid_in_log_lines() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    // The configured addresses are ports nothing listens on; the flags win.
    let configured = closed_port();
    let admin_configured = closed_port();
    let cfg = Config::empty()
        .listen(&configured.to_string())
        .set("admin_listen", admin_configured)
        .node_files(&["nodes.yaml"])
        .route_all("api")
        .write(&fx, "gg.yaml");
    let gw = Gateway::start_cmd(
        Command::new(env!("CARGO_BIN_EXE_graygate")),
        &cfg,
        &["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
    );
    assert_ne!(gw.addr, configured);
    assert_ne!(gw.admin_addr(), admin_configured);
    assert_eq!(gw.get("/api/x").await.status, 200);
    assert_eq!(gw.admin_get("/status").await.status, 200);
    let logs = gw.logs();
    let pid = format!("Z[{}] ", gw.pid());
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains("listening")).collect();
    assert!(!lines.is_empty(), "{logs}");
    for l in lines {
        assert!(l.contains(&pid), "no pid in {l:?}");
    }
}

#[test]
fn an_installed_binary_defaults_to_its_etc_config() {
    let root = tempfile::tempdir().unwrap();
    let bin = root.path().join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("graygate");
    std::fs::copy(env!("CARGO_BIN_EXE_graygate"), &exe).unwrap();
    let out = Command::new(&exe)
        .arg("--check")
        .current_dir(root.path())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let want = root.path().join("etc/graygate/graygate.yaml");
    assert!(
        text.contains(&want.display().to_string()),
        "not {want:?}: {text}"
    );
    // Elsewhere: the repository's example, relative.
    let help = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("config/graygate.yaml"));
}
