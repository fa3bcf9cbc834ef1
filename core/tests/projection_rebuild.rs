//! Replaying a projection's dump rebuilds it exactly (1,000 random event histories, with workers
//! registering, draining, un-draining and leaving), including through the event log's snapshot +
//! tail path.

use infera_core::clock::VirtualClock;
use infera_core::event::{
    Engine, Event, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, RequestFinished,
    RequestPrefilled, RequestRouted, RequestStatus, RequestTransport, Role, RoutedLeg, Tier,
    WorkerDeregistered, WorkerDraining, WorkerRecord, WorkerRegistered,
};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::ids::{BlockHash, EngineHash, RequestId, WorkerId, WorkerRank};
use infera_core::log::{EventLog, MemoryLog, NewEvent, Snapshot, rebuild};
use infera_core::projection::Projection;
use proptest::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
enum Op {
    Register(u8, u8),
    Deregister(u8),
    Drain(u8, u8),
    Store(u8, u8, bool, Vec<u8>),
    Remove(u8, u8, bool, Vec<u8>),
    Clear(u8, u8),
    Route(u16, u8, u8, Vec<u8>, u64),
    Prefill(u16),
    Finish(u16),
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = || prop::collection::vec(0u8..40, 0..6);
    prop_oneof![
        (0u8..6, 1u8..3).prop_map(|(w, dp)| Op::Register(w, dp)),
        (0u8..6).prop_map(Op::Deregister),
        (0u8..6, 0u8..3).prop_map(|(w, reason)| Op::Drain(w, reason)),
        (0u8..6, 0u8..2, any::<bool>(), hashes()).prop_map(|(w, r, t, h)| Op::Store(w, r, t, h)),
        (0u8..6, 0u8..2, any::<bool>(), hashes()).prop_map(|(w, r, t, h)| Op::Remove(w, r, t, h)),
        (0u8..6, 0u8..2).prop_map(|(w, r)| Op::Clear(w, r)),
        (0u16..30, 0u8..6, 0u8..2, hashes(), 0u64..30_000_000)
            .prop_map(|(id, w, r, h, t)| Op::Route(id, w, r, h, t)),
        (0u16..30).prop_map(Op::Prefill),
        (0u16..30).prop_map(Op::Finish),
    ]
}

fn record(w: u8, dp: u8) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(format!("w{w}:1")),
        url: format!("http://w{w}:1"),
        model_name: "m".into(),
        engine: Engine::Sglang,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: 16,
        dp_rank: 0,
        dp_size: dp as u32,
        request_transport: RequestTransport::Nats,
        kv: None,
        extra: Default::default(),
    }
}

fn to_event(op: &Op) -> Event {
    let rank = |w: u8, r: u8| WorkerRank::new(format!("w{w}:1"), r as u32);
    let tier = |t: bool| if t { Tier::Host } else { Tier::Gpu };
    let id = |i: u16| RequestId::new(format!("r{i}"));
    match op.clone() {
        Op::Register(w, dp) => Event::WorkerRegistered(WorkerRegistered {
            record: record(w, dp),
        }),
        Op::Deregister(w) => Event::WorkerDeregistered(WorkerDeregistered {
            worker: WorkerId::new(format!("w{w}:1")),
            reason: "gone".into(),
        }),
        Op::Drain(w, reason) => Event::WorkerDraining(WorkerDraining {
            worker: WorkerId::new(format!("w{w}:1")),
            reason: format!("reason {reason}"),
        }),
        Op::Store(w, r, t, h) => Event::KvBlocksStored(KvBlocksStored {
            worker: rank(w, r),
            tier: tier(t),
            block_size: 16,
            engine_hashes: h.iter().map(|x| EngineHash(*x as u64 + 500)).collect(),
            router_hashes: h.iter().map(|x| BlockHash(*x as u64 % 25)).collect(),
            parent: None,
        }),
        Op::Remove(w, r, t, h) => Event::KvBlocksRemoved(KvBlocksRemoved {
            worker: rank(w, r),
            tier: tier(t),
            engine_hashes: h.iter().map(|x| EngineHash(*x as u64 + 500)).collect(),
            router_hashes: vec![],
        }),
        Op::Clear(w, r) => Event::KvCacheCleared(KvCacheCleared {
            worker: rank(w, r),
            tier: None,
        }),
        Op::Route(i, w, r, h, t) => Event::RequestRouted(RequestRouted {
            request_id: id(i),
            model: "m".into(),
            legs: vec![RoutedLeg {
                worker: rank(w, r),
                role: Role::Mixed,
                overlap_blocks: h.len() as u32 / 2,
            }],
            blocks: h.iter().map(|x| BlockHash(*x as u64)).collect(),
            prompt_tokens: h.len() as u32 * 16 + 3,
            policy: "kv-aware".into(),
            weights: vec![(Role::Mixed, 1.0)],
            top: vec![],
            retention: None,
            at_us: t,
            tenant: None,
            session: None,
        }),
        Op::Prefill(i) => Event::RequestPrefilled(RequestPrefilled { request_id: id(i) }),
        Op::Finish(i) => Event::RequestFinished(RequestFinished {
            request_id: id(i),
            status: RequestStatus::Ok,
            ttft_us: Some(1),
            tokens_in: 1,
            tokens_out: 1,
            cached_tokens: None,
        }),
    }
}

