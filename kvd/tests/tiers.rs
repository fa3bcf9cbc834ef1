//! The daemon with its L3 tier, over the socket: long blocks survive a restart, short blocks
//! spill when L2 evicts them, `none` and `ephemeral` never reach the disk, and a
//! `prefetch_hint` promotes L3 blocks into L2 before its deadline.

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::Daemon;
use infera_core::event::Retention;
use infera_kvd::{IoMode, KvdOptions, LongBackendConfig, Namespace, SetItem, TablespaceConfig};
use std::path::Path;

fn ns() -> Namespace {
    Namespace::new("m", "")
}

fn key(i: u32) -> Bytes {
    Bytes::copy_from_slice(&i.to_be_bytes())
}

fn with_l3(o: &mut KvdOptions, dir: &Path) {
    // L2 holds about four 64 KiB values; L3 many more.
    o.max_bytes = 4 * (65536 + 200);
    let mut ts = TablespaceConfig::new(vec![dir.join("l3")], 16 << 20);
    ts.io_mode = IoMode::Buffered;
    ts.container_bytes = 4 << 20;
    ts.workers_per_shard = 2;
    o.long = Some(LongBackendConfig::Tablespace(ts));
}

fn marked(i: u32, class: Retention) -> Vec<u8> {
    let mut v = vec![i as u8; 65536];
    if class < Retention::Short {
        v[..8].copy_from_slice(b"NODISK!!");
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_spill_persist_and_keep_none_off_disk() {
    let daemon = Daemon::start(with_l3).await;
    let mut c = daemon.client().await;
    let classes = [
        Retention::None,
        Retention::Ephemeral,
        Retention::Short,
        Retention::Long,
    ];
    for i in 0..40u32 {
        // Lower classes may be refused once L2 holds only higher ones; long never is.
        let class = classes[i as usize % 4];
        let item = SetItem::new(key(i), marked(i, class)).retention(class);
        let ack = c.set(&ns(), item).await.unwrap();
        assert!(ack.accepted || class < Retention::Long, "{ack:?}");
    }
    let stats = c.stats(true).await.unwrap();
    let ext = stats.extended.clone().unwrap();
    assert!(
        ext.l3_spills_total > 0,
        "evicted short blocks spill: {ext:?}"
    );
    assert_eq!(
        stats.long_bytes,
        10 * 65536,
        "every long block is written through"
    );
    assert!(stats.spillover_bytes > 0 && stats.spillover_bytes <= 10 * 65536);
    // Long and spilled short blocks come back from L3; none/ephemeral ones are simply gone.
    for i in 0..40u32 {
        let got = c.get(&ns(), &key(i)).await.unwrap();
        match classes[i as usize % 4] {
            Retention::Long => assert_eq!(got.unwrap().value, marked(i, Retention::Long)),
            _ => {
                if let Some(hit) = got {
                    assert_eq!(hit.value, marked(i, classes[i as usize % 4]));
                }
            }
        }
    }
    let dir = daemon.stop().await;
    let on_disk = std::fs::read_dir(dir.path().join("l3")).unwrap().any(|e| {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        bytes.windows(8).any(|w| w == b"NODISK!!")
    });
    assert!(!on_disk, "a none or ephemeral block reached the disk");

    // A restart (same directory) keeps every long block.
    let daemon = Daemon::start(|o, _| with_l3(o, dir.path())).await;
    let mut c = daemon.client().await;
    assert!(c.stats(true).await.unwrap().extended.unwrap().l3_entries >= 10);
    for i in (3..40u32).step_by(4) {
        let hit = c.get(&ns(), &key(i)).await.unwrap().unwrap();
        assert_eq!(
            (hit.value.len(), hit.retention),
            (65536, Some(Retention::Long))
        );
    }
    daemon.stop().await;
    drop(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_hints_promote_l3_blocks_before_their_deadline() {
    let daemon = Daemon::start(with_l3).await;
    let mut c = daemon.client().await;
    for i in 0..12u32 {
        let item = SetItem::new(key(i), marked(i, Retention::Long)).retention(Retention::Long);
        assert!(c.set(&ns(), item).await.unwrap().accepted);
    }
    // A restart empties L2 and leaves every block in L3 only, with no write still in flight
    // (an in-flight block would be answered from memory, not read back).
    let dir = daemon.stop().await;
    let mut daemon = Daemon::start(|o, _| with_l3(o, dir.path())).await;
    let mut c = daemon.client().await;
    let before = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(before.class_entries[Retention::Long as usize], 0);
    assert_eq!(before.l3_entries, 12);
    let seen = *daemon.prefetches.borrow_and_update();
    c.prefetch_hint(&ns(), (0..4).map(key).collect(), 5000)
        .await
        .unwrap();
    daemon.prefetches.wait_for(|n| *n > seen).await.unwrap();
    let after = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(after.prefetch_hints_total, 1, "{after:?}");
    assert_eq!(after.prefetch_promoted_total, 4, "{after:?}");
    assert_eq!(after.l3_reads_total, before.l3_reads_total + 4);
    // Served from RAM now: no further disk read.
    for i in 0..4u32 {
        let hit = c.get(&ns(), &key(i)).await.unwrap().unwrap();
        assert_eq!(hit.value, marked(i, Retention::Long));
    }
    let last = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(last.l3_reads_total, after.l3_reads_total);
    // A hint whose deadline passed before it could run is dropped and counted.
    let seen = *daemon.prefetches.borrow_and_update();
    c.prefetch_hint(&ns(), (4..8).map(key).collect(), 0)
        .await
        .unwrap();
    daemon.prefetches.wait_for(|n| *n > seen).await.unwrap();
    let ext = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(ext.prefetch_dropped_total, 1);
    daemon.stop().await;
    drop(dir);
}
