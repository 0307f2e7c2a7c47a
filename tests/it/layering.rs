//! The house keeps its layers: every top-level module of `src/` imports
//! only from modules of a lower layer (so no import circle can form), and
//! the data plane never imports the control plane. Reads the `crate::…`
//! paths (and `use crate::{a, b}` groups) of every source file. Inside
//! every module directory, sibling modules form no import circle either
//! (`super::x` and `crate::…::x` paths, test code aside).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layer of each top-level module, lowest first. A new module must be
/// placed here.
const LAYERS: &[(&str, u32)] = &[
    ("config", 0),
    ("base", 1),
    ("codec", 2),
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

/// The non-test part of a source file: up to its first `#[cfg(test)]`
/// (test modules may reach anywhere).
fn non_test(text: &str) -> &str {
    text.find("#[cfg(test)]").map_or(text, |i| &text[..i])
}

/// Within `dir` (a module directory under `src`, e.g. `lane/script`): each
/// child module → the siblings it imports (`super::x`, or the full
/// `crate::…::x` path), test code aside.
fn sibling_graph(src: &Path, dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let full = src.join(dir);
    let prefix = format!("crate::{}::", dir.replace('/', "::"));
    let mut files = Vec::new();
    walk(&full, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&full).unwrap();
        let mut parts = rel.components();
        let first = parts.next().unwrap().as_os_str().to_string_lossy();
        let child = first.trim_end_matches(".rs").to_string();
        // mod.rs is the parent; `testing` helpers are test code.
        if child == "mod" || f.file_stem().is_some_and(|s| s == "testing") {
            continue;
        }
        // A file directly in `dir` sees its siblings as `super::`; one in a
        // child directory as `super::super::` (its mod.rs: `super::`).
        let depth = rel.components().count() - usize::from(rel.ends_with("mod.rs"));
        let up = "super::".repeat(depth);
        let text = std::fs::read_to_string(f).unwrap();
        let text = non_test(&text);
        let deps = g.entry(child.clone()).or_default();
        for head in [up.as_str(), prefix.as_str()] {
            let mut rest = text;
            while let Some(pos) = rest.find(head) {
                let glued = rest[..pos]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
                rest = &rest[pos + head.len()..];
                if glued {
                    continue;
                }
                let names: Vec<String> = match rest.strip_prefix('{') {
                    Some(group) => {
                        let end = group.find('}').unwrap_or(group.len());
                        group[..end].split(',').map(|i| ident(i.trim())).collect()
                    }
                    None => vec![ident(rest)],
                };
                deps.extend(names.into_iter().filter(|n| !n.is_empty() && *n != child));
            }
        }
    }
    // Only edges to sibling modules (not to items of mod.rs).
    let children: BTreeSet<String> = g.keys().cloned().collect();
    for deps in g.values_mut() {
        deps.retain(|d| children.contains(d));
    }
    g
}

/// Every module directory under `src` (relative, `/`-separated).
fn module_dirs(src: &Path, rel: &str, out: &mut Vec<String>) {
    for e in std::fs::read_dir(src.join(rel)).unwrap().flatten() {
        if e.path().is_dir() {
            let name = e.file_name().to_string_lossy().into_owned();
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            out.push(child.clone());
            module_dirs(src, &child, out);
        }
    }
}

