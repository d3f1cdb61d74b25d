//! The listener's framing watch (`proxy::framing`), which sees every byte before hyper does
//! and refuses heads a peer could frame differently (request smuggling).
//!
//! Input: one byte that picks a segment size (1..=64), then the bytes of a connection.
//! Invariants: no panic; the verdicts do not depend on how the bytes were segmented (TCP
//! decides that, so an attacker does); and when httparse — hyper's parser — reads the first
//! head with both `Content-Length` and `Transfer-Encoding`, or two `Content-Length` lines,
//! the watch refuses that first request.
#![no_main]

use abx_proxy::proxy::framing::watch;
use libfuzzer_sys::fuzz_target;

/// Verdicts compared per connection.
const REQUESTS: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Some((&seg, stream)) = data.split_first() else {
        return;
    };
    let seg = usize::from(seg % 64) + 1;

    let (mut whole, whole_verdicts) = watch();
    whole.scan(stream);
    let (mut pieces, piece_verdicts) = watch();
    for chunk in stream.chunks(seg) {
        pieces.scan(chunk);
    }
    let a: Vec<_> = (0..REQUESTS)
        .map(|_| whole_verdicts.next_refusal())
        .collect();
    let b: Vec<_> = (0..REQUESTS)
        .map(|_| piece_verdicts.next_refusal())
        .collect();
    assert_eq!(
        a, b,
        "verdicts depend on segmentation ({seg}-byte segments)"
    );

    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = req.parse(stream) else {
        return;
    };
    // A head httparse completes is not the HTTP/2 preface (its version is 2.0), so a `PRI`
    // head is held to the same rule as any other.
    if req.method == Some("CONNECT") {
        return; // no HTTP/1 framing follows; the router refuses CONNECT itself
    }
    let count = |name: &str| {
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name))
            .count()
    };
    let (cl, te) = (count("content-length"), count("transfer-encoding"));
    if (cl > 0 && te > 0) || cl > 1 {
        assert!(
            a[0].is_some(),
            "hyper's parser sees {cl} Content-Length and {te} Transfer-Encoding, the watch lets it through"
        );
    }
});
