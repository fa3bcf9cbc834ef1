use super::*;
use crate::server::KeyStore;
use crate::server::test_support::{record, state, state_with_keys};
use futures::StreamExt as _;
use infera_core::clock::SystemClock;
use infera_core::event::{KvBlocksStored, Role, Tier, WorkerRegistered};
use infera_core::ids::{BlockHash, EngineHash};
use infera_core::kv_events::EngineBatch;
use infera_core::log::MemoryLog;

/// A durable log in which `workers` registered and each stored 3 blocks at engine seq 5.
async fn logged(workers: &[&str]) -> Arc<dyn EventLog> {
    let log = MemoryLog::new(Arc::new(SystemClock));
    for (i, id) in workers.iter().enumerate() {
        let base = 100 * i as u64;
        log.append(vec![
            NewEvent::new(Event::WorkerRegistered(WorkerRegistered {
                record: record(id),
            })),
            NewEvent::from_source(
                Source {
                    worker: WorkerId::new(*id),
                    dp_rank: 0,
                    seq: Some(5),
                },
                Event::KvBlocksStored(KvBlocksStored {
                    worker: WorkerRank::new(*id, 0),
                    tier: Tier::Gpu,
                    block_size: 16,
                    engine_hashes: (base..base + 3).map(EngineHash).collect(),
                    router_hashes: (base..base + 3).map(BlockHash).collect(),
                    parent: None,
                }),
            ),
        ])
        .await
        .expect("append");
    }
    Arc::new(log)
}

fn blocks(st: &ServerState, id: &str) -> usize {
    st.service()
        .with_fleet(|f| f.index().blocks_of(&WorkerRank::new(id, 0), Tier::Gpu))
}

fn empty_batch() -> EngineBatch {
    EngineBatch {
        ts: 0.0,
        dp_rank: None,
        events: Vec::new(),
        skipped_unknown: 0,
        malformed: Vec::new(),
    }
}

