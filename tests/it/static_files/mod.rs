//! Static lanes: a directory tree per lane, served by the gateway itself.

mod fds;
mod lanes;
mod sendfile;
