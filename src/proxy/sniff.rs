//! Learning envd tokens from control-plane responses: which responses to read, and what to
//! take from them. The response itself reaches the client byte for byte.

use http::Method;

use super::sandbox_path;
use crate::secret::Secret;

#[derive(Debug, PartialEq, Eq)]
pub enum Sniff {
    None,
    /// create, connect, resume, fork, `GET /sandboxes/{id}`: the body may carry
    /// `envdAccessToken`s.
    Learn,
    /// `DELETE /sandboxes/{id}`: forget the sandbox's token.
    Forget(String),
}

/// `path` is the upstream path: after the `/v2` rewrite, or still `/v2/…` where paths
/// pass unchanged (`compat_v2_paths = pass`, plugin providers).
pub fn plan(method: &Method, path: &str) -> Sniff {
    let Some(path) = sandbox_path::parse(path) else {
        return Sniff::None;
    };
    match (path.id, path.action) {
        (None, _) if method == Method::POST => Sniff::Learn,
        (Some(_), None) if method == Method::GET => Sniff::Learn,
        (Some(id), None) if method == Method::DELETE => Sniff::Forget(id.to_string()),
        // Resume is connect's older form (E2B SDKs before 2.x): it answers the sandbox too,
        // with the token a resumed sandbox may have changed. A fork answers the new ones.
        (Some(_), Some("connect" | "resume" | "fork")) if method == Method::POST => Sniff::Learn,
        _ => Sniff::None,
    }
}

/// Results of one fork answer read at most: e2b asks for up to 20 forks (its
/// `MAX_FORK_COUNT`). A longer list, from a buggy or hostile control plane, would push
/// every other learned token out of the store.
pub const MAX_LEARNED: usize = 64;

/// A token's length at most: E2B's are ~40 characters. The store is bounded by count, and
/// 10 000 tokens of the 1 MiB an answer may be, from a buggy or hostile control plane,
/// would be gigabytes.
pub const MAX_TOKEN_LEN: usize = 4096;
const _: () = assert!(MAX_TOKEN_LEN == 4 << 10, "the messages below say 4 KiB");

/// Each `(sandboxID, envdAccessToken)` with a token in a JSON answer: the one sandbox it
/// describes (create, connect, resume, `GET /sandboxes/{id}`), or a fork's list of
/// results, each `{"sandbox": …}` or, for a fork that failed, `{"error": …}` (the first
/// [`MAX_LEARNED`]). Told apart by the first byte, not by serde's untagged enums, which
/// copy a whole body into memory before they try a shape.
pub fn learn(body: &[u8]) -> Vec<(String, Secret)> {
    let sandboxes = match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => serde_json::from_slice::<Forks>(body).map_or(Vec::new(), |f| f.0),
        _ => serde_json::from_slice::<Sandbox>(body).map_or(Vec::new(), |s| vec![s]),
    };
    let mut learned: Vec<(String, Secret)> = (sandboxes.into_iter())
        .map(Sandbox::into_pair)
        .filter(|(_, token)| !token.expose().is_empty())
        .collect();
    let before = learned.len();
    learned.retain(|(_, token)| token.expose().len() <= MAX_TOKEN_LEN);
    if learned.len() < before {
        said_too_long();
    }
    learned
}

/// Once a process: a provider whose tokens are all too long would otherwise fail every
/// request by a token alone, and every look-up, with no word of why at the create.
#[cold]
fn said_too_long() {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            max = MAX_TOKEN_LEN,
            "an envd access token over 4 KiB was not learned: requests by the token alone \
             are refused, and its look-up fails (requests that carry their own token and \
             name their sandbox still pass)"
        );
    }
}

/// The sandboxes of a fork answer's first [`MAX_LEARNED`] results; the rest are read past,
/// into nothing.
struct Forks(Vec<Sandbox>);

impl<'de> serde::Deserialize<'de> for Forks {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, SeqAccess, Visitor};

        #[derive(serde::Deserialize)]
        struct Fork {
            sandbox: Option<Sandbox>,
        }
        struct Results;
        impl<'de> Visitor<'de> for Results {
            type Value = Forks;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of fork results")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Forks, A::Error> {
                let mut sandboxes = Vec::new();
                for _ in 0..MAX_LEARNED {
                    match seq.next_element::<Fork>()? {
                        Some(fork) => sandboxes.extend(fork.sandbox),
                        None => return Ok(Forks(sandboxes)),
                    }
                }
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Forks(sandboxes))
            }
        }
        d.deserialize_seq(Results)
    }
}

