//! Model-based properties of the routing policies (1,000 cases each).
//!
//! The two that the load model exists for: sequential turns of one conversation on an idle
//! fleet stay on the worker that holds their prefix, and a burst of identical prompts decided
//! before any KV event spreads over the fleet.

use infera_core::event::{
    Engine, Envelope, Event, KvBlocksStored, RequestFinished, RequestPrefilled, RequestStatus,
    RequestTransport, Role, Tier, WorkerRecord, WorkerRegistered,
};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::ids::{BlockHash, EngineHash, RequestId, WorkerId, WorkerRank};
use infera_core::policy::{RouteRequest, Router, RouterConfig, Weights, score_candidates};
use infera_core::projection::Projection;
use proptest::prelude::*;

const BS: u32 = 4;

fn record(i: usize) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(format!("w{i}:80")),
        url: format!("http://w{i}:80"),
        model_name: "m".into(),
        engine: Engine::Vllm,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: BS,
        dp_rank: 0,
        dp_size: 1,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: Default::default(),
    }
}

struct World {
    fleet: FleetState,
    seq: u64,
}

impl World {
    fn new(n: usize) -> Self {
        let mut w = Self {
            fleet: FleetState::new(FleetConfig::default()),
            seq: 0,
        };
        for i in 0..n {
            w.apply(Event::WorkerRegistered(WorkerRegistered {
                record: record(i),
            }));
        }
        w
    }

    fn apply(&mut self, event: Event) {
        self.seq += 1;
        self.fleet.apply(&Envelope {
            v: 1,
            seq: self.seq,
            ts_us: 0,
            source: None,
            event,
        });
    }

    fn store(&mut self, worker: usize, blocks: &[BlockHash]) {
        self.apply(Event::KvBlocksStored(KvBlocksStored {
            worker: WorkerRank::new(format!("w{worker}:80"), 0),
            tier: Tier::Gpu,
            block_size: BS,
            engine_hashes: blocks
                .iter()
                .map(|b| EngineHash(b.0.rotate_left(7)))
                .collect(),
            router_hashes: blocks.to_vec(),
            parent: None,
        }));
    }

    fn finish(&mut self, id: &RequestId) {
        self.apply(Event::RequestFinished(RequestFinished {
            request_id: id.clone(),
            status: RequestStatus::Ok,
            ttft_us: None,
            tokens_in: 0,
            tokens_out: 0,
            cached_tokens: None,
        }));
    }
}

/// The worker index of a rank named `w{i}:80`.
fn worker_index(rank: &WorkerRank) -> usize {
    rank.worker.as_str()[1..]
        .split(':')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("worker id")
}

/// A prompt as chained block ids: a shared root of `shared` blocks then private ones.
fn prompt(root: u64, shared: usize, private_seed: u64, len: usize) -> Vec<BlockHash> {
    (0..len)
        .map(|i| {
            if i < shared {
                BlockHash(root * 1000 + i as u64)
            } else {
                BlockHash(1_000_000 + private_seed * 10_000 + i as u64)
            }
        })
        .collect()
}

fn req(id: String, blocks: Vec<BlockHash>) -> RouteRequest {
    RouteRequest {
        request_id: RequestId::new(id),
        model: "m".into(),
        prompt_tokens: blocks.len() as u32 * BS,
        hashes: vec![(BS, blocks)],
        retention: None,
        per_worker: Default::default(),
        exclude: vec![],
        session: None,
        kvd: Vec::new(),
    }
}

/// A fleet with random cached prefixes and random in-flight load.
/// (workers, cached prefixes as (worker, root, len), in-flight prompts as (worker, seed, len)).
type WorldSpec = (usize, Vec<(usize, u64, usize)>, Vec<(usize, u64, usize)>);

fn arb_world() -> impl Strategy<Value = WorldSpec> {
    (2usize..10).prop_flat_map(|n| {
        (
            Just(n),
            prop::collection::vec((0..n, 0u64..4, 1usize..24), 0..12),
            prop::collection::vec((0..n, 0u64..50, 1usize..24), 0..12),
        )
    })
}

