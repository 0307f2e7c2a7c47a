//! The configuration reference (`docs/src/reference/configuration.md`) states the code's
//! defaults, and names only keys the code knows.
//!
//! Each table of the page that follows a `<!-- defaults: KIND -->` marker has the columns
//! `key | default | meaning`: the key is a dotted YAML path inside the object KIND describes,
//! and the default is a YAML value in backticks, `none` (the key absent is the same as `null`),
//! `required` (the test's minimal document must set it) or `computed` (worked out at run time
//! from the machine or other keys; listed in `COMPUTED` below). For every row the test writes the
//! documented default into a minimal valid document, parses that document and the minimal one
//! with graygate's own parser (`config::parse_yaml`, as the binary reads its files), and requires
//! both to give the same configuration; a key the parser rejects fails the test too (every
//! configuration type denies unknown fields).

use std::path::Path;

use graygate::config::release::ReleaseSpec;
use graygate::config::rules::RulesConfig;
use graygate::config::{parse_yaml, Bootstrap, MainConfig, NodeFile};
use serde_yaml::{Mapping, Value};

/// Parses a document of one file type and renders the result for comparison.
type Parse = fn(&str) -> Result<String, String>;

fn parsed<T: serde::de::DeserializeOwned + std::fmt::Debug>(
    file: &str,
    text: &str,
) -> Result<String, String> {
    parse_yaml::<T>(Path::new(file), text)
        .map(|c| format!("{c:?}"))
        .map_err(|e| e.to_string())
}

fn main_file(text: &str) -> Result<String, String> {
    parsed::<MainConfig>("graygate.yaml", text)
}
fn node_file(text: &str) -> Result<String, String> {
    parsed::<NodeFile>("nodes.yaml", text)
}
fn rule_file(text: &str) -> Result<String, String> {
    parsed::<RulesConfig>("rules.yaml", text)
}
fn release_spec(text: &str) -> Result<String, String> {
    parsed::<ReleaseSpec>("release.yaml", text)
}
fn bootstrap(text: &str) -> Result<String, String> {
    parsed::<Bootstrap>("bootstrap.yaml", text)
}
fn nacos_bootstrap(text: &str) -> Result<String, String> {
    graygate::config::nacos::NacosBootstrap::parse(Path::new("bootstrap.yaml"), text)
        .map(|c| format!("{c:?}"))
        .map_err(|e| e.to_string())
}

/// What a marker's tables describe: the file type, a minimal valid document of it, and where in
/// that document the object whose keys the table lists sits.
struct Kind {
    name: &'static str,
    parse: Parse,
    base: &'static str,
    object: &'static [&'static str],
}

const MAIN: &str = "listen: 127.0.0.1:8080\n";

