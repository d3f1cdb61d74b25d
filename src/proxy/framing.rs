//! Request framing that hyper accepts and SPEC §4 refuses.
//!
//! hyper frames a request that carries both `Content-Length` and `Transfer-Encoding` by the
//! latter (RFC 9112 §6.3 allows that), drops the length, and closes the connection after
//! the response: the service never learns the length was there. SPEC §4 wants such a
//! request refused with 400, since a peer on the path may have framed it by the length
//! (request smuggling). So the connection's bytes are watched on their way into hyper:
//! [`HeadWatch`] follows HTTP/1 framing (heads, sized and chunked bodies) and records which
//! request head carried both fields; [`Verdicts`] tells the service, request by request.
//! It also tells whether the bytes so far end inside a head ([`HeadWatch::in_head`]): the
//! listener's header timeout runs from a head's first byte, not while a connection idles.
//!
//! The same watch refuses the other framings hyper accepts but a peer could read
//! differently ([`Refusal`]): a repeated `Content-Length` (hyper keeps one when they agree)
//! and a `Transfer-Encoding` other than exactly `chunked` (hyper accepts `gzip, chunked`
//! and `chunked, chunked`, and would hand the proxy still-coded bytes as the content).
//! After a refusal the listener closes the connection.
//!
//! The watch costs a scan for line ends in heads and chunk-size lines; body bytes are
//! skipped by count. Whatever it cannot follow (`CONNECT`, upgrades, a chunk-size line
//! longer than it keeps, a chunk-size or trailer line that ends in a bare LF, malformed
//! input hyper will reject) switches it off, and then the
//! connection serves no further request: the answer to the request where the watch lost
//! track closes the connection unless it turns it into a tunnel (101, or 2xx to
//! `CONNECT`), and a request whose head it did not see is refused ([`Refusal::Unfollowed`]).
//! hyper keeps a connection open after a refused `CONNECT` or upgrade, so without this the
//! next request would pass unchecked. HTTP/2 (the exact preface opening a connection) has
//! framing of its own: the watch refuses nothing there, and follows only its frames'
//! headers, for the header blocks ([`Frames`]) and the frame budget ([`super::flood`]).
//! Only the exact preface: a head that merely starts with `PRI` is HTTP/1 to hyper, and
//! followed as such.
//!
//! Closing, rather than watching on: whether the bytes after a `CONNECT` or upgrade head
//! are HTTP is decided by the answer, after hyper may already have read them past the
//! watch, and following them until then would scan the start of every WebSocket as if it
//! were requests. A client that reuses a connection after a refused upgrade reconnects.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::flood::{Credit, FrameBudget};
use super::listener::MAX_HEAD;

/// Marks a request (in its extensions) whose framing is refused: both `Content-Length` and
/// `Transfer-Encoding`, or another [`Refusal`] (which the listener inserts beside it).
#[derive(Debug, Clone, Copy)]
pub struct AmbiguousLength;

/// Why a request's framing is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Both `Content-Length` and `Transfer-Encoding`.
    BothLengths,
    /// More than one `Content-Length` field line, even with equal values (as nginx).
    RepeatedLength,
    /// A `Transfer-Encoding` other than exactly one `chunked`.
    TransferCoding,
    /// A `Content-Length` or `Transfer-Encoding` line too long to be an honest one.
    LongFramingField,
    /// A request after the watch lost track of the connection's framing: its head may not
    /// be where hyper found it.
    Unfollowed,
    /// A head over [`MAX_HEAD`]: answered 431, as the fast path answers it. hyper checks
    /// its own limit only while a head is incomplete, and its buffer grows by doubling: a
    /// head that one read completes passed up to about twice the limit.
    HeadTooLarge,
    /// A `Content-Length` over 2^63-1, the most nginx (and many servers) can hold: hyper
    /// took it and sent it on, but answered the last two values below 2^64 431.
    HugeLength,
}

impl Refusal {
    /// The reason in the client's E5003 answer.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::BothLengths => "both Content-Length and Transfer-Encoding",
            Refusal::RepeatedLength => "more than one Content-Length",
            Refusal::TransferCoding => "unsupported Transfer-Encoding (only chunked is accepted)",
            Refusal::LongFramingField => "oversized Content-Length or Transfer-Encoding field",
            Refusal::Unfollowed => "an earlier request's framing could not be followed",
            Refusal::HeadTooLarge => "request head over 64 KiB",
            Refusal::HugeLength => "Content-Length over 9223372036854775807",
        }
    }

    fn code(self) -> u64 {
        match self {
            Refusal::BothLengths => 1,
            Refusal::RepeatedLength => 2,
            Refusal::TransferCoding => 3,
            Refusal::LongFramingField => 4,
            Refusal::Unfollowed => 5,
            Refusal::HeadTooLarge => 6,
            Refusal::HugeLength => 7,
        }
    }

    fn from_code(code: u64) -> Self {
        match code {
            2 => Refusal::RepeatedLength,
            3 => Refusal::TransferCoding,
            4 => Refusal::LongFramingField,
            5 => Refusal::Unfollowed,
            6 => Refusal::HeadTooLarge,
            7 => Refusal::HugeLength,
            _ => Refusal::BothLengths,
        }
    }
}

