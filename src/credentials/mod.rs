//! Where the credential attached to a request comes from.
//!
//! - [`ApiCredential`]: the control-plane key — a static API key, or a temporary key
//!   obtained by AK/SK exchange and refreshed in the background ([`exchange`]);
//! - [`envd::TokenStore`]: each sandbox's envd access token.
//!
//! Both are read on the request path without waiting on writers: snapshots behind
//! `ArcSwap`; refresh and reload happen beside the traffic. (The deleted sandboxes' tokens
//! that [`envd::TokenStore::sandbox_of`] also asks sit behind a `Mutex`, held for a scan
//! of at most 1024 and only for a token the snapshot does not know.)

pub mod envd;
pub mod exchange;

pub use exchange::exchange_once;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::metrics::Metrics;
use crate::secret::Secret;
use crate::settings::{Credential, Settings};

/// `key` as the provider's auth header sends it, or the error naming the setting it came
/// from (a key pasted with a control character cannot be a header value).
pub fn header_value(settings: &Settings, key: &Secret) -> Result<http::HeaderValue, Error> {
    let scheme = crate::proxy::headers::AuthScheme::from(&settings.auth);
    scheme.value(key).ok_or_else(|| Error::InvalidSetting {
        key: match &settings.plugin {
            Some(p) => format!("{}.api_key", p.installed.manifest.id),
            None => "sandbox_api_key".into(),
        },
        reason: "not usable as an HTTP header value".into(),
    })
}

/// The control-plane credential in use.
pub enum ApiCredential {
    Static(Secret),
    /// A temporary key from the AK/SK exchange, refreshed in the background.
    Exchanged(exchange::ExchangedKey),
}

/// Whether a credential's exchanges count in the metrics yet. A reload's candidate counts
/// from the moment it replaces the running credential: its trial exchange failing (a new
/// pair with a wrong secret, retried by the file watch for as long as the file stays so)
/// was counted as the running credential's, and under a static key, whose expiry reads 0,
/// that paged `AbxProxyTokenMissing` ("every request is answered 503") while every request
/// was served. The failed reload is counted, and alerted on, as a reload.
#[derive(Clone)]
pub struct Counted(Arc<AtomicBool>);

