//! Layer: control plane. The etcd service registry: instances register
//! under `<prefix>/services/<svc>/nodes/<id>` (JSON, attached to a lease),
//! optional per-service settings under `<prefix>/services/<svc>/config`
//! (YAML: `lane_key`, health, strict, retries). A service's `lane_key` names
//! a metadata key whose value is the instance's lane, so instances that
//! register Spring-Cloud style (`metadata.version: gray`) work as they are.
//! `graygate register` is the sidecar that keeps an instance's lease alive
//! and deregisters it first on SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{find_line, parse_yaml, valid_lane, ConfigError, NodeConfig};
use crate::config::{ServiceConfig, FORMAL};

pub use crate::control::source::RegisteredServices;

/// The value of `<prefix>/services/<svc>/nodes/<id>`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Instance {
    pub addr: SocketAddr,
    /// The lane, unless the service's `lane_key` names a metadata key the
    /// instance has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    #[serde(default = "one")]
    pub weight: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
    /// Free metadata (`version`, `zone`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

fn one() -> u32 {
    1
}

/// The value of `<prefix>/services/<svc>/config` (YAML or JSON): a node
/// file's service settings (`health`, `strict`, `retries`, `balance`, …,
/// every key but `nodes`, which come from the instances) plus `lane_key`.
/// The settings are a [`ServiceConfig`] read by its own `Deserialize`, so a
/// setting added there works here too, with the same errors (key, line).
#[derive(Debug, Clone)]
pub struct RegistryService {
    /// Metadata key whose value is an instance's lane (e.g. `version`).
    pub lane_key: Option<String>,
    /// The service's settings; `nodes` is always empty.
    pub service: ServiceConfig,
}

impl<'de> Deserialize<'de> for RegistryService {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct(
            "RegistryService",
            lane_key_aside::fields(),
            lane_key_aside::RegistryVisitor,
        )
    }
}

/// Reading a registry service document as a [`ServiceConfig`]: the map is
/// handed to `ServiceConfig`'s derived `Deserialize` with `lane_key` taken
/// aside and `nodes` refused. Keys are read inside the YAML deserializer,
/// so errors keep their line and key path.
mod lane_key_aside {
    use std::fmt;
    use std::sync::OnceLock;

    use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
    use serde::{Deserialize, Deserializer};

    use super::RegistryService;
    use crate::config::ServiceConfig;

