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
//! body decoder) are [`codec`]'s; this module does the connections, the pool and the I/O.

use std::future::{poll_fn, Future};
use std::io::{self, IoSlice, Write as _};
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{TRANSFER_ENCODING, UPGRADE};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::{capture_connection, HttpConnector};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tower_service::Service;

pub(crate) mod codec;
#[doc(hidden)]
pub use codec::replay;

use codec::{
    admit, declared_length, encode_head, parse_head, step, BodyKind, Chunk, Decode, Head, Out,
    Span, Step,
};

use super::body;
use super::forward::{self, FailKind};
use crate::descriptors::{IdleConnections, NoSlot, PipeSlot, Slot, Slots};
use crate::metrics::Plane;
use crate::upstream::{self, BoxError, HttpClient, LocalResolver, ProxyBody, Versions};

/// The first read of a connection; it doubles while reads fill it, up to [`MAX_READ`].
const FIRST_READ: usize = 8 * 1024;
/// An answer's frames are slices of their read: a client that stops reading a download
/// (on the TLS listener, or a chunked answer; sized plain ones are spliced) pins the frame
/// it was handed and the read after it, and a fast upstream fills every read. At 256 KiB
/// that held about 0.55 MiB per stalled download; at 64 KiB about 0.15 MiB (the TLS and
/// write queues, 64 KiB each, are the rest), with the same throughput on TLS (bound by
/// the encryption) and within the noise on plain chunked answers.
const MAX_READ: usize = 64 * 1024;
const MAX_IDLE_PER_ORIGIN: usize = 256;
/// How long an idle upstream connection is kept; hyper-util's pool, beside this one, keeps
/// its own as long (`crate::upstream`).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a worker with idle connections drops those expired or closed by the upstream
/// (see [`sweep`]).
const SWEEP_EVERY: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// Why an upstream exchange failed. Nothing here carries a header value: no secret can
/// reach a message or `Debug` output.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// From hyper-util's client (HTTP/2 origins, upgrades).
    #[error(transparent)]
    Legacy(#[from] hyper_util::client::legacy::Error),
    /// The client's own request body failed: not the upstream's fault.
    #[error("the request body could not be read")]
    ClientBody(#[source] BoxError),
    /// Name resolution or TCP connect (a connect timeout included).
    #[error("connect failed")]
    Connect(#[source] BoxError),
    #[error("tls handshake failed")]
    Tls(#[source] io::Error),
    #[error("upstream connection failed")]
    Io(#[source] io::Error),
    /// The upstream closed the connection before the message was complete.
    #[error("connection closed early")]
    Closed,
    #[error("invalid response: {0}")]
    Protocol(&'static str),
    /// No response head within `--upstream-timeout`.
    #[error("timed out")]
    Timeout,
    /// hyper's HTTP/2 keep-alive found the connection dead before the head came (see
    /// [`forward::timed_out`]).
    #[error("keep-alive ping unanswered")]
    PingUnanswered,
    /// No response head within `--upstream-timeout`, the client's body having stopped
    /// before its end: the upstream waits for the rest, so the fault is the client's.
    #[error("the request body stalled")]
    BodyStalled,
    /// No response head within `--upstream-timeout`, and the request's body never taken
    /// (over HTTP/2, a request waiting for a stream the upstream had no room for): the
    /// upstream holds no whole request, and never will (see [`body::Moved::give_up`]).
    #[error("timed out")]
    Unsent,
}

impl UpstreamError {
    /// The client's request body broke; forward answers 400 instead of blaming upstream.
    pub fn is_client_body(&self) -> bool {
        match self {
            UpstreamError::ClientBody(_) => true,
            UpstreamError::Legacy(e) => forward::client_body_failed(e),
            _ => false,
        }
    }

    /// Every upstream connection slot was in use ([`NoSlot`]): the proxy's own saturation.
    pub fn is_no_slot(&self) -> bool {
        let inner: &(dyn std::error::Error + 'static) = match self {
            UpstreamError::Connect(e) => e.as_ref(),
            UpstreamError::Legacy(e) if e.is_connect() => e,
            _ => return false,
        };
        forward::chain(inner).any(|e| e.is::<NoSlot>())
    }

    /// Whether the upstream may have received the request: false only when the connection
    /// failed to be set up (resolve, connect, TLS handshake). A timeout counts as received,
    /// as the pool's deadline covers the connect and the exchange alike.
    pub fn reached_upstream(&self) -> bool {
        match self {
            UpstreamError::Legacy(e) => !e.is_connect() && !forward::refused(e),
            UpstreamError::Connect(_) | UpstreamError::Tls(_) | UpstreamError::Unsent => false,
            UpstreamError::ClientBody(_)
            | UpstreamError::Io(_)
            | UpstreamError::Closed
            | UpstreamError::Protocol(_)
            | UpstreamError::Timeout
            | UpstreamError::PingUnanswered
            | UpstreamError::BodyStalled => true,
        }
    }

    /// The `abx_proxy_upstream_errors_total{kind}` label.
    pub fn kind(&self) -> FailKind {
        match self {
            UpstreamError::Legacy(e) => forward::classify(e),
            UpstreamError::Connect(e) => forward::connect_kind(forward::find_io(e.as_ref())),
            // A handshake cut short is a failure to connect (a reset: the peer's doing), as
            // the legacy client counts it.
            UpstreamError::Tls(e) if forward::find_rustls(e).is_none() => {
                forward::connect_kind(forward::find_io(e))
            }
            UpstreamError::Tls(_) => FailKind::Tls,
            UpstreamError::Io(e) => forward::io_kind(e.kind()),
            UpstreamError::Closed => FailKind::Reset,
            UpstreamError::Timeout | UpstreamError::Unsent | UpstreamError::PingUnanswered => {
                FailKind::Timeout
            }
            UpstreamError::ClientBody(_)
            | UpstreamError::BodyStalled
            | UpstreamError::Protocol(_) => FailKind::Protocol,
        }
    }

    /// A short, secret-free reason: "connect refused", "tls: invalid peer certificate: …".
    pub fn describe(&self) -> String {
        use io::ErrorKind::*;
        match self {
            UpstreamError::Legacy(e) => forward::describe(e),
            UpstreamError::ClientBody(_) => "the request body could not be read".into(),
            UpstreamError::Connect(e) => match forward::find_io(e.as_ref()) {
                Some(ConnectionRefused) => "connect refused".into(),
                Some(TimedOut) => upstream::timed_out_words(e.as_ref()).into(),
                _ => forward::connect_failed(e.as_ref()),
            },
            UpstreamError::Tls(e) => match forward::find_rustls(e) {
                Some(tls) => forward::tls_failed(tls),
                None => describe_io(e.kind(), "tls handshake failed"),
            },
            UpstreamError::Io(e) => describe_io(e.kind(), "upstream connection failed"),
            UpstreamError::Closed => "connection closed early".into(),
            UpstreamError::Timeout | UpstreamError::Unsent => "timed out".into(),
            UpstreamError::PingUnanswered => "keep-alive ping unanswered".into(),
            UpstreamError::BodyStalled => "the request body stalled".into(),
            UpstreamError::Protocol(what) => format!("invalid response: {what}"),
        }
    }
}

fn describe_io(kind: io::ErrorKind, what: &str) -> String {
    use io::ErrorKind::*;
    match kind {
        ConnectionReset | ConnectionAborted => "connection reset".into(),
        UnexpectedEof | BrokenPipe => "connection closed early".into(),
        TimedOut => "timed out".into(),
        kind => format!("{what}: {kind}"),
    }
}

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

/// `https` origins that negotiated HTTP/1.1 through ALPN: their requests go to the pool.
/// hyper-util's HTTP/1 pool races a waiting request's connect against connections coming
/// back and finishes a losing connect in the background, for nobody: in a pool this one
/// does not see, holding a [`Slot`] that [`IdleConnections`] cannot give back. An answer
/// holds for [`Http1Origins::FOR`]; then one request asks hyper-util's client again (the
/// others keep to the pool meanwhile), so that an origin whose HTTP/1.1 was passing (a
/// balancer's node without HTTP/2, a deploy) is multiplexed again.
#[derive(Default)]
struct Http1Origins {
    /// Whether `list` has any, read first: an HTTP/2 control plane (the usual one) takes
    /// no lock per request.
    any: std::sync::atomic::AtomicBool,
    /// Each origin with the time until which its requests go to the pool.
    list: std::sync::RwLock<Vec<(Box<str>, Instant)>>,
}

impl Http1Origins {
    /// A client has a handful of origins; more are not remembered.
    const MAX: usize = 64;
    const FOR: Duration = Duration::from_secs(600);
    /// How long the other requests keep to the pool while one asks again.
    const ASKING: Duration = Duration::from_secs(10);

    /// Whether `uri`'s origin goes to the pool. Once its time is up, false for one
    /// request in each [`Http1Origins::ASKING`].
    fn has(&self, uri: &http::Uri, now: Instant) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.any.load(Relaxed) {
            return false;
        }
        let Some(authority) = uri.authority() else {
            return false;
        };
        {
            let list = self.list.read().unwrap_or_else(PoisonError::into_inner);
            match Self::index(&list, authority.as_str()) {
                None => return false,
                Some(i) if now < list[i].1 => return true,
                Some(_) => {}
            }
        }
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        match Self::index(&list, authority.as_str()) {
            Some(i) if now < list[i].1 => true,
            Some(i) => {
                list[i].1 = now + Self::ASKING;
                false
            }
            None => false,
        }
    }

    fn index(list: &[(Box<str>, Instant)], authority: &str) -> Option<usize> {
        list.iter().position(|(a, _)| **a == *authority)
    }

    /// `uri`'s origin answered in HTTP/1.x at `now`.
    #[cold]
    fn add(&self, uri: &http::Uri, now: Instant) {
        let Some(authority) = uri.authority() else {
            return;
        };
        let until = now + Self::FOR;
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = Self::index(&list, authority.as_str()) {
            list[i].1 = until;
            return;
        }
        if list.len() >= Self::MAX {
            list.retain(|(_, until)| now < *until);
        }
        if list.len() < Self::MAX {
            list.push((authority.as_str().into(), until));
            self.any.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// `uri`'s origin answered in HTTP/2: hyper-util's client keeps it.
    fn remove(&self, uri: &http::Uri) {
        if !self.any.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let Some(authority) = uri.authority() else {
            return;
        };
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        list.retain(|(a, _)| **a != *authority.as_str());
    }
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

    async fn legacy(
        &self,
        plane: Plane,
        req: Request<ProxyBody>,
        timeout: Duration,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let mut deadline = Instant::now() + timeout;
        // Only a request with a body is watched (no allocation for a GET). Its trailers
        // are dropped as on the pool's connections (nothing an SDK sends has them, and a
        // client's could carry credential fields past the head's rewrite).
        let moved = (!req.body().is_end_stream()).then(body::Moved::default);
        let mut req = match &moved {
            Some(m) => req.map(|b| body::boxed(body::Uploading::new(b, m.clone()))),
            None => req,
        };
        // Given up before the answer's head (dropped at its timeout, or with its client):
        // what of the body has not gone is never sent.
        let mut give_up = GiveUp(moved.clone());
        let upgrade = req.headers().contains_key(UPGRADE);
        let mut again = if upgrade { None } else { Again::of(&req) };
        let idempotent = is_idempotent(req.method());
        // The origin, to remember should it answer in HTTP/1.1 (a refcount, not a copy).
        let origin = (self.negotiate && !upgrade).then(|| req.uri().clone());
        // To poison the connection of an answer refused below: hyper would reuse it, though
        // an upstream framing its answers that way may have more bytes of it to come.
        let mut conn = capture_connection(&mut req);
        let mut response = pin!(self.legacy.request(req));
        let mut resp = loop {
            match tokio::time::timeout_at(deadline.into(), response.as_mut()).await {
                // hyper's HTTP/1 client marks the body's error as the caller's; its HTTP/2
                // client resets the stream and fails with that reset, the upstream's
                // answer to nothing it did.
                Ok(Err(e)) if moved.as_ref().is_some_and(body::Moved::broken) => {
                    return Err(UpstreamError::ClientBody(e.into()))
                }
                Ok(Err(e)) if forward::timed_out(&e) => return Err(UpstreamError::PingUnanswered),
                // Not processed at all (RFC 9113 §8.7): sent once more, as curl and Go's
                // client do, whatever the method. hyper-util sends again only what it never
                // wrote. Once: an upstream refusing every stream is answered. So is a
                // request that may be done twice whose connection was lost under it with no
                // word (closed or reset without a GOAWAY, as a server ending an idle
                // connection may), as the pool's HTTP/1.1 connections and Go's client do.
                Ok(Err(e))
                    if forward::refused(&e) || idempotent && forward::connection_lost(&e) =>
                {
                    let Some(again) = again.take() else {
                        return Err(e.into());
                    };
                    let why = if forward::refused(&e) {
                        "refused"
                    } else {
                        "lost"
                    };
                    tracing::debug!(
                        plane = plane.label(),
                        method = %again.method,
                        why,
                        "the upstream refused the request unprocessed, or its connection was \
                         lost: sending it again"
                    );
                    let mut req = again.into_request(moved.as_ref());
                    conn = capture_connection(&mut req);
                    response.set(self.legacy.request(req));
                }
                Ok(resp) => break resp?,
                // An upload still moving is not an upstream gone quiet: the wait counts
                // from its last bytes (as nginx's proxy_send_timeout does).
                Err(_) => {
                    let last = moved.as_ref().and_then(body::Moved::last);
                    match held_off(last.map(tokio::time::Instant::into_std), timeout) {
                        Some(later) => deadline = later,
                        None if moved.as_ref().is_some_and(body::Moved::awaiting_client) => {
                            return Err(UpstreamError::BodyStalled)
                        }
                        // Given up here, so that the body's first poll, should it race this
                        // on hyper's side, finds it so, or is seen to have come first.
                        None if moved.as_ref().is_some_and(body::Moved::give_up) => {
                            return Err(UpstreamError::Unsent)
                        }
                        None => return Err(UpstreamError::Timeout),
                    }
                }
            }
        };
        // Answered: the rest of the body goes on (an upstream may answer before its end).
        give_up.0 = None;
        if let Err(e) = admit(upgrade, &mut resp) {
            if let Some(conn) = &*conn.connection_metadata() {
                conn.poison();
            }
            return Err(e);
        }
        if let Some(origin) = origin {
            if resp.version() < Version::HTTP_2 {
                self.http1.add(&origin, Instant::now());
            } else {
                self.http1.remove(&origin);
            }
        }
        let pool = self.pool.clone();
        let count = move |e: BoxError| {
            // An answer cut because the client's upload broke (the stream reset with it)
            // is no upstream error.
            if moved.as_ref().is_some_and(body::Moved::broken) {
                return e;
            }
            // The one error that is not hyper's: a stream reset before its END_STREAM.
            let kind = e
                .downcast_ref::<hyper::Error>()
                .map_or(FailKind::Reset, forward::body_kind);
            pool.count_broken(plane, kind);
            e
        };
        // Not for HTTP/1: hyper never says a chunked body is at its end, and a connection
        // cut mid-body is hyper's own error there.
        let h2 = resp.version() == Version::HTTP_2;
        Ok(resp.map(|incoming| {
            if h2 {
                body::boxed(body::EndStreamed::response(incoming).map_err(count))
            } else {
                body::boxed(incoming.map_err(BoxError::from).map_err(count))
            }
        }))
    }
}

/// Gives the request up ([`body::Moved::give_up`]) when dropped still holding its body's
/// progress: before the answer's head.
struct GiveUp(Option<body::Moved>);

impl Drop for GiveUp {
    fn drop(&mut self) {
        if let Some(moved) = &self.0 {
            let _ = moved.give_up();
        }
    }
}

/// A request kept to be sent once more should the upstream refuse it unprocessed (or, in
/// the handler, refuse its temporary key): its head, and its body when there is none or
/// the handler holds it whole ([`Replay`]). A body streamed from the client is gone once
/// sent: such a request is not kept.
pub(super) struct Again {
    method: Method,
    uri: http::Uri,
    headers: HeaderMap,
    body: Option<Bytes>,
}

/// A request body the handler holds whole (a rewritten create or connect), put in the
/// request's extensions so that the upstream client can send it again.
#[derive(Clone)]
pub struct Replay(pub Bytes);

impl Again {
    pub(super) fn of(req: &Request<ProxyBody>) -> Option<Again> {
        let body = if req.body().is_end_stream() {
            None
        } else {
            Some(req.extensions().get::<Replay>()?.0.clone())
        };
        Some(Again {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers: req.headers().clone(),
            body,
        })
    }

    /// The request again; its body marks `moved` as the first one's did, and is held for
    /// the pool to send once more as the first one's was.
    pub(super) fn into_request(self, moved: Option<&body::Moved>) -> Request<ProxyBody> {
        let body = match (&self.body, moved) {
            (Some(b), Some(m)) => {
                body::boxed(body::Uploading::new(body::full(b.clone()), m.clone()))
            }
            (Some(b), None) => body::full(b.clone()),
            (None, _) => body::empty(),
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers;
        if let Some(b) = self.body {
            req.extensions_mut().insert(Replay(b));
        }
        req
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

/// Idle connections by origin. There are a handful of origins (the control plane, envd or
/// a few sandboxes), so a list scanned in order beats hashing.
struct Idle {
    origins: Vec<OriginIdle>,
    /// A [`sweep`] task runs for this list.
    sweeping: bool,
}

struct OriginIdle {
    key: Origin,
    /// Oldest first; taken from the end (the most recently used is the likeliest alive).
    conns: Vec<Conn>,
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

    fn lock(&self) -> MutexGuard<'_, Idle> {
        self.idle[crate::workers::index() % self.idle.len()]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle connection to the origin that still looks open.
    fn checkout(&self, tls: bool, host: &str, port: u16) -> Option<Conn> {
        let now = crate::clock::since_boot();
        loop {
            let mut conn = {
                let mut idle = self.lock();
                let list = idle
                    .origins
                    .iter_mut()
                    .find(|o| o.key.is(tls, host, port))?;
                let conn = list.conns.pop()?;
                if now.saturating_sub(conn.idle_since) >= IDLE_TIMEOUT {
                    // The ones below it are older still.
                    let expired = std::mem::take(&mut list.conns);
                    drop(idle);
                    drop((conn, expired));
                    return None;
                }
                conn
            };
            if conn.looks_open() {
                return Some(conn);
            }
        }
    }

    fn put(self: &Arc<Self>, mut conn: Conn) {
        conn.idle_since = crate::clock::since_boot();
        // Not a download's buffer for an idle socket: up to 128 KiB each was kept, and a
        // thousand sandboxes' idle connections held 150 MiB. Its reads grew past the first
        // size (`capacity` says only what is left of the buffer past what was split off).
        if conn.read_size > FIRST_READ || conn.rbuf.capacity() > 2 * FIRST_READ {
            conn.rbuf = BytesMut::new();
        }
        conn.read_size = FIRST_READ;
        let mut idle = self.lock();
        if !idle.sweeping {
            // On this worker's runtime, like the connections it looks after.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                idle.sweeping = true;
                runtime.spawn(sweep(Arc::downgrade(self)));
            }
        }
        let overflow = match idle.origins.iter_mut().find(|o| o.key == conn.origin) {
            Some(o) if o.conns.len() < MAX_IDLE_PER_ORIGIN => {
                o.conns.push(conn);
                None
            }
            Some(_) => Some(conn),
            None => {
                let key = conn.origin.clone();
                idle.origins.push(OriginIdle {
                    key,
                    conns: vec![conn],
                });
                None
            }
        };
        drop(idle);
        // Closing a socket is a syscall: not under the lock.
        drop(overflow);
        // A slot is worth more to a request waiting for one than to an idle connection.
        // Checked after the push (the list's lock taken and released): a request that
        // began to wait before then is counted by now, and one that begins later finds
        // the connection idle.
        if self.slots.wanted() {
            self.close_one();
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
            wbuf: Vec::with_capacity(1024),
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

impl Pool {
    /// Where the longest idle connection is: when it went idle, its worker's list and its
    /// origin there.
    fn oldest_at(&self) -> Option<(Duration, usize, usize)> {
        let lists = self.idle.iter().enumerate();
        (lists.filter_map(|(list, idle)| {
            let idle = idle.lock().unwrap_or_else(PoisonError::into_inner);
            let origins = idle.origins.iter().enumerate();
            (origins.filter_map(|(origin, o)| Some((o.conns.first()?.idle_since, list, origin))))
                .min()
        }))
        .min()
    }

    /// Closes an idle connection, the first found in any worker's list: the lists changed
    /// since the oldest was looked for (a request took it).
    fn close_any(&self) -> bool {
        self.idle.iter().any(|list| {
            let mut idle = list.lock().unwrap_or_else(PoisonError::into_inner);
            let found = (idle.origins.iter_mut())
                .find(|o| !o.conns.is_empty())
                .map(|o| o.conns.remove(0));
            drop(idle);
            found.is_some()
        })
    }
}

impl IdleConnections for Pool {
    fn oldest(&self) -> Option<Duration> {
        self.oldest_at().map(|(since, ..)| since)
    }

    /// The longest idle connection of all: the first origin's was closed, however busy
    /// (a sandbox used all along lost its connection to each new one, while hundreds idle
    /// since to sandboxes no longer used stayed open).
    fn close_one(&self) -> bool {
        let Some((_, list, origin)) = self.oldest_at() else {
            return false;
        };
        let mut idle = self.idle[list]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let oldest = (idle.origins.get_mut(origin))
            .filter(|o| !o.conns.is_empty())
            .map(|o| o.conns.remove(0));
        drop(idle);
        // Closed outside the lock; from any thread, as the sweep's are.
        oldest.is_some() || self.close_any()
    }
}

/// Every [`SWEEP_EVERY`] while this worker keeps idle connections: drops those expired and
/// those the upstream closed or wrote to. Without it a connection the upstream closed stays
/// in CLOSE-WAIT, its descriptor held, until a request for the same origin comes, which
/// for a sandbox's own origin may be never. Ends when the list is empty (an idle proxy
/// wakes for nothing), or with the pool.
async fn sweep(pool: Weak<Pool>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(pool) = pool.upgrade() else { return };
        let now = crate::clock::since_boot();
        let mut gone = Vec::new();
        let mut idle = pool.lock();
        for o in &mut idle.origins {
            for mut c in std::mem::take(&mut o.conns) {
                let fresh = now.saturating_sub(c.idle_since) < IDLE_TIMEOUT;
                if fresh && c.looks_open() {
                    o.conns.push(c);
                } else {
                    gone.push(c);
                }
            }
        }
        idle.origins.retain(|o| !o.conns.is_empty());
        let done = idle.origins.is_empty();
        idle.sweeping = !done;
        drop(idle);
        // Closing sockets is syscalls: not under the lock.
        drop(gone);
        if done {
            return;
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
    /// The request head, then chunk-size lines; reused across requests.
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
            pool.count_broken(plane, forward::io_kind(e.kind()));
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
mod tests {
    use super::*;
    use http::header::{CONNECTION, CONTENT_LENGTH, HOST};
    use http::uri::Authority;
    use http::{HeaderValue, StatusCode};
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;
    use tokio::sync::{mpsc, oneshot};

    /// A connect that failed is said in the words of its innermost error: a name that
    /// does not resolve read "connect failed: uncategorized error" (the kind of the
    /// resolver's error), nothing about the name.
    #[test]
    fn a_failed_connect_is_said_in_its_errors_words() {
        let said = |e: io::Error| UpstreamError::Connect(Box::new(e)).describe();
        let dns = "failed to lookup address information: Name or service not known";
        assert_eq!(
            said(io::Error::other(dns)),
            format!("connect failed: {dns}")
        );
        let wrapped = io::Error::other(io::Error::new(io::ErrorKind::NotFound, dns));
        assert_eq!(said(wrapped), format!("connect failed: {dns}"));
        let os = io::Error::from_raw_os_error(113);
        assert_eq!(said(os), "connect failed: No route to host (os error 113)");
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(said(refused), "connect refused");
    }

    /// Bounds every wait so a broken client fails the test instead of hanging it.
    const GUARD: Duration = Duration::from_secs(20);
    /// An upstream timeout no test reaches.
    const LONG: Duration = Duration::from_secs(60);

    async fn within<F: Future>(fut: F) -> F::Output {
        tokio::time::timeout(GUARD, fut).await.expect("timed out")
    }

    fn config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
    }

    fn client() -> Upstream {
        counted(Slots::unlimited())
    }

    fn counted(slots: Arc<Slots>) -> Upstream {
        counted_with(slots, Duration::from_secs(5))
    }

    fn counted_with(slots: Arc<Slots>, connect_timeout: Duration) -> Upstream {
        Upstream::new(
            config(rustls::RootCertStore::empty()),
            Versions::Http1,
            connect_timeout,
            LONG,
            None,
            slots,
            upstream::LocalResolver::new(upstream::Names::Sandboxes),
        )
    }

    /// A raw TCP upstream on 127.0.0.1: each connection goes to `serve` with its number.
    struct Fake {
        addr: SocketAddr,
        accepts: Arc<AtomicUsize>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Fake {
        async fn start<F, Fut>(serve: F) -> Fake
        where
            F: Fn(TcpStream, usize) -> Fut + Send + 'static,
            Fut: Future<Output = ()> + Send + 'static,
        {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accepts = Arc::new(AtomicUsize::new(0));
            let count = accepts.clone();
            let task = tokio::spawn(async move {
                while let Ok((s, _)) = listener.accept().await {
                    let n = count.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(serve(s, n));
                }
            });
            Fake {
                addr,
                accepts,
                task,
            }
        }

        fn url(&self, path: &str) -> String {
            format!("http://{}{path}", self.addr)
        }

        fn accepts(&self) -> usize {
            self.accepts.load(Ordering::SeqCst)
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// One request head from `s` (what follows it stays in `buf`); `None` at EOF.
    async fn read_head<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<String> {
        loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..i + 4]).into_owned();
                buf.drain(..i + 4);
                return Some(head);
            }
            let mut tmp = [0u8; 4096];
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
    }

    /// Reads until `buf` ends with `end` (or EOF).
    async fn read_until<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>, end: &[u8]) {
        while !buf.ends_with(end) {
            let mut tmp = [0u8; 4096];
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
    }

    /// A keep-alive server answering each request head with `answer(head)`.
    fn keep_alive(
        answer: fn(&str) -> Vec<u8>,
    ) -> impl Fn(TcpStream, usize) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        move |s, _| Box::pin(answer_each(s, answer))
    }

    /// Answers each request head on `s` with `answer(head)` until the client closes.
    async fn answer_each<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, answer: fn(&str) -> Vec<u8>) {
        let mut buf = Vec::new();
        while let Some(head) = read_head(&mut s, &mut buf).await {
            if s.write_all(&answer(&head)).await.is_err() {
                return;
            }
        }
    }

    /// RFC 9112 §6.1: an HTTP/1.0 answer with Transfer-Encoding has faulty framing. Its
    /// body is read as chunked, but its connection is not used again, whatever
    /// `Connection: keep-alive` says; an HTTP/1.0 keep-alive answer with a length is.
    #[tokio::test]
    async fn an_http_1_0_answer_with_transfer_encoding_ends_its_connection() {
        fn chunked(_: &str) -> Vec<u8> {
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n\
              2\r\nok\r\n0\r\n\r\n"
                .to_vec()
        }
        fn length(_: &str) -> Vec<u8> {
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok".to_vec()
        }
        for (answer, accepts) in [(chunked as fn(&str) -> Vec<u8>, 2), (length, 1)] {
            let fake = Fake::start(keep_alive(answer)).await;
            let client = client();
            for path in ["/1", "/2"] {
                assert_eq!(get_text(&client, &fake.url(path)).await, "ok");
            }
            assert_eq!(fake.accepts(), accepts);
        }
    }

    /// A GET through `client` that must get an answer; the answer's body.
    async fn get_text(client: &Upstream, url: &str) -> String {
        let resp = within(client.request(Plane::Api, get(url), LONG))
            .await
            .unwrap();
        text(resp).await
    }

    fn get(url: &str) -> Request<ProxyBody> {
        Request::get(url).body(body::empty()).unwrap()
    }

    /// A WebSocket upgrade request: it goes through hyper's client.
    fn upgrade(url: &str) -> Request<ProxyBody> {
        Request::get(url)
            .header(CONNECTION, "upgrade")
            .header(UPGRADE, "websocket")
            .body(body::empty())
            .unwrap()
    }

    fn with_body(method: &str, url: &str, b: ProxyBody) -> Request<ProxyBody> {
        Request::builder().method(method).uri(url).body(b).unwrap()
    }

    async fn text(resp: Response<ProxyBody>) -> String {
        let bytes = within(resp.into_body().collect())
            .await
            .expect("body")
            .to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// A request body fed by the test, one chunk per message, size unknown.
    struct ChannelBody(mpsc::Receiver<Result<Bytes, BoxError>>);

    impl Body for ChannelBody {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx).map(|m| m.map(|r| r.map(Frame::data)))
        }
    }

    fn channel() -> (mpsc::Sender<Result<Bytes, BoxError>>, ProxyBody) {
        let (tx, rx) = mpsc::channel(4);
        (tx, body::boxed(ChannelBody(rx)))
    }

    /// A PUT to `url` through `client` whose body has given `first` and waits for more:
    /// the sender of the rest, and the answer.
    async fn put_first(
        client: &Upstream,
        url: &str,
        first: &'static [u8],
    ) -> (mpsc::Sender<Result<Bytes, BoxError>>, Response<ProxyBody>) {
        let (tx, body) = channel();
        tx.send(Ok(Bytes::from_static(first))).await.unwrap();
        let put = with_body("PUT", url, body);
        let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
        (tx, resp)
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let fake = Fake::start(keep_alive(|head| {
            if head.starts_with("GET /big ") {
                let mut r = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
                r.extend(std::iter::repeat_n(b'x', 200_000));
                r
            } else {
                OK.to_vec()
            }
        }))
        .await;
        let client = client();
        for path in ["/a", "/big", "/b", "/big", "/c"] {
            let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let body = text(resp).await;
            if path == "/big" {
                assert_eq!(body.len(), 200_000);
                assert!(body.bytes().all(|b| b == b'x'));
            } else {
                assert_eq!(body, "ok");
            }
        }
        assert_eq!(fake.accepts(), 1);
    }

    /// A large plain answer is spliced only with a place free for its pipe (see
    /// `descriptors::Budget::pipes`), held while the splice lasts and apart from the
    /// connections' slots; without one the body is read as usual, whole.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_splice_takes_a_pipes_place_or_the_body_is_read() {
        const LEN: usize = 2 << 20;
        let up = Fake::start(keep_alive(|_| {
            let mut answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {LEN}\r\n\r\n");
            answer.push_str(&"x".repeat(LEN));
            answer.into_bytes()
        }))
        .await;
        for pipes in [0, 1] {
            let slots = Slots::new(1, pipes);
            let pool = counted(slots.clone());
            let resp = within(pool.request(Plane::Api, get(&up.url("/")), LONG)).await;
            let resp = resp.expect("the answer");
            let offer = resp.extensions().get::<Splice>().cloned().expect("offered");
            let taken = offer.take(LEN as u64);
            assert_eq!(taken.is_some(), pipes == 1, "{pipes} places");
            assert_eq!(slots.in_use(), 1, "{pipes} places: the connection");
            if taken.is_some() {
                assert!(slots.try_take_pipe().is_none(), "the place is held");
                drop(taken);
                assert!(slots.try_take_pipe().is_some(), "given back");
            } else {
                assert_eq!(text(resp).await.len(), LEN, "read whole");
            }
        }
    }

    /// Connections hold the slots both planes share: with one, a request to another
    /// origin takes over an idle connection's (closing it); while an answer holds it, a
    /// request waits for it, and gets it as the answer ends, the connection closed rather
    /// than pooled, or fails after the connect timeout.
    #[tokio::test]
    async fn connections_are_held_to_the_shared_slots() {
        let a = Fake::start(keep_alive(|_| OK.to_vec())).await;
        let more = Arc::new(tokio::sync::Notify::new());
        let go_on = more.clone();
        let b = Fake::start(move |mut s, _| {
            let go_on = go_on.clone();
            async move {
                let mut buf = Vec::new();
                while read_head(&mut s, &mut buf).await.is_some() {
                    let head = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok";
                    let _ = s.write_all(head).await;
                    go_on.notified().await;
                    let _ = s.write_all(b"ok").await;
                }
            }
        })
        .await;
        let slots = Slots::new(1, Slots::UNLIMITED);
        let api = Arc::new(counted(slots.clone()));
        let envd = counted_with(slots.clone(), Duration::from_millis(300));

        assert_eq!(get_text(&api, &a.url("/")).await, "ok");
        assert_eq!(slots.in_use(), 1, "the idle connection holds its slot");
        let held = within(envd.request(Plane::Envd, get(&b.url("/")), LONG)).await;
        let held = held.expect("the idle connection to a gave its slot up");
        assert_eq!(slots.in_use(), 1);

        let Err(e) = within(envd.request(Plane::Envd, get(&a.url("/")), LONG)).await else {
            panic!("a second connection with one slot");
        };
        assert!(matches!(e, UpstreamError::Connect(_)), "{e:?}");
        assert_eq!(
            e.describe(),
            "connect failed: no upstream connection free within 300ms: all 1 in use (the \
             open-file limit's share, see --max-connections)"
        );

        let waiting = tokio::spawn({
            let (api, url) = (api.clone(), a.url("/"));
            async move { get_text(&api, &url).await }
        });
        while !slots.wanted() {
            tokio::task::yield_now().await;
        }
        more.notify_one();
        assert_eq!(text(held).await, "okok");
        assert_eq!(within(waiting).await.unwrap(), "ok");
        assert_eq!(slots.in_use(), 1);
        // b's connection was closed, not pooled: another request to b connects again.
        more.notify_one();
        assert_eq!(get_text(&envd, &b.url("/")).await, "okok");
        assert_eq!(b.accepts(), 2);
    }

    /// The second request is a POST, which is never sent again on a new connection (see
    /// `Exchange::fail`): a GET lost on the dead connection would be, and the test would
    /// pass with a pool that hands out connections the server closed.
    #[tokio::test]
    async fn an_idle_connection_the_server_closed_is_replaced() {
        let (closed_tx, closed_rx) = oneshot::channel::<()>();
        let closed_tx = Arc::new(Mutex::new(Some(closed_tx)));
        let fake = Fake::start(move |mut s, n| {
            let closed_tx = closed_tx.clone();
            async move {
                let mut buf = Vec::new();
                while read_head(&mut s, &mut buf).await.is_some() {
                    let _ = s.write_all(OK).await;
                    if n == 0 {
                        // Keep-alive said nothing about closing; close anyway.
                        drop(s);
                        if let Some(tx) = closed_tx.lock().unwrap().take() {
                            let _ = tx.send(());
                        }
                        return;
                    }
                }
            }
        })
        .await;
        let client = client();
        assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
        within(closed_rx).await.unwrap();
        // On loopback the FIN is in our socket once the close has returned, but the
        // connection's readiness comes from the runtime's I/O driver, which a task woken by
        // the channel need not have let run: a yield polls it before this task goes on.
        tokio::task::yield_now().await;
        let pause = with_body("POST", &fake.url("/2"), body::empty());
        let resp = within(client.request(Plane::Api, pause, LONG))
            .await
            .unwrap();
        assert_eq!(text(resp).await, "ok");
        assert_eq!(fake.accepts(), 2);
    }

    /// A connection's idle age counts the machine's sleeps ([`crate::clock`]): one that
    /// went idle ten seconds before a night's sleep is past its idle timeout on waking,
    /// and the next request opens a new connection (the upstream dropped the old one while
    /// its close could not reach the sleeping machine). No sleep can be had in a test: the
    /// stamp is set back as one would leave it. Linux: elsewhere the clock is monotonic.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_connection_idle_across_a_sleep_is_not_used_again() {
        let fake = Fake::start(keep_alive(|_| OK.to_vec())).await;
        let client = client();
        assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
        assert_eq!(get_text(&client, &fake.url("/2")).await, "ok");
        assert_eq!(fake.accepts(), 1, "kept alive while awake");
        let slept = IDLE_TIMEOUT + Duration::from_secs(1);
        let now = crate::clock::since_boot();
        assert!(now > slept, "up {now:?}");
        {
            let mut idle = client.pool.lock();
            let conn = idle.origins[0].conns.last_mut().expect("pooled");
            conn.idle_since -= slept;
        }
        assert_eq!(get_text(&client, &fake.url("/3")).await, "ok");
        assert_eq!(fake.accepts(), 2, "a new connection after the sleep");
    }

    /// Idle connections the upstream closed are dropped by the sweep, with no request for
    /// their origin, while one still open stays; the sweep ends with the last connection.
    #[tokio::test]
    async fn the_sweep_drops_idle_connections_the_upstream_closed() {
        let (close_tx, close_rx) = oneshot::channel::<()>();
        let (closed_tx, closed_rx) = oneshot::channel::<()>();
        let signals = Arc::new(Mutex::new(Some((close_rx, closed_tx))));
        // Answers one request, then closes once told to.
        let closing = Fake::start(move |mut s, _| {
            let signals = signals.clone();
            async move {
                let mut buf = Vec::new();
                read_head(&mut s, &mut buf).await;
                let _ = s.write_all(OK).await;
                let Some((close, closed)) = signals.lock().unwrap().take() else {
                    return;
                };
                let _ = close.await;
                drop(s);
                let _ = closed.send(());
            }
        })
        .await;
        let staying = Fake::start(keep_alive(|_| OK.to_vec())).await;
        let client = client();
        assert_eq!(get_text(&client, &closing.url("/1")).await, "ok");
        assert_eq!(get_text(&client, &staying.url("/1")).await, "ok");
        let pooled = |client: &Upstream| -> Vec<u16> {
            let idle = client.pool.lock();
            idle.origins.iter().map(|o| o.key.port).collect()
        };
        assert_eq!(pooled(&client).len(), 2);

        close_tx.send(()).unwrap();
        within(closed_rx).await.unwrap();
        tokio::time::pause();
        // A little past the period: timers round their deadlines up to the millisecond.
        let period = SWEEP_EVERY + Duration::from_millis(10);
        tokio::time::advance(period).await;
        // The sweep's timer has fired: it runs once this task lets it.
        for _ in 0..100 {
            if pooled(&client).len() == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(pooled(&client), [staying.addr.port()]);
        assert!(client.pool.lock().sweeping);

        drop(staying);
        let conn = client.pool.lock().origins[0].conns.pop().unwrap();
        drop(conn);
        tokio::time::advance(period).await;
        for _ in 0..100 {
            if !client.pool.lock().sweeping {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            !client.pool.lock().sweeping,
            "the sweep ends with the last connection"
        );
    }

    /// An origin keeps at most [`MAX_IDLE_PER_ORIGIN`] idle connections: one more coming
    /// back is closed (its upstream sees the end), so a burst does not leave a descriptor
    /// per request held for good.
    #[tokio::test]
    async fn an_origin_keeps_at_most_its_idle_limit_and_closes_the_rest() {
        // Both ends of every connection are in this process; the default soft limit of
        // 1024 descriptors is shared with the tests running beside this one.
        let _ = rlimit::increase_nofile_limit(4096);
        let (go_tx, go_rx) = tokio::sync::watch::channel(false);
        let (closed_tx, mut closed_rx) = mpsc::unbounded_channel::<()>();
        let fake = Fake::start(move |mut s, _| {
            let mut go = go_rx.clone();
            let closed = closed_tx.clone();
            async move {
                let mut buf = Vec::new();
                if read_head(&mut s, &mut buf).await.is_none() {
                    return;
                }
                // Half the body, the rest when told: until then the client holds the connection.
                let _ = s.write_all(&OK[..OK.len() - 1]).await;
                let _ = go.wait_for(|go| *go).await;
                let _ = s.write_all(b"k").await;
                if read_head(&mut s, &mut buf).await.is_none() {
                    let _ = closed.send(());
                }
            }
        })
        .await;
        let client = client();
        let n = MAX_IDLE_PER_ORIGIN + 1;
        let mut held = Vec::with_capacity(n);
        for _ in 0..n {
            let resp = within(client.request(Plane::Api, get(&fake.url("/")), LONG)).await;
            held.push(resp.unwrap());
        }
        assert_eq!(fake.accepts(), n, "each request holds a connection");
        go_tx.send(true).unwrap();
        for resp in held {
            assert_eq!(text(resp).await, "ok");
        }
        let kept: usize = {
            let idle = client.pool.lock();
            idle.origins.iter().map(|o| o.conns.len()).sum()
        };
        assert_eq!(MAX_IDLE_PER_ORIGIN, kept);
        within(closed_rx.recv()).await.unwrap();
    }

    /// The deadline lives with the connection and moves per exchange: a kept-alive
    /// connection whose first exchange had a long deadline still times out the second,
    /// shorter one, and a timeout on a fresh connection covers the connect too.
    #[tokio::test]
    async fn the_upstream_timeout_follows_each_exchange_on_a_reused_connection() {
        let fake = Fake::start(|mut s, n| async move {
            // Answers the first request of the first connection only.
            let mut answer = n == 0;
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                if std::mem::take(&mut answer) {
                    let _ = s.write_all(OK).await;
                }
            }
        })
        .await;
        let client = client();
        assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
        let e =
            within(client.request(Plane::Api, get(&fake.url("/2")), Duration::from_millis(100)))
                .await
                .unwrap_err();
        assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
        assert_eq!(e.kind(), FailKind::Timeout);
        assert_eq!(
            fake.accepts(),
            1,
            "the second exchange reused the connection"
        );
        // A timed-out exchange leaves its connection unusable: the next one opens another,
        // and times out as well.
        let e =
            within(client.request(Plane::Api, get(&fake.url("/3")), Duration::from_millis(100)))
                .await
                .unwrap_err();
        assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
        assert_eq!(fake.accepts(), 2);
    }

    /// No head within the timeout while the request body waits on the client: the client's
    /// stall (the upstream waits for the rest), not an upstream timeout. While the body
    /// waits on the upstream instead, which stopped reading, the upstream's.
    #[tokio::test]
    async fn a_stalled_upload_is_told_from_an_upstream_that_stopped_reading() {
        // Reads the head and nothing more, and never answers.
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            if read_head(&mut s, &mut buf).await.is_some() {
                std::future::pending::<()>().await;
            }
        })
        .await;
        let client = client();
        let short = Duration::from_millis(300);
        let (tx, body) = channel();
        tx.send(Ok(Bytes::from_static(b"first part")))
            .await
            .unwrap();
        let put = with_body("PUT", &fake.url("/stalled"), body);
        let e = within(client.request(Plane::Api, put, short))
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::BodyStalled), "{e:?}");
        drop(tx);

        // Far more than the sockets' buffers hold, offered as fast as it is taken.
        let (tx, body) = channel();
        let feed = tokio::spawn(async move {
            let chunk = Bytes::from(vec![b'x'; 1 << 20]);
            while tx.send(Ok(chunk.clone())).await.is_ok() {}
        });
        let put = with_body("PUT", &fake.url("/unread"), body);
        let e = within(client.request(Plane::Api, put, short))
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
        within(feed).await.unwrap();
    }

    /// The server takes the second request on the kept-alive connection and closes without
    /// a word: a bodiless request with an idempotent method goes again on a new connection;
    /// one with a body does not, nor a POST, which the server may have carried out.
    #[tokio::test]
    async fn a_request_lost_to_a_keep_alive_close_is_retried_once_only_if_idempotent() {
        let heads = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = heads.clone();
        let fake = Fake::start(move |mut s, _| {
            let seen = seen.clone();
            async move {
                let mut buf = Vec::new();
                let mut served = 0;
                while let Some(head) = read_head(&mut s, &mut buf).await {
                    seen.lock().unwrap().push(head);
                    if served == 1 {
                        return;
                    }
                    served += 1;
                    let _ = s.write_all(OK).await;
                }
            }
        })
        .await;
        let client = client();
        for path in ["/1", "/2"] {
            assert_eq!(get_text(&client, &fake.url(path)).await, "ok");
        }
        assert_eq!(fake.accepts(), 2, "the retry took a new connection");
        let paths: Vec<String> = heads
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.split(' ').nth(1).unwrap().to_string())
            .collect();
        assert_eq!(paths, ["/1", "/2", "/2"]);

        // Connection 2 served /2; the POST reuses it and is lost: not sent again.
        let post = with_body("POST", &fake.url("/3"), body::full("data"));
        let e = within(client.request(Plane::Api, post, LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
        assert_eq!(e.describe(), "connection closed early");
        assert_eq!(fake.accepts(), 2, "a body is never sent twice");

        // A POST without a body (`/sandboxes/{id}/pause`) is not sent twice either.
        assert_eq!(get_text(&client, &fake.url("/4")).await, "ok");
        let pause = with_body("POST", &fake.url("/5"), body::empty());
        let e = within(client.request(Plane::Api, pause, LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
        assert_eq!(fake.accepts(), 3, "a POST is never sent twice");

        // DELETE is idempotent: it goes again.
        assert_eq!(get_text(&client, &fake.url("/6")).await, "ok");
        let delete = with_body("DELETE", &fake.url("/7"), body::empty());
        let resp = within(client.request(Plane::Api, delete, LONG))
            .await
            .unwrap();
        assert_eq!(text(resp).await, "ok");
        assert_eq!(fake.accepts(), 5, "the retry took a new connection");
        let methods: Vec<String> = heads
            .lock()
            .unwrap()
            .iter()
            .skip(3)
            .map(|h| h.split(' ').take(2).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            methods,
            [
                "POST /3",
                "GET /4",
                "POST /5",
                "GET /6",
                "DELETE /7",
                "DELETE /7"
            ]
        );
    }

    /// One poll of a request, with this task's waker.
    async fn poll_once<T>(request: &mut Pin<Box<dyn Future<Output = T> + Send + '_>>) -> Poll<T> {
        poll_fn(|cx| Poll::Ready(request.as_mut().poll(cx))).await
    }

    /// Shuts the writing half of the pooled idle connection, so the next request on it
    /// fails at its first write, with nothing written, while the read side still looks
    /// open to the checkout.
    fn shut_the_idle_connections_writing_half(client: &Upstream) {
        let mut conn = client.pool.lock().origins[0].conns.pop().unwrap();
        let Io::Plain(tcp) = conn.io else {
            panic!("plain upstream")
        };
        let tcp = tcp.into_std().unwrap();
        tcp.shutdown(std::net::Shutdown::Write).unwrap();
        conn.io = Io::Plain(TcpStream::from_std(tcp).unwrap());
        client.pool.lock().origins[0].conns.push(conn);
    }

    /// A request none of which reached the server goes again on a new connection, a POST
    /// too, since the server cannot have acted on it; one whose body was already taken
    /// does not, as what was taken is gone.
    #[tokio::test]
    async fn a_request_none_of_which_was_written_is_sent_again_unless_its_body_was_taken() {
        let heads = Arc::new(Mutex::new(Vec::<(usize, String)>::new()));
        let seen = heads.clone();
        // A connection closes only when the test says: after its request's write failed.
        let close = Arc::new(tokio::sync::Semaphore::new(0));
        let closing = close.clone();
        let fake = Fake::start(move |mut s, n| {
            let (seen, closing) = (seen.clone(), closing.clone());
            async move {
                let mut buf = Vec::new();
                while let Some(head) = read_head(&mut s, &mut buf).await {
                    seen.lock().unwrap().push((n, head));
                    let _ = s.write_all(OK).await;
                }
                closing.acquire().await.unwrap().forget();
            }
        })
        .await;
        let client = client();
        assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");

        shut_the_idle_connections_writing_half(&client);
        let pause = with_body("POST", &fake.url("/2"), body::empty());
        let mut request = client.request(Plane::Api, pause, LONG);
        // The first poll takes the pooled connection and fails to write; the answer waits
        // for the server's close, which tells a dead connection from a slow one.
        assert!(poll_once(&mut request).await.is_pending());
        close.add_permits(1);
        let resp = within(request).await.unwrap();
        assert_eq!(text(resp).await, "ok");
        assert_eq!(fake.accepts(), 2, "the POST went again on a new connection");

        shut_the_idle_connections_writing_half(&client);
        let upload = with_body("POST", &fake.url("/3"), body::full("data"));
        let mut request = client.request(Plane::Api, upload, LONG);
        assert!(poll_once(&mut request).await.is_pending());
        close.add_permits(1);
        let e = within(request).await.unwrap_err();
        assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
        assert_eq!(fake.accepts(), 2, "a body once taken is never sent again");

        let seen: Vec<(usize, String)> = heads
            .lock()
            .unwrap()
            .iter()
            .map(|(n, h)| (*n, h.split(' ').take(2).collect::<Vec<_>>().join(" ")))
            .collect();
        assert_eq!(seen, [(0, "GET /1".into()), (1, "POST /2".into())]);
    }

    #[tokio::test]
    async fn a_server_closing_mid_response_is_a_reset() {
        // One answer per connection, cut short, then the connection closes.
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            if let Some(head) = read_head(&mut s, &mut buf).await {
                let reply: &[u8] = if head.starts_with("GET /head ") {
                    b"HTTP/1.1 200 OK\r\nContent-Le"
                } else {
                    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
                };
                let _ = s.write_all(reply).await;
            }
        })
        .await;
        let client = client();
        let e = within(client.request(Plane::Api, get(&fake.url("/head")), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
        assert_eq!(e.describe(), "connection closed early");

        let resp = within(client.request(Plane::Api, get(&fake.url("/body")), LONG))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let e = within(resp.into_body().collect()).await.unwrap_err();
        let e = e.downcast_ref::<UpstreamError>().expect("an UpstreamError");
        assert!(matches!(e, UpstreamError::Closed), "{e:?}");
        assert_eq!(e.kind(), FailKind::Reset);
    }

    #[tokio::test]
    async fn chunked_responses_are_decoded_with_extensions_and_trailers() {
        let fake = Fake::start(keep_alive(|_| {
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              5;ext=1\r\nhello\r\n6 ; name=\"v\"\r\n world\r\n0\r\nx-trailer: yes\r\n\r\n"
                .to_vec()
        }))
        .await;
        let client = client();
        for _ in 0..2 {
            let resp = within(client.request(Plane::Api, get(&fake.url("/")), LONG))
                .await
                .unwrap();
            let collected = within(resp.into_body().collect()).await.unwrap();
            assert_eq!(collected.trailers().unwrap()["x-trailer"], "yes");
            assert_eq!(collected.to_bytes(), "hello world");
        }
        assert_eq!(
            fake.accepts(),
            1,
            "a chunked body read to its end is reusable"
        );
    }

    #[tokio::test]
    async fn close_delimited_responses_read_to_eof() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            if read_head(&mut s, &mut buf).await.is_some() {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nall of it").await;
            }
        })
        .await;
        let client = client();
        for _ in 0..2 {
            assert_eq!(get_text(&client, &fake.url("/")).await, "all of it");
        }
        assert_eq!(
            fake.accepts(),
            2,
            "a close-delimited body ends its connection"
        );
    }

    #[tokio::test]
    async fn head_204_and_304_have_no_body() {
        let fake = Fake::start(keep_alive(|head| match head.split(' ').nth(1).unwrap() {
            "/head" => b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec(),
            "/204" => b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
            "/304" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n".to_vec(),
            _ => OK.to_vec(),
        }))
        .await;
        let client = client();
        let head = Request::head(fake.url("/head"))
            .body(body::empty())
            .unwrap();
        let resp = within(client.request(Plane::Api, head, LONG))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-length"], "1000");
        assert!(resp.body().is_end_stream());
        for path in ["/204", "/304"] {
            let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
                .await
                .unwrap();
            assert_eq!(resp.status().as_str(), &path[1..]);
            assert_eq!(text(resp).await, "");
        }
        assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
        assert_eq!(fake.accepts(), 1);
    }

    /// A 204 with `Transfer-Encoding` or a length, or a 304 with `Transfer-Encoding`, is often
    /// followed by the body it announced (`0\r\n\r\n`, late): read as the next request's
    /// answer, that gave another client a 502 or, with a whole answer, shifted every later
    /// answer by one. A 304's length is the resource's: its connection is kept.
    #[tokio::test]
    async fn a_bodyless_answer_announcing_a_body_ends_its_connection() {
        let fake = Fake::start(keep_alive(|head| match head.split(' ').nth(1).unwrap() {
            "/zero" => b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n".to_vec(),
            "/chunked" => b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
            "/length" => b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n".to_vec(),
            "/304-length" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n".to_vec(),
            "/304-chunked" => {
                b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec()
            }
            _ => OK.to_vec(),
        }))
        .await;
        let client = client();
        let answers = [
            ("/zero", 1),
            ("/chunked", 2),
            ("/length", 3),
            ("/304-length", 3),
            ("/304-chunked", 4),
        ];
        for (path, accepts) in answers {
            let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
                .await
                .unwrap();
            let status = if path.starts_with("/304") { 304 } else { 204 };
            assert_eq!(resp.status(), status, "{path}");
            assert_eq!(text(resp).await, "", "{path}");
            assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
            assert_eq!(fake.accepts(), accepts, "after {path}");
        }
    }

    /// An idle connection keeps no download's read buffer: up to 128 KiB each was kept, and
    /// a thousand sandboxes' idle connections held 150 MiB. A small answer's buffer is kept
    /// (no allocation per request).
    #[tokio::test]
    async fn an_idle_connection_keeps_no_large_read_buffer() {
        let fake = Fake::start(keep_alive(|head| {
            if head.split(' ').nth(1) != Some("/big") {
                return OK.to_vec();
            }
            let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
            answer.resize(answer.len() + 200_000, b'x');
            answer
        }))
        .await;
        let client = client();
        // Whether the idle connection's read buffer is a new one: split to its end, a
        // download's buffer reads empty but is still there; a new one has not allocated.
        let fresh = || -> Vec<bool> {
            let new = BytesMut::new().as_ptr();
            (client.pool.idle.iter())
                .flat_map(|list| {
                    let idle = list.lock().unwrap();
                    let conns = idle.origins.iter().flat_map(|o| o.conns.iter());
                    conns.map(|c| c.rbuf.as_ptr() == new).collect::<Vec<_>>()
                })
                .collect()
        };
        for _ in 0..3 {
            assert_eq!(get_text(&client, &fake.url("/small")).await, "ok");
            assert_eq!(fresh(), [false], "a small answer's buffer is kept");
        }
        assert_eq!(get_text(&client, &fake.url("/big")).await.len(), 200_000);
        assert_eq!(fresh(), [true], "a download's is not");
        assert_eq!(fake.accepts(), 1);
    }

    /// A slot wanted closes the longest idle connection, whatever its origin: the first
    /// origin's was closed, however recently used.
    #[tokio::test]
    async fn the_longest_idle_connection_is_the_one_closed() {
        let a = Fake::start(keep_alive(|_| OK.to_vec())).await;
        let b = Fake::start(keep_alive(|_| OK.to_vec())).await;
        let client = client();
        // `a` first in the pool's list, then `b`, then `a` again: `b` idle the longest.
        for fake in [&a, &b, &a] {
            assert_eq!(get_text(&client, &fake.url("/")).await, "ok");
        }
        assert!(client.pool.close_one());
        for fake in [&a, &b] {
            assert_eq!(get_text(&client, &fake.url("/")).await, "ok");
        }
        assert_eq!((a.accepts(), b.accepts()), (1, 2), "b's closed, a's kept");
    }

    #[tokio::test]
    async fn interim_100_continue_is_skipped() {
        let fake = Fake::start(keep_alive(|_| {
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
              HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
                .to_vec()
        }))
        .await;
        let client = client();
        let post = with_body("POST", &fake.url("/"), body::full("x"));
        let resp = within(client.request(Plane::Api, post, LONG))
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
        assert!(resp.headers().get("link").is_none());
        assert_eq!(text(resp).await, "ok");
    }

    /// Answers whose framing a proxy must not pass on, by the path asked for.
    fn ambiguous(head: &str) -> Vec<u8> {
        match head.split(' ').nth(1).unwrap() {
            "/cl-te" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/two-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!".to_vec(),
            "/bad-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok".to_vec(),
            "/gzip" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/gzip-eof" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx".to_vec(),
            "/twice" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/same-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/101" => b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n".to_vec(),
            "/h2c" => b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n".to_vec(),
            "/garbage" => b"\x00\x01 not http\r\n\r\n".to_vec(),
            "/many" => {
                let mut r = b"HTTP/1.1 200 OK\r\n".to_vec();
                for i in 0..150 {
                    r.extend_from_slice(format!("x-h{i}: {i}\r\n").as_bytes());
                }
                r.extend_from_slice(b"Content-Length: 0\r\n\r\n");
                r
            }
            _ => OK.to_vec(),
        }
    }

    #[tokio::test]
    async fn ambiguous_response_framing_is_a_protocol_error() {
        let fake = Fake::start(keep_alive(ambiguous)).await;
        let client = client();
        let paths = [
            "/cl-te",
            "/two-cl",
            "/bad-cl",
            "/garbage",
            "/many",
            "/gzip",
            "/gzip-eof",
            "/twice",
            "/101",
        ];
        assert_refused(&client, &fake, |path| fake.url(path), &paths).await;
        assert_plain_length(&client, &fake.url("/same-cl")).await;
        // A plain answer on the same client still works.
        assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
    }

    /// Each of `paths` is a protocol error, and no connection that carried one is reused.
    async fn assert_refused(
        client: &Upstream,
        fake: &Fake,
        url: impl Fn(&str) -> String,
        paths: &[&str],
    ) {
        for path in paths {
            let e = within(client.request(Plane::Api, get(&url(path)), LONG))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), FailKind::Protocol, "{path}: {e:?}");
            assert!(e.describe().starts_with("invalid response: "), "{path}");
        }
        assert_eq!(
            fake.accepts(),
            paths.len(),
            "no connection with a bad answer is reused"
        );
    }

    /// Equal lengths, listed and repeated, are one length, and the client gets it plain.
    async fn assert_plain_length(client: &Upstream, url: &str) {
        let resp = within(client.request(Plane::Api, get(url), LONG))
            .await
            .unwrap();
        let lengths: Vec<_> = resp.headers().get_all(CONTENT_LENGTH).iter().collect();
        assert_eq!(lengths, ["2"]);
        assert_eq!(text(resp).await, "ok");
    }

    /// The same answers from an `https` origin that may negotiate HTTP/2 and chose
    /// HTTP/1.1 (hyper's client reads them): hyper decoded `gzip, chunked` of its chunks
    /// and passed on `Content-Length` beside `Transfer-Encoding`, and the client got a
    /// body still compressed with the field that said so removed, or cut at the length
    /// yet looking complete.
    #[tokio::test]
    async fn ambiguous_response_framing_is_a_protocol_error_on_hypers_client_too() {
        let tls = tls_pair();
        let fake = tls_answering(&tls, ambiguous).await;
        let client = negotiating(&tls);
        let url = |path: &str| format!("https://localhost:{}{path}", fake.addr.port());
        let paths = ["/cl-te", "/gzip", "/gzip-eof", "/twice"];
        assert_refused(&client, &fake, url, &paths).await;
        assert_plain_length(&client, &url("/same-cl")).await;
        assert_eq!(get_text(&client, &url("/ok")).await, "ok");
    }

    /// A WebSocket upgrade is answered with its 101 (the handler tunnels it). A 101 to a
    /// request that asked for none was passed on as the final answer, and the client
    /// waited for what came after it until its idle timeout; one that switched to another
    /// protocol was tunnelled.
    #[tokio::test]
    async fn only_a_websocket_upgrade_gets_its_101() {
        let tls = tls_pair();
        let fake = tls_answering(&tls, ambiguous).await;
        let client = negotiating(&tls);
        let url = format!("https://localhost:{}", fake.addr.port());
        let e = within(client.request(Plane::Api, get(&format!("{url}/101")), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Protocol, "{e:?}");
        assert_eq!(
            e.describe(),
            "invalid response: unexpected 101 Switching Protocols"
        );
        let resp = within(client.request(Plane::Api, upgrade(&format!("{url}/101")), LONG))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
        let e = within(client.request(Plane::Api, upgrade(&format!("{url}/h2c")), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Protocol, "{e:?}");
        assert_eq!(
            e.describe(),
            "invalid response: 101 Switching Protocols to another protocol than WebSocket"
        );
    }

    /// An answer other than a 2xx before the upload ended (a 413), or a 2xx complete with
    /// its head: the answer is delivered, the upload stops, and the connection is not
    /// reused.
    #[tokio::test]
    async fn an_early_answer_stops_the_upload() {
        const ANSWERS: [&[u8]; 2] = [
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n",
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        ];
        for answer in ANSWERS {
            let fake = Fake::start(move |mut s, n| async move {
                let mut buf = Vec::new();
                while read_head(&mut s, &mut buf).await.is_some() {
                    if n == 0 {
                        let _ = s.write_all(answer).await;
                        // Read on so the client's close is a FIN, not a reset.
                        let mut sink = Vec::new();
                        let _ = s.read_to_end(&mut sink).await;
                        return;
                    }
                    let _ = s.write_all(OK).await;
                }
            })
            .await;
            let client = client();
            let (tx, resp) = put_first(&client, &fake.url("/up"), b"first part").await;
            let status = resp.status();
            let want = if status == 413 { "" } else { "ok" };
            assert_eq!(text(resp).await, want, "{status}");
            within(tx.closed()).await;
            assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
            assert_eq!(fake.accepts(), 2, "{status}");
        }
    }

    /// A 2xx that starts before the upload ended and goes on as the upload does (an echo, a
    /// stream answering as it reads): the rest of the body goes up alongside the answer's,
    /// and the connection is then closed (whether the upstream read the rest is not
    /// known): the next request gets a new one. The client's body stopped at the answer's
    /// head before: the upstream waited for the rest, and the client for the answer's end.
    #[tokio::test]
    async fn a_2xx_before_the_upload_ended_gets_the_rest_alongside_its_body() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            while let Some(head) = read_head(&mut s, &mut buf).await {
                if !head.starts_with("PUT") {
                    let _ = s.write_all(OK).await;
                    continue;
                }
                // Answers at once, then relays what the (chunked) body brings, framing and
                // all, as chunks of its own until the body's last chunk.
                let mut echo = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
                let mut seen = std::mem::take(&mut buf);
                loop {
                    if !seen.is_empty() {
                        echo.extend(format!("{:x}\r\n", seen.len()).as_bytes());
                        echo.extend_from_slice(&seen);
                        echo.extend_from_slice(b"\r\n");
                    }
                    let end = seen.ends_with(b"0\r\n\r\n");
                    if end {
                        echo.extend_from_slice(b"0\r\n\r\n");
                    }
                    if s.write_all(&std::mem::take(&mut echo)).await.is_err() || end {
                        break;
                    }
                    let mut tmp = [0u8; 4096];
                    match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen = tmp[..n].to_vec(),
                    }
                }
            }
        })
        .await;
        let client = client();
        let (tx, resp) = put_first(&client, &fake.url("/echo"), b"hello").await;
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while !got.ends_with(b"hello\r\n") {
            let frame = within(body.frame()).await.expect("more").expect("a frame");
            got.extend_from_slice(&frame.into_data().expect("data"));
        }
        tx.send(Ok(Bytes::from_static(b"world")))
            .await
            .expect("the upload goes on after the answer's head");
        drop(tx);
        let rest = within(body.collect()).await.expect("the rest").to_bytes();
        got.extend_from_slice(&rest);
        assert_eq!(got, b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n");
        assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
        assert_eq!(fake.accepts(), 2);
    }

    /// A 2xx begun before the upload ended that ends before it does: what is left of the
    /// upload is dropped, and the connection with it (the upstream would take the rest for
    /// a next request).
    #[tokio::test]
    async fn a_2xx_that_ends_before_the_upload_ends_the_upload_and_the_connection() {
        let fake = Fake::start(|mut s, n| async move {
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                if n > 0 {
                    let _ = s.write_all(OK).await;
                    continue;
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nhalf")
                    .await;
                // The answer's end waits for the upload's second part.
                read_until(&mut s, &mut buf, b"second\r\n").await;
                let _ = s.write_all(b"done").await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
                return;
            }
        })
        .await;
        let client = client();
        let (tx, resp) = put_first(&client, &fake.url("/up"), b"first").await;
        tx.send(Ok(Bytes::from_static(b"second"))).await.unwrap();
        assert_eq!(text(resp).await, "halfdone");
        within(tx.closed()).await;
        assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
        assert_eq!(fake.accepts(), 2);
    }

    /// The client's body breaking while its upload goes on alongside a 2xx ends that answer
    /// with the client's error (the upstream would wait for the rest in vain), not with an
    /// upstream failure.
    #[tokio::test]
    async fn a_client_body_breaking_after_an_early_2xx_ends_the_answer() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            if read_head(&mut s, &mut buf).await.is_some() {
                let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n";
                let _ = s.write_all(head).await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            }
        })
        .await;
        let client = client();
        let (tx, resp) = put_first(&client, &fake.url("/echo"), b"hello").await;
        let mut body = resp.into_body();
        let first = within(body.frame()).await.expect("a frame").expect("data");
        assert_eq!(first.into_data().expect("data"), "ok");
        tx.send(Err("the client went away".into())).await.unwrap();
        let e = within(body.frame())
            .await
            .expect("an end")
            .expect_err("the client's error");
        let e = e
            .downcast_ref::<UpstreamError>()
            .expect("the client's error");
        assert!(e.is_client_body(), "{e:?}");
    }

    /// The head goes up at once, before the body has given anything: the upstream may answer
    /// from the head alone (a 401, a 413), and a client streaming its body from a slow
    /// source must not hold that answer back.
    #[tokio::test]
    async fn the_head_goes_up_before_the_body_has_anything() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            if read_head(&mut s, &mut buf).await.is_some() {
                let _ = s
                    .write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
                    .await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            }
        })
        .await;
        let client = client();
        let (_tx, body) = channel();
        let put = with_body("PUT", &fake.url("/up"), body);
        let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
        assert_eq!(resp.status(), 413);
    }

    /// A head larger than the socket's buffers goes out over several writes, each taking
    /// up where the last one stopped, and the body after it. (The client's listener bounds
    /// the heads it takes, but a write may stop anywhere in one when the upstream is slow.)
    #[tokio::test]
    async fn a_head_written_in_pieces_arrives_whole_before_its_body() {
        // Over Linux's default largest send buffer: the first write cannot take all of it
        // while the server, on this thread, reads nothing.
        let big = "b".repeat(6 << 20);
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<(String, Vec<u8>)>();
        let fake = Fake::start(move |mut s, _| {
            let seen_tx = seen_tx.clone();
            async move {
                // Not `read_head`: its search from the start after each read is quadratic.
                let mut buf = Vec::new();
                read_until(&mut s, &mut buf, b"done").await;
                let _ = s.write_all(OK).await;
                let end = buf
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map_or(0, |i| i + 4);
                let body = buf.split_off(end);
                let _ = seen_tx.send((String::from_utf8_lossy(&buf).into_owned(), body));
            }
        })
        .await;
        let client = client();
        let put = Request::put(fake.url("/big"))
            .header("x-big", big.as_str())
            .body(body::full(Bytes::from_static(b"done")))
            .unwrap();
        let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, body) = within(seen.recv()).await.unwrap();
        assert!(head.starts_with("PUT /big HTTP/1.1\r\n"));
        assert!(head.contains(&format!("\r\nx-big: {big}\r\n")));
        assert!(head.ends_with("\r\ncontent-length: 4\r\n\r\n"));
        assert_eq!(body, b"done");
    }

    #[tokio::test]
    async fn request_framing_and_host() {
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<(String, Vec<u8>)>();
        let fake = Fake::start(move |mut s, _| {
            let seen_tx = seen_tx.clone();
            async move {
                let mut buf = Vec::new();
                while let Some(head) = read_head(&mut s, &mut buf).await {
                    let lower = head.to_ascii_lowercase();
                    if lower.contains("transfer-encoding: chunked") {
                        read_until(&mut s, &mut buf, b"0\r\n\r\n").await;
                    } else if let Some(n) = lower
                        .split("\r\n")
                        .find_map(|l| l.strip_prefix("content-length: "))
                    {
                        let n: usize = n.parse().unwrap();
                        while buf.len() < n {
                            let mut tmp = [0u8; 4096];
                            match s.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&tmp[..k]),
                            }
                        }
                    }
                    let _ = seen_tx.send((head, std::mem::take(&mut buf)));
                    let _ = s.write_all(OK).await;
                }
            }
        })
        .await;
        let client = client();

        // Unknown size: chunked, each frame a chunk.
        let (tx, body) = channel();
        tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
        tx.send(Ok(Bytes::from_static(b"second!"))).await.unwrap();
        drop(tx);
        let resp = within(client.request(
            Plane::Api,
            with_body("POST", &fake.url("/c?q=1"), body),
            LONG,
        ))
        .await
        .unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, sent) = within(seen.recv()).await.unwrap();
        assert!(head.starts_with("POST /c?q=1 HTTP/1.1\r\n"), "{head}");
        assert!(
            head.contains(&format!("\r\nhost: 127.0.0.1:{}\r\n", fake.addr.port())),
            "{head}"
        );
        assert!(
            head.contains("\r\ntransfer-encoding: chunked\r\n"),
            "{head}"
        );
        assert!(!head.contains("content-length"), "{head}");
        assert_eq!(sent, b"5\r\nfirst\r\n7\r\nsecond!\r\n0\r\n\r\n");

        // Known size: Content-Length, the body right behind the head.
        let resp = within(client.request(
            Plane::Api,
            with_body("PUT", &fake.url("/k"), body::full("hello")),
            LONG,
        ))
        .await
        .unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, sent) = within(seen.recv()).await.unwrap();
        assert!(head.contains("\r\ncontent-length: 5\r\n"), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert_eq!(sent, b"hello");

        // A size the body cannot tell but the request declares: that Content-Length (a
        // server that takes no chunked upload, an S3-style PUT, still gets it whole).
        let (tx, body) = channel();
        tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
        tx.send(Ok(Bytes::from_static(b"second"))).await.unwrap();
        drop(tx);
        let mut req = with_body("PUT", &fake.url("/d"), body);
        req.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("11"));
        let resp = within(client.request(Plane::Api, req, LONG)).await.unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, sent) = within(seen.recv()).await.unwrap();
        assert_eq!(head.matches("content-length: 11\r\n").count(), 1, "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert_eq!(sent, b"firstsecond");

        // No body: nothing for GET, a zero length for POST; a Host of the caller's own.
        let mut req = get(&fake.url("/"));
        req.headers_mut()
            .insert(HOST, HeaderValue::from_static("example.test"));
        let resp = within(client.request(Plane::Api, req, LONG)).await.unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, _) = within(seen.recv()).await.unwrap();
        assert!(!head.contains("content-length"), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert_eq!(head.matches("host: ").count(), 1, "{head}");
        assert!(head.contains("\r\nhost: example.test\r\n"), "{head}");
        let resp = within(client.request(
            Plane::Api,
            with_body("POST", &fake.url("/"), body::empty()),
            LONG,
        ))
        .await
        .unwrap();
        assert_eq!(text(resp).await, "ok");
        let (head, _) = within(seen.recv()).await.unwrap();
        assert!(head.contains("\r\ncontent-length: 0\r\n"), "{head}");
        assert_eq!(fake.accepts(), 1);
    }

    #[test]
    fn host_header_omits_only_the_default_port() {
        let parts = |authority: &str, tls: bool| {
            let parsed: Authority = authority.parse().unwrap();
            let (host, port, header) = authority_parts(authority, tls);
            // The same host and port as the `http` crate reads.
            assert_eq!(host, parsed.host(), "{authority}");
            let default = if tls { 443 } else { 80 };
            assert_eq!(port, parsed.port_u16().unwrap_or(default), "{authority}");
            header.to_string()
        };
        assert_eq!(parts("example.com", false), "example.com");
        assert_eq!(parts("example.com:80", false), "example.com");
        assert_eq!(parts("example.com:443", true), "example.com");
        assert_eq!(parts("example.com:443", false), "example.com:443");
        assert_eq!(parts("example.com:80", true), "example.com:80");
        assert_eq!(parts("user:pw@example.com:8080", false), "example.com:8080");
        assert_eq!(parts("[::1]", true), "[::1]");
        assert_eq!(parts("[::1]:443", true), "[::1]");
        assert_eq!(parts("[::1]:8080", false), "[::1]:8080");
        assert_eq!(parts("example.com:", false), "example.com");
        assert_eq!(parts("example.com:99999", false), "example.com");
        assert_eq!(parts("10.0.0.1:0080", false), "10.0.0.1");
        // All digits and no colon: a name (a decimal IPv4 address), not a port.
        assert_eq!(parts("2130706433", false), "2130706433");
        assert_eq!(
            parts("49983-isb-1.localhost:9443", true),
            "49983-isb-1.localhost:9443"
        );
    }

    #[tokio::test]
    async fn a_broken_request_body_is_the_clients_fault() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            let _ = read_head(&mut s, &mut buf).await;
            let _ = s.read_to_end(&mut buf).await;
        })
        .await;
        let (tx, body) = channel();
        tx.send(Ok(Bytes::from_static(b"some"))).await.unwrap();
        tx.send(Err("the client went away".into())).await.unwrap();
        let e = within(client().request(Plane::Api, with_body("POST", &fake.url("/"), body), LONG))
            .await
            .unwrap_err();
        assert!(e.is_client_body(), "{e:?}");
    }

    /// hyper's client (an upgrade goes through it) fails as the pool does, and its failures
    /// are described and counted the same way: refused, reset, closed before the answer,
    /// and an answer that is not HTTP.
    #[tokio::test]
    async fn hypers_client_failures_are_described_and_counted_like_the_pools_own() {
        let fake = Fake::start(|mut s, _| async move {
            let mut buf = Vec::new();
            let Some(head) = read_head(&mut s, &mut buf).await else {
                return;
            };
            if head.starts_with("GET /reset ") {
                let _ = s.set_zero_linger();
            } else if head.starts_with("GET /garbage ") {
                let _ = s.write_all(b"SMTP ready\r\n\r\n").await;
                let _ = s.shutdown().await;
            }
            // `/close`: closed with no answer.
        })
        .await;
        let cases = [
            (
                "http://127.0.0.1:9/".to_string(),
                FailKind::Connect,
                "connect refused",
            ),
            (fake.url("/reset"), FailKind::Reset, "connection reset"),
            (
                fake.url("/close"),
                FailKind::Reset,
                "connection closed early",
            ),
            (
                fake.url("/garbage"),
                FailKind::Protocol,
                "upstream connection failed: ",
            ),
        ];
        let client = client();
        for (url, kind, reason) in cases {
            let e = within(client.request(Plane::Api, upgrade(&url), LONG))
                .await
                .unwrap_err();
            assert!(matches!(e, UpstreamError::Legacy(_)), "{url}: {e:?}");
            assert_eq!(e.kind(), kind, "{url}: {e:?}");
            assert!(e.describe().starts_with(reason), "{url}: {}", e.describe());
        }
        // A connection that was set up and then timed out (keep-alive probes unanswered).
        assert_eq!(forward::io_kind(io::ErrorKind::TimedOut), FailKind::Timeout);
    }

    /// An upstream that resets the connection, at the TLS handshake or after the request,
    /// is a `reset` with the same words on the pool's connections as on hyper's: not a TLS
    /// failure, as no certificate or protocol was refused.
    #[tokio::test]
    async fn a_reset_is_a_reset_on_the_pools_connections_too() {
        let fake = Fake::start(|mut s, _| async move {
            // A ClientHello or a request head: either way, something was sent.
            let mut first = [0u8; 1];
            let _ = s.read(&mut first).await;
            let _ = s.set_zero_linger();
        })
        .await;
        let tls = tls_pair();
        let clients = [
            (client(), "http"),
            (client(), "https"),
            (negotiating(&tls), "https"),
        ];
        for (client, scheme) in clients {
            let url = format!("{scheme}://{}/reset", fake.addr);
            let e = within(client.request(Plane::Api, get(&url), LONG))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), FailKind::Reset, "{url}: {e:?}");
            assert_eq!(e.describe(), "connection reset", "{url}: {e:?}");
        }
    }

    /// A connect that runs out of time waiting for its name says so, not "connect timed
    /// out": the DNS server stopped answering, not the upstream.
    #[tokio::test]
    async fn a_connect_waiting_for_its_name_says_the_look_up_timed_out() {
        let client = |resolver| {
            Upstream::new(
                config(rustls::RootCertStore::empty()),
                Versions::Http1,
                Duration::from_millis(300),
                LONG,
                None,
                Slots::unlimited(),
                resolver,
            )
        };
        let stalled = client(crate::resolve::stalled());
        let e = within(stalled.request(Plane::Api, get("http://stalled-p.test/"), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Timeout, "{e:?}");
        assert_eq!(e.describe(), "name look-up timed out");
        // Looked up, then a TLS handshake that never answers: its name was no part of it.
        let silent = Fake::start(|s, _| async move {
            let _held = s;
            std::future::pending::<()>().await
        })
        .await;
        let url = format!("https://answered-p.test:{}/", silent.addr.port());
        let answered = client(crate::resolve::answering());
        let e = within(answered.request(Plane::Api, get(&url), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.describe(), "connect timed out");
    }

    #[tokio::test]
    async fn connection_refused_is_a_connect_error() {
        // The discard port, which nothing serves, as the integration tests'
        // `support::refused_addr`: a port bound and released here could be taken by a
        // concurrent test's listener before the connect.
        let addr = "127.0.0.1:9";
        let e = within(client().request(Plane::Api, get(&format!("http://{addr}/")), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Connect, "{e:?}");
        assert_eq!(e.describe(), "connect refused");
        assert!(!e.is_client_body());
    }

    struct Tls {
        ca: rustls_pki_types::CertificateDer<'static>,
        server: Arc<rustls::ServerConfig>,
    }

    fn tls_pair() -> Tls {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], key)
        .unwrap();
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Tls {
            ca: ca.der().clone(),
            server: Arc::new(server),
        }
    }

    async fn tls_fake(tls: &Tls) -> Fake {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
        Fake::start(move |s, _| {
            let acceptor = acceptor.clone();
            async move {
                let Ok(mut s) = acceptor.accept(s).await else {
                    return;
                };
                let (_, session) = s.get_ref();
                let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
                let sni = session.server_name().map(str::to_string);
                let mut buf = Vec::new();
                while read_head(&mut s, &mut buf).await.is_some() {
                    let body = format!(
                        "{:?} {:?}",
                        sni,
                        alpn.as_deref().map(String::from_utf8_lossy)
                    );
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            }
        })
        .await
    }

    /// An HTTP/1.1-only TLS server answering each request head with `answer(head)`.
    async fn tls_answering(tls: &Tls, answer: fn(&str) -> Vec<u8>) -> Fake {
        let mut server = (*tls.server).clone();
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        Fake::start(move |s, _| {
            let acceptor = acceptor.clone();
            async move {
                if let Ok(s) = acceptor.accept(s).await {
                    answer_each(s, answer).await;
                }
            }
        })
        .await
    }

    /// A client trusting `tls`'s CA whose `https` requests go to hyper's client.
    fn negotiating(tls: &Tls) -> Upstream {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(tls.ca.clone()).unwrap();
        Upstream::new(
            config(roots),
            Versions::Negotiate,
            Duration::from_secs(5),
            LONG,
            None,
            Slots::unlimited(),
            upstream::LocalResolver::new(upstream::Names::Own),
        )
    }

    /// An `https` origin that answers hyper's client in HTTP/1.1 is the pool's from then
    /// on (for `Http1Origins::FOR` at a time): hyper-util's HTTP/1 pool finishes connects
    /// nobody waits for any more, each holding a slot. Its first connection stays with
    /// hyper-util.
    #[tokio::test]
    async fn an_origin_that_negotiated_http1_goes_to_the_pool() {
        let tls = tls_pair();
        let mut h1_only = (*tls.server).clone();
        h1_only.alpn_protocols = vec![b"http/1.1".to_vec()];
        let fake = tls_fake(&Tls {
            ca: tls.ca.clone(),
            server: Arc::new(h1_only),
        })
        .await;
        let url = format!("https://localhost:{}/", fake.addr.port());
        let client = negotiating(&tls);
        for _ in 0..3 {
            let resp = within(client.request(Plane::Api, get(&url), LONG)).await;
            assert_eq!(
                text(resp.unwrap()).await,
                r#"Some("localhost") Some("http/1.1")"#
            );
        }
        assert_eq!(
            fake.accepts(),
            2,
            "hyper-util's connection, then the pool's, kept"
        );
        let other = format!("https://127.0.0.1:{}/", fake.addr.port());
        let now = Instant::now();
        assert!(client.http1.has(&url.parse().unwrap(), now));
        assert!(!client.http1.has(&other.parse().unwrap(), now), "by origin");
    }

    /// A remembered origin whose time is up and that answers the request asking again in
    /// HTTP/2 is hyper-util's again.
    #[tokio::test]
    async fn an_origin_that_answers_in_http2_again_is_forgotten() {
        let tls = tls_pair();
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
        let fake = Fake::start(move |s, _| {
            let acceptor = acceptor.clone();
            async move {
                let Ok(s) = acceptor.accept(s).await else {
                    return;
                };
                let answer = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(Response::new(body::full("h2")))
                });
                let h2 =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                let _ = h2
                    .serve_connection(hyper_util::rt::TokioIo::new(s), answer)
                    .await;
            }
        })
        .await;
        let url = format!("https://localhost:{}/", fake.addr.port());
        let client = negotiating(&tls);
        client.http1.add(&url.parse().unwrap(), Instant::now());
        // Its time is up.
        client.http1.list.write().unwrap()[0].1 = Instant::now();
        let resp = within(client.request(Plane::Api, get(&url), LONG))
            .await
            .unwrap();
        assert_eq!(resp.version(), Version::HTTP_2);
        assert_eq!(text(resp).await, "h2");
        assert!(client.http1.list.read().unwrap().is_empty());
    }

    /// An origin's HTTP/1.1 holds `Http1Origins::FOR`; then one request in each `ASKING`
    /// goes to hyper-util's client again and the others to the pool, until an answer
    /// renews it (HTTP/1.1) or ends it (HTTP/2). When the list is full, expired origins
    /// make room.
    #[test]
    fn remembered_origins_are_asked_again_one_request_at_a_time() {
        let origins = Http1Origins::default();
        let uri = |host: &str| -> http::Uri { format!("https://{host}/").parse().unwrap() };
        let t0 = Instant::now();
        assert!(!origins.has(&uri("a:443"), t0));
        origins.add(&uri("a:443"), t0);
        assert!(origins.has(&uri("a:443"), t0));
        assert!(!origins.has(&uri("b:443"), t0), "by origin");
        assert!(!origins.has(&uri("a:8443"), t0), "by origin");

        let due = t0 + Http1Origins::FOR;
        assert!(!origins.has(&uri("a:443"), due), "one request asks again");
        assert!(
            origins.has(&uri("a:443"), due),
            "the others keep to the pool"
        );
        let later = due + Http1Origins::ASKING;
        assert!(
            !origins.has(&uri("a:443"), later),
            "no answer yet: another asks"
        );
        origins.add(&uri("a:443"), later);
        assert!(origins.has(&uri("a:443"), later + Http1Origins::ASKING));
        assert_eq!(
            origins.list.read().unwrap().len(),
            1,
            "renewed, not added again"
        );
        origins.remove(&uri("a:443"));
        assert!(
            !origins.has(&uri("a:443"), later),
            "an HTTP/2 answer ends it"
        );

        for i in 0..Http1Origins::MAX {
            origins.add(&uri(&format!("h{i}:443")), t0);
        }
        origins.add(&uri("new:443"), t0);
        assert!(!origins.has(&uri("new:443"), t0), "full");
        origins.add(&uri("new:443"), due);
        assert!(origins.has(&uri("new:443"), due), "expired ones make room");
    }

    #[tokio::test]
    async fn tls_with_a_trusted_ca_works_and_an_untrusted_one_is_a_tls_error() {
        let tls = tls_pair();
        let fake = tls_fake(&tls).await;
        let url = format!("https://localhost:{}/", fake.addr.port());

        let mut roots = rustls::RootCertStore::empty();
        roots.add(tls.ca.clone()).unwrap();
        let trusting = Upstream::new(
            config(roots),
            Versions::Http1,
            Duration::from_secs(5),
            LONG,
            None,
            Slots::unlimited(),
            upstream::LocalResolver::new(upstream::Names::Own),
        );
        for _ in 0..2 {
            let resp = within(trusting.request(Plane::Api, get(&url), LONG))
                .await
                .unwrap();
            assert_eq!(text(resp).await, r#"Some("localhost") Some("http/1.1")"#);
        }
        assert_eq!(fake.accepts(), 1, "kept alive over TLS");

        let e = within(client().request(Plane::Api, get(&url), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Tls, "{e:?}");
        assert!(
            (e.describe()).starts_with("tls: invalid peer certificate: signed by an unknown"),
            "{}",
            e.describe()
        );
    }
}
