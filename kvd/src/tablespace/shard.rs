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

use super::alloc::Allocator;
use super::io::{IoCounters, IoQueue, Job, ReadJob, WriteJob};
use super::journal::Journal;
use super::layout::{BlockParts, Expect, Geometry, PutRecord, Record, verify};
use super::recover::Recovered;
use crate::long::{Durable, LongBlock, LongHit, LongRejected, WritePermit};
use crate::lru::ClassLru;
use crate::proto::Namespace;
use crate::stats::LongStats;
use bytes::Bytes;
use infera_core::event::Retention;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{Semaphore, oneshot};

mod checkpoint;

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
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Updates are short and leave the index consistent at every `?`; a panicking holder
        // cannot make a read return wrong bytes (reads verify blocks), so recover the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

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
        let (job, landing) = {
            let mut st = self.lock();
            st.drop_entry(b.hash, &self.journal);
            if !matches!(b.class, Retention::Short | Retention::Long) {
                return Err(LongRejected::ClassNotStored);
            }
            if b.expires_at.is_some_and(|t| t <= now) {
                return Ok((0, None));
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
            (job, landing)
        };
        let generation = job.generation;
        if let Err(job) = self.queue.push(Job::Write(job))
            && let Job::Write(job) = *job
        {
            self.write_done(job, false);
        }
        Ok((generation, landing))
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
        for h in &doomed {
            st.drop_entry(*h, &self.journal);
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

    /// Removes the entry for `hash` (journaled); its extent is freed now, or when its write
    /// completes.
    fn drop_entry(&mut self, hash: u128, journal: &Journal) -> bool {
        let Some((class, slot)) = self.index.remove(hash) else {
            return false;
        };
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
        true
    }
}

#[cfg(test)]
#[path = "shard_tests.rs"]
mod tests;
