//! The upstream client stack, shared by the proxy and the proxy's own calls (token
//! exchange, envd token look-ups, `check`): rustls with the Mozilla and system roots plus
//! `--upstream-ca`, the TCP connector, and hyper-util's pooled client. Plain `http://`
//! upstreams work too (local OpenSandbox, tests). The proxy's own HTTP/1.1 pool
//! (`proxy::pool`) connects through [`connector`] and keeps this client for HTTP/2 and
//! upgrades.
//!
//! Names resolve through [`crate::resolve`]: `localhost` and `*.localhost` without DNS,
//! every other name through getaddrinfo, a few at once.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector, HttpInfo};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use crate::descriptors::{Slot, Slots};
use crate::error::Error;
pub use crate::resolve::{LocalResolver, LookingUp, Names};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of every upstream request and every response the proxy sends.
pub type ProxyBody = BoxBody<Bytes, BoxError>;
pub type HttpClient = Client<TimedConnect<HttpsConnector<HttpConnector<LocalResolver>>>, ProxyBody>;

/// A warning for each forward-proxy variable set in the environment, naming it, never its
/// value (it may carry a password). curl and most HTTP clients go through them; the proxy
/// does not, and behind a firewall that lets out only a forward proxy its connects just
/// time out.
pub fn unused_forward_proxies() -> Vec<String> {
    let names = ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"];
    (names.into_iter().chain(["ALL_PROXY", "all_proxy"]))
        .filter(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()))
        .map(|name| {
            format!(
                "{name} is set, and not used: abx-proxy connects to its upstreams directly \
                 (where only a forward proxy reaches them, connects time out)"
            )
        })
        .collect()
}

/// Which HTTP versions to offer upstream over TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Versions {
    /// HTTP/2 when the server's ALPN offers it, else HTTP/1.1 (control plane).
    Negotiate,
    /// HTTP/1.1 only (envd: long Connect streams and file downloads, see SPEC §4).
    Http1,
}

/// PEM text without the UTF-8 byte-order mark an editor may have put before it (Notepad,
/// PowerShell 5): the parser found no section after one, where openssl and curl read the
/// file.
pub(crate) fn without_bom(pem: &[u8]) -> &[u8] {
    pem.strip_prefix(b"\xef\xbb\xbf").unwrap_or(pem)
}

/// Why a PEM file could not be read, in words: the parser's own text shows the expected
/// end line as a list of byte values (`missing section end marker: [45, 45, …]`), which
/// is what a file caught half-written during a certificate rotation prints.
pub(crate) fn pem_reason(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error as Pem;
    match e {
        Pem::MissingSectionEnd { end_marker } => format!(
            "a PEM section has no end line (-----END {}-----): the file is cut short",
            String::from_utf8_lossy(end_marker)
        ),
        Pem::IllegalSectionStart { .. } => "a malformed PEM `-----BEGIN` line".into(),
        Pem::Base64Decode(_) => "a PEM section that is not valid base64".into(),
        e => e.to_string(),
    }
}

