//! Plugin provider manifests (`abx-provider.toml`): the subset SPEC §3 reads, checked
//! strictly: a key no table knows, a value of the wrong type and a value `serve` would
//! refuse are all errors at install. Every problem is an E8001 naming the file and the line.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::Error;
use crate::settings::shown::shown;
use crate::settings::{values, UpstreamUrl};

/// The only manifest format this build reads.
pub const MANIFEST_VERSION: i64 = 1;
pub const MANIFEST_FILE: &str = "abx-provider.toml";

/// Built-in keys a plugin may ask to inherit (with consent).
pub const INHERITABLE: &[&str] = &["sandbox_api_key"];

/// Env name prefixes that belong to abx-proxy, the E2B SDKs or Alibaba Cloud (the proxy's
/// own names, and those Alibaba's CLI and credentials chain read, `ALIBABACLOUD_` and
/// `ALIYUN_` among them): a plugin alias there could read another provider's credential.
const RESERVED_PREFIXES: &[&str] = &[
    "ABX_",
    "E2B_",
    "ALICLOUD_",
    "ALIBABA_CLOUD_",
    "ALIBABACLOUD_",
    "ALIYUN_",
];

/// Alibaba Cloud credential names without those prefixes, which its CLI (after the
/// prefixed ones) and its OSS tools read.
const RESERVED_NAMES: &[&str] = &[
    "ACCESS_KEY_ID",
    "ACCESS_KEY_SECRET",
    "SECURITY_TOKEN",
    "OSS_ACCESS_KEY_ID",
    "OSS_ACCESS_KEY_SECRET",
    "OSS_SESSION_TOKEN",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthKind {
    Bearer,
    Header(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    pub secret: bool,
    /// Vendor aliases, after the canonical `ABX_<ID>_<FIELD>`.
    pub aliases: Vec<String>,
    pub default: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub id: String,
    pub description: Option<String>,
    pub base_url: String,
    pub auth: AuthKind,
    /// E2B-style providers: envd at `https://{port}-{id}.{envd_domain}`.
    pub envd_domain: Option<String>,
    pub fields: BTreeMap<String, Field>,
    pub inherit: Vec<String>,
}

impl Manifest {
    /// The canonical env name of a field: `ABX_<PROVIDER_ID>_<FIELD>`.
    pub fn canonical_env(&self, field: &str) -> String {
        canonical_env(&self.id, field)
    }

    /// Every variable this provider's fields are read from: canonical names and aliases.
    pub fn env_names(&self) -> impl Iterator<Item = String> + '_ {
        self.fields.values().flat_map(|f| self.variables_of(f))
    }

    /// The variables the secret fields (`secret`), or the plain ones, are read from.
    pub fn env_names_of(&self, secret: bool) -> impl Iterator<Item = String> + '_ {
        self.fields
            .values()
            .filter(move |f| f.secret == secret)
            .flat_map(|f| self.variables_of(f))
    }

    fn variables_of<'a>(&'a self, f: &'a Field) -> impl Iterator<Item = String> + 'a {
        std::iter::once(self.canonical_env(&f.name)).chain(f.aliases.iter().cloned())
    }

    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Manifest {
            path: path.display().to_string(),
            line: 0,
            reason: e.kind().to_string(),
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, path: &str) -> Result<Self, Error> {
        let at = &At { text, path };
        let table = read_table(at)?;
        check_version(&table, at)?;
        let (id, description) = provider(&table, at)?;
        let (base_url, envd_domain, auth) = endpoint(&table, &id, at)?;
        let fields = fields(&table, &id, at)?;
        let inherit = inherit(&table, at)?;
        Ok(Manifest {
            id,
            description,
            base_url,
            auth,
            envd_domain,
            fields,
            inherit,
        })
    }
}

/// Where an E8001 points: the manifest's path, and the line in its text.
struct At<'a> {
    text: &'a str,
    path: &'a str,
}

impl At<'_> {
    fn at_line(&self, line: usize, reason: String) -> Error {
        Error::Manifest {
            path: self.path.to_string(),
            line,
            reason,
        }
    }

    /// At the first line mentioning `needle`.
    fn mention(&self, needle: &str, reason: String) -> Error {
        self.at_line(line_of(self.text, needle), reason)
    }

    /// At the line that sets `key`, not the first that mentions it.
    fn key(&self, key: &str, reason: String) -> Error {
        self.at_line(key_line(self.text, key), reason)
    }
}

/// The manifest as TOML, with no control character in a key or a string.
fn read_table(at: &At) -> Result<toml::Table, Error> {
    let table: toml::Table = at.text.parse().map_err(|e: toml::de::Error| {
        // Counting `lines()` before the offset put an error at the start of a line on the
        // line above.
        let line = e
            .span()
            .map_or(0, |s| crate::settings::layers::line_of(at.text, s.start));
        at.at_line(line, "invalid TOML".into())
    })?;
    // `provider install` prints the manifest for the user to consent on: an escape
    // sequence in a string (`\u001b[8m` conceals the rest of the screen) would hide the
    // inherit list being consented to, a newline would forge lines of its own.
    if let Some(key) = control_character(&table) {
        // A key spelled with escapes is not in the text as is: its table's line.
        let line = key
            .iter()
            .rev()
            .map(|k| key_line(at.text, k))
            .find(|l| *l != 0)
            .unwrap_or(0);
        return Err(at.at_line(
            line,
            format!("{}: control characters are not accepted", key.join(".")),
        ));
    }
    Ok(table)
}

