//! The outage every real L4 store is put through (`l4_redis`, `l4_mooncake`): blocks written
//! through an L4 over the store, the store killed mid-run, SETs and GETs going on (no client
//! error), the breaker opening; the store restarted, the breaker closing and writes landing
//! again; and a fresh L4 over the restarted store reading the new write back byte-exact while a
//! block written during the outage reads as a miss.

#![allow(dead_code, clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::{L4, L4Options, RemoteStore};
use infera_kvd::long::LongStore;
use infera_kvd::stats::L4Stats;
use infera_kvd::store::{Got, Store, key_hash};
use infera_kvd::{Namespace, SetItem};
use std::sync::Arc;
use std::time::Duration;

/// A store the scenario can kill and bring back.
pub trait Outage {
    /// A new client of the store, as a fresh daemon makes one.
    fn client(&self) -> Arc<dyn RemoteStore>;
    /// Kills the store (SIGKILL): it and everything in it are gone.
    fn kill(&mut self);
    /// Starts the store again where it was.
    fn restart(&mut self);
}

/// Block `i`'s bytes: `len` bytes that differ per block and per position.
pub fn block(i: usize, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8))
            .collect::<Vec<u8>>(),
    )
}

pub fn key(i: usize) -> Vec<u8> {
    format!("block-{i}").into_bytes()
}

/// The namespace the scenario writes in.
pub fn namespace() -> Namespace {
    Namespace::new("m", "")
}

/// Runs the scenario (module docs) over `target` with `options`, each breaker transition
/// awaited for at most `within`; returns the counters read while the store was down.
pub async fn a_killed_store_costs_no_client_error(
    target: &mut impl Outage,
    options: L4Options,
    within: Duration,
) -> L4Stats {
    let l4 = Arc::new(
        L4::open(target.client(), options.clone(), true)
            .await
            .unwrap(),
    );
    let long: Arc<dyn LongStore> = l4.clone();
    let store = Store::new(256 << 10, None, Some(long));
    let ns = namespace();
    let set = |i: usize| SetItem::new(key(i), block(i, 48 << 10)).retention(Retention::Long);
    for i in 0..4 {
        assert!(store.set(&ns, &set(i), 1).await.accepted);
    }
    l4.flush().await.unwrap();
    let mut up = l4.watch_up();

    target.kill();
    for i in 4..40 {
        assert!(
            store.set(&ns, &set(i), 1).await.accepted,
            "a SET never fails for L4"
        );
        let k = Bytes::from(key(i % 4));
        if let Some(Got::Bytes(v, _)) = store.get(&ns, &k, 1, false).await {
            assert_eq!(v, block(i % 4, 48 << 10));
        }
    }
    let opened = tokio::time::timeout(within, up.wait_for(|u| !*u))
        .await
        .is_ok();
    assert!(opened, "the breaker opens: {:?}", l4.l4_stats());
    assert!(store.set(&ns, &set(40), 1).await.accepted);
    let down = l4.l4_stats();
    assert!(down.breaker_opens_total >= 1, "{down:?}");
    assert!(down.errors_total + down.timeouts_total >= 1, "{down:?}");
    assert_eq!(down.up, 0);

    target.restart();
    let closed = tokio::time::timeout(within, up.wait_for(|u| *u))
        .await
        .is_ok();
    assert!(closed, "the breaker closes: {:?}", l4.l4_stats());
    assert!(store.set(&ns, &set(41), 1).await.accepted);
    l4.flush().await.unwrap();
    let s = l4.l4_stats();
    assert!(s.reconnects_total >= 1, "{s:?}");

    // A fresh L4 over the restarted store reads the new write back byte-exact; block 40,
    // written while the store was down, reads as a miss rather than as anything else.
    let again = L4::open(target.client(), options, true).await.unwrap();
    let hit = again
        .get(&ns, &key(41), key_hash(&ns, &key(41)), 1)
        .await
        .expect("read back");
    assert_eq!(hit.value, block(41, 48 << 10));
    assert!(
        again
            .get(&ns, &key(40), key_hash(&ns, &key(40)), 1)
            .await
            .is_none()
    );
    down
}
