//! A typed builder for the gateway's files: the main file ([`Config`]) and
//! node files ([`Nodes`], [`Service`], [`Node`]), written as YAML in the
//! order the calls come (so a test that expects an error at `file:line`
//! knows the line). Keys the builder has no method for go in with
//! [`Config::raw`] / [`Service::raw`], verbatim. Tests about YAML syntax
//! itself write their text by hand.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::Fixture;

/// One route of the main file.
#[derive(Clone)]
pub struct Route {
    fields: Vec<(&'static str, String)>,
}

impl Route {
    /// `prefix: <p>`, to a service.
    pub fn service(prefix: &str, service: &str) -> Route {
        Route {
            fields: vec![("prefix", prefix.into()), ("service", service.into())],
        }
    }

    /// `prefix: <p>`, to a static tree.
    pub fn static_dir(prefix: &str, dir: &str) -> Route {
        Route {
            fields: vec![("prefix", prefix.into()), ("static", dir.into())],
        }
    }

    /// Any other key of the route (`host`, `sticky`, …), verbatim value.
    pub fn with(mut self, key: &'static str, value: &str) -> Route {
        self.fields.push((key, value.into()));
        self
    }

    pub fn host(self, host: &str) -> Route {
        self.with("host", host)
    }

    pub fn sticky(self) -> Route {
        self.with("sticky", "true")
    }
}

/// The main configuration file.
#[derive(Clone)]
pub struct Config {
    out: String,
}

impl Default for Config {
    fn default() -> Self {
        Config::new()
    }
}

impl Config {
    /// `listen` and `admin_listen` on free loopback ports, a short reload
    /// debounce.
    pub fn new() -> Config {
        Config {
            out: "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nreload_debounce_ms: 50\n".into(),
        }
    }

    /// Nothing filled in (e.g. a file pushed to etcd, or one without an
    /// admin listener).
    pub fn empty() -> Config {
        Config { out: String::new() }
    }

