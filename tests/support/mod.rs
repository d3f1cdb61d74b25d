//! Shared helpers for the proxy integration tests: a test PKI (CA + server certificate from
//! `rcgen`), a TLS hyper upstream that records what it received and answers through a
//! closure, the real `abx-proxy` binary spawned with a cleared environment, and small HTTP
//! clients (hyper over TCP or a unix socket, and raw bytes over a `TcpStream`).
//!
//! Synchronisation is by events only: the proxy's "listening" log line, requests seen by the
//! upstream, channels the tests release. [`GUARD`] bounds every wait so a broken proxy fails
//! a test instead of hanging it; it never lets time pass on purpose.
//!
//! Include it from a test crate with `mod support;`.
#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// The longest any single wait may take before the test fails.
pub const GUARD: Duration = Duration::from_secs(30);

/// The bound on what a setting far below its default should cause (a close at a 1 s
/// `--header-timeout`): well above the setting, for a loaded machine, and below the 30 s
/// defaults, which [`GUARD`], as long, would let through, so a flag going unapplied fails.
pub const BOUND: Duration = Duration::from_secs(20);

/// The pause between two looks at state that no event announces (a gauge, a socket
/// queue): short against any wait, and the poller leaves the CPU to the proxy it watches.
pub const POLL: Duration = Duration::from_millis(10);

/// Access lines, in a proxy's stderr, for heads cut by `--header-timeout` (408).
pub fn timed_out_heads(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("abx_proxy::access") && l.contains(" status=408 "))
        .count()
}

/// A [`POLL`] ticker; its first tick is at once.
pub fn poll_ticker() -> tokio::time::Interval {
    let mut every = tokio::time::interval(POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every
}

/// The real key the proxy attaches. Distinctive, so a leak into a log or a body is found.
pub const API_KEY: &str = "sk-abx-live-7Q4mZ2xK9pW3rT8vB5nL1cY6";

/// Streaming tests move data in pieces of this size.
pub const CHUNK: usize = 64 * 1024;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type TestBody = BoxBody<Bytes, BoxError>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `fut` within [`GUARD`], or a test failure naming `what`.
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(GUARD, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {GUARD:?}: {what}"),
    }
}

/// Runs `cmd` to its exit off the runtime (which may be serving its fakes), with its
/// stdout and stderr. Bounded by [`GUARD`]: a process still running then (a proxy that
/// started where it should have refused) is killed, not left behind the test.
pub async fn output_within(cmd: Command, what: &str) -> std::process::Output {
    run_within(cmd, None, what).await
}

/// [`output_within`], with `input` as the process's whole stdin.
pub async fn output_within_input(cmd: Command, input: Vec<u8>, what: &str) -> std::process::Output {
    run_within(cmd, Some(input), what).await
}

async fn run_within(mut cmd: Command, input: Option<Vec<u8>>, what: &str) -> std::process::Output {
    // As with `Command::output`, no stdin unless given: a child reading the test
    // runner's stdin could wait on a terminal until the guard.
    let stdin = if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let mut child = cmd
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let pid = child.id();
    if let (Some(mut pipe), Some(input)) = (child.stdin.take(), input) {
        // Its own thread: a child that writes a lot before it has read everything would
        // otherwise block on its stdout while this blocks on its stdin. The write fails,
        // ending the thread, once the child exits.
        std::thread::spawn(move || {
            use std::io::Write;
            let _ = pipe.write_all(&input);
        });
    }
    let waited = tokio::time::timeout(
        GUARD,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    match waited {
        Ok(joined) => joined
            .expect("join")
            .unwrap_or_else(|e| panic!("wait for {what}: {e}")),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("timed out after {GUARD:?}: {what}");
        }
    }
}

/// Sends process `pid` a signal by name (`TERM`, `INT`, `HUP`) with kill(1).
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

/// `child`'s exit, waited for off the runtime. `None` past [`GUARD`], the child killed
/// then rather than left behind the test.
async fn exit_within(mut child: Child) -> Option<ExitStatus> {
    let pid = child.id();
    let waited =
        tokio::time::timeout(GUARD, tokio::task::spawn_blocking(move || child.wait())).await;
    match waited {
        Ok(joined) => Some(joined.expect("join").expect("wait for a child process")),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            None
        }
    }
}

/// A process a test started with its own stdio: killed and reaped when dropped, so a test
/// that fails half-way leaves nothing running.
pub struct Spawned {
    child: Option<Child>,
    pub pid: u32,
}

impl Spawned {
    pub fn spawn(cmd: &mut Command, what: &str) -> Spawned {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let pid = child.id();
        Spawned {
            child: Some(child),
            pid,
        }
    }

    /// Sends a signal by name (`TERM`, `INT`, `HUP`) with kill(1).
    pub fn signal(&self, name: &str) {
        signal(self.pid, name);
    }

    /// Its standard output, which the command must have piped.
    pub fn take_stdout(&mut self) -> std::process::ChildStdout {
        let child = self.child.as_mut().expect("already reaped");
        child.stdout.take().expect("stdout piped")
    }

