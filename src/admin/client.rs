//! Layer: admin. `graygate release …`: a small client of the admin API for
//! operators and scripts (plain HTTP/1.1 to the admin listener).
//!
//! Which gateway: `--admin ADDR`, else the `admin_listen` of the
//! configuration file `-c FILE` names (a main file or an etcd bootstrap,
//! read by the configuration loader's own parsing), else 127.0.0.1:9080.
//! The bearer token: `--token`, else `GRAYGATE_ADMIN_TOKEN`, else that
//! file's `admin_token`. Answers print as tables ([`Output::Table`], the
//! default) or as the API's JSON unchanged ([`Output::Json`], for scripts).

mod table;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{is_bootstrap, parse_yaml, read_file, Bootstrap, ConfigError, MainConfig};

/// The admin listener asked when neither `--admin` nor `-c` says one.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9080";

/// What `graygate release` was asked to do.
pub enum ReleaseCommand {
    List,
    Show(String),
    /// Create from a spec file (YAML or JSON).
    Create(PathBuf),
    /// `promote`, `pause`, `resume` or `abort`.
    Act(String, String),
    /// Finish a promoted or rolled-back release (`POST
    /// /releases/NAME/finish`); with `relabel_nodes`, the node files'
    /// promoted nodes become formal too.
    Finish {
        name: String,
        relabel_nodes: bool,
    },
}

/// How answers are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Tables and one-line summaries, for people.
    Table,
    /// The API's JSON as it came, for scripts.
    Json,
}

/// Where the admin address came from, as the operator is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `--admin ADDR`.
    Flag,
    /// The `admin_listen` of this configuration file.
    Config(PathBuf),
    /// Neither: [`DEFAULT_ADMIN`].
    Default,
}

/// The gateway a command talks to.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: String,
    pub origin: Origin,
    pub token: Option<String>,
}

impl Target {
    /// `admin` (`--admin`) wins; else the admin listener of `config`
    /// (`-c`); else [`DEFAULT_ADMIN`]. `token` (`--token` or the
    /// environment) wins over the file's `admin_token`. A file that is
    /// named is read whatever wins: it cannot be read, or (without
    /// `--admin`) has no usable admin listener → the line to print.
    pub fn resolve(
        admin: Option<String>,
        config: Option<&Path>,
        token: Option<String>,
    ) -> Result<Target, String> {
        let token = token.filter(|t| !t.is_empty());
        let Some(file) = config else {
            return Ok(match admin {
                Some(addr) => Target {
                    addr,
                    origin: Origin::Flag,
                    token,
                },
                None => Target {
                    addr: DEFAULT_ADMIN.to_string(),
                    origin: Origin::Default,
                    token,
                },
            });
        };
        let settings = AdminSettings::read(file).map_err(|e| e.to_string())?;
        let token = token.or(settings.token);
        if let Some(addr) = admin {
            return Ok(Target {
                addr,
                origin: Origin::Flag,
                token,
            });
        }
        let shown = file.display();
        let listen = settings.listen.ok_or_else(|| {
            format!(
                "{shown}: no admin_listen: that gateway serves no admin API (set admin_listen, or pass --admin ADDR)"
            )
        })?;
        if listen.port() == 0 {
            return Err(format!(
                "{shown}: admin_listen {listen} takes a port the system picks at start: pass --admin with the address the gateway bound"
            ));
        }
        Ok(Target {
            addr: connectable(listen).to_string(),
            origin: Origin::Config(file.to_path_buf()),
            token,
        })
    }

    /// `127.0.0.1:9080 (from /etc/graygate/graygate.yaml)`, `… (--admin)`,
    /// `… (default)`.
    pub fn describe(&self) -> String {
        match &self.origin {
            Origin::Flag => format!("{} (--admin)", self.addr),
            Origin::Config(file) => format!("{} (from {})", self.addr, file.display()),
            Origin::Default => format!("{} (default)", self.addr),
        }
    }
}

/// What a configuration file says of its gateway's admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSettings {
    /// `admin_listen`, if any.
    pub listen: Option<SocketAddr>,
    /// `admin_token` (a main file; a bootstrap's token is in etcd).
    pub token: Option<String>,
}

impl AdminSettings {
    /// Reads `path` as the gateway does at start: a bootstrap (a top-level
    /// `etcd:` key) or a main file, parsed by the loader's own types, so
    /// an error names the file and line in the loader's words.
    pub fn read(path: &Path) -> Result<AdminSettings, ConfigError> {
        let text = read_file(path)?;
        if is_bootstrap(&text) {
            let b: Bootstrap = parse_yaml(path, &text)?;
            return Ok(AdminSettings {
                listen: b.admin_listen,
                token: None,
            });
        }
        let c: MainConfig = parse_yaml(path, &text)?;
        Ok(AdminSettings {
            listen: c.admin_listen,
            token: c.admin_token.filter(|t| !t.is_empty()),
        })
    }
}

/// An address to connect to for a listening one: a wildcard (`0.0.0.0`,
/// `[::]`) is reached on loopback.
fn connectable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    }
}

/// Why a command failed: the line to print, and whether a gateway
/// answered (so the caller can still say which one).
#[derive(Debug)]
pub struct Failure {
    pub answered: bool,
    pub message: String,
}

