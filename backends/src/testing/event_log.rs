//! The event log conformance suite: what every [`EventLog`] must do, whatever stores it.
//!
//! A backend's test implements [`EventLogFixture`] (handles on named logs, a clock the suite
//! drives, a way to plant a malformed record) and runs [`event_log_conformance`] or the cases one
//! by one. Each case uses a log of its own name, so cases may share a server. Every wait has a
//! deadline ([`WAIT`]); nothing sleeps to synchronise.
//!
//! [`workload`] is a deterministic, realistic event mix (registrations, KV stores and removals,
//! routed / prefilled / finished requests) for these cases and for benchmarks.

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use infera_core::clock::{Clock, VirtualClock};
use infera_core::event::{
    Engine, Envelope, Event, KvBlocksRemoved, KvBlocksStored, RequestFinished, RequestPrefilled,
    RequestRouted, RequestStatus, RequestTransport, Role, RoutedLeg, Seq, Source, Tier,
    WorkerRecord, WorkerRegistered,
};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::ids::{BlockHash, EngineHash, RequestId, SessionKey, WorkerId, WorkerRank};
use infera_core::log::{EventLog, LogError, NewEvent, SeqRange, Snapshot, rebuild};
use infera_core::projection::Projection;
use std::sync::Arc;
use std::time::Duration;

/// How long the suite waits for an expected envelope.
pub const WAIT: Duration = Duration::from_secs(20);

/// Workers the [`workload`] uses.
pub const WORKLOAD_WORKERS: usize = 4;
/// Blocks per request in the [`workload`].
const BLOCKS_PER_REQUEST: u64 = 4;
/// Tokens per block in the [`workload`].
const BLOCK_SIZE: u32 = 16;

/// A backend under test.
#[async_trait]
pub trait EventLogFixture: Send + Sync {
    /// A new handle, with a connection of its own, on the log called `log` (created empty on
    /// first use). Handles on one name share the data, like server replicas.
    async fn open(&self, log: &str) -> Arc<dyn EventLog>;
    /// The clock every handle stamps envelopes with.
    fn clock(&self) -> Arc<VirtualClock>;
    /// Whether the data outlives every handle (`open` after dropping them all finds it).
    fn durable(&self) -> bool;
    /// Stores something that is not an envelope as the next record of `log`, bypassing the
    /// log's API, and returns its seq; `None` if the backend cannot hold such a record.
    async fn inject_malformed(&self, log: &str) -> Option<Seq>;
}

/// Runs every case against `fixture`.
///
/// # Panics
/// On the first behaviour that differs from the `EventLog` contract.
pub async fn event_log_conformance(fixture: &dyn EventLogFixture) {
    append_and_read(fixture).await;
    read_windows(fixture).await;
    subscribe_history_then_live(fixture).await;
    concurrent_appenders(fixture).await;
    replicas_share_load(fixture).await;
    compact_and_rebuild(fixture).await;
    reopen_keeps_everything(fixture).await;
    malformed_records_are_errors(fixture).await;
}

fn registration(worker: usize) -> NewEvent {
    let id = worker_id(worker);
    NewEvent::from_source(
        Source {
            worker: WorkerId::new(id.clone()),
            dp_rank: 0,
            seq: None,
        },
        Event::WorkerRegistered(WorkerRegistered {
            record: WorkerRecord {
                worker_id: WorkerId::new(id.clone()),
                url: format!("http://{id}"),
                model_name: model_of(worker).to_owned(),
                engine: Engine::Vllm,
                disagg_mode: Role::Mixed,
                disagg_meta: None,
                kv_events_endpoint: None,
                kv_block_size: BLOCK_SIZE,
                dp_rank: 0,
                dp_size: 1,
                request_transport: RequestTransport::Http,
                kv: None,
                extra: serde_json::Map::new(),
            },
        }),
    )
}

fn worker_id(worker: usize) -> String {
    format!("10.0.0.{}:8000", worker + 1)
}

/// The model a [`workload`] worker serves (two per model).
pub fn model_of(worker: usize) -> &'static str {
    if worker.is_multiple_of(2) {
        "model-a"
    } else {
        "model-b"
    }
}

