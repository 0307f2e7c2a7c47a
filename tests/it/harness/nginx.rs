//! A real nginx for cross-checks (`nginx-core`, and `libnginx-mod-http-lua`
//! for OpenResty scripts, from `tools/test`'s packages): started in the
//! foreground on a listening socket bound here and inherited (named in
//! `$NGINX`, as on nginx's own binary upgrade), so no other process can take
//! the port between choosing and binding it; ready once it answers.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Nginx {
    child: Child,
    pub port: u16,
    pub dir: PathBuf,
}

impl Nginx {
    /// nginx with `main` at the top of its configuration (e.g.
    /// `load_module` lines) and `http` inside its `http {}` block, where
    /// `{port}` stands for the port of its one listening socket. Files and
    /// logs go in `dir` (`error.log`).
    pub fn start(dir: &Path, main: &str, http: &str) -> Nginx {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        socket2::SockRef::from(&listener)
            .set_cloexec(false)
            .unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let conf = format!(
            r#"
{main}
worker_processes 1;
daemon off;
# A master and one worker: nginx 1.22 crashes on inherited sockets without
# a master.
master_process on;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp};
    uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
{http}
}}
"#,
            dir = dir.display(),
            tmp = tmp.display(),
            http = http.replace("{port}", &port.to_string()),
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let mut child = Command::new("nginx")
            .arg("-p")
            .arg(dir)
            .args(["-e", "stderr", "-c"])
            .arg(&path)
            .env("NGINX", format!("{fd};"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "nginx runs (apt-get install nginx-core libnginx-mod-http-lua, see tools/test)",
            );
        // nginx has its own copy now.
        drop(listener);
        // The socket accepts connections before nginx runs: ready once
        // nginx answers a request.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !answers(port) {
            if let Ok(Some(st)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
                panic!("nginx exited with {st}:\n{log}");
            }
            assert!(Instant::now() < deadline, "nginx did not start");
        }
        Nginx {
            child,
            port,
            dir: dir.to_path_buf(),
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // nginx runs as a master and one worker in their own process group:
        // stop both.
        let group = format!("-{}", self.child.id());
        for sig in ["-TERM", "-KILL"] {
            let _ = Command::new("kill").args([sig, "--", &group]).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.wait();
    }
}

/// Does something answer an HTTP request on the port within a second?
fn answers(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"GET / HTTP/1.0\r\nHost: ready\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if n > 0)
}
