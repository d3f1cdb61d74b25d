//! Settings: every key of SPEC §2 resolved through the chain (flags → environment →
//! `./.env` → `~/.abx/.env` → `~/.abx/config.toml` → default), per key, blank values
//! skipped; then validated once into typed [`Settings`] before any port is bound.
//!
//! [`Resolved`] is the raw view (value + source per key) that `config list` prints;
//! [`Settings`] is what the proxy runs on.

mod expansion;
pub mod keys;
pub mod layers;
pub mod shown;
pub(crate) mod values;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;

pub use keys::{Key, KeySpec, KEYS};
pub use layers::Source;
pub use shown::shown;
pub use values::{parse_duration, CompatMode, ExchangeScheme, ListenAddr, UpstreamUrl};

use crate::error::Error;
use crate::providers::{self, AuthKind, PluginSettings};
use crate::secret::Secret;

/// What the chain is resolved from. `flags` is the highest level: command-line flags, or
/// code parameters for the library (see [`Builder`]).
#[derive(Clone, Default)]
pub struct Inputs {
    pub flags: HashMap<Key, FlagValue>,
    /// `--provider-option FIELD=VALUE` pairs, for plugin providers.
    pub provider_options: Vec<(String, String)>,
    pub env: HashMap<String, String>,
    /// Names of environment variables whose value is not UTF-8. Only an error when a
    /// setting reads one: a stray variable of another program must not stop the proxy.
    pub env_not_unicode: BTreeSet<String>,
    pub cwd: PathBuf,
    /// `~/.abx` (or `$ABX_HOME`); `None` when ABX_HOME is unset or blank and HOME is
    /// unset, blank, or names a file or a path through one (a HOME not made yet still
    /// gives `HOME/.abx`).
    pub abx_home: Option<PathBuf>,
}

/// The environment holds secrets (`ABX_SANDBOX_API_KEY`, …): only its names are shown.
impl std::fmt::Debug for Inputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inputs")
            .field("flags", &self.flags)
            .field("provider_options", &option_names(&self.provider_options))
            .field("env", &names(&self.env))
            .field("env_not_unicode", &self.env_not_unicode)
            .field("cwd", &self.cwd)
            .field("abx_home", &self.abx_home)
            .finish()
    }
}

/// A raw layer's variable names, sorted, without their values.
fn names(map: &HashMap<String, String>) -> Vec<&str> {
    let mut names: Vec<&str> = map.keys().map(String::as_str).collect();
    names.sort_unstable();
    names
}

/// `--provider-option` fields without their values: a secret one is refused, but only
/// after it was read.
fn option_names(options: &[(String, String)]) -> Vec<&str> {
    options.iter().map(|(field, _)| field.as_str()).collect()
}

/// A flag's value; secrets arrive only through `--*-file` flags or code parameters.
#[derive(Clone, Debug)]
pub enum FlagValue {
    Plain(String),
    Secret(Secret),
}

impl Inputs {
    /// The process environment and current directory, with the given flag-level values.
    /// `std::env::vars` would panic on a value that is not UTF-8 (and print it, key or
    /// not); such values are set aside by name and refused only if a setting reads them.
    pub fn from_process(flags: HashMap<Key, FlagValue>) -> Self {
        let mut env = HashMap::new();
        let mut env_not_unicode = BTreeSet::new();
        for (name, value) in std::env::vars_os() {
            // Every name this crate reads is ASCII: a name that is not UTF-8 is not one.
            let Ok(name) = name.into_string() else {
                continue;
            };
            match value.into_string() {
                Ok(v) => {
                    env.insert(name, v);
                }
                Err(_) => {
                    env_not_unicode.insert(name);
                }
            }
        }
        Inputs {
            abx_home: layers::abx_home(|name| std::env::var_os(name)),
            flags,
            provider_options: Vec::new(),
            env,
            env_not_unicode,
            cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from(".")),
        }
    }
}

/// Code parameters for library users: the same level as command-line flags.
#[derive(Debug, Default, Clone)]
pub struct Builder {
    flags: HashMap<Key, FlagValue>,
}

impl Builder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a non-secret key (`region`, `listen`, …) or, for a secret key, its value.
    pub fn set(mut self, key: Key, value: impl Into<String>) -> Self {
        let value = value.into();
        let v = if key.spec().secret {
            FlagValue::Secret(Secret::new(value))
        } else {
            FlagValue::Plain(value)
        };
        self.flags.insert(key, v);
        self
    }

    pub fn sandbox_api_key(self, key: Secret) -> Self {
        let mut b = self;
        b.flags.insert(Key::SandboxApiKey, FlagValue::Secret(key));
        b
    }

    /// Resolves against the process environment and files, with these values on top.
    pub fn resolve(self) -> Result<Resolved, Error> {
        Resolved::from_inputs(&Inputs::from_process(self.flags))
    }
}

/// One key's effective value and where it came from.
#[derive(Debug, Clone)]
pub struct Entry {
    pub spec: &'static KeySpec,
    pub value: Option<Value>,
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Plain(String),
    Secret(Secret),
}

impl Value {
    /// A plain value as it is, a secret masked: what the non-secret settings are read
    /// from. Not for printing: a plain value may carry a secret (see [`Value::printed`]).
    pub fn text(&self) -> String {
        match self {
            Value::Plain(s) => s.clone(),
            Value::Secret(s) => s.masked(),
        }
    }

    /// The value as `config list` prints it: a secret masked, a plain value through
    /// [`shown()`] with the resolved `secrets`.
    pub fn printed(&self, secrets: &[Secret]) -> String {
        match self {
            Value::Plain(s) => shown(s, secrets),
            Value::Secret(s) => s.masked(),
        }
    }
}

fn secrets_of(values: &[Value]) -> Vec<Secret> {
    values
        .iter()
        .filter_map(|v| match v {
            Value::Secret(s) => Some(s.clone()),
            Value::Plain(_) => None,
        })
        .collect()
}

/// Which credential is attached to control-plane requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialKind {
    ApiKey,
    AccessKey,
}

impl CredentialKind {
    pub fn label(self) -> &'static str {
        match self {
            CredentialKind::ApiKey => "api_key",
            CredentialKind::AccessKey => "access_key",
        }
    }
}

/// The chain resolved for every key, before validation.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub entries: Vec<Entry>,
    /// `~/.abx` (or `$ABX_HOME`), where plugin providers are installed.
    pub abx_home: Option<PathBuf>,
    /// Every layer's raw maps, kept for plugin provider fields.
    pub layers: RawLayers,
    pub warnings: Vec<String>,
    /// The secret field values of every installed plugin, selected or not: masked in what
    /// is printed as the selected one's are (a key pasted as another setting's value).
    installed_secrets: Vec<Secret>,
}

/// The layers as read, by env name (env, `.env` files) or key (toml, flags).
#[derive(Clone, Default)]
pub struct RawLayers {
    pub flags: HashMap<Key, FlagValue>,
    pub provider_options: Vec<(String, String)>,
    pub env: HashMap<String, String>,
    /// See [`Inputs::env_not_unicode`].
    pub env_not_unicode: BTreeSet<String>,
    pub dotenv_cwd: HashMap<String, String>,
    pub dotenv_home: HashMap<String, String>,
    pub toml: HashMap<String, String>,
    /// The config.toml read, for warnings about its plugin tables.
    pub toml_path: Option<std::path::PathBuf>,
    /// The `./.env` read (in the working directory at the time), for messages.
    pub dotenv_cwd_path: Option<std::path::PathBuf>,
}

/// The env and `.env` layers hold secrets as read: only their names are shown. (Plugin
/// fields in config.toml may be secrets too, ignored with a warning but still read.)
impl std::fmt::Debug for RawLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawLayers")
            .field("flags", &self.flags)
            .field("provider_options", &option_names(&self.provider_options))
            .field("env", &names(&self.env))
            .field("env_not_unicode", &self.env_not_unicode)
            .field("dotenv_cwd", &names(&self.dotenv_cwd))
            .field("dotenv_home", &names(&self.dotenv_home))
            .field("toml", &names(&self.toml))
            .field("toml_path", &self.toml_path)
            .field("dotenv_cwd_path", &self.dotenv_cwd_path)
            .finish()
    }
}

fn nonblank(v: &str) -> Option<&str> {
    let t = v.trim();
    (!t.is_empty()).then_some(t)
}

/// A value, its layer, and the variable that gave it (`None` from config.toml).
pub type Found<'e> = (String, Source, Option<&'e str>);

