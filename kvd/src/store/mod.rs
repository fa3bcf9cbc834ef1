//! The stores: [`L2Store`], RAM only (the L2 rules on their own, used by tests and benches),
//! and [`Store`], the daemon's tiered store: L2 in RAM (values on the heap or in the shared
//! arena) in front of an optional long-term backend ([`crate::long::LongStore`]).
//!
//! Files: `l2.rs` (the L2 state and its invariants), `tiered.rs` ([`Store`]: L2 + arena + L3).

mod l2;
mod tiered;

pub use l2::{ENTRY_OVERHEAD, KeyHash, charge, key_hash};
pub use tiered::{Got, Reservation, Store};

use crate::proto::{Namespace, SetAck, SetItem};
use crate::stats::Stats;
use bytes::Bytes;
use infera_core::event::Retention;
use l2::L2State;
use std::sync::{Mutex, MutexGuard};

/// The reason a lower class may not overwrite a higher one for the same key.
pub const REASON_DOWNGRADE: &str = "retention_downgrade_not_allowed";
/// The reason a write cannot make room without evicting a higher class.
pub const REASON_DISPLACE: &str = "would_displace_higher_priority";
/// The reason a `long` write is refused under `--durable-long-writes` when its L3 write or
/// journal sync failed (it may still be held in RAM).
pub const REASON_NOT_DURABLE: &str = "not_durable";
/// The reason an entry larger than the whole store is refused.
pub const REASON_TOO_LARGE: &str = "value_larger_than_store";

/// A hit: the stored bytes and their class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub value: Bytes,
    pub retention: Retention,
}

/// The L2 rules alone, values on the heap (see `l2.rs` for the invariants).
#[derive(Debug)]
pub struct L2Store {
    state: Mutex<L2State>,
}

impl L2Store {
    /// An empty store holding at most `max_bytes` charged bytes.
    pub fn new(max_bytes: u64) -> Self {
        Self {
            state: Mutex::new(L2State::new(max_bytes, None, false)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, L2State> {
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
                let found = state.lookup(key_hash(ns, k), ns, k, now)?;
                Some(Hit {
                    value: state.bytes_of(&found.value, found.len)?,
                    retention: found.class,
                })
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
            .map(|k| state.contains(key_hash(ns, k.as_ref()), ns, k.as_ref(), now))
            .collect()
    }

    /// Writes one item; see `l2.rs` for when it is refused.
    pub fn set(&self, ns: &Namespace, item: &SetItem, now: u64) -> SetAck {
        self.lock().set(ns, item, now)
    }

    /// Writes items in order, under one lock.
    pub fn set_many(&self, ns: &Namespace, items: &[SetItem], now: u64) -> Vec<SetAck> {
        let mut state = self.lock();
        items.iter().map(|item| state.set(ns, item, now)).collect()
    }

    /// Drops the namespace's entries, or every entry when both parts of `ns` are empty.
    pub fn clear(&self, ns: &Namespace) -> u64 {
        self.lock().clear(ns)
    }

    /// Removes every entry expired at `now`. Returns how many.
    pub fn sweep(&self, now: u64) -> usize {
        self.lock().sweep(now)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.lock().snapshot()
    }

    /// The bytes an entry would charge (for callers sizing their writes).
    pub fn charge_of(ns: &Namespace, item: &SetItem) -> u64 {
        charge(ns, item)
    }

    /// Debug check: the bookkeeping agrees with the eviction index.
    #[doc(hidden)]
    pub fn check_consistency(&self) -> Result<(), String> {
        self.lock().check_consistency()
    }
}

#[cfg(test)]
mod tests;
