//! The integration suite, one binary: the real graygate binary on free
//! loopback ports, real backends, real clients. One module per area; the
//! shared pieces (gateway, backend, client, config builder, etcd, TLS,
//! browser) are in `harness`.
//!
//! Tests run in parallel threads of this one process, so none of them
//! changes process-wide state: no environment variables, no working
//! directory, no signal dispositions of this process (signals go to the
//! gateway children), every file in its own temporary directory. That is
//! why no area needs a binary of its own: `signals` signals the gateway
//! processes, `scripting::jit_mdwe` sets `PR_SET_MDWE` in a `python3`
//! child before it execs graygate, and `fuzz_smoke` calls pure library
//! entry points.

mod harness;

mod bench_harness;
mod cli;
mod cli_overrides;
mod config_messages;
mod dashboard;
mod docs_agree;
mod docs_reference;
mod docs_snippets;
mod drain;
mod etcd_fleet;
mod example;
mod fuzz_smoke;
mod grpc;
mod h1_server;
mod h2;
mod hardening;
mod layering;
mod listen;
mod nacos;
mod node_names;
mod observability;
mod otel;
mod own_services;
mod packaging;
mod releases;
mod reload;
mod resilience;
mod routing;
mod rules;
mod scripting;
mod signals;
mod smuggling;
mod static_files;
mod tls;
mod upgrade;
mod upstream;
