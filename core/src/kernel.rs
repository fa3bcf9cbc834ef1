//! The kernel: one type that owns the router's state — the fleet projection, the decider and
//! the in-memory event log — and the only way to change it.
//!
//! Every change is an event: [`Kernel::commit`] appends a batch to the log and folds it into the
//! fleet in sequence order, so the fleet is always the fold of the log. Routing
//! ([`Kernel::route`]) reads the fleet and returns the `RequestRouted` event for the caller to
//! commit; KV-event ingest ([`Kernel::ingest`]) turns an engine batch into index events with the
//! fleet's own engine → router hash map and commits them.
//!
//! # Compaction
//! With [`Compaction::Auto`] the log is compacted once it holds
//! `max(COMPACT_MIN_EVENTS, 2 × snapshot size)` events past its snapshot: the fleet's dump becomes
//! the snapshot, so memory stays proportional to the fleet's state, not to the requests served,
//! at an amortized O(1) cost per event. `infera server` and `infera replay` both run on a kernel
//! with it; a test that wants the whole history opts out with [`Compaction::Off`].
//!
//! A [`RouterRetuned`] event changes the router's tunables (`--auto-tune apply`); the last one
//! is part of every snapshot, so a log replayed from its snapshot routes as the live one did.
//!
//! The kernel is a plain value (no locks, no I/O): the live server keeps it behind a short
//! mutex, the simulator owns it.

use crate::clock::{Clock, Micros};
use crate::event::{Envelope, Event, RequestRouted, RouterRetuned, Source};
use crate::fleet::{FleetConfig, FleetState};
use crate::ids::WorkerRank;
use crate::kv_events::{EngineBatch, IngestStats, kvd, to_core_events};
use crate::log::{MemoryLog, NewEvent, Snapshot};
use crate::policy::{DirectPick, RouteError, RouteRequest, Router, RouterConfig};
use crate::projection::Projection as _;
use std::sync::Arc;

/// The log is compacted once it holds this many events past its snapshot (at least).
pub const COMPACT_MIN_EVENTS: usize = 1 << 16;

/// Whether the kernel compacts its log. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compaction {
    /// Compact as the log grows (the default).
    Auto,
    /// Keep every event (tests that inspect the whole history).
    Off,
}

/// What one [`Kernel::ingest`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ingested {
    /// Per event class, what the batch turned into.
    pub stats: IngestStats,
    /// Events committed.
    pub applied: usize,
}

/// The router's state and its one way to change. See the module docs.
#[derive(Debug)]
pub struct Kernel {
    fleet: FleetState,
    router: Router,
    log: MemoryLog,
    compaction: Compaction,
    /// Events in the last snapshot (the next compaction waits for twice as many new ones).
    snapshot_events: usize,
    /// The last change of the router's tunables, kept in snapshots.
    retuned: Option<RouterRetuned>,
}

impl Kernel {
    /// An empty fleet whose log stamps events with `clock`.
    pub fn new(
        fleet: FleetConfig,
        router: RouterConfig,
        clock: Arc<dyn Clock>,
        compaction: Compaction,
    ) -> Self {
        Self {
            fleet: FleetState::new(fleet),
            router: Router::new(router),
            log: MemoryLog::new(clock),
            compaction,
            snapshot_events: 0,
            retuned: None,
        }
    }

    /// The fleet projection.
    /// The decider's configuration.
    pub fn router_config(&self) -> &RouterConfig {
        self.router.config()
    }

    pub fn fleet(&self) -> &FleetState {
        &self.fleet
    }

    /// The in-memory log (its snapshot and the events after it).
    pub fn log(&self) -> &MemoryLog {
        &self.log
    }

    /// Appends `events` and folds them into the fleet, in order; compacts when due. Returns how
    /// many were applied.
    pub fn commit(&mut self, events: Vec<NewEvent>) -> usize {
        self.commit_with(events, |_| ()).0
    }

