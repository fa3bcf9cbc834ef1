//! The KV index: which worker rank holds which router block hash, in which tier.
//!
//! It owns, per tier, the map router hash → holder set, and per (worker rank, tier) the map engine
//! hash → router hash that removals and parent lookups resolve through. It is a projection of the
//! KV events ([`KvBlocksStored`], [`KvBlocksRemoved`], [`KvCacheCleared`]) and of
//! `WorkerDeregistered`; the router reads it through [`KvIndex::overlap`].
//!
//! # Semantics
//!
//! The engine → router map of each (worker rank, tier) is the truth. A (worker rank, tier) holds
//! router hash `H` while at least one of its engine hashes maps to `H` (engines that key blocks by
//! more than their tokens — LoRA id, multimodal hashes — can store one token prefix under several
//! engine hashes; removing one of them keeps `H` held). Storing an engine hash that is already
//! mapped to the same router hash is a no-op (duplicates are idempotent); storing it with a
//! different router hash remaps it (the engine reused its key for other content). A stored event's
//! `parent` is not needed: the router hashes travel in the event. Removing an engine hash the map
//! does not contain changes nothing and is counted in [`KvIndex::unknown_removals`]. Tiers are
//! independent: a block held in `Host` says nothing about `Gpu`.
//!
//! # Layout
//!
//! - Worker ranks get dense [`WorkerSlot`]s; a freed slot is reused, lowest number first, so a fleet
//!   of up to 64 ranks uses slots `0..64` only. Slot numbers are handles, not identities: never keep
//!   one across a `WorkerDeregistered`.
//! - Per tier, `TierHolders`: router hash → a `u64` bitset of slots `0..64`, plus side rows for
//!   slots ≥ 64 (see `holders.rs`).
//! - Per (slot, tier), `SlotTier`: engine hash → router hash, the number of distinct router hashes
//!   held, and a refcount side map that is empty unless several engine hashes of that rank and
//!   tier map to the same router hash.
//! - The holder map is read on every overlap query, so it is a `U64Map` (`table.rs`: linear
//!   probing, key and value in one 16-byte slot, at most 3/4 full: 21–43 bytes per distinct router
//!   hash and one cache line per lookup). The engine maps are written on every event and read only
//!   by removals, so they stay `FxHashMap`s (hashbrown, at most 7/8 full: 19–39 bytes per block;
//!   inserting a new key reads only the small control bytes, and the bucket miss is a store that
//!   does not stall).
//!
//! # Invariants (checked by [`KvIndex::check_invariants`])
//!
//! - slot `s` is in a tier's holder set of `H` iff some engine hash of `(s, tier)` maps to `H`;
//! - `extra[H]` = (number of engine hashes of `(s, tier)` mapping to `H`) − 1, present only when ≥ 1;
//! - `held` = number of distinct router hashes of `(s, tier)`; `entries` = total holder bits;
//! - a free slot has no worker and empty maps; every live slot is in `by_worker` and vice versa.
//!
//! # Cost
//!
//! Ingest: two hash-map operations per block (engine map, holder set). Overlap: one lookup per
//! request block until the last candidate drops out (see `overlap.rs`). Memory: about 50 bytes per
//! (block, worker rank) entry when blocks are shared by two ranks on average. `benches/index.rs`
//! measures all three on a 64-rank, 1 M-entry fleet.

mod holders;
mod overlap;
mod snapshot;
mod table;
#[cfg(test)]
mod tests;

pub use snapshot::DUMP_CHUNK;

use crate::event::{KvBlocksRemoved, KvBlocksStored, KvCacheCleared, Tier};
use crate::ids::{BlockHash, EngineHash, WorkerId, WorkerRank};
use holders::{TierHolders, map_bytes};
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

const TIERS: usize = Tier::ALL.len();

/// Dense handle of a (worker, dp rank) inside one index; reused after the worker is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSlot(pub u32);

