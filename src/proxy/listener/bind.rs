//! Binding the listen sockets and accepting on them: TCP with the proxy's backlog (and
//! `[::]` taking IPv4 too), unix sockets made mode 0660 before anyone can connect, a
//! leftover socket file replaced only when nobody answers on it, and the file removed at
//! the end only while it is still the one this process bound.

use std::io;
use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, UnixListener};

use crate::error::Error;
use crate::proxy::h1::Sock;
use crate::settings::ListenAddr;

pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, SocketFile),
}

/// The path a unix listener made, and which file it was: the path is removed when the
/// listener goes only while it still names that file (another process may have replaced
/// it meanwhile, and its socket must not lose its name).
pub struct SocketFile {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl SocketFile {
    fn new(path: &Path) -> Self {
        SocketFile {
            path: path.to_path_buf(),
            id: file_id(path),
        }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.id.is_some() && file_id(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Device and inode of what `path` names now.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl Listener {
    /// `shown` is `addr` as printed in the error ([`crate::settings::Settings::shown`]).
    pub async fn bind(addr: &ListenAddr, shown: &str) -> Result<Self, Error> {
        let fail = |e: io::Error| Error::Bind {
            addr: shown.to_string(),
            reason: e.to_string(),
        };
        match addr {
            ListenAddr::Tcp(a) => Ok(Listener::Tcp(bind_tcp(*a).map_err(fail)?)),
            ListenAddr::Unix(path) => {
                remove_stale_socket(path).await.map_err(fail)?;
                let l = bind_unix(path).map_err(fail)?;
                // A rename keeps the inode: this is the file that was bound.
                Ok(Listener::Unix(l, SocketFile::new(path)))
            }
        }
    }

    /// The bound address (with the real port when 0 was asked for), as logs show it (a
    /// socket's path as `ListenAddr` shows it).
    pub fn local_addr(&self) -> String {
        match self {
            Listener::Tcp(l) => l.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            Listener::Unix(_, f) => crate::settings::ListenAddr::Unix(f.path.clone()).to_string(),
        }
    }
}

/// Connections the kernel completes and holds for the accept loop (past
/// `--max-connections`, or in a burst). At std's and mio's 128, a burst of 300 at a full
/// proxy left 171 clients retrying their SYNs (1, 3, 7 s …) after slots had freed, where
/// the README says they wait in the accept queue; nginx asks 511, Go the system's
/// `somaxconn`, which caps this.
const BACKLOG: i32 = 1024;

/// A TCP listener as std binds one (`SO_REUSEADDR`), with [`BACKLOG`]. `[::]` takes IPv4
/// connections too, as the README and the Kubernetes manifest say of
/// `--admin-listen=[::]:9464`: left to the host's `net.ipv6.bindv6only`, a host (or a
/// pod's namespace) where it is 1 got an IPv6-only listener, and the IPv4 scrapes a
/// dual-stack cluster sends failed. nginx's `ipv6only=off` and Go's listeners set it so.
fn bind_tcp(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // An IPv4-mapped address (`[::ffff:127.0.0.1]`) is IPv4's: refused (EINVAL) on an
    // IPv6-only socket.
    let mapped = matches!(addr.ip(), std::net::IpAddr::V6(a) if a.to_ipv4_mapped().is_some());
    if addr.is_ipv6() && (addr.ip().is_unspecified() || mapped) {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Binds a unix socket at `path` that is mode 0660 from its first moment there (SPEC §7).
/// Bound in place, the file is 0777 less the umask until a chmod: under umask 000 (common
/// in containers, on a volume shared with the agent's) anyone could connect in between,
/// spend the key, and keep the connection open. The umask is the process's, shared by its
/// threads, so it is not changed: the socket is bound in a private directory beside the
/// path, made 0660 there, and renamed onto the path.
fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    #[cfg(target_os = "linux")]
    {
        if let Some(private) = PrivateDir::beside(path)? {
            return private.bind_onto(path);
        }
    }
    bind_in_place(path)
}

/// Where there is no private directory to bind in (see [`PrivateDir::beside`]: no `/proc`
/// for a path near `sun_path`'s limit), and off Linux: the socket is connectable before its
/// chmod.
fn bind_in_place(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(l)
}

/// `sun_path`'s size: a socket's path must be shorter (it ends with a NUL).
#[cfg(target_os = "linux")]
const SUN_PATH: usize = 108;

/// This process's open descriptors, each a name for what it has open.
#[cfg(target_os = "linux")]
const PROC_FDS: &str = "/proc/self/fd";

/// A directory (mode 0700) in the socket path's own directory, so that the rename stays on
/// one filesystem; only its owner can reach a socket in it. Removed on drop, with the
/// socket's name in it if that was not renamed away, whether the bind succeeded or not.
#[cfg(target_os = "linux")]
struct PrivateDir {
    dir: PathBuf,
    socket: PathBuf,
    /// The directory, open while the socket is named through it (see [`PrivateDir::at`]).
    handle: Option<std::fs::File>,
}

#[cfg(target_os = "linux")]
impl PrivateDir {
    /// `None` for a path too long for a bind anywhere, which must fail as it did, not be
    /// renamed into place; and for one near the limit (the directory's `.abx-` and six
    /// letters, then `/s`, would not fit) where there is no `/proc` to name the socket
    /// through (see [`PrivateDir::at`]): such a path is bound in place.
    fn beside(path: &Path) -> io::Result<Option<Self>> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
            return Ok(None);
        };
        if path.as_os_str().len() >= SUN_PATH {
            return Ok(None);
        }
        let by_path = parent.join(".abx-XXXXXX/s").as_os_str().len() < SUN_PATH;
        if !by_path && !Path::new(PROC_FDS).is_dir() {
            return Ok(None);
        }
        for _ in 0..8 {
            let name: String = std::iter::repeat_with(fastrand::alphanumeric)
                .take(6)
                .collect();
            let dir = parent.join(format!(".abx-{name}"));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    let made = PrivateDir::at(dir)?;
                    // The umask may have taken the owner's own write bit (0277 leaves
                    // 0500), and with it the socket's bind in there.
                    let mode = std::fs::Permissions::from_mode(0o700);
                    std::fs::set_permissions(&made.dir, mode)?;
                    return Ok(Some(made));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "no free name for a private directory beside the socket",
        ))
    }

    /// The socket's name in `dir` (just made): by the directory's path, or where that would
    /// not fit in `sun_path`, through this process's descriptor of the directory
    /// (`/proc/self/fd/N/s`, short whatever the path's length). Bound in place instead, a
    /// path of 95 to 107 bytes was connectable before its chmod.
    fn at(dir: PathBuf) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        let socket = dir.join("s");
        let mut made = PrivateDir {
            dir,
            socket,
            handle: None,
        };
        if made.socket.as_os_str().len() >= SUN_PATH {
            // Removed on drop should the open fail.
            let handle = std::fs::File::open(&made.dir)?;
            made.socket = Path::new(PROC_FDS).join(format!("{}/s", handle.as_raw_fd()));
            made.handle = Some(handle);
        }
        Ok(made)
    }

