//! Shared test helpers for the AK/SK token exchange: a fake FCSandbox `CreateApiKey`
//! endpoint and a manual clock.
//!
//! The fake is a real hyper server on 127.0.0.1 (plain HTTP, or TLS with an rcgen
//! certificate). It verifies every request's signature itself, with the straightforward
//! implementation below that shares no code with the crate's `signing` module — a test that
//! checked the crate against itself could not fail. It counts calls, issues distinct keys,
//! and can be told to fail, hang, hold answers until released, or answer with clock skew.
//!
//! Include it from a test crate with `#[path = "support/fake_exchange.rs"] mod fake_exchange;`.
#![allow(dead_code)]

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use abx_proxy::credentials::exchange::{BoxFuture, Clock};
use base64::Engine as _;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, watch};

/// The AccessKey pair the fake accepts.
pub const ACCESS_KEY_ID: &str = "LTAI5tFakeAccessKeyId";
pub const ACCESS_KEY_SECRET: &str = "fake-secret-Zq9wX2vB7nM4kL1pR8tY";

/// A guard against a test hanging forever; never used to let time pass.
pub const GUARD: Duration = Duration::from_secs(20);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------------------
// Manual clock
// ---------------------------------------------------------------------------------------

/// A clock that moves only when told. Sleepers register when their future is created and
/// wake when [`ManualClock::advance`] reaches their deadline.
pub struct ManualClock {
    state: Mutex<ClockState>,
    /// Bumped on every registration, so a test can wait for a sleeper to appear.
    registered: watch::Sender<u64>,
}

struct ClockState {
    now: SystemTime,
    sleepers: Vec<(SystemTime, oneshot::Sender<()>)>,
}

