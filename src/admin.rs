//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (a credential can be attached, and we are not draining). It stays up while the
//! proxy drains, answering 503 on `/readyz` until exit.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::proxy::body;
use crate::proxy::listener::Listener;
use crate::proxy::Proxy;
use crate::upstream::ProxyBody;

/// Connections served at once. Scrapers and probes need a few; the deployments bind the
/// admin listener beyond loopback, where anyone on the network could otherwise hold
/// connections (and memory, and descriptors the proxy needs) without end.
const MAX_CONNECTIONS: usize = 64;

/// Serves until the process exits, on TCP or a unix socket (`curl --unix-socket`). A
/// connection gets `header_timeout` for each request head, the wait for the next one on a
/// kept-alive connection included.
pub async fn serve(listener: Listener, proxy: Arc<Proxy>, header_timeout: Duration) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Without a timer hyper turns its header timeout off.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    loop {
        // Beyond the limit, new connections wait in the kernel's accept queue.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let accepted = match &listener {
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(s, _)| spawn(s, &proxy, &builder, slot)),
            Listener::Unix(l, _) => l
                .accept()
                .await
                .map(|(s, _)| spawn(s, &proxy, &builder, slot)),
        };
        if let Err(e) = accepted {
            // EMFILE and friends: the listener stays readable, so back off instead of
            // spinning on the thread that also runs the signals and the drain.
            tracing::warn!(error = %e, "admin accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn spawn<S>(
    stream: S,
    proxy: &Arc<Proxy>,
    builder: &hyper::server::conn::http1::Builder,
    slot: OwnedSemaphorePermit,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let proxy = proxy.clone();
    let connection = builder.serve_connection(
        TokioIo::new(stream),
        service_fn(move |req| answer(req, proxy.clone())),
    );
    tokio::spawn(async move {
        let _ = connection.await;
        drop(slot);
    });
}

async fn answer(
    req: Request<Incoming>,
    proxy: Arc<Proxy>,
) -> Result<Response<ProxyBody>, Infallible> {
    let text = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(body::full(body));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n"));
    }
    Ok(match req.uri().path() {
        "/metrics" => {
            // Read at scrape time: set after each change, two concurrent changes could
            // leave the count of the one that read the store first.
            proxy.metrics.envd_tokens.set(proxy.tokens.len() as i64);
            let mut r = Response::new(body::full(proxy.metrics.render()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if proxy.ready() => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    })
}
