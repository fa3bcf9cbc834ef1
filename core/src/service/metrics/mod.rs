//! The server's Prometheus metrics: one `prometheus_client` registry per server, rendered in the
//! Prometheus text format (0.0.4) by `GET /metrics` (see [`text`]).
//!
//! Two groups of families live in it:
//! - **The Python Infera's** (its `infera/server/metrics.py`), with its names, types, labels and
//!   buckets, so dashboards and alerts written for it keep working: picks per role and worker,
//!   the pick histograms, request duration and in-flight per router, PD leg durations and
//!   bootstrap failures, migrations, per-worker breaker state and trips, active workers per
//!   disaggregation mode, the policy's per-worker active blocks and cache view, retention hints
//!   seen and cache locality skipped.
//! - **Ours**, beside them: decisions by outcome, retries, requests by status, per-model
//!   traffic, first bytes and cache hits ([`models`]), per-tenant traffic, limits and the
//!   router's queue ([`tenants`]), event intake,
//!   transport errors, KV-event gaps, PD pair errors, breaker totals, exact migrations; the
//!   event taps, the durable log and the trace recorder register theirs through
//!   [`Service::register_metrics`].
//!
//! Label values are bounded: roles, outcomes, reasons, worker ids and served models (the fleet
//! is bounded), never request ids. Gauges the fleet already knows (active workers, the
//! policy's per-worker views, breaker states) are set from it at scrape time.

use super::Service;
use super::breaker::BreakerState;
use crate::event::{Role, Tier, WorkerRecord};
use crate::ids::WorkerRank;
use crate::kv_events::IngestStats;
use crate::ports::transport::TransportError;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};

mod models;
mod sla;
mod tenants;
pub mod text;

pub(crate) use models::ModelFamilies;
pub(crate) use sla::{SlaFamilies, SlaSample};
pub(crate) use tenants::TenantFamilies;

