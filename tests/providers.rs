//! Plugin providers (SPEC §3) through the real binary: manifests installed with
//! `provider install`, each provider's key sent only to its own upstream (both upstreams
//! running, both asserted), consent for `[core] inherit`, and the command-line rules.

mod support;

use std::path::Path;
use std::process::Output;

use http::HeaderValue;
use http_body_util::BodyExt;
use support::*;

const OPENSANDBOX: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/providers/opensandbox/abx-provider.toml"
);
const E2B: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/providers/e2b/abx-provider.toml"
);
const OS_KEY: &str = "os-key-Hq7Lm2Np9Rs4Tv6W";
const OS_HEADER: &str = "open-sandbox-api-key";

/// A manifest that asks to inherit the built-in key.
const INHERITING: &str = r#"manifest_version = 1
[provider]
id = "borrower"
[endpoint]
base_url = "http://localhost:9"
auth.scheme = "header"
auth.header = "X-Borrower-Key"
[config.fields.api_key]
secret = true
env = ["BORROWER_KEY"]
[config.fields.base_url]
[core]
inherit = ["sandbox_api_key"]
"#;

/// A manifest for `auth.scheme = "bearer"`: the plugin's key as `Authorization: Bearer`.
const BEARER: &str = r#"manifest_version = 1
[provider]
id = "bearerco"
[endpoint]
base_url = "http://localhost:9"
auth.scheme = "bearer"
[config.fields.api_key]
secret = true
[config.fields.base_url]
"#;
const BEARER_KEY: &str = "bearer-key-Jk4Lm6Np8Qr2St5V";

/// `text` written to a temporary `abx-provider.toml`: the directory (keep it) and the path.
fn manifest_file(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("abx-provider.toml");
    std::fs::write(&path, text).expect("manifest");
    let path = path.display().to_string();
    (dir, path)
}

/// `abx-proxy <args>` in a cleared environment with `ABX_HOME=<home>/.abx`.
async fn abx(home: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
    cmd.env_clear()
        .env("HOME", home)
        .env("ABX_HOME", home.join(".abx"))
        .current_dir(home)
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    output_within(cmd, "abx-proxy to exit").await
}

/// `provider install <manifest>` into `home`, which must succeed: its output.
async fn install(home: &Path, manifest: &str) -> Output {
    let out = abx(home, &[], &["provider", "install", manifest]).await;
    assert!(out.status.success(), "{}", text(&out));
    out
}

/// A plugin's key copied with its scheme is warned about as the built-in key is, with the
/// header the plugin sends it in; the built-in key, unused beside a plugin, is not.
#[tokio::test]
async fn a_plugin_key_with_an_auth_scheme_is_warned_about() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    install(h, OPENSANDBOX).await;
    let bearer = format!("Bearer {OS_KEY}");
    let env = [
        ("ABX_PROVIDER", "opensandbox"),
        ("OPEN_SANDBOX_API_KEY", bearer.as_str()),
        ("ABX_OPENSANDBOX_BASE_URL", "http://127.0.0.1:9"),
        ("ABX_SANDBOX_API_KEY", "Bearer sk-builtin-0123456789"),
    ];
    let out = abx(h, &env, &["check", "--offline"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    let warning = format!(
        "the API key (from OPEN_SANDBOX_API_KEY in env) begins with `Bearer`, an auth \
         scheme: the proxy sends it whole as `{}: <key>`",
        OS_HEADER.to_ascii_uppercase()
    );
    assert!(said.contains(&warning), "{said}");
    assert_eq!(said.matches("the API key (from").count(), 1, "{said}");
    assert!(
        !said.contains(OS_KEY) && !said.contains("sk-builtin"),
        "{said}"
    );
}

/// The `config list --json` row of `key`.
fn row_of(rows: &[serde_json::Value], key: &str) -> serde_json::Value {
    rows.iter()
        .find(|r| r["key"] == key)
        .unwrap_or_else(|| panic!("no row {key}"))
        .clone()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A request carrying every kind of client credential. `/envd` paths also carry
/// `E2b-Sandbox-Id`, which a provider without an envd plane sends to its control plane.
async fn send_with_client_credentials(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut req = request("GET", addr, path)
        .header("x-api-key", "dummy")
        .header("authorization", "Bearer dummy")
        .header(OS_HEADER, "dummy");
    if path.starts_with("/envd") {
        req = req.header("e2b-sandbox-id", "isb-1");
    }
    let req = req.body(empty()).expect("request");
    let resp = send(addr, req).await;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_reaches_only_its_own_provider() {
    let pki = Pki::new();
    let alicloud = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ali") }).await;
    let opensandbox = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "os") }).await;

    // The plugin selected: its header and key, nothing else, and only to its upstream;
    // the built-in provider's envd address, left set, is not the plugin's.
    let proxy = ProxyCmd::new(&alicloud.url(), &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .env("ABX_SANDBOX_URL", Some(&alicloud.url()))
        .env("ABX_PROVIDER", Some("opensandbox"))
        .env("OPEN_SANDBOX_API_KEY", Some(OS_KEY))
        .env("ABX_OPENSANDBOX_BASE_URL", Some(&opensandbox.url()))
        .spawn()
        .await;
    for path in ["/v1/sandboxes", "/v2/sandboxes", "/envd/files"] {
        let (status, body) = send_with_client_credentials(proxy.addr(), path).await;
        assert_eq!(status, 200, "{body}");
    }
    proxy.finish().await;
    let seen = opensandbox.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.all(OS_HEADER), vec![OS_KEY.to_string()]);
        assert!(s.header("authorization").is_none(), "{:?}", s.headers);
        assert!(s.header("x-api-key").is_none());
        // No /v2 rewrite for a plugin, and no envd plane: the path is the client's.
        assert!(["/v1/sandboxes", "/v2/sandboxes", "/envd/files"].contains(&s.path_and_query()));
    }
    assert_not_sent(&seen, API_KEY, "the built-in key");
    assert_eq!(
        alicloud.connections(),
        0,
        "the built-in upstream was contacted"
    );

    // The built-in selected: the plugin's key, though in the environment, goes nowhere.
    let proxy = ProxyCmd::new(&alicloud.url(), &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .env("OPEN_SANDBOX_API_KEY", Some(OS_KEY))
        .env("ABX_OPENSANDBOX_API_KEY", Some(OS_KEY))
        .env("ABX_OPENSANDBOX_BASE_URL", Some(&opensandbox.url()))
        .spawn()
        .await;
    assert_eq!(
        send_with_client_credentials(proxy.addr(), "/sandboxes")
            .await
            .0,
        200
    );
    proxy.finish().await;
    let seen = alicloud.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].all("authorization"),
        vec![format!("Bearer {API_KEY}")]
    );
    // The client's own dummy in that header is its business; the real key never goes.
    assert_eq!(seen[0].all(OS_HEADER), vec!["dummy".to_string()]);
    assert_not_sent(&seen, OS_KEY, "the opensandbox key");
    assert_eq!(
        opensandbox.seen().len(),
        3,
        "nothing more reached the plugin upstream"
    );
}

/// What a browser keeps from an answer for its host or origin, beside cookies.
const HOST_STATE: [(&str, &str); 11] = [
    ("clear-site-data", "\"cookies\""),
    (
        "strict-transport-security",
        "max-age=31536000; includeSubDomains",
    ),
    ("alt-svc", "h2=\"localhost:8443\"; ma=86400"),
    ("nel", "{\"report_to\":\"app\",\"max_age\":86400}"),
    (
        "report-to",
        "{\"group\":\"app\",\"endpoints\":[{\"url\":\"https://evil.example/r\"}]}",
    ),
    ("reporting-endpoints", "app=\"https://evil.example/r\""),
    ("accept-ch", "Sec-CH-UA-Full-Version-List"),
    ("critical-ch", "Sec-CH-UA-Full-Version-List"),
    (
        "sec-session-registration",
        "(ES256 RS256);path=\"/dbsc\";challenge=\"c\"",
    ),
    (
        "secure-session-registration",
        "(ES256 RS256);path=\"/dbsc\";challenge=\"c\"",
    ),
    ("set-login", "logged-in"),
];

