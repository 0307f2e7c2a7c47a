//! Layer: admin. `graygate release …`: a small client of the admin API for
//! operators and scripts (plain HTTP/1.1 to the admin listener, bearer token
//! from `--token` or `GRAYGATE_ADMIN_TOKEN`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What `graygate release` was asked to do.
pub enum ReleaseCommand {
    List,
    Show(String),
    /// Create from a spec file (YAML or JSON).
    Create(std::path::PathBuf),
    /// `promote`, `pause`, `resume` or `abort`.
    Act(String, String),
}

/// Sends one request to the admin API; returns the status and body.
fn call(
    admin: &str,
    method: &str,
    path: &str,
    body: &str,
    token: Option<&str>,
) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(admin).map_err(|e| format!("cannot reach {admin}: {e}"))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {admin}\r\n{auth}Content-Type: application/yaml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").ok_or("malformed answer")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("malformed status line")?;
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

/// Runs the command and prints the answer; Err carries what to print on
/// failure.
pub fn release(admin: &str, token: Option<&str>, cmd: ReleaseCommand) -> Result<String, String> {
    let spec_file = match &cmd {
        ReleaseCommand::Create(file) => Some(file.clone()),
        _ => None,
    };
    let (method, path, body) = match cmd {
        ReleaseCommand::List => ("GET", "/releases".to_string(), String::new()),
        ReleaseCommand::Show(n) => ("GET", format!("/releases/{n}"), String::new()),
        ReleaseCommand::Create(file) => {
            let spec =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            ("POST", "/releases".to_string(), spec)
        }
        ReleaseCommand::Act(n, a) => ("POST", format!("/releases/{n}/{a}"), String::new()),
    };
    let (status, text) = call(admin, method, &path, &body, token)?;
    if (200..300).contains(&status) {
        Ok(text)
    } else {
        let text = text.trim_end();
        // A refused spec names the file it came from.
        match (spec_file, text.strip_prefix("release spec")) {
            (Some(file), Some(rest)) => Err(format!("{}{rest}", file.display())),
            _ => Err(format!("{status}: {text}")),
        }
    }
}
