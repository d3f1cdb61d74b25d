//! The HTTP/2 frame budget: how many bytes of frames that carry no request a client may
//! send on one connection before it is closed.
//!
//! h2 (the library) takes PING, SETTINGS, PRIORITY, WINDOW_UPDATE and RST_STREAM on a closed
//! stream as fast as a client sends them, and answers the first two: frames of 13-17
//! bytes, millions a second from a client that writes one buffer over and over, and a
//! core of the proxy's for as long as it goes on (CVE-2019-9512, -9513, -9514, -9515).
//! nginx closes such a connection ("http2 flood detected") once the bytes it has read,
//! divided by 8, pass the bytes of requests in them (header blocks and bodies) by more than
//! 1 MiB. So does the proxy, with five differences:
//! - a request's head counts once the listener's service has it (as nginx counts a head
//!   when its request runs), as its size decoded, up to [`HEAD_CAP`]: not its header
//!   block as it is read. h2 refuses some blocks itself (over `H2_MAX_HEAD_LIST` decoded,
//!   which it answers 431; past the stream limit; malformed; trailers on a stream it has
//!   reset, which it ignores for as long as they come), and no request follows them: a
//!   client credited for them sent 310 KB blocks, each buying 2 MB of PRIORITY frames,
//!   without end. Decoded, not compressed (hyper hands over no block's size), and so
//!   capped: HPACK names a field indexed once in a byte or two;
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
//!   5 GiB. A 256th: a sixteenth let a 1 GB download buy four seconds of a core's flood;
//! - what a connection earns fills its room only up to the 1 MiB it started with (see
//!   [`FrameBudget::spent`]): nginx's totals run for a connection's life, which its
//!   rotation bounds; without the bound 20 000 cheap requests, sent in 0.4 s, bought 1.3
//!   GB of PRIORITY frames: 10 s of a core;
//! - a SETTINGS frame weighs more than its bytes ([`SETTINGS_WEIGHT`]): h2 walks every
//!   open stream for one.
//!
//! A PING or SETTINGS flood earns next to nothing by its answers, and is closed.
//!
//! The framing watch (`framing::Frames`) keeps the budget as it follows every frame's
//! header on its way into hyper; the connection's clocks say what its requests have
//! earned ([`Credit`]), and the listener's IO wrapper counts the bytes written.

use http::Request;

/// The room every connection starts with: 8 MiB of frames that carry no request.
const ALLOWANCE: u64 = 1 << 20;

/// Bytes read earn their cost divided by this.
const READ_COST: u64 = 8;

/// Bytes written earn room divided by this.
const WRITE_SHARE: u64 = 256;

/// What a SETTINGS frame costs beyond its bytes, counted as bytes read. One that changes
/// INITIAL_WINDOW_SIZE makes h2 walk every open stream: with 99 streams held open (400s
/// whose bodies the client's zero window kept back), 15-byte frames toggling it cost eight
/// times the CPU per byte of PRIORITY frames, and a connection's allowance 0.7 s of a core
/// instead of 0.06. So weighted, each costs about what the same CPU in PRIORITY frames
/// does; a client sends one or two on a connection.
const SETTINGS_WEIGHT: u64 = 256;

/// The most a request's head earns: an eighth of [`MAX_HEAD`](super::listener::MAX_HEAD),
/// so that every head the proxy serves, however little HPACK compressed it, pays for its
/// own bytes read. More would let a client that names one indexed 4 KiB field sixty times
/// (a hundred bytes) buy half a MiB of flood with each request.
pub(super) const HEAD_CAP: u64 = super::listener::MAX_HEAD as u64 / READ_COST;

