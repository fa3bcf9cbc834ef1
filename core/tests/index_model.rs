//! Model-based test of the KV index: random sequences of KV and discovery events are applied to
//! [`KvIndex`] and to a naive reference (one `BTreeMap` engine → router per (worker rank, tier)),
//! and after every event the two must agree on overlaps, `entries()`, `blocks_of()`, parent
//! lookups and counters. At the end, the index's dump applied to a fresh index must rebuild an
//! equal index with identical overlaps.
//!
//! Hash spaces are tiny so that duplicates, engine hashes reused for other content, several engine
//! hashes per router hash, unknown parents and unknown removals are frequent; stores and queries
//! follow three chains (two sharing a prefix) so that long contiguous overlaps happen too. Half the
//! cases first register up to 130 idle "padding" ranks, pushing the tested ranks' slots across 64
//! and 128 so that the wide holder rows and the wide overlap path are exercised.

use infera_core::event::{
    Envelope, Event, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, Tier, WorkerDeregistered,
};
use infera_core::ids::{BlockHash, EngineHash, WorkerId, WorkerRank};
use infera_core::index::{KvIndex, WorkerSlot};
use infera_core::projection::Projection;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const WORKERS: u8 = 8;
const DP_RANKS: u8 = 2;
const RANKS: u8 = WORKERS * DP_RANKS;
const TIERS: [Tier; 2] = [Tier::Gpu, Tier::Host];

/// Three chains of router hashes; chain 1 shares its first four blocks with chain 0.
fn chain(k: u8) -> Vec<u64> {
    match k {
        0 => (1..=12).collect(),
        1 => (1..=4).chain(21..=28).collect(),
        _ => (31..=42).collect(),
    }
}

fn rank(i: u8) -> WorkerRank {
    WorkerRank::new(
        WorkerId::new(format!("w{}:80", i / DP_RANKS)),
        u32::from(i % DP_RANKS),
    )
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: u8,
        tier: Tier,
        pairs: Vec<(u64, u64)>,
        parent: Option<u64>,
        truncate: bool,
    },
    Remove {
        w: u8,
        tier: Tier,
        engines: Vec<u64>,
    },
    Clear {
        w: u8,
        tier: Option<Tier>,
    },
    Down {
        worker: u8,
    },
}

#[derive(Debug, Clone)]
enum Cand {
    Rank(u8),
    Raw(u32),
}

#[derive(Debug, Clone)]
struct Query {
    tier: Tier,
    blocks: Vec<u64>,
    cands: Vec<Cand>,
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Gpu), Just(Tier::Host)]
}

/// A run of a chain (half the time from its start, as an engine stores a prompt), as (engine,
/// router) pairs; the engine key is the router hash salted by 0..3.
fn chain_pairs() -> impl Strategy<Value = Vec<(u64, u64)>> {
    let start = prop_oneof![Just(0usize), 0usize..10];
    (0u8..3, start, 1usize..9, 0u64..3).prop_map(|(k, start, len, salt)| {
        chain(k)
            .into_iter()
            .skip(start)
            .take(len)
            .map(|r| (r ^ (salt << 6), r))
            .collect()
    })
}

fn pairs() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop_oneof![
        3 => chain_pairs(),
        2 => prop::collection::vec((0u64..64, 0u64..48), 1..6),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let rank = 0..RANKS;
    prop_oneof![
        8 => (rank.clone(), tier(), pairs(), prop::option::of(0u64..200), prop::bool::weighted(0.05))
            .prop_map(|(w, tier, pairs, parent, truncate)| Op::Store { w, tier, pairs, parent, truncate }),
        4 => (rank.clone(), tier(), prop_oneof![
                chain_pairs().prop_map(|p| p.into_iter().map(|(e, _)| e).collect()),
                prop::collection::vec(0u64..64, 1..5),
            ])
            .prop_map(|(w, tier, engines)| Op::Remove { w, tier, engines }),
        1 => (rank, prop::option::of(tier())).prop_map(|(w, tier)| Op::Clear { w, tier }),
        1 => (0..WORKERS).prop_map(|worker| Op::Down { worker }),
    ]
}

fn query() -> impl Strategy<Value = Query> {
    let blocks = prop_oneof![
        3 => (0u8..3, 0usize..14, prop::option::of((0usize..12, 0u64..48))).prop_map(
            |(k, len, mutate)| {
                let mut b: Vec<u64> = chain(k).into_iter().take(len).collect();
                if let Some((i, v)) = mutate.filter(|(i, _)| *i < b.len()) {
                    b[i] = v;
                }
                b
            }
        ),
        1 => prop::collection::vec(0u64..48, 0..8),
    ];
    let cand = prop_oneof![
        6 => (0..RANKS).prop_map(Cand::Rank),
        1 => prop_oneof![4 => 0u32..200, 1 => Just(u32::MAX)].prop_map(Cand::Raw),
    ];
    (tier(), blocks, prop::collection::vec(cand, 0..10)).prop_map(|(tier, blocks, cands)| Query {
        tier,
        blocks,
        cands,
    })
}

