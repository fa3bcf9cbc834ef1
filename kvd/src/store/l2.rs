//! The L2 state: KV blocks in host RAM, bounded by `--max-bytes`, each value either on the heap
//! or in a shared-arena slot.
//!
//! Eviction is [`ClassedLru`] (retention classes `none < ephemeral < short < long`, LRU within a
//! class), keyed by a 128-bit xxh3 hash of the full key `(model, compat_key, key)`. The entry keeps
//! its full key beside the value, and a read compares it: a hash collision reads as a miss, never
//! as another key's bytes.
//!
//! Invariants:
//! - every entry charges `value + key + model + compat_key + metadata + ENTRY_OVERHEAD` bytes,
//!   wherever its value lives, and the sum of charges never exceeds `max_bytes`;
//! - a write that could only fit by evicting a higher class is refused
//!   (`would_displace_higher_priority`) and evicts nothing;
//! - a write of a lower class than the entry already held for the same key is refused
//!   (`retention_downgrade_not_allowed`, upstream's reason) and leaves that entry untouched;
//! - an entry past its TTL is never returned; it is removed on access or by [`L2State::sweep`];
//! - a TTL of zero or less is accepted and stores nothing (upstream's contract);
//! - arena placement never decides what is kept: a slot is only taken after admission by the
//!   rules above, and freeing a slot for a lease moves its entry to the heap ([`L2State::demote`])
//!   instead of dropping it. `residents` orders the arena-resident entries by class and recency
//!   so the demoted one is the lowest-class, least recently used.
//!
//! Time is an argument (milliseconds on the daemon's clock), so the state is deterministic. The
//! owner ([`super::L2Store`] or the tiered [`super::Store`]) wraps it in one `Mutex`, held for
//! O(1) work per key: values are [`Bytes`] (heap) or slot numbers, never copied under it.
//!
//! Inventory: an entry keeps its inventory hash (computed by the writer before the lock, `None`
//! while publishing is off); an admission is noted `stored` (an overwrite too), and an entry
//! that leaves but for a `clear` (evicted, expired, replaced by a colliding key) `removed`, in
//! [`L2State::changes`], which the owner hands to the recorder once per hold of the lock
//! ([`crate::inventory`]).

use super::{REASON_DISPLACE, REASON_DOWNGRADE, REASON_TOO_LARGE};
use crate::arena::Arena;
use crate::inventory::{Change, ChangeKind};
use crate::lru::ClassLru;
use crate::proto::{Namespace, SetAck, SetItem};
use crate::stats::Stats;
use bytes::Bytes;
use infera_core::event::{Retention, Tier};
use infera_core::retention::{ClassedLru, Evicted, Rejected};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// The 128-bit hash of a full key.
pub type KeyHash = u128;

/// Bytes charged per entry on top of its key, namespace, metadata and value: the index node, the
/// map slot and the entry header.
pub const ENTRY_OVERHEAD: u64 = 128;

/// Where an entry's bytes live.
#[derive(Debug, Clone)]
pub(crate) enum Stored {
    Heap(Bytes),
    Arena { slot: u32, version: u32 },
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub ns: Namespace,
    pub key: Bytes,
    pub value: Stored,
    pub len: u64,
    /// Stored for the engine and written to L3, never interpreted.
    pub metadata: Option<Bytes>,
    pub class: Retention,
    pub expires_at: Option<u64>,
    pub charge: u64,
    /// A promoted `short` value the backend still holds: not spilled back when evicted
    /// (written-through values are `long`, which is never spilled).
    pub on_disk: bool,
    /// The inventory hash, while publishing is on.
    pub inventory: Option<u64>,
}

impl Entry {
    fn is(&self, ns: &Namespace, key: &[u8]) -> bool {
        self.key == key && self.ns == *ns
    }

    fn expired(&self, now: u64) -> bool {
        self.expires_at.is_some_and(|t| t <= now)
    }
}

/// A value found in L2.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub value: Stored,
    pub len: u64,
    pub class: Retention,
}

/// A `short` entry L2 evicted that L3 does not hold yet: the tiered store writes it there.
#[derive(Debug, Clone)]
pub(crate) struct Spill {
    pub hash: KeyHash,
    pub ns: Namespace,
    pub key: Bytes,
    pub value: Bytes,
    pub metadata: Option<Bytes>,
    pub class: Retention,
    pub expires_at: Option<u64>,
}

/// What to insert: the value's placement and description.
#[derive(Debug)]
pub(crate) struct Insert<'a> {
    pub ns: &'a Namespace,
    pub key: &'a Bytes,
    pub value: Stored,
    pub len: u64,
    pub metadata: Option<&'a Bytes>,
    pub class: Retention,
    pub lifetime: Lifetime,
    pub on_disk: bool,
    /// Counts as a client write (`sets_total`); promotions from L3 do not.
    pub count: bool,
    /// The inventory hash ([`crate::inventory::Inventory::hash`]).
    pub inventory: Option<u64>,
}

