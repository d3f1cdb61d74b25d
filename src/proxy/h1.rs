//! The HTTP/1.1 fast path for plain TCP and unix-socket clients.
//!
//! Nearly every request an E2B SDK sends is a plain HTTP/1.1 message: a head, then no body
//! or a `Content-Length` one. This module serves exactly those, on the connection's own
//! task: the head is parsed with `httparse` straight from the socket, handed to
//! [`Proxy::handle`], and the answer is written back with the head and the first body bytes
//! in one write. Between requests a connection holds no buffer at all (an idle keep-alive
//! connection costs its socket and a small task, as in nginx), and the next head waits for
//! readiness, not for a read into a buffer.
//!
//! Everything else is handed over, whole, to hyper's server: the bytes read so far go first
//! ([`Rewind`]), and hyper serves that request and every later one on the connection. That
//! covers `Transfer-Encoding`, repeated or odd `Content-Length`, `Expect`, `TE` (a client
//! that takes trailers gets them by hyper's rule; the fast path sends none), upgrades
//! (WebSocket), HTTP/1.0, the HTTP/2 preface, heads over the size or field limits and
//! anything `httparse` rejects — hyper answers those as it always has (400, 431, …), and
//! the framing watch sees every byte it is given.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::task::AtomicWaker;
use futures_util::FutureExt;
use http::header::{CONNECTION, CONTENT_LENGTH, DATE, EXPECT, TE, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{watch, Notify};

use super::body;
use super::failure;
use super::framing;
use super::headers;
use super::listener::{Activity, AnswerCut, MAX_HEAD, MAX_HEADERS};
#[cfg(target_os = "linux")]
use super::pool;
use super::Proxy;
use crate::upstream::ProxyBody;

/// A client socket the fast path can read and write through a shared reference, so the
/// request body (on its way upstream) and the response (on its way back) move at once.
#[derive(Debug)]
pub enum Sock {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// A [`Sock`] on its way between runtimes.
pub enum StdSock {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Sock {
    pub fn into_std(self) -> io::Result<StdSock> {
        Ok(match self {
            Sock::Tcp(s) => StdSock::Tcp(s.into_std()?),
            Sock::Unix(s) => StdSock::Unix(s.into_std()?),
        })
    }

    /// Registers the socket with the calling thread's runtime.
    pub fn from_std(s: StdSock) -> io::Result<Self> {
        Ok(match s {
            StdSock::Tcp(s) => Sock::Tcp(TcpStream::from_std(s)?),
            StdSock::Unix(s) => Sock::Unix(UnixStream::from_std(s)?),
        })
    }

    /// Waits for readiness through the socket's one reader slot: `readable()` queues a
    /// waiter on a list per call instead, under a lock, and takes it out again. One reader
    /// at a time is enough: the connection's task, or a request body's reader, which may
    /// be polled in another task (hyper's client); the connection reads again only once
    /// that reader is gone (see [`Shared`]).
    async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_read_ready(cx)).await
    }

    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Sock::Tcp(s) => s.poll_read_ready(cx),
            Sock::Unix(s) => s.poll_read_ready(cx),
        }
    }

    /// Whether bytes wait in the socket, asked of the kernel: the readiness the runtime
    /// keeps lags behind until its next turn (a connection just handed to a worker with
    /// its request already in).
    fn holds_bytes(&self) -> bool {
        let sock = match self {
            Sock::Tcp(s) => socket2::SockRef::from(s),
            Sock::Unix(s) => socket2::SockRef::from(s),
        };
        let mut one = [std::mem::MaybeUninit::<u8>::uninit()];
        matches!(sock.peek(&mut one), Ok(n) if n > 0)
    }

    fn try_read_buf<B: BufMut>(&self, buf: &mut B) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.try_read_buf(buf),
            Sock::Unix(s) => s.try_read_buf(buf),
        }
    }

    /// Reads what is there; a read that did not fill `buf` emptied the socket, so the
    /// readiness is cleared at once (as nginx does) instead of by one more read that
    /// finds nothing. The clear is tied to the readiness seen before the read: bytes that
    /// arrive meanwhile raise it again, so no wake-up is lost.
    fn read_draining<B: BufMut>(&self, buf: &mut B) -> io::Result<usize> {
        let room = buf.chunk_mut().len();
        let mut got = None;
        let mut read = || {
            let n = self.try_read_buf(buf)?;
            got = Some(n);
            if n > 0 && n < room {
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                Ok(n)
            }
        };
        let r = match self {
            Sock::Tcp(s) => s.try_io(Interest::READABLE, &mut read),
            Sock::Unix(s) => s.try_io(Interest::READABLE, &mut read),
        };
        match got {
            Some(n) => Ok(n),
            None => r,
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.writable().await,
            Sock::Unix(s) => s.writable().await,
        }
    }

    fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.try_write_vectored(bufs),
            Sock::Unix(s) => s.try_write_vectored(bufs),
        }
    }
}

/// What the fast path leaves behind: nothing, or the connection for hyper with the bytes
/// already read from it.
pub enum Outcome {
    Closed,
    HandOver(Sock, Bytes),
}

/// What a connection needs from the listener.
pub struct Ctx<'a> {
    pub proxy: &'a Arc<Proxy>,
    pub activity: &'a Activity,
    pub headed: &'a AtomicBool,
    pub header_timeout: Duration,
}

/// The socket and what the request body reader shares with the connection loop.
struct Shared {
    sock: Sock,
    /// Bytes of the current request body not yet read; the connection can carry another
    /// request only once this is 0.
    body_left: AtomicU64,
    /// Set once the answer went out with the body unread: the body's reader ends instead of
    /// reading on, so that the connection can read (and drop) the rest itself.
    abandoned: AtomicBool,
    /// The body reader's waker while it waits, to end it at once when abandoned.
    reader: AtomicWaker,
    /// Notified when the body's reader is dropped, and when it has read the body's end.
    released: Notify,
}

impl Shared {
    /// The request body's reader is gone: nobody but the connection reads the socket.
    async fn reader_released(self: &Arc<Self>) {
        while Arc::strong_count(self) > 1 {
            self.released.notified().await;
        }
    }

    /// The request body is read whole, or its reader is gone. A reader at the body's end
    /// never reads the socket again, though it may live on: the proxy's own upstream
    /// client keeps the request's body until the answer's head (or, a 2xx having begun
    /// first, until the upload or that answer ends).
    async fn body_read(self: &Arc<Self>) {
        while Arc::strong_count(self) > 1 && self.body_left.load(Ordering::Relaxed) != 0 {
            self.released.notified().await;
        }
    }
}

