//! Acceptance tests for the settings chain and the `config`/`check`/`serve` command lines
//! (SPEC §1–§2), driving the real binary.
//!
//! Every case gets its own temporary HOME, ABX_HOME and working directory and a cleared
//! environment (only PATH, HOME, ABX_HOME and what the case sets), so nothing from the
//! machine running the tests leaks in. Every run goes through [`Case::run`], which asserts
//! that no raw secret of this file ([`SECRETS`]) appears in stdout or stderr.

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_abx-proxy");

// Every secret value this file ever hands to the binary. Distinct last four characters
// tell which level won through the mask; none is a substring of any output.
const KEY_FLAG: &str = "sk-flag-5f1e2d3c4b5a69788796FLAG";
const KEY_ENV: &str = "sk-envv-5f1e2d3c4b5a69788796ENVV";
const KEY_CWD: &str = "sk-cwdd-5f1e2d3c4b5a69788796CWDD";
const KEY_HOME: &str = "sk-home-5f1e2d3c4b5a69788796HOME";
const KEY_TOML: &str = "sk-toml-5f1e2d3c4b5a69788796TOML";
const KEY_OTHER_HOME: &str = "sk-ohom-5f1e2d3c4b5a69788796OHOM";
const KEY_SHORT: &str = "sk-short-9x";
const KEY_16: &str = "sk-16-abcdefQ16Z";
const KEY_15: &str = "sk-15-abcdefQ15";
const AK_SECRET_ENV: &str = "aksec-env-0a1b2c3d4e5f6a7b8c9dSENV";
const AK_SECRET_CWD: &str = "aksec-cwd-0a1b2c3d4e5f6a7b8c9dSCWD";
const AK_SECRET_HOME: &str = "aksec-hom-0a1b2c3d4e5f6a7b8c9dSHOM";
const AK_SECRET_FILE: &str = "aksec-fil-0a1b2c3d4e5f6a7b8c9dSFIL";
const AK_SECRET_TOML: &str = "aksec-tom-0a1b2c3d4e5f6a7b8c9dSTOM";
const GH_TOKEN: &str = "ghp_0a1b2c3d4e5f6a7b8c9d0e1f2a3bGHTK";
const REFUSED: &str = "sk-cmdl-5f1e2d3c4b5a69788796REFU";
const REFUSED_DASH: &str = "-sk-dash-5f1e2d3c4b5a6978879DASH";

const SECRETS: &[&str] = &[
    KEY_FLAG,
    KEY_ENV,
    KEY_CWD,
    KEY_HOME,
    KEY_TOML,
    KEY_OTHER_HOME,
    KEY_SHORT,
    KEY_16,
    KEY_15,
    AK_SECRET_ENV,
    AK_SECRET_CWD,
    AK_SECRET_HOME,
    AK_SECRET_FILE,
    AK_SECRET_TOML,
    GH_TOKEN,
    REFUSED,
    REFUSED_DASH,
];

const AK_ID: &str = "LTAI5tAccessKeyIdExample";

const E1001: &str = "[E1001] API key cannot be empty\n  Suggestion: Set ABX_SANDBOX_API_KEY (environment, ./.env or ~/.abx/.env) or pass --sandbox-api-key-file.\n";

/// `serve` for the runs meant to stop before they listen: should one listen after all, it
/// takes ports of its own, not the default ones a proxy in use on this machine may hold.
const SERVE: &[&str] = &[
    "serve",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
];

/// A child that runs longer than this is killed and the test fails (nothing here should
/// take more than a fraction of a second; a `serve` that starts by mistake would not end).
const WATCHDOG: Duration = Duration::from_secs(60);

/// One isolated world: temp HOME, ABX_HOME and cwd, and the environment and flags the
/// case adds.
struct Case {
    _root: TempDir,
    home: PathBuf,
    abx_home: Option<PathBuf>,
    cwd: PathBuf,
    vars: Vec<(String, String)>,
    /// Variables whose value is not UTF-8.
    raw_vars: Vec<(String, Vec<u8>)>,
    flags: Vec<String>,
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

/// One row of `config list --json`.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    key: String,
    value: Option<String>,
    source: String,
    env: Option<String>,
    secret: bool,
}

impl Case {
    /// HOME and ABX_HOME in separate temp directories: every case exercises the override.
    fn new() -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let home = root.path().join("home");
        let abx_home = root.path().join("abx-home");
        let cwd = root.path().join("work");
        for d in [&home, &abx_home, &cwd] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        Case {
            _root: root,
            home,
            abx_home: Some(abx_home),
            cwd,
            vars: Vec::new(),
            raw_vars: Vec::new(),
            flags: Vec::new(),
        }
    }

    /// No ABX_HOME: the directory is `$HOME/.abx`.
    fn without_abx_home() -> Self {
        let mut c = Case::new();
        let dir = c.home.join(".abx");
        std::fs::create_dir_all(&dir).expect("mkdir");
        c.abx_home = None;
        c
    }

    fn abx_dir(&self) -> PathBuf {
        self.abx_home
            .clone()
            .unwrap_or_else(|| self.home.join(".abx"))
    }

    fn env(&mut self, k: &str, v: &str) -> &mut Self {
        self.vars.push((k.to_string(), v.to_string()));
        self
    }

    /// A variable whose value is any bytes (not UTF-8, for one).
    fn env_bytes(&mut self, k: &str, v: &[u8]) -> &mut Self {
        self.raw_vars.push((k.to_string(), v.to_vec()));
        self
    }

    /// Settings flags appended to every run (after the subcommand).
    fn flag(&mut self, f: &str, v: &str) -> &mut Self {
        self.flags.push(f.to_string());
        self.flags.push(v.to_string());
        self
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.cwd.parent().expect("root").join(name);
        std::fs::write(&p, text).expect("write file");
        p
    }

    fn cwd_dotenv(&self, text: &str) -> &Self {
        append(&self.cwd.join(".env"), text, 0o600);
        self
    }

    fn home_dotenv(&self, text: &str) -> &Self {
        append(&self.abx_dir().join(".env"), text, 0o600);
        self
    }

    /// `text` with each file layer's label closing a parenthesis (`(ABX_X from ./.env)`,
    /// `(./.env)`) followed by where the file is, as messages name a file: a service's
    /// `~/.abx` is its `ABX_HOME`.
    fn with_paths(&self, text: &str) -> String {
        let files = [
            ("./.env)", self.cwd.join(".env")),
            ("~/.abx/.env)", self.abx_dir().join(".env")),
            ("~/.abx/config.toml)", self.abx_dir().join("config.toml")),
        ];
        files.iter().fold(text.to_string(), |t, (label, path)| {
            let label = label.trim_end_matches(')');
            t.replace(
                &format!("{label})"),
                &format!("{label} ({}))", path.display()),
            )
        })
    }

    /// `text` into `~/.abx/.env` (`in_home`) or `./.env`; the file's source label.
    fn dotenv_in(&self, in_home: bool, text: &str) -> &'static str {
        if in_home {
            self.home_dotenv(text);
            "~/.abx/.env"
        } else {
            self.cwd_dotenv(text);
            "./.env"
        }
    }

    fn toml(&self, text: &str) -> &Self {
        append(&self.abx_dir().join("config.toml"), text, 0o600);
        self
    }

    /// Runs the binary; asserts that no raw secret reached stdout or stderr.
    fn run(&self, args: &[&str]) -> Out {
        let mut cmd = self.command(args);
        cmd.stdout(Stdio::piped());
        self.finish(cmd, args)
    }

    /// Runs the binary with a stdout nobody reads: the read end of its pipe is closed
    /// before it starts, so its first write fails with EPIPE (`abx-proxy … | true`).
    fn run_with_reader_gone(&self, args: &[&str]) -> Out {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let mut cmd = self.command(args);
        cmd.stdout(writer);
        self.finish(cmd, args)
    }

    /// Runs the binary with a stderr whose reader has gone: every write to it fails.
    fn run_with_stderr_gone(&self, args: &[&str]) -> Out {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let mut cmd = self.command(args);
        cmd.stdout(Stdio::piped()).stderr(writer);
        self.finish(cmd, args)
    }

    /// Runs the binary with a stdout on a full disk: every write fails with ENOSPC.
    fn run_with_stdout_full(&self, args: &[&str]) -> Out {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full");
        let mut cmd = self.command(args);
        cmd.stdout(full.expect("/dev/full"));
        self.finish(cmd, args)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .args(&self.flags)
            .env_clear()
            .env(
                "PATH",
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
            )
            .env("HOME", &self.home)
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(h) = &self.abx_home {
            cmd.env("ABX_HOME", h);
        }
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        for (k, v) in &self.raw_vars {
            cmd.env(k, OsStr::from_bytes(v));
        }
        cmd
    }

    fn finish(&self, mut cmd: Command, args: &[&str]) -> Out {
        let child = cmd.spawn().expect("spawn abx-proxy");
        // The parent's copy of a pipe's write end must go, or the reader never sees EOF.
        drop(cmd);
        let pid = child.id();
        let (done, watch) = mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            if watch.recv_timeout(WATCHDOG) == Err(mpsc::RecvTimeoutError::Timeout) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        });
        let output = child.wait_with_output().expect("wait abx-proxy");
        let _ = done.send(());
        let _ = watchdog.join();
        let out = Out {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        };
        for s in SECRETS {
            assert!(
                !out.stdout.contains(s) && !out.stderr.contains(s),
                "raw secret ending {:?} printed by {args:?} {:?}\nstdout:\n{}\nstderr:\n{}",
                &s[s.len() - 4..],
                self.flags,
                out.stdout,
                out.stderr
            );
        }
        out
    }

    /// `config list --json`, which must succeed, parsed into rows.
    fn list(&self) -> Vec<Row> {
        let out = self.run(&["config", "list", "--json"]);
        assert_eq!(out.code, 0, "config list failed:\n{}", out.stderr);
        parse_rows(&out.stdout)
    }

    /// One row of `config list --json`.
    fn row(&self, key: &str) -> Row {
        find(&self.list(), key)
    }
}

fn append(path: &Path, text: &str, mode: u32) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open for append");
    writeln!(f, "{text}").expect("append");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn parse_rows(stdout: &str) -> Vec<Row> {
    let v: Value = serde_json::from_str(stdout).expect("config list --json is JSON");
    let arr = v.as_array().expect("a JSON array");
    arr.iter()
        .map(|o| {
            let o = o.as_object().expect("rows are objects");
            let mut fields: Vec<&str> = o.keys().map(String::as_str).collect();
            fields.sort_unstable();
            assert_eq!(fields, ["env", "key", "secret", "source", "value"], "{o:?}");
            let opt = |f: &str| match &o[f] {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                other => panic!("{f} is neither a string nor null: {other}"),
            };
            Row {
                key: o["key"].as_str().expect("key is a string").to_string(),
                value: opt("value"),
                source: o["source"]
                    .as_str()
                    .expect("source is a string")
                    .to_string(),
                env: opt("env"),
                secret: o["secret"].as_bool().expect("secret is a bool"),
            }
        })
        .collect()
}

fn find(rows: &[Row], key: &str) -> Row {
    rows.iter()
        .find(|r| r.key == key)
        .unwrap_or_else(|| panic!("no row {key} in {rows:?}"))
        .clone()
}

fn masked(secret: &str) -> String {
    format!("****{}", &secret[secret.len() - 4..])
}

/// The levels of the chain, highest first.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Level {
    Flag,
    Env,
    CwdDotenv,
    HomeDotenv,
    Toml,
}

const LEVELS: [Level; 5] = [
    Level::Flag,
    Level::Env,
    Level::CwdDotenv,
    Level::HomeDotenv,
    Level::Toml,
];

impl Level {
    fn source(self) -> &'static str {
        match self {
            Level::Flag => "flag",
            Level::Env => "env",
            Level::CwdDotenv => "./.env",
            Level::HomeDotenv => "~/.abx/.env",
            Level::Toml => "~/.abx/config.toml",
        }
    }
}

/// Puts `region = value` at a level.
fn set_region(c: &mut Case, level: Level, value: &str) {
    match level {
        Level::Flag => {
            c.flag("--region", value);
        }
        Level::Env => {
            c.env("ALIBABA_CLOUD_REGION_ID", value);
        }
        Level::CwdDotenv => {
            c.cwd_dotenv(&format!("ALIBABA_CLOUD_REGION_ID={value}"));
        }
        Level::HomeDotenv => {
            c.home_dotenv(&format!("ALIBABA_CLOUD_REGION_ID={value}"));
        }
        Level::Toml => {
            c.toml(&format!("[transport]\nregion = \"{value}\""));
        }
    }
}

/// Puts the API key at a level (`--sandbox-api-key-file` for the flag level).
fn set_key(c: &mut Case, level: Level, value: &str) {
    match level {
        Level::Flag => {
            let p = c.file(
                &format!("key-{}", &value[value.len() - 4..]),
                &format!("{value}\n"),
            );
            c.flag("--sandbox-api-key-file", p.to_str().expect("utf-8 path"));
        }
        Level::Env => {
            c.env("ABX_SANDBOX_API_KEY", value);
        }
        Level::CwdDotenv => {
            c.cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={value}"));
        }
        Level::HomeDotenv => {
            c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={value}"));
        }
        Level::Toml => {
            c.toml(&format!("sandbox_api_key = \"{value}\""));
        }
    }
}

fn region_for(level: Level) -> &'static str {
    match level {
        Level::Flag => "us-east-1",
        Level::Env => "cn-beijing",
        Level::CwdDotenv => "cn-shanghai",
        Level::HomeDotenv => "ap-southeast-1",
        Level::Toml => "cn-shenzhen",
    }
}

fn key_for(level: Level) -> &'static str {
    match level {
        Level::Flag => KEY_FLAG,
        Level::Env => KEY_ENV,
        Level::CwdDotenv => KEY_CWD,
        Level::HomeDotenv => KEY_HOME,
        Level::Toml => KEY_TOML,
    }
}

// ---------------------------------------------------------------------------------------
// The chain: every pair of levels

/// `HOME=/dev/null` (services and containers set it so) or a `HOME` that is a file (or a
/// path through one, as `/dev/null/`): no
/// `~/.abx`, as git finds no `~/.gitconfig` there. Every command failed with E1006 "Not a
/// directory" reading `~/.abx/.env`.
#[test]
fn a_home_that_is_no_directory_holds_no_abx_files() {
    let mut c = Case::without_abx_home();
    let file = c.home.join("a-file");
    std::fs::write(&file, "").expect("write");
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let through_file = file.join("");
    let homes = ["/dev/null".into(), "/dev/null/".into(), file, through_file];
    for home in homes {
        c.home = home;
        let r = c.row("sandbox_api_key");
        assert_eq!(r.source, "env", "{:?}", c.home);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 0, "{:?}: {}", c.home, out.stderr);
        let out = c.run(&["provider", "list"]);
        assert_eq!(out.code, 0, "{:?}: {}", c.home, out.stderr);
        assert!(out.stdout.contains("alicloud-express"), "{}", out.stdout);
        c.env("ABX_PROVIDER", "some-plugin");
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 78, "{}", out.stderr);
        assert!(!out.stderr.contains("Not a directory"), "{}", out.stderr);
        c.vars.retain(|(k, _)| k != "ABX_PROVIDER");
    }
}

/// No HOME at all (a systemd service without `User=`, `env -i`) and no ABX_HOME: said,
/// where `~/.abx/.env` was passed over without a word. A HOME that is no directory is
/// "no home" on purpose, and ABX_HOME needs none: nothing said.
#[test]
fn a_missing_home_is_said() {
    const SAID: &str = "~/.abx/.env and ~/.abx/config.toml are not read: HOME is unset or blank";
    let mut c = Case::without_abx_home();
    c.home = PathBuf::new();
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(out.stderr.contains(SAID), "{}", out.stderr);
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains(SAID), "{}", out.stderr);
    c.home = "/dev/null".into();
    let mut with_abx_home = Case::new();
    with_abx_home.home = PathBuf::new();
    for case in [&c, &with_abx_home] {
        let out = case.run(&["config", "list"]);
        assert!(
            !out.stderr.contains(SAID),
            "{:?}: {}",
            case.home,
            out.stderr
        );
    }
}

#[test]
fn region_every_pair_of_levels_higher_wins() {
    // Each level alone beats the default; each pair is won by the higher level.
    for (i, &hi) in LEVELS.iter().enumerate() {
        let mut alone = Case::new();
        set_region(&mut alone, hi, region_for(hi));
        let r = alone.row("region");
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some(region_for(hi)), hi.source())
        );

        for &lo in &LEVELS[i + 1..] {
            let mut c = Case::new();
            set_region(&mut c, hi, region_for(hi));
            set_region(&mut c, lo, region_for(lo));
            let r = c.row("region");
            assert_eq!(
                (r.value.as_deref(), r.source.as_str()),
                (Some(region_for(hi)), hi.source()),
                "{hi:?} over {lo:?}"
            );
        }
    }
    let r = Case::new().row("region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-hangzhou"), "default")
    );
}

