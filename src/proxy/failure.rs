//! What went wrong upstream, told apart: the upstream client's error ([`UpstreamError`]),
//! and the walk of hyper's, h2's, rustls's and the system's error chains behind it. A
//! failure is named three ways: its `abx_proxy_upstream_errors_total{kind}` label, whether
//! the upstream may have received the request, and the secret-free words of E5001's
//! message. [`super::forward`] turns them into the proxy's answers; the token exchange and
//! `check`, which call through hyper-util's client themselves, use the words too.

use std::io;

use crate::descriptors::NoSlot;
use crate::metrics::FailKind;
use crate::upstream::{self, BoxError};

/// Why an upstream exchange failed. Nothing here carries a header value: no secret can
/// reach a message or `Debug` output.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// From hyper-util's client (HTTP/2 origins, upgrades).
    #[error(transparent)]
    Legacy(#[from] hyper_util::client::legacy::Error),
    /// The client's own request body failed: not the upstream's fault.
    #[error("the request body could not be read")]
    ClientBody(#[source] BoxError),
    /// Name resolution or TCP connect (a connect timeout included).
    #[error("connect failed")]
    Connect(#[source] BoxError),
    #[error("tls handshake failed")]
    Tls(#[source] io::Error),
    #[error("upstream connection failed")]
    Io(#[source] io::Error),
    /// The upstream closed the connection before the message was complete.
    #[error("connection closed early")]
    Closed,
    #[error("invalid response: {0}")]
    Protocol(&'static str),
    /// No response head within `--upstream-timeout`.
    #[error("timed out")]
    Timeout,
    /// hyper's HTTP/2 keep-alive found the connection dead before the head came (see
    /// [`timed_out`]).
    #[error("keep-alive ping unanswered")]
    PingUnanswered,
    /// No response head within `--upstream-timeout`, the client's body having stopped
    /// before its end: the upstream waits for the rest, so the fault is the client's.
    #[error("the request body stalled")]
    BodyStalled,
    /// No response head within `--upstream-timeout`, and the request's body never taken
    /// (over HTTP/2, a request waiting for a stream the upstream had no room for): the
    /// upstream holds no whole request, and never will (see [`super::body::Moved::give_up`]).
    #[error("timed out")]
    Unsent,
}

/// An answer's body ended in an error of the client's own: its upload broke while the
/// upstream's answer was already coming (an early answer), which is no upstream's fault.
pub(in crate::proxy) fn client_left(e: &BoxError) -> bool {
    e.downcast_ref::<UpstreamError>()
        .is_some_and(UpstreamError::is_client_body)
}

impl UpstreamError {
    /// The client's request body broke; forward answers 400 instead of blaming upstream.
    pub fn is_client_body(&self) -> bool {
        match self {
            UpstreamError::ClientBody(_) => true,
            UpstreamError::Legacy(e) => client_body_failed(e),
            _ => false,
        }
    }

    /// Every upstream connection slot was in use ([`NoSlot`]): the proxy's own saturation.
    pub fn is_no_slot(&self) -> bool {
        let inner: &(dyn std::error::Error + 'static) = match self {
            UpstreamError::Connect(e) => e.as_ref(),
            UpstreamError::Legacy(e) if e.is_connect() => e,
            _ => return false,
        };
        chain(inner).any(|e| e.is::<NoSlot>())
    }

    /// Whether the upstream may have received the request: false only when the connection
    /// failed to be set up (resolve, connect, TLS handshake). A timeout counts as received,
    /// as the pool's deadline covers the connect and the exchange alike.
    pub fn reached_upstream(&self) -> bool {
        match self {
            UpstreamError::Legacy(e) => !e.is_connect() && !refused(e),
            UpstreamError::Connect(_) | UpstreamError::Tls(_) | UpstreamError::Unsent => false,
            UpstreamError::ClientBody(_)
            | UpstreamError::Io(_)
            | UpstreamError::Closed
            | UpstreamError::Protocol(_)
            | UpstreamError::Timeout
            | UpstreamError::PingUnanswered
            | UpstreamError::BodyStalled => true,
        }
    }

    /// The `abx_proxy_upstream_errors_total{kind}` label.
    pub fn kind(&self) -> FailKind {
        match self {
            UpstreamError::Legacy(e) => classify(e),
            UpstreamError::Connect(e) => connect_kind(find_io(e.as_ref())),
            // A handshake cut short is a failure to connect (a reset: the peer's doing), as
            // the legacy client counts it.
            UpstreamError::Tls(e) if find_rustls(e).is_none() => connect_kind(find_io(e)),
            UpstreamError::Tls(_) => FailKind::Tls,
            UpstreamError::Io(e) => io_kind(e.kind()),
            UpstreamError::Closed => FailKind::Reset,
            UpstreamError::Timeout | UpstreamError::Unsent | UpstreamError::PingUnanswered => {
                FailKind::Timeout
            }
            UpstreamError::ClientBody(_)
            | UpstreamError::BodyStalled
            | UpstreamError::Protocol(_) => FailKind::Protocol,
        }
    }

    /// A short, secret-free reason: "connect refused", "tls: invalid peer certificate: …".
    pub fn describe(&self) -> String {
        use io::ErrorKind::*;
        bounded(match self {
            UpstreamError::Legacy(e) => describe(e),
            UpstreamError::ClientBody(_) => "the request body could not be read".into(),
            UpstreamError::Connect(e) => match find_io(e.as_ref()) {
                Some(ConnectionRefused) => "connect refused".into(),
                Some(TimedOut) => upstream::timed_out_words(e.as_ref()).into(),
                _ => connect_failed(e.as_ref()),
            },
            UpstreamError::Tls(e) => match find_rustls(e) {
                Some(tls) => tls_failed(tls),
                None => describe_io(e.kind(), "tls handshake failed"),
            },
            UpstreamError::Io(e) => describe_io(e.kind(), "upstream connection failed"),
            UpstreamError::Closed => "connection closed early".into(),
            UpstreamError::Timeout | UpstreamError::Unsent => "timed out".into(),
            UpstreamError::PingUnanswered => "keep-alive ping unanswered".into(),
            UpstreamError::BodyStalled => "the request body stalled".into(),
            UpstreamError::Protocol(what) => format!("invalid response: {what}"),
        })
    }
}

fn describe_io(kind: io::ErrorKind, what: &str) -> String {
    use io::ErrorKind::*;
    match kind {
        ConnectionReset | ConnectionAborted => "connection reset".into(),
        UnexpectedEof | BrokenPipe => "connection closed early".into(),
        TimedOut => "timed out".into(),
        kind => format!("{what}: {kind}"),
    }
}

pub(crate) fn chain<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

pub(crate) fn find_rustls<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    chain(e).find_map(|e| {
        e.downcast_ref::<rustls::Error>()
            .or_else(|| e.downcast_ref::<std::io::Error>().and_then(inside_io))
    })
}

/// hyper-rustls wraps tokio-rustls's `io::Error` in another `io::Error`, and `get_ref` is
/// not `source`: unwrap the layers by hand.
fn inside_io(io: &std::io::Error) -> Option<&rustls::Error> {
    let inner = io.get_ref()?;
    inner
        .downcast_ref::<rustls::Error>()
        .or_else(|| inner.downcast_ref::<std::io::Error>().and_then(inside_io))
}

pub(crate) fn find_io(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    chain(e).find_map(|e| {
        // h2 keeps the I/O error of a connection that ended under a stream (an upstream
        // closing its socket mid-answer) out of `source`.
        let io = e.downcast_ref::<std::io::Error>();
        let io = io.or_else(|| e.downcast_ref::<h2::Error>().and_then(h2::Error::get_io));
        io.map(innermost_kind)
    })
}

/// The upstream refused the request before processing any of it (RFC 9113 §8.7): its
/// HTTP/2 stream reset with `REFUSED_STREAM`, or above the last stream a GOAWAY says was
/// processed (§6.8). Safe to send again, whatever the method. h2 gives the GOAWAY's own
/// error to those streams only, when it arrives; streams at or below it that the
/// connection's end cuts get an I/O error.
pub(crate) fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    chain(e).any(|e| {
        e.downcast_ref::<h2::Error>().is_some_and(|e| {
            e.is_remote()
                && (e.is_go_away()
                    || e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM))
        })
    })
}

/// The upstream's connection ended under the request before its answer, with no word
/// on whether it was processed (closed or reset without a GOAWAY): hyper's "connection
/// closed before message completed", or an I/O error that ends a connection.
pub(crate) fn connection_lost(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::*;
    let ended = |kind| {
        matches!(
            kind,
            UnexpectedEof | BrokenPipe | ConnectionReset | ConnectionAborted
        )
    };
    chain(e).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
            || e.downcast_ref::<h2::Error>()
                .and_then(h2::Error::get_io)
                .is_some_and(|io| ended(io.kind()))
            || e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| ended(io.kind()))
    })
}

