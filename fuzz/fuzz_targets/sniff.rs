//! Which control-plane responses are read for envd tokens (`sniff::plan`), and the reading
//! itself (`sniff::learn`).
//!
//! Input: `METHOD PATH\nBODY` (without a space, the whole first line is the path and the
//! method is GET); `learn` also sees the whole input. Invariants: no panic; `Forget` names a
//! non-empty id without `/`; at most `MAX_LEARNED` sandboxes learned from one answer (a
//! fork's list); a learned token is non-empty and never printed.
#![no_main]

use abx_proxy::proxy::sniff::{learn, plan, Sniff, MAX_LEARNED};
use http::Method;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (head, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let (method, path) = match head.iter().position(|&b| b == b' ') {
        Some(i) => (Method::from_bytes(&head[..i]).ok(), &head[i + 1..]),
        None => (Some(Method::GET), head),
    };
    if let (Some(method), Ok(path)) = (method, std::str::from_utf8(path)) {
        match plan(&method, path) {
            Sniff::Forget(id) => {
                assert_eq!(method, Method::DELETE);
                assert!(!id.is_empty() && !id.contains('/'), "{id:?}");
            }
            // `/v2/sandboxes…` too: the plan reads both spellings (the `/v2` rewrite).
            Sniff::Learn => {
                let rest = path.strip_prefix("/v2").unwrap_or(path);
                let rest = rest.strip_prefix("/sandboxes");
                assert!(
                    rest.is_some_and(|r| r.is_empty() || r.starts_with('/')),
                    "{path:?}"
                );
            }
            Sniff::None => {}
        }
    }
    for bytes in [body, data] {
        let learned = learn(bytes);
        assert!(learned.len() <= MAX_LEARNED);
        for (_id, token) in learned {
            assert!(!token.expose().is_empty());
            assert_eq!(format!("{token:?}"), "Secret(****)");
            assert_eq!(token.to_string(), "****");
        }
    }
});
