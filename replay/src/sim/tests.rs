use super::*;
use crate::trace::{Trace, TraceRequest};
use infera_core::policy::PolicyKind;

/// A synthetic multi-turn trace: `sessions` conversations whose turns extend the previous prompt.
fn conversations(sessions: u64, turns: u64, gap_us: u64) -> Trace {
    let mut requests = Vec::new();
    for t in 0..turns {
        for s in 0..sessions {
            let len = 4 + 3 * t as usize;
            let block_hashes: Vec<u64> = (0..len as u64).map(|b| s * 10_000 + b).collect();
            requests.push(TraceRequest {
                arrival_us: (t * sessions + s) * gap_us,
                request_id: format!("s{s}-t{t}"),
                model: "m".into(),
                input_length: len as u32 * 16,
                output_length: 20 + (s % 5) as u32,
                block_size: 16,
                block_hashes,
                token_ids: None,
                session_id: Some(format!("s{s}")),
                retention: None,
                ttl_seconds: None,
                think_time_us: None,
                lora: None,
                cache_salt: None,
                images: Vec::new(),
                tenant: None,
                priority: None,
            });
        }
    }
    Trace {
        requests,
        source: "synthetic".into(),
        notes: vec![],
    }
}

fn cfg(workers: usize, gpu_blocks: usize) -> SimConfig {
    let mut c = SimConfig {
        workers,
        ..Default::default()
    };
    c.engine.gpu_blocks = gpu_blocks;
    c
}

fn hit_rate(r: &SimResult) -> f64 {
    let blocks: u64 = r.requests.iter().map(|q| q.blocks as u64).sum();
    let hits: u64 = r
        .requests
        .iter()
        .map(|q| (q.gpu_hit_blocks + q.host_hit_blocks + q.disk_hit_blocks) as u64)
        .sum();
    hits as f64 / blocks as f64
}

#[test]
fn every_request_finishes_once_and_blocks_are_conserved() {
    let trace = conversations(12, 6, 20_000);
    let r = run(&trace, &cfg(3, 60)).expect("run");
    assert_eq!(r.requests.len(), trace.requests.len());
    for (i, q) in r.requests.iter().enumerate() {
        assert_eq!(q.index, i);
        assert!(!q.rejected, "{} rejected", q.request_id);
        assert!(q.finish_us >= q.arrival_us + q.ttft_us, "{q:?}");
        assert!(q.ttft_us > 0);
        assert!(q.gpu_hit_blocks + q.host_hit_blocks + q.disk_hit_blocks <= q.blocks);
    }
    for (stored, resident, removed) in &r.block_ledger {
        assert_eq!(*stored, resident + removed);
    }
    // Small caches evicted something, so the ledger is not trivially balanced.
    assert!(r.block_ledger.iter().any(|(_, _, removed)| *removed > 0));
}

#[test]
fn same_seed_same_result_different_seed_may_differ() {
    let trace = conversations(10, 4, 5_000);
    let mut c = cfg(4, 40);
    c.router.temperature = 0.3;
    let a = run(&trace, &c).expect("run");
    let b = run(&trace, &c).expect("run");
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.events, b.events);
}

#[test]
fn kv_aware_keeps_sessions_on_their_cache_and_beats_round_robin() {
    // 15 sessions on 4 workers: round-robin moves every session between turns.
    let trace = conversations(15, 8, 50_000);
    let kv = run(&trace, &cfg(4, 80)).expect("run");
    let mut rr_cfg = cfg(4, 80);
    rr_cfg.router.policy = PolicyKind::ROUND_ROBIN;
    let rr = run(&trace, &rr_cfg).expect("run");
    assert!(
        hit_rate(&kv) > hit_rate(&rr) + 0.1,
        "kv {} rr {}",
        hit_rate(&kv),
        hit_rate(&rr)
    );
    // Later turns of a session mostly stay where the session's prefix is.
    let moves = |r: &SimResult| -> usize {
        (0..15)
            .map(|s| {
                let workers: Vec<&str> = r
                    .requests
                    .iter()
                    .filter(|q| q.request_id.starts_with(&format!("s{s}-")))
                    .map(|q| q.worker.as_str())
                    .collect();
                workers.windows(2).filter(|w| w[0] != w[1]).count()
            })
            .sum()
    };
    assert!(
        moves(&kv) * 2 < moves(&rr),
        "kv moved {} rr moved {}",
        moves(&kv),
        moves(&rr)
    );
}

#[test]
fn weight_zero_balances_requests() {
    let trace = conversations(16, 8, 50_000);
    let mut c = cfg(4, 80);
    c.router.overlap_weight = 0.0;
    let r = run(&trace, &c).expect("run");
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for q in &r.requests {
        *counts.entry(&q.worker).or_default() += 1;
    }
    let max = *counts.values().max().expect("counts");
    let mean = r.requests.len() / 4;
    assert!(max as f64 <= mean as f64 * 1.5, "{counts:?}");
}

