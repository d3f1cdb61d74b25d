//! The files a running proxy reads again: the `--*-file` secrets and the listener's
//! `--tls-cert` / `--tls-key` ([`read`]), and the settings files, `.env` and `config.toml`
//! ([`read_regular`]), at the start and at every reload (SIGHUP, or the file watch of
//! [`crate::reload`]).
//!
//! A read must end, and soon: reloads' reads queue on one thread ([`crate::reader`]), and
//! one that never ended would hold every later reload and the file watch. So a file past
//! [`MAX_LEN`] (a disk image written over a certificate) is refused, not read on; and a
//! pipe or a terminal (`<(…)`, `/dev/stdin`), which the start read to its end and which
//! cannot be read again, keeps what the start read. A path that was a regular file and is
//! now something else (a FIFO swapped in, which would block until someone writes to it) is
//! refused, and what runs keeps running. A file is opened without waiting and its type
//! checked on the open file, so a FIFO swapped in between a look at the path and the open
//! cannot block it either.

use std::collections::HashMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// Far more than any key or certificate chain.
pub const MAX_LEN: u64 = 1 << 20;
const _: () = assert!(MAX_LEN == 1 << 20, "`read_bounded_to`'s error says 1 MiB");

/// What a pipe gave the start; `Debug` shows its length only (it is a secret, or a key).
struct Kept(Vec<u8>);

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kept({} bytes)", self.0.len())
    }
}

/// Each path read so far: what a pipe or a device gave, or `None` for a regular file.
static SEEN: Mutex<Option<HashMap<PathBuf, Option<Kept>>>> = Mutex::new(None);

fn seen<T>(f: impl FnOnce(&mut HashMap<PathBuf, Option<Kept>>) -> T) -> T {
    let mut guard = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.get_or_insert_with(HashMap::new))
}

/// The file's bytes: see the module's doc for what is refused and what is kept.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    read_up_to(path, Limit::File)
}

/// How much a read takes before it refuses the file.
#[derive(Clone, Copy)]
pub enum Limit {
    /// [`MAX_LEN`]: a key, certificate, settings or manifest file.
    File,
    /// [`MAX_BUNDLE_LEN`]: `--upstream-ca`, which may hold a whole trust store.
    Bundle,
}

/// A trust bundle may hold every CA a system trusts, and more: Debian's is ~200 KB, one
/// written with `openssl x509 -text` for each certificate several times that (1 MiB
/// refused such bundles, which curl and nginx take).
pub const MAX_BUNDLE_LEN: u64 = 16 << 20;
const _: () = assert!(
    MAX_BUNDLE_LEN == 16 << 20,
    "`read_bounded_to`'s error says 16 MiB"
);

/// [`read`], refusing past `limit`.
pub fn read_up_to(path: &Path, limit: Limit) -> io::Result<Vec<u8>> {
    let kind = match open_if_regular(path)? {
        Ok(file) => {
            let bytes = read_bounded_to(file, limit)?;
            seen(|s| s.insert(path.to_path_buf(), None));
            return Ok(bytes);
        }
        Err(kind) => kind,
    };
    match seen(|s| s.get(path).map(|k| k.as_ref().map(|k| k.0.clone()))) {
        Some(Some(kept)) => Ok(kept),
        Some(None) => Err(io::Error::other(format!(
            "no longer a regular file ({kind}): a pipe or a device is read at the start only"
        ))),
        // The first read of a pipe: the start's, which waits for its end (a key typed at
        // a terminal ends with Ctrl-D).
        None => {
            let bytes = read_bounded_to(std::fs::File::open(path)?, limit)?;
            seen(|s| s.insert(path.to_path_buf(), Some(Kept(bytes.clone()))));
            Ok(bytes)
        }
    }
}

/// A regular file's bytes, up to [`MAX_LEN`]; anything else at `path` is refused (an
/// `Other` error naming what it is), never opened, nor waited on if swapped in.
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    read_bounded(open_if_regular(path)?.map_err(not_regular)?)
}

/// `path` opened if it is a regular file, else what it is. Looked at first, so that what is
/// no regular file is never opened (a FIFO's writer, waiting for another reader, would be
/// let through); opened without waiting and typed again on the open file, so that a FIFO
/// swapped in between cannot block the open.
pub fn open_if_regular(path: &Path) -> io::Result<Result<std::fs::File, &'static str>> {
    let kind = kind_word(std::fs::metadata(path)?.file_type());
    if kind != REGULAR {
        return Ok(Err(kind));
    }
    open_typed(path)
}

