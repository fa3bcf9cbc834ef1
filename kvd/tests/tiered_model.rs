//! Model-based test of the tiered store (L2, optionally with the shared arena, over the L3
//! tablespace): random writes of every class with and without TTLs, reads, time steps, sweeps,
//! flushes and restarts of the L3 tier (L2 starts empty again, as after a daemon restart),
//! against a reference that knows, per full key, the last accepted value, its class and expiry.
//!
//! Checked after every read: the value is the last accepted one for that key or nothing —
//! never an older value, never another key's bytes, never a value past its TTL. A write
//! refused as a downgrade must really be lower than a live entry of the key. And `none` and
//! `ephemeral` values never reach the disk: the test scans the region's files for their bytes.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::arena::Arena;
use infera_kvd::long::{self, LongStore};
use infera_kvd::store::{REASON_DOWNGRADE, Store};
use infera_kvd::{IoMode, LongBackendConfig, Namespace, SetItem, TablespaceConfig};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, Clone)]
enum Op {
    Set {
        ns: u8,
        key: u8,
        len: usize,
        class: Retention,
        ttl_ms: Option<u64>,
    },
    Get {
        ns: u8,
        key: u8,
    },
    Advance(u64),
    Sweep,
    Flush,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let class = prop::sample::select(Retention::ALL.to_vec());
    prop_oneof![
        8 => (0u8..2, 0u8..24, 16usize..20_000, class, prop::option::weighted(0.2, 1u64..60))
            .prop_map(|(ns, key, len, class, ttl_ms)| Op::Set { ns, key, len, class, ttl_ms }),
        6 => (0u8..2, 0u8..24).prop_map(|(ns, key)| Op::Get { ns, key }),
        2 => (1u64..40).prop_map(Op::Advance),
        1 => Just(Op::Sweep),
        1 => Just(Op::Flush),
        1 => Just(Op::Restart),
    ]
}

fn namespace(i: u8) -> Namespace {
    Namespace::new("m", if i == 0 { "" } else { "fp8" })
}

/// Bytes that name their key and write, so a wrong read is visible; `none`/`ephemeral` values
/// carry a marker the disk scan looks for.
fn value(ns: u8, key: u8, seq: u32, len: usize, class: Retention) -> Bytes {
    let fill = if class < Retention::Short { 0xEE } else { key };
    let mut v = vec![fill; len.max(16)];
    v[..4].copy_from_slice(&seq.to_le_bytes());
    v[4] = ns;
    v[5] = key;
    if class < Retention::Short {
        v[6..14].copy_from_slice(b"NODISK!!");
    }
    Bytes::from(v)
}

#[derive(Debug, Clone)]
struct Known {
    value: Bytes,
    class: Retention,
    expires_at: Option<u64>,
}

fn ts_config(dir: &Path) -> TablespaceConfig {
    let mut c = TablespaceConfig::new(vec![dir.join("l3")], 256 << 10);
    c.io_mode = IoMode::Buffered;
    c.container_bytes = 256 << 10;
    c.workers_per_shard = 2;
    c.journal_flush = std::time::Duration::from_millis(1);
    c
}

async fn store(dir: &Path, arena: bool) -> (Store, Arc<dyn LongStore>) {
    let long = long::open(&LongBackendConfig::Tablespace(ts_config(dir)))
        .await
        .unwrap();
    let arena = arena.then(|| Arc::new(Arena::new(48 << 10, Some(8 << 10)).unwrap()));
    (Store::new(96 << 10, arena, Some(long.clone())), long)
}

