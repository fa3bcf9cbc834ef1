//! The recorder, the publisher's batches, and what the stores record.

use super::*;
use crate::long::{self, LongBackendConfig};
use crate::proto::SetItem;
use crate::store::Store;
use crate::tablespace::{IoMode, TablespaceConfig};
use infera_core::event::Retention;
use infera_core::ids::EngineHash;
use infera_core::kv_events::EngineEvent;
use infera_core::kv_events::kvd::{removed_event, stored_event};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// A sink that keeps what it is given, or refuses while told to.
#[derive(Debug, Default)]
struct Capture {
    batches: Mutex<Vec<EngineBatch>>,
    refuse: AtomicBool,
}

impl InventorySink for Capture {
    fn publish(&self, batch: &EngineBatch) -> Result<(), SinkError> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(SinkError::Full);
        }
        self.batches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(batch.clone());
        Ok(())
    }
}

impl Capture {
    fn take(&self) -> Vec<EngineBatch> {
        std::mem::take(&mut *self.batches.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

struct Rig {
    recorder: Arc<Recorder>,
    load: Arc<LoadMeter>,
    sink: Arc<Capture>,
    counters: Arc<PublishCounters>,
    publisher: Publisher,
}

fn rig(limit: usize) -> Rig {
    let recorder = Arc::new(Recorder::new(limit));
    let load = Arc::new(LoadMeter::default());
    let sink = Arc::new(Capture::default());
    let counters = Arc::new(PublishCounters::default());
    let publisher = Publisher::new(
        recorder.clone(),
        load.clone(),
        sink.clone(),
        counters.clone(),
    );
    Rig {
        recorder,
        load,
        sink,
        counters,
        publisher,
    }
}

fn ns() -> Namespace {
    Namespace::new("llama-8b", "fp8")
}

fn inv(key: &str) -> u64 {
    inventory_hash("llama-8b", "fp8", key.as_bytes()).0
}

fn stored(tier: Tier, keys: &[&str]) -> EngineEvent {
    stored_event(tier, keys.iter().map(|k| EngineHash(inv(k))).collect())
}

fn removed(tier: Tier, keys: &[&str]) -> EngineEvent {
    removed_event(tier, keys.iter().map(|k| EngineHash(inv(k))).collect())
}

fn change(tier: Tier, kind: ChangeKind, key: &str) -> Change {
    Change {
        tier,
        kind,
        hash: inv(key),
    }
}

/// The events of every batch published by one round.
fn round(rig: &mut Rig, now: Instant) -> Vec<EngineEvent> {
    rig.publisher.round(now);
    rig.sink.take().into_iter().flat_map(|b| b.events).collect()
}

/// The events of one tier, in order (tiers note their changes under their own locks: only the
/// order within a tier is defined).
fn of_tier(events: &[EngineEvent], tier: Tier) -> Vec<EngineEvent> {
    events
        .iter()
        .filter(|e| match e {
            EngineEvent::BlockStored { tier: t, .. }
            | EngineEvent::BlockRemoved { tier: t, .. } => *t == tier,
            _ => false,
        })
        .cloned()
        .collect()
}

fn item(key: &str, len: usize) -> SetItem {
    SetItem::new(key.as_bytes().to_vec(), vec![7u8; len]).retention(Retention::Short)
}

/// What a key charges L2 with a value of `len` bytes (see `store::charge`).
fn charge(key: &str, len: usize) -> u64 {
    crate::store::L2Store::charge_of(&ns(), &item(key, len))
}

#[test]
fn the_first_batch_is_a_clear_and_runs_of_one_kind_and_tier_are_one_event() {
    let mut rig = rig(MAX_PENDING);
    let t0 = Instant::now();
    assert_eq!(round(&mut rig, t0), vec![EngineEvent::AllBlocksCleared]);
    assert_eq!(round(&mut rig, t0), vec![], "nothing changed, nothing sent");
    for c in [
        change(Tier::Host, ChangeKind::Stored, "a"),
        change(Tier::Host, ChangeKind::Stored, "b"),
        change(Tier::Disk, ChangeKind::Stored, "a"),
        change(Tier::Host, ChangeKind::Removed, "a"),
        change(Tier::Host, ChangeKind::Stored, "c"),
    ] {
        rig.recorder.record(c.tier, c.kind, c.hash);
    }
    assert_eq!(
        round(&mut rig, t0),
        vec![
            stored(Tier::Host, &["a", "b"]),
            stored(Tier::Disk, &["a"]),
            removed(Tier::Host, &["a"]),
            stored(Tier::Host, &["c"]),
        ]
    );
    assert_eq!(rig.counters.batches(), 2);
    assert_eq!(rig.counters.events(), 5);
    assert_eq!(rig.counters.dropped(), 0);
}

#[test]
fn an_overflow_drops_the_waiting_changes_and_starts_over_with_a_clear() {
    let mut rig = rig(4);
    let t0 = Instant::now();
    round(&mut rig, t0);
    for key in ["a", "b", "c", "d"] {
        rig.recorder
            .record(Tier::Host, ChangeKind::Stored, inv(key));
    }
    // The fifth change finds the buffer full: the four waiting are discarded (a removal among
    // them would otherwise be lost while its store is published).
    rig.recorder
        .record(Tier::Host, ChangeKind::Removed, inv("e"));
    assert_eq!(rig.recorder.len(), 1);
    assert_eq!(
        round(&mut rig, t0),
        vec![EngineEvent::AllBlocksCleared, removed(Tier::Host, &["e"])]
    );
    assert_eq!(rig.counters.dropped(), 4);
    rig.recorder
        .record(Tier::Host, ChangeKind::Stored, inv("f"));
    assert_eq!(round(&mut rig, t0), vec![stored(Tier::Host, &["f"])]);
}

#[test]
fn a_refused_batch_is_counted_and_the_next_one_starts_with_a_clear() {
    let mut rig = rig(MAX_PENDING);
    let t0 = Instant::now();
    round(&mut rig, t0);
    rig.recorder
        .record(Tier::Disk, ChangeKind::Stored, inv("a"));
    rig.recorder
        .record(Tier::Disk, ChangeKind::Stored, inv("b"));
    rig.sink.refuse.store(true, Ordering::Relaxed);
    assert_eq!(round(&mut rig, t0), vec![]);
    assert_eq!(rig.counters.dropped(), 2);
    rig.sink.refuse.store(false, Ordering::Relaxed);
    rig.recorder
        .record(Tier::Disk, ChangeKind::Removed, inv("c"));
    assert_eq!(
        round(&mut rig, t0),
        vec![EngineEvent::AllBlocksCleared, removed(Tier::Disk, &["c"])]
    );
}

#[test]
fn a_clear_op_makes_the_waiting_changes_moot() {
    let mut rig = rig(MAX_PENDING);
    let t0 = Instant::now();
    round(&mut rig, t0);
    let inventory = Inventory::recording(rig.recorder.clone());
    inventory.stored(Tier::Host, Some(inv("a")));
    inventory.cleared();
    inventory.stored(Tier::External, Some(inv("b")));
    assert_eq!(
        round(&mut rig, t0),
        vec![
            EngineEvent::AllBlocksCleared,
            stored(Tier::External, &["b"])
        ]
    );
    assert_eq!(rig.counters.dropped(), 0, "cleared, not dropped");
    assert_eq!(
        Inventory::off().hash(&ns(), b"a"),
        None,
        "off hashes nothing"
    );
}

#[test]
fn tier_loads_go_out_the_first_time_then_on_a_change_at_most_every_five_seconds() {
    let mut rig = rig(MAX_PENDING);
    let t0 = Instant::now();
    let sample = |load: &LoadMeter, micros: u64| {
        let mut served = Served::default();
        served.add(Tier::Disk, 1 << 20);
        load.record(&served, Duration::from_micros(micros));
    };
    sample(&rig.load, 1000);
    let first = round(&mut rig, t0);
    assert!(matches!(first[0], EngineEvent::AllBlocksCleared));
    match &first[1] {
        EngineEvent::TierLoad {
            tier: Tier::Disk,
            bytes_per_s,
            block_bytes: 1_048_576,
        } => assert!((bytes_per_s - 1.048_576e9).abs() < 1.0),
        other => panic!("{other:?}"),
    }
    // Three times slower: due only once five seconds passed.
    for _ in 0..3 {
        sample(&rig.load, 3000);
    }
    assert_eq!(round(&mut rig, t0 + Duration::from_secs(4)), vec![]);
    let later = round(&mut rig, t0 + Duration::from_secs(5));
    assert!(matches!(
        later[..],
        [EngineEvent::TierLoad {
            tier: Tier::Disk,
            ..
        }]
    ));
    // Within 10 % of the last published: not sent again.
    sample(&rig.load, 3100);
    assert_eq!(round(&mut rig, t0 + Duration::from_secs(60)), vec![]);
}

#[tokio::test]
async fn a_set_that_evicts_records_host_stored_and_removed() {
    let mut rig = rig(MAX_PENDING);
    let budget = charge("k1", 1000) * 2 + 10;
    let store =
        Store::new(budget, None, None).with_inventory(Inventory::recording(rig.recorder.clone()));
    let t0 = Instant::now();
    round(&mut rig, t0);
    for key in ["k1", "k2"] {
        assert!(store.set(&ns(), &item(key, 1000), 1).await.accepted);
    }
    // Another value for a held key: still held, stored again, never removed.
    assert!(store.set(&ns(), &item("k2", 1000), 1).await.accepted);
    assert!(store.set(&ns(), &item("k3", 1000), 1).await.accepted);
    assert_eq!(
        round(&mut rig, t0),
        vec![
            stored(Tier::Host, &["k1", "k2", "k2"]),
            removed(Tier::Host, &["k1"]),
            stored(Tier::Host, &["k3"]),
        ]
    );
    // A TTL that passed (k4 made room by evicting k2): removed on access.
    let ttl = item("k4", 10).ttl_seconds(0.001);
    assert!(store.set(&ns(), &ttl, 1).await.accepted);
    assert!(store.get(&ns(), &ttl.key, 10_000, false).await.is_none());
    assert_eq!(
        round(&mut rig, t0),
        vec![
            removed(Tier::Host, &["k2"]),
            stored(Tier::Host, &["k4"]),
            removed(Tier::Host, &["k4"]),
        ]
    );
    assert_eq!(store.clear(&Namespace::new("", "")), 1);
    assert_eq!(round(&mut rig, t0), vec![EngineEvent::AllBlocksCleared]);
}

fn ts_config(dir: &std::path::Path) -> TablespaceConfig {
    let mut c = TablespaceConfig::new(vec![dir.join("l3")], 1 << 20);
    c.io_mode = IoMode::Buffered;
    c.container_bytes = 1 << 20;
    c.workers_per_shard = 1;
    c.io_uring = false;
    c
}

#[tokio::test]
async fn a_spill_to_l3_records_disk_stored_and_a_lower_write_disk_removed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let long = long::open(&LongBackendConfig::Tablespace(ts_config(dir.path())))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rig = rig(MAX_PENDING);
    let budget = charge("k1", 1000) * 2 + 10;
    let store = Store::new(budget, None, Some(long.clone()))
        .with_inventory(Inventory::recording(rig.recorder.clone()));
    let t0 = Instant::now();
    round(&mut rig, t0);
    for key in ["k1", "k2", "k3"] {
        assert!(store.set(&ns(), &item(key, 1000), 1).await.accepted);
    }
    // k1, evicted from L2 as `short`, is spilled to L3.
    let events = round(&mut rig, t0);
    assert_eq!(
        of_tier(&events, Tier::Host),
        vec![
            stored(Tier::Host, &["k1", "k2"]),
            removed(Tier::Host, &["k1"]),
            stored(Tier::Host, &["k3"]),
        ]
    );
    assert_eq!(
        of_tier(&events, Tier::Disk),
        vec![stored(Tier::Disk, &["k1"])]
    );
    // An `ephemeral` write of k1 never reaches disk and removes L3's copy.
    let lower = item("k1", 1000).retention(Retention::Ephemeral);
    assert!(!store.set(&ns(), &lower, 1).await.accepted, "a downgrade");
    let short = item("k1", 1000);
    assert!(store.set(&ns(), &short, 1).await.accepted);
    let events = round(&mut rig, t0);
    assert!(
        events.contains(&removed(Tier::Disk, &["k1"])),
        "the L3 copy of a key written again is dropped: {events:?}"
    );
    assert!(events.contains(&stored(Tier::Disk, &["k2"])), "{events:?}");
    long.close().await.unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_fast_hash_is_the_cores_inventory_hash() {
    for (model, compat) in [("", ""), ("m", ""), ("llama-3-70b", "fp8:paged-16")] {
        for len in [0usize, 1, 16, 32, 200, 250, 260, 1000] {
            let key: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            assert_eq!(
                hash_of(&Namespace::new(model, compat), &key),
                inventory_hash(model, compat, &key).0,
                "{model:?} {compat:?} {len}"
            );
        }
    }
}

#[test]
fn an_append_past_the_bound_drops_the_waiting_changes() {
    let mut rig = rig(4);
    let t0 = Instant::now();
    round(&mut rig, t0);
    let inventory = Inventory::recording(rig.recorder.clone());
    let mut gathered = vec![change(Tier::Host, ChangeKind::Stored, "a")];
    inventory.append(&mut gathered);
    assert!(gathered.is_empty());
    gathered.extend(["b", "c", "d", "e"].map(|k| change(Tier::Host, ChangeKind::Stored, k)));
    inventory.append(&mut gathered);
    assert_eq!(
        round(&mut rig, t0),
        vec![
            EngineEvent::AllBlocksCleared,
            stored(Tier::Host, &["b", "c", "d", "e"])
        ]
    );
    assert_eq!(rig.counters.dropped(), 1);
}

#[test]
fn a_quiet_daemon_sends_an_empty_batch_every_second() {
    let mut rig = rig(MAX_PENDING);
    let t0 = Instant::now();
    round(&mut rig, t0);
    rig.publisher.round(t0 + Duration::from_millis(999));
    assert!(rig.sink.take().is_empty(), "silent within the second");
    rig.publisher.round(t0 + HEARTBEAT_EVERY);
    let beat = rig.sink.take();
    assert_eq!(beat.len(), 1, "one heartbeat");
    assert!(beat[0].events.is_empty());
}
