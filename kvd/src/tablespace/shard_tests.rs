//! Checkpoints taken while the index changes: recovery from them (and the journal after them)
//! gives back exactly the last value of every key, in the same recency order.

use super::super::{Tablespace, TablespaceConfig};
use super::*;
use crate::long::{LongBlock, WritePermit};
use crate::store::key_hash;
use crate::tablespace::recover::CHECKPOINT;
use std::collections::BTreeMap;

fn ns() -> Namespace {
    Namespace::new("m", "")
}

fn hash(k: u64) -> u128 {
    key_hash(&ns(), &k.to_be_bytes())
}

fn block(k: u64, v: u8) -> LongBlock {
    LongBlock {
        hash: hash(k),
        ns: ns(),
        key: Bytes::copy_from_slice(&k.to_be_bytes()),
        value: Bytes::from(vec![v; 100 + k as usize % 7]),
        metadata: None,
        class: if k.is_multiple_of(3) {
            Retention::Short
        } else {
            Retention::Long
        },
        expires_at: None,
    }
}

fn put(shard: &Shard, model: &mut BTreeMap<u64, u8>, k: u64, v: u8) {
    shard
        .put(block(k, v), WritePermit::unbounded(), 1, false, false)
        .unwrap();
    model.insert(k, v);
}

fn config(dir: &std::path::Path) -> TablespaceConfig {
    let mut c = TablespaceConfig::new(vec![dir.join("l3")], 4 << 20);
    c.io_mode = super::super::IoMode::Buffered;
    c.container_bytes = 1 << 20;
    c.workers_per_shard = 1;
    c.journal_flush = std::time::Duration::from_millis(1);
    c
}

/// The index's keys, least recently used first within each class.
fn order(shard: &Shard) -> Vec<u128> {
    shard.lock().index.iter().map(|(h, _, _)| h).collect()
}

async fn check(shard: &Shard, model: &BTreeMap<u64, u8>, keys: std::ops::Range<u64>) {
    assert_eq!(shard.stats().entries, model.len() as u64);
    for k in keys {
        let got = shard.get(&ns(), &k.to_be_bytes(), hash(k), 1).await;
        let want = model.get(&k).map(|v| block(k, *v).value);
        assert_eq!(got.map(|h| h.value), want, "key {k}");
    }
}

#[tokio::test]
async fn a_checkpoint_walked_while_the_index_changes_recovers_exactly_the_last_values() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let ts = Tablespace::open(&c).unwrap();
    let shard = ts.shards[0].clone();
    let mut model = BTreeMap::new();
    for k in 0..200 {
        put(&shard, &mut model, k, 1);
    }
    let mut chunks = 0;
    shard
        .checkpoint_in_chunks(16, |n| {
            chunks += 1;
            let n = n as u64;
            // Between chunks: a key ahead of the walk leaves (its position is then reused by
            // the next put, a new generation the walk must skip), a key already walked gets a
            // new value, a new key arrives.
            let ahead = 199 - n;
            assert!(shard.remove(hash(ahead)));
            model.remove(&ahead);
            put(&shard, &mut model, n * 16, 2);
            put(&shard, &mut model, 1000 + n, 3);
        })
        .unwrap();
    assert_eq!(chunks, 13, "200 positions in chunks of 16");
    assert!(dir.path().join("l3").join(CHECKPOINT).exists());
    // After the checkpoint: more history, in the segment recovery replays over it.
    assert!(shard.remove(hash(1)));
    model.remove(&1);
    put(&shard, &mut model, 2, 4);
    let before = order(&shard);
    // A crash: no close, no final checkpoint.
    drop(shard);
    drop(ts);

    let ts = Tablespace::open(&c).unwrap();
    let shard = ts.shards[0].clone();
    assert_eq!(order(&shard), before);
    check(&shard, &model, 0..1100).await;
}

#[tokio::test]
async fn a_quiet_checkpoint_keeps_the_recency_order() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let ts = Tablespace::open(&c).unwrap();
    let shard = ts.shards[0].clone();
    let mut model = BTreeMap::new();
    for k in 0..50 {
        put(&shard, &mut model, k, 1);
    }
    for k in [7u64, 3, 30, 0] {
        assert!(
            shard
                .get(&ns(), &k.to_be_bytes(), hash(k), 1)
                .await
                .is_some()
        );
    }
    let before = order(&shard);
    shard.checkpoint().unwrap();
    drop(shard);
    drop(ts);

    // Only the checkpoint: its segment has no records.
    let ts = Tablespace::open(&c).unwrap();
    let shard = ts.shards[0].clone();
    assert_eq!(order(&shard), before);
    check(&shard, &model, 0..60).await;
}
