//! Session playback of synthesized agentic traces: a turn leaves when its predecessor finished
//! plus its think time, and the KV-aware router keeps a conversation on the worker holding it.

use infera_core::policy::PolicyKind;
use infera_replay::report::Summary;
use infera_replay::sim::{self, Playback, SimConfig, SimResult};
use infera_replay::trace::synth::{SynthConfig, synthesize};
use infera_replay::trace::{Trace, summarize};
use std::collections::HashMap;

fn agentic() -> Trace {
    synthesize(&SynthConfig {
        sessions: 16,
        concurrency: 6.0,
        min_turns: 4,
        max_turns: 12,
        seed: 7,
        ..SynthConfig::default()
    })
    .expect("trace")
}

fn config(policy: PolicyKind, playback: Playback) -> SimConfig {
    let mut c = SimConfig {
        workers: 4,
        playback,
        ..SimConfig::default()
    };
    c.router.policy = policy;
    c.engine.gpu_blocks = 1 << 14;
    c
}

/// The workers each session's turns ran on, by session id.
fn workers_by_session(trace: &Trace, r: &SimResult) -> HashMap<String, Vec<String>> {
    let mut m: HashMap<String, Vec<String>> = HashMap::new();
    for (row, out) in trace.requests.iter().zip(&r.requests) {
        let s = row.session_id.clone().expect("session");
        m.entry(s).or_default().push(out.worker.clone());
    }
    m
}

#[test]
fn a_turn_leaves_after_its_predecessor_finished_plus_its_think_time_mixed_or_pd() {
    let trace = agentic();
    let mut cfg = config(PolicyKind::KV_AWARE, Playback::Sessions);
    cfg.speedup = 2.0;
    let pd = SimConfig {
        pd: Some((1, 2)),
        ..cfg.clone()
    };
    for cfg in [cfg, pd] {
        check_session_timing(&trace, &cfg);
    }

    let open = sim::run(&trace, &config(PolicyKind::KV_AWARE, Playback::Timeline)).expect("run");
    for (row, out) in trace.requests.iter().zip(&open.requests) {
        assert_eq!(out.arrival_us, row.arrival_us, "{}", row.request_id);
    }
}

/// Every turn finishes, and each later turn arrives its think time after its predecessor's end.
fn check_session_timing(trace: &Trace, cfg: &SimConfig) {
    let r = sim::run(trace, cfg).expect("run");
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut closed_loop = 0;
    for (i, row) in trace.requests.iter().enumerate() {
        let s = row.session_id.as_deref().expect("session");
        match (last.insert(s, i), row.think_time_us) {
            (Some(prev), Some(think)) => {
                let expected = r.requests[prev].finish_us + think / 2;
                let got = r.requests[i].arrival_us;
                assert!(
                    got.abs_diff(expected) <= 1,
                    "{}: {got} vs {expected}",
                    row.request_id
                );
                closed_loop += 1;
            }
            _ => assert_eq!(r.requests[i].arrival_us, row.arrival_us / 2),
        }
        assert!(r.requests[i].finish_us > 0, "{} finished", row.request_id);
    }
    assert!(closed_loop > trace.requests.len() / 2);
}

/// The share of later turns that ran on the same worker as their predecessor.
fn stay_rate(trace: &Trace, r: &SimResult) -> f64 {
    let (mut stayed, mut later) = (0, 0);
    for workers in workers_by_session(trace, r).values() {
        for pair in workers.windows(2) {
            later += 1;
            stayed += usize::from(pair[0] == pair[1]);
        }
    }
    stayed as f64 / later as f64
}

#[test]
fn one_conversation_at_a_time_stays_on_one_worker_under_kv_aware() {
    let trace = synthesize(&SynthConfig {
        sessions: 6,
        concurrency: 0.02,
        min_turns: 6,
        max_turns: 10,
        seed: 3,
        ..SynthConfig::default()
    })
    .expect("trace");
    let kv = sim::run(&trace, &config(PolicyKind::KV_AWARE, Playback::Sessions)).expect("run");
    // Precondition: the conversations do not overlap (each starts after the last one ended).
    let mut by_arrival: Vec<_> = kv.requests.iter().collect();
    by_arrival.sort_by_key(|o| o.arrival_us);
    for pair in by_arrival.windows(2) {
        assert!(
            pair[1].arrival_us >= pair[0].finish_us,
            "{} overlaps",
            pair[1].request_id
        );
    }
    for (s, workers) in workers_by_session(&trace, &kv) {
        assert!(
            workers.iter().all(|w| *w == workers[0]),
            "{s} moved between workers: {workers:?}"
        );
    }
    let rr = sim::run(&trace, &config(PolicyKind::ROUND_ROBIN, Playback::Sessions)).expect("run");
    let ideal = summarize(&trace).ideal_hit_rate;
    let (kv, rr) = (Summary::of(&kv, ideal), Summary::of(&rr, ideal));
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv-aware {} vs round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
}

#[test]
fn under_load_kv_aware_keeps_more_turns_in_place_and_hits_more_than_round_robin() {
    let trace = agentic();
    let ideal = summarize(&trace).ideal_hit_rate;
    let kv = sim::run(&trace, &config(PolicyKind::KV_AWARE, Playback::Sessions)).expect("run");
    let rr = sim::run(&trace, &config(PolicyKind::ROUND_ROBIN, Playback::Sessions)).expect("run");
    let (kv_stay, rr_stay) = (stay_rate(&trace, &kv), stay_rate(&trace, &rr));
    assert!(
        kv_stay > rr_stay,
        "turns in place: kv-aware {kv_stay} vs round-robin {rr_stay}"
    );
    let (kv, rr) = (Summary::of(&kv, ideal), Summary::of(&rr, ideal));
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv-aware {} vs round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
    println!(
        "turns in place: kv-aware {kv_stay:.3}, round-robin {rr_stay:.3}; hit rate: kv-aware \
         {:.3}, round-robin {:.3}, ideal {ideal:.3}",
        kv.hit_rate, rr.hit_rate
    );
}
