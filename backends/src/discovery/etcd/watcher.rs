//! Server side of the etcd backend: range, watch from the next revision, resume, re-list.
//!
//! State: the records emitted as `Registered` (by worker id) and the revision to resume from
//! (`None` when a re-list is needed). The resume revision only moves past revisions whose events
//! were handled: an event's `mod_revision`, or the header of a progress notification (etcd sends
//! those only once every earlier event of the watch has been delivered).

use super::proto::{EventType, KeyValue, WatchCreateRequest, prefix_range_end};
use super::{BACKEND, EtcdDiscovery, call};
use crate::discovery::{
    Backoff, DiscoveryChange, DiscoveryError, Result, WatchStats, decode_record,
};
use infera_core::event::WorkerRecord;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The receiving side is gone: the stream was dropped, so the task ends.
struct Closed;

/// How one watch attempt ended.
enum WatchEnd {
    Closed,
    /// The resume revision was compacted; etcd cannot replay from there.
    Compacted {
        compact_revision: i64,
    },
    Failed(String),
}

pub(super) struct Watcher {
    backend: EtcdDiscovery,
    tx: mpsc::Sender<DiscoveryChange>,
    stats: Arc<WatchStats>,
    known: HashMap<String, WorkerRecord>,
    /// Changes from the initial listing, sent first by [`Watcher::run`].
    initial: Vec<DiscoveryChange>,
    /// Next revision to watch from; `None` means list again first.
    next_revision: Option<i64>,
}

impl Watcher {
    /// Lists the prefix once, so that an unreachable etcd is reported to the caller of `watch`.
    pub(super) async fn start(
        backend: EtcdDiscovery,
        tx: mpsc::Sender<DiscoveryChange>,
        stats: Arc<WatchStats>,
    ) -> Result<Self> {
        let mut watcher = Self {
            backend,
            tx,
            stats,
            known: HashMap::new(),
            initial: Vec::new(),
            next_revision: None,
        };
        let (revision, kvs) = watcher.range().await?;
        watcher.initial = watcher.reconcile(&kvs);
        watcher.next_revision = Some(revision + 1);
        tracing::info!(
            prefix = %watcher.backend.prefix, workers = watcher.known.len(), revision,
            "etcd discovery: listed workers"
        );
        Ok(watcher)
    }

