//! The simulated node kvds: with lower tiers configured ([`super::TierConfig`]), each simulated
//! worker is its own node, whose kvd publishes what the worker's L2 and L3 hold, as a live kvd
//! does (`infera_core::kv_events::kvd`), so the replayed router credits tier hits with the same
//! cost as the live one.
//!
//! Within the simulator a block's inventory name is its router hash (the simulated engines
//! have no connector keys), on both sides: the kvd's events and the request's
//! [`RouteRequest::kvd`](infera_core::policy::RouteRequest). The kvd's measured speed is the
//! engine model's own load cost, so the credit it earns is the time the simulated engine
//! actually saves.

use super::TierChange;
use infera_core::engine::EngineConfig;
use infera_core::event::{
    Event, KvBlocksRemoved, KvBlocksStored, PREFILL_TOKENS_PER_S, Tier, TierLoadMeasured,
    WorkerRecord,
};
use infera_core::ids::{BlockHash, EngineHash, WorkerRank};
use infera_core::kv_events::kvd::{KVD_EVENTS_ENDPOINT, link_of};
use infera_core::policy::KvdHashes;

/// Names `record`'s node kvd (and its engine's prefill speed) in its registration; returns the
/// kvd's pseudo worker rank.
pub(super) fn link(record: &mut WorkerRecord, engine: &EngineConfig) -> Option<WorkerRank> {
    let node = record.worker_id.as_str().split(':').next().unwrap_or("sim");
    let endpoint = format!("tcp://{node}:5590");
    record
        .extra
        .insert(KVD_EVENTS_ENDPOINT.into(), endpoint.into());
    if let Some(speed) = engine.prefill_tokens_per_s() {
        record
            .extra
            .insert(PREFILL_TOKENS_PER_S.into(), speed.into());
    }
    link_of(record).map(|l| l.source())
}

/// The kvd's measured speeds: loading a block from L2 or L3 takes what the engine model charges
/// (one byte per token, so the speed is in tokens per second).
pub(super) fn speeds(source: &WorkerRank, engine: &EngineConfig) -> Vec<Event> {
    let load_s = engine.timing.load_ms(1) / 1000.0 / engine.speedup;
    if load_s <= 0.0 || !load_s.is_finite() {
        return Vec::new();
    }
    let block_bytes = u64::from(engine.block_size.max(1));
    [Tier::Host, Tier::Disk]
        .into_iter()
        .map(|tier| {
            Event::TierLoadMeasured(TierLoadMeasured {
                source: source.clone(),
                tier,
                bytes_per_s: block_bytes as f64 / load_s,
                block_bytes,
            })
        })
        .collect()
}

/// `changes` of the kvd `source`'s tiers as index events, each block named by `name`.
pub(super) fn events(
    source: &WorkerRank,
    changes: &[TierChange],
    name: impl Fn(BlockHash) -> BlockHash,
) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    // Consecutive changes of one kind and tier make one event, as a kvd batches them.
    for group in changes.chunk_by(|a, b| a.tier == b.tier && a.stored == b.stored) {
        let names: Vec<BlockHash> = group.iter().map(|c| name(c.block)).collect();
        let engine: Vec<EngineHash> = names.iter().map(|h| EngineHash(h.0)).collect();
        let (tier, stored) = (group[0].tier, group[0].stored);
        out.push(if stored {
            Event::KvBlocksStored(KvBlocksStored {
                worker: source.clone(),
                tier,
                block_size: 0,
                engine_hashes: engine,
                router_hashes: names,
                parent: None,
            })
        } else {
            Event::KvBlocksRemoved(KvBlocksRemoved {
                worker: source.clone(),
                tier,
                engine_hashes: engine,
                router_hashes: Vec::new(),
            })
        });
    }
    out
}

/// A request's inventory names: its routed hashes.
pub(super) fn request_hashes(block_size: u32, routed: &[BlockHash]) -> Vec<KvdHashes> {
    vec![KvdHashes {
        block_size,
        compat_key: "".into(),
        hashes: routed.to_vec(),
    }]
}
