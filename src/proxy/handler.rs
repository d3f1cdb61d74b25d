//! One request through the phases: route → authorize → rewrite → forward → respond → log.
//! Each phase is a call in [`Proxy::handle`] or in the plane functions below it. The
//! control plane authorizes after its rewrite, which may wait for the request's body: its
//! temporary key is taken as late as possible, so that it never goes out expired.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{ACCEPT_ENCODING, CONTENT_LENGTH, HOST};
use http::request::Parts;
use http::uri::{PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;

use super::body::{self, Bounded, Moved, Prefixed, READ_WHOLE_LIMIT};
use super::compat::{self, Rewrite};
use super::forward::{self, FailKind, Failed};
use super::framing::Refusal;
use super::headers::{self, X_ACCESS_TOKEN};
use super::listener::{MAX_HEAD, MAX_HEADERS};
use super::route::{self, Route, DEFAULT_ENVD_PORT};
use super::sandbox_path;
use super::sniff::{self, Sniff};
use super::tunnel::{self, Upgrade};
use super::{EnvdTarget, Proxy};
use crate::credentials::envd::TokenOwner;
use crate::credentials::ApiCredential;
use crate::error::{Error, Within};
use crate::logging::AccessLine;
use crate::metrics::{GaugeGuard, Plane};
use crate::secret::Secret;
use crate::settings::{CompatMode, UpstreamUrl};
use crate::upstream::ProxyBody;

/// The header with which the E2B SDKs let a server say whether a 429/502/503/504 may be sent
/// again; without it they send the request again, a `POST` included (Python SDK 2.63: three
/// times).
const SHOULD_RETRY: http::HeaderName = http::HeaderName::from_static("should-retry");
/// A client's promise that the upstream carries out a request with the same key once.
const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");
/// Asked for on the answers the proxy reads itself (the envd token is in their JSON).
const IDENTITY: http::HeaderValue = http::HeaderValue::from_static("identity");

/// A key that cannot be sent as a header value. A static key is refused at start, so this
/// is a temporary key from the exchange.
fn unusable_key() -> Error {
    Error::TokenExchange {
        reason: "the temporary key is not usable as an HTTP header value".into(),
    }
}

/// A request the proxy cannot build for its upstream (a target no URI holds): the
/// client's, refused 400 E5003.
fn unbuildable(reason: impl std::fmt::Display) -> Error {
    Error::Refused {
        reason: format!("cannot build the upstream request: {reason}"),
    }
}

impl Proxy {
    /// Not an `async fn`: that would keep `req` twice in its future (as passed and as
    /// moved into the body), and the callers box this future for every request, which
    /// copies it whole. The synchronous start runs here, before the future exists.
    pub fn handle(
        self: Arc<Self>,
        mut req: Request<ProxyBody>,
    ) -> impl Future<Output = Result<Response<ProxyBody>, Infallible>> + Send {
        let start = Instant::now();
        let method = req.method().clone();
        let uri = req.uri().clone();
        let upgrade = headers::is_upgrade_request(&req).then(|| Upgrade::of(&mut req));
        let (mut parts, body) = req.into_parts();
        // An HTTP/2 upload's progress (see below).
        let upload = parts.extensions.remove::<Moved>();
        // HTTP/1 heads are held to the limits by their parser (hyper answers 431), and the
        // size hyper's parser may let through by the framing watch. HTTP/2 counts no
        // fields, and its layer's own size limit is set above ours (see
        // `listener::H2_MAX_HEAD_LIST`): its 431 would reach no log and no count.
        let oversized = parts.headers.len() > MAX_HEADERS
            || (parts.version == Version::HTTP_2 && h2_head_size(&parts) > MAX_HEAD)
            || parts.extensions.get::<Refusal>() == Some(&Refusal::HeadTooLarge);
        // Only a non-idempotent method looks for the header and the path: none of the hot
        // path's GETs.
        let repeatable = method.is_idempotent()
            || parts.headers.contains_key(IDEMPOTENCY_KEY)
            || harmless_to_repeat(uri.path());
        // route, and everything else, before the future exists: hyper drops a future it
        // never polled (its HTTP/1 dispatcher reads the client's FIN right behind the head
        // and closes first), and the plane its 499 is counted on is the route's.
        let routed = (!oversized).then(|| self.route_of(&mut parts));
        let (plane, route, refused) = match routed {
            None => (Plane::Api, None, None),
            Some(Ok(route)) => (route.plane(), Some(route), None),
            // Boxed: rare, and inline it sizes every request's future.
            Some(Err((plane, refused))) => (plane, None, Some(Box::new(refused))),
        };
        let mut unanswered = Unanswered {
            proxy: self,
            method,
            uri,
            plane,
            route,
            tried: Tried::default(),
            start,
            // Answered with its 431 and its own line (`head_refused`).
            answered: oversized,
        };
        async move {
            // Borrows of three fields: `unanswered` is still marked as the work goes.
            let (this, tried) = (&unanswered.proxy, &unanswered.tried);
            let result = match (&unanswered.route, refused) {
                (_, Some(refused)) => Err(*refused),
                // Neither routed nor refused: not looked at, for its size.
                (None, None) => {
                    let status = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
                    this.head_refused(status, start.elapsed());
                    let mut too_large = Response::new(body::empty());
                    *too_large.status_mut() = status;
                    return Ok(too_large);
                }
                (Some(route), None) => {
                    let in_flight = GaugeGuard::new(this.metrics.in_flight_for(plane));
                    let result = match route {
                        Route::Api => this.api(parts, body, upgrade, tried).await,
                        // Boxed: with its token look-up and 401 replay the envd plane's
                        // state is several times the control plane's, and would size
                        // every request.
                        Route::Envd { sandbox_id, port } => {
                            let envd = this.envd(parts, body, sandbox_id, *port, upgrade, tried);
                            Box::pin(envd).await
                        }
                    };
                    drop(in_flight);
                    result
                }
            };
            // An HTTP/2 client that reset its stream before the end of its upload has given
            // the request up: whatever became of it, no answer reaches the client, and
            // `unanswered` logs and counts it as 499 (nginx's "client closed request"). So
            // would hyper's dropping the request on the reset, but only when it sees the
            // reset before the handler sees the body's error and answers. So has one whose
            // connection the end of the drain's grace closed: its upload broke with the
            // connection, and its 400 was no refusal of the client's (HTTP/1's are dropped
            // with their connection's task, 499 too).
            // Unfinished, not only aborting: an upload whole, answered as the grace ended,
            // is the upstream's answer still.
            let cut = |u: &Moved| u.reset_by_client() || (!u.ended() && *this.aborting.borrow());
            if upload.as_ref().is_some_and(cut) {
                let mut gone = Response::new(body::empty());
                gone.extensions_mut().insert(GaveUp);
                return Ok(gone);
            }
            let (resp, upstream, error, reason) = match result {
                Ok((mut resp, upstream)) => {
                    if !repeatable && plane == Plane::Api {
                        say_not_to_retry_a_gateway_failure(&mut resp);
                    }
                    (resp, upstream, None, None)
                }
                Err(f) => {
                    let code = f.error.code();
                    let reason = match &f.error {
                        Error::UpstreamUnreachable { reason, .. }
                        | Error::UpstreamUnavailable { reason, .. } => Some(reason.clone()),
                        _ => None,
                    };
                    let (resp, host) = this.failure_answer(plane, f, repeatable);
                    (resp, host, Some(code), reason)
                }
            };
            unanswered.answered = true;
            let elapsed = start.elapsed();
            let status = resp.status().as_u16();
            let method = &unanswered.method;
            this.metrics.request_done(plane, method, status, elapsed);
            // Never the query string: signed file URLs carry secrets there.
            let path = logged_target(&unanswered.uri);
            crate::logging::access(&AccessLine {
                method,
                path,
                plane: plane.label(),
                status,
                elapsed,
                upstream: &upstream,
                error,
                reason: reason.as_deref(),
            });
            Ok(resp)
        }
    }
}

impl Proxy {
    /// route: where a request goes, or why it goes nowhere and which plane counts it.
    fn route_of(&self, parts: &mut Parts) -> Result<Route, (Plane, Failed)> {
        let route = match route::route(parts, &self.host_policy) {
            Ok(route) => route,
            Err(e) => {
                // A token-only envd request is envd's as `by_token` would route it.
                let plane = match self.envd {
                    Some(_) => match route::refused_plane(parts) {
                        Plane::Api if self.by_token(parts).is_some() => Plane::Envd,
                        plane => plane,
                    },
                    None => Plane::Api,
                };
                return Err((plane, Failed::from(e)));
            }
        };
        // A provider without envd gets everything on its control plane.
        let route = match route {
            Route::Envd { .. } if self.envd.is_none() => Route::Api,
            Route::Api if self.envd.is_some() => match self.by_token(parts) {
                Some((route, owner)) => {
                    if owner.deleted {
                        parts.extensions.insert(DeletedSandbox);
                    }
                    route
                }
                None => Route::Api,
            },
            route => route,
        };
        match self.naming_no_sandbox(&route, parts) {
            Some(refused) => Err((Plane::Envd, refused)),
            None => Ok(route),
        }
    }

    /// respond, for a request that failed: the error's own answer, and the upstream host
    /// it names for the access line.
    fn failure_answer(
        &self,
        plane: Plane,
        f: Failed,
        repeatable: bool,
    ) -> (Response<ProxyBody>, Arc<str>) {
        if let Some(kind) = f.kind {
            self.metrics.upstream_error(plane, kind);
        }
        let host = match &f.error {
            Error::UpstreamUnreachable { host, .. }
            | Error::UpstreamUnavailable { host, .. }
            | Error::UpstreamTimeout { host, .. }
            | Error::UpstreamSilent { host, .. } => Arc::from(host.as_str()),
            // The control plane's answer to the token look-up says so.
            Error::SandboxNotFound { .. } => self.api_host.clone(),
            _ => Arc::from(""),
        };
        let mut resp = body::error_response(&f.error);
        // The upstream may have created the sandbox whose answer failed: sent again, the
        // request could create a second one.
        if f.reached && !repeatable {
            resp.headers_mut()
                .insert(SHOULD_RETRY, http::HeaderValue::from_static("false"));
        }
        (resp, host)
    }
}

/// A request's target as its access line shows it: the path, never the query (signed file
/// URLs carry secrets there); a `CONNECT`'s authority, which has no path (RFC 9112
/// §3.2.3: its line said `""`), without the userinfo a client may put in it.
fn logged_target(uri: &Uri) -> &str {
    match uri.path() {
        "" => uri
            .authority()
            .and_then(|a| a.as_str().rsplit('@').next())
            .unwrap_or(""),
        path => path,
    }
}

/// `POST /sandboxes/{id}/connect`, `…/timeout`, `…/pause`, `…/resume`, `…/refreshes` (and
/// their `/v2` forms): done twice, they leave the sandbox as done once, so the SDKs'
/// retry is kept for them (a 502 is as often a request that never reached the control
/// plane).
fn harmless_to_repeat(path: &str) -> bool {
    sandbox_path::parse(path).is_some_and(|p| {
        p.id.is_some()
            && matches!(
                p.action,
                Some("connect" | "timeout" | "pause" | "resume" | "refreshes")
            )
    })
}

/// A gateway in front of the control plane answering 502 or 504 to a request that is not
/// safe to repeat leaves its outcome as unknown as the proxy's own 502/504 does (a create
/// it gave up waiting for may have been carried out behind it): the same
/// `Should-Retry: false`, unless the answer says itself. Python SDK 2.63 otherwise sent
/// such a create four times, each of which could leave a sandbox running. A 503 or 429
/// says the request was not taken: the SDKs' retry stays.
fn say_not_to_retry_a_gateway_failure(resp: &mut Response<ProxyBody>) {
    let status = resp.status();
    if (status == StatusCode::BAD_GATEWAY || status == StatusCode::GATEWAY_TIMEOUT)
        && !resp.headers().contains_key(SHOULD_RETRY)
    {
        resp.headers_mut()
            .insert(SHOULD_RETRY, http::HeaderValue::from_static("false"));
    }
}

impl Proxy {
    /// The credential in place and its key. A reload may replace the credential while a
    /// request waits on it (an AK/SK pair's first exchange, or a refresh): the replaced
    /// one wakes its waiters as it retires, and they ask the new one.
    async fn api_key(&self) -> Result<(Arc<ApiCredential>, Secret), Error> {
        let credential = self.credential.load_full();
        match credential.current().await {
            Ok(key) => Ok((credential, key)),
            Err(e) => {
                let now = self.credential.load_full();
                if Arc::ptr_eq(&now, &credential) {
                    return Err(e);
                }
                let key = now.current().await?;
                Ok((now, key))
            }
        }
    }

    /// A key to send again a request the control plane refused with `key` from
    /// `credential`: the temporary key replacing it, or, when a reload has replaced the
    /// credential itself meanwhile, its successor's key (a retired source has no refresh
    /// coming: its requests waited 10 s for none). The credential goes with the key, to be
    /// told how the control plane answers it.
    async fn replacement(
        &self,
        credential: &Arc<ApiCredential>,
        key: &Secret,
    ) -> Option<(Arc<ApiCredential>, Secret)> {
        if let Some(fresh) = credential.replacement(key).await {
            return Some((credential.clone(), fresh));
        }
        let now = self.credential.load_full();
        if Arc::ptr_eq(&now, credential) {
            return None;
        }
        // A reload swaps in a pair only once it has a key: no wait here.
        let fresh = now.current().await.ok()?;
        (fresh != *key).then_some((now, fresh))
    }

    /// A head refused for what it is, before it became a request (one hyper cannot parse,
    /// or over the field or size limits, on any path): logged and counted as nginx logs
    /// its 400s, with `method` and `path` unknown (`-`; counted as `OTHER`). Not by its
    /// parts: the path alone may be most of a head over the limit. Not timed: the latency
    /// histogram is for requests that were made (a 408 observed at 0 s pulled the
    /// quantiles down with every stalled client or scanner). `took` is for the access line
    /// (a 408's wait for its head; zero where the head's time is not known).
    #[cold]
    pub(super) fn head_refused(&self, status: StatusCode, took: Duration) {
        let unknown = Method::from_bytes(b"-").unwrap_or_default();
        let (plane, status) = (Plane::Api, status.as_u16());
        self.metrics.head_refused(plane, &unknown, status);
        crate::logging::access(&AccessLine {
            method: &unknown,
            path: "-",
            plane: plane.label(),
            status,
            elapsed: took,
            upstream: "",
            error: None,
            reason: None,
        });
    }
}

/// An HTTP/2 head's size as HTTP/2 measures it (RFC 9113 §6.5.2,
/// `SETTINGS_MAX_HEADER_LIST_SIZE`): each field's name and value plus 32, pseudo-fields
/// included. A sum over what hyper already decoded, without allocating.
fn h2_head_size(parts: &Parts) -> usize {
    const PER_FIELD: usize = 32;
    let field = |name: &str, value: &str| name.len() + value.len() + PER_FIELD;
    let uri = &parts.uri;
    let pseudo = field(":method", parts.method.as_str())
        + uri.scheme_str().map_or(0, |s| field(":scheme", s))
        + uri
            .authority()
            .map_or(0, |a| field(":authority", a.as_str()))
        + uri
            .path_and_query()
            .map_or(0, |p| field(":path", p.as_str()));
    parts.headers.iter().fold(pseudo, |size, (name, value)| {
        size + name.as_str().len() + value.len() + PER_FIELD
    })
}

/// Marks a request routed by the token of a sandbox deleted through the proxy (see
/// [`Proxy::by_token`]): it goes with the client's token alone, neither the store's nor
/// one looked up after envd's 401. Its id may name another sandbox by now (a provider
/// that reuses ids): the proxy sent that one's token, and ran the request in it.
#[derive(Clone, Copy)]
struct DeletedSandbox;

/// Marks the answer to a request its client gave up (see [`Proxy::handle`]): no answer
/// reaches it, and its connection counts it as cancelled.
#[derive(Clone, Copy)]
pub(super) struct GaveUp;

/// A request dropped before its answer (the client hung up, or the connection was cut,
/// even before the handler's future was first polled): counted and logged as 499, nginx's
/// "client closed request", so that every request the proxy began has its access line
/// and its count. Marked `answered` once the answer is there. It holds what the handler
/// works with (the proxy, the method, the target, the route), so that it exists before the
/// future.
struct Unanswered {
    proxy: Arc<Proxy>,
    method: Method,
    uri: http::Uri,
    plane: Plane,
    /// Where the request goes (its 499 is counted on its plane).
    route: Option<Route>,
    tried: Tried,
    start: Instant,
    answered: bool,
}

/// Where a request went before its client left, for its 499's `upstream`, as nginx's
/// `$upstream_addr` names the upstream a request was sent to: nowhere yet (waiting for the
/// key, or for its body to be rewritten), the control plane (its sandbox's token looked
/// up: a slow control plane, not the sandbox), or its route's upstream.
#[derive(Default)]
struct Tried(AtomicU8);

impl Tried {
    const CONTROL_PLANE: u8 = 1;
    const ROUTE: u8 = 2;

    fn control_plane(&self) {
        self.0.store(Self::CONTROL_PLANE, Ordering::Relaxed);
    }

    fn route(&self) {
        self.0.store(Self::ROUTE, Ordering::Relaxed);
    }
}

impl Unanswered {
    #[cold]
    fn client_closed(&self) {
        const CLIENT_CLOSED: u16 = 499;
        let elapsed = self.start.elapsed();
        let proxy = &self.proxy;
        proxy
            .metrics
            .request_done(self.plane, &self.method, CLIENT_CLOSED, elapsed);
        let upstream = match (self.tried.0.load(Ordering::Relaxed), &self.route) {
            (Tried::CONTROL_PLANE, _) | (Tried::ROUTE, Some(Route::Api)) => proxy.api_host.clone(),
            (Tried::ROUTE, Some(Route::Envd { sandbox_id, port })) => {
                proxy.envd_shown_host(sandbox_id, *port)
            }
            _ => Arc::from(""),
        };
        crate::logging::access(&AccessLine {
            method: &self.method,
            path: logged_target(&self.uri),
            plane: self.plane.label(),
            status: CLIENT_CLOSED,
            elapsed,
            upstream: &upstream,
            error: None,
            reason: None,
        });
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if !self.answered {
            self.client_closed();
        }
    }
}

impl Proxy {
    /// An envd request that names no sandbox but carries the token the proxy learned for
    /// one: that sandbox's, on envd's port. e2b Python 2.10-2.20 send commands and files
    /// of a sandbox got by `Sandbox.connect` so, as JS 2.9 sends its file and health
    /// requests: on the control plane they got its 404 (or its `/health`'s 200 for a
    /// sandbox killed). Only envd's paths, only a token the store holds: the client could
    /// name that sandbox itself.
    fn by_token(&self, parts: &Parts) -> Option<(Route, TokenOwner)> {
        let token = parts.headers.get(X_ACCESS_TOKEN)?;
        if !route::is_envd_path(parts.uri.path()) {
            return None;
        }
        let owner = self.tokens.sandbox_of(token.as_bytes())?;
        let route = Route::Envd {
            sandbox_id: owner.id.to_string(),
            port: DEFAULT_ENVD_PORT,
        };
        Some((route, owner))
    }

    /// The control plane: attach the key, rewrite `/v2`, learn envd tokens.
    /// Not an `async fn`, for the reason given at [`Proxy::handle`].
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn api<'a>(
        &'a self,
        mut parts: Parts,
        body: ProxyBody,
        upgrade: Option<Upgrade>,
        tried: &'a Tried,
    ) -> impl Future<Output = Result<(Response<ProxyBody>, Arc<str>), Failed>> + Send + 'a {
        async move {
            // rewrite
            let path = parts.uri.path();
            // Read on the client's path: a base URL's own path goes before it upstream.
            let app_route = headers::is_sandbox_proxy_route(path);
            let own_credential = app_route || headers::is_volume_content(path);
            let rewrite = match self.compat {
                CompatMode::Rewrite => compat::plan(&parts.method, path),
                CompatMode::Pass => Rewrite::None,
            };
            let upstream_path = match rewrite {
                Rewrite::None => path,
                _ => compat::rewritten_path(path),
            };
            let sniff = sniff::plan(&parts.method, upstream_path);
            let uri = if rewrite == Rewrite::None && self.api_base.path.is_empty() {
                // The common case: the client's path and query as hyper parsed them, under the
                // upstream's scheme and authority; no string is built and nothing re-parsed.
                upstream_uri(&self.api_base, &parts.uri)
            } else {
                match parts.uri.query() {
                    Some(q) => self.api_base.join(&format!("{upstream_path}?{q}")),
                    None => self.api_base.join(upstream_path),
                }
            }
            .map_err(unbuildable)?;
            headers::strip_hop_by_hop(&mut parts.headers, upgrade.is_some());
            parts.headers.remove(HOST);
            if app_route {
                headers::keep_local_cookies(&mut parts.headers);
            }
            if sniff == Sniff::Learn {
                // The token is read from the body: ask for it uncompressed. Saying so, as
                // no field at all means any coding will do (RFC 9110 §12.5.3).
                parts.headers.insert(ACCEPT_ENCODING, IDENTITY);
            }
            let body = if rewrite != Rewrite::None {
                parts.headers.remove(CONTENT_LENGTH);
                // Boxed, like the sniff in `respond`: rare, and inline it sizes every request.
                Box::pin(self.rewritten_body(&rewrite, body, &mut parts.extensions)).await?
            } else {
                body
            };
            parts.uri = uri;
            if parts.version == Version::HTTP_2 {
                headers::join_cookies(&mut parts.headers);
            }
            parts.version = Version::HTTP_11;

            // authorize: once the body is in. A rewritten one may take up to the upstream
            // timeout to arrive, and a key taken before it could go out expired (SPEC §5:
            // never later than 5 s before its expiry). Volume content carries the client's
            // own token, a sandbox's app through the server its own or none: no key, and
            // their 401 says nothing of the key.
            let keyed = if own_credential {
                headers::authorize_own(&mut parts.headers, self.auth.scheme());
                None
            } else {
                let (credential, key) = self.api_key().await?;
                let auth_value = self.auth.value(&key).ok_or_else(unusable_key)?;
                headers::authorize_api(&mut parts.headers, self.auth.scheme(), auth_value);
                if self.envd.is_some() {
                    // A sandbox's envd token is envd's credential (SPEC §4), never the
                    // control plane's.
                    parts.headers.remove(X_ACCESS_TOKEN);
                }
                Some((credential, key))
            };
            let req = Request::from_parts(parts, body);
            // A temporary key can be refused before its expiry (revoked, or a clock behind
            // the endpoint's): a request the proxy holds whole, one without a body or a
            // rewritten one, is sent again with the key that replaces it, as after envd's
            // 401 (SPEC §4). A static key refused is the user's to mend.
            let replay = match keyed.as_ref().map(|(c, _)| &**c) {
                Some(ApiCredential::Exchanged(_)) if upgrade.is_none() => {
                    super::pool::Again::of(&req)
                }
                _ => None,
            };

            // forward
            let host = self.api_host.clone();
            let client = match upgrade {
                // HTTP/2 has no Upgrade: a WebSocket goes over the HTTP/1.1 client.
                Some(_) => &self.envd_client,
                None => &self.api_client,
            };
            tried.route();
            let mut resp =
                forward::send(client, Plane::Api, req, self.upstream_timeout, &host).await?;
            // Borrowed, and the replay decided outside: moved into the branch, they took
            // slots of their own in every request's future (+224 bytes).
            let again = replay.filter(|_| resp.status() == StatusCode::UNAUTHORIZED);
            if let Some((credential, key)) = &keyed {
                judge(credential, key, resp.status(), &host);
                if let Some(again) = again {
                    let fresh = self.replacement(credential, key).await;
                    if let Some((credential, fresh, value)) =
                        fresh.and_then(|(c, k)| self.auth.value(&k).map(|v| (c, k, v)))
                    {
                        let mut req = again.into_request(None);
                        headers::authorize_api(req.headers_mut(), self.auth.scheme(), value);
                        drop(resp);
                        resp = forward::send(client, Plane::Api, req, self.upstream_timeout, &host)
                            .await?;
                        judge(&credential, &fresh, resp.status(), &host);
                    }
                }
            }

            // respond
            let mut resp = self.respond(Plane::Api, resp, sniff, upgrade).await?;
            if app_route {
                headers::sandbox_the_page(resp.headers_mut());
            }
            Ok((resp, host))
        }
    }

    /// rewrite, a body: read whole when it fits in the held room and given the field
    /// `rewrite` adds (kept in `extensions` to be sent again), else streamed with the field
    /// in its first bytes. Bounded in time: while the handler has the request, no idle
    /// timeout runs on its connection, and the upstream's timeout has not begun.
    async fn rewritten_body(
        &self,
        rewrite: &Rewrite,
        body: ProxyBody,
        extensions: &mut http::Extensions,
    ) -> Result<ProxyBody, Failed> {
        let read = body::read_bounded(body, READ_WHOLE_LIMIT, Some(&self.held));
        let Ok(read) = tokio::time::timeout(self.upstream_timeout, read).await else {
            return Err(Error::Refused {
                reason: format!(
                    "request body not received within {}",
                    Within(self.upstream_timeout)
                ),
            }
            .into());
        };
        match read {
            Ok(Bounded::Complete(b, room)) => {
                let b = room.hold(compat::complete_body(rewrite, b));
                // Sent again should the upstream refuse it unprocessed.
                extensions.insert(super::pool::Replay(b.clone()));
                Ok(body::full(b))
            }
            // Too long to hold: streamed, the field added to its first bytes.
            Ok(Bounded::Partial(head, rest)) => Ok(compat::complete_head(rewrite, head)
                .into_iter()
                .rev()
                .fold(body::boxed(rest), |b, piece| {
                    body::boxed(Prefixed::new(piece, b))
                })),
            // Passed on unread, it would go up without the field the rewrite adds
            // (`"secure": true`: a sandbox whose envd anyone may use).
            Ok(Bounded::NoRoom(..)) => {
                self.held.say_full();
                Err(Error::Busy {
                    reason: format!(
                        "the proxy holds {} MiB of request and answer bodies it reads whole; retry shortly",
                        body::HELD_LIMIT >> 20
                    ),
                }
                .into())
            }
            Err(_) => Err(Error::Refused {
                reason: "request body ended early".into(),
            }
            .into()),
        }
    }

    /// envd: the sandbox's token, routing headers, one refetch on 401.
    async fn envd(
        self: &Arc<Self>,
        mut parts: Parts,
        body: ProxyBody,
        sandbox_id: &str,
        port: u16,
        upgrade: Option<Upgrade>,
        tried: &Tried,
    ) -> Result<(Response<ProxyBody>, Arc<str>), Failed> {
        // route, to the end: where the request goes, before a look-up is spent on it.
        let pq = origin_form(&parts.uri).map_err(unbuildable)?;
        let (target, host) = self.envd_uri(sandbox_id, port, pq.as_str())?;

        // authorize: the store, else the client's own token, else ask the control plane.
        // envd's port only: the token runs commands as root in the sandbox, and an app on
        // another port (a user's server, which may log or forward what it is sent) is not
        // envd; the SDKs send it none either. A token the client sends there passes.
        let client_token = parts
            .headers
            .get(X_ACCESS_TOKEN)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(Secret::new);
        let deleted = parts.extensions.remove::<DeletedSandbox>().is_some();
        let stored = (port == DEFAULT_ENVD_PORT && !deleted)
            .then(|| self.tokens.get(sandbox_id))
            .flatten();
        let (token, client_sent) = match (&stored, client_token) {
            // The control plane gave no token for this sandbox (an unsecured one, or an
            // answer without it): the client's own, when it sent one, is the better guess.
            (Some(t), Some(c)) if t.expose().is_empty() => (c, true),
            (Some(t), _) => (t.clone(), false),
            // The SDKs' copy of a token of the proxy's that envd refused (they send the one
            // their create got with every request): no token of the client's to mend, but
            // one known to fail. Looked up as if none was sent: after a look-up that
            // failed, it went to envd and its bare 401 was the answer, where the first
            // request was told why (the SDKs raised "invalid access token" for an outage).
            (None, Some(c))
                if port == DEFAULT_ENVD_PORT
                    && !deleted
                    && self.tokens.was_refused(sandbox_id, &c) =>
            {
                tried.control_plane();
                (self.lookup_token(sandbox_id).await?, false)
            }
            (None, Some(t)) => (t, true),
            (None, None) if port == DEFAULT_ENVD_PORT && !deleted => {
                tried.control_plane();
                (self.lookup_token(sandbox_id).await?, false)
            }
            (None, None) => (Secret::new(""), false),
        };

        // rewrite
        headers::strip_hop_by_hop(&mut parts.headers, upgrade.is_some());
        parts.headers.remove(HOST);
        headers::authorize_envd(
            &mut parts.headers,
            self.auth.scheme(),
            &token,
            sandbox_id,
            port,
        );
        if port == DEFAULT_ENVD_PORT {
            headers::pace_keepalives(&mut parts.headers, self.idle_timeout);
        }
        parts.uri = target;
        if parts.version == Version::HTTP_2 {
            headers::join_cookies(&mut parts.headers);
        }
        parts.version = Version::HTTP_11;
        // A request without a body can be sent again after a 401.
        let replay = body.is_end_stream().then(|| {
            (
                parts.method.clone(),
                parts.uri.clone(),
                parts.headers.clone(),
            )
        });

        // forward
        let req = Request::from_parts(parts, body);
        tried.route();
        let mut resp = forward::send(
            &self.envd_client,
            Plane::Envd,
            req,
            self.upstream_timeout,
            &host,
        )
        .await?;
        // Only envd's own 401 is about the token. An app's (another port) answers the
        // client's credential for the app: fetching the token again would let any client
        // drive look-ups with the proxy's key, and would send the request twice.
        if resp.status() == StatusCode::UNAUTHORIZED && port == DEFAULT_ENVD_PORT && !deleted {
            // The token may have been rotated: fetch it again, once. A token of the
            // proxy's is said refused first, then dropped (a request between the two would
            // find neither, and send the SDK's copy as a token of the client's). Only the
            // refused token is dropped, so concurrent 401s share one look-up instead of
            // each discarding the token the previous one just fetched; that is the token
            // sent, or the empty one the client's stood in for.
            if !client_sent {
                self.tokens.refused(sandbox_id, &token);
            }
            self.tokens
                .remove_stale(sandbox_id, stored.as_ref().unwrap_or(&token));
            // A look-up that fails says why the proxy's token could not be replaced (the
            // control plane down, the key exchange failing, the sandbox gone), as it does
            // for a sandbox with no token stored: envd's 401 alone read as a bad key. A
            // token the client sent is the client's to mend: envd's 401 is its answer.
            tried.control_plane();
            let fresh = match self.lookup_token(sandbox_id).await {
                Ok(fresh) => Some(fresh),
                Err(_) if client_sent => None,
                Err(e) => return Err(e.into()),
            };
            if let (Some((method, uri, mut headers)), Some(fresh)) =
                (replay, fresh.filter(|fresh| *fresh != token))
            {
                headers::authorize_envd(&mut headers, self.auth.scheme(), &fresh, sandbox_id, port);
                let req = rebuild(method, uri, headers);
                tried.route();
                resp = forward::send(
                    &self.envd_client,
                    Plane::Envd,
                    req,
                    self.upstream_timeout,
                    &host,
                )
                .await?;
            }
        }

        // respond
        let resp = self
            .respond(Plane::Envd, resp, Sniff::None, upgrade)
            .await?;
        Ok((resp, host))
    }

    /// envd's requests that name no sandbox the proxy can find have no place on the control
    /// plane: a signed file URL the SDK builds while E2B_SANDBOX_URL points here, and an
    /// older SDK's requests by a token the store no longer holds (a day old, past its bound,
    /// or from before a restart), which went there with the sandbox's token and came back
    /// as its bare 404 ("sandbox not found" to the SDK). Refused, saying what to do, and
    /// counted as envd's, where they were meant to go.
    fn naming_no_sandbox(&self, route: &Route, parts: &Parts) -> Option<Failed> {
        if *route != Route::Api || self.envd.is_none() {
            return None;
        }
        let path = parts.uri.path();
        // A token first: an older SDK's file request by it needs connecting again, where a
        // signed URL (no token) needs the sandbox named.
        let token = (parts.headers.get(X_ACCESS_TOKEN)).is_some_and(|t| !t.is_empty());
        let reason = if route::is_envd_path(path) && token {
            format!(
                "an envd request by an X-Access-Token of no sandbox this proxy knows (it learns \
                 a sandbox's token from the answers to its create, connect or resume through \
                 it, or to a request naming it, and forgets it a day after its last use, past \
                 {} 000 sandboxes or at a restart): \
                 connect to the sandbox again through the proxy, or name it (E2b-Sandbox-Id \
                 header, or the host 49983-<sandboxID>.localhost)",
                crate::credentials::envd::MAX_TOKENS / 1000
            )
        } else if path == "/files" {
            "/files is envd's: name the sandbox (E2b-Sandbox-Id header, or the host \
             49983-<sandboxID>.localhost)"
                .to_string()
        } else {
            return None;
        };
        Some(Failed::from(Error::Refused { reason }))
    }

    /// The envd host a request for `sandbox_id` on `port` goes to, as printed: what
    /// [`Proxy::envd_uri`] names, for a request that did not get that far.
    fn envd_shown_host(&self, sandbox_id: &str, port: u16) -> Arc<str> {
        match &self.envd {
            None => Arc::from(""),
            Some(EnvdTarget::Url { shown_host, .. }) => shown_host.clone(),
            Some(EnvdTarget::Domain {
                domain,
                shown_domain,
            }) => {
                let domain = shown_domain.as_ref().unwrap_or(domain);
                Arc::from(format!("{port}-{sandbox_id}.{domain}"))
            }
        }
    }

    /// The envd URI for a request, and its host as printed (see [`EnvdTarget`]).
    fn envd_uri(&self, sandbox_id: &str, port: u16, pq: &str) -> Result<(Uri, Arc<str>), Error> {
        match &self.envd {
            // Not reached: `route_of` sends a provider without envd to its control plane.
            None => Err(unbuildable("this provider has no envd plane")),
            Some(EnvdTarget::Url { url, shown_host }) => {
                Ok((url.join(pq).map_err(unbuildable)?, shown_host.clone()))
            }
            Some(EnvdTarget::Domain {
                domain,
                shown_domain,
            }) => {
                // The sandbox's name is one DNS label (RFC 1035 §2.3.1): an id too long for
                // one, or ending in a dash, names no sandbox, and failed only at the
                // connect, after a look-up with the key (502, which the SDKs read as a
                // sandbox no longer running).
                let digits = port.checked_ilog10().unwrap_or(0) as usize + 1;
                let label = digits + 1 + sandbox_id.len();
                let unfit = if label > 63 {
                    Some(format!("`{port}-<id>` is {label} characters, over 63"))
                } else if sandbox_id.ends_with('-') {
                    Some("it ends in a dash".to_string())
                } else {
                    None
                };
                if let Some(why) = unfit {
                    return Err(Error::Refused {
                        reason: format!(
                            "sandbox id not valid in a host name (one DNS label): {why}"
                        ),
                    });
                }
                let host = format!("{port}-{sandbox_id}.{domain}");
                let uri = Uri::builder()
                    .scheme(Scheme::HTTPS)
                    .authority(host.as_str())
                    .path_and_query(pq)
                    .build()
                    .map_err(unbuildable)?;
                let shown = match shown_domain {
                    None => Arc::from(host),
                    Some(shown) => Arc::from(format!("{port}-{sandbox_id}.{shown}")),
                };
                Ok((uri, shown))
            }
        }
    }

    /// The sandbox's envd token from the control plane, one look-up per sandbox at a time.
    /// A sandbox that exists without a token (not `secure`) gets an empty one.
    /// The fetch runs in a task of its own (see `TokenStore::get_or_fetch`): a client that
    /// gives up waiting does not take the look-up with it.
    async fn lookup_token(self: &Arc<Self>, sandbox_id: &str) -> Result<Secret, Error> {
        let fetch = || {
            let (proxy, id) = (Arc::clone(self), sandbox_id.to_string());
            async move { proxy.fetch_token(&id).await }
        };
        let found = self.tokens.get_or_fetch(sandbox_id, fetch).await;
        let found = found.ok_or_else(|| Error::UpstreamUnavailable {
            reason: "the envd token look-up did not finish".into(),
            host: self.api_host.to_string(),
        })??;
        found.ok_or_else(|| Error::SandboxNotFound {
            sandbox_id: sandbox_id.to_string(),
        })
    }

    async fn fetch_token(&self, sandbox_id: &str) -> Result<Option<Secret>, Error> {
        let (mut credential, mut key) = self.api_key().await?;
        let uri = self
            .api_base
            .join(&format!("/sandboxes/{sandbox_id}"))
            .map_err(unbuildable)?;
        let host = self.api_host.to_string();
        let mut first = true;
        let resp = loop {
            let value = self.auth.value(&key).ok_or_else(unusable_key)?;
            let mut headers = HeaderMap::new();
            headers.insert(self.auth.header(), value);
            headers.insert(ACCEPT_ENCODING, IDENTITY);
            let req = rebuild(Method::GET, uri.clone(), headers);
            // The control plane failing a look-up is counted like any other upstream failure.
            let resp = forward::send(
                &self.api_client,
                Plane::Api,
                req,
                self.upstream_timeout,
                &host,
            )
            .await
            .map_err(|f| {
                if let Some(kind) = f.kind {
                    self.metrics.upstream_error(Plane::Api, kind);
                }
                f.error
            })?;
            judge(&credential, &key, resp.status(), &host);
            if resp.status() != StatusCode::UNAUTHORIZED || !std::mem::take(&mut first) {
                break resp;
            }
            // A refused temporary key: looked up once more with its replacement, as a
            // client's request without a body is sent again (see `api`).
            match self.replacement(&credential, &key).await {
                Some(fresh) => (credential, key) = fresh,
                None => break resp,
            }
        };
        let status = resp.status();
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            // The key itself was turned away: no network fault, and no retry will help
            // until the key changes (SPEC §6: 503 when no valid credential can be attached).
            // A 401 was said by `judge`.
            if status == StatusCode::FORBIDDEN {
                credential.rejected(&key, 403, &host);
            }
            return Err(Error::CredentialRejected {
                status: status.as_u16(),
                host,
            });
        }
        if !status.is_success() {
            return Err(Error::UpstreamUnavailable {
                reason: format!("envd token look-up answered {}", status.as_u16()),
                host,
            });
        }
        // A body that breaks has counted itself; one that stalls is a timeout, as a head
        // would be (every request for this sandbox waits on this look-up).
        // Not in the room: one look-up per sandbox at a time, its answer dropped once read.
        let read = body::read_bounded(resp.into_body(), READ_WHOLE_LIMIT, None);
        let Ok(read) = tokio::time::timeout(self.upstream_timeout, read).await else {
            let (error, kind) = self.body_timeout();
            self.metrics.upstream_error(Plane::Api, kind);
            return Err(error);
        };
        let reason = match read {
            Ok(Bounded::Complete(b, _)) => match sniff::looked_up(&b, sandbox_id) {
                Ok(token) => return Ok(Some(token)),
                // Remembered as "no token", every request would go to envd without one.
                Err(reason) => reason,
            },
            Ok(Bounded::Partial(..) | Bounded::NoRoom(..)) => {
                "envd token look-up: answer over 1 MiB"
            }
            Err(_) => {
                return Err(Error::UpstreamUnreachable {
                    reason: "envd token look-up: connection closed mid-answer".into(),
                    host,
                })
            }
        };
        // An answer the proxy cannot use (a login page, a reshaped body) fails every envd
        // request for the sandbox: counted as a malformed answer is, or no upstream-error
        // alert fires while they all get 502.
        self.metrics.upstream_error(Plane::Api, FailKind::Protocol);
        Err(Error::UpstreamUnavailable {
            reason: reason.into(),
            host,
        })
    }

    /// A control-plane answer whose body the proxy reads itself stalled after its head.
    fn body_timeout(&self) -> (Error, FailKind) {
        let error = Error::UpstreamTimeout {
            within: Within(self.upstream_timeout),
            host: self.api_host.to_string(),
        };
        (error, FailKind::Timeout)
    }

    /// Phase 5, respond: hop-by-hop out, tunnels for upgrades, token learning.
    async fn respond(
        &self,
        plane: Plane,
        mut resp: Response<ProxyBody>,
        sniff: Sniff,
        upgrade: Option<Upgrade>,
    ) -> Result<Response<ProxyBody>, Failed> {
        // An intermediary answers in its own version (RFC 9110 §6.2): an HTTP/1.0 upstream's
        // "HTTP/1.0" status line, written by hyper's server, told 1.1 clients to close.
        *resp.version_mut() = Version::HTTP_11;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(client_side) = upgrade {
                let upstream_side = hyper::upgrade::on(&mut resp);
                let aborting = self.aborting.subscribe();
                let count = tunnel::Count {
                    metrics: self.metrics.clone(),
                    plane,
                };
                tokio::spawn(tunnel::run(
                    client_side,
                    upstream_side,
                    self.idle_timeout,
                    aborting,
                    count,
                ));
                headers::strip_response_hop_by_hop(resp.headers_mut(), true);
                return Ok(resp.map(|_| body::empty()));
            }
        }
        headers::strip_response_hop_by_hop(resp.headers_mut(), false);
        // No length on a 204 (RFC 9110 §8.6), whatever an upstream says. HTTP/1 writers drop
        // it; hyper's HTTP/2 server sent it with END_STREAM, a malformed answer (RFC 9113
        // §8.1.1) that clients reset, so the client got nothing for a logged 204.
        if resp.status() == StatusCode::NO_CONTENT {
            resp.headers_mut().remove(CONTENT_LENGTH);
        }
        let ok = resp.status().is_success();
        match sniff {
            Sniff::Learn if ok => {
                let (parts, incoming) = resp.into_parts();
                // Bounded in time too: the head came, and `--upstream-timeout` covers a body
                // that then stalls as it would the head (the client sees nothing until then).
                let read = Box::pin(body::read_bounded(
                    incoming,
                    READ_WHOLE_LIMIT,
                    Some(&self.held),
                ));
                let Ok(read) = tokio::time::timeout(self.upstream_timeout, read).await else {
                    let (error, kind) = self.body_timeout();
                    return Err(Failed {
                        error,
                        kind: Some(kind),
                        reached: true,
                    });
                };
                let body = match read {
                    Ok(Bounded::Complete(b, room)) => {
                        let mut learned = sniff::learn(&b);
                        learned.retain(|(id, _)| route::valid_sandbox_id(id));
                        self.tokens.insert_all(&learned);
                        body::full(room.hold(b))
                    }
                    // Past the bound, or without room: on unread, the token looked up when
                    // needed.
                    Ok(Bounded::Partial(head, rest)) => body::boxed(Prefixed::new(head, rest)),
                    Ok(Bounded::NoRoom(head, rest)) => {
                        self.held.say_full();
                        body::boxed(Prefixed::new(head, rest))
                    }
                    // Not counted here: the body counted itself as it broke.
                    Err(_) => {
                        return Err(Failed {
                            error: Error::UpstreamUnreachable {
                                reason: "connection closed mid-response".into(),
                                host: self.api_host.to_string(),
                            },
                            kind: None,
                            reached: true,
                        })
                    }
                };
                Ok(Response::from_parts(parts, body))
            }
            Sniff::Forget(id) if ok || resp.status() == StatusCode::NOT_FOUND => {
                self.tokens.remove(&id);
                Ok(resp)
            }
            _ => Ok(resp),
        }
    }
}

