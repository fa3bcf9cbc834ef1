//! L3 write back-pressure cannot deadlock: batches of `long` writes larger than the write queue,
//! alone or many at once, are answered, and later writes still go through (issue 15's two
//! reproductions, in process, each under a deadline so a regression fails instead of hanging).

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::Daemon;
use infera_core::event::Retention;
use infera_kvd::{IoMode, KvdOptions, LongBackendConfig, Namespace, SetItem, TablespaceConfig};
use std::path::Path;
use std::time::Duration;

/// Far longer than the work takes on a loaded CI machine; reached only by a hang.
const DEADLINE: Duration = Duration::from_secs(120);

fn ns() -> Namespace {
    Namespace::new("m", "")
}

/// L3 with the default write queue (256 MiB = 65,536 permits of 4 KiB).
fn with_l3(o: &mut KvdOptions, dir: &Path) {
    o.max_bytes = 64 << 20;
    o.max_frame_bytes = 64 << 20;
    let mut ts = TablespaceConfig::new(vec![dir.join("l3")], 128 << 20);
    ts.io_mode = IoMode::Buffered;
    ts.container_bytes = 32 << 20;
    ts.workers_per_shard = 2;
    o.long = Some(LongBackendConfig::Tablespace(ts));
}

fn long_items(prefix: u32, n: u32, len: usize) -> Vec<SetItem> {
    (0..n)
        .map(|i| {
            let mut key = prefix.to_be_bytes().to_vec();
            key.extend_from_slice(&i.to_be_bytes());
            SetItem::new(Bytes::from(key), vec![(i % 251) as u8; len]).retention(Retention::Long)
        })
        .collect()
}

/// A `long` write after the batches still completes (no permit leaked or stuck).
async fn a_later_long_write_completes(daemon: &Daemon) {
    let mut c = daemon.client().await;
    let item = SetItem::new(&b"after"[..], vec![7u8; 4096]).retention(Retention::Long);
    let ack = tokio::time::timeout(DEADLINE, c.set(&ns(), item))
        .await
        .expect("a long write after the batches hangs")
        .unwrap();
    assert!(ack.accepted, "{ack:?}");
    assert_eq!(
        c.get(&ns(), b"after").await.unwrap().unwrap().value.len(),
        4096
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_of_more_items_than_write_permits_is_answered() {
    let daemon = Daemon::start(with_l3).await;
    let mut c = daemon.client().await;
    let items = long_items(1, 70_000, 1);
    let acks = tokio::time::timeout(DEADLINE, c.batch_set(&ns(), items))
        .await
        .expect("a batch_set of 70,000 one-byte long items never got its reply")
        .unwrap();
    assert_eq!(acks.len(), 70_000);
    assert!(
        acks.iter().all(|a| a.accepted),
        "{:?}",
        acks.iter().find(|a| !a.accepted)
    );
    // Acknowledged before their blocks land (writes are not durable here): each one is
    // written, or refused by L3 when every block it could evict was still being written
    // (70,000 blocks do not fit its 128 MiB; such a block stays in RAM only).
    let settled = async {
        loop {
            let stats = c.stats(true).await.unwrap().extended.unwrap();
            let settled = stats.l3_writes_total + stats.l3_rejected_total;
            if settled >= 70_000 {
                return (settled, stats.l3_writes_total);
            }
        }
    };
    let (settled, written) = tokio::time::timeout(DEADLINE, settled)
        .await
        .expect("acknowledged long writes were never all written or refused by L3");
    assert_eq!(settled, 70_000);
    assert!(written > 0);
    a_later_long_write_completes(&daemon).await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_that_together_exceed_the_write_queue_are_answered() {
    let daemon = Daemon::start(with_l3).await;
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(daemon.client().await);
    }
    let batches = clients
        .into_iter()
        .enumerate()
        .map(|(b, mut c)| async move {
            let acks = c
                .batch_set(&ns(), long_items(100 + b as u32, 2_500, 16 << 10))
                .await
                .unwrap();
            (acks.len(), acks.iter().filter(|a| a.accepted).count())
        });
    let done = tokio::time::timeout(DEADLINE, futures::future::join_all(batches))
        .await
        .expect("8 concurrent batch_sets of 2,500 x 16 KiB long blocks never got their replies");
    assert_eq!(done, vec![(2_500, 2_500); 8]);
    a_later_long_write_completes(&daemon).await;
    daemon.stop().await;
}
