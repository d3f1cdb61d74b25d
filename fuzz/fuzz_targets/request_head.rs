//! Arbitrary bytes as an HTTP/1.1 request head (parsed with `httparse`, the parser hyper
//! uses), then the proxy's routing and header rewriting.
//!
//! Invariants: `route` never panics; `CONNECT` and a head with both `Content-Length` and
//! `Transfer-Encoding` are refused; an accepted request on a loopback listener named a
//! loopback Host; an envd route has a valid sandbox id and a non-zero port; after
//! `strip_hop_by_hop` no hop-by-hop field (nor one named in `Connection`) remains; after
//! `authorize_api` exactly one credential header is left, ours, and no `X-API-Key`; after
//! `authorize_envd` exactly one `X-Access-Token`, ours, no `X-API-Key`, and only Basic
//! `Authorization`.
#![no_main]

use abx_proxy::proxy::framing::AmbiguousLength;
use abx_proxy::proxy::headers::{
    authorize_api, authorize_envd, is_upgrade, strip_hop_by_hop, AuthScheme, X_ACCESS_TOKEN,
    X_API_KEY,
};
use abx_proxy::proxy::route::{is_local_name, route, valid_sandbox_id, HostPolicy, Route};
use abx_proxy::Secret;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Version};
use libfuzzer_sys::fuzz_target;

const API_KEY: &str = "fuzz-api-key-0123456789abcdef";
const ENVD_TOKEN: &str = "fuzz-envd-token-0123456789";
const LISTED: &str = "proxy.internal";

fuzz_target!(|data: &[u8]| {
    let Some(parts) = parse_head(data) else {
        return;
    };
    check_route(&parts);
    check_rewrite(&parts);
});

/// What hyper would hand the service, or `None` when hyper would answer 400 itself.
fn parse_head(data: &[u8]) -> Option<Parts> {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(_) = req.parse(data).ok()? else {
        return None;
    };
    let method = Method::from_bytes(req.method?.as_bytes()).ok()?;
    let uri: http::Uri = req.path?.parse().ok()?;
    let version = match req.version? {
        0 => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut builder = http::Request::builder()
        .method(method)
        .uri(uri)
        .version(version);
    let (mut cl, mut te) = (false, false);
    for h in req.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(h.value).ok()?;
        cl |= name == header::CONTENT_LENGTH;
        te |= name == header::TRANSFER_ENCODING;
        builder = builder.header(name, value);
    }
    let mut parts = builder.body(()).ok()?.into_parts().0;
    if cl && te {
        // What the listener's framing watch marks.
        parts.extensions.insert(AmbiguousLength);
    }
    Some(parts)
}

/// `host[:port]` → `host` (IPv6 literals keep their brackets).
fn hostname(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |i| &authority[..=i]);
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    }
}

/// The name the Host check must have looked at.
fn checked_host(parts: &Parts) -> Option<String> {
    match parts.uri.authority() {
        Some(a) => Some(a.as_str().to_string()),
        None => parts
            .headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string),
    }
}

fn check_route(parts: &Parts) {
    let policies = [
        HostPolicy::Loopback,
        HostPolicy::Listed(vec![LISTED.to_string()]),
        HostPolicy::Any,
    ];
    for policy in &policies {
        let routed = route(parts, policy);
        if parts.method == Method::CONNECT {
            assert!(routed.is_err(), "CONNECT accepted under {policy:?}");
        }
        if parts.extensions.get::<AmbiguousLength>().is_some() {
            assert!(routed.is_err(), "CL+TE accepted under {policy:?}");
        }
        match &routed {
            Err(e) => assert_eq!(e.code(), "E5003", "{e:?}"),
            Ok(Route::Envd { sandbox_id, port }) => {
                assert!(valid_sandbox_id(sandbox_id), "{sandbox_id:?}");
                assert_ne!(*port, 0);
            }
            Ok(Route::Api) => {}
        }
        if routed.is_ok() && !matches!(policy, HostPolicy::Any) {
            let host = checked_host(parts).expect("accepted without a Host");
            let name = hostname(&host);
            let listed =
                matches!(policy, HostPolicy::Listed(_)) && name.eq_ignore_ascii_case(LISTED);
            assert!(
                is_local_name(name) || listed,
                "Host {host:?} accepted under {policy:?}"
            );
        }
    }
}