/// Enough of a line to recognise the fields that matter and read a length or chunk size.
pub(super) const LINE_CAP: usize = 64;

/// The watch and the service's side of it, for one connection.
pub fn watch() -> (HeadWatch, Verdicts) {
    let found = Arc::new(Found::default());
    (
        HeadWatch {
            state: State::Preface(0),
            line: [0; LINE_CAP],
            line_len: 0,
            line_cut: false,
            cr: false,
            head: Head::default(),
            head_len: 0,
            heads: 0,
            http2: false,
            frames: Frames::default(),
            found: found.clone(),
        },
        Verdicts {
            found,
            served: AtomicU64::new(0),
        },
    )
}

/// What the watch tells the service.
#[derive(Debug, Default)]
struct Found {
    /// The number (1-based) of the first refused head, shifted left by 8, with the
    /// [`Refusal`] code in the low byte; 0 while there is none.
    flagged: AtomicU64,
    /// The number of the head during which the watch stopped following the framing (in
    /// the head itself or in its body); 0 while it follows.
    lost_at: AtomicU64,
}

/// What the service does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Refused, and why; the connection closes after the answer.
    pub refusal: Option<Refusal>,
    /// The watch lost track at this request: unless the answer turns the connection into a
    /// tunnel, it must close after it.
    pub last: bool,
}

/// Tells the service which request is the ambiguous one. hyper hands HTTP/1 requests to the
/// service in the order their heads arrived, and the watch sees each head before hyper
/// does, so counting requests is enough — even with pipelining, where a later head may
/// already have been read while an earlier request is served.
///
/// Where the watch lost track is known when the service gets that request: its head went
/// through the watch before hyper parsed it, and `CONNECT` and `Upgrade` are in the head. A
/// chunk-size line is lost in the body, maybe after the answer went out with the connection
/// kept: the next request is then refused instead.
#[derive(Debug)]
pub struct Verdicts {
    found: Arc<Found>,
    served: AtomicU64,
}

impl Verdicts {
    /// Called once per request, in order.
    pub fn next_verdict(&self) -> Verdict {
        let n = self.served.fetch_add(1, Relaxed) + 1;
        let flagged = self.found.flagged.load(Relaxed);
        let lost_at = self.found.lost_at.load(Relaxed);
        let refusal = if flagged >> 8 == n {
            Some(Refusal::from_code(flagged & 0xff))
        } else if lost_at != 0 && n > lost_at {
            Some(Refusal::Unfollowed)
        } else {
            None
        };
        Verdict {
            refusal,
            last: lost_at == n,
        }
    }

    /// Called once per request, in order: whether this one's framing is refused, and why.
    /// (The listener takes [`Verdicts::next_verdict`]; this is the tests' and the fuzz
    /// target's view.)
    pub fn next_refusal(&self) -> Option<Refusal> {
        self.next_verdict().refusal
    }

    /// Called once per request, in order: whether this one's framing is refused.
    #[cfg(test)]
    pub fn next_is_ambiguous(&self) -> bool {
        self.next_refusal().is_some()
    }
}

/// What makes hyper-util's server serve HTTP/2: these exact bytes opening the connection
/// (it compares the first 24 bytes, nothing else). Anything else is HTTP/1, whatever its
/// method: `PRI /x HTTP/1.1` is an ordinary request to hyper.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The connection's first bytes, as long as they are the start of [`H2_PREFACE`]: how
    /// many of it have been seen.
    Preface(usize),
    /// A message has ended and no byte of the next head has come: the connection is idle.
    Between,
    /// The lines of a head; `first` until the request line has been read.
    Head { first: bool },
    /// A sized body: bytes still to pass.
    Sized(u64),
    /// A chunk-size line.
    ChunkSize,
    /// Chunk data and the CRLF after it: bytes still to pass.
    ChunkData(u64),
    /// Trailer lines after the last chunk, up to the empty line.
    Trailers,
    /// HTTP/2's frames, after its preface: see [`Frames`].
    Http2,
    /// Not HTTP/1 framing any more, or lost: watch no further.
    Off,
}