fn scan_for_marker(dir: &Path) -> bool {
    std::fs::read_dir(dir.join("l3")).unwrap().any(|e| {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        bytes.windows(8).any(|w| w == b"NODISK!!")
    })
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn run(ops: Vec<Op>, arena: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, mut long) = store(dir.path(), arena).await;
    let mut known: HashMap<(u8, u8), Known> = HashMap::new();
    let mut now = wall_ms();
    let mut seq = 0u32;
    for op in ops {
        match op {
            Op::Set {
                ns,
                key,
                len,
                class,
                ttl_ms,
            } => {
                seq += 1;
                let v = value(ns, key, seq, len, class);
                let mut item = SetItem::new(vec![key], v.clone()).retention(class);
                if let Some(ms) = ttl_ms {
                    item = item.ttl_seconds(ms as f64 / 1000.0);
                }
                let ack = store.set(&namespace(ns), &item, now).await;
                let live = known
                    .get(&(ns, key))
                    .filter(|k| k.expires_at.is_none_or(|t| t > now));
                match ack.reason.as_deref() {
                    None => {
                        prop_assert!(ack.accepted);
                        known.insert(
                            (ns, key),
                            Known {
                                value: v,
                                class,
                                expires_at: ttl_ms.map(|ms| now + ms),
                            },
                        );
                    }
                    Some(REASON_DOWNGRADE) => {
                        let k = live.expect("a downgrade needs a live entry");
                        prop_assert!(class < k.class, "refused although not lower");
                    }
                    Some(_) => {}
                }
            }
            Op::Get { ns, key } => {
                let got = store
                    .get(&namespace(ns), &Bytes::from(vec![key]), now, false)
                    .await;
                if let Some(infera_kvd::store::Got::Bytes(v, class)) = got {
                    let k = known.get(&(ns, key));
                    prop_assert!(k.is_some(), "a value for a key never written");
                    let k = k.unwrap();
                    prop_assert_eq!(&v[..6], &k.value[..6], "not the last accepted value");
                    prop_assert_eq!(&v, &k.value);
                    prop_assert_eq!(class, k.class);
                    prop_assert!(
                        k.expires_at.is_none_or(|t| t > now),
                        "returned past its TTL"
                    );
                }
            }
            Op::Advance(ms) => now += ms,
            Op::Sweep => {
                store.sweep(now);
            }
            Op::Flush => long.flush().await.unwrap(),
            Op::Restart => {
                long.close().await.unwrap();
                drop(store);
                drop(long);
                (store, long) = self::store(dir.path(), arena).await;
            }
        }
        if let Err(e) = store.check_consistency() {
            prop_assert!(false, "inconsistent: {}", e);
        }
    }
    long.close().await.unwrap();
    prop_assert!(
        !scan_for_marker(dir.path()),
        "a none/ephemeral value reached the disk"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]
    #[test]
    fn the_tiered_store_matches_the_reference(
        ops in prop::collection::vec(op(), 1..120),
        arena in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(ops, arena))?;
    }
}

/// The model above only means something if its runs reach every path: a long deterministic
/// run must spill, evict on disk, read back from disk after restarts and hit the arena.
#[test]
fn a_long_run_exercises_every_tier() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let ops: Vec<Op> = (0..3000)
        .map(|_| op().new_tree(&mut runner).unwrap().current())
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let (store, long) = store(dir.path(), true).await;
        let mut now = wall_ms();
        let mut reads = 0;
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Set {
                    ns,
                    key,
                    len,
                    class,
                    ttl_ms,
                } => {
                    let mut item = SetItem::new(vec![key], value(ns, key, i as u32, len, class))
                        .retention(class);
                    if let Some(ms) = ttl_ms {
                        item = item.ttl_seconds(ms as f64 / 1000.0);
                    }
                    store.set(&namespace(ns), &item, now).await;
                }
                Op::Get { ns, key } => {
                    store
                        .get(&namespace(ns), &Bytes::from(vec![key]), now, false)
                        .await;
                }
                Op::Advance(ms) => now += ms,
                Op::Sweep => {
                    store.sweep(now);
                }
                Op::Flush | Op::Restart => {
                    long.flush().await.unwrap();
                    reads = long.stats().reads_total;
                }
            }
        }
        let s = store.stats();
        assert!(s.long.spills_total > 20, "{s:?}");
        assert!(s.long.evictions_total > 5, "{s:?}");
        assert!(reads > 20 || s.long.reads_total > 20, "{s:?}");
        assert!(s.arena.entries > 0, "{s:?}");
        assert!(s.hits_total > 100 && s.misses_total > 100, "{s:?}");
        long.close().await.unwrap();
    });
}
