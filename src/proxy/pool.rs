//! The upstream client the proxy forwards through: a lean HTTP/1.1 client with a keep-alive
//! pool per origin, driven inline in the request's own task, and hyper-util's legacy
//! client beside it for what it alone can do.
//!
//! The legacy pooled client costs a spawned task per connection and a channel hand-off per
//! request (a cross-thread wake-up each way); here the request task writes the head and
//! body and reads the answer itself, and the response body owns the connection until its
//! end, when it goes back to the idle list of its origin. A request whose 2xx answer begins
//! before all of its body went up sends the rest from that answer's body, as it is read
//! ([`Upload`]). What goes to the legacy client:
//! `https` origins with [`Versions::Negotiate`] (they may speak HTTP/2 through ALPN)
//! until one answers in HTTP/1.1 (see `Http1Origins`), and
//! requests that carry `Upgrade` (the handler tunnels WebSockets through
//! `hyper::upgrade::on`, which only hyper's connections provide).
//!
//! Names, connect timeout, TCP_NODELAY and keep-alive probes are those of
//! [`crate::upstream`]'s connector (the same `LocalResolver` rules); TLS is tokio-rustls with
//! the same trust store, ALPN `http/1.1` only, SNI = the host.
//!
//! The bytes on the wire (the request head, the response head and its framing rules, the
//! body decoder) are [`codec`]'s; the idle connections `idle`'s; the requests that go to
//! hyper-util's client `legacy`'s. This module does the connections and their I/O.

use std::future::{poll_fn, Future};
use std::io::{self, IoSlice, Write as _};
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{TRANSFER_ENCODING, UPGRADE};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tower_service::Service;

pub(crate) mod codec;
mod idle;
mod legacy;
#[doc(hidden)]
pub use codec::replay;
use idle::Idle;
pub(crate) use idle::IDLE_TIMEOUT;
pub(super) use legacy::Again;
use legacy::Http1Origins;
pub use legacy::Replay;

use codec::{
    declared_length, encode_head, parse_head, step, BodyKind, Chunk, Decode, Head, Out, Span, Step,
};

use super::body;
use super::failure::{self, UpstreamError};
use crate::descriptors::{IdleConnections, PipeSlot, Slot, Slots};
use crate::metrics::{FailKind, Plane};
use crate::upstream::{self, BoxError, HttpClient, LocalResolver, ProxyBody, Versions};

/// The first read of a connection; it doubles while reads fill it, up to [`MAX_READ`].
const FIRST_READ: usize = 8 * 1024;
/// A connection's write buffer (a request's head, then chunk-size lines), and the most
/// of it kept once written.
const WBUF_FIRST: usize = 1024;
const WBUF_KEPT: usize = 8 * 1024;
/// An answer's frames are slices of their read: a client that stops reading a download
/// (on the TLS listener, or a chunked answer; sized plain ones are spliced) pins the frame
/// it was handed and the read after it, and a fast upstream fills every read. At 256 KiB
/// that held about 0.55 MiB per stalled download; at 64 KiB about 0.15 MiB (the TLS and
/// write queues, 64 KiB each, are the rest), with the same throughput on TLS (bound by
/// the encryption) and within the noise on plain chunked answers.
const MAX_READ: usize = 64 * 1024;

/// A failed exchange, and whether sending it again on a fresh connection is safe.
struct Failed {
    error: UpstreamError,
    retry: bool,
}

// ---------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------

/// Where a response body that breaks after its head counts itself:
/// `abx_proxy_upstream_errors_total{plane, kind}`. By then the handler has answered with the
/// head and logged its status; only the body can tell that the upstream failed. `None` in
/// unit tests.
pub type BrokenBodies = Option<prometheus::IntCounterVec>;

/// The client behind `Proxy::api_client` and `Proxy::envd_client`.
pub struct Upstream {
    legacy: HttpClient,
    /// `https` origins may negotiate HTTP/2: they go to the legacy client, until one
    /// answers in HTTP/1.
    negotiate: bool,
    http1: Http1Origins,
    pool: Arc<Pool>,
}

