//! Body helpers: boxing, bounded reads that never lose bytes, the proxy's own answers, and
//! the wrappers that watch a body on its way: [`EndStreamed`] (an HTTP/2 body ends only with
//! END_STREAM), [`Uploading`] and [`Marked`] (how an upload moves, for the upstream timeout
//! and the idle limit) and [`IdleLimited`] (an HTTP/2 answer that stalls).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};

use super::listener::{AnswerCut, OpenStream};
use crate::error::Error;
use crate::upstream::{BoxError, ProxyBody};

/// The size bound for a body the proxy reads whole itself: a rewritten create or connect
/// body, or an answer it learns envd tokens from (a longer one of these streams on,
/// unread), or its own token look-up's answer (a longer one fails the look-up).
pub const READ_WHOLE_LIMIT: usize = 1024 * 1024;
const _: () = assert!(
    READ_WHOLE_LIMIT == 1 << 20,
    "the token look-up's error says 1 MiB"
);

/// What the proxy holds at once, in all, of the bodies it reads whole ([`Held`]).
pub const HELD_LIMIT: usize = 32 * 1024 * 1024;

/// Room for the bodies the proxy reads whole: one bound for the process, where each body
/// alone is bound by [`READ_WHOLE_LIMIT`]. A rewritten create is read before it goes up and kept
/// until its answer (to be sent again); over HTTP/2 a client may have a hundred on a
/// connection, and four such connections held 500 MB. Room is taken as bytes arrive, never
/// waited for: a body that finds none stops being read (see [`read_bounded`]), so bodies
/// holding part of theirs never wait on one another, nor on a client that sends nothing.
pub struct Held {
    room: Arc<tokio::sync::Semaphore>,
    /// When the room was last said to be full: at most once a minute.
    said: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Held {
    pub fn new(bytes: usize) -> Self {
        Held {
            room: Arc::new(tokio::sync::Semaphore::new(bytes)),
            said: std::sync::Mutex::default(),
        }
    }

    /// Says, at most once a minute, that a body found no room: the 503s it brings, and
    /// the answers passed on unread, are otherwise told from no other 503 by the log.
    #[cold]
    pub fn say_full(&self) {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        if said.is_none_or(|s| s.elapsed() >= Duration::from_secs(60)) {
            *said = Some(std::time::Instant::now());
            drop(said);
            tracing::warn!(
                held_mib = HELD_LIMIT >> 20,
                "the bodies the proxy reads whole fill their room: rewritten creates and \
                 connects get 503 (retry), answers go on unread; a client holding large \
                 uploads open is the likely cause"
            );
        }
    }

    /// Room for `bytes` more in `room`, when there is.
    fn take(&self, room: &mut Room, bytes: usize) -> bool {
        let Ok(bytes) = u32::try_from(bytes) else {
            return false;
        };
        match self.room.clone().try_acquire_many_owned(bytes) {
            Ok(more) => {
                match &mut room.0 {
                    Some(taken) => taken.merge(more),
                    None => room.0 = Some(more),
                }
                true
            }
            Err(_) => false,
        }
    }
}

/// Room taken in [`Held`], given back when the bytes it holds are dropped.
#[derive(Default)]
pub struct Room(Option<tokio::sync::OwnedSemaphorePermit>);

impl Room {
    /// `bytes`, keeping this room until the last of them is dropped (a copy kept to be sent
    /// again included).
    pub fn hold(self, bytes: Bytes) -> Bytes {
        match self.0 {
            Some(permit) => Bytes::from_owner(HeldBytes {
                bytes,
                _permit: permit,
            }),
            None => bytes,
        }
    }
}

struct HeldBytes {
    bytes: Bytes,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl AsRef<[u8]> for HeldBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

pub fn boxed<B>(body: B) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into()).map_err(|e| match e {}).boxed()
}

pub fn empty() -> ProxyBody {
    Empty::new().map_err(|e| match e {}).boxed()
}

/// The proxy's own error answer: E2B JSON shape plus `X-Abx-Error`.
pub fn error_response(e: &Error) -> Response<ProxyBody> {
    let mut resp = Response::new(full(e.json_body()));
    *resp.status_mut() =
        StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert("x-abx-error", HeaderValue::from_static(e.code()));
    if matches!(e, Error::Busy { .. }) {
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// Reads `body` up to `limit` bytes, each taking room in `held` when given. `Complete`
/// holds all of it, with its room; `Partial` what was read (holding its room) and the rest
/// of the stream, so nothing is lost when the bound is hit; `NoRoom` the same when `held`
/// had no room for the next bytes.
pub async fn read_bounded<B>(
    mut body: B,
    limit: usize,
    held: Option<&Held>,
) -> Result<Bounded<B>, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    // Sized from the body's length when known: grown by doubling, a 1 MiB body took 2.
    let hint = body.size_hint().exact().unwrap_or(0);
    let mut buf = BytesMut::with_capacity(hint.min(limit as u64 + 1) as usize);
    let mut room = Room::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Into::into)?;
        if let Ok(data) = frame.into_data() {
            let roomy = held.is_none_or(|held| held.take(&mut room, data.len()));
            buf.extend_from_slice(&data);
            if !roomy {
                return Ok(Bounded::NoRoom(room.hold(buf.freeze()), body));
            }
            if buf.len() > limit {
                return Ok(Bounded::Partial(room.hold(buf.freeze()), body));
            }
        }
        // Trailers on these small JSON bodies carry nothing we pass on.
    }
    Ok(Bounded::Complete(buf.freeze(), room))
}

