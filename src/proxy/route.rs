//! Phase 1, route: which plane a request belongs to, and whether it may be served at all
//! (Host check against DNS rebinding, no forward-proxying, no ambiguous framing, no plain
//! HTTP on the TLS listener).

use http::request::Parts;
use http::{HeaderValue, Method};

use super::framing::{AmbiguousLength, Refusal};
use super::headers::{E2B_SANDBOX_ID, E2B_SANDBOX_PORT};
use crate::error::Error;
use crate::metrics::Plane;

pub const DEFAULT_ENVD_PORT: u16 = 49983;

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The control plane.
    Api,
    /// A sandbox's envd.
    Envd { sandbox_id: String, port: u16 },
}

impl Route {
    pub fn plane(&self) -> Plane {
        match self {
            Route::Api => Plane::Api,
            Route::Envd { .. } => Plane::Envd,
        }
    }
}

/// Which Host names the listener accepts.
#[derive(Debug, Clone)]
pub enum HostPolicy {
    /// Loopback TCP listener: loopback literals, `localhost`, `*.localhost` only.
    Loopback,
    /// `--allowed-host`: these names (and the loopback ones).
    Listed(Vec<String>),
    /// Without `--allowed-host`, a unix socket or a TCP listener that is not loopback or
    /// has `--allow-remote`: any Host.
    Any,
}

impl HostPolicy {
    /// An absolute-form target names where a forward proxy would go. Whatever Host names
    /// the listener accepts, only its own (local or listed) names pass here: this is not a
    /// forward proxy, and a client configured to use it as one must hear so.
    fn accepts_target(&self, host: &str) -> bool {
        match self {
            HostPolicy::Any => is_local_name(host),
            _ => self.accepts(host),
        }
    }

    fn accepts(&self, host: &str) -> bool {
        match self {
            HostPolicy::Any => true,
            HostPolicy::Loopback => is_local_name(host),
            HostPolicy::Listed(names) => {
                // The names are kept without a trailing dot, an address in one spelling
                // (see `cli::allowed_host`).
                let name = host.strip_suffix('.').unwrap_or(host);
                let inside = name.strip_prefix('[').and_then(|n| n.strip_suffix(']'));
                let addr = inside.and_then(|a| a.parse::<std::net::Ipv6Addr>().ok());
                // Only an address is spelt anew (and allocated for), an IPv4 one written as
                // IPv6 as IPv4.
                let name = match addr.map(|a| a.to_canonical()) {
                    Some(std::net::IpAddr::V6(a)) => std::borrow::Cow::Owned(format!("[{a}]")),
                    Some(std::net::IpAddr::V4(a)) => std::borrow::Cow::Owned(a.to_string()),
                    None => std::borrow::Cow::Borrowed(name),
                };
                is_local_name(host) || names.iter().any(|n| n.eq_ignore_ascii_case(&name))
            }
        }
    }
}

/// A browser's cross-site request passes the Host check (the page names the proxy's own
/// address), so the Host check alone does not keep a web page from spending the key: a
/// `fetch` from any site to `http://127.0.0.1:49982/sandboxes` would go out with it, and
/// the upstream's CORS answer could even let the page read the result. Browsers say where a
/// request comes from; a page's origin must be one the listener would accept as Host.
/// Clients outside browsers (the SDKs, curl) send neither field.
///
/// One kind of local origin is not the user's: `<port>-<id>.localhost` is a sandbox's own
/// port, served through this proxy, and what it serves (an app the agent wrote) may be
/// anything. Its pages reach their own origin only (`own`, the sandbox the Host names): a
/// form posted to `localhost:49982/sandboxes` or to another sandbox's envd would go out
/// with the key or that sandbox's token.
///
/// A listener that serves any Host (`--allow-remote`, a unix socket) serves any site's
/// pages: whoever can reach it may use it. Not a sandbox's, though, nor a page whose
/// origin is hidden (`null`: a sandboxed frame, as OpenSandbox serves its apps): those
/// pages are the proxy's own content, and a unix socket behind a loopback bridge (how the
/// SDKs reach one) let them spend the key and every sandbox's token. Their requests that
/// carry no `Origin` (a `<script>`, a navigation) say `cross-site` to a local name, which
/// no other site's page has reason to load from.
fn check_origin(
    fields: &Fields<'_>,
    policy: &HostPolicy,
    hostname: &str,
    own: Option<(u16, &str)>,
) -> Result<(), Error> {
    // Under any Host, `accepts` takes every origin that names a host.
    if let Some(origin) = fields.origin {
        let host = origin.to_str().ok().and_then(origin_host);
        return match host {
            Some(h) if policy.accepts(h) && sandbox_host(h).is_ok_and(|o| same_sandbox(o, own)) => {
                Ok(())
            }
            // The page's origin, as much of it as names one (the field can be long).
            _ => Err(refused(format!(
                "cross-origin request from {}",
                String::from_utf8_lossy(&origin.as_bytes()[..origin.len().min(100)])
            ))),
        };
    }
    // No `Origin`: a navigation, or a `no-cors` GET (`<img>`, `<script>`). Browsers mark
    // those from another site; a local page's own requests carry `Origin`. A name below
    // `localhost` shares its site with every name below it (no public suffix list names
    // `localhost`, so `X.localhost` is a site): under `*.e2b.localhost` every sandbox, the
    // control plane's `api.e2b.localhost` and `e2b.localhost` itself are one site, and a
    // sandbox's page at `3000-<a>.49983-<b>.localhost` is `same-site` to `<b>`'s envd.
    // `localhost` itself is a site no sandbox shares.
    let any = matches!(policy, HostPolicy::Any) && !is_local_name(hostname);
    match fields.site.map(HeaderValue::as_bytes) {
        Some(site) if site.eq_ignore_ascii_case(b"cross-site") && !any => Err(refused(
            "cross-site request from a browser (Sec-Fetch-Site: cross-site)",
        )),
        Some(site) if site.eq_ignore_ascii_case(b"same-site") && below_localhost(hostname) => {
            Err(refused(
                "same-site request from a browser to a name below localhost, whose site \
                 sandboxes may share (Sec-Fetch-Site: same-site, no Origin)",
            ))
        }
        _ => Ok(()),
    }
}

/// A name below `localhost` (`app.localhost`, `api.e2b.localhost`).
fn below_localhost(hostname: &str) -> bool {
    ends_with_ignore_case(hostname.trim_end_matches('.'), ".localhost")
}

/// Whether a page's origin may reach the request's Host: any origin that is not a
/// sandbox's, and a sandbox's only to the same sandbox and port.
fn same_sandbox(origin: Option<(u16, &str)>, own: Option<(u16, &str)>) -> bool {
    match (origin, own) {
        (None, _) => true,
        (Some((op, oid)), Some((p, id))) => op == p && oid.eq_ignore_ascii_case(id),
        (Some(_), None) => false,
    }
}

