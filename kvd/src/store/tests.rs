//! Unit tests of the L2 rules through [`L2Store`].

use super::*;
use Retention::{Ephemeral, Long, Short};

fn ns() -> Namespace {
    Namespace::new("m", "")
}

fn item(key: &str, len: usize, class: Retention) -> SetItem {
    SetItem::new(key.as_bytes().to_vec(), vec![key.as_bytes()[0]; len]).retention(class)
}

/// A budget that holds exactly `n` items of `len` value bytes with one-byte keys.
fn budget(n: u64, len: u64) -> u64 {
    n * (len + 1 + 1 + ENTRY_OVERHEAD)
}

#[test]
fn a_short_write_cannot_evict_long() {
    let store = L2Store::new(budget(2, 100));
    assert!(store.set(&ns(), &item("a", 100, Long), 0).accepted);
    assert!(store.set(&ns(), &item("b", 100, Long), 0).accepted);
    let ack = store.set(&ns(), &item("c", 100, Short), 0);
    assert_eq!(ack, SetAck::rejected(REASON_DISPLACE));
    assert!(store.get(&ns(), b"a", 0).is_some() && store.get(&ns(), b"b", 0).is_some());
    // The same class may displace the least recently used one.
    assert!(store.set(&ns(), &item("d", 100, Long), 0).accepted);
    assert_eq!(
        store.exists(&ns(), &[b"a", b"b", b"d"], 0),
        [false, true, true]
    );
    let s = store.stats();
    assert_eq!((s.evictions_total, s.rejected_total), (1, 1));
    store.check_consistency().unwrap();
}

#[test]
fn lower_classes_go_first() {
    let store = L2Store::new(budget(3, 10));
    store.set(&ns(), &item("e", 10, Ephemeral), 0);
    store.set(&ns(), &item("s", 10, Short), 0);
    store.set(&ns(), &item("l", 10, Long), 0);
    assert!(store.set(&ns(), &item("x", 10, Short), 0).accepted);
    assert_eq!(
        store.exists(&ns(), &[b"e", b"s", b"l", b"x"], 0),
        [false, true, true, true]
    );
}

#[test]
fn a_lower_class_never_overwrites_a_higher_one() {
    let store = L2Store::new(budget(4, 10));
    store.set(&ns(), &item("a", 10, Long), 0);
    let ack = store.set(&ns(), &SetItem::new(&b"a"[..], &b"other"[..]), 0);
    assert_eq!(ack, SetAck::rejected(REASON_DOWNGRADE));
    let hit = store.get(&ns(), b"a", 0).unwrap();
    assert_eq!((hit.value.len(), hit.retention), (10, Long));
    // An upgrade replaces the value and the class.
    store.set(&ns(), &item("b", 10, Short), 0);
    assert!(store.set(&ns(), &item("b", 5, Long), 0).accepted);
    let hit = store.get(&ns(), b"b", 0).unwrap();
    assert_eq!((hit.value.len(), hit.retention), (5, Long));
    store.check_consistency().unwrap();
}

#[test]
fn ttl_expiry_frees_space() {
    let store = L2Store::new(budget(2, 100));
    store.set(&ns(), &item("a", 100, Long).ttl_seconds(1.0), 0);
    store.set(&ns(), &item("b", 100, Long).ttl_seconds(2.0), 0);
    assert_eq!(store.exists(&ns(), &[b"a"], 999), [true]);
    assert_eq!(store.exists(&ns(), &[b"a"], 1000), [false]);
    assert_eq!(store.sweep(1000), 1);
    assert!(store.set(&ns(), &item("d", 100, Long), 1000).accepted);
    assert!(store.get(&ns(), b"b", 2000).is_none(), "expired on access");
    let s = store.stats();
    assert_eq!(s.expired_total, 2);
    assert_eq!(s.entries, 1);
    store.check_consistency().unwrap();
}

#[test]
fn zero_ttl_stores_nothing_and_namespaces_are_separate() {
    let store = L2Store::new(1 << 20);
    assert!(
        store
            .set(&ns(), &item("a", 1, Short).ttl_seconds(0.0), 0)
            .accepted
    );
    assert_eq!(store.stats().entries, 0);
    let other = Namespace::new("m", "fp8");
    store.set(&ns(), &item("a", 1, Short), 0);
    assert!(store.get(&other, b"a", 0).is_none());
    store.set(&other, &item("a", 2, Short), 0);
    assert_eq!(store.clear(&other), 1);
    assert_eq!(store.get(&ns(), b"a", 0).unwrap().value.len(), 1);
    assert_eq!(store.clear(&Namespace::default()), 1);
    assert_eq!(store.stats().accounted_bytes, 0);
}

#[test]
fn too_large_is_refused() {
    let store = L2Store::new(100);
    let ack = store.set(&ns(), &item("a", 100, Long), 0);
    assert_eq!(ack, SetAck::rejected(REASON_TOO_LARGE));
}

#[test]
fn key_hashes_are_the_reference_xxh3_128_so_stored_keys_stay_valid() {
    // XXH3-128 of the length-prefixed parts, as every build before computed it: an L3 region
    // written then still finds its keys.
    let h = key_hash(&Namespace::new("model", "fp8"), b"key");
    assert_eq!(h, 0x7d5c05efc32db4c9a70d7a975ad74e77);
}
