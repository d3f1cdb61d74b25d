//! Phases 2 and 3, authorize and rewrite: credential attachment (the credential itself is
//! found by the handler: the key, the envd token) and header hygiene both ways. Works in
//! place on the request's own `HeaderMap`: no copies on the hot path.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::route::DEFAULT_ENVD_PORT;
use crate::secret::Secret;

/// RFC 9110 §7.6.1 hop-by-hop fields, plus the de-facto ones, and `Trailer`: end to end
/// (§6.6.2), but a request's trailers are dropped on the way upstream, so its `Trailer`
/// announces fields that never come (a response keeps it, see
/// [`strip_response_hop_by_hop`]).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Hop-by-hop too: it belongs to the `h2c` upgrade, which the proxy never passes on, and
/// is connection-specific even when a client's `Connection` fails to name it (RFC 7540
/// §3.2.1). Kept apart from [`HOP_BY_HOP`], whose names are looked up by length first.
const HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
pub const X_ACCESS_TOKEN: HeaderName = HeaderName::from_static("x-access-token");
pub const E2B_SANDBOX_ID: HeaderName = HeaderName::from_static("e2b-sandbox-id");
pub const E2B_SANDBOX_PORT: HeaderName = HeaderName::from_static("e2b-sandbox-port");

/// What a browser keeps from an answer for its host or its origin, not for the page: from a
/// sandbox's app on the proxy's own origin, for every local site (cookies and HSTS know no
/// port): a session planted for another local app, or cookies enough that its every
/// request is refused as too large; every local site's cookies wiped (`Clear-Site-Data`);
/// HTTPS forced on every `http://localhost:*` site (with `includeSubDomains`, on the
/// sandbox hosts too); the proxy's later requests sent elsewhere (`Alt-Svc`) or reported
/// to the app's collector (`NEL`, `Report-To`, `Reporting-Endpoints`); client hints asked
/// of every later request there (`Accept-CH`, `Critical-CH`); a device-bound session
/// registered, whose scope may take in the whole site, every local port (DBSC's
/// `Sec-Session-Registration`, `Secure-Session-Registration` in the W3C draft); the origin
/// marked as an identity provider's, logged in (FedCM's `Set-Login`).
const HOST_STATE: [HeaderName; 12] = [
    header::SET_COOKIE,
    HeaderName::from_static("clear-site-data"),
    header::STRICT_TRANSPORT_SECURITY,
    header::ALT_SVC,
    HeaderName::from_static("nel"),
    HeaderName::from_static("report-to"),
    HeaderName::from_static("reporting-endpoints"),
    HeaderName::from_static("accept-ch"),
    HeaderName::from_static("critical-ch"),
    HeaderName::from_static("sec-session-registration"),
    HeaderName::from_static("secure-session-registration"),
    HeaderName::from_static("set-login"),
];

/// The pace, in whole seconds, at which envd sends keepalive events on a quiet Connect
/// stream (a command's output, a watch).
const KEEPALIVE_PING_INTERVAL: HeaderName = HeaderName::from_static("keepalive-ping-interval");

/// envd's pace when the field is missing or not a positive number.
const ENVD_DEFAULT_KEEPALIVE_SECS: u64 = 90;

/// envd's default user when the client names none (`user:` with an empty password).
const DEFAULT_BASIC: HeaderValue = HeaderValue::from_static("Basic dXNlcjo=");

/// Whether the message asks to switch protocols (`Connection: upgrade` + `Upgrade`).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| connection_tokens(v).any(|t| t.eq_ignore_ascii_case(b"upgrade")))
}

/// Whether a client's request asks for an upgrade the proxy tunnels: WebSocket over
/// HTTP/1.1 (HTTP/2 has no `Upgrade`). Another protocol (curl's `h2c`, `TLS/1.0`) is not
/// tunnelled: its `Upgrade` is dropped as the hop-by-hop field it is and the request is
/// answered as itself, as nginx and envoy do. A tunnel to it would carry requests past
/// every check the proxy makes.
pub fn is_upgrade_request<B>(req: &http::Request<B>) -> bool {
    req.version() == http::Version::HTTP_11
        && is_upgrade(req.headers())
        && offers_websocket(req.headers())
}

/// Whether an `Upgrade` field names WebSocket among its protocols (a request's offer, or
/// the protocol a 101 switches to).
pub fn offers_websocket(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(connection_tokens)
        .any(is_websocket)
}

/// Whether an `Upgrade` protocol token (`websocket`, `WebSocket/13`) names WebSocket.
fn is_websocket(protocol: &[u8]) -> bool {
    let name = protocol.split(|b| *b == b'/').next().unwrap_or_default();
    name.eq_ignore_ascii_case(b"websocket")
}

/// The comma-separated tokens of a `Connection` value, as bytes: a line with obs-text
/// (bytes >= 0x80, which hyper accepts) still names the fields it lists.
fn connection_tokens(v: &HeaderValue) -> impl Iterator<Item = &[u8]> {
    tokens(v.as_bytes())
}

fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|b| *b == b',')
        .map(|t| t.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// Whether a comma-separated field value (`Connection: keep-alive, close`) lists `token`,
/// in any case.
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    tokens(value).any(|t| t.eq_ignore_ascii_case(token))
}

/// Removes a request's hop-by-hop headers and those named in `Connection`, and the
/// client's `_` spellings of fields the proxy manages ([`drop_underscored_spellings`]).
/// With `upgrade`,
/// the `Upgrade` header and `Connection: upgrade` survive (WebSocket needs them end to end),
/// `Upgrade` naming WebSocket alone: another protocol offered beside it (`h2c, websocket`)
/// is not one the proxy tunnels.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    strip(headers, upgrade, Message::Request);
}

