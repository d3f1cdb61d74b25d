//! The HTTP/1.1 wire format of the pool's exchanges: the request head it writes, the
//! response head it reads (and the framing rules every upstream answer is held to, hyper's
//! client's included), and the response body's decoder, length, chunked or to the end of
//! the connection.
//!
//! Everything here works on buffers the pool owns and never does I/O, so each piece can be
//! fed a byte at a time.

use std::io::Write as _;
use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, Version};

use super::UpstreamError;
use crate::proxy::headers::has_token;

/// The largest response head (and trailer section) accepted; HTTP/2 answers get the same
/// (`crate::upstream`).
pub(crate) const MAX_HEAD: usize = 64 * 1024;
const _: () = assert!(
    MAX_HEAD == 64 << 10,
    "`failure`'s HTTP/2 answers say 64 KiB"
);

/// `HTTP/1.1 200 \r\n` and the head's closing CRLF, as [`admit`] counts a head hyper read.
const STATUS_LINE: usize = 17;
/// Header lines in a response head; more is a protocol error (hyper's client is given the
/// same: `crate::upstream`).
pub(crate) const MAX_HEADERS: usize = 128;
/// Trailer lines after a chunked body.
const MAX_TRAILERS: usize = 64;
/// A chunk-size line, extensions included.
const MAX_CHUNK_LINE: usize = 4 * 1024;

/// Where a response header's name and value lie in the read buffer.
#[derive(Clone, Copy)]
pub(super) struct Span {
    name: (u32, u32),
    value: (u32, u32),
}

/// How the request body is framed.
#[derive(Clone, Copy)]
pub(super) enum Out {
    Length(u64),
    Chunked,
}

/// A `Content-Length` the request declares itself, when it is one valid number.
pub(super) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    let mut values = headers.get_all(CONTENT_LENGTH).iter();
    let n = parse_length(values.next()?.as_bytes())?;
    values.next().is_none().then_some(n)
}

