//! Operations (SPEC §5, §7): the admin listener's metrics and readiness, request logs,
//! SIGHUP reload, and the AK/SK credential seen through the real binary. Upstreams are
//! in-process TLS servers (tests/support); the token endpoint is the verifying fake of
//! tests/support/fake_exchange.rs.

mod support;

#[path = "support/fake_exchange.rs"]
mod fake_exchange;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abx_proxy::credentials::exchange::SystemClock;
use bytes::Bytes;
use fake_exchange::{FakeExchange, Mode, ACCESS_KEY_ID, ACCESS_KEY_SECRET};
use http_body_util::BodyExt;
use support::*;
use tokio::sync::{oneshot, watch};

/// `GET path` through the proxy (or the admin listener): status and body.
async fn get(addr: SocketAddr, path: &str) -> (u16, Bytes) {
    let resp = send(
        addr,
        request("GET", addr, path).body(empty()).expect("request"),
    )
    .await;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, body)
}

/// A signed file URL as envd gets it: `GET /files?…&signature=…` for sandbox `isb-1`, with
/// the client's own token (no look-up). The signature is a secret in the query string.
async fn get_signed(addr: SocketAddr, secret: &str) -> u16 {
    let path = format!("/files?path=%2Ftmp%2Fx&signature={secret}");
    let req = request("GET", addr, &path)
        .header("e2b-sandbox-id", "isb-1")
        .header("x-access-token", "t")
        .body(empty())
        .expect("request");
    send(addr, req).await.status().as_u16()
}

/// `/metrics` must be served as the Prometheus text format, version 0.0.4.
async fn assert_metrics_content_type(admin: SocketAddr) {
    let resp = send(
        admin,
        request("GET", admin, "/metrics")
            .body(empty())
            .expect("req"),
    )
    .await;
    let ctype = resp.headers()["content-type"]
        .to_str()
        .expect("text")
        .to_string();
    assert!(
        ctype.starts_with("text/plain") && ctype.contains("version=0.0.4"),
        "{ctype}"
    );
}

/// The value of `name{labels}` (label order is irrelevant).
fn series(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    metric(text, &format!("{name}{{{}}}", labels.join(",")))
}

fn requests_total(text: &str, method: &str, code: &str) -> f64 {
    series(
        text,
        "abx_proxy_requests_total",
        &[("plane", "api"), ("method", method), ("code", code)],
    )
    .unwrap_or(0.0)
}

async fn promtool_check(text: &str) {
    let mut cmd = Command::new("promtool");
    cmd.args(["check", "metrics"]);
    let out = output_within_input(
        cmd,
        text.as_bytes().to_vec(),
        "promtool check metrics (Debian package prometheus; scripts/deps.sh installs it)",
    )
    .await;
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool_and_count_exactly_the_requests_made() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match req.method().as_str() {
            "POST" => response(201, "{}"),
            _ => response(200, "[]"),
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());

    assert_metrics_content_type(admin).await;
    let before = scrape(admin).await;
    promtool_check(&before).await;
    // Fixed label sets exist from startup, at 0.
    for result in ["success", "failure"] {
        assert_eq!(
            series(
                &before,
                "abx_proxy_token_exchanges_total",
                &[("result", result)]
            ),
            Some(0.0),
            "{before}"
        );
    }
    for plane in ["api", "envd"] {
        for kind in ["connect", "tls", "timeout", "reset", "protocol"] {
            let labels = [("plane", plane), ("kind", kind)];
            let errors = series(&before, "abx_proxy_upstream_errors_total", &labels);
            assert_eq!(errors, Some(0.0), "{plane} {kind}: {before}");
        }
        let labels = [("plane", plane)];
        let timed = series(&before, "abx_proxy_request_duration_seconds_count", &labels);
        assert_eq!(timed, Some(0.0), "{plane}: {before}");
        let in_flight = series(&before, "abx_proxy_in_flight_requests", &labels);
        assert_eq!(in_flight, Some(0.0), "{plane}: {before}");
    }
    for result in ["success", "failure"] {
        let reloads = series(&before, "abx_proxy_reloads_total", &[("result", result)]);
        assert_eq!(reloads, Some(0.0), "{before}");
    }
    // No reload has failed: an alert on 0 must not fire on a fresh process.
    let last = series(&before, "abx_proxy_last_reload_successful", &[]);
    assert_eq!(last, Some(1.0), "{before}");
    assert_eq!(
        series(
            &before,
            "abx_proxy_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    // The slots served: --max-connections's 10 000, or what the open-file limit leaves.
    let slots = series(&before, "abx_proxy_max_connections", &[]);
    assert!(
        slots.is_some_and(|n| (1.0..=10_000.0).contains(&n)),
        "{before}"
    );
    for name in [
        "abx_proxy_open_connections",
        "abx_proxy_envd_tokens",
        "abx_proxy_upstream_connections",
        "abx_proxy_tls_handshake_failures_total",
        "abx_proxy_token_expiry_timestamp_seconds",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(
            series(&before, name, &[]).is_some(),
            "{name} missing:\n{before}"
        );
    }
    assert_eq!(requests_total(&before, "GET", "200"), 0.0);

    for _ in 0..5 {
        assert_eq!(get(addr, "/sandboxes").await.0, 200);
    }
    for _ in 0..2 {
        let req = request("POST", addr, "/sandboxes")
            .body(full("{}"))
            .expect("request");
        assert_eq!(send(addr, req).await.status(), 201);
    }
    // Refused by the proxy itself: counted too, with the status it answered.
    let refused = raw_exchange(addr, b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n").await;
    assert_eq!(refused.status, 400);

    let after = scrape(admin).await;
    promtool_check(&after).await;
    assert_eq!(requests_total(&after, "GET", "200"), 5.0, "{after}");
    assert_eq!(requests_total(&after, "POST", "201"), 2.0, "{after}");
    assert_eq!(requests_total(&after, "GET", "400"), 1.0, "{after}");
    assert_eq!(
        series(
            &after,
            "abx_proxy_request_duration_seconds_count",
            &[("plane", "api")]
        ),
        Some(8.0)
    );
    // The buckets reach the default --upstream-timeout: a 504 after 300 s is not just +Inf.
    assert_eq!(
        series(
            &after,
            "abx_proxy_request_duration_seconds_bucket",
            &[("plane", "api"), ("le", "300")]
        ),
        Some(8.0)
    );
    assert_eq!(
        series(&after, "abx_proxy_in_flight_requests", &[("plane", "api")]),
        Some(0.0)
    );
    // Scrapes of the admin listener are not requests through the proxy.
    let again = scrape(admin).await;
    assert_eq!(requests_total(&again, "GET", "200"), 5.0);
    assert_no_key(&after, "/metrics");

    proxy.finish().await;

    // Nothing listening upstream: counted as an upstream error of kind connect.
    let proxy = ProxyCmd::new(&format!("https://{}", refused_addr().await), &pki)
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 502);
    let down = scrape(proxy.admin_addr()).await;
    promtool_check(&down).await;
    assert_eq!(
        series(
            &down,
            "abx_proxy_upstream_errors_total",
            &[("plane", "api"), ("kind", "connect")]
        ),
        Some(1.0),
        "{down}"
    );
    assert_eq!(requests_total(&down, "GET", "502"), 1.0);
    proxy.finish().await;
}

/// An AK/SK proxy whose token endpoint is `fake`.
fn aksk_proxy(upstream: &Upstream, pki: &Pki, fake: &FakeExchange) -> ProxyCmd {
    ProxyCmd::new(&upstream.url(), pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .env("ALICLOUD_ACCESS_KEY_ID", Some(ACCESS_KEY_ID))
        .env("ALICLOUD_ACCESS_KEY_SECRET", Some(ACCESS_KEY_SECRET))
        .args(&["--token-exchange-url", &fake.url])
}

/// [`aksk_proxy`] with the pair in `~/.abx/.env` instead of the environment: a reload
/// (SIGHUP) can then replace it.
fn aksk_proxy_from_dotenv(upstream: &Upstream, pki: &Pki, fake: &FakeExchange) -> ProxyCmd {
    aksk_proxy(upstream, pki, fake)
        .env("ALICLOUD_ACCESS_KEY_ID", None)
        .env("ALICLOUD_ACCESS_KEY_SECRET", None)
        .abx_file(".env", &dotenv_pair())
}

/// The test pair as `.env` lines.
fn dotenv_pair() -> String {
    format!(
        "ALICLOUD_ACCESS_KEY_ID={ACCESS_KEY_ID}\nALICLOUD_ACCESS_KEY_SECRET={ACCESS_KEY_SECRET}\n"
    )
}

fn assert_no_aksk_secret(text: &str, issued: &[String], what: &str) {
    assert!(
        !text.contains(ACCESS_KEY_SECRET),
        "AccessKey secret in {what}"
    );
    for key in issued {
        assert!(!text.contains(key.as_str()), "a temporary key in {what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_credential_and_the_drain() {
    let pki = Pki::new();
    let (release_tx, release_rx) = watch::channel(false);
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let mut release = release_rx.clone();
        async move {
            if req.uri().path() == "/slow" {
                let _ = release.wait_for(|r| *r).await;
            }
            response(200, "ok")
        }
    })
    .await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.hold();
    let mut proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let admin = proxy.admin_addr();

    // The first exchange started at startup and is held: not ready, and liveness is fine.
    fake.until_calls(1).await;
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!((status, &body[..]), (503, &b"not ready\n"[..]));
    assert_eq!(get(admin, "/healthz").await.0, 200);

    fake.release();
    proxy.wait_for_line("token exchange succeeded").await;
    assert_eq!(get(admin, "/readyz").await.0, 200);
    let text = scrape(admin).await;
    assert_eq!(
        series(
            &text,
            "abx_proxy_token_exchanges_total",
            &[("result", "success")]
        ),
        Some(1.0)
    );
    assert!(
        series(&text, "abx_proxy_token_expiry_timestamp_seconds", &[]).unwrap_or(0.0) > 1.7e9,
        "{text}"
    );

    // The upstream sees the temporary key, never the AccessKey secret.
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    let seen = upstream.next_request().await;
    let issued = fake.issued_keys();
    assert_eq!(
        seen.all("authorization"),
        vec![format!("Bearer {}", issued[0])]
    );
    for (_, v) in seen.headers.iter() {
        assert!(!v.to_str().unwrap_or("").contains(ACCESS_KEY_SECRET));
    }

    // Draining: /readyz turns 503 while an in-flight request finishes.
    let addr = proxy.addr();
    let slow = tokio::spawn(async move { get(addr, "/slow").await.0 });
    upstream.next_request().await;
    proxy.signal("TERM");
    proxy.wait_for_line("listener closed").await;
    // Said as what it is: an expected drain, not a credential missing.
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!((status, &body[..]), (503, &b"draining\n"[..]));
    // A reload asked for now is not done: the next start reads the files.
    proxy.signal("HUP");
    proxy
        .wait_for_line("reload skipped: the proxy is draining")
        .await;
    release_tx.send_replace(true);
    assert_eq!(within("the slow request", slow).await.expect("join"), 200);
    let status = proxy.wait_exit().await;
    assert!(status.success());
    assert_no_aksk_secret(&proxy.stderr(), &fake.issued_keys(), "the proxy's stderr");
}

/// A reload whose new pair's first exchange is still out when the drain begins is stopped:
/// the process is on its way out. It went on, and its key, minted for no one, was swapped
/// in during the drain (or a read slow to end let it start one then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_stops_a_reload_whose_new_pair_is_still_exchanging() {
    let pki = Pki::new();
    let (release_tx, release_rx) = watch::channel(false);
    let mut upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let mut release = release_rx.clone();
        async move {
            let _ = release.wait_for(|r| *r).await;
            response(200, "ok")
        }
    })
    .await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    let mut proxy = aksk_proxy_from_dotenv(&upstream, &pki, &fake).spawn().await;
    proxy.wait_for_line("token exchange succeeded").await;
    // A request in flight holds the drain open.
    let addr = proxy.addr();
    let held = tokio::spawn(async move { get(addr, "/sandboxes").await.0 });
    upstream.next_request().await;

    fake.hold();
    let rotated = "ALICLOUD_ACCESS_KEY_ID=LTAI5tRotatedPair000\nALICLOUD_ACCESS_KEY_SECRET=rotated-secret-QQQQ9999rrrr0000\n";
    std::fs::write(proxy.abx_home().join(".env"), rotated).expect("rewrite .env");
    proxy.signal("HUP");
    // The new pair's first exchange has arrived, and waits.
    fake.until_calls(2).await;
    proxy.signal("TERM");
    proxy
        .wait_for_line("reload stopped: the proxy is draining")
        .await;
    fake.release();
    release_tx.send_replace(true);
    assert_eq!(within("the held request", held).await.expect("join"), 200);
    assert!(proxy.wait_exit().await.success());
    let stderr = proxy.stderr();
    assert!(!stderr.contains("reloaded"), "{stderr}");
    assert!(
        !stderr.contains("QQQQ9999rrrr0000"),
        "the new secret in the log"
    );
    assert_no_aksk_secret(&stderr, &fake.issued_keys(), "the proxy's stderr");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temporary_key_rotates_before_expiry_under_load_without_a_failure() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.set_ttl(Some(Duration::from_secs(20)));
    let proxy = aksk_proxy(&upstream, &pki, &fake)
        .args(&["--token-ttl", "20", "--token-refresh-before", "10"])
        .spawn()
        .await;
    let addr = proxy.addr();

    // Two clients send a request every 5 ms each until the upstream has seen the second
    // key (about 10 s), and at most `MAX_EACH`: a steady stream across the rotation that
    // leaves the machine's two cores to the tests running beside it.
    const MAX_EACH: usize = 5_000;
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut clients = Vec::new();
    for _ in 0..2 {
        let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            // Pacing the load (the behaviour under test), not synchronisation.
            let mut every = tokio::time::interval(Duration::from_millis(5));
            for _ in 0..MAX_EACH {
                every.tick().await;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let status = get(addr, "/sandboxes").await.0;
                sent.fetch_add(1, Ordering::SeqCst);
                if status != 200 {
                    failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let second = format!("Bearer {}", fake.until_issued(2).await[1]);
    within("the upstream to see the rotated key", async {
        let mut every = poll_ticker();
        loop {
            if upstream
                .seen()
                .iter()
                .any(|s| s.header("authorization") == Some(second.as_str()))
            {
                break;
            }
            every.tick().await;
            let before = sent.load(Ordering::SeqCst);
            while sent.load(Ordering::SeqCst) == before {
                every.tick().await;
            }
        }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.expect("client");
    }
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "requests failed during rotation"
    );
    assert_eq!(fake.calls(), 2, "exactly one refresh");
    let keys: std::collections::HashSet<String> = upstream
        .seen()
        .iter()
        .filter_map(|s| s.header("authorization").map(str::to_string))
        .collect();
    assert_eq!(keys.len(), 2, "the first key, then the second: {keys:?}");
    let stderr = proxy.finish().await;
    assert_no_aksk_secret(&stderr, &fake.issued_keys(), "the proxy's stderr");
}

/// `abx-proxy`, run from `home` (so `home/.abx` is `~/.abx`) with only an AccessKey pair in
/// a cleared environment.
fn aksk_command(home: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
    cmd.env_clear()
        .env("HOME", home)
        .env("ALICLOUD_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("ALICLOUD_ACCESS_KEY_SECRET", ACCESS_KEY_SECRET)
        .current_dir(home);
    cmd
}

/// `abx-proxy <args>` with only an AccessKey pair in a cleared environment.
async fn run_check(home: &Path, args: &[&str]) -> Output {
    let mut cmd = aksk_command(home);
    cmd.args(args);
    output(cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_performs_one_exchange_and_reports_the_expiry() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "[]") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    let home = tempfile::tempdir().expect("home");
    let ca = pki.ca_pem.display().to_string();
    let url = upstream.url();
    let check = |exchange_url: String| {
        let args = [
            "check".to_string(),
            "--token-exchange-url".into(),
            exchange_url,
            "--sandbox-base-url".into(),
            url.clone(),
            "--upstream-ca".into(),
            ca.clone(),
        ];
        let home = home.path().to_path_buf();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_check(&home, &args).await
        }
    };
    let out = check(fake.url.clone()).await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(fake.accepted(), 1, "exactly one signed exchange");
    assert!(stdout.contains("temporary key expires at 20"), "{stdout}");
    let issued = fake.issued_keys();
    assert_no_aksk_secret(&format!("{stdout}{stderr}"), &issued, "check's output");
    assert_eq!(
        upstream.seen()[0].all("authorization"),
        vec![format!("Bearer {}", issued[0])]
    );

    // The endpoint reached but failing (5xx): unavailable, exit 69 as when unreachable;
    // the configuration (78) may well be right.
    fake.set_mode(Mode::Fail500);
    let out = check(fake.url.clone()).await;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains("[E5001] upstream unavailable: the endpoint answered HTTP 500"),
        "{stderr}"
    );

    // The endpoint unreachable: exit 69.
    drop(fake);
    let out = check(format!("http://{}", refused_addr().await)).await;
    assert_eq!(
        out.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A static-key proxy whose key is in `ABX_HOME/.env`, where a reload can change it.
fn key_in_env_file(upstream: &Upstream, pki: &Pki, key: &str) -> ProxyCmd {
    ProxyCmd::new(&upstream.url(), pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", &format!("ABX_SANDBOX_API_KEY={key}\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_the_key_without_a_restart_or_a_failed_request() {
    const KEY1: &str = "sk-reload-one-AAAA1111bbbb2222";
    const KEY2: &str = "sk-reload-two-CCCC3333dddd4444";
    const KEY3: &str = "sk-reload-three-EEEE5555ffff6666";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = key_in_env_file(&upstream, &pki, KEY1).spawn().await;
    let addr = proxy.addr();

    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let (first_tx, first_rx) = oneshot::channel();
    let client = {
        let (stop, failed) = (stop.clone(), failed.clone());
        tokio::spawn(async move {
            let mut first = Some(first_tx);
            // Paced and counted: a request a millisecond at most, while the reloads last.
            let mut every = tokio::time::interval(Duration::from_millis(1));
            for _ in 0..20_000 {
                every.tick().await;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                if get(addr, "/sandboxes").await.0 != 200 {
                    failed.fetch_add(1, Ordering::SeqCst);
                }
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        })
    };
    within("the first request", first_rx).await.expect("client");

    let line = proxy
        .reload_env(&format!("ABX_SANDBOX_API_KEY={KEY2}\n"), "reloaded")
        .await;
    assert!(
        line.contains("sandbox_api_key"),
        "names what changed: {line}"
    );
    let bearer2 = format!("Bearer {KEY2}");
    within("a request with the new key", async {
        let mut every = poll_ticker();
        while !upstream
            .seen()
            .iter()
            .any(|s| s.header("authorization") == Some(bearer2.as_str()))
        {
            every.tick().await;
        }
    })
    .await;

    // A broken file: the reload fails, says why, and the running key stays.
    proxy
        .reload_env("ABX_SANDBOX_API_KEY=\"unterminated\n", "reload failed")
        .await;
    // So does one whose `${NAME}` references could expand past 16 MiB (the last line here
    // would be 64 MiB): dotenvy's unbounded expansion of such a file ended the process.
    let mut doubling = format!("ABX_SANDBOX_API_KEY={KEY3}\nV0={}\n", "x".repeat(64));
    for i in 1..=20 {
        doubling += &format!("V{i}=${{V{}}}${{V{}}}\n", i - 1, i - 1);
    }
    let line = proxy.reload_env(&doubling, "reload failed").await;
    assert!(line.contains("could expand past 16 MiB"), "{line}");

    // SPEC §3: a new key whose hosts moved too (here envd's domain) is refused: neither the
    // new key with the old hosts nor the old key with the new ones; what runs stays.
    let moved = format!("ABX_SANDBOX_API_KEY={KEY3}\nABX_SANDBOX_DOMAIN=elsewhere.example\n");
    let line = proxy.reload_env(&moved, "reload refused").await;
    assert!(line.contains("sandbox_domain"), "{line}");
    // The same, the host set in the working directory's `.env`: at a start the proxy
    // would warn that the key from elsewhere goes there; refused, it goes nowhere new.
    // A misspelt name beside it is still said.
    let here = (
        proxy.cwd().join(".env"),
        "ABX_SANDBOX_DOMAIN=other.example\nABX_SANDBOXURL=https://other.example\n",
    );
    let line = proxy.reload_files(&[here], "reload refused").await;
    assert!(line.contains("sandbox_domain"), "{line}");
    // Nor a reload that fails, with the same new host.
    let here = (
        proxy.cwd().join(".env"),
        "ABX_SANDBOX_DOMAIN=other.example\nABX_TOKEN_REFRESH_BEFORE=soon\n",
    );
    proxy.reload_files(&[here], "reload failed").await;
    stop.store(true, Ordering::SeqCst);
    client.await.expect("client");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(bearer2.clone()));
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "a request failed around the reload"
    );
    let before = upstream
        .seen()
        .iter()
        .filter(|s| s.header("authorization") == Some(&format!("Bearer {KEY1}")))
        .count();
    assert!(before > 0, "the first key was used before the reload");
    let stderr = proxy.finish().await;
    // The file decides the key here: nothing shadows it, and no warning says so.
    let shadowed: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("higher level still decides"))
        .collect();
    assert!(shadowed.is_empty(), "{shadowed:?}");
    assert!(!stderr.contains("goes there"), "{stderr}");
    assert!(stderr.contains("did you mean ABX_SANDBOX_URL?"), "{stderr}");
    for key in [KEY1, KEY2, KEY3] {
        assert!(!stderr.contains(key), "a key value in the log:\n{stderr}");
    }
}

/// Settings warnings are log lines, with a timestamp and a level, in text too; and a
/// reload says only those it finds anew: said again at every SIGHUP and every rotated key
/// file, a misspelt name was noise. One that went away and came back is said again; one
/// of what runs stands through a reload that was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_says_only_the_warnings_it_finds_anew() {
    const KEY: &str = "sk-warned-once-GGGG7777hhhh8888";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let (region, listen) = ("ABX_REGION (~/.abx/.env (", "ABX_LISTEN (~/.abx/.env (");
    let with = |names: &[&str]| {
        let mut env = format!("ABX_SANDBOX_API_KEY={KEY}\n");
        names.iter().for_each(|n| env += &format!("{n}=x\n"));
        env
    };
    // envd's host in the working directory's `.env`: the key from ~/.abx/.env goes there.
    let envd = |host: &str| format!("ABX_SANDBOX_URL=https://{host}\n");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", &with(&["ABX_REGION"]))
        .cwd_dotenv(&envd("envd.invalid"))
        .spawn()
        .await;
    let unchanged = "reload: no setting changed";
    proxy.reload_env(&with(&["ABX_REGION"]), unchanged).await;
    // A reload refused (the host moved) changes nothing that runs: back where it was, what
    // was said of where the key goes still stands.
    let here = proxy.cwd().join(".env");
    let moved = envd("elsewhere.invalid");
    proxy
        .reload_files(&[(here.clone(), &moved)], "reload refused")
        .await;
    let back = envd("envd.invalid");
    proxy.reload_files(&[(here, &back)], unchanged).await;
    proxy
        .reload_env(&with(&["ABX_REGION", "ABX_LISTEN"]), unchanged)
        .await;
    proxy.reload_env(&with(&["ABX_LISTEN"]), unchanged).await;
    proxy
        .reload_env(&with(&["ABX_REGION", "ABX_LISTEN"]), unchanged)
        .await;
    let stderr = proxy.finish().await;
    let warned = |l: &&str| l.contains("is not a variable abx-proxy reads");
    let said = |what: &str| {
        stderr
            .lines()
            .filter(warned)
            .filter(|l| l.contains(what))
            .count()
    };
    assert_eq!((said(region), said(listen)), (2, 1), "{stderr}");
    assert_eq!(stderr.matches("goes there").count(), 1, "{stderr}");
    for line in stderr.lines().filter(|l| l.contains(region)) {
        assert!(line.starts_with("20") && line.contains(" WARN "), "{line}");
    }
}

/// Kubernetes rotates a Secret by updating its mounted file (swapping the volume's `..data`
/// link), and nothing in the pod can send the proxy a SIGHUP. A changed
/// `--sandbox-api-key-file` reloads on its own: the file is polled every few seconds and a
/// change applies once two reads agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_file_reloads_without_a_signal() {
    use std::os::unix::fs::symlink;
    const KEY1: &str = "sk-mounted-one-JJJJ1111kkkk2222";
    const KEY2: &str = "sk-mounted-two-LLLL3333mmmm4444";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    // The kubelet's layout: key -> ..data/key, ..data -> ..<version>.
    let volume = tempfile::tempdir().expect("volume");
    let version = |name: &str, key: &str| {
        let dir = volume.path().join(name);
        std::fs::create_dir(&dir).expect("version dir");
        std::fs::write(dir.join("key"), format!("{key}\n")).expect("key");
        let tmp = volume.path().join("..data_tmp");
        symlink(name, &tmp).expect("link");
        std::fs::rename(&tmp, volume.path().join("..data")).expect("swap ..data");
    };
    version("..v1", KEY1);
    symlink("..data/key", volume.path().join("key")).expect("key link");
    let key_file = volume.path().join("key").display().to_string();
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .args(&["--sandbox-api-key-file", &key_file])
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY1}")));

    version("..v2", KEY2);
    proxy.wait_for_line("a watched file changed").await;
    let line = proxy.wait_for_line("reloaded").await;
    assert!(line.contains("sandbox_api_key"), "{line}");
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY2}")));
    let stderr = proxy.finish().await;
    for key in [KEY1, KEY2] {
        assert!(!stderr.contains(key), "a key value in the log:\n{stderr}");
    }
}