/// [`strip_hop_by_hop`] for a response, which keeps `Trailer`: hyper's HTTP/1.1 server sends
/// a response's trailers only when it declares them there, and the client asked for them
/// with `TE: trailers`. A response's own `TE` goes whatever its value: TE is a request field.
pub fn strip_response_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    strip(headers, upgrade, Message::Response);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Message {
    Request,
    Response,
}

/// Removes the hop-by-hop fields: all of them from a request but `TE: trailers`, all of them
/// from a response but `Trailer`; from a request, the `_` spellings of managed fields.
fn strip(headers: &mut HeaderMap, upgrade: bool, message: Message) {
    let keep = match message {
        Message::Request => 0,
        Message::Response => TRAILER_BIT,
    };
    // One pass over the names present decides what to do, so the map is hashed only for
    // fields that are there. (Removing all nine names unconditionally cost nine hash
    // probes per message, twice per request, nearly all of them for absent fields.)
    let present = headers
        .keys()
        .fold(0u16, |bits, name| bits | hop_by_hop_bit(name));
    if present & UNDERSCORE_BIT != 0 && message == Message::Request {
        drop_underscored_spellings(headers);
    }
    if present & CONNECTION_BIT != 0 {
        // Every `Connection` line counts, not just the first: `Connection: close` followed
        // by `Connection: X-Secret` must still drop `X-Secret`. The list is only built when
        // some token names a field beyond the ones removed below anyway.
        let names_fields = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(connection_tokens)
            .any(|t| !is_plain_connection_token(t));
        if names_fields {
            let named: Vec<HeaderName> = headers
                .get_all(header::CONNECTION)
                .iter()
                .flat_map(connection_tokens)
                .filter(|t| !is_plain_connection_token(t))
                .filter_map(|t| HeaderName::from_bytes(t).ok())
                .collect();
            for name in named {
                headers.remove(&name);
            }
        }
    }
    if present & TE_BIT != 0 {
        // `TE: trailers` is the one TE value a proxy may pass on (gRPC over HTTP/2 needs it),
        // and only in a request.
        let te_trailers = message == Message::Request
            && headers
                .get(header::TE)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
        headers.remove(header::TE);
        if te_trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
    }
    if present & HTTP2_SETTINGS_BIT != 0 {
        headers.remove(HTTP2_SETTINGS);
    }
    // The proxy meets `Expect: 100-continue` itself (its server sends the 100 when the body
    // is first read). Asked again, an upstream could answer early without the 100 and leave
    // the body unread on the connection, to be read as its next request; nginx drops it too.
    if present & EXPECT_BIT != 0 {
        headers.remove(header::EXPECT);
    }
    let remove = present & !keep;
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if remove & (1 << i) == 0 || (upgrade && name == header::UPGRADE) {
            continue;
        }
        headers.remove(name);
    }
    if upgrade {
        let websocket = headers
            .get_all(header::UPGRADE)
            .iter()
            .flat_map(connection_tokens)
            .find(|p| is_websocket(p))
            .and_then(|p| HeaderValue::from_bytes(p).ok());
        match websocket {
            Some(protocol) => {
                headers.insert(header::UPGRADE, protocol);
                headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            }
            None => {
                headers.remove(header::UPGRADE);
            }
        }
    }
}

/// RFC 9113 §8.2.3: an HTTP/2 client may send its cookies as several `Cookie` fields
/// (browsers do, so that each pair compresses on its own), and they must be one field,
/// joined with "; ", before they go on over HTTP/1.1, where a server may read one line
/// only. Left as they are if the joined value is not a valid field value.
pub fn join_cookies(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::COOKIE).iter();
    if values.next().is_none() || values.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    let mut sensitive = false;
    for v in headers.get_all(header::COOKIE) {
        if v.is_empty() {
            continue;
        }
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
        sensitive |= v.is_sensitive();
    }
    if let Ok(mut v) = HeaderValue::from_bytes(&joined) {
        v.set_sensitive(sensitive);
        // `insert` replaces every field of the name.
        headers.insert(header::COOKIE, v);
    }
}

/// Bit `i` stands for `HOP_BY_HOP[i]`; `TE` has the next one.
const CONNECTION_BIT: u16 = 1;
const TRAILER_BIT: u16 = 1 << 5;
const TE_BIT: u16 = 1 << 8; // HOP_BY_HOP.len()
const HTTP2_SETTINGS_BIT: u16 = 1 << 9;
const EXPECT_BIT: u16 = 1 << 10;
/// A name with `_` where a [`MANAGED`] one of its length has `-` (see
/// [`drop_underscored_spellings`]).
const UNDERSCORE_BIT: u16 = 1 << 11;

/// The fields that route or frame a request, or carry its credential, whose names have a
/// `-` that a gateway may read a client's `_` as.
const MANAGED: [&str; 8] = [
    "content-length",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "keepalive-ping-interval",
    "proxy-authorization",
    "transfer-encoding",
    "x-access-token",
    "x-api-key",
];

/// Drops a request's fields spelt with `_` where `-` would make one the proxy manages
/// (`e2b_sandbox_id`, `content_length`, `x_access_token`): passed on, they reached the
/// upstream before the proxy's own, and a gateway there that reads `_` as `-` (nginx with
/// `underscores_in_headers on`, matching `$http_e2b_sandbox_id` to both) could take the
/// client's: another sandbox's port for the envd token, another length for the body.
/// nginx drops every name with `_` by default; here others pass: the E2B Python SDK's own
/// (`lang_version`, `sdk_runtime`) and an app's.
#[cold]
fn drop_underscored_spellings(headers: &mut HeaderMap) {
    drop_names(headers, |name| {
        MANAGED.iter().any(|m| underscored_spelling(name, m))
    });
}

/// A plugin's own header, spelt with `_` for some of its `-` (as the fixed fields in
/// [`drop_underscored_spellings`]): the client's would reach the upstream before the key.
fn drop_underscored_spellings_of(headers: &mut HeaderMap, name: &HeaderName) {
    let name = name.as_str();
    if !name.contains('-') {
        return;
    }
    drop_names(headers, |spelt| underscored_spelling(spelt, name));
}

