//! The proxy's own HTTP/1.1 upstream pool (`src/proxy/pool.rs`) end to end: the real
//! binary, envd in `sandbox_url` mode over TLS. envd is reached over HTTP/1.1 only, so
//! every request here goes through the pool, not hyper-util's client: bodies stream both
//! ways byte-identical whatever their framing, and sequential requests share one upstream
//! connection.

mod support;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use std::net::SocketAddr;
use support::*;
use tokio::sync::mpsc;

const BIG: u64 = 256 * 1024 * 1024;
const SMALL: u64 = 16 * 1024 * 1024;

fn envd(method: &str, addr: SocketAddr, path: &str) -> http::request::Builder {
    request(method, addr, path)
        .header("e2b-sandbox-id", "isb-pool")
        .header("x-access-token", "tok-pool")
}

/// An envd that stores uploads (answering with their hash) and serves generated files:
/// `/files/{len}` with a Content-Length, `/stream/{len}` chunked.
async fn envd_upstream(pki: &Pki) -> (Upstream, mpsc::UnboundedReceiver<(u64, [u8; 32])>) {
    let (got_tx, got_rx) = mpsc::unbounded_channel();
    let upstream = Upstream::start(pki, Proto::H2, move |req: Request<Incoming>| {
        let got_tx = got_tx.clone();
        async move {
            let path = req.uri().path().to_string();
            if req.method() == "PUT" {
                let got = hash_body(req.into_body()).await;
                let _ = got_tx.send(got);
                return response(200, "stored");
            }
            let (exact, len) = match path.split_once('/').map(|(_, p)| p.split_once('/')) {
                Some(Some(("files", len))) => (true, len.parse().unwrap()),
                Some(Some(("stream", len))) => (false, len.parse().unwrap()),
                _ => return response(404, "no such file"),
            };
            let seed = len ^ u64::from(exact);
            let (body, _) = GenBody::new(seed, len, exact);
            Response::new(boxed(body))
        }
    })
    .await;
    (upstream, got_rx)
}

async fn download(addr: SocketAddr, path: &str) -> Response<Incoming> {
    let resp = send(addr, envd("GET", addr, path).body(empty()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK, "{path}");
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_uploads_and_downloads_stream_byte_identical_over_one_connection() {
    let pki = Pki::new();
    let (mut upstream, mut got) = envd_upstream(&pki).await;
    let proxy = one_worker_proxy(&upstream.url(), &pki).await;
    let addr = proxy.addr();

    // Uploads: 256 MiB of unknown length (chunked upstream), then a known length.
    for (seed, len, exact) in [(1u64, BIG, false), (2, SMALL, true)] {
        let (body, sent) = GenBody::new(seed, len, exact);
        let req = envd("PUT", addr, "/files/upload")
            .header("content-type", "application/octet-stream")
            .body(boxed(body))
            .unwrap();
        let resp = send(addr, req).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(collect(resp.into_body()).await, "stored");
        let seen = upstream.next_request().await;
        assert_eq!(seen.version, http::Version::HTTP_11);
        if exact {
            assert_eq!(
                seen.header("content-length"),
                Some(len.to_string().as_str())
            );
            assert!(seen.header("transfer-encoding").is_none());
        } else {
            assert_eq!(seen.header("transfer-encoding"), Some("chunked"));
            assert!(seen.header("content-length").is_none());
        }
        let sent = within("the client's hash", sent).await.unwrap();
        let received = within("the upstream's hash", got.recv()).await.unwrap();
        assert_eq!(received.0, sent.0, "upload length");
        assert_eq!(
            hex(&received.1),
            hex(&sent.1),
            "upload corrupted on the way"
        );
    }

    // Downloads: 256 MiB with a Content-Length, then a chunked one.
    for (path, len, exact) in [
        (format!("/files/{BIG}"), BIG, true),
        (format!("/stream/{SMALL}"), SMALL, false),
    ] {
        let resp = download(addr, &path).await;
        if exact {
            assert_eq!(
                resp.headers()["content-length"].to_str().unwrap(),
                len.to_string()
            );
        }
        let (got_len, got_hash) = within("the download", hash_body(resp.into_body())).await;
        let (mut expect, _) = GenBody::new(len ^ u64::from(exact), len, exact);
        let (want_len, want_hash) = hash_body(&mut expect).await;
        assert_eq!(got_len, want_len, "{path}");
        assert_eq!(
            hex(&got_hash),
            hex(&want_hash),
            "{path} corrupted on the way"
        );
    }

    assert_eq!(
        upstream.connections(),
        1,
        "every sequential request reused the first upstream connection"
    );
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_envd_requests_then_sequential_ones_reuse_the_pool() {
    const N: usize = 16;
    let pki = Pki::new();
    let (upstream, _got) = envd_upstream(&pki).await;
    let proxy = one_worker_proxy(&upstream.url(), &pki).await;
    let addr = proxy.addr();

    let clients: Vec<_> = (0..N)
        .map(|i| {
            tokio::spawn(async move {
                let resp = download(addr, &format!("/files/{}", 8 * (i + 1))).await;
                collect(resp.into_body()).await.len()
            })
        })
        .collect();
    for (i, c) in clients.into_iter().enumerate() {
        assert_eq!(
            within("a concurrent download", c).await.unwrap(),
            8 * (i + 1)
        );
    }
    let after_burst = upstream.connections();
    assert!((1..=N).contains(&after_burst), "{after_burst}");
    for i in 0..N {
        let resp = download(addr, &format!("/stream/{}", 8 * (i + 1))).await;
        assert_eq!(collect(resp.into_body()).await.len(), 8 * (i + 1));
    }
    assert_eq!(
        upstream.connections(),
        after_burst,
        "sequential requests took idle connections, opened none"
    );
    proxy.finish().await;
}

/// The proxy with envd at `url` and one worker: idle upstream connections are per worker
/// thread, and which worker a new client connection lands on is the kernel's choice, so
/// counting upstream connections needs one.
async fn one_worker_proxy(url: &str, pki: &Pki) -> ProxyProc {
    ProxyCmd::new(url, pki)
        .args(&["--sandbox-url", url])
        .env("TOKIO_WORKER_THREADS", Some("1"))
        .spawn()
        .await
}
