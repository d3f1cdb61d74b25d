//! The `/v2` compatibility rewrite (SPEC §4): E2B SDKs 2.51+ create and connect through
//! `POST /v2/sandboxes` and `POST /v2/sandboxes/{id}/connect`; Alibaba Cloud Agent Sandbox
//! serves `/sandboxes` and `/sandboxes/{id}/connect`. A rewritten request gets what the
//! older SDKs send on those paths when its body lacks it: `"secure": true` in a create, and
//! `"timeout": 300` in a connect (`/v2` makes it optional with that default, the v1 schema
//! requires it; SDKs 2.51+ send `{}`).

use std::cell::Cell;

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
    let Some((open, field)) = (match scan(&body, rewrite) {
        Scan::Whole(keys) => insertion(rewrite, &body, keys),
        Scan::Cut(_) | Scan::NotObject => None,
    }) else {
        return body;
    };
    let mut out = Vec::with_capacity(body.len() + field.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(&field);
    out.extend_from_slice(&body[open + 1..]);
    Bytes::from(out)
}

/// The first bytes of a rewritten body too long to be read whole (past the 1 MiB bound),
/// in pieces to send in order: with the field added as [`complete_body`] adds it, when
/// they are the start of a JSON object whose keys so far do not name it. e2b 2.63 sends a
/// create's `envs` and `metadata` in it: past the bound, such a sandbox was created
/// without `"secure": true`. The field may still come after these bytes: a JSON object's
/// last value for a key is the one the upstream's decoder keeps (Go's, Python's,
/// JavaScript's), the client's. The pieces around the field are slices of `head`, not a
/// copy: they keep its room in the bound on bodies read whole (see `body::Held`).
pub fn complete_head(rewrite: &Rewrite, head: Bytes) -> Vec<Bytes> {
    let found = match scan(&head, rewrite) {
        // No key yet: whether the object is empty is past the head.
        Scan::Cut(keys) if !keys.empty => insertion(rewrite, &head, keys),
        Scan::Whole(keys) => insertion(rewrite, &head, keys),
        Scan::Cut(_) | Scan::NotObject => None,
    };
    match found {
        Some((open, field)) => vec![head.slice(..=open), field, head.slice(open + 1..)],
        None => vec![head],
    }
}

/// The field a rewrite adds: its key, and the key with its value as JSON.
fn field_of(rewrite: &Rewrite) -> Option<(&'static str, String)> {
    match rewrite {
        Rewrite::None => None,
        Rewrite::Create => Some(("secure", "\"secure\":true".to_string())),
        Rewrite::Connect => Some(("timeout", format!("\"timeout\":{CONNECT_TIMEOUT}"))),
    }
}

/// Where the rewrite's field goes in `body`, a JSON object (or its start) whose keys are
/// `keys`: after the object's opening brace (its first byte that is not JSON whitespace),
/// with a comma when keys follow; none when a key names it.
fn insertion(rewrite: &Rewrite, body: &[u8], keys: Keys) -> Option<(usize, Bytes)> {
    let (_, field) = field_of(rewrite)?;
    if keys.named {
        return None;
    }
    let open = body.iter().position(|b| *b == b'{')?;
    let comma = if keys.empty { "" } else { "," };
    Some((open, Bytes::from(format!("{field}{comma}"))))
}

/// What the rewrite needs to know of a JSON object's keys.
#[derive(Clone, Copy)]
struct Keys {
    /// One of them is `name`.
    named: bool,
    empty: bool,
}

/// What a body's bytes are, read as JSON.
enum Scan {
    /// One JSON object, and its keys.
    Whole(Keys),
    /// The bytes end inside a JSON value: the top-level object's keys read before that,
    /// if it is one.
    Cut(Keys),
    NotObject,
}

/// The top-level keys of `body` as a JSON object, read without building it: a 1 MiB body
/// of small values made a tree of 15 MB. Each key is noted as it is read, so that bytes
/// that end mid-object still tell the keys before their end.
fn scan(body: &[u8], rewrite: &Rewrite) -> Scan {
    let Some((name, _)) = field_of(rewrite) else {
        return Scan::NotObject;
    };
    match scan_keys(body, name) {
        // serde_json says a number cut at the end (`-`, `1.`, `1e`, `1e+`) is an invalid
        // number, not a cut: without its last characters the bytes say what they are.
        Scan::NotObject => {
            let number =
                |b: &u8| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E');
            let kept = body.len() - body.iter().rev().take_while(|b| number(b)).count();
            match kept < body.len() {
                true => match scan_keys(&body[..kept], name) {
                    cut @ Scan::Cut(_) => cut,
                    _ => Scan::NotObject,
                },
                false => Scan::NotObject,
            }
        }
        scanned => scanned,
    }
}

