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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The OpenSandbox key the proxy must attach.
const REAL_KEY: &str = "osb-real-key-e2e-5f0c1a9d7b3e42";
/// The built-in provider's key, also in the proxy's environment; must never reach OpenSandbox.
const BUILTIN_KEY: &str = "abx-builtin-key-e2e-8d2b6e0f4a17";
/// What the SDK user configures.
const DUMMY_KEY: &str = "dummy";

/// Bounds for each wait; none lets time pass on purpose.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const DRIVER_TIMEOUT: Duration = Duration::from_secs(120);

/// `target/<profile>` of this test binary (`target/debug/deps/e2e_opensandbox-…` → `target/debug`).
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

/// The fake's binary; `cargo test` builds examples, `cargo test --test e2e_opensandbox`
/// does not, so build it when it is missing.
fn fake_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = profile_dir().join("examples").join("fake_opensandbox");
        if !bin.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let st = Command::new(cargo)
                .args(["build", "--example", "fake_opensandbox"])
                .current_dir(repo())
                .status()
                .expect("run cargo build --example fake_opensandbox");
            assert!(
                st.success(),
                "cargo build --example fake_opensandbox failed"
            );
        }
        assert!(bin.exists(), "{} missing", bin.display());
        bin
    })
    .clone()
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte (0x40..=0x7e)
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

enum Event {
    Line(String),
    Eof,
}

/// A child process with its stdout and stderr read line by line by two threads (into one
/// transcript and one channel); killed and reaped on drop.
struct Proc {
    name: String,
    child: Child,
    /// Kept open: the fake exits when it is closed (`--stdin-lifeline`).
    _stdin: Option<ChildStdin>,
    events: Receiver<Event>,
    open_streams: usize,
    transcript: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, events) = mpsc::channel();
        let transcript = Arc::new(Mutex::new(Vec::new()));
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout"));
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr"));
        for (stream, tag) in [(out, "out"), (err, "err")] {
            let tx = tx.clone();
            let transcript = transcript.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let line = strip_ansi(&line);
                    transcript
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("[{tag}] {line}"));
                    if tx.send(Event::Line(line)).is_err() {
                        break;
                    }
                }
                let _ = tx.send(Event::Eof);
            });
        }
        Proc {
            name: name.into(),
            _stdin: child.stdin.take(),
            child,
            events,
            open_streams: 2,
            transcript,
        }
    }

    fn output(&self) -> String {
        let lines = self.transcript.lock().unwrap_or_else(|e| e.into_inner());
        format!("---- {} ----\n{}\n", self.name, lines.join("\n"))
    }

    /// The first line (stdout or stderr) for which `find` returns something, within `limit`.
    fn wait_for<T>(
        &mut self,
        limit: Duration,
        find: impl Fn(&str) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + limit;
        loop {
            if self.open_streams == 0 {
                let st = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                return Err(format!(
                    "{} exited ({st}) before the line appeared",
                    self.name
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::Line(l)) => {
                    if let Some(v) = find(&l) {
                        return Ok(v);
                    }
                }
                Ok(Event::Eof) => self.open_streams -= 1,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("{}: no such line within {limit:?}", self.name))
                }
                Err(RecvTimeoutError::Disconnected) => self.open_streams = 0,
            }
        }
    }

    /// Waits until the process has closed stdout and stderr and exited, within `limit`;
    /// kills it after that.
    fn wait(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let deadline = Instant::now() + limit;
        while self.open_streams > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::Line(_)) => {}
                Ok(Event::Eof) => self.open_streams -= 1,
                Err(RecvTimeoutError::Disconnected) => self.open_streams = 0,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("{} did not finish within {limit:?}", self.name));
                }
            }
        }
        self.child
            .wait()
            .map_err(|e| format!("wait for {}: {e}", self.name))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// `listen=127.0.0.1:PORT` (text logs) or `"listen":"127.0.0.1:PORT"` (JSON logs) from the
