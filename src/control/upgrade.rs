//! Layer: control plane. Process housekeeping around the data plane: binary
//! upgrade without a lost connection (nginx's USR2 + QUIT, Pingora's graceful
//! upgrade), the pid file and systemd's readiness notification.
//!
//! The running process listens on `upgrade_socket` (a Unix socket, mode
//! 0600, peer uid checked). A successor — `graygate --upgrade`, or the one
//! this process starts itself on SIGUSR2 — loads and validates its
//! configuration, connects, says hello and receives every listening socket
//! (client, admin, demo) through `server::handover`; it starts serving on
//! them and answers `ready`. Only then does this process stop accepting,
//! answer `ok` and drain (in-flight requests, keep-alive connections closed
//! by `Connection: close` or while idle, WebSocket tunnels up to
//! `drain_timeout_ms`) and exit. A successor that fails before `ready`
//! (bad config, crash) leaves the running process serving, undisturbed.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{resolve, MainConfig};
use crate::server::handover::{self, Entry, Inherited};

/// First line a successor sends.
const HELLO: &[u8] = b"graygate-upgrade 1\n";
/// How long a successor may take from receiving the sockets to `ready`.
const READY_WAIT: Duration = Duration::from_secs(120);

/// Where the pid file and the upgrade socket are, from the config and the
/// command line (which wins).
#[derive(Debug, Clone, Default)]
pub struct Paths {
    pub pid_file: Option<PathBuf>,
    pub upgrade_socket: Option<PathBuf>,
}

impl Paths {
    /// Relative config paths are resolved against `root` (as every other
    /// path of the main file); the default socket sits beside the pid file.
    pub fn new(
        config_path: &Path,
        cfg: &MainConfig,
        cli_pid_file: Option<PathBuf>,
        cli_socket: Option<PathBuf>,
    ) -> Paths {
        let dir = config_path.parent().unwrap_or(Path::new("."));
        let root = cfg
            .root
            .as_ref()
            .map_or(dir.to_path_buf(), |r| resolve(dir, r));
        let pid_file = cli_pid_file.or_else(|| cfg.pid_file.as_ref().map(|p| resolve(&root, p)));
        let upgrade_socket = cli_socket
            .or_else(|| cfg.upgrade_socket.as_ref().map(|p| resolve(&root, p)))
            .or_else(|| pid_file.as_ref().map(|p| p.with_file_name("graygate.sock")));
        Paths {
            pid_file,
            upgrade_socket,
        }
    }
}

/// The running process's side: the sockets it could hand over, and the
/// files it owns.
pub struct Upgrade {
    pub paths: Paths,
    /// Duplicates of every listening socket, in the order they are sent.
    sockets: Mutex<Vec<(Entry, OwnedFd)>>,
    /// The binary and arguments this process was started with: SIGUSR2 runs
    /// that path again (the package manager may have replaced the file).
    exe: PathBuf,
    args: Vec<OsString>,
    /// Inode of the socket file we bound (so we never remove a successor's).
    socket_ino: Mutex<Option<u64>>,
}

