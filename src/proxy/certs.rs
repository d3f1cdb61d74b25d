//! The listener's certificate and key (`--tls-cert`, `--tls-key`): read and checked as a
//! pair, and served by TLS settings of their own ([`Handshakes`]), which a reload swaps
//! whole for the next handshakes.
//!
//! cert-manager renews a certificate by rewriting the mounted files in place, and a user
//! who renews one by hand expects SIGHUP to apply it, as nginx does; a restart would cut
//! every open connection. A new pair is swapped in only when it is valid as a whole: a
//! rotation caught between its two files, or a file caught half written, keeps the pair in
//! use until the next try. Connections already open keep the pair they shook hands with.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

use crate::error::Error;

/// The listener's pair, the files it comes from, and the TLS settings that serve it.
pub struct ListenerCert {
    cert: PathBuf,
    key: PathBuf,
    /// The pair in use, for its dates.
    pair: Arc<CertifiedKey>,
    /// The two files' contents the pair in use was read from, hashed (no copy of the key
    /// is kept): a reload that finds nothing new swaps nothing and logs nothing, so that
    /// a SIGHUP or a rotated API key file does not claim a certificate reload.
    read: [u8; 32],
    handshakes: Handshakes,
    /// What the log has said of the pair's coming end (see [`ListenerCert::due`]).
    said: Said,
}

/// How long before the certificate in use expires the log says so: the week of the alert
/// `AbxProxyListenerCertificateExpiring`, for a proxy nobody scrapes; for a certificate
/// that lives under six weeks, a sixth of its life (see [`End`]).
pub const EXPIRY_NOTICE: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// The log's word on the pair in use as its end nears, each said once per pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    Nothing,
    /// That it expires within its notice (see [`End`]).
    Soon,
    /// That it expired (at its load, [`ListenerCert::validity_warning`] said it).
    Expired,
}

impl Said {
    /// At a pair's load: an expired one was said by its load's warning.
    fn at_load(end: Option<End>) -> Said {
        match end {
            Some(end) if SystemTime::now() > end.at => Said::Expired,
            _ => Said::Nothing,
        }
    }
}

/// The listener's TLS settings: one `ServerConfig` per pair, each with its own session
/// cache (rustls' default, 256 sessions), swapped whole by a reload. A handshake begun on
/// the old pair keeps the old settings to its end, its session stored in the old cache,
/// which goes with them: sessions from before a rotation (a key replaced because it may
/// have leaked) were resumed, the new certificate never shown, for as long as the one cache
/// kept them (TLS 1.2's and 1.3's alike: rustls checks neither's age), as nginx's are not;
/// and a cache replaced under one config took a session from a handshake the swap caught
/// midway.
#[derive(Clone)]
pub struct Handshakes(Arc<ArcSwap<rustls::ServerConfig>>);

impl Handshakes {
    /// An acceptor for one connection, with the settings in use now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.0.load_full())
    }
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The files hold the pair in use.
    Unchanged,
    /// New handshakes get the new pair.
    Swapped,
}

