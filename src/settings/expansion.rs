//! A bound on what a `.env` file's `${NAME}` references may expand to, known before dotenvy
//! expands them.
//!
//! dotenvy expands each value as it parses it, without a limit: forty short lines, each
//! doubling the one before (`V1=${V0}${V0}`), ask for 2^40 bytes and the process aborts —
//! at start, or on the SIGHUP that re-reads a `./.env` a cloned project brought along. The
//! file's size is capped where it is read; this caps what its references add. Each `$` in
//! an entry adds at most one value, an environment variable's or an earlier entry's, so
//! the next entry parsed is at most the file's length plus its `$`s times the longest
//! value one of its names stands for so far. Checked before each entry, that keeps every
//! expansion under [`LIMIT`], whatever the file's lines are made of (the bound needs no
//! parse of its own of which entry a `$` belongs to).

use std::collections::HashSet;

/// Far beyond what a real `.env` (a few short references) expands to, and an allocation a
/// sidecar survives.
pub const LIMIT: usize = 16 << 20;

/// What one file's references may still expand to; see the module doc.
pub struct Expansion<'t> {
    len: usize,
    dollars: usize,
    /// Every name a `$` in the file may stand for (more, never fewer, than dotenvy reads).
    named: HashSet<&'t str>,
    /// The longest value one of `named` stands for so far.
    widest: usize,
}

impl<'t> Expansion<'t> {
    pub fn of(text: &'t str) -> Self {
        let named = names(text);
        // dotenvy looks a name up in the environment first.
        let widest = named
            .iter()
            .filter_map(std::env::var_os)
            .map(|value| value.len())
            .max()
            .unwrap_or(0);
        Expansion {
            len: text.len(),
            dollars: text.bytes().filter(|&b| b == b'$').count(),
            named,
            widest,
        }
    }

    /// The most the next entry can expand to.
    pub fn next_at_most(&self) -> usize {
        self.len
            .saturating_add(self.dollars.saturating_mul(self.widest))
    }

    /// An entry parsed: later references to `name` may stand for `value`.
    pub fn parsed(&mut self, name: &str, value: &str) {
        if self.named.contains(name) {
            self.widest = self.widest.max(value.len());
        }
    }

    /// Why the file is refused, once the next entry could pass [`LIMIT`].
    pub fn refusal(&self) -> Option<String> {
        (self.next_at_most() > LIMIT).then(|| {
            format!(
                "its `$` references could expand past {} MiB ({} of them, naming values of up \
                 to {} bytes)",
                LIMIT >> 20,
                self.dollars,
                self.widest
            )
        })
    }
}

/// The names after each `$` as dotenvy reads them: `${` up to the next `}`, else the
/// letters and digits that follow. Quotes and escapes are not looked at: a `$` dotenvy
/// leaves alone only adds a name.
fn names(text: &str) -> HashSet<&str> {
    let mut out = HashSet::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let name = match rest.strip_prefix('{') {
            Some(block) => block.find('}').map_or(block, |end| &block[..end]),
            None => {
                let end = rest
                    .find(|c: char| !c.is_alphanumeric())
                    .unwrap_or(rest.len());
                &rest[..end]
            }
        };
        out.insert(name);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_as_dotenvy_reads_them() {
        let text = "A=${B_1}x$C2_d ${unclosed\nE='$F'\\$G$";
        let mut got: Vec<_> = names(text).into_iter().collect();
        got.sort_unstable();
        assert_eq!(got, ["", "B_1", "C2", "F", "G", "unclosed\nE='$F'\\$G$"]);
    }

    #[test]
    fn each_entry_is_bounded_by_the_longest_value_named() {
        let text = "V0=xxxx\nV1=${V0}${V0}\nV2=${V1}${V1}\nOTHER=yyyyyyyyyyyyyyyy\n";
        let mut e = Expansion::of(text);
        assert_eq!(e.next_at_most(), text.len());
        e.parsed("V0", "xxxx");
        assert_eq!(e.next_at_most(), text.len() + 4 * 4);
        // A value no `$` names does not count.
        e.parsed("OTHER", &"y".repeat(1 << 20));
        assert_eq!(e.next_at_most(), text.len() + 4 * 4);
        assert!(e.refusal().is_none());
        e.parsed("V1", &"x".repeat(LIMIT / 4));
        assert!(e.refusal().is_some());
    }
}
