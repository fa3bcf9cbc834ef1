//! The mock engine behind `infera worker mock`: a GPU-free, OpenAI-compatible server that
//! behaves like vLLM with prefix caching, driven by the core engine model
//! ([`infera_core::engine`]) on the wall clock, and publishing KV events in vLLM's format.
//!
//! # Pieces
//! - `http`: the axum routes — `POST /v1/completions`, `POST /v1/chat/completions` (streaming
//!   and not), `GET /v1/models`, `GET /health`, `GET /metrics`.
//! - `engine`: one task that owns the [`EngineModel`], fed by
//!   a bounded channel, that turns each step into tokens for the clients and a KV-event batch.
//! - `clock`: the engine loop's step clock, precise to the microsecond (a timerfd on Linux,
//!   where tokio's timer would end every step up to 2 ms late).
//! - `openai`: request parsing, response and error shapes, the filler text.
//! - `metrics`: vLLM-named Prometheus metrics, in one `prometheus_client` registry per mock.
//! - `pd`: the prefill/decode roles ([`MockConfig::pd`]): what each leg must carry per PD
//!   protocol (400 otherwise), the prefill's hand-off, and `GET /mock/pd-legs`.
//! - `abort`: SGLang's `POST /abort_request` by `rid`, and `GET /mock/pd-aborts`.
//! - `kvd`: the lower tier ([`MockConfig::kv_store`]): blocks loaded from and saved to a
//!   [`KvBlockStore`](infera_core::ports::kv_store::KvBlockStore), counted apart from the GPU
//!   prefix cache's hits (`infera_mock_kvd_hit_tokens_total`).
//!
//! # Tokens and hashes
//! With a tokenizer ([`MockConfig::tokenizer`], loaded from `--model-path` by the binary),
//! prompts are tokenized exactly as the router does (chat through the tokenizer's template);
//! without one, every UTF-8 byte is a token (logged at startup and reported by
//! `infera_mock_tokenizer_loaded 0`). Block hashes are the router's
//! ([`infera_core::hashing::hash_blocks`]), so shared prompt prefixes become cache hits.
//!
//! # KV events
//! Every step with cache changes yields one [`EngineBatch`] sent to the [`KvEventSink`], in
//! order: `BlockStored` with the blocks' token ids, the parent's engine hash, the block size and
//! medium `GPU`; `BlockRemoved`; `AllBlocksCleared`. Engine hashes are router hashes XOR a
//! per-process random [salt](MockServer::salt), as vLLM's differ per process. This crate does
//! not know the transport: the binary connects the sink to the ZeroMQ publisher.
//!
//! # Connections
//! Served by the crate's serve loop ([`crate::serve`]) within [`MockConfig::limits`]; accepted connections set `TCP_NODELAY`, so that every streamed token leaves
//! at once.
//!
//! # Shutdown
//! [`MockServer::serve`] stops accepting when its shutdown future completes, lets in-flight
//! requests finish for up to [`MockConfig::drain_timeout`], then stops the engine loop (streams
//! still open end with an error event). Nothing is detached: the engine task is joined.
//!
//! # Cancellation
//! A request whose client disconnects is aborted in the engine at the end of the step in which
//! that is noticed: its batch slot and blocks are freed (its published blocks stay cached).

mod abort;
mod clock;
mod engine;
mod http;
mod kvd;
mod metrics;
mod openai;
mod pd;
mod sse;

pub use kvd::{MockKvStore, block_value};
pub use openai::{DEFAULT_MAX_TOKENS, FILLER, filler, filler_start, filler_start_ids};
pub use pd::MockPd;

use crate::serve::ServeLimits;
use crate::tokenize::{TemplateKwargs, Tokenizer};
use infera_core::engine::{EngineConfig, EngineConfigError, EngineModel};
use infera_core::kv_events::EngineBatch;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where the mock sends its KV-event batches, in step order. A full channel holds the engine
/// back (events are never dropped); a closed one is logged and counted, and events stop.
pub type KvEventSink = mpsc::Sender<EngineBatch>;

