//! Retention-class eviction: the cache policy of the KV-cache daemon's tiers, shared by `infera kvd`
//! (its L2 / L3 stores) and `infera replay` (which simulates those tiers behind each engine).
//!
//! [`ClassedLru`] tracks keys with a size, a [`Retention`] class and an optional expiry. It holds at
//! most `capacity` units (bytes or blocks, the caller's choice). Rules (PROTOCOLS.md §6):
//! - eviction takes the lowest class first, least recently used first within a class, in O(1);
//! - a write never displaces a higher class: if the room can only be made by evicting entries of a
//!   higher class than the incoming one, the write is rejected and nothing is evicted;
//! - a lower class never overwrites a higher one for the same key (the entry keeps its class; its
//!   recency and expiry are refreshed);
//! - expired entries are reclaimed by [`ClassedLru::expire`] (the daemon's sweeper), and are never
//!   returned by [`ClassedLru::get`].
//!
//! The structure is a slab of nodes linked into one doubly-linked LRU list per class, plus a key
//! map and an expiry index; every operation is O(1) or O(log n) in the expiry index.

use crate::event::Retention;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::hash::Hash;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node<K> {
    key: K,
    size: u64,
    class: Retention,
    expires_at: Option<u64>,
    prev: u32,
    next: u32,
}

#[derive(Debug, Clone, Copy, Default)]
struct List {
    /// Least recently used end.
    head: u32,
    /// Most recently used end.
    tail: u32,
    bytes: u64,
}

/// Why a write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// Making room would evict entries of a higher class than the write.
    #[error("would_displace_higher_priority")]
    WouldDisplaceHigherPriority,
    /// The entry alone is larger than the whole store.
    #[error("too_large")]
    TooLarge,
}

impl Rejected {
    /// The reason string of the kvd wire protocol.
    pub fn reason(self) -> &'static str {
        match self {
            Rejected::WouldDisplaceHigherPriority => "would_displace_higher_priority",
            Rejected::TooLarge => "too_large",
        }
    }
}

/// An entry that left the store to make room (or by expiry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted<K> {
    pub key: K,
    pub size: u64,
    pub class: Retention,
    pub expires_at: Option<u64>,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct ClassedLru<K: Hash + Eq + Clone + Ord> {
    capacity: u64,
    used: u64,
    nodes: Vec<Node<K>>,
    free: Vec<u32>,
    map: FxHashMap<K, u32>,
    lists: [List; 4],
    expiry: BTreeSet<(u64, K)>,
}

