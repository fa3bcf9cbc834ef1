use super::*;
use crate::event::{
    Engine, KvBlocksStored, RequestStatus, RequestTransport, RoutedLeg, Tier, WorkerDeregistered,
};
use crate::ids::EngineHash;

pub(crate) fn record(id: &str, model: &str, role: Role, dp_size: u32) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(id),
        url: format!("http://{id}"),
        model_name: model.to_owned(),
        engine: Engine::Vllm,
        disagg_mode: role,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: 16,
        dp_rank: 0,
        dp_size,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: Default::default(),
    }
}

fn env(seq: u64, event: Event) -> Envelope {
    Envelope {
        v: 1,
        seq,
        ts_us: seq,
        source: None,
        event,
    }
}

fn routed(id: &str, rank: &WorkerRank, blocks: &[u64], at_us: u64) -> Event {
    Event::RequestRouted(RequestRouted {
        request_id: RequestId::new(id),
        model: "m".into(),
        legs: vec![RoutedLeg {
            worker: rank.clone(),
            role: Role::Mixed,
            overlap_blocks: 1,
        }],
        blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
        prompt_tokens: blocks.len() as u32 * 16,
        policy: "kv-aware".into(),
        weights: vec![],
        top: vec![],
        retention: None,
        at_us,
        tenant: None,
        session: None,
    })
}

/// A successful `RequestFinished` of `id` with no usage.
fn finished(id: &str) -> Event {
    Event::RequestFinished(RequestFinished {
        request_id: RequestId::new(id),
        status: RequestStatus::Ok,
        ttft_us: None,
        tokens_in: 0,
        tokens_out: 0,
        cached_tokens: None,
    })
}

fn fleet_with_two() -> (FleetState, WorkerRank, WorkerRank) {
    let mut f = FleetState::new(FleetConfig::default());
    for (i, id) in ["a:1", "b:1"].iter().enumerate() {
        let ev = Event::WorkerRegistered(WorkerRegistered {
            record: record(id, "m", Role::Mixed, 1),
        });
        f.apply(&env(i as u64 + 1, ev));
    }
    (f, WorkerRank::new("a:1", 0), WorkerRank::new("b:1", 0))
}

#[test]
fn candidates_follow_model_role_and_dp_ranks() {
    let mut f = FleetState::new(FleetConfig::default());
    let recs = [
        record("a:1", "m", Role::Mixed, 2),
        record("p:1", "m", Role::Prefill, 1),
        record("d:1", "m", Role::Decode, 1),
        record("x:1", "other", Role::Mixed, 1),
    ];
    for (i, r) in recs.iter().enumerate() {
        let ev = Event::WorkerRegistered(WorkerRegistered { record: r.clone() });
        f.apply(&env(i as u64 + 1, ev));
    }
    let mixed = f.candidates("m", Role::Mixed);
    assert_eq!(mixed.len(), 2);
    assert_eq!(mixed[1].rank, WorkerRank::new("a:1", 1));
    assert_eq!(f.candidates("m", Role::Prefill).len(), 1);
    assert!(f.is_disaggregated("m"));
    assert!(!f.is_disaggregated("other"));
    let names: Vec<&str> = f.models().into_iter().map(|(m, _)| m).collect();
    assert_eq!(names, ["m", "other"]);
    let gone = Event::WorkerDeregistered(WorkerDeregistered {
        worker: WorkerId::new("a:1"),
        reason: "test".into(),
    });
    f.apply(&env(9, gone));
    assert!(f.candidates("m", Role::Mixed).is_empty());
}

#[test]
fn active_blocks_count_shared_prefixes_once_and_drain_on_finish() {
    let (mut f, a, _) = fleet_with_two();
    f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 10)));
    f.apply(&env(4, routed("r2", &a, &[1, 2, 4], 20)));
    assert_eq!(f.active_blocks(&a), 4);
    assert_eq!(f.queued_prefill_tokens(&a), 2 * (48 - 16));
    f.apply(&env(
        5,
        Event::RequestPrefilled(RequestPrefilled {
            request_id: RequestId::new("r1"),
        }),
    ));
    assert_eq!(f.queued_prefill_tokens(&a), 32);
    f.apply(&env(6, finished("r1")));
    assert_eq!(f.active_blocks(&a), 3);
    f.apply(&env(7, finished("r2")));
    assert_eq!(f.active_blocks(&a), 0);
    assert_eq!(f.queued_prefill_tokens(&a), 0);
    assert_eq!(f.inflight_requests(), 0);
}