#[test]
fn api_key_every_pair_of_levels_higher_wins() {
    // config.toml may not hold a secret: it is a level only in that it must lose to every
    // other level and never supply a value on its own.
    for (i, &hi) in LEVELS.iter().enumerate() {
        for &lo in &LEVELS[i + 1..] {
            let mut c = Case::new();
            set_key(&mut c, hi, key_for(hi));
            set_key(&mut c, lo, key_for(lo));
            let rows = c.list();
            let key = find(&rows, "sandbox_api_key");
            assert_eq!(
                (key.value, key.source.as_str()),
                (Some(masked(key_for(hi))), hi.source()),
                "{hi:?} over {lo:?}"
            );
            let cred = find(&rows, "credential");
            assert_eq!(
                (cred.value.as_deref(), cred.source.as_str()),
                (Some("api_key"), hi.source())
            );
        }
    }
    // Each allowed level alone; config.toml alone leaves the key unset.
    for level in LEVELS {
        let mut c = Case::new();
        set_key(&mut c, level, key_for(level));
        let r = c.row("sandbox_api_key");
        if level == Level::Toml {
            assert_eq!((r.value, r.source.as_str()), (None, "unset"));
        } else {
            assert_eq!(
                (r.value, r.source.as_str()),
                (Some(masked(key_for(level))), level.source())
            );
        }
    }
}

#[test]
fn each_key_falls_through_on_its_own() {
    // ./.env sets only the region: the key still comes from ~/.abx/.env.
    let c = Case::new();
    c.cwd_dotenv("ALIBABA_CLOUD_REGION_ID=cn-beijing");
    c.home_dotenv(&format!(
        "ABX_SANDBOX_API_KEY={KEY_HOME}\nALIBABA_CLOUD_REGION_ID=cn-shenzhen"
    ));
    c.toml("[transport]\nsandbox_domain = \"toml.example\"\nregion = \"us-west-1\"");
    let rows = c.list();
    let region = find(&rows, "region");
    assert_eq!(
        (region.value.as_deref(), region.source.as_str()),
        (Some("cn-beijing"), "./.env")
    );
    let key = find(&rows, "sandbox_api_key");
    assert_eq!(
        (key.value, key.source.as_str()),
        (Some(masked(KEY_HOME)), "~/.abx/.env")
    );
    let domain = find(&rows, "sandbox_domain");
    assert_eq!(
        (domain.value.as_deref(), domain.source.as_str()),
        (Some("toml.example"), "~/.abx/config.toml")
    );
    // Defaults derive from the effective region, whatever its level.
    let base = find(&rows, "sandbox_base_url");
    assert_eq!(
        (base.value.as_deref(), base.source.as_str()),
        (
            Some("https://api.cn-beijing.e2b.fc.aliyuncs.com"),
            "default"
        )
    );
}

// ---------------------------------------------------------------------------------------
// Blank values

#[test]
fn blank_values_are_skipped_at_every_level() {
    for blank in ["", "  ", "\t "] {
        // A blank flag falls to the environment.
        let mut c = Case::new();
        c.flag("--region", blank)
            .env("ALIBABA_CLOUD_REGION_ID", "cn-beijing");
        let r = c.row("region");
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some("cn-beijing"), "env"),
            "{blank:?}"
        );

        // A blank environment variable falls to ./.env.
        let mut c = Case::new();
        c.env("ALIBABA_CLOUD_REGION_ID", blank)
            .env("ABX_SANDBOX_API_KEY", blank);
        c.cwd_dotenv(&format!(
            "ALIBABA_CLOUD_REGION_ID=cn-shanghai\nABX_SANDBOX_API_KEY={KEY_CWD}"
        ));
        let rows = c.list();
        let r = find(&rows, "region");
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some("cn-shanghai"), "./.env")
        );
        let k = find(&rows, "sandbox_api_key");
        assert_eq!(
            (k.value, k.source.as_str()),
            (Some(masked(KEY_CWD)), "./.env")
        );

        // A blank ./.env value falls to ~/.abx/.env; a blank ~/.abx/.env one to config.toml.
        let c = Case::new();
        c.cwd_dotenv(&format!(
            "ALIBABA_CLOUD_REGION_ID=\"{blank}\"\nABX_SANDBOX_API_KEY='{blank}'"
        ));
        c.home_dotenv(&format!(
            "ABX_SANDBOX_API_KEY={KEY_HOME}\nALIBABA_CLOUD_REGION_ID=\"{blank}\""
        ));
        c.toml("region = \"cn-shenzhen\"");
        let rows = c.list();
        let r = find(&rows, "region");
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some("cn-shenzhen"), "~/.abx/config.toml")
        );
        let k = find(&rows, "sandbox_api_key");
        assert_eq!(
            (k.value, k.source.as_str()),
            (Some(masked(KEY_HOME)), "~/.abx/.env")
        );

        // A blank config.toml value falls to the default.
        let c = Case::new();
        c.toml(&format!("[transport]\nregion = \"{blank}\""));
        let r = c.row("region");
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some("cn-hangzhou"), "default")
        );
    }

    // Unquoted empty values in .env files, and a blank key file.
    let mut c = Case::new();
    c.cwd_dotenv("ABX_SANDBOX_API_KEY=\nALIBABA_CLOUD_REGION_ID=");
    let blank_file = c.file("blank-key", "  \n");
    c.flag(
        "--sandbox-api-key-file",
        blank_file.to_str().expect("utf-8 path"),
    );
    c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
    let rows = c.list();
    let k = find(&rows, "sandbox_api_key");
    assert_eq!(
        (k.value, k.source.as_str()),
        (Some(masked(KEY_HOME)), "~/.abx/.env")
    );
    let r = find(&rows, "region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-hangzhou"), "default")
    );

    // Only blanks everywhere: no key at all.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", "   ");
    c.cwd_dotenv("ABX_SANDBOX_API_KEY=\"  \"");
    let out = c.run(&["check", "--offline"]);
    assert_eq!((out.code, out.stderr.as_str()), (78, E1001));
}

// ---------------------------------------------------------------------------------------
// Dotenv syntax

#[test]
fn dotenv_syntax_forms_in_both_files() {
    let text = format!(
        "# a full-line comment: ABX_TOKEN_EXCHANGE=acs3\n\
         export ABX_SANDBOX_API_KEY=\"{KEY_CWD}\"\n\
         export ALIBABA_CLOUD_REGION_ID=cn-beijing\n\
         ABX_PROVIDER='single # quoted'\n\
         ABX_SANDBOX_DOMAIN=\"double.example\"\n\
         ABX_TOKEN_TTL=1234 # a trailing comment\n\
         ABX_TOKEN_REFRESH_BEFORE=\"60\" # after a quoted value\n\
         ABX_SANDBOX_BASE_URL=https://${{BASE_HOST}}/api\n\
         ABX_TOKEN_EXCHANGE_URL=\"https://${{BASE_HOST}}:8443\"\n\
         ABX_SANDBOX_URL=https://envd.${{ABX_SANDBOX_DOMAIN}}\n\
         ABX_COMPAT_V2_PATHS='${{BASE_HOST}}'\n\
         ABX_PROXY_LISTEN=127.0.0.1:${{MISSING_VAR}}7000\n"
    );
    for in_home in [false, true] {
        let mut c = Case::new();
        c.env("BASE_HOST", "base.example");
        let source = c.dotenv_in(in_home, &text);
        let rows = c.list();
        let expect: &[(&str, Option<&str>, &str)] = &[
            ("region", Some("cn-beijing"), source),
            ("provider", Some("single # quoted"), source),
            ("sandbox_domain", Some("double.example"), source),
            ("token_ttl", Some("1234"), source),
            ("token_refresh_before", Some("60"), source),
            ("sandbox_base_url", Some("https://base.example/api"), source),
            (
                "token_exchange_url",
                Some("https://base.example:8443"),
                source,
            ),
            ("sandbox_url", Some("https://envd.double.example"), source),
            // Single quotes are literal: no expansion.
            ("compat_v2_paths", Some("${BASE_HOST}"), source),
            // An unset variable expands to nothing.
            ("listen", Some("127.0.0.1:7000"), source),
            // The commented-out line is not read.
            ("token_exchange", Some("rpc-v1"), "default"),
        ];
        for (key, value, src) in expect {
            let r = find(&rows, key);
            assert_eq!(
                (r.value.as_deref(), r.source.as_str()),
                (*value, *src),
                "{key} (in {source})"
            );
        }
        let k = find(&rows, "sandbox_api_key");
        assert_eq!(
            (k.value, k.source.as_str()),
            (Some(masked(KEY_CWD)), source)
        );
    }
}

#[test]
fn dotenv_expansion_from_an_earlier_line_with_the_secret() {
    // A secret assembled from an earlier line still resolves, masked, and never printed.
    let c = Case::new();
    let (head, tail) = KEY_HOME.split_at(10);
    c.home_dotenv(&format!(
        "KEY_HEAD={head}\nexport ABX_SANDBOX_API_KEY=\"${{KEY_HEAD}}{tail}\""
    ));
    let r = c.row("sandbox_api_key");
    assert_eq!(
        (r.value, r.source.as_str()),
        (Some(masked(KEY_HOME)), "~/.abx/.env")
    );
}

/// dotenvy expands `${NAME}` without a limit: a few hundred bytes of lines, each doubling
/// the one before, asked for terabytes and aborted the process (at start, or on the SIGHUP
/// that re-read a cloned project's `./.env`). A file whose references could expand past 16
/// MiB is refused, naming the file, never a value; here the last line would be 64 MiB, so
/// the test does no harm where the bound is missing. References to short values pass.
#[test]
fn a_dotenv_whose_references_could_explode_is_refused() {
    let mut doubling = format!("V0={}\n", "x".repeat(64));
    for i in 1..=20 {
        doubling += &format!("V{i}=${{V{}}}${{V{}}}\n", i - 1, i - 1);
    }
    for home in [false, true] {
        let c = Case::new();
        let label = c.dotenv_in(home, &doubling);
        let out = c.run(&["config", "get", "region"]);
        assert_eq!(out.code, 78, "{}", out.stderr);
        assert!(
            out.stderr.contains(&format!("[E1006] cannot read {label}"))
                && out
                    .stderr
                    .contains("its `$` references could expand past 16 MiB"),
            "{}",
            out.stderr
        );
        assert!(!out.stderr.contains("xxxx"), "{}", out.stderr);
    }
    // A long value named once beside many short ones: each name counts its own `$`s.
    let c = Case::new();
    let many = format!(
        "PART={}\nALIBABA_CLOUD_REGION_ID=cn-${{PART}}\nBUNDLE=\"{}\"\nCA=${{BUNDLE}}\n{}",
        "b".repeat(1024),
        "c".repeat(200 * 1024),
        (0..500)
            .map(|i| format!("X{i}=${{PART}}\nU{i}=u\nL{i}=${{U{i}}}:${{U{i}}}\n"))
            .collect::<String>()
    );
    c.cwd_dotenv(&many);
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, format!("cn-{}", "b".repeat(1024)).as_str()),
        "{}",
        out.stderr
    );
}

/// An editor may save a `.env` with a byte-order mark: its first line is read as any
/// other (it was a syntax error, or a skipped line, depending on the file).
#[test]
fn a_dotenv_with_a_byte_order_mark_reads_its_first_line() {
    for home in [false, true] {
        let c = Case::new();
        let text =
            format!("\u{feff}ABX_SANDBOX_API_KEY={KEY_CWD}\nALIBABA_CLOUD_REGION_ID=cn-beijing\n");
        let label = c.dotenv_in(home, &text);
        let r = c.row("sandbox_api_key");
        assert_eq!((r.value, r.source.as_str()), (Some(masked(KEY_CWD)), label));
        assert_eq!(c.row("region").value.as_deref(), Some("cn-beijing"));
    }
}

/// dotenvy, which reads the `.env` files, takes `${VAR:-default}` as a lookup of a variable
/// named `VAR:-default` and ends a bare `$NAME` at the first `_`: both quietly expand to
/// nothing or to part of what was meant, as does a `${VAR}` set nowhere. Such a line of
/// ours is warned about by every command that resolves settings, in either file, naming
/// the line and never the value.
#[test]
fn a_dotenv_default_or_bare_dollar_on_a_line_of_ours_is_warned_about() {
    let text = format!(
        "ABX_SANDBOX_API_KEY={KEY_CWD}\n\
         ALIBABA_CLOUD_REGION_ID=${{MY_REGION:-cn-shanghai}}\n\
         ABX_TOKEN_TTL=$MY_TTL\n\
         ABX_SANDBOX_DOMAIN=${{MY_DOMAIN}}\n\
         OTHER_TOOL=${{X:-y}}\n\
         ABX_SANDBOX_URL=${{MY_UNSET_URL}}\n"
    );
    for home in [false, true] {
        let mut c = Case::new();
        c.env("MY_REGION", "cn-beijing");
        c.env("MY_TTL", "1200");
        c.env("MY_DOMAIN", "d.example");
        let label = c.dotenv_in(home, &text);
        for args in [&["config", "list"][..], &["check", "--offline"][..]] {
            let out = c.run(args);
            let warned: Vec<&str> = out
                .stderr
                .lines()
                .filter(|l| l.starts_with(&format!("warning: {label} (")))
                .collect();
            assert_eq!(warned.len(), 3, "{args:?}: {}", out.stderr);
            assert!(
                warned[0].contains(": line 2 (ALIBABA_CLOUD_REGION_ID): a `${…}` holds more"),
                "{}",
                warned[0]
            );
            assert!(
                warned[1].contains(": line 3 (ABX_TOKEN_TTL): a bare `$` is expanded"),
                "{}",
                warned[1]
            );
            assert!(
                warned[2].contains(
                    ": line 6 (ABX_SANDBOX_URL): ${MY_UNSET_URL} is set neither in the \
                     environment nor above it in this file, and expands to nothing"
                ),
                "{}",
                warned[2]
            );
            assert!(!out.stderr.contains("cn-shanghai"), "{}", out.stderr);
        }
        // What dotenvy made of them, as the warnings say.
        assert_eq!(c.row("region").value.as_deref(), Some("cn-hangzhou"));
        assert_eq!(c.row("sandbox_domain").value.as_deref(), Some("d.example"));
    }
}

/// `./.env` is whatever directory the proxy starts in: one that names an upstream while the
/// key comes from elsewhere (a checkout's file, the user's key in ~/.abx/.env) is said, with
/// where the key would go. A project whose `./.env` holds both is the user's own: no word.
#[test]
fn a_cwd_env_that_moves_the_upstream_of_a_key_kept_elsewhere_is_warned_about() {
    let c = Case::new();
    c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}\n"));
    c.cwd_dotenv("ABX_SANDBOX_BASE_URL=https://elsewhere.example\n");
    for args in [&["config", "list"][..], &["check", "--offline"][..]] {
        let out = c.run(args);
        let warning = out
            .stderr
            .lines()
            .find(|l| l.contains("ABX_SANDBOX_BASE_URL"))
            .unwrap_or_else(|| panic!("{args:?}: no warning:\n{}", out.stderr));
        assert!(warning.starts_with("warning: "), "{warning}");
        assert!(warning.contains("https://elsewhere.example"), "{warning}");
        assert!(warning.contains("~/.abx/.env"), "{warning}");
    }
    c.cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_CWD}\n"));
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        !out.stderr.contains("ABX_SANDBOX_BASE_URL"),
        "{}",
        out.stderr
    );
    // The exchange endpoint is the pair's alone: an API key never goes there.
    for (home, warned) in [
        (format!("ABX_SANDBOX_API_KEY={KEY_HOME}\n"), false),
        (
            "ALICLOUD_ACCESS_KEY_ID=LTAI5tHomePairId0000\n\
             ALICLOUD_ACCESS_KEY_SECRET=home-secret-zq81\n"
                .to_string(),
            true,
        ),
    ] {
        let c = Case::new();
        c.home_dotenv(&home);
        c.cwd_dotenv("ABX_TOKEN_EXCHANGE_URL=https://exchange.example\n");
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        let said = "ABX_TOKEN_EXCHANGE_URL=https://exchange.example: the credential";
        assert_eq!(out.stderr.contains(said), warned, "{}", out.stderr);
        assert!(!out.stderr.contains("zq81"), "{}", out.stderr);
    }
}

/// The same warning names where the key goes, never a password or a signature that the
/// value carries in its user info or query string (E1005 refuses such a URL, but the
/// warning comes first, and `serve` logs it), nor a secret a `${VAR}` put in the value.
#[test]
fn a_cwd_env_upstream_warning_shows_no_password_query_string_or_embedded_secret() {
    let mut c = Case::new();
    c.env("GITHUB_TOKEN", GH_TOKEN);
    c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}\n"));
    c.cwd_dotenv(
        "ABX_SANDBOX_BASE_URL=https://bob:pw-zq71@elsewhere.example/api?sig=zq72#zq73\n\
         ABX_SANDBOX_DOMAIN=eve:pw-zq74@domain.example\n\
         ABX_SANDBOX_URL=https://envd.example/${GITHUB_TOKEN}/\n",
    );
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(!out.stderr.contains("zq7"), "{}", out.stderr);
    for shown in [
        "ABX_SANDBOX_BASE_URL=https://bob:****@elsewhere.example/api?sig=****#****: the credential",
        "ABX_SANDBOX_DOMAIN=eve:****@domain.example: the credential",
        "ABX_SANDBOX_URL=https://envd.example/****/: the credential",
    ] {
        assert!(out.stderr.contains(shown), "{shown}\n{}", out.stderr);
    }
}

