//! Acceptance tests of the proxy core (SPEC §4, §6, §7): the real `abx-proxy` binary between
//! a hyper client (or raw bytes) and an in-process TLS upstream signed by a test CA. Every
//! test asserts on what the upstream RECEIVED, and ends by stopping the proxy with SIGTERM
//! and checking that the key appears nowhere in its debug-level stderr.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;
use support::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Many times every buffer on the way, and small enough that a debug build on a loaded
/// machine moves it well within GUARD.
const BIG: u64 = 64 * 1024 * 1024;

async fn connect_raw(addr: std::net::SocketAddr) -> TcpStream {
    within("connect to the proxy", TcpStream::connect(addr))
        .await
        .expect("connect to the proxy")
}

/// What every forwarded control-plane request must look like upstream.
fn assert_authorized(seen: &Seen, upstream: &Upstream) {
    assert_eq!(
        seen.all("authorization"),
        vec![format!("Bearer {API_KEY}")],
        "exactly the real key"
    );
    assert!(
        seen.header("x-api-key").is_none(),
        "client X-API-Key went upstream"
    );
    assert_eq!(
        seen.host(),
        upstream.addr.to_string(),
        "Host is the upstream's"
    );
}

// ---------------------------------------------------------------------------------------
// Headers
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_attached_client_credentials_and_hop_by_hop_removed() {
    let pki = Pki::new();
    let mut upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        let mut r = response(200, "listed");
        let h = r.headers_mut();
        h.insert("connection", "X-Resp-Hop".parse().unwrap());
        h.insert("x-resp-hop", "hop".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-authenticate", "Basic realm=x".parse().unwrap());
        // A request field, meaningless in a response, but hop-by-hop all the same.
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-resp-kept", "yes".parse().unwrap());
        r
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    // Raw bytes: header names in odd cases, two Connection lines (the first plain `close`),
    // and every hop-by-hop field the proxy must not pass on.
    let req = format!(
        "GET /sandboxes?limit=5 HTTP/1.1\r\n\
         Host: 127.0.0.1:{port}\r\n\
         X-Api-Key: dummy-1\r\n\
         x-API-KEY: dummy-2\r\n\
         AUTHORIZATION: Bearer dummy-3\r\n\
         Connection: close\r\n\
         Connection: X-Req-Hop, Keep-Alive\r\n\
         X-Req-Hop: hop\r\n\
         Keep-Alive: timeout=5\r\n\
         Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
         Proxy-Connection: keep-alive\r\n\
         TE: gzip\r\n\
         Expect: 100-continue\r\n\
         X-Kept: yes\r\n\r\n",
        port = addr.port()
    );
    let resp = raw_exchange(addr, req.as_bytes()).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.text(), "listed");

    let seen = upstream.next_request().await;
    assert_authorized(&seen, &upstream);
    assert_eq!(seen.method, "GET");
    assert_eq!(seen.path_and_query(), "/sandboxes?limit=5");
    for hop in [
        "connection",
        "x-req-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "transfer-encoding",
        "upgrade",
        // Not hop-by-hop, but met by the proxy itself (see `headers::strip`).
        "expect",
    ] {
        assert!(
            seen.header(hop).is_none(),
            "{hop} went upstream: {:?}",
            seen.headers
        );
    }
    assert_eq!(seen.header("x-kept"), Some("yes"));

    // The other direction.
    assert_eq!(resp.header("x-resp-kept"), Some("yes"));
    for hop in ["x-resp-hop", "keep-alive", "proxy-authenticate", "te"] {
        assert!(
            !resp.has(hop),
            "{hop} reached the client: {:?}",
            resp.headers
        );
    }
    if let Some(conn) = resp.header("connection") {
        assert!(
            conn.eq_ignore_ascii_case("close"),
            "upstream Connection leaked: {conn}"
        );
    }

    proxy.finish().await;
}

/// E2B's volume content API (`/volumecontent/…`, the SDKs' `Volume` file calls) is on the
/// control plane's host but takes the volume's own token: the client's `Authorization`
/// goes up as sent and no key is attached (the key put in its place failed every call),
/// read on the client's path under a base URL with a path of its own too. Its dummy
/// `X-API-Key` still goes nowhere; the control plane's other paths get the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_content_goes_with_the_clients_token_and_no_key() {
    let pki = Pki::new();
    let mut upstream =
        Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    for prefix in ["", "/api"] {
        let proxy = ProxyCmd::new(&format!("{}{prefix}", upstream.url()), &pki)
            .spawn()
            .await;
        let addr = proxy.addr();
        let req = request("PUT", addr, "/volumecontent/vol-1/file?path=%2Fa%20b")
            .header("authorization", "Bearer volume-token-1")
            .header("x-api-key", "dummy")
            .body(full("contents"))
            .unwrap();
        assert_eq!(send(addr, req).await.status(), StatusCode::OK, "{prefix}");
        let seen = upstream.next_request().await;
        assert_eq!(
            seen.path_and_query(),
            format!("{prefix}/volumecontent/vol-1/file?path=%2Fa%20b")
        );
        assert_eq!(seen.all("authorization"), vec!["Bearer volume-token-1"]);
        assert!(seen.header("x-api-key").is_none(), "{:?}", seen.headers);

        // None sent, none added.
        let req = request("GET", addr, "/volumecontent/vol-1/dir?path=%2F")
            .header("x-api-key", "dummy")
            .body(empty())
            .unwrap();
        assert_eq!(send(addr, req).await.status(), StatusCode::OK, "{prefix}");
        let seen = upstream.next_request().await;
        assert!(seen.header("authorization").is_none(), "{:?}", seen.headers);
        assert!(seen.header("x-api-key").is_none(), "{:?}", seen.headers);

        // The volumes themselves are the control plane's, as is any other path.
        for path in ["/volumes", "/volumecontent/"] {
            let req = request("GET", addr, path)
                .header("authorization", "Bearer volume-token-1")
                .body(empty())
                .unwrap();
            assert_eq!(send(addr, req).await.status(), StatusCode::OK, "{path}");
            assert_authorized(&upstream.next_request().await, &upstream);
        }
        proxy.finish().await;
    }
}

/// An HTTP/2 client connection (prior knowledge) to the proxy's plain listener.
async fn h2_prior_knowledge(
    addr: std::net::SocketAddr,
) -> hyper::client::conn::http2::SendRequest<TestBody> {
    let (h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(connect_raw(addr).await),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    h2
}

/// `req` sent bodiless on `h2`, to envd (the sandbox's routing headers added) when `envd`:
/// the answer, which must come (a reset stream fails the test).
async fn h2_send(
    h2: &mut hyper::client::conn::http2::SendRequest<TestBody>,
    mut req: http::request::Builder,
    envd: bool,
) -> Response<hyper::body::Incoming> {
    if envd {
        req = req
            .header("e2b-sandbox-id", "isb-1")
            .header("x-access-token", "t");
    }
    within(
        "an HTTP/2 answer",
        h2.send_request(req.body(empty()).unwrap()),
    )
    .await
    .expect("an HTTP/2 answer, not a reset stream")
}

/// An HTTP/2 client's cookies split over several `cookie` fields (browsers send them so,
/// to a sandbox's web app on the TLS listener) reach an HTTP/1.1 upstream as one field,
/// joined with "; " (RFC 9113 §8.2.3), on both planes. They went as one line each, and a
/// server reading one `Cookie` line saw the first cookie only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_http2_cookies_reach_an_http1_upstream_as_one_field() {
    let pki = Pki::new();
    let mut upstream =
        Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_URL", Some(&upstream.url()))
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut h2 = h2_prior_knowledge(addr).await;
    for envd in [false, true] {
        let req = Request::builder()
            .uri(format!("http://{addr}/sandboxes"))
            .header("x-api-key", "dummy")
            .header("cookie", "a=1")
            .header("cookie", "b=2");
        let resp = h2_send(&mut h2, req, envd).await;
        assert_eq!(resp.status(), StatusCode::OK, "envd: {envd}");
        let seen = upstream.next_request().await;
        assert_eq!(seen.version, http::Version::HTTP_11);
        assert_eq!(seen.all("cookie"), ["a=1; b=2"], "envd: {envd}");
    }
    proxy.finish().await;
}

/// A listener for an upstream written by hand (answers hyper's server would not give, or
/// bytes it would hide), and its URL.
async fn raw_upstream_listener() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    (listener, url)
}

/// An upstream's 204 that carries a `Content-Length` (RFC 9110 §8.6 forbids it) reaches an
/// HTTP/2 client as a 204 without one, on both planes: hyper's HTTP/2 server sent the
/// length with END_STREAM, a malformed answer the client reset, though the log said 204.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_204_with_a_length_reaches_an_http2_client_whole() {
    let pki = Pki::new();
    let (listener, url) = raw_upstream_listener().await;
    let upstream = tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = tcp.read(&mut buf).await {
                    head.extend_from_slice(&buf[..n]);
                    while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        head.drain(..end + 4);
                        let answer = b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n";
                        if tcp.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let proxy = ProxyCmd::new(&url, &pki)
        .env("ABX_SANDBOX_URL", Some(&url))
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut h2 = h2_prior_knowledge(addr).await;
    for envd in [false, true, false] {
        let req = Request::get(format!("http://{addr}/x")).header("x-api-key", "dummy");
        let resp = h2_send(&mut h2, req, envd).await;
        assert_eq!(resp.status(), StatusCode::NO_CONTENT, "envd: {envd}");
        assert!(
            resp.headers().get("content-length").is_none(),
            "envd: {envd}"
        );
    }
    proxy.finish().await;
    upstream.abort();
}