impl Counted {
    /// Counted from now on.
    pub fn from_now(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn yes(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl ApiCredential {
    /// The credential the settings call for; an AK/SK pair starts its first exchange now.
    /// Must run inside the runtime: the exchange task is spawned here.
    /// `trust`: the upstream trust store, built once at the start (its files are not read
    /// again here: a reload that swapped in a pair read `--upstream-ca` and the system's
    /// certificates on the thread that accepts connections and answers the probes).
    pub fn start(
        settings: &Settings,
        options: &crate::proxy::Options,
        trust: &rustls::ClientConfig,
        metrics: &Arc<Metrics>,
    ) -> Result<Self, Error> {
        let counted = Counted(Arc::new(AtomicBool::new(true)));
        Self::counted(settings, options, trust, metrics, counted)
    }

    /// A reload's candidate, as [`ApiCredential::start`] makes it, but its exchanges not
    /// counted in the metrics until [`Counted::from_now`].
    pub fn trial(
        settings: &Settings,
        options: &crate::proxy::Options,
        trust: &rustls::ClientConfig,
        metrics: &Arc<Metrics>,
    ) -> Result<(Self, Counted), Error> {
        let counted = Counted(Arc::new(AtomicBool::new(false)));
        let credential = Self::counted(settings, options, trust, metrics, counted.clone())?;
        Ok((credential, counted))
    }

    fn counted(
        settings: &Settings,
        options: &crate::proxy::Options,
        trust: &rustls::ClientConfig,
        metrics: &Arc<Metrics>,
        counted: Counted,
    ) -> Result<Self, Error> {
        let Some(config) = exchange::ExchangeConfig::from_settings(settings) else {
            return match &settings.credential {
                Credential::ApiKey(key) => {
                    // Refused now, not by a 503 on every request while /readyz says 200.
                    header_value(settings, key)?;
                    Ok(ApiCredential::Static(key.clone()))
                }
                Credential::AccessKey { .. } => Err(Error::MissingCredential),
            };
        };
        let client = crate::upstream::client(
            trust.clone(),
            crate::upstream::Versions::Negotiate,
            options.connect_timeout,
            exchange::CALL_TIMEOUT,
        );
        let (success, failure, expiry) = (
            metrics.token_exchanges.with_label_values(&["success"]),
            metrics.token_exchanges.with_label_values(&["failure"]),
            metrics.token_expiry.clone(),
        );
        let running = Arc::clone(&counted.0);
        let observer: exchange::Observer = Arc::new(move |event| match event {
            _ if !counted.yes() => {}
            exchange::ExchangeEvent::Success { expiry_unix } => {
                success.inc();
                expiry.set(expiry_unix as f64);
            }
            exchange::ExchangeEvent::Failure => failure.inc(),
        });
        Ok(ApiCredential::Exchanged(exchange::ExchangedKey::new(
            config,
            client,
            Some(observer),
            Some(running),
        )))
    }

    /// The key to attach now.
    pub async fn current(&self) -> Result<Secret, Error> {
        match self {
            ApiCredential::Static(key) => Ok(key.clone()),
            ApiCredential::Exchanged(source) => source.current().await,
        }
    }

    /// Unix seconds of the temporary key's expiry; `None` for a static key.
    pub fn expiry_unix(&self) -> Option<i64> {
        match self {
            ApiCredential::Static(_) => None,
            ApiCredential::Exchanged(source) => source.expiry_unix(),
        }
    }

    /// The control plane (`host`) answered 401 to `key`: a temporary key is replaced early
    /// (see [`exchange::ExchangedKey::refused`]); a static key is what the user gave, which
    /// only the operator can mend: said in the log. The SDK user, who holds a dummy key, is
    /// told by the SDK to check theirs.
    pub fn refused(&self, key: &Secret, host: &str) {
        match self {
            ApiCredential::Exchanged(source) => {
                source.refused(key);
            }
            ApiCredential::Static(_) => self.rejected(key, 401, host),
        }
    }

    /// The control plane (`host`) answered `status` (401, or 403 to a token look-up) to
    /// `key`: said in the log for a static key that is still the one configured (a request
    /// in flight over a reload may carry the one before), at most once a minute for the
    /// same key.
    pub fn rejected(&self, key: &Secret, status: u16, host: &str) {
        if let ApiCredential::Static(current) = self {
            if current == key {
                say_static_key_refused(key, status, host);
            }
        }
    }

    /// A key to send again a request the control plane refused with `key` (401): a
    /// temporary key's replacement (see [`exchange::ExchangedKey::replacement`]); never
    /// for a static key, which is what the user gave.
    pub async fn replacement(&self, key: &Secret) -> Option<Secret> {
        match self {
            ApiCredential::Static(_) => None,
            ApiCredential::Exchanged(source) => source.replacement(key).await,
        }
    }

    /// The control plane answered `key` with something other than 401: a run of refusals
    /// of a temporary key is over (see [`exchange::ExchangedKey::accepted`]).
    pub fn accepted(&self, key: &Secret) {
        if let ApiCredential::Exchanged(source) = self {
            source.accepted(key);
        }
    }

    /// A reload replaced this credential: an AK/SK pair's refresher stops now, not when
    /// the last request holding the credential ends (until then it would go on minting
    /// keys with the replaced pair and reporting them in the metrics).
    pub fn retire(&self) {
        if let ApiCredential::Exchanged(source) = self {
            source.retire();
        }
    }

    /// Whether a key could be attached right now without waiting (`/readyz`).
    pub fn ready(&self) -> bool {
        match self {
            ApiCredential::Static(_) => true,
            ApiCredential::Exchanged(source) => source.ready(),
        }
    }
}

impl std::fmt::Debug for ApiCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiCredential::Static(_) => f.write_str("ApiCredential::Static(****)"),
            ApiCredential::Exchanged(_) => f.write_str("ApiCredential::Exchanged(****)"),
        }
    }
}

/// A static key the control plane refused, said at most once a minute for the same key
/// (a key rotated in by a reload and refused too is said at once): every request gets
/// the upstream's answer until the key is mended, and nothing else in the log says why.
/// The key is remembered by a hash, never kept.
#[cold]
fn say_static_key_refused(key: &Secret, status: u16, host: &str) {
    static SAID: Mutex<Option<(Instant, u64)>> = Mutex::new(None);
    static HASHER: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let hashed = std::hash::BuildHasher::hash_one(HASHER.get_or_init(Default::default), key);
    let mut said = SAID.lock().unwrap_or_else(PoisonError::into_inner);
    if said.is_some_and(|(at, was)| was == hashed && at.elapsed() < Duration::from_secs(60)) {
        return;
    }
    *said = Some((Instant::now(), hashed));
    drop(said);
    let e = Error::CredentialRejected {
        status,
        host: host.to_string(),
    };
    tracing::warn!(
        error = %e.line(),
        suggestion = e.suggestion().unwrap_or_default(),
        "the control plane refused the configured API key: its requests get the refusal \
         (said at most once a minute)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_static_key_prints_masked_and_is_always_ready() {
        let key = ApiCredential::Static(Secret::new("sk-live-0123456789".to_string()));
        assert_eq!(format!("{key:?}"), "ApiCredential::Static(****)");
        assert!(key.ready());
        assert_eq!(key.expiry_unix(), None);
    }
}
