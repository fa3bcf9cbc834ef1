//! The request pipeline as an application service, written against the ports: a [`Service`]
//! owns the router's event-sourced plane (the [`Kernel`] and the taps on its committed stream)
//! and takes a request that an edge has parsed, tokenized and hashed (a [`RouteRequest`](crate::policy::RouteRequest))
//! through decide → dispatch with failover → relay → record. It knows no HTTP server, no
//! OpenAI or Anthropic body and no transport: an edge (`infera-adapters`' HTTP front, the
//! endpoint picker) translates its protocol into calls here and the [`Reply`] or
//! [`RequestError`] back; requests go out through the [`RequestTransport`] port.
//!
//! # State
//! One [`Kernel`] (fleet projection, router, in-memory log) behind a `std::sync::Mutex` that is
//! only ever held for synchronous sections (never across `.await`). Every change is an event
//! committed on the kernel ([`Service::apply`]), so the fleet is always the fold of the log in
//! sequence order; the taps ([`taps`]) get a copy of each committed batch under the same lock.
//!
//! # Requests
//! [`Service::forward`] decides with the router, appends `RequestRouted` and hands the request
//! to the transport. A connection failure, a 429 admission reject, a timeout or a 5xx before
//! the first response byte finishes that attempt (`RequestFinished` with `worker_error`) and
//! re-decides with the failed rank excluded (and every worker whose circuit breaker is open,
//! see [`breaker`], that failed its health checks, see [`health`], or that serves far worse
//! than its peers, see [`outlier`]), up to `request_max_retries` more times; each attempt has
//! its own request id (`<key>.<n>`, `n` unique to the service) so the fleet's in-flight
//! accounting never mixes attempts, nor requests that share a client id. `RequestPrefilled` is appended at the first
//! response byte (for a prefill/decode pair: when the prefill leg's answer has arrived) and
//! `RequestFinished` at the end (or when the client goes away: `cancelled`), never
//! `RequestPrefilled` after it ([`Attempt`]). A worker registered with `dp_size > 1` fronts
//! several DP ranks: the request is pinned to the chosen one with the `X-data-parallel-rank`
//! header. A model served by prefill and decode workers is driven per the pair's protocol by
//! the private `pd` module; a stream whose worker fails midway may continue on another (private `migrate` module).
//!
//! # Direct mode
//! With a [`DirectPick`](crate::policy::DirectPick) the decision is [`Kernel::route`]'s direct one on the worker an
//! external endpoint picker named; it is not failed over.

mod admission;
mod attempt;
pub mod breaker;
pub mod deadline;
mod decide;
mod dispatch;
pub mod health;
pub mod metrics;
mod migrate;
pub mod outlier;
mod pd;
mod prepare;
mod reply;
pub mod taps;
#[cfg(test)]
mod test_support;

pub use admission::{Admitted, QueueConfig, Share};
pub use attempt::{Attempt, Usage};
pub use breaker::{BreakerConfig, BreakerState, PROBE_TIMEOUT};
pub use deadline::{FirstByte, FirstByteConfig, Prefill};
pub use decide::Route;
pub use health::HealthConfig;
pub use metrics::Metrics;
pub use outlier::OutlierConfig;
pub use pd::{Leg, Pair};
pub use prepare::{Prepared, RequestKeys};
pub use reply::{Reply, ReplyBody, RequestError};
pub use taps::{EventBatch, RequestMeta, drain_tap};

use crate::clock::Clock;
use crate::fleet::{FleetConfig, FleetState};
use crate::ids::RequestId;
use crate::kernel::{Compaction, Kernel};
use crate::log::NewEvent;
use crate::policy::RouterConfig;
use crate::ports::trace::TraceContext;
use crate::ports::transport::RequestTransport;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// What the service needs to know besides its ports.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// The routing policy and its weights.
    pub router: RouterConfig,
    /// Load accounting.
    pub fleet: FleetConfig,
    /// Extra attempts on another worker before the first response byte (`--request-max-retries`).
    pub request_max_retries: u32,
    /// The most a worker's answer may hold where the service reads it whole (a PD prefill's
    /// hand-off), as the edge bounds request bodies (`--max-body-bytes`).
    pub max_body_bytes: usize,
}

/// The router's kernel and the consumers of its committed stream, under one short lock.
#[derive(Debug)]
pub struct Plane {
    /// Fleet projection, router and in-memory log.
    pub kernel: Kernel,
    /// Consumers of the committed stream (see [`taps`]).
    taps: Vec<taps::Tap>,
}

impl Plane {
    /// Commits `events` on the kernel (see [`Kernel::commit`]) and hands the taps their copy;
    /// without taps nothing is copied. Returns how many events were applied.
    pub fn commit(&mut self, events: Vec<NewEvent>) -> usize {
        let tapped = !self.taps.is_empty();
        let (applied, copy) = self
            .kernel
            .commit_with(events, |envs| tapped.then(|| envs.to_vec()));
        if let Some(envs) = copy {
            self.feed_taps(envs);
        }
        applied
    }

