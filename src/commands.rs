//! The commands other than `serve`: `config list|get`, `check`, `provider …`. Each returns
//! its exit status; output goes to stdout, warnings and errors to stderr.

use std::io::Write;

use crate::cli::{CheckArgs, SettingsArgs};
use crate::error::{Error, EXIT_USAGE};
use crate::providers;
use crate::providers::manifest::printable;
use crate::settings::{FlagValue, Inputs, Resolved, Source, KEYS};

/// Resolves the chain for these flags and prints the warnings (every command that resolves
/// settings does).
pub fn resolve(args: &SettingsArgs) -> Result<Resolved, Error> {
    let (resolved, warnings) = resolve_unsaid(args)?;
    for w in warnings {
        crate::logging::warning(&w);
    }
    Ok(resolved)
}

/// [`resolve`], its warnings returned instead of printed: a reload says them once it knows
/// what it does with what it read (one that fails or is refused sends the credential to no
/// new host and selects no new provider, and [`Resolved::selection_warnings`] would say it
/// does).
pub fn resolve_unsaid(args: &SettingsArgs) -> Result<(Resolved, Vec<String>), Error> {
    let mut inputs = Inputs::from_process(args.to_flags()?);
    inputs.provider_options = args.provider_options()?;
    let resolved = Resolved::from_inputs(&inputs)?;
    // A refused --provider-option is a bad command line for every command (exit 2).
    match resolved.plugin() {
        Err(e @ Error::ProviderOption { .. }) => return Err(e),
        Ok(None) if !inputs.provider_options.is_empty() => {
            return Err(Error::ProviderOption {
                field: inputs.provider_options[0].0.clone(),
                reason: "the built-in provider takes no --provider-option; use its own flags"
                    .into(),
            })
        }
        _ => {}
    }
    crate::log_writer::mask(resolved.embedded_secrets());
    crate::log_writer::mask_when_verbose(resolved.secrets());
    let mut warnings = resolved.all_warnings();
    warnings.extend(empty_secret_files(args, &inputs, &resolved));
    Ok((resolved, warnings))
}

/// A key file read empty is a blank value, skipped like any (SPEC §2), but hardly what
/// whoever pointed the proxy at it meant (a Secret created empty, a rotation caught half
/// done): without a word the key would come from a lower level, an old `.env` key.
fn empty_secret_files(args: &SettingsArgs, inputs: &Inputs, resolved: &Resolved) -> Vec<String> {
    let mut found = Vec::new();
    for (key, path) in args.secret_files() {
        let blank = match inputs.flags.get(&key) {
            Some(FlagValue::Secret(s)) => s.expose().trim().is_empty(),
            _ => false,
        };
        if !blank {
            continue;
        }
        let entry = resolved.entry(key);
        let instead = match (&entry.value, entry.source) {
            (Some(_), source) => {
                let from = resolved.file_shown(source);
                format!("{} comes from {from}", entry.spec.name)
            }
            (None, _) => format!("{} is not set", entry.spec.name),
        };
        found.push(format!(
            "{} is empty: skipped as a blank value; {instead}",
            path.display()
        ));
    }
    found
}

/// Exit status when stdout's reader has gone: what a shell reports for a program ended by
/// SIGPIPE (128 + 13), as `cat`, `ls` or `git` end there. Not 0: a `check` cut short did
/// not pass.
pub const EXIT_BROKEN_PIPE: i32 = 141;
/// EX_IOERR: stdout failed otherwise (a full disk).
const EXIT_IOERR: i32 = 74;

/// One line of a command's output (see `outln!`). A reader that went away ends the process
/// quietly: nobody is left to read the rest, and the panic `println!` gave was noise on
/// stderr. Any other write failure ends it with a one-line error rather than a panic.
pub fn stdout_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            crate::logging::finish();
            std::process::exit(EXIT_BROKEN_PIPE)
        }
        Err(e) => {
            crate::logging::stderr_line(&format!("error: cannot write to stdout: {e}"));
            crate::logging::finish();
            std::process::exit(EXIT_IOERR)
        }
    }
}

struct Row {
    key: String,
    value: Option<String>,
    source: &'static str,
    env: Option<String>,
    secret: bool,
}