/// `manifest_version`, and no top-level table or key this build does not read.
fn check_version(table: &toml::Table, at: &At) -> Result<(), Error> {
    match table.get("manifest_version") {
        Some(toml::Value::Integer(MANIFEST_VERSION)) => {}
        Some(v) => {
            return Err(at.mention(
                "manifest_version",
                format!("unsupported manifest_version {v} (this build reads {MANIFEST_VERSION})"),
            ))
        }
        None => return Err(at.mention("", "missing manifest_version".into())),
    }
    for key in table.keys() {
        if !["manifest_version", "provider", "endpoint", "config", "core"].contains(&key.as_str()) {
            return Err(at.mention(key, format!("unknown table or key {key:?}")));
        }
    }
    Ok(())
}

/// `[provider]`: the id and the description.
fn provider(table: &toml::Table, at: &At) -> Result<(String, Option<String>), Error> {
    // A key misspelt, or of the wrong type, is refused rather than read as absent:
    // `envd_domainn` would leave the provider without an envd plane, unnoticed.
    let provider = table_at(table, "provider", "provider", at)?
        .ok_or_else(|| at.mention("", "missing [provider]".into()))?;
    known_keys(provider, "provider", &["id", "description"], at)?;
    let id = string(provider, "id", "provider.id", at)?
        .ok_or_else(|| at.mention("[provider]", "missing provider.id".into()))?;
    if !valid_id(&id) {
        return Err(at.key(
            "id",
            format!("provider id {id:?}: lower-case letters, digits and dashes only"),
        ));
    }
    if id == crate::providers::BUILTIN {
        return Err(at.key("id", "provider id alicloud-express is built in".into()));
    }
    let description = string(provider, "description", "provider.description", at)?;
    Ok((id, description))
}

/// `[endpoint]`: the base URL, the envd domain and how the key is sent.
fn endpoint(
    table: &toml::Table,
    id: &str,
    at: &At,
) -> Result<(String, Option<String>, AuthKind), Error> {
    let endpoint = table_at(table, "endpoint", "endpoint", at)?
        .ok_or_else(|| at.mention("", "missing [endpoint]".into()))?;
    known_keys(
        endpoint,
        "endpoint",
        &["base_url", "envd_domain", "auth"],
        at,
    )?;
    let base_url = string(endpoint, "base_url", "endpoint.base_url", at)?
        .ok_or_else(|| at.mention("[endpoint]", "missing endpoint.base_url".into()))?;
    // The check `serve` makes, here: a bad value installed fine and failed only there.
    if let Err(e) = upstream_url(id, &base_url) {
        let reason = match e {
            Error::InvalidSetting { reason, .. } => reason,
            other => other.to_string(),
        };
        // The value as `config list` shows it: a refused URL may carry a password.
        let shown = shown(&base_url, &[]);
        return Err(at.key("base_url", format!("endpoint.base_url {shown:?}: {reason}")));
    }
    let envd_domain = string(endpoint, "envd_domain", "endpoint.envd_domain", at)?;
    // A plugin's envd hosts are always made of its domain: no address.
    if let Some(d) = envd_domain.as_deref() {
        let refused = if !values::is_domain(d) {
            Some(values::DOMAIN_EXPECTED)
        } else if values::is_address(d) {
            Some(values::ADDRESS_NO_DOMAIN)
        } else {
            None
        };
        if let Some(reason) = refused {
            let shown = shown(d, &[]);
            return Err(at.key(
                "envd_domain",
                format!("endpoint.envd_domain {shown:?}: {reason}"),
            ));
        }
    }
    Ok((base_url, envd_domain, auth(endpoint, at)?))
}

/// `[endpoint.auth]`: how the key is sent.
fn auth(endpoint: &toml::Table, at: &At) -> Result<AuthKind, Error> {
    let auth = table_at(endpoint, "auth", "endpoint.auth", at)?
        .ok_or_else(|| at.mention("[endpoint]", "missing endpoint.auth".into()))?;
    known_keys(auth, "endpoint.auth", &["scheme", "header"], at)?;
    let header = string(auth, "header", "auth.header", at)?;
    let auth = match string(auth, "scheme", "auth.scheme", at)?.as_deref() {
        Some("bearer") => {
            if header.is_some() {
                return Err(at.key(
                    "header",
                    "auth.header is for auth.scheme = \"header\"; \"bearer\" sends Authorization"
                        .into(),
                ));
            }
            AuthKind::Bearer
        }
        Some("header") => {
            let header = header.ok_or_else(|| {
                at.mention(
                    "scheme",
                    "auth.scheme = \"header\" needs auth.header".into(),
                )
            })?;
            let Ok(name) = http::HeaderName::from_bytes(header.as_bytes()) else {
                return Err(at.mention(
                    "auth.header",
                    format!("auth.header {header:?} is not a valid header name"),
                ));
            };
            if !auth_header_allowed(&name) {
                return Err(at.mention(
                    "auth.header",
                    format!(
                        "auth.header {header:?}: the key cannot be sent as a header that frames, routes or qualifies the request (host, content-length, transfer-encoding, connection, proxy-*, accept-encoding, range, if-*, forwarded, …) or that the proxy sets for envd"
                    ),
                ));
            }
            AuthKind::Header(header)
        }
        Some(other) => {
            return Err(at.mention(
                "scheme",
                format!("auth.scheme {other:?}: expected \"bearer\" or \"header\""),
            ))
        }
        None => return Err(at.mention("auth", "missing auth.scheme".into())),
    };
    Ok(auth)
}

