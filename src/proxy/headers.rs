//! Phase 3, rewrite: header hygiene both ways and credential attachment. Works in place on
//! the request's own `HeaderMap`: no copies on the hot path.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::secret::Secret;

/// RFC 9110 §7.6.1 hop-by-hop fields, plus the de-facto ones.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
pub const X_ACCESS_TOKEN: HeaderName = HeaderName::from_static("x-access-token");
pub const E2B_SANDBOX_ID: HeaderName = HeaderName::from_static("e2b-sandbox-id");
pub const E2B_SANDBOX_PORT: HeaderName = HeaderName::from_static("e2b-sandbox-port");

/// envd's default user when the client names none (`user:` with an empty password).
const DEFAULT_BASIC: HeaderValue = HeaderValue::from_static("Basic dXNlcjo=");

/// Whether the message asks to switch protocols (`Connection: upgrade` + `Upgrade`).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| connection_tokens(v).any(|t| t.eq_ignore_ascii_case("upgrade")))
}

fn connection_tokens(v: &HeaderValue) -> impl Iterator<Item = &str> {
    v.to_str()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Removes hop-by-hop headers and those named in `Connection`. With `upgrade`, the
/// `Upgrade` header and `Connection: upgrade` survive (WebSocket needs them end to end).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    // Every `Connection` line counts, not just the first: `Connection: close` followed by
    // `Connection: X-Secret` must still drop `X-Secret`. The list is only built when some
    // token names a field beyond the ones removed below anyway.
    let names_fields = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(connection_tokens)
        .any(|t| !is_plain_connection_token(t));
    if names_fields {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(connection_tokens)
            .filter(|t| !is_plain_connection_token(t))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(&name);
        }
    }
    // `TE: trailers` is the one TE value a proxy may pass on (gRPC over HTTP/2 needs it).
    let te_trailers = headers
        .get(header::TE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    headers.remove(header::TE);
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    for name in &HOP_BY_HOP {
        if upgrade && name == header::UPGRADE {
            continue;
        }
        headers.remove(name);
    }
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// `close`, `keep-alive` and `upgrade`: options, or fields handled by [`HOP_BY_HOP`].
fn is_plain_connection_token(t: &str) -> bool {
    ["close", "keep-alive", "upgrade"]
        .iter()
        .any(|p| t.eq_ignore_ascii_case(p))
}

/// How a provider wants its key.
#[derive(Debug, Clone)]
pub enum AuthScheme {
    /// `Authorization: Bearer <key>`.
    Bearer,
    /// `<header>: <key>`.
    Header(HeaderName),
}

impl From<&crate::providers::AuthKind> for AuthScheme {
    fn from(kind: &crate::providers::AuthKind) -> Self {
        match kind {
            crate::providers::AuthKind::Bearer => AuthScheme::Bearer,
            // The manifest reader checked the name; an invalid one cannot get here.
            crate::providers::AuthKind::Header(h) => HeaderName::from_bytes(h.as_bytes())
                .map(AuthScheme::Header)
                .unwrap_or(AuthScheme::Bearer),
        }
    }
}

impl AuthScheme {
    /// The header value for `key`, built once per key rather than once per request.
    pub fn value(&self, key: &Secret) -> Option<HeaderValue> {
        let mut v = match self {
            AuthScheme::Bearer => HeaderValue::try_from(format!("Bearer {}", key.expose())).ok()?,
            AuthScheme::Header(_) => HeaderValue::from_str(key.expose()).ok()?,
        };
        v.set_sensitive(true);
        Some(v)
    }

    pub fn header(&self) -> HeaderName {
        match self {
            AuthScheme::Bearer => header::AUTHORIZATION,
            AuthScheme::Header(h) => h.clone(),
        }
    }
}

/// Control plane: every client credential out, the resolved key in.
pub fn authorize_api(headers: &mut HeaderMap, scheme: &AuthScheme, value: HeaderValue) {
    headers.remove(header::AUTHORIZATION);
    headers.remove(X_API_KEY);
    let name = scheme.header();
    headers.remove(&name);
    headers.insert(name, value);
}

/// envd: the sandbox's token and routing headers; the client's `Authorization: Basic …`
/// (which selects the sandbox user) is kept, anything else becomes the default user.
pub fn authorize_envd(headers: &mut HeaderMap, token: &Secret, sandbox_id: &str, port: u16) {
    headers.remove(X_API_KEY);
    let basic = headers.get(header::AUTHORIZATION).is_some_and(|v| {
        v.as_bytes().len() > 6 && v.as_bytes()[..6].eq_ignore_ascii_case(b"basic ")
    });
    if !basic {
        headers.insert(header::AUTHORIZATION, DEFAULT_BASIC);
    }
    if let Ok(mut v) = HeaderValue::from_str(token.expose()) {
        v.set_sensitive(true);
        headers.insert(X_ACCESS_TOKEN, v);
    }
    if let Ok(v) = HeaderValue::from_str(sandbox_id) {
        headers.insert(E2B_SANDBOX_ID, v);
    }
    headers.insert(E2B_SANDBOX_PORT, HeaderValue::from(port));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_and_connection_named() {
        let mut h = map(&[
            ("connection", "close, X-Custom"),
            ("x-custom", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "gzip"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic x"),
            ("x-kept", "yes"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn every_connection_line_counts() {
        let mut h = map(&[
            ("connection", "close"),
            ("connection", "X-Hop-A, keep-alive"),
            ("connection", "Upgrade, x-hop-b"),
            ("x-hop-a", "1"),
            ("x-hop-b", "2"),
            ("x-kept", "yes"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn upgrade_survives_when_upgrading() {
        let mut h = map(&[("connection", "Upgrade"), ("upgrade", "websocket")]);
        assert!(is_upgrade(&h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
    }

    #[test]
    fn api_credentials_replaced() {
        let mut h = map(&[
            ("x-api-key", "dummy"),
            ("X-Api-Key", "dummy2"),
            ("authorization", "Bearer dummy"),
        ]);
        let key = Secret::new("real");
        authorize_api(
            &mut h,
            &AuthScheme::Bearer,
            AuthScheme::Bearer.value(&key).unwrap(),
        );
        assert_eq!(h.len(), 1);
        assert_eq!(h["authorization"], "Bearer real");
    }

    #[test]
    fn envd_basic_kept_or_defaulted() {
        let t = Secret::new("tok");
        let mut h = map(&[("authorization", "Basic cm9vdDo="), ("x-api-key", "d")]);
        authorize_envd(&mut h, &t, "isb-1", 49983);
        assert_eq!(h["authorization"], "Basic cm9vdDo=");
        assert!(!h.contains_key("x-api-key"));
        assert_eq!(h["x-access-token"], "tok");
        assert_eq!(h["e2b-sandbox-port"], "49983");
        let mut h = map(&[("authorization", "Bearer dummy")]);
        authorize_envd(&mut h, &t, "isb-1", 8080);
        assert_eq!(h["authorization"], "Basic dXNlcjo=");
    }
}