    /// The keys a registry service document may have: `lane_key`, then
    /// `ServiceConfig`'s fields but `nodes` (as its derive names them).
    pub fn fields() -> &'static [&'static str] {
        static FIELDS: OnceLock<&'static [&'static str]> = OnceLock::new();
        FIELDS.get_or_init(|| {
            let mut v = vec!["lane_key"];
            v.extend(service_fields().iter().filter(|f| **f != "nodes"));
            Box::leak(v.into_boxed_slice())
        })
    }

    /// `ServiceConfig`'s field list, asked of its derived `Deserialize` by a
    /// deserializer that only records what `deserialize_struct` is given.
    fn service_fields() -> &'static [&'static str] {
        struct Grab;
        #[derive(Debug)]
        struct Fields(&'static [&'static str]);
        impl fmt::Display for Fields {
            fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("field list")
            }
        }
        impl std::error::Error for Fields {}
        impl de::Error for Fields {
            fn custom<T: fmt::Display>(_: T) -> Self {
                Fields(&[])
            }
        }
        impl<'de> Deserializer<'de> for Grab {
            type Error = Fields;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Fields> {
                Err(Fields(&[]))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Fields> {
                Err(Fields(fields))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
                bytes byte_buf option unit unit_struct newtype_struct seq tuple
                tuple_struct map enum identifier ignored_any
            }
        }
        ServiceConfig::deserialize(Grab)
            .err()
            .map_or(&[][..], |f| f.0)
    }

    pub struct RegistryVisitor;

    impl<'de> Visitor<'de> for RegistryVisitor {
        type Value = RegistryService;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("struct RegistryService")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RegistryService, A::Error> {
            let mut lane_key = None;
            let service =
                ServiceConfig::deserialize(de::value::MapAccessDeserializer::new(Aside {
                    map,
                    lane_key: &mut lane_key,
                }))?;
            Ok(RegistryService {
                lane_key: lane_key.flatten(),
                service,
            })
        }
    }

    /// The document's map as `ServiceConfig` sees it.
    struct Aside<'a, A> {
        map: A,
        lane_key: &'a mut Option<Option<String>>,
    }

    enum Key<T> {
        LaneKey,
        Field(T),
    }

    /// Reads one key: `lane_key` is kept back (the seed stays for the next
    /// key), another known key goes to `ServiceConfig`'s field seed.
    struct KeySeed<'s, K> {
        seed: &'s mut Option<K>,
    }

    impl<'de, K: DeserializeSeed<'de>> DeserializeSeed<'de> for KeySeed<'_, K> {
        type Value = Key<K::Value>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_identifier(self)
        }
    }

    impl<'de, K: DeserializeSeed<'de>> Visitor<'de> for KeySeed<'_, K> {
        type Value = Key<K::Value>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("field identifier")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if v == "lane_key" {
                return Ok(Key::LaneKey);
            }
            if !fields().contains(&v) {
                return Err(E::unknown_field(v, fields()));
            }
            let seed = self.seed.take().expect("one seed per key");
            seed.deserialize(de::value::StrDeserializer::<E>::new(v))
                .map(Key::Field)
        }
    }

    impl<'de, A: MapAccess<'de>> MapAccess<'de> for Aside<'_, A> {
        type Error = A::Error;
        fn next_key_seed<K: DeserializeSeed<'de>>(
            &mut self,
            seed: K,
        ) -> Result<Option<K::Value>, A::Error> {
            let mut seed = Some(seed);
            loop {
                match self.map.next_key_seed(KeySeed { seed: &mut seed })? {
                    None => return Ok(None),
                    Some(Key::Field(k)) => return Ok(Some(k)),
                    Some(Key::LaneKey) => {
                        if self.lane_key.is_some() {
                            return Err(de::Error::duplicate_field("lane_key"));
                        }
                        *self.lane_key = Some(self.map.next_value()?);
                    }
                }
            }
        }
        fn next_value_seed<V: DeserializeSeed<'de>>(
            &mut self,
            seed: V,
        ) -> Result<V::Value, A::Error> {
            self.map.next_value_seed(seed)
        }
    }
}

/// The key of an instance.
pub fn node_key(prefix: &str, service: &str, id: &str) -> String {
    format!("{prefix}/services/{service}/nodes/{id}")
}

/// Is `s` usable as one segment of a key (service name, instance id)?
pub fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// The lane of `inst` in a service whose `lane_key` is `lane_key`.
pub fn lane_of(inst: &Instance, lane_key: Option<&str>) -> String {
    lane_key
        .and_then(|k| inst.metadata.get(k))
        .or(inst.lane.as_ref())
        .cloned()
        .unwrap_or_else(|| FORMAL.to_string())
}