/// The fields the route phase decides on besides the routing headers, found in one pass
/// over the few a request has: separate look-ups, mostly for absent names, hashed each
/// name on every request.
struct Fields<'a> {
    hosts: usize,
    host: Option<&'a HeaderValue>,
    origin: Option<&'a HeaderValue>,
    site: Option<&'a HeaderValue>,
}

impl<'a> Fields<'a> {
    fn of(headers: &'a http::HeaderMap) -> Self {
        let mut fields = Fields {
            hosts: 0,
            host: None,
            origin: None,
            site: None,
        };
        for (name, value) in headers {
            if name == http::header::HOST {
                fields.hosts += 1;
                fields.host = Some(value);
            } else if name == http::header::ORIGIN {
                fields.origin = fields.origin.or(Some(value));
            } else if name == SEC_FETCH_SITE {
                fields.site = fields.site.or(Some(value));
            }
        }
        fields
    }
}

const SEC_FETCH_SITE: http::HeaderName = http::HeaderName::from_static("sec-fetch-site");

/// The host of a serialized origin (`scheme://host[:port]`); `None` for `null` (sandboxed
/// frames, `file:` pages) and anything else that names no host.
fn origin_host(origin: &str) -> Option<&str> {
    let (scheme, rest) = origin.split_once("://")?;
    if scheme.is_empty() || rest.is_empty() || rest.contains(['/', '@', '?', '#']) {
        return None;
    }
    Some(strip_port(rest))
}

/// `127.0.0.0/8`, `[::1]`, `localhost`, `*.localhost` (host without port).
pub fn is_local_name(host: &str) -> bool {
    let h = host.trim_end_matches('.');
    // What nearly every local client sends, without parsing an address per request.
    if h == "127.0.0.1" {
        return true;
    }
    if h.eq_ignore_ascii_case("localhost") || ends_with_ignore_case(h, ".localhost") {
        return true;
    }
    if let Some(v6) = h.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        // `[::ffff:127.0.0.1]` reaches IPv4 loopback from an IPv6 socket.
        return v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| a.to_canonical().is_loopback());
    }
    h.parse::<std::net::Ipv4Addr>()
        .is_ok_and(|a| a.is_loopback())
}

fn ends_with_ignore_case(s: &str, suffix: &str) -> bool {
    s.len() >= suffix.len()
        && s.is_char_boundary(s.len() - suffix.len())
        && s[s.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
}

/// Splits `host[:port]` (IPv6 literals keep their brackets).
fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return match authority.find(']') {
            Some(i) => &authority[..=i],
            None => authority,
        };
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    }
}

fn refused(reason: impl Into<String>) -> Error {
    Error::Refused {
        reason: reason.into(),
    }
}

/// Marks a request that came as plain HTTP to the TLS listener (an `http://` URL where
/// `https://` was meant, the commonest TLS mistake): it is answered with what to change,
/// where a TLS alert would reach the client as an empty reply or garbage.
#[derive(Clone, Copy)]
pub struct PlainOnTls;

/// Which plane a request goes to, and whether it may be sent at all: its form, its Host
/// (the DNS-rebinding defence of SPEC §4) and its page origin, its path, then the sandbox
/// it names, by Host or by the `E2b-Sandbox-*` headers.
pub fn route(parts: &Parts, policy: &HostPolicy) -> Result<Route, Error> {
    refuse_unforwardable(parts)?;
    let named = checked_host(parts, policy)?;
    // Dot segments are the upstream's to resolve, or not: under a base URL with a path
    // (`https://gateway/api`), `/../admin` left the prefix the key was set up for at any
    // upstream that resolves them. nginx resolves them before mapping the path; curl and
    // browsers send none.
    if has_dot_segment(parts.uri.path()) {
        return Err(refused(
            "a path with a `.` or `..` segment: send the path resolved (the proxy does \
             not rewrite paths)",
        ));
    }
    plane(parts, named)
}

/// The requests no upstream is sent, whatever their Host: the forms a forward proxy or a
/// server itself would answer, and those framed so that a peer on the path may read them
/// otherwise.
fn refuse_unforwardable(parts: &Parts) -> Result<(), Error> {
    if parts.extensions.get::<PlainOnTls>().is_some() {
        return Err(refused(
            "plain HTTP sent to the TLS listener: use https:// to reach this proxy",
        ));
    }
    if parts.extensions.get::<AmbiguousLength>().is_some() {
        // Some peer on the path may have framed this differently: request smuggling.
        let why = parts.extensions.get::<Refusal>().copied();
        return Err(refused(why.unwrap_or(Refusal::BothLengths).reason()));
    }
    if parts.method == Method::CONNECT {
        return Err(refused(
            "CONNECT is not supported: this is not a forward proxy",
        ));
    }
    // TRACE asks the server to echo the request back, credential and all (RFC 9110
    // §9.3.8): a client that may only spend the key through the proxy would get a copy.
    // nginx refuses it too. Methods are case-sensitive, but a server may not be: `trace`
    // is refused as well, as is IIS's TRACK.
    let method = parts.method.as_str();
    if method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK") {
        return Err(refused(format!(
            "{method} is not forwarded: the answer would echo the credential"
        )));
    }
    // The authority form (`GET 127.0.0.1:80`) is CONNECT's alone (RFC 9112 §3.2.3), yet
    // hyper and the fast path parse it for any method. Served, its authority would stand
    // in for Host below (a `Host: evil.example` beside it unchecked), and it would go
    // upstream as `GET /` with the key. HTTP/2 always names a scheme beside :authority.
    if parts.uri.authority().is_some() && parts.uri.scheme().is_none() {
        return Err(refused(
            "authority-form request target: only CONNECT names a bare host:port, \
             and this is not a forward proxy",
        ));
    }
    // The asterisk form (`OPTIONS *`, RFC 9112 §3.2.4) asks about this server, not a
    // resource: forwarded, it went upstream with the key, joined to a base URL's path as
    // `/api*`. nginx refuses it too.
    if parts.uri.path() == "*" {
        return Err(refused(
            "asterisk-form request target (*): it names no resource to forward",
        ));
    }
    Ok(())
}

