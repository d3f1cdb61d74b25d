//! What the user is shown of a non-secret setting's value: `config list|get`, `check`,
//! warnings, log lines and the errors that quote a value all print it through [`shown`].
//! Only the display changes; what is sent upstream is the value as resolved.
//!
//! A non-secret value can still carry a secret: a URL's password or a signed query string
//! (`?sig=…`), or a secret itself, through a `.env` file's `${VAR}` expansion
//! (`ABX_SANDBOX_URL=https://h/?t=${ABX_SANDBOX_API_KEY}`).

use crate::secret::Secret;

/// Shorter secrets are not looked for: they would mask ordinary words of other values.
pub const MIN_EMBEDDED: usize = 8;

const MASK: &str = "****";

/// `value` as printed: each of `secrets` (the resolved ones, plugin fields included) it
/// contains verbatim as `****`, then, read as a URL, the password of its user info (the
/// whole user info when it has no password) and the value of each query parameter as
/// `****` (`https://bob:****@host/api?sig=****`); the scheme, a user name before a
/// password, host, port and path as written.
pub fn shown(value: &str, secrets: &[Secret]) -> String {
    url_masked(&secrets_masked(value, secrets))
}

/// `value` with each of `secrets` (of [`MIN_EMBEDDED`] characters or more) it contains
/// as `****`, in any ASCII case: the first rule of [`shown`], and what the log writer
/// does to every line with the secrets a setting's value carries. Any case: a host name
/// holding one is the same host in every case (and refused as such), and a copy in upper
/// case leaves only each letter's case to guess.
pub fn secrets_masked(value: &str, secrets: &[Secret]) -> String {
    let embedded: Vec<String> = secrets
        .iter()
        .map(Secret::expose)
        .filter(|s| s.chars().count() >= MIN_EMBEDDED)
        .map(str::to_ascii_lowercase)
        .collect();
    if embedded.is_empty() {
        return value.to_string();
    }
    // ASCII case folding keeps every byte where it was: the offsets found in the folded
    // copy are the value's. Every copy of every secret, overlapping ones too, then masked
    // as one: masked one secret after another, two that overlapped left one's tail in
    // clear (`AAAABBBB1234` then `1234CCCCDDDD` in `AAAABBBB1234CCCCDDDD`).
    let folded = value.to_ascii_lowercase();
    let mut found: Vec<(usize, usize)> = Vec::new();
    for secret in &embedded {
        let step = secret.chars().next().map_or(1, char::len_utf8);
        let mut from = 0;
        while let Some(at) = folded[from..].find(secret.as_str()).map(|i| from + i) {
            found.push((at, at + secret.len()));
            from = at + step;
        }
    }
    found.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (start, end) in found {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let mut masked = String::with_capacity(value.len());
    let mut from = 0;
    for (start, end) in merged {
        masked.push_str(&value[from..start]);
        masked.push_str(MASK);
        from = end;
    }
    masked.push_str(&value[from..]);
    masked
}

/// The URL rule of [`shown`]. A value is read as a URL when it has a `://`, or when it
/// starts with user info or is a host with a query (`eve:pw@domain.example`,
/// `localhost:8080/p?sig=…`: host-only values, as `sandbox_domain` or a plugin's
/// `base_url` without a scheme take; the latter's fragment is left as written); anything
/// else (`single # quoted`, a
/// unix path, a region) comes back as it is. What comes before the `://` need not be a
/// valid scheme: `config list` prints a mistyped URL (`h ttps://`, `9p://`) too, and its
/// password is no less a password. The authority ends where the settings' URL parser ends
/// it, at the first `/`, `?` or `#`.
fn url_masked(value: &str) -> String {
    // A socket path (`unix:/run/user@1000.service/p.sock`) has no user info to mask.
    if value.starts_with("unix:") {
        return value.to_string();
    }
    let (scheme, rest) = match value.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, value),
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    // Without a scheme: user info says URL; so does a query after a host, as a plugin's
    // `base_url` takes it (`localhost:8080/p?sig=…` gets `http://`). Other plain values
    // (`/srv/data#1`, `team/a?x=1`, `img:3#sha`) are no URLs and are shown as written.
    let url_like = scheme.is_some() || authority.contains('@');
    let host_with_query =
        host_like(authority) && tail.split('#').next().is_some_and(|t| t.contains('?'));
    if !url_like && !host_with_query {
        return value.to_string();
    }
    let (tail, fragment) = match tail.split_once('#') {
        Some((tail, fragment)) => (tail, Some(fragment)),
        None => (tail, None),
    };
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let mut out = String::with_capacity(value.len());
    if let Some(scheme) = scheme {
        out.push_str(scheme);
        out.push_str("://");
    }
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            match userinfo.split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(MASK);
                }
                // A lone user info is as often a token (`https://<token>@host/`) as a name.
                None => out.push_str(MASK),
            }
            out.push('@');
            out.push_str(host);
        }
        None => out.push_str(authority),
    }
    out.push_str(path);
    if let Some(query) = query {
        out.push('?');
        let params: Vec<String> = query.split('&').map(masked_param).collect();
        out.push_str(&params.join("&"));
    }
    // Never sent (the parser drops it), but it may hold a token all the same.
    if let Some(fragment) = fragment {
        out.push('#');
        if !url_like {
            out.push_str(fragment);
        } else if !fragment.is_empty() {
            out.push_str(MASK);
        }
    }
    out
}