/// A provider id that a `${VAR}` filled with the key (or a key pasted in its place) is
/// an unknown provider: its E8002 prints the id as `config list` does, the key masked.
#[test]
fn an_unknown_providers_error_shows_no_resolved_secret() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ABX_PROVIDER=p-${ABX_SANDBOX_API_KEY}\n");
    for args in [&["check", "--offline"][..], &["config", "list"][..]] {
        let out = c.run(args);
        assert!(!out.stderr.contains(KEY_ENV), "{args:?}: {}", out.stderr);
        assert!(!out.stdout.contains(KEY_ENV), "{args:?}: {}", out.stdout);
        assert!(
            out.stderr.contains("[E8002] unknown provider: p-****"),
            "{args:?}: {}",
            out.stderr
        );
    }

    // An installed plugin's key in its place, and a URL's password and query, masked as
    // `config list` masks them.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let manifest = c.file(
        "acme.toml",
        "manifest_version = 1\n[provider]\nid = \"acme\"\n[endpoint]\n\
         base_url = \"https://api.acme.example\"\nauth.scheme = \"bearer\"\n\
         [config.fields.api_key]\nsecret = true\n",
    );
    let out = c.run(&["provider", "install", manifest.to_str().expect("utf-8")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    c.env("ABX_ACME_API_KEY", "sk-acme-plugin-zq81");
    for (provider, shown) in [
        ("sk-acme-plugin-zq81", "unknown provider: ****"),
        (
            "https://bob:pw-zq82@h.example/?sig=zq83",
            "unknown provider: https://bob:****@h.example/?sig=****",
        ),
    ] {
        c.env("ABX_PROVIDER", provider);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 78, "{}", out.stderr);
        assert!(!out.stderr.contains("zq8"), "{}", out.stderr);
        assert!(out.stderr.contains(shown), "{shown}: {}", out.stderr);
        // And the `provider` row of `config list` below the warning.
        let out = c.run(&["config", "list"]);
        assert!(!out.stdout.contains("zq8"), "{}", out.stdout);
    }
}

// ---------------------------------------------------------------------------------------
// Secrets: config.toml, the command line, files, masking

#[test]
fn secret_in_config_toml_is_ignored_with_a_warning() {
    let c = Case::new();
    c.toml(&format!(
        "sandbox_api_key = \"{KEY_TOML}\"\n[auth]\naccess_key_id = \"{AK_ID}\"\naccess_key_secret = \"{AK_SECRET_TOML}\"\n[transport]\nregion = \"cn-beijing\""
    ));
    let out = c.run(&["config", "list", "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let rows = parse_rows(&out.stdout);
    for key in ["sandbox_api_key", "access_key_secret"] {
        let r = find(&rows, key);
        assert_eq!((r.value, r.source.as_str()), (None, "unset"), "{key}");
        let warning = out
            .stderr
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("no warning naming {key}:\n{}", out.stderr));
        assert!(warning.starts_with("warning: "), "{warning}");
        assert!(warning.contains("~/.abx/config.toml"), "{warning}");
        let path = c.abx_dir().join("config.toml");
        assert!(warning.contains(path.to_str().expect("utf-8")), "{warning}");
    }
    // The non-secret keys of the same file are used.
    let r = find(&rows, "region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-beijing"), "~/.abx/config.toml")
    );
    let r = find(&rows, "access_key_id");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some(AK_ID), "~/.abx/config.toml")
    );

    // With only the half pair left, check and serve stop with E1003 (after the warnings).
    for args in [&["check", "--offline"][..], SERVE] {
        let out = c.run(args);
        assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains("sandbox_api_key"), "{}", out.stderr);
        assert!(out.stderr.contains("[E1003] "), "{}", out.stderr);
    }
}

#[test]
fn secret_flags_are_refused_without_echoing_the_value() {
    let commands: &[&[&str]] = &[
        // No subcommand: serve, with its flags.
        &SERVE[1..],
        SERVE,
        &["check", "--offline"],
        &["config", "list"],
        &["config", "get", "region"],
    ];
    let equals = format!("--sandbox-api-key={REFUSED}");
    let forms: &[&[&str]] = &[
        &["--sandbox-api-key", REFUSED],
        &[&equals],
        &["--sandbox-api-key", REFUSED_DASH],
        &["--sandbox-api-key"],
        &["--access-key-secret", REFUSED],
        &["--access-key-secret", REFUSED_DASH],
        &["--github-token", REFUSED],
    ];
    for cmd in commands {
        for form in forms {
            let mut c = Case::new();
            c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
            let args: Vec<&str> = cmd.iter().chain(form.iter()).copied().collect();
            let out = c.run(&args);
            assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
            assert!(out.stdout.is_empty(), "{args:?}: {}", out.stdout);
            // Names the flag it refuses and points at the alternatives.
            let flag = form[0].split('=').next().unwrap_or_default();
            assert!(
                out.stderr.contains(&format!("{flag} is not accepted")),
                "{args:?}: {}",
                out.stderr
            );
            // Run's shared check covers the whole value; also no tail of it.
            assert!(
                !out.stderr.contains(&REFUSED[20..]) && !out.stderr.contains(&REFUSED_DASH[20..]),
                "{}",
                out.stderr
            );
        }
    }
}

#[test]
fn command_line_errors_around_a_refused_secret_do_not_echo_it() {
    // clap rejects these before the refusal runs: still exit 2, still no value on stderr.
    let cases: &[&[&str]] = &[
        &["config", "get", "--sandbox-api-key", REFUSED],
        &["--sandbox-api-key", REFUSED, "config", "list"],
        &["check", "--sandbox-api-key", REFUSED, "--no-such-flag"],
        &[
            "serve",
            "--access-key-secret",
            REFUSED_DASH,
            "--max-connections",
            "many",
        ],
    ];
    for args in cases {
        let out = Case::new().run(args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(
            !out.stderr.contains(&REFUSED[20..]) && !out.stderr.contains(&REFUSED_DASH[20..]),
            "{}",
            out.stderr
        );
    }
}

/// A project's `./.env` shared with other tools may hold lines python-dotenv accepts and
/// dotenvy does not: they are skipped with a warning naming the line (never its text)
/// when they set nothing abx-proxy reads, and the rest of the file still counts.
#[test]
fn other_tools_lines_in_the_cwd_env_are_skipped_with_a_warning() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("GREETING=hello world\nALIBABA_CLOUD_REGION_ID=cn-shanghai\n");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "cn-shanghai\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("./.env") && out.stderr.contains("line 1 skipped"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("hello"), "{}", out.stderr);

    // Ten such lines are said one by one, the rest in one line: 170 000 of them printed
    // as many warnings at every command and reload.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let lines: String = (0..2_000)
        .map(|i| format!("GREETING_{i}=hello world\n"))
        .collect();
    c.cwd_dotenv(&lines);
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let skipped = out.stderr.lines().filter(|l| l.contains("skipped")).count();
    assert_eq!(skipped, 11, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("1990 more lines skipped likewise, up to line 2000"),
        "{}",
        out.stderr
    );
}

/// A credential sent over plain `http://` beyond this machine crosses the network in
/// clear: `check`, `serve` and `config` say so (a warning: self-hosted OpenSandbox inside a
/// cluster is often plain HTTP). Loopback and https upstreams get no warning.
#[test]
fn a_plain_http_upstream_beyond_this_machine_is_warned_about() {
    for (url, warned) in [
        ("http://sandbox.example:8080", true),
        ("http://127.0.0.1:8080", false),
        ("http://localhost:8080", false),
        ("https://sandbox.example", false),
    ] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
        c.flag("--sandbox-base-url", url);
        for args in [&["check", "--offline"][..], &["config", "list"]] {
            let out = c.run(args);
            assert_eq!(out.code, 0, "{url} {args:?}: {}", out.stderr);
            assert_eq!(
                out.stderr.contains("crosses the network unencrypted"),
                warned,
                "{url} {args:?}: {}",
                out.stderr
            );
            assert!(!out.stderr.contains(KEY_ENV), "{}", out.stderr);
        }
    }
    // Envd at the control plane's own address: said once.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.flag("--sandbox-base-url", "http://sandbox.example:8080/api")
        .flag("--sandbox-url", "http://SANDBOX.example:8080");
    let out = c.run(&["check", "--offline"]);
    let said = out
        .stderr
        .matches("crosses the network unencrypted")
        .count();
    assert_eq!((out.code, said), (0, 1), "{}", out.stderr);
}

/// `config list|get` show a value `check` and `serve` refuse (E1005) as it resolved, and
/// say so: a region with a space was listed in usable-looking URLs, exit 0, no word.
#[test]
fn config_list_says_a_value_check_and_serve_refuse() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
        .env("ALIBABA_CLOUD_REGION_ID", "cn hangzhou");
    let check = c.run(&["check", "--offline"]);
    assert_eq!(check.code, 78, "{}", check.stderr);
    for args in [
        &["config", "list"][..],
        &["config", "list", "--json"],
        &["config", "get", "region"],
    ] {
        let out = c.run(args);
        assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .contains("warning: [E1005] invalid value for region")
                && out.stderr.contains("(check and serve stop on it)"),
            "{args:?}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains(KEY_ENV), "{}", out.stderr);
    }
    // Nothing said of values that are fine, nor of the key left unset (its row says so).
    let mut c = Case::new();
    c.env("ALIBABA_CLOUD_REGION_ID", "cn-shanghai");
    let out = c.run(&["config", "list"]);
    assert!(!out.stderr.contains("E10"), "{}", out.stderr);
    // Half an AccessKey pair and no key: `check` stops on it (E1003), `config` says it.
    c.env("ALICLOUD_ACCESS_KEY_ID", "LTAI5tHalfAPairOnly00");
    let check = c.run(&["check", "--offline"]);
    assert!(
        check.code == 78 && check.stderr.contains("[E1003]"),
        "{}",
        check.stderr
    );
    let out = c.run(&["config", "list"]);
    assert!(
        out.code == 0
            && out.stderr.contains("warning: [E1003]")
            && out.stderr.contains("(check and serve stop on it)"),
        "{}",
        out.stderr
    );
    // With no key yet, or half a pair, the value is still said (the missing key hid it):
    // `check` names it first too. Dot segments; an admin listener on the proxy's own
    // address; an upstream that is the proxy itself (nothing is bound).
    let refused: [(&[&str], &str); 3] = [
        (
            &["--sandbox-base-url", "https://sandbox.example/a/../b"],
            "sandbox_base_url",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:18431",
                "--admin-listen",
                "127.0.0.1:18431",
            ],
            "admin_listen",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:18432",
                "--sandbox-base-url",
                "http://localhost:18432",
            ],
            "sandbox_base_url",
        ),
    ];
    for (flags, key) in refused {
        for half in [
            None,
            Some(("ALICLOUD_ACCESS_KEY_ID", "LTAI5tHalfAPairOnly00")),
        ] {
            let mut c = Case::new();
            c.flags.extend(flags.iter().map(|f| f.to_string()));
            if let Some((name, value)) = half {
                c.env(name, value);
            }
            let check = c.run(&["check", "--offline"]);
            assert!(
                check.code == 78 && check.stderr.contains("[E1005]"),
                "{flags:?} {half:?}: {}",
                check.stderr
            );
            let out = c.run(&["config", "get", key]);
            let said = format!("warning: [E1005] invalid value for {key}");
            assert!(
                out.code == 0 && out.stderr.contains(&said),
                "{flags:?} {half:?}: {}",
                out.stderr
            );
        }
    }
}

/// An AccessKey ID with a control character or a space (pasted with it) is refused,
/// E1005, as a key is, when the pair is the credential in use; said by `config`, which
/// shows it escaped. An ID beside the key in use stops nothing.
#[test]
fn an_access_key_id_with_a_control_character_is_refused() {
    for id in ["LTAI5t\u{1b}[31mRED", "LTAI5t two"] {
        let mut c = Case::new();
        c.env("ALICLOUD_ACCESS_KEY_ID", id)
            .env("ALICLOUD_ACCESS_KEY_SECRET", KEY_ENV);
        let check = c.run(&["check", "--offline"]);
        assert!(
            check.code == 78
                && check
                    .stderr
                    .contains("[E1005] invalid value for access_key_id"),
            "{id:?}: {}",
            check.stderr
        );
        assert!(!check.stderr.contains(KEY_ENV), "{}", check.stderr);
        let out = c.run(&["config", "get", "access_key_id"]);
        assert!(
            out.code == 0
                && (out.stderr).contains("warning: [E1005] invalid value for access_key_id"),
            "{id:?}: {}",
            out.stderr
        );
        assert!(!out.stdout.contains('\u{1b}'), "{:?}", out.stdout);
        let mut unused = Case::new();
        unused
            .env("ALICLOUD_ACCESS_KEY_ID", id)
            .env("ABX_SANDBOX_API_KEY", KEY_ENV);
        let check = unused.run(&["check", "--offline"]);
        assert_eq!(check.code, 0, "{id:?}: {}", check.stderr);
    }
}

/// `check` refuses what `serve` refuses before it binds: an upstream that is the proxy's
/// own listener (it would call itself forever), and the admin listener on the proxy's own
/// address (the second bind fails, blaming "another process"). Both said ok.
#[test]
fn check_refuses_an_upstream_or_admin_address_that_is_the_proxys_own_listener() {
    let check_offline = |flags: &[&str]| {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
        c.flags.extend(flags.iter().map(|f| f.to_string()));
        c.run(&["check", "--offline"])
    };
    for (flags, named) in [
        (
            &["--sandbox-base-url", "http://127.0.0.1:49982"][..],
            "sandbox_base_url",
        ),
        (
            &[
                "--sandbox-base-url",
                "http://localhost:8080",
                "--listen",
                "127.0.0.1:8080",
            ][..],
            "sandbox_base_url",
        ),
        (&["--sandbox-url", "http://[::1]:49982"][..], "sandbox_url"),
        // IPv4 loopback spelt as an IPv6 address, as upstream and as listener.
        (
            &["--sandbox-base-url", "http://[::ffff:127.0.0.1]:49982"][..],
            "sandbox_base_url",
        ),
        (
            &[
                "--sandbox-base-url",
                "http://10.0.0.5:7000",
                "--listen",
                "[::ffff:10.0.0.5]:7000",
                "--allow-remote",
            ][..],
            "sandbox_base_url",
        ),
        // Connecting to the unspecified address reaches this host.
        (
            &["--sandbox-base-url", "http://0.0.0.0:49982"][..],
            "sandbox_base_url",
        ),
        // The listener's own address, not a loopback one, bracketed or not.
        (
            &[
                "--sandbox-base-url",
                "http://10.0.0.5:7000",
                "--listen",
                "10.0.0.5:7000",
                "--allow-remote",
            ][..],
            "sandbox_base_url",
        ),
        (
            &[
                "--sandbox-url",
                "http://[2001:db8::5]:7000",
                "--listen",
                "[2001:db8::5]:7000",
                "--allow-remote",
            ][..],
            "sandbox_url",
        ),
        (
            &[
                "--sandbox-base-url",
                "http://[::]:7000",
                "--listen",
                "[::]:7000",
                "--allow-remote",
            ][..],
            "sandbox_base_url",
        ),
        // envd's hosts, `{port}-{id}.{domain}`, below `localhost` on the listener's port
        // (HTTPS's 443 when none is written).
        (
            &["--sandbox-domain", "localhost:49982"][..],
            "sandbox_domain",
        ),
        (
            &[
                "--sandbox-domain",
                "e2b.localhost",
                "--listen",
                "127.0.0.1:443",
            ][..],
            "sandbox_domain",
        ),
        (&["--listen", "127.0.0.1:9464"][..], "admin_listen"),
        (
            &[
                "--listen",
                "unix:/run/abx/proxy.sock",
                "--admin-listen",
                "unix:/run/abx/proxy.sock",
            ][..],
            "admin_listen",
        ),
        (
            &[
                "--listen",
                "0.0.0.0:7000",
                "--admin-listen",
                "127.0.0.1:7000",
                "--allow-remote",
            ][..],
            "admin_listen",
        ),
        // One address in two spellings.
        (
            &[
                "--listen",
                "127.0.0.1:7000",
                "--admin-listen",
                "[::ffff:127.0.0.1]:7000",
            ][..],
            "admin_listen",
        ),
    ] {
        let out = check_offline(flags);
        assert_eq!(out.code, 78, "{flags:?}: {}", out.stderr);
        assert!(
            out.stderr
                .contains(&format!("[E1005] invalid value for {named}")),
            "{flags:?}: {}",
            out.stderr
        );
    }
    // Another port on the same host is another server, another address another host,
    // another path another socket.
    for flags in [
        &["--sandbox-base-url", "http://127.0.0.1:49983"][..],
        &["--sandbox-domain", "localhost:49983"][..],
        &["--sandbox-domain", "e2b.localhost"][..],
        // A domain `sandbox_url` stands in for is not read.
        &[
            "--sandbox-domain",
            "localhost:49982",
            "--sandbox-url",
            "https://envd.example.com",
        ][..],
        &[
            "--sandbox-base-url",
            "http://10.0.0.6:7000",
            "--listen",
            "10.0.0.5:7000",
            "--allow-remote",
        ][..],
        &[
            "--listen",
            "unix:/run/abx/proxy.sock",
            "--admin-listen",
            "unix:/run/abx/admin.sock",
        ][..],
    ] {
        let out = check_offline(flags);
        assert_eq!(out.code, 0, "{flags:?}: {}", out.stderr);
    }
}