/// The Host the request names, checked against the listener's policy and the page origin
/// that sent it; the sandbox it names in the `<port>-<id>.localhost` form, if any.
fn checked_host<'p>(
    parts: &'p Parts,
    policy: &HostPolicy,
) -> Result<Option<(u16, &'p str)>, Error> {
    let fields = Fields::of(&parts.headers);
    if fields.hosts > 1 {
        // RFC 9112 §3.2: which one a peer on the path reads is anyone's guess.
        return Err(refused("more than one Host header"));
    }
    // RFC 9113 §8.3.1: an HTTP/2 Host naming another host than :authority is malformed.
    // The check below reads :authority; a peer further on may read Host.
    if parts.version == http::Version::HTTP_2 {
        // The h2 layer refuses lengths that differ, and passes equal ones on as written:
        // refused here as the HTTP/1.1 framing watch refuses them, so that both versions
        // meet one rule and no upstream sees the field twice.
        let mut lengths = parts.headers.get_all(http::header::CONTENT_LENGTH).iter();
        let length = lengths.next();
        if length.is_some() && lengths.next().is_some() {
            return Err(refused(Refusal::RepeatedLength.reason()));
        }
        // The h2 layer takes up to 19 digits; HTTP/1.1's watch refuses what it does.
        let huge = length
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|n| n > i64::MAX as u64);
        if huge {
            return Err(refused(Refusal::HugeLength.reason()));
        }
        if let (Some(authority), Some(host)) = (parts.uri.authority(), fields.host) {
            if !host
                .as_bytes()
                .eq_ignore_ascii_case(authority.as_str().as_bytes())
            {
                return Err(refused("Host differs from :authority"));
            }
        }
    }
    // HTTP/2 carries the target in :authority; HTTP/1.1 absolute-form too. Either way the
    // named host is the one checked, so `GET http://example.com/` cannot pass as local.
    let host = match parts.uri.authority() {
        Some(a) => a.as_str(),
        None => match parts
            .headers
            .get(http::header::HOST)
            .map(HeaderValue::to_str)
        {
            Some(Ok(h)) => h,
            Some(Err(_)) => return Err(refused("invalid Host header")),
            None if parts.version < http::Version::HTTP_11 => "",
            None => return Err(refused("missing Host header")),
        },
    };
    // RFC 9112 §3.2: a Host that is no `host[:port]` is answered 400. Unchecked, anything
    // ending in `.localhost` passed as local (`evil.example/x.localhost`, `a b.localhost`),
    // and userinfo (`user@49983-isb-a.localhost`, which RFC 9110 §4.2.4 makes an error)
    // hid a sandbox's name, so its request went to the control plane with the key.
    let Some(hostname) = host_of(host) else {
        return Err(refused(match parts.uri.authority() {
            Some(_) if parts.version == http::Version::HTTP_2 => "invalid :authority",
            Some(_) => "invalid host in the request target",
            None => "invalid Host header",
        }));
    };
    let absolute_form = parts.uri.scheme().is_some() && parts.version < http::Version::HTTP_2;
    if absolute_form && !policy.accepts_target(hostname) {
        return Err(refused(format!(
            "absolute-form request to another host: {hostname}"
        )));
    }
    if !host.is_empty() && !policy.accepts(hostname) {
        // A user who reaches the proxy by another name (an /etc/hosts alias, the name on
        // the listener's certificate) reads this in the SDK's error: the flag is the fix.
        return Err(refused(format!(
            "Host not allowed on this listener: {hostname} (start the proxy with \
             --allowed-host {hostname} to accept it)"
        )));
    } else if host.is_empty() && !matches!(policy, HostPolicy::Any) {
        return Err(refused("missing Host header"));
    }
    let named = sandbox_host(hostname)?;
    check_origin(&fields, policy, hostname, named)?;
    Ok(named)
}

/// The plane of a request that passed the checks: envd's when it names a sandbox by the
/// `E2b-Sandbox-*` headers or by its Host (`named`), the control plane's otherwise.
fn plane(parts: &Parts, named: Option<(u16, &str)>) -> Result<Route, Error> {
    // The constants, not strings: a `&str` key is parsed into a name on every call.
    if let Some(id) = parts.headers.get(&E2B_SANDBOX_ID) {
        let id = id
            .to_str()
            .ok()
            .filter(|s| valid_sandbox_id(s))
            .ok_or_else(|| refused("invalid E2b-Sandbox-Id"))?;
        let port = header_port(parts).ok_or_else(|| refused("invalid E2b-Sandbox-Port"))?;
        // A Host that names a sandbox and headers that name another: which one a client
        // meant is unknowable, and a page served from the Host's sandbox could otherwise
        // send its own origin's requests (no `Origin` on a same-origin GET) to another.
        if named.is_some_and(|n| !same_sandbox(Some(n), Some((port, id)))) {
            return Err(refused(
                "E2b-Sandbox-Id/E2b-Sandbox-Port name another sandbox or port than Host",
            ));
        }
        if named.is_none() && control_planes_despite_headers(port, parts.uri.path()) {
            return Ok(Route::Api);
        }
        // A Host that names it too says how the cloud spells it (see below).
        let sandbox_id = match named {
            Some((_, named_id)) => named_id.to_ascii_lowercase(),
            None => id.to_string(),
        };
        return Ok(Route::Envd { sandbox_id, port });
    }
    // A host name's case is no part of it (RFC 4343): `49983-ISB-A1.LOCALHOST` is the
    // sandbox the cloud names `isb-a1`, whose token the store holds under that spelling.
    if let Some((port, id)) = named {
        return Ok(Route::Envd {
            sandbox_id: id.to_ascii_lowercase(),
            port,
        });
    }
    Ok(Route::Api)
}

/// The plane a request [`route`] refused is counted under (SPEC §4): envd's when it names
/// a sandbox, by a Host of the `<port>-<id>.localhost` shape, however ill-formed, or by
/// `E2b-Sandbox-Id` (but on the paths [`control_planes_despite_headers`] gives the control
/// plane, as `route` does). Counted as the control plane's, envd's refusals left per-plane
/// error ratios. The caller adds the requests that name a sandbox by a token alone
/// (`Proxy::by_token`, which needs the token store).
pub fn refused_plane(parts: &Parts) -> Plane {
    let host = match parts.uri.authority() {
        Some(a) => Some(a.as_str()),
        None => (parts.headers.get(http::header::HOST)).and_then(|h| h.to_str().ok()),
    };
    let by_host = host
        .and_then(host_of)
        .is_some_and(|h| !matches!(sandbox_host(h), Ok(None)));
    let by_header = parts.headers.contains_key(&E2B_SANDBOX_ID)
        && !header_port(parts).is_some_and(|p| control_planes_despite_headers(p, parts.uri.path()));
    if by_host || by_header {
        Plane::Envd
    } else {
        Plane::Api
    }
}

/// `E2b-Sandbox-Port`, envd's when absent; `None` when it names no port.
fn header_port(parts: &Parts) -> Option<u16> {
    match parts.headers.get(&E2B_SANDBOX_PORT) {
        None => Some(DEFAULT_ENVD_PORT),
        Some(p) => p.to_str().ok().and_then(|p| port_number(p.trim())),
    }
}

/// e2b Python 2.10-2.20 send the routing headers on their control-plane connect too
/// (`POST /sandboxes/{id}/connect`), which E2B's API ignores: sent to envd, which serves no
/// `/sandboxes` path, the connect got a 404 and `Sandbox.connect` failed. On envd's port
/// only: another port is a sandbox app's, whose paths are its own.
fn control_planes_despite_headers(port: u16, path: &str) -> bool {
    port == DEFAULT_ENVD_PORT && is_control_plane_path(path)
}