impl ListenerCert {
    /// Reads and checks the pair, for `serve` and `check` at startup: any fault is E1006.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, Error> {
        let (pair, read) = read_pair(cert, key)?;
        let pair = Arc::new(pair);
        let config = server_config(&pair, cert)?;
        Ok(ListenerCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            said: Said::at_load(end(&pair)),
            pair,
            read,
            handshakes: Handshakes(Arc::new(ArcSwap::from_pointee(config))),
        })
    }

    /// What a client would refuse of the certificates in use now, if anything: that the
    /// leaf expired, or is not valid yet; or that a certificate the file sends after it
    /// did, which a client whose path to its trusted root goes through it refuses (one
    /// whose path does not, through a root of its own or another cross-sign, does not: an
    /// expired cross-sign left in a chain, AddTrust's in 2020, broke only old clients). A
    /// warning, not an error, as nginx serves such a certificate too (a client may not
    /// check, or check another clock); but every client that refuses it fails its
    /// handshake, and the proxy sees no request to log.
    pub fn validity_warning(&self, now: SystemTime) -> Option<String> {
        let pair = &self.pair;
        let file = self.shown_file();
        pair.cert.iter().enumerate().find_map(|(i, cert)| {
            let (not_before, not_after) = validity(cert.as_ref())?;
            let (which, refuse) = match i {
                0 => (
                    format!("the listener certificate ({file})"),
                    "clients that check it refuse the handshake",
                ),
                _ => (
                    format!("certificate #{} of the listener's chain ({file})", i + 1),
                    "clients whose path to a trusted root goes through it refuse the handshake",
                ),
            };
            if now > not_after {
                Some(format!(
                    "{which} expired at {}: {refuse}; renew it, or leave it out of the file (a \
                     SIGHUP, or its files' change, applies the new one)",
                    crate::credentials::exchange::iso8601(not_after)
                ))
            } else if now < not_before {
                Some(format!(
                    "{which} is not valid before {}: {refuse} until then (or this machine's \
                     clock is behind)",
                    crate::credentials::exchange::iso8601(not_before)
                ))
            } else {
                None
            }
        })
    }

    /// When the leaf certificate in use expires, or its issuer before it when the file
    /// sends that next (see `end`), in unix seconds; NaN when the leaf's date cannot be
    /// read (no alert compares true with it).
    pub fn expires(&self) -> f64 {
        end(&self.pair)
            .and_then(|end| end.at.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(f64::NAN, |d| d.as_secs_f64())
    }

    /// That the certificate in use expires within its notice of `now` (see [`End`]), when
    /// it does: for `check`, and the log of a running proxy (see [`ListenerCert::due`]).
    pub fn expiry_notice(&self, now: SystemTime) -> Option<String> {
        let end = end(&self.pair)?;
        let left = end.at.duration_since(now).ok()?;
        if left > end.notice {
            return None;
        }
        let file = self.shown_file();
        let which = match end.which {
            0 => format!("the listener certificate ({file})"),
            _ => format!("the issuer of the listener certificate, #2 in its chain ({file}),"),
        };
        Some(format!(
            "{which} expires at {} (in {}): clients that check it will refuse the handshake; \
             renew it (a SIGHUP, or its files' change, applies the new one)",
            crate::credentials::exchange::iso8601(end.at),
            in_words(left)
        ))
    }

    /// What the log should say now of the pair's coming end, said once per pair: that it
    /// expires within its notice, then that it expired. A running proxy's only word
    /// between its start and the first refused handshake, which it never sees.
    pub fn due(&mut self, now: SystemTime) -> Option<String> {
        let end = end(&self.pair)?;
        if now > end.at {
            if self.said == Said::Expired {
                return None;
            }
            self.said = Said::Expired;
            return self.validity_warning(now);
        }
        if self.said != Said::Nothing {
            return None;
        }
        let notice = self.expiry_notice(now)?;
        self.said = Said::Soon;
        Some(notice)
    }

    /// How long from `now` until [`ListenerCert::due`] may have something new to say;
    /// `None` when nothing is left to say of this pair. At most an hour: the wall clock
    /// runs on while a laptop sleeps, and a timer does not.
    pub fn next_look(&self, now: SystemTime) -> Option<Duration> {
        let End {
            at: end, notice, ..
        } = end(&self.pair)?;
        let at = match self.said {
            Said::Nothing => end.checked_sub(notice).unwrap_or(now),
            // Past its last second: `notAfter` is the last valid one (RFC 5280 §4.1.2.5).
            Said::Soon => end.checked_add(Duration::from_secs(1)).unwrap_or(end),
            Said::Expired => return None,
        };
        let wait = at.duration_since(now).unwrap_or(Duration::ZERO);
        Some(wait.min(Duration::from_secs(60 * 60)))
    }

    /// The certificate file's path as the log shows it: a line break or a bidirectional
    /// override in a file's name is the operator's, and still must not split or turn a line.
    fn shown_file(&self) -> String {
        crate::providers::manifest::printable(&self.cert.to_string_lossy()).into_owned()
    }

    /// The listener's TLS; its handshakes follow every later [`ListenerCert::apply`].
    pub fn handshakes(&self) -> Handshakes {
        self.handshakes.clone()
    }

    /// The certificate and key files, as given.
    pub fn paths(&self) -> (&Path, &Path) {
        (&self.cert, &self.key)
    }

    /// Swaps in the pair of `files` (the files read again: [`read_files`] of
    /// [`ListenerCert::paths`], on the reading thread) if it is new and valid. On an error
    /// the pair in use keeps serving, and the same files are read afresh next time.
    pub fn apply(&mut self, files: Result<(Vec<u8>, Vec<u8>), Error>) -> Result<Reloaded, Error> {
        let (cert_pem, key_pem) = files?;
        let read = digest(&cert_pem, &key_pem);
        if read == self.read {
            return Ok(Reloaded::Unchanged);
        }
        let pair = Arc::new(parse_pair(&self.cert, &cert_pem, &self.key, &key_pem)?);
        let config = server_config(&pair, &self.cert)?;
        self.handshakes.0.store(Arc::new(config));
        self.said = Said::at_load(end(&pair));
        self.pair = pair;
        self.read = read;
        Ok(Reloaded::Swapped)
    }
}

