//! The Prometheus registry and the handles the proxy updates (SPEC §7 names).
//! Label sets that are fixed (`result`, `plane`, `kind`) are created at startup so the
//! series exist at 0.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::Duration;

use http::Method;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub upstream_errors: IntCounterVec,
    pub in_flight: IntGaugeVec,
    pub open_connections: IntGauge,
    /// The client connections served at once, at most: `open_connections` at it means new
    /// ones wait in the accept queue (set at start).
    pub max_connections: IntGauge,
    pub token_exchanges: IntCounterVec,
    pub token_expiry: Gauge,
    pub envd_tokens: IntGauge,
    /// Set from the proxy's upstream connection slots at each scrape.
    pub upstream_connections: IntGauge,
    /// Set from [`crate::log_writer::dropped`] at each scrape.
    pub log_lines_dropped: IntCounter,
    /// Handshakes a client began on the `--tls-cert` listener that failed.
    pub tls_handshake_failures: IntCounter,
    /// The `--tls-cert` leaf's (or its issuer's) expiry; registered only with that listener (see
    /// [`Metrics::serve_tls`]).
    listener_cert_expiry: Gauge,
    /// Reloads (SIGHUP, a changed watched file), by result.
    pub reloads: IntCounterVec,
    /// 0 while what the last reload read has not taken effect.
    pub last_reload_successful: IntGauge,
    /// The per-request series, resolved once (see [`Hot`]).
    hot: Hot,
}

/// Which plane a request belongs to (SPEC §4): the `plane` label of the per-request
/// series and the access line's `plane` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// The provider's control plane, where the key goes.
    Api,
    /// A sandbox's envd and the ports of its apps (the access token goes to envd's port
    /// only).
    Envd,
}

impl Plane {
    /// Every plane, each a series from the start.
    pub const ALL: [Plane; 2] = [Plane::Api, Plane::Envd];

    pub fn label(self) -> &'static str {
        match self {
            Plane::Api => "api",
            Plane::Envd => "envd",
        }
    }

    /// Its place in [`Plane::ALL`] and in [`Hot`]'s arrays.
    fn index(self) -> usize {
        match self {
            Plane::Api => 0,
            Plane::Envd => 1,
        }
    }
}

/// Why an upstream exchange failed: the `kind` label of `abx_proxy_upstream_errors_total`
/// (SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    Connect,
    Tls,
    Timeout,
    Reset,
    Protocol,
}

impl FailKind {
    /// Every kind, each a series from the start.
    pub const ALL: [FailKind; 5] = [
        FailKind::Connect,
        FailKind::Tls,
        FailKind::Timeout,
        FailKind::Reset,
        FailKind::Protocol,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FailKind::Connect => "connect",
            FailKind::Tls => "tls",
            FailKind::Timeout => "timeout",
            FailKind::Reset => "reset",
            FailKind::Protocol => "protocol",
        }
    }
}

/// Methods and status codes common enough to get a cached series; others take the
/// `with_label_values` path.
const HOT_METHODS: [Method; 7] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::HEAD,
    Method::OPTIONS,
];
const HOT_CODES: [u16; 24] = [
    200, 201, 202, 204, 206, 301, 302, 304, 307, 308, 400, 401, 403, 404, 405, 409, 413, 422, 429,
    431, 500, 502, 503, 504,
];

/// The request series that exist at 0 from the start, for each plane: the methods the SDKs
/// use, with their usual successes (202: OpenSandbox's creates, pauses and resumes) and
/// the server errors. Prometheus takes a series' first
/// sample as its start: a burst counted before the first scrape that sees the series is
/// lost to `rate` and `increase` (five 502s in a burst read as 0). The successes too, or
/// the 5xx alert's ratio would count the errors and not the requests beside them. Other
/// series appear at their first request: every series is kept by every scrape of every
/// pod.
const FROM_ZERO_METHODS: [Method; 3] = [Method::GET, Method::POST, Method::DELETE];
const FROM_ZERO_CODES: [u16; 8] = [200, 201, 202, 204, 500, 502, 503, 504];