/// OpenSandbox's route to a sandbox's app through its server (`use_server_proxy`'s
/// endpoint) asks no key and hands the request to the app: the key stays out (the client's
/// own `Authorization` passes, its dummy does not), however the path spells the route, and
/// the app's page, served on the proxy's own origin, is sandboxed: its requests carry
/// `Origin: null`, refused. The browser's cookies there are every local site's (cookies
/// know no port): the app gets none, and leaves nothing a browser keeps for the host or
/// origin (cookies, HSTS, …). Paths the server cannot route to an app get the key, and
/// pass all of it both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_app_through_the_opensandbox_server_gets_no_key_and_a_sandboxed_page() {
    let pki = Pki::new();
    let opensandbox = Upstream::start(&pki, Proto::Http1, |_r| async {
        let mut resp = response(200, "<html>");
        let h = resp.headers_mut();
        h.append(
            "set-cookie",
            HeaderValue::from_static("grafana_session=planted; Path=/"),
        );
        h.append("set-cookie", HeaderValue::from_static("more=1"));
        for (name, value) in HOST_STATE {
            h.append(name, HeaderValue::from_static(value));
        }
        resp
    })
    .await;
    let proxy = ProxyCmd::new("http://127.0.0.1:9", &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .env("ABX_PROVIDER", Some("opensandbox"))
        .env("OPEN_SANDBOX_API_KEY", Some(OS_KEY))
        .env("ABX_OPENSANDBOX_BASE_URL", Some(&opensandbox.url()))
        .spawn()
        .await;
    let addr = proxy.addr();
    let get = |path: &'static str| async move {
        let req = request("GET", addr, path)
            .header("authorization", "Bearer app-token")
            .header(OS_HEADER, "dummy")
            .header("cookie", "grafana_session=LOCAL; jupyter=TOKEN")
            .body(empty())
            .expect("request");
        send(addr, req).await
    };
    const SANDBOXED: &str =
        "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads";
    // Any path that begins as the route does: the server asks the key for some (`..`, a
    // port that is no number) but may route them to the app all the same.
    let app = [
        "/v1/sandboxes/osb-1/proxy/3000/index.html",
        "/sandboxes/osb-1/proxy/3000",
        "/v1/sandboxes/osb-1/%70roxy/3000/",
        "/v1/%73andboxes/osb-1/proxy/80?x=1",
        "/v1/sandboxes/osb-1/proxy/3000/app..min.js",
        "/v1/sandboxes/osb-1/proxy/3000/a%3F..",
        "/v1/sandboxes/osb-1/proxy/web/",
    ];
    let keyed = [
        "/v1/sandboxes/osb-1",
        "/v1/sandboxes/osb-1/proxy",
        "/v1/sandboxes//proxy/3000/",
        "/v1/sandboxes/a%2Fb/proxy/3000/",
        "/v2/sandboxes/osb-1/proxy/3000/",
    ];
    for path in app.iter().chain(keyed.iter()) {
        let resp = get(path).await;
        assert_eq!(resp.status(), 200, "{path}");
        let csp = resp.headers().get("content-security-policy");
        let want = app.contains(path).then_some(SANDBOXED);
        assert_eq!(csp.map(|v| v.to_str().unwrap()), want, "{path}");
        let h = resp.headers();
        let set = h.get_all("set-cookie").iter().count();
        let kept = HOST_STATE.iter().filter(|(name, _)| h.contains_key(*name));
        let passed = if app.contains(path) { 0 } else { 2 };
        assert_eq!(set, passed, "{path}: {h:?}");
        let passed = if app.contains(path) {
            0
        } else {
            HOST_STATE.len()
        };
        assert_eq!(kept.count(), passed, "{path}: {h:?}");
    }
    // A sandboxed page's request, to the lifecycle API or to its own route.
    for path in ["/v1/sandboxes", "/v1/sandboxes/osb-1/proxy/3000/api"] {
        let req = request("POST", addr, path)
            .header("origin", "null")
            .body(empty())
            .expect("request");
        assert_eq!(send(addr, req).await.status(), 400, "{path}");
    }
    proxy.finish().await;
    let seen = opensandbox.seen();
    assert_eq!(seen.len(), app.len() + keyed.len(), "{seen:?}");
    for (s, path) in seen.iter().zip(app.iter().chain(keyed.iter())) {
        assert_eq!(s.path_and_query(), *path);
        if app.contains(path) {
            assert!(s.header(OS_HEADER).is_none(), "{path}: {:?}", s.headers);
            assert_eq!(s.all("authorization"), vec!["Bearer app-token"], "{path}");
            assert!(s.header("cookie").is_none(), "{path}: {:?}", s.headers);
        } else {
            assert_eq!(s.all(OS_HEADER), vec![OS_KEY.to_string()], "{path}");
            assert!(s.header("authorization").is_none(), "{path}");
            let cookie = vec!["grafana_session=LOCAL; jupyter=TOKEN"];
            assert_eq!(s.all("cookie"), cookie, "{path}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inherit_needs_consent_for_that_exact_manifest() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let (_dir, manifest) = manifest_file(INHERITING);
    let base = ("ABX_BORROWER_BASE_URL", upstream.url());

    // The install says what was not granted and how to grant it; with --consent, it says
    // consented and nothing more.
    for (consent, says, never) in [
        (false, "sandbox_api_key (NOT consented", Some("(consented)")),
        (true, "sandbox_api_key (consented)", None),
    ] {
        let home = tempfile::tempdir().expect("home");
        let mut args = vec!["provider", "install", manifest.as_str()];
        if consent {
            args.push("--consent");
        }
        let out = abx(home.path(), &[], &args).await;
        let said = text(&out);
        assert!(out.status.success(), "{said}");
        let note = "note: this provider asks to inherit sandbox_api_key; it was not granted.";
        assert!(said.contains(says), "{said}");
        assert_eq!(said.contains(note), !consent, "{said}");
        assert!(never.is_none_or(|n| !said.contains(n)), "{said}");
        if consent {
            // `config list` names the built-in key's variable beside the inherited key,
            // not the plugin's own, which nobody set.
            let env = [
                ("ABX_SANDBOX_API_KEY", API_KEY),
                ("ABX_PROVIDER", "borrower"),
            ];
            let out = abx(home.path(), &env, &["config", "list", "--json"]).await;
            let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
            let key = row_of(&rows, "borrower.api_key");
            assert_eq!(
                (key["source"].as_str(), key["env"].as_str()),
                (Some("env"), Some("ABX_SANDBOX_API_KEY"))
            );
            // The inherited key read from the built-in key's file: an error about it names
            // that flag (`--provider-option`, which it blamed, refuses secret fields).
            let file = home.path().join("key");
            std::fs::write(&file, "key-with-a-\u{1}-in-it\n").expect("key file");
            let path = file.display().to_string();
            let args = ["check", "--offline", "--sandbox-api-key-file", &path];
            let out = abx(home.path(), &[("ABX_PROVIDER", "borrower")], &args).await;
            let said = text(&out);
            assert_eq!(out.status.code(), Some(78), "{said}");
            let named = "[E1005] invalid value for borrower.api_key (--sandbox-api-key-file)";
            assert!(said.contains(named), "{said}");

            // A `./.env` selecting the plugin takes the built-in key to the plugin's hosts:
            // said, as a `./.env` that moves a host is; not for the plugin's own key, nor
            // for a selection made elsewhere.
            std::fs::write(home.path().join(".env"), "ABX_PROVIDER=borrower\n").expect(".env");
            let moved = "./.env in this directory sets ABX_PROVIDER=borrower: the credential \
                         from env goes to borrower's hosts";
            for (env, warned) in [
                (("ABX_SANDBOX_API_KEY", API_KEY), true),
                (("ABX_BORROWER_API_KEY", API_KEY), false),
                (("BORROWER_KEY", API_KEY), false),
            ] {
                let out = abx(home.path(), &[env], &["check", "--offline"]).await;
                let said = text(&out);
                assert_eq!(out.status.code(), Some(0), "{said}");
                assert_eq!(said.contains(moved), warned, "{env:?}: {said}");
            }
            std::fs::remove_file(home.path().join(".env")).expect("rm .env");
            let env = [
                ("ABX_SANDBOX_API_KEY", API_KEY),
                ("ABX_PROVIDER", "borrower"),
            ];
            let out = abx(home.path(), &env, &["check", "--offline"]).await;
            assert!(!text(&out).contains("goes there"), "{}", text(&out));
        }
    }

    // Installed without consent: no key for the plugin, so serve refuses to start.
    let (status, stderr) = ProxyCmd::new(&upstream.url(), &pki)
        .setup(&["provider", "install", &manifest])
        .env("ABX_PROVIDER", Some("borrower"))
        .env(base.0, Some(&base.1))
        .run_to_exit()
        .await;
    assert_eq!(status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("[E8003] provider borrower: api_key is not set"),
        "{stderr}"
    );
    // In the house format, with its suggestion line.
    let suggestion = "  Suggestion: `abx-proxy provider info borrower` lists its fields";
    assert!(stderr.contains(suggestion), "{stderr}");
    // And why the built-in key was not taken, with how to grant it.
    let why = "(its manifest asks to inherit sandbox_api_key, which was not consented to for \
               this manifest, or the manifest changed since: `abx-proxy provider install FILE \
               --consent` grants it)";
    assert!(stderr.contains(why), "{stderr}");

    // With consent: the built-in key is attached in the plugin's header.
    let proxy = ProxyCmd::new(&upstream.url(), &pki)
        .setup(&["provider", "install", &manifest, "--consent"])
        .env("ABX_PROVIDER", Some("borrower"))
        .env(base.0, Some(&base.1))
        .spawn()
        .await;
    assert_eq!(
        send_with_client_credentials(proxy.addr(), "/x").await.0,
        200
    );
    // A manifest changed after consent loses it (the receipt is bound to its hash).
    let installed = proxy
        .abx_home()
        .join("providers/borrower/abx-provider.toml");
    std::fs::write(
        &installed,
        INHERITING.replace("localhost:9", "localhost:10"),
    )
    .expect("edit");
    let home = proxy.abx_home().parent().expect("home").to_path_buf();
    let out = abx(
        &home,
        &[
            ("ABX_SANDBOX_API_KEY", API_KEY),
            ("ABX_PROVIDER", "borrower"),
        ],
        &["check", "--offline"],
    )
    .await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("api_key is not set"));
    assert!(text(&out).contains("or the manifest changed since"));
    proxy.finish().await;
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].all("x-borrower-key"), vec![API_KEY.to_string()]);
    assert!(seen[0].header("authorization").is_none());
}

