//! [`ClassLru`]: keys grouped by retention class, least recently used first within a class,
//! with a value per key. The L3 index and the arena's resident set use it where they must pick
//! victims one at a time ([`ClassLru::lowest`]) rather than by byte budget (the L2 store uses
//! `infera_core::retention::ClassedLru` for that).
//!
//! A slab of nodes linked into one doubly-linked list per class plus a key map: every
//! operation is O(1). Each node also carries a recency stamp (a counter bumped on every insert
//! and touch), so a walk of the slab in chunks ([`ClassLru::slot_range`], with a lock released
//! between chunks) can still restore the recency order afterwards by sorting on it.

use infera_core::event::Retention;
use rustc_hash::FxHashMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node<T> {
    key: u128,
    class: Retention,
    prev: u32,
    next: u32,
    /// The value of `clock` when the node last became the most recent of its class.
    stamp: u64,
    value: Option<T>,
}

#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct ClassLru<T> {
    nodes: Vec<Node<T>>,
    free: Vec<u32>,
    map: FxHashMap<u128, u32>,
    lists: [List; 4],
    clock: u64,
}

impl<T> Default for ClassLru<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ClassLru<T> {
    /// An empty set.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty set with room for `n` keys.
    pub fn with_capacity(n: usize) -> Self {
        let mut map = FxHashMap::default();
        map.reserve(n);
        Self {
            nodes: Vec::with_capacity(n),
            free: Vec::new(),
            map,
            lists: [EMPTY; 4],
            clock: 0,
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The value and class of `key`.
    pub fn get(&self, key: u128) -> Option<(Retention, &T)> {
        let n = &self.nodes[*self.map.get(&key)? as usize];
        Some((n.class, n.value.as_ref()?))
    }

    /// The value of `key`, mutably (recency unchanged).
    pub fn get_mut(&mut self, key: u128) -> Option<&mut T> {
        let i = *self.map.get(&key)?;
        self.nodes[i as usize].value.as_mut()
    }

    /// Inserts `key` (or replaces it, returning the old value) as the most recently used of
    /// `class`.
    pub fn insert(&mut self, key: u128, class: Retention, value: T) -> Option<T> {
        let old = self.remove(key).map(|(_, v)| v);
        let node = Node {
            key,
            class,
            prev: NIL,
            next: NIL,
            stamp: 0,
            value: Some(value),
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(key, i);
        self.push_tail(i);
        old
    }

    /// Makes `key` the most recently used of its class.
    pub fn touch(&mut self, key: u128) {
        if let Some(&i) = self.map.get(&key) {
            self.unlink(i);
            self.push_tail(i);
        }
    }

    /// Removes `key`, returning its class and value.
    pub fn remove(&mut self, key: u128) -> Option<(Retention, T)> {
        let i = self.map.remove(&key)?;
        self.unlink(i);
        self.free.push(i);
        let n = &mut self.nodes[i as usize];
        Some((n.class, n.value.take()?))
    }

    /// The least recently used key of the lowest non-empty class at most `max`.
    pub fn lowest(&self, max: Retention) -> Option<u128> {
        (0..=max as usize)
            .map(|c| self.lists[c].head)
            .find(|h| *h != NIL)
            .map(|h| self.nodes[h as usize].key)
    }

    /// Every entry, lowest class first, least recently used first within a class.
    pub fn iter(&self) -> impl Iterator<Item = (u128, Retention, &T)> + '_ {
        self.lists.iter().flat_map(move |list| {
            let mut at = list.head;
            std::iter::from_fn(move || {
                if at == NIL {
                    return None;
                }
                let n = &self.nodes[at as usize];
                at = n.next;
                Some((n.key, n.class, n.value.as_ref()?))
            })
        })
    }

    /// Slab positions in use so far (held or free); [`ClassLru::slot_range`] walks them.
    pub fn slots(&self) -> usize {
        self.nodes.len()
    }

    /// The entries held at slab positions `range` (clamped to [`ClassLru::slots`]), with their
    /// recency stamps: within a class, a larger stamp was used more recently.
    ///
    /// An entry keeps its position from insert to removal (a touch relinks it in place), so a
    /// walk over every position in chunks, with changes between chunks, sees each entry that
    /// stayed held throughout exactly once; entries inserted meanwhile may or may not be seen
    /// (possibly twice, when re-inserted), and removed ones may have been seen before they left.
    pub fn slot_range(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (u128, Retention, u64, &T)> + '_ {
        let end = range.end.min(self.nodes.len());
        let start = range.start.min(end);
        self.nodes[start..end]
            .iter()
            .filter_map(|n| Some((n.key, n.class, n.stamp, n.value.as_ref()?)))
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next, class) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next, n.class as usize)
        };
        match prev {
            NIL => self.lists[class].head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.lists[class].tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        self.lists[class].len -= 1;
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = NIL;
    }

