//! End-to-end gate for the OpenSandbox plugin provider: the real, unmodified `opensandbox`
//! Python SDK (from PyPI) talks to `abx-proxy` with a dummy key; the proxy, with the
//! `deploy/providers/opensandbox` manifest installed and `ABX_PROVIDER=opensandbox`, talks
//! to the fake OpenSandbox server (`examples/fake_opensandbox.rs`), which checks every
//! request: exactly one `OPEN-SANDBOX-API-KEY`, the real one; no `Authorization`, no
//! `X-API-Key`; the built-in provider's key (`ABX_SANDBOX_API_KEY`) in no header.
//!
//! The SDK reaches the sandbox's execd directly at the endpoint the server hands out (its
//! default mode), so the execd readiness probe goes to the fake without the proxy; the fake
//! checks that no key at all travels there.
//!
//! `scripts/e2e-deps.sh` installs the SDK into `target/e2e/py-opensandbox` (first run: about
//! half a minute from PyPI; later runs: instant).

#[path = "support/e2e.rs"]
mod e2e;

use std::time::Duration;

use serde_json::Value;

use e2e::{deps, driver, e2e_dir, fake_report, repo, start_fake, Outcome, Proc};

/// The OpenSandbox key the proxy must attach.
const REAL_KEY: &str = "osb-real-key-e2e-5f0c1a9d7b3e42";
/// The built-in provider's key, also in the proxy's environment; must never reach OpenSandbox.
const BUILTIN_KEY: &str = "abx-builtin-key-e2e-8d2b6e0f4a17";
/// What the SDK user configures.
const DUMMY_KEY: &str = "dummy";

const DRIVER_TIMEOUT: Duration = Duration::from_secs(120);
/// `provider install` copies a file: anything near this is a hang.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How the proxy is told where OpenSandbox is.
#[derive(Clone, Copy, Debug)]
enum BaseUrlVia {
    /// `ABX_OPENSANDBOX_BASE_URL=http://127.0.0.1:PORT`
    Canonical,
    /// The vendor alias `OPEN_SANDBOX_DOMAIN=127.0.0.1:PORT` (no scheme → http://).
    VendorAlias,
}

/// The fake OpenSandbox server and, optionally, abx-proxy in front of it.
struct Rig {
    dir: tempfile::TempDir,
    fake: Proc,
    fake_url: String,
    proxy: Option<Proc>,
    install_log: String,
}

