//! abx-proxy: a local, streaming, credential-injecting reverse proxy for E2B-compatible
//! sandbox clouds.
//!
//! Module map: the settings read once at start, then the modules in the order a request
//! meets them:
//! - [`settings`]: the key table and the layered resolution (flags → env → `./.env` →
//!   `~/.abx/.env` → `~/.abx/config.toml` → default), read once into typed data;
//! - [`workers`]: one single-threaded runtime per core, serving connections;
//! - [`proxy`]: listeners, routing, header rewriting, forwarding, drain;
//! - [`credentials`]: where the key attached to a request comes from (static key, AK/SK
//!   exchange, envd token store), with [`signing`]: Alibaba Cloud request signatures,
//!   pure functions;
//! - [`upstream`]: the TLS client stack shared by the proxy and its own calls, with
//!   [`descriptors`] counting the upstream connections the open-file limit has room for,
//!   [`clock`] ageing idle ones through the machine's sleeps and [`resolve`] looking up
//!   their names;
//! - [`admin`] and [`metrics`]: `/metrics`, `/healthz`, `/readyz` (with
//!   [`process_metrics`] for the standard `process_*` ones);
//! - [`error`] and [`secret`]: the E-code catalogue and the masked secret type.
//!
//! The binary's commands live in [`serve`] (with [`reload`] for SIGHUP and changed secret
//! files, [`reader`] and [`watched`] for the files it reads, [`signals`], and [`notify`]
//! for systemd's readiness), [`commands`] and [`check`], parsed by [`cli`]; [`logging`]
//! formats the access log and the rest of stderr, which [`log_writer`]'s thread writes (a
//! stalled reader stops no worker), and [`providers`] holds the built-in provider and
//! installed plugin ones.
#![forbid(unsafe_code)]
// The library is the binary's, and its docs are read as its code is: they link private
// items, which `cargo doc --document-private-items` renders.
#![allow(rustdoc::private_intra_doc_links)]

/// `println!` for the commands' output. `println!` panics (exit 101 and a panic message)
/// when the reader has gone, as in `abx-proxy config list | head -1`; this ends quietly
/// instead (see [`commands::stdout_line`]). Defined before the modules that use it.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::commands::stdout_line(format_args!($($arg)*))
    };
}

pub mod admin;
pub mod check;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod credentials;
pub mod descriptors;
pub mod error;
pub mod log_writer;
pub mod logging;
pub mod metrics;
pub mod notify;
#[cfg(target_os = "linux")]
pub mod process_metrics;
pub mod providers;
pub mod proxy;
pub mod reader;
pub mod reload;
pub mod resolve;
pub mod secret;
pub mod serve;
pub mod settings;
pub mod signals;
pub mod signing;
pub mod upstream;
pub mod watched;
pub mod workers;

pub use error::Error;
pub use secret::Secret;
