//! Unit tests of the KV index: one behaviour a router relies on per test.

use super::*;
use crate::event::{Envelope, Event, WorkerDeregistered};
use crate::projection::Projection;

fn rank(w: &str, dp: u32) -> WorkerRank {
    WorkerRank::new(w, dp)
}

fn bh(v: &[u64]) -> Vec<BlockHash> {
    v.iter().map(|&x| BlockHash(x)).collect()
}

fn stored(w: &WorkerRank, tier: Tier, pairs: &[(u64, u64)]) -> KvBlocksStored {
    KvBlocksStored {
        worker: w.clone(),
        tier,
        block_size: 16,
        engine_hashes: pairs.iter().map(|&(e, _)| EngineHash(e)).collect(),
        router_hashes: pairs.iter().map(|&(_, r)| BlockHash(r)).collect(),
        parent: None,
    }
}

fn removed(w: &WorkerRank, tier: Tier, engines: &[u64]) -> KvBlocksRemoved {
    KvBlocksRemoved {
        worker: w.clone(),
        tier,
        engine_hashes: engines.iter().map(|&e| EngineHash(e)).collect(),
        router_hashes: Vec::new(),
    }
}

fn cleared(w: &WorkerRank, tier: Option<Tier>) -> KvCacheCleared {
    KvCacheCleared {
        worker: w.clone(),
        tier,
    }
}

fn overlap(ix: &KvIndex, tier: Tier, blocks: &[u64], cands: &[WorkerSlot]) -> Vec<u32> {
    let mut out = vec![99; 7];
    ix.overlap(tier, &bh(blocks), cands, &mut out);
    ix.check_invariants().expect("invariants");
    out
}

#[test]
fn stored_blocks_give_contiguous_prefix_overlap() {
    let mut ix = KvIndex::new();
    let (a, b) = (rank("a:1", 0), rank("b:1", 0));
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 1), (11, 2), (12, 3)]));
    ix.apply_stored(&stored(&b, Tier::Gpu, &[(20, 1), (22, 3)]));
    let (sa, sb) = (ix.slot(&a).expect("a"), ix.slot(&b).expect("b"));
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1, 2, 3, 4], &[sa, sb]),
        vec![3, 1]
    );
    // Holding block 3 without block 2 does not count: the prefix stops at the first gap.
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1, 2, 3], &[sb, sa, sb]),
        vec![1, 3, 1]
    );
    assert_eq!(overlap(&ix, Tier::Gpu, &[9, 1], &[sa]), vec![0]);
    assert_eq!(overlap(&ix, Tier::Gpu, &[], &[sa, sb]), vec![0, 0]);
    assert!(overlap(&ix, Tier::Gpu, &[1], &[]).is_empty());
    assert_eq!(ix.entries(), 5);
    assert_eq!(ix.blocks_of(&a, Tier::Gpu), 3);
    assert_eq!(ix.distinct_blocks(Tier::Gpu), 3);
    assert_eq!(
        ix.router_hash(&a, Tier::Gpu, EngineHash(11)),
        Some(BlockHash(2))
    );
    assert_eq!(ix.router_hash(&b, Tier::Gpu, EngineHash(11)), None);
}

#[test]
fn duplicates_are_idempotent_and_unknown_parents_are_fine() {
    let mut ix = KvIndex::new();
    let a = rank("a:1", 0);
    let mut ev = stored(&a, Tier::Gpu, &[(10, 1), (11, 2)]);
    ev.parent = Some(EngineHash(12345));
    ix.apply_stored(&ev);
    let once = ix.clone();
    ix.apply_stored(&ev);
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(11, 2)]));
    assert_eq!(ix, once);
    assert_eq!(ix.entries(), 2);
    // One removal undoes one engine hash, however often it was stored.
    ix.apply_removed(&removed(&a, Tier::Gpu, &[11]));
    assert_eq!(ix.blocks_of(&a, Tier::Gpu), 1);
    ix.check_invariants().expect("invariants");
}

#[test]
fn router_hash_stays_held_while_another_engine_hash_maps_to_it() {
    let mut ix = KvIndex::new();
    let a = rank("a:1", 0);
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 1), (30, 1)]));
    assert_eq!(ix.blocks_of(&a, Tier::Gpu), 1);
    assert_eq!(ix.entries(), 1);
    let s = ix.slot(&a).expect("slot");
    ix.apply_removed(&removed(&a, Tier::Gpu, &[10]));
    assert_eq!(overlap(&ix, Tier::Gpu, &[1], &[s]), vec![1]);
    ix.apply_removed(&removed(&a, Tier::Gpu, &[30]));
    assert_eq!(overlap(&ix, Tier::Gpu, &[1], &[s]), vec![0]);
    assert_eq!(ix.entries(), 0);
}

