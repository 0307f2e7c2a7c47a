//! Layer: server. Listening sockets handed from a running graygate to its
//! successor (binary upgrade), as Pingora, HAProxy and Envoy do: the old
//! process sends its listening file descriptors over a Unix socket
//! (`SCM_RIGHTS`, through `rustix`'s safe `sendmsg`/`recvmsg`, which yield
//! `OwnedFd`s), so both processes hold the *same* kernel sockets and a
//! connection waiting in the accept queue is taken by whichever process
//! accepts next — none is reset, as one queued on a closed SO_REUSEPORT
//! listener would be.
//!
//! Wire format of the one frame: 4-byte big-endian length, then JSON
//! (`[{"role","addr"}, …]`), the descriptors riding on its first byte in
//! the same order. Orchestration (who connects, when the old one stops)
//! lives in the control plane (`control::upgrade`); this file only moves
//! sockets and hands them to the workers.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// At most this many sockets in one handover (the kernel's `SCM_MAX_FD` is
/// 253).
pub const MAX_FDS: usize = 250;
/// Largest JSON header accepted.
const MAX_HEADER: usize = 1 << 20;

/// What one passed socket is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// `client`, `admin` or `demo`.
    pub role: String,
    /// Its local address.
    pub addr: SocketAddr,
}

/// Sends `sockets` (at most [`MAX_FDS`]) in one frame.
pub fn send(stream: &UnixStream, sockets: &[(Entry, OwnedFd)]) -> io::Result<()> {
    if sockets.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} listening sockets, at most {MAX_FDS} can be handed over",
            sockets.len()
        )));
    }
    let entries: Vec<&Entry> = sockets.iter().map(|(e, _)| e).collect();
    let json = serde_json::to_vec(&entries).map_err(io::Error::other)?;
    let mut frame = (json.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&json);
    let fds: Vec<_> = sockets.iter().map(|(_, fd)| fd.as_fd()).collect();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("ancillary buffer too small"));
    }
    let sent = sendmsg(
        stream,
        &[IoSlice::new(&frame)],
        &mut control,
        SendFlags::empty(),
    )?;
    // The descriptors went with the first byte; the rest is plain data.
    (&*stream).write_all(&frame[sent..])?;
    Ok(())
}

/// Receives one frame sent by [`send`]. The descriptors arrive
/// close-on-exec.
pub fn receive(stream: &UnixStream) -> io::Result<Vec<(Entry, OwnedFd)>> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = msg {
            fds.extend(it);
        }
    }
    if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        return Err(io::Error::other(
            "listening sockets were cut off in transit",
        ));
    }
    let mut data = buf[..got.bytes].to_vec();
    if got.bytes == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the running graygate closed the upgrade connection",
        ));
    }
    while data.len() < 4 {
        read_more(stream, &mut data)?;
    }
    let len = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
    if len > MAX_HEADER {
        return Err(io::Error::other("handover header too large"));
    }
    while data.len() < 4 + len {
        read_more(stream, &mut data)?;
    }
    let entries: Vec<Entry> =
        serde_json::from_slice(&data[4..4 + len]).map_err(io::Error::other)?;
    if entries.len() != fds.len() {
        return Err(io::Error::other(format!(
            "handover names {} sockets but carried {}",
            entries.len(),
            fds.len()
        )));
    }
    Ok(entries.into_iter().zip(fds).collect())
}

fn read_more(stream: &UnixStream, data: &mut Vec<u8>) -> io::Result<()> {
    let mut chunk = [0u8; 8192];
    let n = (&*stream).read(&mut chunk)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "handover frame cut short",
        ));
    }
    data.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// Sockets received from the previous process, taken by role and address
/// as the new process starts its listeners.
#[derive(Default)]
pub struct Inherited {
    items: Vec<(Entry, OwnedFd)>,
}

impl Inherited {
    pub fn new(items: Vec<(Entry, OwnedFd)>) -> Inherited {
        Inherited { items }
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Takes every listening TCP socket of `role` whose address is `want`
    /// (port 0 in `want` matches any port on the same IP). A descriptor that
    /// is not a listening TCP socket on that address is refused.
    pub fn take(&mut self, role: &str, want: SocketAddr) -> Vec<std::net::TcpListener> {
        let mut out = Vec::new();
        let mut rest = Vec::new();
        for (e, fd) in std::mem::take(&mut self.items) {
            let fits = e.role == role
                && (e.addr == want || (want.port() == 0 && want.ip() == e.addr.ip()));
            if !fits {
                rest.push((e, fd));
                continue;
            }
            let sock = socket2::Socket::from(fd);
            let real = sock.local_addr().ok().and_then(|a| a.as_socket());
            let listening = sock.is_listener().unwrap_or(false);
            if real != Some(e.addr) || !listening {
                tracing::warn!(role, addr = %e.addr, "inherited descriptor is not that listening socket; ignored");
                continue;
            }
            if let Err(e) = sock.set_nonblocking(true) {
                tracing::warn!(error = %e, "inherited socket: cannot make it non-blocking");
                continue;
            }
            out.push(sock.into());
        }
        self.items = rest;
        out
    }

    /// What nobody took (a changed listen address); closing them drops
    /// whatever waited in their queues, so it is logged.
    pub fn leftover(self) -> Vec<Entry> {
        self.items.into_iter().map(|(e, _)| e).collect()
    }
}

/// The client listeners for `workers` workers on `addr`: the inherited ones
/// (same sockets, same queues), topped up with fresh SO_REUSEPORT listeners
/// on the same address when this process runs more workers.
pub fn client_listeners(
    addr: SocketAddr,
    workers: usize,
    inherited: Vec<std::net::TcpListener>,
) -> io::Result<Vec<std::net::TcpListener>> {
    if inherited.is_empty() {
        return super::Server::bind_exclusive(addr, workers);
    }
    let mut out = inherited;
    if out.len() < workers {
        let bound = out[0].local_addr()?;
        out.extend(super::Server::bind_listeners(bound, workers - out.len())?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_travel_over_a_unix_socket_and_keep_their_queue() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // A connection waits in the queue before the handover.
        let mut waiting = std::net::TcpStream::connect(addr).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let fd = OwnedFd::from(l.try_clone().unwrap());
        let entry = Entry {
            role: "client".into(),
            addr,
        };
        send(&a, &[(entry.clone(), fd)]).unwrap();
        drop(l);
        let got = receive(&b).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, entry);
        let mut inh = Inherited::new(got);
        assert!(inh.take("admin", addr).is_empty());
        let mut ls = inh.take("client", "127.0.0.1:0".parse().unwrap());
        assert_eq!(ls.len(), 1);
        assert!(inh.is_empty());
        let l = ls.pop().unwrap();
        l.set_nonblocking(false).unwrap();
        let (mut s, _) = l.accept().unwrap();
        waiting.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        s.read_exact(&mut one).unwrap();
        assert_eq!(&one, b"x");
    }

    #[test]
    fn a_socket_that_is_not_listening_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let addr = c.local_addr().unwrap();
        let mut inh = Inherited::new(vec![(
            Entry {
                role: "client".into(),
                addr,
            },
            OwnedFd::from(c),
        )]);
        assert!(inh.take("client", addr).is_empty());
    }
}