    /// Ingests one engine batch on the kernel (see [`Kernel::ingest`]), feeding the taps.
    pub fn ingest(
        &mut self,
        rank: &crate::ids::WorkerRank,
        seq: Option<u64>,
        batch: &crate::kv_events::EngineBatch,
    ) -> Option<crate::kernel::Ingested> {
        let tapped = !self.taps.is_empty();
        let (done, copy) = self
            .kernel
            .ingest_with(rank, seq, batch, |envs| tapped.then(|| envs.to_vec()))?;
        if let Some(envs) = copy {
            self.feed_taps(envs);
        }
        Some(done)
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    plane: Mutex<Plane>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) options: ServiceOptions,
    pub(crate) metrics: Metrics,
    pub(crate) transport: Arc<dyn RequestTransport>,
    pub(crate) id_prefix: u64,
    /// `--enable-sla-metrics`: the SLA planner's histograms are recorded.
    pub(crate) sla_metrics: AtomicBool,
    pub(crate) meta_tap: Mutex<Option<taps::MetaTap>>,
    pub(crate) breaker: breaker::Breaker,
    pub(crate) health: health::Health,
    pub(crate) first_byte: deadline::FirstByte,
    pub(crate) outliers: outlier::Outliers,
    pub(crate) migration_limit: AtomicU32,
    pub(crate) admission: admission::Admission,
    /// The trace context of `--otlp-endpoint`, when set (see [`crate::ports::trace`]).
    pub(crate) trace: std::sync::OnceLock<Arc<dyn TraceContext>>,
}

/// A cheap, cloneable handle on the service. See the module docs.
#[derive(Debug, Clone)]
pub struct Service {
    pub(crate) inner: Arc<Inner>,
}

impl Service {
    /// A service with an empty fleet whose log and deadlines run on `clock`, sending requests
    /// over `transport`.
    pub fn new(
        options: ServiceOptions,
        transport: Arc<dyn RequestTransport>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let plane = Plane {
            kernel: Kernel::new(
                options.fleet,
                options.router.clone(),
                Arc::clone(&clock),
                Compaction::Auto,
            ),
            taps: Vec::new(),
        };
        let id_prefix = clock.now_us() ^ u64::from(std::process::id()).rotate_left(40);
        Self {
            inner: Arc::new(Inner {
                plane: Mutex::new(plane),
                clock,
                options,
                metrics: Metrics::default(),
                transport,
                id_prefix,
                sla_metrics: AtomicBool::new(false),
                meta_tap: Mutex::new(None),
                breaker: breaker::Breaker::default(),
                health: health::Health::default(),
                first_byte: deadline::FirstByte::default(),
                outliers: outlier::Outliers::default(),
                migration_limit: AtomicU32::new(0),
                admission: admission::Admission::default(),
                trace: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The plane, locked (keep the section short and synchronous).
    pub fn lock(&self) -> MutexGuard<'_, Plane> {
        self.inner
            .plane
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends `events` to the log and applies them to the fleet, in order. Returns how many
    /// were applied.
    pub fn apply(&self, events: Vec<NewEvent>) -> usize {
        if events.is_empty() {
            return 0;
        }
        let applied = self.lock().commit(events);
        self.inner.metrics.events_applied(applied as u64);
        if self.inner.admission.len() > 0 {
            self.pump();
        }
        applied
    }

    /// Runs `f` on the fleet under the lock (keep it short).
    pub fn with_fleet<T>(&self, f: impl FnOnce(&FleetState) -> T) -> T {
        f(self.lock().kernel.fleet())
    }

    /// The service's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The clock the log and the breaker run on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The request transport.
    pub fn transport(&self) -> &Arc<dyn RequestTransport> {
        &self.inner.transport
    }

    /// A number unique to this process and start, for ids the service and its edges mint.
    pub fn id_prefix(&self) -> u64 {
        self.inner.id_prefix
    }

    /// Propagates trace context with `trace` (set once, at start; see [`crate::ports::trace`]).
    pub fn set_trace_context(&self, trace: Arc<dyn TraceContext>) {
        let _ = self.inner.trace.set(trace);
    }

    /// The trace context, when traces are exported.
    pub fn trace_context(&self) -> Option<&Arc<dyn TraceContext>> {
        self.inner.trace.get()
    }

    /// Records the SLA planner's histograms (`--enable-sla-metrics`); off by default, so
    /// ordinary requests pay nothing for them.
    pub fn set_sla_metrics(&self, enabled: bool) {
        self.inner.sla_metrics.store(enabled, Ordering::Relaxed);
    }

    /// A new client request's key, `<client id>#<n>`: a client may send one
    /// `x-infera-request-id` with concurrent requests, and neither the fleet's in-flight
    /// accounting nor the trace recorder may merge them.
    pub fn request_key(&self, client_id: &str) -> String {
        RequestId::keyed(client_id, self.next_number()).0
    }

    /// A new attempt of the request keyed `key`: `<key>.<m>`.
    pub fn attempt_id(&self, key: &str) -> RequestId {
        RequestId::attempt(key, self.next_number())
    }

    /// The numbers in request keys and attempt ids (see [`RequestId`]), unique to this service.
    fn next_number(&self) -> u64 {
        static NEXT_NUMBER: AtomicU64 = AtomicU64::new(0);
        self.inner
            .id_prefix
            .wrapping_add(NEXT_NUMBER.fetch_add(1, Ordering::Relaxed))
    }
}
