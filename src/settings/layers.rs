//! Reading the layers of the chain: the process environment, `./.env`, `~/.abx/.env` and
//! `~/.abx/config.toml`. Each layer becomes a plain map; resolution happens in `mod.rs`.
//! Nothing here writes to the process environment.
//!
//! The file readers hand the text to [`parse_dotenv_str`] and [`parse_config_toml_str`],
//! which do the parsing and touch no file system (the fuzz targets call them directly).

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::expansion::Expansion;
use super::keys::KEYS;
use crate::error::Error;

/// Where a value came from, with the literal names `config list` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    Flag,
    Env,
    DotEnvCwd,
    DotEnvHome,
    ConfigToml,
    Default,
    Unset,
}

impl Source {
    pub fn label(self) -> &'static str {
        match self {
            Source::Flag => "flag",
            Source::Env => "env",
            Source::DotEnvCwd => "./.env",
            Source::DotEnvHome => "~/.abx/.env",
            Source::ConfigToml => "~/.abx/config.toml",
            Source::Default => "default",
            Source::Unset => "unset",
        }
    }
}

/// Whether `a` and `b` name one file (device and inode, links followed); false when
/// either is missing.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    id(a).is_some_and(|a| Some(a) == id(b))
}

/// A `.env` file's variables, in file order (later duplicates win, as in a shell).
/// `skipped`: the file is read by other tools too (`./.env`), and lines it cannot parse
/// that set none of abx-proxy's own variables go there rather than failing the file (see
/// [`collect_dotenv`]); without it, as for `~/.abx/.env`, every such line fails.
pub fn read_dotenv(
    path: &Path,
    label: &str,
    skipped: Option<&mut Vec<SkippedLine>>,
    warnings: &mut Vec<String>,
) -> Result<HashMap<String, String>, Error> {
    let shown = labelled(label, path);
    let absent = match std::fs::metadata(path) {
        Ok(meta) => !meta.is_file(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        // A file that may be there but cannot be looked at (a directory on its way that
        // this user may not enter, a link into one) fails as an unreadable file does, and
        // as `config.toml` does; it was skipped as absent, and the key it held came from
        // elsewhere or nowhere without a word. A link that leads to no file otherwise (a
        // loop) is a dangling one.
        Err(e)
            if e.kind() != std::io::ErrorKind::PermissionDenied
                && path.symlink_metadata().is_ok_and(|m| m.is_symlink()) =>
        {
            true
        }
        Err(e) => {
            return Err(Error::ReadFile {
                path: shown,
                reason: e.to_string(),
            })
        }
    };
    if absent {
        // Something is there, but not a file to read: a link to a file that is gone (a
        // Secret volume's link after a bad mount), or a directory. Skipped as absent, but
        // said, or the key it was meant to hold comes from elsewhere without a word.
        if path.symlink_metadata().is_ok() {
            warnings.push(format!(
                "{label} ({}) is not a readable file ({}); skipped",
                path.display(),
                crate::watched::kind_of(path)
            ));
        }
        return Ok(HashMap::new());
    }
    warn_if_shared(path, label, warnings);
    let unread = |e: std::io::Error| Error::ReadFile {
        path: shown.clone(),
        reason: e.to_string(),
    };
    // Read once: the parser, the line numbers of its errors and the warnings share it.
    let bytes = crate::watched::read_regular(path).map_err(unread)?;
    let shown_once: Arc<str> = Arc::from(shown.as_str());
    let (bytes, mut not_utf8) = match skipped {
        Some(_) => foreign_not_utf8(bytes, &shown_once)
            .map_err(|line| line_error(&shown, line, Cause::NotUtf8))?,
        None => (bytes, Vec::new()),
    };
    let text = crate::watched::utf8(bytes).map_err(unread)?;
    let text = lines_ended(text);
    let vars = match skipped {
        Some(skipped) => {
            let vars = collect_dotenv(&text, &shown, Some(&mut *skipped))?;
            // In file order, the lines skipped for their bytes among those for their syntax.
            skipped.append(&mut not_utf8);
            skipped.sort_by_key(|s| s.line);
            vars
        }
        None => collect_dotenv(&text, &shown, None)?,
    };
    warnings.extend(substitution_warnings(&text, &shown, &vars));
    Ok(vars)
}

/// A shared `./.env`'s lines that are not UTF-8 (a Latin-1 `GREETING=café` another tool
/// reads) and set nothing abx-proxy always reads: each blanked, its number kept, and set
/// aside as a skipped line, as one dotenvy cannot parse is; such a comment is blanked.
/// `Err(line)`: the first such line that may be ours (it names one of ours, or nothing
/// readable), or that opens or lies inside a quoted value running over lines (blanked,
/// it would end or move another value, or let a quoted line be read as a setting): the
/// file fails naming it. A file in UTF-16 is left whole: [`watched::utf8`] says so.
///
/// [`watched::utf8`]: crate::watched::utf8
fn foreign_not_utf8(
    bytes: Vec<u8>,
    shown: &Arc<str>,
) -> Result<(Vec<u8>, Vec<SkippedLine>), usize> {
    if crate::watched::is_utf16(&bytes) || std::str::from_utf8(&bytes).is_ok() {
        return Ok((bytes, Vec::new()));
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut skipped = Vec::new();
    // Where dotenvy's line joiner is: a quoted value may run over lines.
    let mut joiner = Joiner::Complete;
    // Numbered as `lines_ended` will number them: `\r\n`, `\r` and `\n` each end one.
    let mut number = 1;
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        let end = rest.iter().position(|b| *b == b'\n' || *b == b'\r');
        let (line, ending) = match end {
            Some(i) => {
                let len = if rest[i..].starts_with(b"\r\n") { 2 } else { 1 };
                (&rest[..i], &rest[i..i + len])
            }
            None => (rest, &rest[rest.len()..]),
        };
        let text = String::from_utf8_lossy(line);
        let inside = joiner != Joiner::Complete;
        joiner = joiner_after(&text, joiner);
        match std::str::from_utf8(line) {
            Ok(_) => out.extend_from_slice(line),
            Err(_) if inside || joiner != Joiner::Complete => return Err(number),
            // A comment sets nothing: blanked without a word.
            Err(_) if text.trim_start().starts_with('#') => {}
            Err(_) => {
                let name = line_name(&text).filter(|n| !n.contains('\u{fffd}'));
                let ours = OURS.iter().any(|n| text.contains(n));
                match name {
                    Some(name) if !ours && !is_ours(name) => skipped.push(SkippedLine {
                        shown: shown.clone(),
                        line: number,
                        names: name.into(),
                        cause: Cause::NotUtf8,
                    }),
                    _ => return Err(number),
                }
            }
        }
        out.extend_from_slice(ending);
        rest = &rest[line.len() + ending.len()..];
        number += 1;
    }
    Ok((out, skipped))
}

/// Where dotenvy's line joiner is at the end of a physical line: a logical line goes on
/// (into the next physical one) in any state but `Complete`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Joiner {
    Complete,
    Escape,
    Strong,
    StrongEscape,
    Weak,
    WeakEscape,
    WhiteSpace,
}

/// dotenvy 0.15.7's `eval_end_state`, state for state, over one physical line and its
/// end (`\n`), from `state`: quotes anywhere, a backslash escaping in and out of them, a
/// `#` after one blank (not two) ending the line. A logical line that begins with `#`
/// (after blanks) is a comment, skipped whole, as its iterator skips it. Change it with a
/// dotenvy upgrade.
fn joiner_after(line: &str, state: Joiner) -> Joiner {
    use Joiner::*;
    if state == Complete && line.trim_start().starts_with('#') {
        return Complete;
    }
    let mut state = state;
    for c in line.chars().chain(['\n']) {
        state = match state {
            WhiteSpace => match c {
                '#' => return Complete,
                '\\' => Escape,
                '"' => Weak,
                '\'' => Strong,
                _ => Complete,
            },
            Escape => Complete,
            Complete => match c {
                c if c.is_whitespace() && c != '\n' && c != '\r' => WhiteSpace,
                '\\' => Escape,
                '"' => Weak,
                '\'' => Strong,
                _ => Complete,
            },
            Weak => match c {
                '\\' => WeakEscape,
                '"' => Complete,
                _ => Weak,
            },
            WeakEscape => Weak,
            Strong => match c {
                '\\' => StrongEscape,
                '\'' => Complete,
                _ => Strong,
            },
            StrongEscape => Strong,
        };
    }
    state
}

