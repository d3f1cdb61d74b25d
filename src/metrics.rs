//! The Prometheus registry and the handles the proxy updates (SPEC §7 names).
//! Label sets that are fixed (`result`) are created at startup so the series exist at 0.

use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub upstream_errors: IntCounterVec,
    pub in_flight: IntGaugeVec,
    pub open_connections: IntGauge,
    pub token_exchanges: IntCounterVec,
    pub token_expiry: Gauge,
    pub envd_tokens: IntGauge,
}

/// The plane label values.
pub const PLANES: [&str; 2] = ["api", "envd"];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "abx_proxy_requests_total",
                "Requests answered, by plane, method and status code.",
            ),
            &["plane", "method", "code"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "abx_proxy_request_duration_seconds",
                "Time from request to response headers.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
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
            Opts::new("abx_proxy_in_flight_requests", "Requests being served."),
            &["plane"],
        )?;
        let open_connections = IntGauge::new(
            "abx_proxy_open_connections",
            "Downstream (client) connections open.",
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
            "Expiry of the temporary API key in use (unix seconds; 0 when none).",
        )?;
        let envd_tokens = IntGauge::new(
            "abx_proxy_envd_tokens",
            "Sandboxes whose envd access token is known.",
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new("abx_proxy_build_info", "Build information."),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        for result in ["success", "failure"] {
            token_exchanges.with_label_values(&[result]);
        }
        for plane in PLANES {
            in_flight.with_label_values(&[plane]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(open_connections.clone()))?;
        registry.register(Box::new(token_exchanges.clone()))?;
        registry.register(Box::new(token_expiry.clone()))?;
        registry.register(Box::new(envd_tokens.clone()))?;
        registry.register(Box::new(build_info))?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Metrics {
            registry,
            requests,
            duration,
            upstream_errors,
            in_flight,
            open_connections,
            token_exchanges,
            token_expiry,
            envd_tokens,
        })
    }

    /// The text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        buf
    }
}
