//! Layer: base (uses config's file reading and errors). Named IP/CIDR lists:
//! loaded from text files (one entry a line, `#` comments), compiled into
//! sorted, merged address ranges and looked up by binary search — O(log n)
//! whatever the list size.

use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;

use crate::config::ConfigError;

/// A compiled set of addresses. IPv4-mapped IPv6 addresses match IPv4 entries.
#[derive(Debug, Clone, Default)]
pub struct IpList {
    v4: Vec<(u32, u32)>,
    v6: Vec<(u128, u128)>,
    entries: usize,
}

impl IpList {
    /// Parses list text; `path` only labels errors.
    pub fn parse(path: &Path, text: &str) -> Result<IpList, ConfigError> {
        let mut nets = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let net = parse_entry(line).ok_or_else(|| {
                ConfigError::new(path, Some(i + 1), format!("invalid IP or CIDR {line:?}"))
            })?;
            nets.push(net);
        }
        Ok(IpList::from_nets(nets))
    }

    /// Loads a list file.
    pub fn load(path: &Path) -> Result<IpList, ConfigError> {
        let text = crate::config::read_file(path)?;
        IpList::parse(path, &text)
    }

    /// Loads a list document from `docs` (files or a store's snapshot).
    pub fn load_from(
        docs: &dyn crate::config::docs::Docs,
        path: &Path,
    ) -> Result<IpList, ConfigError> {
        IpList::parse(path, &docs.read(path)?)
    }

    pub fn from_nets(nets: impl IntoIterator<Item = IpNet>) -> IpList {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        let mut entries = 0;
        for net in nets {
            entries += 1;
            match net {
                IpNet::V4(n) => v4.push((u32::from(n.network()), u32::from(n.broadcast()))),
                IpNet::V6(n) => v6.push((u128::from(n.network()), u128::from(n.broadcast()))),
            }
        }
        IpList {
            v4: merge(v4),
            v6: merge(v6),
            entries,
        }
    }

    /// Number of entries as written (before merging).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => lookup(&self.v4, u32::from(a)),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => lookup(&self.v4, u32::from(v4)),
                None => lookup(&self.v6, u128::from(a)),
            },
        }
    }

    /// Parses `ip` and tests it; unparsable text is never a member.
    pub fn contains_str(&self, ip: &str) -> bool {
        ip.parse::<IpAddr>().is_ok_and(|a| self.contains(a))
    }
}

fn parse_entry(s: &str) -> Option<IpNet> {
    if let Ok(net) = s.parse::<IpNet>() {
        return Some(net.trunc());
    }
    s.parse::<IpAddr>().ok().map(IpNet::from)
}

fn merge<T: Ord + Copy + num_succ::Succ>(mut ranges: Vec<(T, T)>) -> Vec<(T, T)> {
    ranges.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        if let Some(last) = out.last_mut() {
            if lo <= last.1.succ_saturating() {
                if hi > last.1 {
                    last.1 = hi;
                }
                continue;
            }
        }
        out.push((lo, hi));
    }
    out
}

fn lookup<T: Ord + Copy>(ranges: &[(T, T)], ip: T) -> bool {
    let idx = ranges.partition_point(|r| r.0 <= ip);
    idx > 0 && ranges[idx - 1].1 >= ip
}

mod num_succ {
    /// Saturating successor, so adjacent ranges merge.
    pub trait Succ {
        fn succ_saturating(self) -> Self;
    }
    impl Succ for u32 {
        fn succ_saturating(self) -> Self {
            self.saturating_add(1)
        }
    }
    impl Succ for u128 {
        fn succ_saturating(self) -> Self {
            self.saturating_add(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(text: &str) -> IpList {
        IpList::parse(Path::new("t.txt"), text).unwrap()
    }

    #[test]
    fn cidrs_hosts_and_comments() {
        let l = list("# gray testers\n127.0.9.0/24\n10.1.2.3 # one host\n\n2001:db8::/32\n");
        assert_eq!(l.len(), 3);
        assert!(l.contains_str("127.0.9.0"));
        assert!(l.contains_str("127.0.9.255"));
        assert!(!l.contains_str("127.0.10.0"));
        assert!(!l.contains_str("127.0.8.255"));
        assert!(l.contains_str("10.1.2.3"));
        assert!(!l.contains_str("10.1.2.4"));
        assert!(l.contains_str("2001:db8::1"));
        assert!(!l.contains_str("2001:db9::1"));
        assert!(l.contains_str("::ffff:127.0.9.7"));
        assert!(!l.contains_str("not an ip"));
    }

    #[test]
    fn overlapping_and_adjacent_ranges_merge() {
        let l = list("10.0.0.0/24\n10.0.1.0/24\n10.0.0.128/25\n0.0.0.0/0\n");
        assert!(l.contains_str("255.255.255.255"));
        assert_eq!(l.v4.len(), 1);
        let l = list("10.0.0.0/24\n10.0.2.0/24\n");
        assert!(!l.contains_str("10.0.1.5"));
        assert!(l.contains_str("10.0.2.5"));
    }

    #[test]
    fn bad_entry_reports_its_line() {
        let err = IpList::parse(Path::new("ips.txt"), "10.0.0.1\n\n10.0.0.0/40\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "ips.txt:3: invalid IP or CIDR \"10.0.0.0/40\""
        );
    }

    #[test]
    fn large_list() {
        let text: String = (0..100_000u32)
            .map(|i| format!("10.{}.{}.0/24\n", (i >> 8) & 0xff, i & 0xff))
            .collect();
        let l = list(&text);
        assert!(l.contains_str("10.3.7.9"));
        assert!(!l.contains_str("11.0.0.1"));
    }
}