impl RawLayers {
    /// The highest non-blank value for these env names / toml key, with its source. For a
    /// secret, config.toml was already stripped when read. `key` names the setting in the
    /// error for an environment variable that would be read but is not UTF-8 (E1005: its
    /// value is never shown, it may be a secret).
    pub fn lookup(
        &self,
        key: &str,
        envs: &[&str],
        toml_key: Option<&str>,
    ) -> Result<Option<(String, Source)>, Error> {
        let found = self.lookup_named(key, envs, toml_key)?;
        Ok(found.map(|(v, source, _)| (v, source)))
    }

    /// [`RawLayers::lookup`], and the variable that gave the value: among aliases, what a
    /// warning or `config list` names.
    pub fn lookup_named<'e>(
        &self,
        key: &str,
        envs: &[&'e str],
        toml_key: Option<&str>,
    ) -> Result<Option<Found<'e>>, Error> {
        for name in envs {
            if let Some(v) = self.env.get(*name).and_then(|v| nonblank(v)) {
                return Ok(Some((v.to_string(), Source::Env, Some(name))));
            }
            if self.env_not_unicode.contains(*name) {
                return Err(Error::InvalidSetting {
                    key: key.to_string(),
                    reason: format!("{name} in the environment is not valid UTF-8"),
                });
            }
        }
        let by_env = |map: &HashMap<String, String>| {
            envs.iter().find_map(|e| {
                let v = map.get(*e).and_then(|v| nonblank(v))?;
                Some((v.to_string(), Some(*e)))
            })
        };
        Ok(by_env(&self.dotenv_cwd)
            .map(|(v, e)| (v, Source::DotEnvCwd, e))
            .or_else(|| by_env(&self.dotenv_home).map(|(v, e)| (v, Source::DotEnvHome, e)))
            .or_else(|| {
                toml_key
                    .and_then(|k| self.toml.get(k))
                    .and_then(|v| nonblank(v))
                    .map(|v| (v.to_string(), Source::ConfigToml, None))
            }))
    }
}

/// An `ABX_HOME` that is no absolute path is read from the working directory, as every
/// relative path is: `ABX_HOME=~/.abx` from a systemd `Environment=` or a container's env
/// (neither expands `~`) read `./~/.abx`, and `config list` showed the key unset without a
/// word, while E1001 said to put it in `~/.abx/.env`, where it was.
pub(crate) fn relative_abx_home(home: Option<&str>, cwd: &std::path::Path) -> Option<String> {
    let home = home.filter(|h| !h.trim().is_empty())?;
    if std::path::Path::new(home).is_absolute() {
        return None;
    }
    let tilde = match home.starts_with('~') {
        true => " (a `~` is expanded by a shell, not by systemd or a container's env)",
        false => "",
    };
    Some(format!(
        "ABX_HOME ({home}) is not an absolute path: it is read from the working directory, \
         {}{tilde}; write it out in full",
        cwd.join(home).display()
    ))
}

/// A key file that holds a `.env` line (`ABX_SANDBOX_API_KEY=…`, `export` or not) rather
/// than the key alone: it is read whole, as Kubernetes mounts a secret, so the name went
/// upstream with the key (401 on every request) while `check --offline` said ok. Said,
/// never the line: a name must hold a `_` and only capitals, digits and `_` (a base32 key
/// ends in `=` too), and nothing of the file is repeated.
fn assignments_in_key_files(flags: &HashMap<Key, FlagValue>) -> Vec<String> {
    let assignment = |v: &str| {
        let v = v.strip_prefix("export ").unwrap_or(v).trim_start();
        v.split_once('=').is_some_and(|(name, value)| {
            name.contains('_')
                && name.starts_with(|c: char| c.is_ascii_uppercase())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                && !value.is_empty()
        })
    };
    [
        (Key::SandboxApiKey, "--sandbox-api-key-file"),
        (Key::AccessKeySecret, "--access-key-secret-file"),
    ]
    .into_iter()
    .filter(
        |(key, _)| matches!(flags.get(key), Some(FlagValue::Secret(s)) if assignment(s.expose())),
    )
    .map(|(_, flag)| {
        format!(
            "the file given to {flag} holds a NAME=value line, and all of it is sent as the \
             key: write the value alone (as a Kubernetes secret holds it), or put the line \
             in a .env file"
        )
    })
    .collect()
}

/// An API key longer than this is no API key (they are tens of bytes): a file of
/// something else, read whole. Many servers refuse header fields far shorter (nginx's line
/// buffer is 8 KiB): every request got the upstream's 431 while `/readyz` said 200.
const LONGEST_PLAUSIBLE_KEY: usize = 4096;

/// An API key that cannot be one as written: with an auth scheme or a header's name before
/// it (`Bearer sk-…`, `X-API-Key: sk-…`, copied from a curl line: the proxy writes the
/// header itself, and the upstream got it twice), with a space or a tab (no key has one),
/// or far too long. Warned, not refused: the proxy cannot know a provider's key format.
/// `from` says where it was read, `header` the field it is sent in. Never the key or any
/// part of it but a scheme's or a header's name, and only one of those known (`keyid:
/// secret` would show its id).
fn implausible_key(key: &Secret, from: &str, header: &str) -> Option<String> {
    let key = key.expose();
    let word_end = key
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or(key.len());
    let (word, rest) = key.split_at(word_end);
    let is = |names: &[&str]| names.iter().any(|n| word.eq_ignore_ascii_case(n));
    let said = if is(&["bearer", "basic", "token"]) && rest.starts_with([' ', '\t', ':']) {
        format!("begins with `{word}`, an auth scheme")
    } else if is(&["authorization", "x-api-key", header]) && rest.starts_with(':') {
        format!("begins with `{word}:`, a header's name")
    } else if key.contains([' ', '\t']) {
        "holds a space or a tab, which no API key has".to_string()
    } else if key.len() > LONGEST_PLAUSIBLE_KEY {
        format!(
            "is {} bytes long, far longer than an API key (many servers refuse a header \
             that long: 431)",
            key.len()
        )
    } else {
        return None;
    };
    let sent = if header.eq_ignore_ascii_case("authorization") {
        "Authorization: Bearer <key>".to_string()
    } else {
        format!("{header}: <key>")
    };
    Some(format!(
        "the API key (from {from}) {said}: the proxy sends it whole as `{sent}`; set the key \
         alone"
    ))
}

/// `serve`'s and `check`'s flags that are no setting of the chain: no variable, no
/// `config.toml` key (checked against the command line in `cli`'s tests).
pub const FLAG_ONLY: [&str; 16] = [
    "sandbox-api-key-file",
    "access-key-secret-file",
    "provider-option",
    "allow-remote",
    "allowed-host",
    "tls-cert",
    "tls-key",
    "upstream-ca",
    "connect-timeout",
    "upstream-timeout",
    "header-timeout",
    "idle-timeout",
    "shutdown-grace",
    "max-connections",
    "log-format",
    "log-level",
];