impl Upgrade {
    pub fn new(paths: Paths) -> Upgrade {
        Upgrade {
            paths,
            sockets: Mutex::new(Vec::new()),
            exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("graygate")),
            args: std::env::args_os().skip(1).collect(),
            socket_ino: Mutex::new(None),
        }
    }

    /// Keeps a duplicate of a listening socket to hand over later.
    pub fn register(&self, role: &str, addr: SocketAddr, listener: &impl AsFd) {
        match listener.as_fd().try_clone_to_owned() {
            Ok(fd) => self
                .sockets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((
                    Entry {
                        role: role.to_string(),
                        addr,
                    },
                    fd,
                )),
            Err(e) => {
                tracing::warn!(role, error = %e, "cannot keep a listening socket for upgrades")
            }
        }
    }

    /// Drops the duplicates: once the workers close their listeners, new
    /// connections are refused (a plain stop), or only the successor holds
    /// them (after a handover).
    pub fn release(&self) {
        self.sockets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Binds the upgrade socket: a fresh socket renamed over the path, so a
    /// successor can bind while its predecessor still holds the old one.
    pub fn bind(&self) -> io::Result<Option<tokio::net::UnixListener>> {
        let Some(path) = &self.paths.upgrade_socket else {
            return Ok(None);
        };
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let l = std::os::unix::net::UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)?;
        *self.socket_ino.lock().unwrap_or_else(|e| e.into_inner()) =
            std::fs::metadata(path).ok().map(|m| m.ino());
        l.set_nonblocking(true)?;
        tracing::info!(path = %path.display(), "upgrade socket listening");
        tokio::net::UnixListener::from_std(l).map(Some)
    }

    /// Serves successors one at a time until one has taken over; returns
    /// its pid. A failed attempt is logged and the process serves on.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::UnixListener) -> u32 {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "upgrade socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let me = self.clone();
            let attempt = tokio::task::spawn_blocking(move || {
                let stream = stream.into_std()?;
                stream.set_nonblocking(false)?;
                me.hand_over(&stream)
            })
            .await;
            match attempt {
                Ok(Ok(pid)) => return pid,
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "binary upgrade aborted; this process keeps serving")
                }
                Err(e) => {
                    tracing::error!(error = %e, "binary upgrade task failed; this process keeps serving")
                }
            }
        }
    }

    fn hand_over(&self, stream: &UnixStream) -> io::Result<u32> {
        let peer = rustix::net::sockopt::socket_peercred(stream)?;
        if peer.uid != rustix::process::getuid() {
            return Err(io::Error::other(format!(
                "refusing a successor of uid {}",
                peer.uid.as_raw()
            )));
        }
        let pid = peer.pid.as_raw_pid() as u32;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let hello = read_line(stream)?;
        if hello.as_bytes() != &HELLO[..HELLO.len() - 1] {
            return Err(io::Error::other(format!("unexpected greeting {hello:?}")));
        }
        {
            let sockets = self.sockets.lock().unwrap_or_else(|e| e.into_inner());
            let dups = sockets
                .iter()
                .map(|(e, fd)| Ok((e.clone(), fd.try_clone()?)))
                .collect::<io::Result<Vec<_>>>()?;
            tracing::info!(
                successor = pid,
                sockets = dups.len(),
                "binary upgrade: handing over the listening sockets"
            );
            handover::send(stream, &dups)?;
        }
        stream.set_read_timeout(Some(READY_WAIT))?;
        match read_line(stream) {
            Ok(l) if l == "ready" => {}
            Ok(l) => return Err(io::Error::other(format!("successor {pid} said {l:?}"))),
            Err(e) => {
                return Err(io::Error::other(format!(
                    "successor {pid} did not start ({e})"
                )))
            }
        }
        (&*stream).write_all(b"ok\n")?;
        Ok(pid)
    }

    /// Starts the successor: this binary's path, the same arguments, plus
    /// `--upgrade`. Its output goes where ours goes.
    pub fn spawn_successor(&self) -> io::Result<tokio::process::Child> {
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(self.args.iter().filter(|a| *a != "--upgrade"))
            .arg("--upgrade")
            .stdin(std::process::Stdio::null());
        cmd.spawn()
    }

    /// Writes the pid file (atomically: a temporary file renamed over it).
    pub fn write_pid_file(&self) -> io::Result<()> {
        let Some(path) = &self.paths.pid_file else {
            return Ok(());
        };
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, format!("{}\n", std::process::id()))?;
        std::fs::rename(&tmp, path)
    }

    /// Removes the pid file and the upgrade socket if they are still ours
    /// (after an upgrade they belong to the successor).
    pub fn cleanup(&self) {
        if let Some(path) = &self.paths.pid_file {
            let ours = std::fs::read_to_string(path)
                .is_ok_and(|s| s.trim() == std::process::id().to_string());
            if ours {
                let _ = std::fs::remove_file(path);
            }
        }
        if let Some(path) = &self.paths.upgrade_socket {
            let ino = *self.socket_ino.lock().unwrap_or_else(|e| e.into_inner());
            if ino.is_some() && std::fs::metadata(path).ok().map(|m| m.ino()) == ino {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// The successor's side of the connection to the running process.
pub struct Predecessor {
    stream: UnixStream,
    pub pid: u32,
}

/// Connects to the running graygate at `path` and receives its listening
/// sockets. Blocking.
pub fn take_over(path: &Path) -> io::Result<(Predecessor, Inherited)> {
    let stream = UnixStream::connect(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("no running graygate answers on {} ({e})", path.display()),
        )
    })?;
    let peer = rustix::net::sockopt::socket_peercred(&stream)?;
    if peer.uid != rustix::process::getuid() {
        return Err(io::Error::other(format!(
            "{} belongs to uid {}, not to us",
            path.display(),
            peer.uid.as_raw()
        )));
    }
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    (&stream).write_all(HELLO)?;
    let sockets = handover::receive(&stream)?;
    Ok((
        Predecessor {
            stream,
            pid: peer.pid.as_raw_pid() as u32,
        },
        Inherited::new(sockets),
    ))
}

impl Predecessor {
    /// Tells the predecessor this process serves: it stops accepting and
    /// drains. Waits for its `ok`.
    pub fn ready(self) -> io::Result<()> {
        (&self.stream).write_all(b"ready\n")?;
        self.stream
            .set_read_timeout(Some(Duration::from_secs(10)))?;
        match read_line(&self.stream)? {
            l if l == "ok" => Ok(()),
            l => Err(io::Error::other(format!("predecessor said {l:?}"))),
        }
    }
}

/// Reads one `\n`-terminated line (at most 256 bytes) without reading past it.
fn read_line(stream: &UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if (&*stream).read(&mut b)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(b[0]);
        if line.len() > 256 {
            return Err(io::Error::other("line too long"));
        }
    }
}