#[test]
fn restoring_an_engine_hash_with_other_content_remaps_it() {
    let mut ix = KvIndex::new();
    let a = rank("a:1", 0);
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 1)]));
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 2)]));
    let s = ix.slot(&a).expect("slot");
    assert_eq!(overlap(&ix, Tier::Gpu, &[1], &[s]), vec![0]);
    assert_eq!(overlap(&ix, Tier::Gpu, &[2], &[s]), vec![1]);
    ix.apply_removed(&removed(&a, Tier::Gpu, &[10]));
    assert_eq!(ix.entries(), 0);
    assert_eq!(ix.unknown_removals(), 0);
}

#[test]
fn unknown_removals_are_ignored_and_counted() {
    let mut ix = KvIndex::new();
    let a = rank("a:1", 0);
    ix.apply_removed(&removed(&a, Tier::Gpu, &[1, 2]));
    assert_eq!(ix.slot(&a), None, "a removal does not create a slot");
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 1)]));
    ix.apply_removed(&removed(&a, Tier::Gpu, &[10, 10, 77]));
    ix.apply_removed(&removed(&a, Tier::Host, &[10]));
    assert_eq!(ix.unknown_removals(), 2 + 2 + 1);
    assert_eq!(ix.entries(), 0);
    ix.check_invariants().expect("invariants");
}

#[test]
fn tiers_are_isolated() {
    let mut ix = KvIndex::new();
    let a = rank("a:1", 0);
    ix.apply_stored(&stored(&a, Tier::Gpu, &[(10, 1)]));
    ix.apply_stored(&stored(&a, Tier::Host, &[(10, 1), (11, 2)]));
    let s = ix.slot(&a).expect("slot");
    assert_eq!(overlap(&ix, Tier::Gpu, &[1, 2], &[s]), vec![1]);
    assert_eq!(overlap(&ix, Tier::Host, &[1, 2], &[s]), vec![2]);
    assert_eq!(overlap(&ix, Tier::Disk, &[1, 2], &[s]), vec![0]);
    ix.apply_removed(&removed(&a, Tier::Gpu, &[10]));
    assert_eq!(overlap(&ix, Tier::Host, &[1, 2], &[s]), vec![2]);
    ix.apply_cleared(&cleared(&a, Some(Tier::Host)));
    assert_eq!(ix.entries(), 0);
}

#[test]
fn clearing_one_tier_or_all_keeps_the_slot() {
    let mut ix = KvIndex::new();
    let (a, b) = (rank("a:1", 0), rank("a:1", 1));
    for w in [&a, &b] {
        ix.apply_stored(&stored(w, Tier::Gpu, &[(10, 1), (11, 2)]));
        ix.apply_stored(&stored(w, Tier::Disk, &[(10, 1)]));
    }
    ix.apply_cleared(&cleared(&a, Some(Tier::Gpu)));
    assert_eq!(ix.blocks_of(&a, Tier::Gpu), 0);
    assert_eq!(ix.blocks_of(&a, Tier::Disk), 1);
    assert_eq!(ix.blocks_of(&b, Tier::Gpu), 2);
    ix.apply_cleared(&cleared(&a, None));
    assert_eq!(ix.blocks_of(&a, Tier::Disk), 0);
    assert!(ix.slot(&a).is_some());
    assert_eq!(ix.entries(), 3);
    ix.apply_cleared(&cleared(&rank("nobody:1", 0), None));
    ix.check_invariants().expect("invariants");
}

#[test]
fn remove_worker_drops_every_rank_and_slots_are_reused() {
    let mut ix = KvIndex::new();
    let (a0, a1, b) = (rank("a:1", 0), rank("a:1", 1), rank("b:1", 0));
    ix.apply_stored(&stored(&a0, Tier::Gpu, &[(10, 1)]));
    ix.apply_stored(&stored(&a1, Tier::Host, &[(10, 1)]));
    ix.apply_stored(&stored(&b, Tier::Gpu, &[(10, 1)]));
    let (s0, s1, sb) = (ix.slot(&a0), ix.slot(&a1), ix.slot(&b));
    assert_eq!(
        (s0, s1, sb),
        (
            Some(WorkerSlot(0)),
            Some(WorkerSlot(1)),
            Some(WorkerSlot(2))
        )
    );
    ix.apply(&Envelope {
        v: 1,
        seq: 1,
        ts_us: 0,
        source: None,
        event: Event::WorkerDeregistered(WorkerDeregistered {
            worker: WorkerId::new("a:1"),
            reason: String::new(),
        }),
    });
    assert_eq!(ix.slot(&a0), None);
    assert_eq!(ix.worker_of(WorkerSlot(1)), None);
    assert_eq!(ix.entries(), 1);
    // The old slot numbers now answer 0 and are handed out again, lowest first.
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1], &[WorkerSlot(0), WorkerSlot(2)]),
        vec![0, 1]
    );
    let c = rank("c:1", 0);
    assert_eq!(ix.ensure_slot(&c), WorkerSlot(0));
    assert_eq!(ix.ensure_slot(&c), WorkerSlot(0));
    assert_eq!(ix.worker_of(WorkerSlot(0)), Some(&c));
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1], &[WorkerSlot(0)]),
        vec![0],
        "no stale blocks"
    );
    assert_eq!(ix.ensure_slot(&rank("d:1", 0)), WorkerSlot(1));
    assert_eq!(ix.ensure_slot(&rank("e:1", 0)), WorkerSlot(3));
}