/// Everything the mock engine needs.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Cache size, block size, batch limits, timing and speedup.
    pub engine: EngineConfig,
    /// The model name served (`/v1/models`, the `model` of responses).
    pub model_name: String,
    /// LoRA adapters served on top of it, by name (vLLM's `--lora-modules NAME=PATH`); more can
    /// be loaded at run time (`POST /v1/load_lora_adapter`).
    pub lora_adapters: Vec<String>,
    /// The model's tokenizer; `None` tokenizes by UTF-8 byte.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Larger request bodies are answered 413.
    pub max_body_bytes: usize,
    /// Requests that may wait for the engine loop to take them.
    pub queue_capacity: usize,
    /// How long in-flight requests may finish after shutdown starts.
    pub drain_timeout: Duration,
    /// The engine-hash salt; `None` draws a random one (tests fix it).
    pub salt: Option<u64>,
    /// A leg of a PD pair to play (see the `pd` module); `None`: a mixed engine.
    pub pd: Option<MockPd>,
    /// Client connection deadlines and cap of its HTTP server.
    pub limits: ServeLimits,
    /// The block store behind the GPU cache (kvd); `None`: the GPU prefix cache only.
    pub kv_store: Option<MockKvStore>,
    /// What the engine merges into every chat request before its template runs, as SGLang's
    /// `--default-chat-template-kwargs` (a request's own `chat_template_kwargs` win); reported
    /// at `GET /get_server_info` as SGLang reports it.
    pub chat_template_defaults: TemplateKwargs,
}

impl MockConfig {
    /// Defaults: 32 MiB bodies, a queue of 4096 requests, a 30 s drain, a random salt, the serve
    /// loop's default client bounds.
    pub fn new(model_name: impl Into<String>, engine: EngineConfig) -> Self {
        Self {
            engine,
            model_name: model_name.into(),
            lora_adapters: Vec::new(),
            tokenizer: None,
            max_body_bytes: 32 << 20,
            queue_capacity: 4096,
            drain_timeout: Duration::from_secs(30),
            salt: None,
            pd: None,
            limits: ServeLimits::default(),
            kv_store: None,
            chat_template_defaults: TemplateKwargs::new(),
        }
    }
}

/// Why the mock could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// The engine parameters are invalid (not retryable: fix the flags).
    #[error("mock engine: {0}")]
    Config(#[from] EngineConfigError),
    /// The HTTP address could not be bound (retryable once the port is free).
    #[error("mock engine: cannot bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed while running.
    #[error("mock engine: http server failed: {0}")]
    Serve(#[source] std::io::Error),
}

impl MockError {
    /// Whether starting again later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, MockError::Bind { .. } | MockError::Serve(_))
    }
}

/// The fields a mock worker adds to its registration record (PROTOCOLS.md §1): it registers with
/// `engine: "vllm"`, whose formats it speaks, and names itself with `"mock": true`; it also
/// states its capacity in blocks and its prefill speed (at its step budget, the speed the
/// router weighs loading a block from a lower tier against), and with a block store
/// `"kvd_backed": true`. The record's own fields (engine, block size) are not repeated.
pub fn registration_extra(
    engine: &EngineConfig,
    kvd_backed: bool,
) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("mock".into(), true.into());
    m.insert(
        infera_core::event::KV_CAPACITY_BLOCKS.into(),
        engine.gpu_blocks.into(),
    );
    if let Some(speed) = engine.prefill_tokens_per_s() {
        m.insert(
            infera_core::event::PREFILL_TOKENS_PER_S.into(),
            speed.into(),
        );
    }
    if kvd_backed {
        m.insert(
            infera_core::ports::kv_store::KVD_BACKED_FIELD.into(),
            true.into(),
        );
    }
    m
}

/// Cancels the engine loop when the server is dropped without being served.
#[derive(Debug)]
struct CancelOnDrop(CancellationToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A bound mock engine: its listener, its running engine loop and its routes.
#[derive(Debug)]
pub struct MockServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    state: Arc<http::AppState>,
    engine_task: JoinHandle<()>,
    engine_cancel: CancelOnDrop,
    max_body_bytes: usize,
    drain_timeout: Duration,
    limits: ServeLimits,
    salt: u64,
    engine_config: EngineConfig,
    kvd_backed: bool,
    stall: StallSwitch,
}

/// Stops a mock engine's scheduler (no step runs; its HTTP server, `/health` included, still
/// answers) or starts it again: an engine that answers but makes no progress.
#[derive(Debug, Clone)]
pub struct StallSwitch(tokio::sync::watch::Sender<bool>);

impl StallSwitch {
    /// Stops a running scheduler or starts a stopped one; returns whether it is stopped now.
    pub fn toggle(&self) -> bool {
        let mut stalled = false;
        self.0.send_modify(|s| {
            *s = !*s;
            stalled = *s;
        });
        stalled
    }
}