    /// Binds here, chmods, and renames the socket onto `path`, never over a file there: one
    /// another process bound since the stale check keeps its name, and the bind fails as a
    /// bind in place would have.
    fn bind_onto(self, path: &Path) -> io::Result<UnixListener> {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        use rustix::io::Errno;
        use std::os::unix::fs::PermissionsExt;
        let l = UnixListener::bind(&self.socket)?;
        std::fs::set_permissions(&self.socket, std::fs::Permissions::from_mode(0o660))?;
        let moved = match renameat_with(CWD, &self.socket, CWD, path, RenameFlags::NOREPLACE) {
            // A filesystem (or kernel) without RENAME_NOREPLACE: link(2) does not replace
            // either, and the private name goes with the directory.
            Err(Errno::INVAL | Errno::NOSYS) => std::fs::hard_link(&self.socket, path),
            moved => moved.map_err(io::Error::from),
        };
        match moved {
            Ok(()) => Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(Errno::ADDRINUSE.into()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(target_os = "linux")]
impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A socket file nobody listens on is left over from a crash: replace it. One somebody
/// answers on is in use.
async fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    // Only a socket can be stale. A connect to any other file fails as it does to a dead
    // socket, so a mistyped `--listen unix:~/notes.txt` used to delete the user's file.
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket",
        ));
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(_) => Err(io::Error::new(io::ErrorKind::AddrInUse, "socket in use")),
        // Nobody listens: left over from a crash.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        // EAGAIN is a live listener with a full accept queue (this proxy leaves excess
        // connections there at --max-connections); EACCES, one we may not use.
        Err(e) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("socket may be in use ({e})"),
        )),
    }
}

/// Whether a connection waits in the kernel's accept queue: a readiness check that takes
/// none (`poll` with no wait), for the accept loop to know that a client waits for a slot.
pub(super) fn has_waiting(listener: &Listener) -> bool {
    use std::os::fd::AsFd;
    let fd = match listener {
        Listener::Tcp(l) => l.as_fd(),
        Listener::Unix(l, _) => l.as_fd(),
    };
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let now = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(n) if n > 0)
}