/// What a connection's requests have earned so far, as the listener counts them (see
/// [`Activity::credit`](super::listener::Activity::credit)).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(in crate::proxy) struct Credit {
    /// Bytes of the request heads the listener's service has received, each as
    /// [`head_credit`] counts it.
    pub heads: u64,
    /// Bytes of request bodies the proxy has taken.
    pub taken: u64,
    /// A stream window for each request body the proxy dropped before its end: up to this
    /// much of the DATA read beyond `taken` (what the client had on the way, which h2
    /// drops as it comes) costs nothing.
    pub refunds: u64,
}

/// What a request's head earns: its size as h2 decoded it (method, URI, and each field's
/// name and value), up to [`HEAD_CAP`].
pub(in crate::proxy) fn head_credit<B>(req: &Request<B>) -> u64 {
    let uri = req.uri();
    let mut size = req.method().as_str().len()
        + uri.scheme_str().map_or(0, str::len)
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len());
    for (name, value) in req.headers() {
        if size as u64 >= HEAD_CAP {
            break;
        }
        size += name.as_str().len() + value.len();
    }
    (size as u64).min(HEAD_CAP)
}

/// One HTTP/2 connection's budget.
#[derive(Debug)]
pub(super) struct FrameBudget {
    /// Every byte of frames read (headers and payloads).
    read: u64,
    /// Payload bytes of DATA frames.
    data: u64,
    /// Bytes written to the client.
    written: u64,
    /// What the connection had earned, and what its reads had cost, at the last look.
    earned: u64,
    cost: u64,
    /// The room left: [`ALLOWANCE`] at the start, and never more.
    room: u64,
    /// The room ran out: the connection is to be closed.
    spent: bool,
}

impl Default for FrameBudget {
    fn default() -> Self {
        FrameBudget {
            read: 0,
            data: 0,
            written: 0,
            earned: 0,
            cost: 0,
            room: ALLOWANCE,
            spent: false,
        }
    }
}

impl FrameBudget {
    const DATA: u8 = 0x0;
    const SETTINGS: u8 = 0x4;

    /// `n` bytes of frames (headers or payload) were read.
    pub(super) fn read(&mut self, n: usize) {
        self.read = self.read.saturating_add(n as u64);
    }

    /// A frame's header announced `len` bytes of payload of type `kind`. Of the frames
    /// read, DATA is kept apart (for the bodies dropped: see [`FrameBudget::spent`]) and
    /// SETTINGS weighs more ([`SETTINGS_WEIGHT`]); a header block earns nothing here, but
    /// as its request reaches the listener.
    pub(super) fn frame(&mut self, kind: u8, len: usize) {
        if kind == Self::DATA {
            self.data = self.data.saturating_add(len as u64);
        } else if kind == Self::SETTINGS {
            self.read = self.read.saturating_add(SETTINGS_WEIGHT);
        }
    }

    /// `n` bytes went out to the client.
    pub(super) fn wrote(&mut self, n: usize) {
        self.written = self.written.saturating_add(n as u64);
    }

