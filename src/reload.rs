//! SIGHUP (SPEC §7): re-read the `.env` files and config.toml with the same flags and swap
//! the credential when it changed. Everything else a reload finds only applies at the next
//! restart, and is logged as such (names, never values).
//!
//! A changed `--sandbox-api-key-file` / `--access-key-secret-file` reloads too, without a
//! signal: Kubernetes updates a mounted Secret's file in place, but nothing in the pod can
//! send the proxy a SIGHUP (the image has no shell, the agent runs as another user).
//!
//! Two rules keep a reload from breaking a proxy that works:
//! - the credential is swapped only while the provider and every host it is sent to stay
//!   the same: the running proxy still routes to the hosts it started with, and a key must
//!   never reach another provider's host (SPEC §3);
//! - a new AK/SK pair replaces the running key only once its first exchange has answered:
//!   until then, and if it fails, the old temporary key keeps serving (SPEC §5).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::signal::unix::Signal;

use crate::cli::SettingsArgs;
use crate::commands;
use crate::credentials::ApiCredential;
use crate::proxy::{Options, Proxy};
use crate::settings::{self, Resolved, Settings, Source};

/// What a reload does with freshly validated settings.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// The credential is unchanged. `restart`: what changed that only a restart applies.
    Keep { restart: Vec<String> },
    /// A new credential for the same provider and hosts.
    Swap { restart: Vec<String> },
    /// The provider or a host it is sent to changed (`moved`): the running credential stays
    /// until a restart, with the hosts it belongs to.
    Refuse { moved: Vec<&'static str> },
}

/// Compares the settings the proxy runs on with the next ones. `changed` names every key
/// whose value or source differs.
pub fn plan(running: &Settings, next: &Settings, changed: &[String]) -> Plan {
    let moved = destination_changes(running, next);
    if !moved.is_empty() {
        return Plan::Refuse { moved };
    }
    let restart = changed
        .iter()
        .filter(|k| !is_credential(next, k))
        .cloned()
        .collect();
    if running.credential == next.credential {
        Plan::Keep { restart }
    } else {
        Plan::Swap { restart }
    }
}

/// The running settings with `next`'s credential: only the credential is swapped, so the
/// settings logged as applying at the next restart (`token_ttl`, `token_refresh_before`)
/// do not come into force with the new key's refresher meanwhile.
fn with_credential_of(running: &Settings, next: &Settings) -> Settings {
    Settings {
        credential: next.credential.clone(),
        plugin: next.plugin.clone(),
        ..running.clone()
    }
}

/// The settings that decide where the credential goes and how it is attached.
fn destination_changes(a: &Settings, b: &Settings) -> Vec<&'static str> {
    let mut moved = Vec::new();
    let mut check = |name, same: bool| {
        if !same {
            moved.push(name);
        }
    };
    check("provider", a.provider == b.provider);
    check("auth", a.auth == b.auth);
    check("region", a.region == b.region);
    check("sandbox_base_url", a.sandbox_base_url == b.sandbox_base_url);
    check("sandbox_domain", a.sandbox_domain == b.sandbox_domain);
    check("sandbox_url", a.sandbox_url == b.sandbox_url);
    check(
        "token_exchange_url",
        a.token_exchange_url == b.token_exchange_url,
    );
    check("token_exchange", a.token_exchange == b.token_exchange);
    moved
}

/// Keys that feed the credential a reload swaps: the built-in ones, or the selected
/// plugin provider's `api_key` field (which may inherit `sandbox_api_key`).
fn is_credential(next: &Settings, key: &str) -> bool {
    settings::is_credential_key(key)
        || next
            .plugin
            .as_ref()
            .is_some_and(|p| key == format!("{}.api_key", p.installed.manifest.id))
}

