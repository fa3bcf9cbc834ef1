//! The one KV-event pipeline: frames of any transport ([`KvEventStream`]) → decoded batches →
//! the fleet ([`KvSink`]), with sequence, epoch and group-kind state kept per stream.
//!
//! Every transport (ZeroMQ, NATS, the in-process channels of `infera up`) feeds [`consume`];
//! nothing else decodes engine payloads. Per rank of the worker, [`StreamDecoder`] keeps:
//! - the sequence ([`StreamSeq`]): a skipped number is a **gap**, a number that goes back is a
//!   **restart**; the first number seen is accepted (a subscriber may join late);
//! - the publisher's epoch (NATS relay): a new epoch is a restart whatever the seq says;
//! - the KV groups' kinds ([`GroupKinds`]): a `BlockRemoved` carries only its `group_idx`, so a
//!   removal of a sliding-window group's block decoded in a later batch than the block's
//!   `BlockStored` must still be known as not indexable. Gap replays are decoded with the same
//!   state, in order; a restart forgets it (a new engine process).
//!
//! What is done about them, for every transport alike:
//! - gap: the missing batches are fetched from the engine's replay socket ([`KvReplay`]) and
//!   ingested in order before the batch that revealed the gap; when that cannot be done (no
//!   socket, no answer, the engine no longer holds them all, one does not decode) the rank's
//!   blocks are cleared and the batches that follow rebuild them;
//! - restart: the rank's blocks are cleared;
//! - an undecodable payload or an unframeable message is reported to the sink and skipped.
//!
//! A message without a seq (ATOM, a Python relay) is taken as it is.

use super::{DecodeError, EngineBatch, GroupKinds, SeqStatus, StreamSeq, decode_batch_with};
use crate::ids::{WorkerId, WorkerRank};
use crate::ports::kv_events::{KvEventStream, KvFrame, KvItem, KvReplay, KvSubscription};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::ops::RangeInclusive;
use tokio::sync::mpsc;

/// How one frame relates to its rank's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Continuity {
    /// The expected number, the first one, or a frame without a seq.
    InOrder,
    /// Batches `missing` were never received.
    Gap { missing: RangeInclusive<u64> },
    /// The publisher restarted (the seq went back, or the epoch changed): the rank's cache is
    /// empty and its group kinds are forgotten.
    Restart,
}

#[derive(Debug, Default)]
struct RankStream {
    epoch: Option<u64>,
    seq: StreamSeq,
    kinds: GroupKinds,
}

/// Per-rank decoding state of one worker's stream. See the module docs.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ranks: HashMap<u32, RankStream>,
}

impl StreamDecoder {
    /// Records `frame`'s seq and epoch and says how it relates to its rank's stream.
    pub fn observe(&mut self, frame: &KvFrame) -> Continuity {
        let rank = self.ranks.entry(frame.dp_rank).or_default();
        let Some(seq) = frame.seq else {
            return Continuity::InOrder;
        };
        let new_epoch = rank.epoch.is_some() && frame.epoch.is_some() && rank.epoch != frame.epoch;
        if frame.epoch.is_some() {
            rank.epoch = frame.epoch;
        }
        if new_epoch {
            rank.seq = StreamSeq::default();
        }
        match rank.seq.observe(seq) {
            _ if new_epoch => {
                rank.kinds = GroupKinds::default();
                Continuity::Restart
            }
            SeqStatus::InOrder => Continuity::InOrder,
            SeqStatus::Gap { missing } => Continuity::Gap { missing },
            SeqStatus::Restart { .. } => {
                rank.kinds = GroupKinds::default();
                Continuity::Restart
            }
        }
    }

    /// Decodes one payload of `dp_rank`'s stream, learning and applying its group kinds.
    /// Payloads must be decoded in the stream's order (replayed ones before the frame that
    /// revealed their gap).
    ///
    /// # Errors
    /// As [`decode_batch_with`].
    pub fn decode(&mut self, dp_rank: u32, payload: &[u8]) -> Result<EngineBatch, DecodeError> {
        decode_batch_with(payload, &mut self.ranks.entry(dp_rank).or_default().kinds)
    }
}

/// Where decoded batches go: the server's state, a test's fleet.
pub trait KvSink: Send + Sync {
    /// Ingests one decoded batch of `rank`. Returns `false` when the worker is not registered
    /// (the batch is dropped).
    fn ingest(&self, rank: &WorkerRank, seq: Option<u64>, batch: &EngineBatch) -> bool;

    /// Forgets every block of `rank` (restart, or a gap that could not be repaired).
    fn clear(&self, rank: &WorkerRank, seq: Option<u64>);

    /// A gap of `rank` was seen: `replayed` when the replay socket filled it.
    fn gap(&self, rank: &WorkerRank, missing: &RangeInclusive<u64>, replayed: bool);

    /// A message or payload of `worker` could not be used.
    fn malformed(&self, worker: &WorkerId, reason: &str);
}

