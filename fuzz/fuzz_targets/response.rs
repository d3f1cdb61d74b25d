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

#[path = "hyper_client.rs"]
mod hyper_client;

use abx_proxy::proxy::pool::replay::{read, Read};
use hyper_client::hyper_read;
use libfuzzer_sys::fuzz_target;

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
