//! The `abx-proxy` binary: parse the command line, set up logging, run the command, turn
//! its error into the house format and an exit status.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use abx_proxy::cli::{Cli, Command, ConfigCommand, LogFormat, ProviderCommand};
use abx_proxy::error::EXIT_USAGE;
use abx_proxy::{commands, logging, serve, Error};

/// mimalloc: per-thread free lists for every size. With glibc's, the few allocations of a
/// request above 1 KiB (the head buffer, boxed futures) took its slow path, about 10% of
/// a request's instructions.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit());
    let command = cli.command.unwrap_or(Command::Serve(cli.serve));
    let settings = match &command {
        Command::Serve(a) => Some(&a.settings),
        Command::Check(a) => Some(&a.settings),
        Command::Config {
            command: ConfigCommand::List { settings, .. },
        }
        | Command::Config {
            command: ConfigCommand::Get { settings, .. },
        } => Some(settings),
        Command::Provider { .. } => None,
    };
    if let Some(refused) = settings.and_then(|s| s.refused_secret()) {
        let json = match &command {
            Command::Serve(a) => a.run.log_format == LogFormat::Json,
            Command::Check(a) => a.run.log_format == LogFormat::Json,
            _ => false,
        };
        logging::refused(json, &format!(
            "{} is not accepted: a secret on the command line is visible to every user in `ps` and in shell history; {}",
            refused.0, refused.1
        ));
        return ExitCode::from(EXIT_USAGE as u8);
    }
    let result: Result<i32, Error> = match &command {
        Command::Serve(args) => {
            // The long-running command: its lines go through the writer thread, so that a
            // log reader that stalls stops nothing (see `log_writer`). The others write
            // where they log, in order with their output on stdout.
            abx_proxy::log_writer::start();
            logging::warnings_as_log_lines();
            logging::init(args.run.log_format, args.run.log_level.as_deref(), "info");
            logging::panics_as_lines();
            // A panic that ends the process: its line is queued (see the hook), and the
            // writer thread must be given the moment it is given at any other exit.
            let served =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve::run(args)));
            let Ok(served) = served else {
                logging::finish();
                return ExitCode::from(101);
            };
            served.map(|()| 0)
        }
        Command::Check(args) => {
            logging::init(args.run.log_format, args.run.log_level.as_deref(), "warn");
            commands::check(args)
        }
        Command::Config { command } => match command {
            ConfigCommand::List { json, settings } => commands::config_list(settings, *json),
            ConfigCommand::Get { key, settings } => commands::config_get(settings, key),
        },
        Command::Provider { command } => match command {
            ProviderCommand::List => commands::provider_list(),
            ProviderCommand::Info { id } => commands::provider_info(id),
            ProviderCommand::Install { file, consent } => {
                commands::provider_install(file, *consent)
            }
        },
    };
    match result {
        Ok(code) => {
            logging::finish();
            ExitCode::from(code as u8)
        }
        Err(e) => {
            logging::fatal(&e);
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