    /// Sends the initial listing, then watches until the stream is dropped.
    pub(super) async fn run(mut self) {
        for change in std::mem::take(&mut self.initial) {
            if self.tx.send(change).await.is_err() {
                return;
            }
        }
        let config = self.backend.config.clone();
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        loop {
            let next = match self.next_revision {
                Some(next) => next,
                None => match self.relist().await {
                    Ok(Ok(next)) => next,
                    Ok(Err(Closed)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "etcd discovery: re-list failed; retrying");
                        backoff.wait().await;
                        continue;
                    }
                },
            };
            match self.watch_from(next, &mut backoff).await {
                WatchEnd::Closed => return,
                WatchEnd::Compacted { compact_revision } => {
                    tracing::warn!(
                        resume_revision = next,
                        compact_revision,
                        "etcd discovery: resume revision compacted; listing again"
                    );
                    self.next_revision = None;
                }
                WatchEnd::Failed(reason) => {
                    WatchStats::bump(&self.stats.reconnects);
                    tracing::warn!(
                        reason = %reason, resume_revision = ?self.next_revision,
                        "etcd discovery: watch interrupted; resuming"
                    );
                    backoff.wait().await;
                }
            }
        }
    }

    /// Ranges the prefix: the store revision and every key-value under it.
    async fn range(&self) -> Result<(i64, Vec<KeyValue>)> {
        let prefix = self.backend.prefix.as_bytes();
        let range_end = prefix_range_end(prefix);
        let response = call("range", self.backend.client.range(prefix, &range_end)).await?;
        let revision =
            response
                .header
                .map(|h| h.revision)
                .ok_or_else(|| DiscoveryError::Unavailable {
                    backend: BACKEND,
                    op: "range",
                    message: "response without a header".to_owned(),
                })?;
        Ok((revision, response.kvs))
    }

    /// Lists again after a compaction and emits the difference; returns the next revision.
    async fn relist(&mut self) -> Result<Result<i64, Closed>> {
        let (revision, kvs) = self.range().await?;
        WatchStats::bump(&self.stats.relists);
        let changes = self.reconcile(&kvs);
        tracing::info!(
            workers = self.known.len(),
            changes = changes.len(),
            revision,
            "etcd discovery: listed workers again"
        );
        for change in changes {
            if self.tx.send(change).await.is_err() {
                return Ok(Err(Closed));
            }
        }
        self.next_revision = Some(revision + 1);
        Ok(Ok(revision + 1))
    }

    /// Replaces the known set by a listing; returns the changes that turn the old set into it.
    fn reconcile(&mut self, kvs: &[KeyValue]) -> Vec<DiscoveryChange> {
        let mut listed = HashMap::with_capacity(kvs.len());
        for kv in kvs {
            if let Some((worker, record)) = self.decode(kv) {
                listed.insert(worker, record);
            }
        }
        let mut changes = Vec::new();
        let mut vanished: Vec<_> = self
            .known
            .keys()
            .filter(|worker| !listed.contains_key(*worker))
            .cloned()
            .collect();
        vanished.sort();
        for worker in vanished {
            self.known.remove(&worker);
            changes.push(DiscoveryChange::Deregistered {
                worker: worker.into(),
                reason: "absent from etcd when listed again (deleted, or its record became \
                         invalid, while the watch was disconnected)"
                    .to_owned(),
            });
        }
        let mut current: Vec<_> = listed.into_iter().collect();
        current.sort_by(|a, b| a.0.cmp(&b.0));
        for (worker, record) in current {
            if self.known.get(&worker) != Some(&record) {
                self.known.insert(worker, record.clone());
                changes.push(DiscoveryChange::Registered(record));
            }
        }
        changes
    }

    /// The worker id of a key under the prefix and its decoded record; invalid ones are logged,
    /// counted and `None`.
    fn decode(&self, kv: &KeyValue) -> Option<(String, WorkerRecord)> {
        let worker = self.worker_of(&kv.key)?;
        let record = self.decode_value(&worker, kv)?;
        Some((worker, record))
    }

    fn decode_value(&self, worker: &str, kv: &KeyValue) -> Option<WorkerRecord> {
        match decode_record(worker, &kv.value) {
            Ok(record) => Some(record),
            Err(reason) => {
                WatchStats::bump(&self.stats.invalid_records);
                tracing::warn!(
                    key = %String::from_utf8_lossy(&kv.key), reason = %reason,
                    "etcd discovery: skipping invalid worker record"
                );
                None
            }
        }
    }

    fn worker_of(&self, key: &[u8]) -> Option<String> {
        let worker = key.strip_prefix(self.backend.prefix.as_bytes())?;
        match std::str::from_utf8(worker) {
            Ok(worker) => Some(worker.to_owned()),
            Err(_) => {
                WatchStats::bump(&self.stats.invalid_records);
                tracing::warn!(
                    key = %String::from_utf8_lossy(key),
                    "etcd discovery: skipping a key that is not UTF-8"
                );
                None
            }
        }
    }

    /// Watches from `start` until the stream ends, handling events as they come.
    async fn watch_from(&mut self, start: i64, backoff: &mut Backoff) -> WatchEnd {
        let prefix = self.backend.prefix.as_bytes();
        let create = WatchCreateRequest {
            key: prefix.to_vec(),
            range_end: prefix_range_end(prefix),
            start_revision: start,
            progress_notify: true,
        };
        let mut stream = match self.backend.client.watch(create).await {
            Ok(stream) => stream,
            Err(e) => return WatchEnd::Failed(format!("starting the watch: {e}")),
        };
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return WatchEnd::Failed("watch stream closed by etcd".to_owned()),
                Err(e) => return WatchEnd::Failed(format!("watch stream: {e}")),
            };
            if response.canceled {
                if response.compact_revision > 0 {
                    return WatchEnd::Compacted {
                        compact_revision: response.compact_revision,
                    };
                }
                return WatchEnd::Failed(format!(
                    "watch canceled by etcd: {}",
                    response.cancel_reason
                ));
            }
            if response.created {
                backoff.reset();
                tracing::debug!(start, endpoint = %stream.endpoint(), "etcd discovery: watching");
                continue;
            }
            if response.events.is_empty() {
                // A progress notification: every event up to the header revision was delivered.
                if let Some(header) = &response.header {
                    self.advance(header.revision + 1);
                }
                continue;
            }
            for event in &response.events {
                let Some(kv) = &event.kv else { continue };
                let revision = kv.mod_revision;
                let change = match event.r#type() {
                    EventType::Put => self.on_put(kv),
                    EventType::Delete => self.on_delete(&kv.key),
                };
                if let Some(change) = change
                    && self.tx.send(change).await.is_err()
                {
                    return WatchEnd::Closed;
                }
                self.advance(revision + 1);
            }
        }
    }

    fn advance(&mut self, next: i64) {
        if self.next_revision.is_none_or(|current| next > current) {
            self.next_revision = Some(next);
        }
    }

    fn on_put(&mut self, kv: &KeyValue) -> Option<DiscoveryChange> {
        let worker = self.worker_of(&kv.key)?;
        match self.decode_value(&worker, kv) {
            Some(record) => {
                if self.known.get(&worker) == Some(&record) {
                    return None;
                }
                self.known.insert(worker, record.clone());
                Some(DiscoveryChange::Registered(record))
            }
            None => self
                .known
                .remove(&worker)
                .map(|_| DiscoveryChange::Deregistered {
                    worker: worker.into(),
                    reason: "its etcd record became invalid".to_owned(),
                }),
        }
    }

    fn on_delete(&mut self, key: &[u8]) -> Option<DiscoveryChange> {
        let worker = self.worker_of(key)?;
        self.known
            .remove(&worker)
            .map(|_| DiscoveryChange::Deregistered {
                worker: worker.into(),
                reason: "etcd key deleted (lease revoked or expired, or key removed)".to_owned(),
            })
    }
}
