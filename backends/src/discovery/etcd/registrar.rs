//! Worker side of the etcd backend: lease grant, put, keepalive task, revoke.
//!
//! The keepalive task is owned by the [`EtcdRegistration`]: `deregister` aborts and joins it before
//! revoking the lease (so it cannot re-create the record behind the revoke), and dropping the
//! registration aborts it, after which etcd expires the lease within its TTL. The current lease id
//! and record live behind one async mutex, so an `update` and the task's re-registration after a
//! lost lease never interleave.

use super::client::EtcdClient;
use super::{BACKEND, EtcdDiscovery, call};
use crate::discovery::{Backoff, DiscoveryError, Registration, RegistrationHandle, Result};
use async_trait::async_trait;
use infera_core::event::WorkerRecord;
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::{Instant, interval_at};

/// What the keepalive task and the handle share.
#[derive(Debug)]
struct Published {
    lease: i64,
    value: Vec<u8>,
}

#[derive(Debug)]
struct EtcdRegistration {
    backend: EtcdDiscovery,
    worker: String,
    key: String,
    published: Arc<Mutex<Published>>,
    /// `Some` until deregistered.
    keepalive: Option<JoinHandle<()>>,
}

pub(super) async fn register(
    backend: &EtcdDiscovery,
    record: &WorkerRecord,
) -> Result<Registration> {
    let worker = record.worker_id.as_str().to_owned();
    if worker.is_empty() || worker.contains('/') {
        return Err(DiscoveryError::InvalidRecord {
            worker,
            reason: "worker_id must be a non-empty \"host:port\" without '/'".to_owned(),
        });
    }
    let value = encode(record)?;
    let key = backend.key_for(&worker);
    let lease = grant_and_put(backend, &key, &value).await?;
    tracing::info!(
        worker = %worker, key = %key, lease = format_args!("{lease:x}"),
        ttl_s = backend.config.lease_ttl.as_secs(), "registered with etcd"
    );
    let published = Arc::new(Mutex::new(Published { lease, value }));
    let keepalive = tokio::spawn(keep_alive(
        backend.clone(),
        worker.clone(),
        key.clone(),
        published.clone(),
    ));
    let handle = EtcdRegistration {
        backend: backend.clone(),
        worker: worker.clone(),
        key,
        published,
        keepalive: Some(keepalive),
    };
    Ok(Registration::new(worker.into(), Box::new(handle)))
}

fn encode(record: &WorkerRecord) -> Result<Vec<u8>> {
    serde_json::to_vec(record).map_err(|e| DiscoveryError::InvalidRecord {
        worker: record.worker_id.to_string(),
        reason: format!("cannot encode as JSON: {e}"),
    })
}

/// Grants a lease and puts `value` on it; returns the lease id.
async fn grant_and_put(backend: &EtcdDiscovery, key: &str, value: &[u8]) -> Result<i64> {
    let ttl = i64::try_from(backend.config.lease_ttl.as_secs()).unwrap_or(i64::MAX);
    let client = &backend.client;
    let lease = call("lease grant", client.lease_grant(ttl)).await?;
    if let Err(e) = call("put", client.put(key.as_bytes(), value, lease)).await {
        // Do not leave an empty lease behind; it would expire anyway.
        let _ = client.lease_revoke(lease).await;
        return Err(e);
    }
    Ok(lease)
}

#[async_trait]
impl RegistrationHandle for EtcdRegistration {
    async fn update(&self, record: &WorkerRecord) -> Result<()> {
        let value = encode(record)?;
        let mut published = self.published.lock().await;
        let put = self
            .backend
            .client
            .put(self.key.as_bytes(), &value, published.lease);
        call("put", put).await?;
        published.value = value;
        tracing::info!(worker = %self.worker, "updated etcd registration");
        Ok(())
    }

    async fn deregister(self: Box<Self>) -> Result<()> {
        let mut this = self;
        if let Some(task) = this.keepalive.take() {
            task.abort();
            // Joining an aborted task only reports the abort; what matters is that it stopped, so
            // it cannot register again behind the revoke.
            let _ = task.await;
        }
        let lease = this.published.lock().await.lease;
        match revoke(&this.backend, &this.key, lease).await {
            Ok(()) => {
                tracing::info!(worker = %this.worker, lease = format_args!("{lease:x}"), "deregistered from etcd (lease revoked)");
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    worker = %this.worker, error = %e,
                    ttl_s = this.backend.config.lease_ttl.as_secs(),
                    "lease revoke failed; the record survives until its lease expires, so work may still arrive while draining"
                );
                Err(e)
            }
        }
    }
}

