//! `infera kvd`: the KV-cache daemon — the Unix-socket protocol, the L2 host-RAM store and shared
//! arena, the L3 tablespace, L4 through the backend trait, and its client library. It does not
//! depend on the router.
//!
//! Part 1 (this build): [`proto`] (the wire protocol, PROTOCOLS §6), [`store`] (the L2 store on
//! `infera_core::retention::ClassedLru`), [`server`] (the daemon), [`stats`] (counters and their
//! Prometheus text) and [`client`]. The shared arena and the L3 tier are part 2.
//!
//! Entry points: [`run`] (async, until SIGTERM/SIGINT) and [`run_blocking`] (builds the runtime;
//! what `infera kvd` calls).

pub mod client;
pub mod proto;
pub mod server;
pub mod stats;
pub mod store;

pub use client::{ClientError, KvdClient};
pub use proto::{Namespace, SetAck, SetItem};
pub use server::{KvdError, KvdOptions, KvdServer, ShutdownHandle};
pub use stats::{Stats, metrics_text};

use tokio::signal::unix::{SignalKind, signal};

/// Runs the daemon until SIGTERM or SIGINT, then shuts down gracefully.
///
/// # Errors
/// [`KvdError::Unsupported`] when the options ask for the L3 tier (part 2); otherwise the
/// errors of [`KvdServer::bind`] and of installing the signal handlers.
pub async fn run(options: KvdOptions) -> Result<(), KvdError> {
    if options.long_tier_requested {
        return Err(KvdError::Unsupported(
            "the L3 tier (--long-path / --long-paths) is not part of this build yet; \
             run without it for a RAM-only daemon"
                .to_owned(),
        ));
    }
    if options.shared_arena_bytes > 0 {
        tracing::warn!(
            shared_arena_bytes = options.shared_arena_bytes,
            "the shared arena is not part of this build yet: clients get inline replies \
             (hello_ack.shared_arena = nil)"
        );
    }
    let mut terminate = signal(SignalKind::terminate()).map_err(KvdError::Runtime)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(KvdError::Runtime)?;
    let server = KvdServer::bind(options).await?;
    let stop = server.shutdown_handle();
    let serving = server.serve();
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => return result,
        _ = terminate.recv() => tracing::info!("kvd received SIGTERM, shutting down"),
        _ = interrupt.recv() => tracing::info!("kvd received SIGINT, shutting down"),
    }
    stop.shutdown();
    serving.await
}

/// [`run`] on a new multi-threaded tokio runtime.
///
/// # Errors
/// As [`run`], and [`KvdError::Runtime`] when the runtime cannot start.
pub fn run_blocking(options: KvdOptions) -> Result<(), KvdError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-kvd")
        .build()
        .map_err(KvdError::Runtime)?
        .block_on(run(options))
}