fn rows(resolved: &Resolved) -> Vec<Row> {
    let secrets = resolved.secrets();
    let mut rows: Vec<Row> = KEYS
        .iter()
        .map(|spec| {
            let e = resolved.entry(spec.key);
            Row {
                key: spec.name.to_string(),
                value: e.value.as_ref().map(|v| v.printed(&secrets)),
                source: e.source.label(),
                env: Some(spec.env.to_string()),
                secret: spec.secret,
            }
        })
        .collect();
    // `config` is where a user looks when something is wrong: show what resolves and say
    // what does not, rather than refusing to print anything.
    match resolved.plugin() {
        Ok(Some(plugin)) => rows.extend(plugin.fields.iter().map(|f| Row {
            key: f.key.clone(),
            value: f.value.as_ref().map(|v| v.printed(&secrets)),
            source: f.source.label(),
            env: Some(f.env.clone()),
            secret: f.secret,
        })),
        Ok(None) => {}
        Err(e) => crate::logging::stderr_line(&format!("warning: {}", e.line())),
    }
    let (value, source) = match credential_in_use(resolved) {
        Ok((kind, source)) => (Some(kind.to_string()), source.label()),
        Err(_) => (None, Source::Unset.label()),
    };
    rows.push(Row {
        key: "credential".into(),
        value,
        source,
        env: None,
        secret: false,
    });
    rows
}

/// Which credential is attached and where it comes from: the built-in rule of SPEC §2, or
/// the selected plugin's `api_key`.
pub(crate) fn credential_in_use(resolved: &Resolved) -> Result<(&'static str, Source), Error> {
    match resolved.plugin()? {
        None => resolved
            .credential()
            .map(|(kind, source, _)| (kind.label(), source)),
        Some(p) => p
            .fields
            .iter()
            .find(|f| f.field == "api_key" && f.value.is_some())
            .map(|f| ("api_key", f.source))
            .ok_or(Error::MissingCredential),
    }
}

/// [`credential_in_use`] in words, as the start's and a reload's lines say it: `api_key
/// from ~/.abx/.env (…)`; empty when there is none.
pub(crate) fn credential_said(resolved: &Resolved) -> String {
    credential_in_use(resolved)
        .map(|(kind, source)| format!("{kind} from {}", resolved.file_shown(source)))
        .unwrap_or_default()
}

/// A value `check` and `serve` refuse (E1005, and half an AccessKey pair: E1003), said by
/// `config list|get`, which show it as it resolved (a region with a space was shown in
/// usable-looking URLs, with no word), as a provider that cannot be loaded is. The missing
/// credential is its row's `unset`. Settings they take are warned of as they warn (a plain
/// `http://` upstream): SPEC §2 has every command that resolves settings say them.
fn warn_if_refused(resolved: &Resolved) {
    match resolved.validate() {
        Ok(settings) => {
            for w in settings.cleartext_upstreams() {
                crate::logging::warning(&w);
            }
        }
        Err(e @ (Error::InvalidSetting { .. } | Error::IncompletePair { .. })) => {
            crate::logging::stderr_line(&format!(
                "warning: {} (check and serve stop on it)",
                e.line()
            ));
        }
        Err(_) => {}
    }
}

pub fn config_list(args: &SettingsArgs, json: bool) -> Result<i32, Error> {
    let resolved = resolve(args)?;
    let rows = rows(&resolved);
    warn_if_refused(&resolved);
    if json {
        let arr: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "key": r.key, "value": r.value, "source": r.source,
                    "env": r.env, "secret": r.secret,
                })
            })
            .collect();
        outln!("{}", serde_json::Value::Array(arr));
    } else {
        // Escaped for the terminal (JSON escapes by itself): the table is where a user
        // checks where the key goes, and a value from a `.env` file could otherwise move
        // the cursor over the warning above it.
        let value = |r: &Row| printable(r.value.as_deref().unwrap_or("-")).into_owned();
        let width = |f: &dyn Fn(&Row) -> usize| rows.iter().map(f).max().unwrap_or(0);
        let (wk, wv, ws) = (
            width(&|r| r.key.len()),
            width(&|r| value(r).len()),
            width(&|r| r.source.len()),
        );
        for r in &rows {
            let line = format!(
                "{:wk$}  {:wv$}  {:ws$}  {}",
                r.key,
                value(r),
                r.source,
                r.env.as_deref().unwrap_or("-"),
            );
            outln!("{}", line.trim_end());
        }
    }
    Ok(0)
}

pub fn config_get(args: &SettingsArgs, key: &str) -> Result<i32, Error> {
    let resolved = resolve(args)?;
    warn_if_refused(&resolved);
    let rows = rows(&resolved);
    match rows.iter().find(|r| r.key == key) {
        Some(row) => {
            // Escaped as `config list` shows it: a value a terminal acts on (an ESC pasted
            // with an AccessKey ID) is said by its warning, not run.
            if let Some(v) = &row.value {
                outln!("{}", printable(v));
            }
            Ok(0)
        }
        None => {
            // The selected plugin's keys among them: they are `config get`'s too.
            let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
            crate::logging::stderr_line(&format!(
                "error: unknown key {key:?}; keys: {}",
                keys.join(", ")
            ));
            Ok(EXIT_USAGE)
        }
    }
}