#[derive(Debug, Default, Clone, Copy)]
struct Head {
    content_length: Option<u64>,
    has_content_length: bool,
    /// A second `Content-Length` line.
    repeated_length: bool,
    transfer_encoding: bool,
    /// The only `Transfer-Encoding` line says exactly `chunked`.
    plain_chunked: bool,
    /// A `Content-Length` or `Transfer-Encoding` line longer than [`LINE_CAP`].
    long_field: bool,
    upgrade: bool,
}

/// Follows one connection's request framing; fed every byte hyper reads, in order.
#[derive(Debug)]
pub struct HeadWatch {
    state: State,
    line: [u8; LINE_CAP],
    line_len: usize,
    /// The current line is longer than [`LINE_CAP`]: `line` holds its start only.
    line_cut: bool,
    /// The last byte of the current line so far is a CR (it may lie past `line`'s end).
    cr: bool,
    head: Head,
    /// The current head's bytes so far, from its request line.
    head_len: usize,
    /// Heads begun so far (request lines read).
    heads: u64,
    /// The connection opened with HTTP/2's whole preface.
    http2: bool,
    frames: Frames,
    found: Arc<Found>,
}

/// HTTP/2's frames after the preface, followed only by their 9-byte headers, for where a
/// header block is (a HEADERS frame and the CONTINUATIONs up to END_HEADERS, RFC 9113
/// §4.3): `--header-timeout` bounds a request head over HTTP/2 as over HTTP/1, as nginx's
/// `client_header_timeout` does. Without it a client sending a header block a byte at a
/// time (or CONTINUATIONs without end) held its connection for as long as it went on.
#[derive(Debug, Default)]
struct Frames {
    header: [u8; 9],
    /// Bytes of the current frame's header so far.
    have: usize,
    /// Bytes of the current frame's payload still to come.
    left: usize,
    /// The current frame ends a header block.
    ends_block: bool,
    /// The bytes so far end inside a header block.
    in_block: bool,
    /// The highest stream the client has opened with a HEADERS frame.
    last_stream: u32,
    /// The current header block is trailers: on a stream already open, the end of a
    /// request's body and no head (a stalled one was cut as a head and logged 408 beside
    /// its request's own line).
    trailers: bool,
    budget: FrameBudget,
}

impl Frames {
    const HEADERS: u8 = 0x1;
    const CONTINUATION: u8 = 0x9;
    const END_HEADERS: u8 = 0x4;

    fn scan(&mut self, mut data: &[u8]) {
        self.budget.read(data.len());
        while !data.is_empty() {
            if self.have < self.header.len() {
                let n = (self.header.len() - self.have).min(data.len());
                self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
                self.have += n;
                data = &data[n..];
                let kind = self.header[3];
                let block = kind == Self::HEADERS || kind == Self::CONTINUATION;
                // A head has begun once its frame's type is in (a HEADERS frame's stream,
                // which may make it trailers, comes five bytes later).
                let opens = kind == Self::HEADERS || (block && !self.trailers);
                self.in_block |= self.have > 3 && opens;
                if self.have < self.header.len() {
                    return;
                }
                let [a, b, c, _, flags, s0, s1, s2, s3] = self.header;
                self.left = u32::from_be_bytes([0, a, b, c]) as usize;
                self.ends_block = block && flags & Self::END_HEADERS != 0;
                if kind == Self::HEADERS {
                    let stream = u32::from_be_bytes([s0, s1, s2, s3]) & 0x7fff_ffff;
                    self.trailers = stream <= self.last_stream;
                    self.last_stream = self.last_stream.max(stream);
                    self.in_block &= !self.trailers;
                }
                self.budget.frame(kind, self.left);
            } else {
                let take = self.left.min(data.len());
                self.left -= take;
                data = &data[take..];
            }
            if self.left == 0 {
                self.in_block &= !self.ends_block;
                self.have = 0;
            }
        }
    }
}