/// A key given through a pipe (`--sandbox-api-key-file <(…)`, `/dev/stdin`) is the start's
/// to read, once: the file watch read it first, and the start found it empty (E1001). A
/// SIGHUP keeps what the start read: read again, the pipe was empty (the reload failed),
/// and a terminal's would have waited for the user, holding up the whole proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_that_is_a_pipe_is_read_by_the_start() {
    const KEY: &str = "sk-piped-in-RRRR9999ssss0000";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .stdin(format!("{KEY}\n").as_bytes())
        .args(&["--sandbox-api-key-file", "/dev/stdin"])
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY}")));
    proxy.signal("HUP");
    proxy.wait_for_line("reload: no setting changed").await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY}")));
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(KEY), "the key in the log:\n{stderr}");
    assert!(!stderr.contains("reload failed"), "{stderr}");
}

/// A SIGHUP in the moments the start takes is kept for the running proxy, which reloads;
/// it took its default action (exit 129), where SIGHUP never stops the proxy. SIGTERM and
/// SIGINT there end the process at once, as Ctrl-C must end a start that waits for a key
/// from a pipe or the terminal (kept for later, they left it waiting for good). The start
/// is held open by its key file, a FIFO it reads once, which the test writes only after
/// the signal, or never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_the_start_reloads_or_ends_it() {
    use std::io::Write;
    use std::os::unix::process::ExitStatusExt;
    const KEY: &str = "sk-fifo-at-start-VVVV1111wwww2222";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    // Opening the FIFO returns once the proxy opens it to read: it is starting. Signalled
    // then (its pid from `pid`, or from the launcher's file written before the exec), and
    // given the key, or not.
    let feed = |fifo: std::path::PathBuf, pid: Box<dyn FnOnce() -> u32 + Send>, name, key: bool| {
        let (fed_tx, fed) = oneshot::channel();
        std::thread::spawn(move || {
            if let Ok(mut file) = std::fs::OpenOptions::new().write(true).open(&fifo) {
                signal(pid(), name);
                // With the key, closed: the proxy reads to the end. Without, held open
                // until the proxy is gone: at its end the read would end the start.
                if key {
                    let _ = writeln!(file, "{KEY}");
                    drop(file);
                    let _ = fed_tx.send(None);
                } else {
                    let _ = fed_tx.send(Some(file));
                }
            }
        });
        fed
    };

    let dir = tempfile::tempdir().expect("dir");
    let (fifo, pid_file) = (dir.path().join("key"), dir.path().join("pid"));
    mkfifo(&fifo);
    let launcher_pid = pid_file.clone();
    let pid = Box::new(move || {
        let pid = std::fs::read_to_string(launcher_pid).expect("the pid");
        pid.trim().parse().expect("a pid")
    });
    let fed = feed(fifo.clone(), pid, "HUP", true);
    let script = r#"echo $$ > "$0"; exec "$@""#;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .args(&["--sandbox-api-key-file", &fifo.display().to_string()])
        .launcher(&["/bin/sh", "-c", script, &pid_file.display().to_string()])
        .spawn()
        .await;
    drop(within("the key written", fed).await.expect("the feeder"));
    proxy.wait_for_line("reload").await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY}")));
    proxy.finish().await;

    // SIGTERM: SIGINT would do as well, but a test run started in the background (`&` in
    // a script) inherits it ignored, and exec keeps that.
    for (name, number) in [("TERM", 15)] {
        let dir = tempfile::tempdir().expect("dir");
        let fifo = dir.path().join("key");
        mkfifo(&fifo);
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_abx-proxy"))
            .env_clear()
            .env("HOME", dir.path())
            .env("ABX_HOME", dir.path().join("abx"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .args([
                "--sandbox-base-url",
                &upstream.url(),
                "--sandbox-api-key-file",
            ])
            .arg(&fifo)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn abx-proxy");
        let pid = child.id();
        let fed = feed(fifo, Box::new(move || pid), name, false);
        let ended = tokio::time::timeout(GUARD, async {
            let mut every = poll_ticker();
            loop {
                every.tick().await;
                if let Some(status) = child.try_wait().expect("wait") {
                    return status;
                }
            }
        })
        .await;
        let Ok(status) = ended else {
            let _ = child.kill();
            panic!("SIG{name} left the start waiting");
        };
        assert_eq!(status.signal(), Some(number), "SIG{name}: {status}");
        drop(within("the feeder", fed).await);
    }
}

/// A key file replaced by a FIFO (which blocks whoever opens it until a writer comes) is
/// refused by the reload, not opened: the reload held up the runtime that accepts
/// connections, and the proxy no longer answered, nor stopped on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_swapped_for_a_fifo_is_refused_not_waited_on() {
    const KEY: &str = "sk-regular-file-TTTT1111uuuu2222";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let volume = tempfile::tempdir().expect("volume");
    let key_file = volume.path().join("key");
    std::fs::write(&key_file, format!("{KEY}\n")).expect("key");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .args(&["--sandbox-api-key-file", &key_file.display().to_string()])
        .spawn()
        .await;
    let fifo = volume.path().join("key.new");
    mkfifo(&fifo);
    std::fs::rename(&fifo, &key_file).expect("swap the FIFO in");
    proxy.signal("HUP");
    let failed = proxy.wait_for_line("reload failed").await;
    assert!(failed.contains("no longer a regular file"), "{failed}");
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY}")));
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(KEY), "the key in the log:\n{stderr}");
}

