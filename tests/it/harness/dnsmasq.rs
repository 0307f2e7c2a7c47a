//! A real DNS server for the node-host-name tests: `dnsmasq` (Debian's
//! `dnsmasq` package) on a free loopback port, UDP and TCP, answering
//! names under `test.` from a hosts file only (`--local=/test/`: any other
//! name of that domain is NXDOMAIN, nothing is forwarded). [`Dnsmasq::set`]
//! rewrites the file and sends SIGHUP, which makes dnsmasq read it again;
//! it returns once the server answers the new records. Killed on drop.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

pub struct Dnsmasq {
    /// Where it answers (UDP and TCP).
    pub addr: SocketAddr,
    hosts: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `records` as a hosts file: `ip name` a line.
fn hosts_text(records: &[(&str, &str)]) -> String {
    records
        .iter()
        .map(|(name, ip)| format!("{ip} {name}\n"))
        .collect()
}

impl Dnsmasq {
    /// A server answering `records` (name, IPv4 address; a name may come
    /// more than once), up once it answers the first of them.
    pub async fn start(records: &[(&str, &str)]) -> Dnsmasq {
        let dir = tempfile::tempdir().unwrap();
        // Readable by the user dnsmasq drops to when started as root.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, hosts_text(records)).unwrap();
        std::fs::set_permissions(&hosts, std::fs::Permissions::from_mode(0o644)).unwrap();
        let log = dir.path().join("dnsmasq.log");
        for attempt in 1..=5 {
            let port = free_port();
            let child = Command::new("dnsmasq")
                .args([
                    "--no-daemon",
                    "--conf-file=/dev/null",
                    &format!("--port={port}"),
                    "--listen-address=127.0.0.1",
                    "--bind-interfaces",
                    "--no-resolv",
                    "--no-hosts",
                    &format!("--addn-hosts={}", hosts.display()),
                    "--local=/test/",
                    "--pid-file",
                    "--log-queries",
                    "--log-facility=-",
                ])
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&log).unwrap())
                .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
                .spawn()
                .expect("dnsmasq (Debian package dnsmasq) must be installed");
            let mut child = child;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    let err =
                        std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
                    assert!(
                        err.contains("in use") && attempt < 5,
                        "dnsmasq exited: {err}"
                    );
                    break;
                }
                if query(addr, records[0].0).is_some() {
                    return Dnsmasq {
                        addr,
                        hosts,
                        child,
                        _dir: dir,
                    };
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("dnsmasq does not answer");
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        unreachable!()
    }

    /// Replaces the records and has dnsmasq read them (SIGHUP); returns
    /// once it answers `name` with what `records` give it (or, absent
    /// from them, with NXDOMAIN).
    pub async fn set(&self, records: &[(&str, &str)], name: &str) {
        std::fs::write(&self.hosts, hosts_text(records)).unwrap();
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -HUP dnsmasq");
        let mut want: Vec<Ipv4Addr> = records
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, ip)| ip.parse().unwrap())
            .collect();
        want.sort();
        super::soon("dnsmasq answers the new records", || {
            let got = self.query(name);
            let want = want.clone();
            async move {
                match got {
                    Some(mut v) => {
                        v.sort();
                        v == want
                    }
                    None => false,
                }
            }
        })
        .await;
    }

    /// The A records of `name` (empty for NXDOMAIN or no record), `None`
    /// when the server does not answer.
    pub fn query(&self, name: &str) -> Option<Vec<Ipv4Addr>> {
        query(self.addr, name)
    }
}

/// The A records of `name` asked of the server at `addr` (empty for
/// NXDOMAIN or no record), `None` when it does not answer.
fn query(addr: SocketAddr, name: &str) -> Option<Vec<Ipv4Addr>> {
    {
        let s = UdpSocket::bind("127.0.0.1:0").ok()?;
        s.set_read_timeout(Some(Duration::from_millis(300))).ok()?;
        let id: u16 = fastrand::u16(..);
        let mut q = Vec::new();
        q.extend_from_slice(&id.to_be_bytes());
        q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        s.send_to(&q, addr).ok()?;
        let mut buf = [0u8; 512];
        let n = s.recv(&mut buf).ok()?;
        let r = &buf[..n];
        if n < 12 || r[..2] != id.to_be_bytes() {
            return None;
        }
        let answers = u16::from_be_bytes([r[6], r[7]]);
        // Skip the question: the name as sent, then type and class.
        let mut i = q.len();
        let mut out = Vec::new();
        for _ in 0..answers {
            // A compressed name (2 bytes) or labels.
            if r.get(i)? & 0xc0 == 0xc0 {
                i += 2;
            } else {
                while *r.get(i)? != 0 {
                    i += 1 + *r.get(i)? as usize;
                }
                i += 1;
            }
            let rtype = u16::from_be_bytes([*r.get(i)?, *r.get(i + 1)?]);
            let len = u16::from_be_bytes([*r.get(i + 8)?, *r.get(i + 9)?]) as usize;
            i += 10;
            if rtype == 1 && len == 4 {
                out.push(Ipv4Addr::new(r[i], r[i + 1], r[i + 2], r[i + 3]));
            }
            i += len;
        }
        Some(out)
    }
}
