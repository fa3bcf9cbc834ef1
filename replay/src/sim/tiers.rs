//! The KV-cache daemon's tiers behind one simulated engine: host RAM (L2) and NVMe (L3).
//!
//! Blocks the GPU evicts are offered to L2 with the retention class (and TTL) of the request that
//! last used them; L2 evicts lowest class first, then LRU, and never displaces a higher class (the
//! same [`ClassedLru`] the daemon uses). Blocks L2 evicts, or refuses, go to L3 when their class is
//! `short` or `long`; `none` and `ephemeral` never reach disk. A lookup walks the request's blocks
//! after its GPU hit and counts the contiguous run found in L2 or L3, refreshing their recency
//! (blocks are read in place: reading a run never evicts part of it).
//!
//! Every change of what L2 or L3 holds is kept as a [`TierChange`] until the simulator takes
//! it ([`Tiers::take_changes`]) and publishes it as the node kvd's inventory, as a live kvd does.

use infera_core::event::{Retention, Tier};
use infera_core::ids::BlockHash;
use infera_core::retention::ClassedLru;
use rustc_hash::FxHashMap;

/// Capacities of the simulated tiers, in blocks (0 = the tier is absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct TierConfig {
    pub host_blocks: u64,
    pub disk_blocks: u64,
}

/// Where a lookup found each block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LowerHits {
    pub host: u32,
    pub disk: u32,
}

/// A block entering (`stored`) or leaving a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierChange {
    pub tier: Tier,
    pub stored: bool,
    pub block: BlockHash,
}

/// One engine's lower tiers, plus the class of every block it holds on the GPU.
#[derive(Debug)]
pub struct Tiers {
    host: Option<ClassedLru<BlockHash>>,
    disk: Option<ClassedLru<BlockHash>>,
    /// What entered or left L2 and L3 since the last [`Tiers::take_changes`].
    changes: Vec<TierChange>,
    /// Class and expiry of blocks resident on the GPU (from the requests that used them).
    gpu_class: FxHashMap<BlockHash, (Retention, Option<u64>)>,
}

impl Tiers {
    pub fn new(cfg: TierConfig) -> Self {
        Self {
            host: (cfg.host_blocks > 0).then(|| ClassedLru::new(cfg.host_blocks)),
            disk: (cfg.disk_blocks > 0).then(|| ClassedLru::new(cfg.disk_blocks)),
            changes: Vec::new(),
            gpu_class: FxHashMap::default(),
        }
    }

