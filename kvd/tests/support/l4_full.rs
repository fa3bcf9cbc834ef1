//! The full store every real L4 store that can refuse a write is put through (`l4_redis`,
//! `l4_mooncake`): the store answers but keeps no more (Redis at `maxmemory` under
//! `noeviction`, a Mooncake holder with no segment left). That is not a store that is down:
//! the breaker stays closed and blocks already in the store keep reading, and a block the
//! store refused is a miss, never its key's older value still in the store; once there is
//! room again, writes land.

#![allow(dead_code, clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::{LongBlock, LongStore, WritePermit};
use infera_kvd::store::key_hash;

/// A store the scenario can fill and empty.
#[async_trait::async_trait]
pub trait Full {
    /// Makes the store refuse further writes.
    async fn fill(&mut self);
    /// Makes room again.
    async fn empty(&mut self);
}

fn ns() -> Namespace {
    Namespace::new("m", "")
}

/// Writes `value` under `key` through `l4` and waits until the store answered it.
pub async fn write(l4: &L4, key: &str, value: &Bytes) {
    let ns = ns();
    let block = LongBlock {
        hash: key_hash(&ns, key.as_bytes()),
        ns,
        key: Bytes::copy_from_slice(key.as_bytes()),
        value: value.clone(),
        metadata: None,
        class: Retention::Long,
        expires_at: None,
    };
    l4.put(block, WritePermit::unbounded(), 1, false).unwrap();
    l4.flush().await.unwrap();
}

/// What `l4` reads under `key`, as its length and first byte (each value here is one byte
/// repeated, and a failed comparison prints two numbers).
pub async fn read(l4: &L4, key: &str) -> Option<(usize, u8)> {
    let ns = ns();
    let hash = key_hash(&ns, key.as_bytes());
    let hit = l4.get(&ns, key.as_bytes(), hash, 1).await?;
    Some((hit.value.len(), hit.value[0]))
}

fn seen(value: &Bytes) -> Option<(usize, u8)> {
    Some((value.len(), value[0]))
}

/// Runs the scenario (module docs) with `l4` over `store`.
pub async fn a_full_store_refuses_without_tripping_the_breaker(l4: &L4, store: &mut impl Full) {
    let (old, kept) = (
        Bytes::from(vec![1u8; 64 << 10]),
        Bytes::from(vec![2u8; 64 << 10]),
    );
    write(l4, "full-k", &old).await;
    write(l4, "full-j", &kept).await;
    // Read, as a reader before the store filled up would have: a store that leases what is
    // read (Mooncake) does not evict these.
    assert_eq!(read(l4, "full-k").await, seen(&old));
    assert_eq!(read(l4, "full-j").await, seen(&kept));

    store.fill().await;
    let new = Bytes::from(vec![3u8; 4 << 20]);
    write(l4, "full-k", &new).await;
    let s = l4.l4_stats();
    assert!(s.refused_total >= 1, "the store refused puts: {s:?}");
    assert_eq!(
        (s.up, s.breaker_opens_total),
        (1, 0),
        "a full store is up: {s:?}"
    );
    assert_eq!(s.queued_ops, 0, "the refused puts' removals landed: {s:?}");
    // Not the older value the store held for the key: the refused put's removal took it out.
    assert_eq!(read(l4, "full-k").await, None);
    assert_eq!(read(l4, "full-j").await, seen(&kept), "reads go on");

    store.empty().await;
    write(l4, "full-k", &new).await;
    assert_eq!(read(l4, "full-k").await, seen(&new), "writes land again");
    assert_eq!(l4.l4_stats().breaker_opens_total, 0);
}