/// Writes the request head; returns whether the request itself asks to close.
pub(super) fn encode_head(
    buf: &mut Vec<u8>,
    parts: &Parts,
    host_header: &str,
    out: Option<Out>,
    length: Option<u64>,
) -> bool {
    buf.clear();
    let target = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str())
        .filter(|pq| !pq.is_empty())
        .unwrap_or("/");
    buf.extend_from_slice(parts.method.as_str().as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(target.as_bytes());
    buf.extend_from_slice(b" HTTP/1.1\r\n");
    let mut close = false;
    let mut has_host = false;
    for (name, value) in &parts.headers {
        // The framing is this client's to state.
        if name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
            continue;
        }
        has_host |= name == HOST;
        if name == CONNECTION && has_token(value.as_bytes(), b"close") {
            close = true;
        }
        buf.extend_from_slice(name.as_str().as_bytes());
        buf.extend_from_slice(b": ");
        buf.extend_from_slice(value.as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    if !has_host {
        buf.extend_from_slice(b"host: ");
        buf.extend_from_slice(host_header.as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    if let Some(n) = length {
        // Writing into a Vec cannot fail.
        let _ = write!(buf, "content-length: {n}\r\n");
    } else if let Some(Out::Chunked) = out {
        buf.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    buf.extend_from_slice(b"\r\n");
    close
}

/// `Content-Length` digits (a comma list of equal values is one value, as in hyper).
fn parse_length(value: &[u8]) -> Option<u64> {
    let mut found = None;
    for part in value.split(|b| *b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = part.iter().try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })?;
        // Past i64::MAX, clients (curl) and nginx read no length at all: a cut answer
        // would look whole. The request side refuses those too (`framing`'s `HugeLength`).
        if n > i64::MAX as u64 {
            return None;
        }
        match found {
            Some(m) if m != n => return None,
            _ => found = Some(n),
        }
    }
    found
}

/// Digits without a leading zero (but `0`): a length as the client-facing writers
/// write it.
fn plain_number(value: &[u8]) -> bool {
    matches!(value, [b'0'] | [b'1'..=b'9', ..]) && value.iter().all(u8::is_ascii_digit)
}

pub(super) struct Head {
    pub(super) status: StatusCode,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    pub(super) body: BodyKind,
    pub(super) keep_alive: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum BodyKind {
    None,
    Length(u64),
    Chunked,
    /// Read to the end of the connection (RFC 9112 §6.3 rule 8).
    Eof,
}

/// What the framing headers of a response say.
#[derive(Default)]
struct Framing {
    length: Option<u64>,
    bad_length: bool,
    /// More than one `Content-Length` line, a list, or a number not written plainly
    /// (leading zeros, spaces): the client gets one plain value.
    odd_length: bool,
    te: bool,
    /// `Transfer-Encoding` is `chunked` and nothing else.
    chunked: bool,
    close: bool,
    keep_alive: bool,
}

impl Framing {
    fn note(&mut self, name: &str, value: &[u8]) {
        if name.eq_ignore_ascii_case("content-length") {
            self.odd_length |= self.length.is_some() || !plain_number(value);
            match parse_length(value) {
                Some(n) if !matches!(self.length, Some(m) if m != n) => self.length = Some(n),
                _ => self.bad_length = true,
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Any other coding (`gzip, chunked`) would reach the client decoded of its
            // chunks but still compressed, with the field that says so removed as
            // hop-by-hop: nginx answers 502 to those too.
            let mut codings = value.split(|b| *b == b',').map(<[u8]>::trim_ascii);
            let only_chunked = codings
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"))
                && codings.next().is_none();
            self.chunked = only_chunked && !self.te;
            self.te = true;
        } else if name.eq_ignore_ascii_case("connection") {
            self.close |= has_token(value, b"close");
            self.keep_alive |= has_token(value, b"keep-alive");
        }
    }

    /// The framing of a head another parser (hyper's) has read.
    fn of(headers: &HeaderMap) -> Framing {
        let mut framing = Framing::default();
        for (name, value) in headers {
            framing.note(name.as_str(), value.as_bytes());
        }
        framing
    }

    /// The framing a final response may have: one length or chunked, not both (RFC 9112
    /// §6.3: an answer with both may be a smuggling attempt, and no length is to be
    /// trusted), nothing else.
    fn check(&self) -> Result<(), UpstreamError> {
        if self.bad_length {
            return Err(UpstreamError::Protocol("invalid Content-Length"));
        }
        if self.te && self.length.is_some() {
            return Err(UpstreamError::Protocol(
                "both Content-Length and Transfer-Encoding",
            ));
        }
        if self.te && !self.chunked {
            return Err(UpstreamError::Protocol(
                "a transfer coding other than chunked",
            ));
        }
        Ok(())
    }

    /// The client-facing writers take one plain number of at most 18 digits; `5, 5` or
    /// `0000000000000000010` made the fast path fall back to a close-delimited answer,
    /// where a cut looks like the end.
    fn normalise(&self, headers: &mut HeaderMap) {
        if let (true, Some(n)) = (self.odd_length, self.length) {
            headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
        }
    }
}

/// Holds an answer of hyper's client to the pool's rules: hyper takes any 101 for an
/// upgrade, and passes on framing that nginx and the pool refuse. The client then gets
/// what the pool would have given it, or the same 502.
pub(super) fn admit<B>(upgrade: bool, resp: &mut Response<B>) -> Result<(), UpstreamError> {
    // hyper's own bound is its read buffer's, loose by the buffer's growth (a 110 KB head
    // passed one time in three): the head as written at its shortest (each field's `:`
    // and CRLF, the status line with the reason phrase hyper keeps aside) is held to the
    // pool's, which counts the bytes.
    let reason = resp.extensions().get::<hyper::ext::ReasonPhrase>();
    let status_line = STATUS_LINE + reason.map_or(0, |r| r.as_bytes().len());
    let written = resp.headers().iter();
    let size = written.fold(status_line, |n, (name, value)| {
        n + name.as_str().len() + value.len() + 3
    });
    if size > MAX_HEAD {
        return Err(UpstreamError::Protocol("response head too large"));
    }
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        return switched(upgrade, resp.headers());
    }
    let framing = Framing::of(resp.headers());
    framing.check()?;
    framing.normalise(resp.headers_mut());
    Ok(())
}

/// Whether a 101 may be tunnelled: only one to a request that asked for an upgrade (the
/// handler lets only WebSocket's through), switching to WebSocket. Another 101 would
/// reach the client as a final answer with nothing after it, or tunnel a protocol the
/// proxy never agreed to (`h2c`) past every check it makes.
fn switched(requested: bool, headers: &HeaderMap) -> Result<(), UpstreamError> {
    if !requested {
        return Err(UpstreamError::Protocol(
            "unexpected 101 Switching Protocols",
        ));
    }
    if !crate::proxy::headers::offers_websocket(headers) {
        return Err(UpstreamError::Protocol(
            "101 Switching Protocols to another protocol than WebSocket",
        ));
    }
    Ok(())
}

/// The final response head at the front of `rbuf`, once it is all there; interim
/// (1xx) responses are consumed and skipped.
pub(super) fn parse_head(
    rbuf: &mut BytesMut,
    spans: &mut Vec<Span>,
    head_request: bool,
) -> Result<Option<Head>, UpstreamError> {
    loop {
        if rbuf.is_empty() {
            return Ok(None);
        }
        let mut framing = Framing::default();
        spans.clear();
        let (len, code, version) = {
            let mut slots = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
            let mut resp = httparse::Response::new(&mut []);
            let buf: &[u8] = rbuf;
            let len = match httparse::ParserConfig::default()
                .parse_response_with_uninit_headers(&mut resp, buf, &mut slots)
            {
                Ok(httparse::Status::Complete(n)) if n <= MAX_HEAD => n,
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Ok(None),
                Ok(_) => return Err(UpstreamError::Protocol("response head too large")),
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(UpstreamError::Protocol("too many response headers"))
                }
                Err(_) => return Err(UpstreamError::Protocol("malformed response head")),
            };
            let base = buf.as_ptr() as usize;
            let at = |s: &[u8]| {
                let start = (s.as_ptr() as usize - base) as u32;
                (start, start + s.len() as u32)
            };
            for h in resp.headers.iter() {
                framing.note(h.name, h.value);
                spans.push(Span {
                    name: at(h.name.as_bytes()),
                    value: at(h.value),
                });
            }
            (len, resp.code.unwrap_or(0), resp.version.unwrap_or(1))
        };
        let status = StatusCode::from_u16(code)
            .map_err(|_| UpstreamError::Protocol("invalid status code"))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                // Upgrades go through the legacy client; nothing here asked for one.
                return Err(UpstreamError::Protocol(
                    "unexpected 101 Switching Protocols",
                ));
            }
            rbuf.advance(len);
            continue;
        }
        framing.check()?;
        let body = if head_request
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            BodyKind::None
        } else if framing.te {
            BodyKind::Chunked
        } else {
            framing.length.map_or(BodyKind::Eof, BodyKind::Length)
        };
        let (version, keep_alive) = if version == 0 {
            // RFC 9112 §6.1: Transfer-Encoding from an HTTP/1.0 sender is faulty framing;
            // the message is read, and its connection ends.
            (
                Version::HTTP_10,
                framing.keep_alive && !framing.close && !framing.te,
            )
        } else {
            (Version::HTTP_11, !framing.close)
        };
        // A 204 announcing a body (RFC 9110 §15.3.5 and §8.6 forbid both fields), or a 304
        // announcing a chunked one (its length may describe the resource; a chunked body it
        // never has), comes from a server that may well write one: after the head, where the
        // connection's next answer would be read, for whoever asks next. Its connection
        // ends with it.
        let announces_body = match status {
            StatusCode::NO_CONTENT => framing.te || framing.length.is_some_and(|n| n > 0),
            StatusCode::NOT_MODIFIED => framing.te,
            _ => false,
        };
        let keep_alive = keep_alive && !announces_body;
        let raw = rbuf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(spans.len());
        for span in spans.iter() {
            let name = &raw[span.name.0 as usize..span.name.1 as usize];
            let name = HeaderName::from_bytes(name)
                .map_err(|_| UpstreamError::Protocol("invalid header name"))?;
            // A slice of the head: no copy per header.
            let value = raw.slice(span.value.0 as usize..span.value.1 as usize);
            let value = HeaderValue::from_maybe_shared(value)
                .map_err(|_| UpstreamError::Protocol("invalid header value"))?;
            headers.append(name, value);
        }
        framing.normalise(&mut headers);
        return Ok(Some(Head {
            status,
            version,
            headers,
            body,
            keep_alive: keep_alive && body != BodyKind::Eof,
        }));
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decode {
    Length(u64),
    Chunk(Chunk),
    Eof,
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Chunk {
    Size,
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    Trailers,
}

pub(super) enum Step {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    /// Nothing more without reading (or, in a look-ahead, without handing out data).
    More,
}

/// Decodes what `rbuf` holds. With `data` false, stops before handing out body bytes: the
/// look-ahead after a data frame that finds the end without waiting for another poll.
pub(super) fn step(
    state: &mut Decode,
    rbuf: &mut BytesMut,
    data: bool,
) -> Result<Step, UpstreamError> {
    loop {
        match *state {
            Decode::Done | Decode::Length(0) => {
                *state = Decode::Done;
                return Ok(Step::End);
            }
            Decode::Length(left) => {
                if rbuf.is_empty() || !data {
                    return Ok(Step::More);
                }
                let n = left.min(rbuf.len() as u64);
                *state = Decode::Length(left - n);
                return Ok(Step::Data(rbuf.split_to(n as usize).freeze()));
            }
            Decode::Eof => {
                if rbuf.is_empty() || !data {
                    return Ok(Step::More);
                }
                return Ok(Step::Data(rbuf.split().freeze()));
            }
            Decode::Chunk(Chunk::Size) => match chunk_size(rbuf)? {
                None => return Ok(Step::More),
                Some((used, size)) => {
                    rbuf.advance(used);
                    *state = Decode::Chunk(if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data(size)
                    });
                }
            },
            Decode::Chunk(Chunk::Data(left)) => {
                if rbuf.is_empty() || !data {
                    return Ok(Step::More);
                }
                let n = left.min(rbuf.len() as u64);
                *state = Decode::Chunk(if n == left {
                    Chunk::DataEnd
                } else {
                    Chunk::Data(left - n)
                });
                return Ok(Step::Data(rbuf.split_to(n as usize).freeze()));
            }
            Decode::Chunk(Chunk::DataEnd) => {
                if rbuf.len() < 2 {
                    return Ok(Step::More);
                }
                if &rbuf[..2] != b"\r\n" {
                    return Err(UpstreamError::Protocol("chunk data not followed by CRLF"));
                }
                rbuf.advance(2);
                *state = Decode::Chunk(Chunk::Size);
            }
            Decode::Chunk(Chunk::Trailers) => {
                if rbuf.starts_with(b"\r\n") {
                    rbuf.advance(2);
                    *state = Decode::Done;
                    return Ok(Step::End);
                }
                return match trailers(rbuf)? {
                    None => Ok(Step::More),
                    Some(map) => {
                        *state = Decode::Done;
                        Ok(Step::Trailers(map))
                    }
                };
            }
        }
    }
}

/// `chunk-size [ws] [; ext] CRLF` at the front of `buf`: bytes used and the size, `None`
/// while incomplete. Bare LF and CR are refused, as hyper does.
fn chunk_size(buf: &[u8]) -> Result<Option<(usize, u64)>, UpstreamError> {
    let bad = || UpstreamError::Protocol("invalid chunk size line");
    let window = &buf[..buf.len().min(MAX_CHUNK_LINE)];
    let Some(lf) = memchr::memchr(b'\n', window) else {
        return if buf.len() >= MAX_CHUNK_LINE {
            Err(bad())
        } else {
            Ok(None)
        };
    };
    if lf == 0 || window[lf - 1] != b'\r' {
        return Err(bad());
    }
    let line = &window[..lf - 1];
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(bad());
    }
    let mut size: u64 = 0;
    for &d in &line[..digits] {
        let v = (d as char).to_digit(16).unwrap_or(0);
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(v)))
            .ok_or_else(bad)?;
    }
    let rest = &line[digits..];
    let rest = &rest[rest
        .iter()
        .take_while(|b| **b == b' ' || **b == b'\t')
        .count()..];
    if !rest.is_empty() && (rest[0] != b';' || rest.contains(&b'\r')) {
        return Err(bad());
    }
    Ok(Some((lf + 1, size)))
}

