//! The server's Prometheus metrics: plain atomics as struct fields, rendered as text by
//! `GET /metrics`. Label sets are bounded (outcomes and statuses, never worker ids); gauges that
//! the fleet already knows (in-flight requests, workers) are read from it at render time.

use infera_core::kv_events::IngestStats;
use infera_core::ports::transport::TransportError;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of the request pipeline and the event intake.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    pub(crate) picks: AtomicU64,
    pub(crate) pick_cache_hits: AtomicU64,
    pub(crate) pick_request_blocks: AtomicU64,
    pub(crate) decisions_unknown_model: AtomicU64,
    pub(crate) decisions_no_worker: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) requests_ok: AtomicU64,
    pub(crate) requests_client_error: AtomicU64,
    pub(crate) requests_worker_error: AtomicU64,
    pub(crate) requests_cancelled: AtomicU64,
    pub(crate) request_duration_us_sum: AtomicU64,
    pub(crate) request_duration_count: AtomicU64,
    pub(crate) events_applied: AtomicU64,
    pub(crate) kv_stored_blocks: AtomicU64,
    pub(crate) kv_removed_blocks: AtomicU64,
    pub(crate) kv_dropped_events: AtomicU64,
    pub(crate) tokenizer_failures: AtomicU64,
    pub(crate) transport_timeouts: AtomicU64,
    pub(crate) transport_rejected: AtomicU64,
    pub(crate) transport_sequence_errors: AtomicU64,
    pub(crate) kv_gaps: AtomicU64,
    pub(crate) kv_gaps_replayed: AtomicU64,
    pub(crate) pd_requests: AtomicU64,
    pub(crate) pd_prefill_failures: AtomicU64,
    pub(crate) pd_pair_errors: AtomicU64,
    /// Circuit breakers that opened (see `breaker`).
    pub(crate) breaker_trips: AtomicU64,
    /// Workers whose breaker is open now (a gauge).
    pub(crate) breaker_open: AtomicU64,
    /// Workers whose breaker is half-open now (a gauge).
    pub(crate) breaker_half_open: AtomicU64,
    /// Streams continued on another worker after theirs failed (see `migrate`).
    pub(crate) migrations: AtomicU64,
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

