//! The mock engine's KV-event sink: a task that takes every batch the engine emits and publishes
//! it, either from a ZeroMQ publisher that speaks vLLM's wire format (PUB
//! `[topic "kv-events", seq u64 BE, payload]` and a ROUTER replay socket) or on the worker's
//! NATS subjects, each batch encoded as vLLM does.

#[cfg(not(all(feature = "nats", feature = "zmq")))]
use super::Backend;
use crate::worker::mock::{KvBind, KvOut};
#[cfg(feature = "zmq")]
use anyhow::Context as _;
#[cfg(feature = "nats")]
use bytes::Bytes;
#[cfg(feature = "zmq")]
use infera_backends::zmq::{KvEventPublisher, PublisherConfig};
use infera_core::kv_events::EngineBatch;
#[cfg(feature = "nats")]
use infera_core::kv_events::encode_batch_vllm;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Batches the engine may emit ahead of the publisher.
#[cfg(any(feature = "nats", feature = "zmq"))]
const SINK_CAPACITY: usize = 1024;

/// Opens `kv` (binding the ZeroMQ sockets) and starts the task that publishes every batch sent
/// to the returned sink; the task ends when the engine drops the sink.
///
/// # Errors
/// The sockets cannot be bound, or the transport is not in this build.
pub async fn mock_kv_sink(
    kv: KvOut,
) -> anyhow::Result<(mpsc::Sender<EngineBatch>, JoinHandle<()>)> {
    match kv {
        KvOut::Zmq(bind) => zmq_sink(bind).await,
        KvOut::Nats {
            link,
            worker_id,
            epoch,
        } => {
            #[cfg(feature = "nats")]
            return Ok(nats_sink(link.kv_publisher(&worker_id, epoch)));
            #[cfg(not(feature = "nats"))]
            {
                let _ = (link, worker_id, epoch);
                Err(Backend::Nats
                    .not_built("--kv-event-transport", "nats")
                    .into())
            }
        }
    }
}

#[cfg(feature = "nats")]
fn nats_sink(
    mut publisher: infera_backends::nats::kv::KvEventPublisher,
) -> (mpsc::Sender<EngineBatch>, JoinHandle<()>) {
    let (sink, mut batches) = mpsc::channel::<EngineBatch>(SINK_CAPACITY);
    let forwarder = tokio::spawn(async move {
        let mut failures = 0u64;
        while let Some(batch) = batches.recv().await {
            let payload = Bytes::from(encode_batch_vllm(&batch));
            let rank = batch.dp_rank.unwrap_or(0);
            if let Err(e) = publisher.publish(rank, payload).await {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::error!(error = %e, failures, "kv-event publish on nats failed");
                }
            }
        }
        if let Err(e) = publisher.flush().await {
            tracing::warn!(error = %e, "cannot flush the last kv events to nats");
        }
    });
    (sink, forwarder)
}

async fn zmq_sink(bind: KvBind) -> anyhow::Result<(mpsc::Sender<EngineBatch>, JoinHandle<()>)> {
    #[cfg(not(feature = "zmq"))]
    {
        let _ = bind;
        Err(Backend::Zmq.not_built("--kv-event-transport", "zmq").into())
    }
    #[cfg(feature = "zmq")]
    {
        let mut publisher = KvEventPublisher::bind(PublisherConfig::new(bind.events, bind.replay))
            .await
            .context("cannot bind the mock's kv-event sockets")?;
        tracing::info!(
            endpoint = publisher.endpoint(),
            replay = publisher.replay_endpoint().unwrap_or_default(),
            "mock kv events publishing"
        );
        let (sink, mut batches) = mpsc::channel::<EngineBatch>(SINK_CAPACITY);
        let forwarder = tokio::spawn(async move {
            let mut failures = 0u64;
            while let Some(batch) = batches.recv().await {
                if let Err(e) = publisher.publish_batch(&batch).await {
                    failures += 1;
                    if failures.is_power_of_two() {
                        tracing::error!(error = %e, failures, "kv-event publish failed");
                    }
                }
            }
            publisher.shutdown().await;
        });
        Ok((sink, forwarder))
    }
}