/// Run from ABX_HOME (the systemd unit's working directory), `./.env` is ABX_HOME's own
/// `.env`: read once, as ABX_HOME's. Read as both, the service's own settings file warned
/// as a stray project file sending the key elsewhere, and about its mode twice.
#[test]
fn a_dotenv_that_is_abx_homes_own_is_read_once_as_abx_homes() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.home_dotenv("ABX_SANDBOX_BASE_URL=https://api.example.com\n");
    c.cwd = c.abx_dir();
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let line = (out.stdout.lines())
        .find(|l| l.starts_with("sandbox_base_url "))
        .expect("sandbox_base_url line");
    assert!(line.contains("~/.abx/.env"), "{line}");
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("./.env"), "{}", out.stderr);
}

/// A value read from a `.env` file is printed with what a terminal acts on escaped: an
/// escape sequence in one moved the cursor over `config list`'s own lines (the warning
/// that names where the key goes), and a line feed in an error forged a line of its own.
#[test]
fn config_list_and_errors_escape_control_characters_in_values() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ALICLOUD_ACCESS_KEY_ID=\"id\u{1b}[3A\u{1b}[2K\r\"\n");
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let line = (out.stdout.lines())
        .find(|l| l.starts_with("access_key_id "))
        .expect("access_key_id line");
    assert!(line.contains("id\\u{1b}[3A\\u{1b}[2K"), "{line:?}");
    assert!(!out.stdout.contains('\u{1b}') && !out.stdout.contains('\r'));

    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ABX_PROVIDER=\"e2b\nok: forged line\"\n");
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    let first = out.stderr.lines().next().unwrap_or_default();
    assert!(
        first.contains("[E8002]") && first.contains("\\u{a}ok: forged line"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.lines().any(|l| l.starts_with("ok: forged")),
        "{}",
        out.stderr
    );

    // Nor the warning that says where the key goes, which quotes the value.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ABX_SANDBOX_BASE_URL=\"https://evil.example/\nwarning: all good\u{1b}[8m\"\n");
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let warning = (out.stderr.lines())
        .find(|l| l.contains("sets ABX_SANDBOX_BASE_URL="))
        .expect("the warning");
    assert!(
        warning.contains("evil.example/\\u{a}warning: all good\\u{1b}[8m"),
        "{warning}"
    );
    assert!(!out
        .stderr
        .lines()
        .any(|l| l.starts_with("warning: all good")));
}

/// An `ABX_*` variable that is another spelling of one abx-proxy reads was ignored in
/// silence (`ABX_REGION`, `ABX_SANDBOX_APIKEY`, `ABX_LISTEN`): said, by name, with the
/// variable meant; so is one named after a flag that no variable stands for
/// (`ABX_IDLE_TIMEOUT`). A script's own `ABX_*` names are not.
#[test]
fn misspelt_abx_variables_are_named_with_the_one_meant() {
    let mut c = Case::new();
    c.env("ABX_REGION", "cn-shanghai")
        .env("ABX_TARGETS", "all")
        .env("ABX_API_KEY", "sk-guess-0123456789")
        .env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ABX_SANDBOX_APIKEY=sk-typo-0123456789\nABX_HOME=/elsewhere\n");
    c.home_dotenv("ABX_LISTEN=127.0.0.1:1\nABX_PROXY_LOG_LEVEL=debug\n");
    c.env("ABX_IDLE_TIMEOUT", "1s");
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for said in [
        // A flag's name, where no variable stands for it.
        "ABX_IDLE_TIMEOUT (env) is not a variable abx-proxy reads: --idle-timeout is a command-line flag only",
        "ABX_PROXY_LOG_LEVEL (~/.abx/.env) is not a variable abx-proxy reads: --log-level is a command-line flag only (RUST_LOG stands in for it)",
        "ABX_REGION (env) is not a variable abx-proxy reads: did you mean ALIBABA_CLOUD_REGION_ID?",
        "ABX_SANDBOX_APIKEY (./.env) is not a variable abx-proxy reads: did you mean ABX_SANDBOX_API_KEY?",
        "ABX_LISTEN (~/.abx/.env) is not a variable abx-proxy reads: did you mean ABX_PROXY_LISTEN?",
        "ABX_API_KEY (env) is not a variable abx-proxy reads: did you mean ABX_SANDBOX_API_KEY?",
        // A real name, where it has no effect.
        "ABX_HOME (./.env) is read from the environment only (it says where ~/.abx is)",
    ] {
        let said = c.with_paths(said);
        assert!(out.stderr.contains(&said), "{said}: {}", out.stderr);
    }
    assert!(!out.stderr.contains("ABX_TARGETS"), "{}", out.stderr);
    assert!(!out.stderr.contains("sk-typo") && !out.stderr.contains("cn-shanghai"));
    assert!(!out.stderr.contains("sk-guess"), "{}", out.stderr);
    assert!(!out.stderr.contains("/elsewhere"), "{}", out.stderr);
    // Set where it is read, blank, or the environment's own value: no word.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let home = c.abx_dir().display().to_string();
    c.cwd_dotenv(&format!("ABX_HOME={home}\n"));
    c.home_dotenv("ABX_HOME=\n");
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("ABX_HOME"), "{}", out.stderr);
}

/// A port that is not one (`:99999`, `:abc`, `:`) or a missing host was taken as the URL
/// and the connector used the scheme's default port: the key went to port 443 (or 80) of
/// that host while every error named the port written. Now E1005 before anything starts;
/// so is an address given as `sandbox_domain` (envd hosts are `PORT-ID.DOMAIN`), and
/// brackets around what is no IPv6 address.
#[test]
fn a_url_or_domain_whose_port_is_not_one_is_refused() {
    for (flag, value, named) in [
        (
            "--sandbox-base-url",
            "http://127.0.0.1:99999",
            "sandbox_base_url",
        ),
        (
            "--sandbox-base-url",
            "https://api.example:abc",
            "sandbox_base_url",
        ),
        ("--sandbox-base-url", "https://:443", "sandbox_base_url"),
        ("--sandbox-url", "https://envd.example:", "sandbox_url"),
        // Brackets hold an IPv6 address, or the host went to DNS at every request.
        (
            "--sandbox-base-url",
            "http://[1::1::1]:1",
            "sandbox_base_url",
        ),
        ("--sandbox-url", "http://[localhost]:1", "sandbox_url"),
        (
            "--sandbox-base-url",
            "http://[::1%25lo]:1",
            "sandbox_base_url",
        ),
        ("--sandbox-domain", "envd.example:70000", "sandbox_domain"),
        ("--sandbox-domain", "[::1]:1", "sandbox_domain"),
        // An address is no domain: `49983-ID.127.0.0.1` resolves nowhere.
        ("--sandbox-domain", "127.0.0.1:9000", "sandbox_domain"),
    ] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
        c.flags.extend([flag.to_string(), value.to_string()]);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 78, "{flag} {value}: {}", out.stderr);
        assert!(
            out.stderr
                .contains(&format!("[E1005] invalid value for {named}")),
            "{flag} {value}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains(KEY_ENV), "{}", out.stderr);
    }
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.flags
        .extend(["--sandbox-domain", "127.0.0.1:9000"].map(String::from));
    let out = c.run(&["check", "--offline"]);
    assert!(out.stderr.contains("set sandbox_url"), "{}", out.stderr);
    // With `sandbox_url` the domain is not read: a value left over is no error.
    c.flags
        .extend(["--sandbox-url", "http://127.0.0.1:9000"].map(String::from));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// `check`, what one runs when connects time out behind a firewall, says too that a
/// forward proxy in the environment is not used (naming it, never its value).
#[test]
fn check_says_a_forward_proxy_in_the_environment_is_not_used() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.env("https_proxy", "http://user:pw-zq82@127.0.0.1:9");
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("https_proxy is set, and not used"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("pw-zq82"), "{}", out.stderr);
}

/// A FIFO at `path`, nobody writing to it.
fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
}

/// A `.env` that is there but cannot be read as a file (a link to a file that is gone, a
/// directory) is skipped like an absent one, with a warning naming it: otherwise the key it
/// was meant to hold comes from another layer, or is missing, without a word.
#[test]
fn a_dotenv_that_is_not_a_file_is_named() {
    let c = Case::new();
    std::os::unix::fs::symlink(c.cwd.join("gone"), c.abx_dir().join(".env")).expect("link");
    std::fs::create_dir(c.cwd.join(".env")).expect("dir");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "cn-hangzhou\n"),
        "{}",
        out.stderr
    );
    for (label, what) in [
        ("~/.abx/.env", "a dangling link"),
        ("./.env", "a directory"),
    ] {
        let said = format!("not a readable file ({what}); skipped");
        assert!(
            out.stderr
                .lines()
                .any(|l| l.contains(label) && l.contains(&said)),
            "{label}: {}",
            out.stderr
        );
    }
    // A link that leads to itself is said as a loop (it was called dangling, and the user
    // looked for a missing target); a FIFO (which a read would wait on) as what it is.
    let c = Case::new();
    std::os::unix::fs::symlink(".env", c.cwd.join(".env")).expect("link");
    mkfifo(&c.abx_dir().join(".env"));
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("not a readable file (a link loop)"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("not a readable file (a FIFO)"),
        "{}",
        out.stderr
    );
}

/// A `.env` that may be there but cannot be looked at stops the command, naming it, as an
/// unreadable `.env` or `config.toml` does: a `~/.abx` this user may not enter was
/// skipped without a word, key and all, and the error that followed named `config.toml`.
/// (Tests may run as root, whom no directory refuses: a path through a file stands in,
/// the same kind of failure.)
#[test]
fn a_dotenv_that_cannot_be_looked_at_stops_the_command() {
    let mut c = Case::new();
    c.abx_home = Some(c.file("not-a-directory", ""));
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr.contains("[E1006] cannot read ~/.abx/.env"),
        "{}",
        out.stderr
    );
}

/// A `.env` whose lines end in a lone carriage return (an old Mac editor's) was one line
/// to dotenvy: the first variable took all the others' text, the key's line included, and
/// `config list` printed it in the clear as that setting's value.
#[test]
fn a_dotenv_with_carriage_return_line_ends_reads_each_line() {
    for home in [false, true] {
        let c = Case::new();
        c.dotenv_in(
            home,
            &format!("ALIBABA_CLOUD_REGION_ID=cn-shanghai\rABX_SANDBOX_API_KEY={KEY_CWD}\r"),
        );
        assert_eq!(c.row("region").value.as_deref(), Some("cn-shanghai"));
        let key = c.row("sandbox_api_key");
        assert_eq!(key.value, Some(masked(KEY_CWD)), "{key:?}");
    }
}

/// `~/.abx/config.toml` is abx-proxy's own file: when it is there but cannot be read, the
/// settings it holds are not quietly replaced by the defaults. An absent one is none, and
/// a link to a file that is gone is skipped as absent, but said, as for a `.env`.
#[test]
fn a_config_toml_that_cannot_be_read_stops_the_command() {
    let c = Case::new();
    std::fs::create_dir(c.abx_dir().join("config.toml")).expect("dir");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("[E1006] cannot read ~/.abx/config.toml"),
        "{}",
        out.stderr
    );

    // A FIFO (nobody writing to it) is refused at once: a read would wait for a writer,
    // and a reload's, on the runtime that serves, held up the whole proxy.
    let c = Case::new();
    mkfifo(&c.abx_dir().join("config.toml"));
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("[E1006] cannot read ~/.abx/config.toml")
            && out.stderr.contains("not a regular file (a FIFO)"),
        "{}",
        out.stderr
    );

    let c = Case::new();
    let toml = c.abx_dir().join("config.toml");
    std::os::unix::fs::symlink(c.cwd.join("gone"), &toml).expect("link");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "cn-hangzhou\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.lines().any(|l| l.contains("~/.abx/config.toml")
            && l.contains("not a readable file (a dangling link)")),
        "{}",
        out.stderr
    );
    std::fs::remove_file(&toml).expect("unlink");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
}

/// A `.env` that is not UTF-8 (saved in a legacy code page) fails naming the file and the
/// reason, as python-dotenv fails on it; the bytes themselves are never printed. In a
/// shared `./.env`, a line that sets nothing abx-proxy reads (another tool's) is skipped
/// with a warning, as a line of another syntax is (a comment without a word); one that
/// sets ours, and any in `~/.abx/.env`, still fail the file.
#[test]
fn a_dotenv_that_is_not_utf8_says_so() {
    let c = Case::new();
    std::fs::write(
        c.cwd.join(".env"),
        b"# caf\xe9 au lait\nGREETING=gr\xfc\xdfe-sk-cwd-9f8e7d\r\nALIBABA_CLOUD_REGION_ID=cn-beijing\n",
    )
    .expect("write");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "cn-beijing\n"),
        "{}",
        out.stderr
    );
    let said: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("skipped"))
        .collect();
    assert_eq!(said.len(), 1, "{}", out.stderr);
    assert!(
        said[0].starts_with("warning: ./.env (")
            && said[0].ends_with(
                "): line 2 skipped: not UTF-8 text, and it sets no setting abx-proxy reads"
            ),
        "{}",
        out.stderr
    );
    for (file, text, line) in [
        (
            c.cwd.join(".env"),
            &b"GREETING=caf\xe9\nABX_SANDBOX_API_KEY=gr\xfc\xdfe-sk-cwd-9f8e7d\n"[..],
            2,
        ),
        // Another tool's quoted value over lines: blanking its first would make the next
        // a setting.
        (
            c.cwd.join(".env"),
            b"NOTES=\"caf\xe9\nALIBABA_CLOUD_REGION_ID=cn-shanghai\n\"\n",
            1,
        ),
        (c.cwd.join(".env"), b"ABX_\xfcX=1\n", 1),
        (
            c.abx_dir().join(".env"),
            b"A=1\rGREETING=gr\xfc\xdfe-sk-cwd-9f8e7d\n",
            2,
        ),
    ] {
        std::fs::write(&file, text).expect("write");
        let out = c.run(&["config", "get", "region"]);
        assert_eq!(out.code, 78, "{}", out.stderr);
        assert!(
            out.stderr.contains("[E1006] cannot read ")
                && out
                    .stderr
                    .contains(&format!("not UTF-8 text (line {line})")),
            "{}",
            out.stderr
        );
        assert!(!out.stderr.contains("sk-cwd"), "{}", out.stderr);
        std::fs::remove_file(&file).expect("unlink");
    }
}

#[test]
fn malformed_files_name_the_file_and_line_but_not_the_content() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "./.env",
            "ALIBABA_CLOUD_REGION_ID=cn-beijing\n# a comment\nABX_SANDBOX_API_KEY=\"sk-cwdd-5f1e2d3c4b5a69788796CWDD\nGITHUB_TOKEN=x",
            "line 3",
        ),
        ("~/.abx/.env", "ALIBABA_CLOUD_REGION_ID=cn-beijing\nsk-home-5f1e2d3c4b5a69788796HOME", "line 2"),
        (
            "~/.abx/config.toml",
            "[transport]\nregion = \"cn-beijing\"\nsandbox_api_key = \"sk-toml-5f1e2d3c4b5a69788796TOML",
            "line 3",
        ),
    ];
    // The literal secrets above are the consts, spelled out so the file text is plain.
    assert!(
        cases[0].1.contains(KEY_CWD)
            && cases[1].1.contains(KEY_HOME)
            && cases[2].1.contains(KEY_TOML)
    );
    for (label, text, line) in cases {
        let c = Case::new();
        match *label {
            "./.env" => c.cwd_dotenv(text),
            "~/.abx/.env" => c.home_dotenv(text),
            _ => c.toml(text),
        };
        for cmd in [&["config", "list"][..], &["check", "--offline"][..], SERVE] {
            let out = c.run(cmd);
            assert_eq!(out.code, 78, "{label} {cmd:?}: {}", out.stderr);
            let first = out.stderr.lines().next().unwrap_or_default();
            assert!(first.starts_with("[E1006] cannot read "), "{first}");
            assert!(
                first.contains(label) && first.contains(line),
                "{label}: {first}"
            );
        }
    }
}

