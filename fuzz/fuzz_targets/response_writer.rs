//! The fast path's response writer (`proxy::write_one`, as a client connection drives it),
//! held to hyper's HTTP/1.1 client.
//!
//! The writer frames every answer a plain HTTP/1.1 client gets: the upstream's length, or
//! chunks, or the close. If it framed one wrongly, the client would wait for bytes that
//! never come, or read the start of the next answer as the end of this one.
//!
//! Input: a flag byte (bit 0: the request was HEAD; bit 1: the connection closes after this
//! answer; bit 2: the body states its exact length; bit 3: it ends with trailers; bit 4: it
//! breaks; bits 5-7: its `Content-Length`, see [`length`]), two bytes for the status
//! (200-999), one whose bits make the body wait before its first 8 frames, one for the size
//! of hyper's reads (1-64); then, split at NUL bytes, the header lines (`name:value`, one
//! per line), the body's data frames and, with bit 3, the trailer lines.
//!
//! Invariants, on what the writer puts on the socket:
//! - hyper reads its head: the same status and the same fields (less the framing ones),
//!   and a `Date`;
//! - an answer the writer calls complete, hyper reads whole from these bytes, with the
//!   same body and (when chunked) no trailers (the fast path serves no request that said
//!   `TE: trailers`, and sends none), and not from one byte less (the next
//!   answer on the connection starts where both think it does);
//! - an answer cut short is never read by hyper as anything but a prefix of the body;
//! - an answer the body gave cleanly, with a length that holds or none, is complete.
#![no_main]

#[path = "hyper_client.rs"]
mod hyper_client;

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use abx_proxy::proxy::{body, headers, write_one};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper_client::{hyper_read, pairs, runtime};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

fuzz_target!(|data: &[u8]| {
    let Some((&[flags, s0, s1, waits, seg], rest)) = data.split_first_chunk::<5>() else {
        return;
    };
    let head_request = flags & 1 != 0;
    let close = flags & 2 != 0;
    let exact = flags & 4 != 0;
    let with_trailers = flags & 8 != 0;
    let breaks = flags & 16 != 0;
    let seg = usize::from(seg % 64) + 1;
    let status = 200 + u16::from_le_bytes([s0, s1]) % 800;
    let Ok(status) = StatusCode::from_u16(status) else {
        return;
    };

    let mut sections = rest.split(|&b| b == 0);
    let mut fields = lines(sections.next().unwrap_or_default());
    // What reaches the writer has been through the response filter (and no upstream reader
    // passes on conflicting lengths): the length comes from `length` alone.
    headers::strip_response_hop_by_hop(&mut fields, false);
    let first_value = fields.values().next().cloned();
    fields.remove(http::header::CONTENT_LENGTH);
    let mut frames: Vec<&[u8]> = sections.collect();
    let trailers = match with_trailers {
        true => frames.pop().map(lines),
        false => None,
    };
    let sent: Vec<u8> = frames.concat();
    let total = sent.len() as u64;
    let length = length(flags >> 5, total, first_value);
    let mut stated = fields.clone();
    if let Some(values) = &length {
        for v in values {
            stated.append(http::header::CONTENT_LENGTH, v.clone());
        }
    }

    let source = Source {
        frames: frames
            .iter()
            .map(|f| Frame::data(Bytes::copy_from_slice(f)))
            .chain(trailers.clone().map(Frame::trailers))
            .collect(),
        breaks,
        waits,
        polled: 0,
        waited: false,
        exact: exact.then_some(total),
    };
    let mut resp = Response::new(body::boxed(source));
    *resp.status_mut() = status;
    *resp.headers_mut() = stated;

    let (written, wire) = runtime().block_on(async move {
        let (ours, mut theirs) = UnixStream::pair().expect("a socket pair");
        let mut wire = Vec::new();
        let (written, read) = tokio::join!(
            write_one(ours, resp, head_request, close),
            theirs.read_to_end(&mut wire)
        );
        read.expect("reading the writer's side");
        (written, Bytes::from(wire))
    });

    // An answer the body gave whole, with a length that holds or none, is not cut.
    let holds = match &length {
        None => true,
        Some(values) => values
            .iter()
            .all(|v| v.as_bytes() == total.to_string().as_bytes()),
    };
    if !breaks && holds {
        assert!(
            written,
            "a whole answer with a true length was cut: {wire:?}"
        );
    }
    let bodiless =
        head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let hyper = hyper_read(&wire, seg, head_request);
    let h = match (&hyper, written) {
        (Ok(h), _) => h,
        // Cut short: hyper may refuse the whole answer (the body is read with the head).
        (Err(_), false) => return,
        (Err(e), true) => panic!("hyper refused an answer written whole ({e}): {wire:?}"),
    };
    assert_eq!(h.status, status.as_u16(), "status");
    // RFC 9110 §6.6.1: a proxy dates an answer that came without a date.
    let dates = h.headers.iter().filter(|(n, _)| n == "date").count();
    assert!(dates >= 1, "an answer without a Date: {wire:?}");
    assert_eq!(
        without_framing(&h.headers, &fields),
        pairs(&fields),
        "fields"
    );
    assert!(
        sent.starts_with(&h.body),
        "hyper read what the body did not give: {h:?} / {wire:?}"
    );
    if !written {
        return;
    }

    let body = if bodiless { &[][..] } else { &sent[..] };
    assert_eq!(h.body, body, "body");
    let chunked = length.is_none() && !exact;
    if chunked && !bodiless {
        assert!(h.trailers.is_empty(), "trailers sent: {wire:?}");
    }
    // The next answer on the connection starts right after this one.
    if let Ok(h) = hyper_read(&wire[..wire.len() - 1], seg, head_request) {
        panic!("hyper read the answer one byte before its end: {h:?} / {wire:?}");
    }
});

