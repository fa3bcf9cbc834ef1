use super::*;
use crate::event::{
    Engine, Envelope, Event, KvBlocksStored, RequestTransport, Tier, WorkerRecord, WorkerRegistered,
};
use crate::fleet::FleetConfig;
use crate::hashing::hash_blocks;
use crate::ids::EngineHash;
use crate::projection::Projection;

fn record(id: &str, role: Role) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(id),
        url: format!("http://{id}"),
        model_name: "m".into(),
        engine: Engine::Vllm,
        disagg_mode: role,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: 4,
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
    fn new(workers: &[(&str, Role)]) -> Self {
        let mut w = World {
            fleet: FleetState::new(FleetConfig::default()),
            seq: 0,
        };
        for (id, role) in workers {
            w.apply(Event::WorkerRegistered(WorkerRegistered {
                record: record(id, *role),
            }));
        }
        w
    }

    fn apply(&mut self, event: Event) {
        self.apply_at(0, event);
    }

    fn apply_at(&mut self, ts_us: u64, event: Event) {
        self.seq += 1;
        let env = Envelope {
            v: 1,
            seq: self.seq,
            ts_us,
            source: None,
            event,
        };
        self.fleet.apply(&env);
    }

    fn store(&mut self, id: &str, blocks: &[BlockHash]) {
        self.apply(Event::KvBlocksStored(KvBlocksStored {
            worker: WorkerRank::new(id, 0),
            tier: Tier::Gpu,
            block_size: 4,
            engine_hashes: blocks.iter().map(|b| EngineHash(b.0 ^ 1)).collect(),
            router_hashes: blocks.to_vec(),
            parent: None,
        }));
    }
}

fn request(id: &str, tokens: &[u32]) -> RouteRequest {
    RouteRequest {
        request_id: RequestId::new(id),
        model: "m".into(),
        prompt_tokens: tokens.len() as u32,
        hashes: vec![(4, hash_blocks(tokens, 4, None))],
        retention: None,
        per_worker: Default::default(),
        exclude: vec![],
        session: None,
        kvd: Vec::new(),
    }
}

#[test]
fn kv_aware_prefers_the_worker_holding_the_prefix() {
    let mut w = World::new(&[
        ("a:1", Role::Mixed),
        ("b:1", Role::Mixed),
        ("c:1", Role::Mixed),
    ]);
    let tokens: Vec<u32> = (0..64).collect();
    let blocks = hash_blocks(&tokens, 4, None);
    w.store("b:1", &blocks[..12]);
    let mut r = Router::new(RouterConfig::default());
    let d = r
        .decide(&w.fleet, &request("r1", &tokens), 0)
        .expect("decision");
    assert_eq!(d.legs.len(), 1);
    assert_eq!(d.legs[0].worker, WorkerRank::new("b:1", 0));
    assert_eq!(d.legs[0].overlap_blocks, 12);
    assert_eq!(d.top[0].worker, WorkerRank::new("b:1", 0));
    assert_eq!(d.blocks.len(), 16);
    assert_eq!(d.policy, "kv-aware");
}

#[test]
fn load_outweighs_a_small_overlap_at_low_weight() {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let tokens: Vec<u32> = (0..64).collect();
    let blocks = hash_blocks(&tokens, 4, None);
    w.store("a:1", &blocks[..2]);
    let mut r = Router::new(RouterConfig {
        overlap_weight: 0.5,
        ..Default::default()
    });
    // Put 40 distinct in-flight blocks on a:1.
    let busy = request("busy", &(1000..1160).collect::<Vec<u32>>());
    let mut d = r.decide(&w.fleet, &busy, 0).expect("decision");
    d.legs[0].worker = WorkerRank::new("a:1", 0);
    w.apply(Event::RequestRouted(d));
    let d = r
        .decide(&w.fleet, &request("r", &tokens), 0)
        .expect("decision");
    assert_eq!(d.legs[0].worker, WorkerRank::new("b:1", 0));
}

