use super::idle::{MAX_IDLE_PER_ORIGIN, SWEEP_EVERY};
use super::*;
use http::header::{CONNECTION, CONTENT_LENGTH, HOST};
use http::uri::Authority;
use http::{HeaderValue, StatusCode, Version};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

/// Bounds every wait so a broken client fails the test instead of hanging it.
const GUARD: Duration = Duration::from_secs(20);
/// An upstream timeout no test reaches.
const LONG: Duration = Duration::from_secs(60);

async fn within<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(GUARD, fut).await.expect("timed out")
}

fn config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

fn client() -> Upstream {
    counted(Slots::unlimited())
}

fn counted(slots: Arc<Slots>) -> Upstream {
    counted_with(slots, Duration::from_secs(5))
}

fn counted_with(slots: Arc<Slots>, connect_timeout: Duration) -> Upstream {
    Upstream::new(
        config(rustls::RootCertStore::empty()),
        Versions::Http1,
        connect_timeout,
        LONG,
        None,
        slots,
        upstream::LocalResolver::new(upstream::Names::Sandboxes),
    )
}

/// A raw TCP upstream on 127.0.0.1: each connection goes to `serve` with its number.
struct Fake {
    addr: SocketAddr,
    accepts: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Fake {
    async fn start<F, Fut>(serve: F) -> Fake
    where
        F: Fn(TcpStream, usize) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepts = Arc::new(AtomicUsize::new(0));
        let count = accepts.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let n = count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(s, n));
            }
        });
        Fake {
            addr,
            accepts,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn accepts(&self) -> usize {
        self.accepts.load(Ordering::SeqCst)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One request head from `s` (what follows it stays in `buf`); `None` at EOF.
async fn read_head<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i + 4]).into_owned();
            buf.drain(..i + 4);
            return Some(head);
        }
        let mut tmp = [0u8; 4096];
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// Reads until `buf` ends with `end` (or EOF).
async fn read_until<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>, end: &[u8]) {
    while !buf.ends_with(end) {
        let mut tmp = [0u8; 4096];
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// A keep-alive server answering each request head with `answer(head)`.
fn keep_alive(
    answer: fn(&str) -> Vec<u8>,
) -> impl Fn(TcpStream, usize) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    move |s, _| Box::pin(answer_each(s, answer))
}

/// Answers each request head on `s` with `answer(head)` until the client closes.
async fn answer_each<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, answer: fn(&str) -> Vec<u8>) {
    let mut buf = Vec::new();
    while let Some(head) = read_head(&mut s, &mut buf).await {
        if s.write_all(&answer(&head)).await.is_err() {
            return;
        }
    }
}

/// RFC 9112 §6.1: an HTTP/1.0 answer with Transfer-Encoding has faulty framing. Its
/// body is read as chunked, but its connection is not used again, whatever
/// `Connection: keep-alive` says; an HTTP/1.0 keep-alive answer with a length is.
#[tokio::test]
async fn an_http_1_0_answer_with_transfer_encoding_ends_its_connection() {
    fn chunked(_: &str) -> Vec<u8> {
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n\
              2\r\nok\r\n0\r\n\r\n"
            .to_vec()
    }
    fn length(_: &str) -> Vec<u8> {
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok".to_vec()
    }
    for (answer, accepts) in [(chunked as fn(&str) -> Vec<u8>, 2), (length, 1)] {
        let fake = Fake::start(keep_alive(answer)).await;
        let client = client();
        for path in ["/1", "/2"] {
            assert_eq!(get_text(&client, &fake.url(path)).await, "ok");
        }
        assert_eq!(fake.accepts(), accepts);
    }
}

/// A GET through `client` that must get an answer; the answer's body.
async fn get_text(client: &Upstream, url: &str) -> String {
    let resp = within(client.request(Plane::Api, get(url), LONG))
        .await
        .unwrap();
    text(resp).await
}

fn get(url: &str) -> Request<ProxyBody> {
    Request::get(url).body(body::empty()).unwrap()
}

/// A WebSocket upgrade request: it goes through hyper's client.
fn upgrade(url: &str) -> Request<ProxyBody> {
    Request::get(url)
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, "websocket")
        .body(body::empty())
        .unwrap()
}

fn with_body(method: &str, url: &str, b: ProxyBody) -> Request<ProxyBody> {
    Request::builder().method(method).uri(url).body(b).unwrap()
}

async fn text(resp: Response<ProxyBody>) -> String {
    let bytes = within(resp.into_body().collect())
        .await
        .expect("body")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A request body fed by the test, one chunk per message, size unknown.
struct ChannelBody(mpsc::Receiver<Result<Bytes, BoxError>>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|m| m.map(|r| r.map(Frame::data)))
    }
}

fn channel() -> (mpsc::Sender<Result<Bytes, BoxError>>, ProxyBody) {
    let (tx, rx) = mpsc::channel(4);
    (tx, body::boxed(ChannelBody(rx)))
}

/// A PUT to `url` through `client` whose body has given `first` and waits for more:
/// the sender of the rest, and the answer.
async fn put_first(
    client: &Upstream,
    url: &str,
    first: &'static [u8],
) -> (mpsc::Sender<Result<Bytes, BoxError>>, Response<ProxyBody>) {
    let (tx, body) = channel();
    tx.send(Ok(Bytes::from_static(first))).await.unwrap();
    let put = with_body("PUT", url, body);
    let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
    (tx, resp)
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

#[tokio::test]
async fn sequential_requests_reuse_one_connection() {
    let fake = Fake::start(keep_alive(|head| {
        if head.starts_with("GET /big ") {
            let mut r = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
            r.extend(std::iter::repeat_n(b'x', 200_000));
            r
        } else {
            OK.to_vec()
        }
    }))
    .await;
    let client = client();
    for path in ["/a", "/big", "/b", "/big", "/c"] {
        let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = text(resp).await;
        if path == "/big" {
            assert_eq!(body.len(), 200_000);
            assert!(body.bytes().all(|b| b == b'x'));
        } else {
            assert_eq!(body, "ok");
        }
    }
    assert_eq!(fake.accepts(), 1);
}

/// A large plain answer is spliced only with a place free for its pipe (see
/// `descriptors::Budget::pipes`), held while the splice lasts and apart from the
/// connections' slots; without one the body is read as usual, whole.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_splice_takes_a_pipes_place_or_the_body_is_read() {
    const LEN: usize = 2 << 20;
    let up = Fake::start(keep_alive(|_| {
        let mut answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {LEN}\r\n\r\n");
        answer.push_str(&"x".repeat(LEN));
        answer.into_bytes()
    }))
    .await;
    for pipes in [0, 1] {
        let slots = Slots::new(1, pipes);
        let pool = counted(slots.clone());
        let resp = within(pool.request(Plane::Api, get(&up.url("/")), LONG)).await;
        let resp = resp.expect("the answer");
        let offer = resp.extensions().get::<Splice>().cloned().expect("offered");
        let taken = offer.take(LEN as u64);
        assert_eq!(taken.is_some(), pipes == 1, "{pipes} places");
        assert_eq!(slots.in_use(), 1, "{pipes} places: the connection");
        if taken.is_some() {
            assert!(slots.try_take_pipe().is_none(), "the place is held");
            drop(taken);
            assert!(slots.try_take_pipe().is_some(), "given back");
        } else {
            assert_eq!(text(resp).await.len(), LEN, "read whole");
        }
    }
}

