//! The proxy's own HTTP/1.1 upstream pool (`src/proxy/pool.rs`) end to end: the real
//! binary, envd in `sandbox_url` mode over TLS. envd is reached over HTTP/1.1 only, so
//! every request here goes through the pool, not hyper-util's client: bodies stream both
//! ways byte-identical whatever their framing, and sequential requests share one upstream
//! connection.

mod support;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Many times every buffer on the way, and small enough that a debug build on a loaded
/// machine moves it well within GUARD.
const BIG: u64 = 64 * 1024 * 1024;
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

    // Uploads: 64 MiB of unknown length (chunked upstream), then a known length.
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

    // Downloads: 64 MiB with a Content-Length, then a chunked one.
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

/// envd answering as it reads (hyper's echo: the request body streams back as it comes):
/// the rest of the upload goes up alongside the answer, on the fast path (a sized body)
/// and on hyper's (a chunked one); the upstream connection is then closed, not used
/// again. The proxy's client stopped sending at the answer's head before: the echo waited
/// for the rest and the client for the echo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_streaming_as_the_upload_goes_gets_all_of_it() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req: Request<Incoming>| async move {
        Response::new(boxed(req.into_body()))
    })
    .await;
    let proxy = one_worker_proxy(&upstream.url(), &pki).await;
    let addr = proxy.addr();
    for chunked in [false, true] {
        let framing = match chunked {
            true => "Transfer-Encoding: chunked",
            false => "Content-Length: 11",
        };
        let part = |p: &str| match chunked {
            true => format!("{:x}\r\n{p}\r\n", p.len()),
            false => p.to_string(),
        };
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /echo HTTP/1.1\r\nHost: {addr}\r\ne2b-sandbox-id: isb-pool\r\n\
             x-access-token: tok-pool\r\n{framing}\r\n\r\n"
        );
        s.write_all(format!("{head}{}", part("hello ")).as_bytes())
            .await
            .unwrap();
        // The first part's echo, before the second part is sent.
        let mut buf = Vec::new();
        while !buf.windows(6).any(|w| w == b"hello ") {
            let mut tmp = [0u8; 4096];
            let n = within("the first part's echo", s.read(&mut tmp))
                .await
                .unwrap();
            assert!(n > 0, "chunked {chunked}: closed after {buf:?}");
            buf.extend_from_slice(&tmp[..n]);
        }
        let last = if chunked { "0\r\n\r\n" } else { "" };
        s.write_all(format!("{}{last}", part("world")).as_bytes())
            .await
            .unwrap();
        let resp = read_response(&mut s, &mut buf).await;
        assert_eq!(resp.status, 200, "chunked {chunked}");
        assert_eq!(resp.text(), "hello world", "chunked {chunked}");
    }
    // An answer that came before the whole body leaves its connection in doubt: one each
    // (see `an_early_answers_connection_is_not_used_again`).
    assert_eq!(upstream.connections(), 2);
    proxy.finish().await;
}