impl Upstream {
    /// `upstream_timeout` is the `timeout` requests will pass to [`Upstream::request`]: the
    /// legacy client's HTTP/2 pings keep pace with it (see [`upstream::client`]). Host
    /// names are looked up through `resolver` (by both clients).
    pub fn new(
        tls: rustls::ClientConfig,
        versions: Versions,
        connect_timeout: Duration,
        upstream_timeout: Duration,
        broken: BrokenBodies,
        slots: Arc<Slots>,
        resolver: upstream::LocalResolver,
    ) -> Self {
        let mut h1 = tls.clone();
        h1.alpn_protocols = vec![b"http/1.1".to_vec()];
        // Over HTTP/1 only (envd), the legacy client carries nothing but upgrades, whose
        // connections it cannot reuse once switched: one refused (a 204, a 401) was kept
        // idle, out of reach of `Slots::close_idle`, 8 per origin (a sandbox and port the
        // client names), and 400 such requests took every upstream slot for 90 s.
        let max_idle = match versions {
            Versions::Negotiate => upstream::MAX_IDLE_HTTP1,
            Versions::Http1 => 0,
        };
        let legacy = upstream::counted_client(
            tls,
            versions,
            connect_timeout,
            upstream_timeout,
            slots.clone(),
            max_idle,
            resolver.clone(),
        );
        let pool = Arc::new(Pool {
            idle: (0..=crate::workers::count())
                .map(|_| {
                    Mutex::new(Idle {
                        origins: Vec::new(),
                        sweeping: false,
                    })
                })
                .collect(),
            tcp: upstream::connector(connect_timeout, resolver),
            connect_timeout,
            tls: TlsConnector::from(Arc::new(h1)),
            broken,
            slots,
        });
        pool.slots
            .register(Arc::downgrade(&pool) as Weak<dyn IdleConnections>);
        Upstream {
            legacy,
            negotiate: versions == Versions::Negotiate,
            http1: Http1Origins::default(),
            pool,
        }
    }

    /// Sends `req` (absolute URI) and returns the response head with its streaming body,
    /// or [`UpstreamError::Timeout`] when the head has not come within `timeout`. A body
    /// that breaks later is counted under `plane`.
    ///
    /// Boxed here, once: the exchange's state is a kilobyte, and every future awaiting it
    /// would otherwise carry (and move) a copy of it.
    pub fn request(
        &self,
        plane: Plane,
        req: Request<ProxyBody>,
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, UpstreamError>> + Send + '_>> {
        let tls = match req.uri().scheme_str() {
            Some("http") => false,
            Some("https") if !self.negotiate || self.http1.has(req.uri(), Instant::now()) => true,
            _ => return Box::pin(self.legacy(plane, req, timeout)),
        };
        if req.headers().contains_key(UPGRADE) {
            return Box::pin(self.legacy(plane, req, timeout));
        }
        let (parts, body) = req.into_parts();
        Box::pin(self.pool.send(plane, parts, body, tls, timeout))
    }
}

/// Who a connection talks to. The host is as the URI spells it (brackets for IPv6).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Origin {
    tls: bool,
    port: u16,
    host: Box<str>,
}

impl Origin {
    fn is(&self, tls: bool, host: &str, port: u16) -> bool {
        self.tls == tls && self.port == port && *self.host == *host
    }
}

struct Pool {
    /// Idle lists, one per worker thread and one for every other thread (see
    /// [`crate::workers::index`]): a connection is registered with the runtime of the
    /// thread that opened it, so it is only ever used from there.
    idle: Box<[Mutex<Idle>]>,
    tcp: HttpConnector<LocalResolver>,
    /// For the whole set-up (resolve, TCP, TLS): `tcp`'s own covers only the TCP connect.
    connect_timeout: Duration,
    tls: TlsConnector,
    broken: BrokenBodies,
    /// Shared with the other plane's pool and both legacy clients.
    slots: Arc<Slots>,
}

impl Pool {
    #[cold]
    fn count_broken(&self, plane: Plane, kind: FailKind) {
        if let Some(counter) = &self.broken {
            counter
                .with_label_values(&[plane.label(), kind.label()])
                .inc();
        }
    }

    async fn connect(
        &self,
        uri: &http::Uri,
        tls: bool,
        host: &str,
        port: u16,
        deadline: Instant,
    ) -> Result<Conn, UpstreamError> {
        let slot = self.slots.take(self.connect_timeout).await;
        let slot = slot.map_err(|e| UpstreamError::Connect(e.into()))?;
        let looking = upstream::LookingUp::default();
        let open = looking.watch(self.open(uri, tls, host));
        let io = tokio::time::timeout(self.connect_timeout, open).await;
        let io =
            io.map_err(|_| UpstreamError::Connect(upstream::connect_timed_out(looking.now())))??;
        Ok(Conn {
            io,
            _slot: slot,
            rbuf: BytesMut::with_capacity(FIRST_READ),
            wbuf: Vec::with_capacity(WBUF_FIRST),
            spans: Vec::new(),
            read_size: FIRST_READ,
            origin: Origin {
                tls,
                port,
                host: host.into(),
            },
            idle_since: Duration::ZERO,
            deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
        })
    }

    /// Resolves, connects and, for `https`, shakes hands.
    async fn open(&self, uri: &http::Uri, tls: bool, host: &str) -> Result<Io, UpstreamError> {
        let mut tcp = self.tcp.clone();
        poll_fn(|cx| tcp.poll_ready(cx))
            .await
            .map_err(|e| UpstreamError::Connect(e.into()))?;
        let stream = tcp
            .call(uri.clone())
            .await
            .map_err(|e| UpstreamError::Connect(e.into()))?
            .into_inner();
        if let (Ok(peer), Ok(local)) = (stream.peer_addr(), stream.local_addr()) {
            upstream::not_own_listener(peer, local).map_err(UpstreamError::Connect)?;
        }
        if !tls {
            return Ok(Io::Plain(stream));
        }
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(name)
            .map_err(|_| UpstreamError::Connect("invalid server name".into()))?
            .to_owned();
        let stream = self
            .tls
            .connect(name, stream)
            .await
            .map_err(UpstreamError::Tls)?;
        Ok(Io::Tls(Box::new(stream)))
    }