impl ManualClock {
    /// Starts at the current wall time, rounded down to a whole second (the exchange
    /// formats times in whole seconds; a fraction would blur the tests' arithmetic).
    pub fn new() -> Arc<Self> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1_735_689_600);
        Self::starting_at(UNIX_EPOCH + Duration::from_secs(secs))
    }

    pub fn starting_at(t: SystemTime) -> Arc<Self> {
        Arc::new(ManualClock {
            state: Mutex::new(ClockState {
                now: t,
                sleepers: Vec::new(),
            }),
            registered: watch::channel(0).0,
        })
    }

    pub fn advance(&self, by: Duration) {
        let mut st = lock(&self.state);
        st.now += by;
        let now = st.now;
        let (due, rest): (Vec<_>, Vec<_>) = st.sleepers.drain(..).partition(|(d, _)| *d <= now);
        st.sleepers = rest;
        drop(st);
        for (_, tx) in due {
            let _ = tx.send(());
        }
    }

    /// Moves time without waking anyone: a machine that was suspended, whose wall clock
    /// moved on while its timers did not run.
    pub fn jump(&self, by: Duration) {
        lock(&self.state).now += by;
    }

    /// Sleepers whose future is still alive.
    pub fn live_sleepers(&self) -> usize {
        let mut st = lock(&self.state);
        st.sleepers.retain(|(_, tx)| !tx.is_closed());
        st.sleepers.len()
    }

    /// The earliest deadline among live sleepers.
    pub fn next_deadline(&self) -> Option<SystemTime> {
        let mut st = lock(&self.state);
        st.sleepers.retain(|(_, tx)| !tx.is_closed());
        st.sleepers.iter().map(|(d, _)| *d).min()
    }

    /// Waits (in real time, bounded by [`GUARD`]) until at least `n` sleepers are alive.
    pub async fn until_sleepers(&self, n: usize) {
        let mut rx = self.registered.subscribe();
        let wait = async {
            while self.live_sleepers() < n {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(GUARD, wait).await.is_err() {
            panic!(
                "expected {n} sleepers on the manual clock, have {}",
                self.live_sleepers()
            );
        }
    }

    /// Waits for a sleeper, then moves time exactly to the earliest deadline.
    pub async fn advance_to_next_sleeper(&self) {
        self.until_sleepers(1).await;
        if let Some(deadline) = self.next_deadline() {
            let now = Clock::now(self);
            self.advance(deadline.duration_since(now).unwrap_or_default());
        }
    }

    /// Moves time to `t` (no-op when `t` is not in the future).
    pub fn advance_to(&self, t: SystemTime) {
        let now = Clock::now(self);
        self.advance(t.duration_since(now).unwrap_or_default());
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        lock(&self.state).now
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        if duration.is_zero() {
            return Box::pin(async {});
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut st = lock(&self.state);
            let deadline = st.now + duration;
            st.sleepers.push((deadline, tx));
        }
        self.registered.send_modify(|n| *n += 1);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

// ---------------------------------------------------------------------------------------
// The fake endpoint
// ---------------------------------------------------------------------------------------

/// How the fake answers the next requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Verify and issue a key.
    Ok,
    /// 500 with an Alibaba-style error body.
    Fail500,
    /// Never answer.
    Hang,
    /// 400 `InvalidTimeStamp.Expired`.
    ClockSkew,
    /// 200 with a key that holds a line break (no HTTP header can carry it).
    BadKey,
    /// 429 `Throttling.User`.
    Throttle,
    /// The given status with a code that repeats the AccessKey secret, as a gateway might
    /// repeat what it checked.
    EchoSecret(u16),
    /// The given status with a gateway's HTML page of 100 KiB.
    GatewayPage(u16),
    /// 400 with a code that repeats the AccessKey secret in JSON escapes (`\u0066` for its
    /// first letter), which its bytes do not match.
    EchoSecretEscaped,
}

struct State {
    clock: Arc<dyn Clock>,
    mode: Mutex<Mode>,
    /// Lifetime of issued keys; `None` leaves `expireTime` out of the answer.
    ttl: Mutex<Option<Duration>>,
    /// Bytes of an extra field in each issued key's answer.
    padding: Mutex<usize>,
    /// Where the endpoint sits below the host (`""`, or `/gateway`).
    prefix: Mutex<String>,
    /// While false, requests are counted and then held until it turns true.
    open: watch::Sender<bool>,
    calls: watch::Sender<usize>,
    accepted: AtomicUsize,
    rejected: AtomicUsize,
    rejections: Mutex<Vec<String>>,
    /// Every key issued, in order; a watch so that a test can wait for the n-th.
    issued: watch::Sender<Vec<String>>,
    nonces: Mutex<HashSet<String>>,
    schemes: Mutex<Vec<&'static str>>,
}

/// A running fake endpoint; stops when dropped.
pub struct FakeExchange {
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT` or `https://127.0.0.1:PORT`.
    pub url: String,
    /// PEM of the self-signed certificate (TLS only).
    pub ca_pem: Option<String>,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeExchange {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeExchange {
    /// Plain HTTP, issuing keys that live one hour by `clock`.
    pub async fn start(clock: Arc<dyn Clock>) -> FakeExchange {
        Self::spawn(clock, None).await
    }

    /// TLS with a fresh self-signed certificate for 127.0.0.1 (see [`FakeExchange::ca_pem`]).
    pub async fn start_tls(clock: Arc<dyn Clock>) -> FakeExchange {
        let certified = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
        ])
        .expect("rcgen certificate");
        let cert_der = certified.cert.der().clone();
        let key_der = rustls_pki_types::PrivateKeyDer::Pkcs8(
            rustls_pki_types::PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()),
        );
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert_der], key_der)
            .expect("server certificate");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let mut fake = Self::spawn(clock, Some(acceptor)).await;
        fake.ca_pem = Some(certified.cert.pem());
        fake
    }

    async fn spawn(clock: Arc<dyn Clock>, tls: Option<tokio_rustls::TlsAcceptor>) -> FakeExchange {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake exchange");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State {
            clock,
            mode: Mutex::new(Mode::Ok),
            ttl: Mutex::new(Some(Duration::from_secs(3600))),
            padding: Mutex::new(0),
            prefix: Mutex::new(String::new()),
            open: watch::channel(true).0,
            calls: watch::channel(0).0,
            accepted: AtomicUsize::new(0),
            rejected: AtomicUsize::new(0),
            rejections: Mutex::new(Vec::new()),
            issued: watch::channel(Vec::new()).0,
            nonces: Mutex::new(HashSet::new()),
            schemes: Mutex::new(Vec::new()),
        });
        let scheme = if tls.is_some() { "https" } else { "http" };
        let server_state = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = Arc::clone(&server_state);
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let state = Arc::clone(&state);
                        async move {
                            // The endpoint's own clock, as a real one's `Date` is.
                            let date = httpdate::fmt_http_date(state.clock.now());
                            let mut resp = handle(state, req).await;
                            if let Ok(date) = hyper::header::HeaderValue::from_str(&date) {
                                resp.headers_mut().insert(hyper::header::DATE, date);
                            }
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                        }
                    }
                });
            }
        });
        FakeExchange {
            addr,
            url: format!("{scheme}://{addr}"),
            ca_pem: None,
            state,
            task,
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        *lock(&self.state.mode) = mode;
    }

    pub fn set_ttl(&self, ttl: Option<Duration>) {
        *lock(&self.state.ttl) = ttl;
    }

    /// Serves ACS3's `CreateApiKey` below `prefix` (a gateway path), not at the root.
    pub fn set_path_prefix(&self, prefix: &str) {
        *lock(&self.state.prefix) = prefix.to_string();
    }

    /// Pads each answer that issues a key with a field of `bytes` bytes (real answers
    /// carry request ids and key metadata the proxy skips).
    pub fn set_padding(&self, bytes: usize) {
        *lock(&self.state.padding) = bytes;
    }

    /// Holds every answer (requests are still counted) until [`FakeExchange::release`].
    pub fn hold(&self) {
        self.state.open.send_replace(false);
    }

    pub fn release(&self) {
        self.state.open.send_replace(true);
    }

    /// Requests received, whatever became of them.
    pub fn calls(&self) -> usize {
        *self.state.calls.borrow()
    }

    /// Requests whose signature verified and that got a key.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Requests refused for a bad signature or bad parameters.
    pub fn rejected(&self) -> usize {
        self.state.rejected.load(Ordering::SeqCst)
    }

    /// Why requests were refused, for assertion messages.
    pub fn rejections(&self) -> Vec<String> {
        lock(&self.state.rejections).clone()
    }

    /// Every key issued so far, in order.
    pub fn issued_keys(&self) -> Vec<String> {
        self.state.issued.borrow().clone()
    }

    /// Waits (in real time, bounded by [`GUARD`]) until `n` keys have been issued. A call
    /// is counted on arrival, its key only once it is verified: [`FakeExchange::until_calls`]
    /// can return while the key of the last call counted is still to come.
    pub async fn until_issued(&self, n: usize) -> Vec<String> {
        let mut rx = self.state.issued.subscribe();
        let issued = tokio::time::timeout(GUARD, rx.wait_for(|keys| keys.len() >= n)).await;
        if !matches!(issued, Ok(Ok(_))) {
            panic!(
                "expected {n} keys issued by the fake exchange, got {} (calls {}, rejections {:?})",
                self.issued_keys().len(),
                self.calls(),
                self.rejections()
            );
        }
        // Its `Ref` holds the channel's lock, which `issued_keys` takes again.
        drop(issued);
        self.issued_keys()
    }

    /// The signature scheme of every accepted request (`"rpc-v1"` or `"acs3"`).
    pub fn schemes(&self) -> Vec<&'static str> {
        lock(&self.state.schemes).clone()
    }

    /// Waits (in real time, bounded by [`GUARD`]) until `n` requests have arrived.
    pub async fn until_calls(&self, n: usize) {
        let mut rx = self.state.calls.subscribe();
        if tokio::time::timeout(GUARD, rx.wait_for(|c| *c >= n))
            .await
            .is_err()
        {
            panic!(
                "expected {n} calls at the fake exchange, got {}",
                self.calls()
            );
        }
    }
}