/// Serves requests until the client closes, a timeout or the drain ends the connection,
/// or a request needs hyper.
pub async fn serve(sock: Sock, ctx: Ctx<'_>, stop: &mut watch::Receiver<bool>) -> Outcome {
    let shared = Arc::new(Shared {
        sock,
        body_left: AtomicU64::new(0),
        abandoned: AtomicBool::new(false),
        reader: AtomicWaker::new(),
        released: Notify::new(),
    });
    // One drain watch for the connection's whole life: a fresh `wait_for` per idle wait
    // would register with the watch and leave it again on every request.
    let mut watcher = stop.clone();
    let drained = watcher.wait_for(|s| *s);
    tokio::pin!(drained);
    let mut buf = BytesMut::new();
    let mut draining = false;
    // Empty-line bytes a client may still send before its next request line (see
    // `read_head`): four per gap between requests, not per read.
    let mut blank = Blank::GAP;
    loop {
        if buf.is_empty() {
            // `drained` is done: a drain serves what was in the socket when it began.
            if draining {
                return Outcome::Closed;
            }
            // Idle between requests: no buffer is held while waiting.
            buf = BytesMut::new();
            draining = tokio::select! {
                biased;
                r = shared.sock.readable() => if r.is_err() { return Outcome::Closed } else { false },
                _ = &mut drained => true,
                // Asked to make room: as a drain, for this connection.
                () = ctx.activity.left() => true,
            };
            // Bytes already in the socket are a request sent before the drain began (or
            // the connection was asked to make room), which the runtime had not seen yet:
            // it is served, and its answer closes the connection. An idle connection
            // closes now.
            if draining && (!shared.sock.holds_bytes() || shared.sock.readable().await.is_err()) {
                return Outcome::Closed;
            }
        }
        // The head is bound inside the match arm only: a local in scope across the
        // `.await`s below would be kept in every connection's task state, moved out or not.
        let FastRequest {
            req,
            length,
            is_head,
            mut close,
        } = match read_head(
            &shared.sock,
            &mut buf,
            ctx.activity,
            ctx.header_timeout,
            &mut blank,
        )
        .await
        {
            Read::Head(head) => {
                blank = Blank::GAP;
                ctx.headed.store(true, Ordering::Relaxed);
                request(head, &shared, &mut buf, ctx.activity)
            }
            Read::Nothing => continue,
            Read::Closed => return Outcome::Closed,
            // RFC 9113 §3.3: the HTTP/2 preface (prior knowledge) only opens a connection.
            // After a request, hyper would switch this connection to HTTP/2 all the same.
            Read::HandOver
                if ctx.headed.load(Ordering::Relaxed) && buf.starts_with(H2_PREFACE_LINE) =>
            {
                return Outcome::Closed;
            }
            Read::HandOver => {
                return match Arc::try_unwrap(shared) {
                    Ok(s) => Outcome::HandOver(s.sock, buf.freeze()),
                    // A body reader of an earlier request is still alive somewhere.
                    Err(_) => Outcome::Closed,
                };
            }
        };

        // Boxed, like the write below: only a pointer of it stays in the connection's task,
        // so an idle keep-alive connection does not carry a request's worth of state.
        // The path goes with the handler, for an `answer cut` line (see `AnswerCut`): kept
        // in the box, not in the connection's task.
        let proxy = ctx.proxy.clone();
        let handled = Box::pin(async move {
            let path = ShortPath::of(req.uri().path());
            (proxy.handle(req).await, path)
        });
        // `resp` lives in this block only: in scope across the write's `.await` it would be
        // kept in the task (see the head above).
        let write = {
            let waiting = ctx.activity.awaiting();
            // A client that hangs up while waiting takes its request with it (hyper does the
            // same): the handler is dropped, the upstream exchange cancelled.
            // Biased, the handler first: a client that sent its request and closed its
            // side at once would otherwise lose, one time in two, a handler never polled,
            // and with it the request's 499 line and count.
            let resp = if length == 0 {
                tokio::select! {
                    biased;
                    r = handled => r,
                    () = client_gone(&shared.sock, &mut buf) => return Outcome::Closed,
                }
            } else {
                // With a body, once it is all read (until then its reader reads), gone or
                // not: a finished body may be kept until the answer's head, and a client
                // that left meanwhile held its upstream exchange, its connection slot and
                // a drain until then.
                let gone = async {
                    shared.body_read().await;
                    if shared.body_left.load(Ordering::Relaxed) != 0 {
                        return std::future::pending().await;
                    }
                    client_gone(&shared.sock, &mut buf).await
                };
                tokio::select! {
                    biased;
                    r = handled => r,
                    () = gone => return Outcome::Closed,
                }
            };
            drop(waiting);
            close |= *stop.borrow() || ctx.activity.leaving();
            // Body bytes the handler left unread (an early answer: a refusal, a 503) would
            // be taken for the next request: the connection ends, and the client is told.
            close |= shared.body_left.load(Ordering::Relaxed) != 0;
            let (resp, path) = resp;
            match resp {
                Ok(resp) => {
                    match write_response(&shared.sock, ctx.activity, resp, is_head, close) {
                        Write::Later(writing) => {
                            Write::Later(Box::pin(cut_logged(writing, ctx.activity, path)))
                        }
                        done => done,
                    }
                }
                Err(never) => match never {},
            }
        };
        let written = match write {
            Write::Done(written) => written,
            // A streamed answer (a Connect stream, a download) stops when the client goes,
            // rather than at the next write that fails, or the idle timeout.
            Write::Later(writing)
                if Arc::strong_count(&shared) == 1
                    && shared.body_left.load(Ordering::Relaxed) == 0 =>
            {
                tokio::select! {
                    w = writing => w,
                    () = client_gone(&shared.sock, &mut buf) => return Outcome::Closed,
                }
            }
            Write::Later(writing) => writing.await,
        };
        if written && shared.body_left.load(Ordering::Relaxed) != 0 {
            ctx.activity.lingers();
            // Boxed: rare, and inline its timers would grow every connection's task.
            Box::pin(after_early_answer(&shared, &mut buf, stop)).await;
            return Outcome::Closed;
        }
        if !written || close || *stop.borrow() {
            return Outcome::Closed;
        }
    }
}

/// An answer still being written when [`write_response`] returned, with the line that
/// says so should the proxy cut it (see [`AnswerCut`]).
async fn cut_logged(
    writing: Pin<Box<dyn Future<Output = bool> + Send + '_>>,
    activity: &Activity,
    path: ShortPath,
) -> bool {
    let mut cut = AnswerCut::new(activity, path.uri());
    let written = writing.await;
    if written {
        cut.ended();
    } else {
        cut.fell_short();
    }
    written
}

/// A request's path kept for its `answer cut` line, copied: a clone of the request's
/// `Uri` cost every request an atomic reference count (and at times an allocation) for
/// a line few answers ever need. Longer paths are cut at a character short of
/// [`ShortPath::MAX`] and end in `...`: cut in a character, a path became no `Uri` and
/// the line said `path=/`, and cut bare it read as the whole path.
struct ShortPath {
    len: usize,
    bytes: [u8; ShortPath::MAX],
}

impl ShortPath {
    const MAX: usize = 96;

    const CUT: &'static [u8] = b"...";

    fn of(path: &str) -> Self {
        let mut bytes = [0u8; Self::MAX];
        if path.len() <= Self::MAX {
            bytes[..path.len()].copy_from_slice(path.as_bytes());
            return ShortPath {
                len: path.len(),
                bytes,
            };
        }
        let mut kept = Self::MAX - Self::CUT.len();
        while !path.is_char_boundary(kept) {
            kept -= 1;
        }
        // Nor half a percent escape (`%C` of `%C3`).
        let bytes_kept = &path.as_bytes()[..kept];
        if let Some(escape) = bytes_kept.iter().rev().take(2).position(|&b| b == b'%') {
            kept -= escape + 1;
        }
        bytes[..kept].copy_from_slice(&path.as_bytes()[..kept]);
        bytes[kept..kept + Self::CUT.len()].copy_from_slice(Self::CUT);
        ShortPath {
            len: kept + Self::CUT.len(),
            bytes,
        }
    }

    /// As a `Uri` (only for an answer not written at once).
    fn uri(&self) -> Uri {
        Uri::try_from(&self.bytes[..self.len]).unwrap_or_default()
    }
}

/// The answer went out with the body unread. Its reader may live on in another task
/// (hyper's client polls the body it sends upstream): it is ended first, as two readers
/// cannot share the socket, then the rest of the body is read and dropped.
async fn after_early_answer(
    shared: &Arc<Shared>,
    buf: &mut BytesMut,
    stop: &mut watch::Receiver<bool>,
) {
    if Arc::strong_count(shared) > 1 {
        shared.abandoned.store(true, Ordering::Release);
        shared.reader.wake();
        let released = tokio::time::timeout(LINGER_IDLE, shared.reader_released()).await;
        if released.is_err() {
            // Still held somewhere: it will not read again, and the socket closes with it.
            tracing::trace!(end = "reader held", "lingering close over");
            return;
        }
    }
    let unread = shared.body_left.load(Ordering::Relaxed);
    let end = match unread {
        0 => "body",
        _ => linger(&shared.sock, unread, buf, stop).await,
    };
    // What ended it tells a body miscounted (it ends on the timer) from one read whole,
    // which the time the close took cannot tell on a loaded machine.
    tracing::trace!(end, "lingering close over");
}

/// How long an answered connection is read and discarded before it closes, in all and
/// without a byte (nginx's `lingering_time` and `lingering_timeout`).
pub(super) const LINGER_TOTAL: Duration = Duration::from_secs(30);
pub(super) const LINGER_IDLE: Duration = Duration::from_secs(5);

/// nginx's lingering close, after an answer that left `unread` body bytes unread (a
/// refusal, a 503, the upstream's early 413 or 401): closing at once, with the client's
/// bytes still arriving, makes the kernel reset the connection, and a client still sending
/// its body gets that reset, or loses the answer with it (RFC 9112 §9.6). Reading the rest
/// of the body and dropping it lets the client finish and read the answer.
///
/// Returns what ended it: `body`, `drain`, `timer`, `eof` or `error`.
async fn linger(
    sock: &Sock,
    mut unread: u64,
    buf: &mut BytesMut,
    stop: &mut watch::Receiver<bool>,
) -> &'static str {
    let until = tokio::time::Instant::now() + LINGER_TOTAL;
    loop {
        let idle = tokio::time::Instant::now() + LINGER_IDLE;
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return "drain",
            () = tokio::time::sleep_until(idle.min(until)) => return "timer",
            r = sock.readable() => if r.is_err() { return "error" },
        }
        buf.clear();
        buf.reserve(BODY_READ);
        match sock.try_read_buf(buf) {
            Ok(0) => return "eof",
            Ok(n) if n as u64 >= unread => return "body",
            Ok(n) => unread -= n as u64,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return "error",
        }
    }
}

/// A request the fast path read, and what the connection still needs of its head once the
/// request has gone to the handler.
struct FastRequest {
    req: Request<ProxyBody>,
    /// The body's length: `Content-Length`, or 0 without one (a `Transfer-Encoding` goes
    /// to hyper).
    length: u64,
    is_head: bool,
    /// The client asked to close after the answer.
    close: bool,
}

/// The request for a parsed head, with its body reader: the body's first bytes are those
/// already in `buf`.
fn request(
    head: Head,
    shared: &Arc<Shared>,
    buf: &mut BytesMut,
    activity: &Activity,
) -> FastRequest {
    let length = head.content_length;
    let body = if length == 0 {
        body::empty()
    } else {
        let prefix = buf.split_to(buf.len().min(length as usize)).freeze();
        let left = length - prefix.len() as u64;
        shared.body_left.store(left, Ordering::Relaxed);
        body::boxed(FastBody {
            shared: shared.clone(),
            activity: activity.clone(),
            prefix: Some(prefix).filter(|p| !p.is_empty()),
            left,
            buf: BytesMut::new(),
        })
    };
    FastRequest {
        is_head: head.method == Method::HEAD,
        close: head.close,
        req: head.into_request(body),
        length,
    }
}

