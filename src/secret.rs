//! `Secret`: the one type that holds a credential (API key, AccessKey secret, temporary key,
//! envd token).
//!
//! `Debug` and `Display` never show the value, so a secret cannot reach a log line, an error
//! or a panic message by accident. The raw value is handed out only by [`Secret::expose`]:
//! to write a header or compute a signature (where it leaves the process), and to compare
//! it, test it for emptiness or mask it — grep for it to audit every place a secret leaves
//! this type. (`Borrow<str>` lends it too, only for a map keyed by secrets to be looked up
//! by a `&str`: no code calls `borrow()` on one.)

use std::fmt;
use std::sync::Arc;

/// A credential value. Cheap to clone (shared), never printed. Hashed as its text, so a map
/// keyed by secrets is looked up by a `&str`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(Arc<str>);

impl std::borrow::Borrow<str> for Secret {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl Secret {
    pub fn new(value: impl Into<Arc<str>>) -> Self {
        Secret(value.into())
    }

    /// The raw value: for a header or a signature, or to compare, test or mask it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The form `config list` shows: `****` plus the last 4 characters when the value has
    /// at least 16, else `****` alone (short values would give too much away).
    pub fn masked(&self) -> String {
        mask(&self.0)
    }
}

/// Masks any value by the rule of [`Secret::masked`].
pub fn mask(value: &str) -> String {
    let chars: Vec<char> = value.chars().collect();
    if chars.len() >= 16 {
        let tail: String = chars[chars.len() - 4..].iter().collect();
        format!("****{tail}")
    } else {
        "****".to_string()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(****)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("****")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_hide_the_value() {
        let s = Secret::new("sk-0123456789abcdef0123456789abcd");
        assert_eq!(format!("{s:?}"), "Secret(****)");
        assert_eq!(format!("{s}"), "****");
        assert!(!format!("{:?}", Some(&s)).contains("0123"));
    }

    #[test]
    fn masking_rule() {
        assert_eq!(mask("0123456789abcdef0123456789abWXYZ"), "****WXYZ");
        assert_eq!(mask("0123456789abcdef"), "****cdef");
        assert_eq!(mask("0123456789abcde"), "****");
        assert_eq!(mask(""), "****");
    }
}
