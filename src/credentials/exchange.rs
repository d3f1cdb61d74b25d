//! The AK/SK → temporary API key exchange of SPEC §5: one signed `CreateApiKey` call (RPC V1
//! or ACS3), the reading of its answer, and [`ExchangedKey`], the credential source that keeps
//! a fresh temporary key in memory and refreshes it in the background.
//!
//! Only the background task of an [`ExchangedKey`] ever calls the endpoint, so any number of
//! concurrent requests cause exactly one exchange. Requests read the key from an `ArcSwap`
//! snapshot and never wait on the refresher, except before the very first answer, when the
//! key ran out with its refresh late (a machine that slept), and after the control plane
//! refused it (401): see [`ExchangedKey::current`] and [`ExchangedKey::replacement`].
//!
//! Key expiry is wall-clock time (the endpoint states it so, and a laptop that slept through
//! it must not send a dead key); every deadline here is read through a [`Clock`] so tests can
//! move time without real sockets racing a paused Tokio clock.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use futures_util::FutureExt as _;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use serde_json::Value;
use time::OffsetDateTime;
use tokio::sync::{watch, Notify};

use crate::error::Error;
use crate::proxy::headers::AuthScheme;
use crate::secret::Secret;
use crate::settings::{Credential, ExchangeScheme, Settings, UpstreamUrl};
use crate::signing::{self, acs3, rpc_v1};
use crate::upstream::HttpClient;

/// A boxed, sendable future (the [`Exchanger`] and [`Clock`] traits are object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One exchange call may take this long before it counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an attempt may take at most: [`CALL_TIMEOUT`], the exchanger's own bound
/// (whose error names the host), and a second beyond it, where the refresher's backstop
/// fires (at the same instant the two raced, and the backstop won half the time).
const ATTEMPT_MAX: Duration = Duration::from_secs(11);
/// Requests that arrive before the first exchange has answered wait this long for it.
pub const STARTUP_WAIT: Duration = Duration::from_secs(30);
/// A refresh that began this long after its time was late (the machine slept), not slow.
const LATE: Duration = Duration::from_secs(1);
/// A key is never handed out later than this before its expiry: a request still has to
/// reach the upstream and be checked there.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);
/// A refresh begins at least this long before its key stops being handed out (see
/// `Token::new`): an exchange usually answers within it.
const REFRESH_ROOM: Duration = Duration::from_secs(5);
/// First retry delay after a failed exchange; doubles up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A key issued for less than this is short, usable for under [`BACKOFF_MIN`] before
/// [`EXPIRY_MARGIN`], and exchanges for such keys are paced as failed ones. Not longer:
/// a key of 9 s, refreshed every 2 s, serves without a gap, and paced it lapsed for most
/// of each pause.
pub const SHORT_KEY: Duration = Duration::from_secs(6);

/// An answer is a few hundred bytes; anything far larger is not an answer we can use.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;
const _: () = assert!(MAX_RESPONSE_BYTES == 64 << 10, "its errors say 64 KiB");
/// The refresher re-reads the wall clock at least this often, so a suspended laptop
/// refreshes soon after waking instead of when the monotonic timer finally fires.
const RECHECK_EVERY: Duration = Duration::from_secs(30);
/// The least time between two refreshes brought forward by the control plane's 401s.
/// Each early refresh is a `CreateApiKey` (a key nobody deletes), so while the refusals go
/// on in a row the gap doubles, up to [`REFUSAL_GAP_MAX`].
pub const REFUSAL_GAP: Duration = Duration::from_secs(30);
/// The longest gap between early refreshes: a control plane that refuses every key (a
/// region mismatch, a RAM policy denial) costs a key an hour, not 120.
pub const REFUSAL_GAP_MAX: Duration = Duration::from_secs(3600);
/// The longest gap between exchanges whose answers said they issued a key the proxy cannot
/// use (expired by this machine's clock, not found, not sendable): each created a key, and
/// retried with [`backoff`] they cost 120 to 240 keys an hour; at this gap (drawn from its
/// upper half), 30 to 60. Not more: a clock put right is to be noticed soon, and the
/// shipped alerts read a failing exchange from a failure in every 5 minutes (with the
/// attempt's own 11 s, one in every 131 s at most).
pub const UNUSABLE_GAP_MAX: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------

/// Wall-clock time and sleeping, injectable for tests.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> SystemTime;
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

/// The real clock: `SystemTime::now` and Tokio's timer.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// Seconds since the Unix epoch (0 for times before it).
pub fn unix_seconds(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `YYYY-MM-DDTHH:MM:SSZ`, for log lines and `check`.
pub fn iso8601(t: SystemTime) -> String {
    // `time` panics past the year 9999; no expiry we keep is later, but stay total.
    signing::timestamp(OffsetDateTime::from(t.min(latest_expiry())))
}

/// 9999-12-31T23:59:59Z: the last instant ISO-8601 (and `time`) can write with four digits.
fn latest_expiry() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(253_402_300_799)
}

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// What one exchange needs, taken from [`Settings`] when the credential is an AccessKey pair.
#[derive(Debug, Clone)]
pub struct ExchangeConfig {
    pub url: UpstreamUrl,
    /// `url`'s host and port as printed in errors ([`Settings::shown`]: a `${VAR}` may have
    /// put a secret into it).
    pub shown_host: String,
    pub scheme: ExchangeScheme,
    pub region: String,
    pub access_key_id: String,
    pub access_key_secret: Secret,
    /// Lifetime asked for (ACS3) and assumed when the answer states no expiry.
    pub token_ttl: Duration,
    pub refresh_before: Duration,
    /// How the provider sends the key: an issued key must fit this header, by the rule
    /// [`crate::credentials::header_value`] applies to a configured key.
    pub auth: AuthScheme,
}

