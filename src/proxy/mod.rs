//! The proxy: its shared state ([`Proxy`], [`Options`]) and the listen-exposure check;
//! [`crate::serve::run`] binds it, serves until a signal and drains.
//!
//! Submodules are the phases of a request (`route`, `headers`/`compat` for the rewrite,
//! `forward`, `sniff` for the response filter; `sandbox_path` reads the control plane's
//! sandbox paths for them) and the plumbing around them (`listener`,
//! `certs` its TLS certificate, `h1` the HTTP/1.1 fast path, `framing`, `body`, `pool` the
//! upstream client, `splice`, `tunnel` for upgraded connections). `handler` strings the
//! phases together.

pub mod body;
pub mod certs;
pub(crate) mod compat;
pub mod failure;
mod flood;
pub mod forward;
pub mod framing;
mod h1;
mod handler;
pub mod headers;
pub mod listener;
pub mod pool;
pub mod route;
pub(crate) mod sandbox_path;
pub mod sniff;
#[cfg(target_os = "linux")]
mod splice;
mod tunnel;

#[doc(hidden)]
pub use h1::{read_one_head, write_one};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::credentials::envd::TokenStore;
use crate::credentials::ApiCredential;
use crate::descriptors::Slots;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::settings::{CompatMode, ListenAddr, Settings, UpstreamUrl};
use crate::upstream::{LocalResolver, Names, Versions};
use headers::{AuthScheme, CachedAuth};
use pool::Upstream;
use route::HostPolicy;

/// Serving options that are not settings keys (flags of `serve`).
#[derive(Debug, Clone)]
pub struct Options {
    pub allow_remote: bool,
    pub allowed_hosts: Vec<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub upstream_ca: Option<PathBuf>,
    pub connect_timeout: Duration,
    pub upstream_timeout: Duration,
    pub idle_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Time a client may take to send a request head (and, on a new connection, its first
    /// bytes).
    pub header_timeout: Duration,
    pub max_connections: usize,
    /// Upstream connections open at once, both planes (see [`crate::descriptors`]).
    pub upstream_slots: usize,
    /// Splices' pipes open at once (see [`crate::descriptors::Budget::pipes`]).
    pub splice_pipes: usize,
}

impl Options {
    /// [`check_exposure`] of `listen` with these flags: what `serve` refuses, and so a
    /// reload that would move the next start there.
    pub fn refuse_exposure(&self, listen: &ListenAddr) -> Result<(), Error> {
        check_exposure(listen, self.tls(), self.allow_remote)
    }

    /// [`exposure_warning`] of `listen` with these flags: what `serve` would say of it.
    pub fn exposure_warning(&self, listen: &ListenAddr) -> Option<String> {
        exposure_warning(listen, self.tls(), self.allow_remote)
    }

    fn tls(&self) -> bool {
        self.tls_cert.is_some() && self.tls_key.is_some()
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            allow_remote: false,
            allowed_hosts: Vec::new(),
            tls_cert: None,
            tls_key: None,
            upstream_ca: None,
            connect_timeout: Duration::from_secs(10),
            upstream_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            max_connections: 10_000,
            upstream_slots: crate::descriptors::Slots::UNLIMITED,
            splice_pipes: crate::descriptors::Slots::UNLIMITED,
        }
    }
}

/// Where envd traffic goes. Each with its host as printed ([`Settings::shown`]): a `${VAR}`
/// in a `.env` file can put a secret into a host name, and the host goes into every access
/// line and into the errors a client gets.
#[derive(Debug, Clone)]
pub enum EnvdTarget {
    /// `https://{port}-{id}.{domain}`, always HTTPS (SPEC §2: an envd over plain HTTP is
    /// reached through `sandbox_url`); `shown_domain` is `None` when nothing in `domain` is
    /// masked (the usual case: no second string per request).
    Domain {
        domain: String,
        shown_domain: Option<String>,
    },
    /// One URL for every sandbox (`sandbox_url`), routed by the `E2b-Sandbox-*` headers.
    Url {
        url: UpstreamUrl,
        shown_host: Arc<str>,
    },
}