/// How long an inserted entry lives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Lifetime {
    /// A TTL from the request (`None`: no expiry; zero or less: accepted, not stored).
    Ttl(Option<f64>),
    /// An absolute expiry (an entry promoted from L3 keeps its own).
    Until(Option<u64>),
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct L2State {
    lru: ClassedLru<KeyHash>,
    entries: FxHashMap<KeyHash, Entry>,
    residents: ClassLru<()>,
    pub stats: Stats,
    arena: Option<Arc<Arena>>,
    collect_spills: bool,
    pub spills: Vec<Spill>,
    /// L2's changes since the owner last took them (see the module docs).
    pub changes: Vec<Change>,
}

/// The 128-bit hash of a full key; the parts are length-prefixed so no two keys share an input.
pub fn key_hash(ns: &Namespace, key: &[u8]) -> KeyHash {
    let parts = [ns.model.as_bytes(), ns.compat_key.as_bytes(), key];
    let total = 24 + parts.iter().map(|p| p.len()).sum::<usize>();
    let fill = |out: &mut [u8]| {
        let mut at = 0;
        for part in parts {
            out[at..at + 8].copy_from_slice(&(part.len() as u64).to_le_bytes());
            out[at + 8..at + 8 + part.len()].copy_from_slice(part);
            at += 8 + part.len();
        }
    };
    // Keys are block hashes and namespaces short names: hash them from the stack.
    let mut stack = [0u8; 256];
    if total <= stack.len() {
        fill(&mut stack[..total]);
        twox_hash::XxHash3_128::oneshot(&stack[..total])
    } else {
        let mut heap = vec![0u8; total];
        fill(&mut heap);
        twox_hash::XxHash3_128::oneshot(&heap)
    }
}

/// What an item charges against the budget.
pub fn charge(ns: &Namespace, item: &SetItem) -> u64 {
    charge_of(
        ns,
        &item.key,
        item.value.len() as u64,
        item.metadata.as_ref(),
    )
}

fn charge_of(ns: &Namespace, key: &[u8], len: u64, metadata: Option<&Bytes>) -> u64 {
    len + (key.len() + ns.model.len() + ns.compat_key.len() + metadata.map_or(0, Bytes::len)) as u64
        + ENTRY_OVERHEAD
}

/// When a TTL ends, or `Err(())` for a TTL of zero or less (accepted, not stored).
pub(crate) fn expiry(ttl_seconds: Option<f64>, now: u64) -> Result<Option<u64>, ()> {
    match ttl_seconds {
        Some(ttl) if ttl <= 0.0 => Err(()),
        Some(ttl) => Ok(Some(
            now.saturating_add(((ttl * 1000.0).ceil() as u64).max(1)),
        )),
        None => Ok(None),
    }
}

impl L2State {
    pub fn new(max_bytes: u64, arena: Option<Arc<Arena>>, collect_spills: bool) -> Self {
        Self {
            lru: ClassedLru::new(max_bytes),
            entries: FxHashMap::default(),
            residents: ClassLru::new(),
            stats: Stats {
                max_bytes,
                ..Stats::default()
            },
            arena,
            collect_spills,
            spills: Vec::new(),
            changes: Vec::new(),
        }
    }

    #[inline]
    fn note(&mut self, kind: ChangeKind, inventory: Option<u64>) {
        if let Some(hash) = inventory {
            self.changes.push(Change {
                tier: Tier::Host,
                kind,
                hash,
            });
        }
    }

    fn add(&mut self, hash: KeyHash, entry: Entry) {
        self.stats.entries += 1;
        self.stats.host_bytes += entry.len;
        self.stats.class_entries[entry.class as usize] += 1;
        if matches!(entry.value, Stored::Arena { .. }) {
            self.residents.insert(hash, entry.class, ());
        }
        self.note(ChangeKind::Stored, entry.inventory);
        self.entries.insert(hash, entry);
    }

    /// Takes the entry out of the map and the counters (the caller removed it from the LRU,
    /// and notes the removal when there is one to note); its arena slot, if any, is still held.
    fn take(&mut self, hash: KeyHash) -> Option<Entry> {
        let entry = self.entries.remove(&hash)?;
        self.stats.entries -= 1;
        self.stats.host_bytes -= entry.len;
        self.stats.class_entries[entry.class as usize] -= 1;
        self.residents.remove(hash);
        Some(entry)
    }

    /// Lets go of a taken entry's bytes.
    fn discard(&self, entry: Entry) {
        if let (Stored::Arena { slot, .. }, Some(arena)) = (&entry.value, &self.arena) {
            arena.release(*slot);
        }
    }

