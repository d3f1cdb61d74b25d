//! Acceptance tests of the envd plane (SPEC §4, issue 4): the real `abx-proxy` binary between
//! a client and two in-process TLS upstreams — a scripted control plane that creates,
//! connects, looks up and deletes sandboxes, and an envd that checks `X-Access-Token`
//! against the sandbox's current token. Every test asserts on what the upstreams RECEIVED;
//! every envd head is checked for HTTP/1.1 (the upstream offers h2 in ALPN) and for the
//! absence of the API key and of the client's `X-API-Key`.
//!
//! Synchronisation is by events only: responses, request heads seen by the upstreams, the
//! proxy's admin metrics, and channels. The timers are the Connect keepalive pacing in
//! `connect_server_stream_outlives_the_idle_timeout` and envd's keepalive ticker in
//! `a_quiet_command_outlives_a_short_idle_timeout`, where the timing is what is tested.

mod support;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;
use support::*;
use tokio::sync::{mpsc, oneshot, watch, Barrier};

const ENVD_PORT: u16 = 49983;
/// `user:` — envd's default user, attached when the client names none.
const DEFAULT_BASIC: &str = "Basic dXNlcjo=";
/// `root:` — a client that picks the sandbox user.
const ROOT_BASIC: &str = "Basic cm9vdDo=";

// ---------------------------------------------------------------------------------------
// The fake cloud
// ---------------------------------------------------------------------------------------

/// What the fake control plane knows; envd checks tokens against it too.
struct Cloud {
    /// Sandboxes that exist, with their current envd token.
    sandboxes: Mutex<HashMap<String, String>>,
    /// What the next `POST /sandboxes` creates, and the JSON it answers.
    next: Mutex<VecDeque<(String, String, serde_json::Value)>>,
    /// The bodies of the `POST /sandboxes` requests received, in order.
    create_bodies: Mutex<Vec<Bytes>>,
    /// `GET /sandboxes/{id}` answers only while this is true.
    lookups_open: watch::Sender<bool>,
    /// When set, envd's 401 answers wait here until as many have gathered.
    unauthorized_together: Mutex<Option<Arc<Barrier>>>,
}

impl Cloud {
    fn new() -> Arc<Cloud> {
        Arc::new(Cloud {
            sandboxes: Mutex::new(HashMap::new()),
            next: Mutex::new(VecDeque::new()),
            create_bodies: Mutex::new(Vec::new()),
            lookups_open: watch::channel(true).0,
            unauthorized_together: Mutex::new(None),
        })
    }

    /// A sandbox that exists in the cloud (the proxy has not seen it).
    fn exists(&self, id: &str, token: &str) {
        self.sandboxes
            .lock()
            .unwrap()
            .insert(id.to_string(), token.to_string());
    }

    /// The next `POST /sandboxes` creates `id` with `token`.
    fn will_create(&self, id: &str, token: &str) {
        self.will_create_answering(id, token, sandbox_json(id, token));
    }

    /// Like [`Cloud::will_create`], answering with `answer`.
    fn will_create_answering(&self, id: &str, token: &str, answer: serde_json::Value) {
        self.next
            .lock()
            .unwrap()
            .push_back((id.to_string(), token.to_string(), answer));
    }

    fn token(&self, id: &str) -> Option<String> {
        self.sandboxes.lock().unwrap().get(id).cloned()
    }
}

fn sandbox_json(id: &str, token: &str) -> serde_json::Value {
    json!({
        "sandboxID": id,
        "templateID": "base",
        "clientID": "c-1",
        "envdVersion": "0.2.0",
        "envdAccessToken": token,
        "trafficAccessToken": null,
        "domain": null,
    })
}

fn json_response(status: u16, v: &serde_json::Value) -> Response<TestBody> {
    let mut r = response(status, v.to_string());
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

/// The path prefix of `--sandbox-base-url` in `path_prefixes_are_kept_on_both_planes`.
const API_PREFIX: &str = "/api";

/// The control plane, at the root and under [`API_PREFIX`]: list, create, connect, look up
/// (held while `lookups_open` is false), delete.
async fn control_plane(cloud: Arc<Cloud>, req: Request<Incoming>) -> Response<TestBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = collect(req.into_body()).await;
    let path = path.strip_prefix(API_PREFIX).unwrap_or(&path);
    let Some(rest) = path.strip_prefix("/sandboxes") else {
        return response(404, "no such route");
    };
    let id = rest.strip_prefix('/').unwrap_or("");
    match (method.as_str(), id) {
        ("GET", "") => {
            let ids: Vec<String> = cloud.sandboxes.lock().unwrap().keys().cloned().collect();
            json_response(200, &json!(ids))
        }
        ("POST", "") => {
            cloud.create_bodies.lock().unwrap().push(body);
            let (id, token, answer) = cloud
                .next
                .lock()
                .unwrap()
                .pop_front()
                .expect("the test announced this create");
            cloud.exists(&id, &token);
            json_response(201, &answer)
        }
        // Busy: a 503 whose body still describes the sandbox, as a cached one might.
        ("POST", id) if id.ends_with("/connect") && id.starts_with(BUSY) => {
            let mut answer = describe(&cloud, id.trim_end_matches("/connect"));
            *answer.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            answer
        }
        ("POST", id) if id.ends_with("/connect") => {
            describe(&cloud, id.trim_end_matches("/connect"))
        }
        // A fork: 201 and a result per fork, the sandboxes named `{id}-f…` (made by the test
        // with `Cloud::exists`), and one that failed.
        ("POST", id) if id.ends_with("/fork") => {
            let parent = format!("{}-f", id.trim_end_matches("/fork"));
            let mut forks: Vec<(String, String)> = (cloud.sandboxes.lock().unwrap().iter())
                .filter(|(id, _)| id.starts_with(&parent))
                .map(|(id, token)| (id.clone(), token.clone()))
                .collect();
            forks.sort();
            let mut results: Vec<serde_json::Value> = (forks.iter())
                .map(|(id, token)| json!({"sandbox": sandbox_json(id, token)}))
                .collect();
            results.push(json!({"error": {"code": 500, "message": "no room for this fork"}}));
            json_response(201, &json!(results))
        }
        // The older resume: 201 and the sandbox, as connect's.
        ("POST", id) if id.ends_with("/resume") => {
            let mut answer = describe(&cloud, id.trim_end_matches("/resume"));
            if answer.status() == StatusCode::OK {
                *answer.status_mut() = StatusCode::CREATED;
            }
            answer
        }
        // A page where the sandbox was expected (a gateway's, a captive portal's), 200.
        ("GET", id) if id.starts_with(NOT_A_SANDBOX) => {
            let mut r = response(200, "<html><body>Sign in to continue</body></html>");
            r.headers_mut()
                .insert("content-type", "text/html".parse().unwrap());
            r
        }
        ("GET", id) if !id.is_empty() => {
            let mut open = cloud.lookups_open.subscribe();
            let _ = open.wait_for(|open| *open).await;
            if id.starts_with(BUSY) {
                return response(503, "busy");
            }
            describe(&cloud, id)
        }
        // A control plane too busy to delete: the sandbox (and its token) lives on.
        ("DELETE", id) if id.starts_with(BUSY) => response(503, "busy"),
        ("DELETE", id) if !id.is_empty() => match cloud.sandboxes.lock().unwrap().remove(id) {
            Some(_) => response(204, ""),
            None => response(404, ""),
        },
        _ => response(404, "no such route"),
    }
}

/// Sandboxes whose id starts so are answered 503 on `DELETE`, on connect and on look-up.
const BUSY: &str = "isb-busy";
/// Sandboxes whose id starts so are looked up with an HTML page, 200.
const NOT_A_SANDBOX: &str = "isb-html";

/// The sandbox with its current token (get info, connect), or 404.
fn describe(cloud: &Cloud, id: &str) -> Response<TestBody> {
    match cloud.token(id) {
        Some(token) => json_response(200, &sandbox_json(id, &token)),
        None => json_response(404, &json!({"code": 404, "message": "sandbox not found"})),
    }
}

/// envd: 401 unless `X-Access-Token` is the sandbox's current token (an unsecured sandbox,
/// whose token is "", takes any); else accepts a WebSocket upgrade (see [`echo_tunnel`]),
/// or says who it is. Another port is an app, as E2B's gateway serves it: no token
/// checked, and 401 to a client whose credential for the app is [`BAD_APP_CREDENTIAL`].
async fn envd_checking_tokens(cloud: Arc<Cloud>, mut req: Request<Incoming>) -> Response<TestBody> {
    let id = header_of(&req, "e2b-sandbox-id");
    let token = header_of(&req, "x-access-token");
    let app = header_of(&req, "e2b-sandbox-port") != ENVD_PORT.to_string();
    let what = format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map_or("/", |pq| pq.as_str())
    );
    let req_authorization = header_of(&req, "authorization");
    let upgrade = req
        .headers()
        .contains_key("upgrade")
        .then(|| hyper::upgrade::on(&mut req));
    let body = collect(req.into_body()).await;
    let unsecured = cloud.token(&id).as_deref() == Some("");
    if app && req_authorization == BAD_APP_CREDENTIAL {
        return response(401, "the app refuses the credential");
    }
    let refused = cloud.token(&id).as_deref() != Some(token.as_str()) || token.is_empty();
    if !app && !unsecured && refused {
        let together = cloud.unauthorized_together.lock().unwrap().clone();
        if let Some(barrier) = together {
            barrier.wait().await;
        }
        return response(401, "bad access token");
    }
    if let Some(upgrade) = upgrade {
        tokio::spawn(echo_tunnel(upgrade));
        let mut r = response(101, Bytes::new());
        let h = r.headers_mut();
        // A hop-by-hop field of envd's own, which the client must not see.
        h.insert("connection", "Upgrade, X-Envd-Hop".parse().unwrap());
        h.insert("x-envd-hop", "1".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        h.insert("sec-websocket-accept", WS_ACCEPT.parse().unwrap());
        return r;
    }
    response(200, format!("envd {id}: {what} ({} bytes)", body.len()))
}

/// A client's credential for an app in the sandbox that the app refuses.
const BAD_APP_CREDENTIAL: &str = "Bearer wrong-app-credential";

/// RFC 6455's example `Sec-WebSocket-Key` and the `Sec-WebSocket-Accept` it gets.
const WS_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const WS_ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

/// envd's side of a WebSocket tunnel: every byte back, until the client's side ends.
async fn echo_tunnel(upgrade: hyper::upgrade::OnUpgrade) {
    if let Ok(upgraded) = upgrade.await {
        let (mut rd, mut wr) = tokio::io::split(hyper_util::rt::TokioIo::new(upgraded));
        let _ = tokio::io::copy(&mut rd, &mut wr).await;
    }
}