impl ExchangeConfig {
    /// `None` when the configured credential is a plain API key.
    pub fn from_settings(settings: &Settings) -> Option<Self> {
        match &settings.credential {
            Credential::ApiKey(_) => None,
            Credential::AccessKey { id, secret } => Some(ExchangeConfig {
                url: settings.token_exchange_url.clone(),
                shown_host: settings.shown(&settings.token_exchange_url.authority()),
                scheme: settings.token_exchange,
                region: settings.region.clone(),
                access_key_id: id.clone(),
                access_key_secret: secret.clone(),
                token_ttl: settings.token_ttl,
                refresh_before: settings.token_refresh_before,
                auth: AuthScheme::from(&settings.auth),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Reading the answer
// ---------------------------------------------------------------------------------------

/// A temporary key and when it stops working.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedKey {
    pub key: Secret,
    pub expires_at: SystemTime,
    /// The answer said when: `expires_at` is by the endpoint's clock (see
    /// [`on_our_clock`]), not `token_ttl` from this machine's.
    pub stated: bool,
}

/// `now + token_ttl`; settings bound the TTL, and an overflow that slips past them reads as
/// an expiry already past (refused below) rather than a panic in the refresher.
fn ttl_from(now: SystemTime, token_ttl: Duration) -> SystemTime {
    now.checked_add(token_ttl).unwrap_or(now)
}

/// Reads an exchange answer. `now` is when the request was made: it anchors the `token_ttl`
/// fallback and the sanity check of the stated expiry.
///
/// Errors name the HTTP status and the endpoint's error `Code`, never the body: an error
/// body may echo request parameters, and a success body holds the key.
pub fn parse_response(
    status: u16,
    body: &[u8],
    now: SystemTime,
    token_ttl: Duration,
) -> Result<IssuedKey, Error> {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let code = json.as_ref().and_then(error_code);
    if !(200..300).contains(&status) {
        return Err(endpoint_error(status, code.as_deref()));
    }
    let Some(json) = json else {
        return Err(Error::TokenExchange {
            reason: format!("HTTP {status}: the answer is not JSON"),
        });
    };
    let Some((key, holder)) = find_key(&json) else {
        // `{"success": false, "code": 0, …}`: a failure, whatever its code says.
        let failed = ["success", "Success"]
            .iter()
            .any(|k| json.get(*k) == Some(&Value::Bool(false)));
        return Err(match code {
            Some(c) if !says_success(&c) => endpoint_error(status, Some(&c)),
            _ if failed => Error::TokenExchange {
                reason: format!("HTTP {status}: the answer says it failed (success: false)"),
            },
            // A success wrapped in its own envelope (`{"code": "200", "data": {…}}`) is
            // likelier a form this proxy does not read than no key made.
            _ => Error::IssuedUnusable {
                reason: format!("HTTP {status}: a success with no apiKey found in it"),
            },
        });
    };
    let stated = holder
        .and_then(expiry_field)
        .or_else(|| expiry_field(&json));
    // Read, it is a time by the endpoint's clock; guessed, by this machine's.
    let mut said_when = false;
    let expires_at = match stated {
        None => ttl_from(now, token_ttl),
        Some((field, value)) => match parse_expiry(value) {
            Some(t) => {
                said_when = true;
                t
            }
            None => {
                // token_ttl, not a shorter guess: an expiry we cannot read is far likelier
                // a format we do not know than a short one (ACS3 asks for token_ttl), and
                // every exchange mints a key nobody deletes, so a short guess would cost
                // keys on every cycle. A key that dies early anyway is caught by the
                // control plane's 401, which brings the refresh forward.
                // The field is named, never the value beside the key or the key.
                tracing::warn!(
                    field,
                    "token exchange: the answer's expiry is a zero value or in a form this proxy cannot read; assuming token_ttl"
                );
                ttl_from(now, token_ttl)
            }
        },
    };
    if expires_at <= now + EXPIRY_MARGIN {
        return Err(Error::IssuedExpired {
            reason: format!(
                "the endpoint issued a key that expires at {}, already (nearly) past by this machine's clock",
                iso8601(expires_at)
            ),
        });
    }
    Ok(IssuedKey {
        key: Secret::new(key),
        expires_at,
        stated: said_when,
    })
}

/// A stated expiry is a time by the endpoint's clock. With this machine's behind it (its
/// `Date` later than the answer's arrival here, by more than a slow answer explains), that
/// time comes later here than it does there: the key went out after it had expired, each
/// request with a body then failing on the control plane's 401 (the signature passes up
/// to 15 minutes off). Counted instead as the life the endpoint gave it, from the
/// answer's arrival; said, as the clock is the operator's to mend. A clock ahead only
/// makes keys look shorter-lived, and exchanges earlier.
///
/// The `Date` may not be the issuer's clock (a gateway's that is wrong): one further ahead
/// than a signature's 15 minutes is not believed (the signature would have been refused),
/// nor one that leaves the key no life: the stated time stands, as before. A key that
/// dies early costs a 401 and an early refresh; a refusal cost every request a 503.
fn on_our_clock(mut issued: IssuedKey, asked: Asked, theirs: Option<SystemTime>) -> IssuedKey {
    let Some(theirs) = theirs.filter(|_| issued.stated) else {
        return issued;
    };
    let Some((said, false)) = skew(asked, theirs) else {
        return issued;
    };
    if theirs.duration_since(asked.answered).unwrap_or_default() > SIGNATURE_SKEW {
        return issued;
    }
    let lives = issued.expires_at.duration_since(theirs).unwrap_or_default();
    let expires_at = asked.answered.checked_add(lives).unwrap_or(asked.answered);
    if expires_at <= asked.answered + EXPIRY_MARGIN {
        tracing::warn!(
            "token exchange: {said}, by the answer's Date, which leaves the key no life: \
             its stated expiry is kept"
        );
        return issued;
    }
    tracing::warn!(
        "token exchange: {said}: each key's life is counted from its arrival on this \
         machine's clock; set the clock (NTP)"
    );
    issued.expires_at = issued.expires_at.min(expires_at);
    issued
}

/// How far a signature's time may be from the endpoint's clock (Alibaba's gateways, and
/// the fake in the tests, refuse it beyond).
const SIGNATURE_SKEW: Duration = Duration::from_secs(15 * 60);

/// The key and, when it came as an object, that object (the expiry may sit beside the value).
fn find_key(json: &Value) -> Option<(&str, Option<&Value>)> {
    for name in ["apiKey", "ApiKey"] {
        match json.get(name) {
            Some(Value::String(s)) if !s.trim().is_empty() => return Some((s.trim(), None)),
            Some(obj @ Value::Object(_)) => {
                for inner in ["apiKeyValue", "ApiKeyValue"] {
                    if let Some(Value::String(s)) = obj.get(inner) {
                        if !s.trim().is_empty() {
                            return Some((s.trim(), Some(obj)));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    None
}

/// The expiry beside the key and the name it came under.
fn expiry_field(obj: &Value) -> Option<(&'static str, &Value)> {
    ["expireTime", "ExpireTime"]
        .into_iter()
        .find_map(|name| obj.get(name).map(|v| (name, v)))
        .filter(|(_, v)| !v.is_null())
}

/// ISO-8601 (also with spaces: `2025-01-01 01:00:00 +0000`), the HTTP date form
/// (`Wed, 01 Jan 2025 01:00:00 GMT`, or RFC 2822 with a numeric zone), or epoch seconds, or
/// epoch milliseconds (above 10^11, which as seconds would be the year 5138), as a number or
/// a numeric string.
pub fn parse_expiry(value: &Value) -> Option<SystemTime> {
    // An expiry past the year 9999 is nonsense; treat it as absent (token_ttl applies). So
    // is one at or before 1970: that is a zero value (epoch 0 written as a date, Go's
    // `0001-01-01T00:00:00Z`), which a serializer writes for "no expiry", as 0 is taken
    // below; a key that really expired in the past is refused by the caller.
    let t = match value {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().map(|f| f as i64))
            .and_then(from_epoch),
        Value::String(s) => {
            let s = s.trim();
            if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
                s.parse::<f64>().ok().and_then(|f| from_epoch(f as i64))
            } else {
                parse_iso8601(s)
            }
        }
        _ => None,
    };
    t.filter(|t| *t > UNIX_EPOCH && *t <= latest_expiry())
}

fn from_epoch(n: i64) -> Option<SystemTime> {
    let n = u64::try_from(n).ok().filter(|n| *n > 0)?;
    let d = if n > 100_000_000_000 {
        Duration::from_millis(n)
    } else {
        Duration::from_secs(n)
    };
    UNIX_EPOCH.checked_add(d)
}

fn parse_iso8601(s: &str) -> Option<SystemTime> {
    use time::format_description::well_known::{Iso8601, Rfc2822, Rfc3339};
    use time::macros::format_description;
    use time::PrimitiveDateTime;

    if let Ok(t) = OffsetDateTime::parse(s, &Rfc3339) {
        return Some(t.into());
    }
    if let Ok(t) = OffsetDateTime::parse(s, &Iso8601::DEFAULT) {
        return Some(t.into());
    }
    // What `Date`-style formatters write: a space before the time and before the offset.
    let spaced: [&[time::format_description::BorrowedFormatItem<'_>]; 2] = [
        format_description!(
            "[year]-[month]-[day] [hour]:[minute]:[second] [offset_hour sign:mandatory][offset_minute]"
        ),
        format_description!(
            "[year]-[month]-[day] [hour]:[minute]:[second] [offset_hour sign:mandatory]:[offset_minute]"
        ),
    ];
    if let Some(t) = spaced.iter().find_map(|f| OffsetDateTime::parse(s, f).ok()) {
        return Some(t.into());
    }
    // The HTTP date (`GMT`), then RFC 2822's numeric zones (`+0800`).
    if let Ok(t) = httpdate::parse_http_date(s) {
        return Some(t);
    }
    if let Ok(t) = OffsetDateTime::parse(s, &Rfc2822) {
        return Some(t.into());
    }
    // Alibaba also writes minute precision (`2025-01-01T00:00Z`) and zone-less UTC times.
    let s = s.strip_suffix('Z').unwrap_or(s);
    let zone_less: [&[time::format_description::BorrowedFormatItem<'_>]; 5] = [
        format_description!("[year]-[month]-[day]T[hour]:[minute]"),
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]"),
        format_description!("[year]-[month]-[day] [hour]:[minute]:[second]"),
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond]"),
        // Java's `yyyy-MM-dd HH:mm:ss.SSS`.
        format_description!("[year]-[month]-[day] [hour]:[minute]:[second].[subsecond]"),
    ];
    zone_less
        .iter()
        .find_map(|f| PrimitiveDateTime::parse(s, f).ok())
        .map(|t| t.assume_utc().into())
}

fn error_code(json: &Value) -> Option<String> {
    ["Code", "code"].iter().find_map(|k| match json.get(*k) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    })
}

/// A code that says the call succeeded, as wrapped answers write it: `200`, `0`, `OK`,
/// `Success`.
fn says_success(code: &str) -> bool {
    let c = code.trim();
    c == "0"
        || (c.len() == 3 && c.starts_with('2') && c.bytes().all(|b| b.is_ascii_digit()))
        || c.eq_ignore_ascii_case("ok")
        || c.eq_ignore_ascii_case("success")
}

/// Keeps an endpoint-supplied code to the characters error codes use, so an odd answer
/// cannot smuggle text (or anything echoed from the request) into a log line.
fn sanitize_code(code: &str) -> String {
    code_chars(code).chars().take(80).collect()
}

/// The characters of `code` that error codes use, all of them.
fn code_chars(code: &str) -> String {
    code.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .collect()
}

/// Codes that say the signed time is too far from the endpoint's: `InvalidTimeStamp.Expired`
/// (the POP gateway), `RequestTimeTooSkewed` and other `…Skew…` codes. Not every code that
/// names the timestamp: `InvalidTimeStamp.Format` or a missing one is this proxy's own
/// request at fault, and like `SignatureDoesNotMatch` (a wrong secret) it must not send the
/// user to fix their clock.
fn is_clock_skew(code: &str) -> bool {
    let c = code.to_ascii_lowercase();
    c.contains("skew") || (c.contains("timestamp") && c.ends_with(".expired"))
}

/// An answer that says "not now" rather than "not this configuration": 5xx, 429, and the
/// `Throttling…` codes Alibaba also sends with other statuses. `check` exits 69 on these,
/// not 78, and they are retried like any failed exchange.
fn is_temporary(status: u16, body: &[u8]) -> bool {
    status >= 500
        || status == 429
        || serde_json::from_slice::<Value>(body)
            .ok()
            .as_ref()
            .and_then(error_code)
            .is_some_and(|c| c.starts_with("Throttling"))
}

/// A failed answer with the pair's secret taken out, before its failure is worded. Its
/// error code is said, kept to a code's characters (see [`sanitize_code`]), which a secret
/// is made of too: a gateway that repeats what it checked (`InvalidAccessKeySecret.<the
/// secret>`) put it in every client's 503 and the log. Out of the answer, not the message:
/// a code cut to its 80 characters kept part of a secret that no longer matched whole.
fn without(secret: &Secret, body: Bytes) -> Bytes {
    let body = without_bytes(secret.expose().as_bytes(), body);
    without_in_code(secret.expose(), body)
}

fn without_bytes(secret: &[u8], body: Bytes) -> Bytes {
    if secret.is_empty() || !body.windows(secret.len()).any(|w| w == secret) {
        return body;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut rest = &body[..];
    while let Some(at) = rest.windows(secret.len()).position(|w| w == secret) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(b"****");
        rest = &rest[at + secret.len()..];
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

/// JSON can spell the secret in a code with escapes (`\u0041`, `\/`) that its bytes do not
/// match: the code is looked at as read, and as the characters of it that are said, in any
/// ASCII case (a gateway may fold what it repeats, as the log's masking assumes too) when
/// the secret is as long as the log's masking asks: a short one, folded, would take its
/// letters out of codes that merely hold them (`InvalidTimeStamp.Expired`).
fn without_in_code(secret: &str, body: Bytes) -> Bytes {
    let Ok(Value::Object(mut json)) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let said = code_chars(secret);
    let folds = said.len() >= crate::settings::shown::MIN_EMBEDDED;
    let fold = |s: &str| {
        if folds {
            s.to_ascii_lowercase()
        } else {
            s.to_string()
        }
    };
    let said = fold(&said);
    let mut masked = false;
    for field in ["Code", "code"] {
        let Some(Value::String(code)) = json.get_mut(field) else {
            continue;
        };
        if !secret.is_empty() && code.contains(secret) {
            *code = code.replace(secret, "****");
            masked = true;
        }
        let chars = code_chars(code);
        // ASCII only: the folded copy's offsets are the code's.
        let folded = fold(&chars);
        if !said.is_empty() && folded.contains(&said) {
            let (mut kept, mut from) = (String::new(), 0);
            while let Some(at) = folded[from..].find(&said) {
                kept.push_str(&chars[from..from + at]);
                from += at + said.len();
            }
            kept.push_str(&chars[from..]);
            *code = kept;
            masked = true;
        }
    }
    if !masked {
        return body;
    }
    serde_json::to_vec(&json).map_or(body, Bytes::from)
}

/// When the request was signed, and when its answer came, by this machine's clock.
#[derive(Debug, Clone, Copy)]
struct Asked {
    signed: SystemTime,
    answered: SystemTime,
}

/// A failure that says the clocks disagree, with how far (from the answer's `Date`): "check
/// NTP" alone left the user to find out whether by seconds or hours, and which way. A key
/// that arrived expired is said to be so only when this machine's clock is ahead: behind,
/// the endpoint issued it expired by its own clock, and the clock is not why.
fn with_skew(e: Error, asked: Asked, their_time: Option<SystemTime>) -> Error {
    let Some((said, ahead)) = their_time.and_then(|t| skew(asked, t)) else {
        return e;
    };
    match e {
        Error::ClockSkew { reason } => Error::ClockSkew {
            reason: format!("{reason}; {said}"),
        },
        Error::IssuedExpired { reason } if ahead => Error::IssuedExpired {
            reason: format!("{reason}; {said}"),
        },
        Error::IssuedExpired { reason } => Error::IssuedExpired {
            reason: format!(
                "{reason}; {said}, so the endpoint issued it expired by its own clock too"
            ),
        },
        e => e,
    }
}

/// "this machine's clock is about 2 h 3 min ahead of the endpoint's" (and whether ahead),
/// when the endpoint's time falls outside the time the request took by more than the
/// `Date`'s second and 5 s: a slow answer is no skew.
fn skew(asked: Asked, theirs: SystemTime) -> Option<(String, bool)> {
    let (by, ahead) = if let Ok(ahead) = asked.signed.duration_since(theirs) {
        (ahead, true)
    } else if let Ok(behind) = theirs.duration_since(asked.answered) {
        (behind, false)
    } else {
        return None;
    };
    if by < Duration::from_secs(5) {
        return None;
    }
    // Rounded to the nearest unit said; past a day, a `Date` nobody should believe.
    let secs = by.as_secs() + u64::from(by.subsec_millis() >= 500);
    let minutes = (secs + 30) / 60;
    let size = match (minutes / 60, minutes % 60) {
        _ if secs < 60 => format!("about {secs} s"),
        _ if secs > 86_400 => "over a day".to_string(),
        (0, m) => format!("about {m} min"),
        (h, 0) => format!("about {h} h"),
        (h, m) => format!("about {h} h {m} min"),
    };
    let way = if ahead { "ahead of" } else { "behind" };
    let said = format!("this machine's clock is {size} {way} the endpoint's");
    Some((said, ahead))
}

fn endpoint_error(status: u16, code: Option<&str>) -> Error {
    let code = code.map(sanitize_code).filter(|c| !c.is_empty());
    match code {
        Some(c) if is_clock_skew(&c) => Error::ClockSkew {
            reason: format!("HTTP {status}, {c}"),
        },
        Some(c) => Error::TokenExchange {
            reason: format!("the endpoint answered HTTP {status}, {c}"),
        },
        None => Error::TokenExchange {
            reason: format!("the endpoint answered HTTP {status}"),
        },
    }
}

// ---------------------------------------------------------------------------------------
// One call
// ---------------------------------------------------------------------------------------

/// Something that performs one exchange. `now` is the time to sign with.
pub trait Exchanger: Send + Sync + 'static {
    fn exchange(&self, now: SystemTime) -> BoxFuture<'_, Result<IssuedKey, Error>>;
}

/// The real exchange over HTTP(S), signed with the configured scheme.
pub struct HttpExchanger {
    config: ExchangeConfig,
    client: HttpClient,
    hostname: String,
}

impl fmt::Debug for HttpExchanger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpExchanger")
            .field("config", &self.config)
            .field("hostname", &self.hostname)
            .finish_non_exhaustive()
    }
}

impl HttpExchanger {
    pub fn new(config: ExchangeConfig, client: HttpClient) -> Self {
        HttpExchanger {
            config,
            client,
            hostname: local_hostname(),
        }
    }

    /// One exchange, bounded by [`CALL_TIMEOUT`]. An endpoint that cannot be reached, or
    /// answers 5xx or throttles (see [`is_temporary`]) or breaks off its answer, is
    /// E5001/E5002 (so `check` exits 69: the endpoint is unavailable, the configuration may
    /// be fine); everything else is E1004 or E1002.
    pub async fn exchange_at(&self, now: SystemTime) -> Result<IssuedKey, Error> {
        let host = self.config.shown_host.clone();
        let request = self.request(now)?;
        let sent = std::time::Instant::now();
        let call = async {
            let response =
                self.client
                    .request(request)
                    .await
                    .map_err(|e| Error::UpstreamUnreachable {
                        reason: crate::proxy::failure::describe(&e),
                        host: host.clone(),
                    })?;
            let status = response.status().as_u16();
            // The endpoint's clock, to size a skew it answers (to the second).
            let their_time = (response.headers().get(http::header::DATE))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| httpdate::parse_http_date(v).ok());
            let broke_off = |reason: String| Error::UpstreamUnreachable {
                reason,
                host: host.clone(),
            };
            let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| match e.downcast::<LengthLimitError>() {
                    // A gateway's error page for an outage is often that long: by its
                    // status, as a short one is (`check` exits 69, not 78).
                    Ok(_) if is_temporary(status, b"") => Error::UpstreamUnavailable {
                        reason: format!("HTTP {status}: the answer is over 64 KiB"),
                        host: host.clone(),
                    },
                    Ok(_) => Error::TokenExchange {
                        reason: format!("HTTP {status}: the answer is over 64 KiB"),
                    },
                    Err(e) => broke_off(format!("HTTP {status}: the answer broke off: {e}")),
                })?
                .to_bytes();
            let ttl = self.config.token_ttl;
            // A key is read from the answer as it came (the secret could be part of it); a
            // failure is said from the answer rid of the secret.
            let issued = parse_response(status, &body, now, ttl)
                .or_else(|_| {
                    let body = without(&self.config.access_key_secret, body);
                    parse_response(status, &body, now, ttl).map_err(|e| match e {
                        Error::TokenExchange { reason } if is_temporary(status, &body) => {
                            Error::UpstreamUnavailable {
                                reason,
                                host: host.clone(),
                            }
                        }
                        e => e,
                    })
                })
                .map_err(|e| {
                    let answered = now + sent.elapsed();
                    with_skew(
                        e,
                        Asked {
                            signed: now,
                            answered,
                        },
                        their_time,
                    )
                })?;
            let asked = Asked {
                signed: now,
                answered: now + sent.elapsed(),
            };
            let issued = on_our_clock(issued, asked, their_time);
            // Stored, such a key would make /readyz say 200 while every request got a 503,
            // until the next refresh an hour later; as a failure it is retried (minutes
            // apart: see `unusable_gap`).
            // The reason never quotes the value: it is the key.
            crate::log_writer::mask_issued(&issued.key);
            if self.config.auth.value(&issued.key).is_none() {
                return Err(Error::IssuedUnusable {
                    reason: format!(
                        "HTTP {status}: the endpoint issued a key that cannot be sent as an HTTP header value"
                    ),
                });
            }
            Ok(issued)
        };
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(result) => result,
            Err(_) => Err(Error::UpstreamTimeout {
                within: crate::error::Within(CALL_TIMEOUT),
                host,
            }),
        }
    }

    fn request(&self, now: SystemTime) -> Result<http::Request<crate::upstream::ProxyBody>, Error> {
        let cfg = &self.config;
        let bad_url = |e: http::Error| Error::InvalidSetting {
            key: "token_exchange_url".into(),
            reason: e.to_string(),
        };
        let (uri, headers, body) = match cfg.scheme {
            ExchangeScheme::RpcV1 => {
                let params = rpc_v1::create_api_key_params(
                    &cfg.access_key_id,
                    &cfg.region,
                    &signing::rpc_nonce(),
                    &signing::timestamp(OffsetDateTime::from(now)),
                );
                let query = rpc_v1::signed_query("POST", &params, &cfg.access_key_secret);
                let uri = cfg.url.join(&format!("/?{query}")).map_err(bad_url)?;
                // hyper writes no length for an empty body, and a gateway may answer a
                // POST without one 411 (RFC 9110 §8.6: a client should send 0, as
                // Alibaba's SDKs do).
                let headers = vec![
                    ("accept".to_string(), "application/json".to_string()),
                    ("content-length".to_string(), "0".to_string()),
                ];
                (uri, headers, Vec::new())
            }
            ExchangeScheme::Acs3 => {
                let signed = acs3::create_api_key_request(
                    &acs3::CreateApiKey {
                        host: cfg.url.authority.as_str(),
                        path_prefix: &cfg.url.path,
                        access_key_id: &cfg.access_key_id,
                        hostname: &self.hostname,
                        now: OffsetDateTime::from(now),
                        ttl: time::Duration::try_from(cfg.token_ttl).unwrap_or(time::Duration::MAX),
                        nonce: &signing::acs3_nonce(),
                    },
                    &cfg.access_key_secret,
                );
                // The prefix is part of the signed path already.
                let uri = UpstreamUrl {
                    path: String::new(),
                    ..cfg.url.clone()
                }
                .join(&signed.path)
                .map_err(bad_url)?;
                (uri, signed.headers, signed.body)
            }
        };
        let mut builder = http::Request::post(uri).header(
            http::header::USER_AGENT,
            concat!("abx-proxy/", env!("CARGO_PKG_VERSION")),
        );
        for (name, value) in &headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        builder
            .body(
                Full::new(Bytes::from(body))
                    .map_err(|never| match never {})
                    .boxed(),
            )
            .map_err(bad_url)
    }
}

impl Exchanger for HttpExchanger {
    fn exchange(&self, now: SystemTime) -> BoxFuture<'_, Result<IssuedKey, Error>> {
        Box::pin(self.exchange_at(now))
    }
}

/// One exchange for `check`: the key and its expiry as `YYYY-MM-DDTHH:MM:SSZ`.
/// A plain API key configuration is E1001 here: there is nothing to exchange.
pub async fn exchange_once(
    settings: &Settings,
    client: &HttpClient,
) -> Result<(Secret, String), Error> {
    let config = ExchangeConfig::from_settings(settings).ok_or(Error::MissingCredential)?;
    let issued = HttpExchanger::new(config, client.clone())
        .exchange_at(SystemTime::now())
        .await?;
    Ok((issued.key, iso8601(issued.expires_at)))
}

/// The machine's name as it goes into `apiKeyName`.
fn local_hostname() -> String {
    host_label(&gethostname::gethostname().to_string_lossy())
}

/// Letters, digits, `-` and `.` only, at most 63 of them; `unknown` for no name.
fn host_label(raw: &str) -> String {
    let name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    if name.is_empty() {
        "unknown".to_string()
    } else {
        name
    }
}

// ---------------------------------------------------------------------------------------
// The credential source
// ---------------------------------------------------------------------------------------

/// What the refresher reports after each exchange, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeEvent {
    Success { expiry_unix: i64 },
    Failure,
}

/// Called on the refresher task after every exchange; keep it quick.
pub type Observer = Arc<dyn Fn(ExchangeEvent) + Send + Sync>;

/// How an [`ExchangedKey`] runs. [`RefreshOptions::new`] gives the real clock and no observer.
#[derive(Clone)]
pub struct RefreshOptions {
    pub refresh_before: Duration,
    pub clock: Arc<dyn Clock>,
    pub observer: Option<Observer>,
    /// A reload's candidate until this is set (see `credentials::Counted`); `None`: the
    /// running credential from the start.
    pub running: Option<Arc<AtomicBool>>,
}

impl RefreshOptions {
    pub fn new(refresh_before: Duration) -> Self {
        RefreshOptions {
            refresh_before,
            clock: Arc::new(SystemClock),
            observer: None,
            running: None,
        }
    }

