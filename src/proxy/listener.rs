//! Listeners: TCP or unix socket, optional TLS, HTTP/1.1 and HTTP/2 (h2c by prior knowledge
//! or ALPN), the connection limit, the idle timeout, the framing watch, and the graceful
//! drain.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONNECTION, CONTENT_LENGTH};
use http::{HeaderValue, Method, Request, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use super::framing::{self, HeadWatch, Verdicts};
use super::h1::{self, Sock, StdSock};
use super::handler::GaveUp;
use super::headers;
use super::route::PlainOnTls;
use super::Proxy;
use crate::error::Error;
use crate::metrics::GaugeGuard;
use crate::settings::ListenAddr;
use crate::workers::Workers;

/// Request heads larger than this get 431 (SPEC §4).
pub const MAX_HEAD: usize = 64 * 1024;

/// Request heads with more header lines than this get 431 (hyper's default, set here so it
/// is a decision, not an accident; Apache's `LimitRequestFields` default too).
pub const MAX_HEADERS: usize = 100;

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

    /// The bound address (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> String {
        match self {
            Listener::Tcp(l) => l.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            Listener::Unix(_, f) => format!("unix:{}", f.path.display()),
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
        use std::os::unix::fs::DirBuilderExt;
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
                Ok(()) => return PrivateDir::at(dir).map(Some),
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

/// How connections are served.
pub struct ServeConfig {
    pub tls: Option<TlsAcceptor>,
    pub idle_timeout: Duration,
    /// `--header-timeout`: the time a client may take to send a request head.
    pub header_timeout: Duration,
    pub max_connections: usize,
}

/// Accepts until `stop` turns true. Every connection task holds a clone of `stop`: the
/// drain is over when the sender sees no receivers left (see [`drain`]).
pub async fn accept_loop(
    listener: Listener,
    proxy: Arc<Proxy>,
    config: ServeConfig,
    workers: Workers,
    mut stop: watch::Receiver<bool>,
) {
    let builder = Arc::new(http_builder(&config));
    let limit = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let config = Arc::new(config);
    let mut failing = AcceptFailures::new("proxy");
    let mut full_warned: Option<Instant> = None;
    for turn in 0.. {
        // Beyond the limit new connections wait in the kernel's accept queue.
        let permit = match limit.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::Closed) => break,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                // Said, at most once a minute, as nginx says "worker_connections are not
                // enough": otherwise a full proxy only looks slow.
                if full_warned.is_none_or(|w| w.elapsed() >= AcceptFailures::EVERY) {
                    tracing::warn!(
                        connections = config.max_connections,
                        "every connection slot is in use: new connections wait in the \
                         kernel's accept queue until one closes (--max-connections, or \
                         what the open-file limit leaves room for)"
                    );
                    full_warned = Some(Instant::now());
                }
                tokio::select! {
                    p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        };
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = stop.wait_for(|s| *s) => break,
        };
        // Unregistered from this thread's runtime, registered with the worker's below.
        let sock = match accepted.and_then(Sock::into_std) {
            Ok(s) => {
                failing.recovered();
                s
            }
            Err(e) => {
                failing.failed(&e).await;
                continue;
            }
        };
        let task = connection_task(
            sock,
            permit,
            proxy.clone(),
            builder.clone(),
            config.clone(),
            stop.clone(),
        );
        workers.spawn(turn, task);
    }
}

/// Failed accepts in a row. Out of descriptors, every accept fails until one is freed,
/// and one warning per try (20 a second) buried everything else: the first failure of a
/// run is a warning that says what to do, then one a minute while it lasts, and the end
/// of a run that warned is said too. The minute spans runs: descriptors hovering at the
/// limit end a run and start the next many times a second, and each run's warning and
/// end were two lines each time.
pub(crate) struct AcceptFailures {
    /// Which listener, for the log lines: `proxy` or `admin`.
    listener: &'static str,
    /// The start of the current run.
    run: Option<Instant>,
    /// Failures since the last warning, over runs.
    since_warning: u64,
    warned: Option<Instant>,
}

impl AcceptFailures {
    const EVERY: Duration = Duration::from_secs(60);

    pub(crate) fn new(listener: &'static str) -> Self {
        AcceptFailures {
            listener,
            run: None,
            since_warning: 0,
            warned: None,
        }
    }

    /// Logs as said above, then waits a moment: EMFILE and friends leave the listener
    /// readable, and the next accept would fail at once, spinning.
    pub(crate) async fn failed(&mut self, e: &io::Error) {
        self.log(e, Instant::now());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    fn log(&mut self, e: &io::Error, now: Instant) {
        self.run.get_or_insert(now);
        let due = self.warned.is_none_or(|w| now - w >= Self::EVERY);
        if !due {
            self.since_warning += 1;
            tracing::debug!(listener = self.listener, error = %e, "accept failed again");
            return;
        }
        tracing::warn!(
            listener = self.listener,
            error = %e,
            failed_since_last_warning = self.since_warning,
            "accept failed: new connections wait in the kernel's queue; if the process is out \
             of descriptors, raise its open-file limit (LimitNOFILE=, ulimit -n) or lower \
             --max-connections"
        );
        self.since_warning = 0;
        self.warned = Some(now);
    }

    pub(crate) fn recovered(&mut self) {
        let Some(since) = self.run.take() else {
            return;
        };
        let failing_s = since.elapsed().as_secs_f64();
        if self.warned.is_some_and(|w| w >= since) {
            tracing::info!(
                listener = self.listener,
                failing_s,
                "accepting connections again"
            );
        } else {
            tracing::debug!(
                listener = self.listener,
                failing_s,
                "accepting connections again"
            );
        }
    }
}

/// What makes a client connection count while it is open: its place under
/// `--max-connections`, in `abx_proxy_open_connections`, and in the drain (which ends when
/// the last receiver of `stop` is gone, see [`drain`]).
///
/// Shared: after an HTTP Upgrade hyper's connection is over and the connection's task ends,
/// but the connection lives on as a tunnel (see `tunnel::run`), which keeps a clone.
/// Released when both are done, so a drain waits for live tunnels too.
pub(super) struct OpenConnection {
    _permit: OwnedSemaphorePermit,
    _counted: GaugeGuard,
    stop: watch::Receiver<bool>,
}

/// Everything a connection's task holds for its whole life. Its size is paid by every open
/// connection, idle ones included (see the test `a_connection_task_stays_small`).
async fn connection_task(
    sock: StdSock,
    permit: OwnedSemaphorePermit,
    proxy: Arc<Proxy>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    config: Arc<ServeConfig>,
    stop: watch::Receiver<bool>,
) {
    // This task's share is dropped only once its access lines are out: the drain ends when
    // the last receiver is gone, and the process with it.
    let open = Arc::new(OpenConnection {
        _permit: permit,
        _counted: GaugeGuard::new(&proxy.metrics.open_connections),
        stop,
    });
    let Ok(sock) = Sock::from_std(sock) else {
        return;
    };
    let activity = Activity::new();
    let told = Told::default();
    // The end of the drain's grace (see `Proxy::abort`). Boxed: inline, its state would
    // add about 170 bytes to every connection's task, idle or not.
    let mut aborting = proxy.aborting.subscribe();
    let cutting = &activity;
    let aborted = Box::pin(async move {
        let _ = aborting.wait_for(|a| *a).await;
        cutting.clocks.cut.store(CUT_DRAIN, Ordering::Relaxed);
    });
    let serving = connection(sock, &proxy, &config, &builder, &activity, &told, &open);
    tokio::select! {
        _ = serving => {}
        _ = watchdog(&activity, &told, &config) => {}
        () = aborted => {}
    }
    activity.cut_parked();
    // A head begun and not finished in time, cut by the watchdog or the fast path's own
    // timer, is logged and counted 408 as nginx logs one: otherwise slow heads left no
    // trace but the open-connections gauge. So is one the watchdog found stalled for
    // `--idle-timeout` (shorter than `--header-timeout`), whoever closed its connection
    // then (an idle HTTP/2 one may close itself after its GOAWAY): not one held back
    // behind an answer (the watchdog clears those). Here, not in either: the
    // watchdog's state is paid by every connection. No time observed, as for the heads
    // hyper refuses: the request latency histogram is for requests that were made.
    let stalled = match told.stalled.load(Ordering::Relaxed) {
        0 => false,
        mark => activity.clocks.head.load(Ordering::Relaxed) == mark,
    };
    if stalled || head_timed_out(&activity, &told, &config) {
        // Logged with the head's time, from where its timeout counts to the cut, as
        // nginx's `$request_time` of a 408.
        let began = head_from(&activity, &told).unwrap_or(activity.opened);
        // A block begun after the cut began (behind the idle GOAWAY) ends with the
        // connection.
        let cut = match activity.clocks.cut_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(activity.opened + Duration::from_millis(ms - 1)),
        };
        let cut = cut.filter(|cut| *cut > began).unwrap_or_else(Instant::now);
        let took = cut.saturating_duration_since(began);
        proxy.head_refused(StatusCode::REQUEST_TIMEOUT, took);
    }
    crate::logging::flush_thread();
    drop(open);
}

