//! The discovery port: how workers announce themselves and how the server learns the fleet.
//!
//! Two object-safe traits, used as `Arc<dyn …>`:
//!
//! - [`Registrar`] (worker side) publishes one [`WorkerRecord`] and returns a [`Registration`] that
//!   owns whatever keeps the record alive (the etcd lease keepalive task). The registration updates
//!   the record in place, and [`Registration::deregister`] removes it first thing on shutdown
//!   (PROTOCOLS.md §1: "revoke the lease first, then drain"). Dropping a registration without
//!   deregistering stops the keepalive, so the record expires on its own; no task outlives it.
//! - [`Discovery`] (server side) opens a [`DiscoveryStream`] of [`DiscoveryChange`]s: every worker
//!   present when the watch starts (as `Registered`), then each change. A changed record is
//!   `Registered` again; the fleet projection treats it as an update. Identical re-puts are not
//!   repeated. A backend that can tell a worker is shutting down before its record goes (a
//!   Kubernetes Pod with a `deletionTimestamp`) reports it as `Draining`: listed, not routed to.
//!
//! # Invariants every backend keeps
//!
//! - A record is identified by its `worker_id` (`host:port`), which must match the slot it is stored
//!   under (the etcd key suffix, the Pod); a mismatch is an invalid record.
//! - Invalid records (bad JSON, unknown engine, wrong worker id) are logged, counted in
//!   [`WatchStats::invalid_records`] and skipped; they never end the watch. A worker whose record
//!   turns invalid is deregistered, because its state is no longer known.
//! - A `Deregistered` is emitted only for a worker that was emitted as `Registered` on that stream.
//! - A `Draining` is emitted only for a worker that is `Registered` on that stream and not already
//!   draining. What follows it is either `Registered` (the drain is cancelled, or the record
//!   changed) or `Deregistered` (the worker left). Backends without a notion of draining (etcd:
//!   presence is the lease) never emit it.
//! - Backends reconnect by themselves with bounded exponential backoff; the stream only ends
//!   when it is dropped.
//!
//! The conformance suite every backend must pass is
//! `infera_backends::testing::discovery_conformance`.

use crate::event::WorkerRecord;
use crate::ids::WorkerId;
use async_trait::async_trait;
use futures::Stream;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Result of discovery operations.
pub type Result<T, E = DiscoveryError> = std::result::Result<T, E>;

/// Errors of the discovery port.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The backend could not be reached or did not answer in time.
    #[error("{backend} discovery unavailable during {op}: {message}")]
    Unavailable {
        backend: &'static str,
        op: &'static str,
        message: String,
    },
    /// The backend answered, but refused the operation (permissions, bad argument).
    #[error("{backend} discovery rejected {op}: {message}")]
    Rejected {
        backend: &'static str,
        op: &'static str,
        message: String,
    },
    /// A worker record that cannot be published or was read back malformed.
    #[error("invalid worker record for {worker:?}: {reason}")]
    InvalidRecord { worker: String, reason: String },
    /// The backend's configuration is unusable.
    #[error("invalid discovery configuration: {0}")]
    InvalidConfig(String),
}

impl DiscoveryError {
    /// Whether the same call may succeed later (the backend may come back).
    pub fn is_retryable(&self) -> bool {
        match self {
            DiscoveryError::Unavailable { .. } => true,
            DiscoveryError::Rejected { .. }
            | DiscoveryError::InvalidRecord { .. }
            | DiscoveryError::InvalidConfig(_) => false,
        }
    }
}

/// One change of the fleet as seen by a discovery backend.
#[derive(Debug, Clone, PartialEq)]
pub enum DiscoveryChange {
    /// A worker appeared, or its record changed.
    Registered(WorkerRecord),
    /// A worker left routing.
    Deregistered {
        worker: WorkerId,
        /// Why it left (lease expired or revoked, record became invalid…), for operators.
        reason: String,
    },
    /// A registered worker is shutting down: it stays listed and finishes its in-flight work,
    /// but gets no new requests. See the module invariants for what may follow.
    Draining {
        worker: WorkerId,
        /// Why it drains (Pod being deleted…), for operators.
        reason: String,
    },
}

impl DiscoveryChange {
    /// The worker this change is about.
    pub fn worker(&self) -> &WorkerId {
        match self {
            DiscoveryChange::Registered(record) => &record.worker_id,
            DiscoveryChange::Deregistered { worker, .. }
            | DiscoveryChange::Draining { worker, .. } => worker,
        }
    }
}