/// Runs `worker`'s subscription into `sink` until the stream ends or `shutdown` completes.
pub async fn consume(
    worker: WorkerId,
    subscription: KvSubscription,
    sink: &dyn KvSink,
    shutdown: impl Future<Output = ()>,
) {
    let KvSubscription { mut events, replay } = subscription;
    let mut decoder = StreamDecoder::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let item = tokio::select! {
            () = &mut shutdown => break,
            item = events.recv() => item,
        };
        match item {
            None => break,
            Some(KvItem::Malformed { reason }) => sink.malformed(&worker, &reason),
            Some(KvItem::Frame(frame)) => {
                let rank = WorkerRank::new(worker.clone(), frame.dp_rank);
                match decoder.observe(&frame) {
                    Continuity::InOrder => {}
                    Continuity::Restart => {
                        tracing::warn!(
                            worker = worker.as_str(),
                            dp_rank = frame.dp_rank,
                            seq = frame.seq,
                            "kv-event publisher restarted; clearing the rank's blocks"
                        );
                        sink.clear(&rank, frame.seq);
                    }
                    Continuity::Gap { missing } => {
                        repair_gap(&mut decoder, replay.as_deref(), &rank, missing, sink).await;
                    }
                }
                ingest(&mut decoder, &rank, frame.seq, &frame.payload, sink);
            }
        }
    }
}

fn ingest(
    decoder: &mut StreamDecoder,
    rank: &WorkerRank,
    seq: Option<u64>,
    payload: &[u8],
    sink: &dyn KvSink,
) {
    match decoder.decode(rank.dp_rank, payload) {
        Ok(batch) => {
            if !sink.ingest(rank, seq, &batch) {
                tracing::debug!(
                    worker = rank.worker.as_str(),
                    "kv batch of an unregistered worker dropped"
                );
            }
        }
        Err(e) => sink.malformed(
            &rank.worker,
            &format!("rank {}: undecodable batch {seq:?}: {e}", rank.dp_rank),
        ),
    }
}

/// Fills the gap `missing` of `rank` from the replay socket, or clears the rank.
async fn repair_gap(
    decoder: &mut StreamDecoder,
    replay: Option<&dyn KvReplay>,
    rank: &WorkerRank,
    missing: RangeInclusive<u64>,
    sink: &dyn KvSink,
) {
    match replayed(decoder, replay, rank, &missing).await {
        Ok(batches) => {
            for (seq, batch) in &batches {
                sink.ingest(rank, Some(*seq), batch);
            }
            tracing::info!(
                worker = rank.worker.as_str(),
                dp_rank = rank.dp_rank,
                ?missing,
                "kv events lost in transit were replayed by the engine"
            );
            sink.gap(rank, &missing, true);
        }
        Err(why) => {
            tracing::warn!(worker = rank.worker.as_str(), dp_rank = rank.dp_rank, ?missing,
                reason = %why, "kv events lost; clearing the rank's blocks for later events to rebuild");
            sink.clear(rank, None);
            sink.gap(rank, &missing, false);
        }
    }
}

/// The batches `missing` of `rank` from the replay socket, decoded in order with the stream's
/// state; every one of them decoded before any is ingested, so a bad one clears the rank
/// instead of half-applying the gap.
async fn replayed(
    decoder: &mut StreamDecoder,
    replay: Option<&dyn KvReplay>,
    rank: &WorkerRank,
    missing: &RangeInclusive<u64>,
) -> Result<Vec<(u64, EngineBatch)>, String> {
    let replay = replay.ok_or("the engine has no replay socket")?;
    let got = replay
        .replay(rank.dp_rank, missing.clone())
        .await
        .map_err(|e| e.to_string())?;
    exactly(missing, got)?
        .into_iter()
        .map(|(seq, payload)| {
            decoder
                .decode(rank.dp_rank, &payload)
                .map(|batch| (seq, batch))
                .map_err(|e| format!("replayed batch {seq}: {e}"))
        })
        .collect()
}

/// Exactly the batches `missing`, in order, out of what a replay socket returned.
fn exactly(
    missing: &RangeInclusive<u64>,
    got: Vec<(u64, Bytes)>,
) -> Result<Vec<(u64, Bytes)>, String> {
    let mut out = Vec::new();
    let mut want = *missing.start();
    for (seq, payload) in got {
        if seq > *missing.end() {
            break;
        }
        if seq != want {
            return Err(format!(
                "the engine replayed batch {seq} where {want} belonged (it no longer holds it)"
            ));
        }
        out.push((seq, payload));
        want += 1;
    }
    if want <= *missing.end() {
        return Err(format!("the engine did not replay batch {want}"));
    }
    Ok(out)
}

/// An in-process KV-event stream (`infera up`, tests): what is sent on the returned sender is
/// received in order; the stream ends when every sender is dropped.
pub fn channel(capacity: usize) -> (mpsc::Sender<KvItem>, Box<dyn KvEventStream>) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (tx, Box::new(ChannelStream(rx)))
}

#[derive(Debug)]
struct ChannelStream(mpsc::Receiver<KvItem>);

#[async_trait]
impl KvEventStream for ChannelStream {
    async fn recv(&mut self) -> Option<KvItem> {
        self.0.recv().await
    }
}