#[test]
fn sibling_modules_form_no_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = Vec::new();
    module_dirs(&src, "", &mut dirs);
    let mut bad = Vec::new();
    for dir in &dirs {
        let mut g = sibling_graph(&src, dir);
        while let Some(c) = find_cycle(&g) {
            bad.push(format!("{dir}: {}", c.join(" → ")));
            g.get_mut(&c[0]).unwrap().remove(&c[1]);
        }
    }
    assert!(
        bad.is_empty(),
        "import circles between sibling modules:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_sibling_checker_reads_super_and_crate_paths_and_skips_tests() {
    let dir = std::env::temp_dir().join(format!("gg-layering-{}", std::process::id()));
    let m = dir.join("a");
    std::fs::create_dir_all(m.join("z")).unwrap();
    std::fs::write(m.join("x.rs"), "use super::y::Y;\n").unwrap();
    std::fs::write(
        m.join("y.rs"),
        "pub struct Y;\n#[cfg(test)]\nuse super::x;\n",
    )
    .unwrap();
    std::fs::write(m.join("z/mod.rs"), "use crate::a::{x, w};\n").unwrap();
    std::fs::write(m.join("z/inner.rs"), "use super::super::y;\n").unwrap();
    std::fs::write(m.join("testing.rs"), "use super::z;\n").unwrap();
    let g = sibling_graph(&dir, "a");
    let edges = |n: &str| g[n].iter().cloned().collect::<Vec<_>>();
    assert_eq!(edges("x"), ["y"]);
    assert!(edges("y").is_empty(), "test code is not an edge");
    assert_eq!(
        edges("z"),
        ["x", "y"],
        "crate paths and a nested file count"
    );
    assert!(!g.contains_key("testing"));
    assert!(find_cycle(&g).is_none());
    std::fs::write(m.join("y.rs"), "use crate::a::z::Z;\n").unwrap();
    assert!(find_cycle(&sibling_graph(&dir, "a")).is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The configuration stores and discovery sources (etcd, Nacos) are named
/// only behind the source seam: `src/control/source/` (and, for each
/// source's settings, `src/config/`). Everywhere else — code, string
/// literals, the dashboard's script — goes through `source::Store`,
/// `source::discovery` and `source::cli` and takes a store's name from
/// it. Comments may still say which store a behaviour is about; test code
/// aside.
const STORE_NAMES: &[&str] = &["etcd", "nacos"];
const SEAM_DIRS: &[&str] = &["control/source", "config"];

/// `text` (Rust) without its comments: line and block comments blanked,
/// string and char literals kept (a `//` inside a string is not a
/// comment).
fn rust_without_comments(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            i += end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            i += end;
        } else if rest.starts_with("r\"") || rest.starts_with("r#") {
            let hashes = rest[1..].chars().take_while(|c| *c == '#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 1 + hashes + 1;
            let end = rest[body..]
                .find(&close)
                .map_or(rest.len(), |e| body + e + close.len());
            out.push_str(&rest[..end]);
            i += end;
        } else if rest.starts_with('"') {
            let mut j = 1;
            while j < rest.len() {
                match rest.as_bytes()[j] {
                    b'\\' => j += 2,
                    b'"' => {
                        j += 1;
                        break;
                    }
                    _ => j += 1,
                }
            }
            let j = j.min(rest.len());
            out.push_str(&rest[..j]);
            i += j;
        } else if let Some(esc) = rest.strip_prefix("'\\") {
            let end = esc.find('\'').map_or(rest.len(), |e| e + 3);
            out.push_str(&rest[..end]);
            i += end;
        } else if rest.len() >= 3
            && rest.starts_with('\'')
            && rest[1..].chars().nth(1) == Some('\'')
        {
            let n = 2 + rest[1..].chars().next().unwrap().len_utf8();
            out.push_str(&rest[..n]);
            i += n;
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// A non-Rust asset (script, page, style) with its comment lines blanked
/// (so line numbers stay).
fn asset_without_comments(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            let comment = ["//", "/*", "*", "<!--"].iter().any(|c| t.starts_with(c));
            if comment {
                ""
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every line outside the seam that names a store, as `path:line: text`.
fn store_names_outside_the_seam(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    fn all(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                all(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    all(src, &mut files);
    let mut bad = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if SEAM_DIRS
            .iter()
            .any(|d| rel.starts_with(&format!("{d}/")) || rel == format!("{d}.rs"))
        {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue; // not text (an image)
        };
        let code = if rel.ends_with(".rs") {
            rust_without_comments(non_test(&text))
        } else {
            asset_without_comments(&text)
        };
        for (n, line) in code.lines().enumerate() {
            let lower = line.to_ascii_lowercase();
            if STORE_NAMES.iter().any(|s| lower.contains(s)) {
                bad.push(format!("src/{rel}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    bad
}

#[test]
fn no_module_outside_the_sources_names_a_store() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = store_names_outside_the_seam(&src);
    assert!(
        bad.is_empty(),
        "a store named outside src/control/source/ and src/config/ (go through source::Store, \
         source::discovery or source::cli, and take the name from Store::name):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_store_name_checker_reads_code_and_strings_not_comments() {
    let code = rust_without_comments(
        "// etcd here\nlet a = \"http://x\"; // nacos\n/* etcd */ let b = 'x'; let c = \"Nacos\";\nfn f<'a>() {}\n",
    );
    assert!(!code.contains("etcd"), "{code}");
    assert!(code.contains("\"http://x\""), "{code}");
    assert!(
        code.contains("\"Nacos\""),
        "a string literal counts: {code}"
    );
    assert!(code.contains("fn f<'a>()"), "{code}");
    let dir = std::env::temp_dir().join(format!("gg-store-names-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("control/source")).unwrap();
    std::fs::create_dir_all(dir.join("admin")).unwrap();
    std::fs::write(dir.join("control/source/x.rs"), "let etcd = 1;\n").unwrap();
    std::fs::write(
        dir.join("admin/y.rs"),
        "// etcd\nlet s = gw.etcd;\n#[cfg(test)]\nlet t = \"nacos\";\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("admin/z.js"),
        "// nacos\nif (s === \"Nacos\") {}\n",
    )
    .unwrap();
    let mut bad = store_names_outside_the_seam(&dir);
    bad.sort();
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(bad[0].starts_with("src/admin/y.rs:2:"), "{bad:?}");
    assert!(bad[1].starts_with("src/admin/z.js:2:"), "{bad:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