/// Turns the registry keys of one snapshot (key → value, all under
/// `<prefix>/services/`) into services. Errors name the key (and line).
pub fn services<'a>(
    prefix: &str,
    kvs: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Result<RegisteredServices, ConfigError> {
    let base = format!("{prefix}/services/");
    let mut configs: BTreeMap<String, (PathBuf, RegistryService)> = BTreeMap::new();
    let mut instances: BTreeMap<String, Vec<(String, PathBuf, String, Instance)>> = BTreeMap::new();
    for (key, value) in kvs {
        let Some(rest) = key.strip_prefix(&base) else {
            continue;
        };
        let path = PathBuf::from(key);
        let text = std::str::from_utf8(value)
            .map_err(|_| ConfigError::new(&path, None, "not valid UTF-8 text"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [svc, "config"] => {
                let cfg: RegistryService = parse_yaml(&path, text)?;
                configs.insert(svc.to_string(), (path, cfg));
            }
            [svc, "nodes", id] => {
                let inst: Instance = serde_json::from_str(text).map_err(|e| {
                    ConfigError::new(&path, Some(e.line()), format!("instance: {e}"))
                })?;
                instances.entry(svc.to_string()).or_default().push((
                    id.to_string(),
                    path,
                    text.to_string(),
                    inst,
                ));
            }
            _ => tracing::debug!(key, "ignoring unknown registry key"),
        }
    }
    let mut out = Vec::new();
    for (svc, list) in instances {
        if !valid_segment(&svc) {
            return Err(ConfigError::new(
                &list[0].1,
                None,
                format!("invalid service name {svc:?}"),
            ));
        }
        // No `config` key: the node-file defaults (YAML `{}`).
        let (cfg_path, cfg) = configs.remove(&svc).unwrap_or_else(|| {
            let none: RegistryService =
                serde_yaml::from_str("{}").expect("every field has a default");
            (PathBuf::new(), none)
        });
        let mut nodes = Vec::new();
        for (id, path, text, inst) in &list {
            let lane = lane_of(inst, cfg.lane_key.as_deref());
            if !valid_lane(&lane) {
                return Err(ConfigError::new(
                    path,
                    find_line(text, None, &lane),
                    format!("invalid lane name {lane:?} (letters, digits, - _ . only)"),
                ));
            }
            nodes.push(NodeConfig {
                name: Some(id.clone()),
                addr: inst.addr.into(),
                lane,
                weight: inst.weight,
                drain: inst.drain,
                // Spring-Cloud style: the instance's `zone` metadata.
                zone: inst.metadata.get("zone").cloned(),
            });
        }
        let key = if cfg_path.as_os_str().is_empty() {
            list[0].1.clone()
        } else {
            cfg_path
        };
        out.push((
            key,
            svc,
            ServiceConfig {
                nodes,
                ..cfg.service
            },
        ));
    }
    Ok(out)
}

/// `graygate register …`: what the sidecar registers.
#[derive(Debug, Clone)]
pub struct Registration {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub service: String,
    pub id: String,
    pub instance: Instance,
    pub ttl_secs: i64,
    /// After deregistering on SIGTERM, wait this long before exiting (the
    /// gateways drop the instance and finish its in-flight requests).
    pub drain: Duration,
}

/// Runs the sidecar: grant a lease, put the instance with it, keep the lease
/// alive (re-registering after a lost lease or connection); on SIGTERM or
/// SIGINT delete the key and revoke the lease, wait the drain period, return.
pub async fn run_sidecar(reg: Registration) -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let key = node_key(&reg.prefix, &reg.service, &reg.id);
    let value = serde_json::to_string(&reg.instance).map_err(|e| e.to_string())?;
    let mut state: Option<(etcd_client::Client, i64)> = None;
    let mut attempt = 0usize;
    let beat = Duration::from_millis((reg.ttl_secs.max(1) as u64 * 1000) / 3);
    loop {
        if state.is_none() {
            let ep = &reg.endpoints[attempt % reg.endpoints.len()];
            attempt += 1;
            match register_once(ep, &key, &value, reg.ttl_secs).await {
                Ok(s) => {
                    tracing::info!(key, endpoint = %ep, lease = s.1, "registered");
                    state = Some(s);
                }
                Err(e) => tracing::warn!(endpoint = %ep, error = %e, "cannot register; retrying"),
            }
        }
        let wait = if state.is_some() {
            beat
        } else {
            Duration::from_millis(300)
        };
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        if let Some((client, lease)) = &mut state {
            let ok = tokio::time::timeout(Duration::from_secs(2), keep_alive(client, *lease))
                .await
                .unwrap_or(Err("timeout".into()));
            if let Err(e) = ok {
                tracing::warn!(error = %e, "lease keep-alive failed; registering again");
                state = None;
            }
        }
    }
    tracing::info!(key, "terminating: deregistering first");
    let mut done = false;
    if let Some((client, lease)) = &mut state {
        let del = async {
            client.delete(key.as_str(), None).await?;
            client.lease_revoke(*lease).await
        };
        done = tokio::time::timeout(Duration::from_secs(3), del)
            .await
            .is_ok_and(|r| r.is_ok());
    }
    if !done {
        for ep in &reg.endpoints {
            let del = async {
                let mut c = etcd_client::Client::connect([ep.as_str()], None).await?;
                c.delete(key.as_str(), None).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), del).await {
                break;
            }
        }
    }
    tracing::info!(
        drain_ms = reg.drain.as_millis() as u64,
        "deregistered; draining"
    );
    tokio::time::sleep(reg.drain).await;
    Ok(())
}

