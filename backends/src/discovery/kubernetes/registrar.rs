//! Worker side of the Kubernetes backend: patch the own Pod's annotation, re-assert it, remove it.
//!
//! [`PodRecord`] is the worker's Pod. A registration owns a refresh task that patches the current
//! record again every refresh interval; the record and the patching share one async mutex, so an
//! `update` and a refresh never interleave. `deregister` cancels the task, which finishes any
//! patch it has started (never aborted mid-request, so it cannot land after the removal), joins
//! it, then patches the annotation away. Dropping a registration cancels the task only.

use super::{BACKEND, Connection, KubernetesConfig, Op, WORKER_INFO_ANNOTATION, timed};
use crate::discovery::{DiscoveryError, Registration, RegistrationHandle, Result};
use async_trait::async_trait;
use infera_core::event::WorkerRecord;
use infera_core::ids::WorkerId;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior, interval_at};
use tokio_util::sync::CancellationToken;

/// The worker's own Pod and what is registered on it.
#[derive(Debug)]
pub(super) struct PodRecord {
    connection: Connection,
    pod: String,
    config: Arc<KubernetesConfig>,
    /// The worker registered on this Pod, if any (one record per Pod).
    active: std::sync::Mutex<Option<WorkerId>>,
}

impl PodRecord {
    /// Reads the Pod (proving it exists and is readable) and clears a stale record.
    pub(super) async fn open(
        connection: Connection,
        pod: String,
        config: Arc<KubernetesConfig>,
    ) -> Result<Self> {
        let record = Self {
            connection,
            pod,
            config,
            active: std::sync::Mutex::new(None),
        };
        let api = record.api();
        let current = timed(
            &record.connection,
            record.config.request_timeout,
            Op::GET,
            api.get(&record.pod),
        )
        .await?;
        let stale = current
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(WORKER_INFO_ANNOTATION));
        if stale {
            tracing::info!(
                pod = %record.pod, namespace = %record.connection.namespace,
                "clearing the worker record an earlier container of this Pod left behind"
            );
            record.patch(None).await?;
        }
        Ok(record)
    }

    pub(super) fn pod(&self) -> &str {
        &self.pod
    }

    pub(super) fn namespace(&self) -> &str {
        &self.connection.namespace
    }

    fn api(&self) -> Api<Pod> {
        self.connection.pods()
    }

    /// Sets (`Some`) or removes (`None`) the annotation with a JSON merge patch.
    async fn patch(&self, value: Option<&str>) -> Result<()> {
        let body = serde_json::json!({
            "metadata": {"annotations": {WORKER_INFO_ANNOTATION: value}}
        });
        let api = self.api();
        let params = PatchParams::default();
        timed(
            &self.connection,
            self.config.request_timeout,
            Op::PATCH,
            api.patch(&self.pod, &params, &Patch::Merge(&body)),
        )
        .await?;
        Ok(())
    }

    fn set_active(&self, worker: Option<WorkerId>) {
        if let Ok(mut active) = self.active.lock() {
            *active = worker;
        }
    }

    fn active(&self) -> Option<WorkerId> {
        self.active.lock().ok().and_then(|a| a.clone())
    }
}

fn encode(record: &WorkerRecord) -> Result<String> {
    serde_json::to_string(record).map_err(|e| DiscoveryError::InvalidRecord {
        worker: record.worker_id.to_string(),
        reason: format!("cannot encode as JSON: {e}"),
    })
}

pub(super) async fn register(pod: &Arc<PodRecord>, record: &WorkerRecord) -> Result<Registration> {
    let worker = record.worker_id.clone();
    if worker.as_str().is_empty() {
        return Err(DiscoveryError::InvalidRecord {
            worker: String::new(),
            reason: "worker_id must be a non-empty \"host:port\"".to_owned(),
        });
    }
    if let Some(active) = pod.active()
        && active != worker
    {
        return Err(DiscoveryError::InvalidRecord {
            worker: worker.to_string(),
            reason: format!(
                "Pod {:?} already carries worker {:?}'s record; a Pod holds one worker \
                 (deregister it first)",
                pod.pod,
                active.as_str()
            ),
        });
    }
    let value = encode(record)?;
    pod.patch(Some(&value)).await?;
    pod.set_active(Some(worker.clone()));
    tracing::info!(
        worker = %worker, pod = %pod.pod, namespace = %pod.connection.namespace,
        refresh_s = pod.config.refresh_interval.as_secs_f64(),
        "registered through the Pod's {WORKER_INFO_ANNOTATION} annotation"
    );
    let current = Arc::new(Mutex::new(value));
    let cancel = CancellationToken::new();
    let refresh = tokio::spawn(refresh(pod.clone(), current.clone(), cancel.clone()));
    let handle = PodRegistration {
        pod: pod.clone(),
        worker: worker.clone(),
        current,
        cancel,
        refresh: Some(refresh),
    };
    Ok(Registration::new(worker, Box::new(handle)))
}

/// Patches the current record again every refresh interval until cancelled.
async fn refresh(pod: Arc<PodRecord>, current: Arc<Mutex<String>>, cancel: CancellationToken) {
    let period = pod.config.refresh_interval;
    let mut ticks = interval_at(Instant::now() + period, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let value = current.lock().await;
        if cancel.is_cancelled() {
            return;
        }
        if let Err(e) = pod.patch(Some(&value)).await {
            tracing::warn!(
                pod = %pod.pod, error = %e,
                "could not re-assert the worker record; retrying at the next refresh"
            );
        }
    }
}

#[derive(Debug)]
struct PodRegistration {
    pod: Arc<PodRecord>,
    worker: WorkerId,
    current: Arc<Mutex<String>>,
    cancel: CancellationToken,
    /// `Some` until deregistered.
    refresh: Option<JoinHandle<()>>,
}

#[async_trait]
impl RegistrationHandle for PodRegistration {
    async fn update(&self, record: &WorkerRecord) -> Result<()> {
        let value = encode(record)?;
        let mut current = self.current.lock().await;
        self.pod.patch(Some(&value)).await?;
        *current = value;
        Ok(())
    }

    async fn deregister(mut self: Box<Self>) -> Result<()> {
        self.cancel.cancel();
        if let Some(task) = self.refresh.take() {
            // Waits for a refresh patch in flight; the task never panics short of a bug.
            let _ = task.await;
        }
        let result = self.pod.patch(None).await;
        self.pod.set_active(None);
        match &result {
            Ok(()) => tracing::info!(
                worker = %self.worker, pod = %self.pod.pod,
                "deregistered: {WORKER_INFO_ANNOTATION} annotation removed"
            ),
            Err(e) => tracing::error!(
                worker = %self.worker, pod = %self.pod.pod, error = %e,
                "could not remove the worker record; unless this Pod is being deleted, the \
                 {BACKEND} discovery keeps routing to it while it drains"
            ),
        }
        result
    }
}

impl Drop for PodRegistration {
    fn drop(&mut self) {
        self.cancel.cancel();
        if self.refresh.is_some() {
            self.pod.set_active(None);
        }
    }
}