/// A rotated key file whose reload fails (here `~/.abx/.env` is broken at that moment; in
/// production, a new AccessKey pair's first exchange meeting a 5xx) is tried again until it
/// applies: it was marked as read, and the key stayed the old one until the next rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_file_that_failed_to_reload_is_tried_again() {
    const KEY1: &str = "sk-mounted-one-NNNN5555oooo6666";
    const KEY2: &str = "sk-mounted-two-PPPP7777qqqq8888";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let volume = tempfile::tempdir().expect("volume");
    let key_file = volume.path().join("key");
    std::fs::write(&key_file, format!("{KEY1}\n")).expect("key");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", "ABX_REGION=cn-hangzhou\n")
        .args(&["--sandbox-api-key-file", &key_file.display().to_string()])
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY1}")));

    let dotenv = proxy.abx_home().join(".env");
    std::fs::write(&dotenv, "ABX_REGION=\"cn-hangzhou\n").expect("break .env");
    std::fs::write(&key_file, format!("{KEY2}\n")).expect("rotate");
    proxy.wait_for_line("a watched file changed").await;
    let failed = proxy.wait_for_line("reload failed").await;
    assert!(failed.contains("E1006"), "{failed}");
    // Said to Prometheus too: the old key keeps serving, and /readyz stays 200.
    let admin = proxy.admin_addr();
    let last = "abx_proxy_last_reload_successful";
    wait_metric(admin, last, "0", |v| v == Some(0.0)).await;
    let failures = r#"abx_proxy_reloads_total{result="failure"}"#;
    assert!(metric(&scrape(admin).await, failures) >= Some(1.0));
    std::fs::write(&dotenv, "ABX_REGION=cn-hangzhou\n").expect("mend .env");
    proxy.wait_for_line("trying its reload again").await;
    let line = proxy.wait_for_line("reloaded").await;
    assert!(line.contains("sandbox_api_key"), "{line}");
    wait_metric(admin, last, "1", |v| v == Some(1.0)).await;
    let successes = r#"abx_proxy_reloads_total{result="success"}"#;
    assert_eq!(metric(&scrape(admin).await, successes), Some(1.0));

    // A bad rotation put back to the key in use: nothing is left failing, and a reload
    // says so (the gauge stayed 0 and the alert fired for nothing).
    std::fs::write(&key_file, format!("{KEY2}\nsecond line\n")).expect("a bad key");
    proxy.wait_for_line("reload failed").await;
    wait_metric(admin, last, "0", |v| v == Some(0.0)).await;
    std::fs::write(&key_file, format!("{KEY2}\n")).expect("put back");
    proxy
        .wait_for_line("back to their last applied contents")
        .await;
    wait_metric(admin, last, "1", |v| v == Some(1.0)).await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY2}")));
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {KEY2}")));
    let stderr = proxy.finish().await;
    for key in [KEY1, KEY2] {
        assert!(!stderr.contains(key), "a key value in the log:\n{stderr}");
    }
}

/// A key rotated in `~/.abx/.env` while the process environment sets one (systemd's
/// `Environment=`): the environment still wins, as SPEC §2 says, and the reload says so
/// instead of a bare "no setting changed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_names_a_rotated_key_the_environment_still_overrides() {
    const ENV_KEY: &str = "sk-from-the-environment-GGGG7777";
    const FILE_KEY: &str = "sk-rotated-in-the-file-HHHH8888";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", Some(ENV_KEY))
        .abx_file(".env", "ABX_SANDBOX_API_KEY=sk-old-file-key-IIII9999\n")
        .spawn()
        .await;
    let line = proxy
        .reload_env(&format!("ABX_SANDBOX_API_KEY={FILE_KEY}\n"), "higher level")
        .await;
    assert!(
        line.contains(&format!(
            "sandbox_api_key in ~/.abx/.env ({}) (env wins)",
            proxy.abx_home().join(".env").display()
        )),
        "names the key, the file and what wins: {line}"
    );
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {ENV_KEY}")));
    // Said once: a reload that finds nothing new says nothing of it again.
    proxy.wait_for_line("reload: no setting changed").await;
    proxy
        .reload_env(
            &format!("ABX_SANDBOX_API_KEY={FILE_KEY}\n"),
            "reload: no setting changed",
        )
        .await;
    let stderr = proxy.finish().await;
    assert_eq!(stderr.matches("higher level").count(), 1, "{stderr}");
    for key in [ENV_KEY, FILE_KEY] {
        assert!(!stderr.contains(key), "a key value in the log:\n{stderr}");
    }
}

/// The rotated key's file is named with its path: a directory whose name holds a newline
/// (and a forged log line after it) is escaped, as every other message escapes it, not
/// written as two lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_keys_file_path_cannot_forge_a_log_line() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let odd = tempfile::tempdir().expect("tempdir");
    let home = odd
        .path()
        .join("abx\n2026-01-01T00:00:00Z  INFO abx_proxy::serve: forged");
    std::fs::create_dir_all(&home).expect("mkdir");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env(
            "ABX_SANDBOX_API_KEY",
            Some("sk-from-the-environment-JJJJ0000"),
        )
        .env("ABX_HOME", Some(home.to_str().expect("utf-8")))
        .spawn()
        .await;
    let rotated = (
        home.join(".env"),
        "ABX_SANDBOX_API_KEY=sk-rotated-KKKK1111\n",
    );
    let line = proxy.reload_files(&[rotated], "higher level").await;
    assert!(
        line.contains(
            "abx\\u{a}2026-01-01T00:00:00Z  INFO abx_proxy::serve: forged/.env) (env wins)"
        ),
        "{line}"
    );
    let stderr = proxy.finish().await;
    assert!(
        !stderr
            .lines()
            .any(|l| l.starts_with("2026-01-01T00:00:00Z")),
        "{stderr}"
    );
}

/// The `Authorization` the upstream saw last.
fn last_bearer(upstream: &Upstream) -> Option<String> {
    upstream
        .seen()
        .last()
        .and_then(|s| s.header("authorization").map(str::to_string))
}

/// The soft and hard open-file limits of a process, from `/proc/<pid>/limits`.
fn nofile(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let limit = |n: usize| match line.split_whitespace().nth(n) {
        Some("unlimited") => u64::MAX,
        word => word
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("limit {n} in {line:?}")),
    };
    (limit(3), limit(4))
}

/// The soft open-file limit every proxy here starts with, as under systemd (1024 there).
const START_SOFT: u64 = 256;

/// systemd starts services with a soft open-file limit of 1024 (and a high hard one): past
/// it every accept fails. The proxy raises the soft limit to what `--max-connections`
/// needs (two descriptors each, plus 256 and four per worker thread), as far as the hard
/// limit allows, and warns when that is not enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_file_limit_is_raised_for_max_connections() {
    // Without privilege prlimit may lower the hard limit the proxy inherits, never raise
    // it, and runners set theirs anywhere from 1024 up.
    // The four descriptors of each of the two workers this proxy runs.
    const WORKERS_OWN: u64 = 2 * 4;
    let (_, hard) = nofile(std::process::id());
    if hard < START_SOFT + WORKERS_OWN + 2 {
        eprintln!(
            "skipped: the hard open-file limit ({hard}) leaves no room above a soft limit \
             of {START_SOFT} to raise it into"
        );
        return;
    }
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;

    let roomy = hard.min(3000);
    let connections = ((roomy - START_SOFT - WORKERS_OWN) / 2).min(1000);
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={START_SOFT}:{roomy}"), "--"])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .args(&["--max-connections", &connections.to_string()])
        .spawn()
        .await;
    assert_eq!(
        nofile(proxy.pid),
        (2 * connections + START_SOFT + WORKERS_OWN, roomy)
    );
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("open-file limit is below"), "{stderr}");

    // The default --max-connections needs 20 264.
    let tight = hard.min(512);
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={START_SOFT}:{tight}"), "--"])
        .spawn()
        .await;
    assert_eq!(
        nofile(proxy.pid).0,
        tight,
        "as far as the hard limit allows"
    );
    let stderr = proxy.finish().await;
    assert!(
        stderr.contains("open-file limit is below what --max-connections needs")
            && stderr.contains("the others wait in the kernel's accept queue"),
        "{stderr}"
    );
    // Short for the upstream connections alone: every client is served, and said so.
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&[
            "prlimit",
            &format!("--nofile={START_SOFT}:{}", hard.min(256)),
            "--",
        ])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .args(&["--max-connections", "50"])
        .spawn()
        .await;
    let stderr = proxy.finish().await;
    assert!(
        stderr.contains("every client connection is served, but upstream connections are held")
            && !stderr.contains("the others wait"),
        "{stderr}"
    );
}

/// Upstream connections are held to the open-file limit's share (the limit less a
/// reserve and one per client connection): an HTTP/2 client's streams may each hold one,
/// and three clients whose 300 streams each held a download took every descriptor of a
/// proxy started for 10 connections (its upstream connects, accepts and scrapes then
/// failed with EMFILE). Now 162 are held; the other streams wait `--connect-timeout` for
/// a slot and get 502 E5001 saying so, while scrapes go on; once the downloads end,
/// requests go through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_held_to_the_open_file_limit() {
    // Room for 10 connections (10 x 2 + 256); under 1 024 a quarter is reserved, at least
    // 96, and 4 for each of the 2 workers, so 276 - 96 - 8 - 10 upstream connections.
    const LIMIT: u64 = 276;
    const SHARE: usize = 162;
    const STREAMS: usize = 300;
    let (_, hard) = nofile(std::process::id());
    if hard < LIMIT {
        eprintln!("skipped: the hard open-file limit ({hard}) is under {LIMIT}");
        return;
    }
    let pki = Pki::new();
    // Every answer holds its body open until the test lets them go.
    let held: Arc<Mutex<Option<Vec<tokio::sync::mpsc::Sender<Bytes>>>>> =
        Arc::new(Mutex::new(Some(Vec::new())));
    let holding = held.clone();
    let upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let holding = holding.clone();
        async move {
            if holding.lock().expect("held").is_none() {
                return response(200, "x");
            }
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let _ = tx.send(Bytes::from_static(b"x")).await;
            if let Some(held) = holding.lock().expect("held").as_mut() {
                held.push(tx);
            }
            hyper::Response::new(boxed(ChannelBody(rx)))
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={LIMIT}:{LIMIT}"), "--"])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        // Room for the 162 TLS handshakes at once of a debug build (both ends) on two busy
        // cores: at 1 s some timed out on a CI run, and 5 s left little to spare under
        // load. The 138 refused streams wait it out together.
        .args(&["--max-connections", "10", "--connect-timeout", "10s"])
        .spawn()
        .await;
    assert_eq!(nofile(proxy.pid).0, LIMIT);
    let addr = proxy.addr();

    let mut clients = Vec::new();
    for _ in 0..3 {
        let (h2, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(
                tokio::net::TcpStream::connect(addr).await.expect("connect"),
            ),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(conn);
        clients.push(h2);
    }
    let streams = (0..STREAMS).map(|i| {
        let mut h2 = clients[i % clients.len()].clone();
        let req = request("GET", addr, "/sandboxes")
            .body(empty())
            .expect("req");
        tokio::spawn(async move { h2.send_request(req).await.expect("an answer") })
    });
    let mut downloads = Vec::new();
    let mut refused = 0;
    for stream in streams.collect::<Vec<_>>() {
        let resp = within("an answer", stream).await.expect("task");
        match resp.status().as_u16() {
            200 => downloads.push(resp),
            502 => {
                assert_eq!(resp.headers()["x-abx-error"], "E5001");
                let body = resp.into_body().collect().await.expect("body").to_bytes();
                let body = String::from_utf8_lossy(&body);
                assert!(
                    body.contains(&format!(
                        "no upstream connection free within 10s: all {SHARE} in use"
                    )),
                    "{body}"
                );
                refused += 1;
            }
            status => panic!("{status}"),
        }
    }
    assert_eq!((downloads.len(), refused), (SHARE, STREAMS - SHARE));
    assert_eq!(upstream.connections(), SHARE);
    let scraped = scrape(proxy.admin_addr()).await;
    let open = metric(&scraped, "abx_proxy_upstream_connections");
    assert_eq!(open, Some(SHARE as f64));
    // The proxy's own saturation, not the upstream's failure.
    let connect = r#"abx_proxy_upstream_errors_total{kind="connect",plane="api"}"#;
    assert_eq!(metric(&scraped, connect), Some(0.0), "{scraped}");

    held.lock().expect("held").take();
    for resp in downloads {
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], b"x");
    }
    drop(clients);
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let stderr = proxy.finish().await;
    assert_eq!(
        stderr
            .matches("every upstream connection slot is in use")
            .count(),
        1,
        "{stderr}"
    );
}

/// A hard open-file limit short of what `--max-connections` needs (a `LimitNOFILE=`, a
/// container's ulimit) holds client connections to half of what the limit less its
/// reserve leaves: 233 keep-alive clients once took every descriptor of a proxy under a
/// limit of 256, and its admin listener could accept nothing (probes and scrapes timed
/// out) for as long as they stayed. Now 76 are served at once, the reserve stays free for
/// the probes, and the others wait in the accept queue until one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_open_file_limit_holds_clients_to_its_share_and_keeps_the_probes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // 256 less its reserve (a quarter, at least 96) and the two workers' own, halved.
    const LIMIT: u64 = 256;
    const SERVED: usize = 76;
    const CLIENTS: usize = 200;
    let (_, hard) = nofile(std::process::id());
    if hard < LIMIT {
        eprintln!("skipped: the hard open-file limit ({hard}) is under {LIMIT}");
        return;
    }
    let pki = Pki::new();
    // Each answer waits for the test: a served client holds its connection and an
    // upstream one.
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (release, released) = watch::channel(false);
    let upstream = Upstream::start(&pki, Proto::Http1, move |_req| {
        let (arrived_tx, mut released) = (arrived_tx.clone(), released.clone());
        async move {
            let _ = arrived_tx.send(());
            let _ = released.wait_for(|r| *r).await;
            response(200, "ok")
        }
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={LIMIT}:{LIMIT}"), "--"])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .spawn()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());

    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!("GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        sock.write_all(head.as_bytes()).await.expect("request");
        clients.push(tokio::spawn(async move {
            let mut answer = [0u8; 12];
            sock.read_exact(&mut answer).await.map(|_| answer)
        }));
    }
    for _ in 0..SERVED {
        within("a served request upstream", arrived.recv()).await;
    }
    let fds = std::fs::read_dir(format!("/proc/{}/fd", proxy.pid))
        .expect("the proxy's descriptors")
        .count() as u64;
    assert!(fds < LIMIT - 32, "{fds} of {LIMIT} descriptors in use");
    assert_eq!(probe(admin).await, 200);
    let scraped = scrape(admin).await;
    let open = metric(&scraped, "abx_proxy_open_connections");
    assert_eq!(open, Some(SERVED as f64), "{scraped}");

    // Once answered, a client hangs up and one that waited is served.
    let _ = release.send(true);
    for client in clients {
        let answer = within("an answer", client).await.expect("task");
        assert_eq!(&answer.expect("an answer")[..], b"HTTP/1.1 200");
    }
    let stderr = proxy.finish().await;
    assert!(
        stderr.contains(&format!("serving {SERVED} connections at once")),
        "{stderr}"
    );
}

/// An open-file limit with no room for one connection beside what the proxy holds at rest
/// (about 21 descriptors with two workers) fails the start with E1008, naming the least
/// it needs. (Under a hard limit of 20 the proxy said it listened and answered nothing.)
/// At that least, a request and a probe are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_file_limit_with_no_room_for_a_connection_fails_the_start() {
    const LEAST: u64 = 24;
    let (_, hard) = nofile(std::process::id());
    if hard < LEAST {
        eprintln!("skipped: the hard open-file limit ({hard}) is under {LEAST}");
        return;
    }
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let short = LEAST - 1;
    let (status, stderr) = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={short}:{short}"), "--"])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("[E1008]"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the open-file limit ({short}) leaves no room for a connection"
        )) && stderr.contains(&format!("raise it to at least {LEAST}")),
        "{stderr}"
    );
    // Not first told what it would serve.
    assert!(!stderr.contains("open-file limit is below"), "{stderr}");

    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &format!("--nofile={LEAST}:{LEAST}"), "--"])
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(probe(proxy.admin_addr()).await, 200);
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("accept failed"), "{stderr}");
}

/// A proxy started with `args`, for tests of its admin listener alone; the upstream and
/// the PKI are returned to live as long as it.
async fn admin_proxy(args: &[&str]) -> (ProxyProc, Upstream, Pki) {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .args(args)
        .spawn()
        .await;
    (proxy, upstream, pki)
}

/// The admin listener, bound beyond loopback in the shipped deployments, holds no
/// connection that sends nothing (or half a head) past `--header-timeout`, and still
/// answers scrapes meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_cuts_connections_that_send_no_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (proxy, _upstream, _pki) = admin_proxy(&["--header-timeout", "1s"]).await;
    let admin = proxy.admin_addr();
    // Well under the 30 s default (and GUARD): an admin listener that ignored the flag
    // would close these connections too, only later, and must fail here.
    let cut_by = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut silent = tokio::net::TcpStream::connect(admin)
        .await
        .expect("connect");
    let mut half = tokio::net::TcpStream::connect(admin)
        .await
        .expect("connect");
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("half a head");
    assert_eq!(get(admin, "/healthz").await.0, 200);
    for (what, s) in [("silent", &mut silent), ("half a head", &mut half)] {
        let mut rest = Vec::new();
        let read = tokio::time::timeout_at(cut_by, s.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("{what}: still open 20 s after connecting"));
        assert!(read.is_ok(), "{what}: {read:?}");
        // hyper may answer a timed-out head with 408 before it closes; never with data.
        let text = String::from_utf8_lossy(&rest);
        assert!(
            rest.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{what}: {text}"
        );
    }
    proxy.finish().await;
}