/// [`read_dotenv`] on text already in memory: the same variables and the same errors, with
/// `label` standing where the file reader names the file. No permission warning (there is
/// no file to check). A `shared` file's skipped lines are warned about as they are with the
/// built-in provider selected: this reader knows no plugin's variables.
pub fn parse_dotenv_str(
    text: &str,
    label: &str,
    shared: Option<&mut Vec<String>>,
) -> Result<HashMap<String, String>, Error> {
    let text = &lines_ended(text.to_string());
    let mut skipped = Vec::new();
    let vars = collect_dotenv(text, label, shared.is_some().then_some(&mut skipped))?;
    if let Some(warnings) = shared {
        warnings.extend(SkippedLine::warnings(&skipped));
        warnings.extend(substitution_warnings(text, label, &vars));
    }
    Ok(vars)
}

/// dotenvy expands `${NAME}` and a bare `$NAME`, but a bare name ends at the first
/// character that is not a letter or digit (`$MY_TTL` reads `$MY`, then `_TTL`), and
/// `${NAME:-default}` looks up a variable called `NAME:-default`: both quietly give nothing,
/// or part of what was meant (a key holding `$` is cut short; a value that is only such a
/// default is blank, so the setting falls through to a lower layer). python-dotenv and
/// docker compose read both forms as meant. And a `${NAME}` that names a variable set
/// neither in the environment nor earlier in the file expands to nothing, as in a shell,
/// where docker compose says so (a key kept in a variable exported in another shell, or
/// not passed to a service). A line that sets one of abx-proxy's variables with any of
/// these gets a warning naming the file, the line and the variables, never the value.
/// `parsed`: what dotenvy read from the file (a line it skipped, or one inside a quoted
/// value, sets nothing).
fn substitution_warnings(text: &str, shown: &str, parsed: &HashMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    // dotenvy looks a `${NAME}` up in the environment, then among the lines above it.
    let mut above: std::collections::HashSet<&str> = std::collections::HashSet::new();
    // Read once, as `env::var` would find them: a look-up per reference scans the whole
    // environment (getenv), seconds for a file of many references beside 40 000 variables.
    let environment: std::collections::HashSet<String> = std::env::vars_os()
        .filter(|(_, value)| value.to_str().is_some())
        .filter_map(|(name, _)| name.into_string().ok())
        .collect();
    for (i, line) in text.lines().enumerate() {
        let (Some(name), Some((_, value))) = (line_name(line), line.split_once('=')) else {
            continue;
        };
        let defined = |var: &str| {
            (above.contains(&var) && parsed.contains_key(var)) || environment.contains(var)
        };
        let dollar = risky_dollar(value, &defined);
        above.insert(name);
        // Only a name dotenvy takes, which also passes over comments (the text before a `=`
        // on a line inside a multi-line quoted value may be anything, a secret's piece
        // included).
        let key_like = name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !(key_like && is_ours(name)) {
            continue;
        }
        let what = match dollar {
            Some(Dollar::Operator) => {
                "a `${…}` holds more than a variable name (a default such as `${VAR:-x}` is not \
                 supported) and expands to nothing"
                    .to_string()
            }
            Some(Dollar::Bare) => {
                "a bare `$` is expanded, its name ending at the first character that is not a \
                 letter or digit (`$MY_VAR` reads `$MY`): write `${VAR}`, or single quotes \
                 around a value that holds a literal `$`"
                    .to_string()
            }
            // Named only as a variable is conventionally named: what a template's braces
            // hold may be the key pasted into them.
            Some(Dollar::Unset(var)) if is_conventional_name(&var) => format!(
                "${{{var}}} is set neither in the environment nor above it in this file, and \
                 expands to nothing"
            ),
            Some(Dollar::Unset(_)) => "a `${…}` names a variable set neither in the \
                                       environment nor above it in this file (or holds a \
                                       value pasted between its braces), and expands to \
                                       nothing"
                .to_string(),
            None => continue,
        };
        out.push(format!("{shown}: line {} ({name}): {what}", i + 1));
    }
    out
}

/// `NAME`, `MY_KEY_2`: upper-case letters, digits and underscores, not too long to be one.
fn is_conventional_name(name: &str) -> bool {
    name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

enum Dollar {
    /// `${NAME:-default}` and the like.
    Operator,
    /// `$NAME`.
    Bare,
    /// `${NAME}`, `NAME` set nowhere dotenvy looks.
    Unset(String),
}

/// The first substitution in a value that dotenvy reads otherwise than a shell would: as
/// dotenvy does, none inside single quotes or after a backslash, and none past the
/// whitespace that ends an unquoted value (a comment may follow). `defined`: whether a
/// variable has a value to expand to.
fn risky_dollar(value: &str, defined: &dyn Fn(&str) -> bool) -> Option<Dollar> {
    let mut quoting = Quoting::default();
    let value = value.trim_start_matches([' ', '\t']);
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        if !quoting.live(c) {
            continue;
        }
        match c {
            ' ' | '\t' if !quoting.double => return None,
            '$' => match chars.peek() {
                Some('{') => {
                    chars.next();
                    let inner: String = chars.by_ref().take_while(|c| *c != '}').collect();
                    if !inner.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        return Some(Dollar::Operator);
                    }
                    if !inner.is_empty() && !defined(&inner) {
                        return Some(Dollar::Unset(inner));
                    }
                }
                Some(c) if c.is_alphanumeric() => return Some(Dollar::Bare),
                _ => {}
            },
            _ => {}
        }
    }
    None
}

const BOM: char = '\u{feff}';

/// `text` with a carriage return that ends no `\r\n` read as a line's end: an old Mac
/// editor's line ends, or a file pasted through one. dotenvy reads such a file as one line,
/// so the first variable took every other line's text as its value (the key's line
/// included, printed back by `config list` in a setting that is not secret). Node's and
/// Ruby's dotenv read them as line ends too. A file with no lone `\r` is left as it is,
/// so a value's `\r\n` inside quotes stays.
fn lines_ended(text: String) -> String {
    let lone = text
        .char_indices()
        .any(|(i, c)| c == '\r' && !text[i + 1..].starts_with('\n'));
    if !lone {
        return text;
    }
    text.replace("\r\n", "\n").replace('\r', "\n")
}

/// How many skipped lines of a `./.env` get a warning each.
const SKIPPED_SAID: usize = 10;

/// A line of a shared `./.env` that dotenvy cannot parse and that sets none of the
/// variables abx-proxy always reads. Whether it is skipped waits until the provider is
/// known: a selected plugin's vendor aliases (`OPEN_SANDBOX_API_KEY`) are abx-proxy's too,
/// and a broken line setting one is the user's real problem, not another tool's line.
///
/// No `Debug`: `names` is the text before a `=` on each line of the entry, and a line
/// inside an unterminated quote may be part of a value.
///
/// Small, one allocation of its own: a `./.env` of another tool's may have 170 000 such
/// lines, each kept until the provider is known (a copy of the file's path in each held
/// 58 MB, more with a long path).
pub struct SkippedLine {
    /// The file, shared by its lines.
    shown: Arc<str>,
    line: usize,
    /// One name a line, `\n` between them.
    names: Box<str>,
    /// Why dotenvy failed it, for the error it gets as a line of ours (never its text).
    cause: Cause,
}

impl SkippedLine {
    /// Whether the line sets (or, as a bare `export`, names) one of `env`.
    pub fn sets_any(&self, env: &[String]) -> bool {
        self.names.split('\n').any(|n| env.iter().any(|e| e == n))
    }

