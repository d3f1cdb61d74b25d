//! Logging: `tracing` to stderr, text or JSON (one object per line, fields at the top
//! level), filtered by `--log-level`, else `RUST_LOG`, else the command's default.
//!
//! Also owns the per-request access line (SPEC §7, [`access`]). tracing-subscriber's fmt
//! layer spends most of a request's logging budget on its generic machinery (field
//! visitors, a dynamic writer, timestamp formatting through `fmt`), so the access line is
//! formatted here by hand, byte for byte what that layer prints for the same event, and
//! handed to [`crate::log_writer`] whole; on the workers, several lines at once (see
//! [`batch_this_thread`]). Filtering stays with the installed subscriber: the line is
//! only written when it would let `abx_proxy::access` at info through. Whenever the fast
//! path cannot vouch for identical output (logging not set up by [`init`], colours on,
//! inside a span), the event goes through `tracing` as before.

use std::cell::{Cell, RefCell};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// The target of the access line; filters name it (`RUST_LOG=info,abx_proxy::access=off`).
pub const ACCESS_TARGET: &str = "abx_proxy::access";

/// What [`init`] installed, as far as [`access`] needs to know: `FALLBACK` until a
/// subscriber without colours is in place, then the format it prints.
static FAST_FORMAT: AtomicU8 = AtomicU8::new(FALLBACK);
const FALLBACK: u8 = 0;
const TEXT: u8 = 1;
const JSON: u8 = 2;

/// Whether [`init`] installed the JSON subscriber (see [`warning`]).
static JSON_LOGS: AtomicBool = AtomicBool::new(false);

/// Whether settings warnings are log lines in either format (see [`warning`]).
static WARNINGS_LOGGED: AtomicBool = AtomicBool::new(false);

/// A settings warning: `warning: …` on stderr, as every command prints them; where the
/// logs are JSON, an object through the subscriber instead, so that a log pipeline reading
/// one object per line never meets a bare line; and a line like any other under `serve`
/// (see [`warnings_as_log_lines`]). What a terminal would act on is escaped: a warning
/// quotes values from `.env` files, and a line feed or an escape sequence in one could
/// forge or hide the very warning that says where the key goes.
pub fn warning(text: &str) {
    let text = crate::providers::manifest::printable(text);
    let logged = WARNINGS_LOGGED.load(Ordering::Acquire) && INSTALLED.load(Ordering::Acquire);
    if JSON_LOGS.load(Ordering::Acquire) || logged {
        tracing::warn!("{text}");
    } else {
        stderr_line(&format!("warning: {text}"));
    }
}

/// One line on stderr, or nothing when stderr is gone: `eprintln!` panics then, and a
/// terminal closed under a running proxy (SIGHUP, which reloads) must not turn every log
/// line into a panic, nor the exit code of a failed start into 101.
pub fn stderr_line(text: &str) {
    let mut line = Vec::with_capacity(text.len() + 1);
    line.extend_from_slice(text.as_bytes());
    line.push(b'\n');
    crate::log_writer::write(line);
}

/// Whether [`init`] installed its subscriber.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Settings warnings are log lines, with a timestamp and a level, in text too, once
/// [`init`] has installed its subscriber (its own warning of a `RUST_LOG` it refused
/// included): for `serve`, whose every other line is one. A bare `warning: …` among them
/// (at the start, and at a reload) had neither, and a shipper that starts a record at a
/// timestamp glued it to the line before.
pub fn warnings_as_log_lines() {
    WARNINGS_LOGGED.store(true, Ordering::Release);
}

/// The error that ends a command, in the house format; where the logs are JSON, an object
/// like every other line (a pipeline reading one object per line would refuse the line
/// that says why the unit failed). Then waits, a moment at most, for the lines queued
/// before it to be written: the process exits next.
pub fn fatal(e: &crate::Error) {
    if JSON_LOGS.load(Ordering::Acquire) {
        let suggestion = e.suggestion();
        crate::log_writer::write(error_object(
            &e.line(),
            Some(e.code()),
            suggestion.as_deref(),
        ));
    } else {
        stderr_line(&e.render());
    }
    finish();
}

/// A command line refused before logging is set up (a secret given as a flag): as an
/// object when `json` (`--log-format json` was asked for), else as the line it is.
pub fn refused(json: bool, text: &str) {
    if json {
        crate::log_writer::write(error_object(text, None, None));
    } else {
        stderr_line(&format!("error: {text}"));
    }
}

/// From now on a panic is one line through the log writer, an ERROR object where the logs
/// are JSON (with `RUST_BACKTRACE`, the backtrace follows, in the object or after the
/// line). The default hook wrote a plain-text block straight to stderr: among
/// `--log-format json` lines, and, with a log reader that had stalled, blocking the thread
/// that panicked (on the main runtime, accepts, probes and signals stopped with it).
pub fn panics_as_lines() {
    std::panic::set_hook(Box::new(|info| {
        let what = (info.payload().downcast_ref::<&str>().copied())
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("Box<dyn Any>");
        let at = info.location().map(|l| l.to_string()).unwrap_or_default();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let mut text = format!("thread '{name}' panicked at {at}: {what}");
        // RUST_BACKTRACE asks for one, as of the default hook.
        let trace = std::backtrace::Backtrace::capture();
        if trace.status() == std::backtrace::BacktraceStatus::Captured {
            text.push_str(&format!("\n{trace}"));
        }
        let json = JSON_LOGS.load(Ordering::Acquire);
        crate::log_writer::write_masked(panic_line(&text, json));
    }));
}

/// A panic's line: an ERROR object, or a text line as the subscriber's ERROR lines are.
fn panic_line(text: &str, json: bool) -> Vec<u8> {
    if json {
        return error_object(text, None, None);
    }
    let mut line = Vec::with_capacity(text.len() + 64);
    write_timestamp(&mut line, SystemTime::now());
    line.extend_from_slice(b" ERROR abx_proxy: ");
    line.extend_from_slice(text.as_bytes());
    line.push(b'\n');
    line
}

/// An ERROR line as the JSON subscriber prints one, written whatever the filter says: the
/// line that says why the process ends must not be filtered away (`--log-level off`).
fn error_object(message: &str, code: Option<&str>, suggestion: Option<&str>) -> Vec<u8> {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"{\"timestamp\":\"");
    write_timestamp(&mut line, SystemTime::now());
    line.extend_from_slice(b"\",\"level\":\"ERROR\",\"message\":");
    write_json_str(&mut line, message);
    for (key, value) in [("code", code), ("suggestion", suggestion)] {
        if let Some(value) = value {
            line.extend_from_slice(format!(",\"{key}\":").as_bytes());
            write_json_str(&mut line, value);
        }
    }
    line.extend_from_slice(b",\"target\":\"abx_proxy\"}\n");
    line
}

/// Waits up to a second for the queued log lines to be written (see [`crate::log_writer`]):
/// before the process exits.
pub fn finish() {
    crate::log_writer::flush(Duration::from_secs(1));
}

/// `level` is `--log-level`; blank, it is not given (as a blank `RUST_LOG` is unset).
pub fn init(format: LogFormat, level: Option<&str>, default: &str) {
    let mut refused = None;
    let filter = level
        .filter(|l| !l.trim().is_empty())
        .and_then(|l| EnvFilter::try_new(quiet_h2(&quiet_rustls(l))).ok())
        .or_else(|| rust_log(&mut refused))
        .unwrap_or_else(|| EnvFilter::new(quiet_rustls(default)));
    // Colour codes only for a terminal: journald, kubectl logs and pipes get plain text.
    let ansi = std::io::stderr().is_terminal();
    let timer = tracing_subscriber::fmt::time::SystemTime;
    let subscriber = subscriber(format, filter, ansi, timer, crate::log_writer::Stderr);
    let installed = subscriber.try_init().is_ok();
    JSON_LOGS.store(installed && format == LogFormat::Json, Ordering::Release);
    INSTALLED.store(installed, Ordering::Release);
    // The hand-written line mirrors exactly this subscriber's plain output; if another
    // subscriber was already installed, or it paints colours, `access` defers to tracing.
    if installed && !ansi {
        let fast = match format {
            LogFormat::Text => TEXT,
            LogFormat::Json => JSON,
        };
        FAST_FORMAT.store(fast, Ordering::Release);
    }
    if let Some(why) = refused {
        warning(&format!(
            "RUST_LOG is not a filter ({why}); logging at {default:?}"
        ));
    }
}

/// The subscriber [`init`] installs, in `format`, colours only when `ansi`, its lines
/// stamped by `timer` and written by `writer`: one place, so that the benches, tests and
/// fuzz targets that hold the access line's fast path to it hold it to this one.
#[doc(hidden)]
pub fn subscriber<T, W>(
    format: LogFormat,
    filter: EnvFilter,
    ansi: bool,
    timer: T,
    writer: W,
) -> tracing::Dispatch
where
    T: FormatTime + Send + Sync + 'static,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    // Internal errors off: on a failed write the subscriber reports it with `eprintln!`,
    // which panics when stderr is what failed (see `stderr_line`).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_timer(timer)
        .with_writer(writer)
        .log_internal_errors(false);
    match format {
        LogFormat::Text => tracing::Dispatch::new(builder.finish()),
        LogFormat::Json => tracing::Dispatch::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .finish(),
        ),
    }
}