pub enum Bounded<B> {
    Complete(Bytes, Room),
    Partial(Bytes, B),
    NoRoom(Bytes, B),
}

/// Already-read bytes followed by the rest of a stream.
pub struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: B,
}

impl<B> Prefixed<B> {
    pub fn new(prefix: Bytes, rest: B) -> Self {
        Prefixed {
            prefix: Some(prefix).filter(|b| !b.is_empty()),
            rest,
        }
    }
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let extra = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let inner = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + extra);
        if let Some(u) = inner.upper() {
            hint.set_upper(u + extra);
        }
        hint
    }
}

/// An HTTP/2 body, which ends only with its sender's END_STREAM.
///
/// hyper reads a received `RST_STREAM(NO_ERROR)` as the end of the body. RFC 9113 §8.1
/// lets a server stop a request that way once its answer is complete, but before the end
/// it is an abort: from a client (Node's `http2stream.close()` sends it) an upload cut
/// short went upstream as a complete, shorter one (a chunked body got its last chunk: a
/// truncated file written into the sandbox); from an upstream, an answer without a length
/// cut that way reached the client with a clean end and was read as whole by the proxy's
/// own look-ups. Only a received END_STREAM leaves the body at its end (h2 keeps saying so
/// after a reset that follows it), so a body that stops without it is an error, which cuts
/// the message passed on as any broken body.
pub struct EndStreamed<B> {
    body: B,
    /// Who sent the body, for the error: "the client", "the upstream".
    sender: &'static str,
    /// A client's connection, told of the bytes taken (see [`EndStreamed::counted`]).
    taken: Option<super::listener::Activity>,
    /// The body is at its end: nothing more may come on its stream.
    ended: bool,
}

impl<B> Drop for EndStreamed<B> {
    fn drop(&mut self) {
        if let (Some(activity), false) = (&self.taken, self.ended) {
            activity.dropped_body();
        }
    }
}

impl<B> EndStreamed<B> {
    /// A client's request body.
    pub fn request(body: B) -> Self {
        EndStreamed {
            body,
            sender: "the client",
            taken: None,
            ended: false,
        }
    }

    /// An upstream's response body.
    pub fn response(body: B) -> Self {
        EndStreamed {
            body,
            sender: "the upstream",
            taken: None,
            ended: false,
        }
    }

    /// Tells the client's connection of each byte of the body taken, and of the body
    /// dropped before its end: room in its HTTP/2 frame budget (see
    /// [`flood`](super::flood)). Counted as taken, not as its DATA frames are read: h2
    /// drops DATA on a stream already reset, and a client credited for it flooded PRIORITY
    /// frames without end.
    pub(super) fn counted(mut self, activity: super::listener::Activity) -> Self
    where
        B: Body,
    {
        self.ended = self.body.is_end_stream();
        self.taken = Some(activity);
        self
    }
}