#[test]
fn slots_beyond_64_use_the_wide_path() {
    let mut ix = KvIndex::new();
    let ranks: Vec<WorkerRank> = (0..150).map(|i| rank(&format!("w{i}:1"), 0)).collect();
    for (i, w) in ranks.iter().enumerate() {
        // Rank i holds the first i % 5 + 1 blocks of the chain 1, 2, 3, 4, 5.
        let pairs: Vec<(u64, u64)> = (1..=(i as u64 % 5 + 1)).map(|r| (r * 100, r)).collect();
        ix.apply_stored(&stored(w, Tier::Gpu, &pairs));
    }
    let cands: Vec<WorkerSlot> = ranks.iter().map(|w| ix.slot(w).expect("slot")).collect();
    let want: Vec<u32> = (0..150).map(|i| (i % 5 + 1) as u32).collect();
    assert_eq!(overlap(&ix, Tier::Gpu, &[1, 2, 3, 4, 5, 6], &cands), want);
    let low_and_stray = [WorkerSlot(2), WorkerSlot(u32::MAX)];
    assert_eq!(
        overlap(&KvIndex::new(), Tier::Gpu, &[1], &low_and_stray),
        vec![0, 0]
    );
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1, 2, 3], &low_and_stray),
        vec![3, 0]
    );
    let few = [
        WorkerSlot(149),
        WorkerSlot(3),
        WorkerSlot(64),
        WorkerSlot(500),
    ];
    assert_eq!(overlap(&ix, Tier::Gpu, &[1, 2, 3], &few), vec![3, 3, 3, 0]);
    assert_eq!(
        overlap(&ix, Tier::Gpu, &[1, 2, 3, 4, 5], &few),
        vec![5, 4, 5, 0]
    );
    let stray = [WorkerSlot(u32::MAX), WorkerSlot(149), WorkerSlot(100_000)];
    assert_eq!(overlap(&ix, Tier::Gpu, &[1, 2], &stray), vec![0, 2, 0]);
    assert_eq!(overlap(&ix, Tier::Host, &[1, 2], &stray), vec![0, 0, 0]);
    for w in &ranks[60..] {
        ix.remove_worker(&w.worker);
    }
    assert_eq!(overlap(&ix, Tier::Gpu, &[1, 2], &few), vec![0, 2, 0, 0]);
    assert_eq!(ix.entries(), (0..60).map(|i| i % 5 + 1).sum::<usize>());
}

#[test]
fn dump_rebuilds_an_equal_index() {
    let mut ix = KvIndex::new();
    let (a, b) = (rank("b:1", 0), rank("a:1", 3));
    ix.apply_stored(&stored(
        &a,
        Tier::Gpu,
        &[(12, 3), (10, 1), (11, 2), (13, 1)],
    ));
    ix.apply_stored(&stored(&b, Tier::Host, &[(20, 1)]));
    ix.apply_stored(&stored(&b, Tier::Gpu, &[(21, 1)]));
    ix.ensure_slot(&rank("empty:1", 0));
    let dump = ix.dump();
    let order: Vec<(String, Tier, Vec<EngineHash>)> = dump
        .iter()
        .map(|e| match e {
            Event::KvBlocksStored(s) => (s.worker.to_string(), s.tier, s.engine_hashes.clone()),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let e = |v: &[u64]| v.iter().map(|&x| EngineHash(x)).collect::<Vec<_>>();
    assert_eq!(
        order,
        vec![
            ("a:1#3".to_owned(), Tier::Gpu, e(&[21])),
            ("a:1#3".to_owned(), Tier::Host, e(&[20])),
            ("b:1#0".to_owned(), Tier::Gpu, e(&[10, 11, 12, 13])),
        ]
    );
    let mut back = KvIndex::new();
    for (i, event) in dump.into_iter().enumerate() {
        back.apply(&Envelope {
            v: 1,
            seq: i as u64 + 1,
            ts_us: 0,
            source: None,
            event,
        });
    }
    assert_eq!(back, ix);
    // The engine maps are part of the state: dropping one of two engine hashes of router 1 keeps
    // the block held, yet the indexes differ.
    back.apply_removed(&removed(&a, Tier::Gpu, &[13]));
    let sa = back.slot(&a).expect("slot");
    assert_eq!(overlap(&back, Tier::Gpu, &[1, 2, 3], &[sa]), vec![3]);
    assert_ne!(back, ix);
}

#[test]
fn heap_bytes_grows_with_content() {
    let mut ix = KvIndex::new();
    let empty = ix.heap_bytes();
    let pairs: Vec<(u64, u64)> = (0..10_000).map(|i| (i, i * 7)).collect();
    ix.apply_stored(&stored(&rank("a:1", 0), Tier::Gpu, &pairs));
    let per_entry = (ix.heap_bytes() - empty) / ix.entries();
    assert!(
        (20..=80).contains(&per_entry),
        "{per_entry} bytes per entry"
    );
    assert!(format!("{ix:?}").contains("entries: 10000"));
}