    /// [`Kernel::commit`], letting `observe` see the committed envelopes (with their sequence
    /// numbers) before compaction may drop them: the server's taps copy them there.
    pub fn commit_with<T>(
        &mut self,
        events: Vec<NewEvent>,
        observe: impl FnOnce(&[Envelope]) -> T,
    ) -> (usize, T) {
        let (fleet, router, retuned) = (&mut self.fleet, &mut self.router, &mut self.retuned);
        let (applied, last, seen) = self.log.append_with(events, |envs| {
            for env in envs {
                if let Event::RouterRetuned(r) = &env.event {
                    router.retune(&r.to);
                    *retuned = Some(r.clone());
                }
                fleet.apply(env);
            }
            (envs.len(), envs.last().map(|e| e.seq), observe(envs))
        });
        if self.compaction == Compaction::Auto
            && self.log.len() >= COMPACT_MIN_EVENTS.max(2 * self.snapshot_events)
            && let Some(upto) = last
        {
            let mut events = self.fleet.dump();
            events.extend(self.retuned.clone().map(Event::RouterRetuned));
            self.snapshot_events = events.len();
            if let Err(e) = self.log.compact_sync(Snapshot { upto, events }) {
                tracing::error!(error = %e, "event log compaction failed");
            }
        }
        (applied, seen)
    }

    /// Decides where `req` goes (on the worker `direct` names, in direct mode), without
    /// committing: the caller commits the returned `RequestRouted` once it holds a route.
    ///
    /// # Errors
    /// [`RouteError`] when no worker serves the request's model or role, or a direct pick is
    /// not registered.
    pub fn route(
        &mut self,
        req: &RouteRequest,
        direct: Option<&DirectPick>,
        now_us: Micros,
    ) -> Result<RequestRouted, RouteError> {
        match direct {
            Some(pick) => self.router.decide_direct(&self.fleet, req, pick, now_us),
            None => self.router.decide(&self.fleet, req, now_us),
        }
    }

    /// Turns one engine batch of `rank` (its engine seq `seq`) into index events, with parents
    /// resolved through the fleet's index, and commits them with the rank as their source. An
    /// unregistered worker's batch is dropped (`None`), and so is that of a kvd
    /// ([`kvd::is_source`]) that no registered worker names.
    pub fn ingest(
        &mut self,
        rank: &WorkerRank,
        seq: Option<u64>,
        batch: &EngineBatch,
    ) -> Option<Ingested> {
        self.ingest_with(rank, seq, batch, |_| ())
            .map(|(done, ())| done)
    }

