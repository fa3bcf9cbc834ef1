//! Shutdown signals of the long-running commands (`server`, `worker mock`, `up`).
//!
//! Handlers for SIGTERM and SIGINT (Ctrl-C) are registered before a command announces that it is
//! ready, so a signal sent right after the announcement is never lost to the default action
//! (which would kill the process with a non-zero status instead of shutting it down cleanly).

use anyhow::Context;
use tokio::signal::unix::{Signal, SignalKind, signal};

/// Registered SIGTERM and SIGINT handlers. Needs a running tokio runtime.
#[derive(Debug)]
pub struct Signals {
    terminate: Signal,
    interrupt: Signal,
}

impl Signals {
    /// Registers both handlers.
    ///
    /// # Errors
    /// When the process cannot install a signal handler (then it must not start serving).
    pub fn register() -> anyhow::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
        })
    }

    /// Completes on SIGTERM or Ctrl-C.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
        tracing::info!("shutdown signal received");
    }
}
