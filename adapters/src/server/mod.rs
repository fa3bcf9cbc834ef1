//! The `infera server` front: the OpenAI-compatible HTTP API, the request pipeline (parse →
//! tokenize → hash → decide → forward → relay) and the router state it decides with.
//!
//! # State
//! [`ServerState`] owns one [`Kernel`] (fleet projection, router, in-memory log; see
//! `infera_core::kernel`) behind a `std::sync::Mutex` that is only ever held for synchronous
//! sections (never across `.await`). Every change is an event committed on the kernel, so the
//! fleet is always the fold of the log in sequence order; the server's taps get a copy of each
//! committed batch under the same lock. Discovery and the
//! KV-event transport feed events through [`ServerState::apply`],
//! [`ServerState::register_worker`], [`ServerState::deregister_worker`] and
//! [`ServerState::ingest_kv_batch`] (the KV-event pipeline's [`KvSink`]); this crate does not
//! know those transports.
//!
//! # Requests (PROTOCOLS.md §2 and §4)
//! A request is tokenized on the blocking pool, hashed at every block size the model's workers
//! use, and decided by the [`Router`] (round-robin needs no prefix, so under it requests are
//! neither tokenized nor hashed); the `RequestRouted` event is appended before the request
//! is handed to the [`RequestTransport`] the server was built with (HTTP to `worker.url + path`
//! by default, NATS from `infera-backends`). A connection failure, a 429 admission reject, a
//! timeout or a 5xx before the first response byte finishes that attempt (`RequestFinished` with
//! `worker_error`) and re-decides with the failed rank excluded (and every worker whose circuit
//! breaker is open, see the private `breaker` module), up to `request_max_retries` more times; each attempt has its own request
//! id (`<id>#<n>`, `n` unique to the server) so the fleet's in-flight accounting never mixes
//! attempts, nor requests that share a client id.
//! `RequestPrefilled` is appended at the first response byte (for a prefill/decode pair: when
//! the prefill leg's answer has arrived) and `RequestFinished` at the end (or when the client
//! goes away: `cancelled`), never `RequestPrefilled` after it. A stream that fails midway ends
//! with an SSE `data: {"error": ...}` event and `data: [DONE]`. A worker registered with
//! `dp_size > 1` fronts several DP ranks: the request is pinned to the chosen one with the
//! `X-data-parallel-rank` header (its rank within the registration), which vLLM, SGLang and ATOM
//! read.
//!
//! # Direct mode
//! With [`ServerOptions::direct`], the pipeline is the same (tokenize, hash, record), but the
//! decision is [`Router::decide_direct`] on the worker named by `x-worker-instance-id` (and
//! `x-prefill-instance-id`, `x-dp-rank`): a missing header is a 400, a worker that is not
//! registered a 503, a worker of another model a 400. The named worker is not failed over.
//!
//! # Prefill/decode
//! A model served by prefill and decode workers is decided onto one of each (one
//! `RequestRouted` with both legs, each with its role, so both count as load); the private `pd`
//! module drives the pair per the protocol both registered in `disagg_meta.protocol`
//! (PROTOCOLS.md §7): concurrent legs (`sglang-bootstrap`, `vllm-mori-write`) or a one-token
//! prefill whose answer builds the decode leg (`vllm-nixl`, `vllm-mooncake`, `vllm-mori-read`,
//! `atom-mooncake`). The client gets the decode leg's response; a failed prefill fails the
//! attempt before the first byte and is failed over like a single worker. An SGLang leg left
//! running when its pair is given up gets SGLang's `POST /abort_request` (private `pd_abort`
//! module).
//!
//! # Other endpoints
//! `/v1/messages` is translated by the private `anthropic` module; `/v1/cache/prewarm`,
//! `/v1/admin/profile/{start,stop}` and `/v1/admin/scale` are served by the `prewarm`, `profile`
//! and `scale` modules.
//!
//! # Deciding only
//! [`ServerState::pick`] (private `pick` module) runs the pipeline up to the decision for a
//! gateway that sends the request itself (`infera gaie`), with the same load accounting.
//!
//! # Clients
//! Connections are served by the crate's one serve loop ([`crate::serve`]: header, idle and body
//! deadlines, a connection cap); request bodies are parsed within a server-wide memory budget
//! without building a JSON tree of their token ids (private `body` module); the admin
//! endpoints and `/v1/workers` take an optional bearer token (private `client` module).