/// envd's own paths (its Connect services and its HTTP API), which no control plane serves.
pub fn is_envd_path(path: &str) -> bool {
    path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
        || matches!(path, "/files" | "/health" | "/envs" | "/init" | "/metrics")
}

/// The control plane's sandbox collection (`/sandboxes…`, `/v2/sandboxes…`): no envd path.
fn is_control_plane_path(path: &str) -> bool {
    let rest = path.strip_prefix("/v2").unwrap_or(path);
    rest.strip_prefix("/sandboxes")
        .is_some_and(|r| r.is_empty() || r.starts_with('/'))
}

/// `<port>-<sandboxId>.localhost`: the port is the digits before the first dash. A name of
/// that shape whose port or id cannot be one (`0-…`, `65536-…`, `49983-isb_a`) is an
/// error, not another local name: served as one, a sandbox's request (its signed URL's
/// query included) would go to the control plane with the key.
///
/// The first label names the sandbox, under `.localhost` or a name below it
/// (`49983-<id>.e2b.localhost`): SDKs without `E2B_SANDBOX_URL` (e2b 1.x to 2.5) reach envd
/// only at `https://<port>-<id>.<E2B_DOMAIN>`, and no TLS stack takes a `*.localhost`
/// certificate for it; `*.e2b.localhost` they take (`api.e2b.localhost` is then the
/// control plane's).
fn sandbox_host(host: &str) -> Result<Option<(u16, &str)>, Error> {
    let h = host.trim_end_matches('.');
    if !ends_with_ignore_case(h, ".localhost") {
        return Ok(None);
    }
    let name = &h[..h.len() - ".localhost".len()];
    let label = name.split('.').next().unwrap_or(name);
    let Some((port, id)) = label.split_once('-') else {
        return Ok(None);
    };
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(None);
    }
    let Some(port) = port_number(port) else {
        return Err(refused(
            "invalid sandbox host: the port before the first dash must be 1-65535",
        ));
    };
    if !valid_sandbox_id(id) {
        return Err(refused(
            "invalid sandbox host: the sandbox id must be letters, digits and dashes, \
             at most 128",
        ));
    }
    Ok(Some((port, id)))
}

/// The host of `host[:port]` as RFC 3986 spells an authority, without userinfo (an IP
/// literal keeps its brackets, as in [`strip_port`]): `None` unless the host is of its
/// characters (or an IP literal in brackets) and, after one `:`, digits only. By form, not
/// only by characters: `x:1:49983-isb-a.localhost` and `[::1]junk` left a name that
/// `strip_port` read otherwise.
fn host_of(authority: &str) -> Option<&str> {
    const SUB_DELIMS: &[u8] = b"-._~!$&'()*+,;=%";
    let host_char = |b: u8| b.is_ascii_alphanumeric() || SUB_DELIMS.contains(&b);
    let (host, host_ok, port) = match authority.strip_prefix('[') {
        // An IPv6 address (a zone after `%`), or an IPvFuture.
        Some(literal) => {
            let (inside, port) = literal.split_once(']')?;
            let host = &authority[..inside.len() + 2];
            (
                host,
                inside.bytes().all(|b| b == b':' || host_char(b)),
                port,
            )
        }
        None => {
            let (host, port) = authority.split_at(authority.rfind(':').unwrap_or(authority.len()));
            (host, host.bytes().all(host_char), port)
        }
    };
    let port_ok = port.is_empty()
        || port
            .strip_prefix(':')
            .is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()));
    (host_ok && port_ok).then_some(host)
}

/// Whether a segment of `path` is `.` or `..`: percent-encoded (`%2e`) or not, with
/// parameters after it (`..;`, `..%3b`, which Tomcat reads as `..`) or a NUL (`..%00`,
/// which a server that decodes the path and cuts it there reads so), and between any of
/// the separators an upstream may read as `/`: `\` (WHATWG URL parsers, as in Node) and
/// `%2f` or `%5c` (gateways that decode before they resolve, nginx among them).
pub fn has_dot_segment(path: &str) -> bool {
    // Most paths have neither: no scan then.
    if !path.bytes().any(|b| b == b'.' || b == b'%') {
        return false;
    }
    let mut rest = path.as_bytes();
    loop {
        let cut = (0..rest.len()).find_map(|i| separator(&rest[i..]).map(|n| (i, n)));
        let segment = cut.map_or(rest, |(i, _)| &rest[..i]);
        if is_dot_segment(segment) {
            return true;
        }
        match cut {
            Some((i, n)) => rest = &rest[i + n..],
            None => return false,
        }
    }
}

/// The length of the segment separator `path` starts with, if it does.
fn separator(path: &[u8]) -> Option<usize> {
    match path {
        [b'/' | b'\\', ..] => Some(1),
        [b'%', b'2', c, ..] if c.eq_ignore_ascii_case(&b'f') => Some(3),
        [b'%', b'5', c, ..] if c.eq_ignore_ascii_case(&b'c') => Some(3),
        _ => None,
    }
}

fn is_dot_segment(segment: &[u8]) -> bool {
    let mut rest = segment;
    let mut dots = 0;
    loop {
        match rest {
            [] | [b';', ..] | [b'%', b'0', b'0', ..] => break,
            [b'%', b'3', c, ..] if c.eq_ignore_ascii_case(&b'b') => break,
            [b'.', tail @ ..] => rest = tail,
            [b'%', b'2', e, tail @ ..] if e.eq_ignore_ascii_case(&b'e') => rest = tail,
            _ => return false,
        }
        dots += 1;
    }
    dots == 1 || dots == 2
}

/// A port as a client writes one: digits only, 1-65535.
fn port_number(digits: &str) -> Option<u16> {
    crate::settings::values::port(digits).filter(|p| *p != 0)
}