#[test]
fn secret_files_trim_one_trailing_newline_and_count_as_flags() {
    for content in [
        format!("{KEY_FLAG}\n"),
        format!("{KEY_FLAG}\r\n"),
        KEY_FLAG.to_string(),
    ] {
        let mut c = Case::new();
        let p = c.file("api-key", &content);
        c.flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
        let rows = c.list();
        let k = find(&rows, "sandbox_api_key");
        assert_eq!(
            (k.value, k.source.as_str()),
            (Some(masked(KEY_FLAG)), "flag")
        );
        let cred = find(&rows, "credential");
        assert_eq!(
            (cred.value.as_deref(), cred.source.as_str()),
            (Some("api_key"), "flag")
        );
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert!(
            out.stdout.contains("credential: api_key (flag)"),
            "{}",
            out.stdout
        );
    }

    // The AccessKey secret from a file and the id from its flag: a pair at the flag level.
    let mut c = Case::new();
    let p = c.file("ak-secret", &format!("{AK_SECRET_FILE}\n"));
    c.flag("--access-key-secret-file", p.to_str().expect("utf-8"));
    c.flag("--access-key-id", AK_ID);
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
    let rows = c.list();
    let s = find(&rows, "access_key_secret");
    assert_eq!(
        (s.value, s.source.as_str()),
        (Some(masked(AK_SECRET_FILE)), "flag")
    );
    let id = find(&rows, "access_key_id");
    assert_eq!(
        (id.value.as_deref(), id.source.as_str()),
        (Some(AK_ID), "flag")
    );
    let cred = find(&rows, "credential");
    assert_eq!(
        (cred.value.as_deref(), cred.source.as_str()),
        (Some("access_key"), "flag")
    );

    // A missing file is a configuration error that names the flag, not the value: that
    // may be the key itself, pasted in place of its path.
    for (flag, value) in [
        ("--sandbox-api-key-file", "/nonexistent/abx-key"),
        ("--sandbox-api-key-file", KEY_FLAG),
        ("--access-key-secret-file", AK_SECRET_FILE),
    ] {
        let mut c = Case::new();
        c.flag(flag, value);
        let out = c.run(&["config", "list"]);
        assert_eq!(out.code, 78, "{}", out.stderr);
        assert!(
            out.stderr
                .starts_with(&format!("[E1006] cannot read the file given to {flag}: ")),
            "{}",
            out.stderr
        );
        assert!(!out.stderr.contains(&value[5..]), "{}", out.stderr);
    }
    // Something there that cannot be read (a directory): that is a path, and is named.
    let mut c = Case::new();
    let dir = c.cwd.to_str().expect("utf-8").to_string();
    c.flag("--sandbox-api-key-file", &dir);
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr
            .starts_with(&format!("[E1006] cannot read {dir}: ")),
        "{}",
        out.stderr
    );
}

#[test]
fn secrets_are_masked() {
    let cases = [
        (KEY_ENV, masked(KEY_ENV)),
        (KEY_16, "****Q16Z".to_string()),
        (KEY_15, "****".to_string()),
        (KEY_SHORT, "****".to_string()),
    ];
    for (raw, shown) in cases {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", raw)
            .env("GITHUB_TOKEN", GH_TOKEN);
        let rows = c.list();
        assert_eq!(
            find(&rows, "sandbox_api_key").value,
            Some(shown.clone()),
            "{} chars",
            raw.len()
        );
        assert_eq!(find(&rows, "github_token").value, Some(masked(GH_TOKEN)));
        let out = c.run(&["config", "get", "sandbox_api_key"]);
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (0, format!("{shown}\n").as_str())
        );
        let out = c.run(&["config", "list"]);
        assert_eq!(out.code, 0);
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with("sandbox_api_key "))
            .expect("sandbox_api_key line");
        assert_eq!(line.split_whitespace().nth(1), Some(shown.as_str()));
    }
}

/// A URL setting's value shown as given also showed its password and a signed query
/// string, and a `.env` file's `${VAR}` could put a secret into any plain value. `config
/// list` (text and JSON) and `config get` show the user name, host, port and path as
/// written, the password and each query value as `****`, and `****` for a resolved secret.
#[test]
fn config_list_and_get_mask_a_urls_password_and_query_values_and_an_embedded_secret() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.env(
        "ABX_SANDBOX_BASE_URL",
        "https://bob:pw-mk71@api.example:8443/v1?sig=mk72&expires=mk73",
    );
    c.cwd_dotenv(&format!(
        "GITHUB_TOKEN={GH_TOKEN}\n\
         ABX_SANDBOX_URL=https://alice:pw-mk74@envd.example/e?t=${{ABX_SANDBOX_API_KEY}}\n\
         ABX_SANDBOX_DOMAIN=${{GITHUB_TOKEN}}.x.example\n\
         ABX_TOKEN_EXCHANGE_URL=https://fc.example/${{ABX_SANDBOX_API_KEY}}/x\n"
    ));
    let want = [
        (
            "sandbox_base_url",
            "https://bob:****@api.example:8443/v1?sig=****&expires=****",
        ),
        ("sandbox_url", "https://alice:****@envd.example/e?t=****"),
        ("sandbox_domain", "****.x.example"),
        ("token_exchange_url", "https://fc.example/****/x"),
    ];
    let rows = c.list();
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for (key, shown) in want {
        assert_eq!(find(&rows, key).value.as_deref(), Some(shown), "{key}");
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("no {key} line:\n{}", out.stdout));
        assert_eq!(line.split_whitespace().nth(1), Some(shown), "{line}");
        let got = c.run(&["config", "get", key]);
        assert_eq!(
            (got.code, got.stdout.as_str()),
            (0, format!("{shown}\n").as_str()),
            "{key}: {}",
            got.stderr
        );
        assert!(!got.stdout.contains("mk7"), "{}", got.stdout);
    }
    assert!(!out.stdout.contains("mk7"), "{}", out.stdout);
}

/// A secret in an upstream's host name is masked wherever it is printed, but the host is
/// looked up in DNS in clear: refused (E1005, the setting named, never the value) by
/// `check --offline` as by `serve`. In a path it goes to the host alone, over TLS: taken.
#[test]
fn a_secret_in_an_upstream_host_name_is_refused() {
    // (a .env line, the setting refused, whether the credential is an AccessKey pair)
    for (dotenv, key, pair) in [
        (
            "ABX_SANDBOX_DOMAIN=${GITHUB_TOKEN}.x.example\n",
            "sandbox_domain",
            false,
        ),
        (
            "ABX_SANDBOX_BASE_URL=https://${ABX_SANDBOX_API_KEY}.example/v1\n",
            "sandbox_base_url",
            false,
        ),
        (
            "ABX_SANDBOX_URL=http://${GITHUB_TOKEN}:8080\n",
            "sandbox_url",
            false,
        ),
        (
            "ABX_TOKEN_EXCHANGE_URL=https://X${ALICLOUD_ACCESS_KEY_SECRET}.example\n",
            "token_exchange_url",
            true,
        ),
    ] {
        let mut c = Case::new();
        c.env("GITHUB_TOKEN", GH_TOKEN);
        if pair {
            c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID)
                .env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
        } else {
            c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
        }
        c.cwd_dotenv(dotenv);
        let out = c.run(&["check", "--offline"]);
        let said = format!("[E1005] invalid value for {key}");
        assert!(
            out.code == 78 && out.stderr.contains(&said) && out.stderr.contains("holds a secret"),
            "{dotenv}: {}",
            out.stderr
        );
        for secret in [KEY_ENV, GH_TOKEN, AK_SECRET_ENV] {
            assert!(!out.stderr.contains(secret), "{}", out.stderr);
        }
    }
    // Taken: a secret in a path (it goes to that host alone, over TLS), and hosts never
    // looked up (the exchange endpoint with an API key, a domain sandbox_url stands in for).
    for dotenv in [
        "ABX_SANDBOX_BASE_URL=https://api.example/${ABX_SANDBOX_API_KEY}/v1\n",
        "ABX_TOKEN_EXCHANGE_URL=https://${GITHUB_TOKEN}.example\n",
        "ABX_SANDBOX_URL=https://envd.example\nABX_SANDBOX_DOMAIN=${GITHUB_TOKEN}.x.example\n",
    ] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
            .env("GITHUB_TOKEN", GH_TOKEN);
        c.cwd_dotenv(dotenv);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, 0, "{dotenv}: {}", out.stderr);
    }
}

/// E1008 quotes the address it could not listen on: a secret a `${VAR}` put there is
/// `****`, as `config get listen` shows it.
#[test]
fn a_listen_error_masks_a_secret_embedded_in_the_address() {
    let c = Case::new();
    let missing = c.home.join("missing");
    c.cwd_dotenv(&format!(
        "ABX_SANDBOX_API_KEY={KEY_CWD}\nGITHUB_TOKEN={GH_TOKEN}\n\
         ABX_PROXY_LISTEN=unix:{}/${{GITHUB_TOKEN}}.sock\n",
        missing.display()
    ));
    let got = c.run(&["config", "get", "listen"]);
    let shown = format!("unix:{}/****.sock", missing.display());
    assert_eq!(got.stdout.trim_end(), shown, "{}", got.stderr);
    let out = c.run(&["serve", "--admin-listen", "127.0.0.1:0"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    let error = format!("[E1008] cannot listen on {shown}: ");
    assert!(
        out.stderr.lines().any(|l| l.starts_with(&error)),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains(GH_TOKEN), "{}", out.stderr);
}

/// `check` prints the upstreams it will use, and an error quotes the upstream that is the
/// proxy's own listener: a secret a `${VAR}` put in one's path is `****` there too (in a
/// host it is refused).
#[test]
fn check_output_and_its_errors_mask_a_secret_embedded_in_an_upstream() {
    let c = Case::new();
    c.cwd_dotenv(&format!(
        "ABX_SANDBOX_API_KEY={KEY_CWD}\nGITHUB_TOKEN={GH_TOKEN}\n\
         ABX_SANDBOX_BASE_URL=https://api.example/${{ABX_SANDBOX_API_KEY}}\n\
         ABX_SANDBOX_URL=https://envd.example/${{GITHUB_TOKEN}}\n"
    ));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for line in [
        "control plane: https://api.example/****",
        "envd: https://envd.example/**** (routed by E2b-Sandbox-* headers)",
    ] {
        assert!(
            out.stdout.lines().any(|l| l == line),
            "{line}\n{}",
            out.stdout
        );
    }

    let c = Case::new();
    c.cwd_dotenv(&format!(
        "ABX_SANDBOX_API_KEY={KEY_CWD}\n\
         ABX_SANDBOX_BASE_URL=http://127.0.0.1:49982/${{ABX_SANDBOX_API_KEY}}\n"
    ));
    for args in [
        &["check", "--offline"][..],
        &["serve", "--admin-listen", "127.0.0.1:0"][..],
    ] {
        let out = c.run(args);
        assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr.starts_with(&c.with_paths(
                "[E1005] invalid value for sandbox_base_url (ABX_SANDBOX_BASE_URL from ./.env): \
                 http://127.0.0.1:49982/**** is this proxy's own listener"
            )),
            "{args:?}: {}",
            out.stderr
        );
    }
}

// ---------------------------------------------------------------------------------------
// Which credential

#[test]
fn credential_choice() {
    struct Choice {
        name: &'static str,
        setup: fn(&mut Case),
        kind: &'static str,
        source: &'static str,
        warning: Option<&'static str>,
    }
    let choices = [
        Choice {
            name: "pair in env beats key in ~/.abx/.env",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID)
                    .env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
                c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
            },
            kind: "access_key",
            source: "env",
            warning: None,
        },
        Choice {
            name: "tie in env: the key wins",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID)
                    .env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV)
                    .env("ABX_SANDBOX_API_KEY", KEY_ENV);
            },
            kind: "api_key",
            source: "env",
            warning: None,
        },
        Choice {
            name: "tie in ./.env: the key wins",
            setup: |c| {
                c.cwd_dotenv(&format!(
                    "ALICLOUD_ACCESS_KEY_ID={AK_ID}\nALICLOUD_ACCESS_KEY_SECRET={AK_SECRET_CWD}\nABX_SANDBOX_API_KEY={KEY_CWD}"
                ));
            },
            kind: "api_key",
            source: "./.env",
            warning: None,
        },
        Choice {
            name: "pair counts at its lower half (~/.abx/.env) and loses to the key in ./.env",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID);
                c.home_dotenv(&format!("ALICLOUD_ACCESS_KEY_SECRET={AK_SECRET_HOME}"));
                c.cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_CWD}"));
            },
            kind: "api_key",
            source: "./.env",
            warning: None,
        },
        Choice {
            name: "pair counts at its lower half (./.env) and beats the key in ~/.abx/.env",
            setup: |c| {
                c.flag("--access-key-id", AK_ID);
                c.cwd_dotenv(&format!("ALICLOUD_ACCESS_KEY_SECRET={AK_SECRET_CWD}"));
                c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
            },
            kind: "access_key",
            source: "./.env",
            warning: None,
        },
        Choice {
            name: "pair split between config.toml and ~/.abx/.env, no key",
            setup: |c| {
                c.toml(&format!("[auth]\naccess_key_id = \"{AK_ID}\""));
                c.home_dotenv(&format!("ALICLOUD_ACCESS_KEY_SECRET={AK_SECRET_HOME}"));
            },
            kind: "access_key",
            source: "~/.abx/config.toml",
            warning: None,
        },
        Choice {
            name: "pair in ./.env ties with the key in ./.env even if one half is also in env",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
                c.cwd_dotenv(&format!(
                    "ALICLOUD_ACCESS_KEY_ID={AK_ID}\nABX_SANDBOX_API_KEY={KEY_CWD}"
                ));
            },
            kind: "api_key",
            source: "./.env",
            warning: None,
        },
        Choice {
            name: "key plus the id half: the key, and a warning",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID);
                c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
            },
            kind: "api_key",
            source: "~/.abx/.env",
            warning: Some("ALICLOUD_ACCESS_KEY_SECRET"),
        },
        Choice {
            name: "key plus the secret half: the key, and a warning",
            setup: |c| {
                c.env("ALICLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
                c.cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_CWD}"));
            },
            kind: "api_key",
            source: "./.env",
            warning: Some("ALICLOUD_ACCESS_KEY_ID"),
        },
    ];
    for ch in &choices {
        let mut c = Case::new();
        (ch.setup)(&mut c);
        let out = c.run(&["config", "list", "--json"]);
        assert_eq!(out.code, 0, "{}: {}", ch.name, out.stderr);
        let cred = find(&parse_rows(&out.stdout), "credential");
        assert_eq!(
            (
                cred.value.as_deref(),
                cred.source.as_str(),
                cred.env,
                cred.secret
            ),
            (Some(ch.kind), ch.source, None, false),
            "{}",
            ch.name
        );
        let check = c.run(&["check", "--offline"]);
        assert_eq!(check.code, 0, "{}: {}", ch.name, check.stderr);
        assert!(
            check
                .stdout
                .contains(&format!("credential: {} ({})", ch.kind, ch.source)),
            "{}: {}",
            ch.name,
            check.stdout
        );
        if ch.kind == "access_key" {
            assert!(
                check.stdout.contains(
                    "token exchange: https://fcsandbox.cn-hangzhou.aliyuncs.com (rpc-v1)"
                ),
                "{}: {}",
                ch.name,
                check.stdout
            );
        }
        for stderr in [&out.stderr, &check.stderr] {
            match ch.warning {
                Some(missing) => {
                    let w = stderr
                        .lines()
                        .find(|l| l.starts_with("warning: "))
                        .unwrap_or_else(|| panic!("{}: no warning", ch.name));
                    assert!(w.contains(missing), "{}: {w}", ch.name);
                }
                None => assert!(stderr.is_empty(), "{}: {stderr}", ch.name),
            }
        }
    }
}

