//! A switched protocol (WebSocket) after its 101: bytes both ways between the client's
//! upgraded connection and the upstream's, until a side ends, the tunnel goes idle or the
//! drain's grace is over, and a line at its end saying which, after how long, and how many
//! bytes went each way.
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
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use super::listener::{self, Activity, IdleIo, OpenConnection};
use crate::upstream::ProxyBody;

/// A client's request to switch protocols.
pub(super) struct Upgrade {
    /// The client's side of the tunnel, once hyper has written the 101.
    client: OnUpgrade,
    /// The client connection's place among the open ones, from the listener. `None` only
    /// for a request that did not come through a listener.
    connection: Option<Arc<OpenConnection>>,
    /// The request's path, never its query (as in the access line).
    path: String,
}

impl Upgrade {
    pub(super) fn of(req: &mut http::Request<ProxyBody>) -> Self {
        Upgrade {
            connection: req.extensions_mut().remove(),
            client: hyper::upgrade::on(&mut *req),
            path: req.uri().path().to_owned(),
        }
    }
}

/// How a tunnel ended.
#[derive(Clone, Copy)]
enum End {
    /// A side closed it.
    Closed,
    /// A side failed (a reset, mostly).
    Failed,
    /// No byte either way for `--idle-timeout`.
    Idle,
    /// The drain's grace ran out.
    Drain,
}

impl End {
    fn as_str(self) -> &'static str {
        match self {
            End::Closed => "closed",
            End::Failed => "error",
            End::Idle => "idle",
            End::Drain => "drain",
        }
    }
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
pub(super) async fn run(
    upgrade: Upgrade,
    upstream: OnUpgrade,
    idle_timeout: Duration,
    mut aborting: watch::Receiver<bool>,
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
    let mut client = Counted::new(IdleIo::tunnel(TokioIo::new(client), activity.clone()));
    let mut upstream = TokioIo::new(upstream);
    let end = tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
            if copied.is_ok() { End::Closed } else { End::Failed }
        }
        () = listener::idle(&activity, idle_timeout) => End::Idle,
        _ = aborting.wait_for(|a| *a) => End::Drain,
    };
    let duration_ms = start.elapsed().as_millis() as u64;
    let (up, down) = (client.read, client.written);
    match end {
        // The proxy's own doing: worth a line at the default level.
        End::Idle | End::Drain => tracing::info!(
            path = %path, end = end.as_str(), duration_ms, bytes_up = up, bytes_down = down,
            "tunnel cut"
        ),
        End::Closed | End::Failed => tracing::debug!(
            path = %path, end = end.as_str(), duration_ms, bytes_up = up, bytes_down = down,
            "tunnel closed"
        ),
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