/// Resolves when the client closes its side while a request is being answered. Bytes it
/// sends meanwhile (a pipelined request) are kept in `buf` and the watch ends there.
///
/// Reads straight into `buf`: a probe array here would sit in every connection's task
/// state, idle or not. Not at all while `buf` holds bytes already (pipelined requests not
/// yet served): the client is there, and a client that kept sending and reading would
/// otherwise have its whole backlog pulled into the proxy's memory, 512 bytes and more per
/// request served, instead of waiting in TCP's flow control as it does everywhere else.
async fn client_gone(sock: &Sock, buf: &mut BytesMut) {
    if !buf.is_empty() {
        return std::future::pending().await;
    }
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        buf.reserve(512);
        match sock.try_read_buf(buf) {
            Ok(0) => return,
            Ok(_) => return std::future::pending().await,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

// Returned by value once per request and matched at once: boxing the head would add an
// allocation to every request to save a move.
#[allow(clippy::large_enum_variant)]
enum Read {
    Head(Head),
    /// Readiness without bytes: wait again.
    Nothing,
    Closed,
    HandOver,
}

/// Empty-line bytes still to be skipped before the next request line, and whether the
/// last read ended in the CR of one (its LF may come with the next).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Blank {
    left: usize,
    cr: bool,
}

impl Blank {
    /// Four bytes between two requests.
    const GAP: Blank = Blank { left: 4, cr: false };

    /// Skips the empty lines `buf` begins with, within the budget. Whole lines only, as
    /// hyper's parser skips them: a bare CR is no line end (RFC 9112 §2.2), and goes to
    /// the parser, which hands it to hyper's 400.
    fn skip(&mut self, buf: &mut BytesMut) {
        if std::mem::take(&mut self.cr) && buf[0] != b'\n' {
            // Not an empty line after all: the CR goes back for the parser.
            let mut back = BytesMut::with_capacity(buf.len() + 1);
            back.put_u8(b'\r');
            back.extend_from_slice(buf);
            *buf = back;
            self.left = 0;
            return;
        }
        let mut n = 0;
        loop {
            match &buf[n..] {
                [b'\n', ..] if n < self.left => n += 1,
                [b'\r', b'\n', ..] if n + 2 <= self.left => n += 2,
                // An empty line's CR at the end of the read, its LF to come.
                [b'\r'] if n + 2 <= self.left => {
                    n += 1;
                    self.cr = true;
                }
                _ => break,
            }
        }
        buf.advance(n);
        self.left = if buf.is_empty() { self.left - n } else { 0 };
    }
}

/// Reads until a whole head is buffered and parsed. The header timeout runs from the head's
/// first byte (waiting for that byte is the keep-alive idle time, watched elsewhere).
async fn read_head(
    sock: &Sock,
    buf: &mut BytesMut,
    activity: &Activity,
    header_timeout: Duration,
    blank: &mut Blank,
) -> Read {
    let mut deadline = None;
    let mut scanned = 0;
    // RFC 9112 §2.2: empty lines before a request line are ignored (a client may send a
    // CRLF more after a body). Taken for a head begun, one held a drain for the whole
    // header timeout and was logged 408. `blank` bytes of them at most, four between two
    // requests (`serve` keeps the count across reads): a client that sends line ends and
    // nothing else is still bound by the header timeout.
    loop {
        if blank.left > 0 && !buf.is_empty() {
            blank.skip(buf);
        }
        if !buf.is_empty() {
            match parse(buf, &mut scanned) {
                Parsed::Head(head) => {
                    activity.fast_heading(false);
                    return Read::Head(head);
                }
                Parsed::HandOver => return Read::HandOver,
                Parsed::Partial if buf.len() > MAX_HEAD => return Read::HandOver,
                Parsed::Partial => activity.fast_heading(true),
            }
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(4096);
        }
        match sock.read_draining(buf) {
            Ok(0) => return Read::Closed,
            Ok(_) => activity.touch(),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if buf.is_empty() {
                    return Read::Nothing;
                }
                let at = *deadline.get_or_insert_with(|| Instant::now() + header_timeout);
                // Boxed: only a head arriving in pieces gets here, and the timer inline
                // would size every connection's task. A drain waits for the rest, as
                // nginx's does: the client has begun its request, and closing would lose
                // it with no answer (a POST's client could not tell whether it was
                // done). The header timeout bounds the wait, and the grace the drain.
                // A head cut here is logged by the connection's task (the head's mark,
                // `Activity::fast_heading`, stays set).
                let more = Box::pin(tokio::time::timeout_at(at.into(), sock.readable()));
                if !matches!(more.await, Ok(Ok(()))) {
                    return Read::Closed;
                }
            }
            Err(_) => return Read::Closed,
        }
    }
}

/// A request head the fast path serves.
struct Head {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    content_length: u64,
    /// The client asked for the connection to close after this request.
    close: bool,
}

impl Head {
    fn into_request(self, body: ProxyBody) -> Request<ProxyBody> {
        let mut req = Request::new(body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers;
        req
    }
}

/// The HTTP/2 connection preface's request line (what the fast path has of it when it hands over).
const H2_PREFACE_LINE: &[u8] = b"PRI * HTTP/2.0\r\n";

#[allow(clippy::large_enum_variant)]
enum Parsed {
    Head(Head),
    Partial,
    HandOver,
}

/// Parses the head at the start of `buf`; on success the head's bytes are split off and
/// the URI and values point into them (no copy). `scanned` is how far earlier calls looked
/// for the head's end in the same partial head: a head arriving in pieces is scanned once,
/// not from its start at every piece (64 KiB sent a few bytes at a time cost a tenth of a
/// second of CPU that way).
fn parse(buf: &mut BytesMut, scanned: &mut usize) -> Parsed {
    let len = match head_end(buf, *scanned) {
        Ok(len) => len,
        Err(resume) => {
            // Bytes no request can start with (a TLS ClientHello, from an `https://` URL
            // aimed at this plain listener, holds no line end) go to hyper, which refuses
            // them at once; waiting for the head's end, the client waited out the header
            // timeout for nothing. Only a head's first bytes are looked at, and only until
            // the scan has passed them, so that a long one is not parsed again at every
            // piece. (A ClientHello with a post-quantum key share is over 1 KiB, and comes
            // in one read.)
            let early = *scanned < EARLY_CHECK;
            *scanned = resume;
            let start = &buf[..buf.len().min(EARLY_CHECK)];
            return match early && cannot_be_a_request(start) {
                true => Parsed::HandOver,
                false => Parsed::Partial,
            };
        }
    };
    if len > MAX_HEAD {
        // Over the limit: hyper answers 431.
        return Parsed::HandOver;
    }
    let head = buf.split_to(len).freeze();
    match parse_head(&head) {
        Some(parsed) => Parsed::Head(parsed),
        None => {
            // Put the bytes back in front for hyper: nothing was consumed.
            let mut back = BytesMut::with_capacity(head.len() + buf.len());
            back.extend_from_slice(&head);
            back.extend_from_slice(buf);
            *buf = back;
            Parsed::HandOver
        }
    }
}

/// Whether the start of a head already breaks the request line's grammar. Fields are not
/// looked at (no slots for them: running out of slots means the line was fine).
fn cannot_be_a_request(partial: &[u8]) -> bool {
    let mut req = httparse::Request::new(&mut []);
    matches!(req.parse(partial), Err(e) if e != httparse::Error::TooManyHeaders)
}

/// How much of a partial head [`cannot_be_a_request`] looks at: what gives away bytes that
/// are no request (a TLS record, a binary protocol) is in their first few.
const EARLY_CHECK: usize = 1024;

/// The length of the head at the start of `buf` (through its empty line), once it is all
/// there, looking from `from` on (an offset an earlier call returned for a shorter `buf`).
/// Bare `LF` line ends count, as they do for httparse and hyper (RFC 9112 §2.2). Not all
/// there: where to look from once more bytes have come.
fn head_end(buf: &[u8], from: usize) -> Result<usize, usize> {
    let mut from = from.min(buf.len());
    while let Some(i) = memchr::memchr(b'\n', &buf[from..]) {
        let next = &buf[from + i + 1..];
        if next.starts_with(b"\n") {
            return Ok(from + i + 2);
        }
        if next.starts_with(b"\r\n") {
            return Ok(from + i + 3);
        }
        if next.len() < 2 {
            break;
        }
        from += i + 1;
    }
    // A line end in the last two bytes may still begin the empty line.
    Err(buf.len().saturating_sub(2))
}

/// The request in `head`, if the fast path serves it; `None` hands it to hyper.
fn parse_head(head: &Bytes) -> Option<Head> {
    // Uninitialised slots: zeroing 100 of them cost more than parsing a small request.
    let mut fields =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    match req.parse_with_uninit_headers(head, &mut fields) {
        Ok(httparse::Status::Complete(n)) if n == head.len() => {}
        // Too many fields, bad syntax, HTTP/2's preface: hyper gives the answer.
        _ => return None,
    }
    if req.version != Some(1) {
        return None;
    }
    let method = Method::from_bytes(req.method?.as_bytes()).ok()?;
    if method == Method::CONNECT {
        return None;
    }
    let uri = Uri::from_maybe_shared(head.slice_ref(req.path?.as_bytes())).ok()?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    let mut content_length = None;
    let mut close = false;
    for f in req.headers.iter() {
        let name = HeaderName::from_bytes(f.name.as_bytes()).ok()?;
        if name == CONTENT_LENGTH {
            // The framing watch refuses a length line it cannot hold whole; so does this.
            let line = (f.value.as_ptr() as usize + f.value.len()) - f.name.as_ptr() as usize;
            if content_length.is_some() || line > framing::LINE_CAP {
                return None;
            }
            content_length = Some(decimal(f.value)?);
        } else if name == TRANSFER_ENCODING || name == EXPECT || name == UPGRADE || name == TE {
            return None;
        } else if name == CONNECTION {
            close |= headers::has_token(f.value, b"close");
        }
        let value = HeaderValue::from_maybe_shared(head.slice_ref(f.value)).ok()?;
        headers.append(name, value);
    }
    Some(Head {
        method,
        uri,
        headers,
        content_length: content_length.unwrap_or(0),
        close,
    })
}

/// A request's `Content-Length`: digits only, no sign, no list, at most 18 of them (a
/// longer one goes to hyper's path, whose framing watch refuses one over `i64::MAX`;
/// hyper itself takes nearly any `u64`).
fn decimal(v: &[u8]) -> Option<u64> {
    if v.len() > 18 {
        return None;
    }
    length(v)
}

/// An answer's `Content-Length`, any that fits in 64 bits: the pool has checked its form,
/// and one the writer could not read was dropped, the answer then ending with the
/// connection, so that one the upstream cut short looked whole.
fn length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// A request body of known length, read from the client socket as the upstream takes it.
struct FastBody {
    shared: Arc<Shared>,
    activity: Activity,
    /// Body bytes that arrived with the head.
    prefix: Option<Bytes>,
    left: u64,
    buf: BytesMut,
}

/// Large reads for large bodies: an upload moves in pieces of up to this (fewer system
/// calls per byte; 64 KiB reads left a 1 GiB upload at 0.68x of going direct).
const BODY_READ: usize = 256 * 1024;

impl Body for FastBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        loop {
            if this.shared.abandoned.load(Ordering::Acquire) {
                return Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "answered before the body was read",
                ))));
            }
            let want = this.left.min(BODY_READ as u64) as usize;
            // The last piece has usually gone upstream by now: take its memory back
            // rather than allocate (and, at this size, map) a new one.
            if this.buf.capacity() < want && !this.buf.try_reclaim(want) {
                this.buf = BytesMut::with_capacity(want);
            }
            // Never past this body's end: what follows is the next request's.
            match this
                .shared
                .sock
                .read_draining(&mut (&mut this.buf).limit(want))
            {
                Ok(0) => {
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "client closed the connection mid-body",
                    ))))
                }
                Ok(n) => {
                    this.activity.touch();
                    this.left -= n as u64;
                    this.shared.body_left.store(this.left, Ordering::Relaxed);
                    if this.left == 0 {
                        // The socket is the connection's again (see `Shared::body_read`).
                        this.shared.released.notify_one();
                    }
                    let data = this.buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    this.shared.reader.register(cx.waker());
                    if this.shared.abandoned.load(Ordering::Acquire) {
                        continue;
                    }
                    ready!(this.shared.sock.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left + self.prefix.as_ref().map_or(0, |p| p.len() as u64))
    }
}

