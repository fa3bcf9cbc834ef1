//! Test harness: real external services on free loopback ports, for this crate's integration
//! tests and other crates' (`infera_backends::testing`, hidden from docs).
//!
//! - [`EtcdServer`]: the `etcd` binary (Debian `etcd-server`) with a temporary data dir.
//! - [`NatsServer`]: `nats-server` ≥ 2.10 with JetStream in a temporary store dir, found through
//!   `INFERA_NATS_SERVER_BIN` (set by `cargo xtask`) or `PATH`.
//! - [`free_port`], [`free_port_triple`]: loopback ports no two starts of one test process share.
//! - [`TcpProxy`]: a loopback TCP proxy whose connections a test can cut and restore, to break a
//!   client's streams while the server stays up.
//! - [`discovery_conformance`]: the behaviour every discovery backend must show.
//!
//! Servers are started as child processes whose output goes to a log file in their temp dir;
//! readiness is polled against a deadline (never a fixed sleep); `Drop` kills the process and
//! removes the dir. A missing or too old binary is an error naming what to install: tests that
//! need a service fail, they never skip.

mod discovery;
mod etcd;
pub mod event_log;
pub mod kube_api;
mod nats;
mod ports;
pub mod postgres;
mod proxy;

pub use discovery::{DiscoveryFixture, discovery_conformance, next_change_for, sample_record};
pub use etcd::EtcdServer;
pub use nats::NatsServer;
pub use ports::{free_port, free_port_triple};
pub use proxy::TcpProxy;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a server may take to answer after it was started.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Interval between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// Why a test service could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// The binary is not installed.
    #[error("{binary} not found ({looked_in}); install it: {install}")]
    BinaryMissing {
        binary: &'static str,
        looked_in: String,
        install: &'static str,
    },
    /// The binary is too old for the tests.
    #[error(
        "{path} is version {found}, older than the {needed} the tests need; install: {install}"
    )]
    TooOld {
        path: PathBuf,
        found: String,
        needed: &'static str,
        install: &'static str,
    },
    /// Spawning or preparing the process failed.
    #[error("starting {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The process exited or did not answer before the deadline.
    #[error("{binary} did not become ready: {reason}; last log lines:\n{log_tail}")]
    NotReady {
        binary: &'static str,
        reason: String,
        log_tail: String,
    },
}

impl HarnessError {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        HarnessError::Io {
            what: what.into(),
            source,
        }
    }
}

/// `name` on `PATH`, if it is there.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The last `lines` lines of a log file, for error messages.
fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Spawns `command` (the server binary `binary`) with stdout and stderr appended to `log`.
fn spawn_logged(command: &mut Command, binary: &Path, log: &Path) -> Result<Child, HarnessError> {
    let out = std::fs::File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| HarnessError::io(format!("opening {}", log.display()), e))?;
    let err = out
        .try_clone()
        .map_err(|e| HarnessError::io(format!("duplicating the handle of {}", log.display()), e))?;
    command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| HarnessError::io(format!("spawning {}", binary.display()), e))
}

/// Polls `probe` (bounded per attempt) until it succeeds, the process exits, or
/// [`READY_TIMEOUT`] passes — then kills the process and reports the end of its log.
async fn wait_ready<F, Fut>(
    child: &mut Option<Child>,
    name: &'static str,
    log: &Path,
    mut probe: F,
) -> Result<(), HarnessError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    let not_ready = |reason: String| HarnessError::NotReady {
        binary: name,
        reason,
        log_tail: log_tail(log, 20),
    };
    loop {
        if let Some(c) = child.as_mut()
            && let Ok(Some(status)) = c.try_wait()
        {
            *child = None;
            return Err(not_ready(format!("exited with {status}")));
        }
        let last_error = match tokio::time::timeout(PROBE_INTERVAL * 20, probe()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => "the readiness probe timed out".to_owned(),
        };
        if tokio::time::Instant::now() >= deadline {
            if let Some(mut c) = child.take() {
                kill(&mut c);
            }
            return Err(not_ready(format!(
                "not ready within {READY_TIMEOUT:?}: {last_error}"
            )));
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// Kills and reaps a child process; errors mean it already exited.
fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether a server's log says its port was taken (then it is restarted on other ports).
fn port_was_taken(log: &Path) -> bool {
    log_tail(log, 50).contains("address already in use")
}
