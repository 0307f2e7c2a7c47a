//! Layer: observe (uses base, config). The access log: one line per request,
//! text or JSON, written by a dedicated thread. Requests hand their line over a
//! bounded channel and never wait: when the writer falls behind, lines are
//! dropped and counted (`graygate_access_log_dropped_total`). On SIGUSR1 the
//! writer reopens its file by path ([`AccessLog::reopen`]), so logrotate can
//! rename the file away and the next lines land in a new one.

use std::io::Write;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, SystemTime};

use prometheus::IntCounter;
use tokio::sync::mpsc;

use crate::config::{AccessLogConfig, AccessLogFormat};

/// One request's log record.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Entry {
    /// RFC 3339, milliseconds, UTC.
    pub time: String,
    pub client_ip: IpAddr,
    pub method: String,
    pub path: String,
    /// The status recorded — the one metrics and the release analysis
    /// count: a node's answer that failed after its head (a body it broke
    /// off, a counted gRPC status) shows as the gateway's status for it.
    pub status: u16,
    /// The status the client's head said, when it differs from `status`
    /// (the head had gone out before the failure).
    pub sent_status: Option<u16>,
    pub lane: String,
    /// What decided the lane (`script`, `trusted_tag`, `rule`, …).
    pub decided_by: String,
    /// The deciding rule's name, when a named rule decided.
    pub rule: Option<String>,
    pub node: String,
    /// Milliseconds waiting for the upstream's response head (API routes).
    pub upstream_ms: Option<f64>,
    /// Milliseconds from request head to the end of the response body.
    pub total_ms: f64,
    /// What failed (`client_abort`, `client_body`, `upstream_body`,
    /// `connect`, …), when the request did not end as the node answered.
    pub error: Option<&'static str>,
    /// W3C trace id and the gateway's span id (`otel:` configured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub span_id: Option<String>,
}

impl Entry {
    pub fn now_string() -> String {
        humantime::format_rfc3339_millis(SystemTime::now()).to_string()
    }

    /// Milliseconds with microsecond precision.
    pub fn ms(d: Duration) -> f64 {
        (d.as_micros() as f64) / 1000.0
    }

    /// The line, without its newline.
    pub fn format(&self, format: AccessLogFormat) -> String {
        match format {
            AccessLogFormat::Json => serde_json::to_string(self).unwrap_or_default(),
            AccessLogFormat::Text => {
                let up = self
                    .upstream_ms
                    .map_or_else(|| "-".to_string(), |u| format!("{u:.3}"));
                let mut line = format!(
                    "{} {} \"{} {}\" {} lane={} decided_by={} rule={} node={} upstream_ms={} total_ms={:.3} error={} sent_status={}",
                    self.time,
                    self.client_ip,
                    self.method,
                    self.path.escape_debug(),
                    self.status,
                    self.lane,
                    self.decided_by,
                    self.rule.as_deref().unwrap_or("-"),
                    self.node,
                    up,
                    self.total_ms,
                    self.error.unwrap_or("-"),
                    self.sent_status
                        .map_or_else(|| "-".to_string(), |s| s.to_string())
                );
                if let (Some(t), Some(s)) = (&self.trace_id, &self.span_id) {
                    line.push_str(" trace_id=");
                    line.push_str(t);
                    line.push_str(" span_id=");
                    line.push_str(s);
                }
                line
            }
        }
    }
}

/// What the writer thread receives. Lines are nearly every message, so they
/// stay unboxed (no allocation per line; a channel slot held an `Entry`
/// before reopening existed).
#[allow(clippy::large_enum_variant)]
enum Msg {
    Line(Entry),
    /// Reopen the file by its path (log rotation).
    Reopen,
}

/// The request-side handle: off, or a bounded sender.
pub struct AccessLog {
    tx: Option<mpsc::Sender<Msg>>,
    dropped: IntCounter,
}

fn open_target(target: &Path, path: &Path) -> std::io::Result<Box<dyn Write>> {
    Ok(match target.to_str() {
        Some("stdout") => Box::new(std::io::stdout()),
        Some("stderr") => Box::new(std::io::stderr()),
        _ => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
    })
}

impl AccessLog {
    pub fn off(dropped: IntCounter) -> AccessLog {
        AccessLog { tx: None, dropped }
    }