#[test]
fn a_finished_request_leaves_no_load_and_no_expectation() {
    let (mut f, a, b) = fleet_with_two();
    let slot = f.index().slot(&a).expect("slot");
    let blocks: Vec<BlockHash> = [1, 2, 3, 4].map(BlockHash).to_vec();
    f.apply(&env(3, routed("r1", &a, &[1, 2, 3, 4], 0)));
    // Before any KV event, the pick's blocks are expected on its rank only.
    assert_eq!(f.expected_overlap_at(slot, &blocks, 0), 4);
    let b_slot = f.index().slot(&b).expect("slot");
    assert_eq!(f.expected_overlap_at(b_slot, &blocks, 0), 0);
    assert_eq!(f.inflight_blocks(&a), 4);
    f.apply(&env(4, finished("r1")));
    assert_eq!(f.inflight_blocks(&a), 0);
    assert_eq!(f.active_blocks(&a), 0);
    assert_eq!(f.expected_overlap_at(slot, &blocks, 0), 0);
    assert_eq!(f.expected_overlap_at(slot, &blocks, 2), 2);
}

#[test]
fn the_expected_cache_extends_the_announced_prefix() {
    let (mut f, a, _) = fleet_with_two();
    let slot = f.index().slot(&a).expect("slot");
    let blocks: Vec<BlockHash> = [1, 2, 3, 4, 5].map(BlockHash).to_vec();
    f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 0)));
    // The engine announced 1..=2; the request in flight computes 3; 4 and 5 are nobody's.
    assert_eq!(f.expected_overlap_at(slot, &blocks, 2), 3);
    // A longer announced prefix is never shortened.
    assert_eq!(f.expected_overlap_at(slot, &blocks, 5), 5);
    assert_eq!(f.expected_overlap_at(slot, &blocks[..2], 0), 2);
}

#[test]
fn identical_requests_load_their_rank_once_each() {
    let (mut f, a, _) = fleet_with_two();
    f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 0)));
    f.apply(&env(4, routed("r2", &a, &[1, 2, 3], 0)));
    assert_eq!(f.active_blocks(&a), 3);
    assert_eq!(f.inflight_blocks(&a), 6);
    assert_eq!(f.inflight_on(&a), 2);
    f.apply(&env(5, finished("r2")));
    assert_eq!(f.inflight_blocks(&a), 3);
}

#[test]
fn dump_rebuilds_an_equal_state() {
    let (mut f, a, b) = fleet_with_two();
    let stored = Event::KvBlocksStored(KvBlocksStored {
        worker: a.clone(),
        tier: Tier::Gpu,
        block_size: 16,
        engine_hashes: vec![EngineHash(7), EngineHash(8)],
        router_hashes: vec![BlockHash(1), BlockHash(2)],
        parent: None,
    });
    f.apply(&env(3, stored));
    f.apply(&env(4, routed("r1", &a, &[1, 2, 3], 10)));
    f.apply(&env(5, routed("r2", &b, &[9], 20)));
    f.apply(&env(
        6,
        Event::RequestPrefilled(RequestPrefilled {
            request_id: RequestId::new("r2"),
        }),
    ));
    f.apply(&env(
        7,
        Event::RequestFinished(RequestFinished {
            request_id: RequestId::new("r1"),
            status: RequestStatus::Ok,
            ttft_us: Some(5),
            tokens_in: 48,
            tokens_out: 3,
            cached_tokens: Some(16),
        }),
    ));
    f.apply(&env(8, drain("b:1", "pod deleted")));
    let mut g = FleetState::new(FleetConfig::default());
    for (i, e) in f.dump().into_iter().enumerate() {
        g.apply(&env(i as u64 + 1, e));
    }
    assert_eq!(f, g);
    assert_eq!(f.inflight_blocks(&a), g.inflight_blocks(&a));
    assert_eq!(g.drain_reason(&WorkerId::new("b:1")), Some("pod deleted"));
    assert_eq!(
        g.candidates("m", Role::Mixed),
        f.candidates("m", Role::Mixed)
    );
}

