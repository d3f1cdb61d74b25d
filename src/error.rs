//! The error catalogue: every E-code, its message, its suggestion, its exit status and its
//! HTTP status. Only this file knows the texts.
//!
//! Variants carry only non-secret context (key names, file paths, host names, reasons built
//! by this crate). A secret has no way in: [`crate::secret::Secret`] prints as `****`.

use std::fmt::Write as _;

/// Exit status for a bad command line (clap uses it too).
pub const EXIT_USAGE: i32 = 2;
/// EX_UNAVAILABLE: `check` could not reach the upstream or the exchange endpoint.
pub const EXIT_UNAVAILABLE: i32 = 69;
/// EX_CONFIG: configuration or credential error.
pub const EXIT_CONFIG: i32 = 78;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// E1001: neither an API key nor a complete AccessKey pair was found.
    #[error("API key cannot be empty")]
    MissingCredential,
    /// E1002: the exchange endpoint says our clock is off.
    #[error("clock skew: the token exchange endpoint rejected the request time ({reason})")]
    ClockSkew { reason: String },
    /// E1003: one half of the AccessKey pair, and no API key.
    #[error("incomplete AccessKey pair: {present} is set but {missing} is not")]
    IncompletePair { present: String, missing: String },
    /// E1004: no usable temporary key (exchange failed, or the key expired).
    #[error("token exchange failed: {reason}")]
    TokenExchange { reason: String },
    /// E1004 too: the endpoint issued a key already (nearly) expired by this machine's
    /// clock. Of its own for its suggestion: the pair is not what to check. (A short
    /// name: the fuzz target `exchange_response` reads 17 characters of an error's `Debug`
    /// found in the answer as the answer repeated.)
    #[error("token exchange failed: {reason}")]
    IssuedExpired { reason: String },
    /// E1004 too: the endpoint answered as if it issued a key (2xx), and the key cannot be
    /// used: none this proxy can find, or one it cannot send. Of its own because each
    /// exchange creates a key: retries are spaced further apart than failures are.
    #[error("token exchange failed: {reason}")]
    IssuedUnusable { reason: String },
    /// E1005: a setting has a value we cannot use.
    #[error("invalid value for {key}: {reason}")]
    InvalidSetting { key: String, reason: String },
    /// E1006: a file named by a setting or flag cannot be read or parsed.
    #[error("cannot read {path}: {reason}")]
    ReadFile { path: String, reason: String },
    /// E1006 too: a file abx-proxy keeps (an installed provider) cannot be written.
    #[error("cannot write {path}: {reason}")]
    WriteFile { path: String, reason: String },
    /// E1007: a non-loopback listener without TLS and without consent.
    #[error(
        "refusing to listen on {addr} without TLS: anyone who reaches this port spends your key"
    )]
    RemoteListen { addr: String },
    /// E1008: the proxy cannot serve: a listener could not be bound, or what serving
    /// needs could not be had (the open-file limit's room, the runtime and its threads,
    /// the metrics registry), or its accept loop ended.
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
    /// E1009: the upstream answered 401/403 to the credential (`check`, or the envd token
    /// look-up the proxy makes for a request).
    #[error("the upstream rejected the credential ({status} from {host})")]
    CredentialRejected { status: u16, host: String },
    /// E2009: the control plane does not know the sandbox.
    #[error("sandbox not found: {sandbox_id}")]
    SandboxNotFound { sandbox_id: String },
    /// E5001: the upstream could not be reached or its answer broke (connect, TLS, reset,
    /// broken framing, an answer cut off mid-body).
    #[error("upstream unreachable: {reason} ({host})")]
    UpstreamUnreachable { reason: String, host: String },
    /// E5001 too: the upstream answered, but it is failing (5xx) or throttling, or what it
    /// answered a look-up is not its API's (a login page, a reshaped body); unlike
    /// [`Error::UpstreamUnreachable`], not a matter of network access.
    #[error("upstream unavailable: {reason} ({host})")]
    UpstreamUnavailable { reason: String, host: String },
    /// E5001 too, from `check`: the control plane answered with a redirect, which the
    /// proxy would hand the SDKs: its base URL is not the API's own address.
    #[error("upstream unavailable: it answered {status}, a redirect: the base URL is not the API's own address ({host})")]
    UpstreamRedirect { status: u16, host: String },
    /// E5002: the upstream did not answer in time.
    #[error("upstream timeout: no response within {within} ({host})")]
    UpstreamTimeout { within: Within, host: String },
    /// E5002 too: an HTTP/2 upstream connection stopped answering altogether, found by its
    /// keep-alive ping before the request's own timeout ran out.
    #[error(
        "upstream timeout: the connection stopped answering (a keep-alive ping unanswered for {within}) ({host})"
    )]
    UpstreamSilent { within: Within, host: String },
    /// E5003: a request this proxy will not forward.
    #[error("request refused: {reason}")]
    Refused { reason: String },
    /// E5003 too, answered 503 with `Retry-After`: a request the proxy cannot take now (no
    /// room for its body), which a client may send again shortly, as the E2B SDKs do with
    /// a 503; a 400 told them not to.
    #[error("request refused for now: {reason}")]
    Busy { reason: String },
    /// E8001: a provider manifest or install receipt is malformed.
    #[error("invalid provider manifest {path}:{line}: {reason}")]
    Manifest {
        path: String,
        line: usize,
        reason: String,
    },
    /// E8002: the selected provider is neither built in nor installed.
    #[error("unknown provider: {id}")]
    UnknownProvider { id: String },
    /// E8003: a provider needs consent or a field it does not have.
    #[error("provider {id}: {reason}")]
    Provider { id: String, reason: String },
    /// E8004: a `--provider-option` that cannot be accepted.
    #[error("--provider-option {field}: {reason}")]
    ProviderOption { field: String, reason: String },
}

