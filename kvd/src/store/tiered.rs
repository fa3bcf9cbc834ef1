//! [`Store`]: the daemon's tiered store — L2 in RAM (heap or shared arena) in front of an
//! optional long-term backend.
//!
//! Flow (upstream's, made crash-safe):
//! - `set` of `long`: L2, and written through to the backend; `short`: L2 only, written to the
//!   backend when L2 evicts it (a spill); `ephemeral` and `none`: L2 only, never on disk.
//! - An accepted write of a key also replaces (long) or removes (other classes) the backend's
//!   copy, under the L2 lock, so the backend never keeps an older value than L2: a get returns
//!   the last accepted value or nothing, whichever tier answers.
//! - The classes are one ladder across tiers: a write lower than the class the backend holds
//!   for the key is refused like one lower than L2's (`retention_downgrade_not_allowed`).
//! - With a durable backend (`--durable-long-writes`), a `long` write is acknowledged only
//!   once the backend's [`crate::long::Durable`] resolved (awaited after the L2 lock is
//!   released); one the backend refused or could not make durable is answered `not_durable`.
//! - `get`: L2, then the backend (one batched read for a batch's misses); a backend hit is promoted into L2 (into the arena when a slot
//!   is free) unless the key changed meanwhile (its generation moved on, or L2 got a new value).
//! - Arena: an inline `set` is copied into a free slot when one exists (else kept on the heap);
//!   `set_reserve` demotes the lowest-class LRU resident to the heap when every slot is taken,
//!   so placement never decides what is kept — the L2 budget and classes do.
//!
//! - Inventory ([`Store::with_inventory`]): every tier notes what it gains and loses
//!   ([`crate::inventory`]); a write's inventory hash is computed before the L2 lock, and a
//!   `clear` is noted as one, under it, once every tier dropped the namespace.
//!
//! Lock order: L2 → backend shard → journal; the arena's own lock is taken inside any of them,
//! and the inventory recorder's (a leaf) inside any.
//! Waiting (backend write permits, reads) happens outside the L2 lock.

use super::l2::{Found, Insert, L2State, Lifetime, Stored, expiry, key_hash};
use super::{REASON_DOWNGRADE, REASON_NOT_DURABLE, SetAck};
use crate::arena::Arena;
use crate::inventory::{Inventory, Served};
use crate::long::{Durable, LongBlock, LongHit, LongStore, WritePermit};
use crate::proto::{Namespace, SetItem, SharedSlot};
use crate::stats::Stats;
use bytes::Bytes;
use infera_core::event::{Retention, Tier};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

mod reserve;

/// A value found in some tier.
#[derive(Debug, Clone)]
pub enum Got {
    /// Arena-resident, for a client that mapped the arena; with the pinned bytes when the
    /// caller may still have to answer inline (a batch that mixes placements).
    Shared(SharedSlot, Option<Bytes>),
    /// The bytes (pinned arena bytes, heap bytes or a block read from disk).
    Bytes(Bytes, Retention),
}

/// A granted `set_reserve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub lease_token: u64,
    pub slot_id: u32,
    pub payload_offset: u64,
    pub payload_max_size: u64,
}

/// One write to admit.
struct Write<'a> {
    ns: &'a Namespace,
    key: &'a Bytes,
    value: Stored,
    len: u64,
    metadata: Option<&'a Bytes>,
    class: Retention,
    expires_at: Option<u64>,
    permit: Option<WritePermit>,
    /// The inventory hash ([`Inventory::hash`]).
    inventory: Option<u64>,
}

/// The L2 lock; released, it hands the changes L2 noted under it to the inventory, in one
/// append (before the lock itself is released, so the tier's changes keep their order).
struct L2Guard<'a> {
    state: MutexGuard<'a, L2State>,
    inventory: &'a Inventory,
}

impl Deref for L2Guard<'_> {
    type Target = L2State;

    fn deref(&self) -> &L2State {
        &self.state
    }
}

impl DerefMut for L2Guard<'_> {
    fn deref_mut(&mut self) -> &mut L2State {
        &mut self.state
    }
}