impl HeadWatch {
    pub fn scan(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match self.state {
                State::Off => return,
                State::Http2 => return self.frames.scan(data),
                State::Preface(seen) => {
                    let rest = &H2_PREFACE[seen..];
                    let n = rest.len().min(data.len());
                    if data[..n] != rest[..n] {
                        // HTTP/1 after all, as hyper-util decides: the bytes that matched
                        // so far open its first head.
                        self.state = State::Head { first: true };
                        self.scan(&H2_PREFACE[..seen]);
                        continue;
                    }
                    data = &data[n..];
                    self.state = if seen + n == H2_PREFACE.len() {
                        // HTTP/2 has framing of its own, where none of this applies.
                        self.http2 = true;
                        State::Http2
                    } else {
                        State::Preface(seen + n)
                    };
                }
                // Bytes, so the next head has begun (an empty line before it included).
                State::Between => self.state = State::Head { first: true },
                State::Sized(left) | State::ChunkData(left) => {
                    let take = left.min(data.len() as u64);
                    data = &data[take as usize..];
                    let left = left - take;
                    self.state = match (self.state, left) {
                        (State::Sized(_), 0) => State::Between,
                        (State::Sized(_), _) => State::Sized(left),
                        (_, 0) => State::ChunkSize,
                        _ => State::ChunkData(left),
                    };
                }
                State::Head { .. } | State::ChunkSize | State::Trailers => {
                    // This runs on every read: the line end is found a word at a time, and a
                    // line that arrived whole is looked at where it lies, not copied.
                    let end = memchr::memchr(b'\n', data);
                    if let State::Head { .. } = self.state {
                        self.head_len += end.map_or(data.len(), |end| end + 1);
                    }
                    match end {
                        Some(end) if self.line_len == 0 => {
                            let line = &data[..end];
                            data = &data[end + 1..];
                            self.line_cut = line.len() > LINE_CAP;
                            self.cr = line.last() == Some(&b'\r');
                            self.end_of_line(&line[..line.len().min(LINE_CAP)]);
                        }
                        Some(end) => {
                            self.push(&data[..end]);
                            data = &data[end + 1..];
                            let (copy, len) = (self.line, self.line_len);
                            self.end_of_line(&copy[..len]);
                        }
                        None => {
                            self.push(data);
                            return;
                        }
                    }
                }
            }
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(LINE_CAP - self.line_len);
        self.line[self.line_len..self.line_len + n].copy_from_slice(&bytes[..n]);
        self.line_len += n;
        self.line_cut |= n < bytes.len();
        if let Some(&last) = bytes.last() {
            self.cr = last == b'\r';
        }
    }

    /// `line`: the line without its `\n`, at most [`LINE_CAP`] bytes of it (`line_cut`
    /// says whether there was more, `cr` whether it ended in CRLF).
    fn end_of_line(&mut self, mut line: &[u8]) {
        if let Some(l) = line.strip_suffix(b"\r") {
            line = l;
        }
        self.state = match self.state {
            // hyper ends a chunk-size or trailer line only at CRLF: a bare LF is an error in
            // the one and an ordinary byte in the other, so the trailers would end where
            // hyper does not end them (`0\r\n\n` and what follows is still its trailer
            // section) and the next head be looked for in the wrong place.
            State::ChunkSize | State::Trailers if !self.cr => self.lose(),
            // Empty lines before a request line are tolerated (RFC 9112 §2.2), and are no
            // part of its head.
            State::Head { first: true } if line.is_empty() => {
                self.head_len = 0;
                State::Head { first: true }
            }
            State::Head { first: true } => {
                self.head = Head::default();
                self.heads += 1;
                let method = line.split(|&b| b == b' ').next().unwrap_or_default();
                // A preface that is not the connection's first bytes (or is not all of them)
                // is HTTP/1 to hyper, which refuses its version and ends the connection: not
                // followed, should that change. Any other `PRI` head is an ordinary request.
                if method == b"CONNECT" || line == b"PRI * HTTP/2.0" {
                    // A tunnel may follow (or, for a late preface, hyper's error).
                    self.lose()
                } else {
                    State::Head { first: false }
                }
            }
            State::Head { first: false } if line.is_empty() => self.end_of_head(),
            State::Head { first: false } => {
                self.header_line(line);
                State::Head { first: false }
            }
            // A cut size line could hide digits (`000…05` reads as 0): stop following.
            State::ChunkSize if self.line_cut => self.lose(),
            State::ChunkSize => match chunk_size(line) {
                Some(0) => State::Trailers,
                Some(size) => State::ChunkData(size.saturating_add(2)),
                None => self.lose(),
            },
            State::Trailers if line.is_empty() => State::Between,
            other => other,
        };
        self.line_len = 0;
        self.line_cut = false;
        self.cr = false;
    }

    fn header_line(&mut self, line: &[u8]) {
        // Only three names matter: most lines are ruled out by their first byte, and a
        // colon further in than 17 bytes cannot end one of them.
        if !matches!(line.first(), Some(b'c' | b'C' | b't' | b'T' | b'u' | b'U')) {
            return;
        }
        let Some(colon) = line.iter().take(18).position(|&b| b == b':') else {
            return;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-length") {
            self.head.repeated_length |= self.head.has_content_length;
            self.head.long_field |= self.line_cut;
            self.head.has_content_length = true;
            // `5, 5` is one length said twice; hyper refuses lists that disagree.
            let first = value.split(|&b| b == b',').next().unwrap_or_default();
            self.head.content_length = std::str::from_utf8(trim(first))
                .ok()
                .and_then(|v| v.parse().ok());
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            self.head.long_field |= self.line_cut;
            // hyper accepts any list that ends in `chunked`, over one line or several.
            self.head.plain_chunked =
                !self.head.transfer_encoding && trim(value).eq_ignore_ascii_case(b"chunked");
            self.head.transfer_encoding = true;
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            self.head.upgrade = true;
        }
    }

