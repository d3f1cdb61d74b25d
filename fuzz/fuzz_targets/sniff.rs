//! Which control-plane responses are read for envd tokens (`sniff::plan`), the reading
//! itself (`sniff::learn`), and a token look-up's answer (`sniff::looked_up`).
//!
//! Input: `METHOD PATH\nBODY` (without a space, the whole first line is the path and the
//! method is GET); `learn` also sees the whole input. Invariants: no panic; `Forget` names a
//! non-empty id without `/`; at most `MAX_LEARNED` sandboxes learned from one answer (a
//! fork's list); a learned token is non-empty, at most `MAX_TOKEN_LEN` bytes and never
//! printed. A look-up's answer gives a token only for the sandbox it describes (its
//! `sandboxID`, in any case, or that id followed by `-` and a client id), the answer's own
//! `envdAccessToken` (or none), never for another id: stored under the asked id, another
//! sandbox's token would go to this one's envd.
#![no_main]

use abx_proxy::proxy::sniff::{learn, looked_up, plan, Sniff, MAX_LEARNED, MAX_TOKEN_LEN};
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
            assert!(token.expose().len() <= MAX_TOKEN_LEN);
            assert_eq!(format!("{token:?}"), "Secret(****)");
            assert_eq!(token.to_string(), "****");
        }
    }
    look_up(body, head);
});

/// `looked_up` for the id the first line names (its last `/` segment), and for ids made
/// from the answer's own: the same with a client id, and one character more.
fn look_up(body: &[u8], head: &[u8]) {
    let asked = String::from_utf8_lossy(head);
    let asked = asked.rsplit('/').next().unwrap_or("");
    // What the answer says, read independently: an object's `sandboxID` and token. Only
    // for an answer a `Value` reads (the proxy's reading skips fields it does not use
    // unchecked, bytes that are not UTF-8 in their strings included).
    let Ok(said) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    let field = |name: &str| said.get(name).cloned();
    let id = field("sandboxID").and_then(|v| v.as_str().map(str::to_owned));
    let token = match field("envdAccessToken") {
        Some(serde_json::Value::String(t)) => Some(t),
        Some(serde_json::Value::Null) | None => Some(String::new()),
        Some(_) => None,
    };
    let fits = |asked: &str, id: &str| {
        asked.eq_ignore_ascii_case(id)
            || (!id.is_empty()
                && asked.len() > id.len()
                && asked.as_bytes()[..id.len()].eq_ignore_ascii_case(id.as_bytes())
                && asked.as_bytes()[id.len()] == b'-')
    };
    if let Ok(got) = looked_up(body, asked) {
        let id = id
            .as_deref()
            .expect("a token from an answer with no sandboxID");
        assert!(fits(asked, id), "{asked:?} given the token of {id:?}");
        assert_eq!(
            Some(got.expose()),
            token.as_deref(),
            "another token than the answer's"
        );
        assert!(got.expose().len() <= MAX_TOKEN_LEN);
    }
    if let Some(id) = id {
        // The answer as the proxy reads it (serde's derive refuses what a `Value` keeps,
        // such as a field twice): its exact id and the client-id form alike.
        let exact = looked_up(body, &id).is_ok();
        if !id.is_empty() {
            let client = format!("{id}-client");
            assert_eq!(looked_up(body, &client).is_ok(), exact, "{client:?}");
        }
        let other = format!("{id}x");
        assert!(
            looked_up(body, &other).is_err(),
            "{other:?} given {id:?}'s token"
        );
    }
}
