//! How `provider install` writes an installed plugin's files: each replaced whole (written
//! and synced beside its target, then renamed over it), and one install of a plugin at a
//! time. The order of the renames, which keeps what readers see consistent without their
//! taking any lock, is [`super::install`]'s.
//!
//! The installers' lock is an exclusive `flock` on `.abx-install.lock` in the plugin's
//! directory, waited for at most [`INSTALL_WAIT`]: two installs of one id at once could
//! otherwise leave one's manifest beside the other's receipt for good.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};

pub const LOCK_FILE: &str = ".abx-install.lock";

/// How long an install waits for another install of the same plugin.
const INSTALL_WAIT: Duration = Duration::from_secs(30);

/// Held while a plugin's files are replaced; released when dropped (with its descriptor).
pub struct InstallLock {
    _held: File,
}

impl InstallLock {
    /// Takes the lock of the plugin directory `dir`, waiting at most [`INSTALL_WAIT`] for
    /// an install in progress (saying so once), then failing with `WouldBlock`.
    pub fn take(dir: &Path) -> io::Result<Self> {
        let path = dir.join(LOCK_FILE);
        // Without waiting: a FIFO put there would block the open; nor through a link, which
        // would create its target elsewhere. A lock file this user may not write (mode
        // 0444) still takes a lock through a read-only descriptor.
        let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOFOLLOW;
        let open = |write: bool| {
            OpenOptions::new()
                .read(true)
                .write(write)
                .create(write)
                .truncate(false)
                .custom_flags(flags.bits() as i32)
                .open(&path)
        };
        let link = |e: io::Error| match e.raw_os_error() {
            Some(n) if n == rustix::io::Errno::LOOP.raw_os_error() => {
                io::Error::other("not a regular file (a link)")
            }
            _ => e,
        };
        let file = match open(true) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => open(false).map_err(link)?,
            opened => opened.map_err(link)?,
        };
        if !file.metadata()?.is_file() {
            return Err(io::Error::other(format!(
                "not a regular file ({})",
                crate::watched::kind_of(&path)
            )));
        }
        let deadline = Instant::now() + INSTALL_WAIT;
        let mut said = false;
        loop {
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(InstallLock { _held: file }),
                Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                    if !said {
                        eprintln!("waiting for another install of this provider to finish");
                        said = true;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        format!(
                            "another install of this provider held the lock for {} s; \
                             install again once it is over",
                            INSTALL_WAIT.as_secs()
                        ),
                    ))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Replaces `dir/name` with `bytes` whole: a reader sees the old file or the new one, never
/// one cut short. The old file's permissions are kept (a `chmod 600` survives a reinstall).
/// Only under [`InstallLock`], whose holder alone writes the temporary file.
pub fn replace(dir: &Path, name: &str, bytes: &[u8], _lock: &InstallLock) -> io::Result<()> {
    let temp = dir.join(format!(".{name}.new"));
    // One found is a crashed install's.
    let _ = std::fs::remove_file(&temp);
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        if let Ok(old) = std::fs::metadata(dir.join(name)) {
            file.set_permissions(old.permissions())?;
        }
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temp, dir.join(name))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written?;
    // The rename itself on disk before the command says it installed.
    let _ = File::open(dir).and_then(|d| d.sync_all());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reinstall keeps the file's permissions and leaves no temporary file, also after
    /// one a crashed install left.
    #[test]
    fn a_replace_keeps_permissions_and_leaves_nothing_behind() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        let lock = InstallLock::take(d).expect("lock");
        replace(d, "manifest", b"m1", &lock).expect("installed");
        let mode = std::fs::Permissions::from_mode(0o600);
        std::fs::set_permissions(d.join("manifest"), mode).expect("chmod");
        std::fs::write(d.join(".manifest.new"), "crashed").expect("left behind");
        replace(d, "manifest", b"m2", &lock).expect("installed again");
        let meta = std::fs::metadata(d.join("manifest")).expect("manifest");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(d.join("manifest")).expect("read"), b"m2");
        let mut names: Vec<_> = std::fs::read_dir(d)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        assert_eq!(names, [LOCK_FILE, "manifest"]);
    }

    /// One install at a time; a lock file that is no regular file (a FIFO would block
    /// the open) is refused at once; one this user may only read still locks.
    #[test]
    fn the_lock_is_one_installs_and_never_blocks_on_a_fifo() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        let held = InstallLock::take(d).expect("lock");
        let file = File::open(d.join(LOCK_FILE)).expect("lock file");
        assert!(
            flock(&file, FlockOperation::NonBlockingLockShared).is_err(),
            "held exclusively"
        );
        drop(held);
        assert!(flock(&file, FlockOperation::NonBlockingLockShared).is_ok());
        drop(file);

        std::fs::set_permissions(d.join(LOCK_FILE), std::fs::Permissions::from_mode(0o444))
            .expect("chmod");
        // Root writes a 0444 file anyway; elsewhere this takes the read-only way. Either
        // way it holds: a second taker is kept out.
        let held = InstallLock::take(d).expect("a read-only lock file locks");
        let file = File::open(d.join(LOCK_FILE)).expect("lock file");
        assert!(
            flock(&file, FlockOperation::NonBlockingLockShared).is_err(),
            "a read-only lock file held"
        );
        drop((held, file));

        let fifo = tempfile::tempdir().expect("temp dir");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            fifo.path().join(LOCK_FILE),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
        let e = InstallLock::take(fifo.path())
            .err()
            .expect("a FIFO is refused");
        assert_eq!(e.to_string(), "not a regular file (a FIFO)");
        // Nor through a link: its target would be created elsewhere.
        let linked = tempfile::tempdir().expect("temp dir");
        let target = linked.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, linked.path().join(LOCK_FILE)).expect("link");
        let e = InstallLock::take(linked.path())
            .err()
            .expect("a link is refused");
        assert_eq!(e.to_string(), "not a regular file (a link)");
        assert!(!target.exists(), "created through the link");
    }
}
