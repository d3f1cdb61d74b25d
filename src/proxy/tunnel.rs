//! A switched protocol (WebSocket) after its 101: bytes both ways between the client's
//! upgraded connection and the upstream's, until both sides end, the tunnel goes idle, a
//! side's end leaves the other way's time run out (see [`HALF_CLOSED_IDLE`] and [`LINGER`])
//! or the drain's grace is over, and a line at its end saying which, after how long, and
//! how many bytes went each way.
//!
//! The request's access line is written when the 101 goes out, like every other answer's
//! when its head does; a tunnel then lives on for hours, and without its own end line a
//! WebSocket the proxy cut (idle, or at shutdown) looked the same as one its peer closed.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;

use super::failure::io_kind;
use super::listener::{self, Activity, IdleIo, OpenConnection};
use crate::metrics::{Metrics, Plane};
use crate::upstream::ProxyBody;

/// A client's request to switch protocols.
pub(super) struct Upgrade {
    /// The client's side of the tunnel, once hyper has written the 101.
    client: OnUpgrade,
    /// The client connection's place among the open ones, from the listener. `None` only
    /// for a request that did not come through a listener.
    connection: Option<Arc<OpenConnection>>,
    /// The request's path, never its query, escaped as in the access line.
    path: String,
}

impl Upgrade {
    pub(super) fn of(req: &mut http::Request<ProxyBody>) -> Self {
        Upgrade {
            connection: req.extensions_mut().remove(),
            client: hyper::upgrade::on(&mut *req),
            path: crate::logging::shown_path(req.uri().path()).into_owned(),
        }
    }
}

/// How a tunnel ended.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    /// Both sides closed it.
    Closed,
    /// One way failed: `up` (client to upstream) or down. Whose failure it was, the
    /// upstream side's [`Watched`] says.
    Failed { up: bool },
    /// The client's side failed (a reset, mostly), or went while an answer was written.
    Client,
    /// A read from the upstream failed: a reset, mostly (a server aborted, or one that
    /// closed its socket with bytes unread).
    Upstream(io::ErrorKind),
    /// No byte either way for `--idle-timeout`.
    Idle,
    /// One side ended, and the other way's time ran out: after the client's end, no byte
    /// went the upstream's way for [`HALF_CLOSED_IDLE`]; after the upstream's, the client
    /// had [`LINGER`].
    HalfClosed,
    /// The drain's grace ran out.
    Drain,
}

impl End {
    fn as_str(self) -> &'static str {
        match self {
            End::Closed => "closed",
            End::Failed { .. } => "error",
            End::Client => "client",
            End::Upstream(_) => "upstream",
            End::Idle => "idle",
            End::HalfClosed => "half-closed",
            End::Drain => "drain",
        }
    }

    /// An end, told by whose doing it was. The upstream failed when a read from it failed,
    /// or a write met a reset (`EPIPE` is the reset of a peer that had ended its side: a
    /// close), however the tunnel then ended, but for the proxy's own cuts; a failed way
    /// is otherwise the client's.
    fn blamed(self, upstream: &Watched<impl Sized>) -> End {
        let reset = upstream
            .write_failed
            .filter(|&k| k != io::ErrorKind::BrokenPipe);
        match (self, upstream.read_failed, reset) {
            (End::Failed { up: false }, Some(kind), _) => End::Upstream(kind),
            (End::Closed | End::HalfClosed | End::Failed { .. }, _, Some(kind)) => {
                End::Upstream(kind)
            }
            (End::Failed { .. }, _, _) => End::Client,
            (end, _, _) => end,
        }
    }
}

/// Where a tunnel's upstream failures are counted: `upstream_errors_total`, as an answer
/// the upstream breaks is.
pub(super) struct Count {
    pub metrics: Arc<Metrics>,
    pub plane: Plane,
}