impl WorkerSlot {
    /// The slot as an array index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The KV index. See the module docs for semantics, layout and invariants.
#[derive(Clone)]
pub struct KvIndex {
    slots: Vec<SlotState>,
    by_worker: FxHashMap<WorkerRank, WorkerSlot>,
    free: BinaryHeap<Reverse<u32>>,
    tiers: [TierHolders; TIERS],
    entries: usize,
    unknown_removals: u64,
    mismatched_events: u64,
}

/// One slot: its worker rank (if live) and its per-tier maps.
#[derive(Clone, Default)]
struct SlotState {
    worker: Option<WorkerRank>,
    /// Block size of the last stored event, so that a dump carries it.
    block_size: u32,
    tiers: [SlotTier; TIERS],
}

/// One (slot, tier).
#[derive(Clone, Default)]
struct SlotTier {
    /// Engine hash → router hash.
    engine: FxHashMap<u64, u64>,
    /// Router hash → how many engine hashes beyond the first map to it.
    extra: FxHashMap<u64, u32>,
    /// Distinct router hashes held.
    held: usize,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// Records one more engine hash of `(slot, tier)` mapping to `router`.
fn hold(h: &mut TierHolders, st: &mut SlotTier, slot: u32, router: u64, entries: &mut usize) {
    if h.set(router, slot) {
        st.held += 1;
        *entries += 1;
    } else {
        *st.extra.entry(router).or_insert(0) += 1;
    }
}

/// Records one engine hash of `(slot, tier)` mapping to `router` less.
fn release(h: &mut TierHolders, st: &mut SlotTier, slot: u32, router: u64, entries: &mut usize) {
    if let Some(n) = st.extra.get_mut(&router) {
        *n -= 1;
        if *n == 0 {
            st.extra.remove(&router);
        }
    } else if h.clear(router, slot) {
        st.held -= 1;
        *entries -= 1;
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self {
            slots: Vec::new(),
            by_worker: FxHashMap::default(),
            free: BinaryHeap::new(),
            tiers: Default::default(),
            entries: 0,
            unknown_removals: 0,
            mismatched_events: 0,
        }
    }

    /// The slot of `w`, if it has one.
    pub fn slot(&self, w: &WorkerRank) -> Option<WorkerSlot> {
        self.by_worker.get(w).copied()
    }

    /// The slot of `w`, created (lowest free number first) if it has none.
    pub fn ensure_slot(&mut self, w: &WorkerRank) -> WorkerSlot {
        if let Some(&s) = self.by_worker.get(w) {
            return s;
        }
        let idx = match self.free.pop() {
            Some(Reverse(i)) => i,
            None => {
                self.slots.push(SlotState::default());
                // More than 4 billion worker ranks cannot be registered: the cast cannot truncate.
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[idx as usize].worker = Some(w.clone());
        self.by_worker.insert(w.clone(), WorkerSlot(idx));
        WorkerSlot(idx)
    }

    /// The worker rank that `s` currently stands for.
    pub fn worker_of(&self, s: WorkerSlot) -> Option<&WorkerRank> {
        self.slots.get(s.index()).and_then(|st| st.worker.as_ref())
    }

    /// Folds in stored blocks; creates the worker rank's slot if needed.
    ///
    /// Pairs `engine_hashes[i]` with `router_hashes[i]`; if the lists differ in length the extra
    /// hashes are ignored and the event is counted in [`Self::mismatched_events`].
    pub fn apply_stored(&mut self, ev: &KvBlocksStored) {
        if ev.engine_hashes.len() != ev.router_hashes.len() {
            self.mismatched_events += 1;
        }
        let s = self.ensure_slot(&ev.worker).0;
        let t = ev.tier.index();
        let slot = &mut self.slots[s as usize];
        slot.block_size = ev.block_size;
        let st = &mut slot.tiers[t];
        let h = &mut self.tiers[t];
        let entries = &mut self.entries;
        for (e, r) in ev.engine_hashes.iter().zip(&ev.router_hashes) {
            match st.engine.insert(e.0, r.0) {
                None => hold(h, st, s, r.0, entries),
                Some(old) if old == r.0 => {}
                Some(old) => {
                    release(h, st, s, old, entries);
                    hold(h, st, s, r.0, entries);
                }
            }
        }
    }

    /// Folds in evicted blocks, resolving engine hashes through the (worker rank, tier) map.
    /// Unknown engine hashes (or an unknown worker rank) change nothing and are counted.
    pub fn apply_removed(&mut self, ev: &KvBlocksRemoved) {
        let Some(s) = self.slot(&ev.worker) else {
            self.unknown_removals += ev.engine_hashes.len() as u64;
            return;
        };
        let t = ev.tier.index();
        let st = &mut self.slots[s.index()].tiers[t];
        let h = &mut self.tiers[t];
        for e in &ev.engine_hashes {
            match st.engine.remove(&e.0) {
                Some(r) => release(h, st, s.0, r, &mut self.entries),
                None => self.unknown_removals += 1,
            }
        }
    }

    /// Drops one tier (or, with `tier: None`, every tier) of a worker rank. The slot stays.
    pub fn apply_cleared(&mut self, ev: &KvCacheCleared) {
        let Some(s) = self.slot(&ev.worker) else {
            return;
        };
        match ev.tier {
            Some(t) => self.clear_tier(s, t),
            None => Tier::ALL.into_iter().for_each(|t| self.clear_tier(s, t)),
        }
    }

    fn clear_tier(&mut self, s: WorkerSlot, tier: Tier) {
        let t = tier.index();
        let st = std::mem::take(&mut self.slots[s.index()].tiers[t]);
        let h = &mut self.tiers[t];
        for &r in st.engine.values() {
            if h.clear(r, s.0) {
                self.entries -= 1;
            }
        }
    }

    /// Drops every dp rank and tier of `worker` and frees their slots.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        let mut gone: Vec<WorkerSlot> = self
            .by_worker
            .iter()
            .filter(|(w, _)| &w.worker == worker)
            .map(|(_, &s)| s)
            .collect();
        gone.sort_unstable();
        for s in gone {
            Tier::ALL.into_iter().for_each(|t| self.clear_tier(s, t));
            let slot = &mut self.slots[s.index()];
            if let Some(w) = slot.worker.take() {
                self.by_worker.remove(&w);
            }
            *slot = SlotState::default();
            self.free.push(Reverse(s.0));
        }
    }

    /// The router hash that `engine` of `(w, tier)` maps to, for parent lookups at ingest.
    pub fn router_hash(&self, w: &WorkerRank, tier: Tier, engine: EngineHash) -> Option<BlockHash> {
        let s = self.slot(w)?;
        self.slots[s.index()].tiers[tier.index()]
            .engine
            .get(&engine.0)
            .map(|&r| BlockHash(r))
    }

    /// For each candidate, the number of leading blocks of `blocks` that this candidate holds in
    /// `tier` (contiguous prefix: stop at the first block it lacks). `out` is cleared and gets
    /// `candidates.len()` values, in candidate order. A slot with no worker gets 0.
    pub fn overlap(
        &self,
        tier: Tier,
        blocks: &[BlockHash],
        candidates: &[WorkerSlot],
        out: &mut Vec<u32>,
    ) {
        self.tiers[tier.index()].overlap(blocks, candidates, out);
    }

    /// Whether the rank at `slot` holds `block` in `tier`.
    pub fn holds(&self, tier: Tier, block: BlockHash, slot: WorkerSlot) -> bool {
        self.tiers[tier.index()].holds(block.0, slot.0)
    }

    /// Distinct router hashes that `(w, tier)` holds.
    pub fn blocks_of(&self, w: &WorkerRank, tier: Tier) -> usize {
        self.slot(w)
            .map_or(0, |s| self.slots[s.index()].tiers[tier.index()].held)
    }

    /// Number of (router block hash, worker rank, tier) entries.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct router hashes held by anyone in `tier`.
    pub fn distinct_blocks(&self, tier: Tier) -> usize {
        self.tiers[tier.index()].len()
    }

    /// Removals of engine hashes the index never saw (or had already dropped), for metrics.
    pub fn unknown_removals(&self) -> u64 {
        self.unknown_removals
    }

    /// Stored events whose engine and router hash lists differ in length, for metrics.
    pub fn mismatched_events(&self) -> u64 {
        self.mismatched_events
    }

    /// Heap bytes, estimated from container capacities (within a few percent of the allocator's
    /// count; worker id strings are included).
    pub fn heap_bytes(&self) -> usize {
        let tiers: usize = self.tiers.iter().map(TierHolders::heap_bytes).sum();
        let slots: usize = self
            .slots
            .iter()
            .map(|s| {
                let name = s.worker.as_ref().map_or(0, |w| w.worker.0.capacity());
                let maps: usize = s
                    .tiers
                    .iter()
                    .map(|t| {
                        map_bytes::<u64, u64>(t.engine.capacity())
                            + map_bytes::<u64, u32>(t.extra.capacity())
                    })
                    .sum();
                // The name is stored twice: in the slot and as the `by_worker` key.
                2 * name + maps
            })
            .sum();
        tiers
            + slots
            + self.slots.capacity() * std::mem::size_of::<SlotState>()
            + map_bytes::<WorkerRank, WorkerSlot>(self.by_worker.capacity())
            + self.free.capacity() * 4
    }
}
