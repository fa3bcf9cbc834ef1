//! The paged GPU KV cache: published blocks keyed by router hash, plus a count of anonymous ones.
//!
//! # Structure
//! Published blocks live in a slab (`entries`, recycled through `free_slots`) indexed by a hash map
//! `BlockHash → slot`. Each entry records its parent slot (the block before it in the prompt that
//! stored it), how many sequences reference it and how many resident children it has. Anonymous
//! blocks (partial prompt tails, generated tokens) are only counted.
//!
//! # Invariants
//! - `resident() + anonymous() <= capacity` at all times: nothing is ever over-allocated.
//! - Every resident block's parent is resident (a block implies its prefix), so the published
//!   blocks form a forest; a block is inserted only under a resident parent and removed only when
//!   it has no resident child.
//! - Sequences reference whole chains from a root, so every ancestor of a referenced block is
//!   referenced. Hence if any block is unreferenced, the deepest unreferenced one is a leaf: all
//!   `unreferenced()` blocks can be evicted one leaf at a time, and `available()` is exact.
//! - The LRU set holds exactly the evictable blocks: unreferenced (`refs == 0`) leaves
//!   (`children == 0`), ordered by their last-use stamp.
//!
//! # Eviction: leaf-first LRU
//! The least recently used evictable block goes first. Evicting a leaf may make its parent a leaf;
//! the parent then joins the LRU set with its own (older) stamp, so a shared root outlives all its
//! descendants but is not kept forever once they are gone. Stamps come from a per-cache counter
//! bumped on every acquire and release, so they are unique and the order is deterministic. Each
//! operation is O(log n) (a `BTreeMap` keyed by stamp); nothing ever scans the cache, except
//! [`BlockCache::evict_all_unreferenced`], which is proportional to what it evicts.

use crate::ids::BlockHash;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Slot value meaning "no parent" (a block at the start of a prompt).
const ROOT: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Entry {
    hash: BlockHash,
    parent: u32,
    refs: u32,
    children: u32,
    stamp: u64,
}

/// The result of looking a block up under an expected parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// Not resident.
    Absent,
    /// Resident under the expected parent, at this slot.
    Hit(u32),
    /// Resident under another parent: the caller's hashes are not a consistent chain.
    Conflict,
}

/// The GPU block pool (see the module docs).
#[derive(Debug)]
pub(crate) struct BlockCache {
    capacity: usize,
    entries: Vec<Entry>,
    free_slots: Vec<u32>,
    by_hash: FxHashMap<BlockHash, u32>,
    /// Evictable blocks by last-use stamp.
    lru: BTreeMap<u64, u32>,
    clock: u64,
    unreferenced: usize,
    anonymous: usize,
}

impl BlockCache {
    pub(crate) fn new(capacity: usize) -> Self {
        let reserve = capacity.min(1 << 20);
        let mut by_hash = FxHashMap::default();
        by_hash.reserve(reserve);
        Self {
            capacity,
            entries: Vec::with_capacity(reserve),
            free_slots: Vec::new(),
            by_hash,
            lru: BTreeMap::new(),
            clock: 0,
            unreferenced: 0,
            anonymous: 0,
        }
    }

    /// Published blocks resident (referenced or cached).
    pub(crate) fn resident(&self) -> usize {
        self.by_hash.len()
    }

    pub(crate) fn anonymous(&self) -> usize {
        self.anonymous
    }

    /// Resident published blocks no sequence references (all evictable, leaf by leaf).
    pub(crate) fn unreferenced(&self) -> usize {
        self.unreferenced
    }

    /// Blocks neither resident nor anonymous.
    pub(crate) fn free(&self) -> usize {
        self.capacity
            .saturating_sub(self.resident() + self.anonymous)
    }

    /// Blocks that could be handed out now, evicting if needed.
    pub(crate) fn available(&self) -> usize {
        self.free() + self.unreferenced
    }

    /// Blocks in use by sequences (referenced published + anonymous) over capacity.
    pub(crate) fn utilisation(&self) -> f64 {
        let used = self.resident() - self.unreferenced + self.anonymous;
        used as f64 / self.capacity as f64
    }