/// Bytes both ways between an upgraded client connection and the upstream's.
///
/// Its own task, as hyper's connection (and the listener's task serving it) ends with the
/// 101. It keeps the client connection counted until the bytes stop: open, under
/// `--max-connections`, and waited for by the drain, which gives it the grace period to
/// end on its own; when that is over it is closed with every other connection left
/// (`aborting`, see `Proxy::abort`).
///
/// A tunnel that moves no bytes either way for `--idle-timeout` is closed, like any
/// connection: a client gone without a word would otherwise hold its place forever.
/// One side's end is passed on to the other (its write side shut down); then the
/// upstream's way goes on while it moves (see [`HALF_CLOSED_IDLE`]), the client's for
/// [`LINGER`] at most.
pub(super) async fn run(
    upgrade: Upgrade,
    upstream: OnUpgrade,
    idle_timeout: Duration,
    mut aborting: watch::Receiver<bool>,
    count: Count,
) {
    let Upgrade {
        client,
        connection: _open,
        path,
    } = upgrade;
    let (Ok(client), Ok(upstream)) = tokio::join!(client, upstream) else {
        return;
    };
    let start = Instant::now();
    // Every byte, either way, passes the client's side.
    let activity = Activity::new();
    let client = Counted::new(IdleIo::tunnel(TokioIo::new(client), activity.clone()));
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let upstream = Watched::new(TokioIo::new(upstream), &path);
    let (mut from_upstream, mut to_upstream) = tokio::io::split(upstream);
    let end = both_ways(
        pass(&mut from_client, &mut to_upstream),
        pass(&mut from_upstream, &mut to_client),
        &activity,
        idle_timeout,
        &mut aborting,
        &path,
    )
    .await;
    let client = from_client.unsplit(to_client);
    let end = end.blamed(&from_upstream.unsplit(to_upstream));
    let duration_ms = start.elapsed().as_millis() as u64;
    let (up, down) = (client.read, client.written);
    match end {
        // The proxy's own doing: worth a line at the default level.
        End::Idle | End::HalfClosed | End::Drain => tracing::info!(
            path = %path, end = end.as_str(), duration_ms, bytes_up = up, bytes_down = down,
            "tunnel cut"
        ),
        // As an answer the upstream breaks: nginx says "recv() failed … while proxying
        // upgraded connection". Only a debug line before, the same as a client's reset.
        End::Upstream(kind) => {
            count.metrics.upstream_error(count.plane, io_kind(kind));
            tracing::warn!(
                path = %path, end = end.as_str(), error = %kind, duration_ms, bytes_up = up,
                bytes_down = down, "tunnel closed"
            );
        }
        End::Closed | End::Client | End::Failed { .. } => tracing::debug!(
            path = %path, end = end.as_str(), duration_ms, bytes_up = up, bytes_down = down,
            "tunnel closed"
        ),
    }
}

/// How long the upstream's way of a tunnel whose client has ended goes on without a byte:
/// 5 s, as HAProxy's `timeout client-fin` bounds it (nginx ends such a tunnel at once).
/// WebSocket has no half-close: a client gone with a FIN (a killed process, a `close()`
/// without a Close frame) towards a server that ignores it held the tunnel, its slot of
/// `--max-connections` and the drain until `--idle-timeout`. An upstream still answering
/// after the client's end goes on as long as its bytes move.
const HALF_CLOSED_IDLE: Duration = Duration::from_secs(5);

/// How long a client has, once the upstream's way has ended (its bytes all handed to the
/// client's socket, and its end), to read the rest and end, as nginx's `lingering_time`;
/// what it sends meanwhile goes upstream, or nowhere once the upstream refuses it (see
/// [`Watched`]). Several MiB can wait in the sockets' buffers for a slow reader: cut with
/// bytes of its unread (a ping sent after a quiet spell is enough), its connection resets
/// and they are lost. At 5 s without a byte (the other way's bound) a reader taking 64 KiB
/// each 0.2 s and pinging every 8 s lost up to 1.6 of 8 MiB; at 5 s in all, one pinging
/// every 0.5 s lost 2.3 of 4 MiB; a client that kept sending into an upstream gone held
/// the tunnel for as long as it sent.
///
/// The limit: the time runs from the upstream's last byte handed to the client's socket,
/// and up to about 4 MiB can still be queued then (the proxy's send buffer and the
/// client's receive buffer). A reader slower than about 140 KiB/s that sends after the cut
/// loses what it had not read (a quiet one gets it all: the kernel goes on sending after
/// the close). Cutting when that queue stops shrinking would need `SIOCOUTQ` or
/// `TCP_INFO`, which no safe interface the proxy uses offers.
const LINGER: Duration = Duration::from_secs(30);