    /// Lets go of a taken entry that left L2, noting its removal.
    #[inline]
    fn drop_entry(&mut self, entry: Entry) {
        self.note(ChangeKind::Removed, entry.inventory);
        self.discard(entry);
    }

    fn remove(&mut self, hash: KeyHash) -> bool {
        self.lru.remove(&hash);
        match self.take(hash) {
            Some(entry) => {
                self.drop_entry(entry);
                true
            }
            None => false,
        }
    }

    /// The bytes of a stored value as [`Bytes`] (an arena value is pinned, not copied).
    pub fn bytes_of(&self, value: &Stored, len: u64) -> Option<Bytes> {
        match (value, &self.arena) {
            (Stored::Heap(b), _) => Some(b.clone()),
            (Stored::Arena { slot, .. }, Some(arena)) => arena.pin(*slot, len),
            (Stored::Arena { .. }, None) => None,
        }
    }

    fn evicted(&mut self, evicted: Vec<Evicted<KeyHash>>, now: u64) {
        for e in evicted {
            let Some(entry) = self.take(e.key) else {
                continue;
            };
            self.stats.evictions_total += 1;
            if self.collect_spills
                && entry.class == Retention::Short
                && !entry.on_disk
                && !entry.expired(now)
                && let Some(value) = self.bytes_of(&entry.value, entry.len)
            {
                self.spills.push(Spill {
                    hash: e.key,
                    ns: entry.ns.clone(),
                    key: entry.key.clone(),
                    value,
                    metadata: entry.metadata.clone(),
                    class: entry.class,
                    expires_at: entry.expires_at,
                });
            }
            self.drop_entry(entry);
        }
    }

    /// Looks up one key; a hit becomes most recently used.
    pub fn lookup(&mut self, hash: KeyHash, ns: &Namespace, key: &[u8], now: u64) -> Option<Found> {
        let entry = self.entries.get(&hash)?;
        if entry.expired(now) {
            self.remove(hash);
            self.stats.expired_total += 1;
            return None;
        }
        if !entry.is(ns, key) {
            return None;
        }
        let found = Found {
            value: entry.value.clone(),
            len: entry.len,
            class: entry.class,
        };
        self.lru.get(&hash, now);
        self.residents.touch(hash);
        Some(found)
    }

    /// Whether the key is held and live; recency unchanged.
    pub fn contains(&self, hash: KeyHash, ns: &Namespace, key: &[u8], now: u64) -> bool {
        self.entries
            .get(&hash)
            .is_some_and(|e| !e.expired(now) && e.is(ns, key))
    }

    /// The class of the live entry for the key.
    pub fn class_of(
        &self,
        hash: KeyHash,
        ns: &Namespace,
        key: &[u8],
        now: u64,
    ) -> Option<Retention> {
        self.entries
            .get(&hash)
            .filter(|e| !e.expired(now) && e.is(ns, key))
            .map(|e| e.class)
    }

    /// Writes a heap item; see the module docs for when it is refused.
    pub fn set(&mut self, ns: &Namespace, item: &SetItem, now: u64) -> SetAck {
        self.insert(
            Insert {
                ns,
                key: &item.key,
                value: Stored::Heap(item.value.clone()),
                len: item.value.len() as u64,
                metadata: item.metadata.as_ref(),
                class: item.retention,
                lifetime: Lifetime::Ttl(item.ttl_seconds),
                on_disk: false,
                count: true,
                // L2 alone ([`super::L2Store`]) publishes nothing.
                inventory: None,
            },
            now,
        )
    }

    /// Writes a placed value; a refused arena value's slot is released.
    pub fn insert(&mut self, ins: Insert<'_>, now: u64) -> SetAck {
        let arena_slot = match ins.value {
            Stored::Arena { slot, .. } => Some(slot),
            Stored::Heap(_) => None,
        };
        let ack = self.admit(ins, now);
        if !ack.accepted
            && let (Some(slot), Some(arena)) = (arena_slot, &self.arena)
        {
            arena.release(slot);
        }
        ack
    }