#[test]
fn pd_fleet_uses_both_pools() {
    let trace = conversations(8, 3, 30_000);
    let mut c = cfg(4, 200);
    c.pd = Some((1, 2));
    c.router.prefill_overlap_weight = Some(20.0);
    let r = run(&trace, &c).expect("run");
    assert_eq!(r.workers.len(), 3);
    for q in &r.requests {
        assert!(q.worker.starts_with("sim-prefill"), "{q:?}");
        assert!(
            q.decode_worker
                .as_deref()
                .is_some_and(|d| d.starts_with("sim-decode"))
        );
        assert!(q.finish_us >= q.arrival_us + q.ttft_us);
    }
}

#[test]
fn host_tier_turns_gpu_evictions_into_hits() {
    let trace = conversations(20, 5, 40_000);
    let plain = run(&trace, &cfg(2, 30)).expect("run");
    let mut c = cfg(2, 30);
    c.tiers = TierConfig {
        host_blocks: 2_000,
        disk_blocks: 0,
    };
    let tiered = run(&trace, &c).expect("run");
    let host: u32 = tiered.requests.iter().map(|q| q.host_hit_blocks).sum();
    assert!(host > 0);
    assert!(hit_rate(&tiered) > hit_rate(&plain));
    // `none` never reaches disk: with only a disk tier and every request `none`, no disk hits.
    let mut c = cfg(2, 30);
    c.tiers = TierConfig {
        host_blocks: 0,
        disk_blocks: 2_000,
    };
    c.rules = vec!["*:none".parse().expect("rule")];
    let none = run(&trace, &c).expect("run");
    assert_eq!(
        none.requests.iter().map(|q| q.disk_hit_blocks).sum::<u32>(),
        0
    );
    c.rules = vec!["*:long".parse().expect("rule")];
    let long = run(&trace, &c).expect("run");
    assert!(long.requests.iter().map(|q| q.disk_hit_blocks).sum::<u32>() > 0);
}

#[test]
fn bad_settings_are_errors_not_panics() {
    let trace = conversations(2, 2, 1_000);
    assert!(matches!(
        run(&trace, &cfg(0, 10)),
        Err(SimError::Invalid(_))
    ));
    assert!(matches!(run(&trace, &cfg(2, 0)), Err(SimError::Invalid(_))));
    let empty = Trace {
        requests: vec![],
        source: "x".into(),
        notes: vec![],
    };
    assert_eq!(run(&empty, &cfg(2, 10)).err(), Some(SimError::EmptyTrace));
}

#[test]
fn quiet_decode_runs_give_the_same_results_as_step_by_step() {
    let trace = conversations(12, 5, 7_000);
    for pd in [None, Some((1, 2))] {
        let mut fast = cfg(3, 120);
        fast.pd = pd;
        let mut slow = fast.clone();
        slow.step_by_step = true;
        let a = run(&trace, &fast).expect("run");
        let b = run(&trace, &slow).expect("run");
        assert_eq!(a.requests, b.requests);
        assert_eq!(a.block_ledger, b.block_ledger);
        assert_eq!(a.steps, b.steps);
        assert!(a.requests.iter().any(|q| q.output_tokens > 2));
    }
}

#[test]
fn the_front_end_adds_its_hop_to_ttft_and_finish_and_changes_nothing_else() {
    // Busy engines (requests 300 µs apart, sharing prefixes): queueing, batching and routing
    // all matter, and none of them may move.
    let trace = conversations(6, 4, 300);
    let mut alone = cfg(2, 200);
    alone.frontend_us = 0;
    let with = SimConfig {
        frontend_us: 1_000,
        ..alone.clone()
    };
    let a = run(&trace, &alone).expect("run");
    let b = run(&trace, &with).expect("run");
    assert!(
        a.requests.iter().any(|q| q.queue_us > 0),
        "engines are busy"
    );
    for (x, y) in a.requests.iter().zip(&b.requests) {
        assert_eq!(x.worker, y.worker);
        assert_eq!(x.cached_tokens, y.cached_tokens);
        assert_eq!(x.queue_us, y.queue_us);
        assert_eq!(x.tpot_us, y.tpot_us);
        assert_eq!(y.ttft_us, x.ttft_us + 1_000, "{}", x.request_id);
        assert_eq!(y.finish_us, x.finish_us + 1_000, "{}", x.request_id);
    }
    assert_eq!(a.makespan_us, b.makespan_us);
    assert_eq!(a.steps, b.steps);
}