/// The admin listener's connection limit.
const ADMIN_CONNECTIONS: usize = 64;

/// A probe's wait for its answer: the kubelet's is 1 s; this is only the bound that makes
/// a listener that does not answer fail the test instead of hanging it.
const PROBE_GUARD: Duration = Duration::from_secs(10);

/// `GET /healthz` on a fresh connection, bounded by [`PROBE_GUARD`].
async fn probe(admin: SocketAddr) -> u16 {
    match tokio::time::timeout(PROBE_GUARD, get(admin, "/healthz")).await {
        Ok((status, _)) => status,
        Err(_) => panic!("no answer to a fresh GET /healthz within {PROBE_GUARD:?}"),
    }
}

/// The admin listener serves `GET` and `HEAD` on three paths: another method is 405
/// naming the two in `Allow` (RFC 9110 §15.5.6 requires it), another path 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_refuses_other_methods_with_allow_and_other_paths_with_404() {
    let (proxy, _upstream, _pki) = admin_proxy(&[]).await;
    let admin = proxy.admin_addr();
    for method in ["POST", "OPTIONS", "DELETE"] {
        let req = request(method, admin, "/metrics").body(empty());
        let resp = send(admin, req.expect("request")).await;
        assert_eq!(resp.status(), 405, "{method}");
        let allow = resp
            .headers()
            .get("allow")
            .map(|v| v.to_str().expect("text"));
        let methods: Vec<&str> = allow
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .collect();
        assert_eq!(methods, ["GET", "HEAD"], "{method}: Allow {allow:?}");
    }
    assert_eq!(get(admin, "/nope").await.0, 404);
    assert_eq!(get(admin, "/metrics/").await.0, 404);
    // A head far over any probe's is refused, not buffered (hyper's default took ~400 KiB).
    let mut big = format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\nX-Big: ");
    big.push_str(&"a".repeat(64 * 1024));
    big.push_str("\r\n\r\n");
    assert_eq!(raw_exchange(admin, big.as_bytes()).await.status, 431);
    let mut fair = format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\nX-Fair: ");
    fair.push_str(&"a".repeat(4 * 1024));
    fair.push_str("\r\n\r\n");
    assert_eq!(raw_exchange(admin, fair.as_bytes()).await.status, 200);
    proxy.finish().await;
}

/// 64 clients (the admin listener's limit) that each keep a connection and send
/// `GET /healthz` on it again and again, as an attacker in the cluster could, do not lock
/// the listener: a probe on a fresh connection is answered while they go on. (They used
/// to hold every slot, and the probe waited in the accept queue; in a pod the kubelet
/// restarted the sidecar.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_is_answered_while_64_clients_keep_using_their_admin_connections() {
    let (proxy, _upstream, _pki) = admin_proxy(&[]).await;
    let admin = proxy.admin_addr();
    let (stop, stopped) = watch::channel(false);
    let (holders, first_answers): (Vec<_>, Vec<_>) = (0..ADMIN_CONNECTIONS)
        .map(|_| {
            let stopped = stopped.clone();
            let (answered, first_answer) = oneshot::channel();
            let mut answered = Some(answered);
            let holder = tokio::spawn(async move {
                // Paced and counted: a request every 10 ms each, enough to keep its
                // connection in use.
                let mut every = tokio::time::interval(Duration::from_millis(10));
                let mut left = 5_000u32;
                // A connection the listener closes is replaced: the holder wants one.
                while !*stopped.borrow() && left > 0 {
                    let mut client = connect(admin).await;
                    while !*stopped.borrow() && client.ready().await.is_ok() && left > 0 {
                        every.tick().await;
                        left -= 1;
                        let req = request("GET", admin, "/healthz").body(empty());
                        let Ok(resp) = client.send_request(req.expect("request")).await else {
                            break;
                        };
                        if resp.into_body().collect().await.is_err() {
                            break;
                        }
                        if let Some(answered) = answered.take() {
                            let _ = answered.send(());
                        }
                    }
                }
            });
            (holder, first_answer)
        })
        .unzip();
    // Each holder has had an answer: all 64 have (or had) a connection of their own.
    for first in first_answers {
        let answered = within("a holder's first answer", first).await;
        assert!(answered.is_ok(), "a holder ended");
    }
    let status = tokio::spawn(probe(admin)).await;
    stop.send_replace(true);
    for h in holders {
        within("a holder to stop", h).await.expect("holder");
    }
    assert_eq!(status.expect("probe"), 200);
    proxy.finish().await;
}

/// When its 64 connections are all taken, a new one makes the admin listener close the
/// connection that has waited longest for a request head (as nginx reuses its
/// connections), instead of waiting in the accept queue until one of them times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_admin_listener_closes_its_longest_silent_connection_for_a_probe() {
    let (proxy, _upstream, _pki) = admin_proxy(&["--header-timeout", "300s"]).await;
    let admin = proxy.admin_addr();
    let mut silent = Vec::new();
    for _ in 0..ADMIN_CONNECTIONS {
        let s = within("connect", tokio::net::TcpStream::connect(admin)).await;
        silent.push(s.expect("connect"));
    }
    assert_eq!(probe(admin).await, 200);
    // The first accepted has waited longest.
    expect_closed(&mut silent[0], &[]).await;
    proxy.finish().await;
}

/// 64 connections that each send a run of pipelined `GET /metrics` and never read the
/// answers do not keep a probe out: the admin listener answers one request per connection
/// and closes it. (Kept alive, they held every slot for about twice `--header-timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_scrapes_nobody_reads_do_not_keep_a_probe_out() {
    use tokio::io::AsyncWriteExt;
    let (proxy, _upstream, _pki) = admin_proxy(&[]).await;
    let admin = proxy.admin_addr();
    let scrapes = format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\n\r\n").repeat(100);
    let mut unread = Vec::new();
    for _ in 0..ADMIN_CONNECTIONS {
        let s = within("connect", tokio::net::TcpStream::connect(admin)).await;
        let mut s = s.expect("connect");
        let written = within("pipelined scrapes", s.write_all(scrapes.as_bytes())).await;
        written.expect("pipelined scrapes");
        unread.push(s);
    }
    assert_eq!(probe(admin).await, 200);
    drop(unread);
    proxy.finish().await;
}

/// A request's path and `Authorization` (empty when none), as an upstream records them.
fn path_and_bearer<B>(req: &http::Request<B>) -> (String, String) {
    let bearer = (req.headers().get("authorization"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    (req.uri().path().to_string(), bearer.to_string())
}

/// A temporary key the control plane refuses (401) is replaced before its planned
/// refresh, and a request the proxy holds whole is sent again with the new key, as after
/// envd's 401: one without a body, a rewritten `/v2` create, an envd token look-up. A body
/// streamed from the client is gone once sent: that request gets the 401, the next one the
/// new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_key_the_control_plane_refuses_is_replaced_and_the_request_sent_again() {
    const CREATE: &str = r#"{"templateID":"base"}"#;
    let pki = Pki::new();
    // Bearers the upstream refuses, and what it was sent: path, bearer, body.
    let refused = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = Arc::new(Mutex::new(Vec::<(String, String, Bytes)>::new()));
    let (refusing, seeing) = (refused.clone(), seen.clone());
    let upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let (refusing, seeing) = (refusing.clone(), seeing.clone());
        async move {
            let (path, bearer) = path_and_bearer(&req);
            let body = req.into_body().collect().await.expect("body").to_bytes();
            let refuse = refusing.lock().unwrap().contains(&bearer);
            seeing.lock().unwrap().push((path.clone(), bearer, body));
            match path.as_str() {
                _ if refuse => response(401, r#"{"code":401,"message":"Invalid API key"}"#),
                "/sandboxes/isb-1" => {
                    response(200, r#"{"sandboxID":"isb-1","envdAccessToken":"t"}"#)
                }
                _ => response(200, "ok"),
            }
        }
    })
    .await;
    let successes = r#"abx_proxy_token_exchanges_total{result="success"}"#;
    for case in ["no body", "rewritten", "look-up", "streamed"] {
        let fake = FakeExchange::start(Arc::new(SystemClock)).await;
        let proxy = aksk_proxy(&upstream, &pki, &fake)
            .args(&["--sandbox-url", &upstream.url()])
            .spawn()
            .await;
        let addr = proxy.addr();
        wait_metric_at_least(proxy.admin_addr(), successes, 1.0).await;
        let first = format!("Bearer {}", fake.issued_keys()[0]);
        refused.lock().unwrap().push(first.clone());
        seen.lock().unwrap().clear();
        let req = match case {
            "no body" => request("GET", addr, "/sandboxes").body(empty()),
            "rewritten" => request("POST", addr, "/v2/sandboxes").body(full(CREATE)),
            "look-up" => (request("GET", addr, "/health"))
                .header("e2b-sandbox-id", "isb-1")
                .body(empty()),
            _ => request("POST", addr, "/sandboxes/isb-1/timeout").body(full(r#"{"timeout":60}"#)),
        };
        let status = send(addr, req.expect("request")).await.status().as_u16();
        // Sent again, a request had the new key; one passed the 401 on may be out first.
        wait_metric_at_least(proxy.admin_addr(), successes, 2.0).await;
        let issued = fake.issued_keys();
        assert_eq!(issued.len(), 2, "{case}: one early refresh");
        let second = format!("Bearer {}", issued[1]);
        let sent: Vec<_> = seen.lock().unwrap().drain(..).collect();
        let to = |path: &str, bearer: &str| {
            let bearers = sent.iter().filter(|(p, ..)| p == path).map(|(_, b, _)| b);
            bearers.filter(|b| *b == bearer).count()
        };
        match case {
            "streamed" => {
                assert_eq!(status, 401, "{case}");
                assert_eq!(sent.len(), 1, "{case}: sent once");
                assert_eq!(get(addr, "/sandboxes").await.0, 200, "{case}: the next");
                let next = seen.lock().unwrap().pop().expect("the next request");
                assert_eq!((next.0.as_str(), next.1), ("/sandboxes", second), "{case}");
            }
            "look-up" => {
                assert_eq!(status, 200, "{case}");
                assert_eq!(to("/sandboxes/isb-1", &first), 1, "{case}");
                assert_eq!(to("/sandboxes/isb-1", &second), 1, "{case}");
                assert_eq!(sent.last().map(|s| s.0.as_str()), Some("/health"));
                assert_eq!(sent.len(), 3, "{case}: {sent:?}");
            }
            _ => {
                assert_eq!(status, 200, "{case}");
                assert_eq!(to("/sandboxes", &first), 1, "{case}");
                assert_eq!(to("/sandboxes", &second), 1, "{case}");
                assert_eq!(sent.len(), 2, "{case}");
                // The rewritten body both times, byte for byte.
                assert_eq!(sent[0].2, sent[1].2, "{case}");
                assert_eq!(sent[0].2.is_empty(), case == "no body", "{case}");
            }
        }
        let stderr = proxy.finish().await;
        assert!(stderr.contains("refused the temporary key"), "{stderr}");
        assert_no_aksk_secret(&stderr, &issued, "the log");
    }
}

/// Volume content (`/volumecontent/…`) carries the client's own token, not the key: its
/// 401 is the volume token's, passed to the client, and says nothing of the temporary key
/// (no early exchange, no request sent again with a new key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_contents_401_is_not_the_temporary_keys() {
    let pki = Pki::new();
    let bearers = Arc::new(Mutex::new(Vec::<(String, String)>::new()));
    let seeing = bearers.clone();
    let upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let seeing = seeing.clone();
        async move {
            let (path, bearer) = path_and_bearer(&req);
            seeing.lock().unwrap().push((path.clone(), bearer));
            match path.starts_with("/volumecontent/") {
                true => response(401, r#"{"code":401,"message":"invalid volume token"}"#),
                false => response(200, "ok"),
            }
        }
    })
    .await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    let proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let addr = proxy.addr();
    let successes = r#"abx_proxy_token_exchanges_total{result="success"}"#;
    wait_metric_at_least(proxy.admin_addr(), successes, 1.0).await;
    let req = request("GET", addr, "/volumecontent/vol-1/file?path=%2Fa")
        .header("authorization", "Bearer expired-volume-token")
        .body(empty())
        .expect("request");
    assert_eq!(send(addr, req).await.status().as_u16(), 401);
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let issued = fake.issued_keys();
    let first = format!("Bearer {}", issued[0]);
    assert_eq!(
        *bearers.lock().unwrap(),
        vec![
            (
                "/volumecontent/vol-1/file".to_string(),
                "Bearer expired-volume-token".to_string()
            ),
            ("/sandboxes".to_string(), first),
        ],
        "sent once, with its own token; the key after it is the same"
    );
    let stderr = proxy.finish().await;
    // Said, in the request's own task, before its answer, had the 401 been the key's.
    assert!(!stderr.contains("refused the temporary key"), "{stderr}");
    assert_eq!(fake.issued_keys().len(), 1, "no early exchange");
    assert_no_aksk_secret(&stderr, &issued, "the log");
}

/// A static key the control plane refuses is the operator's to mend, and the SDK user, who
/// holds a dummy key, is told by the SDK to check theirs: the proxy's log says E1009 with
/// its suggestion, once a minute for a key however many requests get the refusal, which
/// goes to the client unchanged; a token look-up's 403 too. A key a reload brings in,
/// refused as well, is said at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_key_the_control_plane_refuses_is_said_in_the_log() {
    const FIRST: &str = "sk-refused-one-AAAA1111bbbb2222";
    const SECOND: &str = "sk-refused-two-CCCC3333dddd4444";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match req.uri().path() {
            "/refuse" => response(401, r#"{"code":401,"message":"Invalid API key"}"#),
            "/sandboxes/isb-1" => response(403, r#"{"code":403,"message":"Forbidden"}"#),
            _ => response(200, ""),
        }
    })
    .await;
    let mut proxy = key_in_env_file(&upstream, &pki, FIRST)
        .args(&["--sandbox-url", &upstream.url()])
        .spawn()
        .await;
    let addr = proxy.addr();
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let look_up = request("GET", addr, "/health")
        .header("e2b-sandbox-id", "isb-1")
        .body(empty())
        .expect("request");
    assert_eq!(
        send(addr, look_up).await.status(),
        http::StatusCode::SERVICE_UNAVAILABLE
    );
    for _ in 0..3 {
        assert_eq!(get(addr, "/refuse").await.0, 401);
    }
    let home_env = proxy.abx_home().join(".env");
    let env = format!("ABX_SANDBOX_API_KEY={SECOND}\n");
    proxy.reload_files(&[(home_env, &env)], "reloaded").await;
    for _ in 0..2 {
        assert_eq!(get(addr, "/refuse").await.0, 401);
    }
    let stderr = proxy.finish().await;
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("refused the configured API key"))
        .collect();
    assert_eq!(said.len(), 2, "{stderr}");
    for (line, status) in said.iter().zip(["403", "401"]) {
        assert!(line.contains("WARN") && line.contains("[E1009]"), "{line}");
        assert!(line.contains(&format!("{status} from")), "{line}");
        assert!(line.contains("check the provider's key"), "{line}");
    }
    for key in [FIRST, SECOND] {
        assert!(!stderr.contains(key), "a key in the log");
    }
}