/// An HTTP/2 request with `content-length` said twice, equal (the h2 layer refuses lengths
/// that differ), is refused with 400 E5003 on both planes as HTTP/1.1's is, and reaches no
/// upstream: it went to an HTTP/2 control plane with both fields. The connection serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_content_length_said_twice_is_refused() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::H2, |_req| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_URL", Some(&upstream.url()))
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut h2 = h2_prior_knowledge(addr).await;
    let post = |path: &str, lengths: &[&str]| {
        let mut req = Request::post(format!("http://{addr}{path}")).header("x-api-key", "dummy");
        if path == "/files" {
            req = req
                .header("e2b-sandbox-id", "isb-1")
                .header("x-access-token", "t");
        }
        for l in lengths {
            req = req.header("content-length", *l);
        }
        req.body(full("hello")).unwrap()
    };
    for path in ["/sandboxes", "/files"] {
        let req = post(path, &["5", "5"]);
        let resp = within("an HTTP/2 answer", h2.send_request(req))
            .await
            .expect("HTTP/2");
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(resp.headers()["x-abx-error"], "E5003", "{path}");
        let text = String::from_utf8_lossy(&collect(resp.into_body()).await).into_owned();
        assert!(
            text.contains("more than one Content-Length"),
            "{path}: {text}"
        );
    }
    assert_eq!(
        upstream.seen().len(),
        0,
        "a refused request reached the upstream"
    );
    let resp = within("an HTTP/2 answer", h2.send_request(post("/files", &["5"])))
        .await
        .expect("HTTP/2");
    assert_eq!(resp.status(), StatusCode::OK);
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_upstream_gets_the_key_and_its_authority() {
    let pki = Pki::new();
    let mut upstream = Upstream::start(&pki, Proto::H2, |_req| async { response(200, "h2") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let req = request("GET", addr, "/templates")
        .header("x-api-key", "dummy")
        .header("authorization", "Bearer dummy")
        .body(empty())
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "h2");

    let seen = upstream.next_request().await;
    assert_eq!(seen.version, http::Version::HTTP_2);
    assert_authorized(&seen, &upstream);
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_upload_of_64_mib_arrives_byte_identical() {
    let pki = Pki::new();
    let (got_tx, mut got_rx) = mpsc::unbounded_channel();
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let got_tx = got_tx.clone();
        async move {
            let received = hash_body(req.into_body()).await;
            let _ = got_tx.send(received);
            response(200, "stored")
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let (body, sent) = GenBody::new(0x5eed_0001, BIG, false);
    let req = request("PUT", addr, "/files/upload")
        .header("content-type", "application/octet-stream")
        .body(boxed(body))
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "stored");

    let seen = upstream.next_request().await;
    assert_eq!(seen.header("transfer-encoding"), Some("chunked"));
    assert!(seen.header("content-length").is_none());
    let (sent_len, sent_hash) = within("the client's hash", sent).await.unwrap();
    let (got_len, got_hash) = within("the upstream's hash", got_rx.recv()).await.unwrap();
    assert_eq!(got_len, sent_len);
    assert_eq!(
        hex(&got_hash),
        hex(&sent_hash),
        "upload corrupted on the way"
    );
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_of_64_mib_arrives_byte_identical() {
    let pki = Pki::new();
    let (hash_tx, mut hash_rx) = mpsc::unbounded_channel();
    let upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let (body, sent) = GenBody::new(0x5eed_0002, BIG, true);
        let hash_tx = hash_tx.clone();
        tokio::spawn(async move {
            if let Ok(h) = sent.await {
                let _ = hash_tx.send(h);
            }
        });
        async move { Response::new(boxed(body)) }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let resp = send(
        addr,
        request("GET", addr, "/files/big").body(empty()).unwrap(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()
            .get("content-length")
            .map(|v| v.to_str().unwrap()),
        Some(BIG.to_string().as_str())
    );
    let (got_len, got_hash) = within("the download", hash_body(resp.into_body())).await;
    let (sent_len, sent_hash) = within("the upstream's hash", hash_rx.recv()).await.unwrap();
    assert_eq!(got_len, sent_len);
    assert_eq!(
        hex(&got_hash),
        hex(&sent_hash),
        "download corrupted on the way"
    );
    proxy.finish().await;
}

/// Chunk 2 is only sent after the client has chunk 1: a buffering proxy deadlocks here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stream_reaches_the_client_chunk_by_chunk() {
    const FIRST: &[u8] = b"event: one\n\n";
    const SECOND: &[u8] = b"event: two\n\n";
    let pki = Pki::new();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let release_rx = Arc::new(Mutex::new(Some(release_rx)));
    let upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let release = release_rx
            .lock()
            .unwrap()
            .take()
            .expect("one stream request");
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(FIRST)).await;
            if release.await.is_ok() {
                let _ = tx.send(Bytes::from_static(SECOND)).await;
            }
        });
        async move {
            let mut r = Response::new(boxed(ChannelBody(rx)));
            r.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            r
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let resp = send(addr, request("GET", addr, "/stream").body(empty()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while got.len() < FIRST.len() {
        let frame = within("chunk 1 before chunk 2 is even sent", body.frame())
            .await
            .expect("stream ended early")
            .expect("stream failed");
        got.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    assert_eq!(got, FIRST);
    release_tx.send(()).unwrap();
    let rest = within("chunk 2", body.collect()).await.unwrap().to_bytes();
    assert_eq!(&rest[..], SECOND);
    proxy.finish().await;
}

/// A client that dies mid-upload must not become a complete (truncated) body upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_abort_mid_upload_reaches_upstream_as_an_error() {
    let pki = Pki::new();
    let (outcome_tx, mut outcome_rx) = mpsc::unbounded_channel();
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let outcome_tx = outcome_tx.clone();
        async move {
            let mut body = req.into_body();
            let mut got = 0usize;
            let outcome = loop {
                match body.frame().await {
                    None => break Ok(got),
                    Some(Ok(f)) => got += f.into_data().map_or(0, |d| d.len()),
                    Some(Err(e)) => break Err(e.to_string()),
                }
            };
            let _ = outcome_tx.send(outcome);
            response(200, "")
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let mut s = connect_raw(addr).await;
    let head = format!(
        "PUT /files/upload HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    upstream.next_request().await;
    drop(s);
    let outcome = within("the upstream's view of the body", outcome_rx.recv())
        .await
        .unwrap();
    assert!(
        outcome.is_err(),
        "a truncated upload ended cleanly upstream: {outcome:?}"
    );
    proxy.finish().await;
}

/// An upstream that dies mid-download must not look like a complete body to the client, and
/// is counted as an upstream `reset` once the head was answered: over HTTP/1.1 (the body
/// cut short) and HTTP/2 (the stream reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_abort_mid_download_reaches_the_client_as_an_error() {
    for proto in [Proto::Http1, Proto::H2] {
        abort_mid_download(proto).await;
    }
}

async fn abort_mid_download(proto: Proto) {
    let pki = Pki::new();
    let (upstream, cut) = cutting_upstream(&pki, proto).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let resp = send(
        addr,
        request("GET", addr, "/files/big").body(empty()).unwrap(),
    )
    .await;
    let (got, failed) = read_cut_download(resp, cut).await;
    assert!(
        failed,
        "{proto:?}: a truncated download ended cleanly: {:?}",
        String::from_utf8_lossy(&got)
    );
    let text = scrape(proxy.admin_addr()).await;
    assert_one_upstream_error(&text, "api", "reset");
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// Upgrades
// ---------------------------------------------------------------------------------------

/// A WebSocket upstream: it answers an upgrade with 101, greets, then echoes what it gets
/// until the client's side ends (at [`STICKY`], then holds its own side open without a
/// word, as a server that ignores a FIN). Any other request is answered with how many of
/// its tunnels are open (`tunnels=N`).
async fn websocket_upstream(pki: &Pki) -> Upstream {
    let tunnels = Arc::new(AtomicUsize::new(0));
    Upstream::start(pki, Proto::H2, move |mut req| {
        let upgrade = req.headers().contains_key("upgrade");
        let sticky = req.uri().path() == STICKY;
        let late = req.uri().path() == LATE;
        let open = tunnels.load(Ordering::SeqCst);
        if upgrade {
            let on_upgrade = hyper::upgrade::on(&mut req);
            let tunnels = tunnels.clone();
            tokio::spawn(async move {
                let Ok(upgraded) = on_upgrade.await else {
                    return;
                };
                tunnels.fetch_add(1, Ordering::SeqCst);
                let mut io = hyper_util::rt::TokioIo::new(upgraded);
                echo_until_closed(&mut io).await;
                if late {
                    // An answer that takes a moment, after the client's end.
                    tokio::time::sleep(LATE_BY).await;
                    let _ = io.write_all(LATE_ANSWER).await;
                    let _ = io.shutdown().await;
                }
                if sticky {
                    // Held (bounded, as everything here), its side never closed.
                    tokio::time::sleep(GUARD).await;
                }
                // Before the socket closes: whoever sees it closed sees the count without it.
                tunnels.fetch_sub(1, Ordering::SeqCst);
            });
        }
        async move {
            if !upgrade {
                return response(200, format!("tunnels={open}"));
            }
            let mut r = response(101, Bytes::new());
            let h = r.headers_mut();
            h.insert("connection", "Upgrade".parse().unwrap());
            h.insert("upgrade", "websocket".parse().unwrap());
            h.insert(
                "sec-websocket-accept",
                "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=".parse().unwrap(),
            );
            r
        }
    })
    .await
}

/// The upstream's side of a tunnel: [`GREETING`], then echoes.
async fn echo_until_closed<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S) {
    if io.write_all(GREETING).await.is_err() {
        return;
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match io.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if io.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// What [`websocket_upstream`] sends first through a new tunnel.
const GREETING: &[u8] = b"hello from upstream\n";

/// The path at which [`websocket_upstream`] ignores the end of the client's side.
const STICKY: &str = "/sticky";
/// The path at which [`websocket_upstream`] answers [`LATE_ANSWER`] [`LATE_BY`] after the
/// end of the client's side, then ends its own.
const LATE: &str = "/late";
const LATE_BY: Duration = Duration::from_millis(3500);
const LATE_ANSWER: &[u8] = b"the answer, late";

fn websocket_request(addr: std::net::SocketAddr) -> String {
    websocket_request_to(addr, "/ws?x=1")
}

fn websocket_request_to(addr: std::net::SocketAddr, target: &str) -> String {
    format!(
        "GET {target} HTTP/1.1\r\nHost: localhost:{}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         X-API-Key: dummy\r\n\r\n",
        addr.port()
    )
}

/// Reads the upstream's greeting; `buf` holds what came with the 101.
async fn read_greeting(s: &mut TcpStream, mut buf: Vec<u8>) {
    while buf.len() < GREETING.len() {
        let mut tmp = [0u8; 1024];
        let n = within("the upstream's greeting", s.read(&mut tmp))
            .await
            .unwrap();
        assert!(n > 0, "tunnel closed");
        buf.extend_from_slice(&tmp[..n]);
    }
    assert_eq!(&buf[..], GREETING);
}

/// Asks [`websocket_upstream`] how many tunnels it has open, on a connection of its own.
fn tunnels_request(addr: std::net::SocketAddr) -> String {
    format!(
        "GET /tunnels HTTP/1.1\r\nHost: localhost:{}\r\nConnection: close\r\n\r\n",
        addr.port()
    )
}

/// A [`websocket_upstream`] and a proxy in front of it, started with `args`.
async fn behind_websocket_upstream(pki: &Pki, args: &[&str]) -> (Upstream, ProxyProc) {
    let upstream = websocket_upstream(pki).await;
    let proxy = ProxyCmd::new(&upstream.url(), pki).args(args).spawn().await;
    (upstream, proxy)
}

/// A WebSocket tunnel through the proxy at `addr`, past the 101 and the greeting.
async fn open_tunnel(addr: std::net::SocketAddr) -> TcpStream {
    open_tunnel_to(addr, "/ws?x=1").await
}

/// [`open_tunnel`] to `target`.
async fn open_tunnel_to(addr: std::net::SocketAddr, target: &str) -> TcpStream {
    let (mut s, resp, buf) = raw_open(addr, websocket_request_to(addr, target).as_bytes()).await;
    assert_eq!(resp.status, 101, "{resp:?}");
    read_greeting(&mut s, buf).await;
    s
}

/// Only WebSocket is tunnelled, as nginx and envoy do: another `Upgrade` (curl's `h2c`
/// over plain HTTP) goes no further than the proxy, and the request is answered as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_other_than_websocket_are_not_passed_on() {
    let pki = Pki::new();
    let upstream = websocket_upstream(&pki).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let req = format!(
        "GET /h2c HTTP/1.1\r\nHost: localhost:{}\r\nConnection: Upgrade, HTTP2-Settings\r\n\
         Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\nX-API-Key: dummy\r\n\r\n",
        addr.port()
    );
    let (_s, resp, _) = raw_open(addr, req.as_bytes()).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    for name in ["upgrade", "connection", "http2-settings"] {
        assert_eq!(seen[0].header(name), None, "{name} went upstream");
    }
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_tunnels_bytes_both_ways() {
    let pki = Pki::new();
    let mut upstream = websocket_upstream(&pki).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let (mut s, resp, buf) = raw_open(addr, websocket_request(addr).as_bytes()).await;
    assert_eq!(resp.status, 101, "{resp:?}");
    assert_eq!(resp.header("upgrade"), Some("websocket"));
    assert!(resp
        .header("connection")
        .is_some_and(|c| c.eq_ignore_ascii_case("upgrade")));
    assert_eq!(
        resp.header("sec-websocket-accept"),
        Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
    );

    let seen = upstream.next_request().await;
    assert_authorized(&seen, &upstream);
    assert_eq!(
        seen.version,
        http::Version::HTTP_11,
        "upgrades go over HTTP/1.1"
    );
    assert_eq!(seen.header("upgrade"), Some("websocket"));
    assert!(seen
        .header("connection")
        .is_some_and(|c| c.to_ascii_lowercase().contains("upgrade")));
    assert_eq!(
        seen.header("sec-websocket-key"),
        Some("dGhlIHNhbXBsZSBub25jZQ==")
    );
    assert_eq!(seen.path_and_query(), "/ws?x=1");

    // Upstream → client first, then echoes of what the client sends, small and large.
    read_greeting(&mut s, buf).await;
    for size in [5usize, 1024 * 1024] {
        let mut payload = vec![0u8; size.next_multiple_of(8)];
        Gen::new(size as u64).fill(&mut payload);
        echo(&mut s, &payload).await;
    }
    drop(s);
    proxy.finish().await;
}

/// A tunnel keeps its connection's place under `--max-connections`: with one allowed, the
/// next connection waits in the kernel's accept queue while the tunnel is open, and a drain
/// that begins meanwhile never serves it (the listener's close resets it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_tunnel_holds_its_place_under_max_connections() {
    let pki = Pki::new();
    let (upstream, mut proxy) = behind_websocket_upstream(&pki, &["--max-connections", "1"]).await;
    let addr = proxy.addr();

    let mut tunnel = open_tunnel(addr).await;
    let mut next = connect_raw(addr).await;
    next.write_all(tunnels_request(addr).as_bytes())
        .await
        .unwrap();

    proxy.signal("TERM");
    proxy.wait_for_line("listener closed").await;
    // A connection the proxy had accepted would now get its answer (`tunnels=1`).
    expect_closed(&mut next, &[]).await;
    echo(&mut tunnel, b"still open").await;
    tunnel.shutdown().await.unwrap();
    expect_closed(&mut tunnel, &[]).await;
    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    let served = upstream
        .seen()
        .iter()
        .any(|r| r.path_and_query() == "/tunnels");
    assert!(
        !served,
        "the queued connection's request reached the upstream"
    );
}

// ---------------------------------------------------------------------------------------
// The /v2 compatibility rewrite
// ---------------------------------------------------------------------------------------

async fn recording_upstream(pki: &Pki) -> (Upstream, mpsc::UnboundedReceiver<(String, Bytes)>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let upstream = Upstream::start(pki, Proto::Http1, move |req| {
        let tx = tx.clone();
        async move {
            let path = req.uri().path().to_string();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let _ = tx.send((path, body));
            response(201, r#"{"sandboxID":"x","clientID":"c"}"#)
        }
    })
    .await;
    (upstream, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_paths_are_rewritten_with_the_fields_v1_expects() {
    let pki = Pki::new();
    let (upstream, mut bodies) = recording_upstream(&pki).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let create = json!({"templateID": "base", "timeout": 300, "metadata": {"a": "b"}});
    let req = request("POST", addr, "/v2/sandboxes")
        .header("content-type", "application/json")
        .body(full(create.to_string()))
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let (path, body) = within("the create", bodies.recv()).await.unwrap();
    assert_eq!(path, "/sandboxes");
    let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut expected = create.clone();
    expected["secure"] = json!(true);
    assert_eq!(sent, expected);

    let req = request("POST", addr, "/v2/sandboxes/x/connect")
        .header("content-type", "application/json")
        .body(full(r#"{"timeout":60}"#))
        .unwrap();
    assert_eq!(send(addr, req).await.status(), StatusCode::CREATED);
    let (path, body) = within("the connect", bodies.recv()).await.unwrap();
    assert_eq!(path, "/sandboxes/x/connect");
    assert_eq!(&body[..], br#"{"timeout":60}"#);

    // SDKs 2.51+ connect with `{}`; `/v2` defaults the timeout to 300, the v1 path needs it.
    let req = request("POST", addr, "/v2/sandboxes/x/connect")
        .header("content-type", "application/json")
        .body(full("{}"))
        .unwrap();
    assert_eq!(send(addr, req).await.status(), StatusCode::CREATED);
    let (path, body) = within("the connect", bodies.recv()).await.unwrap();
    assert_eq!(path, "/sandboxes/x/connect");
    assert_eq!(&body[..], br#"{"timeout":300}"#);

    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[2].header("content-length"), Some("15"));
    assert_eq!(
        seen[0].header("content-length"),
        Some(body_len(&sent).as_str()),
        "the rewritten create carries its new length"
    );
    for s in &seen {
        assert_authorized(s, &upstream);
    }
    proxy.finish().await;
}

fn body_len(v: &serde_json::Value) -> String {
    serde_json::to_vec(v).unwrap().len().to_string()
}

/// `--compat-v2-paths pass`: the client's `/v2` paths, bodies untouched, also under an
/// upstream URL with a path of its own (the path is joined, never stripped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_paths_pass_through_with_compat_pass() {
    let pki = Pki::new();
    let (upstream, mut bodies) = recording_upstream(&pki).await;
    for prefix in ["", "/api"] {
        let proxy = ProxyCmd::new(&format!("{}{prefix}", upstream.url()), &pki)
            .args(&["--compat-v2-paths", "pass"])
            .spawn()
            .await;
        let addr = proxy.addr();

        let create = r#"{"templateID":"base"}"#;
        let req = request("POST", addr, "/v2/sandboxes")
            .body(full(create))
            .unwrap();
        assert_eq!(send(addr, req).await.status(), StatusCode::CREATED);
        let (path, body) = within("the create", bodies.recv()).await.unwrap();
        assert_eq!(path, format!("{prefix}/v2/sandboxes"));
        assert_eq!(&body[..], create.as_bytes(), "body untouched");

        let req = request("POST", addr, "/v2/sandboxes/x/connect")
            .body(empty())
            .unwrap();
        assert_eq!(send(addr, req).await.status(), StatusCode::CREATED);
        let (path, _) = within("the connect", bodies.recv()).await.unwrap();
        assert_eq!(path, format!("{prefix}/v2/sandboxes/x/connect"));
        proxy.finish().await;
    }
}

// ---------------------------------------------------------------------------------------
// Redirects and refusals
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_are_passed_back_not_followed() {
    let pki = Pki::new();
    let elsewhere = Upstream::start(&pki, Proto::Http1, |_req| async {
        response(200, "followed")
    })
    .await;
    let location = format!("https://127.0.0.1:{}/landing", elsewhere.addr.port());
    let upstream = {
        let location = location.clone();
        Upstream::start(&pki, Proto::Http1, move |_req| {
            let location = location.clone();
            async move {
                let mut r = response(302, "");
                r.headers_mut()
                    .insert("location", location.parse().unwrap());
                r
            }
        })
        .await
    };
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let resp = send(
        addr,
        request("GET", addr, "/sandboxes/x/logs")
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::FOUND);
    assert_eq!(resp.headers()["location"], location.as_str());
    assert_eq!(upstream.seen().len(), 1);
    assert_eq!(
        elsewhere.connections(),
        0,
        "the proxy followed the redirect"
    );
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_targets_and_hosts_are_refused_without_contacting_upstream() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let local = format!("127.0.0.1:{}", addr.port());

    let refused = [
        // absolute-form to a foreign authority: not a forward proxy
        "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n".to_string(),
        format!("GET http://example.com/sandboxes HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        // CONNECT tunnels
        "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n".to_string(),
        format!("CONNECT {local} HTTP/1.1\r\nHost: {local}\r\n\r\n"),
        // DNS rebinding: a page on evil.example resolving to 127.0.0.1
        "GET /sandboxes HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".to_string(),
        format!("GET /sandboxes HTTP/1.1\r\nHost: evil.example:{}\r\nConnection: close\r\n\r\n", addr.port()),
        "GET /sandboxes HTTP/1.1\r\nHost: localhost.evil.example\r\nConnection: close\r\n\r\n".to_string(),
        "GET /sandboxes HTTP/1.1\r\nHost: 10.0.0.1\r\nConnection: close\r\n\r\n".to_string(),
        "GET /sandboxes HTTP/1.1\r\nConnection: close\r\n\r\n".to_string(),
        // two Hosts: a peer routing on the other one would see a different request
        format!("GET /sandboxes HTTP/1.1\r\nHost: {local}\r\nHost: evil.example\r\nConnection: close\r\n\r\n"),
        // no `host[:port]`, though it ends in `.localhost` (RFC 9112 §3.2: 400); userinfo
        // hid a sandbox's name, and its request went to the control plane with the key
        "GET /sandboxes HTTP/1.1\r\nHost: evil.example/x.localhost\r\nConnection: close\r\n\r\n".to_string(),
        "GET /sandboxes HTTP/1.1\r\nHost: evil.example x.localhost\r\nConnection: close\r\n\r\n".to_string(),
        "GET /sandboxes HTTP/1.1\r\nHost: user@49983-isb-d.localhost\r\nConnection: close\r\n\r\n".to_string(),
        format!("GET http://user@{local}/sandboxes HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        // dot segments: under a base URL's path they left the prefix at an upstream that
        // resolves them
        format!("GET /../admin HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        format!("GET /v2/sandboxes/%2E%2e/x HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        format!("GET /..;/x HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        format!("GET /./sandboxes HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        // separators a gateway may decode or read as `/`, parameters Tomcat drops
        format!("GET /a%2f..%2f..%2fadmin HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        format!("GET /..\\admin HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        format!("GET /a/..%3B/b HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n"),
        // a host and then no port
        "GET /sandboxes HTTP/1.1\r\nHost: x:1:49983-isb-1.localhost\r\nConnection: close\r\n\r\n".to_string(),
        "GET /sandboxes HTTP/1.1\r\nHost: [::1]junk\r\nConnection: close\r\n\r\n".to_string(),
    ];
    for req in &refused {
        let resp = raw_exchange(addr, req.as_bytes()).await;
        assert_proxy_error(&resp, 400, "E5003");
        assert!(
            !resp.text().contains("dummy"),
            "request: {req:?} → {:?}",
            resp.text()
        );
    }
    // A name the user reaches the proxy by is one flag away, and the refusal says which.
    let resp = raw_exchange(addr, refused[4].as_bytes()).await;
    assert!(
        resp.text().contains("--allowed-host evil.example"),
        "{:?}",
        resp.text()
    );
    assert_eq!(
        upstream.connections(),
        0,
        "a refused request reached the upstream"
    );

    // The loopback names that must pass: all of 127.0.0.0/8, and any name under
    // `localhost` (browsers and the SDKs' `<port>-<id>.localhost` resolve them locally).
    let port = addr.port();
    for host in [
        local.clone(),
        format!("localhost:{port}"),
        "[::1]".into(),
        format!("127.1.2.3:{port}"),
        "foo.localhost".into(),
        format!("foo.localhost:{port}"),
    ] {
        let resp = with_host(addr, &host, "/sandboxes").await;
        assert_eq!(resp.status, 200, "Host {host}: {:?}", resp.text());
    }
    // Dots that make no segment of their own pass.
    for path in [
        "/process.Process/Start",
        "/files/.env",
        "/a/.../b",
        "/x..y/%2e%2ex",
    ] {
        let resp = with_host(addr, &local, path).await;
        assert_eq!(resp.status, 200, "{path}: {:?}", resp.text());
    }
    // A refused CONNECT's line names what it asked for (its target has no path), without
    // a password a client put before its host.
    let connect = "CONNECT user:hunter2@example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
    assert_proxy_error(&raw_exchange(addr, connect.as_bytes()).await, 400, "E5003");
    let stderr = proxy.finish().await;
    let connects: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("abx_proxy::access") && l.contains("method=CONNECT"))
        .collect();
    assert_eq!(connects.len(), 3, "{stderr}");
    for target in ["path=example.com:443 ", &format!("path={local} ")] {
        assert!(
            connects.iter().any(|l| l.contains(target)),
            "{target}: {connects:?}"
        );
    }
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

/// An absolute-form target without a path (`GET http://localhost:PORT?q=1`) has the path
/// `/` (RFC 9110 §4.2.3): it went upstream as `GET ?q=1 HTTP/1.1`, which nginx refuses.
/// A raw upstream: hyper's server reads `?q=1` as `/?q=1` and would hide it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_without_a_path_goes_upstream_with_one() {
    let pki = Pki::new();
    let (listener, url) = raw_upstream_listener().await;
    let upstream = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut head = Vec::new();
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed before the head");
            head.extend_from_slice(&buf[..n]);
        }
        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        s.write_all(reply).await.expect("write");
        head
    });
    let proxy = ProxyCmd::new(&url, &pki).spawn().await;
    let addr = proxy.addr();
    let local = format!("127.0.0.1:{}", addr.port());
    let req =
        format!("GET http://{local}?q=1 HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n");
    let resp = raw_exchange(addr, req.as_bytes()).await;
    assert_eq!(resp.status, 200, "{:?}", resp.text());
    let head = within("the upstream's request", upstream)
        .await
        .expect("upstream");
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    assert_eq!(String::from_utf8_lossy(line), "GET /?q=1 HTTP/1.1");
    proxy.finish().await;
}

/// A web page can make a browser send requests to the proxy with a local Host (the page
/// names `http://127.0.0.1:49982` itself; no DNS rebinding needed): a cross-origin `fetch`,
/// a form post, a preflight, an `<img>`. Each is refused before the upstream is asked,
/// whatever the method; a page served from a local origin (a dev server on localhost) is
/// served, as are the SDKs, which send no `Origin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_from_another_sites_pages_are_refused() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let host = format!("127.0.0.1:{}", addr.port());
    let browser = |method: &str, extra: &str| {
        format!(
            "{method} /refused HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
    };
    for req in [
        browser(
            "GET",
            "Origin: https://evil.example\r\nSec-Fetch-Mode: cors\r\n",
        ),
        browser(
            "POST",
            "Origin: https://evil.example\r\nContent-Type: text/plain\r\n",
        ),
        browser(
            "OPTIONS",
            "Origin: https://evil.example\r\nAccess-Control-Request-Method: DELETE\r\n",
        ),
        browser("POST", "Origin: null\r\n"),
        browser(
            "GET",
            "Sec-Fetch-Site: cross-site\r\nSec-Fetch-Mode: no-cors\r\n",
        ),
    ] {
        let resp = raw_exchange(addr, req.as_bytes()).await;
        assert_proxy_error(&resp, 400, "E5003");
    }
    assert_not_reached(&upstream, "/refused", "a cross-site request");
    let local = browser(
        "GET",
        "Origin: http://localhost:3000\r\nSec-Fetch-Site: cross-site\r\nSec-Fetch-Mode: cors\r\n",
    )
    .replace("/refused", "/served");
    assert_eq!(raw_exchange(addr, local.as_bytes()).await.status, 200);
    proxy.finish().await;
}

/// No request for `path` reached `upstream`.
fn assert_not_reached(upstream: &Upstream, path: &str, what: &str) {
    let reached = upstream.seen().iter().any(|r| r.path_and_query() == path);
    assert!(!reached, "{what} reached the upstream");
}

/// `GET path` with `Host: host` on a fresh connection that closes after the answer.
async fn with_host(addr: std::net::SocketAddr, host: &str, path: &str) -> RawResponse {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    raw_exchange(addr, req.as_bytes()).await
}

/// `--allow-remote` lifts the loopback-only Host check, also on a loopback listener (SPEC
/// §4, e.g. behind a reverse proxy that keeps the client's Host): without `--allowed-host`
/// any Host is served; with `--allowed-host proxy.internal` that name is served (with a
/// port, in any case) and so are the local names, which no DNS-rebinding page can send,
/// while any other Host gets 400 E5003 without the upstream being asked. `--allowed-host`
/// on a loopback listener without `--allow-remote` accepts the same names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_remote_and_allowed_host_decide_which_hosts_are_served() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let any = ProxyCmd::new(&upstream.url(), &pki)
        .arg("--allow-remote")
        .spawn()
        .await;
    // Values as users write them: in capitals, with a trailing dot, an IPv6 address
    // without brackets, a blank one (skipped, as every blank value is).
    let listed = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--allow-remote", "--allowed-host", "proxy.internal"])
        .args(&[
            "--allowed-host",
            "Other.Example.",
            "--allowed-host",
            "FD00::1",
            "--allowed-host",
            "[2001:db8:0:0::5]",
            // IPv4 written as IPv6, both ways round.
            "--allowed-host",
            "[::ffff:10.0.0.6]",
            "--allowed-host",
            "10.0.0.7",
        ])
        .args(&["--allowed-host", " "])
        .spawn()
        .await;
    // On loopback without --allow-remote the list adds to the local names (an alias in
    // /etc/hosts, a TLS certificate's name), rather than being ignored.
    let listed_local = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--allowed-host", "proxy.internal"])
        .spawn()
        .await;

    for host in ["evil.example", "10.0.0.1:8080", "proxy.internal"] {
        let resp = with_host(any.addr(), host, "/served").await;
        assert_eq!(resp.status, 200, "any Host: {host}: {:?}", resp.text());
    }
    // Any Host, but still not a forward proxy: an absolute-form target must name the
    // proxy itself (here, a local name).
    let forward =
        "GET http://example.com/refused HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n";
    assert_proxy_error(
        &raw_exchange(any.addr(), forward.as_bytes()).await,
        400,
        "E5003",
    );

    // An address in any spelling, whichever the flag used (curl shortens it, httpx
    // sends it as written).
    for host in [
        "other.example",
        "other.example.",
        "[fd00::1]:8443",
        "[fd00:0::1]",
        "[2001:DB8::5]:1",
        "proxy.internal.",
        "10.0.0.6:8080",
        "[::ffff:10.0.0.7]:8080",
        "[::ffff:a00:6]",
    ] {
        let resp = with_host(listed.addr(), host, "/served").await;
        assert_eq!(resp.status, 200, "listed: Host {host}: {:?}", resp.text());
    }
    // A value with a port could never match a Host: refused on the command line.
    let (status, stderr) = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--allowed-host", "proxy.internal:8443"])
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("without a port"), "{stderr}");

    for proxy in [&listed, &listed_local] {
        let port = proxy.addr().port();
        for host in [
            "proxy.internal".to_string(),
            format!("proxy.internal:{port}"),
            "PROXY.Internal".into(),
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            "foo.localhost".into(),
        ] {
            let resp = with_host(proxy.addr(), &host, "/served").await;
            assert_eq!(resp.status, 200, "listed: Host {host}: {:?}", resp.text());
        }
        for host in [
            "evil.example".to_string(),
            format!("evil.example:{port}"),
            "proxy.internal.evil.example".into(),
            "internal".into(),
            "10.0.0.1".into(),
        ] {
            let resp = with_host(proxy.addr(), &host, "/refused").await;
            assert_proxy_error(&resp, 400, "E5003");
        }
    }
    assert_not_reached(&upstream, "/refused", "a refused Host");
    any.finish().await;
    listed.finish().await;
    listed_local.finish().await;
}

// ---------------------------------------------------------------------------------------
// Upstream failures
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502_e5001() {
    let pki = Pki::new();
    let proxy = ProxyCmd::new(&format!("https://{}", refused_addr().await), &pki)
        .spawn()
        .await;
    let addr = proxy.addr();

    let req = format!(
        "GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\nConnection: close\r\n\r\n"
    );
    let resp = raw_exchange(addr, req.as_bytes()).await;
    assert_proxy_error(&resp, 502, "E5001");
    assert_eq!(resp.header("content-type"), Some("application/json"));
    proxy.finish().await;
}

/// An answer the proxy gave itself says its E-code on the access line, and an upstream it
/// could not reach why; the upstream's own 502 says none (the two looked alike in the
/// log: the E-code and the reason reached only the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_own_answers_say_their_e_code_on_the_access_line() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        response(502, "bad gateway")
    })
    .await;
    let refused = format!("http://{}", refused_addr().await);
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--sandbox-url", &refused])
        .spawn()
        .await;
    let addr = proxy.addr();
    let api = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    assert_eq!(raw_exchange(addr, api.as_bytes()).await.status, 502);
    let envd = format!(
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nE2b-Sandbox-Id: isb-1\r\n\
         X-Access-Token: t\r\nConnection: close\r\n\r\n"
    );
    assert_proxy_error(&raw_exchange(addr, envd.as_bytes()).await, 502, "E5001");
    let log = proxy.finish().await;
    let line = |plane: &str| {
        let plane = format!("plane=\"{plane}\" status=502");
        let found = log.lines().find(|l| l.contains(&plane));
        found
            .unwrap_or_else(|| panic!("no {plane} line: {log}"))
            .to_string()
    };
    assert!(!line("api").contains("error="), "{}", line("api"));
    // And why, as the client's body says it: nginx's error log names a refused connect.
    assert!(
        line("envd").ends_with(" error=\"E5001\" reason=\"connect refused\""),
        "{}",
        line("envd")
    );
}

/// A `${VAR}` in a `.env` file can put a secret into an upstream's host. Printed masked,
/// it was still looked up in DNS in clear: `serve` refuses it before it binds (E1005, the
/// setting named, never the value), on both planes and for the exchange endpoint. The
/// secret here is `localhost`, which resolves without asking DNS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_secret_embedded_in_an_upstream_host() {
    let pki = Pki::new();
    let port = refused_addr().await.port();
    for (key, dotenv) in [
        (
            "sandbox_base_url",
            format!("ABX_SANDBOX_BASE_URL=http://${{GITHUB_TOKEN}}:{port}\n"),
        ),
        (
            "sandbox_url",
            format!("ABX_SANDBOX_URL=http://${{GITHUB_TOKEN}}:{port}\n"),
        ),
        (
            "token_exchange_url",
            format!("ABX_TOKEN_EXCHANGE_URL=http://${{GITHUB_TOKEN}}:{port}\n"),
        ),
    ] {
        let mut cmd = ProxyCmd::new(&format!("http://127.0.0.1:{port}"), &pki)
            .omit(&["--sandbox-base-url"])
            .cwd_dotenv(&format!("GITHUB_TOKEN=localhost\n{dotenv}"));
        // The exchange endpoint is looked up for an AccessKey pair only.
        if key == "token_exchange_url" {
            cmd = cmd
                .env("ABX_SANDBOX_API_KEY", None)
                .env("ALICLOUD_ACCESS_KEY_ID", Some("LTAI5tPxMaskedHostId"))
                .env(
                    "ALICLOUD_ACCESS_KEY_SECRET",
                    Some("masked-host-secret-0123456789"),
                );
        }
        let (status, stderr) = cmd.run_to_exit().await;
        assert_eq!(status.code(), Some(78), "{key}: {stderr}");
        assert!(
            stderr.contains(&format!("[E1005] invalid value for {key}"))
                && stderr.contains("holds a secret"),
            "{key}: {stderr}"
        );
        assert!(!stderr.contains("localhost:"), "{key}: {stderr}");
    }
}

/// At debug, every resolved secret is `****` in every line (other crates print what an
/// upstream sent there): the access lines too, which the proxy formats itself, outside
/// tracing. A client's path holding the key went out as sent to a pipe (journald, a
/// container runtime), where the same line on a terminal (through tracing) was starred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_debug_an_access_line_stars_a_secret_in_the_path() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(404, "no") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .log_level("debug")
        .spawn()
        .await;
    let shouted = API_KEY.to_ascii_uppercase();
    let path = format!("/templates/{API_KEY}/{shouted}");
    let addr = proxy.addr();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    assert_eq!(raw_exchange(addr, req.as_bytes()).await.status, 404);
    // finish() fails on the key anywhere in the log.
    let stderr = proxy.finish().await;
    let line = (stderr.lines())
        .find(|l| l.contains("abx_proxy::access") && l.contains("/templates/"))
        .unwrap_or_else(|| panic!("no access line:\n{stderr}"));
    assert!(line.contains("path=/templates/****/****"), "{line}");
}

/// An upstream that never completes TLS, and one that never answers, get 504 E5002 at
/// `--upstream-timeout`, each counted as an upstream error of kind `timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_upstream_is_504_e5002() {
    let pki = Pki::new();
    // One accepts TCP and never speaks (TLS never completes); one completes TLS and reads
    // the request but never answers it.
    let tcp_silent = SilentUpstream::start().await;
    let (hold_tx, hold_rx) = oneshot::channel::<()>();
    let hold_rx = Arc::new(tokio::sync::Mutex::new(Some(hold_rx)));
    let mut tls_silent = Upstream::start(&pki, Proto::Http1, move |_req| {
        let hold_rx = hold_rx.clone();
        async move {
            if let Some(rx) = hold_rx.lock().await.take() {
                let _ = rx.await;
            }
            response(200, "too late")
        }
    })
    .await;
    let p1 = ProxyCmd::new(&format!("https://{}", tcp_silent.addr), &pki)
        .args(&["--upstream-timeout", "1s"])
        .spawn()
        .await;
    let p2 = ProxyCmd::new(&tls_silent.url(), &pki)
        .args(&["--upstream-timeout", "1s"])
        .spawn()
        .await;

    let get = |addr: std::net::SocketAddr| async move {
        let req = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        raw_exchange(addr, req.as_bytes()).await
    };
    let (r1, r2) = tokio::join!(get(p1.addr()), get(p2.addr()));
    assert_proxy_error(&r1, 504, "E5002");
    assert_proxy_error(&r2, 504, "E5002");
    // Counted as what they are (SPEC §7), whether the TLS or the answer never came.
    for p in [&p1, &p2] {
        let text = scrape(p.admin_addr()).await;
        let timeouts = "abx_proxy_upstream_errors_total{plane=\"api\",kind=\"timeout\"}";
        assert_eq!(metric(&text, timeouts), Some(1.0), "{text}");
    }
    assert_eq!(
        tls_silent.next_request().await.path_and_query(),
        "/sandboxes"
    );
    drop(hold_tx);
    p1.finish().await;
    p2.finish().await;
}

/// `--upstream-timeout` is the upstream's time to answer, not the client's time to upload:
/// an upload that takes longer than the timeout in all but keeps moving gets its answer
/// (envd answers a file upload only once it has all of it), through both upstream clients
/// (the control plane's and envd's). One that stops moving is refused, 400 E5003 (as a
/// create body the proxy reads itself), no sooner than a timeout after its last bytes: the
/// client's stall, not an upstream timeout (504 E5002, counted against the upstream, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_longer_than_the_upstream_timeout_is_not_cut_while_it_moves() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match req.into_body().collect().await {
            Ok(body) => response(200, format!("got {}", body.to_bytes().len())),
            Err(_) => response(400, "cut"),
        }
    })
    .await;
    // Twelve times the 250 ms pace below: a stall of seconds on a loaded machine between
    // two bytes must not pass for an upload that stopped.
    const TIMEOUT: Duration = Duration::from_secs(3);
    // 250 ms apart, 4 s in all: past the timeout.
    const BYTES: usize = 16;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_URL", Some(&upstream.url()))
        .args(&["--upstream-timeout", &format!("{}s", TIMEOUT.as_secs())])
        .spawn()
        .await;
    let addr = proxy.addr();
    let upload = |envd: bool| {
        let routing = if envd {
            "E2b-Sandbox-Id: isb-1\r\nX-Access-Token: t\r\n"
        } else {
            ""
        };
        format!(
            "POST /upload HTTP/1.1\r\nHost: {addr}\r\n{routing}Content-Length: {BYTES}\r\nConnection: close\r\n\r\n"
        )
    };
    let moving = |envd: bool| async move {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(upload(envd).as_bytes()).await.expect("head");
        // Pacing the upload (the behaviour under test), not synchronisation.
        let mut every = tokio::time::interval(Duration::from_millis(250));
        every.tick().await;
        for _ in 0..BYTES {
            every.tick().await;
            s.write_all(b"x").await.expect("body");
        }
        let resp = read_response(&mut s, &mut Vec::new()).await;
        assert_eq!(
            (resp.status, resp.text()),
            (200, format!("got {BYTES}")),
            "envd: {envd}"
        );
    };
    let stopped = |envd: bool| async move {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(upload(envd).as_bytes()).await.expect("head");
        // Before the write: the proxy's timer can start before this task reads the clock.
        let last = Instant::now();
        s.write_all(b"xx").await.expect("body");
        let resp = read_response(&mut s, &mut Vec::new()).await;
        assert_proxy_error(&resp, 400, "E5003");
        let message = resp.json()["message"].to_string();
        assert!(
            message.contains("request body not received within 3s"),
            "{message}"
        );
        assert!(
            last.elapsed() >= TIMEOUT,
            "envd: {envd}: {:?}",
            last.elapsed()
        );
    };
    // All at once: each is a few seconds of waiting, not of work.
    tokio::join!(moving(false), moving(true), stopped(false), stopped(true));
    let metrics = scrape(proxy.admin_addr()).await;
    for plane in ["api", "envd"] {
        let timeouts =
            format!("abx_proxy_upstream_errors_total{{plane=\"{plane}\",kind=\"timeout\"}}");
        assert_eq!(metric(&metrics, &timeouts).unwrap_or(0.0), 0.0, "{plane}");
        let refused =
            format!("abx_proxy_requests_total{{plane=\"{plane}\",method=\"POST\",code=\"400\"}}");
        assert_eq!(metric(&metrics, &refused), Some(1.0), "{plane}");
    }
    proxy.finish().await;
}

