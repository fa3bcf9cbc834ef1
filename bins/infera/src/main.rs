//! The `infera` binary: parse the command line, start logging, run the command, and turn the
//! outcome into an exit code. Everything else lives in the modules below.

// Tests may unwrap; the non-test build still denies it everywhere.

mod app;
mod auto_tune;
mod bench;
mod cli;
mod config;
mod gaie;
mod kvd_metrics;
mod kvd_store;
mod net;
mod prewarm;
mod record;
mod replay_cmd;
mod server_cmd;
mod signals;
mod up_cmd;
mod wiring;
mod worker;

use std::process::ExitCode;

/// mimalloc, not glibc malloc: the router allocates per request on every worker thread, and glibc's
/// arena locking and consolidation were 12–20 % of a round-robin request's CPU.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match cli::parse_from(std::env::args_os()) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let _exporter = match app::init_tracing(&cli) {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("{error}");
            return error.exit_code();
        }
    };
    match app::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            error.exit_code()
        }
    }
}