impl Drop for L2Guard<'_> {
    fn drop(&mut self) {
        if !self.state.changes.is_empty() {
            self.inventory.append(&mut self.state.changes);
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Store {
    l2: Mutex<L2State>,
    arena: Option<Arc<Arena>>,
    long: Option<Arc<dyn LongStore>>,
    /// Whether `long` makes writers wait for permits ([`LongStore::permits_wait`], asked once:
    /// a SET that calls into the backend only to learn it has nothing to wait for pays for
    /// it at p99).
    waits: bool,
    hints: AtomicU64,
    promoted: AtomicU64,
    dropped: AtomicU64,
    inventory: Inventory,
}

impl Store {
    /// A store of `max_bytes` of L2, with an optional arena and backend.
    pub fn new(
        max_bytes: u64,
        arena: Option<Arc<Arena>>,
        long: Option<Arc<dyn LongStore>>,
    ) -> Self {
        let spills = long.is_some();
        Self {
            waits: long.as_ref().is_some_and(|long| long.permits_wait()),
            l2: Mutex::new(L2State::new(max_bytes, arena.clone(), spills)),
            arena,
            long,
            hints: AtomicU64::new(0),
            promoted: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            inventory: Inventory::off(),
        }
    }

    /// The store noting every tier's changes in `inventory` (L2 here, the backend's through
    /// [`LongStore::record_inventory`]); before it serves.
    pub fn with_inventory(mut self, inventory: Inventory) -> Self {
        if let Some(long) = &self.long {
            long.record_inventory(&inventory);
        }
        self.inventory = inventory;
        self
    }

    fn lock(&self) -> L2Guard<'_> {
        L2Guard {
            // See `L2Store::lock`: reads compare full keys, so a poisoned lock is safe to reuse.
            state: self.l2.lock().unwrap_or_else(|p| p.into_inner()),
            inventory: &self.inventory,
        }
    }

    /// The shared arena, if any.
    pub fn arena(&self) -> Option<&Arc<Arena>> {
        self.arena.as_ref()
    }

    /// The long-term backend, if any.
    pub fn long(&self) -> Option<&Arc<dyn LongStore>> {
        self.long.as_ref()
    }

    /// Copies `value` into a free arena slot, or keeps it on the heap.
    fn place(&self, value: &Bytes) -> Stored {
        if let Some(arena) = &self.arena
            && let Ok(slot) = arena.take(value.len() as u64)
        {
            arena.write(slot, value);
            let version = arena.publish(slot, value.len() as u64);
            return Stored::Arena { slot, version };
        }
        Stored::Heap(value.clone())
    }

    fn unplace(&self, value: &Stored) {
        if let (Stored::Arena { slot, .. }, Some(arena)) = (value, &self.arena) {
            arena.release(*slot);
        }
    }

    /// Writes one item.
    pub async fn set(&self, ns: &Namespace, item: &SetItem, now: u64) -> SetAck {
        self.set_many(ns, std::slice::from_ref(item), now)
            .await
            .pop()
            .unwrap_or_else(SetAck::accepted)
    }

    /// Writes items in order (one ack each); see the module docs.
    ///
    /// Written through in rounds: each takes the backend's write permits for a bounded prefix
    /// of the remaining `long` items at once, admits that prefix under the L2 lock, and moves
    /// on, so a batch never waits for permits while holding others (no hold-and-wait).
    pub async fn set_many(&self, ns: &Namespace, items: &[SetItem], now: u64) -> Vec<SetAck> {
        let through = |item: &SetItem| {
            self.long.is_some()
                && item.retention == Retention::Long
                && expiry(item.ttl_seconds, now).is_ok()
        };
        // A backend that never makes a writer wait hands out no permits.
        let permitted = |item: &SetItem| self.waits && through(item);
        let mut acks = Vec::with_capacity(items.len());
        let mut durable = Vec::new();
        let mut rest = items;
        while !rest.is_empty() {
            let sizes: Vec<u64> = rest
                .iter()
                .filter(|item| permitted(item))
                .map(|item| item.value.len() as u64)
                .collect();
            let mut permits = match &self.long {
                Some(long) if !sizes.is_empty() => long.write_permits(&sizes).await,
                _ => Vec::new(),
            }
            .into_iter();
            // The round ends before the first write-through item without a permit.
            let mut granted = permits.len();
            let round = rest
                .iter()
                .position(|item| {
                    if !permitted(item) {
                        return false;
                    }
                    if granted == 0 {
                        return true;
                    }
                    granted -= 1;
                    false
                })
                .unwrap_or(rest.len());
            let (now_items, later) = rest.split_at(round);
            rest = later;
            let placed: Vec<Option<(Stored, Option<u64>)>> = now_items
                .iter()
                .map(|item| {
                    expiry(item.ttl_seconds, now)
                        .ok()
                        .map(|_| (self.place(&item.value), self.inventory.hash(ns, &item.key)))
                })
                .collect();
            let mut st = self.lock();
            for (item, placed) in now_items.iter().zip(placed) {
                let Some((value, inventory)) = placed else {
                    st.stats.sets_total += 1;
                    acks.push(SetAck::accepted());
                    continue;
                };
                let permit = if permitted(item) {
                    permits.next()
                } else {
                    None
                };
                let (ack, landing) = self.admit(
                    &mut st,
                    Write {
                        ns,
                        key: &item.key,
                        value,
                        len: item.value.len() as u64,
                        metadata: item.metadata.as_ref(),
                        class: item.retention,
                        expires_at: expiry(item.ttl_seconds, now).ok().flatten(),
                        permit,
                        inventory,
                    },
                    now,
                );
                if let Some(landing) = landing {
                    durable.push((acks.len(), landing));
                }
                acks.push(ack);
            }
            self.drain_spills(&mut st, now);
        }
        self.land(&mut acks, durable).await;
        acks
    }

    /// Waits for the durable puts of acknowledged writes; one that failed turns its ack into
    /// a refusal (`REASON_NOT_DURABLE`).
    async fn land(&self, acks: &mut [SetAck], durable: Vec<(usize, Durable)>) {
        if durable.is_empty() {
            return;
        }
        let (at, waits): (Vec<usize>, Vec<Durable>) = durable.into_iter().unzip();
        for (i, result) in at.into_iter().zip(futures::future::join_all(waits).await) {
            if let Err(error) = result {
                tracing::warn!(%error, "kvd refused a durable long write");
                acks[i] = SetAck::rejected(REASON_NOT_DURABLE);
            }
        }
    }

    /// Admits one write; with a durable backend, also what to await before acknowledging it.
    fn admit(&self, st: &mut L2State, w: Write<'_>, now: u64) -> (SetAck, Option<Durable>) {
        let hash = key_hash(w.ns, w.key);
        // (`long` is the highest class: nothing outranks a `long` write.)
        if let Some(long) = &self.long
            && w.class < Retention::Long
            && st.class_of(hash, w.ns, w.key, now).is_none()
            && long.class_of(hash, now).is_some_and(|c| w.class < c)
        {
            st.stats.sets_total += 1;
            st.stats.rejected_total += 1;
            self.unplace(&w.value);
            return (SetAck::rejected(REASON_DOWNGRADE), None);
        }
        let ack = st.insert(
            Insert {
                ns: w.ns,
                key: w.key,
                value: w.value.clone(),
                len: w.len,
                metadata: w.metadata,
                class: w.class,
                lifetime: Lifetime::Until(w.expires_at),
                on_disk: false,
                count: true,
                inventory: w.inventory,
            },
            now,
        );
        if !ack.accepted {
            return (ack, None);
        }
        let mut durable = None;
        if let Some(long) = &self.long {
            if w.class == Retention::Long {
                let Some(value) = st.bytes_of(&w.value, w.len) else {
                    long.remove_key(w.ns, w.key, hash);
                    return (ack, None);
                };
                let block = LongBlock {
                    hash,
                    ns: w.ns.clone(),
                    key: w.key.clone(),
                    value,
                    metadata: w.metadata.cloned(),
                    class: w.class,
                    expires_at: w.expires_at,
                };
                let permit = w.permit.unwrap_or_else(WritePermit::unbounded);
                match long.put(block, permit, now, false) {
                    Ok(put) => durable = put.durable,
                    // Held in RAM only: not what a durable acknowledgement promises.
                    Err(rejected) if long.durable_writes() => {
                        tracing::debug!(%rejected, "kvd durable long write refused by L3");
                        return (SetAck::rejected(REASON_NOT_DURABLE), None);
                    }
                    Err(_) => {}
                }
            } else {
                long.remove_key(w.ns, w.key, hash);
            }
        }
        (ack, durable)
    }

    /// Writes L2's evicted `short` blocks to the backend; dropped when its queue is full.
    fn drain_spills(&self, st: &mut L2State, now: u64) {
        let Some(long) = &self.long else {
            st.spills.clear();
            return;
        };
        for s in st.spills.drain(..) {
            let Some(permit) = long.try_write_permit(s.value.len() as u64) else {
                continue;
            };
            let block = LongBlock {
                hash: s.hash,
                ns: s.ns,
                key: s.key,
                value: s.value,
                metadata: s.metadata,
                class: s.class,
                expires_at: s.expires_at,
            };
            let _ = long.put(block, permit, now, true);
        }
    }

    fn got(&self, st: &L2State, found: Found, shared: bool, pin: bool) -> Option<Got> {
        match (&found.value, &self.arena) {
            (Stored::Arena { slot, version }, Some(arena)) if shared => Some(Got::Shared(
                arena.shared_slot(*slot, found.len, *version, found.class),
                if pin {
                    Some(st.bytes_of(&found.value, found.len)?)
                } else {
                    None
                },
            )),
            _ => Some(Got::Bytes(
                st.bytes_of(&found.value, found.len)?,
                found.class,
            )),
        }
    }

    /// Looks up one key in every tier; `shared` asks for arena offsets where possible.
    pub async fn get(&self, ns: &Namespace, key: &Bytes, now: u64, shared: bool) -> Option<Got> {
        self.get_many(ns, std::slice::from_ref(key), now, shared)
            .await
            .pop()
            .flatten()
    }

    /// Looks up keys in order (backend reads run concurrently). Arena hits of a `shared` lookup
    /// carry their pinned bytes too, for a reply that must be inline after all.
    pub async fn get_many(
        &self,
        ns: &Namespace,
        keys: &[Bytes],
        now: u64,
        shared: bool,
    ) -> Vec<Option<Got>> {
        self.get_many_served(ns, keys, now, shared).await.0
    }

    /// [`Store::get_many`], with the bytes each tier served (for the daemon's load meter).
    pub async fn get_many_served(
        &self,
        ns: &Namespace,
        keys: &[Bytes],
        now: u64,
        shared: bool,
    ) -> (Vec<Option<Got>>, Served) {
        let pin = keys.len() > 1;
        let mut out: Vec<Option<Got>> = vec![None; keys.len()];
        let mut served = Served::default();
        let mut misses = Vec::new();
        {
            let mut st = self.lock();
            for (i, key) in keys.iter().enumerate() {
                let hash = key_hash(ns, key);
                match st.lookup(hash, ns, key, now) {
                    Some(found) => {
                        served.add(Tier::Host, found.len);
                        out[i] = self.got(&st, found, shared, pin);
                    }
                    None => misses.push((i, hash)),
                }
            }
            if misses.is_empty() {
                let n = keys.len() as u64;
                st.stats.gets_total += n;
                st.stats.hits_total += n;
                return (out, served);
            }
        }
        if let Some(long) = &self.long
            && !misses.is_empty()
        {
            let reqs: Vec<(Bytes, u128)> = misses
                .iter()
                .map(|(i, hash)| (keys[*i].clone(), *hash))
                .collect();
            let hits = long.get_many(ns, &reqs, now).await;
            for ((i, hash), hit) in misses.into_iter().zip(hits) {
                if let Some(hit) = hit {
                    served.add(hit.tier, hit.value.len() as u64);
                    out[i] = Some(self.promote(ns, &keys[i], hash, hit, now, shared));
                }
            }
        }
        let found = out.iter().filter(|g| g.is_some()).count() as u64;
        let mut st = self.lock();
        st.stats.gets_total += keys.len() as u64;
        st.stats.hits_total += found;
        st.stats.misses_total += keys.len() as u64 - found;
        (out, served)
    }

    /// Puts a backend hit into L2 unless the key changed meanwhile; answers the hit either way.
    fn promote(
        &self,
        ns: &Namespace,
        key: &Bytes,
        hash: u128,
        hit: LongHit,
        now: u64,
        shared: bool,
    ) -> Got {
        let inline = Got::Bytes(hit.value.clone(), hit.class);
        let Some(long) = &self.long else {
            return inline;
        };
        let placed = self.place(&hit.value);
        let inventory = self.inventory.hash(ns, key);
        let mut st = self.lock();
        let fresh = !st.contains(hash, ns, key, now)
            && long.is_current(hash, hit.generation)
            && hit.expires_at.is_none_or(|t| t > now);
        if !fresh {
            self.unplace(&placed);
            return inline;
        }
        let ack = st.insert(
            Insert {
                ns,
                key,
                value: placed.clone(),
                len: hit.value.len() as u64,
                metadata: None,
                class: hit.class,
                lifetime: Lifetime::Until(hit.expires_at),
                on_disk: true,
                count: false,
                inventory,
            },
            now,
        );
        self.drain_spills(&mut st, now);
        match (placed, &self.arena) {
            (Stored::Arena { slot, version }, Some(arena)) if ack.accepted && shared => {
                Got::Shared(
                    arena.shared_slot(slot, hit.value.len() as u64, version, hit.class),
                    Some(hit.value),
                )
            }
            _ => inline,
        }
    }

    /// Whether L2 holds the key (tests of what each tier holds).
    #[cfg(test)]
    pub(crate) fn l2_holds(&self, ns: &Namespace, key: &[u8], now: u64) -> bool {
        self.lock().contains(key_hash(ns, key), ns, key, now)
    }

    /// Whether each key is held in any tier; recency unchanged.
    pub fn exists(&self, ns: &Namespace, keys: &[Bytes], now: u64) -> Vec<bool> {
        let st = self.lock();
        keys.iter()
            .map(|k| {
                let hash = key_hash(ns, k);
                st.contains(hash, ns, k, now)
                    || self
                        .long
                        .as_ref()
                        .is_some_and(|l| l.class_of(hash, now).is_some())
            })
            .collect()
    }

    /// Drops the namespace (everything for the empty one) from every tier; returns entries
    /// dropped, summed over the tiers (a block held by both counts twice).
    pub fn clear(&self, ns: &Namespace) -> u64 {
        let mut st = self.lock();
        let l2 = st.clear(ns);
        let long = self.long.as_ref().map_or(0, |l| l.clear(ns));
        // One `AllBlocksCleared` for any clear: the router forgets every block of this kvd
        // (those of other namespaces too), and learns them again as they are written.
        self.inventory.cleared();
        l2 + long
    }

    /// Removes expired entries from every tier; returns how many.
    pub fn sweep(&self, now: u64) -> usize {
        let l2 = self.lock().sweep(now);
        l2 + self.long.as_ref().map_or(0, |l| l.sweep(now))
    }

    /// Counts a `prefetch_hint` frame, or one dropped unprocessed.
    pub fn note_hint(&self, dropped: bool) {
        self.hints.fetch_add(1, Ordering::Relaxed);
        if dropped {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a hint abandoned at its deadline.
    pub fn note_hint_expired(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Promotes the keys the backend holds and L2 does not (asking a remote backend which it
    /// holds, then reading those in one batch); returns how many it promoted.
    pub async fn prefetch(&self, ns: &Namespace, keys: &[Bytes], now: u64) -> u64 {
        let Some(long) = &self.long else {
            return 0;
        };
        let wanted: Vec<(Bytes, u128)> = {
            let st = self.lock();
            keys.iter()
                .map(|key| (key.clone(), key_hash(ns, key)))
                .filter(|(key, hash)| !st.contains(*hash, ns, key, now))
                .collect()
        };
        if wanted.is_empty() {
            return 0;
        }
        let held = long.held(ns, &wanted, now).await;
        let reqs: Vec<(Bytes, u128)> = wanted
            .into_iter()
            .zip(held)
            .filter_map(|(req, held)| held.then_some(req))
            .collect();
        let mut promoted = 0;
        for ((key, hash), hit) in reqs.iter().zip(long.get_many(ns, &reqs, now).await) {
            if let Some(hit) = hit {
                self.promote(ns, key, *hash, hit, now, false);
                if self.lock().contains(*hash, ns, key, now) {
                    promoted += 1;
                }
            }
        }
        self.promoted.fetch_add(promoted, Ordering::Relaxed);
        promoted
    }

    /// The counters of every tier.
    pub fn stats(&self) -> Stats {
        let mut stats = self.lock().snapshot();
        stats.prefetch_hints_total = self.hints.load(Ordering::Relaxed);
        stats.prefetch_promoted_total = self.promoted.load(Ordering::Relaxed);
        stats.prefetch_dropped_total = self.dropped.load(Ordering::Relaxed);
        if let Some(arena) = &self.arena {
            stats.arena = arena.stats();
        }
        if let Some(long) = &self.long {
            stats.long = long.stats();
        }
        stats
    }

    /// Debug check of the L2 bookkeeping.
    #[doc(hidden)]
    pub fn check_consistency(&self) -> Result<(), String> {
        self.lock().check_consistency()
    }
}
