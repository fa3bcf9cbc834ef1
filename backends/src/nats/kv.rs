//! `--kv-event-transport nats` (PROTOCOLS.md §3): the worker republishes each engine batch on
//! `infera.kv.events.<token>.<dp_rank>` ([`KvEventPublisher`]); the server subscribes per worker
//! ([`NatsKvSource`], the KV-event source port) and gets the frames undecoded: the one
//! pipeline (`infera_core::kv_events::pipeline`) decodes them.
//!
//! # Gaps and restarts
//! Ours adds two headers: [`HDR_KV_SEQ`], the engine's seq of the batch (vLLM, SGLang; for an
//! engine without one, like the mock, the publisher's own count from 0 per rank), and
//! [`HDR_KV_EPOCH`], a number fixed for the life of the publishing worker process. Per rank
//! the pipeline expects `seq + 1` within one epoch: a new epoch, or a seq that goes back, is a
//! restart (the rank's cache starts empty); a seq that skips is a gap (a broker restart, a slow
//! consumer). A message without the headers (a Python worker) is taken as it is.

use super::{NatsError, subject_token};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt as _;
use infera_core::event::WorkerRecord;
use infera_core::ports::kv_events::{
    KvEventSource, KvEventStream, KvFrame, KvItem, KvSourceError, KvSubscription,
};
use std::collections::HashMap;

/// Header (ours): the publisher's batch number on the rank, from 0.
pub const HDR_KV_SEQ: &str = "infera-kv-seq";
/// Header (ours): the publishing worker process's epoch.
pub const HDR_KV_EPOCH: &str = "infera-kv-epoch";

/// `infera.kv.events.<token>.<dp_rank>`.
pub fn kv_subject(worker_id: &str, dp_rank: u32) -> String {
    format!("infera.kv.events.{}.{dp_rank}", subject_token(worker_id))
}

/// Publishes one worker's engine batches. Not shared between tasks (one per worker).
#[derive(Debug)]
pub struct KvEventPublisher {
    client: async_nats::Client,
    worker_id: String,
    epoch: u64,
    next_seq: HashMap<u32, u64>,
}

impl KvEventPublisher {
    /// A publisher for `worker_id` whose epoch is `epoch` (pick one that differs across the
    /// worker's restarts, e.g. the start time in microseconds).
    pub fn new(client: async_nats::Client, worker_id: impl Into<String>, epoch: u64) -> Self {
        Self {
            client,
            worker_id: worker_id.into(),
            epoch,
            next_seq: HashMap::new(),
        }
    }

    /// Publishes `payload` (the engine's msgpack batch, verbatim) for `dp_rank`, numbered by
    /// this publisher (for an engine that numbers nothing, like the mock's sink). Returns its
    /// seq.
    ///
    /// # Errors
    /// The client's publish error (its buffer is full while the broker is away).
    pub async fn publish(
        &mut self,
        dp_rank: u32,
        payload: Bytes,
    ) -> Result<u64, async_nats::PublishError> {
        let seq = self.next_seq.entry(dp_rank).or_insert(0);
        let this = *seq;
        *seq += 1;
        self.publish_with_seq(dp_rank, Some(this), payload).await?;
        Ok(this)
    }

    /// Publishes `payload` for `dp_rank` with the engine's own seq (vLLM, SGLang), so that the
    /// engine's gaps and restarts reach the server as they are; `None` (ATOM) sends no seq.
    ///
    /// # Errors
    /// The client's publish error.
    pub async fn publish_with_seq(
        &mut self,
        dp_rank: u32,
        seq: Option<u64>,
        payload: Bytes,
    ) -> Result<(), async_nats::PublishError> {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(seq) = seq {
            headers.insert(HDR_KV_SEQ, seq.to_string().as_str());
        }
        headers.insert(HDR_KV_EPOCH, self.epoch.to_string().as_str());
        self.client
            .publish_with_headers(kv_subject(&self.worker_id, dp_rank), headers, payload)
            .await
    }

    /// Sends what the client still buffers (before the worker exits).
    ///
    /// # Errors
    /// The client's flush error (the broker is away).
    pub async fn flush(&self) -> Result<(), async_nats::client::FlushError> {
        self.client.flush().await
    }
}

/// `--kv-event-transport nats`: each worker's `infera.kv.events.<token>.*` subjects.
#[derive(Debug, Clone)]
pub struct NatsKvSource {
    client: async_nats::Client,
}

impl NatsKvSource {
    /// A source on `client`'s connection.
    pub fn new(client: async_nats::Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl KvEventSource for NatsKvSource {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn subscribe(&self, record: &WorkerRecord) -> Result<KvSubscription, KvSourceError> {
        let worker = record.worker_id.as_str();
        let events = KvEventSubscription::subscribe(&self.client, worker)
            .await
            .map_err(|e| KvSourceError::Subscribe {
                worker: worker.to_owned(),
                source: Box::new(e),
            })?;
        Ok(KvSubscription {
            events: Box::new(events),
            replay: None,
        })
    }

    /// Subjects are named by the worker id alone: a changed record keeps its subscription.
    fn resubscribe(&self, _old: &WorkerRecord, _new: &WorkerRecord) -> bool {
        false
    }
}

/// One worker's KV-event messages, all ranks, undecoded. Dropping it unsubscribes.
#[derive(Debug)]
pub struct KvEventSubscription {
    sub: async_nats::Subscriber,
}

impl KvEventSubscription {
    /// Subscribes to `infera.kv.events.<token>.*`.
    ///
    /// # Errors
    /// [`NatsError::Subscribe`].
    pub async fn subscribe(
        client: &async_nats::Client,
        worker_id: &str,
    ) -> Result<Self, NatsError> {
        let subject = format!("infera.kv.events.{}.*", subject_token(worker_id));
        let sub = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| NatsError::Subscribe {
                subject,
                reason: e.to_string(),
            })?;
        Ok(Self { sub })
    }
}

#[async_trait]
impl KvEventStream for KvEventSubscription {
    async fn recv(&mut self) -> Option<KvItem> {
        let msg = self.sub.next().await?;
        Some(frame_of(&msg))
    }
}

/// The frame of one message: its rank from the subject, seq and epoch from our headers.
fn frame_of(msg: &async_nats::Message) -> KvItem {
    let Some(dp_rank) = msg
        .subject
        .rsplit('.')
        .next()
        .and_then(|r| r.parse::<u32>().ok())
    else {
        return KvItem::Malformed {
            reason: format!("subject {} does not end in a dp rank", msg.subject),
        };
    };
    let header = |name: &str| -> Option<u64> {
        msg.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .and_then(|v| v.as_str().trim().parse().ok())
    };
    KvItem::Frame(KvFrame {
        dp_rank,
        seq: header(HDR_KV_SEQ),
        epoch: header(HDR_KV_EPOCH),
        payload: msg.payload.clone(),
    })
}