impl Resolved {
    pub fn from_inputs(inputs: &Inputs) -> Result<Self, Error> {
        let mut warnings = Vec::new();
        let mut skipped = Vec::new();
        let cwd_env = inputs.cwd.join(".env");
        // Run from ABX_HOME (as the systemd unit is), `./.env` is ABX_HOME's own: one file,
        // read once, as ABX_HOME's. Read as both, it warned about itself as a stray
        // project file redirecting the key, twice about its mode, and shadowed itself.
        let home_env = inputs.abx_home.as_ref().map(|h| h.join(".env"));
        let dotenv_cwd = if home_env.is_some_and(|h| layers::same_file(&cwd_env, &h)) {
            HashMap::new()
        } else {
            layers::read_dotenv(&cwd_env, "./.env", Some(&mut skipped), &mut warnings)?
        };
        let skipped_at = warnings.len();
        let home = inputs.env.get("ABX_HOME").map(String::as_str);
        warnings.extend(relative_abx_home(home, &inputs.cwd));
        let (dotenv_home, toml) = match &inputs.abx_home {
            Some(home) => (
                layers::read_dotenv(&home.join(".env"), "~/.abx/.env", None, &mut warnings)?,
                layers::read_config_toml(&home.join("config.toml"), &mut warnings)?,
            ),
            None => {
                // A service run without `User=` (systemd sets HOME only with one) or under
                // `env -i`: its key in `/root/.abx/.env` was passed over without a word,
                // and E1001 named `~/.abx/.env`. `HOME=/dev/null` says "no home" on purpose.
                let home_unset = inputs.env.get("HOME").is_none_or(|h| h.trim().is_empty())
                    && !inputs.env_not_unicode.contains("HOME");
                if home_unset {
                    warnings.push(
                        "~/.abx/.env and ~/.abx/config.toml are not read: HOME is unset or blank \
                         (set ABX_HOME to the directory that holds them)"
                            .to_string(),
                    );
                }
                Default::default()
            }
        };
        let layers = RawLayers {
            flags: inputs.flags.clone(),
            provider_options: inputs.provider_options.clone(),
            env: inputs.env.clone(),
            env_not_unicode: inputs.env_not_unicode.clone(),
            dotenv_cwd,
            dotenv_home,
            toml,
            toml_path: inputs.abx_home.as_ref().map(|h| h.join("config.toml")),
            dotenv_cwd_path: Some(inputs.cwd.join(".env")),
        };

        let mut entries: Vec<Entry> = KEYS
            .iter()
            .map(|spec| {
                let from_flag = layers.flags.get(&spec.key).and_then(|f| match f {
                    FlagValue::Plain(v) => nonblank(v).map(|v| Value::Plain(v.to_string())),
                    FlagValue::Secret(s) => {
                        nonblank(s.expose()).map(|v| Value::Secret(Secret::new(v)))
                    }
                });
                let (value, source) = match from_flag {
                    Some(v) => (Some(v), Source::Flag),
                    None => {
                        let toml_key = (!spec.secret).then_some(spec.name);
                        match layers.lookup(spec.name, &[spec.env], toml_key)? {
                            Some((v, src)) if spec.secret => {
                                (Some(Value::Secret(Secret::new(v))), src)
                            }
                            Some((v, src)) => (Some(Value::Plain(v)), src),
                            None => (None, Source::Unset),
                        }
                    }
                };
                Ok(Entry {
                    spec,
                    value,
                    source,
                })
            })
            .collect::<Result<_, Error>>()?;

        // Defaults last: some derive from the effective region.
        let region = entries[Key::Region as usize]
            .value
            .as_ref()
            .map(Value::text)
            .unwrap_or_else(|| keys::DEFAULT_REGION.to_string());
        for e in entries.iter_mut().filter(|e| e.value.is_none()) {
            if let Some(d) = e.spec.key.default_value(&region) {
                e.value = Some(Value::Plain(d));
                e.source = Source::Default;
            }
        }
        warnings.extend(assignments_in_key_files(&inputs.flags));
        let installed_secrets = inputs
            .abx_home
            .as_deref()
            .map(|home| providers::installed_secrets(home, &layers))
            .unwrap_or_default();
        let mut resolved = Resolved {
            entries,
            abx_home: inputs.abx_home.clone(),
            layers,
            warnings,
            installed_secrets,
        };
        resolved.settle_skipped(skipped, skipped_at)?;
        Ok(resolved)
    }

