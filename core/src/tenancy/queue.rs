//! The order in which waiting requests leave the router's queue: strictly by priority (a lower
//! number first, as vLLM's `priority`), and within one priority by weighted fair share between
//! tenants: deficit round robin on each request's cost (its prompt tokens).
//!
//! # Deficit round robin
//! Each tenant with waiting requests has a lane; the lanes of a priority take turns. On its
//! turn a lane is credited `quantum × weight` and serves its oldest requests while their cost
//! fits its credit, then passes the turn on, keeping what is left for its next turn. A lane
//! that empties leaves the round and forgets its credit. So over a busy period each backlogged
//! tenant's served cost follows its weight, within one quantum and one request; none starves,
//! whatever the others' weights: a lane is served at least once per round. Within a lane
//! requests leave in arrival order.
//!
//! A waiter that gives up (its client went away, its deadline passed) leaves with
//! [`FairQueue::remove`].

use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// The credit a tenant's lane gets per turn, per unit of weight, in prompt tokens, in the
/// router's queue and `infera replay`'s: small against a prefill budget, so tenants' requests
/// interleave finely.
pub const QUANTUM: u64 = 512;

/// A queued request's handle, for [`FairQueue::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Place(u64);

#[derive(Debug)]
struct Entry<T> {
    place: Place,
    cost: u64,
    item: T,
}

#[derive(Debug)]
struct Lane<T> {
    weight: u64,
    credit: u64,
    entries: VecDeque<Entry<T>>,
}

#[derive(Debug)]
struct Level<T> {
    /// Tenants with waiting requests, the one whose turn it is first.
    turn: VecDeque<Arc<str>>,
    /// Whether the first lane has had its credit for this turn.
    credited: bool,
    lanes: FxHashMap<Arc<str>, Lane<T>>,
}

impl<T> Default for Level<T> {
    fn default() -> Self {
        Level {
            turn: VecDeque::new(),
            credited: false,
            lanes: FxHashMap::default(),
        }
    }
}

/// Waiting requests by priority and tenant. See the module docs.
#[derive(Debug)]
pub struct FairQueue<T> {
    levels: BTreeMap<i32, Level<T>>,
    places: FxHashMap<Place, (i32, Arc<str>)>,
    next: u64,
    quantum: u64,
}

impl<T> FairQueue<T> {
    /// A queue crediting `quantum × weight` per turn (at least 1).
    pub fn new(quantum: u64) -> Self {
        FairQueue {
            levels: BTreeMap::new(),
            places: FxHashMap::default(),
            next: 0,
            quantum: quantum.max(1),
        }
    }

    /// Waiting requests.
    pub fn len(&self) -> usize {
        self.places.len()
    }

    pub fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    /// Queues `item` of `tenant` (whose weight is `weight`, at least 1) at `priority`, costing
    /// `cost` (at least 1).
    pub fn push(
        &mut self,
        priority: i32,
        tenant: &Arc<str>,
        weight: u32,
        cost: u64,
        item: T,
    ) -> Place {
        let place = Place(self.next);
        self.next += 1;
        let level = self.levels.entry(priority).or_default();
        let lane = level.lanes.entry(Arc::clone(tenant)).or_insert_with(|| {
            level.turn.push_back(Arc::clone(tenant));
            Lane {
                weight: 1,
                credit: 0,
                entries: VecDeque::new(),
            }
        });
        lane.weight = u64::from(weight.max(1));
        lane.entries.push_back(Entry {
            place,
            cost: cost.max(1),
            item,
        });
        self.places.insert(place, (priority, Arc::clone(tenant)));
        place
    }

    /// The next request to leave, per the module docs.
    pub fn pop(&mut self) -> Option<T> {
        self.pop_with_place().map(|(_, item)| item)
    }

    /// [`FairQueue::pop`], with the place the request had.
    pub fn pop_with_place(&mut self) -> Option<(Place, T)> {
        let mut first = self.levels.first_entry()?;
        let level = first.get_mut();
        let entry = loop {
            let tenant = level.turn.front()?;
            let lane = level.lanes.get_mut(tenant)?;
            if !level.credited {
                lane.credit = lane.credit.saturating_add(self.quantum * lane.weight);
                level.credited = true;
            }
            let cost = lane.entries.front()?.cost;
            if cost <= lane.credit {
                lane.credit -= cost;
                let entry = lane.entries.pop_front()?;
                if lane.entries.is_empty() {
                    level.lanes.remove(tenant);
                    level.turn.pop_front();
                    level.credited = false;
                }
                break entry;
            }
            level.turn.rotate_left(1);
            level.credited = false;
        };
        if level.turn.is_empty() {
            first.remove();
        }
        self.places.remove(&entry.place);
        Some((entry.place, entry.item))
    }