impl MockServer {
    /// Binds `addr` and starts the engine loop. Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`MockError::Config`] for invalid engine parameters, [`MockError::Bind`] when the address
    /// cannot be bound.
    pub async fn bind(
        addr: &str,
        config: MockConfig,
        sink: Option<KvEventSink>,
    ) -> Result<Self, MockError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MockError::Bind {
                addr: addr.to_owned(),
                source,
            })?;
        Self::from_listener(listener, config, sink)
    }

    /// Like [`MockServer::bind`] with a listener bound by the caller.
    ///
    /// # Errors
    /// [`MockError::Config`] for invalid engine parameters, [`MockError::Bind`] when the
    /// listener has no local address.
    pub fn from_listener(
        listener: TcpListener,
        config: MockConfig,
        sink: Option<KvEventSink>,
    ) -> Result<Self, MockError> {
        let model = EngineModel::try_new(config.engine.clone())?;
        let local_addr = listener.local_addr().map_err(|source| MockError::Bind {
            addr: "listener".to_owned(),
            source,
        })?;
        let salt = config.salt.unwrap_or_else(engine::process_random);
        let info = metrics::StaticInfo {
            block_size: config.engine.block_size,
            gpu_blocks: config.engine.gpu_blocks,
            tokenizer_loaded: config.tokenizer.is_some(),
        };
        let metrics = Arc::new(metrics::MockMetrics::new(&config.model_name, &info));
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let cancel = CancellationToken::new();
        let engine_loop = engine::EngineLoop::new(model, salt, sink, Arc::clone(&metrics));
        let (stall, stalled) = tokio::sync::watch::channel(false);
        let engine_task = tokio::spawn(engine_loop.run(rx, cancel.clone(), stalled));
        if config.tokenizer.is_none() {
            tracing::warn!(
                model = %config.model_name,
                "mock engine has no tokenizer: prompts are tokenized one token per byte, so \
                 its block hashes will not match a router that uses the model's tokenizer"
            );
        }
        let kvd_backed = config.kv_store.is_some();
        let kvd = config
            .kv_store
            .map(|store| kvd::Tier::new(store, &config.model_name, config.engine.block_size));
        let state = Arc::new(http::AppState {
            kvd,
            filler_ids: http::AppState::filler_ids(config.tokenizer.as_deref()),
            model_name: config.model_name,
            adapters: std::sync::RwLock::new(config.lora_adapters),
            info,
            tokenizer: config.tokenizer,
            engine: tx,
            metrics,
            id_prefix: engine::process_random(),
            next_id: AtomicU64::new(0),
            pd: config.pd,
            pd_log: pd::LegLog::default(),
            aborts: abort::Aborts::default(),
            template_defaults: config.chat_template_defaults,
        });
        Ok(Self {
            listener,
            local_addr,
            state,
            engine_task,
            engine_cancel: CancelOnDrop(cancel),
            max_body_bytes: config.max_body_bytes,
            drain_timeout: config.drain_timeout,
            limits: config.limits,
            salt,
            engine_config: config.engine,
            kvd_backed,
            stall: StallSwitch(stall),
        })
    }

    /// The switch that stops and starts the engine's scheduler.
    pub fn stall_switch(&self) -> StallSwitch {
        self.stall.clone()
    }

    /// The bound HTTP address (port resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The salt XORed into router hashes to make this process's engine hashes.
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// See [`registration_extra`].
    pub fn registration_extra(&self) -> serde_json::Map<String, serde_json::Value> {
        registration_extra(&self.engine_config, self.kvd_backed)
    }

    /// Serves until `shutdown` completes, then drains (bounded by the drain timeout) and stops
    /// the engine loop.
    ///
    /// # Errors
    /// [`MockError::Serve`] when the HTTP server fails.
    pub async fn serve<F>(self, shutdown: F) -> Result<(), MockError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Self {
            listener,
            local_addr,
            state,
            engine_task,
            engine_cancel,
            max_body_bytes,
            drain_timeout,
            limits,
            ..
        } = self;
        let draining = CancellationToken::new();
        let signal = {
            let draining = draining.clone();
            async move {
                shutdown.await;
                tracing::info!(%local_addr, "mock engine draining");
                draining.cancel();
            }
        };
        let app = http::router(state, max_body_bytes);
        let server = crate::serve::serve(listener, app, limits, signal);
        let bound = async {
            draining.cancelled().await;
            tokio::time::sleep(drain_timeout).await;
        };
        let result = tokio::select! {
            r = server => r.map_err(MockError::Serve),
            () = bound => {
                tracing::warn!(
                    timeout_ms = drain_timeout.as_millis() as u64,
                    "mock engine drain timed out; ending the remaining requests"
                );
                Ok(())
            }
        };
        drop(engine_cancel);
        if let Err(e) = engine_task.await {
            tracing::error!(error = %e, "mock engine loop panicked");
        }
        tracing::info!(%local_addr, "mock engine stopped");
        result
    }
}