    /// Its exit status if it has exited, without waiting.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("already reaped");
        child.try_wait().expect("try_wait")
    }

    /// Its exit within [`GUARD`], or a test failure naming `what`.
    pub async fn exit(&mut self, what: &str) -> ExitStatus {
        let child = self.child.take().expect("already reaped");
        exit_within(child)
            .await
            .unwrap_or_else(|| panic!("timed out after {GUARD:?}: {what}"))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Bodies
// ---------------------------------------------------------------------------------------

pub fn full(bytes: impl Into<Bytes>) -> TestBody {
    Full::new(bytes.into()).map_err(|e| match e {}).boxed()
}

pub fn empty() -> TestBody {
    Empty::new().map_err(|e| match e {}).boxed()
}

pub fn boxed<B>(body: B) -> TestBody
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

/// Every data frame of `body`, concatenated.
pub async fn collect(body: Incoming) -> Bytes {
    within("reading a body", body.collect())
        .await
        .expect("body stream failed")
        .to_bytes()
}

/// A body fed by a channel: each message is one frame; dropping the sender ends it.
pub struct ChannelBody(pub mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

/// SHA-256, streaming. ring's implementation (reached through the rustls provider) rather
/// than `sha2`: in an unoptimised test build `sha2` manages ~15 MB/s, ring's assembly ~600.
pub struct Sha256(Box<dyn rustls::crypto::hash::Context>);

impl Sha256 {
    pub fn new() -> Self {
        use rustls::crypto::hash::HashAlgorithm;
        let hash = rustls::crypto::ring::default_provider()
            .cipher_suites
            .iter()
            .find_map(|s| match s {
                rustls::SupportedCipherSuite::Tls13(t)
                    if t.common.hash_provider.algorithm() == HashAlgorithm::SHA256 =>
                {
                    Some(t.common.hash_provider)
                }
                _ => None,
            })
            .expect("ring offers a SHA-256 suite");
        Sha256(hash.start())
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    pub fn finalize(self) -> [u8; 32] {
        self.0
            .finish()
            .as_ref()
            .try_into()
            .expect("SHA-256 is 32 bytes")
    }
}

impl Default for Sha256 {
    fn default() -> Self {
        Sha256::new()
    }
}

/// One data frame, then — once `die` fires or is dropped — a failure: a peer that dies
/// mid-stream, at a moment the test chooses.
pub struct AbortingBody {
    pub first: Option<Bytes>,
    pub die: oneshot::Receiver<()>,
}

impl Body for AbortingBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(b) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        Pin::new(&mut self.die)
            .poll(cx)
            .map(|_| Some(Err("the test upstream died mid-stream".into())))
    }
}

/// An upstream whose one answer is 200 with `partial`, then a failure once the returned
/// sender fires or is dropped: a download the upstream cuts short.
pub async fn cutting_upstream(pki: &Pki, proto: Proto) -> (Upstream, oneshot::Sender<()>) {
    let (cut, die) = oneshot::channel::<()>();
    let die = Arc::new(Mutex::new(Some(die)));
    let upstream = Upstream::start(pki, proto, move |_req| {
        let die = die.lock().unwrap().take().expect("one download");
        async move {
            Response::new(boxed(AbortingBody {
                first: Some(Bytes::from_static(b"partial")),
                die,
            }))
        }
    })
    .await;
    (upstream, cut)
}

/// Reads a [`cutting_upstream`]'s download as it reaches the client: `partial` first, then
/// (after `cut`) to its end. What arrived, and whether the end was an error.
pub async fn read_cut_download(
    resp: Response<Incoming>,
    cut: oneshot::Sender<()>,
) -> (Vec<u8>, bool) {
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while got.len() < b"partial".len() {
        let frame = within("the first bytes", body.frame())
            .await
            .expect("the first bytes")
            .expect("the first bytes");
        got.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    drop(cut);
    let (rest, failed) = read_to_end(body).await;
    got.extend(rest);
    (got, failed)
}

/// A body read to its end as it reaches the client: what arrived, and whether the end was
/// an error.
pub async fn read_to_end(mut body: Incoming) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let failed = within("the end of the body", async {
        loop {
            match body.frame().await {
                None => break false,
                Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap_or_default()),
                Some(Err(_)) => break true,
            }
        }
    })
    .await;
    (got, failed)
}

/// The one `abx_proxy_upstream_errors_total` series above 0 in `text` is `{plane, kind}`,
/// at 1 (the others exist from startup, at 0).
pub fn assert_one_upstream_error(text: &str, plane: &str, kind: &str) {
    let series = text
        .lines()
        .filter(|l| l.starts_with("abx_proxy_upstream_errors_total{") && !l.ends_with(" 0"))
        .count();
    let want = format!("abx_proxy_upstream_errors_total{{plane=\"{plane}\",kind=\"{kind}\"}}");
    assert_eq!(
        (series, metric(text, &want)),
        (1, Some(1.0)),
        "{want}: {text}"
    );
}

/// A seeded pseudo-random byte stream (splitmix64): the same seed gives the same bytes.
pub struct Gen(u64);

impl Gen {
    pub fn new(seed: u64) -> Self {
        Gen(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Fills `buf`; its length must be a multiple of 8.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for word in buf.chunks_exact_mut(8) {
            word.copy_from_slice(&self.next().to_le_bytes());
        }
    }
}

/// `len` generated bytes, produced [`CHUNK`] at a time and hashed as they go out; the
/// SHA-256 is sent on `done` with the last chunk. With `exact`, the length is announced
/// (Content-Length); without, HTTP/1.1 sends it chunked.
pub struct GenBody {
    gen: Gen,
    remaining: u64,
    exact: bool,
    hasher: Sha256,
    done: Option<oneshot::Sender<(u64, [u8; 32])>>,
    total: u64,
}

impl GenBody {
    pub fn new(seed: u64, len: u64, exact: bool) -> (Self, oneshot::Receiver<(u64, [u8; 32])>) {
        assert_eq!(len % 8, 0, "GenBody lengths are whole words");
        let (tx, rx) = oneshot::channel();
        let body = GenBody {
            gen: Gen::new(seed),
            remaining: len,
            exact,
            hasher: Sha256::new(),
            done: Some(tx),
            total: len,
        };
        (body, rx)
    }
}

impl Body for GenBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = self.remaining.min(CHUNK as u64) as usize;
        let mut buf = BytesMut::zeroed(n);
        self.gen.fill(&mut buf);
        self.hasher.update(&buf);
        self.remaining -= n as u64;
        if self.remaining == 0 {
            let digest = std::mem::take(&mut self.hasher).finalize();
            let total = self.total;
            if let Some(tx) = self.done.take() {
                let _ = tx.send((total, digest));
            }
        }
        Poll::Ready(Some(Ok(Frame::data(buf.freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact {
            SizeHint::with_exact(self.remaining)
        } else {
            SizeHint::default()
        }
    }
}

/// Length and SHA-256 of a body, computed frame by frame without holding it.
pub async fn hash_body<B>(mut body: B) -> (u64, [u8; 32])
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("body stream failed");
        if let Ok(data) = frame.into_data() {
            len += data.len() as u64;
            hasher.update(&data);
        }
    }
    (len, hasher.finalize())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------
// PKI
// ---------------------------------------------------------------------------------------

/// A throwaway CA and a server certificate it signed for `127.0.0.1` and `localhost`.
pub struct Pki {
    dir: tempfile::TempDir,
    pub ca_pem: PathBuf,
    chain: Vec<CertificateDer<'static>>,
    key: Vec<u8>,
    leaf_pem: String,
    key_pem: String,
}

impl Pki {
    pub fn new() -> Pki {
        Pki::with_names(&["127.0.0.1", "localhost"])
    }

    /// The server side of the upstream's TLS, offering `alpn`.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(self.chain.clone(), key)
            .expect("server config");
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server certificate and its key as PEM files, for the proxy's own listener
    /// (`--tls-cert`, `--tls-key`).
    pub fn server_pem_files(&self) -> (PathBuf, PathBuf) {
        let cert = self.dir.path().join("server.pem");
        let key = self.dir.path().join("server.key");
        std::fs::write(&cert, &self.leaf_pem).expect("write server.pem");
        std::fs::write(&key, &self.key_pem).expect("write server.key");
        (cert, key)
    }

    /// A TLS client connection to `addr` that trusts only this CA, offering `alpn`.
    pub async fn tls_connect(
        &self,
        addr: SocketAddr,
        alpn: &[&[u8]],
    ) -> tokio_rustls::client::TlsStream<TcpStream> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        let ca = std::fs::read(&self.ca_pem).expect("read ca.pem");
        for cert in CertificateDer::pem_slice_iter(&ca) {
            roots.add(cert.expect("CA PEM")).expect("add the CA");
        }
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = within("connect to the proxy", TcpStream::connect(addr))
            .await
            .expect("connect to the proxy");
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("server name");
        within("the TLS handshake", connector.connect(name, tcp))
            .await
            .expect("TLS handshake with the proxy")
    }
}

// ---------------------------------------------------------------------------------------
// The upstream
// ---------------------------------------------------------------------------------------

/// Which HTTP versions the upstream offers in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Http1,
    /// HTTP/2 preferred, HTTP/1.1 accepted.
    H2,
}