pub(crate) fn inc(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

impl ServerMetrics {
    pub(crate) fn events_applied(&self, n: u64) {
        inc(&self.events_applied, n);
    }

    pub(crate) fn kv_ingested(&self, s: &IngestStats) {
        inc(&self.kv_stored_blocks, u64::from(s.stored_blocks));
        inc(&self.kv_removed_blocks, u64::from(s.removed_blocks));
        inc(&self.kv_dropped_events, u64::from(s.dropped()));
    }

    pub(crate) fn transport_error(&self, e: &TransportError) {
        match e {
            TransportError::Timeout(_) => inc(&self.transport_timeouts, 1),
            TransportError::Overloaded { .. } => inc(&self.transport_rejected, 1),
            TransportError::Sequence(_) => inc(&self.transport_sequence_errors, 1),
            TransportError::Unreachable(_) | TransportError::Failed(_) => {}
        }
    }

    /// A KV-event transport lost batches of a rank: `replayed` when the engine's replay socket
    /// gave them back, else the rank's blocks were cleared for later batches to rebuild.
    pub fn kv_gap(&self, replayed: bool) {
        inc(&self.kv_gaps, 1);
        if replayed {
            inc(&self.kv_gaps_replayed, 1);
        }
    }

    /// Total routing picks so far.
    pub fn picks_total(&self) -> u64 {
        get(&self.picks)
    }

    /// Total attempts retried on another worker.
    pub fn retries_total(&self) -> u64 {
        get(&self.retries)
    }

    /// Circuit breakers opened so far (a failed half-open probe reopens, and counts).
    pub fn breaker_trips_total(&self) -> u64 {
        get(&self.breaker_trips)
    }

    /// Streams migrated to another worker so far.
    pub fn migrations_total(&self) -> u64 {
        get(&self.migrations)
    }

    /// Events appended and applied so far.
    pub fn events_applied_total(&self) -> u64 {
        get(&self.events_applied)
    }

    /// Renders the Prometheus text format.
    pub(crate) fn render(&self, inflight: usize, workers: usize, active_blocks: u64) -> String {
        let mut out = String::with_capacity(2048);
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                if labels.is_empty() {
                    let _ = writeln!(out, "{name} {v}");
                } else {
                    let _ = writeln!(out, "{name}{{{labels}}} {v}");
                }
            }
        };
        metric(
            "infera_router_picks_total",
            "counter",
            "Routing decisions that picked a worker.",
            &[("", get(&self.picks))],
        );
        metric(
            "infera_router_pick_cache_hits",
            "counter",
            "Picks whose worker already held part of the prompt.",
            &[("", get(&self.pick_cache_hits))],
        );
        metric(
            "infera_router_pick_request_blocks",
            "counter",
            "Prompt blocks of picked requests.",
            &[("", get(&self.pick_request_blocks))],
        );
        metric(
            "infera_router_decisions_total",
            "counter",
            "Routing decisions by outcome.",
            &[
                ("outcome=\"routed\"", get(&self.picks)),
                (
                    "outcome=\"unknown_model\"",
                    get(&self.decisions_unknown_model),
                ),
                ("outcome=\"no_worker\"", get(&self.decisions_no_worker)),
            ],
        );
        metric(
            "infera_router_retries_total",
            "counter",
            "Attempts retried on another worker before the first response byte.",
            &[("", get(&self.retries))],
        );
        metric(
            "infera_requests_total",
            "counter",
            "Finished requests by status.",
            &[
                ("status=\"ok\"", get(&self.requests_ok)),
                ("status=\"client_error\"", get(&self.requests_client_error)),
                ("status=\"worker_error\"", get(&self.requests_worker_error)),
                ("status=\"cancelled\"", get(&self.requests_cancelled)),
            ],
        );
        let sum = get(&self.request_duration_us_sum) as f64 / 1e6;
        let _ = writeln!(
            out,
            "# HELP infera_request_duration_seconds Time from routing to the last response byte.\n\
             # TYPE infera_request_duration_seconds summary\n\
             infera_request_duration_seconds_sum {sum}\n\
             infera_request_duration_seconds_count {}",
            get(&self.request_duration_count)
        );
        let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        metric(
            "infera_request_inflight",
            "gauge",
            "Requests routed and not finished.",
            inflight as u64,
        );
        metric(
            "infera_active_workers",
            "gauge",
            "Registered workers.",
            workers as u64,
        );
        metric(
            "infera_policy_active_blocks",
            "gauge",
            "Distinct blocks of in-flight requests, summed over worker ranks.",
            active_blocks,
        );
        metric(
            "infera_events_applied_total",
            "counter",
            "Events appended to the log and applied to the fleet.",
            get(&self.events_applied),
        );
        metric(
            "infera_kv_stored_blocks_total",
            "counter",
            "Blocks reported stored by engines.",
            get(&self.kv_stored_blocks),
        );
        metric(
            "infera_kv_removed_blocks_total",
            "counter",
            "Blocks reported removed by engines.",
            get(&self.kv_removed_blocks),
        );
        metric(
            "infera_kv_dropped_events_total",
            "counter",
            "Engine KV events dropped at ingest (block-size mismatch, unknown parent...).",
            get(&self.kv_dropped_events),
        );
        metric(
            "infera_tokenizer_failures_total",
            "counter",
            "Requests the router tokenizer or chat template failed on (answered 400 or 500).",
            get(&self.tokenizer_failures),
        );
        metric(
            "infera_transport_timeouts_total",
            "counter",
            "Requests ended by the transport's idle or total timeout (504, worker told to cancel).",
            get(&self.transport_timeouts),
        );
        metric(
            "infera_transport_rejected_total",
            "counter",
            "Attempts refused by a worker's admission limit (429; retried elsewhere if allowed).",
            get(&self.transport_rejected),
        );
        metric(
            "infera_transport_sequence_errors_total",
            "counter",
            "Reply streams that lost or reordered a chunk (ended with an error, never relayed).",
            get(&self.transport_sequence_errors),
        );
        metric(
            "infera_kv_event_gaps_total",
            "counter",
            "KV-event gaps detected (filled from the engine's replay socket where it has one, else \
             the rank's blocks were cleared and rebuilt from later events).",
            get(&self.kv_gaps),
        );
        metric(
            "infera_kv_event_gaps_replayed_total",
            "counter",
            "KV-event gaps filled from the engine's replay socket, no blocks cleared.",
            get(&self.kv_gaps_replayed),
        );
        metric(
            "infera_pd_requests_total",
            "counter",
            "Attempts dispatched to a prefill/decode pair (each leg is recorded with its role in RequestRouted).",
            get(&self.pd_requests),
        );
        metric(
            "infera_pd_prefill_failures_total",
            "counter",
            "PD attempts whose prefill leg failed before the first byte (the decode leg was dropped or never sent).",
            get(&self.pd_prefill_failures),
        );
        metric(
            "infera_pd_pair_errors_total",
            "counter",
            "PD attempts refused because the pair's protocols differ or a registration lacks a parameter (500) or the prefill's answer lacks the hand-off (502).",
            get(&self.pd_pair_errors),
        );
        metric(
            "infera_breaker_trips_total",
            "counter",
            "Circuit breakers opened: a worker taken out of routing after consecutive failures \
             before the first byte, or a failed half-open probe.",
            get(&self.breaker_trips),
        );
        metric(
            "infera_breaker_open_workers",
            "gauge",
            "Workers whose circuit breaker is open (excluded from routing until the cooldown).",
            get(&self.breaker_open),
        );
        metric(
            "infera_breaker_half_open_workers",
            "gauge",
            "Workers whose circuit breaker is half-open (admitting one probe at a time).",
            get(&self.breaker_half_open),
        );
        metric(
            "infera_stream_migrations_total",
            "counter",
            "Streams continued on another worker after theirs failed mid-stream (--migration-limit).",
            get(&self.migrations),
        );
        out
    }
}
