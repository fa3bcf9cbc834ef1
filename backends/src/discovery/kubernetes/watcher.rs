//! Server side of the Kubernetes backend: list, watch from the list's version, resume, re-list.
//!
//! State: the [`Fleet`] emitted on this stream and the `resourceVersion` to resume from (`None`
//! when a re-list is needed). The version advances with every event and bookmark handled, so a
//! resumed watch neither repeats nor skips one. A watch that ends cleanly (the server's
//! `timeoutSeconds`, or a connection dropped mid-stream, which the client reports the same way)
//! resumes at once; a stream that breaks with an error resumes after a backoff; a watch request
//! that fails is retried after a backoff, and once it failed twice in a row (the API server
//! unreachable or refusing, not a one-off reset of a pooled connection) the state is listed again
//! first, since it may have moved on arbitrarily meanwhile; a 410 Gone re-lists at once. A watch that stays silent
//! past its own timeout (no event, no bookmark, no end) is presumed dead and treated as broken.

use super::fleet::{Fleet, judge};
use super::{BACKEND, Connection, KubernetesConfig, Op, api_code, map_err, timed};
use crate::discovery::{Backoff, DiscoveryChange, Result, WatchStats};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, WatchEvent, WatchParams};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The receiving side is gone: the stream was dropped, so the task ends.
struct Closed;

/// How one watch request ended.
enum WatchEnd {
    Closed,
    /// The stream ended; `productive` if it delivered anything or lasted a while.
    Ended {
        productive: bool,
    },
    /// 410 Gone: the version to resume from is too old.
    Expired(String),
    /// The established stream broke; its version is still good.
    Broken(String),
    /// The watch request itself failed, or the server ended it with an error.
    Failed(String),
}

/// After this many watch requests failed in a row (the API server unreachable or refusing, not
/// a one-off reset of a pooled connection), the state is listed again before watching.
const RELIST_AFTER_FAILURES: u32 = 2;

/// A watch that delivered nothing and ended sooner than this is not a normal timeout.
const MIN_PRODUCTIVE_WATCH: Duration = Duration::from_secs(1);

pub(super) struct Watcher {
    connection: Connection,
    config: Arc<KubernetesConfig>,
    tx: mpsc::Sender<DiscoveryChange>,
    stats: Arc<WatchStats>,
    fleet: Fleet,
    /// Changes from the initial listing, sent first by [`Watcher::run`].
    initial: Vec<DiscoveryChange>,
    /// Version to watch from; `None` means list again first.
    resource_version: Option<String>,
}

impl Watcher {
    /// Lists once, so that an unreachable API server or missing RBAC is reported to the caller.
    pub(super) async fn start(
        connection: Connection,
        config: Arc<KubernetesConfig>,
        tx: mpsc::Sender<DiscoveryChange>,
        stats: Arc<WatchStats>,
    ) -> Result<Self> {
        let mut watcher = Self {
            connection,
            config,
            tx,
            stats,
            fleet: Fleet::default(),
            initial: Vec::new(),
            resource_version: None,
        };
        if watcher.config.label_selector.is_empty() {
            tracing::warn!(
                namespace = %watcher.connection.namespace,
                "kubernetes discovery: no label selector; watching every Pod of the namespace"
            );
        }
        let (version, pods) = watcher.list().await?;
        watcher.initial = watcher.reconcile(pods);
        tracing::info!(
            namespace = %watcher.connection.namespace, selector = %watcher.config.label_selector,
            workers = watcher.fleet.len(), resource_version = %version,
            "kubernetes discovery: listed worker Pods"
        );
        watcher.resource_version = Some(version);
        Ok(watcher)
    }