/// The end of the pair's certificates that comes first for clients: the leaf's, or its
/// issuer's before it when the file sends that next (see [`end`]).
#[derive(Debug, Clone, Copy)]
struct End {
    /// Its `notAfter`.
    at: SystemTime,
    /// How long before it the log says so: [`EXPIRY_NOTICE`], or a sixth of that
    /// certificate's life when shorter. Certificates are renewed a third of their life
    /// before their end (cert-manager, certbot), and one of 6 days (Let's Encrypt's
    /// short-lived) or 24 hours (step-ca's) was said to need renewing the moment it came.
    notice: Duration,
    /// Its place in the file: 0 for the leaf, 1 for its issuer.
    which: usize,
}

/// When the pair's leaf certificate expires, or its issuer before it when the file sends
/// that next (clients with no copy of it of their own go through it: the usual case, a CA's
/// intermediate); `None` when the leaf's date cannot be read. Not the others': which a
/// client's path goes through depends on the client's roots, and an expired cross-sign
/// many clients never use would have kept an alert saying "expired" for good.
fn end(pair: &CertifiedKey) -> Option<End> {
    let chain = &pair.cert;
    let leaf = chain.first()?.as_ref();
    let issuer = chain.get(1).map(|c| c.as_ref()).filter(|issuer| {
        let (leaf, issuer) = (fields(leaf), fields(issuer));
        leaf.zip(issuer).is_some_and(|(l, i)| l.issuer == i.subject)
    });
    let leaf = validity(leaf)?;
    let (which, (from, at)) = match issuer.and_then(validity) {
        Some(issuer) if issuer.1 < leaf.1 => (1, issuer),
        _ => (0, leaf),
    };
    let life = at.duration_since(from).unwrap_or(Duration::ZERO);
    Some(End {
        at,
        notice: EXPIRY_NOTICE.min(life / 6),
        which,
    })
}

/// A time left, in the largest unit it holds twice or more, to the nearest: "3 days".
fn in_words(left: Duration) -> String {
    let secs = left.as_secs();
    let (unit, name) = match secs {
        s if s >= 2 * 86_400 => (86_400, "days"),
        s if s >= 2 * 3_600 => (3_600, "hours"),
        s if s >= 2 * 60 => (60, "minutes"),
        1 => (1, "second"),
        _ => (1, "seconds"),
    };
    format!("{} {name}", (secs + unit / 2) / unit)
}

