//! `Manifest::parse` on arbitrary text.
//!
//! Invariants: no panic; every error is an E8001 naming the file and a line within the text;
//! an accepted manifest satisfies every rule the parser promises (valid id, no reserved env
//! alias, only inheritable core keys, no secret default, a valid auth header name the key
//! may be sent as, no control character in a string `provider install` prints, a secret
//! `api_key` field, a plain `envd_domain` field, a `base_url` `serve` accepts).
#![no_main]

use abx_proxy::providers::manifest::INHERITABLE;
use abx_proxy::providers::{AuthKind, Manifest};
use abx_proxy::Error;
use libfuzzer_sys::fuzz_target;

const PATH: &str = "fuzz/abx-provider.toml";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Manifest::parse(text, PATH) {
        Err(e) => {
            assert_eq!(e.code(), "E8001", "{e:?}");
            let Error::Manifest { path, line, .. } = &e else {
                panic!("not a manifest error: {e:?}")
            };
            assert_eq!(path, PATH);
            assert!(
                *line <= text.lines().count().max(1),
                "line {line} past the end: {e}"
            );
            let _ = (e.to_string(), e.suggestion());
        }
        Ok(m) => {
            assert!(!m.id.is_empty() && m.id.len() <= 64, "{:?}", m.id);
            assert!(
                m.id.starts_with(|c: char| c.is_ascii_lowercase()),
                "{:?}",
                m.id
            );
            assert!(
                m.id.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{:?}",
                m.id
            );
            assert_ne!(m.id, "alicloud-express");
            for s in m.description.iter().chain([&m.base_url]) {
                assert!(!s.chars().any(char::is_control), "{s:?}");
            }
            if let AuthKind::Header(h) = &m.auth {
                let name = http::HeaderName::from_bytes(h.as_bytes());
                assert!(
                    name.is_ok_and(|n| abx_proxy::providers::manifest::auth_header_allowed(&n)),
                    "{h:?}"
                );
            }
            for key in &m.inherit {
                assert!(INHERITABLE.contains(&key.as_str()), "{key:?}");
            }
            for (name, field) in &m.fields {
                assert_eq!(name, &field.name);
                assert!(
                    !(field.secret && field.default.is_some()),
                    "secret default on {name}"
                );
                let env = m.canonical_env(name);
                assert!(
                    env.bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
                    "{env:?}"
                );
                for alias in &field.aliases {
                    assert!(!alias.is_empty());
                    for reserved in ["ABX_", "E2B_", "ALICLOUD_", "ALIBABA_CLOUD_"] {
                        assert!(!alias.starts_with(reserved), "{alias:?}");
                    }
                }
            }
            assert!(!m.fields.get("base_url").is_some_and(|f| f.secret));
            assert!(m.fields.get("api_key").is_some_and(|f| f.secret));
            assert!(!m.fields.get("envd_domain").is_some_and(|f| f.secret));
            assert!(
                abx_proxy::providers::manifest::upstream_url(&m.id, &m.base_url).is_ok(),
                "{:?}",
                m.base_url
            );
        }
    }
});