/// One label.
pub type Label = [(&'static str, &'static str); 1];
/// A label whose value is a worker id (`worker_id`; `<id>#dp<rank>` for a rank of a
/// multi-rank worker, as the Python Infera's route keys).
pub type WorkerLabel = [(&'static str, String); 1];
/// Two labels, the second a worker id.
pub type WorkerPairLabel = [(&'static str, String); 2];
type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

/// Buckets of the pick histograms (blocks).
const BLOCK_BUCKETS: [f64; 13] = [
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
];
/// Buckets of `infera_request_duration_seconds`.
const REQUEST_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets of `infera_pd_dispatch_duration_seconds`.
const LEG_BUCKETS: [f64; 11] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

fn block_histogram() -> Histogram {
    Histogram::new(BLOCK_BUCKETS)
}
fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}
fn leg_histogram() -> Histogram {
    Histogram::new(LEG_BUCKETS)
}

/// Every family of the server, and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    // The Python Infera's families.
    pub(crate) picks_by_worker: Family<WorkerPairLabel, Counter>,
    pub(crate) pick_cache_hits: Hist<Label>,
    pub(crate) pick_request_blocks: Hist<Label>,
    pub(crate) request_duration: Hist<[(&'static str, &'static str); 2]>,
    pub(crate) request_inflight: Family<Label, Gauge>,
    pub(crate) pd_dispatch_duration: Hist<WorkerPairLabel>,
    pub(crate) migrations_by_reason: Family<Label, Counter>,
    pub(crate) migrations_failed: Family<Label, Counter>,
    pub(crate) pd_bootstrap_failures: Family<Label, Counter>,
    pub(crate) active_workers: Family<WorkerLabel, Gauge>,
    /// Routable ranks per served model and adapter (`parent` empty for a base model).
    pub(crate) model_ranks: Family<[(&'static str, String); 2], Gauge>,
    pub(crate) worker_breaker_state: Family<WorkerLabel, Gauge>,
    pub(crate) worker_breaker_trips: Family<WorkerLabel, Counter>,
    pub(crate) policy_active_blocks: Family<WorkerLabel, Gauge>,
    pub(crate) policy_cache_view_size: Family<WorkerLabel, Gauge>,
    pub(crate) cache_control_seen: Family<Label, Counter>,
    pub(crate) cache_locality_skipped: Family<Label, Counter>,
    /// The SLA planner's signals (`--enable-sla-metrics`), by `router` and `model`.
    pub(crate) sla: SlaFamilies,
    // Ours.
    pub(crate) models: ModelFamilies,
    pub(crate) tenants: TenantFamilies,
    pub(crate) decisions: Family<Label, Counter>,
    /// Requests naming a session, by whether it stayed on its worker (see `policy::affinity`).
    pub(crate) sessions: Family<Label, Counter>,
    /// Sessions pinned now.
    pub(crate) sessions_pinned: Gauge,
    pub(crate) retries: Counter,
    pub(crate) requests: Family<Label, Counter>,
    pub(crate) events_applied: Counter,
    pub(crate) kv_stored_blocks: Counter,
    pub(crate) kv_removed_blocks: Counter,
    pub(crate) kv_dropped_events: Counter,
    pub(crate) tokenizer_failures: Counter,
    pub(crate) transport_timeouts: Counter,
    pub(crate) transport_rejected: Counter,
    pub(crate) transport_sequence_errors: Counter,
    pub(crate) kv_gaps: Counter,
    pub(crate) kv_gaps_replayed: Counter,
    pub(crate) pd_requests: Counter,
    pub(crate) pd_prefill_failures: Counter,
    pub(crate) pd_pair_errors: Counter,
    /// Circuit breakers that opened (see `breaker`).
    pub(crate) breaker_trips: Counter,
    /// Workers that left routing for failing their health checks (see `health`).
    pub(crate) health_ejections: Counter,
    /// Probes failed because the worker's streams made no progress (see `health`).
    pub(crate) health_stalls: Counter,
    /// Workers out of routing for that now.
    pub(crate) health_out: Gauge,
    pub(crate) ejections_capped: Counter,
    /// Outliers ejected, by the rule that found them (see `outlier`).
    pub(crate) outlier_ejections: Family<Label, Counter>,
    /// Workers ejected as outliers now.
    pub(crate) outliers_out: Gauge,
    /// Each judged worker's time per unit of work against its peers' (see `outlier`).
    pub(crate) outlier_ttft_ratio: Family<WorkerLabel, Gauge<f64, AtomicU64>>,
    /// Outliers left in routing because their group was at the cap.
    pub(crate) outliers_capped: Counter,
    /// Workers whose breaker is open now.
    pub(crate) breaker_open: Gauge,
    /// Workers whose breaker is half-open now.
    pub(crate) breaker_half_open: Gauge,
    /// Streams continued on another worker after theirs failed (see `migrate`).
    pub(crate) migrations: Counter,
    /// Of those, the ones continued from the exact token ids (see `migrate`).
    pub(crate) migrations_exact: Counter,
    /// Committed events handed to a tap, and those a tap's full queue could not take.
    pub(crate) tap_delivered: Family<Label, Counter>,
    pub(crate) tap_dropped: Family<Label, Counter>,
}

/// A rank's `worker_id` label: the worker's id, or `<id>#dp<rank>` for a rank of a worker that
/// fronts several (the Python Infera's route key).
pub(crate) fn route_key(worker: &WorkerRecord, rank: &WorkerRank) -> String {
    if worker.dp_size > 1 {
        format!("{}#dp{}", worker.worker_id.as_str(), rank.dp_rank)
    } else {
        worker.worker_id.as_str().to_owned()
    }
}

pub(crate) fn inc(c: &Counter, by: u64) {
    c.inc_by(by);
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            picks_by_worker: Family::default(),
            pick_cache_hits: Family::new_with_constructor(block_histogram),
            pick_request_blocks: Family::new_with_constructor(block_histogram),
            request_duration: Family::new_with_constructor(request_histogram),
            request_inflight: Family::default(),
            pd_dispatch_duration: Family::new_with_constructor(leg_histogram),
            migrations_by_reason: Family::default(),
            migrations_failed: Family::default(),
            pd_bootstrap_failures: Family::default(),
            active_workers: Family::default(),
            model_ranks: Family::default(),
            worker_breaker_state: Family::default(),
            worker_breaker_trips: Family::default(),
            policy_active_blocks: Family::default(),
            policy_cache_view_size: Family::default(),
            cache_control_seen: Family::default(),
            cache_locality_skipped: Family::default(),
            sla: SlaFamilies::default(),
            models: ModelFamilies::default(),
            tenants: TenantFamilies::default(),
            decisions: Family::default(),
            sessions: Family::default(),
            sessions_pinned: Gauge::default(),
            retries: Counter::default(),
            requests: Family::default(),
            events_applied: Counter::default(),
            kv_stored_blocks: Counter::default(),
            kv_removed_blocks: Counter::default(),
            kv_dropped_events: Counter::default(),
            tokenizer_failures: Counter::default(),
            transport_timeouts: Counter::default(),
            transport_rejected: Counter::default(),
            transport_sequence_errors: Counter::default(),
            kv_gaps: Counter::default(),
            kv_gaps_replayed: Counter::default(),
            pd_requests: Counter::default(),
            pd_prefill_failures: Counter::default(),
            pd_pair_errors: Counter::default(),
            breaker_trips: Counter::default(),
            health_ejections: Counter::default(),
            health_stalls: Counter::default(),
            health_out: Gauge::default(),
            ejections_capped: Counter::default(),
            outlier_ejections: Family::default(),
            outliers_out: Gauge::default(),
            outlier_ttft_ratio: Family::default(),
            outliers_capped: Counter::default(),
            breaker_open: Gauge::default(),
            breaker_half_open: Gauge::default(),
            migrations: Counter::default(),
            migrations_exact: Counter::default(),
            tap_delivered: Family::default(),
            tap_dropped: Family::default(),
        };
        m.register_all();
        m
    }
}

impl Metrics {
    /// Puts every family in the registry (help texts end without a period: the encoder adds
    /// one; counter names without `_total`: the encoder adds it).
    fn register_all(&self) {
        let mut r = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        let r = &mut *r;
        // The Python Infera's families: its names, help texts, labels and buckets.
        r.register(
            "infera_router_picks",
            "Total number of pick() decisions made by the router, per role and worker",
            self.picks_by_worker.clone(),
        );
        r.register(
            "infera_router_pick_cache_hits",
            "Number of cache blocks the picked worker already had (chained-prefix hits)",
            self.pick_cache_hits.clone(),
        );
        r.register(
            "infera_router_pick_request_blocks",
            "Total request block count seen at pick time",
            self.pick_request_blocks.clone(),
        );
        r.register(
            "infera_request_duration_seconds",
            "End-to-end server-observed request latency (server.pick + worker round-trip)",
            self.request_duration.clone(),
        );
        r.register(
            "infera_request_inflight",
            "Currently in-flight requests at the server",
            self.request_inflight.clone(),
        );
        r.register(
            "infera_pd_dispatch_duration_seconds",
            "Per-worker duration of a PD-dispatched request (P or D leg from server POST to \
             response complete)",
            self.pd_dispatch_duration.clone(),
        );
        r.register(
            "infera_migrations",
            "Live generations carried from one worker to another, by what prompted it",
            self.migrations_by_reason.clone(),
        );
        r.register(
            "infera_migrations_failed",
            "Generations that could not be carried, and so ended visibly to the client",
            self.migrations_failed.clone(),
        );
        r.register(
            "infera_pd_bootstrap_failures",
            "PD bootstrap protocol failures (missing bootstrap_addr, P unreachable, etc.)",
            self.pd_bootstrap_failures.clone(),
        );
        r.register(
            "infera_active_workers",
            "Number of workers in ACTIVE status, by disagg_mode",
            self.active_workers.clone(),
        );
        r.register(
            "infera_model_routable_ranks",
            "Routable worker ranks (any role) of each served model and LoRA adapter; parent is \
             an adapter's base model, empty for a base model",
            self.model_ranks.clone(),
        );
        r.register(
            "infera_router_worker_breaker_state",
            "Router-side circuit breaker per worker: 0=closed, 1=half_open, 2=open",
            self.worker_breaker_state.clone(),
        );
        r.register(
            "infera_router_worker_breaker_trips",
            "Times a worker's breaker has opened",
            self.worker_breaker_trips.clone(),
        );
        r.register(
            "infera_policy_active_blocks",
            "Per-worker count of distinct in-flight block hashes (the load term of the cost)",
            self.policy_active_blocks.clone(),
        );
        r.register(
            "infera_policy_cache_view_size",
            "Per-worker count of cached blocks in the router-side view of the KV events",
            self.policy_cache_view_size.clone(),
        );
        r.register(
            "infera_cache_control_seen",
            "Count of requests by retention level observed in the request body",
            self.cache_control_seen.clone(),
        );
        r.register(
            "infera_cache_locality_skipped",
            "Count of routing decisions where cache locality was intentionally ignored",
            self.cache_locality_skipped.clone(),
        );
        r.register(
            "infera_time_to_first_token_seconds",
            "Server-observed time from dispatch to the first token of the reply (streamed \
             replies; for a PD pair it spans prefill, KV transfer and the decode's first step)",
            self.sla.ttft.clone(),
        );
        r.register(
            "infera_inter_token_latency_seconds",
            "Mean per-request inter-token latency: (total stream time - TTFT) spread over the \
             generated tokens (requests of at least two output tokens)",
            self.sla.itl.clone(),
        );
        r.register(
            "infera_input_sequence_tokens",
            "Prompt length in tokens (ISL): the engine's usage when it reports one, else the \
             router's own count",
            self.sla.isl.clone(),
        );
        r.register(
            "infera_output_sequence_tokens",
            "Generated length in tokens (OSL): the engine's usage when it reports one, else the \
             stream's data frames",
            self.sla.osl.clone(),
        );
        // Ours.
        let counters: [(&str, &str, &Counter); 17] = [
            (
                "infera_router_retries",
                "Attempts retried on another worker before the first response byte",
                &self.retries,
            ),
            (
                "infera_events_applied",
                "Events appended to the log and applied to the fleet",
                &self.events_applied,
            ),
            (
                "infera_kv_stored_blocks",
                "Blocks reported stored by engines",
                &self.kv_stored_blocks,
            ),
            (
                "infera_kv_removed_blocks",
                "Blocks reported removed by engines",
                &self.kv_removed_blocks,
            ),
            (
                "infera_kv_dropped_events",
                "Engine KV events dropped at ingest (block-size mismatch, unknown parent...)",
                &self.kv_dropped_events,
            ),
            (
                "infera_tokenizer_failures",
                "Requests the router tokenizer or chat template failed on (answered 400 or 500)",
                &self.tokenizer_failures,
            ),
            (
                "infera_transport_timeouts",
                "Requests ended by the transport's idle or total timeout (504, worker told to \
                 cancel)",
                &self.transport_timeouts,
            ),
            (
                "infera_transport_rejected",
                "Attempts refused by a worker's admission limit (429; retried elsewhere if \
                 allowed)",
                &self.transport_rejected,
            ),
            (
                "infera_transport_sequence_errors",
                "Reply streams that lost or reordered a chunk (ended with an error, never \
                 relayed)",
                &self.transport_sequence_errors,
            ),
            (
                "infera_kv_event_gaps",
                "KV-event gaps detected (filled from the engine's replay socket where it has \
                 one, else the rank's blocks were cleared and rebuilt from later events)",
                &self.kv_gaps,
            ),
            (
                "infera_kv_event_gaps_replayed",
                "KV-event gaps filled from the engine's replay socket, no blocks cleared",
                &self.kv_gaps_replayed,
            ),
            (
                "infera_pd_requests",
                "Attempts dispatched to a prefill/decode pair",
                &self.pd_requests,
            ),
            (
                "infera_pd_prefill_failures",
                "PD attempts whose prefill leg failed before the first byte (the decode leg was \
                 dropped or never sent)",
                &self.pd_prefill_failures,
            ),
            (
                "infera_pd_pair_errors",
                "PD attempts refused because the pair's protocols differ or a registration \
                 lacks a parameter (500) or the prefill's answer lacks the hand-off (502)",
                &self.pd_pair_errors,
            ),
            (
                "infera_breaker_trips",
                "Circuit breakers opened: a worker taken out of routing after consecutive \
                 failures before the first byte, or a failed half-open probe",
                &self.breaker_trips,
            ),
            (
                "infera_stream_migrations",
                "Streams continued on another worker after theirs failed mid-stream \
                 (--migration-limit)",
                &self.migrations,
            ),
            (
                "infera_stream_migrations_exact",
                "Of the migrated streams, those continued from the token ids the engine sampled \
                 (not re-tokenized text)",
                &self.migrations_exact,
            ),
        ];
        for (name, help, counter) in counters {
            r.register(name, help, counter.clone());
        }
        r.register(
            "infera_router_decisions",
            "Routing decisions by outcome",
            self.decisions.clone(),
        );
        r.register(
            "infera_router_session_requests",
            "Routed requests that named a session, by outcome: new (no live pin), kept (on the \
             worker it was pinned to), moved (elsewhere)",
            self.sessions.clone(),
        );
        r.register(
            "infera_router_sessions",
            "Sessions pinned to a worker (live or within their TTL, at most 1,048,576)",
            self.sessions_pinned.clone(),
        );
        r.register(
            "infera_requests",
            "Finished requests by status",
            self.requests.clone(),
        );
        self.models.register(r);
        self.tenants.register(r);
        r.register(
            "infera_health_ejections",
            "Workers that left routing for failing their health checks (--health-check-*)",
            self.health_ejections.clone(),
        );
        r.register(
            "infera_health_check_stalls",
            "Health probes failed because the worker's streams past their first byte relayed \
             nothing for --health-check-stall-timeout",
            self.health_stalls.clone(),
        );
        r.register(
            "infera_health_out_workers",
            "Workers out of routing now for failing their health checks",
            self.health_out.clone(),
        );
        r.register(
            "infera_ejections_capped",
            "Ejected workers routed anyway because more of their model's workers were out than \
             --max-ejection-percent allows, summed over requests",
            self.ejections_capped.clone(),
        );
        r.register(
            "infera_outlier_ejections",
            "Workers ejected from routing for serving far worse than their peers, by rule: ttft \
             (time to first byte per unit of work) or errors (--outlier-*)",
            self.outlier_ejections.clone(),
        );
        r.register(
            "infera_outlier_ejected_workers",
            "Workers ejected from routing as outliers now",
            self.outliers_out.clone(),
        );
        r.register(
            "infera_outlier_ttft_ratio",
            "Each judged worker's median time to first byte per unit of work against its peers' \
             at like work, as of the last outlier evaluation (above --outlier-ttft-factor ejects)",
            self.outlier_ttft_ratio.clone(),
        );
        r.register(
            "infera_outliers_capped",
            "Outliers left in routing because --max-ejection-percent of their peer group was \
             out already",
            self.outliers_capped.clone(),
        );
        r.register(
            "infera_breaker_open_workers",
            "Workers whose circuit breaker is open (excluded from routing until the cooldown)",
            self.breaker_open.clone(),
        );
        r.register(
            "infera_breaker_half_open_workers",
            "Workers whose circuit breaker is half-open (admitting one probe at a time)",
            self.breaker_half_open.clone(),
        );
        r.register(
            "infera_event_tap_delivered_events",
            "Committed events handed to a tap (trace recorder, durable log)",
            self.tap_delivered.clone(),
        );
        r.register(
            "infera_event_tap_dropped_events",
            "Committed events a tap's full queue could not take (lost to that tap, never \
             waited for)",
            self.tap_dropped.clone(),
        );
    }

    /// Lets a component (the durable log, the trace recorder) put its own families in this
    /// server's registry.
    pub(crate) fn register(&self, with: impl FnOnce(&mut Registry)) {
        with(&mut self.registry.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The Prometheus text exposition of every registered family, after `fill` set the
    /// scrape-time gauges (under the registry's lock: two scrapes never interleave).
    pub(crate) fn render(&self, fill: impl FnOnce(&Self)) -> String {
        let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        fill(self);
        text::render(&registry)
    }

    pub fn events_applied(&self, n: u64) {
        self.events_applied.inc_by(n);
    }

    pub fn kv_ingested(&self, s: &IngestStats) {
        self.kv_stored_blocks.inc_by(u64::from(s.stored_blocks));
        self.kv_removed_blocks.inc_by(u64::from(s.removed_blocks));
        self.kv_dropped_events.inc_by(u64::from(s.dropped()));
    }

    pub(crate) fn transport_error(&self, e: &TransportError) {
        match e {
            TransportError::Timeout(_) => self.transport_timeouts.inc(),
            TransportError::Overloaded { .. } => self.transport_rejected.inc(),
            TransportError::Sequence(_) => self.transport_sequence_errors.inc(),
            TransportError::Unreachable(_) | TransportError::Failed(_) => 0,
        };
    }

    /// A routing decision's outcome: `routed`, `unknown_model`, `no_worker`.
    pub fn decision(&self, outcome: &'static str) {
        self.decisions.get_or_create(&[("outcome", outcome)]).inc();
    }

    /// One leg of a pick, as the Python Infera's `record_pick`.
    pub(crate) fn pick(&self, role: &'static str, worker: String, hits: u32, blocks: usize) {
        self.picks_by_worker
            .get_or_create(&[("role", role.to_owned()), ("worker_id", worker)])
            .inc();
        let role = [("role", role)];
        self.pick_cache_hits
            .get_or_create(&role)
            .observe(f64::from(hits));
        self.pick_request_blocks
            .get_or_create(&role)
            .observe(blocks as f64);
    }

    /// The tokenizer (or chat template) failed on a request.
    pub fn tokenizer_failed(&self) {
        self.tokenizer_failures.inc();
    }

    /// A request's retention hint (`none` without one), as the Python Infera's
    /// `cache_control_seen`.
    pub fn retention_seen(&self, retention: &'static str) {
        self.cache_control_seen
            .get_or_create(&[("retention", retention)])
            .inc();
    }

    /// A request routed without its prefix (`multimodal`), as the Python Infera's
    /// `cache_locality_skipped`.
    pub fn locality_skipped(&self, reason: &'static str) {
        self.cache_locality_skipped
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// A PD bootstrap failure, by the Python Infera's reason names.
    pub(crate) fn pd_bootstrap_failure(&self, reason: &'static str) {
        self.pd_bootstrap_failures
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// A migration that could not be made (`no_candidate`, `no_first_byte`, `limit`).
    pub(crate) fn migration_failed(&self, reason: &'static str) {
        self.migrations_failed
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// A KV-event transport lost batches of a rank: `replayed` when the engine's replay socket
    /// gave them back, else the rank's blocks were cleared for later batches to rebuild.
    pub fn kv_gap(&self, replayed: bool) {
        self.kv_gaps.inc();
        if replayed {
            self.kv_gaps_replayed.inc();
        }
    }

    /// Total routing picks so far.
    pub fn picks_total(&self) -> u64 {
        self.decisions.get_or_create(&[("outcome", "routed")]).get()
    }

    /// Total attempts retried on another worker.
    pub fn retries_total(&self) -> u64 {
        self.retries.get()
    }

    /// Circuit breakers opened so far (a failed half-open probe reopens, and counts).
    pub fn breaker_trips_total(&self) -> u64 {
        self.breaker_trips.get()
    }

    /// Streams migrated to another worker so far.
    pub fn migrations_total(&self) -> u64 {
        self.migrations.get()
    }

    /// Events appended and applied so far.
    pub fn events_applied_total(&self) -> u64 {
        self.events_applied.get()
    }
}

impl Service {
    /// Lets a component (the durable log, the trace recorder) put its own families in the
    /// server's registry, rendered by `GET /metrics` from then on.
    pub fn register_metrics(&self, with: impl FnOnce(&mut Registry)) {
        self.inner.metrics.register(with);
    }

    /// The exposition, with the gauges the fleet knows set from it now: active workers per
    /// disaggregation mode (draining ones are not active), each worker's breaker state, and
    /// each rank's active blocks and cached (GPU) blocks as the router sees them.
    pub fn render_metrics(&self) -> String {
        self.inner.metrics.render(|m| {
            m.health_out
                .set(i64::try_from(self.inner.health.out().len()).unwrap_or(i64::MAX));
            m.outliers_out
                .set(i64::try_from(self.inner.outliers.ejected().len()).unwrap_or(i64::MAX));
            m.tenants.queue_waiting.clear();
            for (tenant, n) in self.inner.admission.by_tenant() {
                m.tenants
                    .queue_waiting
                    .get_or_create(&[("tenant", tenant.to_string())])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            self.with_fleet(|f| {
                m.sessions_pinned
                    .set(i64::try_from(f.sessions_pinned()).unwrap_or(i64::MAX));
                m.active_workers.clear();
                m.model_ranks.clear();
                for (model, served) in f.models() {
                    let ranks: usize = [Role::Mixed, Role::Prefill, Role::Decode]
                        .into_iter()
                        .map(|role| f.candidates(model, role).len())
                        .sum();
                    let labels = [
                        ("model", model.to_owned()),
                        ("parent", served.parent.clone().unwrap_or_default()),
                    ];
                    m.model_ranks
                        .get_or_create(&labels)
                        .set(i64::try_from(ranks).unwrap_or(i64::MAX));
                }
                m.worker_breaker_state.clear();
                m.policy_active_blocks.clear();
                m.policy_cache_view_size.clear();
                for w in f.workers() {
                    if !f.is_draining(&w.worker_id) {
                        let mode = [("disagg_mode", w.disagg_mode.as_str().to_owned())];
                        m.active_workers.get_or_create(&mode).inc();
                    }
                    let state = match self.inner.breaker.state_of(&w.worker_id) {
                        BreakerState::Closed => 0,
                        BreakerState::HalfOpen => 1,
                        BreakerState::Open => 2,
                    };
                    m.worker_breaker_state
                        .get_or_create(&[("worker_id", w.worker_id.as_str().to_owned())])
                        .set(state);
                    for r in w.dp_rank..w.dp_rank + w.dp_size.max(1) {
                        let rank = WorkerRank::new(w.worker_id.clone(), r);
                        let key = [("worker_id", route_key(w, &rank))];
                        let active = f.active_blocks(&rank);
                        let cached = f.index().blocks_of(&rank, Tier::Gpu);
                        m.policy_active_blocks
                            .get_or_create(&key)
                            .set(i64::try_from(active).unwrap_or(i64::MAX));
                        m.policy_cache_view_size
                            .get_or_create(&key)
                            .set(i64::try_from(cached).unwrap_or(i64::MAX));
                    }
                }
            });
        })
    }
}

#[cfg(test)]
mod tests;
