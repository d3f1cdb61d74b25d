//! What the SDK end-to-end tests (`tests/e2e_sdk.rs`, `tests/e2e_opensandbox.rs`) share:
//! where things live (`target/<profile>`, `target/e2e`), the one-off install of the SDKs
//! (`scripts/e2e-deps.sh`), the fakes' binaries (`examples/fake_*.rs`), child processes
//! whose output is read line by line, `abx-proxy serve` started on ephemeral ports, and
//! the fakes' `/__fake/report`.
//!
//! Synchronisation is by events only: a fake's port line, the proxy's "abx-proxy
//! listening" line, a process's exit. Each wait is bounded by a timeout that fails the
//! test instead of hanging it; none lets time pass on purpose.
//!
//! Include it with `#[path = "support/e2e.rs"] mod e2e;` (not `mod support;`: that is the
//! tokio-based harness of the other tests).

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Bounds a fake's or the proxy's start-up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounds reading what an exited process left in its pipes.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Bounds `scripts/e2e-deps.sh` (a first run downloads the SDKs) and the build of a fake.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);

/// `target/<profile>` of this test binary (`target/debug/deps/e2e_sdk-…` → `target/debug`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf()
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn e2e_dir() -> PathBuf {
    profile_dir()
        .parent()
        .expect("target dir above the profile dir")
        .join("e2e")
}