mod anthropic;
mod attempt;
mod body;
mod breaker;
mod client;
mod durable;
#[cfg(test)]
mod fuzz;
mod http;
mod metrics;
mod migrate;
mod pd;
mod pd_abort;
mod pick;
mod prewarm;
mod profile;
mod prompt;
mod relay;
mod scale;
mod taps;
#[cfg(test)]
mod test_support;
pub mod transport;
mod variants;

pub use breaker::{BreakerConfig, BreakerState, PROBE_TIMEOUT};
pub use client::{AdminToken, ClientOptions, ParseBudget};
pub use durable::{COMPACT_EVERY, DurableLog, REPLICA_PREFIX, attach as attach_event_log};
pub use metrics::ServerMetrics;
pub use pick::{Pick, PickError};
pub use prewarm::{DEFAULT_DEADLINE_MS, MAX_KEYS};
pub use taps::{EventBatch, RequestMeta};
pub use transport::{HttpDeadlines, HttpTransport};

use crate::tokenize::{ChatTemplate, TemplateKwargs, Tokenizer};
use infera_core::clock::{Clock, SystemClock};
use infera_core::event::{
    Event, KvCacheCleared, Source, WorkerDeregistered, WorkerDraining, WorkerRecord,
    WorkerRegistered,
};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::kernel::{Compaction, Ingested, Kernel};
use infera_core::kv_events::pipeline::KvSink;
use infera_core::kv_events::{EngineBatch, IngestStats};
use infera_core::log::NewEvent;
use infera_core::policy::RouterConfig;
use infera_core::ports::prefetch::KvPrefetch;
use infera_core::ports::scaling::PoolScaler;
use infera_core::ports::transport::RequestTransport;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::net::TcpListener;

/// Everything the front needs besides the tokenizer.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Larger request bodies are answered 413 (`--max-body-bytes`).
    pub max_body_bytes: usize,
    /// Extra attempts on another worker before the first response byte (`--request-max-retries`).
    pub request_max_retries: u32,
    /// The routing policy and its weights.
    pub router: RouterConfig,
    /// Load accounting.
    pub fleet: FleetConfig,
    /// A chat template that overrides the tokenizer's (`--chat-template`).
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// The template kwargs the workers' engines merge into every chat request before they
    /// render (`--kv-default-chat-template-kwargs`, matching their
    /// `--default-chat-template-kwargs`).
    pub template_defaults: Arc<TemplateKwargs>,
    /// `--kv-per-worker-template-kwargs`: ask each SGLang worker for the template defaults its
    /// engine merges in, and hash its chats its way where they differ from `template_defaults`.
    pub per_worker_template_kwargs: bool,
    /// `--router-mode direct`: route each request to the worker its `x-worker-instance-id`
    /// header names (and `x-prefill-instance-id`, `x-dp-rank`), picked by an external endpoint
    /// picker; no policy, no failover.
    pub direct: bool,
    /// Client connection deadlines and cap, the parse budget and the admin token.
    pub client: ClientOptions,
}

/// The router's kernel and the consumers of its committed stream, under one short lock.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) kernel: Kernel,
    /// Consumers of the committed stream (see [`taps`]).
    pub(crate) taps: Vec<taps::Tap>,
}