    /// The client has spent its room, given what its requests have earned so far: the
    /// connection is to be closed (and stays so). What was earned since the last look
    /// fills the room, up to [`ALLOWANCE`], before what was read since costs it: nginx's
    /// totals, kept for a connection's life, let a client bank what 20 000 cheap requests
    /// earned (0.4 s of them) and spend it on 1.3 GB of PRIORITY frames, 10 s of a core
    /// (nginx closes a connection after 1 000 requests; the proxy does not). A request's
    /// own bytes come before its credit (a block before its request, DATA before its body
    /// is taken), so the bound takes nothing from a client whose frames each pay their way;
    /// a download's WINDOW_UPDATEs come after the DATA that earned their room. A client
    /// that acknowledges every DATA frame alone is closed on a long stream of frames under
    /// about 800 bytes (26 bytes of acknowledgement cost more than a 256th of the frame
    /// earns), as under nginx; httpx, curl and Node batch their acknowledgements.
    ///
    /// Refunds forgive DATA dropped, up to the DATA read beyond the bodies taken; they are
    /// not credited as a body taken: a refused request whose stream is then fed its window
    /// of DATA bought 7 MiB of flood, and refunds pool across a connection's streams.
    pub(super) fn spent(&mut self, credit: Credit) -> bool {
        let Credit {
            heads,
            taken,
            refunds,
        } = credit;
        let dropped = taken
            .saturating_add(refunds)
            .min(self.data)
            .saturating_sub(taken);
        let earned = heads.saturating_add(taken);
        let earned = earned.saturating_add(dropped / READ_COST);
        let earned = earned.saturating_add(self.written / WRITE_SHARE);
        let cost = self.read / READ_COST;
        let gain = earned.saturating_sub(self.earned);
        let charge = cost.saturating_sub(self.cost);
        (self.earned, self.cost) = (self.earned.max(earned), cost);
        self.room = self.room.saturating_add(gain).min(ALLOWANCE);
        self.spent |= charge > self.room;
        self.room = self.room.saturating_sub(charge);
        self.spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: u8 = 0x0;
    const HEADERS: u8 = 0x1;
    const CONTINUATION: u8 = 0x9;
    const PING: (u8, usize) = (0x6, 8);
    const SETTINGS: (u8, usize) = (0x4, 0);
    const PRIORITY: (u8, usize) = (0x2, 5);
    const WINDOW_UPDATE: (u8, usize) = (0x8, 4);
    const RST_STREAM: (u8, usize) = (0x3, 4);

    /// One frame read whole: its header and payload.
    fn read(budget: &mut FrameBudget, (kind, len): (u8, usize)) {
        budget.frame(kind, len);
        budget.read(9 + len);
    }

    /// Feeds `(kind, payload length)` frames, each followed by `answer` bytes written,
    /// until the budget is spent or `max` frames went in: the bytes read by then, if spent.
    /// DATA frames' payloads are taken as they come when `taken`; each HEADERS frame is a
    /// request whose head, decoded, is `head` bytes.
    fn read_until_spent(
        frames: &[(u8, usize)],
        answer: usize,
        max: u64,
        taken: bool,
        head: u64,
    ) -> Option<u64> {
        let mut budget = FrameBudget::default();
        let mut credit = Credit::default();
        for n in 0..max {
            let (kind, len) = frames[(n as usize) % frames.len()];
            read(&mut budget, (kind, len));
            if kind == DATA && taken {
                credit.taken += len as u64;
            }
            if kind == HEADERS {
                credit.heads += head;
            }
            budget.wrote(answer);
            if budget.spent(credit) {
                return Some(budget.read);
            }
        }
        None
    }

    /// SETTINGS frames weigh [`SETTINGS_WEIGHT`] more: a flood of them is closed after a
    /// sixteenth of the bytes of other frames; the two a connection opens with cost little.
    #[test]
    fn settings_frames_weigh_more() {
        // The bytes of `frame`s sent by the time the budget is spent.
        let closed_after = |frame: (u8, usize)| {
            let mut budget = FrameBudget::default();
            (1..10_000_000u64)
                .find(|_| {
                    read(&mut budget, frame);
                    budget.spent(Credit::default())
                })
                .map(|n| n * (9 + frame.1 as u64))
        };
        let settings = closed_after((0x4, 6)).expect("closed");
        let priority = closed_after(PRIORITY).expect("closed");
        assert!(settings * 16 < priority, "{settings} against {priority}");
        let mut budget = FrameBudget::default();
        read(&mut budget, (0x4, 18));
        read(&mut budget, SETTINGS);
        assert!(budget.read < 1024, "{}", budget.read);
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
            let read = read_until_spent(frames, answer, MAX, true, 0);
            let read = read.unwrap_or_else(|| panic!("{what}: never closed"));
            // nginx's allowance, 8 MiB, and little more for those answered.
            let closed = (8 << 20..9 << 20).contains(&read);
            assert!(closed, "{what}: closed after {read}");
        }
    }