/// A time limit in an error, as the flag that set it is written: `--upstream-timeout 1500ms`
/// is "1.5s", not the whole seconds it holds ("1s"), nor "0s" for `500ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Within(pub std::time::Duration);

impl std::fmt::Display for Within {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Under a millisecond (a flag may say 0.0005s) is not "0s".
        let ms = self.0.as_millis().max(u128::from(!self.0.is_zero()));
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else if ms < 1000 {
            write!(f, "{ms}ms")
        } else {
            let s = format!("{}.{:03}", ms / 1000, ms % 1000);
            write!(f, "{}s", s.trim_end_matches('0'))
        }
    }
}

impl Error {
    pub fn code(&self) -> &'static str {
        match self {
            Error::MissingCredential => "E1001",
            Error::ClockSkew { .. } => "E1002",
            Error::IncompletePair { .. } => "E1003",
            Error::TokenExchange { .. }
            | Error::IssuedExpired { .. }
            | Error::IssuedUnusable { .. } => "E1004",
            Error::InvalidSetting { .. } => "E1005",
            Error::ReadFile { .. } | Error::WriteFile { .. } => "E1006",
            Error::RemoteListen { .. } => "E1007",
            Error::Bind { .. } => "E1008",
            Error::CredentialRejected { .. } => "E1009",
            Error::SandboxNotFound { .. } => "E2009",
            Error::UpstreamUnreachable { .. }
            | Error::UpstreamUnavailable { .. }
            | Error::UpstreamRedirect { .. } => "E5001",
            Error::UpstreamTimeout { .. } | Error::UpstreamSilent { .. } => "E5002",
            Error::Refused { .. } | Error::Busy { .. } => "E5003",
            Error::Manifest { .. } => "E8001",
            Error::UnknownProvider { .. } => "E8002",
            Error::Provider { .. } => "E8003",
            Error::ProviderOption { .. } => "E8004",
        }
    }

    /// What the user can do about it, when there is something to say.
    pub fn suggestion(&self) -> Option<String> {
        let s = match self {
            Error::MissingCredential => "Set ABX_SANDBOX_API_KEY (environment, ./.env or ~/.abx/.env) or pass --sandbox-api-key-file.",
            Error::ClockSkew { .. } => "Synchronise the system clock (NTP): Alibaba Cloud rejects signed requests whose Timestamp is more than 15 minutes off.",
            Error::IncompletePair { .. } => "Set both ALICLOUD_ACCESS_KEY_ID and ALICLOUD_ACCESS_KEY_SECRET (or --access-key-secret-file), or set ABX_SANDBOX_API_KEY instead.",
            Error::IssuedExpired { .. } => "Compare this machine's clock with the endpoint's (NTP): a clock ahead of it reads fresh keys as expired. A key issued for seconds can also run out during a slow answer. Each exchange creates a key: while serving, the proxy tries again 15 to 30 s later, the gap doubling to at most 2 minutes.",
            Error::IssuedUnusable { .. } => "Check that token_exchange_url is the CreateApiKey endpoint of the region's Agent Sandbox, and that the proxy is up to date with its answer's form. Each exchange creates a key: while serving, the proxy tries again 15 to 30 s later, the gap doubling to at most 2 minutes.",
            // Said by `check` too ("run check" was no advice there), and in serve's log line.
            Error::TokenExchange { .. } => "Check the AccessKey pair (and its permission to create API keys), token_exchange_url and network access to it; the error says which failed.",
            Error::InvalidSetting { .. } => "Fix the value; `abx-proxy config list` shows where each setting comes from.",
            Error::ReadFile { .. } => "Check that the file exists, is readable by this user and is well formed.",
            Error::WriteFile { .. } => "Check that this user may write to the directory named above (ABX_HOME, else ~/.abx, holds the installed providers).",
            Error::RemoteListen { .. } => "Pass --allow-remote to accept connections from other hosts, or listen on 127.0.0.1, or give --tls-cert and --tls-key.",
            Error::Bind { .. } => "The reason above says what is in the way (another process listening there, a missing directory or a file that is not a socket at a unix: path, a port below 1024 without privileges, the process's open-file or thread limit: LimitNOFILE= / ulimit -n, TasksMax= / ulimit -u); or choose another address with --listen / --admin-listen.",
            Error::CredentialRejected { .. } => "The key is wrong, expired or for another region; check the provider's key or the AccessKey pair: `abx-proxy config list` shows which is used and where it comes from (a plugin also reads its SDK's variable, such as OPEN_SANDBOX_API_KEY, which may hold a dummy meant for the proxy).",
            Error::UpstreamUnreachable { .. } => "Check network access to the host named above, the URL setting that names it (sandbox_base_url, token_exchange_url, a plugin's <id>.base_url) and --upstream-ca.",
            Error::UpstreamUnavailable { .. } => "The host named above answered but is failing or throttling, or is not the API the URL setting should name (a login page, another service): retry later. If it persists, check that host's status and the URL setting that names it.",
            Error::UpstreamRedirect { .. } => "Set the base URL to the API's own address (an http:// one for an https:// API, or a path added or missing, is redirected); `abx-proxy config list` shows where it comes from.",
            // The exchange's own bound is fixed: the flag alone would not change its answer.
            Error::UpstreamTimeout { .. } => {
                return Some(format!(
                    "The upstream is slow or unreachable; retry, or raise --upstream-timeout for a slow upstream (a token exchange endpoint always gets {}s: the flag does not change it).",
                    crate::credentials::exchange::CALL_TIMEOUT.as_secs()
                ))
            }
            Error::UpstreamSilent { .. } => "The upstream, or a load balancer or NAT on the way, stopped answering on an open connection: retry, the next request opens a new one.",
            Error::Manifest { .. } => "Fix the manifest and install it again with `abx-proxy provider install FILE`.",
            Error::UnknownProvider { .. } => "`abx-proxy provider list` shows the providers known; install a manifest with `abx-proxy provider install FILE`.",
            Error::ProviderOption { .. } => "--provider-option takes FIELD=VALUE for a non-secret field of a selected plugin provider (ABX_PROVIDER; the built-in one takes none; secret fields are read only from the environment or a .env file); `abx-proxy provider info ID` lists the fields.",
            Error::Provider { id, .. } => {
                return Some(format!(
                    "`abx-proxy provider info {id}` lists its fields, the variables each is read from, and what it inherits."
                ))
            }
            Error::SandboxNotFound { .. } | Error::Refused { .. } | Error::Busy { .. } => {
                return None
            }
        };
        Some(s.to_string())
    }

    /// Exit status when this error ends a command.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::UpstreamUnreachable { .. }
            | Error::UpstreamUnavailable { .. }
            | Error::UpstreamRedirect { .. }
            | Error::UpstreamTimeout { .. }
            | Error::UpstreamSilent { .. } => EXIT_UNAVAILABLE,
            Error::ProviderOption { .. } => EXIT_USAGE,
            _ => EXIT_CONFIG,
        }
    }

    /// HTTP status when the proxy answers a request with this error itself.
    pub fn http_status(&self) -> u16 {
        match self {
            Error::UpstreamUnreachable { .. }
            | Error::UpstreamUnavailable { .. }
            | Error::UpstreamRedirect { .. } => 502,
            Error::UpstreamTimeout { .. } | Error::UpstreamSilent { .. } => 504,
            Error::Refused { .. } => 400,
            Error::SandboxNotFound { .. } => 404,
            _ => 503,
        }
    }

    /// `[E1001] API key cannot be empty` — the one-line form used in logs and HTTP bodies.
    /// What a terminal would act on is escaped: messages quote values from `.env` files,
    /// the environment and upstreams, and a line feed or escape sequence in one could
    /// forge or hide a line of the output a user reads to decide where a key goes.
    pub fn line(&self) -> String {
        let line = format!("[{}] {}", self.code(), self);
        match crate::providers::manifest::printable(&line) {
            std::borrow::Cow::Borrowed(_) => line,
            std::borrow::Cow::Owned(escaped) => escaped,
        }
    }

    /// The house format for stderr: the line, then an indented suggestion.
    pub fn render(&self) -> String {
        let mut out = self.line();
        if let Some(s) = self.suggestion() {
            let _ = write!(out, "\n  Suggestion: {s}");
        }
        out
    }

    /// The E2B error shape, so the SDKs show the message: `{"code": 502, "message": "[E5001] …"}`.
    pub fn json_body(&self) -> String {
        serde_json::json!({ "code": self.http_status(), "message": self.line() }).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn house_format() {
        assert_eq!(
            Error::MissingCredential.render(),
            "[E1001] API key cannot be empty\n  Suggestion: Set ABX_SANDBOX_API_KEY (environment, ./.env or ~/.abx/.env) or pass --sandbox-api-key-file."
        );
        assert_eq!(Error::MissingCredential.exit_code(), 78);
    }

    /// Each suggestion fits every path to its code: E1004 is said by `serve`'s log line
    /// too (where "above" was nothing and "run check" fitted), E5001 under an API key.
    #[test]
    fn suggestions_fit_every_path_to_their_code() {
        let exchange = Error::TokenExchange {
            reason: "connect refused".into(),
        };
        let said = exchange.suggestion().unwrap_or_default();
        assert!(
            !said.contains("above") && !said.contains("abx-proxy check"),
            "{said}"
        );
        let unavailable = Error::UpstreamUnavailable {
            reason: "it answered 503".into(),
            host: "h".into(),
        };
        let said = unavailable.suggestion().unwrap_or_default();
        assert!(!said.contains("token exchange"), "{said}");
    }

    /// `check` against a stalled exchange endpoint said to raise `--upstream-timeout`,
    /// which does not bound the exchange: the suggestion says what does.
    #[test]
    fn a_timeout_suggestion_says_the_exchange_limit_is_fixed() {
        let e = Error::UpstreamTimeout {
            within: Within(crate::credentials::exchange::CALL_TIMEOUT),
            host: "fcsandbox.example".into(),
        };
        assert_eq!(
            e.render(),
            "[E5002] upstream timeout: no response within 10s (fcsandbox.example)\n  Suggestion: The upstream is slow or unreachable; retry, or raise --upstream-timeout for a slow upstream (a token exchange endpoint always gets 10s: the flag does not change it)."
        );
        assert_eq!(e.exit_code(), 69);
    }

    /// A timeout is shown as its flag was written: `--upstream-timeout 500ms` said
    /// "within 0s", and `1500ms` "within 1s".
    #[test]
    fn a_time_limit_is_shown_to_the_millisecond() {
        let shown = |ms| Within(std::time::Duration::from_millis(ms)).to_string();
        assert_eq!(shown(500), "500ms");
        assert_eq!(shown(1500), "1.5s");
        assert_eq!(shown(1250), "1.25s");
        assert_eq!(shown(300_000), "300s");
        assert_eq!(shown(0), "0s");
        let half_ms = Within(std::time::Duration::from_micros(500)).to_string();
        assert_eq!(half_ms, "1ms");
    }

    /// SPEC §1 exit statuses and §6 HTTP statuses, code by code: scripts branch on the
    /// exit status (78 configuration, 69 unreachable, 2 command line) and clients on the
    /// status and `[Ennnn] message` of the proxy's own answers.
    #[test]
    fn every_code_has_the_spec_exit_status_http_status_and_message() {
        let s = String::from;
        let cases = [
            (
                Error::MissingCredential,
                78,
                503,
                "[E1001] API key cannot be empty",
            ),
            (
                Error::ClockSkew { reason: s("r") },
                78,
                503,
                "[E1002] clock skew",
            ),
            (
                Error::IncompletePair {
                    present: "ALICLOUD_ACCESS_KEY_ID".into(),
                    missing: "ALICLOUD_ACCESS_KEY_SECRET".into(),
                },
                78,
                503,
                "[E1003] ",
            ),
            (
                Error::TokenExchange { reason: s("r") },
                78,
                503,
                "[E1004] token exchange failed: r",
            ),
            (
                Error::IssuedExpired { reason: s("r") },
                78,
                503,
                "[E1004] token exchange failed: r",
            ),
            (
                Error::IssuedUnusable { reason: s("r") },
                78,
                503,
                "[E1004] token exchange failed: r",
            ),
            (
                Error::RemoteListen {
                    addr: s("0.0.0.0:1"),
                },
                78,
                503,
                "[E1007] ",
            ),
            (
                Error::SandboxNotFound {
                    sandbox_id: s("isb-1"),
                },
                78,
                404,
                "[E2009] sandbox not found",
            ),
            (
                Error::UpstreamUnreachable {
                    reason: s("connect refused"),
                    host: s("h"),
                },
                69,
                502,
                "[E5001] upstream unreachable: connect refused (h)",
            ),
            (
                Error::UpstreamTimeout {
                    within: Within(std::time::Duration::from_secs(1)),
                    host: s("h"),
                },
                69,
                504,
                "[E5002] ",
            ),
            (
                Error::UpstreamRedirect {
                    status: 301,
                    host: s("h"),
                },
                69,
                502,
                "[E5001] upstream unavailable: it answered 301, a redirect",
            ),
            (Error::Refused { reason: s("r") }, 78, 400, "[E5003] "),
            (
                Error::Busy { reason: s("r") },
                78,
                503,
                "[E5003] request refused for now: r",
            ),
            (Error::UnknownProvider { id: s("x") }, 78, 503, "[E8002] "),
            // §3: a secret given as --provider-option is a bad command line.
            (
                Error::ProviderOption {
                    field: s("api_key"),
                    reason: s("r"),
                },
                2,
                503,
                "[E8004] ",
            ),
        ];
        // README's table of codes says the same, where it gives a status at all (a code
        // no command stops with, or no request is answered with, leaves it blank).
        let readme = include_str!("../README.md");
        let rows: std::collections::HashMap<&str, (&str, &str)> = readme
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.strip_prefix("| E")?.split('|').map(str::trim).collect();
                Some((&l[2..7], (*cells.get(2)?, *cells.get(3)?)))
            })
            .collect();
        let mut codes: Vec<&str> = rows.keys().copied().collect();
        codes.sort_unstable();
        assert_eq!(
            codes,
            [
                "E1001", "E1002", "E1003", "E1004", "E1005", "E1006", "E1007", "E1008", "E1009",
                "E2009", "E5001", "E5002", "E5003", "E8001", "E8002", "E8003", "E8004"
            ],
            "README's table of codes"
        );
        // The row gives E5003's 400; its 503 for now (`Busy`) is in the row's text.
        for (e, exit, status, _) in cases.iter().filter(|c| !matches!(c.0, Error::Busy { .. })) {
            let (shown_exit, shown_status) = rows[e.code()];
            let number = |cell: &str| cell.split(' ').next().unwrap_or_default().to_string();
            if !shown_exit.is_empty() {
                assert_eq!(number(shown_exit), exit.to_string(), "README, {}", e.code());
            }
            if !shown_status.is_empty() {
                assert_eq!(
                    number(shown_status),
                    status.to_string(),
                    "README, {}",
                    e.code()
                );
            }
        }
        for (e, exit, status, line) in cases {
            assert_eq!(e.exit_code(), exit, "{}", e.line());
            assert_eq!(e.http_status(), status, "{}", e.line());
            assert!(e.line().starts_with(line), "{} vs {line}", e.line());
            let v: serde_json::Value = serde_json::from_str(&e.json_body()).unwrap();
            assert_eq!(v["code"], status, "{v}");
            assert_eq!(v["message"], e.line().as_str(), "{v}");
        }
    }

    #[test]
    fn json_shape() {
        let e = Error::UpstreamUnreachable {
            reason: "connect refused".into(),
            host: "api.example".into(),
        };
        let v: serde_json::Value = serde_json::from_str(&e.json_body()).unwrap();
        assert_eq!(v["code"], 502);
        assert_eq!(
            v["message"],
            "[E5001] upstream unreachable: connect refused (api.example)"
        );
    }
}
