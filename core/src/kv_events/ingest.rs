//! Ingest: a decoded [`EngineBatch`] → the router's core events, with router hashes.
//!
//! The router never trusts engine hashes (ARCHITECTURE.md "Block hashing"). For each `BlockStored`
//! it re-hashes the event's `token_ids` with [`hash_blocks`], chained after the router hash of the
//! event's parent block. The parent is resolved first among the blocks stored earlier in the same
//! batch (SGLang sends one event per page, each naming the previous page), then through the
//! caller's `lookup_parent` (normally [`KvIndex::router_hash`]). Invariants:
//!
//! - an event whose parent cannot be resolved is dropped and counted (`unknown_parent`): the
//!   router cannot know its prefix, and chaining from nothing would index wrong hashes;
//! - an event whose block size differs from the worker's is dropped and counted
//!   (`block_size_mismatch`), and so is one whose token count is not `blocks × block_size`
//!   (`token_count_mismatch`); neither is ever silent;
//! - non-full-attention events (`indexable: false`) are dropped and counted;
//! - a block the engine keys by more than its tokens (a LoRA adapter, a cache salt, an image:
//!   the event's `extra_keys`, or its `lora_name` and SGLang's `cache_salt`) is hashed with those keys
//!   ([`crate::hashing::identity`]), as the request side hashes a request of the same identity;
//!   an event whose `extra_keys` has not one entry per block is dropped and counted
//!   (`extra_keys_mismatch`);
//! - a block removed, or a cache cleared, earlier in the batch is not a valid parent any more,
//!   even if the index (not yet updated with this batch) still maps it.
//!
//! `BlockRemoved` becomes `KvBlocksRemoved` with `router_hashes` left empty (the index resolves
//! removals through its own engine → router map); `AllBlocksCleared` becomes
//! `KvCacheCleared { tier: None }`; `KvdTierLoad` becomes `TierLoadMeasured`. Counting is done locally and returned once per batch.
//!
//! [`KvIndex::router_hash`]: crate::index::KvIndex::router_hash

use super::{EngineBatch, EngineEvent};
use crate::event::{
    Event, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, Tier, TierLoadMeasured,
};
use crate::hashing::{ExtraKey, KvIdentity, hash_block_keyed, hash_blocks_under};
use crate::ids::{BlockHash, EngineHash, WorkerRank};
use std::collections::HashMap;

/// What ingesting one batch did, event by event class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IngestStats {
    /// `BlockStored` events turned into `KvBlocksStored`, and their blocks.
    pub stored: u32,
    pub stored_blocks: u32,
    /// `BlockRemoved` events turned into `KvBlocksRemoved`, and their blocks.
    pub removed: u32,
    pub removed_blocks: u32,
    /// `AllBlocksCleared` events.
    pub cleared: u32,
    /// Stored or removed events of a non-full-attention KV group, dropped.
    pub dropped_non_full_attention: u32,
    /// Stored events whose `block_size` differs from the worker's, dropped.
    pub block_size_mismatch: u32,
    /// Stored events whose token count is not `block_hashes.len() × block_size`, dropped.
    pub token_count_mismatch: u32,
    /// Stored events whose parent block the router does not know, dropped.
    pub unknown_parent: u32,
    /// Stored events whose `extra_keys` do not have one entry per block, dropped.
    pub extra_keys_mismatch: u32,
    /// 1 when the batch names a dp rank other than the worker rank it was ingested for (the
    /// events are still attributed to the given rank).
    pub dp_rank_mismatch: u32,
}

impl IngestStats {
    /// Events dropped for any reason.
    pub fn dropped(&self) -> u32 {
        self.dropped_non_full_attention
            + self.block_size_mismatch
            + self.token_count_mismatch
            + self.unknown_parent
            + self.extra_keys_mismatch
    }

    /// Adds another batch's counts to these.
    pub fn add(&mut self, o: &IngestStats) {
        self.stored += o.stored;
        self.stored_blocks += o.stored_blocks;
        self.removed += o.removed;
        self.removed_blocks += o.removed_blocks;
        self.cleared += o.cleared;
        self.dropped_non_full_attention += o.dropped_non_full_attention;
        self.block_size_mismatch += o.block_size_mismatch;
        self.token_count_mismatch += o.token_count_mismatch;
        self.unknown_parent += o.unknown_parent;
        self.extra_keys_mismatch += o.extra_keys_mismatch;
        self.dp_rank_mismatch += o.dp_rank_mismatch;
    }
}

/// The core events of one batch, in wire order, and what was dropped.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IngestOutcome {
    pub events: Vec<Event>,
    pub stats: IngestStats,
}