/// `base`'s scheme and authority with `client`'s path and query: what
/// [`UpstreamUrl::join`] gives for a base without a path prefix, without the string.
fn upstream_uri(base: &UpstreamUrl, client: &Uri) -> Result<Uri, http::Error> {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(base.scheme.clone());
    parts.authority = Some(base.authority.clone());
    parts.path_and_query = Some(origin_form(client)?);
    Ok(Uri::from_parts(parts)?)
}

/// The client's path and query as an origin-form target. An absolute-form target without
/// a path (`GET http://localhost:49982?q=1`) has the path `/` (RFC 9110 §4.2.3), while
/// its `path_and_query` is `?q=1`: sent so, the request line was `GET ?q=1 HTTP/1.1`,
/// which nginx answers 400.
fn origin_form(client: &Uri) -> Result<PathAndQuery, http::uri::InvalidUri> {
    match client.path_and_query() {
        Some(pq) if pq.as_str().starts_with('/') => Ok(pq.clone()),
        Some(pq) if pq.as_str().starts_with('?') => {
            PathAndQuery::try_from(format!("/{}", pq.as_str()))
        }
        Some(pq) => Ok(pq.clone()),
        None => Ok(PathAndQuery::from_static("/")),
    }
}

/// What the control plane's answer says of the key it was sent with. A 5xx may come from a
/// gateway that never looked at the key: it neither refuses the key nor shows that it works.
fn judge(credential: &ApiCredential, key: &Secret, status: StatusCode, host: &str) {
    if status == StatusCode::UNAUTHORIZED {
        credential.refused(key, host);
    } else if !status.is_server_error() {
        credential.accepted(key);
    }
}