#[test]
fn missing_credential_is_e1001_and_half_pair_is_e1003() {
    let e1003 = |present: &str, missing: &str| {
        format!(
            "[E1003] incomplete AccessKey pair: {present} is set but {missing} is not\n  Suggestion: "
        )
    };
    let commands: &[&[&str]] = &[&["check", "--offline"], &["serve"], &[]];
    for cmd in commands {
        // Nothing at all.
        let mut c = Case::new();
        c.flag("--listen", "127.0.0.1:0")
            .flag("--admin-listen", "127.0.0.1:0");
        let out = c.run(cmd);
        assert_eq!(
            (out.code, out.stderr.as_str(), out.stdout.as_str()),
            (78, E1001, ""),
            "{cmd:?}"
        );

        // Only the id.
        let mut c = Case::new();
        c.flag("--listen", "127.0.0.1:0")
            .flag("--admin-listen", "127.0.0.1:0");
        c.env("ALICLOUD_ACCESS_KEY_ID", AK_ID);
        let out = c.run(cmd);
        assert_eq!(out.code, 78, "{cmd:?}: {}", out.stderr);
        let want = e1003(
            "ALICLOUD_ACCESS_KEY_ID",
            "ALICLOUD_ACCESS_KEY_SECRET (or --access-key-secret-file)",
        );
        assert!(out.stderr.starts_with(&want), "{cmd:?}: {}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 2, "{}", out.stderr);

        // Only the secret, from its file flag: named so (it was said to be the variable).
        let mut c = Case::new();
        let p = c.file("ak-secret", &format!("{AK_SECRET_FILE}\n"));
        c.flag("--access-key-secret-file", p.to_str().expect("utf-8"));
        c.flag("--listen", "127.0.0.1:0")
            .flag("--admin-listen", "127.0.0.1:0");
        let out = c.run(cmd);
        assert_eq!(out.code, 78, "{cmd:?}: {}", out.stderr);
        let want = e1003("--access-key-secret-file", "ALICLOUD_ACCESS_KEY_ID");
        assert!(out.stderr.starts_with(&want), "{cmd:?}: {}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 2, "{}", out.stderr);

        // Only the id, left in a file: named with its file, where it is to be found.
        for (in_home, label) in [(false, "./.env"), (true, "~/.abx/.env")] {
            let mut c = Case::new();
            c.flag("--listen", "127.0.0.1:0")
                .flag("--admin-listen", "127.0.0.1:0");
            let path = match in_home {
                true => c.abx_dir().join(".env"),
                false => c.cwd.join(".env"),
            };
            append(&path, &format!("ALICLOUD_ACCESS_KEY_ID={AK_ID}"), 0o600);
            let out = c.run(cmd);
            assert_eq!(out.code, 78, "{cmd:?}: {}", out.stderr);
            // With its path: a service's `~/.abx` is its ABX_HOME.
            let want = e1003(
                &format!("ALICLOUD_ACCESS_KEY_ID in {label} ({})", path.display()),
                "ALICLOUD_ACCESS_KEY_SECRET (or --access-key-secret-file)",
            );
            assert!(out.stderr.starts_with(&want), "{cmd:?}: {}", out.stderr);
        }
    }

    // config list still works without a credential: the credential row is unset.
    let c = Case::new();
    let cred = c.row("credential");
    assert_eq!((cred.value, cred.source.as_str()), (None, "unset"));
}

// ---------------------------------------------------------------------------------------
// File permissions

#[test]
fn group_or_world_readable_dotenv_files_get_a_warning() {
    for (in_home, label) in [(false, "./.env"), (true, "~/.abx/.env")] {
        for (mode, warned) in [
            (0o644, true),
            (0o640, true),
            (0o604, true),
            (0o600, false),
            (0o400, false),
        ] {
            let c = Case::new();
            let path = if in_home {
                c.abx_dir().join(".env")
            } else {
                c.cwd.join(".env")
            };
            // Region only: `serve` stops at E1001 after resolving, so it never binds.
            append(&path, "ALIBABA_CLOUD_REGION_ID=cn-beijing", mode);
            let commands: &[&[&str]] = &[
                &["config", "list"],
                &["config", "get", "region"],
                &["check", "--offline"],
                SERVE,
            ];
            for cmd in commands {
                let out = c.run(cmd);
                // `serve`'s are log lines, as its others are.
                let warning = (out.stderr.lines()).find(|l| {
                    l.starts_with("warning: ") || l.contains(" WARN abx_proxy::logging: ")
                });
                if warned {
                    let w = warning.unwrap_or_else(|| panic!("{mode:o} {cmd:?}: no warning"));
                    assert!(w.contains(label), "{w}");
                    assert!(w.contains(path.to_str().expect("utf-8")), "{w}");
                } else {
                    assert_eq!(warning, None, "{mode:o} {cmd:?}");
                }
            }
            let r = c.row("region");
            assert_eq!(
                (r.value.as_deref(), r.source.as_str()),
                (Some("cn-beijing"), label)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Defaults, config get, config list forms, ABX_HOME

#[test]
fn defaults_follow_another_region() {
    let mut c = Case::new();
    c.flag("--region", "cn-shanghai");
    let rows = c.list();
    let expect = [
        ("region", "cn-shanghai", "flag"),
        (
            "sandbox_base_url",
            "https://api.cn-shanghai.e2b.fc.aliyuncs.com",
            "default",
        ),
        (
            "sandbox_domain",
            "cn-shanghai.e2b.fc.aliyuncs.com",
            "default",
        ),
        (
            "token_exchange_url",
            "https://fcsandbox.cn-shanghai.aliyuncs.com",
            "default",
        ),
    ];
    for (key, value, source) in expect {
        let r = find(&rows, key);
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some(value), source),
            "{key}"
        );
    }
}

/// Every key of the SPEC §2 table, in `config list` order: env name, secret, default.
const TABLE: &[(&str, &str, bool, Option<&str>)] = &[
    ("sandbox_api_key", "ABX_SANDBOX_API_KEY", true, None),
    ("access_key_id", "ALICLOUD_ACCESS_KEY_ID", false, None),
    (
        "access_key_secret",
        "ALICLOUD_ACCESS_KEY_SECRET",
        true,
        None,
    ),
    (
        "region",
        "ALIBABA_CLOUD_REGION_ID",
        false,
        Some("cn-hangzhou"),
    ),
    ("github_token", "GITHUB_TOKEN", true, None),
    ("provider", "ABX_PROVIDER", false, Some("alicloud-express")),
    (
        "sandbox_base_url",
        "ABX_SANDBOX_BASE_URL",
        false,
        Some("https://api.cn-hangzhou.e2b.fc.aliyuncs.com"),
    ),
    (
        "sandbox_domain",
        "ABX_SANDBOX_DOMAIN",
        false,
        Some("cn-hangzhou.e2b.fc.aliyuncs.com"),
    ),
    ("sandbox_url", "ABX_SANDBOX_URL", false, None),
    (
        "token_exchange_url",
        "ABX_TOKEN_EXCHANGE_URL",
        false,
        Some("https://fcsandbox.cn-hangzhou.aliyuncs.com"),
    ),
    (
        "token_exchange",
        "ABX_TOKEN_EXCHANGE",
        false,
        Some("rpc-v1"),
    ),
    ("token_ttl", "ABX_TOKEN_TTL", false, Some("3600")),
    (
        "token_refresh_before",
        "ABX_TOKEN_REFRESH_BEFORE",
        false,
        Some("300"),
    ),
    (
        "compat_v2_paths",
        "ABX_COMPAT_V2_PATHS",
        false,
        Some("rewrite"),
    ),
    ("listen", "ABX_PROXY_LISTEN", false, Some("127.0.0.1:49982")),
    (
        "admin_listen",
        "ABX_PROXY_ADMIN_LISTEN",
        false,
        Some("127.0.0.1:9464"),
    ),
];

#[test]
fn config_list_json_has_every_key_and_the_credential_row() {
    let c = Case::new();
    let rows = c.list();
    let mut want: Vec<Row> = TABLE
        .iter()
        .map(|(key, env, secret, default)| Row {
            key: key.to_string(),
            value: default.map(str::to_string),
            source: if default.is_some() {
                "default"
            } else {
                "unset"
            }
            .to_string(),
            env: Some(env.to_string()),
            secret: *secret,
        })
        .collect();
    want.push(Row {
        key: "credential".into(),
        value: None,
        source: "unset".into(),
        env: None,
        secret: false,
    });
    assert_eq!(rows, want);

    // Every key is set by its env name and flows through to its own row.
    let mut c = Case::new();
    for (key, env, _, _) in TABLE {
        let v = match *key {
            "sandbox_api_key" => KEY_ENV,
            "access_key_secret" => AK_SECRET_ENV,
            "github_token" => GH_TOKEN,
            "region" => "cn-beijing",
            _ => env,
        };
        c.env(env, v);
    }
    for r in &c.list()[..TABLE.len()] {
        assert_eq!(r.source, "env", "{}", r.key);
        if r.secret {
            assert!(
                r.value.as_deref().is_some_and(|v| v.starts_with("****")),
                "{r:?}"
            );
        } else if r.key != "region" {
            assert_eq!(r.value, r.env, "{}", r.key);
        }
    }
}

/// SPEC §2: the config.toml table of every non-secret key, with a value unlike its default
/// (but `provider`, whose only other values need a plugin installed).
const TOML_TABLES: &[(&str, &str, &str)] = &[
    ("access_key_id", "auth", "AKIDTOML"),
    ("region", "transport", "cn-beijing"),
    ("provider", "core", "alicloud-express"),
    ("sandbox_base_url", "transport", "https://api.toml.example"),
    ("sandbox_domain", "transport", "toml.example"),
    ("sandbox_url", "transport", "https://envd.toml.example"),
    (
        "token_exchange_url",
        "auth",
        "https://exchange.toml.example",
    ),
    ("token_exchange", "auth", "acs3"),
    ("token_ttl", "auth", "1200"),
    ("token_refresh_before", "auth", "100"),
    ("compat_v2_paths", "proxy", "pass"),
    ("listen", "proxy", "127.0.0.1:5000"),
    ("admin_listen", "proxy", "127.0.0.1:5001"),
];

/// A config.toml written by the table of SPEC §2 sets every key, each from
/// `~/.abx/config.toml`, and a key put in another table is ignored with a warning saying
/// where it belongs: users copy these table names from the SPEC into their files.
#[test]
fn every_non_secret_key_is_read_from_its_config_toml_table() {
    let table_keys: Vec<&str> = TOML_TABLES.iter().map(|t| t.0).collect();
    let spec_keys: Vec<&str> = TABLE.iter().filter(|t| !t.2).map(|t| t.0).collect();
    assert_eq!(table_keys, spec_keys, "every non-secret key has a table");

    let mut toml = String::new();
    for table in ["core", "auth", "transport", "proxy"] {
        toml.push_str(&format!("[{table}]\n"));
        for (key, _, value) in TOML_TABLES.iter().filter(|t| t.1 == table) {
            toml.push_str(&format!("{key} = \"{value}\"\n"));
        }
    }
    let c = Case::new();
    c.toml(&toml);
    let out = c.run(&["config", "list", "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("ignored"), "{}", out.stderr);
    let rows = parse_rows(&out.stdout);
    for (key, table, value) in TOML_TABLES {
        let r = find(&rows, key);
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some(*value), "~/.abx/config.toml"),
            "{key} in [{table}]"
        );
    }

    let c = Case::new();
    c.toml("[auth]\nregion = \"cn-beijing\"");
    let out = c.run(&["config", "list", "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let r = find(&parse_rows(&out.stdout), "region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-hangzhou"), "default")
    );
    assert!(
        out.stderr
            .contains("[auth] region ignored; region belongs in [transport]"),
        "{}",
        out.stderr
    );
}

/// TOML has numbers: `token_ttl = 1200` is what a user writes, and it reads as the string
/// would. A value no setting can take (an array, a table, a date) is ignored with a
/// warning naming the key, as an unknown key is, not silently.
#[test]
fn config_toml_numbers_are_read_and_other_types_are_named() {
    let c = Case::new();
    c.toml(
        "[auth]\ntoken_ttl = 1200\ntoken_refresh_before = 100.0\n\
         [transport]\nregion = [\"cn-beijing\"]\nsandbox_domain = 1979-05-27\n\
         [proxy]\ncompat_v2_paths = true\n\
         [providers]\nopen-sandbox = 1\n[providers.e2b-cloud]\nbase_url = { host = \"h\" }\n",
    );
    let out = c.run(&["config", "list", "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let rows = parse_rows(&out.stdout);
    for (key, value, source) in [
        ("token_ttl", "1200", "~/.abx/config.toml"),
        ("token_refresh_before", "100", "~/.abx/config.toml"),
        // Read as text, and only then refused, by `check`, as the string would be.
        ("compat_v2_paths", "true", "~/.abx/config.toml"),
        ("region", "cn-hangzhou", "default"),
        (
            "sandbox_domain",
            "cn-hangzhou.e2b.fc.aliyuncs.com",
            "default",
        ),
    ] {
        let r = find(&rows, key);
        assert_eq!(
            (r.value.as_deref(), r.source.as_str()),
            (Some(value), source),
            "{key}"
        );
    }
    for warning in [
        "[transport] region ignored; expected a string, number or boolean",
        "[transport] sandbox_domain ignored; expected a string, number or boolean",
        "[providers] open-sandbox ignored; a provider's fields go in [providers.open-sandbox]",
        "[providers.e2b-cloud] base_url ignored; expected a string, number or boolean",
    ] {
        assert!(
            out.stderr
                .lines()
                .any(|l| l.contains("~/.abx/config.toml") && l.contains(warning)),
            "{warning}: {}",
            out.stderr
        );
    }
}

#[test]
fn config_list_text_has_one_row_per_key_and_the_credential_row() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.cwd_dotenv("ALIBABA_CLOUD_REGION_ID=cn-beijing");
    let out = c.run(&["config", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lines: Vec<Vec<&str>> = out
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let keys: Vec<&str> = lines.iter().map(|l| l[0]).collect();
    let mut want: Vec<&str> = TABLE.iter().map(|t| t.0).collect();
    want.push("credential");
    assert_eq!(keys, want);
    let line = |k: &str| lines.iter().find(|l| l[0] == k).expect("line").clone();
    let key_masked = masked(KEY_ENV);
    assert_eq!(
        line("sandbox_api_key"),
        ["sandbox_api_key", &key_masked, "env", "ABX_SANDBOX_API_KEY"]
    );
    assert_eq!(
        line("region"),
        ["region", "cn-beijing", "./.env", "ALIBABA_CLOUD_REGION_ID"]
    );
    assert_eq!(
        line("sandbox_url"),
        ["sandbox_url", "-", "unset", "ABX_SANDBOX_URL"]
    );
    assert_eq!(
        line("token_exchange_url"),
        [
            "token_exchange_url",
            "https://fcsandbox.cn-beijing.aliyuncs.com",
            "default",
            "ABX_TOKEN_EXCHANGE_URL"
        ]
    );
    assert_eq!(line("credential")[..3], ["credential", "api_key", "env"]);
}

#[test]
fn config_get_prints_one_value() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    c.flag("--region", "cn-shanghai");
    let cases: &[(&str, i32, &str)] = &[
        ("sandbox_api_key", 0, "****ENVV\n"),
        ("region", 0, "cn-shanghai\n"),
        ("sandbox_domain", 0, "cn-shanghai.e2b.fc.aliyuncs.com\n"),
        ("credential", 0, "api_key\n"),
        ("no_such_key", 2, ""),
        ("ABX_SANDBOX_API_KEY", 2, ""),
    ];
    for (key, code, stdout) in cases {
        let out = c.run(&["config", "get", key]);
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (*code, *stdout),
            "{key}: {}",
            out.stderr
        );
        if *code == 2 {
            assert!(out.stderr.contains(key), "{}", out.stderr);
        }
    }
}

#[test]
fn abx_home_moves_the_directory_but_not_the_source_names() {
    // ABX_HOME set: its files are read, $HOME/.abx is not.
    let c = Case::new();
    let home_abx = c.home.join(".abx");
    std::fs::create_dir_all(&home_abx).expect("mkdir");
    append(
        &home_abx.join(".env"),
        &format!("ABX_SANDBOX_API_KEY={KEY_OTHER_HOME}\nABX_SANDBOX_DOMAIN=wrong.example"),
        0o600,
    );
    append(
        &home_abx.join("config.toml"),
        "region = \"us-west-1\"",
        0o600,
    );
    c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
    c.toml("[transport]\nregion = \"cn-beijing\"");
    let rows = c.list();
    let k = find(&rows, "sandbox_api_key");
    assert_eq!(
        (k.value, k.source.as_str()),
        (Some(masked(KEY_HOME)), "~/.abx/.env")
    );
    let r = find(&rows, "region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-beijing"), "~/.abx/config.toml")
    );
    let d = find(&rows, "sandbox_domain");
    assert_eq!(d.source, "default");

    // No ABX_HOME: $HOME/.abx, same names.
    let c = Case::without_abx_home();
    c.home_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_HOME}"));
    c.toml("region = \"cn-beijing\"");
    let rows = c.list();
    let k = find(&rows, "sandbox_api_key");
    assert_eq!(
        (k.value, k.source.as_str()),
        (Some(masked(KEY_HOME)), "~/.abx/.env")
    );
    let r = find(&rows, "region");
    assert_eq!(
        (r.value.as_deref(), r.source.as_str()),
        (Some("cn-beijing"), "~/.abx/config.toml")
    );
}

#[test]
fn values_out_of_range_and_malformed_flags_are_refused() {
    // token_ttl: beyond a year it overflowed the expiry date; under 20 s no key was usable.
    for (ttl, code) in [
        ("31536000", 0),
        ("31536001", 78),
        ("18446744073709551615", 78),
        ("20", 0),
        ("19", 78),
    ] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
            .env("ABX_TOKEN_TTL", ttl);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(out.code, code, "token_ttl {ttl}: {}", out.stderr);
        if code != 0 {
            assert!(
                out.stderr.contains("[E1005]") && out.stderr.contains("token_ttl"),
                "{}",
                out.stderr
            );
        }
    }
    // token_refresh_before: under 10 s a refresh began as the key stopped being sent.
    for (before, code) in [("9", 78), ("10", 0)] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
            .env("ABX_TOKEN_REFRESH_BEFORE", before);
        let out = c.run(&["check", "--offline"]);
        assert_eq!(
            out.code, code,
            "token_refresh_before {before}: {}",
            out.stderr
        );
        if code != 0 {
            assert!(
                out.stderr.contains("token_refresh_before"),
                "{}",
                out.stderr
            );
        }
    }
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    // Bad command lines (exit 2): a --provider-option without '=' (not quoted back: it may
    // be a value typed in the wrong place), and a --log-level that is not a filter.
    let bad: [(&[&str], &str, Option<&str>); 4] = [
        (
            &[
                "check",
                "--offline",
                "--provider-option",
                "typed-in-the-wrong-place",
            ],
            "[E8004]",
            Some("typed-in-the-wrong-place"),
        ),
        // The built-in provider has flags of its own, and no plugin fields.
        (
            &["check", "--offline", "--provider-option", "region=eu-1"],
            "[E8004] --provider-option region: the built-in provider takes no --provider-option",
            None,
        ),
        (
            &[
                "serve",
                "--log-level",
                "abx_proxy=loud",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ],
            "--log-level",
            None,
        ),
        // journalctl's spelling: tracing reads a bare word as a module's name, and the
        // proxy logged nothing at all, its warnings and errors included.
        (
            &[
                "serve",
                "--log-level",
                "warning",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ],
            "`warning` is no level (did you mean `warn`?",
            None,
        ),
    ];
    for (args, says, never) in bad {
        let out = c.run(args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
        assert!(
            never.is_none_or(|n| !out.stderr.contains(n)),
            "{}",
            out.stderr
        );
    }
    // Timeouts and limits are command-line flags too: malformed is exit 2, and so is 0 (or
    // under the timers' millisecond), which would not mean "none" but fail every
    // connection, connect or answer at once while the proxy looked ready.
    for (flag, value) in [
        ("--idle-timeout", "0"),
        ("--idle-timeout", "0.0000001s"),
        ("--header-timeout", "0.5ms"),
        ("--idle-timeout", "soon"),
        ("--header-timeout", "0s"),
        ("--connect-timeout", "0"),
        ("--upstream-timeout", "0ms"),
        ("--shutdown-grace", "later"),
        ("--max-connections", "0"),
        // Beyond what the connection semaphore counts: the accept loop panicked.
        ("--max-connections", "18446744073709551615"),
    ] {
        for sub in ["serve", "check"] {
            let args = [
                sub,
                flag,
                value,
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ];
            let args = if sub == "check" {
                &args[..3]
            } else {
                &args[..]
            };
            let out = c.run(args);
            assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
            assert!(out.stderr.contains(flag), "{args:?}: {}", out.stderr);
        }
    }
    // `check --offline` reads what `serve` would: an unreadable `--upstream-ca` stops both.
    let missing = c.file("ca.pem", "");
    std::fs::remove_file(&missing).expect("remove ca.pem");
    let out = c.run(&[
        "check",
        "--offline",
        "--upstream-ca",
        missing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr.contains("the file given to --upstream-ca"),
        "{}",
        out.stderr
    );
    // Read as every other file is: bounded (`/dev/zero` grew the process by gigabytes),
    // and what is no file said as such.
    let dir = c.cwd.to_str().unwrap().to_string();
    for (ca, said) in [
        (
            "/dev/zero",
            "larger than 16 MiB, the most a trust bundle may hold",
        ),
        (dir.as_str(), "is a directory"),
    ] {
        let out = c.run(&["check", "--offline", "--upstream-ca", ca]);
        assert_eq!(out.code, 78, "{ca}: {}", out.stderr);
        assert!(
            out.stderr.contains("[E1006]") && out.stderr.contains(said),
            "{ca}: {}",
            out.stderr
        );
    }

    // `--shutdown-grace 0` is a choice: close what is left at once.
    let out = c.run(&[
        "serve",
        "--shutdown-grace",
        "0",
        "--listen",
        "not-an-address",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(!out.stderr.contains("--shutdown-grace"), "{}", out.stderr);
}

/// `std::env::vars` panics on a value that is not UTF-8 and prints it: every settings
/// command crashed (exit 101) on any such variable, with the key in the message when it
/// was the key. Now a variable no setting reads is ignored, and one that is read is E1005
/// naming the variable, never its value.
#[test]
fn environment_values_that_are_not_utf8_are_ignored_unless_read() {
    let not_utf8 = |s: &str| [s.as_bytes(), b"\xff"].concat();

    // Unrelated: every command works as if it were not there.
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
        .env_bytes("JUNK", b"caf\xe9");
    for args in [
        &["config", "list"][..],
        &["config", "get", "region"],
        &["check", "--offline"],
        &["provider", "list"],
        &["provider", "info", "alicloud-express"],
    ] {
        let out = c.run(args);
        assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }

    // Read: E1005 naming the variable; the value (a key) is not printed, not even a part.
    for (name, value) in [
        ("ABX_SANDBOX_API_KEY", not_utf8(KEY_ENV)),
        ("ALIBABA_CLOUD_REGION_ID", not_utf8("cn-beijing")),
    ] {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_CWD)
            .env_bytes(name, &value);
        if name == "ABX_SANDBOX_API_KEY" {
            c.vars.clear();
        }
        for args in [&["config", "list"][..], &["check", "--offline"], SERVE] {
            let out = c.run(args);
            assert_eq!(out.code, 78, "{name} {args:?}: {}", out.stderr);
            let first = out.stderr.lines().next().unwrap_or_default();
            assert!(
                first.starts_with("[E1005]") && first.contains(name),
                "{name} {args:?}: {}",
                out.stderr
            );
            assert!(!out.stderr.contains("5f1e2d3c"), "{}", out.stderr);
            assert!(!out.stderr.contains("cn-beijing"), "{}", out.stderr);
        }
    }

    // A flag above it: the variable is not read, so it is no error.
    let mut c = Case::new();
    let p = c.file("api-key", KEY_FLAG);
    c.env_bytes("ABX_SANDBOX_API_KEY", &not_utf8(KEY_ENV))
        .flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("credential: api_key (flag)"),
        "{}",
        out.stdout
    );
}

/// `ABX_HOME=~/.abx` (systemd's `Environment=` and a container's env expand no `~`) names
/// `./~/.abx`, where the key is not: said, with the directory read; an absolute one is not.
#[test]
fn an_abx_home_that_is_no_absolute_path_is_warned_about() {
    let mut c = Case::new();
    c.env("ABX_HOME", "~/.abx");
    let out = c.run(&["config", "get", "region"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let said = "warning: ABX_HOME (~/.abx) is not an absolute path: it is read from the \
                working directory";
    assert!(out.stderr.contains(said), "{}", out.stderr);
    assert!(
        out.stderr.contains("a `~` is expanded by a shell"),
        "{}",
        out.stderr
    );
    // The provider commands, which read no settings, too.
    let out = c.run(&["provider", "list"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains(said), "{}", out.stderr);
    let out = Case::new().run(&["config", "get", "region"]);
    assert!(!out.stderr.contains("ABX_HOME"), "{}", out.stderr);
}

/// `check` takes serve's own flags (timeouts, connection limit, logs), so that a serve
/// command line runs as a check of it (a unit's `ExecStartPre=`): they were refused,
/// "unexpected argument". It warns as serve does of an idle timeout envd's keepalives
/// cannot keep a stream open under, and logs as those flags say.
#[test]
fn check_takes_a_serve_command_line() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let serve_flags = [
        "--log-format",
        "json",
        "--log-level",
        "warn",
        "--idle-timeout",
        "1s",
        "--header-timeout",
        "10s",
        "--shutdown-grace",
        "5s",
        "--max-connections",
        "100",
    ];
    let out = c.run(&[&["check", "--offline"][..], &serve_flags].concat());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("ok (offline"), "{}", out.stdout);
    let warned: Vec<Value> = (out.stderr.lines())
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        warned.iter().any(|v| v["level"] == "WARN"
            && v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("--idle-timeout is under 2 s"))),
        "{}",
        out.stderr
    );
}

/// A key file written as a `.env` line is read whole, as a Kubernetes secret is, and its
/// name would go upstream with the key (401 on every request): `check` says so, naming
/// the flag and nothing of the file.
#[test]
fn a_key_file_holding_a_dotenv_line_is_warned_about() {
    let mut c = Case::new();
    let p = c.file(
        "api-key",
        &format!("export ABX_SANDBOX_API_KEY={KEY_FLAG}\n"),
    );
    c.flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let said = "warning: the file given to --sandbox-api-key-file holds a NAME=value line";
    assert!(out.stderr.contains(said), "{}", out.stderr);
    assert!(!out.stderr.contains(KEY_FLAG), "{}", out.stderr);
}

/// A key copied with its scheme (`Bearer sk-…`, from a curl line) went upstream as
/// `Bearer Bearer sk-…`: 401 on every request while `check --offline` said ok.
#[test]
fn a_key_with_an_auth_scheme_is_warned_about() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", &format!("Bearer {KEY_ENV}"));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let said = "warning: the API key (from env) begins with `Bearer`, an auth scheme: the \
                proxy sends it whole as `Authorization: Bearer <key>`; set the key alone";
    assert!(out.stderr.contains(said), "{}", out.stderr);
    assert!(!out.stderr.contains(KEY_ENV), "{}", out.stderr);
}

/// `check --offline` said ok for settings `serve` refuses at start: a key that cannot be a
/// header value (a control character pasted with it, a key file of two lines) and a
/// non-loopback listener without `--allow-remote`. Both now give the same answer, and
/// `check` takes the flags that decide it, so a serve command line runs as a check.
#[test]
fn check_refuses_what_serve_refuses() {
    let header = "not usable as an HTTP header value";
    let mut pasted = Case::new();
    pasted.env("ABX_SANDBOX_API_KEY", &format!("{KEY_ENV}\u{7f}"));
    let mut two_lines = Case::new();
    let p = two_lines.file("api-key", &format!("{KEY_FLAG}\n{KEY_FLAG}\n"));
    two_lines.flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
    for (what, c) in [("control character", &pasted), ("two lines", &two_lines)] {
        for args in [&["check", "--offline"][..], SERVE] {
            let out = c.run(args);
            assert_eq!(out.code, 78, "{what} {args:?}: {}", out.stderr);
            assert!(
                out.stderr
                    .starts_with("[E1005] invalid value for sandbox_api_key")
                    && out.stderr.contains(header),
                "{what} {args:?}: {}",
                out.stderr
            );
        }
    }

    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV)
        .env("ABX_PROXY_ADMIN_LISTEN", "127.0.0.1:0")
        .flag("--listen", "0.0.0.0:0");
    for args in [&["check", "--offline"][..], &["serve"]] {
        let out = c.run(args);
        assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
        assert!(
            // serve may warn first (the open-file limit).
            out.stderr.lines().any(|l| l.starts_with("[E1007]"))
                && out.stderr.contains("--allow-remote"),
            "{args:?}: {}",
            out.stderr
        );
    }
    let out = c.run(&[
        "check",
        "--offline",
        "--allow-remote",
        "--allowed-host",
        "h",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("listen: 0.0.0.0:0"), "{}", out.stdout);

    // Listener TLS stands in for --allow-remote; check reads the files as serve does.
    let missing = c.cwd.join("no-such-cert.pem");
    let missing = missing.to_str().expect("utf-8");
    for args in [&["check", "--offline"][..], &["serve"]] {
        let args: Vec<&str> = args
            .iter()
            .copied()
            .chain(["--tls-cert", missing, "--tls-key", missing])
            .collect();
        let out = c.run(&args);
        assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .lines()
                .any(|l| l.starts_with("[E1006] cannot read the file given to --tls-cert: ")),
            "{args:?}: {}",
            out.stderr
        );
    }
}