/// The trailer section after the last chunk, once complete (its blank line included).
fn trailers(rbuf: &mut BytesMut) -> Result<Option<HeaderMap>, UpstreamError> {
    let bad = || UpstreamError::Protocol("invalid trailers");
    let mut slots = [httparse::EMPTY_HEADER; MAX_TRAILERS];
    let (used, map) = match httparse::parse_headers(rbuf, &mut slots) {
        Ok(httparse::Status::Complete((used, fields))) => {
            // httparse also ends a line at a bare LF; hyper, and the chunk-size lines
            // here, do not. A server that meant the LF as data (or nothing) would go on
            // after the point where this reader ends the response.
            let section = &rbuf[..used];
            if memchr::memchr_iter(b'\n', section).any(|i| i == 0 || section[i - 1] != b'\r') {
                return Err(bad());
            }
            let mut map = HeaderMap::with_capacity(fields.len());
            for f in fields {
                let name = HeaderName::from_bytes(f.name.as_bytes()).map_err(|_| bad())?;
                let value = HeaderValue::from_bytes(f.value).map_err(|_| bad())?;
                map.append(name, value);
            }
            (used, map)
        }
        Ok(httparse::Status::Partial) if rbuf.len() < MAX_HEAD => return Ok(None),
        _ => return Err(bad()),
    };
    rbuf.advance(used);
    Ok(Some(map))
}