/// `provider install` prints the manifest for the user to consent on. A description ending
/// in SGR conceal (`ESC [8m`) would hide the inherit list and the consent note after it on
/// xterm and VTE terminals: such a manifest is refused, with or without `--consent`, and
/// nothing of it reaches the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_that_would_hide_its_inherit_list_from_the_terminal_is_refused() {
    let home = tempfile::tempdir().expect("home");
    let (_dir, manifest) = manifest_file(&INHERITING.replace(
        "id = \"borrower\"\n",
        "id = \"borrower\"\ndescription = \"Borrower\\u001b[8m\"\n",
    ));
    for consent in [false, true] {
        let mut args = vec!["provider", "install", &manifest];
        if consent {
            args.push("--consent");
        }
        let out = abx(home.path(), &[], &args).await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(78), "{all}");
        assert!(
            all.contains(&format!(
                "[E8001] invalid provider manifest {manifest}:4: provider.description: control characters are not accepted"
            )),
            "{all}"
        );
        assert!(!all.contains('\u{1b}'), "{all:?}");
        assert!(
            !home.path().join(".abx/providers/borrower").exists(),
            "a refused manifest was installed"
        );
    }
}

/// A manifest without `[config.fields.api_key]` has no variable read as its key, and its
/// consented inherit nothing to stand in for: it used to install, "(consented)" and all,
/// and then never start. It is refused at install.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_without_an_api_key_field_is_not_installed_even_with_consent() {
    let home = tempfile::tempdir().expect("home");
    let field = "[config.fields.api_key]\nsecret = true\nenv = [\"BORROWER_KEY\"]\n";
    let without = INHERITING.replace(field, "");
    assert_ne!(without, INHERITING);
    let (_dir, manifest) = manifest_file(&without);
    let out = abx(
        home.path(),
        &[],
        &["provider", "install", &manifest, "--consent"],
    )
    .await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(78), "{all}");
    assert!(
        all.contains(&format!(
            "[E8001] invalid provider manifest {manifest}:8: missing [config.fields.api_key]"
        )),
        "{all}"
    );
    assert!(!all.contains("consented"), "{all}");
    assert!(
        !home.path().join(".abx/providers/borrower").exists(),
        "a refused manifest was installed"
    );
}

/// A provider id names a directory under `providers/`, never a path: a checkout's ./.env
/// must not be able to load a manifest (and a receipt of consent to the built-in key) kept
/// in the checkout itself. A manifest moved to another id's directory is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_id_is_a_name_not_a_path() {
    let home = tempfile::tempdir().expect("home");
    let (_dir, manifest) = manifest_file(INHERITING);
    let env = [("ABX_SANDBOX_API_KEY", API_KEY)];
    let out = abx(
        home.path(),
        &env,
        &["provider", "install", &manifest, "--consent"],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let installed = home.path().join(".abx/providers/borrower");
    let check = |provider: String| {
        let home = home.path().to_path_buf();
        async move {
            let env = [
                ("ABX_SANDBOX_API_KEY", API_KEY),
                ("ABX_PROVIDER", &provider),
            ];
            abx(&home, &env, &["check", "--offline"]).await
        }
    };
    assert!(check("borrower".into()).await.status.success());

    // The same files, consent receipt and all, outside providers/.
    let elsewhere = home.path().join("checkout-plugin");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    for file in ["abx-provider.toml", ".abx-install.json"] {
        std::fs::copy(installed.join(file), elsewhere.join(file)).expect("copy");
    }
    for id in [
        elsewhere.display().to_string(),
        "../../checkout-plugin".to_string(),
    ] {
        let out = check(id.clone()).await;
        assert_eq!(out.status.code(), Some(78), "{id}: {}", text(&out));
        assert!(text(&out).contains("[E8002]"), "{id}: {}", text(&out));
    }

    // Installed as one id, declaring another.
    std::fs::rename(&installed, installed.with_file_name("other")).expect("rename");
    let out = check("other".into()).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out).contains("declares id `borrower` but is installed as `other`"),
        "{}",
        text(&out)
    );
}

/// An installed manifest is read again at every reload, on the runtime that serves: one
/// replaced by a FIFO is refused at once (E1006, naming what it is), where its read waited
/// for a writer and held up the probes, the proxy port and SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installed_manifest_that_is_a_fifo_is_refused_not_waited_on() {
    let home = tempfile::tempdir().expect("home");
    install(home.path(), OPENSANDBOX).await;
    let manifest = home
        .path()
        .join(".abx/providers/opensandbox/abx-provider.toml");
    std::fs::remove_file(&manifest).expect("remove");
    mkfifo(&manifest);
    let env = [
        ("ABX_PROVIDER", "opensandbox"),
        ("OPEN_SANDBOX_API_KEY", OS_KEY),
    ];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out).contains("[E1006]") && text(&out).contains("not a regular file (a FIFO)"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains(OS_KEY), "{}", text(&out));

    // What the reload would refuse is not installed either: it installed, then nothing
    // could load it.
    let shipped = std::fs::read_to_string(OPENSANDBOX).expect("manifest");
    let (_dir, big) = manifest_file(&format!("{shipped}\n#{}\n", "x".repeat(1 << 20)));
    let fresh = tempfile::tempdir().expect("home");
    let out = abx(fresh.path(), &[], &["provider", "install", &big]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("larger than 1 MiB"), "{}", text(&out));
}

