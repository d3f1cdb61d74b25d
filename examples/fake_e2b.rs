//! A fake E2B cloud for end-to-end tests: one process, two plain-HTTP listeners on
//! 127.0.0.1 — the control plane (`/sandboxes`, `/v2/sandboxes`, …) and envd (the
//! in-sandbox daemon, reached the way the SDKs reach it with `E2B_SANDBOX_URL`: one URL,
//! routed by the `E2b-Sandbox-Id` header).
//!
//! ```text
//! fake_e2b [--api-port 0] [--envd-port 0] [--expect-key KEY] [--dummy-key dummy-key]
//!          [--no-auth-check] [--envd-version 0.5.7] [--tls-ca-out PATH] [--stdin-lifeline]
//!          [--key-in-x-api-key] [--forbid KEY]...
//! ```
//!
//! On startup it prints one JSON line, `{"api":"http://127.0.0.1:X","envd":"http://127.0.0.1:Y"}`.
//!
//! With `--tls-ca-out PATH` both listeners also take TLS (as the real cloud does: the
//! control plane offering HTTP/2, envd as `https://{port}-{id}.{domain}`), with a
//! certificate for `127.0.0.1` and `*.sandbox.localhost` from a CA written to PATH; the
//! start-up line adds `"tls_api":"https://127.0.0.1:X"` and
//! `"sandbox_domain":"sandbox.localhost:Y"` (`*.localhost` is loopback: RFC 6761), each
//! log entry says whether its request came over TLS, and envd also accepts the Host
//! `{port}-{id}.sandbox.localhost:Y`.
//! Every request is checked; a violation is recorded and answered with an error so the SDK
//! fails too. `GET /__fake/report` on the api port returns
//! `{"requests": N, "routes": {"api POST /sandboxes": 1, …}, "violations": […], "log": […]}`.
//!
//! Control-plane checks (off with `--no-auth-check`): `Authorization: Bearer <expect-key>`,
//! no `X-API-Key` header, the dummy key in no header; with `--key-in-x-api-key` (E2B's own
//! cloud, as the `deploy/providers/e2b` plugin reaches it) one `X-API-Key: <expect-key>`
//! and no `Authorization` instead. Every `--forbid KEY` (another provider's key, say) must
//! appear in no header of either plane. Envd checks (always): `X-Access-Token`
//! equal to the token issued for the sandbox named by `E2b-Sandbox-Id`, `E2b-Sandbox-Port`
//! present, `Authorization` (if any) only `Basic`, the real key in no header. Both planes:
//! `Host` is the listener's own authority.
//!
//! The envd listener also plays the code interpreter of E2B's `code-interpreter-v1`
//! template (`E2b-Sandbox-Port: 49999`): `/execute` streams NDJSON as its server does
//! (`print('…')` lines and a last `a + b` line are understood; at a `wait_until_seen()`
//! line the stream pauses until the client makes a context, at most 20 s: a client that
//! does so on seeing the output before it proves that output was streamed to it, not held
//! until the end), `/contexts…` keep a list beside the two default contexts. Its checks: a
//! sent `X-Access-Token` is the sandbox's (the SDKs send it with `/execute` only), and a
//! sandbox created with `network.allowPublicTraffic: false` (which gets a
//! `trafficAccessToken`) is reached with its `E2B-Traffic-Access-Token`, as E2B's edge asks
//! on every port but envd's; either one twice is refused (the SDKs send one: a second would
//! be a token the proxy added; E2B's server would read the first). Log entries of envd
//! requests say whether a token came.
//!
//! Volumes (`/volumes…` on the control plane) and their contents (`/volumecontent/{id}/…`,
//! on the same listener, as E2B serves them beside its API): a volume's contents are
//! reached with `Authorization: Bearer <the volume's token>` (from its create), exactly
//! one, and no key, real or dummy, in any header.

#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use support::{empty, full, json_response, Body, Locked, Tally};

/// Default port of envd inside a sandbox; the SDKs send it as `E2b-Sandbox-Port`.
const ENVD_PORT: &str = "49983";
/// Port of the code interpreter's server in E2B's `code-interpreter-v1` template.
const JUPYTER_PORT: &str = "49999";

#[derive(Clone, Debug)]
struct Args {
    common: support::Common,
    api_port: u16,
    envd_port: u16,
    dummy_key: String,
    envd_version: String,
    tls_ca_out: Option<String>,
    /// `--key-in-x-api-key`: the control plane's key comes as `X-API-Key`.
    key_in_x_api_key: bool,
    /// `--forbid KEY`, any number: values no request may carry in any header.
    forbidden: Vec<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: fake_e2b [--api-port N] [--envd-port N] [--expect-key KEY] [--dummy-key KEY] \
         [--no-auth-check] [--envd-version V] [--tls-ca-out PATH] [--stdin-lifeline] \
         [--key-in-x-api-key] [--forbid KEY]..."
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let (mut api_port, mut envd_port) = (0, 0);
    let mut dummy_key = "dummy-key".to_string();
    let mut envd_version = "0.5.7".to_string();
    let mut tls_ca_out = None;
    let mut key_in_x_api_key = false;
    let mut forbidden = Vec::new();
    let common = support::Options::parse("fake_e2b", usage, |name, opts| {
        match name {
            "--api-port" => api_port = opts.port(),
            "--envd-port" => envd_port = opts.port(),
            "--dummy-key" => dummy_key = opts.value(),
            "--envd-version" => envd_version = opts.value(),
            "--tls-ca-out" => tls_ca_out = Some(opts.value()),
            "--key-in-x-api-key" => key_in_x_api_key = true,
            "--forbid" => {
                // An empty one would be in every header (and `windows(0)` panics).
                let key = opts.value();
                if key.is_empty() {
                    usage();
                }
                forbidden.push(key);
            }
            _ => return false,
        }
        true
    });
    Args {
        common,
        api_port,
        envd_port,
        dummy_key,
        envd_version,
        tls_ca_out,
        key_in_x_api_key,
        forbidden,
    }
}

