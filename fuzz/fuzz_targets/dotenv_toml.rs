//! The `.env` reader and the config.toml reader on arbitrary text.
//!
//! Invariants: no panic; an error names the label and a line (or byte) number, never a piece
//! of the input; config.toml never yields a secret key; a warning never repeats a value.
#![no_main]

use std::path::Path;

use abx_proxy::settings::layers::{parse_config_toml_str, parse_dotenv_str};
use abx_proxy::settings::KEYS;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    dotenv(text);
    config(text);
});

fn dotenv(text: &str) {
    // Lines as the reader counts them: a carriage return that ends no `\r\n` ends a line
    // too, when the file has one (old Mac line ends).
    let lone_cr = text
        .char_indices()
        .any(|(i, c)| c == '\r' && !text[i + 1..].starts_with('\n'));
    let ends = |c: char| c == '\n' || (lone_cr && c == '\r');
    let lines = text
        .replace("\r\n", "\n")
        .chars()
        .filter(|&c| ends(c))
        .count()
        + 1;
    // Read as a shared `./.env`: a skipped line is warned about by number, never by text.
    let mut warnings = Vec::new();
    let shared = parse_dotenv_str(text, "fuzz.env", Some(&mut warnings));
    for w in &warnings {
        // Past ten skipped lines, one warning counts the rest: numbers only.
        if let Some(more) = w.strip_prefix("fuzz.env: ") {
            if let Some((count, last)) = more.split_once(" skipped likewise, up to line ") {
                let count = count
                    .strip_suffix(" more lines")
                    .or_else(|| count.strip_suffix(" more line"));
                assert!(
                    count.is_some_and(|c| common::is_numbered(c, "", "")),
                    "unexpected warning shape: {w:?}"
                );
                assert!(
                    common::is_numbered(last, "", "") && last.parse::<usize>().unwrap() <= lines,
                    "unexpected warning shape: {w:?}"
                );
                continue;
            }
        }
        // `line N skipped: …`, or `line N (NAME): …` for a substitution dotenvy reads
        // otherwise than meant, NAME being a variable name and nothing else of the line.
        let rest = w
            .strip_prefix("fuzz.env: line ")
            .unwrap_or_else(|| panic!("unexpected warning shape: {w:?}"));
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (n, rest) = rest.split_at(digits);
        let n = n
            .parse::<usize>()
            .unwrap_or_else(|_| panic!("unexpected warning shape: {w:?}"));
        assert!(n <= lines, "warning names line {n} of {lines}");
        if let Some(named) = rest.strip_prefix(" (") {
            let name = named.split_once("): ").map_or("", |(name, _)| name);
            assert!(
                !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'),
                "unexpected warning shape: {w:?}"
            );
        } else {
            assert!(
                rest.starts_with(" skipped: "),
                "unexpected warning shape: {w:?}"
            );
        }
    }
    if let Err(e) = shared {
        check_error(&e, lines);
    }
    // As abx-proxy's own file: strict.
    if let Err(e) = parse_dotenv_str(text, "fuzz.env", None) {
        check_error(&e, lines);
    }
}

/// What a line's syntax error may add after its number.
const HINTS: [&str; 2] = [
    ": NUL bytes (UTF-16 text? save it as UTF-8)",
    ": dotenvy reads no `$` (or `$NAME`) just before a closing double quote; write \
     `${NAME}`, or `\\$` for a dollar sign",
];

fn check_error(e: &abx_proxy::Error, lines: usize) {
    assert_eq!(e.code(), "E1006");
    let msg = e.to_string();
    let reason = msg
        .strip_prefix("cannot read fuzz.env: ")
        .unwrap_or_else(|| panic!("unexpected error shape: {msg:?}"));
    // A line's error may end in a hint (UTF-16's NULs, a `$` dotenvy does not read): fixed
    // texts, never the line's.
    let numbered = HINTS
        .iter()
        .find_map(|hint| reason.strip_suffix(hint))
        .unwrap_or(reason);
    let ok = reason == "unreadable"
        || common::is_numbered(reason, "syntax error at byte ", " of an entry")
        || (common::is_numbered(numbered, "syntax error at line ", "")
            && numbered["syntax error at line ".len()..]
                .parse::<usize>()
                .unwrap()
                <= lines);
    assert!(ok, "unexpected .env error reason: {reason:?}");
}

