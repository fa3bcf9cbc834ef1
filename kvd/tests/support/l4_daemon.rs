//! The two halves of a round trip through an L4 and kvd's socket (`l4_redis`, `l4_s3`): blocks
//! written through one daemon, then a fresh daemon over the same store whose prefetch hint
//! reaches them. Between the two a test looks at its store's own layout.

#![allow(dead_code, clippy::unwrap_used)]

use crate::common::Daemon;
use crate::l4_outage::key;
use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::L4Config;
use infera_kvd::{KvdClient, LongBackendConfig, Namespace, SetItem};

/// Writes `values` as the `long` blocks `key(i)` of `ns` through a daemon with `l4`, and stops
/// it: its shutdown drains the write-behind queue, so every block is in the store.
pub async fn write_through_a_daemon(l4: &L4Config, ns: &Namespace, values: &[Bytes]) {
    let daemon = Daemon::start(|o, _| o.long = Some(LongBackendConfig::L4(l4.clone()))).await;
    let mut client = daemon.client().await;
    for (i, v) in values.iter().enumerate() {
        let item = SetItem::new(key(i), v.clone()).retention(Retention::Long);
        assert!(client.set(ns, item).await.unwrap().accepted);
    }
    daemon.stop().await;
}

/// A fresh daemon with `l4` and a client of it, after a prefetch hint (what the server's
/// `/v1/cache/prewarm` sends) for the first three blocks of `ns` promoted them from L4 to L2.
pub async fn a_fresh_daemon_prefetching_three(
    l4: &L4Config,
    ns: &Namespace,
) -> (Daemon, KvdClient) {
    let mut fresh = Daemon::start(|o, _| o.long = Some(LongBackendConfig::L4(l4.clone()))).await;
    let mut client = fresh.client().await;
    let seen = *fresh.prefetches.borrow_and_update();
    let hinted: Vec<Bytes> = (0..3).map(|i| Bytes::from(key(i))).collect();
    client.prefetch_hint(ns, hinted, 5000).await.unwrap();
    fresh.prefetches.wait_for(|n| *n > seen).await.unwrap();
    let stats = client.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(stats.prefetch_promoted_total, 3, "{stats:?}");
    assert_eq!(stats.class_entries[Retention::Long as usize], 3);
    (fresh, client)
}
