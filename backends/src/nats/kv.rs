//! `--kv-event-transport nats` (PROTOCOLS §3): the worker republishes each engine batch on
//! `infera.kv.events.<token>.<dp_rank>` ([`KvEventPublisher`]); the server subscribes per worker
//! ([`KvEventSubscription`]) and decodes the batches.
//!
//! # Gaps and restarts
//! Ours adds two headers: [`HDR_KV_SEQ`], the engine's seq of the batch (vLLM, SGLang; for an
//! engine without one, like the mock, the publisher's own count from 0 per rank), and
//! [`HDR_KV_EPOCH`], a number fixed for the life of the publishing worker process. Per rank
//! the subscriber expects `seq + 1` within one epoch:
//! - a new epoch, or a seq that goes back, is [`KvItem::Restart`]: the worker (and its engine)
//!   restarted, so the rank's cache starts empty;
//! - a seq that skips is [`KvItem::Gap`]: batches were lost (a broker restart, a slow consumer),
//!   so the index may hold blocks the engine evicted or miss blocks it stored.
//!
//! The server repairs both the same way: it clears the rank's blocks, which the following
//! batches rebuild. A message without the headers (a Python worker) is taken as it is.

use super::{NatsError, subject_token};
use bytes::Bytes;
use futures::StreamExt as _;
use infera_adapters::kv_events::{EngineBatch, SeqStatus, StreamSeq, decode_batch};
use std::collections::HashMap;
use std::ops::RangeInclusive;

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

/// What a subscription yields, per rank.
#[derive(Debug, Clone, PartialEq)]
pub enum KvItem {
    /// One decoded batch.
    Batch {
        dp_rank: u32,
        seq: Option<u64>,
        batch: EngineBatch,
    },
    /// Batches were lost on this rank (sent before the batch after them).
    Gap {
        dp_rank: u32,
        missing: RangeInclusive<u64>,
    },
    /// The publisher restarted (sent before its first batch).
    Restart { dp_rank: u32 },
    /// A message that could not be used.
    Malformed { reason: String },
}

/// One worker's KV events, all ranks. Dropping it unsubscribes.
#[derive(Debug)]
pub struct KvEventSubscription {
    sub: async_nats::Subscriber,
    ranks: HashMap<u32, (Option<u64>, StreamSeq)>,
    queued: Option<KvItem>,
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
        Ok(Self {
            sub,
            ranks: HashMap::new(),
            queued: None,
        })
    }

    /// The next item; `None` once the subscription ended.
    pub async fn recv(&mut self) -> Option<KvItem> {
        if let Some(item) = self.queued.take() {
            return Some(item);
        }
        let msg = self.sub.next().await?;
        Some(self.classify(msg))
    }

    fn classify(&mut self, msg: async_nats::Message) -> KvItem {
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
        let (seq, epoch) = (header(HDR_KV_SEQ), header(HDR_KV_EPOCH));
        let batch = match decode_batch(&msg.payload) {
            Ok(batch) => batch,
            Err(e) => {
                return KvItem::Malformed {
                    reason: format!("rank {dp_rank}: undecodable batch: {e}"),
                };
            }
        };
        let item = KvItem::Batch {
            dp_rank,
            seq,
            batch,
        };
        let Some(seq) = seq else {
            return item;
        };
        let (known_epoch, stream) = self.ranks.entry(dp_rank).or_default();
        let restarted = known_epoch.is_some() && *known_epoch != epoch;
        if restarted {
            *stream = StreamSeq::default();
        }
        *known_epoch = epoch;
        let status = stream.observe(seq);
        let before = match status {
            _ if restarted => Some(KvItem::Restart { dp_rank }),
            SeqStatus::InOrder => None,
            SeqStatus::Gap { missing } => Some(KvItem::Gap { dp_rank, missing }),
            SeqStatus::Restart { .. } => Some(KvItem::Restart { dp_rank }),
        };
        match before {
            Some(b) => {
                self.queued = Some(item);
                b
            }
            None => item,
        }
    }
}
