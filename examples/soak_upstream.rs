//! A TLS HTTP/1.1 upstream that breaks on purpose, for `scripts/soak.sh`.
//!
//! ```text
//! soak_upstream CA_OUT [RESET_EVERY ERROR_EVERY CUT_EVERY SLOW_EVERY]
//! ```
//!
//! Writes a fresh self-signed certificate for 127.0.0.1 to `CA_OUT` (give it to the proxy
//! as `--upstream-ca`) and prints `listening https://127.0.0.1:P control http://127.0.0.1:Q`.
//!
//! Data plane (TLS, keep-alive): `GET /download?bytes=N` (N bytes, default 64 KiB),
//! `POST|PUT /upload` (reads and counts the body), anything else a small JSON. Request
//! number n (counted over all data-plane requests, from 1) is turned into a fault, in this
//! order of precedence, when
//! - n % RESET_EVERY == 0 (default 97): the connection is reset (RST) after the request head
//!   was read — the proxy answers 502;
//! - n % ERROR_EVERY == 0 (default 89): 500 with `X-Soak-Fault: 500`;
//! - n % CUT_EVERY == 0 (default 101): 200 announcing 64 KiB, then the connection closes
//!   after 16 KiB — the client sees the stream end mid-body;
//! - n % SLOW_EVERY == 0 (default 53): the answer comes after 200 ms (not a failure).
//!
//! A value of 0 turns that fault off.
//!
//! Control plane (plain HTTP, its own port, so it never counts itself):
//! - `GET /stats`: `{"open":…,"requests":…,"resets":…,"errors":…,"cuts":…,"slow":…}`, where
//!   `open` is the data-plane connections open now;
//! - `POST /close-idle`: closes every idle data-plane connection now (and the others once
//!   their response is done), so the proxy's pool empties and its file descriptors can be
//!   counted without them.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::server::TlsStream;

type ResBody = BoxBody<Bytes, io::Error>;

const SMALL: &[u8] = br#"{"sandboxID":"isb-soak","state":"running"}"#;

#[derive(Default)]
struct Stats {
    open: AtomicU64,
    requests: AtomicU64,
    resets: AtomicU64,
    errors: AtomicU64,
    cuts: AtomicU64,
    slow: AtomicU64,
}

struct Every {
    reset: u64,
    error: u64,
    cut: u64,
    slow: u64,
}

fn hits(n: u64, every: u64) -> bool {
    every != 0 && n.is_multiple_of(every)
}

/// The TLS stream; when `reset` is set, dropping it resets the TCP connection.
struct Conn {
    inner: TlsStream<TcpStream>,
    reset: Arc<AtomicBool>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.inner.get_ref().0.set_zero_linger();
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn full(b: impl Into<Bytes>) -> ResBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

fn query_bytes(req: &Request<Incoming>) -> u64 {
    req.uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("bytes=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 * 1024)
}

async fn data(
    req: Request<Incoming>,
    stats: Arc<Stats>,
    every: Arc<Every>,
    reset: Arc<AtomicBool>,
) -> Result<Response<ResBody>, io::Error> {
    let n = stats.requests.fetch_add(1, Ordering::SeqCst) + 1;
    if hits(n, every.reset) {
        stats.resets.fetch_add(1, Ordering::SeqCst);
        reset.store(true, Ordering::SeqCst);
        return Err(io::Error::other("soak fault: reset"));
    }
    if hits(n, every.error) {
        stats.errors.fetch_add(1, Ordering::SeqCst);
        let mut resp = Response::new(full(r#"{"code":500,"message":"soak fault"}"#));
        *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        resp.headers_mut()
            .insert("x-soak-fault", HeaderValue::from_static("500"));
        return Ok(resp);
    }
    if hits(n, every.cut) {
        stats.cuts.fetch_add(1, Ordering::SeqCst);
        // A pause before the failure lets the head and the first 16 KiB go out: otherwise
        // hyper drops them unflushed and the proxy sees no response at all.
        let frames = futures_util::stream::unfold(0u8, |step| async move {
            match step {
                0 => Some((Ok(Frame::data(Bytes::from(vec![b'c'; 16 * 1024]))), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Some((Err(io::Error::other("soak fault: cut")), 2))
                }
                _ => None,
            }
        });
        let body = StreamBody::new(frames).boxed();
        let mut resp = Response::new(body);
        resp.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from(64 * 1024u64));
        return Ok(resp);
    }
    if hits(n, every.slow) {
        stats.slow.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/download") => {
            let len = query_bytes(&req) as usize;
            let mut resp = Response::new(full(vec![b'd'; len]));
            resp.headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from(len as u64));
            Ok(resp)
        }
        (&Method::POST | &Method::PUT, "/upload") => {
            let mut body = req.into_body();
            let mut total: u64 = 0;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => total += f.data_ref().map_or(0, |d| d.len() as u64),
                    Err(e) => return Err(io::Error::other(e)),
                }
            }
            Ok(Response::new(full(format!("{{\"received\":{total}}}"))))
        }
        _ => {
            let mut resp = Response::new(full(Bytes::from_static(SMALL)));
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Ok(resp)
        }
    }
}

