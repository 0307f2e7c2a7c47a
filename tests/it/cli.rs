//! The command line: `--version` with build information (also from a
//! tarball without .git), and the shell completions and man page generated
//! from the clap definitions (quiet when their reader goes away).

use std::path::{Path, PathBuf};
use std::process::Command;

fn graygate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key:?} line in {text}"))
        .trim()
}

#[test]
fn version_prints_the_version_and_how_the_binary_was_built() {
    let (ok, out, err) = graygate(&["--version"]);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().next().unwrap(),
        format!("graygate {}", env!("CARGO_PKG_VERSION"))
    );
    let rustc = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(
        line(&out, "rustc:"),
        String::from_utf8_lossy(&rustc.stdout).trim()
    );
    assert!(line(&out, "target:").contains("linux"), "{out}");
    assert!(!line(&out, "features:").is_empty());
    // tools/rustc-pgo flags only optimized crates: this debug build has no
    // profile.
    if line(&out, "profile:") == "debug" {
        assert_eq!(line(&out, "pgo:"), "none", "{out}");
    } else {
        assert!(!line(&out, "pgo:").is_empty(), "{out}");
    }
    // The VM the binary links (mlua's own report of it).
    let vm: String = mlua::Lua::new()
        .load("return jit and jit.version or _VERSION")
        .eval()
        .unwrap();
    let family: String = vm.split('.').take(2).collect::<Vec<_>>().join(".");
    assert!(line(&out, "lua:").starts_with(&family), "{vm}: {out}");
    // The commit this checkout is at (the test binary was built from it);
    // from a tarball, "unknown".
    let dir = env!("CARGO_MANIFEST_DIR");
    let head = Command::new("git")
        .args(["-C", dir, "rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(h) => assert!(line(&out, "commit:").starts_with(&h), "{out}"),
        None => assert!(line(&out, "commit:").starts_with("unknown"), "{out}"),
    }
    // -V: the short form, version only.
    let (_, short, _) = graygate(&["-V"]);
    assert_eq!(
        short.trim(),
        format!("graygate {}", env!("CARGO_PKG_VERSION"))
    );
}

/// The compiled build script of this package (next to the binary's
/// target directory), the most recent if there are several.
fn build_script() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_graygate"));
    let build = bin.parent().unwrap().join("build");
    std::fs::read_dir(&build)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("graygate-"))
        .map(|e| e.path().join("build-script-build"))
        .filter(|p| p.exists())
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .expect("compiled build script")
}

#[test]
fn build_script_works_from_a_tarball_without_git() {
    let tarball = tempfile::tempdir().unwrap();
    let out_dir = tarball.path().join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let run = |commit: Option<&str>| {
        let mut cmd = Command::new(build_script());
        cmd.env("CARGO_MANIFEST_DIR", tarball.path())
            .env("OUT_DIR", &out_dir)
            .env("TARGET", "x86_64-unknown-linux-gnu")
            .env("PROFILE", "release")
            .env("CARGO_FEATURE_DEMO", "1")
            .env("GIT_CEILING_DIRECTORIES", tarball.path().parent().unwrap())
            .env_remove("GRAYGATE_GIT_COMMIT");
        if let Some(c) = commit {
            cmd.env("GRAYGATE_GIT_COMMIT", c);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let plain = run(None);
    assert!(
        plain.contains(
            "cargo:rustc-env=GRAYGATE_BUILD_COMMIT=unknown (not built from a git checkout)"
        ),
        "{plain}"
    );
    assert!(
        plain.contains("cargo:rustc-env=GRAYGATE_BUILD_RUSTC=rustc "),
        "{plain}"
    );
    assert!(
        plain.contains("cargo:rustc-env=GRAYGATE_BUILD_FEATURES=demo"),
        "{plain}"
    );
    assert!(
        plain.contains("cargo:rustc-env=GRAYGATE_BUILD_PROFILE=release"),
        "{plain}"
    );
    let given = run(Some("v0.1.0-3-gabcdef"));
    assert!(
        given.contains("cargo:rustc-env=GRAYGATE_BUILD_COMMIT=v0.1.0-3-gabcdef"),
        "{given}"
    );
}

#[test]
fn completions_and_man_page_come_from_the_clap_definitions() {
    for (shell, marker) in [
        ("bash", "complete -F _graygate"),
        ("zsh", "#compdef graygate"),
        ("fish", "complete -c graygate"),
    ] {
        let (ok, out, err) = graygate(&["completions", shell]);
        assert!(ok, "{shell}: {err}");
        assert!(out.contains(marker), "{shell}: {out}");
        for flag in ["upgrade", "upgrade-socket", "config", "check", "pid-file"] {
            assert!(out.contains(flag), "{shell} completion lacks {flag}");
        }
        assert!(
            out.contains("manpage"),
            "{shell} completion lacks the subcommands"
        );
    }
    let (ok, _, err) = graygate(&["completions", "tcsh"]);
    assert!(!ok && err.contains("invalid value"), "{err}");

    let (ok, man, err) = graygate(&["manpage"]);
    assert!(ok, "{err}");
    assert!(man.contains(".TH graygate 1"), "{man}");
    for s in [
        ".SH NAME",
        ".SH SYNOPSIS",
        ".SH OPTIONS",
        ".SH SUBCOMMANDS",
        ".SH VERSION",
    ] {
        assert!(man.contains(s), "man page lacks {s}");
    }
    assert!(man.contains("\\-\\-upgrade"), "{man}");
    assert!(
        man.contains("USR2 binary upgrade"),
        "the signals are documented: {man}"
    );
}

/// `graygate completions bash | head -1`, `graygate manpage | head`: a
/// reader gone before they write ends them quietly (exit 0, no panic).
#[test]
fn completions_and_man_page_end_quietly_on_a_closed_pipe() {
    for args in [&["completions", "bash"][..], &["manpage"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_graygate"))
            .args(args)
            .stdout(writer)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
