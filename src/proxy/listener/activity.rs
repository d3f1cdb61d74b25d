//! A connection's clocks ([`Activity`]): when bytes last moved either way, where the head
//! being read began, what answer the client is owed and how a cut ended it (the `answer
//! cut` lines, [`AnswerCut`]); the I/O wrapper that keeps them and reads heads through the
//! framing watch ([`IdleIo`], with hyper's lingering close); and the [`watchdog`] that cuts
//! a connection idle past `--idle-timeout` or slow past `--header-timeout`, telling the
//! serving code through [`Told`].

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use super::ServeConfig;
use crate::proxy::flood::Credit;
use crate::proxy::framing::{self, HeadWatch, Verdicts};
use crate::proxy::h1;

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
    /// See [`Activity::took_head`].
    heads: AtomicU64,
    /// See [`Activity::took_body`].
    bodies: AtomicU64,
    /// See [`Activity::dropped_body`].
    refunds: AtomicU64,
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
    /// Every slot is in use, and this connection was asked to close if it is idle between
    /// requests (see [`super::reuse`]).
    asked: AtomicU8,
    /// Asked, and found idle, a plain HTTP/1 connection is to close once nothing waits in
    /// its socket (see [`Activity::leaving`]).
    leaving: AtomicBool,
    /// The connection is closing on its own, reading and dropping the rest of a body
    /// after an early answer (see [`Activity::lingers`]).
    lingering: AtomicBool,
    /// When the drain's grace cut the connection, a head was held back behind an answer
    /// (see [`Activity::drain_cut_head`]).
    held_at_cut: AtomicBool,
}

/// What [`Clocks::asked`] holds, besides 0: asked to close if idle a second, or at all.
const ASKED: u8 = 1;
const ASKED_URGENTLY: u8 = 2;

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
pub(in crate::proxy) struct AnswerCut {
    clocks: Arc<Clocks>,
    uri: http::Uri,
    began: Instant,
    ended: bool,
    /// An HTTP/2 answer's share of its connection (see [`AnswerCut::holding`]).
    open: Option<Arc<super::OpenConnection>>,
    /// A line was said: flushed before the share goes.
    said: bool,
}

impl AnswerCut {
    pub(in crate::proxy) fn new(activity: &Activity, uri: http::Uri) -> Self {
        activity.clocks.answers.fetch_add(1, Ordering::Relaxed);
        AnswerCut {
            clocks: activity.clocks.clone(),
            uri,
            began: Instant::now(),
            ended: false,
            open: None,
            said: false,
        }
    }

    /// An HTTP/2 answer's body lives in a task of hyper's own, which drops it after the
    /// connection's task has ended when the connection was cut: without a share of the
    /// connection, a drain begun then was over at once, and the process exited before the
    /// body was dropped and its `answer cut` said (as [`super::StreamHeld`] keeps a
    /// request's 499).
    pub(in crate::proxy) fn holding(mut self, open: Arc<super::OpenConnection>) -> Self {
        self.open = Some(open);
        self
    }

    /// The answer went out whole, or ended for a reason of its own.
    pub(in crate::proxy) fn ended(&mut self) {
        self.ended = true;
    }

    /// The proxy cut the answer itself (an HTTP/2 stream whose upstream went silent).
    pub(in crate::proxy) fn cut_idle(&mut self) {
        self.log("idle");
        self.ended = true;
    }

    /// The client's upload broke while the answer was coming (an early answer).
    pub(in crate::proxy) fn left_by_client(&mut self) {
        self.log("client");
        self.ended = true;
    }

    /// The upstream's body failed mid-answer.
    pub(in crate::proxy) fn broke_upstream(&mut self) {
        self.log("upstream");
        self.ended = true;
    }