impl<K: Hash + Eq + Clone + Ord> ClassedLru<K> {
    pub fn new(capacity: u64) -> Self {
        let empty = List {
            head: NIL,
            tail: NIL,
            bytes: 0,
        };
        Self {
            capacity,
            used: 0,
            nodes: Vec::new(),
            free: Vec::new(),
            map: FxHashMap::default(),
            lists: [empty; 4],
            expiry: BTreeSet::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Units held.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Units held by entries of `class`.
    pub fn used_by(&self, class: Retention) -> u64 {
        self.lists[class as usize].bytes
    }

    /// Whether `key` is held and not expired at `now`; does not touch recency.
    pub fn contains(&self, key: &K, now: u64) -> bool {
        self.map.get(key).is_some_and(|i| !self.is_expired(*i, now))
    }

    /// The entry's class if held and not expired; marks it most recently used.
    pub fn get(&mut self, key: &K, now: u64) -> Option<Retention> {
        let i = *self.map.get(key)?;
        if self.is_expired(i, now) {
            return None;
        }
        let class = self.nodes[i as usize].class;
        self.unlink(i);
        self.push_tail(i);
        Some(class)
    }

    /// Inserts or refreshes `key`. Returns the entries evicted to make room.
    pub fn insert(
        &mut self,
        key: K,
        size: u64,
        class: Retention,
        expires_at: Option<u64>,
    ) -> Result<Vec<Evicted<K>>, Rejected> {
        if let Some(&i) = self.map.get(&key) {
            return self.update(i, size, class, expires_at);
        }
        if size > self.capacity {
            return Err(Rejected::TooLarge);
        }
        let evicted = self.make_room(size, class, None)?;
        let node = Node {
            key: key.clone(),
            size,
            class,
            expires_at,
            prev: NIL,
            next: NIL,
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
        if let Some(t) = expires_at {
            self.expiry.insert((t, key.clone()));
        }
        self.map.insert(key, i);
        self.used += size;
        self.push_tail(i);
        Ok(evicted)
    }

    fn update(
        &mut self,
        i: u32,
        size: u64,
        class: Retention,
        expires_at: Option<u64>,
    ) -> Result<Vec<Evicted<K>>, Rejected> {
        let (old_size, old_class, old_exp) = {
            let n = &self.nodes[i as usize];
            (n.size, n.class, n.expires_at)
        };
        let new_class = old_class.max(class);
        if size > self.capacity {
            return Err(Rejected::TooLarge);
        }
        let evicted = if size > old_size {
            self.make_room(size - old_size, new_class, Some(i))?
        } else {
            Vec::new()
        };
        self.unlink(i);
        let key = self.nodes[i as usize].key.clone();
        if let Some(t) = old_exp {
            self.expiry.remove(&(t, key.clone()));
        }
        // A lower class keeps the higher class's lifetime too: an unbounded entry stays unbounded.
        let new_exp = if class < old_class {
            old_exp.and(expires_at.max(old_exp))
        } else {
            expires_at
        };
        if let Some(t) = new_exp {
            self.expiry.insert((t, key));
        }
        let n = &mut self.nodes[i as usize];
        n.size = size;
        n.class = new_class;
        n.expires_at = new_exp;
        self.used = self.used - old_size + size;
        self.push_tail(i);
        Ok(evicted)
    }

    /// Evicts lowest-class-first until `need` more units fit. Refuses (evicting nothing) when that
    /// would take an entry of a class above `class`. `keep` is never evicted.
    fn make_room(
        &mut self,
        need: u64,
        class: Retention,
        keep: Option<u32>,
    ) -> Result<Vec<Evicted<K>>, Rejected> {
        let free = self.capacity - self.used;
        if need <= free {
            return Ok(Vec::new());
        }
        let keep_size = keep.map(|k| self.nodes[k as usize].size).unwrap_or(0);
        let keep_class = keep.map(|k| self.nodes[k as usize].class);
        let evictable: u64 = (0..=class as usize)
            .map(|c| self.lists[c].bytes)
            .sum::<u64>()
            - keep_class
                .filter(|c| *c <= class)
                .map(|_| keep_size)
                .unwrap_or(0);
        if free + evictable < need {
            return Err(Rejected::WouldDisplaceHigherPriority);
        }
        let mut out = Vec::new();
        let mut c = 0usize;
        while self.capacity - self.used < need {
            let mut i = self.lists[c].head;
            if Some(i) == keep {
                i = self.nodes[i as usize].next;
            }
            if i == NIL {
                c += 1;
                continue;
            }
            out.push(self.remove_index(i));
        }
        Ok(out)
    }

    /// Removes `key`, returning its entry.
    pub fn remove(&mut self, key: &K) -> Option<Evicted<K>> {
        let i = *self.map.get(key)?;
        Some(self.remove_index(i))
    }

    /// Removes every entry expired at `now` (the sweeper).
    pub fn expire(&mut self, now: u64) -> Vec<Evicted<K>> {
        let mut out = Vec::new();
        while let Some((t, key)) = self.expiry.first().cloned() {
            if t > now {
                break;
            }
            match self.map.get(&key) {
                Some(&i) => out.push(self.remove_index(i)),
                None => {
                    self.expiry.pop_first();
                }
            }
        }
        out
    }

    /// Drops everything; returns how many entries were held.
    pub fn clear(&mut self) -> usize {
        let n = self.map.len();
        *self = Self::new(self.capacity);
        n
    }

    fn is_expired(&self, i: u32, now: u64) -> bool {
        self.nodes[i as usize].expires_at.is_some_and(|t| t <= now)
    }

    fn remove_index(&mut self, i: u32) -> Evicted<K> {
        self.unlink(i);
        let n = &self.nodes[i as usize];
        let ev = Evicted {
            key: n.key.clone(),
            size: n.size,
            class: n.class,
            expires_at: n.expires_at,
        };
        if let Some(t) = ev.expires_at {
            self.expiry.remove(&(t, ev.key.clone()));
        }
        self.map.remove(&ev.key);
        self.used -= ev.size;
        self.free.push(i);
        ev
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next, class, size) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next, n.class as usize, n.size)
        };
        if prev == NIL {
            self.lists[class].head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.lists[class].tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        self.lists[class].bytes -= size;
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = NIL;
    }

    fn push_tail(&mut self, i: u32) {
        let (class, size) = {
            let n = &self.nodes[i as usize];
            (n.class as usize, n.size)
        };
        let tail = self.lists[class].tail;
        self.nodes[i as usize].prev = tail;
        self.nodes[i as usize].next = NIL;
        if tail == NIL {
            self.lists[class].head = i;
        } else {
            self.nodes[tail as usize].next = i;
        }
        self.lists[class].tail = i;
        self.lists[class].bytes += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Retention::{Ephemeral, Long, Short};

    #[test]
    fn evicts_lowest_class_then_lru() {
        let mut c = ClassedLru::new(4);
        c.insert(1u64, 1, Long, None).expect("fits");
        c.insert(2, 1, Short, None).expect("fits");
        c.insert(3, 1, Short, None).expect("fits");
        c.insert(4, 1, Ephemeral, None).expect("fits");
        assert_eq!(c.get(&2, 0), Some(Short)); // 3 is now the LRU short entry
        let ev = c
            .insert(5, 2, Short, None)
            .expect("room from lower classes");
        let keys: Vec<u64> = ev.iter().map(|e| e.key).collect();
        assert_eq!(keys, vec![4, 3]);
        assert!(c.contains(&1, 0) && c.contains(&2, 0) && c.contains(&5, 0));
        assert_eq!(c.used(), 4);
    }

    #[test]
    fn never_displaces_a_higher_class() {
        let mut c = ClassedLru::new(2);
        c.insert(1u64, 1, Long, None).expect("fits");
        c.insert(2, 1, Long, None).expect("fits");
        assert_eq!(
            c.insert(3, 1, Short, None),
            Err(Rejected::WouldDisplaceHigherPriority)
        );
        assert_eq!(c.len(), 2);
        assert_eq!(c.insert(4, 3, Long, None), Err(Rejected::TooLarge));
        // Same class may displace.
        let ev = c.insert(5, 1, Long, None).expect("lru long goes");
        assert_eq!(ev[0].key, 1);
    }

    #[test]
    fn lower_class_never_overwrites_higher_for_the_same_key() {
        let mut c = ClassedLru::new(4);
        c.insert(1u64, 1, Long, None).expect("fits");
        c.insert(1, 1, Retention::None, Some(10)).expect("refresh");
        assert_eq!(
            c.get(&1, 100),
            Some(Long),
            "keeps class and stays unbounded"
        );
        c.insert(2u64, 1, Short, Some(5)).expect("fits");
        c.insert(2, 1, Long, None).expect("upgrade");
        assert_eq!(c.get(&2, 100), Some(Long));
    }

    #[test]
    fn expiry_is_swept_and_never_returned() {
        let mut c = ClassedLru::new(10);
        c.insert(1u64, 3, Short, Some(100)).expect("fits");
        c.insert(2, 3, Short, Some(50)).expect("fits");
        c.insert(3, 3, Long, None).expect("fits");
        assert_eq!(c.get(&2, 50), None);
        assert!(c.contains(&1, 99));
        let gone: Vec<u64> = c.expire(100).into_iter().map(|e| e.key).collect();
        assert_eq!(gone, vec![2, 1]);
        assert_eq!(c.used(), 3);
        assert!(c.expire(1000).is_empty());
    }

    #[test]
    fn growing_an_entry_keeps_it() {
        let mut c = ClassedLru::new(4);
        c.insert(1u64, 2, Short, None).expect("fits");
        c.insert(2, 2, Short, None).expect("fits");
        let ev = c.insert(1, 3, Short, None).expect("grow by evicting 2");
        assert_eq!(ev.iter().map(|e| e.key).collect::<Vec<_>>(), vec![2]);
        assert_eq!(c.used(), 3);
        assert_eq!(c.used_by(Short), 3);
    }
}