/// What a reader sees of the worker set: every listed worker with its drain reason, and the
/// number that take new requests.
type Listing = (Vec<(String, Option<String>)>, usize);

fn listing(f: &FleetState) -> Listing {
    let listed = f
        .workers()
        .map(|w| {
            (
                w.worker_id.to_string(),
                f.drain_reason(&w.worker_id).map(str::to_owned),
            )
        })
        .collect();
    (listed, f.worker_count())
}

fn observe(f: &FleetState) -> Vec<(WorkerRank, u64, u64, u64, Vec<u32>)> {
    let probe: Vec<BlockHash> = (0..25).map(BlockHash).collect();
    let mut out = Vec::new();
    let cands = f.candidates("m", Role::Mixed);
    for c in cands {
        let mut ov = Vec::new();
        f.index().overlap(Tier::Gpu, &probe, &[c.slot], &mut ov);
        let mut ov2 = Vec::new();
        f.index()
            .overlap(Tier::Host, &probe[3..], &[c.slot], &mut ov2);
        ov.extend(ov2);
        let indexed = ov.first().copied().unwrap_or(0);
        ov.push(f.expected_overlap_at(c.slot, &probe, indexed));
        out.push((
            c.rank.clone(),
            f.active_blocks(&c.rank),
            f.queued_prefill_tokens(&c.rank),
            f.inflight_blocks(&c.rank),
            ov,
        ));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn dump_then_replay_rebuilds_the_same_fleet(ops in prop::collection::vec(op(), 0..80)) {
        let clock = Arc::new(VirtualClock::new(0));
        let log = MemoryLog::new(clock);
        let envs = log.append_sync(ops.iter().map(|o| NewEvent::new(to_event(o))).collect());
        let mut live = FleetState::new(FleetConfig::default());
        for e in &envs {
            live.apply(e);
        }
        // Through the log: compact at the midpoint with a dump of the state there, then rebuild.
        let mid = envs.len() / 2;
        let mut at_mid = FleetState::new(FleetConfig::default());
        for e in &envs[..mid] {
            at_mid.apply(e);
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let rebuilt = rt.block_on(async {
            log.compact(Snapshot { upto: mid as u64, events: at_mid.dump() }).await.expect("compact");
            let mut fresh = FleetState::new(FleetConfig::default());
            let last = rebuild(&log, &mut fresh).await.expect("rebuild");
            assert_eq!(last, envs.len() as u64);
            fresh
        });
        prop_assert!(live == rebuilt, "log rebuild differs");
        // And directly from a dump of the final state.
        let mut from_dump = FleetState::new(FleetConfig::default());
        let log2 = MemoryLog::new(Arc::new(VirtualClock::new(0)));
        for e in log2.append_sync(live.dump().into_iter().map(NewEvent::new).collect()) {
            from_dump.apply(&e);
        }
        prop_assert!(live == from_dump, "dump rebuild differs");
        prop_assert_eq!(listing(&live), listing(&from_dump));
        prop_assert_eq!(listing(&live), listing(&rebuilt));
        // Draining workers are listed but never candidates.
        for c in live.candidates("m", Role::Mixed) {
            prop_assert!(!live.is_draining(&c.rank.worker), "{:?} drains", c.rank);
        }
        let (listed, routable) = listing(&live);
        let drained = listed.iter().filter(|(_, reason)| reason.is_some()).count();
        prop_assert_eq!(routable + drained, listed.len());
        prop_assert_eq!(observe(&live), observe(&from_dump));
        prop_assert_eq!(observe(&live), observe(&rebuilt));
    }
}
