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
struct Pipe {
    out: OwnedFd,
    inn: OwnedFd,
    capacity: usize,
    held: usize,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let (out, inn) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        // Where the limit is lower, the default size still works, in more calls.
        let capacity = fcntl_setpipe_size(&inn, PIPE_SIZE).unwrap_or(64 * 1024);
        Ok(Pipe {
            out,
            inn,
            capacity,
            held: 0,
        })
    }

    /// Moves bytes from `from` to `to` until `len` (what is still to take from `from`) is
    /// 0 and the pipe is empty; `progress` runs after every write to `to`. Fails on an
    /// early end of `from` (`UnexpectedEof`) or a socket error; bytes moved stay moved.
    fn poll_copy(
        &mut self,
        cx: &mut Context<'_>,
        from: &TcpStream,
        to: &TcpStream,
        len: &mut u64,
        mut progress: impl FnMut(),
    ) -> Poll<Result<(), Broken>> {
        let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
        loop {
            if *len == 0 && self.held == 0 {
                return Poll::Ready(Ok(()));
            }
            let can_take = *len > 0 && self.held < self.capacity;
            let mut moved = false;
            if can_take {
                let want = usize::try_from(*len)
                    .unwrap_or(usize::MAX)
                    .min(self.capacity - self.held);
                match from.try_io(Interest::READABLE, || {
                    Ok(splice(from, None, &self.inn, None, want, flags)?)
                }) {
                    Ok(0) => {
                        let eof = io::ErrorKind::UnexpectedEof.into();
                        return Poll::Ready(Err(Broken::Source(eof)));
                    }
                    Ok(n) => {
                        self.held += n;
                        *len -= n as u64;
                        moved = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(Broken::Source(e))),
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
            // so these register for the next edge of whichever side can move next.
            let mut ready = false;
            if can_take {
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

/// Moves exactly `len` bytes from `from` to `to`; `progress` runs after every write, for
/// the idle clock.
pub async fn copy(
    from: &TcpStream,
    to: &TcpStream,
    mut len: u64,
    mut progress: impl FnMut(),
) -> Result<(), Broken> {
    // No pipe is nobody's fault but ours; the client's side is where it surfaces.
    let mut pipe = Pipe::new().map_err(Broken::Sink)?;
    poll_fn(|cx| pipe.poll_copy(cx, from, to, &mut len, &mut progress)).await
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
        lock(&self.0).body.as_ref().map_or(true, B::is_end_stream)
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

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
        copy(&from, &to, len as u64, || calls += 1).await.unwrap();
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

    /// The source ends before `len`: an error, not a short success.
    #[tokio::test]
    async fn an_early_end_is_unexpected_eof() {
        let (from, mut writer) = pair().await;
        let (to, _reader) = pair().await;
        writer.write_all(b"only this").await.unwrap();
        drop(writer);
        let Err(Broken::Source(e)) = copy(&from, &to, 100, || {}).await else {
            panic!("an early end of the source is the source's failure");
        };
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
