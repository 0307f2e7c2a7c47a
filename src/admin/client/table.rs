//! Layer: admin. The tables `graygate release list|show` print and the
//! one-line summaries of its actions, from the API's JSON read as
//! `serde_json::Value`: a field the API adds is ignored, one it lacks is
//! shown as `-`. `None`: not the document expected (the caller prints it
//! as it came). Steps count from 0, as the API, the dashboard, the gauge
//! and the log lines do.

use std::fmt::Write as _;

use serde_json::Value;

/// Longest `LAST` cell of `list` (characters; the full reasons are in
/// `show`).
const LAST_WIDTH: usize = 60;

/// Outcomes that are judgements (their figures are the interval's); the
/// rest are actions (`step`, `promote`, `pause`, …) with no figures.
const JUDGED: &[&str] = &["pass", "fail", "inconclusive", "error"];

/// `GET /releases` as a table: NAME, LANE, STATE, STEP, WEIGHT, FAILURES,
/// LAST.
pub fn list(doc: &Value) -> Option<String> {
    let releases = doc.get("releases")?.as_array()?;
    let mut out = String::new();
    if releases.is_empty() {
        out.push_str("no releases\n");
    } else {
        let rows = releases
            .iter()
            .map(|r| {
                vec![
                    text(&r["name"]),
                    text(&r["lane"]),
                    text(&r["state"]),
                    step(r),
                    percent(&r["weight"]),
                    text(&r["failures"]),
                    truncate(&text(&r["last"]["reason"]), LAST_WIDTH),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "NAME", "LANE", "STATE", "STEP", "WEIGHT", "FAILURES", "LAST",
            ],
            rows,
        ));
    }
    if let Some(fleet) = doc.get("fleet").filter(|f| f.is_object()) {
        let _ = write!(out, "\nfleet: release leader {}", text(&fleet["leader"]));
        if fleet["this_gateway_leads"].as_bool() == Some(true) {
            out.push_str(" (this gateway)");
        }
        if let Some(e) = fleet["election_error"].as_str() {
            let _ = write!(out, "; election error: {e}");
        }
        out.push('\n');
    }
    Some(out)
}

