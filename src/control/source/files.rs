//! Layer: control plane. The files source (the default): the main file and
//! every document it names, read from disk through `config::docs::FileDocs`
//! and watched by `control::reload` (notify + SIGHUP).

use std::path::Path;
use std::sync::Arc;

pub use crate::config::docs::FileDocs;
use crate::config::ConfigError;
pub use crate::control::reload::run as watch;
use crate::control::Gateway;
use crate::generation::Generation;

/// `--check` of a main file: built as a start builds it. The demo
/// certificate is made first, as at start, so the shipped example checks
/// before its first run too.
pub fn check(main: &Path) -> Result<Generation, ConfigError> {
    Generation::prepare(main);
    Generation::load(main, 0)
}

/// A gateway serving generation 1, read from the main file.
pub fn start(main: &Path) -> Result<Arc<Gateway>, ConfigError> {
    Gateway::load(main)
}

/// Starts the file watcher and the SIGHUP handler on the current runtime;
/// a watcher that cannot start is logged and the gateway serves on.
pub fn spawn_watch(gw: Arc<Gateway>) {
    tokio::spawn(async move {
        if let Err(e) = watch(gw).await {
            tracing::error!(error = %e, "file watcher failed; reload with SIGHUP only");
        }
    });
}