#[test]
fn unknown_model_and_no_role_are_distinct_errors() {
    let w = World::new(&[("a:1", Role::Prefill)]);
    let mut r = Router::new(RouterConfig::default());
    let mut req = request("r", &[1, 2, 3, 4]);
    req.model = "nope".into();
    assert_eq!(
        r.decide(&w.fleet, &req, 0),
        Err(RouteError::UnknownModel {
            model: "nope".into(),
            served: vec!["m".into()]
        })
    );
    // Only a prefill pool: not disaggregated, so mixed workers are needed and there are none.
    let err = r
        .decide(&w.fleet, &request("r", &[1, 2, 3, 4]), 0)
        .expect_err("no mixed");
    assert!(matches!(err, RouteError::NoWorker { role: "mixed", .. }));
    assert!(err.is_retryable());
}

#[test]
fn pd_fleet_gets_two_legs_with_role_weights() {
    let w = World::new(&[("p:1", Role::Prefill), ("d:1", Role::Decode)]);
    let cfg = RouterConfig {
        prefill_overlap_weight: Some(20.0),
        decode_overlap_weight: Some(2.0),
        ..Default::default()
    };
    let mut r = Router::new(cfg);
    let d = r
        .decide(&w.fleet, &request("r", &[1, 2, 3, 4]), 0)
        .expect("decision");
    let roles: Vec<Role> = d.legs.iter().map(|l| l.role).collect();
    assert_eq!(roles, vec![Role::Prefill, Role::Decode]);
    assert_eq!(d.weights, vec![(Role::Prefill, 20.0), (Role::Decode, 2.0)]);
}

#[test]
fn retention_hint_scales_the_weight() {
    assert_eq!(retention_scale(Some(Retention::Long)), 2.0);
    assert_eq!(retention_scale(Some(Retention::None)), 0.1);
    assert_eq!(retention_scale(None), 1.0);
    let w = World::new(&[("a:1", Role::Mixed)]);
    let mut r = Router::new(RouterConfig {
        overlap_weight: 3.0,
        ..Default::default()
    });
    let mut req = request("r", &[1, 2, 3, 4]);
    req.retention = Some(Retention::Long);
    let d = r.decide(&w.fleet, &req, 0).expect("decision");
    assert_eq!(d.weights, vec![(Role::Mixed, 6.0)]);
    assert_eq!(d.retention, Some(Retention::Long));
}

#[test]
fn excluded_ranks_are_never_picked() {
    let w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let mut r = Router::new(RouterConfig::default());
    let mut req = request("r", &[1, 2, 3, 4]);
    req.exclude = vec![WorkerRank::new("a:1", 0)];
    for _ in 0..20 {
        let d = r.decide(&w.fleet, &req, 0).expect("decision");
        assert_eq!(d.legs[0].worker.worker.as_str(), "b:1");
    }
    req.exclude.push(WorkerRank::new("b:1", 0));
    assert!(matches!(
        r.decide(&w.fleet, &req, 0),
        Err(RouteError::NoWorker { .. })
    ));
}

