//! The docs say what the code does, where a page lists the code's values or states its defaults
//! outside the configuration reference's tables (those are `docs_reference`'s):
//!
//! - every `decided_by` value the code records is in every list of them on any page (a list is a
//!   paragraph or table naming three or more of the values only `decided_by` has);
//! - the Lua API page states the trace compiler's default as the code's default;
//! - the README's test command is `tools/test`, CI's `.ci/run` runs that same command, and
//!   `tools/test` installs every Debian package whose program a test starts; the README stays
//!   within 200 lines.
//!
//! The dashboard's release step, counted as the API counts it, is `dashboard`'s (a real browser).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use graygate::config::{parse_yaml, MainConfig};
use graygate::lane::DecidedBy;

use crate::harness::files_under;

/// Every `DecidedBy` the code has.
fn all_decided_by() -> Vec<DecidedBy> {
    let n: Arc<str> = "n".into();
    let all = vec![
        DecidedBy::Default,
        DecidedBy::Script,
        DecidedBy::TrustedTag,
        DecidedBy::TrustedBaggage,
        DecidedBy::ScriptError(String::new()),
        DecidedBy::InvalidLane(String::new()),
        DecidedBy::Deny(n.clone()),
        DecidedBy::Rule(n.clone()),
        DecidedBy::RuleFallback,
        DecidedBy::StickyCookie,
        DecidedBy::Release(n.clone()),
        DecidedBy::RolledBack(n),
    ];
    for d in &all {
        // No wildcard: a new variant does not compile until it is listed above.
        match d {
            DecidedBy::Default
            | DecidedBy::Script
            | DecidedBy::TrustedTag
            | DecidedBy::TrustedBaggage
            | DecidedBy::ScriptError(_)
            | DecidedBy::InvalidLane(_)
            | DecidedBy::Deny(_)
            | DecidedBy::Rule(_)
            | DecidedBy::RuleFallback
            | DecidedBy::StickyCookie
            | DecidedBy::Release(_)
            | DecidedBy::RolledBack(_) => {}
        }
    }
    all
}

fn docs() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    files_under(&root.join("docs/src"), &["md"])
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            (f.strip_prefix(root).unwrap().display().to_string(), text)
        })
        .collect()
}

/// The words in backticks of `text`.
fn code_words(text: &str) -> BTreeSet<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_decided_by_value_is_in_every_list_of_them() {
    let values: Vec<&str> = all_decided_by().iter().map(DecidedBy::as_str).collect();
    // Values no other list of the docs names (`rule`, `script`, `default`, … are common words).
    let own: Vec<&str> = values.iter().copied().filter(|v| v.contains('_')).collect();
    let mut lists = Vec::new();
    let mut failures = Vec::new();
    for (page, text) in docs() {
        let mut line = 1;
        for para in text.split("\n\n") {
            let words = code_words(para);
            if own.iter().filter(|v| words.contains(*v)).count() >= 3 {
                lists.push(format!("{page}:{line}"));
                let missing: Vec<&str> = values
                    .iter()
                    .copied()
                    .filter(|v| !words.contains(v))
                    .collect();
                if !missing.is_empty() {
                    failures.push(format!(
                        "{page}:{line}: lists decided_by values without {missing:?}"
                    ));
                }
            }
            line += para.matches('\n').count() + 2;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The guide's table, the rules reference and the metrics reference at least.
    for page in [
        "guides/lanes-and-scripts.md",
        "reference/rules.md",
        "reference/metrics.md",
    ] {
        assert!(
            lists.iter().any(|l| l.contains(page)),
            "no decided_by list in {page}: {lists:?}"
        );
    }
}

#[test]
fn the_lua_api_page_states_the_jit_default() {
    let (_, text) = docs()
        .into_iter()
        .find(|(p, _)| p.ends_with("reference/lua-api.md"))
        .unwrap();
    let text = text.replace('\n', " ");
    let said = text
        .split("on by default (`script_limits.jit: ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .unwrap_or_else(|| panic!("lua-api.md does not say the trace compiler's default"));
    let main = |extra: &str| {
        let c: MainConfig = parse_yaml(
            Path::new("g.yaml"),
            &format!("listen: 127.0.0.1:8080\n{extra}"),
        )
        .unwrap();
        format!("{:?}", c.script_limits.jit)
    };
    assert_eq!(
        main(&format!("script_limits: {{ jit: {said} }}\n")),
        main(""),
        "the page says {said}"
    );
    assert!(
        !text.contains("(its interpreter)"),
        "the page still says scripts run on the interpreter"
    );
}

/// The Debian package of each program the tests start, by the program's name in the tests.
const TEST_PROGRAMS: &[(&str, &str)] = &[
    ("\"nginx\"", "nginx-core"),
    ("\"haproxy\"", "haproxy"),
    ("\"wrk\"", "wrk"),
    ("\"h2load\"", "nghttp2-client"),
    ("\"etcd\"", "etcd-server"),
    ("\"etcdctl\"", "etcd-client"),
    ("\"chromedriver\"", "chromium-driver"),
    ("\"valgrind\"", "valgrind"),
    ("\"dnsmasq\"", "dnsmasq"),
];

#[test]
fn the_readme_test_command_is_ci_s_and_installs_what_the_tests_start() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 200,
        "README.md: {} lines",
        readme.lines().count()
    );
    assert!(
        readme.contains("```sh\ntools/test\n```"),
        "README: the test command"
    );
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    assert!(
        ci.lines().any(|l| l.trim() == "tools/test"),
        ".ci/run runs tools/test"
    );
    let script = std::fs::read_to_string(root.join("tools/test")).unwrap();
    let packages: String = script
        .split("APT_PACKAGES=(")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap()
        .to_string();
    let packages: BTreeSet<&str> = packages.split_whitespace().collect();
    let tests: String = [root.join("tests"), root.join("bench")]
        .iter()
        .flat_map(|d| files_under(d, &["rs", "py"]))
        .filter(|p| !p.ends_with("docs_agree.rs"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    for (program, package) in TEST_PROGRAMS {
        if tests.contains(program) {
            assert!(
                packages.contains(package),
                "tests start {program}: tools/test must install {package}"
            );
        }
    }
}