/// A request head as the upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
}

impl Seen {
    /// `Host`, or HTTP/2's `:authority`.
    pub fn host(&self) -> String {
        match self.headers.get(http::header::HOST) {
            Some(h) => h.to_str().expect("Host is text").to_string(),
            None => self
                .uri
                .authority()
                .map(|a| a.to_string())
                .unwrap_or_default(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("header is text"))
    }

    pub fn all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().expect("header is text").to_string())
            .collect()
    }

    pub fn path_and_query(&self) -> &str {
        self.uri.path_and_query().map_or("/", |pq| pq.as_str())
    }
}

type HandlerFn = dyn Fn(Request<Incoming>) -> Pin<Box<dyn Future<Output = Response<TestBody>> + Send>>
    + Send
    + Sync;

/// A TLS hyper server on 127.0.0.1 that records every request head and answers through the
/// test's closure (which gets the whole request: body, upgrades).
pub struct Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    seen_rx: mpsc::UnboundedReceiver<Seen>,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Upstream {
    pub async fn start<F, Fut>(pki: &Pki, proto: Proto, handler: F) -> Upstream
    where
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<TestBody>> + Send + 'static,
    {
        let handler: Arc<HandlerFn> = Arc::new(move |req| Box::pin(handler(req)));
        let alpn: &[&[u8]] = match proto {
            Proto::Http1 => &[b"http/1.1"],
            Proto::H2 => &[b"h2", b"http/1.1"],
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(pki.server_config(alpn));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (seen_tx, seen_rx) = mpsc::unbounded_channel();
        let connections = Arc::new(AtomicUsize::new(0));
        let task = {
            let seen = seen.clone();
            let connections = connections.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    connections.fetch_add(1, Ordering::SeqCst);
                    let acceptor = acceptor.clone();
                    let handler = handler.clone();
                    let seen = seen.clone();
                    let seen_tx = seen_tx.clone();
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(stream).await else {
                            return;
                        };
                        let service = service_fn(move |req: Request<Incoming>| {
                            let record = Seen {
                                method: req.method().clone(),
                                uri: req.uri().clone(),
                                version: req.version(),
                                headers: req.headers().clone(),
                            };
                            lock(&seen).push(record.clone());
                            let _ = seen_tx.send(record);
                            let fut = handler(req);
                            async move { Ok::<_, Infallible>(fut.await) }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection_with_upgrades(TokioIo::new(tls), service)
                            .await;
                    });
                }
            })
        };
        Upstream {
            addr,
            seen,
            seen_rx,
            connections,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The path and query of every request received so far, in order.
    pub fn paths(&self) -> Vec<String> {
        lock(&self.seen)
            .iter()
            .map(|s| s.path_and_query().to_string())
            .collect()
    }

    /// Every request head received so far.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.seen).clone()
    }

    /// The next request head, in arrival order (bounded by [`GUARD`]).
    pub async fn next_request(&mut self) -> Seen {
        within("the upstream to receive a request", self.seen_rx.recv())
            .await
            .expect("upstream stopped")
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An upstream that accepts TCP connections and never says a word (not even TLS).
pub struct SilentUpstream {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl SilentUpstream {
    pub async fn start() -> SilentUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind silent");
        let addr = listener.local_addr().expect("silent addr");
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        SilentUpstream { addr, task }
    }
}

impl Drop for SilentUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An address that refuses connections for the whole test: 127.0.0.1:9 (discard), the one
/// the other tests use for "nothing there". A port bound and released instead can be handed
/// to a concurrent test's listener in between, turning "refused" into a timeout or an
/// answer. Tests bind port 0, which never gives a port below 1024. Checked, so a machine
/// that does serve discard fails here rather than at a confusing assertion.
pub async fn refused_addr() -> SocketAddr {
    let addr = SocketAddr::from(([127, 0, 0, 1], 9));
    match within("a connect to 127.0.0.1:9", TcpStream::connect(addr)).await {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => addr,
        other => panic!("127.0.0.1:9 must refuse connections for this test: {other:?}"),
    }
}

pub fn response(status: u16, body: impl Into<Bytes>) -> Response<TestBody> {
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(status).expect("status");
    r
}

// ---------------------------------------------------------------------------------------
// The proxy process
// ---------------------------------------------------------------------------------------

/// How to start `abx-proxy serve`: a cleared environment with only HOME, ABX_HOME and the
/// key, a temporary cwd, debug logging, and the upstream's CA.
pub struct ProxyCmd {
    listen: String,
    admin_listen: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Files written under ABX_HOME before start: (relative path, contents).
    files: Vec<(String, String)>,
    /// `abx-proxy` commands run with the same environment before `serve`.
    setup: Vec<Vec<String>>,
    /// Default arguments left off the command line (see [`ProxyCmd::omit`]).
    omit: Vec<String>,
    /// A program that runs the proxy (`prlimit … --`), empty for none.
    launcher: Vec<String>,
    /// What the proxy reads on its standard input (then closed); none: `/dev/null`.
    stdin: Option<Vec<u8>>,
}

impl ProxyCmd {
    pub fn new(base_url: &str, pki: &Pki) -> ProxyCmd {
        ProxyCmd {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            args: vec![
                "--sandbox-base-url".into(),
                base_url.into(),
                "--upstream-ca".into(),
                pki.ca_pem.display().to_string(),
                "--log-level".into(),
                "debug".into(),
                "--shutdown-grace".into(),
                "10s".into(),
            ],
            env: vec![("ABX_SANDBOX_API_KEY".into(), API_KEY.into())],
            files: Vec::new(),
            setup: Vec::new(),
            omit: Vec::new(),
            launcher: Vec::new(),
            stdin: None,
        }
    }

    /// Gives the proxy `bytes` on a pipe as its standard input.
    pub fn stdin(mut self, bytes: &[u8]) -> Self {
        self.stdin = Some(bytes.to_vec());
        self
    }

    /// Runs the proxy through `program` (which must exec it as its last argument: its pid
    /// is the proxy's), e.g. `prlimit --nofile=… --`.
    pub fn launcher(mut self, program: &[&str]) -> Self {
        self.launcher = program.iter().map(|a| a.to_string()).collect();
        self
    }

    /// Sets (or, with `None`, removes) an environment variable of the proxy.
    pub fn env(mut self, key: &str, value: Option<&str>) -> Self {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.into(), v.into()));
        }
        self
    }

    /// Writes `contents` to `ABX_HOME/<rel>` (mode 600) before the proxy starts.
    pub fn abx_file(mut self, rel: &str, contents: &str) -> Self {
        self.files.push((rel.into(), contents.into()));
        self
    }

    /// Runs `abx-proxy <args>` (same environment and home) before `serve`; it must succeed.
    pub fn setup(mut self, args: &[&str]) -> Self {
        self.setup
            .push(args.iter().map(|a| a.to_string()).collect());
        self
    }

    async fn prepare(&self, home: &Path) {
        use std::os::unix::fs::PermissionsExt;
        let abx_home = home.join(".abx");
        for (rel, contents) in &self.files {
            let path = abx_home.join(rel);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(&path, contents).expect("write ABX_HOME file");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .expect("chmod 600");
        }
        for args in &self.setup {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
            cmd.env_clear()
                .env("HOME", home)
                .env("ABX_HOME", &abx_home)
                .current_dir(home.join("cwd"))
                .args(args);
            for (k, v) in &self.env {
                cmd.env(k, v);
            }
            let out = output_within(cmd, "an abx-proxy setup command").await;
            assert!(
                out.status.success(),
                "abx-proxy {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = addr.into();
        self
    }

    pub fn admin_listen(mut self, addr: &str) -> Self {
        self.admin_listen = addr.into();
        self
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.into());
        self
    }

    /// Listener TLS with the test CA's server certificate (`--tls-cert`, `--tls-key`).
    pub fn tls_listener(self, pki: &Pki) -> Self {
        let (cert, key) = pki.server_pem_files();
        self.arg("--tls-cert")
            .arg(&cert.display().to_string())
            .arg("--tls-key")
            .arg(&key.display().to_string())
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    fn command(&self, home: &Path) -> Command {
        let abx_home = home.join(".abx");
        let cwd = home.join("cwd");
        std::fs::create_dir_all(&abx_home).expect("ABX_HOME");
        std::fs::create_dir_all(&cwd).expect("cwd");
        let mut cmd = match self.launcher.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(env!("CARGO_BIN_EXE_abx-proxy"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_abx-proxy")),
        };
        cmd.env_clear()
            .env("HOME", home)
            .env("ABX_HOME", &abx_home)
            .current_dir(&cwd)
            .args(self.argv())
            .stdin(match self.stdin {
                Some(_) => Stdio::piped(),
                None => Stdio::null(),
            })
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Starts the proxy and waits for its "listening" line.
    pub async fn spawn(self) -> ProxyProc {
        match self.try_spawn().await {
            Ok(proc) => proc,
            Err(stderr) => panic!("abx-proxy exited before listening; stderr:\n{stderr}"),
        }
    }

    /// [`ProxyCmd::spawn`], or the stderr of a proxy that exited before listening (a port
    /// bound and released to be given to `--listen`, which a concurrent test's listener
    /// took in between: E1008, and another port to try).
    pub async fn try_spawn(self) -> Result<ProxyProc, String> {
        let home = tempfile::tempdir().expect("home");
        let mut command = self.command(home.path());
        self.prepare(home.path()).await;
        let mut child = command.spawn().expect("spawn abx-proxy");
        if let (Some(bytes), Some(mut pipe)) = (&self.stdin, child.stdin.take()) {
            // Far below a pipe's buffer: written whole at once, and closed.
            std::io::Write::write_all(&mut pipe, bytes).expect("write the proxy's stdin");
        }
        let pid = child.id();
        let stderr = child.stderr.take().expect("stderr piped");
        let text = Arc::new(Mutex::new(String::new()));
        let (tx, lines) = mpsc::unbounded_channel();
        let reading = Arc::new((Mutex::new(true), std::sync::Condvar::new()));
        let reader = {
            let text = text.clone();
            let reading = reading.clone();
            std::thread::spawn(move || {
                let mut r = std::io::BufReader::new(stderr);
                let mut raw = Vec::new();
                loop {
                    let (open, opened) = &*reading;
                    let guard = lock(open);
                    drop(opened.wait_while(guard, |open| !*open).expect("the gate"));
                    let Ok(n) = r.read_until(b'\n', &mut raw) else {
                        break;
                    };
                    if n == 0 {
                        break;
                    }
                    let line = strip_ansi(&String::from_utf8_lossy(&raw));
                    lock(&text).push_str(&line);
                    let _ = tx.send(line);
                    raw.clear();
                }
            })
        };
        let mut proc = ProxyProc {
            child: Some(child),
            pid,
            listen: String::new(),
            admin: String::new(),
            text,
            lines,
            reader: Some(reader),
            reading,
            _home: home,
        };
        let Some(line) = proc.line_before_exit("abx-proxy listening").await else {
            return Err(proc.stderr());
        };
        proc.listen = field(&line, "listen").expect("listen= in the listening line");
        proc.admin = field(&line, "admin").expect("admin= in the listening line");
        Ok(proc)
    }

    /// Starts the proxy with its stderr on `stderr` (a file, a pipe), not waiting for anything:
    /// the process and its home, which must outlive it.
    pub async fn spawn_logging_to(self, stderr: impl Into<Stdio>) -> (Spawned, tempfile::TempDir) {
        let home = tempfile::tempdir().expect("home");
        let mut command = self.command(home.path());
        self.prepare(home.path()).await;
        command.stderr(stderr);
        (Spawned::spawn(&mut command, "abx-proxy"), home)
    }

    /// Runs a proxy that is expected to refuse to start: its exit status and stderr.
    pub async fn run_to_exit(self) -> (ExitStatus, String) {
        let home = tempfile::tempdir().expect("home");
        let cmd = self.command(home.path());
        self.prepare(home.path()).await;
        let out = output_within(cmd, "abx-proxy to exit").await;
        let stderr = strip_ansi(&String::from_utf8_lossy(&out.stderr));
        assert_no_key(&stderr, "stderr");
        (out.status, stderr)
    }
}

/// `name=value` from a log line (values end at whitespace).
pub fn field(line: &str, name: &str) -> Option<String> {
    // `--log-format json`: one object per line, fields at the top level.
    if let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(line.trim()) {
        return obj.get(name).and_then(|v| v.as_str()).map(str::to_string);
    }
    let pat = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&pat))
        .map(|v| v.trim_matches('"').to_string())
}

/// Log text without terminal colour sequences (`ESC [ … letter`).
/// A FIFO at `path` (nobody writing to it: whoever opens it to read waits for a writer).
pub fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// The key, or any recognisable part of it, must not appear in `text`.
pub fn assert_no_key(text: &str, what: &str) {
    let body = &API_KEY["sk-abx-live-".len()..];
    assert!(
        !text.contains(API_KEY) && !text.contains(body),
        "the API key leaked into {what}:\n{text}"
    );
}

/// A running proxy. Dropping it kills the process; [`ProxyProc::finish`] stops it the
/// way an operator would and checks its whole stderr.
pub struct ProxyProc {
    child: Option<Child>,
    pub pid: u32,
    /// `127.0.0.1:PORT` or `unix:/path`, as logged.
    pub listen: String,
    pub admin: String,
    text: Arc<Mutex<String>>,
    lines: mpsc::UnboundedReceiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Whether the stderr reader reads (see [`ProxyProc::read_stderr`]).
    reading: Arc<(Mutex<bool>, std::sync::Condvar)>,
    _home: tempfile::TempDir,
}

impl ProxyProc {
    pub fn addr(&self) -> SocketAddr {
        self.listen.parse().expect("a TCP listen address")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.parse().expect("a TCP admin address")
    }

    /// The proxy's `ABX_HOME` (files there can be changed before a SIGHUP).
    pub fn abx_home(&self) -> PathBuf {
        self._home.path().join(".abx")
    }

    /// Stops (`false`) or resumes reading the proxy's stderr, as a log reader that stalls
    /// and comes back: the pipe fills, and the proxy's writes to it wait. The line being
    /// read when it stops is still taken.
    pub fn read_stderr(&self, read: bool) {
        let (open, opened) = &*self.reading;
        *lock(open) = read;
        opened.notify_all();
    }

    /// Everything the proxy wrote to stderr so far.
    pub fn stderr(&self) -> String {
        lock(&self.text).clone()
    }

    /// Waits for a stderr line containing `needle` (lines before it are consumed).
    pub async fn wait_for_line(&mut self, needle: &str) -> String {
        match self.line_before_exit(needle).await {
            Some(line) => line,
            None => panic!(
                "abx-proxy exited before logging {needle:?}; stderr:\n{}",
                self.stderr()
            ),
        }
    }

    /// [`ProxyProc::wait_for_line`], or `None` when the proxy exits first.
    async fn line_before_exit(&mut self, needle: &str) -> Option<String> {
        let found = tokio::time::timeout(GUARD, async {
            while let Some(line) = self.lines.recv().await {
                if line.contains(needle) {
                    return Some(line);
                }
            }
            None
        })
        .await;
        match found {
            Ok(found) => found,
            Err(_) => panic!(
                "abx-proxy did not log {needle:?} within {GUARD:?}; stderr:\n{}",
                self.stderr()
            ),
        }
    }

    /// Rewrites `ABX_HOME/.env` with `contents`, sends SIGHUP and waits for the log line
    /// containing `needle`.
    pub async fn reload_env(&mut self, contents: &str, needle: &str) -> String {
        std::fs::write(self.abx_home().join(".env"), contents).expect("rewrite .env");
        self.signal("HUP");
        self.wait_for_line(needle).await
    }

    /// Sends a signal by name (`TERM`, `INT`, `HUP`) with kill(1).
    pub fn signal(&self, name: &str) {
        signal(self.pid, name);
    }

    /// Waits for the process to exit (bounded), then for its stderr to be complete.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        let child = self.child.take().expect("proxy already reaped");
        let Some(status) = exit_within(child).await else {
            panic!(
                "abx-proxy did not exit within {GUARD:?}; stderr:\n{}",
                self.stderr()
            );
        };
        // What a stalled reader left in the pipe, and the end.
        self.read_stderr(true);
        if let Some(reader) = self.reader.take() {
            let _ = tokio::task::spawn_blocking(move || reader.join()).await;
        }
        status
    }

    /// Whether the process has exited (without waiting); its status stays for
    /// [`ProxyProc::wait_exit`].
    pub fn has_exited(&mut self) -> bool {
        let child = self.child.as_mut().expect("proxy already reaped");
        !matches!(child.try_wait(), Ok(None))
    }

    /// SIGTERM, a clean exit 0, and no key anywhere in stderr. Returns the stderr (also
    /// printed when `ABX_TEST_SHOW_STDERR` is set, for `--nocapture` debugging).
    pub async fn finish(mut self) -> String {
        self.signal("TERM");
        let status = self.wait_exit().await;
        let text = self.stderr();
        assert!(
            status.success(),
            "abx-proxy exited with {status}; stderr:\n{text}"
        );
        assert_no_key(&text, "the proxy's stderr");
        if std::env::var_os("ABX_TEST_SHOW_STDERR").is_some() {
            eprintln!("{text}");
        }
        text
    }
}