/// The `Content-Length` the answer states: none, the body's length, one more or one less,
/// the same line twice, the list `n, n`, zero, or the first header value of the input.
fn length(mode: u8, total: u64, first: Option<HeaderValue>) -> Option<Vec<HeaderValue>> {
    let n = |v: u64| HeaderValue::from(v);
    Some(match mode {
        0 => return None,
        1 => vec![n(total)],
        2 => vec![n(total + 1)],
        3 => vec![n(total.saturating_sub(1))],
        4 => vec![n(total), n(total)],
        5 => vec![HeaderValue::from_str(&format!("{total}, {total}")).ok()?],
        6 => vec![n(0)],
        _ => vec![first?],
    })
}

/// Header lines as a reader hands them on: valid names and values, without the blanks
/// around a value (httparse and hyper drop them), at most 90 (hyper's limit is 100).
fn lines(text: &[u8]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for line in text.split(|&b| b == b'\n').take(90) {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let value = line[colon + 1..].trim_ascii();
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(value),
        ) {
            map.append(name, value);
        }
    }
    map
}

/// hyper's fields less those the writer frames the answer with, and its `Date` unless the
/// answer had one.
fn without_framing(read: &[(String, Vec<u8>)], given: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    read.iter()
        .filter(|(n, _)| {
            !matches!(
                n.as_str(),
                "content-length" | "transfer-encoding" | "connection"
            ) && (n != "date" || given.contains_key(http::header::DATE))
        })
        .cloned()
        .collect()
}

/// The answer's body: its frames, each after a wait when `waits` says so, then the end,
/// or an error.
struct Source {
    frames: VecDeque<Frame<Bytes>>,
    breaks: bool,
    waits: u8,
    polled: u32,
    waited: bool,
    exact: Option<u64>,
}

impl Body for Source {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let wait = self.polled < 8 && self.waits & (1 << self.polled) != 0;
        if wait && !self.waited {
            self.waited = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.waited = false;
        self.polled += 1;
        match self.frames.pop_front() {
            Some(frame) => Poll::Ready(Some(Ok(frame))),
            None if self.breaks => Poll::Ready(Some(Err(io::Error::other("upstream broke")))),
            None => Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}
