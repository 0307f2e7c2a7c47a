//! Layer: control plane. The etcd key layout under `<prefix>`:
//!
//! ```text
//! <prefix>/config/main.yaml              main settings (the main file's format; listen,
//!                                        admin_listen and root come from the bootstrap)
//! <prefix>/config/<path>                 every document main.yaml names, by its relative
//!                                        path: scripts/gray.lua (+ modules), lists, node
//!                                        files, rules files
//! <prefix>/services/<svc>/config         registry: per-service settings (lane_key, health, …)
//! <prefix>/services/<svc>/nodes/<id>     registry: one instance (JSON), leased
//! <prefix>/status/<gateway-id>           each gateway's state (JSON), leased
//! ```
//!
//! The status keys sort after the snapshot range, so a gateway publishing
//! its state never triggers a build.

/// The members of a comma-separated `--etcd` list, spaces around each
/// trimmed and empty entries skipped (`a:2379, b:2379,` is two members).
pub fn endpoint_list(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|e| !e.is_empty())
}

/// `<prefix>` without a trailing slash.
pub fn norm_prefix(p: &str) -> String {
    p.trim_end_matches('/').to_string()
}

/// The range one snapshot reads: `[<prefix>/config/, <prefix>/services0)`.
pub fn range(prefix: &str) -> (String, String) {
    (format!("{prefix}/config/"), format!("{prefix}/services0"))
}

/// The key of the main settings.
pub fn main_key(prefix: &str) -> String {
    format!("{prefix}/config/main.yaml")
}

/// The status key of gateway `id`.
pub fn status_key(prefix: &str, id: &str) -> String {
    format!("{prefix}/status/{id}")
}

/// The key of release `name`.
pub fn release_key(prefix: &str, name: &str) -> String {
    format!("{prefix}/releases/{name}")
}

/// The release keys: `[<prefix>/releases/, <prefix>/releases0)`.
pub fn releases_range(prefix: &str) -> (String, String) {
    (format!("{prefix}/releases/"), format!("{prefix}/releases0"))
}

/// The counters key of gateway `id`.
pub fn stats_key(prefix: &str, id: &str) -> String {
    format!("{prefix}/stats/{id}")
}

/// The release leader's key.
pub fn leader_key(prefix: &str) -> String {
    format!("{prefix}/tasks/releases/leader")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_main_key_is_in_the_range_and_status_keys_sort_after_it() {
        let (start, end) = range("/g");
        let main = main_key("/g");
        assert!(start <= main && main < end);
        assert!(status_key("/g", "a:1") >= end);
        assert!("/g/services/api/nodes/a" < end.as_str());
        assert_eq!(norm_prefix("/g//"), "/g");
    }

    #[test]
    fn endpoint_lists_trim_spaces_and_skip_empty_entries() {
        let eps: Vec<_> = endpoint_list(" http://a:2379, http://b:2379 ,,").collect();
        assert_eq!(eps, ["http://a:2379", "http://b:2379"]);
    }
}