    /// A clock other than the system's: the tests' manual one.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Told of every exchange's outcome: the tests wait on it (`ExchangedKey::new` sets
    /// the metrics' observer itself).
    pub fn with_observer(mut self, observer: Observer) -> Self {
        self.observer = Some(observer);
        self
    }
}

impl fmt::Debug for RefreshOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RefreshOptions")
            .field("refresh_before", &self.refresh_before)
            .field("observer", &self.observer.is_some())
            .finish_non_exhaustive()
    }
}

struct Token {
    key: Secret,
    expires_at: SystemTime,
    /// `expires_at - EXPIRY_MARGIN`: not handed out from here on.
    usable_until: SystemTime,
    refresh_at: SystemTime,
    /// `refresh_at` was brought forward by a refusal: the exchange it causes does not end
    /// a run of refusals the way a refresh on the key's own schedule does.
    early: bool,
}

impl Token {
    fn new(issued: IssuedKey, now: SystemTime, refresh_before: Duration) -> Self {
        let expires_at = issued.expires_at;
        let lifetime = expires_at.duration_since(now).unwrap_or_default();
        let usable_until = expires_at.checked_sub(EXPIRY_MARGIN).unwrap_or(UNIX_EPOCH);
        let lead = refresh_before.min(lifetime / 2);
        // An exchange takes time: one begun as the key stops being handed out left a gap
        // at every refresh until it answered (a burst of 503s and `/readyz` down, for keys
        // issued for under 10 s). It begins [`REFRESH_ROOM`] before then, or half of the
        // key's usable life before when that is shorter; for keys of `MIN_TOKEN_TTL` and
        // longer, SPEC §5's point is earlier still.
        let usable = usable_until.duration_since(now).unwrap_or_default();
        let room = REFRESH_ROOM.min(usable / 2);
        let refresh_at = expires_at
            .checked_sub(lead)
            .unwrap_or(UNIX_EPOCH)
            .min(usable_until.checked_sub(room).unwrap_or(UNIX_EPOCH));
        Token {
            key: issued.key,
            expires_at,
            usable_until,
            refresh_at,
            early: false,
        }
    }
}

