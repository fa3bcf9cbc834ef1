//! The L2 store: KV blocks in host RAM, bounded by `--max-bytes`.
//!
//! Eviction is [`ClassedLru`] (retention classes `none < ephemeral < short < long`, LRU within a
//! class), keyed by a 128-bit xxh3 hash of the full key `(model, compat_key, key)`. The entry keeps
//! its full key beside the value, and a read compares it: a hash collision reads as a miss, never
//! as another key's bytes.
//!
//! Invariants:
//! - every entry charges `value + key + model + compat_key + metadata + ENTRY_OVERHEAD` bytes, and
//!   the sum of charges never exceeds `max_bytes`;
//! - a write that could only fit by evicting a higher class is refused
//!   (`would_displace_higher_priority`) and evicts nothing;
//! - a write of a lower class than the entry already held for the same key is refused
//!   (`retention_downgrade_not_allowed`, upstream's reason) and leaves that entry untouched;
//! - an entry past its TTL is never returned; it is removed on access or by [`L2Store::sweep`];
//! - a TTL of zero or less is accepted and stores nothing (upstream's contract).
//!
//! Time is an argument (milliseconds on the daemon's clock), so the store is deterministic and
//! the daemon drives it from tokio's clock (paused in tests). One `Mutex` guards the state; it is
//! held for O(1) work per key (values are [`Bytes`], never copied under it) and never across an
//! `.await`.

use crate::proto::{Namespace, SetAck, SetItem};
use crate::stats::Stats;
use bytes::Bytes;
use infera_core::event::Retention;
use infera_core::retention::{ClassedLru, Evicted, Rejected};
use rustc_hash::FxHashMap;
use std::sync::{Mutex, MutexGuard};

/// Bytes charged per entry on top of its key, namespace, metadata and value: the index node, the
/// map slot and the entry header.
pub const ENTRY_OVERHEAD: u64 = 128;

/// The reason a lower class may not overwrite a higher one for the same key.
pub const REASON_DOWNGRADE: &str = "retention_downgrade_not_allowed";
/// The reason a write cannot make room without evicting a higher class.
pub const REASON_DISPLACE: &str = "would_displace_higher_priority";
/// The reason an entry larger than the whole store is refused.
pub const REASON_TOO_LARGE: &str = "value_larger_than_store";

type KeyHash = u128;

/// A hit: the stored bytes and their class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub value: Bytes,
    pub retention: Retention,
}

#[derive(Debug)]
struct Entry {
    ns: Namespace,
    key: Bytes,
    value: Bytes,
    /// Stored for the engine, never interpreted (part 2 writes it to L3).
    #[allow(dead_code)]
    metadata: Option<Bytes>,
    class: Retention,
    expires_at: Option<u64>,
    charge: u64,
}

impl Entry {
    fn is(&self, ns: &Namespace, key: &[u8]) -> bool {
        self.key == key && self.ns == *ns
    }

    fn expired(&self, now: u64) -> bool {
        self.expires_at.is_some_and(|t| t <= now)
    }
}

#[derive(Debug)]
struct State {
    lru: ClassedLru<KeyHash>,
    entries: FxHashMap<KeyHash, Entry>,
    stats: Stats,
}

impl State {
    fn add(&mut self, hash: KeyHash, entry: Entry) {
        self.stats.entries += 1;
        self.stats.host_bytes += entry.value.len() as u64;
        self.stats.class_entries[entry.class as usize] += 1;
        self.entries.insert(hash, entry);
    }

    /// Forgets the entry's bookkeeping; the caller has removed it from the LRU already.
    fn forget(&mut self, hash: KeyHash) -> Option<Entry> {
        let entry = self.entries.remove(&hash)?;
        self.stats.entries -= 1;
        self.stats.host_bytes -= entry.value.len() as u64;
        self.stats.class_entries[entry.class as usize] -= 1;
        Some(entry)
    }

    fn remove(&mut self, hash: KeyHash) -> Option<Entry> {
        self.lru.remove(&hash);
        self.forget(hash)
    }

    fn evicted(&mut self, evicted: Vec<Evicted<KeyHash>>) {
        for e in evicted {
            if self.forget(e.key).is_some() {
                self.stats.evictions_total += 1;
            }
        }
    }