/// Connections hold the slots both planes share: with one, a request to another
/// origin takes over an idle connection's (closing it); while an answer holds it, a
/// request waits for it, and gets it as the answer ends, the connection closed rather
/// than pooled, or fails after the connect timeout.
#[tokio::test]
async fn connections_are_held_to_the_shared_slots() {
    let a = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let more = Arc::new(tokio::sync::Notify::new());
    let go_on = more.clone();
    let b = Fake::start(move |mut s, _| {
        let go_on = go_on.clone();
        async move {
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                let head = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok";
                let _ = s.write_all(head).await;
                go_on.notified().await;
                let _ = s.write_all(b"ok").await;
            }
        }
    })
    .await;
    let slots = Slots::new(1, Slots::UNLIMITED);
    let api = Arc::new(counted(slots.clone()));
    let envd = counted_with(slots.clone(), Duration::from_millis(300));

    assert_eq!(get_text(&api, &a.url("/")).await, "ok");
    assert_eq!(slots.in_use(), 1, "the idle connection holds its slot");
    let held = within(envd.request(Plane::Envd, get(&b.url("/")), LONG)).await;
    let held = held.expect("the idle connection to a gave its slot up");
    assert_eq!(slots.in_use(), 1);

    let Err(e) = within(envd.request(Plane::Envd, get(&a.url("/")), LONG)).await else {
        panic!("a second connection with one slot");
    };
    assert!(matches!(e, UpstreamError::Connect(_)), "{e:?}");
    assert_eq!(
        e.describe(),
        "connect failed: no upstream connection free within 300ms: all 1 in use (the \
             open-file limit's share, see --max-connections)"
    );

    let waiting = tokio::spawn({
        let (api, url) = (api.clone(), a.url("/"));
        async move { get_text(&api, &url).await }
    });
    while !slots.wanted() {
        tokio::task::yield_now().await;
    }
    more.notify_one();
    assert_eq!(text(held).await, "okok");
    assert_eq!(within(waiting).await.unwrap(), "ok");
    assert_eq!(slots.in_use(), 1);
    // b's connection was closed, not pooled: another request to b connects again.
    more.notify_one();
    assert_eq!(get_text(&envd, &b.url("/")).await, "okok");
    assert_eq!(b.accepts(), 2);
}

/// The second request is a POST, which is never sent again on a new connection (see
/// `Exchange::fail`): a GET lost on the dead connection would be, and the test would
/// pass with a pool that hands out connections the server closed.
#[tokio::test]
async fn an_idle_connection_the_server_closed_is_replaced() {
    let (closed_tx, closed_rx) = oneshot::channel::<()>();
    let closed_tx = Arc::new(Mutex::new(Some(closed_tx)));
    let fake = Fake::start(move |mut s, n| {
        let closed_tx = closed_tx.clone();
        async move {
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                let _ = s.write_all(OK).await;
                if n == 0 {
                    // Keep-alive said nothing about closing; close anyway.
                    drop(s);
                    if let Some(tx) = closed_tx.lock().unwrap().take() {
                        let _ = tx.send(());
                    }
                    return;
                }
            }
        }
    })
    .await;
    let client = client();
    assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
    within(closed_rx).await.unwrap();
    // On loopback the FIN is in our socket once the close has returned, but the
    // connection's readiness comes from the runtime's I/O driver, which a task woken by
    // the channel need not have let run: a yield polls it before this task goes on.
    tokio::task::yield_now().await;
    let pause = with_body("POST", &fake.url("/2"), body::empty());
    let resp = within(client.request(Plane::Api, pause, LONG))
        .await
        .unwrap();
    assert_eq!(text(resp).await, "ok");
    assert_eq!(fake.accepts(), 2);
}

/// A connection's idle age counts the machine's sleeps ([`crate::clock`]): one that
/// went idle ten seconds before a night's sleep is past its idle timeout on waking,
/// and the next request opens a new connection (the upstream dropped the old one while
/// its close could not reach the sleeping machine). No sleep can be had in a test: the
/// stamp is set back as one would leave it. Linux: elsewhere the clock is monotonic.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_connection_idle_across_a_sleep_is_not_used_again() {
    let fake = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let client = client();
    assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
    assert_eq!(get_text(&client, &fake.url("/2")).await, "ok");
    assert_eq!(fake.accepts(), 1, "kept alive while awake");
    let slept = IDLE_TIMEOUT + Duration::from_secs(1);
    let now = crate::clock::since_boot();
    assert!(now > slept, "up {now:?}");
    {
        let mut idle = client.pool.lock();
        let conn = idle.origins[0].conns.last_mut().expect("pooled");
        conn.idle_since -= slept;
    }
    assert_eq!(get_text(&client, &fake.url("/3")).await, "ok");
    assert_eq!(fake.accepts(), 2, "a new connection after the sleep");
}

