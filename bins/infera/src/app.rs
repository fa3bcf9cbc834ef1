//! Dispatch of a parsed command line: validation, `--check-config`, and the exit code of each
//! outcome.
//!
//! Exit codes: 0 success (including `--check-config`); 1 a command that failed while running
//! (including an option this build refuses at startup); 2 an invalid configuration (and, from
//! clap, a usage error). Every failure is reported as one line on stderr.

use crate::cli::{Cli, Command};
use crate::config::{ConfigError, GaieConfig, KvdConfig, ServerConfig, WorkerConfig};
use crate::{replay_cmd, up_cmd, worker};
use infera_adapters::telemetry;
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// Why a command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The flags do not form a valid configuration.
    #[error("infera {command}: error: {error}")]
    Config {
        /// The command (`server`, `worker`, `kvd`, `gaie`).
        command: &'static str,
        /// What is wrong.
        error: ConfigError,
    },
    /// The flags are invalid (commands validated outside `config`, e.g. `replay`).
    #[error("infera {command}: error: {error:#}")]
    Invalid {
        /// The command.
        command: &'static str,
        /// What is wrong.
        error: anyhow::Error,
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
            Self::Config { .. } | Self::Invalid { .. } => ExitCode::from(2),
            Self::Failed { .. } => ExitCode::FAILURE,
        }
    }
}

/// Sends `tracing` output to stderr (stdout carries `--check-config` JSON), filtered by
/// `RUST_LOG`, else by `infera kvd --log-level`, else `info`; and, for `infera server` and
/// `infera up` with an OTLP endpoint, the request path's spans to it (see [`telemetry`]). The
/// returned exporter flushes at drop.
///
/// # Errors
/// Bad `--otlp-*` flags, or an exporter that cannot be built.
pub fn init_tracing(cli: &Cli) -> Result<Option<telemetry::Exporter>, AppError> {
    let default = match &cli.command {
        Command::Kvd(args) => args.log_level.directive(),
        _ => "info",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    let (command, settings) = match &cli.command {
        Command::Server(args) => (
            "server",
            telemetry::Settings {
                endpoint: args.otlp_endpoint.clone(),
                sample_ratio: args.otlp_sample_ratio,
            },
        ),
        Command::Up(_) => ("up", telemetry::Settings::default()),
        _ => {
            tracing_subscriber::registry().with(log).init();
            return Ok(None);
        }
    };
    settings.validate().map_err(|e| AppError::Invalid {
        command,
        error: e.into(),
    })?;
    if !settings.enabled(|k| std::env::var(k).ok()) {
        tracing_subscriber::registry().with(log).init();
        return Ok(None);
    }
    let (exporter, spans) = telemetry::layer(&settings).map_err(|e| AppError::Failed {
        command,
        error: e.into(),
    })?;
    tracing_subscriber::registry().with(log).with(spans).init();
    Ok(Some(exporter))
}

/// Runs a parsed command line.
///
/// # Errors
/// See [`AppError`].
pub fn run(cli: Cli) -> Result<(), AppError> {
    match cli.command {
        Command::Server(args) => {
            let check = args.check_config;
            match ServerConfig::try_from(*args) {
                Ok(config) if !check => {
                    crate::server_cmd::run(config).map_err(|error| AppError::Failed {
                        command: "server",
                        error,
                    })
                }
                config => finish("server", config),
            }
        }
        Command::Worker(worker) => {
            let check = worker.check_config();
            match WorkerConfig::try_from(worker) {
                Ok(config) if !check => worker::run(config).map_err(|error| AppError::Failed {
                    command: "worker",
                    error,
                }),
                config => finish("worker", config),
            }
        }
        Command::Kvd(args) => {
            let check = args.check_config;
            let config = KvdConfig::try_from(args).map_err(|error| AppError::Config {
                command: "kvd",
                error,
            })?;
            if check {
                return finish("kvd", Ok(config));
            }
            let failed = |error: anyhow::Error| AppError::Failed {
                command: "kvd",
                error,
            };
            let metrics = config
                .metrics_bind
                .map(crate::kvd_metrics::bind)
                .transpose()
                .map_err(failed)?;
            let events = config.kv_events.clone();
            let runtime = infera_kvd::runtime().map_err(|error| failed(error.into()))?;
            runtime
                .block_on(async {
                    // Bound before the daemon, so a taken port stops it before its socket exists.
                    let publishing = match &events {
                        Some(events) => Some(crate::wiring::kvd_inventory(events).await?),
                        None => None,
                    };
                    infera_kvd::run_publishing(config.into(), publishing, |server| {
                        if let Some(listener) = metrics {
                            crate::kvd_metrics::spawn(listener, server.stats_reader());
                        }
                    })
                    .await
                    .map_err(anyhow::Error::from)
                })
                .map_err(failed)
        }
        Command::Gaie(args) => {
            let check = args.check_config;
            match GaieConfig::try_from(args) {
                Ok(config) if !check => {
                    crate::gaie::run(config).map_err(|error| AppError::Failed {
                        command: "gaie",
                        error,
                    })
                }
                config => finish("gaie", config),
            }
        }
        Command::Replay(args) => {
            replay_cmd::run_replay(args).map_err(|e| replay_error("replay", e))
        }
        Command::Bench(args) => crate::bench::run(args).map_err(|e| replay_error("bench", e)),
        Command::Trace(args) => replay_cmd::run_trace(args).map_err(|e| replay_error("trace", e)),
        Command::MockEngine(args) => {
            worker::mock::run_engine(args).map_err(|error| AppError::Failed {
                command: "mock-engine",
                error,
            })
        }
        Command::Up(args) => up_cmd::run(args).map_err(|e| match e {
            up_cmd::UpFailure::Invalid(error) => AppError::Invalid {
                command: "up",
                error,
            },
            up_cmd::UpFailure::Failed(error) => AppError::Failed {
                command: "up",
                error,
            },
        }),
    }
}

fn replay_error(command: &'static str, e: replay_cmd::ReplayFailure) -> AppError {
    match e {
        replay_cmd::ReplayFailure::Invalid(error) => AppError::Invalid { command, error },
        replay_cmd::ReplayFailure::Failed(error) => AppError::Failed { command, error },
    }
}

/// Prints a validated configuration (`--check-config`), or reports why it is invalid.
fn finish<T: Serialize>(
    command: &'static str,
    config: Result<T, ConfigError>,
) -> Result<(), AppError> {
    let config = config.map_err(|error| AppError::Config { command, error })?;
    print_json(&config).map_err(|error| AppError::Failed { command, error })
}

fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut stdout, value)?;
    writeln!(stdout)?;
    stdout.flush()?;
    Ok(())
}