fn rank(worker: usize) -> WorkerRank {
    WorkerRank::new(worker_id(worker), 0)
}

fn blocks(request: u64) -> Vec<u64> {
    (0..BLOCKS_PER_REQUEST)
        .map(|b| request * BLOCKS_PER_REQUEST + b + 1)
        .collect()
}

/// `RequestRouted` for request `id` to `worker` with `overlap` cached blocks of 4.
pub fn routed(id: &str, worker: usize, overlap: u32, at_us: u64) -> NewEvent {
    let n: u64 = id.bytes().map(u64::from).sum();
    NewEvent::new(Event::RequestRouted(RequestRouted {
        request_id: RequestId::new(id),
        model: model_of(worker).to_owned(),
        legs: vec![RoutedLeg {
            worker: rank(worker),
            role: Role::Mixed,
            overlap_blocks: overlap,
        }],
        blocks: blocks(n).into_iter().map(BlockHash).collect(),
        prompt_tokens: BLOCKS_PER_REQUEST as u32 * BLOCK_SIZE,
        policy: "kv-aware".to_owned(),
        weights: vec![(Role::Mixed, 1.0)],
        top: vec![],
        retention: None,
        at_us,
        // Half of them name a tenant and a third a session: the stores keep them, or their absence.
        tenant: n.is_multiple_of(2).then(|| format!("tenant-{}", n % 3)),
        session: n
            .is_multiple_of(3)
            .then(|| SessionKey::of(&format!("s{}", n % 5))),
    }))
}

/// `RequestFinished` for request `id` with `tokens_in` prompt tokens of which `cached` hit.
pub fn finished(id: &str, tokens_in: u32, cached: Option<u32>) -> NewEvent {
    NewEvent::new(Event::RequestFinished(RequestFinished {
        request_id: RequestId::new(id),
        status: RequestStatus::Ok,
        ttft_us: Some(20_000),
        tokens_in,
        tokens_out: 32,
        cached_tokens: cached,
    }))
}