/// Removes every field whose name `named` picks (all its values).
fn drop_names(headers: &mut HeaderMap, named: impl Fn(&str) -> bool) {
    let dropped: Vec<HeaderName> = (headers.keys())
        .filter(|name| named(name.as_str()))
        .cloned()
        .collect();
    for name in dropped {
        headers.remove(&name);
    }
}

/// Whether `spelt` is `name` with some of its `-` written `_` (at least one).
fn underscored_spelling(spelt: &str, name: &str) -> bool {
    spelt.len() == name.len()
        && spelt != name
        && (spelt.bytes().zip(name.bytes())).all(|(s, n)| s == n || (s == b'_' && n == b'-'))
}

/// Which hop-by-hop field `name` is, as a bit (0 for none), or [`UNDERSCORE_BIT`].
fn hop_by_hop_bit(name: &HeaderName) -> u16 {
    // Lengths first: one comparison rules out most names (host, accept, …); searching
    // every name for `_` doubled the rewrite's time in criterion. `HTTP2-Settings` has its
    // own: `content-length`, in most requests, is as long.
    match name.as_str().len() {
        2 | 7 | 10 | 16..=19 => {}
        14 if name == HTTP2_SETTINGS => return HTTP2_SETTINGS_BIT,
        6 if name == header::EXPECT => return EXPECT_BIT,
        9 | 14 | 23 => return underscored(name),
        _ => return 0,
    }
    if name == header::TE {
        return TE_BIT;
    }
    HOP_BY_HOP
        .iter()
        .position(|h| h == name)
        .map_or_else(|| underscored(name), |i| 1 << i)
}

/// `_` where a [`MANAGED`] name of the same length has `-` (its place is all a gateway's
/// reading changes): a byte or two to look at. A scan of the whole of each name of those
/// lengths still cost the rewrite 15%.
fn underscored(name: &HeaderName) -> u16 {
    let name = name.as_str().as_bytes();
    let dashes: &[usize] = match name.len() {
        9 => &[1, 5],
        14 => &[1, 3, 7, 8, 11],
        16 => &[3, 11],
        17 => &[8],
        19 => &[5],
        23 => &[9, 14],
        _ => return 0,
    };
    if dashes.iter().any(|&i| name.get(i) == Some(&b'_')) {
        UNDERSCORE_BIT
    } else {
        0
    }
}

/// `close`, `keep-alive` and `upgrade`: options, or fields handled by [`HOP_BY_HOP`].
fn is_plain_connection_token(t: &[u8]) -> bool {
    [&b"close"[..], b"keep-alive", b"upgrade"]
        .iter()
        .any(|p| t.eq_ignore_ascii_case(p))
}

/// How a provider wants its key.
#[derive(Debug, Clone)]
pub enum AuthScheme {
    /// `Authorization: Bearer <key>`.
    Bearer,
    /// `<header>: <key>`.
    Header(HeaderName),
}

impl From<&crate::providers::AuthKind> for AuthScheme {
    fn from(kind: &crate::providers::AuthKind) -> Self {
        match kind {
            crate::providers::AuthKind::Bearer => AuthScheme::Bearer,
            // The manifest reader checked the name; an invalid one cannot get here.
            crate::providers::AuthKind::Header(h) => HeaderName::from_bytes(h.as_bytes())
                .map(AuthScheme::Header)
                .unwrap_or(AuthScheme::Bearer),
        }
    }
}

impl AuthScheme {
    /// The header value for `key`, built once per key rather than once per request.
    pub fn value(&self, key: &Secret) -> Option<HeaderValue> {
        let mut v = match self {
            AuthScheme::Bearer => HeaderValue::try_from(format!("Bearer {}", key.expose())).ok()?,
            AuthScheme::Header(_) => HeaderValue::from_str(key.expose()).ok()?,
        };
        v.set_sensitive(true);
        Some(v)
    }

    pub fn header(&self) -> HeaderName {
        match self {
            AuthScheme::Bearer => header::AUTHORIZATION,
            AuthScheme::Header(h) => h.clone(),
        }
    }
}

/// The provider's auth header with its value built once per key: formatting `Bearer <key>`
/// and validating it as a header value took two allocations and a scan on every request.
/// Keys change rarely (AK/SK refresh, SIGHUP), so one remembered pair is enough.
pub struct CachedAuth {
    scheme: AuthScheme,
    last: arc_swap::ArcSwapOption<(Secret, HeaderValue)>,
}

impl CachedAuth {
    pub fn new(scheme: AuthScheme) -> Self {
        CachedAuth {
            scheme,
            last: arc_swap::ArcSwapOption::empty(),
        }
    }

    pub fn scheme(&self) -> &AuthScheme {
        &self.scheme
    }

    pub fn header(&self) -> HeaderName {
        self.scheme.header()
    }

    /// [`AuthScheme::value`], remembered for the last key. `Secret` equality is a pointer
    /// comparison first, so the hit costs no string compare for the same key.
    pub fn value(&self, key: &Secret) -> Option<HeaderValue> {
        if let Some(last) = &*self.last.load() {
            if last.0 == *key {
                return Some(last.1.clone());
            }
        }
        let value = self.scheme.value(key)?;
        self.last
            .store(Some(std::sync::Arc::new((key.clone(), value.clone()))));
        Some(value)
    }
}

impl std::fmt::Debug for CachedAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The cached value is a secret: only the scheme is shown.
        f.debug_struct("CachedAuth")
            .field("scheme", &self.scheme)
            .finish_non_exhaustive()
    }
}