/// The envd token in the answer to a token look-up (`GET /sandboxes/{id}`) for
/// `sandbox_id`: empty for a sandbox that has none (an unsecured one). Refused, with the
/// reason, when the answer describes no sandbox (not JSON, an error page answered 200),
/// which is not to be taken for "no token", or another one: its token, stored under this
/// id, would go to this sandbox's envd, where whatever runs in it could read it.
pub fn looked_up(body: &[u8], sandbox_id: &str) -> Result<Secret, &'static str> {
    let (id, token) = sandbox(body).ok_or("envd token look-up: the answer describes no sandbox")?;
    // E2B's API answers the older `{sandboxID}-{clientID}` form of an id with the id alone.
    let same = id.eq_ignore_ascii_case(sandbox_id)
        || (sandbox_id.get(..id.len()))
            .is_some_and(|short| !id.is_empty() && short.eq_ignore_ascii_case(&id))
            && sandbox_id[id.len()..].starts_with('-');
    if token.expose().len() > MAX_TOKEN_LEN {
        said_too_long();
        Err("envd token look-up: the answer's token is over 4 KiB")
    } else if same {
        Ok(token)
    } else {
        Err("envd token look-up: the answer describes another sandbox")
    }
}

/// A sandbox as the control plane describes it: its id and envd token.
struct Sandbox {
    sandbox_id: String,
    envd_access_token: Option<String>,
}

impl<'de> serde::Deserialize<'de> for Sandbox {
    /// From a JSON object only. serde's derive also reads a struct from a list of its
    /// fields in order: `["isb-1", "tok"]`, which no control plane answers, was a sandbox
    /// with a token to `looked_up` (the token-look-up fuzz target found it).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{value::MapAccessDeserializer, MapAccess, Visitor};
        use serde::Deserialize;

        #[derive(serde::Deserialize)]
        struct Fields {
            #[serde(rename = "sandboxID")]
            sandbox_id: String,
            #[serde(rename = "envdAccessToken")]
            envd_access_token: Option<String>,
        }
        struct OnlyAnObject;
        impl<'de> Visitor<'de> for OnlyAnObject {
            type Value = Sandbox;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a sandbox (a JSON object)")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Sandbox, A::Error> {
                let f = Fields::deserialize(MapAccessDeserializer::new(map))?;
                Ok(Sandbox {
                    sandbox_id: f.sandbox_id,
                    envd_access_token: f.envd_access_token,
                })
            }
        }
        d.deserialize_map(OnlyAnObject)
    }
}

impl Sandbox {
    /// The id, and the token, `""` when it has none.
    fn into_pair(self) -> (String, Secret) {
        let token = self.envd_access_token.unwrap_or_default();
        (self.sandbox_id, Secret::new(token))
    }
}

