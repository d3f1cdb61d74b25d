//! A fake OpenSandbox server for end-to-end tests: one plain-HTTP listener on 127.0.0.1
//! serving the lifecycle API the `opensandbox` SDKs call under `/v1` (the SDK appends
//! `/v1` to its domain itself), plus a tiny "execd" (the in-sandbox daemon) under
//! `/execd/<sandbox-id>/<port>` that the endpoints it hands out point at.
//!
//! ```text
//! fake_opensandbox [--port 0] [--expect-key KEY] [--forbid-key KEY]... [--no-auth-check]
//!                  [--stdin-lifeline]
//! ```
//!
//! On startup it prints one JSON line, `{"url":"http://127.0.0.1:PORT"}`.
//! `GET /__fake/report` returns
//! `{"requests": N, "routes": {"api POST /v1/sandboxes": 1, …}, "violations": […], "log": […]}`
//! (`requests` counts every request except the report itself).
//!
//! Lifecycle API (`/v1/…`), checked unless `--no-auth-check`: exactly one
//! `OPEN-SANDBOX-API-KEY` header, equal to `--expect-key`; no `Authorization`; no
//! `X-API-Key`. Execd (`/execd/…`) is reached by the SDK directly, not through a proxy,
//! and the SDK promises never to send the key there in its default (direct) mode: no
//! `OPEN-SANDBOX-API-KEY`, `Authorization` or `X-API-Key` header at all. Always, on both:
//! no `--forbid-key` (nor, on execd, `--expect-key`) in any header value or in the query
//! string, and `Host` is this listener's own authority. A violation is recorded and the
//! request is answered 401 in OpenSandbox's error shape, so the SDK fails too.
//!
//! Endpoints implemented (as the `opensandbox` 1.1.x SDK's generated client expects):
//! `POST /v1/sandboxes` → 202 `CreateSandboxResponse`; `GET /v1/sandboxes/{id}` → 200
//! `Sandbox`; `DELETE /v1/sandboxes/{id}` → 204; `GET /v1/sandboxes/{id}/endpoints/{port}`
//! → 200 `Endpoint` (`{"endpoint": "127.0.0.1:PORT/execd/{id}/{port}"}`); `POST
//! /v1/metrics/events` → 204 (the SDK's fire-and-forget `sandbox.create` report);
//! `GET /execd/{id}/{port}/ping` → 200 (the SDK's readiness probe). Unknown sandboxes get
//! 404 `{"code": "SANDBOX::NOT_FOUND", "message": …}`.

// Handlers answer errors as `Err(Response)`; the size does not matter in a test fake.
#![allow(clippy::result_large_err)]

#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use support::{empty, json_response, Body, Locked, Tally};

/// The SDK's credential header (`OPEN-SANDBOX-API-KEY`), as hyper stores names.
const KEY_HEADER: &str = "open-sandbox-api-key";
/// Ports the SDK asks endpoints for during create: execd and the egress sidecar.
const EXECD_PORT: u16 = 44772;
const EGRESS_PORT: u16 = 18080;
const MAX_BODY: usize = 1 << 20;

#[derive(Clone, Debug)]
struct Args {
    common: support::Common,
    port: u16,
    forbid_keys: Vec<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: fake_opensandbox [--port N] [--expect-key KEY] [--forbid-key KEY]... \
         [--no-auth-check] [--stdin-lifeline]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut port = 0;
    let mut forbid_keys = Vec::new();
    let common = support::Options::parse("fake_opensandbox", usage, |name, opts| {
        match name {
            "--port" => port = opts.port(),
            "--forbid-key" => {
                let k = opts.value();
                if k.is_empty() {
                    opts.fail("--forbid-key needs a non-empty value")
                }
                forbid_keys.push(k)
            }
            _ => return false,
        }
        true
    });
    Args {
        common,
        port,
        forbid_keys,
    }
}

#[derive(Debug)]
struct Sandbox {
    image: Value,
    entrypoint: Value,
    metadata: Value,
    created_at: String,
    expires_at: Option<String>,
    alive: bool,
}

#[derive(Default)]
struct Inner {
    tally: Tally,
    sandboxes: HashMap<String, Sandbox>,
}

struct State {
    args: Args,
    authority: String,
    inner: Locked<Inner>,
}

