//! A durable, shared event log behind the server (`--event-log` other than `memory`).
//!
//! The server always decides from its in-memory log and fleet (one short lock, no I/O). A
//! durable log ([`EventLog`]: JetStream, SQLite, PostgreSQL) is attached by [`attach`]:
//!
//! - **Write-behind.** One task, fed by a tap ([`ServerState::tap`]), appends every event this
//!   server commits — discovery changes, its KV subscribers' events, its requests — to the
//!   durable log in commit order, one append per committed batch. Request events are stamped with
//!   this replica's source, `router/<replica id>`. The request path never waits for it.
//! - **Sharing.** A tail task follows the durable log from where it stood at attach time and
//!   applies other replicas' `RequestRouted` / `RequestPrefilled` / `RequestFinished` to this
//!   server's fleet, so every replica's load accounting includes its peers' requests. Peers' KV
//!   and discovery events are not applied: each replica consumes those from the source itself.
//! - **Restore.** At attach time the durable log's snapshot and tail are folded into a fleet of
//!   their own; a worker that registers again with the same record gets its KV index back
//!   ([`ServerState::register_worker`] replays its restored blocks right after the
//!   registration), so a restarted server routes by cache affinity at once instead of after the
//!   engines have refilled their caches. The restored index is kept only if the engine's event
//!   stream continues where the log left it: the first batch of each restored rank must carry
//!   the engine sequence number after the last one logged; otherwise (events were missed while
//!   the server was down, the engine restarted, or it sends no sequence numbers) the rank's
//!   restored blocks are cleared before the batch is applied. Restored requests and workers that
//!   do not come back are never applied.
//! - **Compaction.** After every [`COMPACT_EVERY`] appended events the fleet's dump becomes the
//!   durable log's snapshot, so restarts read a bounded tail.
//!
//! # What can be lost (and is counted)
//! A tap that overflows while the store is slow or down loses those events for the durable log
//! (`infera_event_tap_dropped_events_total{tap="event-log"}`); appends that fail are retried with
//! backoff until shutdown (`infera_event_log_append_failures_total`). A peer's events the tail
//! missed (the store compacted past it) are skipped with a warning; a replica that crashed leaves
//! its in-flight requests in its peers' load until they restart. Requests in flight when this
//! server stopped are not restored.

use super::ServerState;
use super::taps::write_family;
use futures::StreamExt as _;
use infera_core::event::{Envelope, Event, Source, WorkerRecord};
use infera_core::fleet::FleetState;
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::log::{EventLog, LogError, NewEvent, Snapshot};
use infera_core::ports::metrics::MetricsSource;
use infera_core::projection::Projection;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The durable log is compacted after this many appended events.
pub const COMPACT_EVERY: u64 = 1 << 16;
/// Batches the write-behind tap holds while the store is slow.
const TAP_CAPACITY: usize = 1 << 16;
/// Source worker ids of router replicas start with this.
pub const REPLICA_PREFIX: &str = "router/";

/// A worker's state as the durable log left it: its record, its KV index, and the last engine
/// sequence number logged for each of its dp ranks.
#[derive(Debug, Clone)]
pub(crate) struct Restored {
    record: WorkerRecord,
    events: Vec<Event>,
    last_seq: HashMap<u32, u64>,
}

/// The restored state of every worker, waiting for each to register again.
pub(crate) type RestoredWorkers = HashMap<WorkerId, Restored>;

/// What [`attach`] leaves in the server state for registrations and KV ingest to consult.
#[derive(Debug, Default)]
pub(crate) struct RestoreState {
    workers: RestoredWorkers,
    /// Ranks whose restored index awaits its first engine batch, with the sequence number that
    /// batch must carry to keep it.
    unverified: HashMap<WorkerRank, Option<u64>>,
    counters: Option<Arc<Counters>>,
}

/// The fleet plus the last engine sequence number of each rank, folded from the durable log.
struct RestoreFold {
    fleet: FleetState,
    last_seq: HashMap<WorkerRank, u64>,
}

