//! Criterion benchmarks of the per-request hot path: routing, the header rewrite (strip +
//! attach), the credential read, the envd token look-up, and both signing schemes (which run
//! once per token exchange, not per request, but should stay cheap), and the access line.

use std::time::Duration;

use abx_proxy::credentials::envd::TokenStore;
use abx_proxy::credentials::ApiCredential;
use abx_proxy::proxy::headers::{self, AuthScheme, CachedAuth};
use abx_proxy::proxy::route::{self, HostPolicy};
use abx_proxy::secret::Secret;
use abx_proxy::signing::{acs3, rpc_v1};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::request::Parts;

/// The head the Python SDK sends for `POST /v2/sandboxes` (from the wire captures).
fn sdk_api_request() -> Parts {
    http::Request::post("/v2/sandboxes")
        .header("accept", "*/*")
        .header("accept-encoding", "gzip, deflate")
        .header("lang", "python")
        .header("lang_version", "3.11.7")
        .header("package_version", "2.63.0")
        .header("publisher", "e2b")
        .header("sdk_runtime", "python")
        .header("system", "Linux")
        .header("user-agent", "e2b-python-sdk/2.63.0")
        .header("x-api-key", "dummy-key")
        .header("content-type", "application/json")
        .header("content-length", "68")
        .header("connection", "keep-alive")
        .header("host", "127.0.0.1:49982")
        .body(())
        .map(|r| r.into_parts().0)
        .unwrap_or_else(|_| unreachable!("static request"))
}

fn sdk_envd_request() -> Parts {
    http::Request::get("/files?path=%2Fhome%2Fuser%2Fhello.txt")
        .header("accept", "*/*")
        .header("accept-encoding", "gzip, deflate")
        .header("user-agent", "e2b-python-sdk/2.63.0")
        .header("x-access-token", "envd-token-FAKE-123")
        .header("e2b-sandbox-id", "isb-fake0001")
        .header("e2b-sandbox-port", "49983")
        .header("host", "127.0.0.1:49982")
        .body(())
        .map(|r| r.into_parts().0)
        .unwrap_or_else(|_| unreachable!("static request"))
}

fn routing(c: &mut Criterion) {
    let api = sdk_api_request();
    let envd = sdk_envd_request();
    let policy = HostPolicy::Loopback;
    c.bench_function("route/api", |b| {
        b.iter(|| route::route(black_box(&api), &policy))
    });
    c.bench_function("route/envd", |b| {
        b.iter(|| route::route(black_box(&envd), &policy))
    });
}

