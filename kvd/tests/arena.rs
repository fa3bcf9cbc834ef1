//! The shared-arena path over a real socket: the memfd handshake, zero-copy gets and
//! `set_reserve`/`set_commit` writes through the Rust client and an independent Python peer,
//! torn-read detection, leases that die with their connection, and the retention rules for
//! arena entries.

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::Daemon;
use infera_core::event::Retention;
use infera_kvd::client::SharedGet;
use infera_kvd::{KvdClient, Namespace, SetItem};

fn ns() -> Namespace {
    Namespace::new("m", "")
}

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

async fn arena_daemon(arena: u64, slot: Option<u64>, max_bytes: u64) -> Daemon {
    Daemon::start(|o, _| {
        o.shared_arena_bytes = arena;
        o.arena_slot_bytes = slot;
        o.max_bytes = max_bytes;
    })
    .await
}

async fn slot_of(c: &mut KvdClient, k: &str) -> infera_kvd::proto::SharedSlot {
    match c.get_shared(&ns(), k.as_bytes()).await.unwrap() {
        Some(SharedGet::Slot(slot)) => slot,
        other => panic!("{k}: expected an arena slot, got {other:?}"),
    }
}

#[tokio::test]
async fn zero_copy_reads_and_writes_round_trip() {
    let daemon = arena_daemon(1 << 20, Some(64 << 10), 4 << 20).await;
    let mut shared = daemon.shared_client().await;
    let mut inline = daemon.client().await;
    let arena = shared.arena().unwrap();
    assert_eq!((arena.len(), arena.slot_size()), (1 << 20, 64 << 10));
    assert_eq!(arena.server_pid(), u64::from(std::process::id()));

    // Written through the arena, read inline by another client.
    let value = vec![7u8; 40_000];
    let ack = shared
        .put(&ns(), key("a"), &value, Retention::Long, None)
        .await
        .unwrap();
    assert!(ack.accepted, "{ack:?}");
    let hit = inline.get(&ns(), b"a").await.unwrap().unwrap();
    assert_eq!(
        (hit.value.len(), hit.retention),
        (40_000, Some(Retention::Long))
    );
    assert!(hit.value.iter().all(|b| *b == 7));

    // Written inline, read zero-copy.
    inline
        .set(&ns(), SetItem::new(key("b"), vec![9u8; 1000]))
        .await
        .unwrap();
    let slot = slot_of(&mut shared, "b").await;
    assert_eq!(
        (slot.length, slot.retention),
        (1000, Some(Retention::Short))
    );
    let sum = shared.arena().unwrap().read(&slot, |bytes| {
        bytes.iter().map(|b| u64::from(*b)).sum::<u64>()
    });
    assert_eq!(sum, Some(9000));
    // `get` copies out; `batch_get` answers with offsets and the client copies them out too.
    assert_eq!(
        shared.get(&ns(), b"b").await.unwrap().unwrap().value.len(),
        1000
    );
    let got = shared
        .batch_get(&ns(), vec![key("a"), key("zz"), key("b")])
        .await
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap().value.len(), 40_000);
    assert!(got[1].is_none());
    assert_eq!(got[2].as_ref().unwrap().value, vec![9u8; 1000]);

    // A value larger than a slot stays on the heap and comes back inline, even to arena
    // clients, and a batch that mixes placements is answered inline.
    inline
        .set(&ns(), SetItem::new(key("big"), vec![1u8; 100_000]))
        .await
        .unwrap();
    match shared.get_shared(&ns(), b"big").await.unwrap() {
        Some(SharedGet::Inline(hit)) => assert_eq!(hit.value.len(), 100_000),
        other => panic!("{other:?}"),
    }
    let mixed = shared
        .batch_get(&ns(), vec![key("big"), key("b")])
        .await
        .unwrap();
    assert_eq!(mixed[0].as_ref().unwrap().value.len(), 100_000);
    assert_eq!(mixed[1].as_ref().unwrap().value.len(), 1000);
    let ext = shared.stats(true).await.unwrap().extended.unwrap();
    assert_eq!((ext.arena_entries, ext.arena_slot_bytes), (2, 64 << 10));
    daemon.stop().await;
}