    /// Not an `async fn`: that keeps its arguments twice in the future (as passed and as
    /// moved into the body), and [`Upstream::request`] boxes it per request.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn send(
        self: &Arc<Self>,
        plane: Plane,
        parts: Parts,
        mut body: ProxyBody,
        tls: bool,
        timeout: Duration,
    ) -> impl Future<Output = Result<Response<ProxyBody>, UpstreamError>> + Send + '_ {
        async move {
            let deadline = Instant::now() + timeout;
            let Some(authority) = parts.uri.authority() else {
                return Err(UpstreamError::Protocol("request URI without authority"));
            };
            let (host, port, host_header) = authority_parts(authority.as_str(), tls);
            let mut retried = false;
            loop {
                let pooled = if retried {
                    None
                } else {
                    self.checkout(tls, host, port)
                };
                let reused = pooled.is_some();
                let mut conn = match pooled {
                    Some(conn) => conn,
                    None => {
                        let connect = Box::pin(self.connect(&parts.uri, tls, host, port, deadline));
                        match tokio::time::timeout_at(deadline.into(), connect).await {
                            Ok(conn) => conn?,
                            Err(_) => return Err(UpstreamError::Timeout),
                        }
                    }
                };
                let wait = Wait { deadline, timeout };
                match exchange(&mut conn, &parts, host_header, &mut body, wait).await {
                    Ok((head, sent)) => return Ok(self.response(plane, conn, head, sent)),
                    // The keep-alive race: the server closed the connection as we reused it,
                    // and the request is one that may go again (see `Exchange::fail`): once,
                    // on a new connection.
                    Err(f) if f.retry && reused && !retried => retried = true,
                    Err(f) => return Err(f.error),
                }
            }
        }
    }

    fn response(
        self: &Arc<Self>,
        plane: Plane,
        mut conn: Conn,
        head: Head,
        sent: Sent,
    ) -> Response<ProxyBody> {
        // An answer before the whole request went up. A 2xx one (a stream answering as it
        // reads, as an echo does) gets the rest alongside its body, as curl and hyper's
        // client do; any other (a 413, a 401) ends the upload, as in curl and RFC 9110
        // §15.5 ("the client SHOULD stop sending"). Either way the connection is not used
        // again, as nginx's is not: whether the server read the rest or left it to be read
        // as its next request is unknowable, and an upstream that answered early and
        // skipped the body gave the next client of the connection the answer to a request
        // hidden in this one's body. (An answer complete with its head has nothing to
        // carry the upload on: it ends there.)
        let reusable = sent.rest.is_none() && head.keep_alive && sent.keep;
        let upload = sent.rest.filter(|_| head.status.is_success());
        #[cfg(target_os = "linux")]
        let mut offer = None;
        let body = match head.body {
            BodyKind::None => {
                self.release(conn, reusable);
                body::empty()
            }
            BodyKind::Length(0) => {
                self.release(conn, reusable);
                body::empty()
            }
            // The whole body came with the head: no state to keep.
            BodyKind::Length(n) if conn.rbuf.len() as u64 >= n => {
                let bytes = conn.rbuf.split_to(n as usize).freeze();
                self.release(conn, reusable);
                body::full(bytes)
            }
            kind => {
                let state = match kind {
                    BodyKind::Length(n) => Decode::Length(n),
                    BodyKind::Chunked => Decode::Chunk(Chunk::Size),
                    _ => Decode::Eof,
                };
                let body = PoolBody {
                    conn: Some(conn),
                    pool: self.clone(),
                    plane,
                    state,
                    reusable: reusable && !matches!(kind, BodyKind::Eof),
                    pending: None,
                    upload,
                };
                #[cfg(target_os = "linux")]
                let body = {
                    let (splice, body) = Splice::offer(body);
                    offer = splice;
                    body
                };
                #[cfg(not(target_os = "linux"))]
                let body = body::boxed(body);
                body
            }
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = head.status;
        *resp.version_mut() = head.version;
        *resp.headers_mut() = head.headers;
        #[cfg(target_os = "linux")]
        if let Some(offer) = offer {
            resp.extensions_mut().insert(offer);
        }
        resp
    }

    /// Back to the idle list when the exchange left the connection clean.
    fn release(self: &Arc<Self>, conn: Conn, reusable: bool) {
        if reusable && conn.rbuf.is_empty() {
            self.put(conn);
        }
    }
}

// ---------------------------------------------------------------------------------------
// A connection
// ---------------------------------------------------------------------------------------

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