/// A chunked request's trailers never reach the upstream: they could carry `X-API-Key` or
/// `Authorization` past the rewrite of the head. HTTP/2 upstreams would take them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_are_not_passed_upstream() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::H2, |req| async move {
        match req.into_body().collect().await {
            Ok(body) => {
                let trailers = body.trailers().map_or(0, |t| t.len());
                let data = body.to_bytes();
                response(200, format!("{} bytes, {trailers} trailers", data.len()))
            }
            Err(_) => response(400, "cut"),
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let req = format!(
        "POST /sandboxes HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\nTrailer: X-API-Key\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\nX-API-Key: dummy\r\nAuthorization: Bearer dummy\r\n\r\n"
    );
    let resp = raw_exchange(addr, req.as_bytes()).await;
    assert_eq!(
        (resp.status, resp.text()),
        (200, "3 bytes, 0 trailers".into())
    );
    proxy.finish().await;
}

/// An upstream's trailers reach a client that asks for them (`TE: trailers`), and only
/// such a client, whichever path serves the request: the fast path (a sized GET) or hyper's
/// (a chunked POST). `Trailer`, end to end (RFC 9110 §6.6.2), was dropped as hop-by-hop,
/// and hyper's server sends a response's trailers only when that field declares them: on
/// hyper's path they never came. The fast path sent them to every client, TE or not,
/// while hyper's sent them to none that had not asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_trailers_reach_a_client_that_asks_for_them() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::H2, |_req| async {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-sum", http::HeaderValue::from_static("abc"));
        // Of no known length (`map_frame` hides it): the proxy answers chunked, the
        // HTTP/1.1 framing that carries trailers.
        let body = full("hello")
            .map_frame(|f| f)
            .with_trailers(std::future::ready(Some(Ok(trailers))));
        let mut r = Response::new(boxed(body));
        r.headers_mut()
            .insert("trailer", http::HeaderValue::from_static("x-sum"));
        r
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let paths = [
        ("sized", "GET", "", ""),
        (
            "chunked",
            "POST",
            "Transfer-Encoding: chunked\r\n",
            "0\r\n\r\n",
        ),
    ];
    for asks in [false, true] {
        for (path, method, framing, body) in paths {
            let te = if asks { "TE: trailers\r\n" } else { "" };
            let mut s = connect_raw(addr).await;
            let req = format!(
                "{method} /sums HTTP/1.1\r\nHost: {addr}\r\n{te}{framing}\
                 Connection: close\r\n\r\n{body}"
            );
            s.write_all(req.as_bytes()).await.unwrap();
            let mut got = Vec::new();
            within("the answer", s.read_to_end(&mut got)).await.unwrap();
            let got = String::from_utf8_lossy(&got).to_ascii_lowercase();
            let what = format!("{path}, TE: {asks}: {got}");
            assert!(got.starts_with("http/1.1 200"), "{what}");
            assert!(got.contains("\r\ntrailer: x-sum\r\n"), "{what}");
            let end = match asks {
                true => "\r\nhello\r\n0\r\nx-sum: abc\r\n\r\n",
                false => "\r\nhello\r\n0\r\n\r\n",
            };
            assert!(got.ends_with(end), "{what}");
        }
    }
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------------------