/// `check`: the offline checks, then, unless `--offline`, [`crate::check::online`].
pub fn check(args: &CheckArgs) -> Result<i32, Error> {
    let resolved = resolve(&args.settings)?;
    let settings = resolved.validate()?;
    for w in settings.cleartext_upstreams() {
        crate::logging::warning(&w);
    }
    for w in crate::upstream::unused_forward_proxies() {
        crate::logging::warning(&w);
    }
    // What serve checks before it binds, from the same flags: check's ok means serve starts.
    let exposure = &args.exposure;
    crate::proxy::check_exposure(&settings.listen, exposure.tls(), exposure.allow_remote)?;
    let remote =
        crate::proxy::exposure_warning(&settings.listen, exposure.tls(), exposure.allow_remote);
    if let Some(w) = remote {
        crate::logging::warning(&w);
    }
    if let (Some(cert), Some(key)) = (&exposure.tls_cert, &exposure.tls_key) {
        let pair = crate::proxy::certs::ListenerCert::load(cert, key)?;
        // Both: an expired cross-sign left in the file is said first, and hid that the
        // leaf ends within days.
        let now = std::time::SystemTime::now();
        for w in [pair.validity_warning(now), pair.expiry_notice(now)] {
            w.iter().for_each(|w| crate::logging::warning(w));
        }
    }
    // And of its own flags: the idle timeout's warning, and room under the open-file limit
    // for a connection (E1008).
    if let Some(w) = crate::serve::short_idle_timeout(&args.run) {
        crate::logging::warning(&w);
    }
    crate::descriptors::room_for_one(crate::workers::count()).map_err(|e| Error::Bind {
        addr: settings.shown(&settings.listen),
        reason: e.to_string(),
    })?;
    let (kind, source) = credential_in_use(&resolved)?;
    outln!("credential: {kind} ({})", source.label());
    outln!("provider: {}", settings.provider);
    outln!(
        "control plane: {}",
        settings.shown(&settings.sandbox_base_url)
    );
    match (&settings.sandbox_url, &settings.sandbox_domain) {
        (Some(u), _) => outln!(
            "envd: {} (routed by E2b-Sandbox-* headers)",
            settings.shown(u)
        ),
        (None, Some(d)) => outln!("envd: https://{{port}}-{{sandboxId}}.{}", settings.shown(d)),
        (None, None) => outln!("envd: none (this provider has no envd plane)"),
    }
    outln!(
        "listen: {}  admin: {}",
        settings.shown(&settings.listen),
        settings.shown(&settings.admin_listen)
    );
    if matches!(
        settings.credential,
        crate::settings::Credential::AccessKey { .. }
    ) {
        // The setting's own spelling (`rpc-v1`, `acs3`), not the enum's Debug name.
        let scheme = match settings.token_exchange {
            crate::settings::ExchangeScheme::RpcV1 => "rpc-v1",
            crate::settings::ExchangeScheme::Acs3 => "acs3",
        };
        outln!(
            "token exchange: {} ({scheme})",
            settings.shown(&settings.token_exchange_url)
        );
    }
    if args.offline {
        // Read offline too: `serve` with the same file would stop at it.
        if let Some(ca) = &args.net.upstream_ca {
            crate::upstream::tls_config(Some(ca))?;
        }
        outln!("ok (offline: nothing was contacted)");
        return Ok(0);
    }
    crate::check::online(&settings, &args.net)
}

/// `ABX_HOME` for the `provider` commands, which read no settings: a relative one is
/// warned about here as the settings chain warns about it.
fn abx_home() -> Result<std::path::PathBuf, Error> {
    let cwd = std::env::current_dir().unwrap_or_default();
    let home = std::env::var("ABX_HOME").ok();
    if let Some(w) = crate::settings::relative_abx_home(home.as_deref(), &cwd) {
        crate::logging::warning(&w);
    }
    crate::settings::layers::abx_home(|name| std::env::var_os(name)).ok_or_else(|| {
        Error::InvalidSetting {
            key: "ABX_HOME".into(),
            reason: "neither ABX_HOME nor HOME names a directory (an unset HOME or \
                     HOME=/dev/null: set ABX_HOME)"
                .into(),
        }
    })
}

pub fn provider_list() -> Result<i32, Error> {
    outln!("{:18} {:10} description", "id", "kind");
    outln!(
        "{:18} {:10} Alibaba Cloud Agent Sandbox (E2B API, Authorization: Bearer)",
        providers::BUILTIN,
        "built-in"
    );
    // No home, no installed provider: the built-in one is all there is to list.
    let installed = abx_home().map_or_else(|_| Vec::new(), |home| providers::list(&home));
    for entry in installed {
        match entry {
            Ok(p) => outln!(
                "{:18} {:10} {}",
                p.manifest.id,
                "installed",
                printable(p.manifest.description.as_deref().unwrap_or(""))
            ),
            Err(e) => crate::logging::stderr_line(&format!("warning: {}", e.line())),
        }
    }
    Ok(0)
}