/// The sandbox domain of TLS mode: two labels, as webpki (like browsers) honours a
/// wildcard only above two labels, so `*.sandbox.localhost` covers every sandbox host.
const SANDBOX_DOMAIN: &str = "sandbox.localhost";

#[derive(Debug)]
struct Sandbox {
    token: String,
    /// Issued when the create asked for no public traffic (`allowPublicTraffic: false`).
    traffic_token: Option<String>,
    /// The code interpreter's contexts, by id (`/contexts`), and how many were ever made.
    contexts: Vec<String>,
    contexts_made: tokio::sync::watch::Sender<u64>,
    executions: u64,
    template_id: String,
    metadata: Value,
    timeout: u64,
    alive: bool,
    files: HashMap<String, Vec<u8>>,
}

#[derive(Debug)]
struct Volume {
    name: String,
    token: String,
    files: HashMap<String, Vec<u8>>,
}

#[derive(Default)]
struct Inner {
    tally: Tally,
    sandboxes: HashMap<String, Sandbox>,
    volumes: HashMap<String, Volume>,
    next_pid: u32,
}

struct State {
    args: Args,
    api_authority: String,
    envd_authority: String,
    inner: Locked<Inner>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Plane {
    Api,
    Envd,
}

impl Plane {
    fn name(self) -> &'static str {
        match self {
            Plane::Api => "api",
            Plane::Envd => "envd",
        }
    }
}

fn main() {
    support::main("fake_e2b", run(parse_args()));
}

async fn run(args: Args) -> std::io::Result<()> {
    let api = TcpListener::bind(("127.0.0.1", args.api_port)).await?;
    let envd = TcpListener::bind(("127.0.0.1", args.envd_port)).await?;
    let api_addr = api.local_addr()?;
    let envd_addr = envd.local_addr()?;
    let tls = match &args.tls_ca_out {
        Some(path) => {
            let names = ["127.0.0.1".to_string(), format!("*.{SANDBOX_DOMAIN}")];
            let (acceptor, ca) = support::tls_acceptor(&names).map_err(std::io::Error::other)?;
            std::fs::write(path, ca)?;
            Some(acceptor)
        }
        None => None,
    };
    let state = Arc::new(State {
        api_authority: api_addr.to_string(),
        envd_authority: envd_addr.to_string(),
        args: args.clone(),
        inner: Locked::new(Inner {
            next_pid: 1000,
            ..Inner::default()
        }),
    });
    let mut started =
        json!({"api": format!("http://{api_addr}"), "envd": format!("http://{envd_addr}")});
    if tls.is_some() {
        started["tls_api"] = json!(format!("https://{api_addr}"));
        started["sandbox_domain"] = json!(format!("{SANDBOX_DOMAIN}:{}", envd_addr.port()));
    }
    support::started(&started, args.common.stdin_lifeline)?;
    let a = tokio::spawn(serve(api, Plane::Api, tls.clone(), state.clone()));
    let e = tokio::spawn(serve(envd, Plane::Envd, tls, state));
    let _ = tokio::join!(a, e);
    Ok(())
}

async fn serve(
    listener: TcpListener,
    plane: Plane,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<State>,
) {
    let what = format!("fake_e2b: {}", plane.name());
    support::serve(listener, &what, tls, move |req| {
        let state = state.clone();
        async move { handle(req, plane, &state).await }
    })
    .await
}

// ---------------------------------------------------------------------------------------
// helpers

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"code": status.as_u16(), "message": message}),
    )
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (percent_decode(k) == name).then(|| percent_decode(v))
    })
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let mut bits = 0u32;
    let mut nbits = 0;
    let mut out = Vec::new();
    for c in s.trim_end_matches('=').bytes() {
        let v = B64.iter().position(|&x| x == c)? as u32;
        bits = (bits << 6) | v;
        nbits += 6;
        if nbits >= 8 {
            nbits -= 8;
            out.push((bits >> nbits) as u8);
        }
    }
    Some(out)
}

/// The sandbox user selected by `Authorization: Basic base64(user:)`, as envd reads it.
fn basic_user(h: &HeaderMap) -> Option<String> {
    let v = header(h, "authorization")?;
    let enc = v.strip_prefix("Basic ")?;
    let dec = String::from_utf8(b64_decode(enc.trim())?).ok()?;
    Some(dec.split(':').next().unwrap_or("").to_string())
}

/// One Connect envelope: flags byte, u32 big-endian length, payload.
fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(5 + payload.len());
    v.push(flags);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    Bytes::from(v)
}