/// An install that cannot write its files says so, as E1006 "cannot write", with what to
/// check: it read "cannot read <dir>: cannot write", with the advice for a file to read.
/// (Tests may run as root, whom no directory refuses: an ABX_HOME that is a file stands in.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_that_cannot_write_says_so() {
    let home = tempfile::tempdir().expect("home");
    std::fs::write(home.path().join(".abx"), "").expect("a file where ~/.abx goes");
    let (_dir, manifest) = manifest_file(BEARER);
    let out = abx(home.path(), &[], &["provider", "install", &manifest]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    let said = text(&out);
    let dir = home.path().join(".abx/providers/bearerco");
    assert!(
        said.contains(&format!("[E1006] cannot write {}: ", dir.display())),
        "{said}"
    );
    assert!(said.contains("may write to the directory"), "{said}");
    assert!(!said.contains("cannot read"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_settings_canonical_first_secrets_never_on_the_command_line() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    let listing = text(&install(h, OPENSANDBOX).await);
    for needed in [
        "ABX_OPENSANDBOX_API_KEY",
        "OPEN_SANDBOX_API_KEY",
        "Inherits",
    ] {
        assert!(
            listing.contains(needed),
            "install output lacks {needed}:\n{listing}"
        );
    }

    let canonical = "canonical-key-0123456789-WXYZ";
    let alias = "alias-key-0123456789abcd-QRST";
    let env = [
        ("ABX_PROVIDER", "opensandbox"),
        ("ABX_OPENSANDBOX_API_KEY", canonical),
        ("OPEN_SANDBOX_API_KEY", alias),
        ("OPEN_SANDBOX_DOMAIN", "127.0.0.1:8081"),
    ];
    let out = abx(
        h,
        &env,
        &[
            "config",
            "list",
            "--json",
            "--provider-option",
            "base_url=127.0.0.1:9999",
        ],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let all = text(&out);
    assert!(
        !all.contains(canonical) && !all.contains(alias),
        "a raw key in the output"
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let row = |key: &str| row_of(&rows, key);
    let api_key = row("opensandbox.api_key");
    assert_eq!(api_key["value"], "****WXYZ", "the canonical name wins");
    assert_eq!(api_key["source"], "env");
    assert_eq!(api_key["env"], "ABX_OPENSANDBOX_API_KEY");
    assert_eq!(api_key["secret"], true);
    let base = row("opensandbox.base_url");
    assert_eq!(base["value"], "127.0.0.1:9999");
    assert_eq!(base["source"], "flag");
    // The credential row names the plugin's key and where that came from.
    let credential = row("credential");
    assert_eq!(
        (credential["value"].as_str(), credential["source"].as_str()),
        (Some("api_key"), Some("env"))
    );

    // The SDK's variables exported for the SDK (pointing it at the proxy, with a dummy
    // key) do not replace the canonical ones kept in ~/.abx/.env or config.toml.
    std::fs::write(
        h.join(".abx/.env"),
        format!("ABX_PROVIDER=opensandbox\nABX_OPENSANDBOX_API_KEY={canonical}\n"),
    )
    .expect("write .env");
    std::fs::write(
        h.join(".abx/config.toml"),
        "[providers.opensandbox]\nbase_url = \"127.0.0.1:8082\"\n\
         api_key = \"sk-toml-0123456789abcdef\"\nbase_ulr = \"typo\"\n",
    )
    .expect("write config.toml");
    let sdk_env = [
        ("OPEN_SANDBOX_API_KEY", "dummy"),
        ("OPEN_SANDBOX_DOMAIN", "127.0.0.1:49982"),
    ];
    let out = abx(h, &sdk_env, &["config", "list", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out));
    // A secret field and a misspelt one in the provider's table: each ignored, and said.
    let stderr = String::from_utf8_lossy(&out.stderr);
    for warning in [
        "secret field [providers.opensandbox] api_key ignored",
        "unknown field [providers.opensandbox] base_ulr ignored",
    ] {
        assert!(stderr.contains(warning), "{warning}: {stderr}");
    }
    assert!(!stderr.contains("sk-toml"), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let row = |key: &str| row_of(&rows, key);
    let api_key = row("opensandbox.api_key");
    assert_eq!(
        (api_key["value"].as_str(), api_key["source"].as_str()),
        (Some("****WXYZ"), Some("~/.abx/.env"))
    );
    let base = row("opensandbox.base_url");
    assert_eq!(
        (base["value"].as_str(), base["source"].as_str()),
        (Some("127.0.0.1:8082"), Some("~/.abx/config.toml"))
    );
    // With nothing canonical anywhere, the alias is what there is.
    std::fs::remove_file(h.join(".abx/config.toml")).expect("remove config.toml");
    let out = abx(h, &sdk_env, &["config", "get", "opensandbox.base_url"]).await;
    assert!(text(&out).contains("127.0.0.1:49982"), "{}", text(&out));
    // A key mistyped is told the keys there are, the plugin's among them.
    let out = abx(h, &sdk_env, &["config", "get", "opensandbox.nope"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("unknown key \"opensandbox.nope\"; keys: sandbox_api_key, ")
            && said.contains(", opensandbox.api_key, opensandbox.base_url, credential\n"),
        "{said}"
    );
    // And the row names the variable that gave it, not the canonical one nobody set.
    let out = abx(h, &sdk_env, &["config", "list", "--json"]).await;
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let base = row_of(&rows, "opensandbox.base_url");
    assert_eq!(
        (base["source"].as_str(), base["env"].as_str()),
        (Some("env"), Some("OPEN_SANDBOX_DOMAIN"))
    );

    // A secret field as --provider-option: refused, exit 2, the value not repeated; also
    // with a blank one after it (skipped, as a blank flag is: the secret stays in argv).
    for blank_after in [false, true] {
        let mut args = vec![
            "config",
            "list",
            "--provider-option",
            "api_key=sneaky-value-123",
        ];
        if blank_after {
            args.extend(["--provider-option", "api_key="]);
        }
        let out = abx(h, &env, &args).await;
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(!text(&out).contains("sneaky-value-123"));
    }

    // No key anywhere (and no consent to inherit one): no credential, said as unset, while
    // the fields that have values still show them.
    std::fs::remove_file(h.join(".abx/.env")).expect("remove .env");
    let out = abx(
        h,
        &[("ABX_PROVIDER", "opensandbox")],
        &["config", "list", "--json"],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let credential = row_of(&rows, "credential");
    assert_eq!(
        (credential["value"].as_str(), credential["source"].as_str()),
        (None, Some("unset")),
        "{credential}"
    );
    assert_eq!(row_of(&rows, "opensandbox.base_url")["source"], "default");

    let out = abx(h, &[], &["provider", "info", "opensandbox"]).await;
    assert!(out.status.success());
    assert!(text(&out).contains("Inherits:"), "{}", text(&out));
    let out = abx(h, &[], &["provider", "list"]).await;
    assert!(text(&out).contains("alicloud-express") && text(&out).contains("opensandbox"));
}

/// An installed plugin whose manifest cannot be read is said by `provider list` (it listed
/// only the built-in provider, without a word), and a manifest that is a dangling link is
/// E1006 naming it where the plugin is selected (it was E8002 "unknown provider", with a
/// suggestion to install what is installed).
#[tokio::test]
async fn a_broken_installed_manifest_is_said_not_left_out() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    let (_dir, manifest) = manifest_file(BEARER);
    install(h, &manifest).await;
    let path = h.join(".abx/providers/bearerco/abx-provider.toml");
    let shown = path.display().to_string();
    let selected = [
        ("ABX_PROVIDER", "bearerco"),
        ("ABX_BEARERCO_API_KEY", BEARER_KEY),
    ];
    let breakages: [(&str, &dyn Fn()); 3] = [
        ("a dangling link", &|| {
            std::os::unix::fs::symlink(h.join("nowhere"), &path).expect("link")
        }),
        ("a directory", &|| std::fs::create_dir(&path).expect("dir")),
        ("a FIFO", &|| {
            let made = std::process::Command::new("mkfifo").arg(&path).status();
            assert!(made.expect("mkfifo").success());
        }),
    ];
    for (kind, break_it) in breakages {
        std::fs::remove_file(&path).expect("remove the manifest");
        break_it();
        let out = abx(h, &[], &["provider", "list"]).await;
        let all = text(&out);
        assert!(out.status.success(), "{kind}: {all}");
        assert!(
            all.contains("warning: [E1006]") && all.contains(&shown) && all.contains(kind),
            "{kind}: {all}"
        );
        let out = abx(h, &selected, &["check", "--offline"]).await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(78), "{kind}: {all}");
        assert!(
            all.contains("[E1006]") && all.contains(&shown),
            "{kind}: {all}"
        );
        assert!(!all.contains(BEARER_KEY), "{all}");
        // Put back as the next breakage expects it.
        if kind == "a directory" {
            std::fs::remove_dir(&path).expect("remove the directory");
            std::fs::write(&path, BEARER).expect("manifest");
        }
    }
}

/// A manifest that is not UTF-8 is refused by `provider install` as a `.env` is, naming
/// the line: it was read lossily and installed with U+FFFD in place of its bytes. One
/// installed before that still loads, as it did (an upgrade must not stop the start).
#[tokio::test]
async fn a_manifest_that_is_not_utf8_is_refused_naming_its_line() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    let (dir, manifest) = manifest_file("");
    // A Latin-1 comment line: the 0xe9 of "café" is no UTF-8.
    let marked = BEARER.replace("[endpoint]", "# caf\u{1}\n[endpoint]");
    let bytes: Vec<u8> = (marked.into_bytes().into_iter())
        .map(|b| if b == 1 { 0xe9 } else { b })
        .collect();
    std::fs::write(&manifest, bytes).expect("manifest");
    let out = abx(h, &[], &["provider", "install", &manifest]).await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(78), "{all}");
    assert!(
        all.contains("[E1006]") && all.contains("not UTF-8 text (line 4)"),
        "{all}"
    );

    std::fs::write(&manifest, BEARER).expect("manifest");
    install(h, &manifest).await;
    let installed = h.join(".abx/providers/bearerco/abx-provider.toml");
    let with_latin1: Vec<u8> = (BEARER.replace("[endpoint]", "# caf\u{1}\n[endpoint]"))
        .into_bytes()
        .into_iter()
        .map(|b| if b == 1 { 0xe9 } else { b })
        .collect();
    std::fs::write(&installed, with_latin1).expect("an older install's copy");
    let selected = [
        ("ABX_PROVIDER", "bearerco"),
        ("ABX_BEARERCO_API_KEY", BEARER_KEY),
    ];
    let out = abx(h, &selected, &["check", "--offline"]).await;
    assert!(out.status.success(), "{}", text(&out));
    drop(dir);
}

/// A plugin's URL field printed by `config list|get` hid neither a password, nor a query
/// value, nor the plugin's own secret field put into it by `${VAR}` in a `.env` file.
#[tokio::test]
async fn a_plugins_url_field_is_printed_without_its_password_query_values_or_secret() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    let (_dir, manifest) = manifest_file(BEARER);
    install(h, &manifest).await;
    std::fs::write(
        h.join(".env"),
        format!(
            "ABX_PROVIDER=bearerco\nABX_BEARERCO_API_KEY={BEARER_KEY}\n\
             ABX_BEARERCO_BASE_URL=https://bob:pw-pk71@h.example/${{ABX_BEARERCO_API_KEY}}?sig=pk72\n"
        ),
    )
    .expect("write .env");
    let shown = "https://bob:****@h.example/****?sig=****";
    let out = abx(h, &[], &["config", "list", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(row_of(&rows, "bearerco.base_url")["value"], shown);
    let out = abx(h, &[], &["config", "get", "bearerco.base_url"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{shown}\n"));
    for args in [&["config", "list"][..], &["config", "list", "--json"][..]] {
        let out = abx(h, &[], args).await;
        let all = text(&out);
        assert!(!all.contains(BEARER_KEY) && !all.contains("pk7"), "{all}");
    }
}

/// A project's `./.env` line dotenvy cannot parse (`OPEN_SANDBOX_API_KEY=my key`, which
/// python-dotenv accepts) that sets a variable the selected plugin reads stops with the
/// E1006 a broken `ABX_` line gets, naming the file and line: skipped as another tool's, it
/// was followed by "api_key is not set: set … or OPEN_SANDBOX_API_KEY", hiding the real
/// problem. Another tool's broken line is still skipped with a warning, and with the
/// built-in provider the plugin's alias is another tool's variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_cwd_env_line_setting_a_plugins_variable_stops_naming_its_line() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    install(h, OPENSANDBOX).await;
    let plugin = [("ABX_PROVIDER", "opensandbox")];
    for dotenv in [
        "OPEN_SANDBOX_API_KEY=my key\n",
        "export OPEN_SANDBOX_DOMAIN\n",
        // The quote runs on: dotenvy's entry swallows the next line, which sets the alias.
        "NOTE=\"unterminated\nOPEN_SANDBOX_API_KEY=my-key\n",
    ] {
        std::fs::write(h.join(".env"), dotenv).expect("write ./.env");
        let out = abx(h, &plugin, &["check", "--offline"]).await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(78), "{dotenv:?}: {all}");
        assert!(
            all.contains("[E1006] cannot read ./.env") && all.contains("syntax error at line 1"),
            "{dotenv:?}: {all}"
        );
        assert!(
            !all.contains("skipped") && !all.contains("E8003"),
            "{dotenv:?}: {all}"
        );
        assert!(!all.contains("my key") && !all.contains("my-key"), "{all}");
    }

    std::fs::write(
        h.join(".env"),
        format!("GREETING=hello world\nOPEN_SANDBOX_API_KEY={OS_KEY}\n"),
    )
    .expect("write ./.env");
    let out = abx(h, &plugin, &["check", "--offline"]).await;
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("./.env") && all.contains("line 1 skipped"),
        "{all}"
    );
    assert!(!all.contains("hello") && !all.contains(OS_KEY), "{all}");

    std::fs::write(h.join(".env"), "OPEN_SANDBOX_API_KEY=my key\n").expect("write ./.env");
    let builtin = [("ABX_SANDBOX_API_KEY", API_KEY)];
    let out = abx(h, &builtin, &["check", "--offline"]).await;
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("line 1 skipped"), "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_manifests_are_refused_naming_file_and_line() {
    let home = tempfile::tempdir().expect("home");
    let good = std::fs::read_to_string(OPENSANDBOX).expect("shipped manifest");
    let line_of = |text: &str, needle: &str| {
        text.lines()
            .position(|l| l.contains(needle))
            .expect("needle")
            + 1
    };
    let cases: Vec<(String, &str)> = vec![
        (
            good.replace("manifest_version = 1", "manifest_version = 7"),
            "manifest_version",
        ),
        (
            good.replace("\"OPEN_SANDBOX_API_KEY\"", "\"ABX_SANDBOX_API_KEY\""),
            "ABX_SANDBOX_API_KEY",
        ),
        (
            good.replace("\"OPEN_SANDBOX_API_KEY\"", "\"E2B_API_KEY\""),
            "E2B_API_KEY",
        ),
        (
            good.replace("\"OPEN_SANDBOX_DOMAIN\"", "\"ALICLOUD_ACCESS_KEY_ID\""),
            "ALICLOUD_ACCESS_KEY_ID",
        ),
        (
            good.replace("secret = true", "secret = true\ndefault = \"k\""),
            "[config.fields.api_key]",
        ),
        // A misspelt key left the provider without an envd plane, silently.
        (
            good.replace(
                "base_url = \"http://localhost:8080\"",
                "base_url = \"http://localhost:8080\"\nenvd_domainn = \"sbx.example\"",
            ),
            "envd_domainn",
        ),
        // Checked as serve checks it, not first found when serve starts.
        (
            good.replace("http://localhost:8080", "ftp://localhost:8080"),
            "ftp://",
        ),
        // Its masked value failed the domain check, confusingly.
        (
            format!("{good}\n[config.fields.envd_domain]\nsecret = true\n"),
            "[config.fields.envd_domain]",
        ),
        // The key as `Host` chose the upstream's virtual host.
        (
            good.replace("\"OPEN-SANDBOX-API-KEY\"", "\"Host\""),
            "auth.header",
        ),
        // User info would move envd's connections to another host.
        (
            good.replace(
                "base_url = \"http://localhost:8080\"",
                "base_url = \"http://localhost:8080\"\nenvd_domain = \"sbx.example@127.0.0.1:1\"",
            ),
            "envd_domain",
        ),
        // An address is no domain: `49983-ID.127.0.0.1` resolves nowhere.
        (
            good.replace(
                "base_url = \"http://localhost:8080\"",
                "base_url = \"http://localhost:8080\"\nenvd_domain = \"127.0.0.1:9000\"",
            ),
            "envd_domain",
        ),
    ];
    for (i, (text_, needle)) in cases.iter().enumerate() {
        let path = home.path().join(format!("bad{i}.toml"));
        std::fs::write(&path, text_).expect("write");
        let out = abx(
            home.path(),
            &[],
            &["provider", "install", &path.display().to_string()],
        )
        .await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(78), "case {i}: {all}");
        let expected = format!(
            "[E8001] invalid provider manifest {}:{}",
            path.display(),
            line_of(text_, needle)
        );
        assert!(
            all.contains(&expected),
            "case {i}: wanted {expected:?} in {all}"
        );
    }
    assert!(
        !home.path().join(".abx/providers/opensandbox").exists(),
        "a refused manifest was installed"
    );

    // The same rule for the field that overrides it.
    install(home.path(), E2B).await;
    let env = [
        ("ABX_PROVIDER", "e2b"),
        ("ABX_E2B_API_KEY", "e2b-key"),
        ("ABX_E2B_ENVD_DOMAIN", "e2b.app@127.0.0.1:1"),
    ];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out).contains("[E1005] invalid value for e2b.envd_domain"),
        "{}",
        text(&out)
    );
    let env = [
        ("ABX_PROVIDER", "e2b"),
        ("ABX_E2B_API_KEY", "e2b-key"),
        ("ABX_E2B_ENVD_DOMAIN", "10.0.0.5:8080"),
    ];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out).contains("an address is no domain"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("sandbox_url"), "{}", text(&out));
}

