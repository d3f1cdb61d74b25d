//! `serve` as the command line and the settings chain promise it (SPEC §1–§2), through the
//! real binary: no subcommand serves, `--version` and `--help`, settings that come from
//! the environment and the files rather than flags, and `github_token`, which is resolved
//! but never sent anywhere.

mod support;

use std::path::Path;
use std::process::Command;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use support::*;

const GH_TOKEN: &str = "ghp_9Zt4Kq7Wm2Xc5Vb8Nr3Ls6Hd1GITH";

/// One request over the unix socket at `sock`; the response head within [`GUARD`].
async fn send_unix(sock: &Path, req: Request<TestBody>) -> Response<Incoming> {
    let stream = within(
        "connect to the socket",
        tokio::net::UnixStream::connect(sock),
    )
    .await
    .expect("connect to the socket");
    let mut client = handshake(stream).await;
    within("the proxy's response", client.send_request(req))
        .await
        .expect("request through the proxy")
}

/// The upstream's answer for a sandbox: what teaches the proxy its envd token.
fn sandbox(status: u16, id: &str, token: &str) -> Response<TestBody> {
    let body = serde_json::json!({"sandboxID": id, "envdAccessToken": token});
    response(status, body.to_string())
}

/// SPEC §1: `abx-proxy` with no subcommand is `serve`: it takes the serve flags, binds,
/// and forwards a real request with the key attached in place of the client's dummy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subcommand_serves() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .omit(&["serve"])
        .spawn()
        .await;
    let addr = proxy.addr();
    let req = request("GET", addr, "/sandboxes")
        .header("x-api-key", "dummy")
        .body(empty())
        .expect("request");
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(collect(resp.into_body()).await, "ok");
    proxy.finish().await;

    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
    assert!(seen[0].header("x-api-key").is_none(), "{:?}", seen[0]);
}

/// A key that cannot be a header value (a control character pasted with it) is a
/// configuration error at start (E1005, exit 78), not a 503 "API key cannot be empty" on
/// every request while `/readyz` says 200. The key itself is not printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_cannot_be_a_header_value_is_refused_at_start() {
    let pki = Pki::new();
    let (status, stderr) = ProxyCmd::new("http://127.0.0.1:9", &pki)
        .env("ABX_SANDBOX_API_KEY", Some("sk-pasted-zq81\u{7f}"))
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains(
            "[E1005] invalid value for sandbox_api_key (ABX_SANDBOX_API_KEY from env): not usable as an HTTP header value"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("zq81"), "{stderr}");
}

/// SPEC §1: `--version` exits 0 and prints the package version; `--help` exits 0 and
/// names every command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_and_help_exit_0() {
    let dir = tempfile::tempdir().expect("dir");
    let run = |flag: &'static str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
        cmd.env_clear()
            .env("HOME", dir.path())
            .current_dir(dir.path())
            .arg(flag);
        async move {
            let out = output_within(cmd, "abx-proxy to exit").await;
            assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
            String::from_utf8(out.stdout).expect("text")
        }
    };
    assert_eq!(
        run("--version").await.trim(),
        format!("abx-proxy {}", env!("CARGO_PKG_VERSION"))
    );
    let help = run("--help").await;
    for command in ["serve", "config", "check", "provider"] {
        assert!(help.contains(command), "--help lacks {command}:\n{help}");
    }
}

