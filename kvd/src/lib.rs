//! `infera kvd`: the KV-cache daemon — the Unix-socket protocol, the L2 host-RAM store and its
//! shared arena, the L3 tablespace, the L4 remote tier, the long-term backend trait, and the
//! client library. It does not depend on the router.
//!
//! # Map
//! - [`proto`]: the wire protocol (PROTOCOLS.md §6), frames and their msgpack codecs.
//! - [`server`]: the daemon (socket ownership, connections, sweeper, checkpointer,
//!   prefetcher) in front of [`store::Store`].
//! - [`store`]: the tiered store — L2 (retention classes on
//!   `infera_core::retention::ClassedLru`, values on the heap or in the arena) in front of a
//!   [`long::LongStore`]; [`store::L2Store`] is L2 alone.
//! - [`arena`]: the shared arena — a memfd of fixed-size slots with seqlock headers, passed to
//!   clients over `SCM_RIGHTS`, read and written zero-copy (`get_shared_response`,
//!   `set_reserve`/`set_commit`).
//! - [`long`]: the long-term backend trait, its resolver (`--long-backend`) and
//!   [`long::Stacked`] (L3 with an L4 behind it).
//! - [`l4`]: the L4 tier over a remote store shared by a fleet — LMCache's Redis/Valkey layout,
//!   `lm://` server protocol and `s3://` buckets, a Mooncake Store; framed values,
//!   write-behind, deadlines and a breaker.
//! - [`tablespace`]: the L3 implementation — container files, journal, checkpoints, crash-safe
//!   recovery, O_DIRECT or buffered I/O through io_uring (or `pread`/`pwrite`).
//! - [`inventory`]: what the tiers hold, published as KV events (vLLM's layout) through the
//!   [`InventorySink`] port, and the tiers' load speeds.
//! - [`stats`]: counters and their Prometheus text; [`client`]: the async client.
//! - `sys` (private): the only `unsafe` code — the shared mapping, aligned buffers, io_uring.
//!
//! Entry points: [`run`] (async, until SIGTERM/SIGINT), [`run_publishing`] (the same, publishing
//! the inventory; what `infera kvd` calls on [`runtime`]) and [`run_blocking`] (builds the
//! runtime).

pub mod arena;
pub mod client;
pub mod inventory;
pub mod l4;
pub mod long;
pub(crate) mod lru;
pub mod proto;
pub mod server;
pub mod stats;
pub mod store;
pub(crate) mod sys;
pub mod tablespace;
pub(crate) mod wire;

pub use client::{ClientError, HelloAck, KvdClient};
pub use inventory::{InventoryPublishing, InventorySink, SinkError};
pub use long::{LongBackendConfig, LongStore};
pub use proto::{Namespace, SetAck, SetItem};
pub use server::{KvdError, KvdOptions, KvdServer, ShutdownHandle, StatsReader};
pub use stats::{Stats, metrics_text};
pub use tablespace::{IoMode, TablespaceConfig};

use tokio::signal::unix::{SignalKind, signal};

/// Runs the daemon until SIGTERM or SIGINT, then shuts down gracefully. `on_bound` sees the
/// bound daemon before it serves (on the daemon's runtime: it may spawn tasks, such as an
/// exporter of its [`StatsReader`]).
///
/// # Errors
/// The errors of [`KvdServer::bind`] and of installing the signal handlers.
pub async fn run(options: KvdOptions, on_bound: impl FnOnce(&KvdServer)) -> Result<(), KvdError> {
    run_publishing(options, None, on_bound).await
}

/// [`run`], publishing the inventory through `publishing` when given
/// ([`KvdServer::bind_publishing`]).
///
/// # Errors
/// As [`run`].
pub async fn run_publishing(
    options: KvdOptions,
    publishing: Option<InventoryPublishing>,
    on_bound: impl FnOnce(&KvdServer),
) -> Result<(), KvdError> {
    let mut terminate = signal(SignalKind::terminate()).map_err(KvdError::Runtime)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(KvdError::Runtime)?;
    let server = KvdServer::bind_publishing(options, publishing).await?;
    on_bound(&server);
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
pub fn run_blocking(
    options: KvdOptions,
    on_bound: impl FnOnce(&KvdServer),
) -> Result<(), KvdError> {
    runtime()?.block_on(run(options, on_bound))
}

/// The daemon's multi-threaded tokio runtime (threads named `infera-kvd`).
///
/// # Errors
/// [`KvdError::Runtime`] when it cannot start.
pub fn runtime() -> Result<tokio::runtime::Runtime, KvdError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-kvd")
        .build()
        .map_err(KvdError::Runtime)
}