    /// Names the file and the line, never the text.
    pub fn warning(&self) -> String {
        let why = match self.cause {
            Cause::NotUtf8 => "not UTF-8 text",
            _ => "not dotenv syntax",
        };
        format!(
            "{}: line {} skipped: {why}, and it sets no setting abx-proxy reads",
            self.shown, self.line
        )
    }

    /// A warning for each of the first ten (`SKIPPED_SAID`) lines, then one for the rest: a
    /// `./.env` of another tool's 170 000 lines printed as many warnings (100 MB) at every
    /// command and reload.
    pub fn warnings(skipped: &[SkippedLine]) -> Vec<String> {
        let (said, rest) = skipped.split_at(skipped.len().min(SKIPPED_SAID));
        let mut lines: Vec<String> = said.iter().map(SkippedLine::warning).collect();
        if let Some(last) = rest.last() {
            let more = match rest.len() {
                1 => "1 more line".to_string(),
                n => format!("{n} more lines"),
            };
            lines.push(format!(
                "{}: {more} skipped likewise, up to line {}",
                last.shown, last.line
            ));
        }
        lines
    }

    /// The error a broken line of abx-proxy's own gets: a selected plugin's alias line
    /// says what any other line of ours would.
    pub fn into_error(self) -> Error {
        line_error(&self.shown, self.line, self.cause)
    }
}

/// `text` gives the whole input again, only to turn a syntax error into a line number.
///
/// A `./.env` is often a project's, read by other tools too, and python-dotenv (what E2B's
/// Python users load it with) accepts lines dotenvy does not (`GREETING=hello world`,
/// a bare `export NAME`, `NAME-WITH-DASH=1`). In such a `shared` file a line is set aside
/// in `skipped` when it sets nothing abx-proxy always reads (the caller decides, once the
/// provider is known, whether it is skipped with a warning); one that may, or whose line is
/// unknown, fails the file as before, so a broken key line never falls through silently to
/// a lower level. `~/.abx/.env` is abx-proxy's own: strict.
fn collect_dotenv(
    text: &str,
    shown: &str,
    mut skipped: Option<&mut Vec<SkippedLine>>,
) -> Result<HashMap<String, String>, Error> {
    let mut out = HashMap::new();
    let shown_once: Arc<str> = Arc::from(shown);
    // An editor's byte-order mark: dotenvy strips it only when it loads a file into the
    // environment, not in the iterator read here, where it made line 1 a syntax error.
    let body = text.strip_prefix(BOM).unwrap_or(text);
    let mut iter = dotenvy::from_read_iter(body.as_bytes());
    // dotenvy expands without a limit: each entry's bound is checked before it is parsed.
    let mut expansion = Expansion::of(body);
    // Where the last failing entry was found: dotenvy reports them in file order, so the
    // next one lies past it, and the search for it starts there.
    let mut failed_at = Line::NONE;
    loop {
        if let Some(reason) = expansion.refusal() {
            return Err(Error::ReadFile {
                path: shown.to_string(),
                reason,
            });
        }
        let Some(item) = iter.next() else { break };
        match item {
            Ok((k, v)) => {
                expansion.parsed(&k, &v);
                out.insert(k, v);
            }
            Err(e) => match (skippable_line(&e, text, failed_at), skipped.as_deref_mut()) {
                (Some((line, names)), Some(skipped)) => {
                    failed_at = line;
                    skipped.push(SkippedLine {
                        shown: shown_once.clone(),
                        line: line.number,
                        names,
                        cause: Cause::of(&text[line.start..]),
                    })
                }
                // The dotenvy error names the line and byte offset only, never the value.
                _ => return Err(read_error(shown, &e, text, failed_at)),
            },
        }
    }
    Ok(out)
}

/// The line of a syntax error that concerns no setting abx-proxy always reads, with the
/// names its entry sets. The failing entry may run over several lines (an unterminated
/// quote runs to the end of the file): it counts as ours if any of it names one of ours,
/// and each of its lines that reads as `NAME=…` gives a name.
fn skippable_line(e: &dotenvy::Error, text: &str, after: Line) -> Option<(Line, Box<str>)> {
    let dotenvy::Error::LineParse(entry, _) = e else {
        return None;
    };
    // A line in UTF-16 (`A\0B\0X\0_`) hides its name from the comparison: judged without
    // its NULs, or a key appended so was skipped as another tool's line.
    let plain = entry.replace('\0', "");
    if OURS.iter().any(|name| plain.contains(name)) {
        return None;
    }
    let line = entry_line(text, entry, after)?;
    // A first line without `=` is skipped only as a bare `export NAME`: anything else may
    // be a key pasted without its name.
    let name = line_name(text[line.start..].lines().next()?)?;
    let ours = is_ours(name);
    // Without NULs too: a selected plugin's alias set in UTF-16 is still its alias.
    let names = std::iter::once(name)
        .chain(entry.split('\n').skip(1).filter_map(line_name))
        .map(|n| n.replace('\0', ""))
        .collect::<Vec<_>>()
        .join("\n")
        .into();
    (!ours).then_some((line, names))
}

/// The variable a `.env` line sets, or the one a bare `export NAME` names.
fn line_name(line: &str) -> Option<&str> {
    let line = line.trim_start_matches('\u{feff}').trim_start();
    match line.split_once('=') {
        Some((name, _)) => Some(name.trim_start_matches("export ").trim()),
        None => Some(line.strip_prefix("export ")?.trim()),
    }
}

/// Names, or the starts of names, of the variables abx-proxy reads whatever the provider
/// (plugin providers' canonical names are `ABX_<ID>_…`; a selected plugin's aliases are
/// known only later, see [`SkippedLine`]).
const OURS: [&str; 4] = ["ABX_", "ALICLOUD_", "ALIBABA_CLOUD_", "GITHUB_TOKEN"];

/// Whether a `.env` line's variable is one abx-proxy reads whatever the provider.
fn is_ours(name: &str) -> bool {
    OURS.iter().any(|p| name.starts_with(p)) || KEYS.iter().any(|k| k.env == name)
}

fn read_error(shown: &str, e: &dotenvy::Error, text: &str, after: Line) -> Error {
    let reason = match e {
        // dotenvy gives the offending entry's text and an offset into it, no line number.
        // The text may hold a secret, so it is only used to find where the entry starts (an
        // unterminated quote runs to the end of the file: its start is the useful line).
        dotenvy::Error::LineParse(entry, idx) => match entry_line(text, entry, after) {
            Some(line) => {
                return line_error(shown, line.number, Cause::of(&text[line.start..]));
            }
            None => format!("syntax error at byte {idx} of an entry"),
        },
        dotenvy::Error::Io(io) => io.to_string(),
        _ => "unreadable".to_string(),
    };
    Error::ReadFile {
        path: shown.to_string(),
        reason,
    }
}

/// Whether a double-quoted value on `line` ending in `$` or `$NAME` is why dotenvy fails
/// it: dotenvy 0.15 fails such a line (`URL="http://127.0.0.1:$PORT"`, which python-dotenv
/// and compose read), and a bare "syntax error" left the user guessing. The cause only if
/// the line parses once each is braced (`${NAME}`, `\$`): a line failing for another
/// reason (an unquoted space) is not blamed on it.
fn dollar_is_the_cause(line: &str) -> bool {
    let mut quoting = Quoting::default();
    let mut chars = line.chars().peekable();
    let (mut braced, mut any) = (String::with_capacity(line.len() + 8), false);
    while let Some(c) = chars.next() {
        if !(quoting.live(c) && c == '$' && quoting.double) {
            braced.push(c);
            continue;
        }
        let mut name = String::new();
        while let Some(n) = chars.next_if(|c| c.is_ascii_alphanumeric() || *c == '_') {
            name.push(n);
        }
        if chars.peek() != Some(&'"') {
            braced.push('$');
            braced.push_str(&name);
        } else if name.is_empty() {
            any = true;
            braced.push_str("\\$");
        } else {
            any = true;
            braced.push_str(&format!("${{{name}}}"));
        }
    }
    any && dotenvy::from_read_iter(braced.as_bytes()).all(|entry| entry.is_ok())
}

