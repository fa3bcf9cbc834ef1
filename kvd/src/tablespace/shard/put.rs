//! [`Shard::put`]: recording a block in the index (making room lowest class first) and queuing
//! its write; and the inventory's view of it (the block noted `stored` on disk, the entries it
//! replaces or evicts `removed`).

use super::{Landing, Shard, Slot, State};
use crate::long::{LongBlock, LongRejected, WritePermit};
use crate::tablespace::io::{Job, WriteJob};
use crate::tablespace::layout::{BlockParts, PutRecord, Record};
use infera_core::event::{Retention, Tier};
use tokio::sync::oneshot;

/// A recorded put: its write to queue, and what a durable put waits for.
type Queued = (WriteJob, Option<Landing>);

impl Shard {
    /// Records a block and queues its write (see [`crate::long::LongStore::put`]); with
    /// `durable`, also what [`Shard::durable`] waits for.
    pub fn put(
        &self,
        b: LongBlock,
        permit: WritePermit,
        now: u64,
        spill: bool,
        durable: bool,
    ) -> Result<(u64, Option<Landing>), LongRejected> {
        let inventory = self.inventory.get().and_then(|inv| inv.hash(&b.ns, &b.key));
        let (job, landing) = {
            let mut st = self.lock();
            let replaced = st.unlink(b.hash, &self.journal);
            let admitted = self.admit(&mut st, b, permit, now, spill, durable, inventory);
            // A key written again stays on disk: no removal, one more `stored`.
            let kept = matches!(admitted, Ok(Some(_)));
            if let Some(old) = replaced
                && !(kept && old == inventory)
            {
                st.inventory.removed(Tier::Disk, old);
            }
            match admitted? {
                Some(queued) => queued,
                // Accepted and not stored: already expired.
                None => return Ok((0, None)),
            }
        };
        let generation = job.generation;
        if let Err(job) = self.queue.push(Job::Write(job))
            && let Job::Write(job) = *job
        {
            self.write_done(job, false);
        }
        Ok((generation, landing))
    }

    /// Records `b` in the index under the shard lock (the key's older entry already unlinked);
    /// `None` for a block already expired (accepted, not stored).
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        st: &mut State,
        b: LongBlock,
        permit: WritePermit,
        now: u64,
        spill: bool,
        durable: bool,
        inventory: Option<u64>,
    ) -> Result<Option<Queued>, LongRejected> {
        if !matches!(b.class, Retention::Short | Retention::Long) {
            return Err(LongRejected::ClassNotStored);
        }
        if b.expires_at.is_some_and(|t| t <= now) {
            return Ok(None);
        }
        let meta = b.metadata.as_deref().unwrap_or_default();
        let parts = BlockParts {
            generation: 0,
            hash: b.hash,
            class: b.class,
            ns: &b.ns,
            key: &b.key,
            metadata: meta,
            value: &b.value,
        };
        let units = parts.units();
        if !parts.fits_header() || units > self.geometry.container_units() {
            st.counters.rejected += 1;
            return Err(LongRejected::TooLarge);
        }
        let reclaimable: u64 = (0..=b.class as usize).map(|c| st.class_units[c]).sum();
        if st.alloc.free_units() + reclaimable < u64::from(units) {
            st.counters.rejected += 1;
            return Err(LongRejected::WouldDisplace);
        }
        let (container, start) = loop {
            if let Some(extent) = st.alloc.alloc(units, b.hash as u64) {
                break extent;
            }
            // The least recently used entry of the lowest class, skipping those whose
            // write is in flight (their units would only come back later).
            let victim = st
                .index
                .iter()
                .take_while(|(_, c, _)| *c <= b.class)
                .find(|(_, _, s)| !s.writing)
                .map(|(h, _, _)| h);
            let Some(victim) = victim else {
                st.counters.rejected += 1;
                return Err(LongRejected::WouldDisplace);
            };
            st.drop_entry(victim, &self.journal);
            st.counters.evictions += 1;
        };
        let generation = st.next_generation;
        st.next_generation += 1;
        let ns = st.intern(&b.ns, &self.journal);
        let value_len = b.value.len() as u32;
        let slot = Slot {
            generation,
            ns,
            container,
            start,
            units,
            value_len,
            expires_at: b.expires_at,
            pending: Some(b.value.clone()),
            writing: true,
            inventory,
        };
        self.journal.append(&Record::Put(PutRecord {
            generation,
            hash: b.hash,
            ns,
            class: b.class,
            expires_at: b.expires_at,
            container,
            start,
            units,
            value_len,
        }));
        st.account(b.class, units, value_len, true);
        if let Some(t) = b.expires_at {
            st.expiry.insert((t, b.hash));
        }
        st.index.insert(b.hash, b.class, slot);
        st.inventory.stored(Tier::Disk, inventory);
        if spill {
            st.counters.spills += 1;
        }
        let (landed, landing) = if durable {
            let (tx, rx) = oneshot::channel();
            let landing = Landing {
                written: rx,
                journal_at: self.journal.appended(),
            };
            (Some(tx), Some(landing))
        } else {
            (None, None)
        };
        let job = WriteJob {
            generation,
            hash: b.hash,
            class: b.class,
            container,
            start,
            units,
            ns: b.ns,
            key: b.key,
            metadata: b.metadata,
            value: b.value,
            _permit: permit,
            landed,
        };
        Ok(Some((job, landing)))
    }
}