#[test]
fn the_front_end_is_wall_time_not_divided_by_speedup() {
    let trace = conversations(1, 1, 1_000);
    let mut c = cfg(1, 200);
    c.frontend_us = 1_000;
    let one = run(&trace, &c).expect("run");
    c.speedup = 4.0;
    c.engine.speedup = 4.0;
    let four = run(&trace, &c).expect("run");
    let (t1, t4) = (one.requests[0].ttft_us, four.requests[0].ttft_us);
    // The engine's part is four times shorter (to the rounding of µs), the front end's the same.
    assert!((t1 - 1_000).abs_diff(4 * (t4 - 1_000)) <= 4, "{t1} vs {t4}");
}

/// Conversations whose prompts share their first 8 blocks of tokens (a common tool prompt),
/// each running under adapter `a{s % adapters}`.
fn adapter_conversations(sessions: u64, adapters: u64) -> Trace {
    let mut trace = conversations(sessions, 4, 20_000);
    for r in &mut trace.requests {
        let s: u64 = r.session_id.as_deref().unwrap_or("s0")[1..]
            .parse()
            .unwrap_or(0);
        // The shared tool prompt: the same 8 leading ids in every conversation.
        for (b, h) in r.block_hashes.iter_mut().enumerate().take(8) {
            *h = 7_000_000 + b as u64;
        }
        r.input_length = r.input_length.max(8 * 16);
        if r.block_hashes.len() < 8 {
            r.block_hashes = (0..8).map(|b| 7_000_000 + b).collect();
        }
        r.lora = Some(format!("a{}", s % adapters));
    }
    trace
}

#[test]
fn adapters_are_cached_apart_and_a_blind_router_predicts_what_engines_cannot_serve() {
    let trace = adapter_conversations(8, 4);
    let aware = run(&trace, &cfg(4, 4096)).expect("aware run");
    assert!(
        aware.requests.iter().all(|r| !r.rejected),
        "adapters are served"
    );
    let predicted_unserved = |r: &SimResult| -> u64 {
        r.requests
            .iter()
            .map(|q| {
                let served = q.gpu_hit_blocks + q.host_hit_blocks + q.disk_hit_blocks;
                u64::from(q.overlap_blocks.saturating_sub(served))
            })
            .sum()
    };
    assert_eq!(
        predicted_unserved(&aware),
        0,
        "an aware router predicts only real hits"
    );
    let blind = run(
        &trace,
        &SimConfig {
            identity_blind: true,
            ..cfg(4, 4096)
        },
    )
    .expect("blind run");
    assert!(
        predicted_unserved(&blind) > 0,
        "a blind router predicts the shared tool prompt across adapters"
    );
    // The ideal counts the tool prompt once per adapter, not once for the whole trace.
    let mut plain = trace.clone();
    plain.requests.iter_mut().for_each(|r| r.lora = None);
    let (keyed, shared) = (
        crate::trace::summarize(&trace).ideal_hit_rate,
        crate::trace::summarize(&plain).ideal_hit_rate,
    );
    assert!(shared > keyed, "{shared} {keyed}");
}

mod tenants;

/// With small GPU caches and large node kvds, the router's tiered cost (the same as the live
/// one: each worker's kvd publishes its tiers) keeps conversations on the node whose kvd holds
/// them; the GPU-only cost (tier credits 0) scatters them once their GPU copy is evicted. The
/// clients name no sessions (affinity off), so only the cache holds a conversation together.
#[test]
fn the_tiered_cost_sends_turns_to_the_node_whose_kvd_holds_them() {
    let trace = conversations(40, 6, 100_000);
    let mut tiered = cfg(4, 64);
    tiered.router.sessions.mode = infera_core::policy::AffinityMode::Off;
    tiered.tiers = TierConfig {
        host_blocks: 4_000,
        disk_blocks: 0,
    };
    let mut gpu_only = tiered.clone();
    gpu_only.router.tier_weights.host = Some(0.0);
    gpu_only.router.tier_weights.disk = Some(0.0);
    let (t, g) = (
        run(&trace, &tiered).expect("run"),
        run(&trace, &gpu_only).expect("run"),
    );
    let host = |r: &SimResult| r.requests.iter().map(|q| q.host_hit_blocks).sum::<u32>();
    let ttft = |r: &SimResult| {
        let mut v: Vec<u64> = r.requests.iter().map(|q| q.ttft_us).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    assert!(
        hit_rate(&t) > hit_rate(&g) + 0.05,
        "tiered {:.3} vs GPU-only {:.3}",
        hit_rate(&t),
        hit_rate(&g)
    );
    assert!(host(&t) > host(&g), "{} vs {}", host(&t), host(&g));
    assert!(ttft(&t) <= ttft(&g), "{} vs {} us", ttft(&t), ttft(&g));
}
