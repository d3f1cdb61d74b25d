//! Parsing and checking individual setting values into typed data.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::uri::{Authority, Scheme, Uri};

use super::keys::Key;
use crate::error::Error;

pub(crate) fn invalid(key: Key, reason: impl Into<String>) -> Error {
    Error::InvalidSetting {
        key: key.name().to_string(),
        reason: reason.into(),
    }
}

/// An upstream base URL: scheme, authority and an optional path prefix.
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    pub scheme: Scheme,
    pub authority: Authority,
    /// Path prefix without a trailing slash ("" for the root).
    pub path: String,
}

/// The first thing in an ASCII `path` that RFC 3986 does not let a path hold as it is, said
/// for an error: a character outside its `pchar`s and `/` (`|`, `"`, `{`, `\`, `^`, a space:
/// the URI parser takes several), or a `%` that starts no escape.
fn not_in_a_path(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let hex = |at: usize| bytes.get(at).is_some_and(u8::is_ascii_hexdigit);
    bytes.iter().enumerate().find_map(|(i, &b)| match b {
        b'%' if hex(i + 1) && hex(i + 2) => None,
        b'%' => Some("a `%` that starts no %XX escape".to_string()),
        b if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&b) => None,
        b if b.is_ascii_graphic() => Some(format!("`{}`", char::from(b))),
        b => Some(format!("`{}`", char::from(b).escape_default())),
    })
}

impl UpstreamUrl {
    pub fn parse(key: Key, raw: &str) -> Result<Self, Error> {
        Self::parse_named(key.name(), raw)
    }