    fn admit(&mut self, ins: Insert<'_>, now: u64) -> SetAck {
        if ins.count {
            self.stats.sets_total += 1;
        }
        let expires_at = match ins.lifetime {
            Lifetime::Ttl(ttl) => match expiry(ttl, now) {
                Ok(at) => at,
                Err(()) => return SetAck::accepted(),
            },
            Lifetime::Until(at) if at.is_some_and(|t| t <= now) => return SetAck::accepted(),
            Lifetime::Until(at) => at,
        };
        let (ns, key) = (ins.ns, ins.key);
        let hash = key_hash(ns, key);
        if let Some(old) = self.entries.get(&hash) {
            if old.expired(now) {
                self.remove(hash);
                self.stats.expired_total += 1;
            } else if !old.is(ns, key) {
                // A 128-bit collision: the newcomer replaces the other key unless it is lower.
                if old.class > ins.class {
                    return self.reject(REASON_DISPLACE);
                }
                self.remove(hash);
                self.stats.evictions_total += 1;
            } else if ins.class < old.class {
                return self.reject(REASON_DOWNGRADE);
            }
        }
        let charge = charge_of(ns, key, ins.len, ins.metadata);
        match self.lru.insert(hash, charge, ins.class, expires_at) {
            Ok(evicted) => {
                self.evicted(evicted, now);
                if let Some(old) = self.take(hash) {
                    self.discard(old);
                }
                self.add(
                    hash,
                    Entry {
                        ns: ns.clone(),
                        key: key.clone(),
                        value: ins.value,
                        len: ins.len,
                        metadata: ins.metadata.cloned(),
                        class: ins.class,
                        expires_at,
                        charge,
                        on_disk: ins.on_disk,
                        inventory: ins.inventory,
                    },
                );
                SetAck::accepted()
            }
            Err(Rejected::WouldDisplaceHigherPriority) => self.reject(REASON_DISPLACE),
            Err(Rejected::TooLarge) => self.reject(REASON_TOO_LARGE),
        }
    }

    fn reject(&mut self, reason: &str) -> SetAck {
        self.stats.rejected_total += 1;
        SetAck::rejected(reason)
    }

    /// Moves the lowest-class, least recently used arena-resident entry to the heap, freeing
    /// its slot. Returns false when no entry lives in the arena.
    pub fn demote(&mut self) -> bool {
        let Some(arena) = self.arena.clone() else {
            return false;
        };
        let Some(victim) = self.residents.lowest(Retention::Long) else {
            return false;
        };
        self.residents.remove(victim);
        let Some(entry) = self.entries.get_mut(&victim) else {
            return false;
        };
        if let Stored::Arena { slot, .. } = entry.value {
            entry.value = Stored::Heap(arena.copy_out(slot, entry.len));
            arena.release(slot);
            arena.note_demotion();
        }
        true
    }

    /// Drops the namespace's entries, or every entry when both parts of `ns` are empty.
    /// Returns how many were dropped.
    pub fn clear(&mut self, ns: &Namespace) -> u64 {
        let all = ns.model.is_empty() && ns.compat_key.is_empty();
        let doomed: Vec<KeyHash> = self
            .entries
            .iter()
            .filter(|(_, e)| all || e.ns == *ns)
            .map(|(h, _)| *h)
            .collect();
        // No removal each: the owner notes the clear as one (`Inventory::cleared`).
        for hash in &doomed {
            self.lru.remove(hash);
            if let Some(entry) = self.take(*hash) {
                self.discard(entry);
            }
        }
        doomed.len() as u64
    }

    /// Removes every entry expired at `now` (the sweeper). Returns how many.
    pub fn sweep(&mut self, now: u64) -> usize {
        let expired = self.lru.expire(now);
        let n = expired.len();
        for e in expired {
            if let Some(entry) = self.take(e.key) {
                self.drop_entry(entry);
            }
        }
        self.stats.expired_total += n as u64;
        n
    }

    /// The L2 counters with the budget gauges filled in.
    pub fn snapshot(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.accounted_bytes = self.lru.used();
        for class in Retention::ALL {
            stats.class_bytes[class as usize] = self.lru.used_by(class);
        }
        stats
    }

    /// Debug check: the bookkeeping agrees with the eviction index.
    pub fn check_consistency(&self) -> Result<(), String> {
        let charged: u64 = self.entries.values().map(|e| e.charge).sum();
        if charged != self.lru.used() {
            return Err(format!(
                "entries charge {charged}, index holds {}",
                self.lru.used()
            ));
        }
        if self.entries.len() != self.lru.len() {
            return Err(format!(
                "{} entries, {} indexed",
                self.entries.len(),
                self.lru.len()
            ));
        }
        if self.lru.used() > self.lru.capacity() {
            return Err("over budget".to_owned());
        }
        let resident = self
            .entries
            .values()
            .filter(|e| matches!(e.value, Stored::Arena { .. }))
            .count();
        if resident != self.residents.len() {
            return Err(format!(
                "{resident} arena entries, {} tracked",
                self.residents.len()
            ));
        }
        for class in Retention::ALL {
            let held: u64 = self
                .entries
                .values()
                .filter(|e| e.class == class)
                .map(|e| e.charge)
                .sum();
            if held != self.lru.used_by(class) {
                return Err(format!("class {} disagrees", class.as_str()));
            }
        }
        Ok(())
    }
}