fn header_of<B>(req: &Request<B>, name: &str) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

struct Env {
    pki: Pki,
    cloud: Arc<Cloud>,
    api: Upstream,
    envd: Upstream,
}

impl Env {
    /// Both upstreams offer h2 and HTTP/1.1; envd checks tokens.
    async fn start(pki: Pki) -> Env {
        let cloud = Cloud::new();
        let c = cloud.clone();
        let envd = Upstream::start(&pki, Proto::H2, move |req| {
            envd_checking_tokens(c.clone(), req)
        })
        .await;
        Env::with_envd(pki, cloud, envd).await
    }

    async fn with_envd(pki: Pki, cloud: Arc<Cloud>, envd: Upstream) -> Env {
        let c = cloud.clone();
        let api = Upstream::start(&pki, Proto::H2, move |req| control_plane(c.clone(), req)).await;
        Env {
            pki,
            cloud,
            api,
            envd,
        }
    }

    /// `sandbox_url` mode: all envd traffic to the envd upstream.
    async fn proxy(&self) -> ProxyProc {
        self.proxy_with(&[]).await
    }

    async fn proxy_with(&self, extra: &[&str]) -> ProxyProc {
        ProxyCmd::new(&self.api.url(), &self.pki)
            .args(&["--sandbox-url", &self.envd.url()])
            .args(extra)
            .spawn()
            .await
    }

    /// `GET /sandboxes/{id}` requests the control plane received (the proxy's look-ups),
    /// also under [`API_PREFIX`].
    fn lookups(&self, id: &str) -> Vec<Seen> {
        let path = format!("/sandboxes/{id}");
        self.api
            .seen()
            .into_iter()
            .filter(|s| {
                let p = s.uri.path();
                s.method == "GET" && p.strip_prefix(API_PREFIX).unwrap_or(p) == path
            })
            .collect()
    }

    /// An envd request naming only `id` reaches envd with `token` and costs no look-up:
    /// the proxy knew the token already.
    async fn assert_token_known(&self, proxy: &ProxyProc, id: &str, token: &str) {
        let addr = proxy.addr();
        let (status, body) = text(send(addr, envd_request(addr, id, "/health")).await).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let last = self.envd.seen().pop().expect("envd was asked");
        let host = self.envd.addr.to_string();
        assert_envd_head(&last, &host, id, ENVD_PORT, token, DEFAULT_BASIC);
        assert!(
            self.lookups(id).is_empty(),
            "{id}: the token was looked up, not learned"
        );
    }

    /// Every envd head: HTTP/1.1 (SPEC §4), no client `X-API-Key`, no API key anywhere.
    fn assert_envd_clean(&self) {
        let seen = self.envd.seen();
        assert!(!seen.is_empty(), "envd saw nothing");
        for s in &seen {
            assert_eq!(
                s.version,
                Version::HTTP_11,
                "envd must be reached over HTTP/1.1 even when it offers h2: {s:?}"
            );
            assert!(
                s.header("x-api-key").is_none(),
                "client X-API-Key reached envd: {s:?}"
            );
            let text: String = s
                .headers
                .iter()
                .map(|(k, v)| format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())))
                .collect();
            assert_no_key(&text, "an envd request head");
            assert_no_key(s.path_and_query(), "an envd request target");
        }
    }

    /// Creates a sandbox through the proxy as an SDK would (dummy key, `POST /sandboxes`).
    async fn create(&self, proxy: &ProxyProc, id: &str, token: &str) {
        self.cloud.will_create(id, token);
        let body = r#"{"templateID":"base","timeout":300}"#;
        let resp = post_json(proxy.addr(), "/sandboxes", body).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        let body: serde_json::Value =
            serde_json::from_slice(&collect(resp.into_body()).await).expect("create JSON");
        assert_eq!(
            body,
            sandbox_json(id, token),
            "the create response is unchanged"
        );
    }
}

/// `POST path` with a JSON body through the proxy, as an SDK sends it (dummy key).
async fn post_json(addr: SocketAddr, path: &str, json: impl Into<Bytes>) -> Response<Incoming> {
    let req = request("POST", addr, path)
        .header("x-api-key", "dummy-key")
        .header("content-type", "application/json")
        .header("accept-encoding", "gzip, deflate, br, zstd")
        .body(full(json))
        .unwrap();
    send(addr, req).await
}

/// What reaches an app's port (not envd's) when the client sent no `Authorization`.
const NO_AUTHORIZATION: &str = "";
/// What reaches an app's port when the client sent no `X-Access-Token`: the sandbox's
/// token is envd's alone.
const NO_TOKEN: &str = "";

/// The routing and credential headers one envd head must carry (an empty `token` or
/// `basic`: none of that field).
fn assert_envd_head(seen: &Seen, host: &str, id: &str, port: u16, token: &str, basic: &str) {
    assert_eq!(seen.host(), host, "Host is the envd upstream's: {seen:?}");
    let want: Vec<&str> = Some(token).filter(|t| !t.is_empty()).into_iter().collect();
    assert_eq!(seen.all("x-access-token"), want, "X-Access-Token");
    assert_eq!(seen.all("e2b-sandbox-id"), vec![id], "E2b-Sandbox-Id");
    assert_eq!(
        seen.all("e2b-sandbox-port"),
        vec![port.to_string()],
        "E2b-Sandbox-Port"
    );
    let want: Vec<&str> = Some(basic).filter(|b| !b.is_empty()).into_iter().collect();
    assert_eq!(seen.all("authorization"), want, "Authorization");
}

/// A bodiless envd request routed by `E2b-Sandbox-Id` alone (no token, no port).
fn envd_request(addr: SocketAddr, id: &str, path: &str) -> Request<TestBody> {
    request("GET", addr, path)
        .header("e2b-sandbox-id", id)
        .body(empty())
        .unwrap()
}

