//! The command line: clap's definitions, argv's clean-up (blank repeats) and the flag
//! layer of the settings chain (the `-file` flags' secrets read, `--provider-option`
//! checked).

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::error::Error;
use crate::secret::Secret;
use crate::settings::{parse_duration, FlagValue, Key};

#[derive(Debug, Parser)]
#[command(
    name = "abx-proxy",
    version,
    about = "Credential-injecting streaming proxy for E2B-compatible sandbox clouds",
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// With no subcommand, `serve` runs with these flags.
    #[command(flatten)]
    pub serve: ServeArgs,
}

impl Cli {
    /// [`Parser::try_parse_from`], with clap's "a similar argument exists" tip kept off
    /// the hidden flags that exist only to refuse a secret: `--sandbox-apikey=…` was told
    /// to try `--sandbox-api-key`, and following the tip put the secret in shell history
    /// to be refused. The tip names the flag that reads the secret from a file instead.
    pub fn parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        use clap::error::{ContextKind, ContextValue};
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        Cli::try_parse_from(without_blank_repeats(args)).map_err(|e| {
            let mut e = without_pasted_text(e);
            let refused = match e.get(ContextKind::SuggestedArg) {
                Some(ContextValue::String(s)) => refused_flag_tip(s),
                _ => None,
            };
            match refused {
                None => e,
                Some(Some(tip)) => {
                    e.insert(ContextKind::SuggestedArg, ContextValue::String(tip.into()));
                    e
                }
                // clap renders any suggestion it holds: the same error without one.
                Some(None) => rebuilt(&e, ContextKind::SuggestedArg, None),
            }
        })
    }
}

/// `args` without a settings flag's blank value where the same flag is given a value too:
/// a blank flag is skipped like any blank value (SPEC §2), so `$DEFAULTS --region "$R"`
/// with `R` unset keeps the default's region, where the last value, blank, took it and
/// the key fell through to the lower layers (a key file flag so given: E1001). A blank
/// flag alone stays, to be skipped with its warning.
fn without_blank_repeats(args: Vec<OsString>) -> Vec<OsString> {
    use clap::Args as _;
    let settings = SettingsArgs::augment_args(clap::Command::new("settings"));
    let flags: Vec<String> = (settings.get_arguments())
        .filter(|a| a.get_action().takes_values())
        .filter_map(|a| Some(format!("--{}", a.get_long()?)))
        .collect();
    let blank = |v: &OsString| v.to_str().is_some_and(|v| v.trim().is_empty());
    // Each argument as (flag, value given with it), for the flags above, up to `--`.
    let mut given: Vec<Option<(&str, Option<usize>)>> = vec![None; args.len()];
    let mut i = 1;
    while i < args.len() {
        let Some(arg) = args[i].to_str() else {
            i += 1;
            continue;
        };
        if arg == "--" {
            break;
        }
        let (name, inline) = arg.split_once('=').map_or((arg, false), |(n, _)| (n, true));
        if let Some(flag) = flags.iter().find(|f| *f == name) {
            let value = (!inline && i + 1 < args.len()).then_some(i + 1);
            given[i] = Some((flag.as_str(), value));
            i += 1 + usize::from(value.is_some());
            continue;
        }
        i += 1;
    }
    let is_blank = |i: usize, value: Option<usize>| match value {
        Some(v) => blank(&args[v]),
        None => args[i]
            .to_str()
            .and_then(|a| a.split_once('='))
            .is_some_and(|(_, v)| v.trim().is_empty()),
    };
    let valued = |flag: &str| {
        (given.iter().enumerate())
            .any(|(i, g)| matches!(g, Some((f, v)) if *f == flag && !is_blank(i, *v)))
    };
    let mut dropped = vec![false; args.len()];
    for (i, g) in given.iter().enumerate() {
        if let Some((flag, value)) = g {
            if is_blank(i, *value) && valued(flag) {
                dropped[i] = true;
                if let Some(v) = value {
                    dropped[*v] = true;
                }
            }
        }
    }
    (args.into_iter().zip(dropped))
        .filter_map(|(a, d)| (!d).then_some(a))
        .collect()
}

/// `e` with `kind`'s context replaced by `value`, or left out.
fn rebuilt(
    e: &clap::Error,
    kind: clap::error::ContextKind,
    value: Option<clap::error::ContextValue>,
) -> clap::Error {
    let cmd = <Cli as clap::CommandFactory>::command();
    let mut plain = clap::Error::new(e.kind()).with_cmd(&cmd);
    for (k, v) in e.context() {
        if k != kind {
            plain.insert(k, v.clone());
        }
    }
    if let Some(value) = value {
        plain.insert(kind, value);
    }
    plain
}