/// Sends `state` to systemd's notification socket when running under a
/// `Type=notify` unit (`NOTIFY_SOCKET`); a no-op otherwise.
pub fn notify_systemd(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| -> io::Result<()> {
        let sock = std::os::unix::net::UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        } else {
            sock.send_to(state.as_bytes(), Path::new(&path))?;
        }
        Ok(())
    })();
    if let Err(e) = sent {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> MainConfig {
        serde_yaml::from_str(&format!("listen: 127.0.0.1:0\n{extra}")).unwrap()
    }

    #[test]
    fn paths_resolve_against_root_and_default_beside_the_pid_file() {
        let conf = Path::new("/etc/graygate/graygate.yaml");
        let p = Paths::new(
            conf,
            &cfg("root: ../..\npid_file: run/g/g.pid\n"),
            None,
            None,
        );
        assert_eq!(
            p.pid_file.as_deref(),
            Some(Path::new("/etc/graygate/../../run/g/g.pid"))
        );
        assert_eq!(
            p.upgrade_socket.as_deref(),
            Some(Path::new("/etc/graygate/../../run/g/graygate.sock"))
        );
        let p = Paths::new(conf, &cfg("upgrade_socket: up.sock\n"), None, None);
        assert_eq!(p.pid_file, None);
        assert_eq!(
            p.upgrade_socket.as_deref(),
            Some(Path::new("/etc/graygate/up.sock"))
        );
        // Neither: binary upgrades are off.
        assert!(Paths::new(conf, &cfg(""), None, None)
            .upgrade_socket
            .is_none());
        // The command line wins.
        let p = Paths::new(
            conf,
            &cfg("pid_file: a.pid\nupgrade_socket: a.sock\n"),
            Some("/run/b.pid".into()),
            Some("/run/b.sock".into()),
        );
        assert_eq!(p.pid_file.as_deref(), Some(Path::new("/run/b.pid")));
        assert_eq!(p.upgrade_socket.as_deref(), Some(Path::new("/run/b.sock")));
    }

    #[tokio::test]
    async fn cleanup_removes_only_files_that_are_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths {
            pid_file: Some(dir.path().join("g.pid")),
            upgrade_socket: Some(dir.path().join("g.sock")),
        };
        let up = Upgrade::new(paths.clone());
        up.write_pid_file().unwrap();
        let _l = up.bind().unwrap();
        let succ = Upgrade::new(paths.clone());
        // A successor's socket replaces ours at the path; its pid file too.
        let _l2 = succ.bind().unwrap();
        std::fs::write(paths.pid_file.as_ref().unwrap(), "999999\n").unwrap();
        up.cleanup();
        assert!(paths.pid_file.as_ref().unwrap().exists());
        assert!(paths.upgrade_socket.as_ref().unwrap().exists());
        // The successor's own cleanup removes its socket.
        succ.cleanup();
        assert!(!paths.upgrade_socket.as_ref().unwrap().exists());
    }
}