/// `[config.fields]`, each field checked alone, then against the others and the built-in
/// settings.
fn fields(table: &toml::Table, id: &str, at: &At) -> Result<BTreeMap<String, Field>, Error> {
    let mut fields = BTreeMap::new();
    if let Some(config) = table_at(table, "config", "config", at)? {
        known_keys(config, "config", &["fields"], at)?;
        let empty = toml::Table::new();
        let defs = table_at(config, "fields", "config.fields", at)?.unwrap_or(&empty);
        for (name, def) in defs {
            fields.insert(name.clone(), field(name, def, at)?);
        }
    }
    // `ABX_<ID>_<FIELD>` can spell a built-in variable (`sandbox` + `api_key` is
    // `ABX_SANDBOX_API_KEY`): that field would be handed the built-in key, with no
    // consent asked, and send it to the plugin's hosts.
    for name in fields.keys() {
        let env = canonical_env(id, name);
        if let Some(spec) = built_in_env(&env) {
            return Err(at.mention(
                name,
                format!(
                    "field {name}: its variable {env} is the built-in setting {}'s; choose another provider id or field name",
                    spec.name
                ),
            ));
        }
    }
    // One variable, one field: read by a secret field and a plain one, the key would be
    // the plain one's value too, shown in clear by `config`, and as `base_url` or
    // `envd_domain` looked up in DNS and sent plain `http` to a host of its own.
    let mut readers: BTreeMap<&str, &str> = BTreeMap::new();
    for field in fields.values() {
        for alias in &field.aliases {
            match readers.insert(alias, &field.name) {
                Some(other) if other != field.name => {
                    return Err(at.mention(
                        alias,
                        format!(
                            "env alias {alias:?} is read by fields {other} and {}: a variable may name one field only",
                            field.name
                        ),
                    ))
                }
                _ => {}
            }
        }
    }
    if fields.get("base_url").is_some_and(|f| f.secret) {
        return Err(at.mention("base_url", "field base_url cannot be secret".into()));
    }
    // A secret is shown masked, and the masked value then failed the domain check.
    if fields.get("envd_domain").is_some_and(|f| f.secret) {
        return Err(at.mention(
            "fields.envd_domain",
            "field envd_domain cannot be secret".into(),
        ));
    }
    // The key the proxy attaches: as a plain field it would be printed by `config`,
    // read from config.toml and taken from the command line, where `ps` shows it.
    match fields.get("api_key") {
        Some(f) if !f.secret => {
            return Err(at.mention(
                "[config.fields.api_key]",
                "field api_key holds the provider's key and must be `secret = true`".into(),
            ))
        }
        Some(_) => {}
        // Without it nothing is read as the key (nor the inherited one, which stands in
        // for it): the provider would install, consent included, and never start.
        None => {
            return Err(at.mention(
                if at.text.contains("[config") { "[config" } else { "" },
                "missing [config.fields.api_key] (`secret = true`): the provider's key, which the proxy attaches to every request".into(),
            ))
        }
    }
    Ok(fields)
}

/// One `[config.fields.<name>]`.
fn field(name: &str, def: &toml::Value, at: &At) -> Result<Field, Error> {
    let toml::Value::Table(def) = def else {
        return Err(at.mention(name, format!("config.fields.{name} must be a table")));
    };
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(at.mention(
            name,
            format!("field name {name:?}: lower-case letters, digits and _ only"),
        ));
    }
    let secret = match def.get("secret") {
        None => false,
        Some(toml::Value::Boolean(b)) => *b,
        Some(_) => {
            return Err(at.mention(
                "secret",
                format!("config.fields.{name}.secret must be true or false"),
            ))
        }
    };
    let aliases = match def.get("env") {
        None => Vec::new(),
        Some(toml::Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                at.mention(
                    name,
                    format!("config.fields.{name}.env must be a list of strings"),
                )
            })?,
        Some(_) => {
            return Err(at.mention(
                name,
                format!("config.fields.{name}.env must be a list of strings"),
            ))
        }
    };
    for alias in &aliases {
        if let Some(spec) = built_in_env(alias) {
            return Err(at.mention(alias, format!(
                "env alias {alias:?} is reserved: it is the built-in setting {}'s variable, and a plugin never reads the built-in settings",
                spec.name
            )));
        }
        if RESERVED_NAMES.contains(&alias.as_str()) {
            return Err(at.mention(
                alias,
                format!("env alias {alias:?} is reserved (an Alibaba Cloud credential's variable: the plugin would send that credential to its own host)"),
            ));
        }
        if RESERVED_PREFIXES.iter().any(|p| alias.starts_with(p)) {
            return Err(at.mention(alias, format!(
                "env alias {alias:?} is reserved (ABX_, E2B_, ALICLOUD_, ALIBABA_CLOUD_, ALIBABACLOUD_ and ALIYUN_ names belong to abx-proxy, the E2B SDKs and Alibaba Cloud)"
            )));
        }
        if alias.is_empty() || !alias.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            // An empty needle is line 1: point at the field instead.
            return Err(at.mention(
                if alias.is_empty() { name } else { alias },
                format!("env alias {alias:?} is not a valid variable name"),
            ));
        }
    }
    let default = def.get("default").map(|v| match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    });
    if secret && default.is_some() {
        return Err(at.mention(name, format!("secret field {name} cannot have a default")));
    }
    // Their default is `[endpoint]`'s; one here would be silently ignored.
    if default.is_some() && ["base_url", "envd_domain"].contains(&name) {
        return Err(at.key(
            "default",
            format!("field {name} cannot have a default: it defaults to endpoint.{name}"),
        ));
    }
    known_keys(
        def,
        &format!("config.fields.{name}"),
        &["secret", "env", "default", "description"],
        at,
    )?;
    string(
        def,
        "description",
        &format!("config.fields.{name}.description"),
        at,
    )?;
    Ok(Field {
        name: name.to_string(),
        secret,
        aliases,
        default,
    })
}

