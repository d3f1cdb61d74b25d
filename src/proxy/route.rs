//! Phase 1, route: which plane a request belongs to, and whether it may be served at all
//! (Host check against DNS rebinding, no forward-proxying, no ambiguous framing).

use http::request::Parts;
use http::{HeaderValue, Method};

use super::framing::{AmbiguousLength, Refusal};
use super::headers::{E2B_SANDBOX_ID, E2B_SANDBOX_PORT};
use crate::error::Error;

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
    pub fn plane(&self) -> &'static str {
        match self {
            Route::Api => "api",
            Route::Envd { .. } => "envd",
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
    /// A unix socket, or `--allow-remote` without a list: any Host.
    Any,
}

impl HostPolicy {
    fn accepts(&self, host: &str) -> bool {
        match self {
            HostPolicy::Any => true,
            HostPolicy::Loopback => is_local_name(host),
            HostPolicy::Listed(names) => {
                is_local_name(host) || names.iter().any(|n| n.eq_ignore_ascii_case(host))
            }
        }
    }
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
        return v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| a.is_loopback());
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

pub fn route(parts: &Parts, policy: &HostPolicy) -> Result<Route, Error> {
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
    let hostname = strip_port(host);
    if !host.is_empty() && !policy.accepts(hostname) {
        let what = if parts.uri.scheme().is_some() && parts.version < http::Version::HTTP_2 {
            "absolute-form request to another host"
        } else {
            "Host not allowed on this listener"
        };
        return Err(refused(format!("{what}: {hostname}")));
    } else if host.is_empty() && !matches!(policy, HostPolicy::Any) {
        return Err(refused("missing Host header"));
    }

    // The constants, not strings: a `&str` key is parsed into a name on every call.
    if let Some(id) = parts.headers.get(&E2B_SANDBOX_ID) {
        let id = id
            .to_str()
            .ok()
            .filter(|s| valid_sandbox_id(s))
            .ok_or_else(|| refused("invalid E2b-Sandbox-Id"))?;
        let port = match parts.headers.get(&E2B_SANDBOX_PORT) {
            None => DEFAULT_ENVD_PORT,
            Some(p) => p
                .to_str()
                .ok()
                .and_then(|p| p.trim().parse::<u16>().ok())
                .filter(|p| *p != 0)
                .ok_or_else(|| refused("invalid E2b-Sandbox-Port"))?,
        };
        return Ok(Route::Envd {
            sandbox_id: id.to_string(),
            port,
        });
    }
    if let Some((port, id)) = sandbox_host(hostname) {
        return Ok(Route::Envd {
            sandbox_id: id.to_string(),
            port,
        });
    }
    Ok(Route::Api)
}

/// `<port>-<sandboxId>.localhost`: the port is the digits before the first dash.
fn sandbox_host(host: &str) -> Option<(u16, &str)> {
    let h = host.trim_end_matches('.');
    if !ends_with_ignore_case(h, ".localhost") {
        return None;
    }
    let label = &h[..h.len() - ".localhost".len()];
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    valid_sandbox_id(id).then_some((port, id))
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
    }

    #[test]
    fn host_check() {
        let p = HostPolicy::Loopback;
        for ok in [
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:49982",
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
            "127.0.0.1.evil.com",
        ] {
            let e = route(&parts("/", &[("host", bad)]), &p).unwrap_err();
            assert_eq!(e.code(), "E5003", "{bad}");
        }
        let e = route(&parts("http://example.com/x", &[("host", "127.0.0.1")]), &p).unwrap_err();
        assert_eq!(e.code(), "E5003");
        let listed = HostPolicy::Listed(vec!["proxy.internal".into()]);
        assert!(route(&parts("/", &[("host", "proxy.internal:49982")]), &listed).is_ok());
        assert!(route(&parts("/", &[("host", "other")]), &listed).is_err());
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
    }
}