    /// Whether the bytes so far end inside a request body (its trailers included): the
    /// client is still sending one. Never once the watch has stopped (HTTP/2, an upgrade or
    /// `CONNECT`, whose bytes may be a tunnel's, framing it could not follow).
    pub fn in_body(&self) -> bool {
        matches!(
            self.state,
            State::Sized(_) | State::ChunkSize | State::ChunkData(_) | State::Trailers
        )
    }

    /// Whether the bytes so far end inside a request head: from its first byte (an empty
    /// line before its request line included) until its empty line; over HTTP/2, inside a
    /// header block. Never once the watch has stopped, nor inside HTTP/2's preface.
    pub fn in_head(&self) -> bool {
        match self.state {
            State::Head { .. } => true,
            State::Http2 => self.frames.in_block,
            _ => false,
        }
    }

    /// Inside a head that has only empty lines so far (RFC 9112 §2.2: no request begun).
    pub fn blank_so_far(&self) -> bool {
        matches!(self.state, State::Head { first: true })
            && self.line[..self.line_len].iter().all(|&b| b == b'\r')
    }

    /// The connection opened with HTTP/2's preface: hyper serves it as HTTP/2, and the
    /// watch has nothing more to follow.
    pub fn is_http2(&self) -> bool {
        self.http2
    }

    /// `n` bytes went out to the client: over HTTP/2, room in its frame budget.
    pub fn wrote(&mut self, n: usize) {
        if self.state == State::Http2 {
            self.frames.budget.wrote(n);
        }
    }

    /// An HTTP/2 client has sent more frames that carry no request than its budget allows,
    /// given what its requests have earned (see [`flood`](super::flood)): the connection is
    /// to be closed.
    pub(in crate::proxy) fn flooded(&mut self, credit: Credit) -> bool {
        self.state == State::Http2 && self.frames.budget.spent(credit)
    }

    /// Stops following: see the module's documentation for what becomes of the connection.
    fn lose(&mut self) -> State {
        self.found.lost_at.store(self.heads.max(1), Relaxed);
        State::Off
    }

