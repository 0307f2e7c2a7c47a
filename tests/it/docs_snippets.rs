//! Every YAML snippet of the docs is valid where its page says to put it.
//!
//! Convention: each ```` ```yaml ```` fence in `docs/src/**/*.md` has, on the line right above
//! it, a marker `<!-- snippet: KIND -->` (an HTML comment: mdBook does not show it) saying what
//! the snippet is. A fence without one fails the test, so a new snippet is classified when it is
//! written. The kinds, and how each is checked with graygate's own loader:
//!
//! - `main`: a whole main file; `main-fragment`: some keys of the main file, written into a
//!   minimal main file (`listen: 127.0.0.1:8080`, unless the snippet sets `listen`). Loaded as
//!   the binary loads its configuration at start (`Generation::load`, what `graygate --check`
//!   runs).
//! - `node-file`: a file the main file names in `node_files`; `rule-file`: the file `rules_file`
//!   names. Each is loaded through a minimal main file naming it.
//! - `release`: a release spec (`POST /releases`, `graygate release create`): parsed and checked
//!   as the release controller checks a new spec.
//! - `bootstrap`: the main file of a gateway that reads the rest from etcd: parsed (its loading
//!   needs the etcd cluster, which `etcd_fleet` starts); `nacos-bootstrap`: the same with the
//!   rest in Nacos config (`nacos.config`), parsed and its `nacos:` checked.
//!
//! A marker may also name the snippet's file, `<!-- snippet: node-file nodes.yaml -->`: the
//! snippet is then written under that name beside every later snippet of the same page (a
//! guide's main file naming the node file the guide showed first). Anything else a snippet
//! refers to is made for it in its temporary directory: a certificate and key for every
//! `cert:`/`key:`/`ca:` path, and an (empty) IP list for every `{ list: NAME }` (the minimal main
//! file then names it under `lists:`).

use std::path::Path;

use graygate::config::release::ReleaseSpec;
use graygate::config::{parse_yaml, Bootstrap};

use crate::harness::{files_under, load_config, tls::write_cert};

/// One ```` ```yaml ```` block of a page.
struct Snippet {
    /// `page:line` of the fence.
    at: String,
    kind: String,
    /// The named snippets above it on its page: (file name, text).
    beside: Vec<(String, String)>,
    text: String,
}

/// Every YAML snippet of the docs; panics on a fence without a marker.
fn snippets() -> Vec<Snippet> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = files_under(&root.join("docs/src"), &["md"]);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.strip_prefix(root).unwrap().display().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let mut named: Vec<(String, String)> = Vec::new();
        let mut i = 0;
        while i < lines.len() {
            let fence = lines[i].trim();
            if !fence.starts_with("```") {
                i += 1;
                continue;
            }
            let lang = fence.trim_start_matches('`').trim();
            let start = i;
            i += 1;
            let mut body = String::new();
            while i < lines.len() && lines[i].trim() != "```" {
                body.push_str(lines[i]);
                body.push('\n');
                i += 1;
            }
            i += 1;
            if lang != "yaml" && lang != "yml" {
                continue;
            }
            let at = format!("{name}:{}", start + 1);
            let marker = start
                .checked_sub(1)
                .and_then(|p| {
                    lines[p]
                        .trim()
                        .strip_prefix("<!-- snippet:")?
                        .strip_suffix("-->")
                })
                .unwrap_or_else(|| {
                    panic!("{at}: a YAML snippet without a `<!-- snippet: KIND -->` line above it")
                })
                .trim()
                .to_string();
            let mut words = marker.split_whitespace();
            let kind = words.next().unwrap_or("").to_string();
            let file = words.next().map(str::to_string);
            // The snippet's own indentation (inside a list item) is not the file's.
            let indent = lines[start].len() - lines[start].trim_start().len();
            let text = body
                .lines()
                .map(|l| l.get(indent..).unwrap_or(l.trim_start()))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n";
            let beside = named.clone();
            if let Some(f) = &file {
                named.push((f.clone(), text.clone()));
            }
            out.push(Snippet {
                at,
                kind,
                beside,
                text,
            });
        }
    }
    out
}