/// `[core]`: the built-in keys inherited, with consent.
fn inherit(table: &toml::Table, at: &At) -> Result<Vec<String>, Error> {
    let mut inherit = Vec::new();
    if let Some(core) = table_at(table, "core", "core", at)? {
        known_keys(core, "core", &["inherit"], at)?;
        if let Some(list) = core.get("inherit") {
            let list = list
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| {
                    at.mention("inherit", "core.inherit must be a list of strings".into())
                })?;
            for key in &list {
                if !INHERITABLE.contains(&key.as_str()) {
                    return Err(at.mention(
                        key,
                        format!(
                            "core.inherit: {key:?} cannot be inherited (only {})",
                            INHERITABLE.join(", ")
                        ),
                    ));
                }
            }
            // Once each: a key listed twice was asked for (and shown) twice.
            for key in list {
                if !inherit.contains(&key) {
                    inherit.push(key);
                }
            }
        }
    }
    Ok(inherit)
}

/// Whether the key may be sent as `name`. Not as a field that frames the message (the key
/// as `Content-Length` or `Transfer-Encoding` would desync the connection), routes it (as
/// `Host` it picked the upstream's virtual host and left the real one out), is hop-by-hop
/// (stripped, or read by the next hop rather than the provider), or carries envd's token
/// and routing, which the proxy sets itself. `Cookie` holds `name=value` pairs, never a
/// bare key, and replacing it would drop the client's cookies. Nor as one that changes
/// what is asked or said (as `Accept-Encoding` the key went in place of the proxy's
/// `identity` on the token look-ups, which then went without it; `Range`, `If-*`,
/// `Content-Type`, `Cache-Control`, `Idempotency-Key`, a method override), or that says
/// where the request came from (`Forwarded`, `Via`, `X-Forwarded-*`, `X-Real-IP`), or
/// that a WebSocket handshake or a Connect call needs (`Sec-WebSocket-*`, `Connect-*`:
/// envd's requests lose the client's field of the provider's header's name). A name spelt
/// with `_` for `-` is read as its `-` spelling: a gateway may (nginx's
/// `underscores_in_headers`).
pub fn auth_header_allowed(name: &http::HeaderName) -> bool {
    const REFUSED: &[&str] = &[
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "cookie",
        "set-cookie",
        "x-access-token",
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "accept",
        "accept-encoding",
        "content-type",
        "content-encoding",
        "content-range",
        "range",
        "forwarded",
        "via",
        "cache-control",
        "max-forwards",
        "http2-settings",
        "idempotency-key",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        "x-forwarded",
        "x-real-ip",
        "keepalive-ping-interval",
    ];
    let name = name.as_str().replace('_', "-");
    !REFUSED.contains(&name.as_str())
        && ![
            "proxy-",
            "if-",
            "x-forwarded-",
            "sec-websocket-",
            "connect-",
        ]
        .iter()
        .any(|p| name.starts_with(p))
}

fn canonical_env(id: &str, field: &str) -> String {
    format!("ABX_{id}_{field}")
        .to_ascii_uppercase()
        .replace('-', "_")
}

/// The built-in setting (SPEC §2) read from the variable `env`, if any.
fn built_in_env(env: &str) -> Option<&'static crate::settings::keys::KeySpec> {
    crate::settings::keys::KEYS.iter().find(|k| k.env == env)
}

/// A provider's control-plane upstream from a `base_url`, the manifest's or the field's:
/// one without a scheme, as `OPEN_SANDBOX_DOMAIN` is (`localhost:8080`), gets `http://`.
pub fn upstream_url(id: &str, raw: &str) -> Result<UpstreamUrl, Error> {
    let named = format!("{id}.base_url");
    if raw.contains("://") {
        UpstreamUrl::parse_named(&named, raw)
    } else {
        UpstreamUrl::parse_named(&named, &format!("http://{raw}"))
    }
}

/// The table `t[key]`, if there; `what` names it when it is something else.
fn table_at<'a>(
    t: &'a toml::Table,
    key: &str,
    what: &str,
    at: &At,
) -> Result<Option<&'a toml::Table>, Error> {
    match t.get(key) {
        None => Ok(None),
        Some(toml::Value::Table(t)) => Ok(Some(t)),
        Some(_) => Err(at.key(key, format!("{what} must be a table"))),
    }
}

