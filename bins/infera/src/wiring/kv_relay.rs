//! `--kv-event-transport nats` for a real engine: the worker subscribes to its engine's ZeroMQ
//! publisher on loopback (one subscriber per dp rank, port P + rank offset) and republishes each
//! batch's payload verbatim on `infera.kv.events.<token>.<rank>` with the engine's seq and the
//! worker's epoch (the NATS backend's `KvEventPublisher`), so the server sees the engine's gaps
//! and restarts as they are. The relay moves bytes: it decodes nothing. It needs both the `nats`
//! and the `zmq` features.
//!
//! [`KvRelay`] owns its tasks: [`KvRelay::stop`] cancels and joins them; a dropped relay
//! cancels them.

#[cfg(not(all(feature = "nats", feature = "zmq")))]
use super::Backend;
use super::NatsLink;
use crate::config::ConfigError;
#[cfg(all(feature = "nats", feature = "zmq"))]
use infera_backends::{
    nats::kv::KvEventPublisher,
    zmq::{KvEventSubscriber, SubscriberConfig, SubscriberItem, rank_endpoint},
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The running relay tasks.
#[derive(Debug)]
pub struct KvRelay {
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl KvRelay {
    /// Starts one relay per rank of `dp_size` ranks from `dp_rank`, reading the engine's events
    /// at `endpoint` (rank offsets added to its port; a wildcard host read on loopback).
    ///
    /// # Errors
    /// This build lacks ZeroMQ (to read the engine's events) or NATS.
    #[cfg_attr(not(all(feature = "nats", feature = "zmq")), allow(unused_variables))]
    pub fn start(
        link: &NatsLink,
        worker_id: &str,
        endpoint: &str,
        dp_rank: u32,
        dp_size: u32,
        epoch: u64,
    ) -> Result<Self, ConfigError> {
        #[cfg(all(feature = "nats", feature = "zmq"))]
        return Ok(Self::spawn(
            link, worker_id, endpoint, dp_rank, dp_size, epoch,
        ));
        #[cfg(not(all(feature = "nats", feature = "zmq")))]
        {
            let missing = if Backend::Zmq.built() {
                Backend::Nats
            } else {
                Backend::Zmq
            };
            Err(missing.not_built("--kv-event-transport", "nats"))
        }
    }

    #[cfg(all(feature = "nats", feature = "zmq"))]
    fn spawn(
        link: &NatsLink,
        worker_id: &str,
        endpoint: &str,
        dp_rank: u32,
        dp_size: u32,
        epoch: u64,
    ) -> Self {
        let cancel = CancellationToken::new();
        let mut tasks = Vec::new();
        for offset in 0..dp_size.max(1) {
            let Some(ep) = rank_endpoint(endpoint, "http://127.0.0.1", offset) else {
                tracing::error!(%endpoint, "the engine's kv-event endpoint is not tcp://HOST:PORT; \
                    its events are not relayed");
                break;
            };
            let publisher = link.kv_publisher(worker_id, epoch);
            tracing::info!(endpoint = %ep, dp_rank = dp_rank + offset, "relaying kv events to nats");
            tasks.push(tokio::spawn(relay(
                ep,
                dp_rank + offset,
                publisher,
                cancel.clone(),
            )));
        }
        Self { cancel, tasks }
    }

    /// Stops the relays and waits for them.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
    }
}

impl Drop for KvRelay {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(all(feature = "nats", feature = "zmq"))]
async fn relay(
    endpoint: String,
    dp_rank: u32,
    mut publisher: KvEventPublisher,
    cancel: CancellationToken,
) {
    let mut sub = KvEventSubscriber::spawn(SubscriberConfig::new(endpoint));
    let mut failures = 0u64;
    loop {
        let item = tokio::select! {
            () = cancel.cancelled() => break,
            item = sub.recv() => item,
        };
        let Some(item) = item else { break };
        match item {
            SubscriberItem::Frames(frames) => {
                if let Err(e) = publisher
                    .publish_with_seq(dp_rank, frames.seq, frames.payload)
                    .await
                {
                    failures += 1;
                    if failures.is_power_of_two() {
                        tracing::error!(error = %e, failures, "kv-event relay to nats failed");
                    }
                }
            }
            SubscriberItem::Malformed { reason } => {
                tracing::warn!(dp_rank, %reason, "malformed engine kv event message not relayed");
            }
        }
    }
    sub.shutdown().await;
    if let Err(e) = publisher.flush().await {
        tracing::warn!(dp_rank, error = %e, "cannot flush the last kv events to nats");
    }
}
