//! `infera up`: a local fleet in one process, for the quickstart and demos.
//!
//! One tokio runtime runs the OpenAI-compatible server ([`infera_adapters::server`]) and N mock
//! engines ([`infera_adapters::mock::MockServer`]) on loopback ports, without etcd or ZeroMQ:
//!
//! - discovery is embedded: each mock's record is registered directly as a `WorkerRegistered`
//!   event ([`ServerState::register_worker`]);
//! - KV events take an in-process path through the same pipeline as every transport: each
//!   mock's [`KvEventSink`] batches are encoded as vLLM payloads, numbered, and sent on an
//!   in-process KV-event stream that `infera_core::kv_events::pipeline::consume` runs into the
//!   server's state.
//!
//! With `--kvd`, a kvd daemon ([`infera_kvd::KvdServer`]) runs in the same runtime on a Unix
//! socket (a fresh temporary directory, or `--kvd-socket`): every mock saves its KV blocks there
//! and loads the ones its GPU cache misses ([`MockKvStore`] on [`KvdBlockStore`]), the
//! server's prewarm goes to it, and its inventory reaches the router in process ([`kvd`]), so
//! the router credits what it holds. It is stopped after the mocks.
//!
//! Mocks and the router share one tokenizer, so their block hashes match. With `--port 0` every
//! port is chosen by the system; the bound ports are printed in the `server:` line on stdout.
//!
//! # Shutdown
//! SIGTERM or Ctrl-C stops the server (in-flight requests finish), then the mocks (their engine
//! loops are joined, which drops their sinks), then the forwarders end. Nothing is detached.

mod kvd;

