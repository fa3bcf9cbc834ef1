//! The index as a projection: folding events in, dumping itself as events, logical equality, and
//! the invariant check used by tests.
//!
//! A dump is one [`KvBlocksStored`] per (worker rank, tier) and chunk of [`DUMP_CHUNK`] blocks,
//! sorted by worker rank, then tier, then engine hash, with `parent: None` and the block size of the
//! rank's last stored event. Applied to an empty index it rebuilds every engine → router map, hence
//! (by the invariants) every holder set. Counters (`unknown_removals`, `mismatched_events`) and slot
//! numbers are not part of the logical state and are not dumped.

use super::{KvIndex, SlotTier, TIERS};
use crate::event::{Envelope, Event, KvBlocksStored, Tier};
use crate::ids::{BlockHash, EngineHash, WorkerRank};
use crate::projection::Projection;
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;

/// Most blocks in one dumped event, so snapshot records stay small.
pub const DUMP_CHUNK: usize = 4096;

impl Projection for KvIndex {
    fn apply(&mut self, env: &Envelope) {
        match &env.event {
            Event::KvBlocksStored(ev) => self.apply_stored(ev),
            Event::KvBlocksRemoved(ev) => self.apply_removed(ev),
            Event::KvCacheCleared(ev) => self.apply_cleared(ev),
            Event::WorkerDeregistered(ev) => self.remove_worker(&ev.worker),
            Event::WorkerRegistered(_)
            | Event::WorkerDraining(_)
            | Event::RequestRouted(_)
            | Event::RequestPrefilled(_)
            | Event::RequestFinished(_)
            | Event::RecentLoad(_)
            | Event::TierLoadMeasured(_)
            | Event::RouterRetuned(_) => {}
        }
    }

    fn dump(&self) -> Vec<Event> {
        let mut out = Vec::new();
        for ((w, tier), (block_size, st)) in self.logical_maps() {
            let mut pairs: Vec<(u64, u64)> = st.engine.iter().map(|(&e, &r)| (e, r)).collect();
            pairs.sort_unstable();
            for chunk in pairs.chunks(DUMP_CHUNK) {
                out.push(Event::KvBlocksStored(KvBlocksStored {
                    worker: w.clone(),
                    tier,
                    block_size,
                    engine_hashes: chunk.iter().map(|&(e, _)| EngineHash(e)).collect(),
                    router_hashes: chunk.iter().map(|&(_, r)| BlockHash(r)).collect(),
                    parent: None,
                }));
            }
        }
        out
    }
}

impl KvIndex {
    /// Every non-empty (worker rank, tier) with its block size and maps, sorted.
    fn logical_maps(&self) -> BTreeMap<(&WorkerRank, Tier), (u32, &SlotTier)> {
        let mut out = BTreeMap::new();
        for s in &self.slots {
            let Some(w) = &s.worker else { continue };
            for tier in Tier::ALL {
                let st = &s.tiers[tier.index()];
                if !st.engine.is_empty() {
                    out.insert((w, tier), (s.block_size, st));
                }
            }
        }
        out
    }

    /// The worker ranks holding `router` in tier `t`, sorted.
    fn holders_of(&self, t: usize, router: u64) -> Vec<Option<&WorkerRank>> {
        let mut ws: Vec<_> = self.tiers[t]
            .slots_of(router)
            .into_iter()
            .map(|s| self.slots.get(s as usize).and_then(|st| st.worker.as_ref()))
            .collect();
        ws.sort_unstable();
        ws
    }

    /// Verifies the invariants of the module docs. O(entries); for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.by_worker.len() != self.slots.iter().filter(|s| s.worker.is_some()).count() {
            return Err("by_worker and live slots differ in number".to_owned());
        }
        for (w, s) in &self.by_worker {
            if self.worker_of(*s) != Some(w) {
                return Err(format!(
                    "{w} maps to slot {} that stands for another rank",
                    s.0
                ));
            }
        }
        for &Reverse(f) in self.free.iter() {
            let st = self.slots.get(f as usize).ok_or("free slot out of range")?;
            if st.worker.is_some() || st.tiers.iter().any(|t| !t.engine.is_empty()) {
                return Err(format!("free slot {f} is in use"));
            }
        }
        let mut pairs = 0usize;
        for t in 0..TIERS {
            pairs += self.tiers[t]
                .check()
                .map_err(|e| format!("tier {t}: {e}"))?;
            // Expected holders, derived from the engine maps.
            let mut want: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
            for (s, slot) in self.slots.iter().enumerate() {
                let st = &slot.tiers[t];
                let mut count: FxHashMap<u64, u32> = FxHashMap::default();
                for &r in st.engine.values() {
                    *count.entry(r).or_insert(0) += 1;
                }
                if st.held != count.len() {
                    return Err(format!(
                        "slot {s} tier {t}: held {} != {}",
                        st.held,
                        count.len()
                    ));
                }
                let extra: FxHashMap<u64, u32> = count
                    .iter()
                    .filter(|(_, n)| **n > 1)
                    .map(|(&r, &n)| (r, n - 1))
                    .collect();
                if extra != st.extra {
                    return Err(format!("slot {s} tier {t}: refcounts differ from the map"));
                }
                for r in count.into_keys() {
                    want.entry(r).or_default().push(s as u32);
                }
            }
            if want.len() != self.tiers[t].len() {
                return Err(format!(
                    "tier {t}: {} routers held, want {}",
                    self.tiers[t].len(),
                    want.len()
                ));
            }
            for (r, mut slots) in want {
                slots.sort_unstable();
                if self.tiers[t].slots_of(r) != slots {
                    return Err(format!(
                        "tier {t}: holders of {r:#x} differ from the engine maps"
                    ));
                }
            }
        }
        if pairs != self.entries {
            return Err(format!("entries {} != holder bits {pairs}", self.entries));
        }
        Ok(())
    }
}

/// Logical equality: the same engine → router map for every non-empty (worker rank, tier), and the
/// same worker ranks holding each router hash in each tier. Slot numbers, counters and block sizes
/// are ignored.
impl PartialEq for KvIndex {
    fn eq(&self, other: &Self) -> bool {
        if self.entries != other.entries {
            return false;
        }
        let (a, b) = (self.logical_maps(), other.logical_maps());
        if a.len() != b.len()
            || a.iter()
                .zip(&b)
                .any(|((ka, (_, sa)), (kb, (_, sb)))| ka != kb || sa.engine != sb.engine)
        {
            return false;
        }
        (0..TIERS).all(|t| {
            self.tiers[t].len() == other.tiers[t].len()
                && self.tiers[t]
                    .routers()
                    .all(|r| self.holders_of(t, r) == other.holders_of(t, r))
        })
    }
}

impl Eq for KvIndex {}

/// A summary: an index can hold millions of entries.
impl fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let distinct: Vec<usize> = self.tiers.iter().map(|t| t.len()).collect();
        f.debug_struct("KvIndex")
            .field("worker_ranks", &self.by_worker.len())
            .field("slots", &self.slots.len())
            .field("entries", &self.entries)
            .field("distinct_blocks_per_tier", &distinct)
            .field("unknown_removals", &self.unknown_removals)
            .field("mismatched_events", &self.mismatched_events)
            .finish()
    }
}