/// Idle connections the upstream closed are dropped by the sweep, with no request for
/// their origin, while one still open stays; the sweep ends with the last connection.
#[tokio::test]
async fn the_sweep_drops_idle_connections_the_upstream_closed() {
    let (close_tx, close_rx) = oneshot::channel::<()>();
    let (closed_tx, closed_rx) = oneshot::channel::<()>();
    let signals = Arc::new(Mutex::new(Some((close_rx, closed_tx))));
    // Answers one request, then closes once told to.
    let closing = Fake::start(move |mut s, _| {
        let signals = signals.clone();
        async move {
            let mut buf = Vec::new();
            read_head(&mut s, &mut buf).await;
            let _ = s.write_all(OK).await;
            let Some((close, closed)) = signals.lock().unwrap().take() else {
                return;
            };
            let _ = close.await;
            drop(s);
            let _ = closed.send(());
        }
    })
    .await;
    let staying = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let client = client();
    assert_eq!(get_text(&client, &closing.url("/1")).await, "ok");
    assert_eq!(get_text(&client, &staying.url("/1")).await, "ok");
    let pooled = |client: &Upstream| -> Vec<u16> {
        let idle = client.pool.lock();
        idle.origins.iter().map(|o| o.key.port).collect()
    };
    assert_eq!(pooled(&client).len(), 2);

    close_tx.send(()).unwrap();
    within(closed_rx).await.unwrap();
    tokio::time::pause();
    // A little past the period: timers round their deadlines up to the millisecond.
    let period = SWEEP_EVERY + Duration::from_millis(10);
    tokio::time::advance(period).await;
    // The sweep's timer has fired: it runs once this task lets it.
    for _ in 0..100 {
        if pooled(&client).len() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(pooled(&client), [staying.addr.port()]);
    assert!(client.pool.lock().sweeping);

    drop(staying);
    let conn = client.pool.lock().origins[0].conns.pop().unwrap();
    drop(conn);
    tokio::time::advance(period).await;
    for _ in 0..100 {
        if !client.pool.lock().sweeping {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        !client.pool.lock().sweeping,
        "the sweep ends with the last connection"
    );
}

/// An origin keeps at most [`MAX_IDLE_PER_ORIGIN`] idle connections: one more coming
/// back is closed (its upstream sees the end), so a burst does not leave a descriptor
/// per request held for good.
#[tokio::test]
async fn an_origin_keeps_at_most_its_idle_limit_and_closes_the_rest() {
    // Both ends of every connection are in this process; the default soft limit of
    // 1024 descriptors is shared with the tests running beside this one.
    let _ = rlimit::increase_nofile_limit(4096);
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel::<()>();
    let fake = Fake::start(move |mut s, _| {
        let mut go = go_rx.clone();
        let closed = closed_tx.clone();
        async move {
            let mut buf = Vec::new();
            if read_head(&mut s, &mut buf).await.is_none() {
                return;
            }
            // Half the body, the rest when told: until then the client holds the connection.
            let _ = s.write_all(&OK[..OK.len() - 1]).await;
            let _ = go.wait_for(|go| *go).await;
            let _ = s.write_all(b"k").await;
            if read_head(&mut s, &mut buf).await.is_none() {
                let _ = closed.send(());
            }
        }
    })
    .await;
    let client = client();
    let n = MAX_IDLE_PER_ORIGIN + 1;
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let resp = within(client.request(Plane::Api, get(&fake.url("/")), LONG)).await;
        held.push(resp.unwrap());
    }
    assert_eq!(fake.accepts(), n, "each request holds a connection");
    go_tx.send(true).unwrap();
    for resp in held {
        assert_eq!(text(resp).await, "ok");
    }
    let kept: usize = {
        let idle = client.pool.lock();
        idle.origins.iter().map(|o| o.conns.len()).sum()
    };
    assert_eq!(MAX_IDLE_PER_ORIGIN, kept);
    within(closed_rx.recv()).await.unwrap();
}

/// The deadline lives with the connection and moves per exchange: a kept-alive
/// connection whose first exchange had a long deadline still times out the second,
/// shorter one, and a timeout on a fresh connection covers the connect too.
#[tokio::test]
async fn the_upstream_timeout_follows_each_exchange_on_a_reused_connection() {
    let fake = Fake::start(|mut s, n| async move {
        // Answers the first request of the first connection only.
        let mut answer = n == 0;
        let mut buf = Vec::new();
        while read_head(&mut s, &mut buf).await.is_some() {
            if std::mem::take(&mut answer) {
                let _ = s.write_all(OK).await;
            }
        }
    })
    .await;
    let client = client();
    assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");
    let e = within(client.request(Plane::Api, get(&fake.url("/2")), Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
    assert_eq!(e.kind(), FailKind::Timeout);
    assert_eq!(
        fake.accepts(),
        1,
        "the second exchange reused the connection"
    );
    // A timed-out exchange leaves its connection unusable: the next one opens another,
    // and times out as well.
    let e = within(client.request(Plane::Api, get(&fake.url("/3")), Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
    assert_eq!(fake.accepts(), 2);
}

/// No head within the timeout while the request body waits on the client: the client's
/// stall (the upstream waits for the rest), not an upstream timeout. While the body
/// waits on the upstream instead, which stopped reading, the upstream's.
#[tokio::test]
async fn a_stalled_upload_is_told_from_an_upstream_that_stopped_reading() {
    // Reads the head and nothing more, and never answers.
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        if read_head(&mut s, &mut buf).await.is_some() {
            std::future::pending::<()>().await;
        }
    })
    .await;
    let client = client();
    let short = Duration::from_millis(300);
    let (tx, body) = channel();
    tx.send(Ok(Bytes::from_static(b"first part")))
        .await
        .unwrap();
    let put = with_body("PUT", &fake.url("/stalled"), body);
    let e = within(client.request(Plane::Api, put, short))
        .await
        .unwrap_err();
    assert!(matches!(e, UpstreamError::BodyStalled), "{e:?}");
    drop(tx);

    // Far more than the sockets' buffers hold, offered as fast as it is taken.
    let (tx, body) = channel();
    let feed = tokio::spawn(async move {
        let chunk = Bytes::from(vec![b'x'; 1 << 20]);
        while tx.send(Ok(chunk.clone())).await.is_ok() {}
    });
    let put = with_body("PUT", &fake.url("/unread"), body);
    let e = within(client.request(Plane::Api, put, short))
        .await
        .unwrap_err();
    assert!(matches!(e, UpstreamError::Timeout), "{e:?}");
    within(feed).await.unwrap();
}

/// The server takes the second request on the kept-alive connection and closes without
/// a word: a bodiless request with an idempotent method goes again on a new connection;
/// one with a body does not, nor a POST, which the server may have carried out.
#[tokio::test]
async fn a_request_lost_to_a_keep_alive_close_is_retried_once_only_if_idempotent() {
    let heads = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = heads.clone();
    let fake = Fake::start(move |mut s, _| {
        let seen = seen.clone();
        async move {
            let mut buf = Vec::new();
            let mut served = 0;
            while let Some(head) = read_head(&mut s, &mut buf).await {
                seen.lock().unwrap().push(head);
                if served == 1 {
                    return;
                }
                served += 1;
                let _ = s.write_all(OK).await;
            }
        }
    })
    .await;
    let client = client();
    for path in ["/1", "/2"] {
        assert_eq!(get_text(&client, &fake.url(path)).await, "ok");
    }
    assert_eq!(fake.accepts(), 2, "the retry took a new connection");
    let paths: Vec<String> = heads
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.split(' ').nth(1).unwrap().to_string())
        .collect();
    assert_eq!(paths, ["/1", "/2", "/2"]);

    // Connection 2 served /2; the POST reuses it and is lost: not sent again.
    let post = with_body("POST", &fake.url("/3"), body::full("data"));
    let e = within(client.request(Plane::Api, post, LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
    assert_eq!(e.describe(), "connection closed early");
    assert_eq!(fake.accepts(), 2, "a body is never sent twice");

    // A POST without a body (`/sandboxes/{id}/pause`) is not sent twice either.
    assert_eq!(get_text(&client, &fake.url("/4")).await, "ok");
    let pause = with_body("POST", &fake.url("/5"), body::empty());
    let e = within(client.request(Plane::Api, pause, LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
    assert_eq!(fake.accepts(), 3, "a POST is never sent twice");

    // DELETE is idempotent: it goes again.
    assert_eq!(get_text(&client, &fake.url("/6")).await, "ok");
    let delete = with_body("DELETE", &fake.url("/7"), body::empty());
    let resp = within(client.request(Plane::Api, delete, LONG))
        .await
        .unwrap();
    assert_eq!(text(resp).await, "ok");
    assert_eq!(fake.accepts(), 5, "the retry took a new connection");
    let methods: Vec<String> = heads
        .lock()
        .unwrap()
        .iter()
        .skip(3)
        .map(|h| h.split(' ').take(2).collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        methods,
        [
            "POST /3",
            "GET /4",
            "POST /5",
            "GET /6",
            "DELETE /7",
            "DELETE /7"
        ]
    );
}

/// One poll of a request, with this task's waker.
async fn poll_once<T>(request: &mut Pin<Box<dyn Future<Output = T> + Send + '_>>) -> Poll<T> {
    poll_fn(|cx| Poll::Ready(request.as_mut().poll(cx))).await
}

/// Shuts the writing half of the pooled idle connection, so the next request on it
/// fails at its first write, with nothing written, while the read side still looks
/// open to the checkout.
fn shut_the_idle_connections_writing_half(client: &Upstream) {
    let mut conn = client.pool.lock().origins[0].conns.pop().unwrap();
    let Io::Plain(tcp) = conn.io else {
        panic!("plain upstream")
    };
    let tcp = tcp.into_std().unwrap();
    tcp.shutdown(std::net::Shutdown::Write).unwrap();
    conn.io = Io::Plain(TcpStream::from_std(tcp).unwrap());
    client.pool.lock().origins[0].conns.push(conn);
}

/// A request none of which reached the server goes again on a new connection, a POST
/// too, since the server cannot have acted on it; one whose body was already taken
/// does not, as what was taken is gone.
#[tokio::test]
async fn a_request_none_of_which_was_written_is_sent_again_unless_its_body_was_taken() {
    let heads = Arc::new(Mutex::new(Vec::<(usize, String)>::new()));
    let seen = heads.clone();
    // A connection closes only when the test says: after its request's write failed.
    let close = Arc::new(tokio::sync::Semaphore::new(0));
    let closing = close.clone();
    let fake = Fake::start(move |mut s, n| {
        let (seen, closing) = (seen.clone(), closing.clone());
        async move {
            let mut buf = Vec::new();
            while let Some(head) = read_head(&mut s, &mut buf).await {
                seen.lock().unwrap().push((n, head));
                let _ = s.write_all(OK).await;
            }
            closing.acquire().await.unwrap().forget();
        }
    })
    .await;
    let client = client();
    assert_eq!(get_text(&client, &fake.url("/1")).await, "ok");

    shut_the_idle_connections_writing_half(&client);
    let pause = with_body("POST", &fake.url("/2"), body::empty());
    let mut request = client.request(Plane::Api, pause, LONG);
    // The first poll takes the pooled connection and fails to write; the answer waits
    // for the server's close, which tells a dead connection from a slow one.
    assert!(poll_once(&mut request).await.is_pending());
    close.add_permits(1);
    let resp = within(request).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    assert_eq!(fake.accepts(), 2, "the POST went again on a new connection");

    shut_the_idle_connections_writing_half(&client);
    let upload = with_body("POST", &fake.url("/3"), body::full("data"));
    let mut request = client.request(Plane::Api, upload, LONG);
    assert!(poll_once(&mut request).await.is_pending());
    close.add_permits(1);
    let e = within(request).await.unwrap_err();
    assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
    assert_eq!(fake.accepts(), 2, "a body once taken is never sent again");

    let seen: Vec<(usize, String)> = heads
        .lock()
        .unwrap()
        .iter()
        .map(|(n, h)| (*n, h.split(' ').take(2).collect::<Vec<_>>().join(" ")))
        .collect();
    assert_eq!(seen, [(0, "GET /1".into()), (1, "POST /2".into())]);
}

#[tokio::test]
async fn a_server_closing_mid_response_is_a_reset() {
    // One answer per connection, cut short, then the connection closes.
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        if let Some(head) = read_head(&mut s, &mut buf).await {
            let reply: &[u8] = if head.starts_with("GET /head ") {
                b"HTTP/1.1 200 OK\r\nContent-Le"
            } else {
                b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
            };
            let _ = s.write_all(reply).await;
        }
    })
    .await;
    let client = client();
    let e = within(client.request(Plane::Api, get(&fake.url("/head")), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Reset, "{e:?}");
    assert_eq!(e.describe(), "connection closed early");

    let resp = within(client.request(Plane::Api, get(&fake.url("/body")), LONG))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let e = within(resp.into_body().collect()).await.unwrap_err();
    let e = e.downcast_ref::<UpstreamError>().expect("an UpstreamError");
    assert!(matches!(e, UpstreamError::Closed), "{e:?}");
    assert_eq!(e.kind(), FailKind::Reset);
}

#[tokio::test]
async fn chunked_responses_are_decoded_with_extensions_and_trailers() {
    let fake = Fake::start(keep_alive(|_| {
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              5;ext=1\r\nhello\r\n6 ; name=\"v\"\r\n world\r\n0\r\nx-trailer: yes\r\n\r\n"
            .to_vec()
    }))
    .await;
    let client = client();
    for _ in 0..2 {
        let resp = within(client.request(Plane::Api, get(&fake.url("/")), LONG))
            .await
            .unwrap();
        let collected = within(resp.into_body().collect()).await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-trailer"], "yes");
        assert_eq!(collected.to_bytes(), "hello world");
    }
    assert_eq!(
        fake.accepts(),
        1,
        "a chunked body read to its end is reusable"
    );
}

#[tokio::test]
async fn close_delimited_responses_read_to_eof() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        if read_head(&mut s, &mut buf).await.is_some() {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nall of it").await;
        }
    })
    .await;
    let client = client();
    for _ in 0..2 {
        assert_eq!(get_text(&client, &fake.url("/")).await, "all of it");
    }
    assert_eq!(
        fake.accepts(),
        2,
        "a close-delimited body ends its connection"
    );
}

#[tokio::test]
async fn head_204_and_304_have_no_body() {
    let fake = Fake::start(keep_alive(|head| match head.split(' ').nth(1).unwrap() {
        "/head" => b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec(),
        "/204" => b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
        "/304" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n".to_vec(),
        _ => OK.to_vec(),
    }))
    .await;
    let client = client();
    let head = Request::head(fake.url("/head"))
        .body(body::empty())
        .unwrap();
    let resp = within(client.request(Plane::Api, head, LONG))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-length"], "1000");
    assert!(resp.body().is_end_stream());
    for path in ["/204", "/304"] {
        let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
            .await
            .unwrap();
        assert_eq!(resp.status().as_str(), &path[1..]);
        assert_eq!(text(resp).await, "");
    }
    assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
    assert_eq!(fake.accepts(), 1);
}

/// A 204 with `Transfer-Encoding` or a length, or a 304 with `Transfer-Encoding`, is often
/// followed by the body it announced (`0\r\n\r\n`, late): read as the next request's
/// answer, that gave another client a 502 or, with a whole answer, shifted every later
/// answer by one. A 304's length is the resource's: its connection is kept.
#[tokio::test]
async fn a_bodyless_answer_announcing_a_body_ends_its_connection() {
    let fake = Fake::start(keep_alive(|head| match head.split(' ').nth(1).unwrap() {
        "/zero" => b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n".to_vec(),
        "/chunked" => b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
        "/length" => b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n".to_vec(),
        "/304-length" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n".to_vec(),
        "/304-chunked" => {
            b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec()
        }
        _ => OK.to_vec(),
    }))
    .await;
    let client = client();
    let answers = [
        ("/zero", 1),
        ("/chunked", 2),
        ("/length", 3),
        ("/304-length", 3),
        ("/304-chunked", 4),
    ];
    for (path, accepts) in answers {
        let resp = within(client.request(Plane::Api, get(&fake.url(path)), LONG))
            .await
            .unwrap();
        let status = if path.starts_with("/304") { 304 } else { 204 };
        assert_eq!(resp.status(), status, "{path}");
        assert_eq!(text(resp).await, "", "{path}");
        assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
        assert_eq!(fake.accepts(), accepts, "after {path}");
    }
}

/// An idle connection keeps no download's read buffer: up to 128 KiB each was kept, and
/// a thousand sandboxes' idle connections held 150 MiB. A small answer's buffer is kept
/// (no allocation per request).
#[tokio::test]
async fn an_idle_connection_keeps_no_large_read_buffer() {
    let fake = Fake::start(keep_alive(|head| {
        if head.split(' ').nth(1) != Some("/big") {
            return OK.to_vec();
        }
        let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
        answer.resize(answer.len() + 200_000, b'x');
        answer
    }))
    .await;
    let client = client();
    // Whether the idle connection's read buffer is a new one: split to its end, a
    // download's buffer reads empty but is still there; a new one has not allocated.
    let fresh = || -> Vec<bool> {
        let new = BytesMut::new().as_ptr();
        (client.pool.idle.iter())
            .flat_map(|list| {
                let idle = list.lock().unwrap();
                let conns = idle.origins.iter().flat_map(|o| o.conns.iter());
                conns.map(|c| c.rbuf.as_ptr() == new).collect::<Vec<_>>()
            })
            .collect()
    };
    for _ in 0..3 {
        assert_eq!(get_text(&client, &fake.url("/small")).await, "ok");
        assert_eq!(fresh(), [false], "a small answer's buffer is kept");
    }
    assert_eq!(get_text(&client, &fake.url("/big")).await.len(), 200_000);
    assert_eq!(fresh(), [true], "a download's is not");
    assert_eq!(fake.accepts(), 1);
}

/// Nor a large request head's write buffer: a 60 KiB head's was kept through the answer's
/// wait and then while the connection idled (an HPACK-indexed head costs its HTTP/2 client
/// ~130 bytes). A small head's is kept (no allocation per request).
#[tokio::test]
async fn an_idle_connection_keeps_no_large_write_buffer() {
    let fake = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let client = client();
    let wbufs = || -> Vec<(usize, *const u8)> {
        (client.pool.idle.iter())
            .flat_map(|list| {
                let idle = list.lock().unwrap();
                let conns = idle.origins.iter().flat_map(|o| o.conns.iter());
                conns
                    .map(|c| (c.wbuf.capacity(), c.wbuf.as_ptr()))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    assert_eq!(get_text(&client, &fake.url("/small")).await, "ok");
    let kept = wbufs();
    assert_eq!(kept.len(), 1);
    assert_eq!(get_text(&client, &fake.url("/small")).await, "ok");
    assert_eq!(wbufs(), kept, "a small head's buffer is kept");
    let mut req = get(&fake.url("/big-head"));
    let value = http::HeaderValue::from_str(&"v".repeat(4000)).unwrap();
    for _ in 0..15 {
        req.headers_mut().append("x-a", value.clone());
    }
    let resp = within(client.request(Plane::Api, req, LONG)).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    let after = wbufs();
    assert_eq!(after.len(), 1);
    assert!(
        after[0].0 <= WBUF_KEPT,
        "a 60 KiB head's buffer kept: {after:?}"
    );
    assert_eq!(fake.accepts(), 1);
}

/// A slot wanted closes the longest idle connection, whatever its origin: the first
/// origin's was closed, however recently used.
#[tokio::test]
async fn the_longest_idle_connection_is_the_one_closed() {
    let a = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let b = Fake::start(keep_alive(|_| OK.to_vec())).await;
    let client = client();
    // `a` first in the pool's list, then `b`, then `a` again: `b` idle the longest.
    for fake in [&a, &b, &a] {
        assert_eq!(get_text(&client, &fake.url("/")).await, "ok");
    }
    assert!(client.pool.close_one());
    for fake in [&a, &b] {
        assert_eq!(get_text(&client, &fake.url("/")).await, "ok");
    }
    assert_eq!((a.accepts(), b.accepts()), (1, 2), "b's closed, a's kept");
}

#[tokio::test]
async fn interim_100_continue_is_skipped() {
    let fake = Fake::start(keep_alive(|_| {
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
              HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
            .to_vec()
    }))
    .await;
    let client = client();
    let post = with_body("POST", &fake.url("/"), body::full("x"));
    let resp = within(client.request(Plane::Api, post, LONG))
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert!(resp.headers().get("link").is_none());
    assert_eq!(text(resp).await, "ok");
}

/// Answers whose framing a proxy must not pass on, by the path asked for.
fn ambiguous(head: &str) -> Vec<u8> {
    match head.split(' ').nth(1).unwrap() {
            "/cl-te" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/two-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!".to_vec(),
            "/bad-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok".to_vec(),
            "/gzip" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/gzip-eof" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx".to_vec(),
            "/twice" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "/same-cl" => b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/101" => b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n".to_vec(),
            "/h2c" => b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n".to_vec(),
            "/garbage" => b"\x00\x01 not http\r\n\r\n".to_vec(),
            "/many" => {
                let mut r = b"HTTP/1.1 200 OK\r\n".to_vec();
                for i in 0..150 {
                    r.extend_from_slice(format!("x-h{i}: {i}\r\n").as_bytes());
                }
                r.extend_from_slice(b"Content-Length: 0\r\n\r\n");
                r
            }
            _ => OK.to_vec(),
        }
}

#[tokio::test]
async fn ambiguous_response_framing_is_a_protocol_error() {
    let fake = Fake::start(keep_alive(ambiguous)).await;
    let client = client();
    let paths = [
        "/cl-te",
        "/two-cl",
        "/bad-cl",
        "/garbage",
        "/many",
        "/gzip",
        "/gzip-eof",
        "/twice",
        "/101",
    ];
    assert_refused(&client, &fake, |path| fake.url(path), &paths).await;
    assert_plain_length(&client, &fake.url("/same-cl")).await;
    // A plain answer on the same client still works.
    assert_eq!(get_text(&client, &fake.url("/ok")).await, "ok");
}

/// Each of `paths` is a protocol error, and no connection that carried one is reused.
async fn assert_refused(
    client: &Upstream,
    fake: &Fake,
    url: impl Fn(&str) -> String,
    paths: &[&str],
) {
    for path in paths {
        let e = within(client.request(Plane::Api, get(&url(path)), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Protocol, "{path}: {e:?}");
        assert!(e.describe().starts_with("invalid response: "), "{path}");
    }
    assert_eq!(
        fake.accepts(),
        paths.len(),
        "no connection with a bad answer is reused"
    );
}

/// Equal lengths, listed and repeated, are one length, and the client gets it plain.
async fn assert_plain_length(client: &Upstream, url: &str) {
    let resp = within(client.request(Plane::Api, get(url), LONG))
        .await
        .unwrap();
    let lengths: Vec<_> = resp.headers().get_all(CONTENT_LENGTH).iter().collect();
    assert_eq!(lengths, ["2"]);
    assert_eq!(text(resp).await, "ok");
}

/// The same answers from an `https` origin that may negotiate HTTP/2 and chose
/// HTTP/1.1 (hyper's client reads them): hyper decoded `gzip, chunked` of its chunks
/// and passed on `Content-Length` beside `Transfer-Encoding`, and the client got a
/// body still compressed with the field that said so removed, or cut at the length
/// yet looking complete.
#[tokio::test]
async fn ambiguous_response_framing_is_a_protocol_error_on_hypers_client_too() {
    let tls = tls_pair();
    let fake = tls_answering(&tls, ambiguous).await;
    let client = negotiating(&tls);
    let url = |path: &str| format!("https://localhost:{}{path}", fake.addr.port());
    let paths = ["/cl-te", "/gzip", "/gzip-eof", "/twice"];
    assert_refused(&client, &fake, url, &paths).await;
    assert_plain_length(&client, &url("/same-cl")).await;
    assert_eq!(get_text(&client, &url("/ok")).await, "ok");
}

/// A WebSocket upgrade is answered with its 101 (the handler tunnels it). A 101 to a
/// request that asked for none was passed on as the final answer, and the client
/// waited for what came after it until its idle timeout; one that switched to another
/// protocol was tunnelled.
#[tokio::test]
async fn only_a_websocket_upgrade_gets_its_101() {
    let tls = tls_pair();
    let fake = tls_answering(&tls, ambiguous).await;
    let client = negotiating(&tls);
    let url = format!("https://localhost:{}", fake.addr.port());
    let e = within(client.request(Plane::Api, get(&format!("{url}/101")), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Protocol, "{e:?}");
    assert_eq!(
        e.describe(),
        "invalid response: unexpected 101 Switching Protocols"
    );
    let resp = within(client.request(Plane::Api, upgrade(&format!("{url}/101")), LONG))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let e = within(client.request(Plane::Api, upgrade(&format!("{url}/h2c")), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Protocol, "{e:?}");
    assert_eq!(
        e.describe(),
        "invalid response: 101 Switching Protocols to another protocol than WebSocket"
    );
}

/// An answer other than a 2xx before the upload ended (a 413), or a 2xx complete with
/// its head: the answer is delivered, the upload stops, and the connection is not
/// reused.
#[tokio::test]
async fn an_early_answer_stops_the_upload() {
    const ANSWERS: [&[u8]; 2] = [
        b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
    ];
    for answer in ANSWERS {
        let fake = Fake::start(move |mut s, n| async move {
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                if n == 0 {
                    let _ = s.write_all(answer).await;
                    // Read on so the client's close is a FIN, not a reset.
                    let mut sink = Vec::new();
                    let _ = s.read_to_end(&mut sink).await;
                    return;
                }
                let _ = s.write_all(OK).await;
            }
        })
        .await;
        let client = client();
        let (tx, resp) = put_first(&client, &fake.url("/up"), b"first part").await;
        let status = resp.status();
        let want = if status == 413 { "" } else { "ok" };
        assert_eq!(text(resp).await, want, "{status}");
        within(tx.closed()).await;
        assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
        assert_eq!(fake.accepts(), 2, "{status}");
    }
}

/// A 2xx that starts before the upload ended and goes on as the upload does (an echo, a
/// stream answering as it reads): the rest of the body goes up alongside the answer's,
/// and the connection is then closed (whether the upstream read the rest is not
/// known): the next request gets a new one. The client's body stopped at the answer's
/// head before: the upstream waited for the rest, and the client for the answer's end.
#[tokio::test]
async fn a_2xx_before_the_upload_ended_gets_the_rest_alongside_its_body() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        while let Some(head) = read_head(&mut s, &mut buf).await {
            if !head.starts_with("PUT") {
                let _ = s.write_all(OK).await;
                continue;
            }
            // Answers at once, then relays what the (chunked) body brings, framing and
            // all, as chunks of its own until the body's last chunk.
            let mut echo = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            let mut seen = std::mem::take(&mut buf);
            loop {
                if !seen.is_empty() {
                    echo.extend(format!("{:x}\r\n", seen.len()).as_bytes());
                    echo.extend_from_slice(&seen);
                    echo.extend_from_slice(b"\r\n");
                }
                let end = seen.ends_with(b"0\r\n\r\n");
                if end {
                    echo.extend_from_slice(b"0\r\n\r\n");
                }
                if s.write_all(&std::mem::take(&mut echo)).await.is_err() || end {
                    break;
                }
                let mut tmp = [0u8; 4096];
                match s.read(&mut tmp).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen = tmp[..n].to_vec(),
                }
            }
        }
    })
    .await;
    let client = client();
    let (tx, resp) = put_first(&client, &fake.url("/echo"), b"hello").await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while !got.ends_with(b"hello\r\n") {
        let frame = within(body.frame()).await.expect("more").expect("a frame");
        got.extend_from_slice(&frame.into_data().expect("data"));
    }
    tx.send(Ok(Bytes::from_static(b"world")))
        .await
        .expect("the upload goes on after the answer's head");
    drop(tx);
    let rest = within(body.collect()).await.expect("the rest").to_bytes();
    got.extend_from_slice(&rest);
    assert_eq!(got, b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n");
    assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
    assert_eq!(fake.accepts(), 2);
}

/// A 2xx begun before the upload ended that ends before it does: what is left of the
/// upload is dropped, and the connection with it (the upstream would take the rest for
/// a next request).
#[tokio::test]
async fn a_2xx_that_ends_before_the_upload_ends_the_upload_and_the_connection() {
    let fake = Fake::start(|mut s, n| async move {
        let mut buf = Vec::new();
        while read_head(&mut s, &mut buf).await.is_some() {
            if n > 0 {
                let _ = s.write_all(OK).await;
                continue;
            }
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nhalf")
                .await;
            // The answer's end waits for the upload's second part.
            read_until(&mut s, &mut buf, b"second\r\n").await;
            let _ = s.write_all(b"done").await;
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
            return;
        }
    })
    .await;
    let client = client();
    let (tx, resp) = put_first(&client, &fake.url("/up"), b"first").await;
    tx.send(Ok(Bytes::from_static(b"second"))).await.unwrap();
    assert_eq!(text(resp).await, "halfdone");
    within(tx.closed()).await;
    assert_eq!(get_text(&client, &fake.url("/next")).await, "ok");
    assert_eq!(fake.accepts(), 2);
}

/// The client's body breaking while its upload goes on alongside a 2xx ends that answer
/// with the client's error (the upstream would wait for the rest in vain), not with an
/// upstream failure.
#[tokio::test]
async fn a_client_body_breaking_after_an_early_2xx_ends_the_answer() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        if read_head(&mut s, &mut buf).await.is_some() {
            let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n";
            let _ = s.write_all(head).await;
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        }
    })
    .await;
    let client = client();
    let (tx, resp) = put_first(&client, &fake.url("/echo"), b"hello").await;
    let mut body = resp.into_body();
    let first = within(body.frame()).await.expect("a frame").expect("data");
    assert_eq!(first.into_data().expect("data"), "ok");
    tx.send(Err("the client went away".into())).await.unwrap();
    let e = within(body.frame())
        .await
        .expect("an end")
        .expect_err("the client's error");
    let e = e
        .downcast_ref::<UpstreamError>()
        .expect("the client's error");
    assert!(e.is_client_body(), "{e:?}");
}

/// The head goes up at once, before the body has given anything: the upstream may answer
/// from the head alone (a 401, a 413), and a client streaming its body from a slow
/// source must not hold that answer back.
#[tokio::test]
async fn the_head_goes_up_before_the_body_has_anything() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        if read_head(&mut s, &mut buf).await.is_some() {
            let _ = s
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
                .await;
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        }
    })
    .await;
    let client = client();
    let (_tx, body) = channel();
    let put = with_body("PUT", &fake.url("/up"), body);
    let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
    assert_eq!(resp.status(), 413);
}