#[test]
fn round_robin_rotates_per_candidate_set() {
    let w = World::new(&[
        ("a:1", Role::Mixed),
        ("b:1", Role::Mixed),
        ("c:1", Role::Mixed),
    ]);
    let mut r = Router::new(RouterConfig {
        policy: PolicyKind::ROUND_ROBIN,
        ..Default::default()
    });
    let picks: Vec<String> = (0..6)
        .map(|i| {
            let d = r
                .decide(&w.fleet, &request(&format!("r{i}"), &[1, 2, 3, 4]), 0)
                .expect("d");
            d.legs[0].worker.worker.0.clone()
        })
        .collect();
    assert_eq!(picks, ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1"]);
    // A different candidate set (one excluded) has its own cursor starting at its first member.
    let mut req = request("x", &[1, 2, 3, 4]);
    req.exclude = vec![WorkerRank::new("a:1", 0)];
    let d = r.decide(&w.fleet, &req, 0).expect("d");
    assert_eq!(d.legs[0].worker.worker.as_str(), "b:1");
    assert_eq!(d.policy, "round-robin");
}

#[test]
fn temperature_spreads_choices_but_prefers_cheap_ones() {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let tokens: Vec<u32> = (0..64).collect();
    w.store("a:1", &hash_blocks(&tokens, 4, None));
    let mut r = Router::new(RouterConfig {
        temperature: 0.5,
        seed: 3,
        ..Default::default()
    });
    let mut on_a = 0;
    for i in 0..400 {
        let d = r
            .decide(&w.fleet, &request(&format!("r{i}"), &tokens), 0)
            .expect("d");
        on_a += usize::from(d.legs[0].worker.worker.as_str() == "a:1");
    }
    // p(a) = 1 / (1 + e^-2) ≈ 0.88
    assert!((300..390).contains(&on_a), "on_a = {on_a}");
}

#[test]
fn direct_mode_resolves_named_workers_without_failover() {
    let w = World::new(&[
        ("p:1", Role::Prefill),
        ("d:1", Role::Decode),
        ("m:1", Role::Mixed),
    ]);
    let legs = resolve_direct(&w.fleet, "m:1", None, None).expect("legs");
    assert_eq!(
        legs,
        vec![RoutedLeg {
            worker: WorkerRank::new("m:1", 0),
            role: Role::Mixed,
            overlap_blocks: 0
        }]
    );
    let legs = resolve_direct(&w.fleet, "d:1", Some("p:1"), Some(0)).expect("legs");
    assert_eq!(
        legs.iter().map(|l| l.role).collect::<Vec<_>>(),
        vec![Role::Prefill, Role::Decode]
    );
    assert_eq!(
        resolve_direct(&w.fleet, "zz:1", None, None),
        Err(RouteError::UnknownWorker("zz:1".into()))
    );
    assert!(matches!(
        resolve_direct(&w.fleet, "m:1", None, Some(3)),
        Err(RouteError::UnknownRank { rank: 3, .. })
    ));
}

#[test]
fn a_direct_decision_records_the_named_worker_and_its_cached_overlap() {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let tokens: Vec<u32> = (0..16).collect();
    let req = request("r", &tokens);
    w.store("b:1", &req.hashes[0].1[..3]);
    let router = Router::new(RouterConfig::default());
    let pick = |worker: &str| DirectPick {
        worker: worker.to_owned(),
        prefill: None,
        dp_rank: None,
    };
    let routed = router
        .decide_direct(&w.fleet, &req, &pick("b:1"), 7)
        .expect("direct");
    assert_eq!(routed.policy, "direct");
    assert_eq!(routed.legs.len(), 1);
    assert_eq!(routed.legs[0].worker, WorkerRank::new("b:1", 0));
    assert_eq!(routed.legs[0].overlap_blocks, 3);
    assert_eq!(routed.blocks, req.hashes[0].1);
    // The named worker wins even where the policy would pick another.
    let routed = router
        .decide_direct(&w.fleet, &req, &pick("a:1"), 7)
        .expect("direct");
    assert_eq!(routed.legs[0].worker, WorkerRank::new("a:1", 0));
    assert_eq!(routed.legs[0].overlap_blocks, 0);
    w.apply(Event::WorkerDraining(crate::event::WorkerDraining {
        worker: WorkerId::new("a:1"),
        reason: "pod deleted".into(),
    }));
    assert_eq!(
        router.decide_direct(&w.fleet, &req, &pick("a:1"), 7),
        Err(RouteError::Draining("a:1".into()))
    );
    let mut other = request("r2", &tokens);
    other.model = "other".into();
    assert_eq!(
        router.decide_direct(&w.fleet, &other, &pick("b:1"), 7),
        Err(RouteError::WrongModel {
            worker: "b:1".into(),
            model: "other".into()
        })
    );
}

#[test]
fn a_worker_of_unknown_block_size_is_routed_by_load() {
    let mut w = World::new(&[("a:1", Role::Mixed)]);
    let mut rec = record("b:1", Role::Mixed);
    rec.kv_block_size = 0;
    w.apply(Event::WorkerRegistered(WorkerRegistered { record: rec }));
    let mut r = Router::new(RouterConfig::default());
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..8 {
        let d = r
            .decide(
                &w.fleet,
                &request(&format!("r{i}"), &[1, 2, 3, 4, 5, 6, 7, 8]),
                0,
            )
            .expect("decision");
        seen.insert(d.legs[0].worker.worker.0.clone());
        w.apply(Event::RequestRouted(d));
    }
    assert_eq!(seen.len(), 2, "both workers take load: {seen:?}");
}

#[test]
fn a_worker_that_renders_its_own_way_is_scored_and_charged_with_its_own_hashes() {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    // b's engine renders the prompt with its own template defaults: other tokens, other hashes.
    let fleet_tokens: Vec<u32> = (0..64).collect();
    let b_tokens: Vec<u32> = (1000..1064).collect();
    let b_blocks = hash_blocks(&b_tokens, 4, None);
    w.store("b:1", &b_blocks[..12]);
    let mut r = Router::new(RouterConfig::default());

    // Hashed the fleet's way only, b's cache is invisible: no overlap anywhere.
    let uniform = request("r1", &fleet_tokens);
    let d = r.decide(&w.fleet, &uniform, 0).expect("decision");
    assert_eq!(d.legs[0].overlap_blocks, 0);

    let mut per_worker = request("r2", &fleet_tokens);
    per_worker.per_worker = WorkerHashes {
        workers: vec![(WorkerId::new("b:1"), 1)],
        hashes: vec![(1, 4, b_blocks.clone())],
    };
    let d = r.decide(&w.fleet, &per_worker, 0).expect("decision");
    assert_eq!(d.legs[0].worker, WorkerRank::new("b:1", 0));
    assert_eq!(d.legs[0].overlap_blocks, 12);
    // The blocks charged to b are the ones its engine will store.
    assert_eq!(d.blocks, b_blocks);
    assert_eq!(
        per_worker.blocks_for(&WorkerId::new("a:1"), 4),
        Some(&per_worker.hashes[0].1[..])
    );
    // A rendering without hashes at a block size is a missing block size, as for the fleet's.
    assert_eq!(per_worker.blocks_for(&WorkerId::new("b:1"), 8), None);
}

/// Routes `tokens` at `t_us` with `r`, then finishes it a millisecond later; the worker picked.
fn turn(w: &mut World, r: &mut Router, id: &str, tokens: &[u32], t_us: u64) -> WorkerRank {
    serve(w, r, &request(id, tokens), t_us)
}

/// Routes `req` at `t_us` and finishes it a millisecond later; the worker it went to.
fn serve(w: &mut World, r: &mut Router, req: &RouteRequest, t_us: u64) -> WorkerRank {
    let d = r.decide(&w.fleet, req, t_us).expect("decision");
    let picked = d.legs[0].worker.clone();
    w.apply_at(t_us, Event::RequestRouted(d));
    finish(w, &req.request_id, t_us + 1_000);
    picked
}

/// Request `id` finished at `t_us`.
fn finish(w: &mut World, id: &RequestId, t_us: u64) {
    w.apply_at(
        t_us,
        Event::RequestFinished(crate::event::RequestFinished {
            request_id: id.clone(),
            status: crate::event::RequestStatus::Ok,
            ttft_us: None,
            tokens_in: 0,
            tokens_out: 0,
            cached_tokens: None,
        }),
    );
}

/// A shared system prompt of 32 tokens (8 blocks), then the session's own text.
fn session_prompt(session: u32, len: u32) -> Vec<u32> {
    (0..32)
        .chain((0..len).map(|i| 1_000 * (session + 1) + i))
        .collect()
}

/// Two sessions on two workers that both hold the shared system prompt: session 1's turn ends,
/// and it is thinking when session 2 starts. The workers each one got.
fn two_sessions(seed: u64, resident_weight: f64) -> (WorkerRank, WorkerRank) {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let system = hash_blocks(&session_prompt(0, 0), 4, None);
    w.store("a:1", &system);
    w.store("b:1", &system);
    let mut r = Router::new(RouterConfig {
        resident_weight,
        seed,
        ..RouterConfig::default()
    });
    let first = turn(&mut w, &mut r, "s1", &session_prompt(1, 16), 1_000_000);
    let second = turn(&mut w, &mut r, "s2", &session_prompt(2, 16), 3_000_000);
    (first, second)
}

#[test]
fn a_new_session_avoids_a_worker_where_another_one_is_resident() {
    for seed in 0..16 {
        let (first, second) = two_sessions(seed, 1.0);
        assert_ne!(first, second, "seed {seed}: the sessions share a worker");
    }
    // Without the term, the idle fleet looks even and the second session lands by chance.
    assert!((0..16).any(|seed| {
        let (first, second) = two_sessions(seed, 0.0);
        first == second
    }));
}

/// Three workers and a router with `resident_weight`.
fn three_workers(resident_weight: f64) -> (World, Router) {
    three_workers_with(RouterConfig {
        resident_weight,
        ..RouterConfig::default()
    })
}

/// Three workers and a router with `config`.
fn three_workers_with(config: RouterConfig) -> (World, Router) {
    let w = World::new(&[
        ("a:1", Role::Mixed),
        ("b:1", Role::Mixed),
        ("c:1", Role::Mixed),
    ]);
    (w, Router::new(config))
}

/// Sends `prompts` one after another, `step_us` apart from `step_us` on, each once the
/// previous one finished, the engine announcing each prompt's blocks on the worker picked.
/// The workers picked.
fn one_after_another(
    w: &mut World,
    r: &mut Router,
    prompts: &[Vec<u32>],
    step_us: u64,
) -> Vec<WorkerRank> {
    let mut picks = Vec::new();
    for (k, tokens) in prompts.iter().enumerate() {
        let at = (k as u64 + 1) * step_us;
        let picked = turn(w, r, &format!("t{k}"), tokens, at);
        w.store(picked.worker.as_str(), &hash_blocks(tokens, 4, None));
        picks.push(picked);
    }
    picks
}

#[test]
fn sequential_turns_stay_on_their_worker_with_resident_load_on() {
    for resident_weight in [0.5, 1.0, 4.0] {
        let (mut w, mut r) = three_workers(resident_weight);
        // Another session lives on some worker; ours sends six turns, each the previous
        // prompt plus more, seconds apart.
        let other = turn(&mut w, &mut r, "o", &session_prompt(9, 400), 0);
        let turns: Vec<Vec<u32>> = (1..=6u32).map(|k| session_prompt(1, 64 * k)).collect();
        let picks = one_after_another(&mut w, &mut r, &turns, 5_000_000);
        assert!(
            picks.iter().all(|p| *p == picks[0]),
            "weight {resident_weight}: turns moved: {picks:?}"
        );
        assert_ne!(
            picks[0], other,
            "weight {resident_weight}: the sessions share a worker"
        );
    }
}

#[test]
fn sequential_questions_under_one_system_prompt_stay_with_resident_load_on() {
    // One user, one long system prompt, a new question each time (no history): the earlier
    // questions are other conversations, but all they hold beyond the shared prompt is a
    // question, so they never outweigh the prompt's cache.
    for resident_weight in [0.5, 1.0, 4.0] {
        let (mut w, mut r) = three_workers(resident_weight);
        let questions: Vec<Vec<u32>> = (0..6u32)
            .map(|k| (0..256).chain((0..8).map(|i| 50_000 + 8 * k + i)).collect())
            .collect();
        let picks = one_after_another(&mut w, &mut r, &questions, 2_000_000);
        assert!(
            picks.iter().all(|p| *p == picks[0]),
            "weight {resident_weight}: questions moved: {picks:?}"
        );
    }
}

/// `n` different questions under one 64-token system prompt (16 blocks), sent one after
/// another on three workers at overlap weight 16 and `balance_tokens`; the picks per worker.
fn hot_prefix_picks(balance_tokens: u32, n: u32) -> Vec<usize> {
    let (mut w, mut r) = three_workers_with(RouterConfig {
        overlap_weight: 16.0,
        balance_tokens,
        ..RouterConfig::default()
    });
    let questions: Vec<Vec<u32>> = (0..n)
        .map(|k| (0..64).chain((0..8).map(|i| 70_000 + 8 * k + i)).collect())
        .collect();
    let picks = one_after_another(&mut w, &mut r, &questions, 1_000_000);
    ["a:1", "b:1", "c:1"]
        .iter()
        .map(|id| picks.iter().filter(|p| p.worker.as_str() == *id).count())
        .collect()
}

#[test]
fn a_hot_prefix_spreads_over_workers_with_balance_on() {
    // Each question finishes before the next: in-flight load never moves them off the first
    // holder of the system prompt.
    let mut off = hot_prefix_picks(0, 30);
    off.sort();
    assert_eq!(off, vec![0, 0, 30]);
    // Each pick above the mean costs 4 blocks (16 tokens at block size 4): once its holder is
    // more than four picks ahead, another worker pays the 16-block prompt once.
    for balance_tokens in [16, 32] {
        let on = hot_prefix_picks(balance_tokens, 30);
        assert!(
            on.iter().all(|n| (5..=15).contains(n)),
            "{balance_tokens} tokens: picks per worker {on:?}"
        );
    }
}

#[test]
fn a_prefix_longer_than_the_imbalance_charged_stays_with_balance_on() {
    // At 4 tokens (one block) per pick above the mean, the 16-block prompt moves only once
    // its holder is 16 picks ahead of the mean: in ten questions it is at most 7 ahead.
    let on = hot_prefix_picks(4, 10);
    assert!(on.contains(&10), "picks per worker {on:?}");
}

#[test]
fn sequential_turns_stay_on_their_worker_with_balance_on() {
    // Each turn is a pick on the conversation's worker, but its own earlier turns never count
    // against it, however high the charge.
    for balance_tokens in [16, 512, 4096] {
        let (mut w, mut r) = three_workers_with(RouterConfig {
            balance_tokens,
            ..RouterConfig::default()
        });
        let turns: Vec<Vec<u32>> = (1..=6u32).map(|k| session_prompt(1, 64 * k)).collect();
        let picks = one_after_another(&mut w, &mut r, &turns, 5_000_000);
        assert!(
            picks.iter().all(|p| *p == picks[0]),
            "{balance_tokens} tokens: turns moved: {picks:?}"
        );
    }
}

/// What every registered policy owes its callers: a pick among the candidates, never an excluded
/// rank, both legs of a disaggregated model, and its name on the event.
#[test]
fn every_registered_policy_routes_among_the_candidates() {
    for kind in PolicyKind::all() {
        let mut w = World::new(&[
            ("a:1", Role::Mixed),
            ("b:1", Role::Mixed),
            ("c:1", Role::Mixed),
        ]);
        let mut r = Router::new(RouterConfig {
            policy: kind,
            ..Default::default()
        });
        for i in 0..12 {
            let mut req = request(&format!("r{i}"), &[1, 2, 3, 4, 5, 6, 7, 8]);
            req.exclude = vec![WorkerRank::new("b:1", 0)];
            let d = r.decide(&w.fleet, &req, 0).expect("decision");
            assert_eq!(d.policy, kind.as_str());
            assert_eq!(d.legs.len(), 1, "{kind}");
            assert_ne!(d.legs[0].worker.worker.as_str(), "b:1", "{kind}");
            w.apply(Event::RequestRouted(d));
        }
        let mut pd = World::new(&[("p:1", Role::Prefill), ("d:1", Role::Decode)]);
        let mut r = Router::new(RouterConfig {
            policy: kind,
            ..Default::default()
        });
        let d = r
            .decide(&pd.fleet, &request("pd", &[1, 2, 3, 4]), 0)
            .expect("decision");
        let legs: Vec<(&str, Role)> = d
            .legs
            .iter()
            .map(|l| (l.worker.worker.as_str(), l.role))
            .collect();
        assert_eq!(
            legs,
            [("p:1", Role::Prefill), ("d:1", Role::Decode)],
            "{kind}"
        );
        pd.apply(Event::RequestRouted(d));
    }
}

#[test]
fn policies_are_named_as_registered_and_unknown_names_list_them() {
    let mut names: Vec<&str> = PolicyKind::all().map(PolicyKind::as_str).collect();
    assert_eq!(names[0], "kv-aware", "the default comes first");
    names.sort_unstable();
    let registered = names.len();
    names.dedup();
    assert_eq!(names.len(), registered, "names are unique");
    assert_eq!(PolicyKind::default(), PolicyKind::KV_AWARE);
    assert_eq!(
        "round-robin".parse::<PolicyKind>(),
        Ok(PolicyKind::ROUND_ROBIN)
    );
    let err = PolicyKind::parse("fastest").expect_err("unknown");
    assert!(
        err.to_string()
            .starts_with("unknown routing policy \"fastest\"; registered: kv-aware, round-robin"),
        "{err}"
    );
    let json = serde_json::to_string(&PolicyKind::ROUND_ROBIN).expect("ser");
    assert_eq!(json, "\"round-robin\"");
    let back: PolicyKind = serde_json::from_str(&json).expect("de");
    assert_eq!(back, PolicyKind::ROUND_ROBIN);
    assert!(serde_json::from_str::<PolicyKind>("\"fastest\"").is_err());
}

mod sessions;
mod tiers;