/// Everything a request needs, shared by all connections.
pub struct Proxy {
    pub(crate) api_base: UpstreamUrl,
    /// `api_base`'s host and port as printed ([`Settings::shown`]), for log lines and errors
    /// without re-parsing it per request.
    pub(crate) api_host: Arc<str>,
    /// `None` for a provider without an envd plane: everything goes to the control plane.
    pub(crate) envd: Option<EnvdTarget>,
    pub(crate) api_client: Upstream,
    pub(crate) envd_client: Upstream,
    /// The upstream connections both clients hold (`abx_proxy_upstream_connections`).
    pub(crate) slots: Arc<Slots>,
    pub(crate) auth: CachedAuth,
    /// Swapped whole on SIGHUP or a changed secret file; requests in flight keep the one
    /// they loaded.
    pub credential: ArcSwap<ApiCredential>,
    pub tokens: Arc<TokenStore>,
    pub metrics: Arc<Metrics>,
    /// Room for the bodies read whole: rewritten requests, answers read for tokens.
    pub(crate) held: body::Held,
    pub(crate) host_policy: HostPolicy,
    pub(crate) compat: CompatMode,
    pub(crate) upstream_timeout: Duration,
    /// `--idle-timeout`, for what outlives the connection's own watchdog: tunnels, each
    /// HTTP/2 answer's idle limit, and the keepalive pace asked of envd.
    pub(crate) idle_timeout: Duration,
    /// Set when the drain begins; a watch, for a reload to be stopped by it.
    draining: tokio::sync::watch::Sender<bool>,
    /// Set when the drain's grace is over: every connection ends now (see [`Proxy::abort`]).
    pub(crate) aborting: tokio::sync::watch::Sender<bool>,
    /// The client connections' tasks, for those idle to be asked to close when every slot
    /// is in use (see `listener::reuse`).
    pub(crate) listed: listener::reuse::Listed,
}

impl Proxy {
    /// `trust`: the upstream trust store ([`crate::upstream::tls_config`]), one for the
    /// process.
    pub fn new(
        settings: &Settings,
        options: &Options,
        trust: &rustls::ClientConfig,
        credential: ApiCredential,
        metrics: Arc<Metrics>,
    ) -> Result<Self, Error> {
        options.refuse_exposure(&settings.listen)?;
        let tls = trust.clone();
        // Names given add to the local ones on every listener, a unix socket too: on
        // loopback an /etc/hosts alias or the listener certificate's name (ignoring them
        // silently refused those Hosts), elsewhere the only names to accept (ignoring them
        // silently left a user who asked for the restriction without it). Without them a
        // unix socket, where access is by file permission, accepts any Host.
        let local_only = settings.listen.is_loopback() && !options.allow_remote;
        let host_policy = if !options.allowed_hosts.is_empty() {
            HostPolicy::Listed(options.allowed_hosts.clone())
        } else if local_only {
            HostPolicy::Loopback
        } else {
            HostPolicy::Any
        };
        let envd = match (&settings.sandbox_url, &settings.sandbox_domain) {
            (Some(url), _) => Some(EnvdTarget::Url {
                url: url.clone(),
                shown_host: Arc::from(settings.shown(&url.authority())),
            }),
            (None, Some(domain)) => Some(EnvdTarget::Domain {
                domain: domain.clone(),
                shown_domain: Some(settings.shown(domain)).filter(|shown| shown != domain),
            }),
            (None, None) => None,
        };
        let compat = if settings.provider == crate::providers::BUILTIN {
            settings.compat_v2_paths
        } else {
            CompatMode::Pass
        };
        let slots = Slots::new(options.upstream_slots, options.splice_pipes);
        Ok(Proxy {
            api_base: settings.sandbox_base_url.clone(),
            api_host: Arc::from(settings.shown(&settings.sandbox_base_url.authority())),
            envd,
            api_client: Upstream::new(
                tls.clone(),
                Versions::Negotiate,
                options.connect_timeout,
                options.upstream_timeout,
                Some(metrics.upstream_errors.clone()),
                slots.clone(),
                LocalResolver::new(Names::Own),
            ),
            envd_client: Upstream::new(
                tls,
                Versions::Http1,
                options.connect_timeout,
                options.upstream_timeout,
                Some(metrics.upstream_errors.clone()),
                slots.clone(),
                LocalResolver::new(Names::Sandboxes),
            ),
            slots,
            auth: CachedAuth::new(AuthScheme::from(&settings.auth)),
            credential: ArcSwap::from_pointee(credential),
            tokens: Arc::new(TokenStore::new()),
            metrics,
            held: body::Held::new(body::HELD_LIMIT),
            host_policy,
            compat,
            upstream_timeout: options.upstream_timeout,
            idle_timeout: options.idle_timeout,
            draining: tokio::sync::watch::Sender::new(false),
            aborting: tokio::sync::watch::Sender::new(false),
            listed: listener::reuse::Listed::default(),
        })
    }

    /// `/readyz`: a credential can be attached and we are not draining.
    pub fn ready(&self) -> bool {
        !self.draining() && self.credential.load().ready()
    }

    /// Whether the drain has begun.
    pub fn draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Returns once the drain has begun.
    pub async fn drain_begun(&self) {
        let _ = self.draining.subscribe().wait_for(|d| *d).await;
    }

    pub fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    /// Ends every connection still open when the drain's grace is over (or a second
    /// signal came): each drops what it serves, so a request cut there is logged and
    /// counted as 499 like any other, and its worker's batched lines go out, before exit.
    pub fn abort(&self) {
        self.aborting.send_replace(true);
    }
}