/// The names of every key whose value or source differs: the built-in table's and the
/// selected plugin provider's fields.
fn changed_names(before: &Resolved, after: &Resolved, a: &Settings, b: &Settings) -> Vec<String> {
    let mut names: Vec<String> = settings::changed_keys(before, after)
        .into_iter()
        .map(str::to_string)
        .collect();
    if let (Some(pa), Some(pb)) = (&a.plugin, &b.plugin) {
        for fb in &pb.fields {
            let same = pa
                .fields
                .iter()
                .any(|fa| fa.key == fb.key && fa.value == fb.value && fa.source == fb.source);
            if !same {
                names.push(fb.key.clone());
            }
        }
    }
    names
}

/// Credential keys a `.env` file changed while the process environment or a flag still
/// decides them. A reload cannot change either, so the key rotated in the file is not the
/// one in use (systemd's `Environment=` beside a rotated `~/.abx/.env`), and "nothing
/// changed" alone would hide it. Each as `key in file (source wins)`.
fn shadowed(before: &Resolved, after: &Resolved) -> Vec<String> {
    let mut found = Vec::new();
    for e in &after.entries {
        if !settings::is_credential_key(e.spec.name)
            || !matches!(e.source, Source::Env | Source::Flag)
        {
            continue;
        }
        let files = [
            (
                Source::DotEnvCwd,
                &before.layers.dotenv_cwd,
                &after.layers.dotenv_cwd,
            ),
            (
                Source::DotEnvHome,
                &before.layers.dotenv_home,
                &after.layers.dotenv_home,
            ),
        ];
        for (file, was, is) in files {
            if was.get(e.spec.env) != is.get(e.spec.env) {
                found.push(format!(
                    "{} in {} ({} wins)",
                    e.spec.name,
                    file.label(),
                    e.source.label()
                ));
            }
        }
    }
    found
}

/// How often the secret files are read. A change reloads once two reads in a row agree,
/// so a file caught half rewritten (`echo key > file` is not atomic) is never swapped in.
const FILE_POLL: Duration = Duration::from_secs(5);

/// The `--*-file` secrets' contents, hashed: a copy of a secret is not kept to compare.
/// `None` for a file that cannot be read now (reported by the reload it triggers).
#[derive(Clone, PartialEq, Eq)]
struct FileSnapshot(Vec<Option<[u8; 32]>>);

impl FileSnapshot {
    fn take(paths: &[PathBuf]) -> Self {
        FileSnapshot(
            paths
                .iter()
                .map(|p| std::fs::read(p).ok().map(|b| Sha256::digest(&b).into()))
                .collect(),
        )
    }
}

/// Watches the secret files: resolves when one has changed and read the same twice.
struct FileWatch {
    paths: Vec<PathBuf>,
    applied: FileSnapshot,
    pending: Option<FileSnapshot>,
}

impl FileWatch {
    fn new(paths: Vec<PathBuf>) -> Self {
        let applied = FileSnapshot::take(&paths);
        FileWatch {
            paths,
            applied,
            pending: None,
        }
    }

    async fn changed(&mut self) {
        if self.paths.is_empty() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(FILE_POLL).await;
            let now = FileSnapshot::take(&self.paths);
            if now == self.applied {
                self.pending = None;
            } else if self.pending.as_ref() == Some(&now) {
                return;
            } else {
                self.pending = Some(now);
            }
        }
    }

    /// What a reload has just read counts as applied, whatever woke it.
    fn reloaded(&mut self) {
        self.applied = FileSnapshot::take(&self.paths);
        self.pending = None;
    }
}