impl Drop for ProxyProc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------

/// An HTTP/1.1 client connection to `addr` (hyper, one connection).
pub async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<TestBody> {
    let stream = within("connect to the proxy", TcpStream::connect(addr))
        .await
        .expect("connect to the proxy");
    handshake(stream).await
}

pub async fn handshake<S>(stream: S) -> hyper::client::conn::http1::SendRequest<TestBody>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("client handshake");
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    send
}

/// One request on a fresh connection; the response head within [`GUARD`].
pub async fn send(addr: SocketAddr, req: Request<TestBody>) -> Response<Incoming> {
    let mut client = connect(addr).await;
    within("the proxy's response", client.send_request(req))
        .await
        .expect("request through the proxy")
}

/// A request builder with the proxy's own Host (a loopback name, as the SDKs send).
pub fn request(method: &str, addr: SocketAddr, path_and_query: &str) -> http::request::Builder {
    Request::builder()
        .method(method)
        .uri(path_and_query)
        .header(http::header::HOST, addr.to_string())
}

/// A response read off a raw stream.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn has(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn fill_more<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> usize {
    let mut tmp = [0u8; 16 * 1024];
    let n = within("bytes from the proxy", s.read(&mut tmp))
        .await
        .expect("read from the proxy");
    buf.extend_from_slice(&tmp[..n]);
    n
}