/// The TLS settings that serve `pair`, with a session cache of their own.
fn server_config(pair: &Arc<CertifiedKey>, cert: &Path) -> Result<rustls::ServerConfig, Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| read_err(cert, e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Pair(pair.clone())));
    // `http/1.0` too, as nginx offers it: a client offering only that (`curl
    // --http1.0`) failed its handshake with `no_application_protocol`.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), b"http/1.0".to_vec()];
    Ok(config)
}

/// Hands every handshake its settings' pair.
struct Pair(Arc<CertifiedKey>);

impl ResolvesServerCert for Pair {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

// rustls requires Debug of a resolver; the pair's own would reach the signing key.
impl fmt::Debug for Pair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pair(listener certificate)")
    }
}

/// A certificate's `notBefore` and `notAfter` (RFC 5280 §4.1.2.5), read from its DER by
/// hand: nothing in the TLS stack exposes them, and a certificate parser would be a
/// dependency for two dates. `None` when the DER is not laid out as a certificate is.
fn validity(der: &[u8]) -> Option<(SystemTime, SystemTime)> {
    let (t1, before, rest) = der_item(fields(der)?.validity)?;
    let (t2, after, _) = der_item(rest)?;
    Some((der_time(t1, before)?, der_time(t2, after)?))
}

/// The fields of a certificate's DER this file reads (RFC 5280 §4.1): its issuer's and its
/// subject's names (their DER, compared byte for byte, as a chain's issuer writes its
/// subject) and its validity.
struct Fields<'a> {
    issuer: &'a [u8],
    validity: &'a [u8],
    subject: &'a [u8],
}

fn fields(der: &[u8]) -> Option<Fields<'_>> {
    let (_, certificate, _) = der_item(der)?;
    let (_, tbs, _) = der_item(certificate)?;
    // version [0] EXPLICIT (absent in v1), serialNumber, signature, issuer, validity,
    // subject.
    let (tag, _, mut rest) = der_item(tbs)?;
    if tag == 0xa0 {
        rest = der_item(rest)?.2;
    }
    rest = der_item(rest)?.2;
    let (_, issuer, rest) = der_item(rest)?;
    let (tag, validity, rest) = der_item(rest)?;
    if tag != 0x30 {
        return None;
    }
    let (_, subject, _) = der_item(rest)?;
    Some(Fields {
        issuer,
        validity,
        subject,
    })
}