/// `filter` with rustls held to errors when its level for everything is `info` or `warn`
/// and it names no rustls target: rustls warns of what a client's handshake held (a
/// malformed SNI name, an address given as one), a line per handshake that any client
/// reaching the listener could repeat without end, and that pushed the proxy's own lines
/// out of a log reader that cannot keep up (nginx logs handshake trouble at `info`). A
/// `debug` or `trace` level, or a directive for rustls, keeps them; `RUST_LOG=info` is held
/// as `--log-level info` is (containers set levels that way), and so is
/// `info,abx_proxy::access=off`, which the proxy itself suggests.
fn quiet_rustls(filter: &str) -> String {
    let directives = || filter.split(',').map(str::trim);
    let everything = directives()
        .filter_map(|d| d.parse::<LevelFilter>().ok())
        .next_back();
    // As in `quiet_h2`: a span's or a field's directive names no target whole.
    let names_rustls = |d: &str| {
        let target = d.split('=').next().unwrap_or_default();
        let level = d.parse::<LevelFilter>().is_ok();
        !level && !d.contains('[') && !target.is_empty() && "rustls".starts_with(target)
    };
    let quiet = everything.is_some_and(|l| l == LevelFilter::INFO || l == LevelFilter::WARN);
    match quiet && !directives().any(names_rustls) {
        true => format!("{},rustls=error", filter.trim()),
        false => filter.to_string(),
    }
}

/// `filter` with h2 held to `info` when it sets `debug` or `trace` for everything and
/// nothing for h2: h2's debug lines cost about ten times a request's own work (a line per
/// frame), and one quotes an HTTP/2 `:path` it refused, query string and all (a signed
/// URL's signature). A directive for h2 (`debug,h2=debug`) keeps them.
fn quiet_h2(filter: &str) -> String {
    let directives = || filter.split(',').map(str::trim);
    let verbose = directives().any(|d| {
        d.parse::<LevelFilter>()
            .is_ok_and(|l| l >= LevelFilter::DEBUG)
    });
    // A directive for h2 itself; one for a module below it (`h2::codec=info`) is more
    // specific than `h2=info` and still wins, while the rest of h2 stays held.
    // Not a span's or a field's directive: it only lets lines through, in its spans or
    // for its fields, and everything else still goes by the level for everything.
    let names_h2 = |d: &str| {
        let target = d.split('=').next().unwrap_or_default();
        !d.contains('[') && !target.is_empty() && "h2".starts_with(target)
    };
    match verbose && !directives().any(names_h2) {
        true => format!("{filter},h2=info"),
        false => filter.to_string(),
    }
}

/// `filter` with each directive trimmed and empty ones dropped. tracing-subscriber trims a
/// directive to parse it but keeps its spaces in what it takes: `info ` (a YAML block
/// value's newline, a space after a comma) was a target named `info `, and not one line
/// was logged; `warn, abx_proxy=debug` did not parse.
pub fn normalized(filter: &str) -> String {
    let directives = filter.split(',').map(str::trim).filter(|d| !d.is_empty());
    directives.collect::<Vec<_>>().join(",")
}

/// Why `filter` would not log what its writer meant, if so: it does not parse, or no
/// directive covers the proxy's own lines, its errors included. `tracing` reads a bare
/// word as a target, so `--log-level warning` (journalctl's and syslog's spelling) chose a
/// module of that name: not one line was logged, warnings and errors included, and nothing
/// said so. A directive covers the proxy's lines when it is a level alone, or when
/// `abx_proxy::` starts with its target (`tracing` matches a line's target by prefix);
/// spans' directives cover nothing (the proxy opens none). A covering `off` is silence
/// asked for (`off`, `warn,abx_proxy=off`). Other crates' directives are left alone:
/// `RUST_LOG` is often shared (`debug,reqwest=info`).
pub fn filter_refusal(filter: &str) -> Option<String> {
    let filter = &normalized(filter);
    if let Err(e) = EnvFilter::try_new(filter) {
        return Some(e.to_string());
    }
    let directives: Vec<&str> = filter.split(',').collect();
    // Whether a directive covers all of the proxy's lines: a level alone, or one for a
    // target `abx_proxy::` starts with (`abx`, `abx_proxy`), read as `tracing` reads it.
    // A module's alone (`abx_proxy::serve=info`) leaves the others' errors out: the
    // reload's, the exchange's, the listener's. Which of several covers does not matter:
    // any level, `off` included, was asked for.
    let covers = |d: &&str| {
        let target = d.split_once('=').map_or(*d, |(t, _)| t);
        !d.contains('[') && (d.parse::<LevelFilter>().is_ok() || "abx_proxy::".starts_with(target))
    };
    // A target with a space in it is no line's (a comma forgotten: `warn abx_proxy=debug`,
    // or a YAML block's newline), whatever else covers the proxy's lines.
    let spaced = directives.iter().find(|d| {
        let target = d.split(['=', '[']).next().unwrap_or_default();
        target.contains(char::is_whitespace)
    });
    if let Some(d) = spaced {
        return Some(format!(
            "`{}` names a target with a space in it, which no line has (a comma missing?)",
            d.escape_debug()
        ));
    }
    if directives.iter().any(covers) {
        return None;
    }
    let levels = "trace, debug, info, warn, error, off";
    let meant = directives.iter().find_map(|d| {
        let level = match d.to_ascii_lowercase().as_str() {
            "warning" | "warnings" => "warn",
            "err" | "errors" | "crit" | "critical" | "fatal" | "alert" | "emerg" => "error",
            "notice" | "information" | "informational" => "info",
            "verbose" => "debug",
            "all" => "trace",
            "none" | "quiet" | "silent" => "off",
            _ => return None,
        };
        Some((d, level))
    });
    Some(match meant {
        Some((word, level)) => {
            format!("`{word}` is no level (did you mean `{level}`? levels: {levels})")
        }
        None => format!(
            "it leaves out the proxy's own lines, or all but a module's, errors included: it \
             sets no level ({levels}) for everything or for `abx_proxy` (add one: \
             `info,{filter}`)"
        ),
    })
}

/// `RUST_LOG`, when set to something: blank is unset, as for every setting (SPEC §2; a
/// `RUST_LOG=${RUST_LOG}` in a manifest would otherwise turn every line off), and a filter
/// that does not parse is said so in `refused`, not dropped without a word.
fn rust_log(refused: &mut Option<String>) -> Option<EnvFilter> {
    let raw = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => v,
        // Said, like any other filter that does not parse, rather than dropped silently.
        Err(std::env::VarError::NotUnicode(_)) => {
            *refused = Some("not valid UTF-8".into());
            return None;
        }
        _ => return None,
    };
    match filter_refusal(&raw) {
        Some(why) => {
            *refused = Some(why);
            None
        }
        None => EnvFilter::try_new(quiet_h2(&quiet_rustls(&normalized(&raw)))).ok(),
    }
}

/// The fields of one access line (SPEC §7), in the order they are printed.
#[derive(Debug, Clone, Copy)]
pub struct AccessLine<'a> {
    pub method: &'a http::Method,
    /// Never the query string: signed file URLs carry secrets there.
    pub path: &'a str,
    pub plane: &'a str,
    pub status: u16,
    pub elapsed: Duration,
    pub upstream: &'a str,
    /// The E-code of an answer the proxy gave itself (SPEC §6), printed after the SPEC's
    /// fields; none for the upstream's own answers. A 502 of the proxy's and one of the
    /// upstream's looked alike in the log.
    pub error: Option<&'static str>,
    /// Why, in words, when the upstream could not be reached or broke its answer (E5001):
    /// the words its answer's body gives the client. Without them the log said only
    /// `error="E5001"` of an upstream certificate that expired, a refused connect or a
    /// reset, at any level, where nginx's error log says which.
    pub reason: Option<&'a str>,
}

impl AccessLine<'_> {
    /// In milliseconds, to the microsecond: nanoseconds are the clock's noise, and their
    /// float printed as `0.5199309999999999`.
    pub fn duration_ms(&self) -> f64 {
        self.elapsed.as_micros() as f64 / 1000.0
    }
}

/// One access line (SPEC §7), if `abx_proxy::access` is enabled at info; its path as
/// [`shown_path`] shows it.
pub fn access(line: &AccessLine<'_>) {
    let path = shown_path(line.path);
    let line = AccessLine {
        path: &path,
        ..*line
    };
    let format = match FAST_FORMAT.load(Ordering::Acquire) {
        TEXT => LogFormat::Text,
        JSON => LogFormat::Json,
        _ => return access_via_tracing(&line),
    };
    access_with(format, &line, emit);
}

/// A request's path as the access line shows it (see [`escape_path`]).
pub fn shown_path(path: &str) -> std::borrow::Cow<'_, str> {
    if shown_as_is(path) {
        std::borrow::Cow::Borrowed(path)
    } else {
        std::borrow::Cow::Owned(escape_path(path))
    }
}

/// Whether [`escape_path`] leaves `path` as it is (nearly every path).
fn shown_as_is(path: &str) -> bool {
    path.len() <= SHOWN_PATH_MAX && path.bytes().all(|b| b.is_ascii() && !needs_percent(b))
}

