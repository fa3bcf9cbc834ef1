//! The mock's engine loop: one task owns the [`EngineModel`] and steps it on the wall clock.
//!
//! # Protocol
//! HTTP handlers send a [`Submission`] over a bounded channel and watch the request's
//! [`Progress`]. Each loop iteration takes every queued submission, runs one model step, sleeps
//! until the step's modelled end — its duration (already divided by `speedup`) after the previous
//! step's modelled end, or after now when the engine was idle, so that the engine keeps the
//! model's pace over many short steps, on a step clock precise to tens of microseconds (see
//! `clock`) — then publishes what the step did:
//!
//! 1. the step's KV changes, as one vLLM [`EngineBatch`] to the sink (engine hashes are the router
//!    hashes XOR the per-process salt, as vLLM salts its hashes per process);
//! 2. [`Prefilled`]: the request's first token and its `cached_tokens`;
//! 3. [`Finished`]: the request's remaining tokens (up to the count the model reports) and its end;
//! 4. one token for every other request that is decoding.
//!
//! # Invariants
//! - A request's token count never exceeds `max(output_tokens, 1)` and, at its end, equals what
//!   [`Finished::output_tokens`] says (at least 1: prefill produces a token).
//! - Decode tokens are credited one per step to every decoding request, capped one short of the
//!   target so that the last token arrives with [`Finished`]. The model does not say which
//!   sequences it decoded in a step, so a request that was preempted (tiny caches only) or left
//!   out of a full token budget still gets its per-step token; only its timing differs.
//! - The token ids of every complete prompt block of a live request are kept (shared by hash,
//!   reference counted) until the request finishes, so every `BlockStored` carries its tokens.
//! - The model's lower-tier hook answers from each request's [`Submission::lower_blocks`], found
//!   in the block store before the request was submitted (see `kvd`).
//! - [`EngineModel`] has no abort: a request whose client went away stays in the engine until it
//!   finishes (it keeps its blocks and batch slot); only its progress stops being published.

use infera_core::engine::{EngineModel, Finished, KvChange, Prefilled, SimRequest};
use infera_core::event::Tier;
use infera_core::hashing::{ExtraKey, KvIdentity};
use infera_core::ids::{BlockHash, EngineHash};
use infera_core::kv_events::{EngineBatch, EngineEvent};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::KvEventSink;
use super::clock::StepClock;
use super::metrics::MockMetrics;

/// How a request left the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Generated every token it asked for.
    Finished,
    /// It can never fit in the cache and was not run.
    Rejected,
}

/// What a client has received so far; published on a `watch` channel after every step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Tokens generated so far.
    pub tokens: u32,
    /// Prompt tokens served from the cache (known once prefilled).
    pub cached_tokens: u32,
    /// Set once, when the request leaves the engine.
    pub outcome: Option<Outcome>,
}

/// One request handed to the engine loop.
#[derive(Debug)]
pub(crate) struct Submission {
    pub id: u64,
    /// Router hashes of the prompt's complete blocks.
    pub blocks: Vec<BlockHash>,
    /// The prompt's token ids (at least the tokens of the complete blocks).
    pub tokens: Vec<u32>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub progress: watch::Sender<Progress>,
    /// When the handler got the request (for `vllm:time_to_first_token_seconds`).
    pub received: Instant,
    /// Leading prompt blocks the block store holds (the lower tier; 0 without one).
    pub lower_blocks: usize,
    /// What the blocks are keyed by besides their tokens (reported in `BlockStored`).
    pub identity: KvIdentity,
}

/// A live request, as the loop tracks it.
#[derive(Debug)]
struct Live {
    progress: watch::Sender<Progress>,
    blocks: Vec<BlockHash>,
    prompt_tokens: u32,
    /// `max(output_tokens, 1)`.
    target: u32,
    tokens: u32,
    decoding: bool,
    /// The step in which it was prefilled (no decode token in that step).
    prefilled_step: u64,
    /// The client went away: progress is no longer published.
    detached: bool,
    received: Instant,
    /// See [`Submission::lower_blocks`].
    lower_blocks: usize,
}