fn first_envelope(body: &[u8]) -> Option<(u8, &[u8])> {
    if body.len() < 5 {
        return None;
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    body.get(5..5 + len).map(|p| (body[0], p))
}

fn new_sandbox_id() -> String {
    format!("isb-{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

fn sandbox_json(id: &str, sb: &Sandbox, envd_version: &str) -> Value {
    json!({
        "templateID": sb.template_id,
        "sandboxID": id,
        "alias": sb.template_id,
        "clientID": "fake-client",
        "envdVersion": envd_version,
        "envdAccessToken": sb.token,
        "trafficAccessToken": sb.traffic_token,
        "domain": Value::Null,
    })
}

fn sandbox_detail_json(id: &str, sb: &Sandbox, envd_version: &str) -> Value {
    json!({
        "templateID": sb.template_id,
        "sandboxID": id,
        "alias": sb.template_id,
        "clientID": "fake-client",
        "startedAt": "2025-01-01T00:00:00Z",
        "endAt": "2025-01-01T01:00:00Z",
        "envdVersion": envd_version,
        "envdAccessToken": sb.token,
        "domain": Value::Null,
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": 1024,
        "state": "running",
        "metadata": sb.metadata,
        "timeout": sb.timeout,
    })
}

// ---------------------------------------------------------------------------------------
// dispatch

async fn handle(req: Request<Incoming>, plane: Plane, state: &State) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let method = parts.method.clone();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().map(str::to_string);

    if plane == Plane::Api && path == "/__fake/report" {
        return state.inner.lock().tally.report();
    }

    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let msg = format!(
                "{} {method} {path}: reading the body failed: {e}",
                plane.name()
            );
            state.inner.lock().tally.violations.push(msg.clone());
            return error(StatusCode::BAD_REQUEST, &msg);
        }
    };

    let route = route_name(plane, &method, &path, &parts.headers);
    let mut violations = check_common(plane, &parts.uri, &parts.headers, state);
    let resp = if let Some(v) = match plane {
        Plane::Api if path.starts_with("/volumecontent/") => {
            check_volume(&parts.headers, &path, state)
        }
        Plane::Api => check_api(&parts.headers, state),
        Plane::Envd => check_envd(&parts.headers, &path, state),
    } {
        violations.push(v.1.clone());
        error(v.0, &v.1)
    } else {
        match plane {
            Plane::Api => api(&method, &path, query.as_deref(), &body, state),
            Plane::Envd => envd(
                &method,
                &path,
                query.as_deref(),
                &parts.headers,
                &body,
                state,
            ),
        }
    };
    if resp.status() == StatusCode::NOT_FOUND && route.ends_with("(unknown)") {
        violations.push(format!("{} unexpected route {method} {path}", plane.name()));
    }

    let mut inner = state.inner.lock();
    inner.tally.count(&route);
    let mut entry = json!({
        "plane": plane.name(),
        "method": method.as_str(),
        "path": path,
        "route": route,
        "status": resp.status().as_u16(),
        "version": format!("{:?}", parts.version),
        "tls": parts.extensions.get::<support::OverTls>().is_some(),
    });
    if route.ends_with("POST /sandboxes") || route.ends_with("POST /v2/sandboxes") {
        let secure = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("secure").cloned())
            .unwrap_or(Value::Null);
        entry["secure"] = secure;
    }
    if let Some(a) = header(&parts.headers, "authorization").filter(|a| a.starts_with("Basic ")) {
        entry["basic"] = Value::String(a.to_string());
    }
    if plane == Plane::Envd {
        entry["token"] = Value::Bool(parts.headers.contains_key("x-access-token"));
    }
    for v in &violations {
        eprintln!("fake_e2b: VIOLATION: {v}");
    }
    inner.tally.violations.extend(violations);
    inner.tally.log.push(entry);
    resp
}

/// Route names for the report: the method and the path with the sandbox id replaced; the
/// code interpreter's requests are named `jupyter …`.
fn route_name(plane: Plane, method: &Method, path: &str, h: &HeaderMap) -> String {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    if plane == Plane::Envd && header(h, "e2b-sandbox-port") == Some(JUPYTER_PORT) {
        let shape = match segs.as_slice() {
            ["execute" | "contexts" | "health"] => path.to_string(),
            ["contexts", _] => "/contexts/{id}".to_string(),
            ["contexts", _, "restart"] => "/contexts/{id}/restart".to_string(),
            _ => return format!("jupyter {method} (unknown)"),
        };
        return format!("jupyter {method} {shape}");
    }
    let shape = match (plane, segs.as_slice()) {
        (Plane::Api, ["sandboxes"]) => "/sandboxes".to_string(),
        (Plane::Api, ["v2", "sandboxes"]) => "/v2/sandboxes".to_string(),
        (Plane::Api, ["sandboxes", _]) => "/sandboxes/{id}".to_string(),
        (Plane::Api, ["sandboxes", _, rest]) => format!("/sandboxes/{{id}}/{rest}"),
        (Plane::Api, ["v2", "sandboxes", _, rest]) => format!("/v2/sandboxes/{{id}}/{rest}"),
        (Plane::Api, ["volumes"]) => "/volumes".to_string(),
        (Plane::Api, ["volumes", _]) => "/volumes/{id}".to_string(),
        (Plane::Api, ["volumecontent", _, rest]) => format!("/volumecontent/{{id}}/{rest}"),
        (Plane::Envd, ["files" | "health" | "process.Process" | "filesystem.Filesystem", ..]) => {
            path.to_string()
        }
        _ => return format!("{} {method} (unknown)", plane.name()),
    };
    format!("{} {method} {shape}", plane.name())
}

fn check_common(plane: Plane, uri: &hyper::Uri, h: &HeaderMap, state: &State) -> Vec<String> {
    let mut v: Vec<String> = (state.args.forbidden.iter())
        .filter(|key| carries(h, key))
        .map(|_| {
            format!(
                "{}: a forbidden key appears in a request header",
                plane.name()
            )
        })
        .collect();
    let own = match plane {
        Plane::Api => &state.api_authority,
        Plane::Envd => &state.envd_authority,
    };
    // `sandbox_domain` mode names the sandbox in the host, as the real envd is reached.
    let named = match (
        plane,
        header(h, "e2b-sandbox-id"),
        header(h, "e2b-sandbox-port"),
    ) {
        (Plane::Envd, Some(id), Some(port)) if state.args.tls_ca_out.is_some() => {
            let own_port = own.rsplit(':').next().unwrap_or_default();
            Some(format!("{port}-{id}.{SANDBOX_DOMAIN}:{own_port}"))
        }
        _ => None,
    };
    // HTTP/2 carries the authority in the URI instead of a Host header.
    match header(h, "host").or_else(|| uri.authority().map(|a| a.as_str())) {
        Some(host) if host == own || Some(host) == named.as_deref() => {}
        other => v.push(format!(
            "{}: Host is {other:?}, expected the upstream's own {own:?}",
            plane.name()
        )),
    }
    v
}