/// proxy's "abx-proxy listening" line.
fn listen_addr(line: &str) -> Option<String> {
    if !line.contains("abx-proxy listening") {
        return None;
    }
    let start = [" listen=", "\"listen\":\""]
        .iter()
        .find_map(|tag| line.find(tag).map(|i| i + tag.len()))?;
    let rest = &line[start..];
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '"' || c == ',')
        .unwrap_or(rest.len());
    let addr = &rest[..end];
    (!addr.is_empty()).then(|| addr.to_string())
}

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
        let mut cmd = Command::new(fake_bin());
        cmd.args([
            "--port",
            "0",
            "--expect-key",
            REAL_KEY,
            "--forbid-key",
            BUILTIN_KEY,
            "--stdin-lifeline",
        ]);
        let mut fake = Proc::spawn("fake_opensandbox", cmd);
        let fake_url = fake
            .wait_for(START_TIMEOUT, |l| {
                let v: Value = serde_json::from_str(l).ok()?;
                v["url"].as_str().map(str::to_string)
            })
            .unwrap_or_else(|e| panic!("{e}\n{}", fake.output()));
        Rig {
            dir,
            fake,
            fake_url,
            proxy: None,
            install_log: String::new(),
        }
    }

    fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    fn abx_home(&self) -> PathBuf {
        self.home().join(".abx")
    }

    /// `abx-proxy` with a cleared environment, a temp HOME/ABX_HOME and a temp cwd.
    fn abx(&self) -> Command {
        let cwd = self.dir.path().join("cwd");
        std::fs::create_dir_all(self.abx_home()).expect("mkdir ABX_HOME");
        std::fs::create_dir_all(&cwd).expect("mkdir cwd");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
        cmd.env_clear()
            .env("HOME", self.home())
            .env("ABX_HOME", self.abx_home())
            .env("NO_COLOR", "1")
            .current_dir(cwd);
        cmd
    }

    /// `abx-proxy provider install deploy/providers/opensandbox/abx-provider.toml`.
    fn install_provider(&mut self) {
        let manifest = repo().join("deploy/providers/opensandbox/abx-provider.toml");
        let out = self
            .abx()
            .args(["provider", "install"])
            .arg(&manifest)
            .stdin(Stdio::null())
            .output()
            .expect("run abx-proxy provider install");
        self.install_log = format!(
            "---- abx-proxy provider install ({}) ----\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "abx-proxy provider install failed:\n{}",
            self.install_log
        );
        let installed = self
            .abx_home()
            .join("providers/opensandbox/abx-provider.toml");
        assert!(
            installed.is_file(),
            "provider install did not create {}:\n{}",
            installed.display(),
            self.install_log
        );
    }

    /// Starts abx-proxy for OpenSandbox on 127.0.0.1:0 and returns its listen address,
    /// read from its "abx-proxy listening" log line.
    fn start_proxy(&mut self, via: BaseUrlVia) -> String {
        let mut cmd = self.abx();
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
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ]);
        let mut proxy = Proc::spawn("abx-proxy", cmd);
        let addr = proxy.wait_for(START_TIMEOUT, listen_addr);
        let addr = match addr {
            Ok(a) => a,
            Err(e) => panic!("{e}\n{}{}", self.install_log, proxy.output()),
        };
        self.proxy = Some(proxy);
        addr
    }

    /// Runs the SDK driver with `OPEN_SANDBOX_DOMAIN=<domain>` and the dummy key.
    fn run_driver(&self, domain: &str) -> (bool, String) {
        let home = self.dir.path().join("driver-home");
        std::fs::create_dir_all(&home).expect("mkdir driver home");
        let py = e2e_dir().join("py-opensandbox").join("bin").join("python");
        let mut cmd = Command::new(py);
        // A clean environment: no proxies, no OPENSANDBOX_* settings from the caller.
        cmd.arg(repo().join("tests/e2e/opensandbox_test.py"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("OPEN_SANDBOX_DOMAIN", domain)
            .env("OPEN_SANDBOX_API_KEY", DUMMY_KEY)
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(self.dir.path());
        let mut p = Proc::spawn("opensandbox_test.py", cmd);
        let ok = match p.wait(DRIVER_TIMEOUT) {
            Ok(st) => st.success(),
            Err(e) => {
                println!("{e}");
                false
            }
        };
        (ok, p.output())
    }

    fn report(&self) -> Value {
        let authority = self.fake_url.trim_start_matches("http://");
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
    let (ok, out) = rig.run_driver(&addr);
    let report = rig.report();
    let dump = || {
        format!(
            "{out}{}---- fake report ----\n{}",
            rig.logs(),
            serde_json::to_string_pretty(&report).unwrap_or_default()
        )
    };
    assert!(
        ok,
        "the SDK driver failed through abx-proxy ({via:?}):\n{}",
        dump()
    );

    let violations = report["violations"].as_array().cloned().unwrap_or_default();
    assert!(
        violations.is_empty(),
        "the fake recorded violations:\n{}",
        dump()
    );

    let mut wrong = Vec::new();
    for (route, n) in EXPECTED {
        let got = report["routes"][*route].as_u64().unwrap_or(0);
        if got != *n {
            wrong.push(format!("{route}: {got} (expected {n})"));
        }
    }
    let total: u64 = EXPECTED.iter().map(|(_, n)| n).sum();
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

    // Neither key in anything the proxy printed.
    let proxy_log = rig.proxy.as_ref().map(Proc::output).unwrap_or_default();
    for key in [REAL_KEY, BUILTIN_KEY] {
        assert!(
            !proxy_log.contains(key),
            "a key appears in abx-proxy's log:\n{}",
            dump()
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
    let (ok, out) = rig.run_driver(rig.fake_url.trim_start_matches("http://"));
    let report = rig.report();
    assert!(!ok, "the driver passed without the proxy:\n{out}");
    let violations = report["violations"].to_string();
    assert!(
        violations.contains("OPEN-SANDBOX-API-KEY is not the expected key"),
        "no OPEN-SANDBOX-API-KEY violation recorded: {report}\n{out}"
    );
}
