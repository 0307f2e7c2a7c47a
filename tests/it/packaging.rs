//! The Debian package, built from the repository by packaging/build-deb.sh
//! (plain dpkg-deb). To keep the test cheap it packages the debug binary the
//! suite already built (the script's default is `cargo build --release`),
//! its debug symbols stripped as for any package, uncompressed; the package is then inspected with `dpkg-deb -I/-c`,
//! unpacked with `dpkg-deb -x` (no root install, no systemd) and the
//! unpacked binary must pass `--check` on the packaged configuration and
//! serve on it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::*;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The packaging script of this checkout.
fn script() -> String {
    format!("{}/packaging/build-deb.sh", env!("CARGO_MANIFEST_DIR"))
}

fn build_package(out: &Path, extra: &[&str]) -> PathBuf {
    let deb = run(Command::new("bash")
        .arg(script())
        .args(extra)
        .args([
            "--binary",
            env!("CARGO_BIN_EXE_graygate"),
            "--compress",
            "none",
            "--out",
        ])
        .arg(out));
    PathBuf::from(deb.trim())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_package_holds_a_gateway_that_starts_on_its_config() {
    let work = tempfile::tempdir().unwrap();
    let deb = build_package(work.path(), &[]);
    let arch = run(Command::new("dpkg").arg("--print-architecture"));
    assert_eq!(
        deb.file_name().unwrap().to_string_lossy(),
        format!(
            "graygate_{}-1_{}.deb",
            env!("CARGO_PKG_VERSION"),
            arch.trim()
        )
    );

    // Control data.
    let info = run(Command::new("dpkg-deb").arg("-I").arg(&deb));
    for field in [
        "Package: graygate".to_string(),
        format!("Version: {}-1", env!("CARGO_PKG_VERSION")),
        format!("Architecture: {}", arch.trim()),
        "Depends: libc6".to_string(),
        "Recommends: logrotate".to_string(),
    ] {
        assert!(info.contains(&field), "no {field:?} in\n{info}");
    }
    let conffiles = run(Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .arg("conffiles"));
    for f in [
        "/etc/graygate/graygate.yaml",
        "/etc/graygate/nodes.yaml",
        "/etc/logrotate.d/graygate",
    ] {
        assert!(
            conffiles.lines().any(|l| l == f),
            "{f} not a conffile: {conffiles}"
        );
    }
    let postinst = run(Command::new("dpkg-deb").arg("-I").arg(&deb).arg("postinst"));
    assert!(
        postinst.contains("--signal=USR2"),
        "upgrade hands over: {postinst}"
    );

    // Contents: path → mode and owner.
    let listing = run(Command::new("dpkg-deb").arg("-c").arg(&deb));
    let entry = |path: &str| {
        listing
            .lines()
            .find(|l| l.ends_with(&format!(" .{path}")))
            .unwrap_or_else(|| panic!("{path} not in the package:\n{listing}"))
            .to_string()
    };
    let bin = entry("/usr/bin/graygate");
    assert!(bin.starts_with("-rwxr-xr-x root/root"), "{bin}");
    for p in [
        "/etc/graygate/graygate.yaml",
        "/etc/graygate/nodes.yaml",
        "/etc/graygate/gray_ips.txt",
        "/etc/graygate/gray.lua",
        "/usr/lib/systemd/system/graygate.service",
        "/etc/logrotate.d/graygate",
        "/usr/share/man/man1/graygate.1.gz",
        "/usr/share/bash-completion/completions/graygate",
        "/usr/share/zsh/vendor-completions/_graygate",
        "/usr/share/fish/vendor_completions.d/graygate.fish",
        "/usr/share/doc/graygate/copyright",
        "/usr/share/graygate/static/formal/index.html",
    ] {
        assert!(entry(p).starts_with("-rw-r--r-- root/root"), "{}", entry(p));
    }

    // Unpacked, as dpkg would install it (without running anything).
    let root = work.path().join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
    let unit =
        std::fs::read_to_string(root.join("usr/lib/systemd/system/graygate.service")).unwrap();
    for line in [
        "Type=notify",
        "NotifyAccess=all",
        "ExecStart=/usr/bin/graygate --config /etc/graygate/graygate.yaml",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "RuntimeDirectory=graygate",
        "LogsDirectory=graygate",
        "WantedBy=multi-user.target",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "unit lacks {line:?}:\n{unit}"
        );
    }
    assert!(
        unit.contains("--signal=USR2"),
        "the upgrade path is documented in the unit"
    );
    let rotate = std::fs::read_to_string(root.join("etc/logrotate.d/graygate")).unwrap();
    assert!(rotate.contains("/var/log/graygate/*.log"), "{rotate}");
    assert!(
        rotate.contains("postrotate")
            && rotate.contains("kill -USR1")
            && rotate.contains("/run/graygate/graygate.pid"),
        "{rotate}"
    );
    let config = root.join("etc/graygate/graygate.yaml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        text.contains("pid_file: run/graygate/graygate.pid"),
        "logrotate's pid file"
    );
    assert!(
        text.contains("path: var/log/graygate/access.log"),
        "logrotate's log"
    );
    let man = run(Command::new("gzip")
        .arg("-dc")
        .arg(root.join("usr/share/man/man1/graygate.1.gz")));
    assert!(man.contains(".TH graygate 1"));
    let exe = root.join("usr/bin/graygate");
    assert!(std::fs::metadata(&exe).unwrap().permissions().mode() & 0o111 != 0);
    let version = run(Command::new(&exe).arg("--version"));
    assert!(version.starts_with(&format!("graygate {}\ncommit:", env!("CARGO_PKG_VERSION"))));

    // `graygate --check` on the packaged configuration, as it is.
    let check = run(Command::new(&exe)
        .arg("--check")
        .arg("--config")
        .arg(&config));
    assert!(check.contains("configuration ok"), "{check}");

    // It serves on that configuration: only its fixed ports are replaced
    // by free ones (the suite never takes fixed ports); /run/graygate is
    // what systemd's RuntimeDirectory= would create.
    let mut nodes = std::fs::read_to_string(root.join("etc/graygate/nodes.yaml")).unwrap();
    let mut cfg = text
        .replace("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0")
        .replace("admin_listen: 127.0.0.1:9080", "admin_listen: 127.0.0.1:0");
    for (port, free) in ["18081", "18082", "18091"]
        .into_iter()
        .zip(std::iter::repeat_with(free_port))
    {
        let free = free.to_string();
        cfg = cfg.replace(port, &free);
        nodes = nodes.replace(port, &free);
    }
    assert_ne!(cfg, text);
    std::fs::write(&config, cfg).unwrap();
    std::fs::write(root.join("etc/graygate/nodes.yaml"), nodes).unwrap();
    std::fs::create_dir_all(root.join("run/graygate")).unwrap();
    // systemd's readiness protocol, as the unit's Type=notify expects.
    let notify_path = work.path().join("notify.sock");
    let notify = notify_socket(&notify_path);
    let mut cmd = Command::new(&exe);
    cmd.env("NOTIFY_SOCKET", &notify_path);
    let mut gw = Gateway::start_cmd(cmd, &config, &[]);
    let mut buf = [0u8; 256];
    let n = notify.recv(&mut buf).expect("READY notification");
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!("READY=1\nMAINPID={}", gw.pid())
    );
    let api = gw.get("/api/hello").await;
    assert_eq!(api.status, 200, "{}", api.text());
    assert!(api.node().starts_with("api-"), "{}", api.text());
    let page = gw.get("/").await;
    assert!(page.text().contains("Formal lane"), "{}", page.text());
    let access = root.join("var/log/graygate/access.log");
    soon("access log line", || async {
        std::fs::read_to_string(&access).is_ok_and(|t| t.contains("\"GET /api/hello\""))
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(root.join("run/graygate/graygate.pid"))
            .unwrap()
            .trim(),
        gw.pid().to_string()
    );
    assert!(root.join("run/graygate/upgrade.sock").exists());
    let _ = gw.stop_and_read_stdout().await;
    assert!(
        !root.join("run/graygate/graygate.pid").exists(),
        "pid file removed at exit"
    );
}