/// Reads one response from `s`. `buf` holds bytes already read and keeps what follows the
/// response (for pipelining and upgrades). Bodies: Content-Length, chunked, none for
/// 1xx/204/304, else to EOF.
pub async fn read_response<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> RawResponse {
    let end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i;
        }
        if fill_more(s, buf).await == 0 {
            panic!(
                "connection closed before a response head; got {:?}",
                String::from_utf8_lossy(buf)
            );
        }
    };
    let head = String::from_utf8(buf[..end].to_vec()).expect("head is text");
    buf.drain(..end + 4);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut resp = RawResponse {
        status,
        headers,
        body: Vec::new(),
    };
    if (100..200).contains(&status) || status == 204 || status == 304 {
        return resp;
    }
    if let Some(len) = resp.header("content-length") {
        let len: usize = len.parse().expect("content-length");
        while buf.len() < len {
            if fill_more(s, buf).await == 0 {
                panic!("connection closed mid-body");
            }
        }
        resp.body = buf.drain(..len).collect();
    } else if resp
        .header("transfer-encoding")
        .is_some_and(|te| te.eq_ignore_ascii_case("chunked"))
    {
        loop {
            let line_end = loop {
                if let Some(i) = find(buf, b"\r\n") {
                    break i;
                }
                assert!(fill_more(s, buf).await > 0, "closed mid-chunk");
            };
            let size_text = String::from_utf8_lossy(&buf[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .expect("chunk size");
            buf.drain(..line_end + 2);
            if size == 0 {
                // No trailers from the proxy: the final CRLF.
                while buf.len() < 2 {
                    assert!(fill_more(s, buf).await > 0, "closed before the last CRLF");
                }
                buf.drain(..2);
                break;
            }
            while buf.len() < size + 2 {
                assert!(fill_more(s, buf).await > 0, "closed mid-chunk");
            }
            resp.body.extend_from_slice(&buf[..size]);
            buf.drain(..size + 2);
        }
    } else {
        while fill_more(s, buf).await > 0 {}
        resp.body = std::mem::take(buf);
    }
    resp
}

/// Writes `bytes` to a fresh connection and reads one response.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> RawResponse {
    raw_open(addr, bytes).await.1
}