/// One response as the pool reads it, for the `response` fuzz target, which holds it to
/// hyper's client: what the exchange and [`super::PoolBody`] do with the head and the body
/// decoder, the connection's bytes arriving as `segments` and then its end.
#[doc(hidden)]
pub mod replay {
    use super::*;

    /// A response read to its end.
    #[derive(Debug, PartialEq, Eq)]
    pub struct Read {
        pub status: u16,
        pub headers: Vec<(String, Vec<u8>)>,
        pub body: Vec<u8>,
        pub trailers: Vec<(String, Vec<u8>)>,
        /// Whether the connection may carry the next request.
        pub keep_alive: bool,
        /// The bytes after the response.
        pub rest: Vec<u8>,
    }

    /// Reads the first response; the error is the pool's `UpstreamError` text.
    pub fn read(segments: &[&[u8]], head_request: bool) -> Result<Read, String> {
        let mut next = segments.iter();
        let mut rbuf = BytesMut::new();
        let mut spans = Vec::new();
        let mut fill = |rbuf: &mut BytesMut| match next.next() {
            Some(s) => {
                rbuf.extend_from_slice(s);
                true
            }
            None => false,
        };
        let head = loop {
            match parse_head(&mut rbuf, &mut spans, head_request) {
                Ok(Some(head)) => break head,
                Ok(None) if fill(&mut rbuf) => {}
                Ok(None) => return Err(UpstreamError::Closed.to_string()),
                Err(e) => return Err(e.to_string()),
            }
        };
        let mut state = match head.body {
            BodyKind::None => Decode::Done,
            BodyKind::Length(n) => Decode::Length(n),
            BodyKind::Chunked => Decode::Chunk(Chunk::Size),
            BodyKind::Eof => Decode::Eof,
        };
        let mut body = Vec::new();
        let mut trailers = HeaderMap::new();
        loop {
            match step(&mut state, &mut rbuf, true).map_err(|e| e.to_string())? {
                Step::Data(bytes) => {
                    body.extend_from_slice(&bytes);
                    // The look-ahead `PoolBody` makes after each data frame.
                    match step(&mut state, &mut rbuf, false).map_err(|e| e.to_string())? {
                        Step::Trailers(t) => trailers = t,
                        Step::End => {}
                        Step::Data(_) | Step::More => continue,
                    }
                    break;
                }
                Step::Trailers(t) => {
                    trailers = t;
                    break;
                }
                Step::End => break,
                Step::More if fill(&mut rbuf) => {}
                Step::More if state == Decode::Eof => break,
                Step::More => return Err(UpstreamError::Closed.to_string()),
            }
        }
        let mut rest = rbuf.to_vec();
        for s in next {
            rest.extend_from_slice(s);
        }
        let pairs = |map: &HeaderMap| {
            map.iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                .collect()
        };
        Ok(Read {
            status: head.status.as_u16(),
            headers: pairs(&head.headers),
            body,
            trailers: pairs(&trailers),
            keep_alive: head.keep_alive,
            rest,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list of equal lengths is one length, unequal ones none; the trailer section may
    /// grow to just under [`MAX_HEAD`] and no further. (Cases a mutation run let through.)
    #[test]
    fn length_lists_and_the_trailer_limit() {
        assert_eq!(parse_length(b"5"), Some(5));
        assert_eq!(parse_length(b"5, 5"), Some(5));
        for bad in [&b"5, 6"[..], b"5,", b"", b"+5", b"18446744073709551616"] {
            assert_eq!(
                parse_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }

        let mut rbuf = BytesMut::from(&[b'a'; MAX_HEAD - 1][..]);
        assert!(
            matches!(trailers(&mut rbuf), Ok(None)),
            "waits under the limit"
        );
        rbuf.extend_from_slice(b"a");
        assert!(trailers(&mut rbuf).is_err(), "refused at the limit");
    }

    /// The framing upstream is the pool's own: a client's `Content-Length` or
    /// `Transfer-Encoding` is never copied beside it (two lengths, or a length and
    /// chunked, would be a smuggling vector). Only `Connection: close` asks to close.
    #[test]
    fn the_request_head_states_its_own_framing() {
        let parts = |fields: &[(&str, &str)]| {
            let mut req = http::Request::builder().method("POST").uri("/x");
            for (name, value) in fields {
                req = req.header(*name, *value);
            }
            req.body(()).map(|r| r.into_parts().0)
        };
        let mut buf = Vec::new();
        let client = parts(&[("content-length", "7"), ("transfer-encoding", "chunked")]);
        let close = encode_head(
            &mut buf,
            &client.expect("head"),
            "up.example",
            Some(Out::Length(5)),
            Some(5),
        );
        assert_eq!(
            String::from_utf8_lossy(&buf),
            "POST /x HTTP/1.1\r\nhost: up.example\r\ncontent-length: 5\r\n\r\n"
        );
        assert!(!close);

        for (fields, asks) in [
            (&[("connection", "close")][..], true),
            (&[("connection", "keep-alive")], false),
            (&[("x-mode", "close")], false),
            (&[("x-mode", "close"), ("connection", "keep-alive")], false),
        ] {
            let p = parts(fields).expect("head");
            let close = encode_head(&mut buf, &p, "up.example", Some(Out::Chunked), None);
            assert_eq!(close, asks, "{fields:?}");
            assert!(String::from_utf8_lossy(&buf).ends_with("transfer-encoding: chunked\r\n\r\n"));
        }
    }

    /// A length said oddly (leading zeros, a list, twice) reaches the client-facing
    /// writers as one plain number, which they can frame the answer by; a plain one is
    /// left as it came.
    #[test]
    fn an_odd_content_length_becomes_one_plain_number() {
        for (fields, want) in [
            ("content-length: 005\r\n", "5"),
            ("content-length: 5, 5\r\n", "5"),
            ("content-length: 5\r\ncontent-length: 5\r\n", "5"),
            ("content-length: 0\r\n", "0"),
            ("content-length: 00\r\n", "0"),
            ("content-length: 12\r\n", "12"),
        ] {
            let mut rbuf = BytesMut::from(format!("HTTP/1.1 200 OK\r\n{fields}\r\n").as_bytes());
            let head = parse_head(&mut rbuf, &mut Vec::new(), false);
            let Ok(Some(head)) = head else {
                panic!("{fields:?}: {:?}", head.map(|h| h.map(|h| h.status)));
            };
            let lengths: Vec<_> = head.headers.get_all(CONTENT_LENGTH).iter().collect();
            assert_eq!(lengths, [want], "{fields:?}");
        }
    }

    /// Whether the connection may carry the next request, as RFC 9112 §9.3 has it: HTTP/1.1
    /// unless `close` is among the `Connection` tokens, HTTP/1.0 only with `keep-alive`
    /// and without chunked framing, and never after a body read to the close.
    #[test]
    fn keep_alive_follows_the_version_and_the_connection_tokens() {
        for (head, keep) in [
            ("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", true),
            (
                "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nconnection: x, Close\r\ncontent-length: 0\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nx-mode: close\r\ncontent-length: 0\r\n\r\n",
                true,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", false),
            ("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false),
            (
                "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
                true,
            ),
            (
                "HTTP/1.0 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 0\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n",
                false,
            ),
        ] {
            let mut rbuf = BytesMut::from(head.as_bytes());
            let parsed = parse_head(&mut rbuf, &mut Vec::new(), false);
            assert!(
                matches!(parsed, Ok(Some(ref h)) if h.keep_alive == keep),
                "{head:?}"
            );
        }
    }

    /// The limits in bytes, not just relative to themselves: a response head of 64 KiB (a
    /// large `Set-Cookie`, a CSP) is read, one byte more is refused, and an unfinished one
    /// is waited for only while it can still end within that; a chunk-size line with
    /// extensions of nearly 4 KiB is read, one without its end by then is refused.
    #[test]
    fn response_heads_and_chunk_lines_are_bounded_where_documented() {
        let head = |len: usize| {
            let start = "HTTP/1.1 200 OK\r\nx-big: ";
            let end = "\r\ncontent-length: 0\r\n\r\n";
            let fill = "a".repeat(len - start.len() - end.len());
            BytesMut::from(format!("{start}{fill}{end}").as_bytes())
        };
        let mut spans = Vec::new();
        let ok = parse_head(&mut head(64 * 1024), &mut spans, false);
        assert!(
            matches!(ok, Ok(Some(ref h)) if h.status == 200),
            "64 KiB head"
        );
        let over = parse_head(&mut head(64 * 1024 + 1), &mut spans, false);
        let too_large = |r: &Result<Option<Head>, UpstreamError>| {
            matches!(r, Err(UpstreamError::Protocol("response head too large")))
        };
        assert!(too_large(&over), "a head over 64 KiB");
        // Unfinished: waited for while it could still end within the limit, no longer.
        let mut partial = BytesMut::from(&b"HTTP/1.1 200 OK\r\nx-big: "[..]);
        partial.resize(64 * 1024 - 1, b'a');
        let wait = parse_head(&mut partial, &mut spans, false);
        assert!(matches!(wait, Ok(None)), "an unfinished head under 64 KiB");
        partial.extend_from_slice(b"a");
        let cut = parse_head(&mut partial, &mut spans, false);
        assert!(too_large(&cut), "an unfinished head of 64 KiB");

        let line = |ext: usize| {
            let mut l = b"5;".to_vec();
            l.extend(std::iter::repeat_n(b'e', ext));
            l.extend_from_slice(b"\r\nhello\r\n");
            l
        };
        assert!(matches!(chunk_size(&line(4000)), Ok(Some((4004, 5)))));
        let long = line(4 * 1024);
        assert!(chunk_size(&long).is_err(), "no line end within 4 KiB");
    }

    /// The decoder fed one byte at a time: every state survives a partial read.
    #[test]
    fn chunked_decoding_byte_by_byte() {
        let wire = b"5;a=b\r\nhello\r\n000C\r\n hello world\r\n0\r\nx-t: 1\r\n\r\n";
        let mut state = Decode::Chunk(Chunk::Size);
        let mut rbuf = BytesMut::new();
        let mut out = Vec::new();
        let mut trailers = None;
        for &b in wire {
            rbuf.extend_from_slice(&[b]);
            loop {
                match step(&mut state, &mut rbuf, true).unwrap() {
                    Step::Data(d) => out.extend_from_slice(&d),
                    Step::Trailers(t) => trailers = Some(t),
                    Step::End | Step::More => break,
                }
            }
        }
        assert_eq!(state, Decode::Done);
        assert!(rbuf.is_empty());
        assert_eq!(out, b"hello hello world");
        assert_eq!(trailers.unwrap()["x-t"], "1");

        for bad in [
            &b"zz\r\n"[..],
            b"5\nhello\r\n",
            b"10\nhello\r\n",
            b"-5\r\n",
            b"0x5\r\n",
            b"5 5\r\n",
            b"1ffffffffffffffff\r\n",
            b"5;a\rb\r\n",
        ] {
            let mut state = Decode::Chunk(Chunk::Size);
            let mut rbuf = BytesMut::from(bad);
            assert!(
                step(&mut state, &mut rbuf, true).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Bare LFs in the trailer section (found by the `response` fuzz target: the
        // pool ended the answer at `0\r\n\n`, hyper refuses it).
        for bad in [&b"0\r\n\nHTTP/1.1 200 OK\r\n\r\n"[..], b"0\r\nx-t: 1\n\r\n"] {
            let mut state = Decode::Chunk(Chunk::Size);
            let mut rbuf = BytesMut::from(bad);
            let ended = loop {
                match step(&mut state, &mut rbuf, true) {
                    Ok(Step::End | Step::Trailers(_)) => break true,
                    Ok(Step::More) | Err(_) => break false,
                    Ok(Step::Data(_)) => {}
                }
            };
            assert!(!ended, "{:?}", String::from_utf8_lossy(bad));
        }
        let mut state = Decode::Chunk(Chunk::Size);
        let mut rbuf = BytesMut::from(&b"3\r\nhello\r\n"[..]);
        assert!(matches!(
            step(&mut state, &mut rbuf, true),
            Ok(Step::Data(_))
        ));
        assert!(
            step(&mut state, &mut rbuf, true).is_err(),
            "data longer than its size"
        );

        // A chunk's CRLF is taken as soon as both bytes are there: a stream that pauses
        // after a chunk leaves nothing half-read behind it.
        let mut state = Decode::Chunk(Chunk::Size);
        let mut rbuf = BytesMut::from(&b"5\r\nhello\r\n"[..]);
        assert!(matches!(
            step(&mut state, &mut rbuf, true),
            Ok(Step::Data(_))
        ));
        assert!(matches!(step(&mut state, &mut rbuf, false), Ok(Step::More)));
        assert_eq!(state, Decode::Chunk(Chunk::Size));
        assert!(rbuf.is_empty());
    }
}
