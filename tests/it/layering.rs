//! The house keeps its layers: every top-level module of `src/` imports
//! only from modules of a lower layer (so no import circle can form), and
//! the data plane never imports the control plane. Reads the `crate::…`
//! paths (and `use crate::{a, b}` groups) of every source file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layer of each top-level module, lowest first. A new module must be
/// placed here.
const LAYERS: &[(&str, u32)] = &[
    ("config", 0),
    ("base", 1),
    ("observe", 2),
    ("upstream", 3),
    ("static_files", 3),
    ("lane", 3),
    ("nodes", 4),
    ("generation", 5),
    ("proxy", 6),
    ("server", 7),
    ("control", 8),
    ("admin", 9),
    ("demo", 10),
    ("fuzz_entry", 10),
];

/// The request path: what serves traffic. None of it may reach these.
const DATA_PLANE_MAX: u32 = 7;
const CONTROL_PLANE: &[&str] = &["control", "admin"];

/// The identifier at the start of `s`.
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// `crate::NAME` heads in `text` (and each NAME of `crate::{a, b}`),
/// comments and doc links included: they are references too.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(pos) = rest.find("crate::") {
        let glued = rest[..pos]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        rest = &rest[pos + "crate::".len()..];
        if glued {
            continue;
        }
        match rest.strip_prefix('{') {
            Some(group) => {
                let end = group.find('}').unwrap_or(group.len());
                out.extend(group[..end].split(',').map(|i| ident(i.trim())));
            }
            None => {
                out.insert(ident(rest));
            }
        }
    }
    out.remove("");
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

/// Top-level module → the other top-level modules it imports.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let deps = g.entry(top.clone()).or_default();
        deps.extend(crate_refs(&text).into_iter().filter(|d| *d != top));
    }
    g
}

/// A circle in `g`, if any (depth-first search).
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            match state.get(d.as_str()).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|s| s == d).unwrap();
                    let mut c = stack[from..].to_vec();
                    c.push(d.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(d, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, g, &mut state, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

/// Every way `g` breaks the layering, as readable lines.
fn violations(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut bad = Vec::new();
    for (m, deps) in g {
        let Some(&lm) = layer.get(m.as_str()) else {
            bad.push(format!(
                "module `{m}` has no layer: add it to LAYERS in tests/it/layering.rs"
            ));
            continue;
        };
        for d in deps {
            let Some(&ld) = layer.get(d.as_str()) else {
                continue; // not a module of ours (e.g. a macro path)
            };
            if ld >= lm {
                bad.push(format!(
                    "`{m}` (layer {lm}) imports `{d}` (layer {ld}): only lower layers may be imported"
                ));
            }
            if lm <= DATA_PLANE_MAX && CONTROL_PLANE.contains(&d.as_str()) {
                bad.push(format!(
                    "data-plane module `{m}` imports control-plane `{d}`"
                ));
            }
        }
    }
    if let Some(c) = find_cycle(g) {
        bad.push(format!("import circle: {}", c.join(" → ")));
    }
    bad
}

#[test]
fn layers_import_downward_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(g.len() >= LAYERS.len(), "read too few modules: {g:?}");
    let bad = violations(&g);
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_catches_circles_and_control_imports() {
    let mk = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert!(violations(&mk(&[("proxy", "lane"), ("lane", "base")])).is_empty());
    let circle = violations(&mk(&[("lane", "generation"), ("generation", "lane")]));
    assert!(
        circle.iter().any(|l| l.starts_with("import circle")),
        "{circle:?}"
    );
    let control = violations(&mk(&[("proxy", "control")]));
    assert!(
        control.iter().any(|l| l.contains("control-plane")),
        "{control:?}"
    );
    let sideways = violations(&mk(&[("lane", "upstream")]));
    assert!(!sideways.is_empty(), "same-layer imports are refused");
    let unknown = violations(&mk(&[("newthing", "base")]));
    assert!(unknown.iter().any(|l| l.contains("has no layer")));
    assert_eq!(
        crate_refs("use crate::{a::X, b};\nlet y = crate::c::f(); // notcrate::d"),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
}