/// SPEC §2: `serve` takes its non-flag settings from the same layers as `config list`.
/// With no `--listen`, `--admin-listen` or `--sandbox-base-url`: the listen address (a unix
/// socket) comes from config.toml, the control plane from `./.env`, `compat_v2_paths =
/// pass` from the environment, the admin address from `~/.abx/.env`. Serve binds and
/// forwards accordingly, and `config list` shows the same values from the same sources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reads_settings_from_the_same_layers_as_config_list() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().expect("dir");
    let sock = dir.path().join("abx.sock");
    let listen = format!("unix:{}", sock.display());
    let cmd = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .omit(&["--listen", "--admin-listen", "--sandbox-base-url"])
        .abx_file("config.toml", &format!("[proxy]\nlisten = \"{listen}\"\n"))
        .cwd_dotenv(&format!("ABX_SANDBOX_BASE_URL={}\n", upstream.url()))
        .abx_file(".env", "ABX_PROXY_ADMIN_LISTEN=127.0.0.1:0\n")
        .env("ABX_COMPAT_V2_PATHS", Some("pass"));
    let env = cmd.env_vars();
    let proxy = cmd.spawn().await;
    assert_eq!(proxy.listen, listen);
    assert_ne!(proxy.admin_addr().port(), 9464, "the default admin port");

    // `pass`: the SDK's `/v2/sandboxes` reaches the upstream as sent.
    let req = Request::post("/v2/sandboxes")
        .header("host", "localhost")
        .body(full("{}"))
        .expect("request");
    let resp = send_unix(&sock, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let config = proxy.config_list(&env).await;
    proxy.finish().await;

    let expected = [
        ("listen", listen.as_str(), "~/.abx/config.toml"),
        ("sandbox_base_url", &upstream.url(), "./.env"),
        ("compat_v2_paths", "pass", "env"),
        ("admin_listen", "127.0.0.1:0", "~/.abx/.env"),
    ];
    for (key, value, source) in expected {
        assert_eq!(config[key]["value"], value, "{key}");
        assert_eq!(config[key]["source"], source, "{key}");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path_and_query(), "/v2/sandboxes");
    assert_eq!(
        seen[0].all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
}

/// SPEC §2: `github_token` is resolved and listed, never attached. With `GITHUB_TOKEN`
/// set, no header the upstream receives carries it: control-plane requests, envd requests
/// for a sandbox the proxy knows and one it must look up, and that look-up itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_token_is_never_sent_upstream() {
    let pki = Pki::new();
    // One upstream for both planes (`--sandbox-url`).
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match (req.method().as_str(), req.uri().path()) {
            ("POST", "/sandboxes") => sandbox(201, "isb-1", "tok-1"),
            ("GET", "/sandboxes/isb-2") => sandbox(200, "isb-2", "tok-2"),
            _ => response(200, "ok"),
        }
    })
    .await;
    let cmd = ProxyCmd::new(&upstream.url(), &pki)
        .args(&["--sandbox-url", &upstream.url()])
        .env("GITHUB_TOKEN", Some(GH_TOKEN));
    let env = cmd.env_vars();
    let proxy = cmd.spawn().await;
    let addr = proxy.addr();
    let requests = [
        ("POST", "/sandboxes", None),
        ("GET", "/sandboxes", None),
        ("GET", "/health", Some("isb-1")),
        ("GET", "/health", Some("isb-2")),
    ];
    for (method, path, sandbox_id) in requests {
        let mut req = request(method, addr, path).header("x-api-key", "dummy");
        if let Some(id) = sandbox_id {
            req = req.header("e2b-sandbox-id", id);
        }
        let resp = send(addr, req.body(empty()).expect("request")).await;
        assert!(resp.status().is_success(), "{method} {path}: {resp:?}");
        collect(resp.into_body()).await;
    }
    let config = proxy.config_list(&env).await;
    let stderr = proxy.finish().await;

    assert_eq!(
        config["github_token"]["source"], "env",
        "resolved and listed"
    );
    let seen = upstream.seen();
    let envd_tokens: Vec<Vec<String>> = seen.iter().map(|s| s.all("x-access-token")).collect();
    assert_eq!(
        envd_tokens,
        [
            vec![],
            vec![],
            vec!["tok-1".to_string()],
            vec![],
            vec!["tok-2".to_string()]
        ],
        "the two control-plane requests, envd, the look-up, envd"
    );
    assert_not_sent(&seen, GH_TOKEN, "GITHUB_TOKEN");
    assert!(!stderr.contains(GH_TOKEN), "GITHUB_TOKEN in the log");
}
