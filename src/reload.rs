//! SIGHUP (SPEC §7): re-read the `.env` files and config.toml with the same flags and swap
//! the credential when it changed. Everything else a reload finds only applies at the next
//! restart, and is logged as such (names, never values).
//!
//! A changed `--sandbox-api-key-file` / `--access-key-secret-file` reloads too, without a
//! signal: Kubernetes updates a mounted Secret's file in place, but nothing in the pod can
//! send the proxy a SIGHUP (the image has no shell, the agent runs as another user).
//!
//! The listener's `--tls-cert` / `--tls-key` are re-read by the same signal and the same
//! file watch (cert-manager renews them in place), apart from the settings: a pair that is
//! not valid as a whole keeps the one in use (see [`crate::proxy::certs`]), and the
//! settings' outcome does not depend on it.
//!
//! Two rules keep a reload from breaking a proxy that works:
//! - the credential is swapped only while the provider, how it attaches the key and every
//!   host in use stay the same, and, for a new AK/SK pair, its exchange (URL, signing
//!   style, region): the running proxy still routes, and exchanges, as it started, and a
//!   key must never reach another provider's host (SPEC §3; [`destination_changes`]);
//! - a new AK/SK pair replaces the running key only once its first exchange has answered:
//!   until then, and if it fails, the old temporary key keeps serving (SPEC §5).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio::signal::unix::Signal;
use tokio::time::Instant;

use crate::cli::SettingsArgs;
use crate::commands;
use crate::credentials::ApiCredential;
use crate::error::Error;
use crate::logging;
use crate::proxy::certs::{read_files, ListenerCert, Reloaded};
use crate::proxy::{Options, Proxy};
use crate::reader::Reader;
use crate::settings::{self, Change, Resolved, Settings, Source};

/// What a reload does with freshly validated settings.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// The credential is unchanged. `restart`: what changed that only a restart applies.
    Keep { restart: Vec<String> },
    /// A new credential for the same provider and hosts.
    Swap { restart: Vec<String> },
    /// The provider, a host it is sent to or the key exchange changed (`moved`): the
    /// running credential stays until a restart, with the hosts it belongs to.
    Refuse { moved: Vec<String> },
}

/// Compares the settings the proxy runs on with the next ones. `changed` names every
/// key, built-in or a plugin's field, whose value differs from what the proxy started
/// with (what a restart would change).
pub fn plan(running: &Settings, next: &Settings, changed: &[String]) -> Plan {
    let moved = destination_changes(running, next);
    if !moved.is_empty() {
        return Plan::Refuse { moved };
    }
    let restart = changed
        .iter()
        .filter(|k| !is_credential(next, k) && !same_in_use(running, next, k))
        .cloned()
        .collect();
    if running.credential == next.credential {
        Plan::Keep { restart }
    } else {
        Plan::Swap { restart }
    }
}

/// A key whose text changed and whose value as the proxy uses it did not: a URL respelt
/// (`http://h:1/`, `HTTP://h:1`), an address written anew. A restart would change
/// nothing, and "applies at the next restart" said one was owed.
fn same_in_use(running: &Settings, next: &Settings, key: &str) -> bool {
    match key {
        "sandbox_base_url" => running.sandbox_base_url == next.sandbox_base_url,
        "sandbox_url" => running.sandbox_url == next.sandbox_url,
        "token_exchange_url" => running.token_exchange_url == next.token_exchange_url,
        "listen" => running.listen == next.listen,
        "admin_listen" => running.admin_listen == next.admin_listen,
        // A plugin provider's own fields land in the same settings (see
        // `destination_changes`).
        k if k.ends_with(".base_url") => running.sandbox_base_url == next.sandbox_base_url,
        k if k.ends_with(".envd_domain") => running.sandbox_domain == next.sandbox_domain,
        _ => false,
    }
}

/// The running settings with `next`'s credential: only the credential is swapped, so the
/// settings logged as applying at the next restart (`token_ttl`, `token_refresh_before`)
/// do not come into force with the new key's refresher meanwhile.
fn with_credential_of(running: &Settings, next: &Settings) -> Settings {
    Settings {
        credential: next.credential.clone(),
        plugin: next.plugin.clone(),
        secrets: next.secrets.clone(),
        ..running.clone()
    }
}

/// The plugin provider both settings select, if they select the same one: the built-in
/// provider's own keys (its region, hosts and exchange) then decide nothing.
fn same_plugin<'a>(a: &'a Settings, b: &Settings) -> Option<&'a str> {
    match (&a.plugin, &b.plugin) {
        (Some(pa), Some(pb)) if pa.installed.manifest.id == pb.installed.manifest.id => {
            Some(&pa.installed.manifest.id)
        }
        _ => None,
    }
}

