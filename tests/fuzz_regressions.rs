//! Inputs the fuzz targets in `fuzz/` found, kept as plain tests so a fix stays fixed without
//! running the fuzzer (`scripts/fuzz.sh`). Each test names its target and states the input
//! as the target saw it.

use std::time::{Duration, UNIX_EPOCH};

use abx_proxy::credentials::exchange::{iso8601, parse_response, unix_seconds};
use abx_proxy::proxy::headers::{authorize_envd, strip_hop_by_hop, AuthScheme};
use abx_proxy::Secret;
use http::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONNECTION};

/// `request_head`: hyper (through httparse) accepts obs-text (bytes 0x80–0xFF) in a field
/// value, so a client can send
/// `"Connection: close, X-Secret\r\nConnection:\xa0keep-alive, x-other\r\n"`. The second
/// line is not visible ASCII, and every name it lists used to survive the hop-by-hop strip
/// and go upstream (SPEC §4: fields named in `Connection` are removed).
#[test]
fn connection_line_with_obs_text_still_names_hop_by_hop_fields() {
    let mut h = HeaderMap::new();
    h.append(CONNECTION, HeaderValue::from_static("close, X-Secret"));
    h.append(
        CONNECTION,
        HeaderValue::from_bytes(b"\xa0keep-alive, x-other").unwrap(),
    );
    h.append(
        CONNECTION,
        HeaderValue::from_bytes(b"x-third, caf\xe9").unwrap(),
    );
    h.insert("x-secret", HeaderValue::from_static("1"));
    h.insert("x-other", HeaderValue::from_static("2"));
    h.insert("x-third", HeaderValue::from_static("3"));
    h.insert("x-kept", HeaderValue::from_static("yes"));

    strip_hop_by_hop(&mut h, false);

    for gone in ["connection", "x-secret", "x-other", "x-third"] {
        assert!(
            !h.contains_key(gone),
            "{gone} survived strip_hop_by_hop (a Connection line with a byte >= 0x80 names nothing): {h:?}"
        );
    }
    assert_eq!(h.get("x-kept").unwrap(), "yes");
}

/// `request_head`: `Authorization: Basic cm9vdDo=` followed by a second `Authorization` field
/// (`"Authorization: Basic cm9vdDo=\r\nAuthorization: B&sic cm9vdDo=\r\n"`; the same goes for
/// `Bearer <client key>`). `authorize_envd` looked at the first value only, kept the field,
/// and so sent the second, non-Basic credential to envd as well. SPEC §4: envd gets the
/// client's own `Authorization: Basic …` or the default user, nothing else.
#[test]
fn envd_gets_one_basic_authorization_even_when_the_client_sends_several() {
    for second in ["B&sic cm9vdDo=", "Bearer dummy-key", "o Basic cm9vdDo="] {
        let mut h = HeaderMap::new();
        h.append(AUTHORIZATION, HeaderValue::from_static("Basic cm9vdDo="));
        h.append(AUTHORIZATION, HeaderValue::from_str(second).unwrap());

        authorize_envd(
            &mut h,
            &AuthScheme::Bearer,
            &Secret::new("envd-token"),
            "isb-1",
            49983,
        );

        let sent: Vec<_> = h.get_all(AUTHORIZATION).iter().collect();
        assert_eq!(
            sent,
            [HeaderValue::from_static("Basic cm9vdDo=")],
            "after a client Basic plus {second:?}, envd got {sent:?}"
        );
    }
}

/// `exchange_response`: an answer whose `expireTime` lies past the year 9999 (here epoch
/// milliseconds 10^16, the year 318857) is accepted by `parse_response`, and formatting that
/// expiry — the refresher logs `iso8601(expires_at)` after every exchange, and `check`
/// prints it — panicked inside `time` ("overflow adding duration to date"), killing the
/// refresh task. An absurd expiry must be either refused or made printable.
#[test]
fn exchange_answer_with_an_expiry_past_year_9999_does_not_panic() {
    let now = UNIX_EPOCH + Duration::from_secs(1_750_000_000);
    let ttl = Duration::from_secs(3600);
    let bodies: [&[u8]; 4] = [
        // As the fuzzer found it (status 200).
        br#"{"apiKey":"SECx","expireTime":"1276257601666666666666666666666666666666666666666666666666666"}"#,
        br#"{"apiKey":{"apiKeyValue":"SECRETKEYxxxxxxxxxxxx","expireTime":10000000000000000}}"#,
        br#"{"ApiKey":{"ApiKeyValue":"SECRETKEYxxxxxxxxxxxx","ExpireTime":"99999999999999999999"}}"#,
        br#"{"apiKey":"SECRETKEYxxxxxxxxxxxx","expireTime":1e300}"#,
    ];
    for body in bodies {
        let shown = String::from_utf8_lossy(body);
        let outcome = std::panic::catch_unwind(|| {
            parse_response(200, body, now, ttl)
                .map(|issued| (iso8601(issued.expires_at), unix_seconds(issued.expires_at)))
        });
        match outcome {
            Err(_) => panic!("reading or logging the expiry of {shown} panicked"),
            Ok(Err(e)) => assert!(!e.to_string().contains("SECRETKEY"), "{e}"),
            Ok(Ok((text, secs))) => assert!(secs > 1_750_000_000, "{shown}: {text} {secs}"),
        }
    }
}

/// `manifest`: `"e=[\n[\n"`, a TOML error at the very end of a text ending in a newline.
/// Manifest errors counted newlines before the error's offset and named line 3 of a
/// two-line file; the end of such a text is its last line.
#[test]
fn a_manifest_error_at_the_end_names_the_last_line() {
    let text = "e=[\n[\n";
    let Err(abx_proxy::Error::Manifest { line, .. }) =
        abx_proxy::providers::Manifest::parse(text, "abx-provider.toml")
    else {
        panic!("not a manifest error");
    };
    assert_eq!(line, 2);
}

/// `response`: a chunked answer whose trailer section ends in a bare LF,
/// `…0\r\n\n0\r\nx-t: 1\r\n\r\n`. The pool read the trailers with httparse, which ends a
/// line at a bare LF, and so ended the answer after `0\r\n\n`; hyper ends trailer lines
/// only at CRLF and reads on. Had the rest come in a later read, the connection would have
/// gone back to the pool clean, and the next request on it been answered with the tail of
/// this one.
#[test]
fn a_trailer_section_ended_by_a_bare_lf_is_refused() {
    use abx_proxy::proxy::pool::replay::read;
    let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec();
    for tail in [
        &b"0\r\n\n"[..],
        b"0\r\n\n0\r\nx-t: 1\r\n\r\n",
        b"0\r\nx-t: 1\n\r\n",
    ] {
        let wire = [&head[..], tail].concat();
        let read = read(&[&wire], false);
        assert!(
            read.is_err(),
            "{:?}: {read:?}",
            String::from_utf8_lossy(tail)
        );
    }
    // The same answer with CRLFs is read, trailers and all.
    let wire = [&head[..], b"0\r\nx-t: 1\r\n\r\n"].concat();
    let read = read(&[&wire], false).expect("a well-formed answer");
    assert_eq!((read.body.as_slice(), read.rest.len()), (&b"hello"[..], 0));
    assert_eq!(read.trailers, [("x-t".to_owned(), b"1".to_vec())]);
}