impl Drop for FastBody {
    fn drop(&mut self) {
        // Stores a permit when nobody waits yet: `reader_released` cannot miss it.
        self.shared.released.notify_one();
    }
}

/// How the response body is delimited on the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
}

/// How a response gets written: already, or by a future; either way, whether it went out
/// whole and framed so that the connection could carry another request (a failed write,
/// a cut body or a close-delimited answer end it; `close` is the caller's to add).
///
/// The future is boxed here, not by the caller: a `match` on this value keeps it in the
/// caller's state across the `.await`, and an inline writer there would grow every idle
/// connection's task by its size.
enum Write<'a> {
    Done(bool),
    Later(Pin<Box<dyn Future<Output = bool> + Send + 'a>>),
}

/// Small answers whose body is all here are written before [`write_response`] returns.
const WRITE_NOW: u64 = 16 * 1024;

/// Writes the response (see [`Write`] for what it returns).
///
/// Not an `async fn`: the head is built before any future exists. Most answers are small
/// and whole by the time their head is: those are written right here, and no future is
/// made at all. Otherwise the boxed future holds only what streaming the body needs.
fn write_response<'a>(
    sock: &'a Sock,
    activity: &'a Activity,
    resp: Response<ProxyBody>,
    is_head: bool,
    close: bool,
) -> Write<'a> {
    let (mut parts, mut body) = resp.into_parts();
    let status = parts.status;
    // A 204 must not carry a length (RFC 9110 §8.6), the upstream's included. The
    // response phase drops it for every version (`Proxy::respond`); the writer keeps
    // HTTP/1 framing right whatever it is handed, as hyper's HTTP/1 server does.
    if status == StatusCode::NO_CONTENT {
        parts.headers.remove(CONTENT_LENGTH);
    }
    let bodyless = is_head
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational();
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .map(|v| length(v.as_bytes()));
    let framing = match (declared, body.size_hint().exact()) {
        // A length that is not a number cannot frame anything: close-delimit instead.
        // Boxed: rare, and inline it would double this future's size.
        (Some(None), _) => {
            return Write::Later(Box::pin(write_close_delimited(sock, activity, parts, body)))
        }
        (Some(Some(n)), _) => Framing::Length(n),
        (None, Some(n)) => Framing::Length(n),
        (None, None) => Framing::Chunked,
    };

    let mut out = Vec::with_capacity(512);
    head(&mut out, status, &parts.headers);
    // Without a length from the upstream, an empty answer to HEAD, a 204 or a 304 says
    // none (as hyper's server does): `content-length: 0` would misstate a HEAD's resource
    // and a 304's, and a 204 must not carry one (RFC 9110 §8.6).
    let implied = |n: u64| bodyless && (n == 0 || status == StatusCode::NO_CONTENT);
    match framing {
        Framing::Length(n) if declared.is_none() && !implied(n) => {
            field(&mut out, b"content-length", itoa(n).as_bytes());
        }
        Framing::Chunked if !bodyless => field(&mut out, b"transfer-encoding", b"chunked"),
        _ => {}
    }
    if close {
        field(&mut out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    #[cfg(target_os = "linux")]
    if let (Framing::Length(n), false, Sock::Tcp(tcp)) = (framing, bodyless, sock) {
        if let Some(offered) = parts.extensions.get::<pool::Splice>() {
            if let Some((source, pipe)) = offered.take(n) {
                let splicing = splice_body(tcp, sock, activity, out, source, pipe);
                return Write::Later(Box::pin(splicing));
            }
        }
    }
    drop(parts);
    let mut left = match framing {
        Framing::Length(n) => n,
        _ => u64::MAX,
    };
    let chunked = framing == Framing::Chunked;
    if bodyless || (!chunked && left <= WRITE_NOW) {
        match take_now(&mut body, &mut out, &mut left, bodyless) {
            Taken::Whole => {
                return match write_now(sock, activity, &mut out) {
                    Ok(true) => Write::Done(true),
                    Ok(false) => Write::Later(Box::pin(async move {
                        write_all(sock, activity, &out, &[]).await.is_ok()
                    })),
                    Err(_) => Write::Done(false),
                };
            }
            // What came is sent, and the connection ends: the client must not wait for
            // the rest, nor read past a cut.
            broken @ (Taken::Broken | Taken::Left) => {
                match broken {
                    Taken::Left => activity.client_broke(),
                    _ => activity.upstream_broke(),
                }
                return Write::Later(Box::pin(async move {
                    let _ = write_all(sock, activity, &out, &[]).await;
                    false
                }));
            }
            Taken::Later => {}
        }
    }
    Write::Later(Box::pin(stream_body(
        sock, activity, body, out, left, chunked,
    )))
}

/// The rest of [`write_response`]'s answer, as its body gives it: `out` (the head, and
/// what came with it) goes out when the body has nothing more right now; at most `left`
/// bytes of a sized body, chunks of an unsized one. Whether the connection may serve
/// another request.
///
/// Not an `async fn`: one would hold its arguments and its own copies of them (+64 bytes
/// in every streamed answer's future).
#[allow(clippy::manual_async_fn)] // on purpose: see above
fn stream_body<'a>(
    sock: &'a Sock,
    activity: &'a Activity,
    mut body: ProxyBody,
    mut out: Vec<u8>,
    mut left: u64,
    chunked: bool,
) -> impl Future<Output = bool> + 'a {
    async move {
        loop {
            // Frames already there join what is queued; the queue goes out when the body has
            // nothing more right now, so a stream is never held back and a small answer
            // leaves in one write.
            let next = match body.frame().now_or_never() {
                Some(f) => f,
                None => {
                    if !out.is_empty() {
                        if write_all(sock, activity, &out, &[]).await.is_err() {
                            return false;
                        }
                        out.clear();
                    }
                    body.frame().await
                }
            };
            let frame = match next {
                None => break,
                Some(Ok(f)) => f,
                Some(Err(e)) => {
                    // The upstream broke mid-answer: what was sent stands, the client sees the
                    // connection close before the end. Or the client's upload broke under
                    // an early answer: its doing.
                    match failure::client_left(&e) {
                        true => activity.client_broke(),
                        false => activity.upstream_broke(),
                    }
                    let _ = write_all(sock, activity, &out, &[]).await;
                    return false;
                }
            };
            // Trailers are dropped: a client that takes them said `TE: trailers`, and such a
            // request is hyper's, whose rule (only fields the `Trailer` field announces) is
            // then the one rule on every path.
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.is_empty() {
                continue;
            }
            let data = if chunked {
                chunk_size(&mut out, data.len());
                data
            } else if (data.len() as u64) > left {
                // More than the declared length: the rest cannot be framed.
                activity.upstream_broke();
                let cut = data.slice(..left as usize);
                let _ = write_all(sock, activity, &out, &cut).await;
                return false;
            } else {
                left -= data.len() as u64;
                data
            };
            if data.len() <= 16 * 1024 && out.len() < 64 * 1024 {
                out.extend_from_slice(&data);
            } else {
                if write_all(sock, activity, &out, &data).await.is_err() {
                    return false;
                }
                out.clear();
            }
            if chunked {
                out.extend_from_slice(b"\r\n");
            }
        }
        if chunked {
            out.extend_from_slice(b"0\r\n\r\n");
        } else if left != 0 {
            // Shorter than declared: the client must not wait for the rest.
            activity.upstream_broke();
            let _ = write_all(sock, activity, &out, &[]).await;
            return false;
        }
        write_all(sock, activity, &out, &[]).await.is_ok()
    }
}