async fn text(resp: Response<Incoming>) -> (StatusCode, String) {
    let status = resp.status();
    let body = collect(resp.into_body()).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Scrapes `/metrics` until `series` equals `want` (bounded by [`GUARD`]).
async fn wait_for_metric(admin: SocketAddr, series: &str, want: f64) {
    wait_metric(admin, series, &want.to_string(), |v| v == Some(want)).await;
}

async fn gauge(proxy: &ProxyProc, series: &str) -> Option<f64> {
    metric(&scrape(proxy.admin_addr()).await, series)
}

const ENVD_TOKENS: &str = "abx_proxy_envd_tokens";

// ---------------------------------------------------------------------------------------
// 1. Learned tokens, routing headers, credentials
// ---------------------------------------------------------------------------------------

/// A curl-like client names only the sandbox; envd gets the token the proxy learned from the
/// create response, the routing headers, and the default Basic user; a client's own Basic
/// user is kept; `X-API-Key` and the key never reach envd; in `sandbox_url` mode the Host
/// is that URL's authority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_token_and_routing_headers_reach_envd_without_the_key() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    let envd_host = env.envd.addr.to_string();

    env.create(&proxy, "isb-1", "tok-1").await;
    let create = &env.api.seen()[0];
    assert_eq!(
        (create.method.as_str(), create.uri.path()),
        ("POST", "/sandboxes")
    );
    assert_eq!(
        create.all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
    assert!(create.header("x-api-key").is_none());
    // The proxy reads the token from this answer: asked for uncompressed, whatever the
    // client accepts.
    assert_eq!(create.all("accept-encoding"), vec!["identity"]);

    // curl -H 'E2b-Sandbox-Id: isb-1' -H 'X-API-Key: dummy-key' …
    let raw = format!(
        "GET /files?path=%2Fhome%2Fuser%2Fa.txt&username=user HTTP/1.1\r\n\
         Host: 127.0.0.1:{port}\r\n\
         User-Agent: curl/8.5.0\r\n\
         Accept: */*\r\n\
         E2b-Sandbox-Id: isb-1\r\n\
         X-API-Key: dummy-key\r\n\
         x-api-key: {API_KEY}\r\n\r\n",
        port = addr.port()
    );
    let resp = raw_exchange(addr, raw.as_bytes()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(
        resp.text(),
        "envd isb-1: GET /files?path=%2Fhome%2Fuser%2Fa.txt&username=user (0 bytes)"
    );
    let seen = &env.envd.seen()[0];
    assert_envd_head(seen, &envd_host, "isb-1", ENVD_PORT, "tok-1", DEFAULT_BASIC);
    assert_eq!(seen.header("user-agent"), Some("curl/8.5.0"));

    // The SDK's `user="root"`: its Basic user is kept. A stale client token loses to the
    // store's; a client Bearer is no envd credential and becomes the default user.
    let req = request("POST", addr, "/filesystem.Filesystem/ListDir")
        .header("e2b-sandbox-id", "isb-1")
        .header("authorization", ROOT_BASIC)
        .header("x-access-token", "stale-client-token")
        .header("x-api-key", "dummy-key")
        .header("content-type", "application/json")
        .body(full(r#"{"path":"/root"}"#))
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        "envd isb-1: POST /filesystem.Filesystem/ListDir (16 bytes)"
    );
    let req = request("GET", addr, "/health")
        .header("e2b-sandbox-id", "isb-1")
        .header("authorization", format!("Bearer {API_KEY}"))
        .body(empty())
        .unwrap();
    let (status, _) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK);
    // An app's port (an MCP gateway, a user's server) is not envd: the client's
    // `Authorization` is the app's own credential, and reaches it as sent.
    let req = request("GET", addr, "/mcp")
        .header("e2b-sandbox-id", "isb-1")
        .header("e2b-sandbox-port", "50005")
        .header("authorization", "Bearer mcp-token")
        .body(empty())
        .unwrap();
    let (status, _) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK);

    let seen = env.envd.seen();
    assert_eq!(seen.len(), 4);
    assert_envd_head(
        &seen[1], &envd_host, "isb-1", ENVD_PORT, "tok-1", ROOT_BASIC,
    );
    assert_envd_head(
        &seen[3],
        &envd_host,
        "isb-1",
        50005,
        NO_TOKEN,
        "Bearer mcp-token",
    );
    assert_envd_head(
        &seen[2],
        &envd_host,
        "isb-1",
        ENVD_PORT,
        "tok-1",
        DEFAULT_BASIC,
    );
    assert!(
        env.lookups("isb-1").is_empty(),
        "a learned token needs no look-up"
    );
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 2. Look-ups: single flight, unknown sandboxes, the client's own token
// ---------------------------------------------------------------------------------------

/// 50 requests for a sandbox the proxy never saw cause ONE `GET /sandboxes/{id}`. The
/// control plane holds its answer until all 50 are inside the proxy (its in-flight gauge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_misses_cause_one_lookup() {
    const N: usize = 50;
    let mut env = Env::start(Pki::new()).await;
    env.cloud.exists("isb-7", "tok-7");
    env.cloud.lookups_open.send_replace(false);
    let proxy = env.proxy().await;
    let addr = proxy.addr();

    let clients: Vec<_> = (0..N)
        .map(|i| {
            tokio::spawn(async move {
                let resp = send(addr, envd_request(addr, "isb-7", &format!("/health?n={i}"))).await;
                text(resp).await
            })
        })
        .collect();

    let lookup = env.api.next_request().await;
    assert_eq!(
        (lookup.method.as_str(), lookup.uri.path()),
        ("GET", "/sandboxes/isb-7")
    );
    assert_eq!(
        lookup.all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
    assert!(lookup.header("x-api-key").is_none());
    wait_for_metric(
        proxy.admin_addr(),
        r#"abx_proxy_in_flight_requests{plane="envd"}"#,
        N as f64,
    )
    .await;
    env.cloud.lookups_open.send_replace(true);

    for (i, client) in clients.into_iter().enumerate() {
        let (status, body) = within("an envd response", client)
            .await
            .expect("client task");
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
        assert_eq!(body, format!("envd isb-7: GET /health?n={i} (0 bytes)"));
    }
    let lookups: Vec<_> = env
        .api
        .seen()
        .into_iter()
        .filter(|s| s.uri.path() == "/sandboxes/isb-7")
        .collect();
    assert_eq!(
        lookups.len(),
        1,
        "one look-up for {N} waiting requests: {lookups:?}"
    );
    let seen = env.envd.seen();
    assert_eq!(seen.len(), N);
    let envd_host = env.envd.addr.to_string();
    for s in &seen {
        assert_envd_head(s, &envd_host, "isb-7", ENVD_PORT, "tok-7", DEFAULT_BASIC);
    }
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

/// A client that gives up while its sandbox's token is looked up (an SDK's timeout shorter
/// than a slow control plane's answer) does not take the look-up with it: the answer is
/// remembered, and the next request is served without asking again. The look-up ran in
/// the client's request, and each impatient client threw away another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_outlives_the_client_that_gave_up_on_it() {
    let mut env = Env::start(Pki::new()).await;
    env.cloud.exists("isb-slow", "tok-slow");
    let mut proxy = env.proxy().await;
    let addr = proxy.addr();

    give_up_during_look_up(&mut env, &proxy, "isb-slow").await;
    // Its 499 names the upstream it waited for: the control plane's look-up.
    let gone = proxy.wait_for_line(" status=499 ").await;
    let named = format!(" upstream={}", env.api.addr);
    assert!(gone.trim_end().ends_with(&named), "{gone}");
    let envd_host = env.envd.addr.to_string();
    let (status, body) = text(send(addr, envd_request(addr, "isb-slow", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(env.lookups("isb-slow").len(), 1, "asked again");
    let seen = env.envd.seen();
    assert_eq!(seen.len(), 1, "the client that left reached envd");
    assert_envd_head(
        &seen[0],
        &envd_host,
        "isb-slow",
        ENVD_PORT,
        "tok-slow",
        DEFAULT_BASIC,
    );

    // One that fails with nobody left to tell leaves a line saying so.
    give_up_during_look_up(&mut env, &proxy, "isb-busy-gone").await;
    let line = proxy
        .wait_for_line("envd token look-up failed after its requests had gone")
        .await;
    assert!(
        line.contains("isb-busy-gone") && line.contains("[E5001]"),
        "{line}"
    );
    env.assert_envd_clean();
    proxy.finish().await;
}

/// An envd request for `id` whose client hangs up while the look-up is held, seen gone by
/// the proxy before the look-up is let through.
async fn give_up_during_look_up(env: &mut Env, proxy: &ProxyProc, id: &'static str) {
    let (addr, in_flight) = (
        proxy.addr(),
        r#"abx_proxy_in_flight_requests{plane="envd"}"#,
    );
    env.cloud.lookups_open.send_replace(false);
    let impatient = tokio::spawn(async move { send(addr, envd_request(addr, id, "/")).await });
    let lookup = env.api.next_request().await;
    assert_eq!(lookup.uri.path(), format!("/sandboxes/{id}"));
    wait_for_metric(proxy.admin_addr(), in_flight, 1.0).await;
    impatient.abort();
    // The proxy saw the client go: its request is over, the look-up is not.
    wait_for_metric(proxy.admin_addr(), in_flight, 0.0).await;
    env.cloud.lookups_open.send_replace(true);
}

/// A sandbox the control plane does not know: 404 E2009, envd never contacted. A store miss
/// with the client's own `X-Access-Token` uses that token as is, without a look-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_sandbox_is_404_e2009_and_a_client_token_is_used_on_a_miss() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();

    let raw = format!(
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nE2b-Sandbox-Id: isb-gone\r\n\r\n",
        addr.port()
    );
    let resp = raw_exchange(addr, raw.as_bytes()).await;
    assert_proxy_error(&resp, 404, "E2009");
    assert!(resp.text().contains("isb-gone"), "{}", resp.text());
    let lookups = env.lookups("isb-gone");
    assert_eq!(lookups.len(), 1);
    assert_eq!(
        lookups[0].all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
    assert!(
        env.envd.seen().is_empty(),
        "envd contacted for an unknown sandbox"
    );
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(0.0));

    env.cloud.exists("isb-8", "tok-8");
    let req = request("GET", addr, "/health")
        .header("e2b-sandbox-id", "isb-8")
        .header("x-access-token", "tok-8")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_envd_head(
        &env.envd.seen()[0],
        &env.envd.addr.to_string(),
        "isb-8",
        ENVD_PORT,
        "tok-8",
        DEFAULT_BASIC,
    );
    assert!(
        env.lookups("isb-8").is_empty(),
        "the client's token needed no look-up"
    );
    env.assert_envd_clean();
    // The access line names the control plane, which answered the look-up.
    let stderr = proxy.finish().await;
    let line = stderr
        .lines()
        .find(|l| l.contains("abx_proxy::access") && l.contains("status=404"))
        .unwrap_or_else(|| panic!("no 404 line:\n{stderr}"));
    let upstream = format!("upstream={}", env.api.addr);
    assert!(line.split(' ').any(|f| f == upstream), "{line}");
}

/// A look-up answered 200 with what describes no sandbox (a gateway's or a captive portal's
/// page) is the control plane failing, 502 E5001 and an upstream error, and is not remembered: taken for a
/// sandbox without a token, every request for it went to envd without one. Its access
/// lines say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_answer_that_describes_no_sandbox_is_502() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    let id = format!("{NOT_A_SANDBOX}-1");
    let raw = format!(
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nE2b-Sandbox-Id: {id}\r\n\r\n",
        addr.port()
    );
    for asked in 1..=2 {
        let resp = raw_exchange(addr, raw.as_bytes()).await;
        assert_proxy_error(&resp, 502, "E5001");
        assert!(
            resp.text().contains("the answer describes no sandbox"),
            "{}",
            resp.text()
        );
        assert_eq!(
            env.lookups(&id).len(),
            asked,
            "looked up again: not remembered"
        );
    }
    assert!(env.envd.seen().is_empty(), "envd was asked without a token");
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(0.0));
    // Counted as the upstream failing, or no upstream-error alert fires while every envd
    // request for the sandbox gets 502.
    let protocol = r#"abx_proxy_upstream_errors_total{plane="api",kind="protocol"}"#;
    assert_eq!(gauge(&proxy, protocol).await, Some(2.0));
    // And the log says why, as the body does: nothing else says it while requests wait.
    let stderr = proxy.finish().await;
    let reason = "error=\"E5001\" reason=\"envd token look-up: the answer describes no sandbox\"";
    let said = stderr.lines().filter(|l| l.ends_with(reason)).count();
    assert_eq!(said, 2, "{stderr}");
}

/// An unsecured sandbox has no envd token: the look-up learns that, and then no
/// `X-Access-Token` is sent rather than an empty one, and a client's own token is never
/// replaced by the empty one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_without_a_token_gets_none_and_a_clients_own_is_kept() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.cloud.exists("isb-open", "");
    for client_token in [None, Some("client-tok")] {
        let mut req = request("GET", addr, "/health").header("e2b-sandbox-id", "isb-open");
        if let Some(t) = client_token {
            req = req.header("x-access-token", t);
        }
        let (status, body) = text(send(addr, req.body(empty()).unwrap()).await).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let seen = env.envd.seen();
        let last = seen.last().expect("envd was asked");
        assert_eq!(last.header("x-access-token"), client_token, "{last:?}");
    }
    assert_eq!(
        env.lookups("isb-open").len(),
        1,
        "the answer was remembered"
    );
    // Remembered as having none, it is no sandbox with a known token (SPEC §7).
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(0.0));
    // The answer without a token is out of date: envd refuses the client's token, the
    // empty entry it stood in for goes with it, and the token is fetched again (SPEC §4:
    // on a 401 the token is fetched again once) for the retry.
    env.cloud.exists("isb-open", "tok-open");
    let req = request("GET", addr, "/health")
        .header("e2b-sandbox-id", "isb-open")
        .header("x-access-token", "client-stale");
    let (status, body) = text(send(addr, req.body(empty()).unwrap()).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(env.lookups("isb-open").len(), 2);
    let seen = env.envd.seen();
    let retried = seen.last().expect("envd was asked");
    assert_eq!(retried.header("x-access-token"), Some("tok-open"));
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

/// The sandbox's envd token is envd's alone: it runs commands as root, and an app on
/// another port (a user's server, which may log or forward what it gets) neither receives
/// it nor makes the proxy look it up with its key. A token the client sends itself passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_port_gets_no_envd_token_and_causes_no_look_up() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.cloud.exists("isb-app", "tok-app");
    let app = |token: Option<&str>| {
        let mut req = request("GET", addr, "/app")
            .header("e2b-sandbox-id", "isb-app")
            .header("e2b-sandbox-port", "3000");
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        req.body(empty()).unwrap()
    };
    // Unknown to the proxy: no look-up for an app.
    let (status, body) = text(send(addr, app(None)).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        env.lookups("isb-app").is_empty(),
        "an app's request looked the token up"
    );
    // Known (envd's request looked it up): still not sent to the app.
    let (status, body) = text(send(addr, envd_request(addr, "isb-app", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = text(send(addr, app(None)).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = text(send(addr, app(Some("the-clients-own"))).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let seen = env.envd.seen();
    assert_eq!(seen.len(), 4);
    let host = env.envd.addr.to_string();
    for (i, (port, token, basic)) in [
        (3000, NO_TOKEN, NO_AUTHORIZATION),
        (ENVD_PORT, "tok-app", DEFAULT_BASIC),
        (3000, NO_TOKEN, NO_AUTHORIZATION),
        (3000, "the-clients-own", NO_AUTHORIZATION),
    ]
    .into_iter()
    .enumerate()
    {
        assert_envd_head(&seen[i], &host, "isb-app", port, token, basic);
    }
    assert_eq!(env.lookups("isb-app").len(), 1, "envd's request's only");
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 3. Host-based routing
// ---------------------------------------------------------------------------------------

/// `Host: <port>-<id>.localhost:<listen port>` with no E2b headers is envd traffic; the
/// token was learned from the client's own `GET /sandboxes/{id}` (no second look-up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_names_route_to_envd() {
    let env = Env::start(Pki::new()).await;
    env.cloud.exists("isb-2", "tok-2");
    let proxy = env.proxy().await;
    let addr = proxy.addr();

    // The SDK's get_info: the proxy learns the token from the answer.
    let req = request("GET", addr, "/sandboxes/isb-2")
        .header("x-api-key", "dummy-key")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        sandbox_json("isb-2", "tok-2")
    );

    let signed = "/files?path=%2Fhome%2Fuser%2Fa.txt&signature=v1_sig";
    for (port, path) in [
        (ENVD_PORT, "/health"),
        (8080u16, "/app?x=1"),
        (ENVD_PORT, signed),
    ] {
        let raw = format!(
            "GET {path} HTTP/1.1\r\nHost: {port}-isb-2.localhost:{}\r\nX-API-Key: dummy-key\r\n\r\n",
            addr.port()
        );
        let resp = raw_exchange(addr, raw.as_bytes()).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(resp.text(), format!("envd isb-2: GET {path} (0 bytes)"));
    }
    // The signed URL an SDK builds while E2B_SANDBOX_URL points at the proxy names no
    // sandbox: refused, with the way to name it, instead of going to the control plane.
    let raw = format!("GET {signed} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let resp = raw_exchange(addr, raw.as_bytes()).await;
    assert_proxy_error(&resp, 400, "E5003");
    assert!(
        resp.text().contains("49983-<sandboxID>.localhost"),
        "{}",
        resp.text()
    );
    let files_on_api = env.api.seen().iter().any(|s| s.uri.path() == "/files");
    assert!(!files_on_api, "/files reached the control plane");

    let seen = env.envd.seen();
    assert_eq!(seen.len(), 3);
    let envd_host = env.envd.addr.to_string();
    assert_envd_head(
        &seen[0],
        &envd_host,
        "isb-2",
        ENVD_PORT,
        "tok-2",
        DEFAULT_BASIC,
    );
    assert_envd_head(
        &seen[1],
        &envd_host,
        "isb-2",
        8080,
        NO_TOKEN,
        NO_AUTHORIZATION,
    );
    assert_eq!(
        env.lookups("isb-2").len(),
        1,
        "only the client's own GET: the token was learned from it"
    );
    env.assert_envd_clean();
    proxy.finish().await;
}

/// A page an app in sandbox A serves through the proxy (`3000-isb-a.localhost`) is a local
/// origin, but not the user's: a form it posts to another sandbox's envd or to the control
/// plane is refused before anything goes out (the form would carry sandbox B's token, or
/// the key); a same-origin GET naming sandbox B in `E2b-Sandbox-Id` too. Its own origin is
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_served_from_a_sandbox_reaches_nothing_but_its_own_origin() {
    let env = Env::start(Pki::new()).await;
    env.cloud.exists("isb-a", "tok-a");
    env.cloud.exists("isb-b", "tok-b");
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    let port = addr.port();
    let origin = format!("Origin: http://3000-isb-a.localhost:{port}\r\n");
    let form = |path: &str, host: &str, extra: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: text/plain\r\n\
             Content-Length: 2\r\nConnection: close\r\n\r\nhi"
        )
    };
    for req in [
        form(
            "/files?path=/x",
            &format!("49983-isb-b.localhost:{port}"),
            &origin,
        ),
        form("/sandboxes", &format!("127.0.0.1:{port}"), &origin),
        form("/sandboxes", &format!("localhost:{port}"), &origin),
        format!(
            "GET /files?path=/x HTTP/1.1\r\nHost: 3000-isb-a.localhost:{port}\r\n\
             E2b-Sandbox-Id: isb-b\r\nSec-Fetch-Site: same-origin\r\nConnection: close\r\n\r\n"
        ),
    ] {
        let resp = raw_exchange(addr, req.as_bytes()).await;
        assert_proxy_error(&resp, 400, "E5003");
    }
    assert!(env.envd.seen().is_empty(), "a sandbox's page reached envd");
    assert!(
        env.api.seen().is_empty(),
        "a sandbox's page reached the control plane"
    );

    let own = form("/app", &format!("3000-isb-a.localhost:{port}"), &origin);
    let resp = raw_exchange(addr, own.as_bytes()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.text(), "envd isb-a: POST /app (2 bytes)");
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 4. Forgetting on delete
// ---------------------------------------------------------------------------------------

/// `DELETE /sandboxes/{id}` through the proxy forgets the token: the next envd request for
/// it asks the control plane again, and so does a 404 (deleted elsewhere); a failed delete
/// keeps it. `abx_proxy_envd_tokens` follows creates and deletes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_forgets_the_token() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(0.0));

    env.create(&proxy, "isb-4", "tok-4").await;
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));
    env.create(&proxy, "isb-5", "tok-5").await;
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(2.0));
    let (status, _) = text(send(addr, envd_request(addr, "isb-4", "/health")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert!(env.lookups("isb-4").is_empty());

    let req = request("DELETE", addr, "/sandboxes/isb-4")
        .header("x-api-key", "dummy-key")
        .body(empty())
        .unwrap();
    assert_eq!(send(addr, req).await.status(), StatusCode::NO_CONTENT);
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));

    // Forgotten: the proxy asks, and the control plane no longer knows it.
    let resp = raw_exchange(
        addr,
        format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nE2b-Sandbox-Id: isb-4\r\n\r\n",
            addr.port()
        )
        .as_bytes(),
    )
    .await;
    assert_proxy_error(&resp, 404, "E2009");
    assert_eq!(
        env.lookups("isb-4").len(),
        1,
        "the forgotten token was looked up"
    );
    assert_eq!(
        env.envd.seen().len(),
        1,
        "envd contacted for a deleted sandbox"
    );

    // The other sandbox is untouched.
    let (status, _) = text(send(addr, envd_request(addr, "isb-5", "/health")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert!(env.lookups("isb-5").is_empty());
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));

    // A look-up that finds the sandbox counts it again.
    env.cloud.exists("isb-6", "tok-6");
    let (status, _) = text(send(addr, envd_request(addr, "isb-6", "/health")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(2.0));

    // Gone already (deleted elsewhere): the 404 forgets the token all the same. A delete
    // that failed (503) keeps it: the sandbox is still there.
    let delete = |id: &str| {
        request("DELETE", addr, &format!("/sandboxes/{id}"))
            .header("x-api-key", "dummy-key")
            .body(empty())
            .unwrap()
    };
    env.cloud.sandboxes.lock().unwrap().remove("isb-6");
    assert_eq!(send(addr, delete("isb-6")).await.status(), 404);
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));
    env.create(&proxy, "isb-busy-7", "tok-7").await;
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(2.0));
    assert_eq!(send(addr, delete("isb-busy-7")).await.status(), 503);
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(2.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 5. envd 401: fetch the token again
// ---------------------------------------------------------------------------------------

/// The token rotates behind the proxy's back. A bodiless request that gets 401 is retried
/// with the token fetched again; one with a body gets the 401, and the next request uses
/// the fresh token. Each 401 costs exactly one look-up; one that fails is the answer
/// when the token refused was the proxy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_401_fetches_the_token_again() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    let envd_host = env.envd.addr.to_string();
    env.create(&proxy, "isb-5", "tok-a").await;

    env.cloud.exists("isb-5", "tok-b");
    let (status, body) = text(send(addr, envd_request(addr, "isb-5", "/health")).await).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the bodiless request was retried: {body}"
    );
    assert_eq!(env.lookups("isb-5").len(), 1);
    let seen = env.envd.seen();
    assert_eq!(seen.len(), 2, "the 401, then the retry");
    assert_envd_head(
        &seen[0],
        &envd_host,
        "isb-5",
        ENVD_PORT,
        "tok-a",
        DEFAULT_BASIC,
    );
    assert_envd_head(
        &seen[1],
        &envd_host,
        "isb-5",
        ENVD_PORT,
        "tok-b",
        DEFAULT_BASIC,
    );
    assert_eq!(seen[1].path_and_query(), "/health");

    env.cloud.exists("isb-5", "tok-c");
    let upload = || {
        request("POST", addr, "/files?path=%2Ftmp%2Fx")
            .header("e2b-sandbox-id", "isb-5")
            .header("content-type", "application/octet-stream")
            .body(full("payload"))
            .unwrap()
    };
    let (status, body) = text(send(addr, upload()).await).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "a body cannot be sent twice"
    );
    assert_eq!(body, "bad access token");
    assert_eq!(
        env.lookups("isb-5").len(),
        2,
        "the 401 fetched the token again"
    );
    assert_eq!(env.envd.seen().len(), 3, "no retry with a body");

    let (status, body) = text(send(addr, upload()).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, "envd isb-5: POST /files?path=%2Ftmp%2Fx (7 bytes)");
    assert_eq!(env.lookups("isb-5").len(), 2, "the fresh token was kept");
    let seen = env.envd.seen();
    assert_envd_head(
        &seen[2],
        &envd_host,
        "isb-5",
        ENVD_PORT,
        "tok-b",
        DEFAULT_BASIC,
    );
    assert_envd_head(
        &seen[3],
        &envd_host,
        "isb-5",
        ENVD_PORT,
        "tok-c",
        DEFAULT_BASIC,
    );
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));

    // Deleted behind the proxy's back: the look-up after envd's 401 finds nothing, and
    // says so (404 E2009, as for a sandbox with no token stored: the 401 alone read as a
    // bad key); the token is no longer counted as known.
    env.cloud.sandboxes.lock().unwrap().remove("isb-5");
    let raw = format!(
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nE2b-Sandbox-Id: isb-5\r\nConnection: close\r\n\r\n"
    );
    let resp = raw_exchange(addr, raw.as_bytes()).await;
    assert_proxy_error(&resp, 404, "E2009");
    assert_eq!(env.lookups("isb-5").len(), 3);
    assert_eq!(env.envd.seen().len(), 5, "nothing to retry with");
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(0.0));

    // Rotated while the control plane fails its look-ups: the look-up's failure is the
    // answer (502 E5001), with a body too, not envd's 401. So is the next request's, which
    // sends the token the SDK got from the create (it was envd's bare 401: the refused
    // token had been dropped, and the SDK's copy of it taken for a token of its own), and
    // one with none: each is looked up, and neither goes to envd with the refused token.
    for (id, method, body) in [("isb-busy-5", "GET", ""), ("isb-busy-6", "POST", "payload")] {
        env.create(&proxy, id, "tok-busy").await;
        env.cloud.exists(id, "tok-busy-rotated");
        let sdk_token = "X-Access-Token: tok-busy\r\n";
        for (n, sdk_token) in [(1, ""), (2, sdk_token), (3, "")] {
            let raw = format!(
                "{method} /files?path=%2Ftmp%2Fx HTTP/1.1\r\nHost: {addr}\r\n\
                 E2b-Sandbox-Id: {id}\r\n{sdk_token}Content-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
            let resp = raw_exchange(addr, raw.as_bytes()).await;
            assert_proxy_error(&resp, 502, "E5001");
            assert!(
                resp.text().contains("look-up answered 503"),
                "{}",
                resp.text()
            );
            assert_eq!(env.lookups(id).len(), n);
        }
    }
    assert_eq!(env.envd.seen().len(), 7, "each 401, nothing to retry with");

    // A token the client sent (none stored) that envd refuses: envd's 401 is the client's
    // answer, whatever the look-up found (here: no such sandbox in this account).
    let theirs = request("GET", addr, "/health")
        .header("e2b-sandbox-id", "isb-elsewhere")
        .header("x-access-token", "tok-of-theirs")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, theirs).await).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::UNAUTHORIZED, "bad access token")
    );
    assert_eq!(env.lookups("isb-elsewhere").len(), 1);

    // An app's port: its 401 is the app's own answer (to the client's credential for it),
    // not envd's about the token. It reaches the client as it is: no look-up (which any
    // client could otherwise drive, with the proxy's key, one per 401), nothing sent again.
    env.create(&proxy, "isb-6", "tok-6").await;
    env.cloud.exists("isb-6", "tok-6b");
    let app = request("DELETE", addr, "/items/1")
        .header("e2b-sandbox-id", "isb-6")
        .header("e2b-sandbox-port", "3000")
        .header("authorization", BAD_APP_CREDENTIAL)
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, app).await).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::UNAUTHORIZED, "the app refuses the credential")
    );
    assert!(
        env.lookups("isb-6").is_empty(),
        "an app's 401 looked the token up"
    );
    assert_eq!(env.envd.seen().len(), 9, "an app's 401 was sent again");
    env.assert_envd_clean();
    proxy.finish().await;
}