/// Turns one engine batch of `worker` into core events.
///
/// `expected_block_size` is the worker's registered block size. `lookup_parent(tier, engine)`
/// returns the router hash the index maps an engine hash of this worker rank to (for example
/// `|t, h| index.router_hash(worker, t, h)`).
pub fn to_core_events(
    batch: &EngineBatch,
    worker: &WorkerRank,
    expected_block_size: u32,
    lookup_parent: &dyn Fn(Tier, EngineHash) -> Option<BlockHash>,
) -> IngestOutcome {
    let mut out = IngestOutcome {
        events: Vec::with_capacity(batch.events.len()),
        stats: IngestStats::default(),
    };
    let stats = &mut out.stats;
    if batch.dp_rank.is_some_and(|r| r != worker.dp_rank) {
        stats.dp_rank_mismatch = 1;
    }
    // What this batch did so far: `Some(h)` stored with router hash `h`, `None` removed.
    let mut overlay: HashMap<(Tier, EngineHash), Option<BlockHash>> = HashMap::new();
    // After a clear, nothing the index holds for this worker is a valid parent.
    let mut cleared = false;

    for ev in &batch.events {
        match ev {
            EngineEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                tier,
                lora_id: _,
                lora_name,
                extra_keys,
                cache_salt,
                indexable,
            } => {
                if !indexable {
                    stats.dropped_non_full_attention += 1;
                    continue;
                }
                if *block_size != expected_block_size {
                    stats.block_size_mismatch += 1;
                    continue;
                }
                let router_parent = match parent {
                    None => None,
                    Some(p) => {
                        let found = match overlay.get(&(*tier, *p)) {
                            Some(known) => *known,
                            None if cleared => None,
                            None => lookup_parent(*tier, *p),
                        };
                        match found {
                            Some(h) => Some(h),
                            None => {
                                stats.unknown_parent += 1;
                                continue;
                            }
                        }
                    }
                };
                let bs = *block_size as usize;
                if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                    stats.token_count_mismatch += 1;
                    continue;
                }
                if extra_keys
                    .as_ref()
                    .is_some_and(|k| k.len() != block_hashes.len())
                {
                    stats.extra_keys_mismatch += 1;
                    continue;
                }
                let router_hashes = match extra_keys {
                    Some(keys) => per_block_keyed(token_ids, bs, router_parent, keys),
                    None => {
                        let identity = KvIdentity {
                            lora: lora_name.clone(),
                            // SGLang's salt keys a sequence's first block, as vLLM's does.
                            salt: cache_salt.clone().filter(|_| parent.is_none()),
                            mm: Vec::new(),
                        };
                        hash_blocks_under(token_ids, bs, router_parent, &identity)
                    }
                };
                for (e, r) in block_hashes.iter().zip(&router_hashes) {
                    overlay.insert((*tier, *e), Some(*r));
                }
                stats.stored += 1;
                stats.stored_blocks += block_hashes.len() as u32;
                out.events.push(Event::KvBlocksStored(KvBlocksStored {
                    worker: worker.clone(),
                    tier: *tier,
                    block_size: *block_size,
                    engine_hashes: block_hashes.clone(),
                    router_hashes,
                    parent: *parent,
                }));
            }
            EngineEvent::BlockRemoved {
                block_hashes,
                tier,
                indexable,
            } => {
                if !indexable {
                    stats.dropped_non_full_attention += 1;
                    continue;
                }
                for e in block_hashes {
                    overlay.insert((*tier, *e), None);
                }
                stats.removed += 1;
                stats.removed_blocks += block_hashes.len() as u32;
                out.events.push(Event::KvBlocksRemoved(KvBlocksRemoved {
                    worker: worker.clone(),
                    tier: *tier,
                    engine_hashes: block_hashes.clone(),
                    router_hashes: Vec::new(),
                }));
            }
            EngineEvent::AllBlocksCleared => {
                overlay.clear();
                cleared = true;
                stats.cleared += 1;
                out.events.push(Event::KvCacheCleared(KvCacheCleared {
                    worker: worker.clone(),
                    tier: None,
                }));
            }
            EngineEvent::TierLoad {
                tier,
                bytes_per_s,
                block_bytes,
            } => out.events.push(Event::TierLoadMeasured(TierLoadMeasured {
                source: worker.clone(),
                tier: *tier,
                bytes_per_s: *bytes_per_s,
                block_bytes: *block_bytes,
            })),
        }
    }
    out
}

/// The router hashes of a stored run of blocks with the engine's own keys for each block
/// (`extra_keys`, one entry per block: checked by the caller).
fn per_block_keyed(
    tokens: &[u32],
    block_size: usize,
    parent: Option<BlockHash>,
    keys: &[Vec<ExtraKey>],
) -> Vec<BlockHash> {
    let mut prev = parent;
    tokens
        .chunks_exact(block_size)
        .zip(keys)
        .map(|(block, keys)| {
            let h = hash_block_keyed(block, prev, keys);
            prev = Some(h);
            h
        })
        .collect()
}