impl State {
    fn alive(&self, id: &str) -> bool {
        self.inner.lock().sandboxes.get(id).is_some_and(|s| s.alive)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Plane {
    Api,
    Execd,
}

impl Plane {
    fn name(self) -> &'static str {
        match self {
            Plane::Api => "api",
            Plane::Execd => "execd",
        }
    }
}

fn main() {
    support::main("fake_opensandbox", run(parse_args()));
}

async fn run(args: Args) -> std::io::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", args.port)).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(State {
        authority: addr.to_string(),
        args: args.clone(),
        inner: Locked::new(Inner::default()),
    });
    support::started(
        &json!({"url": format!("http://{addr}")}),
        args.common.stdin_lifeline,
    )?;
    support::serve(listener, "fake_opensandbox", None, move |req| {
        let state = state.clone();
        async move { handle(req, &state).await }
    })
    .await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// helpers

/// OpenSandbox's `ErrorResponse`: `{"code": "<DOMAIN::CODE>", "message": "…"}`.
fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    json_response(status, &json!({"code": code, "message": message}))
}

fn now_rfc3339(offset_secs: i64) -> String {
    let t = time::OffsetDateTime::now_utc() + time::Duration::seconds(offset_secs);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

/// Every check on the request head; returns the violations found (empty = fine).
fn check_head(req: &Request<Incoming>, plane: Plane, state: &State) -> Vec<String> {
    let args = &state.args;
    let mut bad = Vec::new();
    let what = format!("{} {} {}", plane.name(), req.method(), req.uri().path());
    let headers = req.headers();

    // Never: a forbidden key anywhere in a header value or in the query string.
    let mut secrets: Vec<(&str, &str)> = args
        .forbid_keys
        .iter()
        .map(|k| ("the forbidden key (--forbid-key)", k.as_str()))
        .collect();
    if plane == Plane::Execd {
        if let Some(k) = args.common.expect_key.as_deref().filter(|k| !k.is_empty()) {
            secrets.push(("the real key (--expect-key)", k));
        }
    }
    for (label, secret) in &secrets {
        for (name, value) in headers {
            if String::from_utf8_lossy(value.as_bytes()).contains(secret) {
                bad.push(format!("{what}: {label} in header {name}"));
            }
        }
        if req.uri().query().is_some_and(|q| q.contains(secret)) {
            bad.push(format!("{what}: {label} in the query string"));
        }
    }

    // Host must be this listener's (a proxy sets the upstream's Host).
    match headers.get(hyper::header::HOST) {
        Some(h) if h.as_bytes() == state.authority.as_bytes() => {}
        Some(h) => bad.push(format!(
            "{what}: Host is {:?}, expected {:?}",
            String::from_utf8_lossy(h.as_bytes()),
            state.authority
        )),
        // HTTP/2 carries the authority in the URI instead.
        None if req.uri().authority().map(|a| a.as_str()) == Some(state.authority.as_str()) => {}
        None => bad.push(format!("{what}: no Host header")),
    }

    if args.common.no_auth_check {
        return bad;
    }
    if headers.contains_key(hyper::header::AUTHORIZATION) {
        bad.push(format!("{what}: an Authorization header arrived"));
    }
    if headers.contains_key("x-api-key") {
        bad.push(format!("{what}: an X-API-Key header arrived"));
    }
    let keys: Vec<_> = headers.get_all(KEY_HEADER).iter().collect();
    match plane {
        Plane::Api => {
            let expect = args.common.expect_key.as_deref().unwrap_or("");
            match keys.as_slice() {
                [] => bad.push(format!("{what}: no OPEN-SANDBOX-API-KEY header")),
                [one] if one.as_bytes() == expect.as_bytes() => {}
                [_] => bad.push(format!(
                    "{what}: OPEN-SANDBOX-API-KEY is not the expected key (--expect-key)"
                )),
                many => bad.push(format!(
                    "{what}: {} OPEN-SANDBOX-API-KEY headers (expected exactly one)",
                    many.len()
                )),
            }
        }
        Plane::Execd => {
            if !keys.is_empty() {
                bad.push(format!(
                    "{what}: OPEN-SANDBOX-API-KEY sent to execd (the SDK must not send the key \
                     into the sandbox in direct mode)"
                ));
            }
        }
    }
    bad
}

async fn read_json(req: Request<Incoming>) -> Result<Value, String> {
    let body = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| format!("cannot read the body: {e}"))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| format!("body is not JSON: {e}"))
}

// ---------------------------------------------------------------------------------------
// routing