struct Shared {
    token: ArcSwapOption<Token>,
    /// Why the last exchange failed; cleared by a success.
    last_error: ArcSwapOption<Error>,
    /// Completed exchanges (either outcome), and the source's retirement: waiters for an
    /// answer watch it.
    attempts: watch::Sender<u64>,
    /// When the exchange in flight began, in milliseconds since the epoch by [`Clock`];
    /// 0 while none is.
    attempt_started_ms: AtomicU64,
    /// Requests that see a key past its refresh time nudge the refresher (after a suspend
    /// the timer may lag the wall clock).
    kick: Notify,
    clock: Arc<dyn Clock>,
    observer: Option<Observer>,
    successes: AtomicU64,
    failures: AtomicU64,
    /// Unix seconds of the current key's expiry, 0 when there is none.
    expiry_unix: AtomicI64,
    /// Refusals that brought a refresh forward (see [`ExchangedKey::refused`]).
    refusals: std::sync::Mutex<Refusals>,
    /// `refusals.in_row > 0`, readable without the lock: every answered request asks.
    refusal_streak: AtomicBool,
    /// A reload replaced this source ([`ExchangedKey::retire`]): no refresh is coming.
    retired: AtomicBool,
    /// See [`RefreshOptions::running`].
    running: Option<Arc<AtomicBool>>,
}

/// The early refreshes of a run of 401s.
#[derive(Debug, Default)]
struct Refusals {
    /// When a refusal last brought a refresh forward.
    last: Option<SystemTime>,
    /// Early refreshes since the key last worked or was refreshed on schedule.
    in_row: u32,
}

/// The gap an early refresh must keep from the previous one after `in_row` early refreshes
/// in a row: 30 s, 30 s, 60 s, 120 s … up to [`REFUSAL_GAP_MAX`]. The first refusal after a
/// reset still keeps [`REFUSAL_GAP`] from the last one, so 401s that are not about the key
/// never cost more than one exchange per gap.
fn refusal_gap(in_row: u32) -> Duration {
    let doublings = in_row.saturating_sub(1).min(16);
    REFUSAL_GAP
        .saturating_mul(1u32 << doublings)
        .min(REFUSAL_GAP_MAX)
}

/// The wait after `in_row` exchanges in a row (from 1) that issued keys the proxy cannot
/// use: 30 s doubling to [`UNUSABLE_GAP_MAX`], each drawn from the upper half of its step
/// as [`backoff`]'s are (a fleet restarted together, on one image with its clock ahead,
/// would otherwise ask in lockstep).
fn unusable_gap(in_row: u32) -> Duration {
    unusable_step(in_row).mul_f64(0.5 + fastrand::f64() * 0.5)
}

fn unusable_step(in_row: u32) -> Duration {
    let doublings = in_row.saturating_sub(1).min(16);
    REFUSAL_GAP
        .saturating_mul(1u32 << doublings)
        .min(UNUSABLE_GAP_MAX)
}

impl Shared {
    fn unusable(&self) -> Error {
        match &*self.last_error.load() {
            Some(e) => Error::clone(e),
            None => Error::TokenExchange {
                reason: "the temporary key has expired and no new one has been obtained yet".into(),
            },
        }
    }