    /// A header block earns nothing as it is read: h2 refuses some itself (too large
    /// decoded, past the stream limit, malformed, trailers on a stream it reset) and no
    /// request follows. 310 KB blocks, each followed by 2 MB of PRIORITY frames, are a
    /// flood; the same blocks as requests the listener receives, each earning its capped
    /// head, are too (a head earns at most `HEAD_CAP`); 15 KB blocks as requests, each
    /// followed by 40 KB of PRIORITY frames, are not.
    #[test]
    fn header_blocks_earn_only_as_their_requests_arrive() {
        let blocks = |size: usize, priorities: usize, head: Option<u64>| {
            let mut budget = FrameBudget::default();
            let mut credit = Credit::default();
            (1..=200).find(|_| {
                read(&mut budget, (HEADERS, size.min(16 << 10)));
                for piece in (16 << 10..size).step_by(16 << 10) {
                    read(&mut budget, (CONTINUATION, (size - piece).min(16 << 10)));
                }
                credit.heads += head.unwrap_or(0);
                for _ in 0..priorities / 14 {
                    read(&mut budget, PRIORITY);
                }
                budget.spent(credit)
            })
        };
        assert_eq!(blocks(310_000, 2_000_000, None), Some(4));
        assert_eq!(blocks(310_000, 2_000_000, Some(HEAD_CAP)), Some(4));
        assert_eq!(blocks(15_000, 40_000, Some(15_000.min(HEAD_CAP))), None);
        assert_eq!(blocks(15_000, 40_000, None), Some(153));
    }

    #[test]
    fn a_head_earns_its_size_decoded_up_to_a_cap() {
        let small = Request::get("https://api.example.com/sandboxes?limit=1")
            .header("x-api-key", "e2b_0123")
            .body(())
            .unwrap();
        assert_eq!(head_credit(&small), 3 + 5 + 15 + 18 + 9 + 8);
        let mut big = Request::get("/").body(()).unwrap();
        for n in 0..100 {
            let name = http::HeaderName::try_from(format!("x-{n}")).unwrap();
            big.headers_mut()
                .insert(name, "v".repeat(1000).parse().unwrap());
        }
        assert_eq!(head_credit(&big), HEAD_CAP);
    }

    /// DATA that h2 drops (on a stream already reset) is no body taken: PRIORITY frames
    /// between such frames are still a flood. Taken, the same DATA earns their room.
    #[test]
    fn data_earns_room_only_as_it_is_taken() {
        let frames = [(DATA, 16 << 10), PRIORITY, PRIORITY, PRIORITY, PRIORITY];
        let dropped = read_until_spent(&frames, 0, 10_000_000, false, 0);
        assert!(dropped.is_some_and(|read| read < 9 << 20), "{dropped:?}");
        assert_eq!(read_until_spent(&frames, 0, 10_000_000, true, 0), None);
    }

    /// Bodies dropped before their end (the proxy answered without them: a 400, a 413, an
    /// upstream down): the DATA their client still had on the way, up to a stream window
    /// each, costs nothing; DATA past that on their streams costs as any frame does.
    #[test]
    fn dropped_bodies_refund_a_window_of_data_each() {
        let window = 1 << 20;
        // `bytes` of DATA in 16 KiB frames, the budget looked at after each: spent?
        let read_data = |budget: &mut FrameBudget, bytes: u64, credit: Credit| {
            (0..bytes / (16 << 10)).any(|_| {
                read(budget, (DATA, 16 << 10));
                budget.spent(credit)
            })
        };
        let refunded = |refunds| Credit {
            refunds,
            ..Credit::default()
        };
        // 40 uploads refused, each with a window on the way.
        let refused = |refund: u64| {
            let mut budget = FrameBudget::default();
            (1..=40).any(|n| {
                read(&mut budget, (HEADERS, 30));
                read_data(&mut budget, window, refunded(n * refund))
            })
        };
        assert!(!refused(window));
        assert!(refused(0));
        // One refused, and its stream fed 100 MiB more.
        let mut fed = FrameBudget::default();
        assert!(read_data(&mut fed, 100 << 20, refunded(window)));
        // Refused requests, each followed by its window of DATA and 7 MiB of PRIORITY
        // frames: a refund buys no flood.
        let mut farmed = FrameBudget::default();
        let farmed_at = (1..=10).find(|&n| {
            read(&mut farmed, (HEADERS, 30));
            let credit = refunded(n * window);
            read_data(&mut farmed, window, credit)
                || (0..(7 << 20) / 14).any(|_| {
                    read(&mut farmed, PRIORITY);
                    farmed.spent(credit)
                })
        });
        assert_eq!(farmed_at, Some(2));
    }

