//! Providers: the built-in `alicloud-express`, and plugins installed from manifests under
//! `~/.abx/providers/<id>/` with an install receipt recording what the user consented to.
//!
//! A plugin's fields resolve through the same chain as the built-in keys (canonical
//! `ABX_<ID>_<FIELD>` first, then the manifest's aliases); a plugin sees the built-in
//! credential only when its manifest asks in `[core] inherit` and the receipt records consent
//! for exactly that manifest.

mod files;
pub mod manifest;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use manifest::{AuthKind, Field, Manifest, MANIFEST_FILE};

use crate::error::Error;
use crate::secret::Secret;
use crate::settings::{Key, RawLayers, Source, UpstreamUrl, Value};

pub const BUILTIN: &str = "alicloud-express";
pub const RECEIPT_FILE: &str = ".abx-install.json";

/// An installed plugin: its manifest and the consent on record.
#[derive(Debug, Clone)]
pub struct Installed {
    pub manifest: Manifest,
    pub dir: PathBuf,
    /// Built-in keys the user consented to share with this exact manifest.
    pub consented: Vec<String>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Receipt {
    id: String,
    manifest_sha256: String,
    installed_at: u64,
    consent: Consent,
    /// While a reinstall replaces the manifest, the consent on record for the one it
    /// replaces (see [`install`]); gone once the new manifest is in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous: Option<Previous>,
}

#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Previous {
    manifest_sha256: String,
    consent: Consent,
}

#[derive(serde::Serialize, serde::Deserialize, Default, Clone)]
struct Consent {
    inherit: Vec<String>,
}

impl Receipt {
    /// The consent this receipt records for the manifest whose hash is `sha`, if any.
    fn consent_for(&self, sha: &str) -> Option<&Consent> {
        if self.manifest_sha256 == sha {
            return Some(&self.consent);
        }
        self.previous
            .as_ref()
            .filter(|p| p.manifest_sha256 == sha)
            .map(|p| &p.consent)
    }
}

