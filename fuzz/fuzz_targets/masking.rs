//! `settings::shown::secrets_masked`, what every log line goes through with the secrets a
//! setting's value carries (`log_writer`), and what `config list` shows.
//!
//! Input: up to four secrets and the text, split at NUL bytes (the text last), as UTF-8
//! (lossily). Invariants: the output is the text with each run of bytes that copies of
//! secrets of 8 characters or more cover, in any ASCII case and however they overlap,
//! replaced by one `****`, and nothing else changed (worked out here byte by byte, from
//! every start); so no copy of such a secret without a `*` of its own is left (one with
//! a `*` could be spelt again by a mask beside it).
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
    let secrets: Vec<&str> = parts.into_iter().take(4).collect();
    let held: Vec<Secret> = secrets.iter().map(|s| Secret::new(*s)).collect();
    let masked = secrets_masked(value, &held);

    let looked_for: Vec<String> = (secrets.iter())
        .filter(|s| s.chars().count() >= MIN_EMBEDDED)
        .map(|s| s.to_ascii_lowercase())
        .collect();
    assert_eq!(masked, expected(value, &looked_for), "secrets {secrets:?}");
    let folded = masked.to_ascii_lowercase();
    for secret in looked_for.iter().filter(|s| !s.contains('*')) {
        assert!(
            !folded.contains(secret.as_str()),
            "a secret left in {masked:?}"
        );
    }
});

/// `value` with each run of bytes some copy of a secret (lower case) covers, in any ASCII
/// case, as one `****`. UTF-8 matches of UTF-8 start and end on characters.
fn expected(value: &str, secrets: &[String]) -> String {
    let folded = value.to_ascii_lowercase();
    let mut covered = vec![false; value.len()];
    for secret in secrets {
        for start in 0..value.len() {
            if folded.as_bytes()[start..].starts_with(secret.as_bytes()) {
                covered[start..start + secret.len()].fill(true);
            }
        }
    }
    let mut out = String::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        if covered[i] {
            out.push_str("****");
            while i < value.len() && covered[i] {
                i += 1;
            }
        } else {
            let c = value[i..].chars().next().unwrap_or_default();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}