fn answer(status: u16, body: Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json;charset=utf-8"),
    );
    resp
}

fn alibaba_error(status: u16, code: &str, message: &str) -> Response<Full<Bytes>> {
    answer(
        status,
        json!({"RequestId": "FAKE-REQUEST", "Code": code, "Message": message, "HostId": "fake"}),
    )
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    state.calls.send_modify(|n| *n += 1);
    let mut open = state.open.subscribe();
    let _ = open.wait_for(|o| *o).await;

    let mode = *lock(&state.mode);
    match mode {
        Mode::Hang => std::future::pending::<()>().await,
        Mode::Fail500 => {
            return alibaba_error(
                500,
                "InternalError",
                "The request processing has failed due to some unknown error.",
            )
        }
        Mode::ClockSkew => {
            return alibaba_error(
                400,
                "InvalidTimeStamp.Expired",
                "Specified time stamp or date value is expired.",
            )
        }
        Mode::EchoSecret(status) => {
            // Past a code's 80 characters too, where the proxy cuts it.
            let code = match status {
                429 => format!("Throttling.{ACCESS_KEY_SECRET}"),
                _ => format!(
                    "InvalidAccessKeySecret.{}.{ACCESS_KEY_SECRET}",
                    "X".repeat(60)
                ),
            };
            return alibaba_error(status, &code, "echoed");
        }
        Mode::EchoSecretEscaped => {
            let mut chars = ACCESS_KEY_SECRET.chars();
            let first = chars.next().map_or(0, u32::from);
            let body = format!(
                "{{\"Code\":\"InvalidAccessKeySecret.\\u{first:04x}{}\",\"Message\":\"echoed\"}}",
                chars.as_str()
            );
            let mut resp = Response::new(Full::new(Bytes::from(body)));
            *resp.status_mut() = hyper::StatusCode::BAD_REQUEST;
            return resp;
        }
        Mode::GatewayPage(status) => {
            let page = format!("<html>{}</html>", " ".repeat(100 * 1024));
            let mut resp = Response::new(Full::new(Bytes::from(page)));
            *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
            return resp;
        }
        Mode::Throttle => {
            return alibaba_error(
                429,
                "Throttling.User",
                "Request was denied due to user flow control.",
            )
        }
        Mode::BadKey => {
            let expiry = state.clock.now() + Duration::from_secs(3600);
            let ms = expiry
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0);
            return answer(
                200,
                json!({"RequestId": "FAKE-REQUEST", "ApiKey": {
                    "ApiKeyName": "fake-bad",
                    "ApiKeyValue": "tmpkey-1\nabcdef",
                    "ExpireTime": u64::try_from(ms).unwrap_or(u64::MAX),
                }}),
            );
        }
        Mode::Ok => {}
    }

    let (parts, body) = req.into_parts();
    // As a gateway that wants a length: a POST over HTTP/1.1 says how long its body is,
    // `Content-Length: 0` for none (RFC 9110 §8.6; Alibaba's SDKs send it).
    let framed = parts.headers.contains_key(http::header::CONTENT_LENGTH)
        || parts.headers.contains_key(http::header::TRANSFER_ENCODING);
    if parts.method == http::Method::POST && parts.version == http::Version::HTTP_11 && !framed {
        state.rejected.fetch_add(1, Ordering::SeqCst);
        lock(&state.rejections).push("411: a POST without Content-Length".into());
        return alibaba_error(411, "MissingContentLength", "Length Required");
    }
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return alibaba_error(400, "InvalidBody", "unreadable body"),
    };
    let verified = if parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("ACS3-HMAC-SHA256 "))
    {
        verify_acs3(&state, &parts, &body).map(|t| ("acs3", t))
    } else {
        verify_rpc(&state, &parts, &body).map(|t| ("rpc-v1", t))
    };
    let (scheme, signed_at) = match verified {
        Ok(v) => v,
        Err((code, why)) => {
            state.rejected.fetch_add(1, Ordering::SeqCst);
            lock(&state.rejections).push(format!("{code}: {why}"));
            return alibaba_error(400, code, &why);
        }
    };
    let now = state.clock.now();
    let off = match now.duration_since(signed_at) {
        Ok(d) => d,
        Err(e) => e.duration(),
    };
    if off > Duration::from_secs(15 * 60) {
        return alibaba_error(
            400,
            "InvalidTimeStamp.Expired",
            "Specified time stamp or date value is expired.",
        );
    }

    let (mut n, mut key) = (0, String::new());
    state.issued.send_modify(|keys| {
        n = keys.len() + 1;
        key = format!("tmpkey-{n}-{:016x}", fastrand::u64(..));
        keys.push(key.clone());
    });
    lock(&state.schemes).push(scheme);
    state.accepted.fetch_add(1, Ordering::SeqCst);
    let expiry = lock(&state.ttl).map(|ttl| now + ttl);
    // The two schemes answer in different shapes, so both parsing paths run end to end.
    let mut body = if scheme == "rpc-v1" {
        let mut k = json!({"ApiKeyName": format!("fake-{n}"), "ApiKeyValue": key});
        if let Some(t) = expiry {
            let ms = t
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0);
            k["ExpireTime"] = json!(u64::try_from(ms).unwrap_or(u64::MAX));
        }
        json!({"RequestId": "FAKE-REQUEST", "ApiKey": k})
    } else {
        let mut k = json!({"apiKeyName": format!("fake-{n}"), "apiKeyValue": key});
        if let Some(t) = expiry {
            k["expireTime"] = json!(format_utc(t));
        }
        json!({"requestId": "FAKE-REQUEST", "apiKey": k})
    };
    let padding = *lock(&state.padding);
    if padding > 0 {
        body["Padding"] = json!("x".repeat(padding));
    }
    answer(200, body)
}