fn build(n: usize, stored: &[(usize, u64, usize)], busy: &[(usize, u64, usize)]) -> World {
    let mut w = World::new(n);
    for (worker, root, len) in stored {
        w.store(*worker, &prompt(*root, 24, 0, *len));
    }
    let mut router = Router::new(RouterConfig::default());
    for (i, (worker, seed, len)) in busy.iter().enumerate() {
        let r = req(format!("busy{i}"), prompt(99, 0, *seed, *len));
        let mut d = router.decide(&w.fleet, &r, 0).expect("decision");
        d.legs[0].worker = WorkerRank::new(format!("w{worker}:80"), 0);
        w.apply(Event::RequestRouted(d));
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn weight_zero_picks_the_least_loaded((n, stored, busy) in arb_world(), root in 0u64..4, len in 1usize..24, seed: u64) {
        let w = build(n, &stored, &busy);
        let mut router = Router::new(RouterConfig { overlap_weight: 0.0, seed, ..Default::default() });
        let r = req("q".into(), prompt(root, 24, 7, len));
        let d = router.decide(&w.fleet, &r, 0).expect("decision");
        let cands = w.fleet.candidates("m", Role::Mixed);
        let load = |rank: &WorkerRank| w.fleet.inflight_blocks(rank) as f64;
        let min = cands.iter().map(|c| load(&c.rank)).fold(f64::INFINITY, f64::min);
        prop_assert!((load(&d.legs[0].worker) - min).abs() < 1e-6);
    }

    #[test]
    fn more_overlap_never_raises_cost((n, stored, busy) in arb_world(), target in 0usize..10, len in 2usize..24, have in 0usize..23, weight in 0.0f64..32.0) {
        let mut w = build(n, &stored, &busy);
        let target = target % n;
        let blocks = prompt(42, 24, 0, len);
        let have = have % len;
        w.store(target, &blocks[..have]);
        let r = req("q".into(), blocks.clone());
        let cands = w.fleet.candidates("m", Role::Mixed).to_vec();
        let mut scratch = Default::default();
        let weights = Weights { overlap: weight, resident: 1.0, balance_tokens: 512.0, tiers: Default::default() };
        let before = score_candidates(&w.fleet, &r, &cands, weights, 0, &mut scratch).expect("score");
        w.store(target, &blocks[..have + 1]);
        let after = score_candidates(&w.fleet, &r, &cands, weights, 0, &mut scratch).expect("score");
        for (b, a) in before.iter().zip(&after) {
            prop_assert!(a.overlap >= b.overlap);
            prop_assert!(a.cost <= b.cost + 1e-9, "{} -> {}", b.cost, a.cost);
        }
        let t = &after[target];
        prop_assert_eq!(t.overlap as usize, have + 1);
    }

    #[test]
    fn only_candidates_are_picked((n, stored, busy) in arb_world(), excl in prop::collection::vec(0usize..10, 0..4), root in 0u64..4, temp in prop_oneof![Just(0.0), 0.01f64..2.0], seed: u64) {
        let w = build(n, &stored, &busy);
        let mut router = Router::new(RouterConfig { temperature: temp, seed, ..Default::default() });
        let mut r = req("q".into(), prompt(root, 24, 3, 10));
        r.exclude = excl.iter().map(|i| WorkerRank::new(format!("w{}:80", i % n), 0)).collect();
        let allowed: Vec<WorkerRank> = w.fleet.candidates("m", Role::Mixed).iter().map(|c| c.rank.clone()).filter(|r2| !r.exclude.contains(r2)).collect();
        match router.decide(&w.fleet, &r, 0) {
            Ok(d) => prop_assert!(allowed.contains(&d.legs[0].worker)),
            Err(_) => prop_assert!(allowed.is_empty()),
        }
    }

    #[test]
    fn a_burst_before_any_kv_event_spreads(n in 1usize..12, k in 1usize..200, len in 1usize..40, weight in 0.0f64..32.0, seed: u64) {
        let mut w = World::new(n);
        let mut router = Router::new(RouterConfig { overlap_weight: weight, seed, ..Default::default() });
        let mut counts = vec![0usize; n];
        for i in 0..k {
            let r = req(format!("r{i}"), prompt(0, 0, i as u64, len));
            let d = router.decide(&w.fleet, &r, i as u64).expect("decision");
            counts[worker_index(&d.legs[0].worker)] += 1;
            w.apply(Event::RequestRouted(d));
        }
        let bound = k.div_ceil(n) + 1;
        prop_assert!(counts.iter().all(|c| *c <= bound), "{counts:?} > {bound}");
    }

    #[test]
    fn a_burst_of_identical_prompts_spreads(n in 2usize..12, k in 2usize..200, len in 1usize..40, weight in 0.0f64..=1.0, prefilled in prop::collection::vec(any::<bool>(), 200), seed: u64) {
        // No KV event arrives during the burst; some requests reach their first byte.
        let mut w = World::new(n);
        let mut router = Router::new(RouterConfig { overlap_weight: weight, seed, ..Default::default() });
        let mut counts = vec![0usize; n];
        let blocks = prompt(5, 40, 0, len);
        for (i, first_byte) in prefilled.iter().take(k).enumerate() {
            let d = router.decide(&w.fleet, &req(format!("r{i}"), blocks.clone()), i as u64).expect("decision");
            counts[worker_index(&d.legs[0].worker)] += 1;
            let id = d.request_id.clone();
            w.apply(Event::RequestRouted(d));
            if *first_byte {
                w.apply(Event::RequestPrefilled(RequestPrefilled { request_id: id }));
            }
        }
        let bound = k.div_ceil(n) + 1;
        prop_assert!(counts.iter().all(|c| *c <= bound), "{counts:?} > {bound}");
    }

    #[test]
    fn sequential_turns_on_an_idle_fleet_stay_with_their_prefix(n in 2usize..12, turns in 2usize..12, system in 1usize..60, turn_len in 0usize..8, other in prop::collection::vec((0usize..12, 0u64..4, 1usize..24), 0..12), weight in 0.01f64..32.0, events_late in any::<bool>(), seed: u64) {
        // Other conversations' prefixes are cached around the fleet; nothing is in flight.
        let mut w = World::new(n);
        for (worker, root, len) in &other {
            w.store(worker % n, &prompt(10 + root, 24, 0, *len));
        }
        let mut router = Router::new(RouterConfig { overlap_weight: weight, seed, ..Default::default() });
        let mut first: Option<WorkerRank> = None;
        for t in 0..turns {
            // Each turn is the whole conversation so far: the system prompt, then every turn.
            let blocks = prompt(1, system, 77, system + (t + 1) * turn_len);
            let d = router.decide(&w.fleet, &req(format!("turn{t}"), blocks.clone()), t as u64 * 1_000).expect("decision");
            let rank = d.legs[0].worker.clone();
            if let Some(f) = &first {
                prop_assert_eq!(&rank, f, "turn {} left the worker holding its prefix", t);
                prop_assert!(d.legs[0].overlap_blocks as usize >= system + t * turn_len);
            }
            first.get_or_insert(rank.clone());
            let id = d.request_id.clone();
            w.apply(Event::RequestRouted(d));
            // The engine's KV events come while the request runs, or just before it ends.
            if !events_late {
                w.store(worker_index(&rank), &blocks);
            }
            w.apply(Event::RequestPrefilled(RequestPrefilled { request_id: id.clone() }));
            if events_late {
                w.store(worker_index(&rank), &blocks);
            }
            w.finish(&id);
        }
    }

    #[test]
    fn decisions_are_deterministic_for_a_seed((n, stored, busy) in arb_world(), seed: u64, temp in prop_oneof![Just(0.0), 0.01f64..2.0]) {
        let w = build(n, &stored, &busy);
        let run = || {
            let mut router = Router::new(RouterConfig { temperature: temp, seed, ..Default::default() });
            (0..20).map(|i| {
                let r = req(format!("r{i}"), prompt(i % 4, 24, i, 8));
                router.decide(&w.fleet, &r, 0).expect("decision").legs[0].worker.clone()
            }).collect::<Vec<_>>()
        };
        prop_assert_eq!(run(), run());
    }
}