/// Token ids of one resident-or-pending block, shared by every live request that has it.
#[derive(Debug)]
struct BlockTokens {
    refs: u32,
    tokens: Box<[u32]>,
    /// The block's extra keys and its request's adapter, as `BlockStored` reports them.
    keys: Box<[ExtraKey]>,
    lora: Option<Box<str>>,
}

/// The loop's state (owned by the task, never shared).
pub(crate) struct EngineLoop {
    model: EngineModel,
    block_size: usize,
    salt: u64,
    live: FxHashMap<u64, Live>,
    block_tokens: FxHashMap<BlockHash, BlockTokens>,
    sink: Option<KvEventSink>,
    metrics: Arc<MockMetrics>,
    step_no: u64,
}

impl std::fmt::Debug for EngineLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLoop")
            .field("live", &self.live.len())
            .field("block_size", &self.block_size)
            .field("step_no", &self.step_no)
            .finish_non_exhaustive()
    }
}

impl EngineLoop {
    pub(crate) fn new(
        model: EngineModel,
        salt: u64,
        sink: Option<KvEventSink>,
        metrics: Arc<MockMetrics>,
    ) -> Self {
        let block_size = model.config().block_size as usize;
        Self {
            model,
            block_size,
            salt,
            live: FxHashMap::default(),
            block_tokens: FxHashMap::default(),
            sink,
            metrics,
            step_no: 0,
        }
    }

