//! A bounded LRU from a 128-bit hash of a text chunk to that chunk's token ids.
//!
//! Invariants: the resident token count never exceeds `max_tokens` after an insert, and the
//! entry count never exceeds `max_entries`; the least recently used entries go first. Keys are
//! XXH3-128 of the chunk's UTF-8 bytes: a collision (2^-64 at a billion entries) would return
//! wrong ids, which we accept as we accept it for block hashes. Values are `Arc<[u32]>`, so a
//! hit copies ids out without holding the lock while the caller concatenates.

use std::sync::Arc;

use rustc_hash::FxHashMap;

const NIL: usize = usize::MAX;

#[derive(Debug)]
struct Slot {
    key: u128,
    ids: Arc<[u32]>,
    prev: usize,
    next: usize,
}

/// Least-recently-used map, bounded by entries and by resident tokens.
#[derive(Debug)]
pub(crate) struct Lru {
    map: FxHashMap<u128, usize>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
    tokens: usize,
    max_tokens: usize,
    max_entries: usize,
    evictions: u64,
}

impl Lru {
    pub(crate) fn new(max_entries: usize, max_tokens: usize) -> Self {
        Self {
            map: FxHashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            tokens: 0,
            max_tokens,
            max_entries,
            evictions: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Removes every entry; eviction counts are kept.
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.slots.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.tokens = 0;
    }

    /// Returns the ids for `key` and marks it most recently used.
    pub(crate) fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        let index = *self.map.get(&key)?;
        self.unlink(index);
        self.push_front(index);
        Some(Arc::clone(&self.slots[index].ids))
    }

    /// Inserts (or refreshes) `key`, evicting from the cold end to stay within bounds. A value
    /// larger than the whole token budget is not stored.
    pub(crate) fn insert(&mut self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > self.max_tokens || self.max_entries == 0 {
            return;
        }
        if let Some(&index) = self.map.get(&key) {
            self.unlink(index);
            self.push_front(index);
            return;
        }
        while self.map.len() >= self.max_entries || self.tokens + ids.len() > self.max_tokens {
            if !self.evict_one() {
                break;
            }
        }
        self.tokens += ids.len();
        let slot = Slot {
            key,
            ids,
            prev: NIL,
            next: NIL,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index] = slot;
                index
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        self.map.insert(key, index);
        self.push_front(index);
    }

    fn evict_one(&mut self) -> bool {
        let index = self.tail;
        if index == NIL {
            return false;
        }
        self.unlink(index);
        let key = self.slots[index].key;
        self.map.remove(&key);
        self.tokens -= self.slots[index].ids.len();
        self.slots[index].ids = Arc::from(Vec::new());
        self.free.push(index);
        self.evictions += 1;
        true
    }

    fn unlink(&mut self, index: usize) {
        let (prev, next) = (self.slots[index].prev, self.slots[index].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next].prev = prev;
        }
        self.slots[index].prev = NIL;
        self.slots[index].next = NIL;
    }

    fn push_front(&mut self, index: usize) {
        self.slots[index].next = self.head;
        self.slots[index].prev = NIL;
        if self.head != NIL {
            self.slots[self.head].prev = index;
        }
        self.head = index;
        if self.tail == NIL {
            self.tail = index;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<_>>().into()
    }

    #[test]
    fn evicts_least_recently_used_by_entries() {
        let mut lru = Lru::new(2, 100);
        lru.insert(1, ids(1));
        lru.insert(2, ids(2));
        assert!(lru.get(1).is_some());
        lru.insert(3, ids(3));
        assert!(lru.get(2).is_none());
        assert!(lru.get(1).is_some());
        assert!(lru.get(3).is_some());
        assert_eq!(lru.evictions(), 1);
    }

    #[test]
    fn evicts_by_token_budget() {
        let mut lru = Lru::new(100, 10);
        lru.insert(1, ids(4));
        lru.insert(2, ids(4));
        lru.insert(3, ids(4));
        assert_eq!(lru.len(), 2);
        assert!(lru.tokens() <= 10);
        assert!(lru.get(1).is_none());
        lru.insert(4, ids(11));
        assert!(lru.get(4).is_none());
    }
}