    /// The lines of `./.env` set aside when it was read (see [`layers::SkippedLine`]), now
    /// that the provider is known: one setting a variable the selected plugin reads fails
    /// as a broken line of abx-proxy's own does (skipping it contradicted the "not set"
    /// error that followed and hid the syntax error); the others are warnings, where the
    /// reader put them before. A plugin that does not load reads nothing here: its error
    /// is reported when it is resolved.
    fn settle_skipped(
        &mut self,
        mut skipped: Vec<layers::SkippedLine>,
        at: usize,
    ) -> Result<(), Error> {
        if skipped.is_empty() {
            return Ok(());
        }
        let id = self.plain(Key::Provider).unwrap_or(providers::BUILTIN);
        let plugin_env: Vec<String> = match &self.abx_home {
            Some(home) if id != providers::BUILTIN => providers::load(home, id)
                .ok()
                .flatten()
                .map(|p| p.manifest.env_names().collect())
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        if let Some(first) = skipped.iter().position(|l| l.sets_any(&plugin_env)) {
            return Err(skipped.swap_remove(first).into_error());
        }
        self.warnings
            .splice(at..at, layers::SkippedLine::warnings(&skipped));
        Ok(())
    }

    pub fn entry(&self, key: Key) -> &Entry {
        &self.entries[key as usize]
    }

    fn plain(&self, key: Key) -> Option<&str> {
        match &self.entry(key).value {
            Some(Value::Plain(s)) => Some(s),
            _ => None,
        }
    }

    fn secret(&self, key: Key) -> Option<&Secret> {
        match &self.entry(key).value {
            Some(Value::Secret(s)) => Some(s),
            _ => None,
        }
    }

    /// Every secret that resolved, the plugins' secret fields included: what [`shown()`]
    /// hides in the values printed.
    pub fn secrets(&self) -> Vec<Secret> {
        let mut secrets = secrets_of(&self.values());
        secrets.extend(self.installed_secrets.iter().cloned());
        secrets
    }

    /// Every value that resolved, the selected plugin's fields included.
    fn values(&self) -> Vec<Value> {
        let plugin = self.plugin().ok().flatten();
        let fields = plugin.iter().flat_map(|p| &p.fields).map(|f| &f.value);
        self.entries
            .iter()
            .map(|e| &e.value)
            .chain(fields)
            .flatten()
            .cloned()
            .collect()
    }

    /// The secrets that a plain value carries (a `.env`'s `${VAR}` in a URL or a domain).
    /// Other crates' debug lines print upstream host names as resolved (rustls's server
    /// name, hyper-util's pool keys): the log writer masks these in every line.
    pub fn embedded_secrets(&self) -> Vec<Secret> {
        let values = self.values();
        let plain: Vec<&str> = values
            .iter()
            .filter_map(|v| match v {
                Value::Plain(s) => Some(s.as_str()),
                Value::Secret(_) => None,
            })
            .collect();
        secrets_of(&values)
            .into_iter()
            .filter(|s| s.expose().chars().count() >= shown::MIN_EMBEDDED)
            .filter(|s| plain.iter().any(|p| p.contains(s.expose())))
            .collect()
    }

    /// A layer as messages name it: a file as the user knows it and where it is (a
    /// service's `~/.abx` is its `ABX_HOME`, a `./.env` is the working directory's), the
    /// others by their label.
    pub(crate) fn file_shown(&self, source: Source) -> String {
        let path = match source {
            Source::DotEnvCwd => self.layers.dotenv_cwd_path.clone(),
            Source::DotEnvHome => self.abx_home.as_ref().map(|h| h.join(".env")),
            Source::ConfigToml => self.layers.toml_path.clone(),
            _ => None,
        };
        match path {
            Some(path) => layers::labelled(source.label(), &path),
            None => source.label().to_string(),
        }
    }

    /// The credential rule of SPEC §2: the highest level decides, a pair counts at the level
    /// of its lower half, a tie goes to the API key. Also the warning for a stray half pair.
    pub fn credential(&self) -> Result<(CredentialKind, Source, Option<String>), Error> {
        let key = self.entry(Key::SandboxApiKey);
        let id = self.entry(Key::AccessKeyId);
        let secret = self.entry(Key::AccessKeySecret);
        let pair = match (&id.value, &secret.value) {
            (Some(_), Some(_)) => Some(id.source.max(secret.source)),
            _ => None,
        };
        // Each half by where it was given: a secret from --access-key-secret-file was said
        // to be ALICLOUD_ACCESS_KEY_SECRET, which the user had not set; a half left in a
        // file, by its file (the environment has no such variable to look for), with its
        // path: a service's `~/.abx` is its `ABX_HOME`, not the reader's.
        let named = |e: &Entry| match e.source {
            Source::Flag => e.spec.key.flag(),
            Source::ConfigToml => format!("{} in {}", e.spec.key.name(), self.file_shown(e.source)),
            Source::DotEnvCwd | Source::DotEnvHome => {
                format!("{} in {}", e.spec.env, self.file_shown(e.source))
            }
            _ => e.spec.env.to_string(),
        };
        let half = match (&id.value, &secret.value) {
            (Some(_), None) => Some((
                named(id),
                "ALICLOUD_ACCESS_KEY_SECRET (or --access-key-secret-file)".to_string(),
            )),
            (None, Some(_)) => Some((named(secret), "ALICLOUD_ACCESS_KEY_ID".to_string())),
            _ => None,
        };
        match (key.value.is_some(), pair, half) {
            (true, Some(p), _) if p < key.source => Ok((CredentialKind::AccessKey, p, None)),
            (true, _, half) => Ok((
                CredentialKind::ApiKey,
                key.source,
                half.map(|(present, missing)| {
                    format!("{present} is set but {missing} is not; using the API key")
                }),
            )),
            (false, Some(p), _) => Ok((CredentialKind::AccessKey, p, None)),
            (false, None, Some((present, missing))) => {
                Err(Error::IncompletePair { present, missing })
            }
            (false, None, None) => Err(Error::MissingCredential),
        }
    }

    /// The selected plugin provider, resolved (its manifest and receipt read again);
    /// `None` for the built-in one.
    pub fn plugin(&self) -> Result<Option<PluginSettings>, Error> {
        let id = self.plain(Key::Provider).unwrap_or(providers::BUILTIN);
        if id == providers::BUILTIN {
            return Ok(None);
        }
        // The id is printed as `config list` prints it, a URL's password and query masked,
        // and with it any secret, an installed plugin's too: a key pasted in its place.
        // (Not `secrets()`: it asks this function for the selected plugin's.)
        let unknown = || {
            let values: Vec<Value> = self
                .entries
                .iter()
                .filter_map(|e| e.value.clone())
                .collect();
            let mut secrets = secrets_of(&values);
            secrets.extend(self.installed_secrets.iter().cloned());
            Error::UnknownProvider {
                id: shown(id, &secrets),
            }
        };
        let home = self.abx_home.as_deref().ok_or_else(unknown)?;
        let installed = providers::load(home, id)?.ok_or_else(unknown)?;
        let path = installed.dir.join(providers::MANIFEST_FILE);
        providers::shares_no_secret(
            home,
            &installed.manifest,
            &path.display().to_string(),
            false,
        )?;
        let core_key = self
            .secret(Key::SandboxApiKey)
            .map(|k| (k, self.entry(Key::SandboxApiKey).source));
        providers::resolve(installed, &self.layers, core_key).map(Some)
    }

    /// Validates every key into typed settings; the first problem is the error, saying
    /// where the value came from (the same key may be set at five levels).
    pub fn validate(&self) -> Result<Settings, Error> {
        self.validate_values().map_err(|e| self.locate(e))
    }

    /// An E1005 about a key, with where its value came from added to the key's name: the
    /// flag, or the variable and its layer. Only names and labels, never the value.
    fn locate(&self, e: Error) -> Error {
        let Error::InvalidSetting { key, reason } = e else {
            return e;
        };
        let builtin = KEYS
            .iter()
            .find(|spec| spec.name == key)
            .map(|spec| self.entry(spec.key))
            .map(|entry| (entry.source, Some(entry.spec.env.to_string())));
        // A plugin field may have come from its canonical name or a vendor alias: the one
        // it was found under is named, as `config list` names it.
        let found = builtin.or_else(|| {
            let plugin = self.plugin().ok().flatten()?;
            let field = plugin.fields.iter().find(|f| f.key == key)?;
            Some((field.source, Some(field.env.clone())))
        });
        let origin = match found {
            // A plugin's inherited key comes from the built-in key's file flag, not from
            // `--provider-option` (which refuses secret fields).
            Some((Source::Flag, env)) => Some(
                match Key::by_name(&key).or_else(|| {
                    let env = env?;
                    KEYS.iter().find(|s| s.env == env).map(|s| s.key)
                }) {
                    Some(k) => k.flag(),
                    None => "--provider-option".to_string(),
                },
            ),
            Some((src @ (Source::Env | Source::DotEnvCwd | Source::DotEnvHome), Some(env))) => {
                Some(format!("{env} from {}", self.file_shown(src)))
            }
            Some((Source::ConfigToml, _)) => Some(format!(
                "{key} from {}",
                self.file_shown(Source::ConfigToml)
            )),
            _ => None,
        };
        Error::InvalidSetting {
            key: match origin {
                Some(o) => format!("{key} ({o})"),
                None => key,
            },
            reason,
        }
    }

    fn validate_values(&self) -> Result<Settings, Error> {
        let plugin = self.plugin()?;
        // A plugin provider reads none of the built-in provider's own keys (see
        // [`Key::builtin_only`]): their defaults stand in for them, so that a value meant
        // for the built-in provider (a region exported for another tool) cannot stop a
        // plugin's start or its key's reload.
        let unread: Vec<(Key, String)> = match &plugin {
            None => Vec::new(),
            Some(_) => (KEYS.iter().map(|spec| spec.key))
                .filter(|k| k.builtin_only())
                .filter_map(|k| Some((k, k.default_value(keys::DEFAULT_REGION)?)))
                .collect(),
        };
        let get = |k: Key| match unread.iter().find(|(u, _)| *u == k) {
            Some((_, default)) => default.as_str(),
            None => self.plain(k).unwrap_or_default(),
        };
        let region = get(Key::Region).to_string();
        values::check_region(&region)?;
        let token_ttl = values::seconds(Key::TokenTtl, get(Key::TokenTtl))?;
        // A key stops being sent 5 s before it expires, and its refresh needs time before
        // that: shorter values made every key unusable or left a gap at each refresh. The
        // upper bound keeps `now + token_ttl` a date.
        if !(MIN_TOKEN_TTL..=MAX_TOKEN_TTL).contains(&token_ttl) {
            return Err(values::invalid(
                Key::TokenTtl,
                format!(
                    "must be {} to {} seconds (a year)",
                    MIN_TOKEN_TTL.as_secs(),
                    MAX_TOKEN_TTL.as_secs()
                ),
            ));
        }
        let token_refresh_before =
            values::seconds(Key::TokenRefreshBefore, get(Key::TokenRefreshBefore))?;
        if token_refresh_before < MIN_REFRESH_BEFORE {
            return Err(values::invalid(
                Key::TokenRefreshBefore,
                format!(
                    "must be at least {} seconds: a key stops being sent 5 s before it expires",
                    MIN_REFRESH_BEFORE.as_secs()
                ),
            ));
        }
        // The values before the credential: a missing key must not hide a value `check`
        // and `serve` refuse, which `config list` warns about (it said nothing then).
        let (auth, sandbox_base_url, envd_domain) = match &plugin {
            None => (
                AuthKind::Bearer,
                UpstreamUrl::parse(Key::SandboxBaseUrl, get(Key::SandboxBaseUrl))?,
                Some(values::domain(get(Key::SandboxDomain))?),
            ),
            Some(p) => (
                p.installed.manifest.auth.clone(),
                p.base_url()?,
                p.envd_domain()?,
            ),
        };
        let sandbox_url = match &plugin {
            None => self
                .plain(Key::SandboxUrl)
                .map(|u| UpstreamUrl::parse(Key::SandboxUrl, u))
                .transpose()?,
            Some(_) => None,
        };
        // Read only where no `sandbox_url` stands in for it (a leftover value is no error).
        if let (None, None, Some(domain)) = (&plugin, &sandbox_url, &envd_domain) {
            values::domain_names_hosts(domain)?;
        }
        let token_exchange_url =
            UpstreamUrl::parse(Key::TokenExchangeUrl, get(Key::TokenExchangeUrl))?;
        let token_exchange = ExchangeScheme::parse(get(Key::TokenExchange))?;
        let compat_v2_paths = CompatMode::parse(get(Key::CompatV2Paths))?;
        let listen = ListenAddr::parse(Key::Listen, get(Key::Listen))?;
        let admin_listen = ListenAddr::parse(Key::AdminListen, get(Key::AdminListen))?;
        // Said once the values that need no credential are checked (below).
        let credential = match &plugin {
            None => self.builtin_credential(),
            Some(p) => plugin_credential(p),
        };
        let mut settings = Settings {
            provider: get(Key::Provider).to_string(),
            sandbox_base_url,
            sandbox_domain: envd_domain,
            // `sandbox_url` is the built-in provider's envd address (SPEC §2): a plugin's
            // envd tokens must not follow a variable left set for another provider.
            sandbox_url,
            token_exchange_url,
            token_exchange,
            token_ttl,
            token_refresh_before,
            compat_v2_paths,
            listen,
            admin_listen,
            secrets: self.secrets(),
            region,
            // Replaced below, once the checks that need none are passed.
            credential: Credential::ApiKey(Secret::new(String::new())),
            auth,
            plugin,
        };
        settings.refuse_shared_listen()?;
        if let ListenAddr::Tcp(addr) = settings.listen {
            if addr.port() != 0 {
                settings.refuse_self_loop(addr)?;
            }
        }
        settings.credential = credential?;
        // Once the credential is known: the exchange endpoint is the pair's alone.
        settings.refuse_secret_in_host()?;
        // Here rather than when serve attaches it, so that check refuses what serve would:
        // a key pasted with a control character, or a key file of more than one line.
        if let Credential::ApiKey(key) = &settings.credential {
            crate::credentials::header_value(&settings, key)?;
        }
        Ok(settings)
    }

    fn builtin_credential(&self) -> Result<Credential, Error> {
        let (kind, _, _) = self.credential()?;
        Ok(match kind {
            CredentialKind::ApiKey => Credential::ApiKey(
                self.secret(Key::SandboxApiKey)
                    .cloned()
                    .ok_or(Error::MissingCredential)?,
            ),
            // Only the pair in use: an ID beside the key that is used (its pair unused)
            // must not stop a start or a key's reload.
            CredentialKind::AccessKey => Credential::AccessKey {
                id: {
                    let id = self.plain(Key::AccessKeyId).unwrap_or_default();
                    values::check_access_key_id(id)?;
                    id.to_string()
                },
                secret: self
                    .secret(Key::AccessKeySecret)
                    .cloned()
                    .ok_or(Error::MissingCredential)?,
            },
        })
    }

    /// Flags only the built-in provider reads, given with plugin provider `id` selected:
    /// they were ignored without a word, and `--sandbox-base-url` did not move the plugin's
    /// key, which went to its manifest's URL. Not an error: a wrapper may pass the same
    /// flags whatever the provider. The same keys from a variable or a file, which other
    /// tools and providers may share, are left unread and unsaid, as before.
    fn builtin_flags_unread(&self, id: &str) -> impl Iterator<Item = String> + '_ {
        let id = id.to_string();
        KEYS.iter()
            .map(|spec| spec.key)
            .filter(|k| k.builtin_only() && self.entry(*k).source == Source::Flag)
            .map(move |k| {
                format!(
                    "{} is for the built-in provider, and provider {id} is selected: it is not \
                     read (`abx-proxy provider info {id}` lists what is; a field is given as \
                     --provider-option FIELD=VALUE)",
                    k.flag()
                )
            })
    }