async fn register_once(
    endpoint: &str,
    key: &str,
    value: &str,
    ttl: i64,
) -> Result<(etcd_client::Client, i64), String> {
    let work = async {
        let mut c = etcd_client::Client::connect([endpoint], None).await?;
        let lease = c.lease_grant(ttl, None).await?.id();
        c.put(
            key,
            value,
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await?;
        Ok::<_, etcd_client::Error>((c, lease))
    };
    tokio::time::timeout(Duration::from_secs(2), work)
        .await
        .map_err(|_| "timeout".to_string())?
        .map_err(|e| e.to_string())
}

/// One keep-alive round trip; an expired lease (TTL 0) is an error.
pub async fn keep_alive(client: &mut etcd_client::Client, lease: i64) -> Result<(), String> {
    let (mut keeper, mut stream) = client
        .lease_keep_alive(lease)
        .await
        .map_err(|e| e.to_string())?;
    keeper.keep_alive().await.map_err(|e| e.to_string())?;
    match stream.message().await.map_err(|e| e.to_string())? {
        Some(r) if r.ttl() > 0 => Ok(()),
        _ => Err(format!("lease {lease:x} expired")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_key_maps_metadata_to_the_lane() {
        let kvs = [
            ("/g/services/api/config", &b"lane_key: version\n"[..]),
            (
                "/g/services/api/nodes/a",
                &br#"{"addr":"127.0.0.1:1","metadata":{"version":"gray","zone":"hz"}}"#[..],
            ),
            ("/g/services/api/nodes/b", &br#"{"addr":"127.0.0.1:2"}"#[..]),
            (
                "/g/services/web/nodes/c",
                &br#"{"addr":"127.0.0.1:3","lane":"v2","weight":5}"#[..],
            ),
        ];
        let s = services("/g", kvs.into_iter()).unwrap();
        assert_eq!(s.len(), 2);
        let api = &s[0].2.nodes;
        assert_eq!(
            (api[0].lane.as_str(), api[1].lane.as_str()),
            ("gray", "formal")
        );
        assert_eq!(s[1].2.nodes[0].lane, "v2");
        assert_eq!(s[1].2.nodes[0].weight, 5);
    }

    #[test]
    fn bad_instances_name_their_key_and_line() {
        let kvs = [("/g/services/api/nodes/a", &b"{\n\"addr\": 5\n}"[..])];
        let e = services("/g", kvs.into_iter()).unwrap_err();
        assert!(
            e.to_string().starts_with("/g/services/api/nodes/a:2:"),
            "{e}"
        );
        let kvs = [(
            "/g/services/api/nodes/a",
            &br#"{"addr":"127.0.0.1:1","lane":"a b"}"#[..],
        )];
        let e = services("/g", kvs.into_iter()).unwrap_err();
        assert!(e.to_string().contains("invalid lane"), "{e}");
    }

    #[test]
    fn service_settings_read_as_a_node_file_reads_them() {
        let kvs = [
            (
                "/g/services/api/config",
                &b"lane_key: version\nstrict: true\nretries: 3\nbalance: least_request\n"[..],
            ),
            ("/g/services/api/nodes/a", &br#"{"addr":"127.0.0.1:1"}"#[..]),
        ];
        let s = services("/g", kvs.into_iter()).unwrap();
        let api = &s[0].2;
        assert!(api.strict);
        assert_eq!(api.retries, Some(3));
        assert_eq!(api.balance, crate::config::Balance::LeastRequest);
        assert_eq!(api.nodes.len(), 1);
        assert_eq!(s[0].0, PathBuf::from("/g/services/api/config"));
    }

    #[test]
    fn bad_service_settings_name_their_key_line_and_the_keys_allowed() {
        let cfg = |text: &'static str| {
            let kvs = [
                ("/g/services/api/config", text.as_bytes()),
                ("/g/services/api/nodes/a", &br#"{"addr":"127.0.0.1:1"}"#[..]),
            ];
            services("/g", kvs.into_iter()).unwrap_err().to_string()
        };
        let e = cfg("lane_key: v\n\nstrict: yes please\n");
        assert!(
            e.starts_with("/g/services/api/config:3: strict: invalid type"),
            "{e}"
        );
        let e = cfg("lane_key: v\nbogus: 1\n");
        assert!(
            e.starts_with("/g/services/api/config:2: unknown field `bogus`, expected one of `lane_key`, `health`, `strict`"),
            "{e}"
        );
        let e = cfg("nodes: []\n");
        assert!(e.contains("unknown field `nodes`"), "{e}");
        let e = cfg("lane_key: a\nlane_key: b\n");
        assert!(e.contains("duplicate key `lane_key`"), "{e}");
        let e = cfg("health:\n  bogus: 1\n");
        assert!(
            e.starts_with("/g/services/api/config:2: health: unknown field `bogus`"),
            "{e}"
        );
    }
}
