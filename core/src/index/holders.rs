//! Holder sets of one tier: router block hash → the set of worker slots holding it, as bitsets.
//!
//! Layout:
//! - `low` (a [`U64Map`], one cache line per lookup): router hash → one `u64` bitset of slots
//!   `0..64`. Every held router hash has an entry
//!   here, even when only slots ≥ 64 hold it (the word is then `0`), so a miss in `low` means
//!   "nobody holds it" and a fleet of up to 64 worker ranks never touches anything else.
//! - `high_rows`: router hash → a row of `high`, only for router hashes held by some slot ≥ 64.
//!   A row is `stride` words; word `j` covers slots `64 * (j + 1) .. 64 * (j + 2)`. The arena is
//!   widened (every row copied) the first time a slot beyond its width is set; it never narrows.
//!
//! Invariants (checked by [`TierHolders::check`]):
//! - a router hash is a key of `low` iff at least one slot holds it;
//! - it is a key of `high_rows` iff at least one slot ≥ 64 holds it, and its row is non-zero;
//! - rows on the free list are all-zero and referenced by no key; no row is referenced twice.

use super::table::U64Map;
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

/// Slots `0..LOW_SLOTS` live in the one-word bitset of `low`.
pub(crate) const LOW_SLOTS: u32 = 64;

/// Router hash → holder bitset, for one tier.
#[derive(Clone, Default)]
pub(crate) struct TierHolders {
    low: U64Map,
    high_rows: FxHashMap<u64, u32>,
    high: Rows,
}

/// Fixed-width bitset rows for slots ≥ 64, with a free list.
#[derive(Clone, Default)]
struct Rows {
    stride: usize,
    words: Vec<u64>,
    free: Vec<u32>,
}

impl Rows {
    fn alloc(&mut self) -> u32 {
        if let Some(r) = self.free.pop() {
            return r;
        }
        let row = self.words.len() / self.stride.max(1);
        self.words.resize(self.words.len() + self.stride, 0);
        row as u32
    }

    fn row(&self, row: u32) -> &[u64] {
        let start = row as usize * self.stride;
        &self.words[start..start + self.stride]
    }

    /// Widens every row to `stride` words, keeping row numbers.
    fn widen(&mut self, stride: usize) {
        if stride <= self.stride {
            return;
        }
        let rows = self.words.len().checked_div(self.stride).unwrap_or(0);
        let mut words = vec![0u64; rows * stride];
        for r in 0..rows {
            let old = &self.words[r * self.stride..(r + 1) * self.stride];
            words[r * stride..r * stride + self.stride].copy_from_slice(old);
        }
        self.words = words;
        self.stride = stride;
    }
}

/// Which word of `high` rows holds `slot` (≥ 64), and its bit.
fn high_pos(slot: u32) -> (usize, u64) {
    ((slot / 64 - 1) as usize, 1u64 << (slot % 64))
}

impl TierHolders {
    /// Adds `slot` to the holders of `router`; returns whether it was absent.
    pub(crate) fn set(&mut self, router: u64, slot: u32) -> bool {
        let low = self.low.get_or_zero(router);
        if slot < LOW_SLOTS {
            let bit = 1u64 << slot;
            let added = *low & bit == 0;
            *low |= bit;
            return added;
        }
        let (word, bit) = high_pos(slot);
        if word >= self.high.stride {
            self.high.widen(word + 1);
        }
        let row = match self.high_rows.entry(router) {
            Entry::Occupied(o) => *o.get(),
            Entry::Vacant(v) => *v.insert(self.high.alloc()),
        };
        let cell = &mut self.high.words[row as usize * self.high.stride + word];
        let added = *cell & bit == 0;
        *cell |= bit;
        added
    }

    /// Removes `slot` from the holders of `router`; returns whether it was present.
    pub(crate) fn clear(&mut self, router: u64, slot: u32) -> bool {
        if slot < LOW_SLOTS {
            let Some(low) = self.low.get_mut(router) else {
                return false;
            };
            let bit = 1u64 << slot;
            if *low & bit == 0 {
                return false;
            }
            *low &= !bit;
            if *low == 0 && !self.high_rows.contains_key(&router) {
                self.low.remove(router);
            }
            return true;
        }
        let Some(&row) = self.high_rows.get(&router) else {
            return false;
        };
        let (word, bit) = high_pos(slot);
        if word >= self.high.stride {
            return false;
        }
        let start = row as usize * self.high.stride;
        let cell = &mut self.high.words[start + word];
        if *cell & bit == 0 {
            return false;
        }
        *cell &= !bit;
        if self.high.row(row).iter().all(|&w| w == 0) {
            self.high_rows.remove(&router);
            self.high.free.push(row);
            if self.low.get(router) == Some(0) {
                self.low.remove(router);
            }
        }
        true
    }

    /// The bitset of slots `0..64` holding `router`, or `None` if no slot holds it.
    #[inline]
    pub(crate) fn low_word(&self, router: u64) -> Option<u64> {
        self.low.get(router)
    }

    /// Whether `slot` holds `router`.
    #[inline]
    pub(crate) fn holds(&self, router: u64, slot: u32) -> bool {
        if slot < LOW_SLOTS {
            return self
                .low_word(router)
                .is_some_and(|w| w & (1u64 << slot) != 0);
        }
        let (word, bit) = high_pos(slot);
        self.high_words(router)
            .get(word)
            .is_some_and(|w| w & bit != 0)
    }