/// E2B's volume content API (`/volumecontent/{volumeID}/…`: the SDKs' `Volume` file calls,
/// sent to `E2B_VOLUME_API_URL`) is served on the control plane's host but takes the
/// volume's own token as `Authorization: Bearer`, not the key: the key put in its place
/// failed every call, and spent the account's key where a token scoped to one volume was
/// meant to go.
pub fn is_volume_content(path: &str) -> bool {
    path.strip_prefix("/volumecontent/")
        .is_some_and(|rest| !rest.is_empty())
}

/// OpenSandbox's route to a sandbox's app through its server
/// (`[/v1]/sandboxes/{id}/proxy/{port}/…`, the endpoint `use_server_proxy` gives): the
/// server asks no key there and hands the request on to the app, an older server with
/// every field the client sent (the key among them) to code anyone may have written.
/// Read as the server routes it, percent-decoded, and as a hop in front of it may pass it
/// on: slashes merged (nginx's `merge_slashes`, on by default) and `;` parameters dropped
/// from each segment (as servlet containers do); and any path that begins as the route
/// does, whatever follows: the server asks the key for some of those (a `..` anywhere, a
/// port that is no number) yet may still route them to the app, and a 401 there costs
/// less than the key in an app's hands.
pub fn is_sandbox_proxy_route(path: &str) -> bool {
    // Most paths name no route like it: no decoding then.
    if !path.contains("sandboxes") && !path.contains('%') {
        return false;
    }
    let decoded = percent_decoded(path.as_bytes());
    let decoded = merged(&decoded);
    let rest = decoded.strip_prefix(b"/v1").unwrap_or(&decoded);
    let Some(rest) = rest.strip_prefix(b"/sandboxes/") else {
        return false;
    };
    let Some(slash) = rest.iter().position(|&b| b == b'/').filter(|&i| i > 0) else {
        return false;
    };
    rest[slash..].starts_with(b"/proxy/")
}

/// `path` with runs of `/` merged into one and each segment's `;` parameters dropped; a
/// `\` is a `/`, as WHATWG URL parsers read it (see `route`'s dot segments).
fn merged(path: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let separator = |b: &u8| *b == b';' || *b == b'\\';
    if !path.iter().any(separator) && !path.windows(2).any(|w| w == b"//") {
        return std::borrow::Cow::Borrowed(path);
    }
    let mut out = Vec::with_capacity(path.len());
    let mut parameters = false;
    for b in path.iter().map(|&b| if b == b'\\' { b'/' } else { b }) {
        if b == b'/' {
            parameters = false;
            if out.last() == Some(&b'/') {
                continue;
            }
        } else if b == b';' || parameters {
            parameters = true;
            continue;
        }
        out.push(b);
    }
    std::borrow::Cow::Owned(out)
}