#[test]
fn a_dump_keeps_only_the_requests_in_flight() {
    let (mut f, a, b) = fleet_with_two();
    let mut seq = 3;
    for i in 0..10_000u64 {
        let rank = if i % 3 == 0 { &b } else { &a };
        f.apply(&env(
            seq,
            routed(&format!("r{i}"), rank, &[i, i + 1], i * 200),
        ));
        if i < 9_999 {
            f.apply(&env(seq + 1, finished(&format!("r{i}"))));
        }
        seq += 2;
    }
    let dump = f.dump();
    // Two workers and the one request in flight.
    let kinds: Vec<&str> = dump.iter().map(Event::kind).collect();
    assert_eq!(
        kinds,
        ["worker_registered", "worker_registered", "request_routed"]
    );
    let mut g = FleetState::new(FleetConfig::default());
    for (i, e) in dump.into_iter().enumerate() {
        g.apply(&env(i as u64 + 1, e));
    }
    assert_eq!(f, g);
    assert_eq!((g.inflight_blocks(&a), g.inflight_blocks(&b)), (0, 2));
}

#[test]
fn a_v3_recent_window_folds_as_nothing() {
    let (mut f, a, _) = fleet_with_two();
    let before = f.clone();
    let window = Event::RecentLoad(crate::event::RecentLoad {
        latest_us: 1_000,
        buckets: vec![crate::event::RecentLoadBucket {
            at_us: 0,
            charges: vec![crate::event::RecentCharge {
                worker: a.clone(),
                blocks: 300,
            }],
        }],
    });
    f.apply(&env(3, window));
    assert_eq!(f, before);
    assert_eq!(f.inflight_blocks(&a), 0);
}

fn drain(id: &str, reason: &str) -> Event {
    Event::WorkerDraining(WorkerDraining {
        worker: WorkerId::new(id),
        reason: reason.into(),
    })
}

fn candidate_workers(f: &FleetState) -> Vec<&str> {
    f.candidates("m", Role::Mixed)
        .iter()
        .map(|c| c.rank.worker.as_str())
        .collect()
}

fn listed(f: &FleetState) -> Vec<&str> {
    f.workers().map(|w| w.worker_id.as_str()).collect()
}

#[test]
fn a_draining_worker_stays_listed_and_loaded_but_is_no_candidate() {
    let (mut f, a, _) = fleet_with_two();
    f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 10)));
    f.apply(&env(4, drain("a:1", "pod deleted")));
    assert_eq!(candidate_workers(&f), ["b:1"]);
    assert_eq!(listed(&f), ["a:1", "b:1"]);
    assert!(f.worker(&WorkerId::new("a:1")).is_some());
    assert!(f.is_draining(&WorkerId::new("a:1")));
    assert!(!f.is_draining(&WorkerId::new("b:1")));
    assert_eq!((f.worker_count(), f.draining_count()), (1, 1));
    // Its in-flight request still loads it, and finishes there.
    assert_eq!(f.active_blocks(&a), 3);
    assert_eq!(f.inflight_on(&a), 1);
    f.apply(&env(
        5,
        Event::RequestFinished(RequestFinished {
            request_id: RequestId::new("r1"),
            status: RequestStatus::Ok,
            ttft_us: None,
            tokens_in: 0,
            tokens_out: 0,
            cached_tokens: None,
        }),
    ));
    assert_eq!(f.active_blocks(&a), 0);
    // A second drain only updates the reason.
    f.apply(&env(6, drain("a:1", "again")));
    assert_eq!(f.drain_reason(&WorkerId::new("a:1")), Some("again"));
    assert_eq!(f.worker_count(), 1);
}

#[test]
fn a_draining_worker_keeps_its_cached_blocks() {
    let (mut f, a, _) = fleet_with_two();
    let stored = Event::KvBlocksStored(KvBlocksStored {
        worker: a.clone(),
        tier: Tier::Gpu,
        block_size: 16,
        engine_hashes: vec![EngineHash(7)],
        router_hashes: vec![BlockHash(1)],
        parent: None,
    });
    f.apply(&env(3, stored));
    f.apply(&env(4, drain("a:1", "pod deleted")));
    assert_eq!(f.index().blocks_of(&a, Tier::Gpu), 1);
}

