//! End-to-end gate: the real, unmodified E2B SDKs (Python latest, Python 2.50.0, JS latest,
//! JS 2.50.0) talk to `abx-proxy` with a dummy key; the proxy talks to the fake E2B cloud
//! (`examples/fake_e2b.rs`), which checks every request it gets (the real key as Bearer on
//! the control plane, no client key anywhere, the right envd token per sandbox, …).
//!
//! `scripts/e2e-deps.sh` installs the SDKs into `target/e2e` and `tests/e2e/node_modules`
//! (first run: about a minute, from PyPI and npm; later runs: instant).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

const REAL_KEY: &str = "real-key-e2e-0123456789abcdef";
const DUMMY_KEY: &str = "dummy-key";
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// `target/<profile>` of this test binary (`target/debug/deps/e2e_sdk-…` → `target/debug`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn e2e_dir() -> PathBuf {
    profile_dir()
        .parent()
        .expect("target dir above the profile dir")
        .join("e2e")
}

/// Runs `scripts/e2e-deps.sh` once per test process (the script also locks itself).
fn deps() {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("scripts/e2e-deps.sh"))
            .env("ABX_E2E_DIR", e2e_dir())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run scripts/e2e-deps.sh: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "scripts/e2e-deps.sh failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// The fake's binary; `cargo test` builds examples, `cargo test --test e2e_sdk` does not,
/// so build it when it is missing.
fn fake_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = profile_dir().join("examples").join("fake_e2b");
        if !bin.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let st = Command::new(cargo)
                .args(["build", "--example", "fake_e2b"])
                .current_dir(repo())
                .status()
                .expect("run cargo build --example fake_e2b");
            assert!(st.success(), "cargo build --example fake_e2b failed");
        }
        assert!(bin.exists(), "{} missing", bin.display());
        bin
    })
    .clone()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A child process killed and reaped on drop, its output going to files in `dir`.
struct Proc {
    name: String,
    child: Child,
    /// Kept open: the fake exits when it is closed (`--stdin-lifeline`).
    _stdin: Option<ChildStdin>,
    out: PathBuf,
    err: PathBuf,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let out = dir.join(format!("{name}.stdout"));
        let err = dir.join(format!("{name}.stderr"));
        cmd.stdout(File::create(&out).expect("create stdout file"))
            .stderr(File::create(&err).expect("create stderr file"))
            .stdin(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdin = child.stdin.take();
        Proc {
            name: name.into(),
            child,
            _stdin: stdin,
            out,
            err,
        }
    }