/// The series every request touches. `with_label_values` hashes the label strings and
/// takes a lock on each call — three times per request; here each series is looked up
/// once (the request counters on their first use, or at start for [`FROM_ZERO_CODES`]),
/// and after that is an index and an atomic load.
struct Hot {
    in_flight: [IntGauge; 2],
    duration: [Histogram; 2],
    /// plane × method × code, flattened.
    requests: Box<[OnceLock<IntCounter>]>,
}

impl Hot {
    /// A hot method and code's request counter, made on its first use; `None` for others.
    fn series(
        &self,
        requests: &IntCounterVec,
        plane: Plane,
        method: &Method,
        status: u16,
    ) -> Option<&IntCounter> {
        let m = HOT_METHODS.iter().position(|m| m == method)?;
        let c = HOT_CODES.binary_search(&status).ok()?;
        let slot = (plane.index() * HOT_METHODS.len() + m) * HOT_CODES.len() + c;
        Some(self.requests[slot].get_or_init(|| {
            requests.with_label_values(&[plane.label(), method.as_str(), &status.to_string()])
        }))
    }
}

/// The `method` label: the methods of RFC 9110 and PATCH by name, any other `OTHER`. A
/// client may send any token as a method, and each label value would be a series kept
/// for the life of the process.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "OTHER",
    }
}