/// `n` events: the workers' registrations, then per request: its blocks stored, routed,
/// prefilled, finished, and (from the ninth request of a worker on) the blocks of the request
/// eight back on that worker removed. Deterministic.
pub fn workload(n: usize) -> Vec<NewEvent> {
    let mut out: Vec<NewEvent> = (0..WORKLOAD_WORKERS).map(registration).collect();
    let mut request = 0u64;
    while out.len() < n {
        let worker = (request % WORKLOAD_WORKERS as u64) as usize;
        let id = format!("req-{request}");
        let source = Source {
            worker: WorkerId::new(worker_id(worker)),
            dp_rank: 0,
            seq: Some(request),
        };
        let hashes = blocks(id.bytes().map(u64::from).sum());
        let engine = |r: u64| EngineHash(r.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        out.push(NewEvent::from_source(
            source.clone(),
            Event::KvBlocksStored(KvBlocksStored {
                worker: rank(worker),
                tier: Tier::Gpu,
                block_size: BLOCK_SIZE,
                engine_hashes: hashes.iter().map(|h| engine(*h + request * 1000)).collect(),
                router_hashes: hashes
                    .iter()
                    .map(|h| BlockHash(*h + request * 1000))
                    .collect(),
                parent: None,
            }),
        ));
        let overlap = (request % (BLOCKS_PER_REQUEST + 1)) as u32;
        out.push(routed(&id, worker, overlap, request * 1_000));
        out.push(NewEvent::new(Event::RequestPrefilled(RequestPrefilled {
            request_id: RequestId::new(id.clone()),
        })));
        let tokens = BLOCKS_PER_REQUEST as u32 * BLOCK_SIZE;
        out.push(finished(&id, tokens, Some(overlap * BLOCK_SIZE)));
        if request >= 8 * WORKLOAD_WORKERS as u64 {
            let old = request - 8 * WORKLOAD_WORKERS as u64;
            let old_hashes = blocks(format!("req-{old}").bytes().map(u64::from).sum());
            out.push(NewEvent::from_source(
                source,
                Event::KvBlocksRemoved(KvBlocksRemoved {
                    worker: rank(worker),
                    tier: Tier::Gpu,
                    engine_hashes: old_hashes.iter().map(|h| engine(*h + old * 1000)).collect(),
                    router_hashes: vec![],
                }),
            ));
        }
        request += 1;
    }
    out.truncate(n);
    out
}

/// Appends `events` in batches of `batch`, returning each batch's range.
pub async fn append_all(log: &dyn EventLog, events: &[NewEvent], batch: usize) -> Vec<SeqRange> {
    let mut ranges = Vec::new();
    for chunk in events.chunks(batch.max(1)) {
        ranges.push(log.append(chunk.to_vec()).await.expect("append"));
    }
    ranges
}

/// Every envelope from `from` to the end, in pages of `page`.
pub async fn read_all(log: &dyn EventLog, from: Seq, page: usize) -> Vec<Envelope> {
    let mut out: Vec<Envelope> = Vec::new();
    let mut next = from;
    loop {
        let got = log.read(next, page).await.expect("read");
        let Some(last) = got.last() else { break };
        next = last.seq + 1;
        out.extend(got);
    }
    out
}

/// The next item of `stream`, within [`WAIT`].
pub async fn next_item(
    stream: &mut BoxStream<'static, Result<Envelope, LogError>>,
) -> Result<Envelope, LogError> {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .unwrap_or_else(|_| panic!("no envelope within {WAIT:?}"))
        .expect("a subscription ends only with an error")
}

fn fleet() -> FleetState {
    FleetState::new(FleetConfig::default())
}

fn assert_matches(envelopes: &[Envelope], first: Seq, events: &[NewEvent]) {
    assert_eq!(envelopes.len(), events.len(), "number of envelopes");
    for (i, (env, want)) in envelopes.iter().zip(events).enumerate() {
        assert_eq!(env.seq, first + i as Seq, "seqs must be contiguous");
        assert_eq!(env.event, want.event, "event at seq {}", env.seq);
        assert_eq!(env.source, want.source, "source at seq {}", env.seq);
    }
}

/// Batches get consecutive seqs from 1, stamped with the log's clock; empty batches change nothing.
pub async fn append_and_read(fixture: &dyn EventLogFixture) {
    let log = fixture.open("append").await;
    let clock = fixture.clock();
    assert_eq!(
        log.last_seq().await.expect("last_seq"),
        0,
        "a new log is empty"
    );
    assert!(log.read(1, 10).await.expect("read").is_empty());
    assert!(log.snapshot().await.expect("snapshot").is_none());
    let events = workload(68);
    let mut expected = Vec::new();
    let mut next = 1;
    for (size, ts) in [(3, 1_000_000), (64, 2_000_000), (1, 3_000_000)] {
        clock.set(1_764_430_000_000_000 + ts);
        let batch: Vec<NewEvent> = events[next as usize - 1..][..size].to_vec();
        let range = log.append(batch).await.expect("append");
        assert_eq!(
            range,
            SeqRange {
                first: next,
                last: next + size as Seq - 1
            }
        );
        expected.push((range, clock.now_us()));
        next += size as Seq;
    }
    let empty = log.append(Vec::new()).await.expect("empty append");
    assert_eq!(
        empty,
        SeqRange {
            first: 69,
            last: 68
        },
        "an empty batch takes no seq"
    );
    assert_eq!(log.last_seq().await.expect("last_seq"), 68);
    let all = log.read(1, 1000).await.expect("read");
    assert_matches(&all, 1, &events);
    for (range, ts) in expected {
        for env in &all[range.first as usize - 1..range.last as usize] {
            assert_eq!(
                env.ts_us, ts,
                "seq {} stamped with its batch's append time",
                env.seq
            );
            assert_eq!(env.v, infera_core::event::EVENT_FORMAT_VERSION);
        }
    }
}

/// `read` serves any window, clamps `from = 0` to 1, and is empty past the end.
pub async fn read_windows(fixture: &dyn EventLogFixture) {
    let log = fixture.open("windows").await;
    let events = workload(100);
    append_all(log.as_ref(), &events, 10).await;
    let seqs = |v: Vec<Envelope>| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(
        seqs(log.read(0, 5).await.expect("read")),
        (1..=5).collect::<Vec<_>>()
    );
    assert_eq!(
        seqs(log.read(37, 10).await.expect("read")),
        (37..=46).collect::<Vec<_>>()
    );
    assert_eq!(
        seqs(log.read(95, 100).await.expect("read")),
        (95..=100).collect::<Vec<_>>()
    );
    assert!(log.read(101, 10).await.expect("read").is_empty());
    assert!(log.read(5000, 10).await.expect("read").is_empty());
    assert!(log.read(1, 0).await.expect("read").is_empty());
    let paged = read_all(log.as_ref(), 1, 7).await;
    assert_matches(&paged, 1, &events);
}

/// A subscription yields history from its start, then appends made through other handles.
pub async fn subscribe_history_then_live(fixture: &dyn EventLogFixture) {
    let a = fixture.open("subscribe").await;
    let b = fixture.open("subscribe").await;
    let events = workload(15);
    a.append(events[..10].to_vec()).await.expect("append");
    let mut sub = a.subscribe(4);
    let mut seen = Vec::new();
    for _ in 4..=10 {
        seen.push(next_item(&mut sub).await.expect("history"));
    }
    assert_matches(&seen, 4, &events[3..10]);
    let mut from_zero = b.subscribe(0);
    assert_eq!(next_item(&mut from_zero).await.expect("first").seq, 1);
    b.append(events[10..13].to_vec()).await.expect("append");
    b.append(events[13..].to_vec()).await.expect("append");
    let mut live = Vec::new();
    for _ in 11..=15 {
        live.push(next_item(&mut sub).await.expect("live"));
    }
    assert_matches(&live, 11, &events[10..]);
}

/// A subscriber that reads while another handle appends one event at a time sees every
/// envelope, in order, and never a gap that is not there (a read racing a commit must not
/// report the commit's envelopes as lost).
pub async fn tail_while_appending(fixture: &dyn EventLogFixture) {
    const N: usize = 300;
    let writer = fixture.open("racing").await;
    let reader = fixture.open("racing").await;
    let events = workload(N);
    let mut sub = reader.subscribe(1);
    let appends = {
        let events = events.clone();
        tokio::spawn(async move {
            for e in events {
                writer.append(vec![e]).await.expect("append");
            }
        })
    };
    let mut seen = Vec::with_capacity(N);
    for _ in 0..N {
        seen.push(
            next_item(&mut sub)
                .await
                .expect("every envelope, no false gap"),
        );
    }
    appends.await.expect("appender");
    assert_matches(&seen, 1, &events);
}

/// Two handles appending at once never share a seq, and each batch stays contiguous.
pub async fn concurrent_appenders(fixture: &dyn EventLogFixture) {
    let a = fixture.open("concurrent").await;
    let b = fixture.open("concurrent").await;
    let batch = |who: &str, i: usize| -> Vec<NewEvent> {
        (0..8)
            .map(|j| finished(&format!("{who}-{i}-{j}"), j, None))
            .collect()
    };
    let run = |log: Arc<dyn EventLog>, who: &'static str| async move {
        let mut out = Vec::new();
        for i in 0..20 {
            let events = batch(who, i);
            out.push((log.append(events.clone()).await.expect("append"), events));
        }
        out
    };
    let (from_a, from_b) = tokio::join!(run(a.clone(), "a"), run(b.clone(), "b"));
    let mut ranges: Vec<(SeqRange, Vec<NewEvent>)> = from_a.into_iter().chain(from_b).collect();
    ranges.sort_by_key(|(r, _)| r.first);
    let mut next = 1;
    for (range, _) in &ranges {
        assert_eq!(
            range.first, next,
            "ranges must tile the log without overlap: {ranges:?}"
        );
        assert_eq!(range.last, range.first + 7);
        next = range.last + 1;
    }
    assert_eq!(a.last_seq().await.expect("last"), 320);
    let all = read_all(b.as_ref(), 1, 100).await;
    for (range, events) in &ranges {
        let got = &all[range.first as usize - 1..range.last as usize];
        assert_matches(got, range.first, events);
    }
}

