//! Free space of one shard: per container, the free extents (in units) by start and by length,
//! so allocation is best-fit in O(log n) and freeing coalesces with both neighbours.
//!
//! Extents never cross a container. Allocation starts at a container chosen by the key hash
//! (spreading concurrent writes over files, and so over inode locks) and probes the others.

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, Default)]
struct Container {
    by_start: BTreeMap<u32, u32>,
    by_len: BTreeSet<(u32, u32)>,
    free: u64,
}

impl Container {
    fn insert(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free += u64::from(len);
    }

    fn take(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free -= u64::from(len);
    }

    fn alloc(&mut self, units: u32) -> Option<u32> {
        let &(len, start) = self.by_len.range((units, 0)..).next()?;
        self.take(start, len);
        if len > units {
            self.insert(start + units, len - units);
        }
        Some(start)
    }

    fn free(&mut self, mut start: u32, mut len: u32) {
        if let Some((&s, &l)) = self.by_start.range(..start).next_back()
            && s + l == start
        {
            self.take(s, l);
            start = s;
            len += l;
        }
        if let Some(&l) = self.by_start.get(&(start + len)) {
            self.take(start + len, l);
            len += l;
        }
        self.insert(start, len);
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Allocator {
    containers: Vec<Container>,
    units_per_container: u32,
}

impl Allocator {
    /// All free: `containers` containers of `units` units each.
    #[cfg(test)]
    pub fn new(containers: u32, units: u32) -> Self {
        Self::with_used(containers, units, Vec::new())
    }

    /// Free except `used` extents `(container, start, len)`, which must not overlap (see
    /// [`Allocator::conflicts`]) and must lie inside their containers.
    pub fn with_used(containers: u32, units: u32, mut used: Vec<(u32, u32, u32)>) -> Self {
        used.sort_unstable();
        let mut all: Vec<Container> = (0..containers).map(|_| Container::default()).collect();
        let mut i = 0;
        for (c, container) in all.iter_mut().enumerate() {
            let mut at = 0u32;
            while i < used.len() && used[i].0 == c as u32 {
                let (_, s, l) = used[i];
                if s > at {
                    container.insert(at, s - at);
                }
                at = at.max(s + l);
                i += 1;
            }
            if at < units {
                container.insert(at, units - at);
            }
        }
        Self {
            containers: all,
            units_per_container: units,
        }
    }

    /// Recovery's guard against damaged journals: which of `extents` `(container, start, len)`
    /// to drop so the rest lie inside the region and overlap nothing. In a conflict the extent
    /// with the higher `priority` (the newer generation) is kept. Returns sorted indices.
    pub fn conflicts(
        extents: &[(u32, u32, u32)],
        priority: &[u64],
        containers: u32,
        units: u32,
    ) -> Vec<usize> {
        // The common case (an undamaged journal): everything inside, nothing overlapping —
        // one sort by position tells.
        let mut sorted = extents.to_vec();
        sorted.sort_unstable();
        let clean = sorted.iter().all(|&(c, s, l)| {
            c < containers && l > 0 && s.checked_add(l).is_some_and(|e| e <= units)
        }) && sorted
            .windows(2)
            .all(|w| w[0].0 != w[1].0 || w[0].1 + w[0].2 <= w[1].1);
        if clean {
            return Vec::new();
        }
        let mut order: Vec<usize> = (0..extents.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(priority[*i]));
        let mut kept: BTreeMap<(u32, u32), u32> = BTreeMap::new();
        let mut drop = Vec::new();
        for i in order {
            let (c, s, l) = extents[i];
            let inside = c < containers && l > 0 && s.checked_add(l).is_some_and(|e| e <= units);
            let before = kept
                .range(..=(c, s))
                .next_back()
                .is_some_and(|(&(pc, ps), &pl)| pc == c && ps + pl > s);
            let after = kept
                .range((c, s)..)
                .next()
                .is_some_and(|(&(nc, ns), _)| nc == c && ns < s.saturating_add(l));
            if !inside || before || after {
                drop.push(i);
            } else {
                kept.insert((c, s), l);
            }
        }
        drop.sort_unstable();
        drop
    }

    /// Free units in all containers.
    pub fn free_units(&self) -> u64 {
        self.containers.iter().map(|c| c.free).sum()
    }

    /// Takes `units` contiguous units, trying container `hint % n` first.
    pub fn alloc(&mut self, units: u32, hint: u64) -> Option<(u32, u32)> {
        let n = self.containers.len();
        if n == 0 || units == 0 || units > self.units_per_container {
            return None;
        }
        let first = (hint % n as u64) as usize;
        (0..n).map(|k| (first + k) % n).find_map(|c| {
            self.containers[c]
                .alloc(units)
                .map(|start| (c as u32, start))
        })
    }

    /// Returns an extent.
    pub fn free(&mut self, container: u32, start: u32, units: u32) {
        if let Some(c) = self.containers.get_mut(container as usize) {
            c.free(start, units);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_splits_and_freeing_coalesces() {
        let mut a = Allocator::new(1, 100);
        let x = a.alloc(10, 0).unwrap();
        let y = a.alloc(20, 0).unwrap();
        let z = a.alloc(70, 0).unwrap();
        assert_eq!((x, y, z), ((0, 0), (0, 10), (0, 30)));
        assert_eq!(a.alloc(1, 0), None);
        a.free(0, 0, 10);
        a.free(0, 30, 70);
        assert_eq!(
            a.alloc(15, 0),
            Some((0, 30)),
            "best fit skips the 10-unit hole"
        );
        a.free(0, 10, 20);
        assert_eq!(a.free_units(), 85);
        assert_eq!(a.alloc(30, 0), Some((0, 0)), "0..10 and 10..30 coalesced");
        assert_eq!(a.alloc(101, 0), None);
    }

    #[test]
    fn hints_spread_over_containers_and_used_extents_are_respected() {
        let mut a = Allocator::with_used(3, 10, vec![(1, 2, 3), (0, 0, 10)]);
        assert_eq!(a.free_units(), 20 + 7 - 10);
        assert_eq!(a.alloc(5, 1), Some((1, 5)));
        assert_eq!(a.alloc(2, 1), Some((1, 0)));
        assert_eq!(a.alloc(10, 0), Some((2, 0)), "container 0 is full");
        let extents = [
            (0, 0, 4),
            (0, 2, 4),
            (0, 6, 1),
            (5, 0, 1),
            (0, 8, 3),
            (0, 5, 1),
        ];
        let newest = [1, 9, 1, 1, 1, 1];
        assert_eq!(
            Allocator::conflicts(&extents, &newest, 1, 10),
            vec![0, 3, 4, 5],
            "the newer (0, 2, 4) wins over (0, 0, 4); out-of-range extents go"
        );
    }
}