/// The peer closes: EOF (or a reset) within [`BOUND`], with nothing else before it. Over
/// TLS a peer that just drops the connection sends no close_notify, which rustls reports
/// as an unexpected EOF.
///
/// Not [`GUARD`]: every close a test waits for comes at once or at a setting of a second
/// or two, while `--header-timeout`'s 30 s default (which also ends a keep-alive
/// connection waiting for its next head) would close it within GUARD too, and so pass a
/// test whose flag, or whose close after an error, went missing.
pub async fn expect_closed<S: AsyncRead + Unpin>(s: &mut S, leftover: &[u8]) {
    assert!(
        leftover.is_empty(),
        "unexpected bytes: {:?}",
        String::from_utf8_lossy(leftover)
    );
    let mut tmp = [0u8; 1024];
    let Ok(read) = tokio::time::timeout(BOUND, s.read(&mut tmp)).await else {
        panic!("the proxy did not close the connection within {BOUND:?}");
    };
    match read {
        Ok(0) => {}
        Ok(n) => panic!(
            "expected the connection closed, got {:?}",
            String::from_utf8_lossy(&tmp[..n])
        ),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
            ) => {}
        Err(e) => panic!("read failed: {e}"),
    }
}

/// Asserts the proxy's own error answer: status, `X-Abx-Error`, the E2B JSON shape, no key.
pub fn assert_proxy_error(resp: &RawResponse, status: u16, code: &str) {
    assert_eq!(resp.status, status, "status; body {:?}", resp.text());
    assert_eq!(resp.header("x-abx-error"), Some(code), "X-Abx-Error");
    let v = resp.json();
    assert_eq!(v["code"], status, "JSON code in {v}");
    let message = v["message"].as_str().expect("message is a string");
    assert!(
        message.starts_with(&format!("[{code}] ")),
        "message {message:?} should start with [{code}]"
    );
    assert_no_key(&resp.text(), "an error body");
}

// ---------------------------------------------------------------------------------------
// Added for tests/envd.rs: certificates for other names, and the admin listener's metrics
// ---------------------------------------------------------------------------------------

impl Pki {
    /// Like [`Pki::new`], but the server certificate names `names` (DNS names, wildcards
    /// such as `*.localhost`, or IP literals) instead of `127.0.0.1` and `localhost`.
    pub fn with_names(names: &[&str]) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "abx-proxy test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");

        let leaf_key = KeyPair::generate().expect("server key");
        let sans: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut leaf = CertificateParams::new(sans).expect("server params");
        leaf.distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("test"));
        let leaf_cert = leaf
            .signed_by(&leaf_key, &ca_cert, &ca_key)
            .expect("server certificate");

        let dir = tempfile::tempdir().expect("pki dir");
        let ca_pem = dir.path().join("ca.pem");
        std::fs::write(&ca_pem, ca_cert.pem()).expect("write ca.pem");
        Pki {
            dir,
            ca_pem,
            chain: vec![leaf_cert.der().clone()],
            key: leaf_key.serialize_der(),
            leaf_pem: leaf_cert.pem(),
            key_pem: leaf_key.serialize_pem(),
        }
    }
}

