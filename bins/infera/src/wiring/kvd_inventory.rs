//! `infera kvd`'s inventory sink ([`infera_kvd::InventorySink`]): each batch encoded as vLLM
//! encodes it and published from a ZeroMQ PUB socket (`[topic "kv-events", seq u64 BE,
//! payload]`, seq from 0) with a ROUTER replay socket keeping the last 10,000 batches, vLLM's
//! layout (PROTOCOLS.md §3).
//!
//! The daemon's publisher task must never wait, so the sink only encodes and queues: a task
//! owns the sockets and sends, and a queue that is full (the socket stalled for
//! [`QUEUE`] batches) refuses the batch, which the daemon answers by starting its next batch
//! with `AllBlocksCleared`. The task ends, closing the sockets, once the daemon drops the sink
//! at shutdown.

use crate::config::kvd::KvEventsConfig;
#[cfg(not(feature = "zmq"))]
use crate::wiring::Backend;
use infera_kvd::InventoryPublishing;
#[cfg(feature = "zmq")]
use {
    anyhow::Context as _,
    bytes::Bytes,
    infera_backends::zmq::{KvEventPublisher, PublisherConfig},
    infera_core::kv_events::{EngineBatch, encode_batch_vllm},
    infera_kvd::{InventorySink, SinkError},
    std::sync::Arc,
    tokio::sync::mpsc,
};

/// Encoded batches queued ahead of the socket at most (about 12 s of batches every 50 ms).
#[cfg(feature = "zmq")]
const QUEUE: usize = 256;

/// Binds `config`'s sockets and starts the task that sends what the returned sink is given;
/// the endpoints it returns are the bound ones (a port 0 resolved), `*` bound as `0.0.0.0`,
/// with `--kv-events-advertise-host` in place of the bound host when given.
/// Must run on the daemon's runtime.
///
/// # Errors
/// An endpoint cannot be bound (taken: another kvd on this host), or ZeroMQ is not in this
/// build.
pub async fn kvd_inventory(config: &KvEventsConfig) -> anyhow::Result<InventoryPublishing> {
    #[cfg(not(feature = "zmq"))]
    {
        Err(Backend::Zmq
            .not_built("--kv-events-endpoint", &config.endpoint)
            .into())
    }
    #[cfg(feature = "zmq")]
    {
        let publisher = KvEventPublisher::bind(PublisherConfig::new(
            all_interfaces(&config.endpoint),
            config.replay_endpoint.as_deref().map(all_interfaces),
        ))
        .await
        .with_context(|| {
            format!(
                "--kv-events-endpoint {} (replay {}): cannot bind; another kvd on this host? \
                 give each its own ports, or off",
                config.endpoint,
                config.replay_endpoint.as_deref().unwrap_or("off"),
            )
        })?;
        let advertised = |bound: &str| match &config.advertise_host {
            Some(host) => with_host(bound, host),
            None => bound.to_owned(),
        };
        let endpoint = advertised(publisher.endpoint());
        let replay_endpoint = publisher.replay_endpoint().map(advertised);
        tracing::info!(%endpoint, replay = replay_endpoint.as_deref().unwrap_or("off"),
            "kvd inventory events publishing");
        let (batches, queued) = mpsc::channel(QUEUE);
        tokio::spawn(send(publisher, queued));
        Ok(InventoryPublishing {
            sink: Arc::new(ZmqSink { batches }),
            endpoint,
            replay_endpoint,
        })
    }
}

/// `tcp://HOST:PORT` with `host` in place of HOST.
#[cfg(feature = "zmq")]
fn with_host(endpoint: &str, host: &str) -> String {
    match endpoint.rsplit_once(':') {
        Some((_, port)) => format!("tcp://{host}:{port}"),
        None => endpoint.to_owned(),
    }
}

/// ZeroMQ's `*` host as an address to bind.
#[cfg(feature = "zmq")]
fn all_interfaces(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

#[cfg(feature = "zmq")]
#[derive(Debug)]
struct ZmqSink {
    batches: mpsc::Sender<Bytes>,
}

#[cfg(feature = "zmq")]
impl InventorySink for ZmqSink {
    fn publish(&self, batch: &EngineBatch) -> Result<(), SinkError> {
        let payload = Bytes::from(encode_batch_vllm(batch));
        self.batches.try_send(payload).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SinkError::Full,
            mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
        })
    }
}

/// Sends every queued payload until the sink is dropped, then closes the sockets.
#[cfg(feature = "zmq")]
async fn send(mut publisher: KvEventPublisher, mut queued: mpsc::Receiver<Bytes>) {
    let mut failures = 0u64;
    while let Some(payload) = queued.recv().await {
        // A failed send still took its seq and sits in the replay ring: subscribers see a gap
        // and replay it.
        if let Err(error) = publisher.publish(payload).await {
            failures += 1;
            if failures.is_power_of_two() {
                tracing::error!(%error, failures, "kvd inventory publish failed");
            }
        }
    }
    publisher.shutdown().await;
}
