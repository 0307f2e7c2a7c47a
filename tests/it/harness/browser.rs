//! Shared by the browser tests (`dashboard`, `etcd_fleet`):
//! a chromedriver on a free loopback port and headless Chromium sessions
//! (Debian's `chromium` + `chromium-driver`), driven by fantoccini.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};

use crate::harness::eventually;

/// A chromedriver process on a free loopback port, killed on drop.
pub struct Driver {
    child: Child,
    url: String,
    _profile: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    pub async fn start() -> Driver {
        // A chromedriver that exits before saying its port (seen once on a
        // loaded machine) is started again, up to three times.
        let mut tries = 0;
        let (child, port) = loop {
            tries += 1;
            match Self::spawn() {
                Ok(started) => break started,
                Err(mut child) if tries < 3 => {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                Err(_) => panic!("chromedriver did not report its port in {tries} starts"),
            }
        };
        let url = format!("http://127.0.0.1:{port}");
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        eventually(
            "chromedriver listens",
            Duration::from_secs(20),
            || async move { tokio::net::TcpStream::connect(addr).await.is_ok() },
        )
        .await;
        Driver {
            child,
            url,
            _profile: tempfile::tempdir().unwrap(),
        }
    }

    /// Starts chromedriver on port 0 (it binds an ephemeral port itself
    /// and says which); `Err` with the process when it said none.
    fn spawn() -> Result<(Child, u16), Child> {
        let mut child = Command::new("chromedriver")
            .arg("--port=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian package chromium-driver) must be installed");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(port) = line
                    .strip_prefix("ChromeDriver was started successfully on port ")
                    .and_then(|p| p.trim_end_matches('.').parse::<u16>().ok())
                {
                    let _ = tx.send(port);
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(port) => Ok((child, port)),
            Err(_) => Err(child),
        }
    }

    pub async fn browser(&self) -> Client {
        let profile = self._profile.path().display().to_string();
        let caps = serde_json::json!({
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--window-size=1280,1800",
                    format!("--user-data-dir={profile}"),
                ],
            }
        });
        let caps = caps.as_object().unwrap().clone().into_iter().collect();
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("start a headless Chromium session")
    }
}

/// Waits until the text of the first element matching `css` satisfies `ok`.
pub async fn wait_text(c: &Client, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    loop {
        if let Ok(e) = c.find(Locator::Css(css)).await {
            if let Ok(t) = e.text().await {
                if ok(&t) {
                    return t;
                }
                last = t;
            }
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what} ({css}); last text {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
