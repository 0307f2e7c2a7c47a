//! Layer: lane. Declarative gray rules (the form Nacos-based gray systems and
//! ABTestingGateway use): an `enabled` switch, `deny` rules checked first,
//! ordered `rules` (first match wins, every condition must hold) and a
//! `fallback` lane. Parsed from YAML, validated with `file:line`, compiled once
//! per generation into matchers that allocate nothing on the hot path (except a
//! percentage keyed on the client IP).

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use http::HeaderName;
use ipnet::IpNet;

use super::RequestInfo;
use crate::base::lists::IpList;
use crate::config::{find_line, valid_lane, ConfigError, FORMAL};

use crate::config::rules::{
    IpConfig, MatchConfig, OneOrMany, RangeConfig, RuleConfig, RulesConfig, Scalar, SourceConfig,
};

// ---------------------------------------------------------------- compiled

/// Where a value is read from.
#[derive(Debug, Clone)]
pub enum Source {
    Header(HeaderName),
    Cookie(String),
    Query(String),
    Ip,
}

impl Source {
    fn read<'a>(&self, r: &'a RequestInfo) -> Option<std::borrow::Cow<'a, str>> {
        use std::borrow::Cow;
        match self {
            Source::Header(h) => r.parts.headers.get(h)?.to_str().ok().map(Cow::Borrowed),
            Source::Cookie(c) => r.cookie(c).map(Cow::Borrowed),
            Source::Query(q) => query_arg(r, q),
            Source::Ip => Some(Cow::Owned(r.client_ip.to_string())),
        }
    }
}

/// First query argument `name`, percent-decoded (no copy when unescaped).
fn query_arg<'a>(r: &'a RequestInfo, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    let q = r.parts.uri.query()?;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

#[derive(Debug)]
enum Matcher {
    Values(Vec<String>),
    Regex(regex::Regex),
}

impl Matcher {
    fn matches(&self, v: &str) -> bool {
        match self {
            Matcher::Values(vs) => vs.iter().any(|x| x == v),
            Matcher::Regex(re) => re.is_match(v),
        }
    }
}

#[derive(Debug)]
enum Cond {
    Ip(IpList),
    Value(Source, Matcher),
    Uid {
        source: Source,
        /// Sorted, for binary search.
        list: Vec<String>,
        ranges: Vec<(u64, u64)>,
        suffixes: Vec<String>,
    },
    PathPrefix(Vec<String>),
    Percentage(Source, f64),
}

impl Cond {
    fn holds(&self, r: &RequestInfo) -> bool {
        match self {
            Cond::Ip(list) => list.contains(r.client_ip),
            Cond::Value(Source::Header(h), m) => r
                .parts
                .headers
                .get_all(h)
                .iter()
                .any(|v| v.to_str().is_ok_and(|v| m.matches(v))),
            Cond::Value(src, m) => src.read(r).is_some_and(|v| m.matches(&v)),
            Cond::Uid {
                source,
                list,
                ranges,
                suffixes,
            } => {
                let Some(uid) = source.read(r) else {
                    return false;
                };
                if list
                    .binary_search_by(|x| x.as_str().cmp(uid.as_ref()))
                    .is_ok()
                {
                    return true;
                }
                let numeric = !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_digit());
                if !numeric {
                    return false;
                }
                if suffixes.iter().any(|s| uid.ends_with(s.as_str())) {
                    return true;
                }
                uid.parse::<u64>()
                    .is_ok_and(|n| ranges.iter().any(|&(lo, hi)| lo <= n && n <= hi))
            }
            Cond::PathPrefix(ps) => {
                let path = r.parts.uri.path();
                ps.iter().any(|p| path.starts_with(p.as_str()))
            }
            Cond::Percentage(src, pct) => src
                .read(r)
                .is_some_and(|k| f64::from(super::bucket(k.as_bytes())) < *pct),
        }
    }
}

#[derive(Debug)]
pub struct Rule {
    pub name: Arc<str>,
    /// Empty for deny rules.
    pub lane: Arc<str>,
    conds: Vec<Cond>,
}

impl Rule {
    fn matches(&self, r: &RequestInfo) -> bool {
        self.conds.iter().all(|c| c.holds(r))
    }

