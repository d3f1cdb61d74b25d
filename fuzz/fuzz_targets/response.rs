//! The pool's reading of an upstream response (`proxy::pool::replay`: its head parser and
//! body decoder, driven as the pool drives them), held to hyper's HTTP/1.1 client.
//!
//! The pool keeps upstream connections and gives them to the next client's request: if it
//! ended a response at another byte than the upstream did, that client would get the rest
//! of someone else's answer (a response desync). hyper is the reference.
//!
//! Input: one byte (bit 0: the request was HEAD; bits 1-6: a segment size, 1..=64), then
//! the bytes the upstream sends before closing. Invariants: no panic; the reading does not
//! depend on how the bytes were segmented; and a response the pool reads to its end at byte
//! `p`, hyper reads too from the first `p` bytes, with the same status, body and trailers,
//! and cannot from `p - 1` bytes (so both end it at the same byte), except where the pool
//! knowingly reads what hyper refuses (listed in `tolerated`).
#![no_main]

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use abx_proxy::proxy::pool::replay::{read, Read};
use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, wire)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    let seg = usize::from((flags >> 1) % 64) + 1;

    let whole = read(&[wire], head_request);
    let pieces: Vec<&[u8]> = wire.chunks(seg).collect();
    assert_eq!(
        whole,
        read(&pieces, head_request),
        "the reading depends on segmentation ({seg}-byte segments)"
    );
    let Ok(pool) = whole else {
        return;
    };

    let end = wire.len() - pool.rest.len();
    let prefix = &wire[..end];
    match hyper_read(prefix, seg, head_request) {
        Ok(h) => {
            assert_eq!(pool.status, h.status, "status");
            assert_eq!(pool.body, h.body, "body");
            assert_eq!(pool.trailers, h.trailers, "trailers");
        }
        Err(e) => assert!(
            tolerated(prefix, &pool),
            "the pool read a response hyper refuses ({e}): {pool:?}"
        ),
    }
    // A response that ends only with the connection ends at the same byte for both.
    if end > 0 && !close_delimited(&pool, head_request) {
        if let Ok(h) = hyper_read(&wire[..end - 1], seg, head_request) {
            panic!("hyper read the response one byte before the pool's end: {h:?} / {pool:?}");
        }
    }
});

/// What the pool reads where hyper refuses, on purpose:
/// - RFC 9112 §6.1: `Transfer-Encoding` from an HTTP/1.0 server is faulty framing; the
///   message is read and the connection closed (hyper refuses the message);
/// - 101 to 128 header fields in a head, interim ones included (hyper's limit is 100):
///   nothing to do with the framing.
fn tolerated(prefix: &[u8], pool: &Read) -> bool {
    let Some((version, fields)) = final_head(prefix) else {
        return false;
    };
    let te = pool
        .headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("transfer-encoding"));
    (version == 0 && te && !pool.keep_alive) || fields > 100
}

/// The final (non-1xx) head's minor version and the most fields in a head up to it, as
/// httparse (both readers' head parser) reads them.
fn final_head(wire: &[u8]) -> Option<(u8, usize)> {
    let mut at = wire;
    let mut most = 0;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 128];
        let mut resp = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(end) = resp.parse(at).ok()? else {
            return None;
        };
        most = most.max(resp.headers.len());
        if !(100..200).contains(&resp.code?) {
            return Some((resp.version?, most));
        }
        at = &at[end..];
    }
}

fn close_delimited(pool: &Read, head_request: bool) -> bool {
    let status = pool.status;
    let bodiless = head_request || status == 204 || status == 304;
    let framed = pool.headers.iter().any(|(n, _)| {
        n.eq_ignore_ascii_case("content-length") || n.eq_ignore_ascii_case("transfer-encoding")
    });
    !bodiless && !framed
}

#[derive(Debug)]
struct Hyper {
    status: u16,
    body: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
}

/// hyper's client reading one response from `wire` (in `seg`-byte reads, then the end).
fn hyper_read(wire: &[u8], seg: usize, head_request: bool) -> Result<Hyper, hyper::Error> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime")
    });
    let io = Wire {
        bytes: Bytes::copy_from_slice(wire),
        seg,
        asked: false,
        reader: None,
    };
    rt.block_on(async move {
        let (mut send, conn) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io)).await?;
        let conn = tokio::spawn(conn);
        let method = if head_request {
            Method::HEAD
        } else {
            Method::GET
        };
        let req = Request::builder()
            .method(method)
            .uri("/")
            .header("host", "upstream")
            .body(Empty::new())
            .expect("a valid request");
        let result = async {
            let resp = send.send_request(req).await?;
            let status = resp.status().as_u16();
            let collected = resp.into_body().collect().await?;
            let trailers = collected.trailers().map(pairs).unwrap_or_default();
            Ok(Hyper {
                status,
                body: collected.to_bytes().to_vec(),
                trailers,
            })
        }
        .await;
        drop(send);
        let _ = conn.await;
        result
    })
}

fn pairs(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// The upstream's side of the connection: once the request is written, `bytes` in reads of
/// at most `seg`, then the end; what the client writes is taken and dropped. (Bytes there
/// before the request would be an unsolicited answer, which hyper refuses.)
struct Wire {
    bytes: Bytes,
    seg: usize,
    asked: bool,
    reader: Option<Waker>,
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.asked {
            self.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = self.seg.min(self.bytes.len()).min(buf.remaining());
        let chunk = self.bytes.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.asked = true;
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