/// A head larger than the socket's buffers goes out over several writes, each taking
/// up where the last one stopped, and the body after it. (The client's listener bounds
/// the heads it takes, but a write may stop anywhere in one when the upstream is slow.)
#[tokio::test]
async fn a_head_written_in_pieces_arrives_whole_before_its_body() {
    // Over Linux's default largest send buffer: the first write cannot take all of it
    // while the server, on this thread, reads nothing.
    let big = "b".repeat(6 << 20);
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<(String, Vec<u8>)>();
    let fake = Fake::start(move |mut s, _| {
        let seen_tx = seen_tx.clone();
        async move {
            // Not `read_head`: its search from the start after each read is quadratic.
            let mut buf = Vec::new();
            read_until(&mut s, &mut buf, b"done").await;
            let _ = s.write_all(OK).await;
            let end = buf
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map_or(0, |i| i + 4);
            let body = buf.split_off(end);
            let _ = seen_tx.send((String::from_utf8_lossy(&buf).into_owned(), body));
        }
    })
    .await;
    let client = client();
    let put = Request::put(fake.url("/big"))
        .header("x-big", big.as_str())
        .body(body::full(Bytes::from_static(b"done")))
        .unwrap();
    let resp = within(client.request(Plane::Api, put, LONG)).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, body) = within(seen.recv()).await.unwrap();
    assert!(head.starts_with("PUT /big HTTP/1.1\r\n"));
    assert!(head.contains(&format!("\r\nx-big: {big}\r\n")));
    assert!(head.ends_with("\r\ncontent-length: 4\r\n\r\n"));
    assert_eq!(body, b"done");
}