impl Projection for RestoreFold {
    fn apply(&mut self, env: &Envelope) {
        if let (Some(source), Some(seq)) = (&env.source, env.source.as_ref().and_then(|s| s.seq))
            && matches!(
                env.event,
                Event::KvBlocksStored(_) | Event::KvBlocksRemoved(_) | Event::KvCacheCleared(_)
            )
        {
            self.last_seq
                .insert(WorkerRank::new(source.worker.clone(), source.dp_rank), seq);
        }
        self.fleet.apply(env);
    }

    fn dump(&self) -> Vec<Event> {
        self.fleet.dump()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    appended: AtomicU64,
    append_failures: AtomicU64,
    peer_events: AtomicU64,
    compactions: AtomicU64,
    restored_workers: AtomicU64,
    restored_ranks_cleared: AtomicU64,
}

impl MetricsSource for Counters {
    fn render(&self, out: &mut String) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let families = [
            (
                "infera_event_log_appended_events_total",
                "counter",
                "Events appended to the durable event log.",
                get(&self.appended),
            ),
            (
                "infera_event_log_append_failures_total",
                "counter",
                "Appends to the durable event log that failed (retried).",
                get(&self.append_failures),
            ),
            (
                "infera_event_log_peer_events_total",
                "counter",
                "Other replicas' request events applied to this server's load accounting.",
                get(&self.peer_events),
            ),
            (
                "infera_event_log_compactions_total",
                "counter",
                "Snapshots written to the durable event log.",
                get(&self.compactions),
            ),
            (
                "infera_event_log_restored_workers_total",
                "counter",
                "Workers whose KV index was restored from the durable log when they registered.",
                get(&self.restored_workers),
            ),
            (
                "infera_event_log_restored_ranks_cleared_total",
                "counter",
                "Restored ranks cleared because the engine's events did not continue the logged sequence.",
                get(&self.restored_ranks_cleared),
            ),
        ];
        for (name, kind, help, v) in families {
            write_family(out, name, kind, help, &[("", v)]);
        }
    }
}

/// The running write-behind and tail tasks.
#[derive(Debug)]
pub struct DurableLog {
    writer: JoinHandle<()>,
    tail: JoinHandle<()>,
    stop_tail: CancellationToken,
}

impl DurableLog {
    /// Stops following peers and waits until everything committed before
    /// [`ServerState::close_taps`] is appended (or `grace` passes: the rest is lost).
    pub async fn close(self, grace: Duration) {
        self.stop_tail.cancel();
        let _ = self.tail.await;
        let abort = self.writer.abort_handle();
        if tokio::time::timeout(grace, self.writer).await.is_err() {
            abort.abort();
            tracing::warn!(
                ?grace,
                "the durable event log did not take every event before shutdown"
            );
        }
    }
}

impl ServerState {
    /// This replica's source id in shared logs (`router/<hex>`).
    pub fn replica_id(&self) -> String {
        format!("{REPLICA_PREFIX}{:016x}", self.inner.id_prefix)
    }
}

/// Attaches `log` to `state` (see the module docs): restores the workers' KV index, then starts
/// the write-behind and tail tasks. Call before discovery starts.
///
/// # Errors
/// The log cannot be read (its snapshot or tail).
pub async fn attach(state: &ServerState, log: Arc<dyn EventLog>) -> Result<DurableLog, LogError> {
    let counters = Arc::new(Counters::default());
    state.add_metrics(counters.clone());
    let (restored, tip) = restore(log.as_ref()).await?;
    tracing::info!(
        workers = restored.len(),
        upto = tip,
        "durable event log read; workers get their KV index back when they register"
    );
    *state.restore_state() = RestoreState {
        workers: restored,
        unverified: HashMap::new(),
        counters: Some(counters.clone()),
    };
    let rx = state.tap("event-log", TAP_CAPACITY);
    let writer = tokio::spawn(write_behind(
        state.clone(),
        log.clone(),
        rx,
        counters.clone(),
    ));
    let stop_tail = CancellationToken::new();
    let tail = tokio::spawn(follow_peers(
        state.clone(),
        log,
        tip + 1,
        counters,
        stop_tail.clone(),
    ));
    Ok(DurableLog {
        writer,
        tail,
        stop_tail,
    })
}

