//! `logging::format_access`, the access line's hand-written fast path, against what it
//! stands in for: the `tracing` event of `logging::access_via_tracing` as the fmt layer
//! `logging::init` installs prints it (text and JSON, no colours), for any request line a
//! client can send.
//!
//! Input: a control byte (the format, an E-code or none), two bytes of status, eight of
//! duration, then the method, the path, the upstream and the reason split at NUL. The
//! method is any token `http` takes; the path any bytes hyper takes in a request target
//! (visible ASCII, and UTF-8 past it), shown as `logging::access` shows it (`shown_path`,
//! at most `SHOWN_PATH_MAX` bytes and `CUT`); the upstream a host as a URL gives it; the
//! reason any text (with an E-code only). Invariants: the two lines are equal byte for
//! byte past the timestamp; each is one line; the JSON one is an object whose fields are
//! the inputs; the text one's `name=value` fields read back as the inputs (nothing in a
//! path or a host opens a field of its own; the reason, last, is quoted whole).
#![no_main]

use std::cell::RefCell;
use std::io::Write;
use std::time::{Duration, SystemTime};

use abx_proxy::cli::LogFormat;
use abx_proxy::logging::{
    access_via_tracing, format_access, shown_path, subscriber, AccessLine, CUT, SHOWN_PATH_MAX,
};
use libfuzzer_sys::fuzz_target;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::EnvFilter;

const CODES: [&str; 3] = ["E3001", "E4002", "E5003"];
const PLANES: [&str; 2] = ["api", "envd"];
/// What a URL's host and port may hold, as the settings keep them.
const HOST: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789.-:[]";
/// Stands for the timestamp in the tracing line; ours is cut off up to the same place.
const STAMP: &str = "STAMP";

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<11>() else {
        return;
    };
    let format = match head[0] & 1 {
        0 => LogFormat::Text,
        _ => LogFormat::Json,
    };
    let error = match usize::from(head[0] >> 1) % 4 {
        0 => None,
        i => Some(CODES[i - 1]),
    };
    let plane = PLANES[usize::from(head[0] >> 3) & 1];
    let status = u16::from_le_bytes([head[1], head[2]]);
    let elapsed = Duration::from_nanos(u64::from_le_bytes(head[3..11].try_into().unwrap()));
    let mut parts = rest.split(|b| *b == 0);
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        return;
    };
    let upstream = parts.next();
    let reason = parts.next().map(String::from_utf8_lossy);
    let reason = error.and(reason.as_deref());
    let Ok(method) = http::Method::from_bytes(method) else {
        return;
    };
    // What httparse leaves of a target: no controls, no space, no DEL.
    let path: Vec<u8> = path
        .iter()
        .copied()
        .filter(|b| *b > 0x20 && *b != 0x7f)
        .collect();
    let Ok(path) = std::str::from_utf8(&path) else {
        return;
    };
    let upstream: String = (upstream.unwrap_or_default().iter())
        .map(|b| char::from(HOST[usize::from(*b) % HOST.len()]))
        .collect();
    let shown = shown_path(path);
    assert!(shown.len() <= SHOWN_PATH_MAX + CUT.len(), "{}", shown.len());
    assert_eq!(
        shown.ends_with(CUT),
        shown.len() > SHOWN_PATH_MAX,
        "{shown}"
    );
    let line = AccessLine {
        method: &method,
        path: &shown,
        plane,
        status,
        elapsed,
        upstream: &upstream,
        error,
        reason,
    };

    let mut ours = Vec::new();
    format_access(&mut ours, format, SystemTime::now(), &line);
    let ours = String::from_utf8(ours).expect("UTF-8");
    let theirs = tracing_line(format, &line);
    assert_eq!(without_stamp(format, &ours), without_stamp(format, &theirs));
    assert_eq!(ours.find('\n'), Some(ours.len() - 1), "one line: {ours:?}");

    let fields: Vec<(String, String)> = match format {
        LogFormat::Json => {
            let v: serde_json::Value = serde_json::from_str(&ours).expect("JSON");
            let obj = v.as_object().expect("an object");
            (obj.iter())
                .filter(|(k, _)| *k != "timestamp" && *k != "duration_ms")
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => (k.clone(), s.clone()),
                    other => (k.clone(), other.to_string()),
                })
                .collect()
        }
        LogFormat::Text => {
            let (_, after) = ours
                .trim_end()
                .split_once(" abx_proxy::access: ")
                .expect("target");
            let after = match reason {
                Some(reason) => {
                    let quoted = format!(" reason={reason:?}");
                    after
                        .strip_suffix(&quoted)
                        .expect("the reason, last and quoted")
                }
                None => after,
            };
            (after.split(' '))
                .map(|f| {
                    let (k, v) = f.split_once('=').expect("name=value");
                    (k.to_string(), v.trim_matches('"').to_string())
                })
                .filter(|(k, _)| k != "duration_ms")
                .collect()
        }
    };
    let mut want = vec![
        ("method", method.to_string()),
        ("path", shown.to_string()),
        ("plane", plane.to_string()),
        ("status", status.to_string()),
        ("upstream", upstream.clone()),
    ];
    if let Some(code) = error {
        want.push(("error", code.to_string()));
    }
    if let (Some(reason), LogFormat::Json) = (reason, format) {
        want.push(("reason", reason.to_string()));
    }
    if format == LogFormat::Json {
        want.push(("level", "INFO".into()));
        want.push(("target", "abx_proxy::access".into()));
    }
    let mut got: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut want: Vec<(&str, &str)> = want.iter().map(|(k, v)| (*k, v.as_str())).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "{ours:?}");
});

/// The line past its timestamp.
fn without_stamp(format: LogFormat, line: &str) -> String {
    match format {
        LogFormat::Text => line.split_once(' ').expect("a timestamp").1.to_string(),
        LogFormat::Json => {
            let (_, after) = line.split_once("\"timestamp\":\"").expect("a timestamp");
            after.split_once('"').expect("its end").1.to_string()
        }
    }
}

/// The event as `logging::init`'s subscriber prints it, its timestamp `STAMP`.
fn tracing_line(format: LogFormat, line: &AccessLine<'_>) -> String {
    CAPTURED.with(|c| c.borrow_mut().clear());
    let filter = EnvFilter::new("info");
    let subscriber = subscriber(format, filter, false, Stamp, || Captured);
    tracing::dispatcher::with_default(&subscriber, || access_via_tracing(line));
    let text = CAPTURED.with(|c| c.borrow().clone());
    String::from_utf8(text).expect("UTF-8")
}

struct Stamp;

impl FormatTime for Stamp {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        w.write_str(STAMP)
    }
}

thread_local! {
    /// What the subscriber of [`tracing_line`] wrote.
    static CAPTURED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Writes to [`CAPTURED`].
struct Captured;

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURED.with(|c| c.borrow_mut().extend_from_slice(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