/// [`write_response`] on a socket of the caller's, the fast path's writer as the connection
/// drives it: whether the connection may serve another request (unless `close`). For the
/// `response_writer` fuzz target, which holds what it writes to hyper's client.
#[doc(hidden)]
pub async fn write_one(
    sock: UnixStream,
    resp: Response<ProxyBody>,
    is_head: bool,
    close: bool,
) -> bool {
    let sock = Sock::Unix(sock);
    let activity = Activity::new();
    // Bound before returning: the writing future borrows `sock` and `activity`.
    let written = match write_response(&sock, &activity, resp, is_head, close) {
        Write::Done(written) => written,
        Write::Later(writing) => writing.await,
    };
    written
}

/// The fast path's head reader on `data` arriving at once: the request it serves itself
/// (method, target, fields), its `Content-Length`, whether it asked to close, and the
/// bytes its head took; `None` when it waits for more or hands the connection to hyper.
/// For the `fast_head` fuzz target, which holds it to hyper's server and the framing watch.
#[doc(hidden)]
pub fn read_one_head(data: &[u8]) -> Option<(Request<()>, u64, bool, usize)> {
    let mut buf = BytesMut::from(data);
    let mut scanned = 0;
    match parse(&mut buf, &mut scanned) {
        Parsed::Head(head) => {
            let (length, close, taken) = (head.content_length, head.close, data.len() - buf.len());
            let req = head.into_request(body::empty()).map(|_| ());
            Some((req, length, close, taken))
        }
        Parsed::Partial | Parsed::HandOver => None,
    }
}

/// What [`take_now`] found.
enum Taken {
    /// The whole body is in `out`.
    Whole,
    /// The body failed, was longer than declared, or ended short; `out` holds what may
    /// still be sent.
    Broken,
    /// As `Broken`, by the client: its upload broke under an early answer.
    Left,
    /// More is to come; `out` and `left` account for what was taken.
    Later,
}

/// Takes the frames of a small sized body that are already here into `out`.
fn take_now(body: &mut ProxyBody, out: &mut Vec<u8>, left: &mut u64, bodyless: bool) -> Taken {
    if bodyless {
        return Taken::Whole;
    }
    loop {
        let frame = match body.frame().now_or_never() {
            None => return Taken::Later,
            Some(None) if *left == 0 => return Taken::Whole,
            Some(Some(Err(e))) if failure::client_left(&e) => return Taken::Left,
            Some(None) | Some(Some(Err(_))) => return Taken::Broken,
            Some(Some(Ok(frame))) => frame,
        };
        // Trailers have no place in a sized answer.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.len() as u64 > *left {
            out.extend_from_slice(&data[..*left as usize]);
            return Taken::Broken;
        }
        *left -= data.len() as u64;
        out.extend_from_slice(&data);
    }
}

/// One write attempt for a whole answer: `Ok(true)` when all of it went, otherwise `out`
/// keeps what is left.
fn write_now(sock: &Sock, activity: &Activity, out: &mut Vec<u8>) -> io::Result<bool> {
    match sock.try_write_vectored(&[io::IoSlice::new(out)]) {
        Ok(0) => Err(io::ErrorKind::WriteZero.into()),
        Ok(n) => {
            activity.touch();
            out.drain(..n);
            Ok(out.is_empty())
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    }
}

/// A large sized answer on a plain TCP upstream connection, to a plain TCP client: the head
/// and the bytes that came with the upstream's head written, the rest spliced from socket
/// to socket ([`super::splice`]).
#[cfg(target_os = "linux")]
async fn splice_body(
    tcp: &TcpStream,
    sock: &Sock,
    activity: &Activity,
    head: Vec<u8>,
    mut source: pool::SpliceSource,
    pipe: super::splice::Pipe,
) -> bool {
    let first = source.buffered();
    if write_all(sock, activity, &head, &first).await.is_err() {
        return false;
    }
    let (moved, broke) = (|| activity.touch(), || activity.upstream_broke());
    match source.splice_to(pipe, tcp, moved, broke).await {
        Ok(()) => true,
        // Marked by `broke` as it happened.
        Err(super::splice::Broken::Source(_)) => false,
        Err(super::splice::Broken::Sink(_)) => {
            activity.client_broke();
            false
        }
    }
}

/// An answer whose `Content-Length` is unusable: sent without it, ended by the close.
async fn write_close_delimited(
    sock: &Sock,
    activity: &Activity,
    mut parts: http::response::Parts,
    mut body: ProxyBody,
) -> bool {
    parts.headers.remove(CONTENT_LENGTH);
    let mut out = Vec::with_capacity(512);
    head(&mut out, parts.status, &parts.headers);
    out.extend_from_slice(b"connection: close\r\n\r\n");
    if write_all(sock, activity, &out, &[]).await.is_err() {
        return false;
    }
    // Ended by the close, whole or not: a failed side is said (see `AnswerCut`).
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            activity.upstream_broke();
            break;
        };
        if let Ok(data) = frame.into_data() {
            if write_all(sock, activity, &data, &[]).await.is_err() {
                break;
            }
        }
    }
    false
}