/// The built-in provider's `./.env` rule for a plugin: a `./.env` that moves the plugin's
/// upstream while its key is kept elsewhere is said, naming the variable and where the key
/// comes from. And an invalid plugin field names the layer its value came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_upstream_moved_by_the_cwd_env_is_warned_about_and_errors_name_the_layer() {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir().expect("home");
    install(home.path(), E2B).await;
    let home_env = home.path().join(".abx/.env");
    std::fs::write(
        &home_env,
        "ABX_PROVIDER=e2b\nABX_E2B_API_KEY=e2b-key-in-home-7Qw\n",
    )
    .expect("write");
    std::fs::set_permissions(&home_env, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::write(
        home.path().join(".env"),
        "ABX_E2B_BASE_URL=https://elsewhere.example\nABX_E2B_ENVD_DOMAIN=elsewhere.example\n",
    )
    .expect("write");
    let out = abx(home.path(), &[], &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    for moved in [
        "ABX_E2B_BASE_URL=https://elsewhere.example",
        "ABX_E2B_ENVD_DOMAIN=elsewhere.example",
    ] {
        let said = format!(
            "./.env in this directory sets {moved}: the credential from ~/.abx/.env goes there"
        );
        assert!(text(&out).contains(&said), "{said}: {}", text(&out));
    }
    assert!(!text(&out).contains("e2b-key-in-home"), "{}", text(&out));

    // No key anywhere: nothing goes there, and that is said as its own error.
    std::fs::write(&home_env, "ABX_PROVIDER=e2b\n").expect("write");
    let out = abx(home.path(), &[], &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("api_key is not set"), "{}", text(&out));
    assert!(!text(&out).contains("goes there"), "{}", text(&out));
    std::fs::write(
        &home_env,
        "ABX_PROVIDER=e2b\nABX_E2B_API_KEY=e2b-key-in-home-7Qw\n",
    )
    .expect("write");

    let env = [("ABX_E2B_ENVD_DOMAIN", "e2b.app@127.0.0.1:1")];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out)
            .contains("[E1005] invalid value for e2b.envd_domain (ABX_E2B_ENVD_DOMAIN from env)"),
        "{}",
        text(&out)
    );

    // The plugin's key in one of its hosts: looked up in DNS in clear, refused by name.
    for (name, field) in [
        ("ABX_E2B_BASE_URL", "base_url"),
        ("ABX_E2B_ENVD_DOMAIN", "envd_domain"),
    ] {
        let value = match field {
            "base_url" => "https://e2b-key-in-home-7qw.example",
            _ => "e2b-key-in-home-7qw.example",
        };
        let out = abx(home.path(), &[(name, value)], &["check", "--offline"]).await;
        assert_eq!(out.status.code(), Some(78), "{}", text(&out));
        let said = format!("[E1005] invalid value for e2b.{field} ({name} from env)");
        assert!(
            text(&out).contains(&said) && text(&out).contains("holds a secret"),
            "{}",
            text(&out)
        );
        assert!(
            !text(&out).to_ascii_lowercase().contains("e2b-key-in-home"),
            "{}",
            text(&out)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_the_proxy_itself_is_refused() {
    // A shell set up for the OpenSandbox SDK points OPEN_SANDBOX_DOMAIN at the proxy; the
    // proxy reads the same variable as its upstream and would call itself forever.
    let pki = Pki::new();
    // The port is known before the proxy starts only as one bound and released, which a
    // concurrent test's listener can take in between: then the proxy cannot listen (E1008)
    // and never gets to the comparison, and another port is tried.
    for _ in 0..5 {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
            l.local_addr().expect("addr").port()
        };
        let (status, stderr) = ProxyCmd::new("https://127.0.0.1:9", &pki)
            .listen(&format!("127.0.0.1:{port}"))
            .setup(&["provider", "install", OPENSANDBOX])
            .env("ABX_PROVIDER", Some("opensandbox"))
            .env("OPEN_SANDBOX_API_KEY", Some(OS_KEY))
            .env("OPEN_SANDBOX_DOMAIN", Some(&format!("127.0.0.1:{port}")))
            .run_to_exit()
            .await;
        if stderr.contains("[E1008]") {
            continue;
        }
        assert_eq!(status.code(), Some(78), "{stderr}");
        assert!(
            stderr.contains("[E1005]") && stderr.contains("own listener"),
            "{stderr}"
        );
        assert!(!stderr.contains(OS_KEY));
        return;
    }
    panic!("five released ports were all taken before the proxy could listen");
}

/// A plugin's envd domain below `localhost` on the listener's port names the proxy itself:
/// envd requests called the proxy again, a connection each, until none was left. Refused
/// as the upstreams are, naming the plugin's field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_envd_domain_that_is_the_proxy_itself_is_refused() {
    let home = tempfile::tempdir().expect("home");
    install(home.path(), E2B).await;
    let env = [
        ("ABX_PROVIDER", "e2b"),
        ("ABX_E2B_API_KEY", "e2b_0a1b2c3d4e5f6a7b8c9d"),
        ("ABX_E2B_ENVD_DOMAIN", "localhost:49982"),
    ];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    let said = text(&out);
    let refused = "[E1005] invalid value for e2b.envd_domain (ABX_E2B_ENVD_DOMAIN from env): \
                   localhost:49982 names this proxy's own listener";
    assert!(said.contains(refused), "{said}");
    let env = [env[0], env[1], ("ABX_E2B_ENVD_DOMAIN", "localhost:49983")];
    let out = abx(home.path(), &env, &["check", "--offline"]).await;
    assert!(out.status.success(), "{}", text(&out));
}