/// The trust store: Mozilla roots, the system's, and any extra CA file.
pub fn tls_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, Error> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    // A system store that fails to load is not fatal: the Mozilla roots still apply.
    let native = rustls_native_certs::load_native_certs();
    let _ = roots.add_parsable_certificates(native.certs);
    if let Some(path) = extra_ca {
        let bad = |reason: String| Error::ReadFile {
            path: path.display().to_string(),
            reason,
        };
        // Bounded, as every file the proxy reads: `/dev/zero` given here grew the process
        // by gigabytes. A directory is said as such; a pipe is read once, at the start (it
        // waits for its writer), as a key file's is.
        let pem = crate::watched::read_up_to(path, crate::watched::Limit::Bundle).map_err(|e| {
            crate::watched::unread("--upstream-ca", path, crate::watched::reason(&e))
        })?;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(without_bom(&pem))
            .collect::<Result<_, _>>()
            .map_err(|e| bad(pem_reason(&e)))?;
        if certs.is_empty() {
            return Err(bad("no PEM certificate in file".into()));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| bad(e.to_string()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::InvalidSetting {
            key: "tls".into(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

/// TCP connections to upstreams: names through [`LocalResolver`], `https` URIs accepted
/// (TLS is layered above), TCP_NODELAY, keep-alive probes after 60 s idle.
pub fn connector(
    connect_timeout: Duration,
    resolver: LocalResolver,
) -> HttpConnector<LocalResolver> {
    let mut http = HttpConnector::new_with_resolver(resolver);
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    http
}

/// Idle HTTP/1.1 connections hyper-util's pool keeps per origin. An HTTP/2 origin has
/// one connection; an `https` origin that negotiated HTTP/1.1 is the proxy's own pool's
/// after its first answer (`proxy::pool`), so these serve only the requests made before
/// it, and would otherwise hold upstream connection slots (`crate::descriptors`) that no
/// waiting request can take from them, for the 90 s they stay idle (`proxy::pool::IDLE_TIMEOUT`).
pub const MAX_IDLE_HTTP1: usize = 8;

/// The largest HTTP/2 answer head accepted, in HTTP/2's measure (RFC 9113 §6.5.2: names
/// and values, plus 32 a field): the 64 KiB the proxy's HTTP/1.1 pool takes. h2's default
/// is 16 KiB, so a head an HTTP/1.1 control plane passed was 502 over HTTP/2.
const MAX_ANSWER_HEAD: u32 = crate::proxy::pool::codec::MAX_HEAD as u32;

/// The longest wait between HTTP/2 keep-alive pings, and for their answer.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(20);

/// The interval of HTTP/2 keep-alive pings, and how long one may go unanswered, for a
/// client whose requests wait `request_timeout` for an answer: half of it, so that a
/// connection that went silent is closed about when the request on it times out, and the
/// next one opens a new connection.
pub(crate) fn ping_interval(request_timeout: Duration) -> Duration {
    (request_timeout / 2).clamp(Duration::from_millis(1), MAX_PING_INTERVAL)
}

/// What one HTTP/2 stream may bring in that its client has not read yet: 1 MiB, so that a
/// control-plane answer (JSON; a long list some hundreds of KiB) comes in whole and frees
/// its stream even when its client does not read it. Smaller (128 KiB), one client leaving
/// 100 answers of 150 KB unread held every stream the control plane allows a connection.
const STREAM_WINDOW: u32 = 1024 * 1024;

/// What a whole HTTP/2 connection may: 32 streams' windows. Every client's control-plane
/// requests share one connection, and what a client leaves unread holds the connection's
/// window as well as its stream's: with hyper's windows (2 MiB a stream, 5 MiB the
/// connection) three clients not reading large answers stalled every other answer on it,
/// creates and token look-ups included, until `--idle-timeout` cut them. It now takes 32,
/// and what they hold stays bounded (a connection window of 1 GiB let 300 stalled streams
/// hold 344 MB).
const CONNECTION_WINDOW: u32 = 32 * STREAM_WINDOW;

/// A pooled client over `tls`, for requests that wait `request_timeout` for an answer.
///
/// An HTTP/2 connection with requests open is pinged (see [`ping_interval`]): one that
/// stopped answering without closing (a stalled load balancer, a half-open NAT mapping)
/// was otherwise kept and reused, and every request on it timed out, for as long as the
/// proxy ran. An idle connection is not pinged (servers may take pings without requests
/// for abuse, and an idle proxy stays asleep): the next request finds a dead one out.
pub fn client(
    tls: rustls::ClientConfig,
    versions: Versions,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> HttpClient {
    counted_client(
        tls,
        versions,
        connect_timeout,
        request_timeout,
        Slots::unlimited(),
        MAX_IDLE_HTTP1,
        LocalResolver::new(Names::Own),
    )
}

/// [`client`], its connections counted in `slots` (the proxy's own upstream clients), at
/// most `max_idle` of them kept idle per origin, its host names looked up by `resolver`.
pub fn counted_client(
    tls: rustls::ClientConfig,
    versions: Versions,
    connect_timeout: Duration,
    request_timeout: Duration,
    slots: Arc<Slots>,
    max_idle: usize,
    resolver: LocalResolver,
) -> HttpClient {
    let http = connector(connect_timeout, resolver);
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let https = match versions {
        Versions::Negotiate => builder.enable_http1().enable_http2().wrap_connector(http),
        Versions::Http1 => builder.enable_http1().wrap_connector(http),
    };
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(crate::proxy::pool::IDLE_TIMEOUT)
        .pool_max_idle_per_host(max_idle)
        // Idle ages that count the machine's sleeps (see `crate::clock`).
        .pool_timer(crate::clock::AwakeTimer::default())
        .timer(hyper_util::rt::TokioTimer::new())
        .http2_keep_alive_interval(ping_interval(request_timeout))
        .http2_keep_alive_timeout(ping_interval(request_timeout))
        .http2_max_header_list_size(MAX_ANSWER_HEAD)
        // An HTTP/1 answer's head is held to the pool's limit too (hyper's own is ~400 KB):
        // a TLS origin's first answer, and upgrades, come this way.
        .http1_max_buf_size(MAX_ANSWER_HEAD as usize)
        .http1_max_headers(crate::proxy::pool::codec::MAX_HEADERS)
        .http2_initial_stream_window_size(STREAM_WINDOW)
        .http2_initial_connection_window_size(CONNECTION_WINDOW)
        .build(TimedConnect {
            inner: https,
            timeout: connect_timeout,
            slots,
        })
}

/// The error of a connection set-up that took longer than `--connect-timeout`;
/// `looking_up`: while it waited for its name (see [`LookingUp`]).
pub fn connect_timed_out(looking_up: bool) -> BoxError {
    use std::io::{Error, ErrorKind::TimedOut};
    Box::new(if looking_up {
        Error::new(TimedOut, LookupTimedOut)
    } else {
        Error::new(TimedOut, "connect timed out")
    })
}

/// A connect out of time while its name was being looked up.
#[derive(Debug, thiserror::Error)]
#[error("name look-up timed out")]
struct LookupTimedOut;

/// How a connect that timed out is said: "name look-up timed out" when `e` holds a
/// [`LookupTimedOut`], else "connect timed out".
pub fn timed_out_words(e: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut next = Some(e);
    while let Some(e) = next {
        let io = e.downcast_ref::<std::io::Error>();
        if io
            .and_then(|io| io.get_ref())
            .is_some_and(|w| w.is::<LookupTimedOut>())
        {
            return "name look-up timed out";
        }
        next = e.source();
    }
    "connect timed out"
}

/// The proxy's own listener, once bound (a `unix:` one cannot be dialled): an upstream
/// connection that reaches it is a loop.
static OWN_LISTENER: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

/// Says where the proxy listens, for [`not_own_listener`].
pub fn listening_on(addr: SocketAddr) {
    let _ = OWN_LISTENER.set(addr);
}

/// Refuses a connection from `local` to `peer` that reached the proxy's own listener: one
/// on this host (loopback, or the connection's own address) at the listener's port, on
/// its address, or on any when it listens on all. The settings refuse the spellings of this
/// host they can read (`localhost`, `127.0.0.1`, `[::]`); the system's resolver reads more
/// (`127.1`, `0x7f000001`, `0`, the machine's own name), and one request through such a
/// loop (with `--allow-remote`) came back as thousands within seconds, each holding a
/// connection until `--upstream-timeout`.
pub fn not_own_listener(peer: SocketAddr, local: SocketAddr) -> Result<(), BoxError> {
    match OWN_LISTENER.get() {
        Some(own) if reaches(*own, peer, local) => Err(std::io::Error::other(format!(
            "{peer} is this proxy's own listener: each request would come back to it"
        ))
        .into()),
        _ => Ok(()),
    }
}

/// Whether a connection from `local` to `peer` reached a listener bound at `own`.
fn reaches(own: SocketAddr, peer: SocketAddr, local: SocketAddr) -> bool {
    let ip = peer.ip().to_canonical();
    let this_host = ip.is_loopback() || ip == local.ip().to_canonical();
    // `0.0.0.0` takes IPv4 only; `[::]` both (`[::1]` beside a `0.0.0.0` listener was
    // another server).
    let any = own.ip().is_unspecified() && (own.is_ipv6() || ip.is_ipv4());
    let listened = any || own.ip().to_canonical() == ip;
    this_host && listened && own.port() == peer.port()
}

/// A connector held to `--connect-timeout` as a whole: name resolution, TCP connect and
/// TLS handshake. `HttpConnector`'s own timeout covers only the TCP connect, so an
/// upstream that accepted and then never answered the ClientHello held a request until
/// `--upstream-timeout`. Each connection holds a [`Slot`] (waited for up to the same
/// timeout, before the connect) until it closes.
#[derive(Clone)]
pub struct TimedConnect<C> {
    inner: C,
    timeout: Duration,
    slots: Arc<Slots>,
}

impl<C> tower_service::Service<http::Uri> for TimedConnect<C>
where
    C: tower_service::Service<http::Uri>,
    C::Response: Connection,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = Slotted<C::Response>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.inner.call(uri);
        let timeout = self.timeout;
        let slots = self.slots.clone();
        Box::pin(async move {
            let slot = slots.take(timeout).await?;
            let looking = LookingUp::default();
            match tokio::time::timeout(timeout, looking.watch(connect)).await {
                Ok(conn) => {
                    let io = conn.map_err(Into::into)?;
                    let mut extras = http::Extensions::new();
                    io.connected().get_extras(&mut extras);
                    if let Some(ends) = extras.get::<HttpInfo>() {
                        not_own_listener(ends.remote_addr(), ends.local_addr())?;
                    }
                    Ok(Slotted { io, _slot: slot })
                }
                Err(_) => Err(connect_timed_out(looking.now())),
            }
        })
    }
}

/// An upstream connection and its [`Slot`], given back as hyper drops the connection (or,
/// for an upgrade, as the tunnel ends).
pub struct Slotted<T> {
    io: T,
    _slot: Slot,
}

impl<T: Connection> Connection for Slotted<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for Slotted<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for Slotted<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection reaches the proxy's own listener when its peer is on this host at the
    /// listener's port and address (any address for one that listens on all); another
    /// host's, another port or another loopback address with a listener of its own does
    /// not. (Port 1: no test listens there. The listener is process-wide, set once.)
    #[test]
    fn a_connection_to_the_proxys_own_listener_is_known() {
        let at = |s: &str| s.parse::<SocketAddr>().expect("address");
        let refused = |peer: &str, local: &str| not_own_listener(at(peer), at(local)).is_err();
        assert!(
            !refused("127.0.0.1:1", "127.0.0.1:40000"),
            "before it listens"
        );
        listening_on(at("127.0.0.1:1"));
        let looped = [
            ("127.0.0.1:1", "127.0.0.1:40000"),
            ("[::ffff:127.0.0.1]:1", "[::ffff:127.0.0.1]:40000"),
        ];
        for (peer, local) in looped {
            assert!(refused(peer, local), "{peer}");
        }
        let elsewhere = [
            ("127.0.0.1:2", "127.0.0.1:40000"),
            ("127.0.0.2:1", "127.0.0.1:40000"),
            ("10.0.0.5:1", "10.0.0.4:40000"),
            ("[::1]:1", "[::1]:40000"),
        ];
        for (peer, local) in elsewhere {
            assert!(!refused(peer, local), "{peer}");
        }
        // Listening on all addresses: IPv4's `0.0.0.0` takes no IPv6 peer, `[::]` both.
        let all4 = at("0.0.0.0:1");
        assert!(reaches(all4, at("127.0.0.1:1"), at("127.0.0.1:40000")));
        assert!(reaches(all4, at("10.0.0.4:1"), at("10.0.0.4:40000")));
        assert!(!reaches(all4, at("[::1]:1"), at("[::1]:40000")));
        let all6 = at("[::]:1");
        assert!(reaches(all6, at("[::1]:1"), at("[::1]:40000")));
        assert!(reaches(all6, at("127.0.0.1:1"), at("127.0.0.1:40000")));
        assert!(!reaches(all6, at("10.0.0.5:1"), at("10.0.0.4:40000")));
        let said = not_own_listener(at("127.0.0.1:1"), at("127.0.0.1:40000"));
        let said = said.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            said.contains("127.0.0.1:1 is this proxy's own listener"),
            "{said}"
        );
    }

    /// A connect that runs out of time waiting for its name says so; one whose name was
    /// answered says "connect timed out" (the upstream's network, not DNS). Through
    /// hyper-util's client, as the control plane, the token exchange and `check` ask.
    #[tokio::test]
    async fn a_connect_out_of_time_says_whether_it_waited_for_its_name() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let tls = tls_config(None).expect("tls");
        let timeout = Duration::from_millis(300);
        let client = |resolver| {
            counted_client(
                tls.clone(),
                Versions::Negotiate,
                timeout,
                Duration::from_secs(60),
                Slots::unlimited(),
                MAX_IDLE_HTTP1,
                resolver,
            )
        };
        let get = |url: &str| {
            http::Request::get(url)
                .body(crate::proxy::body::empty())
                .unwrap()
        };
        let cases = [
            (
                crate::resolve::stalled(),
                "http://stalled-h.test/",
                "name look-up timed out",
            ),
            // Looked up, then a TLS handshake nobody answers.
            (
                crate::resolve::answering(),
                "https://answered-h.test",
                "connect timed out",
            ),
        ];
        for (resolver, url, said) in cases {
            let url = if url.starts_with("https") {
                format!("{url}:{port}/")
            } else {
                url.into()
            };
            let e = client(resolver).request(get(&url)).await.unwrap_err();
            assert_eq!(crate::proxy::failure::describe(&e), said, "{url}");
        }
        drop(silent);
    }

    /// Pings every half of the request timeout, at most every 20 s and at least every
    /// millisecond.
    #[test]
    fn ping_interval_is_half_the_request_timeout_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(ping_interval(s(10)), s(5));
        assert_eq!(ping_interval(s(40)), s(20));
        assert_eq!(ping_interval(s(300)), MAX_PING_INTERVAL);
        assert_eq!(ping_interval(Duration::ZERO), Duration::from_millis(1));
    }
}