/// Replicas that fold the shared log see each other's routing decisions and so the same load.
pub async fn replicas_share_load(fixture: &dyn EventLogFixture) {
    let a = fixture.open("replicas").await;
    let b = fixture.open("replicas").await;
    a.append((0..WORKLOAD_WORKERS).map(registration).collect())
        .await
        .expect("register");
    let (mut state_a, mut state_b) = (fleet(), fleet());
    let (mut sub_a, mut sub_b) = (a.subscribe(1), b.subscribe(1));
    a.append(vec![routed("from-a", 0, 1, 1_000)])
        .await
        .expect("route a");
    b.append(vec![routed("from-b", 1, 2, 2_000)])
        .await
        .expect("route b");
    let last = b.last_seq().await.expect("last");
    for (state, sub) in [(&mut state_a, &mut sub_a), (&mut state_b, &mut sub_b)] {
        for _ in 1..=last {
            state.apply(&next_item(sub).await.expect("follow"));
        }
    }
    for state in [&state_a, &state_b] {
        assert_eq!(
            state.inflight_requests(),
            2,
            "each replica sees both decisions"
        );
        assert!(state.active_blocks(&rank(0)) > 0 && state.active_blocks(&rank(1)) > 0);
    }
    assert!(state_a == state_b, "replicas folding one log agree");
    b.append(vec![finished("from-a", 64, Some(16))])
        .await
        .expect("finish a");
    a.append(vec![finished("from-b", 64, Some(32))])
        .await
        .expect("finish b");
    for (state, sub) in [(&mut state_a, &mut sub_a), (&mut state_b, &mut sub_b)] {
        for _ in 0..2 {
            state.apply(&next_item(sub).await.expect("follow"));
        }
        assert_eq!(state.inflight_requests(), 0, "finishes are shared too");
        assert_eq!(state.active_blocks(&rank(0)), 0);
    }
    assert!(state_a == state_b);
}