/// Many requests rejected together with the same stale token: one look-up between them,
/// and every bodiless request is retried with the fresh token. (A request whose 401 is
/// handled after another's look-up finished must not throw the fresh token away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_401s_share_one_refetch() {
    const N: usize = 20;
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.create(&proxy, "isb-r", "tok-old").await;
    env.cloud.exists("isb-r", "tok-new");
    *env.cloud.unauthorized_together.lock().unwrap() = Some(Arc::new(Barrier::new(N)));

    let clients: Vec<_> = (0..N)
        .map(|i| {
            tokio::spawn(async move {
                text(send(addr, envd_request(addr, "isb-r", &format!("/health?n={i}"))).await).await
            })
        })
        .collect();
    for (i, client) in clients.into_iter().enumerate() {
        let (status, body) = within("an envd response", client)
            .await
            .expect("client task");
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
    }
    assert_eq!(
        env.lookups("isb-r").len(),
        1,
        "one look-up for {N} rejections"
    );
    let seen = env.envd.seen();
    let with = |token: &str| {
        seen.iter()
            .filter(|s| s.header("x-access-token") == Some(token))
            .count()
    };
    assert_eq!((with("tok-old"), with("tok-new")), (N, N));
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(1.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 6. sandbox_domain mode
// ---------------------------------------------------------------------------------------

/// `--sandbox-domain localhost:P` (no `sandbox_url`): the proxy connects to
/// `https://49983-isb-1.localhost:P` — `*.localhost` resolves to loopback without DNS
/// (RFC 6761) — verifies the certificate for that name, and sends it as the Host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_domain_reaches_port_dash_id_dot_domain_over_tls() {
    // webpki (like NSS) ignores a wildcard with fewer than two labels after it, so the
    // certificate names the sandbox hosts as well as `*.localhost`.
    let pki = Pki::with_names(&[
        "127.0.0.1",
        "*.localhost",
        "49983-isb-1.localhost",
        "8080-isb-1.localhost",
    ]);
    let mut env = Env::start(pki).await;
    let domain = format!("localhost:{}", env.envd.addr.port());
    let mut proxy = ProxyCmd::new(&env.api.url(), &env.pki)
        .args(&["--sandbox-domain", &domain])
        .spawn()
        .await;
    let addr = proxy.addr();
    // A client gone during a look-up (the control plane's first request here): its 499
    // names the control plane, which it waited for.
    give_up_during_look_up(&mut env, &proxy, "isb-gone").await;
    let gone = proxy.wait_for_line(" status=499 ").await;
    let named = format!(" upstream={}", env.api.addr);
    assert!(gone.trim_end().ends_with(&named), "{gone}");
    env.create(&proxy, "isb-1", "tok-1").await;

    // Routed by the headers, then by the Host name, then to another port.
    let (status, body) = text(send(addr, envd_request(addr, "isb-1", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let raw = format!(
        "GET /health HTTP/1.1\r\nHost: 49983-isb-1.localhost:{}\r\n\r\n",
        addr.port()
    );
    let resp = raw_exchange(addr, raw.as_bytes()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let req = request("GET", addr, "/app")
        .header("e2b-sandbox-id", "isb-1")
        .header("e2b-sandbox-port", "8080")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let seen = env.envd.seen();
    assert_eq!(seen.len(), 3);
    let host = |port: u16| format!("{port}-isb-1.{domain}");
    assert_envd_head(
        &seen[0],
        &host(ENVD_PORT),
        "isb-1",
        ENVD_PORT,
        "tok-1",
        DEFAULT_BASIC,
    );
    assert_envd_head(
        &seen[1],
        &host(ENVD_PORT),
        "isb-1",
        ENVD_PORT,
        "tok-1",
        DEFAULT_BASIC,
    );
    assert_envd_head(
        &seen[2],
        &host(8080),
        "isb-1",
        8080,
        NO_TOKEN,
        NO_AUTHORIZATION,
    );

    // An id that cannot be part of one DNS label (`49983-<id>` over 63 characters, or
    // ending in a dash) names no sandbox here: refused before a look-up spends the key,
    // where it failed at the connect, 502 (which the SDKs read as a sandbox gone).
    let long = format!("isb-{}", "a".repeat(54));
    let why = [
        (long.as_str(), "is 64 characters, over 63"),
        ("isb-2-", "ends in a dash"),
    ];
    for (id, why) in why {
        let resp = send(addr, envd_request(addr, id, "/health")).await;
        let (status, body) = text(resp).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{id}: {body}");
        assert!(body.contains("E5003") && body.contains(why), "{body}");
        assert!(env.lookups(id).is_empty(), "{id}: looked up");
    }
    // 63 characters make one label: routed, and looked up as any other.
    let longest = format!("isb-{}", "a".repeat(53));
    let resp = send(addr, envd_request(addr, &longest, "/health")).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(env.lookups(&longest).len(), 1);

    // A client gone while envd holds its request (a 401 held until a second comes): its
    // 499 names the sandbox's host.
    env.cloud.exists("isb-1", "tok-rotated");
    let held = Arc::new(Barrier::new(2));
    *env.cloud.unauthorized_together.lock().unwrap() = Some(held.clone());
    let impatient =
        tokio::spawn(async move { send(addr, envd_request(addr, "isb-1", "/held")).await });
    while env.envd.next_request().await.uri.path() != "/held" {}
    impatient.abort();
    let gone = proxy.wait_for_line(" status=499 ").await;
    let named = format!(" upstream={ENVD_PORT}-isb-1.{domain}");
    assert!(gone.trim_end().ends_with(&named), "{gone}");
    // envd's 401 stays held: its connection is the proxy's to close, and it has.
    drop(held);

    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 7. Connect server streams
// ---------------------------------------------------------------------------------------

/// A Connect envelope: flags, big-endian length, payload.
fn envelope(flags: u8, payload: &str) -> Bytes {
    let mut b = Vec::with_capacity(5 + payload.len());
    b.push(flags);
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload.as_bytes());
    Bytes::from(b)
}

/// Complete envelopes at the front of `buf`, removed from it.
fn take_envelopes(buf: &mut Vec<u8>) -> Vec<(u8, String)> {
    let mut out = Vec::new();
    while buf.len() >= 5 {
        let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
        if buf.len() < 5 + len {
            break;
        }
        let payload = String::from_utf8(buf[5..5 + len].to_vec()).expect("JSON payload");
        out.push((buf[0], payload));
        buf.drain(..5 + len);
    }
    out
}

/// Sandbox `isb-9` (token `tok-9`) created through a proxy with `--idle-timeout 3s`.
async fn sandbox_behind_a_3s_idle_timeout(
    pki: Pki,
    cloud: Arc<Cloud>,
    envd: Upstream,
) -> (Env, ProxyProc) {
    let env = Env::with_envd(pki, cloud, envd).await;
    let proxy = env.proxy_with(&["--idle-timeout", "3s"]).await;
    env.create(&proxy, "isb-9", "tok-9").await;
    (env, proxy)
}

/// A Connect server stream of the envelopes sent on `rx`, as envd answers.
fn connect_stream(rx: mpsc::Receiver<Bytes>) -> Response<TestBody> {
    let mut r = Response::new(boxed(ChannelBody(rx)));
    r.headers_mut()
        .insert("content-type", "application/connect+json".parse().unwrap());
    r
}

const START: &str =
    r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","sleep 3; echo hi"]},"stdin":false}"#;
const STARTED: &str = r#"{"event":{"start":{"pid":4242}}}"#;
const KEEPALIVE: &str = r#"{"event":{"keepalive":{}}}"#;
/// 750 ms apart, 4.5 s of keepalives: past the 3 s `--idle-timeout` below.
const KEEPALIVES: usize = 6;

/// `/process.Process/Start` through envd: the first event reaches the client before envd
/// sends anything else (streaming, no buffering), then keepalives every 750 ms carry the
/// stream past the 3 s `--idle-timeout` (a connection that moves bytes is never cut), then
/// the end-of-stream frame. The chunked request envelope arrives intact.
///
/// The timeout is four gaps between keepalives, not two: a loaded machine that stalls the
/// upstream's timer for a second must not make the stream look idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_server_stream_outlives_the_idle_timeout() {
    let pki = Pki::new();
    let cloud = Cloud::new();
    let (client_saw_start, start_seen) = oneshot::channel::<()>();
    let start_seen = Arc::new(Mutex::new(Some(start_seen)));
    let (upload_tx, mut upload_rx) = mpsc::unbounded_channel::<Bytes>();
    let envd = Upstream::start(&pki, Proto::H2, move |req: Request<Incoming>| {
        let start_seen = start_seen.lock().unwrap().take();
        let upload_tx = upload_tx.clone();
        async move {
            let start_seen = start_seen.expect("one Start request");
            let _ = upload_tx.send(collect(req.into_body()).await);
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(async move {
                if tx.send(envelope(0, STARTED)).await.is_err() || start_seen.await.is_err() {
                    return;
                }
                // Pacing the keepalives is what is under test, not synchronisation.
                let mut every = tokio::time::interval(Duration::from_millis(750));
                every.tick().await;
                for _ in 0..KEEPALIVES {
                    every.tick().await;
                    if tx.send(envelope(0, KEEPALIVE)).await.is_err() {
                        return;
                    }
                }
                let _ = tx.send(envelope(2, "{}")).await;
            });
            connect_stream(rx)
        }
    })
    .await;
    let (env, proxy) = sandbox_behind_a_3s_idle_timeout(pki, cloud, envd).await;
    let addr = proxy.addr();

    // The SDK's request: one envelope, chunked (no length announced).
    let (body_tx, body_rx) = mpsc::channel(1);
    body_tx.send(envelope(0, START)).await.unwrap();
    drop(body_tx);
    let req = request("POST", addr, "/process.Process/Start")
        .header("e2b-sandbox-id", "isb-9")
        .header("e2b-sandbox-port", "49983")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .header("keepalive-ping-interval", "50")
        .header("connect-timeout-ms", "60000")
        .header("x-api-key", "dummy-key")
        .body(boxed(ChannelBody(body_rx)))
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "application/connect+json");

    let mut body = resp.into_body();
    let mut buf = Vec::new();
    let mut frames = Vec::new();
    let mut release = Some(client_saw_start);
    loop {
        let Some(frame) = within("the next stream frame", body.frame()).await else {
            break;
        };
        let frame = frame.expect("the stream was cut");
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
        }
        frames.extend(take_envelopes(&mut buf));
        if !frames.is_empty() {
            if let Some(release) = release.take() {
                assert_eq!(frames[0], (0, STARTED.to_string()), "the first event");
                release.send(()).unwrap();
            }
        }
    }
    assert!(buf.is_empty(), "a partial envelope at the end: {buf:?}");
    let mut expected = vec![(0u8, STARTED.to_string())];
    expected.extend((0..KEEPALIVES).map(|_| (0u8, KEEPALIVE.to_string())));
    expected.push((2, "{}".to_string()));
    assert_eq!(frames, expected, "every event, then end-of-stream");

    let upload = within("the request envelope", upload_rx.recv())
        .await
        .unwrap();
    assert_eq!(
        upload,
        envelope(0, START),
        "the request envelope arrived intact"
    );
    let seen = &env.envd.seen()[0];
    assert_eq!(seen.uri.path(), "/process.Process/Start");
    assert_eq!(
        seen.header("content-type"),
        Some("application/connect+json")
    );
    // Half the idle timeout, in whole seconds.
    assert_eq!(seen.header("keepalive-ping-interval"), Some("1"));
    assert_eq!(seen.header("connect-protocol-version"), Some("1"));
    assert_envd_head(
        seen,
        &env.envd.addr.to_string(),
        "isb-9",
        ENVD_PORT,
        "tok-9",
        DEFAULT_BASIC,
    );
    env.assert_envd_clean();
    proxy.finish().await;
}

/// A command quiet for longer than `--idle-timeout`: envd keeps its stream moving with
/// keepalives at the pace the request asks (`Keepalive-Ping-Interval`, seconds), and the
/// SDKs ask for 50 s. The proxy asks for half its idle timeout instead, so the stream
/// outlives a timeout the SDKs' pace would not. The upstream paces as envd does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_command_outlives_a_short_idle_timeout() {
    /// How long the command says nothing: past the 3 s timeout, and past a second cut.
    const QUIET: Duration = Duration::from_millis(6500);
    let pki = Pki::new();
    let cloud = Cloud::new();
    let envd = Upstream::start(&pki, Proto::H2, |req: Request<Incoming>| async move {
        if req.headers()["e2b-sandbox-port"] != "49983" {
            return response(200, "an app");
        }
        // envd's reading: whole seconds, 90 when missing or not a positive number.
        let pace = req
            .headers()
            .get("keepalive-ping-interval")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .filter(|s| *s > 0)
            .unwrap_or(90);
        let _ = collect(req.into_body()).await;
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            if tx.send(envelope(0, STARTED)).await.is_err() {
                return;
            }
            // envd's keepalive ticker over a silent process: the behaviour under test.
            let end = tokio::time::sleep(QUIET);
            tokio::pin!(end);
            let mut every = tokio::time::interval(Duration::from_secs(pace));
            every.tick().await;
            loop {
                tokio::select! {
                    _ = &mut end => break,
                    _ = every.tick() => {
                        if tx.send(envelope(0, KEEPALIVE)).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = tx.send(envelope(2, "{}")).await;
        });
        connect_stream(rx)
    })
    .await;
    let (env, proxy) = sandbox_behind_a_3s_idle_timeout(pki, cloud, envd).await;
    let addr = proxy.addr();

    let req = request("POST", addr, "/process.Process/Start")
        .header("e2b-sandbox-id", "isb-9")
        .header("content-type", "application/connect+json")
        .header("keepalive-ping-interval", "50")
        .body(full(envelope(0, START)))
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    while let Some(frame) = within("the next stream frame", body.frame()).await {
        let frame = frame.expect("the quiet command's stream was cut");
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
        }
    }
    let frames = take_envelopes(&mut buf);
    assert!(buf.is_empty(), "a partial envelope at the end: {buf:?}");
    assert_eq!(frames.first(), Some(&(0, STARTED.to_string())));
    assert_eq!(frames.last(), Some(&(2, "{}".to_string())), "{frames:?}");
    assert!(frames.len() >= 5, "keepalives a second apart: {frames:?}");
    assert_eq!(
        env.envd.seen()[0].header("keepalive-ping-interval"),
        Some("1")
    );
    // An app's port is not envd: what the client asks it is its own business.
    let req = request("POST", addr, "/rpc")
        .header("e2b-sandbox-id", "isb-9")
        .header("e2b-sandbox-port", "3000")
        .header("keepalive-ping-interval", "50")
        .body(empty())
        .unwrap();
    assert_eq!(send(addr, req).await.status(), StatusCode::OK);
    assert_eq!(
        env.envd.seen()[1].header("keepalive-ping-interval"),
        Some("50")
    );
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 8. Learning from connect and the /v2 paths
// ---------------------------------------------------------------------------------------

/// The token is learned from every answer that carries it (SPEC §4): `POST
/// /sandboxes/{id}/connect`, the current SDKs' `POST /v2/sandboxes` and `POST
/// /v2/sandboxes/{id}/connect`, which reach the control plane rewritten, and the older
/// `POST /sandboxes/{id}/resume`. After each, an envd request naming only the sandbox
/// carries that token and costs no look-up; a connect or resume answering a new token (a
/// resumed sandbox) replaces the one learned before. An error answer teaches nothing, even
/// one carrying a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_learned_from_connect_and_v2_answers() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.cloud.will_create("isb-c2", "tok-c2");

    let calls = [
        (
            "/sandboxes/isb-c1/connect",
            "/sandboxes/isb-c1/connect",
            "isb-c1",
            "tok-c1",
        ),
        ("/v2/sandboxes", "/sandboxes", "isb-c2", "tok-c2"),
        (
            "/v2/sandboxes/isb-c3/connect",
            "/sandboxes/isb-c3/connect",
            "isb-c3",
            "tok-c3",
        ),
        (
            "/v2/sandboxes/isb-c1/connect",
            "/sandboxes/isb-c1/connect",
            "isb-c1",
            "tok-c1b",
        ),
        (
            "/sandboxes/isb-c3/resume",
            "/sandboxes/isb-c3/resume",
            "isb-c3",
            "tok-c3b",
        ),
    ];
    for (path, upstream_path, id, token) in calls {
        // The sandbox's token in the cloud: the one it answers.
        env.cloud.exists(id, token);
        let resp = post_json(addr, path, r#"{"timeout":300}"#).await;
        let status = resp.status();
        let body = collect(resp.into_body()).await;
        assert!(status.is_success(), "{path}: {status}");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
            sandbox_json(id, token),
            "{path}: the answer is unchanged"
        );
        let seen = env.api.seen().pop().expect("the control plane was asked");
        assert_eq!(
            (seen.method.as_str(), seen.uri.path()),
            ("POST", upstream_path)
        );
        env.assert_token_known(&proxy, id, token).await;
    }
    assert_eq!(
        env.envd.seen().len(),
        calls.len(),
        "no envd request was refused"
    );
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(3.0));

    // Only a successful answer teaches a token: a 503 carrying one does not.
    env.cloud.exists("isb-busy-9", "tok-9");
    let resp = post_json(addr, "/sandboxes/isb-busy-9/connect", "{}").await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(collect(resp.into_body()).await.ends_with(b"}"));
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(3.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

/// A fork (`POST /sandboxes/{id}/fork`, e2b 2.6x's `Sandbox.fork`) answers a result per
/// new sandbox: each one's token is learned, so a request naming a fork by id alone costs
/// no look-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_learned_from_a_forks_answer() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.cloud.exists("isb-p", "tok-p");
    env.cloud.exists("isb-p-f1", "tok-f1");
    env.cloud.exists("isb-p-f2", "tok-f2");
    let resp = post_json(addr, "/sandboxes/isb-p/fork", r#"{"count":3}"#).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let answer: serde_json::Value =
        serde_json::from_slice(&collect(resp.into_body()).await).unwrap();
    assert_eq!(answer.as_array().map(Vec::len), Some(3), "{answer}");
    env.assert_token_known(&proxy, "isb-p-f1", "tok-f1").await;
    env.assert_token_known(&proxy, "isb-p-f2", "tok-f2").await;
    assert_eq!(gauge(&proxy, ENVD_TOKENS).await, Some(2.0));
    env.assert_envd_clean();
    proxy.finish().await;
}

/// e2b Python 2.10-2.20 sends `E2b-Sandbox-Id` and `E2b-Sandbox-Port: 49983` on its
/// control-plane connect as well: E2B's API ignores them. Routed to envd by the header,
/// the connect got envd's 404 and `Sandbox.connect` failed; it is the control plane's,
/// with the key, and its token is learned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_carrying_envd_headers_goes_to_the_control_plane() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.cloud.exists("isb-h1", "tok-h1");
    let req = request("POST", addr, "/sandboxes/isb-h1/connect")
        .header("x-api-key", "dummy-key")
        .header("e2b-sandbox-id", "isb-h1")
        .header("e2b-sandbox-port", "49983")
        .header("content-type", "application/json")
        .body(full(r#"{"timeout":300}"#))
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = env.api.seen().pop().expect("the control plane was asked");
    assert_eq!(
        (seen.method.as_str(), seen.uri.path()),
        ("POST", "/sandboxes/isb-h1/connect")
    );
    assert_eq!(seen.all("authorization"), vec![format!("Bearer {API_KEY}")]);
    assert!(env.envd.seen().is_empty(), "envd was sent the connect");
    env.assert_token_known(&proxy, "isb-h1", "tok-h1").await;
    proxy.finish().await;
}

/// An older SDK (e2b Python 2.10-2.20, JS 2.9) names no sandbox, only its token. Rotated
/// while the control plane fails its look-ups, the token envd refused still names its
/// sandbox: every such request gets the look-up's error (the second got 400 E5003, "name
/// the sandbox", and commands the control plane's 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_sent_alone_still_names_its_sandbox() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.create(&proxy, "isb-busy-t", "tok-bt").await;
    env.cloud.exists("isb-busy-t", "tok-bt-rotated");
    for n in 1..=3 {
        let raw = format!(
            "GET /files?path=%2Ftmp%2Fx HTTP/1.1\r\nHost: {addr}\r\n\
             X-Access-Token: tok-bt\r\nConnection: close\r\n\r\n"
        );
        let resp = raw_exchange(addr, raw.as_bytes()).await;
        assert_proxy_error(&resp, 502, "E5001");
        assert_eq!(env.lookups("isb-busy-t").len(), n);
    }
    assert_eq!(env.envd.seen().len(), 1, "only the first went to envd");

    // Rotated while the control plane answers: every request by the old token alone
    // reaches envd with the new one (after the first's look-up, the second went to the
    // control plane and the third was refused 400, when the answer ended the refusal).
    env.create(&proxy, "isb-rot", "tok-r").await;
    env.cloud.exists("isb-rot", "tok-r2");
    for n in 1..=3 {
        let raw = format!(
            "GET /health HTTP/1.1\r\nHost: {addr}\r\n\
             X-Access-Token: tok-r\r\nConnection: close\r\n\r\n"
        );
        let resp = raw_exchange(addr, raw.as_bytes()).await;
        assert_eq!(resp.status, 200, "request {n}: {:?}", resp.text());
        let seen = env.envd.seen().pop().expect("envd was asked");
        assert_envd_head(
            &seen,
            &env.envd.addr.to_string(),
            "isb-rot",
            ENVD_PORT,
            "tok-r2",
            DEFAULT_BASIC,
        );
    }
    assert_eq!(env.lookups("isb-rot").len(), 1);
    env.assert_envd_clean();
    proxy.finish().await;
}

/// e2b Python 2.10-2.20 send the commands and files of a sandbox got by `Sandbox.connect`
/// with `X-Access-Token` alone, and JS 2.9 its file and health requests: no sandbox named.
/// On envd's paths, a token the proxy learned names its sandbox; they went to the control
/// plane with the key, and got its 404. A token it never learned is refused; another path
/// stays the control plane's, without the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envd_request_with_only_a_learned_token_goes_to_its_sandbox() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.create(&proxy, "isb-t1", "tok-t1").await;
    env.create(&proxy, "isb-t2", "tok-t2").await;
    let with_token = |path: &str, token: &str| {
        request("GET", addr, path)
            .header("x-access-token", token)
            .body(empty())
            .unwrap()
    };
    for path in ["/health", "/files?path=%2Fetc%2Fhostname"] {
        let (status, body) = text(send(addr, with_token(path, "tok-t2")).await).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
        let seen = env.envd.seen().pop().expect("envd was asked");
        assert_envd_head(
            &seen,
            &env.envd.addr.to_string(),
            "isb-t2",
            ENVD_PORT,
            "tok-t2",
            DEFAULT_BASIC,
        );
    }
    let api_before = env.api.seen().len();
    let envd_before = env.envd.seen().len();
    // A token it never learned (one forgotten, from before a restart) on envd's path: no
    // sandbox to send it to, and never the control plane's (it went there, token and all,
    // and came back as its 404: "sandbox not found" to the SDK). Refused, saying so.
    let (status, body) = text(send(addr, with_token("/health", "tok-unknown")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body.contains("connect to the sandbox again through the proxy"),
        "{body}"
    );
    // A path that is no envd's: the control plane's, without the sandbox's token.
    let (status, _) = text(send(addr, with_token("/sandboxes/isb-t2", "tok-t2")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(env.api.seen().len(), api_before + 1);
    let seen = env.api.seen().pop().expect("the control plane was asked");
    assert_eq!(seen.header("x-access-token"), None, "{:?}", seen.headers);
    assert_eq!(env.envd.seen().len(), envd_before);
    // A file request by an unknown token is refused the same, and a signed file URL naming
    // no sandbox (an empty token is none) is told to name it; each counted as envd's, where
    // it was meant to go; so is a request refused while routing (a dot segment), as routed.
    let (status, body) = text(send(addr, with_token("/files", "tok-unknown")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("connect to the sandbox again"), "{body}");
    let unsigned = request("GET", addr, "/files?path=%2Fx")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, unsigned).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("/files is envd's"), "{body}");
    let (status, body) = text(send(addr, with_token("/files?path=%2Fx", "")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("/files is envd's"), "{body}");
    let dotted = "/filesystem.Filesystem/./ListDir";
    let (status, _) = text(send(addr, with_token(dotted, "tok-t1")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let metrics = scrape(proxy.admin_addr()).await;
    let refused = |plane: &str| {
        let series =
            format!(r#"abx_proxy_requests_total{{plane="{plane}",method="GET",code="400"}}"#);
        metric(&metrics, &series)
    };
    assert_eq!(
        (refused("envd"), refused("api")),
        (Some(5.0), None),
        "{metrics}"
    );

    // Killed through the proxy, its token still names it: the SDKs ask envd's `/health`
    // after a kill, and the control plane's own `/health` (E2B's answers 204) read as the
    // sandbox running.
    let kill = request("DELETE", addr, "/sandboxes/isb-t2")
        .header("x-api-key", "dummy-key")
        .body(empty())
        .unwrap();
    assert_eq!(send(addr, kill).await.status(), StatusCode::NO_CONTENT);
    let api_before = env.api.seen().len();
    let _ = text(send(addr, with_token("/health", "tok-t2")).await).await;
    let seen = env.envd.seen().pop().expect("envd was asked");
    assert_eq!(
        (seen.uri.path(), seen.all("e2b-sandbox-id")),
        ("/health", vec!["isb-t2".to_string()])
    );
    let asked: Vec<String> = (env.api.seen().into_iter().skip(api_before))
        .map(|s| s.uri.path().to_string())
        .collect();
    assert!(!asked.contains(&"/health".to_string()), "{asked:?}");

    // An id given again to a new sandbox (a provider that reuses ids): the old token goes
    // as the client sent it, and envd's 401 is the answer. The proxy put the new
    // sandbox's token in its place and ran the request there.
    env.create(&proxy, "isb-t2", "tok-t2-again").await;
    let lookups = env.lookups("isb-t2").len();
    let (status, _) = text(send(addr, with_token("/health", "tok-t2")).await).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let seen = env.envd.seen().pop().expect("envd was asked");
    assert_eq!(seen.all("x-access-token"), vec!["tok-t2".to_string()]);
    assert_eq!(
        env.lookups("isb-t2").len(),
        lookups,
        "looked up after the 401"
    );
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 9. The 1 MiB bound on bodies the proxy reads
// ---------------------------------------------------------------------------------------

const MIB: usize = 1024 * 1024;

/// Length and SHA-256 of `bytes`, to compare with [`hash_body`]'s.
fn digest(bytes: &[u8]) -> (u64, [u8; 32]) {
    let mut hasher = Sha256::new();
    hasher.update(bytes);
    (bytes.len() as u64, hasher.finalize())
}

/// A create body of exactly `len` bytes: a JSON object without `secure`.
fn create_body_of(len: usize) -> String {
    let (head, tail) = (r#"{"templateID":"base","metadata":{"blob":""#, r#""}}"#);
    format!("{head}{}{tail}", "x".repeat(len - head.len() - tail.len()))
}

/// The proxy reads a control-plane body itself only up to 1 MiB (SPEC §4) and never loses
/// or changes a byte past that: a 1.5 MiB create answer reaches the client byte for byte
/// (its token, past the bound, is looked up instead of learned); a `/v2/sandboxes` create
/// body gets `"secure": true` at 1 MiB and at 1.5 MiB (streamed: the field goes in its
/// first bytes, every other byte as sent), else a large `envs` made a sandbox without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_1_mib_bound_lose_no_byte() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();

    let mut answer = sandbox_json("isb-big", "tok-big");
    answer["metadata"] = json!({ "blob": "x".repeat(MIB * 3 / 2) });
    let answer_bytes = answer.to_string();
    env.cloud
        .will_create_answering("isb-big", "tok-big", answer);
    let resp = post_json(addr, "/sandboxes", r#"{"templateID":"base"}"#).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(
        within("the create answer", hash_body(resp.into_body())).await,
        digest(answer_bytes.as_bytes()),
        "the 1.5 MiB answer reached the client unchanged"
    );
    let (status, body) = text(send(addr, envd_request(addr, "isb-big", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        env.lookups("isb-big").len(),
        1,
        "a token past the bound is looked up"
    );

    for (len, id, token) in [(MIB, "isb-b1", "tok-b1"), (MIB * 3 / 2, "isb-b2", "tok-b2")] {
        let sent = create_body_of(len);
        env.cloud.will_create(id, token);
        let resp = post_json(addr, "/v2/sandboxes", sent.clone()).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        collect(resp.into_body()).await;
        let received = env.cloud.create_bodies.lock().unwrap().pop().unwrap();
        // The control plane is told the length of what it gets.
        let head = env.api.seen().pop().unwrap();
        let length = received.len().to_string();
        assert_eq!(head.header("content-length"), Some(length.as_str()));
        let secure = format!("{{\"secure\":true,{}", &sent[1..]);
        assert_eq!(
            digest(&received),
            digest(secure.as_bytes()),
            "a create body of {len} bytes gets \"secure\": true, and nothing else changes"
        );
        // The answer is small: its token is learned whatever the request's size.
        env.assert_token_known(&proxy, id, token).await;
    }
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 10. What requests_total counts
// ---------------------------------------------------------------------------------------

/// `abx_proxy_requests_total` (SPEC §7) counts each client request once on its plane: an
/// envd request answered after a look-up, one retried after envd's 401, one refused with
/// E2009, a create — and none of the proxy's own `GET /sandboxes/{id}` look-ups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_total_counts_envd_requests_but_not_the_proxys_lookups() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();

    env.cloud.exists("isb-m", "tok-m1");
    let (status, _) = text(send(addr, envd_request(addr, "isb-m", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "answered after a look-up");
    env.cloud.exists("isb-m", "tok-m2");
    let (status, _) = text(send(addr, envd_request(addr, "isb-m", "/health")).await).await;
    assert_eq!(status, StatusCode::OK, "retried after a 401 and a look-up");
    let (status, _) = text(send(addr, envd_request(addr, "isb-none", "/health")).await).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "E2009 after a look-up");
    env.create(&proxy, "isb-n", "tok-n").await;
    // Refused while routing, it is still envd's: it names a sandbox (SPEC §4).
    let (status, _) = text(send(addr, envd_request(addr, "isb_bad!", "/health")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "an id that is none");
    assert_eq!(
        (env.lookups("isb-m").len(), env.lookups("isb-none").len()),
        (2, 1)
    );
    assert_eq!(env.envd.seen().len(), 3);

    let metrics = scrape(proxy.admin_addr()).await;
    let counted: Vec<&str> = metrics
        .lines()
        // The server errors' series exist at 0 from the start.
        .filter(|l| l.starts_with("abx_proxy_requests_total") && !l.ends_with(" 0"))
        .collect();
    assert_eq!(counted.len(), 4, "only the client's requests: {counted:#?}");
    let series = |labels: &str| metric(&metrics, &format!("abx_proxy_requests_total{{{labels}}}"));
    assert_eq!(series(r#"plane="envd",method="GET",code="200""#), Some(2.0));
    assert_eq!(series(r#"plane="envd",method="GET",code="404""#), Some(1.0));
    assert_eq!(series(r#"plane="envd",method="GET",code="400""#), Some(1.0));
    assert_eq!(series(r#"plane="api",method="POST",code="201""#), Some(1.0));
    let envd_timed = r#"abx_proxy_request_duration_seconds_count{plane="envd"}"#;
    assert_eq!(metric(&metrics, envd_timed), Some(4.0));
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 11. WebSocket through envd
// ---------------------------------------------------------------------------------------

/// A WebSocket upgrade routed by the envd headers (SPEC §4: `Upgrade` passes through on
/// both planes). envd gets it over HTTP/1.1 with the learned token in place of the client's
/// stale one, the routing headers and the default user, and without the hop-by-hop fields
/// (also those the client's `Connection` names) or `X-API-Key`; envd's own hop-by-hop field
/// does not reach the client; after the 101, bytes go both ways. A second upgrade, after
/// the token rotated, is refused with 401, and sent again with the token looked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_through_envd() {
    let env = Env::start(Pki::new()).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    let envd_host = env.envd.addr.to_string();
    env.create(&proxy, "isb-ws", "tok-ws1").await;

    let upgrade = format!(
        "GET /ws?room=1 HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\
         Connection: keep-alive, Upgrade, X-Hop\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: {WS_KEY}\r\nSec-WebSocket-Version: 13\r\n\
         E2b-Sandbox-Id: isb-ws\r\nE2b-Sandbox-Port: 49983\r\nX-Access-Token: stale\r\n\
         X-Hop: hop\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n\
         X-API-Key: dummy-key\r\n\r\n",
        addr.port()
    );
    let mut payload = vec![0u8; 256 * 1024];
    Gen::new(11).fill(&mut payload);
    for token in ["tok-ws1", "tok-ws2"] {
        env.cloud.exists("isb-ws", token);
        let (mut s, resp, buf) = raw_open(addr, upgrade.as_bytes()).await;
        assert_eq!(resp.status, 101, "{resp:?}");
        assert_eq!(resp.header("upgrade"), Some("websocket"));
        assert_eq!(resp.header("sec-websocket-accept"), Some(WS_ACCEPT));
        assert!(!resp.has("x-envd-hop"), "envd's hop-by-hop field: {resp:?}");
        assert!(buf.is_empty());

        let seen = env.envd.seen().pop().unwrap();
        assert_envd_head(&seen, &envd_host, "isb-ws", ENVD_PORT, token, DEFAULT_BASIC);
        assert_eq!(seen.path_and_query(), "/ws?room=1");
        assert_eq!(seen.header("upgrade"), Some("websocket"));
        assert_eq!(seen.header("connection"), Some("upgrade"));
        assert_eq!(seen.header("sec-websocket-key"), Some(WS_KEY));
        assert_eq!(seen.header("sec-websocket-version"), Some("13"));
        for hop in ["x-hop", "keep-alive", "proxy-connection"] {
            assert!(seen.header(hop).is_none(), "{hop} reached envd: {seen:?}");
        }
        echo(&mut s, b"ping").await;
        echo(&mut s, &payload).await;
    }
    let refused: Vec<_> = env
        .envd
        .seen()
        .into_iter()
        .map(|s| s.header("x-access-token").unwrap().to_string())
        .collect();
    assert_eq!(
        refused,
        ["tok-ws1", "tok-ws1", "tok-ws2"],
        "the stale token, then the fresh one"
    );
    assert_eq!(env.lookups("isb-ws").len(), 1);
    env.assert_envd_clean();
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// 12. Path prefixes
// ---------------------------------------------------------------------------------------

/// A base URL with a path prefix (SPEC §3: the client's path is appended to the base
/// URL's): with `--sandbox-base-url …/api`, `GET /sandboxes?x=1` reaches
/// `/api/sandboxes?x=1`, the SDK's `/v2/sandboxes` create `/api/sandboxes`, and the
/// proxy's own look-up `/api/sandboxes/{id}`. With `--sandbox-url …/prefix`, envd requests
/// keep that prefix, as the SDKs' `E2B_SANDBOX_URL` is a base URL too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_prefixes_are_kept_on_both_planes() {
    let env = Env::start(Pki::new()).await;
    let proxy = ProxyCmd::new(&format!("{}{API_PREFIX}", env.api.url()), &env.pki)
        .args(&["--sandbox-url", &format!("{}/prefix", env.envd.url())])
        .spawn()
        .await;
    let addr = proxy.addr();
    let envd_host = env.envd.addr.to_string();

    let req = request("GET", addr, "/sandboxes?x=1")
        .header("x-api-key", "dummy-key")
        .body(empty())
        .unwrap();
    let (status, body) = text(send(addr, req).await).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "[]"));
    env.cloud.will_create("isb-p1", "tok-p1");
    let resp = post_json(addr, "/v2/sandboxes", r#"{"templateID":"base"}"#).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    collect(resp.into_body()).await;
    let api: Vec<_> = env.api.paths();
    assert_eq!(api, ["/api/sandboxes?x=1", "/api/sandboxes"]);

    env.cloud.exists("isb-p2", "tok-p2");
    for (id, token) in [("isb-p1", "tok-p1"), ("isb-p2", "tok-p2")] {
        let (status, body) =
            text(send(addr, envd_request(addr, id, "/files?path=%2Fa")).await).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            body,
            format!("envd {id}: GET /prefix/files?path=%2Fa (0 bytes)")
        );
        let seen = env.envd.seen().pop().unwrap();
        assert_envd_head(&seen, &envd_host, id, ENVD_PORT, token, DEFAULT_BASIC);
    }
    let lookups: Vec<_> = env
        .lookups("isb-p2")
        .iter()
        .map(|s| s.uri.path().to_string())
        .collect();
    assert_eq!(lookups, ["/api/sandboxes/isb-p2"]);
    assert!(
        env.lookups("isb-p1").is_empty(),
        "the create's token was learned"
    );
    env.assert_envd_clean();
    proxy.finish().await;
}

/// An envd download the sandbox cuts short reaches the client as an error and is counted
/// as an upstream `reset` on the envd plane, not the control plane's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envd_download_cut_short_is_an_envd_reset() {
    let pki = Pki::new();
    let (envd, cut) = cutting_upstream(&pki, Proto::Http1).await;
    let env = Env::with_envd(pki, Cloud::new(), envd).await;
    let proxy = env.proxy().await;
    let addr = proxy.addr();
    env.create(&proxy, "isb-cut", "tok-cut").await;

    let resp = send(addr, envd_request(addr, "isb-cut", "/files")).await;
    let (got, failed) = read_cut_download(resp, cut).await;
    assert!(failed, "a cut download ended cleanly: {got:?}");
    let text = scrape(proxy.admin_addr()).await;
    assert_one_upstream_error(&text, "envd", "reset");
    proxy.finish().await;
}

/// A control-plane answer the proxy reads itself (the envd token look-up, a create it learns
/// the token from) that stalls after its head is a 504 E5002 at `--upstream-timeout`,
/// counted as a timeout, rather than a wait without end: every request for that sandbox
/// waits on the look-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_answer_stalled_after_its_head_is_a_timeout() {
    let pki = Pki::new();
    let held = Arc::new(Mutex::new(Vec::new()));
    let hold = held.clone();
    let upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let (keep, stall) = tokio::sync::oneshot::channel::<()>();
        hold.lock().unwrap().push(keep);
        async move {
            Response::new(boxed(AbortingBody {
                first: Some(Bytes::from_static(b"{\"sandboxID\":")),
                die: stall,
            }))
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--upstream-timeout", "1s"])
        .spawn()
        .await;
    let addr = proxy.addr();
    for (what, req) in [
        ("the look-up", envd_request(addr, "isb-stall", "/health")),
        (
            "the create",
            request("POST", addr, "/sandboxes")
                .body(full("{}"))
                .unwrap(),
        ),
    ] {
        let resp = send(addr, req).await;
        let status = resp.status();
        let code = resp.headers().get("x-abx-error").cloned();
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{what}");
        assert_eq!(
            code.as_ref().map(|v| v.as_bytes()),
            Some(&b"E5002"[..]),
            "{what}"
        );
    }
    let text = scrape(proxy.admin_addr()).await;
    let timeouts = r#"abx_proxy_upstream_errors_total{plane="api",kind="timeout"}"#;
    assert_eq!(metric(&text, timeouts), Some(2.0), "{text}");
    assert_eq!(held.lock().unwrap().len(), 2, "both reached the upstream");
    proxy.finish().await;
}