async fn control(
    req: Request<Incoming>,
    stats: Arc<Stats>,
    close_idle: watch::Sender<u64>,
) -> Result<Response<ResBody>, Infallible> {
    let body = match (req.method(), req.uri().path()) {
        (&Method::GET, "/stats") => {
            let g = |a: &AtomicU64| a.load(Ordering::SeqCst);
            format!(
                "{{\"open\":{},\"requests\":{},\"resets\":{},\"errors\":{},\"cuts\":{},\"slow\":{}}}\n",
                g(&stats.open),
                g(&stats.requests),
                g(&stats.resets),
                g(&stats.errors),
                g(&stats.cuts),
                g(&stats.slow)
            )
        }
        (&Method::POST, "/close-idle") => {
            close_idle.send_modify(|n| *n += 1);
            "closing\n".to_string()
        }
        _ => {
            let mut resp = Response::new(full("no such control\n"));
            *resp.status_mut() = StatusCode::NOT_FOUND;
            return Ok(resp);
        }
    };
    Ok(Response::new(full(body)))
}

/// Counts an open data-plane connection for as long as it lives.
struct Open(Arc<Stats>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

fn arg(args: &[String], i: usize, default: u64) -> u64 {
    args.get(i)
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() -> io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    const USAGE: &str = "usage: soak_upstream CA_OUT [RESET ERROR CUT SLOW]";
    // `--help` was taken for CA_OUT: a certificate written to a file named `--help` and a
    // server left running.
    let Some(ca_out) = args.get(1).filter(|a| !a.starts_with('-')) else {
        println!("{USAGE}");
        return Ok(());
    };
    let every = Arc::new(Every {
        reset: arg(&args, 2, 97),
        error: arg(&args, 3, 89),
        cut: arg(&args, 4, 101),
        slow: arg(&args, 5, 53),
    });

    let certified =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".into()])
            .map_err(io::Error::other)?;
    std::fs::write(ca_out, certified.cert.pem())?;
    let key = rustls_pki_types::PrivateKeyDer::Pkcs8(rustls_pki_types::PrivatePkcs8KeyDer::from(
        certified.key_pair.serialize_der(),
    ));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_no_client_auth()
        .with_single_cert(vec![certified.cert.der().clone()], key)
        .map_err(io::Error::other)?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let control_listener = TcpListener::bind("127.0.0.1:0").await?;
        println!(
            "listening https://{} control http://{}",
            listener.local_addr()?,
            control_listener.local_addr()?
        );
        let stats = Arc::new(Stats::default());
        let (close_tx, close_rx) = watch::channel(0u64);

        {
            let stats = stats.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = control_listener.accept().await {
                    let (stats, close_tx) = (stats.clone(), close_tx.clone());
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            control(req, stats.clone(), close_tx.clone())
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            });
        }

        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            stats.open.fetch_add(1, Ordering::SeqCst);
            let open = Open(stats.clone());
            let (acceptor, stats, every) = (acceptor.clone(), stats.clone(), every.clone());
            let mut close_rx = close_rx.clone();
            close_rx.mark_unchanged();
            tokio::spawn(async move {
                let _open = open;
                let Ok(Ok(tls)) =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await
                else {
                    return;
                };
                let reset = Arc::new(AtomicBool::new(false));
                let io = Conn {
                    inner: tls,
                    reset: reset.clone(),
                };
                let svc = hyper::service::service_fn(move |req| {
                    data(req, stats.clone(), every.clone(), reset.clone())
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(io), svc);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = close_rx.changed() => conn.as_mut().graceful_shutdown(),
                }
                let _ = conn.await;
            });
        }
    })
}