    /// Runs until `cancel` fires or every submitter is gone and the engine is idle; runs no
    /// step while `stalled` holds (see [`super::StallSwitch`]).
    pub(crate) async fn run(
        mut self,
        mut requests: mpsc::Receiver<Submission>,
        cancel: CancellationToken,
        mut stalled: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut open = true;
        // When the previous step should have ended by the model; `None` after an idle wait.
        let mut due: Option<Instant> = None;
        let mut clock = StepClock::new();
        loop {
            if self.model.is_idle() {
                if !open {
                    break;
                }
                due = None;
                tokio::select! {
                    () = cancel.cancelled() => break,
                    sub = requests.recv() => match sub {
                        Some(sub) => self.submit(sub),
                        None => open = false,
                    },
                }
            }
            while let Ok(sub) = requests.try_recv() {
                self.submit(sub);
            }
            if *stalled.borrow() {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    _ = stalled.wait_for(|s| !*s) => {}
                }
                due = None;
            }
            // Back-to-back steps are timed from the previous step's modelled end, not from when
            // the loop got here, so the loop's own work and any wake-up lateness do not add up
            // over thousands of sub-millisecond decode steps; the step clock wakes within tens
            // of microseconds of each end (see `clock`).
            let started = due.unwrap_or_else(Instant::now);
            let live = &self.live;
            let mut lower = |id: u64, asked: &[BlockHash]| lower_tier(live, id, asked);
            let Some(report) = self.model.step(&mut lower) else {
                continue;
            };
            self.step_no += 1;
            let end = started + Duration::from_micros(report.duration_us);
            due = Some(end);
            if end <= Instant::now() {
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = clock.sleep_until(end) => {}
                }
            }
            let late = Instant::now().saturating_duration_since(end);
            self.metrics.step_lateness.observe(late.as_secs_f64());
            if let Some(batch) = self.kv_batch(&report.kv) {
                self.publish(batch, &cancel).await;
            }
            self.deliver(&report.prefilled, &report.finished);
            self.cancel_abandoned();
            self.metrics.observe_engine(&self.model);
        }
        tracing::debug!(live = self.live.len(), "mock engine loop stopped");
    }

    fn submit(&mut self, sub: Submission) {
        let bs = self.block_size;
        let mut keys = Vec::new();
        for (i, &hash) in sub.blocks.iter().enumerate() {
            let entry = self.block_tokens.entry(hash).or_insert_with(|| {
                let start = u32::try_from(i * bs).unwrap_or(u32::MAX);
                let end = u32::try_from((i + 1) * bs).unwrap_or(u32::MAX);
                sub.identity.block_keys(start, end, &mut keys);
                BlockTokens {
                    refs: 0,
                    tokens: sub
                        .tokens
                        .get(i * bs..(i + 1) * bs)
                        .unwrap_or_default()
                        .into(),
                    keys: std::mem::take(&mut keys).into(),
                    lora: sub.identity.lora.clone(),
                }
            });
            entry.refs += 1;
        }
        self.model.submit(SimRequest {
            id: sub.id,
            blocks: sub.blocks.clone(),
            prompt_tokens: sub.prompt_tokens,
            output_tokens: sub.output_tokens,
        });
        self.live.insert(
            sub.id,
            Live {
                progress: sub.progress,
                blocks: sub.blocks,
                prompt_tokens: sub.prompt_tokens,
                target: sub.output_tokens.max(1),
                tokens: 0,
                decoding: false,
                prefilled_step: 0,
                detached: false,
                received: sub.received,
                lower_blocks: sub.lower_blocks,
            },
        );
    }

    fn salted(&self, hash: BlockHash) -> EngineHash {
        EngineHash::from_u64(hash.0 ^ self.salt)
    }

    /// The step's KV changes as one vLLM batch; `None` when the step changed nothing.
    fn kv_batch(&self, changes: &[KvChange]) -> Option<EngineBatch> {
        if changes.is_empty() {
            return None;
        }
        let mut events = Vec::with_capacity(changes.len());
        let mut missing = 0u64;
        for change in changes {
            match change {
                KvChange::Stored { parent, blocks } => {
                    let mut token_ids = Vec::with_capacity(blocks.len() * self.block_size);
                    let mut block_hashes = Vec::with_capacity(blocks.len());
                    let mut extra_keys = Vec::with_capacity(blocks.len());
                    let mut lora_name = None;
                    for hash in blocks {
                        match self.block_tokens.get(hash) {
                            Some(b) if b.tokens.len() == self.block_size => {
                                token_ids.extend_from_slice(&b.tokens);
                                block_hashes.push(self.salted(*hash));
                                extra_keys.push(b.keys.to_vec());
                                lora_name = lora_name.or_else(|| b.lora.clone());
                            }
                            // Cannot happen (a stored block belongs to a live request); a
                            // block without its tokens would corrupt a router's index, so the
                            // rest of the run is left out and counted.
                            _ => {
                                missing += 1;
                                break;
                            }
                        }
                    }
                    if !block_hashes.is_empty() {
                        events.push(EngineEvent::BlockStored {
                            block_hashes,
                            parent: parent.map(|p| self.salted(p)),
                            token_ids,
                            block_size: self.block_size as u32,
                            tier: Tier::Gpu,
                            lora_id: None,
                            lora_name,
                            // As decoded: plain blocks only are no keys.
                            extra_keys: extra_keys
                                .iter()
                                .any(|k| !k.is_empty())
                                .then_some(extra_keys),
                            cache_salt: None,
                            indexable: true,
                        });
                    }
                }
                KvChange::Removed { blocks } => events.push(EngineEvent::BlockRemoved {
                    block_hashes: blocks.iter().map(|&h| self.salted(h)).collect(),
                    tier: Tier::Gpu,
                    indexable: true,
                }),
                KvChange::Cleared => events.push(EngineEvent::AllBlocksCleared),
            }
        }
        if missing > 0 {
            tracing::error!(
                blocks = missing,
                "mock engine stored blocks whose token ids it does not know; their events were \
                 left out"
            );
            self.metrics.kv_missing_tokens.inc_by(missing);
        }
        Some(EngineBatch {
            ts: unix_seconds(),
            dp_rank: Some(0),
            events,
            ..EngineBatch::default()
        })
    }

    async fn publish(&mut self, batch: EngineBatch, cancel: &CancellationToken) {
        let Some(sink) = &self.sink else { return };
        let events = batch.events.len() as u64;
        let sent = tokio::select! {
            () = cancel.cancelled() => return,
            sent = sink.send(batch) => sent,
        };
        match sent {
            Ok(()) => {
                self.metrics.kv_batches.inc();
                self.metrics.kv_events.inc_by(events);
            }
            Err(_) => {
                tracing::error!(
                    "the kv-event sink was closed; this mock engine stops publishing kv events \
                     and routers will no longer see its cache"
                );
                self.metrics.kv_sink_closed.set(1);
                self.sink = None;
            }
        }
    }

    /// Hands out the step's tokens and ends finished requests.
    fn deliver(&mut self, prefilled: &[Prefilled], finished: &[Finished]) {
        let step = self.step_no;
        let now = Instant::now();
        for p in prefilled {
            if let Some(live) = self.live.get_mut(&p.id) {
                let ttft = now.saturating_duration_since(live.received);
                self.metrics.ttft.observe(ttft.as_secs_f64());
                live.decoding = true;
                live.prefilled_step = step;
                live.tokens = 1;
                let cached = p.cached_tokens;
                publish_progress(live, |pr| {
                    pr.tokens = 1;
                    pr.cached_tokens = cached;
                });
            }
            self.metrics.prefix_queries.inc_by(
                self.live
                    .get(&p.id)
                    .map_or(0, |l| u64::from(l.prompt_tokens)),
            );
            self.metrics.prefix_hits.inc_by(u64::from(p.cached_tokens));
            // `cached_tokens` is capped (the last prompt token is recomputed); the GPU's blocks
            // count first, the rest came from the lower tier.
            let gpu = u64::from(p.gpu_hit_blocks) * self.block_size as u64;
            let lower = u64::from(p.cached_tokens).saturating_sub(gpu);
            self.metrics.kvd_hit_tokens.inc_by(lower);
        }
        for f in finished {
            let Some(mut live) = self.live.remove(&f.id) else {
                continue;
            };
            let outcome = if f.rejected {
                Outcome::Rejected
            } else {
                Outcome::Finished
            };
            let total = if f.rejected {
                0
            } else {
                f.output_tokens.max(1)
            };
            live.tokens = total;
            publish_progress(&mut live, |pr| {
                pr.tokens = total;
                pr.outcome = Some(outcome);
            });
            self.release_block_tokens(&live.blocks);
            self.metrics.finished.inc();
            self.metrics.generation_tokens.inc_by(u64::from(total));
        }
        for live in self.live.values_mut() {
            if live.decoding && live.prefilled_step != step && live.tokens + 1 < live.target {
                live.tokens += 1;
                let tokens = live.tokens;
                publish_progress(live, |pr| pr.tokens = tokens);
            }
        }
    }
}