/// hyper's HTTP/2 keep-alive found the upstream's connection dead: a ping unanswered for
/// as long as half a request's timeout (see `upstream::ping_interval`). An upstream gone
/// quiet, as the request's own timeout would have said a moment later.
pub(crate) fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    chain(e).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
    })
}

/// hyper-rustls wraps a failed handshake's `io::Error` in `io::Error::other` (and, as for
/// [`inside_io`], `get_ref` is not `source`): the kind that says what happened is the
/// innermost one. Without this, an upstream resetting its TLS handshake was reported as
/// "connect failed: other error".
fn innermost_kind(io: &std::io::Error) -> std::io::ErrorKind {
    match io
        .get_ref()
        .and_then(|e| e.downcast_ref::<std::io::Error>())
    {
        Some(inner) => innermost_kind(inner),
        None => io.kind(),
    }
}

/// "connect failed: …" in the words of the innermost error: a resolver's ("failed to
/// lookup address information: Name or service not known", whose kind alone reads
/// "uncategorized error"), the system's ("No route to host (os error 113)").
pub(crate) fn connect_failed(e: &(dyn std::error::Error + 'static)) -> String {
    let innermost = chain(e)
        .last()
        .map(|e| match e.downcast_ref::<std::io::Error>() {
            Some(io) => innermost_io(io).to_string(),
            None => e.to_string(),
        });
    format!("connect failed: {}", innermost.unwrap_or_default())
}

/// As [`innermost_kind`]: the error inside the layers of `io::Error` wrapping.
fn innermost_io(io: &std::io::Error) -> &(dyn std::error::Error + 'static) {
    match io.get_ref() {
        Some(inner) => match inner.downcast_ref::<std::io::Error>() {
            Some(inner) => innermost_io(inner),
            None => inner,
        },
        None => io,
    }
}

/// hyper marks an error of the request body stream as the user's.
pub(crate) fn client_body_failed(e: &hyper_util::client::legacy::Error) -> bool {
    chain(e).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_user)
    })
}

