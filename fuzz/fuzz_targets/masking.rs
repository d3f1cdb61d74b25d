//! `settings::shown::secrets_masked`, what every log line goes through with the secrets a
//! setting's value carries (`log_writer`), and what `config list` shows.
//!
//! Input: up to four secrets and the text, split at NUL bytes (the text last), as UTF-8
//! (lossily). Invariants: no copy of any secret of 8 characters or more is left in the
//! text in any ASCII case, however the copies overlap (secrets with `*`, the mask's own
//! character, are left out: a mask beside one could spell it again); the text is
//! unchanged when no secret is in it; nothing but the secrets' copies is changed (the
//! text outside them is kept, in order, checked for a text without `*`).
#![no_main]

use abx_proxy::settings::shown::{secrets_masked, MIN_EMBEDDED};
use abx_proxy::Secret;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts: Vec<&str> = text.split('\0').collect();
    let Some(value) = parts.pop() else {
        return;
    };
    let secrets: Vec<&str> = (parts.into_iter())
        .filter(|s| !s.contains('*'))
        .take(4)
        .collect();
    let held: Vec<Secret> = secrets.iter().map(|s| Secret::new(*s)).collect();
    let masked = secrets_masked(value, &held);
    let looked_for: Vec<String> = (secrets.iter())
        .filter(|s| s.chars().count() >= MIN_EMBEDDED)
        .map(|s| s.to_ascii_lowercase())
        .collect();
    let folded = masked.to_ascii_lowercase();
    for secret in &looked_for {
        assert!(
            !folded.contains(secret.as_str()),
            "a secret left in {masked:?}"
        );
    }
    let found = looked_for
        .iter()
        .any(|s| value.to_ascii_lowercase().contains(s.as_str()));
    if !found {
        assert_eq!(masked, value, "changed with no secret in it");
    }
    // What is left beside the masks is the text's own, in order (told apart from the
    // masks only in a text without `*` of its own).
    if value.contains('*') {
        return;
    }
    let kept: Vec<&str> = masked.split("****").filter(|p| !p.is_empty()).collect();
    let mut rest: &str = &value;
    for piece in kept {
        let at = rest.find(piece).expect("text the value did not have");
        rest = &rest[at + piece.len()..];
    }
});