use crate::kvd_store::KvdBlockStore;
use crate::net::socket_addr;
use crate::signals::Signals;
use anyhow::{Context as _, bail};
use clap::Args;
use infera_adapters::mock::{KvEventSink, MockConfig, MockError, MockKvStore, MockServer};
use infera_adapters::server::{ServerOptions, ServerState, serve};
use infera_adapters::tokenize::Tokenizer;
use infera_core::engine::EngineConfig;
use infera_core::event::{Engine, RequestTransport, Role, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::WorkerId;
use infera_core::kv_events::{EngineBatch, encode_batch_vllm, pipeline};
use infera_core::policy::{PolicyKind, RouterConfig};
use infera_core::ports::kv_events::{KvFrame, KvItem, KvSubscription};
use infera_core::service::ServiceOptions;
use kvd::LocalKvd;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The router tokenizer used when `--router-tokenizer-path` is not given (relative to the
/// current directory: the repository root).
pub const DEFAULT_TOKENIZER: &str = "fixtures/tokenizers/deepseek-v4";

/// Offset of the first mock's port from `--port` (8000 → 8101, 8102, …).
pub const WORKER_PORT_OFFSET: u16 = 101;

/// Arguments of `infera up`.
#[derive(Debug, Args)]
#[command(after_help = "Example: infera up --workers 3, then:\n  \
    curl -s http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
    -d '{\"model\": \"mock\", \"prompt\": \"Hello\", \"max_tokens\": 16}'")]
pub struct UpArgs {
    /// Number of mock engines.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub workers: u16,

    /// Server HTTP port; 0 lets the system choose. The mocks listen on 127.0.0.1 at
    /// --port + 101, + 102, … (system-chosen ports when --port is 0).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Server HTTP bind address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Model name served by the mocks (the `model` of requests).
    #[arg(long, default_value = "mock", value_name = "NAME")]
    pub model_name: String,

    /// Tokenizer shared by the router and the mocks: a directory containing tokenizer.json, or
    /// a tokenizer.json file. [default: fixtures/tokenizers/deepseek-v4 in the current
    /// directory]
    #[arg(long, value_name = "PATH")]
    pub router_tokenizer_path: Option<PathBuf>,

    /// The defaults of the router's tunables not given, as `infera server --router-profile`.
    #[arg(long, value_enum, default_value = "python")]
    pub router_profile: crate::config::RouterProfile,

    /// KV-aware: cache locality vs load balance, as `infera server`. [default: 1.0] (16 with
    /// --router-profile infera)
    #[arg(long, value_name = "WEIGHT", allow_negative_numbers = true)]
    pub kv_overlap_weight: Option<f64>,

    /// Routing policy, as `infera server`.
    #[arg(long, value_parser = crate::cli::policy_parser(), default_value_t)]
    pub router_policy: PolicyKind,

    /// KV blocks of simulated GPU memory per mock.
    #[arg(long, default_value_t = 16384, value_name = "N")]
    pub gpu_blocks: u32,

    /// Tokens per KV block (mocks and router).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub block_size: u32,

    /// Run the mocks' simulated time this many times faster than the timing model.
    #[arg(long, default_value = "1.0", value_name = "X")]
    pub speedup: f64,

    /// Run a kvd daemon in process (1 GiB of host RAM) and have the mocks save their KV blocks
    /// there and load the ones their GPU cache misses, so a prompt served by one mock is a
    /// kvd hit on another (`infera_mock_kvd_hit_tokens_total` on each mock's /metrics). The
    /// server's POST /v1/cache/prewarm goes to it too.
    #[arg(long)]
    pub kvd: bool,

    /// LoRA adapters every mock serves on top of --model-name, as vLLM's `--lora-modules`:
    /// `NAME=PATH` or `{"name": …, "path": …}` (the path is not read). Requests name an adapter
    /// as their `model`; `/v1/models` lists each with the model as `parent`; their KV blocks
    /// are keyed by the adapter, in the mocks and in the router.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,

    /// The socket of the in-process kvd (--kvd). [default: kvd.sock in a fresh temporary
    /// directory, removed on exit]
    #[arg(long, value_name = "PATH", requires = "kvd")]
    pub kvd_socket: Option<PathBuf>,
}

/// Why `infera up` did not run: invalid flags (exit 2) or a failure while running (exit 1).
#[derive(Debug)]
pub enum UpFailure {
    /// The flags are invalid.
    Invalid(anyhow::Error),
    /// Startup or serving failed.
    Failed(anyhow::Error),
}

/// Runs the fleet until SIGTERM or Ctrl-C.
///
/// # Errors
/// [`UpFailure::Invalid`] for invalid flags or a missing tokenizer; [`UpFailure::Failed`] for a
/// tokenizer that does not load, a port that cannot be bound or a server that fails.
pub fn run(args: UpArgs) -> Result<(), UpFailure> {
    let tokenizer_path = validate(&args).map_err(UpFailure::Invalid)?;
    let tokenizer = Tokenizer::from_path(&tokenizer_path)
        .with_context(|| {
            format!(
                "cannot load the router tokenizer from {}",
                tokenizer_path.display()
            )
        })
        .map_err(UpFailure::Failed)?;
    tracing::info!(path = %tokenizer_path.display(), "router tokenizer loaded");
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-up")
        .build()
        .context("cannot start the tokio runtime")
        .and_then(|rt| rt.block_on(up(args, Arc::new(tokenizer))))
        .map_err(UpFailure::Failed)
}

/// Checks the flags and resolves the tokenizer path.
fn validate(args: &UpArgs) -> anyhow::Result<PathBuf> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if args.gpu_blocks == 0 || args.block_size == 0 {
        bail!("--gpu-blocks and --block-size must be at least 1");
    }
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be a positive number, got {}", args.speedup);
    }
    if args.kv_overlap_weight.is_some_and(|w| !w.is_finite()) {
        bail!("--kv-overlap-weight must be finite");
    }
    for module in &args.lora_modules {
        crate::config::worker::lora_module_name(module)?;
    }
    if args.port != 0
        && args
            .port
            .checked_add(WORKER_PORT_OFFSET + args.workers)
            .is_none()
    {
        bail!(
            "the mocks listen on --port + {WORKER_PORT_OFFSET}..; --port {} is too high for {} \
             workers (or use --port 0)",
            args.port,
            args.workers
        );
    }
    match &args.router_tokenizer_path {
        Some(path) if path.exists() => Ok(path.clone()),
        Some(path) => bail!("--router-tokenizer-path {} does not exist", path.display()),
        None if std::path::Path::new(DEFAULT_TOKENIZER).exists() => {
            Ok(PathBuf::from(DEFAULT_TOKENIZER))
        }
        None => bail!(
            "no tokenizer at {DEFAULT_TOKENIZER} in the current directory: run from the \
             repository root or pass --router-tokenizer-path PATH"
        ),
    }
}