    /// The words for slots ≥ 64 holding `router` (word `j` covers `64 * (j + 1)..`); empty when
    /// none does.
    #[inline]
    pub(crate) fn high_words(&self, router: u64) -> &[u64] {
        if self.high_rows.is_empty() {
            return &[];
        }
        match self.high_rows.get(&router) {
            Some(&row) => self.high.row(row),
            None => &[],
        }
    }

    /// Slots at or above this hold nothing in this tier (the width of the holder rows).
    pub(crate) fn slot_limit(&self) -> u32 {
        let high = u32::try_from(self.high.stride).unwrap_or(u32::MAX);
        LOW_SLOTS.saturating_add(high.saturating_mul(64))
    }

    /// Every slot holding `router`, ascending.
    pub(crate) fn slots_of(&self, router: u64) -> Vec<u32> {
        let mut out = Vec::new();
        let mut push_word = |base: u32, mut w: u64| {
            while w != 0 {
                out.push(base + w.trailing_zeros());
                w &= w - 1;
            }
        };
        if let Some(w) = self.low_word(router) {
            push_word(0, w);
        }
        for (j, &w) in self.high_words(router).iter().enumerate() {
            push_word(64 * (j as u32 + 1), w);
        }
        out
    }

    /// Number of distinct router hashes held by at least one slot.
    pub(crate) fn len(&self) -> usize {
        self.low.len()
    }

    /// Every held router hash (arbitrary order).
    pub(crate) fn routers(&self) -> impl Iterator<Item = u64> + '_ {
        self.low.keys()
    }

    /// Heap bytes of the tables, estimated from their capacities.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.low.heap_bytes()
            + map_bytes::<u64, u32>(self.high_rows.capacity())
            + self.high.words.capacity() * 8
            + self.high.free.capacity() * 4
    }

    /// Verifies the invariants in the module docs; returns the number of (router, slot) pairs.
    pub(crate) fn check(&self) -> Result<usize, String> {
        self.low.check()?;
        let mut pairs = 0usize;
        for (r, w) in self.low.iter() {
            let high = self.high_words(r);
            if w == 0 && high.iter().all(|&x| x == 0) {
                return Err(format!("router {r:#x} is a key with no holder"));
            }
            pairs += w.count_ones() as usize;
            pairs += high.iter().map(|x| x.count_ones() as usize).sum::<usize>();
        }
        let mut used = vec![false; self.high.words.len() / self.high.stride.max(1)];
        for (&r, &row) in &self.high_rows {
            if self.low.get(r).is_none() {
                return Err(format!("router {r:#x} has a high row but no low entry"));
            }
            if self.high.row(row).iter().all(|&x| x == 0) {
                return Err(format!("router {r:#x} has an all-zero high row"));
            }
            if std::mem::replace(&mut used[row as usize], true) {
                return Err(format!("high row {row} is referenced twice"));
            }
        }
        for &row in &self.high.free {
            if std::mem::replace(&mut used[row as usize], true) {
                return Err(format!("free high row {row} is in use or listed twice"));
            }
            if self.high.row(row).iter().any(|&x| x != 0) {
                return Err(format!("free high row {row} is not zero"));
            }
        }
        if used.iter().any(|&u| !u) {
            return Err("a high row is neither used nor free".to_owned());
        }
        Ok(pairs)
    }
}

/// Heap bytes of a hashbrown table (std `HashMap`) with this capacity: buckets of `(K, V)` plus
/// one control byte per bucket and a trailing group of 16.
pub(crate) fn map_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(K, V)>() + 1) + 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_and_high_slots_share_one_key() {
        let mut h = TierHolders::default();
        assert!(h.set(7, 3));
        assert!(!h.set(7, 3));
        assert!(h.set(7, 200));
        assert!(h.set(7, 64));
        assert_eq!(h.slots_of(7), vec![3, 64, 200]);
        assert_eq!(h.check(), Ok(3));
        assert!(h.clear(7, 3));
        assert_eq!(h.low_word(7), Some(0), "high holders keep the low entry");
        assert!(h.clear(7, 200));
        assert!(h.clear(7, 64));
        assert!(!h.clear(7, 64));
        assert_eq!(h.low_word(7), None);
        assert_eq!(h.len(), 0);
        assert_eq!(h.check(), Ok(0));
    }

    #[test]
    fn widening_keeps_rows_and_rows_are_recycled() {
        let mut h = TierHolders::default();
        h.set(1, 70);
        h.set(2, 65);
        h.set(3, 300); // widens from 1 to 4 words
        assert_eq!(h.slots_of(1), vec![70]);
        assert_eq!(h.slots_of(2), vec![65]);
        assert_eq!(h.slots_of(3), vec![300]);
        h.clear(2, 65);
        h.set(4, 100);
        assert_eq!(
            h.high.words.len(),
            3 * h.high.stride,
            "the freed row was reused"
        );
        assert_eq!(h.check(), Ok(3));
    }

    #[test]
    fn map_bytes_matches_hashbrown_growth() {
        let mut m: FxHashMap<u64, u64> = FxHashMap::default();
        m.insert(1, 1);
        assert_eq!(map_bytes::<u64, u64>(m.capacity()), 4 * 17 + 16);
        m.extend((0..1000).map(|i| (i, i)));
        assert_eq!(map_bytes::<u64, u64>(m.capacity()), 2048 * 17 + 16);
    }
}