pub fn classify(e: &hyper_util::client::legacy::Error) -> FailKind {
    if find_rustls(e).is_some() {
        return FailKind::Tls;
    }
    if e.is_connect() {
        return connect_kind(find_io(e));
    }
    if closed_early(e) {
        return FailKind::Reset;
    }
    find_io(e).map_or(FailKind::Protocol, io_kind)
}

/// The upstream ended the exchange before its answer was whole: hyper's "connection closed
/// before message completed" (no I/O error inside), or an HTTP/2 stream or connection the
/// upstream reset. `reset`, as the proxy's own pool counts a connection that ends mid-head
/// and as [`body_kind`] counts one that ends mid-body.
fn closed_early(e: &(dyn std::error::Error + 'static)) -> bool {
    chain(e).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
            || e.downcast_ref::<h2::Error>()
                .is_some_and(h2::Error::is_remote)
    })
}

/// The kind of an I/O failure on an upstream connection that was set up.
pub(crate) fn io_kind(kind: std::io::ErrorKind) -> FailKind {
    use std::io::ErrorKind::*;
    match kind {
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => FailKind::Reset,
        TimedOut => FailKind::Timeout,
        _ => FailKind::Protocol,
    }
}

/// The kind of a response body's failure in hyper's client: an HTTP/1.1 body cut short
/// and an HTTP/2 stream or connection the upstream reset are `reset`, like a reset socket;
/// one that h2 itself reset, over frames it could not accept, is `protocol`.
pub(crate) fn body_kind(e: &hyper::Error) -> FailKind {
    if e.is_timeout() {
        return FailKind::Timeout;
    }
    if let Some(io) = find_io(e) {
        return io_kind(io);
    }
    if closed_early(e) {
        FailKind::Reset
    } else {
        FailKind::Protocol
    }
}

