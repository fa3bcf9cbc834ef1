//! One shard of the tablespace: one directory on one device, with its containers, journal,
//! index and I/O workers.
//!
//! The index maps a key hash to its slot: generation, namespace id, extent, value length,
//! class, expiry, and while its write is in flight the value itself (`pending`, which answers
//! reads meanwhile). Every change to the index appends a journal record under the same lock,
//! so the journal replays to exactly the index's history. An extent whose entry leaves while its
//! write is in flight is freed only when that write completes (`deferred`), so a late write can
//! never land on a new tenant's block.
//!
//! Room is made lowest class first, least recently used first, never by evicting a class above
//! the incoming block's; if the classes at or below it cannot free enough units, the put is
//! refused and nothing is evicted.
//!
//! A checkpoint copies the index a chunk at a time, releasing the lock in between, so it never
//! stalls the data path for longer than one chunk's copy ([`Shard::checkpoint`]).
//!
//! Inventory: a slot keeps its block's inventory hash (`None` for an entry recovered at start,
//! whose key the index does not hold, and while publishing is off); a put is noted `stored`
//! (`put.rs`), and an entry leaving the index, but for a `clear`, `removed`, under the shard
//! lock that orders both.

use super::alloc::Allocator;
use super::io::{IoCounters, IoQueue, Job, ReadJob, WriteJob};
use super::journal::Journal;
use super::layout::{Expect, Geometry, Record, verify};
use super::recover::Recovered;
use crate::inventory::Inventory;
use crate::long::{Durable, LongHit};
use crate::lru::ClassLru;
use crate::proto::Namespace;
use crate::stats::LongStats;
use bytes::Bytes;
use infera_core::event::{Retention, Tier};
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tokio::sync::{Semaphore, oneshot};

mod checkpoint;
mod put;

#[derive(Debug, Clone)]
struct Slot {
    generation: u64,
    ns: u32,
    container: u32,
    start: u32,
    units: u32,
    value_len: u32,
    expires_at: Option<u64>,
    pending: Option<Bytes>,
    writing: bool,
    /// The block's inventory hash (see the module docs).
    inventory: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    spills: u64,
    verify_failures: u64,
    evictions: u64,
    expired: u64,
    rejected: u64,
}

#[derive(Debug)]
struct State {
    index: ClassLru<Slot>,
    alloc: Allocator,
    expiry: BTreeSet<(u64, u128)>,
    ns_ids: FxHashMap<Namespace, u32>,
    ns_names: FxHashMap<u32, Namespace>,
    next_generation: u64,
    deferred: FxHashMap<u64, (u32, u32, u32)>,
    class_units: [u64; 4],
    class_bytes: [u64; 4],
    counters: Counters,
    inventory: Inventory,
}

/// Everything a shard is made of, for [`Shard::new`].
#[derive(Debug)]
pub struct Parts {
    pub id: u32,
    pub dir: PathBuf,
    pub geometry: Geometry,
    pub recovered: Recovered,
    pub journal: Arc<Journal>,
    pub queue: Arc<IoQueue>,
    pub files: Arc<Vec<File>>,
    pub io: Arc<IoCounters>,
    pub read_permits: usize,
    pub direct: bool,
    pub uring: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct Shard {
    pub id: u32,
    dir: PathBuf,
    geometry: Geometry,
    state: Mutex<State>,
    pub journal: Arc<Journal>,
    pub queue: Arc<IoQueue>,
    pub files: Arc<Vec<File>>,
    io: Arc<IoCounters>,
    reads: Arc<Semaphore>,
    direct: bool,
    uring: bool,
    /// Held by the one checkpoint that may run at a time.
    checkpointing: Mutex<()>,
    /// Held by the one durable put that syncs for everyone (group commit).
    committing: tokio::sync::Mutex<()>,
    /// The journal position the last group commit made durable.
    synced_to: AtomicU64,
    /// The inventory puts hash their keys for, before taking the lock (`State` holds the same).
    inventory: OnceLock<Inventory>,
}

/// What a durable put waits for ([`Shard::durable`]).
#[derive(Debug)]
pub struct Landing {
    written: oneshot::Receiver<bool>,
    /// The journal position just past the put's record.
    journal_at: u64,
}

/// Index entries a checkpoint copies per hold of the shard lock.
const CHECKPOINT_CHUNK: usize = 256;

impl Shard {
    /// A shard over a recovered index.
    pub fn new(p: Parts) -> Self {
        let mut st = State {
            index: ClassLru::with_capacity(p.recovered.entries.len()),
            alloc: p.recovered.allocator,
            expiry: BTreeSet::new(),
            ns_ids: FxHashMap::default(),
            ns_names: FxHashMap::default(),
            next_generation: p.recovered.next_generation,
            deferred: FxHashMap::default(),
            class_units: [0; 4],
            class_bytes: [0; 4],
            counters: Counters::default(),
            inventory: Inventory::off(),
        };
        for (id, ns) in p.recovered.namespaces {
            st.ns_ids.insert(ns.clone(), id);
            st.ns_names.insert(id, ns);
        }
        for e in p.recovered.entries {
            st.account(e.class, e.units, e.value_len, true);
            if let Some(t) = e.expires_at {
                st.expiry.insert((t, e.hash));
            }
            st.index.insert(
                e.hash,
                e.class,
                Slot {
                    generation: e.generation,
                    ns: e.ns,
                    container: e.container,
                    start: e.start,
                    units: e.units,
                    value_len: e.value_len,
                    expires_at: e.expires_at,
                    pending: None,
                    writing: false,
                    inventory: None,
                },
            );
        }
        Self {
            id: p.id,
            dir: p.dir,
            geometry: p.geometry,
            state: Mutex::new(st),
            journal: p.journal,
            queue: p.queue,
            files: p.files,
            io: p.io,
            reads: Arc::new(Semaphore::new(p.read_permits)),
            direct: p.direct,
            uring: p.uring,
            checkpointing: Mutex::new(()),
            committing: tokio::sync::Mutex::new(()),
            synced_to: AtomicU64::new(0),
            inventory: OnceLock::new(),
        }
    }