/// SPEC §7 for a plugin: SIGHUP rotates the plugin's own key. A reload that would switch
/// the provider is refused: the running key stays with the upstream it belongs to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_a_plugin_key_and_never_switches_the_provider() {
    const OS_KEY2: &str = "os-key-two-Xy3Za5Bc7De9Fg";
    const OS_KEY3: &str = "os-key-three-Hj2Kl4Mn6Pq8";
    let pki = Pki::new();
    let alicloud = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ali") }).await;
    let opensandbox = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "os") }).await;
    let mut proxy = ProxyCmd::new(&alicloud.url(), &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .env("ABX_OPENSANDBOX_BASE_URL", Some(&opensandbox.url()))
        // Half a pair, which the built-in provider would pass over for its API key.
        .env("ALICLOUD_ACCESS_KEY_ID", Some("LTAI-half-a-pair"))
        .abx_file(
            ".env",
            &format!("ABX_PROVIDER=opensandbox\nOPEN_SANDBOX_API_KEY={OS_KEY}\n"),
        )
        .spawn()
        .await;
    // One request; the key the plugin upstream saw on it.
    let key_sent = |addr| {
        let opensandbox = &opensandbox;
        async move {
            let (status, body) = send_with_client_credentials(addr, "/sandboxes").await;
            assert_eq!(status, 200, "{body}");
            opensandbox.seen().last().map(|s| s.all(OS_HEADER))
        }
    };
    assert_eq!(key_sent(proxy.addr()).await, Some(vec![OS_KEY.to_string()]));

    let rotated = format!("ABX_PROVIDER=opensandbox\nOPEN_SANDBOX_API_KEY={OS_KEY2}\n");
    let line = proxy.reload_env(&rotated, "reloaded").await;
    assert!(line.contains("opensandbox.api_key"), "{line}");
    assert_eq!(
        key_sent(proxy.addr()).await,
        Some(vec![OS_KEY2.to_string()])
    );

    // The built-in provider's own settings beside it carry no plugin key: they neither
    // refuse the rotation nor wait for a restart (a restart would not apply them either).
    let beside = "ALIBABA_CLOUD_REGION_ID=cn-shanghai\nABX_SANDBOX_BASE_URL=http://127.0.0.1:9\n";
    let rotated = format!("{rotated}{beside}").replace(OS_KEY2, OS_KEY3);
    let line = proxy.reload_env(&rotated, "reloaded").await;
    assert_eq!(
        field(&line, "changed").as_deref(),
        Some("opensandbox.api_key")
    );
    assert_eq!(
        key_sent(proxy.addr()).await,
        Some(vec![OS_KEY3.to_string()])
    );
    let line = proxy
        .reload_env(&rotated.replace("cn-shanghai", "cn-beijing"), "reload")
        .await;
    assert!(line.contains("no setting changed"), "{line}");

    // An edited manifest that attaches the key otherwise is said at once, not found out
    // at the next rotation.
    let manifest = proxy
        .abx_home()
        .join("providers/opensandbox/abx-provider.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace("OPEN-SANDBOX-API-KEY", "X-Other-Key"),
    )
    .expect("edit");
    proxy.signal("HUP");
    let line = proxy.wait_for_line("reload").await;
    assert!(
        line.contains("reload refused") && line.contains("auth"),
        "{line}"
    );
    std::fs::write(&manifest, text).expect("restore");
    let line = proxy
        .reload_env(&rotated.replace(OS_KEY3, OS_KEY2), "reload")
        .await;
    assert!(line.contains("reloaded"), "{line}");

    // Back to the built-in provider (its key is in the environment): refused, and nothing
    // is said of the built-in credential as in use.
    let builtin = format!("OPEN_SANDBOX_API_KEY={OS_KEY2}\n");
    let line = proxy.reload_env(&builtin, "reload refused").await;
    assert!(line.contains("provider"), "{line}");
    assert!(
        !proxy.stderr().contains("using the API key"),
        "{}",
        proxy.stderr()
    );
    assert_eq!(
        key_sent(proxy.addr()).await,
        Some(vec![OS_KEY2.to_string()])
    );
    let stderr = proxy.finish().await;
    assert_eq!(
        alicloud.connections(),
        0,
        "the built-in upstream was contacted"
    );
    // The plugin's key is its credential: swapped, never listed as waiting for a restart.
    let restart: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("next restart"))
        .collect();
    assert!(restart.is_empty(), "{restart:?}");
    for key in [OS_KEY, OS_KEY2, OS_KEY3, API_KEY] {
        assert!(!stderr.contains(key), "a key value in the log");
    }
}

/// A reload refused because it would select a plugin provider says nothing of that
/// provider as selected: the built-in one keeps running, and reads its own flags. (It
/// said `--sandbox-base-url is for the built-in provider, and provider opensandbox is
/// selected: it is not read`, the start's warning of the settings it refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_switch_to_a_plugin_is_not_said_to_be_selected() {
    let pki = Pki::new();
    let alicloud = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ali") }).await;
    let mut proxy = ProxyCmd::new(&alicloud.url(), &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .spawn()
        .await;
    assert_eq!(
        send_with_client_credentials(proxy.addr(), "/sandboxes").await,
        (200, "ali".to_string())
    );
    let plugin = format!("ABX_PROVIDER=opensandbox\nOPEN_SANDBOX_API_KEY={OS_KEY}\n");
    let line = proxy.reload_env(&plugin, "reload refused").await;
    assert!(line.contains("provider"), "{line}");
    assert_eq!(
        send_with_client_credentials(proxy.addr(), "/sandboxes").await,
        (200, "ali".to_string())
    );
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("is selected"), "{stderr}");
}

/// A plugin's key rotated in a `.env` file while the environment still decides it is
/// said, as the built-in key is: "no setting changed" alone hid that the file's key is not
/// the one in use. By either of its variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_key_rotated_under_one_the_environment_decides_is_said() {
    let pki = Pki::new();
    let opensandbox = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "os") }).await;
    let mut proxy = ProxyCmd::new(&opensandbox.url(), &pki)
        .setup(&["provider", "install", OPENSANDBOX])
        .env("ABX_PROVIDER", Some("opensandbox"))
        .env("ABX_OPENSANDBOX_BASE_URL", Some(&opensandbox.url()))
        .env("ABX_OPENSANDBOX_API_KEY", Some(OS_KEY))
        .abx_file(".env", "OPEN_SANDBOX_API_KEY=os-key-file-one-0123456\n")
        .spawn()
        .await;
    for rotated in [
        "OPEN_SANDBOX_API_KEY=os-key-file-two-0123456\n",
        "ABX_OPENSANDBOX_API_KEY=os-key-file-two-0123456\n",
    ] {
        let line = proxy
            .reload_env(rotated, "a .env file changed a credential")
            .await;
        assert!(
            line.contains(&format!(
                "opensandbox.api_key in ~/.abx/.env ({}) (env wins)",
                proxy.abx_home().join(".env").display()
            )),
            "{line}"
        );
    }
    let (status, _) = send_with_client_credentials(proxy.addr(), "/sandboxes").await;
    assert_eq!(status, 200);
    assert_eq!(
        opensandbox.seen().last().map(|s| s.all(OS_HEADER)),
        Some(vec![OS_KEY.to_string()])
    );
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("os-key-file"), "a key value in the log");
}

/// A plugin field beside the key, that only a restart applies: changed with a key
/// rotation it is said to wait for the restart; changed back it is not (it is what the
/// process runs on), nor is it a change again at the next reload. Plugin fields were
/// measured from the running settings, which the key's swap brought up to date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_field_changed_with_the_key_and_back_is_not_said_to_wait_for_a_restart() {
    const MANIFEST: &str = r#"manifest_version = 1