/// Quotes and backslashes as dotenvy reads them, a character at a time.
#[derive(Default)]
struct Quoting {
    single: bool,
    double: bool,
    escaped: bool,
}

impl Quoting {
    /// Takes `c`: whether it is text where dotenvy substitutes (not a quote or a backslash
    /// of the syntax, not escaped, not inside single quotes).
    fn live(&mut self, c: char) -> bool {
        if std::mem::take(&mut self.escaped) {
            return false;
        }
        match c {
            '\'' if !self.double => self.single = !self.single,
            '"' if !self.single => self.double = !self.double,
            '\\' if !self.single => self.escaped = true,
            _ => return !self.single,
        }
        false
    }
}

fn syntax_error(shown: &str, line: usize) -> Error {
    Error::ReadFile {
        path: shown.to_string(),
        reason: format!("syntax error at line {line}"),
    }
}

/// What a failing line says beside its number: a byte, kept per skipped line of another
/// tool's (a `./.env` may have 170 000 of them), not an error built for each.
#[derive(Clone, Copy)]
enum Cause {
    Syntax,
    /// UTF-16 text.
    Nul,
    /// A `$` dotenvy does not read (see [`dollar_is_the_cause`]).
    Dollar,
    /// Bytes that are not UTF-8 (see [`foreign_not_utf8`]).
    NotUtf8,
}

impl Cause {
    /// The cause of a failure on the line `from` begins.
    fn of(from: &str) -> Cause {
        let first = from.lines().next().unwrap_or_default();
        if first.contains('\0') {
            Cause::Nul
        } else if first.contains('$') && dollar_is_the_cause(first) {
            Cause::Dollar
        } else {
            Cause::Syntax
        }
    }
}

fn line_error(shown: &str, line: usize, cause: Cause) -> Error {
    let hint = match cause {
        Cause::Syntax => return syntax_error(shown, line),
        Cause::Nul => "NUL bytes (UTF-16 text? save it as UTF-8)",
        Cause::NotUtf8 => {
            return Error::ReadFile {
                path: shown.to_string(),
                reason: format!("not UTF-8 text (line {line})"),
            }
        }
        Cause::Dollar => {
            "dotenvy reads no `$` (or `$NAME`) just before a closing double quote; write \
             `${NAME}`, or `\\$` for a dollar sign"
        }
    };
    Error::ReadFile {
        path: shown.to_string(),
        reason: format!("syntax error at line {line}: {hint}"),
    }
}

/// The 1-based line where dotenvy's failing `entry` starts. dotenvy gives either whole
/// physical lines (leading blanks included) or, for an error in
/// a value, the value from where it starts after `KEY=`. A search for that text anywhere
/// found it in a comment or another line first and named the wrong line; only these two
/// places on a line that is not a comment can be the entry. The first match past line
/// `after` (the previous failing entry's) is the one: an earlier line that matched would
/// have failed first, unless it did (two lines with the same broken value).
/// Each line looked at once however many entries fail: numbered as it is reached from
/// `after`'s start (counting the newlines before every candidate again, and from the top
/// for each failing entry, took 11 s for 2 048 skipped lines, a reload's whole time with
/// the proxy unanswering).
fn entry_line(text: &str, entry: &str, after: Line) -> Option<Line> {
    if entry.is_empty() {
        return None;
    }
    let (number, from) = match after.number {
        0 => (1, 0),
        n => (n, after.start),
    };
    // Line 1 with and without a byte-order mark (some readers strip it, some do not).
    let bom = text.starts_with('\u{feff}').then_some(3);
    let first = match after.number {
        0 => [Some(0), bom],
        _ => [None, None],
    };
    let later = text[from..]
        .match_indices('\n')
        .enumerate()
        .map(move |(k, (i, _))| (from + i + 1, number + 1 + k));
    first
        .into_iter()
        .flatten()
        .map(|start| (start, 1))
        .chain(later)
        .find(|&(start, _)| entry_starts_at(&text[start..], entry))
        .map(|(start, number)| Line { number, start })
}

/// A line of a `.env` text: its 1-based number and where it starts.
#[derive(Clone, Copy)]
struct Line {
    number: usize,
    start: usize,
}

impl Line {
    /// Before the first line.
    const NONE: Line = Line {
        number: 0,
        start: 0,
    };
}

fn entry_starts_at(rest: &str, entry: &str) -> bool {
    // The line alone: trimmed as the rest of the text, a run of blank lines was read
    // again from each of them (300 000 before a failing line: 25 s).
    let line = rest.split('\n').next().unwrap_or_default();
    if line.trim_start().starts_with('#') {
        return false;
    }
    rest.starts_with(entry)
        || line.find('=').is_some_and(|eq| {
            rest[eq + 1..]
                .trim_start_matches([' ', '\t'])
                .starts_with(entry)
        })
}

/// `.env` files hold secrets and are meant to be mode 600.
fn warn_if_shared(path: &Path, label: &str, warnings: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o044 != 0 {
            warnings.push(format!(
                "{label} ({}) is readable by group or others (mode {mode:04o}); it may hold secrets: chmod 600 it",
                path.display()
            ));
        }
    }
}

/// The non-secret keys of `config.toml` by canonical name, plus `[providers.<id>]` tables
/// keyed `<id>.<field>`. Secrets found there are dropped with a warning.
pub fn read_config_toml(
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<HashMap<String, String>, Error> {
    let text = match crate::watched::read_regular(path).and_then(crate::watched::utf8) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // As for a `.env`: a link whose file is gone (a ConfigMap volume's link after a
            // bad mount) leaves every setting it held at its default, so say so.
            if path.symlink_metadata().is_ok() {
                warnings.push(format!(
                    "{} is not a readable file (a dangling link); skipped",
                    config_label(path)
                ));
            }
            return Ok(HashMap::new());
        }
        Err(e) => {
            return Err(Error::ReadFile {
                path: config_label(path),
                reason: e.to_string(),
            })
        }
    };
    parse_config_toml_str(&text, path, warnings)
}

/// A TOML parser's message without what it quotes of the file. Its own lines are kept
/// when they quote nothing or are an "expected" list of its tokens (`expected `"`, `'``);
/// any other quotes a name, which may be anything a line held (a secret pasted as a key;
/// backticks and newlines in it shift any count of them): that line is cut at the quote,
/// `…` put for the rest, and the message ends there.
fn toml_said(message: &str) -> String {
    const TOKENS: &[&str] = &[
        "\"", "'", ".", "=", "]", "]]", "}", "#", ",", "[", "{", "\\", "b", "f", "n", "r", "t",
        "u", "U", "e", "E", "x", "o", "+", "-", "_", ":", "Z", "T",
    ];
    let item_ok = |item: &str| match item.strip_prefix('`').and_then(|i| i.strip_suffix('`')) {
        Some(token) => TOKENS.contains(&token),
        None => item.bytes().all(|b| b.is_ascii_lowercase() || b == b' '),
    };
    let line_ok = |line: &str| {
        !line.contains('`')
            || line
                .strip_prefix("expected ")
                .is_some_and(|list| list.split(", ").all(item_ok))
    };
    // The lines before the first that quotes a name, and that one's words; none after it
    // (a newline in the name would make its rest a line of its own).
    let mut said = Vec::new();
    for line in message.lines() {
        if line_ok(line) {
            said.push(line.to_string());
        } else {
            let words = line.split('`').next().unwrap_or_default();
            said.push(format!("{words}`…`"));
            break;
        }
    }
    said.join("; ")
}