/// The proxy's `/metrics` text from its admin listener.
pub async fn scrape(admin: SocketAddr) -> String {
    let resp = send(
        admin,
        request("GET", admin, "/metrics").body(empty()).unwrap(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK, "GET /metrics");
    String::from_utf8(collect(resp.into_body()).await.to_vec()).expect("metrics are text")
}

/// Scrapes `/metrics` until `series` is at least `min` (bounded by [`GUARD`]).
pub async fn wait_metric_at_least(admin: SocketAddr, series: &str, min: f64) -> f64 {
    let want = format!("at least {min}");
    let last = wait_metric(admin, series, &want, |v| v.is_some_and(|v| v >= min)).await;
    last.unwrap_or_default()
}

/// Scrapes `/metrics` until `series` satisfies `done` (`want` says how, for the failure),
/// [`POLL`] apart and bounded by [`GUARD`]; its value then. Each round is a full request
/// to the proxy: the wait is on the proxy's state.
pub async fn wait_metric(
    admin: SocketAddr,
    series: &str,
    want: &str,
    done: impl Fn(Option<f64>) -> bool,
) -> Option<f64> {
    let mut last = None;
    let mut every = poll_ticker();
    let reached = tokio::time::timeout(GUARD, async {
        loop {
            every.tick().await;
            last = metric(&scrape(admin).await, series);
            if done(last) {
                return;
            }
        }
    })
    .await;
    assert!(
        reached.is_ok(),
        "{series} did not reach {want} within {GUARD:?}; last {last:?}"
    );
    last
}

/// The value of one series in Prometheus text: `abx_proxy_envd_tokens`, or with labels
/// in any order, `abx_proxy_in_flight_requests{plane="envd"}`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    let want = parse_series(series);
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (parse_series(name) == want).then(|| value.parse().ok())?
    })
}

/// A series' name and its label set.
fn parse_series(s: &str) -> (String, std::collections::BTreeMap<String, String>) {
    let (name, labels) = match s.split_once('{') {
        Some((n, rest)) => (n, rest.trim_end_matches('}')),
        None => (s, ""),
    };
    let labels = labels
        .split(',')
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim_matches('"').to_string()))
        .collect();
    (name.to_string(), labels)
}

// ---------------------------------------------------------------------------------------
// Added for tests/faults.rs
// ---------------------------------------------------------------------------------------

impl ProxyCmd {
    /// Replaces the `--log-level` filter (`debug` by default), e.g. with `trace`.
    pub fn log_level(mut self, filter: &str) -> Self {
        if let Some(i) = self.args.iter().position(|a| a == "--log-level") {
            self.args[i + 1] = filter.to_string();
        }
        self
    }

    /// Replaces `--shutdown-grace` (`10s` by default).
    pub fn shutdown_grace(mut self, grace: &str) -> Self {
        if let Some(i) = self.args.iter().position(|a| a == "--shutdown-grace") {
            self.args[i + 1] = grace.to_string();
        }
        self
    }

    /// The environment the proxy gets besides HOME and ABX_HOME (for running other
    /// `abx-proxy` commands, e.g. `config list`, the same way).
    pub fn env_vars(&self) -> Vec<(String, String)> {
        self.env.clone()
    }
}

// ---------------------------------------------------------------------------------------
// Shared by tests/proxy_core.rs and tests/envd.rs: WebSocket tunnels
// ---------------------------------------------------------------------------------------

/// Writes `bytes` to a fresh connection and reads one response; the connection stays open
/// (an upgrade's tunnel), with what came after the response.
pub async fn raw_open(addr: SocketAddr, bytes: &[u8]) -> (TcpStream, RawResponse, Vec<u8>) {
    let mut s = within("connect to the proxy", TcpStream::connect(addr))
        .await
        .expect("connect to the proxy");
    within("write the request", s.write_all(bytes))
        .await
        .expect("write the request");
    let mut buf = Vec::new();
    let resp = read_response(&mut s, &mut buf).await;
    (s, resp, buf)
}

/// `payload` goes through the tunnel and comes back unchanged (written and read at once,
/// so a payload larger than the socket buffers cannot stall).
pub async fn echo(s: &mut TcpStream, payload: &[u8]) {
    let (mut rd, mut wr) = s.split();
    let write = async {
        wr.write_all(payload).await.unwrap();
    };
    let read = async {
        let mut echoed = vec![0u8; payload.len()];
        rd.read_exact(&mut echoed).await.unwrap();
        echoed
    };
    let ((), echoed) = within("the echo", async { tokio::join!(write, read) }).await;
    assert!(echoed == payload, "echo of {} bytes differs", payload.len());
}

// ---------------------------------------------------------------------------------------
// Added for tests/ops.rs: SIGHUP with the working directory's `.env` and config.toml
// ---------------------------------------------------------------------------------------

impl ProxyProc {
    /// The proxy's working directory, where its `./.env` is read from.
    pub fn cwd(&self) -> PathBuf {
        self._home.path().join("cwd")
    }

    /// Writes each `(path, contents)` (mode 600, as `.env` files are meant to be), sends
    /// SIGHUP and waits for the log line containing `needle`.
    pub async fn reload_files(&mut self, files: &[(PathBuf, &str)], needle: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        for (path, contents) in files {
            std::fs::write(path, contents).expect("write a file for the reload");
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .expect("chmod 600");
        }
        self.signal("HUP");
        self.wait_for_line(needle).await
    }
}

// ---------------------------------------------------------------------------------------
// Added for tests/serve_settings.rs and tests/providers.rs: settings from the layers
// instead of flags, `config list` beside a running proxy, values never sent upstream
// ---------------------------------------------------------------------------------------

