//! `check` without `--offline`: one real token exchange when the credential is an AccessKey
//! pair, then one request to the control plane, authenticated the way the provider wants
//! (its header, as the proxy sends it). Reports, never the key.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};

use crate::cli::NetArgs;
use crate::error::Error;
use crate::proxy::headers::AuthScheme;
use crate::secret::Secret;
use crate::settings::{Credential, Settings};
use crate::upstream::{self, Versions};

pub fn online(settings: &Settings, net: &NetArgs) -> Result<i32, Error> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::InvalidSetting {
            key: "runtime".into(),
            reason: e.to_string(),
        })?;
    runtime.block_on(run(settings, net))
}

async fn run(settings: &Settings, net: &NetArgs) -> Result<i32, Error> {
    let connect_timeout = net.connect_timeout;
    // A probe, not a sandbox call: without the flag, half a minute is plenty.
    let upstream_timeout = net.upstream_timeout.unwrap_or(Duration::from_secs(30));
    let tls = upstream::tls_config(net.upstream_ca.as_deref())?;
    let client = upstream::client(
        tls.clone(),
        Versions::Negotiate,
        connect_timeout,
        upstream_timeout,
    );
    let key: Secret = match &settings.credential {
        Credential::ApiKey(k) => k.clone(),
        Credential::AccessKey { .. } => {
            let (key, expires_at) = crate::credentials::exchange_once(settings, &client).await?;
            outln!("token exchange: ok, temporary key expires at {expires_at}");
            key
        }
    };
    probe(settings, &client, &key, upstream_timeout).await
}

async fn probe(
    settings: &Settings,
    client: &upstream::HttpClient,
    key: &Secret,
    timeout: Duration,
) -> Result<i32, Error> {
    let base = &settings.sandbox_base_url;
    let host = settings.shown(&base.authority());
    let uri = base.join("/sandboxes").map_err(|e| Error::InvalidSetting {
        key: "sandbox_base_url".into(),
        reason: e.to_string(),
    })?;
    let probed = settings.shown(&uri);
    let scheme = AuthScheme::from(&settings.auth);
    let value = crate::credentials::header_value(settings, key)?;
    let req = http::Request::get(uri)
        .header(scheme.header(), value)
        .body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed())
        .map_err(|e| Error::InvalidSetting {
            key: "sandbox_base_url".into(),
            reason: e.to_string(),
        })?;
    let resp = match tokio::time::timeout(timeout, client.request(req)).await {
        Err(_) => {
            return Err(Error::UpstreamTimeout {
                within: crate::error::Within(timeout),
                host,
            })
        }
        Ok(Err(e)) => {
            return Err(Error::UpstreamUnreachable {
                reason: crate::proxy::failure::describe(&e),
                host,
            })
        }
        Ok(Ok(resp)) => resp,
    };
    let status = resp.status().as_u16();
    if status == 401 || status == 403 {
        return Err(Error::CredentialRejected { status, host });
    }
    // Reached but not serving: not "ok" (exit 69, like an unreachable one). Nor is one
    // throttling (the exchange takes 429 for a failure too), or one that redirects: the
    // proxy would hand the SDKs the redirect (an `http://` base URL for `https://`, a
    // path added or missing).
    if matches!(status, 301 | 302 | 303 | 307 | 308) {
        return Err(Error::UpstreamRedirect { status, host });
    }
    let why = match status {
        429 => Some(", throttling"),
        300..=399 | 500.. => Some(""),
        _ => None,
    };
    if let Some(why) = why {
        return Err(Error::UpstreamUnavailable {
            reason: format!("it answered {status}{why}"),
            host,
        });
    }
    outln!("control plane: {host} answered {status}");
    // The key heard, but nothing there: a base URL whose path is wrong (a prefix the API is
    // not under) passes, and every SDK call then gets the same 404. Not refused: a provider
    // may serve no list at this path (OpenSandbox's servers may serve it under `/v1` only,
    // while its base URL is the server's root). A prefix pasted twice is not seen.
    if status == 404 {
        crate::logging::warning(&format!(
            "nothing at {probed}: the SDKs' requests go under the same base URL; check its path"
        ));
    }
    outln!("ok");
    Ok(0)
}