/// Control-plane credential checks; `Some((status, message))` on a violation.
fn check_api(h: &HeaderMap, state: &State) -> Option<(StatusCode, String)> {
    let a = &state.args;
    if a.common.no_auth_check {
        return None;
    }
    let dummy = || {
        (!a.dummy_key.is_empty() && carries(h, &a.dummy_key)).then(|| {
            (
                StatusCode::UNAUTHORIZED,
                "api: the dummy key appears in a request header".to_string(),
            )
        })
    };
    if a.key_in_x_api_key {
        return dummy().or_else(|| check_x_api_key(h, a));
    }
    if h.contains_key("x-api-key") {
        return Some((
            StatusCode::UNAUTHORIZED,
            "api: request carries an X-API-Key header (client credential leaked upstream)".into(),
        ));
    }
    if let Some(v) = dummy() {
        return Some(v);
    }
    let expected = format!("Bearer {}", a.common.expect_key.as_deref().unwrap_or(""));
    let auths: Vec<_> = h.get_all("authorization").iter().collect();
    if auths.len() != 1 || auths[0].as_bytes() != expected.as_bytes() {
        return Some((
            StatusCode::UNAUTHORIZED,
            format!(
                "api: expected exactly one `Authorization: Bearer <expected key>`, got {} Authorization header(s){}",
                auths.len(),
                if auths.iter().any(|v| v.as_bytes().starts_with(b"Bearer ")) {
                    " (Bearer with a wrong key)"
                } else {
                    ""
                }
            ),
        ));
    }
    None
}

/// Whether any header value holds `key`.
fn carries(h: &HeaderMap, key: &str) -> bool {
    h.values()
        .any(|v| (v.as_bytes().windows(key.len())).any(|w| w == key.as_bytes()))
}

/// E2B's own cloud's control-plane key: one `X-API-Key` with the expected key, no
/// `Authorization` (the client's Bearer or the built-in provider's), no dummy key.
fn check_x_api_key(h: &HeaderMap, a: &Args) -> Option<(StatusCode, String)> {
    let expected = a.common.expect_key.as_deref().unwrap_or("");
    let keys: Vec<_> = h.get_all("x-api-key").iter().collect();
    let violation = if keys.len() != 1 || keys[0].as_bytes() != expected.as_bytes() {
        format!(
            "api: expected exactly one `X-API-Key: <expected key>`, got {} X-API-Key header(s)",
            keys.len()
        )
    } else if h.contains_key("authorization") {
        "api: an Authorization header beside X-API-Key".to_string()
    } else {
        return None;
    };
    Some((StatusCode::UNAUTHORIZED, violation))
}

/// Volume-content checks: the volume's own token, once, and no key of any kind.
fn check_volume(h: &HeaderMap, path: &str, state: &State) -> Option<(StatusCode, String)> {
    let a = &state.args;
    let keys = [a.common.expect_key.as_deref().unwrap_or(""), &a.dummy_key];
    for key in keys.iter().filter(|k| !k.is_empty()) {
        if h.values()
            .any(|v| v.as_bytes().windows(key.len()).any(|w| w == key.as_bytes()))
        {
            return Some((
                StatusCode::UNAUTHORIZED,
                "volume: an API key (real or dummy) appears in a volume-content request header"
                    .into(),
            ));
        }
    }
    if h.contains_key("x-api-key") {
        return Some((
            StatusCode::UNAUTHORIZED,
            "volume: request carries an X-API-Key header".into(),
        ));
    }
    let id = path.split('/').nth(2).unwrap_or_default();
    let expected = match state.inner.lock().volumes.get(id) {
        Some(v) => format!("Bearer {}", v.token),
        None => return Some((StatusCode::NOT_FOUND, format!("volume {id} not found"))),
    };
    let auths: Vec<_> = h.get_all("authorization").iter().collect();
    if auths.len() != 1 || auths[0].as_bytes() != expected.as_bytes() {
        return Some((
            StatusCode::UNAUTHORIZED,
            format!(
                "volume: expected exactly one `Authorization: Bearer <the volume's token>`, got {} \
                 Authorization header(s)",
                auths.len()
            ),
        ));
    }
    None
}

/// envd checks (and the code interpreter's); `Some((status, message))` on a violation.
fn check_envd(h: &HeaderMap, path: &str, state: &State) -> Option<(StatusCode, String)> {
    let a = &state.args;
    if let Some(key) = a.common.expect_key.as_deref().filter(|k| !k.is_empty()) {
        if h.values()
            .any(|v| v.as_bytes().windows(key.len()).any(|w| w == key.as_bytes()))
        {
            return Some((
                StatusCode::UNAUTHORIZED,
                "envd: the control-plane API key appears in an envd request header".into(),
            ));
        }
    }
    if !a.common.no_auth_check && h.contains_key("x-api-key") {
        return Some((
            StatusCode::UNAUTHORIZED,
            "envd: request carries an X-API-Key header".into(),
        ));
    }
    if let Some(auth) = header(h, "authorization") {
        if !auth.starts_with("Basic ") {
            return Some((
                StatusCode::UNAUTHORIZED,
                "envd: Authorization header that is not Basic".into(),
            ));
        }
    }
    let Some(id) = header(h, "e2b-sandbox-id") else {
        return Some((
            StatusCode::BAD_REQUEST,
            "envd: no E2b-Sandbox-Id header".into(),
        ));
    };
    let port = header(h, "e2b-sandbox-port");
    if !matches!(port, Some(ENVD_PORT | JUPYTER_PORT)) {
        return Some((
            StatusCode::BAD_REQUEST,
            format!(
                "envd: E2b-Sandbox-Port is {port:?}, expected {ENVD_PORT:?} or {JUPYTER_PORT:?}"
            ),
        ));
    }
    let inner = state.inner.lock();
    let Some(sb) = inner.sandboxes.get(id) else {
        return Some((
            StatusCode::BAD_GATEWAY,
            format!("envd: unknown sandbox {id:?}"),
        ));
    };
    if port == Some(JUPYTER_PORT) {
        return check_jupyter(h, path, id, sb);
    }
    match header(h, "x-access-token") {
        Some(t) if t == sb.token => None,
        Some(_) => Some((
            StatusCode::UNAUTHORIZED,
            format!("envd: X-Access-Token for {id} is not the token issued for it"),
        )),
        None => Some((
            StatusCode::UNAUTHORIZED,
            format!("envd: no X-Access-Token for {id}"),
        )),
    }
}