fn header_rewrite(c: &mut Criterion) {
    let template = sdk_api_request().headers;
    let key = Secret::new("sk-0123456789abcdef0123456789abcdef");
    // As the handler does it: the header value from the per-key cache, then strip + attach.
    let auth = CachedAuth::new(AuthScheme::Bearer);
    c.bench_function("rewrite/api (strip + attach)", |b| {
        b.iter_batched_ref(
            || template.clone(),
            |h| {
                headers::strip_hop_by_hop(h, false);
                h.remove(http::header::HOST);
                let value = auth
                    .value(&key)
                    .unwrap_or_else(|| unreachable!("valid key"));
                headers::authorize_api(h, auth.scheme(), value);
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let envd = sdk_envd_request().headers;
    let token = Secret::new("envd-token-FAKE-123");
    c.bench_function("rewrite/envd (strip + attach)", |b| {
        b.iter_batched_ref(
            || envd.clone(),
            |h| {
                headers::strip_hop_by_hop(h, false);
                h.remove(http::header::HOST);
                headers::authorize_envd(h, &AuthScheme::Bearer, &token, "isb-fake0001", 49983);
            },
            criterion::BatchSize::SmallInput,
        )
    });
}

/// The bytes of the SDK's `POST /v2/sandboxes` head and body, as the framing watch sees
/// them on every read of a client connection.
const SDK_HEAD: &[u8] = b"POST /v2/sandboxes HTTP/1.1\r\nHost: 127.0.0.1:49982\r\n\
    Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n\
    User-Agent: e2b-python-sdk/2.63.0\r\nX-API-Key: dummy-key\r\nlang: python\r\n\
    lang_version: 3.11.7\r\npackage_version: 2.63.0\r\npublisher: e2b\r\n\
    sdk_runtime: python\r\nsystem: Linux\r\nContent-Type: application/json\r\n\
    Content-Length: 68\r\n\r\n\
    {\"templateID\": \"base\", \"timeout\": 300, \"secure\": true, \"metadata\": {}}";

fn framing_and_metrics(c: &mut Criterion) {
    c.bench_function("framing/scan (SDK head + body)", |b| {
        b.iter_batched_ref(
            abx_proxy::proxy::framing::watch,
            |(watch, _)| watch.scan(black_box(SDK_HEAD)),
            criterion::BatchSize::SmallInput,
        )
    });
    let metrics = abx_proxy::metrics::Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}"));
    let took = Duration::from_micros(850);
    c.bench_function("metrics/request_done (api GET 200)", |b| {
        b.iter(|| {
            metrics.request_done(
                abx_proxy::metrics::Plane::Api,
                black_box(&http::Method::GET),
                black_box(200),
                took,
            )
        })
    });
}

fn credential_read(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let cred = arc_swap::ArcSwap::from_pointee(ApiCredential::Static(Secret::new("sk-key")));
    c.bench_function("credential/current (static)", |b| {
        b.iter(|| rt.block_on(async { cred.load_full().current().await }))
    });
    let store = TokenStore::new();
    for i in 0..1000 {
        store.insert(&format!("isb-{i:04}"), Secret::new(format!("tok-{i}")));
    }
    c.bench_function("envd token lookup (1000 sandboxes)", |b| {
        b.iter(|| store.get(black_box("isb-0500")))
    });
    // A request that names no sandbox but carries its token (older SDKs), at the store's
    // bound.
    let store = TokenStore::new();
    for i in 0..10_000 {
        store.insert(&format!("isb-{i:05}"), Secret::new(format!("tok-{i:05}")));
    }
    c.bench_function("envd sandbox by token (10000 sandboxes)", |b| {
        b.iter(|| store.sandbox_of(black_box(b"tok-05000")))
    });
    // A sandbox's token replaced (a connect's answer with a new one): the store is copied,
    // at its bound. (A create's new id pays, once in 156, a sort for the oldest besides.)
    let mut n = 0u64;
    c.bench_function("envd token learned (10000 sandboxes)", |b| {
        b.iter(|| {
            n += 1;
            store.insert("isb-05000", Secret::new(format!("tok-new-{n}")))
        })
    });
    // A fork's answer of 100 new sandboxes, at the bound: one copy, and when the store is
    // full, the 156 oldest dropped (a 64th of the bound at once).
    let mut round = 0u64;
    c.bench_function("envd 100 tokens learned at once (10000 sandboxes)", |b| {
        b.iter(|| {
            round += 1;
            let forks: Vec<(String, Secret)> = (0..100)
                .map(|i| {
                    (
                        format!("isb-r{round}-{i}"),
                        Secret::new(format!("tok-r{round}-{i}")),
                    )
                })
                .collect();
            store.insert_all(&forks)
        })
    });
}

fn signing(c: &mut Criterion) {
    let secret = Secret::new("testsecret");
    let params = rpc_v1::create_api_key_params(
        "testid",
        "cn-hangzhou",
        "3ee8c1b8-83d3-44af-a94f-4e0ad82fd6cf",
        "2025-01-01T00:00:00Z",
    );
    c.bench_function("sign/rpc-v1 CreateApiKey", |b| {
        b.iter(|| rpc_v1::signed_query("POST", black_box(&params), &secret))
    });
    let input = acs3::CreateApiKey {
        host: "fcsandbox.cn-hangzhou.aliyuncs.com",
        path_prefix: "",
        access_key_id: "testid",
        hostname: "bench",
        now: time::OffsetDateTime::UNIX_EPOCH,
        ttl: time::Duration::hours(1),
        nonce: "d410180a5abf7fe235dd9b74aca91fc0",
    };
    c.bench_function("sign/acs3 CreateApiKey", |b| {
        b.iter(|| acs3::create_api_key_request(black_box(&input), &secret))
    });
}

/// The per-request access line (SPEC §7): the hand-written formatter into its buffer, the
/// whole fast path (filter check, span check, clock, format) into a sink, and, for
/// comparison, the same event through tracing-subscriber's fmt layer into a sink.
fn access_log(c: &mut Criterion) {
    use abx_proxy::cli::LogFormat;
    use abx_proxy::logging::{self, AccessLine};
    use std::time::SystemTime;

    let line = AccessLine {
        method: &http::Method::POST,
        path: "/v2/sandboxes",
        plane: "api",
        status: 201,
        elapsed: Duration::from_micros(772),
        upstream: "api.sandbox.example.com",
        error: None,
        reason: None,
    };
    let mut group = c.benchmark_group("access_log");
    let mut buf = Vec::with_capacity(256);
    for (name, format) in [("text", LogFormat::Text), ("json", LogFormat::Json)] {
        group.bench_function(format!("format/{name}"), |b| {
            b.iter(|| {
                buf.clear();
                logging::format_access(&mut buf, format, SystemTime::now(), black_box(&line));
                black_box(buf.len())
            })
        });
        // `init`'s subscriber (colours off, default filter) writing into a sink; scoped to
        // this thread, so the dispatcher look-up is a little dearer than the global one.
        let filter = tracing_subscriber::EnvFilter::new("info");
        let timer = tracing_subscriber::fmt::time::SystemTime;
        let dispatch = logging::subscriber(format, filter, false, timer, std::io::sink);
        tracing::dispatcher::with_default(&dispatch, || {
            group.bench_function(format!("fast path/{name}"), |b| {
                b.iter(|| {
                    logging::access_with(format, black_box(&line), |bytes| {
                        black_box(bytes.len());
                    })
                })
            });
            group.bench_function(format!("tracing-subscriber/{name}"), |b| {
                b.iter(|| logging::access_via_tracing(black_box(&line)))
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = routing, header_rewrite, framing_and_metrics, credential_read, signing, access_log
}
criterion_main!(benches);