/// The reference: the engine → router maps and the counters, nothing else.
#[derive(Debug, Default)]
struct Model {
    maps: BTreeMap<(WorkerRank, Tier), BTreeMap<EngineHash, BlockHash>>,
    slotted: BTreeSet<WorkerRank>,
    unknown_removals: u64,
    mismatched: u64,
}

impl Model {
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Store {
                w,
                tier,
                pairs,
                truncate,
                ..
            } => {
                let keep = pairs.len() - usize::from(*truncate);
                self.mismatched += u64::from(*truncate);
                self.slotted.insert(rank(*w));
                let m = self.maps.entry((rank(*w), *tier)).or_default();
                for &(e, r) in &pairs[..keep] {
                    m.insert(EngineHash(e), BlockHash(r));
                }
            }
            Op::Remove { w, tier, engines } => {
                let m = self.maps.entry((rank(*w), *tier)).or_default();
                for e in engines {
                    if m.remove(&EngineHash(*e)).is_none() {
                        self.unknown_removals += 1;
                    }
                }
            }
            Op::Clear { w, tier } => {
                let w = rank(*w);
                self.maps
                    .retain(|(mw, mt), _| *mw != w || tier.is_some_and(|t| t != *mt));
            }
            Op::Down { worker } => {
                let id = rank(*worker * DP_RANKS).worker;
                self.maps.retain(|(w, _), _| w.worker != id);
                self.slotted.retain(|w| w.worker != id);
            }
        }
    }

    fn held(&self, w: &WorkerRank, tier: Tier) -> BTreeSet<BlockHash> {
        self.maps
            .get(&(w.clone(), tier))
            .map(|m| m.values().copied().collect())
            .unwrap_or_default()
    }

    fn overlap(&self, w: Option<&WorkerRank>, tier: Tier, blocks: &[BlockHash]) -> u32 {
        let Some(w) = w else { return 0 };
        let held = self.held(w, tier);
        blocks.iter().take_while(|b| held.contains(b)).count() as u32
    }

    fn entries(&self) -> usize {
        self.maps
            .values()
            .map(|m| m.values().collect::<BTreeSet<_>>().len())
            .sum()
    }
}

fn event_of(op: &Op) -> Event {
    match op {
        Op::Store {
            w,
            tier,
            pairs,
            parent,
            truncate,
        } => Event::KvBlocksStored(KvBlocksStored {
            worker: rank(*w),
            tier: *tier,
            block_size: 16,
            engine_hashes: pairs.iter().map(|&(e, _)| EngineHash(e)).collect(),
            router_hashes: pairs[..pairs.len() - usize::from(*truncate)]
                .iter()
                .map(|&(_, r)| BlockHash(r))
                .collect(),
            parent: parent.map(EngineHash),
        }),
        Op::Remove { w, tier, engines } => Event::KvBlocksRemoved(KvBlocksRemoved {
            worker: rank(*w),
            tier: *tier,
            engine_hashes: engines.iter().map(|&e| EngineHash(e)).collect(),
            router_hashes: Vec::new(),
        }),
        Op::Clear { w, tier } => Event::KvCacheCleared(KvCacheCleared {
            worker: rank(*w),
            tier: *tier,
        }),
        Op::Down { worker } => Event::WorkerDeregistered(WorkerDeregistered {
            worker: WorkerId::new(format!("w{worker}:80")),
            reason: "lease expired".to_owned(),
        }),
    }
}

fn envelope(seq: u64, event: Event) -> Envelope {
    Envelope {
        v: 1,
        seq,
        ts_us: seq,
        source: None,
        event,
    }
}

/// Runs `q` on `ix` and checks it against the model; also checks every rank as a candidate.
fn check_query(ix: &KvIndex, model: &Model, q: &Query) -> Result<(), TestCaseError> {
    let blocks: Vec<BlockHash> = q.blocks.iter().map(|&b| BlockHash(b)).collect();
    let slots: Vec<WorkerSlot> = q
        .cands
        .iter()
        .filter_map(|c| match c {
            Cand::Rank(i) => ix.slot(&rank(*i)),
            Cand::Raw(s) => Some(WorkerSlot(*s)),
        })
        .collect();
    let mut out = vec![7; 3];
    ix.overlap(q.tier, &blocks, &slots, &mut out);
    let want: Vec<u32> = slots
        .iter()
        .map(|&s| model.overlap(ix.worker_of(s), q.tier, &blocks))
        .collect();
    prop_assert_eq!(&out, &want, "query {:?} slots {:?}", q, slots);

    let all: Vec<WorkerRank> = (0..RANKS).map(rank).collect();
    let all_slots: Vec<WorkerSlot> = all.iter().filter_map(|w| ix.slot(w)).collect();
    ix.overlap(q.tier, &blocks, &all_slots, &mut out);
    let want: Vec<u32> = all_slots
        .iter()
        .map(|&s| model.overlap(ix.worker_of(s), q.tier, &blocks))
        .collect();
    prop_assert_eq!(out, want, "all ranks, query {:?}", q);
    Ok(())
}