pub(super) async fn accept(listener: &Listener) -> io::Result<Sock> {
    match listener {
        Listener::Tcp(l) => {
            let (s, _) = l.accept().await?;
            let _ = s.set_nodelay(true);
            Ok(Sock::Tcp(s))
        }
        Listener::Unix(l, _) => {
            let (s, _) = l.accept().await?;
            Ok(Sock::Unix(s))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a directory holds, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("read the directory")
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    }

    /// A socket another process binds at the path after the stale check (`bind_unix` is
    /// what comes after it) keeps its name: the rename onto the path refuses to replace
    /// it, the bind fails as a bind in place would (address in use), and the private
    /// directory is gone.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_socket_bound_at_the_path_meanwhile_keeps_it() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("abx.sock");
        let owner = std::os::unix::net::UnixListener::bind(&path).expect("the owner's bind");
        let ino = std::fs::metadata(&path).expect("the owner's socket").ino();

        let refused = bind_unix(&path)
            .map(drop)
            .expect_err("bound over the owner's socket");
        assert_eq!(refused.kind(), io::ErrorKind::AddrInUse, "{refused}");
        assert_eq!(std::fs::metadata(&path).expect("still named").ino(), ino);
        std::os::unix::net::UnixStream::connect(&path).expect("the owner still answers");
        assert_eq!(
            names(dir.path()),
            ["abx.sock"],
            "a private directory was left"
        );
        drop(owner);
    }

    /// A path that fits in `sun_path` while the private directory's path would not is
    /// bound in the private directory all the same (named through `/proc/self/fd`), and
    /// renamed into place: it was bound in place, connectable before its chmod. The
    /// directory's events show which: a rename brings the name, no bind creates it there.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_path_near_the_length_limit_is_bound_in_a_private_directory_too() {
        use rustix::fs::inotify::{self, ReadFlags, WatchFlags};
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let base = dir.path().as_os_str().len();
        // The socket's path is 107 bytes, the longest that fits.
        let deep = dir.path().join("d".repeat(SUN_PATH - base - 4));
        std::fs::create_dir(&deep).expect("mkdir");
        let path = deep.join("s");
        assert_eq!(path.as_os_str().len(), SUN_PATH - 1);
        let events = inotify::init(inotify::CreateFlags::NONBLOCK).expect("inotify");
        let watched = WatchFlags::CREATE | WatchFlags::MOVED_TO;
        inotify::add_watch(&events, &deep, watched).expect("watch");

        let listener = bind_unix(&path).expect("bound");
        let mode = std::fs::metadata(&path)
            .expect("the socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o660);
        std::os::unix::net::UnixStream::connect(&path).expect("it answers");
        assert_eq!(names(&deep), ["s"]);
        let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
        let mut reader = inotify::Reader::new(&events, &mut buf);
        let mut seen = Vec::new();
        while let Ok(e) = reader.next() {
            let name = e.file_name().map(|n| n.to_string_lossy().into_owned());
            seen.push((e.events() & (ReadFlags::CREATE | ReadFlags::MOVED_TO), name));
        }
        let (created, moved) = (ReadFlags::CREATE, ReadFlags::MOVED_TO);
        let s = Some("s".to_string());
        assert!(seen.contains(&(moved, s.clone())), "{seen:?}");
        assert!(!seen.contains(&(created, s)), "bound in place: {seen:?}");
        drop(listener);
    }

    /// A private directory's name already taken (by a crashed run's leftover, or another
    /// proxy binding beside it) is passed over for the next, and left alone.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_private_directory_name_taken_is_passed_over() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("abx.sock");
        fastrand::seed(7);
        let first: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(6)
            .collect();
        let taken = format!(".abx-{first}");
        std::fs::create_dir(dir.path().join(&taken)).expect("mkdir");

        fastrand::seed(7);
        let listener = bind_unix(&path).expect("bound under the next name");
        std::os::unix::net::UnixStream::connect(&path).expect("it answers");
        assert_eq!(names(dir.path()), [taken.as_str(), "abx.sock"]);
        drop(listener);
    }

    /// A socket path in a directory that does not exist fails as a bind there would, not
    /// with a story about private directories.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_socket_in_a_missing_directory_fails_as_its_bind_would() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("missing").join("abx.sock");
        let e = bind_unix(&path).map(drop).expect_err("bound nowhere");
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }
}