/// One DER item: its tag, its contents and what follows it.
fn der_item(bytes: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = bytes.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |len, b| (len << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// UTCTime (`YYMMDDHHMMSSZ`, years 1950-2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn der_time(tag: u8, text: &[u8]) -> Option<SystemTime> {
    // ASCII only: the slicing below is by byte, and a character across a cut would panic.
    let text = std::str::from_utf8(text)
        .ok()
        .filter(|t| t.is_ascii())?
        .strip_suffix('Z')?;
    let (year, rest) = match (tag, text.len()) {
        (0x17, 12) => {
            let yy: i32 = text[..2].parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        (0x18, 14) => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    let field = |i: usize| rest.get(i..i + 2)?.parse::<u8>().ok();
    let month = time::Month::try_from(field(0)?).ok()?;
    let date = time::Date::from_calendar_date(year, month, field(2)?).ok()?;
    let at = date
        .with_hms(field(4)?, field(6)?, field(8)?)
        .ok()?
        .assume_utc();
    let secs = at.unix_timestamp();
    let since = std::time::Duration::from_secs(secs.unsigned_abs());
    if secs < 0 {
        std::time::UNIX_EPOCH.checked_sub(since)
    } else {
        std::time::UNIX_EPOCH.checked_add(since)
    }
}

fn read_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::ReadFile {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Both files' bytes, read once each: what is hashed is what is parsed.
/// The certificate's and the key's PEM, each read whole (within [`crate::watched`]'s bound).
/// A path with nothing there is not repeated (see [`crate::watched::unread`]).
pub fn read_files(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let unread = |flag, path, e: std::io::Error| {
        crate::watched::unread(flag, path, crate::watched::reason(&e))
    };
    let cert_pem = crate::watched::read(cert).map_err(|e| unread("--tls-cert", cert, e))?;
    let key_pem = crate::watched::read(key).map_err(|e| unread("--tls-key", key, e))?;
    Ok((cert_pem, key_pem))
}

fn read_pair(cert: &Path, key: &Path) -> Result<(CertifiedKey, [u8; 32]), Error> {
    let (cert_pem, key_pem) = read_files(cert, key)?;
    let pair = parse_pair(cert, &cert_pem, key, &key_pem)?;
    Ok((pair, digest(&cert_pem, &key_pem)))
}

fn digest(cert_pem: &[u8], key_pem: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    // The length first, so that bytes moving from one file to the other are a change.
    h.update((cert_pem.len() as u64).to_be_bytes());
    h.update(cert_pem);
    h.update(key_pem);
    h.finalize().into()
}

/// The pair, valid as a whole: a chain, a key rustls can sign with, and the key the leaf
/// certificate names.
fn parse_pair(
    cert: &Path,
    cert_pem: &[u8],
    key: &Path,
    key_pem: &[u8],
) -> Result<CertifiedKey, Error> {
    let (cert_pem, key_pem) = (
        crate::upstream::without_bom(cert_pem),
        crate::upstream::without_bom(key_pem),
    );
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| read_err(cert, crate::upstream::pem_reason(&e)))?;
    if chain.is_empty() {
        return Err(read_err(cert, "no PEM certificate in the file"));
    }
    // The key's own parse errors could quote key material; keep the reasons generic, but
    // name what the user can act on: a passphrase on the key is read by no server here.
    let key_der = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| {
        let encrypted = key_pem.windows(9).any(|w| w == b"ENCRYPTED");
        read_err(
            key,
            if encrypted {
                "the private key is encrypted: give it without its passphrase (`openssl pkey \
                 -in KEY -out KEY.plain`), readable by this user only"
            } else {
                "no readable PEM private key"
            },
        )
    })?;
    let signer = rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|_| {
            read_err(
                key,
                "not a usable private key: RSA of 2048 bits or more, ECDSA on P-256 or P-384, \
                 or Ed25519",
            )
        })?;
    let pair = CertifiedKey::new(chain, signer);
    match pair.keys_match() {
        // As rustls' own `with_single_cert`: a key that cannot tell its public half is
        // not refused.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(pair)
        }
        Err(rustls::Error::InconsistentKeys(_)) => Err(read_err(
            key,
            format!(
                "the private key does not belong to the certificate in {}",
                cert.display()
            ),
        )),
        Err(e) => Err(read_err(cert, unservable(&e))),
    }
}