/// Waits for SIGHUPs (and changed secret files) and applies each reload's [`Plan`]. A
/// reload that fails, or that is refused, keeps what runs.
pub async fn on_hangup(
    proxy: Arc<Proxy>,
    mut hangups: Option<Signal>,
    flags: SettingsArgs,
    mut seen: Resolved,
    mut running: Settings,
    options: Options,
) {
    let mut files = FileWatch::new(flags.secret_files().into_iter().map(|(_, p)| p).collect());
    loop {
        let hangup = async {
            match &mut hangups {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            got = hangup => if got.is_none() { return },
            () = files.changed() => tracing::info!("a secret file changed: reloading"),
        }
        files.reloaded();
        let (resolved, next) = match commands::resolve(&flags)
            .and_then(|r| r.validate().map(|s| (r, s)))
        {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e.line(), "reload failed; keeping the running settings");
                continue;
            }
        };
        let changed = changed_names(&seen, &resolved, &running, &next);
        let shadowed = shadowed(&seen, &resolved);
        if !shadowed.is_empty() {
            tracing::warn!(
                keys = %shadowed.join(","),
                "reload: a .env file changed a credential that a higher level still decides; \
                 the file's value is not used (unset the variable or flag and restart)"
            );
        }
        if changed.is_empty() {
            tracing::info!("reload: nothing changed");
            continue;
        }
        let restart = match plan(&running, &next, &changed) {
            Plan::Refuse { moved } => {
                tracing::warn!(
                    keys = %moved.join(","),
                    "reload refused: the provider or its hosts changed; the running credential \
                     stays with the hosts it belongs to until a restart"
                );
                continue;
            }
            Plan::Keep { restart } => {
                tracing::info!(changed = %changed.join(","), "reloaded; the credential is unchanged");
                restart
            }
            Plan::Swap { restart } => {
                let swapped = with_credential_of(&running, &next);
                let credential = match ApiCredential::start(&swapped, &options, &proxy.metrics) {
                    Ok(credential) => credential,
                    Err(e) => {
                        tracing::warn!(error = %e.line(), "reload failed; keeping the running credential");
                        continue;
                    }
                };
                // An AK/SK pair: its first exchange must answer before it replaces a key
                // that works. A static key answers at once.
                if let Err(e) = credential.current().await {
                    tracing::warn!(error = %e.line(), "reload failed; keeping the running credential");
                    continue;
                }
                let expiry = credential.expiry_unix();
                proxy.credential.swap(Arc::new(credential)).retire();
                // The running key's expiry, whatever the replaced refresher reported last
                // (0 for a static key: left at an old temporary key's expiry, the gauge
                // would pass that time and look like a key about to expire).
                proxy
                    .metrics
                    .token_expiry
                    .set(expiry.map_or(0.0, |t| t as f64));
                tracing::info!(changed = %changed.join(","), "reloaded");
                running.credential = next.credential.clone();
                running.plugin = next.plugin.clone();
                restart
            }
        };
        if !restart.is_empty() {
            tracing::warn!(keys = %restart.join(","), "these settings apply at the next restart");
        }
        seen = resolved;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Secret;
    use crate::settings::{Credential, FlagValue, Inputs, Key};

    /// From flags alone: no environment, no files.
    fn settings(pairs: &[(Key, &str)]) -> Settings {
        let empty = tempfile::tempdir().expect("temp dir");
        let flag = |k: Key, v: &str| match k {
            Key::SandboxApiKey | Key::AccessKeySecret => FlagValue::Secret(Secret::new(v)),
            _ => FlagValue::Plain(v.to_string()),
        };
        let inputs = Inputs {
            flags: pairs.iter().map(|(k, v)| (*k, flag(*k, v))).collect(),
            cwd: empty.path().to_path_buf(),
            ..Inputs::default()
        };
        Resolved::from_inputs(&inputs)
            .and_then(|r| r.validate())
            .unwrap_or_else(|e| panic!("settings: {}", e.line()))
    }

    fn names(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    /// A file caught half rewritten is never swapped in: a change counts once two reads
    /// in a row agree.
    #[tokio::test(start_paused = true)]
    async fn a_secret_file_change_counts_once_two_reads_agree() {
        use tokio::time::timeout;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-one").expect("write");
        let mut watch = FileWatch::new(vec![path.clone()]);
        let poll = FILE_POLL + Duration::from_millis(1);
        assert!(
            timeout(poll * 10, watch.changed()).await.is_err(),
            "unchanged"
        );
        std::fs::write(&path, "sk-tw").expect("half written");
        assert!(timeout(poll, watch.changed()).await.is_err(), "one read");
        std::fs::write(&path, "sk-two").expect("written");
        assert!(
            timeout(poll, watch.changed()).await.is_err(),
            "reads differ"
        );
        assert!(
            timeout(poll, watch.changed()).await.is_ok(),
            "two reads agree"
        );
        watch.reloaded();
        assert!(
            timeout(poll * 10, watch.changed()).await.is_err(),
            "applied"
        );
        assert!(
            timeout(poll * 10, FileWatch::new(vec![]).changed())
                .await
                .is_err(),
            "no file, no wake"
        );
    }

    #[test]
    fn a_new_key_for_the_same_hosts_is_swapped() {
        let a = settings(&[(Key::SandboxApiKey, "sk-one")]);
        let b = settings(&[(Key::SandboxApiKey, "sk-two")]);
        assert_eq!(
            plan(&a, &b, &names(&["sandbox_api_key"])),
            Plan::Swap { restart: vec![] }
        );
        let c = settings(&[(Key::SandboxApiKey, "sk-two"), (Key::Listen, "127.0.0.1:1")]);
        assert_eq!(
            plan(&a, &c, &names(&["sandbox_api_key", "listen"])),
            Plan::Swap {
                restart: names(&["listen"])
            }
        );
    }

    #[test]
    fn an_unchanged_credential_is_kept_and_the_rest_waits_for_a_restart() {
        let a = settings(&[(Key::AccessKeyId, "LTAI-id"), (Key::AccessKeySecret, "s")]);
        let b = settings(&[
            (Key::AccessKeyId, "LTAI-id"),
            (Key::AccessKeySecret, "s"),
            (Key::TokenTtl, "600"),
        ]);
        assert!(matches!(a.credential, Credential::AccessKey { .. }));
        assert_eq!(
            plan(&a, &b, &names(&["token_ttl"])),
            Plan::Keep {
                restart: names(&["token_ttl"])
            }
        );
    }

    /// A new AK/SK pair with a new `token_ttl` in the same reload: the pair is swapped, the
    /// TTL (logged as applying at the next restart) is not, for the new refresher either.
    #[test]
    fn a_swap_takes_the_credential_only() {
        let a = settings(&[(Key::AccessKeyId, "LTAI-one"), (Key::AccessKeySecret, "s1")]);
        let b = settings(&[
            (Key::AccessKeyId, "LTAI-two"),
            (Key::AccessKeySecret, "s2"),
            (Key::TokenTtl, "600"),
            (Key::TokenRefreshBefore, "60"),
        ]);
        let changed = names(&["access_key_id", "access_key_secret", "token_ttl"]);
        assert!(matches!(plan(&a, &b, &changed), Plan::Swap { .. }));
        let swapped = with_credential_of(&a, &b);
        assert_eq!(swapped.credential, b.credential);
        assert_eq!(swapped.token_ttl, a.token_ttl);
        assert_eq!(swapped.token_refresh_before, a.token_refresh_before);
        assert_ne!(a.token_ttl, b.token_ttl);
    }

    #[test]
    fn a_key_is_never_swapped_towards_other_hosts() {
        let a = settings(&[(Key::SandboxApiKey, "sk-one")]);
        for (key, value, name) in [
            (Key::Region, "cn-shanghai", "region"),
            (
                Key::SandboxBaseUrl,
                "https://elsewhere.example",
                "sandbox_base_url",
            ),
            (Key::SandboxDomain, "elsewhere.example", "sandbox_domain"),
            (Key::SandboxUrl, "https://elsewhere.example", "sandbox_url"),
        ] {
            let b = settings(&[(Key::SandboxApiKey, "sk-two"), (key, value)]);
            match plan(&a, &b, &names(&["sandbox_api_key", name])) {
                Plan::Refuse { moved } => assert!(moved.contains(&name), "{name}: {moved:?}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        let mut other_provider = settings(&[(Key::SandboxApiKey, "sk-two")]);
        other_provider.provider = "opensandbox".into();
        other_provider.credential = Credential::ApiKey(Secret::new("sk-two"));
        assert_eq!(
            plan(
                &a,
                &other_provider,
                &names(&["provider", "sandbox_api_key"])
            ),
            Plan::Refuse {
                moved: vec!["provider"]
            }
        );
    }
}