    /// The fast path's writer ended the answer before its end: which side failed, as
    /// [`Activity::upstream_broke`] and [`Activity::client_broke`] said; neither, it
    /// ended whole (an answer ended by the connection's close).
    pub(in crate::proxy) fn fell_short(&mut self) {
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
    pub(in crate::proxy) fn written_later(&mut self) {
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

    fn log(&mut self, end: &str) {
        log_cut(&self.uri, self.began, end);
        self.said = true;
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
        if !self.ended {
            match self.clocks.cut.load(Ordering::Relaxed) {
                CUT_IDLE => self.log("idle"),
                CUT_DRAIN => self.log("drain"),
                CUT_HEAD => self.log("header-timeout"),
                // hyper dropped it (the client reset its stream, or closed), or the fast
                // path stopped writing when the client went: after the upstream broke, if
                // it did (a splice gives the client what its pipe holds first).
                _ if self.clocks.upstream_broke.swap(false, Ordering::Relaxed) => {
                    self.log("upstream")
                }
                _ => self.log("client"),
            }
        }
        // The exit may come as soon as the last share goes: this thread's lines first.
        if self.said {
            if let Some(open) = self.open.take() {
                crate::logging::flush_thread();
                drop(open);
            }
        }
    }
}

impl Activity {
    pub(in crate::proxy) fn new() -> Self {
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
    pub(super) fn cut_parked(&self) {
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
    pub(in crate::proxy) fn upstream_broke(&self) {
        self.clocks.upstream_broke.store(true, Ordering::Relaxed);
    }

    /// The fast path's writer: a write to the client failed.
    pub(in crate::proxy) fn client_broke(&self) {
        self.clocks.client_broke.store(true, Ordering::Relaxed);
    }

    pub(super) fn last_moved(&self) -> Instant {
        self.opened + Duration::from_millis(self.clocks.last.load(Ordering::Relaxed))
    }

    /// Held while a request waits for the upstream's answer: that wait is bounded by
    /// `--upstream-timeout` (then 504), not by the idle timeout, which would otherwise cut
    /// the connection first, or race the 504, and the client would get no answer at all.
    pub(in crate::proxy) fn awaiting(&self) -> Awaiting {
        self.clocks.waiting.fetch_add(1, Ordering::Relaxed);
        Awaiting(self.clocks.clone())
    }

    /// Held by an HTTP/2 request and then its answer's body, until the answer has ended:
    /// a draining connection is closed once none is held (see [`settled`](super::settled)).
    pub(in crate::proxy) fn open_stream(&self) -> OpenStream {
        self.clocks.streams.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.clocks.clone())
    }

    /// Reads that brought bytes from the client on hyper's path, counted (wrapping): a
    /// draining HTTP/2 client that sends anything is still there (see
    /// [`settled`](super::settled)).
    pub(super) fn reads(&self) -> u32 {
        self.clocks.reads.load(Ordering::Relaxed)
    }

    /// An HTTP/2 request's head reached the listener's service, earning `n` bytes of room
    /// in the connection's frame budget (see
    /// [`head_credit`](crate::proxy::flood::head_credit)).
    pub(in crate::proxy) fn took_head(&self, n: u64) {
        self.clocks.heads.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` bytes of an HTTP/2 request body were taken on their way upstream: room in the
    /// connection's frame budget (see [`flood`](crate::proxy::flood)).
    pub(in crate::proxy) fn took_body(&self, n: usize) {
        self.clocks.bodies.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// An HTTP/2 request body was dropped before its end (the proxy answered without it):
    /// what its client still had on the way, a stream window at most, is DATA h2 drops as
    /// it comes, which then costs the client nothing in the frame budget. Without it a
    /// client whose uploads were refused (400, 413, an upstream down) was closed as a
    /// flood after some 8 MiB of them.
    pub(in crate::proxy) fn dropped_body(&self) {
        let window = u64::from(super::H2_STREAM_WINDOW);
        self.clocks.refunds.fetch_add(window, Ordering::Relaxed);
    }

    /// What the connection's requests have earned in its frame budget (see
    /// [`Activity::took_head`], [`Activity::took_body`], [`Activity::dropped_body`]).
    pub(in crate::proxy) fn credit(&self) -> Credit {
        let clocks = &self.clocks;
        Credit {
            heads: clocks.heads.load(Ordering::Relaxed),
            taken: clocks.bodies.load(Ordering::Relaxed),
            refunds: clocks.refunds.load(Ordering::Relaxed),
        }
    }

    /// The connection opened with HTTP/2's preface (see [`HeadWatch::is_http2`]).
    fn opened_http2(&self) {
        self.clocks.http2.store(true, Ordering::Relaxed);
    }

    /// hyper serves HTTP/2 here: the connection is open for requests once its preface is
    /// in, as a keep-alive one is between them (no first-head deadline), and closing it
    /// for idleness is hyper's graceful shutdown (GOAWAY).
    pub(in crate::proxy) fn is_http2(&self) -> bool {
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
    pub(in crate::proxy) fn fast_heading(&self, in_head: bool) {
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

    /// When the connection was accepted.
    pub(super) fn opened(&self) -> Instant {
        self.opened
    }

    /// Where the request head being read stands (see [`Activity::heading`]): the
    /// watchdog's mark of a stalled head is this, and names that head only while it is.
    pub(super) fn head_mark(&self) -> u64 {
        self.clocks.head.load(Ordering::Relaxed)
    }

    /// The drain's grace ran out: the connection is cut for it.
    pub(super) fn cut_by_drain(&self) {
        // Judged now: the requests it was held behind go with the connection.
        (self.clocks.held_at_cut).store(self.head_held_back(), Ordering::Relaxed);
        self.clocks.cut.store(CUT_DRAIN, Ordering::Relaxed);
    }

    /// The drain's grace ended with the connection still open (see
    /// [`Activity::cut_by_drain`]), and any head it had was the client's to finish: not
    /// one held back behind an answer still owed, which the watchdog does not cut either.
    pub(super) fn drain_cut_head(&self) -> bool {
        self.clocks.cut.load(Ordering::Relaxed) == CUT_DRAIN
            && !self.clocks.held_at_cut.load(Ordering::Relaxed)
    }

    /// An HTTP/1 head sent on behind a request whose answer the client is still owed: held
    /// back, not slow (see [`watchdog`]).
    fn head_held_back(&self) -> bool {
        !self.is_http2() && (self.clocks.waiting.load(Ordering::Relaxed) != 0 || self.answer_owed())
    }

    /// When the watchdog began to cut the connection, if it has.
    pub(super) fn cut_began(&self) -> Option<Instant> {
        match self.clocks.cut_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.opened + Duration::from_millis(ms - 1)),
        }
    }

    /// Bytes of an answer are still to go out: a stream open, a write or a flush waiting
    /// for room.
    pub(super) fn sending(&self) -> bool {
        let c = &self.clocks;
        c.streams.load(Ordering::Relaxed) != 0
            || c.write_blocked.load(Ordering::Relaxed)
            || c.flush_blocked.load(Ordering::Relaxed)
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

    /// Nothing in progress as far as the connection's clocks say: no request waiting for
    /// its answer, no HTTP/2 stream open, no answer going out, no head begun (before its
    /// first request too).
    pub(super) fn between_requests(&self) -> bool {
        // Not while bytes of an answer wait to go out (an HTTP/2 stream's last piece).
        !self.busy()
            && !self.answer_owed()
            && self.head_began().is_none()
            && !self.sending()
            && !self.clocks.lingering.load(Ordering::Relaxed)
    }

    /// The connection lingers after an early answer (`h1::linger`, [`IdleIo::poll_linger`])
    /// until it closes: not idle, though its clocks say nothing is under way. Closed to
    /// make room, its client's body still arriving made the kernel reset the connection,
    /// and the answer could be lost with it. An HTTP/2 connection hyper has closed lingers
    /// too (its client may still be reading the end of an answer): one whose client keeps
    /// it open after its own GOAWAY holds its slot up to [`h1::LINGER_IDLE`] of silence
    /// ([`h1::LINGER_TOTAL`] in all, or `H2_LINGER_BYTES` read), no longer taken to make
    /// room.
    pub(in crate::proxy) fn lingers(&self) {
        self.clocks.lingering.store(true, Ordering::Relaxed);
    }

    /// Asked to make room, a plain HTTP/1 connection idle between requests is to close
    /// once nothing waits in its socket: the serving side looks (the watchdog cannot), and
    /// a request written just then is answered, with `Connection: close`, instead of
    /// reset unanswered (as a drain does).
    pub(in crate::proxy) fn leaving(&self) -> bool {
        self.clocks.leaving.load(Ordering::Relaxed)
    }

    /// Marks the connection [`Activity::leaving`] (the watchdog's, and tests').
    pub(in crate::proxy) fn leave(&self) {
        self.clocks.leaving.store(true, Ordering::Relaxed);
    }

    /// Resolves once [`Activity::leaving`]. Registers no waker: only the watchdog sets
    /// it, which runs in the connection's own task and wakes it after.
    pub(in crate::proxy) fn left(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(|_| match self.leaving() {
            true => Poll::Ready(()),
            false => Poll::Pending,
        })
    }

    /// Every slot is in use: close if idle between requests for a second, or at all when
    /// `urgent` (see [`super::reuse`]).
    pub(super) fn ask_to_close(&self, urgent: bool) {
        let level = if urgent { ASKED_URGENTLY } else { ASKED };
        self.clocks.asked.fetch_max(level, Ordering::Relaxed);
    }

    /// When the head in progress began (see [`Activity::heading`]).
    pub(super) fn head_began(&self) -> Option<Instant> {
        match self.clocks.head.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.opened + Duration::from_millis(ms - 1)),
        }
    }
}

/// See [`Activity::awaiting`]; dropped with the request, answered or not.
pub(in crate::proxy) struct Awaiting(Arc<Clocks>);

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// See [`Activity::open_stream`].
pub(in crate::proxy) struct OpenStream(Arc<Clocks>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's bytes on their way into hyper: activity recorded, request framing
/// watched (see [`framing`]). A tunnel's bytes: activity only.
pub(in crate::proxy) struct IdleIo<T> {
    inner: T,
    activity: Activity,
    framing: Option<HeadWatch>,
    /// Set once hyper closes the connection (see [`IdleIo::poll_linger`]).
    /// Boxed: rare, and inline it would size every connection.
    linger: Option<Box<Linger>>,
}

/// A closed connection's lingering: until when, in all, and the timer for the current
/// wait, reset by every read.
struct Linger {
    until: tokio::time::Instant,
    idle: Pin<Box<tokio::time::Sleep>>,
    /// Bytes an HTTP/2 connection may still send (see [`H2_LINGER_BYTES`]); none for
    /// HTTP/1's uploader, which may have a body's worth to come.
    left: Option<usize>,
}

/// What an HTTP/2 client may send after the end, taken and dropped: once hyper is done,
/// a well-behaved client has at most the connection's window of DATA in flight (4 MiB)
/// and a few control frames. One that goes on sending (after a flood's or a protocol
/// error's GOAWAY, often at socket speed) had the proxy read and drop it for the linger's
/// 30 s, most of a core, as long as it liked to repeat.
const H2_LINGER_BYTES: usize = 8 << 20;

/// Reads one lingering close may do in one poll before it lets the worker's other
/// connections run.
const LINGER_READS: usize = 16;

impl<T> IdleIo<T> {
    pub(super) fn new(inner: T, activity: Activity) -> (Self, Verdicts) {
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
    pub(in crate::proxy) fn tunnel(inner: T, activity: Activity) -> Self {
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

    fn after_write(&mut self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Ready(Ok(n)) if *n > 0 => {
                if let Some(framing) = &mut self.framing {
                    framing.wrote(*n);
                }
                self.wrote()
            }
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

/// How long an idle HTTP/2 connection has, once its GOAWAY is sent, to be closed
/// gracefully (hyper waits for the client's answer to a PING) before it is cut.
pub(super) const GOAWAY_WAIT: Duration = Duration::from_secs(1);

/// What a connection's serving code and its task's watchdog tell each other.
#[derive(Default)]
pub(super) struct Told {
    /// A request head has arrived: the first-head deadline no longer applies.
    pub(super) headed: AtomicBool,
    /// The watchdog found an HTTP/2 connection idle.
    pub(super) idle: Notify,
    /// The watchdog found the connection idle with a head begun: that head's mark
    /// ([`Activity::head_mark`]), 0 for none. It stalled, and the connection closes with
    /// it unless it ends meanwhile (see `listener`'s `connection_task`): a head begun
    /// later has another mark.
    pub(super) stalled: AtomicU64,
}

/// Resolves when the connection is to be cut: it has moved no bytes for `--idle-timeout`,
/// no request head has arrived within `--header-timeout` of its start, or a head hyper
/// reads has not ended `--header-timeout` after its first byte.
///
/// The second matters before hyper knows the connection is HTTP/1: a client that sends
/// nothing, or a bit of the HTTP/2 preface, would otherwise hold its slot of
/// `--max-connections` until the idle timeout. The third is hyper's header timeout, but
/// from the head's first byte: hyper's own timer starts when it begins to wait for a head,
/// so it also cut keep-alive connections idle between requests (see
/// [`http_builder`](super::http_builder)).
///
/// One timer for all: the connection's task polls every branch of its `select!` each time
/// it wakes, a few times per request, and a second timer doubled that cost.
///
/// An idle HTTP/2 connection says GOAWAY before it closes (RFC 9113 §6.8): a client
/// opening a stream just then learns it was not processed and may send it again, instead
/// of seeing a reset it cannot judge. hyper's graceful shutdown sends it, told by
/// [`Told::idle`]; the connection is cut [`GOAWAY_WAIT`] later if it has not closed,
/// unless a request the GOAWAY let in is under way, which is then watched as any.
///
/// Asked to close while every slot is in use ([`Activity::ask_to_close`]), a connection
/// idle between requests (or before its first) for [`super::reuse::IDLE_FLOOR`], or at
/// all when asked urgently (a client has waited that long), closes as an idle one does,
/// but a plain HTTP/1 one once nothing waits in its socket ([`Activity::leaving`]); one
/// that is not, or no longer, idle stays.
pub(super) async fn watchdog(activity: &Activity, told: &Told, config: &ServeConfig) {
    let first_head = activity.opened + config.header_timeout;
    // The idle GOAWAY (or close_notify) has gone out.
    let mut told_idle = false;
    loop {
        let asked = activity.clocks.asked.swap(0, Ordering::Relaxed);
        let reclaimed = asked != 0
            && activity.between_requests()
            && (asked == ASKED_URGENTLY
                || activity.last_moved() + super::reuse::IDLE_FLOOR <= Instant::now());
        if reclaimed && config.tls.is_none() && !activity.is_http2() {
            // Plain HTTP/1: the serving side closes, having looked in the socket first (see
            // `Activity::leaving`); hyper's, if it serves the connection, as an idle one.
            // Then watched as any, until it does.
            activity.leave();
            told.idle.notify_one();
            // It may have been polled before this, in this turn of the task.
            tokio::task::yield_now().await;
            continue;
        }
        let mut deadline = activity.last_moved() + config.idle_timeout;
        if !told.headed.load(Ordering::Relaxed) && !activity.is_http2() {
            deadline = deadline.min(first_head);
        }
        let head = activity.head_mark();
        if let Some(began) = activity.head_began() {
            deadline = deadline.min(began + config.header_timeout);
        }
        if reclaimed || Instant::now() >= deadline {
            let idle = reclaimed || Instant::now() >= activity.last_moved() + config.idle_timeout;
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
                    let head = activity.head_mark();
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
            let asked = activity.clocks.asked.load(Ordering::Relaxed) != 0;
            if activity.head_mark() != head || asked {
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
pub(super) fn head_timed_out(activity: &Activity, told: &Told, config: &ServeConfig) -> bool {
    head_from(activity, told).is_some_and(|from| Instant::now() >= from + config.header_timeout)
}

/// Where the head in progress counts its `--header-timeout` from: its first byte, or a
/// connection's first HTTP/1 head, the connection's opening; `None` while there is none.
pub(super) fn head_from(activity: &Activity, told: &Told) -> Option<Instant> {
    let began = activity.head_began()?;
    let first = !told.headed.load(Ordering::Relaxed) && !activity.is_http2();
    Some(if first { activity.opened } else { began })
}

/// The read error that ends a flooded HTTP/2 connection: hyper ends it at once, streams
/// and all, without a GOAWAY (nginx sends one; a client that floods reads none of it).
fn flood() -> io::Error {
    io::Error::other("HTTP/2 frame flood")
}

#[cold]
fn said_flood() {
    tracing::warn!(
        "closing an HTTP/2 connection whose client sent a flood of frames that carry no \
         request (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, RST_STREAM)"
    );
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
        let credit = self.activity.credit();
        if (self.framing.as_mut()).is_some_and(|f| f.flooded(credit)) {
            return Poll::Ready(Err(flood()));
        }
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
                // Empty lines begin no request (RFC 9112 §2.2), nor its clock: a keep-alive
                // client that sent a CRLF after its body had its connection cut at
                // `--header-timeout`, logged 408, and never closed to make room; the drain
                // waited for it as for a head begun.
                let head = framing.in_head() && !framing.blank_so_far();
                this.activity.heading(head, cx.waker());
                if framing.is_http2() {
                    // No first-head deadline any more: the watchdog's deadline moves
                    // later, which it finds when it next wakes.
                    this.activity.opened_http2();
                }
                if framing.flooded(this.activity.credit()) {
                    said_flood();
                    return Poll::Ready(Err(flood()));
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
            this.activity.lingers();
            std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            let now = tokio::time::Instant::now();
            this.linger = Some(Box::new(Linger {
                until: now + h1::LINGER_TOTAL,
                idle: Box::pin(tokio::time::sleep_until(now + h1::LINGER_IDLE)),
                left: this.activity.is_http2().then_some(H2_LINGER_BYTES),
            }));
        }
        this.poll_linger(cx)
    }
}

impl<T: AsyncRead + Unpin> IdleIo<T> {
    /// nginx's lingering close, as the fast path's (`h1::linger`): a client still sending
    /// a body when hyper closes (an early answer: a refusal, a 503, the upstream's 413)
    /// would have the kernel reset the connection under its writes and maybe lose the
    /// answer (RFC 9112 §9.6). What it sends is read and dropped until it closes, for at
    /// most [`h1::LINGER_IDLE`] without a byte and [`h1::LINGER_TOTAL`] in all; an HTTP/2
    /// client, [`H2_LINGER_BYTES`] at most.
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
                    if let Some(left) = linger.left.as_mut() {
                        *left = left.saturating_sub(buf.filled().len());
                        if *left == 0 {
                            return lingered("bytes");
                        }
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
pub(in crate::proxy) async fn idle(activity: &Activity, timeout: Duration) {
    loop {
        let deadline = activity.last_moved() + timeout;
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
