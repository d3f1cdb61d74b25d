//! End-to-end gate: the real, unmodified E2B SDKs ("latest": Python 2.64.0 and JS 2.51.0,
//! the newest checked, pinned in `tests/e2e/python/` and `tests/e2e/package.json`; both
//! at 2.50.0; Python 2.20.0, whose connected sandbox names itself by its token alone) talk to `abx-proxy` with a dummy key; the proxy talks to the fake E2B cloud
//! (`examples/fake_e2b.rs`), which checks every request it gets (the real key as Bearer on
//! the control plane, no client key anywhere, the right envd token per sandbox, …). The JS
//! SDK also goes through the shipped `deploy/providers/e2b` plugin (E2B's own cloud: the key
//! as `X-API-Key`, `/v2` passed on).
//!
//! The code-interpreter SDKs (Python `e2b-code-interpreter` 2.11.5, JS `@e2b/code-interpreter`
//! 2.8.0, on the latest core SDKs) run code through the proxy on the sandbox's port 49999.
//!
//! `scripts/e2e-deps.sh` installs the SDKs into `target/e2e` and `tests/e2e/node_modules`
//! (first run: about a minute, from PyPI and npm; later runs: instant).

#[path = "support/e2e.rs"]
mod e2e;

use std::ffi::OsString;
use std::time::Duration;

use serde_json::Value;

use e2e::{deps, driver, e2e_dir, fake_report, repo, start_fake, Outcome, Proc};

const REAL_KEY: &str = "real-key-e2e-0123456789abcdef";
const DUMMY_KEY: &str = "dummy-key";
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// How abx-proxy reaches the fake.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Upstreams {
    /// Plain HTTP, envd through one `--sandbox-url`.
    Plain,
    /// As in production: an `https` control plane (HTTP/2 offered) and envd at
    /// `https://{port}-{id}.{sandbox_domain}`, certificates from the fake's own CA.
    Tls,
    /// As `Tls`, through the `deploy/providers/e2b` plugin (E2B's own cloud): the key as
    /// `X-API-Key`, the upstreams from its `ABX_E2B_*` settings.
    E2bPlugin,
}

/// The built-in provider's key beside the plugin's: it must reach no upstream.
const BUILTIN_KEY: &str = "builtin-key-e2e-never-sent-0123";

/// The fake E2B cloud and, optionally, abx-proxy in front of it.
struct Rig {
    dir: tempfile::TempDir,
    fake: Proc,
    proxy: Option<Proc>,
    api: String,
    envd: String,
    proxy_url: String,
}