/// One way of a tunnel: every byte, then the end passed on (the write side shut down).
async fn pass<R, W>(from: &mut R, to: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    tokio::io::copy(&mut EndAtUnexpectedEof(from), to).await?;
    to.shutdown().await
}

/// A TLS peer that ends without `close_notify` (Python's `ssl` at a half-close, many
/// servers at their end) reads as an `UnexpectedEof` error. In a tunnel that is its end like
/// any other, as nginx takes it (`SSL_OP_IGNORE_UNEXPECTED_EOF`): the protocol inside
/// (WebSocket's Close frame) tells a cut from an end. Taken as an error, the copy dropped
/// what it had read and not yet written (up to 8 KiB: the end of a download, the Close
/// frame) and the tunnel ended both ways at once, the other side's answer unsent.
struct EndAtUnexpectedEof<R>(R);

impl<R: AsyncRead + Unpin> AsyncRead for EndAtUnexpectedEof<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.0).poll_read(cx, buf) {
            Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Poll::Ready(Ok(())),
            polled => polled,
        }
    }
}

/// Runs both ways of a tunnel until both have ended, one fails, the tunnel is idle (see
/// [`HALF_CLOSED_IDLE`] once the client's way has ended), the client has had [`LINGER`]
/// since the upstream's way ended, or the drain's grace is over.
async fn both_ways(
    up: impl std::future::Future<Output = io::Result<()>>,
    down: impl std::future::Future<Output = io::Result<()>>,
    activity: &Activity,
    idle_timeout: Duration,
    aborting: &mut watch::Receiver<bool>,
    path: &str,
) -> End {
    let (mut up, mut down) = (std::pin::pin!(up), std::pin::pin!(down));
    let (mut up_ended, mut down_ended) = (false, false);
    // When the client's time to read the rest and end is over (see [`LINGER`]).
    let mut lingering: Option<tokio::time::Instant> = None;
    loop {
        let idle = match up_ended && !down_ended {
            true => HALF_CLOSED_IDLE.min(idle_timeout),
            false => idle_timeout,
        };
        if lingering.is_none() && down_ended {
            lingering = Some(tokio::time::Instant::now() + LINGER.min(idle_timeout));
        }
        let lingered = async {
            match lingering {
                Some(until) => tokio::time::sleep_until(until).await,
                None => std::future::pending().await,
            }
        };
        let half_closed = up_ended || down_ended;
        tokio::select! {
            () = lingered => return End::HalfClosed,
            ended = &mut up, if !up_ended => match ended {
                Ok(()) => {
                    tracing::debug!(path, "the client ended its side of a tunnel");
                    up_ended = true;
                }
                Err(_) => return End::Failed { up: true },
            },
            ended = &mut down, if !down_ended => match ended {
                Ok(()) => {
                    tracing::debug!(path, "the upstream ended its side of a tunnel");
                    down_ended = true;
                }
                Err(_) => return End::Failed { up: false },
            },
            () = listener::idle(activity, idle) => {
                return if half_closed { End::HalfClosed } else { End::Idle };
            }
            _ = aborting.wait_for(|a| *a) => return End::Drain,
        }
        if up_ended && down_ended {
            return End::Closed;
        }
        // The wait for the other way counts from the end, not from the last byte: a side
        // quiet for a while before it ended would leave the other no time to answer.
        if !half_closed {
            activity.touch();
        }
    }
}