/// The status line and the answer's fields, with a `Date` if it came without one (RFC 9110
/// §6.6.1: a recipient with a clock that forwards an undated answer dates it).
fn head(out: &mut Vec<u8>, status: StatusCode, headers: &HeaderMap) {
    status_line(out, status);
    for (name, value) in headers {
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if !headers.contains_key(DATE) {
        with_date(|d| field(out, b"date", d));
    }
}

fn status_line(out: &mut Vec<u8>, status: StatusCode) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn chunk_size(out: &mut Vec<u8>, n: usize) {
    let digits = (usize::BITS - n.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        out.push(b"0123456789abcdef"[(n >> (i * 4)) & 0xf]);
    }
    out.extend_from_slice(b"\r\n");
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Decimal digits of `n` without going through `fmt`.
fn itoa(mut n: u64) -> Digits {
    let mut d = Digits {
        buf: [0; 20],
        start: 20,
    };
    loop {
        d.start -= 1;
        d.buf[d.start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return d;
        }
    }
}

struct Digits {
    buf: [u8; 20],
    start: usize,
}

impl Digits {
    fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

/// The `Date` value, formatted once a second per thread (as hyper does).
fn with_date<R>(f: impl FnOnce(&[u8]) -> R) -> R {
    with_date_at(SystemTime::now(), f)
}

/// [`with_date`] at `now`, which tests choose.
fn with_date_at<R>(now: SystemTime, f: impl FnOnce(&[u8]) -> R) -> R {
    use std::cell::RefCell;
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
    }
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with(|cell| {
        let mut cached = cell.borrow_mut();
        if cached.0 != secs || cached.1.is_empty() {
            *cached = (secs, httpdate::fmt_http_date(now));
        }
        f(cached.1.as_bytes())
    })
}

/// Writes `a` then `b`, in as few system calls as the socket allows.
async fn write_all(sock: &Sock, activity: &Activity, a: &[u8], b: &[u8]) -> io::Result<()> {
    let (mut a, mut b) = (a, b);
    while !a.is_empty() || !b.is_empty() {
        let slices = [io::IoSlice::new(a), io::IoSlice::new(b)];
        let failed = match sock.try_write_vectored(&slices) {
            Ok(0) => io::ErrorKind::WriteZero.into(),
            Ok(n) => {
                activity.touch();
                let from_a = n.min(a.len());
                a = &a[from_a..];
                b = &b[n - from_a..];
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match sock.writable().await {
                Ok(()) => continue,
                Err(e) => e,
            },
            Err(e) => e,
        };
        // For the `answer cut` line, should this end an answer (see `AnswerCut`).
        activity.client_broke();
        return Err(failed);
    }
    Ok(())
}

/// The first byte a client sends (`None`: it closed or failed first), which tells a TLS
/// handshake from plain HTTP on the TLS listener. Read, not peeked (a unix socket cannot
/// peek): the caller gives it back with [`Rewind`].
pub(super) async fn first_byte(sock: &Sock) -> Option<u8> {
    let mut byte = [0u8; 1];
    loop {
        sock.readable().await.ok()?;
        match sock.try_read_buf(&mut &mut byte[..]) {
            Ok(0) => return None,
            Ok(_) => return Some(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return None,
        }
    }
}

/// Bytes already read from a connection, served before the rest of it: how a connection
/// the fast path started goes on under hyper, and how the TLS listener gives back the
/// first byte it read to tell TLS from plain HTTP (`listener::tls_or_plain`).
pub struct Rewind {
    prefix: Bytes,
    inner: Sock,
}

impl Rewind {
    pub fn new(inner: Sock, prefix: Bytes) -> Self {
        Rewind { prefix, inner }
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        match &mut self.inner {
            Sock::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Sock::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.inner {
            Sock::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Sock::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.inner {
            Sock::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Sock::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.inner {
            Sock::Tcp(s) => Pin::new(s).poll_flush(cx),
            Sock::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.inner {
            Sock::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Sock::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn head_of(raw: &str) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(raw.as_bytes());
        (parse(&mut buf, &mut 0), buf)
    }

    /// The path an `answer cut` line shows: whole up to 96 bytes; longer, cut at a
    /// character and marked, never `/` for a path that was something else.
    #[test]
    fn a_long_path_is_shown_cut_and_marked() {
        let shown = |path: &str| ShortPath::of(path).uri().path().to_string();
        let exact = format!("/{}", "a".repeat(95));
        assert_eq!(shown(&exact), exact);
        let long = format!("/sandboxes/{}/tail", "a".repeat(110));
        assert_eq!(shown(&long), format!("{}...", &long[..93]));
        // A two-byte character across the cut (bytes 92 and 93) is left out whole.
        let wide = format!("/sandboxes/{}\u{e9}/x{}", "b".repeat(81), "c".repeat(20));
        assert_eq!(shown(&wide), format!("/sandboxes/{}...", "b".repeat(81)));
        // Nor half a percent escape: `%C3` at bytes 91-93 goes whole.
        let escaped = format!("/sandboxes/{}%C3%A9/x{}", "b".repeat(80), "c".repeat(20));
        assert_eq!(shown(&escaped), format!("/sandboxes/{}...", "b".repeat(80)));
    }

    /// While a request is answered, the connection looks for the client hanging up. With
    /// pipelined requests already buffered it must not read on: a client that sends and
    /// reads without pause made each request pull another 512 bytes and more into `buf`,
    /// which grew without bound (and was copied whole each time).
    #[tokio::test]
    async fn the_hang_up_watch_reads_nothing_while_requests_wait_in_the_buffer() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let sock = Sock::Unix(ours);
        theirs
            .write_all(b"GET /third HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        sock.readable().await.unwrap();
        let mut buf = BytesMut::from(&b"GET /second HTTP/1.1\r\n\r\n"[..]);
        let queued = buf.len();
        {
            let gone = client_gone(&sock, &mut buf);
            tokio::pin!(gone);
            let polled = std::future::poll_fn(|cx| Poll::Ready(gone.as_mut().poll(cx))).await;
            assert!(polled.is_pending());
        }
        assert_eq!(buf.len(), queued, "read past the buffered request");

        // With nothing buffered, a hang-up is seen.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let sock = Sock::Unix(ours);
        drop(theirs);
        client_gone(&sock, &mut BytesMut::new()).await;
    }

    #[test]
    fn head_end_takes_crlf_and_bare_lf_and_waits_for_the_rest() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nrest", 0), Ok(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\nA: b\n\nrest", 0), Ok(21));
        assert_eq!(head_end(b"\r\nGET / HTTP/1.1\r\n\r\n", 0), Ok(20));
        for partial in [
            "GET / HTTP/1.1\r\nA: b\r\n",
            "GET / HTTP/1.1\r\nA: b\r\n\r",
            "",
        ] {
            assert!(head_end(partial.as_bytes(), 0).is_err(), "{partial:?}");
        }
    }

    /// A head arriving in pieces, of any size and split anywhere, is found where one scan
    /// of it whole finds it, each piece scanned from where the last one left off; and the
    /// scans add up to about the head's length, not to a scan of it per piece.
    #[test]
    fn a_head_in_pieces_is_scanned_once() {
        for head in [
            &b"GET / HTTP/1.1\r\nA: b\r\n\r\nrest"[..],
            b"GET / HTTP/1.1\nA: b\n\nrest",
            b"\r\nGET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\r\nC: d\n\r\n",
        ] {
            let whole = head_end(head, 0);
            for piece in 1..=4 {
                let (mut from, mut looked) = (0, 0);
                let mut found = Err(0);
                for end in (piece..head.len() + piece).step_by(piece) {
                    let buf = &head[..end.min(head.len())];
                    looked += buf.len() - from.min(buf.len());
                    found = head_end(buf, from);
                    match found {
                        Ok(_) => break,
                        Err(resume) => from = resume,
                    }
                }
                assert_eq!(found, whole, "{head:?} in pieces of {piece}");
                assert!(looked <= head.len() * 3, "{looked} bytes looked at");
            }
        }
    }

    /// A head arriving in pieces is waited for while it can still be an HTTP/1 request;
    /// bytes no such request can start with go to hyper at once, all of them kept.
    #[test]
    fn a_partial_head_is_waited_for_only_while_it_can_be_a_request() {
        for partial in [
            "G",
            "GET /x HTT",
            "\r\nGET /x HTTP/1.1\r",
            "GET /x HTTP/1.1\r\nHost: a\r\n",
        ] {
            assert!(matches!(head_of(partial).0, Parsed::Partial), "{partial:?}");
        }
        // The start of a TLS ClientHello (record type 22, version 3.1), a method with a
        // byte no token has, a request line with another protocol, and HTTP/2's preface
        // (hyper's, whole or not).
        // A ClientHello with a post-quantum key share (X25519MLKEM768) is about 1.5 KiB.
        let large_hello = format!("\x16\x03\x01\x06\x00{}", "\x01".repeat(1500));
        for other in [
            "\x16\x03\x01\x02\x00\x01\x00\x01\x7c\x03\x03",
            large_hello.as_str(),
            "G@T / HTTP/1.1",
            "GET /x FTP/1",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n",
        ] {
            let (parsed, rest) = head_of(other);
            assert!(matches!(parsed, Parsed::HandOver), "{other:?}");
            assert_eq!(&rest[..], other.as_bytes(), "{other:?}: bytes lost");
        }
    }

    #[test]
    fn plain_requests_are_served_here_with_the_body_left_in_the_buffer() {
        let (parsed, rest) =
            head_of("POST /v2/sandboxes?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nConnection: keep-alive, Close\r\n\r\nhello");
        let Parsed::Head(head) = parsed else {
            panic!("not served by the fast path")
        };
        assert_eq!(head.method, Method::POST);
        assert_eq!(head.uri, "/v2/sandboxes?x=1");
        assert_eq!(head.content_length, 5);
        assert!(head.close);
        assert_eq!(head.headers["host"], "a");
        assert_eq!(&rest[..], b"hello");
    }

    #[test]
    fn anything_unusual_goes_to_hyper_with_every_byte_kept() {
        let long_ows = " ".repeat(60);
        for raw in [
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_string(),
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello".into(),
            "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\nhello".into(),
            "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello".into(),
            format!("POST / HTTP/1.1\r\nContent-Length:{long_ows}5\r\n\r\nhello"),
            "PUT / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n".into(),
            "GET / HTTP/1.1\r\nTE: trailers\r\n\r\n".into(),
            "GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n".into(),
            "GET / HTTP/1.0\r\n\r\n".into(),
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".into(),
            "CONNECT a:443 HTTP/1.1\r\n\r\n".into(),
            "GET / HTTP/1.1\r\nX-A: 1\rX-B: 2\r\n\r\n".into(),
            "GET /\x7f HTTP/1.1\r\n\r\n".into(),
        ] {
            let (parsed, rest) = head_of(&raw);
            assert!(matches!(parsed, Parsed::HandOver), "{raw:?}");
            assert_eq!(&rest[..], raw.as_bytes(), "{raw:?}: bytes lost");
        }
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "X-A: 1\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(matches!(head_of(&many).0, Parsed::HandOver));
        let big = format!("GET / HTTP/1.1\r\nX-A: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert!(matches!(head_of(&big).0, Parsed::HandOver));
    }

    /// A head of `MAX_HEAD` bytes and a `Content-Length` line of `LINE_CAP` (the framing
    /// watch's limit) are served by the fast path; one byte more is handed to hyper.
    #[test]
    fn the_fast_path_takes_heads_and_length_lines_up_to_their_limits() {
        let head_of_len = |len: usize| {
            let bare = "GET / HTTP/1.1\r\nX-A: \r\n\r\n".len();
            format!("GET / HTTP/1.1\r\nX-A: {}\r\n\r\n", "a".repeat(len - bare))
        };
        let at_limit = head_of_len(MAX_HEAD);
        assert_eq!(at_limit.len(), MAX_HEAD);
        assert!(matches!(head_of(&at_limit).0, Parsed::Head(_)));
        assert!(matches!(
            head_of(&head_of_len(MAX_HEAD + 1)).0,
            Parsed::HandOver
        ));

        // `Content-Length:`, spaces, `5`: the line from the name to the end of the value.
        let length_line = |len: usize| {
            let ows = " ".repeat(len - "Content-Length:5".len());
            format!("POST / HTTP/1.1\r\nContent-Length:{ows}5\r\n\r\nhello")
        };
        let Parsed::Head(head) = head_of(&length_line(framing::LINE_CAP)).0 else {
            panic!("a length line of LINE_CAP bytes handed over");
        };
        assert_eq!(head.content_length, 5);
        let over = length_line(framing::LINE_CAP + 1);
        assert!(matches!(head_of(&over).0, Parsed::HandOver));
    }

    /// The `Date` of an answer is the second it is written in: formatted once a second,
    /// not once a thread.
    #[test]
    fn the_date_follows_the_clock_to_the_second() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |t: SystemTime| with_date_at(t, |d| String::from_utf8_lossy(d).into_owned());
        let later = start + Duration::from_secs(1);
        assert_eq!(at(start), httpdate::fmt_http_date(start));
        assert_eq!(
            at(start + Duration::from_millis(999)),
            httpdate::fmt_http_date(start)
        );
        assert_eq!(at(later), httpdate::fmt_http_date(later));
        assert_ne!(at(later), at(start));
    }

    #[test]
    fn numbers_on_the_wire() {
        assert_eq!(itoa(0).as_bytes(), b"0");
        assert_eq!(itoa(u64::MAX).as_bytes(), u64::MAX.to_string().as_bytes());
        for n in [0usize, 1, 15, 16, 255, 4096, 65535, 1 << 20] {
            let mut out = Vec::new();
            chunk_size(&mut out, n);
            assert_eq!(out, format!("{n:x}\r\n").into_bytes());
        }
        assert_eq!(decimal(b"0012"), Some(12));
        assert_eq!(
            decimal(b"999999999999999999"),
            Some(999_999_999_999_999_999)
        );
        for bad in [&b""[..], b"1 2", b"-1", b"0x5", b"1234567890123456789"] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }

    /// Writes `resp` through a real socket and returns what the client reads.
    async fn on_the_wire(resp: Response<ProxyBody>, is_head: bool, close: bool) -> (bool, String) {
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        let keep = write_one(ours, resp, is_head, close).await && !close;
        let mut got = String::new();
        theirs.read_to_string(&mut got).await.expect("read");
        (keep, got)
    }

    fn with_date_removed(wire: &str) -> String {
        wire.split_inclusive("\r\n")
            .filter(|l| !l.starts_with("date: "))
            .collect()
    }

    #[tokio::test]
    async fn a_sized_answer_goes_out_with_its_length_and_a_head_answer_without_body() {
        let resp = Response::new(body::full("hello"));
        let (keep, wire) = on_the_wire(resp, false, false).await;
        assert!(keep);
        assert!(wire.contains("\r\ndate: "), "{wire}");
        assert_eq!(
            with_date_removed(&wire),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
        );

        let mut resp = Response::new(body::empty());
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("42"));
        let (keep, wire) = on_the_wire(resp, true, true).await;
        assert!(!keep, "close was asked for");
        assert_eq!(
            with_date_removed(&wire),
            "HTTP/1.1 200 OK\r\ncontent-length: 42\r\nconnection: close\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn bodiless_answers_state_no_length_the_upstream_did_not_give() {
        let answer = |status: u16, b: ProxyBody| {
            let mut resp = Response::new(b);
            *resp.status_mut() = StatusCode::from_u16(status).unwrap();
            resp
        };
        // An upstream's empty body may not say its size: no chunk either.
        let unsized_empty = || {
            let none = futures_util::stream::iter(Vec::<Result<Frame<Bytes>, io::Error>>::new());
            body::boxed(StreamBody::new(none))
        };
        for (status, is_head) in [(200, true), (204, false), (304, false), (304, true)] {
            for empty in [body::empty(), unsized_empty()] {
                let (keep, wire) = on_the_wire(answer(status, empty), is_head, false).await;
                assert!(keep, "{status}: {wire}");
                assert!(!wire.contains("content-length"), "{status}: {wire}");
                assert!(!wire.contains("transfer-encoding"), "{status}: {wire}");
                assert!(wire.ends_with("\r\n\r\n"), "{status}: {wire}");
            }
        }
        // The length an upstream gave a HEAD answer stands, and the connection goes on.
        let mut resp = answer(200, body::empty());
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("42"));
        let (keep, wire) = on_the_wire(resp, true, false).await;
        assert!(keep, "{wire}");
        let wire = with_date_removed(&wire);
        assert!(wire.ends_with("content-length: 42\r\n\r\n"), "{wire}");
        // A 204's length is dropped, even the upstream's (RFC 9110 §8.6); a 304's stands.
        for (status, kept) in [(204, false), (304, true)] {
            let mut resp = answer(status, body::empty());
            resp.headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from_static("5"));
            let (keep, wire) = on_the_wire(resp, false, false).await;
            assert!(keep, "{status}: {wire}");
            assert_eq!(
                wire.contains("content-length: 5\r\n"),
                kept,
                "{status}: {wire}"
            );
            assert!(wire.ends_with("\r\n\r\n"), "{status}: no body: {wire}");
        }
        // A HEAD answer the proxy wrote itself states the length its GET would have.
        let (_, wire) = on_the_wire(answer(503, body::full("{}")), true, false).await;
        assert!(wire.contains("content-length: 2\r\n"), "{wire}");
        assert!(wire.ends_with("\r\n\r\n"), "no body: {wire}");
        // An empty GET answer is `content-length: 0`, as before.
        let (_, wire) = on_the_wire(answer(200, body::empty()), false, false).await;
        assert!(wire.contains("content-length: 0\r\n"), "{wire}");
    }

    #[tokio::test]
    async fn an_unsized_answer_is_chunked_and_a_short_one_closes() {
        let frames = ["ab", "", "cdefghijklmnopq"]
            .map(|s| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(s))));
        let stream = StreamBody::new(futures_util::stream::iter(frames));
        let (keep, wire) = on_the_wire(Response::new(body::boxed(stream)), false, false).await;
        assert!(keep);
        assert!(
            wire.ends_with(
                "transfer-encoding: chunked\r\n\r\n2\r\nab\r\nf\r\ncdefghijklmnopq\r\n0\r\n\r\n"
            ),
            "{wire}"
        );

        // A body shorter than its declared length: the connection must not be reused.
        let mut resp = Response::new(body::boxed(Full::new(Bytes::from("abc"))));
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("10"));
        let (keep, wire) = on_the_wire(resp, false, false).await;
        assert!(!keep);
        assert!(wire.ends_with("\r\n\r\nabc"), "{wire}");
    }

    fn sized(
        len: &'static str,
        frames: Vec<Result<Frame<Bytes>, io::Error>>,
    ) -> Response<ProxyBody> {
        let stream = StreamBody::new(futures_util::stream::iter(frames));
        let mut resp = Response::new(body::boxed(stream));
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static(len));
        resp
    }

    /// A `Content-Length` that is not one number frames nothing: the answer goes without
    /// it, dated like every other, and ends with the connection.
    #[tokio::test]
    async fn an_answer_with_an_unusable_length_is_ended_by_the_close() {
        let data = |s: &'static str| Ok(Frame::data(Bytes::from(s)));
        for len in ["5, 5", "x"] {
            let (keep, wire) =
                on_the_wire(sized(len, vec![data("hel"), data("lo")]), false, false).await;
            assert!(!keep);
            assert!(!wire.contains("content-length"), "{wire}");
            assert!(wire.contains("\r\ndate: "), "{wire}");
            assert!(
                wire.ends_with("\r\nconnection: close\r\n\r\nhello"),
                "{wire}"
            );
        }
    }

    #[tokio::test]
    async fn a_sized_answer_that_breaks_sends_what_fits_and_closes() {
        let data = |s: &'static str| Ok(Frame::data(Bytes::from(s)));
        // Longer than declared: cut at the length.
        let (keep, wire) =
            on_the_wire(sized("4", vec![data("ab"), data("cdef")]), false, false).await;
        assert!(!keep);
        assert!(wire.ends_with("\r\n\r\nabcd"), "{wire}");
        // The body fails after a first piece.
        let failed = Err(io::Error::other("upstream reset"));
        let (keep, wire) = on_the_wire(sized("6", vec![data("abc"), failed]), false, false).await;
        assert!(!keep);
        assert!(wire.ends_with("\r\n\r\nabc"), "{wire}");
    }

    #[tokio::test]
    async fn a_small_answer_to_a_full_socket_is_handed_to_the_writer_whole() {
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        // The client reads nothing yet: fill the socket until it takes no more.
        let filler = [b'x'; 64 * 1024];
        let mut filled = 0;
        loop {
            match ours.try_write(&filler) {
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the socket: {e}"),
            }
        }
        let sock = Sock::Unix(ours);
        let activity = Activity::new();
        let body = format!("{}END", "y".repeat(WRITE_NOW as usize - 3));
        let resp = Response::new(body::full(body.clone()));
        let Write::Later(writing) = write_response(&sock, &activity, resp, false, false) else {
            panic!("a full socket took the answer at once");
        };
        let read = async {
            let mut got = Vec::new();
            let mut chunk = vec![0; 64 * 1024];
            while !got.ends_with(b"END") {
                let n = theirs.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the answer stopped after {} bytes", got.len());
                got.extend_from_slice(&chunk[..n]);
            }
            got
        };
        let (keep, got) = tokio::join!(writing, read);
        assert!(keep);
        assert!(got[..filled].iter().all(|&b| b == b'x'));
        let answer = String::from_utf8(got[filled..].to_vec()).expect("utf-8");
        assert_eq!(
            with_date_removed(&answer),
            format!("HTTP/1.1 200 OK\r\ncontent-length: 16384\r\n\r\n{body}")
        );
    }

    #[tokio::test]
    async fn a_sized_answer_whose_rest_comes_later_is_written_whole() {
        use futures_util::StreamExt;
        let (tx, rx) = tokio::sync::oneshot::channel::<&'static str>();
        let first =
            futures_util::stream::iter([Ok::<_, io::Error>(Frame::data(Bytes::from("head-")))]);
        let rest = futures_util::stream::once(async move {
            Ok(Frame::data(Bytes::from(rx.await.unwrap_or("lost"))))
        });
        // And in two pieces, the first shorter than what is left.
        let last = futures_util::stream::iter([Ok(Frame::data(Bytes::from("il")))]);
        let body = StreamBody::new(first.chain(rest).chain(last));
        let mut resp = Response::new(body::boxed(body));
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("9"));
        // The rest is sent only once the writer has taken the first piece and waits.
        let ((keep, wire), _) =
            tokio::join!(on_the_wire(resp, false, false), async { tx.send("ta") });
        assert!(keep);
        assert_eq!(
            with_date_removed(&wire),
            "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhead-tail"
        );
    }

    /// A small answer whose body is all there goes out before `write_response` returns,
    /// with no future made: the common case costs no allocation beyond the head.
    #[tokio::test]
    async fn a_small_whole_answer_is_written_at_once() {
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        let sock = Sock::Unix(ours);
        let activity = Activity::new();
        let resp = Response::new(body::full("hello"));
        let Write::Done(true) = write_response(&sock, &activity, resp, false, false) else {
            panic!("a small whole answer was left to a future");
        };
        drop(sock);
        let mut wire = String::new();
        theirs.read_to_string(&mut wire).await.expect("read");
        assert!(wire.ends_with("content-length: 5\r\n\r\nhello"), "{wire}");
    }

    /// A stream's head, and each piece, go out as soon as the body has nothing more for
    /// now: the client of a slow stream (a log tail, a process's output) sees its answer
    /// start before the first piece, and each piece before the next.
    #[tokio::test]
    async fn a_streamed_answer_is_not_held_back_for_the_next_piece() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<&'static str>(1);
        let pieces = futures_util::stream::poll_fn(move |cx| {
            rx.poll_recv(cx)
                .map(|p| p.map(|p| Ok::<_, io::Error>(Frame::data(Bytes::from(p)))))
        });
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        let resp = Response::new(body::boxed(StreamBody::new(pieces)));
        let writing = tokio::spawn(write_one(ours, resp, false, false));
        let mut wire = Vec::new();
        let mut read_until = async |end: &[u8]| {
            let mut chunk = [0; 1024];
            while !wire.ends_with(end) {
                let read = tokio::time::timeout(Duration::from_secs(10), theirs.read(&mut chunk));
                let n = read.await.expect("held back").expect("read");
                assert!(n > 0, "closed early");
                wire.extend_from_slice(&chunk[..n]);
            }
        };
        read_until(b"\r\n\r\n").await;
        tx.send("ab").await.expect("send");
        read_until(b"2\r\nab\r\n").await;
        drop(tx);
        read_until(b"0\r\n\r\n").await;
        assert!(writing.await.expect("writer"));
        let wire = String::from_utf8(wire).expect("utf-8");
        assert!(
            wire.ends_with("transfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"),
            "{wire}"
        );
    }

    /// A head still without its end past `MAX_HEAD` is handed to hyper (which answers 431)
    /// with every byte kept, instead of being read on until the header timeout.
    #[tokio::test]
    async fn a_head_that_outgrows_the_limit_is_handed_over_as_it_arrives() {
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        let endless = format!("GET / HTTP/1.1\r\nX-A: {}", "a".repeat(MAX_HEAD + 4096));
        let sending = endless.clone();
        // Kept open after: the head neither ends nor is cut.
        let writer = tokio::spawn(async move {
            theirs.write_all(sending.as_bytes()).await.expect("write");
            theirs
        });
        let sock = Sock::Unix(ours);
        let mut buf = BytesMut::new();
        let activity = Activity::new();
        let mut blank = Blank::GAP;
        // As the connection does: wait for the first byte, then read the head.
        let read = loop {
            sock.readable().await.expect("readable");
            match read_head(
                &sock,
                &mut buf,
                &activity,
                Duration::from_secs(10),
                &mut blank,
            )
            .await
            {
                Read::Nothing => continue,
                read => break read,
            }
        };
        assert!(matches!(read, Read::HandOver));
        assert!(buf.len() > MAX_HEAD, "{} bytes", buf.len());
        assert!(endless.as_bytes().starts_with(&buf), "bytes lost");
        drop(writer.await.expect("writer"));
    }

    /// A request already in the socket when the drain begins, before the runtime has seen
    /// it (a connection just handed to a worker), is answered, and the connection closes
    /// after it: it was closed unanswered, as if idle.
    #[tokio::test]
    async fn a_request_in_the_socket_when_the_drain_begins_is_answered() {
        let answer = served_unseen(true, Ending::Drain).await;
        assert!(answer.starts_with("http/1.1 502"), "{answer}");
        assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    }

    /// The same for a connection asked to make room (see `Activity::leaving`): a request
    /// in its socket is answered, with `Connection: close`, and without one the connection
    /// closes at once, unanswered.
    #[tokio::test]
    async fn a_connection_asked_to_leave_answers_what_its_socket_holds_first() {
        let answer = served_unseen(true, Ending::Leave).await;
        assert!(answer.starts_with("http/1.1 502"), "{answer}");
        assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
        let answer = served_unseen(false, Ending::Leave).await;
        assert!(answer.is_empty(), "{answer}");
    }

    enum Ending {
        Drain,
        Leave,
    }

    /// Serves a connection told to end (`ending`) before it is first polled, with a
    /// request in its socket if `request` (to an upstream that refuses connections): what
    /// its client reads, lowercased, once the connection has closed.
    async fn served_unseen(request: bool, ending: Ending) -> String {
        use crate::settings::Key;
        let refused = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", refused.local_addr().expect("addr"));
        drop(refused);
        let proxy = crate::proxy::test_proxy_with("sk-test", &[(Key::SandboxBaseUrl, &url)]);
        let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
        if request {
            theirs
                .write_all(b"GET /sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .await
                .expect("request");
        }
        let (_stop, mut stop) = watch::channel(matches!(ending, Ending::Drain));
        let activity = Activity::new();
        if let Ending::Leave = ending {
            activity.leave();
        }
        let headed = AtomicBool::new(false);
        let ctx = Ctx {
            proxy: &proxy,
            activity: &activity,
            headed: &headed,
            header_timeout: Duration::from_secs(10),
        };
        let served = serve(Sock::Unix(ours), ctx, &mut stop);
        let outcome = tokio::time::timeout(Duration::from_secs(10), served).await;
        assert!(matches!(outcome, Ok(Outcome::Closed)));
        let mut answer = Vec::new();
        theirs.read_to_end(&mut answer).await.expect("answer");
        String::from_utf8_lossy(&answer).to_ascii_lowercase()
    }

    /// A client that resets its connection ends the read of a head at once, as a close
    /// does: the error is not taken for "nothing yet", which would send the connection
    /// back to waiting for a byte.
    #[tokio::test]
    async fn a_reset_connection_is_closed_not_waited_on() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let client = client.expect("connect");
        client.set_zero_linger().expect("linger");
        drop(client);
        let ours = accepted.expect("accept").0;
        ours.readable().await.expect("readable");
        let sock = Sock::Tcp(ours);
        let mut buf = BytesMut::new();
        let activity = Activity::new();
        let mut blank = Blank::GAP;
        let read = read_head(
            &sock,
            &mut buf,
            &activity,
            Duration::from_secs(10),
            &mut blank,
        );
        assert!(matches!(read.await, Read::Closed));
    }

    /// A client's socket and the connection's side of it, reading heads as `serve` does
    /// (the header timeout short: a head begun and left is cut at once).
    struct Heads {
        sock: Sock,
        theirs: UnixStream,
        buf: BytesMut,
        activity: Activity,
        blank: Blank,
    }

    impl Heads {
        fn new() -> Heads {
            let (ours, theirs) = UnixStream::pair().expect("socket pair");
            Heads {
                sock: Sock::Unix(ours),
                theirs,
                buf: BytesMut::new(),
                activity: Activity::new(),
                blank: Blank::GAP,
            }
        }

        /// The client sends `bytes`; what the next read of a head makes of them.
        async fn after(&mut self, bytes: &[u8]) -> Read {
            self.theirs.write_all(bytes).await.expect("write");
            self.sock.readable().await.expect("readable");
            let short = Duration::from_millis(50);
            read_head(
                &self.sock,
                &mut self.buf,
                &self.activity,
                short,
                &mut self.blank,
            )
            .await
        }
    }

    /// Empty lines before a request line are skipped four bytes to a gap between requests,
    /// counted across reads: a client that sends line ends and nothing else begins a head,
    /// bound by the header timeout (four a read kept such a client's connection for good).
    #[tokio::test]
    async fn empty_lines_before_a_head_are_skipped_four_bytes_a_gap() {
        let mut heads = Heads::new();
        assert!(matches!(heads.after(b"\r\n").await, Read::Nothing));
        assert_eq!(heads.blank.left, 2);
        let read = heads.after(b"\r\n\r").await;
        assert!(
            matches!(read, Read::Closed),
            "the fifth byte is a head begun, cut"
        );
    }

    /// An empty line split between two reads (its CR in one, its LF in the next) is one
    /// all the same: no head begun, which held a drain and logged 408.
    #[tokio::test]
    async fn an_empty_line_split_between_reads_is_skipped() {
        let mut heads = Heads::new();
        for (half, left) in [(&b"\r"[..], 3), (b"\n", 2)] {
            assert!(matches!(heads.after(half).await, Read::Nothing));
            assert_eq!(heads.blank.left, left);
        }
        // A CR followed by anything but its LF is a bare one, for hyper's 400.
        heads.blank = Blank::GAP;
        assert!(matches!(heads.after(b"\r").await, Read::Nothing) && heads.blank.cr);
        let read = heads.after(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(matches!(read, Read::HandOver));
    }

    /// Only whole empty lines are skipped: bytes hyper would refuse before a request line
    /// (a bare CR) are not taken for one, and go to hyper's 400 as they did.
    #[tokio::test]
    async fn a_bare_cr_before_a_head_is_not_an_empty_line() {
        for (sent, served) in [
            (&b"\n\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"[..], true),
            (b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", true),
            (b"\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", false),
            (b"\r\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", false),
            (b"\n\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ] {
            let read = Heads::new().after(sent).await;
            let name = String::from_utf8_lossy(sent);
            match served {
                true => assert!(matches!(read, Read::Head(_)), "{name:?}"),
                false => assert!(matches!(read, Read::HandOver), "{name:?}"),
            }
        }
    }
}