/// The most of a path a log line shows, escaped; then [`CUT`]. The head limit lets a path
/// run to 64 KiB, which escaping triples: a line of 196 KB, which journald (`LineMax`,
/// 48 KiB) and containerd (16 KiB) split into pieces none of which is a JSON object, and
/// which any client could send to fill the log's queue. nginx's request line is 8 KiB at
/// most.
pub const SHOWN_PATH_MAX: usize = 4096;

/// After a path cut at [`SHOWN_PATH_MAX`]: no path shows it (every byte past ASCII is
/// escaped), so it cannot be mistaken for the path's own.
pub const CUT: &str = "\u{2026}";

/// ASCII bytes that, unquoted in a text line, make logfmt readers (Loki's, go-logfmt)
/// refuse the line, and with it its status and upstream: a `"` or `\` (httparse takes
/// them in a target, RFC 3986 does not) and a `=` (a sub-delimiter paths may hold).
fn needs_percent(b: u8) -> bool {
    matches!(b, b'"' | b'\\' | b'=')
}

/// A path's non-ASCII bytes, and those of [`needs_percent`], percent-encoded, as a client
/// would have sent them: hyper and httparse accept raw UTF-8 in a target, and written as
/// is, U+2028 or U+0085 end the line for a Unicode-aware reader and U+202E turns its
/// display around. At most [`SHOWN_PATH_MAX`] bytes of it, then [`CUT`].
fn escape_path(path: &str) -> String {
    let mut out = String::with_capacity((path.len() * 3).min(SHOWN_PATH_MAX + CUT.len()));
    for b in path.bytes() {
        let shown = b.is_ascii() && !needs_percent(b);
        // Never half an escape.
        if out.len() + if shown { 1 } else { 3 } > SHOWN_PATH_MAX {
            out.push_str(CUT);
            break;
        }
        if shown {
            out.push(char::from(b));
        } else {
            let _ = std::fmt::Write::write_fmt(&mut out, format_args!("%{b:02X}"));
        }
    }
    out
}

/// Up to this many bytes of access lines go out in one `write`: `PIPE_BUF`, below which a
/// write to a pipe (journald, a container runtime) is atomic, so the lines of different
/// threads never mix.
const BATCH_MAX: usize = 4096;

thread_local! {
    /// Access lines of a batching thread (see [`batch_this_thread`]) not yet written.
    static PENDING: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// From now on this thread's access lines wait in a buffer until [`flush_thread`] or until
/// the buffer is full. The workers call it: under load a worker writes a dozen lines with
/// one system call instead of one each, and their runtimes flush before they sleep, so a
/// line is never held while the thread waits for work.
pub fn batch_this_thread() {
    PENDING.with(|p| *p.borrow_mut() = Some(Vec::with_capacity(BATCH_MAX)));
}

/// Writes this thread's pending access lines, if any.
pub fn flush_thread() {
    let _ = PENDING.try_with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            if let Some(buf) = p.as_mut().filter(|b| !b.is_empty()) {
                crate::log_writer::write_starred(buf.to_vec());
                buf.clear();
            }
        }
    });
}

/// One formatted access line: into this thread's batch, or straight out.
fn emit(line: &[u8]) {
    let batched = PENDING
        .try_with(|p| {
            let Ok(mut p) = p.try_borrow_mut() else {
                return false;
            };
            let Some(buf) = p.as_mut() else {
                return false;
            };
            if buf.len() + line.len() > BATCH_MAX && !buf.is_empty() {
                crate::log_writer::write_starred(buf.to_vec());
                buf.clear();
            }
            // A line longer than a whole batch goes out on its own, after those before it.
            if line.len() > BATCH_MAX {
                return false;
            }
            buf.extend_from_slice(line);
            true
        })
        .unwrap_or(false);
    if !batched {
        crate::log_writer::write_starred(line.to_vec());
    }
}

/// The fast path of [`access`] for a subscriber installed by [`init`] printing `format`
/// without colours: the formatted line goes to `out`, unless the filter drops it or a span
/// is current (then tracing prints it, span context included).
#[doc(hidden)]
pub fn access_with(format: LogFormat, line: &AccessLine<'_>, out: impl FnOnce(&[u8])) {
    if !access_enabled() {
        return;
    }
    // Inside a span the subscriber prefixes (text) or appends (JSON) the span context,
    // which only it knows how to render.
    if tracing::dispatcher::get_default(|d| d.current_span().id().is_some()) {
        return access_via_tracing(line);
    }
    let now = SystemTime::now();
    let mut out = Some(out);
    let _ = LINE_BUF.try_with(|cell| {
        if let Ok(mut buf) = cell.try_borrow_mut() {
            buf.clear();
            format_access(&mut buf, format, now, line);
            if let Some(out) = out.take() {
                out(&buf);
            }
            // One huge path should not pin its buffer for the thread's lifetime.
            if buf.capacity() > MAX_KEPT_BUF {
                *buf = Vec::with_capacity(INITIAL_BUF);
            }
        }
    });
    // Thread teardown or re-entrance: a one-off buffer still gets the line out.
    if let Some(out) = out {
        let mut buf = Vec::with_capacity(INITIAL_BUF);
        format_access(&mut buf, format, now, line);
        out(&buf);
    }
}

const INITIAL_BUF: usize = 256;
const MAX_KEPT_BUF: usize = 16 * 1024;

thread_local! {
    /// The line under construction, kept per thread so formatting does not allocate.
    static LINE_BUF: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(INITIAL_BUF));
}

/// Whether the installed subscriber lets `abx_proxy::access` through at info. The
/// callsite's cached interest answers most calls; the filter decides the rest.
#[doc(hidden)]
pub fn access_enabled() -> bool {
    tracing::enabled!(target: ACCESS_TARGET, tracing::Level::INFO)
}

/// The access line as a `tracing` event: what the fast path reproduces, and what runs
/// whenever the fast path cannot stand in for the subscriber.
#[doc(hidden)]
pub fn access_via_tracing(line: &AccessLine<'_>) {
    tracing::info!(
        target: ACCESS_TARGET,
        method = %line.method,
        path = %line.path,
        plane = line.plane,
        status = line.status,
        duration_ms = line.duration_ms(),
        upstream = %line.upstream,
        error = line.error,
        reason = line.reason,
    );
}

/// Append the access line, newline included, exactly as tracing-subscriber's plain (no
/// ANSI) fmt layer configured by [`init`] prints the event of [`access_via_tracing`] at
/// `now`.
#[doc(hidden)]
pub fn format_access(buf: &mut Vec<u8>, format: LogFormat, now: SystemTime, line: &AccessLine) {
    let duration_ms = line.duration_ms();
    match format {
        // `{timestamp} {level:>5} {target}: {fields}`; `%` fields print with Display,
        // `&str` ones with Debug (quoted), numbers with Debug.
        LogFormat::Text => {
            write_timestamp(buf, now);
            buf.extend_from_slice(b"  INFO abx_proxy::access: method=");
            buf.extend_from_slice(line.method.as_str().as_bytes());
            buf.extend_from_slice(b" path=");
            buf.extend_from_slice(line.path.as_bytes());
            buf.extend_from_slice(b" plane=");
            write_debug_str(buf, line.plane);
            buf.extend_from_slice(b" status=");
            write_u16(buf, line.status);
            buf.extend_from_slice(b" duration_ms=");
            write_debug_f64(buf, duration_ms);
            buf.extend_from_slice(b" upstream=");
            buf.extend_from_slice(line.upstream.as_bytes());
            if let Some(code) = line.error {
                buf.extend_from_slice(b" error=");
                write_debug_str(buf, code);
            }
            if let Some(reason) = line.reason {
                buf.extend_from_slice(b" reason=");
                write_debug_str(buf, reason);
            }
        }
        // Keys in the order the layer emits them: timestamp, level, the event's fields,
        // target. The float, and any string that needs escaping, go through serde_json,
        // which is what the layer uses, so neither can drift from it.
        LogFormat::Json => {
            buf.extend_from_slice(b"{\"timestamp\":\"");
            write_timestamp(buf, now);
            buf.extend_from_slice(b"\",\"level\":\"INFO\",\"method\":");
            write_json_str(buf, line.method.as_str());
            buf.extend_from_slice(b",\"path\":");
            write_json_str(buf, line.path);
            buf.extend_from_slice(b",\"plane\":");
            write_json_str(buf, line.plane);
            buf.extend_from_slice(b",\"status\":");
            write_u16(buf, line.status);
            buf.extend_from_slice(b",\"duration_ms\":");
            // Writing into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *buf, &duration_ms);
            buf.extend_from_slice(b",\"upstream\":");
            write_json_str(buf, line.upstream);
            if let Some(code) = line.error {
                buf.extend_from_slice(b",\"error\":");
                write_json_str(buf, code);
            }
            if let Some(reason) = line.reason {
                buf.extend_from_slice(b",\"reason\":");
                write_json_str(buf, reason);
            }
            buf.extend_from_slice(b",\"target\":\"abx_proxy::access\"}");
        }
    }
    buf.push(b'\n');
}

