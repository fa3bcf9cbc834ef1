//! The `infera server` front: the OpenAI-compatible HTTP API, the adapter before the request
//! service (`infera_core::service`). It reads and parses bodies, implements the service's
//! tokenizer port (the private `tokens` module: the tokenizer, chat templates and per-worker
//! renderings), and translates the service's reply and errors back into HTTP, SSE and the
//! OpenAI or Anthropic error shapes; hashing, deciding, dispatching, failover, relaying and
//! recording are the service's.
//!
//! # State
//! [`ServerState`] holds the [`Service`] (which owns the kernel: fleet projection, router,
//! in-memory log, and the taps on its committed stream), the tokenizer and the front's options.
//! Discovery and the KV-event transport feed events through [`Service::apply`],
//! [`ServerState::register_worker`], [`ServerState::deregister_worker`] and
//! [`ServerState::ingest_kv_batch`] (the KV-event pipeline's [`KvSink`]); this crate does not
//! know those transports.
//!
//! # Requests (PROTOCOLS.md §2 and §4)
//! A body is read within `--max-body-bytes` and the parse budget; [`Service::prepare`]
//! tokenizes it through the front's tokenizer on the blocking pool (a chat rendered with its
//! template, and again the way each SGLang worker with other template defaults renders it) and
//! hashes it at every block size the model's workers use (round-robin needs no prefix, so under
//! it requests are neither tokenized nor hashed); [`Service::forward`] takes it from there. Its [`Reply`](infera_core::service::Reply) becomes the response; a
//! stream the service ends with a failure ends with an SSE `data: {"error": ...}` event and
//! `data: [DONE]`. Every request carries `x-infera-request-id` (the client's, or one minted
//! here); the service keys it `<id>#<n>` so concurrent requests with one id never merge.
//!
//! # Direct mode
//! With [`ServerOptions::direct`], the pipeline is the same (tokenize, hash, record), but the
//! decision is the router's direct one on the worker named by `x-worker-instance-id` (and
//! `x-prefill-instance-id`, `x-dp-rank`): a missing header is a 400, a worker that is not
//! registered a 503, a worker of another model a 400. The named worker is not failed over.
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
mod body;
mod client;
mod durable;
#[cfg(test)]
mod fuzz;
mod http;
mod lora;
mod pick;
mod prewarm;
mod profile;
mod prompt;
mod scale;
mod tenants;
#[cfg(test)]
mod test_support;
mod tokens;
pub mod transport;
mod tuning;
mod variants;

pub use client::{AdminToken, ClientOptions, ParseBudget};
pub use durable::{COMPACT_EVERY, DurableLog, REPLICA_PREFIX, attach as attach_event_log};
pub use infera_core::service::metrics::Metrics as ServerMetrics;
pub use infera_core::service::{
    BreakerConfig, BreakerState, EventBatch, PROBE_TIMEOUT, RequestMeta,
};
pub use lora::LoraLoading;
pub use pick::{Pick, PickError};
pub use prewarm::{DEFAULT_DEADLINE_MS, MAX_KEYS};
pub use tenants::{KeyStore, RELOAD_EVERY};
pub use transport::{FirstByteDeadline, HttpDeadlines, HttpTransport};

use crate::tokenize::{ChatTemplate, TemplateKwargs, Tokenizer};
use infera_core::clock::{Clock, SystemClock};
use infera_core::event::{
    Event, KvCacheCleared, Source, WorkerDeregistered, WorkerDraining, WorkerRecord,
    WorkerRegistered,
};
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::kv_events::pipeline::KvSink;
use infera_core::kv_events::{EngineBatch, IngestStats};
use infera_core::log::NewEvent;
use infera_core::ports::prefetch::KvPrefetch;
use infera_core::ports::scaling::PoolScaler;
use infera_core::ports::transport::RequestTransport;
use infera_core::service::{Plane, Service, ServiceOptions};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::net::TcpListener;