    fn output(&self) -> String {
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "---- {} stdout ----\n{}---- {} stderr ----\n{}",
            self.name,
            read(&self.out),
            self.name,
            read(&self.err)
        )
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits for the process to exit, up to `limit`; kills it after that.
    fn wait(&mut self, limit: Duration) -> Result<std::process::ExitStatus, String> {
        let deadline = Instant::now() + limit;
        let mut pause = Duration::from_millis(10);
        loop {
            if let Some(st) = self.exited() {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(format!("{} did not finish within {limit:?}", self.name));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The fake E2B cloud and abx-proxy in front of it.
struct Rig {
    dir: tempfile::TempDir,
    fake: Proc,
    proxy: Option<Proc>,
    api: String,
    envd: String,
    proxy_url: String,
}

impl Rig {
    /// Starts the fake; with `proxy`, also abx-proxy in front of it, and waits for it.
    fn start(with_proxy: bool) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new(fake_bin());
        cmd.args([
            "--api-port",
            "0",
            "--envd-port",
            "0",
            "--expect-key",
            REAL_KEY,
            "--dummy-key",
            DUMMY_KEY,
            "--stdin-lifeline",
        ]);
        let fake = Proc::spawn("fake_e2b", cmd, dir.path());
        let (api, envd) = read_fake_ports(&fake);
        let mut rig = Rig {
            dir,
            fake,
            proxy: None,
            api,
            envd,
            proxy_url: String::new(),
        };
        if with_proxy {
            rig.start_proxy();
        }
        rig
    }

    fn start_proxy(&mut self) {
        let port = free_port();
        let admin = free_port();
        let home = self.dir.path().join("home");
        let abx_home = home.join(".abx");
        let cwd = self.dir.path().join("cwd");
        std::fs::create_dir_all(&abx_home).expect("mkdir ABX_HOME");
        std::fs::create_dir_all(&cwd).expect("mkdir cwd");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("ABX_HOME", &abx_home)
            .env("ABX_SANDBOX_API_KEY", REAL_KEY)
            .current_dir(&cwd)
            .args(["serve", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{admin}"))
            .arg("--sandbox-base-url")
            .arg(&self.api)
            .arg("--sandbox-url")
            .arg(&self.envd);
        let mut proxy = Proc::spawn("abx-proxy", cmd, self.dir.path());
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let mut pause = Duration::from_millis(10);
        let mut ready = false;
        for _ in 0..100 {
            if let Some(st) = proxy.exited() {
                panic!("abx-proxy exited early ({st}):\n{}", proxy.output());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok() {
                ready = true;
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
        assert!(
            ready,
            "abx-proxy never accepted on {addr}:\n{}",
            proxy.output()
        );
        self.proxy_url = format!("http://{addr}");
        self.proxy = Some(proxy);
    }

    fn report(&self) -> Value {
        let authority = self.api.trim_start_matches("http://");
        let mut s = TcpStream::connect(authority).expect("connect to the fake");
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        write!(
            s,
            "GET /__fake/report HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
        )
        .expect("send report request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read report");
        let text = String::from_utf8_lossy(&raw);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b)
            .expect("report response");
        serde_json::from_str(body).unwrap_or_else(|e| panic!("report is not JSON ({e}): {body}"))
    }

    fn logs(&self) -> String {
        let mut s = self.fake.output();
        if let Some(p) = &self.proxy {
            s.push_str(&p.output());
        }
        s
    }
}

fn read_fake_ports(fake: &Proc) -> (String, String) {
    // The fake prints its ports as the first stdout line; poll the file until it is there.
    let mut pause = Duration::from_millis(5);
    for _ in 0..100 {
        if let Ok(f) = File::open(&fake.out) {
            let mut line = String::new();
            if BufReader::new(f).read_line(&mut line).is_ok() && line.ends_with('\n') {
                let v: Value = serde_json::from_str(&line).expect("fake's port line is JSON");
                let get = |k: &str| v[k].as_str().expect("api/envd URL").to_string();
                return (get("api"), get("envd"));
            }
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
    panic!("fake_e2b printed no ports:\n{}", fake.output());
}

enum Sdk {
    Python(&'static str),
    Js(&'static str),
}

/// Runs one SDK driver with `E2B_API_URL`/`E2B_SANDBOX_URL` set to the given URLs.
fn run_driver(rig: &Rig, sdk: &Sdk, api_url: &str, sandbox_url: &str) -> (bool, String) {
    let home = rig.dir.path().join("driver-home");
    std::fs::create_dir_all(&home).expect("mkdir driver home");
    let (name, mut cmd) = match sdk {
        Sdk::Python(venv) => {
            let py = e2e_dir().join(venv).join("bin").join("python");
            let mut c = Command::new(py);
            c.arg(repo().join("tests/e2e/sdk_test.py"));
            (format!("driver-{venv}"), c)
        }
        Sdk::Js(pkg) => {
            let mut c = Command::new("node");
            c.arg(repo().join("tests/e2e/sdk_test.mjs"));
            (format!("driver-js-{pkg}"), c)
        }
    };
    // A clean environment: no E2B_DOMAIN/E2B_DEBUG and no HTTP(S)_PROXY from the caller.
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("E2B_API_KEY", DUMMY_KEY)
        .env("E2B_API_URL", api_url)
        .env("E2B_SANDBOX_URL", sandbox_url)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(rig.dir.path());
    if let Sdk::Js(pkg) = sdk {
        cmd.env("E2B_JS_PACKAGE", pkg);
    }
    let mut p = Proc::spawn(&name, cmd, rig.dir.path());
    let ok = match p.wait(DRIVER_TIMEOUT) {
        Ok(st) => st.success(),
        Err(e) => {
            println!("{e}");
            false
        }
    };
    (ok, p.output())
}

fn route_count(report: &Value, route: &str) -> u64 {
    report["routes"][route].as_u64().unwrap_or(0)
}

/// One SDK through the proxy: the driver passes, the fake saw no violation, and exactly
/// the requests the driver makes arrived, on the paths the proxy is meant to use.
fn sdk_through_proxy(sdk: Sdk) {
    deps();
    let rig = Rig::start(true);
    let (ok, out) = run_driver(&rig, &sdk, &rig.proxy_url, &rig.proxy_url);
    let report = rig.report();
    let dump = || {
        format!(
            "{out}{}---- fake report ----\n{}",
            rig.logs(),
            serde_json::to_string_pretty(&report).unwrap_or_default()
        )
    };
    assert!(ok, "the SDK driver failed through abx-proxy:\n{}", dump());

    let violations = report["violations"].as_array().cloned().unwrap_or_default();
    assert!(
        violations.is_empty(),
        "the fake recorded violations:\n{}",
        dump()
    );

    // What every driver does: 1 create, 1 set_timeout, 1 get_info, 1 connect, 1 kill;
    // 4 commands, 2 uploads, 2 downloads, 2 health checks, 1 ListDir. `/v2/…` create and
    // connect reach the upstream as `/sandboxes…` (compat_v2_paths = rewrite).
    let expected: &[(&str, u64)] = &[
        ("api POST /sandboxes", 1),
        ("api POST /sandboxes/{id}/timeout", 1),
        ("api GET /sandboxes/{id}", 1),
        ("api POST /sandboxes/{id}/connect", 1),
        ("api DELETE /sandboxes/{id}", 1),
        ("envd POST /process.Process/Start", 4),
        ("envd POST /files", 2),
        ("envd GET /files", 2),
        ("envd GET /health", 2),
        ("envd POST /filesystem.Filesystem/ListDir", 1),
    ];
    let mut wrong = Vec::new();
    for (route, n) in expected {
        let got = route_count(&report, route);
        if got != *n {
            wrong.push(format!("{route}: {got} (expected {n})"));
        }
    }
    let total: u64 = expected.iter().map(|(_, n)| n).sum();
    if report["requests"].as_u64() != Some(total) {
        wrong.push(format!(
            "requests: {} (expected {total}; routes {})",
            report["requests"], report["routes"]
        ));
    }
    assert!(
        wrong.is_empty(),
        "unexpected request counts: {wrong:?}\n{}",
        dump()
    );

    let log = report["log"].as_array().cloned().unwrap_or_default();
    for entry in &log {
        if entry["route"] == "api POST /sandboxes" {
            assert_eq!(
                entry["secure"],
                Value::Bool(true),
                "create must reach the upstream with \"secure\": true\n{}",
                dump()
            );
        }
        if entry["plane"] == "envd" {
            assert!(
                entry["basic"].as_str().is_some(),
                "envd request without Authorization: Basic (the proxy adds `Basic dXNlcjo=`): {entry}\n{}",
                dump()
            );
        }
    }
}

#[test]
fn python_sdk_latest_through_proxy() {
    sdk_through_proxy(Sdk::Python("py-latest"));
}

#[test]
fn python_sdk_2_50_through_proxy() {
    sdk_through_proxy(Sdk::Python("py250"));
}

#[test]
fn js_sdk_latest_through_proxy() {
    sdk_through_proxy(Sdk::Js("e2b"));
}

#[test]
fn js_sdk_2_50_through_proxy() {
    sdk_through_proxy(Sdk::Js("e2b-250"));
}

/// The fake has teeth: the SDK talking to it directly (dummy key as X-API-Key, no Bearer)
/// is refused and recorded, so a proxy that leaks the client's key cannot pass the tests.
#[test]
fn fake_refuses_the_sdk_without_the_proxy() {
    deps();
    let rig = Rig::start(false);
    let (ok, out) = run_driver(&rig, &Sdk::Python("py-latest"), &rig.api, &rig.envd);
    let report = rig.report();
    assert!(!ok, "the driver passed without the proxy:\n{out}");
    let violations = report["violations"].to_string();
    assert!(
        violations.contains("X-API-Key"),
        "no X-API-Key violation recorded: {report}\n{out}"
    );
}