/// The code interpreter's checks: E2B's edge asks for the traffic token on every port but
/// envd's; its server takes a sent `X-Access-Token` only if it is the sandbox's, and
/// `/execute` comes with one (both SDKs send it there, and only there).
fn check_jupyter(
    h: &HeaderMap,
    path: &str,
    id: &str,
    sb: &Sandbox,
) -> Option<(StatusCode, String)> {
    for name in ["x-access-token", "e2b-traffic-access-token"] {
        if h.get_all(name).iter().count() > 1 {
            return Some((
                StatusCode::UNAUTHORIZED,
                format!("jupyter: more than one {name} for {id}"),
            ));
        }
    }
    if let Some(want) = &sb.traffic_token {
        if header(h, "e2b-traffic-access-token") != Some(want.as_str()) {
            return Some((
                StatusCode::FORBIDDEN,
                format!("jupyter: {id} restricts public traffic and its E2B-Traffic-Access-Token is missing or wrong"),
            ));
        }
    }
    match header(h, "x-access-token") {
        Some(t) if t != sb.token => Some((
            StatusCode::UNAUTHORIZED,
            format!("jupyter: X-Access-Token for {id} is not the token issued for it"),
        )),
        None if path == "/execute" => Some((
            StatusCode::UNAUTHORIZED,
            format!("jupyter: /execute for {id} without X-Access-Token"),
        )),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------
// control plane

fn api(
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: &[u8],
    state: &State,
) -> Response<Body> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let ev = state.args.envd_version.as_str();
    let v2 = segs.first() == Some(&"v2");
    let segs: Vec<&str> = match segs.as_slice() {
        ["v2", "sandboxes", rest @ ..] => std::iter::once("sandboxes")
            .chain(rest.iter().copied())
            .collect(),
        _ => segs,
    };
    let mut inner = state.inner.lock();
    match (method, segs.as_slice()) {
        (&Method::POST, ["sandboxes"]) => {
            let req: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad JSON body: {e}")),
            };
            let id = new_sandbox_id();
            let network = req.get("network");
            let public = network
                .and_then(|n| {
                    n.get("allowPublicTraffic")
                        .or_else(|| n.get("allow_public_traffic"))
                })
                .and_then(Value::as_bool);
            let sb = Sandbox {
                token: format!("envd-tok-{}", uuid::Uuid::new_v4().simple()),
                traffic_token: (public == Some(false))
                    .then(|| format!("traffic-tok-{}", uuid::Uuid::new_v4().simple())),
                contexts: Vec::new(),
                contexts_made: tokio::sync::watch::channel(0).0,
                executions: 0,
                template_id: req
                    .get("templateID")
                    .and_then(Value::as_str)
                    .unwrap_or("base")
                    .to_string(),
                metadata: req.get("metadata").cloned().unwrap_or_else(|| json!({})),
                timeout: req.get("timeout").and_then(Value::as_u64).unwrap_or(300),
                alive: true,
                files: HashMap::new(),
            };
            let resp = sandbox_json(&id, &sb, ev);
            inner.sandboxes.insert(id, sb);
            json_response(StatusCode::CREATED, &resp)
        }
        (&Method::GET, ["sandboxes", id]) => match inner.sandboxes.get(*id).filter(|s| s.alive) {
            Some(sb) => json_response(StatusCode::OK, &sandbox_detail_json(id, sb, ev)),
            None => error(StatusCode::NOT_FOUND, &format!("sandbox {id} not found")),
        },
        (&Method::DELETE, ["sandboxes", id]) => {
            match inner.sandboxes.get_mut(*id).filter(|s| s.alive) {
                Some(sb) => {
                    sb.alive = false;
                    empty(StatusCode::NO_CONTENT)
                }
                None => error(StatusCode::NOT_FOUND, &format!("sandbox {id} not found")),
            }
        }
        (&Method::POST, ["sandboxes", id, "timeout"]) => {
            let t = serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|v| v.get("timeout").and_then(Value::as_u64));
            match (inner.sandboxes.get_mut(*id).filter(|s| s.alive), t) {
                (Some(sb), Some(t)) => {
                    sb.timeout = t;
                    empty(StatusCode::NO_CONTENT)
                }
                (Some(_), None) => error(StatusCode::BAD_REQUEST, "body needs a numeric timeout"),
                (None, _) => error(StatusCode::NOT_FOUND, &format!("sandbox {id} not found")),
            }
        }
        (&Method::POST, ["sandboxes", id, "connect"]) => {
            // The v1 schema (`ConnectSandbox`) requires the timeout; `/v2` defaults it to 300.
            let t = serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|v| v.get("timeout").and_then(Value::as_u64))
                .or(v2.then_some(300));
            match (inner.sandboxes.get_mut(*id).filter(|s| s.alive), t) {
                (Some(sb), Some(t)) => {
                    sb.timeout = sb.timeout.max(t);
                    json_response(StatusCode::OK, &sandbox_json(id, sb, ev))
                }
                (Some(_), None) => error(StatusCode::BAD_REQUEST, "body needs a numeric timeout"),
                (None, _) => error(StatusCode::NOT_FOUND, &format!("sandbox {id} not found")),
            }
        }
        (&Method::POST, ["volumes"]) => {
            let Some(name) = serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|v| v.get("name").and_then(Value::as_str).map(str::to_string))
            else {
                return error(StatusCode::BAD_REQUEST, "body needs a name");
            };
            let id = format!("vol-{}", uuid::Uuid::new_v4().simple());
            let token = format!("volume-tok-{}", uuid::Uuid::new_v4().simple());
            let resp = json!({"volumeID": id, "name": name, "token": token});
            let files = HashMap::new();
            inner.volumes.insert(id, Volume { name, token, files });
            json_response(StatusCode::CREATED, &resp)
        }
        (&Method::GET, ["volumes", id]) => match inner.volumes.get(*id) {
            Some(v) => json_response(
                StatusCode::OK,
                &json!({"volumeID": id, "name": v.name, "token": v.token}),
            ),
            None => error(StatusCode::NOT_FOUND, &format!("volume {id} not found")),
        },
        (&Method::DELETE, ["volumes", id]) => match inner.volumes.remove(*id) {
            Some(_) => empty(StatusCode::NO_CONTENT),
            None => error(StatusCode::NOT_FOUND, &format!("volume {id} not found")),
        },
        (_, ["volumecontent", id, what]) => {
            let Some(vol) = inner.volumes.get_mut(*id) else {
                return error(StatusCode::NOT_FOUND, &format!("volume {id} not found"));
            };
            let Some(file) = query_param(query, "path") else {
                return error(StatusCode::BAD_REQUEST, "no path in the query");
            };
            match (method, *what) {
                (&Method::PUT, "file") => {
                    vol.files.insert(file.clone(), body.to_vec());
                    let name = file.rsplit('/').next().unwrap_or_default();
                    let now = "2026-01-01T00:00:00Z";
                    json_response(
                        StatusCode::CREATED,
                        &json!({"name": name, "type": "file", "path": file,
                                "size": body.len(), "mode": 0o644, "uid": 1000, "gid": 1000,
                                "atime": now, "mtime": now, "ctime": now}),
                    )
                }
                (&Method::GET, "file") => match vol.files.get(&file) {
                    Some(data) => {
                        let mut r = Response::new(full(Bytes::from(data.clone())));
                        r.headers_mut().insert(
                            CONTENT_TYPE,
                            HeaderValue::from_static("application/octet-stream"),
                        );
                        r
                    }
                    None => error(StatusCode::NOT_FOUND, &format!("{file} not found")),
                },
                (&Method::DELETE, "path") => match vol.files.remove(&file) {
                    Some(_) => empty(StatusCode::NO_CONTENT),
                    None => error(StatusCode::NOT_FOUND, &format!("{file} not found")),
                },
                _ => error(StatusCode::NOT_FOUND, &format!("no route {method} {path}")),
            }
        }
        _ => error(StatusCode::NOT_FOUND, &format!("no route {method} {path}")),
    }
}