impl Rig {
    fn start_fake() -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let (fake, v) = start_fake("fake_opensandbox", REAL_KEY, &["--forbid-key", BUILTIN_KEY]);
        let fake_url = v["url"].as_str().map(str::to_string);
        let fake_url = fake_url.unwrap_or_else(|| panic!("no url in {v}\n{}", fake.output()));
        Rig {
            dir,
            fake,
            fake_url,
            proxy: None,
            install_log: String::new(),
        }
    }

    /// `abx-proxy provider install deploy/providers/opensandbox/abx-provider.toml`.
    fn install_provider(&mut self) {
        let manifest = repo().join("deploy/providers/opensandbox/abx-provider.toml");
        let mut cmd = e2e::abx(self.dir.path());
        cmd.args(["provider", "install"]).arg(&manifest);
        let (ok, log) = Proc::run_without_input("abx-proxy provider install", cmd, INSTALL_TIMEOUT);
        self.install_log = log;
        assert!(
            ok,
            "abx-proxy provider install failed:\n{}",
            self.install_log
        );
        let installed =
            e2e::abx_home(self.dir.path()).join("providers/opensandbox/abx-provider.toml");
        assert!(
            installed.is_file(),
            "provider install did not create {}:\n{}",
            installed.display(),
            self.install_log
        );
    }

    /// Starts abx-proxy for OpenSandbox and returns its listen address.
    fn start_proxy(&mut self, via: BaseUrlVia) -> String {
        let mut cmd = e2e::abx(self.dir.path());
        cmd.env("ABX_PROVIDER", "opensandbox")
            .env("OPEN_SANDBOX_API_KEY", REAL_KEY)
            .env("ABX_SANDBOX_API_KEY", BUILTIN_KEY);
        match via {
            BaseUrlVia::Canonical => cmd.env("ABX_OPENSANDBOX_BASE_URL", &self.fake_url),
            BaseUrlVia::VendorAlias => cmd.env(
                "OPEN_SANDBOX_DOMAIN",
                self.fake_url.trim_start_matches("http://"),
            ),
        };
        let (proxy, addr) =
            e2e::serve(cmd, &[]).unwrap_or_else(|e| panic!("{}{e}", self.install_log));
        self.proxy = Some(proxy);
        addr
    }

    /// Runs the SDK driver with `OPEN_SANDBOX_DOMAIN=<domain>` and the dummy key.
    fn run_driver(&self, domain: &str) -> (bool, String) {
        let py = e2e_dir().join("py-opensandbox").join("bin").join("python");
        // `driver` keeps proxies and OPENSANDBOX_* settings of the caller out.
        let mut cmd = driver(py, self.dir.path());
        cmd.arg(repo().join("tests/e2e/opensandbox_test.py"))
            .env("OPEN_SANDBOX_DOMAIN", domain)
            .env("OPEN_SANDBOX_API_KEY", DUMMY_KEY);
        Proc::run("opensandbox_test.py", cmd, DRIVER_TIMEOUT)
    }

    fn report(&self) -> Value {
        fake_report(&self.fake_url)
    }

    fn logs(&self) -> String {
        let mut s = self.install_log.clone();
        s.push_str(&self.fake.output());
        if let Some(p) = &self.proxy {
            s.push_str(&p.output());
        }
        s
    }
}

/// Every request the driver causes, by the fake's route names.
const EXPECTED: &[(&str, u64)] = &[
    // SandboxSync.create: create, then the execd (44772) and egress (18080) endpoints,
    // then the readiness probe on execd (direct, not through the proxy), then the
    // fire-and-forget `sandbox.create` metric.
    ("api POST /v1/sandboxes", 1),
    ("api GET /v1/sandboxes/{id}/endpoints/{port}", 2),
    ("execd GET /ping", 1),
    ("api POST /v1/metrics/events", 1),
    // get_info, and get_info again after kill (404).
    ("api GET /v1/sandboxes/{id}", 2),
    ("api DELETE /v1/sandboxes/{id}", 1),
];

fn through_proxy(via: BaseUrlVia) {
    deps();
    let mut rig = Rig::start_fake();
    rig.install_provider();
    let addr = rig.start_proxy(via);
    let run = Outcome::new(rig.run_driver(&addr), rig.report(), rig.logs());
    run.assert_clean(&format!("through abx-proxy ({via:?})"), EXPECTED);

    // Neither key in anything the proxy printed, its drain and stop included.
    let proxy_log = rig.proxy.as_mut().expect("the proxy").stopped_output();
    for key in [REAL_KEY, BUILTIN_KEY] {
        assert!(
            !proxy_log.contains(key),
            "a key appears in abx-proxy's log:\n{}",
            run.dump
        );
    }
}

#[test]
fn opensandbox_python_sdk_through_proxy() {
    through_proxy(BaseUrlVia::Canonical);
}

#[test]
fn opensandbox_python_sdk_through_proxy_vendor_domain_alias() {
    through_proxy(BaseUrlVia::VendorAlias);
}

/// The fake has teeth: the SDK talking to it directly (the dummy key in
/// `OPEN-SANDBOX-API-KEY`) is refused and recorded, so a proxy that passes the client's
/// key through cannot pass the tests above.
#[test]
fn fake_refuses_the_sdk_without_the_proxy() {
    deps();
    let rig = Rig::start_fake();
    let run = rig.run_driver(rig.fake_url.trim_start_matches("http://"));
    Outcome::new(run, rig.report(), rig.logs())
        .assert_refused("OPEN-SANDBOX-API-KEY is not the expected key");
}