    /// Sends the initial listing, then watches until the stream is dropped.
    pub(super) async fn run(mut self) {
        for change in std::mem::take(&mut self.initial) {
            if self.tx.send(change).await.is_err() {
                return;
            }
        }
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        // Consecutive failed watch requests.
        let mut failures = 0u32;
        loop {
            let version = match self.resource_version.clone() {
                Some(version) => version,
                None => match self.relist().await {
                    Ok(Ok(version)) => version,
                    Ok(Err(Closed)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "kubernetes discovery: re-list failed; retrying");
                        backoff.wait().await;
                        continue;
                    }
                },
            };
            let end = self.watch_from(&version, &mut backoff).await;
            if !matches!(end, WatchEnd::Failed(_)) {
                failures = 0;
            }
            match end {
                WatchEnd::Closed => return,
                WatchEnd::Ended { productive } => {
                    WatchStats::bump(&self.stats.reconnects);
                    tracing::debug!(
                        resource_version = ?self.resource_version,
                        "kubernetes discovery: watch ended; resuming"
                    );
                    if productive {
                        backoff.reset();
                    } else {
                        backoff.wait().await;
                    }
                }
                WatchEnd::Expired(message) => {
                    tracing::info!(
                        resource_version = %version, message = %message,
                        "kubernetes discovery: watch version expired (410 Gone); listing again"
                    );
                    self.resource_version = None;
                }
                WatchEnd::Broken(reason) => {
                    WatchStats::bump(&self.stats.reconnects);
                    tracing::warn!(
                        reason = %reason, resource_version = ?self.resource_version,
                        "kubernetes discovery: watch stream broke; resuming after a backoff"
                    );
                    backoff.wait().await;
                }
                WatchEnd::Failed(reason) => {
                    WatchStats::bump(&self.stats.reconnects);
                    failures += 1;
                    if failures >= RELIST_AFTER_FAILURES {
                        tracing::warn!(
                            reason = %reason, failures,
                            "kubernetes discovery: watch request failed again; listing again after a backoff"
                        );
                        self.resource_version = None;
                    } else {
                        tracing::info!(
                            reason = %reason,
                            "kubernetes discovery: watch request failed; retrying after a backoff"
                        );
                    }
                    backoff.wait().await;
                }
            }
        }
    }

    /// Lists the matching Pods: the list's version and the Pods.
    async fn list(&self) -> Result<(String, Vec<Pod>)> {
        let params = ListParams::default().labels(&self.config.label_selector);
        let api = self.connection.pods();
        let list = timed(
            &self.connection,
            self.config.request_timeout,
            Op::LIST,
            api.list(&params),
        )
        .await?;
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        Ok((version, list.items))
    }

    /// Lists again and emits the difference; returns the version to watch from.
    async fn relist(&mut self) -> Result<Result<String, Closed>> {
        let (version, pods) = self.list().await?;
        WatchStats::bump(&self.stats.relists);
        let changes = self.reconcile(pods);
        tracing::info!(
            workers = self.fleet.len(), changes = changes.len(), resource_version = %version,
            "kubernetes discovery: listed worker Pods again"
        );
        for change in changes {
            if self.tx.send(change).await.is_err() {
                return Ok(Err(Closed));
            }
        }
        self.resource_version = Some(version.clone());
        Ok(Ok(version))
    }

    fn reconcile(&mut self, pods: Vec<Pod>) -> Vec<DiscoveryChange> {
        let listed = pods
            .iter()
            .filter_map(|pod| Some((pod.metadata.name.clone()?, judge(pod))))
            .collect();
        self.fleet.reconcile(listed, &self.stats)
    }

    /// Watches from `version` until the stream ends, handling events as they come. The backoff is
    /// reset once the watch delivers something.
    async fn watch_from(&mut self, version: &str, backoff: &mut Backoff) -> WatchEnd {
        let server_timeout = u32::try_from(self.config.watch_timeout.as_secs()).unwrap_or(u32::MAX);
        let params = WatchParams::default()
            .labels(&self.config.label_selector)
            .timeout(server_timeout);
        let api = self.connection.pods();
        let opened = Instant::now();
        let stream =
            match tokio::time::timeout(self.config.request_timeout, api.watch(&params, version))
                .await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) if api_code(&e) == Some(410) => return WatchEnd::Expired(e.to_string()),
                Ok(Err(e)) => {
                    return WatchEnd::Failed(map_err(&self.connection, Op::WATCH, &e).to_string());
                }
                Err(_) => {
                    return WatchEnd::Failed(format!(
                        "{BACKEND}: opening the watch took longer than {:?}",
                        self.config.request_timeout
                    ));
                }
            };
        let mut stream = std::pin::pin!(stream);
        let silence = self.config.watch_timeout + self.config.request_timeout;
        let mut delivered = false;
        loop {
            let event = match tokio::time::timeout(silence, stream.next()).await {
                Err(_) => {
                    return WatchEnd::Broken(format!(
                        "the watch stayed silent for {silence:?}; presuming the connection dead"
                    ));
                }
                Ok(None) => {
                    return WatchEnd::Ended {
                        productive: delivered || opened.elapsed() >= MIN_PRODUCTIVE_WATCH,
                    };
                }
                Ok(Some(Err(e))) if api_code(&e) == Some(410) => {
                    return WatchEnd::Expired(e.to_string());
                }
                Ok(Some(Err(e))) => return WatchEnd::Broken(format!("watch stream: {e}")),
                Ok(Some(Ok(event))) => event,
            };
            if !delivered {
                delivered = true;
                backoff.reset();
            }
            let (pod, changes) = match event {
                WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                    let Some(name) = pod.metadata.name.clone() else {
                        continue;
                    };
                    let changes = self.fleet.observe(&name, judge(&pod), &self.stats);
                    (pod, changes)
                }
                WatchEvent::Deleted(pod) => {
                    let Some(name) = pod.metadata.name.clone() else {
                        continue;
                    };
                    let changes = self.fleet.forget(&name, "pod deleted");
                    (pod, changes)
                }
                WatchEvent::Bookmark(bookmark) => {
                    self.resource_version = Some(bookmark.metadata.resource_version);
                    continue;
                }
                WatchEvent::Error(status) if status.code == 410 => {
                    return WatchEnd::Expired(status.message);
                }
                WatchEvent::Error(status) => {
                    return WatchEnd::Failed(format!(
                        "watch error event {}: {}",
                        status.code, status.message
                    ));
                }
            };
            for change in changes {
                if self.tx.send(change).await.is_err() {
                    return WatchEnd::Closed;
                }
            }
            if let Some(version) = pod.metadata.resource_version {
                self.resource_version = Some(version);
            }
        }
    }
}
