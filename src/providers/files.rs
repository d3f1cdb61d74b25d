//! An installed plugin's two files, its manifest and its consent receipt, written and read
//! as one pair: a proxy starting, `check` or a reload reading while `provider install`
//! writes sees the old pair or the new one, never the new manifest beside the old receipt
//! (whose consent, given to another manifest, would not count).
//!
//! The installer holds an exclusive `flock` on `.abx-install.lock` in the plugin's
//! directory while it renames both into place (so two installs of one id take turns too);
//! a reader that finds the two out of step takes the lock shared, which waits out an
//! install in progress, and reads again. Readers of a pair in step take no lock.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};

const LOCK_FILE: &str = ".abx-install.lock";

/// How long a reader waits for an install in progress, which renames two files: the wait
/// runs where settings are read (a reload, on the runtime with the admin listener), and a
/// stopped installer must not hold that up for long.
const READER_WAIT: Duration = Duration::from_secs(2);

/// Writes `files` (name, contents) into `dir`, each replacing its old one whole: all are
/// written and synced beside their targets first, then renamed into place one after the
/// other under the lock.
pub fn write_pair(dir: &Path, files: [(&str, &[u8]); 2]) -> io::Result<()> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))?;
    flock(&lock, FlockOperation::LockExclusive)?;
    let mut temps: Vec<(PathBuf, &str)> = Vec::new();
    let mut written = || -> io::Result<()> {
        for (name, bytes) in files {
            temps.push((prepare(dir, name, bytes)?, name));
        }
        for (temp, name) in &temps {
            std::fs::rename(temp, dir.join(name))?;
        }
        Ok(())
    };
    let result = written();
    for (temp, _) in &temps {
        // Renamed away on success: only a failure leaves one to remove.
        let _ = std::fs::remove_file(temp);
    }
    if result.is_ok() {
        // The renames themselves, on disk before the command says it installed.
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    result
}

/// `name`'s new contents in a file of its own beside it, synced, with the old file's
/// permissions (a `chmod 600` survives a reinstall).
fn prepare(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<PathBuf> {
    let temp = dir.join(format!(".{name}.new"));
    // Under the lock no other install writes here: one found is a crashed install's.
    let _ = std::fs::remove_file(&temp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)?;
    if let Ok(old) = std::fs::metadata(dir.join(name)) {
        file.set_permissions(old.permissions())?;
    }
    file.write_all(bytes)?;
    file.sync_all()?;
    Ok(temp)
}

/// The two files `names` of `dir` (the second may be missing), read through the bounded
/// reader. When `in_step` says they are not, an install may be between its two renames:
/// read again once it is over. A pair still out of step after that (a manifest edited by
/// hand) is returned as it is.
pub fn read_pair(
    dir: &Path,
    names: [&str; 2],
    in_step: impl Fn(&[u8], Option<&[u8]>) -> bool,
) -> io::Result<(Vec<u8>, Option<Vec<u8>>)> {
    let read = || -> io::Result<(Vec<u8>, Option<Vec<u8>>)> {
        let first = crate::watched::read_regular(&dir.join(names[0]))?;
        let second = crate::watched::read_regular(&dir.join(names[1])).ok();
        Ok((first, second))
    };
    let pair = read()?;
    if in_step(&pair.0, pair.1.as_deref()) {
        return Ok(pair);
    }
    let Ok(lock) = File::open(dir.join(LOCK_FILE)) else {
        return Ok(pair);
    };
    let deadline = Instant::now() + READER_WAIT;
    loop {
        match flock(&lock, FlockOperation::NonBlockingLockShared) {
            Ok(()) => return read(),
            Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return Ok(pair),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 2] = ["manifest", "receipt"];

    fn in_step(a: &[u8], b: Option<&[u8]>) -> bool {
        b.is_some_and(|b| a.last() == b.last())
    }

    /// A reader that finds the new manifest beside the old receipt (an install between
    /// its renames) waits for the install to end and reads the new pair.
    #[test]
    fn a_reader_waits_out_an_install_between_its_renames() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().to_path_buf();
        write_pair(&d, [(NAMES[0], b"m1"), (NAMES[1], b"r1")]).expect("installed");
        // An install in progress: the lock held, the manifest renamed, not yet the receipt.
        let lock = File::open(d.join(LOCK_FILE)).expect("lock file");
        flock(&lock, FlockOperation::LockExclusive).expect("locked");
        std::fs::write(d.join(NAMES[0]), "m2").expect("new manifest");
        let (saw, seen) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            read_pair(&d, NAMES, |a, b| {
                let _ = saw.send(());
                in_step(a, b)
            })
        });
        seen.recv().expect("the reader read the pair out of step");
        std::fs::write(dir.path().join(NAMES[1]), "r2").expect("new receipt");
        drop(lock);
        let (a, b) = reader.join().expect("reader").expect("read");
        assert_eq!((a.as_slice(), b.as_deref()), (&b"m2"[..], Some(&b"r2"[..])));
    }

    /// A pair out of step with no install running (a manifest edited by hand) is read as
    /// it is, at once; so is one never installed through the lock.
    #[test]
    fn a_pair_out_of_step_by_hand_is_read_as_it_is() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        std::fs::write(d.join(NAMES[0]), "m1").expect("manifest");
        let (a, b) = read_pair(d, NAMES, in_step).expect("read without a lock file");
        assert_eq!((a.as_slice(), b), (&b"m1"[..], None));
        write_pair(d, [(NAMES[0], b"m1"), (NAMES[1], b"r1")]).expect("installed");
        std::fs::write(d.join(NAMES[0]), "m2").expect("edited");
        let (a, b) = read_pair(d, NAMES, in_step).expect("read");
        assert_eq!((a.as_slice(), b.as_deref()), (&b"m2"[..], Some(&b"r1"[..])));
    }

    /// A reinstall keeps the files' permissions and leaves no temporary file, also after
    /// one a crashed install left.
    #[test]
    fn a_write_keeps_permissions_and_leaves_nothing_behind() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        write_pair(d, [(NAMES[0], b"m1"), (NAMES[1], b"r1")]).expect("installed");
        let mode = std::fs::Permissions::from_mode(0o600);
        std::fs::set_permissions(d.join(NAMES[0]), mode).expect("chmod");
        std::fs::write(d.join(".manifest.new"), "crashed").expect("left behind");
        write_pair(d, [(NAMES[0], b"m2"), (NAMES[1], b"r2")]).expect("installed again");
        let meta = std::fs::metadata(d.join(NAMES[0])).expect("manifest");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(d.join(NAMES[0])).expect("read"), b"m2");
        let mut names: Vec<_> = std::fs::read_dir(d)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        assert_eq!(names, [LOCK_FILE, NAMES[0], NAMES[1]]);
    }
}