    /// What requests earned is not banked past the room a connection starts with: 20 000
    /// cheap requests (25-byte blocks whose heads, HPACK-indexed, earn 8 KiB each) and
    /// then PRIORITY frames alone are closed after 8 MiB of them, as a flood without
    /// the requests is. With nginx's totals the requests bought 1.3 GB of flood.
    #[test]
    fn earnings_are_not_banked_past_the_allowance() {
        let mut budget = FrameBudget::default();
        let mut credit = Credit::default();
        for n in 0..20_000 {
            read(&mut budget, (HEADERS, 25));
            credit.heads += HEAD_CAP;
            budget.wrote(30);
            assert!(!budget.spent(credit), "request {n}");
        }
        let before = budget.read;
        let flood = (1..10_000_000).find(|_| {
            read(&mut budget, PRIORITY);
            budget.spent(credit)
        });
        let flooded = flood.map(|_| budget.read - before);
        // 8 MiB, give or take the eighths of bytes left over before.
        let closed = flooded.is_some_and(|f| ((8 << 20) - 64..9 << 20).contains(&f));
        assert!(closed, "{flooded:?}");
        // And it stays closed.
        assert!(budget.spent(credit));
    }

    /// An upload: 2 GiB in 16 KiB DATA frames, taken, the proxy's WINDOW_UPDATE written
    /// for each.
    #[test]
    fn an_upload_is_no_flood() {
        let frames = [(DATA, 16 << 10)];
        assert_eq!(read_until_spent(&frames, 13, 2 << 16, true, 0), None);
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
            read(&mut budget, WINDOW_UPDATE);
            read(&mut budget, WINDOW_UPDATE);
            if n % 64 == 0 {
                read(&mut budget, (HEADERS, 20));
                read(&mut budget, RST_STREAM);
            }
            assert!(!budget.spent(Credit::default()), "spent after {n} frames");
        }
    }

    /// Requests that are all overhead: a small header block (HPACK-indexed, 30 bytes
    /// decoded), cancelled at once, a PING for each, and no more than a 20-byte answer
    /// head: ten million of them. Without their heads' credit they are closed.
    #[test]
    fn small_requests_with_their_resets_and_pings_are_no_flood() {
        let frames = [(HEADERS, 6), RST_STREAM, PING];
        assert_eq!(read_until_spent(&frames, 20, 30_000_000, true, 30), None);
        assert!(read_until_spent(&frames, 20, 30_000_000, true, 0).is_some());
    }

    #[test]
    fn counts_saturate() {
        let mut budget = FrameBudget::default();
        budget.frame(HEADERS, usize::MAX);
        budget.wrote(usize::MAX);
        budget.wrote(usize::MAX);
        budget.frame(DATA, usize::MAX);
        budget.frame(DATA, usize::MAX);
        let all = Credit {
            heads: u64::MAX,
            taken: u64::MAX,
            refunds: u64::MAX,
        };
        assert!(!budget.spent(all));
        budget.read(usize::MAX);
        budget.read(usize::MAX);
        assert!(budget.spent(all));
    }
}