    /// [`Rule::matches`], where a percentage whose key `r` does not carry
    /// is decided by `draw` (the user's bucket recorded earlier, e.g. in a
    /// sticky cookie): a bucket from `r`'s own key always comes first.
    fn matches_drawn(&self, r: &RequestInfo, draw: Option<u32>) -> bool {
        self.conds.iter().all(|c| match c {
            Cond::Percentage(src, pct) => src
                .read(r)
                .map(|k| super::bucket(k.as_bytes()))
                .or(draw)
                .is_some_and(|b| f64::from(b) < *pct),
            c => c.holds(r),
        })
    }

    /// The user's bucket in this rule's percentage, when it has one and `r`
    /// carries its key (wherever `r` goes: the draw is the user's, not the
    /// path's).
    pub fn draw(&self, r: &RequestInfo) -> Option<u32> {
        self.conds.iter().find_map(|c| match c {
            Cond::Percentage(src, _) => src.read(r).map(|k| super::bucket(k.as_bytes())),
            _ => None,
        })
    }

    /// Whether the rule has a percentage (a share that draws users).
    pub fn has_share(&self) -> bool {
        self.conds.iter().any(|c| matches!(c, Cond::Percentage(..)))
    }
}

/// The compiled rule set of one generation.
#[derive(Debug)]
pub struct Rules {
    pub enabled: bool,
    pub deny: Vec<Rule>,
    pub rules: Vec<Rule>,
    pub fallback: Arc<str>,
}

/// What the rules say about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No rules, or `enabled: false`.
    Disabled,
    Deny(Arc<str>),
    Rule {
        name: Arc<str>,
        lane: Arc<str>,
    },
    Fallback(Arc<str>),
}

impl Rules {
    /// The deny rule matching `r`, if the rules are enabled.
    pub fn denied(&self, r: &RequestInfo) -> Option<&Arc<str>> {
        if !self.enabled {
            return None;
        }
        self.deny.iter().find(|d| d.matches(r)).map(|d| &d.name)
    }

    pub fn verdict(&self, r: &RequestInfo) -> Verdict {
        if !self.enabled {
            return Verdict::Disabled;
        }
        if let Some(name) = self.denied(r) {
            return Verdict::Deny(name.clone());
        }
        self.matched(r)
    }

    /// The verdict once no deny rule matched: the first matching rule, else
    /// the fallback lane (`Disabled` when off). Lane precedence checks the
    /// deny rules earlier, before a sticky cookie and release steps.
    pub fn matched(&self, r: &RequestInfo) -> Verdict {
        if !self.enabled {
            return Verdict::Disabled;
        }
        match self.rules.iter().find(|x| x.matches(r)) {
            Some(x) => Verdict::Rule {
                name: x.name.clone(),
                lane: x.lane.clone(),
            },
            None => Verdict::Fallback(self.fallback.clone()),
        }
    }

    /// The first rule that matches, ignoring deny rules and the fallback
    /// (release splits: no match means "not in the release").
    pub fn first_match(&self, r: &RequestInfo) -> Option<&Rule> {
        self.rules.iter().find(|x| x.matches(r))
    }

    /// [`Rules::first_match`] with each rule's percentage decided, when `r`
    /// lacks its key, by `draw(rule name)`.
    pub fn first_match_drawn(
        &self,
        r: &RequestInfo,
        draw: impl Fn(&str) -> Option<u32>,
    ) -> Option<&Rule> {
        self.rules
            .iter()
            .find(|x| x.matches_drawn(r, draw(&x.name)))
    }

    /// Every lane a rule (or the fallback) can produce.
    pub fn lanes(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .map(|r| &*r.lane)
            .chain(std::iter::once(&*self.fallback))
    }