/// How long an idle HTTP/2 connection has, once its GOAWAY is sent, to be closed
/// gracefully (hyper waits for the client's answer to a PING) before it is cut.
const GOAWAY_WAIT: Duration = Duration::from_secs(1);

/// What a connection's serving code and its task's watchdog tell each other.
#[derive(Default)]
struct Told {
    /// A request head has arrived: the first-head deadline no longer applies.
    headed: AtomicBool,
    /// The watchdog found an HTTP/2 connection idle.
    idle: Notify,
    /// The watchdog found the connection idle with a head begun: that head's mark
    /// ([`Clocks::head`]), 0 for none. It stalled, and the connection closes with it unless
    /// it ends meanwhile (see [`connection_task`]): a head begun later has another mark.
    stalled: AtomicU64,
}

/// One client connection: the HTTP/1.1 fast path for plain sockets, hyper for TLS and for
/// whatever the fast path hands over.
async fn connection(
    sock: Sock,
    proxy: &Arc<Proxy>,
    config: &ServeConfig,
    builder: &auto::Builder<TokioExecutor>,
    activity: &Activity,
    told: &Told,
    open: &Arc<OpenConnection>,
) {
    let mut stop = open.stop.clone();
    // Set for plain HTTP on the TLS listener: every request on it is refused.
    let mut plain = None;
    let io: Box<dyn Io> = match &config.tls {
        None => {
            let ctx = h1::Ctx {
                proxy,
                activity,
                headed: &told.headed,
                header_timeout: config.header_timeout,
            };
            match h1::serve(sock, ctx, &mut stop).await {
                h1::Outcome::Closed => return,
                h1::Outcome::HandOver(sock, prefix) => Box::new(h1::Rewind::new(sock, prefix)),
            }
        }
        Some(acceptor) => {
            // No timer of its own: the watchdog's first-head deadline (`--header-timeout`)
            // covers the handshake, as nginx's `client_header_timeout` does. A drain does
            // not wait for it: there is no request yet. Boxed, as the hyper part below.
            let stop = &mut stop;
            let handshake = Box::pin(async move {
                tokio::select! {
                    io = tls_or_plain(acceptor, sock, &proxy.metrics) => io,
                    _ = stop.wait_for(|s| *s) => None,
                }
            });
            match handshake.await {
                Some((io, refused)) => {
                    plain = refused;
                    io
                }
                None => return,
            }
        }
    };
    // with_hyper watches the drain with its own receiver: this one would stay in the
    // task's state for the connection's life.
    drop(stop);
    Box::pin(with_hyper(io, proxy, builder, activity, told, open, plain)).await
}

/// The TLS listener's connection, marked when it is plain HTTP instead. TLS opens with a
/// handshake record (0x16); a request method's capital letter is an `http://` URL for this
/// listener, whose requests hyper reads so that each is refused with what to change (as
/// nginx answers "The plain HTTP request was sent to HTTPS port"): rustls would answer an
/// alert, which curl shows as an empty reply or HTTP/0.9 and the SDKs as a bare connection
/// error. Any other byte goes to rustls, which refuses it.
///
/// A handshake that fails is counted (`abx_proxy_tls_handshake_failures_total`) and said
/// at `debug` only: any client can fail one at will, and every failure a line at `info`
/// would be theirs to write; a count that climbs after a certificate's renewal is the
/// operator's sign that clients refuse it.
async fn tls_or_plain(
    acceptor: &TlsAcceptor,
    sock: Sock,
    metrics: &crate::metrics::Metrics,
) -> Option<(Box<dyn Io>, Option<PlainOnTls>)> {
    let first = h1::first_byte(&sock).await?;
    let sock = h1::Rewind::new(sock, Bytes::copy_from_slice(&[first]));
    if first.is_ascii_uppercase() {
        return Some((Box::new(sock), Some(PlainOnTls)));
    }
    match acceptor.accept(sock).await {
        Ok(tls) => Some((Box::new(tls), None)),
        Err(e) => {
            metrics.tls_handshake_failures.inc();
            tracing::debug!(error = %e, "a client's TLS handshake failed");
            None
        }
    }
}