    /// [`Kernel::ingest`], letting `observe` see the committed envelopes (see
    /// [`Kernel::commit_with`]).
    pub fn ingest_with<T>(
        &mut self,
        rank: &WorkerRank,
        seq: Option<u64>,
        batch: &EngineBatch,
        observe: impl FnOnce(&[Envelope]) -> T,
    ) -> Option<(Ingested, T)> {
        let out = if kvd::is_source(&rank.worker) {
            if !self.fleet.links_kvd(&rank.worker) {
                return None;
            }
            kvd::to_core_events(batch, rank)
        } else {
            let block_size = self.fleet.worker(&rank.worker)?.kv_block_size;
            let index = self.fleet.index();
            to_core_events(batch, rank, block_size, &|tier, h| {
                index.router_hash(rank, tier, h)
            })
        };
        let source = Source {
            worker: rank.worker.clone(),
            dp_rank: rank.dp_rank,
            seq,
        };
        let events: Vec<NewEvent> = out
            .events
            .into_iter()
            .map(|e: Event| NewEvent::from_source(source.clone(), e))
            .collect();
        let (applied, seen) = self.commit_with(events, observe);
        Some((
            Ingested {
                stats: out.stats,
                applied,
            },
            seen,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::event::{
        Engine, RequestFinished, RequestStatus, RequestTransport, Role, RoutedLeg, WorkerRecord,
        WorkerRegistered,
    };
    use crate::ids::{RequestId, WorkerId};

    fn record(id: &str) -> WorkerRecord {
        WorkerRecord {
            worker_id: WorkerId::new(id),
            url: format!("http://{id}"),
            model_name: "m".into(),
            engine: Engine::Vllm,
            disagg_mode: Role::Mixed,
            disagg_meta: None,
            kv_events_endpoint: None,
            kv_block_size: 16,
            dp_rank: 0,
            dp_size: 1,
            request_transport: RequestTransport::Http,
            kv: None,
            extra: serde_json::Map::new(),
        }
    }

    fn routed(id: &str, at_us: u64) -> NewEvent {
        NewEvent::new(Event::RequestRouted(RequestRouted {
            request_id: RequestId::new(id),
            model: "m".into(),
            legs: vec![RoutedLeg {
                worker: WorkerRank::new("w:1", 0),
                role: Role::Mixed,
                overlap_blocks: 0,
            }],
            blocks: Vec::new(),
            prompt_tokens: 10,
            policy: "kv-aware".into(),
            weights: Vec::new(),
            top: Vec::new(),
            retention: None,
            at_us,
            tenant: None,
            session: None,
        }))
    }

    fn finished(id: &str) -> NewEvent {
        NewEvent::new(Event::RequestFinished(RequestFinished {
            request_id: RequestId::new(id),
            status: RequestStatus::Ok,
            ttft_us: None,
            tokens_in: 10,
            tokens_out: 1,
            cached_tokens: None,
        }))
    }

    fn kernel(compaction: Compaction) -> Kernel {
        let mut k = Kernel::new(
            FleetConfig::default(),
            RouterConfig::default(),
            Arc::new(SystemClock),
            compaction,
        );
        k.commit(vec![NewEvent::new(Event::WorkerRegistered(
            WorkerRegistered {
                record: record("w:1"),
            },
        ))]);
        k
    }

    #[test]
    fn the_log_is_compacted_and_the_snapshot_rebuilds_the_fleet() {
        let mut k = kernel(Compaction::Auto);
        // Requests come and go; one stays in flight across every compaction.
        k.commit(vec![routed("stays", 0)]);
        for i in 0..(3 * COMPACT_MIN_EVENTS / 4) {
            let id = format!("r{i}");
            k.commit(vec![routed(&id, i as u64 * 1_000), finished(&id)]);
        }
        assert!(
            k.log().len() < COMPACT_MIN_EVENTS,
            "log holds {}",
            k.log().len()
        );
        assert_eq!(k.fleet().inflight_requests(), 1);

        let mut rebuilt = FleetState::new(FleetConfig::default());
        futures::executor::block_on(crate::log::rebuild(k.log(), &mut rebuilt)).expect("rebuild");
        assert_eq!(rebuilt.dump(), k.fleet().dump());
        assert_eq!(rebuilt.inflight_requests(), 1);
    }

    #[test]
    fn without_compaction_every_event_is_kept_and_observed_in_order() {
        let mut k = kernel(Compaction::Off);
        let mut seen = Vec::new();
        for i in 0..(COMPACT_MIN_EVENTS / 2 + 1) {
            let id = format!("r{i}");
            let (applied, seqs) = k.commit_with(vec![routed(&id, 0), finished(&id)], |envs| {
                envs.iter().map(|e| e.seq).collect::<Vec<_>>()
            });
            assert_eq!(applied, 2);
            seen.extend(seqs);
        }
        assert_eq!(k.log().len(), COMPACT_MIN_EVENTS + 3);
        assert!(
            seen.windows(2).all(|w| w[1] == w[0] + 1),
            "contiguous sequence numbers"
        );
        assert_eq!(k.fleet().inflight_requests(), 0);
    }

    #[test]
    fn a_retune_changes_the_router_and_survives_compaction() {
        let mut k = kernel(Compaction::Auto);
        let from = k.router_config().tunables();
        let to = crate::event::Tunables {
            overlap_weight: 8.0,
            balance_tokens: 512,
            ..from
        };
        k.commit(vec![NewEvent::new(Event::RouterRetuned(RouterRetuned {
            from,
            to,
            by: "auto-tune".into(),
            reason: "adopt".into(),
            predicted_hit_rate: Some(0.6),
            realised_hit_rate: Some(0.5),
        }))]);
        assert_eq!(k.router_config().tunables(), to);
        assert_eq!(k.router_config().policy, RouterConfig::default().policy);
        // Enough requests to compact: the snapshot keeps the change.
        for i in 0..COMPACT_MIN_EVENTS {
            let id = format!("r{i}");
            k.commit(vec![routed(&id, 0), finished(&id)]);
        }
        let snapshot = futures::executor::block_on(crate::log::EventLog::snapshot(k.log()))
            .expect("read")
            .expect("compacted");
        let kept: Vec<&RouterRetuned> = snapshot
            .events
            .iter()
            .filter_map(|e| match e {
                Event::RouterRetuned(r) => Some(r),
                _ => None,
            })
            .collect();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].to, to);
    }

    #[test]
    fn a_batch_of_an_unregistered_worker_is_dropped() {
        let mut k = kernel(Compaction::Auto);
        let before = k.log().len();
        let batch = EngineBatch::default();
        assert!(
            k.ingest(&WorkerRank::new("nobody:1", 0), Some(0), &batch)
                .is_none()
        );
        assert_eq!(k.log().len(), before);
        let done = k.ingest(&WorkerRank::new("w:1", 0), Some(0), &batch);
        assert_eq!(done.map(|d| d.applied), Some(0));
    }
}
