//! Zero-copy forwarding of a sized body from one plain TCP socket to another with
//! `splice(2)`: socket → pipe → socket, the bytes never enter this process. A copying proxy
//! moves every byte through user space twice more than the client and upstream do, which
//! on a loaded machine halves a large download; HAProxy splices for the same reason.
//!
//! Only where both ends are plain TCP and the length is known: TLS needs the bytes in user
//! space, and chunked or close-delimited bodies need their framing read. Linux only.
//!
//! Used for downloads: the pool offers a large body ([`Offer`], `pool::Splice`) in the
//! response's extensions, and the fast path's response writer takes it. Uploads were
//! spliced too for a while; `benches/load.sh` measured them no faster than the copy, so
//! they are read as usual.

use std::future::poll_fn;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use rustix::io::Errno;
use rustix::pipe::{fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bodies at least this long are offered for splicing; below it a copy costs less than
/// the pipe and the extra calls.
pub const MIN: u64 = 1 << 20;

/// The pipe between the sockets. Linux's default is 64 KiB; a larger one takes fewer calls
/// per byte. Unprivileged processes may go up to 1 MiB (`/proc/sys/fs/pipe-max-size`).
const PIPE_SIZE: usize = 1 << 20;

/// A copy that failed, by the side that failed it: the source (the upstream, whose failure
/// is counted) or the sink (the client, who may just have gone).
#[derive(Debug)]
pub enum Broken {
    Source(io::Error),
    Sink(io::Error),
}

impl From<Broken> for io::Error {
    fn from(b: Broken) -> io::Error {
        match b {
            Broken::Source(e) | Broken::Sink(e) => e,
        }
    }
}

/// A pipe and the bytes in it: the state of one copy, kept between polls.
pub struct Pipe {
    out: OwnedFd,
    inn: OwnedFd,
    capacity: usize,
    held: usize,
    /// The source's early end or failure, said once the pipe has given `to` what it holds.
    broken: Option<io::Error>,
}

impl Pipe {
    /// Made before a body is taken to be spliced: without one (no descriptor left) the
    /// body is copied as usual, not cut after its head.
    pub fn new() -> io::Result<Pipe> {
        let (out, inn) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        // Where the limit is lower, the default size still works, in more calls.
        let capacity = fcntl_setpipe_size(&inn, PIPE_SIZE).unwrap_or(64 * 1024);
        Ok(Pipe {
            out,
            inn,
            capacity,
            held: 0,
            broken: None,
        })
    }

    /// Moves bytes from `from` to `to` until `len` (what is still to take from `from`) is
    /// 0 and the pipe is empty; `progress` runs after every write to `to`. Fails on an
    /// early end of `from` (`UnexpectedEof`) or a socket error; bytes moved stay moved,
    /// and those the pipe holds when `from` fails go to `to` first, as a copy's would.
    /// `source_failed` hears of that failure when it happens: the client may never take
    /// the rest (it goes, or the idle timeout or the drain ends the copy first).
    fn poll_copy(
        &mut self,
        cx: &mut Context<'_>,
        from: &TcpStream,
        to: &TcpStream,
        len: &mut u64,
        mut progress: impl FnMut(),
        mut source_failed: impl FnMut(&io::Error),
    ) -> Poll<Result<(), Broken>> {
        let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
        loop {
            if self.held == 0 {
                if let Some(e) = self.broken.take() {
                    return Poll::Ready(Err(Broken::Source(e)));
                }
                if *len == 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            let can_take = *len > 0 && self.held < self.capacity && self.broken.is_none();
            let mut moved = false;
            // A pipe has a slot per segment spliced in, so after small segments it is full
            // with far fewer bytes than its size, and the splice fails with EAGAIN though the
            // socket has bytes. `try_io` must not take that for the socket's "not ready" and
            // clear its readiness: when the upstream has sent all it will, no edge would come
            // to set it again. Only an empty pipe's EAGAIN speaks for the socket.
            let mut maybe_full = false;
            if can_take {
                let want = usize::try_from(*len)
                    .unwrap_or(usize::MAX)
                    .min(self.capacity - self.held);
                let held = self.held;
                match from.try_io(Interest::READABLE, || {
                    match splice(from, None, &self.inn, None, want, flags) {
                        Err(Errno::AGAIN) if held > 0 => Ok(None),
                        r => Ok(Some(r?)),
                    }
                }) {
                    Ok(None) => maybe_full = true,
                    Ok(Some(0)) => {
                        let eof = io::ErrorKind::UnexpectedEof.into();
                        source_failed(&eof);
                        self.broken = Some(eof);
                        continue;
                    }
                    Ok(Some(n)) => {
                        self.held += n;
                        *len -= n as u64;
                        moved = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        source_failed(&e);
                        self.broken = Some(e);
                        continue;
                    }
                }
            }
            if self.held > 0 {
                match to.try_io(Interest::WRITABLE, || {
                    Ok(splice(&self.out, None, to, None, self.held, flags)?)
                }) {
                    Ok(0) => {
                        return Poll::Ready(Err(Broken::Sink(io::ErrorKind::WriteZero.into())))
                    }
                    Ok(n) => {
                        self.held -= n;
                        progress();
                        moved = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(Broken::Sink(e))),
                }
            }
            if moved {
                continue;
            }
            // Neither side could move: `try_io` cleared the readiness it found wanting,
            // so these register for the next edge of whichever side can move next. After
            // `maybe_full` the socket's readiness is still set and waiting on it would spin;
            // the pipe holds bytes then, and `to` taking them wakes the copy.
            let mut ready = false;
            if can_take && !maybe_full {
                if let Poll::Ready(r) = from.poll_read_ready(cx) {
                    r.map_err(Broken::Source)?;
                    ready = true;
                }
            }
            if self.held > 0 {
                if let Poll::Ready(r) = to.poll_write_ready(cx) {
                    r.map_err(Broken::Sink)?;
                    ready = true;
                }
            }
            if !ready {
                return Poll::Pending;
            }
        }
    }
}

/// Moves exactly `len` bytes from `from` to `to` through `pipe`; `progress` runs after
/// every write, for the idle clock; `source_failed` when `from` fails (see
/// [`Pipe::poll_copy`]).
pub async fn copy(
    mut pipe: Pipe,
    from: &TcpStream,
    to: &TcpStream,
    mut len: u64,
    mut progress: impl FnMut(),
    mut source_failed: impl FnMut(&io::Error),
) -> Result<(), Broken> {
    let mut copying = |cx: &mut Context<'_>| {
        pipe.poll_copy(cx, from, to, &mut len, &mut progress, &mut source_failed)
    };
    poll_fn(&mut copying).await
}

/// A body offered to whoever ends up writing it: one that writes to a plain TCP socket may
/// take it and splice the rest instead of reading it. The message keeps a body that reads
/// the same shared state as usual ([`OfferedBody`]), so everyone else (hyper's TLS
/// connections, the sniffing of answers) just reads it. The offer can only be taken while
/// nothing has read from the body: no byte is read twice or lost.
pub struct Offer<B>(Arc<Mutex<Offered<B>>>);

struct Offered<B> {
    body: Option<B>,
    touched: bool,
}

impl<B> Clone for Offer<B> {
    fn clone(&self) -> Self {
        Offer(self.0.clone())
    }
}

fn lock<B>(shared: &Mutex<Offered<B>>) -> MutexGuard<'_, Offered<B>> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<B> Offer<B> {
    /// The offer, and the body to put in the message.
    pub fn new(body: B) -> (Offer<B>, OfferedBody<B>) {
        let shared = Arc::new(Mutex::new(Offered {
            body: Some(body),
            touched: false,
        }));
        (Offer(shared.clone()), OfferedBody(shared))
    }

    /// The body, if nothing has read from it yet and `fits` it; the message's body is
    /// empty after.
    pub fn take_if(&self, fits: impl FnOnce(&B) -> bool) -> Option<B> {
        let mut offered = lock(&self.0);
        if offered.touched || !offered.body.as_ref().is_some_and(fits) {
            return None;
        }
        offered.body.take()
    }
}