/// Sandbox ids become part of a host name upstream: letters, digits and dashes only.
pub fn valid_sandbox_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// e2b Python 2.10-2.20's connect carries the routing headers (envd's port): it is the
    /// control plane's; an app's port, or a Host naming the sandbox, keeps it envd's.
    #[test]
    fn a_control_plane_path_with_envd_headers_is_the_control_planes() {
        let p = HostPolicy::Loopback;
        let routed = |path: &str, port: Option<&str>, host: &str| {
            let mut h = vec![("host", host), ("e2b-sandbox-id", "isb-a1")];
            h.extend(port.map(|p| ("e2b-sandbox-port", p)));
            route(&parts(path, &h), &p).unwrap()
        };
        let envd = |port| Route::Envd {
            sandbox_id: "isb-a1".into(),
            port,
        };
        for path in [
            "/sandboxes/isb-a1/connect",
            "/v2/sandboxes/isb-a1/connect",
            "/sandboxes",
            "/v2/sandboxes?state=running",
            "/sandboxes/isb-a1",
        ] {
            assert_eq!(
                routed(path, Some("49983"), "localhost"),
                Route::Api,
                "{path}"
            );
            assert_eq!(routed(path, None, "localhost"), Route::Api, "{path}");
            assert_eq!(
                routed(path, Some("8080"), "localhost"),
                envd(8080),
                "{path}"
            );
            assert_eq!(
                routed(path, None, "49983-isb-a1.localhost"),
                envd(49983),
                "{path}"
            );
        }
        for path in [
            "/sandboxesx",
            "/v2/sandboxesx/a",
            "/files",
            "/v3/sandboxes",
            "/x/sandboxes",
        ] {
            assert_eq!(
                routed(path, Some("49983"), "localhost"),
                envd(49983),
                "{path}"
            );
        }
    }

    /// The first label names the sandbox under a name below `.localhost` too: the host
    /// form of SDKs without `E2B_SANDBOX_URL` given `E2B_DOMAIN=e2b.localhost:49982` (a
    /// `*.e2b.localhost` certificate covers it; no TLS stack takes `*.localhost`).
    #[test]
    fn a_sandbox_host_below_a_name_under_localhost_is_the_sandbox() {
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            for (host, port, id) in [
                ("49983-isb-a1.e2b.localhost:49982", 49983, "isb-a1"),
                ("3000-ISB-A1.E2B.localhost", 3000, "isb-a1"),
                ("49983-isb-a1.a.b.localhost.", 49983, "isb-a1"),
            ] {
                assert_eq!(
                    route(&parts("/files", &[("host", host)]), &p).unwrap(),
                    Route::Envd {
                        sandbox_id: id.into(),
                        port
                    },
                    "{host}"
                );
            }
        }
    }

    #[test]
    fn a_refused_request_naming_a_sandbox_is_envds() {
        let plane = |uri: &str, headers: &[(&str, &str)]| refused_plane(&parts(uri, headers));
        let p = HostPolicy::Loopback;
        for headers in [
            &[("host", "localhost"), ("e2b-sandbox-id", "isb_bad!")][..],
            &[("host", "49983-isb_BAD.localhost:1")],
            &[("host", "0-isb-a.localhost")],
            &[
                ("host", "localhost"),
                ("e2b-sandbox-id", "isb-a"),
                ("e2b-sandbox-port", "99999"),
            ],
            &[("host", "evil.example"), ("e2b-sandbox-id", "isb-a")],
        ] {
            assert!(route(&parts("/files", headers), &p).is_err(), "{headers:?}");
            assert_eq!(plane("/files", headers), Plane::Envd, "{headers:?}");
        }
        assert_eq!(
            plane("/a/%2e%2e/b", &[("host", "49983-isb-a.localhost")]),
            Plane::Envd
        );
        for headers in [
            &[("host", "evil.example")][..],
            &[("host", "localhost")],
            &[("host", "api.localhost")],
            &[],
        ] {
            assert_eq!(plane("/a/%2e%2e/b", headers), Plane::Api, "{headers:?}");
        }
        assert_eq!(plane("http://49983-isb-a.localhost/x", &[]), Plane::Envd);
        // The control plane's paths with envd's port are the control plane's, as routed.
        let connect = "/sandboxes/isb-a/./connect";
        let headers = [("host", "localhost"), ("e2b-sandbox-id", "isb-a")];
        assert_eq!(plane(connect, &headers), Plane::Api);
        let port = |p| [headers[0], headers[1], ("e2b-sandbox-port", p)];
        assert_eq!(plane(connect, &port("49983")), Plane::Api);
        assert_eq!(plane(connect, &port("3000")), Plane::Envd);
        assert_eq!(
            plane(connect, &[("host", "49983-isb-a.localhost")]),
            Plane::Envd
        );
    }

    #[test]
    fn planes() {
        let p = HostPolicy::Loopback;
        assert_eq!(
            route(&parts("/sandboxes", &[("host", "127.0.0.1:49982")]), &p).unwrap(),
            Route::Api
        );
        assert_eq!(
            route(
                &parts(
                    "/files",
                    &[("host", "localhost"), ("e2b-sandbox-id", "isb-a1")]
                ),
                &p
            )
            .unwrap(),
            Route::Envd {
                sandbox_id: "isb-a1".into(),
                port: 49983
            }
        );
        assert_eq!(
            route(
                &parts("/files", &[("host", "49983-isb-abc-1.localhost:49982")]),
                &p
            )
            .unwrap(),
            Route::Envd {
                sandbox_id: "isb-abc-1".into(),
                port: 49983
            }
        );
        // Host names are case-insensitive: the id as the cloud spells it, also when the
        // headers name the same sandbox in another case.
        for id in [None, Some("ISB-ABC-1"), Some("isb-abc-1")] {
            let mut headers = vec![("host", "49983-ISB-Abc-1.LOCALHOST:49982")];
            headers.extend(id.map(|id| ("e2b-sandbox-id", id)));
            assert_eq!(
                route(&parts("/files", &headers), &p).unwrap(),
                Route::Envd {
                    sandbox_id: "isb-abc-1".into(),
                    port: 49983
                },
                "{id:?}"
            );
        }
    }

    #[test]
    fn dot_segments_in_every_spelling() {
        for path in [
            "/..",
            "/../a",
            "/a/./b",
            "/a/%2E%2e/b",
            "/%2e/",
            "/..;x/a",
            "/a/.;",
            "/a%2f..%2f..%2fadmin",
            "/%2e%2e%2Fadmin",
            "/..\\admin",
            "/a\\.\\b",
            "/a/..%3b/b",
            "/x%5C..%5cy",
            "/a/..%00/b",
            "/%2e%00",
        ] {
            assert!(has_dot_segment(path), "{path}");
        }
        for path in [
            "/",
            "/a.b/c",
            "/.../a",
            "/..a/b",
            "/%2e%2e%2e",
            "/a%2fb..",
            "/.env",
            "/a%2Fb",
            "/x..y/.well-known",
            "/process.Process/Start",
            "/a%00b",
            "/..x%00",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }

    #[test]
    fn hosts_by_form() {
        for ok in [
            "",
            "localhost",
            "127.0.0.1:49982",
            "[::1]",
            "[::1]:49982",
            "[fe80::1%25lo]:1",
            "3000-isb-1.localhost.",
            "localhost:",
            "my_host.localhost",
        ] {
            assert_eq!(host_of(ok), Some(strip_port(ok)), "{ok}");
        }
        for bad in [
            "user@49983-isb-d.localhost",
            "evil.example/x.localhost",
            "evil.example x.localhost",
            "x:1:49983-isb-1.localhost",
            "a:b.localhost",
            "[::1]junk",
            "[::1]:abc",
            "[::1]:1:2",
            "[::1",
            "::1",
        ] {
            assert!(host_of(bad).is_none(), "{bad}");
        }
    }

    /// `OPTIONS *` and any other method with the asterisk form: refused, never forwarded.
    #[test]
    fn the_asterisk_form_is_refused() {
        let p = HostPolicy::Loopback;
        for method in [Method::OPTIONS, Method::GET] {
            let mut req = parts("*", &[("host", "localhost")]);
            req.method = method.clone();
            let e = route(&req, &p).expect_err("refused");
            assert!(e.to_string().contains("asterisk-form"), "{method}: {e}");
            assert_eq!(e.code(), "E5003");
        }
    }

    #[test]
    fn host_check() {
        let p = HostPolicy::Loopback;
        for ok in [
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:49982",
            "[::ffff:127.0.0.1]:49982",
            "localhost",
            "LOCALHOST:1",
            "a.localhost",
        ] {
            assert!(route(&parts("/", &[("host", ok)]), &p).is_ok(), "{ok}");
        }
        for bad in [
            "evil.com",
            "localhost.evil.com",
            "10.0.0.1",
            "[::2]",
            "[::ffff:10.0.0.1]",
            "[::127.0.0.1]",
            "127.0.0.1.evil.com",
        ] {
            let e = route(&parts("/", &[("host", bad)]), &p).unwrap_err();
            assert_eq!(e.code(), "E5003", "{bad}");
        }
        let e = route(&parts("http://example.com/x", &[("host", "127.0.0.1")]), &p).unwrap_err();
        assert_eq!(e.code(), "E5003");
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            let two = [("host", "localhost"), ("host", "evil.example")];
            let e = route(&parts("/", &two), &p).unwrap_err();
            assert!(e.to_string().contains("more than one Host"), "{e}");
        }
        let listed = HostPolicy::Listed(vec!["proxy.internal".into()]);
        assert!(route(&parts("/", &[("host", "proxy.internal:49982")]), &listed).is_ok());
        assert!(route(&parts("/", &[("host", "other")]), &listed).is_err());
    }

    #[test]
    fn absolute_form_to_a_foreign_host_is_refused_whatever_hosts_are_served() {
        for p in [
            HostPolicy::Any,
            HostPolicy::Loopback,
            HostPolicy::Listed(vec!["proxy.internal".into()]),
        ] {
            let e = route(
                &parts("http://example.com/x", &[("host", "example.com")]),
                &p,
            )
            .unwrap_err();
            assert_eq!(e.code(), "E5003", "{p:?}");
            assert!(e.to_string().contains("absolute-form"), "{e}");
            assert!(route(&parts("http://localhost:49982/x", &[("host", "x")]), &p).is_ok());
        }
        let listed = HostPolicy::Listed(vec!["proxy.internal".into()]);
        assert!(route(&parts("http://proxy.internal/x", &[]), &listed).is_ok());
        // Any Host is still served on such a listener, in origin-form.
        assert!(route(&parts("/x", &[("host", "example.com")]), &HostPolicy::Any).is_ok());
    }

    #[test]
    fn planes_are_named_as_in_metrics() {
        assert_eq!(Route::Api.plane().label(), "api");
        let envd = Route::Envd {
            sandbox_id: "isb-1".into(),
            port: 49983,
        };
        assert_eq!(envd.plane().label(), "envd");
    }

    fn versioned(version: http::Version, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut p = parts(uri, headers);
        p.version = version;
        p
    }

    /// Only HTTP/1.0 may leave Host out (RFC 9112 §3.2), and then only on a listener that
    /// serves any Host: a loopback one cannot tell such a request from a rebinding attack.
    #[test]
    fn only_http_1_0_may_omit_host_and_only_where_any_host_is_served() {
        use http::Version;
        let bare = versioned(Version::HTTP_10, "/x", &[]);
        assert_eq!(route(&bare, &HostPolicy::Any).unwrap(), Route::Api);
        for p in [
            HostPolicy::Loopback,
            HostPolicy::Listed(vec!["proxy.internal".into()]),
        ] {
            let e = route(&bare, &p).unwrap_err();
            assert!(e.to_string().contains("missing Host"), "{p:?}: {e}");
        }
        for p in [HostPolicy::Any, HostPolicy::Loopback] {
            let e = route(&versioned(Version::HTTP_11, "/x", &[]), &p).unwrap_err();
            assert!(e.to_string().contains("missing Host"), "{p:?}: {e}");
        }
    }

    /// HTTP/2 names the target in :authority, with a scheme, on every request: that is not
    /// the absolute form, so any host passes where any Host is served. A Host field beside
    /// it must name the same.
    #[test]
    fn http_2_authority_is_the_host_and_host_must_agree() {
        use http::Version;
        let h2 = |uri, headers| versioned(Version::HTTP_2, uri, headers);
        let own = h2("https://proxy.example/x", &[]);
        assert_eq!(route(&own, &HostPolicy::Any).unwrap(), Route::Api);
        let abs = versioned(Version::HTTP_11, "https://proxy.example/x", &[]);
        assert!(route(&abs, &HostPolicy::Any).is_err());

        let same = h2("https://localhost:49982/x", &[("host", "LOCALHOST:49982")]);
        assert!(route(&same, &HostPolicy::Loopback).is_ok());
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            let other = h2("https://localhost:49982/x", &[("host", "evil.example")]);
            let e = route(&other, &p).unwrap_err();
            assert!(e.to_string().contains("Host differs"), "{p:?}: {e}");
        }
    }

    /// HTTP/2 frames its bodies itself, but a `content-length` said twice would reach the
    /// upstream twice: refused as HTTP/1.1's is. Once is fine.
    #[test]
    fn http_2_content_length_said_twice_is_refused() {
        use http::Version;
        let uri = "https://localhost/x";
        let once = versioned(Version::HTTP_2, uri, &[("content-length", "5")]);
        assert_eq!(route(&once, &HostPolicy::Loopback).unwrap(), Route::Api);
        let twice = [("content-length", "5"), ("content-length", "5")];
        let e = route(
            &versioned(Version::HTTP_2, uri, &twice),
            &HostPolicy::Loopback,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("more than one Content-Length"),
            "{e}"
        );
        // Over 2^63-1, as HTTP/1.1's framing watch refuses it; at it, fine.
        let most = [("content-length", "9223372036854775807")];
        let most = versioned(Version::HTTP_2, uri, &most);
        assert_eq!(route(&most, &HostPolicy::Loopback).unwrap(), Route::Api);
        let over = [("content-length", "9223372036854775808")];
        let e = route(
            &versioned(Version::HTTP_2, uri, &over),
            &HostPolicy::Loopback,
        )
        .unwrap_err();
        assert!(e.to_string().contains("Content-Length over"), "{e}");
    }

    /// An `Origin` is `scheme://host[:port]` and nothing else; anything more or less names
    /// no host a page could be on.
    #[test]
    fn an_origin_names_a_host_only_in_its_own_shape() {
        assert_eq!(origin_host("http://localhost:3000"), Some("localhost"));
        assert_eq!(origin_host("https://[::1]:8443"), Some("[::1]"));
        for bad in [
            "://localhost",
            "http://",
            "http://evil.example/.localhost",
            "http://evil.example?.localhost",
            "http://evil.example#.localhost",
            "http://u@localhost",
            "null",
        ] {
            assert_eq!(origin_host(bad), None, "{bad}");
        }
        let p = HostPolicy::Loopback;
        let from = |origin| parts("/x", &[("host", "localhost"), ("origin", origin)]);
        assert!(route(&from("http://localhost:3000"), &p).is_ok());
        for bad in ["://localhost", "http://evil.example/.localhost"] {
            let e = route(&from(bad), &p).unwrap_err();
            assert!(e.to_string().contains("cross-origin"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_port_is_digits_and_suffixes_compare_whole_characters() {
        assert_eq!(strip_port("localhost:49982"), "localhost");
        assert_eq!(strip_port("localhost:"), "localhost");
        assert_eq!(strip_port("localhost:x1"), "localhost:x1");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert!(ends_with_ignore_case("a.LocalHost", ".localhost"));
        assert!(!ends_with_ignore_case("localhost", ".localhost"));
        // The suffix would start inside a character: no match (and no panic).
        assert!(!ends_with_ignore_case("\u{e9}", "x"));
        assert!(!ends_with_ignore_case("ab\u{e9}", "x"));
    }

    #[test]
    fn authority_form_is_refused_for_every_method() {
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            for (method, target) in [
                ("GET", "127.0.0.1:80"),
                ("POST", "localhost:49982"),
                ("OPTIONS", "example.com:443"),
            ] {
                let mut req = parts(target, &[("host", "evil.example")]);
                req.method = method.parse().unwrap();
                let e = route(&req, &p).unwrap_err();
                assert_eq!(e.code(), "E5003", "{method} {target}");
                assert!(e.to_string().contains("authority-form"), "{e}");
            }
        }
        // The other forms still pass: origin, absolute (to a local name). The asterisk
        // form has a test of its own.
        let p = HostPolicy::Loopback;
        for target in ["/x", "http://127.0.0.1:49982/x"] {
            assert!(
                route(&parts(target, &[("host", "localhost")]), &p).is_ok(),
                "{target}"
            );
        }
    }

    /// `<port>-<id>.localhost` is a local name, but what it serves is a sandbox's app: its
    /// pages reach their own sandbox port only, never the control plane (the key) nor
    /// another sandbox or port (that sandbox's token).
    #[test]
    fn a_page_served_from_a_sandbox_reaches_its_own_origin_only() {
        let page = ("origin", "http://3000-isb-a.localhost:49982");
        for p in [HostPolicy::Loopback, HostPolicy::Listed(vec!["x".into()])] {
            for (target, host, extra) in [
                ("/sandboxes", "127.0.0.1:49982", None),
                ("/sandboxes", "localhost:49982", None),
                ("/files", "49983-isb-b.localhost:49982", None),
                ("/files", "49983-isb-a.localhost:49982", None),
                ("/", "3000-isb-b.localhost:49982", None),
                (
                    "/files",
                    "127.0.0.1:49982",
                    Some(("e2b-sandbox-id", "isb-b")),
                ),
            ] {
                let mut headers = vec![("host", host), page];
                headers.extend(extra);
                let e = route(&parts(target, &headers), &p).unwrap_err();
                assert_eq!(e.code(), "E5003", "{host} {extra:?}");
                assert!(e.to_string().contains("cross-origin request"), "{e}");
            }
            let own = [("host", "3000-ISB-A.localhost:49982"), page];
            assert_eq!(
                route(&parts("/app", &own), &p).unwrap(),
                Route::Envd {
                    sandbox_id: "isb-a".into(),
                    port: 3000
                }
            );
        }
        // Any page may still reach a sandbox's port through the proxy: the restriction is
        // on what a sandbox's page reaches.
        let dev = [
            ("host", "3000-isb-a.localhost"),
            ("origin", "http://localhost:5173"),
        ];
        assert!(route(&parts("/", &dev), &HostPolicy::Loopback).is_ok());
    }

    /// A Host in the sandbox shape (`<digits>-…`) whose port or id cannot be one is
    /// refused, not served as another local name: that went to the control plane with the
    /// key, a signed file URL's query included. Other local names still do.
    #[test]
    fn a_sandbox_host_that_names_no_sandbox_is_refused() {
        let long = format!("49983-{}.localhost", "a".repeat(129));
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            for host in [
                "0-isb-a.localhost",
                "65536-isb-a.localhost:49982",
                "99999-isb-a.localhost",
                "49983-isb_a.localhost",
                "49983-isb_a.e2b.localhost",
                "0-isb-a.e2b.localhost",
                "49983-isb%2Da.localhost",
                "49983-.localhost",
                long.as_str(),
            ] {
                let e = route(&parts("/files?signature=s", &[("host", host)]), &p).unwrap_err();
                assert_eq!(e.code(), "E5003", "{host}");
                assert!(
                    e.to_string().contains("invalid sandbox host"),
                    "{host}: {e}"
                );
            }
            for host in [
                "localhost",
                "app.localhost",
                "my-app.localhost",
                "x-1.localhost",
                "api.e2b.localhost:49982",
                "x.49983-isb-a.localhost",
            ] {
                assert_eq!(
                    route(&parts("/", &[("host", host)]), &p).unwrap(),
                    Route::Api
                );
            }
        }
        // Nor does a page claim such an origin to pass as a local one.
        let from_bad = [
            ("host", "localhost"),
            ("origin", "http://0-isb-a.localhost:49982"),
        ];
        let e = route(&parts("/sandboxes", &from_bad), &HostPolicy::Loopback).unwrap_err();
        assert!(e.to_string().contains("cross-origin"), "{e}");
    }

    /// A Host naming one sandbox port and routing headers naming another are refused,
    /// whoever sends them (a same-origin GET from a sandbox's page carries no `Origin`);
    /// headers that agree with the Host are what an SDK sends.
    #[test]
    fn routing_headers_must_agree_with_a_sandbox_host() {
        let p = HostPolicy::Loopback;
        let host = ("host", "3000-isb-a.localhost:49982");
        for extra in [
            vec![("e2b-sandbox-id", "isb-b")],
            vec![("e2b-sandbox-id", "isb-a")],
            vec![("e2b-sandbox-id", "isb-a"), ("e2b-sandbox-port", "49983")],
        ] {
            let mut headers = vec![host];
            headers.extend(extra.iter().copied());
            let e = route(&parts("/files", &headers), &p).unwrap_err();
            assert_eq!(e.code(), "E5003", "{extra:?}");
            assert!(e.to_string().contains("another sandbox or port"), "{e}");
        }
        let sdk = [
            ("host", "49983-isb-a.localhost:49982"),
            ("e2b-sandbox-id", "isb-a"),
        ];
        let envd = Route::Envd {
            sandbox_id: "isb-a".into(),
            port: 49983,
        };
        assert_eq!(route(&parts("/files", &sdk), &p).unwrap(), envd);
        let both = [sdk[0], sdk[1], ("e2b-sandbox-port", "49983")];
        assert_eq!(route(&parts("/files", &both), &p).unwrap(), envd);
    }

    /// TRACE would have the upstream echo the request, the credential the proxy attached
    /// included, back to the client.
    #[test]
    fn trace_is_refused_on_both_planes() {
        for p in [HostPolicy::Loopback, HostPolicy::Any] {
            for headers in [
                vec![("host", "127.0.0.1")],
                vec![("host", "127.0.0.1"), ("e2b-sandbox-id", "isb-a")],
                vec![("host", "49983-isb-a.localhost")],
            ] {
                let mut req = parts("/sandboxes", &headers);
                req.method = Method::TRACE;
                let e = route(&req, &p).unwrap_err();
                assert_eq!(e.code(), "E5003", "{headers:?}");
                assert!(e.to_string().contains("TRACE"), "{e}");
            }
        }
    }

    #[test]
    fn a_page_from_another_origin_cannot_use_the_proxy() {
        let host = ("host", "127.0.0.1:49982");
        let listed = HostPolicy::Listed(vec!["proxy.internal".into()]);
        for p in [HostPolicy::Loopback, listed.clone()] {
            for bad in [
                "https://evil.example",
                "http://127.0.0.1.evil.example:49982",
                "null",
                "file://",
                "garbage",
                "http://localhost@evil.example",
            ] {
                let e = route(&parts("/sandboxes", &[host, ("origin", bad)]), &p).unwrap_err();
                assert_eq!(e.code(), "E5003", "{bad}");
                assert!(e.to_string().contains("cross-origin request"), "{e}");
            }
            for ok in [
                "http://localhost:3000",
                "http://127.0.0.1:49982",
                "https://app.localhost",
                "http://[::1]:8080",
            ] {
                assert!(route(&parts("/sandboxes", &[host, ("origin", ok)]), &p).is_ok());
            }
            let e = route(
                &parts("/sandboxes", &[host, ("sec-fetch-site", "cross-site")]),
                &p,
            )
            .unwrap_err();
            assert!(e.to_string().contains("cross-site"), "{e}");
            // A local page's request is cross-site too (localhost vs 127.0.0.1), but names
            // its origin; a typed URL or a same-site page is fine.
            let local = [
                host,
                ("sec-fetch-site", "cross-site"),
                ("origin", "http://localhost:3000"),
            ];
            assert!(route(&parts("/sandboxes", &local), &p).is_ok());
            for site in ["none", "same-site", "same-origin"] {
                let r = route(&parts("/", &[host, ("sec-fetch-site", site)]), &p);
                assert!(r.is_ok(), "{site}");
            }
            // A name below `localhost` shares its site with the names below it: a sandbox's
            // page is `same-site` to the others and to the control plane's name.
            for shared in [
                "api.e2b.localhost",
                "e2b.localhost",
                "49983-isb-b.e2b.localhost:1",
                "3000-isb-a.x.y.localhost.",
                "49983-isb-b.localhost",
                "app.localhost",
            ] {
                let same_site = [("host", shared), ("sec-fetch-site", "same-site")];
                let e = route(&parts("/", &same_site), &p).unwrap_err();
                assert!(e.to_string().contains("same-site request"), "{shared}: {e}");
                for site in ["none", "same-origin"] {
                    let r = route(
                        &parts("/", &[("host", shared), ("sec-fetch-site", site)]),
                        &p,
                    );
                    assert!(r.is_ok(), "{shared}: {site}");
                }
            }
            for own in ["localhost:1", "127.0.0.1:49982", "[::1]"] {
                let same_site = [("host", own), ("sec-fetch-site", "same-site")];
                assert!(route(&parts("/", &same_site), &p).is_ok(), "{own}");
            }
        }
        let ok = route(
            &parts("/x", &[host, ("origin", "http://proxy.internal:3000")]),
            &listed,
        );
        assert!(ok.is_ok());
        // `--allow-remote` with any Host: whoever can reach it may use it, from any site;
        // without an `Origin`, by a name of its own.
        let named = ("host", "proxy.example.com");
        for fields in [
            [host, ("origin", "https://evil.example")],
            [named, ("sec-fetch-site", "cross-site")],
        ] {
            let any = route(&parts("/x", &fields), &HostPolicy::Any);
            assert!(any.is_ok(), "{fields:?}");
        }
        for local in ["localhost:49982", "127.0.0.1", "49983-isb-b.localhost"] {
            let fields = [("host", local), ("sec-fetch-site", "cross-site")];
            let any = route(&parts("/x", &fields), &HostPolicy::Any);
            assert!(any.is_err(), "{local}");
        }
        // But not from a sandbox's own pages beyond their sandbox, nor from a hidden
        // origin: those are the proxy's own content (a unix socket behind a loopback
        // bridge is how the SDKs reach one).
        let page = ("origin", "http://3000-isb-a.localhost:49982");
        for (to, ok) in [
            ("localhost:49982", false),
            ("49983-isb-b.localhost:49982", false),
            ("3000-isb-a.localhost:49982", true),
        ] {
            let r = route(&parts("/x", &[("host", to), page]), &HostPolicy::Any);
            assert_eq!(r.is_ok(), ok, "{to}: {r:?}");
        }
        let hidden = route(&parts("/x", &[host, ("origin", "null")]), &HostPolicy::Any);
        assert!(hidden.is_err());
        let below = [
            ("host", "49983-isb-b.localhost"),
            ("sec-fetch-site", "same-site"),
        ];
        assert!(route(&parts("/x", &below), &HostPolicy::Any).is_err());
    }

    #[test]
    fn bad_envd_headers() {
        let p = HostPolicy::Loopback;
        assert!(route(
            &parts("/", &[("host", "localhost"), ("e2b-sandbox-id", "../x")]),
            &p
        )
        .is_err());
        assert!(route(
            &parts(
                "/",
                &[
                    ("host", "localhost"),
                    ("e2b-sandbox-id", "a"),
                    ("e2b-sandbox-port", "x")
                ]
            ),
            &p
        )
        .is_err());
        // `u16::from_str` reads these as ports; no client writes them.
        for port in ["+80", "-0", "0", "65536", "", "8 0"] {
            let headers = [
                ("host", "localhost"),
                ("e2b-sandbox-id", "a"),
                ("e2b-sandbox-port", port),
            ];
            assert!(route(&parts("/", &headers), &p).is_err(), "{port:?}");
        }
        let headers = [
            ("host", "localhost"),
            ("e2b-sandbox-id", "a"),
            ("e2b-sandbox-port", " 3000 "),
        ];
        assert!(matches!(
            route(&parts("/", &headers), &p),
            Ok(Route::Envd { port: 3000, .. })
        ));
    }
}