/// Why the leaf certificate cannot serve, in words: rustls says "invalid peer certificate"
/// of the proxy's own, and an X.509 v1 certificate (`openssl x509 -req` without
/// extensions writes one) came out as `Other(OtherError(UnsupportedCertVersion))`.
fn unservable(e: &rustls::Error) -> String {
    let said = e.to_string();
    if said.contains("UnsupportedCertVersion") {
        return "the certificate is X.509 v1 (or another version before v3), which the TLS \
                library does not serve: issue it as v3 (openssl adds v3 extensions with \
                -extfile, or -addext for a self-signed one)"
            .into();
    }
    said.replace(
        "invalid peer certificate",
        "the certificate cannot be served",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and its key, as PEM.
    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
        let cert = params.self_signed(&key).expect("certificate");
        (cert.pem(), key.serialize_pem())
    }

    /// The files' pair, or the error's line; never the key's bytes.
    fn load(cert: &str, key: &str) -> Result<ListenerCert, String> {
        let dir = tempfile::tempdir().expect("dir");
        let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert_path, cert).expect("cert");
        std::fs::write(&key_path, key).expect("key");
        ListenerCert::load(&cert_path, &key_path).map_err(|e| e.line())
    }

    /// A pair valid for `not_before..not_after`.
    fn dated(not_before: (i32, u8, u8), not_after: (i32, u8, u8)) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["a.localhost".into()]).expect("params");
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        let cert = params.self_signed(&key).expect("certificate");
        (cert.pem(), key.serialize_pem())
    }

    /// Midnight UTC of a date.
    fn midnight(y: i32, m: u8, d: u8) -> SystemTime {
        let date = time::Date::from_calendar_date(y, time::Month::try_from(m).unwrap(), d);
        let secs = date.unwrap().midnight().assume_utc().unix_timestamp();
        std::time::UNIX_EPOCH + Duration::from_secs(secs as u64)
    }

    /// The log's word on a pair's coming end: once within the alert's week, once past it,
    /// nothing more of that pair, with a look at least hourly meanwhile; a new pair
    /// starts over. (Far ahead of this clock: a pair's load asks it whether it expired.)
    #[test]
    fn a_pairs_coming_end_is_said_once_near_it_and_once_past_it() {
        let end = midnight(2040, 1, 1);
        let (cert, key) = dated((2020, 1, 1), (2040, 1, 1));
        let mut pair = load(&cert, &key).expect("loads");
        let hour = Duration::from_secs(3600);
        let (notice, second) = (EXPIRY_NOTICE, Duration::from_secs(1));

        assert_eq!(pair.due(end - notice - hour), None);
        assert_eq!(pair.expiry_notice(end - notice - second), None);
        assert_eq!(pair.next_look(end - notice - 2 * hour), Some(hour));
        assert_eq!(
            pair.next_look(end - notice - 60 * second),
            Some(60 * second)
        );
        let soon = end - 3 * 24 * hour;
        let line = pair.due(soon).expect("said within the week");
        let said = "the listener certificate (";
        let when = "expires at 2040-01-01T00:00:00Z (in 3 days)";
        assert!(
            line.contains(said) && line.contains("tls.crt") && line.contains(when),
            "{line}"
        );
        assert_eq!(pair.due(soon + second), None, "said once");
        assert_eq!(pair.next_look(soon), Some(hour));
        assert_eq!(pair.next_look(end - 10 * second), Some(11 * second));
        // `notAfter` is its last valid second.
        assert_eq!(pair.due(end), None);
        let line = pair.due(end + second).expect("said past its end");
        assert!(
            line.contains(said) && line.contains("expired at 2040-01-01T00:00:00Z"),
            "{line}"
        );
        assert_eq!(pair.due(end + 2 * 24 * hour), None, "said once");
        assert_eq!(pair.next_look(end + second), None);

        // A new pair, its issuer's end before its own.
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let dates = |until: (i32, u8, u8), ca: bool| {
            let mut params = CertificateParams::new(if ca {
                vec![]
            } else {
                vec!["a.localhost".into()]
            })
            .expect("params");
            params.is_ca = if ca {
                IsCa::Ca(BasicConstraints::Unconstrained)
            } else {
                IsCa::NoCa
            };
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2);
            params
        };
        let ca_key = KeyPair::generate().expect("key");
        let ca = dates((2041, 1, 1), true).self_signed(&ca_key).expect("CA");
        let leaf_key = KeyPair::generate().expect("key");
        let leaf = dates((2042, 1, 1), false)
            .signed_by(&leaf_key, &ca, &ca_key)
            .expect("leaf");
        let files = (
            format!("{}{}", leaf.pem(), ca.pem()).into_bytes(),
            leaf_key.serialize_pem().into_bytes(),
        );
        assert_eq!(
            pair.apply(Ok(files)).map_err(|e| e.line()),
            Ok(Reloaded::Swapped)
        );
        let end = midnight(2041, 1, 1);
        assert_eq!(pair.next_look(end + second), Some(Duration::ZERO));
        let line = pair.due(end - 47 * hour).expect("said anew");
        let said = "the issuer of the listener certificate, #2 in its chain (";
        assert!(
            line.contains(said) && line.contains("expires at 2041-01-01T00:00:00Z (in 47 hours)"),
            "{line}"
        );
        let line = pair.due(end + second).expect("said past its end");
        assert!(
            line.contains("certificate #2 of the listener's chain ("),
            "{line}"
        );

        // One that lives six days (Let's Encrypt's short-lived): a sixth of its life, a
        // day, not a week, or it was said the moment it came.
        let (cert, key) = dated((2039, 12, 26), (2040, 1, 1));
        let files = (cert.into_bytes(), key.into_bytes());
        assert_eq!(
            pair.apply(Ok(files)).map_err(|e| e.line()),
            Ok(Reloaded::Swapped)
        );
        let end = midnight(2040, 1, 1);
        assert_eq!(pair.due(end - 5 * 24 * hour), None, "just renewed");
        assert_eq!(pair.due(end - 25 * hour), None);
        assert_eq!(pair.next_look(end - 25 * hour), Some(hour));
        let line = pair.due(end - 23 * hour).expect("said within a day");
        assert!(line.contains("(in 23 hours)"), "{line}");
    }

    #[test]
    fn time_left_is_said_in_its_largest_unit_held_twice_to_the_nearest() {
        let words = |secs| in_words(Duration::from_secs(secs));
        assert_eq!(words(0), "0 seconds");
        assert_eq!(words(1), "1 second");
        assert_eq!(words(119), "119 seconds");
        assert_eq!(words(120), "2 minutes");
        assert_eq!(words(2 * 3600 - 1), "120 minutes");
        // Where a running proxy first looks: just under the notice's week.
        assert_eq!(words(7 * 86_400 - 1), "7 days");
        assert_eq!(words(6 * 86_400 + 11 * 3600), "6 days");
        assert_eq!(words(2 * 3600), "2 hours");
        assert_eq!(words(7 * 86_400), "7 days");
    }

    /// A byte-order mark before either file (Notepad, PowerShell 5) is not a parse error:
    /// openssl and curl read such files.
    #[test]
    fn a_byte_order_mark_before_the_pem_is_read_past() {
        let (cert, key) = dated((2020, 1, 1), (2040, 1, 1));
        let bom = |pem: &str| format!("\u{feff}{pem}");
        assert!(load(&bom(&cert), &bom(&key)).is_ok());
    }

    /// A leaf outside its validity is said (a warning: it still loads), with the date;
    /// both DER time forms are read (UTCTime to 2049, GeneralizedTime from 2050).
    #[test]
    fn a_certificate_outside_its_validity_is_said() {
        let at = |y: i32, m: u8, d: u8| {
            let date = time::Date::from_calendar_date(y, time::Month::try_from(m).unwrap(), d);
            let secs = date.unwrap().midnight().assume_utc().unix_timestamp();
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs as u64)
        };
        let now = at(2026, 12, 5);
        for (valid, said) in [
            (((2020, 1, 1), (2030, 1, 1)), None),
            (
                ((2020, 1, 1), (2026, 12, 4)),
                Some("expired at 2026-12-04T00:00:00Z"),
            ),
            (
                ((2055, 6, 1), (2060, 1, 1)),
                Some("is not valid before 2055-06-01T00:00:00Z"),
            ),
            (((2026, 1, 1), (2051, 1, 1)), None),
            (
                ((1960, 1, 1), (2000, 1, 1)),
                Some("expired at 2000-01-01T00:00:00Z"),
            ),
        ] {
            let (cert, key) = dated(valid.0, valid.1);
            let pair = load(&cert, &key).expect("loads all the same");
            let warning = pair.validity_warning(now);
            match said {
                None => assert_eq!(warning, None, "{valid:?}"),
                Some(said) => {
                    let warning = warning.expect("a warning");
                    assert!(
                        warning.contains(said) && warning.contains("tls.crt"),
                        "{warning}"
                    );
                }
            }
        }
        assert_eq!(validity(b"\x30\x03\x02\x01\x01"), None);
        // Not a time, and no panic: a character that byte slicing would cut.
        assert_eq!(
            der_time(0x17, "a\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}bZ".as_bytes()),
            None
        );
    }

    /// `der` with its TBS's items for which `keep` is false left out, lengths re-encoded
    /// (a made-up certificate for the parser only: its signature no longer holds).
    fn without(der: &[u8], keep: impl Fn(u8) -> bool) -> Vec<u8> {
        fn encode(tag: u8, body: &[u8]) -> Vec<u8> {
            let mut out = vec![tag];
            let len = body.len();
            if len < 0x80 {
                out.push(len as u8);
            } else {
                let bytes: Vec<u8> = len
                    .to_be_bytes()
                    .into_iter()
                    .skip_while(|b| *b == 0)
                    .collect();
                out.push(0x80 | bytes.len() as u8);
                out.extend(bytes);
            }
            out.extend_from_slice(body);
            out
        }
        let (_, certificate, _) = der_item(der).unwrap();
        let (_, mut tbs, rest) = der_item(certificate).unwrap();
        let mut kept = Vec::new();
        while !tbs.is_empty() {
            let (tag, body, next) = der_item(tbs).unwrap();
            if keep(tag) {
                kept.extend(encode(tag, body));
            }
            tbs = next;
        }
        let mut outer = encode(0x30, &kept);
        outer.extend_from_slice(rest);
        encode(0x30, &outer)
    }

    /// An X.509 v1 certificate (no version field, no extensions) is refused in words that
    /// say what to do, not as rustls' "invalid peer certificate: Other(…)".
    #[test]
    fn a_v1_certificate_is_refused_in_words() {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["a.localhost".into()]).expect("params");
        let cert = params.self_signed(&key).expect("certificate");
        let v1 = without(cert.der(), |tag| tag != 0xa0 && tag != 0xa3);
        let v1_pem = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &v1)
        );
        let line = load(&v1_pem, &key.serialize_pem()).err().expect("refused");
        assert!(
            line.contains("tls.crt") && line.contains("X.509 v1"),
            "{line}"
        );
        assert!(!line.contains("peer"), "{line}");
    }

    /// Each part of a pair that cannot serve is refused with the file it is in, in words
    /// that quote nothing of the key.
    #[test]
    fn a_pair_is_accepted_only_when_valid_as_a_whole() {
        let (cert_a, key_a) = pair("a.localhost");
        let (_, key_b) = pair("b.localhost");
        assert!(load(&cert_a, &key_a).is_ok());
        let half_key = &key_a[..key_a.len() / 2];
        // A passphrase-protected key (as `openssl genpkey -aes256` writes one).
        let encrypted = key_a.replace("PRIVATE KEY", "ENCRYPTED PRIVATE KEY");
        // A PEM key whose contents no signer takes (a P-521 or RSA-1024 key, say).
        let unusable =
            "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5IGF0IGFsbA==\n-----END PRIVATE KEY-----\n";
        for (cert, key, file, reason) in [
            (
                &cert_a[..],
                &key_b[..],
                "tls.key",
                "does not belong to the certificate",
            ),
            ("", &key_a[..], "tls.crt", "no PEM certificate"),
            (
                &cert_a[..],
                half_key,
                "tls.key",
                "no readable PEM private key",
            ),
            (&cert_a[..], "", "tls.key", "no readable PEM private key"),
            (
                &cert_a[..],
                &encrypted[..],
                "tls.key",
                "the private key is encrypted: give it without its passphrase",
            ),
            (
                &cert_a[..],
                unusable,
                "tls.key",
                "not a usable private key: RSA of 2048 bits or more, ECDSA on P-256 or P-384",
            ),
            // Caught half-written (a rotation): said in words, not as byte values.
            (
                &cert_a[..cert_a.len() / 2],
                &key_a[..],
                "tls.crt",
                "no end line (-----END CERTIFICATE-----): the file is cut short",
            ),
        ] {
            let line = load(cert, key).err().expect("refused");
            assert!(line.starts_with("[E1006]"), "{line}");
            assert!(line.contains(file) && line.contains(reason), "{line}");
            assert!(!line.contains("PRIVATE KEY"), "{line}");
        }
    }
}