    /// Warnings from reading the layers plus those of the credential rule.
    pub fn all_warnings(&self) -> Vec<String> {
        let mut w = self.warnings.clone();
        match self.plugin() {
            Ok(Some(p)) => {
                w.extend(self.redirect_warnings());
                w.extend(plugin_key_warning(&p));
                w.extend(p.warnings);
                w.extend(self.builtin_flags_unread(&p.installed.manifest.id));
            }
            Ok(None) => match self.credential() {
                Ok((kind, _, extra)) => {
                    if kind == CredentialKind::ApiKey {
                        w.extend(self.builtin_key_warning());
                    }
                    w.extend(extra);
                    w.extend(self.redirect_warnings());
                }
                Err(_) => w.extend(self.vendor_pair_hint()),
            },
            // The error itself is reported by whoever validates.
            Err(_) => {}
        }
        w.extend(self.misspelt_names());
        w
    }

    /// [`implausible_key`] of the built-in provider's key.
    fn builtin_key_warning(&self) -> Option<String> {
        let entry = self.entry(Key::SandboxApiKey);
        let from = match entry.source {
            // The one flag that gives it: naming it says which file, not showing its path.
            Source::Flag => "--sandbox-api-key-file",
            other => other.label(),
        };
        implausible_key(self.secret(Key::SandboxApiKey)?, from, "Authorization")
    }

    /// Those of [`Resolved::all_warnings`] that speak of these settings as the ones
    /// running: a host set in the working directory's `.env` gets the credential from
    /// elsewhere; a plugin provider is selected, so built-in flags go unread; a stray half
    /// pair leaves the API key in use. True of a start and an applied reload, untrue of a
    /// reload that fails or is refused (what runs stays).
    pub fn selection_warnings(&self) -> Vec<String> {
        let mut w = self.redirect_warnings();
        match self.plugin() {
            Ok(Some(p)) => {
                w.extend(plugin_key_warning(&p));
                w.extend(self.builtin_flags_unread(&p.installed.manifest.id));
            }
            Ok(None) => {
                w.extend(self.builtin_key_warning());
                w.extend(self.credential().ok().and_then(|(_, _, extra)| extra));
            }
            Err(_) => {}
        }
        w
    }

    /// A host set in the working directory's `.env` that gets the credential from
    /// elsewhere (see [`redirected`]).
    fn redirect_warnings(&self) -> Vec<String> {
        let secrets = self.secrets();
        let mut w = Vec::new();
        match self.plugin() {
            Ok(Some(p)) => {
                let key_from = p.fields.iter().find(|f| f.field == "api_key");
                let hosts = p
                    .fields
                    .iter()
                    .filter(|f| f.field == "base_url" || f.field == "envd_domain");
                for field in hosts {
                    if let (Some(Value::Plain(v)), Some(k)) = (&field.value, key_from) {
                        w.extend(redirected(
                            &field.env,
                            v,
                            field.source,
                            k.source,
                            &secrets,
                            "there",
                        ));
                    }
                }
                // A key inherited from the built-in provider's settings follows a `./.env`
                // that selects the plugin: to the plugin's hosts (consented to at its
                // install, but not in this directory).
                let m = &p.installed.manifest;
                let own = |env: &str| {
                    env == m.canonical_env("api_key")
                        || m.fields
                            .get("api_key")
                            .is_some_and(|f| f.aliases.iter().any(|a| a == env))
                };
                let provider = self.entry(Key::Provider);
                if let (Some(Value::Plain(id)), Some(k)) = (&provider.value, key_from) {
                    if !own(&k.env) {
                        // "There" would be a provider's id: the hosts it names.
                        let to = format!("to {}'s hosts", m.id);
                        let (env, source) = (provider.spec.env, provider.source);
                        w.extend(redirected(env, id, source, k.source, &secrets, &to));
                    }
                }
            }
            Ok(None) => {
                if let Ok((kind, key_from, _)) = self.credential() {
                    // An API key never goes to the exchange endpoint.
                    let exchanged = kind == CredentialKind::AccessKey;
                    let keys = UPSTREAM_KEYS.into_iter();
                    for key in keys.filter(|k| exchanged || *k != Key::TokenExchangeUrl) {
                        let e = self.entry(key);
                        if let Some(Value::Plain(v)) = &e.value {
                            w.extend(redirected(
                                e.spec.env, v, e.source, key_from, &secrets, "there",
                            ));
                        }
                    }
                }
            }
            Err(_) => {}
        }
        w
    }

    /// `ABX_*` variables nothing reads that are another spelling of one that is read
    /// (`ABX_REGION`, `ABX_SANDBOX_APIKEY`, `ABX_LISTEN`): each was ignored in silence, and
    /// the error that followed ("API key cannot be empty") did not say why; so was an
    /// `ABX_HOME` in a `.env`. Names only; other unknown `ABX_*` names (a script's own)
    /// are left alone.
    fn misspelt_names(&self) -> Vec<String> {
        let squash = |s: &str| -> String {
            (s.chars())
                .filter(|c| *c != '_')
                .map(|c| c.to_ascii_lowercase())
                .collect()
        };
        let plugin_env: Vec<String> = match self.plugin() {
            Ok(Some(p)) => p.installed.manifest.env_names().collect(),
            _ => Vec::new(),
        };
        let read: Vec<&str> = (KEYS.iter().map(|k| k.env))
            .chain(plugin_env.iter().map(String::as_str))
            .collect();
        // `ABX_API_KEY`, the likeliest guess at the key's name, squashes to no setting's:
        // it means the selected provider's key.
        let key_env = (plugin_env.iter())
            .find(|e| e.starts_with("ABX_") && e.ends_with("_API_KEY"))
            .map_or("ABX_SANDBOX_API_KEY", String::as_str);
        // Each read name, and each built-in setting's key, by its squashed spelling.
        let spellings: Vec<(String, &str)> = (KEYS.iter())
            .map(|k| (squash(k.name), k.env))
            .chain(read.iter().map(|env| {
                let rest = env.strip_prefix("ABX_").unwrap_or(env);
                (squash(rest), *env)
            }))
            .chain([("apikey".to_string(), key_env)])
            .collect();
        let layers = [
            (&self.layers.env, Source::Env),
            (&self.layers.dotenv_cwd, Source::DotEnvCwd),
            (&self.layers.dotenv_home, Source::DotEnvHome),
        ];
        let mut said: Vec<String> = layers
            .iter()
            .flat_map(|(map, source)| {
                let (read, spellings) = (&read, &spellings);
                let env_home = self.layers.env.get("ABX_HOME");
                map.iter().filter_map(move |(name, value)| {
                    let rest = name.strip_prefix("ABX_")?;
                    // Blank, or what the environment says anyway: it changes nothing.
                    let moves = !value.trim().is_empty() && Some(value) != env_home;
                    if name == "ABX_HOME" && *source != Source::Env && moves {
                        // It says where `~/.abx/.env` is, so only the environment sets it.
                        return Some(format!(
                            "ABX_HOME ({}) is read from the environment only (it says where \
                             ~/.abx is): export it, or pass it to the service",
                            self.file_shown(*source)
                        ));
                    }
                    if read.contains(&name.as_str()) || name == "ABX_HOME" {
                        return None;
                    }
                    // `ABX_IDLE_TIMEOUT`, `ABX_PROXY_LOG_LEVEL`: set for a service (an
                    // `EnvironmentFile`, a pod's `env:`), changing nothing.
                    let bare = squash(rest.strip_prefix("PROXY_").unwrap_or(rest));
                    if let Some(flag) = FLAG_ONLY.iter().find(|f| f.replace('-', "") == bare) {
                        let instead = if *flag == "log-level" {
                            " (RUST_LOG stands in for it)"
                        } else {
                            ""
                        };
                        return Some(format!(
                            "{name} ({}) is not a variable abx-proxy reads: --{flag} is a \
                             command-line flag only{instead}",
                            self.file_shown(*source)
                        ));
                    }
                    let (_, meant) = spellings.iter().find(|(s, _)| *s == squash(rest))?;
                    Some(format!(
                        "{name} ({}) is not a variable abx-proxy reads: did you mean {meant}?",
                        self.file_shown(*source)
                    ))
                })
            })
            .collect();
        said.sort();
        said
    }
}

