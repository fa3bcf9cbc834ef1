//! Test harness: real external services on free loopback ports, for this crate's integration
//! tests and other crates' (`infera_backends::testing`, hidden from docs).
//!
//! - [`EtcdServer`]: the `etcd` binary (Debian `etcd-server`) with a temporary data dir.
//! - [`NatsServer`]: `nats-server` ≥ 2.10 with JetStream in a temporary store dir, found through
//!   `INFERA_NATS_SERVER_BIN` (set by `cargo xtask`) or `PATH`.
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
mod nats;
mod proxy;

pub use discovery::{DiscoveryFixture, discovery_conformance, next_change_for, sample_record};
pub use etcd::EtcdServer;
pub use nats::NatsServer;
pub use proxy::TcpProxy;

use std::path::{Path, PathBuf};
use std::process::Child;
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

/// A port that was free on 127.0.0.1 a moment ago (the OS picked it; a race with another process
/// is possible but rare, and the servers below retry on "address already in use").
pub fn free_port() -> Result<u16, HarnessError> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| HarnessError::io("binding a probe socket to find a free port", e))?;
    listener
        .local_addr()
        .map(|addr| addr.port())
        .map_err(|e| HarnessError::io("reading a probe socket's port", e))
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

/// Kills and reaps a child process; errors mean it already exited.
fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether a server's log says its port was taken (then it is restarted on other ports).
fn port_was_taken(log: &Path) -> bool {
    log_tail(log, 50).contains("address already in use")
}