/// hyper serves the rest of the connection. Boxed by the caller: its state is kilobytes,
/// and an unboxed one would size every fast-path connection's task.
async fn with_hyper(
    io: Box<dyn Io>,
    proxy: &Arc<Proxy>,
    builder: &auto::Builder<TokioExecutor>,
    activity: &Activity,
    told: &Told,
    open: &Arc<OpenConnection>,
    plain: Option<PlainOnTls>,
) {
    let mut stop = open.stop.clone();
    // A fresh watch: the fast path hands over at the start of a head.
    let (io, verdicts) = IdleIo::new(io, activity.clone());
    // Whether hyper has begun a request on this connection (see the drain below).
    let begun = &AtomicBool::new(false);
    let cancels = Arc::new(Cancels::default());
    let watched = cancels.clone();
    let service = service_fn(move |mut req: Request<Incoming>| {
        told.headed.store(true, Ordering::Relaxed);
        begun.store(true, Ordering::Relaxed);
        let guard = Cancels::begin(&watched);
        if headers::is_upgrade_request(&req) {
            // Should the upstream switch protocols, the tunnel outlives this task and keeps
            // the connection counted (see [`OpenConnection`]).
            req.extensions_mut().insert(open.clone());
        }
        if let Some(plain) = plain {
            req.extensions_mut().insert(plain);
        }
        let verdict = verdicts.next_verdict();
        if let Some(why) = verdict.refusal {
            // A head over the limit is framed like any other: the handler answers 431.
            if why != framing::Refusal::HeadTooLarge {
                req.extensions_mut().insert(framing::AmbiguousLength);
            }
            req.extensions_mut().insert(why);
        }
        let connect = req.method() == Method::CONNECT;
        let head = req.method() == Method::HEAD;
        let http2 = req.version() == http::Version::HTTP_2;
        let http10 = req.version() == http::Version::HTTP_10;
        let stream = http2.then(|| activity.open_stream());
        let idle = proxy.idle_timeout;
        // The upload's progress, when there is one: on HTTP/2 for its answer's idle limit
        // (see `IdleLimited`), on HTTP/1 whether it had ended when the answer came.
        let mut upload = None;
        let req = if http2 {
            let mut req =
                req.map(|b| super::body::marked(super::body::EndStreamed::request(b), &mut upload));
            // For the handler: a client that resets its stream mid-upload is gone.
            if let Some(moved) = &upload {
                req.extensions_mut().insert(moved.clone());
            }
            req
        } else {
            req.map(|b| super::body::marked(b, &mut upload))
        };
        // For the answer's `answer cut` line, should the proxy cut it (see `AnswerCut`).
        let uri = req.uri().clone();
        // Boxed: hyper keeps the service future's slot for the connection's whole life,
        // so an unboxed one (about 1.7 KB, held twice by this wrapper) stays resident on every
        // idle keep-alive connection; boxed, it lives only while a request does.
        let handled = Box::pin(proxy.clone().handle(req));
        let waiting = activity.awaiting();
        let answering = activity.clone();
        async move {
            let mut resp = handled.await?;
            // The client gave the request up: a cancel, as if hyper had dropped it.
            if resp.extensions().get::<GaveUp>().is_some() {
                return Ok(resp);
            }
            guard.answered();
            drop(waiting);
            let status = resp.status();
            let tunnel =
                status == StatusCode::SWITCHING_PROTOCOLS || (connect && status.is_success());
            // A refusal: what follows on this connection was framed by a guess. The last
            // request the watch followed, answered without a tunnel: hyper would read on,
            // and the rest would pass unchecked (see `framing`). Plain HTTP on the TLS
            // listener: nothing on it will be served. An HTTP/1 upload not read to its end
            // (a client's stalled body refused, an early answer): hyper drops the rest and
            // closes, as the fast path does, and says so.
            let unread = !http2 && upload.as_ref().is_some_and(|m| !m.ended());
            let last = verdict.last || unread;
            // An answer of no known length reaches an HTTP/1.0 client delimited by the
            // close (RFC 9112 §6.3), and hyper still told a keep-alive client
            // `Connection: keep-alive`: it would send its next request into a closing
            // connection, or wait there for more.
            let close_delimited = http10
                && !resp.headers().contains_key(CONTENT_LENGTH)
                && http_body::Body::size_hint(resp.body()).exact().is_none();
            if verdict.refusal.is_some()
                || plain.is_some()
                || ((last || close_delimited) && !tunnel)
            {
                resp.headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
                if http10 {
                    // hyper adds `keep-alive` to a 1.1 answer for a 1.0 client that asked
                    // for it (`close, keep-alive`); an answer in the client's own version
                    // it closes as the header says.
                    *resp.version_mut() = http::Version::HTTP_10;
                }
            }
            let unsent = body_unsent(head, status);
            if unsent && http2 && !http_body::Body::is_end_stream(resp.body()) {
                // hyper's HTTP/2 server sends what the body holds, as DATA that such an
                // answer may not carry (curl and h2 reset the stream: PROTOCOL_ERROR).
                resp = resp.map(|_| super::body::empty());
            }
            // See `IdleLimited`: HTTP/1.1 answers have the connection's idle timeout.
            if !tunnel && !unsent && !http_body::Body::is_end_stream(resp.body()) {
                let cut = AnswerCut::new(&answering, uri);
                resp = resp.map(|b| {
                    use super::body::{boxed, CutLogged, IdleLimited};
                    if http2 {
                        boxed(CutLogged::new(
                            IdleLimited::new(b, idle, upload, stream),
                            cut,
                        ))
                    } else {
                        boxed(CutLogged::http1(b, cut))
                    }
                });
            } else if !tunnel && !http2 {
                // No body to end: hyper never polls it, and the head alone may wait in its
                // buffer for a client that does not read (see `AnswerCut::written_later`).
                AnswerCut::new(&answering, uri).written_later();
            }
            Ok::<_, Infallible>(resp)
        }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let draining = tokio::select! {
        // The connection first: a head already in its buffer is a request to finish.
        biased;
        done = conn.as_mut() => return refused_by_hyper(proxy, done),
        _ = stop.wait_for(|s| *s) => true,
        () = told.idle.notified() => false,
        () = cancels.abusive.notified() => return said_rapid_reset(),
    };
    if draining {
        // Bytes already in the socket are a request sent before the drain began, which
        // the runtime had not reported yet (see `h1::serve`): one turn of its driver, and
        // hyper reads them, and begins that request, before being told to finish.
        tokio::task::yield_now().await;
        if let Some(done) = conn.as_mut().now_or_never() {
            return refused_by_hyper(proxy, done);
        }
    }
    // Nothing begun: no request to finish. hyper's graceful shutdown would wait for a
    // first HTTP/1 head, up to the watchdog's deadline, so the connection just closes.
    // An HTTP/2 one that has its preface is open for requests: it is told GOAWAY.
    if !begun.load(Ordering::Relaxed) && !activity.is_http2() {
        return;
    }
    // Draining, or an idle HTTP/2 connection, or an idle HTTP/1 one over TLS (see
    // [`watchdog`]): finish what is in flight (GOAWAY), take no new request.
    let heard = activity.reads();
    conn.as_mut().graceful_shutdown();
    if !activity.is_http2() {
        let _ = conn.await;
        return;
    }
    // hyper ends an HTTP/2 connection once its streams have and the client has answered
    // the PING sent with the GOAWAY. A client that no longer reads never answers, and held
    // the drain for the whole grace with nothing left to finish.
    // Nor does it stop the rapid-reset bound: an idle connection's client that leaves the
    // PING unanswered can still open streams, while one of them keeps it busy.
    tokio::select! {
        biased;
        _ = conn.as_mut() => {}
        () = settled(activity, GOAWAY_WAIT, heard) => {}
        () = cancels.abusive.notified() => said_rapid_reset(),
    }
}

/// An answer to HEAD, a 204 or a 304 has no body on the wire, whatever its body holds
/// (the proxy's own error answers hold JSON): on HTTP/1 hyper never polls it, so its end
/// is never seen (see [`AnswerCut::written_later`]); on HTTP/2 it would send it.
fn body_unsent(head: bool, status: StatusCode) -> bool {
    head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED
}

#[cold]
fn said_rapid_reset() {
    tracing::warn!(
        cancelled = MAX_CANCELLED,
        "closing a connection whose client cancelled most of its requests before their answer (HTTP/2 rapid reset)"
    );
}

/// Resolves once a draining HTTP/2 connection's client is gone and nothing is left to
/// finish: the client has sent nothing since the GOAWAY (`heard`: [`Activity::reads`]
/// then; one that reads answers hyper's PING at once), no stream is open, no answer's bytes
/// wait for room in the socket, and none have moved for `wait` ([`GOAWAY_WAIT`]). A client
/// that answers is left to hyper, and to the grace: h2 holds an answer's last bytes past
/// its stream's end while the client's flow-control window is shut (a client taking its
/// time to consume them), which none of the rest can see. Checked once a `wait`: this runs
/// only on connections being closed.
async fn settled(activity: &Activity, wait: Duration, heard: u32) {
    let goaway = Instant::now();
    loop {
        if activity.reads() != heard {
            return std::future::pending().await;
        }
        let quiet = activity.last_moved().max(goaway) + wait;
        let now = Instant::now();
        let clocks = &activity.clocks;
        let busy = clocks.streams.load(Ordering::Relaxed) != 0
            || clocks.write_blocked.load(Ordering::Relaxed)
            || clocks.flush_blocked.load(Ordering::Relaxed);
        if now >= quiet && !busy {
            return;
        }
        let next = if now < quiet { quiet } else { now + wait };
        tokio::time::sleep_until(next.into()).await;
    }
}

/// Requests a client may cancel before their answer on one connection, when they are at
/// least half of its requests, before the connection is closed. HTTP/2's rapid reset
/// (CVE-2023-44487), paced to stay under h2's own limit on resets it has not yet handed
/// over, makes the proxy begin one upstream exchange per cancelled stream, the key
/// attached, at the client's rate; envoy closes such connections likewise.
const MAX_CANCELLED: u32 = 100;

/// Only a request cancelled this soon counts (envoy's `premature_reset_min_stream_lifetime`):
/// an SDK whose requests time out against a slow control plane is no rapid reset, and its
/// connection was cut with its other requests on it.
const PREMATURE: Duration = Duration::from_secs(1);

/// A connection's requests on hyper's path, and those dropped before their answer.
#[derive(Default)]
struct Cancels {
    begun: AtomicU32,
    cancelled: AtomicU32,
    abusive: Notify,
}

impl Cancels {
    fn begin(this: &Arc<Cancels>) -> CancelGuard {
        this.begun.fetch_add(1, Ordering::Relaxed);
        CancelGuard(Some((this.clone(), Instant::now())))
    }
}

/// Counts its request as cancelled, when dropped within [`PREMATURE`] of its beginning,
/// unless [`CancelGuard::answered`] is called first (the handler's own `Unanswered` logs
/// the same event as 499).
struct CancelGuard(Option<(Arc<Cancels>, Instant)>);

impl CancelGuard {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let Some((c, begun)) = self.0.take() else {
            return;
        };
        if begun.elapsed() >= PREMATURE {
            return;
        }
        let cancelled = c.cancelled.fetch_add(1, Ordering::Relaxed) + 1;
        if cancelled >= MAX_CANCELLED && cancelled * 2 >= c.begun.load(Ordering::Relaxed) {
            c.abusive.notify_one();
        }
    }
}

/// A head hyper refused before it became a request (one it cannot parse, or over the size
/// or field limits): hyper answered 400 or 431 itself and the handler never saw it. It gets
/// its access line and its count all the same (`method` and `path` unknown: `-`), as nginx
/// logs its 400s; otherwise a client told "400" finds no trace of it in the proxy.
#[cold]
fn refused_by_hyper(proxy: &Proxy, done: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    let Some(e) = done.err() else { return };
    let Some(e) = e.downcast_ref::<hyper::Error>() else {
        return;
    };
    let status = if e.is_parse_too_large() {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    } else if e.is_parse_version_h2() {
        // The HTTP/2 preface after an HTTP/1 request: hyper closes without an answer, and
        // a line would tell of a 400 that no client was sent.
        return;
    } else if e.is_parse() {
        StatusCode::BAD_REQUEST
    } else {
        return;
    };
    proxy.head_refused(status, Duration::ZERO);
}

pub fn http_builder(config: &ServeConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    // hyper's header timer starts when it begins to wait for a head, idle or not: at
    // --header-timeout it closed keep-alive connections idle between requests long before
    // --idle-timeout, and a client whose pool kept one longer raced the close and lost the
    // request it sent just then. The watchdog times heads from their first byte instead;
    // hyper's timer is left only for a head the framing watch no longer follows (after a
    // refused CONNECT or upgrade), and fires after the watchdog would have. Not at the
    // same time: started as an answer's last byte went out, it ran out on the same tick
    // as the idle deadline (when that is the longer one, as by default), and an idle TLS
    // connection then ended without its close_notify in most runs.
    let backstop = config.header_timeout.max(config.idle_timeout) + 2 * GOAWAY_WAIT;
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(backstop)
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEAD)
        .keep_alive(true);
    // No keep-alive pings: hyper sends them whether or not a stream is open, and the
    // connection's idle clock counts them as traffic, so an idle HTTP/2 connection would
    // never reach --idle-timeout. A dead peer is found by that timeout instead.
    // hyper's defaults allow 200 streams with 400 KiB of answer buffered for each: a
    // client that opens them all and reads nothing held ~160 MiB per connection (each
    // stream also holds an upstream connection). 100 streams (envoy's and nginx's
    // figure) with 64 KiB each, beside the upstream reads each holds (see `pool`'s
    // `MAX_READ`), bound it to ~19 MiB, until `--idle-timeout` (`body::IdleLimited`).
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(H2_MAX_HEAD_LIST as u32)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_send_buf_size(H2_SEND_BUF);
    b
}