struct Conn {
    io: Io,
    /// Bytes read and not yet handed out; empty whenever the connection is idle.
    rbuf: BytesMut,
    /// The request head, then chunk-size lines; reused across requests, unless it grew past
    /// [`WBUF_KEPT`] (see `Outgoing::advance`).
    wbuf: Vec<u8>,
    /// Scratch for the head parser; reused across requests.
    spans: Vec<Span>,
    read_size: usize,
    origin: Origin,
    /// When it last went idle, in [`crate::clock::since_boot`]: its idle age counts the
    /// machine's sleeps (a connection dropped by the upstream during a night's sleep was
    /// reused on waking, and the request on it reset).
    idle_since: Duration,
    /// `--upstream-timeout` for the response head of the exchange under way. One timer for
    /// the connection's life, moved forward per exchange: a later deadline is one atomic
    /// store in tokio's timer, where a new timer per request is a wheel insert and removal.
    deadline: Pin<Box<tokio::time::Sleep>>,
    _slot: Slot,
}

impl Conn {
    /// Whether an idle connection is still open: the peer has neither closed it nor sent
    /// anything (an idle HTTP/1.1 server has nothing to say). Never waits.
    fn looks_open(&mut self) -> bool {
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        let read = pin!(self.io.read_buf(&mut self.rbuf));
        read.poll(&mut cx).is_pending()
    }

    /// One read into `rbuf`, of at least `want` bytes of room (bounded by the read size).
    fn poll_fill(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        let want = want.clamp(1, self.read_size);
        if self.rbuf.capacity() - self.rbuf.len() < want {
            self.rbuf.reserve(want);
        }
        let room = self.rbuf.capacity() - self.rbuf.len();
        // At most `want`: reserve may have doubled the buffer, and a read that outgrows the
        // cache makes the copy back out to the client a trip to memory.
        let n = ready!(pin!(self.io.read_buf(&mut (&mut self.rbuf).limit(want))).poll(cx))?;
        if n >= room.min(self.read_size) && self.read_size < MAX_READ {
            self.read_size = (self.read_size * 2).min(MAX_READ);
        }
        Poll::Ready(Ok(n))
    }
}

// ---------------------------------------------------------------------------------------
// One exchange: the request out, the response head in
// ---------------------------------------------------------------------------------------

/// When the upstream timeout has run out: the later deadline an upload still moving holds
/// it off to (`timeout` after its last bytes went up), or `None`: time is up.
fn held_off(body_moved: Option<Instant>, timeout: Duration) -> Option<Instant> {
    body_moved
        .map(|t| t + timeout)
        .filter(|later| *later > Instant::now())
}

/// `--upstream-timeout` for one exchange: the response head is due by `deadline`, or
/// within `timeout` of the request body's last bytes, whichever is later.
#[derive(Clone, Copy)]
struct Wait {
    deadline: Instant,
    timeout: Duration,
}

/// How much of the request went up by the time its answer's head came.
struct Sent {
    /// The request lets its connection carry another (no `Connection: close`, no failed
    /// write), once all of it is sent.
    keep: bool,
    /// The rest of the request, when its head came first; `None`: all of it went, or no
    /// more can (a write failed).
    rest: Option<Box<Upload>>,
}

/// The request on `conn`; the response head, and how much of the request went up.
async fn exchange(
    conn: &mut Conn,
    parts: &Parts,
    host_header: &str,
    body: &mut ProxyBody,
    wait: Wait,
) -> Result<(Head, Sent), Failed> {
    conn.deadline.as_mut().reset(wait.deadline.into());
    let (out, length) = if body.is_end_stream() {
        let expects_body = matches!(parts.method, Method::POST | Method::PUT | Method::PATCH);
        (None, expects_body.then_some(0))
    } else if parts.headers.contains_key(TRANSFER_ENCODING) {
        (Some(Out::Chunked), None)
    } else {
        match declared_length(&parts.headers).or_else(|| body.size_hint().exact()) {
            Some(n) => (Some(Out::Length(n)), Some(n)),
            None => (Some(Out::Chunked), None),
        }
    };
    let close = encode_head(&mut conn.wbuf, parts, host_header, out, length);
    let mut ex = Exchange {
        out: Outgoing {
            body_done: matches!(out, None | Some(Out::Length(0))),
            out: out.unwrap_or(Out::Length(0)),
            wpos: 0,
            data: Bytes::new(),
            post: b"",
            touched: false,
            wrote: false,
            body_moved: None,
            awaiting_client: false,
        },
        conn,
        body,
        head_request: parts.method == Method::HEAD,
        idempotent: is_idempotent(&parts.method),
        sent: false,
        write_error: None,
        got_bytes: false,
        timeout: wait.timeout,
    };
    let head = poll_fn(|cx| ex.poll(cx)).await?;
    let sent = match (ex.sent, ex.write_error.is_some()) {
        (_, true) => Sent {
            keep: false,
            rest: None,
        },
        (true, false) => Sent {
            keep: !close,
            rest: None,
        },
        (false, false) => Sent {
            keep: !close,
            rest: Some(Box::new(Upload {
                body: std::mem::replace(ex.body, body::empty()),
                out: ex.out,
            })),
        },
    };
    Ok((head, sent))
}