[provider]
id = "zoned"
[endpoint]
base_url = "http://localhost:9"
auth.scheme = "header"
auth.header = "X-Zoned-Key"
[config.fields.api_key]
secret = true
[config.fields.base_url]
[config.fields.zone]
default = "a"
"#;
    const KEY1: &str = "zoned-key-one-Bc3De5Fg7Hj";
    const KEY2: &str = "zoned-key-two-Kl2Mn4Pq6Rs";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let (_dir, manifest) = manifest_file(MANIFEST);
    let key = |k: &str| format!("ABX_ZONED_API_KEY={k}\n");
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .setup(&["provider", "install", &manifest])
        .env("ABX_PROVIDER", Some("zoned"))
        .env("ABX_ZONED_BASE_URL", Some(&upstream.url()))
        .abx_file(".env", &key(KEY1))
        .spawn()
        .await;
    let restart_lines = |stderr: &str| {
        (stderr.lines())
            .filter(|l| l.contains("apply at the next restart"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let moved = format!("{}ABX_ZONED_ZONE=b\n", key(KEY2));
    let line = proxy.reload_env(&moved, "apply at the next restart").await;
    assert!(line.contains("zoned.zone"), "{line}");
    // Back to the zone it started with, the rotated key kept.
    let line = proxy.reload_env(&key(KEY2), "reloaded").await;
    assert!(
        line.contains("credential is unchanged") && line.contains("zoned.zone"),
        "{line}"
    );
    let line = proxy.reload_env(&key(KEY2), "reload").await;
    assert!(line.contains("no setting changed"), "{line}");
    // A zone changed without the key: said, once; the same file again is no change.
    let zone_c = format!("{}ABX_ZONED_ZONE=c\n", key(KEY2));
    let line = proxy.reload_env(&zone_c, "apply at the next restart").await;
    assert!(line.contains("zoned.zone"), "{line}");
    let line = proxy.reload_env(&zone_c, "reload").await;
    assert!(line.contains("no setting changed"), "{line}");
    let (status, body) = send_with_client_credentials(proxy.addr(), "/x").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        upstream.seen().last().map(|s| s.all("x-zoned-key")),
        Some(vec![KEY2.to_string()])
    );
    let stderr = proxy.finish().await;
    assert_eq!(restart_lines(&stderr).len(), 2, "{stderr}");
    assert!(!stderr.contains("zoned-key-"), "a key value in the log");
}

/// A plugin that inherits the built-in key from the environment, and whose own key in a
/// `.env` file is removed: the reload applies the inherited key, and says nothing of a
/// file's key that a higher level decides (the file's own key had been the one in use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_own_key_removed_from_a_file_gives_way_to_the_inherited_one() {
    const OWN: &str = "borrower-own-key-Lm4Np6Qr8St";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let (_dir, manifest) = manifest_file(INHERITING);
    let mut proxy = ProxyCmd::new(&upstream.url(), &pki)
        .setup(&["provider", "install", &manifest, "--consent"])
        .env("ABX_PROVIDER", Some("borrower"))
        .env("ABX_BORROWER_BASE_URL", Some(&upstream.url()))
        .abx_file(".env", &format!("ABX_BORROWER_API_KEY={OWN}\n"))
        .spawn()
        .await;
    let key_sent = |addr| {
        let upstream = &upstream;
        async move {
            let (status, body) = send_with_client_credentials(addr, "/x").await;
            assert_eq!(status, 200, "{body}");
            upstream.seen().last().map(|s| s.all("x-borrower-key"))
        }
    };
    assert_eq!(key_sent(proxy.addr()).await, Some(vec![OWN.to_string()]));
    let line = proxy.reload_env("", "reloaded").await;
    assert!(line.contains("borrower.api_key"), "{line}");
    // The inherited key's source, read with the plugin's manifest on the reading thread.
    assert!(line.contains("credential=api_key from env"), "{line}");
    assert_eq!(
        key_sent(proxy.addr()).await,
        Some(vec![API_KEY.to_string()])
    );
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("higher level"), "{stderr}");
}

/// A flag only the built-in provider reads, given with a plugin selected, was ignored
/// without a word: `--sandbox-base-url` did not move the plugin's key. Said, naming the
/// flag (a wrapper may pass the same flags whatever the provider: not an error); the same
/// setting from the environment is left unread and unsaid, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_in_only_flag_with_a_plugin_is_said_to_be_unread() {
    let home = tempfile::tempdir().expect("home");
    let out = abx(home.path(), &[], &["provider", "install", OPENSANDBOX]).await;
    assert!(out.status.success(), "{}", text(&out));
    let env = [
        ("ABX_PROVIDER", "opensandbox"),
        ("ABX_OPENSANDBOX_API_KEY", OS_KEY),
        ("ALIBABA_CLOUD_REGION_ID", "cn-beijing"),
    ];
    // Not read, so not judged either: a value meant for the built-in provider (or none
    // it would take) stops no plugin.
    let env = [
        env[0],
        env[1],
        ("ALIBABA_CLOUD_REGION_ID", "not a region"),
        ("ABX_TOKEN_EXCHANGE", "none-such"),
        ("ALICLOUD_ACCESS_KEY_ID", "LTAI-unused"),
    ];
    let args = [
        "check",
        "--offline",
        "--sandbox-base-url",
        "http://127.0.0.1:9",
        "--compat-v2-paths",
        "pass",
        "--token-refresh-before",
        "1",
    ];
    let out = abx(home.path(), &env, &args).await;
    assert!(out.status.success(), "{}", text(&out));
    let said: Vec<String> = text(&out)
        .lines()
        .filter(|l| l.contains("is for the built-in provider"))
        .map(str::to_string)
        .collect();
    assert_eq!(said.len(), 3, "{said:?}");
    let flags = [
        "--sandbox-base-url",
        "--token-refresh-before",
        "--compat-v2-paths",
    ];
    for (line, flag) in said.iter().zip(flags) {
        assert!(
            line.starts_with(&format!(
                "warning: {flag} is for the built-in provider, and provider opensandbox is \
                 selected: it is not read"
            )),
            "{line}"
        );
    }
}

/// `check` probes a plugin's control plane with the plugin's own header, as the proxy
/// would send it, and judges the answer: 401 or 403 is the key refused (E1009, exit 78);
/// 500 and above, 429 (throttling) and a redirect (which the proxy would hand the SDKs) are
/// a control plane reached but not serving (E5001, exit 69); anything else, a 404
/// included, is a control plane that heard the key (exit 0), a 404 with a warning that
/// the base URL's path may be wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probes_with_the_providers_header_and_judges_the_answer() {
    let pki = Pki::new();
    let opensandbox = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "[]") }).await;
    let home = tempfile::tempdir().expect("home");
    let ca = pki.ca_pem.display().to_string();
    let run = |base: String| {
        let (home, ca) = (home.path().to_path_buf(), ca.clone());
        async move {
            let env = [
                ("ABX_PROVIDER", "opensandbox"),
                ("OPEN_SANDBOX_API_KEY", OS_KEY),
                ("ABX_OPENSANDBOX_BASE_URL", base.as_str()),
            ];
            abx(&home, &env, &["check", "--upstream-ca", &ca]).await
        }
    };
    install(home.path(), OPENSANDBOX).await;

    let out = run(opensandbox.url()).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let seen = opensandbox.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].all(OS_HEADER), vec![OS_KEY.to_string()]);
    assert!(
        seen[0].header("authorization").is_none(),
        "{:?}",
        seen[0].headers
    );

    for (status, exit, code) in [
        (401, 78, Some("[E1009]")),
        (403, 78, Some("[E1009]")),
        (404, 0, None),
        (301, 69, Some("[E5001]")),
        (429, 69, Some("[E5001]")),
        (500, 69, Some("[E5001]")),
        (503, 69, Some("[E5001]")),
    ] {
        let answering = Upstream::start(&pki, Proto::Http1, move |_r| async move {
            response(status, "no")
        })
        .await;
        let out = run(answering.url()).await;
        let said = text(&out);
        assert_eq!(out.status.code(), Some(exit), "{status}: {said}");
        // Not a setting of the built-in provider's: the plugin's base URL is in force.
        if status == 301 {
            let redirect = "a redirect: the base URL is not the API's own address";
            assert!(
                said.contains(redirect) && !said.contains("sandbox_base_url"),
                "{said}"
            );
            // Retrying cannot mend a wrong address.
            let suggestion = "  Suggestion: Set the base URL to the API's own address";
            assert!(
                said.contains(suggestion) && !said.contains("retry"),
                "{said}"
            );
        }
        match code {
            Some(code) => assert!(
                said.contains(code) && said.contains(&status.to_string()),
                "{status}: {said}"
            ),
            None => assert!(
                said.contains(&format!("answered {status}")) && said.contains("\nok"),
                "{status}: {said}"
            ),
        }
        let nothing_there = format!("warning: nothing at {}/sandboxes: ", answering.url());
        assert_eq!(
            said.contains(&nothing_there),
            status == 404,
            "{status}: {said}"
        );
        assert!(!said.contains(OS_KEY), "{said}");
        assert_eq!(answering.seen().len(), 1, "{status}");
    }
}