/// One running mock engine and the task that forwards its KV events to the server.
struct Worker {
    url: String,
    serve: JoinHandle<Result<(), MockError>>,
    forward: JoinHandle<()>,
}

async fn up(args: UpArgs, tokenizer: Arc<Tokenizer>) -> anyhow::Result<()> {
    let options = ServerOptions {
        service: ServiceOptions {
            router: RouterConfig {
                policy: args.router_policy,
                overlap_weight: args
                    .kv_overlap_weight
                    .unwrap_or(args.router_profile.overlap_weight()),
                balance_tokens: args.router_profile.balance_tokens(),
                ..RouterConfig::default()
            },
            fleet: FleetConfig::default(),
            request_max_retries: 1,
            max_body_bytes: 32 << 20,
        },
        chat_template: None,
        template_defaults: Default::default(),
        per_worker_template_kwargs: true,
        model_tokenizers: Default::default(),
        lora_loading: None,
        direct: false,
        client: infera_adapters::server::ClientOptions::default(),
    };
    let state = ServerState::new(options, Arc::clone(&tokenizer));
    let signals = Signals::register()?;
    let addr = socket_addr(&args.host, args.port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot bind the server on {addr}"))?;
    let server_addr = listener.local_addr().context("server address")?;
    // Started last of what may fail early, so that nothing returns past it without stopping it.
    let mut kvd = if args.kvd {
        Some(LocalKvd::start(args.kvd_socket.clone()).await?)
    } else {
        None
    };
    if let Some(kvd) = &kvd {
        let prefetch = crate::prewarm::KvdPrefetch::new(kvd.socket.clone());
        state.set_prefetch(Arc::new(prefetch));
    }
    let kvd_socket = kvd.as_ref().map(|k| k.socket.clone());

    let stop_workers = CancellationToken::new();
    let mut workers = Vec::with_capacity(usize::from(args.workers));
    let mut started = Ok(());
    for i in 0..args.workers {
        let store = kvd_socket.clone().map(|socket| MockKvStore {
            store: Arc::new(KvdBlockStore::new(socket)),
            compat_key: String::new(),
        });
        match start_worker(&args, i, &tokenizer, &state, &stop_workers, store).await {
            Ok(w) => workers.push(w),
            Err(e) => {
                started = Err(e);
                break;
            }
        }
    }
    // The mocks name the kvd: its inventory is folded from now on.
    let inventory = kvd.as_mut().and_then(|k| k.follow(&state));
    if started.is_ok() {
        let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
        if let Err(e) = announce(server_addr, &args.model_name, &urls, kvd_socket.as_deref()) {
            tracing::warn!(error = %e, "cannot print the fleet's addresses");
        }
        tracing::info!(addr = %server_addr, workers = workers.len(), "infera up: fleet serving");
    }

    // The server's active health checks and outlier ejection, at their defaults (see `infera
    // server`).
    let health = {
        let service = state.service().clone();
        tokio::spawn(async move { service.run_ejection().await })
    };
    let served = match started {
        Ok(()) => serve(listener, state, async move {
            let mut signals = signals;
            signals.recv().await;
        })
        .await
        .context("http server failed"),
        Err(e) => Err(e),
    };
    health.abort();
    stop_workers.cancel();
    let mut result = served;
    for w in workers {
        match w.serve.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                if result.is_ok() {
                    result = Err(anyhow::Error::new(e).context(format!("mock {}", w.url)));
                }
            }
            Err(e) => tracing::error!(error = %e, url = %w.url, "mock task failed"),
        }
        // Ends once the mock's engine loop dropped the sink (it has: `serve` joined it).
        if let Err(e) = w.forward.await {
            tracing::error!(error = %e, url = %w.url, "kv-event forwarder failed");
        }
    }
    if let Some(kvd) = kvd {
        let stopped = kvd.stop().await;
        if result.is_ok() {
            result = stopped;
        }
    }
    if let Some(inventory) = inventory
        && let Err(e) = inventory.await
    {
        tracing::error!(error = %e, "the kvd inventory task failed");
    }
    tracing::info!("infera up: stopped");
    result
}