/// A host as a scheme-less URL names one: a dotted name or address, `localhost`, a
/// bracketed IPv6 address, or any of them with a port. (A single-label name, `gw?t=…`, is
/// not told from a plain value; validation refuses its query anyway.)
fn host_like(authority: &str) -> bool {
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
            return !h.is_empty()
        }
        _ => authority,
    };
    host.contains('.') || host.eq_ignore_ascii_case("localhost") || host.starts_with('[')
}

/// `name=****`; a parameter without `=` may be a bare token, and is masked whole.
fn masked_param(param: &str) -> String {
    match param.split_once('=') {
        Some((name, _)) => format!("{name}={MASK}"),
        None if param.is_empty() => String::new(),
        None => MASK.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_keeps_its_user_name_host_and_path_and_loses_its_password_and_query_values() {
        let cases = [
            (
                "https://bob:s3cret@host.example:8443/api/v1?sig=abc&token=&x",
                "https://bob:****@host.example:8443/api/v1?sig=****&token=****&****",
            ),
            ("https://bob@host/", "https://****@host/"),
            ("http://host/p#frag", "http://host/p#****"),
            ("eve:pw@domain.example", "eve:****@domain.example"),
            ("bob:pw@h:1?k=v", "bob:****@h:1?k=****"),
            (
                "https://api.cn-hangzhou.e2b.fc.aliyuncs.com",
                "https://api.cn-hangzhou.e2b.fc.aliyuncs.com",
            ),
            ("127.0.0.1:49982", "127.0.0.1:49982"),
            ("unix:/run/abx/proxy.sock", "unix:/run/abx/proxy.sock"),
            // A path, not a URL: an `@` in it is no user info.
            ("unix:run@1/p.sock", "unix:run@1/p.sock"),
            ("cn-hangzhou", "cn-hangzhou"),
            ("single # quoted", "single # quoted"),
            ("a?b=c", "a?b=c"),
            // A plugin's `base_url` without a scheme (SPEC §3 gives it `http://`).
            ("localhost:8080/p?token=x", "localhost:8080/p?token=****"),
            ("localhost:8080?sig=x#f", "localhost:8080?sig=****#f"),
            ("h.example/?sig=x", "h.example/?sig=****"),
            ("ns:12?x=1", "ns:12?x=****"),
            ("[::1]?sig=x", "[::1]?sig=****"),
            // Plain values that are no URLs: no host, or no query.
            ("h:?x", "h:?x"),
            (":80?x=1", ":80?x=1"),
            ("/srv/data#1", "/srv/data#1"),
            ("team/a?x=1", "team/a?x=1"),
            ("img:3#sha", "img:3#sha"),
            ("C:/x#1", "C:/x#1"),
            ("h.example/p#x?y=1", "h.example/p#x?y=1"),
            // Not a scheme, still a URL as far as its password goes.
            ("9p://bob:pw@h/", "9p://bob:****@h/"),
            // An empty parameter stays empty.
            ("https://h/?a=1&&b", "https://h/?a=****&&****"),
            ("h ttps://bob:pw@h/?sig=x", "h ttps://bob:****@h/?sig=****"),
            ("", ""),
        ];
        for (raw, want) in cases {
            assert_eq!(shown(raw, &[]), want, "{raw}");
        }
    }

    /// What is masked is what validation refuses (user info, a query string) or drops (a
    /// fragment): the rest is the upstream as used.
    #[test]
    fn what_is_masked_is_what_validation_refuses_or_drops() {
        use crate::settings::{Key, UpstreamUrl};
        let parse = |raw| UpstreamUrl::parse(Key::SandboxBaseUrl, raw);
        assert!(parse("https://bob:pw@h/").is_err());
        assert!(parse("https://h/?sig=x").is_err());
        let url = parse("https://h:8443/api#frag").expect("a fragment is accepted");
        assert_eq!(url.to_string(), "https://h:8443/api");
        assert_eq!(shown(&url.to_string(), &[]), url.to_string());
    }

    #[test]
    fn a_resolved_secret_inside_a_value_is_masked_and_a_short_one_is_not_looked_for() {
        let secrets = [
            Secret::new("ghp_embedded0001"),
            Secret::new("ghp_embedded0001XYZ"),
            Secret::new("short7x"),
        ];
        assert_eq!(
            shown("ghp_embedded0001XYZ.x.example", &secrets),
            "****.x.example"
        );
        assert_eq!(
            shown("https://h/ghp_embedded0001/short7x", &secrets),
            "https://h/****/short7x"
        );
        assert_eq!(
            shown("https://u:ghp_embedded0001@h/", &secrets),
            "https://u:****@h/"
        );
        // In any ASCII case, among multi-byte text, each copy.
        assert_eq!(
            shown(
                "https://GHP_EMBEDDED0001XYZ.example/é/Ghp_Embedded0001",
                &secrets
            ),
            "https://****.example/é/****"
        );
        // Two that overlap, and one that overlaps itself: masked whole.
        let two = [Secret::new("AAAABBBB1234"), Secret::new("1234CCCCDDDD")];
        assert_eq!(shown("/AAAABBBB1234CCCCDDDD/x", &two), "/****/x");
        let own = [Secret::new("abababab")];
        assert_eq!(shown("/ababababab/x", &own), "/****/x");
        assert_eq!(shown("abababab", &own), "****");
    }
}
