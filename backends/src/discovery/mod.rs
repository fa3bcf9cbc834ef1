//! The discovery port: how workers announce themselves and how the server learns the fleet.
//!
//! Two object-safe traits, used as `Arc<dyn …>`:
//!
//! - [`Registrar`] (worker side) publishes one [`WorkerRecord`] and returns a [`Registration`] that
//!   owns whatever keeps the record alive (the etcd lease keepalive task). The registration updates
//!   the record in place, and [`Registration::deregister`] removes it first thing on shutdown
//!   (PROTOCOLS §1: "revoke the lease first, then drain"). Dropping a registration without
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
//! - Backends reconnect by themselves with bounded exponential backoff ([`Backoff`]); the stream only
//!   ends when it is dropped.
//!
//! The conformance suite every backend must pass is
//! [`crate::testing::discovery_conformance`].

pub mod etcd;
pub mod kubernetes;

use async_trait::async_trait;
use futures::Stream;
use infera_core::event::WorkerRecord;
use infera_core::ids::WorkerId;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use etcd::{EtcdConfig, EtcdDiscovery};
pub use kubernetes::{KubernetesConfig, KubernetesDiscovery, KubernetesRegistrar};

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

    pub(crate) fn bump(counter: &AtomicU64) {
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

/// Decodes a stored record for the worker whose slot it was found in.
///
/// Fields the Python workers write as `null` where ours have a default (`dp_rank`, `dp_size`,
/// `request_transport`, `disagg_meta`, `kv_events_endpoint`, `kv`) are read as absent.
///
/// # Errors
/// A human-readable reason: not JSON, not a record (unknown engine, missing field), or a
/// `worker_id` other than `slot_worker`.
pub fn decode_record(slot_worker: &str, value: &[u8]) -> std::result::Result<WorkerRecord, String> {
    let mut json: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
    if let Some(object) = json.as_object_mut() {
        for field in NULL_MEANS_DEFAULT {
            if object.get(*field).is_some_and(serde_json::Value::is_null) {
                object.remove(*field);
            }
        }
    }
    let record: WorkerRecord =
        serde_json::from_value(json).map_err(|e| format!("not a worker record: {e}"))?;
    if record.worker_id.as_str() != slot_worker {
        return Err(format!(
            "worker_id {:?} does not match its slot {slot_worker:?}",
            record.worker_id.as_str()
        ));
    }
    Ok(record)
}

const NULL_MEANS_DEFAULT: &[&str] = &[
    "dp_rank",
    "dp_size",
    "request_transport",
    "disagg_meta",
    "kv_events_endpoint",
    "kv",
];

/// Bounded exponential backoff for reconnect loops: `initial`, doubling, capped at `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and never waiting longer than `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(1));
        Self {
            initial,
            max: max.max(initial),
            next: initial,
        }
    }

    /// The delay to wait now; the next one doubles, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Waits for [`Backoff::next_delay`].
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// Back to the initial delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python_record() -> serde_json::Value {
        serde_json::json!({
            "worker_id": "10.0.0.5:8000",
            "url": "http://10.0.0.5:8000",
            "model_name": "deepseek-ai/DeepSeek-V4",
            "engine": "sglang",
            "disagg_mode": null,
            "disagg_meta": null,
            "kv_events_endpoint": null,
            "kv_block_size": 64,
            "dp_rank": null,
            "dp_size": null,
            "request_transport": "http",
            "status": "active",
        })
    }

    #[test]
    fn python_nulls_read_as_defaults_and_extras_are_kept() {
        let bytes = serde_json::to_vec(&python_record()).unwrap();
        let record = decode_record("10.0.0.5:8000", &bytes).unwrap();
        assert_eq!(record.dp_rank, 0);
        assert_eq!(record.dp_size, 1);
        assert_eq!(record.disagg_mode, infera_core::event::Role::Mixed);
        assert_eq!(
            record.extra.get("status"),
            Some(&serde_json::json!("active"))
        );
    }

    #[test]
    fn invalid_records_are_reported() {
        assert!(decode_record("a:1", b"{not json").is_err());
        let mut unknown_engine = python_record();
        unknown_engine["engine"] = serde_json::json!("tensorrt");
        let bytes = serde_json::to_vec(&unknown_engine).unwrap();
        assert!(decode_record("10.0.0.5:8000", &bytes).is_err());
        let bytes = serde_json::to_vec(&python_record()).unwrap();
        let err = decode_record("10.0.0.6:8000", &bytes).unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let delays: Vec<_> = (0..4).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }

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