#[tokio::test]
async fn a_reused_slot_is_a_torn_read_not_wrong_bytes() {
    // Three slots.
    let daemon = arena_daemon(3 * 4096, Some(4096), 1 << 20).await;
    let mut c = daemon.shared_client().await;
    c.put(&ns(), key("k"), &[1u8; 100], Retention::Short, None)
        .await
        .unwrap();
    let old = slot_of(&mut c, "k").await;
    assert_eq!(c.arena().unwrap().copy(&old).unwrap(), vec![1u8; 100]);
    // `k` moves to another slot; the old one is freed and taken by the next write.
    c.put(&ns(), key("k"), &[2u8; 100], Retention::Short, None)
        .await
        .unwrap();
    c.put(&ns(), key("j"), &[3u8; 100], Retention::Short, None)
        .await
        .unwrap();
    let j = slot_of(&mut c, "j").await;
    assert_eq!(j.slot_offset, old.slot_offset, "the slot was reused");
    assert!(j.version > old.version);
    assert_eq!(
        c.arena().unwrap().copy(&old),
        None,
        "a stale offset never validates"
    );
    assert_eq!(c.arena().unwrap().read(&old, |b| b.to_vec()), None);
    assert_eq!(
        c.get(&ns(), b"k").await.unwrap().unwrap().value,
        vec![2u8; 100]
    );
    daemon.stop().await;
}