    fn end_of_head(&mut self) -> State {
        let head = self.head;
        let too_large = std::mem::take(&mut self.head_len) > MAX_HEAD;
        let refusal = if too_large {
            Some(Refusal::HeadTooLarge)
        } else if head.has_content_length && head.transfer_encoding {
            Some(Refusal::BothLengths)
        } else if head.long_field {
            Some(Refusal::LongFramingField)
        } else if head.repeated_length {
            Some(Refusal::RepeatedLength)
        } else if head.transfer_encoding && !head.plain_chunked {
            Some(Refusal::TransferCoding)
        } else if head.content_length.is_some_and(|n| n > i64::MAX as u64) {
            Some(Refusal::HugeLength)
        } else {
            None
        };
        if let Some(refusal) = refusal {
            // Only the first matters: the connection closes after that request.
            let (this, none) = ((self.heads << 8) | refusal.code(), 0);
            let _ = self
                .found
                .flagged
                .compare_exchange(none, this, Relaxed, Relaxed);
        }
        if head.upgrade {
            // The bytes after a 101 are not HTTP; whether one comes is not known here.
            self.lose()
        } else if head.transfer_encoding {
            // hyper accepts only `chunked` last; anything else ends the connection.
            State::ChunkSize
        } else if !head.has_content_length {
            State::Between
        } else {
            match head.content_length {
                Some(0) => State::Between,
                Some(n) => State::Sized(n),
                // A length hyper refuses: the connection ends with its 400.
                None => self.lose(),
            }
        }
    }
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// The hex size at the start of a chunk-size line (extensions after `;` ignored). Leading
/// zeros are fine (hyper takes them); a size over `u64` is not.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits == 0 {
        return None;
    }
    let text = std::str::from_utf8(&line[..digits]).ok()?;
    u64::from_str_radix(text, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `step` bytes; which requests (1-based) were flagged.
    fn flagged(input: &[u8], step: usize, requests: usize) -> Vec<usize> {
        let (mut watch, verdicts) = watch();
        for piece in input.chunks(step) {
            watch.scan(piece);
        }
        (1..=requests)
            .filter(|_| verdicts.next_is_ambiguous())
            .collect()
    }

    const CLEAN: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
        e\r\nContent-Length\r\n0\r\nX-Trailer: 1\r\n\r\n\
        POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 26\r\n\r\nTransfer-Encoding: chunked\
        \r\n\nGET /c HTTP/1.1\nHost: x\n\n";

    #[test]
    fn clean_requests_pass_in_any_split() {
        for step in [1, 2, 3, 7, 64, 4096] {
            assert_eq!(flagged(CLEAN, step, 3), Vec::<usize>::new(), "step {step}");
        }
    }

    #[test]
    fn both_fields_flag_the_right_request() {
        let mut input = CLEAN.to_vec();
        input.extend_from_slice(
            b"POST /d HTTP/1.1\r\nHost: x\r\ncontent-length: 3\r\nTRANSFER-ENCODING: chunked\r\n\r\n0\r\n\r\n",
        );
        for step in [1, 5, 4096] {
            assert_eq!(flagged(&input, step, 4), vec![4], "step {step}");
        }
        let te_first =
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n";
        assert_eq!(flagged(te_first, 4096, 1), vec![1]);
    }

    /// A head of `len` bytes, from its request line to its empty line.
    fn head_of_len(len: usize) -> Vec<u8> {
        let mut head = b"GET / HTTP/1.1\r\nX-A: ".to_vec();
        head.resize(len - 4, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        head
    }

    /// A head over [`MAX_HEAD`] is refused as too large, whatever its split and whichever
    /// request it is; one of exactly `MAX_HEAD` is not, nor are the empty lines a client
    /// may send before a request line.
    #[test]
    fn heads_over_the_limit_are_too_large() {
        let too_large = Verdict {
            refusal: Some(Refusal::HeadTooLarge),
            last: false,
        };
        for step in [1, 7, 4096, 200_000] {
            let mut input = b"\r\n\r\n".to_vec();
            input.extend(head_of_len(MAX_HEAD));
            input.extend(head_of_len(MAX_HEAD + 1));
            assert_eq!(verdicts(&input, step, 2), [PASS, too_large], "step {step}");
            let twice = [head_of_len(MAX_HEAD), head_of_len(MAX_HEAD)].concat();
            assert_eq!(verdicts(&twice, step, 2), [PASS, PASS], "step {step}");
            let mut input = head_of_len(100);
            input.extend(head_of_len(2 * MAX_HEAD));
            assert_eq!(verdicts(&input, step, 2), [PASS, too_large], "step {step}");
        }
    }

    /// Each request's verdict, as the service would get them.
    fn verdicts(input: &[u8], step: usize, requests: usize) -> Vec<Verdict> {
        let (mut watch, verdicts) = watch();
        for piece in input.chunks(step) {
            watch.scan(piece);
        }
        (0..requests).map(|_| verdicts.next_verdict()).collect()
    }

    const PASS: Verdict = Verdict {
        refusal: None,
        last: false,
    };
    const LAST: Verdict = Verdict {
        refusal: None,
        last: true,
    };
    const UNFOLLOWED: Verdict = Verdict {
        refusal: Some(Refusal::Unfollowed),
        last: false,
    };

    #[test]
    fn http2_is_left_alone() {
        let h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0Content-Length: 1\r\nTransfer-Encoding: x\r\n\r\n";
        assert_eq!(verdicts(h2, 4096, 3), [PASS; 3]);
    }

    /// Over HTTP/2 a head is a header block: from the fourth byte of a HEADERS frame (its
    /// type) to the end of the frame that says END_HEADERS, CONTINUATIONs included; other
    /// frames are no head, nor are trailers (a HEADERS frame on a stream already open),
    /// once the frame's header shows its stream. However the bytes are split.
    #[test]
    fn an_http2_header_block_is_a_head() {
        fn frame(kind: u8, flags: u8, stream: u8, payload: &[u8]) -> Vec<u8> {
            let len = payload.len() as u8;
            let mut f = vec![0, 0, len, kind, flags, 0, 0, 0, stream];
            f.extend_from_slice(payload);
            f
        }
        let mut bytes = H2_PREFACE.to_vec();
        let mut heads = Vec::new();
        // `head`: the frame opens a head (`Some(true)`), is a head's last (`Some(false)`),
        // or neither; trailers are taken for one only until their stream is read.
        for (kind, flags, stream, payload, opens, closes) in [
            (0x4, 0, 0, &b"\0\x03\0\0\0\x64"[..], false, false), // SETTINGS
            (0x1, 0x0, 1, b"\x82\x86", true, false),             // HEADERS
            (0x9, 0, 1, b"", false, false),                      // CONTINUATION, empty
            (0x9, 0x4, 1, b"\x84", false, true),                 // CONTINUATION, END_HEADERS
            (0x0, 0x0, 1, b"hello", false, false),               // DATA
            (0x1, 0x5, 3, b"\x82\x86\x84", true, true),          // HEADERS, whole
            (0x1, 0x1, 1, b"\x40\x01", false, false),            // trailers, open
            (0x9, 0x4, 1, b"\x61\x00", false, false),            // their end
        ] {
            let start = bytes.len();
            if opens {
                heads.push((start + 4, 0));
            }
            bytes.extend(frame(kind, flags, stream, payload));
            if closes {
                heads.last_mut().unwrap().1 = bytes.len();
            }
            if kind == 0x1 && !opens {
                heads.push((start + 4, start + 9));
            }
        }
        let expected = |seen: usize| heads.iter().any(|&(from, to)| seen >= from && seen < to);
        for piece in 1..=7 {
            let (mut watch, _verdicts) = watch();
            let mut seen = 0;
            for chunk in bytes.chunks(piece) {
                watch.scan(chunk);
                seen += chunk.len();
                assert_eq!(watch.in_head(), expected(seen), "{seen} bytes in {piece}s");
            }
            assert!(watch.is_http2());
        }
    }

    /// hyper-util serves HTTP/2 only when the connection opens with the exact preface; a
    /// head with the method `PRI` is an ordinary HTTP/1 request to hyper, and so it is to
    /// the watch: its own framing and that of the requests after it are checked.
    #[test]
    fn only_the_exact_preface_is_http2() {
        let pri = "PRI /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let after: [(&str, Refusal); 3] = [
            (
                "POST /s HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                Refusal::BothLengths,
            ),
            (
                "POST /g HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                Refusal::TransferCoding,
            ),
            (
                "POST /d HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
                Refusal::RepeatedLength,
            ),
        ];
        // Heads that start as the preface does, up to a point.
        for first in [pri, "PRI * HTTP/1.1\r\nHost: x\r\n\r\n"] {
            for (second, want) in after {
                let input = format!("{first}{second}");
                for step in [1, 5, 23, 24, 4096] {
                    assert_eq!(
                        refusals(input.as_bytes(), step, 2),
                        vec![(2, want)],
                        "{first:?} then {second:?}, step {step}"
                    );
                }
            }
        }
        // The `PRI` head's own framing is checked too.
        let both =
            "PRI /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(
            refusals(both.as_bytes(), 4096, 1),
            vec![(1, Refusal::BothLengths)]
        );
        // All of the preface's request line and less than the rest: hyper reads HTTP/1 and
        // refuses the version; the watch follows nothing after it.
        let almost = "PRI * HTTP/2.0\r\n\r\nSX\r\n\r\n";
        let input = format!("{almost}{}", after[0].0);
        for step in [1, 20, 4096] {
            assert_eq!(
                verdicts(input.as_bytes(), step, 2),
                [LAST, UNFOLLOWED],
                "step {step}"
            );
        }
        // The exact preface, however it arrives, is HTTP/2.
        for step in [1, 2, 23, 4096] {
            let h2 = [H2_PREFACE, after[0].0.as_bytes()].concat();
            assert_eq!(verdicts(&h2, step, 2), [PASS; 2], "step {step}");
        }
    }

    /// hyper keeps the connection after a refused CONNECT or upgrade: what the watch could
    /// not follow ends the connection's HTTP/1 use at that request, and whatever comes
    /// after it is refused, clean or not.
    #[test]
    fn what_it_cannot_follow_is_the_last_request_served() {
        let smuggled =
            "POST /s HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let clean = "GET /c HTTP/1.1\r\n\r\n";
        let long_line = format!("5;{}", "x".repeat(LINE_CAP));
        let zeros = format!("{}5", "0".repeat(LINE_CAP));
        let chunked = "POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let cases: [(&str, String); 11] = [
            ("CONNECT", "CONNECT a:1 HTTP/1.1\r\nHost: x\r\n\r\n".into()),
            (
                "upgrade",
                "GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n".into(),
            ),
            (
                "upgrade with a body",
                "POST /ws HTTP/1.1\r\nUpgrade: x\r\nContent-Length: 2\r\n\r\nhi".into(),
            ),
            (
                "long chunk-size line",
                format!("POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{long_line}\r\nhello\r\n0\r\n\r\n"),
            ),
            (
                "chunk size hidden by zeros",
                format!("POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{zeros}\r\nhello\r\n0\r\n\r\n"),
            ),
            (
                "bad chunk size",
                "POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n".into(),
            ),
            (
                "a late HTTP/2 preface",
                "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".into(),
            ),
            // hyper's trailer section goes on past these, up to a CRLF CRLF.
            (
                "bare LF ending the trailers",
                format!("{chunked}0\r\nX: a\r\n\n"),
            ),
            (
                "bare LF right after the last chunk",
                format!("{chunked}1\r\nx\r\n0\r\n\n"),
            ),
            (
                "bare LF ending a trailer line",
                format!("{chunked}0\r\nX: a\n\r\n"),
            ),
            (
                "bare LF ending a chunk-size line",
                format!("{chunked}5\nhello\r\n0\r\n\r\n"),
            ),
        ];
        for (name, first) in &cases {
            for second in [smuggled, clean] {
                // After a clean request, so that the lost one is not the connection's first.
                let input = format!("{clean}{first}{second}{clean}");
                for step in [1, 3, 4096] {
                    assert_eq!(
                        verdicts(input.as_bytes(), step, 4),
                        [PASS, LAST, UNFOLLOWED, UNFOLLOWED],
                        "{name}, then {second:?}, step {step}"
                    );
                }
            }
        }
        // A refusal in the head that was lost wins.
        let both = "GET /ws HTTP/1.1\r\nUpgrade: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            verdicts(format!("{both}{clean}").as_bytes(), 4096, 2),
            [
                Verdict {
                    refusal: Some(Refusal::BothLengths),
                    last: true
                },
                UNFOLLOWED
            ]
        );
    }

    /// The refusal of each request (1-based) that has one.
    fn refusals(input: &[u8], step: usize, requests: usize) -> Vec<(usize, Refusal)> {
        let (mut watch, verdicts) = watch();
        for piece in input.chunks(step) {
            watch.scan(piece);
        }
        (1..=requests)
            .filter_map(|n| verdicts.next_refusal().map(|r| (n, r)))
            .collect()
    }

    #[test]
    fn other_framings_hyper_accepts_are_refused() {
        let cases: [(&[u8], Refusal); 8] = [
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\nhello",
                Refusal::RepeatedLength,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
                Refusal::TransferCoding,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                Refusal::TransferCoding,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding:                                             chunked\r\n\r\n0\r\n\r\n",
                Refusal::LongFramingField,
            ),
            // Cut at the line cap, the digits kept would read 0.
            (
                b"POST / HTTP/1.1\r\nContent-Length: 00000000000000000000000000000000000000000000000000000005\r\n\r\nhello",
                Refusal::LongFramingField,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                Refusal::BothLengths,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 9223372036854775808\r\n\r\nhello",
                Refusal::HugeLength,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 18446744073709551613\r\n\r\nhello",
                Refusal::HugeLength,
            ),
        ];
        for (input, want) in cases {
            for step in [1, 3, 4096] {
                assert_eq!(
                    refusals(input, step, 1),
                    vec![(1, want)],
                    "{:?}",
                    String::from_utf8_lossy(input)
                );
            }
        }
        // Plain chunked in any case with OWS, and a chunk size with many leading zeros, are
        // followed: the smuggling attempt after them is still caught.
        let input = b"POST /a HTTP/1.1\r\nTransfer-Encoding:  Chunked \r\n\r\n\
            000000000000000000000005\r\nhello\r\n0\r\n\r\n\
            POST /b HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello";
        for step in [1, 7, 4096] {
            assert_eq!(refusals(input, step, 2), vec![(2, Refusal::RepeatedLength)]);
        }
        let most = b"POST / HTTP/1.1\r\nContent-Length: 9223372036854775807\r\n\r\n";
        assert_eq!(refusals(most, 4096, 1), vec![]);
    }

    /// The listener times a head from its first byte to its empty line, and an idle
    /// connection not at all: after each read the watch says which it is in.
    #[test]
    fn a_head_is_in_progress_from_its_first_byte_to_its_empty_line() {
        let (mut watch, _verdicts) = watch();
        let reads: [(&str, bool); 9] = [
            ("G", true),
            ("ET / HTTP/1.1\r\nHost: x\r\n", true),
            ("\r\n", false),
            // An empty line before a request line is part of the next head's time.
            ("\r\n", true),
            ("POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n", false),
            ("h", false),
            // The body's end and the next head's first byte in one read.
            ("iP", true),
            (
                "UT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                false,
            ),
            // Not followed any further: not timed by the watch.
            ("CONNECT a:1 HTTP/1.1\r\nHost: x", false),
        ];
        for (read, in_head) in reads {
            watch.scan(read.as_bytes());
            assert_eq!(watch.in_head(), in_head, "after {read:?}");
        }
    }

    #[test]
    fn long_lines_are_bounded() {
        let mut input = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
        input.extend(std::iter::repeat_n(b'a', 100_000));
        input.extend_from_slice(b"\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(flagged(&input, 1000, 1), vec![1]);
    }
}
