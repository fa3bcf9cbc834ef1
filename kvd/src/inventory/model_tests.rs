//! Model-based: random writes of every class (with and without TTLs), reads, clears and time
//! steps against the tiered store, L2 alone and L2 over an L3 tablespace; after each step (and
//! a sweep, which the daemon runs every second) the blocks the recorded changes say each tier
//! holds, folded as the router folds them, are exactly the blocks the store holds, but for the
//! blocks of other namespaces that a namespace `clear` made the router forget (it is published
//! as one `AllBlocksCleared`) until they are written again. The router never believes in a
//! block the store does not hold.

use super::*;
use crate::long::{self, LongBackendConfig, LongStore};
use crate::proto::SetItem;
use crate::store::Store;
use crate::tablespace::{IoMode, TablespaceConfig};
use infera_core::event::Retention;
use proptest::prelude::*;
use std::collections::BTreeSet;

const KEYS: u8 = 12;

#[derive(Debug, Clone)]
enum Op {
    Set {
        key: u8,
        len: usize,
        class: Retention,
        ttl: Option<f64>,
    },
    Get(u8),
    Advance(u64),
    Clear {
        all: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let class = prop::sample::select(Retention::ALL.to_vec());
    prop_oneof![
        6 => (0..KEYS, 1usize..6000, class, prop::option::weighted(0.2, 0.001f64..3.0))
            .prop_map(|(key, len, class, ttl)| Op::Set { key, len, class, ttl }),
        2 => (0..KEYS).prop_map(Op::Get),
        1 => (0u64..2000).prop_map(Op::Advance),
        1 => any::<bool>().prop_map(|all| Op::Clear { all }),
    ]
}

fn ns(key: u8) -> Namespace {
    // Two namespaces, so that a namespace clear leaves the other's blocks.
    Namespace::new(if key.is_multiple_of(2) { "even" } else { "odd" }, "")
}

fn name(key: u8) -> u64 {
    inventory_hash(&ns(key).model, "", &[key]).0
}

/// What the router knows of the kvd: blocks per tier (`[L2, L3]`).
#[derive(Debug, Default)]
struct View([BTreeSet<u64>; 2]);

fn slot(tier: Tier) -> usize {
    match tier {
        Tier::Host => 0,
        Tier::Disk => 1,
        other => panic!("{other:?} from L2 and L3"),
    }
}

impl View {
    /// Applies the waiting changes; the blocks they store, per tier.
    fn fold(&mut self, recorder: &Recorder) -> [BTreeSet<u64>; 2] {
        let mut changes = Vec::new();
        if recorder.drain(&mut changes).clear {
            *self = View::default();
        }
        let mut stored: [BTreeSet<u64>; 2] = Default::default();
        for c in changes {
            let i = slot(c.tier);
            match c.kind {
                ChangeKind::Stored => {
                    stored[i].insert(c.hash);
                    self.0[i].insert(c.hash)
                }
                ChangeKind::Removed => self.0[i].remove(&c.hash),
            };
        }
        stored
    }
}

/// Whether each tier (`[L2, L3]`) holds `key` at `now`.
fn holds(store: &Store, long: Option<&Arc<dyn LongStore>>, key: u8, now: u64) -> [bool; 2] {
    let hash = crate::store::key_hash(&ns(key), &[key]);
    [
        store.l2_holds(&ns(key), &[key], now),
        long.is_some_and(|l| l.class_of(hash, now).is_some()),
    ]
}

async fn run(ops: Vec<Op>, long: Option<Arc<dyn LongStore>>) -> Result<(), TestCaseError> {
    let recorder = Arc::new(Recorder::default());
    let store = Store::new(24 << 10, None, long.clone())
        .with_inventory(Inventory::recording(recorder.clone()));
    let mut view = View::default();
    // Per tier, the keys it held when a namespace clear made the router forget them, not
    // stored in it since.
    let mut forgotten: [BTreeSet<u8>; 2] = Default::default();
    let mut now = 1_000u64;
    for op in ops {
        match op {
            Op::Set {
                key,
                len,
                class,
                ttl,
            } => {
                let mut item = SetItem::new(vec![key], vec![key; len]).retention(class);
                item.ttl_seconds = ttl;
                store.set(&ns(key), &item, now).await;
            }
            Op::Get(key) => {
                let key = bytes::Bytes::from(vec![key]);
                store.get(&ns(key[0]), &key, now, false).await;
            }
            Op::Advance(ms) => now += ms,
            Op::Clear { all } => {
                let cleared = if all { Namespace::new("", "") } else { ns(0) };
                store.clear(&cleared);
                for (i, keys) in forgotten.iter_mut().enumerate() {
                    *keys = (0..KEYS)
                        .filter(|k| holds(&store, long.as_ref(), *k, now)[i])
                        .collect();
                }
            }
        }
        store.sweep(now);
        let stored = view.fold(&recorder);
        let stats = store.stats();
        let entries = [stats.entries, stats.long.entries];
        for i in 0..2 {
            forgotten[i].retain(|k| !stored[i].contains(&name(*k)));
            let named = view.0[i].len() as u64;
            prop_assert!(named <= entries[i], "tier {}: {} named", i, named);
            if forgotten[i].is_empty() {
                prop_assert_eq!(named, entries[i], "tier {}", i);
            }
        }
        for key in 0..KEYS {
            let held = holds(&store, long.as_ref(), key, now);
            for i in 0..2 {
                let named = view.0[i].contains(&name(key));
                prop_assert!(!named || held[i], "tier {}: key {} named, not held", i, key);
                prop_assert!(
                    named || !held[i] || forgotten[i].contains(&key),
                    "tier {}: key {} held, not named",
                    i,
                    key
                );
            }
        }
    }
    if let Some(long) = long {
        long.close()
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_recorded_changes_fold_to_what_l2_holds(ops in prop::collection::vec(op(), 1..60)) {
        runtime().block_on(run(ops, None))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn the_recorded_changes_fold_to_what_l2_and_l3_hold(
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut config = TablespaceConfig::new(vec![dir.path().join("l3")], 64 << 10);
        config.io_mode = IoMode::Buffered;
        config.container_bytes = 64 << 10;
        config.workers_per_shard = 1;
        config.io_uring = false;
        let rt = runtime();
        let long = rt
            .block_on(long::open(&LongBackendConfig::Tablespace(config)))
            .unwrap_or_else(|e| panic!("{e}"));
        rt.block_on(run(ops, Some(long)))?;
    }
}