#[tokio::test]
async fn leases_die_with_their_connection() {
    let daemon = arena_daemon(4 * 4096, Some(4096), 1 << 20).await;
    let mut observer = daemon.client().await;
    {
        let mut c = daemon.shared_client().await;
        for _ in 0..4 {
            let lease = c.set_reserve(100).await.unwrap();
            assert!(lease.lease_token > 0, "{lease:?}");
        }
        let refused = c.set_reserve(100).await.unwrap();
        assert_eq!(
            (refused.lease_token, refused.reason.as_str()),
            (0, "arena_full_no_evictable")
        );
        let ext = c.stats(true).await.unwrap().extended.unwrap();
        assert_eq!(ext.arena_leases, 4);
    }
    // The server notices the close when it reads EOF; wait for it through the observable state.
    let mut released = false;
    for _ in 0..10_000 {
        if observer
            .stats(true)
            .await
            .unwrap()
            .extended
            .unwrap()
            .arena_leases
            == 0
        {
            released = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(released, "the dropped connection's leases were released");
    let mut c = daemon.shared_client().await;
    assert!(c.set_reserve(100).await.unwrap().lease_token > 0);
    daemon.stop().await;
}

#[tokio::test]
async fn arena_entries_obey_the_retention_rules() {
    // Room for two 1000-byte entries in L2's budget; eight slots.
    let budget = 2 * (1000 + 2 + 1 + 128);
    let daemon = arena_daemon(8 * 4096, Some(4096), budget).await;
    let mut c = daemon.shared_client().await;
    for k in ["l1", "l2"] {
        let ack = c
            .put(&ns(), key(k), &[5u8; 1000], Retention::Long, None)
            .await
            .unwrap();
        assert!(ack.accepted);
    }
    let ack = c
        .put(&ns(), key("s"), &[6u8; 1000], Retention::Short, None)
        .await
        .unwrap();
    assert_eq!(
        (ack.accepted, ack.reason.as_deref()),
        (false, Some("would_displace_higher_priority"))
    );
    let ack = c
        .put(&ns(), key("l1"), &[7u8; 10], Retention::Ephemeral, None)
        .await
        .unwrap();
    assert_eq!(
        ack.reason.as_deref(),
        Some("retention_downgrade_not_allowed")
    );
    assert_eq!(
        c.get(&ns(), b"l1").await.unwrap().unwrap().value,
        vec![5u8; 1000]
    );
    // Refused commits free their slots; the one lease left is `put`'s spare for the next write.
    let ext = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!((ext.arena_entries, ext.arena_leases), (2, 1));
    daemon.stop().await;
}

#[tokio::test]
async fn a_full_arena_moves_its_coldest_entry_to_the_heap_for_a_lease() {
    let daemon = arena_daemon(2 * 4096, Some(4096), 1 << 20).await;
    // Inline sets land in free slots.
    let mut inline = daemon.client().await;
    for (k, class) in [("long", Retention::Long), ("eph", Retention::Ephemeral)] {
        let item = SetItem::new(key(k), vec![1u8; 100]).retention(class);
        assert!(inline.set(&ns(), item).await.unwrap().accepted);
    }
    let mut c = daemon.shared_client().await;
    slot_of(&mut c, "eph").await;
    // Both slots are taken: the lease demotes the ephemeral (lowest class) entry to the heap.
    let lease = c.set_reserve(100).await.unwrap();
    assert!(lease.lease_token > 0);
    match c.get_shared(&ns(), b"eph").await.unwrap() {
        Some(SharedGet::Inline(hit)) => assert_eq!(hit.value, vec![1u8; 100]),
        other => panic!("the demoted entry is still held, inline: {other:?}"),
    }
    slot_of(&mut c, "long").await;
    let ext = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(ext.arena_demotions_total, 1);
    daemon.stop().await;
}

#[tokio::test]
async fn the_python_peer_speaks_the_arena_protocol() {
    let daemon = arena_daemon(1 << 20, None, 4 << 20).await;
    common::run_peer("kvd_arena_client.py", &daemon.path).await;
    // What Python wrote through its own mapping, Rust reads zero-copy.
    let mut c = daemon.shared_client().await;
    let slot = match c
        .get_shared(&Namespace::new("py-arena", ""), b"py-a1")
        .await
        .unwrap()
    {
        Some(SharedGet::Slot(slot)) => slot,
        other => panic!("{other:?}"),
    };
    let want: Vec<u8> = (0..40).flat_map(|_| 0u8..=255).collect();
    let got = c.arena().unwrap().read(&slot, |b| b == want.as_slice());
    assert_eq!(got, Some(true));
    daemon.stop().await;
}

#[tokio::test]
async fn absurd_reserve_sizes_are_refused_and_leave_the_slot_size_to_a_real_write() {
    let daemon = arena_daemon(1 << 20, None, 4 << 20).await;
    let mut c = daemon.shared_client().await;
    for size in [u64::MAX, u64::MAX - 15, u64::MAX - 63, 1 << 63, 1 << 20] {
        let r = c.set_reserve(size).await.unwrap();
        assert_eq!(
            (r.lease_token, r.reason.as_str()),
            (0, "oversize"),
            "{size}"
        );
    }
    let stats = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(
        stats.arena_slot_bytes, 0,
        "no refused size decided the grid"
    );
    // The connection still works, and a real write decides the slot size.
    let r = c.set_reserve(4000).await.unwrap();
    assert!(r.lease_token > 0, "{r:?}");
    assert_eq!(r.payload_max_size, 4032 - 16);
    let stats = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(stats.arena_slot_bytes, 4032);
    daemon.stop().await;
}

#[tokio::test]
async fn batch_get_shared_hands_out_slots_that_outlive_the_connection_and_validate() {
    let daemon = arena_daemon(1 << 20, Some(64 << 10), 4 << 20).await;
    let mut writer = daemon.client().await;
    writer
        .set(&ns(), SetItem::new(key("a"), vec![5u8; 3000]))
        .await
        .unwrap();
    let mut shared = daemon.shared_client().await;
    let found = shared
        .batch_get_shared(&ns(), vec![key("a"), key("missing")])
        .await
        .unwrap();
    let slot = match &found[..] {
        [Some(SharedGet::Slot(slot)), None] => *slot,
        other => panic!("expected one arena slot and one miss, got {other:?}"),
    };
    let arena = shared.arena_handle().unwrap();
    drop(shared); // the handle keeps the mapping
    assert!(arena.is_valid(&slot));
    // The base pointer addresses the same bytes `read` lends.
    let in_place = arena.read(&slot, |bytes| bytes.as_ptr()).unwrap();
    assert_eq!(
        in_place,
        arena.base().wrapping_add(slot.slot_offset as usize)
    );
    assert_eq!(arena.copy(&slot).unwrap(), vec![5u8; 3000]);
    // A slot that does not lie in the arena never validates.
    let outside = infera_kvd::proto::SharedSlot {
        slot_offset: arena.len() as u64,
        ..slot
    };
    assert!(!arena.is_valid(&outside));
    // Without an arena, the same call answers inline.
    let mut inline = daemon.client().await;
    let found = inline
        .batch_get_shared(&ns(), vec![key("a")])
        .await
        .unwrap();
    assert!(
        matches!(&found[..], [Some(SharedGet::Inline(hit))] if hit.value.len() == 3000),
        "{found:?}"
    );
    daemon.stop().await;
}