/// After `compact`, reads below the snapshot are `Compacted`, and snapshot + tail rebuilds the
/// projection exactly.
pub async fn compact_and_rebuild(fixture: &dyn EventLogFixture) {
    let log = fixture.open("compact").await;
    let events = workload(600);
    append_all(log.as_ref(), &events, 64).await;
    let all = read_all(log.as_ref(), 1, 128).await;
    let (mut at_400, mut live) = (fleet(), fleet());
    for env in &all {
        if env.seq <= 400 {
            at_400.apply(env);
        }
        live.apply(env);
    }
    let snapshot = Snapshot {
        upto: 400,
        events: at_400.dump(),
    };
    log.compact(snapshot.clone()).await.expect("compact");
    for from in [1, 400] {
        assert!(
            matches!(
                log.read(from, 10).await,
                Err(LogError::Compacted { upto: 400 })
            ),
            "read({from}) below the snapshot must say Compacted"
        );
    }
    assert_eq!(
        log.read(401, 3).await.expect("read").first().map(|e| e.seq),
        Some(401)
    );
    assert_eq!(log.snapshot().await.expect("snapshot"), Some(snapshot));
    let mut sub = log.subscribe(1);
    assert!(
        matches!(
            next_item(&mut sub).await,
            Err(LogError::Compacted { upto: 400 })
        ),
        "a subscription below the snapshot must fail, not skip"
    );
    let mut rebuilt = fleet();
    assert_eq!(
        rebuild(log.as_ref(), &mut rebuilt).await.expect("rebuild"),
        600
    );
    assert!(
        rebuilt == live,
        "snapshot + tail must rebuild the live projection"
    );
    let other = fixture.open("compact").await;
    let mut rebuilt_elsewhere = fleet();
    rebuild(other.as_ref(), &mut rebuilt_elsewhere)
        .await
        .expect("rebuild");
    assert!(
        rebuilt_elsewhere == live,
        "another handle rebuilds the same state"
    );
    let ahead = Snapshot {
        upto: 10_000,
        events: vec![],
    };
    assert!(matches!(
        log.compact(ahead).await,
        Err(LogError::SnapshotAhead {
            upto: 10_000,
            last: 600
        })
    ));
    let more = workload(700);
    let range = log
        .append(more[600..].to_vec())
        .await
        .expect("append after compaction");
    assert_eq!(
        range,
        SeqRange {
            first: 601,
            last: 700
        }
    );
    for env in read_all(log.as_ref(), 601, 64).await {
        live.apply(&env);
    }
    let mut at_650 = fleet();
    rebuild_to(log.as_ref(), &mut at_650, 650).await;
    let second = Snapshot {
        upto: 650,
        events: at_650.dump(),
    };
    log.compact(second).await.expect("compact again");
    let mut again = fleet();
    assert_eq!(
        rebuild(log.as_ref(), &mut again).await.expect("rebuild"),
        700
    );
    assert!(again == live, "a second compaction keeps rebuilds exact");
}