impl Failure {
    fn before_answer(message: String) -> Failure {
        Failure {
            answered: false,
            message,
        }
    }
}

/// Sends one request to the admin API; returns the status and body.
fn call(target: &Target, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let admin = &target.addr;
    let unreachable =
        |e: std::io::Error| format!("cannot reach graygate at {}: {e}", target.describe());
    let mut s = TcpStream::connect(admin.as_str()).map_err(unreachable)?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let auth = target
        .token
        .as_deref()
        .map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {admin}\r\n{auth}Content-Type: application/yaml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(unreachable)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("graygate at {} did not answer: {e}", target.describe()))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let malformed = || format!("{} answered something other than HTTP", target.describe());
    let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(malformed)?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(malformed)?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A release name as one path segment.
fn segment(name: &str) -> String {
    const KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(name, KEEP).to_string()
}

/// Runs the command against `target`; `Ok` is what to print on stdout
/// (a gateway answered, with success).
pub fn release(target: &Target, cmd: ReleaseCommand, output: Output) -> Result<String, Failure> {
    let spec_file = match &cmd {
        ReleaseCommand::Create(file) => Some(file.clone()),
        _ => None,
    };
    let (method, path, body, verb) = match &cmd {
        ReleaseCommand::List => ("GET", "/releases".to_string(), String::new(), ""),
        ReleaseCommand::Show(n) => (
            "GET",
            format!("/releases/{}", segment(n)),
            String::new(),
            "",
        ),
        ReleaseCommand::Create(file) => {
            let spec = std::fs::read_to_string(file).map_err(|e| {
                Failure::before_answer(format!("{}: cannot read: {e}", file.display()))
            })?;
            ("POST", "/releases".to_string(), spec, "created")
        }
        ReleaseCommand::Act(n, a) => {
            let verb = match a.as_str() {
                "promote" => "promoted",
                "pause" => "paused",
                "resume" => "resumed",
                "abort" => "aborted",
                _ => "done",
            };
            (
                "POST",
                format!("/releases/{}/{a}", segment(n)),
                String::new(),
                verb,
            )
        }
        ReleaseCommand::Finish {
            name,
            relabel_nodes,
        } => {
            let query = if *relabel_nodes {
                "?relabel_nodes=true"
            } else {
                ""
            };
            let path = format!("/releases/{}/finish{query}", segment(name));
            ("POST", path, String::new(), "finished")
        }
    };
    let (status, text) = call(target, method, &path, &body).map_err(Failure::before_answer)?;
    if !(200..300).contains(&status) {
        let text = text.trim_end();
        // A refused spec names the file it came from.
        let message = match (spec_file, text.strip_prefix("release spec")) {
            (Some(file), Some(rest)) => format!("{}{rest}", file.display()),
            _ if status == 401 => format!(
                "{status}: {text} (the admin token: --token, GRAYGATE_ADMIN_TOKEN, or admin_token in the file -c names)"
            ),
            _ => format!("{status}: {text}"),
        };
        return Err(Failure {
            answered: true,
            message,
        });
    }
    Ok(render(&cmd, verb, &text, output))
}

/// The answer as it is printed: JSON as it came (with a final newline),
/// or a table / summary; an answer that is not the JSON expected is
/// printed as it came.
fn render(cmd: &ReleaseCommand, verb: &str, text: &str, output: Output) -> String {
    let raw = || {
        let mut t = text.to_string();
        if !t.is_empty() && !t.ends_with('\n') {
            t.push('\n');
        }
        t
    };
    if output == Output::Json {
        return raw();
    }
    let doc: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let shown = match (cmd, &doc) {
        (ReleaseCommand::List, Some(doc)) => table::list(doc),
        (ReleaseCommand::Show(_), Some(doc)) => table::show(doc),
        (ReleaseCommand::Finish { name, .. }, None) if text.trim().is_empty() => {
            Some(format!("release {name}: finished\n"))
        }
        (
            ReleaseCommand::Create(_) | ReleaseCommand::Act(..) | ReleaseCommand::Finish { .. },
            Some(doc),
        ) => table::summary(verb, doc),
        _ => None,
    };
    shown.unwrap_or_else(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_admin_listener_is_reached_on_loopback() {
        let a: SocketAddr = "0.0.0.0:9080".parse().unwrap();
        assert_eq!(connectable(a).to_string(), "127.0.0.1:9080");
        let a: SocketAddr = "[::]:9080".parse().unwrap();
        assert_eq!(connectable(a).to_string(), "[::1]:9080");
        let a: SocketAddr = "10.0.0.5:9080".parse().unwrap();
        assert_eq!(connectable(a), a);
    }

    #[test]
    fn names_are_one_path_segment() {
        assert_eq!(segment("checkout-v2.1_a"), "checkout-v2.1_a");
        assert_eq!(segment("a/b?c"), "a%2Fb%3Fc");
    }

    #[test]
    fn json_is_printed_as_it_came() {
        let text = r#"{"releases":[],"source":"files"}"#;
        let out = render(&ReleaseCommand::List, "", text, Output::Json);
        assert_eq!(out, format!("{text}\n"));
    }

    #[test]
    fn an_answer_that_is_not_the_json_expected_is_printed_as_it_came() {
        let out = render(&ReleaseCommand::List, "", "not json", Output::Table);
        assert_eq!(out, "not json\n");
    }
}