type Reject = (&'static str, String);

fn reject(code: &'static str, why: impl Into<String>) -> Reject {
    (code, why.into())
}

fn check_nonce(state: &State, nonce: &str) -> Result<(), Reject> {
    if nonce.is_empty() {
        return Err(reject("MissingSignatureNonce", "no nonce"));
    }
    if !lock(&state.nonces).insert(nonce.to_string()) {
        return Err(reject("SignatureNonceUsed", "nonce replayed"));
    }
    Ok(())
}

/// RPC V1: every parameter in the query, `Signature` over all the others.
fn verify_rpc(
    state: &State,
    parts: &http::request::Parts,
    body: &[u8],
) -> Result<SystemTime, Reject> {
    if parts.method != http::Method::POST {
        return Err(reject("InvalidMethod", "expected POST"));
    }
    if !body.is_empty() {
        return Err(reject("InvalidBody", "expected an empty body"));
    }
    let query = parts.uri.query().unwrap_or("");
    let mut params: Vec<(String, String)> = Vec::new();
    let mut signature = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (
            pct_decode(k).ok_or_else(|| reject("InvalidParameter", "bad escape"))?,
            pct_decode(v).ok_or_else(|| reject("InvalidParameter", "bad escape"))?,
        );
        if k == "Signature" {
            signature = Some(v);
        } else {
            params.push((k, v));
        }
    }
    let signature = signature.ok_or_else(|| reject("MissingSignature", "no Signature"))?;
    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("")
    };
    for (name, want) in [
        ("Action", "CreateApiKey"),
        ("Version", "2026-05-09"),
        ("Format", "JSON"),
        ("SignatureMethod", "HMAC-SHA1"),
        ("SignatureVersion", "1.0"),
    ] {
        if get(name) != want {
            return Err(reject("InvalidParameter", format!("{name} must be {want}")));
        }
    }
    if get("AccessKeyId") != ACCESS_KEY_ID {
        return Err(reject("InvalidAccessKeyId.NotFound", "unknown AccessKeyId"));
    }
    if get("RegionId").is_empty() {
        return Err(reject("MissingRegionId", "no RegionId"));
    }
    let signed_at = parse_utc(get("Timestamp"))
        .ok_or_else(|| reject("InvalidTimeStamp.Format", "bad Timestamp"))?;
    let nonce = get("SignatureNonce").to_string();

    params.sort();
    let canonical: Vec<String> = params
        .iter()
        .map(|(k, v)| format!("{}={}", pct(k), pct(v)))
        .collect();
    let to_sign = format!("{}&%2F&{}", parts.method, pct(&canonical.join("&")));
    let mut mac = Hmac::<sha1::Sha1>::new_from_slice(format!("{ACCESS_KEY_SECRET}&").as_bytes())
        .expect("hmac key");
    mac.update(to_sign.as_bytes());
    let expected = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    if expected != signature {
        return Err(reject(
            "SignatureDoesNotMatch",
            format!("rpc-v1 signature mismatch; string to sign was {to_sign}"),
        ));
    }
    check_nonce(state, &nonce)?;
    Ok(signed_at)
}