fn rebuild(method: Method, uri: Uri, headers: HeaderMap) -> Request<ProxyBody> {
    let mut req = Request::new(body::empty());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}

#[cfg(test)]
mod tests {
    use crate::proxy::test_proxy_with;
    use crate::settings::Key;

    /// A request's handler is boxed once per request in flight (`h1::serve`), so its size
    /// is memory per request, a stalled download's included.
    #[test]
    fn a_requests_future_stays_small() {
        // 1,984 bytes today in debug (2,160 before the body rewrite went into a boxed
        // function of its own); 2,376 when the volume-content branch (0460693) moved the
        // credential and the replay into it. The room above is for small changes.
        const BUDGET: usize = 2200;
        let req = http::Request::builder()
            .uri("/sandboxes")
            .header("host", "127.0.0.1")
            .body(crate::proxy::body::empty())
            .expect("request");
        let handled = crate::proxy::test_proxy().handle(req);
        let size = std::mem::size_of_val(&handled);
        assert!(
            size <= BUDGET,
            "a request's future is {size} bytes (budget {BUDGET})"
        );
    }

    /// The actions on one sandbox that done twice leave it as done once; nothing else.
    #[test]
    fn harmless_to_repeat_is_an_action_on_one_sandbox() {
        use super::harmless_to_repeat;
        for yes in [
            "/sandboxes/isb-1/connect",
            "/v2/sandboxes/isb-1/connect",
            "/sandboxes/isb-1/timeout",
            "/sandboxes/isb-1/pause",
            "/sandboxes/isb-1/resume/",
            "/sandboxes/isb-1/refreshes",
        ] {
            assert!(harmless_to_repeat(yes), "{yes}");
        }
        for no in [
            "/sandboxes",
            "/v2/sandboxes",
            "/sandboxes/connect",
            "/sandboxes//connect",
            "/sandboxes/a/b/connect",
            "/sandboxes/isb-1/snapshots",
            "/templates/t/connect",
            "/api/sandboxes/isb-1/connect",
        ] {
            assert!(!harmless_to_repeat(no), "{no}");
        }
    }