/// A file flag's value that names nothing is not repeated in its error: it may be the
/// secret pasted in place of its path (the API key given as a CA file or a certificate).
/// A key's PEM, which starts with `-`, is an argument clap did not expect: it quoted it
/// whole, and now its first line only. Something there is a path, and is named.
#[test]
fn a_secret_pasted_in_place_of_a_file_flags_path_is_not_repeated() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let cert = c.file("cert.pem", "not read");
    let cert = cert.to_str().expect("utf-8").to_string();
    let cases: [(&[&str], &str); 2] = [
        (&["--tls-cert", KEY_FLAG, "--tls-key", &cert], "--tls-cert"),
        (&["--upstream-ca", KEY_FLAG], "--upstream-ca"),
    ];
    for (flags, flag) in cases {
        for command in ["check", "serve"] {
            let args: Vec<&str> = [command, "--offline"][..if command == "check" { 2 } else { 1 }]
                .iter()
                .copied()
                .chain(flags.iter().copied())
                .collect();
            let out = c.run(&args);
            assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
            let said = format!("[E1006] cannot read the file given to {flag}: ");
            assert!(
                out.stderr.lines().any(|l| l.starts_with(&said)),
                "{args:?}: {}",
                out.stderr
            );
            assert!(
                !out.stderr.contains(&KEY_FLAG[5..]),
                "{args:?}: {}",
                out.stderr
            );
        }
    }
    let pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj\n-----END PRIVATE KEY-----\n";
    for flags in [
        &["--tls-cert", &cert, "--tls-key", pem][..],
        &["--tls-cert", pem, "--tls-key", &cert],
        &["--upstream-ca", pem],
        &["--sandbox-api-key-file", pem],
    ] {
        let args: Vec<&str> = ["check", "--offline"]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        let out = c.run(&args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .contains("'-----BEGIN PRIVATE KEY----- … (the rest is not repeated)'"),
            "{args:?}: {}",
            out.stderr
        );
        assert!(
            !out.stderr.contains("MIIEvQIBADAN"),
            "{args:?}: {}",
            out.stderr
        );
    }
    let dir = c.cwd.to_str().expect("utf-8").to_string();
    let out = c.run(&["check", "--offline", "--upstream-ca", &dir]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("[E1006] cannot read {dir}: ")),
        "{}",
        out.stderr
    );
}

/// An empty key file is a blank value, skipped like any (SPEC §2), but not silently: the
/// key quietly came from a lower level (an old `~/.abx/.env` key) although the proxy was
/// pointed at a file. A warning names the file and where the key comes from instead.
#[test]
fn an_empty_secret_file_is_skipped_with_a_warning() {
    for (flag, key) in [
        ("--sandbox-api-key-file", "sandbox_api_key"),
        ("--access-key-secret-file", "access_key_secret"),
    ] {
        for empty in ["", "\n", "\r\n", " \n"] {
            let mut c = Case::new();
            let p = c.file("empty-key", empty);
            let path = p.to_str().expect("utf-8").to_string();
            c.home_dotenv(&format!(
                "ABX_SANDBOX_API_KEY={KEY_HOME}\nALICLOUD_ACCESS_KEY_SECRET={AK_SECRET_ENV}"
            ));
            c.flag(flag, &path);
            let out = c.run(&["config", "list"]);
            assert_eq!(out.code, 0, "{flag} {empty:?}: {}", out.stderr);
            // The whole line, with where that file is.
            let warning = format!(
                "{path} is empty: skipped as a blank value; {key} comes from ~/.abx/.env ({})\n",
                c.abx_dir().join(".env").display()
            );
            assert!(
                out.stderr.contains(&warning),
                "{flag} {empty:?}: {}",
                out.stderr
            );
        }
    }
    // Nothing below it: the usual error, after the warning.
    let mut c = Case::new();
    let p = c.file("empty-key", "");
    c.flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 78, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("is empty: skipped as a blank value; sandbox_api_key is not set"),
        "{}",
        out.stderr
    );
}

/// SPEC §2: a flag given an empty or blank value is skipped like any blank value; the
/// `-file` flags refused "" with a clap error (exit 2) and tried to read " " (E1006).
#[test]
fn blank_secret_file_flags_are_skipped() {
    for flag in ["--sandbox-api-key-file", "--access-key-secret-file"] {
        for blank in ["", " ", "\t"] {
            let mut c = Case::new();
            c.env("ABX_SANDBOX_API_KEY", KEY_ENV).flag(flag, blank);
            let k = c.row("sandbox_api_key");
            assert_eq!(
                (k.value, k.source.as_str()),
                (Some(masked(KEY_ENV)), "env"),
                "{flag} {blank:?}"
            );
            let out = c.run(&["check", "--offline"]);
            assert_eq!(out.code, 0, "{flag} {blank:?}: {}", out.stderr);
        }
    }
}

/// `abx-proxy check --offline | true`: `println!` panicked on the closed pipe (exit 101 and
/// a panic message). The output commands now end quietly with 141, what a shell reports
/// for a program ended by SIGPIPE (as `cat` or `git` end there); not 0, since a `check`
/// cut short did not pass.
#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    for args in [
        &["check", "--offline"][..],
        &["config", "list"],
        &["config", "list", "--json"],
        &["config", "get", "region"],
        &["provider", "list"],
        &["provider", "info", "alicloud-express"],
    ] {
        let out = c.run_with_reader_gone(args);
        assert_eq!(out.code, 141, "{args:?}: {}", out.stderr);
        assert_eq!(out.stderr, "", "{args:?}");
    }
}