async fn handle(req: Request<Incoming>, state: &State) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();

    if method == Method::GET && path == "/__fake/report" {
        return state.inner.lock().tally.report();
    }

    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let plane = if segs.first() == Some(&"execd") {
        Plane::Execd
    } else {
        Plane::Api
    };
    let route = route_name(&method, &segs, plane);
    let bad = check_head(&req, plane, state);
    let key_headers = req.headers().get_all(KEY_HEADER).iter().count();
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    {
        let mut inner = state.inner.lock();
        inner.tally.count(&route);
        inner.tally.violations.extend(bad.iter().cloned());
    }

    let resp = if !bad.is_empty() {
        error(
            StatusCode::UNAUTHORIZED,
            "FAKE::AUTH_CHECK_FAILED",
            &bad.join("; "),
        )
    } else {
        match dispatch(req, &method, &segs, plane, state).await {
            Ok(r) => r,
            Err(r) => r,
        }
    };

    let mut inner = state.inner.lock();
    inner.tally.log.push(json!({
        "plane": plane.name(),
        "method": method.as_str(),
        "path": path,
        "route": route,
        "status": resp.status().as_u16(),
        "key_headers": key_headers,
        "host": host,
    }));
    resp
}

/// A stable name for the report: ids and ports replaced by `{id}` / `{port}`.
fn route_name(method: &Method, segs: &[&str], plane: Plane) -> String {
    let shape: Vec<String> = match plane {
        Plane::Execd => segs
            .iter()
            .skip(3) // execd/{id}/{port}
            .map(|s| s.to_string())
            .collect(),
        Plane::Api => segs
            .iter()
            .enumerate()
            .map(|(i, s)| match (i, segs.first(), segs.get(1)) {
                (2, Some(&"v1"), Some(&"sandboxes")) => "{id}".to_string(),
                (4, Some(&"v1"), Some(&"sandboxes")) if segs.get(3) == Some(&"endpoints") => {
                    "{port}".to_string()
                }
                _ => s.to_string(),
            })
            .collect(),
    };
    format!("{} {method} /{}", plane.name(), shape.join("/"))
}

async fn dispatch(
    req: Request<Incoming>,
    method: &Method,
    segs: &[&str],
    plane: Plane,
    state: &State,
) -> Result<Response<Body>, Response<Body>> {
    match (plane, method, segs) {
        (Plane::Api, &Method::POST, ["v1", "sandboxes"]) => create(req, state).await,
        (Plane::Api, &Method::GET, ["v1", "sandboxes", id]) => get(id, state),
        (Plane::Api, &Method::DELETE, ["v1", "sandboxes", id]) => delete(id, state),
        (Plane::Api, &Method::GET, ["v1", "sandboxes", id, "endpoints", port]) => {
            endpoint(id, port, req.uri().query(), state)
        }
        (Plane::Api, &Method::POST, ["v1", "metrics", "events"]) => metrics(req, state).await,
        (Plane::Execd, &Method::GET, ["execd", id, port, "ping"]) => ping(id, port, state),
        _ => {
            let msg = format!("unexpected request {method} /{}", segs.join("/"));
            state.inner.lock().tally.violations.push(msg.clone());
            Err(error(StatusCode::NOT_FOUND, "FAKE::NO_ROUTE", &msg))
        }
    }
}

fn not_found(id: &str) -> Response<Body> {
    error(
        StatusCode::NOT_FOUND,
        "SANDBOX::NOT_FOUND",
        &format!("sandbox {id} not found"),
    )
}

fn bad_request(state: &State, what: &str, msg: String) -> Response<Body> {
    let msg = format!("{what}: {msg}");
    state.inner.lock().tally.violations.push(msg.clone());
    error(StatusCode::BAD_REQUEST, "SANDBOX::INVALID_PARAMETER", &msg)
}