/// The HTTP/2 layer's own limit on a request head. Over [`MAX_HEAD`] the handler answers
/// 431 itself, logged and counted as HTTP/1's is; the layer's 431 reaches neither, so its
/// limit is set above ours, bounded all the same: a head up to it is decoded whole before
/// it is refused (h2 ends the connection over four times it).
const H2_MAX_HEAD_LIST: usize = 4 * MAX_HEAD;

/// Streams one HTTP/2 client connection may have open at once.
const H2_MAX_STREAMS: u32 = 100;
/// Answer bytes buffered per HTTP/2 stream for a client that does not read them.
const H2_SEND_BUF: usize = 64 * 1024;

pub(crate) trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

async fn accept(listener: &Listener) -> io::Result<Sock> {
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

/// A connection's clocks, shared by the fast path, [`IdleIo`], [`idle`] and the
/// [`watchdog`].
#[derive(Clone)]
pub struct Activity {
    opened: Instant,
    clocks: Arc<Clocks>,
}

/// What [`Activity`] shares, in one allocation; times in milliseconds since the connection
/// opened.
#[derive(Default)]
struct Clocks {
    /// When the connection's bytes last moved: the idle timeout's clock.
    last: AtomicU64,
    /// Requests waiting for their answer's head (see [`Activity::awaiting`]).
    waiting: AtomicU32,
    /// When the request head hyper is reading began, plus one; 0 while none is (see
    /// [`Activity::heading`]).
    head: AtomicU64,
    /// See [`Activity::is_http2`].
    http2: AtomicBool,
    /// HTTP/2 streams whose answer has not ended (see [`Activity::open_stream`]).
    streams: AtomicU32,
    /// Answers whose body has not ended (each an [`AnswerCut`]'s life).
    answers: AtomicU32,
    /// See [`Activity::reads`].
    reads: AtomicU32,
    /// The last write found the socket full: bytes of an answer are still to go out.
    write_blocked: AtomicBool,
    /// The last flush could not finish: over TLS, bytes wait in rustls' buffer.
    flush_blocked: AtomicBool,
    /// Why the proxy is cutting the connection (see [`AnswerCut`]); 0 while it is not.
    cut: AtomicU8,
    /// How an answer ended short on the fast path, whose writer only says whether the
    /// connection may go on (see [`AnswerCut::fell_short`]).
    upstream_broke: AtomicBool,
    client_broke: AtomicBool,
    /// When the watchdog began to cut the connection, in [`Activity::now_ms`] plus one; 0
    /// while it has not. A 408's time ends there, not after the GOAWAY's wait. Here, not
    /// in [`Told`]: every connection's task holds that inline.
    cut_ms: AtomicU64,
    /// An HTTP/1 answer hyper has whole but may not have written yet (see
    /// [`AnswerCut::written_later`]), and whether there is one. Boxed: every connection
    /// holds the slot, idle ones included, and few ever fill it.
    parked: std::sync::Mutex<Option<Box<(http::Uri, Instant)>>>,
    has_parked: AtomicBool,
}

/// What [`Clocks::cut`] holds.
const CUT_IDLE: u8 = 1;
const CUT_DRAIN: u8 = 2;
/// An HTTP/2 connection cut for a header block left open: its other streams with it.
const CUT_HEAD: u8 = 3;

/// An answer on its way to the client, from its head to its end. Ended short, it says so
/// in an `answer cut` line, as a tunnel's `tunnel cut` does: the access line went out with
/// the head, and said 200. Cut by the proxy (no byte moved for `--idle-timeout`, or the
/// drain's grace ran out), at `info`: the client only sees a connection closed
/// mid-answer, which the SDKs report as the sandbox gone. Broken by the upstream (closed
/// or reset mid-answer, short of its length), at `warn`, as nginx's "upstream prematurely
/// closed": `upstream_errors_total` counted it, and no line said which request. Left by
/// the client (a cancelled stream, a watch stopped), at `debug`, as a tunnel's side that
/// closes it is.
pub(super) struct AnswerCut {
    clocks: Arc<Clocks>,
    uri: http::Uri,
    began: Instant,
    ended: bool,
}

impl AnswerCut {
    pub(super) fn new(activity: &Activity, uri: http::Uri) -> Self {
        activity.clocks.answers.fetch_add(1, Ordering::Relaxed);
        AnswerCut {
            clocks: activity.clocks.clone(),
            uri,
            began: Instant::now(),
            ended: false,
        }
    }

    /// The answer went out whole, or ended for a reason of its own.
    pub(super) fn ended(&mut self) {
        self.ended = true;
    }

    /// The proxy cut the answer itself (an HTTP/2 stream whose upstream went silent).
    pub(super) fn cut_idle(&mut self) {
        self.log("idle");
        self.ended = true;
    }

    /// The upstream's body failed mid-answer.
    pub(super) fn broke_upstream(&mut self) {
        self.log("upstream");
        self.ended = true;
    }

    /// The fast path's writer ended the answer before its end: which side failed, as
    /// [`Activity::upstream_broke`] and [`Activity::client_broke`] said; neither, it
    /// ended whole (an answer ended by the connection's close).
    pub(super) fn fell_short(&mut self) {
        let clocks = &self.clocks;
        if clocks.upstream_broke.swap(false, Ordering::Relaxed) {
            self.log("upstream");
        } else if clocks.client_broke.swap(false, Ordering::Relaxed) {
            self.log("client");
        }
        self.ended = true;
    }

    /// hyper has the whole body, on HTTP/1: its last bytes may still wait in hyper's
    /// buffer (and rustls') for a client that does not read. The answer is parked with
    /// its connection until a flush finds nothing left (see [`IdleIo`]), and a cut before
    /// that is said by the connection's task ([`Activity::cut_parked`]).
    /// One already parked is an earlier answer, written first: the one a cut truncates.
    pub(super) fn written_later(&mut self) {
        self.ended = true;
        let uri = std::mem::take(&mut self.uri);
        let mut parked = self
            .clocks
            .parked
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if parked.is_none() {
            *parked = Some(Box::new((uri, self.began)));
        }
        self.clocks.has_parked.store(true, Ordering::Relaxed);
    }

    fn log(&self, end: &str) {
        log_cut(&self.uri, self.began, end);
    }
}

fn log_cut(uri: &http::Uri, began: Instant, end: &str) {
    let duration_ms = began.elapsed().as_millis() as u64;
    let path = crate::logging::shown_path(uri.path());
    match end {
        "upstream" => tracing::warn!(path = %path, end, duration_ms, "answer cut"),
        "client" => tracing::debug!(path = %path, end, duration_ms, "answer cut"),
        _ => tracing::info!(path = %path, end, duration_ms, "answer cut"),
    }
}

impl Drop for AnswerCut {
    fn drop(&mut self) {
        self.clocks.answers.fetch_sub(1, Ordering::Relaxed);
        if self.ended {
            return;
        }
        match self.clocks.cut.load(Ordering::Relaxed) {
            CUT_IDLE => self.log("idle"),
            CUT_DRAIN => self.log("drain"),
            CUT_HEAD => self.log("header-timeout"),
            // hyper dropped it (the client reset its stream, or closed), or the fast path
            // stopped writing when the client went: after the upstream broke, if it did (a
            // splice gives the client what its pipe holds first).
            _ if self.clocks.upstream_broke.swap(false, Ordering::Relaxed) => self.log("upstream"),
            _ => self.log("client"),
        }
    }
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            opened: Instant::now(),
            clocks: Arc::default(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// The connection has been cut: an answer parked unwritten (see
    /// [`AnswerCut::written_later`]) was cut with it.
    fn cut_parked(&self) {
        if let Some((uri, began, end)) = self.parked_cut() {
            log_cut(&uri, began, end);
        }
    }

    /// What [`Activity::cut_parked`] says: the parked answer and why it was cut.
    fn parked_cut(&self) -> Option<(http::Uri, Instant, &'static str)> {
        let end = match self.clocks.cut.load(Ordering::Relaxed) {
            CUT_IDLE => "idle",
            CUT_DRAIN => "drain",
            CUT_HEAD => "header-timeout",
            _ => return None,
        };
        if !self.clocks.has_parked.load(Ordering::Relaxed) {
            return None;
        }
        let parked = (self.clocks.parked.lock())
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        parked.map(|p| (p.0, p.1, end))
    }

    /// Everything written so far is out: a parked answer went out whole.
    fn written(&self) {
        let has = &self.clocks.has_parked;
        if has.load(Ordering::Relaxed) && has.swap(false, Ordering::Relaxed) {
            let mut parked = self
                .clocks
                .parked
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            *parked = None;
        }
    }

    pub fn touch(&self) {
        self.clocks.last.store(self.now_ms(), Ordering::Relaxed);
    }

    /// The fast path's writer: the upstream's body broke mid-answer (see
    /// [`AnswerCut::fell_short`]).
    pub(super) fn upstream_broke(&self) {
        self.clocks.upstream_broke.store(true, Ordering::Relaxed);
    }

    /// The fast path's writer: a write to the client failed.
    pub(super) fn client_broke(&self) {
        self.clocks.client_broke.store(true, Ordering::Relaxed);
    }

    fn last_moved(&self) -> Instant {
        self.opened + Duration::from_millis(self.clocks.last.load(Ordering::Relaxed))
    }

    /// Held while a request waits for the upstream's answer: that wait is bounded by
    /// `--upstream-timeout` (then 504), not by the idle timeout, which would otherwise cut
    /// the connection first, or race the 504, and the client would get no answer at all.
    pub(super) fn awaiting(&self) -> Awaiting {
        self.clocks.waiting.fetch_add(1, Ordering::Relaxed);
        Awaiting(self.clocks.clone())
    }

    /// Held by an HTTP/2 request and then its answer's body, until the answer has ended:
    /// a draining connection is closed once none is held (see [`settled`]).
    pub(super) fn open_stream(&self) -> OpenStream {
        self.clocks.streams.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.clocks.clone())
    }

    /// Reads that brought bytes from the client on hyper's path, counted (wrapping): a
    /// draining HTTP/2 client that sends anything is still there (see [`settled`]).
    fn reads(&self) -> u32 {
        self.clocks.reads.load(Ordering::Relaxed)
    }

    /// The connection opened with HTTP/2's preface (see [`HeadWatch::is_http2`]).
    fn opened_http2(&self) {
        self.clocks.http2.store(true, Ordering::Relaxed);
    }

    /// hyper serves HTTP/2 here: the connection is open for requests once its preface is
    /// in, as a keep-alive one is between them (no first-head deadline), and closing it
    /// for idleness is hyper's graceful shutdown (GOAWAY).
    pub(super) fn is_http2(&self) -> bool {
        self.clocks.http2.load(Ordering::Relaxed)
    }

    /// After each read hyper makes: whether the bytes so far end inside a request head
    /// (see [`HeadWatch::in_head`]). `--header-timeout` runs from a head's first byte, as
    /// on the fast path, and not while a keep-alive connection is idle between requests:
    /// that is `--idle-timeout`'s.
    ///
    /// When a head begins, `task` (the connection's own, which runs the [`watchdog`] too)
    /// is woken: the watchdog's deadline may now come sooner. The read happens in that
    /// task, so no waker needs registering, which the fast path would pay for on every
    /// poll of a connection that never reaches here.
    fn heading(&self, in_head: bool, task: &std::task::Waker) {
        let began = self.clocks.head.load(Ordering::Relaxed);
        if in_head && began == 0 {
            self.clocks.head.store(self.now_ms() + 1, Ordering::Relaxed);
            task.wake_by_ref();
        } else if !in_head && began != 0 {
            self.clocks.head.store(0, Ordering::Relaxed);
        }
    }

    /// The fast path's side of [`Activity::heading`]: it reads on this connection's own task,
    /// whose watchdog sees the mark at its next wake (no earlier deadline than the first
    /// head's comes of a head begun before it; a later head has the fast path's own timer).
    pub(super) fn fast_heading(&self, in_head: bool) {
        let began = self.clocks.head.load(Ordering::Relaxed);
        if in_head && began == 0 {
            self.clocks.head.store(self.now_ms() + 1, Ordering::Relaxed);
        } else if !in_head && began != 0 {
            self.clocks.head.store(0, Ordering::Relaxed);
        }
    }

    /// The proxy still owes the client an answer (it is writing one, or waiting for the
    /// upstream's): a head the client sent on behind its request (pipelined) is not the
    /// client's to finish yet, so its time starts again from now.
    fn restart_head(&self) {
        if self.clocks.head.load(Ordering::Relaxed) != 0 {
            self.clocks.head.store(self.now_ms() + 1, Ordering::Relaxed);
        }
    }

    /// A request or an answer is under way: one waits for its head, an HTTP/2 stream or an
    /// answer's body has not ended.
    fn busy(&self) -> bool {
        let c = &self.clocks;
        c.waiting.load(Ordering::Relaxed) != 0
            || c.streams.load(Ordering::Relaxed) != 0
            || c.answers.load(Ordering::Relaxed) != 0
    }

    /// An HTTP/1 answer is still going to the client: its body has not ended, or its end
    /// waits unwritten for a client that does not read (see [`AnswerCut::written_later`]).
    fn answer_owed(&self) -> bool {
        self.clocks.answers.load(Ordering::Relaxed) != 0
            || self.clocks.has_parked.load(Ordering::Relaxed)
    }

    /// When the head in progress began (see [`Activity::heading`]).
    fn head_began(&self) -> Option<Instant> {
        match self.clocks.head.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.opened + Duration::from_millis(ms - 1)),
        }
    }
}