/// The kind of a failed connection set-up (TCP connect, TLS handshake), from the I/O error
/// in it. A reset there means the peer accepted the connection and then reset it: that is
/// `reset`, as it is when the reset comes a moment later, once the request is written.
/// Counted as `connect` before, an upstream that resets what it accepts got either label
/// depending on whether the reset beat the connector's check of the new socket.
pub(crate) fn connect_kind(io: Option<std::io::ErrorKind>) -> FailKind {
    use std::io::ErrorKind::*;
    match io {
        Some(TimedOut) => FailKind::Timeout,
        Some(ConnectionReset | ConnectionAborted) => FailKind::Reset,
        _ => FailKind::Connect,
    }
}

/// "tls: …" in words. rustls spells several certificate errors as their variant names
/// (`invalid peer certificate: UnknownIssuer`, `Other(OtherError(NameConstraintViolation))`);
/// those a user meets (a private CA not given to `--upstream-ca`, an interception proxy's
/// certificate) are said as curl and browsers say them. The rest are rustls's own words.
pub(crate) fn tls_failed(e: &rustls::Error) -> String {
    use rustls::CertificateError::*;
    // A plain HTTP server answers a ClientHello with its own 400 (nginx, hyper): the
    // commonest slip, `https://` for a port that serves `http://`, read "received corrupt
    // message of type InvalidContentType".
    if let rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType) = e {
        return "tls: the server did not answer in TLS (if this port serves plain HTTP, \
                use an http:// URL)"
            .into();
    }
    let rustls::Error::InvalidCertificate(cert) = e else {
        return format!("tls: {e}");
    };
    let words = match cert {
        UnknownIssuer => "signed by an unknown authority (none of the system's roots or \
                          --upstream-ca's issued it)"
            .to_string(),
        BadSignature => "its signature does not verify".into(),
        BadEncoding => "it cannot be parsed".into(),
        Expired => "it has expired".into(),
        NotValidYet => "it is not valid yet".into(),
        // Not rustls's words for this one: they quote the host name, which can carry a
        // secret (`https://${KEY}.example/`); the error's own host is printed masked.
        NotValidForName | NotValidForNameContext { .. } => {
            "it is not valid for this host name".into()
        }
        Revoked => "it has been revoked".into(),
        // The context lists every purpose the certificate names, as many as it likes.
        InvalidPurpose | InvalidPurposeContext { .. } => {
            "it is not issued for TLS server authentication".into()
        }
        UnhandledCriticalExtension => "it has a critical extension that is not supported".into(),
        Other(other) => {
            let name = other.to_string();
            match webpki_words(&name) {
                Some(words) => words.into(),
                None => format!("rejected: {name}"),
            }
        }
        // Already in words: an expiry with its times, …
        _ => cert.to_string(),
    };
    bounded(format!("tls: invalid peer certificate: {words}"))
}

/// The most of a reason the proxy says (in its answer's body and on the access line):
/// rustls words some certificate errors with what the certificate holds, and a
/// certificate may hold 60 KB of it.
pub const REASON_MAX: usize = 512;

/// `reason` cut at [`REASON_MAX`] bytes, on a character, and marked as cut.
fn bounded(mut reason: String) -> String {
    if reason.len() > REASON_MAX {
        let mut end = REASON_MAX;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push_str(crate::logging::CUT);
    }
    reason
}

/// The certificate path errors rustls passes on from webpki by their variant names, in
/// words. `CaUsedAsEndEntity` is the usual self-signed certificate pinned with
/// `--upstream-ca`: `openssl req -x509` makes a CA certificate unless told otherwise, which
/// curl and Node take as a server's own and webpki does not.
fn webpki_words(name: &str) -> Option<&'static str> {
    Some(match name {
        "CaUsedAsEndEntity" => {
            "it is a CA certificate, used as the server's own (a self-signed server certificate \
             needs basicConstraints CA:FALSE, which `openssl req -x509` does not write unless \
             asked, and to be given to --upstream-ca; or have a CA issue the server's)"
        }
        "EndEntityUsedAsCa" => "its chain uses a server's certificate as an issuer",
        "NameConstraintViolation" => "its issuer's name constraints do not allow this name",
        "UnsupportedCertVersion" => "it is an X.509 v1 certificate (v3 is needed)",
        _ => return None,
    })
}