/// The message's side of an [`Offer`]: reads the shared body as usual.
pub struct OfferedBody<B>(Arc<Mutex<Offered<B>>>);

impl<B: Body + Unpin> Body for OfferedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut offered = lock(&self.0);
        offered.touched = true;
        match offered.body.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.0).body.as_ref().is_none_or(B::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.0)
            .body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), B::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::io::ioctl_fionread;
    use std::os::fd::AsFd;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpSocket};
    use tokio::time::timeout;

    /// Two connected sockets: (ours, the peer's).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    /// 8 MiB of a known pattern, written slowly enough in parts to exercise the waits, go
    /// through byte for byte; the bytes after `len` stay in the source socket.
    #[tokio::test]
    async fn moves_exactly_len_bytes_in_order() {
        let (from, mut writer) = pair().await;
        let (to, mut reader) = pair().await;
        let len = 8 << 20;
        let pattern = |i: usize| (i % 251) as u8;
        let write = tokio::spawn(async move {
            let data: Vec<u8> = (0..len + 5).map(pattern).collect();
            for part in data.chunks(100_003) {
                writer.write_all(part).await.unwrap();
            }
            writer
        });
        let read = tokio::spawn(async move {
            let mut got = vec![0u8; len];
            reader.read_exact(&mut got).await.unwrap();
            got
        });
        let mut calls = 0;
        copy(
            Pipe::new().unwrap(),
            &from,
            &to,
            len as u64,
            || calls += 1,
            |_| {},
        )
        .await
        .unwrap();
        let got = read.await.unwrap();
        assert!(got.iter().enumerate().all(|(i, b)| *b == pattern(i)));
        assert!(calls > 0);
        let _writer = write.await.unwrap();
        let mut rest = [0u8; 5];
        let mut from = from;
        from.read_exact(&mut rest).await.unwrap();
        assert_eq!(
            rest.to_vec(),
            (len..len + 5).map(pattern).collect::<Vec<_>>()
        );
    }

    /// Two connected sockets for a slow client: ours sends through a small buffer and the
    /// peer's receives into one, so a few KiB fill them and the pipe has to hold the rest.
    async fn narrow_pair() -> (TcpStream, TcpStream) {
        let listener = TcpSocket::new_v4().unwrap();
        listener.set_recv_buffer_size(4096).unwrap();
        listener.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = listener.listen(1).unwrap();
        let ours = TcpSocket::new_v4().unwrap();
        ours.set_send_buffer_size(4096).unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(ours.connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    /// A body that arrives in segments smaller than a page fills the pipe's slots (one per
    /// segment) while its bytes are far below the pipe's size. The upstream has sent it all
    /// before the client reads; nothing more arrives to wake the copy, which must still take
    /// the rest from the socket once the client drained the pipe.
    #[tokio::test]
    async fn a_pipe_full_of_small_segments_still_takes_the_rest() {
        let (from, mut writer) = pair().await;
        let (to, mut reader) = narrow_pair().await;
        writer.set_nodelay(true).unwrap();
        // Our own registration of the source socket: waiting on `from`'s readiness would
        // share (and could consume) the copy's.
        let arrivals = from.as_fd().try_clone_to_owned().unwrap();
        let arrivals = TcpStream::from_std(std::net::TcpStream::from(arrivals)).unwrap();
        let mut pipe = Pipe::new().unwrap();
        // Four slots instead of 256: the same limit, reached in four segments rather than
        // 256, so what waits in the socket meanwhile fits its receive buffer.
        pipe.capacity = fcntl_setpipe_size(&pipe.inn, 4 * 4096).unwrap();
        let len = 32 << 10;
        let pattern = |i: usize| (i % 251) as u8;
        let data: Vec<u8> = (0..len).map(pattern).collect();
        let mut left = len as u64;
        let upstream = async {
            let mut written = 0;
            // One segment per write, and the copy looks at each before the next is written:
            // on loopback, segments that arrive while others wait in the receive queue merge
            // with them, and a merged run takes one slot. The copy looks once the runtime has
            // seen the arrival (here: `arrivals` woke), as in the proxy, where that wakes it.
            for piece in data.chunks(1024) {
                writer.write_all(piece).await.unwrap();
                written += piece.len();
                loop {
                    arrivals.readable().await.unwrap();
                    arrivals
                        .try_io(Interest::READABLE, || {
                            Err::<(), _>(io::ErrorKind::WouldBlock.into())
                        })
                        .unwrap_err();
                    let queued = ioctl_fionread(&from).unwrap() as usize;
                    if len - left as usize + queued >= written {
                        break;
                    }
                }
                let step = poll_fn(|cx| {
                    Poll::Ready(pipe.poll_copy(cx, &from, &to, &mut left, || {}, |_| {}))
                });
                assert!(step.await.is_pending(), "the client has not read yet");
            }
        };
        let limit = Duration::from_secs(5);
        timeout(limit, upstream)
            .await
            .expect("the upstream's bytes arrive");
        // Only now the client reads, and the upstream sends nothing more.
        let queued = ioctl_fionread(&from).unwrap();
        let read = async {
            let mut got = vec![0u8; len];
            reader.read_exact(&mut got).await.unwrap();
            got
        };
        let copy = poll_fn(|cx| pipe.poll_copy(cx, &from, &to, &mut left, || {}, |_| {}));
        let Ok((copied, got)) = timeout(limit, async { tokio::join!(copy, read) }).await else {
            panic!("the copy stalled: {queued} bytes were in the source socket, {left} left");
        };
        copied.unwrap();
        assert!(got == data);
    }

    /// One poll of a copy, on a thread of its own: a copy that neither moves nor returns
    /// (a busy loop, a core burnt for as long as a slow client takes) fails the test
    /// instead of hanging it. Says whether the poll was pending, and what is left to take
    /// from the source.
    fn poll_alone(mut pipe: Pipe, from: TcpStream, to: TcpStream, mut len: u64) -> (bool, u64) {
        let (done, polled) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            let pending = pipe
                .poll_copy(&mut cx, &from, &to, &mut len, || {}, |_| {})
                .is_pending();
            let _ = done.send((pending, len));
        });
        polled
            .recv_timeout(Duration::from_secs(10))
            .expect("a copy that can move nothing returns")
    }

    /// Nothing has come from the upstream yet and the client could take bytes: the copy
    /// waits for the upstream alone, not on the client's standing readiness to write.
    #[tokio::test]
    async fn a_copy_with_nothing_to_move_waits() {
        let (from, _writer) = pair().await;
        let (to, _reader) = pair().await;
        assert_eq!(poll_alone(Pipe::new().unwrap(), from, to, 100), (true, 100));
    }

    /// The client reads nothing while the upstream has sent more than the pipe and the
    /// client's socket hold: the copy waits for the client, not on the upstream's standing
    /// readiness to read.
    #[tokio::test]
    async fn a_copy_blocked_by_the_client_waits() {
        let (from, mut writer) = pair().await;
        let (to, _reader) = narrow_pair().await;
        let mut pipe = Pipe::new().unwrap();
        pipe.capacity = fcntl_setpipe_size(&pipe.inn, 4 * 4096).unwrap();
        // Within what a receive buffer takes unread, beyond what the pipe and the narrow
        // client hold.
        let len = 48 << 10;
        writer.write_all(&vec![7u8; len]).await.unwrap();
        // All of it in the source socket before the poll, the readiness left set.
        let arrived = until(&from, |_| ioctl_fionread(&from).unwrap() as usize >= len);
        timeout(Duration::from_secs(10), arrived)
            .await
            .expect("the upstream's bytes arrive");
        let (pending, left) = poll_alone(pipe, from, to, len as u64);
        assert!(pending);
        assert!(left > 0, "the client took it all: no wait to test");
    }

    /// Waits on `sock`'s readiness to read until `done` says so, clearing what was found
    /// each time it does not.
    async fn until(sock: &TcpStream, mut done: impl FnMut(tokio::io::Ready) -> bool) {
        loop {
            let ready = sock.ready(Interest::READABLE).await.unwrap();
            if done(ready) {
                return;
            }
            let _ = sock.try_io(Interest::READABLE, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
        }
    }

    /// The source ends before `len`: an error, not a short success.
    #[tokio::test]
    async fn an_early_end_is_unexpected_eof() {
        let (from, mut writer) = pair().await;
        let (to, _reader) = pair().await;
        writer.write_all(b"only this").await.unwrap();
        drop(writer);
        let Err(Broken::Source(e)) =
            copy(Pipe::new().unwrap(), &from, &to, 100, || {}, |_| {}).await
        else {
            panic!("an early end of the source is the source's failure");
        };
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// The source ends early while the pipe holds bytes a client that does not read has
    /// yet to take: the end is heard at once (counted, said), not when the pipe is empty,
    /// which a client that goes, or the idle timeout or the drain, may never let happen.
    /// The copy still waits to give the client what the pipe holds.
    #[tokio::test]
    async fn a_source_that_fails_is_heard_before_the_pipe_is_given_out() {
        let (from, mut writer) = pair().await;
        let (to, _reader) = narrow_pair().await;
        // Our own registration of the source socket (see the test above).
        let arrivals = from.as_fd().try_clone_to_owned().unwrap();
        let arrivals = TcpStream::from_std(std::net::TcpStream::from(arrivals)).unwrap();
        // Beyond what the narrow client holds, within what the pipe does.
        let sent = 64 << 10;
        writer.write_all(&vec![7u8; sent]).await.unwrap();
        drop(writer);
        let ended = until(&arrivals, |ready| ready.is_read_closed());
        timeout(Duration::from_secs(10), ended)
            .await
            .expect("the source's bytes and its end arrive");
        let mut pipe = Pipe::new().unwrap();
        let mut left = 2 * sent as u64;
        let mut heard = Vec::new();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let polled = pipe.poll_copy(
            &mut cx,
            &from,
            &to,
            &mut left,
            || {},
            |e| heard.push(e.kind()),
        );
        assert!(polled.is_pending(), "{polled:?}");
        assert!(
            pipe.held > 0,
            "the client took it all: nothing held to test"
        );
        assert_eq!(heard, [io::ErrorKind::UnexpectedEof]);
    }

    /// The client goes away mid-body: the sink's failure, reported at once, not retried
    /// as if the socket were only full.
    #[tokio::test]
    async fn a_client_gone_is_the_sinks_failure() {
        let (from, mut writer) = pair().await;
        let (to, reader) = pair().await;
        drop(reader);
        let len = 32 << 20;
        // Bytes to move for as long as the copy takes them; stopped with the runtime.
        tokio::spawn(async move {
            let part = vec![7u8; 64 * 1024];
            while writer.write_all(&part).await.is_ok() {}
        });
        let copy = copy(Pipe::new().unwrap(), &from, &to, len, || {}, |_| {});
        let copied = timeout(Duration::from_secs(10), copy).await;
        let Ok(Err(Broken::Sink(_))) = copied else {
            panic!("a gone client is the sink's failure: {copied:?}");
        };
    }

    /// An offer is taken only while nothing has read the body and only when it fits;
    /// taken, it leaves the message an empty, ended body.
    #[test]
    fn an_offer_is_taken_whole_or_not_at_all() {
        use futures_util::FutureExt;
        use http_body_util::{BodyExt, Full};
        let hello = || Full::new(bytes::Bytes::from_static(b"hello"));

        let (offer, body) = Offer::new(hello());
        assert!(
            offer.take_if(|_| false).is_none(),
            "taken though it did not fit"
        );
        assert_eq!(body.size_hint().exact(), Some(5));
        assert!(!body.is_end_stream());
        let taken = offer.take_if(|b| b.size_hint().exact() == Some(5));
        assert_eq!(taken.map(|b| b.size_hint().exact()), Some(Some(5)));
        assert_eq!(body.size_hint().exact(), Some(0));
        assert!(body.is_end_stream());

        // Once read from, the body stays with the message, which reads on as usual.
        let (offer, mut body) = Offer::new(hello());
        let first = body
            .frame()
            .now_or_never()
            .flatten()
            .map(|f| f.map(Frame::into_data));
        assert!(
            matches!(first, Some(Ok(Ok(ref d))) if d == "hello"),
            "{first:?}"
        );
        assert!(offer.take_if(|_| true).is_none(), "taken after a read");
        assert!(body.is_end_stream());
    }
}
