//! Static lanes: a directory tree per lane, served by the gateway itself.

mod lanes;
mod sendfile;