/// The string `t[key]`, if there; `what` names it when it is something else.
fn string(t: &toml::Table, key: &str, what: &str, at: &At) -> Result<Option<String>, Error> {
    match t.get(key) {
        None => Ok(None),
        Some(toml::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(at.key(key, format!("{what} must be a string"))),
    }
}

/// Refuses a key of `t` not in `allowed`; `what` names the table.
fn known_keys(t: &toml::Table, what: &str, allowed: &[&str], at: &At) -> Result<(), Error> {
    match t.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(at.key(
            key,
            format!(
                "{what}: unknown key {key:?} (expected {})",
                allowed.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// The key (its segments, made printable) of the first key or string holding a control
/// character: C0, DEL or C1.
fn control_character(table: &toml::Table) -> Option<Vec<String>> {
    table.iter().find_map(|(key, value)| {
        let inner = if key.chars().any(char::is_control) {
            Some(Vec::new())
        } else {
            value_control_character(value)
        };
        inner.map(|mut inner| {
            inner.insert(0, printable(key).into_owned());
            inner
        })
    })
}

fn value_control_character(value: &toml::Value) -> Option<Vec<String>> {
    match value {
        toml::Value::String(s) => s.chars().any(char::is_control).then(Vec::new),
        toml::Value::Array(a) => a.iter().find_map(value_control_character),
        toml::Value::Table(t) => control_character(t),
        _ => None,
    }
}

/// `s` with what a terminal would act on rather than show written as `\u{..}`: control
/// characters, and the bidirectional overrides and isolates that reorder a line. Manifest
/// strings are printed for the user to decide on; the parser refuses control characters,
/// and this keeps one that got through (a manifest installed by an older build) inert.
pub fn printable(s: &str) -> Cow<'_, str> {
    // U+2028 and U+2029 are no controls, but end a line for a Unicode-aware reader
    // (Python's `splitlines`, JavaScript), and serde_json writes them raw.
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
    };
    if !s.chars().any(hidden) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if hidden(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id.starts_with(|c: char| c.is_ascii_lowercase())
        && id
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// The 1-based line of the first occurrence of `needle` (0 when not found): semantic errors
/// point at the key or value they are about.
fn line_of(text: &str, needle: &str) -> usize {
    if needle.is_empty() {
        return 1;
    }
    text.lines()
        .position(|l| l.contains(needle))
        .map_or(0, |i| i + 1)
}

/// The line of the first `key = ` (also dotted, `auth.key = `, or quoted) or table header
/// naming `key` (`[config.key.x]`); failing that, of the first mention of `key`.
fn key_line(text: &str, key: &str) -> usize {
    let is_key = |k: &str| !key.is_empty() && k.trim().trim_matches(['"', '\'']) == key;
    text.lines()
        .position(|l| {
            let l = l.trim();
            if l.starts_with('[') {
                l.trim_matches(['[', ']']).split('.').any(is_key)
            } else {
                l.split_once('=')
                    .is_some_and(|(k, _)| is_key(k.rsplit('.').next().unwrap_or(k)))
            }
        })
        .map_or_else(|| line_of(text, key), |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: &str = r#"manifest_version = 1
[provider]
id = "opensandbox"
[endpoint]
base_url = "http://localhost:8080"
auth.scheme = "header"
auth.header = "OPEN-SANDBOX-API-KEY"
[config.fields.api_key]
secret = true
env = ["OPEN_SANDBOX_API_KEY"]
[config.fields.base_url]
env = ["OPEN_SANDBOX_DOMAIN"]
[core]
inherit = ["sandbox_api_key"]
"#;

    /// `text` refused as an E8001 naming the file: the line and the reason.
    fn refused(text: &str) -> (usize, String) {
        let e = Manifest::parse(text, "m.toml").expect_err("refused");
        assert_eq!(e.code(), "E8001", "{e}");
        match e {
            Error::Manifest { path, line, reason } => {
                assert_eq!(path, "m.toml");
                (line, reason)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reads_the_spec_example() {
        let m = Manifest::parse(OPEN, "m.toml").unwrap();
        assert_eq!(m.id, "opensandbox");
        assert_eq!(m.auth, AuthKind::Header("OPEN-SANDBOX-API-KEY".into()));
        assert!(m.fields["api_key"].secret);
        assert_eq!(m.fields["base_url"].aliases, vec!["OPEN_SANDBOX_DOMAIN"]);
        assert_eq!(m.inherit, vec!["sandbox_api_key"]);
        // Listed twice, inherited (and asked for) once.
        let twice = OPEN.replace(
            r#"inherit = ["sandbox_api_key"]"#,
            r#"inherit = ["sandbox_api_key", "sandbox_api_key"]"#,
        );
        assert_ne!(twice, OPEN);
        let m = Manifest::parse(&twice, "m.toml").unwrap();
        assert_eq!(m.inherit, vec!["sandbox_api_key"]);
        assert_eq!(m.canonical_env("api_key"), "ABX_OPENSANDBOX_API_KEY");
    }

    /// A secret field and a plain one reading one variable: the key would be the plain
    /// one's value too (here the upstream's host).
    #[test]
    fn refuses_a_variable_read_by_two_fields() {
        let text = OPEN.replace("OPEN_SANDBOX_DOMAIN", "OPEN_SANDBOX_API_KEY");
        let (line, reason) = refused(&text);
        assert!(
            reason.contains("\"OPEN_SANDBOX_API_KEY\" is read by fields api_key and base_url"),
            "{reason}"
        );
        assert_eq!(line, 10, "{reason}");
        // One field naming its alias twice reads one variable: nothing to refuse.
        let twice = OPEN.replace(
            "[\"OPEN_SANDBOX_DOMAIN\"]",
            "[\"OPEN_SANDBOX_DOMAIN\", \"OPEN_SANDBOX_DOMAIN\"]",
        );
        assert!(Manifest::parse(&twice, "m.toml").is_ok());
    }

    #[test]
    fn refuses_control_characters_in_every_string_naming_the_key() {
        let cases = [
            // SGR conceal: the terminal hides what follows, the inherit list included.
            (
                OPEN.replace(
                    "id = \"opensandbox\"\n",
                    "id = \"opensandbox\"\ndescription = \"OpenSandbox\\u001b[8m\"\n",
                ),
                4,
                "provider.description",
            ),
            (
                OPEN.replace("localhost:8080", "localhost:8080/\\u0007"),
                5,
                "endpoint.base_url",
            ),
            // C1 (NEL) and DEL.
            (
                OPEN.replace("localhost:8080", "localhost:8080/\\u0085"),
                5,
                "endpoint.base_url",
            ),
            (
                OPEN.replace(
                    "secret = true\n",
                    "secret = true\ndescription = \"k\\u007f\"\n",
                ),
                10,
                "config.fields.api_key.description",
            ),
            // A newline forges a line of its own.
            (
                OPEN.replace(
                    "[config.fields.base_url]\n",
                    "[config.fields.base_url]\ndefault = \"\"\"h\nInherits: (none)\"\"\"\n",
                ),
                12,
                "config.fields.base_url.default",
            ),
            // In a list (an env alias): refused as a control character, before the
            // alias is checked as a variable name.
            (
                OPEN.replace(
                    "\"OPEN_SANDBOX_API_KEY\"",
                    "\"OPEN_SANDBOX_API_KEY\\u001b\"",
                ),
                10,
                "config.fields.api_key.env",
            ),
            (
                OPEN.replace("[core]", "[core]\n\"a\\tb\" = 1"),
                13,
                "core.a\\u{9}b",
            ),
        ];
        for (text, line, what) in cases {
            let (l, reason) = refused(&text);
            assert_eq!(
                reason,
                format!("{what}: control characters are not accepted")
            );
            assert_eq!(l, line, "{reason}");
            assert!(!reason.chars().any(char::is_control), "{reason:?}");
        }
    }

    /// Without an `api_key` field no variable is read as the key and the consented inherit
    /// has nothing to stand in for: such a provider would install and never start.
    #[test]
    fn a_provider_without_an_api_key_field_is_refused() {
        let without = OPEN.replace(
            "[config.fields.api_key]\nsecret = true\nenv = [\"OPEN_SANDBOX_API_KEY\"]\n",
            "",
        );
        let (line, reason) = refused(&without);
        assert_eq!(line, 8, "{reason}");
        assert!(
            reason.starts_with("missing [config.fields.api_key] (`secret = true`)"),
            "{reason}"
        );
        // No [config] at all: the first line.
        let bare = "manifest_version = 1\n[provider]\nid = \"p\"\n[endpoint]\nbase_url = \"http://h\"\nauth.scheme = \"bearer\"\n";
        let (line, reason) = refused(bare);
        assert_eq!(line, 1, "{reason}");
        assert!(
            reason.starts_with("missing [config.fields.api_key]"),
            "{reason}"
        );
        // The shipped manifests have one.
        for shipped in [
            include_str!("../../deploy/providers/opensandbox/abx-provider.toml"),
            include_str!("../../deploy/providers/e2b/abx-provider.toml"),
        ] {
            let m = Manifest::parse(shipped, "abx-provider.toml").unwrap();
            assert!(m.fields["api_key"].secret, "{}", m.id);
        }
    }

    #[test]
    fn the_key_is_never_sent_as_a_header_that_frames_or_routes_the_request() {
        for refused_name in [
            "Host",
            "content-length",
            "Transfer-Encoding",
            "connection",
            "TE",
            "upgrade",
            "keep-alive",
            "proxy-authorization",
            "Proxy-Connection",
            "proxy-anything",
            "trailer",
            "expect",
            "cookie",
            "X-Access-Token",
            "e2b-sandbox-id",
            "E2B-Sandbox-Port",
            "Accept-Encoding",
            "content-type",
            "Range",
            "If-None-Match",
            "Set-Cookie",
            "Forwarded",
            "via",
            "X-Forwarded-For",
            "Idempotency-Key",
            "X-HTTP-Method-Override",
            "HTTP2-Settings",
            "Sec-WebSocket-Key",
            "Connect-Timeout-Ms",
            "Keepalive-Ping-Interval",
            "x_access_token",
            "Content_Length",
        ] {
            let text = OPEN.replace("OPEN-SANDBOX-API-KEY", refused_name);
            let (line, reason) = refused(&text);
            assert_eq!(line, 7, "{refused_name}: {reason}");
            assert!(
                reason.starts_with(&format!("auth.header {refused_name:?}: the key cannot")),
                "{reason}"
            );
        }
        for allowed in [
            "X-API-Key",
            "authorization",
            "open-sandbox-api-key",
            "x-borrower-key",
        ] {
            let text = OPEN.replace("OPEN-SANDBOX-API-KEY", allowed);
            let m = Manifest::parse(&text, "m.toml").unwrap();
            assert_eq!(m.auth, AuthKind::Header(allowed.into()));
        }
    }

    /// `base_url` gets the check `serve` gives it, at install: a bad one used to install and
    /// fail only when the proxy started.
    #[test]
    fn base_url_is_checked_as_serve_checks_it() {
        // Quoted as `config list` shows it: user info and query values may be secrets.
        for (bad, shown, why) in [
            ("ftp://localhost:8080", None, "scheme must be https or http"),
            (
                "http://user@localhost:8080",
                Some("http://****@localhost:8080"),
                "credentials in the URL",
            ),
            (
                "http://localhost:8080/?a=b",
                Some("http://localhost:8080/?a=****"),
                "a query string",
            ),
            ("http://localhost:8080/a b", None, "not a URL"),
            ("", None, "not a URL"),
        ] {
            let text = OPEN.replace("http://localhost:8080", bad);
            let (line, reason) = refused(&text);
            assert_eq!(line, 5, "{reason}");
            let shown = shown.unwrap_or(bad);
            assert!(
                reason.starts_with(&format!("endpoint.base_url {shown:?}: "))
                    && reason.contains(why),
                "{bad}: {reason}"
            );
        }
        // Without a scheme, as OPEN_SANDBOX_DOMAIN is written: http://.
        let m = Manifest::parse(
            &OPEN.replace("http://localhost:8080", "localhost:8080"),
            "m",
        )
        .unwrap();
        assert_eq!(
            upstream_url(&m.id, &m.base_url).unwrap().to_string(),
            "http://localhost:8080"
        );
    }

    #[test]
    fn envd_domain_and_base_url_fields_are_plain_and_default_to_the_endpoint() {
        let e2b = include_str!("../../deploy/providers/e2b/abx-provider.toml");
        let cases = [
            (
                e2b.replace(
                    "[config.fields.envd_domain]\n",
                    "[config.fields.envd_domain]\nsecret = true\n",
                ),
                "field envd_domain cannot be secret",
            ),
            (
                e2b.replace(
                    "[config.fields.envd_domain]\n",
                    "[config.fields.envd_domain]\ndefault = \"e2b.dev\"\n",
                ),
                "field envd_domain cannot have a default: it defaults to endpoint.envd_domain",
            ),
            (
                e2b.replace(
                    "[config.fields.base_url]\n",
                    "[config.fields.base_url]\ndefault = \"https://api.e2b.dev\"\n",
                ),
                "field base_url cannot have a default: it defaults to endpoint.base_url",
            ),
        ];
        for (text, what) in cases {
            let (line, reason) = refused(&text);
            assert_eq!(reason, what);
            let expected = if what.contains("secret") {
                text.lines()
                    .position(|l| l == "[config.fields.envd_domain]")
            } else {
                text.lines().position(|l| l.starts_with("default ="))
            };
            assert_eq!(Some(line), expected.map(|i| i + 1), "{reason}");
        }
    }

    #[test]
    fn printable_escapes_what_a_terminal_would_act_on() {
        assert_eq!(printable("OpenSandbox server"), "OpenSandbox server");
        assert!(matches!(printable("Sandbox (日本)"), Cow::Borrowed(_)));
        assert_eq!(
            printable("a\u{1b}[8mb\nc\u{7f}\u{85}\u{202e}d"),
            "a\\u{1b}[8mb\\u{a}c\\u{7f}\\u{85}\\u{202e}d"
        );
        assert_eq!(
            printable("k\u{2028}FAKE\u{2029}x"),
            "k\\u{2028}FAKE\\u{2029}x"
        );
    }

    #[test]
    fn rejects_with_file_and_line() {
        let cases = [
            (
                OPEN.replace("manifest_version = 1", "manifest_version = 2"),
                1,
                "manifest_version",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY", "ABX_SANDBOX_API_KEY"),
                10,
                "reserved",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY", "E2B_API_KEY"),
                10,
                "reserved",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY\"", "GITHUB_TOKEN\""),
                10,
                "built-in setting github_token",
            ),
            // `ABX_SANDBOX_API_KEY` spelled by the canonical name, not an alias.
            (
                OPEN.replace("\"opensandbox\"", "\"sandbox\""),
                8,
                "ABX_SANDBOX_API_KEY is the built-in setting sandbox_api_key's",
            ),
            (
                OPEN.replace("\"opensandbox\"", "\"sandbox\"")
                    .replace("api_key]", "key]")
                    .replace("id = \"sandbox\"", "id = \"sandbox-api\""),
                8,
                "ABX_SANDBOX_API_KEY is the built-in setting",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_DOMAIN", "ALICLOUD_ACCESS_KEY_ID"),
                12,
                "reserved",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY", "ALIBABACLOUD_ACCESS_KEY_SECRET"),
                10,
                "reserved",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY", "ALIYUN_ACCESS_KEY_SECRET"),
                10,
                "reserved",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY", "ACCESS_KEY_SECRET"),
                10,
                "reserved (an Alibaba Cloud credential's variable: the plugin would send",
            ),
            (
                OPEN.replace("secret = true", "secret = true\ndefault = \"x\""),
                8,
                "cannot have a default",
            ),
            (
                OPEN.replace("\"header\"\n", "\"digest\"\n"),
                6,
                "auth.scheme",
            ),
            (
                OPEN.replace("id = \"opensandbox\"", "id = \"Open Sandbox\""),
                3,
                "provider id",
            ),
            (
                OPEN.replace("id = \"opensandbox\"", "id = \"9sandbox\""),
                3,
                "provider id \"9sandbox\": lower-case letters",
            ),
            (
                OPEN.replace("OPEN_SANDBOX_API_KEY\"", "OPEN.SANDBOX_API_KEY\""),
                10,
                "env alias \"OPEN.SANDBOX_API_KEY\" is not a valid variable name",
            ),
            (
                OPEN.replace("\"OPEN_SANDBOX_API_KEY\"", "\"\""),
                8,
                "env alias \"\" is not a valid variable name",
            ),
            (
                OPEN.replace("base_url = \"http://localhost:8080\"\n", ""),
                4,
                "base_url",
            ),
            (OPEN.replace("[core]", "[core"), 13, "invalid TOML"),
            // The span starts at the start of the line.
            (
                OPEN.replace("[core]\n", "[core]\n= 1\n"),
                14,
                "invalid TOML",
            ),
            (
                OPEN.replace("manifest_version", "\"manifest_version"),
                1,
                "invalid TOML",
            ),
            (
                OPEN.replace("secret = true\n", ""),
                8,
                "must be `secret = true`",
            ),
            (
                OPEN.replace("\"sandbox_api_key\"", "\"access_key_secret\""),
                14,
                "cannot be inherited",
            ),
            // A misspelt or mistyped key, in any table, used to be read as absent:
            // `envd_domainn` left the provider without an envd plane, and nothing said so.
            (
                OPEN.replace("auth.scheme", "envd_domainn = \"sbx.example\"\nauth.scheme"),
                6,
                "endpoint: unknown key \"envd_domainn\" (expected base_url, envd_domain, auth)",
            ),
            (
                OPEN.replace("inherit =", "inherits ="),
                14,
                "core: unknown key \"inherits\" (expected inherit)",
            ),
            (
                OPEN.replace("[endpoint]", "name = \"o\"\n[endpoint]"),
                4,
                "provider: unknown key \"name\" (expected id, description)",
            ),
            (
                // A prefix the author expected before the key, silently not sent.
                OPEN.replacen("[config", "auth.prefix = \"Token \"\n[config", 1),
                8,
                "endpoint.auth: unknown key \"prefix\" (expected scheme, header)",
            ),
            (
                OPEN.replace("[core]", "[config.field.api_keyy]\nsecret = true\n[core]"),
                13,
                "config: unknown key \"field\" (expected fields)",
            ),
            (
                OPEN.replace("secret = true\n", "secret = true\nsecrett = true\n"),
                10,
                "config.fields.api_key: unknown key \"secrett\"",
            ),
            (
                OPEN.replace("[endpoint]", "description = 5\n[endpoint]"),
                4,
                "provider.description must be a string",
            ),
            (
                OPEN.replace("auth.scheme", "envd_domain = 1\nauth.scheme"),
                6,
                "endpoint.envd_domain must be a string",
            ),
            (
                OPEN.replace("[core]\ninherit = [\"sandbox_api_key\"]\n", "")
                    .replace("manifest_version = 1\n", "manifest_version = 1\ncore = 1\n"),
                2,
                "core must be a table",
            ),
            (
                OPEN.replace("secret = true\n", "secret = true\ndescription = 1\n"),
                10,
                "config.fields.api_key.description must be a string",
            ),
            (
                OPEN.replace("\"header\"\nauth.header", "\"bearer\"\nauth.header"),
                7,
                "auth.header is for auth.scheme = \"header\"",
            ),
            // Found by its key however it is spaced, not by the text `id =`.
            (
                OPEN.replace("id = \"opensandbox\"", "id=\"My_Cloud\""),
                3,
                "provider id \"My_Cloud\"",
            ),
            (
                OPEN.replace("id = \"opensandbox\"", "id  = \"alicloud-express\""),
                3,
                "built in",
            ),
            // A refused URL's password is not printed back.
            (
                OPEN.replace("localhost:8080", "u:hunter2pw@localhost:8080"),
                5,
                "endpoint.base_url \"http://u:****@localhost:8080\": credentials in the URL",
            ),
            (
                OPEN.replace(
                    "auth.scheme",
                    "envd_domain = \"u:hunter2pw@sbx.example\"\nauth.scheme",
                ),
                6,
                "endpoint.envd_domain \"u:****@sbx.example\"",
            ),
            // Found by its key, not by a comment that mentions it first.
            (
                format!("# envd_domain is set below\n{OPEN}")
                    .replace("auth.scheme", "envd_domain = \"not a domain\"\nauth.scheme"),
                7,
                "endpoint.envd_domain \"not a domain\"",
            ),
        ];
        for (text, line, what) in cases {
            let (l, reason) = refused(&text);
            assert!(reason.contains(what), "{what}: {reason}");
            assert_eq!(l, line, "{what}: {reason}");
        }
    }
}