impl ProxyCmd {
    /// Leaves default arguments off the command line: `serve` (the subcommand) or a flag
    /// given with its value (`--listen`, `--admin-listen`, `--sandbox-base-url`, …), so the
    /// setting comes from the environment, a `.env` file or config.toml instead.
    pub fn omit(mut self, args: &[&str]) -> Self {
        self.omit.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Writes `contents` to `./.env` in the proxy's working directory (mode 600).
    pub fn cwd_dotenv(self, contents: &str) -> Self {
        // The working directory is `cwd` beside ABX_HOME (see `ProxyCmd::command`).
        self.abx_file("../cwd/.env", contents)
    }

    /// `serve`, the listen flags and the test's arguments, less those [`ProxyCmd::omit`]s.
    fn argv(&self) -> Vec<String> {
        let listen = [
            "--listen",
            &self.listen,
            "--admin-listen",
            &self.admin_listen,
        ];
        let all = std::iter::once("serve")
            .chain(listen)
            .chain(self.args.iter().map(String::as_str));
        let mut argv = Vec::new();
        let mut skip_value = false;
        for a in all {
            if std::mem::take(&mut skip_value) {
                continue;
            }
            if self.omit.iter().any(|o| o == a) {
                skip_value = a.starts_with("--");
                continue;
            }
            argv.push(a.to_string());
        }
        argv
    }
}

impl ProxyProc {
    /// `abx-proxy <args>` in this proxy's HOME, ABX_HOME and working directory, with `env`
    /// (e.g. [`ProxyCmd::env_vars`]): `config list` sees the same layers as `serve`.
    pub async fn run(&self, env: &[(String, String)], args: &[&str]) -> std::process::Output {
        let home = self._home.path();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
        cmd.env_clear()
            .env("HOME", home)
            .env("ABX_HOME", self.abx_home())
            .current_dir(home.join("cwd"))
            .args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        output_within(cmd, "abx-proxy to exit").await
    }

    /// `config list --json` in this proxy's world, as rows by key: what it says `serve` uses.
    pub async fn config_list(
        &self,
        env: &[(String, String)],
    ) -> std::collections::BTreeMap<String, serde_json::Value> {
        let out = self.run(env, &["config", "list", "--json"]).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "config list failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_no_key(&stdout, "config list");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("config JSON");
        rows.into_iter()
            .map(|r| (r["key"].as_str().expect("key").to_string(), r))
            .collect()
    }
}

/// No header of any request head in `seen` contains `value` (`what` names it).
pub fn assert_not_sent(seen: &[Seen], value: &str, what: &str) {
    for s in seen {
        for (name, v) in s.headers.iter() {
            assert!(
                !String::from_utf8_lossy(v.as_bytes()).contains(value),
                "{what} was sent upstream in {name} ({} {})",
                s.method,
                s.path_and_query()
            );
        }
    }
}

/// `pid`'s `n` lowest descriptor numbers not in use: a new descriptor takes the lowest.
pub fn free_descriptor_numbers(pid: u32, n: usize) -> Vec<u64> {
    let open: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("list the proxy's descriptors")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).filter(|d| !open.contains(d)).take(n).collect()
}

/// Sets `pid`'s soft open-file limit (no descriptor numbered at or above it can be made);
/// returns the one it had.
pub fn set_soft_nofile(pid: u32, soft: u64) -> u64 {
    let (mut old, mut hard) = (0, 0);
    let (pid, nofile) = (pid as i32, rlimit::Resource::NOFILE);
    rlimit::prlimit(pid, nofile, None, Some((&mut old, &mut hard))).expect("read the limit");
    rlimit::prlimit(pid, nofile, Some((soft, hard)), None).expect("set the limit");
    old
}

// ---------------------------------------------------------------------------------------
// Access lines and counts: each answer logged once and counted once
// ---------------------------------------------------------------------------------------

/// One answer as SPEC §7 records it: the fields of its access line, which are also the
/// labels of its count in `abx_proxy_requests_total` (`-` is counted as `OTHER`).
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub plane: &'a str,
    pub status: u16,
    /// The upstream named on the line: its host for an answer about the upstream, empty
    /// for one the proxy gave without asking it.
    pub upstream: &'a str,
}

impl Answer<'_> {
    fn series(&self) -> String {
        let method = if self.method == "-" {
            "OTHER"
        } else {
            self.method
        };
        format!(
            "abx_proxy_requests_total{{plane=\"{}\",method=\"{method}\",code=\"{}\"}}",
            self.plane, self.status
        )
    }
}

/// Waits until `requests_total` has counted each of `answers` (a bounded wait on the
/// proxy's state), then asserts it counted each exactly once: every label set has as many
/// as `answers` name with it, no more. `before` is the scrape taken before they were sent.
pub async fn assert_counted_once(admin: SocketAddr, before: &str, answers: &[Answer<'_>]) {
    let mut want = std::collections::BTreeMap::<String, f64>::new();
    for a in answers {
        *want
            .entry(a.series())
            .or_insert(metric(before, &a.series()).unwrap_or(0.0)) += 1.0;
    }
    for (series, n) in &want {
        wait_metric_at_least(admin, series, *n).await;
    }
    let text = scrape(admin).await;
    for (series, n) in &want {
        assert_eq!(metric(&text, series), Some(*n), "{series}:\n{text}");
    }
}

/// The fields of an access line (text format): `name=value` after the target.
fn access_fields(line: &str) -> Option<std::collections::BTreeMap<&str, &str>> {
    let (_, fields) = line.split_once("abx_proxy::access: ")?;
    Some(
        fields
            .split(' ')
            .filter_map(|f| f.split_once('='))
            .collect(),
    )
}

/// In the whole stderr of a stopped proxy (every line written), each of `answers` has
/// exactly one access line for its path, and that line has the answer's method, plane,
/// status, upstream and a duration.
pub fn assert_logged_once(stderr: &str, answers: &[Answer<'_>]) {
    for a in answers {
        let lines: Vec<_> = stderr
            .lines()
            .filter_map(access_fields)
            .filter(|f| f.get("path") == Some(&a.path))
            .collect();
        assert_eq!(lines.len(), 1, "access lines for {a:?}:\n{stderr}");
        let f = &lines[0];
        let plane = format!("{:?}", a.plane);
        let status = a.status.to_string();
        let want = [
            ("method", a.method),
            ("plane", &plane),
            ("status", &status),
            ("upstream", a.upstream),
        ];
        for (name, value) in want {
            assert_eq!(f.get(name).copied(), Some(value), "{name} of {a:?}: {f:?}");
        }
        let ms = f.get("duration_ms").and_then(|d| d.parse::<f64>().ok());
        assert!(
            ms.is_some_and(|ms| ms >= 0.0),
            "duration_ms of {a:?}: {f:?}"
        );
    }
}