/// SIGTERM (SPEC §7): the listener stops accepting, `/readyz` turns 503, the request in
/// flight still gets its answer, and the exit is 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_refuses_new_ones() {
    drains_in_flight_requests_on("TERM").await;
}

/// SIGINT (Ctrl-C in a terminal, `docker stop` of an image whose STOPSIGNAL is SIGINT)
/// drains exactly like SIGTERM (SPEC §7) instead of killing the request in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_drains_in_flight_requests_like_sigterm() {
    drains_in_flight_requests_on("INT").await;
}

/// A request is held upstream while `signal` arrives: new connections are refused and
/// `/readyz` is 503 while it runs; it then completes, and the proxy exits 0.
async fn drains_in_flight_requests_on(signal: &str) {
    let pki = Pki::new();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let release_rx = Arc::new(tokio::sync::Mutex::new(Some(release_rx)));
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let release_rx = release_rx.clone();
        async move {
            if let Some(rx) = release_rx.lock().await.take() {
                let _ = rx.await;
            }
            response(200, "finished after the signal")
        }
    })
    .await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let admin = proxy.admin_addr();

    let readyz = |admin| async move {
        raw_exchange(
            admin,
            b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await
        .status
    };
    assert_eq!(readyz(admin).await, 200);

    let in_flight = tokio::spawn(send(
        addr,
        request("POST", addr, "/sandboxes/x/timeout")
            .body(full("{}"))
            .unwrap(),
    ));
    upstream.next_request().await;

    proxy.signal(signal);
    // The log names the signal that began the drain (an operator reading it after a
    // restart tells a supervisor's stop from a Ctrl-C).
    let draining = proxy.wait_for_line("draining").await;
    assert!(
        draining.contains(&format!("signal=\"SIG{signal}\"")),
        "{draining}"
    );
    proxy.wait_for_line("listener closed").await;
    let refused = TcpStream::connect(addr).await;
    assert_eq!(
        refused.map(|_| ()).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused),
        "a new connection was accepted while draining"
    );
    assert_eq!(readyz(admin).await, 503, "/readyz while draining");

    release_tx.send(()).unwrap();
    let resp = within("the in-flight request", in_flight).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "finished after the signal");

    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    assert_no_key(&proxy.stderr(), "the proxy's stderr");
}

/// A second signal of the kind that started the drain (Ctrl-C pressed again, a second
/// SIGTERM) ends it at once: what is left is closed and the exit is 0, instead of waiting
/// out `--shutdown-grace`. The other kind does not: Ctrl-C under a supervisor sends SIGINT
/// to the group, then the supervisor its SIGTERM, and that must not cut the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_of_the_same_kind_ends_the_drain_at_once() {
    let pki = Pki::new();
    let (_release, held) = oneshot::channel::<()>();
    let held = Arc::new(tokio::sync::Mutex::new(Some(held)));
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let held = held.clone();
        async move {
            if let Some(rx) = held.lock().await.take() {
                let _ = rx.await;
            }
            response(200, "too late")
        }
    })
    .await;
    // A grace far longer than the test may take: the exit must come from the signal.
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace("300s")
        .spawn()
        .await;
    let addr = proxy.addr();
    let in_flight = tokio::spawn(send_raw_get(addr));
    upstream.next_request().await;
    proxy.signal("INT");
    proxy.wait_for_line("listener closed").await;
    proxy.signal("TERM");
    proxy.wait_for_line("the drain goes on").await;
    assert!(
        !proxy.has_exited(),
        "the other kind of signal ended the drain"
    );
    proxy.signal("INT");
    proxy.wait_for_line("second signal").await;
    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    let got = within("the cut request", in_flight).await.expect("join");
    assert!(got.is_empty(), "the held request was answered: {got:?}");
}

/// `GET /sandboxes` on its own connection: what came back before the connection closed.
async fn send_raw_get(addr: std::net::SocketAddr) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Ok(mut s) = TcpStream::connect(addr).await {
        let req = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        if s.write_all(req.as_bytes()).await.is_ok() {
            let _ = s.read_to_end(&mut buf).await;
        }
    }
    buf
}

/// An upgraded connection is served by a tunnel after hyper's connection has ended: it must
/// still count as open, and the drain must wait for it (SPEC §7) instead of the exit
/// cutting it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drain_waits_for_an_open_websocket_tunnel() {
    let pki = Pki::new();
    let upstream = websocket_upstream(&pki).await;
    // A grace far longer than the test may take: the exit must come from the tunnel's end.
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace("60s")
        .spawn()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let open_connections =
        |admin| async move { metric(&scrape(admin).await, "abx_proxy_open_connections") };

    let mut s = open_tunnel(addr).await;
    echo(&mut s, b"before the signal").await;
    assert_eq!(
        open_connections(admin).await,
        Some(1.0),
        "the tunnel is an open connection"
    );

    proxy.signal("TERM");
    let closed = proxy.wait_for_line("listener closed").await;
    assert!(
        closed.contains("open=1"),
        "the drain waits for the tunnel: {closed}"
    );
    echo(&mut s, b"after the drain began").await;
    assert_eq!(open_connections(admin).await, Some(1.0), "while draining");
    assert!(!proxy.has_exited(), "the proxy exited with a tunnel open");

    // The client ends the tunnel: the upstream sees the end, closes its side, and the proxy
    // closes the client's.
    s.shutdown().await.unwrap();
    expect_closed(&mut s, &[]).await;
    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    // Not `clean=false`: the drain ended with the tunnel, not with the grace.
    let stderr = proxy.stderr();
    assert!(stderr.contains("clean=true"), "stderr:\n{stderr}");
    assert_no_key(&stderr, "the proxy's stderr");
}

/// A request whose head was coming in when the drain began is served (with `Connection:
/// close`), as nginx serves it: closing lost it with no answer, and its client could not
/// tell whether it was done. A head begun and left unfinished is bounded by its
/// `--header-timeout`, not the grace: it does not hold the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_finishes_a_head_begun_before_it_and_no_more() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace("120s")
        .args(&["--header-timeout", "3s"])
        .spawn()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let mut begun = TcpStream::connect(addr).await.unwrap();
    begun.write_all(b"GET /sandboxes HT").await.unwrap();
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled.write_all(b"GET /sandboxes HT").await.unwrap();
    until_open_connections(admin, 2.0).await;
    the_head_ends_in_the_drain(&mut proxy, &mut begun, Vec::new()).await;
    // The other head never ends: cut at its header timeout, and the drain with it.
    expect_closed(&mut stalled, &[]).await;
    exits_0(&mut proxy).await;
}

/// A head still unfinished when the drain's grace ends is cut with its connection, and
/// logged and counted 408 as one its `--header-timeout` cuts (from where that counts):
/// it left no line, and the stop ended `clean=false` with nothing to say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_the_grace_cuts_unfinished_is_logged_408() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace("1s")
        .args(&["--header-timeout", "120s"])
        .spawn()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled.write_all(b"GET /sandboxes HT").await.unwrap();
    until_open_connections(admin, 1.0).await;
    proxy.signal("TERM");
    expect_closed(&mut stalled, &[]).await;
    exits_0(&mut proxy).await;
    let stderr = proxy.stderr();
    let cut: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains(" status=408 "))
        .collect();
    assert!(cut.len() == 1 && cut[0].contains("method=-"), "{stderr}");
}