/// The script's options: the default build is `cargo build --release`
/// (profile-guided by the committed profile; seen by its check for cargo
/// failing on a PATH without it), `--pgo` trains a fresh profile with
/// bench/pgo.py first (seen by that script's first check failing on a PATH
/// without nginx, before any build), `--no-pgo` with `--binary` packages the
/// given binary, and an unknown option is refused.
#[test]
fn build_deb_builds_with_the_committed_profile_or_a_fresh_one() {
    let script = script();
    let bare = tempfile::tempdir().unwrap();
    // The interpreter itself (not a version manager's shim, which needs more
    // of PATH), and what the script runs before it.
    let python = run(Command::new("python3").args(["-c", "import sys; print(sys.executable)"]));
    std::os::unix::fs::symlink(python.trim(), bare.path().join("python3")).unwrap();
    let dirname = run(Command::new("bash").args(["-c", "command -v dirname"]));
    std::os::unix::fs::symlink(dirname.trim(), bare.path().join("dirname")).unwrap();
    let bare_run = |args: &[&str]| {
        let out = Command::new("/bin/bash")
            .arg(&script)
            .args(args)
            .env("PATH", bare.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = bare_run(&[]);
    assert!(err.contains("cargo not found"), "{err}");
    assert!(!err.contains("nginx not found"), "{err}");
    let err = bare_run(&["--pgo"]);
    assert!(err.contains("nginx not found"), "{err}");

    let work = tempfile::tempdir().unwrap();
    let deb = build_package(work.path(), &["--no-pgo"]);
    assert!(deb.is_file(), "{deb:?}");

    let bad = Command::new("bash")
        .arg(&script)
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown option --bogus"));
}

/// The packaged binary is really stripped: no symbol table and no debug
/// sections (`--strip-debug` would keep `.symtab`), and it still runs.
#[test]
fn packaged_binary_has_no_symbol_table() {
    let work = tempfile::tempdir().unwrap();
    let deb = build_package(work.path(), &[]);
    let root = work.path().join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
    let exe = root.join("usr/bin/graygate");
    let sections = run(Command::new("readelf").args(["-S", "-W"]).arg(&exe));
    assert!(
        !sections.contains(".symtab"),
        "symbol table kept:\n{sections}"
    );
    // (`.debug_gdb_scripts` is loaded with the program: strip keeps it.)
    for debug in [".debug_info", ".debug_line", ".debug_str"] {
        assert!(!sections.contains(debug), "{debug} kept:\n{sections}");
    }
    let before = std::fs::metadata(env!("CARGO_BIN_EXE_graygate"))
        .unwrap()
        .len();
    assert!(std::fs::metadata(&exe).unwrap().len() < before);
    assert!(run(Command::new(&exe).arg("--version")).starts_with("graygate "));
    // --no-strip keeps them.
    let kept = build_package(&work.path().join("kept"), &["--no-strip"]);
    let root = work.path().join("kept-root");
    run(Command::new("dpkg-deb").arg("-x").arg(&kept).arg(&root));
    let sections = run(Command::new("readelf")
        .args(["-S", "-W"])
        .arg(root.join("usr/bin/graygate")));
    assert!(sections.contains(".symtab"), "{sections}");
}

/// postinst's upgrade step against a stand-in `systemctl` (systemd present,
/// the unit active): it signals the main process with an option every
/// systemd the package installs on knows (`--kill-whom=` is 252's), waits
/// for the new main process, and fails visibly — no `|| true` — when the
/// signal fails or the upgrade does not complete.
#[test]
fn postinst_upgrade_signals_the_main_process_and_fails_visibly() {
    let src = format!("{}/packaging/debian/postinst", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(src).unwrap();
    let commands = text.lines().filter(|l| !l.trim_start().starts_with('#'));
    for l in commands {
        assert!(!l.contains("--kill-whom"), "needs systemd 252: {l}");
        assert!(!l.contains("|| true") || !l.contains("kill"), "{l}");
    }
    let work = tempfile::tempdir().unwrap();
    let systemd = work.path().join("run-systemd");
    std::fs::create_dir_all(&systemd).unwrap();
    let script = work.path().join("postinst");
    std::fs::write(
        &script,
        text.replace("/run/systemd/system", systemd.to_str().unwrap()),
    )
    .unwrap();
    let bin = work.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = work.path().join("calls");
    // `show` answers the old pid until `kill` ran (then the new one, unless
    // STUCK), `kill` fails when KILL_FAILS is set.
    let fake = format!(
        r#"#!/bin/sh
echo "$*" >>{log}
case "$1" in
show) if [ -e {log}.killed ] && [ -z "$STUCK" ]; then echo 200; else echo 100; fi ;;
kill) [ -z "$KILL_FAILS" ] || exit 1; touch {log}.killed ;;
esac
exit 0
"#,
        log = log.display()
    );
    for (name, body) in [
        ("systemctl", fake.as_str()),
        ("getent", "#!/bin/sh\nexit 0\n"),
        ("install", "#!/bin/sh\nexit 0\n"),
        ("sleep", "#!/bin/sh\nexit 0\n"),
    ] {
        let p = bin.join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let upgrade = |env: &[(&str, &str)]| {
        let _ = std::fs::remove_file(&log);
        let _ = std::fs::remove_file(log.with_extension("killed"));
        let mut cmd = Command::new("sh");
        cmd.arg(&script)
            .args(["configure", "0.0.1-1"])
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let calls = std::fs::read_to_string(&log).unwrap_or_default();
        (out, calls)
    };
    let (out, calls) = upgrade(&[]);
    assert!(out.status.success(), "{out:?}\n{calls}");
    assert!(
        calls
            .lines()
            .any(|l| l == "kill --kill-who=main --signal=USR2 graygate.service"),
        "{calls}"
    );
    let (out, calls) = upgrade(&[("KILL_FAILS", "1")]);
    assert!(!out.status.success(), "a failed signal passed: {calls}");
    let (out, _) = upgrade(&[("STUCK", "1")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("binary upgrade did not complete"), "{err}");
}