impl Resolved {
    /// Alibaba's own CLI and SDKs name the pair `ALIBABA_CLOUD_ACCESS_KEY_*`; abx-proxy reads
    /// the `ALICLOUD_*` names of SPEC §2 only (an alias would take a pair meant for other
    /// tools without the user choosing it). When no credential resolves and those names are
    /// set, say so beside the error, naming the variables and layers, never their values.
    fn vendor_pair_hint(&self) -> Option<String> {
        let layers = [
            (&self.layers.env, Source::Env),
            (&self.layers.dotenv_cwd, Source::DotEnvCwd),
            (&self.layers.dotenv_home, Source::DotEnvHome),
        ];
        // By layer: a file's path is said once for both names.
        let found: Vec<(usize, String)> = (layers.iter())
            .filter_map(|(map, src)| {
                let names: Vec<&str> = (VENDOR_PAIR.iter().copied())
                    .filter(|name| map.get(*name).and_then(|v| nonblank(v)).is_some())
                    .collect();
                (!names.is_empty()).then(|| {
                    let group = format!("{} ({})", names.join(", "), self.file_shown(*src));
                    (names.len(), group)
                })
            })
            .collect();
        (!found.is_empty()).then(|| {
            // Layers apart by `;`, as the names within one are by `,`.
            let names: usize = found.iter().map(|(n, _)| n).sum();
            let groups: Vec<&str> = found.iter().map(|(_, g)| g.as_str()).collect();
            format!(
                "{} {} set, but abx-proxy reads the AccessKey pair from ALICLOUD_ACCESS_KEY_ID and ALICLOUD_ACCESS_KEY_SECRET: set those (e.g. ALICLOUD_ACCESS_KEY_ID=$ALIBABA_CLOUD_ACCESS_KEY_ID)",
                groups.join("; "),
                if names == 1 { "is" } else { "are" }
            )
        })
    }
}

/// The names Alibaba's own tools give the AccessKey pair.
const VENDOR_PAIR: [&str; 2] = [
    "ALIBABA_CLOUD_ACCESS_KEY_ID",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET",
];

/// The settings that say where the credential goes.
const UPSTREAM_KEYS: [Key; 4] = [
    Key::SandboxBaseUrl,
    Key::SandboxDomain,
    Key::SandboxUrl,
    Key::TokenExchangeUrl,
];

/// `./.env` is read from wherever the proxy starts: a file in a checkout that names an
/// upstream would send a key kept elsewhere (the environment, ~/.abx/.env) to its host.
/// Said rather than refused: in the user's own projects the layer is theirs. The warning
/// comes before validation refuses a password or a query string, and `serve` logs it.
/// The credential goes `to` ("there": the host the value names).
fn redirected(
    env: &str,
    value: &str,
    source: Source,
    key_from: Source,
    secrets: &[Secret],
    to: &str,
) -> Option<String> {
    // With no key at all nothing goes there (and that is an error of its own).
    let elsewhere = key_from != Source::DotEnvCwd && key_from != Source::Unset;
    (source == Source::DotEnvCwd && elsewhere).then(|| {
        format!(
            "./.env in this directory sets {env}={}: the credential from {} goes {to}",
            shown(value, secrets),
            key_from.label()
        )
    })
}

/// The longest `token_ttl` accepted: a year.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// The shortest `token_ttl`: four times the 5 s a key is held back before its expiry.
pub const MIN_TOKEN_TTL: Duration = Duration::from_secs(20);
/// The shortest `token_refresh_before`: twice that margin.
pub const MIN_REFRESH_BEFORE: Duration = Duration::from_secs(10);

/// [`implausible_key`] of a plugin provider's key, as its manifest sends it.
fn plugin_key_warning(p: &PluginSettings) -> Option<String> {
    let field = p.fields.iter().find(|f| f.field == "api_key")?;
    let from = match field.source {
        // An inherited built-in key, from its file.
        Source::Flag => "--sandbox-api-key-file".to_string(),
        source => format!("{} in {}", field.env, source.label()),
    };
    let header = match &p.installed.manifest.auth {
        AuthKind::Bearer => "Authorization",
        AuthKind::Header(name) => name.as_str(),
    };
    implausible_key(&p.api_key()?, &from, header)
}

/// A plugin provider's key, or why there is none.
fn plugin_credential(p: &PluginSettings) -> Result<Credential, Error> {
    let m = &p.installed.manifest;
    let inherit = "sandbox_api_key";
    // Only `provider info` said why an inheriting plugin had no key.
    let unconsented = (m.inherit.iter().any(|i| i == inherit)
        && !p.installed.consented.iter().any(|c| c == inherit))
    .then(|| {
        format!(
            " (its manifest asks to inherit {inherit}, which was not consented \
             to for this manifest, or the manifest changed since: `abx-proxy \
             provider install FILE --consent` grants it)"
        )
    });
    let key = p.api_key().ok_or_else(|| Error::Provider {
        id: m.id.clone(),
        reason: format!(
            "api_key is not set: set {}{}{}",
            m.canonical_env("api_key"),
            m.fields
                .get("api_key")
                .map(|f| f
                    .aliases
                    .iter()
                    .map(|a| format!(" or {a}"))
                    .collect::<String>())
                .unwrap_or_default(),
            unconsented.unwrap_or_default()
        ),
    })?;
    Ok(Credential::ApiKey(key))
}

/// The credential to attach, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    ApiKey(Secret),
    AccessKey { id: String, secret: Secret },
}

/// `host` (an upstream's, as written) reaches the listener bound at `bound`: a local name,
/// the listener's own address, or the unspecified one (connecting to it reaches this host).
fn names_this_host(host: &str, bound: std::net::SocketAddr) -> bool {
    // An IPv6 host comes bracketed (`[::]`), which no address parser takes.
    let literal = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    crate::proxy::route::is_local_name(host)
        || literal
            .parse::<std::net::IpAddr>()
            .map(|ip| ip.to_canonical())
            .is_ok_and(|ip| ip == bound.ip().to_canonical() || ip.is_unspecified())
}

/// Validated, typed settings: what the proxy runs on.
#[derive(Debug, Clone)]
pub struct Settings {
    pub region: String,
    pub provider: String,
    pub sandbox_base_url: UpstreamUrl,
    /// envd at `https://{port}-{id}.{domain}`; `None` for a provider without envd.
    pub sandbox_domain: Option<String>,
    pub sandbox_url: Option<UpstreamUrl>,
    pub token_exchange_url: UpstreamUrl,
    pub token_exchange: ExchangeScheme,
    pub token_ttl: Duration,
    pub token_refresh_before: Duration,
    pub compat_v2_paths: CompatMode,
    pub listen: ListenAddr,
    pub admin_listen: ListenAddr,
    pub credential: Credential,
    /// Every resolved secret (see [`Resolved::secrets`]), only to hide them in the values
    /// printed; never sent.
    pub secrets: Vec<Secret>,
    /// How the provider wants its key attached.
    pub auth: AuthKind,
    /// The selected plugin provider; `None` for the built-in one.
    pub plugin: Option<PluginSettings>,
}