    fn attempt_started(&self) -> Option<SystemTime> {
        match self.attempt_started_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(UNIX_EPOCH + Duration::from_millis(ms)),
        }
    }

    /// The key of the next exchange attempt, waited for up to [`ATTEMPT_MAX`] (the bound
    /// of the attempt itself); the reason there is none otherwise.
    async fn refreshed(&self) -> Result<Secret, Error> {
        let seen = *self.attempts.borrow();
        // Also when it landed between the caller's look and `seen`.
        if let Some(key) = self.usable_key(self.clock.now()) {
            return Ok(key);
        }
        let mut attempts = self.attempts.subscribe();
        tokio::select! {
            _ = attempts.wait_for(|n| *n > seen) => {}
            // As long as an attempt may take (see `refresher`).
            _ = self.clock.sleep(ATTEMPT_MAX) => {}
        }
        self.usable_key(self.clock.now())
            .ok_or_else(|| self.unusable())
    }

    fn usable_key(&self, now: SystemTime) -> Option<Secret> {
        match &*self.token.load() {
            Some(t) if now < t.usable_until => Some(t.key.clone()),
            _ => None,
        }
    }

    /// Ends a run of refusals: the next early refresh waits only [`REFUSAL_GAP`].
    fn reset_refusals(&self) -> bool {
        if !self.refusal_streak.swap(false, Ordering::Relaxed) {
            return false;
        }
        let mut r = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
        r.in_row = 0;
        true
    }

    fn notify(&self, event: ExchangeEvent) {
        if let Some(observer) = &self.observer {
            observer(event);
        }
    }
}

/// The AK/SK credential source: a temporary key obtained at construction and kept fresh in
/// the background. Dropping it stops the refresher.
pub struct ExchangedKey {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl ExchangedKey {
    /// Starts the first exchange now. Must be called within a Tokio runtime.
    pub fn new(
        config: ExchangeConfig,
        client: HttpClient,
        observer: Option<Observer>,
        running: Option<Arc<AtomicBool>>,
    ) -> Self {
        let mut options = RefreshOptions::new(config.refresh_before);
        options.observer = observer;
        options.running = running;
        Self::with_exchanger(Arc::new(HttpExchanger::new(config, client)), options)
    }

    /// Starts the first exchange now with any [`Exchanger`]. Must be called within a Tokio
    /// runtime.
    pub fn with_exchanger(exchanger: Arc<dyn Exchanger>, options: RefreshOptions) -> Self {
        let (attempts, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            token: ArcSwapOption::empty(),
            last_error: ArcSwapOption::empty(),
            attempts,
            attempt_started_ms: AtomicU64::new(0),
            kick: Notify::new(),
            clock: options.clock,
            observer: options.observer,
            successes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            expiry_unix: AtomicI64::new(0),
            refusals: std::sync::Mutex::new(Refusals::default()),
            refusal_streak: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            running: options.running,
        });
        let task = tokio::spawn(refresher(
            Arc::clone(&shared),
            exchanger,
            options.refresh_before,
        ));
        ExchangedKey { shared, task }
    }

    /// The key to attach now. Lock-free while a usable key is cached; before the first
    /// exchange has answered, waits for it up to [`STARTUP_WAIT`]; after a key ran out with
    /// no failed refresh behind it and its refresh late (none begun on time: the machine
    /// slept), waits for that refresh up to [`ATTEMPT_MAX`]; a refresh begun on time and
    /// still out gets E1004 at once. E1004 (or E1002 after a clock-skew answer) when there
    /// is no usable key.
    pub async fn current(&self) -> Result<Secret, Error> {
        let shared = &*self.shared;
        let now = shared.clock.now();
        if let Some(t) = &*shared.token.load() {
            if now >= t.refresh_at {
                shared.kick.notify_one();
            }
            if now < t.usable_until {
                return Ok(t.key.clone());
            }
            // Ran out with no failed refresh behind it and none begun on time: the
            // refresher is late, not failing or slow. A laptop that slept past the key's
            // expiry: the wall clock moved on, the refresher's timers did not run. The
            // refresh just asked for is waited for, as the first exchange is, rather than
            // a 503 until it lands.
            let late = shared
                .attempt_started()
                .is_none_or(|started| started > t.refresh_at + LATE);
            if shared.last_error.load().is_some() || !late {
                return Err(shared.unusable());
            }
            return shared.refreshed().await;
        }
        if *shared.attempts.borrow() == 0 {
            let mut first = shared.attempts.subscribe();
            tokio::select! {
                _ = first.wait_for(|n| *n > 0) => {}
                _ = shared.clock.sleep(STARTUP_WAIT) => {
                    return Err(Error::TokenExchange {
                        reason: format!(
                            "no answer from the token exchange endpoint within {}s",
                            STARTUP_WAIT.as_secs()
                        ),
                    });
                }
            }
        }
        // Also when no wait was needed: the first key may have been stored between the
        // look at `token` above and the look at `attempts`.
        match shared.usable_key(shared.clock.now()) {
            Some(key) => Ok(key),
            None => Err(shared.unusable()),
        }
    }

    /// The control plane answered 401 to `key`. A temporary key can stop working before
    /// the expiry it came with: revoked, or judged by a local clock behind the endpoint's
    /// (the expiry is compared with ours). While `key` is still the one handed out, its
    /// refresh is brought forward to now; at most once per [`REFUSAL_GAP`], so that 401s
    /// that are not about the key cost one exchange, not one per request, and with a gap
    /// that doubles while the refusals go on (see [`refusal_gap`]): a control plane that
    /// refuses every key must not have a new one minted every 30 s. Whether a refresh was
    /// asked for.
    pub fn refused(&self, key: &Secret) -> bool {
        let shared = &*self.shared;
        if shared.retired.load(Ordering::Relaxed) {
            return false;
        }
        let now = shared.clock.now();
        let current = shared.token.load_full();
        let Some(t) = current
            .as_ref()
            .filter(|t| t.key == *key && now < t.refresh_at)
        else {
            // Another key by now, or the refresh is already due.
            return false;
        };
        let (in_row, next_gap) = {
            let mut r = shared
                .refusals
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let recent = r.last.and_then(|at| now.duration_since(at).ok());
            if recent.is_some_and(|since| since < refusal_gap(r.in_row)) {
                return false;
            }
            r.last = Some(now);
            r.in_row = r.in_row.saturating_add(1);
            shared.refusal_streak.store(true, Ordering::Relaxed);
            (r.in_row, refusal_gap(r.in_row))
        };
        let due = Token {
            key: t.key.clone(),
            expires_at: t.expires_at,
            usable_until: t.usable_until,
            refresh_at: now,
            early: true,
        };
        // Only over the key that was refused: a refresh that landed meanwhile stays.
        shared.token.compare_and_swap(&current, Some(Arc::new(due)));
        shared.kick.notify_one();
        if in_row > 1 {
            tracing::warn!(
                refusals_in_row = in_row,
                next_early_refresh_after_s = next_gap.as_secs(),
                "the control plane refused the temporary key again; exchanging for a new one \
                 and backing off further early refreshes"
            );
        } else {
            tracing::warn!("the control plane refused the temporary key; exchanging for a new one");
        }
        true
    }

    /// A key other than `refused`, for sending again a request the control plane refused
    /// with it (see [`ExchangedKey::refused`]): the key that has replaced it, or the one the
    /// refresh it is due for brings, waited for up to [`ATTEMPT_MAX`]. `None` when no
    /// refresh is coming (401s within the refusal gap are not about the key; a failing
    /// endpoint is in its backoff; a reload retired this source: its successor is the
    /// caller's to ask) or it brought no other key: the 401 is the answer.
    pub async fn replacement(&self, refused: &Secret) -> Option<Secret> {
        let shared = &*self.shared;
        let seen = *shared.attempts.borrow();
        // After `seen`: a retirement between the two still wakes the wait below.
        if shared.retired.load(Ordering::Relaxed) {
            return None;
        }
        let now = shared.clock.now();
        match &*shared.token.load() {
            Some(t) if t.key != *refused => return (now < t.usable_until).then(|| t.key.clone()),
            Some(t) if now < t.refresh_at => return None,
            // After a failure the refresher sleeps out its backoff (up to 30 s, or
            // `unusable_gap`'s minutes): nothing answers within the wait.
            _ if shared.last_error.load().is_some() && shared.attempt_started().is_none() => {
                return None
            }
            _ => {}
        }
        let mut attempts = shared.attempts.subscribe();
        tokio::select! {
            _ = attempts.wait_for(|n| *n > seen) => {}
            _ = shared.clock.sleep(ATTEMPT_MAX) => {}
        }
        shared
            .usable_key(shared.clock.now())
            .filter(|key| key != refused)
    }

    /// The control plane answered `key` with something other than 401: while it is the key
    /// handed out, it works, and a run of refusals is over.
    pub fn accepted(&self, key: &Secret) {
        let shared = &*self.shared;
        // The hot path: one relaxed load when no refusals are being backed off.
        if !shared.refusal_streak.load(Ordering::Relaxed) {
            return;
        }
        let current = shared.token.load();
        if current.as_ref().is_some_and(|t| t.key == *key) && shared.reset_refusals() {
            tracing::info!(
                "the control plane accepted the temporary key; refusals no longer back off"
            );
        }
    }

    /// Stops the refresher: a reload replaced this key source. Requests still holding it
    /// keep the key they took; no new exchange is made with a pair the user replaced.
    /// Requests waiting for an answer from it are woken, to ask its successor: they
    /// waited out the 30 s of a first exchange the reload had ended.
    pub fn retire(&self) {
        self.task.abort();
        self.shared.retired.store(true, Ordering::Relaxed);
        self.shared.attempts.send_modify(|n| *n += 1);
    }

    /// Whether a key could be attached right now (for `/readyz`); never waits.
    pub fn ready(&self) -> bool {
        self.shared.usable_key(self.shared.clock.now()).is_some()
    }