/// A short, secret-free reason: "connect refused", "tls: invalid peer certificate: …".
pub fn describe(e: &hyper_util::client::legacy::Error) -> String {
    use std::io::ErrorKind::*;
    if let Some(tls) = find_rustls(e) {
        return tls_failed(tls);
    }
    bounded(match find_io(e) {
        Some(ConnectionRefused) => "connect refused".into(),
        Some(TimedOut) => crate::upstream::timed_out_words(e).into(),
        Some(ConnectionReset) => "connection reset".into(),
        Some(UnexpectedEof | BrokenPipe) => "connection closed early".into(),
        _ if e.is_connect() => connect_failed(e),
        _ => match h2_said(e) {
            Some(said) => said,
            None => {
                let msg = chain(e).last().map(|e| e.to_string()).unwrap_or_default();
                format!("upstream connection failed: {msg}")
            }
        },
    })
}

/// An HTTP/2 stream's end in HTTP/2's own names: a stream the upstream reset is not a
/// connection closed (the connection serves on), and h2's words for one it reset itself
/// ("unspecific protocol error detected", a byte string of debug data) say neither who
/// broke the protocol nor how. hyper's "connection closed before message completed" is
/// an early close; `None` when neither error is in the chain.
fn h2_said(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    if chain(e).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
    }) {
        return Some("connection closed early".into());
    }
    let h2 = chain(e).find_map(|e| e.downcast_ref::<h2::Error>())?;
    let reason = h2.reason()?;
    Some(match (h2.is_remote(), h2.is_go_away()) {
        (true, true) if reason == h2::Reason::NO_ERROR => "connection closed early".into(),
        (true, true) => format!("connection closed by the upstream ({reason:?})"),
        (true, false) => format!("stream reset by the upstream ({reason:?})"),
        // A connection error h2 raised itself, ending every stream on the connection, the
        // innocent ones too: said of the connection, not of this answer. Its guards (too
        // many CONTINUATION frames, over 5 whatever the head's size; a head four times
        // the limit; small DATA frames left unread, or reset streams, piling up from the
        // proxy's own clients) end it with ENHANCE_YOUR_CALM or COMPRESSION_ERROR; frames
        // no HTTP/2 peer may send with the rest.
        (false, true)
            if reason == h2::Reason::ENHANCE_YOUR_CALM
                || reason == h2::Reason::COMPRESSION_ERROR =>
        {
            format!(
                "HTTP/2 connection closed by the proxy: an answer head over 64 KiB or in \
                 too many frames, or too many frames pending ({reason:?})"
            )
        }
        (false, true) => {
            format!("HTTP/2 connection closed by the proxy: the upstream broke HTTP/2 ({reason:?})")
        }
        // h2 resets the stream with PROTOCOL_ERROR for a head over the client's limit too.
        (false, false) if reason == h2::Reason::PROTOCOL_ERROR => {
            format!("HTTP/2 answer refused: malformed, or a head over 64 KiB ({reason:?})")
        }
        (false, false) => format!("HTTP/2 answer refused ({reason:?})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rustls's variant names, said in words; what rustls words itself is kept.
    #[test]
    fn certificate_errors_are_said_in_words() {
        use rustls::CertificateError as C;
        let said = |e: C| tls_failed(&rustls::Error::InvalidCertificate(e));
        assert_eq!(
            said(C::UnknownIssuer),
            "tls: invalid peer certificate: signed by an unknown authority (none of the \
             system's roots or --upstream-ca's issued it)"
        );
        assert_eq!(
            said(C::Expired),
            "tls: invalid peer certificate: it has expired"
        );
        assert_eq!(
            said(C::NotValidForName),
            "tls: invalid peer certificate: it is not valid for this host name"
        );
        let mismatch = C::NotValidForNameContext {
            expected: rustls_pki_types::ServerName::try_from("sk-secret-label.example")
                .expect("a DNS name"),
            presented: vec!["*.sandbox.example".into()],
        };
        assert_eq!(
            said(mismatch),
            "tls: invalid peer certificate: it is not valid for this host name"
        );
        let other = C::Other(rustls::OtherError(std::sync::Arc::new(std::fmt::Error)));
        assert_eq!(
            said(other),
            "tls: invalid peer certificate: rejected: an error occurred when formatting an argument"
        );
        // webpki's errors, which rustls passes on by their names.
        #[derive(Debug)]
        struct Named(&'static str);
        impl std::fmt::Display for Named {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Named {}
        let named = |n| C::Other(rustls::OtherError(std::sync::Arc::new(Named(n))));
        let ca = said(named("CaUsedAsEndEntity"));
        assert!(
            ca.starts_with("tls: invalid peer certificate: it is a CA certificate, used as")
                && ca.contains("CA:FALSE"),
            "{ca}"
        );
        for name in [
            "NameConstraintViolation",
            "UnsupportedCertVersion",
            "EndEntityUsedAsCa",
        ] {
            assert!(!said(named(name)).contains(name), "{name}");
        }
        for (variant, words) in [
            (C::BadSignature, "its signature does not verify"),
            (C::Revoked, "it has been revoked"),
            (C::NotValidYet, "it is not valid yet"),
        ] {
            assert!(!format!("{variant:?}").contains(' '));
            assert!(said(variant).ends_with(words));
        }
        // A certificate that names many purposes, none of them TLS server's: rustls
        // lists every one (a 60 KB certificate's made a 286 KB line).
        let purposes = C::InvalidPurposeContext {
            required: rustls::ExtendedKeyPurpose::ServerAuth,
            presented: vec![rustls::ExtendedKeyPurpose::Other(vec![1, 2, 3, 4]); 5000],
        };
        assert_eq!(
            said(purposes),
            "tls: invalid peer certificate: it is not issued for TLS server authentication"
        );
        let signature = C::UnsupportedSignatureAlgorithmContext {
            signature_algorithm_id: vec![7; 5000],
            supported_algorithms: vec![],
        };
        let words = said(signature);
        assert!(
            words.len() <= REASON_MAX + crate::logging::CUT.len(),
            "{}",
            words.len()
        );
        assert!(words.ends_with(crate::logging::CUT), "{words}");
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::HandshakeFailure);
        assert_eq!(tls_failed(&alert), format!("tls: {alert}"));
        let plain = rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        assert!(tls_failed(&plain).contains("use an http:// URL"));
    }

    /// Connects nowhere: every connect fails with the error it is given.
    #[derive(Clone)]
    struct Failing(std::sync::Arc<dyn Fn() -> std::io::Error + Send + Sync>);

    impl tower_service::Service<http::Uri> for Failing {
        type Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Self::Response, std::io::Error>>;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), std::io::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Uri) -> Self::Future {
            std::future::ready(Err((self.0)()))
        }
    }

    /// hyper-util's client says a failed connect in the words of its innermost error: a
    /// resolver's read "connect failed: uncategorized error" before.
    #[tokio::test]
    async fn a_failed_connect_is_said_in_its_errors_words() {
        let dns = "failed to lookup address information: Name or service not known";
        let fails = |e: fn() -> std::io::Error| async move {
            let client = hyper_util::client::legacy::Client::builder(
                hyper_util::rt::TokioExecutor::new(),
            )
            .build::<_, http_body_util::Empty<bytes::Bytes>>(Failing(std::sync::Arc::new(e)));
            let uri: http::Uri = "http://no-such-host.invalid/".parse().unwrap();
            client.get(uri).await.unwrap_err()
        };
        let e = fails(|| {
            std::io::Error::other("failed to lookup address information: Name or service not known")
        })
        .await;
        assert!(e.is_connect(), "{e:?}");
        assert_eq!(describe(&e), format!("connect failed: {dns}"));
        let e = fails(|| std::io::Error::from_raw_os_error(113)).await;
        assert_eq!(
            describe(&e),
            "connect failed: No route to host (os error 113)"
        );
        let e = fails(|| std::io::ErrorKind::ConnectionRefused.into()).await;
        assert_eq!(describe(&e), "connect refused");
    }

    /// A connect that failed is said in the words of its innermost error: a name that
    /// does not resolve read "connect failed: uncategorized error" (the kind of the
    /// resolver's error), nothing about the name.
    #[test]
    fn an_upstream_error_says_a_failed_connect_in_its_errors_words() {
        let said = |e: io::Error| UpstreamError::Connect(Box::new(e)).describe();
        let dns = "failed to lookup address information: Name or service not known";
        assert_eq!(
            said(io::Error::other(dns)),
            format!("connect failed: {dns}")
        );
        let wrapped = io::Error::other(io::Error::new(io::ErrorKind::NotFound, dns));
        assert_eq!(said(wrapped), format!("connect failed: {dns}"));
        let os = io::Error::from_raw_os_error(113);
        assert_eq!(said(os), "connect failed: No route to host (os error 113)");
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(said(refused), "connect refused");
    }
}