/// The idempotent methods of RFC 9110 §9.2.2, spelled out: `Method::is_idempotent` follows
/// the http crate's version (1.5 added QUERY), and what may be sent twice should not change
/// with a dependency bump.
fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// The host, the port (explicit or the scheme's default) and the `Host` value of an
/// authority, in one pass: `http`'s accessors scan the string again on every call. The
/// `Host` value is what hyper-util's client writes: the host, and `:port` only when the
/// port is not the scheme's default.
fn authority_parts(authority: &str, tls: bool) -> (&str, u16, &str) {
    // Authorities are short: a plain scan beats memchr's set-up.
    let start = authority
        .as_bytes()
        .iter()
        .rposition(|c| *c == b'@')
        .map_or(0, |at| at + 1);
    let host_port = &authority[start..];
    let b = host_port.as_bytes();
    // The port is the digits after the last colon; an IPv6 literal ends in `]`.
    let digits = b.iter().rev().take_while(|c| c.is_ascii_digit()).count();
    let colon = b.len() - digits;
    let (host, port) = if colon > 0 && b[colon - 1] == b':' {
        let port = b[colon..].iter().try_fold(0u16, |n, d| {
            n.checked_mul(10)?.checked_add(u16::from(d - b'0'))
        });
        let port = port.filter(|_| digits > 0);
        (&host_port[..colon - 1], port)
    } else {
        (host_port, None)
    };
    let default = if tls { 443 } else { 80 };
    match port {
        Some(p) if p != default => (host, p, host_port),
        _ => (host, default, host),
    }
}

enum SendError {
    Io(io::Error),
    Body(BoxError),
}

struct Exchange<'a> {
    conn: &'a mut Conn,
    body: &'a mut ProxyBody,
    out: Outgoing,
    head_request: bool,
    /// GET, HEAD, OPTIONS, TRACE, PUT or DELETE (RFC 9110 §9.2.2).
    idempotent: bool,
    /// Everything was written and flushed.
    sent: bool,
    write_error: Option<io::Error>,
    /// Something of the response arrived.
    got_bytes: bool,
    /// `--upstream-timeout`: an upload still moving holds the deadline off (a 1 GiB file
    /// over a slow link takes longer than the timeout, and envd answers only once it has
    /// all of it).
    timeout: Duration,
}