fn config(text: &str) {
    let path = Path::new("fuzz/config.toml");
    let mut warnings = Vec::new();
    match parse_config_toml_str(text, path, &mut warnings) {
        Err(e) => {
            assert_eq!(e.code(), "E1006");
            assert!(warnings.is_empty());
            let msg = e.to_string();
            let reason = msg
                .strip_prefix("cannot read ~/.abx/config.toml (fuzz/config.toml): ")
                .unwrap_or_else(|| panic!("unexpected error shape: {msg:?}"));
            // The parser's message after the place: what is wrong, never what the line
            // held (a name it quotes is `…`; its own tokens are a character or two).
            let (place, said) = reason.split_once(": ").unwrap_or((reason, ""));
            assert!(
                place == "invalid TOML" || common::is_numbered(place, "invalid TOML at line ", ""),
                "unexpected config.toml error reason: {reason:?}"
            );
            // The parser's words, its "expected" lists of one- or two-character tokens,
            // or its first words and `…` for a name: nothing quoted from the file.
            let token = |i: &str| {
                let inner = i.strip_prefix('`').and_then(|i| i.strip_suffix('`'));
                inner.is_some_and(|t| (1..=2).contains(&t.chars().count()))
            };
            let line_ok = |line: &str| {
                !line.contains('`')
                    || line.strip_prefix("expected ").is_some_and(|list| {
                        list.split(", ").all(|i| !i.contains('`') || token(i))
                    })
            };
            let (kept, cut) = match said.strip_suffix("`…`") {
                Some(kept) => (kept, true),
                None => (said, false),
            };
            let lines: Vec<&str> = kept.split("; ").collect();
            let (last, before) = lines.split_last().unwrap_or((&"", &[]));
            let quoted_ok =
                before.iter().all(|l| line_ok(l)) && if cut { !last.contains('`') } else { line_ok(last) };
            assert!(
                quoted_ok && common::key_like_runs(said.as_bytes(), 16).is_empty(),
                "config.toml error quotes the file: {reason:?}"
            );
        }
        Ok(map) => {
            for spec in KEYS.iter().filter(|k| k.secret) {
                assert!(
                    !map.contains_key(spec.name),
                    "secret {} taken from config.toml",
                    spec.name
                );
            }
            for key in map.keys() {
                assert!(
                    key.contains('.') || KEYS.iter().any(|s| s.name == key),
                    "unknown key {key:?} taken from config.toml"
                );
            }
            // Warnings name keys (which come from the input) but never repeat a value.
            let table: toml::Table = text.parse().expect("the reader accepted it");
            let mut keys = Vec::new();
            let mut values = Vec::new();
            walk(&toml::Value::Table(table), &mut keys, &mut values);
            for value in &values {
                for run in common::key_like_runs(value.as_bytes(), 17) {
                    if keys.iter().any(|k| common::contains(k.as_bytes(), run)) {
                        continue;
                    }
                    for w in &warnings {
                        assert!(
                            !common::contains(w.as_bytes(), run),
                            "warning repeats a value: {w:?}"
                        );
                    }
                }
            }
        }
    }
}

fn walk(v: &toml::Value, keys: &mut Vec<String>, values: &mut Vec<String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                keys.push(k.clone());
                walk(v, keys, values);
            }
        }
        toml::Value::Array(a) => a.iter().for_each(|v| walk(v, keys, values)),
        toml::Value::String(s) => values.push(s.clone()),
        other => values.push(other.to_string()),
    }
}