/// A run of refusals ends when the control plane answers the key in use with anything but
/// a 401 or a 5xx, whether to a proxied request or to an envd token look-up: the log says
/// so (and the refusals after it back off from 30 s again, as the exchange tests show).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_to_the_key_in_use_ends_a_run_of_refusals() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match req.uri().path() {
            "/refuse" => response(401, ""),
            "/sandboxes/isb-1" => response(200, r#"{"sandboxID":"isb-1","envdAccessToken":"t"}"#),
            _ => response(200, ""),
        }
    })
    .await;
    let envd_request = |addr| {
        request("GET", addr, "/health")
            .header("e2b-sandbox-id", "isb-1")
            .body(empty())
            .expect("request")
    };
    // First the envd request's token look-up, then a proxied request, each the first answer
    // but a 401 to the key that replaced a refused one (`/refuse`, sent again with it, is
    // refused again: within the gap, that asks for nothing).
    for look_up in [true, false] {
        let fake = FakeExchange::start(Arc::new(SystemClock)).await;
        let proxy = aksk_proxy(&upstream, &pki, &fake)
            .args(&["--sandbox-url", &upstream.url()])
            .spawn()
            .await;
        let addr = proxy.addr();
        assert_eq!(get(addr, "/refuse").await.0, 401);
        let successes = r#"abx_proxy_token_exchanges_total{result="success"}"#;
        wait_metric_at_least(proxy.admin_addr(), successes, 2.0).await;
        let (status, path) = if look_up {
            let status = send(addr, envd_request(addr)).await.status().as_u16();
            (status, "/health")
        } else {
            (get(addr, "/sandboxes").await.0, "/sandboxes")
        };
        assert_eq!(status, 200, "look-up: {look_up}");
        let issued = fake.issued_keys();
        let last = upstream.seen().pop().expect("a request");
        assert_eq!(last.path_and_query(), path);
        let stderr = proxy.finish().await;
        let accepted = "the control plane accepted the temporary key";
        assert_eq!(
            stderr.matches(accepted).count(),
            1,
            "look-up: {look_up}: {stderr}"
        );
        assert_no_aksk_secret(&stderr, &issued, "the log");
    }
    let looked_up = upstream
        .seen()
        .into_iter()
        .filter(|s| s.path_and_query() == "/sandboxes/isb-1")
        .count();
    assert_eq!(looked_up, 1);
}

/// A setting that waits for a restart, changed and changed back: the running process has
/// it as the files now say, so the second reload says nothing of a restart (it said
/// "these settings apply at the next restart" again, measured from the first reload). Nor
/// does one that a file sets to the value the process runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_setting_changed_back_is_not_said_to_wait_for_a_restart() {
    const KEY: &str = "sk-restart-test-JJJJ1111kkkk2222";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let key = format!("ABX_SANDBOX_API_KEY={KEY}\n");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", &key)
        .spawn()
        .await;
    let default = format!("{key}ABX_TOKEN_TTL=3600\n");
    let line = proxy.reload_env(&default, "reloaded").await;
    assert!(line.contains("token_ttl"), "names what changed: {line}");
    // Its lines are all out once the next reload's are.
    proxy.reload_env(&default, "no setting changed").await;
    let said = |stderr: &str| {
        (stderr.lines())
            .filter(|l| l.contains("apply at the next restart"))
            .count()
    };
    assert_eq!(said(&proxy.stderr()), 0, "{}", proxy.stderr());
    let ttl = format!("{key}ABX_TOKEN_TTL=600\n");
    let line = proxy.reload_env(&ttl, "apply at the next restart").await;
    assert!(line.contains("token_ttl"), "{line}");
    let line = proxy.reload_env(&key, "reloaded").await;
    assert!(line.contains("token_ttl"), "names what changed: {line}");
    proxy.reload_env(&key, "no setting changed").await;
    let stderr = proxy.finish().await;
    assert_eq!(said(&stderr), 1, "{stderr}");
}

/// A `./.env` key removed lets `~/.abx/.env`'s through (SPEC §2's order, as a release
/// directory deleted under a service does): the `reloaded` line says where the key now
/// comes from, where `changed=sandbox_api_key` alone put a forgotten key in service unsaid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_takes_the_key_from_a_lower_layer_says_which() {
    const HERE: &str = "sk-fall-here-LLLL1111mmmm2222";
    const HOME: &str = "sk-fall-home-NNNN3333oooo4444";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", &format!("ABX_SANDBOX_API_KEY={HOME}\n"))
        .cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={HERE}\n"))
        .spawn()
        .await;
    std::fs::remove_file(proxy.cwd().join(".env")).expect("remove ./.env");
    proxy.signal("HUP");
    let line = proxy.wait_for_line("reloaded").await;
    assert!(line.contains("changed=sandbox_api_key"), "{line}");
    let home = proxy.abx_home().join(".env");
    let from = format!("credential=api_key from ~/.abx/.env ({})", home.display());
    assert!(line.contains(&from), "{line}");
    proxy.finish().await;
}

/// A reload's candidate pair whose exchange fails is a failed reload, not a failing
/// exchange of the running credential: under a static key (expiry 0) its failures, retried
/// by the watch, paged `AbxProxyTokenMissing` ("every request is answered 503") while
/// every request was served. Once a pair is applied its exchanges count, the trial's too.
/// The pair's client uses the trust store built at the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_trial_exchange_is_a_failed_reload_not_a_failing_exchange() {
    const STATIC_KEY: &str = "sk-trial-static-GGGG7777hhhh8888";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_API_KEY", None)
        .abx_file(".env", &format!("ABX_SANDBOX_API_KEY={STATIC_KEY}\n"))
        .args(&["--token-exchange-url", &fake.url])
        .spawn()
        .await;
    let admin = proxy.admin_addr();
    fake.set_mode(Mode::Fail500);
    proxy.reload_env(&dotenv_pair(), "reload failed").await;
    assert_eq!(fake.calls(), 1, "the trial asked once");
    let text = scrape(admin).await;
    let exchanges = |text: &str, result| {
        series(
            text,
            "abx_proxy_token_exchanges_total",
            &[("result", result)],
        )
    };
    assert_eq!(exchanges(&text, "failure"), Some(0.0), "{text}");
    assert_eq!(
        series(&text, "abx_proxy_reloads_total", &[("result", "failure")]),
        Some(1.0),
        "{text}"
    );
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);

    // The pair's exchange client takes the trust store built at the start: the reload
    // read `--upstream-ca` (and the system's certificates) again, on the thread that
    // answers the probes; gone now, it would fail the reload.
    std::fs::remove_file(&pki.ca_pem).expect("remove the CA file");
    fake.set_mode(Mode::Ok);
    proxy.reload_env(&dotenv_pair(), "reloaded").await;
    let text = scrape(admin).await;
    assert_eq!(exchanges(&text, "success"), Some(1.0), "{text}");
    assert_eq!(exchanges(&text, "failure"), Some(0.0), "{text}");
    assert!(
        series(&text, "abx_proxy_token_expiry_timestamp_seconds", &[]).unwrap_or(0.0) > 1.7e9,
        "{text}"
    );
    proxy.finish().await;
}

/// A `listen` a `.env` moves beyond loopback, with no TLS and no `--allow-remote`, fails
/// the reload with E1007, as `check` and the next start refuse it: the reload said it
/// would apply at the restart, which then exited 78. One the start would take passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_refuses_a_listen_address_the_next_start_would_refuse() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .omit(&["--listen"])
        .abx_file(".env", "ABX_PROXY_LISTEN=127.0.0.1:0\n")
        .spawn()
        .await;
    let line = proxy
        .reload_env("ABX_PROXY_LISTEN=0.0.0.0:0\n", "reload failed")
        .await;
    assert!(
        line.contains("[E1007]") && line.contains("0.0.0.0:0"),
        "{line}"
    );
    let line = proxy
        .reload_env(
            "ABX_PROXY_LISTEN=127.0.0.2:0\n",
            "apply at the next restart",
        )
        .await;
    assert!(line.contains("listen"), "{line}");
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    proxy.finish().await;
}

/// A reload moving a TLS listener beyond loopback, without `--allow-remote`, applies at the
/// next restart (SPEC §7 lets TLS stand in for the consent) and says the start's warning
/// first: TLS checks no client, and the next start says it only to a log nobody reads then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moving_a_tls_listener_beyond_loopback_warns_as_the_start_would() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .omit(&["--listen"])
        .tls_listener(&pki)
        .abx_file(".env", "ABX_PROXY_LISTEN=127.0.0.1:0\n")
        .spawn()
        .await;
    let warning = "beyond this machine, with TLS";
    assert!(!proxy.stderr().contains(warning), "{}", proxy.stderr());
    let line = proxy
        .reload_env("ABX_PROXY_LISTEN=0.0.0.0:0\n", "apply at the next restart")
        .await;
    assert!(line.contains("listen"), "{line}");
    let stderr = proxy.stderr();
    let said = (stderr.lines()).position(|l| l.contains(warning) && l.contains("--allow-remote"));
    let applied = stderr
        .lines()
        .position(|l| l.contains("apply at the next restart"));
    assert!(
        matches!((said, applied), (Some(s), Some(a)) if s < a),
        "{stderr}"
    );
    // Said once: a reload that leaves it there (a key rotated) says nothing of it again.
    proxy
        .reload_env(
            "ABX_PROXY_LISTEN=0.0.0.0:0\n# rotated\n",
            "no setting changed",
        )
        .await;
    let stderr = proxy.stderr();
    assert_eq!(stderr.matches(warning).count(), 1, "{stderr}");
    proxy.finish().await;
}

/// A request refused with a temporary key after a reload replaced the credential (here
/// the pair by an API key) is sent again with the new credential's key, and so is an envd
/// token look-up: the retired pair has no refresh coming, and such a request waited 10 s
/// for none, then got the 401 (the look-up's envd request, 503 E1009).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_across_a_reload_is_sent_again_with_the_new_credential() {
    const STATIC_KEY: &str = "sk-reload-static-EEEE5555ffff6666";
    let pki = Pki::new();
    // The refused bearer, and the channel its request is held on until the test lets the
    // 401 go: first word that it arrived, then the go-ahead.
    let refused = Arc::new(Mutex::new(String::new()));
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel::<()>();
    let release = Arc::new(tokio::sync::Notify::new());
    let (refusing, freed) = (refused.clone(), release.clone());
    let upstream = Upstream::start(&pki, Proto::Http1, move |req| {
        let bearer = (req.headers().get("authorization"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let held = *refusing.lock().unwrap() == bearer;
        let (arrived, freed) = (arrived_tx.clone(), freed.clone());
        let path = req.uri().path().to_string();
        async move {
            if held {
                let _ = arrived.send(());
                freed.notified().await;
                return response(401, r#"{"code":401,"message":"Invalid API key"}"#);
            }
            match path.as_str() {
                "/sandboxes/isb-1" => {
                    response(200, r#"{"sandboxID":"isb-1","envdAccessToken":"t"}"#)
                }
                _ => response(200, "ok"),
            }
        }
    })
    .await;
    let successes = r#"abx_proxy_token_exchanges_total{result="success"}"#;
    for look_up in [false, true] {
        let fake = FakeExchange::start(Arc::new(SystemClock)).await;
        let mut proxy = aksk_proxy_from_dotenv(&upstream, &pki, &fake)
            .args(&["--sandbox-url", &upstream.url()])
            .spawn()
            .await;
        let addr = proxy.addr();
        wait_metric_at_least(proxy.admin_addr(), successes, 1.0).await;
        *refused.lock().unwrap() = format!("Bearer {}", fake.issued_keys()[0]);
        let req = match look_up {
            false => request("GET", addr, "/sandboxes"),
            true => request("GET", addr, "/health").header("e2b-sandbox-id", "isb-1"),
        };
        let sent = tokio::spawn(send(addr, req.body(empty()).expect("request")));
        within("the refused request upstream", arrived.recv()).await;
        proxy
            .reload_env(&format!("ABX_SANDBOX_API_KEY={STATIC_KEY}\n"), "reloaded")
            .await;
        release.notify_one();
        let status = within("the answer", sent).await.expect("the request task");
        assert_eq!(status.status(), 200, "look-up: {look_up}");
        let seen = upstream.seen();
        let bearers: Vec<_> = seen
            .iter()
            .rev()
            .map(|s| s.header("authorization"))
            .collect();
        let want = format!("Bearer {STATIC_KEY}");
        let want = match look_up {
            false => vec![Some(want.as_str())],
            // The look-up again, then envd's request (its default user's Basic).
            true => vec![Some("Basic dXNlcjo="), Some(want.as_str())],
        };
        assert_eq!(bearers[..want.len()], want, "look-up: {look_up}");
        assert_eq!(
            fake.calls(),
            1,
            "look-up: {look_up}: no exchange for the retired pair"
        );
        let stderr = proxy.finish().await;
        assert_no_aksk_secret(&stderr, &fake.issued_keys(), "the log");
    }
}

/// SPEC §5 and §7: a reload swaps the credential only when it changed, and a new AK/SK
/// pair only once it has a key of its own; until then the running temporary key serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_keeps_a_working_temporary_key_until_a_new_pair_has_one() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    // envd's host set in the working directory: the pair from ~/.abx/.env goes there, as
    // the start warns, once: a reload that applies finds it said, and one that fails
    // says nothing of where the key goes.
    let mut proxy = aksk_proxy_from_dotenv(&upstream, &pki, &fake)
        .cwd_dotenv("ABX_SANDBOX_URL=https://envd.invalid\n")
        .spawn()
        .await;
    let goes_there = |proxy: &ProxyProc| proxy.stderr().matches("goes there").count();
    assert_eq!(goes_there(&proxy), 1, "{}", proxy.stderr());
    // The start says which credential it took, and from where.
    let started = proxy.stderr();
    let listening = started.lines().find(|l| l.contains("abx-proxy listening"));
    let listening = listening.unwrap_or_else(|| panic!("{started}"));
    let said = " credential=access_key from ~/.abx/.env (";
    assert!(listening.contains(said), "{listening}");
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let first = fake.issued_keys();
    assert_eq!(first.len(), 1);
    let bearer = Some(format!("Bearer {}", first[0]));
    assert_eq!(last_bearer(&upstream), bearer);

    // Only a setting that waits for a restart changed: no new exchange.
    let ttl = format!("{}ABX_TOKEN_TTL=600\n", dotenv_pair());
    let line = proxy.reload_env(&ttl, "apply at the next restart").await;
    assert!(line.contains("token_ttl"), "{line}");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    assert_eq!(
        fake.calls(),
        1,
        "a reload that kept the pair exchanged again"
    );
    assert_eq!(last_bearer(&upstream), bearer);
    assert_eq!(goes_there(&proxy), 1, "said again, though nothing new");

    // A new pair the endpoint refuses: the running key keeps serving.
    let refused_pair = format!(
        "ALICLOUD_ACCESS_KEY_ID={ACCESS_KEY_ID}\nALICLOUD_ACCESS_KEY_SECRET=wrong-secret-0000\n"
    );
    proxy
        .reload_env(
            &refused_pair,
            "reload failed: the new credential's first token exchange failed; keeping the \
             running credential",
        )
        .await;
    assert_eq!(fake.rejected(), 1);
    // The candidate's failure is said as the new credential's, with no retry promised:
    // it is dropped, and the running key has not failed.
    let said = proxy.stderr();
    assert!(
        said.contains("token exchange failed for the reload's new credential"),
        "{said}"
    );
    assert!(!said.contains("retry_in_ms"), "{said}");
    assert_eq!(
        goes_there(&proxy),
        1,
        "the failed swap said where its pair goes"
    );
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), bearer);
    assert_eq!(get(admin, "/readyz").await.0, 200);
    let expiry = "abx_proxy_token_expiry_timestamp_seconds";
    assert!(series(&scrape(admin).await, expiry, &[]) > Some(0.0));

    // The exchange's signing style, the pair kept: the running refresher goes on as it
    // started, and the style waits for a restart as other settings do.
    let restyled = format!("{}ABX_TOKEN_EXCHANGE=acs3\n", dotenv_pair());
    let line = proxy
        .reload_env(&restyled, "these settings apply at the next restart")
        .await;
    assert!(line.contains("token_exchange"), "{line}");
    assert_eq!(fake.calls(), 2, "a reload that kept the pair exchanged");
    // With a new pair it would be how that pair goes out: refused as the hosts' change is,
    // and said so (it read "the provider or its hosts changed").
    let restyled_new = "ALICLOUD_ACCESS_KEY_ID=LTAI-other-pair\n\
                        ALICLOUD_ACCESS_KEY_SECRET=other-secret\nABX_TOKEN_EXCHANGE=acs3\n";
    let line = proxy.reload_env(restyled_new, "reload refused").await;
    assert!(
        line.contains("key exchange changed") && line.contains("token_exchange"),
        "{line}"
    );
    assert_eq!(fake.calls(), 2, "a refused reload exchanged");

    const STATIC_KEY: &str = "sk-reload-static-CCCC3333dddd4444";
    // An API key instead of the pair: no temporary key is in use any more, and the expiry
    // gauge says so (left at the old key's expiry, it would set off the expiry alert).
    let line = proxy
        .reload_env(&format!("ABX_SANDBOX_API_KEY={STATIC_KEY}\n"), "reloaded")
        .await;
    assert!(line.contains("sandbox_api_key"), "{line}");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {STATIC_KEY}")));
    assert_eq!(series(&scrape(admin).await, expiry, &[]), Some(0.0));

    // Back to the pair: a temporary key of its own serves, and the gauge shows its expiry
    // again (set from the running key at the swap, after the exchange that reported it).
    proxy.reload_env(&dotenv_pair(), "reloaded").await;
    let issued = fake.issued_keys();
    assert_eq!(issued.len(), 2, "{issued:?}");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    assert_eq!(
        last_bearer(&upstream),
        Some(format!("Bearer {}", issued[1]))
    );
    assert!(series(&scrape(admin).await, expiry, &[]) > Some(1.7e9));
    let stderr = proxy.finish().await;
    assert_no_aksk_secret(&stderr, &issued, "the log");
    assert!(!stderr.contains(STATIC_KEY), "a key in the log");
    assert!(!stderr.contains("wrong-secret-0000"), "a secret in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line_without_query_strings() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    // A secret in config.toml is ignored with a warning: that line is JSON too.
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_URL", Some(&upstream.url()))
        .args(&["--log-format", "json"])
        .abx_file("config.toml", "sandbox_api_key = \"sk-in-toml-0000\"\n")
        .spawn()
        .await;
    assert_eq!(get_signed(proxy.addr(), "SIGNEDURLSECRET").await, 200);
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("SIGNEDURLSECRET"), "query string logged");
    assert!(!stderr.contains("sk-in-toml-0000"), "a secret logged");
    let (mut request_lines, mut warnings) = (0, 0);
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v.get("level").is_some() && v.get("timestamp").is_some(),
            "{line}"
        );
        if v["level"] == "WARN"
            && v["message"]
                .as_str()
                .is_some_and(|m| m.contains("config.toml"))
        {
            warnings += 1;
        }
        if v.get("method").is_some() {
            request_lines += 1;
            assert_eq!(v["level"], "INFO", "{line}");
            assert_eq!(v["method"], "GET");
            assert_eq!(v["path"], "/files");
            assert_eq!(v["plane"], "envd");
            assert_eq!(v["status"], 200);
            assert!(v["duration_ms"].as_f64().is_some(), "{line}");
            // The port too: two local upstreams on one address are told apart.
            assert_eq!(v["upstream"], upstream.addr.to_string());
        }
    }
    assert_eq!(request_lines, 1, "one line per request:\n{stderr}");
    assert_eq!(warnings, 1, "the config.toml warning:\n{stderr}");
}