    /// Validates and compiles `cfg`. `file`/`text` locate errors (for an
    /// inline block, the main config; `anchor` is then `rules:`).
    pub fn compile(
        cfg: &RulesConfig,
        file: &Path,
        text: &str,
        anchor: Option<&str>,
        lists: &std::collections::BTreeMap<String, IpList>,
    ) -> Result<Rules, ConfigError> {
        let c = Compiler {
            file,
            text,
            anchor,
            lists,
            uid: cfg
                .uid
                .as_ref()
                .map(|s| source(s, false, file, text, anchor))
                .transpose()?,
        };
        let mut names = HashSet::new();
        let mut deny = Vec::new();
        for d in &cfg.deny {
            if d.lane.is_some() {
                return Err(c.err(
                    &format!("name: {}", d.name),
                    format!(
                        "deny rule {:?} must not have a lane (a deny match is always formal)",
                        d.name
                    ),
                ));
            }
            deny.push(c.rule(d, &mut names, true)?);
        }
        let mut rules = Vec::new();
        for r in &cfg.rules {
            rules.push(c.rule(r, &mut names, false)?);
        }
        let fallback = cfg.fallback.clone().unwrap_or_else(|| FORMAL.to_string());
        if !valid_lane(&fallback) {
            return Err(c.err(
                "fallback",
                format!("invalid fallback lane {fallback:?} (letters, digits, - _ . only)"),
            ));
        }
        Ok(Rules {
            enabled: cfg.enabled,
            deny,
            rules,
            fallback: fallback.into(),
        })
    }
}

fn source(
    s: &SourceConfig,
    allow_ip: bool,
    file: &Path,
    text: &str,
    anchor: Option<&str>,
) -> Result<Source, ConfigError> {
    let mut found = Vec::new();
    if let Some(h) = &s.header {
        let name = HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
            ConfigError::new(
                file,
                find_line(text, anchor, h),
                format!("invalid header name {h:?}"),
            )
        })?;
        found.push(Source::Header(name));
    }
    if let Some(c) = &s.cookie {
        found.push(Source::Cookie(c.clone()));
    }
    if let Some(q) = &s.query {
        found.push(Source::Query(q.clone()));
    }
    if s.ip {
        if !allow_ip {
            return Err(ConfigError::new(
                file,
                find_line(text, anchor, "ip:"),
                "the uid source must be a header, cookie or query argument",
            ));
        }
        found.push(Source::Ip);
    }
    if found.len() != 1 {
        return Err(ConfigError::new(
            file,
            find_line(text, anchor, "uid:").or(find_line(text, anchor, "key:")),
            "a source needs exactly one of `header`, `cookie`, `query` (or `ip: true` for a percentage key)",
        ));
    }
    Ok(found.remove(0))
}

struct Compiler<'a> {
    file: &'a Path,
    text: &'a str,
    anchor: Option<&'a str>,
    lists: &'a std::collections::BTreeMap<String, IpList>,
    uid: Option<Source>,
}

