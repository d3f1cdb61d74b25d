//! Helpers shared by the targets (each target includes this file with `#[path]`).
#![allow(dead_code)]

/// Maximal runs of ASCII letters and digits at least `min` bytes long: what an API key, an
/// AccessKey secret or an envd token looks like once separators are ignored.
pub fn key_like_runs(bytes: &[u8], min: usize) -> Vec<&[u8]> {
    bytes
        .split(|b| !b.is_ascii_alphanumeric())
        .filter(|run| run.len() >= min)
        .collect()
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// `prefix` + digits (+ `suffix`), e.g. `syntax error at line 12`.
pub fn is_numbered(s: &str, prefix: &str, suffix: &str) -> bool {
    s.strip_prefix(prefix)
        .and_then(|rest| rest.strip_suffix(suffix))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}
