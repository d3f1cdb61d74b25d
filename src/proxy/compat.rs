//! The `/v2` compatibility rewrite (SPEC §4): E2B SDKs 2.51+ create and connect through
//! `POST /v2/sandboxes` and `POST /v2/sandboxes/{id}/connect`; Alibaba Cloud Agent Sandbox
//! serves `/sandboxes` and `/sandboxes/{id}/connect`. A rewritten create gets
//! `"secure": true` when the body lacks it, as the older SDKs send.

use bytes::Bytes;
use http::Method;

/// What the rewrite does to one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// Leave the request alone.
    None,
    /// `POST /v2/sandboxes` → `/sandboxes`, body gains `"secure": true`.
    Create,
    /// `POST /v2/sandboxes/{id}/connect` → `/sandboxes/{id}/connect`.
    Connect,
}

pub fn plan(method: &Method, path: &str) -> Rewrite {
    if method != Method::POST {
        return Rewrite::None;
    }
    match path.strip_prefix("/v2/sandboxes") {
        Some("") | Some("/") => Rewrite::Create,
        Some(rest) => match rest
            .strip_prefix('/')
            .and_then(|r| r.strip_suffix("/connect"))
        {
            Some(id) if !id.is_empty() && !id.contains('/') => Rewrite::Connect,
            _ => Rewrite::None,
        },
        None => Rewrite::None,
    }
}

/// The path without the `/v2` prefix.
pub fn rewritten_path(path: &str) -> &str {
    path.strip_prefix("/v2").unwrap_or(path)
}

/// The create body with `"secure": true` added when absent; anything that is not a JSON
/// object is passed on unchanged for the upstream to judge.
pub fn add_secure(body: Bytes) -> Bytes {
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(serde_json::Value::Object(mut obj)) if !obj.contains_key("secure") => {
            obj.insert("secure".into(), serde_json::Value::Bool(true));
            serde_json::to_vec(&obj).map(Bytes::from).unwrap_or(body)
        }
        _ => body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        assert_eq!(plan(&Method::POST, "/v2/sandboxes"), Rewrite::Create);
        assert_eq!(
            plan(&Method::POST, "/v2/sandboxes/isb-1/connect"),
            Rewrite::Connect
        );
        assert_eq!(plan(&Method::GET, "/v2/sandboxes"), Rewrite::None);
        assert_eq!(plan(&Method::POST, "/sandboxes"), Rewrite::None);
        assert_eq!(
            plan(&Method::POST, "/v2/sandboxes/a/b/connect"),
            Rewrite::None
        );
        assert_eq!(
            rewritten_path("/v2/sandboxes/x/connect"),
            "/sandboxes/x/connect"
        );
    }

    #[test]
    fn secure_added_once() {
        let b = add_secure(Bytes::from_static(br#"{"templateID":"base"}"#));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["secure"], true);
        assert_eq!(v["templateID"], "base");
        let b = add_secure(Bytes::from_static(br#"{"secure":false}"#));
        assert_eq!(&b[..], br#"{"secure":false}"#);
        assert_eq!(&add_secure(Bytes::from_static(b"nope"))[..], b"nope");
    }
}