/// The settings that decide where the credential goes and how it is attached, by the
/// names `config list` gives them.
fn destination_changes(a: &Settings, b: &Settings) -> Vec<String> {
    let mut moved = Vec::new();
    let mut check = |name: &str, same: bool| {
        if !same {
            moved.push(name.to_string());
        }
    };
    check("provider", a.provider == b.provider);
    check("auth", a.auth == b.auth);
    if let Some(id) = same_plugin(a, b) {
        // A plugin's key goes to its own fields' hosts (kept in the same settings).
        check(
            &format!("{id}.base_url"),
            a.sandbox_base_url == b.sandbox_base_url,
        );
        check(
            &format!("{id}.envd_domain"),
            a.sandbox_domain == b.sandbox_domain,
        );
        return moved;
    }
    // Where requests go as the proxy uses them: a value nothing reads (a domain beside
    // `sandbox_url`, the exchange's settings when no pair will be exchanged, the region
    // once every host is set) moved no key, and refusing for it kept a rotated key out
    // until a restart. The exchange counts only for a new pair: one swapped in is made
    // with the running settings, its exchange's among them; a pair kept goes on as it
    // started, and a static key exchanges nothing (the new values wait for a restart).
    let exchanging = a.credential != b.credential
        && matches!(b.credential, settings::Credential::AccessKey { .. });
    let base_moved = a.sandbox_base_url != b.sandbox_base_url;
    let url_moved = a.sandbox_url != b.sandbox_url;
    let domain_read = a.sandbox_url.is_none() || b.sandbox_url.is_none();
    let domain_moved = domain_read && a.sandbox_domain != b.sandbox_domain;
    // The region is named where it counts: it signs a pair's exchange (`RegionId`), and
    // it is what the user changed when a host that moved is its default.
    let follows_region = |key: settings::Key, value: Option<String>| {
        value.is_some() && key.default_value(&b.region) == value
    };
    let region_moved = a.region != b.region
        && (exchanging
            || (base_moved
                && follows_region(
                    settings::Key::SandboxBaseUrl,
                    Some(b.sandbox_base_url.to_string()),
                ))
            || (domain_moved
                && follows_region(settings::Key::SandboxDomain, b.sandbox_domain.clone())));
    check("region", !region_moved);
    check("sandbox_base_url", !base_moved);
    check("sandbox_domain", !domain_moved);
    check("sandbox_url", !url_moved);
    if exchanging {
        check(
            "token_exchange_url",
            a.token_exchange_url == b.token_exchange_url,
        );
        check("token_exchange", a.token_exchange == b.token_exchange);
    }
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

/// The names of every key that changed (see [`Change`]):
/// the built-in table's (less the built-in provider's own while a plugin provider stays
/// selected: they apply at no restart either) and the selected plugin provider's fields;
/// `auth` when an edited manifest attaches the key otherwise.
fn changed_names(
    before: &Resolved,
    after: &Resolved,
    a: &Settings,
    b: &Settings,
    change: Change,
) -> Vec<String> {
    let plugin = same_plugin(a, b).is_some();
    let with_source = change == Change::ValueOrSource;
    let mut names: Vec<String> = settings::changed_keys(before, after, change)
        .into_iter()
        .filter(|k| !(plugin && settings::Key::by_name(k).is_some_and(|k| k.builtin_only())))
        .map(str::to_string)
        .collect();
    if a.auth != b.auth {
        names.push("auth".to_string());
    }
    if let (Some(pa), Some(pb)) = (&a.plugin, &b.plugin) {
        for fb in &pb.fields {
            let same = pa.fields.iter().any(|fa| {
                fa.key == fb.key && fa.value == fb.value && (!with_source || fa.source == fb.source)
            });
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
/// changed" alone would hide it. Each as `key in file (source wins)`; the selected plugin
/// provider's key too, by its variables (canonical name and aliases).
fn shadowed(before: &Resolved, after: &Resolved, next: &Settings) -> Vec<String> {
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
    let mut found = Vec::new();
    let plugin_key = next.plugin.as_ref().and_then(|p| {
        let m = &p.installed.manifest;
        let field = p.fields.iter().find(|f| f.field == "api_key")?;
        let aliases = m.fields.get("api_key").map(|f| f.aliases.clone());
        let names: Vec<String> = std::iter::once(m.canonical_env("api_key"))
            .chain(aliases.unwrap_or_default())
            .collect();
        Some((field, names))
    });
    if let Some((field, names)) = plugin_key {
        // Decided by one of its own variables: one inherited (`ABX_SANDBOX_API_KEY`) gives
        // way to the plugin's own in a file, which the reload then applies.
        let own = names.contains(&field.env);
        if own && matches!(field.source, Source::Env | Source::Flag) {
            for (file, was, is) in &files {
                if names.iter().any(|n| was.get(n) != is.get(n)) {
                    found.push(format!(
                        "{} in {} ({} wins)",
                        field.key,
                        after.file_shown(*file),
                        field.source.label()
                    ));
                }
            }
        }
    }
    for e in &after.entries {
        if !settings::is_credential_key(e.spec.name)
            || !matches!(e.source, Source::Env | Source::Flag)
        {
            continue;
        }
        for (file, was, is) in &files {
            if was.get(e.spec.env) != is.get(e.spec.env) {
                found.push(format!(
                    "{} in {} ({} wins)",
                    e.spec.name,
                    after.file_shown(*file),
                    e.source.label()
                ));
            }
        }
    }
    found
}

/// How often the watched files are read. A change reloads once two reads in a row agree,
/// so a file caught half rewritten (`echo key > file` is not atomic) is never swapped in.
const FILE_POLL: Duration = Duration::from_secs(5);

/// The first wait before a changed secret file whose reload failed is tried again; it
/// doubles with each failure, to [`RETRY_MAX`]. A new AccessKey pair whose first exchange
/// met a passing 5xx, or a key rotated while `~/.abx/.env` was being edited, would
/// otherwise wait for the next rotation: nothing else reloads a pod's proxy.
const RETRY_FIRST: Duration = Duration::from_secs(5);
/// At most this between two tries (a wrong new pair is an exchange call each time).
const RETRY_MAX: Duration = Duration::from_secs(300);

/// What the watch saw of each watched file (the `--*-file` secrets, the listener's pair).
#[derive(Clone, PartialEq, Eq)]
struct FileSnapshot(Vec<Seen>);

/// What the watch saw of one file.
#[derive(Clone, PartialEq, Eq)]
enum Seen {
    /// Cannot be read now (reported by the reload it triggers).
    Unreadable,
    /// Not a regular file: a pipe (`<(…)`, `/dev/stdin`) or a device, read once by the
    /// start. Reading it here would take what the start reads (the key came up empty),
    /// and nothing rewrites it in place.
    NotAFile,
    /// A regular file's contents, hashed: a copy of a secret is not kept to compare.
    Contents([u8; 32]),
}

impl FileSnapshot {
    fn take(paths: &[PathBuf]) -> Self {
        FileSnapshot(paths.iter().map(|p| Seen::now(p)).collect())
    }

    /// [`FileSnapshot::take`] on the reading thread (see [`Reader`]). `None` when it could
    /// not read. Nothing watched, nothing to read: nothing asked of it.
    async fn take_apart(reader: &Reader, paths: &[PathBuf]) -> Option<Self> {
        if paths.is_empty() {
            return Some(FileSnapshot(Vec::new()));
        }
        let paths = paths.to_vec();
        reader
            .run("the watched files", move || FileSnapshot::take(&paths))
            .await
            .ok()
    }
}

impl Seen {
    fn now(path: &Path) -> Seen {
        // What is no regular file is not opened at all: see `open_if_regular`.
        match crate::watched::open_if_regular(path) {
            Ok(Ok(file)) => Seen::hash(file).map_or(Seen::Unreadable, Seen::Contents),
            Ok(Err(_)) => Seen::NotAFile,
            Err(_) => Seen::Unreadable,
        }
    }

    /// Hashed as it is read, a buffer at a time, to one byte past what a reload reads (see
    /// [`crate::watched`]), with the length: a file past that is refused whatever it holds.
    fn hash(file: std::fs::File) -> std::io::Result<[u8; 32]> {
        use std::io::Read;
        let mut hasher = Sha256::new();
        hasher.update(file.metadata()?.len().to_be_bytes());
        std::io::copy(&mut file.take(crate::watched::MAX_LEN + 1), &mut hasher)?;
        Ok(hasher.finalize().into())
    }
}

/// Why the watched files ask for a reload.
#[derive(Debug, PartialEq, Eq)]
enum FileEvent {
    Changed,
    /// Unchanged since a reload of them failed: another try.
    Retry,
    /// Back to what runs after a reload of other contents failed: a reload says whether
    /// all now holds (the failure stays on the metrics until one succeeds).
    Restored,
}

/// Watches the secret files and the listener's pair: resolves when one has changed and
/// read the same twice, or when a change whose reload failed is due another try.
pub struct FileWatch {
    paths: Vec<PathBuf>,
    reader: Reader,
    /// The contents the running credential was read from.
    applied: FileSnapshot,
    /// A change read once, waiting for a second read to agree.
    pending: Option<FileSnapshot>,
    /// Contents a reload failed to apply, and when to try them again.
    failed: Option<(FileSnapshot, Instant)>,
    retry_in: Duration,
}

impl FileWatch {
    /// Taken before the settings are first read, so that a rotation while the proxy
    /// starts is seen as a change.
    pub fn new(paths: Vec<PathBuf>, reader: Reader) -> Self {
        let applied = FileSnapshot::take(&paths);
        FileWatch {
            paths,
            reader,
            applied,
            pending: None,
            failed: None,
            retry_in: RETRY_FIRST,
        }
    }

    async fn changed(&mut self) -> FileEvent {
        if self.paths.is_empty() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(FILE_POLL).await;
            let Some(now) = FileSnapshot::take_apart(&self.reader, &self.paths).await else {
                continue;
            };
            if now == self.applied {
                // Back to what runs: nothing to apply, nothing to retry.
                self.pending = None;
                self.retry_in = RETRY_FIRST;
                if self.failed.take().is_some() {
                    return FileEvent::Restored;
                }
            } else if let Some((_, due)) = self.failed.as_ref().filter(|(f, _)| *f == now) {
                if Instant::now() >= *due {
                    return FileEvent::Retry;
                }
            } else if self.pending.as_ref() == Some(&now) {
                return FileEvent::Changed;
            } else {
                self.pending = Some(now);
            }
        }
    }

    /// What a reload is about to read, whatever woke it.
    async fn reading(&mut self) -> FileSnapshot {
        self.pending = None;
        match FileSnapshot::take_apart(&self.reader, &self.paths).await {
            Some(read) => read,
            None => FileSnapshot::take(&self.paths),
        }
    }

    /// The reload of `read` took effect.
    fn applied(&mut self, read: FileSnapshot) {
        self.applied = read;
        self.failed = None;
        self.retry_in = RETRY_FIRST;
    }

    /// The reload of `read` did not take effect: if the files differ from what runs, they
    /// are tried again later. (A SIGHUP's failure with the files unchanged is the
    /// operator's to retry.)
    fn failed(&mut self, read: FileSnapshot) {
        if read == self.applied {
            return;
        }
        self.failed = Some((read, Instant::now() + self.retry_in));
        self.retry_in = (self.retry_in * 2).min(RETRY_MAX);
    }
}

/// What a running proxy reloads, and what it runs on.
pub struct Running {
    pub proxy: Arc<Proxy>,
    pub flags: SettingsArgs,
    pub options: Options,
    /// The settings of the last reload that took effect, or of the start (with sources),
    /// to name what the next reload changes; a plugin's fields from `seen_settings`.
    pub seen: Resolved,
    pub seen_settings: Settings,
    /// The settings as read at the start, which the proxy runs on (its credential aside):
    /// what a restart would change is measured from them, a plugin's fields included, not
    /// from the last reload nor from `settings` (which a key swap brings up to date).
    pub started: Resolved,
    pub started_settings: Settings,
    /// What runs: the start's settings, with the credential of the last swap.
    pub settings: Settings,
    /// The listener's pair, when it serves TLS.
    pub tls: Option<ListenerCert>,
    /// The upstream trust store built at the start, for a new pair's exchange client.
    pub trust: rustls::ClientConfig,
    /// The settings warnings last said, at the start or by a reload: a reload says only
    /// those it finds anew. Said again at every reload (a key file rotated each hour,
    /// every SIGHUP), a `.env` file's mode or a misspelt name was noise.
    pub warned: Vec<String>,
}

/// The settings read at the start, the warnings said of them, and the credential they
/// give, in words.
pub struct Started {
    pub resolved: Resolved,
    pub warned: Vec<String>,
    pub credential: String,
}

impl Running {
    /// What runs at the start: every baseline a reload measures from is the start's.
    pub fn at_start(
        proxy: Arc<Proxy>,
        flags: SettingsArgs,
        options: Options,
        started: Started,
        settings: &Settings,
        tls: Option<ListenerCert>,
        trust: rustls::ClientConfig,
    ) -> Self {
        let Started {
            resolved, warned, ..
        } = started;
        Running {
            proxy,
            flags,
            options,
            started: resolved.clone(),
            started_settings: settings.clone(),
            seen: resolved,
            seen_settings: settings.clone(),
            settings: settings.clone(),
            tls,
            trust,
            warned,
        }
    }
}

/// Waits for SIGHUPs (and changed watched files), re-reads the listener's pair and applies
/// each settings reload's [`Plan`]. A reload that fails, or that is refused, keeps what runs.
pub async fn on_hangup(mut running: Running, mut hangups: Option<Signal>, mut files: FileWatch) {
    loop {
        let hangup = async {
            match &mut hangups {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        // Draining, the watch stops: a changed file would be said, and skipped, every poll.
        let watched = async {
            match running.proxy.draining() {
                true => std::future::pending().await,
                false => files.changed().await,
            }
        };
        // The listener certificate's coming end, said in the log as it nears and passes.
        let look = running
            .tls
            .as_ref()
            .and_then(|tls| tls.next_look(SystemTime::now()));
        let expiring = async {
            match look {
                Some(wait) => tokio::time::sleep(wait).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            got = hangup => if got.is_none() { return },
            () = expiring => {
                if let Some(line) = running.tls.as_mut().and_then(|tls| tls.due(SystemTime::now())) {
                    tracing::warn!("{line}");
                }
                continue;
            }
            event = watched => match event {
                FileEvent::Changed => tracing::info!("a watched file changed: reloading"),
                FileEvent::Retry => tracing::info!("a changed watched file: trying its reload again"),
                FileEvent::Restored => tracing::info!("watched files are back to their last applied contents: reloading"),
            },
        }
        // The process is on its way out: a new pair's trial exchange would mint a key no
        // one uses (keys are never deleted), and the next start reads the files anyway.
        if running.proxy.draining() {
            tracing::info!("reload skipped: the proxy is draining");
            continue;
        }
        let read = files.reading().await;
        // On the thread the watch reads on. A drain that begins meanwhile (after a slow
        // read, or with a new pair's first exchange still out) stops it: the process is on
        // its way out, and a dropped exchange may yet mint no key. The credential's swap
        // comes after the last wait; the listener's pair, read first, may be in place.
        let proxy = running.proxy.clone();
        let applied = tokio::select! {
            // The drain first, when both are ready.
            biased;
            () = proxy.drain_begun() => {
                tracing::info!("reload stopped: the proxy is draining");
                continue;
            }
            applied = running.reload(&files.reader) => applied,
        };
        // A rotated key or certificate that does not take effect is only a warning line
        // otherwise: the old one keeps serving, /readyz stays 200, until it is revoked.
        let metrics = &running.proxy.metrics;
        let result = if applied { "success" } else { "failure" };
        metrics.reloads.with_label_values(&[result]).inc();
        metrics.last_reload_successful.set(i64::from(applied));
        if applied {
            files.applied(read);
        } else {
            files.failed(read);
        }
    }
}

impl Running {
    /// One reload; `false` when what was read did not take effect (failed or refused).
    async fn reload(&mut self, reader: &Reader) -> bool {
        // Both, whatever the other's outcome: a broken `.env` must not hold back a renewed
        // certificate, nor a half-rotated pair a new key.
        let tls = self.reload_tls(reader).await;
        let settings = self.reload_settings(reader).await;
        tls && settings
    }

    /// The listener's pair; `false` when a new one was read and not applied.
    async fn reload_tls(&mut self, reader: &Reader) -> bool {
        let Some(tls) = &mut self.tls else {
            return true;
        };
        let (cert, key) = tls.paths();
        let (cert, key) = (cert.to_path_buf(), key.to_path_buf());
        let read = match reader
            .run("the listener's certificate and key", move || {
                read_files(&cert, &key)
            })
            .await
        {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "listener certificate reload failed: its files could not be read; the \
                     one in use keeps serving"
                );
                return false;
            }
        };
        match tls.apply(read) {
            Ok(Reloaded::Unchanged) => true,
            Ok(Reloaded::Swapped) => {
                let (cert, key) = tls.paths();
                tracing::info!(
                    cert = %crate::providers::manifest::printable(&cert.to_string_lossy()),
                    key = %crate::providers::manifest::printable(&key.to_string_lossy()),
                    "listener certificate reloaded; new connections get it"
                );
                self.proxy.metrics.listener_cert_swapped(tls.expires());
                if let Some(w) = tls.validity_warning(std::time::SystemTime::now()) {
                    tracing::warn!("{w}");
                }
                true
            }
            Err(e) => {
                tracing::warn!(
                    error = %e.line(),
                    "listener certificate reload failed; the one in use keeps serving"
                );
                false
            }
        }
    }

    async fn reload_settings(&mut self, reader: &Reader) -> bool {
        let failed = |e: Error| {
            tracing::warn!(error = %e.line(), "reload failed; keeping the running settings");
            false
        };
        // Read on the reading thread: this one also accepts connections and answers the
        // probes, which a slow read (a stalled network mount) would leave unanswered. The
        // validation and the selection's warnings too: each reads a plugin's manifest and
        // receipt again, and lists the installed ones.
        let flags = self.flags.clone();
        let options = self.options.clone();
        let seen_listen = self.seen_settings.listen.clone();
        let read = reader.run("the settings", move || {
            let (resolved, mut warnings) = commands::resolve_unsaid(&flags)?;
            // What the next start would refuse, as `check` and `serve` refuse it: a
            // `listen` beyond loopback without TLS or consent was said to apply at the
            // restart, which then exited 78.
            let next = (resolved.validate())
                .and_then(|next| options.refuse_exposure(&next.listen).map(|()| next));
            // And what it would warn of (a TLS listener moved beyond loopback), once: said
            // again at every reload (a key rotated each hour), it was noise.
            if let Some(next) = next.as_ref().ok().filter(|n| n.listen != seen_listen) {
                warnings.extend(options.exposure_warning(&next.listen));
            }
            let selection = resolved.selection_warnings();
            // Where the key would come from, for the line of a reload that swaps it: a
            // `./.env` deleted (a release directory removed) lets a lower layer's key
            // through, as SPEC §2 orders them, and a forgotten `~/.abx/.env` one went into
            // service said as a changed key alone. Here: a plugin's is found by reading
            // its manifest.
            let from = commands::credential_said(&resolved);
            Ok::<_, Error>((resolved, warnings, next, selection, from))
        });
        let (resolved, warnings, next, selection, from) = match read.await {
            Ok(Ok(read)) => read,
            Ok(Err(e)) => return failed(e),
            Err(e) => {
                tracing::warn!(error = %e, "reload failed: the settings could not be read; keeping the running settings");
                return false;
            }
        };
        // A reload that fails or is refused changes neither the provider nor a host: a
        // warning that the credential goes to a host set in a `.env`, or that a plugin is
        // selected, would be untrue. The others stand (a misspelt name, an unset `${VAR}`
        // may be why it failed or a host moved). Said once the outcome is known, before
        // its line: a new pair's first exchange can still fail the reload.
        let mut say = |applies: bool| {
            let untrue = if applies { &[][..] } else { &selection[..] };
            let standing: Vec<String> = (warnings.iter())
                .filter(|w| !untrue.contains(w))
                .cloned()
                .collect();
            let new: Vec<String> = (standing.into_iter())
                .filter(|w| !self.warned.contains(w))
                .collect();
            new.iter().for_each(|w| logging::warning(w));
            // What runs changes only when the reload applies: until then, what was said of
            // it still stands (a refused read's host, gone again, was said anew).
            if applies {
                self.warned.retain(|w| warnings.contains(w));
            }
            self.warned.extend(new);
        };
        let next = match next {
            Ok(next) => next,
            Err(e) => {
                say(false);
                return failed(e);
            }
        };
        let changed = changed_names(
            &self.seen,
            &resolved,
            &self.seen_settings,
            &next,
            Change::ValueOrSource,
        );
        let shadowed = shadowed(&self.seen, &resolved, &next);
        if !shadowed.is_empty() {
            // The files' paths are in it: a directory's name may hold a newline.
            tracing::warn!(
                keys = %crate::providers::manifest::printable(&shadowed.join(",")),
                "reload: a .env file changed a credential that a higher level still decides; \
                 the file's value is not used (unset the variable or flag and restart)"
            );
        }
        if changed.is_empty() {
            say(true);
            // "Settings": a certificate this reload swapped is said on its own line before.
            tracing::info!("reload: no setting changed");
            // What was read is what runs: a key shadowed in a file is said once, not again
            // at every later reload until some other change is applied.
            self.seen = resolved;
            self.seen_settings = next;
            return true;
        }
        // By value: a restart on the same value from another file changes nothing.
        let pending = changed_names(
            &self.started,
            &resolved,
            &self.started_settings,
            &next,
            Change::Value,
        );
        let restart = match plan(&self.settings, &next, &pending) {
            Plan::Refuse { moved } => {
                say(false);
                tracing::warn!(
                    keys = %moved.join(","),
                    "reload refused: the provider, its hosts or its key exchange changed; the \
                     running credential stays with the hosts it belongs to until a restart"
                );
                return false;
            }
            Plan::Keep { restart } => {
                say(true);
                tracing::info!(changed = %changed.join(","), "reloaded; the credential is unchanged");
                restart
            }
            Plan::Swap { restart } => {
                let swapped = with_credential_of(&self.settings, &next);
                let metrics = &self.proxy.metrics;
                let mut kept = |e: Error| {
                    say(false);
                    tracing::warn!(error = %e.line(), "reload failed; keeping the running credential");
                    false
                };
                let (credential, counted) =
                    match ApiCredential::trial(&swapped, &self.options, &self.trust, metrics) {
                        Ok(trial) => trial,
                        Err(e) => return kept(e),
                    };
                // An AK/SK pair: its first exchange must answer before it replaces a key
                // that works. A static key answers at once. Dropped when it fails (its
                // refresher said so as the new credential's): a file watch tries the
                // reload again, a SIGHUP is needed otherwise.
                if let Err(e) = credential.current().await {
                    say(false);
                    tracing::warn!(
                        error = %e.line(),
                        "reload failed: the new credential's first token exchange failed; \
                         keeping the running credential"
                    );
                    return false;
                }
                say(true);
                let expiry = credential.expiry_unix();
                self.proxy.credential.swap(Arc::new(credential)).retire();
                counted.from_now();
                if expiry.is_some() {
                    // The trial's exchange, which answered: the running credential's first.
                    metrics
                        .token_exchanges
                        .with_label_values(&["success"])
                        .inc();
                }
                // The running key's expiry, whatever the replaced refresher reported last
                // (0 for a static key: left at an old temporary key's expiry, the gauge
                // would pass that time and look like a key about to expire).
                metrics.token_expiry.set(expiry.map_or(0.0, |t| t as f64));
                tracing::info!(
                    changed = %changed.join(","),
                    credential = %crate::providers::manifest::printable(&from),
                    "reloaded"
                );
                self.settings.credential = next.credential.clone();
                self.settings.plugin = next.plugin.clone();
                self.settings.secrets = next.secrets.clone();
                restart
            }
        };
        if !restart.is_empty() {
            tracing::warn!(keys = %restart.join(","), "these settings apply at the next restart");
        }
        self.seen = resolved;
        self.seen_settings = next;
        true
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

    /// What a reload from `a` to `b` is refused for (what else changed plays no part).
    fn refused_for(a: &Settings, b: &Settings) -> Vec<String> {
        match plan(a, b, &[]) {
            Plan::Refuse { moved } => moved,
            other => panic!("not refused: {other:?}"),
        }
    }

    /// A key file holding `sk-one`, watched.
    fn watched_key_file() -> (tempfile::TempDir, PathBuf, FileWatch) {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-one").expect("write");
        let watch = FileWatch::new(vec![path.clone()], Reader::inline());
        (dir, path, watch)
    }

    /// A pipe or a device is never read by the watch: what it takes, the start lacks.
    #[test]
    fn only_regular_files_are_read_by_the_watch() {
        assert!(Seen::now(Path::new("/dev/null")) == Seen::NotAFile);
        assert!(Seen::now(Path::new("/nonexistent/abx-key")) == Seen::Unreadable);
        let (_dir, path, _watch) = watched_key_file();
        let mut sk_one = Sha256::new();
        sk_one.update(6u64.to_be_bytes());
        sk_one.update(b"sk-one");
        assert!(Seen::now(&path) == Seen::Contents(sk_one.finalize().into()));
    }

    /// A file caught half rewritten is never swapped in: a change counts once two reads
    /// in a row agree.
    #[tokio::test(start_paused = true)]
    async fn a_secret_file_change_counts_once_two_reads_agree() {
        use tokio::time::timeout;
        let (_dir, path, mut watch) = watched_key_file();
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
        let read = watch.reading().await;
        watch.applied(read);
        assert!(
            timeout(poll * 10, watch.changed()).await.is_err(),
            "applied"
        );
        assert!(
            timeout(
                poll * 10,
                FileWatch::new(vec![], Reader::inline()).changed()
            )
            .await
            .is_err(),
            "no file, no wake"
        );
    }

    /// A change whose reload failed (a broken `.env` beside it, a new pair's first
    /// exchange meeting a 5xx) is tried again, later each time, until it takes effect or
    /// the file changes back; nothing else would apply it before the next rotation.
    #[tokio::test(start_paused = true)]
    async fn a_secret_file_change_that_failed_to_apply_is_tried_again() {
        use tokio::time::timeout;
        let (_dir, path, mut watch) = watched_key_file();
        std::fs::write(&path, "sk-two").expect("rotate");
        let event = timeout(FILE_POLL * 3, watch.changed()).await;
        assert_eq!(event.ok(), Some(FileEvent::Changed));

        // Each failure waits longer before the next try: 5 s, 10 s, 20 s, …
        for retry_in in [RETRY_FIRST, RETRY_FIRST * 2, RETRY_FIRST * 4] {
            let read = watch.reading().await;
            watch.failed(read);
            let started = Instant::now();
            let event = timeout(retry_in + FILE_POLL * 2, watch.changed()).await;
            assert_eq!(event.ok(), Some(FileEvent::Retry), "after {retry_in:?}");
            assert!(started.elapsed() >= retry_in, "{:?}", started.elapsed());
        }
        let read = watch.reading().await;
        watch.failed(read);
        let started = Instant::now();
        for _ in 0..8 {
            let read = watch.reading().await;
            watch.failed(read);
        }
        let event = timeout(RETRY_MAX + FILE_POLL * 2, watch.changed()).await;
        assert_eq!(event.ok(), Some(FileEvent::Retry), "at most {RETRY_MAX:?}");
        assert!(started.elapsed() <= RETRY_MAX + FILE_POLL);

        // Applied at last: no more tries, and the next failure starts from the first wait.
        let read = watch.reading().await;
        watch.applied(read);
        assert!(timeout(RETRY_MAX * 2, watch.changed()).await.is_err());
        std::fs::write(&path, "sk-three").expect("rotate");
        assert_eq!(watch.changed().await, FileEvent::Changed);
        let read = watch.reading().await;
        watch.failed(read);
        let started = Instant::now();
        assert_eq!(watch.changed().await, FileEvent::Retry);
        assert!(started.elapsed() <= RETRY_FIRST + FILE_POLL);

        // No retry once a failed change is undone, but one reload, which says (and counts)
        // that what runs is what the files hold again; nor for a failure with the files as
        // they run (a SIGHUP with a broken `.env`: the operator's to send again).
        let read = watch.reading().await;
        watch.failed(read);
        std::fs::write(&path, "sk-two").expect("back");
        let event = timeout(FILE_POLL * 3, watch.changed()).await;
        assert_eq!(event.ok(), Some(FileEvent::Restored));
        assert!(timeout(RETRY_MAX * 2, watch.changed()).await.is_err());
        let read = watch.reading().await;
        watch.failed(read);
        assert!(timeout(RETRY_MAX * 2, watch.changed()).await.is_err());
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

    /// A URL or address respelt is the same as the proxy uses it: no restart is owed.
    #[test]
    fn a_respelt_url_owes_no_restart() {
        let a = settings(&[
            (Key::SandboxApiKey, "sk-one"),
            (Key::SandboxBaseUrl, "http://127.0.0.1:22001"),
            (Key::Listen, "127.0.0.1:1"),
        ]);
        let b = settings(&[
            (Key::SandboxApiKey, "sk-one"),
            (Key::SandboxBaseUrl, "HTTP://127.0.0.1:22001/"),
            (Key::Listen, "localhost:1"),
            (Key::TokenTtl, "600"),
        ]);
        assert_eq!(
            plan(&a, &b, &names(&["sandbox_base_url", "listen", "token_ttl"])),
            Plan::Keep {
                restart: names(&["token_ttl"])
            }
        );
        // A plugin provider's fields are its settings' URL and domain.
        assert!(same_in_use(&a, &b, "myco.base_url"));
        let moved = settings(&[
            (Key::SandboxApiKey, "sk-one"),
            (Key::SandboxBaseUrl, "http://127.0.0.1:22002"),
            (Key::SandboxDomain, "other.example"),
        ]);
        assert!(!same_in_use(&a, &moved, "myco.base_url"));
        assert!(!same_in_use(&a, &moved, "myco.envd_domain"));
        assert!(same_in_use(&a, &b, "myco.envd_domain"));
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
            let moved = refused_for(&a, &b);
            assert!(moved.iter().any(|m| m == name), "{name}: {moved:?}");
        }
        // Every host set: a region, a domain beside `sandbox_url`, the exchange's URL and
        // style under a static key move nothing; the new key is swapped, they wait.
        let hosts = [
            (Key::SandboxBaseUrl, "https://api.example"),
            (Key::SandboxUrl, "https://envd.example"),
        ];
        let set = settings(&[&hosts[..], &[(Key::SandboxApiKey, "sk-one")]].concat());
        let unused_moved = settings(
            &[
                &hosts[..],
                &[
                    (Key::SandboxApiKey, "sk-two"),
                    (Key::Region, "cn-shanghai"),
                    (Key::SandboxDomain, "elsewhere.example"),
                    (Key::TokenExchangeUrl, "https://elsewhere.example"),
                    (Key::TokenExchange, "acs3"),
                ],
            ]
            .concat(),
        );
        let unread = [
            "region",
            "sandbox_domain",
            "token_exchange_url",
            "token_exchange",
        ];
        let changed = [&["sandbox_api_key"][..], &unread[..]].concat();
        assert_eq!(
            plan(&set, &unused_moved, &names(&changed)),
            Plan::Swap {
                restart: names(&unread)
            }
        );
        // A pair swapped in is exchanged with the running settings: a region (its
        // `RegionId`) or an exchange setting of the new ones would not apply. Every host
        // and the exchange's URL set, so that only the region moves.
        let exchange = (Key::TokenExchangeUrl, "https://exchange.example");
        let pair = [(Key::AccessKeyId, "LTAI-id"), (Key::AccessKeySecret, "s")];
        let shanghai = (Key::Region, "cn-shanghai");
        let c = settings(&[&hosts[..], &[exchange], &pair[..]].concat());
        let d = settings(&[&hosts[..], &[exchange, shanghai], &pair[..]].concat());
        let other_pair = [(Key::AccessKeyId, "LTAI-two"), (Key::AccessKeySecret, "t")];
        let d2 = settings(&[&hosts[..], &[exchange, shanghai], &other_pair[..]].concat());
        let static_key =
            settings(&[&hosts[..], &[exchange, (Key::SandboxApiKey, "sk-one")]].concat());
        for (from, to) in [(&c, &d2), (&static_key, &d)] {
            assert_eq!(refused_for(from, to), names(&["region"]));
        }
        // With its default host, the exchange's URL moves with the region, and is named.
        let c = settings(&[&hosts[..], &pair[..]].concat());
        let d = settings(&[&hosts[..], &other_pair[..], &[shanghai]].concat());
        assert_eq!(
            refused_for(&c, &d),
            names(&["region", "token_exchange_url"])
        );
        let e = settings(&[&hosts[..], &[(Key::TokenExchange, "acs3")], &pair[..]].concat());
        assert_eq!(refused_for(&set, &e), names(&["token_exchange"]));
        // A static key swapped in for a pair exchanges nothing: the exchange's settings
        // and the region wait for a restart with the rest.
        let to_static = settings(
            &[
                &hosts[..],
                &[
                    shanghai,
                    (Key::TokenExchange, "acs3"),
                    (Key::SandboxApiKey, "sk-two"),
                ],
            ]
            .concat(),
        );
        let changed = names(&["sandbox_api_key", "region", "token_exchange"]);
        assert_eq!(
            plan(&c, &to_static, &changed),
            Plan::Swap {
                restart: names(&["region", "token_exchange"])
            }
        );
        // A pair kept: its exchange goes on as it started, the new values wait.
        let kept = settings(&[&hosts[..], &[exchange, shanghai], &pair[..]].concat());
        let running = settings(&[&hosts[..], &[exchange], &pair[..]].concat());
        assert_eq!(
            plan(&running, &kept, &names(&["region"])),
            Plan::Keep {
                restart: names(&["region"])
            }
        );
        // A region beside an explicit host that is no region's default: only the host is
        // named (the region moved nothing).
        let moved_base = settings(&[
            (Key::SandboxBaseUrl, "https://api2.example"),
            (Key::SandboxUrl, "https://envd.example"),
            (Key::SandboxApiKey, "sk-two"),
            shanghai,
        ]);
        assert_eq!(refused_for(&set, &moved_base), names(&["sandbox_base_url"]));
        // A region that moved no host is not named beside one the user moved.
        let url_moved = settings(&[
            (Key::SandboxBaseUrl, "https://api.example"),
            (Key::SandboxUrl, "https://elsewhere.example"),
            (Key::SandboxApiKey, "sk-two"),
            shanghai,
        ]);
        assert_eq!(refused_for(&set, &url_moved), names(&["sandbox_url"]));
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
                moved: names(&["provider"])
            }
        );
    }
}