/// The `code` label: the status when it has a registered meaning (or is the proxy's own
/// 499), else its class: `4xx`, and `5xx` for 600-999, which HTTP does not define (RFC 9110
/// §15 has clients take them as 5xx). A sandbox's app answers with any status it likes on
/// the envd plane, and each label value would be a series kept for the life of the process.
fn code_label(status: u16) -> Cow<'static, str> {
    let registered = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .is_some();
    if registered || status == 499 {
        return Cow::Owned(status.to_string());
    }
    Cow::Borrowed(match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    })
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "abx_proxy_requests_total",
                "Requests received, by plane, method and the status answered (499: the client left first).",
            ),
            &["plane", "method", "code"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "abx_proxy_request_duration_seconds",
                "Time from request to response headers.",
            )
            .buckets(vec![
                // Up to the default --upstream-timeout (300 s): slow creates. Its 504s,
                // observed a hair past it, count in `+Inf` alone.
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0,
            ]),
            &["plane"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "abx_proxy_upstream_errors_total",
                "Failed upstream exchanges, by kind.",
            ),
            &["plane", "kind"],
        )?;
        let in_flight = IntGaugeVec::new(
            // To the response head, like the duration histogram (SPEC §7): a body that
            // then streams for hours (a Connect stream, a download) counts in
            // open_connections only.
            Opts::new(
                "abx_proxy_in_flight_requests",
                "Requests waiting for their response head.",
            ),
            &["plane"],
        )?;
        let open_connections = IntGauge::new(
            "abx_proxy_open_connections",
            "Downstream (client) connections open.",
        )?;
        let max_connections = IntGauge::new(
            "abx_proxy_max_connections",
            "Downstream connections served at once at most (--max-connections, or what the open-file limit leaves room for); at it new ones wait to be accepted.",
        )?;
        let token_exchanges = IntCounterVec::new(
            Opts::new(
                "abx_proxy_token_exchanges_total",
                "AK/SK token exchanges, by result.",
            ),
            &["result"],
        )?;
        let token_expiry = Gauge::new(
            "abx_proxy_token_expiry_timestamp_seconds",
            "Expiry of the last temporary API key obtained, past when its refresh keeps failing (unix seconds; 0 when none).",
        )?;
        let envd_tokens = IntGauge::new(
            "abx_proxy_envd_tokens",
            "Sandboxes whose envd access token is known.",
        )?;
        let upstream_connections = IntGauge::new(
            "abx_proxy_upstream_connections",
            "Upstream connections open, idle pooled ones included (both planes).",
        )?;
        let log_lines_dropped = IntCounter::new(
            "abx_proxy_log_lines_dropped_total",
            "Log lines dropped because stderr was not read fast enough, or could not be written.",
        )?;
        let tls_handshake_failures = IntCounter::new(
            "abx_proxy_tls_handshake_failures_total",
            "TLS handshakes with clients that ended in an error on the --tls-cert listener.",
        )?;
        let listener_cert_expiry = Gauge::new(
            "abx_proxy_listener_certificate_expiry_timestamp_seconds",
            "When the --tls-cert listener's certificate in use expires, or its issuer sent next to it before it (unix seconds).",
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "abx_proxy_reloads_total",
                "Reloads (SIGHUP or a changed watched file), by result: failure when what was \
                 read did not take effect (failed or refused).",
            ),
            &["result"],
        )?;
        let last_reload_successful = IntGauge::new(
            "abx_proxy_last_reload_successful",
            "1 when the last reload took effect (or none has run), 0 while it has not.",
        )?;
        last_reload_successful.set(1);
        let build_info = IntGaugeVec::new(
            Opts::new("abx_proxy_build_info", "Build information."),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        for result in ["success", "failure"] {
            token_exchanges.with_label_values(&[result]);
            reloads.with_label_values(&[result]);
        }
        // Every fixed label set exists from the start at 0, so that `rate()` sees the first
        // error and a dashboard shows 0 rather than no data.
        for plane in Plane::ALL.map(Plane::label) {
            in_flight.with_label_values(&[plane]);
            duration.with_label_values(&[plane]);
            for kind in FailKind::ALL {
                upstream_errors.with_label_values(&[plane, kind.label()]);
            }
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(open_connections.clone()))?;
        registry.register(Box::new(max_connections.clone()))?;
        registry.register(Box::new(token_exchanges.clone()))?;
        registry.register(Box::new(token_expiry.clone()))?;
        registry.register(Box::new(envd_tokens.clone()))?;
        registry.register(Box::new(upstream_connections.clone()))?;
        registry.register(Box::new(log_lines_dropped.clone()))?;
        registry.register(Box::new(tls_handshake_failures.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(last_reload_successful.clone()))?;
        registry.register(Box::new(build_info))?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            crate::process_metrics::ProcessCollector::for_self()?,
        ))?;
        let hot = Hot {
            in_flight: Plane::ALL.map(|p| in_flight.with_label_values(&[p.label()])),
            duration: Plane::ALL.map(|p| duration.with_label_values(&[p.label()])),
            requests: (0..Plane::ALL.len() * HOT_METHODS.len() * HOT_CODES.len())
                .map(|_| OnceLock::new())
                .collect(),
        };
        for plane in Plane::ALL {
            for method in &FROM_ZERO_METHODS {
                for status in FROM_ZERO_CODES {
                    hot.series(&requests, plane, method, status);
                }
            }
        }
        Ok(Metrics {
            registry,
            requests,
            duration,
            upstream_errors,
            in_flight,
            open_connections,
            max_connections,
            token_exchanges,
            token_expiry,
            envd_tokens,
            upstream_connections,
            log_lines_dropped,
            tls_handshake_failures,
            listener_cert_expiry,
            reloads,
            last_reload_successful,
            hot,
        })
    }

    /// The `--tls-cert` listener serves: its certificate's expiry is a series from now on,
    /// for an alert before handshakes fail (a proxy without the listener has none, rather
    /// than a 0 an alert would have to tell from an expiry). Called once, at the start.
    pub fn serve_tls(&self, expires: f64) -> Result<(), prometheus::Error> {
        self.listener_cert_expiry.set(expires);
        self.registry
            .register(Box::new(self.listener_cert_expiry.clone()))
    }

    /// A reload swapped in a new pair: its certificate's expiry.
    pub fn listener_cert_swapped(&self, expires: f64) {
        self.listener_cert_expiry.set(expires);
    }

    /// `abx_proxy_in_flight_requests{plane}`.
    pub fn in_flight_for(&self, plane: Plane) -> &IntGauge {
        &self.hot.in_flight[plane.index()]
    }

    /// Counts one upstream failure.
    #[cold]
    pub fn upstream_error(&self, plane: Plane, kind: FailKind) {
        self.upstream_errors
            .with_label_values(&[plane.label(), kind.label()])
            .inc();
    }

    /// Counts an answered request and observes its duration (to response headers).
    pub fn request_done(&self, plane: Plane, method: &Method, status: u16, elapsed: Duration) {
        self.hot.duration[plane.index()].observe(elapsed.as_secs_f64());
        match self.hot.series(&self.requests, plane, method, status) {
            Some(counter) => counter.inc(),
            None => self.count_slow(plane, method, status),
        }
    }

    /// Counts a head refused before it became a request (see `Proxy::head_refused`): no
    /// duration observed.
    #[cold]
    pub fn head_refused(&self, plane: Plane, method: &Method, status: u16) {
        self.count_slow(plane, method, status);
    }

    fn count_slow(&self, plane: Plane, method: &Method, status: u16) {
        self.requests
            .with_label_values(&[plane.label(), method_label(method), &code_label(status)])
            .inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        buf
    }
}

