//! Layer: lane. Loading a lane script: its source and, transitively, the
//! modules it `require`s (inside the script's directory only, Lua source
//! only), so a reload validates and watches every file it was built from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::{find_line, ConfigError};
use crate::config::{DEFAULT_INSTRUCTION_BUDGET, DEFAULT_MEMORY_LIMIT};
use crate::lane::shared_dict::SharedDict;

/// The script and every module it requires, read from disk at load time.
#[derive(Debug)]
pub struct ScriptSource {
    pub path: PathBuf,
    pub dir: PathBuf,
    pub source: String,
    /// Module name → (file, source), resolved inside `dir` only.
    pub modules: BTreeMap<String, (PathBuf, String)>,
    pub instruction_budget: u64,
    pub memory_limit: usize,
    /// LuaJIT's trace compiler on (`script_limits.jit`).
    pub jit: bool,
    /// `ngx.shared` dictionaries the script may use.
    pub dicts: BTreeMap<String, Arc<SharedDict>>,
    /// Unique per load; a VM built for another id is rebuilt.
    pub id: u64,
}

pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl ScriptSource {
    /// Reads the script and, transitively, the modules it `require`s.
    pub fn load(path: &Path) -> Result<ScriptSource, ConfigError> {
        Self::load_from(&crate::config::docs::FileDocs, path)
    }

    /// As [`ScriptSource::load`], reading the script and its modules from
    /// `docs` (files or a store's snapshot).
    pub fn load_from(
        docs: &dyn crate::config::docs::Docs,
        path: &Path,
    ) -> Result<ScriptSource, ConfigError> {
        let source = read_script(docs, path)?;
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let mut modules = BTreeMap::new();
        let mut pending = vec![(path.to_path_buf(), source.clone())];
        while let Some((file, text)) = pending.pop() {
            for name in required_modules(&text) {
                if modules.contains_key(&name) || BUILTIN_MODULES.contains(&name.as_str()) {
                    continue;
                }
                let mpath = module_path(&dir, &name).ok_or_else(|| {
                    ConfigError::new(
                        &file,
                        find_line(&text, None, &name),
                        format!("invalid module name {name:?} (letters, digits, _ and . only)"),
                    )
                })?;
                let mtext = read_script(docs, &mpath).map_err(|e| {
                    ConfigError::new(
                        &file,
                        find_line(&text, None, &name),
                        format!("require {name:?}: {}", e.message),
                    )
                })?;
                pending.push((mpath.clone(), mtext.clone()));
                modules.insert(name, (mpath, mtext));
            }
        }
        Ok(ScriptSource {
            path: path.to_path_buf(),
            dir,
            source,
            modules,
            instruction_budget: DEFAULT_INSTRUCTION_BUDGET,
            memory_limit: DEFAULT_MEMORY_LIMIT,
            jit: false,
            dicts: BTreeMap::new(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The script's and its modules' source text.
    pub(crate) fn texts(&self) -> impl Iterator<Item = &str> + Clone {
        std::iter::once(self.source.as_str())
            .chain(self.modules.values().map(|(_, text)| text.as_str()))
    }

    /// Every file this script was built from (for the reload watcher).
    pub fn files(&self) -> Vec<PathBuf> {
        let mut v = vec![self.path.clone()];
        v.extend(self.modules.values().map(|(p, _)| p.clone()));
        v
    }
}

/// Libraries `require` returns from the sandbox itself (OpenResty scripts
/// often start with `local bit = require "bit"`).
pub(super) const BUILTIN_MODULES: [&str; 8] = [
    "bit",
    "ngx",
    "string",
    "table",
    "math",
    "coroutine",
    "table.new",
    "table.clear",
];

/// Reads Lua source text; precompiled bytecode is refused.
fn read_script(docs: &dyn crate::config::docs::Docs, path: &Path) -> Result<String, ConfigError> {
    let bytes = docs.read_bytes(path)?;
    if bytes.first() == Some(&0x1b) {
        return Err(ConfigError::new(
            path,
            Some(1),
            "precompiled Lua bytecode is not allowed; ship the source",
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| ConfigError::new(path, None, "cannot read: not valid UTF-8 text"))
}

fn required_modules(text: &str) -> Vec<String> {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| {
        regex::Regex::new(r#"require\s*\(?\s*["']([^"']+)["']"#).expect("static regex")
    });
    static COMMENTS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let comments = COMMENTS
        .get_or_init(|| regex::Regex::new(r"(?s)--\[\[.*?\]\]|--[^\n]*").expect("static regex"));
    let code = comments.replace_all(text, "");
    re.captures_iter(&code).map(|c| c[1].to_string()).collect()
}

fn module_path(dir: &Path, name: &str) -> Option<PathBuf> {
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
        && !name.starts_with('.')
        && !name.contains("..");
    ok.then(|| dir.join(format!("{}.lua", name.replace('.', "/"))))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load_src, validate_error, write};
    use super::*;
    use mlua::Lua;

    #[test]
    fn syntax_error_is_located() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "s.lua", "return function(req)\n  if then\nend\n");
        let src = ScriptSource::load(&p).unwrap();
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.file.ends_with("s.lua"), "{err}");
        // A stray `end`, in the script and in a module: Lua's own message
        // and line, not the budget rewrite's wrapper's.
        let extra_end = "return function(req)\n  return 'gray'\nend end\n";
        let p = write(d.path(), "e.lua", extra_end);
        let err = validate_error(&p);
        assert_eq!(err.line, Some(3), "{err}");
        assert!(err.message.contains("'<eof>' expected"), "{err}");
        write(d.path(), "m.lua", extra_end);
        let p = write(d.path(), "main.lua", "local m = require('m')\nreturn m\n");
        let err = validate_error(&p);
        assert!(err.file.ends_with("m.lua"), "{err}");
        assert_eq!(err.line, Some(3), "{err}");
    }

    #[test]
    fn modules_are_found_and_recorded() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "lib/util.lua", "return { x = 1 }\n");
        let p = write(
            d.path(),
            "main.lua",
            "local u = require('lib.util')\nreturn function() return u.x == 1 and 'gray' or nil end\n",
        );
        let src = ScriptSource::load(&p).unwrap();
        assert_eq!(src.files().len(), 2);
        src.validate(&Arc::new(BTreeMap::new())).unwrap();
    }

    #[test]
    fn requires_in_comments_are_ignored() {
        assert_eq!(
            required_modules(
                "-- require('a')\n--[[ require('b')\n]] local c = require 'c' -- require('d')\n"
            ),
            vec!["c".to_string()]
        );
    }

    #[test]
    fn require_outside_scripts_dir_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "main.lua",
            "local u = require('..secret')\nreturn function() end\n",
        );
        let err = ScriptSource::load(&p).unwrap_err();
        assert!(err.message.contains("invalid module name"), "{err}");
    }

    #[test]
    fn must_return_a_function() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "main.lua", "return 42\n");
        let err = validate_error(&p);
        assert!(err.message.contains("must return a function"), "{err}");
    }

    #[test]
    fn the_rewrites_reserved_names_are_refused_at_load_with_file_and_line() {
        let (_d, src) = load_src("local x = 1\nlocal __gg_b = {}\nreturn function() end\n");
        let err = src.validate(&Arc::new(BTreeMap::new())).unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.message.contains("reserved"), "{err}");
        // In a required module too, placed in the module's file.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "m.lua", "local t = {}\n\nt.__gg = 1\nreturn t\n");
        let p = write(
            d.path(),
            "main.lua",
            "local m = require('m')\nreturn function() end\n",
        );
        let err = validate_error(&p);
        assert!(err.file.ends_with("m.lua"), "{err}");
        assert_eq!(err.line, Some(3), "{err}");
    }

    #[test]
    fn bytecode_is_refused() {
        let lua = Lua::new();
        let f = lua
            .load("return function() return 'gray' end")
            .into_function()
            .unwrap();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("b.lua");
        std::fs::write(&p, f.dump(false)).unwrap();
        let err = ScriptSource::load(&p).unwrap_err();
        assert!(err.message.contains("bytecode"), "{err}");
        // ...as a required module too.
        std::fs::write(d.path().join("m.lua"), f.dump(true)).unwrap();
        let main = write(d.path(), "main.lua", "local m = require('m')\nreturn m\n");
        let err = ScriptSource::load(&main).unwrap_err();
        assert!(err.message.contains("bytecode"), "{err}");
    }
}