    /// `key: value` on one line.
    /// Sets a top-level key, replacing the builder's own default for it
    /// (e.g. `reload_debounce_ms`) rather than writing it twice.
    pub fn set(mut self, key: &str, value: impl std::fmt::Display) -> Config {
        let line = format!("{key}: {value}\n");
        let prefix = format!("{key}: ");
        match self.out.lines().position(|l| l.starts_with(&prefix)) {
            Some(i) => {
                let mut out = String::with_capacity(self.out.len() + line.len());
                for (j, l) in self.out.lines().enumerate() {
                    if j == i {
                        out.push_str(&line);
                    } else {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                self.out = out;
            }
            None => self.out.push_str(&line),
        }
        self
    }

    pub fn listen(self, addr: &str) -> Config {
        self.set("listen", addr)
    }

    pub fn script(self, file: &str) -> Config {
        self.set("script", file)
    }

    pub fn rules_file(self, file: &str) -> Config {
        self.set("rules_file", file)
    }

    /// `node_files: [a, b]`.
    pub fn node_files(self, files: &[&str]) -> Config {
        let list = files.join(", ");
        self.set("node_files", format!("[{list}]"))
    }

    /// `routes:` as a block list, one `- key: value` group per route.
    pub fn routes(mut self, routes: &[Route]) -> Config {
        self.out.push_str("routes:\n");
        for r in routes {
            for (i, (k, v)) in r.fields.iter().enumerate() {
                let lead = if i == 0 { "  - " } else { "    " };
                let _ = writeln!(self.out, "{lead}{k}: {v}");
            }
        }
        self
    }

    /// `routes:` with one route: every path to `service`.
    pub fn route_all(self, service: &str) -> Config {
        self.routes(&[Route::service("/", service)])
    }

    /// Lines added verbatim (whole top-level keys; a missing final
    /// newline is added).
    pub fn raw(mut self, yaml: &str) -> Config {
        self.out.push_str(yaml);
        if !yaml.is_empty() && !yaml.ends_with('\n') {
            self.out.push('\n');
        }
        self
    }

    pub fn to_yaml(&self) -> String {
        self.out.clone()
    }

    /// Writes the file in the fixture (in place) and returns its path.
    pub fn write(&self, fx: &Fixture, rel: &str) -> PathBuf {
        fx.write(rel, &self.out)
    }

    /// Writes the file and starts a gateway on it.
    pub fn start(&self, fx: &Fixture, rel: &str) -> super::Gateway {
        super::Gateway::start(&self.write(fx, rel))
    }

    /// Writes the file as editors save it (a temp file renamed over it).
    pub fn write_rename(&self, fx: &Fixture, rel: &str) -> PathBuf {
        fx.write_rename(rel, &self.out)
    }
}

impl Fixture {
    /// Starts a gateway on `nodes.yaml` (service `api` on these backends)
    /// and a main file whose script is `lane.lua` (written by the test)
    /// and whose one route sends everything to `api`.
    pub fn start_scripted(&self, nodes: &[&super::Backend]) -> super::Gateway {
        self.api_nodes(nodes);
        let cfg = Config::new()
            .script("lane.lua")
            .node_files(&["nodes.yaml"])
            .route_all("api")
            .write(self, "gg.yaml");
        super::Gateway::start(&cfg)
    }

    /// `nodes.yaml`: service `api` with these backends.
    pub fn api_nodes(&self, bs: &[&super::Backend]) -> PathBuf {
        Nodes::api(nodes_of(bs.iter().copied())).write(self, "nodes.yaml")
    }
}

/// One node of a node file.
#[derive(Clone)]
pub struct Node {
    fields: Vec<(&'static str, String)>,
}

impl Node {
    pub fn new(name: &str, addr: SocketAddr) -> Node {
        Node {
            fields: vec![("name", name.into()), ("addr", format!("\"{addr}\""))],
        }
    }

    /// A node with only an address (any `host:port` text).
    pub fn at(addr: impl std::fmt::Display) -> Node {
        Node {
            fields: vec![("addr", format!("\"{addr}\""))],
        }
    }

    pub fn lane(self, lane: &str) -> Node {
        self.with("lane", lane)
    }

    /// Any other key (`zone`, `weight`, …), verbatim value.
    pub fn with(mut self, key: &'static str, value: &str) -> Node {
        self.fields.push((key, value.into()));
        self
    }

    /// `      - { name: …, addr: "…", lane: … }` and a newline.
    pub fn to_yaml(&self) -> String {
        let inner = self
            .fields
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("      - {{ {inner} }}\n")
    }
}

/// One service of a node file.
#[derive(Clone)]
pub struct Service {
    name: String,
    keys: String,
    nodes: Vec<Node>,
}

impl Service {
    pub fn new(name: &str) -> Service {
        Service {
            name: name.into(),
            keys: String::new(),
            nodes: Vec::new(),
        }
    }

    /// Service keys before `nodes:`, verbatim, indented four spaces
    /// (e.g. `"    health:\n      passive: { max_fails: 1 }\n"`).
    pub fn raw(mut self, yaml: &str) -> Service {
        self.keys.push_str(yaml);
        self
    }

    /// `key: value` under the service.
    pub fn set(self, key: &str, value: impl std::fmt::Display) -> Service {
        self.raw(&format!("    {key}: {value}\n"))
    }

    pub fn node(mut self, n: Node) -> Service {
        self.nodes.push(n);
        self
    }

    pub fn nodes(mut self, ns: impl IntoIterator<Item = Node>) -> Service {
        self.nodes.extend(ns);
        self
    }

    fn to_yaml(&self) -> String {
        let mut s = format!("  {}:\n{}    nodes:\n", self.name, self.keys);
        for n in &self.nodes {
            s.push_str(&n.to_yaml());
        }
        s
    }
}

/// A node file: `services:` and their nodes.
#[derive(Clone, Default)]
pub struct Nodes {
    head: String,
    services: Vec<Service>,
}

impl Nodes {
    pub fn new() -> Nodes {
        Nodes::default()
    }

    /// One service `api` with these nodes.
    pub fn api(nodes: impl IntoIterator<Item = Node>) -> Nodes {
        Nodes::new().service(Service::new("api").nodes(nodes))
    }

    /// A comment line first (e.g. to make a rewrite differ).
    pub fn comment(mut self, text: &str) -> Nodes {
        let _ = writeln!(self.head, "# {text}");
        self
    }

    pub fn service(mut self, s: Service) -> Nodes {
        self.services.push(s);
        self
    }

    pub fn to_yaml(&self) -> String {
        let mut s = format!("{}services:\n", self.head);
        for svc in &self.services {
            s.push_str(&svc.to_yaml());
        }
        s
    }

    pub fn write(&self, fx: &Fixture, rel: &str) -> PathBuf {
        fx.write(rel, &self.to_yaml())
    }
}

/// The nodes of these backends (name, addr, lane).
pub fn nodes_of<'a>(bs: impl IntoIterator<Item = &'a super::Backend>) -> Vec<Node> {
    bs.into_iter().map(super::Backend::node).collect()
}

/// One extra listener of the main file (`listeners:`), on a free port.
#[derive(Clone)]
pub struct Listener {
    yaml: String,
}

impl Listener {
    /// Cleartext HTTP/2 (prior knowledge) and HTTP/1.1.
    pub fn h2c() -> Listener {
        Listener {
            yaml: "  - { listen: 127.0.0.1:0, h2c: true }\n".into(),
        }
    }

    /// TLS, its certificates added with [`Listener::cert`].
    pub fn tls() -> Listener {
        Listener {
            yaml: "  - listen: 127.0.0.1:0\n    tls:\n      certificates:\n".into(),
        }
    }

    /// A certificate (the default one: no server names).
    pub fn cert(self, cert: &str, key: &str) -> Listener {
        self.cert_for(cert, key, &[])
    }

    /// A certificate for these server names.
    pub fn cert_for(mut self, cert: &str, key: &str, names: &[&str]) -> Listener {
        let names = if names.is_empty() {
            String::new()
        } else {
            let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
            format!(", server_names: [{}]", quoted.join(", "))
        };
        let _ = writeln!(self.yaml, "        - {{ cert: {cert}, key: {key}{names} }}");
        self
    }
}

impl Config {
    /// `listeners:`, in this order.
    pub fn listeners(mut self, ls: &[Listener]) -> Config {
        self.out.push_str("listeners:\n");
        for l in ls {
            self.out.push_str(&l.yaml);
        }
        self
    }
}
