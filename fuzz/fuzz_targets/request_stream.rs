//! The framing watch (`proxy::framing`) against hyper's HTTP/1.1 server, on a whole
//! connection's bytes.
//!
//! The watch's verdict for a request is only worth something if the head it judged is the
//! head hyper serves: were it to skip a body differently (a chunk-size line, trailers, a
//! length), it would look for the next head in the wrong place, and a request carrying both
//! `Content-Length` and `Transfer-Encoding` would pass unrefused. Here hyper reads the bytes
//! one at a time, as the listener's watch sees them, and the service notes how many it had
//! read when each request reached it: exactly its head's end.
//!
//! Input: the bytes a client sends. Invariants: no panic; every request hyper serves that
//! the watch does not refuse, nor lose track at, ended (by the watch's `in_head`) at the
//! byte where hyper ended it, the bytes the watch took for its head are that request
//! (httparse reads hyper's method and target from them, and nothing after), and that head
//! has one `Content-Length`, or one `Transfer-Encoding: chunked`, or neither (every head,
//! not only the first as in `framing`). (After a refused request, or the one where the watch lost
//! track, the listener closes the connection; so does the service here.)
#![no_main]

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use abx_proxy::proxy::framing::{watch, HeadWatch, Verdict, Verdicts};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};

/// Requests looked at per input.
const REQUESTS: usize = 16;

fuzz_target!(|data: &[u8]| {
    let (watch, verdicts) = watch();
    let shared = Arc::new(Mutex::new(Shared {
        watch,
        read: 0,
        head_starts: Vec::new(),
        head_ends: Vec::new(),
        was_in_head: false,
    }));
    let served = serve(data, shared.clone(), verdicts);
    let shared = shared.lock().expect("not poisoned");
    for (n, seen) in served.iter().enumerate() {
        // The listener closes the connection after a refusal, and after the request where
        // the watch lost track: no later head is served unjudged.
        if seen.verdict.refusal.is_some() || seen.verdict.last {
            break;
        }
        let at = seen.head_end;
        assert_eq!(
            shared.head_ends.get(n),
            Some(&at),
            "request {}: hyper ended its head at byte {at}, the watch at {:?} (all: {:?})",
            n + 1,
            shared.head_ends.get(n),
            shared.head_ends
        );
        // And it began where hyper's began: the watch's head, read alone, is this request.
        // The first head begins with the connection (the watch's `in_head` is false
        // while the bytes could still be HTTP/2's preface).
        let start = if n == 0 { 0 } else { shared.head_starts[n] };
        let mut fields = [httparse::EMPTY_HEADER; 100];
        let mut head = httparse::Request::new(&mut fields);
        let parsed = head.parse(&data[start..at]);
        assert!(
            matches!(parsed, Ok(httparse::Status::Complete(len)) if len == at - start)
                && head.method == Some(seen.method.as_str())
                // As hyper reads a target (without its fragment, for one).
                && head.path.and_then(|p| p.parse::<http::Uri>().ok()).map(|u| u.to_string())
                    == Some(seen.target.clone()),
            "request {}: the watch's head {:?} is not hyper's {} {}",
            n + 1,
            String::from_utf8_lossy(&data[start..at]),
            seen.method,
            seen.target
        );
        // A head the watch let through frames its body one way only.
        let field = |name: &str| {
            head.headers
                .iter()
                .filter(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| h.value.trim_ascii())
                .collect::<Vec<_>>()
        };
        let (lengths, codings) = (field("content-length"), field("transfer-encoding"));
        assert!(
            lengths.len() + codings.len() <= 1
                && codings.iter().all(|c| c.eq_ignore_ascii_case(b"chunked")),
            "request {}: not refused: Content-Length {lengths:?}, Transfer-Encoding {codings:?}",
            n + 1
        );
    }
});

struct Shared {
    watch: HeadWatch,
    /// Bytes hyper has read.
    read: usize,
    /// Where the watch saw heads begin (`in_head` false before a byte, true after it) and
    /// end (the other way round).
    head_starts: Vec<usize>,
    head_ends: Vec<usize>,
    was_in_head: bool,
}

/// A request as hyper served it.
#[derive(Clone)]
struct Served {
    /// The bytes hyper had read when the request reached the service.
    head_end: usize,
    method: String,
    target: String,
    verdict: Verdict,
}

/// hyper's server over `data`: the requests it served.
fn serve(data: &[u8], shared: Arc<Mutex<Shared>>, verdicts: Verdicts) -> Vec<Served> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime")
    });
    let served = Arc::new(Mutex::new(Vec::new()));
    let io = Wire {
        bytes: Bytes::copy_from_slice(data),
        shared: shared.clone(),
    };
    let verdicts = Arc::new(verdicts);
    let log = served.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let seen = Served {
            head_end: shared.lock().expect("not poisoned").read,
            method: req.method().to_string(),
            target: req.uri().to_string(),
            verdict: verdicts.next_verdict(),
        };
        let verdict = seen.verdict;
        let log = log.clone();
        async move {
            if let Ok(mut log) = log.lock() {
                if log.len() < REQUESTS {
                    log.push(seen);
                }
            }
            // Read the body whole, as the proxy streams it on: hyper then goes on to the
            // next head.
            let _ = req.into_body().collect().await;
            let mut resp = Response::new(Empty::<Bytes>::new());
            if verdict.refusal.is_some() || verdict.last {
                resp.headers_mut()
                    .insert(http::header::CONNECTION, "close".parse().expect("a value"));
            }
            Ok::<_, Infallible>(resp)
        }
    });
    rt.block_on(async move {
        let _ = hyper::server::conn::http1::Builder::new()
            .max_headers(100)
            .max_buf_size(64 * 1024)
            .keep_alive(true)
            .serve_connection(
                TokioIo::new(tokio::io::join(io, tokio::io::sink())),
                service,
            )
            .await;
    });
    let served = served.lock().expect("not poisoned");
    served.clone()
}

/// The client's side: `bytes` one at a time, each through the watch first (as the
/// listener's reader does), then the end; answers are taken and dropped.
struct Wire {
    bytes: Bytes,
    shared: Arc<Mutex<Shared>>,
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.bytes.is_empty() || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let byte = self.bytes.split_to(1);
        let mut s = self.shared.lock().expect("not poisoned");
        s.watch.scan(&byte);
        s.read += 1;
        let in_head = s.watch.in_head();
        if s.was_in_head != in_head {
            let at = s.read;
            if in_head {
                s.head_starts.push(at - 1);
            } else {
                s.head_ends.push(at);
            }
        }
        s.was_in_head = in_head;
        buf.put_slice(&byte);
        Poll::Ready(Ok(()))
    }
}