/// Folds `log`'s snapshot and tail into `state` up to and including `upto`.
async fn rebuild_to(log: &dyn EventLog, state: &mut FleetState, upto: Seq) {
    let mut next = 1;
    if let Some(snap) = log.snapshot().await.expect("snapshot") {
        for event in snap.events {
            state.apply(&Envelope {
                v: 1,
                seq: snap.upto,
                ts_us: 0,
                source: None,
                event,
            });
        }
        next = snap.upto + 1;
    }
    for env in read_all(log, next, 64).await {
        if env.seq <= upto {
            state.apply(&env);
        }
    }
}

/// A durable log reopened after every handle is gone has the same envelopes and snapshot.
pub async fn reopen_keeps_everything(fixture: &dyn EventLogFixture) {
    if !fixture.durable() {
        return;
    }
    let events = workload(50);
    let (before, snapshot) = {
        let log = fixture.open("reopen").await;
        append_all(log.as_ref(), &events, 16).await;
        let snapshot = Snapshot {
            upto: 20,
            events: events[..4].iter().map(|e| e.event.clone()).collect(),
        };
        log.compact(snapshot.clone()).await.expect("compact");
        (read_all(log.as_ref(), 21, 64).await, snapshot)
    };
    let log = fixture.open("reopen").await;
    assert_eq!(log.last_seq().await.expect("last"), 50);
    assert_eq!(log.snapshot().await.expect("snapshot"), Some(snapshot));
    assert_eq!(read_all(log.as_ref(), 21, 64).await, before);
    let range = log
        .append(workload(51)[50..].to_vec())
        .await
        .expect("append");
    assert_eq!(
        range,
        SeqRange {
            first: 51,
            last: 51
        }
    );
}

/// A stored record that is not an envelope is an error where it is read, never a panic, and
/// the log stays usable around it.
pub async fn malformed_records_are_errors(fixture: &dyn EventLogFixture) {
    let log = fixture.open("malformed").await;
    log.append(workload(3)).await.expect("append");
    let Some(bad) = fixture.inject_malformed("malformed").await else {
        return;
    };
    assert_eq!(bad, 4, "the malformed record is the next one");
    assert_eq!(
        log.read(1, 3)
            .await
            .expect("records before it read fine")
            .len(),
        3
    );
    let err = log.read(1, 10).await.expect_err("reading it is an error");
    assert!(
        err.to_string().contains('4'),
        "the error names the seq: {err}"
    );
    let mut sub = log.subscribe(1);
    for seq in 1..=3 {
        assert_eq!(next_item(&mut sub).await.expect("valid").seq, seq);
    }
    assert!(
        next_item(&mut sub).await.is_err(),
        "the subscription reports it"
    );
    assert!(
        rebuild(log.as_ref(), &mut fleet()).await.is_err(),
        "rebuild reports it"
    );
    let range = log.append(workload(1)).await.expect("append after it");
    assert_eq!(range.first, 5);
    assert_eq!(log.read(5, 10).await.expect("read after it").len(), 1);
}
