//! The kvds the fleet's workers load blocks from ([`crate::kv_events::kvd`]): which worker
//! names which node kvd, and how fast each kvd loads each tier.
//!
//! A kvd's inventory is indexed under its pseudo worker rank for as long as one registered
//! worker names it: the first registration that names it gives it an index slot, and when the
//! last such worker leaves (or names another kvd) its blocks and speeds are dropped.
//! Speeds come from `TierLoadMeasured` events of a named kvd (or of a registered worker, for an
//! engine's own offload tiers); the newest one per (source, tier) is kept.

use super::{FleetState, KvdAt};
use crate::event::{Tier, TierLoadMeasured, WorkerRecord};
use crate::ids::{BlockHash, WorkerId, WorkerRank};
use crate::index::WorkerSlot;
use crate::kv_events::kvd::{KvdLink, link_of, source_endpoint};
use std::collections::BTreeMap;
use std::sync::Arc;

/// How fast a source loads blocks of one tier: the median speed of its recent loads and their
/// mean size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierLoad {
    pub bytes_per_s: f64,
    pub block_bytes: u64,
}

/// See the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Kvds {
    by_worker: BTreeMap<WorkerId, KvdLink>,
    /// Per source, its speed per tier (by [`Tier::index`]).
    loads: BTreeMap<WorkerRank, [Option<TierLoad>; 4]>,
}

impl Kvds {
    /// Records the kvd `record` names (or that it names none). Returns the kvd it named before
    /// when no worker names that one any more.
    pub(super) fn link(&mut self, record: &WorkerRecord) -> Option<WorkerRank> {
        let old = match link_of(record) {
            Some(link) => self.by_worker.insert(record.worker_id.clone(), link),
            None => self.by_worker.remove(&record.worker_id),
        };
        self.orphaned(old)
    }

    /// Forgets `worker`'s link. Returns its kvd when no worker names it any more.
    pub(super) fn unlink(&mut self, worker: &WorkerId) -> Option<WorkerRank> {
        let old = self.by_worker.remove(worker);
        self.orphaned(old)
    }

    fn orphaned(&mut self, old: Option<KvdLink>) -> Option<WorkerRank> {
        let old = old?;
        if self.by_worker.values().any(|l| l.endpoint == old.endpoint) {
            return None;
        }
        let old = old.source();
        self.loads.remove(&old);
        Some(old)
    }

    /// Whether some registered worker names the kvd `source`.
    pub(super) fn links(&self, source: &WorkerId) -> bool {
        source_endpoint(source).is_some_and(|e| self.by_worker.values().any(|l| l.endpoint == e))
    }

    /// The kvd `worker` names.
    pub(super) fn of(&self, worker: &WorkerId) -> Option<&KvdLink> {
        self.by_worker.get(worker)
    }

    /// Every named kvd, once (the first worker's link of each).
    pub(super) fn sources(&self) -> Vec<KvdLink> {
        let mut seen: BTreeMap<String, KvdLink> = BTreeMap::new();
        for link in self.by_worker.values() {
            seen.entry(link.endpoint.clone())
                .or_insert_with(|| link.clone());
        }
        seen.into_values().collect()
    }

    /// Keeps a measured speed.
    pub(super) fn measured(&mut self, m: &TierLoadMeasured) {
        let load = TierLoad {
            bytes_per_s: m.bytes_per_s,
            block_bytes: m.block_bytes,
        };
        self.loads.entry(m.source.clone()).or_default()[m.tier.index()] = Some(load);
    }

    /// Forgets the speeds `source` measured.
    pub(super) fn forget(&mut self, source: &WorkerId) {
        self.loads.retain(|s, _| s.worker != *source);
    }

    pub(super) fn load(&self, source: &WorkerRank, tier: Tier) -> Option<TierLoad> {
        self.loads.get(source)?[tier.index()]
    }

    /// The speeds as events, for a dump.
    pub(super) fn dump(&self) -> impl Iterator<Item = TierLoadMeasured> + '_ {
        self.loads.iter().flat_map(|(source, loads)| {
            Tier::ALL.into_iter().filter_map(move |tier| {
                let l = loads[tier.index()]?;
                Some(TierLoadMeasured {
                    source: source.clone(),
                    tier,
                    bytes_per_s: l.bytes_per_s,
                    block_bytes: l.block_bytes,
                })
            })
        })
    }
}

/// The kvds as the router reads them.
impl FleetState {
    /// Whether a registered worker names the kvd `source` (its inventory is folded only then).
    pub fn links_kvd(&self, source: &WorkerId) -> bool {
        self.kvds.links(source)
    }

    /// The node kvd `worker` names, if any.
    pub fn kvd_link(&self, worker: &WorkerId) -> Option<&KvdLink> {
        self.kvds.of(worker)
    }

    /// Every kvd a registered worker names, once: the server subscribes to each.
    pub fn kvd_sources(&self) -> Vec<KvdLink> {
        self.kvds.sources()
    }

    /// The node kvd of the routable rank at `slot`, if it names one.
    pub fn kvd_at(&self, slot: WorkerSlot) -> Option<&KvdAt> {
        self.kvd_at.get(slot.index())?.as_ref()
    }

    /// The (block size, compat key) namespaces in which `model`'s candidates load blocks from
    /// a kvd, without repeats: the inventory hashes a request for it needs.
    pub fn kvd_namespaces(&self, model: &str) -> Vec<(u32, Arc<str>)> {
        let mut out: Vec<(u32, Arc<str>)> = Vec::new();
        if self.kvd_slots.is_empty() {
            return out;
        }
        let all = self.candidates.iter().filter(|((m, _), _)| m == model);
        for c in all.flat_map(|(_, c)| c) {
            if let Some(k) = self.kvd_at(c.slot)
                && !out
                    .iter()
                    .any(|(bs, ck)| *bs == c.block_size && *ck == k.compat_key)
            {
                out.push((c.block_size, Arc::clone(&k.compat_key)));
            }
        }
        out
    }

    /// How fast the source at `slot` (a kvd, or an engine's own offload tiers) loads `tier`,
    /// once it said.
    pub fn tier_load(&self, slot: WorkerSlot, tier: Tier) -> Option<TierLoad> {
        self.kvds.load(self.index.worker_of(slot)?, tier)
    }

    /// The blocks of `blocks[from..]` that `kvd` can load, by tier: the contiguous run of blocks
    /// each held in its L2 (`Host`), else its L3 (`Disk`), else the shared L4 (`External`) of
    /// any named kvd, each counted in the fastest tier holding it ([`Tier::index`] positions;
    /// the `Gpu` count is 0).
    pub fn lower_tier_run(&self, kvd: WorkerSlot, blocks: &[BlockHash], from: usize) -> [u32; 4] {
        let mut run = [0u32; 4];
        for &b in blocks.iter().skip(from) {
            let tier = if self.index.holds(Tier::Host, b, kvd) {
                Tier::Host
            } else if self.index.holds(Tier::Disk, b, kvd) {
                Tier::Disk
            } else if self
                .kvd_slots
                .iter()
                .any(|s| self.index.holds(Tier::External, b, *s))
            {
                Tier::External
            } else {
                break;
            };
            run[tier.index()] += 1;
        }
        run
    }

    pub(super) fn tier_load_measured(&mut self, m: &TierLoadMeasured) {
        if self.kvds.links(&m.source.worker) || self.serves(&m.source) {
            self.kvds.measured(m);
        }
    }
}