    /// Starts the writer thread for `cfg` (`path` resolved against `root`).
    /// The file is opened by the writer, so a slow or blocked target never
    /// stalls start-up or requests.
    pub fn start(cfg: &AccessLogConfig, root: &Path, dropped: IntCounter) -> AccessLog {
        let (tx, mut rx) = mpsc::channel::<Msg>(cfg.buffer.max(1));
        let format = cfg.format;
        let target = cfg.path.clone();
        let path = crate::config::resolve(root, &cfg.path);
        let spawned = std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let out = match open_target(&target, &path) {
                    Ok(out) => out,
                    Err(e) => {
                        tracing::error!(path = %path.display(), error = %e, "cannot open access log; it stays off");
                        return;
                    }
                };
                let mut buf = std::io::BufWriter::new(out);
                while let Some(mut msg) = rx.blocking_recv() {
                    // Batch whatever is already queued, then flush.
                    loop {
                        match msg {
                            Msg::Line(e) => {
                                let _ = writeln!(buf, "{}", e.format(format));
                            }
                            Msg::Reopen => {
                                let _ = buf.flush();
                                match open_target(&target, &path) {
                                    Ok(out) => {
                                        buf = std::io::BufWriter::new(out);
                                        tracing::info!(path = %path.display(), "access log reopened");
                                    }
                                    // Keep writing to the old file rather
                                    // than lose lines.
                                    Err(e) => tracing::error!(path = %path.display(), error = %e, "cannot reopen access log; writing on to the old file"),
                                }
                            }
                        }
                        match rx.try_recv() {
                            Ok(m) => msg = m,
                            Err(_) => break,
                        }
                    }
                    let _ = buf.flush();
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the access log writer");
            return AccessLog::off(dropped);
        }
        AccessLog {
            tx: Some(tx),
            dropped,
        }
    }

    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues `entry` without waiting; drops (and counts) it when full.
    pub fn log(&self, entry: Entry) {
        if let Some(tx) = &self.tx {
            if tx.try_send(Msg::Line(entry)).is_err() {
                self.dropped.inc();
            }
        }
    }

    /// Asks the writer to reopen the file (SIGUSR1). Waits for room in the
    /// queue (control plane only), so the request is never dropped.
    pub async fn reopen(&self) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Reopen).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            time: "2026-01-02T03:04:05.678Z".into(),
            client_ip: "127.0.9.1".parse().unwrap(),
            method: "GET".into(),
            path: "/api/x".into(),
            status: 200,
            sent_status: None,
            lane: "gray".into(),
            decided_by: "script".into(),
            rule: None,
            node: "g1".into(),
            upstream_ms: Some(1.5),
            total_ms: 2.25,
            error: None,
            trace_id: None,
            span_id: None,
        }
    }

    #[test]
    fn text_line() {
        assert_eq!(
            entry().format(AccessLogFormat::Text),
            "2026-01-02T03:04:05.678Z 127.0.9.1 \"GET /api/x\" 200 lane=gray decided_by=script rule=- node=g1 upstream_ms=1.500 total_ms=2.250 error=- sent_status=-"
        );
        let broken = Entry {
            status: 502,
            sent_status: Some(200),
            error: Some("upstream_body"),
            ..entry()
        };
        assert!(
            broken
                .format(AccessLogFormat::Text)
                .ends_with("\" 502 lane=gray decided_by=script rule=- node=g1 upstream_ms=1.500 total_ms=2.250 error=upstream_body sent_status=200"),
        );
    }

    #[test]
    fn json_line() {
        let v: serde_json::Value =
            serde_json::from_str(&entry().format(AccessLogFormat::Json)).unwrap();
        assert_eq!(v["client_ip"], "127.0.9.1");
        assert_eq!(v["lane"], "gray");
        assert_eq!(v["upstream_ms"], 1.5);
        assert_eq!(v["total_ms"], 2.25);
        assert_eq!(v["sent_status"], serde_json::Value::Null);
        assert!(v.get("trace_id").is_none(), "no trace fields without otel");
        let traced = Entry {
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
            span_id: Some("00f067aa0ba902b7".into()),
            ..entry()
        };
        let v: serde_json::Value =
            serde_json::from_str(&traced.format(AccessLogFormat::Json)).unwrap();
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(v["span_id"], "00f067aa0ba902b7");
        assert!(traced.format(AccessLogFormat::Text).ends_with(
            " sent_status=- trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7"
        ));
    }

    #[test]
    fn full_channel_drops_and_counts_instead_of_waiting() {
        let dropped = IntCounter::new("d", "d").unwrap();
        let (tx, _rx) = mpsc::channel(2);
        let log = AccessLog {
            tx: Some(tx),
            dropped: dropped.clone(),
        };
        for _ in 0..5 {
            log.log(entry());
        }
        assert_eq!(dropped.get(), 3);
    }
}
