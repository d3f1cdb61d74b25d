//! The `/v2` compatibility rewrite (SPEC §4): E2B SDKs 2.51+ create and connect through
//! `POST /v2/sandboxes` and `POST /v2/sandboxes/{id}/connect`; Alibaba Cloud Agent Sandbox
//! serves `/sandboxes` and `/sandboxes/{id}/connect`. A rewritten request gets what the
//! older SDKs send on those paths when its body lacks it: `"secure": true` in a create, and
//! `"timeout": 300` in a connect (`/v2` makes it optional with that default, the v1 schema
//! requires it; SDKs 2.51+ send `{}`).

use bytes::Bytes;
use http::Method;

use super::sandbox_path::{self, SandboxPath};

/// What the rewrite does to one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// Leave the request alone.
    None,
    /// `POST /v2/sandboxes` → `/sandboxes`, body gains `"secure": true`.
    Create,
    /// `POST /v2/sandboxes/{id}/connect` → `/sandboxes/{id}/connect`, body gains
    /// `"timeout": 300`.
    Connect,
}

pub fn plan(method: &Method, path: &str) -> Rewrite {
    if method != Method::POST {
        return Rewrite::None;
    }
    match sandbox_path::parse(path) {
        Some(SandboxPath {
            v2: true, id: None, ..
        }) => Rewrite::Create,
        Some(SandboxPath {
            v2: true,
            id: Some(_),
            action: Some("connect"),
        }) => Rewrite::Connect,
        _ => Rewrite::None,
    }
}

/// The path without the `/v2` prefix.
pub fn rewritten_path(path: &str) -> &str {
    path.strip_prefix("/v2").unwrap_or(path)
}

/// The `/v2` connect's default sandbox timeout, in seconds (E2B's OpenAPI `ConnectSandboxV2`).
const CONNECT_TIMEOUT: u64 = 300;

/// The body of a rewritten request with the field the v1 path expects added when absent
/// (see the module doc); anything that is not a JSON object is passed on unchanged for the
/// upstream to judge.
///
/// The field goes in after the object's opening brace, every other byte as the client
/// sent it: the body re-encoded from its parse had its keys sorted, `1.5e1` as `15.0`,
/// and an integer past 64 bits cut to a float's digits.
pub fn complete_body(rewrite: &Rewrite, body: Bytes) -> Bytes {
    let (name, field) = match rewrite {
        Rewrite::None => return body,
        Rewrite::Create => ("secure", "\"secure\":true".to_string()),
        Rewrite::Connect => ("timeout", format!("\"timeout\":{CONNECT_TIMEOUT}")),
    };
    let Some(Keys {
        named: false,
        empty,
    }) = keys(&body, name)
    else {
        return body;
    };
    // An object parsed: its first byte that is not JSON whitespace is its brace.
    let Some(open) = body.iter().position(|b| *b == b'{') else {
        return body;
    };
    let mut out = Vec::with_capacity(body.len() + field.len() + 1);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(field.as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Bytes::from(out)
}

/// What the rewrite needs to know of a JSON object's keys.
struct Keys {
    /// One of them is `name`.
    named: bool,
    empty: bool,
}

/// The keys of `body` when it is a JSON object, read without building it: a 1 MiB body of
/// small values made a tree of 15 MB.
fn keys(body: &[u8], name: &str) -> Option<Keys> {
    struct Visit<'a>(&'a str);

    impl<'de> serde::de::Visitor<'de> for Visit<'_> {
        type Value = Keys;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
            let mut keys = Keys {
                named: false,
                empty: true,
            };
            while let Some(key) = map.next_key::<String>()? {
                keys.empty = false;
                keys.named |= key == self.0;
                map.next_value::<serde::de::IgnoredAny>()?;
            }
            Ok(keys)
        }
    }

    let mut json = serde_json::Deserializer::from_slice(body);
    let keys = serde::Deserializer::deserialize_map(&mut json, Visit(name)).ok()?;
    json.end().ok()?;
    Some(keys)
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
        // As token learning and the retry rule read it: a trailing slash is none.
        assert_eq!(
            plan(&Method::POST, "/v2/sandboxes/isb-1/connect/"),
            Rewrite::Connect
        );
        assert_eq!(plan(&Method::POST, "/v2/sandboxes//connect"), Rewrite::None);
        assert_eq!(plan(&Method::POST, "/v2/sandboxes//"), Rewrite::Create);
        assert_eq!(
            rewritten_path("/v2/sandboxes/x/connect"),
            "/sandboxes/x/connect"
        );
    }

    #[test]
    fn secure_added_once() {
        let add_secure = |b: &'static [u8]| complete_body(&Rewrite::Create, Bytes::from_static(b));
        let b = add_secure(br#"{"templateID":"base"}"#);
        assert_eq!(&b[..], br#"{"secure":true,"templateID":"base"}"#);
        // Every other byte as sent: no key sorted, no number re-encoded.
        let sent = br#" {"templateID":"base","timeout":1.5e1,"big":123456789012345678901234567890,"a":1.0}"#;
        let b = add_secure(sent);
        assert_eq!(&b[..2], b" {");
        assert_eq!(&b[2..16], br#""secure":true,"#);
        assert_eq!(&b[16..], &sent[2..]);
        let b = add_secure(br#"{"secure":false}"#);
        assert_eq!(&b[..], br#"{"secure":false}"#);
        assert_eq!(&add_secure(b"nope")[..], b"nope");
        // Not one object: as sent.
        for sent in [&b"[]"[..], b"{} {}", b"{\"a\":1", b"\"{}\"", b"{\"a\":1}x"] {
            assert_eq!(
                &add_secure(sent)[..],
                sent,
                "{}",
                String::from_utf8_lossy(sent)
            );
        }
        // A key spelled with an escape is that key.
        let escaped = br#"{"\u0073ecure":false}"#;
        assert_eq!(&add_secure(escaped)[..], escaped);
        let nested = add_secure(br#"{"a":{"secure":false}}"#);
        assert_eq!(&nested[..], br#"{"secure":true,"a":{"secure":false}}"#);
    }

    #[test]
    fn connect_gets_the_v2_default_timeout_once() {
        let connect = |b: &'static [u8]| complete_body(&Rewrite::Connect, Bytes::from_static(b));
        assert_eq!(&connect(b"{}")[..], br#"{"timeout":300}"#);
        assert_eq!(&connect(b"{ }")[..], br#"{"timeout":300 }"#);
        let b = connect(br#"{"memory":false}"#);
        assert_eq!(&b[..], br#"{"timeout":300,"memory":false}"#);
        assert_eq!(&connect(br#"{"timeout":60}"#)[..], br#"{"timeout":60}"#);
        assert_eq!(&connect(b"")[..], b"");
        assert_eq!(
            &complete_body(&Rewrite::None, Bytes::from_static(b"{}"))[..],
            b"{}"
        );
    }
}