    fn lookup(&mut self, hash: KeyHash, ns: &Namespace, key: &[u8], now: u64) -> Option<Hit> {
        let entry = self.entries.get(&hash)?;
        if entry.expired(now) {
            self.remove(hash);
            self.stats.expired_total += 1;
            return None;
        }
        if !entry.is(ns, key) {
            return None;
        }
        let hit = Hit {
            value: entry.value.clone(),
            retention: entry.class,
        };
        self.lru.get(&hash, now);
        Some(hit)
    }

    fn set(&mut self, ns: &Namespace, item: &SetItem, now: u64) -> SetAck {
        self.stats.sets_total += 1;
        let expires_at = match item.ttl_seconds {
            Some(ttl) if ttl <= 0.0 => return SetAck::accepted(),
            Some(ttl) => Some(now.saturating_add(((ttl * 1000.0).ceil() as u64).max(1))),
            None => None,
        };
        let hash = key_hash(ns, &item.key);
        if let Some(old) = self.entries.get(&hash) {
            if old.expired(now) {
                self.remove(hash);
                self.stats.expired_total += 1;
            } else if !old.is(ns, &item.key) {
                // A 128-bit collision: the newcomer replaces the other key unless it is lower.
                if old.class > item.retention {
                    return self.reject(REASON_DISPLACE);
                }
                self.remove(hash);
                self.stats.evictions_total += 1;
            } else if item.retention < old.class {
                return self.reject(REASON_DOWNGRADE);
            }
        }
        let charge = charge(ns, item);
        match self.lru.insert(hash, charge, item.retention, expires_at) {
            Ok(evicted) => {
                self.evicted(evicted);
                self.forget(hash);
                self.add(
                    hash,
                    Entry {
                        ns: ns.clone(),
                        key: item.key.clone(),
                        value: item.value.clone(),
                        metadata: item.metadata.clone(),
                        class: item.retention,
                        expires_at,
                        charge,
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
}

/// The 128-bit hash of a full key; the parts are length-prefixed so no two keys share an input.
pub fn key_hash(ns: &Namespace, key: &[u8]) -> u128 {
    let mut buf = Vec::with_capacity(24 + ns.model.len() + ns.compat_key.len() + key.len());
    for part in [ns.model.as_bytes(), ns.compat_key.as_bytes(), key] {
        buf.extend_from_slice(&(part.len() as u64).to_le_bytes());
        buf.extend_from_slice(part);
    }
    xxhash_rust::xxh3::xxh3_128(&buf)
}

/// What an item charges against the budget.
pub fn charge(ns: &Namespace, item: &SetItem) -> u64 {
    (item.value.len()
        + item.key.len()
        + ns.model.len()
        + ns.compat_key.len()
        + item.metadata.as_ref().map_or(0, Bytes::len)) as u64
        + ENTRY_OVERHEAD
}

/// See the module docs.
#[derive(Debug)]
pub struct L2Store {
    state: Mutex<State>,
}

impl L2Store {
    /// An empty store holding at most `max_bytes` charged bytes.
    pub fn new(max_bytes: u64) -> Self {
        Self {
            state: Mutex::new(State {
                lru: ClassedLru::new(max_bytes),
                entries: FxHashMap::default(),
                stats: Stats {
                    max_bytes,
                    ..Stats::default()
                },
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // returns wrong bytes (reads compare the full key), so a poisoned lock is recovered.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks up one key; a hit becomes most recently used.
    pub fn get(&self, ns: &Namespace, key: &[u8], now: u64) -> Option<Hit> {
        self.get_many(ns, std::slice::from_ref(&key), now)
            .pop()
            .flatten()
    }

    /// Looks up keys in order, under one lock.
    pub fn get_many<K: AsRef<[u8]>>(
        &self,
        ns: &Namespace,
        keys: &[K],
        now: u64,
    ) -> Vec<Option<Hit>> {
        let mut state = self.lock();
        let hits: Vec<Option<Hit>> = keys
            .iter()
            .map(|k| {
                let k = k.as_ref();
                state.lookup(key_hash(ns, k), ns, k, now)
            })
            .collect();
        let found = hits.iter().filter(|h| h.is_some()).count() as u64;
        state.stats.gets_total += keys.len() as u64;
        state.stats.hits_total += found;
        state.stats.misses_total += keys.len() as u64 - found;
        hits
    }

    /// Whether each key is held (not expired); does not touch recency.
    pub fn exists<K: AsRef<[u8]>>(&self, ns: &Namespace, keys: &[K], now: u64) -> Vec<bool> {
        let state = self.lock();
        keys.iter()
            .map(|k| {
                let k = k.as_ref();
                state
                    .entries
                    .get(&key_hash(ns, k))
                    .is_some_and(|e| !e.expired(now) && e.is(ns, k))
            })
            .collect()
    }

    /// Writes one item; see the module docs for when it is refused.
    pub fn set(&self, ns: &Namespace, item: &SetItem, now: u64) -> SetAck {
        self.lock().set(ns, item, now)
    }

    /// Writes items in order, under one lock.
    pub fn set_many(&self, ns: &Namespace, items: &[SetItem], now: u64) -> Vec<SetAck> {
        let mut state = self.lock();
        items.iter().map(|item| state.set(ns, item, now)).collect()
    }

    /// Drops the namespace's entries, or every entry when both parts of `ns` are empty.
    /// Returns how many were dropped.
    pub fn clear(&self, ns: &Namespace) -> u64 {
        let mut state = self.lock();
        if ns.model.is_empty() && ns.compat_key.is_empty() {
            let n = state.lru.clear() as u64;
            state.entries.clear();
            let s = &mut state.stats;
            s.entries = 0;
            s.host_bytes = 0;
            s.class_entries = [0; 4];
            return n;
        }
        let doomed: Vec<KeyHash> = state
            .entries
            .iter()
            .filter(|(_, e)| e.ns == *ns)
            .map(|(h, _)| *h)
            .collect();
        for hash in &doomed {
            state.remove(*hash);
        }
        doomed.len() as u64
    }

    /// Removes every entry expired at `now` (the sweeper). Returns how many.
    pub fn sweep(&self, now: u64) -> usize {
        let mut state = self.lock();
        let expired = state.lru.expire(now);
        let n = expired.len();
        for e in expired {
            state.forget(e.key);
        }
        state.stats.expired_total += n as u64;
        n
    }

    /// Counts a `prefetch_hint` frame.
    pub fn note_prefetch_hint(&self) {
        self.lock().stats.prefetch_hints_total += 1;
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let state = self.lock();
        let mut stats = state.stats.clone();
        stats.accounted_bytes = state.lru.used();
        for class in Retention::ALL {
            stats.class_bytes[class as usize] = state.lru.used_by(class);
        }
        stats
    }

    /// The bytes an entry would charge (for callers sizing their writes).
    pub fn charge_of(ns: &Namespace, item: &SetItem) -> u64 {
        charge(ns, item)
    }

    /// Debug check: the bookkeeping agrees with the eviction index.
    #[doc(hidden)]
    pub fn check_consistency(&self) -> Result<(), String> {
        let state = self.lock();
        let charged: u64 = state.entries.values().map(|e| e.charge).sum();
        if charged != state.lru.used() {
            return Err(format!(
                "entries charge {charged}, index holds {}",
                state.lru.used()
            ));
        }
        if state.entries.len() != state.lru.len() {
            return Err(format!(
                "{} entries, {} indexed",
                state.entries.len(),
                state.lru.len()
            ));
        }
        if state.lru.used() > state.lru.capacity() {
            return Err("over budget".to_owned());
        }
        for class in Retention::ALL {
            let held: u64 = state
                .entries
                .values()
                .filter(|e| e.class == class)
                .map(|e| e.charge)
                .sum();
            if held != state.lru.used_by(class) {
                return Err(format!("class {} disagrees", class.as_str()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Retention::{Ephemeral, Long, Short};

    fn ns() -> Namespace {
        Namespace::new("m", "")
    }

    fn item(key: &str, len: usize, class: Retention) -> SetItem {
        SetItem::new(key.as_bytes().to_vec(), vec![key.as_bytes()[0]; len]).retention(class)
    }

    /// A budget that holds exactly `n` items of `len` value bytes with one-byte keys.
    fn budget(n: u64, len: u64) -> u64 {
        n * (len + 1 + 1 + ENTRY_OVERHEAD)
    }

    #[test]
    fn a_short_write_cannot_evict_long() {
        let store = L2Store::new(budget(2, 100));
        assert!(store.set(&ns(), &item("a", 100, Long), 0).accepted);
        assert!(store.set(&ns(), &item("b", 100, Long), 0).accepted);
        let ack = store.set(&ns(), &item("c", 100, Short), 0);
        assert_eq!(ack, SetAck::rejected(REASON_DISPLACE));
        assert!(store.get(&ns(), b"a", 0).is_some() && store.get(&ns(), b"b", 0).is_some());
        // The same class may displace the least recently used one.
        assert!(store.set(&ns(), &item("d", 100, Long), 0).accepted);
        assert_eq!(
            store.exists(&ns(), &[b"a", b"b", b"d"], 0),
            [false, true, true]
        );
        let s = store.stats();
        assert_eq!((s.evictions_total, s.rejected_total), (1, 1));
        store.check_consistency().unwrap();
    }

    #[test]
    fn lower_classes_go_first() {
        let store = L2Store::new(budget(3, 10));
        store.set(&ns(), &item("e", 10, Ephemeral), 0);
        store.set(&ns(), &item("s", 10, Short), 0);
        store.set(&ns(), &item("l", 10, Long), 0);
        assert!(store.set(&ns(), &item("x", 10, Short), 0).accepted);
        assert_eq!(
            store.exists(&ns(), &[b"e", b"s", b"l", b"x"], 0),
            [false, true, true, true]
        );
    }

    #[test]
    fn a_lower_class_never_overwrites_a_higher_one() {
        let store = L2Store::new(budget(4, 10));
        store.set(&ns(), &item("a", 10, Long), 0);
        let ack = store.set(&ns(), &SetItem::new(&b"a"[..], &b"other"[..]), 0);
        assert_eq!(ack, SetAck::rejected(REASON_DOWNGRADE));
        let hit = store.get(&ns(), b"a", 0).unwrap();
        assert_eq!((hit.value.len(), hit.retention), (10, Long));
        // An upgrade replaces the value and the class.
        store.set(&ns(), &item("b", 10, Short), 0);
        assert!(store.set(&ns(), &item("b", 5, Long), 0).accepted);
        let hit = store.get(&ns(), b"b", 0).unwrap();
        assert_eq!((hit.value.len(), hit.retention), (5, Long));
        store.check_consistency().unwrap();
    }

    #[test]
    fn ttl_expiry_frees_space() {
        let store = L2Store::new(budget(2, 100));
        store.set(&ns(), &item("a", 100, Long).ttl_seconds(1.0), 0);
        store.set(&ns(), &item("b", 100, Long).ttl_seconds(2.0), 0);
        assert_eq!(store.exists(&ns(), &[b"a"], 999), [true]);
        assert_eq!(store.exists(&ns(), &[b"a"], 1000), [false]);
        assert_eq!(store.sweep(1000), 1);
        assert!(store.set(&ns(), &item("d", 100, Long), 1000).accepted);
        assert!(store.get(&ns(), b"b", 2000).is_none(), "expired on access");
        let s = store.stats();
        assert_eq!(s.expired_total, 2);
        assert_eq!(s.entries, 1);
        store.check_consistency().unwrap();
    }

    #[test]
    fn zero_ttl_stores_nothing_and_namespaces_are_separate() {
        let store = L2Store::new(1 << 20);
        assert!(
            store
                .set(&ns(), &item("a", 1, Short).ttl_seconds(0.0), 0)
                .accepted
        );
        assert_eq!(store.stats().entries, 0);
        let other = Namespace::new("m", "fp8");
        store.set(&ns(), &item("a", 1, Short), 0);
        assert!(store.get(&other, b"a", 0).is_none());
        store.set(&other, &item("a", 2, Short), 0);
        assert_eq!(store.clear(&other), 1);
        assert_eq!(store.get(&ns(), b"a", 0).unwrap().value.len(), 1);
        assert_eq!(store.clear(&Namespace::default()), 1);
        assert_eq!(store.stats().accounted_bytes, 0);
    }

    #[test]
    fn too_large_is_refused() {
        let store = L2Store::new(100);
        let ack = store.set(&ns(), &item("a", 100, Long), 0);
        assert_eq!(ack, SetAck::rejected(REASON_TOO_LARGE));
    }
}