/// [`read_config_toml`] on text already in memory; `path` only labels errors and warnings.
pub fn parse_config_toml_str(
    text: &str,
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<HashMap<String, String>, Error> {
    let mut out = HashMap::new();
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::ReadFile {
        path: config_label(path),
        // The parser's `Display` quotes the offending line, which could be a secret: its
        // message alone, which says what is wrong ("duplicate key", "invalid string").
        reason: format!(
            "invalid TOML{}: {}",
            e.span()
                .map(|s| format!(" at line {}", line_of(text, s.start)))
                .unwrap_or_default(),
            toml_said(e.message())
        ),
    })?;
    // Top-level keys first, so that a key's own table, read after, wins whatever the
    // names' order (`toml::Table` iterates sorted: `[auth]` came before `token_ttl`).
    let (sections, top): (Vec<_>, Vec<_>) = table.iter().partition(|(_, v)| v.is_table());
    for (name, value) in top.into_iter().chain(sections) {
        match value {
            toml::Value::Table(section) if name == "providers" => {
                for (id, fields) in section {
                    let toml::Value::Table(fields) = fields else {
                        let id = toml_key(id);
                        warnings.push(format!(
                            "{}: [providers] {id} ignored; a provider's fields go in [providers.{id}]",
                            config_label(path)
                        ));
                        continue;
                    };
                    for (field, v) in fields {
                        match scalar(v) {
                            Some(v) => {
                                out.insert(format!("{id}.{field}"), v);
                            }
                            None => warnings.push(not_scalar(
                                path,
                                &format!("[providers.{}] {}", toml_key(id), toml_key(field)),
                            )),
                        }
                    }
                }
            }
            toml::Value::Table(section) => {
                for (key, v) in section {
                    take(path, Some(name), key, v, &mut out, warnings);
                }
            }
            v => take(path, None, name, v, &mut out, warnings),
        }
    }
    Ok(out)
}

fn take(
    path: &Path,
    section: Option<&str>,
    key: &str,
    value: &toml::Value,
    out: &mut HashMap<String, String>,
    warnings: &mut Vec<String>,
) {
    let shown = match section {
        Some(s) => format!("[{}] {}", toml_key(s), toml_key(key)),
        None => toml_key(key).into_owned(),
    };
    match KEYS.iter().find(|k| k.name == key) {
        Some(spec) if spec.secret => warnings.push(format!(
            "{}: secret key {shown} ignored; secrets are read only from the environment or a .env file",
            config_label(path)
        )),
        Some(spec) if section.is_none() || spec.section == section => match scalar(value) {
            Some(v) => {
                if out.insert(key.to_string(), v).is_some() {
                    warnings.push(format!(
                        "{}: {key} is set both at the top level and in [{}]; [{}]'s is used",
                        config_label(path),
                        spec.section.unwrap_or(""),
                        spec.section.unwrap_or("")
                    ));
                }
            }
            None => warnings.push(not_scalar(path, &shown)),
        },
        Some(spec) => warnings.push(format!(
            "{}: {shown} ignored; {key} belongs in [{}]",
            config_label(path),
            spec.section.unwrap_or("")
        )),
        None => warnings.push(format!("{}: unknown key {shown} ignored", config_label(path))),
    }
}

/// A key as TOML writes it: bare when it can be, else quoted, so that `"region "` is not
/// shown as `region` followed by a space no one sees.
fn toml_key(key: &str) -> std::borrow::Cow<'_, str> {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        return key.into();
    }
    let mut quoted = String::with_capacity(key.len() + 2);
    quoted.push('"');
    for c in key.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() || invisible(c) => {
                let code = u32::from(c);
                // TOML's escapes: four hex digits, or eight past the first plane.
                quoted.push_str(&match code {
                    0..=0xffff => format!("\\u{code:04X}"),
                    _ => format!("\\U{code:08X}"),
                });
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted.into()
}

/// Characters that show as nothing or turn the text around (Unicode's format
/// characters): `re\u{200b}gion` read as `region`.
fn invisible(c: char) -> bool {
    matches!(c, '\u{00ad}' | '\u{034f}' | '\u{0600}'..='\u{0605}' | '\u{061c}' | '\u{06dd}'
        | '\u{070f}' | '\u{08e2}' | '\u{115f}' | '\u{1160}' | '\u{180b}'..='\u{180f}'
        | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{206f}'
        | '\u{3164}' | '\u{fe00}'..='\u{fe0f}' | '\u{feff}' | '\u{ffa0}'
        | '\u{fff9}'..='\u{fffb}' | '\u{110bd}' | '\u{110cd}' | '\u{1d173}'..='\u{1d17a}'
        | '\u{e0001}' | '\u{e0020}'..='\u{e007f}' | '\u{e0100}'..='\u{e01ef}')
}

/// An array, table or date where a setting's value goes: ignored, as an unknown key is,
/// rather than silently.
fn not_scalar(path: &Path, shown: &str) -> String {
    format!(
        "{}: {shown} ignored; expected a string, number or boolean",
        config_label(path)
    )
}