impl Compiler<'_> {
    fn err(&self, needle: &str, msg: String) -> ConfigError {
        ConfigError::new(self.file, find_line(self.text, self.anchor, needle), msg)
    }

    /// Locates `needle` after the rule's `name:` line.
    fn err_in(&self, rule: &str, needle: &str, msg: String) -> ConfigError {
        let anchor = format!("name: {rule}");
        let line = find_line(self.text, Some(&anchor), needle)
            .or_else(|| find_line(self.text, self.anchor, &anchor));
        ConfigError::new(self.file, line, msg)
    }

    fn rule(
        &self,
        r: &RuleConfig,
        names: &mut HashSet<String>,
        deny: bool,
    ) -> Result<Rule, ConfigError> {
        let n = &r.name;
        if n.is_empty() {
            return Err(self.err("name:", "a rule needs a non-empty name".into()));
        }
        if !names.insert(n.clone()) {
            return Err(self.err_in(n, "name:", format!("duplicate rule name {n:?}")));
        }
        let lane = match (&r.lane, deny) {
            (_, true) => String::new(),
            (None, false) => {
                return Err(self.err_in(n, "name:", format!("rule {n:?} has no lane")));
            }
            (Some(l), false) => {
                if !valid_lane(l) {
                    return Err(self.err_in(
                        n,
                        l,
                        format!(
                            "rule {n:?}: invalid lane name {l:?} (letters, digits, - _ . only)"
                        ),
                    ));
                }
                l.clone()
            }
        };
        let mut conds = Vec::new();
        match &r.ip {
            Some(IpConfig::Cidrs(cidrs)) => {
                let mut nets = Vec::new();
                for c in cidrs {
                    let net = c
                        .parse::<IpNet>()
                        .map(|n| n.trunc())
                        .or_else(|_| c.parse::<std::net::IpAddr>().map(IpNet::from))
                        .map_err(|_| {
                            self.err_in(n, c, format!("rule {n:?}: invalid IP or CIDR {c:?}"))
                        })?;
                    nets.push(net);
                }
                conds.push(Cond::Ip(IpList::from_nets(nets)));
            }
            Some(IpConfig::List { list }) => {
                let l = self.lists.get(list).ok_or_else(|| {
                    self.err_in(n, list, format!("rule {n:?}: unknown IP list {list:?}"))
                })?;
                conds.push(Cond::Ip(l.clone()));
            }
            None => {}
        }
        let kinds: [(&str, &Option<OneOrMany<MatchConfig>>); 3] = [
            ("header", &r.header),
            ("cookie", &r.cookie),
            ("query", &r.query),
        ];
        for (kind, m) in kinds {
            for m in m.iter().flat_map(|m| m.to_vec()) {
                let src = match kind {
                    "header" => {
                        Source::Header(HeaderName::from_bytes(m.name.as_bytes()).map_err(|_| {
                            self.err_in(
                                n,
                                &m.name,
                                format!("rule {n:?}: invalid header name {:?}", m.name),
                            )
                        })?)
                    }
                    "cookie" => Source::Cookie(m.name.clone()),
                    _ => Source::Query(m.name.clone()),
                };
                let matcher = match (&m.values, &m.regex) {
                    (Some(vs), None) => Matcher::Values(vs.iter().map(Scalar::text).collect()),
                    (None, Some(re)) => Matcher::Regex(regex::Regex::new(re).map_err(|e| {
                        let first = e.to_string();
                        let first = first.lines().last().unwrap_or("").trim().to_string();
                        self.err_in(
                            n,
                            re,
                            format!("rule {n:?}: bad {kind} regex {re:?}: {first}"),
                        )
                    })?),
                    _ => {
                        return Err(self.err_in(
                            n,
                            &m.name,
                            format!(
                                "rule {n:?}: {kind} {:?} needs exactly one of `values` or `regex`",
                                m.name
                            ),
                        ))
                    }
                };
                conds.push(Cond::Value(src, matcher));
            }
        }
        if let Some(u) = &r.uid {
            let source = self.uid.clone().ok_or_else(|| {
                self.err_in(
                    n,
                    "uid:",
                    format!("rule {n:?} tests the uid but the rules have no `uid:` source"),
                )
            })?;
            let mut ranges = Vec::new();
            for rc in &u.ranges {
                let (lo, hi) = match rc {
                    RangeConfig::Pair([lo, hi]) => (*lo, *hi),
                    RangeConfig::Text(t) => t
                        .split_once('-')
                        .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)))
                        .ok_or_else(|| {
                            self.err_in(n, t, format!("rule {n:?}: bad uid range {t:?} (lo-hi)"))
                        })?,
                };
                if lo > hi {
                    return Err(self.err_in(
                        n,
                        "ranges",
                        format!("rule {n:?}: uid range {lo}-{hi} is empty"),
                    ));
                }
                ranges.push((lo, hi));
            }
            let mut suffixes = Vec::new();
            for s in &u.suffix {
                let t = s.text();
                if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(self.err_in(
                        n,
                        "suffix",
                        format!("rule {n:?}: uid suffix {t:?} must be digits"),
                    ));
                }
                suffixes.push(t);
            }
            if u.list.is_empty() && ranges.is_empty() && suffixes.is_empty() {
                return Err(self.err_in(
                    n,
                    "uid:",
                    format!("rule {n:?}: uid needs `in`, `ranges` or `suffix`"),
                ));
            }
            conds.push(Cond::Uid {
                source,
                list: {
                    let mut l: Vec<String> = u.list.iter().map(Scalar::text).collect();
                    l.sort_unstable();
                    l.dedup();
                    l
                },
                ranges,
                suffixes,
            });
        }
        if let Some(p) = &r.path_prefix {
            let ps = p.to_vec();
            if let Some(bad) = ps.iter().find(|p| !p.starts_with('/')) {
                return Err(self.err_in(
                    n,
                    bad,
                    format!("rule {n:?}: path_prefix {bad:?} must start with /"),
                ));
            }
            conds.push(Cond::PathPrefix(ps));
        }
        match (r.percentage, &r.key) {
            (Some(p), key) => {
                if !(0.0..=100.0).contains(&p) {
                    return Err(self.err_in(
                        n,
                        "percentage",
                        format!("rule {n:?}: percentage {p} is outside 0-100"),
                    ));
                }
                let src = match key {
                    Some(k) => source(k, true, self.file, self.text, self.anchor)?,
                    None => self.uid.clone().ok_or_else(|| {
                        self.err_in(
                            n,
                            "percentage",
                            format!("rule {n:?}: percentage needs a `key:` (or a `uid:` source)"),
                        )
                    })?,
                };
                conds.push(Cond::Percentage(src, p));
            }
            (None, Some(_)) => {
                return Err(self.err_in(
                    n,
                    "key:",
                    format!("rule {n:?}: `key` is only used with `percentage`"),
                ))
            }
            (None, None) => {}
        }
        if conds.is_empty() {
            return Err(self.err_in(n, "name:", format!("rule {n:?} has no condition")));
        }
        Ok(Rule {
            name: n.as_str().into(),
            lane: lane.into(),
            conds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::net::IpAddr;

    fn compile(yaml: &str) -> Result<Rules, ConfigError> {
        let mut lists = BTreeMap::new();
        lists.insert(
            "testers".to_string(),
            IpList::parse(Path::new("l.txt"), "127.0.9.0/24\n").unwrap(),
        );
        let cfg: RulesConfig = crate::config::parse_yaml(Path::new("r.yaml"), yaml)?;
        Rules::compile(&cfg, Path::new("r.yaml"), yaml, None, &lists)
    }

    fn req(uri: &str, ip: &str, headers: &[(&str, &str)]) -> RequestInfo {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (parts, _) = b.body(()).unwrap().into_parts();
        RequestInfo {
            parts,
            client_ip: ip.parse::<IpAddr>().unwrap(),
            host: "h".into(),
            peer_trusted: false,
        }
    }

    fn lane_of(r: &Rules, q: &RequestInfo) -> (String, Option<String>) {
        match r.verdict(q) {
            Verdict::Disabled => ("<disabled>".into(), None),
            Verdict::Deny(n) => ("<deny>".into(), Some(n.to_string())),
            Verdict::Rule { name, lane } => (lane.to_string(), Some(name.to_string())),
            Verdict::Fallback(l) => (l.to_string(), None),
        }
    }

    const IP: &str = "10.0.0.1";

    #[test]
    fn ip_cidrs_and_named_lists() {
        let r = compile(
            "rules:\n  - name: a\n    lane: gray\n    ip: [192.168.0.0/16, 10.9.9.9]\n  - name: b\n    lane: v2\n    ip: { list: testers }\n",
        )
        .unwrap();
        assert_eq!(lane_of(&r, &req("/", "192.168.3.4", &[])).0, "gray");
        assert_eq!(lane_of(&r, &req("/", "10.9.9.9", &[])).0, "gray");
        assert_eq!(lane_of(&r, &req("/", "127.0.9.77", &[])).0, "v2");
        assert_eq!(lane_of(&r, &req("/", IP, &[])).0, "formal");
    }

    #[test]
    fn header_cookie_query_values_and_regex() {
        let r = compile(
            "rules:\n  - name: h\n    lane: a\n    header: { name: X-Beta, values: [\"1\", yes] }\n  - name: c\n    lane: b\n    cookie: { name: ver, regex: \"^v2(\\\\.|$)\" }\n  - name: q\n    lane: c\n    query: { name: gray, values: [on] }\n",
        )
        .unwrap();
        assert_eq!(lane_of(&r, &req("/", IP, &[("x-beta", "yes")])).0, "a");
        assert_eq!(lane_of(&r, &req("/", IP, &[("x-beta", "2")])).0, "formal");
        assert_eq!(
            lane_of(&r, &req("/", IP, &[("cookie", "a=1; ver=v2.3")])).0,
            "b"
        );
        assert_eq!(
            lane_of(&r, &req("/", IP, &[("cookie", "ver=v20")])).0,
            "formal"
        );
        assert_eq!(lane_of(&r, &req("/?x=1&gray=on", IP, &[])).0, "c");
        assert_eq!(lane_of(&r, &req("/?gray=o%6E", IP, &[])).0, "c");
        assert_eq!(lane_of(&r, &req("/?gray=off", IP, &[])).0, "formal");
    }

    #[test]
    fn all_conditions_of_a_rule_must_hold() {
        let r = compile(
            "rules:\n  - name: both\n    lane: gray\n    path_prefix: /api/\n    header: { name: X-Beta, values: [\"1\"] }\n",
        )
        .unwrap();
        assert_eq!(
            lane_of(&r, &req("/api/x", IP, &[("x-beta", "1")])).0,
            "gray"
        );
        assert_eq!(
            lane_of(&r, &req("/web/x", IP, &[("x-beta", "1")])).0,
            "formal"
        );
        assert_eq!(lane_of(&r, &req("/api/x", IP, &[])).0, "formal");
    }

    #[test]
    fn uid_list_ranges_and_suffix() {
        let r = compile(
            "uid: { header: X-Uid }\nrules:\n  - name: appoint\n    lane: a\n    uid: { in: [42, alice] }\n  - name: range\n    lane: b\n    uid: { ranges: [[1000, 1999], \"5000-5009\"] }\n  - name: suffix\n    lane: c\n    uid: { suffix: [7] }\n",
        )
        .unwrap();
        let u = |uid: &str| lane_of(&r, &req("/", IP, &[("x-uid", uid)])).0;
        assert_eq!(u("42"), "a");
        assert_eq!(u("alice"), "a");
        assert_eq!(u("1000"), "b");
        assert_eq!(u("1999"), "b");
        assert_eq!(u("5009"), "b");
        assert_eq!(u("2000"), "formal");
        assert_eq!(u("2237"), "c");
        // Non-numeric uids match lists but never ranges or suffixes.
        assert_eq!(u("abc7"), "formal");
        assert_eq!(u("1500x"), "formal");
        assert_eq!(lane_of(&r, &req("/", IP, &[])).0, "formal");
    }

    #[test]
    fn percentage_on_murmur_bucket_of_the_key() {
        let r = compile(
            "rules:\n  - name: p\n    lane: gray\n    percentage: 30\n    key: { cookie: sid }\n",
        )
        .unwrap();
        let mut hits = 0;
        for i in 0..1000 {
            let sid = format!("s{i}");
            let expect = super::super::bucket(sid.as_bytes()) < 30;
            let got = lane_of(&r, &req("/", IP, &[("cookie", &format!("sid={sid}"))])).0;
            assert_eq!(got == "gray", expect, "{sid}");
            hits += usize::from(expect);
        }
        assert!((200..400).contains(&hits), "{hits}");
        // Without the key the rule never matches.
        assert_eq!(lane_of(&r, &req("/", IP, &[])).0, "formal");
        let all = compile(
            "rules:\n  - name: p\n    lane: gray\n    percentage: 100\n    key: { ip: true }\n",
        )
        .unwrap();
        assert_eq!(lane_of(&all, &req("/", IP, &[])).0, "gray");
        let none = compile(
            "rules:\n  - name: p\n    lane: gray\n    percentage: 0\n    key: { ip: true }\n",
        )
        .unwrap();
        assert_eq!(lane_of(&none, &req("/", IP, &[])).0, "formal");
    }

    #[test]
    fn deny_wins_first_match_wins_and_fallback() {
        let r = compile(
            "deny:\n  - name: blocked\n    ip: [10.0.0.0/8]\nrules:\n  - name: first\n    lane: a\n    path_prefix: /x\n  - name: second\n    lane: b\n    path_prefix: /\nfallback: v0\n",
        )
        .unwrap();
        assert_eq!(
            lane_of(&r, &req("/x", "10.1.1.1", &[])),
            ("<deny>".into(), Some("blocked".into()))
        );
        assert_eq!(
            lane_of(&r, &req("/x", "11.1.1.1", &[])),
            ("a".into(), Some("first".into()))
        );
        let only = compile("rules:\n  - name: x\n    lane: a\n    path_prefix: /x\nfallback: v0\n")
            .unwrap();
        assert_eq!(lane_of(&only, &req("/y", IP, &[])), ("v0".into(), None));
    }

    #[test]
    fn enabled_false_disables_everything() {
        let r = compile(
            "enabled: false\ndeny:\n  - name: d\n    ip: [0.0.0.0/0]\nrules:\n  - name: x\n    lane: a\n    path_prefix: /\n",
        )
        .unwrap();
        assert_eq!(r.verdict(&req("/", IP, &[])), Verdict::Disabled);
    }

    fn rejected(yaml: &str) -> ConfigError {
        compile(yaml).unwrap_err()
    }

    #[test]
    fn invalid_files_are_rejected_with_lines() {
        let e = rejected("rules:\n  - name: a\n    lane: g\n    ip: [10.0.0.0/33]\n");
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.message.contains("invalid IP or CIDR"), "{e}");

        let e = rejected(
            "rules:\n  - name: a\n    lane: g\n    percentage: 101\n    key: { ip: true }\n",
        );
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.message.contains("outside 0-100"), "{e}");
        let e = rejected(
            "rules:\n  - name: a\n    lane: g\n    percentage: -1\n    key: { ip: true }\n",
        );
        assert!(e.message.contains("outside 0-100"), "{e}");

        let e = rejected(
            "rules:\n  - name: a\n    lane: g\n    header: { name: X, regex: \"(unclosed\" }\n",
        );
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.message.contains("bad header regex"), "{e}");

        // Unknown source kinds are rejected by the parser, with their line.
        let e = rejected("uid: { body: uid }\nrules: []\n");
        assert_eq!(e.line, Some(1), "{e}");
        let e =
            rejected("rules:\n  - name: a\n    lane: g\n    percentage: 5\n    key: { form: x }\n");
        assert_eq!(e.line, Some(5), "{e}");
        let e = rejected("rules:\n  - name: a\n    lane: g\n    bogus: 1\n");
        assert_eq!(e.line, Some(4), "{e}");
        // A uid condition without a uid source.
        let e = rejected("rules:\n  - name: a\n    lane: g\n    uid: { in: [1] }\n");
        assert!(e.message.contains("no `uid:` source"), "{e}");

        let e = rejected("rules:\n  - name: a\n    lane: g\n    ip: { list: nope }\n");
        assert!(e.message.contains("unknown IP list"), "{e}");
        let e = rejected("rules:\n  - name: a\n    lane: \"bad lane\"\n    path_prefix: /\n");
        assert!(e.message.contains("invalid lane"), "{e}");
        let e = rejected("rules:\n  - name: a\n    lane: g\n");
        assert!(e.message.contains("no condition"), "{e}");
        let e = rejected("rules:\n  - name: a\n    lane: g\n    path_prefix: /\n  - name: a\n    lane: h\n    path_prefix: /\n");
        assert!(e.message.contains("duplicate"), "{e}");
        let e = rejected(
            "uid: { header: X }\nrules:\n  - name: a\n    lane: g\n    uid: { ranges: [[9, 1]] }\n",
        );
        assert!(e.message.contains("empty"), "{e}");
        let e = rejected("deny:\n  - name: d\n    lane: g\n    path_prefix: /\n");
        assert!(e.message.contains("must not have a lane"), "{e}");
    }

    #[test]
    fn readme_example_compiles_and_decides() {
        let readme = include_str!("../../docs/src/reference/rules.md");
        let section = readme.split("# Declarative rules").nth(1).unwrap();
        let yaml = section
            .split("```yaml\n")
            .nth(1)
            .unwrap()
            .split("```")
            .next()
            .unwrap();
        let mut lists = BTreeMap::new();
        lists.insert(
            "partner_ips".to_string(),
            IpList::parse(Path::new("p.txt"), "203.0.113.0/24\n").unwrap(),
        );
        let cfg: RulesConfig = crate::config::parse_yaml(Path::new("rules.md"), yaml).unwrap();
        let r = Rules::compile(&cfg, Path::new("rules.md"), yaml, None, &lists).unwrap();
        assert_eq!(r.rules.len(), 6);
        let v = |q: RequestInfo| lane_of(&r, &q);
        assert_eq!(v(req("/", "203.0.113.9", &[("x-beta", "1")])).0, "<deny>");
        assert_eq!(v(req("/", "127.0.9.1", &[])).1.as_deref(), Some("testers"));
        assert_eq!(v(req("/", IP, &[("cookie", "ver=v2.1")])).0, "v2");
        assert_eq!(v(req("/", IP, &[("x-user-id", "7007")])).0, "gray");
        assert_eq!(
            v(req("/api/v2/x?beta=on", IP, &[])).1.as_deref(),
            Some("new-api")
        );
        assert_eq!(v(req("/", IP, &[])), ("formal".into(), None));
    }
}
