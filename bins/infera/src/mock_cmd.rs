//! `infera worker mock`: runs the mock engine ([`infera_adapters::mock`]) from a validated
//! [`WorkerConfig`] and connects its KV-event sink to a ZeroMQ publisher
//! ([`infera_backends::zmq::KvEventPublisher`]) that speaks vLLM's wire format.
//!
//! Endpoints (the mock has no `--kv-events-config`; they are derived from the HTTP port so that
//! mocks on consecutive ports never collide):
//!
//! ```text
//! HTTP          {host}:{port}
//! KV events     tcp://{host}:{port + 10000}   PUB, [topic "kv-events", seq u64 BE, payload]
//! replay        tcp://{host}:{port + 20000}   ROUTER (vLLM's replay protocol)
//! ```
//!
//! With `--model-path` naming an existing tokenizer directory or `tokenizer.json`, the tokenizer
//! is loaded (a failed load stops startup); any other model name runs with the byte fallback.
//! SIGTERM or Ctrl-C starts a graceful shutdown bounded by `--drain-timeout`.

use crate::config::WorkerConfig;
use crate::config::worker::{LaunchConfig, MockEngineConfig};
use crate::signals::Signals;
use anyhow::{Context, bail};
use infera_adapters::kv_events::EngineBatch;
use infera_adapters::mock::{MockConfig, MockServer};
use infera_adapters::tokenize::Tokenizer;
use infera_backends::zmq::{KvEventPublisher, PublisherConfig};
use infera_core::engine::{EngineConfig, TimingModel};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Offset of the KV-event PUB port from the HTTP port.
pub const KV_EVENTS_PORT_OFFSET: u16 = 10_000;
/// Offset of the KV-event replay port from the HTTP port.
pub const KV_REPLAY_PORT_OFFSET: u16 = 20_000;

/// Whether this worker configuration runs the in-process mock engine.
pub fn is_mock(config: &WorkerConfig) -> bool {
    matches!(config.launch, LaunchConfig::Mock(_))
}

/// Runs the mock engine until SIGTERM or Ctrl-C.
///
/// # Errors
/// A tokenizer that does not load, an invalid engine configuration, a port that cannot be bound,
/// or a failing HTTP server.
pub fn run(config: WorkerConfig) -> anyhow::Result<()> {
    let LaunchConfig::Mock(mock) = &config.launch else {
        bail!("worker {} is not the mock engine", config.engine);
    };
    let engine = engine_config(mock);
    let tokenizer = load_tokenizer(&config.model)?;
    let mut mock_config = MockConfig::new(config.model.clone(), engine);
    mock_config.tokenizer = tokenizer;
    mock_config.drain_timeout = config.drain_timeout.0;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-mock")
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(serve(config, mock_config))
}

async fn serve(config: WorkerConfig, mock_config: MockConfig) -> anyhow::Result<()> {
    let (sink, forwarder) = if config.kv_events.enabled {
        let (sink, forwarder) = start_publisher(&config).await?;
        (Some(sink), Some(forwarder))
    } else {
        tracing::info!("kv events disabled (--no-enable-kv-events)");
        (None, None)
    };
    let addr = socket_addr(&config.host, config.port);
    let signals = Signals::register()?;
    let server = MockServer::bind(&addr, mock_config, sink).await?;
    tracing::info!(
        addr = %server.local_addr(),
        model = %config.model,
        registration = %serde_json::Value::Object(server.registration_extra()),
        "mock engine serving"
    );
    server.serve(signals.recv()).await?;
    if let Some(forwarder) = forwarder {
        // Ends once the engine loop dropped the sink (it has: `serve` joined it).
        if let Err(e) = forwarder.await {
            tracing::error!(error = %e, "kv-event publisher task failed");
        }
    }
    Ok(())
}

/// Binds the ZeroMQ publisher and starts the task that publishes every batch of the sink.
async fn start_publisher(
    config: &WorkerConfig,
) -> anyhow::Result<(mpsc::Sender<EngineBatch>, tokio::task::JoinHandle<()>)> {
    let port = |offset: u16| {
        config.port.checked_add(offset).with_context(|| {
            format!(
                "the mock's kv-event ports are --port + {KV_EVENTS_PORT_OFFSET} and + \
                 {KV_REPLAY_PORT_OFFSET}; --port {} is too high for that",
                config.port
            )
        })
    };
    let endpoint = format!(
        "tcp://{}",
        socket_addr(&config.host, port(KV_EVENTS_PORT_OFFSET)?)
    );
    let replay = format!(
        "tcp://{}",
        socket_addr(&config.host, port(KV_REPLAY_PORT_OFFSET)?)
    );
    let mut publisher = KvEventPublisher::bind(PublisherConfig::new(endpoint, Some(replay)))
        .await
        .context("cannot bind the mock's kv-event sockets")?;
    tracing::info!(
        endpoint = publisher.endpoint(),
        replay = publisher.replay_endpoint().unwrap_or_default(),
        "mock kv events publishing"
    );
    let (sink, mut batches) = mpsc::channel::<EngineBatch>(1024);
    let forwarder = tokio::spawn(async move {
        let mut failures = 0u64;
        while let Some(batch) = batches.recv().await {
            if let Err(e) = publisher.publish_batch(&batch).await {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::error!(error = %e, failures, "kv-event publish failed");
                }
            }
        }
        publisher.shutdown().await;
    });
    Ok((sink, forwarder))
}

fn engine_config(mock: &MockEngineConfig) -> EngineConfig {
    let [prefill_a, prefill_b, prefill_c] = mock.prefill_coeffs.0;
    let [decode_a, decode_b, decode_c] = mock.decode_coeffs.0;
    EngineConfig {
        gpu_blocks: mock.gpu_blocks as usize,
        block_size: mock.block_size,
        max_batched_tokens: mock.max_batched_tokens,
        max_seqs: mock.max_seqs,
        timing: TimingModel {
            prefill_a,
            prefill_b,
            prefill_c,
            decode_a,
            decode_b,
            decode_c,
            ..TimingModel::default()
        },
        speedup: mock.speedup,
    }
}

/// Loads the tokenizer when `model` names one on disk; `None` for a bare model name.
fn load_tokenizer(model: &str) -> anyhow::Result<Option<Arc<Tokenizer>>> {
    let path = Path::new(model);
    if !path.exists() {
        return Ok(None);
    }
    let tokenizer = Tokenizer::from_path(path)
        .with_context(|| format!("cannot load the tokenizer of --model-path {model}"))?;
    tracing::info!(model, fast_path = ?tokenizer.fast_path(), "mock tokenizer loaded");
    Ok(Some(Arc::new(tokenizer)))
}

fn socket_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