impl<B> Body for EndStreamed<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = ready!(Pin::new(&mut self.body).poll_frame(cx));
        // A body whose length is all taken is at its end, its END_STREAM (an empty DATA
        // frame, as python-h2 sends it, or trailers) perhaps still unread: hyper's HTTP/1
        // client stops polling there.
        self.ended = self.body.is_end_stream() || self.body.size_hint().exact() == Some(0);
        match polled {
            None if !self.body.is_end_stream() => Poll::Ready(Some(Err(Box::new(ResetEarly {
                sender: self.sender,
            })))),
            other => {
                if let (Some(activity), Some(Ok(frame))) = (&self.taken, &other) {
                    activity.took_body(frame.data_ref().map_or(0, Bytes::len));
                }
                Poll::Ready(other.map(|r| r.map_err(Into::into)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The error of an [`EndStreamed`] body that ended without END_STREAM: its sender reset
/// the stream with `NO_ERROR`, which hyper reads as the body's end.
#[derive(Debug, thiserror::Error)]
#[error("{sender} reset the stream before the end of its body")]
pub struct ResetEarly {
    sender: &'static str,
}

/// Whether a body's error is its HTTP/2 sender resetting the stream (with any code), or
/// its connection ending under it with h2's own GOAWAY (after a connection error h2
/// found: its limit on streams reset before they were taken, a protocol error): either
/// way the request is given up, as one whose connection is cut. (A client's GOAWAY fails
/// none of its own streams in h2.)
fn reset_by_sender(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|e| {
        e.is::<ResetEarly>()
            || e.downcast_ref::<h2::Error>()
                .is_some_and(|e| (e.is_reset() && e.is_remote()) || e.is_go_away())
    })
}

/// A request body's progress on its way upstream, written by [`Uploading`] and [`Marked`]:
/// when its bytes last moved, and whether its last poll found the client had nothing more
/// yet. Read by the upstream timeout (an upload still moving holds it off; one stalled by
/// its client is the client's fault) and by an HTTP/2 answer's idle limit. On tokio's clock,
/// like [`IdleLimited`]'s.
#[derive(Clone)]
pub struct Moved(Arc<Progress>);

struct Progress {
    since: tokio::time::Instant,
    /// Nanoseconds after `since`; 0 before any bytes moved.
    at: AtomicU64,
    awaiting_client: AtomicBool,
    /// The client's body failed (a reset or closed connection, a bad chunk).
    broken: AtomicBool,
    /// The body has been read to its end (set by [`Marked`]).
    ended: AtomicBool,
    /// The client reset its HTTP/2 stream before the body's end (set by [`Marked`]).
    reset: AtomicBool,
    /// [`FRESH`], [`TAKEN`] or [`GIVEN_UP`] (see [`Moved::give_up`]).
    sending: AtomicU8,
}

impl Default for Moved {
    fn default() -> Self {
        Moved(Arc::new(Progress {
            since: tokio::time::Instant::now(),
            at: AtomicU64::new(0),
            awaiting_client: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            reset: AtomicBool::new(false),
            sending: AtomicU8::new(FRESH),
        }))
    }
}

impl Moved {
    fn mark(&self) {
        let nanos = u64::try_from(self.0.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.0.at.store(nanos.max(1), Ordering::Relaxed);
    }

    /// What a poll of the body gave: `Pending` (the client has sent nothing more yet) or
    /// anything else.
    fn polled<T>(&self, poll: &Poll<T>) {
        self.0
            .awaiting_client
            .store(poll.is_pending(), Ordering::Relaxed);
    }

    pub fn last(&self) -> Option<tokio::time::Instant> {
        match self.0.at.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.0.since + Duration::from_nanos(n)),
        }
    }

    /// The body's last poll found nothing from the client, and the body has not ended.
    pub fn awaiting_client(&self) -> bool {
        self.0.awaiting_client.load(Ordering::Relaxed)
    }

    /// The client's body gave an error: what the upstream client then fails with (an
    /// HTTP/2 stream it reset itself, a connection it gave up) is the client's doing.
    pub fn broken(&self) -> bool {
        self.0.broken.load(Ordering::Relaxed)
    }

    /// The body has been read to its end (as far as [`Marked`] knows: `Uploading` does
    /// not say).
    pub fn ended(&self) -> bool {
        self.0.ended.load(Ordering::Relaxed)
    }

    /// The client reset its HTTP/2 stream before the body's end: it has given up the
    /// request, and no answer reaches it.
    pub fn reset_by_client(&self) -> bool {
        self.0.reset.load(Ordering::Relaxed)
    }

    /// The proxy gave the request up before its answer's head (its timeout, or its client
    /// gone): what [`Uploading`] has not sent of the body is never sent. hyper's HTTP/2
    /// client sends a request that waited for a stream the upstream had no room for when
    /// room comes, whether or not anyone still waits for it: a create timed out (504) or
    /// left by its client went up whole seconds later, and made a sandbox nobody asked for.
    /// Its body failing first, the stream is reset (CANCEL) before the request is whole.
    /// Whether the body had been taken at all: if not, none of it ever goes.
    pub fn give_up(&self) -> bool {
        self.0.sending.swap(GIVEN_UP, Ordering::AcqRel) == FRESH
    }
}

/// What [`Uploading`] has done with its body: nothing yet, taken some (or its end), or been
/// told to stop. One atomic, so that a give-up and the body's first poll, on two threads,
/// agree on which came first.
const FRESH: u8 = 0;
const TAKEN: u8 = 1;
const GIVEN_UP: u8 = 2;

/// A request body on its way to an upstream client that pulls it: each data frame taken
/// marks [`Moved`] (the client takes the next one once the last is written), and trailers
/// are dropped.
pub struct Uploading {
    inner: ProxyBody,
    moved: Moved,
}

impl Uploading {
    pub fn new(inner: ProxyBody, moved: Moved) -> Self {
        Uploading { inner, moved }
    }
}

impl Body for Uploading {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let sending = &self.moved.0.sending;
        let given_up = match sending.load(Ordering::Acquire) {
            TAKEN => false,
            _ => sending
                .compare_exchange(FRESH, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                .is_err_and(|now| now == GIVEN_UP),
        };
        if given_up {
            // CANCEL, the reason hyper finds in the error to reset the stream with (it says
            // INTERNAL_ERROR for an error without one).
            return Poll::Ready(Some(Err(Box::new(h2::Error::from(h2::Reason::CANCEL)))));
        }
        loop {
            let poll = Pin::new(&mut self.inner).poll_frame(cx);
            self.moved.polled(&poll);
            match ready!(poll) {
                Some(Ok(frame)) if frame.is_data() => {
                    self.moved.mark();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Ok(_trailers)) => {}
                Some(Err(e)) => {
                    self.moved.0.broken.store(true, Ordering::Relaxed);
                    return Poll::Ready(Some(Err(e)));
                }
                None => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A body passed on unchanged, each data frame marking [`Moved`], and its end: a client's
/// request body on hyper's path. On HTTP/2 its progress keeps its answer's [`IdleLimited`]
/// clock going (an upload the upstream answers 2xx to at once, and then says nothing until
/// it has all of it); on HTTP/1 an answer before its end closes the connection.
pub struct Marked<B> {
    body: B,
    moved: Moved,
}

/// `body` boxed, [`Marked`] when it has anything to send, its progress then in `upload`.
pub fn marked<B>(body: B, upload: &mut Option<Moved>) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + Sync + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    if body.is_end_stream() {
        return boxed(body);
    }
    let moved = Moved::default();
    *upload = Some(moved.clone());
    boxed(Marked::new(body, moved))
}

impl<B> Marked<B> {
    pub fn new(body: B, moved: Moved) -> Self {
        Marked { body, moved }
    }
}

impl<B> Body for Marked<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx)).map(|f| f.map_err(Into::into));
        match &frame {
            Some(Ok(f)) if f.is_data() => self.moved.mark(),
            Some(Err(e)) if reset_by_sender(&**e) => {
                self.moved.0.reset.store(true, Ordering::Relaxed);
            }
            _ => {}
        }
        // A body of known length ends with its last byte: no one need poll it once more.
        if frame.is_none() || self.body.is_end_stream() {
            self.moved.0.ended.store(true, Ordering::Relaxed);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// [`IdleLimited`]'s end: the proxy's own cut of the answer, which [`CutLogged`] says.
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent nothing more for the idle timeout")]
pub struct StreamIdle;

/// An answer's body, with the [`AnswerCut`] that says so if the proxy cuts it short.
pub struct CutLogged<B> {
    body: B,
    cut: AnswerCut,
    /// hyper's HTTP/1 writer: the body's end is not the answer's (see
    /// [`AnswerCut::written_later`]).
    http1: bool,
}

impl<B> CutLogged<B> {
    pub(super) fn new(body: B, cut: AnswerCut) -> Self {
        CutLogged {
            body,
            cut,
            http1: false,
        }
    }

    pub(super) fn http1(body: B, cut: AnswerCut) -> Self {
        CutLogged {
            body,
            cut,
            http1: true,
        }
    }

    fn ended(&mut self) {
        if self.http1 {
            self.cut.written_later();
        } else {
            self.cut.ended();
        }
    }
}

impl<B> Body for CutLogged<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            None => {
                this.ended();
                Poll::Ready(None)
            }
            Some(Ok(frame)) => {
                // hyper stops polling once a body says it has ended.
                if this.body.is_end_stream() {
                    this.ended();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                let e: BoxError = e.into();
                if e.is::<StreamIdle>() {
                    this.cut.cut_idle();
                } else if super::failure::client_left(&e) {
                    this.cut.left_by_client();
                } else {
                    this.cut.broke_upstream();
                }
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// An answer's body to an HTTP/2 client, ended with an error once no frame has come for
/// the idle timeout, or once the client has taken none for as long.
///
/// On HTTP/1.1 the connection's idle timeout ends an answer whose upstream went silent.
/// An HTTP/2 connection's other streams keep that clock going, so such a stream (a dead
/// envd's) held its upstream connection and one of the client's stream slots for as long
/// as they did. nginx's `proxy_read_timeout` is per request likewise. The timer is reset
/// lazily: a frame costs a clock read, not a timer-wheel update. The clock is tokio's (the
/// system's outside tests), so a paused test clock drives the timer and the reading alike.
///
/// A client that opens no flow-control window for the stream (its reader gone, or a
/// hostile one, which may hold a hundred such streams on a connection it keeps alive with
/// PINGs) stops hyper polling the body, and with it the timer: the stream held its upstream
/// connection for as long as the connection lasted. A guard task ([`guard`]) takes the
/// upstream's body away once the client has taken nothing for the idle timeout, as nginx's
/// `send_timeout` ends such an answer; hyper resets the stream when it next polls. hyper
/// takes a frame only once the last has gone out whole: frames go in [`PIECE`]s, so a
/// client that reads slowly but steadily (16 KiB per idle timeout, 55 B/s at the default)
/// is seen to take them. A 64 KiB read whole took a reader at 4 KiB/s 16 s, and one with
/// a 3 s timeout was cut.
pub struct IdleLimited<B> {
    answer: Arc<Answer<B>>,
    timeout: Duration,
    last: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// The request's upload, when it has one: its bytes moving keep the clock going too.
    upload: Option<Moved>,
    guard: tokio::task::AbortHandle,
    /// The stream's place among its connection's open ones, given up with the answer:
    /// not with the body the guard takes, as hyper still holds the stream (a draining or
    /// idle connection that counted it closed would end before saying why).
    _open: Option<OpenStream>,
    /// What is left of a frame given out in pieces.
    rest: Bytes,
}

/// The most of an answer given to hyper at once: HTTP/2's default largest frame.
const PIECE: usize = 16 * 1024;

/// What [`IdleLimited`] shares with its [`guard`].
struct Answer<B> {
    /// The upstream's body, taken by the guard (see [`IdleLimited`]).
    body: std::sync::Mutex<Option<B>>,
    /// 0 while hyper waits on the body; else when it last took a frame, in milliseconds
    /// from `since`, plus one: from then on it holds the frame until the client's window
    /// lets it go. It holds one from the start, before it first polls.
    handed: AtomicU64,
    since: tokio::time::Instant,
}

impl<B> Answer<B> {
    fn handed_now(&self) {
        let ms = self.since.elapsed().as_millis();
        self.handed.store(
            u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1,
            Ordering::Relaxed,
        );
    }

    /// Since when hyper has held a frame of the body, if it does.
    fn handed_since(&self) -> Option<tokio::time::Instant> {
        match self.handed.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.since + Duration::from_millis(ms - 1)),
        }
    }
}

impl<B: Send + 'static> IdleLimited<B> {
    pub(super) fn new(
        body: B,
        timeout: Duration,
        upload: Option<Moved>,
        open: Option<OpenStream>,
    ) -> Self {
        let last = tokio::time::Instant::now();
        let answer = Arc::new(Answer {
            body: std::sync::Mutex::new(Some(body)),
            handed: AtomicU64::new(1),
            since: last,
        });
        let guard = tokio::spawn(guard(answer.clone(), timeout)).abort_handle();
        IdleLimited {
            answer,
            timeout,
            last,
            timer: Box::pin(tokio::time::sleep_until(last + timeout)),
            upload,
            guard,
            _open: open,
            rest: Bytes::new(),
        }
    }
}

/// Takes the upstream's body away from an answer whose client has taken nothing of it
/// for `timeout` (see [`IdleLimited`]). Waiting on the upstream is the body's own timer's.
async fn guard<B>(answer: Arc<Answer<B>>, timeout: Duration) {
    let mut due = answer.since + timeout;
    loop {
        tokio::time::sleep_until(due).await;
        let now = tokio::time::Instant::now();
        match answer.handed_since() {
            Some(since) if now >= since + timeout => {
                let taken = answer
                    .body
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                drop(taken);
                return;
            }
            Some(since) => due = since + timeout,
            None => due = now + timeout,
        }
    }
}

impl<B> Drop for IdleLimited<B> {
    fn drop(&mut self) {
        self.guard.abort();
    }
}

impl<B> Body for IdleLimited<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if !this.rest.is_empty() {
            let taken = (this.answer.body.lock())
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_none();
            if taken {
                // The guard gave the answer up: what is left of the frame goes with it.
                this.rest = Bytes::new();
                return Poll::Ready(Some(Err(StreamIdle.into())));
            }
            let piece = this.rest.split_to(this.rest.len().min(PIECE));
            this.last = tokio::time::Instant::now();
            this.answer.handed_now();
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        let polled = {
            let mut slot = this
                .answer
                .body
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match slot.as_mut() {
                Some(body) => Pin::new(body).poll_frame(cx),
                // Taken by the guard: the client took nothing for the idle timeout.
                None => return Poll::Ready(Some(Err(StreamIdle.into()))),
            }
        };
        if let Poll::Ready(frame) = polled {
            this.last = tokio::time::Instant::now();
            this.answer.handed_now();
            let frame = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        if data.len() > PIECE {
                            this.rest = data.split_off(PIECE);
                        }
                        Frame::data(data)
                    }
                    Err(frame) => frame,
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => return Poll::Ready(None),
            };
            return Poll::Ready(Some(Ok(frame)));
        }
        this.answer.handed.store(0, Ordering::Relaxed);
        loop {
            ready!(this.timer.as_mut().poll(cx));
            let moved = this.upload.as_ref().and_then(Moved::last);
            let due = moved.map_or(this.last, |m| m.max(this.last)) + this.timeout;
            if tokio::time::Instant::now() >= due {
                return Poll::Ready(Some(Err(StreamIdle.into())));
            }
            this.timer.as_mut().reset(due);
        }
    }

    fn is_end_stream(&self) -> bool {
        let slot = self
            .answer
            .body
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.rest.is_empty() && slot.as_ref().is_some_and(|body| body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let slot = self
            .answer
            .body
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let inner = slot
            .as_ref()
            .map_or_else(SizeHint::default, |body| body.size_hint());
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + rest);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use futures_util::{stream, FutureExt};
    use http::HeaderMap;
    use http_body_util::StreamBody;
    use tokio::sync::mpsc;

    use super::*;

    type Step = Result<Frame<Bytes>, BoxError>;

    fn data(s: &'static str) -> Step {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    fn trailers() -> Step {
        Ok(Frame::trailers(HeaderMap::new()))
    }

    /// A body of these frames whose end is not known until it comes (`is_end_stream` stays
    /// false, as a stream's does when it stops without END_STREAM).
    fn frames(steps: Vec<Step>) -> StreamBody<stream::Iter<std::vec::IntoIter<Step>>> {
        StreamBody::new(stream::iter(steps))
    }

    /// Bodies read whole share one room, taken as their bytes arrive and given back when
    /// the last of them is dropped (a copy kept to be sent again included). A body that
    /// finds no room for its next bytes stops there, every byte kept, and waits for nothing.
    #[tokio::test]
    async fn bodies_read_whole_share_one_room() {
        let held = Held::new(10);
        let first = frames(vec![data("abc"), data("def")]);
        let Ok(Bounded::Complete(first, room)) = read_bounded(first, 100, Some(&held)).await else {
            panic!("six bytes of ten");
        };
        let first = room.hold(first);
        let kept = first.clone();
        drop(first);
        let second = frames(vec![data("ghi"), data("jk"), data("l")]);
        let Ok(Bounded::NoRoom(read, body)) = read_bounded(second, 100, Some(&held)).await else {
            panic!("six and five of ten");
        };
        assert_eq!(
            read, "ghijk",
            "what came is kept, the room's last bytes with it"
        );
        assert_eq!(rest(body).await, (vec![Bytes::from("l")], true));
        drop(read);
        assert_eq!(kept, "abcdef");
        drop(kept);
        // All given back: ten fit again.
        let third = frames(vec![data("0123456789")]);
        let read = read_bounded(third, 100, Some(&held)).await;
        assert!(matches!(read, Ok(Bounded::Complete(..))), "ten of ten");
    }

    /// A request given up before its answer's head sends no more of its body: the next
    /// poll fails, the client's bytes untouched; one not given up passes them on.
    #[tokio::test]
    async fn an_upload_given_up_sends_nothing_more() {
        let moved = Moved::default();
        let body = boxed(frames(vec![data("first"), data("second")]));
        let mut upload = Uploading::new(body, moved.clone());
        let frame = upload.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().ok(), Some(Bytes::from("first")));
        assert!(!moved.give_up(), "the body was taken");
        assert!(matches!(upload.frame().await, Some(Err(_))));
        assert!(!moved.broken(), "the proxy's doing, not the client's");
    }

    /// The data frames left in `body`, and whether it ended cleanly.
    async fn rest<B>(mut body: B) -> (Vec<Bytes>, bool)
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => out.extend(f.into_data().ok()),
                Err(_) => return (out, false),
            }
        }
        (out, true)
    }

    fn exact(hint: SizeHint) -> (u64, Option<u64>) {
        (hint.lower(), hint.upper())
    }

    #[tokio::test]
    async fn a_body_of_exactly_the_limit_is_read_whole_and_trailers_are_skipped() {
        let body = frames(vec![data("abc"), data("de"), trailers()]);
        match read_bounded(body, 5, None).await {
            Ok(Bounded::Complete(b, _)) => assert_eq!(b, "abcde"),
            _ => panic!("five bytes within a limit of five are complete"),
        }
    }

    /// Past the limit the read stops, and what it read plus the rest is the whole body.
    #[tokio::test]
    async fn a_body_over_the_limit_keeps_its_rest() {
        let body = frames(vec![data("abc"), data("de"), data("fg"), data("h")]);
        let Ok(Bounded::Partial(read, body)) = read_bounded(body, 4, None).await else {
            panic!("five bytes over a limit of four are partial");
        };
        assert_eq!(
            read, "abcde",
            "the read stops at the frame that crossed the limit"
        );
        assert_eq!(
            rest(body).await,
            (vec![Bytes::from("fg"), Bytes::from("h")], true)
        );
    }

    #[tokio::test]
    async fn a_prefix_comes_first_and_counts_in_the_size() {
        let body = Prefixed::new(Bytes::from("ab"), Full::new(Bytes::from("cde")));
        assert!(!body.is_end_stream(), "the prefix is still to come");
        assert_eq!(exact(body.size_hint()), (5, Some(5)));
        assert_eq!(
            rest(body).await,
            (vec![Bytes::from("ab"), Bytes::from("cde")], true)
        );

        // Over an empty rest, the body ends once the prefix is taken; an empty prefix is none.
        let mut body = Prefixed::new(Bytes::from("ab"), Empty::<Bytes>::new());
        assert!(!body.is_end_stream());
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok(), Some(Bytes::from("ab")));
        assert!(body.is_end_stream());
        assert!(Prefixed::new(Bytes::new(), Empty::<Bytes>::new()).is_end_stream());
    }

    /// An HTTP/2 request body with its length: all of it taken, its END_STREAM not yet
    /// read (python-h2 sends it in an empty DATA frame of its own).
    struct LengthFirst(Option<Bytes>);

    impl Body for LengthFirst {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.0.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => Poll::Pending,
            }
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0.as_ref().map_or(0, |b| b.len() as u64))
        }
    }

    /// The frame budget's counts (see `flood`): the bytes of a body taken, and a stream
    /// window for a body dropped before its end; none for one taken whole or for none.
    #[tokio::test]
    async fn counted_bodies_tell_what_was_taken_and_what_was_dropped() {
        let activity = super::super::listener::Activity::new();
        let body = |b: &'static str| LengthFirst(Some(Bytes::from(b)));
        let bodies = || {
            let credit = activity.credit();
            assert_eq!(credit.heads, 0);
            (credit.taken, credit.refunds)
        };
        let mut whole = EndStreamed::request(body("abc")).counted(activity.clone());
        assert!(whole.frame().await.is_some());
        drop(whole);
        assert_eq!(bodies(), (3, 0));
        drop(EndStreamed::request(body("abc")).counted(activity.clone()));
        assert_eq!(bodies(), (3, 1 << 20));
        drop(EndStreamed::request(Empty::<Bytes>::new()).counted(activity.clone()));
        assert_eq!(bodies(), (3, 1 << 20));
    }

    /// A body whose stream stops without END_STREAM is an error naming who stopped it; one
    /// that reached its end passes through as it is.
    #[tokio::test]
    async fn a_stream_that_stops_before_its_end_is_an_error() {
        let mut cut = EndStreamed::request(frames(vec![data("abc")]));
        assert!(!cut.is_end_stream());
        let first = cut.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok(), Some(Bytes::from("abc")));
        let err = cut.frame().await.expect("an end").expect_err("cut short");
        assert_eq!(
            err.to_string(),
            "the client reset the stream before the end of its body"
        );
        let mut cut = EndStreamed::response(frames(vec![]));
        let err = cut.frame().await.expect("an end").expect_err("cut short");
        assert_eq!(
            err.to_string(),
            "the upstream reset the stream before the end of its body"
        );

        let whole = EndStreamed::response(Full::new(Bytes::from("abc")));
        assert!(!whole.is_end_stream());
        assert_eq!(exact(whole.size_hint()), (3, Some(3)));
        assert_eq!(rest(whole).await, (vec![Bytes::from("abc")], true));
        assert!(EndStreamed::request(Empty::<Bytes>::new()).is_end_stream());
    }

    /// An HTTP/2 upload its client reset before the end says so; one whose body broke
    /// otherwise (a bad chunk, a connection lost) does not.
    #[tokio::test]
    async fn an_upload_says_whether_its_client_reset_it() {
        let mut upload = None;
        let reset = marked(EndStreamed::request(frames(vec![data("a")])), &mut upload);
        let moved = upload.take().expect("a body to mark");
        assert_eq!(rest(reset).await, (vec![Bytes::from("a")], false));
        assert!(moved.reset_by_client());

        let broken: Step = Err("bad chunk".into());
        let other = marked(frames(vec![data("a"), broken]), &mut upload);
        let moved = upload.take().expect("a body to mark");
        assert_eq!(rest(other).await, (vec![Bytes::from("a")], false));
        assert!(!moved.reset_by_client());
    }

    /// Each data frame marks the upload as moving; trailers are dropped.
    #[tokio::test]
    async fn an_upload_marks_each_frame_and_drops_trailers() {
        let moved = Moved::default();
        let before = std::time::Instant::now();
        let mut up = Uploading::new(
            boxed(frames(vec![data("a"), trailers(), data("b")])),
            moved.clone(),
        );
        assert_eq!(moved.last(), None, "nothing has moved yet");
        assert!(!up.is_end_stream());
        let first = up.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok(), Some(Bytes::from("a")));
        let at = moved.last().expect("the frame marked the upload");
        assert!(before <= at.into_std() && at.into_std() <= std::time::Instant::now());
        assert_eq!(rest(up).await, (vec![Bytes::from("b")], true));

        let whole = Uploading::new(full("abc"), Moved::default());
        assert_eq!(exact(whole.size_hint()), (3, Some(3)));
        assert!(Uploading::new(empty(), Moved::default()).is_end_stream());
    }

    /// Whether an upload waits on its client is what its last poll found: nothing yet,
    /// or a frame (or its end).
    #[tokio::test]
    async fn an_upload_says_whether_it_waits_on_its_client() {
        let (tx, rx) = mpsc::channel::<Step>(1);
        let feed = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
        let moved = Moved::default();
        let mut up = Uploading::new(boxed(StreamBody::new(Box::pin(feed))), moved.clone());
        assert!(!moved.awaiting_client(), "not polled yet");
        assert!(up.frame().now_or_never().is_none());
        assert!(moved.awaiting_client());
        tx.send(data("a")).await.expect("the body is listening");
        assert!(up.frame().await.is_some());
        assert!(!moved.awaiting_client());
        assert!(up.frame().now_or_never().is_none());
        assert!(moved.awaiting_client());
        drop(tx);
        assert!(up.frame().await.is_none());
        assert!(!moved.awaiting_client(), "ended");
    }

    /// A 10 s [`IdleLimited`] answer of the frames sent on the channel.
    #[allow(clippy::type_complexity)]
    fn idle_limited_feed() -> (
        mpsc::Sender<Step>,
        IdleLimited<StreamBody<Pin<Box<dyn futures_util::Stream<Item = Step> + Send>>>>,
    ) {
        let (tx, rx) = mpsc::channel::<Step>(4);
        let feed = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
        let body = IdleLimited::new(
            StreamBody::new(
                Box::pin(feed) as Pin<Box<dyn futures_util::Stream<Item = Step> + Send>>
            ),
            Duration::from_secs(10),
            None,
            None,
        );
        (tx, body)
    }

    /// The idle clock runs from the last frame, not from the start: a frame at 8 s of a
    /// 10 s limit moves the failure to 18 s.
    #[tokio::test(start_paused = true)]
    async fn an_answer_fails_the_idle_timeout_after_its_last_frame() {
        let (tx, mut body) = idle_limited_feed();
        let start = tokio::time::Instant::now();
        assert!(!body.is_end_stream());
        assert_eq!(exact(body.size_hint()), (0, None));

        tokio::time::advance(Duration::from_secs(8)).await;
        tx.send(data("a")).await.expect("the body is listening");
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok(), Some(Bytes::from("a")));

        let err = body
            .frame()
            .await
            .expect("an end")
            .expect_err("silent too long");
        assert_eq!(
            err.to_string(),
            "the upstream sent nothing more for the idle timeout"
        );
        assert_eq!(start.elapsed(), Duration::from_secs(18));
        drop(tx);
    }

    /// An upload still moving keeps the answer's idle clock going: its bytes at 8 s and
    /// 16 s of a 10 s limit move the failure to 26 s, though the answer says nothing.
    #[tokio::test(start_paused = true)]
    async fn an_upload_moving_keeps_its_answer_from_the_idle_timeout() {
        let start = tokio::time::Instant::now();
        let moved = Moved::default();
        let silent = StreamBody::new(stream::pending::<Step>());
        let mut body = IdleLimited::new(silent, Duration::from_secs(10), Some(moved.clone()), None);
        let marks = async {
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_secs(8)).await;
                moved.mark();
            }
        };
        let (err, ()) = tokio::join!(body.frame(), marks);
        let err = err.expect("an end").expect_err("silent too long");
        assert_eq!(
            err.to_string(),
            "the upstream sent nothing more for the idle timeout"
        );
        assert_eq!(start.elapsed(), Duration::from_secs(26));
    }

    /// A client that takes nothing of an answer (hyper holds the frame it took and polls
    /// no more) has the upstream's body taken away after the idle timeout, and the next
    /// poll ends the answer; a client that takes a frame now and then keeps it going.
    #[tokio::test(start_paused = true)]
    async fn an_answer_its_client_takes_nothing_of_is_given_up_after_the_idle_timeout() {
        let (tx, mut body) = idle_limited_feed();
        let start = tokio::time::Instant::now();
        // Taken every 6 s: kept.
        for _ in 0..3 {
            tx.send(data("a")).await.expect("the body is listening");
            body.frame().await.expect("a frame").expect("data");
            tokio::time::sleep(Duration::from_secs(6)).await;
            assert!(!tx.is_closed(), "given up at {:?}", start.elapsed());
        }
        // A frame of 40 KiB, its first piece taken at 18 s, then not polled: given up at
        // 28 s, the rest of the frame with it.
        let large = Frame::data(Bytes::from(vec![b'b'; 40 * 1024]));
        tx.send(Ok(large)).await.expect("the body is listening");
        body.frame().await.expect("a frame").expect("data");
        tx.closed().await;
        assert_eq!(start.elapsed(), Duration::from_secs(28));
        let err = body.frame().await.expect("an end").expect_err("given up");
        assert!(err.is::<StreamIdle>(), "{err}");

        // Never polled at all (a window of 0 from the start): the same.
        let (tx, body) = idle_limited_feed();
        let start = tokio::time::Instant::now();
        tx.closed().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        drop(body);
    }

    #[tokio::test]
    async fn an_idle_limited_body_says_what_its_inner_says() {
        let body = IdleLimited::new(
            Full::new(Bytes::from("abc")),
            Duration::from_secs(1),
            None,
            None,
        );
        assert_eq!(exact(body.size_hint()), (3, Some(3)));
        assert!(!body.is_end_stream());
        let body = IdleLimited::new(Empty::<Bytes>::new(), Duration::from_secs(1), None, None);
        assert!(body.is_end_stream());
        // Given out in pieces of 16 KiB, the length still told.
        let mut body = IdleLimited::new(
            Full::new(Bytes::from(vec![7u8; 40 * 1024])),
            Duration::from_secs(1),
            None,
            None,
        );
        let mut pieces = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.expect("data").into_data().expect("data");
            pieces.push(data.len());
            let left = 40 * 1024 - pieces.iter().sum::<usize>();
            assert_eq!(exact(body.size_hint()), (left as u64, Some(left as u64)));
            assert_eq!(body.is_end_stream(), left == 0);
        }
        assert_eq!(pieces, [16 * 1024, 16 * 1024, 8 * 1024]);
    }
}
