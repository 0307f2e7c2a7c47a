//! Build information for `graygate --version`: the git commit (when built
//! from a checkout; `GRAYGATE_GIT_COMMIT` may supply it for a tarball build,
//! else "unknown"), the rustc version, target, profile and enabled features.

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let dir = Path::new(&dir);
    println!("cargo:rerun-if-changed=build.rs");
    // tools/rustc-pgo (the rustc wrapper of .cargo/config.toml) tells the
    // release build which PGO profile it got; `--version` reports it.
    println!(
        "cargo::rustc-check-cfg=cfg(graygate_pgo, values(\"committed\", \"use\", \"generate\"))"
    );
    println!("cargo:rerun-if-env-changed=GRAYGATE_PGO");
    println!("cargo:rerun-if-env-changed=GRAYGATE_GIT_COMMIT");
    // A new committed profile rebuilds this crate (a missing file would
    // re-run this script every build).
    if dir.join("pgo/graygate.profdata").exists() {
        println!("cargo:rerun-if-changed=pgo/graygate.profdata");
    }
    // Only a checkout of this very repository counts (not a parent
    // repository the tarball was unpacked into).
    let top = git(dir, &["rev-parse", "--show-toplevel"]);
    let own = top.is_some_and(|t| Path::new(&t).canonicalize().ok() == dir.canonicalize().ok());
    let commit = std::env::var("GRAYGATE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            if !own {
                return None;
            }
            // Re-run when HEAD moves (a commit or a checkout).
            let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
            watch.extend(git(dir, &["symbolic-ref", "-q", "HEAD"]));
            for p in watch {
                if let Some(f) = git(dir, &["rev-parse", "--git-path", &p]) {
                    let f = dir.join(f);
                    // A missing file would re-run this script every build.
                    if f.exists() {
                        println!("cargo:rerun-if-changed={}", f.display());
                    }
                }
            }
            let hash = git(dir, &["rev-parse", "--short=12", "HEAD"])?;
            let date = git(dir, &["log", "-1", "--format=%cs", "HEAD"]).unwrap_or_default();
            Some(format!("{hash} {date}").trim().to_string())
        })
        .unwrap_or_else(|| "unknown (not built from a git checkout)".into());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| k.strip_prefix("CARGO_FEATURE_").map(|f| f.to_lowercase()))
        .collect();
    features.sort();
    let features = if features.is_empty() {
        "none".to_string()
    } else {
        features.join(",")
    };
    let target = std::env::var("TARGET").unwrap_or_default();
    let profile = std::env::var("PROFILE").unwrap_or_default();
    println!("cargo:rustc-env=GRAYGATE_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=GRAYGATE_BUILD_RUSTC={rustc_version}");
    println!("cargo:rustc-env=GRAYGATE_BUILD_FEATURES={features}");
    println!("cargo:rustc-env=GRAYGATE_BUILD_TARGET={target}");
    println!("cargo:rustc-env=GRAYGATE_BUILD_PROFILE={profile}");
}