// ---------------------------------------------------------------------------------------
// envd

fn envd(
    method: &Method,
    path: &str,
    query: Option<&str>,
    h: &HeaderMap,
    body: &Bytes,
    state: &State,
) -> Response<Body> {
    // check_envd has verified the id, the port and that the sandbox exists.
    let id = header(h, "e2b-sandbox-id").unwrap_or_default().to_string();
    let jupyter = header(h, "e2b-sandbox-port") == Some(JUPYTER_PORT);
    let mut inner = state.inner.lock();
    let pid = inner.next_pid;
    let Some(sb) = inner.sandboxes.get_mut(&id) else {
        return error(StatusCode::BAD_GATEWAY, "sandbox not found");
    };
    if !sb.alive {
        // What the edge answers for a sandbox that is gone; `is_running()` maps 502 to false.
        return error(
            StatusCode::BAD_GATEWAY,
            &format!("sandbox {id} is not running"),
        );
    }
    if jupyter {
        return code_interpreter(method, path, body, sb);
    }
    match (method, path) {
        (&Method::GET, "/health") => empty(StatusCode::NO_CONTENT),
        (&Method::GET, "/files") => {
            let Some(p) = query_param(query, "path") else {
                return error(StatusCode::BAD_REQUEST, "missing path");
            };
            match sb.files.get(&p) {
                Some(data) => {
                    let mut r = Response::new(full(data.clone()));
                    r.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static("application/octet-stream"),
                    );
                    r
                }
                None => error(StatusCode::NOT_FOUND, &format!("file {p} not found")),
            }
        }
        (&Method::POST, "/files") => upload(sb, query, h, body),
        (&Method::POST, "/process.Process/Start") => {
            let r = process_start(h, body, pid);
            inner.next_pid += 1;
            r
        }
        (&Method::POST, "/filesystem.Filesystem/ListDir") => list_dir(sb, body),
        _ => error(StatusCode::NOT_FOUND, &format!("no route {method} {path}")),
    }
}