#[tokio::test]
async fn a_returning_worker_keeps_its_index_only_if_its_events_continue() {
    let st = state();
    let durable = attach(
        &st,
        logged(&["steady", "missed", "changed", "silent"]).await,
    )
    .await
    .expect("attach");
    for id in ["steady", "missed", "silent"] {
        st.register_worker(record(id));
        assert_eq!(blocks(&st, id), 3, "{id} restored at registration");
    }
    let mut other = record("changed");
    other.url = "http://elsewhere".into();
    st.register_worker(other);
    assert_eq!(
        blocks(&st, "changed"),
        0,
        "a changed record is not restored"
    );

    // Seq 6 continues seq 5: kept. Seq 9 reveals missed batches: cleared. No seq at all
    // (ATOM) cannot be verified: cleared.
    st.ingest_kv_batch(&WorkerRank::new("steady", 0), Some(6), &empty_batch());
    st.ingest_kv_batch(&WorkerRank::new("missed", 0), Some(9), &empty_batch());
    st.ingest_kv_batch(&WorkerRank::new("silent", 0), None, &empty_batch());
    assert_eq!(blocks(&st, "steady"), 3);
    assert_eq!(blocks(&st, "missed"), 0);
    assert_eq!(blocks(&st, "silent"), 0);
    // The check runs once: later batches are ordinary.
    st.ingest_kv_batch(&WorkerRank::new("steady", 0), Some(20), &empty_batch());
    assert_eq!(blocks(&st, "steady"), 3);
    // What the restore re-commits keeps the logged seq: a log folded from this server's
    // own commits expects the same continuation.
    let again = MemoryLog::new(Arc::new(SystemClock));
    let local = st.lock().kernel.log().clone();
    let envs = local.read(1, usize::MAX).await.expect("local log");
    again
        .append(
            envs.iter()
                .map(|e| NewEvent {
                    source: e.source.clone(),
                    event: e.event.clone(),
                })
                .collect(),
        )
        .await
        .expect("append");
    let (restored, _) = restore(&again).await.expect("restore");
    assert_eq!(
        restored[&WorkerId::new("steady")].last_seq.get(&0),
        Some(&5)
    );
    // A worker restored once is not restored again after it leaves and returns.
    st.deregister_worker(WorkerId::new("steady"), "gone".into());
    st.register_worker(record("steady"));
    assert_eq!(blocks(&st, "steady"), 0);
    st.service().close_taps();
    durable.close(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn commits_are_written_behind_and_peers_requests_are_applied() {
    let log = logged(&[]).await;
    let a = state();
    let b = state();
    let da = attach(&a, log.clone()).await.expect("attach a");
    let db = attach(&b, log.clone()).await.expect("attach b");
    a.register_worker(record("w"));
    b.register_worker(record("w"));
    let routed = Event::RequestRouted(infera_core::event::RequestRouted {
        request_id: infera_core::ids::RequestId::new("r1"),
        model: "m".into(),
        legs: vec![infera_core::event::RoutedLeg {
            worker: WorkerRank::new("w", 0),
            role: Role::Mixed,
            overlap_blocks: 0,
        }],
        blocks: vec![BlockHash(1)],
        prompt_tokens: 16,
        policy: "kv-aware".into(),
        weights: Vec::new(),
        top: Vec::new(),
        retention: None,
        at_us: 1,
        tenant: None,
        session: None,
    });
    a.service().apply(vec![NewEvent::new(routed)]);
    // B learns of A's request through the durable log.
    let mut seen = log.subscribe(1);
    let mut stamped = None;
    while stamped.is_none() {
        let env = seen.next().await.expect("stream").expect("envelope");
        if matches!(env.event, Event::RequestRouted(_)) {
            stamped = env.source;
        }
    }
    assert_eq!(stamped.map(|s| s.worker.0), Some(a.replica_id()));
    let rank = WorkerRank::new("w", 0);
    let applied = async {
        while b.service().with_fleet(|f| f.inflight_on(&rank)) == 0 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), applied)
        .await
        .expect("B applies A's request");
    assert_eq!(
        a.service().with_fleet(|f| f.inflight_on(&rank)),
        1,
        "A applied it once"
    );
    a.service().close_taps();
    b.service().close_taps();
    da.close(Duration::from_secs(5)).await;
    db.close(Duration::from_secs(5)).await;
    // B never wrote A's request back: one RequestRouted in the log.
    let all = log.read(1, 1000).await.expect("read");
    let routed = all
        .iter()
        .filter(|e| matches!(e.event, Event::RequestRouted(_)))
        .count();
    assert_eq!(routed, 1);
}

/// A shared log whose subscriptions fail, at their next event, while `cut` is set, and
/// silently drop their events while `stall` is.
#[derive(Debug)]
struct CutLog {
    inner: MemoryLog,
    cut: Arc<std::sync::atomic::AtomicBool>,
    stall: Arc<std::sync::atomic::AtomicBool>,
}

impl CutLog {
    fn new() -> Self {
        Self {
            inner: MemoryLog::new(Arc::new(SystemClock)),
            cut: Arc::default(),
            stall: Arc::default(),
        }
    }
}

#[async_trait::async_trait]
impl EventLog for CutLog {
    async fn append(&self, batch: Vec<NewEvent>) -> Result<infera_core::log::SeqRange, LogError> {
        self.inner.append(batch).await
    }
    async fn read(&self, from: u64, max: usize) -> Result<Vec<Envelope>, LogError> {
        self.inner.read(from, max).await
    }
    async fn last_seq(&self) -> Result<u64, LogError> {
        self.inner.last_seq().await
    }
    async fn snapshot(&self) -> Result<Option<Snapshot>, LogError> {
        self.inner.snapshot().await
    }
    async fn compact(&self, snapshot: Snapshot) -> Result<(), LogError> {
        self.inner.compact(snapshot).await
    }
    fn subscribe(
        &self,
        from: u64,
    ) -> futures::stream::BoxStream<'static, Result<Envelope, LogError>> {
        let (cut, stall) = (Arc::clone(&self.cut), Arc::clone(&self.stall));
        self.inner
            .subscribe(from)
            .filter(move |_| std::future::ready(!stall.load(std::sync::atomic::Ordering::SeqCst)))
            .map(move |item| {
                if cut.load(std::sync::atomic::Ordering::SeqCst) {
                    Err(LogError::Backend("cut off".into()))
                } else {
                    item
                }
            })
            .boxed()
    }
}

fn team_routed(id: &str) -> NewEvent {
    NewEvent::new(Event::RequestRouted(infera_core::event::RequestRouted {
        request_id: infera_core::ids::RequestId::new(id),
        model: "m".into(),
        legs: vec![infera_core::event::RoutedLeg {
            worker: WorkerRank::new("w", 0),
            role: Role::Mixed,
            overlap_blocks: 0,
        }],
        blocks: Vec::new(),
        prompt_tokens: 100,
        policy: "kv-aware".into(),
        weights: Vec::new(),
        top: Vec::new(),
        retention: None,
        at_us: 1,
        tenant: Some("team".into()),
        session: None,
    }))
}

