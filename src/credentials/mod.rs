//! Where the credential attached to a request comes from.
//!
//! - [`ApiCredential`]: the control-plane key — a static API key, or a temporary key
//!   obtained by AK/SK exchange and refreshed in the background ([`exchange`]);
//! - [`envd::TokenStore`]: each sandbox's envd access token.
//!
//! Both are read on the request path without waiting on writers: snapshots behind
//! `ArcSwap`; refresh and reload happen beside the traffic.

pub mod envd;

use std::sync::Arc;

use crate::error::Error;
use crate::metrics::Metrics;
use crate::secret::Secret;
use crate::settings::{Credential, Settings};

/// The control-plane credential in use.
pub enum ApiCredential {
    Static(Secret),
}

impl ApiCredential {
    /// The credential the settings call for; an AK/SK pair starts its first exchange now.
    pub fn start(
        settings: &Settings,
        _options: &crate::proxy::Options,
        _metrics: &Arc<Metrics>,
    ) -> Result<Self, Error> {
        match &settings.credential {
            Credential::ApiKey(key) => Ok(ApiCredential::Static(key.clone())),
            Credential::AccessKey { .. } => Err(Error::TokenExchange {
                reason: "AK/SK exchange is not built yet".into(),
            }),
        }
    }

    /// The key to attach now.
    pub async fn current(&self) -> Result<Secret, Error> {
        match self {
            ApiCredential::Static(key) => Ok(key.clone()),
        }
    }

    /// Whether a key could be attached right now without waiting (`/readyz`).
    pub fn ready(&self) -> bool {
        match self {
            ApiCredential::Static(_) => true,
        }
    }
}

impl std::fmt::Debug for ApiCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiCredential::Static(_) => f.write_str("ApiCredential::Static(****)"),
        }
    }
}
