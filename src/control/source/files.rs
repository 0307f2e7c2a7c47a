//! Layer: control plane. The files source (the default): the main file and
//! every document it names, read from disk through `config::docs::FileDocs`
//! and watched by `control::reload` (notify + SIGHUP).

pub use crate::config::docs::FileDocs;
pub use crate::control::reload::run as watch;