/// An upstream that answers before the request's body came (here a 2xx, streaming) gets
/// the body alongside its answer, and the connection is then closed, not pooled, as
/// nginx's is: whether the server read the body or left it on the connection to be read
/// as its next request is unknowable, and one that skipped it gave the connection's next
/// client the answer to a request hidden in the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answers_connection_is_not_used_again() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let upstream = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut tmp = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut tmp).await.unwrap();
            assert!(n > 0, "closed before the head");
            buf.extend_from_slice(&tmp[..n]);
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        buf.drain(..end);
        let early = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n";
        s.write_all(early).await.unwrap();
        // A server that reads on: the whole body, then the answer's end.
        while buf.len() < 11 {
            let n = s.read(&mut tmp).await.unwrap();
            assert!(n > 0, "closed before the body");
            buf.extend_from_slice(&tmp[..n]);
        }
        s.write_all(b"0\r\n\r\n").await.unwrap();
        buf.drain(..11);
        // What comes next on this connection: its end, or a request if it was pooled.
        read_request(&mut s, &mut buf).await
    });
    let proxy = ProxyCmd::new(&format!("http://{up}"), &Pki::new())
        .env("TOKIO_WORKER_THREADS", Some("1"))
        .spawn()
        .await;
    let addr = proxy.addr();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("POST /upload HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 11\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    // The answer's first part, before any of the body is sent.
    let mut buf = Vec::new();
    while !buf.windows(5).any(|w| w == b"hello") {
        let mut tmp = [0u8; 4096];
        let n = within("the early answer", s.read(&mut tmp)).await.unwrap();
        assert!(n > 0, "closed after {buf:?}");
        buf.extend_from_slice(&tmp[..n]);
    }
    s.write_all(b"hello world").await.unwrap();
    let resp = read_response(&mut s, &mut buf).await;
    assert_eq!((resp.status, resp.text()), (200, "hello".to_string()));
    let next = within("the upstream connection's end", upstream)
        .await
        .unwrap();
    assert_eq!(next, None, "the connection was used again");
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

/// A plain-HTTP upstream serving `/files/{len}` (generated, with a Content-Length) and
/// answering an upload with its length and hash: the cases the proxy splices. Returns its
/// address and its accepted-connection count.
async fn plain_files_upstream() -> (SocketAddr, Arc<AtomicUsize>, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let count = conns.clone();
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let service = service_fn(|req: Request<Incoming>| async move {
                if req.method() == "PUT" {
                    let (len, hash) = hash_body(req.into_body()).await;
                    let text = format!("{len} {}", hex(&hash));
                    return Ok::<_, std::convert::Infallible>(response(200, text));
                }
                let len = req
                    .uri()
                    .path()
                    .strip_prefix("/files/")
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(0);
                let (body, _) = GenBody::new(len, len, true);
                Ok::<_, std::convert::Infallible>(Response::new(boxed(body)))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (addr, conns, task)
}

/// [`plain_files_upstream`] behind a one-worker proxy (see [`one_worker_proxy`]).
async fn plain_proxy() -> (ProxyProc, Arc<AtomicUsize>, JoinHandle<()>) {
    let (up, conns, task) = plain_files_upstream().await;
    let proxy = ProxyCmd::new(&format!("http://{up}"), &Pki::new())
        .env("TOKIO_WORKER_THREADS", Some("1"))
        .spawn()
        .await;
    (proxy, conns, task)
}

/// Large sized answers of a plain upstream to a plain client go socket to socket
/// (splice(2) on Linux): byte-identical, an odd length included, small answers between
/// them read as usual, and the upstream connection is reused after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_plain_downloads_arrive_byte_identical_and_keep_the_connection() {
    let (proxy, conns, _task) = plain_proxy().await;
    let addr = proxy.addr();
    for len in [SMALL + 8, 96, 2 * SMALL, 4096] {
        let path = format!("/files/{len}");
        let resp = send(addr, request("GET", addr, &path).body(empty()).unwrap()).await;
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        assert_eq!(
            resp.headers()["content-length"].to_str().unwrap(),
            len.to_string()
        );
        let (got_len, got_hash) = within("the download", hash_body(resp.into_body())).await;
        let (mut expect, _) = GenBody::new(len, len, true);
        let (want_len, want_hash) = hash_body(&mut expect).await;
        assert_eq!(got_len, want_len, "{path}");
        assert_eq!(hex(&got_hash), hex(&want_hash), "{path} corrupted");
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one upstream connection");
    proxy.finish().await;
}

/// An HTTP/2 client gets a plain upstream's answers whole, large ones streamed included:
/// HTTP/2 ends a stream with its head when the body says it has ended, so the pool's body
/// must say so only at its end. The upstream connection is reused after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_gets_plain_answers_whole() {
    let (proxy, conns, _task) = plain_proxy().await;
    let addr = proxy.addr();
    let tcp = within("connect", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    for len in [SMALL + 8, 96] {
        let url = format!("http://{addr}/files/{len}");
        let req = Request::get(&url).body(empty()).unwrap();
        let resp = within("the answer", h2.send_request(req)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{url}");
        let (got_len, got_hash) = within("the download", hash_body(resp.into_body())).await;
        let (mut expect, _) = GenBody::new(len, len, true);
        let (want_len, want_hash) = hash_body(&mut expect).await;
        assert_eq!(
            (got_len, hex(&got_hash)),
            (want_len, hex(&want_hash)),
            "{url}"
        );
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one upstream connection");
    proxy.finish().await;
}

/// A large download when the proxy has no descriptor left for splice's pipe (near the
/// open-file limit, where each connection already holds two): copied as usual, whole. The
/// pipe used to be made after the head went out, and its failure cut the body there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_download_without_a_descriptor_for_a_pipe_arrives_whole() {
    let (proxy, conns, _task) = plain_proxy().await;
    let addr = proxy.addr();
    let len = 2 * SMALL;
    let (mut expect, _) = GenBody::new(len, len, true);
    let want = hash_body(&mut expect).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let get = format!("GET /files/{len} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut limited = None;
    for round in ["spliced", "copied"] {
        if round == "copied" {
            // Both connections are open and pooled already: the answer needs no
            // descriptor but the pipe's.
            // One descriptor number free below the limit: a pipe takes two.
            let free = free_descriptor_numbers(proxy.pid, 2);
            limited = Some(set_soft_nofile(proxy.pid, free[1]));
        }
        s.write_all(get.as_bytes()).await.unwrap();
        let body = within("the download", read_sized_answer(&mut s)).await;
        let got = hash_body(http_body_util::Full::new(bytes::Bytes::from(body))).await;
        assert_eq!((got.0, hex(&got.1)), (want.0, hex(&want.1)), "{round}");
    }
    if let Some(soft) = limited {
        set_soft_nofile(proxy.pid, soft);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one upstream connection");
    proxy.finish().await;
}

/// One answer with a `Content-Length` read off `s`: its body, or as much of it as came
/// before the connection closed.
async fn read_sized_answer(s: &mut tokio::net::TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("a content-length");
    let mut body = buf.split_off(end);
    while body.len() < len {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    body
}

/// An upstream that announces 8 MiB and closes after 2: the client sees its download fail,
/// not a short body that looks complete, and not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_plain_download_cut_short_fails_for_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let _task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match s.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8388608\r\n\r\n")
                    .await;
                let _ = s.write_all(&vec![b'x'; 2 << 20]).await;
            });
        }
    });
    let pki = Pki::new();
    let proxy = ProxyCmd::new(&format!("http://{up}"), &pki).spawn().await;
    let addr = proxy.addr();
    let resp = send(
        addr,
        request("GET", addr, "/files/cut").body(empty()).unwrap(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = 0usize;
    let outcome = within("the end of the download", async {
        loop {
            match body.frame().await {
                None => break Ok(()),
                Some(Ok(f)) => got += f.into_data().map_or(0, |d| d.len()),
                Some(Err(e)) => break Err(e),
            }
        }
    })
    .await;
    assert!(
        outcome.is_err(),
        "a cut download ended cleanly after {got} bytes"
    );
    assert!(got <= 2 << 20, "{got}");
    proxy.finish().await;
}

/// A large sized upload from a plain client to a plain upstream: byte-identical, and both
/// the client's and the upstream's connections carry the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_plain_uploads_arrive_byte_identical_and_keep_both_connections() {
    let (proxy, conns, _task) = plain_proxy().await;
    let addr = proxy.addr();
    let mut client = connect(addr).await;
    for (seed, len) in [(7u64, SMALL + 8), (8, 2 * SMALL)] {
        let (body, sent) = GenBody::new(seed, len, true);
        let req = request("PUT", addr, "/files/upload")
            .header("content-length", len.to_string())
            .body(boxed(body))
            .unwrap();
        // hyper's client takes the next request only once the last exchange is wound up.
        within("the client connection", client.ready())
            .await
            .unwrap();
        let resp = within("the upload", client.send_request(req))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let answer = collect(resp.into_body()).await;
        let (sent_len, sent_hash) = within("the client's hash", sent).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&answer),
            format!("{sent_len} {}", hex(&sent_hash)),
            "upload corrupted on the way"
        );
        // The same client connection serves the next request.
        let req = request("GET", addr, "/files/96").body(empty()).unwrap();
        within("the client connection", client.ready())
            .await
            .unwrap();
        let resp = within("a request after the upload", client.send_request(req))
            .await
            .unwrap();
        assert_eq!(collect(resp.into_body()).await.len(), 96);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one upstream connection");
    proxy.finish().await;
}

/// What an upstream read: (connection, request on it, request line), in order.
type Log = Arc<std::sync::Mutex<Vec<(usize, usize, String)>>>;

/// An upstream on 127.0.0.1 that answers the first request of each connection and keeps it
/// alive, then reads the second one whole and closes without a word: the server acted on
/// it (or may have) and died before answering.
async fn answers_once_then_closes() -> (SocketAddr, Log, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let task = tokio::spawn(async move {
        let mut conn = 0;
        while let Ok((mut s, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                for n in 0.. {
                    let Some(line) = read_request(&mut s, &mut buf).await else {
                        return;
                    };
                    log.lock().unwrap().push((conn, n, line));
                    if n == 1 {
                        // Everything was read: the close is a FIN, not a reset.
                        return;
                    }
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
            conn += 1;
        }
    });
    (addr, seen, task)
}

/// Reads one request (head, and a `Content-Length` body) off `s`; its request line, or
/// `None` at EOF.
async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    let mut tmp = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "{head}"
    );
    let length: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.trim().parse().unwrap());
    while buf.len() < end + length {
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
    buf.drain(..end + length);
    head.lines().next().map(str::to_string)
}

/// A request the upstream read whole on a kept-alive connection, which then closed without
/// answering, may have been acted on: a POST (`/pause` has no body) is not sent again, and
/// the client gets 502 E5001; an idempotent GET is sent again on a new connection and
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_lost_to_a_keep_alive_close_is_not_sent_twice_a_get_is_retried() {
    let (up, seen, _task) = answers_once_then_closes().await;
    let proxy = ProxyCmd::new(&format!("http://{up}"), &Pki::new())
        .env("TOKIO_WORKER_THREADS", Some("1"))
        .spawn()
        .await;
    let addr = proxy.addr();
    let get = |path: &str| request("GET", addr, path).body(empty()).unwrap();

    let resp = send(addr, get("/sandboxes?warm=1")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "ok");
    let pause = request("POST", addr, "/sandboxes/isb-1/pause")
        .body(empty())
        .unwrap();
    let resp = send(addr, pause).await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(resp.headers()["x-abx-error"], "E5001");
    let body = collect(resp.into_body()).await;
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["code"], 502, "{json}");
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (0, 0, "GET /sandboxes?warm=1 HTTP/1.1".to_string()),
            (0, 1, "POST /sandboxes/isb-1/pause HTTP/1.1".to_string()),
        ],
        "the POST went over the kept-alive connection, and only once"
    );

    // The same with a GET: sent again on a new connection, answered there.
    seen.lock().unwrap().clear();
    let resp = send(addr, get("/sandboxes?warm=2")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "ok");
    let resp = send(addr, get("/sandboxes")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "ok");
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (1, 0, "GET /sandboxes?warm=2 HTTP/1.1".to_string()),
            (1, 1, "GET /sandboxes HTTP/1.1".to_string()),
            (2, 0, "GET /sandboxes HTTP/1.1".to_string()),
        ],
        "the GET was retried on a new connection"
    );
    proxy.finish().await;
}
