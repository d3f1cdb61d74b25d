//! Alibaba Cloud RPC (POP) V1 signatures: `SignatureMethod=HMAC-SHA1`,
//! `SignatureVersion=1.0`, and the `CreateApiKey` parameter set of SPEC §5.
//!
//! The string to sign is `METHOD&%2F&enc(canonical query)`, the key is `secret + "&"` (the
//! empty half is the STS token slot the V1 scheme reserves), the signature is Base64.

use std::collections::BTreeMap;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha1::Sha1;

use super::percent::encode;
use crate::secret::Secret;

/// Request parameters. A `BTreeMap<String, _>` iterates in byte order of the keys, which is
/// exactly the order the canonical query needs.
pub type Params = BTreeMap<String, String>;

/// The API version of FCSandbox's `CreateApiKey`.
pub const API_VERSION: &str = "2026-05-09";

/// `enc(k)=enc(v)` for every parameter, sorted by key, joined by `&`.
pub fn canonical_query(params: &Params) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// `METHOD&%2F&enc(canonical query)`.
pub fn string_to_sign(method: &str, params: &Params) -> String {
    format!(
        "{}&{}&{}",
        method.to_ascii_uppercase(),
        encode("/"),
        encode(&canonical_query(params))
    )
}

/// Base64 of HMAC-SHA1 over [`string_to_sign`], keyed with `secret + "&"`.
pub fn signature(method: &str, params: &Params, secret: &Secret) -> String {
    let key = format!("{}&", secret.expose());
    // HMAC accepts keys of any length, so this constructor cannot fail.
    let mut mac = match Hmac::<Sha1>::new_from_slice(key.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(string_to_sign(method, params).as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

/// The full query string to send: the canonical query, then `&Signature=enc(signature)`.
/// The `Signature` parameter must not already be in `params`.
pub fn signed_query(method: &str, params: &Params, secret: &Secret) -> String {
    let sig = signature(method, params, secret);
    let query = canonical_query(params);
    if query.is_empty() {
        format!("Signature={}", encode(&sig))
    } else {
        format!("{query}&Signature={}", encode(&sig))
    }
}

/// The parameters of one `CreateApiKey` call (SPEC §5). `nonce` comes from
/// [`super::rpc_nonce`] and `timestamp` from [`super::timestamp`], fresh for every call.
pub fn create_api_key_params(
    access_key_id: &str,
    region: &str,
    nonce: &str,
    timestamp: &str,
) -> Params {
    [
        ("Action", "CreateApiKey"),
        ("Version", API_VERSION),
        ("Format", "JSON"),
        ("RegionId", region),
        ("AccessKeyId", access_key_id),
        ("SignatureMethod", "HMAC-SHA1"),
        ("SignatureVersion", "1.0"),
        ("SignatureNonce", nonce),
        ("Timestamp", timestamp),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_query_sorts_by_byte_order_and_encodes() {
        let params: Params = [("b", "x y"), ("B", "*"), ("a", "~/")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(canonical_query(&params), "B=%2A&a=~%2F&b=x%20y");
    }

    #[test]
    fn create_api_key_params_match_the_published_vector() {
        let params = create_api_key_params(
            "testid",
            "cn-hangzhou",
            "3ee8c1b8-83d3-44af-a94f-4e0ad82fd6cf",
            "2025-01-01T00:00:00Z",
        );
        assert_eq!(
            signature("POST", &params, &Secret::new("testsecret")),
            "3LoiyBXDjIiL+41F7cRzkx6QY5s="
        );
    }

    #[test]
    fn signed_query_appends_the_encoded_signature_last() {
        let params = create_api_key_params("id", "r", "n", "t");
        let q = signed_query("POST", &params, &Secret::new("s"));
        let (head, sig) = q.rsplit_once("&Signature=").unwrap_or_default();
        assert_eq!(head, canonical_query(&params));
        assert!(!sig.contains('+') && !sig.contains('=') && !sig.contains('/'));
    }
}