#[tokio::test]
async fn request_framing_and_host() {
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<(String, Vec<u8>)>();
    let fake = Fake::start(move |mut s, _| {
        let seen_tx = seen_tx.clone();
        async move {
            let mut buf = Vec::new();
            while let Some(head) = read_head(&mut s, &mut buf).await {
                let lower = head.to_ascii_lowercase();
                if lower.contains("transfer-encoding: chunked") {
                    read_until(&mut s, &mut buf, b"0\r\n\r\n").await;
                } else if let Some(n) = lower
                    .split("\r\n")
                    .find_map(|l| l.strip_prefix("content-length: "))
                {
                    let n: usize = n.parse().unwrap();
                    while buf.len() < n {
                        let mut tmp = [0u8; 4096];
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&tmp[..k]),
                        }
                    }
                }
                let _ = seen_tx.send((head, std::mem::take(&mut buf)));
                let _ = s.write_all(OK).await;
            }
        }
    })
    .await;
    let client = client();

    // Unknown size: chunked, each frame a chunk.
    let (tx, body) = channel();
    tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
    tx.send(Ok(Bytes::from_static(b"second!"))).await.unwrap();
    drop(tx);
    let resp = within(client.request(
        Plane::Api,
        with_body("POST", &fake.url("/c?q=1"), body),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, sent) = within(seen.recv()).await.unwrap();
    assert!(head.starts_with("POST /c?q=1 HTTP/1.1\r\n"), "{head}");
    assert!(
        head.contains(&format!("\r\nhost: 127.0.0.1:{}\r\n", fake.addr.port())),
        "{head}"
    );
    assert!(
        head.contains("\r\ntransfer-encoding: chunked\r\n"),
        "{head}"
    );
    assert!(!head.contains("content-length"), "{head}");
    assert_eq!(sent, b"5\r\nfirst\r\n7\r\nsecond!\r\n0\r\n\r\n");

    // Known size: Content-Length, the body right behind the head.
    let resp = within(client.request(
        Plane::Api,
        with_body("PUT", &fake.url("/k"), body::full("hello")),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, sent) = within(seen.recv()).await.unwrap();
    assert!(head.contains("\r\ncontent-length: 5\r\n"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    assert_eq!(sent, b"hello");

    // A size the body cannot tell but the request declares: that Content-Length (a
    // server that takes no chunked upload, an S3-style PUT, still gets it whole).
    let (tx, body) = channel();
    tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
    tx.send(Ok(Bytes::from_static(b"second"))).await.unwrap();
    drop(tx);
    let mut req = with_body("PUT", &fake.url("/d"), body);
    req.headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from_static("11"));
    let resp = within(client.request(Plane::Api, req, LONG)).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, sent) = within(seen.recv()).await.unwrap();
    assert_eq!(head.matches("content-length: 11\r\n").count(), 1, "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    assert_eq!(sent, b"firstsecond");

    // No body: nothing for GET, a zero length for POST; a Host of the caller's own.
    let mut req = get(&fake.url("/"));
    req.headers_mut()
        .insert(HOST, HeaderValue::from_static("example.test"));
    let resp = within(client.request(Plane::Api, req, LONG)).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, _) = within(seen.recv()).await.unwrap();
    assert!(!head.contains("content-length"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    assert_eq!(head.matches("host: ").count(), 1, "{head}");
    assert!(head.contains("\r\nhost: example.test\r\n"), "{head}");
    let resp = within(client.request(
        Plane::Api,
        with_body("POST", &fake.url("/"), body::empty()),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(text(resp).await, "ok");
    let (head, _) = within(seen.recv()).await.unwrap();
    assert!(head.contains("\r\ncontent-length: 0\r\n"), "{head}");
    assert_eq!(fake.accepts(), 1);
}

#[test]
fn host_header_omits_only_the_default_port() {
    let parts = |authority: &str, tls: bool| {
        let parsed: Authority = authority.parse().unwrap();
        let (host, port, header) = authority_parts(authority, tls);
        // The same host and port as the `http` crate reads.
        assert_eq!(host, parsed.host(), "{authority}");
        let default = if tls { 443 } else { 80 };
        assert_eq!(port, parsed.port_u16().unwrap_or(default), "{authority}");
        header.to_string()
    };
    assert_eq!(parts("example.com", false), "example.com");
    assert_eq!(parts("example.com:80", false), "example.com");
    assert_eq!(parts("example.com:443", true), "example.com");
    assert_eq!(parts("example.com:443", false), "example.com:443");
    assert_eq!(parts("example.com:80", true), "example.com:80");
    assert_eq!(parts("user:pw@example.com:8080", false), "example.com:8080");
    assert_eq!(parts("[::1]", true), "[::1]");
    assert_eq!(parts("[::1]:443", true), "[::1]");
    assert_eq!(parts("[::1]:8080", false), "[::1]:8080");
    assert_eq!(parts("example.com:", false), "example.com");
    assert_eq!(parts("example.com:99999", false), "example.com");
    assert_eq!(parts("10.0.0.1:0080", false), "10.0.0.1");
    // All digits and no colon: a name (a decimal IPv4 address), not a port.
    assert_eq!(parts("2130706433", false), "2130706433");
    assert_eq!(
        parts("49983-isb-1.localhost:9443", true),
        "49983-isb-1.localhost:9443"
    );
}

#[tokio::test]
async fn a_broken_request_body_is_the_clients_fault() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        let _ = read_head(&mut s, &mut buf).await;
        let _ = s.read_to_end(&mut buf).await;
    })
    .await;
    let (tx, body) = channel();
    tx.send(Ok(Bytes::from_static(b"some"))).await.unwrap();
    tx.send(Err("the client went away".into())).await.unwrap();
    let e = within(client().request(Plane::Api, with_body("POST", &fake.url("/"), body), LONG))
        .await
        .unwrap_err();
    assert!(e.is_client_body(), "{e:?}");
}

/// hyper's client (an upgrade goes through it) fails as the pool does, and its failures
/// are described and counted the same way: refused, reset, closed before the answer,
/// and an answer that is not HTTP.
#[tokio::test]
async fn hypers_client_failures_are_described_and_counted_like_the_pools_own() {
    let fake = Fake::start(|mut s, _| async move {
        let mut buf = Vec::new();
        let Some(head) = read_head(&mut s, &mut buf).await else {
            return;
        };
        if head.starts_with("GET /reset ") {
            let _ = s.set_zero_linger();
        } else if head.starts_with("GET /garbage ") {
            let _ = s.write_all(b"SMTP ready\r\n\r\n").await;
            let _ = s.shutdown().await;
        }
        // `/close`: closed with no answer.
    })
    .await;
    let cases = [
        (
            "http://127.0.0.1:9/".to_string(),
            FailKind::Connect,
            "connect refused",
        ),
        (fake.url("/reset"), FailKind::Reset, "connection reset"),
        (
            fake.url("/close"),
            FailKind::Reset,
            "connection closed early",
        ),
        (
            fake.url("/garbage"),
            FailKind::Protocol,
            "upstream connection failed: ",
        ),
    ];
    let client = client();
    for (url, kind, reason) in cases {
        let e = within(client.request(Plane::Api, upgrade(&url), LONG))
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Legacy(_)), "{url}: {e:?}");
        assert_eq!(e.kind(), kind, "{url}: {e:?}");
        assert!(e.describe().starts_with(reason), "{url}: {}", e.describe());
    }
    // A connection that was set up and then timed out (keep-alive probes unanswered).
    assert_eq!(failure::io_kind(io::ErrorKind::TimedOut), FailKind::Timeout);
}