/// The upstream's side of a tunnel, remembering how a read from it failed. A read's
/// `UnexpectedEof` (a TLS peer's end without `close_notify`) is an end, not a failure (see
/// [`EndAtUnexpectedEof`]).
///
/// A write to it that fails makes it a sink: the client's bytes from then on are dropped,
/// while the upstream's way goes on, and for [`LINGER`] after its end: the client's time
/// to read the rest and end. A server that closes its socket after its last bytes (a
/// WebSocket server after its Close frame, as many do) resets what the client sends next;
/// ending the tunnel there dropped the client's connection with its bytes unread, which
/// reset it and lost the end of what the upstream had sent (2 of 4 MiB, and the Close
/// frame, to a client that pinged while it read).
struct Watched<T> {
    inner: T,
    read_failed: Option<io::ErrorKind>,
    /// How the first write that failed did; everything written since was dropped.
    write_failed: Option<io::ErrorKind>,
    /// The tunnel's, for the line saying so.
    path: String,
}

impl<T> Watched<T> {
    fn new(inner: T, path: &str) -> Self {
        Watched {
            inner,
            read_failed: None,
            write_failed: None,
            path: path.to_owned(),
        }
    }

    /// A write's (or flush's, or shutdown's) outcome: a failure makes the upstream's side
    /// a sink, and becomes `done`.
    fn wrote<R>(&mut self, polled: Poll<io::Result<R>>, done: R) -> Poll<io::Result<R>> {
        match polled {
            Poll::Ready(Err(e)) => {
                self.write_failed = Some(e.kind());
                tracing::debug!(
                    path = %self.path,
                    "the upstream's side of a tunnel refused the client's bytes; they are dropped \
                     from now on"
                );
                Poll::Ready(Ok(done))
            }
            polled => polled,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Err(e)) = &polled {
            if e.kind() != io::ErrorKind::UnexpectedEof {
                self.read_failed = self.read_failed.or(Some(e.kind()));
            }
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.write_failed.is_some() {
            return Poll::Ready(Ok(buf.len()));
        }
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(polled, buf.len())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_failed.is_some() {
            return Poll::Ready(Ok(()));
        }
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.wrote(polled, ())
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_failed.is_some() {
            return Poll::Ready(Ok(()));
        }
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.wrote(polled, ())
    }
}

/// Counts what is read from and written to the client: what went up and what came down.
struct Counted<T> {
    inner: T,
    read: u64,
    written: u64,
}

impl<T> Counted<T> {
    fn new(inner: T) -> Self {
        Counted {
            inner,
            read: 0,
            written: 0,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.read += (buf.filled().len() - before) as u64;
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.written += n as u64;
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};

    use super::*;

    const GUARD: Duration = Duration::from_secs(10);

    /// Counts what each read added, also into a buffer that already held bytes (as a copy
    /// whose writer is behind reads into the rest of its buffer).
    #[tokio::test]
    async fn counts_each_reads_own_bytes() {
        let mut counted = Counted::new(&b"hello"[..]);
        let mut storage = [0u8; 16];
        let mut buf = ReadBuf::new(&mut storage);
        buf.put_slice(b"held");
        std::future::poll_fn(|cx| Pin::new(&mut counted).poll_read(cx, &mut buf))
            .await
            .expect("read");
        assert_eq!(buf.filled(), b"heldhello");
        assert_eq!(counted.read, 5);
    }

    /// The upstream failed when a read from it failed, or a write met a reset (not the
    /// `EPIPE` of a peer that had closed), however the tunnel then ended but for the
    /// proxy's own cuts; a failed way is otherwise the client's.
    #[test]
    fn an_end_is_blamed_on_its_side() {
        use io::ErrorKind::{BrokenPipe, ConnectionReset};
        let side = |read_failed, write_failed| Watched {
            inner: (),
            read_failed,
            write_failed,
            path: String::new(),
        };
        let (reset, pipe) = (Some(ConnectionReset), Some(BrokenPipe));
        let upstream = End::Upstream(ConnectionReset);
        let cases = [
            (End::Failed { up: false }, side(reset, None), upstream),
            (End::Failed { up: false }, side(None, None), End::Client),
            (End::Failed { up: true }, side(None, None), End::Client),
            (End::Failed { up: true }, side(reset, None), End::Client),
            (End::Failed { up: true }, side(None, reset), upstream),
            (End::Failed { up: true }, side(None, pipe), End::Client),
            (End::Closed, side(None, reset), upstream),
            (End::Closed, side(None, pipe), End::Closed),
            (End::HalfClosed, side(None, reset), upstream),
            (End::HalfClosed, side(None, pipe), End::HalfClosed),
            (End::Idle, side(reset, reset), End::Idle),
            (End::Drain, side(None, reset), End::Drain),
        ];
        for (end, upstream, blamed) in cases {
            assert_eq!(end.blamed(&upstream), blamed, "{end:?}");
        }
    }

    /// A write that fails makes the upstream's side a sink: it and every write after it
    /// take their bytes, and a flush and the shutdown succeed.
    #[tokio::test]
    async fn a_refused_write_makes_a_sink() {
        struct Refusing(usize);
        impl AsyncWrite for Refusing {
            fn poll_write(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &[u8],
            ) -> Poll<io::Result<usize>> {
                self.0 += 1;
                Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
            }
            fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
            }
        }
        let mut side = Watched::new(Refusing(0), "/ws");
        assert_eq!(side.write(b"close").await.expect("taken"), 5);
        assert_eq!(side.write(b"ping").await.expect("taken"), 4);
        side.flush().await.expect("flushed");
        side.shutdown().await.expect("shut");
        assert_eq!(side.write_failed, Some(io::ErrorKind::BrokenPipe));
        assert_eq!(side.inner.0, 1);
    }