/// A stderr whose reader has gone changes no command's exit status: what it would have
/// said there is lost, but `config get` of an unknown key is still 2 (usage), not a panic's 101
/// (`eprintln!` panics when its write fails).
#[test]
fn a_stderr_reader_that_goes_away_changes_no_exit_status() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let out = c.run_with_stderr_gone(&["config", "get", "nokey"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
}

/// A stdout that fails otherwise (a full disk) is no reader gone: EX_IOERR (74) and one
/// line on stderr saying why, so that a script does not take the output as complete.
#[test]
fn a_stdout_on_a_full_disk_is_exit_74_with_one_line() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    for args in [&["check", "--offline"][..], &["config", "list"]] {
        let out = c.run_with_stdout_full(args);
        assert_eq!(out.code, 74, "{args:?}: {}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr.starts_with("error: cannot write to stdout: "),
            "{args:?}: {}",
            out.stderr
        );
    }
}

/// An invalid value said "invalid value for token_ttl" without where it came from, though
/// the key may be set at five levels. The error names the flag, or the variable and its
/// layer, with the literal source names; never a secret's value.
#[test]
fn an_invalid_value_names_where_it_came_from() {
    type SetUp = fn(&mut Case);
    let cases: [(SetUp, &str); 7] = [
        (
            |c| {
                c.flag("--token-ttl", "abc");
            },
            "token_ttl (--token-ttl)",
        ),
        (
            |c| {
                c.env("ABX_TOKEN_TTL", "abc");
            },
            "token_ttl (ABX_TOKEN_TTL from env)",
        ),
        (
            |c| {
                c.cwd_dotenv("ABX_TOKEN_TTL=abc");
            },
            "token_ttl (ABX_TOKEN_TTL from ./.env)",
        ),
        (
            |c| {
                c.home_dotenv("ABX_COMPAT_V2_PATHS=sometimes");
            },
            "compat_v2_paths (ABX_COMPAT_V2_PATHS from ~/.abx/.env)",
        ),
        (
            |c| {
                c.toml("[auth]\ntoken_exchange = \"rpc-v9\"");
            },
            "token_exchange (token_exchange from ~/.abx/config.toml)",
        ),
        (
            |c| {
                c.env("ABX_SANDBOX_API_KEY", &format!("{KEY_ENV}\u{7f}"));
                c.cwd_dotenv(&format!("ABX_SANDBOX_API_KEY={KEY_CWD}"));
            },
            "sandbox_api_key (ABX_SANDBOX_API_KEY from env)",
        ),
        (
            |c| {
                let p = c.file("key", &format!("{KEY_ENV}\u{7f}"));
                c.flag("--sandbox-api-key-file", p.to_str().expect("utf-8"));
            },
            "sandbox_api_key (--sandbox-api-key-file)",
        ),
    ];
    for (set, says) in cases {
        let mut c = Case::new();
        c.env("ABX_SANDBOX_API_KEY", KEY_HOME);
        set(&mut c);
        let says = c.with_paths(says);
        for args in [&["check", "--offline"][..], SERVE] {
            let out = c.run(args);
            assert_eq!(out.code, 78, "{says} {args:?}: {}", out.stderr);
            assert!(
                out.stderr
                    .starts_with(&format!("[E1005] invalid value for {says}: ")),
                "{says} {args:?}: {}",
                out.stderr
            );
        }
    }
}

/// Alibaba's own CLI and SDKs name the pair `ALIBABA_CLOUD_ACCESS_KEY_*`. abx-proxy does not
/// read those (SPEC §2 names `ALICLOUD_*`), but when no credential resolves and they are
/// set, the E1001 comes with a warning that names the variables to set instead.
#[test]
fn alibaba_cloud_pair_names_get_a_hint_and_are_not_read() {
    let mut in_env = Case::new();
    in_env
        .env("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID)
        .env("ALIBABA_CLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
    let in_dotenv = Case::new();
    in_dotenv.cwd_dotenv(&format!(
        "ALIBABA_CLOUD_ACCESS_KEY_ID={AK_ID}\nALIBABA_CLOUD_ACCESS_KEY_SECRET={AK_SECRET_CWD}"
    ));
    for (c, layer) in [(&in_env, "env"), (&in_dotenv, "./.env")] {
        for args in [&["check", "--offline"][..], SERVE] {
            let out = c.run(args);
            assert_eq!(out.code, 78, "{layer} {args:?}: {}", out.stderr);
            assert!(out.stderr.ends_with(E1001), "{}", out.stderr);
            assert!(
                out.stderr.contains(&c.with_paths(&format!(
                    "ALIBABA_CLOUD_ACCESS_KEY_ID, ALIBABA_CLOUD_ACCESS_KEY_SECRET ({layer}) are set, but abx-proxy reads the AccessKey pair from ALICLOUD_ACCESS_KEY_ID and ALICLOUD_ACCESS_KEY_SECRET"
                ))),
                "{layer} {args:?}: {}",
                out.stderr
            );
            assert!(!out.stderr.contains(AK_ID), "{}", out.stderr);
        }
        let rows = c.list();
        assert_eq!(find(&rows, "access_key_id").source, "unset");
        assert_eq!(find(&rows, "access_key_secret").source, "unset");
        assert_eq!(find(&rows, "credential").value, None);
    }
    // Split across layers: each layer's file said once, layers apart by `;`; one name alone
    // "is" set.
    let mut split = Case::new();
    split.env("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID);
    split.cwd_dotenv(&format!("ALIBABA_CLOUD_ACCESS_KEY_SECRET={AK_SECRET_CWD}"));
    let out = split.run(&["check", "--offline"]);
    let want = split.with_paths(
        "ALIBABA_CLOUD_ACCESS_KEY_ID (env); ALIBABA_CLOUD_ACCESS_KEY_SECRET (./.env) are set, but",
    );
    assert!(out.stderr.contains(&want), "{want}\n{}", out.stderr);
    let mut one = Case::new();
    one.env("ALIBABA_CLOUD_ACCESS_KEY_SECRET", AK_SECRET_ENV);
    let out = one.run(&["check", "--offline"]);
    let want = "ALIBABA_CLOUD_ACCESS_KEY_SECRET (env) is set, but";
    assert!(out.stderr.contains(want), "{}", out.stderr);
    // With a credential, nothing to say.
    let mut c = Case::new();
    c.env("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID)
        .env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let out = c.run(&["check", "--offline"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("ALIBABA_CLOUD"), "{}", out.stderr);
}

/// SPEC §2: `ABX_SANDBOX_API_KEY` is the only env name for the key. `E2B_API_KEY` (which
/// clients pointed at the proxy set to a dummy) is never read as the key.
#[test]
fn e2b_api_key_is_never_read_as_the_key() {
    let mut c = Case::new();
    c.env("E2B_API_KEY", "dummy");
    c.cwd_dotenv("E2B_API_KEY=dummy-cwd");
    c.home_dotenv("E2B_API_KEY=dummy-home");
    let rows = c.list();
    let k = find(&rows, "sandbox_api_key");
    assert_eq!((k.value, k.source.as_str()), (None, "unset"));
    assert_eq!(find(&rows, "credential").value, None);
    for args in [&["check", "--offline"][..], SERVE] {
        let out = c.run(args);
        assert_eq!(out.code, 78, "{args:?}: {}", out.stderr);
        assert!(out.stderr.ends_with(E1001), "{args:?}: {}", out.stderr);
    }
    // Beside the real key it changes nothing either.
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let k = c.row("sandbox_api_key");
    assert_eq!((k.value, k.source.as_str()), (Some(masked(KEY_ENV)), "env"));
}

/// SPEC §2: every non-secret key has a flag named after it, and a flag is the highest
/// level: each shows in `config list --json` as its own key with source `flag`, above the
/// same key set in the environment.
#[test]
fn every_non_secret_flag_sets_its_own_key() {
    let flags = [
        (
            "--access-key-id",
            "access_key_id",
            "ALICLOUD_ACCESS_KEY_ID",
            AK_ID,
        ),
        (
            "--region",
            "region",
            "ALIBABA_CLOUD_REGION_ID",
            "cn-shanghai",
        ),
        ("--provider", "provider", "ABX_PROVIDER", "alicloud-express"),
        (
            "--sandbox-base-url",
            "sandbox_base_url",
            "ABX_SANDBOX_BASE_URL",
            "http://127.0.0.1:1",
        ),
        (
            "--sandbox-domain",
            "sandbox_domain",
            "ABX_SANDBOX_DOMAIN",
            "sb.example",
        ),
        (
            "--sandbox-url",
            "sandbox_url",
            "ABX_SANDBOX_URL",
            "http://127.0.0.1:2",
        ),
        (
            "--token-exchange-url",
            "token_exchange_url",
            "ABX_TOKEN_EXCHANGE_URL",
            "http://127.0.0.1:3",
        ),
        (
            "--token-exchange",
            "token_exchange",
            "ABX_TOKEN_EXCHANGE",
            "acs3",
        ),
        ("--token-ttl", "token_ttl", "ABX_TOKEN_TTL", "1234"),
        (
            "--token-refresh-before",
            "token_refresh_before",
            "ABX_TOKEN_REFRESH_BEFORE",
            "123",
        ),
        (
            "--compat-v2-paths",
            "compat_v2_paths",
            "ABX_COMPAT_V2_PATHS",
            "pass",
        ),
        ("--listen", "listen", "ABX_PROXY_LISTEN", "127.0.0.1:4"),
        (
            "--admin-listen",
            "admin_listen",
            "ABX_PROXY_ADMIN_LISTEN",
            "127.0.0.1:5",
        ),
    ];
    // The table covers every non-secret key.
    let baseline = Case::new().list();
    let non_secret: Vec<&str> = baseline
        .iter()
        .filter(|r| !r.secret && r.key != "credential")
        .map(|r| r.key.as_str())
        .collect();
    let mut covered: Vec<&str> = flags.iter().map(|f| f.1).collect();
    covered.sort_unstable();
    let mut expected = non_secret.clone();
    expected.sort_unstable();
    assert_eq!(covered, expected);
    for (flag, key, env, value) in flags {
        let mut c = Case::new();
        c.env(env, "from-the-environment").flag(flag, value);
        let rows = c.list();
        let row = find(&rows, key);
        assert_eq!(
            (row.value.as_deref(), row.source.as_str()),
            (Some(value), "flag"),
            "{flag}"
        );
        // Its own key only: every other key is as without the flag.
        for (before, after) in baseline.iter().zip(&rows) {
            if after.key != key
                && after.key != "credential"
                && !(key == "region" && after.source == "default")
            {
                assert_eq!(after.source, before.source, "{flag} moved {}", after.key);
            }
        }
    }
}

/// A settings flag given twice takes its last value, as curl's and cloud-sql-proxy's
/// flags do (a wrapper's `abx-proxy $DEFAULTS --listen X` was refused, exit 2), in every
/// command that takes settings flags.
#[test]
fn a_flag_given_twice_takes_its_last_value() {
    let mut c = Case::new();
    c.env("ABX_SANDBOX_API_KEY", KEY_ENV);
    let region = ["--region", "cn-beijing", "--region", "cn-shanghai"];
    let out = c.run(&[&["config", "get", "region"][..], &region].concat());
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, "cn-shanghai"),
        "{}",
        out.stderr
    );
    let out = c.run(&[&["check", "--offline"][..], &region].concat());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains(".cn-shanghai."), "{}", out.stdout);
    let listen = ["--listen", "127.0.0.1:1", "--listen", "127.0.0.1:2"];
    let out = c.run(&[&["config", "list", "--json"][..], &listen].concat());
    let rows: Value = serde_json::from_str(&out.stdout).expect(&out.stderr);
    let row = rows
        .as_array()
        .and_then(|r| r.iter().find(|r| r["key"] == "listen"));
    assert_eq!(
        row.map(|r| (&r["value"], &r["source"])),
        Some((&"127.0.0.1:2".into(), &"flag".into())),
        "{rows}"
    );
}

/// The widest line `--help` may print: the help column starts at about 40, and these are
/// read in a terminal.
const HELP_WIDTH: usize = 120;

/// The option and argument lines of a `--help` output, as (flag, description): every
/// line that starts with spaces and `--`, `-x,` or `<ARG>`, its flag and value names
/// taken off. Asserts that each has a description of its own (not only clap's
/// `[default: …]`), and that no line is wider than [`HELP_WIDTH`].
fn help_entries(args: &[&str]) -> Vec<(String, String)> {
    let out = Case::new().run(args);
    assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
    let mut entries = Vec::new();
    for line in out.stdout.lines() {
        let trimmed = line.trim_start();
        let entry = line.starts_with(' ')
            && (trimmed.starts_with("--")
                || trimmed.starts_with('<')
                || trimmed.as_bytes().get(2) == Some(&b',') && trimmed.starts_with('-'));
        if !entry {
            continue;
        }
        assert!(
            line.chars().count() <= HELP_WIDTH,
            "{args:?}: wider than {HELP_WIDTH} columns:\n{line}"
        );
        let mut words = trimmed.split_whitespace().peekable();
        let mut flag = words.next().unwrap_or_default();
        if flag.ends_with(',') {
            flag = words.next().unwrap_or_default();
        }
        while words
            .peek()
            .is_some_and(|w| w.starts_with('<') || w.starts_with("[<"))
        {
            words.next();
        }
        let description = words.collect::<Vec<_>>().join(" ");
        assert!(
            !description.is_empty() && !description.starts_with('['),
            "{args:?}: {flag} has no description:\n{line}"
        );
        entries.push((flag.to_string(), description));
    }
    entries
}

/// Every flag and argument of every command says what it is for: a bare flag name told a
/// user nothing about what it sets, where else it can come from, or what applies without it.
#[test]
fn every_flag_of_every_command_has_a_one_line_description() {
    for args in [
        &["--help"][..],
        &["serve", "--help"],
        &["check", "--help"],
        &["config", "list", "--help"],
        &["config", "get", "--help"],
        &["provider", "list", "--help"],
        &["provider", "info", "--help"],
        &["provider", "install", "--help"],
    ] {
        let entries = help_entries(args);
        assert!(
            entries.iter().any(|(flag, _)| flag == "--help"),
            "{args:?}: no option lines parsed: {entries:?}"
        );
    }
    let serve: Vec<String> = help_entries(&["serve", "--help"])
        .into_iter()
        .map(|e| e.0)
        .collect();
    for flag in ["--region", "--admin-listen", "--allowed-host", "--tls-key"] {
        assert!(serve.iter().any(|f| f == flag), "{flag} not in {serve:?}");
    }
    let check = help_entries(&["check", "--help"]);
    assert!(check.iter().any(|(f, _)| f == "--offline"), "{check:?}");
}

/// SPEC §7's serve flags exist under their names, with the defaults it fixes: a drain of
/// 30 s (container stop timeouts are sized by it), an idle timeout of 300 s (beyond the
/// SDKs' 50 s Connect keepalives), and text logs unless `json` is asked for.
#[test]
fn serve_flags_of_section_7_have_the_spec_defaults() {
    let serve = help_entries(&["serve", "--help"]);
    for (flag, want) in [
        ("--shutdown-grace", Some("[default: 30s]")),
        ("--idle-timeout", Some("[default: 300s]")),
        (
            "--log-format",
            Some("[default: text] [possible values: text, json]"),
        ),
        ("--log-level", None),
        ("--allow-remote", None),
        ("--allowed-host", None),
        ("--tls-cert", None),
        ("--tls-key", None),
        ("--upstream-ca", None),
    ] {
        let (_, help) = serve
            .iter()
            .find(|(f, _)| f == flag)
            .unwrap_or_else(|| panic!("no {flag} in {serve:?}"));
        if let Some(want) = want {
            assert!(help.ends_with(want), "{flag}: {help}, want {want}");
        }
    }
}

/// The help of each settings flag names the key's environment variable and its default
/// (SPEC §2), as the settings chain resolves them; a key without a default claims none.
#[test]
fn every_settings_flag_names_its_env_variable_and_default() {
    for command in [&["serve", "--help"][..], &["config", "list", "--help"]] {
        let entries = help_entries(command);
        for (key, env, secret, default) in TABLE {
            if *secret {
                continue;
            }
            let flag = format!("--{}", key.replace('_', "-"));
            let (_, help) = entries
                .iter()
                .find(|(f, _)| *f == flag)
                .unwrap_or_else(|| panic!("{command:?}: no {flag} in {entries:?}"));
            assert!(help.contains(&format!("[env {env}]")), "{flag}: {help}");
            let want = match default {
                // Derived from the effective region, wherever that comes from.
                Some(d) if *key != "region" && d.contains("cn-hangzhou") => {
                    Some("[default: from region]".to_string())
                }
                Some(d) => Some(format!("[default: {d}]")),
                None => None,
            };
            match want {
                Some(want) => assert!(help.contains(&want), "{flag}: {help}, want {want}"),
                None => assert!(!help.contains("[default:"), "{flag}: {help}"),
            }
        }
    }
}