const KINDS: &[Kind] = &[
    Kind { name: "main", parse: main_file, base: MAIN, object: &[] },
    Kind {
        name: "route",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nroutes:\n  - {}\n",
        object: &["routes", "0"],
    },
    Kind {
        name: "listener",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nlisteners:\n  - listen: 127.0.0.1:8443\n",
        object: &["listeners", "0"],
    },
    Kind {
        name: "tls",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nlisteners:\n  - listen: 127.0.0.1:8443\n    tls:\n      certificates:\n        - { cert: site.crt, key: site.key }\n",
        object: &["listeners", "0", "tls"],
    },
    Kind {
        name: "certificate",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nlisteners:\n  - listen: 127.0.0.1:8443\n    tls:\n      certificates:\n        - { cert: site.crt, key: site.key }\n",
        object: &["listeners", "0", "tls", "certificates", "0"],
    },
    Kind {
        name: "sticky",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nsticky: {}\n",
        object: &["sticky"],
    },
    Kind {
        name: "access_log",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\naccess_log: { path: stdout }\n",
        object: &["access_log"],
    },
    Kind {
        name: "otel",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\notel: {}\n",
        object: &["otel"],
    },
    Kind {
        name: "otel_traces",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\notel:\n  traces: { endpoint: \"http://127.0.0.1:4318/v1/traces\" }\n",
        object: &["otel", "traces"],
    },
    Kind {
        name: "demo_node",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\ndemo_nodes:\n  - { name: demo, addr: \"127.0.0.1:18081\" }\n",
        object: &["demo_nodes", "0"],
    },
    Kind { name: "service", parse: node_file, base: "services:\n  api: {}\n", object: &["services", "api"] },
    Kind {
        name: "active_health",
        parse: node_file,
        base: "services:\n  api:\n    health:\n      active: { path: /health }\n",
        object: &["services", "api", "health", "active"],
    },
    Kind {
        name: "node_tls",
        parse: node_file,
        base: "services:\n  api:\n    tls: {}\n",
        object: &["services", "api", "tls"],
    },
    Kind {
        name: "node",
        parse: node_file,
        base: "services:\n  api:\n    nodes:\n      - { addr: \"127.0.0.1:18081\" }\n",
        object: &["services", "api", "nodes", "0"],
    },
    Kind { name: "rules", parse: rule_file, base: "{}\n", object: &[] },
    Kind {
        name: "release",
        parse: release_spec,
        base: "name: checkout-v2\nlane: gray\nsteps:\n  - {}\n",
        object: &[],
    },
    // `webhooks:` written out: its keys' defaults are those of a `webhooks` block that is
    // present (without one no webhook is called, so its timeout never applies).
    Kind {
        name: "webhooks",
        parse: release_spec,
        base: "name: checkout-v2\nlane: gray\nsteps:\n  - {}\nwebhooks: {}\n",
        object: &["webhooks"],
    },
    Kind {
        name: "release_step",
        parse: release_spec,
        base: "name: checkout-v2\nlane: gray\nsteps:\n  - {}\n",
        object: &["steps", "0"],
    },
    Kind {
        name: "nacos",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nnacos: { server_addr: \"127.0.0.1:8848\" }\n",
        object: &["nacos"],
    },
    Kind {
        name: "nacos_discovery",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nnacos: { server_addr: \"127.0.0.1:8848\", discovery: {} }\n",
        object: &["nacos", "discovery"],
    },
    Kind {
        name: "nacos_service",
        parse: main_file,
        base: "listen: 127.0.0.1:8080\nnacos: { server_addr: \"127.0.0.1:8848\", discovery: { services: { api: {} } } }\n",
        object: &["nacos", "discovery", "services", "api"],
    },
    Kind {
        name: "nacos_config",
        parse: nacos_bootstrap,
        base: "listen: 127.0.0.1:8080\nnacos: { server_addr: \"127.0.0.1:8848\", config: {} }\n",
        object: &["nacos", "config"],
    },
    Kind {
        name: "etcd",
        parse: bootstrap,
        base: "listen: 127.0.0.1:8080\netcd: { endpoints: [\"http://127.0.0.1:2379\"], prefix: /graygate, cache_dir: cache }\n",
        object: &["etcd"],
    },
];

/// Defaults the code works out at run time, so no YAML value states them. The test still
/// requires the parser to know each key.
const COMPUTED: &[(&str, &str)] = &[
    // The config file's directory.
    ("main", "root"),
    // `releases.json` under `root` (with the etcd source: keys in etcd).
    ("main", "release_state_file"),
    // One worker per CPU of the machine.
    ("main", "workers"),
    // `graygate.sock` beside `pid_file` when there is one.
    ("main", "upgrade_socket"),
];

enum Default {
    Value(Value),
    Null,
    Required,
    Computed,
}

struct Row {
    kind: &'static Kind,
    line: usize,
    key: String,
    default: Default,
}

fn page() -> (String, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/reference/configuration.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path.display().to_string(), text)
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

fn first_code(cell: &str) -> Option<&str> {
    let start = cell.find('`')? + 1;
    let len = cell[start..].find('`')?;
    Some(&cell[start..start + len])
}

/// Every row of every marked table; panics on a malformed page.
fn rows(file: &str, text: &str) -> Vec<Row> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut kind: Option<&'static Kind> = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if let Some(name) = line
            .strip_prefix("<!-- defaults:")
            .and_then(|r| r.strip_suffix("-->"))
        {
            let name = name.trim();
            let k = KINDS
                .iter()
                .find(|k| k.name == name)
                .unwrap_or_else(|| panic!("{file}:{}: unknown kind {name:?}", i + 1));
            kind = Some(k);
        } else if line.starts_with('|') {
            let head = cells(line);
            let is_defaults = head.len() >= 2 && head[0] == "key" && head[1] == "default";
            let k = match (is_defaults, kind.take()) {
                (true, Some(k)) => k,
                (true, None) => panic!(
                    "{file}:{}: a key/default table without a <!-- defaults: KIND --> marker",
                    i + 1
                ),
                (false, _) => {
                    while i < lines.len() && lines[i].trim().starts_with('|') {
                        i += 1;
                    }
                    continue;
                }
            };
            i += 2; // the header and its separator
            let mut any = false;
            while i < lines.len() && lines[i].trim().starts_with('|') {
                let c = cells(lines[i]);
                let key = first_code(&c[0])
                    .unwrap_or_else(|| panic!("{file}:{}: no `key` in the first column", i + 1))
                    .to_string();
                let cell = c.get(1).map(String::as_str).unwrap_or("");
                let default = if cell.starts_with('`') {
                    let v = first_code(cell).unwrap();
                    Default::Value(serde_yaml::from_str(v).unwrap_or_else(|e| {
                        panic!("{file}:{}: `{v}` is no YAML value: {e}", i + 1)
                    }))
                } else if cell == "none" {
                    Default::Null
                } else if cell == "required" {
                    Default::Required
                } else if cell == "computed" {
                    Default::Computed
                } else {
                    panic!(
                        "{file}:{}: default {cell:?} is none of `value`, none, required, computed",
                        i + 1
                    )
                };
                out.push(Row {
                    kind: k,
                    line: i + 1,
                    key,
                    default,
                });
                any = true;
                i += 1;
            }
            assert!(any, "{file}:{}: an empty defaults table", i + 1);
            continue;
        }
        i += 1;
    }
    out
}

/// The object a kind's keys live in, inside a document.
fn object<'a>(doc: &'a mut Value, path: &[&str]) -> &'a mut Value {
    let mut at = doc;
    for seg in path {
        at = match at {
            Value::Sequence(s) => &mut s[seg.parse::<usize>().unwrap()],
            Value::Mapping(m) => m
                .get_mut(*seg)
                .unwrap_or_else(|| panic!("base document has no {seg:?}")),
            _ => panic!("base document: {seg:?} is not inside a mapping or list"),
        };
    }
    at
}

