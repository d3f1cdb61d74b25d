//! The HTTP/1.1 fast path's head reader (`proxy::read_one_head`), held to hyper's server
//! and the framing watch.
//!
//! The fast path reads nearly every request the SDKs send, without hyper: if it read a
//! head another way than hyper would (another target, a field more or less, another
//! body length), the request upstream would not be the client's, or the next one on the
//! connection would start inside this one's body.
//!
//! Input: the bytes a client sends, all at once. Invariants, when the fast path serves
//! the first request itself:
//! - hyper's server, with the listener's limits, serves a first request with the same
//!   method, target and fields;
//! - its body is the `Content-Length` bytes right after the fast path's head end, when
//!   they are all there (both frame it alike);
//! - the framing watch, which guards hyper's path, does not refuse that request.
#![no_main]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use abx_proxy::proxy::framing::watch;
use abx_proxy::proxy::listener::{MAX_HEAD, MAX_HEADERS};
use abx_proxy::proxy::read_one_head;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use libfuzzer_sys::fuzz_target;

#[path = "hyper_client.rs"]
mod hyper_client;

use hyper_client::{pairs, runtime};

/// The first request hyper served, as the fuzz target compares it.
#[derive(Debug, Clone)]
struct Served {
    method: String,
    target: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Result<Vec<u8>, String>,
}

fuzz_target!(|data: &[u8]| {
    let Some((fast, length, _close, taken)) = read_one_head(data) else {
        return;
    };
    let head = String::from_utf8_lossy(&data[..taken]);
    let (mut w, verdicts) = watch();
    w.scan(data);
    let refusal = verdicts.next_refusal();
    assert!(
        refusal.is_none(),
        "the fast path serves a head the framing watch refuses ({refusal:?}): {head:?}"
    );
    let Some(h) = serve(data) else {
        panic!("hyper serves no request where the fast path serves one: {head:?}");
    };
    assert_eq!(h.method, fast.method().as_str(), "method: {head:?}");
    assert_eq!(h.target, fast.uri().to_string(), "target: {head:?}");
    let fields = pairs(fast.headers());
    assert_eq!(h.headers, fields, "fields: {head:?}");
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    if data.len() - taken >= length {
        let want = &data[taken..taken + length];
        match &h.body {
            Ok(b) => assert_eq!(&b[..], want, "body after a head of {taken} bytes"),
            Err(e) => panic!("hyper failed a body the fast path frames whole: {e}"),
        }
    }
});

/// What hyper's HTTP/1 server, configured as the listener's, serves first from `data`.
fn serve(data: &[u8]) -> Option<Served> {
    let first: Arc<Mutex<Option<Served>>> = Arc::new(Mutex::new(None));
    let log = first.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let log = log.clone();
        async move {
            let method = req.method().to_string();
            let target = req.uri().to_string();
            let headers = pairs(req.headers());
            let body = match req.into_body().collect().await {
                Ok(c) => Ok(c.to_bytes().to_vec()),
                Err(e) => Err(e.to_string()),
            };
            let mut l = log.lock().expect("the log");
            if l.is_none() {
                *l = Some(Served {
                    method,
                    target,
                    headers,
                    body,
                });
            }
            let mut resp = Response::new(Empty::<Bytes>::new());
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            Ok::<_, Infallible>(resp)
        }
    });
    // The client's bytes, read in one go; what hyper writes back is dropped.
    let io = tokio::io::join(data, tokio::io::sink());
    runtime().block_on(async move {
        // `half_close`: the input's end is the client's FIN after its request, which
        // hyper would otherwise take for the client gone and drop the request unserved.
        let _ = hyper::server::conn::http1::Builder::new()
            .max_headers(MAX_HEADERS)
            .max_buf_size(MAX_HEAD)
            .keep_alive(true)
            .half_close(true)
            .serve_connection(TokioIo::new(io), service)
            .await;
    });
    let served = first.lock().expect("the log").clone();
    served
}