#[test]
fn a_registration_cancels_a_drain() {
    let (mut f, _, _) = fleet_with_two();
    f.apply(&env(3, drain("a:1", "pod deleted")));
    let again = Event::WorkerRegistered(WorkerRegistered {
        record: record("a:1", "m", Role::Mixed, 1),
    });
    f.apply(&env(4, again));
    assert!(!f.is_draining(&WorkerId::new("a:1")));
    assert_eq!(candidate_workers(&f), ["a:1", "b:1"]);
    assert_eq!(f.worker_count(), 2);
}

#[test]
fn deregistering_a_draining_worker_forgets_the_drain() {
    let (mut f, _, _) = fleet_with_two();
    f.apply(&env(3, drain("a:1", "pod deleted")));
    let gone = Event::WorkerDeregistered(WorkerDeregistered {
        worker: WorkerId::new("a:1"),
        reason: "pod deleted".into(),
    });
    f.apply(&env(4, gone));
    assert_eq!(listed(&f), ["b:1"]);
    assert_eq!((f.worker_count(), f.draining_count()), (1, 0));
    // Back under the same id, it is routable.
    let back = Event::WorkerRegistered(WorkerRegistered {
        record: record("a:1", "m", Role::Mixed, 1),
    });
    f.apply(&env(5, back));
    assert_eq!(candidate_workers(&f), ["a:1", "b:1"]);
}

#[test]
fn draining_an_unknown_worker_changes_nothing() {
    let (mut f, _, _) = fleet_with_two();
    let before = f.clone();
    f.apply(&env(3, drain("z:1", "pod deleted")));
    assert_eq!(f, before);
    assert_eq!(f.draining_count(), 0);
    // It does not pre-drain a worker that registers later.
    let z = Event::WorkerRegistered(WorkerRegistered {
        record: record("z:1", "m", Role::Mixed, 1),
    });
    f.apply(&env(4, z));
    assert!(!f.is_draining(&WorkerId::new("z:1")));
    assert_eq!(candidate_workers(&f), ["a:1", "b:1", "z:1"]);
}

#[test]
fn states_that_differ_only_in_a_drain_are_not_equal() {
    let (f, _, _) = fleet_with_two();
    let mut g = f.clone();
    g.apply(&env(3, drain("a:1", "pod deleted")));
    assert_ne!(f, g);
}

fn at(ts_us: u64, event: Event) -> Envelope {
    Envelope {
        v: 1,
        seq: ts_us,
        ts_us,
        source: None,
        event,
    }
}

fn hashes(blocks: &[u64]) -> Vec<BlockHash> {
    blocks.iter().map(|b| BlockHash(*b)).collect()
}

#[test]
fn a_finished_conversation_stays_resident_for_others_until_the_horizon() {
    let (mut f, a, b) = fleet_with_two();
    let slot_a = f.index().slot(&a).expect("slot");
    let slot_b = f.index().slot(&b).expect("slot");
    f.apply(&at(10, routed("x1", &a, &[1, 2, 3], 10)));
    // In flight it is load, not a resident.
    assert_eq!(f.resident_blocks_at(slot_a, &hashes(&[7, 8]), 0, 10), 0);
    f.apply(&at(1_000, finished("x1")));
    // Another conversation sees it on a, not on b.
    assert_eq!(f.resident_blocks_at(slot_a, &hashes(&[7, 8]), 0, 2_000), 3);
    assert_eq!(f.resident_blocks_at(slot_b, &hashes(&[7, 8]), 0, 2_000), 0);
    // Its own next turn (same prefix, longer) is not charged for its history.
    assert_eq!(
        f.resident_blocks_at(slot_a, &hashes(&[1, 2, 3, 4]), 3, 2_000),
        0
    );
    // A prompt that shares a part of it is another conversation, counted beyond what it
    // shares with the rank.
    assert_eq!(
        f.resident_blocks_at(slot_a, &hashes(&[1, 2, 9, 4]), 0, 2_000),
        3
    );
    assert_eq!(
        f.resident_blocks_at(slot_a, &hashes(&[1, 2, 9, 4]), 2, 2_000),
        1
    );
    // Past the horizon it no longer counts.
    let late = 1_000 + RESIDENT_HORIZON_US + 1;
    assert_eq!(f.resident_blocks_at(slot_a, &hashes(&[7, 8]), 0, late), 0);
}