    pub fn parse_named(name: &str, raw: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::InvalidSetting {
            key: name.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = raw
            .parse()
            .map_err(|_| bad("not a URL (expected https://host[:port][/path])"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| bad("missing scheme (https:// or http://)"))?;
        if scheme != Scheme::HTTPS && scheme != Scheme::HTTP {
            return Err(bad("scheme must be https or http"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad("missing host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not accepted"));
        }
        check_authority(&authority).map_err(bad)?;
        if uri.query().is_some() {
            return Err(bad("a query string is not accepted"));
        }
        // Sent as written, before every client path: `/a/../..` reached the upstream so,
        // where a client's own dot segments are refused (400 E5003), in every spelling
        // they are refused in (`%2e%2e`, `..;`, `%2f..`).
        if crate::proxy::route::has_dot_segment(uri.path()) {
            return Err(bad("a path with `.` or `..` segments is not accepted"));
        }
        // The URI parser takes them, and they went upstream as raw bytes in the request
        // line, which a server may refuse or read in another encoding.
        if !uri.path().is_ascii() {
            return Err(bad(
                "a path with characters outside ASCII is not accepted: write them percent-encoded",
            ));
        }
        if let Some(c) = not_in_a_path(uri.path()) {
            return Err(bad(&format!(
                "a path with {c} is not accepted: write it percent-encoded"
            )));
        }
        let path = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl {
            scheme,
            authority,
            path,
        })
    }

    pub fn host(&self) -> &str {
        self.authority.host()
    }

    /// The host with the port when the URL names one: what errors and the log name, so
    /// that two local upstreams on one address (an OpenSandbox and its envd) are told apart.
    pub fn authority(&self) -> &str {
        self.authority.as_str()
    }

    pub fn is_https(&self) -> bool {
        self.scheme == Scheme::HTTPS
    }

    /// The URL for a client request target: the prefix, then the client's path and query.
    pub fn join(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let mut pq = String::with_capacity(self.path.len() + path_and_query.len());
        pq.push_str(&self.path);
        pq.push_str(path_and_query);
        if pq.is_empty() {
            pq.push('/');
        }
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.path)
    }
}

impl fmt::Debug for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A unix socket path's length at most: `sun_path`'s size less the NUL it ends with.
const MAX_SOCKET_PATH: usize = if cfg!(target_os = "linux") { 107 } else { 103 };

/// A listener address: TCP, or a unix socket path (`unix:/path`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ListenAddr {
    pub fn parse(key: Key, raw: &str) -> Result<Self, Error> {
        if let Some(path) = raw.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(invalid(key, "unix: needs a socket path"));
            }
            // No path holds one; `check` said ok and `serve` failed at the bind.
            if path.contains('\0') {
                return Err(invalid(key, "a socket path cannot hold a NUL byte"));
            }
            // Linux's abstract namespace, as systemd, socat and Go spell it; bound as a file
            // named `@…` in the working directory, which no such client reaches. Refused
            // rather than supported: an abstract socket has no file mode, so anyone on the
            // host could connect and spend the key.
            if path.starts_with('@') {
                return Err(invalid(
                    key,
                    "unix:@NAME is an abstract socket, which has no file permissions (anyone \
                     on the host could connect): give a path, such as \
                     unix:/run/abx-proxy/abx-proxy.sock (unix:./@NAME for a file so named)",
                ));
            }
            // Nor a longer one than the kernel's `sun_path` holds, with its NUL.
            if path.len() > MAX_SOCKET_PATH {
                return Err(invalid(
                    key,
                    format!(
                        "a socket path is at most {MAX_SOCKET_PATH} bytes (the kernel's \
                         sun_path); this one is {}",
                        path.len()
                    ),
                ));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        if let Some((host, port)) = raw.rsplit_once(':') {
            if host.eq_ignore_ascii_case("localhost") || host.eq_ignore_ascii_case("localhost.") {
                let port = self::port(port).ok_or_else(|| invalid(key, "bad port"))?;
                return Ok(ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], port))));
            }
        }
        // Names are not looked up: which addresses one has is the resolver's, at each
        // start, and a listener must be where the operator said.
        raw.parse::<SocketAddr>().map(ListenAddr::Tcp).map_err(|_| {
            invalid(
                key,
                "expected ADDRESS:PORT with an IP address or localhost (e.g. 127.0.0.1:49982, \
                 [::1]:49982; host names are not resolved) or unix:/path",
            )
        })
    }

    /// Loopback TCP: the Host check applies; remote exposure needs consent.
    pub fn is_loopback(&self) -> bool {
        // `[::ffff:127.0.0.1]` is loopback too: an IPv6 socket bound there takes IPv4 loopback.
        matches!(self, ListenAddr::Tcp(a) if a.ip().to_canonical().is_loopback())
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            // A socket's path is the operator's, and still must not split or turn a line.
            ListenAddr::Unix(p) => {
                let path = p.to_string_lossy();
                write!(f, "unix:{}", crate::providers::manifest::printable(&path))
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompatMode {
    Rewrite,
    Pass,
}

impl CompatMode {
    pub fn parse(raw: &str) -> Result<Self, Error> {
        match raw {
            "rewrite" => Ok(CompatMode::Rewrite),
            "pass" => Ok(CompatMode::Pass),
            _ => Err(invalid(Key::CompatV2Paths, "expected rewrite or pass")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeScheme {
    RpcV1,
    Acs3,
}

impl ExchangeScheme {
    pub fn parse(raw: &str) -> Result<Self, Error> {
        match raw {
            "rpc-v1" => Ok(ExchangeScheme::RpcV1),
            "acs3" => Ok(ExchangeScheme::Acs3),
            _ => Err(invalid(Key::TokenExchange, "expected rpc-v1 or acs3")),
        }
    }
}

pub(crate) fn seconds(key: Key, raw: &str) -> Result<Duration, Error> {
    raw.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| invalid(key, "expected a whole number of seconds"))
}

/// Region ids go into host names: keep them to what Alibaba uses.
pub(crate) fn check_region(region: &str) -> Result<(), Error> {
    let ok = region
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok && !region.is_empty() {
        Ok(())
    } else {
        Err(invalid(
            Key::Region,
            "expected a region id such as cn-hangzhou",
        ))
    }
}

/// An AccessKey ID is letters and digits (`LTAI…`, an STS one `STS.…`): a control
/// character or a space pasted with one went into the signed call (in ACS3's
/// `Authorization` field) and, by `config get`, to the terminal.
pub(crate) fn check_access_key_id(id: &str) -> Result<(), Error> {
    if id.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(invalid(
            Key::AccessKeyId,
            "expected an AccessKey ID such as LTAI5t…: no spaces or control characters",
        ))
    }
}

/// `sandbox_domain`: a host name, optionally with a port; no scheme, no path.
pub(crate) fn domain(raw: &str) -> Result<String, Error> {
    if is_domain(raw) {
        Ok(raw.to_string())
    } else {
        Err(invalid(Key::SandboxDomain, DOMAIN_EXPECTED))
    }
}

pub(crate) const DOMAIN_EXPECTED: &str =
    "expected a domain such as cn-hangzhou.e2b.fc.aliyuncs.com";

/// Whether a domain (a port beside it or not) is an address: no top-level domain is all
/// digits (RFC 3696 §2). Envd hosts made of one are no hosts: every request to
/// `49983-ID.127.0.0.1` went to the resolver with the sandbox's id and came back 502,
/// which the SDKs read as a sandbox not running.
pub(crate) fn is_address(domain: &str) -> bool {
    let host = domain.parse::<Authority>().map(|a| a.host().to_string());
    let host = host.as_deref().unwrap_or(domain);
    let host = host.strip_suffix('.').unwrap_or(host);
    let top = host.rsplit('.').next().unwrap_or(host);
    !top.is_empty() && top.bytes().all(|b| b.is_ascii_digit())
}

/// Why an address is refused where envd hosts are made of a domain.
pub(crate) const ADDRESS_NO_DOMAIN: &str = "an address is no domain: envd hosts are PORT-ID.DOMAIN";

/// The built-in provider's `sandbox_domain`, where envd hosts are made of it (no
/// `sandbox_url`): no address.
pub(crate) fn domain_names_hosts(domain: &str) -> Result<(), Error> {
    if is_address(domain) {
        return Err(invalid(
            Key::SandboxDomain,
            format!("{ADDRESS_NO_DOMAIN} (to reach envd at one address, set sandbox_url)"),
        ));
    }
    Ok(())
}

/// A host name with an optional port, and nothing else: envd is reached at
/// `https://{port}-{id}.{domain}`, where user info (`…@host`) would move the connection to
/// another host and a path would break every URL.
pub(crate) fn is_domain(raw: &str) -> bool {
    let Ok(authority) = raw.parse::<Authority>() else {
        return false;
    };
    let labels = authority
        .host()
        .strip_suffix('.')
        .unwrap_or(authority.host());
    !raw.contains('@')
        && check_authority(&authority).is_ok()
        && labels.split('.').all(|label| {
            !label.is_empty()
                && (label.bytes()).all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// A port as written in a URL or an address: digits only, 0-65535. `u16::from_str` also
/// takes a leading `+`, which no URL, SDK or user writes for a port.
pub(crate) fn port(digits: &str) -> Option<u16> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A host and, when a port is written, a port that is one. `Authority` takes `h:abc`,
/// `h:99999`, `h:` and `:443`, and a connector then uses the scheme's default port (or no
/// host): a mistyped port must not send a key to port 443 of that host.
fn check_authority(authority: &Authority) -> Result<(), &'static str> {
    let host = authority.host();
    if host.is_empty() {
        return Err("missing host");
    }
    // `Authority` takes anything in brackets (`[1::1::1]`, `[localhost]`, a zone id): it
    // passed, and every request went to DNS and came back 502 (`[127.0.0.1]` even reached
    // past the self-loop check). curl refuses them as it parses the URL.
    if let Some(inside) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        if inside.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(
                "brackets hold an IPv6 address only (a name or an IPv4 address goes without \
                 them; zone ids are not supported)",
            );
        }
    }
    // A name may end in a dot (the root); an address may not: `127.0.0.1.` went to DNS,
    // and every request came back 502. A name whose last label is a number is an address
    // to URL parsers (`127.1`, `0x7f.0.0.1`), and no name has an empty label.
    if !host.starts_with('[') && (host.starts_with('.') || host.contains("..")) {
        return Err("a host name has no empty label (`..`)");
    }
    if let Some(address) = host.strip_suffix('.') {
        let last = address.rsplit('.').next().unwrap_or_default();
        let hex = last.strip_prefix("0x").or_else(|| last.strip_prefix("0X"));
        let numeric = (!last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()))
            || hex.is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
        if numeric {
            return Err("an IPv4 address takes no trailing dot");
        }
    }
    // `host()` is the authority's start when it has no user info (refused before).
    let Some(written) = authority.as_str().get(host.len()..) else {
        return Err("missing host");
    };
    let valid = match written.strip_prefix(':') {
        None => written.is_empty(),
        Some(digits) => port(digits).is_some_and(|p| p != 0),
    };
    if valid {
        Ok(())
    } else {
        Err("the port must be a number from 1 to 65535")
    }
}

/// `30s`, `500ms`, `5m`, `1h`, or a bare number of seconds.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(raw.len());
    let (num, unit) = raw.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {raw:?} (examples: 30s, 500ms, 5m)"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration unit in {raw:?} (ms, s, m, h)")),
    };
    // Also rejects NaN and infinities, which no range contains.
    if !(0.0..=1e9).contains(&secs) {
        return Err(format!("duration out of range: {raw:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("3d").is_err());
    }

    /// The region goes into host names (`api.{region}.…`): nothing that would change
    /// which host that is, or make it no host at all.
    #[test]
    fn access_key_ids_are_printable_and_unspaced() {
        for ok in ["LTAI5tAbCdEf0123456789", "STS.NUabc-_x", ""] {
            assert!(check_access_key_id(ok).is_ok(), "{ok}");
        }
        for bad in ["LTAI\u{1b}[31m", "LTAI 5t", "LTAI\n", "LTAIé"] {
            assert!(check_access_key_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn regions_are_what_alibaba_names_them() {
        for ok in ["cn-hangzhou", "ap-southeast-1", "us-west-1"] {
            assert!(check_region(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "CN-Hangzhou",
            "cn_hangzhou",
            "cn.evil.example",
            "cn-hangzhou/x",
        ] {
            assert!(check_region(bad).is_err(), "{bad:?}");
        }
    }

    /// `sandbox_domain` is a host and an optional port: user info would move every envd
    /// connection to another host, and a scheme or path would break each URL built on it.
    #[test]
    fn a_domain_is_a_host_and_a_port() {
        for ok in [
            "cn-hangzhou.e2b.fc.aliyuncs.com",
            "envd.local:8443",
            "127.0.0.1:9000",
        ] {
            assert_eq!(domain(ok).ok().as_deref(), Some(ok));
        }
        // Where envd hosts are made of it, an address is no domain.
        for ok in [
            "localhost:9000",
            "127.0.0.1.nip.io",
            "e2b-1.example",
            "e2b.app.",
        ] {
            assert!(domain_names_hosts(ok).is_ok(), "{ok:?}");
        }
        for bad in ["127.0.0.1:9000", "127.0.0.1", "10.0.0.1.", "envd.123"] {
            let e = domain_names_hosts(bad).expect_err(bad).to_string();
            assert!(e.contains("set sandbox_url"), "{e}");
        }
        for bad in [
            "",
            "user@evil.example",
            "https://e2b.example",
            "e2b.example/path",
            "e2b example",
            "e2b.example:abc",
            "e2b.example:99999",
            "e2b.example:0",
            "e2b.example:",
            ":443",
            ".",
            "e2b..example",
            "[::1]:1",
        ] {
            assert!(domain(bad).is_err(), "{bad:?}");
        }
        assert!(domain("e2b.example.").is_ok());
    }

    /// A port that is not one is refused, not read as the scheme's default port: the key
    /// would go to port 443 (or 80) of that host.
    #[test]
    fn an_upstream_url_names_a_host_and_a_real_port() {
        for bad in [
            "https://h:99999",
            "https://h:abc",
            "https://h:",
            "https://h:0",
            "https://h:+1",
            "https://:443",
            "http://[::1]:65536/",
            // An address with a root dot went to DNS; dot segments went upstream as written.
            "http://127.0.0.1.:8080",
            "https://h/a/../..",
            "https://h/./api",
            "https://h/api/..",
            "https://h/api/%2e%2e",
            "https://h/a/.%2E",
            "https://h/a%2f..%2fb",
            "https://h/..;/x",
            "http://127.1.:8080",
            "http://0x7f.0.0.1.:8080",
            "http://127.0.0.1..:8080",
            "http://.h:8080",
            // Sent as raw bytes in the request line.
            "https://h/ümlaut",
            "https://h/gw/中",
            "https://h/a|b",
            "https://h/a%22b%zz",
            "https://h/100%",
            "https://h/a^b",
        ] {
            let e = UpstreamUrl::parse(Key::SandboxBaseUrl, bad).expect_err(bad);
            assert!(e.to_string().contains("sandbox_base_url"), "{e}");
        }
        for ok in [
            "https://h:1",
            "https://h:65535/p",
            "http://[::1]:8080",
            "https://h",
            "https://h.example.:1",
            "https://h/a..b/.well-known",
            "https://h/%C3%BCmlaut",
            "https://h/a;b=c/@x:y/~u/!$&'()*+,%2f",
        ] {
            assert!(UpstreamUrl::parse(Key::SandboxBaseUrl, ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn upstream_join_keeps_prefix() {
        let u = UpstreamUrl::parse(Key::SandboxBaseUrl, "http://h:1/api/").unwrap();
        assert_eq!(
            u.join("/sandboxes?x=1").unwrap().to_string(),
            "http://h:1/api/sandboxes?x=1"
        );
        assert!(UpstreamUrl::parse(Key::SandboxBaseUrl, "h:1").is_err());
        assert!(UpstreamUrl::parse(Key::SandboxBaseUrl, "ftp://h").is_err());
    }

    #[test]
    fn listen_addrs() {
        assert!(ListenAddr::parse(Key::Listen, "127.0.0.1:1")
            .unwrap()
            .is_loopback());
        assert!(!ListenAddr::parse(Key::Listen, "0.0.0.0:1")
            .unwrap()
            .is_loopback());
        assert!(ListenAddr::parse(Key::Listen, "[::ffff:127.0.0.1]:1")
            .unwrap()
            .is_loopback());
        assert_eq!(
            ListenAddr::parse(Key::Listen, "unix:/tmp/x.sock").unwrap(),
            ListenAddr::Unix("/tmp/x.sock".into())
        );
        for local in ["localhost:8080", "LocalHost:8080", "localhost.:8080"] {
            assert_eq!(
                ListenAddr::parse(Key::Listen, local).unwrap(),
                ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 8080))),
                "{local}"
            );
        }
        // A name is not looked up: said so, where "expected HOST:PORT" read as a riddle.
        let Err(Error::InvalidSetting { reason, .. }) =
            ListenAddr::parse(Key::Listen, "myhost.local:8080")
        else {
            panic!("a host name taken")
        };
        assert!(reason.contains("host names are not resolved"), "{reason}");
        // What `serve` could never bind, refused where `check` sees it too.
        for bad in [
            "unix:/tmp/a\0b",
            "localhost:+80",
            "localhost:",
            "unix:",
            "unix:@abstract",
        ] {
            assert!(ListenAddr::parse(Key::Listen, bad).is_err(), "{bad:?}");
        }
        let path = |n: usize| format!("unix:/{}", "s".repeat(n - 1));
        assert!(ListenAddr::parse(Key::Listen, &path(MAX_SOCKET_PATH)).is_ok());
        let Err(Error::InvalidSetting { reason, .. }) =
            ListenAddr::parse(Key::Listen, &path(MAX_SOCKET_PATH + 1))
        else {
            panic!("a path sun_path cannot hold taken")
        };
        assert!(
            reason.contains(&format!("at most {MAX_SOCKET_PATH} bytes")),
            "{reason}"
        );
    }
}
