//! Alibaba Cloud's current OpenAPI signature, `ACS3-HMAC-SHA256`, and the signed
//! `CreateApiKey` request of SPEC §5 (`POST /pop/2026-05-09/api-keys`).
//!
//! The signed header set is exactly the headers the caller passes: the scheme lets the
//! client choose (it must include `host`, `content-type` when there is a body, and every
//! `x-acs-*`), and the published vector also signs `accept` and `user-agent`.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use time::{Duration, OffsetDateTime};

use super::percent::{encode, encode_path};
use crate::secret::Secret;

/// The algorithm name, first line of the string to sign and first word of `Authorization`.
pub const ALGORITHM: &str = "ACS3-HMAC-SHA256";

/// The API version of FCSandbox's `CreateApiKey`.
pub const API_VERSION: &str = "2026-05-09";

/// The path `CreateApiKey` is served on.
pub const CREATE_API_KEY_PATH: &str = "/pop/2026-05-09/api-keys";

/// Hex SHA-256 of the body: both the last line of the canonical request and the value of
/// `x-acs-content-sha256`.
pub fn content_sha256(body: &[u8]) -> String {
    hex::encode(Sha256::digest(body))
}

/// Sorted `enc(k)=enc(v)` pairs joined by `&`; empty when there is no query.
pub fn canonical_query(query: &[(String, String)]) -> String {
    let mut pairs: Vec<(String, String)> =
        query.iter().map(|(k, v)| (encode(k), encode(v))).collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// Canonical headers block (`name:value\n` each) and the signed header list (`a;b;c`).
///
/// Names are lower-cased and values trimmed; a name given twice has its values joined with
/// `,` in the order given, as HTTP folds them.
pub fn canonical_headers(headers: &[(String, String)]) -> (String, String) {
    let mut merged: std::collections::BTreeMap<String, Vec<&str>> = Default::default();
    for (name, value) in headers {
        merged
            .entry(name.trim().to_ascii_lowercase())
            .or_default()
            .push(value.trim());
    }
    let block: String = merged
        .iter()
        .map(|(name, values)| format!("{name}:{}\n", values.join(",")))
        .collect();
    let signed = merged.keys().cloned().collect::<Vec<_>>().join(";");
    (block, signed)
}

/// The canonical request and the signed header list it used.
pub fn canonical_request(
    method: &str,
    path: &str,
    query: &[(String, String)],
    headers: &[(String, String)],
    body: &[u8],
) -> (String, String) {
    let (header_block, signed) = canonical_headers(headers);
    let request = format!(
        "{}\n{}\n{}\n{}\n{}\n{}",
        method.to_ascii_uppercase(),
        encode_path(path),
        canonical_query(query),
        header_block,
        signed,
        content_sha256(body)
    );
    (request, signed)
}

/// `ACS3-HMAC-SHA256\n` + hex SHA-256 of the canonical request.
pub fn string_to_sign(canonical_request: &str) -> String {
    format!(
        "{ALGORITHM}\n{}",
        hex::encode(Sha256::digest(canonical_request.as_bytes()))
    )
}

fn hmac_sha256_hex(secret: &Secret, data: &str) -> String {
    // HMAC accepts keys of any length, so this constructor cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.expose().as_bytes()) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(data.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// The `Authorization` header value for a request signed with every header in `headers`.
pub fn authorization(
    access_key_id: &str,
    secret: &Secret,
    method: &str,
    path: &str,
    query: &[(String, String)],
    headers: &[(String, String)],
    body: &[u8],
) -> String {
    let (request, signed) = canonical_request(method, path, query, headers, body);
    let signature = hmac_sha256_hex(secret, &string_to_sign(&request));
    format!("{ALGORITHM} Credential={access_key_id},SignedHeaders={signed},Signature={signature}")
}

/// A request ready to send: the caller joins `path` to the endpoint's origin and sends the
/// headers (including `authorization`) and the body as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedRequest {
    pub method: &'static str,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Inputs of one `CreateApiKey` call that vary per call; fresh values come from
/// [`super::acs3_nonce`] and the current time.
#[derive(Debug, Clone)]
pub struct CreateApiKey<'a> {
    /// The endpoint's authority (`fcsandbox.cn-hangzhou.aliyuncs.com`, or `host:port`).
    pub host: &'a str,
    /// Path of the endpoint URL before [`CREATE_API_KEY_PATH`] (`""` for the root); the
    /// whole path is signed, as the server sees it.
    pub path_prefix: &'a str,
    pub access_key_id: &'a str,
    /// This machine's name, so a key in the console says where it was made.
    pub hostname: &'a str,
    pub now: OffsetDateTime,
    /// Lifetime asked for; becomes `expireTime` = now + ttl.
    pub ttl: Duration,
    pub nonce: &'a str,
}

/// The signed `POST /pop/2026-05-09/api-keys` of SPEC §5.
pub fn create_api_key_request(input: &CreateApiKey<'_>, secret: &Secret) -> SignedRequest {
    let body = serde_json::json!({
        "apiKeyName": format!("abx-proxy-{}-{}", input.hostname, input.now.unix_timestamp()),
        "expireTime": super::timestamp(input.now.saturating_add(input.ttl)),
    })
    .to_string()
    .into_bytes();
    let mut headers: Vec<(String, String)> = [
        ("host", input.host.to_string()),
        ("x-acs-version", API_VERSION.to_string()),
        ("x-acs-action", "CreateApiKey".to_string()),
        ("x-acs-date", super::timestamp(input.now)),
        ("x-acs-signature-nonce", input.nonce.to_string()),
        ("accept", "application/json".to_string()),
        (
            "content-type",
            "application/json; charset=utf-8".to_string(),
        ),
        ("x-acs-content-sha256", content_sha256(&body)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let path = format!(
        "{}{CREATE_API_KEY_PATH}",
        input.path_prefix.trim_end_matches('/')
    );
    let auth = authorization(
        input.access_key_id,
        secret,
        "POST",
        &path,
        &[],
        &headers,
        &body,
    );
    headers.push(("authorization".to_string(), auth));
    SignedRequest {
        method: "POST",
        path,
        headers,
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn headers_are_lowercased_trimmed_sorted() {
        let (block, signed) =
            canonical_headers(&h(&[("X-Acs-B", "  2 "), ("Host", "h"), ("x-acs-a", "1")]));
        assert_eq!(block, "host:h\nx-acs-a:1\nx-acs-b:2\n");
        assert_eq!(signed, "host;x-acs-a;x-acs-b");
    }

    #[test]
    fn empty_path_and_query() {
        let (req, _) = canonical_request("post", "", &[], &h(&[("host", "h")]), b"");
        assert_eq!(
            req,
            format!("POST\n/\n\nhost:h\n\nhost\n{}", content_sha256(b""))
        );
    }

    #[test]
    fn query_is_sorted_and_encoded() {
        assert_eq!(
            canonical_query(&h(&[("b", "x y"), ("a", "*"), ("a b", "")])),
            "a=%2A&a%20b=&b=x%20y"
        );
    }

    #[test]
    fn create_api_key_request_is_complete_and_self_consistent() {
        let input = CreateApiKey {
            host: "fcsandbox.cn-hangzhou.aliyuncs.com",
            path_prefix: "",
            access_key_id: "testid",
            hostname: "box",
            now: datetime!(2025-01-01 00:00:00 UTC),
            ttl: Duration::seconds(3600),
            nonce: "d410180a5abf7fe235dd9b74aca91fc0",
        };
        let secret = Secret::new("testsecret");
        let req = create_api_key_request(&input, &secret);
        assert_eq!(req.path, CREATE_API_KEY_PATH);
        let body: serde_json::Value =
            serde_json::from_slice(&req.body).unwrap_or(serde_json::Value::Null);
        assert_eq!(body["apiKeyName"], "abx-proxy-box-1735689600");
        assert_eq!(body["expireTime"], "2025-01-01T01:00:00Z");
        let get = |n: &str| {
            req.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        assert_eq!(get("x-acs-date"), "2025-01-01T00:00:00Z");
        assert_eq!(get("x-acs-content-sha256"), content_sha256(&req.body));
        let unsigned: Vec<_> = req
            .headers
            .iter()
            .filter(|(k, _)| k != "authorization")
            .cloned()
            .collect();
        assert_eq!(
            get("authorization"),
            authorization(
                "testid",
                &secret,
                "POST",
                &req.path,
                &[],
                &unsigned,
                &req.body
            )
        );
        assert!(get("authorization").contains(
            "SignedHeaders=accept;content-type;host;x-acs-action;x-acs-content-sha256;x-acs-date;x-acs-signature-nonce;x-acs-version,"
        ));
    }
}
