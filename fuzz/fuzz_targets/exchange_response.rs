//! `credentials::exchange::parse_response` on arbitrary answers.
//!
//! Input: 2 bytes status (mapped to 100..=599), 4 bytes `token_ttl` (1 s .. 10 years), then
//! the body. `now` is fixed. Invariants: no panic, also not in what the refresher does with
//! an accepted answer (`iso8601`, `unix_seconds` of the expiry); an accepted key is non-empty,
//! trimmed, outlives `now + 5 s` and is not printed by `Debug`; an error's text (`Display`
//! and `Debug`) never repeats a key-like run (17+ letters/digits) of the body, except inside
//! the endpoint's own error `Code`, which errors name on purpose (sanitised), nor the key.
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use abx_proxy::credentials::exchange::{iso8601, parse_response, unix_seconds};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[path = "common.rs"]
mod common;

const TEN_YEARS: u64 = 10 * 365 * 86_400;

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let status = 100 + u16::from_be_bytes([data[0], data[1]]) % 500;
    let ttl = Duration::from_secs(
        1 + u64::from(u32::from_be_bytes([data[2], data[3], data[4], data[5]])) % TEN_YEARS,
    );
    let body = &data[6..];
    let now = UNIX_EPOCH + Duration::from_secs(1_750_000_000);

    let json: Option<Value> = serde_json::from_slice(body).ok();
    match parse_response(status, body, now, ttl) {
        Ok(issued) => {
            let key = issued.key.expose();
            assert!(!key.is_empty() && key.trim() == key, "{key:?}");
            assert!(issued.expires_at > now + Duration::from_secs(5));
            let shown = format!("{issued:?}");
            for run in common::key_like_runs(key.as_bytes(), 17) {
                assert!(
                    !common::contains(shown.as_bytes(), run),
                    "Debug shows the key: {shown}"
                );
            }
            // What the refresher and `check` do with an accepted answer.
            let _ = unix_seconds(issued.expires_at);
            let _ = iso8601(issued.expires_at);
        }
        Err(e) => {
            assert!(matches!(e.code(), "E1002" | "E1004"), "{e:?}");
            let code = json.as_ref().and_then(|j| {
                ["Code", "code"].iter().find_map(|k| match j.get(*k) {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Number(n)) => Some(n.to_string()),
                    _ => None,
                })
            });
            // Errors keep only the letters, digits and `._-` of the code: compare on letters
            // and digits, so a run the sanitising glued together still counts as the code's.
            let code = code.unwrap_or_default();
            let code_kept: String = code
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
                .collect();
            let code: String = code.chars().filter(char::is_ascii_alphanumeric).collect();
            for text in [e.to_string(), format!("{e:?}")] {
                for run in common::key_like_runs(text.as_bytes(), 17) {
                    if common::contains(body, run) {
                        assert!(
                            common::contains(code.as_bytes(), run),
                            "error repeats a piece of the body: {text}"
                        );
                    }
                }
                // The key itself, however it was spelled in the body.
                if let Some(key) = json.as_ref().and_then(key_in) {
                    if key.len() >= 17 && !code_kept.contains(&key) {
                        assert!(!text.contains(&key), "error repeats the key: {text}");
                    }
                }
            }
        }
    }
});

/// Every place SPEC §5 reads a key from.
fn key_in(json: &Value) -> Option<String> {
    for name in ["apiKey", "ApiKey"] {
        match json.get(name) {
            Some(Value::String(s)) => return Some(s.trim().to_string()),
            Some(obj @ Value::Object(_)) => {
                for inner in ["apiKeyValue", "ApiKeyValue"] {
                    if let Some(Value::String(s)) = obj.get(inner) {
                        return Some(s.trim().to_string());
                    }
                }
            }
            _ => {}
        }
    }
    None
}
