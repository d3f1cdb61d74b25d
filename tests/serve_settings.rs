//! `serve` as the command line promises it (SPEC §1), through the real binary: no
//! subcommand serves, `--version` and `--help`.

mod support;

use std::process::Command;

use http::StatusCode;
use support::*;

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

/// SPEC §1: `--version` exits 0 and prints the package version; `--help` exits 0 and
/// names every command.
#[test]
fn version_and_help_exit_0() {
    let dir = tempfile::tempdir().expect("dir");
    let run = |flag: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_abx-proxy"))
            .env_clear()
            .env("HOME", dir.path())
            .current_dir(dir.path())
            .arg(flag)
            .output()
            .expect("run abx-proxy");
        assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
        String::from_utf8(out.stdout).expect("text")
    };
    assert_eq!(
        run("--version").trim(),
        format!("abx-proxy {}", env!("CARGO_PKG_VERSION"))
    );
    let help = run("--help");
    for command in ["serve", "config", "check", "provider"] {
        assert!(help.contains(command), "--help lacks {command}:\n{help}");
    }
}