/// The values of `key:` anywhere in `text` (flow or block style), unquoted.
fn values_of(text: &str, key: &str) -> Vec<String> {
    let mut out = Vec::new();
    let needle = format!("{key}:");
    for line in text.lines() {
        let line = line.split(" #").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find(&needle) {
            let before = rest[..i].chars().last();
            rest = &rest[i + needle.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let v: String = rest
                .trim_start()
                .chars()
                .take_while(|c| !matches!(c, ',' | '}' | ']') && !c.is_whitespace())
                .collect();
            let v = v.trim_matches(|c| c == '"' || c == '\'').to_string();
            if !v.is_empty() {
                out.push(v);
            }
        }
    }
    out
}

/// Makes the files `snippet` refers to in `dir`; returns the `lists:` entries a main file needs
/// for the lists it names.
fn referred_files(dir: &Path, snippet: &str) -> String {
    for key in ["cert", "key", "ca"] {
        for v in values_of(snippet, key) {
            let p = Path::new(&v);
            let (Some(stem), Some(ext)) = (p.file_stem(), p.extension()) else {
                continue;
            };
            if !["crt", "key", "pem"].contains(&ext.to_str().unwrap()) || dir.join(p).exists() {
                continue;
            }
            let parent = dir.join(p.parent().unwrap_or(Path::new("")));
            let stem = stem.to_str().unwrap();
            write_cert(&parent, stem, "localhost");
            if ext == "pem" {
                std::fs::rename(parent.join(format!("{stem}.crt")), dir.join(p)).unwrap();
            }
        }
    }
    let mut lists = String::new();
    for name in values_of(snippet, "list") {
        std::fs::write(dir.join(format!("{name}.txt")), "").unwrap();
        lists.push_str(&format!("  {name}: {name}.txt\n"));
    }
    if lists.is_empty() {
        lists
    } else {
        format!("lists:\n{lists}")
    }
}

fn has_key(text: &str, key: &str) -> bool {
    text.lines().any(|l| l.starts_with(&format!("{key}:")))
}

/// Loads `main` (the main file's text) from `dir` as the binary does.
fn load(dir: &Path, main: &str) -> Result<(), String> {
    let path = dir.join("graygate.yaml");
    std::fs::write(&path, main).unwrap();
    load_config(&path).map(drop).map_err(|e| e.to_string())
}

/// Checks one snippet as what its marker says it is.
fn check(s: &Snippet) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    for (name, text) in &s.beside {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let lists = referred_files(dir, &s.text);
    let minimal = "listen: 127.0.0.1:8080\n";
    match s.kind.as_str() {
        "main" => load(dir, &s.text),
        "main-fragment" => {
            let mut main = s.text.clone();
            if !has_key(&main, "listen") {
                main.push_str(minimal);
            }
            if !has_key(&main, "lists") {
                main.push_str(&lists);
            }
            load(dir, &main)
        }
        "node-file" => {
            // Names are resolved at load: an example's host name (`canary-1.svc.internal`)
            // stands for one this machine resolves.
            let mut text = s.text.clone();
            for addr in values_of(&s.text, "addr") {
                if addr.parse::<std::net::SocketAddr>().is_err() {
                    if let Some((_, port)) = addr.rsplit_once(':') {
                        text = text.replace(&addr, &format!("localhost:{port}"));
                    }
                }
            }
            std::fs::write(dir.join("nodes.yaml"), &text).unwrap();
            load(dir, &format!("{minimal}node_files: [nodes.yaml]\n{lists}"))
        }
        "rule-file" => {
            std::fs::write(dir.join("rules.yaml"), &s.text).unwrap();
            load(dir, &format!("{minimal}rules_file: rules.yaml\n{lists}"))
        }
        "release" => {
            let spec: ReleaseSpec = parse_yaml(Path::new("release.yaml"), &s.text).map_err(|e| e.to_string())?;
            graygate::control::release::check_spec(&spec)
        }
        "bootstrap" => parse_yaml::<Bootstrap>(Path::new("graygate.yaml"), &s.text)
            .map(drop)
            .map_err(|e| e.to_string()),
        "nacos-bootstrap" => {
            graygate::config::nacos::NacosBootstrap::parse(Path::new("bootstrap.yaml"), &s.text)
                .map_err(|e| e.to_string())
                .and_then(|b| b.nacos.check().map_err(|(_, m)| m))
        }
        other => Err(format!(
            "unknown snippet kind {other:?} (main, main-fragment, node-file, rule-file, release, bootstrap, nacos-bootstrap)"
        )),
    }
}

#[test]
fn every_yaml_snippet_of_the_docs_loads_where_its_page_puts_it() {
    let all = snippets();
    assert!(all.len() >= 9, "only {} YAML snippets found", all.len());
    let failures: Vec<String> = all
        .iter()
        .filter_map(|s| {
            check(s)
                .err()
                .map(|e| format!("{} ({}): {e}", s.at, s.kind))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} snippets do not load:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}

/// The guide's form: `rules:` in the main file as a bare list is the mapping's `rules`, with
/// everything else at its default — and a rule file may be such a list too.
#[test]
fn a_rules_list_in_the_main_file_is_the_rules_of_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let rules = "  - { name: testers, lane: gray, ip: [127.0.9.0/24] }\n  - { name: beta, lane: gray, header: { name: X-Gray, values: [\"1\"] } }\n";
    let list = format!("listen: 127.0.0.1:8080\nrules:\n{rules}");
    let mapping = format!(
        "listen: 127.0.0.1:8080\nrules:\n  rules:\n{}",
        rules.replace("  - ", "    - ")
    );
    let parsed = |t: &str| {
        parse_yaml::<graygate::config::MainConfig>(Path::new("g.yaml"), t)
            .map(|c| format!("{:?}", c.rules))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    assert_eq!(parsed(&list), parsed(&mapping));
    load(dir, &list).unwrap();
    std::fs::write(dir.join("rules.yaml"), rules).unwrap();
    load(dir, "listen: 127.0.0.1:8080\nrules_file: rules.yaml\n").unwrap();
    // Neither a list nor a mapping: the message says what is expected, in YAML's words.
    let err = load(dir, "listen: 127.0.0.1:8080\nrules: testers\n").unwrap_err();
    assert!(err.contains("graygate.yaml:2"), "{err}");
    assert!(err.contains("a list of rules, or a mapping"), "{err}");
    assert!(!err.contains("RulesConfig"), "{err}");
}