/// In the default text format (SPEC §7) a request's line names `path=/files` and never
/// the query string, where signed file URLs carry their signature; nothing else at
/// `trace` (dependencies included) prints it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_name_the_path_never_the_query_string() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("ABX_SANDBOX_URL", Some(&upstream.url()))
        .log_level("trace")
        .spawn()
        .await;
    assert_eq!(get_signed(proxy.addr(), "SECRET123").await, 200);
    let stderr = proxy.finish().await;
    assert!(
        !stderr.contains("SECRET123") && !stderr.contains("signature="),
        "query string logged:\n{stderr}"
    );
    let line = stderr
        .lines()
        .find(|l| l.contains("method=GET"))
        .unwrap_or_else(|| panic!("no request line:\n{stderr}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    let upstream_field = format!("upstream={}", upstream.addr);
    for field in [
        "path=/files",
        "plane=\"envd\"",
        "status=200",
        &upstream_field,
    ] {
        assert!(fields.contains(&field), "{field} in {line}");
    }
}

/// A target may carry raw UTF-8 (hyper and httparse accept it): its access line gives the
/// path percent-encoded, so that U+2028 / U+0085 cannot split the line for a Unicode-aware
/// reader nor U+202E turn its display around. In both formats. So are the `"` and `\`
/// httparse takes, and `=`: bare in a text line they make a logfmt reader refuse it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_lines_percent_encode_raw_utf8_in_paths() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    for json in [false, true] {
        let mut cmd = ProxyCmd::new(&upstream.url(), &pki);
        if json {
            cmd = cmd.args(&["--log-format", "json"]);
        }
        let proxy = cmd.spawn().await;
        let addr = proxy.addr();
        let mut raw =
            b"GET /u/\xc3\xa9/\xe2\x80\xa8/\xe2\x80\xae/\xc2\x85/x\"status=200\\ HTTP/1.1\r\nHost: "
                .to_vec();
        raw.extend_from_slice(format!("{addr}\r\n\r\n").as_bytes());
        assert_eq!(raw_exchange(addr, &raw).await.status, 200);
        let stderr = proxy.finish().await;
        let line = stderr
            .lines()
            .find(|l| l.contains("/u/"))
            .unwrap_or_else(|| panic!("no access line:\n{stderr}"));
        assert!(
            line.contains("/u/%C3%A9/%E2%80%A8/%E2%80%AE/%C2%85/x%22status%3D200%5C"),
            "json {json}: {line}"
        );
        assert!(line.is_ascii(), "json {json}: {line}");
    }
}

/// `RUST_LOG` applies when `--log-level` is not given (SPEC §7): `RUST_LOG=debug` shows
/// the DEBUG lines the default (`info`) would not. A `--log-level` that is given wins
/// over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_applies_when_log_level_is_not_given() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let with_rust_log = |cmd: ProxyCmd| cmd.env("RUST_LOG", Some("debug")).spawn();
    let env_only = with_rust_log(ProxyCmd::new(&upstream.url(), &pki).omit(&["--log-level"])).await;
    let flag_too = with_rust_log(ProxyCmd::new(&upstream.url(), &pki).log_level("info")).await;
    for proxy in [&env_only, &flag_too] {
        assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    }
    let debug_lines = |stderr: &str| stderr.lines().filter(|l| l.contains(" DEBUG ")).count();

    let stderr = env_only.finish().await;
    assert!(
        debug_lines(&stderr) > 0,
        "RUST_LOG=debug ignored:\n{stderr}"
    );
    assert!(stderr.contains("path=/sandboxes"), "{stderr}");
    let stderr = flag_too.finish().await;
    assert_eq!(
        debug_lines(&stderr),
        0,
        "--log-level info lost to RUST_LOG:\n{stderr}"
    );
    assert!(stderr.contains("path=/sandboxes"), "{stderr}");

    // Blank is unset (a `RUST_LOG=${RUST_LOG}` in a manifest), and a filter that does not
    // parse, or names no level and no module (`warning`: tracing's filter for a module of
    // that name logged nothing at all), is said so: either way the default level, access
    // lines included.
    for (value, warned) in [
        ("", false),
        ("warn,abx_proxy=verbose", true),
        ("warning", true),
    ] {
        let proxy = ProxyCmd::new(&upstream.url(), &pki)
            .omit(&["--log-level"])
            .env("RUST_LOG", Some(value))
            .spawn()
            .await;
        assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
        let stderr = proxy.finish().await;
        assert!(stderr.contains("path=/sandboxes"), "{value:?}:\n{stderr}");
        // A log line, as the proxy's others are.
        let said = (stderr.lines()).any(|l| {
            l.contains(" WARN abx_proxy::logging: RUST_LOG is not a filter") && l.starts_with("20")
        });
        assert_eq!(said, warned, "{value:?}:\n{stderr}");
    }
}

/// A blank `--log-level` is skipped like any blank flag (SPEC §2): the default level
/// applies, or `RUST_LOG`. (`--log-level ""` was an empty filter that let almost nothing
/// through, the listening line and the access lines included; `" "` was refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blank_log_level_is_skipped_like_any_blank_flag() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    for blank in ["", " "] {
        for rust_log in [None, Some("debug")] {
            let case = format!("--log-level {blank:?}, RUST_LOG {rust_log:?}");
            // Waits for the listening line.
            let proxy = ProxyCmd::new(&upstream.url(), &pki)
                .log_level(blank)
                .env("RUST_LOG", rust_log)
                .spawn()
                .await;
            assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
            let stderr = proxy.finish().await;
            let listening = stderr.lines().find(|l| l.contains("abx-proxy listening"));
            assert!(
                listening.is_some_and(|l| l.contains(" INFO ")),
                "{case}:\n{stderr}"
            );
            assert!(stderr.contains("path=/sandboxes"), "{case}:\n{stderr}");
            let debug = stderr.contains(" DEBUG ");
            assert_eq!(debug, rust_log.is_some(), "{case}:\n{stderr}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_upstream_certificate_is_a_tls_error() {
    // The upstream's certificate is from a CA the proxy was not given.
    let (trusted, other) = (Pki::new(), Pki::new());
    let upstream = Upstream::start(&other, Proto::Http1, |_r| async { response(200, "no") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &trusted).spawn().await;
    let resp = raw_exchange(
        proxy.addr(),
        format!("GET /sandboxes HTTP/1.1\r\nHost: {}\r\n\r\n", proxy.addr()).as_bytes(),
    )
    .await;
    assert_proxy_error(&resp, 502, "E5001");
    // In words, as curl says it, not rustls's variant names (`UnknownIssuer`, or
    // `BadSignature`: the two test CAs have the same name, so the other's is found as the
    // issuer and its signature fails).
    let words = [
        "tls: invalid peer certificate: signed by an unknown authority",
        "tls: invalid peer certificate: its signature does not verify",
    ];
    assert!(
        words.iter().any(|w| resp.text().contains(w)),
        "{}",
        resp.text()
    );
    let text = scrape(proxy.admin_addr()).await;
    assert_eq!(
        series(
            &text,
            "abx_proxy_upstream_errors_total",
            &[("plane", "api"), ("kind", "tls")]
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        upstream.seen().is_empty(),
        "no request over an untrusted connection"
    );
    proxy.finish().await;
}

/// A forward proxy in the environment (`HTTPS_PROXY`, as curl reads it) is not used: the
/// start says so, naming the variable and never its value (it may carry a password), and
/// requests go straight to the upstream. Behind a firewall that lets out only the forward
/// proxy, connects time out with nothing else to say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_proxy_in_the_environment_is_said_to_be_unused() {
    let pki = Pki::new();
    let upstream =
        Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "direct") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .env("HTTPS_PROXY", Some("http://user:pw-zq81@127.0.0.1:9"))
        .env("http_proxy", Some(""))
        .spawn()
        .await;
    let (status, body) = get(proxy.addr(), "/sandboxes").await;
    assert_eq!((status, &body[..]), (200, &b"direct"[..]));
    let stderr = proxy.finish().await;
    assert_eq!(
        stderr.matches("HTTPS_PROXY is set, and not used").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("pw-zq81"), "{stderr}");
    assert!(
        !stderr.contains("http_proxy"),
        "an empty one is not set: {stderr}"
    );
}

/// Runs as root with `setpriv` (util-linux): `RLIMIT_NPROC` holds a process to a number
/// of tasks by real uid, and root is exempt. The proxy and the fillers below run with a real
/// uid of their own and without the capabilities that lift the limit; their effective uid
/// stays root, so that they read the test's files.
fn thread_limited(uid: u32, limit: usize) -> Vec<String> {
    [
        "prlimit".to_string(),
        format!("--nproc={limit}"),
        "--".into(),
        "setpriv".into(),
        format!("--ruid={uid}"),
        "--bounding-set=-sys_resource,-sys_admin".into(),
    ]
    .into()
}

/// Whether this test process may give its children `uid` as their real one (root, with
/// `setpriv`, and the uid mapped: not in a user namespace that maps root alone).
fn may_limit_threads(uid: u32) -> bool {
    let launcher = thread_limited(uid, 64);
    Command::new(&launcher[0])
        .args(&launcher[1..])
        .arg("true")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A process that takes one of `uid`'s tasks, if one is left: `None` once none is (the
/// filler's exec is refused, and it ends without a word).
async fn filler(uid: u32, limit: usize) -> Option<Spawned> {
    use std::io::BufRead as _;
    let launcher = thread_limited(uid, limit);
    let mut cmd = Command::new(&launcher[0]);
    cmd.args(&launcher[1..])
        .args(["sh", "-c", "echo up; exec sleep 120"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut spawned = Spawned::spawn(&mut cmd, "a filler");
    let stdout = spawned.take_stdout();
    let read = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        line
    });
    let line = within("a filler's first line", read).await.expect("join");
    (line == "up\n").then_some(spawned)
}

/// At the process's thread limit (`TasksMax`, a pids cgroup), reached after the start: a
/// reload reads on the thread started with the proxy. One asked of tokio's blocking pool
/// for each read could not start: the reload failed, and the pool's panic printed a
/// plain-text block among the log lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_at_its_thread_limit_still_reloads() {
    const LIMIT: usize = 24;
    let uid = 3_000_000 + std::process::id();
    if !may_limit_threads(uid) {
        eprintln!("skipped: needs root and setpriv to set a thread limit");
        return;
    }
    let launcher = thread_limited(uid, LIMIT);
    let launcher: Vec<&str> = launcher.iter().map(String::as_str).collect();
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    // Two workers whatever the cores: one each would not fit the limit on 21 of them.
    let mut proxy = key_in_env_file(&upstream, &pki, "sk-limited-one")
        .env("TOKIO_WORKER_THREADS", Some("2"))
        .launcher(&launcher)
        .spawn()
        .await;
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);

    let mut fillers = Vec::new();
    while let Some(f) = filler(uid, LIMIT).await {
        fillers.push(f);
        assert!(fillers.len() < LIMIT, "the thread limit was never reached");
    }

    let line = proxy
        .reload_env("ABX_SANDBOX_API_KEY=sk-limited-two\n", "reload")
        .await;
    assert!(line.contains("reloaded"), "{line}");
    assert_eq!(get(proxy.addr(), "/sandboxes").await.0, 200);
    assert_eq!(
        last_bearer(&upstream).as_deref(),
        Some("Bearer sk-limited-two")
    );
    let metrics = scrape(proxy.admin_addr()).await;
    assert_eq!(
        metric(&metrics, "abx_proxy_last_reload_successful"),
        Some(1.0)
    );
    drop(fillers);
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A thread limit that leaves no room for a worker: the start fails with its error, its
/// line written before the exit. (The worker's runtime was dropped inside the main one,
/// a panic; and the line was lost with the exit, its flush waiting on a thread that could
/// not start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_limit_with_no_room_for_a_worker_fails_the_start_with_its_error() {
    let uid = 3_100_000 + std::process::id();
    if !may_limit_threads(uid) {
        eprintln!("skipped: needs root and setpriv to set a thread limit");
        return;
    }
    let launcher = thread_limited(uid, 2);
    let launcher: Vec<&str> = launcher.iter().map(String::as_str).collect();
    let pki = Pki::new();
    let (status, stderr) = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .launcher(&launcher)
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("[E1008]"), "{stderr}");
    assert!(
        stderr.contains("cannot start a worker thread: the process is at its thread limit"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `https://` for a port that serves plain HTTP, the commonest TLS slip: the server
/// answers the ClientHello with its own 400 (nginx and hyper do), which rustls calls
/// "received corrupt message of type InvalidContentType". Said as what it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_a_plain_http_port_says_to_use_http() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let plain = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut hello = [0u8; 512];
            let _ = s.read(&mut hello).await;
            let _ = s
                .write_all(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await;
            let _ = s.shutdown().await;
        }
    });
    let pki = Pki::new();
    let proxy = ProxyCmd::new(&format!("https://127.0.0.1:{port}"), &pki)
        .spawn()
        .await;
    let resp = raw_exchange(
        proxy.addr(),
        format!("GET /sandboxes HTTP/1.1\r\nHost: {}\r\n\r\n", proxy.addr()).as_bytes(),
    )
    .await;
    assert_proxy_error(&resp, 502, "E5001");
    assert!(
        resp.text()
            .contains("tls: the server did not answer in TLS (if this port serves plain HTTP, use an http:// URL)"),
        "{}",
        resp.text()
    );
    assert_one_upstream_error(&scrape(proxy.admin_addr()).await, "api", "tls");
    proxy.finish().await;
    plain.abort();
}