/// `path` opened without waiting: the file if it is a regular one, else what it is.
fn open_typed(path: &Path) -> io::Result<Result<std::fs::File, &'static str>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let kind = kind_word(file.metadata()?.file_type());
    Ok(if kind == REGULAR { Ok(file) } else { Err(kind) })
}

/// The text of a settings, key or manifest file; not UTF-8, an error saying where (or that
/// it is UTF-16, which PowerShell 5's `>` and `Out-File` write) instead of std's "stream
/// did not contain valid UTF-8".
pub fn utf8(bytes: Vec<u8>) -> io::Result<String> {
    let text = String::from_utf8(bytes).map_err(|e| {
        let bytes = e.as_bytes();
        let reason = if bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff]) {
            "UTF-16 text: save it as UTF-8".to_string()
        } else {
            // Lines end as a `.env`'s are read: `\r\n`, `\r` or `\n`.
            let valid = &bytes[..e.utf8_error().valid_up_to()];
            let ends = (valid.iter().enumerate())
                .filter(|(i, &b)| b == b'\n' || (b == b'\r' && valid.get(i + 1) != Some(&b'\n')))
                .count();
            format!("not UTF-8 text (line {})", ends + 1)
        };
        io::Error::new(io::ErrorKind::InvalidData, reason)
    })?;
    // UTF-16 with no byte-order mark is valid UTF-8 (ASCII and NUL bytes): read on, it
    // was a bare "syntax error at line 1". Told by its start, every other byte NUL: a NUL
    // on another tool's line of a shared `./.env` is that line's affair (skipped, as any
    // line abx-proxy does not read).
    if is_utf16(text.as_bytes()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "UTF-16 text (no byte-order mark): save it as UTF-8",
        ));
    }
    Ok(text)
}

/// UTF-16 text, with a byte-order mark or told by its start, every other byte NUL (see
/// [`utf8`]).
pub fn is_utf16(bytes: &[u8]) -> bool {
    if bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff]) {
        return true;
    }
    let head = &bytes[..bytes.len().min(64)];
    let nul = head.iter().filter(|&&b| b == 0).count();
    head.len() >= 4 && nul * 2 + 1 >= head.len()
}

/// A file flag's read that failed, as errors say it: the path when something is there;
/// else the flag, since a value that names nothing may well be a secret (a key, a PEM)
/// pasted in place of its path, and errors end up in logs. Whoever typed a wrong path
/// still has it in their command line.
pub fn unread(flag: &str, path: &Path, reason: String) -> crate::error::Error {
    if std::fs::symlink_metadata(path).is_ok() {
        crate::error::Error::ReadFile {
            path: path.display().to_string(),
            reason,
        }
    } else {
        crate::error::Error::ReadFile {
            path: format!("the file given to {flag}"),
            reason: format!(
                "{reason} (the value is not repeated: it may be a secret pasted in place of a path)"
            ),
        }
    }
}

/// An error of these reads in words: the proxy's own reasons in full, the OS's by their kind.
pub fn reason(e: &io::Error) -> String {
    match e.get_ref() {
        Some(own) => own.to_string(),
        // The kind's own words for it are "entity not found".
        None if e.kind() == io::ErrorKind::NotFound => "no such file or directory".into(),
        None => e.kind().to_string(),
    }
}

fn not_regular(kind: &str) -> io::Error {
    io::Error::other(format!("not a regular file ({kind})"))
}

const REGULAR: &str = "a regular file";

/// What is at `path` (a link followed), in words: "a FIFO", "a directory", "a dangling
/// link" ….
pub fn kind_of(path: &Path) -> &'static str {
    match std::fs::metadata(path) {
        Ok(m) => kind_word(m.file_type()),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => "a link loop",
        Err(_) if path.symlink_metadata().is_ok() => "a dangling link",
        Err(_) => "nothing",
    }
}

fn kind_word(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_file() {
        REGULAR
    } else {
        "not a file"
    }
}

/// The file's bytes, refused past [`MAX_LEN`].
pub fn read_bounded(file: std::fs::File) -> io::Result<Vec<u8>> {
    read_bounded_to(file, Limit::File)
}

