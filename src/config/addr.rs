//! Layer: config. Node addresses as node files write them: `ip:port`
//! (`[v6]:port`), or `host:port` — a DNS name the control plane resolves
//! (`control::names`) into one node per address — and the `resolver`
//! setting naming the DNS servers that answer for such names.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A node's address: an IP address and port, or a host name and port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NodeAddr {
    Ip(SocketAddr),
    /// `host` is lower-case, without a trailing dot.
    Name {
        host: String,
        port: u16,
    },
}

impl NodeAddr {
    /// The address when it is an IP address (no resolution needed).
    pub fn ip(&self) -> Option<SocketAddr> {
        match self {
            NodeAddr::Ip(a) => Some(*a),
            NodeAddr::Name { .. } => None,
        }
    }
}

impl From<SocketAddr> for NodeAddr {
    fn from(a: SocketAddr) -> NodeAddr {
        NodeAddr::Ip(a)
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeAddr::Ip(a) => a.fmt(f),
            NodeAddr::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

/// Is `host` a DNS name (letters, digits, `-` and `_`, dot-separated
/// labels of 1–63 characters, 253 at most)?
pub fn valid_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        // An all-digit last label would be a mistyped IPv4 address.
        && !host
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

impl FromStr for NodeAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<NodeAddr, String> {
        let bad = || format!("invalid node address {s:?} (ip:port or host:port)");
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(NodeAddr::Ip(a));
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.parse::<IpAddr>().is_ok() || host.starts_with('[') || !valid_host(host) {
            return Err(bad());
        }
        Ok(NodeAddr::Name {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

impl Serialize for NodeAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NodeAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `resolver:` — the DNS servers asked for node host names, as nginx's
/// `resolver` directive: one address or a list, each `ip` or `ip:port`
/// (port 53 by default).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Resolvers(pub Vec<SocketAddr>);

fn dns_server(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let ip = s.trim_start_matches('[').trim_end_matches(']');
    ip.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| format!("invalid DNS server {s:?} (ip or ip:port)"))
}

impl<'de> Deserialize<'de> for Resolvers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let list = match OneOrMany::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a DNS server address (ip or ip:port) or a list of them",
            )
        })? {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        };
        if list.is_empty() {
            return Err(serde::de::Error::custom(
                "an empty list: name a DNS server, or leave `resolver` out for the system's",
            ));
        }
        list.iter()
            .map(|s| dns_server(s))
            .collect::<Result<Vec<_>, _>>()
            .map(Resolvers)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names() {
        assert_eq!(
            "127.0.0.1:80".parse::<NodeAddr>(),
            Ok(NodeAddr::Ip("127.0.0.1:80".parse().unwrap()))
        );
        assert_eq!(
            "[::1]:80".parse::<NodeAddr>(),
            Ok(NodeAddr::Ip("[::1]:80".parse().unwrap()))
        );
        assert_eq!(
            "Canary-1.svc.internal.:7101".parse::<NodeAddr>(),
            Ok(NodeAddr::Name {
                host: "canary-1.svc.internal".into(),
                port: 7101
            })
        );
        assert_eq!(
            "localhost:8080".parse::<NodeAddr>().unwrap().to_string(),
            "localhost:8080"
        );
        for bad in [
            "canary",
            "canary:",
            "canary:99999",
            "1.2.3:80",
            "1.2.3.400:80",
            "a b:80",
            "-x.y:80",
            "[::1:80",
            ":80",
            "x..y:80",
        ] {
            let e = bad.parse::<NodeAddr>().unwrap_err();
            assert!(e.contains("ip:port or host:port"), "{bad}: {e}");
        }
    }

    #[test]
    fn resolvers_one_or_many_default_port_53() {
        let r: Resolvers = serde_yaml::from_str("10.0.0.2").unwrap();
        assert_eq!(r.0, ["10.0.0.2:53".parse().unwrap()]);
        let r: Resolvers = serde_yaml::from_str("[127.0.0.1:5353, '::1']").unwrap();
        assert_eq!(
            r.0,
            [
                "127.0.0.1:5353".parse::<SocketAddr>().unwrap(),
                "[::1]:53".parse().unwrap()
            ]
        );
        let e = serde_yaml::from_str::<Resolvers>("dns.example").unwrap_err();
        assert!(e.to_string().contains("invalid DNS server"), "{e}");
        let e = serde_yaml::from_str::<Resolvers>("[]").unwrap_err();
        assert!(e.to_string().contains("empty list"), "{e}");
    }
}