    fn push_tail(&mut self, i: u32) {
        let class = self.nodes[i as usize].class as usize;
        let tail = self.lists[class].tail;
        self.clock += 1;
        self.nodes[i as usize].stamp = self.clock;
        self.nodes[i as usize].prev = tail;
        self.nodes[i as usize].next = NIL;
        match tail {
            NIL => self.lists[class].head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.lists[class].tail = i;
        self.lists[class].len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Retention::{Ephemeral, Long, Short};

    #[test]
    fn victims_come_lowest_class_first_then_least_recent() {
        let mut lru = ClassLru::new();
        lru.insert(1, Long, "a");
        lru.insert(2, Short, "b");
        lru.insert(3, Short, "c");
        lru.insert(4, Ephemeral, "d");
        assert_eq!(lru.lowest(Long), Some(4));
        assert_eq!(lru.lowest(Retention::None), None);
        lru.remove(4);
        assert_eq!(lru.lowest(Short), Some(2));
        lru.touch(2);
        assert_eq!(lru.lowest(Short), Some(3));
        assert_eq!(lru.insert(3, Long, "c2"), Some("c"));
        assert_eq!(lru.lowest(Short), Some(2));
        let order: Vec<u128> = lru.iter().map(|(k, _, _)| k).collect();
        assert_eq!(order, [2, 1, 3]);
        assert_eq!(lru.len(), 3);
        assert_eq!(lru.get(3), Some((Long, &"c2")));
        for k in [1, 2, 3] {
            lru.remove(k);
        }
        assert!(lru.len() == 0 && lru.lowest(Long).is_none());
    }

    #[test]
    fn a_slab_walk_in_chunks_sees_held_entries_once_and_restores_recency() {
        let mut lru = ClassLru::new();
        for k in 0..10u128 {
            lru.insert(k, if k % 2 == 0 { Short } else { Long }, k * 10);
        }
        lru.touch(2);
        lru.touch(1);
        let mut seen: Vec<(u128, Retention, u64, u128)> = Vec::new();
        let mut at = 0;
        while at < lru.slots() {
            seen.extend(lru.slot_range(at..at + 3).map(|(k, c, s, v)| (k, c, s, *v)));
            at += 3;
            if at == 3 {
                // Between chunks: a visited entry leaves, an unvisited one leaves, a new one
                // arrives (into a freed position already walked).
                lru.remove(7);
                lru.remove(0);
                lru.insert(42, Short, 420);
            }
        }
        let keys: Vec<u128> = seen.iter().map(|e| e.0).collect();
        assert_eq!(keys, [0, 1, 2, 3, 4, 5, 6, 8, 9], "7 left before its chunk");
        assert!(seen.iter().all(|(k, _, _, v)| *v == k * 10));
        // Sorting by stamp gives the recency order within each class.
        let mut short: Vec<(u64, u128)> = seen
            .iter()
            .filter(|e| e.1 == Short && e.0 != 0)
            .map(|e| (e.2, e.0))
            .collect();
        short.sort_unstable();
        let want: Vec<u128> = lru
            .iter()
            .filter(|(k, c, _)| *c == Short && *k != 42)
            .map(|(k, _, _)| k)
            .collect();
        assert_eq!(short.iter().map(|e| e.1).collect::<Vec<_>>(), want);
        assert_eq!(want, [4, 6, 8, 2]);
        assert!(lru.slot_range(100..200).next().is_none());
    }
}