impl Rig {
    /// Starts the fake; with `proxy`, also abx-proxy in front of it.
    fn start(proxy: Option<Upstreams>) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("fake-ca.pem").display().to_string();
        let mut fake_args = vec!["--dummy-key", DUMMY_KEY];
        if matches!(proxy, Some(Upstreams::Tls | Upstreams::E2bPlugin)) {
            fake_args.extend(["--tls-ca-out", &ca]);
        }
        if proxy == Some(Upstreams::E2bPlugin) {
            fake_args.extend(["--key-in-x-api-key", "--forbid", BUILTIN_KEY]);
        }
        let (fake, ports) = start_fake("fake_e2b", REAL_KEY, &fake_args);
        let url = |k: &str| {
            let u = ports[k].as_str().map(str::to_string);
            u.unwrap_or_else(|| panic!("no {k} URL in {ports}\n{}", fake.output()))
        };
        let (api, envd) = (url("api"), url("envd"));
        let upstream_args = match proxy {
            None => Vec::new(),
            Some(Upstreams::Plain) => vec![
                "--sandbox-base-url".to_string(),
                api.clone(),
                "--sandbox-url".to_string(),
                envd.clone(),
            ],
            Some(Upstreams::Tls) => vec![
                "--sandbox-base-url".to_string(),
                url("tls_api"),
                "--sandbox-domain".to_string(),
                url("sandbox_domain"),
                "--upstream-ca".to_string(),
                ca.clone(),
            ],
            Some(Upstreams::E2bPlugin) => vec!["--upstream-ca".to_string(), ca.clone()],
        };
        let key_env = match proxy {
            Some(Upstreams::E2bPlugin) => vec![
                ("ABX_PROVIDER", "e2b".to_string()),
                ("ABX_E2B_API_KEY", REAL_KEY.to_string()),
                ("ABX_E2B_BASE_URL", url("tls_api")),
                ("ABX_E2B_ENVD_DOMAIN", url("sandbox_domain")),
                ("ABX_SANDBOX_API_KEY", BUILTIN_KEY.to_string()),
            ],
            _ => vec![("ABX_SANDBOX_API_KEY", REAL_KEY.to_string())],
        };
        let mut rig = Rig {
            dir,
            fake,
            proxy: None,
            api,
            envd,
            proxy_url: String::new(),
        };
        if proxy == Some(Upstreams::E2bPlugin) {
            install_e2b_plugin(rig.dir.path());
        }
        if proxy.is_some() {
            let mut cmd = e2e::abx(rig.dir.path());
            cmd.env("PATH", std::env::var_os("PATH").unwrap_or_default());
            cmd.envs(key_env);
            let args: Vec<&str> = upstream_args.iter().map(String::as_str).collect();
            let (proxy, addr) = e2e::serve(cmd, &args).unwrap_or_else(|e| panic!("{e}"));
            rig.proxy_url = format!("http://{addr}");
            rig.proxy = Some(proxy);
        }
        rig
    }

    fn report(&self) -> Value {
        fake_report(&self.api)
    }

    fn logs(&self) -> String {
        let mut s = self.fake.output();
        if let Some(p) = &self.proxy {
            s.push_str(&p.output());
        }
        s
    }
}

/// `abx-proxy provider install deploy/providers/e2b/abx-provider.toml` into the rig's
/// `ABX_HOME`.
fn install_e2b_plugin(root: &std::path::Path) {
    let manifest = repo().join("deploy/providers/e2b/abx-provider.toml");
    let mut cmd = e2e::abx(root);
    cmd.args(["provider", "install"]).arg(&manifest);
    let limit = Duration::from_secs(30);
    let (ok, log) = Proc::run_without_input("abx-proxy provider install", cmd, limit);
    assert!(ok, "abx-proxy provider install failed:\n{log}");
}

