//! The HTTP/2 frame budget: how many bytes of frames that carry no request a client may
//! send on one connection before it is closed.
//!
//! h2 (the library) takes PING, SETTINGS, PRIORITY, WINDOW_UPDATE and RST_STREAM on a closed
//! stream as fast as a client sends them, and answers the first two: frames of 13-17
//! bytes, millions a second from a client that writes one buffer over and over, and a
//! core of the proxy's for as long as it goes on (CVE-2019-9512, -9513, -9514, -9515).
//! nginx closes such a connection ("http2 flood detected") once the bytes it has read,
//! divided by 8, pass the bytes of requests in them (header blocks and bodies) by more than
//! 1 MiB. So does the proxy (a header block counts only when it opens a stream: see
//! [`FrameBudget::frame`]), with two differences:
//! - a body's bytes count once the proxy has taken them (the listener's body wrapper tells
//!   it), not as their DATA frames arrive: h2 drops DATA on a stream already reset, and a
//!   client credited for such frames flooded PRIORITY frames between them without end.
//!   A body the proxy drops before its end (answered without it: a 400, a 413, an
//!   upstream down) lets up to a stream window of the DATA read beyond the bodies taken,
//!   what its client had on the way, cost nothing: without it, a client whose uploads
//!   were refused was closed after some 8 MiB of them. Forgiven, not credited as a body
//!   taken (which earns eight times its bytes): that let each refused request buy 7 MiB
//!   of flood;
//! - what the proxy has written to the client earns room too, a 256th of it. nginx rotates
//!   an HTTP/2 connection after 1 000 requests; the proxy does not, and a client
//!   downloading over one connection for days sends WINDOW_UPDATEs (26 bytes per 16 KiB
//!   frame taken, from clients that answer each) that would reach nginx's bound after some
//!   5 GiB. A 256th: a sixteenth let a 1 GB download buy four seconds of a core's flood.
//!
//! A PING or SETTINGS flood earns next to nothing by its answers, and is closed.
//!
//! A gap remains: a header block that opens a stream earns its bytes as it is read, also
//! when h2 refuses it itself (decoded over `H2_MAX_HEAD_LIST`: h2 answers 431; past the
//! stream limit; malformed) and no request reaches the handler, so a client sending
//! such blocks between its control frames is not closed (a review sent 310 KB blocks,
//! each buying 2 MB of PRIORITY frames). nginx credits a head when its request runs
//! (`ngx_http_v2_run_request`): the fix is to do the same, crediting a head's size as the
//! listener's service receives it (through the connection's clocks, as bodies are) and
//! nothing in the watch.
//!
//! The budget is kept by the framing watch (`framing::Frames`), which follows every frame's
//! header on its way into hyper, and by the listener's IO wrapper for the bytes written.

/// The room every connection starts with: 8 MiB of frames that carry no request.
const ALLOWANCE: u64 = 1 << 20;

/// Bytes read earn their cost divided by this.
const READ_COST: u64 = 8;

/// Bytes written earn room divided by this.
const WRITE_SHARE: u64 = 256;

/// One HTTP/2 connection's budget.
#[derive(Debug, Default)]
pub(super) struct FrameBudget {
    /// Every byte of frames read (headers and payloads).
    read: u64,
    /// Payload bytes of header blocks: HEADERS and CONTINUATION frames.
    heads: u64,
    /// Payload bytes of DATA frames.
    data: u64,
    /// Bytes written to the client.
    written: u64,
}

impl FrameBudget {
    const DATA: u8 = 0x0;
    const HEADERS: u8 = 0x1;
    const CONTINUATION: u8 = 0x9;

    /// `n` bytes of frames (headers or payload) were read.
    pub(super) fn read(&mut self, n: usize) {
        self.read = self.read.saturating_add(n as u64);
    }