/// RFC 3339 UTC with microseconds, as tracing-subscriber's default `SystemTime` timer:
/// `2024-05-06T07:08:09.123456Z`, years past 9999 as `+10000`, before year 0 as `-0001`.
fn write_timestamp(buf: &mut Vec<u8>, now: SystemTime) {
    // Floor to whole seconds on both sides of the epoch, like the timer does.
    let (secs, nanos) = match now.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(e) => {
            let d = e.duration();
            let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            match d.subsec_nanos() {
                0 => (-secs, 0),
                n => (-secs - 1, 1_000_000_000 - n),
            }
        }
    };
    // Lines come many to a second and date and time of day only change once a second,
    // so each thread keeps its last second's rendering.
    let second = LAST_SECOND
        .try_with(|last| {
            let (at, text) = last.get();
            if at == Some(secs) {
                return Some(text);
            }
            let text = render_second(secs)?;
            last.set((Some(secs), text));
            Some(text)
        })
        .unwrap_or_else(|_| render_second(secs));
    match second {
        Some(text) => buf.extend_from_slice(&text),
        None => write_wide_year_second(buf, secs),
    }
    let micros = nanos / 1_000;
    let mut fraction = *b".000000Z";
    put_2(&mut fraction[1..3], micros / 10_000);
    put_2(&mut fraction[3..5], micros / 100 % 100);
    put_2(&mut fraction[5..7], micros % 100);
    buf.extend_from_slice(&fraction);
}

thread_local! {
    /// The second [`write_timestamp`] last rendered, and its `YYYY-MM-DDTHH:MM:SS`.
    static LAST_SECOND: Cell<(Option<i64>, [u8; 19])> = const { Cell::new((None, [0; 19])) };
}

/// `YYYY-MM-DDTHH:MM:SS` of a second since the epoch; `None` outside years 0 to 9999.
fn render_second(secs: i64) -> Option<[u8; 19]> {
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let year = u32::try_from(year).ok().filter(|y| *y <= 9999)?;
    let day_secs = secs.rem_euclid(86_400) as u32;
    let mut out = *b"0000-00-00T00:00:00";
    put_2(&mut out[0..2], year / 100);
    put_2(&mut out[2..4], year % 100);
    put_2(&mut out[5..7], month);
    put_2(&mut out[8..10], day);
    put_2(&mut out[11..13], day_secs / 3600);
    put_2(&mut out[14..16], day_secs / 60 % 60);
    put_2(&mut out[17..19], day_secs % 60);
    Some(out)
}

/// [`render_second`] for the years tracing-subscriber prints wider: `+10000`, `-0001`.
fn write_wide_year_second(buf: &mut Vec<u8>, secs: i64) {
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    let _ = if year > 9999 {
        write!(buf, "+{year}")
    } else {
        write!(buf, "{year:05}")
    };
    let _ = write!(
        buf,
        "-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        t / 3600,
        t / 60 % 60,
        t % 60
    );
}

/// Proleptic Gregorian (year, month, day) of a day count from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March first
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Two decimal digits of `n` (< 100) into `out[..2]`.
fn put_2(out: &mut [u8], n: u32) {
    out[0] = b'0' + (n / 10 % 10) as u8;
    out[1] = b'0' + (n % 10) as u8;
}

fn write_u16(buf: &mut Vec<u8>, n: u16) {
    let mut digits = [0u8; 5];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// `{:?}` of a `str`: printable ASCII without `"` or `\` is copied between quotes, anything
/// else goes through `fmt` so Rust's escaping rules (unicode tables included) apply.
fn write_debug_str(buf: &mut Vec<u8>, s: &str) {
    if s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        let _ = write!(buf, "{s:?}");
    }
}

/// A JSON string, escaped as the JSON layer escapes it: serde_json, which only touches
/// `"`, `\` and control characters below U+0020; strings free of those (every path and
/// host in practice) are copied as they are.
fn write_json_str(buf: &mut Vec<u8>, s: &str) {
    if !needs_json_escape(s.as_bytes()) {
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *buf, s);
    }
}

/// Whether `s` holds a byte serde_json escapes: `"`, `\` or a control character below
/// 0x20. Eight bytes at a time with the classic zero-byte / byte-below-n word tests,
/// which are exact about whether any byte matches (for n <= 0x80); UTF-8 bytes (>= 0x80)
/// never match.
fn needs_json_escape(s: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let flagged = |w: u64| {
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        let zero_quote = quote.wrapping_sub(ONES) & !quote;
        let zero_backslash = backslash.wrapping_sub(ONES) & !backslash;
        let below_space = w.wrapping_sub(ONES * 0x20) & !w;
        (zero_quote | zero_backslash | below_space) & HIGH != 0
    };
    let mut words = s.chunks_exact(8);
    for word in &mut words {
        match <[u8; 8]>::try_from(word) {
            Ok(word) if !flagged(u64::from_le_bytes(word)) => {}
            _ => return true,
        }
    }
    // The tail, padded with a byte that never matches.
    let tail = words.remainder();
    let mut last = [b'a'; 8];
    last[..tail.len()].copy_from_slice(tail);
    flagged(u64::from_le_bytes(last))
}

/// `{:?}` of an `f64`, which the text layer prints, at a third of the cost where that is
/// safe. For 1e-4 <= v < 1e16 both `{:?}` and serde_json print the shortest round-tripping
/// digits in plain decimal notation (`.0` on whole numbers), closest to the exact value. They
/// differ only on an exact tie between two shortest candidates, which they break in
/// opposite directions (`1.0000076293945313` vs `…312` for 1 + 2^-17), and a tie needs the exact decimal expansion of `v` to end at
/// the 18th significant digit or earlier. With `f` fractional bits that expansion has `f`
/// fractional digits, at most 3 of them leading zeros (v >= 1e-4), so at least `f - 3`
/// significant ones: with f >= 22 there is no tie. Anything else goes through `fmt`.
fn write_debug_f64(buf: &mut Vec<u8>, v: f64) {
    if (1e-4..1e16).contains(&v) && fractional_bits(v) >= 22 {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *buf, &v);
    } else {
        let _ = write!(buf, "{v:?}");
    }
}

/// How many binary digits after the point the exact value of a normal positive `v` has.
fn fractional_bits(v: f64) -> i32 {
    let bits = v.to_bits();
    let biased_exp = ((bits >> 52) & 0x7ff) as i32;
    let mantissa = (bits & ((1 << 52) - 1)) | (1 << 52);
    // v = mantissa * 2^(biased_exp - 1075); trailing zero bits of the mantissa do not count.
    (1075 - biased_exp - mantissa.trailing_zeros() as i32).max(0)
}

/// Log lines captured for a unit test: [`Captured::subscriber`] writes into it.
#[cfg(test)]
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

#[cfg(test)]
impl Captured {
    /// A plain-text subscriber (no colours) writing into this capture.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish()
    }

    /// What has been written so far.
    pub fn text(&self) -> String {
        let held = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        String::from_utf8_lossy(&held).into_owned()
    }
}