    /// Notes the shard's changes in `inventory` from now on (once; a second call is ignored).
    pub fn set_inventory(&self, inventory: &Inventory) {
        if self.inventory.set(inventory.clone()).is_ok() {
            self.lock().inventory = inventory.clone();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Updates are short and leave the index consistent at every `?`; a panicking holder
        // cannot make a read return wrong bytes (reads verify blocks), so recover the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once the put of `landing` is durable: its block written, then the journal
    /// synced past its record. Group commit: one caller at a time syncs (the containers in
    /// buffered mode, then the journal) everything appended so far; the others wait for it
    /// and find themselves covered, so concurrent writers share one sync.
    pub fn durable(self: Arc<Self>, landing: Landing) -> Durable {
        Box::pin(async move {
            if !landing.written.await.unwrap_or(false) {
                return Err(io::Error::other(format!(
                    "the L3 write in {} failed; the block was not stored",
                    self.dir.display()
                )));
            }
            let _leader = self.committing.lock().await;
            if self.synced_to.load(Ordering::Acquire) >= landing.journal_at {
                return Ok(());
            }
            let target = self.journal.appended();
            let shard = self.clone();
            tokio::task::spawn_blocking(move || shard.sync())
                .await
                .map_err(io::Error::other)??;
            self.synced_to.fetch_max(target, Ordering::AcqRel);
            Ok(())
        })
    }

    /// A worker finished the write of `job`.
    pub fn write_done(&self, mut job: WriteJob, ok: bool) {
        let landed = job.landed.take();
        let mut st = self.lock();
        let current = st
            .index
            .get(job.hash)
            .is_some_and(|(_, s)| s.generation == job.generation);
        if current {
            if let Some(slot) = st.index.get_mut(job.hash) {
                slot.writing = false;
                slot.pending = None;
            }
            if !ok {
                st.drop_entry(job.hash, &self.journal);
            }
        } else if let Some((c, s, u)) = st.deferred.remove(&job.generation) {
            st.alloc.free(c, s, u);
        }
        drop(st);
        if let Some(landed) = landed {
            let _ = landed.send(ok);
        }
    }

    /// Reads and verifies the block of `(ns, key)`.
    pub async fn get(&self, ns: &Namespace, key: &[u8], hash: u128, now: u64) -> Option<LongHit> {
        let (slot, class) = {
            let mut st = self.lock();
            let (class, slot) = st.index.get(hash).map(|(c, s)| (c, s.clone()))?;
            if slot.expires_at.is_some_and(|t| t <= now) {
                st.drop_entry(hash, &self.journal);
                st.counters.expired += 1;
                return None;
            }
            if st.ns_names.get(&slot.ns) != Some(ns) {
                return None;
            }
            st.index.touch(hash);
            if let Some(value) = &slot.pending {
                return Some(LongHit {
                    value: value.clone(),
                    class,
                    expires_at: slot.expires_at,
                    generation: slot.generation,
                    tier: Tier::Disk,
                });
            }
            (slot, class)
        };
        let permit = self.reads.clone().acquire_owned().await.ok()?;
        let (reply, rx) = oneshot::channel();
        let job = Job::Read(ReadJob {
            container: slot.container,
            start: slot.start,
            units: slot.units,
            reply,
            _permit: permit,
        });
        self.queue.push(job).ok()?;
        let buf = rx.await.ok()?.ok()?;
        let want = Expect {
            generation: slot.generation,
            hash,
            value_len: slot.value_len,
            ns,
            key,
        };
        match verify(buf.as_ref(), &want) {
            Ok(range) => Some(LongHit {
                value: Bytes::from_owner(buf).slice(range),
                class,
                expires_at: slot.expires_at,
                generation: slot.generation,
                tier: Tier::Disk,
            }),
            Err(reason) => {
                let mut st = self.lock();
                st.counters.verify_failures += 1;
                let current = st
                    .index
                    .get(hash)
                    .is_some_and(|(_, s)| s.generation == slot.generation);
                if current && reason != "another key under the same hash" {
                    st.drop_entry(hash, &self.journal);
                }
                tracing::debug!(
                    shard = self.id,
                    reason,
                    "L3 block failed its checks; answered as a miss"
                );
                None
            }
        }
    }

    /// The I/O counters its workers bump.
    pub fn io_counters(&self) -> Arc<IoCounters> {
        self.io.clone()
    }

    /// The class of the live entry for `hash`.
    pub fn class_of(&self, hash: u128, now: u64) -> Option<Retention> {
        let st = self.lock();
        let (class, slot) = st.index.get(hash)?;
        slot.expires_at.is_none_or(|t| t > now).then_some(class)
    }

    /// Whether the live entry for `hash` has `generation`.
    pub fn is_current(&self, hash: u128, generation: u64) -> bool {
        self.lock()
            .index
            .get(hash)
            .is_some_and(|(_, s)| s.generation == generation)
    }

    /// Removes the entry for `hash`.
    pub fn remove(&self, hash: u128) -> bool {
        self.lock().drop_entry(hash, &self.journal)
    }

    /// Drops the namespace's entries (all for the empty namespace).
    pub fn clear(&self, ns: &Namespace) -> u64 {
        let mut st = self.lock();
        let all = ns.model.is_empty() && ns.compat_key.is_empty();
        let id = st.ns_ids.get(ns).copied();
        let doomed: Vec<u128> = st
            .index
            .iter()
            .filter(|(_, _, s)| all || Some(s.ns) == id)
            .map(|(h, _, _)| h)
            .collect();
        // No removal each: the store notes the clear as one.
        for h in &doomed {
            st.unlink(*h, &self.journal);
        }
        doomed.len() as u64
    }

    /// Removes entries expired at `now`.
    pub fn sweep(&self, now: u64) -> usize {
        let mut st = self.lock();
        let mut n = 0;
        while let Some(&(t, hash)) = st.expiry.first() {
            if t > now {
                break;
            }
            st.expiry.pop_first();
            let live = st
                .index
                .get(hash)
                .is_some_and(|(_, s)| s.expires_at == Some(t));
            if live {
                st.drop_entry(hash, &self.journal);
                st.counters.expired += 1;
                n += 1;
            }
        }
        n
    }

    /// The shard's counters.
    pub fn stats(&self) -> LongStats {
        let st = self.lock();
        LongStats {
            entries: st.index.len() as u64,
            capacity_bytes: u64::from(self.geometry.containers) * self.geometry.container_bytes,
            short_bytes: st.class_bytes[Retention::Short as usize],
            long_bytes: st.class_bytes[Retention::Long as usize],
            reads_total: self.io.reads.load(Ordering::Relaxed),
            writes_total: self.io.writes.load(Ordering::Relaxed),
            spills_total: st.counters.spills,
            verify_failures_total: st.counters.verify_failures,
            io_errors_total: self.io.errors.load(Ordering::Relaxed),
            journal_syncs_total: self.io.syncs.load(Ordering::Relaxed),
            evictions_total: st.counters.evictions,
            expired_total: st.counters.expired,
            rejected_total: st.counters.rejected,
            direct_io: self.direct,
            io_uring: self.uring,
            l4: Default::default(),
        }
    }
}

impl State {
    fn account(&mut self, class: Retention, units: u32, value_len: u32, add: bool) {
        let c = class as usize;
        if add {
            self.class_units[c] += u64::from(units);
            self.class_bytes[c] += u64::from(value_len);
        } else {
            self.class_units[c] -= u64::from(units);
            self.class_bytes[c] -= u64::from(value_len);
        }
    }

    fn intern(&mut self, ns: &Namespace, journal: &Journal) -> u32 {
        if let Some(id) = self.ns_ids.get(ns) {
            return *id;
        }
        let id = self.ns_names.keys().max().map_or(0, |m| m + 1);
        self.ns_ids.insert(ns.clone(), id);
        self.ns_names.insert(id, ns.clone());
        journal.append(&Record::Namespace { id, ns: ns.clone() });
        id
    }

    /// Removes the entry for `hash` (journaled) and notes its removal; its extent is freed
    /// now, or when its write completes.
    fn drop_entry(&mut self, hash: u128, journal: &Journal) -> bool {
        match self.unlink(hash, journal) {
            Some(inventory) => {
                self.inventory.removed(Tier::Disk, inventory);
                true
            }
            None => false,
        }
    }

    /// [`State::drop_entry`] without noting the removal; the entry's inventory hash, if there
    /// was an entry.
    fn unlink(&mut self, hash: u128, journal: &Journal) -> Option<Option<u64>> {
        let (class, slot) = self.index.remove(hash)?;
        self.account(class, slot.units, slot.value_len, false);
        if let Some(t) = slot.expires_at {
            self.expiry.remove(&(t, hash));
        }
        if slot.writing {
            self.deferred
                .insert(slot.generation, (slot.container, slot.start, slot.units));
        } else {
            self.alloc.free(slot.container, slot.start, slot.units);
        }
        journal.append(&Record::Evict {
            generation: slot.generation,
            hash,
        });
        Some(slot.inventory)
    }
}

#[cfg(test)]
#[path = "shard_tests.rs"]
mod tests;
