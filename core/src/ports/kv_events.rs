//! The KV-event source port: how engine KV-event messages reach the server, undecoded.
//!
//! A transport (ZeroMQ from the engine's PUB socket, NATS from the worker's relay, a channel in
//! `infera up`) only moves frames: for each message it yields the rank it is for, the engine's
//! sequence number and the publisher's epoch where the wire carries them, and the msgpack
//! payload verbatim. Decoding, sequence and epoch tracking, gap repair and restart handling are
//! done once, for every transport, by [`crate::kv_events::pipeline`].
//!
//! Wire facts per transport are in PROTOCOLS.md §3.

use crate::event::WorkerRecord;
use async_trait::async_trait;
use bytes::Bytes;
use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;

/// `tcp://HOST:PORT` with a wildcard host (`*`, `0.0.0.0`, empty) replaced by `worker_url`'s
/// host: a publisher bound on every interface is reached where its worker is. `None` for an
/// endpoint that is not `tcp://HOST:PORT`, or a wildcard with no host to take.
pub fn resolve_wildcard_host(endpoint: &str, worker_url: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    if !matches!(host, "*" | "0.0.0.0" | "") {
        return Some(endpoint.to_owned());
    }
    let after = worker_url.split_once("://").map_or(worker_url, |(_, r)| r);
    let authority = after.split('/').next().unwrap_or(after);
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    (!host.is_empty()).then(|| format!("tcp://{host}:{port}"))
}

/// One engine KV-event message, as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvFrame {
    /// The worker rank (fleet-wide dp rank) the message is for.
    pub dp_rank: u32,
    /// The engine's batch number on that rank, when the wire carries one (vLLM, SGLang: from 0
    /// per engine process; the NATS relay's own count for engines without one).
    pub seq: Option<u64>,
    /// A number fixed for the life of the publishing process, when the wire carries one (the
    /// NATS relay's `infera-kv-epoch`): a new epoch is a restart whatever the seq says.
    pub epoch: Option<u64>,
    /// The engine's msgpack batch, verbatim.
    pub payload: Bytes,
}

/// What a KV-event stream yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvItem {
    /// One message.
    Frame(KvFrame),
    /// A message the transport could not even frame (wrong frame count, bad subject); it
    /// carries no payload to decode.
    Malformed { reason: String },
}

/// Errors of a KV-event source.
#[derive(Debug, thiserror::Error)]
pub enum KvSourceError {
    /// The worker's registration does not say where its events are published.
    #[error("worker {worker} registered no usable kv_events_endpoint: {reason}")]
    NoEndpoint { worker: String, reason: String },
    /// The subscription could not be opened (retryable: the broker may come back).
    #[error("cannot subscribe to the kv events of worker {worker}: {source}")]
    Subscribe {
        worker: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The engine's replay socket did not give the batches asked for.
    #[error("replay of kv batches {from} and after failed: {reason}")]
    Replay { from: u64, reason: String },
}

/// One worker's KV-event messages, every rank, in arrival order.
#[async_trait]
pub trait KvEventStream: Send + fmt::Debug {
    /// The next item; `None` once the stream ended (it was shut down, or failed for good).
    async fn recv(&mut self) -> Option<KvItem>;
}

/// An engine's replay socket: batches it published and still holds.
#[async_trait]
pub trait KvReplay: Send + Sync + fmt::Debug {
    /// The batches of `dp_rank` from `missing.start()` on, in the engine's order, as raw
    /// payloads with their seqs (at least through `missing.end()` when the engine holds them).
    ///
    /// # Errors
    /// [`KvSourceError::Replay`] when the socket does not answer in time or cannot be used.
    async fn replay(
        &self,
        dp_rank: u32,
        missing: RangeInclusive<u64>,
    ) -> Result<Vec<(u64, Bytes)>, KvSourceError>;
}

/// An open subscription: the stream, and the replay socket when the engine has one.
#[derive(Debug)]
pub struct KvSubscription {
    pub events: Box<dyn KvEventStream>,
    pub replay: Option<Arc<dyn KvReplay>>,
}

/// Where KV events come from (`--kv-event-transport`).
#[async_trait]
pub trait KvEventSource: Send + Sync + fmt::Debug {
    /// The transport's name, for logs (`zmq`, `nats`, `in-process`).
    fn name(&self) -> &'static str;

    /// Opens the KV-event stream of every rank of `record`. Dropping the subscription stops
    /// whatever the source started for it.
    ///
    /// # Errors
    /// [`KvSourceError::NoEndpoint`] when the record names no usable endpoint;
    /// [`KvSourceError::Subscribe`] when the transport refuses.
    async fn subscribe(&self, record: &WorkerRecord) -> Result<KvSubscription, KvSourceError>;

    /// Whether a changed registration of the same worker needs a new subscription (it names
    /// other endpoints or ranks).
    fn resubscribe(&self, old: &WorkerRecord, new: &WorkerRecord) -> bool {
        old.kv_events_endpoint != new.kv_events_endpoint
            || old.dp_rank != new.dp_rank
            || old.dp_size != new.dp_size
    }
}