#[cfg(test)]
impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut held = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        held.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::format::Writer;

    use super::*;

    /// h2 is held to `info` under `debug` or `trace` for everything, and left alone under
    /// any other level or when the filter names it.
    #[test]
    fn h2_is_held_to_info_under_a_verbose_level() {
        for (filter, held) in [
            ("debug", "debug,h2=info"),
            ("TRACE", "TRACE,h2=info"),
            ("5", "5,h2=info"),
            ("info,abx_proxy=debug", "info,abx_proxy=debug"),
            ("debug,h2=debug", "debug,h2=debug"),
            ("debug,h2o=info", "debug,h2o=info,h2=info"),
            ("trace,h2::server=trace", "trace,h2::server=trace,h2=info"),
            ("debug,h2::codec=info", "debug,h2::codec=info,h2=info"),
            ("debug,h2[x]=info", "debug,h2[x]=info,h2=info"),
            ("off", "off"),
            ("warn", "warn"),
        ] {
            assert_eq!(quiet_h2(filter), held, "{filter}");
        }
    }

    /// rustls is held to errors under `info` or `warn` for everything, whatever else the
    /// filter says of other targets, and left alone under any other level or when the
    /// filter names it.
    #[test]
    fn rustls_is_held_to_errors_under_info_or_warn() {
        for (filter, held) in [
            ("info", "info,rustls=error"),
            (" WARN ", "WARN,rustls=error"),
            ("3", "3,rustls=error"),
            (
                "info,abx_proxy::access=off",
                "info,abx_proxy::access=off,rustls=error",
            ),
            ("warn,h2=debug", "warn,h2=debug,rustls=error"),
            ("info,abx_proxy=debug", "info,abx_proxy=debug,rustls=error"),
            ("info,rustls=warn", "info,rustls=warn"),
            (
                "info,rustls::msgs=warn",
                "info,rustls::msgs=warn,rustls=error",
            ),
            (
                "info,rustls[hs]=debug",
                "info,rustls[hs]=debug,rustls=error",
            ),
            (
                "info,rustls[{x}]=warn",
                "info,rustls[{x}]=warn,rustls=error",
            ),
            ("debug", "debug"),
            ("error", "error"),
            ("abx_proxy=info", "abx_proxy=info"),
            ("debug,info", "debug,info,rustls=error"),
        ] {
            assert_eq!(quiet_rustls(filter), held, "{filter}");
        }
    }

    /// A filter with a directive that covers the proxy's own lines (a level alone, or one
    /// for `abx_proxy`, `off` included) passes, whatever else it names (a shared
    /// `RUST_LOG`); one with none is refused, with the level meant when a word is another
    /// tool's spelling of one.
    #[test]
    fn a_filter_that_would_log_nothing_is_refused() {
        for fine in [
            "warn",
            "INFO",
            "3",
            "off",
            "debug,",
            "debug,reqwest=info",
            "info,H2=debug",
            "off,abx_proxy::notify=debug",
            "warn,abx_proxy::serve=info",
            "abx",
            "abx_proxy",
            "warn,warning",
            // Silence asked for, of the proxy alone.
            "warn,abx_proxy=off",
            "off,h2=debug",
            // Spaces around a directive, as tracing would have kept them.
            "info ",
            "info\n",
            " warn, abx_proxy=debug",
            "info,abx_proxy::proxy=debug",
            "abx_proxy::=info",
        ] {
            assert_eq!(filter_refusal(fine), None, "{fine}");
        }
        let none = "it leaves out the proxy's own lines";
        for (refused, says) in [
            ("warning", "`warning` is no level (did you mean `warn`?"),
            ("Err", "`Err` is no level (did you mean `error`?"),
            ("notice", "did you mean `info`?"),
            ("wran", none),
            ("mio", none),
            ("h2=debug,hyper_util=debug", none),
            ("abx_prxy=debug", none),
            ("abx_proxyx=debug", none),
            ("abx_proxy::access=off", none),
            ("abx_proxy::access=info", none),
            ("abx_proxy::serve=info", none),
            ("abx_proxy::proxy=debug", none),
            ("abx_proxy::acess=info", none),
            ("abx_proxy =info", "names a target with a space in it"),
            (
                "warn,warn abx_proxy=debug",
                "names a target with a space in it",
            ),
            ("[request]=debug", none),
            ("debug=info", none),
            ("abx_proxy=loud", "error parsing level filter"),
        ] {
            let why = filter_refusal(refused).unwrap_or_default();
            assert!(why.contains(says), "{refused}: {why}");
        }
    }

    /// A panic is one line: an ERROR object that parses whole, or a text line.
    #[test]
    fn a_panic_is_one_line_in_either_format() {
        let text = "thread 'abx-worker-1' panicked at src/x.rs:1:2: \"quoted\"\nand a trace";
        let json = panic_line(text, true);
        assert_eq!(json.iter().filter(|b| **b == b'\n').count(), 1);
        let object: serde_json::Value = serde_json::from_slice(&json).expect("one object");
        assert_eq!(object["level"], "ERROR");
        assert_eq!(object["message"], text);
        let line = String::from_utf8(panic_line("thread 'main' panicked at a:1:1: x", false));
        let line = line.expect("utf-8");
        assert!(
            line.ends_with(" ERROR abx_proxy: thread 'main' panicked at a:1:1: x\n"),
            "{line}"
        );
    }

    /// A `MakeWriter` collecting everything the subscriber writes.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Capture {
        fn text(&self) -> String {
            let bytes = self.0.lock().map(|b| b.clone()).unwrap_or_default();
            String::from_utf8(bytes).unwrap_or_else(|e| panic!("not UTF-8: {e}"))
        }
    }

    impl Write for Capture {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut b) = self.0.lock() {
                b.extend_from_slice(data);
            }
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    /// A timer printing our rendering of a fixed instant, so whole lines compare.
    struct Fixed(SystemTime);

    impl FormatTime for Fixed {
        fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
            let mut buf = Vec::new();
            write_timestamp(&mut buf, self.0);
            w.write_str(std::str::from_utf8(&buf).map_err(|_| std::fmt::Error)?)
        }
    }

    /// What `init`'s subscriber (colours off) prints for the event, with `timer`.
    fn tracing_output<T>(format: LogFormat, filter: &str, timer: T, emit: impl FnOnce()) -> String
    where
        T: FormatTime + Send + Sync + 'static,
    {
        let capture = Capture::default();
        let filter = EnvFilter::new(filter);
        let subscriber = subscriber(format, filter, false, timer, capture.clone());
        tracing::dispatcher::with_default(&subscriber, emit);
        capture.text()
    }

    fn ours(format: LogFormat, now: SystemTime, line: &AccessLine) -> String {
        let mut buf = Vec::new();
        format_access(&mut buf, format, now, line);
        String::from_utf8(buf).unwrap_or_else(|e| panic!("not UTF-8: {e}"))
    }

    /// `got` is the line formatted at some time between `before` and `after`: it sorts
    /// between ours at both ends, and everything but the timestamp matches exactly.
    fn assert_between(
        format: LogFormat,
        before: SystemTime,
        after: SystemTime,
        line: &AccessLine,
        got: &str,
    ) {
        let (lo, hi) = (ours(format, before, line), ours(format, after, line));
        assert!(lo.as_str() <= got && got <= hi.as_str(), "{lo}{got}{hi}");
        let skip = if format == LogFormat::Json {
            14 + 27
        } else {
            27
        };
        assert_eq!(lo[skip..], got[skip..]);
    }

    const NASTY_PATHS: &[&str] = &[
        "/v2/sandboxes",
        "/",
        "",
        "/a\"b\\c",
        "/ctl\u{0}\u{1}\u{7}\u{8}\t\n\r\u{b}\u{c}\u{1b}[31m\u{1f}\u{7f}",
        "/c1\u{80}\u{85}\u{9f}\u{a0}\u{ad}",
        "/unicode/é/€/𝄞/\u{301}/\u{200b}/\u{2028}\u{2029}/\u{feff}/\u{fffd}",
        "/quote'single'/%22/%E2%82%AC",
        "/{\"json\":[1,2]}",
    ];

    fn lines<'a>(
        method: &'a http::Method,
        plane: &'a str,
        upstream: &'a str,
    ) -> impl Iterator<Item = AccessLine<'a>> {
        let elapsed = [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_nanos(50),
            Duration::from_nanos(772_670),
            Duration::from_micros(1),
            Duration::from_millis(2),
            Duration::from_secs(1),
            Duration::from_secs(3600 * 24 * 365 * 400),
            Duration::new(12, 345_678_901),
        ];
        NASTY_PATHS
            .iter()
            .zip(elapsed.into_iter().cycle())
            .zip([0u16, 7, 200, 502, 65535].into_iter().cycle())
            .zip(
                [None, Some("E5001"), None, Some("E5002")]
                    .into_iter()
                    .cycle(),
            )
            .map(move |(((path, elapsed), status), error)| AccessLine {
                method,
                path,
                plane,
                status,
                elapsed,
                upstream,
                error,
                // Words as nasty as the paths, escaped alike.
                reason: error.map(|_| *path),
            })
    }

    fn instants() -> Vec<SystemTime> {
        vec![
            UNIX_EPOCH + Duration::new(1_796_053_336, 912_543_999),
            UNIX_EPOCH,
            UNIX_EPOCH - Duration::new(1, 1),
            UNIX_EPOCH + Duration::new(951_782_400, 1_000), // 2000-02-29
            UNIX_EPOCH + Duration::new(253_402_300_799, 999_999_999), // 9999-12-31
            UNIX_EPOCH + Duration::new(253_402_300_800, 0), // +10000
            UNIX_EPOCH - Duration::new(62_167_219_201, 0),  // -0001
        ]
    }

    #[test]
    fn text_lines_match_tracing_subscriber() {
        let ext = http::Method::from_bytes(b"PROPFIND").unwrap_or_else(|e| panic!("{e}"));
        for method in [http::Method::GET, http::Method::POST, ext] {
            for plane in ["api", "envd", "we\"ird\\\n", "é\u{301}\u{0}"] {
                for upstream in ["127.0.0.1", "api.example.com:8443", "", "a\"b"] {
                    for line in lines(&method, plane, upstream) {
                        for now in instants() {
                            let theirs =
                                tracing_output(LogFormat::Text, "info", Fixed(now), || {
                                    access_via_tracing(&line)
                                });
                            assert_eq!(ours(LogFormat::Text, now, &line), theirs, "{line:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn json_lines_match_tracing_subscriber_and_parse() {
        let ext = http::Method::from_bytes(b"PROPFIND").unwrap_or_else(|e| panic!("{e}"));
        for method in [http::Method::GET, http::Method::DELETE, ext] {
            for plane in ["api", "envd", "we\"ird\\\n"] {
                for upstream in ["127.0.0.1", "", "a\"b\\\u{1}é"] {
                    for line in lines(&method, plane, upstream) {
                        for now in instants() {
                            let theirs =
                                tracing_output(LogFormat::Json, "info", Fixed(now), || {
                                    access_via_tracing(&line)
                                });
                            let mine = ours(LogFormat::Json, now, &line);
                            assert_eq!(mine, theirs, "{line:?}");
                            assert!(mine.ends_with('\n') && mine.matches('\n').count() == 1);
                            let v: serde_json::Value = serde_json::from_str(&mine)
                                .unwrap_or_else(|e| panic!("not JSON ({e}): {mine}"));
                            assert_eq!(v["level"], "INFO");
                            assert_eq!(v["target"], ACCESS_TARGET);
                            assert_eq!(v["method"], line.method.as_str());
                            assert_eq!(v["path"], line.path);
                            assert_eq!(v["plane"], line.plane);
                            assert_eq!(v["upstream"], line.upstream);
                            assert_eq!(v["status"].as_u64(), Some(u64::from(line.status)));
                            let ms = line.duration_ms();
                            // serde_json's parser (without `float_roundtrip`) may be off
                            // in the last bit; the printed digits are checked above.
                            let parsed = v["duration_ms"].as_f64().unwrap_or(f64::NAN);
                            assert!((parsed - ms).abs() <= ms * 1e-15, "{mine}");
                            let mut ts = Vec::new();
                            write_timestamp(&mut ts, now);
                            assert_eq!(v["timestamp"].as_str().map(str::as_bytes), Some(&ts[..]));
                        }
                    }
                }
            }
        }
    }

    /// With tracing-subscriber's own clock, our timestamp of the instants just before and
    /// after the event brackets the one it printed (same width, so bytes order as time).
    #[test]
    fn timestamp_matches_the_default_timer() {
        let line = AccessLine {
            method: &http::Method::GET,
            path: "/x",
            plane: "api",
            status: 200,
            elapsed: Duration::from_micros(1234),
            upstream: "127.0.0.1",
            error: None,
            reason: None,
        };
        for format in [LogFormat::Text, LogFormat::Json] {
            let capture = Capture::default();
            let builder = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(capture.clone());
            let run = || {
                let before = SystemTime::now();
                access_via_tracing(&line);
                (before, SystemTime::now())
            };
            let (before, after) = match format {
                LogFormat::Text => tracing::subscriber::with_default(builder.finish(), run),
                LogFormat::Json => {
                    let sub = builder.json().flatten_event(true).with_current_span(false);
                    tracing::subscriber::with_default(sub.finish(), run)
                }
            };
            let theirs = capture.text();
            assert_between(format, before, after, &line, &theirs);
        }
    }

    /// Against the `time` crate over a spread of instants, both sides of the epoch.
    #[test]
    fn timestamp_agrees_with_the_time_crate() {
        let rfc = time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
        );
        let mut secs: i64 = -62_135_596_800; // 0001-01-01
        let mut rng = fastrand::Rng::with_seed(7);
        while secs < 253_402_300_799 {
            let nanos = rng.u32(0..1_000_000_000);
            let nanos_total = i128::from(secs) * 1_000_000_000 + i128::from(nanos);
            let magnitude = nanos_total.unsigned_abs();
            let span = Duration::new(
                (magnitude / 1_000_000_000) as u64,
                (magnitude % 1_000_000_000) as u32,
            );
            let now = if nanos_total >= 0 {
                UNIX_EPOCH + span
            } else {
                UNIX_EPOCH - span
            };
            let expected = time::OffsetDateTime::from_unix_timestamp_nanos(nanos_total)
                .unwrap_or_else(|e| panic!("{e}"))
                .format(rfc)
                .unwrap_or_else(|e| panic!("{e}"));
            let mut buf = Vec::new();
            write_timestamp(&mut buf, now);
            assert_eq!(String::from_utf8_lossy(&buf), expected, "{secs}.{nanos}");
            // Again within the same second: the cached date part.
            let later = now + Duration::from_nanos(u64::from(999_999_999 - nanos));
            buf.clear();
            write_timestamp(&mut buf, later);
            assert_eq!(buf[..20], expected.as_bytes()[..20]);
            assert_eq!(&buf[20..], b"999999Z");
            secs += i64::from(rng.u32(1..40_000_000));
        }
        // Leap days and month ends.
        for (secs, expected) in [
            (951_782_399_i64, "2000-02-28T23:59:59.000000Z"),
            (951_782_400, "2000-02-29T00:00:00.000000Z"),
            (4_107_542_400, "2100-03-01T00:00:00.000000Z"),
            (-1, "1969-12-31T23:59:59.000000Z"),
            (253_402_300_800, "+10000-01-01T00:00:00.000000Z"),
            (-62_167_219_201, "-0001-12-31T23:59:59.000000Z"),
        ] {
            let now = if secs >= 0 {
                UNIX_EPOCH + Duration::from_secs(secs as u64)
            } else {
                UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
            };
            let mut buf = Vec::new();
            write_timestamp(&mut buf, now);
            assert_eq!(String::from_utf8_lossy(&buf), expected);
        }
    }

    /// The float is printed as the layers print it: `{:?}` in text, serde_json in JSON.
    #[test]
    fn durations_render_like_tracing_subscriber_over_many_values() {
        let mut rng = fastrand::Rng::with_seed(11);
        let method = http::Method::GET;
        let line_of = |nanos| AccessLine {
            method: &method,
            path: "/p",
            plane: "api",
            status: 200,
            elapsed: Duration::from_nanos(nanos),
            upstream: "u",
            error: None,
            reason: None,
        };
        for i in 0..20_000u64 {
            let nanos = match i % 4 {
                0 => rng.u64(0..1_000_000),
                1 => rng.u64(0..100_000_000_000),
                2 => i * 1_000_000,
                _ => rng.u64(..),
            };
            let line = line_of(nanos);
            for format in [LogFormat::Text, LogFormat::Json] {
                let mut mine = Vec::new();
                format_access(&mut mine, format, UNIX_EPOCH, &line);
                let ms = line.duration_ms();
                let expected = match format {
                    LogFormat::Text => format!("{ms:?}"),
                    LogFormat::Json => serde_json::to_string(&ms).unwrap_or_default(),
                };
                let mine = String::from_utf8_lossy(&mine);
                assert!(
                    mine.contains(&format!(
                        "duration_ms{}",
                        match format {
                            LogFormat::Text => format!("={expected} "),
                            LogFormat::Json => format!("\":{expected},"),
                        }
                    )),
                    "{mine}"
                );
            }
        }
        // To the microsecond: 519 931 ns printed `0.5199309999999999`.
        for (nanos, text) in [(519_931, "0.519"), (12_000_999, "12.0"), (999, "0.0")] {
            let mut mine = Vec::new();
            format_access(&mut mine, LogFormat::Text, UNIX_EPOCH, &line_of(nanos));
            let mine = String::from_utf8_lossy(&mine);
            assert!(mine.contains(&format!(" duration_ms={text} ")), "{mine}");
        }
        // A sample through the real layers too (they are slow, so fewer).
        for nanos in [
            1,
            50,
            999,
            100_000,
            772_670,
            1_000_000,
            123_456_789,
            u64::MAX,
        ] {
            let line = line_of(nanos);
            for format in [LogFormat::Text, LogFormat::Json] {
                let theirs = tracing_output(format, "info", Fixed(UNIX_EPOCH), || {
                    access_via_tracing(&line)
                });
                assert_eq!(ours(format, UNIX_EPOCH, &line), theirs);
            }
        }
    }

    /// The serde_json shortcut for `{:?}` of a float, over random bit patterns across (and
    /// beyond) the range where it is used, whole numbers, and the range's edges.
    #[test]
    fn debug_f64_shortcut_matches_fmt() {
        let mut rng = fastrand::Rng::with_seed(3);
        let (lo, hi) = (1e-6f64.to_bits(), 1e18f64.to_bits());
        let mut values: Vec<f64> = (0..2_000_000)
            .map(|_| f64::from_bits(rng.u64(lo..=hi)))
            .collect();
        values.extend((0..100_000).map(|_| rng.u64(..) as f64 / 1e6));
        values.extend((0..100_000).map(|_| rng.u64(..1 << 40) as f64));
        values.extend((0..100_000).map(|_| Duration::from_nanos(rng.u64(..)).as_secs_f64() * 1e3));
        // Exact ties between two shortest candidates, where the two printers disagree.
        for (int, frac_bits) in [
            (1u64, 17),
            (12_345_678, 10),
            (14_350_791_064_097, 4),
            (0, 20),
        ] {
            for num in 1..64u64 {
                values.push(int as f64 + num as f64 / (1u64 << frac_bits) as f64);
            }
        }
        values.push(f64::from_bits(0x430c_973e_c1fa_3b22));
        for edge in [1e-4f64, 1e16, 1e15, 1.0, 0.1, 9_007_199_254_740_993.0] {
            let b = edge.to_bits();
            values.extend([f64::from_bits(b - 1), edge, f64::from_bits(b + 1)]);
        }
        values.extend([0.0, -0.0, f64::MIN_POSITIVE, 5e-324, f64::MAX, 1e300]);
        let mut buf = Vec::new();
        for v in values {
            buf.clear();
            write_debug_f64(&mut buf, v);
            assert_eq!(
                String::from_utf8_lossy(&buf),
                format!("{v:?}"),
                "{:#x}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn enabled_follows_the_env_filter() {
        for (filter, expected) in [
            ("info", true),
            ("debug", true),
            ("trace", true),
            ("warn", false),
            ("error", false),
            ("off", false),
            ("info,abx_proxy::access=off", false),
            ("info,abx_proxy::access=warn", false),
            ("warn,abx_proxy::access=info", true),
            ("off,abx_proxy=info", true),
            ("off,abx_proxy::access=debug", true),
            ("abx_proxy::serve=info", false),
            ("hyper=debug", false),
        ] {
            let (enabled, printed) = {
                let mut enabled = false;
                let line = AccessLine {
                    method: &http::Method::GET,
                    path: "/x",
                    plane: "api",
                    status: 200,
                    elapsed: Duration::from_millis(1),
                    upstream: "u",
                    error: None,
                    reason: None,
                };
                let printed = tracing_output(LogFormat::Text, filter, Fixed(UNIX_EPOCH), || {
                    enabled = access_enabled();
                    access_via_tracing(&line);
                });
                (enabled, !printed.is_empty())
            };
            assert_eq!(enabled, expected, "enabled!() under {filter:?}");
            assert_eq!(printed, expected, "tracing::info! under {filter:?}");
        }
    }

    /// Logging was never set up in the test binary: `access` must hand the event to
    /// whatever subscriber is current, so nothing is lost.
    #[test]
    fn without_init_access_goes_through_tracing() {
        assert_eq!(FAST_FORMAT.load(Ordering::Acquire), FALLBACK);
        let method = http::Method::PUT;
        let line = AccessLine {
            method: &method,
            path: "/files",
            plane: "envd",
            status: 201,
            elapsed: Duration::from_micros(4321),
            upstream: "sbx.example:49983",
            error: None,
            reason: None,
        };
        for format in [LogFormat::Text, LogFormat::Json] {
            let via_access =
                tracing_output(format, "info", Fixed(UNIX_EPOCH), || log_access(&line));
            assert_eq!(via_access, ours(format, UNIX_EPOCH, &line));
            let filtered = tracing_output(format, "warn", Fixed(UNIX_EPOCH), || {
                access(&AccessLine {
                    path: "/files",
                    ..line
                })
            });
            assert_eq!(filtered, "");
        }
    }

    /// The thread's line buffer keeps what ordinary lines grew it to (no allocation per
    /// line), but not what one huge path did.
    #[test]
    fn the_line_buffer_is_kept_unless_huge() {
        let capacity = || LINE_BUF.with(|b| b.borrow().capacity());
        let long = format!("/long/{}", "x".repeat(2048));
        let huge = format!("/huge/{}", "x".repeat(4 * MAX_KEPT_BUF));
        let mut written = Vec::new();
        tracing_output(LogFormat::Text, "info", Fixed(UNIX_EPOCH), || {
            for path in [&long, &huge] {
                let line = AccessLine {
                    path,
                    ..child_line()
                };
                access_with(LogFormat::Text, &line, |b| written.push(b.len()));
                written.push(capacity());
            }
        });
        let [long_line, after_long, huge_line, after_huge] = written[..] else {
            panic!("two lines written: {written:?}");
        };
        assert!(long_line > 2048 && after_long >= long_line, "{written:?}");
        assert!(
            huge_line > MAX_KEPT_BUF && after_huge <= MAX_KEPT_BUF,
            "{written:?}"
        );
    }

    /// The count [`write_debug_f64`] decides by, on values whose binary expansion is known.
    #[test]
    fn fractional_bits_counts_binary_digits_after_the_point() {
        for (v, bits) in [
            (1.0, 0),
            (3.0, 0),
            ((1u64 << 40) as f64, 0),
            (1.5, 1),
            (0.75, 2),
            // Powers of two: the mantissa's stored bits are all zero, only the implicit one set.
            (0.5, 1),
            (2f64.powi(-30), 30),
            (5.125, 3),
            (1.0 + 2f64.powi(-40), 40),
            // 0x3FB999999999999A: 2^-4 times a mantissa with one trailing zero bit.
            (0.1, 55),
            (1e-4, 66),
        ] {
            assert_eq!(fractional_bits(v), bits, "{v}");
        }
    }

    /// The fast path prints the same bytes the subscriber would, honours its filter, and
    /// leaves lines inside a span to the subscriber.
    #[test]
    fn fast_path_filters_and_defers_inside_spans() {
        let line = AccessLine {
            method: &http::Method::POST,
            path: "/v2/sandboxes",
            plane: "api",
            status: 201,
            elapsed: Duration::from_micros(987),
            upstream: "127.0.0.1",
            error: None,
            reason: None,
        };
        for format in [LogFormat::Text, LogFormat::Json] {
            for (filter, expected) in [
                ("info", true),
                ("warn", false),
                ("info,abx_proxy::access=off", false),
                ("off,abx_proxy::access=info", true),
            ] {
                let mut fast = None;
                let before = SystemTime::now();
                let via_tracing = tracing_output(format, filter, Fixed(UNIX_EPOCH), || {
                    access_with(format, &line, |b| fast = Some(b.to_vec()))
                });
                let after = SystemTime::now();
                assert_eq!(via_tracing, "", "{filter}");
                assert_eq!(fast.is_some(), expected, "{filter}");
                if let Some(fast) = fast {
                    let fast = String::from_utf8_lossy(&fast).into_owned();
                    assert_between(format, before, after, &line, &fast);
                }
            }
            let mut fast = None;
            let in_span = tracing_output(format, "info", Fixed(UNIX_EPOCH), || {
                let _span = tracing::info_span!("conn", peer = "x").entered();
                access_with(format, &line, |b| fast = Some(b.to_vec()))
            });
            assert!(fast.is_none(), "fast path inside a span");
            assert!(in_span.contains("conn"), "{in_span}");
            assert!(in_span.contains("/v2/sandboxes"), "{in_span}");
        }
    }

    /// Whether a child run of this binary ran its one test: a name that matches no test,
    /// or a test no longer ignored, runs nothing and succeeds as well.
    fn child_ran(out: &std::process::Output) -> bool {
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed;")
    }

    /// The child half of `init_then_access_writes_what_tracing_writes`: set up logging as
    /// `serve` does, then log one line through the fast path and the same through tracing.
    #[test]
    #[ignore = "run by init_then_access_writes_what_tracing_writes as a child process"]
    fn child_init_and_access() {
        // `--include-ignored` gets here too: `init` must not take over the logging of a
        // process that runs other tests.
        let Ok(spec) = std::env::var("ABX_LOGGING_CHILD") else {
            return;
        };
        let (format, level) = spec.split_once(':').unwrap_or((&spec, ""));
        // `taken`: another subscriber was installed first, and keeps every line.
        let taken = format == "taken";
        if taken {
            tracing_subscriber::fmt()
                .json()
                .with_writer(std::io::stderr)
                .init();
        }
        let format = if format == "json" {
            LogFormat::Json
        } else {
            LogFormat::Text
        };
        init(format, Some(level).filter(|l| !l.is_empty()), "info");
        assert_eq!(
            FAST_FORMAT.load(Ordering::Acquire) == FALLBACK,
            taken,
            "fast path on only over init's own subscriber"
        );
        let line = child_line();
        log_access(&line);
        // `access` gives the path's non-ASCII bytes percent-encoded: tracing gets the same.
        let escaped = escape_path(line.path);
        access_via_tracing(&AccessLine {
            path: &escaped,
            ..line
        });
        finish();
    }

    /// The child half of `a_batching_thread_writes_whole_lines_in_order`.
    #[test]
    #[ignore = "run by a_batching_thread_writes_whole_lines_in_order as a child process"]
    fn child_batch() {
        // As in `child_init_and_access`: not in a process that runs other tests.
        if std::env::var("ABX_LOGGING_BATCH_CHILD").is_err() {
            return;
        }
        init(LogFormat::Text, Some("info"), "info");
        batch_this_thread();
        // Shown whole, and its line longer than a batch.
        let long = format!("/long/{}", "x".repeat(SHOWN_PATH_MAX - "/long/".len()));
        let paths: Vec<String> = (0..60)
            .map(|i| {
                if i == 30 {
                    long.clone()
                } else {
                    format!("/p/{i}")
                }
            })
            .collect();
        for (i, path) in paths.iter().enumerate() {
            let mut line = child_line();
            line.path = path;
            log_access(&line);
            if i == 2 {
                // Straight to stderr: ahead of the three lines still in the batch.
                tracing::warn!("marker");
            }
        }
        flush_thread();
        finish();
    }

    /// A worker's lines wait in its batch (the marker written meanwhile comes first), go
    /// out whole and in order, several to a write but never more than `PIPE_BUF` bytes to
    /// one, and a line longer than a batch still goes out, alone, after the lines before it.
    #[test]
    fn a_batching_thread_writes_whole_lines_in_order() {
        // The child's stderr is a datagram socket: each `write` arrives as one datagram,
        // so the test sees what went out in which call.
        let (ours, theirs) =
            std::os::unix::net::UnixDatagram::pair().unwrap_or_else(|e| panic!("{e}"));
        let after_child = theirs.try_clone().unwrap_or_else(|e| panic!("{e}"));
        const END: &[u8] = b"\0end of the child's writes";
        let reader = std::thread::spawn(move || {
            let mut writes = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = ours.recv(&mut buf).unwrap_or_else(|e| panic!("{e}"));
                if &buf[..n] == END {
                    return writes;
                }
                writes.push(String::from_utf8(buf[..n].to_vec()).unwrap_or_else(|e| panic!("{e}")));
            }
        });
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
        let out = std::process::Command::new(&exe)
            .args(["--ignored", "--exact", "logging::tests::child_batch"])
            .args(["--nocapture", "--test-threads=1"])
            .env("ABX_LOGGING_BATCH_CHILD", "1")
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::os::fd::OwnedFd::from(theirs))
            .spawn()
            .and_then(|child| child.wait_with_output())
            .unwrap_or_else(|e| panic!("{e}"));
        // Queued behind everything the child wrote, which it did before it exited.
        after_child.send(END).unwrap_or_else(|e| panic!("{e}"));
        let writes = reader
            .join()
            .unwrap_or_else(|_| panic!("the reader failed"));
        assert!(out.status.success(), "{out:?} {writes:?}");
        assert!(child_ran(&out), "{out:?}");
        let batches: Vec<&String> = writes
            .iter()
            .filter(|w| w.contains(ACCESS_TARGET))
            .collect();
        for batch in &batches {
            assert!(batch.ends_with('\n'), "a write ends mid-line: {batch:?}");
            let lines = batch.lines().count();
            assert!(
                batch.len() <= BATCH_MAX || lines == 1,
                "{lines} lines in {}",
                batch.len()
            );
        }
        assert!(batches.len() < 60, "no write held more than one line");
        let stderr = writes.concat();
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains(ACCESS_TARGET) || l.contains("marker"))
            .collect();
        assert!(lines[0].contains("marker"), "{:?}", &lines[..2]);
        let access: Vec<&str> = lines[1..].to_vec();
        assert_eq!(access.len(), 60);
        for (i, line) in access.iter().enumerate() {
            assert!(
                line.contains(" INFO abx_proxy::access: method=GET"),
                "{line}"
            );
            let path = line
                .split(" path=")
                .nth(1)
                .and_then(|r| r.split(' ').next());
            let expected = if i == 30 {
                format!("/long/{}", "x".repeat(SHOWN_PATH_MAX - "/long/".len()))
            } else {
                format!("/p/{i}")
            };
            assert_eq!(path, Some(expected.as_str()), "line {i}");
        }
    }

    /// [`access`] with the fields of `line`.
    fn log_access(line: &AccessLine<'_>) {
        access(line);
    }

    fn child_line() -> AccessLine<'static> {
        AccessLine {
            method: &http::Method::GET,
            path: "/a\"b\\c/\u{1b}[1m/é",
            plane: "api",
            status: 502,
            elapsed: Duration::from_nanos(772_670),
            upstream: "127.0.0.1",
            error: None,
            reason: None,
        }
    }

    /// End to end in a child process: `init`'s real subscriber on a non-terminal stderr,
    /// its filter from `--log-level` or `RUST_LOG`, the fast line byte-identical (past the
    /// timestamp) to what tracing-subscriber writes next to it.
    /// The stderr of `child_init_and_access` run with `spec` and `RUST_LOG`.
    fn child_stderr(spec: &str, rust_log: Option<&std::ffi::OsStr>) -> String {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = std::process::Command::new(&exe);
        cmd.args([
            "--ignored",
            "--exact",
            "logging::tests::child_init_and_access",
        ])
        .args(["--nocapture", "--test-threads=1"])
        .env("ABX_LOGGING_CHILD", spec)
        .env_remove("RUST_LOG");
        if let Some(rust_log) = rust_log {
            cmd.env("RUST_LOG", rust_log);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("{e}"));
        assert!(out.status.success(), "{spec}: {out:?}");
        assert!(child_ran(&out), "{spec}: {out:?}");
        String::from_utf8(out.stderr).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A `RUST_LOG` that is not UTF-8 is said so, as a bare `warning:` line over text logs
    /// and as an object over JSON ones, and the default level applies.
    #[test]
    fn init_says_when_rust_log_is_not_utf8() {
        use std::os::unix::ffi::OsStrExt;
        let raw = std::ffi::OsStr::from_bytes(b"abx_proxy=\xff");
        let said = "RUST_LOG is not a filter (not valid UTF-8); logging at \"info\"";
        let text = child_stderr("text:", Some(raw));
        assert!(
            text.lines().any(|l| l == format!("warning: {said}")),
            "{text}"
        );
        assert_eq!(text.matches(ACCESS_TARGET).count(), 2, "{text}");
        let json = child_stderr("json:", Some(raw));
        let warned = json.lines().any(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["level"] == "WARN" && v["message"] == said)
        });
        assert!(warned, "{json}");
        assert!(!json.contains("warning: "), "{json}");
    }

    /// Where a subscriber was installed before [`init`], it keeps the access lines: the
    /// fast path, which mirrors only init's own, stays off (the child checks) and each line
    /// is the earlier subscriber's JSON, not init's text.
    #[test]
    fn a_subscriber_installed_first_keeps_the_access_lines() {
        let stderr = child_stderr("taken:", None);
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains(ACCESS_TARGET))
            .collect();
        assert_eq!(lines.len(), 2, "{stderr}");
        for line in lines {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            assert_eq!(v["fields"]["status"], 502, "{line}");
        }
    }

    #[test]
    fn init_then_access_writes_what_tracing_writes() {
        for (spec, rust_log, expected_lines) in [
            ("text:", None, 2),
            ("json:", None, 2),
            ("text:debug", None, 2),
            ("text:warn", None, 0),
            ("json:info,abx_proxy::access=off", None, 0),
            ("json:", Some("info,abx_proxy::access=off"), 0),
            // A filter that lets none of the proxy's lines through is warned about, and
            // the default level applies: two access lines, and the warning, whose
            // suggestion names the target.
            ("json:", Some("abx_proxy::access=off"), 3),
            ("text:", Some("warn,abx_proxy::access=info"), 2),
        ] {
            let stderr = child_stderr(spec, rust_log.map(std::ffi::OsStr::new));
            let lines: Vec<&str> = stderr
                .split_inclusive('\n')
                .filter(|l| l.contains(ACCESS_TARGET))
                .collect();
            assert_eq!(
                lines.len(),
                expected_lines,
                "{spec} {rust_log:?}:\n{stderr}"
            );
            if let [fast, traced] = lines[..] {
                let skip = if spec.starts_with("json") {
                    14 + 27
                } else {
                    27
                };
                assert_eq!(fast[skip..], traced[skip..], "{spec}");
                let mut expected = String::new();
                let format = if spec.starts_with("json") {
                    LogFormat::Json
                } else {
                    LogFormat::Text
                };
                let escaped = escape_path(child_line().path);
                let line = AccessLine {
                    path: &escaped,
                    ..child_line()
                };
                expected.push_str(&ours(format, UNIX_EPOCH, &line));
                assert_eq!(fast[skip..], expected[skip..], "{spec}");
            }
        }
    }

    /// A path past [`SHOWN_PATH_MAX`] is cut there, never inside an escape, and marked;
    /// one up to it is shown whole.
    #[test]
    fn a_long_path_is_cut_whole_escapes_and_all() {
        let max = SHOWN_PATH_MAX;
        let plain = "a".repeat(max);
        assert_eq!(shown_path(&plain), plain.as_str());
        let longer = "a".repeat(max + 1);
        assert_eq!(shown_path(&longer), format!("{plain}{CUT}"));
        for lead in 0..4 {
            // Each `é` is two bytes, six escaped: the cut falls at every offset.
            let path = format!("{}{}", "a".repeat(lead), "\u{e9}".repeat(max));
            let shown = shown_path(&path);
            let kept = shown.strip_suffix(CUT).expect("marked");
            assert!(kept.len() <= max && kept.len() > max - 3, "{}", kept.len());
            assert!(kept[lead..].len().is_multiple_of(3) && kept[lead..].starts_with("%C3%A9"));
            assert!(!kept[kept.len() - 2..].contains('%'), "{kept}");
        }
        let escaped_whole = "=".repeat(max / 3);
        assert_eq!(shown_path(&escaped_whole), "%3D".repeat(max / 3));
    }

    #[test]
    fn json_escape_scan_is_exact() {
        let naive = |s: &[u8]| s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
        // Every byte value at every position of strings up to 20 bytes long.
        for len in 1..=20 {
            for at in 0..len {
                for byte in 0..=255u8 {
                    let mut s = vec![b'x'; len];
                    s[at] = byte;
                    assert_eq!(needs_json_escape(&s), naive(&s), "{s:?}");
                }
            }
        }
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..200_000 {
            let len = rng.usize(0..40);
            // Mostly printable with the occasional special or high byte.
            let s: Vec<u8> = (0..len)
                .map(|_| match rng.u8(0..20) {
                    0 => rng.u8(..),
                    _ => rng.u8(0x20..0x7f),
                })
                .collect();
            assert_eq!(needs_json_escape(&s), naive(&s), "{s:?}");
        }
        assert!(!needs_json_escape(b""));
    }

    #[test]
    fn debug_str_fast_path_matches_fmt() {
        for s in [
            "", "api", "envd", "a b~!", "\"", "\\", "'", "\u{7f}", "é", "\u{301}x",
        ] {
            let mut buf = Vec::new();
            write_debug_str(&mut buf, s);
            assert_eq!(String::from_utf8_lossy(&buf), format!("{s:?}"));
        }
        for n in [0u16, 1, 9, 10, 99, 100, 502, 9999, 10000, 65535] {
            let mut buf = Vec::new();
            write_u16(&mut buf, n);
            assert_eq!(String::from_utf8_lossy(&buf), n.to_string());
        }
    }
}