impl Settings {
    /// A setting's value as printed: [`shown()`] with every resolved secret.
    pub fn shown(&self, value: &impl std::fmt::Display) -> String {
        shown(&value.to_string(), &self.secrets)
    }

    /// A secret a `${VAR}` (or a paste) put into the host name of an upstream in use:
    /// masked wherever it is printed, but a host is looked up in DNS, in clear, by whatever
    /// resolver the machine uses, before any TLS. Its path and query go to the host alone,
    /// over TLS. A host never looked up (the exchange endpoint with an API key, a domain
    /// `sandbox_url` stands in for) is left, as a plugin's leftover built-in values are.
    pub fn refuse_secret_in_host(&self) -> Result<(), Error> {
        let plugin_key = |field: &str| {
            (self.plugin.as_ref()).map(|p| format!("{}.{field}", p.installed.manifest.id))
        };
        let domain = (self.sandbox_domain.as_ref())
            .filter(|_| self.sandbox_url.is_none())
            .and_then(|d| {
                let host = d.parse::<http::uri::Authority>().ok()?;
                Some((
                    plugin_key("envd_domain"),
                    Key::SandboxDomain,
                    host.host().to_string(),
                ))
            });
        let exchanged = matches!(self.credential, Credential::AccessKey { .. });
        let urls = [
            (
                plugin_key("base_url"),
                Key::SandboxBaseUrl,
                Some(&self.sandbox_base_url),
            ),
            (None, Key::SandboxUrl, self.sandbox_url.as_ref()),
            (
                None,
                Key::TokenExchangeUrl,
                Some(&self.token_exchange_url).filter(|_| exchanged),
            ),
        ];
        let hosts = (urls.into_iter())
            .filter_map(|(p, k, url)| Some((p, k, url?.host().to_string())))
            .chain(domain);
        for (plugin_key, key, host) in hosts {
            let host = host.to_ascii_lowercase();
            let held = (self.secrets.iter())
                .map(|s| s.expose().to_ascii_lowercase())
                .filter(|s| s.chars().count() >= shown::MIN_EMBEDDED)
                .any(|s| host.contains(&s));
            if held {
                return Err(Error::InvalidSetting {
                    key: plugin_key.unwrap_or_else(|| key.name().to_string()),
                    reason: "its host name holds a secret (a key or token a ${VAR} or a paste \
                             put there): a host name is looked up in DNS in clear, before any \
                             TLS; give the upstream's own host"
                        .into(),
                });
            }
        }
        Ok(())
    }

    /// An upstream that is this proxy's own listener (`bound`) would make every request
    /// call itself until something runs out. It happens easily: the OpenSandbox SDK and the
    /// proxy both read `OPEN_SANDBOX_DOMAIN`, and a shell set up for the SDK points it at
    /// the proxy.
    pub fn refuse_self_loop(&self, bound: std::net::SocketAddr) -> Result<(), Error> {
        let base = match &self.plugin {
            Some(p) => format!("{}.base_url", p.installed.manifest.id),
            None => Key::SandboxBaseUrl.name().to_string(),
        };
        let upstreams = [
            (base, Some(&self.sandbox_base_url)),
            (
                Key::SandboxUrl.name().to_string(),
                self.sandbox_url.as_ref(),
            ),
        ];
        for (key, url) in upstreams {
            let Some(url) = url else { continue };
            let default_port = if url.is_https() { 443 } else { 80 };
            let port = url.authority.port_u16().unwrap_or(default_port);
            if port == bound.port() && names_this_host(url.host(), bound) {
                return Err(Error::InvalidSetting {
                    key,
                    reason: format!(
                        "{} is this proxy's own listener ({bound}): the upstream must be the \
                         sandbox cloud (a variable set for the SDK, such as \
                         OPEN_SANDBOX_DOMAIN, may have been read as the upstream)",
                        self.shown(url)
                    ),
                });
            }
        }
        // envd's hosts are `{port}-{id}.{domain}`, over HTTPS: below `localhost` they are
        // this machine, and with the TLS listener's port every envd request called the
        // proxy again, a connection each, until the connection limit was reached. Not when
        // `sandbox_url` stands in for the domain (a leftover value is no error).
        let Some(domain) = self
            .sandbox_domain
            .as_ref()
            .filter(|_| self.sandbox_url.is_none())
        else {
            return Ok(());
        };
        let Ok(authority) = domain.parse::<http::uri::Authority>() else {
            return Ok(());
        };
        let sandbox_host = format!("49983-sandbox.{}", authority.host());
        if authority.port_u16().unwrap_or(443) == bound.port()
            && crate::proxy::route::is_local_name(&sandbox_host)
        {
            let key = match &self.plugin {
                Some(p) => format!("{}.envd_domain", p.installed.manifest.id),
                None => Key::SandboxDomain.name().to_string(),
            };
            return Err(Error::InvalidSetting {
                key,
                reason: format!(
                    "{} names this proxy's own listener ({bound}) as every sandbox's envd: \
                     the domain must be the sandbox cloud's",
                    self.shown(domain)
                ),
            });
        }
        Ok(())
    }

    /// The proxy's listener and the admin listener on one address: the second bind would
    /// fail, and the error would blame another process.
    fn refuse_shared_listen(&self) -> Result<(), Error> {
        let shared = match (&self.listen, &self.admin_listen) {
            (ListenAddr::Tcp(a), ListenAddr::Tcp(b)) => {
                // As bound: `[::ffff:127.0.0.1]` is 127.0.0.1.
                let (ia, ib) = (a.ip().to_canonical(), b.ip().to_canonical());
                a.port() == b.port()
                    && a.port() != 0
                    && (ia == ib || ia.is_unspecified() || ib.is_unspecified())
            }
            (ListenAddr::Unix(a), ListenAddr::Unix(b)) => a == b,
            _ => false,
        };
        if shared {
            let differ = match self.admin_listen {
                ListenAddr::Tcp(_) => "ports",
                ListenAddr::Unix(_) => "socket paths",
            };
            return Err(Error::InvalidSetting {
                key: Key::AdminListen.name().to_string(),
                reason: format!(
                    "{} is also the proxy's listen address: give them different {differ}",
                    self.shown(&self.admin_listen)
                ),
            });
        }
        Ok(())
    }

    /// Upstreams reached over plain `http://` beyond this machine, where the credential
    /// (or, from the token exchange, a temporary key) crosses the network unencrypted. A
    /// warning, not a refusal: a self-hosted OpenSandbox inside a cluster's network is
    /// commonly plain HTTP, and tests use plain loopback upstreams.
    pub fn cleartext_upstreams(&self) -> Vec<String> {
        let exchange = matches!(self.credential, Credential::AccessKey { .. })
            .then_some(&self.token_exchange_url);
        // Once for an address two settings name (envd at the control plane's), whatever
        // the path or the host's case.
        let mut said: Vec<(String, Option<u16>)> = Vec::new();
        [Some(&self.sandbox_base_url), self.sandbox_url.as_ref(), exchange]
            .into_iter()
            .flatten()
            .filter(|u| !u.is_https() && !crate::proxy::route::is_local_name(u.host()))
            .filter(|u| {
                let at = (u.host().to_ascii_lowercase(), u.authority.port_u16());
                let new = !said.contains(&at);
                said.push(at);
                new
            })
            .map(|u| {
                format!(
                    "{} is plain http:// beyond this machine: the credential crosses the network unencrypted",
                    self.shown(u)
                )
            })
            .collect()
    }
}

/// What makes a key count as changed between two resolutions (see [`changed_keys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Its value: what a restart would apply.
    Value,
    /// Its value or where it came from: what a reload has read anew.
    ValueOrSource,
}

/// The keys that changed between two resolutions (for reload logs: names only, never
/// values).
pub fn changed_keys(before: &Resolved, after: &Resolved, change: Change) -> Vec<&'static str> {
    let with_source = change == Change::ValueOrSource;
    before
        .entries
        .iter()
        .zip(&after.entries)
        .filter(|(a, b)| a.value != b.value || (with_source && a.source != b.source))
        .map(|(a, _)| a.spec.name)
        .collect()
}