impl Core {
    /// Commits `events` on the kernel (see [`Kernel::commit`]) and hands the taps their copy;
    /// without taps nothing is copied. Returns how many events were applied.
    pub(crate) fn commit(&mut self, events: Vec<NewEvent>) -> usize {
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
    fn ingest(
        &mut self,
        rank: &WorkerRank,
        seq: Option<u64>,
        batch: &EngineBatch,
    ) -> Option<Ingested> {
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
    pub(crate) core: Mutex<Core>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) options: ServerOptions,
    pub(crate) metrics: ServerMetrics,
    pub(crate) transport: Arc<dyn RequestTransport>,
    pub(crate) id_prefix: u64,
    pub(crate) restore: Mutex<durable::RestoreState>,
    pub(crate) prefetch: Mutex<Option<Arc<dyn KvPrefetch>>>,
    /// Each probed worker's own chat template defaults (`--kv-per-worker-template-kwargs`).
    pub(crate) variants: variants::Variants,
    /// `--enable-scaling-api`: the pools `/v1/admin/scale` reads and resizes.
    pub(crate) scaler: Mutex<Option<Arc<dyn PoolScaler>>>,
    pub(crate) profiling: std::sync::atomic::AtomicBool,
    /// `--enable-sla-metrics`: the SLA planner's histograms are recorded.
    pub(crate) sla_metrics: std::sync::atomic::AtomicBool,
    pub(crate) meta_tap: Mutex<Option<taps::MetaTap>>,
    pub(crate) breaker: breaker::Breaker,
    pub(crate) migration_limit: std::sync::atomic::AtomicU32,
}

/// A cheap, cloneable handle on the server's state. See the module docs.
#[derive(Debug, Clone)]
pub struct ServerState {
    pub(crate) inner: Arc<Inner>,
}

impl ServerState {
    /// A server with an empty fleet, on the system clock, sending requests over HTTP.
    pub fn new(options: ServerOptions, tokenizer: Arc<Tokenizer>) -> Self {
        Self::with_transport(options, tokenizer, Arc::new(HttpTransport::new()))
    }