/// `GET /releases/NAME` as a header block, then its decisions as rows,
/// oldest first.
pub fn show(r: &Value) -> Option<String> {
    r.get("name")?.as_str()?;
    let mut head: Vec<(&str, String)> = vec![
        ("name", text(&r["name"])),
        ("lane", text(&r["lane"])),
        ("routes", routes(&r["routes"])),
        ("state", text(&r["state"])),
        ("step", step(r)),
        ("weight", percent(&r["weight"])),
        ("failures", text(&r["failures"])),
    ];
    if let Some(held) = r["held"].as_str() {
        head.push(("held", held.to_string()));
    }
    if r["awaiting_promote"].as_bool() == Some(true) {
        head.push((
            "awaiting",
            "promote (a manual gate: `graygate release promote` continues)".to_string(),
        ));
    }
    let width = head.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in &head {
        let _ = writeln!(out, "{:<width$} {v}", format!("{k}:"), width = width);
    }
    out.push('\n');
    let analyses = r["analyses"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if analyses.is_empty() {
        out.push_str("no decisions yet\n");
        return Some(out);
    }
    let rows = analyses.iter().map(decision).collect();
    out.push_str(&table(
        &[
            "TIME",
            "STEP",
            "WEIGHT",
            "OUTCOME",
            "GRAY REQ",
            "GRAY ERR",
            "GRAY P99",
            "FORMAL REQ",
            "FORMAL ERR",
            "FORMAL P99",
            "DETECTABLE",
            "REASON",
        ],
        rows,
    ));
    Some(out)
}

/// One action's answer (the release after it) as one line:
/// `release cli paused: paused at step 0 (of 2, from 0), weight 5%`.
pub fn summary(verb: &str, r: &Value) -> Option<String> {
    let name = r.get("name")?.as_str()?;
    let mut line = format!(
        "release {name} {verb}: {} at step {}, weight {}",
        text(&r["state"]),
        step(r),
        percent(&r["weight"])
    );
    if let Some(held) = r["held"].as_str() {
        let _ = write!(line, " (held: {held})");
    }
    line.push('\n');
    Some(line)
}

/// One decision's row.
fn decision(a: &Value) -> Vec<String> {
    let judged = a["outcome"].as_str().is_some_and(|o| JUDGED.contains(&o));
    let lane = |l: &Value| -> [String; 3] {
        if !judged {
            return ["".into(), "".into(), "".into()];
        }
        let errors = match l["error_rate_pct"].as_f64() {
            Some(pct) if l["requests"].as_u64().unwrap_or(0) > 0 => {
                format!("{} ({pct:.2}%)", text(&l["errors"]))
            }
            _ => text(&l["errors"]),
        };
        [text(&l["requests"]), errors, millis(&l["p99_ms"])]
    };
    let [gr, ge, gp] = lane(&a["gray"]);
    let [fr, fe, fp] = lane(&a["formal"]);
    vec![
        time(&a["at"]),
        text(&a["step"]),
        percent(&a["weight"]),
        text(&a["outcome"]),
        gr,
        ge,
        gp,
        fr,
        fe,
        fp,
        detectable(a),
        text(&a["reason"]),
    ]
}

/// The smallest effects the decision's sample could have failed:
/// `+1.20pp 1.8×`; blank when the decision states none.
fn detectable(a: &Value) -> String {
    let rise = a["detectable_error_rise_pp"]
        .as_f64()
        .map(|v| format!("+{}pp", number(v, 2)));
    let ratio = a["detectable_latency_ratio"]
        .as_f64()
        .map(|v| format!("{}×", number(v, 2)));
    [rise, ratio]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `headers` and `rows` in columns two spaces apart, the last column
/// unpadded (no trailing spaces).
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let width = |s: &str| s.chars().count();
    let mut widths: Vec<usize> = headers.iter().map(|h| width(h)).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            l.push_str(cell);
            if i + 1 < widths.len() {
                l.extend(std::iter::repeat_n(' ', widths[i] - width(cell)));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A JSON value as a cell: strings as they are, numbers plainly, null `-`.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => number(f, 2),
            _ => n.to_string(),
        },
        Value::Bool(b) => if *b { "yes" } else { "no" }.into(),
        other => other.to_string(),
    }
}

/// `f` with at most `places` decimals, trailing zeros dropped (`50`,
/// `12.5`).
fn number(f: f64, places: usize) -> String {
    let s = format!("{f:.places$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn percent(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| text(v), |w| format!("{}%", number(w, 2)))
}

fn millis(v: &Value) -> String {
    match v.as_f64() {
        Some(ms) if ms < 10.0 => format!("{}ms", number(ms, 3)),
        Some(ms) => format!("{}ms", number(ms, 1)),
        None => "-".into(),
    }
}

/// The API's step index with what it counts: `1 (of 3, from 0)` is the
/// second of three.
fn step(r: &Value) -> String {
    match (r["step"].as_u64(), r["steps"].as_u64()) {
        (Some(s), Some(n)) => format!("{s} (of {n}, from 0)"),
        _ => text(&r["step"]),
    }
}

fn routes(v: &Value) -> String {
    match v.as_array() {
        Some(list) => list.iter().map(text).collect::<Vec<_>>().join(", "),
        None => text(v),
    }
}

/// Unix milliseconds as UTC, to the second (`2026-03-01T08:16:30Z`).
fn time(v: &Value) -> String {
    match v.as_u64() {
        Some(ms) => humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
        )
        .to_string(),
        None => text(v),
    }
}