async fn create(req: Request<Incoming>, state: &State) -> Result<Response<Body>, Response<Body>> {
    const WHAT: &str = "api POST /v1/sandboxes";
    let ct_json = req
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let body = read_json(req)
        .await
        .map_err(|e| bad_request(state, WHAT, e))?;
    if !ct_json {
        return Err(bad_request(
            state,
            WHAT,
            "Content-Type is not application/json".into(),
        ));
    }
    let image = body.get("image").cloned().unwrap_or(Value::Null);
    if image
        .get("uri")
        .and_then(Value::as_str)
        .unwrap_or("")
        .is_empty()
        && body.get("snapshotId").and_then(Value::as_str).is_none()
    {
        return Err(bad_request(
            state,
            WHAT,
            format!("no image.uri or snapshotId in {body}"),
        ));
    }
    let entrypoint = body.get("entrypoint").cloned().unwrap_or(Value::Null);
    if entrypoint.as_array().is_none_or(|a| a.is_empty()) {
        return Err(bad_request(
            state,
            WHAT,
            format!("entrypoint is not a non-empty list: {body}"),
        ));
    }
    let metadata = body.get("metadata").cloned().unwrap_or_else(|| json!({}));
    let expires_at = body.get("timeout").and_then(Value::as_i64).map(now_rfc3339);
    let id = format!("osb-{}", uuid::Uuid::new_v4().simple());
    let created_at = now_rfc3339(0);
    let mut resp = json!({
        "id": id,
        "status": {"state": "Pending", "reason": "ContainerCreating", "lastTransitionAt": created_at},
        "createdAt": created_at,
        "entrypoint": entrypoint,
        "metadata": metadata,
    });
    if let Some(e) = &expires_at {
        resp["expiresAt"] = json!(e);
    }
    state.inner.lock().sandboxes.insert(
        id,
        Sandbox {
            image,
            entrypoint,
            metadata,
            created_at,
            expires_at,
            alive: true,
        },
    );
    Ok(json_response(StatusCode::ACCEPTED, &resp))
}

fn get(id: &str, state: &State) -> Result<Response<Body>, Response<Body>> {
    let inner = state.inner.lock();
    let sb = inner
        .sandboxes
        .get(id)
        .filter(|s| s.alive)
        .ok_or_else(|| not_found(id))?;
    let mut v = json!({
        "id": id,
        "status": {"state": "Running", "reason": "Started", "lastTransitionAt": sb.created_at},
        "entrypoint": sb.entrypoint,
        "createdAt": sb.created_at,
        "metadata": sb.metadata,
    });
    if !sb.image.is_null() {
        v["image"] = sb.image.clone();
    }
    if let Some(e) = &sb.expires_at {
        v["expiresAt"] = json!(e);
    }
    Ok(json_response(StatusCode::OK, &v))
}

fn delete(id: &str, state: &State) -> Result<Response<Body>, Response<Body>> {
    let mut inner = state.inner.lock();
    match inner.sandboxes.get_mut(id).filter(|s| s.alive) {
        Some(sb) => {
            sb.alive = false;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        None => Err(not_found(id)),
    }
}

fn endpoint(
    id: &str,
    port: &str,
    query: Option<&str>,
    state: &State,
) -> Result<Response<Body>, Response<Body>> {
    const WHAT: &str = "api GET /v1/sandboxes/{id}/endpoints/{port}";
    let port: u16 = port
        .parse()
        .map_err(|_| bad_request(state, WHAT, format!("port {port:?} is not a number")))?;
    if port != EXECD_PORT && port != EGRESS_PORT {
        return Err(bad_request(state, WHAT, format!("unexpected port {port}")));
    }
    // Direct mode (the SDK default) sends `use_server_proxy=false`; the fake only
    // implements that mode, where the endpoint is the sandbox's own address.
    if query.is_some_and(|q| q.split('&').any(|kv| kv == "use_server_proxy=true")) {
        return Err(bad_request(
            state,
            WHAT,
            "use_server_proxy=true is not implemented".into(),
        ));
    }
    if !state.alive(id) {
        return Err(not_found(id));
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"endpoint": format!("{}/execd/{id}/{port}", state.authority)}),
    ))
}

async fn metrics(req: Request<Incoming>, state: &State) -> Result<Response<Body>, Response<Body>> {
    const WHAT: &str = "api POST /v1/metrics/events";
    let body = read_json(req)
        .await
        .map_err(|e| bad_request(state, WHAT, e))?;
    if body.get("eventType").and_then(Value::as_str).is_none() {
        return Err(bad_request(state, WHAT, format!("no eventType in {body}")));
    }
    Ok(empty(StatusCode::NO_CONTENT))
}

fn ping(id: &str, port: &str, state: &State) -> Result<Response<Body>, Response<Body>> {
    if port != EXECD_PORT.to_string() {
        let msg = format!("execd ping on port {port}, expected {EXECD_PORT}");
        state.inner.lock().tally.violations.push(msg.clone());
        return Err(error(StatusCode::NOT_FOUND, "FAKE::NO_ROUTE", &msg));
    }
    if !state.alive(id) {
        return Err(not_found(id));
    }
    Ok(empty(StatusCode::OK))
}