/// Folds the snapshot and the tail; returns each worker's record, KV events and last engine
/// sequence numbers, and the last log sequence number read.
async fn restore(log: &dyn EventLog) -> Result<(RestoredWorkers, u64), LogError> {
    let mut fold = RestoreFold {
        fleet: FleetState::new(Default::default()),
        last_seq: HashMap::new(),
    };
    let tip = infera_core::log::rebuild(log, &mut fold).await?;
    let mut out: RestoredWorkers = HashMap::new();
    for event in fold.fleet.dump() {
        match event {
            Event::WorkerRegistered(w) => {
                let id = w.record.worker_id.clone();
                let last_seq = fold
                    .last_seq
                    .iter()
                    .filter(|(rank, _)| rank.worker == id)
                    .map(|(rank, seq)| (rank.dp_rank, *seq))
                    .collect();
                out.insert(
                    id,
                    Restored {
                        record: w.record,
                        events: Vec::new(),
                        last_seq,
                    },
                );
            }
            Event::KvBlocksStored(ref s) => {
                if let Some(r) = out.get_mut(&s.worker.worker) {
                    r.events.push(event);
                }
            }
            _ => {}
        }
    }
    Ok((out, tip))
}

impl ServerState {
    fn restore_state(&self) -> std::sync::MutexGuard<'_, RestoreState> {
        self.inner
            .restore
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The events that bring back `record`'s restored KV index, if the durable log knew this
    /// worker with the same record (taken: a worker is restored at most once).
    pub(crate) fn take_restored(&self, record: &WorkerRecord) -> Vec<NewEvent> {
        let mut st = self.restore_state();
        let Some(r) = st.workers.remove(&record.worker_id) else {
            return Vec::new();
        };
        if r.record != *record {
            tracing::info!(worker = %record.worker_id.as_str(),
                "worker registered with a changed record; its restored KV index is dropped");
            return Vec::new();
        }
        if r.events.is_empty() {
            return Vec::new();
        }
        for rank in record.dp_rank..record.dp_rank + record.dp_size.max(1) {
            let expected = r.last_seq.get(&rank).map(|s| s + 1);
            st.unverified
                .insert(WorkerRank::new(record.worker_id.clone(), rank), expected);
        }
        if let Some(c) = &st.counters {
            c.restored_workers.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(worker = %record.worker_id.as_str(), batches = r.events.len(),
            "KV index restored from the durable event log");
        // Each restored batch carries its rank's last logged engine seq, so the log keeps it
        // and a later restart can check continuity again.
        r.events
            .into_iter()
            .map(|event| {
                let rank = match &event {
                    Event::KvBlocksStored(s) => Some(s.worker.clone()),
                    _ => None,
                };
                match rank.and_then(|rank| {
                    let seq = r.last_seq.get(&rank.dp_rank).copied()?;
                    Some(Source {
                        worker: rank.worker,
                        dp_rank: rank.dp_rank,
                        seq: Some(seq),
                    })
                }) {
                    Some(source) => NewEvent::from_source(source, event),
                    None => NewEvent::new(event),
                }
            })
            .collect()
    }

    /// Whether `rank`'s restored index must be cleared before a batch with engine sequence
    /// number `seq` is applied (see the module docs). Answers once per restored rank.
    pub(crate) fn restored_index_is_stale(&self, rank: &WorkerRank, seq: Option<u64>) -> bool {
        let mut st = self.restore_state();
        let Some(expected) = st.unverified.remove(rank) else {
            return false;
        };
        let stale = expected.is_none() || seq != expected;
        if stale {
            if let Some(c) = &st.counters {
                c.restored_ranks_cleared.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(worker = %rank.worker.as_str(), dp_rank = rank.dp_rank, ?seq, ?expected,
                "the engine's events do not continue the restored index; clearing it");
        }
        stale
    }
}

fn is_request(event: &Event) -> bool {
    matches!(
        event,
        Event::RequestRouted(_) | Event::RequestPrefilled(_) | Event::RequestFinished(_)
    )
}

fn from_replica(env: &Envelope) -> bool {
    env.source
        .as_ref()
        .is_some_and(|s| s.worker.as_str().starts_with(REPLICA_PREFIX))
}

async fn write_behind(
    state: ServerState,
    log: Arc<dyn EventLog>,
    mut rx: tokio::sync::mpsc::Receiver<super::EventBatch>,
    counters: Arc<Counters>,
) {
    let me = Source {
        worker: WorkerId::new(state.replica_id()),
        dp_rank: 0,
        seq: None,
    };
    let mut since_compaction = 0u64;
    while let Some(batch) = rx.recv().await {
        let events: Vec<NewEvent> = batch
            .iter()
            // Peers' events came from the durable log: never write them back.
            .filter(|env| !from_replica(env))
            .map(|env| NewEvent {
                source: if is_request(&env.event) {
                    Some(me.clone())
                } else {
                    env.source.clone()
                },
                event: env.event.clone(),
            })
            .collect();
        if events.is_empty() {
            continue;
        }
        let n = events.len() as u64;
        let mut backoff = Duration::from_millis(50);
        let range = loop {
            match log.append(events.clone()).await {
                Ok(range) => break range,
                Err(e) => {
                    counters.append_failures.fetch_add(1, Ordering::Relaxed);
                    if !e.is_retryable() {
                        tracing::error!(error = %e, events = n,
                            "durable event log refused an append; those events are lost to it");
                        break infera_core::log::SeqRange { first: 1, last: 0 };
                    }
                    tracing::warn!(error = %e, ?backoff, "durable event log append failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        };
        if range.last < range.first {
            continue;
        }
        counters.appended.fetch_add(n, Ordering::Relaxed);
        since_compaction += n;
        if since_compaction >= COMPACT_EVERY {
            since_compaction = 0;
            let events = state.with_fleet(|f| f.dump());
            match log
                .compact(Snapshot {
                    upto: range.last,
                    events,
                })
                .await
            {
                Ok(()) => {
                    counters.compactions.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "durable event log compaction failed"),
            }
        }
    }
}

async fn follow_peers(
    state: ServerState,
    log: Arc<dyn EventLog>,
    mut next: u64,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let me = state.replica_id();
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut stream = log.subscribe(next);
        loop {
            let item = tokio::select! {
                () = stop.cancelled() => return,
                item = stream.next() => item,
            };
            match item {
                Some(Ok(env)) => {
                    backoff = Duration::from_millis(50);
                    next = env.seq + 1;
                    let peer = env
                        .source
                        .as_ref()
                        .filter(|s| s.worker.as_str().starts_with(REPLICA_PREFIX))
                        .filter(|s| s.worker.as_str() != me);
                    if let Some(source) = peer
                        && is_request(&env.event)
                    {
                        counters.peer_events.fetch_add(1, Ordering::Relaxed);
                        state.apply(vec![NewEvent::from_source(source.clone(), env.event)]);
                    }
                }
                Some(Err(LogError::Compacted { upto })) => {
                    tracing::warn!(
                        from = next,
                        upto,
                        "the durable log was compacted past the peers' events not yet seen; skipping them"
                    );
                    next = upto + 1;
                    break;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, ?backoff, "following the durable event log failed; resubscribing");
                    break;
                }
                None => break,
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::test_support::{record, state};
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
        st.with_fleet(|f| f.index().blocks_of(&WorkerRank::new(id, 0), Tier::Gpu))
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
        st.close_taps();
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
        });
        a.apply(vec![NewEvent::new(routed)]);
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
            while b.with_fleet(|f| f.inflight_on(&rank)) == 0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), applied)
            .await
            .expect("B applies A's request");
        assert_eq!(
            a.with_fleet(|f| f.inflight_on(&rank)),
            1,
            "A applied it once"
        );
        a.close_taps();
        b.close_taps();
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
}