fn providers_dir(abx_home: &Path) -> PathBuf {
    abx_home.join("providers")
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Installs `file` under `abx_home`; records consent for its inherit list only when given.
/// With it, what the install changed of where and how the installed plugin of that id sent
/// its key (see [`key_route_changes`]).
pub fn install(
    abx_home: &Path,
    file: &Path,
    consent: bool,
) -> Result<(Installed, Vec<String>), Error> {
    install_observed(abx_home, file, consent, || {})
}

/// [`install`], calling `after_step` after each file it replaces: what a reader may find
/// between them.
fn install_observed(
    abx_home: &Path,
    file: &Path,
    consent: bool,
    mut after_step: impl FnMut(),
) -> Result<(Installed, Vec<String>), Error> {
    // Bounded as `load` reads the copy (a pipe is fine here: it is read once).
    let text = std::fs::File::open(file)
        .and_then(crate::watched::read_bounded)
        .map_err(|e| Error::ReadFile {
            path: file.display().to_string(),
            reason: crate::watched::reason(&e),
        })?;
    // Refused as a `.env` or config.toml that is not UTF-8 is: read lossily, a manifest
    // was installed with U+FFFD where its bytes were.
    let text_str = utf8_text(&text, file)?;
    let manifest = Manifest::parse(&text_str, &file.display().to_string())?;
    shares_no_secret(abx_home, &manifest, &file.display().to_string(), true)?;
    let dir = providers_dir(abx_home).join(&manifest.id);
    let write_err = |path: &Path, e: std::io::Error| Error::WriteFile {
        path: path.display().to_string(),
        reason: crate::watched::reason(&e),
    };
    std::fs::create_dir_all(&dir).map_err(|e| write_err(&dir, e))?;
    let lock =
        files::InstallLock::take(&dir).map_err(|e| write_err(&dir.join(files::LOCK_FILE), e))?;
    let consented = if consent {
        manifest.inherit.clone()
    } else {
        Vec::new()
    };
    // The consent a reader grants the manifest in place (under the lock, no other install
    // changes it), as `load` grants it: the receipt's id, the manifest's own inherit list.
    let in_place = load(abx_home, &manifest.id).ok().flatten();
    let changes = (in_place.as_ref())
        .map(|old| key_route_changes(&old.manifest, &manifest))
        .unwrap_or_default();
    let previous = crate::watched::read_regular(&dir.join(MANIFEST_FILE))
        .ok()
        .zip(in_place)
        .map(|(old_text, old)| Previous {
            manifest_sha256: sha256_hex(&old_text),
            consent: Consent {
                inherit: old.consented,
            },
        });
    let mut receipt = Receipt {
        id: manifest.id.clone(),
        manifest_sha256: sha256_hex(&text),
        installed_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        consent: Consent {
            inherit: consented.clone(),
        },
        previous,
    };
    let json = |r: &Receipt| serde_json::to_vec_pretty(r).unwrap_or_default();
    let mut replace = |name: &str, bytes: &[u8]| {
        files::replace(&dir, name, bytes, &lock).map_err(|e| write_err(&dir.join(name), e))?;
        after_step();
        Ok::<(), Error>(())
    };
    // A proxy starting, `check` or a reload may read between the renames below, and takes
    // no lock: each step leaves a pair that reads as the old install or the new one. First
    // the new receipt, which also keeps the consent given to the manifest in place (a
    // receipt alone installs nothing), then the new manifest, then the receipt without
    // the old consent.
    replace(RECEIPT_FILE, &json(&receipt))?;
    replace(MANIFEST_FILE, &text)?;
    if receipt.previous.take().is_some() {
        replace(RECEIPT_FILE, &json(&receipt))?;
    }
    drop(lock);
    let installed = Installed {
        manifest,
        dir,
        consented,
    };
    Ok((installed, changes))
}

/// What `new` changes of where and how `old`, the plugin of the same id, sends its key:
/// its hosts, its header, the variables its secrets are read from. A manifest of another
/// author claiming an installed plugin's id replaced it without a word, and the user's
/// key for the old host went to the new one at the next start.
pub fn key_route_changes(old: &Manifest, new: &Manifest) -> Vec<String> {
    let auth = |a: &AuthKind| match a {
        AuthKind::Bearer => "Authorization: Bearer".to_string(),
        AuthKind::Header(h) => format!("header {h}"),
    };
    let joined = |names: std::collections::BTreeSet<String>| {
        (names.into_iter()).collect::<Vec<_>>().join(", ")
    };
    let secrets = |m: &Manifest| joined(m.env_names_of(true).collect());
    // A host field's own variables: an alias added to `base_url` moves the key as surely
    // as a new default does.
    let read_from = |m: &Manifest, field: &str| match m.fields.get(field) {
        Some(f) => joined(
            std::iter::once(m.canonical_env(field))
                .chain(f.aliases.iter().cloned())
                .collect(),
        ),
        None => "none".to_string(),
    };
    let none = || "none".to_string();
    // A URL or a header name in another case, or with a trailing `/`, is taken for the
    // same (a path's case is the upstream's, the host stays: `fold`); variables' names are
    // not (`API_URL` and `api_url` are two).
    let same = |was: &str, is: &str, fold: bool| match fold {
        true => was
            .trim_end_matches('/')
            .eq_ignore_ascii_case(is.trim_end_matches('/')),
        false => was == is,
    };
    [
        ("base_url", old.base_url.clone(), new.base_url.clone(), true),
        (
            "envd_domain",
            old.envd_domain.clone().unwrap_or_else(none),
            new.envd_domain.clone().unwrap_or_else(none),
            true,
        ),
        ("auth", auth(&old.auth), auth(&new.auth), true),
        ("secrets read from", secrets(old), secrets(new), false),
        (
            "base_url read from",
            read_from(old, "base_url"),
            read_from(new, "base_url"),
            false,
        ),
        (
            "envd_domain read from",
            read_from(old, "envd_domain"),
            read_from(new, "envd_domain"),
            false,
        ),
    ]
    .into_iter()
    .filter(|(_, was, is, fold)| !same(was, is, *fold))
    .map(|(what, was, is, _)| format!("{what} {was} -> {is}"))
    .collect()
}

/// The values of every installed plugin's secret fields, as the layers hold them: what an
/// error quoting a value typed in the wrong place (a provider id) must not show.
pub fn installed_secrets(abx_home: &Path, layers: &RawLayers) -> Vec<Secret> {
    list(abx_home)
        .into_iter()
        .filter_map(Result::ok)
        .flat_map(|p| {
            p.manifest
                .env_names_of(true)
                .filter_map(|n| layers.lookup(&n, &[n.as_str()], None).ok().flatten())
                .map(|(v, _)| Secret::new(v))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Each provider's variables are its own: a field of one reading what a secret field of
/// another reads (`ABX_OPEN_SANDBOX_API_KEY` is provider `open`'s field
/// `sandbox_api_key` and provider `open-sandbox`'s key) would show that key in clear and,
/// as a host, send it there. Checked both ways against the plugins installed by `provider
/// install` (`both_ways`), and for the selected plugin as the reader whenever settings are
/// read (a manifest installed before this check, placed by hand, or installed while the
/// other was unreadable): the owner of the secret does nothing wrong, and starts.
pub fn shares_no_secret(
    abx_home: &Path,
    new: &Manifest,
    path: &str,
    both_ways: bool,
) -> Result<(), Error> {
    // A plain field's variables, and a secret field's own canonical name (`acme-admin`'s
    // key and `acme`'s `admin_api_key` are both `ABX_ACME_ADMIN_API_KEY`): two plugins'
    // secret fields may share an SDK's alias (the user picks which provider the key is
    // for), not a name that says whose key it is.
    let clash = |reader: &Manifest, owner: &Manifest| {
        let secrets: Vec<String> = owner.env_names_of(true).collect();
        let canonical = (reader.fields.values())
            .filter(|f| f.secret)
            .map(|f| reader.canonical_env(&f.name));
        (reader.env_names_of(false).chain(canonical)).find(|v| secrets.contains(v))
    };
    for other in list(abx_home).into_iter().filter_map(Result::ok) {
        let other = other.manifest;
        if other.id == new.id {
            continue;
        }
        let as_owner = both_ways.then(|| clash(&other, new)).flatten();
        let (variable, reader, owner) = match (clash(new, &other), as_owner) {
            (Some(v), _) => (v, &new.id, &other.id),
            (None, Some(v)) => (v, &other.id, &new.id),
            (None, None) => continue,
        };
        return Err(Error::Manifest {
            path: path.to_string(),
            line: 0,
            reason: format!(
                "variable {variable} holds a secret of provider {owner} and is read by a plain field, or as the own name of a secret field, of provider {reader}: rename the field or the alias"
            ),
        });
    }
    Ok(())
}

/// The installed plugin `id`, if any. Consent counts only for the manifest it was given to.
pub fn load(abx_home: &Path, id: &str) -> Result<Option<Installed>, Error> {
    // The id names a directory under providers/. As a path (absolute, or with `..`) it
    // would load a manifest, and a receipt of consent to the built-in key, from anywhere:
    // a checkout's ./.env could name one of its own.
    if !manifest::valid_id(id) {
        return Ok(None);
    }
    let dir = providers_dir(abx_home).join(id);
    let path = dir.join(MANIFEST_FILE);
    // Through the bounded reader: a reload reads it again, on the runtime that serves.
    let (text, receipt) = match read_in_step(&dir) {
        Ok(pair) => pair,
        Err(e) => {
            let reason = match e.kind() {
                // A link to nothing is a broken install, not none: "unknown provider" sent
                // the user to install what is installed.
                std::io::ErrorKind::NotFound if path.symlink_metadata().is_ok() => {
                    crate::watched::kind_of(&path).to_string()
                }
                std::io::ErrorKind::NotFound => return Ok(None),
                _ => crate::watched::reason(&e),
            };
            return Err(Error::ReadFile {
                path: path.display().to_string(),
                reason,
            });
        }
    };
    // Lossily, as before `provider install` refused what is not UTF-8: a manifest
    // installed then (a Latin-1 byte in a comment) must not stop the next start.
    let manifest = Manifest::parse(&String::from_utf8_lossy(&text), &path.display().to_string())?;
    if manifest.id != id {
        return Err(Error::Manifest {
            path: path.display().to_string(),
            line: 0,
            reason: format!(
                "declares id `{}` but is installed as `{id}`; install it again",
                manifest.id
            ),
        });
    }
    let sha = sha256_hex(&text);
    let consented = match receipt {
        Some(r) if r.id == manifest.id => r
            .consent_for(&sha)
            .map(|c| {
                c.inherit
                    .iter()
                    .filter(|k| manifest.inherit.contains(k))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    Ok(Some(Installed {
        manifest,
        dir,
        consented,
    }))
}

/// The manifest in `dir` and its receipt, read in step. Read one after the other they may
/// come from two installs, a manifest read before a reinstall replaced it and the receipt
/// written after (the install's order keeps each state in step, not a reader that
/// straddles two): a receipt with no word on the manifest read, when that manifest is no
/// longer the one in place, is read again with the new one.
fn read_in_step(dir: &Path) -> std::io::Result<(Vec<u8>, Option<Receipt>)> {
    let path = dir.join(MANIFEST_FILE);
    read_in_step_with(dir, || crate::watched::read_regular(&path))
}

fn read_in_step_with(
    dir: &Path,
    mut read_manifest: impl FnMut() -> std::io::Result<Vec<u8>>,
) -> std::io::Result<(Vec<u8>, Option<Receipt>)> {
    let mut text = read_manifest()?;
    for _ in 0..3 {
        let receipt = read_receipt(dir);
        let sha = sha256_hex(&text);
        if receipt
            .as_ref()
            .is_none_or(|r| r.consent_for(&sha).is_some())
        {
            return Ok((text, receipt));
        }
        let again = read_manifest()?;
        if again == text {
            // The manifest read is the one in place (or one put back since): a receipt read
            // now has the last word on it.
            return Ok((text, read_receipt(dir)));
        }
        text = again;
    }
    Ok((text, read_receipt(dir)))
}

fn read_receipt(dir: &Path) -> Option<Receipt> {
    let bytes = crate::watched::read_regular(&dir.join(RECEIPT_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// A manifest's text; E1006 naming `path` and where when it is not UTF-8.
fn utf8_text(bytes: &[u8], path: &Path) -> Result<String, Error> {
    crate::watched::utf8(bytes.to_vec()).map_err(|e| Error::ReadFile {
        path: path.display().to_string(),
        reason: crate::watched::reason(&e),
    })
}

/// Every installed plugin, by id; one that cannot be read is its error (as `check` and
/// `serve` would say it), not left out: `provider list` showed only the built-in one,
/// with no word, when a manifest was a FIFO, a dangling link or unreadable.
pub fn list(abx_home: &Path) -> Vec<Result<Installed, Error>> {
    use std::io::ErrorKind;
    let dir = providers_dir(abx_home);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            return vec![Err(Error::ReadFile {
                path: dir.display().to_string(),
                reason: crate::watched::reason(&e),
            })]
        }
    };
    // Something at the manifest's path, of whatever kind, or a directory that cannot be
    // looked into: not a file beside the plugins, nor a directory holding no manifest.
    let installed = |e: &std::fs::DirEntry| match e.path().join(MANIFEST_FILE).symlink_metadata() {
        Ok(_) => true,
        Err(e) => !matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory),
    };
    let mut ids: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(installed)
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    ids.sort();
    ids.into_iter()
        .filter_map(|id| load(abx_home, &id).transpose())
        .collect()
}

/// config.toml as its warnings name it (`~/.abx/config.toml (/where/it/is)`).
fn toml_label(layers: &RawLayers) -> String {
    layers.toml_path.as_deref().map_or_else(
        || "~/.abx/config.toml".to_string(),
        crate::settings::layers::config_label,
    )
}

/// One plugin field, resolved.
#[derive(Debug, Clone)]
pub struct FieldValue {
    /// `<provider-id>.<field>`, as `config list` keys it.
    pub key: String,
    pub field: String,
    pub value: Option<Value>,
    pub source: Source,
    pub env: String,
    pub secret: bool,
}

/// A plugin provider's resolved settings.
#[derive(Debug, Clone)]
pub struct PluginSettings {
    pub installed: Installed,
    pub fields: Vec<FieldValue>,
    pub warnings: Vec<String>,
}

impl PluginSettings {
    fn field(&self, name: &str) -> Option<&FieldValue> {
        self.fields.iter().find(|f| f.field == name)
    }

    /// The key this plugin attaches: its own `api_key`, or the inherited one.
    pub fn api_key(&self) -> Option<Secret> {
        match &self.field("api_key")?.value {
            Some(Value::Secret(s)) => Some(s.clone()),
            Some(Value::Plain(s)) => Some(Secret::new(s.as_str())),
            None => None,
        }
    }

    /// envd's domain (`envd_domain` field, else the manifest's, checked when it was
    /// parsed); `None`: no envd plane.
    pub fn envd_domain(&self) -> Result<Option<String>, Error> {
        use crate::settings::values;
        match self.field("envd_domain").and_then(|f| f.value.as_ref()) {
            Some(v) if values::is_domain(&v.text()) && !values::is_address(&v.text()) => {
                Ok(Some(v.text()))
            }
            Some(v) => Err(Error::InvalidSetting {
                key: format!("{}.envd_domain", self.installed.manifest.id),
                reason: if values::is_domain(&v.text()) {
                    values::ADDRESS_NO_DOMAIN.into()
                } else {
                    values::DOMAIN_EXPECTED.into()
                },
            }),
            None => Ok(self.installed.manifest.envd_domain.clone()),
        }
    }

    /// The control-plane upstream: the `base_url` field, else the manifest's.
    pub fn base_url(&self) -> Result<UpstreamUrl, Error> {
        let raw = match self.field("base_url").and_then(|f| f.value.as_ref()) {
            Some(v) => v.text(),
            None => self.installed.manifest.base_url.clone(),
        };
        manifest::upstream_url(&self.installed.manifest.id, &raw)
    }
}

/// `base_url` and `envd_domain` fields default to the manifest's `[endpoint]`.
fn endpoint_default<'a>(m: &'a Manifest, field: &Field) -> Option<&'a String> {
    match field.name.as_str() {
        "base_url" => Some(&m.base_url),
        "envd_domain" => m.envd_domain.as_ref(),
        _ => None,
    }
}

/// Resolves a plugin's fields through the chain. `core_api_key` is the resolved
/// `sandbox_api_key`, offered only when the receipt records consent.
pub fn resolve(
    installed: Installed,
    layers: &RawLayers,
    core_api_key: Option<(&Secret, Source)>,
) -> Result<PluginSettings, Error> {
    let m = &installed.manifest;
    let mut fields = Vec::new();
    let mut warnings = Vec::new();
    for field in m.fields.values() {
        let canonical = m.canonical_env(&field.name);
        let key = format!("{}.{}", m.id, field.name);
        let option = layers
            .provider_options
            .iter()
            .rev()
            .find(|(k, _)| k == &field.name)
            .map(|(_, v)| v.trim().to_string())
            .filter(|v| !v.is_empty());
        if field.secret && option.is_some() {
            return Err(Error::ProviderOption {
                field: field.name.clone(),
                reason: "is a secret and is refused on the command line".into(),
            });
        }
        if field.secret && layers.toml.contains_key(&key) {
            warnings.push(format!(
                "{}: secret field [providers.{}] {} ignored; secrets are read only from the environment or a .env file",
                toml_label(layers),
                m.id,
                field.name
            ));
        }
        // The canonical name (and the config.toml key) in any layer before an alias in
        // any layer: a user points the vendor's SDK at the proxy through the vendor's
        // variables (`OPEN_SANDBOX_DOMAIN=localhost:49982`, `OPEN_SANDBOX_API_KEY=dummy`)
        // and keeps the real values under `ABX_*` in ~/.abx/.env; the exported aliases
        // must not take their place.
        let aliases: Vec<&str> = field.aliases.iter().map(String::as_str).collect();
        let toml_key = (!field.secret).then_some(key.as_str());
        let found = match option {
            Some(v) => Some((v, Source::Flag, None)),
            None => match layers.lookup_named(&key, &[canonical.as_str()], toml_key)? {
                Some(found) => Some(found),
                None => layers.lookup_named(&key, &aliases, None)?,
            },
        };
        // The variable named beside the value (`config list`, the ./.env warning): the
        // alias that gave it, or the built-in key's for an inherited key.
        let mut env = canonical.clone();
        let (value, source) = match found {
            Some((v, s, name)) => {
                if let Some(name) = name {
                    env = name.to_string();
                }
                let value = if field.secret {
                    Value::Secret(Secret::new(v))
                } else {
                    Value::Plain(v)
                };
                (Some(value), s)
            }
            None => match (
                endpoint_default(m, field).or(field.default.as_ref()),
                core_api_key,
            ) {
                (Some(d), _) => (Some(Value::Plain(d.clone())), Source::Default),
                (None, Some((k, s)))
                    if field.name == "api_key"
                        && installed.consented.iter().any(|c| c == "sandbox_api_key") =>
                {
                    env = Key::SandboxApiKey.spec().env.to_string();
                    (Some(Value::Secret(k.clone())), s)
                }
                _ => (None, Source::Unset),
            },
        };
        fields.push(FieldValue {
            key,
            field: field.name.clone(),
            value,
            source,
            env,
            secret: field.secret,
        });
    }
    // As config.toml's unknown keys are: said, not dropped silently (a typo in a field name
    // leaves its default in force).
    let table = format!("{}.", m.id);
    let mut unknown: Vec<&str> = layers
        .toml
        .keys()
        .filter_map(|k| k.strip_prefix(&table))
        .filter(|f| !m.fields.contains_key(*f))
        .collect();
    unknown.sort_unstable();
    for f in unknown {
        warnings.push(format!(
            "{}: unknown field [providers.{}] {f} ignored; provider {} has no such field",
            toml_label(layers),
            m.id,
            m.id
        ));
    }
    for (k, _) in &layers.provider_options {
        if !m.fields.contains_key(k) {
            return Err(Error::ProviderOption {
                field: k.clone(),
                reason: format!("provider {} has no such field", m.id),
            });
        }
    }
    Ok(PluginSettings {
        installed,
        fields,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MANIFEST: &str = r#"manifest_version = 1
[provider]
id = "acme"
[endpoint]
base_url = "https://api.acme.example"
envd_domain = "sandbox.acme.example"
auth.scheme = "bearer"
[config.fields.api_key]
secret = true
[config.fields.region]
default = "eu-1"
[config.fields.base_url]
[config.fields.envd_domain]
"#;

    fn installed() -> Installed {
        Installed {
            manifest: Manifest::parse(MANIFEST, "m.toml").expect("manifest"),
            dir: PathBuf::from("acme"),
            consented: Vec::new(),
        }
    }

    fn field<'a>(s: &'a PluginSettings, name: &str) -> &'a FieldValue {
        s.field(name).unwrap_or_else(|| panic!("no field {name}"))
    }

    fn manifest_of(id: &str, fields: &str) -> String {
        format!(
            "manifest_version = 1\n[provider]\nid = \"{id}\"\n[endpoint]\n\
             base_url = \"https://api.{id}.example\"\nauth.scheme = \"bearer\"\n\
             [config.fields.api_key]\nsecret = true\n{fields}"
        )
    }

    fn install_text(home: &Path, text: &str) -> Result<Installed, Error> {
        let file = home.join("m.toml");
        std::fs::write(&file, text).expect("manifest written");
        install(home, &file, false).map(|(installed, _)| installed)
    }

    /// A reinstall says what it changes of where and how the plugin's key goes (its
    /// hosts, its header, the variables its secrets come from), and nothing when none of
    /// that changes.
    #[test]
    fn a_reinstall_says_where_the_key_now_goes() {
        let home = tempfile::tempdir().expect("temp dir");
        let h = home.path();
        let file = h.join("m.toml");
        let changes = |text: &str| {
            std::fs::write(&file, text).expect("manifest written");
            install(h, &file, false).expect("installed").1
        };
        assert!(changes(&manifest_of("acme", "")).is_empty());
        assert!(changes(&manifest_of("acme", "[config.fields.region]\n")).is_empty());
        let respelt = manifest_of("acme", "").replace("https://api.acme", "HTTPS://API.acme");
        assert!(changes(&respelt.replace(".example", ".example/")).is_empty());
        let aliased = manifest_of("acme", "[config.fields.base_url]\nenv = [\"API_URL\"]\n");
        assert_eq!(
            changes(&aliased),
            ["base_url read from none -> ABX_ACME_BASE_URL, API_URL"]
        );
        // Another variable, whatever its case.
        assert_eq!(
            changes(&aliased.replace("API_URL", "api_url")),
            ["base_url read from ABX_ACME_BASE_URL, API_URL -> ABX_ACME_BASE_URL, api_url"]
        );
        // Back to the aliased one, to move from.
        changes(&aliased);
        let moved = manifest_of("acme", "[config.fields.admin_key]\nsecret = true\n")
            .replace("https://api.acme.example", "http://127.0.0.1:9")
            .replace(
                "auth.scheme = \"bearer\"",
                "auth.scheme = \"header\"\nauth.header = \"X-Key\"",
            );
        assert_eq!(
            changes(&moved),
            [
                "base_url https://api.acme.example -> http://127.0.0.1:9",
                "auth Authorization: Bearer -> header X-Key",
                "secrets read from ABX_ACME_API_KEY -> ABX_ACME_ADMIN_KEY, ABX_ACME_API_KEY",
                "base_url read from ABX_ACME_BASE_URL, API_URL -> none",
            ]
        );
    }

    /// `open`'s plain field `sandbox_api_key` is read from `ABX_OPEN_SANDBOX_API_KEY`,
    /// the key of provider `open-sandbox`; an alias can name another's key too. Refused
    /// whichever is installed second.
    #[test]
    fn a_plain_field_never_reads_another_providers_secret() {
        let cases = [
            (
                manifest_of("open-sandbox", ""),
                manifest_of("open", "[config.fields.sandbox_api_key]\n"),
                "ABX_OPEN_SANDBOX_API_KEY",
            ),
            (
                manifest_of("vendor", "env = [\"VENDOR_KEY\"]\n"),
                manifest_of(
                    "other",
                    "[config.fields.base_url]\nenv = [\"VENDOR_KEY\"]\n",
                ),
                "VENDOR_KEY",
            ),
        ];
        for (owner, reader, variable) in &cases {
            for (first, second) in [(owner, reader), (reader, owner)] {
                let home = tempfile::tempdir().expect("temp dir");
                install_text(home.path(), first).expect("the first installs");
                let e = install_text(home.path(), second).expect_err("the second is refused");
                assert_eq!(e.code(), "E8001", "{e}");
                assert!(
                    e.to_string()
                        .contains(&format!("variable {variable} holds a secret")),
                    "{e}"
                );
            }
        }
        // Two keys read from one vendor variable are the user's visible choice, and a
        // provider installed again is no clash with itself.
        let home = tempfile::tempdir().expect("temp dir");
        let staging = manifest_of("vendor-staging", "env = [\"VENDOR_KEY\"]\n");
        for text in [&cases[1].0, &staging, &staging] {
            install_text(home.path(), text).expect("installs");
        }
    }

    /// What a proxy starting, `check` or a reload finds between the files a reinstall
    /// replaces (it takes no lock): the old install's consent or the new one's, never a
    /// new manifest beside a receipt that withdraws the consent given to either.
    #[test]
    fn a_reader_between_a_reinstalls_steps_sees_the_old_install_or_the_new() {
        let home = tempfile::tempdir().expect("temp dir");
        let h = home.path();
        let inheriting = |extra: &str| {
            manifest_of(
                "acme",
                &format!("{extra}[core]\ninherit = [\"sandbox_api_key\"]\n"),
            )
        };
        let file = h.join("m.toml");
        let consents = |text: &str, consent: bool| {
            std::fs::write(&file, text).expect("manifest written");
            let mut seen = Vec::new();
            install_observed(h, &file, consent, || {
                let installed = load(h, "acme").expect("loads");
                seen.push(installed.map(|i| i.consented));
            })
            .expect("installed");
            seen
        };
        let yes = Some(vec!["sandbox_api_key".to_string()]);
        let no = Some(vec![]);
        // A first install: nothing installed until the manifest is there, with its consent.
        assert_eq!(consents(&inheriting(""), true), [None, yes.clone()]);
        // Another manifest, consented again: the old one's consent until it is replaced.
        let changed = inheriting("[config.fields.region]\n");
        assert_eq!(
            consents(&changed, true),
            [yes.clone(), yes.clone(), yes.clone()]
        );
        // The same one again without consent: withdrawn at the first step.
        assert_eq!(
            consents(&changed, false),
            [no.clone(), no.clone(), no.clone()]
        );
        // Another, consented, after an install without: none until it is in place.
        assert_eq!(
            consents(&inheriting(""), true),
            [no.clone(), yes.clone(), yes]
        );
    }

    /// The consent a reinstall keeps for the manifest in place is what readers granted it,
    /// no more: a receipt of another id (edited, or copied from another plugin) granted
    /// nothing before, and nothing while the new manifest goes in.
    #[test]
    fn a_reinstall_keeps_no_consent_readers_did_not_grant() {
        let home = tempfile::tempdir().expect("temp dir");
        let h = home.path();
        let inherit = "[core]\ninherit = [\"sandbox_api_key\"]\n";
        let file = h.join("m.toml");
        std::fs::write(&file, manifest_of("acme", inherit)).expect("manifest written");
        install(h, &file, true).expect("installed");
        let receipt = providers_dir(h).join("acme").join(RECEIPT_FILE);
        let json = std::fs::read_to_string(&receipt).expect("receipt");
        std::fs::write(&receipt, json.replace("\"acme\"", "\"zzz\"")).expect("edited");
        assert!(load(h, "acme")
            .expect("loads")
            .expect("installed")
            .consented
            .is_empty());
        let changed = manifest_of("acme", &format!("[config.fields.region]\n{inherit}"));
        std::fs::write(&file, changed).expect("manifest written");
        let mut seen = Vec::new();
        install_observed(h, &file, false, || {
            let installed = load(h, "acme").expect("loads").expect("installed");
            seen.push(installed.consented);
        })
        .expect("installed");
        assert!(seen.iter().all(Vec::is_empty), "{seen:?}");
    }

    /// A reader that read the manifest before a reinstall replaced it, and the receipt
    /// after the reinstall ended, reads the manifest again: consent given to both is not
    /// taken as withdrawn.
    #[test]
    fn a_reader_straddling_a_reinstall_reads_the_new_pair() {
        let home = tempfile::tempdir().expect("temp dir");
        let h = home.path();
        let inherit = "[core]\ninherit = [\"sandbox_api_key\"]\n";
        let old = manifest_of("acme", inherit);
        let new = manifest_of("acme", &format!("[config.fields.region]\n{inherit}"));
        for text in [&old, &new] {
            let file = h.join("m.toml");
            std::fs::write(&file, text).expect("manifest written");
            install(h, &file, true).expect("installed");
        }
        let dir = providers_dir(h).join("acme");
        let mut reads = 0;
        let (text, receipt) = read_in_step_with(&dir, || {
            reads += 1;
            // The first read came before the reinstall.
            if reads == 1 {
                Ok(old.clone().into_bytes())
            } else {
                std::fs::read(dir.join(MANIFEST_FILE))
            }
        })
        .expect("read");
        assert_eq!(text, new.as_bytes());
        let receipt = receipt.expect("receipt");
        assert!(receipt.consent_for(&sha256_hex(&text)).is_some());
        assert_eq!(reads, 2);

        // The old manifest put back, consented, while the reader looked again: it reads
        // the same bytes as first, and the receipt that goes with them now.
        let file = h.join("m.toml");
        let mut reads = 0;
        let (text, receipt) = read_in_step_with(&dir, || {
            reads += 1;
            if reads == 2 {
                std::fs::write(&file, &old).expect("manifest written");
                install(h, &file, true).expect("put back");
            }
            Ok(old.clone().into_bytes())
        })
        .expect("read");
        assert_eq!(text, old.as_bytes());
        let receipt = receipt.expect("receipt");
        assert!(receipt.consent_for(&sha256_hex(&text)).is_some());
    }

    /// A proxy starting, `check` or a reload reading the manifest as it is installed
    /// again sees one whole file: the old one stays whole for a reader that has it open.
    #[test]
    fn an_install_replaces_its_files_whole() {
        let home = tempfile::tempdir().expect("temp dir");
        let old = manifest_of("acme", "");
        install_text(home.path(), &old).expect("installed");
        let dir = providers_dir(home.path()).join("acme");
        let mut reader = std::fs::File::open(dir.join(MANIFEST_FILE)).expect("open");
        let mut receipt = std::fs::File::open(dir.join(RECEIPT_FILE)).expect("open");
        let new = manifest_of("acme", "[config.fields.region]\n");
        install_text(home.path(), &new).expect("installed again");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut reader, &mut text).expect("read");
        assert_eq!(text, old);
        let mut json = String::new();
        std::io::Read::read_to_string(&mut receipt, &mut json).expect("read");
        assert!(json.contains(&sha256_hex(old.as_bytes())), "{json}");
        let now = std::fs::read_to_string(dir.join(MANIFEST_FILE)).expect("read");
        assert_eq!(now, new);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [RECEIPT_FILE, ".abx-install.lock", MANIFEST_FILE],
            "no file left behind"
        );
    }

    /// A plugin that is not installed is no error here (the caller says E8002); a
    /// manifest that is there but cannot be read is E1006, not taken for an absent one.
    #[test]
    fn an_absent_plugin_is_none_and_an_unreadable_manifest_an_error() {
        let home = tempfile::tempdir().expect("temp dir");
        assert!(matches!(load(home.path(), "acme"), Ok(None)));
        let dir = providers_dir(home.path()).join("acme");
        std::fs::create_dir_all(dir.join(MANIFEST_FILE)).expect("a directory in its place");
        let e = load(home.path(), "acme").expect_err("a directory is no manifest");
        assert_eq!(e.code(), "E1006", "{e}");
    }

    /// Unset fields take the manifest's defaults (a field's own, or `[endpoint]`'s), and
    /// `config list` says so.
    #[test]
    fn unset_fields_take_the_manifests_defaults() {
        let s = resolve(installed(), &RawLayers::default(), None).expect("resolved");
        let region = field(&s, "region");
        assert_eq!(region.value, Some(Value::Plain("eu-1".into())));
        assert_eq!(region.source, Source::Default);
        let base = field(&s, "base_url");
        assert_eq!(
            base.value,
            Some(Value::Plain("https://api.acme.example".into()))
        );
        assert_eq!(base.source, Source::Default);
        let envd = field(&s, "envd_domain");
        assert_eq!(
            envd.value,
            Some(Value::Plain("sandbox.acme.example".into()))
        );
        assert_eq!(envd.source, Source::Default);
        let key = field(&s, "api_key");
        assert_eq!((&key.value, key.source), (&None, Source::Unset));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    /// config.toml may hold a plugin's plain fields; a secret one there is ignored with a
    /// warning, and only that.
    #[test]
    fn only_a_secret_field_in_config_toml_is_warned_about() {
        let mut layers = RawLayers::default();
        layers.toml.insert("acme.region".into(), "eu-2".into());
        let s = resolve(installed(), &layers, None).expect("resolved");
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        assert_eq!(field(&s, "region").value, Some(Value::Plain("eu-2".into())));
        layers
            .toml
            .insert("acme.api_key".into(), "sk-in-toml".into());
        layers.toml.insert("acme.regoin".into(), "eu-3".into());
        // Named as the built-in keys' warnings name it: where `ABX_HOME` put it too.
        layers.toml_path = Some(PathBuf::from("/srv/abx/config.toml"));
        let s = resolve(installed(), &layers, None).expect("resolved");
        assert_eq!(s.warnings.len(), 2, "{:?}", s.warnings);
        assert!(s.warnings[0].contains("[providers.acme] api_key ignored"));
        assert!(s.warnings[1].contains("[providers.acme] regoin ignored"));
        for w in &s.warnings {
            assert!(
                w.starts_with("~/.abx/config.toml (/srv/abx/config.toml): "),
                "{w}"
            );
        }
        assert_eq!(field(&s, "api_key").value, None);
    }
}