/// clap quotes an argument it did not expect whole: a key's PEM pasted in place of a
/// file flag's path starts with `-`, and was taken for an argument and printed. An
/// argument of several lines is quoted by its first (a PEM's is its `-----BEGIN …`).
fn without_pasted_text(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue};
    let first = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => match arg.split_once('\n') {
            Some((first, _)) => format!("{} … (the rest is not repeated)", first.trim_end()),
            None => return e,
        },
        _ => return e,
    };
    rebuilt(
        &e,
        ContextKind::InvalidArg,
        Some(ContextValue::String(first)),
    )
}

/// For a suggested flag that only refuses a secret: the flag to suggest instead (`None`:
/// nothing on the command line, the secret is read from the environment).
fn refused_flag_tip(suggested: &str) -> Option<Option<&'static str>> {
    match suggested {
        "--sandbox-api-key" => Some(Some("--sandbox-api-key-file")),
        "--access-key-secret" => Some(Some("--access-key-secret-file")),
        "--github-token" => Some(None),
        _ => None,
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (the default).
    Serve(ServeArgs),
    /// Show the effective settings and where each comes from.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Resolve everything, exchange a token if AK/SK, probe the upstream.
    Check(CheckArgs),
    /// Providers known (built-in and installed).
    Provider {
        #[command(subcommand)]
        command: ProviderCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Every key: effective value (secrets masked), source, env name.
    List {
        /// Print the rows as a JSON array of objects.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        settings: SettingsArgs,
    },
    /// One key's effective value (secrets masked).
    Get {
        /// A key as `config list` names it, e.g. region.
        key: String,
        #[command(flatten)]
        settings: SettingsArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum ProviderCommand {
    /// Providers known, built-in and installed.
    List,
    /// One provider's fields, env names and inherits.
    Info {
        /// A provider id, as `provider list` shows it.
        id: String,
    },
    /// Install a plugin manifest.
    Install {
        /// The plugin manifest (abx-provider.toml).
        file: PathBuf,
        /// Consent to the manifest's `[core] inherit` list.
        #[arg(long)]
        consent: bool,
    },
}

/// `--max-connections` at most: far beyond any descriptor limit, and within what the
/// connection semaphore can count (a larger number made the accept loop panic).
const MAX_CONNECTIONS: u64 = 1 << 20;

/// The settings flags shared by `serve`, `check` and `config`: one per non-secret key,
/// and `-file` flags for the secrets.
///
/// Their env names and defaults are in the help text, not in clap's `env`/`default_value`:
/// the settings chain resolves those itself, and a flag clap filled in would hide every
/// lower level (`./.env`, `~/.abx`). The help repeats the key table (settings::keys).
#[derive(Debug, Args, Clone, Default)]
pub struct SettingsArgs {
    /// AccessKey ID, exchanged for a temporary API key [env ALICLOUD_ACCESS_KEY_ID]
    #[arg(long, value_name = "ID")]
    pub access_key_id: Option<String>,
    /// Alibaba Cloud region [env ALIBABA_CLOUD_REGION_ID] [default: cn-hangzhou]
    #[arg(long)]
    pub region: Option<String>,
    /// Provider id (provider list) [env ABX_PROVIDER] [default: alicloud-express]
    #[arg(long, value_name = "ID")]
    pub provider: Option<String>,
    /// Control-plane upstream [env ABX_SANDBOX_BASE_URL] [default: from region]
    #[arg(long, value_name = "URL")]
    pub sandbox_base_url: Option<String>,
    /// envd upstream: PORT-ID.DOMAIN [env ABX_SANDBOX_DOMAIN] [default: from region]
    #[arg(long, value_name = "DOMAIN")]
    pub sandbox_domain: Option<String>,
    /// Send all envd traffic to this one URL [env ABX_SANDBOX_URL]
    #[arg(long, value_name = "URL")]
    pub sandbox_url: Option<String>,
    /// AK/SK exchange endpoint [env ABX_TOKEN_EXCHANGE_URL] [default: from region]
    #[arg(long, value_name = "URL")]
    pub token_exchange_url: Option<String>,
    /// AK/SK exchange signature [env ABX_TOKEN_EXCHANGE] [default: rpc-v1]
    #[arg(long, value_name = "rpc-v1|acs3")]
    pub token_exchange: Option<String>,
    /// Key lifetime if the exchange gives none [env ABX_TOKEN_TTL] [default: 3600]
    #[arg(long, value_name = "SECONDS")]
    pub token_ttl: Option<String>,
    /// Refresh this long before expiry [env ABX_TOKEN_REFRESH_BEFORE] [default: 300]
    #[arg(long, value_name = "SECONDS")]
    pub token_refresh_before: Option<String>,
    /// Map /v2/sandboxes to /sandboxes [env ABX_COMPAT_V2_PATHS] [default: rewrite]
    #[arg(long, value_name = "rewrite|pass")]
    pub compat_v2_paths: Option<String>,
    /// HOST:PORT or unix:/path [env ABX_PROXY_LISTEN] [default: 127.0.0.1:49982]
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Metrics and health [env ABX_PROXY_ADMIN_LISTEN] [default: 127.0.0.1:9464]
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    // OsString, not PathBuf: clap refuses an empty PathBuf (exit 2), and SPEC §2 skips a
    // flag given an empty or blank value like any blank value.
    /// Read the API key from a file (a Kubernetes secret); trailing newline trimmed.
    #[arg(long, value_name = "PATH")]
    pub sandbox_api_key_file: Option<OsString>,
    /// Read the AccessKey secret from a file; trailing newline trimmed.
    #[arg(long, value_name = "PATH")]
    pub access_key_secret_file: Option<OsString>,
    /// A plugin provider's non-secret field (repeatable).
    #[arg(long, value_name = "FIELD=VALUE")]
    pub provider_option: Vec<ProviderOption>,

    // Secrets on the command line leak through `ps` and shell history. These exist only to
    // refuse them with a clear message that does not repeat the value. A value starting
    // with `-` is still taken as the value: otherwise clap reports it as an unknown flag
    // and quotes it back on stderr.
    #[arg(long, hide = true, num_args = 0..=1, allow_hyphen_values = true, value_name = "REFUSED")]
    pub sandbox_api_key: Option<Option<Refused>>,
    #[arg(long, hide = true, num_args = 0..=1, allow_hyphen_values = true, value_name = "REFUSED")]
    pub access_key_secret: Option<Option<Refused>>,
    #[arg(long, hide = true, num_args = 0..=1, allow_hyphen_values = true, value_name = "REFUSED")]
    pub github_token: Option<Option<Refused>>,
}

/// A secret given on the command line, refused: the value is dropped as it is parsed, so
/// it is in no field that `Debug` (or anything else) could print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused;

impl std::str::FromStr for Refused {
    type Err = std::convert::Infallible;

    fn from_str(_: &str) -> Result<Self, Self::Err> {
        Ok(Refused)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Network flags shared by `serve` and `check`.
#[derive(Debug, Args, Clone, Default)]
pub struct NetArgs {
    /// Also trust these CA certificates (PEM) for upstream TLS.
    #[arg(long, value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,
    /// Upstream connect timeout: name look-up, TCP and TLS.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = timeout)]
    pub connect_timeout: Duration,
    /// Time an upstream may take to send response headers [default: 300s; check: 30s]
    #[arg(long, value_name = "DURATION", value_parser = timeout)]
    pub upstream_timeout: Option<Duration>,
}

/// The flags that decide whether `serve` may listen where `listen` says. `check` takes
/// them too: a serve command line with `serve` changed to `check` must be accepted, and
/// judged by the same rule.
#[derive(Debug, Args, Clone, Default)]
pub struct ExposureArgs {
    /// Accept connections on a non-loopback address without listener TLS.
    #[arg(long)]
    pub allow_remote: bool,
    /// Extra Host to accept (repeatable); unset: any unless loopback w/o --allow-remote
    #[arg(long, value_name = "NAME", value_parser = allowed_host)]
    pub allowed_host: Vec<String>,
    /// Serve TLS with this certificate chain (PEM); re-read on SIGHUP and on change
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ExposureArgs {
    pub fn tls(&self) -> bool {
        self.tls_cert.is_some() && self.tls_key.is_some()
    }
}

#[derive(Debug, Args, Clone, Default)]
pub struct ServeArgs {
    #[command(flatten)]
    pub settings: SettingsArgs,
    #[command(flatten)]
    pub net: NetArgs,
    #[command(flatten)]
    pub exposure: ExposureArgs,
    #[command(flatten)]
    pub run: RunArgs,
}

/// What only a running proxy uses: its timeouts, its connection limit and its logs.
/// `check` takes them too, so that a serve command line (a unit's `ExecStartPre=`) runs
/// as a check of it; they were refused there ("unexpected argument", exit 2).
#[derive(Debug, Args, Clone, Default)]
pub struct RunArgs {
    /// Close a connection, or reset an HTTP/2 answer, idle this long.
    #[arg(long, value_name = "DURATION", default_value = "300s", value_parser = timeout)]
    pub idle_timeout: Duration,
    /// Drain time for requests and tunnels on SIGTERM/SIGINT (0: none).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Time a client may take to send a request head (slowloris).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = timeout)]
    pub header_timeout: Duration,
    /// Connections served at once; more wait in the accept queue.
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_CONNECTIONS))]
    pub max_connections: usize,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// A RUST_LOG-style filter (RUST_LOG applies when this is not given).
    #[arg(long, value_name = "FILTER", value_parser = log_filter)]
    pub log_level: Option<String>,
}

#[derive(Debug, Args, Clone)]
pub struct CheckArgs {
    #[command(flatten)]
    pub settings: SettingsArgs,
    #[command(flatten)]
    pub net: NetArgs,
    #[command(flatten)]
    pub exposure: ExposureArgs,
    #[command(flatten)]
    pub run: RunArgs,
    /// Resolve and validate only; no network.
    #[arg(long)]
    pub offline: bool,
}

/// An `--allowed-host` value as the Host check compares it: lower case, without a trailing
/// dot, an IPv6 address in brackets (as a Host writes it). A value with a port could never
/// match (the check compares names; the port is the listener's) and is refused rather than
/// left to refuse every request, as is one no Host could be (`bad/host`, `a b`) and a
/// pattern (`*.example.com`: the names are compared whole). A blank one stays blank, to be
/// skipped.
fn allowed_host(raw: &str) -> Result<String, String> {
    let lower = raw.trim().to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    // One spelling of an address, whichever the flag and the client's Host use (curl
    // writes `[::1]` for `[0:0:0:0:0:0:0:1]`, httpx as given).
    let inside = name.strip_prefix('[').and_then(|n| n.strip_suffix(']'));
    if let Ok(addr) = inside.unwrap_or(name).parse::<std::net::Ipv6Addr>() {
        // An IPv4 address written as IPv6 (`[::ffff:10.0.0.5]`, a listen address copied)
        // is that IPv4 address, which clients send as such.
        return Ok(match addr.to_canonical() {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        });
    }
    if name.contains("://") {
        return Err("a host name, not a URL".into());
    }
    if name.contains('%') && name.contains(':') {
        return Err("an IPv6 address without a zone (clients send none in Host)".into());
    }
    let bracketed = name.starts_with('[') && name.ends_with(']');
    let with_port = name.starts_with('[') && name.contains("]:");
    if with_port || (name.contains(':') && !bracketed && !name.contains(['[', ']'])) {
        return Err("a host name or address without a port (the port is the listener's)".into());
    }
    if name.contains('*') {
        return Err("a host name, not a pattern: give each name its own --allowed-host".into());
    }
    if name.contains(',') {
        return Err("one host name: give each its own --allowed-host".into());
    }
    // Names as DNS and the SDKs' Hosts spell them (an IDN as its `xn--` form; `_`, as
    // Docker's service names have it); a `.`-only or empty label matches no Host, and a
    // value that stripped to nothing would have turned the check off.
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !raw.trim().is_empty() && !name.split('.').all(label_ok) {
        return Err(
            "a host name (letters, digits, `-`, `_`, labels between dots; an IDN in its \
             xn-- form) or an IP address (IPv6 in brackets, without a zone)"
                .into(),
        );
    }
    Ok(name.to_string())
}

/// A timeout flag: a duration (SPEC §7: a bare number is seconds) of at least 1 ms. A zero
/// timeout would not mean "none": every connection, connect or answer would fail at once
/// while the proxy looked ready, and so did `0.0000001s` (the timers count milliseconds).
/// A bad value is a bad command line (exit 2), like any flag's.
fn timeout(raw: &str) -> Result<Duration, String> {
    match parse_duration(raw)? {
        d if d < Duration::from_millis(1) => Err("must be at least 1ms".into()),
        d => Ok(d),
    }
}

/// A refused command-line secret: the message names the flag and the alternatives.
#[derive(Debug)]
pub struct RefusedSecretFlag(pub &'static str, pub &'static str);

impl SettingsArgs {
    /// Refuses secret-valued flags (exit 2 in main).
    pub fn refused_secret(&self) -> Option<RefusedSecretFlag> {
        if self.sandbox_api_key.is_some() {
            return Some(RefusedSecretFlag(
                "--sandbox-api-key",
                "use --sandbox-api-key-file PATH or ABX_SANDBOX_API_KEY (environment or .env)",
            ));
        }
        if self.access_key_secret.is_some() {
            return Some(RefusedSecretFlag(
                "--access-key-secret",
                "use --access-key-secret-file PATH or ALICLOUD_ACCESS_KEY_SECRET (environment or .env)",
            ));
        }
        if self.github_token.is_some() {
            return Some(RefusedSecretFlag(
                "--github-token",
                "use GITHUB_TOKEN (environment or .env)",
            ));
        }
        None
    }

    /// The flag level of the settings chain. Reads the `-file` secrets.
    pub fn to_flags(&self) -> Result<HashMap<Key, FlagValue>, Error> {
        let mut flags = HashMap::new();
        let plain = [
            (Key::AccessKeyId, &self.access_key_id),
            (Key::Region, &self.region),
            (Key::Provider, &self.provider),
            (Key::SandboxBaseUrl, &self.sandbox_base_url),
            (Key::SandboxDomain, &self.sandbox_domain),
            (Key::SandboxUrl, &self.sandbox_url),
            (Key::TokenExchangeUrl, &self.token_exchange_url),
            (Key::TokenExchange, &self.token_exchange),
            (Key::TokenTtl, &self.token_ttl),
            (Key::TokenRefreshBefore, &self.token_refresh_before),
            (Key::CompatV2Paths, &self.compat_v2_paths),
            (Key::Listen, &self.listen),
            (Key::AdminListen, &self.admin_listen),
        ];
        for (key, value) in plain {
            if let Some(v) = value {
                flags.insert(key, FlagValue::Plain(v.clone()));
            }
        }
        for (key, path) in self.secret_files() {
            let flag = match key {
                Key::SandboxApiKey => "--sandbox-api-key-file",
                _ => "--access-key-secret-file",
            };
            flags.insert(key, FlagValue::Secret(read_secret_file(flag, &path)?));
        }
        Ok(flags)
    }

    /// The `-file` flags given a path, by the key each reads; an empty or blank one is
    /// skipped like any blank value.
    pub fn secret_files(&self) -> Vec<(Key, PathBuf)> {
        [
            (Key::SandboxApiKey, &self.sandbox_api_key_file),
            (Key::AccessKeySecret, &self.access_key_secret_file),
        ]
        .into_iter()
        .filter_map(|(key, path)| Some((key, path.as_ref()?)))
        .filter(|(_, path)| !path.to_str().is_some_and(|p| p.trim().is_empty()))
        .map(|(key, path)| (key, PathBuf::from(path)))
        .collect()
    }

    /// `--provider-option FIELD=VALUE` pairs.
    /// One without `=` is a bad command line (E8004, exit 2); it is not quoted back, as it
    /// may be a value typed in the wrong place. A blank one is skipped, as a blank value of
    /// any flag is (SPEC §2; `--provider-option "$UNSET"` in a unit file). A field given
    /// twice takes its last value, as a flag given twice does (a wrapper's `$DEFAULTS`
    /// before the user's own), in the place it was first given; a blank value beside
    /// another is skipped, as a blank flag is (`region=$UNSET` keeps the wrapper's, and
    /// `api_key=<secret> api_key=` is still a secret on the command line, refused).
    pub fn provider_options(&self) -> Result<Vec<(String, String)>, Error> {
        let options: Vec<(String, String)> = self
            .provider_option
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.0.trim().is_empty())
            .map(|(i, o)| {
                let refused = |reason: &str| Error::ProviderOption {
                    field: format!("#{}", i + 1),
                    reason: reason.into(),
                };
                match o.0.split_once('=') {
                    None => Err(refused("expects FIELD=VALUE and has no '='")),
                    Some((k, _)) if k.trim().is_empty() => {
                        Err(refused("expects FIELD=VALUE and has no FIELD"))
                    }
                    Some((k, v)) => Ok((k.trim().to_string(), v.to_string())),
                }
            })
            .collect::<Result<_, _>>()?;
        let mut kept: Vec<(String, String)> = Vec::with_capacity(options.len());
        for (field, value) in options {
            match kept.iter_mut().find(|(f, _)| *f == field) {
                Some(earlier) if !value.trim().is_empty() => earlier.1 = value,
                Some(_) => {}
                None => kept.push((field, value)),
            }
        }
        Ok(kept)
    }
}

/// One `--provider-option FIELD=VALUE`. Its `Debug` shows the field only: a secret given
/// there by mistake is refused (E8004), but the parsed arguments live on for SIGHUP.
#[derive(Clone, Default)]
pub struct ProviderOption(pub String);

impl std::str::FromStr for ProviderOption {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(ProviderOption(s.to_string()))
    }
}

impl std::fmt::Debug for ProviderOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.split_once('=') {
            Some((field, _)) => write!(f, "{field}=…"),
            None => f.write_str("…"),
        }
    }
}