/// See [`scan`].
fn scan_keys(body: &[u8], name: &str) -> Scan {
    struct Visit<'a> {
        name: &'a str,
        seen: &'a Cell<Keys>,
    }

    impl<'de> serde::de::Visitor<'de> for Visit<'_> {
        type Value = ();

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                let mut keys = self.seen.get();
                keys.empty = false;
                keys.named |= key == self.name;
                self.seen.set(keys);
                map.next_value::<serde::de::IgnoredAny>()?;
            }
            Ok(())
        }
    }

    let seen = Cell::new(Keys {
        named: false,
        empty: true,
    });
    let mut json = serde_json::Deserializer::from_slice(body);
    let visit = Visit { name, seen: &seen };
    match serde::Deserializer::deserialize_map(&mut json, visit).and_then(|()| json.end()) {
        Ok(()) => Scan::Whole(seen.get()),
        Err(e) if e.is_eof() => Scan::Cut(seen.get()),
        Err(_) => Scan::NotObject,
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
    fn the_start_of_a_body_too_long_to_hold_gets_the_field_when_its_keys_lack_it() {
        let head = |r: &Rewrite, b: &'static [u8]| {
            let pieces = complete_head(r, Bytes::from_static(b));
            // Around the field, slices of what was read: its room stays held.
            if pieces.len() == 3 {
                let around = [&pieces[0], &pieces[2]];
                assert!(around
                    .iter()
                    .all(|p| b.as_ptr_range().contains(&p.as_ptr()) || p.is_empty()));
            }
            Bytes::from(pieces.concat())
        };
        let create = |b| head(&Rewrite::Create, b);
        // e2b's create, cut inside its `envs`.
        let b = create(br#"{"templateID":"base","envs":{"BIG":"xxxx"#);
        assert_eq!(
            &b[..],
            br#"{"secure":true,"templateID":"base","envs":{"BIG":"xxxx"#
        );
        // Cut inside a key: the keys before it are known.
        let b = create(br#" {"templateID":"base","sec"#);
        assert_eq!(&b[..], br#" {"secure":true,"templateID":"base","sec"#);
        // A nested `secure` is not the create's.
        let b = create(br#"{"metadata":{"secure":"no"},"envs":{"A":"x"#);
        assert_eq!(
            &b[..],
            br#"{"secure":true,"metadata":{"secure":"no"},"envs":{"A":"x"#
        );
        let b = head(&Rewrite::Connect, br#"{"memory":tr"#);
        assert_eq!(&b[..], br#"{"timeout":300,"memory":tr"#);
        // Cut inside a number, which serde_json calls invalid rather than cut.
        for cut in [
            &br#"{"n":-"#[..],
            br#"{"n":1."#,
            br#"{"n":1e"#,
            br#"{"n":1e+"#,
            br#"{"n":12"#,
        ] {
            let b = create(cut);
            assert_eq!(
                &b[..15],
                br#"{"secure":true,"#,
                "{}",
                String::from_utf8_lossy(cut)
            );
            assert_eq!(&b[15..], &cut[1..]);
        }
        // As sent: the client's own field, no key yet (the object may be empty), not an
        // object, an object and more, and no rewrite.
        for sent in [
            &br#"{"templateID":"base","secure":false,"envs":{"A":"x"#[..],
            br#"{ "#,
            br#"{"#,
            b"",
            br#"[{"a":1},"#,
            br#""{\"a\":"#,
            br#"{"a":1} {"b":"#,
            br#"{"a":1,,"#,
            br#"{"a":1}5"#,
            br#"{"a":1,,"b":1."#,
        ] {
            assert_eq!(&create(sent)[..], sent, "{}", String::from_utf8_lossy(sent));
        }
        let b = head(&Rewrite::None, br#"{"a":"x"#);
        assert_eq!(&b[..], br#"{"a":"x"#);
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