/// But not a head sent on behind a request still waiting for its answer (pipelined): held
/// back, not slow, as the watchdog judges it; over TLS (hyper reads the heads) it was
/// logged 408 beside the request's 499.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_held_back_behind_an_answer_is_no_408_when_the_grace_ends() {
    let pki = Pki::new();
    let mut upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        std::future::pending::<()>().await;
        response(200, "")
    })
    .await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .shutdown_grace("1s")
        .args(&["--header-timeout", "120s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let pipelined = format!("GET /slow HTTP/1.1\r\nHost: {addr}\r\n\r\nGET /sandboxes HT");
    tls.write_all(pipelined.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    upstream.next_request().await;
    proxy.signal("TERM");
    let mut rest = Vec::new();
    let _ = within("the cut", tls.read_to_end(&mut rest)).await;
    exits_0(&mut proxy).await;
    let stderr = proxy.stderr();
    assert!(stderr.contains(" status=499 "), "{stderr}");
    assert!(!stderr.contains(" status=408 "), "{stderr}");
}

/// SIGTERM; once the drain has begun, the client on `s` (with `leftover` of its earlier
/// answers) ends the head it began: answered with `Connection: close`, then closed.
async fn the_head_ends_in_the_drain<S>(proxy: &mut ProxyProc, s: &mut S, mut leftover: Vec<u8>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let addr = proxy.addr();
    proxy.signal("TERM");
    proxy.wait_for_line("listener closed").await;
    let rest = format!("TP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
    s.write_all(rest.as_bytes()).await.unwrap();
    s.flush().await.unwrap();
    let resp = read_response(s, &mut leftover).await;
    assert_eq!(
        (resp.status, resp.header("connection")),
        (200, Some("close"))
    );
    expect_closed(s, &leftover).await;
}

/// The proxy exits 0 within [`GUARD`].
async fn exits_0(proxy: &mut ProxyProc) {
    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
}

// ---------------------------------------------------------------------------------------
// Listener TLS
// ---------------------------------------------------------------------------------------

/// The connection is the proxy's (not still in the accept queue).
async fn until_open_connections(admin: std::net::SocketAddr, n: f64) {
    let series = "abx_proxy_open_connections";
    wait_metric(admin, series, &n.to_string(), |v| v == Some(n)).await;
}

/// A TLS proxy whose header timeout and grace are far longer than a test may take.
async fn patient_tls_proxy(pki: &Pki) -> ProxyProc {
    ProxyCmd::new("https://127.0.0.1:9", pki)
        .tls_listener(pki)
        .shutdown_grace("120s")
        .args(&["--header-timeout", "120s"])
        .spawn()
        .await
}

/// A GET of the sandbox list with the client's stand-in key, which the proxy replaces.
fn list_sandboxes(addr: std::net::SocketAddr) -> Request<TestBody> {
    request("GET", addr, "/sandboxes")
        .header("x-api-key", "dummy")
        .body(empty())
        .unwrap()
}

/// A TLS proxy (`cmd` applied to it) in front of an upstream that answers 200 to all.
async fn tls_proxy_to_ok(
    pki: &Pki,
    cmd: impl FnOnce(ProxyCmd) -> ProxyCmd,
) -> (Upstream, ProxyProc) {
    let upstream = Upstream::start(pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = cmd(ProxyCmd::new(&upstream.url(), pki).tls_listener(pki))
        .spawn()
        .await;
    (upstream, proxy)
}

/// [`list_sandboxes`] on a kept HTTP/1.1 connection, which must still be open.
async fn list_sandboxes_on(
    h1: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    addr: std::net::SocketAddr,
) -> Response<hyper::body::Incoming> {
    // hyper's client takes the next request only once the last exchange is wound up.
    within("the client connection", h1.ready())
        .await
        .expect("the connection still open");
    within("an HTTP/1.1 answer", h1.send_request(list_sandboxes(addr)))
        .await
        .expect("an HTTP/1.1 answer")
}

/// SIGTERM, and exit 0 within [`GUARD`].
async fn terminate(proxy: &mut ProxyProc) {
    proxy.signal("TERM");
    exits_0(proxy).await;
}

/// `--tls-cert`/`--tls-key`: clients reach the proxy over TLS, HTTP/1.x or HTTP/2 as ALPN
/// picks, and each request goes upstream with the key as over plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_serves_http1_and_http2_with_the_key_attached() {
    let pki = Pki::new();
    let mut upstream =
        Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "listed") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .spawn()
        .await;
    let addr = proxy.addr();

    let tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let mut h1 = handshake(tls).await;
    for _ in 0..2 {
        let resp = list_sandboxes_on(&mut h1, addr).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(collect(resp.into_body()).await, "listed");
        assert_authorized(&upstream.next_request().await, &upstream);
    }

    // A client offering HTTP/1.0 alone (`curl --http1.0`) is served too: its handshake
    // failed with `no_application_protocol`.
    let mut tls = pki.tls_connect(addr, &[b"http/1.0"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.0"[..]));
    let req = format!("GET /sandboxes HTTP/1.0\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    let resp = read_response(&mut tls, &mut Vec::new()).await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "listed"));
    assert_authorized(&upstream.next_request().await, &upstream);

    let tls = pki.tls_connect(addr, &[b"h2", b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .uri(format!("https://{addr}/sandboxes"))
        .header("x-api-key", "dummy")
        .body(empty())
        .unwrap();
    let resp = within("an HTTP/2 answer over TLS", h2.send_request(req))
        .await
        .expect("HTTP/2 over TLS");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "listed");
    assert_authorized(&upstream.next_request().await, &upstream);
    proxy.finish().await;
}

/// Plain HTTP sent to the TLS listener (an `http://` URL where `https://` was meant) gets
/// a 400 E5003 that says to use https://, then the close, where it got a TLS alert that
/// curl showed as an empty reply and the SDKs as a bare connection error. It goes nowhere
/// upstream, and is counted and logged as the proxy's own refusals are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_sent_to_the_tls_listener_gets_a_400_that_says_to_use_https() {
    let pki = Pki::new();
    let (upstream, proxy) = tls_proxy_to_ok(&pki, |cmd| cmd).await;
    let addr = proxy.addr();
    let before = scrape(proxy.admin_addr()).await;
    let mut plain = connect_raw(addr).await;
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
    plain.write_all(req.as_bytes()).await.unwrap();
    let mut leftover = Vec::new();
    let resp = read_response(&mut plain, &mut leftover).await;
    assert_proxy_error(&resp, 400, "E5003");
    let message = resp.json()["message"].to_string();
    assert!(message.contains("use https://"), "{message}");
    assert_eq!(resp.header("connection"), Some("close"));
    expect_closed(&mut plain, &leftover).await;
    assert_not_reached(&upstream, "/health", "plain HTTP on the TLS port");
    let refused = [Answer {
        method: "GET",
        path: "/health",
        plane: "api",
        status: 400,
        upstream: "",
    }];
    assert_counted_once(proxy.admin_addr(), &before, &refused).await;
    assert_logged_once(&proxy.finish().await, &refused);
}

/// TLS sent to the plain listener (an `https://` URL where `http://` was meant) is
/// refused at once, as nginx does: hyper's 400 and the close, so that curl says "wrong
/// version number" and the SDKs fail at once; logged and counted as a head refused. A
/// ClientHello holds no line end, and the proxy waited for the end of a head until
/// `--header-timeout` (here longer than the test may take), then closed without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sent_to_the_plain_listener_is_refused_at_once() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--header-timeout", "120s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    let before = scrape(proxy.admin_addr()).await;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("server name");
    let mut tls = rustls::ClientConnection::new(Arc::new(config), name).expect("client");
    let mut hello = Vec::new();
    tls.write_tls(&mut hello).expect("a ClientHello");
    assert_eq!(hello[0], 0x16, "a handshake record");
    let mut s = connect_raw(addr).await;
    s.write_all(&hello).await.unwrap();
    let mut leftover = Vec::new();
    let resp = read_response(&mut s, &mut leftover).await;
    assert_eq!(resp.status, 400);
    expect_closed(&mut s, &leftover).await;
    assert_eq!(upstream.connections(), 0);
    let refused = [Answer {
        method: "-",
        path: "-",
        plane: "api",
        status: 400,
        upstream: "",
    }];
    assert_counted_once(proxy.admin_addr(), &before, &refused).await;
    assert_logged_once(&proxy.finish().await, &refused);
}

/// A client still in its TLS handshake has sent no request: the drain closes it at once
/// rather than waiting out `--header-timeout` (here far longer than the test may take).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_does_not_wait_for_a_tls_handshake() {
    let pki = Pki::new();
    let mut proxy = patient_tls_proxy(&pki).await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let mut s = connect_raw(addr).await;
    // A handshake record's header and one byte of the ClientHello, and no more.
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    until_open_connections(admin, 1.0).await;
    terminate(&mut proxy).await;
    expect_closed(&mut s, &[]).await;
}

/// A handshake that stalls is cut at `--header-timeout`, like a slow first head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_is_cut_at_the_header_timeout() {
    let pki = Pki::new();
    let proxy = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .tls_listener(&pki)
        .args(&["--header-timeout", "1s"])
        .spawn()
        .await;
    let mut s = connect_raw(proxy.addr()).await;
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    expect_closed(&mut s, &[]).await;
    until_open_connections(proxy.admin_addr(), 0.0).await;
    proxy.finish().await;
}

/// Over TLS, where hyper reads the heads, a first head begun before the drain is served
/// too (see [`the_drain_finishes_a_head_begun_before_it_and_no_more`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_finishes_a_first_head_begun_over_tls() {
    drain_over_tls_with_a_head_begun(false).await;
}

/// And a keep-alive connection's next head: hyper's graceful shutdown took the connection
/// for idle and dropped that head with it, the client getting no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_finishes_a_next_head_begun_over_tls() {
    drain_over_tls_with_a_head_begun(true).await;
}

/// A TLS client begins a head (after a request of its own, with `after_a_request`), the
/// drain begins, the head ends: it is answered with `Connection: close`, and the exit is 0.
async fn drain_over_tls_with_a_head_begun(after_a_request: bool) {
    let pki = Pki::new();
    let (_upstream, mut proxy) = tls_proxy_to_ok(&pki, |cmd| {
        cmd.shutdown_grace("120s")
            .args(&["--header-timeout", "120s"])
    })
    .await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let mut leftover = Vec::new();
    if after_a_request {
        let req = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
        tls.write_all(req.as_bytes()).await.unwrap();
        let resp = read_response(&mut tls, &mut leftover).await;
        assert_eq!((resp.status, resp.header("connection")), (200, None));
    }
    tls.write_all(b"GET /sandboxes HT").await.unwrap();
    tls.flush().await.unwrap();
    until_open_connections(admin, 1.0).await;
    the_head_ends_in_the_drain(&mut proxy, &mut tls, leftover).await;
    exits_0(&mut proxy).await;
}

/// An empty line after a request (a CRLF more after a body, which RFC 9112 §2.2 has
/// servers ignore) is no head begun: a drain closes the connection at once, as any idle
/// one, rather than waiting out `--header-timeout` (far longer here than the test may
/// take) and logging a 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_line_after_a_request_does_not_hold_the_drain() {
    drain_after_an_empty_line(EmptyLineAfter::Plain).await;
}

/// The same over TLS (hyper's path), where the framing watch sees the empty line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_line_after_a_request_over_tls_does_not_hold_the_drain() {
    drain_after_an_empty_line(EmptyLineAfter::Tls).await;
}

/// And after a chunked request, which the fast path hands to hyper.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_line_after_a_chunked_request_does_not_hold_the_drain() {
    drain_after_an_empty_line(EmptyLineAfter::Chunked).await;
}

/// And before a TLS connection's first request: hyper would wait for that head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_line_before_a_first_request_over_tls_does_not_hold_the_drain() {
    let pki = Pki::new();
    let mut proxy = patient_tls_proxy(&pki).await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    tls.write_all(b"\r\n").await.unwrap();
    tls.flush().await.unwrap();
    until_open_connections(admin, 1.0).await;
    terminate(&mut proxy).await;
    expect_closed(&mut tls, &[]).await;
    let stderr = proxy.stderr();
    assert!(!stderr.contains("status=408"), "{stderr}");
}

#[derive(PartialEq)]
enum EmptyLineAfter {
    Plain,
    Tls,
    Chunked,
}

async fn drain_after_an_empty_line(after: EmptyLineAfter) {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let mut cmd = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace("120s")
        .args(&["--header-timeout", "120s"]);
    if after == EmptyLineAfter::Tls {
        cmd = cmd.tls_listener(&pki);
    }
    let mut proxy = cmd.spawn().await;
    let addr = proxy.addr();
    let head = format!("Host: {addr}\r\nX-API-Key: dummy\r\n");
    let req = match after {
        EmptyLineAfter::Chunked => format!(
            "POST /sandboxes HTTP/1.1\r\n{head}Transfer-Encoding: chunked\r\n\r\n\
             2\r\n{{}}\r\n0\r\n\r\n\r\n"
        ),
        _ => format!("GET /sandboxes HTTP/1.1\r\n{head}\r\n\r\n"),
    };
    trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
    impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}
    let mut s: Box<dyn Io> = match after {
        EmptyLineAfter::Tls => Box::new(pki.tls_connect(addr, &[b"http/1.1"]).await),
        _ => Box::new(TcpStream::connect(addr).await.unwrap()),
    };
    s.write_all(req.as_bytes()).await.unwrap();
    s.flush().await.unwrap();
    let mut leftover = Vec::new();
    let resp = read_response(&mut s, &mut leftover).await;
    assert_eq!((resp.status, resp.header("connection")), (200, None));
    terminate(&mut proxy).await;
    expect_closed(&mut s, &leftover).await;
    let stderr = proxy.stderr();
    assert!(!stderr.contains("status=408"), "{stderr}");
}

/// Nor for a keep-alive connection over TLS idle between requests, which only the
/// `--idle-timeout` would close (here far longer than the test may take, with the header
/// timeout and the grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_does_not_wait_for_an_idle_keep_alive_connection_over_tls() {
    let pki = Pki::new();
    let (_upstream, mut proxy) = tls_proxy_to_ok(&pki, |cmd| {
        cmd.shutdown_grace("120s")
            .args(&["--header-timeout", "120s"])
            .log_level("trace")
    })
    .await;
    let addr = proxy.addr();
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let req = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut leftover = Vec::new();
    let resp = read_response(&mut tls, &mut leftover).await;
    assert_eq!((resp.status, resp.header("connection")), (200, None));
    terminate(&mut proxy).await;
    expect_closed(&mut tls, &leftover).await;
    // Closed, not lingered on: between requests there is no body to wait out, and a
    // client that keeps its socket (as this one still does) would hold the exit 5 s.
    let stderr = proxy.stderr();
    assert!(!stderr.contains("lingering close"), "{stderr}");
}

