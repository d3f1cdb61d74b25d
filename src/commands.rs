//! The commands other than `serve`: `config list|get`, `check`, `provider …`. Each returns
//! its exit status; output goes to stdout, warnings and errors to stderr.

use std::io::Write;

use crate::cli::{CheckArgs, SettingsArgs};
use crate::error::{Error, EXIT_USAGE};
use crate::settings::{Inputs, Resolved, Source, KEYS};

/// Resolves the chain for these flags and prints the warnings (every command that resolves
/// settings does).
pub fn resolve(args: &SettingsArgs) -> Result<Resolved, Error> {
    let mut inputs = Inputs::from_process(args.to_flags()?);
    inputs.provider_options = args
        .provider_options()
        .map_err(|reason| Error::InvalidSetting {
            key: "provider_option".into(),
            reason,
        })?;
    let resolved = Resolved::from_inputs(&inputs)?;
    for w in resolved.all_warnings() {
        eprintln!("warning: {w}");
    }
    Ok(resolved)
}

struct Row {
    key: String,
    value: Option<String>,
    source: &'static str,
    env: Option<&'static str>,
    secret: bool,
}

fn rows(resolved: &Resolved) -> Vec<Row> {
    let mut rows: Vec<Row> = KEYS
        .iter()
        .map(|spec| {
            let e = resolved.entry(spec.key);
            Row {
                key: spec.name.to_string(),
                value: e.value.as_ref().map(|v| v.shown()),
                source: e.source.label(),
                env: Some(spec.env),
                secret: spec.secret,
            }
        })
        .collect();
    let (value, source) = match resolved.credential() {
        Ok((kind, source, _)) => (Some(kind.label().to_string()), source.label()),
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

pub fn config_list(args: &SettingsArgs, json: bool) -> Result<i32, Error> {
    let resolved = resolve(args)?;
    let rows = rows(&resolved);
    let mut out = std::io::stdout().lock();
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
        let _ = writeln!(out, "{}", serde_json::Value::Array(arr));
    } else {
        let width = |f: fn(&Row) -> usize| rows.iter().map(f).max().unwrap_or(0);
        let (wk, wv, ws) = (
            width(|r| r.key.len()),
            width(|r| r.value.as_deref().unwrap_or("-").len()),
            width(|r| r.source.len()),
        );
        for r in &rows {
            let line = format!(
                "{:wk$}  {:wv$}  {:ws$}  {}",
                r.key,
                r.value.as_deref().unwrap_or("-"),
                r.source,
                r.env.unwrap_or("-"),
            );
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
    Ok(0)
}

pub fn config_get(args: &SettingsArgs, key: &str) -> Result<i32, Error> {
    let resolved = resolve(args)?;
    match rows(&resolved).into_iter().find(|r| r.key == key) {
        Some(row) => {
            if let Some(v) = row.value {
                println!("{v}");
            }
            Ok(0)
        }
        None => {
            eprintln!(
                "error: unknown key {key:?}; keys: {}, credential",
                KEYS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
            );
            Ok(EXIT_USAGE)
        }
    }
}

/// `check --offline`: everything but the network.
pub fn check(args: &CheckArgs) -> Result<i32, Error> {
    let resolved = resolve(&args.settings)?;
    let settings = resolved.validate()?;
    let (kind, source, _) = resolved.credential()?;
    println!("credential: {} ({})", kind.label(), source.label());
    println!("provider: {}", settings.provider);
    println!("control plane: {}", settings.sandbox_base_url);
    match &settings.sandbox_url {
        Some(u) => println!("envd: {u} (routed by E2b-Sandbox-* headers)"),
        None => println!(
            "envd: https://{{port}}-{{sandboxId}}.{}",
            settings.sandbox_domain
        ),
    }
    println!(
        "listen: {}  admin: {}",
        settings.listen, settings.admin_listen
    );
    if kind == crate::settings::CredentialKind::AccessKey {
        // The setting's own spelling (`rpc-v1`, `acs3`), not the enum's Debug name.
        let scheme = match settings.token_exchange {
            crate::settings::ExchangeScheme::RpcV1 => "rpc-v1",
            crate::settings::ExchangeScheme::Acs3 => "acs3",
        };
        println!("token exchange: {} ({scheme})", settings.token_exchange_url);
    }
    if args.offline {
        println!("ok (offline: nothing was contacted)");
        return Ok(0);
    }
    crate::check::online(&settings, &args.net)
}

pub fn provider_list() -> Result<i32, Error> {
    println!("alicloud-express  built-in  Alibaba Cloud Agent Sandbox (E2B API)");
    Ok(0)
}

pub fn provider_info(id: &str) -> Result<i32, Error> {
    if id != "alicloud-express" {
        return Err(Error::UnknownProvider { id: id.to_string() });
    }
    println!("id: alicloud-express (built-in)");
    println!("auth: Authorization: Bearer <key>");
    println!("fields:");
    for k in KEYS {
        println!(
            "  {:22} {:28} {}",
            k.name,
            k.env,
            if k.secret { "secret" } else { "" }
        );
    }
    println!("Inherits: (none)");
    Ok(0)
}

pub fn provider_install(_file: &std::path::Path, _consent: bool) -> Result<i32, Error> {
    Err(Error::Provider {
        id: "-".into(),
        reason: "plugin providers are not supported yet".into(),
    })
}