/// Writes `value` at the dotted `key` inside `obj`, creating mappings on the way.
fn set(obj: &mut Value, key: &str, value: Value) {
    let parts: Vec<&str> = key.split('.').collect();
    let mut at = obj;
    for part in &parts[..parts.len() - 1] {
        let map = at.as_mapping_mut().expect("a mapping");
        if !map.contains_key(*part) {
            map.insert(Value::from(*part), Value::Mapping(Mapping::new()));
        }
        at = map.get_mut(*part).unwrap();
    }
    at.as_mapping_mut()
        .expect("a mapping")
        .insert(Value::from(parts[parts.len() - 1]), value);
}

fn has(obj: &Value, key: &str) -> bool {
    let mut at = obj;
    for part in key.split('.') {
        match at.as_mapping().and_then(|m| m.get(part)) {
            Some(v) => at = v,
            None => return false,
        }
    }
    true
}

fn with(kind: &Kind, key: &str, value: Value) -> String {
    let mut doc: Value = serde_yaml::from_str(kind.base).unwrap();
    set(object(&mut doc, kind.object), key, value);
    serde_yaml::to_string(&doc).unwrap()
}

#[test]
fn every_documented_default_is_the_codes() {
    let (file, text) = page();
    let rows = rows(&file, &text);
    assert!(
        rows.len() > 50,
        "{file}: only {} documented keys found",
        rows.len()
    );
    let mut failures = Vec::new();
    for kind in KINDS {
        assert!(
            rows.iter().any(|r| r.kind.name == kind.name),
            "{file}: no table documents {:?}",
            kind.name
        );
        if let Err(e) = (kind.parse)(kind.base) {
            panic!("the minimal {:?} document does not parse: {e}", kind.name);
        }
    }
    for (kind, key) in COMPUTED {
        assert!(
            rows.iter().any(|r| r.kind.name == *kind
                && r.key == *key
                && matches!(r.default, Default::Computed)),
            "{file}: {kind} `{key}` is no longer documented as computed: update COMPUTED"
        );
    }
    for row in &rows {
        let kind = row.kind;
        let at = format!("{file}:{}: {} `{}`", row.line, kind.name, row.key);
        let value = match &row.default {
            Default::Value(v) => v.clone(),
            Default::Null => Value::Null,
            Default::Required => {
                let mut doc: Value = serde_yaml::from_str(kind.base).unwrap();
                if !has(object(&mut doc, kind.object), &row.key) {
                    failures.push(format!(
                        "{at}: documented as required, but the minimal document does without it"
                    ));
                }
                continue;
            }
            Default::Computed => {
                if !COMPUTED.contains(&(kind.name, row.key.as_str())) {
                    failures.push(format!(
                        "{at}: documented as computed but not listed in COMPUTED"
                    ));
                }
                // Known to the parser: an explicit null parses.
                if let Err(e) = (kind.parse)(&with(kind, &row.key, Value::Null)) {
                    failures.push(format!("{at}: the parser rejects the key: {e}"));
                }
                continue;
            }
        };
        let expected = (kind.parse)(kind.base).unwrap();
        match (kind.parse)(&with(kind, &row.key, value)) {
            Ok(got) if got == expected => {}
            Ok(_) => failures.push(format!("{at}: the documented default is not the code's")),
            Err(e) => failures.push(format!(
                "{at}: the parser rejects the documented key or value: {e}"
            )),
        }
    }
    // All of a kind's documented defaults at once give the code's configuration too.
    for kind in KINDS {
        let mut doc: Value = serde_yaml::from_str(kind.base).unwrap();
        for row in rows.iter().filter(|r| std::ptr::eq(r.kind, kind)) {
            match &row.default {
                Default::Value(v) => set(object(&mut doc, kind.object), &row.key, v.clone()),
                Default::Null => set(object(&mut doc, kind.object), &row.key, Value::Null),
                Default::Required | Default::Computed => {}
            }
        }
        let all = serde_yaml::to_string(&doc).unwrap();
        if (kind.parse)(&all) != (kind.parse)(kind.base) {
            failures.push(format!(
                "{file}: the {:?} defaults together differ from the code's",
                kind.name
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "configuration reference out of date:\n  {}",
        failures.join("\n  ")
    );
}