/// Revokes `lease`, deleting the record under `key`. When etcd no longer knows the lease (it
/// was lost, and the keepalive task put the record on a fresh one that it was stopped before
/// recording), revokes the lease the record holds now instead, so the record never outlives
/// the deregistration.
async fn revoke(backend: &EtcdDiscovery, key: &str, lease: i64) -> Result<()> {
    let client = &backend.client;
    match client.lease_revoke(lease).await {
        Ok(_) => Ok(()),
        Err(e) if e.is_lease_not_found() => {
            let now = call("get", client.range(key.as_bytes(), b"")).await?;
            match now.kvs.first().map(|kv| kv.lease).filter(|l| *l != 0) {
                Some(current) => call("lease revoke", client.lease_revoke(current))
                    .await
                    .map(drop),
                None => Ok(()),
            }
        }
        Err(e) => Err(super::map_err("lease revoke", e)),
    }
}

impl Drop for EtcdRegistration {
    fn drop(&mut self) {
        if let Some(task) = &self.keepalive {
            task.abort();
        }
    }
}

/// Keeps the lease alive until aborted; on a lost lease, registers again with a fresh one.
async fn keep_alive(
    backend: EtcdDiscovery,
    worker: String,
    key: String,
    published: Arc<Mutex<Published>>,
) {
    let config = backend.config.clone();
    let period = config.keepalive_interval();
    let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
    loop {
        let lease = published.lock().await.lease;
        let lost = match renew_until_broken(&backend.client, lease, period, &mut backoff).await {
            Renewal::Broken(reason) => {
                tracing::warn!(worker = %worker, reason = %reason, "etcd lease keepalive interrupted; reconnecting");
                backoff.wait().await;
                continue;
            }
            Renewal::Lost => lease,
        };
        tracing::warn!(
            worker = %worker, lease = format_args!("{lost:x}"),
            "etcd reports the lease gone; registering again"
        );
        let mut guard = published.lock().await;
        match grant_and_put(&backend, &key, &guard.value).await {
            Ok(lease) => {
                guard.lease = lease;
                backoff.reset();
                tracing::info!(worker = %worker, lease = format_args!("{lease:x}"), "registered again with etcd");
            }
            Err(e) => {
                drop(guard);
                tracing::warn!(worker = %worker, error = %e, "etcd re-registration failed; retrying");
                backoff.wait().await;
            }
        }
    }
}

enum Renewal {
    /// The stream broke; the lease may still be alive.
    Broken(String),
    /// The server says the lease no longer exists.
    Lost,
}

/// Renews `lease` every `period` on one keepalive stream until that stream breaks.
async fn renew_until_broken(
    client: &EtcdClient,
    lease: i64,
    period: std::time::Duration,
    backoff: &mut Backoff,
) -> Renewal {
    let (keeper, mut responses) = match client.lease_keep_alive(lease).await {
        Ok(pair) => pair,
        Err(e) if e.is_lease_not_found() => return Renewal::Lost,
        Err(e) => return Renewal::Broken(format!("{BACKEND} keepalive stream: {e}")),
    };
    backoff.reset();
    // Opening the stream sent the first renewal; the next one is one period away.
    let mut ticks = interval_at(Instant::now() + period, period);
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                if let Err(e) = keeper.keep_alive() {
                    return Renewal::Broken(format!("sending keepalive: {e}"));
                }
            }
            response = responses.message() => match response {
                Ok(Some(response)) if response.ttl <= 0 => return Renewal::Lost,
                Ok(Some(_)) => {}
                Ok(None) => return Renewal::Broken("keepalive stream closed by etcd".to_owned()),
                Err(e) if e.is_lease_not_found() => return Renewal::Lost,
                Err(e) => return Renewal::Broken(format!("keepalive stream: {e}")),
            }
        }
    }
}