/// SPEC §2–§3: `[core] provider` in config.toml selects a plugin and `[providers.<id>]`
/// sets its non-secret fields, for `serve` and `config list` alike; a manifest with
/// `auth.scheme = "bearer"` sends `Authorization: Bearer <its key>`, once, in place of
/// every client credential, and the built-in key goes nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_plugin_chosen_in_config_toml_gets_its_key_and_base_url() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let (_dir, manifest) = manifest_file(BEARER);
    let toml = format!(
        "[core]\nprovider = \"bearerco\"\n\n[providers.bearerco]\nbase_url = \"{}\"\n",
        upstream.url()
    );
    let cmd = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .setup(&["provider", "install", &manifest])
        .env("ABX_BEARERCO_API_KEY", Some(BEARER_KEY))
        .abx_file("config.toml", &toml);
    let env = cmd.env_vars();
    let proxy = cmd.spawn().await;
    let (status, body) = send_with_client_credentials(proxy.addr(), "/sandboxes").await;
    assert_eq!(status, 200, "{body}");
    let config = proxy.config_list(&env).await;
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(BEARER_KEY), "the plugin key in the log");

    for (key, value) in [
        ("provider", "bearerco".into()),
        ("bearerco.base_url", upstream.url()),
    ] {
        assert_eq!(config[key]["value"], value, "{key}");
        assert_eq!(config[key]["source"], "~/.abx/config.toml", "{key}");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].all("authorization"),
        vec![format!("Bearer {BEARER_KEY}")]
    );
    assert!(
        seen[0].header("x-api-key").is_none(),
        "{:?}",
        seen[0].headers
    );
    assert_not_sent(&seen, API_KEY, "the built-in key");
}

/// SPEC §3: a plugin allowed to inherit the built-in key (consent given) that has an
/// `api_key` of its own uses its own, even from a lower level (`~/.abx/.env`) than the
/// built-in key (the environment), in `serve` and in `config list`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_own_key_beats_the_inherited_one() {
    const OWN_KEY: &str = "borrower-own-key-Pq3Rs5Tu7W";
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let (_dir, manifest) = manifest_file(INHERITING);
    let cmd = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .setup(&["provider", "install", &manifest, "--consent"])
        .env("ABX_PROVIDER", Some("borrower"))
        .env("ABX_BORROWER_BASE_URL", Some(&upstream.url()))
        .abx_file(".env", &format!("ABX_BORROWER_API_KEY={OWN_KEY}\n"));
    let env = cmd.env_vars();
    let proxy = cmd.spawn().await;
    assert_eq!(
        send_with_client_credentials(proxy.addr(), "/x").await.0,
        200
    );
    let config = proxy.config_list(&env).await;
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(OWN_KEY), "the plugin key in the log");

    let row = &config["borrower.api_key"];
    assert_eq!(
        row["value"],
        format!("****{}", &OWN_KEY[OWN_KEY.len() - 4..])
    );
    assert_eq!(row["source"], "~/.abx/.env");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].all("x-borrower-key"), vec![OWN_KEY.to_string()]);
    assert_not_sent(&seen, API_KEY, "the inherited built-in key");
}

/// SPEC §3–§4 with the shipped `deploy/providers/e2b` manifest, installed and selected as
/// its comment says: the SDK's dummy `X-API-Key` (and any `Authorization`) is replaced by
/// the real key as exactly one `X-API-Key` on the control plane, also on the proxy's own
/// envd-token look-up; envd gets the sandbox's token and never the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_e2b_manifest_sends_the_key_as_one_x_api_key() {
    const E2B_KEY: &str = "e2b_4f6a8c0e2b4d6f8a0c2e4a6c";
    // One upstream plays both planes: the control plane at 127.0.0.1, envd at
    // `49983-isb-1.localhost` (the manifest's envd_domain moved there by its field).
    let pki = Pki::with_names(&["127.0.0.1", "49983-isb-1.localhost"]);
    let upstream = Upstream::start(&pki, Proto::Http1, |req| async move {
        match req.uri().path() {
            "/sandboxes/isb-1" => {
                let sandbox = serde_json::json!({"sandboxID": "isb-1", "envdAccessToken": "tok-1"});
                response(200, sandbox.to_string())
            }
            _ => response(200, "ok"),
        }
    })
    .await;
    let envd_domain = format!("localhost:{}", upstream.addr.port());
    let proxy = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .setup(&["provider", "install", E2B])
        .env("ABX_PROVIDER", Some("e2b"))
        .env("ABX_E2B_API_KEY", Some(E2B_KEY))
        // A shell set up for the SDK has its dummy here; the manifest never reads it.
        .env("E2B_API_KEY", Some("e2b_dummy"))
        .env("ABX_E2B_BASE_URL", Some(&upstream.url()))
        .env("ABX_E2B_ENVD_DOMAIN", Some(&envd_domain))
        .spawn()
        .await;
    for path in ["/sandboxes", "/envd/health"] {
        let (status, body) = send_with_client_credentials(proxy.addr(), path).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let stderr = proxy.finish().await;
    assert!(!stderr.contains(E2B_KEY), "the plugin key in the log");

    let all = upstream.seen();
    assert_not_sent(&all, API_KEY, "the built-in key");
    let (envd, api): (Vec<Seen>, Vec<Seen>) = all
        .into_iter()
        .partition(|s| s.host().starts_with("49983-isb-1.localhost"));
    // The client's request, then the proxy's token look-up for the envd one.
    let paths: Vec<&str> = api.iter().map(Seen::path_and_query).collect();
    assert_eq!(paths, ["/sandboxes", "/sandboxes/isb-1"]);
    for s in &api {
        assert_eq!(s.all("x-api-key"), vec![E2B_KEY.to_string()], "{s:?}");
        assert!(s.header("authorization").is_none(), "{s:?}");
    }
    assert_eq!(envd.len(), 1);
    assert_eq!(envd[0].header("x-access-token"), Some("tok-1"));
    assert!(envd[0].header("x-api-key").is_none(), "{:?}", envd[0]);
    assert_not_sent(&envd, E2B_KEY, "the e2b key");
}

/// Two plugins whose secret fields have one canonical name (`acme`'s `admin_api_key` and
/// `acme-admin`'s `api_key` are both `ABX_ACME_ADMIN_API_KEY`): the second install is
/// refused, either way round, as `acme-admin` selected sent `acme`'s admin key to its own
/// host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_field_named_as_another_plugins_secret_is_refused() {
    let acme = BEARER
        .replace("id = \"bearerco\"", "id = \"acme\"")
        .replace(
        "[config.fields.api_key]\nsecret = true\n",
        "[config.fields.api_key]\nsecret = true\n[config.fields.admin_api_key]\nsecret = true\n",
    );
    let admin = BEARER.replace("id = \"bearerco\"", "id = \"acme-admin\"");
    for (first, second) in [(&acme, &admin), (&admin, &acme)] {
        let home = tempfile::tempdir().expect("home");
        let (_a, first) = manifest_file(first);
        let (_b, second) = manifest_file(second);
        install(home.path(), &first).await;
        let out = abx(home.path(), &[], &["provider", "install", &second]).await;
        assert_eq!(out.status.code(), Some(78), "{}", text(&out));
        assert!(
            text(&out).contains("variable ABX_ACME_ADMIN_API_KEY holds a secret of provider"),
            "{}",
            text(&out)
        );
    }
}

/// A plain field reading another plugin's key is refused when settings are read, not only
/// by `provider install`: a manifest placed by hand (or installed before the check) would
/// show the key in clear and, as `base_url`, look it up and send to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_field_reading_another_plugins_key_is_refused_at_run_time() {
    let home = tempfile::tempdir().expect("home");
    let h = home.path();
    let (_d, owner) = manifest_file(&BEARER.replace(
        "[config.fields.api_key]\nsecret = true\n",
        "[config.fields.api_key]\nsecret = true\nenv = [\"VENDOR_KEY\"]\n",
    ));
    install(h, &owner).await;
    let reader = h.join(".abx/providers/reader");
    std::fs::create_dir_all(&reader).expect("mkdir");
    std::fs::write(
        reader.join("abx-provider.toml"),
        BEARER
            .replace("id = \"bearerco\"", "id = \"reader\"")
            .replace(
                "[config.fields.base_url]\n",
                "[config.fields.base_url]\nenv = [\"VENDOR_KEY\"]\n",
            ),
    )
    .expect("placed by hand");
    let env = [
        ("ABX_PROVIDER", "reader"),
        ("ABX_READER_API_KEY", "reader-key-Zq4Lm6Np8"),
        ("VENDOR_KEY", "vendor-key-Zq5Rs7Tv9"),
    ];
    for args in [&["check", "--offline"][..], &["config", "list"][..]] {
        let out = abx(h, &env, args).await;
        let all = text(&out);
        assert!(!all.contains("vendor-key-Zq5"), "{args:?}: {all}");
        assert!(
            all.contains("[E8001]")
                && all.contains("variable VENDOR_KEY holds a secret of provider bearerco"),
            "{args:?}: {all}"
        );
    }
    let out = abx(h, &env, &["check", "--offline"]).await;
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    // The owner of the key does nothing wrong: selected, it starts.
    let owner = [
        ("ABX_PROVIDER", "bearerco"),
        ("VENDOR_KEY", "vendor-key-Zq5Rs7Tv9"),
    ];
    let out = abx(h, &owner, &["check", "--offline"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("[E8001]"), "{}", text(&out));
}