    /// Unix seconds of the cached key's expiry, once one has been obtained.
    pub fn expiry_unix(&self) -> Option<i64> {
        match self.shared.expiry_unix.load(Ordering::Relaxed) {
            0 => None,
            t => Some(t),
        }
    }

    /// Successful exchanges so far.
    pub fn successes(&self) -> u64 {
        self.shared.successes.load(Ordering::Relaxed)
    }

    /// Failed exchanges so far.
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }
}

impl Drop for ExchangedKey {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl fmt::Debug for ExchangedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExchangedKey")
            .field("ready", &self.ready())
            .field("expiry_unix", &self.expiry_unix())
            .field("successes", &self.successes())
            .field("failures", &self.failures())
            .finish()
    }
}

/// Exchange errors as requests see them: an unreachable endpoint is still "no key" (E1004,
/// 503), not an upstream failure of the request itself.
fn as_credential_error(e: Error) -> Error {
    match e {
        Error::TokenExchange { .. }
        | Error::IssuedExpired { .. }
        | Error::IssuedUnusable { .. }
        | Error::ClockSkew { .. } => e,
        other => Error::TokenExchange {
            reason: other.to_string(),
        },
    }
}

/// Delay before retry number `n` (from 0): 1 s doubling to 30 s, each drawn from the upper
/// half of its step so a fleet restarted together does not retry in lockstep.
fn backoff(n: u32) -> Duration {
    let step = BACKOFF_MIN
        .saturating_mul(1u32.checked_shl(n.min(16)).unwrap_or(u32::MAX))
        .min(BACKOFF_MAX);
    step.mul_f64(0.5 + fastrand::f64() * 0.5)
}

async fn refresher(shared: Arc<Shared>, exchanger: Arc<dyn Exchanger>, refresh_before: Duration) {
    let mut failed_in_row: u32 = 0;
    // Of those, answers that issued a key the proxy could not use, in a row.
    let mut unusable_in_row: u32 = 0;
    // Keys issued for less than [`SHORT_KEY`] one after another (see below).
    let mut short_in_row: u32 = 0;
    loop {
        if failed_in_row == 0 {
            wait_until_due(&shared).await;
            // A refresh on the key's own schedule starts afresh: a run of refusals before it
            // does not make the next key wait out their backoff.
            let scheduled = shared.token.load().as_ref().is_some_and(|t| !t.early);
            if scheduled {
                shared.reset_refusals();
            }
        }
        let attempt = async {
            let started = shared.clock.now();
            let ms = started
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            shared
                .attempt_started_ms
                .store(ms.max(1), Ordering::Relaxed);
            let outcome = tokio::select! {
                r = exchanger.exchange(started) => r,
                _ = shared.clock.sleep(ATTEMPT_MAX) => Err(Error::TokenExchange {
                    reason: format!("no answer within {}s", ATTEMPT_MAX.as_secs()),
                }),
            };
            let now = shared.clock.now();
            outcome.and_then(|issued| {
                let token = Token::new(issued, now, refresh_before);
                if token.usable_until > now {
                    Ok(token)
                } else {
                    // A slow answer, or a clock ahead of the endpoint's: not the pair.
                    let took = now.duration_since(started).unwrap_or_default();
                    Err(Error::IssuedExpired {
                        reason: format!(
                            "the issued key expired before it could be used (the answer \
                             took {:.1}s)",
                            took.as_secs_f64()
                        ),
                    })
                }
            })
        };
        // Nothing watches this task: a panic in one attempt (in the exchanger, the HTTP
        // stack, the reading of the answer) would end the refreshing silently while the
        // last key runs out. It counts as a failed exchange and is retried with the
        // backoff. The attempt shares nothing it could leave half-changed (the key and
        // the counters are only touched below), so unwinding through it is sound. The
        // payload is not logged: it may quote anything, the key included.
        let outcome = match AssertUnwindSafe(attempt).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(_panic) => {
                tracing::error!("token exchange attempt panicked; counted as a failed exchange");
                Err(Error::TokenExchange {
                    reason: "internal error: the exchange attempt panicked".into(),
                })
            }
        };
        shared.attempt_started_ms.store(0, Ordering::Relaxed);
        match outcome {
            Ok(token) => {
                let lifetime = (token.expires_at)
                    .duration_since(shared.clock.now())
                    .unwrap_or_default();
                let expiry_unix = unix_seconds(token.expires_at);
                let expires_at = iso8601(token.expires_at);
                shared.token.store(Some(Arc::new(token)));
                shared.last_error.store(None);
                shared.expiry_unix.store(expiry_unix, Ordering::Relaxed);
                shared.successes.fetch_add(1, Ordering::Relaxed);
                shared.notify(ExchangeEvent::Success { expiry_unix });
                // Logged once the key is in place: whoever reads this line finds it served.
                tracing::info!(expires_at = %expires_at, "token exchange succeeded");
                shared.attempts.send_modify(|n| *n += 1);
                failed_in_row = 0;
                unusable_in_row = 0;
                // An endpoint that chooses the lifetime (rpc-v1), or a clock running ahead
                // of it, can issue keys of a few seconds: each was due for refresh at once,
                // and the proxy minted keys five times a second for good. Such keys are
                // paced as failures are, while they go on; a request that finds the key
                // run out meanwhile is told why at once (503), not after waiting 10 s for
                // an exchange that is not coming.
                if lifetime < SHORT_KEY {
                    let delay = backoff(short_in_row);
                    let lifetime_ms = u64::try_from(lifetime.as_millis()).unwrap_or(u64::MAX);
                    if short_in_row == 0 {
                        tracing::warn!(
                            lifetime_ms,
                            "the token exchange issued a key usable for under a second (a \
                             clock ahead of the endpoint's, or its own setting): exchanges are \
                             paced as after failures (1 s doubling to 30 s) while keys stay \
                             this short, and requests between keys get 503"
                        );
                    }
                    shared.last_error.store(Some(Arc::new(Error::TokenExchange {
                        reason: format!(
                            "no usable key between exchanges: they succeed, but the endpoint \
                             issues keys that expire {lifetime_ms} ms after issue, usable for \
                             under a second, and exchanges are paced"
                        ),
                    })));
                    short_in_row = short_in_row.saturating_add(1);
                    shared.clock.sleep(delay).await;
                } else {
                    short_in_row = 0;
                }
            }
            Err(e) => {
                // The failure's own suggestion: an endpoint failing or throttling is to be
                // waited out, where E1004's would have the pair checked.
                let suggestion = e.suggestion().unwrap_or_default();
                let e = as_credential_error(e);
                let delay = if matches!(
                    e,
                    Error::IssuedExpired { .. } | Error::IssuedUnusable { .. }
                ) {
                    // Counted until a success: other failures between them (an endpoint
                    // alternating) do not start the gap again.
                    unusable_in_row = unusable_in_row.saturating_add(1);
                    let gap = unusable_gap(unusable_in_row);
                    // One more try before the key in use runs out, however long the gap:
                    // a refresh that met a passing fault would otherwise leave requests
                    // 503 for most of a gap after the endpoint recovered.
                    let now = shared.clock.now();
                    let left = (shared.token.load().as_ref())
                        .and_then(|t| t.usable_until.duration_since(now).ok())
                        .and_then(|left| left.checked_sub(REFRESH_ROOM))
                        .filter(|&before| before >= BACKOFF_MIN);
                    left.map_or(gap, |before| gap.min(before))
                } else {
                    backoff(failed_in_row)
                };
                let line = e.line();
                shared.last_error.store(Some(Arc::new(e)));
                shared.failures.fetch_add(1, Ordering::Relaxed);
                shared.notify(ExchangeEvent::Failure);
                // Logged once the failure is recorded, like a success: whoever reads this
                // line and asks finds this reason in the 503 (not the previous state's). A
                // reload's candidate is not the key in use, and is not retried: the
                // reload drops it (and says so next).
                let candidate = (shared.running.as_ref())
                    .is_some_and(|running| !running.load(Ordering::Relaxed));
                if candidate {
                    tracing::warn!(
                        error = %line,
                        suggestion,
                        "token exchange failed for the reload's new credential (not the one \
                         in use)"
                    );
                } else {
                    let refusing = shared.refusal_streak.load(Ordering::Relaxed);
                    let key =
                        key_in_use(shared.token.load().as_deref(), refusing, shared.clock.now());
                    tracing::warn!(
                        error = %line,
                        suggestion,
                        retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        key = %key,
                        "token exchange failed"
                    );
                }
                shared.attempts.send_modify(|n| *n += 1);
                failed_in_row = failed_in_row.saturating_add(1);
                shared.clock.sleep(delay).await;
            }
        }
    }
}

/// Whether requests still get a key while its refresh fails, for the failure's log line:
/// the first failures of a refresh and those after the key ran out read the same, though
/// only the later ones leave every request a 503.
/// `refusing`: the control plane's 401s to the key are being backed off (until it accepts
/// one again, or a refresh on the key's own schedule).
fn key_in_use(token: Option<&Token>, refusing: bool, now: SystemTime) -> String {
    match token {
        Some(t) if t.usable_until > now && refusing => "refused by the control plane".to_string(),
        Some(t) if t.usable_until > now => format!("usable until {}", iso8601(t.usable_until)),
        _ => "none usable: requests are answered 503".to_string(),
    }
}