    /// Bytes, then `UnexpectedEof` (a TLS peer's end without `close_notify`).
    struct CutShort(Vec<u8>);

    impl AsyncRead for CutShort {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if self.0.is_empty() {
                return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
            }
            let n = self.0.len().min(buf.remaining());
            buf.put_slice(&self.0[..n]);
            self.0.drain(..n);
            Poll::Ready(Ok(()))
        }
    }

    /// A side that ends without `close_notify` while the other is behind: every byte it sent
    /// still goes on, then the end. The copy reads ahead while a write waits: taken as an
    /// error, the `UnexpectedEof` dropped what it held.
    #[tokio::test]
    async fn an_end_without_close_notify_passes_every_byte_on() {
        let sent: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
        let mut from = CutShort(sent.clone());
        // A small pipe: its reader is behind from the first write.
        let (mut to, mut far) = tokio::io::duplex(16);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.map(|_| got)
        });
        let passed = tokio::time::timeout(GUARD, pass(&mut from, &mut to)).await;
        passed
            .expect("passed in time")
            .expect("an end, not an error");
        drop(to);
        let got = tokio::time::timeout(GUARD, reader).await;
        let got = got.expect("read in time").expect("reader").expect("read");
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "the bytes changed on the way");
    }

    /// A flush and a shutdown reach the side beneath: what it buffered goes out, and the
    /// peer sees the end (the half-close a tunnel passes on when one side is done).
    #[tokio::test]
    async fn flush_and_shutdown_reach_the_side_beneath() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut counted = Counted::new(BufWriter::new(near));
        counted.write_all(b"ping").await.expect("write");
        counted.flush().await.expect("flush");
        // Bounded: a flush that stopped at `Counted` would leave the read waiting forever.
        let mut got = [0u8; 4];
        let read = tokio::time::timeout(GUARD, far.read_exact(&mut got)).await;
        read.expect("the flushed bytes in time")
            .expect("the flushed bytes");
        assert_eq!(&got, b"ping");
        counted.write_all(b"bye").await.expect("write");
        counted.shutdown().await.expect("shutdown");
        let mut rest = Vec::new();
        let read = tokio::time::timeout(GUARD, far.read_to_end(&mut rest)).await;
        read.expect("the end in time").expect("the end");
        assert_eq!(rest, b"bye");
        assert_eq!(counted.written, 7);
    }
}