impl EngineLoop {
    /// Drops a leaving request's references to its blocks' token ids.
    fn release_block_tokens(&mut self, blocks: &[BlockHash]) {
        for hash in blocks {
            if let Some(b) = self.block_tokens.get_mut(hash) {
                b.refs -= 1;
                if b.refs == 0 {
                    self.block_tokens.remove(hash);
                }
            }
        }
    }

    /// Aborts, in the engine, every request whose client went away: its batch slot and blocks
    /// are freed for the others (its published blocks stay cached, as in vLLM's abort).
    fn cancel_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.progress.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            let Some(live) = self.live.remove(&id) else {
                continue;
            };
            self.model.abort(id);
            self.release_block_tokens(&live.blocks);
            self.metrics.detached.inc();
        }
    }
}

/// The lower-tier hook of the engine model: of the blocks `asked` (the prompt's blocks after its
/// GPU hit), how many lead the request's lower-tier prefix.
fn lower_tier(live: &FxHashMap<u64, Live>, id: u64, asked: &[BlockHash]) -> usize {
    live.get(&id).map_or(0, |l| {
        let gpu_hit = l.blocks.len().saturating_sub(asked.len());
        l.lower_blocks.saturating_sub(gpu_hit).min(asked.len())
    })
}

/// Publishes a change to a request's progress, unless its client is gone (then marks it
/// detached, once).
fn publish_progress(live: &mut Live, change: impl FnOnce(&mut Progress)) {
    if live.detached {
        return;
    }
    if live.progress.is_closed() {
        // Counted and aborted by `cancel_abandoned` at the end of the step.
        live.detached = true;
        return;
    }
    live.progress.send_modify(change);
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A process-unique, unpredictable 64-bit value (std's randomly keyed hasher, the clock and
/// the pid), used as the engine-hash salt and the id prefix.
pub(crate) fn process_random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