    /// After envd's 401 the proxy's token is said refused before it is dropped: a request
    /// in between finds the one or the other. (Dropped first, a request there found
    /// neither, took the SDK's copy of the refused token, sent with every request, for a
    /// token of the client's, and answered envd's bare 401 when the look-up failed.) The
    /// store's writes are held, so the drop waits: the refusal must be seen meanwhile.
    #[test]
    fn a_token_envd_refused_is_said_refused_before_it_is_dropped() {
        use std::io::{Read, Write};
        use std::time::{Duration, Instant};

        use crate::secret::Secret;

        // Both planes on one listener: envd refuses every token, the look-up fails.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        std::thread::spawn(move || {
            for stream in listener.incoming().take(2) {
                let Ok(mut stream) = stream else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let answer: &[u8] = if head.starts_with(b"GET /sandboxes/") {
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"
                } else {
                    b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 16\r\n\r\nbad access token"
                };
                let _ = stream.write_all(answer);
            }
        });
        let proxy = test_proxy_with(
            "sk-test",
            &[(Key::SandboxBaseUrl, &url), (Key::SandboxUrl, &url)],
        );
        let token = Secret::new("tok-refused");
        proxy.tokens.insert("isb-1", token.clone());

        let writes = proxy.tokens.hold_writes();
        let req = http::Request::builder()
            .uri("/health")
            .header("host", "127.0.0.1")
            .header("e2b-sandbox-id", "isb-1")
            .body(crate::proxy::body::empty())
            .expect("request");
        let handler = std::thread::spawn({
            let proxy = proxy.clone();
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(proxy.handle(req)).map(|resp| resp.status())
            }
        });
        // Not a wait for time to pass: the handler needs nothing from this thread to say
        // the token refused, and cannot drop it before this one lets writes go.
        let start = Instant::now();
        while !proxy.tokens.was_refused("isb-1", &token) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "envd's 401 did not say the token refused while it was stored"
            );
            std::thread::yield_now();
        }
        assert_eq!(proxy.tokens.get("isb-1"), Some(token.clone()));
        drop(writes);
        let status = handler.join().expect("handler").expect("answer");
        assert_eq!(
            status,
            http::StatusCode::BAD_GATEWAY,
            "the look-up's failure"
        );
        assert_eq!(proxy.tokens.get("isb-1"), None, "dropped after");
    }

    /// The host an envd request is sent to, and the one its access line and errors give:
    /// `{port}-{id}.{domain}`. (A secret a `${VAR}` put into `sandbox_domain` is refused
    /// before: the settings' tests.)
    #[test]
    fn an_envd_host_is_sent_and_printed_as_port_id_domain() {
        let key = "sk-in-the-env-0123";
        let proxy = test_proxy_with(key, &[(Key::SandboxDomain, "sandbox.example")]);
        let (uri, shown) = proxy
            .envd_uri("isb-a1", 49983, "/health?x=1")
            .expect("envd uri");
        assert_eq!(
            uri.to_string(),
            "https://49983-isb-a1.sandbox.example/health?x=1"
        );
        assert_eq!(&*shown, "49983-isb-a1.sandbox.example");
        let proxy = test_proxy_with(key, &[(Key::SandboxDomain, "sandbox.example")]);
        let (_, shown) = proxy.envd_uri("isb-a1", 8080, "/").expect("envd uri");
        assert_eq!(&*shown, "8080-isb-a1.sandbox.example");
    }
}