/// A certificate for another name is refused in words that do not quote the host (a host
/// name could carry a secret a `${VAR}` put there, before start-up refused that), which is
/// printed once, as the upstream the error names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_is_refused_without_quoting_the_host() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "no") }).await;
    let base = format!("https://other-name.localhost:{}", upstream.addr.port());
    let proxy = ProxyCmd::new(&base, &pki).spawn().await;
    let resp = raw_exchange(
        proxy.addr(),
        format!("GET /sandboxes HTTP/1.1\r\nHost: {}\r\n\r\n", proxy.addr()).as_bytes(),
    )
    .await;
    assert_proxy_error(&resp, 502, "E5001");
    let text = resp.text();
    assert!(
        text.contains("tls: invalid peer certificate: it is not valid for this host name"),
        "{text}"
    );
    assert_eq!(text.matches("other-name").count(), 1, "{text}");
    proxy.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_mid_request_gives_its_in_flight_count_back() {
    let pki = Pki::new();
    // The upstream never answers: the request is in flight until the client goes away.
    let mut upstream = Upstream::start(&pki, Proto::Http1, |_req| async {
        std::future::pending::<()>().await;
        response(200, "never")
    })
    .await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let admin = proxy.admin_addr();
    let mut stream = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    use tokio::io::AsyncWriteExt;
    stream
        .write_all(format!("GET /hang HTTP/1.1\r\nHost: {}\r\n\r\n", proxy.addr()).as_bytes())
        .await
        .expect("send");
    upstream.next_request().await;
    let in_flight = |text: &str| series(text, "abx_proxy_in_flight_requests", &[("plane", "api")]);
    assert_eq!(in_flight(&scrape(admin).await), Some(1.0));
    drop(stream);
    within("the in-flight gauge to return to 0", async {
        let mut every = poll_ticker();
        while in_flight(&scrape(admin).await) != Some(0.0) {
            every.tick().await;
        }
    })
    .await;
    proxy.finish().await;
}

// ---------------------------------------------------------------------------------------
// The AK/SK exchange through the binary: cold start, expiry, schemes, clock skew, reload
// ---------------------------------------------------------------------------------------

/// `GET path` on a fresh connection, read raw (for [`assert_proxy_error`]).
async fn raw_get(addr: SocketAddr, path: &str) -> RawResponse {
    raw_exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes(),
    )
    .await
}

/// The `Authorization` of every request the upstream has seen, in order.
fn bearers(upstream: &Upstream) -> Vec<String> {
    upstream
        .seen()
        .iter()
        .map(|s| s.header("authorization").unwrap_or("").to_string())
        .collect()
}

/// SPEC §5: requests that arrive while the first exchange (started at startup) is still
/// out wait for it, then go upstream with the key it issued; however many wait, the
/// endpoint is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_before_the_first_exchange_wait_for_it_and_share_one_exchange() {
    const WAITERS: usize = 20;
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.hold();
    let proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    fake.until_calls(1).await;

    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| tokio::spawn(async move { get(addr, "/sandboxes").await.0 }))
        .collect();
    // All of them are inside the proxy, waiting for the key (none has been answered).
    let in_flight = |text: &str| series(text, "abx_proxy_in_flight_requests", &[("plane", "api")]);
    within("every request to be in flight", async {
        let mut every = poll_ticker();
        while in_flight(&scrape(admin).await) != Some(WAITERS as f64) {
            every.tick().await;
        }
    })
    .await;
    assert!(
        upstream.seen().is_empty(),
        "a request went up without a key"
    );

    fake.release();
    for waiter in waiters {
        let status = within("a waiting request", waiter).await.expect("join");
        assert_eq!(status, 200);
    }
    assert_eq!(fake.calls(), 1, "one exchange for every waiter");
    let issued = fake.issued_keys();
    assert_eq!(
        bearers(&upstream),
        vec![format!("Bearer {}", issued[0]); WAITERS]
    );
    let stderr = proxy.finish().await;
    assert_no_aksk_secret(&stderr, &issued, "the proxy's stderr");
}

/// A reload that replaces an AK/SK pair whose first exchange has not answered yet: the
/// requests waiting for it are woken as the replaced pair retires and are served with the
/// new credential. They waited out the first exchange's 30 s, then got 503 E1004, while
/// requests sent after the reload were served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_a_pair_a_reload_replaces_get_the_new_credential() {
    const STATIC_KEY: &str = "sk-reload-static-EEEE5555ffff6666";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.hold();
    let mut proxy = aksk_proxy_from_dotenv(&upstream, &pki, &fake).spawn().await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());
    fake.until_calls(1).await;
    let waiter = tokio::spawn(async move { get(addr, "/sandboxes").await.0 });
    let in_flight = |text: &str| series(text, "abx_proxy_in_flight_requests", &[("plane", "api")]);
    within("the request to wait for the key", async {
        let mut every = poll_ticker();
        while in_flight(&scrape(admin).await) != Some(1.0) {
            every.tick().await;
        }
    })
    .await;

    proxy
        .reload_env(&format!("ABX_SANDBOX_API_KEY={STATIC_KEY}\n"), "reloaded")
        .await;
    // Well inside the first exchange's 30 s, which it would otherwise have waited out.
    let status = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiting request still waited 20 s after the reload")
        .expect("join");
    assert_eq!(status, 200);
    assert_eq!(last_bearer(&upstream), Some(format!("Bearer {STATIC_KEY}")));
    fake.release();
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(STATIC_KEY), "a key in the log");
}

/// SPEC §5 and §7: a temporary key is not sent in its last 5 s. The fake issues a key that
/// lives 10 s, so its refresh falls due 2.5 s before it stops being handed out (room for
/// the exchange: half of its 5 s of use). That refresh is held, so the key runs out during
/// it, then fails. Meanwhile `/readyz` is 503 and requests get 503 E1004 without reaching
/// the upstream; once the endpoint answers again, the retry's key is in use and `/readyz`
/// is 200.
///
/// The first request waits inside the proxy before the key exists, and takes it the moment
/// it is stored; sent after the success line, it had to be read from the log, connect and
/// arrive within the key's 5 s of use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiring_key_whose_refresh_fails_is_503_e1004_until_a_refresh_succeeds() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.set_ttl(Some(Duration::from_secs(10)));
    fake.hold();
    let mut proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let (addr, admin) = (proxy.addr(), proxy.admin_addr());

    fake.until_calls(1).await;
    let first_request = tokio::spawn(async move { get(addr, "/sandboxes").await.0 });
    within("the first request to wait for the key", async {
        let mut every = poll_ticker();
        let in_flight =
            |text: &str| series(text, "abx_proxy_in_flight_requests", &[("plane", "api")]);
        while in_flight(&scrape(admin).await) != Some(1.0) {
            every.tick().await;
        }
    })
    .await;
    // Let the first exchange through and hold everything after it. The fake records a key
    // before it answers, so the hold is in place before the proxy has a key to refresh.
    fake.release();
    fake.until_issued(1).await;
    fake.hold();
    assert_eq!(
        within("the first request", first_request)
            .await
            .expect("join"),
        200,
        "the first key, well before expiry"
    );
    proxy.wait_for_line("token exchange succeeded").await;
    let first = format!("Bearer {}", fake.issued_keys()[0]);
    assert_eq!(bearers(&upstream), std::slice::from_ref(&first));

    // The refresh arrives, and is held until the key is 5 s from expiry: no longer handed
    // out, the proxy unready.
    fake.until_calls(2).await;
    within("the key's last 5 s", async {
        let mut every = poll_ticker();
        while get(admin, "/readyz").await.0 != 503 {
            every.tick().await;
        }
    })
    .await;
    assert_proxy_error(&raw_get(addr, "/sandboxes").await, 503, "E1004");

    // The refresh fails: requests name the endpoint's answer.
    fake.set_ttl(Some(Duration::from_secs(3600)));
    fake.set_mode(Mode::Fail500);
    fake.release();
    let line = proxy.wait_for_line("token exchange failed").await;
    assert!(line.contains("key=none usable"), "{line}");
    let resp = raw_get(addr, "/sandboxes").await;
    assert_proxy_error(&resp, 503, "E1004");
    assert!(resp.text().contains("HTTP 500"), "{}", resp.text());
    assert_eq!(get(admin, "/readyz").await.0, 503);
    assert_eq!(
        bearers(&upstream),
        std::slice::from_ref(&first),
        "a request went upstream"
    );

    // The endpoint recovers: the next retry's key serves.
    fake.set_mode(Mode::Ok);
    proxy.wait_for_line("token exchange succeeded").await;
    assert_eq!(get(admin, "/readyz").await.0, 200);
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let issued = fake.issued_keys();
    assert_eq!(
        issued.len(),
        2,
        "one key at startup, one from the recovered refresh"
    );
    assert_eq!(bearers(&upstream), [first, format!("Bearer {}", issued[1])]);
    let stderr = proxy.finish().await;
    assert_no_aksk_secret(&stderr, &issued, "the proxy's stderr");
}

/// `abx-proxy check` (see [`aksk_command`]) against `fake` and `upstream`.
fn check_command(home: &Path, fake: &FakeExchange, upstream: &Upstream, pki: &Pki) -> Command {
    let mut cmd = aksk_command(home);
    cmd.arg("check").args([
        "--token-exchange-url",
        &fake.url,
        "--sandbox-base-url",
        &upstream.url(),
        "--upstream-ca",
        &pki.ca_pem.display().to_string(),
    ]);
    cmd
}

/// Runs `cmd` off the runtime (the fake and the upstream are served from it), bounded.
async fn output(cmd: Command) -> Output {
    output_within(cmd, "abx-proxy to exit").await
}

/// One way to choose the exchange's signature scheme (SPEC §2), and the scheme it gives.
struct SchemeChoice {
    how: &'static str,
    flags: &'static [&'static str],
    env: Option<(&'static str, &'static str)>,
    config_toml: Option<&'static str>,
    want: &'static str,
}

const SCHEME_CHOICES: [SchemeChoice; 4] = [
    SchemeChoice {
        how: "nothing set",
        flags: &[],
        env: None,
        config_toml: None,
        want: "rpc-v1",
    },
    SchemeChoice {
        how: "--token-exchange acs3",
        flags: &["--token-exchange", "acs3"],
        env: None,
        config_toml: None,
        want: "acs3",
    },
    SchemeChoice {
        how: "ABX_TOKEN_EXCHANGE=acs3",
        flags: &[],
        env: Some(("ABX_TOKEN_EXCHANGE", "acs3")),
        config_toml: None,
        want: "acs3",
    },
    SchemeChoice {
        how: "[auth] token_exchange in config.toml",
        flags: &[],
        env: None,
        config_toml: Some("[auth]\ntoken_exchange = \"acs3\"\n"),
        want: "acs3",
    },
];

/// SPEC §2 and §5: `token_exchange = acs3`, given as a flag, in the environment or under
/// `[auth]` in `~/.abx/config.toml`, makes both `serve` and `check` sign their exchange with
/// ACS3; with none of them both use RPC V1. The fake verifies each scheme on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_check_sign_the_exchange_with_the_configured_scheme() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "[]") }).await;
    for choice in &SCHEME_CHOICES {
        let fake = FakeExchange::start(Arc::new(SystemClock)).await;
        let home = tempfile::tempdir().expect("home for check");
        let mut serve = aksk_proxy(&upstream, &pki, &fake).args(choice.flags);
        let mut check = check_command(home.path(), &fake, &upstream, &pki);
        check.args(choice.flags);
        if let Some((name, value)) = choice.env {
            serve = serve.env(name, Some(value));
            check.env(name, value);
        }
        if let Some(toml) = choice.config_toml {
            serve = serve.abx_file("config.toml", toml);
            std::fs::create_dir_all(home.path().join(".abx")).expect("~/.abx");
            std::fs::write(home.path().join(".abx/config.toml"), toml).expect("config.toml");
        }

        let proxy = serve.spawn().await;
        assert_eq!(
            get(proxy.addr(), "/sandboxes").await.0,
            200,
            "{}",
            choice.how
        );
        assert_eq!(fake.schemes(), [choice.want], "serve, {}", choice.how);
        proxy.finish().await;

        let out = output(check).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "check, {}: {stderr}",
            choice.how
        );
        assert_eq!(fake.schemes(), [choice.want; 2], "check, {}", choice.how);
    }
}

/// What E1002's suggestion says (SPEC §5: a clock-skew answer is E1002 with its suggestion).
const CLOCK_SUGGESTION: &str = "Synchronise the system clock";

/// SPEC §1 and §5: an endpoint that rejects the request time is E1002, not a generic
/// exchange failure. `check` prints `[E1002]` with its suggestion and exits 78 (a credential
/// error; the endpoint was reached, so not 69) without probing the upstream. `serve` logs it
/// with the suggestion, stays unready, and answers requests 503 `E1002` in the E2B error
/// shape — the code that tells an SDK user to look at their clock — sending nothing upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_is_e1002_with_its_suggestion_in_check_and_serve() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "[]") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.set_mode(Mode::ClockSkew);

    let home = tempfile::tempdir().expect("home for check");
    let out = output(check_command(home.path(), &fake, &upstream, &pki)).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("[E1002] clock skew"), "{stderr}");
    assert!(
        stderr.contains(&format!("Suggestion: {CLOCK_SUGGESTION}")),
        "{stderr}"
    );

    let mut proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let line = proxy.wait_for_line("token exchange failed").await;
    assert!(
        line.contains("[E1002]") && line.contains(CLOCK_SUGGESTION),
        "{line}"
    );
    let resp = raw_get(proxy.addr(), "/sandboxes").await;
    assert_proxy_error(&resp, 503, "E1002");
    assert!(
        resp.text().contains("InvalidTimeStamp.Expired"),
        "{}",
        resp.text()
    );
    assert_eq!(get(proxy.admin_addr(), "/readyz").await.0, 503);
    assert!(
        upstream.seen().is_empty(),
        "a request went upstream without a key"
    );
    proxy.finish().await;
}

/// An endpoint failing for a while (a 5xx) is logged with its own suggestion, to retry
/// later, not E1004's to check the AccessKey pair, which the log said before: requests
/// still get E1004.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_exchange_endpoint_is_logged_with_its_own_suggestion() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "[]") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    fake.set_mode(Mode::Fail500);
    let mut proxy = aksk_proxy(&upstream, &pki, &fake).spawn().await;
    let line = proxy.wait_for_line("token exchange failed").await;
    assert!(
        line.contains("[E1004]") && line.contains("retry later"),
        "{line}"
    );
    assert!(!line.contains("Check the AccessKey pair"), "{line}");
    let resp = raw_get(proxy.addr(), "/sandboxes").await;
    assert_proxy_error(&resp, 503, "E1004");
    proxy.finish().await;
}

/// SPEC §2 and §7: SIGHUP re-reads the working directory's `./.env` (not only `~/.abx/.env`)
/// and `~/.abx/config.toml`. A key put in `./.env` beats the one in `~/.abx/.env`; then an
/// AccessKey pair whose id is only in config.toml and whose secret is only in `./.env`
/// replaces the API key: once "reloaded" is logged, the upstream sees the temporary key the
/// endpoint issued for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_cwd_env_and_config_toml_and_a_new_pair_replaces_the_key() {
    const HOME_KEY: &str = "sk-reload-home-GGGG7777hhhh8888";
    const CWD_KEY: &str = "sk-reload-cwd-IIII9999jjjj0000";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let fake = FakeExchange::start(Arc::new(SystemClock)).await;
    let mut proxy = key_in_env_file(&upstream, &pki, HOME_KEY)
        .args(&["--token-exchange-url", &fake.url])
        .spawn()
        .await;
    let addr = proxy.addr();
    let (cwd_env, home_env) = (proxy.cwd().join(".env"), proxy.abx_home().join(".env"));
    let config_toml = proxy.abx_home().join("config.toml");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);

    let line = proxy
        .reload_files(
            &[(cwd_env.clone(), &format!("ABX_SANDBOX_API_KEY={CWD_KEY}\n"))],
            "reloaded",
        )
        .await;
    assert!(line.contains("sandbox_api_key"), "{line}");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);

    let secret = format!("ALICLOUD_ACCESS_KEY_SECRET={ACCESS_KEY_SECRET}\n");
    let id = format!("[auth]\naccess_key_id = \"{ACCESS_KEY_ID}\"\n");
    let line = proxy
        .reload_files(
            &[(cwd_env, &secret), (home_env, ""), (config_toml, &id)],
            "reloaded",
        )
        .await;
    assert!(line.contains("access_key_id"), "{line}");
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let issued = fake.issued_keys();
    assert_eq!(issued.len(), 1, "one exchange, for the reload");
    assert_eq!(
        bearers(&upstream),
        [
            format!("Bearer {HOME_KEY}"),
            format!("Bearer {CWD_KEY}"),
            format!("Bearer {}", issued[0]),
        ]
    );
    assert_eq!(get(proxy.admin_addr(), "/readyz").await.0, 200);
    let stderr = proxy.finish().await;
    assert_no_aksk_secret(&stderr, &issued, "the proxy's stderr");
    for key in [HOME_KEY, CWD_KEY] {
        assert!(!stderr.contains(key), "a key value in the log:\n{stderr}");
    }
}

