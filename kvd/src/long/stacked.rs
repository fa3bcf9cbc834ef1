//! [`Stacked`]: the L3 tablespace with an L4 behind it (L2 → L3 → L4, `--l4-backend`).
//!
//! - Every block given to the backend goes to both tiers: L3 as usual, L4 through its
//!   write-behind queue (never waiting). Removals go to both. So L4 holds what L3 evicted.
//! - A read asks L3 first and L4 for L3's misses (one batch); an L4 hit is promoted into L3
//!   (when L3 has queue room and the key did not change meanwhile) on its way to L2.
//! - Writes and promotions of one key are serialised by a striped lock (taken inside the L2
//!   lock for writes; alone for promotions), so a promotion can never put an older L4 value
//!   over a newer write in L3.
//! - Generations: L3's own, or, for an L4 hit not promoted into L3, the L4's with the top bit
//!   set; [`LongStore::is_current`] asks the tier that issued it.
//! - Durability, checkpoints and flush errors are L3's; the L4 is best effort (its failures
//!   are counted and logged, never returned).

use super::{LongBlock, LongHit, LongRejected, LongStore, Put, WritePermit};
use crate::inventory::Inventory;
use crate::l4::L4;
use crate::proto::Namespace;
use crate::stats::LongStats;
use bytes::Bytes;
use infera_core::event::Retention;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

const STRIPES: usize = 64;
const FROM_L4: u64 = 1 << 63;

/// See the module docs.
#[derive(Debug)]
pub struct Stacked {
    l3: Arc<dyn LongStore>,
    l4: Arc<L4>,
    stripes: Box<[Mutex<()>]>,
}

impl Stacked {
    /// `l3` with `l4` behind it.
    pub fn new(l3: Arc<dyn LongStore>, l4: Arc<L4>) -> Self {
        Self {
            l3,
            l4,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    fn stripe(&self, hash: u128) -> MutexGuard<'_, ()> {
        self.stripes[(hash as usize) % STRIPES]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Puts an L4 hit into L3 unless the key changed; the hit's generation either way.
    fn promote(&self, ns: &Namespace, key: &Bytes, hash: u128, hit: &LongHit, now: u64) -> u64 {
        let _stripe = self.stripe(hash);
        let fresh =
            self.l4.is_current(hash, hit.generation) && self.l3.class_of(hash, now).is_none();
        if fresh && let Some(permit) = self.l3.try_write_permit(hit.value.len() as u64) {
            let block = LongBlock {
                hash,
                ns: ns.clone(),
                key: key.clone(),
                value: hit.value.clone(),
                metadata: None,
                class: hit.class,
                expires_at: hit.expires_at,
            };
            if let Ok(put) = self.l3.put(block, permit, now, false) {
                return put.generation;
            }
        }
        hit.generation | FROM_L4
    }
}

#[async_trait::async_trait]
impl LongStore for Stacked {
    fn kind(&self) -> &'static str {
        match self.l4.kind() {
            "mooncake" => "tablespace+mooncake",
            _ => "tablespace+lmcache",
        }
    }

    fn class_of(&self, hash: u128, now: u64) -> Option<Retention> {
        self.l3
            .class_of(hash, now)
            .or_else(|| self.l4.class_of(hash, now))
    }

    fn is_current(&self, hash: u128, generation: u64) -> bool {
        if generation & FROM_L4 != 0 {
            self.l4.is_current(hash, generation & !FROM_L4)
        } else {
            self.l3.is_current(hash, generation)
        }
    }

    fn durable_writes(&self) -> bool {
        self.l3.durable_writes()
    }

    async fn write_permits(&self, sizes: &[u64]) -> Vec<WritePermit> {
        self.l3.write_permits(sizes).await
    }

    fn try_write_permit(&self, bytes: u64) -> Option<WritePermit> {
        self.l3.try_write_permit(bytes)
    }

    fn put(
        &self,
        block: LongBlock,
        permit: WritePermit,
        now: u64,
        spill: bool,
    ) -> Result<Put, LongRejected> {
        let _stripe = self.stripe(block.hash);
        let l4 = self
            .l4
            .put(block.clone(), WritePermit::unbounded(), now, spill);
        if let Err(rejected) = l4 {
            tracing::debug!(%rejected, "kvd L4 refused a block");
        }
        self.l3.put(block, permit, now, spill)
    }

    fn remove(&self, hash: u128) {
        let _stripe = self.stripe(hash);
        self.l4.remove(hash);
        self.l3.remove(hash);
    }

    fn remove_key(&self, ns: &Namespace, key: &[u8], hash: u128) {
        let _stripe = self.stripe(hash);
        self.l4.remove_key(ns, key, hash);
        self.l3.remove(hash);
    }

    fn record_inventory(&self, inventory: &Inventory) {
        self.l3.record_inventory(inventory);
        self.l4.record_inventory(inventory);
    }

    async fn get(&self, ns: &Namespace, key: &[u8], hash: u128, now: u64) -> Option<LongHit> {
        let reqs = [(Bytes::copy_from_slice(key), hash)];
        self.get_many(ns, &reqs, now).await.pop().flatten()
    }

    async fn get_many(
        &self,
        ns: &Namespace,
        reqs: &[(Bytes, u128)],
        now: u64,
    ) -> Vec<Option<LongHit>> {
        let mut out = self.l3.get_many(ns, reqs, now).await;
        let misses: Vec<usize> = (0..reqs.len()).filter(|i| out[*i].is_none()).collect();
        if misses.is_empty() {
            return out;
        }
        let ask: Vec<(Bytes, u128)> = misses.iter().map(|i| reqs[*i].clone()).collect();
        let hits = self.l4.get_many(ns, &ask, now).await;
        for ((i, (key, hash)), hit) in misses.into_iter().zip(&ask).zip(hits) {
            out[i] = hit.map(|mut hit| {
                hit.generation = self.promote(ns, key, *hash, &hit, now);
                hit
            });
        }
        out
    }

    async fn held(&self, ns: &Namespace, reqs: &[(Bytes, u128)], now: u64) -> Vec<bool> {
        let mut out = self.l3.held(ns, reqs, now).await;
        let misses: Vec<usize> = (0..reqs.len()).filter(|i| !out[*i]).collect();
        if misses.is_empty() {
            return out;
        }
        let ask: Vec<(Bytes, u128)> = misses.iter().map(|i| reqs[*i].clone()).collect();
        for (i, held) in misses.into_iter().zip(self.l4.held(ns, &ask, now).await) {
            out[i] = held;
        }
        out
    }

    fn clear(&self, ns: &Namespace) -> u64 {
        self.l3.clear(ns) + self.l4.clear(ns)
    }

    fn sweep(&self, now: u64) -> usize {
        self.l3.sweep(now) + self.l4.sweep(now)
    }

    fn stats(&self) -> LongStats {
        LongStats {
            l4: self.l4.l4_stats(),
            ..self.l3.stats()
        }
    }

    async fn flush(&self) -> io::Result<()> {
        if let Err(error) = self.l4.flush().await {
            tracing::debug!(%error, "kvd L4 flush incomplete");
        }
        self.l3.flush().await
    }

    async fn checkpoint(&self) -> io::Result<()> {
        self.l3.checkpoint().await
    }

    async fn close(&self) -> io::Result<()> {
        if let Err(error) = self.l4.close().await {
            tracing::warn!(%error, "kvd L4 did not drain at shutdown");
        }
        self.l3.close().await
    }
}
