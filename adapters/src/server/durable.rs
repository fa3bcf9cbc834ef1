//! A durable, shared event log behind the server (`--event-log` other than `memory`).
//!
//! The server always decides from its in-memory log and fleet (one short lock, no I/O). A
//! durable log ([`EventLog`]: JetStream, SQLite, PostgreSQL) is attached by [`attach`]:
//!
//! - **Write-behind.** One task, fed by a tap
//!   ([`Service::tap`](infera_core::service::Service::tap)), appends every event this server
//!   commits — discovery changes, its KV subscribers' events, its requests — to the durable log
//!   in commit order, one append per committed batch. Request events are stamped with
//!   this replica's source, `router/<replica id>`. The request path never waits for it.
//! - **Sharing.** A tail task follows the durable log from where it stood at attach time and
//!   applies other replicas' `RequestRouted` / `RequestPrefilled` / `RequestFinished` to this
//!   server's fleet, so every replica's load accounting includes its peers' requests, and
//!   charges them to the tenants' limits (see the `tenants` module). Peers' KV
//!   and discovery events are not applied: each replica consumes those from the source itself.
//!   A tail that fails, or stalls (this replica's own appends do not come back), counts as cut
//!   off from the peers ([`tail`]).
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
use infera_core::event::{Envelope, Event, Source, WorkerRecord};
use infera_core::fleet::FleetState;
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::log::{EventLog, LogError, NewEvent, Snapshot};
use infera_core::projection::Projection;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The durable log is compacted after this many appended events.
pub const COMPACT_EVERY: u64 = 1 << 16;
/// Batches the write-behind tap holds while the store is slow.
const TAP_CAPACITY: usize = 1 << 16;
/// Source worker ids of router replicas start with this.
pub const REPLICA_PREFIX: &str = "router/";
/// A peer replica counts toward the limits' share this long after its last request event.
const PEERS_SEEN_US: u64 = 600_000_000;

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

/// The durable log's counters, `infera_event_log_*_total` on the server's `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    appended: Counter,
    append_failures: Counter,
    peer_events: Counter,
    compactions: Counter,
    restored_workers: Counter,
    restored_ranks_cleared: Counter,
    /// 1 while tenant limits are shared with the peers; N: cut off, one of N replicas.
    limit_share: Gauge,
}

impl Counters {
    fn register(&self, r: &mut Registry) {
        let families = [
            (
                "infera_event_log_appended_events",
                "Events appended to the durable event log",
                &self.appended,
            ),
            (
                "infera_event_log_append_failures",
                "Appends to the durable event log that failed (retried)",
                &self.append_failures,
            ),
            (
                "infera_event_log_peer_events",
                "Other replicas' request events applied to this server's load accounting",
                &self.peer_events,
            ),
            (
                "infera_event_log_compactions",
                "Snapshots written to the durable event log",
                &self.compactions,
            ),
            (
                "infera_event_log_restored_workers",
                "Workers whose KV index was restored from the durable log when they registered",
                &self.restored_workers,
            ),
            (
                "infera_event_log_restored_ranks_cleared",
                "Restored ranks cleared because the engine's events did not continue the logged \
                 sequence",
                &self.restored_ranks_cleared,
            ),
        ];
        for (name, help, counter) in families {
            r.register(name, help, counter.clone());
        }
        r.register(
            "infera_tenant_limit_share",
            "1 while this replica charges its peers' requests to the tenants' limits; N when \
             cut off from them, each admission costing N (one of N replicas)",
            self.limit_share.clone(),
        );
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
    /// [`Service::close_taps`](infera_core::service::Service::close_taps) is appended (or
    /// `grace` passes: the rest is lost).
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
        format!("{REPLICA_PREFIX}{:016x}", self.service().id_prefix())
    }
}

/// Attaches `log` to `state` (see the module docs): restores the workers' KV index, then starts
/// the write-behind and tail tasks. Call before discovery starts.
///
/// # Errors
/// The log cannot be read (its snapshot or tail).
pub async fn attach(state: &ServerState, log: Arc<dyn EventLog>) -> Result<DurableLog, LogError> {
    let counters = Arc::new(Counters::default());
    counters.limit_share.set(1);
    state.service().register_metrics(|r| counters.register(r));
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
    let rx = state.service().tap("event-log", TAP_CAPACITY);
    let own = Arc::new(tail::OwnTip::default());
    let writer = tokio::spawn(write_behind(
        state.clone(),
        log.clone(),
        rx,
        counters.clone(),
        own.clone(),
    ));
    let stop_tail = CancellationToken::new();
    let tail = tokio::spawn(tail::follow_peers(
        state.clone(),
        log,
        tip + 1,
        counters,
        own,
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
            c.restored_workers.inc();
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
                c.restored_ranks_cleared.inc();
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
    own: Arc<tail::OwnTip>,
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
                    counters.append_failures.inc();
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
        own.appended(range.last);
        counters.appended.inc_by(n);
        since_compaction += n;
        if since_compaction >= COMPACT_EVERY {
            since_compaction = 0;
            let events = state.service().with_fleet(|f| f.dump());
            match log
                .compact(Snapshot {
                    upto: range.last,
                    events,
                })
                .await
            {
                Ok(()) => {
                    counters.compactions.inc();
                }
                Err(e) => tracing::warn!(error = %e, "durable event log compaction failed"),
            }
        }
    }
}

mod tail;
#[cfg(test)]
mod tests;