fn upload(sb: &mut Sandbox, query: Option<&str>, h: &HeaderMap, body: &Bytes) -> Response<Body> {
    let ct = header(h, "content-type").unwrap_or("");
    let qpath = query_param(query, "path");
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let Some(boundary) = ct
            .split(';')
            .filter_map(|p| p.trim().strip_prefix("boundary="))
            .next()
            .map(|b| b.trim_matches('"').to_string())
        else {
            return error(StatusCode::BAD_REQUEST, "multipart without boundary");
        };
        let parts = match parse_multipart(body, &boundary) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad multipart: {e}")),
        };
        if parts.is_empty() {
            return error(StatusCode::BAD_REQUEST, "multipart without parts");
        }
        let single = parts.len() == 1;
        for (filename, data) in parts {
            let path = match (&qpath, filename) {
                (Some(p), _) if single => p.clone(),
                (_, Some(f)) => f,
                (Some(p), None) => p.clone(),
                (None, None) => return error(StatusCode::BAD_REQUEST, "part without a path"),
            };
            sb.files.insert(path.clone(), data);
            written.push(path);
        }
    } else if ct.starts_with("application/octet-stream") {
        if header(h, "content-encoding").is_some_and(|e| e != "identity") {
            return error(
                StatusCode::BAD_REQUEST,
                "fake: compressed uploads not supported",
            );
        }
        let Some(p) = qpath else {
            return error(StatusCode::BAD_REQUEST, "octet-stream upload needs ?path=");
        };
        sb.files.insert(p.clone(), body.to_vec());
        written.push(p);
    } else {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("unsupported upload content type {ct:?}"),
        );
    }
    let infos: Vec<Value> = written
        .iter()
        .map(|p| {
            json!({
                "name": p.rsplit('/').next().unwrap_or(p),
                "type": "file",
                "path": p,
            })
        })
        .collect();
    json_response(StatusCode::OK, &Value::Array(infos))
}

/// One multipart part: its `filename` (if any) and its content.
type Part = (Option<String>, Vec<u8>);

/// Splits a multipart/form-data body into its parts.
fn parse_multipart(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
    let delim = format!("--{boundary}").into_bytes();
    let find = |hay: &[u8], needle: &[u8], from: usize| -> Option<usize> {
        hay.get(from..)?
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let mut parts = Vec::new();
    let mut pos = find(body, &delim, 0).ok_or("no opening boundary")? + delim.len();
    loop {
        if body.get(pos..pos + 2) == Some(b"--") {
            return Ok(parts);
        }
        pos += 2; // CRLF after the boundary
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("part without header end")?;
        let head = String::from_utf8_lossy(&body[pos..head_end]).into_owned();
        let data_start = head_end + 4;
        let mut next_delim = b"\r\n".to_vec();
        next_delim.extend_from_slice(&delim);
        let data_end =
            find(body, &next_delim, data_start).ok_or("part without closing boundary")?;
        let filename = head.lines().find_map(|l| {
            let l = l.trim();
            if !l.to_ascii_lowercase().starts_with("content-disposition:") {
                return None;
            }
            l.split(';').find_map(|p| {
                p.trim()
                    .strip_prefix("filename=")
                    .map(|f| f.trim_matches('"').to_string())
            })
        });
        parts.push((filename, body[data_start..data_end].to_vec()));
        pos = data_end + next_delim.len();
    }
}

/// `process.Process/Start`: a Connect server stream of start, stdout data, end, then the
/// end-of-stream frame. Understands `echo WORDS` and `whoami`; anything else exits 127.
fn process_start(h: &HeaderMap, body: &Bytes, pid: u32) -> Response<Body> {
    let ct = header(h, "content-type").unwrap_or("");
    if ct != "application/connect+json" {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &format!("Start expects application/connect+json, got {ct:?}"),
        );
    }
    let Some((_flags, payload)) = first_envelope(body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "no Connect envelope in the request body",
        );
    };
    let req: Value = match serde_json::from_slice(payload) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad Start request: {e}")),
    };
    let script = req
        .pointer("/process/args")
        .and_then(Value::as_array)
        .and_then(|a| a.last())
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let user = basic_user(h).unwrap_or_else(|| "user".to_string());
    let (stdout, stderr, code) = if let Some(words) = script.strip_prefix("echo ") {
        (format!("{words}\n"), String::new(), 0)
    } else if script == "whoami" {
        (format!("{user}\n"), String::new(), 0)
    } else {
        (
            String::new(),
            format!("fake envd: cannot run {script:?}\n"),
            127,
        )
    };
    let mut frames = vec![envelope(
        0,
        json!({"event": {"start": {"pid": pid}}})
            .to_string()
            .as_bytes(),
    )];
    if !stdout.is_empty() {
        frames.push(envelope(
            0,
            json!({"event": {"data": {"stdout": b64_encode(stdout.as_bytes())}}})
                .to_string()
                .as_bytes(),
        ));
    }
    if !stderr.is_empty() {
        frames.push(envelope(
            0,
            json!({"event": {"data": {"stderr": b64_encode(stderr.as_bytes())}}})
                .to_string()
                .as_bytes(),
        ));
    }
    frames.push(envelope(
        0,
        json!({"event": {"end": {"exitCode": code, "exited": true, "status": format!("exit status {code}")}}})
            .to_string()
            .as_bytes(),
    ));
    frames.push(envelope(0x02, b"{}"));
    // Each frame is its own body chunk: a proxy that buffers instead of streaming still
    // passes, but one that drops or reorders chunks does not.
    let stream = futures_util::stream::iter(
        frames
            .into_iter()
            .map(|f| Ok::<_, Infallible>(Frame::data(f))),
    );
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    r
}

/// `filesystem.Filesystem/ListDir`: a Connect unary JSON call over the in-memory files.
fn list_dir(sb: &Sandbox, body: &Bytes) -> Response<Body> {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let dir = req
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or("/")
        .trim_end_matches('/')
        .to_string();
    let mut entries: Vec<Value> = sb
        .files
        .iter()
        .filter_map(|(p, data)| {
            let (parent, name) = p.rsplit_once('/')?;
            (parent == dir).then(|| {
                json!({
                    "name": name,
                    "type": "FILE_TYPE_FILE",
                    "path": p,
                    "size": data.len().to_string(),
                    "mode": 0o644,
                    "permissions": "-rw-r--r--",
                    "owner": "user",
                    "group": "user",
                    "modifiedTime": "2025-01-01T00:00:00Z",
                })
            })
        })
        .collect();
    entries.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    json_response(StatusCode::OK, &json!({"entries": entries}))
}