/// Over TLS, where hyper reads the heads, `--header-timeout` runs from a head's first byte
/// and not while a keep-alive connection waits for its next request, as on the plain
/// listener: a second head that stops after one byte is cut, and a connection idle since
/// before that byte, so for longer than the header timeout, still takes a request. hyper's
/// own timer ran between requests too and closed such connections: a client whose pool
/// kept one longer (Go's keeps them 90 s) sent its next request into the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_header_timeout_cuts_a_slow_second_head_but_not_an_idle_connection() {
    let pki = Pki::new();
    let (upstream, proxy) =
        // 3 s: the slow first head's clock runs from the accept, its handshake and the
        // client's 400 ms included, on a loaded machine (at 1 s, 0.55 s to spare).
        tls_proxy_to_ok(&pki, |cmd| cmd.args(&["--header-timeout", "3s"])).await;
    let addr = proxy.addr();
    let mut idle = handshake(pki.tls_connect(addr, &[b"http/1.1"]).await).await;
    let resp = list_sandboxes_on(&mut idle, addr).await;
    assert_eq!(resp.status(), StatusCode::OK);
    collect(resp.into_body()).await;

    // The clock: the slow head's first byte comes after the idle connection's answer, and
    // its cut at least the header timeout after that byte.
    let mut slow = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let first = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n");
    slow.write_all(first.as_bytes()).await.unwrap();
    let mut leftover = Vec::new();
    assert_eq!(read_response(&mut slow, &mut leftover).await.status, 200);
    slow.write_all(b"G").await.unwrap();
    slow.flush().await.unwrap();
    // Within BOUND: the idle timeout (300 s) cannot be what cuts it.
    expect_closed(&mut slow, &leftover).await;

    let resp = list_sandboxes_on(&mut idle, addr).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        upstream.seen().len(),
        3,
        "the slow head reached the upstream"
    );

    // A slow first head, begun a while after the handshake: cut by the header timeout
    // (within BOUND, so not by the idle timeout), and logged all the same.
    let mut first = pki.tls_connect(addr, &[b"http/1.1"]).await;
    // A client slow to begin (the behaviour under test), not synchronisation.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    first.write_all(b"GET /sandboxes HT").await.unwrap();
    first.flush().await.unwrap();
    expect_closed(&mut first, &[]).await;
    // Both cut heads are logged 408, as on the plain listener. The default idle timeout
    // gets no warning about the SDKs' keepalives.
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("--idle-timeout is under"), "{stderr}");
    let cut = timed_out_heads(&stderr);
    assert_eq!(cut, 2, "{stderr}");
}

/// An answer cut for idleness over TLS with an empty line behind its request: the cut is
/// said (`answer cut`), and no 408 for a head that the answer held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_an_answer_cut_for_idleness_logs_no_408_for_the_line_behind_it() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(b"hello\n")).await;
            // Silent from here on, the channel kept open.
            tx.closed().await;
        });
        Response::new(boxed(ChannelBody(rx)))
    })
    .await;
    // The idle timeout a multiple of the header timeout, as the defaults (300 s, 30 s):
    // the head's deferred deadline falls on the idle cut.
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .args(&["--header-timeout", "1s", "--idle-timeout", "3s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    // Several at once: whether the deferred deadline lands on the cut depends on a few
    // milliseconds of each connection's timing.
    const CONNECTIONS: usize = 6;
    let cut = (0..CONNECTIONS).map(|_| async {
        let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
        let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n\r\n");
        tls.write_all(req.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        let mut got = Vec::new();
        let _ = within("the idle cut", tls.read_to_end(&mut got)).await;
        assert!(String::from_utf8_lossy(&got).contains("hello"), "{got:?}");
    });
    futures_util::future::join_all(cut).await;
    let stderr = proxy.finish().await;
    assert_eq!(
        stderr.matches("answer cut").count(),
        CONNECTIONS,
        "{stderr}"
    );
    assert!(!stderr.contains(" status=408 "), "{stderr}");
}

/// Over TLS, where hyper reads on while it answers: an empty line after a request (RFC
/// 9112 §2.2 tolerates one before a request line) is no head the client is slow to finish
/// while its answer still streams. An event stream quiet for longer than
/// `--header-timeout` was cut there (and logged as a 408).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_quiet_answer_is_not_cut_for_an_empty_line_after_its_request() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(b"hello\n")).await;
            // A stream quiet past the header timeout (the behaviour under test), not
            // synchronisation.
            tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
            let _ = tx.send(Bytes::from_static(b"world\n")).await;
        });
        Response::new(boxed(ChannelBody(rx)))
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .args(&["--header-timeout", "1s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: dummy\r\n\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let mut leftover = Vec::new();
    let resp = read_response(&mut tls, &mut leftover).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), "hello\nworld\n");
    proxy.finish().await;
}

/// A tunnel still open when `--shutdown-grace` runs out is closed with everything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_tunnel_left_open_is_closed_when_the_grace_ends() {
    tunnel_cut_when_the_grace_ends("1s").await;
}

/// `--shutdown-grace 1`, a bare number, is one second (SPEC §7): not milliseconds (the
/// exit would come before the second is over) nor minutes (it would not come within the
/// test's guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_number_of_shutdown_grace_is_seconds() {
    tunnel_cut_when_the_grace_ends("1").await;
}

/// A WebSocket tunnel is open when SIGTERM comes and stays open: the proxy exits 0 once a
/// `grace` of one second is over, not before, reports an unclean drain, and the tunnel is
/// closed, by the proxy itself before it says "stopped".
async fn tunnel_cut_when_the_grace_ends(grace: &str) {
    let pki = Pki::new();
    let upstream = websocket_upstream(&pki).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .shutdown_grace(grace)
        .spawn()
        .await;
    let addr = proxy.addr();

    let mut s = open_tunnel(addr).await;
    echo(&mut s, b"before the signal").await;
    let signalled = std::time::Instant::now();
    proxy.signal("TERM");
    let draining = proxy.wait_for_line("draining").await;
    assert!(
        draining.contains("grace_s=1.0"),
        "--shutdown-grace {grace}: {draining}"
    );
    let stopped = proxy.wait_for_line("stopped").await;
    assert!(stopped.contains("clean=false"), "{stopped}");
    assert!(stopped.contains(" WARN "), "requests were cut: {stopped}");
    // Closed by the proxy at the end of the grace, not left to the exit.
    assert!(stopped.contains("left=0"), "{stopped}");

    let status = proxy.wait_exit().await;
    let waited = signalled.elapsed();
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    assert!(
        waited >= std::time::Duration::from_secs(1),
        "exit {waited:?} after SIGTERM, before the 1 s grace ended"
    );
    expect_closed(&mut s, &[]).await;
    assert!(
        proxy
            .stderr()
            .lines()
            .any(|l| l.contains("tunnel cut") && l.contains("end=\"drain\"")),
        "no line for the tunnel the drain cut:\n{}",
        proxy.stderr()
    );
    assert_no_key(&proxy.stderr(), "the proxy's stderr");
}

/// A tunnel that moves no bytes for `--idle-timeout` is closed like any idle connection,
/// and the log says the proxy cut it, and what had gone through. Its path is written as
/// the access line writes it: raw, U+2028 ended the line for a Unicode-aware reader and
/// U+202E turned its display around.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_websocket_tunnel_is_closed_at_the_idle_timeout() {
    let pki = Pki::new();
    let (_upstream, mut proxy) = behind_websocket_upstream(&pki, &["--idle-timeout", "1s"]).await;
    let mut s = open_tunnel_to(proxy.addr(), "/ws/\u{202e}gnp.exe\u{2028}?x=1").await;
    let said = b"then silence";
    echo(&mut s, said).await;
    expect_closed(&mut s, &[]).await;
    let cut = proxy.wait_for_line("tunnel cut").await;
    let up = format!("bytes_up={}", said.len());
    let down = format!("bytes_down={}", GREETING.len() + said.len());
    let path = "path=/ws/%E2%80%AEgnp.exe%E2%80%A8 ";
    for field in ["end=\"idle\"", path, &up, &down] {
        assert!(cut.contains(field), "{field} not in: {cut}");
    }
    assert!(!cut.contains("x=1"), "the query reached the log: {cut}");
    let stderr = proxy.finish().await;
    assert_no_key(&stderr, "the proxy's stderr");
    // Under 2 s, envd's keepalives (a second apart at best) cannot keep a command alive.
    assert_eq!(
        stderr.matches("--idle-timeout is under 2 s").count(),
        1,
        "{stderr}"
    );
}

/// WebSocket has no half-close: a client gone with a FIN (a killed process, a `close()`
/// without a Close frame) towards an upstream that ignores it ends the tunnel once the
/// upstream has been quiet for 5 s (HAProxy's `timeout client-fin`), not at
/// `--idle-timeout`: the tunnel held its slot of `--max-connections` (the next client
/// waited), a descriptor in CLOSE-WAIT and the drain until then. What the upstream still
/// sends after the FIN gets through first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_whose_client_left_ends_once_its_upstream_is_quiet() {
    let pki = Pki::new();
    let (_upstream, mut proxy) = behind_websocket_upstream(&pki, &["--max-connections", "1"]).await;
    let addr = proxy.addr();
    let mut s = open_tunnel_to(addr, STICKY).await;
    let said = b"and goodbye";
    s.write_all(said).await.unwrap();
    s.shutdown().await.unwrap();
    // The echo of what came with the FIN, then the end, well before the idle timeout.
    let mut echoed = vec![0u8; said.len()];
    within("the echo after the FIN", s.read_exact(&mut echoed))
        .await
        .unwrap();
    assert_eq!(echoed, said);
    expect_closed(&mut s, &[]).await;
    let cut = proxy.wait_for_line("tunnel cut").await;
    assert!(cut.contains("end=\"half-closed\""), "{cut}");
    // Its slot is free: the next connection is served.
    let next = raw_exchange(addr, tunnels_request(addr).as_bytes()).await;
    assert_eq!(next.status, 200, "{next:?}");
    proxy.finish().await;
}

/// The other way's time after one side's end counts from that end, not from the last byte:
/// a client quiet for 4 s that then half-closes and waits for an answer coming 3.5 s
/// later gets it, with `--idle-timeout 6s` (the half-closed wait is 5 s). It was cut 2 s
/// after the FIN, the answer lost. Each side has 1.5 s or more to spare on a slow machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_tunnels_wait_counts_from_the_end() {
    let pki = Pki::new();
    let (_upstream, mut proxy) = behind_websocket_upstream(&pki, &["--idle-timeout", "6s"]).await;
    let addr = proxy.addr();
    let mut s = open_tunnel_to(addr, LATE).await;
    // Quiet (the behaviour under test), then the end of the client's side.
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.shutdown().await.unwrap();
    let mut answer = vec![0u8; LATE_ANSWER.len()];
    within("the late answer", s.read_exact(&mut answer))
        .await
        .expect("the late answer, before the tunnel's end");
    assert_eq!(answer, LATE_ANSWER);
    expect_closed(&mut s, &[]).await;
    let closed = proxy.wait_for_line("tunnel closed").await;
    assert!(closed.contains("end=\"closed\""), "{closed}");
    proxy.finish().await;
}

/// A plain-HTTP upstream that upgrades every request with a greeting, `hello`, then waits
/// for a byte from the client; at `/reset` it then resets its connection, at `/closing`
/// it sends [`CLOSING_BYTES`] and closes its socket (and says so on `closed`), elsewhere
/// it reads until the client's end.
async fn resetting_websocket_upstream() -> (String, Arc<tokio::sync::Notify>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let closed = Arc::new(tokio::sync::Notify::new());
    let said = closed.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let said = said.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut tmp = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut tmp).await {
                        Ok(n) if n > 0 => head.extend_from_slice(&tmp[..n]),
                        _ => return,
                    }
                }
                let switched = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\
                    Upgrade: websocket\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\nhello";
                if s.write_all(switched).await.is_err() {
                    return;
                }
                let _ = s.read(&mut tmp).await;
                if head.starts_with(b"GET /reset ") {
                    let _ = s.set_zero_linger();
                    return;
                }
                if head.starts_with(b"GET /closing ") {
                    let _ = s.write_all(&vec![b'z'; CLOSING_BYTES]).await;
                    drop(s);
                    said.notify_one();
                    return;
                }
                while matches!(s.read(&mut tmp).await, Ok(n) if n > 0) {}
            });
        }
    });
    (url, closed)
}

/// What [`resetting_websocket_upstream`] sends at `/closing` before it closes.
const CLOSING_BYTES: usize = 32 << 10;

/// A WebSocket tunnel through the proxy at `addr` to `target`, past the 101 and the
/// upstream's `hello`.
async fn open_hello_tunnel(addr: std::net::SocketAddr, target: &str) -> TcpStream {
    let (mut s, resp, mut buf) =
        raw_open(addr, websocket_request_to(addr, target).as_bytes()).await;
    assert_eq!(resp.status, 101, "{resp:?}");
    while buf.len() < 5 {
        let mut tmp = [0u8; 64];
        let n = within("the greeting", s.read(&mut tmp)).await.unwrap();
        assert!(n > 0, "tunnel closed before the greeting");
        buf.extend_from_slice(&tmp[..n]);
    }
    assert_eq!(&buf[..], b"hello");
    s
}

/// A proxy (given `args`) in front of [`resetting_websocket_upstream`], and a tunnel
/// through it to `/closing` whose upstream has sent its bytes and closed, and whose end
/// the proxy has read.
async fn closed_upstream_tunnel(pki: &Pki, args: &[&str]) -> (ProxyProc, TcpStream) {
    let (url, closed) = resetting_websocket_upstream().await;
    let mut proxy = ProxyCmd::new(&url, pki).args(args).spawn().await;
    let mut s = open_hello_tunnel(proxy.addr(), "/closing").await;
    within("a byte up", s.write_all(b"x")).await.unwrap();
    within("the upstream's close", closed.notified()).await;
    proxy.wait_for_line("the upstream ended its side").await;
    (proxy, s)
}

/// A tunnel's failure says whose it was. One the upstream resets (a WebSocket server that
/// crashed) gets a `warn` line with `end="upstream"` and is counted in
/// `upstream_errors_total`, as an answer the upstream breaks is; one the client resets, a
/// `debug` line with `end="client"`, uncounted. Both were a `debug` line with
/// `end="error"`, and uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnels_failure_says_whose_it_was() {
    let pki = Pki::new();
    let (url, _) = resetting_websocket_upstream().await;
    let mut proxy = ProxyCmd::new(&url, &pki)
        .args(&["--idle-timeout", "2s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    let reset = r#"abx_proxy_upstream_errors_total{kind="reset",plane="api"}"#;
    // The client resets; the upstream resets while the client waits; the upstream resets
    // while the client sends (the reset met by a write to the upstream, or by a read).
    for (target, client, end, level, count) in [
        ("/ws", "resets", "client", "DEBUG", 0.0),
        ("/reset", "waits", "upstream", "WARN", 1.0),
        ("/reset", "sends", "upstream", "WARN", 2.0),
    ] {
        let mut s = open_hello_tunnel(addr, target).await;
        within("a byte up", s.write_all(b"x")).await.unwrap();
        let closed = match client {
            "resets" => {
                s.set_zero_linger().unwrap();
                drop(s);
                proxy.wait_for_line("tunnel closed").await
            }
            "waits" => {
                let mut rest = Vec::new();
                let _ = within("the tunnel's end", s.read_to_end(&mut rest)).await;
                proxy.wait_for_line("tunnel closed").await
            }
            _ => tokio::select! {
                line = proxy.wait_for_line("tunnel closed") => line,
                _ = async {
                    while s.write_all(b"ping").await.is_ok() {
                        tokio::task::yield_now().await;
                    }
                } => proxy.wait_for_line("tunnel closed").await,
            },
        };
        assert!(
            closed.contains(&format!("end=\"{end}\"")),
            "{client}: {closed}"
        );
        assert!(closed.contains(level), "{client}: {closed}");
        wait_metric(proxy.admin_addr(), reset, "the count", |v| v == Some(count)).await;
    }
    proxy.finish().await;
}

/// An upstream that closes its socket after its last bytes resets what the client sends
/// next (a WebSocket server after its Close frame, to a client that pings while it
/// reads): the client's bytes from then on are dropped, and it still gets every byte the
/// upstream sent, then the tunnel's end, also when it reads them only after pinging for
/// longer than 5 s. Ending the tunnel at the refused write, or 5 s after it, dropped the
/// client's connection with its bytes unread, which reset it, and what it had not read
/// yet was lost (a client lost 2 of 4 MiB and the Close frame).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_gets_all_an_upstream_sent_before_its_close() {
    let (mut proxy, mut s) = closed_upstream_tunnel(&Pki::new(), &[]).await;
    // Its bytes are all on their way to the client, which has read none of them yet.
    // Pings, unread by anyone now, until the proxy has found the upstream's side gone.
    let (mut from_proxy, mut to_proxy) = s.split();
    tokio::select! {
        _ = proxy.wait_for_line("refused the client's bytes") => {}
        _ = async {
            while to_proxy.write_all(b"ping").await.is_ok() {
                tokio::task::yield_now().await;
            }
        } => panic!("the client's side failed before the proxy refused a write"),
    }
    // A slow reader: pings (here every 100 ms, as the behaviour under test) for longer
    // than 5 s before it reads.
    let mut pings = tokio::time::interval(Duration::from_millis(100));
    for _ in 0..60 {
        pings.tick().await;
        within("a ping", to_proxy.write_all(b"ping")).await.unwrap();
    }
    let mut got = Vec::new();
    let read = within("the upstream's bytes", from_proxy.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "{read:?} after {} bytes", got.len());
    assert_eq!(got.len(), CLOSING_BYTES);
    assert!(got.iter().all(|&b| b == b'z'));
    within("the client's end", to_proxy.shutdown())
        .await
        .unwrap();
    let line = proxy.wait_for_line("tunnel closed").await;
    assert!(line.contains("end=\"closed\""), "{line}");
    proxy.finish().await;
}