/// Holds a gauge up by one for as long as it lives: a future dropped half-way (a client that
/// hangs up, a connection cut at shutdown) still gives its count back.
pub struct GaugeGuard(IntGauge);

impl GaugeGuard {
    pub fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &Metrics) -> String {
        String::from_utf8(m.render()).unwrap_or_default()
    }

    #[test]
    fn cached_and_uncached_series_read_the_same() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        for plane in Plane::ALL {
            assert_eq!(Plane::ALL[plane.index()], plane, "its cached series' slot");
        }
        let fresh = text(&m);
        // Only the usual methods' successes and server errors, at 0, so that a first
        // burst of them is counted.
        let at_start: Vec<&str> = fresh
            .lines()
            .filter(|l| l.starts_with("abx_proxy_requests_total{"))
            .collect();
        let made = Plane::ALL.len() * FROM_ZERO_METHODS.len() * FROM_ZERO_CODES.len();
        assert_eq!(at_start.len(), made, "{at_start:?}");
        assert!(at_start.iter().all(|l| l.ends_with("} 0")), "{at_start:?}");
        for line in [
            r#"abx_proxy_requests_total{code="502",method="POST",plane="envd"} 0"#,
            r#"abx_proxy_requests_total{code="503",method="GET",plane="api"} 0"#,
            r#"abx_proxy_requests_total{code="204",method="DELETE",plane="api"} 0"#,
        ] {
            assert!(at_start.contains(&line), "{line}");
        }
        assert!(!fresh.contains(r#"method="PUT""#) && !fresh.contains(r#"code="404""#));
        // The fixed label sets exist before anything happens.
        for plane in Plane::ALL.map(Plane::label) {
            let count = format!("abx_proxy_request_duration_seconds_count{{plane=\"{plane}\"}} 0");
            assert!(fresh.contains(&count), "{count}");
            for kind in FailKind::ALL.map(FailKind::label) {
                let series = format!(
                    "abx_proxy_upstream_errors_total{{kind=\"{kind}\",plane=\"{plane}\"}} 0"
                );
                assert!(fresh.contains(&series), "{series}");
            }
        }
        let ms = Duration::from_millis(3);
        m.request_done(Plane::Api, &Method::GET, 200, ms);
        m.request_done(Plane::Api, &Method::GET, 200, ms);
        m.request_done(Plane::Envd, &Method::POST, 599, ms);
        m.request_done(Plane::Envd, &Method::TRACE, 405, ms);
        for other in ["PROPFIND", "X1", "X2"] {
            m.request_done(
                Plane::Envd,
                &Method::from_bytes(other.as_bytes()).unwrap(),
                207,
                ms,
            );
        }
        let t = text(&m);
        assert!(t.contains(r#"abx_proxy_requests_total{code="200",method="GET",plane="api"} 2"#));
        assert!(t.contains(r#"abx_proxy_requests_total{code="5xx",method="POST",plane="envd"} 1"#));
        assert!(t.contains(r#"abx_proxy_requests_total{code="405",method="TRACE",plane="envd"} 1"#));
        // Methods a client makes up share one series, however many there are.
        assert!(t.contains(r#"abx_proxy_requests_total{code="207",method="OTHER",plane="envd"} 3"#));
        assert!(!t.contains("PROPFIND"));
        assert!(t.contains(r#"abx_proxy_request_duration_seconds_count{plane="api"} 2"#));
        assert!(t.contains(r#"abx_proxy_request_duration_seconds_count{plane="envd"} 5"#));
        m.in_flight_for(Plane::Envd).inc();
        assert!(text(&m).contains(r#"abx_proxy_in_flight_requests{plane="envd"} 1"#));
    }

    /// An upstream's made-up statuses share their class's series: a sandbox's app on the
    /// envd plane could otherwise add one for each of 900 values.
    #[test]
    fn statuses_without_a_meaning_count_as_their_class() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        for status in 100..=999 {
            m.request_done(Plane::Envd, &Method::GET, status, Duration::from_millis(1));
        }
        let t = text(&m);
        let series: Vec<&str> = t
            .lines()
            .filter(|l| l.starts_with("abx_proxy_requests_total{") && !l.ends_with("} 0"))
            .collect();
        assert!(series.len() < 80, "{}", series.len());
        for (code, n) in [("200", 1), ("418", 1), ("499", 1), ("503", 1)] {
            let line = format!(
                r#"abx_proxy_requests_total{{code="{code}",method="GET",plane="envd"}} {n}"#
            );
            assert!(series.contains(&line.as_str()), "{line}");
        }
        let class = |c: &str| {
            series
                .iter()
                .find(|l| l.contains(&format!(r#"code="{c}""#)))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse::<u32>().ok())
        };
        // 600-999 with the unregistered 5xx; each class with its own unregistered codes.
        assert!(class("5xx").is_some_and(|n| n > 400), "{:?}", class("5xx"));
        assert!(class("2xx").is_some_and(|n| n > 80), "{:?}", class("2xx"));
        let total: u32 = series
            .iter()
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u32>().ok())
            .sum();
        assert_eq!(total, 900);
    }

    /// Each plane, method and code that has a cached slot counts in its own series: two
    /// of them sharing a slot would count one's requests under the other's labels.
    #[test]
    fn every_cached_series_counts_only_its_own_requests() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        let ms = Duration::from_millis(3);
        for plane in Plane::ALL {
            for method in &HOT_METHODS {
                for code in HOT_CODES {
                    m.request_done(plane, method, code, ms);
                }
            }
        }
        let t = text(&m);
        let mut series = 0;
        for plane in Plane::ALL.map(Plane::label) {
            for method in &HOT_METHODS {
                for code in HOT_CODES {
                    let line = format!(
                        "abx_proxy_requests_total{{code=\"{code}\",method=\"{method}\",plane=\"{plane}\"}} 1\n"
                    );
                    assert!(t.contains(&line), "{line}");
                    series += 1;
                }
            }
        }
        assert_eq!(t.matches("abx_proxy_requests_total{").count(), series);
    }

    /// A method of RFC 9110 (or PATCH) keeps its name on the uncached path too: a status
    /// code without a cached slot does not turn `GET` into `OTHER`.
    #[test]
    fn known_methods_keep_their_names_with_any_status_code() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        let names = [
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ];
        for name in names {
            let method = Method::from_bytes(name.as_bytes()).unwrap();
            m.request_done(Plane::Api, &method, 207, Duration::from_millis(3));
        }
        let t = text(&m);
        for name in names {
            let line = format!(
                "abx_proxy_requests_total{{code=\"207\",method=\"{name}\",plane=\"api\"}} 1\n"
            );
            assert!(t.contains(&line), "{line}");
        }
        assert!(!t.contains("OTHER"));
    }

    #[test]
    fn a_gauge_guard_gives_its_count_back_when_dropped() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        let gauge = m.in_flight_for(Plane::Api);
        let first = GaugeGuard::new(gauge);
        let second = GaugeGuard::new(gauge);
        assert_eq!(gauge.get(), 2);
        drop(first);
        assert_eq!(gauge.get(), 1);
        drop(second);
        assert_eq!(gauge.get(), 0);
    }
}