fn check_state(ix: &KvIndex, model: &Model, op: &Op) -> Result<(), TestCaseError> {
    if let Err(e) = ix.check_invariants() {
        return Err(TestCaseError::fail(format!(
            "invariant broken after {op:?}: {e}"
        )));
    }
    prop_assert_eq!(ix.entries(), model.entries(), "entries after {:?}", op);
    prop_assert_eq!(ix.unknown_removals(), model.unknown_removals);
    prop_assert_eq!(ix.mismatched_events(), model.mismatched);
    for i in 0..RANKS {
        let w = rank(i);
        let slot = ix.slot(&w);
        prop_assert_eq!(
            slot.is_some(),
            model.slotted.contains(&w),
            "slot of {} after {:?}",
            w,
            op
        );
        if let Some(s) = slot {
            prop_assert_eq!(ix.worker_of(s), Some(&w));
        }
        for t in TIERS {
            prop_assert_eq!(
                ix.blocks_of(&w, t),
                model.held(&w, t).len(),
                "{} {:?}",
                w,
                t
            );
        }
    }
    for ((w, t), m) in &model.maps {
        for (&e, &r) in m {
            prop_assert_eq!(ix.router_hash(w, *t, e), Some(r));
        }
    }
    if let Op::Remove { w, tier, engines } = op {
        for &e in engines {
            prop_assert_eq!(ix.router_hash(&rank(*w), *tier, EngineHash(e)), None);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn index_matches_naive_model(
        padding in prop_oneof![Just(0usize), 0usize..130],
        ops in prop::collection::vec((op(), query()), 1..40),
        queries in prop::collection::vec(query(), 3),
    ) {
        let mut ix = KvIndex::new();
        for p in 0..padding {
            ix.ensure_slot(&WorkerRank::new(WorkerId::new(format!("pad{p}:1")), 0));
        }
        let mut model = Model::default();
        for (seq, (op, q)) in ops.iter().enumerate() {
            ix.apply(&envelope(seq as u64 + 1, event_of(op)));
            model.apply(op);
            check_state(&ix, &model, op)?;
            check_query(&ix, &model, q)?;
            for q in &queries {
                check_query(&ix, &model, q)?;
            }
        }

        let dump = ix.dump();
        let keys: Vec<(WorkerRank, Tier, Vec<EngineHash>)> = dump
            .iter()
            .filter_map(|e| match e {
                Event::KvBlocksStored(s) => Some((s.worker.clone(), s.tier, s.engine_hashes.clone())),
                _ => None,
            })
            .collect();
        prop_assert_eq!(keys.len(), dump.len(), "a dump holds only stored events");
        prop_assert!(keys.windows(2).all(|p| (&p[0].0, p[0].1) < (&p[1].0, p[1].1)), "dump order");
        prop_assert!(keys.iter().all(|k| k.2.windows(2).all(|p| p[0] < p[1])), "engine order");

        let mut back = KvIndex::new();
        for (seq, event) in dump.into_iter().enumerate() {
            back.apply(&envelope(seq as u64 + 1, event));
        }
        prop_assert!(back == ix, "rebuilt {:?} != {:?}", back, ix);
        if let Err(e) = back.check_invariants() {
            return Err(TestCaseError::fail(format!("rebuilt index: {e}")));
        }
        let mut out_a = Vec::new();
        let mut out_b = Vec::new();
        for q in ops.iter().map(|(_, q)| q).chain(&queries) {
            let blocks: Vec<BlockHash> = q.blocks.iter().map(|&b| BlockHash(b)).collect();
            let ranks: Vec<WorkerRank> = (0..RANKS).map(rank).collect();
            let a: Vec<WorkerSlot> = ranks.iter().filter_map(|w| ix.slot(w)).collect();
            let b: Vec<WorkerSlot> =
                ranks.iter().map(|w| back.slot(w).unwrap_or(WorkerSlot(999))).collect();
            ix.overlap(q.tier, &blocks, &a, &mut out_a);
            back.overlap(q.tier, &blocks, &b, &mut out_b);
            let by_rank_a: BTreeMap<&WorkerRank, u32> =
                a.iter().zip(&out_a).filter_map(|(s, &n)| ix.worker_of(*s).map(|w| (w, n))).collect();
            for (w, &n) in ranks.iter().zip(&out_b) {
                prop_assert_eq!(by_rank_a.get(w).copied().unwrap_or(0), n, "{} after rebuild", w);
            }
        }
    }
}