fn read_bounded_to(file: std::fs::File, limit: Limit) -> io::Result<Vec<u8>> {
    let (max, refused) = match limit {
        Limit::File => (
            MAX_LEN,
            "larger than 1 MiB, the most a key, certificate, settings or provider manifest \
             file may hold",
        ),
        Limit::Bundle => (
            MAX_BUNDLE_LEN,
            "larger than 16 MiB, the most a trust bundle may hold",
        ),
    };
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, refused));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// What is at a path, and why it could not be read, in words a user knows: a link to
    /// itself is a loop (it was called dangling), a missing file is no such file (the
    /// kind's own words are "entity not found").
    #[test]
    fn what_is_there_and_why_it_is_unread_are_said_plainly() {
        let dir = tempfile::tempdir().expect("dir");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::os::unix::fs::symlink(&b, &a).expect("a -> b");
        assert_eq!(kind_of(&a), "a dangling link");
        std::os::unix::fs::symlink(&a, &b).expect("b -> a");
        assert_eq!(kind_of(&a), "a link loop");
        assert_eq!(kind_of(&dir.path().join("c")), "nothing");
        let missing = std::fs::File::open(dir.path().join("c")).expect_err("no file");
        assert_eq!(reason(&missing), "no such file or directory");
    }

    /// Text that is not UTF-8 is said with its line, or as UTF-16 (PowerShell 5's `>`).
    #[test]
    fn text_that_is_not_utf8_is_said_where() {
        let said = |bytes: &[u8]| utf8(bytes.to_vec()).unwrap_err().to_string();
        assert_eq!(said(b"A=1\nB=2\nC=caf\xe9\n"), "not UTF-8 text (line 3)");
        assert_eq!(said(b"\xe9"), "not UTF-8 text (line 1)");
        let utf16: Vec<u8> = [0xff, 0xfe, b'A', 0, b'=', 0, b'1', 0].to_vec();
        assert_eq!(said(&utf16), "UTF-16 text: save it as UTF-8");
        assert_eq!(
            said(&utf16[2..]),
            "UTF-16 text (no byte-order mark): save it as UTF-8"
        );
        let big_endian: Vec<u8> = "A=1\n".bytes().flat_map(|b| [0, b]).collect();
        assert_eq!(
            said(&big_endian),
            "UTF-16 text (no byte-order mark): save it as UTF-8"
        );
        // A NUL on a line is that line's: another tool's line in a shared `./.env`.
        assert!(utf8(b"ABX_REGION=cn-hangzhou\nOTHER=a\0b\n".to_vec()).is_ok());
        assert_eq!(utf8(b"A=1\n".to_vec()).expect("UTF-8"), "A=1\n");
    }

    /// A pipe is read to its end once; a reload's read gets the same bytes, not an empty
    /// pipe (or, at a terminal, a read that waits for the user).
    #[test]
    fn a_pipe_keeps_what_the_start_read() {
        let (reader, mut writer) = io::pipe().expect("pipe");
        writer.write_all(b"sk-piped-once\n").expect("write");
        drop(writer);
        let path = PathBuf::from(format!("/proc/self/fd/{}", reader.as_raw_fd()));
        assert_eq!(read(&path).expect("first"), b"sk-piped-once\n");
        assert_eq!(read(&path).expect("again"), b"sk-piped-once\n");
        drop(reader);
    }

    /// A FIFO is never waited on (its open blocks until a writer comes): refused at once
    /// where a regular file was, as by [`read_regular`].
    #[test]
    fn a_fifo_is_refused_not_waited_on() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-one").expect("write");
        assert_eq!(read(&path).expect("read"), b"sk-one");
        std::fs::remove_file(&path).expect("remove");
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .expect("run mkfifo");
        assert!(made.success(), "mkfifo");
        // On a thread of its own: a regression blocks in `open`, and must fail, not hang.
        let (tx, rx) = std::sync::mpsc::channel();
        let probe = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send((read(&probe), read_regular(&probe)));
        });
        let (kept, regular) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a FIFO was waited on");
        let e = kept.expect_err("refused");
        assert!(
            e.to_string().contains("no longer a regular file (a FIFO)"),
            "{e}"
        );
        let e = regular.expect_err("refused");
        assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
    }

    /// A regular file is read afresh each time, up to the bound; one that became something
    /// else is refused rather than opened.
    #[test]
    fn a_regular_file_is_read_afresh_and_bounded() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-one").expect("write");
        assert_eq!(read(&path).expect("read"), b"sk-one");
        std::fs::write(&path, "sk-two").expect("rotate");
        assert_eq!(read(&path).expect("read"), b"sk-two");

        let big = std::fs::File::create(&path).expect("create");
        big.set_len(MAX_LEN + 1).expect("grow");
        let e = read(&path).expect_err("too large");
        assert!(e.to_string().contains("larger than 1 MiB"), "{e}");
        big.set_len(MAX_LEN).expect("shrink");
        assert_eq!(read(&path).expect("at the bound").len() as u64, MAX_LEN);

        std::fs::remove_file(&path).expect("remove");
        std::fs::create_dir(&path).expect("a directory in its place");
        let e = read(&path).expect_err("not a file");
        assert!(
            e.to_string()
                .contains("no longer a regular file (a directory)"),
            "{e}"
        );
    }
}