/// A proxy with a static key and default settings, for unit tests of the serving code.
/// Resolved from flags alone (no environment, no files), so the machine's own
/// configuration cannot leak in.
#[cfg(test)]
pub(crate) fn test_proxy() -> Arc<Proxy> {
    test_proxy_with("sk-test", &[])
}

/// [`test_proxy`] with another key and more flag-level settings.
#[cfg(test)]
pub(crate) fn test_proxy_with(key: &str, plain: &[(crate::settings::Key, &str)]) -> Arc<Proxy> {
    use crate::secret::Secret;
    use crate::settings::{FlagValue, Inputs, Key, Resolved};

    let empty = tempfile::tempdir().expect("temp dir");
    let flags = plain
        .iter()
        .map(|(k, v)| (*k, FlagValue::Plain(v.to_string())))
        .chain([(
            Key::SandboxApiKey,
            FlagValue::Secret(Secret::new(key.to_string())),
        )]);
    let inputs = Inputs {
        flags: flags.collect(),
        cwd: empty.path().to_path_buf(),
        ..Inputs::default()
    };
    let settings = Resolved::from_inputs(&inputs)
        .and_then(|r| r.validate())
        .expect("settings");
    let options = Options::default();
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let trust = crate::upstream::tls_config(None).expect("trust store");
    let credential =
        ApiCredential::start(&settings, &options, &trust, &metrics).expect("credential");
    Arc::new(Proxy::new(&settings, &options, &trust, credential, metrics).expect("proxy"))
}

/// Whoever reaches a non-loopback plaintext port spends the key: that needs consent.
/// `check` applies it too, so that it says ok only for what `serve` would start with.
pub fn check_exposure(listen: &ListenAddr, tls: bool, allow_remote: bool) -> Result<(), Error> {
    match listen {
        ListenAddr::Tcp(addr) if !listen.is_loopback() && !tls && !allow_remote => {
            Err(Error::RemoteListen {
                addr: addr.to_string(),
            })
        }
        _ => Ok(()),
    }
}

/// A TLS port beyond loopback taken without `--allow-remote`: SPEC §7 lets TLS stand in for
/// the consent, but TLS checks no client, and whoever reaches the port still spends the
/// key. Said at start and by `check`; `--allow-remote` says it is meant.
pub fn exposure_warning(listen: &ListenAddr, tls: bool, allow_remote: bool) -> Option<String> {
    match listen {
        ListenAddr::Tcp(addr) if !listen.is_loopback() && tls && !allow_remote => Some(format!(
            "listening on {addr}, beyond this machine, with TLS: TLS encrypts the connections \
             but checks no client, and whoever reaches the port spends the key; limit who \
             reaches it (a firewall, a network policy), and pass --allow-remote to say that \
             this is meant"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS port beyond loopback is warned about unless consented to; nothing else is.
    #[test]
    fn a_remote_tls_port_without_consent_is_warned_about() {
        let tcp = |a: &str| ListenAddr::Tcp(a.parse().expect("address"));
        let said = exposure_warning(&tcp("0.0.0.0:49982"), true, false).unwrap_or_default();
        assert!(said.starts_with("listening on 0.0.0.0:49982, beyond this machine, with TLS"));
        assert_eq!(exposure_warning(&tcp("0.0.0.0:49982"), true, true), None);
        assert_eq!(exposure_warning(&tcp("0.0.0.0:49982"), false, true), None);
        assert_eq!(exposure_warning(&tcp("127.0.0.1:49982"), true, false), None);
    }

    /// Only a plaintext TCP port beyond loopback needs `--allow-remote`; TLS or consent
    /// lifts the refusal, and loopback addresses and unix sockets never need it.
    #[test]
    fn only_a_remote_plaintext_port_without_consent_is_refused() {
        let tcp = |a: &str| ListenAddr::Tcp(a.parse().expect("address"));
        for remote in ["0.0.0.0:49982", "192.0.2.7:1", "[::]:49982"] {
            let addr = tcp(remote);
            let refused = check_exposure(&addr, false, false);
            assert!(
                matches!(&refused, Err(Error::RemoteListen { addr }) if addr == remote),
                "{remote}: {refused:?}"
            );
            assert_eq!(
                check_exposure(&addr, true, false),
                Ok(()),
                "{remote} with TLS"
            );
            assert_eq!(
                check_exposure(&addr, false, true),
                Ok(()),
                "{remote} allowed"
            );
            assert_eq!(check_exposure(&addr, true, true), Ok(()), "{remote}");
        }
        for local in ["127.0.0.1:49982", "127.3.4.5:1", "[::1]:49982"] {
            assert_eq!(check_exposure(&tcp(local), false, false), Ok(()), "{local}");
        }
        let unix = ListenAddr::Unix("/run/abx/proxy.sock".into());
        assert_eq!(check_exposure(&unix, false, false), Ok(()));
    }
}