/// `path` with its percent escapes decoded; an escape that is none is kept as written.
fn percent_decoded(path: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !path.contains(&b'%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let escaped = match path.get(i..i + 3) {
            Some([b'%', h, l]) => hex(*h).zip(hex(*l)),
            _ => None,
        };
        match escaped {
            Some((h, l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            None => {
                out.push(path[i]);
                i += 1;
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// An answer from a sandbox's app served on the proxy's own origin (OpenSandbox's
/// [`is_sandbox_proxy_route`]) is shown to a browser as a page of no origin: a same-origin
/// page's requests to the proxy pass the Origin check and would go out with the key; a
/// sandboxed page's carry `Origin: null`, which is refused. Scripts, forms and pop-ups
/// still work, within the page. Nor may the app leave the browser anything it keeps for
/// the host or the origin rather than the page ([`HOST_STATE`]).
pub fn sandbox_the_page(headers: &mut HeaderMap) {
    for name in HOST_STATE {
        headers.remove(name);
    }
    headers.append(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads",
        ),
    );
}

/// A request to a sandbox's app on the proxy's own origin (see [`sandbox_the_page`]): a
/// browser sends it the cookies of every local site (cookies know no port: a notebook's,
/// a dashboard's session), none of them the app's, which is code run in a sandbox.
pub fn keep_local_cookies(headers: &mut HeaderMap) {
    headers.remove(header::COOKIE);
}

/// Control plane, on a path whose credential is the client's own
/// ([`is_volume_content`], [`is_sandbox_proxy_route`]): its `Authorization` passes as
/// sent; the fields a client puts its dummy key in (`X-API-Key`, a provider's own header)
/// do not, and no key is added.
pub fn authorize_own(headers: &mut HeaderMap, scheme: &AuthScheme) {
    headers.remove(X_API_KEY);
    remove_own_header(headers, scheme);
}

/// A plugin's own header goes, where the client's dummy key would be: unless it is
/// `Authorization`, whose rules are the caller's (as for a bearer scheme): removed, a
/// client's `Authorization: Basic` on envd ran its command as the default user, and an
/// app's or a volume's own token went missing.
fn remove_own_header(headers: &mut HeaderMap, scheme: &AuthScheme) {
    if let AuthScheme::Header(name) = scheme {
        if name != header::AUTHORIZATION {
            headers.remove(name);
            drop_underscored_spellings_of(headers, name);
        }
    }
}

/// Control plane: every client credential out, the resolved key in.
pub fn authorize_api(headers: &mut HeaderMap, scheme: &AuthScheme, value: HeaderValue) {
    headers.remove(X_API_KEY);
    let name = scheme.header();
    if name != header::AUTHORIZATION {
        headers.remove(header::AUTHORIZATION);
        drop_underscored_spellings_of(headers, &name);
    }
    // `insert` replaces every value the client sent under this name.
    headers.insert(name, value);
}

/// envd: the sandbox's token and routing headers; the client's `Authorization: Basic …`
/// (which selects the sandbox user) is kept, anything else becomes the default user. The
/// client's credential for the control plane (`X-API-Key`, or a plugin's own header, under
/// `scheme`) is not envd's business either.
///
/// Another port of the sandbox is an app's (a user's server, the MCP gateway's
/// `Authorization: Bearer` token): sandbox users are envd's, and the client's
/// `Authorization` there is its credential for the app, passed as sent. `token` is then
/// only what the client sent (the handler gives an app no token of the store's).
pub fn authorize_envd(
    headers: &mut HeaderMap,
    scheme: &AuthScheme,
    token: &Secret,
    sandbox_id: &str,
    port: u16,
) {
    headers.remove(X_API_KEY);
    remove_own_header(headers, scheme);
    if port == DEFAULT_ENVD_PORT {
        // Exactly one Authorization goes to envd: the client's first Basic, or the default
        // user.
        let basic = headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .find(|v| v.as_bytes().len() > 6 && v.as_bytes()[..6].eq_ignore_ascii_case(b"basic "))
            .cloned();
        headers.insert(header::AUTHORIZATION, basic.unwrap_or(DEFAULT_BASIC));
    }
    // No token known (an unsecured sandbox): none sent, rather than an empty one.
    match HeaderValue::from_str(token.expose()) {
        Ok(mut v) if !v.is_empty() => {
            v.set_sensitive(true);
            headers.insert(X_ACCESS_TOKEN, v);
        }
        _ => {
            headers.remove(X_ACCESS_TOKEN);
        }
    }
    if let Ok(v) = HeaderValue::from_str(sandbox_id) {
        headers.insert(E2B_SANDBOX_ID, v);
    }
    headers.insert(E2B_SANDBOX_PORT, HeaderValue::from(port));
}

/// Asks envd for a keepalive at least every half `idle_timeout` (in whole seconds, at
/// least one): a keepalive then always comes before the cut. The E2B SDKs ask for one
/// every 50 s (envd's own default is 90 s): under a shorter `--idle-timeout` a command or
/// watch quiet for that long would be cut, here or by the client, though envd and the
/// process are well. A client asking for a faster pace keeps it; a value envd would not read
/// as a positive number counts as envd's default, as envd reads it (Go's `ParseInt` on the
/// first value, which its HTTP/1.1 parser has trimmed of spaces and tabs).
pub fn pace_keepalives(headers: &mut HeaderMap, idle_timeout: std::time::Duration) {
    let at_most = (idle_timeout.as_secs() / 2).max(1);
    let asked = headers
        .get(KEEPALIVE_PING_INTERVAL)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.trim_matches([' ', '\t']).parse::<u64>().ok())
        .filter(|secs| *secs > 0)
        .unwrap_or(ENVD_DEFAULT_KEEPALIVE_SECS);
    if asked > at_most {
        headers.insert(KEEPALIVE_PING_INTERVAL, HeaderValue::from(at_most));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_and_connection_named() {
        let mut h = map(&[
            ("connection", "close, X-Custom"),
            ("x-custom", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "gzip"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic x"),
            ("http2-settings", "AAMAAABkAAQAoAAAAAIAAAAA"),
            ("expect", "100-continue"),
            ("x-kept", "yes"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn every_hop_by_hop_field_has_a_bit() {
        assert_eq!(TE_BIT, 1 << HOP_BY_HOP.len());
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_bit(name), 1 << i, "{name}");
        }
        assert_eq!(hop_by_hop_bit(&header::TE), TE_BIT);
        assert_eq!(hop_by_hop_bit(&header::TRAILER), TRAILER_BIT);
        for other in [
            "host",
            "user-agent",
            "x-api-key",
            "authorization",
            "trailers",
            "t",
            "accept",
            "cookie",
        ] {
            assert_eq!(
                hop_by_hop_bit(&HeaderName::from_static(other)),
                0,
                "{other}"
            );
        }
        let mut h = map(&[("te", "trailers"), ("te", "gzip"), ("x-kept", "1")]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.get_all("te").iter().count(), 1);
        assert_eq!(h["te"], "trailers");
        let mut h = map(&[("te", "gzip"), ("transfer-encoding", "chunked")]);
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty(), "{h:?}");
    }

    /// A plugin's own header (its key's) goes in every `_` spelling of the client's too,
    /// on both planes; its other fields stay.
    #[test]
    fn underscored_spellings_of_a_plugins_header_are_dropped() {
        let scheme = AuthScheme::Header(HeaderName::from_static("open-sandbox-api-key"));
        let client = || {
            map(&[
                ("open_sandbox_api_key", "client"),
                ("open-sandbox_api-key", "client2"),
                ("open-sandbox-api-key", "dummy"),
                ("open_sandbox_region", "kept"),
            ])
        };
        let mut h = client();
        authorize_api(&mut h, &scheme, HeaderValue::from_static("osk-real"));
        let mut left: Vec<(&str, &str)> = h
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        left.sort_unstable();
        assert_eq!(
            left,
            [
                ("open-sandbox-api-key", "osk-real"),
                ("open_sandbox_region", "kept")
            ]
        );
        let mut h = client();
        authorize_envd(&mut h, &scheme, &Secret::new("tok"), "isb-1", 3000);
        assert!(
            h.keys()
                .all(|k| !k.as_str().starts_with("open-sandbox")
                    && k.as_str() != "open_sandbox_api_key"),
            "{h:?}"
        );
        assert!(h.contains_key("open_sandbox_region"));
    }

    /// A client's `e2b_sandbox_id` or `content_length` does not reach the upstream, where a
    /// gateway reading `_` as `-` could take it for the field the proxy sets or checks; an
    /// app's own name with `_` does, and a response keeps its fields.
    #[test]
    fn underscored_spellings_of_managed_fields_are_dropped_from_requests() {
        let mut h = map(&[
            ("e2b_sandbox_id", "isb-other"),
            ("e2b_sandbox-port", "3000"),
            ("content_length", "40"),
            ("transfer_encoding", "chunked"),
            ("x_access_token", "forged"),
            ("x_api_key", "client"),
            ("x_custom_app", "kept"),
            ("e2b-sandbox-id", "isb-mine"),
            ("x-api_keys", "kept"),
        ]);
        strip_hop_by_hop(&mut h, false);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["e2b-sandbox-id", "x-api_keys", "x_custom_app"]);
        let mut h = map(&[("x_api_key", "a"), ("content_length", "1")]);
        strip_response_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 2);
        // Each `-` of each managed name, alone or with the others, read as `_`.
        for m in MANAGED {
            let spelt = HeaderName::from_bytes(m.replace('-', "_").as_bytes()).unwrap();
            assert_eq!(hop_by_hop_bit(&spelt), UNDERSCORE_BIT, "{m}");
            for (i, _) in m.match_indices('-') {
                let mut one = m.as_bytes().to_vec();
                one[i] = b'_';
                let spelt = HeaderName::from_bytes(&one).unwrap();
                assert_eq!(hop_by_hop_bit(&spelt), UNDERSCORE_BIT, "{spelt}");
            }
        }
    }

    #[test]
    fn a_response_keeps_trailer_and_loses_te() {
        let mut h = map(&[
            ("te", "trailers"),
            ("trailer", "grpc-status"),
            ("keep-alive", "timeout=5"),
            ("x-kept", "1"),
        ]);
        strip_response_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 2, "{h:?}");
        assert_eq!(h["trailer"], "grpc-status");
        assert_eq!(h["x-kept"], "1");
    }

    #[test]
    fn every_connection_line_counts() {
        let mut h = map(&[
            ("connection", "close"),
            ("connection", "X-Hop-A, keep-alive"),
            ("connection", "Upgrade, x-hop-b"),
            ("x-hop-a", "1"),
            ("x-hop-b", "2"),
            ("x-kept", "yes"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn split_cookies_become_one_field() {
        let mut h = map(&[("cookie", "a=1"), ("x-kept", "1"), ("cookie", "b=2")]);
        join_cookies(&mut h);
        let cookies: Vec<_> = h.get_all("cookie").iter().collect();
        assert_eq!(cookies, ["a=1; b=2"]);
        assert_eq!(h["x-kept"], "1");
        let mut h = map(&[("cookie", "a=1")]);
        join_cookies(&mut h);
        assert_eq!(h["cookie"], "a=1");
        // A part HPACK was told never to index keeps the joined field out of the table too.
        let mut h = map(&[("cookie", "a=1")]);
        let mut secret = HeaderValue::from_static("session=s");
        secret.set_sensitive(true);
        h.append("cookie", secret);
        join_cookies(&mut h);
        assert_eq!(h["cookie"], "a=1; session=s");
        assert!(h["cookie"].is_sensitive());
    }

    /// An upgrade takes both fields (RFC 9110 §7.8: `Upgrade` is listed in `Connection`), and
    /// a WebSocket offer, over HTTP/1.1: anything less is answered as a plain request.
    #[test]
    fn an_upgrade_needs_both_fields_websocket_and_http_1_1() {
        let upgrade = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ];
        assert!(is_upgrade(&map(&upgrade)));
        assert!(!is_upgrade(&map(&[("upgrade", "websocket")])));
        assert!(!is_upgrade(&map(&[
            ("connection", "keep-alive"),
            ("upgrade", "websocket")
        ])));
        assert!(!is_upgrade(&map(&[("connection", "upgrade")])));

        use http::Version;
        let request = |version, pairs: &[(&str, &str)]| {
            let mut req = http::Request::new(());
            *req.version_mut() = version;
            *req.headers_mut() = map(pairs);
            req
        };
        assert!(is_upgrade_request(&request(Version::HTTP_11, &upgrade)));
        assert!(!is_upgrade_request(&request(Version::HTTP_10, &upgrade)));
        let h2c = [("connection", "upgrade"), ("upgrade", "h2c")];
        assert!(!is_upgrade_request(&request(Version::HTTP_11, &h2c)));
        let offer_only = [("upgrade", "websocket")];
        assert!(!is_upgrade_request(&request(Version::HTTP_11, &offer_only)));
    }

    #[test]
    fn upgrade_survives_when_upgrading() {
        let mut h = map(&[("connection", "Upgrade"), ("upgrade", "websocket")]);
        assert!(is_upgrade(&h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
    }

    #[test]
    fn api_credentials_replaced() {
        let mut h = map(&[
            ("x-api-key", "dummy"),
            ("X-Api-Key", "dummy2"),
            ("authorization", "Bearer dummy"),
        ]);
        let key = Secret::new("real");
        authorize_api(
            &mut h,
            &AuthScheme::Bearer,
            AuthScheme::Bearer.value(&key).unwrap(),
        );
        assert_eq!(h.len(), 1);
        assert_eq!(h["authorization"], "Bearer real");

        // A provider with a header of its own gets no `Authorization` from the client either.
        let scheme = AuthScheme::Header(HeaderName::from_static("open-sandbox-api-key"));
        let mut h = map(&[
            ("authorization", "Bearer dummy"),
            ("open-sandbox-api-key", "dummy"),
            ("x-kept", "1"),
        ]);
        authorize_api(&mut h, &scheme, scheme.value(&key).unwrap());
        assert!(!h.contains_key("authorization"), "{h:?}");
        assert_eq!(h["open-sandbox-api-key"], "real");
        assert_eq!(h["x-kept"], "1");
    }

    #[test]
    fn volume_content_keeps_its_own_token() {
        for path in [
            "/volumecontent/vol-1/file",
            "/volumecontent/v/dir",
            "/volumecontent/v",
        ] {
            assert!(is_volume_content(path), "{path}");
        }
        for path in [
            "/volumecontent/",
            "/volumecontent",
            "/volumes/vol-1",
            "/v2/volumecontent/v/file",
            "/VOLUMECONTENT/v/file",
            "/sandboxes",
        ] {
            assert!(!is_volume_content(path), "{path}");
        }
        let sent = [
            ("x-api-key", "dummy"),
            ("authorization", "Bearer volume-token"),
            ("open-sandbox-api-key", "dummy"),
            ("x-kept", "1"),
        ];
        let mut h = map(&sent);
        authorize_own(&mut h, &AuthScheme::Bearer);
        assert_eq!(h["authorization"], "Bearer volume-token");
        assert!(!h.contains_key("x-api-key"), "{h:?}");
        assert_eq!(
            (h["open-sandbox-api-key"].as_bytes(), h.len()),
            (&b"dummy"[..], 3)
        );
        let scheme = AuthScheme::Header(HeaderName::from_static("open-sandbox-api-key"));
        let mut h = map(&sent);
        authorize_own(&mut h, &scheme);
        assert_eq!(h["authorization"], "Bearer volume-token");
        assert_eq!(h.len(), 2, "{h:?}");
    }

    /// A plugin whose header is `Authorization` (some APIs take a raw key there) leaves
    /// the client's own to the rules a bearer scheme has: a `Basic` on envd still picks the
    /// user, an app's or a volume's token still passes.
    #[test]
    fn a_plugin_header_named_authorization_keeps_the_clients_own_rules() {
        let scheme = AuthScheme::Header(header::AUTHORIZATION);
        let token = Secret::new("tok");
        let mut h = map(&[("authorization", "Basic cm9vdDo="), ("x-api-key", "dummy")]);
        authorize_envd(&mut h, &scheme, &token, "isb-1", DEFAULT_ENVD_PORT);
        assert_eq!(h["authorization"], "Basic cm9vdDo=", "{h:?}");
        assert!(!h.contains_key("x-api-key"), "{h:?}");
        // The dummy key the client put there is no user: the default one goes instead.
        let mut h = map(&[("authorization", "dummy")]);
        authorize_envd(&mut h, &scheme, &token, "isb-1", DEFAULT_ENVD_PORT);
        assert_eq!(h["authorization"], DEFAULT_BASIC, "{h:?}");
        let mut h = map(&[("authorization", "Bearer app-token")]);
        authorize_envd(&mut h, &scheme, &Secret::new(""), "isb-1", 8080);
        assert_eq!(h["authorization"], "Bearer app-token", "{h:?}");
        let mut h = map(&[("authorization", "Bearer volume-token")]);
        authorize_own(&mut h, &scheme);
        assert_eq!(h["authorization"], "Bearer volume-token", "{h:?}");
    }

    #[test]
    fn the_sandbox_proxy_route_as_the_server_reads_it() {
        for path in [
            "/sandboxes/osb-1/proxy/3000",
            "/sandboxes/osb-1/proxy/3000/",
            "/v1/sandboxes/osb-1/proxy/8080/a/b?c",
            "/v1/sandboxes/osb-1/%70roxy/1/",
            "/v1/sandboxes/osb%2D1/proxy/%31",
            "/%76%31/sandboxes/x/proxy/1",
            // Routed to the app all the same by a server that asks the key for them.
            "/sandboxes/osb-1/proxy/",
            "/sandboxes/osb-1/proxy/x",
            "/sandboxes/osb-1/proxy/3000x",
            "/sandboxes/a..b/proxy/3000",
            "/sandboxes/x/proxy/3000/app..min.js",
            "/sandboxes/x/proxy/3000/a%3F..",
            "/sandboxes/x/proxy/3000%0A",
            "/sandboxes/x/proxy%2F3000/",
            // As a hop that merges slashes or drops parameters passes them on.
            "/v1//sandboxes/x/proxy/8080/a",
            "//sandboxes/x/proxy/8080",
            "/v1/sandboxes/x//proxy/8080/a",
            "/v1/sandboxes/x/proxy//8080",
            "/v1/sandboxes/x/proxy;p/8080/a",
            "/v1;p/sandboxes;q/x;r/proxy;s/1",
            "/sandboxes/x/proxy%3Bp/1",
            "/v1/%2Fsandboxes/x/proxy/1",
            "/v1/sandboxes/x\\proxy/8080/a",
            "/v1/sandboxes/x%5Cproxy/8080/a",
            "/v1\\sandboxes\\x\\proxy\\1",
        ] {
            assert!(is_sandbox_proxy_route(path), "{path}");
        }
        for path in [
            "/sandboxes/osb-1/proxy",
            "/sandboxes/osb-1/proxyx/1",
            "/sandboxes//proxy/3000",
            "/sandboxes/a/b/proxy/3000",
            "/sandboxes/a%2Fb/proxy/3000",
            "/v1/v1/sandboxes/x/proxy/1",
            "/v2/sandboxes/x/proxy/1",
            "/v1sandboxes/x/proxy/1",
            "/Sandboxes/x/proxy/1",
            "/sandboxes/x/PROXY/1",
            "/sandboxes",
            "/sandboxes/x/proxy;p",
            "/sandboxes/;p/proxy/1",
            "/sandboxes/x/prox;y/1",
        ] {
            assert!(!is_sandbox_proxy_route(path), "{path}");
        }
        assert_eq!(&*percent_decoded(b"/a%2fb%zz%4"), b"/a/b%zz%4");
        assert_eq!(&*percent_decoded(b"%ff%00"), b"\xff\x00");
        assert_eq!(&*merged(b"//a;b//c;d;e/;f/g"), b"/a/c/g");
        assert_eq!(&*merged(b"/a\\\\b/\\c;"), b"/a/b/c");
    }

    #[test]
    fn cached_auth_follows_the_key() {
        let auth = CachedAuth::new(AuthScheme::Bearer);
        let a = Secret::new("key-a");
        assert_eq!(auth.value(&a).unwrap(), "Bearer key-a");
        assert_eq!(auth.value(&a.clone()).unwrap(), "Bearer key-a");
        assert!(auth.value(&a).unwrap().is_sensitive());
        assert_eq!(auth.value(&Secret::new("key-b")).unwrap(), "Bearer key-b");
        assert_eq!(auth.value(&Secret::new("key-a")).unwrap(), "Bearer key-a");
        assert!(auth.value(&Secret::new("bad\nkey")).is_none());
        let shown = format!("{auth:?}");
        assert!(!shown.contains("key-a"), "{shown}");
        assert!(
            shown.starts_with("CachedAuth") && shown.contains("Bearer"),
            "{shown}"
        );
    }

    #[test]
    fn envd_basic_kept_or_defaulted() {
        let t = Secret::new("tok");
        let mut h = map(&[("authorization", "Basic cm9vdDo="), ("x-api-key", "d")]);
        authorize_envd(&mut h, &AuthScheme::Bearer, &t, "isb-1", 49983);
        assert_eq!(h["authorization"], "Basic cm9vdDo=");
        assert!(!h.contains_key("x-api-key"));
        assert_eq!(h["x-access-token"], "tok");
        assert_eq!(h["e2b-sandbox-port"], "49983");
        // Not a Basic credential, or one without credentials: the default user.
        for client in ["Bearer dummy", "Basic "] {
            let mut h = map(&[("authorization", client)]);
            authorize_envd(&mut h, &AuthScheme::Bearer, &t, "isb-1", 49983);
            assert_eq!(h["authorization"], "Basic dXNlcjo=", "{client:?}");
        }
        // An app's port: the client's credential for the app, or none.
        let mut h = map(&[("authorization", "Bearer mcp")]);
        authorize_envd(&mut h, &AuthScheme::Bearer, &t, "isb-1", 50005);
        assert_eq!(h["authorization"], "Bearer mcp");
        assert_eq!(h["e2b-sandbox-port"], "50005");
        let mut h = map(&[]);
        authorize_envd(&mut h, &AuthScheme::Bearer, &t, "isb-1", 8080);
        assert!(!h.contains_key("authorization"), "{h:?}");
    }

    #[test]
    fn keepalives_are_paced_for_the_idle_timeout() {
        use std::time::Duration;
        let secs = Duration::from_secs;
        for (sent, idle, expected) in [
            (Some("50"), secs(3), Some("1")),
            (Some("50"), secs(4), Some("2")),
            // Never 0 (an older envd's ticker panics on it), however short the timeout.
            (Some("50"), Duration::from_millis(900), Some("1")),
            (Some("50"), secs(300), Some("50")),
            (Some("3"), secs(30), Some("3")),
            (Some("1 "), secs(4), Some("1 ")),
            (Some("1\t"), secs(4), Some("1\t")),
            (Some("+20"), secs(30), Some("15")),
            // What envd reads as its default of 90 s.
            (None, secs(30), Some("15")),
            (None, secs(300), None),
            (Some("0"), secs(30), Some("15")),
            (Some("-5"), secs(30), Some("15")),
            (Some("soon"), secs(30), Some("15")),
            (Some("soon"), secs(300), Some("soon")),
            (Some("9999999999"), secs(300), Some("150")),
            (
                Some("99999999999999999999"),
                secs(300),
                Some("99999999999999999999"),
            ),
        ] {
            let mut h = sent.map_or_else(HeaderMap::new, |v| {
                map(&[
                    ("keepalive-ping-interval", v),
                    ("keepalive-ping-interval", "7"),
                ])
            });
            pace_keepalives(&mut h, idle);
            let values: Vec<_> = h.get_all("keepalive-ping-interval").iter().collect();
            match expected {
                Some(e) if Some(e) == sent => assert_eq!(values, [e, "7"], "{sent:?}"),
                Some(e) => assert_eq!(values, [e], "{sent:?} under {idle:?}"),
                None => assert!(values.is_empty(), "{values:?}"),
            }
        }
    }

    /// Only the WebSocket offer goes on with an upgrade: `h2c` beside it would let the
    /// upstream switch to a protocol the proxy does not check.
    #[test]
    fn an_upgrade_keeps_websocket_alone() {
        for offered in [
            vec!["h2c, websocket"],
            vec!["h2c", "WebSocket"],
            vec!["websocket, TLS/1.0"],
        ] {
            let mut pairs = vec![("connection", "Upgrade, HTTP2-Settings")];
            pairs.extend(offered.iter().map(|o| ("upgrade", *o)));
            let mut h = map(&pairs);
            strip_hop_by_hop(&mut h, true);
            let upgrade: Vec<_> = h.get_all("upgrade").iter().collect();
            assert_eq!(upgrade.len(), 1, "{offered:?}");
            assert!(upgrade[0].as_bytes().eq_ignore_ascii_case(b"websocket"));
            assert_eq!(h["connection"], "upgrade");
        }
        // Nothing to tunnel: neither field goes on.
        let mut h = map(&[("connection", "upgrade"), ("upgrade", "we")]);
        strip_hop_by_hop(&mut h, true);
        assert!(
            !h.contains_key("upgrade") && !h.contains_key("connection"),
            "{h:?}"
        );
    }

    /// A plugin's own auth header carries the client's (dummy) control-plane key: it goes
    /// to envd no more than `X-API-Key` does.
    #[test]
    fn envd_gets_no_plugin_auth_header() {
        let scheme = AuthScheme::Header(HeaderName::from_static("open-sandbox-api-key"));
        let mut h = map(&[("open-sandbox-api-key", "dummy"), ("x-other", "1")]);
        authorize_envd(&mut h, &scheme, &Secret::new("tok"), "isb-1", 49983);
        assert!(!h.contains_key("open-sandbox-api-key"));
        assert_eq!(h["x-other"], "1");
        assert_eq!(h["x-access-token"], "tok");
    }
}