/// The sandbox a JSON body describes, with its envd token, `""` when it has none.
fn sandbox(body: &[u8]) -> Option<(String, Secret)> {
    serde_json::from_slice::<Sandbox>(body)
        .ok()
        .map(Sandbox::into_pair)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        assert_eq!(plan(&Method::POST, "/sandboxes"), Sniff::Learn);
        assert_eq!(plan(&Method::GET, "/sandboxes"), Sniff::None);
        assert_eq!(plan(&Method::GET, "/sandboxes/isb-1"), Sniff::Learn);
        assert_eq!(
            plan(&Method::POST, "/sandboxes/isb-1/connect"),
            Sniff::Learn
        );
        assert_eq!(plan(&Method::POST, "/sandboxes/isb-1/resume"), Sniff::Learn);
        assert_eq!(plan(&Method::POST, "/sandboxes/isb-1/timeout"), Sniff::None);
        // Only a DELETE forgets: any other method on the sandbox itself leaves its token.
        assert_eq!(plan(&Method::POST, "/sandboxes/isb-1"), Sniff::None);
        assert_eq!(plan(&Method::PATCH, "/sandboxes/isb-1"), Sniff::None);
        assert_eq!(plan(&Method::GET, "/sandboxes/isb-1/connect"), Sniff::None);
        assert_eq!(
            plan(&Method::DELETE, "/sandboxes/isb-1"),
            Sniff::Forget("isb-1".into())
        );
        assert_eq!(plan(&Method::GET, "/templates"), Sniff::None);
        // Paths that pass unchanged (compat pass, plugins) are read all the same.
        assert_eq!(plan(&Method::POST, "/v2/sandboxes"), Sniff::Learn);
        assert_eq!(
            plan(&Method::POST, "/v2/sandboxes/isb-1/connect"),
            Sniff::Learn
        );
        assert_eq!(plan(&Method::GET, "/v2/templates"), Sniff::None);
        assert_eq!(plan(&Method::POST, "/v2sandboxes"), Sniff::None);
        assert_eq!(
            plan(&Method::POST, "/sandboxes//connect"),
            Sniff::None,
            "no id"
        );
        assert_eq!(
            plan(&Method::DELETE, "/sandboxes/isb-1/"),
            Sniff::Forget("isb-1".into())
        );
    }

    #[test]
    fn learns_token() {
        let learned = |body: &[u8]| -> Vec<(String, String)> {
            (learn(body).into_iter())
                .map(|(id, t)| (id, t.expose().to_string()))
                .collect()
        };
        let one = |id: &str, t: &str| (id.to_string(), t.to_string());
        assert_eq!(
            learned(br#"{"sandboxID":"isb-1","envdAccessToken":"t0k","domain":null}"#),
            [one("isb-1", "t0k")]
        );
        assert!(learned(br#"{"sandboxID":"isb-1"}"#).is_empty());
        assert!(learned(b"[]").is_empty());
        assert!(learned(b"not json").is_empty());
        // A fork's answer: a result per fork, a sandbox or an error.
        let forks = br#"[{"sandbox":{"sandboxID":"isb-f1","envdAccessToken":"tf1"}},
            {"error":{"code":500,"message":"no room"}},
            {"sandbox":{"sandboxID":"isb-f2","envdAccessToken":"tf2"}},
            {"sandbox":{"sandboxID":"isb-f3"}}]"#;
        assert_eq!(learned(forks), [one("isb-f1", "tf1"), one("isb-f2", "tf2")]);
        // At most MAX_LEARNED results are read; among them, one that is no result spoils
        // the answer (those after are read past unchecked).
        let fork = |i: usize| {
            format!(r#"{{"sandbox":{{"sandboxID":"isb-{i}","envdAccessToken":"t{i}"}}}}"#)
        };
        let long = format!("[{}]", (0..1000).map(fork).collect::<Vec<_>>().join(","));
        let got = learned(long.as_bytes());
        assert_eq!(got.len(), MAX_LEARNED);
        assert_eq!(
            got.last(),
            Some(&one(
                &format!("isb-{}", MAX_LEARNED - 1),
                &format!("t{}", MAX_LEARNED - 1)
            ))
        );
        assert!(learned(format!("[{},0]", fork(1)).as_bytes()).is_empty());
        assert!(learned(b"  [[]]").is_empty());
        assert_eq!(plan(&Method::POST, "/sandboxes/isb-1/fork"), Sniff::Learn);
        assert_eq!(plan(&Method::GET, "/sandboxes/isb-1/fork"), Sniff::None);
        // A token over MAX_TOKEN_LEN is not learned; one at it is.
        let sized = |n: usize| {
            format!(
                r#"{{"sandboxID":"isb-1","envdAccessToken":"{}"}}"#,
                "t".repeat(n)
            )
        };
        assert_eq!(learned(sized(MAX_TOKEN_LEN).as_bytes()).len(), 1);
        assert!(learned(sized(MAX_TOKEN_LEN + 1).as_bytes()).is_empty());
    }

    #[test]
    fn a_look_up_takes_the_token_of_the_sandbox_asked_for_only() {
        let answer = br#"{"sandboxID":"isb-1","envdAccessToken":"t0k"}"#;
        let token = |id: &str| looked_up(answer, id).map(|t| t.expose().to_string());
        assert_eq!(token("isb-1"), Ok("t0k".into()));
        assert_eq!(token("ISB-1"), Ok("t0k".into()));
        // The id with its client id, which E2B answers with the id alone.
        assert_eq!(token("isb-1-6532622b"), Ok("t0k".into()));
        let other = Err("envd token look-up: the answer describes another sandbox");
        for id in ["isb-2", "isb-10", "isb", "isb-1x"] {
            assert_eq!(token(id), other, "{id}");
        }
        let nothing = br#"{"sandboxID":"","envdAccessToken":"t0k"}"#;
        assert!(looked_up(nothing, "isb-1").is_err());
        assert_eq!(
            looked_up(b"<html>", "isb-1").map(|_| ()),
            Err("envd token look-up: the answer describes no sandbox")
        );
        // A list of the fields in order is no sandbox (serde's derive read it as one).
        assert_eq!(
            looked_up(br#"["isb-1", "t0k"]"#, "isb-1").map(|_| ()),
            Err("envd token look-up: the answer describes no sandbox")
        );
        assert!(learn(br#"[[["isb-1", "t0k"]]]"#).is_empty());
        let unsecured = looked_up(br#"{"sandboxID":"isb-1"}"#, "isb-1").unwrap();
        assert_eq!(unsecured.expose(), "");
        let sized = |n: usize| {
            let answer = format!(
                r#"{{"sandboxID":"isb-1","envdAccessToken":"{}"}}"#,
                "t".repeat(n)
            );
            looked_up(answer.as_bytes(), "isb-1").map(|t| t.expose().len())
        };
        assert_eq!(sized(MAX_TOKEN_LEN), Ok(MAX_TOKEN_LEN));
        assert_eq!(
            sized(MAX_TOKEN_LEN + 1),
            Err("envd token look-up: the answer's token is over 4 KiB")
        );
    }
}