/// Out of descriptors, every accept fails (the proxy retries every 50 ms) until one is
/// freed: one warning says so and what to do, the failures after it are debug lines
/// (they were one warning each, 20 a second), and the end of the run is said. The client
/// that waited in the kernel's queue meanwhile is then served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_failures_warn_once_and_the_waiting_client_is_then_served() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .log_level("debug")
        .spawn()
        .await;
    let addr = proxy.addr();
    let free = free_descriptor_numbers(proxy.pid, 1);
    let soft = set_soft_nofile(proxy.pid, free[0]);
    let mut waiting = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let warning = proxy.wait_for_line("accept failed").await;
    assert!(warning.contains("WARN"), "{warning}");
    assert!(warning.contains("open-file limit"), "{warning}");
    for _ in 0..2 {
        let again = proxy.wait_for_line("accept failed").await;
        assert!(
            again.contains("DEBUG") && again.contains("again"),
            "{again}"
        );
    }
    set_soft_nofile(proxy.pid, soft);
    proxy.wait_for_line("accepting connections again").await;
    let req = format!("GET /after HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut waiting, req.as_bytes())
        .await
        .expect("send");
    let resp = read_response(&mut waiting, &mut Vec::new()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let stderr = proxy.finish().await;
    let warnings = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("accept failed"))
        .count();
    assert_eq!(warnings, 1, "{stderr}");
}

/// A log reader that stalls (a full stderr pipe: a wedged log shipper, a slow `tee`) stops
/// nothing: requests are served, the lines that neither the pipe nor the proxy's queue can
/// hold are dropped and counted, and SIGTERM still ends the proxy. Before, every worker
/// blocked in its write to stderr after a few hundred requests (while `/readyz` said 200),
/// and the main thread at its "draining" line: only SIGKILL ended the process. A reader
/// that comes back is told how many lines were dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_log_reader_stops_neither_requests_nor_the_drain() {
    const REQUESTS: usize = 3000;
    const DROPPED: &str = "abx_proxy_log_lines_dropped_total";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let addr = proxy.addr();
    let fill = |round: usize| async move {
        let mut client = connect(addr).await;
        for i in 0..REQUESTS {
            within("the connection ready", client.ready())
                .await
                .expect("the connection kept");
            let req = request("GET", addr, "/sandboxes")
                .body(empty())
                .expect("request");
            let resp = within(
                "an answer while stderr is not read",
                client.send_request(req),
            )
            .await
            .expect("an answer");
            assert_eq!(resp.status(), 200, "round {round}, request {i}");
            resp.into_body().collect().await.expect("body");
        }
    };
    proxy.read_stderr(false);
    fill(1).await;
    let text = scrape(proxy.admin_addr()).await;
    let dropped = metric(&text, DROPPED).unwrap_or_default();
    assert!(dropped > 0.0, "{text}");
    assert_eq!(get(proxy.admin_addr(), "/readyz").await.0, 200);

    proxy.read_stderr(true);
    assert_eq!(get(addr, "/sandboxes").await.0, 200);
    let said = proxy.wait_for_line("log lines dropped").await;
    assert!(said.contains(" WARN "), "{said}");
    // All of them, at least those counted before (it was 1: the warning itself, queued
    // behind a full queue, was dropped, and the next one counted only that).
    let told = said
        .split(" dropped=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok());
    assert!(
        told.is_some_and(|n| n >= dropped),
        "{dropped} counted: {said}"
    );

    // Stalled again, and full: the drain and the exit do not wait on it.
    proxy.read_stderr(false);
    fill(2).await;
    let text = scrape(proxy.admin_addr()).await;
    assert!(
        metric(&text, DROPPED).unwrap_or_default() > dropped,
        "{text}"
    );
    proxy.signal("TERM");
    let status = proxy.wait_exit().await;
    assert!(status.success(), "{status}; stderr:\n{}", proxy.stderr());
}

/// A panic that ends the process is said, one JSON object, before the exit (101). The
/// panic hook only queues its line; unwinding out of `main` left the writer thread no
/// moment to write it, and most such exits said nothing at all. The one panic the start
/// has: tokio's signal set-up, at an open-file limit of 6 or 7 beside the standard three
/// (each limit from 4 to 12 and as many more as a child of this test inherits is tried,
/// three times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_that_ends_the_process_is_said_before_the_exit() {
    let listed = Command::new("ls")
        .arg("/proc/self/fd")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("ls");
    // Its own three, and the directory it lists.
    let inherited = (String::from_utf8_lossy(&listed.stdout).lines().count()).saturating_sub(4);
    let pki = Pki::new();
    let mut panicked = 0;
    // The limit caps descriptor numbers: an inherited one numbered above the panic's
    // moves nothing, so the range only grows.
    for n in 4..=12 + inherited {
        for _ in 0..3 {
            let limit = format!("--nofile={n}");
            let (status, stderr) = ProxyCmd::new("https://127.0.0.1:9", &pki)
                .args(&["--log-format", "json"])
                .launcher(&["prlimit", &limit, "--"])
                .run_to_exit()
                .await;
            if status.code() != Some(101) {
                continue;
            }
            panicked += 1;
            let said: Vec<serde_json::Value> = stderr
                .lines()
                .map(|l| serde_json::from_str(l).expect("a JSON object a line"))
                .collect();
            assert!(
                said.iter().any(|o| o["level"] == "ERROR"
                    && o["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("panicked at"))),
                "{n}: {stderr}"
            );
        }
    }
    assert!(
        panicked > 0,
        "no open-file limit made the start panic: find another panic"
    );
}

/// Logs written to a file that reaches the file-size limit (`LimitFSIZE=`, `ulimit -f`):
/// SIGXFSZ killed the proxy at once, undrained, mid-line. It serves on, the lines stderr
/// refuses are counted as dropped, and a SIGTERM drains and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_at_the_file_size_limit_neither_end_nor_stop_the_proxy() {
    const LIMIT: u64 = 16 * 1024;
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("proxy.log");
    let file = std::fs::File::create(&log).expect("log file");
    let limit = format!("--fsize={LIMIT}");
    let (mut proxy, _home) = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(&["prlimit", &limit, "--"])
        .spawn_logging_to(file)
        .await;
    let listening = within("the listening line", async {
        let mut every = poll_ticker();
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.contains("abx-proxy listening")) {
                break line.to_string();
            }
            every.tick().await;
        }
    })
    .await;
    let addr: SocketAddr = field(&listening, "listen")
        .expect("listen=")
        .parse()
        .unwrap();
    let admin: SocketAddr = field(&listening, "admin").expect("admin=").parse().unwrap();
    // Each request's debug lines take the file towards its limit; then a few more.
    let mut past = 0;
    for _ in 0..2_000 {
        assert_eq!(get(addr, "/sandboxes").await.0, 200, "{}", past);
        let full = std::fs::metadata(&log).map(|m| m.len()).unwrap_or_default() >= LIMIT;
        past += usize::from(full);
        if past == 20 {
            break;
        }
    }
    assert_eq!(past, 20, "the log file never reached its limit");
    let text = scrape(admin).await;
    let dropped = metric(&text, "abx_proxy_log_lines_dropped_total").unwrap_or_default();
    assert!(dropped > 0.0, "{text}");
    proxy.signal("TERM");
    let status = proxy.exit("the drain").await;
    assert_eq!(status.code(), Some(0), "{status}");
}

/// A stderr whose open file is non-blocking (shared with a parent that set `O_NONBLOCK`
/// on it) and a reader that falls behind: the writer waits for room, signals or not, and
/// every line comes out whole. `write_all` gave up at EAGAIN mid-line, and the next line
/// was glued to the torn one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_blocking_stderr_gets_whole_lines() {
    use std::io::BufRead as _;
    const REQUESTS: usize = 64;
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let (reader, writer) = std::io::pipe().expect("pipe");
    let flags = rustix::fs::fcntl_getfl(&writer).expect("flags");
    rustix::fs::fcntl_setfl(&writer, flags | rustix::fs::OFlags::NONBLOCK).expect("O_NONBLOCK");
    let (mut proxy, _home) = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--log-format", "json"])
        .log_level("info")
        .spawn_logging_to(writer)
        .await;
    // Read up to the listening line, then not until the requests are answered.
    let (go_on, gate) = std::sync::mpsc::channel::<()>();
    let (tell, listening) = oneshot::channel();
    let reading = std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(reader).lines();
        let mut all = Vec::new();
        let mut tell = Some(tell);
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if line.contains("abx-proxy listening") {
                if let Some(tell) = tell.take() {
                    let _ = tell.send(line.clone());
                }
                all.push(line);
                break;
            }
            all.push(line);
        }
        let _ = gate.recv();
        all.extend(lines.map_while(Result::ok));
        all
    });
    let line = within("the listening line", listening)
        .await
        .expect("listening");
    let object: serde_json::Value = serde_json::from_str(&line).expect("json");
    let addr: SocketAddr = object["listen"].as_str().expect("listen").parse().unwrap();
    // Access lines of ~8 KiB each: the pipe's 64 KiB fill within a few.
    let path = format!("/sandboxes/{}", "x".repeat(8 * 1024));
    for _ in 0..REQUESTS {
        assert_eq!(get(addr, &path).await.0, 200);
    }
    // The writer waits for room now. A signal the proxy handles (and then ignores), taken
    // by the writer: its wait (poll(2), never restarted) ends early with EINTR, on which
    // it gave up mid-line. kill(2) given a thread's id prefers that thread.
    let writer = std::fs::read_dir(format!("/proc/{}/task", proxy.pid))
        .expect("tasks")
        .filter_map(Result::ok)
        .find(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "abx-log")
        })
        .map(|t| t.file_name().to_string_lossy().into_owned())
        .expect("the writer thread");
    for _ in 0..20 {
        signal(writer.parse().expect("tid"), "XFSZ");
    }
    drop(go_on);
    proxy.signal("TERM");
    let status = proxy.exit("the drain").await;
    assert_eq!(status.code(), Some(0), "{status}");
    let lines = reading.join().expect("reader");
    for line in &lines {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "a torn line: {}...",
            &line[..line.len().min(200)]
        );
    }
    let access = lines
        .iter()
        .filter(|l| l.contains("\"path\":\"/sandboxes/x"))
        .count();
    assert_eq!(access, REQUESTS, "every request's line");
}

/// With `--log-format json`, the error that ends a start is a JSON object like every other
/// line (with its code and suggestion), not the house format's bare two lines, which a
/// pipeline reading one object per line refused: the one line that says why the unit
/// failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_with_json_logs_says_why_in_json() {
    let pki = Pki::new();
    for level in ["debug", "off"] {
        let cmd = ProxyCmd::new("https://127.0.0.1:9", &pki)
            .args(&["--log-format", "json"])
            .log_level(level)
            .env("ABX_SANDBOX_API_KEY", None);
        fails_in_json(cmd).await;
    }
}

/// The proxy `cmd` fails to start for want of a key: its last stderr line is the error as
/// a JSON object, and every line is one.
async fn fails_in_json(cmd: ProxyCmd) {
    let (status, stderr) = cmd.run_to_exit().await;
    assert_eq!(status.code(), Some(78), "{stderr}");
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?} in\n{stderr}")))
        .collect();
    let last = lines.last().unwrap_or_else(|| panic!("nothing said"));
    assert_eq!(last["level"], "ERROR", "{last}");
    assert_eq!(last["code"], "E1001", "{last}");
    let message = last["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("[E1001] "), "{last}");
    let suggestion = last["suggestion"].as_str().unwrap_or_default();
    assert!(suggestion.contains("ABX_SANDBOX_API_KEY"), "{last}");
}

/// `--admin-listen=[::]:PORT` takes IPv4 connections too, as the README and the Kubernetes
/// manifest say, also where the host's `net.ipv6.bindv6only` is 1 (a listener left to that
/// default took IPv6 only). Run in a network namespace of its own with that default: as
/// root, or else in a user namespace of its own where the kernel allows one; skipped where
/// neither can be made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_wildcard_admin_listener_takes_ipv4_whatever_the_hosts_default() {
    let netns = "ip link set lo up && echo 1 > /proc/sys/net/ipv6/bindv6only && exec \"$@\"";
    let as_root = ["unshare", "--net", "sh", "-c", netns, "sh"];
    let as_user = [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        "sh",
        "-c",
        netns,
        "sh",
    ];
    let works = |launcher: &[&str]| {
        Command::new(launcher[0])
            .args(&launcher[1..])
            .args([
                "sh",
                "-c",
                "test \"$(cat /proc/sys/net/ipv6/bindv6only)\" = 1",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let (launcher, in_user_ns): (&[&str], bool) = if works(&as_root) {
        (&as_root, false)
    } else if works(&as_user) {
        (&as_user, true)
    } else {
        eprintln!("skipped: no network namespace of our own here (neither as root nor in a user namespace)");
        return;
    };
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .launcher(launcher)
        .admin_listen("[::]:0")
        .spawn()
        .await;
    let port = proxy.admin_addr().port();
    // From inside the proxy's namespace: a plain HTTP/1.0 request with bash's /dev/tcp.
    for host in ["127.0.0.1", "::1"] {
        let mut ask = Command::new("nsenter");
        if in_user_ns {
            ask.arg(format!("--user=/proc/{}/ns/user", proxy.pid))
                .arg("--preserve-credentials");
        }
        ask.arg(format!("--net=/proc/{}/ns/net", proxy.pid)).args([
            "timeout",
            "10",
            "bash",
            "-c",
            "exec 3<>\"/dev/tcp/$0/$1\" && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -n 1 <&3",
            host,
            &port.to_string(),
        ]);
        let out = output_within(ask, "a request to the admin listener").await;
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            said.starts_with("HTTP/1.") && said.split_whitespace().nth(1) == Some("200"),
            "{host}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    proxy.finish().await;
}

/// An upstream the settings cannot read as this host (`127.1`, which the system's resolver
/// reads as 127.0.0.1) at the listener's own port: with `--allow-remote`, which lets the
/// request back in, one request came back as thousands within seconds, each holding a
/// connection. The connect that reaches the proxy's own listener is refused: 502 E5001
/// saying so, and one access line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_reaches_the_proxys_own_listener_is_refused_at_connect() {
    let pki = Pki::new();
    // Known before the proxy starts only as a port bound and released, which a concurrent
    // test's listener can take in between (E1008): then another port.
    let mut tries = 0;
    let proxy = loop {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
            l.local_addr().expect("addr").port()
        };
        let started = ProxyCmd::new(&format!("http://127.1:{port}"), &pki)
            .listen(&format!("127.0.0.1:{port}"))
            .arg("--allow-remote")
            .try_spawn()
            .await;
        match started {
            Ok(proxy) => break proxy,
            Err(stderr) if stderr.contains("[E1008]") && tries < 5 => tries += 1,
            Err(stderr) => panic!("abx-proxy exited before listening:\n{stderr}"),
        }
    };
    let (status, body) = get(proxy.addr(), "/sandboxes").await;
    let body = String::from_utf8_lossy(&body).to_string();
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("is this proxy's own listener"), "{body}");
    let log = proxy.finish().await;
    assert_eq!(log.matches("path=/sandboxes").count(), 1, "{log}");
}