/// ACS3-HMAC-SHA256 on `POST /pop/2026-05-09/api-keys` with the JSON body of SPEC §5.
fn verify_acs3(
    state: &State,
    parts: &http::request::Parts,
    body: &[u8],
) -> Result<SystemTime, Reject> {
    let header = |name: &str| -> Vec<String> {
        parts
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("").trim().to_string())
            .collect()
    };
    let one = |name: &str| header(name).join(",");
    let auth = one("authorization");
    let fields = auth
        .strip_prefix("ACS3-HMAC-SHA256 ")
        .ok_or_else(|| reject("InvalidAuthorization", "bad scheme"))?;
    let mut credential = "";
    let mut signed_headers = "";
    let mut signature = "";
    for field in fields.split(',') {
        match field.trim().split_once('=') {
            Some(("Credential", v)) => credential = v,
            Some(("SignedHeaders", v)) => signed_headers = v,
            Some(("Signature", v)) => signature = v,
            _ => return Err(reject("InvalidAuthorization", "bad field")),
        }
    }
    if credential != ACCESS_KEY_ID {
        return Err(reject("InvalidAccessKeyId.NotFound", "unknown AccessKeyId"));
    }
    let signed: Vec<&str> = signed_headers.split(';').collect();
    for must in [
        "host",
        "content-type",
        "x-acs-action",
        "x-acs-version",
        "x-acs-date",
        "x-acs-signature-nonce",
        "x-acs-content-sha256",
    ] {
        if !signed.contains(&must) {
            return Err(reject(
                "InvalidAuthorization",
                format!("{must} is not signed"),
            ));
        }
    }
    let mut sorted = signed.clone();
    sorted.sort();
    if sorted != signed {
        return Err(reject("InvalidAuthorization", "SignedHeaders not sorted"));
    }
    let want = format!("{}/pop/2026-05-09/api-keys", lock(&state.prefix));
    if parts.method != http::Method::POST || parts.uri.path() != want {
        return Err(reject("InvalidAction.NotFound", "wrong method or path"));
    }
    if one("x-acs-action") != "CreateApiKey" || one("x-acs-version") != "2026-05-09" {
        return Err(reject("InvalidAction.NotFound", "wrong action or version"));
    }
    let body_hash = hex::encode(Sha256::digest(body));
    if one("x-acs-content-sha256") != body_hash {
        return Err(reject("InvalidContentSha256", "body hash mismatch"));
    }
    let json: Value =
        serde_json::from_slice(body).map_err(|_| reject("InvalidParameter", "body is not JSON"))?;
    if !json["apiKeyName"]
        .as_str()
        .is_some_and(|n| n.starts_with("abx-proxy-"))
    {
        return Err(reject("InvalidParameter", "apiKeyName"));
    }
    if json["expireTime"].as_str().and_then(parse_utc).is_none() {
        return Err(reject("InvalidParameter", "expireTime"));
    }
    let signed_at = parse_utc(&one("x-acs-date"))
        .ok_or_else(|| reject("InvalidTimeStamp.Format", "bad x-acs-date"))?;

    // As a server reads the path: each segment decoded, then encoded for the signature.
    let path: Vec<String> = (parts.uri.path().split('/'))
        .map(|segment| pct(&pct_decode(segment).unwrap_or_default()))
        .collect();
    let mut query: Vec<(String, String)> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                pct(&pct_decode(k).unwrap_or_default()),
                pct(&pct_decode(v).unwrap_or_default()),
            )
        })
        .collect();
    query.sort();
    let query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut canonical = format!(
        "{}\n{}\n{}\n",
        parts.method,
        path.join("/"),
        query.join("&")
    );
    for name in &signed {
        canonical.push_str(&format!("{name}:{}\n", one(name)));
    }
    canonical.push_str(&format!("\n{signed_headers}\n{body_hash}"));
    let to_sign = format!(
        "ACS3-HMAC-SHA256\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(ACCESS_KEY_SECRET.as_bytes()).expect("hmac key");
    mac.update(to_sign.as_bytes());
    let expected = hex::encode(mac.finalize().into_bytes());
    if expected != signature {
        return Err(reject(
            "SignatureDoesNotMatch",
            format!("acs3 signature mismatch; canonical request was {canonical:?}"),
        ));
    }
    check_nonce(state, &one("x-acs-signature-nonce"))?;
    Ok(signed_at)
}

/// RFC 3986 unreserved kept, every other byte `%XX` (upper-case hex).
pub fn pct(s: &str) -> String {
    const KEEP: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~";
    s.bytes()
        .map(|b| {
            if KEEP.as_bytes().contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Reverses `%XX` escapes (and `+` as space, as a lenient server would).
pub fn pct_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
pub fn parse_utc(s: &str) -> Option<SystemTime> {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    time::PrimitiveDateTime::parse(s, format)
        .ok()
        .map(|t| t.assume_utc().into())
}

pub fn format_utc(t: SystemTime) -> String {
    let t = time::OffsetDateTime::from(t);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}