/// Binds mock `i`, registers it and starts its server and KV-event forwarder.
async fn start_worker(
    args: &UpArgs,
    i: u16,
    tokenizer: &Arc<Tokenizer>,
    state: &ServerState,
    stop: &CancellationToken,
    kv_store: Option<MockKvStore>,
) -> anyhow::Result<Worker> {
    let port = if args.port == 0 {
        0
    } else {
        // Checked in `validate`.
        args.port.saturating_add(WORKER_PORT_OFFSET + i)
    };
    let engine = EngineConfig {
        gpu_blocks: args.gpu_blocks as usize,
        block_size: args.block_size,
        speedup: args.speedup,
        ..EngineConfig::default()
    };
    let adapters = args
        .lora_modules
        .iter()
        .map(|m| crate::config::worker::lora_module_name(m))
        .collect::<Result<Vec<_>, _>>()?;
    let mut config = MockConfig::new(args.model_name.clone(), engine);
    config.lora_adapters = adapters.clone();
    config.tokenizer = Some(Arc::clone(tokenizer));
    config.drain_timeout = Duration::from_secs(5);
    let kvd_backed = kv_store.is_some();
    config.kv_store = kv_store;
    let (sink, mut batches): (KvEventSink, _) = mpsc::channel(1024);
    let server = MockServer::bind(&socket_addr("127.0.0.1", port), config, Some(sink))
        .await
        .with_context(|| format!("cannot start mock worker {i}"))?;
    let addr = server.local_addr();
    let url = format!("http://{addr}");
    let record = WorkerRecord {
        worker_id: WorkerId::new(addr.to_string()),
        url: url.clone(),
        model_name: args.model_name.clone(),
        engine: Engine::Vllm,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: args.block_size,
        dp_rank: 0,
        dp_size: 1,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: server.registration_extra(),
    };
    let mut record = record;
    record.set_lora_adapters(&adapters);
    if kvd_backed {
        record.extra.insert(
            infera_core::kv_events::kvd::KVD_EVENTS_ENDPOINT.into(),
            kvd::UP_KVD_ENDPOINT.into(),
        );
    }
    let worker = record.worker_id.clone();
    state.register_worker(record);
    let forward = {
        let state = state.clone();
        let (frames, events) = pipeline::channel(1024);
        let encode = async move {
            for seq in 0u64.. {
                let Some(batch) = batches.recv().await else {
                    break;
                };
                if frames.send(numbered(seq, &batch)).await.is_err() {
                    break;
                }
            }
        };
        tokio::spawn(async move {
            let subscription = KvSubscription {
                events,
                replay: None,
            };
            // The stream ends when the mock drops its sink (the encoder then drops `frames`).
            let consume = pipeline::consume(worker, subscription, &state, std::future::pending());
            tokio::join!(encode, consume);
        })
    };
    let serve = tokio::spawn(server.serve(stop.clone().cancelled_owned()));
    Ok(Worker {
        url,
        serve,
        forward,
    })
}

/// Batch `seq` of an in-process KV-event stream, encoded as vLLM publishes it.
fn numbered(seq: u64, batch: &EngineBatch) -> KvItem {
    KvItem::Frame(KvFrame {
        dp_rank: 0,
        seq: Some(seq),
        epoch: None,
        payload: encode_batch_vllm(batch).into(),
    })
}

/// Prints one line per component and a curl example on stdout.
fn announce(
    server: SocketAddr,
    model: &str,
    workers: &[&str],
    kvd: Option<&std::path::Path>,
) -> std::io::Result<()> {
    let host = match server.ip() {
        ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
        ip => ip.to_string(),
    };
    let base = format!("http://{}", socket_addr(&host, server.port()));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "server: {base}/v1 ({} mock workers: {})",
        workers.len(),
        workers.join(", ")
    )?;
    for (i, url) in workers.iter().enumerate() {
        writeln!(out, "worker {i}: {url} (mock, model {model})")?;
    }
    if let Some(socket) = kvd {
        writeln!(out, "kvd: {} (the mocks' KV blocks)", socket.display())?;
    }
    writeln!(out, "try:")?;
    writeln!(
        out,
        "  curl -s {base}/v1/chat/completions -H 'content-type: application/json' \
         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \
         \"Hello!\"}}], \"max_tokens\": 16}}'"
    )?;
    writeln!(out, "stop with Ctrl-C")?;
    out.flush()
}