    pub(crate) fn hash_of(&self, slot: u32) -> BlockHash {
        self.entries[slot as usize].hash
    }

    pub(crate) fn refs(&self, slot: u32) -> u32 {
        self.entries[slot as usize].refs
    }

    /// Looks `hash` up, expecting it under `parent` (`None`: at the start of a prompt).
    pub(crate) fn lookup(&self, hash: BlockHash, parent: Option<u32>) -> Lookup {
        match self.by_hash.get(&hash) {
            None => Lookup::Absent,
            Some(&slot) if self.entries[slot as usize].parent == parent.unwrap_or(ROOT) => {
                Lookup::Hit(slot)
            }
            Some(_) => Lookup::Conflict,
        }
    }

    /// The longest prefix of `blocks` resident as a chain from a root, and whether the walk
    /// stopped at a block resident under another parent.
    pub(crate) fn prefix_match(&self, blocks: &[BlockHash]) -> (usize, bool) {
        let mut parent = None;
        for (i, &h) in blocks.iter().enumerate() {
            match self.lookup(h, parent) {
                Lookup::Hit(slot) => parent = Some(slot),
                Lookup::Absent => return (i, false),
                Lookup::Conflict => return (i, true),
            }
        }
        (blocks.len(), false)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Takes a reference on a resident block and refreshes its last use.
    pub(crate) fn acquire(&mut self, slot: u32) {
        let stamp = self.tick();
        let e = &mut self.entries[slot as usize];
        if e.refs == 0 {
            self.unreferenced -= 1;
            if e.children == 0 {
                self.lru.remove(&e.stamp);
            }
        }
        e.refs += 1;
        e.stamp = stamp;
    }

    /// Drops a reference and refreshes the block's last use; an unreferenced leaf becomes
    /// evictable.
    pub(crate) fn release(&mut self, slot: u32) {
        let stamp = self.tick();
        let e = &mut self.entries[slot as usize];
        debug_assert!(e.refs > 0, "release of an unreferenced block");
        e.refs = e.refs.saturating_sub(1);
        e.stamp = stamp;
        if e.refs == 0 {
            self.unreferenced += 1;
            if e.children == 0 {
                self.lru.insert(stamp, slot);
            }
        }
    }

    /// Makes `hash` resident under `parent` with one reference, taking a free block.
    ///
    /// Returns `None` (and changes nothing) when no block is free or `hash` is already resident;
    /// callers make room first and look the hash up before.
    pub(crate) fn insert(&mut self, hash: BlockHash, parent: Option<u32>) -> Option<u32> {
        if self.free() == 0 || self.by_hash.contains_key(&hash) {
            return None;
        }
        let stamp = self.tick();
        let entry = Entry {
            hash,
            parent: parent.unwrap_or(ROOT),
            refs: 1,
            children: 0,
            stamp,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.entries[slot as usize] = entry;
                slot
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        if let Some(p) = parent {
            let pe = &mut self.entries[p as usize];
            if pe.refs == 0 && pe.children == 0 {
                self.lru.remove(&pe.stamp);
            }
            pe.children += 1;
        }
        self.by_hash.insert(hash, slot);
        Some(slot)
    }

    /// Takes `n` anonymous blocks from the free ones; `false` (and nothing taken) if too few.
    pub(crate) fn alloc_anonymous(&mut self, n: usize) -> bool {
        if n > self.free() {
            return false;
        }
        self.anonymous += n;
        true
    }

    pub(crate) fn free_anonymous(&mut self, n: usize) {
        debug_assert!(n <= self.anonymous);
        self.anonymous = self.anonymous.saturating_sub(n);
    }

    /// Evicts the least recently used evictable leaf, appending its hash to `out`.
    fn evict_one(&mut self, out: &mut Vec<BlockHash>) -> bool {
        let Some((_, slot)) = self.lru.pop_first() else {
            return false;
        };
        let (hash, parent) = {
            let e = &self.entries[slot as usize];
            (e.hash, e.parent)
        };
        self.by_hash.remove(&hash);
        self.free_slots.push(slot);
        self.unreferenced -= 1;
        if parent != ROOT {
            let pe = &mut self.entries[parent as usize];
            pe.children -= 1;
            if pe.children == 0 && pe.refs == 0 {
                self.lru.insert(pe.stamp, parent);
            }
        }
        out.push(hash);
        true
    }

    /// Evicts until at least `n` blocks are free; `false` if the evictable blocks ran out first.
    pub(crate) fn evict_until_free(&mut self, n: usize, out: &mut Vec<BlockHash>) -> bool {
        while self.free() < n {
            if !self.evict_one(out) {
                return false;
            }
        }
        true
    }

    /// Evicts every unreferenced block, leaves before their parents.
    pub(crate) fn evict_all_unreferenced(&mut self, out: &mut Vec<BlockHash>) {
        while self.evict_one(out) {}
        debug_assert_eq!(self.unreferenced, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u64) -> BlockHash {
        BlockHash(v)
    }

    #[test]
    fn shared_root_outlives_its_leaves_even_when_older() {
        let mut c = BlockCache::new(3);
        let r = c.insert(h(1), None).expect("room");
        let a = c.insert(h(2), Some(r)).expect("room");
        c.acquire(r);
        let b = c.insert(h(3), Some(r)).expect("room");
        // The root is released first (least recently used), then the leaves.
        c.release(r);
        c.release(r);
        c.release(a);
        c.release(b);
        assert_eq!(c.unreferenced(), 3);
        let mut out = Vec::new();
        assert!(c.evict_until_free(1, &mut out));
        assert_eq!(out, vec![h(2)]);
        assert!(c.evict_until_free(2, &mut out));
        assert_eq!(out, vec![h(2), h(3)]);
        assert!(c.evict_until_free(3, &mut out));
        assert_eq!(out, vec![h(2), h(3), h(1)]);
        assert_eq!(c.resident(), 0);
        assert!(
            !c.evict_until_free(4, &mut out),
            "cannot free past capacity"
        );
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut c = BlockCache::new(2);
        let r = c.insert(h(1), None).expect("room");
        let x = c.insert(h(9), None).expect("room");
        c.release(x);
        let mut out = Vec::new();
        assert!(!c.evict_until_free(2, &mut out));
        assert_eq!(out, vec![h(9)]);
        assert_eq!(c.lookup(h(1), None), Lookup::Hit(r));
        assert_eq!(c.insert(h(5), None).map(|_| ()), Some(()));
        assert_eq!(
            c.insert(h(6), None),
            None,
            "full: insert refuses instead of over-allocating"
        );
        assert!(!c.alloc_anonymous(1));
    }

    #[test]
    fn acquire_refreshes_lru_order() {
        let mut c = BlockCache::new(2);
        let a = c.insert(h(1), None).expect("room");
        let b = c.insert(h(2), None).expect("room");
        c.release(a);
        c.release(b);
        // Touch a again: b is now the least recently used.
        c.acquire(a);
        c.release(a);
        let mut out = Vec::new();
        assert!(c.evict_until_free(1, &mut out));
        assert_eq!(out, vec![h(2)]);
    }

    #[test]
    fn lookup_checks_the_parent() {
        let mut c = BlockCache::new(4);
        let r = c.insert(h(1), None).expect("room");
        let _ = c.insert(h(2), Some(r)).expect("room");
        assert_eq!(c.lookup(h(2), None), Lookup::Conflict);
        assert_eq!(c.lookup(h(3), Some(r)), Lookup::Absent);
        assert_eq!(c.prefix_match(&[h(1), h(2), h(3)]), (2, false));
        assert_eq!(c.prefix_match(&[h(2)]), (0, true));
        assert_eq!(c.insert(h(2), Some(r)), None, "already resident");
    }

    #[test]
    fn anonymous_blocks_count_toward_capacity_and_utilisation() {
        let mut c = BlockCache::new(4);
        assert!(c.alloc_anonymous(3));
        assert!((c.utilisation() - 0.75).abs() < 1e-12);
        let s = c.insert(h(1), None).expect("room");
        assert_eq!(c.free(), 0);
        c.release(s);
        assert!(
            (c.utilisation() - 0.75).abs() < 1e-12,
            "cached blocks are not utilised"
        );
        assert_eq!(c.available(), 1);
        c.free_anonymous(3);
        assert_eq!(c.available(), 4);
    }
}