    /// A server with an empty fleet, on the system clock, sending requests over `transport`.
    pub fn with_transport(
        options: ServerOptions,
        tokenizer: Arc<Tokenizer>,
        transport: Arc<dyn RequestTransport>,
    ) -> Self {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let core = Core {
            kernel: Kernel::new(
                options.fleet,
                options.router.clone(),
                Arc::clone(&clock),
                Compaction::Auto,
            ),
            taps: Vec::new(),
        };
        let id_prefix = clock.now_us() ^ u64::from(std::process::id()).rotate_left(40);
        let variants = variants::Variants::new(options.per_worker_template_kwargs);
        Self {
            inner: Arc::new(Inner {
                core: Mutex::new(core),
                clock,
                tokenizer,
                options,
                metrics: ServerMetrics::default(),
                transport,
                id_prefix,
                restore: Mutex::new(durable::RestoreState::default()),
                prefetch: Mutex::new(None),
                scaler: Mutex::new(None),
                variants,
                profiling: std::sync::atomic::AtomicBool::new(false),
                sla_metrics: std::sync::atomic::AtomicBool::new(false),
                meta_tap: Mutex::new(None),
                breaker: breaker::Breaker::default(),
                migration_limit: std::sync::atomic::AtomicU32::new(0),
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.inner
            .core
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
        applied
    }

    /// A worker appeared (or its record changed).
    pub fn register_worker(&self, record: WorkerRecord) {
        tracing::info!(worker = %record.worker_id.as_str(), url = %record.url,
            model = %record.model_name, "worker registered");
        let restored = self.take_restored(&record);
        if record.engine == infera_core::event::Engine::Sglang
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (state, record) = (self.clone(), record.clone());
            runtime.spawn(async move { state.probe_render_variant(&record).await });
        }
        let mut events = vec![NewEvent::new(Event::WorkerRegistered(WorkerRegistered {
            record,
        }))];
        events.extend(restored);
        self.apply(events);
    }

    /// A worker left routing.
    pub fn deregister_worker(&self, worker: WorkerId, reason: String) {
        tracing::info!(worker = %worker.as_str(), %reason, "worker deregistered");
        self.inner.transport.worker_left(&worker);
        self.inner.variants.forget(&worker);
        self.apply(vec![NewEvent::new(Event::WorkerDeregistered(
            WorkerDeregistered { worker, reason },
        ))]);
    }

    /// A registered worker is shutting down: it stays listed in `/v1/workers` (with
    /// `"draining": true`) and finishes its in-flight requests, but is routed nothing new until
    /// it registers again. Requests already decided for it still go there.
    pub fn drain_worker(&self, worker: WorkerId, reason: String) {
        tracing::info!(worker = %worker.as_str(), %reason, "worker draining");
        self.apply(vec![NewEvent::new(Event::WorkerDraining(WorkerDraining {
            worker,
            reason,
        }))]);
    }

    /// The registered record of `worker`, if any.
    pub fn worker(&self, worker: &WorkerId) -> Option<WorkerRecord> {
        self.lock().kernel.fleet().worker(worker).cloned()
    }

    /// Number of registered workers.
    pub fn worker_count(&self) -> usize {
        self.lock().kernel.fleet().worker_count()
    }

    /// Runs `f` on the fleet under the lock (keep it short; for tests and status pages).
    pub fn with_fleet<T>(&self, f: impl FnOnce(&FleetState) -> T) -> T {
        f(self.lock().kernel.fleet())
    }

    /// Converts one engine batch of `rank` into core events (parents resolved through the
    /// fleet's index) and applies them. An unregistered worker's batch is dropped (`None`).
    pub fn ingest_kv_batch(
        &self,
        rank: &WorkerRank,
        seq: Option<u64>,
        batch: &EngineBatch,
    ) -> Option<IngestStats> {
        let stale = self.restored_index_is_stale(rank, seq);
        let mut core = self.lock();
        if stale && core.kernel.fleet().worker(&rank.worker).is_some() {
            core.commit(vec![NewEvent::new(Event::KvCacheCleared(KvCacheCleared {
                worker: rank.clone(),
                tier: None,
            }))]);
        }
        let done = core.ingest(rank, seq, batch)?;
        drop(core);
        self.inner.metrics.events_applied(done.applied as u64);
        self.inner.metrics.kv_ingested(&done.stats);
        if done.stats.dropped() > 0 {
            tracing::warn!(worker = %rank.worker.as_str(), dp_rank = rank.dp_rank,
                dropped = done.stats.dropped(), stats = ?done.stats, "kv events dropped");
        }
        Some(done.stats)
    }

    /// Forgets every block of `rank` (its engine restarted, or its events can no longer be
    /// trusted); the batches that follow rebuild them.
    pub fn clear_rank(&self, rank: &WorkerRank, seq: Option<u64>) {
        let source = Source {
            worker: rank.worker.clone(),
            dp_rank: rank.dp_rank,
            seq,
        };
        self.apply(vec![NewEvent::from_source(
            source,
            Event::KvCacheCleared(KvCacheCleared {
                worker: rank.clone(),
                tier: None,
            }),
        )]);
    }

    /// The name of the request transport (`http`, `nats`).
    pub fn transport_name(&self) -> &'static str {
        self.inner.transport.name()
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.inner.metrics
    }

    /// The axum routes of the server API.
    pub fn router(&self) -> axum::Router {
        http::router(self.clone())
    }
}

/// The server is where every KV-event pipeline delivers (`infera_core::kv_events::pipeline`).
impl KvSink for ServerState {
    fn ingest(&self, rank: &WorkerRank, seq: Option<u64>, batch: &EngineBatch) -> bool {
        self.ingest_kv_batch(rank, seq, batch).is_some()
    }

    fn clear(&self, rank: &WorkerRank, seq: Option<u64>) {
        self.clear_rank(rank, seq);
    }

    fn gap(&self, _rank: &WorkerRank, _missing: &std::ops::RangeInclusive<u64>, replayed: bool) {
        self.inner.metrics.kv_gap(replayed);
    }

    fn malformed(&self, worker: &WorkerId, reason: &str) {
        tracing::warn!(worker = worker.as_str(), %reason, "malformed kv event message");
    }
}

/// Serves the API on `listener` until `shutdown` completes, then lets in-flight requests finish,
/// within the client bounds of [`ServerOptions::client`] (see [`crate::serve`]).
///
/// # Errors
/// The listener's I/O error when serving fails.
pub async fn serve<F>(listener: TcpListener, state: ServerState, shutdown: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let limits = state.inner.options.client.limits.clone();
    crate::serve::serve(listener, state.router(), limits, shutdown).await
}