    /// A frame's header announced `len` bytes of payload of type `kind`; `trailers`: it is
    /// part of a header block on a stream already opened. Only a block that opens a stream
    /// is a request's head: h2 ignores trailers on a stream it has reset, for as long as
    /// a client sends them, and a 15 KB field in each bought 100 KB of PRIORITY frames
    /// without end.
    pub(super) fn frame(&mut self, kind: u8, len: usize, trailers: bool) {
        if trailers {
            return;
        }
        if matches!(kind, Self::HEADERS | Self::CONTINUATION) {
            self.heads = self.heads.saturating_add(len as u64);
        } else if kind == Self::DATA {
            self.data = self.data.saturating_add(len as u64);
        }
    }

    /// `n` bytes went out to the client.
    pub(super) fn wrote(&mut self, n: usize) {
        self.written = self.written.saturating_add(n as u64);
    }

    /// The client has spent its room: the connection is to be closed. `taken`: the bytes
    /// of its request bodies the proxy has taken; `refunds`: a stream window for each body
    /// it dropped before its end, up to which the DATA read beyond `taken` (what the
    /// client had on the way, which h2 drops as it comes) costs nothing. Not credited as a
    /// body taken: a refused request whose stream is then fed its window of DATA bought
    /// 7 MiB of flood, and refunds pool across a connection's streams.
    pub(super) fn spent(&self, taken: u64, refunds: u64) -> bool {
        let dropped = taken
            .saturating_add(refunds)
            .min(self.data)
            .saturating_sub(taken);
        let earned = self.heads.saturating_add(taken);
        let earned = earned.saturating_add(dropped / READ_COST);
        let earned = earned.saturating_add(self.written / WRITE_SHARE);
        self.read / READ_COST > earned.saturating_add(ALLOWANCE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: u8 = 0x0;
    const PING: (u8, usize) = (0x6, 8);
    const SETTINGS: (u8, usize) = (0x4, 0);
    const PRIORITY: (u8, usize) = (0x2, 5);
    const WINDOW_UPDATE: (u8, usize) = (0x8, 4);
    const RST_STREAM: (u8, usize) = (0x3, 4);

    /// Feeds `(kind, payload length)` frames, each followed by `answer` bytes written,
    /// until the budget is spent or `max` frames went in: the bytes read by then, if spent.
    /// DATA frames' payloads are taken as they come when `taken`.
    fn read_until_spent(
        frames: &[(u8, usize)],
        answer: usize,
        max: u64,
        taken: bool,
    ) -> Option<u64> {
        let mut budget = FrameBudget::default();
        let mut bodies = 0;
        for n in 0..max {
            let (kind, len) = frames[(n as usize) % frames.len()];
            budget.frame(kind, len, false);
            budget.read(9 + len);
            if kind == DATA && taken {
                bodies += len as u64;
            }
            budget.wrote(answer);
            if budget.spent(bodies, 0) {
                return Some(budget.read);
            }
        }
        None
    }

    #[test]
    fn floods_of_frames_that_carry_no_request_are_closed() {
        const MAX: u64 = 10_000_000;
        for (what, frames, answer) in [
            ("PRIORITY", &[PRIORITY][..], 0),
            ("WINDOW_UPDATE", &[WINDOW_UPDATE], 0),
            ("RST_STREAM", &[RST_STREAM], 0),
            ("PING, answered", &[PING], 17),
            ("SETTINGS, answered", &[SETTINGS], 9),
            (
                "all",
                &[PING, SETTINGS, PRIORITY, WINDOW_UPDATE, RST_STREAM],
                5,
            ),
        ] {
            let read = read_until_spent(frames, answer, MAX, true);
            let read = read.unwrap_or_else(|| panic!("{what}: never closed"));
            // nginx's allowance, 8 MiB, and little more for those answered.
            let closed = (8 << 20..9 << 20).contains(&read);
            assert!(closed, "{what}: closed after {read}");
        }
    }

    /// DATA that h2 drops (on a stream already reset) is no body taken: PRIORITY frames
    /// between such frames are still a flood. Taken, the same DATA earns their room.
    #[test]
    fn data_earns_room_only_as_it_is_taken() {
        let frames = [(DATA, 16 << 10), PRIORITY, PRIORITY, PRIORITY, PRIORITY];
        let dropped = read_until_spent(&frames, 0, 10_000_000, false);
        assert!(dropped.is_some_and(|read| read < 9 << 20), "{dropped:?}");
        assert_eq!(read_until_spent(&frames, 0, 10_000_000, true), None);
    }

    /// Bodies dropped before their end (the proxy answered without them: a 400, a 413, an
    /// upstream down): the DATA their client still had on the way, up to a stream window
    /// each, costs nothing; DATA past that on their streams costs as any frame does.
    #[test]
    fn dropped_bodies_refund_a_window_of_data_each() {
        let window = 1 << 20;
        let read_data = |budget: &mut FrameBudget, bytes: usize| {
            for _ in 0..bytes / (16 << 10) {
                budget.frame(DATA, 16 << 10, false);
                budget.read(9 + (16 << 10));
            }
        };
        // 40 uploads refused, each with a window on the way.
        let mut refused = FrameBudget::default();
        for _ in 0..40 {
            refused.frame(FrameBudget::HEADERS, 30, false);
            refused.read(39);
            read_data(&mut refused, window as usize);
        }
        assert!(!refused.spent(0, 40 * window));
        assert!(refused.spent(0, 0));
        // One refused, and its stream fed 100 MiB more.
        let mut fed = FrameBudget::default();
        read_data(&mut fed, 100 << 20);
        assert!(fed.spent(0, window));
        assert!(!fed.spent(100 << 20, 0));
        // Refused requests, each followed by its window of DATA and 7 MiB of PRIORITY
        // frames: a refund buys no flood.
        let mut farmed = FrameBudget::default();
        let farmed_at = (1..=10).find(|&n| {
            farmed.frame(FrameBudget::HEADERS, 30, false);
            farmed.read(39);
            read_data(&mut farmed, window as usize);
            for _ in 0..(7 << 20) / 14 {
                farmed.frame(PRIORITY.0, PRIORITY.1, false);
                farmed.read(14);
            }
            farmed.spent(0, n * window)
        });
        assert_eq!(farmed_at, Some(2));
    }

    /// An upload: 2 GiB in 16 KiB DATA frames, taken, the proxy's WINDOW_UPDATE written
    /// for each.
    #[test]
    fn an_upload_is_no_flood() {
        let frames = [(DATA, 16 << 10)];
        assert_eq!(read_until_spent(&frames, 13, 2 << 16, true), None);
    }

    /// 6 GiB downloaded over one connection in 16 KiB DATA frames, with a WINDOW_UPDATE
    /// for the stream and one for the connection for every frame taken, and a stream
    /// opened and reset for every MiB: no flood.
    #[test]
    fn a_long_download_with_its_window_updates_is_no_flood() {
        let mut budget = FrameBudget::default();
        let frames: u64 = 6 * (1 << 30) / (16 << 10);
        for n in 0..frames {
            budget.wrote(9 + (16 << 10));
            for (kind, len) in [WINDOW_UPDATE, WINDOW_UPDATE] {
                budget.frame(kind, len, false);
                budget.read(9 + len);
            }
            if n % 64 == 0 {
                for (kind, len) in [(FrameBudget::HEADERS, 20), RST_STREAM] {
                    budget.frame(kind, len, false);
                    budget.read(9 + len);
                }
            }
            assert!(!budget.spent(0, 0), "spent after {n} frames");
        }
    }

    /// Requests that are all overhead: a small header block (HPACK-indexed), cancelled at
    /// once, a PING for each, and no more than a 30-byte answer head: ten million of them.
    #[test]
    fn small_requests_with_their_resets_and_pings_are_no_flood() {
        let frames = [(FrameBudget::HEADERS, 6), RST_STREAM, PING];
        assert_eq!(read_until_spent(&frames, 20, 30_000_000, true), None);
    }

    #[test]
    fn counts_saturate() {
        let mut budget = FrameBudget::default();
        budget.read(usize::MAX);
        budget.read(usize::MAX);
        budget.frame(FrameBudget::HEADERS, usize::MAX, false);
        budget.frame(FrameBudget::CONTINUATION, usize::MAX, false);
        budget.wrote(usize::MAX);
        budget.frame(DATA, usize::MAX, false);
        assert!(!budget.spent(u64::MAX, u64::MAX));
    }
}