/// `--log-level`: a filter that does not parse, or that would log nothing (`warning`, see
/// [`crate::logging::filter_refusal`]), is a bad command line (exit 2), not a silent fall
/// back to the default or silence. A blank one is skipped like any blank flag (SPEC §2):
/// `logging::init` takes it for not given. (An empty filter parses, and lets almost
/// nothing through: the listening line and every access line were gone.)
fn log_filter(raw: &str) -> Result<String, String> {
    if raw.trim().is_empty() {
        return Ok(String::new());
    }
    match crate::logging::filter_refusal(raw) {
        Some(why) => Err(why),
        None => Ok(crate::logging::normalized(raw)),
    }
}

/// A secret file as Kubernetes mounts it: the value, maybe with a trailing newline. A
/// byte-order mark before it is dropped, as the `.env` reader drops one: Notepad and
/// PowerShell 5's `Set-Content -Encoding utf8` write one, and it was sent as part of the
/// key (401 on every request, where `check --offline` said ok).
///
/// The path is named in the error only when something exists there (see
/// [`crate::watched::unread`]).
fn read_secret_file(flag: &str, path: &Path) -> Result<Secret, Error> {
    let bytes = crate::watched::read(path)
        .map_err(|e| crate::watched::unread(flag, path, crate::watched::reason(&e)))?;
    // Where, or that it is UTF-16 (PowerShell 5's `"key" > file`), never what.
    let text = crate::watched::utf8(bytes).map_err(|e| Error::ReadFile {
        path: path.display().to_string(),
        reason: crate::watched::reason(&e),
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let trimmed = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text);
    Ok(Secret::new(trimmed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serve's flags are each a setting's or flag-only, never both: a variable named after
    /// a flag-only one is warned about, and a flag left off both lists went unsaid.
    #[test]
    fn each_of_serves_flags_is_a_settings_or_flag_only() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").expect("serve");
        let longs: Vec<&str> = (serve.get_arguments())
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .filter(|l| *l != "help")
            .collect();
        let setting = |flag: &str| {
            let name = flag.replace('-', "_");
            crate::settings::KEYS.iter().any(|k| k.name == name)
        };
        for flag in crate::settings::FLAG_ONLY {
            assert!(
                longs.contains(&flag),
                "--{flag} is no flag of serve: {longs:?}"
            );
            assert!(!setting(flag), "--{flag} is a setting's");
        }
        for flag in longs {
            let flag_only = crate::settings::FLAG_ONLY.contains(&flag);
            assert!(setting(flag) || flag_only, "--{flag} is on neither list");
        }
    }

    /// A flag given twice takes its last value, as curl and cloud-sql-proxy's flags do (a
    /// wrapper's `abx-proxy $DEFAULTS --listen X` was refused: "cannot be used multiple
    /// times"); a flag that takes many values keeps them all.
    #[test]
    fn a_flag_given_twice_takes_its_last_value() {
        let args = [
            "abx-proxy",
            "serve",
            "--listen",
            "127.0.0.1:1",
            "--region",
            "cn-beijing",
            "--listen",
            "127.0.0.1:2",
            "--region",
            "cn-shanghai",
            "--allowed-host",
            "a.example",
            "--allowed-host",
            "b.example",
        ];
        let parsed = Cli::parse_args(args).map_err(|e| e.to_string());
        let Ok(Cli {
            command: Some(Command::Serve(serve)),
            ..
        }) = parsed
        else {
            panic!("{parsed:?}");
        };
        assert_eq!(serve.settings.listen.as_deref(), Some("127.0.0.1:2"));
        assert_eq!(serve.settings.region.as_deref(), Some("cn-shanghai"));
        assert_eq!(serve.exposure.allowed_host, ["a.example", "b.example"]);
        let twice = ["abx-proxy", "check", "--offline", "--offline"];
        assert!(Cli::parse_args(twice).is_ok());
    }

    /// A blank value given after (or before) a real one for the same settings flag is
    /// skipped, as a blank flag is: the real one stands. A blank flag alone is kept, to be
    /// skipped with its warning; other flags' values are left as given.
    #[test]
    fn a_blank_repeat_of_a_settings_flag_leaves_its_value() {
        let settings = |args: &[&str]| {
            let all = [&["abx-proxy", "serve"][..], args].concat();
            match Cli::parse_args(all).map_err(|e| e.to_string()) {
                Ok(Cli {
                    command: Some(Command::Serve(serve)),
                    ..
                }) => serve.settings,
                other => panic!("{args:?}: {other:?}"),
            }
        };
        let region = |args: &[&str]| settings(args).region;
        let some = |s: &str| Some(s.to_string());
        assert_eq!(region(&["--region", "a", "--region", ""]), some("a"));
        assert_eq!(region(&["--region", " ", "--region", "a"]), some("a"));
        assert_eq!(region(&["--region=a", "--region="]), some("a"));
        assert_eq!(region(&["--region", "a", "--region=  "]), some("a"));
        assert_eq!(region(&["--region", ""]), some(""));
        assert_eq!(region(&["--region", "a", "--region", "b"]), some("b"));
        let files = ["--sandbox-api-key-file", "k", "--sandbox-api-key-file", ""];
        assert_eq!(settings(&files).sandbox_api_key_file, Some("k".into()));
    }

    #[test]
    fn an_allowed_host_is_a_name_a_host_could_be() {
        for (raw, kept) in [
            ("Proxy.Internal.", "proxy.internal"),
            ("[::ffff:10.0.0.7]", "10.0.0.7"),
            ("[2001:DB8::5]", "[2001:db8::5]"),
            ("my_service", "my_service"),
            ("xn--bcher-kva.example", "xn--bcher-kva.example"),
            ("10.0.0.7.", "10.0.0.7"),
            (" ", ""),
        ] {
            assert_eq!(allowed_host(raw).as_deref(), Ok(kept), "{raw}");
        }
        for (raw, said) in [
            ("*.example.com", "not a pattern"),
            ("a.example,b.example", "give each its own"),
            ("bad/host", "letters, digits"),
            ("a b", "letters, digits"),
            ("a;b", "letters, digits"),
            ("host'x", "letters, digits"),
            ("a%20b", "letters, digits"),
            ("bücher.example", "xn--"),
            ("[fe80::1%eth0]", "without a zone"),
            ("fe80::1%eth0", "without a zone"),
            ("http://proxy", "not a URL"),
            ("[::1", "letters, digits"),
            ("[::1]:8080", "without a port"),
            (".", "letters, digits"),
            ("a..b", "letters, digits"),
            ("proxy.internal:8443", "without a port"),
        ] {
            let e = allowed_host(raw).expect_err(raw);
            assert!(e.contains(said), "{raw}: {e}");
        }
    }

    #[test]
    fn a_secret_file_loses_its_byte_order_mark_and_one_line_end() {
        let dir = tempfile::tempdir().expect("dir");
        for (written, read) in [
            ("\u{feff}sk-bom\r\n", "sk-bom"),
            ("\u{feff}sk-bom", "sk-bom"),
            ("sk-plain\n", "sk-plain"),
            ("sk-two\n\n", "sk-two\n"),
        ] {
            let path = dir.path().join("key");
            std::fs::write(&path, written).expect("write");
            let secret = read_secret_file("--sandbox-api-key-file", &path).expect("read");
            assert_eq!(secret.expose(), read, "{written:?}");
        }
        // PowerShell 5's `"sk-utf16" > key`: said as UTF-16, never quoted.
        let path = dir.path().join("utf16");
        let utf16: Vec<u8> = [0xff, 0xfe]
            .into_iter()
            .chain("sk-utf16".bytes().flat_map(|b| [b, 0]))
            .collect();
        std::fs::write(&path, utf16).expect("write");
        let e = read_secret_file("--sandbox-api-key-file", &path).expect_err("UTF-16");
        assert!(e.to_string().contains("UTF-16 text"), "{e}");
    }

    /// clap suggests the nearest flag, hidden ones included: a misspelt secret flag is
    /// pointed at the file flag, never at the flag that refuses the secret.
    #[test]
    fn a_misspelt_secret_flag_is_pointed_at_the_file_flag() {
        for (typed, tip) in [
            (
                "--sandbox-apikey=sk-typo-1234",
                Some("'--sandbox-api-key-file'"),
            ),
            ("--access-key-secrt", Some("'--access-key-secret-file'")),
            ("--github-tokn", None),
        ] {
            for args in [vec!["abx-proxy", typed], vec!["abx-proxy", "check", typed]] {
                let e = Cli::parse_args(&args).expect_err(typed);
                let said = e.render().to_string();
                assert!(said.contains("unexpected argument"), "{said}");
                assert!(
                    said.contains("Usage: abx-proxy") && said.contains("try '--help'"),
                    "{said}"
                );
                assert!(!said.contains("sk-typo"), "{said}");
                match tip {
                    Some(tip) => assert!(
                        said.contains(&format!("similar argument exists: {tip}")),
                        "{said}"
                    ),
                    None => assert!(!said.contains("tip:"), "{said}"),
                }
            }
        }
        // Other suggestions are clap's own.
        let e = Cli::parse_args(["abx-proxy", "--upstream-timout", "1s"]).expect_err("typo");
        assert!(e.render().to_string().contains("'--upstream-timeout'"));
    }

    /// A secret passed as a flag is refused, and its value is not kept anywhere `Debug`
    /// could show it.
    #[test]
    fn a_refused_secret_flag_keeps_no_value() {
        for (flag, value) in [
            ("--sandbox-api-key", "sk-cli-secret-1234"),
            ("--access-key-secret", "ak-cli-secret-5678"),
            ("--github-token", "-ghp-cli-secret"),
        ] {
            for args in [
                vec!["abx-proxy", flag, value],
                vec!["abx-proxy", "check", &format!("{flag}={value}")],
            ] {
                let cli = Cli::try_parse_from(&args).unwrap();
                let settings = match &cli.command {
                    Some(Command::Check(c)) => &c.settings,
                    _ => &cli.serve.settings,
                };
                assert_eq!(settings.refused_secret().map(|r| r.0), Some(flag));
                let shown = format!("{cli:?}");
                assert!(!shown.contains("cli-secret"), "{shown}");
            }
        }
    }

    /// A `--provider-option` may carry a secret by mistake (refused later, E8004): its
    /// `Debug` shows the field only.
    #[test]
    fn provider_options_show_their_fields_only() {
        let args = [
            "abx-proxy",
            "--provider-option",
            "api_key=sk-option-zq91",
            "--provider-option",
            "no-equals-zq92",
        ];
        let cli = Cli::try_parse_from(args).unwrap();
        let shown = format!("{cli:?}");
        assert!(!shown.contains("zq9"), "{shown}");
        assert!(shown.contains("api_key=…"), "{shown}");
        let options = cli.serve.settings.provider_options();
        assert!(options.is_err(), "the one without '=' is refused");
    }

    /// A blank `--provider-option` is skipped, as any flag's blank value is (SPEC §2);
    /// the options after it keep their numbers in errors.
    #[test]
    fn a_blank_provider_option_is_skipped() {
        let parse = |args: &[&str]| {
            let args = [&["abx-proxy"], args].concat();
            Cli::try_parse_from(args)
                .unwrap()
                .serve
                .settings
                .provider_options()
        };
        let options = parse(&[
            "--provider-option",
            "",
            "--provider-option",
            " \t",
            "--provider-option",
            "region=eu",
        ])
        .expect("blank ones skipped");
        assert_eq!(options, [("region".to_string(), "eu".to_string())]);
        let e = parse(&["--provider-option", "", "--provider-option", "oops"]).expect_err("no '='");
        assert!(e.to_string().contains("#2"), "{e}");
        // A field given twice: its last value, where it was first given.
        let options = parse(&[
            "--provider-option",
            "region=eu",
            "--provider-option",
            "zone=a",
            "--provider-option",
            " region=us",
        ])
        .expect("a field twice");
        let pair = |f: &str, v: &str| (f.to_string(), v.to_string());
        assert_eq!(options, [pair("region", "us"), pair("zone", "a")]);
        // A blank value beside another is skipped, before it or after it.
        let options = parse(&[
            "--provider-option",
            "region=",
            "--provider-option",
            "region=eu",
            "--provider-option",
            "region= ",
        ])
        .expect("a blank beside a value");
        assert_eq!(options, [pair("region", "eu")]);
        let e = parse(&["--provider-option", " =x"]).expect_err("no field");
        assert!(
            e.to_string()
                .contains("#1: expects FIELD=VALUE and has no FIELD"),
            "{e}"
        );
    }
}
