//! Layer: lane. Where a script failed: [`Located`] (`file:line: message`,
//! the form of load-time and runtime errors alike) pulled out of Lua's own
//! messages, and [`ScriptError`], one lane call's failure.

use std::path::{Path, PathBuf};

use crate::config::ConfigError;

/// Which limit stopped a call, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Instructions,
    Memory,
}

/// Converts an mlua error into a located message, pulling `file:line`
/// out of Lua's own message when it carries one.
pub(super) fn lua_error(default_file: &Path, err: &mlua::Error) -> Located {
    let msg = err.to_string();
    let first = msg.lines().next().unwrap_or("").trim();
    // Lua messages look like "path/to/file.lua:12: message" (possibly after
    // "syntax error: " or "runtime error: ").
    let body = first
        .trim_start_matches("syntax error: ")
        .trim_start_matches("runtime error: ");
    if let Some((file, rest)) = body.split_once(".lua:") {
        if let Some((line, message)) = rest.split_once(':') {
            if let Ok(n) = line.parse::<usize>() {
                return Located::new(format!("{file}.lua"), Some(n), message.trim());
            }
        }
    }
    Located::new(default_file, None, first)
}

pub(super) fn located(at: &str, default_file: &Path, message: &str) -> Located {
    if let Some((file, line)) = at.rsplit_once(':') {
        if let Ok(n) = line.parse::<usize>() {
            if !file.is_empty() {
                return Located::new(file, Some(n), message);
            }
        }
    }
    Located::new(default_file, None, message)
}

/// A message placed in a script file (and line, where known): the form of
/// both load-time errors (turned into a [`ConfigError`]) and runtime
/// failures (a [`ScriptError`] message), printed `file:line: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl Located {
    pub(super) fn new(
        file: impl Into<PathBuf>,
        line: Option<usize>,
        message: impl Into<String>,
    ) -> Located {
        Located {
            file: file.into(),
            line,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file.display(), line, self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl From<Located> for ConfigError {
    fn from(l: Located) -> ConfigError {
        ConfigError::new(l.file, l.line, l.message)
    }
}

/// Error from one lane call, already formatted with the script location.
#[derive(Debug, Clone)]
pub struct ScriptError {
    pub message: String,
    /// Set when a sandbox limit stopped the call.
    pub limit: Option<Limit>,
}

impl std::fmt::Display for ScriptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
