//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (a credential can be attached, and we are not draining). It stays up while the
//! proxy drains, answering 503 on `/readyz` until exit.

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use crate::proxy::body;
use crate::proxy::listener::Listener;
use crate::proxy::Proxy;
use crate::upstream::ProxyBody;

/// Serves until the process exits, on TCP or a unix socket (`curl --unix-socket`).
pub async fn serve(listener: Listener, proxy: Arc<Proxy>) {
    loop {
        // A failed accept (a connection reset before it was taken) ends only that one.
        let _ = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| spawn(s, &proxy)),
            Listener::Unix(l, _) => l.accept().await.map(|(s, _)| spawn(s, &proxy)),
        };
    }
}

fn spawn<S>(stream: S, proxy: &Arc<Proxy>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let proxy = proxy.clone();
    tokio::spawn(async move {
        let service = service_fn(move |req| answer(req, proxy.clone()));
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
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
