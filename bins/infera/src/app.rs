//! Dispatch of a parsed command line: validation, `--check-config`, and the exit code of each
//! outcome.
//!
//! Exit codes: 0 success (including `--check-config`); 1 a command that failed while running,
//! or whose runtime is not part of this build yet; 2 an invalid configuration (and, from clap,
//! a usage error). Every failure is reported as one line on stderr.

use crate::cli::{Cli, Command};
use crate::config::{ConfigError, KvdConfig, ServerConfig, WorkerConfig};
use crate::replay_cmd;
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

/// Why a command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The flags do not form a valid configuration.
    #[error("infera {command}: error: {error}")]
    Config {
        /// The command (`server`, `worker`, `kvd`).
        command: &'static str,
        /// What is wrong.
        error: ConfigError,
    },
    /// The configuration is valid, but this build cannot run the command yet.
    #[error(
        "infera {command}: configuration is valid, but the {command} runtime is not part of this \
         build yet"
    )]
    NotInThisBuild {
        /// The command.
        command: &'static str,
    },
    /// The command ran and failed.
    #[error("infera {command}: error: {error:#}")]
    Failed {
        /// The command.
        command: &'static str,
        /// What failed, with its causes.
        error: anyhow::Error,
    },
}

impl AppError {
    /// The process exit code for this failure.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Self::Config { .. } => ExitCode::from(2),
            Self::NotInThisBuild { .. } | Self::Failed { .. } => ExitCode::FAILURE,
        }
    }
}

/// Sends `tracing` output to stderr (stdout carries `--check-config` JSON), filtered by
/// `RUST_LOG`, `info` by default.
pub fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// Runs a parsed command line.
///
/// # Errors
/// See [`AppError`].
pub fn run(cli: Cli) -> Result<(), AppError> {
    match cli.command {
        Command::Server(args) => {
            let check = args.check_config;
            finish("server", check, ServerConfig::try_from(args))
        }
        Command::Worker(worker) => {
            let check = worker.check_config();
            finish("worker", check, WorkerConfig::try_from(worker))
        }
        Command::Kvd(args) => {
            let check = args.check_config;
            finish("kvd", check, KvdConfig::try_from(args))
        }
        Command::Replay(args) => replay_cmd::run_replay(args).map_err(|error| AppError::Failed {
            command: "replay",
            error,
        }),
        Command::Trace(args) => replay_cmd::run_trace(args).map_err(|error| AppError::Failed {
            command: "trace",
            error,
        }),
    }
}

/// Reports a validated configuration (`--check-config`) or stops: no runtime is built in yet.
fn finish<T: Serialize>(
    command: &'static str,
    check_config: bool,
    config: Result<T, ConfigError>,
) -> Result<(), AppError> {
    let config = config.map_err(|error| AppError::Config { command, error })?;
    if !check_config {
        return Err(AppError::NotInThisBuild { command });
    }
    print_json(&config).map_err(|error| AppError::Failed { command, error })
}

fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut stdout, value)?;
    writeln!(stdout)?;
    stdout.flush()?;
    Ok(())
}