impl Exchange<'_> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Head, Failed>> {
        loop {
            if !self.sent && self.write_error.is_none() {
                match self.out.poll_send(self.conn, self.body, cx) {
                    Poll::Ready(Ok(())) => self.sent = true,
                    // Keep reading: the server may have answered before it stopped reading
                    // (a 413 to a large upload), and that answer is the one to pass on.
                    Poll::Ready(Err(SendError::Io(e))) => self.write_error = Some(e),
                    Poll::Ready(Err(SendError::Body(e))) => {
                        return Poll::Ready(Err(self.fail(UpstreamError::ClientBody(e))))
                    }
                    Poll::Pending => {}
                }
            }
            match parse_head(&mut self.conn.rbuf, &mut self.conn.spans, self.head_request) {
                Ok(Some(head)) => return Poll::Ready(Ok(head)),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Err(self.fail(e))),
            }
            match self.conn.poll_fill(cx, FIRST_READ) {
                Poll::Ready(Ok(0)) => {
                    let e = match self.write_error.take() {
                        Some(e) => UpstreamError::Io(e),
                        None => UpstreamError::Closed,
                    };
                    return Poll::Ready(Err(self.fail(e)));
                }
                Poll::Ready(Ok(_)) => self.got_bytes = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(self.fail(UpstreamError::Io(e)))),
                Poll::Pending => {
                    if self.conn.deadline.as_mut().poll(cx).is_ready() {
                        match held_off(self.out.body_moved, self.timeout) {
                            Some(later) => {
                                self.conn.deadline.as_mut().reset(later.into());
                                continue;
                            }
                            None => {
                                let e = match self.out.awaiting_client {
                                    true => UpstreamError::BodyStalled,
                                    false => UpstreamError::Timeout,
                                };
                                return Poll::Ready(Err(self.fail(e)));
                            }
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn fail(&self, error: UpstreamError) -> Failed {
        // A request the server read whole may have been carried out before the connection
        // closed (a POST /sandboxes/{id}/pause, a create): sending it again could do it
        // twice. So it goes again only when the server cannot have seen it (none of it
        // was written: hyper-util's legacy client retries only that case), or when doing
        // it twice is no different from once (an idempotent method). Either way the body
        // must not have been polled, as what was taken from it is gone.
        let resendable = !self.out.wrote || self.idempotent;
        let retry = !self.got_bytes
            && !self.out.touched
            && resendable
            && matches!(error, UpstreamError::Io(_) | UpstreamError::Closed);
        Failed { error, retry }
    }
}

/// The request on its way out: the head (in `conn.wbuf`), then the body, framed. Owned
/// apart from the exchange so that what is left of it when the answer comes first can go
/// on with the answer's body ([`Upload`]).
struct Outgoing {
    out: Out,
    /// Written part of `conn.wbuf`.
    wpos: usize,
    /// The body chunk being written, after `wbuf` and before `post`.
    data: Bytes,
    post: &'static [u8],
    /// The body has given (or framed) all it will.
    body_done: bool,
    /// The body was polled: it cannot be sent again.
    touched: bool,
    /// The socket took some of the request: the server may have acted on it.
    wrote: bool,
    /// When request body bytes last went out (see [`held_off`]).
    body_moved: Option<Instant>,
    /// The last poll stopped for want of the client's next bytes, not for the upstream
    /// taking them.
    awaiting_client: bool,
}

impl Outgoing {
    /// Writes the head and the body; `Ready(Ok)` once all of it is written and flushed.
    ///
    /// Inlined by hand: called from two places ([`Upload`] too), it was otherwise left a
    /// call of its own, and a pooled GET took about 90 instructions more (callgrind, in a
    /// 22 400 a request).
    #[inline(always)]
    fn poll_send(
        &mut self,
        conn: &mut Conn,
        body: &mut ProxyBody,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), SendError>> {
        self.awaiting_client = false;
        loop {
            // Take the next frame only when the previous one is out, so chunk-size lines
            // appended to `wbuf` stay in order. The first frame joins the head when the
            // body has it ready: one write for both.
            if !self.body_done && self.data.is_empty() && self.post.is_empty() {
                match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        self.touched = true;
                        if let Ok(data) = frame.into_data() {
                            let last = body.is_end_stream();
                            self.queue(&mut conn.wbuf, data, last)?;
                        }
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        self.touched = true;
                        return Poll::Ready(Err(SendError::Body(e)));
                    }
                    Poll::Ready(None) => {
                        self.touched = true;
                        self.end_body(&mut conn.wbuf)?;
                        continue;
                    }
                    Poll::Pending if self.wpos == conn.wbuf.len() => {
                        // Waiting on the client: what was written must reach the upstream.
                        ready!(Pin::new(&mut conn.io).poll_flush(cx)).map_err(SendError::Io)?;
                        self.awaiting_client = true;
                        return Poll::Pending;
                    }
                    Poll::Pending => {}
                }
            }
            if self.wpos < conn.wbuf.len() || !self.data.is_empty() || !self.post.is_empty() {
                let n = {
                    let bufs = [
                        IoSlice::new(&conn.wbuf[self.wpos..]),
                        IoSlice::new(&self.data),
                        IoSlice::new(self.post),
                    ];
                    ready!(Pin::new(&mut conn.io).poll_write_vectored(cx, &bufs))
                        .map_err(SendError::Io)?
                };
                if n == 0 {
                    return Poll::Ready(Err(SendError::Io(io::ErrorKind::WriteZero.into())));
                }
                self.wrote = true;
                if self.touched {
                    self.body_moved = Some(Instant::now());
                }
                self.advance(&mut conn.wbuf, n);
                continue;
            }
            if self.body_done {
                ready!(Pin::new(&mut conn.io).poll_flush(cx)).map_err(SendError::Io)?;
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// `data` to go out next; `last`: the body said it has nothing after it.
    fn queue(&mut self, wbuf: &mut Vec<u8>, data: Bytes, last: bool) -> Result<(), SendError> {
        if data.is_empty() {
            return Ok(());
        }
        match &mut self.out {
            Out::Length(left) => {
                let n = data.len() as u64;
                if n > *left {
                    return Err(SendError::Body(
                        "the request body is longer than its length".into(),
                    ));
                }
                *left -= n;
                // A body that announced its length is complete at that length.
                self.body_done = *left == 0;
            }
            Out::Chunked => {
                let _ = write!(wbuf, "{:x}\r\n", data.len());
                self.post = if last {
                    self.body_done = true;
                    b"\r\n0\r\n\r\n"
                } else {
                    b"\r\n"
                };
            }
        }
        self.data = data;
        Ok(())
    }

    fn end_body(&mut self, wbuf: &mut Vec<u8>) -> Result<(), SendError> {
        self.body_done = true;
        match self.out {
            Out::Length(0) => Ok(()),
            Out::Length(_) => Err(SendError::Body(
                "the request body is shorter than its length".into(),
            )),
            Out::Chunked => {
                wbuf.extend_from_slice(b"0\r\n\r\n");
                Ok(())
            }
        }
    }

    fn advance(&mut self, wbuf: &mut Vec<u8>, mut n: usize) {
        let pre = wbuf.len() - self.wpos;
        if n < pre {
            self.wpos += n;
            return;
        }
        n -= pre;
        wbuf.clear();
        // A large head's buffer goes once it is out (an SDK's is under 1 KiB): kept, it
        // held 60 KiB through each answer's wait (HPACK-indexed heads cost a client ~130
        // bytes each) and then for as long as the connection stayed idle in the pool.
        if wbuf.capacity() > WBUF_KEPT {
            *wbuf = Vec::with_capacity(WBUF_FIRST);
        }
        self.wpos = 0;
        let d = n.min(self.data.len());
        if d == self.data.len() {
            // Let the chunk's memory go now, not at the next frame.
            self.data = Bytes::new();
        } else {
            self.data.advance(d);
        }
        n -= d;
        self.post = &self.post[n.min(self.post.len())..];
    }
}

/// What is left of a request whose answer began before all of it went up, sent on by the
/// answer's body as it is read (see [`Pool::response`]).
struct Upload {
    body: ProxyBody,
    out: Outgoing,
}

impl Upload {
    fn poll(&mut self, conn: &mut Conn, cx: &mut Context<'_>) -> Poll<Result<(), SendError>> {
        self.out.poll_send(conn, &mut self.body, cx)
    }
}

// ---------------------------------------------------------------------------------------
// The response body
// ---------------------------------------------------------------------------------------

/// Something the look-ahead found, for the next poll.
enum Deferred {
    Trailers(HeaderMap),
    Error(UpstreamError),
}

/// A response body read from its connection; the connection goes back to the pool at the
/// body's end, and closes if the body is dropped before it.
struct PoolBody {
    /// `None` once the body ended or failed.
    conn: Option<Conn>,
    pool: Arc<Pool>,
    /// Where a failure of this body is counted.
    plane: Plane,
    state: Decode,
    reusable: bool,
    pending: Option<Deferred>,
    /// The rest of the request, when a 2xx answer came before all of it went up: sent on
    /// as this body is polled. It moves only while the answer is read: a client that
    /// stops reading the answer until its upload is done, from an upstream that stops
    /// reading until its answer is taken, stalls both (hyper's client would go on sending
    /// from its connection task). When the answer ends first, what is left is dropped
    /// with the connection.
    upload: Option<Box<Upload>>,
}

impl PoolBody {
    fn release(&mut self) {
        self.state = Decode::Done;
        // An upload still going ends here (`reusable` is false wherever there was one).
        self.upload = None;
        if let Some(conn) = self.conn.take() {
            self.pool.release(conn, self.reusable);
        }
    }

    fn fail(&mut self, e: UpstreamError) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        self.pool.count_broken(self.plane, e.kind());
        self.end(e)
    }

    fn end(&mut self, e: UpstreamError) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        self.conn = None;
        self.upload = None;
        self.state = Decode::Done;
        Poll::Ready(Some(Err(e)))
    }

    /// Sends on what the upload has ready; `Some` when the client's body broke, which ends
    /// the answer too: the upstream will wait for the rest in vain.
    fn poll_upload(&mut self, cx: &mut Context<'_>) -> Option<UpstreamError> {
        let (Some(upload), Some(conn)) = (self.upload.as_mut(), self.conn.as_mut()) else {
            return None;
        };
        match upload.poll(conn, cx) {
            Poll::Ready(Ok(())) => self.upload = None,
            // The upstream stopped reading (it closed, or reset): its answer may still come
            // whole, and the connection ends with it.
            Poll::Ready(Err(SendError::Io(_))) => {
                self.upload = None;
                self.reusable = false;
            }
            Poll::Ready(Err(SendError::Body(e))) => return Some(UpstreamError::ClientBody(e)),
            Poll::Pending => {}
        }
        None
    }
}

impl Body for PoolBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        match this.pending.take() {
            Some(Deferred::Trailers(t)) => return Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Some(Deferred::Error(e)) => return this.fail(e),
            None => {}
        }
        if let Some(e) = this.poll_upload(cx) {
            // The client's doing, not the upstream's: not counted as a broken answer.
            return this.end(e);
        }
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match step(&mut this.state, &mut conn.rbuf, true) {
                Ok(Step::Data(bytes)) => {
                    // When the end is already buffered, give the connection back now: a
                    // consumer that stops at `is_end_stream` never polls again.
                    match step(&mut this.state, &mut conn.rbuf, false) {
                        Ok(Step::End) => this.release(),
                        Ok(Step::Trailers(t)) => {
                            this.pending = Some(Deferred::Trailers(t));
                            this.release();
                        }
                        Ok(_) => {}
                        Err(e) => this.pending = Some(Deferred::Error(e)),
                    }
                    return Poll::Ready(Some(Ok(Frame::data(bytes))));
                }
                Ok(Step::Trailers(t)) => {
                    this.release();
                    return Poll::Ready(Some(Ok(Frame::trailers(t))));
                }
                Ok(Step::End) => {
                    this.release();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
                Err(e) => return this.fail(e),
            }
            let want = match this.state {
                Decode::Length(left) | Decode::Chunk(Chunk::Data(left)) => {
                    usize::try_from(left).unwrap_or(usize::MAX)
                }
                _ => MAX_READ,
            };
            match ready!(conn.poll_fill(cx, want)) {
                Ok(0) if this.state == Decode::Eof => {
                    // The end of a close-delimited body; the connection is done with.
                    this.conn = None;
                    this.state = Decode::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => return this.fail(UpstreamError::Closed),
                Ok(_) => {}
                Err(e) => return this.fail(UpstreamError::Io(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_none() && self.state == Decode::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            Decode::Length(n) => SizeHint::with_exact(n),
            Decode::Done if self.pending.is_none() => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Splicing a large body
// ---------------------------------------------------------------------------------------

/// A large sized body on a plain TCP upstream connection, offered (as a response extension)
/// to whoever writes the response: one writing to a plain TCP client can move the rest with
/// `splice(2)` instead of reading it (see [`super::splice::Offer`]).
///
/// A splice's pipe holds two descriptors for as long as it lasts: it takes one of the
/// places [`Slots`] keeps for pipes (see `descriptors::Budget::pipes`), else downloads'
/// pipes took the reserve the probes and the token exchange need (28 at an open-file
/// limit of 128 left the admin listener's accepts failing).
#[cfg(target_os = "linux")]
#[derive(Clone)]
pub struct Splice(super::splice::Offer<PoolBody>, Arc<Slots>);

#[cfg(target_os = "linux")]
impl Splice {
    /// The response body for `body`, and an offer when it qualifies: sized, large, on
    /// plain TCP.
    fn offer(body: PoolBody) -> (Option<Splice>, ProxyBody) {
        let plain = matches!(
            body.conn,
            Some(Conn {
                io: Io::Plain(_),
                ..
            })
        );
        match body.state {
            // Splicing moves the answer only: an upload still going needs the body polled.
            Decode::Length(n) if plain && body.upload.is_none() && n >= super::splice::MIN => {
                let slots = body.pool.slots.clone();
                let (offer, body) = super::splice::Offer::new(body);
                (Some(Splice(offer, slots)), body::boxed(body))
            }
            _ => (None, body::boxed(body)),
        }
    }

    /// The body and a pipe to splice it through, if nothing has read from it yet and `len`
    /// bytes of it are left. Taken before the body: without a pipe, or a place for one,
    /// the answer is copied as usual rather than cut after its head.
    pub fn take(&self, len: u64) -> Option<(SpliceSource, super::splice::Pipe)> {
        let slots = self.1.try_take_pipe()?;
        let pipe = super::splice::Pipe::new().ok()?;
        let fits = |b: &PoolBody| matches!(b.state, Decode::Length(n) if n == len);
        let body = self.0.take_if(fits)?;
        Some((SpliceSource { body, _pipe: slots }, pipe))
    }
}

/// A taken [`Splice`]: the rest of a sized body and the connection it comes on.
#[cfg(target_os = "linux")]
pub struct SpliceSource {
    body: PoolBody,
    /// The pipe's place, held until the splice ends.
    _pipe: PipeSlot,
}

#[cfg(target_os = "linux")]
impl SpliceSource {
    /// The bytes of the body that arrived with the head: they go out first.
    pub fn buffered(&mut self) -> Bytes {
        let (Decode::Length(left), Some(conn)) = (self.body.state, self.body.conn.as_mut()) else {
            return Bytes::new();
        };
        let n = conn
            .rbuf
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        self.body.state = Decode::Length(left - n as u64);
        conn.rbuf.split_to(n).freeze()
    }

    /// Splices the rest of the body (after [`SpliceSource::buffered`]) to `to`; the
    /// upstream connection goes back to its pool when all of it went and it is clean.
    pub async fn splice_to(
        mut self,
        pipe: super::splice::Pipe,
        to: &TcpStream,
        progress: impl FnMut(),
        mut source_failed: impl FnMut(),
    ) -> Result<(), super::splice::Broken> {
        let left = match self.body.state {
            Decode::Length(n) => n,
            _ => 0,
        };
        let Some(Conn {
            io: Io::Plain(from),
            rbuf,
            ..
        }) = self.body.conn.as_ref()
        else {
            return Err(super::splice::Broken::Source(
                io::ErrorKind::InvalidInput.into(),
            ));
        };
        if !rbuf.is_empty() && left > 0 {
            // `buffered` first: those bytes come before the socket's.
            return Err(super::splice::Broken::Source(
                io::ErrorKind::InvalidInput.into(),
            ));
        }
        // Counted as it happens: what the pipe still holds goes to the client first, who may
        // never take it.
        let (pool, plane) = (&self.body.pool, self.body.plane);
        let failed = |e: &io::Error| {
            pool.count_broken(plane, failure::io_kind(e.kind()));
            source_failed();
        };
        let copied = super::splice::copy(pipe, from, to, left, progress, failed).await;
        if copied.is_ok() {
            self.body.release();
        }
        copied
    }
}

#[cfg(test)]
mod tests;