/// Worker side of discovery: publishes a record and keeps it alive.
#[async_trait]
pub trait Registrar: Send + Sync + fmt::Debug {
    /// Publishes `record` and starts keeping it alive.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidRecord`] if the record cannot be stored (empty worker id);
    /// [`DiscoveryError::Unavailable`] (retryable) if the backend cannot be reached.
    async fn register(&self, record: &WorkerRecord) -> Result<Registration>;
}

/// Server side of discovery: a stream of fleet changes.
#[async_trait]
pub trait Discovery: Send + Sync + fmt::Debug {
    /// Lists the current workers and starts watching for changes.
    ///
    /// The stream yields every current worker as `Registered` first, then changes, reconnecting by
    /// itself; it ends only when dropped, which stops its background task.
    ///
    /// # Errors
    /// [`DiscoveryError::Unavailable`] (retryable) if the initial listing fails.
    async fn watch(&self) -> Result<DiscoveryStream>;
}

/// What a backend implements behind a [`Registration`].
#[async_trait]
pub trait RegistrationHandle: Send + Sync + fmt::Debug {
    /// Replaces the published record (same worker id).
    async fn update(&self, record: &WorkerRecord) -> Result<()>;
    /// Stops the keepalive and removes the record.
    async fn deregister(self: Box<Self>) -> Result<()>;
}

/// A published worker record, kept alive until deregistered or dropped.
///
/// Dropping it without [`Registration::deregister`] stops the keepalive; the backend then removes
/// the record when its lease (or equivalent) expires.
#[derive(Debug)]
pub struct Registration {
    worker: WorkerId,
    handle: Box<dyn RegistrationHandle>,
}

impl Registration {
    /// Wraps a backend's handle for `worker`.
    pub fn new(worker: WorkerId, handle: Box<dyn RegistrationHandle>) -> Self {
        Self { worker, handle }
    }

    /// The registered worker.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    /// Replaces the published record; watchers see it as `Registered` again.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidRecord`] if `record` names another worker;
    /// [`DiscoveryError::Unavailable`] (retryable) if the backend cannot be reached.
    pub async fn update(&self, record: &WorkerRecord) -> Result<()> {
        if record.worker_id != self.worker {
            return Err(DiscoveryError::InvalidRecord {
                worker: record.worker_id.to_string(),
                reason: format!(
                    "this registration is for worker {:?}; register the new id separately",
                    self.worker.as_str()
                ),
            });
        }
        self.handle.update(record).await
    }

    /// Removes the record (the etcd lease is revoked) and stops the keepalive. Call it before
    /// draining, so that no new work arrives.
    ///
    /// # Errors
    /// [`DiscoveryError::Unavailable`] if the backend cannot be reached; the record then survives
    /// until its lease expires.
    pub async fn deregister(self) -> Result<()> {
        self.handle.deregister().await
    }
}

/// Counters of one watch stream.
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Records that could not be decoded or named the wrong worker (skipped).
    pub invalid_records: AtomicU64,
    /// Times the watch was re-established after an error or disconnect.
    pub reconnects: AtomicU64,
    /// Times the backend had to list everything again (etcd: the resume revision was compacted).
    pub relists: AtomicU64,
}

impl WatchStats {
    /// Reads one counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Adds one to `counter`.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A stream of [`DiscoveryChange`]s, fed by a backend task that stops when the stream is dropped.
#[derive(Debug)]
pub struct DiscoveryStream {
    rx: mpsc::Receiver<DiscoveryChange>,
    stats: Arc<WatchStats>,
    task: JoinHandle<()>,
}

impl DiscoveryStream {
    /// Wraps the receiving end of a backend's bounded channel and the task feeding it.
    pub fn new(
        rx: mpsc::Receiver<DiscoveryChange>,
        stats: Arc<WatchStats>,
        task: JoinHandle<()>,
    ) -> Self {
        Self { rx, stats, task }
    }

    /// The next change; `None` only if the backend task ended (it does not, short of a panic).
    pub async fn recv(&mut self) -> Option<DiscoveryChange> {
        self.rx.recv().await
    }

    /// This stream's counters.
    pub fn stats(&self) -> &Arc<WatchStats> {
        &self.stats
    }
}

impl Stream for DiscoveryStream {
    type Item = DiscoveryChange;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for DiscoveryStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unavailability_is_retryable() {
        let unavailable = DiscoveryError::Unavailable {
            backend: "etcd",
            op: "put",
            message: "connection refused".into(),
        };
        assert!(unavailable.is_retryable());
        assert!(!DiscoveryError::InvalidConfig("x".into()).is_retryable());
    }
}