/// Runs `scripts/e2e-deps.sh` once per test process (the script also locks itself).
pub fn deps() {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        let mut cmd = Command::new("bash");
        cmd.arg(repo().join("scripts/e2e-deps.sh"))
            .env("ABX_E2E_DIR", e2e_dir());
        match Proc::run_without_input("scripts/e2e-deps.sh", cmd, SETUP_TIMEOUT) {
            (true, _) => Ok(()),
            (false, output) => Err(format!("scripts/e2e-deps.sh failed:\n{output}")),
        }
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// The binary of `examples/<name>.rs`, built by this profile once per test process:
/// `scripts/test.sh` builds the examples before the tests (then this finds nothing to do),
/// `cargo test --test e2e_…` does not, and a binary left by an earlier build may be older
/// than its source.
pub fn fake_bin(name: &str) -> PathBuf {
    // One build at a time: the tests of one binary start in parallel.
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let profile = profile_dir();
    let bin = profile.join("examples").join(name);
    if !built.iter().any(|b| b == name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--locked", "--example", name])
            .current_dir(repo());
        if profile.ends_with("release") {
            cmd.arg("--release");
        }
        let what = format!("cargo build --example {name}");
        let (ok, output) = Proc::run_without_input(&what, cmd, SETUP_TIMEOUT);
        assert!(ok, "{what} failed:\n{output}");
        built.push(name.to_string());
    }
    assert!(bin.exists(), "{} missing", bin.display());
    bin
}

/// Starts the fake `examples/<name>.rs` on ports of its choosing, expecting `key` from
/// the proxy, with `args` (plus `--stdin-lifeline`, so it dies with its `Proc`), and
/// returns it with the JSON object it prints once it is listening.
pub fn start_fake(name: &str, key: &str, args: &[&str]) -> (Proc, Value) {
    let mut cmd = Command::new(fake_bin(name));
    cmd.args(["--expect-key", key])
        .args(args)
        .arg("--stdin-lifeline");
    let mut fake = Proc::spawn(name, cmd);
    let found = fake.wait_for(START_TIMEOUT, |l| {
        serde_json::from_str::<Value>(l)
            .ok()
            .filter(Value::is_object)
    });
    match found {
        Ok(ports) => (fake, ports),
        Err(e) => panic!("{e}\n{}", fake.output()),
    }
}

/// `ABX_HOME` of the commands [`abx`] makes for `root`.
pub fn abx_home(root: &Path) -> PathBuf {
    root.join("home").join(".abx")
}

/// `abx-proxy` with a cleared environment (no keys, proxies or `ABX_*` settings from the
/// caller), `HOME` and `ABX_HOME` under `root`, and the cwd `root/cwd`.
pub fn abx(root: &Path) -> Command {
    let cwd = root.join("cwd");
    std::fs::create_dir_all(abx_home(root)).expect("mkdir ABX_HOME");
    std::fs::create_dir_all(&cwd).expect("mkdir cwd");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
    cmd.env_clear()
        .env("HOME", root.join("home"))
        .env("ABX_HOME", abx_home(root))
        .env("NO_COLOR", "1")
        .current_dir(cwd);
    cmd
}

/// Runs `cmd` (from [`abx`]) as `abx-proxy serve` on ephemeral ports, with `args` after,
/// and returns it with its listen address (`127.0.0.1:PORT`) once it has logged it; or
/// why it did not, with its output. Ports it picks itself cannot be taken by another
/// test between choosing and binding.
pub fn serve(mut cmd: Command, args: &[&str]) -> Result<(Proc, String), String> {
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .args(args);
    let mut proxy = Proc::spawn("abx-proxy", cmd);
    match proxy.wait_for(START_TIMEOUT, listen_addr) {
        Ok(addr) => Ok((proxy, addr)),
        Err(e) => Err(format!("{e}\n{}", proxy.output())),
    }
}

/// `listen=127.0.0.1:PORT` (text logs) or `"listen":"127.0.0.1:PORT"` (JSON logs) from the
/// proxy's "abx-proxy listening" line. Its stderr is a pipe, so no colour codes split the
/// fields (it colours only a terminal).
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

/// An SDK driver: `program` with a clean environment (no proxies, no SDK settings from the
/// caller; only `PATH` and a fresh `HOME`), run in `dir`.
pub fn driver(program: impl AsRef<OsStr>, dir: &Path) -> Command {
    let home = dir.join("driver-home");
    std::fs::create_dir_all(&home).expect("mkdir driver home");
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(dir);
    cmd
}

/// `GET /__fake/report` from the fake at `url` (`http://127.0.0.1:PORT`).
pub fn fake_report(url: &str) -> Value {
    let authority = url.trim_start_matches("http://");
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

/// A driver's run against a fake: what the tests assert on, and all there is to show
/// when an assertion fails.
pub struct Outcome {
    /// Whether the driver exited 0 in time.
    pub ok: bool,
    /// The fake's `/__fake/report` after the run.
    pub report: Value,
    /// The driver's output, `logs` and the report.
    pub dump: String,
}

impl Outcome {
    pub fn new((ok, out): (bool, String), report: Value, logs: String) -> Outcome {
        let pretty = serde_json::to_string_pretty(&report).unwrap_or_default();
        let dump = format!("{out}{logs}---- fake report ----\n{pretty}");
        Outcome { ok, report, dump }
    }

    /// The driver failed, and the fake recorded a violation that names `violation`.
    pub fn assert_refused(&self, violation: &str) {
        let dump = &self.dump;
        assert!(!self.ok, "the driver passed without the proxy:\n{dump}");
        let violations = self.report["violations"].to_string();
        assert!(
            violations.contains(violation),
            "no {violation:?} violation recorded:\n{dump}"
        );
    }

    /// The driver passed `via`, the fake recorded no violation, and every request it saw
    /// was `expected` (route → requests), exactly as often.
    pub fn assert_clean(&self, via: &str, expected: &[(&str, u64)]) {
        let (report, dump) = (&self.report, &self.dump);
        assert!(self.ok, "the SDK driver failed {via}:\n{dump}");
        let violations = report["violations"].as_array().cloned().unwrap_or_default();
        assert!(
            violations.is_empty(),
            "the fake recorded violations:\n{dump}"
        );
        let mut wrong = Vec::new();
        for (route, n) in expected {
            let got = report["routes"][*route].as_u64().unwrap_or(0);
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
            "unexpected request counts: {wrong:?}\n{dump}"
        );
    }
}

/// A line of a child's stdout or stderr; `None` when that stream closes.
type Line = Option<String>;

/// How long a stopped abx-proxy may take: its drain has nothing left to wait for.
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// A child process with its stdout and stderr read line by line by two threads (into one
/// transcript and one channel); killed and reaped on drop.
pub struct Proc {
    name: String,
    pid: u32,
    /// `None` once [`Proc::wait`] has handed it to the thread that reaps it.
    child: Option<Child>,
    /// Kept open: a fake exits when it is closed (`--stdin-lifeline`).
    _stdin: Option<ChildStdin>,
    lines: Receiver<Line>,
    open_streams: usize,
    transcript: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        let transcript = Arc::new(Mutex::new(Vec::new()));
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout"));
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr"));
        for (stream, tag) in [(out, "out"), (err, "err")] {
            let tx = tx.clone();
            let transcript = transcript.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    transcript
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("[{tag}] {line}"));
                    if tx.send(Some(line)).is_err() {
                        break;
                    }
                }
                let _ = tx.send(None);
            });
        }
        Proc {
            name: name.into(),
            pid: child.id(),
            _stdin: child.stdin.take(),
            child: Some(child),
            lines,
            open_streams: 2,
            transcript,
        }
    }

    /// Runs `cmd` to its end (killed after `limit`); whether it succeeded, and its output.
    pub fn run(name: &str, cmd: Command, limit: Duration) -> (bool, String) {
        Proc::spawn(name, cmd).run_to_end(limit)
    }

    /// [`Proc::run`] for a command given no input: its stdin is closed at once, as with
    /// `Command::output`, so a read gets end-of-file instead of waiting out `limit`.
    pub fn run_without_input(name: &str, cmd: Command, limit: Duration) -> (bool, String) {
        let mut p = Proc::spawn(name, cmd);
        p._stdin = None;
        p.run_to_end(limit)
    }

    fn run_to_end(mut self, limit: Duration) -> (bool, String) {
        let ok = match self.wait(limit) {
            Ok(st) => st.success(),
            Err(e) => {
                println!("{e}");
                false
            }
        };
        (ok, self.output())
    }

    pub fn output(&self) -> String {
        let lines = self.transcript.lock().unwrap_or_else(|e| e.into_inner());
        format!("---- {} ----\n{}\n", self.name, lines.join("\n"))
    }

    /// The next line (stdout or stderr) for which `find` returns something, within `limit`.
    pub fn wait_for<T>(
        &mut self,
        limit: Duration,
        find: impl Fn(&str) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + limit;
        while self.open_streams > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some(l)) => {
                    if let Some(v) = find(&l) {
                        return Ok(v);
                    }
                }
                Ok(None) => self.open_streams -= 1,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("{}: no such line within {limit:?}", self.name))
                }
                Err(RecvTimeoutError::Disconnected) => self.open_streams = 0,
            }
        }
        Err(format!(
            "{} closed stdout and stderr before the line appeared",
            self.name
        ))
    }

    /// Ends the process as a service manager would (SIGTERM) and waits for it, within
    /// `limit`, and for the rest of its output: what it printed at its end is in
    /// [`Proc::output`] then.
    pub fn stop(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        self.wait(limit)
    }

    /// abx-proxy's whole output, once [`Proc::stop`] has ended it (exit 0, its stop line
    /// written): what it prints at its drain and stop is searched too.
    pub fn stopped_output(&mut self) -> String {
        let stopped = self.stop(STOP_LIMIT);
        let output = self.output();
        assert!(
            stopped.as_ref().is_ok_and(|s| s.success()) && output.contains(" stopped clean="),
            "{stopped:?}\n{output}"
        );
        output
    }

    /// Waits for the process to exit, within `limit`; kills it after that. A thread
    /// blocks in `Child::wait` and reports over a channel, so the wait ends the moment
    /// the process does.
    pub fn wait(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| format!("{} was waited for already", self.name))?;
        let (tx, exited) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        let status = match exited.recv_timeout(limit) {
            Ok(st) => st.map_err(|e| format!("wait for {}: {e}", self.name))?,
            Err(_) => {
                // The child belongs to the waiting thread now (which reaps it), so kill(1)
                // it by pid.
                let _ = Command::new("kill")
                    .args(["-KILL", &self.pid.to_string()])
                    .status();
                let _ = exited.recv_timeout(START_TIMEOUT);
                return Err(format!("{} did not finish within {limit:?}", self.name));
            }
        };
        // The last lines may still be in the pipes. They close with the process unless a
        // grandchild holds one open, which must cost only the rest of the transcript.
        let drained = Instant::now() + DRAIN_TIMEOUT;
        while self.open_streams > 0 {
            let left = drained.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some(_)) => {}
                Ok(None) => self.open_streams -= 1,
                Err(_) => break,
            }
        }
        Ok(status)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