/// A slow reader quiet for longer than 5 s after the upstream's end that then pings (the
/// `websockets` library pings every 20 s) still gets every byte the upstream sent. Cut
/// after 5 s without a byte, as a tunnel whose client ended is, its ping met a closed
/// socket, which reset its connection and lost what it had not read (up to 1.6 of 8 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_slow_reader_gets_all_an_upstream_sent_before_its_close() {
    let (mut proxy, mut s) = closed_upstream_tunnel(&Pki::new(), &[]).await;
    // Quiet past the 5 s (the behaviour under test), then a ping, then the reading.
    tokio::time::sleep(Duration::from_secs(6)).await;
    within("a ping", s.write_all(b"ping")).await.unwrap();
    let mut got = Vec::new();
    let read = within("the upstream's bytes", s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "{read:?} after {} bytes", got.len());
    assert_eq!(got.len(), CLOSING_BYTES);
    within("the client's end", s.shutdown()).await.unwrap();
    let line = proxy.wait_for_line("tunnel closed").await;
    assert!(line.contains("end=\"closed\""), "{line}");
    proxy.finish().await;
}

/// A client that keeps sending after the upstream has closed and refused its bytes (an
/// upload, pings) has 30 s (here `--idle-timeout`, 2 s) to read the rest and end, and is
/// then cut while it still sends: its bytes go nowhere (such a client once held the
/// tunnel for as long as it sent them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_into_an_upstream_gone_is_cut() {
    let (mut proxy, mut s) = closed_upstream_tunnel(&Pki::new(), &["--idle-timeout", "2s"]).await;
    let cut = tokio::select! {
        line = proxy.wait_for_line("tunnel cut") => line,
        _ = async {
            while s.write_all(b"ping").await.is_ok() {
                tokio::task::yield_now().await;
            }
        } => proxy.wait_for_line("tunnel cut").await,
    };
    assert!(cut.contains("end=\"half-closed\""), "{cut}");
    // Not before its time: the tunnel's whole life is the upstream's bytes and the 2 s.
    let lived = cut
        .split("duration_ms=")
        .nth(1)
        .and_then(|d| d.split_whitespace().next())
        .and_then(|d| d.parse::<f64>().ok());
    assert!(lived.is_some_and(|ms| ms >= 2000.0), "{cut}");
    proxy.finish().await;
}

/// An envd upgrade the upstream turns down (a 204 here, a 401 or 404 alike) leaves no
/// upstream connection behind: hyper's client kept it idle, out of reach of the waiting
/// requests that close idle connections for a slot, 8 per sandbox and port, and 400 such
/// requests took every upstream slot for 90 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_envd_upgrade_keeps_no_upstream_connection() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(204, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--sandbox-url", &upstream.url()])
        .spawn()
        .await;
    let addr = proxy.addr();
    let req = format!(
        "GET /ws HTTP/1.1\r\nHost: localhost:{}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         E2b-Sandbox-Id: isb-1\r\nX-Access-Token: t\r\n\r\n",
        addr.port()
    );
    let (_s, resp, _) = raw_open(addr, req.as_bytes()).await;
    assert_eq!(resp.status, 204, "{resp:?}");
    wait_metric(
        proxy.admin_addr(),
        "abx_proxy_upstream_connections",
        "0",
        |v| v == Some(0.0),
    )
    .await;
    proxy.finish().await;
}

/// A TLS client that half-closes without `close_notify` (Python's `ssl` does at
/// `shutdown(SHUT_WR)`) has ended its side, as over plain TCP: the upstream's answer after
/// that end still reaches it. The end read as an error, which ended the tunnel both ways at
/// once and lost the answer (and, from an upstream ending so, up to 8 KiB of its last bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_clients_end_without_close_notify_is_an_end() {
    let pki = Pki::new();
    let upstream = websocket_upstream(&pki).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let req = websocket_request_to(addr, LATE);
    within("write the upgrade", tls.write_all(req.as_bytes()))
        .await
        .unwrap();
    let mut buf = Vec::new();
    let resp = read_response(&mut tls, &mut buf).await;
    assert_eq!(resp.status, 101, "{resp:?}");
    while buf.len() < GREETING.len() {
        let mut tmp = [0u8; 1024];
        let n = within("the greeting", tls.read(&mut tmp)).await.unwrap();
        assert!(n > 0, "tunnel closed before the greeting");
        buf.extend_from_slice(&tmp[..n]);
    }
    assert_eq!(&buf[..], GREETING);
    // The TCP connection's write side ends beneath TLS: a FIN, no `close_notify`.
    within("the FIN", tls.get_mut().0.shutdown()).await.unwrap();
    let mut answer = Vec::new();
    let read = within("the late answer", tls.read_to_end(&mut answer)).await;
    assert_eq!(
        String::from_utf8_lossy(&answer),
        String::from_utf8_lossy(LATE_ANSWER),
        "{read:?}"
    );
    let closed = proxy.wait_for_line("tunnel closed").await;
    assert!(closed.contains("end=\"closed\""), "{closed}");
    proxy.finish().await;
}

/// The moment the listening line is out, SIGHUP must reload and SIGTERM drain: neither may
/// fall to its default action (terminate) because a handler is installed a little later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_right_after_startup_are_handled() {
    let pki = Pki::new();
    let mut proxy = ProxyCmd::new("https://127.0.0.1:9", &pki).spawn().await;
    proxy.signal("HUP");
    proxy.wait_for_line("reload").await;
    let stderr = proxy.finish().await;
    assert!(stderr.contains("stopped"), "no drain:\n{stderr}");
}

// ---------------------------------------------------------------------------------------
// Listeners
// ---------------------------------------------------------------------------------------

/// A socket's path is the operator's, and the log shows what would split or turn a line
/// escaped (U+2028 ends a line for Python's `splitlines` and JavaScript), as every other
/// line that names a file does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_sockets_path_is_logged_on_one_line() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("a\u{2028}b");
    std::fs::create_dir(&odd).unwrap();
    let sock = odd.join("abx.sock");
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .listen(&format!("unix:{}", sock.display()))
        .spawn()
        .await;
    let shown = format!("unix:{}/a\\u{{2028}}b/abx.sock", dir.path().display());
    assert_eq!(proxy.listen, shown);
    assert_eq!(
        send_unix(&sock, "/sandboxes").await.status(),
        StatusCode::OK
    );
    let stderr = proxy.finish().await;
    assert!(!stderr.contains('\u{2028}'), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_listener_serves_requests() {
    use std::os::unix::fs::PermissionsExt;
    let pki = Pki::new();
    let mut upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        response(200, "via unix")
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("abx.sock");
    let admin_sock = dir.path().join("admin.sock");
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .listen(&format!("unix:{}", sock.display()))
        .admin_listen(&format!("unix:{}", admin_sock.display()))
        .spawn()
        .await;
    assert_eq!(proxy.listen, format!("unix:{}", sock.display()));
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode");

    let resp = send_unix(&sock, "/sandboxes").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "via unix");
    assert_authorized(&upstream.next_request().await, &upstream);

    // The admin endpoints answer on a unix socket too, one request per connection.
    for (path, status) in [("/healthz", StatusCode::OK), ("/readyz", StatusCode::OK)] {
        let admin = tokio::net::UnixStream::connect(&admin_sock).await.unwrap();
        let mut client = handshake(admin).await;
        let req = Request::builder()
            .uri(path)
            .header("host", "localhost")
            .body(empty())
            .unwrap();
        let resp = within("an admin answer", client.send_request(req))
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{path}");
        assert_eq!(resp.headers()["connection"], "close", "{path}");
        collect(resp.into_body()).await;
    }
    proxy.finish().await;
    assert!(!sock.exists(), "the socket file is removed at exit");
}

/// A stderr that cannot be written (the terminal closed under a running proxy, a full disk,
/// a pipe whose reader left) stops nothing: the lines are dropped, requests are answered,
/// SIGTERM ends it with 0, and a start that fails still exits with its own code (78), not a
/// panic's 101. Every log line panicked before (`eprintln!` in tracing's error report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stderr_that_cannot_be_written_stops_nothing() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("abx.sock");
    let full = || {
        let f = std::fs::OpenOptions::new().write(true).open("/dev/full");
        std::process::Stdio::from(f.expect("/dev/full"))
    };
    let abx = |key: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
        cmd.env_clear()
            .env("HOME", dir.path())
            .env("ABX_HOME", dir.path().join(".abx"))
            .current_dir(dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(full());
        if let Some(key) = key {
            cmd.env("ABX_SANDBOX_API_KEY", key);
        }
        cmd
    };

    let mut cmd = abx(Some(API_KEY));
    let listen = format!("unix:{}", sock.display());
    let ca = pki.ca_pem.display().to_string();
    cmd.args([
        "serve",
        "--listen",
        &listen,
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .args(["--sandbox-base-url", &upstream.url(), "--upstream-ca", &ca])
    .args(["--log-level", "debug"]);
    let mut proxy = Spawned::spawn(&mut cmd, "abx-proxy serve");
    // No line on stderr to wait for: the socket taking connections is the sign.
    within("the proxy to listen", async {
        let mut every = poll_ticker();
        loop {
            every.tick().await;
            if tokio::net::UnixStream::connect(&sock).await.is_ok() {
                break;
            }
            if let Some(status) = proxy.exited() {
                panic!("the proxy exited: {status}");
            }
        }
    })
    .await;
    for _ in 0..3 {
        assert_eq!(
            send_unix(&sock, "/sandboxes").await.status(),
            StatusCode::OK
        );
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &proxy.pid.to_string()])
        .status();
    assert!(killed.expect("kill").success());
    let status = proxy.exit("the proxy to exit after SIGTERM").await;
    assert_eq!(status.code(), Some(0));

    let mut check = abx(None);
    let status = Spawned::spawn(check.args(["check", "--offline"]), "abx-proxy check")
        .exit("abx-proxy check to exit")
        .await;
    assert_eq!(status.code(), Some(78), "no key: E1001's exit code");
}

/// `GET path` (with a dummy client key) on a fresh connection to the unix socket `sock`.
async fn send_unix(sock: &std::path::Path, path: &str) -> Response<hyper::body::Incoming> {
    let stream = within(
        "connect to the socket",
        tokio::net::UnixStream::connect(sock),
    )
    .await
    .unwrap();
    let mut client = handshake(stream).await;
    let req = Request::builder()
        .uri(path)
        .header("host", "localhost")
        .header("x-api-key", "dummy")
        .body(empty())
        .unwrap();
    within("the response", client.send_request(req))
        .await
        .unwrap()
}

/// `GET path` with `Host: host` on a fresh connection to the unix socket `sock` that
/// closes after the answer.
async fn unix_with_host(sock: &std::path::Path, host: &str, path: &str) -> RawResponse {
    let mut s = within(
        "connect to the socket",
        tokio::net::UnixStream::connect(sock),
    )
    .await
    .expect("connect to the socket");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    within("write the request", s.write_all(req.as_bytes()))
        .await
        .expect("write the request");
    read_response(&mut s, &mut Vec::new()).await
}

/// On a unix socket, where access is by file permission, any Host is served; with
/// `--allowed-host proxy.internal` the Hosts are restricted as on a loopback listener with
/// that flag: the listed name and the local ones are served, any other gets 400 E5003
/// without the upstream being asked. The flag used to be ignored there, without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_host_restricts_the_hosts_a_unix_socket_serves() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let dir = tempfile::tempdir().unwrap();
    let [any_sock, listed_sock] = ["any.sock", "listed.sock"].map(|n| dir.path().join(n));
    let unix = |sock: &std::path::Path| {
        ProxyCmd::new(&upstream.url(), &pki).listen(&format!("unix:{}", sock.display()))
    };
    let any = unix(&any_sock).spawn().await;
    let listed = unix(&listed_sock)
        .args(&["--allowed-host", "proxy.internal"])
        .spawn()
        .await;

    // Without the flag any Host; with it the listed name, in any case, and the local ones.
    let any_hosts = [
        "evil.example",
        "10.0.0.1:8080",
        "proxy.internal",
        "localhost",
    ];
    let listed_hosts = ["proxy.internal", "PROXY.Internal", "localhost", "127.0.0.1"];
    let served = (any_hosts.map(|h| (&any_sock, h)).into_iter())
        .chain(listed_hosts.map(|h| (&listed_sock, h)));
    for (sock, host) in served {
        let resp = unix_with_host(sock, host, "/served").await;
        let text = resp.text();
        assert_eq!(
            resp.status,
            200,
            "{}: Host {host}: {text:?}",
            sock.display()
        );
    }
    for host in ["evil.example", "proxy.internal.evil.example", "10.0.0.1"] {
        let resp = unix_with_host(&listed_sock, host, "/refused").await;
        assert_proxy_error(&resp, 400, "E5003");
    }
    assert_not_reached(&upstream, "/refused", "a refused Host");
    any.finish().await;
    listed.finish().await;
}

/// A unix socket can be connected to by its owner and group only, from the moment it has
/// its name (SPEC §7), even under umask 000 (a container's, on a volume shared with the
/// agent's): watched with inotify, each listener's socket appears at its path by a rename
/// (IN_MOVED_TO), never by a bind there (IN_CREATE), its mode is not changed after that
/// (no IN_ATTRIB), it is 0660, and the private directory it was bound in is gone. Bound in
/// place and then chmodded, it was anyone's to connect to in between.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_is_0660_from_the_moment_it_has_its_name() {
    use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
    use std::os::unix::fs::PermissionsExt;
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("abx.sock");
    let admin_sock = dir.path().join("admin.sock");
    let watch = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK).unwrap();
    let what = WatchFlags::CREATE | WatchFlags::MOVED_TO | WatchFlags::ATTRIB;
    inotify::add_watch(&watch, dir.path(), what).unwrap();

    let proxy = unix_proxy(&pki, &sock)
        .admin_listen(&format!("unix:{}", admin_sock.display()))
        // `exec`: the proxy keeps the shell's pid.
        .launcher(&["sh", "-c", "umask 000 && exec \"$@\"", "sh"])
        .spawn()
        .await;
    // Both sockets were bound before the listening line: their events are queued.
    let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
    let mut events = inotify::Reader::new(&watch, &mut buf);
    let mut seen = Vec::new();
    loop {
        match events.next() {
            Ok(e) => {
                let name = e.file_name().map(|n| n.to_string_lossy().into_owned());
                seen.push((name.unwrap_or_default(), e.events()));
            }
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("reading the inotify events: {e}"),
        }
    }
    for path in [&sock, &admin_sock] {
        let name = path.file_name().unwrap().to_string_lossy();
        let of: Vec<ReadFlags> = seen
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, e)| *e)
            .collect();
        assert_eq!(of, [ReadFlags::MOVED_TO], "{name}; every event: {seen:?}");
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660, "{name}'s mode");
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["abx.sock", "admin.sock"],
        "a private directory was left"
    );
    assert_eq!(
        send_unix(&sock, "/sandboxes").await.status(),
        StatusCode::BAD_GATEWAY,
        "the proxy's own answer: its upstream is down"
    );
    proxy.finish().await;
}