pub fn provider_info(id: &str) -> Result<i32, Error> {
    if id == providers::BUILTIN {
        outln!("id: {id} (built-in)");
        outln!("base_url: https://api.{{region}}.e2b.fc.aliyuncs.com");
        outln!("auth: Authorization: Bearer <key>");
        outln!("envd: https://{{port}}-{{sandboxId}}.{{region}}.e2b.fc.aliyuncs.com");
        outln!("fields:");
        for k in KEYS {
            outln!(
                "  {:22} {:28}{}",
                k.name,
                k.env,
                if k.secret { " secret" } else { "" }
            );
        }
        outln!("Inherits: (none)");
        return Ok(0);
    }
    let installed = providers::load(&abx_home()?, id)?
        .ok_or_else(|| Error::UnknownProvider { id: id.to_string() })?;
    print_provider(&installed);
    Ok(0)
}

fn print_provider(p: &providers::Installed) {
    for line in provider_lines(p) {
        outln!("{line}");
    }
}

/// What `provider install` and `provider info` show, the user's basis for consent. Every
/// manifest string goes through [`printable`]: one a terminal acts on could hide the lines
/// after it, the inherit list among them.
fn provider_lines(p: &providers::Installed) -> Vec<String> {
    let m = &p.manifest;
    let mut lines = vec![format!("id: {}", printable(&m.id))];
    if let Some(d) = &m.description {
        lines.push(format!("description: {}", printable(d)));
    }
    lines.push(format!("base_url: {}", printable(&m.base_url)));
    lines.push(match &m.auth {
        providers::AuthKind::Bearer => "auth: Authorization: Bearer <key>".to_string(),
        providers::AuthKind::Header(h) => format!("auth: {}: <key>", printable(h)),
    });
    lines.push(match &m.envd_domain {
        Some(d) => format!("envd: https://{{port}}-{{sandboxId}}.{}", printable(d)),
        None => "envd: none".to_string(),
    });
    lines.push("fields:".to_string());
    for f in m.fields.values() {
        let mut envs = vec![m.canonical_env(&f.name)];
        envs.extend(f.aliases.iter().cloned());
        lines.push(format!(
            "  {:14} {}{}",
            printable(&f.name),
            printable(&envs.join(", ")),
            if f.secret {
                "  (secret: environment or .env only)"
            } else {
                ""
            }
        ));
    }
    lines.push("Inherits:".to_string());
    if m.inherit.is_empty() {
        lines.push("  (none)".to_string());
    }
    for key in &m.inherit {
        let state = if p.consented.contains(key) {
            "consented"
        } else {
            "NOT consented: reinstall with --consent to allow"
        };
        lines.push(format!("  {} ({state})", printable(key)));
    }
    lines
}

pub fn provider_install(file: &std::path::Path, consent: bool) -> Result<i32, Error> {
    let (installed, changes) = providers::install(&abx_home()?, file, consent)?;
    outln!(
        "installed {} in {}",
        installed.manifest.id,
        installed.dir.display()
    );
    if !changes.is_empty() {
        crate::logging::warning(&format!(
            "this replaced the installed provider {id}, and changes where or how its key \
             goes: {}; a proxy with {id} selected sends it so from its next start",
            changes.join("; "),
            id = installed.manifest.id
        ));
    }
    print_provider(&installed);
    if !installed.manifest.inherit.is_empty() && !consent {
        outln!(
            "note: this provider asks to inherit {}; it was not granted. Run `abx-proxy provider install {} --consent` to allow.",
            installed.manifest.inherit.join(", "),
            file.display()
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_provider_printout_escapes_what_a_terminal_would_act_on() {
        // As an older build may have installed it: the parser now refuses these strings.
        let mut manifest = providers::Manifest::parse(
            "manifest_version = 1\n[provider]\nid = \"p\"\n[endpoint]\nbase_url = \"http://h\"\nauth.scheme = \"bearer\"\n[config.fields.api_key]\nsecret = true\n[core]\ninherit = [\"sandbox_api_key\"]\n",
            "m.toml",
        )
        .unwrap();
        manifest.description = Some("P\u{1b}[8m".into());
        manifest.base_url = "http://h/\u{85}\n".into();
        let p = providers::Installed {
            manifest,
            dir: std::path::PathBuf::from("d"),
            consented: Vec::new(),
        };
        let lines = provider_lines(&p);
        assert!(
            !lines.iter().any(|l| l.chars().any(char::is_control)),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"description: P\\u{1b}[8m".to_string()),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"base_url: http://h/\\u{85}\\u{a}".to_string()),
            "{lines:?}"
        );
        assert_eq!(
            lines.last().map(String::as_str),
            Some("  sandbox_api_key (NOT consented: reinstall with --consent to allow)")
        );
    }
}