/// Everything the front needs besides the default tokenizer.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The request service's options: routing, retries, and the body bound (a larger request
    /// body is answered 413, `--max-body-bytes`).
    pub service: ServiceOptions,
    /// A chat template that overrides the tokenizer's (`--chat-template`).
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// The template kwargs the workers' engines merge into every chat request before they
    /// render (`--kv-default-chat-template-kwargs`, matching their
    /// `--default-chat-template-kwargs`).
    pub template_defaults: Arc<TemplateKwargs>,
    /// `--kv-per-worker-template-kwargs`: ask each SGLang worker for the template defaults its
    /// engine merges in, and hash its chats its way where they differ from `template_defaults`.
    pub per_worker_template_kwargs: bool,
    /// `--model-tokenizer MODEL=PATH`: the tokenizers (with their own chat templates) of the
    /// base models that do not use the default one; an adapter uses its base model's.
    pub model_tokenizers: BTreeMap<String, Arc<Tokenizer>>,
    /// `--lora-load-path`: load an adapter nobody serves on demand (off: `None`).
    pub lora_loading: Option<LoraLoading>,
    /// `--router-mode direct`: route each request to the worker its `x-worker-instance-id`
    /// header names (and `x-prefill-instance-id`, `x-dp-rank`), picked by an external endpoint
    /// picker; no policy, no failover.
    pub direct: bool,
    /// Client connection deadlines and cap, the parse budget and the admin token.
    pub client: ClientOptions,
}

#[derive(Debug)]
pub(crate) struct Inner {
    /// The request pipeline and the router's plane (see `infera_core::service`).
    pub(crate) service: Service,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) options: ServerOptions,
    pub(crate) restore: Mutex<durable::RestoreState>,
    pub(crate) prefetch: Mutex<Option<Arc<dyn KvPrefetch>>>,
    /// Each probed worker's own chat template defaults (`--kv-per-worker-template-kwargs`).
    pub(crate) variants: variants::Variants,
    /// `--enable-scaling-api`: the pools `/v1/admin/scale` reads and resizes.
    pub(crate) scaler: Mutex<Option<Arc<dyn PoolScaler>>>,
    /// What `--auto-tune` published last (`GET /v1/admin/tuning`); `None` when it is off.
    pub(crate) tuning: Mutex<Option<Arc<serde_json::Value>>>,
    pub(crate) profiling: std::sync::atomic::AtomicBool,
    /// On-demand adapter loads in progress (see `lora`).
    pub(crate) lora_loads: lora::Loads,
    /// Every request's tenant without `--api-keys`.
    pub(crate) anonymous: Arc<infera_core::tenancy::Tenant>,
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
        let service = Service::new(options.service.clone(), transport, clock);
        if crate::telemetry::exporting() {
            service.set_trace_context(Arc::new(crate::telemetry::W3c::default()));
        }
        let variants = variants::Variants::new(options.per_worker_template_kwargs);
        Self {
            inner: Arc::new(Inner {
                service,
                tokenizer,
                options,
                restore: Mutex::new(durable::RestoreState::default()),
                prefetch: Mutex::new(None),
                scaler: Mutex::new(None),
                tuning: Mutex::new(None),
                variants,
                profiling: std::sync::atomic::AtomicBool::new(false),
                lora_loads: lora::Loads::default(),
                anonymous: infera_core::tenancy::Tenant::anonymous(),
            }),
        }
    }

    /// The request pipeline this front translates into.
    pub fn service(&self) -> &Service {
        &self.inner.service
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Plane> {
        self.inner.service.lock()
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
        self.service().apply(events);
    }

    /// A worker left routing.
    pub fn deregister_worker(&self, worker: WorkerId, reason: String) {
        tracing::info!(worker = %worker.as_str(), %reason, "worker deregistered");
        self.inner.service.transport().worker_left(&worker);
        self.inner.variants.forget(&worker);
        self.service()
            .apply(vec![NewEvent::new(Event::WorkerDeregistered(
                WorkerDeregistered { worker, reason },
            ))]);
    }

    /// A registered worker is shutting down: it stays listed in `/v1/workers` (with
    /// `"draining": true`) and finishes its in-flight requests, but is routed nothing new until
    /// it registers again. Requests already decided for it still go there.
    pub fn drain_worker(&self, worker: WorkerId, reason: String) {
        tracing::info!(worker = %worker.as_str(), %reason, "worker draining");
        self.service()
            .apply(vec![NewEvent::new(Event::WorkerDraining(WorkerDraining {
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
        self.service().metrics().events_applied(done.applied as u64);
        self.service().metrics().kv_ingested(&done.stats);
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
        self.service().apply(vec![NewEvent::from_source(
            source,
            Event::KvCacheCleared(KvCacheCleared {
                worker: rank.clone(),
                tier: None,
            }),
        )]);
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
        self.service().metrics().kv_gap(replayed);
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