/// A proxy listening on the unix socket `sock`, its upstream a closed port.
fn unix_proxy(pki: &Pki, sock: &std::path::Path) -> ProxyCmd {
    ProxyCmd::new("https://127.0.0.1:9", pki).listen(&format!("unix:{}", sock.display()))
}

/// A socket file left behind by a listener that is gone (a crash, `kill -9`) is replaced
/// (SPEC §7): the proxy starts on that path and answers there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_unix_socket_file_is_replaced() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("abx.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists(), "the dead listener's file stays");

    let proxy = unix_proxy(&pki, &sock).spawn().await;
    // The proxy's own answer (its upstream is down) over the socket.
    let resp = send_unix(&sock, "/sandboxes").await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(resp.headers()["x-abx-error"], "E5001");
    proxy.finish().await;
}

/// Only a stale socket is replaced: on a socket another process still listens on, or on a
/// path that is no socket at all (a mistyped `--listen unix:` naming someone's file), the
/// proxy exits 78 with E1008 naming the path, and leaves what is there alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_unix_socket_or_another_file_is_not_replaced() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let live = dir.path().join("live.sock");
    let owner = std::os::unix::net::UnixListener::bind(&live).unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();

    for path in [&live, &file] {
        let (status, stderr) = unix_proxy(&pki, path).run_to_exit().await;
        assert_eq!(
            status.code(),
            Some(78),
            "{}: stderr:\n{stderr}",
            path.display()
        );
        assert!(
            stderr.contains("[E1008]") && stderr.contains(&path.display().to_string()),
            "stderr:\n{stderr}"
        );
    }
    // The owner still has its socket (had the proxy replaced it, its exit would have
    // removed the file), and the file is untouched.
    std::os::unix::net::UnixStream::connect(&live).expect("the owner's socket is still there");
    drop(owner);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

/// A live listener whose accept queue is full answers a connect with EAGAIN, not
/// "refused": it is busy, not stale, and keeps its socket (at `--max-connections` the
/// proxy itself leaves connections waiting in that queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_unix_socket_is_not_taken_for_a_stale_one() {
    use std::os::unix::fs::MetadataExt;
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let busy = dir.path().join("busy.sock");
    let socket = tokio::net::UnixSocket::new_stream().unwrap();
    socket.bind(&busy).unwrap();
    // A short queue: std's listeners ask for the system's largest.
    let owner = socket.listen(1).unwrap();
    let ino = std::fs::metadata(&busy).unwrap().ino();
    let mut queued = Vec::new();
    loop {
        match tokio::net::UnixStream::connect(&busy).await {
            Ok(s) => queued.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("connect: {e}"),
        }
        assert!(queued.len() < 100, "the accept queue never filled");
    }
    let (status, stderr) = unix_proxy(&pki, &busy).run_to_exit().await;
    assert_eq!(status.code(), Some(78), "stderr:\n{stderr}");
    assert!(stderr.contains("[E1008]"), "stderr:\n{stderr}");
    let named = std::fs::metadata(&busy).map(|m| m.ino());
    assert_eq!(
        named.ok(),
        Some(ino),
        "the path no longer names the owner's socket"
    );
    drop((queued, owner));
}

/// The path is removed at exit only while it still names the proxy's socket: one another
/// process put there meanwhile keeps its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_path_taken_over_is_left_to_its_new_owner() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("abx.sock");
    let mut proxy = unix_proxy(&pki, &sock).spawn().await;
    std::fs::remove_file(&sock).unwrap();
    let newcomer = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    proxy.signal("TERM");
    let status = proxy.wait_exit().await;
    assert!(status.success(), "exit {status}");
    std::os::unix::net::UnixStream::connect(&sock).expect("the newcomer's socket is still named");
    drop(newcomer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_loopback_listen_needs_allow_remote() {
    let pki = Pki::new();
    // TEST-NET-1, on no interface: a proxy that skipped the refusal fails to bind rather
    // than listen on every interface with the key.
    let (status, stderr) = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .listen("192.0.2.1:0")
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(78), "stderr:\n{stderr}");
    assert!(stderr.contains("--allow-remote"), "stderr:\n{stderr}");
    assert!(
        !stderr.contains("abx-proxy listening"),
        "it bound anyway:\n{stderr}"
    );
}

/// `--idle-timeout 3s`: a stream moving a few bytes every 200 ms runs past the idle
/// timeout untouched; a connection that moves nothing is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_cuts_only_connections_that_move_nothing() {
    // 200 ms apart, 4 s in all: past the 3 s timeout, which is fifteen times the pace so
    // that a loaded machine stalling the upstream for a second or two cuts nothing.
    const TICKS: usize = 20;
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            // Pacing the stream (the point of the test), not synchronisation.
            let mut every = tokio::time::interval(std::time::Duration::from_millis(200));
            for i in 0..TICKS {
                every.tick().await;
                if tx.send(Bytes::from(format!("ping {i}\n"))).await.is_err() {
                    return;
                }
            }
        });
        Response::new(boxed(ChannelBody(rx)))
    })
    .await;
    // The header timer also closes a connection that never sends a head; past GUARD, so
    // that within it only the idle timer can close the silent one.
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--idle-timeout", "3s", "--header-timeout", "120s"])
        .spawn()
        .await;
    let addr = proxy.addr();

    let mut idle = connect_raw(addr).await;
    let resp = send(addr, request("GET", addr, "/stream").body(empty()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = collect(resp.into_body()).await;
    let expected: String = (0..TICKS).map(|i| format!("ping {i}\n")).collect();
    assert_eq!(body, expected.as_bytes(), "the moving stream was cut");
    expect_closed(&mut idle, &[]).await;
    // Under the SDKs' 50 s keepalive interval, but envd is asked for keepalives every
    // half timeout: nothing to warn of.
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("--idle-timeout is under"), "{stderr}");
}

// ---------------------------------------------------------------------------------------
// Limits and framing
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_head_is_431() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();

    let big = "a".repeat(70 * 1024);
    let req = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-Big: {big}\r\n\r\n");
    let resp = raw_exchange(addr, req.as_bytes()).await;
    assert_eq!(resp.status, 431);

    // Just under the limit still goes through.
    let ok = "a".repeat(60 * 1024);
    let req = format!(
        "GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-Big: {ok}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(raw_exchange(addr, req.as_bytes()).await.status, 200);
    assert_eq!(upstream.seen().len(), 1);
    proxy.finish().await;
}

/// Sends `req` and expects 400 and the connection closed, the upstream untouched.
async fn expect_400_and_close(addr: std::net::SocketAddr, req: &str) -> RawResponse {
    let mut s = connect_raw(addr).await;
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let resp = read_response(&mut s, &mut buf).await;
    assert_eq!(resp.status, 400, "{req:?} → {resp:?}");
    expect_closed(&mut s, &buf).await;
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_framing_is_400_and_closes() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        response(200, body)
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let host = format!("Host: {addr}\r\n");

    // Both orders of Content-Length + Transfer-Encoding; the answer is the proxy's own.
    for headers in [
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        "transfer-encoding: chunked\r\ncontent-length: 0\r\n",
    ] {
        let req = format!("POST /sandboxes HTTP/1.1\r\n{host}{headers}\r\n5\r\nhello\r\n0\r\n\r\n");
        let resp = expect_400_and_close(addr, &req).await;
        assert_proxy_error(&resp, 400, "E5003");
    }
    // Conflicting lengths.
    let req = format!(
        "POST /sandboxes HTTP/1.1\r\n{host}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
    );
    expect_400_and_close(addr, &req).await;
    let req = format!("POST /sandboxes HTTP/1.1\r\n{host}Content-Length: 5, 6\r\n\r\nhello!");
    expect_400_and_close(addr, &req).await;
    // Lengths over 2^63-1 (as nginx): hyper took them and sent them on.
    for huge in ["9223372036854775808", "18446744073709551613"] {
        let req = format!("POST /sandboxes HTTP/1.1\r\n{host}Content-Length: {huge}\r\n\r\nhello");
        let resp = expect_400_and_close(addr, &req).await;
        assert_proxy_error(&resp, 400, "E5003");
        assert!(
            resp.text().contains("Content-Length over"),
            "{}",
            resp.text()
        );
    }
    assert_eq!(upstream.connections(), 0);

    // Pipelined on one keep-alive connection: a clean chunked request, a clean sized one,
    // then a smuggling attempt. Only the last is refused.
    let mut s = connect_raw(addr).await;
    let pipelined = format!(
        "POST /a HTTP/1.1\r\n{host}Transfer-Encoding: chunked\r\n\r\ne\r\nContent-Length\r\n0\r\n\r\n\
         POST /b HTTP/1.1\r\n{host}Content-Length: 26\r\n\r\nTransfer-Encoding: chunked\
         POST /c HTTP/1.1\r\n{host}Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    );
    s.write_all(pipelined.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let a = read_response(&mut s, &mut buf).await;
    assert_eq!((a.status, a.text().as_str()), (200, "Content-Length"));
    let b = read_response(&mut s, &mut buf).await;
    assert_eq!(
        (b.status, b.text().as_str()),
        (200, "Transfer-Encoding: chunked")
    );
    let c = read_response(&mut s, &mut buf).await;
    assert_proxy_error(&c, 400, "E5003");
    expect_closed(&mut s, &buf).await;
    let paths: Vec<String> = upstream.paths();
    assert_eq!(paths, ["/a", "/b"]);
    proxy.finish().await;
}

/// Writes `bytes` at once, then reads every answer until the proxy closes the connection.
async fn answers_until_close<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    bytes: &[u8],
) -> Vec<RawResponse> {
    within("write the requests", s.write_all(bytes))
        .await
        .expect("write the requests");
    let (mut answers, mut buf) = (Vec::new(), Vec::new());
    loop {
        if buf.is_empty() {
            let mut tmp = [0u8; 16 * 1024];
            match within("an answer or a close", s.read(&mut tmp)).await {
                Ok(0) | Err(_) => return answers,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        answers.push(read_response(s, &mut buf).await);
    }
}

/// A request with the method `PRI` is no HTTP/2 preface: hyper-util serves HTTP/2 only on
/// the exact 24 bytes `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`, and serves `PRI /x HTTP/1.1` as
/// an HTTP/1 request like any other. What follows it on the connection is checked as after
/// any other request: a smuggling attempt gets 400 E5003 and the connection closes, over
/// plain TCP (the chunked `PRI` head makes the fast path hand the connection to hyper) and
/// over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_stays_checked_after_a_pri_request() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let plain = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let tls = ProxyCmd::new(&upstream.url(), &pki)
        .tls_listener(&pki)
        .spawn()
        .await;
    let host = "Host: 127.0.0.1\r\n";
    let pri = format!("PRI /x HTTP/1.1\r\n{host}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
    let smuggles = [
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        "Transfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        "Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    ];
    for smuggle in smuggles {
        // A clean request last, closing: without the fix every one is answered, and the
        // connection still ends.
        let bytes = format!(
            "{pri}POST /smuggled HTTP/1.1\r\n{host}{smuggle}\
             GET /after HTTP/1.1\r\n{host}Connection: close\r\n\r\n"
        );
        let mut tcp = connect_raw(plain.addr()).await;
        let over_tcp = answers_until_close(&mut tcp, bytes.as_bytes()).await;
        let mut tls = pki.tls_connect(tls.addr(), &[b"http/1.1"]).await;
        let over_tls = answers_until_close(&mut tls, bytes.as_bytes()).await;
        for (over, answers) in [("TCP", over_tcp), ("TLS", over_tls)] {
            let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
            assert_eq!(statuses, [200, 400], "{smuggle:?} over {over}");
            assert_proxy_error(&answers[1], 400, "E5003");
        }
    }
    assert_eq!(upstream.paths(), ["/x"; 6]);
    assert!(upstream.seen().iter().all(|s| s.method == "PRI"));
    plain.finish().await;
    tls.finish().await;
}

/// hyper ends a chunked body's trailer section only at CRLF CRLF: a bare LF is an ordinary
/// byte of a trailer to it. A client must not be able to make the framing watch end the
/// trailers early, read hyper's trailers as a head with a length, and skip the next
/// request unchecked: the request with the bare LF is the connection's last one served,
/// whatever follows it is refused, and nothing after it reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_stays_checked_after_a_bare_lf_in_chunked_trailers() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let host = "Host: 127.0.0.1\r\n";
    let smuggled = format!(
        "POST /smuggled HTTP/1.1\r\n{host}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n\
         3\r\nabc\r\n0\r\n\r\n"
    );
    // After the bare LF, a head whose length covers the smuggled request exactly.
    let cover = format!(
        "POST /cover HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        smuggled.len()
    );
    for end in ["0\r\nX: a\r\n\n", "1\r\nx\r\n0\r\n\n"] {
        let before = upstream.seen().len();
        let bytes = format!(
            "POST /a HTTP/1.1\r\n{host}Transfer-Encoding: chunked\r\n\r\n{end}{cover}{smuggled}\
             GET /after HTTP/1.1\r\n{host}Connection: close\r\n\r\n"
        );
        let mut s = connect_raw(proxy.addr()).await;
        let answers = answers_until_close(&mut s, bytes.as_bytes()).await;
        let seen = &upstream.paths()[before..];
        assert_eq!(seen, ["/a"], "{end:?}: reached the upstream");
        // `/a` is served; the connection closes after it, or refuses the next request.
        assert!(
            !answers.is_empty() && answers.len() <= 2,
            "{end:?}: {answers:?}"
        );
        assert_eq!(answers[0].status, 200, "{end:?}: {answers:?}");
        if let Some(next) = answers.get(1) {
            assert_proxy_error(next, 400, "E5003");
        }
    }
    proxy.finish().await;
}

/// The authority form (`GET 127.0.0.1:80 HTTP/1.1`) is only for CONNECT (RFC 9112
/// §3.2.3): for any other method it is refused with 400 E5003 and never reaches the
/// upstream, on the fast path and on hyper's (a chunked body makes the fast path hand the
/// request over). Its authority must not stand in for the Host check either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authority_form_targets_are_refused() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    for target in ["127.0.0.1:80", &addr.to_string(), "localhost:49982"] {
        for host in ["evil.example", "127.0.0.1"] {
            for (path, framing) in [
                ("fast path", ""),
                ("hyper", "Transfer-Encoding: chunked\r\n\r\n0\r\n"),
            ] {
                let req = format!(
                    "GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{framing}\r\n"
                );
                let resp = raw_exchange(addr, req.as_bytes()).await;
                assert_proxy_error(&resp, 400, "E5003");
                assert!(
                    resp.text().contains("authority-form"),
                    "{target}, Host {host}, {path}: {}",
                    resp.text()
                );
            }
        }
    }
    assert_eq!(upstream.paths(), Vec::<String>::new());
    proxy.finish().await;
}