    /// What entered or left L2 and L3 since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<TierChange> {
        std::mem::take(&mut self.changes)
    }

    fn changed(&mut self, tier: Tier, stored: bool, block: BlockHash) {
        self.changes.push(TierChange {
            tier,
            stored,
            block,
        });
    }

    pub fn enabled(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }

    /// A request with `class` / `expires_at` uses `blocks` on the GPU: they take the higher class.
    pub fn note_use(&mut self, blocks: &[BlockHash], class: Retention, expires_at: Option<u64>) {
        if !self.enabled() {
            return;
        }
        for b in blocks {
            let e = self.gpu_class.entry(*b).or_insert((class, expires_at));
            if class > e.0 {
                *e = (class, expires_at);
            } else if class == e.0 {
                e.1 = match (e.1, expires_at) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
        }
    }

    /// The GPU evicted `blocks` at `now`: offer them to the lower tiers.
    pub fn gpu_evicted(&mut self, blocks: &[BlockHash], now: u64) {
        if !self.enabled() {
            return;
        }
        for b in blocks {
            // Kept after eviction: a block can be evicted again (after a preemption or a reload)
            // without a new request touching it.
            let (class, expires_at) = self
                .gpu_class
                .get(b)
                .copied()
                .unwrap_or((Retention::Long, None));
            if expires_at.is_some_and(|t| t <= now) {
                continue;
            }
            self.offer_host(*b, class, expires_at);
        }
    }

    fn offer_host(&mut self, b: BlockHash, class: Retention, expires_at: Option<u64>) {
        let Some(host) = self.host.as_mut() else {
            self.offer_disk(b, class, expires_at);
            return;
        };
        match host.insert(b, 1, class, expires_at) {
            Ok(evicted) => {
                self.changed(Tier::Host, true, b);
                for e in evicted {
                    self.changed(Tier::Host, false, e.key);
                    self.offer_disk(e.key, e.class, e.expires_at);
                }
            }
            Err(_) => self.offer_disk(b, class, expires_at),
        }
    }

    fn offer_disk(&mut self, b: BlockHash, class: Retention, expires_at: Option<u64>) {
        if class < Retention::Short {
            return; // none and ephemeral never reach disk
        }
        if let Some(disk) = self.disk.as_mut()
            && let Ok(evicted) = disk.insert(b, 1, class, expires_at)
        {
            self.changed(Tier::Disk, true, b);
            for e in evicted {
                self.changed(Tier::Disk, false, e.key);
            }
        }
    }

    /// Counts the contiguous run of `blocks` held in L2 or L3 at `now`, promoting L3 hits to L2.
    pub fn lookup(&mut self, blocks: &[BlockHash], now: u64) -> LowerHits {
        let mut hits = LowerHits::default();
        if !self.enabled() {
            return hits;
        }
        let expired_host = self
            .host
            .as_mut()
            .map(|h| h.expire(now))
            .unwrap_or_default();
        let expired_disk = self
            .disk
            .as_mut()
            .map(|d| d.expire(now))
            .unwrap_or_default();
        for e in expired_host {
            self.changed(Tier::Host, false, e.key);
        }
        for e in expired_disk {
            self.changed(Tier::Disk, false, e.key);
        }
        // Measure the run first, then touch it, so reading a run never evicts part of itself.
        let mut tiers_of = Vec::new();
        for b in blocks {
            if self.host.as_ref().is_some_and(|h| h.contains(b, now)) {
                tiers_of.push(true);
            } else if self.disk.as_ref().is_some_and(|d| d.contains(b, now)) {
                tiers_of.push(false);
            } else {
                break;
            }
        }
        for (b, in_host) in blocks.iter().zip(&tiers_of) {
            if *in_host {
                hits.host += 1;
                if let Some(h) = self.host.as_mut() {
                    h.get(b, now);
                }
            } else {
                hits.disk += 1;
                if let Some(d) = self.disk.as_mut() {
                    d.get(b, now);
                }
            }
        }
        hits
    }

    /// Blocks held in (host, disk).
    pub fn occupancy(&self) -> (u64, u64) {
        (
            self.host.as_ref().map(|h| h.used()).unwrap_or(0),
            self.disk.as_ref().map(|d| d.used()).unwrap_or(0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bh(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|x| BlockHash(*x)).collect()
    }

    #[test]
    fn evicted_blocks_are_found_again_in_order() {
        let mut t = Tiers::new(TierConfig {
            host_blocks: 2,
            disk_blocks: 4,
        });
        t.note_use(&bh(&[1, 2, 3]), Retention::Long, None);
        t.gpu_evicted(&bh(&[1, 2, 3]), 0);
        assert_eq!(t.occupancy(), (2, 1));
        // 1 went to disk when 3 arrived in host.
        assert_eq!(
            t.lookup(&bh(&[1, 2, 3, 4]), 0),
            LowerHits { host: 2, disk: 1 }
        );
        assert_eq!(
            t.lookup(&bh(&[1, 2, 3, 4]), 0),
            LowerHits { host: 2, disk: 1 },
            "reading moves nothing"
        );
    }

    #[test]
    fn every_change_of_l2_and_l3_is_reported_in_order() {
        let mut t = Tiers::new(TierConfig {
            host_blocks: 1,
            disk_blocks: 1,
        });
        t.note_use(&bh(&[1, 2, 3]), Retention::Long, None);
        t.gpu_evicted(&bh(&[1, 2, 3]), 0);
        let seen: Vec<(Tier, bool, u64)> = t
            .take_changes()
            .iter()
            .map(|c| (c.tier, c.stored, c.block.0))
            .collect();
        assert_eq!(
            seen,
            vec![
                (Tier::Host, true, 1),
                (Tier::Host, true, 2),
                (Tier::Host, false, 1),
                (Tier::Disk, true, 1),
                (Tier::Host, true, 3),
                (Tier::Host, false, 2),
                (Tier::Disk, true, 2),
                (Tier::Disk, false, 1),
            ]
        );
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn none_and_ephemeral_never_reach_disk() {
        let mut t = Tiers::new(TierConfig {
            host_blocks: 0,
            disk_blocks: 10,
        });
        t.note_use(&bh(&[1]), Retention::None, None);
        t.note_use(&bh(&[2]), Retention::Ephemeral, None);
        t.note_use(&bh(&[3]), Retention::Short, None);
        t.gpu_evicted(&bh(&[1, 2, 3]), 0);
        assert_eq!(t.occupancy(), (0, 1));
    }

    #[test]
    fn short_cannot_evict_long_and_ttl_expires() {
        let mut t = Tiers::new(TierConfig {
            host_blocks: 1,
            disk_blocks: 0,
        });
        t.note_use(&bh(&[1]), Retention::Long, None);
        t.note_use(&bh(&[2]), Retention::Short, Some(100));
        t.gpu_evicted(&bh(&[1, 2]), 0);
        assert_eq!(t.lookup(&bh(&[1]), 0).host, 1);
        assert_eq!(t.lookup(&bh(&[2]), 0).host, 0);
        let mut t = Tiers::new(TierConfig {
            host_blocks: 4,
            disk_blocks: 0,
        });
        t.note_use(&bh(&[5]), Retention::Short, Some(100));
        t.gpu_evicted(&bh(&[5]), 0);
        assert_eq!(t.lookup(&bh(&[5]), 99).host, 1);
        assert_eq!(t.lookup(&bh(&[5]), 100).host, 0);
        assert_eq!(t.occupancy(), (0, 0));
    }
}