/// Returns when the cached key is due for refresh (at once when there is none).
async fn wait_until_due(shared: &Shared) {
    loop {
        let due = match &*shared.token.load() {
            Some(t) => t.refresh_at,
            None => return,
        };
        let wait = match due.duration_since(shared.clock.now()) {
            Ok(w) if !w.is_zero() => w,
            _ => return,
        };
        tokio::select! {
            _ = shared.clock.sleep(wait.min(RECHECK_EVERY)) => {}
            _ = shared.kick.notified() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TTL: Duration = Duration::from_secs(3600);

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_735_689_600) // 2025-01-01T00:00:00Z
    }

    fn parse(status: u16, body: Value) -> Result<IssuedKey, Error> {
        parse_response(status, body.to_string().as_bytes(), now(), TTL)
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn key_shapes() {
        for body in [
            json!({"apiKey": {"apiKeyValue": "k1"}}),
            json!({"ApiKey": {"ApiKeyValue": "k1"}}),
            json!({"apiKey": "k1"}),
            json!({"ApiKey": " k1 "}),
            json!({"RequestId": "x", "apiKey": {"apiKeyName": "n", "apiKeyValue": "k1"}}),
        ] {
            let k = parse(200, body.clone()).unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(k.key.expose(), "k1", "{body}");
            assert_eq!(k.expires_at, now() + TTL, "{body}");
        }
    }

    #[test]
    fn expiry_forms() {
        let exp = 1_735_693_200; // +1 h
        for body in [
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01T01:00:00Z"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01T09:00:00+08:00"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01T01:00Z"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01T01:00:00.000Z"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01 01:00:00"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01 01:00:00.000"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01 01:00:00 +0000"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2025-01-01 09:00:00 +08:00"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "2024-12-31 20:00:00 -0500"}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": "Wed, 01 Jan 2025 01:00:00 GMT"}}),
            json!({"ApiKey": {"ApiKeyValue": "k", "ExpireTime": "Wed, 01 Jan 2025 09:00:00 +0800"}}),
            json!({"ApiKey": {"ApiKeyValue": "k", "ExpireTime": exp}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": exp * 1000}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": exp.to_string()}}),
            json!({"apiKey": {"apiKeyValue": "k", "expireTime": (exp * 1000).to_string()}}),
            json!({"apiKey": "k", "expireTime": exp}),
            json!({"apiKey": {"apiKeyValue": "k"}, "ExpireTime": "2025-01-01T01:00:00Z"}),
        ] {
            // A TTL of two hours: a form read as unreadable cannot pass for the stated hour.
            let k = parse_response(200, body.to_string().as_bytes(), now(), 2 * TTL)
                .unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(k.expires_at, at(exp), "{body}");
        }
    }

    /// Epoch numbers: 0 or less is no expiry, and so is a zero value written as a date;
    /// above 10^11 is milliseconds, 10^11 itself still seconds.
    #[test]
    fn epoch_bounds() {
        for none in [
            json!(0),
            json!(-5),
            json!("0"),
            json!("1970-01-01T00:00:00Z"),
            json!("0001-01-01T00:00:00Z"),
            json!("0001-01-01 00:00:00"),
        ] {
            assert_eq!(parse_expiry(&none), None, "{none}");
        }
        let t = 100_000_000_000;
        assert_eq!(parse_expiry(&json!(t)), Some(at(t)));
        assert_eq!(
            parse_expiry(&json!(t + 1)),
            Some(UNIX_EPOCH + Duration::from_millis(t + 1))
        );
    }

    /// An expiry that cannot be read, or `null`, gives `token_ttl`; each unreadable one is
    /// logged once, naming its field, quoting neither it nor the key. One test for every
    /// answer that reaches the warning: a sibling test reaching it first without a
    /// subscriber would have tracing cache that call site as disabled for the whole test
    /// binary, and the capture here would miss its line (seen under load).
    #[test]
    fn unreadable_or_null_expiry_falls_back_to_ttl_and_is_logged_once() {
        let logs = crate::logging::Captured::default();
        let key = "tmpkey-secret-value";
        let expiries = tracing::subscriber::with_default(logs.subscriber(), || {
            [
                json!({"ApiKey": {"ApiKeyValue": key, "ExpireTime": "next Tuesday"}}),
                json!({"apiKey": {"apiKeyValue": key, "expireTime": "any minute"}}),
                json!({"apiKey": {"apiKeyValue": key, "expireTime": null}}),
            ]
            .map(|body| parse(200, body).map(|k| (k.expires_at, k.stated)).ok())
        });
        // A guess by this machine's clock: not shifted by the endpoint's `Date`.
        assert_eq!(expiries, [Some((now() + TTL, false)); 3]);
        let text = logs.text();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].contains("field=\"ExpireTime\""), "{text}");
        assert!(lines[1].contains("field=\"expireTime\""), "{text}");
        for quoted in [key, "Tuesday", "minute"] {
            assert!(!text.contains(quoted), "{quoted} in: {text}");
        }
    }

    /// A `Date` further ahead than a signature may be is a gateway's wrong clock, not the
    /// issuer's: the stated expiry stands (counted from it, a year-ahead `Date` made every
    /// key expired and refused). Within that, the life counts from the answer's arrival,
    /// unless it leaves none.
    #[test]
    fn a_date_past_the_signatures_skew_is_not_believed() {
        let asked = Asked {
            signed: at(1_000),
            answered: at(1_000),
        };
        // (stated expiry, the answer's `Date`, the expiry kept): 600 s behind, counted from
        // the arrival; past 15 minutes, or leaving the key no life, the stated time.
        for (stated, theirs, kept) in [
            (10_000, 1_600, 9_400),
            (10_000, 2_000, 10_000),
            (10_000, 400_000, 10_000),
            (1_603, 1_600, 1_603),
        ] {
            let issued = IssuedKey {
                key: Secret::new("k"),
                expires_at: at(stated),
                stated: true,
            };
            let got = on_our_clock(issued, asked, Some(at(theirs))).expires_at;
            assert_eq!(got, at(kept), "Date at {theirs}");
        }
    }

    /// A failure's line says whether the key still serves.
    #[test]
    fn a_failures_line_says_whether_a_key_still_serves() {
        let issued = |secs| IssuedKey {
            key: Secret::new("k"),
            expires_at: at(secs),
            stated: true,
        };
        let token = Token::new(issued(1_000), at(900), Duration::from_secs(60));
        assert_eq!(
            super::key_in_use(Some(&token), false, at(990)),
            "usable until 1970-01-01T00:16:35Z"
        );
        assert_eq!(
            super::key_in_use(Some(&token), true, at(990)),
            "refused by the control plane"
        );
        let none = "none usable: requests are answered 503";
        assert_eq!(super::key_in_use(Some(&token), true, at(995)), none);
        assert_eq!(super::key_in_use(None, false, at(0)), none);
    }

    /// A key past its expiry, or within the 5 s margin of it, is refused, naming the
    /// expiry; one just beyond the margin is taken.
    #[test]
    fn past_or_nearly_past_expiry_is_an_error() {
        let start = 1_735_689_600;
        for (exp, shown) in [
            (1_000_000_000, "2001-09-09T01:46:40Z"),
            (start + 3, "2025-01-01T00:00:03Z"),
            (start + 5, "2025-01-01T00:00:05Z"),
        ] {
            match parse(200, json!({"apiKey": "k", "expireTime": exp})) {
                Err(Error::IssuedExpired { reason }) => assert!(
                    reason.contains(&format!("expires at {shown}, already (nearly) past")),
                    "{reason}"
                ),
                other => panic!("{exp}: {other:?}"),
            }
        }
        let k = parse(200, json!({"apiKey": "k", "expireTime": start + 6})).unwrap();
        assert_eq!(k.expires_at, at(start + 6));
    }

    /// A secret in a code is taken out however the JSON spells it, and however much of it
    /// the code's characters keep.
    #[test]
    fn a_secret_in_a_code_is_taken_out_in_any_spelling() {
        let secret = Secret::new("Ab/cd1234567890Ef");
        for body in [
            r#"{"Code": "InvalidAccessKeySecret.Ab/cd1234567890Ef"}"#,
            r#"{"Code": "InvalidAccessKeySecret.Ab\/cd1234567890Ef"}"#,
            r#"{"code": "InvalidAccessKeySecret.\u0041b/cd1234567890Ef"}"#,
            r#"{"Code": "InvalidAccessKeySecret.Abcd1234567890Ef"}"#,
            r#"{"Code": "InvalidAccessKeySecret.abcd1234567890ef"}"#,
            r#"{"Code": "InvalidAccessKeySecret.AB\/CD1234567890EF.x"}"#,
        ] {
            let rid = without(&secret, Bytes::from(body));
            let e = parse_response(400, &rid, now(), TTL).err();
            let said = e.map(|e| e.to_string()).unwrap_or_default();
            assert!(said.contains("InvalidAccessKeySecret."), "{body}: {said}");
            assert!(!said.contains("1234567890"), "{body}: {said}");
        }
        let other = Bytes::from(r#"{"Code": "SignatureDoesNotMatch"}"#);
        assert_eq!(without(&secret, other.clone()), other);
        // A secret too short to be looked for in any case leaves a code that holds its
        // letters in another case as it is.
        let skew = Bytes::from(r#"{"Code": "InvalidTimeStamp.Expired"}"#);
        assert_eq!(without(&Secret::new("EXPIRED"), skew.clone()), skew);
    }

    #[test]
    fn error_answers_name_status_and_code_only() {
        let body = json!({"Code": "InvalidAccessKeyId.NotFound", "Message": "Specified access key is not found: LTAIsecretish", "RequestId": "r"});
        let e = parse(404, body).err().unwrap_or(Error::MissingCredential);
        assert_eq!(e.code(), "E1004");
        let text = e.to_string();
        assert!(
            text.contains("404") && text.contains("InvalidAccessKeyId.NotFound"),
            "{text}"
        );
        assert!(
            !text.contains("LTAI") && !text.contains("Specified"),
            "{text}"
        );

        let e = parse(
            403,
            json!({"code": "SignatureDoesNotMatch", "message": "m"}),
        );
        assert!(matches!(e, Err(Error::TokenExchange { .. })), "{e:?}");

        let e = parse_response(500, b"<html>oops k=secret</html>", now(), TTL);
        match e {
            Err(Error::TokenExchange { reason }) => {
                assert_eq!(reason, "the endpoint answered HTTP 500")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn success_status_without_key() {
        let e = parse(200, json!({"Code": "Throttling.User", "Message": "m"}));
        assert!(
            matches!(&e, Err(Error::TokenExchange { reason }) if reason.contains("Throttling.User")),
            "{e:?}"
        );
        // A success in an envelope of its own, with no key this proxy finds in it.
        for wrapped in [
            json!({"code": "200", "data": {"key": "k"}}),
            json!({"Code": "OK", "Data": {"Token": "k"}}),
            json!({"success": true, "code": 0, "result": {}}),
            json!({"Code": "Success"}),
        ] {
            let e = parse(200, wrapped.clone());
            assert!(
                matches!(e, Err(Error::IssuedUnusable { .. })),
                "{wrapped}: {e:?}"
            );
        }
        // A success with no key found: the endpoint may have created one, so retries are
        // spaced out (see `unusable_gap`).
        for blank in [
            json!({"apiKey": {"apiKeyValue": " "}}),
            json!({"apiKey": " "}),
            json!({"RequestId": "r", "Data": {"Key": "k"}}),
        ] {
            let e = parse(200, blank.clone());
            assert!(
                matches!(e, Err(Error::IssuedUnusable { .. })),
                "{blank}: {e:?}"
            );
        }
        // A blank key is no key: the other spelling is still looked at.
        let k = parse(200, json!({"apiKey": " ", "ApiKey": "k2"})).unwrap();
        assert_eq!(k.key.expose(), "k2");
        // One that says it failed is a failure, whatever its code.
        let e = parse(
            200,
            json!({"success": false, "code": 0, "message": "AccessDenied"}),
        );
        assert!(
            matches!(&e, Err(Error::TokenExchange { reason }) if reason.contains("success: false")),
            "{e:?}"
        );
        let e = parse_response(200, b"not json", now(), TTL);
        assert!(matches!(e, Err(Error::TokenExchange { .. })), "{e:?}");
    }

    #[test]
    fn a_skew_is_said_with_its_size_and_way() {
        let t = now();
        let s = Duration::from_secs;
        let at = |signed: SystemTime| Asked {
            signed,
            answered: signed + s(8),
        };
        for (asked, theirs, said) in [
            (at(t + s(7380)), t, Some("about 2 h 3 min ahead of")),
            (at(t + s(7199)), t, Some("about 2 h ahead of")),
            (at(t), t + s(3608), Some("about 1 h behind")),
            (at(t), t + s(1208), Some("about 20 min behind")),
            (at(t + s(45)), t, Some("about 45 s ahead of")),
            (at(t), t + s(2 * 86_400), Some("is over a day behind")),
            (at(t + s(4)), t, None),
            (at(t), t + s(12), None),
            // A slow answer: the endpoint's time between asking and answering.
            (at(t), t + s(7), None),
        ] {
            let got = skew(asked, theirs).map(|(g, _)| g);
            assert_eq!(
                got.as_deref().map(|g| g.contains(said.unwrap_or("-"))),
                said.map(|_| true),
                "{got:?}"
            );
        }
        let e = Error::ClockSkew {
            reason: "HTTP 400, InvalidTimeStamp.Expired".into(),
        };
        let e = with_skew(e, at(t + s(3600)), Some(t));
        assert!(
            e.to_string().ends_with(
                "(HTTP 400, InvalidTimeStamp.Expired; this machine's clock is about 1 h ahead of the endpoint's)"
            ),
            "{e}"
        );
        let other = Error::TokenExchange { reason: "r".into() };
        assert_eq!(with_skew(other.clone(), at(t + s(3600)), Some(t)), other);
        // A key expired on arrival, this machine behind: the clock is not why.
        let expired = Error::IssuedExpired { reason: "r".into() };
        let behind = with_skew(expired.clone(), at(t), Some(t + s(3600))).to_string();
        assert!(behind.ends_with("expired by its own clock too"), "{behind}");
        let ahead = with_skew(expired, at(t + s(3600)), Some(t));
        assert!(ahead.to_string().contains("1 h ahead of"), "{ahead}");
    }

    #[test]
    fn clock_skew_codes() {
        for code in [
            "InvalidTimeStamp.Expired",
            "InvalidTimestamp.Expired",
            "RequestTimeTooSkewed",
            "ClockSkew",
        ] {
            let e = parse(400, json!({"Code": code, "Message": "m"}));
            assert!(matches!(e, Err(Error::ClockSkew { .. })), "{code}: {e:?}");
        }
        // The proxy's own request at fault, or a wrong secret: no "sync the clock".
        for code in [
            "InvalidTimeStamp.Format",
            "MissingTimestamp",
            "InvalidTimeStamp",
            "SignatureDoesNotMatch",
        ] {
            let e = parse(400, json!({"Code": code, "Message": "m"}));
            assert!(
                matches!(&e, Err(Error::TokenExchange { reason }) if reason.contains(code)),
                "{code}: {e:?}"
            );
        }
    }

    #[test]
    fn throttling_is_temporary() {
        let body = |code: &str| json!({"Code": code, "Message": "m"}).to_string();
        assert!(is_temporary(429, b""));
        assert!(is_temporary(503, b"<html>"));
        assert!(is_temporary(400, body("Throttling.User").as_bytes()));
        assert!(is_temporary(200, body("Throttling").as_bytes()));
        assert!(!is_temporary(403, body("Forbidden.RAM").as_bytes()));
        assert!(!is_temporary(
            400,
            body("InvalidThrottlingConfig").as_bytes()
        ));
    }

    /// A numeric code is named like a text one; a blank `Code` is no code, and `code` is
    /// looked at next.
    #[test]
    fn numeric_and_blank_codes() {
        let e = parse(400, json!({"Code": 4001, "Message": "m"}));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.ends_with("HTTP 400, 4001"), "{text}");
        let body = json!({"Code": "", "code": "Throttling.User"}).to_string();
        assert!(is_temporary(400, body.as_bytes()));
    }

    #[test]
    fn odd_codes_are_sanitized() {
        let e = parse(400, json!({"Code": "Bad Code\n<script>", "Message": "m"}));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.ends_with("HTTP 400, BadCodescript"), "{text}");
    }

    #[test]
    fn host_labels() {
        assert_eq!(host_label("box-1.example"), "box-1.example");
        assert_eq!(host_label("My_Box ä/x"), "My-Box---x");
        assert_eq!(host_label(""), "unknown");
        assert_eq!(host_label(&"a".repeat(100)), "a".repeat(63));
    }

    #[test]
    fn refresh_point() {
        let issued = |secs| IssuedKey {
            key: Secret::new("k"),
            expires_at: now() + Duration::from_secs(secs),
            stated: true,
        };
        // min(refresh_before, lifetime / 2) before expiry.
        let t = Token::new(issued(20), now(), Duration::from_secs(10));
        assert_eq!(t.refresh_at, now() + Duration::from_secs(10));
        let t = Token::new(issued(3600), now(), Duration::from_secs(300));
        assert_eq!(t.refresh_at, now() + Duration::from_secs(3300));
        let t = Token::new(issued(60), now(), Duration::from_secs(300));
        assert_eq!(t.refresh_at, now() + Duration::from_secs(30));
        // With room for the exchange before the key stops being handed out: 5 s, or half
        // of its usable life.
        let t = Token::new(issued(60), now(), Duration::ZERO);
        assert_eq!(t.refresh_at, now() + Duration::from_secs(50));
        assert_eq!(t.usable_until, now() + Duration::from_secs(55));
        let t = Token::new(issued(8), now(), Duration::from_secs(10));
        assert_eq!(t.refresh_at, now() + Duration::from_millis(1500));
        assert_eq!(t.usable_until, now() + Duration::from_secs(3));
        // SPEC §5's point for the shortest keys the proxy asks for, at the least lead.
        let t = Token::new(issued(20), now(), Duration::from_secs(10));
        assert_eq!(t.usable_until - Duration::from_secs(5), t.refresh_at);
    }

    #[test]
    fn refusal_gap_doubles_to_an_hour() {
        for (in_row, secs) in [(0, 30), (1, 30), (2, 60), (3, 120), (7, 1920), (8, 3600)] {
            assert_eq!(refusal_gap(in_row), Duration::from_secs(secs), "{in_row}");
        }
        assert_eq!(refusal_gap(u32::MAX), REFUSAL_GAP_MAX);
        for (in_row, secs) in [(1, 30), (2, 60), (3, 120), (4, 120), (9, 120)] {
            let step = Duration::from_secs(secs);
            assert_eq!(unusable_step(in_row), step, "{in_row}");
            let gap = unusable_gap(in_row);
            assert!(gap >= step / 2 && gap <= step, "{in_row}: {gap:?}");
        }
        assert_eq!(unusable_step(u32::MAX), UNUSABLE_GAP_MAX);
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter() {
        for (n, step) in [(0, 1), (1, 2), (2, 4), (4, 16), (5, 30), (40, 30)] {
            let d = backoff(n);
            let step = Duration::from_secs(step);
            assert!(d >= step / 2 && d <= step, "{n}: {d:?}");
        }
    }
}
