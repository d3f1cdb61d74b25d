//! What the fake upstreams of the end-to-end tests (`fake_e2b`, `fake_opensandbox`) share:
//! their option parsing, runtime, start-up line, stdin lifeline, accept loop (plain HTTP,
//! and TLS on the same port when given a certificate), response helpers, and the request
//! tally that `GET /__fake/report` returns.
//!
//! Include it with `#[path = "support/mod.rs"] mod support;` (this directory has no
//! `main.rs`, so it is no example of its own).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

pub type Body = BoxBody<Bytes, Infallible>;

/// The options every fake takes besides its own.
#[derive(Clone, Debug, Default)]
pub struct Common {
    /// `--expect-key KEY`: the key the proxy must attach (required unless `no_auth_check`).
    pub expect_key: Option<String>,
    /// `--no-auth-check`: accept any credentials.
    pub no_auth_check: bool,
    /// `--stdin-lifeline`: exit when stdin closes.
    pub stdin_lifeline: bool,
}

/// Command-line options, `--name value` or `--name=value`: iterating yields the names,
/// [`Options::value`] the value of the one just yielded.
pub struct Options {
    fake: &'static str,
    usage: fn() -> !,
    args: std::iter::Skip<std::env::Args>,
    name: String,
    inline: Option<String>,
}

impl Options {
    /// Parses the process's arguments: `own` takes the fake's own options (returning
    /// false for a name that is not one of them), the [`Common`] ones are returned.
    /// `usage` prints the synopsis and exits.
    pub fn parse(
        fake: &'static str,
        usage: fn() -> !,
        mut own: impl FnMut(&str, &mut Options) -> bool,
    ) -> Common {
        let mut opts = Options {
            fake,
            usage,
            args: std::env::args().skip(1),
            name: String::new(),
            inline: None,
        };
        let mut common = Common::default();
        while let Some(name) = opts.next() {
            match name.as_str() {
                "--expect-key" => common.expect_key = Some(opts.value()),
                "--no-auth-check" => common.no_auth_check = true,
                "--stdin-lifeline" => common.stdin_lifeline = true,
                "-h" | "--help" => usage(),
                other => {
                    if !own(other, &mut opts) {
                        opts.fail(&format!("unknown argument {other:?}"))
                    }
                }
            }
        }
        if !common.no_auth_check && common.expect_key.as_deref().unwrap_or("").is_empty() {
            opts.fail("--expect-key KEY is required unless --no-auth-check is given")
        }
        common
    }

    pub fn value(&mut self) -> String {
        match self.inline.take().or_else(|| self.args.next()) {
            Some(v) => v,
            None => self.fail(&format!("{} needs a value", self.name)),
        }
    }

    /// The value as a port number.
    pub fn port(&mut self) -> u16 {
        let v = self.value();
        v.parse()
            .unwrap_or_else(|_| self.fail(&format!("{} {v:?} is not a port", self.name)))
    }

    pub fn fail(&self, why: &str) -> ! {
        eprintln!("{}: {why}", self.fake);
        (self.usage)()
    }
}

impl Iterator for Options {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        let arg = self.args.next()?;
        (self.name, self.inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (arg, None),
        };
        Some(self.name.clone())
    }
}

/// Runs `fake` on a small runtime; any error ends the process with status 1.
pub fn main<F: Future<Output = std::io::Result<()>>>(fake: &str, run: F) {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{fake}: cannot start the runtime: {e}");
            std::process::exit(1)
        }
    };
    if let Err(e) = rt.block_on(run) {
        eprintln!("{fake}: {e}");
        std::process::exit(1)
    }
}

/// Prints the start-up line (the fake's addresses, as JSON) the tests wait for; with
/// `lifeline`, exits when the parent closes our stdin (or dies), so no fake outlives its
/// test.
pub fn started(addresses: &Value, lifeline: bool) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{addresses}")?;
    out.flush()?;
    if lifeline {
        std::thread::spawn(|| {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            std::process::exit(0);
        });
    }
    Ok(())
}

/// Serves each connection `listener` accepts with `handle`, over HTTP/1.1 or cleartext
/// HTTP/2 (prior knowledge), as a real server offers. With `tls`, a connection that opens
/// with a TLS handshake is served over TLS (ALPN `h2` or `http/1.1`) and its requests carry
/// the [`OverTls`] extension; plain ones (the tests' report requests) still work.
pub async fn serve<H, F>(listener: TcpListener, what: &str, tls: Option<TlsAcceptor>, handle: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                eprintln!("{what}: accept: {e}");
                continue;
            }
        };
        let (handle, tls) = (handle.clone(), tls.clone());
        tokio::spawn(async move {
            // A TLS ClientHello starts with the handshake record type, 0x16.
            let mut first = [0u8; 1];
            let over_tls = match &tls {
                Some(_) => matches!(stream.peek(&mut first).await, Ok(1) if first[0] == 0x16),
                None => false,
            };
            let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                if over_tls {
                    req.extensions_mut().insert(OverTls);
                }
                let answer = handle(req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            match tls {
                Some(acceptor) if over_tls => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
                _ => {
                    let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                }
            }
        });
    }
}

/// Marks a request that came over TLS.
#[derive(Clone, Copy, Debug)]
pub struct OverTls;

/// A throwaway CA and a server certificate it signed for `names`: the acceptor (offering
/// `h2` and `http/1.1`) and the CA certificate as PEM, for the client to trust.
#[allow(dead_code)] // fake_e2b's: fake_opensandbox has no TLS mode
pub fn tls_acceptor(names: &[String]) -> Result<(TlsAcceptor, String), String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let fail = |e: &dyn std::fmt::Display| format!("test certificate: {e}");
    let ca_key = KeyPair::generate().map_err(|e| fail(&e))?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(|e| fail(&e))?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "abx-proxy e2e fake CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).map_err(|e| fail(&e))?;
    let leaf_key = KeyPair::generate().map_err(|e| fail(&e))?;
    let leaf = CertificateParams::new(names.to_vec()).map_err(|e| fail(&e))?;
    let leaf_cert = leaf
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .map_err(|e| fail(&e))?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
        leaf_key.serialize_der(),
    ));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(&e))?
        .with_no_client_auth()
        .with_single_cert(vec![leaf_cert.der().clone()], key)
        .map_err(|e| fail(&e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((TlsAcceptor::from(Arc::new(config)), ca_cert.pem()))
}

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

pub fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

pub fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = status;
    r
}

/// A fake's mutable state.
pub struct Locked<T>(Mutex<T>);

impl<T> Locked<T> {
    pub fn new(state: T) -> Locked<T> {
        Locked(Mutex::new(state))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        // A panic in one handler must not turn every later request into a second panic.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a fake saw, for `GET /__fake/report` (which it does not count itself).
#[derive(Default)]
pub struct Tally {
    pub requests: u64,
    pub routes: BTreeMap<String, u64>,
    pub violations: Vec<String>,
    pub log: Vec<Value>,
}

impl Tally {
    pub fn count(&mut self, route: &str) {
        self.requests += 1;
        *self.routes.entry(route.to_string()).or_insert(0) += 1;
    }

    /// `{"requests": N, "routes": {…}, "violations": […], "log": […]}`.
    pub fn report(&self) -> Response<Body> {
        json_response(
            StatusCode::OK,
            &json!({
                "requests": self.requests,
                "routes": self.routes,
                "violations": self.violations,
                "log": self.log,
            }),
        )
    }
}