/// An upstream that resets the connection, at the TLS handshake or after the request,
/// is a `reset` with the same words on the pool's connections as on hyper's: not a TLS
/// failure, as no certificate or protocol was refused.
#[tokio::test]
async fn a_reset_is_a_reset_on_the_pools_connections_too() {
    let fake = Fake::start(|mut s, _| async move {
        // A ClientHello or a request head: either way, something was sent.
        let mut first = [0u8; 1];
        let _ = s.read(&mut first).await;
        let _ = s.set_zero_linger();
    })
    .await;
    let tls = tls_pair();
    let clients = [
        (client(), "http"),
        (client(), "https"),
        (negotiating(&tls), "https"),
    ];
    for (client, scheme) in clients {
        let url = format!("{scheme}://{}/reset", fake.addr);
        let e = within(client.request(Plane::Api, get(&url), LONG))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FailKind::Reset, "{url}: {e:?}");
        assert_eq!(e.describe(), "connection reset", "{url}: {e:?}");
    }
}

/// A connect that runs out of time waiting for its name says so, not "connect timed
/// out": the DNS server stopped answering, not the upstream.
#[tokio::test]
async fn a_connect_waiting_for_its_name_says_the_look_up_timed_out() {
    let client = |resolver| {
        Upstream::new(
            config(rustls::RootCertStore::empty()),
            Versions::Http1,
            Duration::from_millis(300),
            LONG,
            None,
            Slots::unlimited(),
            resolver,
        )
    };
    let stalled = client(crate::resolve::stalled());
    let e = within(stalled.request(Plane::Api, get("http://stalled-p.test/"), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Timeout, "{e:?}");
    assert_eq!(e.describe(), "name look-up timed out");
    // Looked up, then a TLS handshake that never answers: its name was no part of it.
    let silent = Fake::start(|s, _| async move {
        let _held = s;
        std::future::pending::<()>().await
    })
    .await;
    let url = format!("https://answered-p.test:{}/", silent.addr.port());
    let answered = client(crate::resolve::answering());
    let e = within(answered.request(Plane::Api, get(&url), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.describe(), "connect timed out");
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    // The discard port, which nothing serves, as the integration tests'
    // `support::refused_addr`: a port bound and released here could be taken by a
    // concurrent test's listener before the connect.
    let addr = "127.0.0.1:9";
    let e = within(client().request(Plane::Api, get(&format!("http://{addr}/")), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Connect, "{e:?}");
    assert_eq!(e.describe(), "connect refused");
    assert!(!e.is_client_body());
}

struct Tls {
    ca: rustls_pki_types::CertificateDer<'static>,
    server: Arc<rustls::ServerConfig>,
}

fn tls_pair() -> Tls {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let key = rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![leaf.der().clone()], key)
    .unwrap();
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Tls {
        ca: ca.der().clone(),
        server: Arc::new(server),
    }
}

async fn tls_fake(tls: &Tls) -> Fake {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
    Fake::start(move |s, _| {
        let acceptor = acceptor.clone();
        async move {
            let Ok(mut s) = acceptor.accept(s).await else {
                return;
            };
            let (_, session) = s.get_ref();
            let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
            let sni = session.server_name().map(str::to_string);
            let mut buf = Vec::new();
            while read_head(&mut s, &mut buf).await.is_some() {
                let body = format!(
                    "{:?} {:?}",
                    sni,
                    alpn.as_deref().map(String::from_utf8_lossy)
                );
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                if s.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// An HTTP/1.1-only TLS server answering each request head with `answer(head)`.
async fn tls_answering(tls: &Tls, answer: fn(&str) -> Vec<u8>) -> Fake {
    let mut server = (*tls.server).clone();
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    Fake::start(move |s, _| {
        let acceptor = acceptor.clone();
        async move {
            if let Ok(s) = acceptor.accept(s).await {
                answer_each(s, answer).await;
            }
        }
    })
    .await
}

/// A client trusting `tls`'s CA whose `https` requests go to hyper's client.
fn negotiating(tls: &Tls) -> Upstream {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(tls.ca.clone()).unwrap();
    Upstream::new(
        config(roots),
        Versions::Negotiate,
        Duration::from_secs(5),
        LONG,
        None,
        Slots::unlimited(),
        upstream::LocalResolver::new(upstream::Names::Own),
    )
}

/// An `https` origin that answers hyper's client in HTTP/1.1 is the pool's from then
/// on (for `Http1Origins::FOR` at a time): hyper-util's HTTP/1 pool finishes connects
/// nobody waits for any more, each holding a slot. Its first connection stays with
/// hyper-util.
#[tokio::test]
async fn an_origin_that_negotiated_http1_goes_to_the_pool() {
    let tls = tls_pair();
    let mut h1_only = (*tls.server).clone();
    h1_only.alpn_protocols = vec![b"http/1.1".to_vec()];
    let fake = tls_fake(&Tls {
        ca: tls.ca.clone(),
        server: Arc::new(h1_only),
    })
    .await;
    let url = format!("https://localhost:{}/", fake.addr.port());
    let client = negotiating(&tls);
    for _ in 0..3 {
        let resp = within(client.request(Plane::Api, get(&url), LONG)).await;
        assert_eq!(
            text(resp.unwrap()).await,
            r#"Some("localhost") Some("http/1.1")"#
        );
    }
    assert_eq!(
        fake.accepts(),
        2,
        "hyper-util's connection, then the pool's, kept"
    );
    let other = format!("https://127.0.0.1:{}/", fake.addr.port());
    let now = Instant::now();
    assert!(client.http1.has(&url.parse().unwrap(), now));
    assert!(!client.http1.has(&other.parse().unwrap(), now), "by origin");
}

/// A remembered origin whose time is up and that answers the request asking again in
/// HTTP/2 is hyper-util's again.
#[tokio::test]
async fn an_origin_that_answers_in_http2_again_is_forgotten() {
    let tls = tls_pair();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
    let fake = Fake::start(move |s, _| {
        let acceptor = acceptor.clone();
        async move {
            let Ok(s) = acceptor.accept(s).await else {
                return;
            };
            let answer = hyper::service::service_fn(|_req| async {
                Ok::<_, std::convert::Infallible>(Response::new(body::full("h2")))
            });
            let h2 = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
            let _ = h2
                .serve_connection(hyper_util::rt::TokioIo::new(s), answer)
                .await;
        }
    })
    .await;
    let url = format!("https://localhost:{}/", fake.addr.port());
    let client = negotiating(&tls);
    client.http1.add(&url.parse().unwrap(), Instant::now());
    // Its time is up.
    client.http1.list.write().unwrap()[0].1 = Instant::now();
    let resp = within(client.request(Plane::Api, get(&url), LONG))
        .await
        .unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(text(resp).await, "h2");
    assert!(client.http1.list.read().unwrap().is_empty());
}

#[tokio::test]
async fn tls_with_a_trusted_ca_works_and_an_untrusted_one_is_a_tls_error() {
    let tls = tls_pair();
    let fake = tls_fake(&tls).await;
    let url = format!("https://localhost:{}/", fake.addr.port());

    let mut roots = rustls::RootCertStore::empty();
    roots.add(tls.ca.clone()).unwrap();
    let trusting = Upstream::new(
        config(roots),
        Versions::Http1,
        Duration::from_secs(5),
        LONG,
        None,
        Slots::unlimited(),
        upstream::LocalResolver::new(upstream::Names::Own),
    );
    for _ in 0..2 {
        let resp = within(trusting.request(Plane::Api, get(&url), LONG))
            .await
            .unwrap();
        assert_eq!(text(resp).await, r#"Some("localhost") Some("http/1.1")"#);
    }
    assert_eq!(fake.accepts(), 1, "kept alive over TLS");

    let e = within(client().request(Plane::Api, get(&url), LONG))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailKind::Tls, "{e:?}");
    assert!(
        (e.describe()).starts_with("tls: invalid peer certificate: signed by an unknown"),
        "{}",
        e.describe()
    );
}