/// TOML's own types for what the settings read as text: `token_ttl = 1200` is `"1200"`.
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The 1-based line of a byte offset (counting newlines: `str::lines` would put an offset
/// at the start of a line on the line before).
pub(crate) fn line_of(text: &str, offset: usize) -> usize {
    let mut end = offset.min(text.len());
    // An error at the very end of a text ending in a newline (a TOML parser's "expected
    // more") is about its last line: there is none after it to look at.
    if end == text.len() && text.ends_with('\n') {
        end -= 1;
    }
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// How messages name a file: as the user knows it (`~/.abx/.env`), and where it is (a
/// service's `~/.abx` is its `ABX_HOME`).
pub(crate) fn labelled(label: &str, path: &Path) -> String {
    format!("{label} ({})", path.display())
}

/// How warnings name a config.toml (see [`labelled`]).
pub(crate) fn config_label(path: &Path) -> String {
    labelled(Source::ConfigToml.label(), path)
}

/// `$ABX_HOME`, else `$HOME/.abx`, from `var` (the process environment's `var_os`). A
/// path need not be UTF-8 on Unix: such a home directory is used as it is. A `HOME` that
/// is no directory (`HOME=/dev/null`, as services and containers set it) is no home, as
/// an unset one is: git finds no `~/.gitconfig` there; every command failed with E1006
/// "Not a directory". (An `ABX_HOME` that is no directory was set on purpose: its error
/// stands.)
pub fn abx_home(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let nonblank = |k: &str| var(k).filter(|v| !v.to_str().is_some_and(|s| s.trim().is_empty()));
    // A path through something that is no directory (`HOME=/dev/null/`) is none either;
    // one that cannot be looked at is left to the read's own error.
    let a_directory = |h: &OsString| match std::fs::metadata(h) {
        Ok(m) => m.is_dir(),
        Err(e) => e.kind() != std::io::ErrorKind::NotADirectory,
    };
    nonblank("ABX_HOME").map(PathBuf::from).or_else(|| {
        nonblank("HOME")
            .filter(a_directory)
            .map(|h| Path::new(&h).join(".abx"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared file's lines that are not UTF-8 are blanked where they were, each line
    /// ending kept (`\r\n`, a lone `\r`, `\n`, none at the end), and numbered as the
    /// parser numbers them; a comment without a word. One of ours, one naming nothing, and
    /// one that opens or lies in a quoted value over lines fail the file, naming it (not
    /// an earlier line that was skippable); UTF-16 is left whole, a NUL elsewhere is not.
    #[test]
    fn lines_that_are_not_utf8_are_blanked_in_place() {
        let shown: Arc<str> = Arc::from("./.env");
        let blanked = |bytes: &[u8]| foreign_not_utf8(bytes.to_vec(), &shown);
        let (out, skipped) = blanked(b"A=1\r\nB=\xff\rC=2\n# caf\xe9\nD=\xfe").expect("taken");
        assert_eq!(out, b"A=1\r\n\rC=2\n\n");
        let lines: Vec<usize> = skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, [2, 5]);
        assert!(skipped[1]
            .warning()
            .contains("line 5 skipped: not UTF-8 text"));
        let (out, skipped) = blanked(b"N=a\x00b\nG=caf\xe9\n").expect("taken");
        assert_eq!((out.as_slice(), skipped.len()), (&b"N=a\x00b\n\n"[..], 1));
        for (bytes, line) in [
            (&b"G=caf\xe9\nABX_SANDBOX_API_KEY=\xff\n"[..], 2),
            (b"A=1\n\xff\n", 2),
            (b"A=1\rB=\xff\r", 0),
            // Another tool's quoted value over lines, its first line blanked: the next
            // would be read as a setting.
            (
                b"NOTES=\"caf\xe9\nALIBABA_CLOUD_REGION_ID=cn-shanghai\nX=1\"\n",
                1,
            ),
            // Inside ours.
            (b"ALIBABA_CLOUD_REGION_ID=\"cn-beijing\nY=caf\xe9\n\"\n", 2),
            (b"J='{\"a\":\n\"caf\xe9\"}'\n", 2),
            // A quote opened mid-value, double or single, and one a line's value opens
            // after closing another.
            (
                b"NOTES=a\"caf\xe9\nALIBABA_CLOUD_REGION_ID=cn-shanghai\nX=1\"\n",
                1,
            ),
            (
                b"NOTES=a'caf\xe9\nALIBABA_CLOUD_REGION_ID=cn-shanghai\nX=1'\n",
                1,
            ),
            (b"NOTES=a\"b\nG=caf\xe9\"\n", 2),
            (b"NOTES='it\\'s\nG=caf\xe9'\n", 2),
            (b"NOTES=\"a\" \"b\nG=caf\xe9\"\n", 2),
            // dotenvy's joiner: two blanks before `#` end no line, nor a `#` right after
            // `=`, nor an escaped blank; a quote in a line with no `=`.
            (b"NOTES=see  # Bob's notes\nG=caf\xe9\nX=1 # '\n", 2),
            (b"K=#Bob's\nG=caf\xe9'\n", 2),
            (b"K=a\\ #Bob's\nG=caf\xe9'\n", 2),
            (b"don't\nG=caf\xe9'\n", 2),
        ] {
            let got = blanked(bytes).map(|_| ());
            if line == 0 {
                assert!(got.is_ok(), "{bytes:?}");
            } else {
                assert_eq!(got, Err(line), "{bytes:?}");
            }
        }
        // Closed on its line, escaped quotes and all: not open.
        assert!(blanked(b"Q=\"say \\\"hi\\\"\"\nG=caf\xe9\n").is_ok());
        // A quote in a comment after a value, or in a comment line, opens none.
        assert!(blanked(b"Q=1 # it's\nG=caf\xe9\n").is_ok());
        assert!(blanked(b"# it's\nG=caf\xe9\n").is_ok());
        assert!(blanked(b"# a=it's\nG=caf\xe9\n").is_ok());
        // An escaped quote outside quotes opens none (dotenvy reads `it's`).
        assert!(blanked(b"K=it\\'s\nG=caf\xe9\n").is_ok());
        for whole in [&b"\xff\xfeA\x00=\x001\x00"[..], b"A=1\n"] {
            let (out, skipped) = blanked(whole).expect("whole");
            assert_eq!((out.as_slice(), skipped.len()), (whole, 0));
        }
    }

    /// Failing entries are found in order, each past the one before, with their numbers:
    /// on line 1 with or without its byte-order mark, and twice the same broken value.
    #[test]
    fn failing_entries_are_found_in_order_with_their_lines() {
        let text = "\u{feff}A=x y\n# A=x y\nB=ok\nC= x y\n\nC= x y\n";
        let mut after = Line::NONE;
        let mut found = Vec::new();
        for entry in ["A=x y", "x y", "x y"] {
            let line = entry_line(text, entry, after).expect(entry);
            found.push((line.number, &text[line.start..line.start + 1]));
            after = line;
        }
        assert_eq!(found, [(1, "A"), (4, "C"), (6, "C")]);
        assert!(entry_line(text, "x y", after).is_none());
        // Blank lines are no comment, whatever follows them.
        let text = "\n\n# B=x y\n\nB=x y\n";
        let line = entry_line(text, "B=x y", Line::NONE).expect("found");
        assert_eq!((line.number, &text[line.start..]), (5, "B=x y\n"));
    }

    /// A default (`${VAR:-x}`) or a bare `$NAME` on a line of ours is warned about, naming
    /// the line and the variable and never the value; `${VAR}`, single quotes, a backslash,
    /// a comment, and other tools' lines are not.
    #[test]
    fn substitutions_dotenvy_reads_otherwise_are_warned_about() {
        let text = "ALIBABA_CLOUD_REGION_ID=${MY_REGION:-cn-shanghai}\n\
                    ABX_TOKEN_TTL=$MY_TTL\n\
                    export ABX_SANDBOX_API_KEY=\"sk-abc$1def-0123456789\"\n\
                    ABX_SANDBOX_DOMAIN=${MY_DOMAIN}\n\
                    ABX_SANDBOX_URL='https://$literal.example'\n\
                    ABX_PROVIDER=\"a\\$b\"\n\
                    ABX_PROXY_LISTEN=127.0.0.1:7000 # $COMMENT\n\
                    # ABX_TOKEN_EXCHANGE=${X:-y}\n\
                    OTHER_TOOL=${X:-y}\n\
                    ABX_ADMIN=$\n";
        let mut warnings = Vec::new();
        parse_dotenv_str(text, "./.env", Some(&mut warnings)).expect("parsed");
        assert_eq!(warnings.len(), 4, "{warnings:#?}");
        for (w, start) in warnings.iter().zip([
            "./.env: line 1 (ALIBABA_CLOUD_REGION_ID): a `${…}` holds more",
            "./.env: line 2 (ABX_TOKEN_TTL): a bare `$` is expanded",
            "./.env: line 3 (ABX_SANDBOX_API_KEY): a bare `$` is expanded",
            "./.env: line 4 (ABX_SANDBOX_DOMAIN): ${MY_DOMAIN} is set neither in the \
             environment nor above it in this file",
        ]) {
            assert!(w.starts_with(start), "{w}");
            for value in ["cn-shanghai", "MY_TTL", "sk-abc", "1def"] {
                assert!(!w.contains(value), "{value} in {w}");
            }
        }
        // A line inside a multi-line quoted value may look like one of ours with anything
        // before its `=`: no warning repeats that.
        let none = HashMap::new();
        assert!(substitution_warnings("ABX_PIECE sk-123=$x\n", "./.env", &none).is_empty());
        assert_eq!(
            substitution_warnings("ABX_PIECE=$x\n", "./.env", &none).len(),
            1
        );
        let warned = |text: &str| {
            let mut warnings = Vec::new();
            parse_dotenv_str(text, "./.env", Some(&mut warnings)).expect("parsed");
            warnings
        };
        // A `${NAME}` set above it, or in the environment, has a value.
        let set = "MY_KEY=sk-1\nABX_SANDBOX_API_KEY=${MY_KEY}\nABX_SANDBOX_URL=${PATH}\n";
        assert!(warned(set).is_empty(), "{:?}", warned(set));
        // Below it, on a line dotenvy skipped, or inside a quoted value, it is not.
        for unset in [
            "ABX_SANDBOX_API_KEY=${MY_KEY}\nMY_KEY=sk-1\n",
            "MY_KEY=hello world\nABX_SANDBOX_API_KEY=${MY_KEY}\n",
            "CERT=\"a\nMY_KEY=b\n\"\nABX_SANDBOX_API_KEY=${MY_KEY}\n",
        ] {
            let w = warned(unset);
            assert!(
                w.iter().any(|w| w.contains("${MY_KEY} is set neither")),
                "{unset:?}: {w:?}"
            );
        }
        // What a template's braces hold may be the key pasted into them: not printed.
        let pasted = "ABX_SANDBOX_API_KEY=${e2b_53ae1fed82754c17ad8077fbc7ab1c3e}\n";
        let w = warned(pasted);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("a `${…}` names a variable set neither"),
            "{w:?}"
        );
        assert!(!w[0].contains("53ae1fed"), "{w:?}");
    }

    /// Lone carriage returns end lines; a file with none is read as it was.
    #[test]
    fn lone_carriage_returns_end_lines() {
        assert_eq!(lines_ended("A=1\rB=2\r\nC=3\r".into()), "A=1\nB=2\nC=3\n");
        let crlf = "A=\"1\r\n2\"\r\nB=3\r\n".to_string();
        assert_eq!(lines_ended(crlf.clone()), crlf);
        let vars = parse_dotenv_str("A=1\rB=2\r", "./.env", None).unwrap();
        assert_eq!((vars["A"].as_str(), vars["B"].as_str()), ("1", "2"));
    }

    /// A project's `./.env` with lines python-dotenv accepts and dotenvy does not: they are
    /// skipped with a warning naming the line when they set nothing abx-proxy reads, and
    /// the file's other lines still count. A broken line that is, or may swallow, one of
    /// ours still fails the file.
    #[test]
    fn broken_lines_of_other_tools_are_skipped_with_a_warning() {
        let text =
            "GREETING=hello world\nexport LONELY\nNAME-WITH-DASH=1\nABX_REGION=cn-shanghai\n";
        let mut warnings = Vec::new();
        let vars = parse_dotenv_str(text, "./.env", Some(&mut warnings)).expect("skipped");
        assert_eq!(
            vars.get("ABX_REGION").map(String::as_str),
            Some("cn-shanghai")
        );
        assert_eq!(vars.len(), 1, "{vars:?}");
        let lines: Vec<_> = warnings
            .iter()
            .map(|w| w.split(" skipped").next().unwrap_or_default())
            .collect();
        assert_eq!(
            lines,
            ["./.env: line 1", "./.env: line 2", "./.env: line 3"]
        );
        assert!(
            !warnings.iter().any(|w| w.contains("hello")),
            "{warnings:?}"
        );
        assert!(
            parse_dotenv_str(text, "~/.abx/.env", None).is_err(),
            "abx-proxy's own file stays strict"
        );

        for fatal in [
            "ABX_SANDBOX_API_KEY=sk one\n",
            "export ALICLOUD_ACCESS_KEY_ID\n",
            "NOTE=\"unterminated\nABX_SANDBOX_API_KEY=sk-after-it\n",
            "GITHUB_TOKEN=a b\n",
            "sk-a-key-pasted-without-its-name\n",
        ] {
            let err = parse_dotenv_str(fatal, "./.env", Some(&mut Vec::new()));
            assert!(err.is_err(), "{fatal:?} was skipped");
        }
    }

    /// Two broken lines with the same value: the second is its own entry, not the first
    /// found again. Named after the first, a broken line of ours was skipped as another
    /// tool's and the setting fell through to a lower level without a word.
    #[test]
    fn a_broken_line_like_a_skipped_one_is_judged_on_its_own() {
        let text = "GREETING=hello world\nALIBABA_CLOUD_REGION_ID=hello world\n";
        let err = parse_dotenv_str(text, "./.env", Some(&mut Vec::new())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read ./.env: syntax error at line 2"
        );
        let text = "GREETING=hello world\nFAREWELL=hello world\nABX_REGION=cn-shanghai\n";
        let mut warnings = Vec::new();
        let vars = parse_dotenv_str(text, "./.env", Some(&mut warnings)).expect("skipped");
        assert_eq!(vars.len(), 1, "{vars:?}");
        let lines: Vec<_> = warnings
            .iter()
            .map(|w| w.split(" skipped").next().unwrap_or_default())
            .collect();
        assert_eq!(lines, ["./.env: line 1", "./.env: line 2"]);
    }

    /// A TOML error says what is wrong and where, and nothing of what the line held:
    /// "invalid TOML at line 3" alone left a duplicate key to be guessed.
    #[test]
    fn toml_errors_say_what_is_wrong_without_the_line() {
        for (text, said) in [
            (
                "[transport]\nregion = \"a\"\nregion = \"b\"\n",
                "invalid TOML at line 3: duplicate key `…`",
            ),
            (
                "sandbox_api_key = sk-SECRET123\n",
                "invalid TOML at line 1: invalid string; expected `\"`, `'`",
            ),
            (
                "\"sk-SECRET123\" = 1\n\"sk-SECRET123\" = 2\n",
                "invalid TOML at line 2: duplicate key `…`",
            ),
            // A backtick in the name shifted which pieces were taken for names.
            (
                "\"`LTAI5tSECRET`\" = 1\n\"`LTAI5tSECRET`\" = 2\n",
                "invalid TOML at line 2: duplicate key `…`",
            ),
            (
                "\"sk-AAAA`BBBBSECRET\" = 1\n\"sk-AAAA`BBBBSECRET\" = 2\n",
                "invalid TOML at line 2: duplicate key `…`",
            ),
            (
                "[\"`SECRETTABLE`\"]\nx = 1\nx = 2\n",
                "invalid TOML at line 3: duplicate key `…`",
            ),
            // A token's letter first, then the name: it passed for the parser's text.
            (
                "\"b`sk-live-9f8e7d6c5b4a3210\" = 1\n\"b`sk-live-9f8e7d6c5b4a3210\" = 2\n",
                "invalid TOML at line 2: duplicate key `…`",
            ),
            (
                "\"x`SECRETDOTTED\".y = 1\n\"x`SECRETDOTTED\".y.z = 2\n",
                "invalid TOML at line 2: dotted key `…`",
            ),
            // A newline in the name, to forge an "expected" line.
            (
                "\"a\\nexpected `b`, secretword\" = 1\n\"a\\nexpected `b`, secretword\" = 2\n",
                "invalid TOML at line 2: duplicate key `…`",
            ),
            (
                "x = \"sk-SEC\\qRET\"\n",
                "invalid TOML at line 1: invalid escape sequence; expected `b`, `f`, `n`, `r`, \
                 `t`, `u`, `U`, `\\`, `\"`",
            ),
            (
                "x = [1, sk-SECRET]\n",
                "invalid TOML at line 1: invalid array; expected `]`",
            ),
            ("x = 1 2\n", "invalid TOML at line 1: expected newline, `#`"),
            // A name on the parser's second line: its first kept.
            (
                "[tbl]\nx = 1\n[tbl]\n",
                "invalid TOML at line 3: invalid table header; duplicate key `…`",
            ),
            (
                "[\"a\\nsecretword\"]\n[\"a\\nsecretword\"]\n",
                "invalid TOML at line 2: invalid table header; duplicate key `…`",
            ),
        ] {
            let e = parse_config_toml_str(text, Path::new("c.toml"), &mut Vec::new());
            let Err(Error::ReadFile { reason, .. }) = e else {
                panic!("{text:?}: {e:?}")
            };
            assert_eq!(reason, said, "{text:?}");
        }
    }

    /// A key no bare TOML key spells is quoted where a warning names it.
    #[test]
    fn keys_in_config_warnings_are_spelt_as_toml_writes_them() {
        let mut warnings = Vec::new();
        let text = "\"region \" = \"x\"\n[transport]\nlisten = \"y\"\n[\"a b\"]\nk = 1\n";
        parse_config_toml_str(text, Path::new("c.toml"), &mut warnings).expect("read");
        let all = warnings.join("\n");
        assert!(all.contains("unknown key \"region \" ignored"), "{all}");
        assert!(all.contains("[transport] listen ignored"), "{all}");
        assert!(all.contains("[\"a b\"]"), "{all}");
        let text = "\"a\\u001B[31m\\\"\" = 1\n[providers]\n\"bad id\" = 1\n[providers.e2b]\n\"x y\" = [1]\n";
        parse_config_toml_str(text, Path::new("c.toml"), &mut warnings).expect("read");
        let all = warnings.join("\n");
        assert!(
            all.contains("unknown key \"a\\u001B[31m\\\"\" ignored"),
            "{all}"
        );
        assert!(all.contains("[providers] \"bad id\" ignored"), "{all}");
        assert!(all.contains("[providers.e2b] \"x y\" ignored"), "{all}");
        let mut warnings = Vec::new();
        let text = "\"re\u{200b}gion\" = 1\n\"x\u{202e}y\" = 1\n\"t\u{e0067}g\" = 1\n";
        parse_config_toml_str(text, Path::new("c.toml"), &mut warnings).expect("read");
        let all = warnings.join("\n");
        assert!(all.contains("\"re\\u200Bgion\""), "{all}");
        assert!(all.contains("\"x\\u202Ey\""), "{all}");
        assert!(all.contains("\"t\\U000E0067g\""), "{all}");
    }

    /// A line of ours appended to a `./.env` in UTF-16 fails the file, naming it: judged by
    /// its NULs' bytes, it was skipped as another tool's and the key came from a lower level.
    #[test]
    fn a_line_of_ours_in_utf16_fails_the_file() {
        let mixed: String = "ABX_REGION=cn-beijing\n".to_string()
            + &"ABX_SANDBOX_API_KEY=sk-new\n"
                .chars()
                .flat_map(|c| [c, '\0'])
                .collect::<String>()
            + "NODE_ENV=dev\n";
        let mut warnings = Vec::new();
        let e = parse_dotenv_str(&mixed, "./.env", Some(&mut warnings)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot read ./.env: syntax error at line 2: NUL bytes (UTF-16 text? save it as UTF-8)"
        );
    }

    /// A line in UTF-16 that sets a selected plugin's alias is known as such, and refused
    /// with the hint a line of ours gets: its name was read with its NULs, and the key was
    /// skipped as another tool's line.
    #[test]
    fn a_line_in_utf16_keeps_its_name() {
        let text = "NODE_ENV=dev\n".to_string()
            + &"OPEN_SANDBOX_API_KEY=os-new"
                .chars()
                .flat_map(|c| [c, '\0'])
                .collect::<String>();
        let mut skipped = Vec::new();
        collect_dotenv(&text, "./.env", Some(&mut skipped)).expect("read");
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].sets_any(&["OPEN_SANDBOX_API_KEY".to_string()]));
        // Refused as a line of ours is: with the hint.
        assert_eq!(
            skipped.remove(0).into_error().to_string(),
            "cannot read ./.env: syntax error at line 2: NUL bytes (UTF-16 text? save it as UTF-8)"
        );
    }

    /// Another tool's lines get a warning each, up to ten; the rest one between them.
    #[test]
    fn skipped_lines_past_ten_are_said_once() {
        let text: String = (1..=25)
            .map(|i| format!("GREETING_{i}=hello world\n"))
            .collect();
        let mut warnings = Vec::new();
        parse_dotenv_str(&text, "./.env", Some(&mut warnings)).expect("skipped");
        assert_eq!(warnings.len(), 11, "{warnings:?}");
        assert!(
            warnings[9].starts_with("./.env: line 10 skipped"),
            "{warnings:?}"
        );
        assert_eq!(
            warnings[10],
            "./.env: 15 more lines skipped likewise, up to line 25"
        );
        let text: String = (1..=11)
            .map(|i| format!("GREETING_{i}=hello world\n"))
            .collect();
        let mut warnings = Vec::new();
        parse_dotenv_str(&text, "./.env", Some(&mut warnings)).expect("skipped");
        assert_eq!(
            warnings.last().map(String::as_str),
            Some("./.env: 1 more line skipped likewise, up to line 11")
        );
    }

    /// The text of a failing entry may also appear earlier, in a comment or inside another
    /// line: only a match at a line start is the entry.
    #[test]
    fn a_syntax_error_names_the_line_of_the_entry() {
        let text = "# ABX_SANDBOX_BASE_URL=http://x y\nA=1\nABX_SANDBOX_BASE_URL=http://x y\n";
        let err = parse_dotenv_str(text, "./.env", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read ./.env: syntax error at line 3"
        );
        let text = "B=\"ABX_REGION=x\n y\"\n  ABX_REGION = x y\n";
        let err = parse_dotenv_str(text, "./.env", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read ./.env: syntax error at line 3"
        );
        let text = "\u{feff}ABX_REGION=x y\n";
        let err = parse_dotenv_str(text, "./.env", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read ./.env: syntax error at line 1"
        );
    }

    /// dotenvy fails a double-quoted value ending in `$NAME` (or `$`): the error says so
    /// and how to write it, without the value.
    #[test]
    fn a_dollar_before_a_closing_quote_is_named_as_the_syntax_error() {
        for line in [
            "ABX_SANDBOX_BASE_URL=\"http://127.0.0.1:$PORT\"",
            "ABX_REGION=\"$R\"",
            "export ABX_REGION=\"${A}$R\"",
            "ABX_REGION=\"cn-$\"",
        ] {
            let text = format!("PORT=1\nR=2\nA=3\n{line}\n");
            let err = parse_dotenv_str(&text, "./.env", None).unwrap_err();
            let said = err.to_string();
            assert!(
                said.starts_with(
                    "cannot read ./.env: syntax error at line 4: dotenvy reads no `$`"
                ) && said.contains("write `${NAME}`"),
                "{line}: {said}"
            );
        }
        // Other syntax errors stay plain, a `$` beside them too; single quotes and `\$`
        // hold no substitution.
        for line in [
            "ABX_REGION=x y",
            "ABX_REGION='$R\"",
            "ABX_REGION=\"\\$R\" x",
            "ABX_REGION=x y # \"$R\"",
            "ABX_REGION=\"x\" \"$R\"",
        ] {
            assert!(!dollar_is_the_cause(line), "{line}");
        }
        let err = parse_dotenv_str("ABX_REGION=x y\n", "./.env", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read ./.env: syntax error at line 1"
        );
    }

    /// A byte-order mark before the first line is not part of its name.
    #[test]
    fn a_byte_order_mark_is_skipped() {
        let text = "\u{feff}ABX_SANDBOX_API_KEY=sk-bom\nB=2\n";
        let vars = parse_dotenv_str(text, "~/.abx/.env", None).expect("parsed");
        assert_eq!(vars["ABX_SANDBOX_API_KEY"], "sk-bom");
        assert_eq!(vars["B"], "2");
    }

    /// A key set at the top level and in its table: the table's, whichever name sorts
    /// first, and a warning naming both.
    #[test]
    fn a_keys_own_table_wins_over_the_top_level() {
        let path = Path::new("/home/u/.abx/config.toml");
        for text in [
            "token_ttl = 100\n[auth]\ntoken_ttl = 200\n",
            "[auth]\ntoken_ttl = 200\n",
            "region = \"top\"\n[transport]\nregion = \"table\"\n",
            "region = \"table\"\n",
        ] {
            let mut warnings = Vec::new();
            let values = parse_config_toml_str(text, path, &mut warnings).expect("parsed");
            let (key, want) = if text.contains("token_ttl") {
                ("token_ttl", "200")
            } else {
                ("region", "table")
            };
            assert_eq!(values[key], want, "{text}");
            let both = text.matches(key).count() == 2;
            assert_eq!(warnings.len(), usize::from(both), "{text}: {warnings:?}");
            if both {
                assert!(
                    warnings[0].contains(&format!("{key} is set both at the top level and in [")),
                    "{warnings:?}"
                );
                assert!(
                    warnings[0].contains("/home/u/.abx/config.toml"),
                    "{warnings:?}"
                );
            }
        }
    }

    #[test]
    fn line_numbers_count_newlines() {
        let text = "a=1\nb=2\n\nc";
        assert_eq!(line_of(text, 0), 1);
        assert_eq!(line_of(text, 3), 1);
        assert_eq!(line_of(text, 4), 2);
        assert_eq!(line_of(text, 9), 4);
        assert_eq!(line_of(text, 99), 4);
        assert_eq!(line_of("a=1\nb=[\n", 8), 2, "the end names the last line");
        assert_eq!(line_of("a=1\r\n", 5), 1);
    }
}