/// Names listed in every `Connection` line, read from the raw bytes.
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|t| t.trim_ascii())
        .filter(|t| {
            !t.is_empty()
                && !["close", "keep-alive", "upgrade"]
                    .iter()
                    .any(|p| t.eq_ignore_ascii_case(p.as_bytes()))
        })
        .filter_map(|t| HeaderName::from_bytes(t).ok())
        .collect()
}

fn check_rewrite(parts: &Parts) {
    let mut h = parts.headers.clone();
    let upgrade = is_upgrade(&h);
    let named = connection_named(&h);
    strip_hop_by_hop(&mut h, upgrade);

    let hop = [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        HeaderName::from_static("http2-settings"),
    ];
    for name in hop.iter().chain(named.iter()) {
        if upgrade && (name == header::UPGRADE || name == header::CONNECTION) {
            continue;
        }
        assert!(
            !h.contains_key(name),
            "{name} survived strip_hop_by_hop: {h:?}"
        );
    }
    if upgrade {
        // WebSocket alone goes on; with no WebSocket offered, no upgrade at all.
        let conn: Vec<_> = h.get_all(header::CONNECTION).iter().collect();
        let offered: Vec<_> = h.get_all(header::UPGRADE).iter().collect();
        if offered.is_empty() {
            assert!(conn.is_empty(), "{h:?}");
        } else {
            assert_eq!(conn, [HeaderValue::from_static("upgrade")], "{h:?}");
            assert_eq!(offered.len(), 1, "{h:?}");
            let name = offered[0].as_bytes().split(|b| *b == b'/').next();
            assert!(
                name.is_some_and(|n| n.eq_ignore_ascii_case(b"websocket")),
                "{h:?}"
            );
        }
    }
    let te: Vec<_> = h.get_all(header::TE).iter().collect();
    assert!(
        te.is_empty() || te == [HeaderValue::from_static("trailers")],
        "TE {te:?} survived"
    );

    // Control plane, both schemes.
    let schemes = [
        AuthScheme::Bearer,
        AuthScheme::Header(HeaderName::from_static("open-sandbox-api-key")),
    ];
    for scheme in &schemes {
        let mut api = h.clone();
        let value = scheme
            .value(&Secret::new(API_KEY))
            .expect("a valid header value");
        authorize_api(&mut api, scheme, value.clone());
        let name = scheme.header();
        let got: Vec<_> = api.get_all(&name).iter().collect();
        assert_eq!(got, [&value], "{name} after authorize_api");
        assert!(
            !api.contains_key(X_API_KEY),
            "X-API-Key after authorize_api"
        );
        if name != header::AUTHORIZATION {
            assert!(
                !api.contains_key(header::AUTHORIZATION),
                "client Authorization kept"
            );
        }
    }

    // envd.
    let mut envd = h.clone();
    authorize_envd(
        &mut envd,
        &AuthScheme::Bearer,
        &Secret::new(ENVD_TOKEN),
        "isb-fuzz-1",
        49983,
    );
    let tokens: Vec<_> = envd.get_all(X_ACCESS_TOKEN).iter().collect();
    assert_eq!(tokens, [ENVD_TOKEN], "X-Access-Token after authorize_envd");
    assert!(
        !envd.contains_key(X_API_KEY),
        "X-API-Key after authorize_envd"
    );
    assert_eq!(envd.get_all("e2b-sandbox-id").iter().count(), 1);
    assert_eq!(envd.get_all("e2b-sandbox-port").iter().count(), 1);
    for auth in envd.get_all(header::AUTHORIZATION) {
        let basic =
            auth.as_bytes().len() > 6 && auth.as_bytes()[..6].eq_ignore_ascii_case(b"basic ");
        assert!(basic, "non-Basic Authorization sent to envd: {auth:?}");
    }
}
