//! Reproduces every vector in `tests/vectors/pop-signing.json` (a copy of the shared
//! vectors, computed by three independent implementations) with the crate's signing code.

use abx_proxy::signing::{acs3, rpc_v1};
use abx_proxy::Secret;
use serde_json::Value;

fn vectors() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/vectors/pop-signing.json"
    );
    let text = std::fs::read_to_string(path).expect("vector file readable");
    serde_json::from_str(&text).expect("vector file is JSON")
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("vector field {key} is a string"))
}

fn pairs(v: &Value) -> Vec<(String, String)> {
    v.as_object()
        .expect("an object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("string value").to_string()))
        .collect()
}

#[test]
fn rpc_v1_vectors() {
    let all = vectors();
    let cases = all["rpc_v1"].as_array().expect("rpc_v1 list");
    assert!(!cases.is_empty());
    for case in cases {
        let name = str_of(case, "name");
        let method = str_of(case, "method");
        let secret = Secret::new(str_of(case, "access_key_secret"));
        let params: rpc_v1::Params = pairs(&case["params"]).into_iter().collect();

        assert_eq!(
            rpc_v1::string_to_sign(method, &params),
            str_of(case, "string_to_sign"),
            "{name}: string to sign"
        );
        assert_eq!(
            rpc_v1::signature(method, &params, &secret),
            str_of(case, "signature"),
            "{name}: signature"
        );
        if let Some(url) = case["signed_url"].as_str() {
            let (_, query) = url.split_once('?').expect("signed_url has a query");
            assert_eq!(
                rpc_v1::signed_query(method, &params, &secret),
                query,
                "{name}: signed query"
            );
        }
    }
}

#[test]
fn rpc_v1_create_api_key_builder_matches_vector_params() {
    let all = vectors();
    let mut checked = 0;
    for case in all["rpc_v1"].as_array().expect("rpc_v1 list") {
        if str_of(&case["params"], "Action") != "CreateApiKey" {
            continue;
        }
        checked += 1;
        let p = &case["params"];
        let built = rpc_v1::create_api_key_params(
            str_of(p, "AccessKeyId"),
            str_of(p, "RegionId"),
            str_of(p, "SignatureNonce"),
            str_of(p, "Timestamp"),
        );
        let expected: rpc_v1::Params = pairs(p).into_iter().collect();
        assert_eq!(built, expected, "{}", str_of(case, "name"));
    }
    assert!(checked > 0, "no CreateApiKey vector");
}

#[test]
fn acs3_vectors() {
    let all = vectors();
    let cases = all["acs3"].as_array().expect("acs3 list");
    assert!(!cases.is_empty());
    for case in cases {
        let name = str_of(case, "name");
        let body = str_of(case, "body").as_bytes();
        let headers = pairs(&case["headers"]);
        let query = pairs(&case["query"]);
        if let Some((_, sha)) = headers.iter().find(|(k, _)| k == "x-acs-content-sha256") {
            assert_eq!(&acs3::content_sha256(body), sha, "{name}: body hash");
        }
        let auth = acs3::authorization(
            str_of(case, "access_key_id"),
            &Secret::new(str_of(case, "access_key_secret")),
            str_of(case, "method"),
            str_of(case, "pathname"),
            &query,
            &headers,
            body,
        );
        assert_eq!(auth, str_of(case, "authorization"), "{name}: authorization");
    }
}