/// See [`Activity::awaiting`]; dropped with the request, answered or not.
pub(super) struct Awaiting(Arc<Clocks>);

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// See [`Activity::open_stream`].
pub(super) struct OpenStream(Arc<Clocks>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's bytes on their way into hyper: activity recorded, request framing
/// watched (see [`framing`]). A tunnel's bytes: activity only.
pub(super) struct IdleIo<T> {
    inner: T,
    activity: Activity,
    framing: Option<HeadWatch>,
    /// Set once hyper closes the connection (see [`IdleIo::poll_linger`]).
    linger: Option<Linger>,
}

/// A closed connection's lingering: until when, in all, and the timer for the current
/// wait, reset by every read.
struct Linger {
    until: tokio::time::Instant,
    idle: Pin<Box<tokio::time::Sleep>>,
}

/// Reads one lingering close may do in one poll before it lets the worker's other
/// connections run.
const LINGER_READS: usize = 16;

impl<T> IdleIo<T> {
    fn new(inner: T, activity: Activity) -> (Self, Verdicts) {
        let (framing, verdicts) = framing::watch();
        (
            IdleIo {
                inner,
                activity,
                framing: Some(framing),
                linger: None,
            },
            verdicts,
        )
    }

    /// For bytes that are no longer HTTP (a tunnel): only their movement is recorded.
    pub(super) fn tunnel(inner: T, activity: Activity) -> Self {
        IdleIo {
            inner,
            activity,
            framing: None,
            linger: None,
        }
    }

    fn touch(&self) {
        self.activity.touch();
    }

    fn after_write(&self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Ready(Ok(n)) if *n > 0 => self.wrote(),
            Poll::Pending => {
                let clocks = &self.activity.clocks;
                clocks.write_blocked.store(true, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Bytes of an answer went out: see [`Activity::restart_head`]. Not a tunnel's: its
    /// connection has no head to time. Nor HTTP/2's: what goes out there (another stream's
    /// answer, a PING's) has nothing to do with the head coming in.
    fn wrote(&self) {
        self.activity.touch();
        let clocks = &self.activity.clocks;
        clocks.write_blocked.store(false, Ordering::Relaxed);
        if self.framing.is_some() && !self.activity.is_http2() {
            self.activity.restart_head();
        }
    }
}

/// Resolves when the connection is to be cut: it has moved no bytes for `--idle-timeout`,
/// no request head has arrived within `--header-timeout` of its start, or a head hyper
/// reads has not ended `--header-timeout` after its first byte.
///
/// The second matters before hyper knows the connection is HTTP/1: a client that sends
/// nothing, or a bit of the HTTP/2 preface, would otherwise hold its slot of
/// `--max-connections` until the idle timeout. The third is hyper's header timeout, but
/// from the head's first byte: hyper's own timer starts when it begins to wait for a head,
/// so it also cut keep-alive connections idle between requests (see [`http_builder`]).
///
/// One timer for all: the connection's task polls every branch of its `select!` each time
/// it wakes, a few times per request, and a second timer doubled that cost.
///
/// An idle HTTP/2 connection says GOAWAY before it closes (RFC 9113 §6.8): a client
/// opening a stream just then learns it was not processed and may send it again, instead
/// of seeing a reset it cannot judge. hyper's graceful shutdown sends it, told by
/// [`Told::idle`]; the connection is cut [`GOAWAY_WAIT`] later if it has not closed,
/// unless a request the GOAWAY let in is under way, which is then watched as any.
async fn watchdog(activity: &Activity, told: &Told, config: &ServeConfig) {
    let first_head = activity.opened + config.header_timeout;
    // The idle GOAWAY (or close_notify) has gone out.
    let mut told_idle = false;
    loop {
        let mut deadline = activity.last_moved() + config.idle_timeout;
        if !told.headed.load(Ordering::Relaxed) && !activity.is_http2() {
            deadline = deadline.min(first_head);
        }
        let head = activity.clocks.head.load(Ordering::Relaxed);
        if let Some(began) = activity.head_began() {
            deadline = deadline.min(began + config.header_timeout);
        }
        if Instant::now() >= deadline {
            let idle = Instant::now() >= activity.last_moved() + config.idle_timeout;
            let http2 = activity.is_http2();
            // A head sent on behind a request is not the client's to finish while it is
            // owed that request's answer: its head (a wait `--upstream-timeout` bounds, so
            // no idleness either) or, on HTTP/1, the rest of its body (idleness still
            // cuts it). A trailing CRLF during a quiet event stream cut the stream at
            // `--header-timeout`. On HTTP/2 a head overdue is cut whatever the other
            // streams wait for: they are no answer its client is owed before it may
            // finish the head.
            let owed_head = activity.clocks.waiting.load(Ordering::Relaxed) != 0;
            let owed_body = !http2 && !idle && activity.answer_owed();
            let head_cut = http2 && head_overdue(activity, config);
            if (!owed_head && !owed_body) || head_cut {
                // A head behind the answer idleness cuts was held back, not slow: no 408
                // for it (see `head_timed_out`).
                if idle && !http2 && activity.answer_owed() {
                    activity.clocks.head.store(0, Ordering::Relaxed);
                }
                if idle {
                    let head = activity.clocks.head.load(Ordering::Relaxed);
                    told.stalled.store(head, Ordering::Relaxed);
                }
                if activity.clocks.cut_ms.load(Ordering::Relaxed) == 0 {
                    (activity.clocks.cut_ms).store(activity.now_ms() + 1, Ordering::Relaxed);
                }
                // An HTTP/2 connection is told GOAWAY; an idle HTTP/1 one over TLS that
                // has served a request is closed as hyper closes one, with TLS's
                // close_notify first (as nginx's `keepalive_timeout` does): a bare end
                // reads as a truncation to a client that checks. Either is cut after
                // [`GOAWAY_WAIT`]. A head never finished (`--header-timeout`) just ends,
                // as nginx's `client_header_timeout` does.
                let idle_tls = config.tls.is_some()
                    && told.headed.load(Ordering::Relaxed)
                    && activity.head_began().is_none();
                if !told_idle && (http2 || idle_tls) {
                    told_idle = true;
                    let heard = activity.reads();
                    told.idle.notify_one();
                    tokio::time::sleep(GOAWAY_WAIT).await;
                    // A request sent as the GOAWAY went out, which promised to serve it,
                    // runs to its end (hyper closes the connection after it), watched as
                    // any: it was cut here a second later, its command already started
                    // in the sandbox; so does a head finished meanwhile. A head still
                    // overdue is cut whatever else runs. A client that sent nothing
                    // since (not even the answer to the GOAWAY's PING) only holds the
                    // answers it left unread, which made the connection idle: watched
                    // again, they held it (and their upstream connections) a second
                    // `--idle-timeout`, the GOAWAY's own bytes having moved its clock.
                    let heard_since = activity.reads() != heard;
                    if !head_overdue(activity, config) && activity.busy() && heard_since {
                        told.stalled.store(0, Ordering::Relaxed);
                        activity.clocks.cut_ms.store(0, Ordering::Relaxed);
                        continue;
                    }
                }
                // Only now: an answer a client gives up on while the connection lives
                // on is no cut of the proxy's. A header block overdue first: `idle` was
                // judged before the GOAWAY's second, and an answer let in by the GOAWAY
                // may have moved all through it.
                if http2 && head_overdue(activity, config) {
                    activity.clocks.cut.store(CUT_HEAD, Ordering::Relaxed);
                } else if idle {
                    activity.clocks.cut.store(CUT_IDLE, Ordering::Relaxed);
                }
                return;
            }
            if owed_head {
                activity.touch();
            }
            // Not an HTTP/2 header block's: its time runs whatever the other streams wait
            // for (restarted at each idle deadline, a block left open lasted as long as
            // another stream waited on its upstream).
            if !http2 {
                activity.restart_head();
            }
            continue;
        }
        // A head that begins (or ends) cuts the wait short: the deadline moves. The read
        // that begins one wakes this task (see `Activity::heading`), so there is nothing
        // to register: a connection the fast path serves pays one load per poll.
        let mut sleep = pin!(tokio::time::sleep_until(deadline.into()));
        std::future::poll_fn(|cx| {
            if activity.clocks.head.load(Ordering::Relaxed) != head {
                return Poll::Ready(());
            }
            sleep.as_mut().poll(cx)
        })
        .await;
    }
}

/// A head begun has had its time when the connection ends: its own `--header-timeout`, or
/// for an HTTP/1 connection's first head the connection's, from its opening (a TLS
/// handshake, or a pause before the first byte, included), as [`watchdog`] cuts it.
fn head_timed_out(activity: &Activity, told: &Told, config: &ServeConfig) -> bool {
    head_from(activity, told).is_some_and(|from| Instant::now() >= from + config.header_timeout)
}

/// Where the head in progress counts its `--header-timeout` from: its first byte, or a
/// connection's first HTTP/1 head, the connection's opening; `None` while there is none.
fn head_from(activity: &Activity, told: &Told) -> Option<Instant> {
    let began = activity.head_began()?;
    let first = !told.headed.load(Ordering::Relaxed) && !activity.is_http2();
    Some(if first { activity.opened } else { began })
}

/// A head in progress has had its `--header-timeout`. Not inline in [`watchdog`]: an
/// instant held there would be held across its awaits, in every connection's task.
fn head_overdue(activity: &Activity, config: &ServeConfig) -> bool {
    activity
        .head_began()
        .is_some_and(|began| Instant::now() >= began + config.header_timeout)
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() != before {
            self.touch();
            // Only this task reads: no read-modify-write needed.
            let reads = &self.activity.clocks.reads;
            reads.store(
                reads.load(Ordering::Relaxed).wrapping_add(1),
                Ordering::Relaxed,
            );
            let this = &mut *self;
            if let Some(framing) = &mut this.framing {
                framing.scan(&buf.filled()[before..]);
                this.activity.heading(framing.in_head(), cx.waker());
                if framing.is_http2() {
                    // No first-head deadline any more: the watchdog's deadline moves
                    // later, which it finds when it next wakes.
                    this.activity.opened_http2();
                }
            }
        }
        r
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.after_write(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.after_write(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        // Over TLS a write only fills rustls' buffer: whether its bytes are out shows here.
        let blocked = r.is_pending();
        let clocks = &self.activity.clocks;
        clocks.flush_blocked.store(blocked, Ordering::Relaxed);
        if matches!(r, Poll::Ready(Ok(()))) && !clocks.write_blocked.load(Ordering::Relaxed) {
            self.activity.written();
        }
        r
    }

    /// hyper closes the connection: shut the write side, then, if the client is still
    /// sending a request body, linger (see [`IdleIo::poll_linger`]). Between requests it
    /// just closes (an idle keep-alive client need not answer the close for a drain to
    /// end), and a tunnel's bytes are left alone: its other direction may still read them.
    ///
    /// An HTTP/2 connection lingers too: its client may still be reading the end of an
    /// answer, and sending WINDOW_UPDATEs as it does; one reaching a closed socket makes
    /// the kernel answer with a reset and drop what is still queued for the client.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let sending =
            this.framing.as_ref().is_some_and(HeadWatch::in_body) || this.activity.is_http2();
        if this.linger.is_none() && !sending {
            return Pin::new(&mut this.inner).poll_shutdown(cx);
        }
        if this.linger.is_none() {
            std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            let now = tokio::time::Instant::now();
            this.linger = Some(Linger {
                until: now + h1::LINGER_TOTAL,
                idle: Box::pin(tokio::time::sleep_until(now + h1::LINGER_IDLE)),
            });
        }
        this.poll_linger(cx)
    }
}

impl<T: AsyncRead + Unpin> IdleIo<T> {
    /// nginx's lingering close, as the fast path's (`h1::linger`): a client still sending
    /// a body when hyper closes (an early answer: a refusal, a 503, the upstream's 413)
    /// would have the kernel reset the connection under its writes and maybe lose the
    /// answer (RFC 9112 §9.6). What it sends is read and dropped until it closes, for at
    /// most [`h1::LINGER_IDLE`] without a byte and [`h1::LINGER_TOTAL`] in all.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(linger) = self.linger.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let mut scratch = [0u8; 4096];
        for _ in 0..LINGER_READS {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    let now = tokio::time::Instant::now();
                    if now >= linger.until {
                        return lingered("timer");
                    }
                    let next = (now + h1::LINGER_IDLE).min(linger.until);
                    linger.idle.as_mut().reset(next);
                }
                // The client closed, or the connection failed: done either way.
                Poll::Ready(Ok(())) => return lingered("eof"),
                Poll::Ready(Err(_)) => return lingered("error"),
                Poll::Pending => {
                    return match linger.idle.as_mut().poll(cx) {
                        Poll::Ready(()) => lingered("timer"),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The end of a lingering close, said as the fast path says it (`h1::after_early_answer`).
fn lingered(end: &'static str) -> Poll<io::Result<()>> {
    tracing::trace!(end, "lingering close over");
    Poll::Ready(Ok(()))
}

/// Resolves once `activity` has seen no bytes for `timeout` (a tunnel's idle timeout).
pub(super) async fn idle(activity: &Activity, timeout: Duration) {
    loop {
        let deadline = activity.last_moved() + timeout;
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// Waits until every connection has finished (each holds a receiver of `stop`), or for
/// `grace` to pass.
pub async fn drain(stop: &watch::Sender<bool>, grace: Duration) -> bool {
    tokio::time::timeout(grace, stop.closed()).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// hyper writes no body for these, and never polls theirs to its end: the proxy's own
    /// 504 to a HEAD (a JSON body) held back no head behind it while its head waited.
    #[test]
    fn answers_without_a_body_on_the_wire_are_known() {
        assert!(body_unsent(true, StatusCode::GATEWAY_TIMEOUT));
        assert!(body_unsent(true, StatusCode::OK));
        assert!(body_unsent(false, StatusCode::NO_CONTENT));
        assert!(body_unsent(false, StatusCode::NOT_MODIFIED));
        assert!(!body_unsent(false, StatusCode::OK));
        assert!(!body_unsent(false, StatusCode::GATEWAY_TIMEOUT));
    }

    /// hyper's HTTP/1 writer has a body's end before its bytes are out: an answer whose
    /// last bytes wait for a client that does not read was cut with no line. It waits,
    /// parked with its connection, until a flush finds nothing left.
    #[test]
    fn an_answer_whose_end_is_not_out_is_said_when_its_connection_is_cut() {
        let parked = |written: bool, cut: u8| {
            let activity = Activity::new();
            let uri: http::Uri = "/files?path=x".parse().expect("uri");
            AnswerCut::new(&activity, uri).written_later();
            if written {
                activity.written();
            }
            activity.clocks.cut.store(cut, Ordering::Relaxed);
            activity
                .parked_cut()
                .map(|(uri, _, end)| (uri.path().to_string(), end))
        };
        assert_eq!(parked(false, CUT_IDLE), Some(("/files".into(), "idle")));
        assert_eq!(parked(false, CUT_DRAIN), Some(("/files".into(), "drain")));
        assert_eq!(parked(true, CUT_IDLE), None, "went out whole");
        assert_eq!(parked(false, 0), None, "not cut");
    }

    /// A draining HTTP/2 connection is not closed while a stream is open or an answer's
    /// bytes wait for room in the socket (a client reading slowly, not a client gone), and
    /// is once neither holds and nothing has moved for the wait.

    #[tokio::test]
    async fn a_draining_http2_connection_settles_only_with_nothing_left_to_send() {
        let wait = Duration::from_millis(50);
        let unsettled = |activity: &Activity| {
            let activity = activity.clone();
            async move {
                let heard = activity.reads();
                let settles = settled(&activity, wait, heard);
                let settles = tokio::time::timeout(wait * 6, settles).await;
                settles.is_err()
            }
        };
        for tls in [false, true] {
            let activity = Activity::new();
            let stream = activity.open_stream();
            assert!(unsettled(&activity).await, "a stream open");
            let full = Arc::new(AtomicBool::new(true));
            let incoming = Arc::new(AtomicBool::new(false));
            let socket = Socket {
                full: full.clone(),
                incoming: incoming.clone(),
                tls,
            };
            let (io, _verdicts) = IdleIo::new(socket, activity.clone());
            let mut io = std::pin::pin!(io);
            let mut send = |cx: &mut Context<'_>| {
                let written = io.as_mut().poll_write(cx, b"x");
                (written, io.as_mut().poll_flush(cx))
            };
            let (written, flushed) = std::future::poll_fn(|cx| Poll::Ready(send(cx))).await;
            assert_eq!((written.is_pending(), flushed.is_pending()), (!tls, tls));
            drop(stream);
            assert!(
                unsettled(&activity).await,
                "bytes waiting for room, tls {tls}"
            );
            full.store(false, Ordering::Relaxed);
            let (written, flushed) = std::future::poll_fn(|cx| Poll::Ready(send(cx))).await;
            assert!(written.is_ready() && flushed.is_ready());
            let heard = activity.reads();
            let settles = settled(&activity, wait, heard);
            let settles = tokio::time::timeout(Duration::from_secs(5), settles);
            settles.await.expect("settled with nothing left to send");

            // The client sends something after the GOAWAY (its PING's answer): still there.
            let heard = activity.reads();
            incoming.store(true, Ordering::Relaxed);
            let mut byte = [0u8; 1];
            let mut buf = ReadBuf::new(&mut byte);
            let read = std::future::poll_fn(|cx| Poll::Ready(io.as_mut().poll_read(cx, &mut buf)));
            assert!(read.await.is_ready());
            let settles = tokio::time::timeout(wait * 6, settled(&activity, wait, heard));
            assert!(settles.await.is_err(), "a client that answers, tls {tls}");
        }
    }

    /// A socket whose room the test gives and takes. Over TLS a write goes into rustls'
    /// buffer whatever the room, and only its flush waits; a TCP socket's flush never does.
    struct Socket {
        full: Arc<AtomicBool>,
        /// A byte from the client is there to be read.
        incoming: Arc<AtomicBool>,
        tls: bool,
    }

    impl AsyncRead for Socket {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if !self.incoming.swap(false, Ordering::Relaxed) {
                return Poll::Pending;
            }
            buf.put_slice(b"\0");
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            if self.full.load(Ordering::Relaxed) && !self.tls {
                return Poll::Pending;
            }
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            if self.full.load(Ordering::Relaxed) && self.tls {
                return Poll::Pending;
            }
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

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

    /// One warning starts a run of failed accepts, the failures after it are counted until
    /// the next warning a minute later (which reports them and starts counting again), and
    /// the end of the run clears the count. A run that starts within the minute of the
    /// last warning warns not again (nor says its end at info) until that minute is over.
    #[test]
    fn failed_accepts_warn_once_a_minute_with_the_count_between() {
        let e = io::Error::from(io::ErrorKind::OutOfMemory);
        let t0 = Instant::now();
        let mut failing = AcceptFailures::new("proxy");
        let state = |f: &AcceptFailures| (f.run, f.since_warning, f.warned);
        failing.log(&e, t0);
        assert_eq!(state(&failing), (Some(t0), 0, Some(t0)));
        for s in [1, 2, 59] {
            failing.log(&e, t0 + Duration::from_secs(s));
        }
        assert_eq!(state(&failing), (Some(t0), 3, Some(t0)));
        let t60 = t0 + AcceptFailures::EVERY;
        failing.log(&e, t60);
        assert_eq!(state(&failing), (Some(t0), 0, Some(t60)));
        failing.recovered();
        assert_eq!(state(&failing), (None, 0, Some(t60)));
        // Descriptors hovering at the limit: runs of a failure or two, many a second,
        // counted over the runs for the next warning.
        for ms in [10, 20, 30] {
            failing.log(&e, t60 + Duration::from_millis(ms));
            assert_eq!(failing.warned, Some(t60), "{ms} ms after the warning");
            failing.recovered();
        }
        assert_eq!(state(&failing), (None, 3, Some(t60)));
        let t120 = t60 + AcceptFailures::EVERY;
        failing.log(&e, t120);
        assert_eq!(state(&failing), (Some(t120), 0, Some(t120)));
    }

    /// A connection is cut off at 100 requests cancelled before their answer, once they are
    /// at least half of its requests: neither a few cancels nor many among far more answers.
    #[test]
    fn cancelled_requests_count_at_100_and_half() {
        use futures_util::FutureExt;
        let cancel = |c: &Arc<Cancels>, n: usize| (0..n).for_each(|_| drop(Cancels::begin(c)));
        let answer = |c: &Arc<Cancels>, n: usize| (0..n).for_each(|_| Cancels::begin(c).answered());
        let fired = |c: &Cancels| c.abusive.notified().now_or_never().is_some();

        let few = Arc::new(Cancels::default());
        cancel(&few, 1);
        assert!(!fired(&few), "one cancel of one request");

        let half = Arc::new(Cancels::default());
        answer(&half, 100);
        cancel(&half, 99);
        assert!(!fired(&half), "99 cancelled");
        cancel(&half, 1);
        assert!(fired(&half), "100 cancelled of 200");

        let among_more = Arc::new(Cancels::default());
        answer(&among_more, 300);
        cancel(&among_more, 100);
        assert!(!fired(&among_more), "100 cancelled of 400");

        // Given up after living a while: requests timing out, not reset at once.
        let timed_out = Arc::new(Cancels::default());
        let a_while_ago = Instant::now()
            .checked_sub(PREMATURE)
            .expect("a past instant");
        for _ in 0..100 {
            let mut guard = Cancels::begin(&timed_out);
            if let Some((_, begun)) = guard.0.as_mut() {
                *begun = a_while_ago;
            }
        }
        assert!(!fired(&timed_out), "100 cancelled after a second each");
        cancel(&timed_out, 99);
        assert!(!fired(&timed_out), "99 cancelled at once");
        cancel(&timed_out, 1);
        assert!(fired(&timed_out), "100 cancelled at once of 200");
    }

    /// A head's clock starts at its first byte, once (the connection's task is woken then,
    /// for the watchdog's sooner deadline), and stops at its end; bytes between requests
    /// start nothing. The clock counts milliseconds from the connection's opening, plus
    /// one: a head begun in its first millisecond is timed too.
    #[test]
    fn a_head_is_timed_from_its_first_byte_to_its_end() {
        struct Wakes(AtomicU32);
        impl std::task::Wake for Wakes {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let wakes = Arc::new(Wakes(AtomicU32::new(0)));
        let task = std::task::Waker::from(wakes.clone());
        let woken = || wakes.0.load(Ordering::Relaxed);
        let activity = Activity::new();

        activity.heading(false, &task);
        assert_eq!((activity.head_began(), woken()), (None, 0));
        activity.heading(true, &task);
        let began = activity.head_began().expect("a head began");
        assert!(activity.opened <= began && began <= Instant::now());
        assert_eq!(woken(), 1);
        activity.heading(true, &task);
        assert_eq!((activity.head_began(), woken()), (Some(began), 1));
        // An answer going out restarts a pipelined head's clock, and starts none.
        activity.restart_head();
        let again = activity.head_began().expect("still a head");
        assert!(began <= again && again <= Instant::now());
        activity.heading(false, &task);
        assert_eq!((activity.head_began(), woken()), (None, 1));
        activity.restart_head();
        assert_eq!(activity.head_began(), None);
    }

    /// Bytes moving either way are the connection's activity (the idle timeout's clock): an
    /// upload the client sends, a download it reads.
    #[tokio::test]
    async fn bytes_either_way_are_activity() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const STALE: u64 = u64::MAX;
        let (near, mut far) = tokio::io::duplex(64);
        let activity = Activity::new();
        // Buffered beneath: the write reaches the far side only with the flush passed on.
        let mut io = IdleIo::tunnel(tokio::io::BufWriter::new(near), activity.clone());
        let last = || activity.clocks.last.load(Ordering::Relaxed);

        activity.clocks.last.store(STALE, Ordering::Relaxed);
        far.write_all(b"up").await.expect("send");
        let mut two = [0u8; 2];
        io.read_exact(&mut two).await.expect("read");
        assert_ne!(last(), STALE, "a read moved nothing");

        activity.clocks.last.store(STALE, Ordering::Relaxed);
        io.write_all(b"down").await.expect("write");
        assert_ne!(last(), STALE, "a write moved nothing");
        io.flush().await.expect("flush");
        let mut four = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(10), far.read_exact(&mut four))
            .await
            .expect("the flush reached the far side")
            .expect("the far side reads");
        assert_eq!(&four, b"down");
    }

    /// hyper closing the connection while the client still sends a request body (after an
    /// early answer) reads and drops what comes, until the client has been silent for
    /// `LINGER_IDLE`: the close does not reset the connection under its writes.
    #[tokio::test(start_paused = true)]
    async fn a_close_during_an_upload_lingers_until_the_client_is_silent() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(1024);
        let (mut io, _verdicts) = IdleIo::new(near, Activity::new());
        let head = b"POST /f HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc";
        far.write_all(head).await.expect("send");
        let mut buf = [0u8; 128];
        let n = io.read(&mut buf).await.expect("read");
        assert_eq!(n, head.len());

        let start = tokio::time::Instant::now();
        io.shutdown().await.expect("closed");
        assert_eq!(start.elapsed(), h1::LINGER_IDLE);
        drop(far);
    }

    /// A plain listener's connection task for `sock`, as the accept loop starts one.
    async fn plain_connection(
        sock: std::os::unix::net::UnixStream,
        proxy: Arc<Proxy>,
        stop: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> {
        let permit = Arc::new(Semaphore::new(1))
            .acquire_owned()
            .await
            .expect("permit");
        let config = ServeConfig {
            tls: None,
            idle_timeout: Duration::from_secs(60),
            header_timeout: Duration::from_secs(10),
            max_connections: 1,
        };
        connection_task(
            StdSock::Unix(sock),
            permit,
            proxy,
            Arc::new(http_builder(&config)),
            Arc::new(config),
            stop,
        )
    }

    /// A request already in the socket of a connection hyper serves (one that sent a
    /// chunked upload before) when the drain begins, before the runtime has seen it, is
    /// answered: hyper, idle, was told to finish at once, and closed it unanswered.
    #[tokio::test]
    async fn a_request_in_the_socket_when_the_drain_begins_is_answered_by_hyper() {
        use crate::settings::Key;
        use http_body_util::BodyExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", upstream.local_addr().expect("addr"));
        tokio::spawn(async move {
            while let Ok((stream, _)) = upstream.accept().await {
                let ok = service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(hyper::Response::new(http_body_util::Full::new(
                        Bytes::from_static(b"ok"),
                    )))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), ok),
                );
            }
        });
        let proxy = super::super::test_proxy_with("sk-test", &[(Key::SandboxBaseUrl, &url)]);
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("nonblocking");
        theirs.set_nonblocking(true).expect("nonblocking");
        let mut theirs = tokio::net::UnixStream::from_std(theirs).expect("register");
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(plain_connection(ours, proxy, stopped).await);
        // A chunked upload: the fast path hands the connection to hyper for good.
        let upload = b"POST /sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
        theirs.write_all(upload).await.expect("upload");
        let mut answer = Vec::new();
        while !answer.ends_with(b"ok") {
            let mut chunk = [0u8; 1024];
            let n = tokio::time::timeout(Duration::from_secs(10), theirs.read(&mut chunk))
                .await
                .expect("the first answer in time")
                .expect("read");
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&chunk[..n]);
        }
        // The next request, and the drain, before the runtime turns again.
        theirs
            .write_all(b"GET /sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .expect("request");
        stop.send_replace(true);
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), theirs.read_to_end(&mut rest))
            .await
            .expect("the answer and the close in time")
            .expect("read");
        let rest = String::from_utf8_lossy(&rest).to_ascii_lowercase();
        assert!(rest.starts_with("http/1.1 200"), "{rest:?}");
        assert!(rest.contains("\r\nconnection: close\r\n"), "{rest}");
        assert!(rest.ends_with("ok"), "{rest}");
    }

    /// The state of a connection's task stays allocated for as long as the connection is
    /// open, idle or not: 10 000 idle keep-alive connections pay it 10 000 times (the
    /// performance target: 64 MiB for them). A writer kept inline in it once added 1 KiB
    /// to each. Rare or large states belong in boxes, and a local must not be in scope
    /// across an `.await` it is not needed after.
    #[tokio::test]
    async fn a_connection_task_stays_small() {
        // 1,152 bytes today in debug (1,144 a few sessions ago; 1,112 before the
        // answer-cut line's parked slot): 32 of them the idle HTTP/2 connection's GOAWAY
        // signal, 72 the end of the drain's grace, 8 the watchdog's wait for a head to
        // begin; 1,048 in debug and 1,032 in release before the guards
        // moved into one shared `OpenConnection` (1,872 before `h1::serve` stopped keeping
        // the head, the answer and a probe array across its awaits). The room above that is
        // for small changes, not for another kilobyte.
        const BUDGET: usize = 1184;
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let (_stop, stopped) = watch::channel(false);
        let task = plain_connection(ours, super::super::test_proxy(), stopped).await;
        let size = std::mem::size_of_val(&task);
        assert!(
            size <= BUDGET,
            "a connection's task is {size} bytes (budget {BUDGET})"
        );
    }
}