enum Sdk {
    Python(&'static str),
    Js(&'static str),
    /// `e2b-code-interpreter` in the py-latest venv.
    PythonCodeInterpreter,
    /// `@e2b/code-interpreter`.
    JsCodeInterpreter,
    /// Volumes, with e2b in the py-latest venv.
    PythonVolumes,
    /// Volumes, with the latest `e2b` JS package.
    JsVolumes,
}

/// Runs one SDK driver with `E2B_API_URL`/`E2B_SANDBOX_URL` set to the given URLs.
fn run_driver(rig: &Rig, sdk: &Sdk, api_url: &str, sandbox_url: &str) -> (bool, String) {
    let python =
        |venv: &str| -> OsString { e2e_dir().join(venv).join("bin").join("python").into() };
    let (name, program, script): (_, OsString, _) = match sdk {
        Sdk::Python(venv) => (
            format!("driver-{venv}"),
            python(venv),
            "tests/e2e/sdk_test.py",
        ),
        Sdk::Js(pkg) => (
            format!("driver-js-{pkg}"),
            "node".into(),
            "tests/e2e/sdk_test.mjs",
        ),
        Sdk::PythonCodeInterpreter => (
            "driver-code-interpreter".to_string(),
            python("py-latest"),
            "tests/e2e/code_interpreter_test.py",
        ),
        Sdk::JsCodeInterpreter => (
            "driver-js-code-interpreter".to_string(),
            "node".into(),
            "tests/e2e/code_interpreter_test.mjs",
        ),
        Sdk::PythonVolumes => (
            "driver-volumes".to_string(),
            python("py-latest"),
            "tests/e2e/volume_test.py",
        ),
        Sdk::JsVolumes => (
            "driver-js-volumes".to_string(),
            "node".into(),
            "tests/e2e/volume_test.mjs",
        ),
    };
    // `driver` keeps E2B_DOMAIN/E2B_DEBUG and HTTP(S)_PROXY of the caller out.
    let mut cmd = driver(program, rig.dir.path());
    cmd.arg(repo().join(script))
        .env("E2B_API_KEY", DUMMY_KEY)
        .env("E2B_API_URL", api_url)
        .env("E2B_SANDBOX_URL", sandbox_url)
        // As the README asks when volumes are used: their contents go where the API does.
        .env("E2B_VOLUME_API_URL", api_url);
    if let Sdk::Js(pkg) = sdk {
        cmd.env("E2B_JS_PACKAGE", pkg);
    }
    Proc::run(&name, cmd, DRIVER_TIMEOUT)
}

/// The fake with abx-proxy in front of it, and one driver's run through them.
fn through_proxy(sdk: &Sdk, upstreams: Upstreams) -> (Rig, Outcome) {
    deps();
    let rig = Rig::start(Some(upstreams));
    let run = run_driver(&rig, sdk, &rig.proxy_url, &rig.proxy_url);
    let run = Outcome::new(run, rig.report(), rig.logs());
    (rig, run)
}

/// The key in nothing the proxy printed, its drain and stop included.
fn key_not_logged(rig: &mut Rig) {
    let proxy_log = rig.proxy.as_mut().expect("the proxy").stopped_output();
    assert!(!proxy_log.contains(REAL_KEY), "the key in abx-proxy's log");
}

/// One SDK through the proxy: the driver passes, the fake saw no violation, and exactly
/// the requests the driver makes arrived, on the paths the proxy is meant to use, over
/// TLS where the upstreams are `https` (the control plane over HTTP/2, which it offers;
/// envd over HTTP/1.1, as SPEC §4 has it).
fn sdk_through_proxy(sdk: Sdk, upstreams: Upstreams) {
    let (mut rig, run) = through_proxy(&sdk, upstreams);

    // What every driver does: 1 create, 1 set_timeout, 1 get_info, 1 connect, 1 kill;
    // 4 commands, 2 uploads, 2 downloads, 3 health checks (the connected sandbox's after
    // the kill too), 1 ListDir; Python 2.64+ (py-latest) a second get_info, by an
    // `Authorization` header alone (no key). `/v2/…` create and
    // connect reach the upstream as `/sandboxes…` (compat_v2_paths = rewrite).
    // The e2b plugin passes `/v2/…` on: E2B's own cloud serves it.
    let (create, connect) = match upstreams {
        Upstreams::E2bPlugin => (
            "api POST /v2/sandboxes",
            "api POST /v2/sandboxes/{id}/connect",
        ),
        _ => ("api POST /sandboxes", "api POST /sandboxes/{id}/connect"),
    };
    let get_info = match sdk {
        Sdk::Python("py-latest") => 2,
        _ => 1,
    };
    let expected: &[(&str, u64)] = &[
        (create, 1),
        ("api POST /sandboxes/{id}/timeout", 1),
        ("api GET /sandboxes/{id}", get_info),
        (connect, 1),
        ("api DELETE /sandboxes/{id}", 1),
        ("envd POST /process.Process/Start", 4),
        ("envd POST /files", 2),
        ("envd GET /files", 2),
        ("envd GET /health", 3),
        ("envd POST /filesystem.Filesystem/ListDir", 1),
    ];
    run.assert_clean("through abx-proxy", expected);

    let dump = &run.dump;
    let log = run.report["log"].as_array().cloned().unwrap_or_default();
    // Every request the fake saw is in its log, the create among them: each is checked.
    assert_eq!(
        Some(log.len() as u64),
        run.report["requests"].as_u64(),
        "{dump}"
    );
    assert!(
        log.iter().any(|e| e["route"] == create),
        "no create in the fake's log\n{dump}"
    );
    for entry in &log {
        // The built-in provider's `/v1` create asks for a secure sandbox (Alibaba Cloud's
        // default is not); E2B's own cloud gets the SDK's `/v2` create as sent, which has
        // no such field.
        if entry["route"] == create {
            let secure = match upstreams {
                Upstreams::E2bPlugin => Value::Null,
                _ => Value::Bool(true),
            };
            assert_eq!(
                entry["secure"], secure,
                "create must reach the upstream with \"secure\": {secure}\n{dump}"
            );
        }
        if entry["plane"] == "envd" {
            assert!(
                entry["basic"].as_str().is_some(),
                "envd request without Authorization: Basic (the proxy adds `Basic dXNlcjo=`): {entry}\n{dump}"
            );
        }
        let tls = upstreams != Upstreams::Plain;
        let version = match (tls, entry["plane"].as_str()) {
            (true, Some("api")) => "HTTP/2.0",
            _ => "HTTP/1.1",
        };
        assert_eq!(
            (entry["tls"].as_bool(), entry["version"].as_str()),
            (Some(tls), Some(version)),
            "{entry}\n{dump}"
        );
    }

    key_not_logged(&mut rig);
}

#[test]
fn python_sdk_latest_through_proxy() {
    sdk_through_proxy(Sdk::Python("py-latest"), Upstreams::Plain);
}

#[test]
fn python_sdk_2_50_through_proxy() {
    sdk_through_proxy(Sdk::Python("py250"), Upstreams::Plain);
}

/// e2b 2.10-2.20: the connect carries envd's routing headers (it is the control plane's
/// all the same), and the connected sandbox's requests carry its token alone.
#[test]
fn python_sdk_2_20_through_proxy() {
    sdk_through_proxy(Sdk::Python("py220"), Upstreams::Plain);
}

#[test]
fn js_sdk_latest_through_proxy() {
    sdk_through_proxy(Sdk::Js("e2b"), Upstreams::Plain);
}

#[test]
fn js_sdk_2_50_through_proxy() {
    sdk_through_proxy(Sdk::Js("e2b-250"), Upstreams::Plain);
}

/// Production's shape: the latest SDKs with the proxy reaching an `https` control plane
/// and `https://{port}-{id}.{sandbox_domain}` envd.
#[test]
fn python_sdk_latest_through_proxy_to_tls_upstreams() {
    sdk_through_proxy(Sdk::Python("py-latest"), Upstreams::Tls);
}

#[test]
fn js_sdk_latest_through_proxy_to_tls_upstreams() {
    sdk_through_proxy(Sdk::Js("e2b"), Upstreams::Tls);
}

/// E2B's own cloud through the shipped `deploy/providers/e2b` plugin: the key as
/// `X-API-Key` (the fake refuses a Bearer), the built-in provider's key in no header.
#[test]
fn js_sdk_latest_through_the_e2b_plugin() {
    sdk_through_proxy(Sdk::Js("e2b"), Upstreams::E2bPlugin);
}

/// As above, with Python: e2b 2.64's `Authorization` header in place of a key must not
/// reach E2B's cloud beside the plugin's `X-API-Key`.
#[test]
fn python_sdk_latest_through_the_e2b_plugin() {
    sdk_through_proxy(Sdk::Python("py-latest"), Upstreams::E2bPlugin);
}

/// The code interpreter through the proxy: `run_code` streams its NDJSON back (the fake holds
/// the run until the client, on seeing its first line, makes a context), contexts are
/// made, listed and removed, on port 49999 of a sandbox that restricts public traffic. The
/// SDK's own `X-Access-Token` on `/execute` and its `E2B-Traffic-Access-Token` everywhere
/// pass as sent (the fake checks both); the proxy adds no token of its own on that port,
/// so `/contexts…`, which the SDKs send without one, arrive without one.
fn code_interpreter_through_proxy(sdk: Sdk, upstreams: Upstreams) {
    let (mut rig, run) = through_proxy(&sdk, upstreams);

    let expected: &[(&str, u64)] = &[
        ("api POST /sandboxes", 1),
        ("api DELETE /sandboxes/{id}", 1),
        ("jupyter POST /execute", 3),
        ("jupyter POST /contexts", 1),
        ("jupyter GET /contexts", 1),
        ("jupyter DELETE /contexts/{id}", 1),
    ];
    run.assert_clean("through abx-proxy", expected);

    let dump = &run.dump;
    let log = run.report["log"].as_array().cloned().unwrap_or_default();
    let tls = upstreams != Upstreams::Plain;
    for entry in log.iter().filter(|e| e["plane"] == "envd") {
        let execute = entry["route"] == "jupyter POST /execute";
        assert_eq!(
            entry["token"].as_bool(),
            Some(execute),
            "X-Access-Token on port 49999 only where the SDK sent it (/execute): {entry}\n{dump}"
        );
        assert_eq!(
            (entry["tls"].as_bool(), entry["version"].as_str()),
            (Some(tls), Some("HTTP/1.1")),
            "{entry}\n{dump}"
        );
    }
    key_not_logged(&mut rig);
}

#[test]
fn python_code_interpreter_through_proxy() {
    code_interpreter_through_proxy(Sdk::PythonCodeInterpreter, Upstreams::Plain);
}

/// Production's shape: the code interpreter at `https://49999-{id}.{sandbox_domain}`.
#[test]
fn js_code_interpreter_through_proxy_to_tls_upstreams() {
    code_interpreter_through_proxy(Sdk::JsCodeInterpreter, Upstreams::Tls);
}

/// Volumes through the proxy: made, looked up and destroyed on the control plane with the
/// key; their contents written, read and removed with the volume's own token, which the
/// proxy passes as sent (the fake refuses the key, real or dummy, there, and any token but
/// the volume's), with `E2B_VOLUME_API_URL` pointing at the proxy.
fn volumes_through_proxy(sdk: Sdk, upstreams: Upstreams) {
    let (mut rig, run) = through_proxy(&sdk, upstreams);
    let expected: &[(&str, u64)] = &[
        ("api POST /volumes", 1),
        ("api GET /volumes/{id}", 1),
        ("api DELETE /volumes/{id}", 1),
        ("api PUT /volumecontent/{id}/file", 1),
        ("api GET /volumecontent/{id}/file", 2),
        ("api DELETE /volumecontent/{id}/path", 1),
    ];
    run.assert_clean("through abx-proxy", expected);
    key_not_logged(&mut rig);
}

#[test]
fn python_volumes_through_proxy() {
    volumes_through_proxy(Sdk::PythonVolumes, Upstreams::Plain);
}

/// Production's shape: an `https` control plane offering HTTP/2.
#[test]
fn js_volumes_through_proxy_to_tls_upstreams() {
    volumes_through_proxy(Sdk::JsVolumes, Upstreams::Tls);
}

/// The fake has teeth: the SDK talking to it directly (dummy key as X-API-Key, no Bearer)
/// is refused and recorded, so a proxy that leaks the client's key cannot pass the tests.
#[test]
fn fake_refuses_the_sdk_without_the_proxy() {
    deps();
    let rig = Rig::start(None);
    let run = run_driver(&rig, &Sdk::Python("py-latest"), &rig.api, &rig.envd);
    Outcome::new(run, rig.report(), rig.logs()).assert_refused("X-API-Key");
}