/// Waits, without a timer, until `done` holds (bounded by a generous timeout).
async fn until(what: &str, done: impl Fn() -> bool) {
    let wait = async {
        while !done() {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .unwrap_or_else(|_| panic!("{what}"));
}

/// Two replicas, A and B, of one tenant `team` with `limits`, on one shared [`CutLog`].
struct Replicas {
    _dir: tempfile::TempDir,
    log: Arc<CutLog>,
    a: ServerState,
    b: ServerState,
    keys_b: KeyStore,
    attached: [DurableLog; 2],
}

impl Replicas {
    async fn start(limits: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys.json");
        let file = format!(
            r#"{{"tenants": [{{"name": "team", "keys": ["sk-team-0123456789abcdef"],
                "limits": {limits}}}]}}"#
        );
        std::fs::write(&path, file).expect("key file");
        let log = Arc::new(CutLog::new());
        let shared: Arc<dyn EventLog> = log.clone();
        let a = state_with_keys(KeyStore::load(&path).expect("keys"));
        let keys_b = KeyStore::load(&path).expect("keys");
        let b = state_with_keys(keys_b.clone());
        let attached = [
            attach(&a, shared.clone()).await.expect("attach a"),
            attach(&b, shared).await.expect("attach b"),
        ];
        Self {
            _dir: dir,
            log,
            a,
            b,
            keys_b,
            attached,
        }
    }

    async fn close(self) {
        self.a.service().close_taps();
        self.b.service().close_taps();
        for d in self.attached {
            d.close(Duration::from_secs(5)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_requests_are_charged_and_a_cut_off_replica_keeps_to_its_share() {
    let r =
        Replicas::start(r#"{"requests_per_minute": 60, "prompt_tokens_per_minute": 6000}"#).await;
    let (a, b, keys_b, cut) = (&r.a, &r.b, &r.keys_b, &r.log.cut);
    let standing = || {
        let team = keys_b.tenants().named("team").cloned().expect("team");
        team.usage.standing(b.service().clock().now_us())
    };
    // A's request, and its retry, are charged to B's tenant once: 59 requests left, 5,900 tokens.
    a.service()
        .apply(vec![team_routed("r1#0.1"), team_routed("r1#0.2")]);
    until("B charges A's request", || {
        standing().requests.is_some_and(|(_, left, _)| left == 59)
    })
    .await;
    assert_eq!(standing().tokens.map(|t| t.1), Some(5_900));
    assert_eq!(keys_b.share(), 1);

    // Cut off, B keeps to its share: one of the two replicas it has seen.
    cut.store(true, std::sync::atomic::Ordering::SeqCst);
    a.service().apply(vec![team_routed("r2#0.1")]);
    until("B notices it is cut off", || keys_b.share() == 2).await;
    let metrics = b.service().render_metrics();
    assert!(metrics.contains("infera_tenant_limit_share 2"), "{metrics}");
    // Back in touch, the request it missed is charged and the share is 1 again.
    cut.store(false, std::sync::atomic::Ordering::SeqCst);
    until("B reads the log again", || keys_b.share() == 1).await;
    until("B charges the missed request", || {
        standing().requests.is_some_and(|(_, left, _)| left == 58)
    })
    .await;
    r.close().await;
}

/// A tail that goes silent (a stalled consumer, a half-open connection) is noticed by its own
/// appends not coming back: the replica keeps to its share within [`tail::STALL`], and returns
/// to the whole limit when a peer's event arrives again.
#[tokio::test(start_paused = true)]
async fn a_replica_whose_tail_goes_silent_keeps_to_its_share() {
    let r = Replicas::start(r#"{"requests_per_minute": 60}"#).await;
    let (a, b, keys_b, stall) = (&r.a, &r.b, &r.keys_b, &r.log.stall);
    let peer_events = || {
        let text = b.service().render_metrics();
        text.lines()
            .find_map(|l| l.strip_prefix("infera_event_log_peer_events_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    a.service().apply(vec![team_routed("r1#0.1")]);
    paused_until("B sees A's request", || peer_events() == Some(1)).await;

    // Silence: B's own request goes out and never comes back. Idle peers alone are no sign.
    stall.store(true, std::sync::atomic::Ordering::SeqCst);
    let silent = tokio::time::Instant::now();
    tokio::time::sleep(tail::STALL * 2).await;
    assert_eq!(keys_b.share(), 1, "nothing of B's own is missing yet");
    b.service().apply(vec![team_routed("rb#0.1")]);
    let appended = tokio::time::Instant::now();
    paused_until("B notices", || keys_b.share() != 1).await;
    let noticed = appended.elapsed();
    assert!(silent.elapsed() > noticed);
    assert_eq!(keys_b.share(), 2);
    assert!(
        noticed >= tail::STALL && noticed <= tail::STALL + Duration::from_secs(2),
        "noticed {noticed:?} after its append"
    );
    let metrics = b.service().render_metrics();
    assert!(metrics.contains("infera_tenant_limit_share 2"), "{metrics}");

    // The tail flows again: B reads what it missed, and a peer's request restores the limit.
    stall.store(false, std::sync::atomic::Ordering::SeqCst);
    a.service().apply(vec![team_routed("r2#0.1")]);
    paused_until("B reads A's next request", || peer_events() == Some(2)).await;
    assert_eq!(keys_b.share(), 1);
    r.close().await;
}

/// Waits in paused time (which moves only when every task waits) until `done` holds.
async fn paused_until(what: &str, done: impl Fn() -> bool) {
    let start = tokio::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