#[test]
fn a_continued_conversation_leaves_one_tip_and_tips_are_bounded() {
    let (mut f, a, _) = fleet_with_two();
    let slot_a = f.index().slot(&a).expect("slot");
    // Three turns of one conversation on a: only the last counts for others.
    let turns: [&[u64]; 3] = [&[1, 2], &[1, 2, 3, 4], &[1, 2, 3, 4, 5, 6]];
    for (i, blocks) in turns.iter().enumerate() {
        let id = format!("t{i}");
        let t = 100 * (i as u64 + 1);
        f.apply(&at(t, routed(&id, &a, blocks, t)));
        f.apply(&at(t + 50, finished(&id)));
    }
    assert_eq!(f.resident_blocks_at(slot_a, &hashes(&[9]), 0, 1_000), 6);
    // Many one-turn conversations: the newest MAX_TIPS are kept.
    for i in 0..(MAX_TIPS as u64 + 5) {
        let id = format!("c{i}");
        f.apply(&at(2_000 + i, routed(&id, &a, &[100 + i], 2_000 + i)));
        f.apply(&at(2_000 + i, finished(&id)));
    }
    assert_eq!(
        f.resident_blocks_at(slot_a, &hashes(&[9]), 0, 3_000),
        MAX_TIPS as u64
    );
}

#[test]
fn resident_tips_are_soft_state_outside_equality() {
    let (mut f, a, _) = fleet_with_two();
    let (g, _, _) = fleet_with_two();
    f.apply(&at(10, routed("x1", &a, &[1, 2, 3], 10)));
    f.apply(&at(20, finished("x1")));
    assert!(
        f == g,
        "a finished request leaves nothing a rebuild must reproduce"
    );
}

#[test]
fn adapters_are_served_by_the_workers_that_list_them_and_follow_re_registration() {
    let mut f = FleetState::default();
    let mut a = record("a:1", "base", Role::Mixed, 1);
    a.set_lora_adapters(&["sql".to_owned(), "chat".to_owned()]);
    let mut b = record("b:1", "base", Role::Mixed, 1);
    b.set_lora_adapters(&["sql".to_owned()]);
    // A name that is another worker's base model is served as that base model only.
    let mut c = record("c:1", "other", Role::Mixed, 1);
    c.set_lora_adapters(&["base".to_owned()]);
    for (i, r) in [&a, &b, &c].into_iter().enumerate() {
        let ev = Event::WorkerRegistered(WorkerRegistered { record: r.clone() });
        f.apply(&env(i as u64 + 1, ev));
    }
    fn workers(f: &FleetState, model: &str) -> Vec<String> {
        f.candidates(model, Role::Mixed)
            .iter()
            .map(|c| c.rank.worker.to_string())
            .collect()
    }
    assert_eq!(workers(&f, "sql"), ["a:1", "b:1"]);
    assert_eq!(workers(&f, "chat"), ["a:1"]);
    assert_eq!(workers(&f, "base"), ["a:1", "b:1"]);
    let parents: Vec<(&str, Option<&str>)> = f
        .models()
        .into_iter()
        .map(|(m, s)| (m, s.parent.as_deref()))
        .collect();
    assert_eq!(
        parents,
        [
            ("base", None),
            ("chat", Some("base")),
            ("other", None),
            ("sql", Some("base"))
        ]
    );
    // The engine unloaded `chat`: the launcher re-registers and it leaves routing.
    a.set_lora_adapters(&["sql".to_owned()]);
    f.apply(&env(
        4,
        Event::WorkerRegistered(WorkerRegistered { record: a }),
    ));
    assert!(f.served("chat").is_none());
    assert!(workers(&f, "chat").is_empty());
    assert_eq!(workers(&f, "sql"), ["a:1", "b:1"]);
}