    /// Takes a waiting request out; `None` when it already left.
    pub fn remove(&mut self, place: Place) -> Option<T> {
        let (priority, tenant) = self.places.remove(&place)?;
        let level = self.levels.get_mut(&priority)?;
        let lane = level.lanes.get_mut(&tenant)?;
        let at = lane.entries.iter().position(|e| e.place == place)?;
        let entry = lane.entries.remove(at)?;
        if lane.entries.is_empty() {
            level.lanes.remove(&tenant);
            let at = level.turn.iter().position(|t| *t == tenant);
            if at == Some(0) {
                level.credited = false;
            }
            if let Some(at) = at {
                level.turn.remove(at);
            }
            if level.turn.is_empty() {
                self.levels.remove(&priority);
            }
        }
        Some(entry.item)
    }

    /// Waiting requests per tenant, for the metrics.
    pub fn waiting_by_tenant(&self) -> FxHashMap<Arc<str>, usize> {
        let mut out: FxHashMap<Arc<str>, usize> = FxHashMap::default();
        for (_, tenant) in self.places.values() {
            *out.entry(Arc::clone(tenant)).or_default() += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn a_more_urgent_priority_always_leaves_first() {
        let mut q = FairQueue::new(100);
        q.push(5, &name("a"), 1, 10, "late");
        q.push(-1, &name("b"), 1, 10, "urgent");
        q.push(0, &name("a"), 100, 10, "normal");
        assert_eq!(q.pop(), Some("urgent"));
        assert_eq!(q.pop(), Some("normal"));
        assert_eq!(q.pop(), Some("late"));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn shares_follow_weights_and_arrival_order_holds_within_a_tenant() {
        let mut q = FairQueue::new(10);
        let (a, b) = (name("a"), name("b"));
        for i in 0..40 {
            q.push(0, &a, 3, 10, ("a", i));
            q.push(0, &b, 1, 10, ("b", i));
        }
        let first: Vec<_> = (0..40).map(|_| q.pop().unwrap()).collect();
        let served_a = first.iter().filter(|(t, _)| *t == "a").count();
        assert_eq!(served_a, 30, "3:1 while both wait");
        let order: Vec<_> = first
            .iter()
            .filter(|(t, _)| *t == "a")
            .map(|x| x.1)
            .collect();
        assert_eq!(order, (0..30).collect::<Vec<_>>());
    }

    #[test]
    fn a_removed_waiter_leaves_and_its_lane_with_it() {
        let mut q = FairQueue::new(10);
        let a = q.push(0, &name("a"), 1, 5, 1);
        let b = q.push(0, &name("b"), 1, 5, 2);
        assert_eq!(q.remove(a), Some(1));
        assert_eq!(q.remove(a), None);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(), Some(2));
        assert_eq!(q.remove(b), None);
        assert!(q.is_empty());
        assert!(q.levels.is_empty());
    }

    proptest! {
        /// A backlogged weight-1 tenant is never starved behind weight-10 ones, whatever the
        /// arrival order and costs: between two of its services the others are served at most
        /// one turn's credit each (quantum × weight, plus one request's cost carried over).
        #[test]
        fn no_backlogged_tenant_starves(
            arrivals in proptest::collection::vec((1usize..4, 1u64..500), 1..300),
        ) {
            let quantum = 500;
            let weights = [1u32, 10, 10, 10];
            let names: Vec<Arc<str>> = (0..4).map(|i| name(&format!("t{i}"))).collect();
            let mut q = FairQueue::new(quantum);
            // The weight-1 tenant is backlogged throughout with requests that each take most
            // of its turn's credit.
            for _ in 0..300 {
                q.push(0, &names[0], weights[0], 400, (0usize, 400u64));
            }
            for (t, cost) in &arrivals {
                q.push(0, &names[*t], weights[*t], *cost, (*t, *cost));
            }
            let bound = 3 * (quantum * 10 + 500);
            let mut others = 0;
            while let Some((t, cost)) = q.pop() {
                if t == 0 {
                    others = 0;
                } else {
                    others += cost;
                    prop_assert!(others <= bound, "{others} served past a backlogged tenant");
                }
            }
        }

        /// Two equal-weight backlogged tenants get equal served cost, within one quantum and
        /// one request.
        #[test]
        fn equal_weights_get_equal_shares(
            a_costs in proptest::collection::vec(1u64..800, 50..100),
            b_costs in proptest::collection::vec(1u64..800, 50..100),
        ) {
            let quantum = 256;
            let mut q = FairQueue::new(quantum);
            let (a, b) = (name("a"), name("b"));
            for c in &a_costs { q.push(0, &a, 1, *c, (0, *c)); }
            for c in &b_costs { q.push(0, &b, 1, *c, (1, *c)); }
            let mut served = [0u64; 2];
            let mut left = [a_costs.len(), b_costs.len()];
            while let Some((t, c)) = q.pop() {
                served[t] += c;
                left[t] -= 1;
                if left[0] > 0 && left[1] > 0 {
                    prop_assert!(served[0].abs_diff(served[1]) <= quantum + 800);
                }
            }
        }
    }
}
