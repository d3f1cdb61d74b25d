//! A bound on what a `.env` file's `${NAME}` references may expand to, known before dotenvy
//! expands them.
//!
//! dotenvy expands each value as it parses it, without a limit: forty short lines, each
//! doubling the one before (`V1=${V0}${V0}`), ask for 2^40 bytes and the process aborts —
//! at start, or on the SIGHUP that re-reads a `./.env` a cloned project brought along. The
//! file's size is capped where it is read; this caps what its references add. Each `$`
//! adds at most one value, that of the name after it (an environment variable's, else an
//! earlier entry's), so the next entry parsed is at most the file's length plus, for each
//! name, the `$`s naming it times the longest value it has stood for so far. Checked
//! before each entry, that keeps every expansion under [`LIMIT`] whatever the file's lines
//! are made of: the bound needs no parse of its own of which entry a `$` belongs to.

use std::collections::{HashMap, HashSet};

/// Far beyond what a real `.env` (a few short references) expands to, and an allocation a
/// sidecar survives.
pub const LIMIT: usize = 16 << 20;

/// What one file's references may still expand to; see the module doc.
pub struct Expansion<'t> {
    /// The most the next entry can expand to.
    bound: usize,
    /// For each name a `$` may stand for: how many `$`s do, and the longest value it has
    /// stood for so far.
    named: HashMap<&'t str, Named>,
}

struct Named {
    dollars: usize,
    longest: usize,
}

impl<'t> Expansion<'t> {
    pub fn of(text: &'t str) -> Self {
        // Read once: a look-up per name scans the whole environment (getenv), and 40 000
        // variables made that seconds for a file of many names.
        let mut environment: HashMap<String, usize> = HashMap::new();
        for (name, value) in std::env::vars_os() {
            let Ok(name) = name.into_string() else {
                continue;
            };
            // A name set twice: glibc's getenv gives the first, another libc may not.
            let longest = environment.entry(name).or_default();
            *longest = (*longest).max(value.len());
        }
        let lengths = environment.keys().map(String::len).collect();
        let mut named = names(text, &lengths);
        let mut bound = text.len();
        for (name, n) in &mut named {
            // dotenvy looks a name up in the environment first.
            n.longest = environment.get(*name).copied().unwrap_or(0);
            bound = bound.saturating_add(n.dollars.saturating_mul(n.longest));
        }
        Expansion { bound, named }
    }

    /// An entry parsed: later references to `name` may stand for `value`.
    pub fn parsed(&mut self, name: &str, value: &str) {
        if let Some(n) = self.named.get_mut(name) {
            if value.len() > n.longest {
                let more = n.dollars.saturating_mul(value.len() - n.longest);
                self.bound = self.bound.saturating_add(more);
                n.longest = value.len();
            }
        }
    }

    /// Why the file is refused, once the next entry could pass [`LIMIT`]. No name and no
    /// length: a value's length may be a key's.
    pub fn refusal(&self) -> Option<String> {
        (self.bound > LIMIT).then(|| {
            format!(
                "its `$` references could expand past {} MiB (lines that repeat earlier \
                 values many times over)",
                LIMIT >> 20
            )
        })
    }
}

/// The characters dotenvy allows in a key: a name with any other can only be an
/// environment variable's.
fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

/// The name after each `$` as dotenvy reads it: `${` up to the next `}`, else the letters
/// and digits that follow, with the `$`s naming each. Quotes and escapes are not looked
/// at: a `$` dotenvy leaves alone only adds to a count. A `${…}` holding more than key
/// characters can only name an environment variable: it is counted only when it is as
/// long as one of theirs (else it names nothing). Read to its `}` whatever the length,
/// `${` repeated over a 1 MiB file took minutes, and seconds still when every one as long
/// as the longest variable name was.
fn names<'t>(text: &'t str, variable_lengths: &HashSet<usize>) -> HashMap<&'t str, Named> {
    let mut out: HashMap<&str, Named> = HashMap::new();
    // The first `}` not behind the scan, kept while it is ahead: looked for afresh from
    // each unclosed `${`, as far as a long variable name reaches, each `${` cost that far.
    let mut close = text.find('}');
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let name = match rest.strip_prefix('{') {
            Some(block) => {
                let key = block.find(|c| !is_key_char(c)).unwrap_or(block.len());
                if block[key..].starts_with('}') {
                    Some(&block[..key])
                } else {
                    let start = text.len() - block.len();
                    while let Some(c) = close.filter(|&c| c < start) {
                        close = text[c + 1..].find('}').map(|i| c + 1 + i);
                    }
                    // `}` is one byte: where it is found is a character boundary.
                    close
                        .filter(|&c| variable_lengths.contains(&(c - start)))
                        .map(|c| &text[start..c])
                }
            }
            None => {
                let end = rest
                    .find(|c: char| !c.is_alphanumeric())
                    .unwrap_or(rest.len());
                Some(&rest[..end])
            }
        };
        if let Some(name) = name {
            out.entry(name)
                .or_insert(Named {
                    dollars: 0,
                    longest: 0,
                })
                .dollars += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(text: &str, variable_length: usize) -> Vec<(&str, usize)> {
        let mut got: Vec<_> = names(text, &HashSet::from([variable_length]))
            .into_iter()
            .map(|(name, n)| (name, n.dollars))
            .collect();
        got.sort_unstable();
        got
    }

    #[test]
    fn names_are_read_as_dotenvy_reads_them() {
        let text = "A=${B_1}x$C2_d ${B_1}\nE='$F'\\$G$ ${a:-b} ${unclosed";
        assert_eq!(
            counted(text, 4),
            [
                ("", 1),
                ("B_1", 2),
                ("C2", 1),
                ("F", 1),
                ("G", 1),
                ("a:-b", 1)
            ]
        );
        // A name with more than key characters is one only as long as a variable's.
        assert_eq!(counted("${a:-b}", 3), []);
        assert_eq!(counted("${a:-b}", 5), []);
        assert_eq!(counted("${a:-b}", 4), [("a:-b", 1)]);
    }

    #[test]
    fn each_name_counts_its_own_dollars_times_its_longest_value() {
        let text = "V0=xxxx\nV1=${V0}${V0}\nV2=${V1}${V1}\nOTHER=yyyy\n";
        let mut e = Expansion::of(text);
        assert_eq!(e.bound, text.len());
        e.parsed("V0", "xxxx");
        assert_eq!(e.bound, text.len() + 2 * 4);
        // A value no `$` names does not count.
        e.parsed("OTHER", &"y".repeat(1 << 20));
        assert_eq!(e.bound, text.len() + 2 * 4);
        e.parsed("V1", "x");
        assert_eq!(e.bound, text.len() + 2 * 4 + 2);
        assert!(e.refusal().is_none());
        e.parsed("V1", &"x".repeat(LIMIT / 2));
        assert!(e.refusal().is_some());
    }

    /// `${` over and over, unclosed or closed only at the end: read to its `}`, each was a
    /// name of its own, 256 GiB of names in all for 1 MiB (minutes of hashing). Only those
    /// the environment's names could be are kept.
    #[test]
    fn a_file_of_open_blocks_names_little() {
        for end in ["", "}"] {
            let text = format!("A={}{end}", "${".repeat(512 * 1024));
            let named = names(&text, &(1..=16).collect());
            assert!(named.len() <= 9, "{}", named.len());
        }
    }
}