/// Keys a reload applies without a restart.
pub fn is_credential_key(name: &str) -> bool {
    matches!(
        name,
        "sandbox_api_key" | "access_key_id" | "access_key_secret"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key file holding a `.env` line is warned about, whatever key it is for; a key
    /// alone is not, nor a base32 key with its `=` padding, and the warning repeats
    /// nothing of the file.
    #[test]
    fn a_key_file_holding_a_dotenv_line_is_warned_about() {
        let flags = |key: Key, v: &str| HashMap::from([(key, FlagValue::Secret(Secret::new(v)))]);
        for line in [
            "ABX_SANDBOX_API_KEY=sk-0123456789abcdef",
            "export ALIBABA_CLOUD_ACCESS_KEY_SECRET=abc",
            "E2B_API_KEY=e2b_0123",
        ] {
            for (key, flag) in [
                (Key::SandboxApiKey, "--sandbox-api-key-file"),
                (Key::AccessKeySecret, "--access-key-secret-file"),
            ] {
                let said = assignments_in_key_files(&flags(key, line));
                assert_eq!(said.len(), 1, "{line}");
                assert!(said[0].starts_with(&format!("the file given to {flag} ")));
                let (name, value) = line.split_once('=').unwrap_or_default();
                assert!(!said[0].contains(name.trim_start_matches("export ")));
                assert!(!said[0].contains(value), "{}", said[0]);
            }
        }
        for key in [
            "sk-0123456789abcdef",
            "MFRGGZDFMZTWQ2LK====",
            "abc_DEF=ghi",
            "ABX_SANDBOX_API_KEY=",
        ] {
            let said = assignments_in_key_files(&flags(Key::SandboxApiKey, key));
            assert!(said.is_empty(), "{key}: {said:?}");
        }
        let plain = HashMap::from([(Key::Region, FlagValue::Plain("A_B=c".into()))]);
        assert!(assignments_in_key_files(&plain).is_empty());
    }

    #[test]
    fn a_key_with_a_scheme_or_of_no_key_length_is_warned_about() {
        let key = "sk-0123456789abcdef";
        let said = |written: &str| implausible_key(&Secret::new(written), "env", "Api-Key");
        for (written, begins) in [
            (
                "Bearer sk-0123456789abcdef",
                "begins with `Bearer`, an auth scheme",
            ),
            (
                "bearer\tsk-0123456789abcdef",
                "begins with `bearer`, an auth scheme",
            ),
            (
                "bearer:sk-0123456789abcdef",
                "begins with `bearer`, an auth scheme",
            ),
            (
                "Token sk-0123456789abcdef",
                "begins with `Token`, an auth scheme",
            ),
            (
                "Authorization: Bearer sk-0123456789abcdef",
                "begins with `Authorization:`",
            ),
            (
                "X-API-Key: sk-0123456789abcdef",
                "begins with `X-API-Key:`, a header's name",
            ),
            ("x-api-key:sk-0123456789abcdef", "begins with `x-api-key:`"),
            ("api-key:sk-0123456789abcdef", "begins with `api-key:`"),
            ("sk-0123 456789abcdef", "holds a space or a tab"),
            // An id before the colon is not said: it may be half the key.
            ("LTAI0123id: sk-0123456789abcdef", "holds a space or a tab"),
        ] {
            let said = said(written).unwrap_or_default();
            assert!(said.starts_with("the API key (from env) "), "{said}");
            assert!(said.contains(begins), "{written}: {said}");
            assert!(
                said.ends_with("sends it whole as `Api-Key: <key>`; set the key alone"),
                "{said}"
            );
            assert!(!said.contains("0123") && !said.contains('\t'), "{said}");
        }
        let bearer = implausible_key(&Secret::new("Bearer x"), "env", "authorization");
        assert!(bearer
            .unwrap_or_default()
            .contains("as `Authorization: Bearer <key>`"));
        let long = "k".repeat(LONGEST_PLAUSIBLE_KEY + 1);
        assert!(said(&long)
            .unwrap_or_default()
            .contains("is 4097 bytes long"));
        let longest = "k".repeat(LONGEST_PLAUSIBLE_KEY);
        for fine in [
            key,
            "Bearer",
            "Bearerish-key",
            "bearer_x",
            "keyid:secret",
            &longest,
        ] {
            assert_eq!(said(fine), None, "{fine}");
        }
    }

    /// The raw layers hold every variable as read, secrets included; their `Debug` (a
    /// library user's `{:?}`, an `unwrap` on a containing `Result`) shows names only.
    #[test]
    fn debug_output_never_shows_a_raw_value() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("abx");
        std::fs::create_dir(&home).unwrap();
        std::fs::write(
            home.join(".env"),
            "ALICLOUD_ACCESS_KEY_SECRET=sk-dotenv-secret-4242\n",
        )
        .unwrap();
        let env: HashMap<String, String> = [
            ("ABX_SANDBOX_API_KEY", "sk-env-secret-1234"),
            ("GITHUB_TOKEN", "ghp-env-secret-5678"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let inputs = Inputs {
            flags: HashMap::new(),
            provider_options: vec![("api_key".into(), "sk-option-secret-9999".into())],
            env,
            env_not_unicode: BTreeSet::new(),
            cwd: dir.path().to_path_buf(),
            abx_home: Some(home),
        };
        let resolved = Resolved::from_inputs(&inputs).unwrap();
        let shown = format!("{inputs:?} {resolved:?} {:#?}", resolved.layers);
        for secret in ["sk-env", "ghp-env", "sk-dotenv", "sk-option"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        // Each still names what it holds: a masked-out `Debug` would help no one.
        let inputs_shown = format!("{inputs:?}");
        for name in ["ABX_SANDBOX_API_KEY", "GITHUB_TOKEN", "api_key"] {
            assert!(
                inputs_shown.contains(name),
                "{name} missing from {inputs_shown}"
            );
        }
        let layers_shown = format!("{:?}", resolved.layers);
        for name in [
            "ABX_SANDBOX_API_KEY",
            "GITHUB_TOKEN",
            "ALICLOUD_ACCESS_KEY_SECRET",
            "api_key",
        ] {
            assert!(
                layers_shown.contains(name),
                "{name} missing from {layers_shown}"
            );
        }
    }

    /// Only a secret that a plain value carries is masked in every log line; one that is
    /// too short to look for, or that no value carries, is not.
    #[test]
    fn embedded_secrets_are_those_a_plain_value_carries() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("abx");
        std::fs::create_dir(&home).unwrap();
        std::fs::write(
            home.join(".env"),
            "ABX_SANDBOX_API_KEY=sk-inhost-4242\n\
             GITHUB_TOKEN=ghp-nowhere-5678\n\
             ABX_SANDBOX_URL=https://${ABX_SANDBOX_API_KEY}.example/\n",
        )
        .unwrap();
        let inputs = Inputs {
            flags: HashMap::new(),
            provider_options: Vec::new(),
            env: HashMap::new(),
            env_not_unicode: BTreeSet::new(),
            cwd: dir.path().to_path_buf(),
            abx_home: Some(home),
        };
        let resolved = Resolved::from_inputs(&inputs).unwrap();
        let embedded: Vec<String> = resolved
            .embedded_secrets()
            .iter()
            .map(|s| s.expose().to_string())
            .collect();
        assert_eq!(embedded, ["sk-inhost-4242"]);
    }

    /// The library's way in: a secret key set through the builder is held as a secret, a
    /// plain one as plain, and both rank as command-line flags.
    #[test]
    fn builder_values_resolve_at_flag_level() {
        let dir = tempfile::tempdir().unwrap();
        let b = Builder::new()
            .set(Key::Region, "cn-shanghai")
            .set(Key::GithubToken, "ghp-builder-1234")
            .sandbox_api_key(Secret::new("sk-builder-5678"));
        assert!(matches!(b.flags[&Key::Region], FlagValue::Plain(_)));
        assert!(matches!(b.flags[&Key::GithubToken], FlagValue::Secret(_)));
        let env = [("ALIBABA_CLOUD_REGION_ID", "cn-beijing")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let inputs = Inputs {
            flags: b.flags,
            provider_options: Vec::new(),
            env,
            env_not_unicode: BTreeSet::new(),
            cwd: dir.path().to_path_buf(),
            abx_home: None,
        };
        let resolved = Resolved::from_inputs(&inputs).unwrap();
        assert_eq!(resolved.plain(Key::Region), Some("cn-shanghai"));
        assert_eq!(resolved.entry(Key::Region).source, Source::Flag);
        let key = resolved.secret(Key::SandboxApiKey).map(Secret::expose);
        assert_eq!(key, Some("sk-builder-5678"));
        assert_eq!(resolved.entry(Key::SandboxApiKey).source, Source::Flag);
    }
}