// ---------------------------------------------------------------------------------------
// the code interpreter (port 49999)

fn code_interpreter(method: &Method, path: &str, body: &Bytes, sb: &mut Sandbox) -> Response<Body> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let context =
        |id: &str, language: &str| json!({"id": id, "language": language, "cwd": "/home/user"});
    match (method, segs.as_slice()) {
        (&Method::GET, ["health"]) => empty(StatusCode::NO_CONTENT),
        (&Method::POST, ["contexts"]) => {
            let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let language = req
                .get("language")
                .and_then(Value::as_str)
                .unwrap_or("python");
            let id = uuid::Uuid::new_v4().to_string();
            sb.contexts.push(id.clone());
            sb.contexts_made.send_modify(|n| *n += 1);
            json_response(StatusCode::OK, &context(&id, language))
        }
        (&Method::GET, ["contexts"]) => {
            // The server lists its default contexts too.
            let defaults = [
                ("default-python", "python"),
                ("default-javascript", "javascript"),
            ];
            let list: Vec<Value> = (defaults.iter().map(|(id, language)| context(id, language)))
                .chain(sb.contexts.iter().map(|id| context(id, "python")))
                .collect();
            json_response(StatusCode::OK, &Value::Array(list))
        }
        (&Method::DELETE, ["contexts", id]) => match sb.contexts.iter().position(|c| c == id) {
            Some(i) => {
                sb.contexts.remove(i);
                json_response(StatusCode::OK, &Value::Null)
            }
            None => error(StatusCode::NOT_FOUND, &format!("context {id} not found")),
        },
        (&Method::POST, ["contexts", id, "restart"]) if sb.contexts.iter().any(|c| c == id) => {
            empty(StatusCode::NO_CONTENT)
        }
        (&Method::POST, ["execute"]) => execute(body, sb),
        _ => error(StatusCode::NOT_FOUND, &format!("no route {method} {path}")),
    }
}

/// How long `wait_until_seen()` waits for the client to make a context.
const SEEN_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// A step of an execution's stream.
enum Step {
    Line(Value),
    /// `wait_until_seen()`: hold the rest until a context is made.
    AwaitContext,
}

/// `/execute`: the code's outputs as NDJSON, a line per chunk (as the server streams them).
/// Understands `print('TEXT')` lines, `wait_until_seen()` (see the module's doc) and a
/// last line `A + B` (its value is the main result); any other line is a `NameError` that
/// ends the run.
fn execute(body: &Bytes, sb: &mut Sandbox) -> Response<Body> {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("bad execute request: {e}"),
            )
        }
    };
    if let Some(ctx) = req.get("context_id").and_then(Value::as_str) {
        if !sb.contexts.iter().any(|c| c == ctx) {
            return error(StatusCode::NOT_FOUND, &format!("context {ctx} not found"));
        }
    }
    let code = req.get("code").and_then(Value::as_str).unwrap_or("");
    sb.executions += 1;
    let now = "2025-01-01T00:00:00Z";
    let mut lines = vec![Step::Line(
        json!({"type": "number_of_executions", "execution_count": sb.executions}),
    )];
    let code_lines: Vec<&str> = code
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    for (i, line) in code_lines.iter().enumerate() {
        let printed = line
            .strip_prefix("print(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|q| q.strip_prefix('\'').and_then(|q| q.strip_suffix('\'')));
        let sum = line
            .split_once('+')
            .and_then(|(a, b)| Some(a.trim().parse::<i64>().ok()? + b.trim().parse::<i64>().ok()?));
        match (printed, sum) {
            (Some(text), _) => lines.push(Step::Line(
                json!({"type": "stdout", "text": format!("{text}\n"), "timestamp": now}),
            )),
            _ if *line == "wait_until_seen()" => lines.push(Step::AwaitContext),
            (None, Some(n)) if i + 1 == code_lines.len() => lines.push(Step::Line(json!({
                "type": "result", "text": n.to_string(), "is_main_result": true,
            }))),
            _ => {
                let name = line
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next()
                    .unwrap_or(line);
                lines.push(Step::Line(json!({
                    "type": "error",
                    "name": "NameError",
                    "value": format!("name '{name}' is not defined"),
                    "traceback": format!("NameError: name '{name}' is not defined"),
                })));
                break;
            }
        }
    }
    lines.push(Step::Line(json!({"type": "end_of_execution"})));
    let made = sb.contexts_made.subscribe();
    let before = *made.borrow();
    let frame = |l: Value| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{l}\n"))));
    let stream = futures_util::stream::unfold(
        (lines.into_iter(), made),
        move |(mut steps, mut made)| async move {
            loop {
                match steps.next()? {
                    Step::Line(l) => return Some((frame(l), (steps, made))),
                    Step::AwaitContext => {
                        let seen = tokio::time::timeout(SEEN_WAIT, made.wait_for(|n| *n > before));
                        if matches!(seen.await, Ok(Ok(_))) {
                            continue;
                        }
                        eprintln!("fake_e2b: wait_until_seen(): no context made in {SEEN_WAIT:?}");
                        let end = vec![Step::Line(json!({"type": "end_of_execution"}))];
                        let l = json!({
                            "type": "error",
                            "name": "TimeoutError",
                            "value": "no context made while the output before wait_until_seen() was out: the client did not see it (held until the end?)",
                            "traceback": "",
                        });
                        return Some((frame(l), (end.into_iter(), made)));
                    }
                }
            }
        },
    );
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}