/// At most `max` characters, the cut marked with `…`.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.truncate(out.trim_end().len());
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn release() -> Value {
        json!({
            "name": "checkout", "lane": "gray", "routes": ["/api/", "/web/"],
            "state": "held", "held": "webhook http://h/ answered 500 Internal Server Error",
            "step": 1, "steps": 3, "weight": 12.5, "failures": 1,
            "awaiting_promote": false,
            "last": { "reason": "x".repeat(100) },
            "future_field": { "ignored": true },
        })
    }

    #[test]
    fn list_has_a_row_per_release_and_cuts_long_reasons() {
        let doc = json!({ "releases": [release()], "source": "files" });
        let out = list(&doc).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines[0].starts_with("NAME      LANE  STATE  STEP"), "{out}");
        assert!(lines[1].contains("1 (of 3, from 0)"), "{out}");
        assert!(lines[1].contains("12.5%"), "{out}");
        assert!(lines[1].ends_with('…'), "{out}");
        let last = lines[1].split("  ").last().unwrap().trim();
        assert_eq!(last.chars().count(), LAST_WIDTH, "{out}");
        assert!(lines.iter().all(|l| !l.ends_with(' ')), "{out}");
    }

    #[test]
    fn list_names_the_fleet_leader() {
        let doc = json!({ "releases": [], "source": "etcd",
            "fleet": { "leader": "gw-a", "this_gateway_leads": true, "election_error": null } });
        let out = list(&doc).unwrap();
        assert!(out.starts_with("no releases\n"), "{out}");
        assert!(
            out.contains("fleet: release leader gw-a (this gateway)"),
            "{out}"
        );
    }

    #[test]
    fn show_has_a_header_and_a_row_per_decision() {
        let mut r = release();
        r["analyses"] = json!([
            { "at": 1_767_225_600_000u64, "step": 0, "weight": 12.5, "outcome": "step",
              "gray": { "requests": 0, "errors": 0, "error_rate_pct": 0.0, "p99_ms": null },
              "formal": { "requests": 0, "errors": 0, "error_rate_pct": 0.0, "p99_ms": null },
              "reason": "created: first step applied" },
            { "at": 1_767_225_601_000u64, "step": 0, "weight": 12.5, "outcome": "fail",
              "gray": { "requests": 400, "errors": 20, "error_rate_pct": 5.0, "p99_ms": 3.25 },
              "formal": { "requests": 3600, "errors": 0, "error_rate_pct": 0.0, "p99_ms": 12.0 },
              "reason": "error rate 5.00% vs formal 0.00%",
              "detectable_error_rise_pp": 1.234, "detectable_latency_ratio": 1.5 },
        ]);
        let out = show(&r).unwrap();
        assert!(out.contains("routes:   /api/, /web/\n"), "{out}");
        assert!(out.contains("step:     1 (of 3, from 0)\n"), "{out}");
        assert!(out.contains("held:     webhook http://h/"), "{out}");
        let rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("TIME")).collect();
        assert_eq!(rows.len(), 3, "{out}");
        assert!(
            rows[1].starts_with("2026-01-01T00:00:00Z  0     12.5%   step"),
            "{out}"
        );
        assert!(rows[1].ends_with("created: first step applied"), "{out}");
        for cell in [
            "400",
            "20 (5.00%)",
            "3.25ms",
            "3600",
            "0 (0.00%)",
            "12ms",
            "+1.23pp 1.5×",
        ] {
            assert!(rows[2].contains(cell), "{cell}: {out}");
        }
    }

    #[test]
    fn summaries_say_where_the_release_stands() {
        let out = summary("paused", &release()).unwrap();
        assert_eq!(
            out,
            "release checkout paused: held at step 1 (of 3, from 0), weight 12.5% (held: webhook http://h/ answered 500 Internal Server Error)\n"
        );
        assert_eq!(summary("paused", &json!({ "other": 1 })), None);
    }

    #[test]
    fn cells_of_any_json() {
        assert_eq!(text(&json!(null)), "-");
        assert_eq!(text(&json!(3)), "3");
        assert_eq!(text(&json!(2.50)), "2.5");
        assert_eq!(percent(&json!(100.0)), "100%");
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("abc", 4), "abc");
    }
}
