//! The mock engine ([`infera_adapters::mock`]) run in process, with its KV-event sink connected
//! ([`crate::wiring::mock_kv_sink`]) to a ZeroMQ publisher that speaks vLLM's wire format: PUB
//! `[topic "kv-events", seq u64 BE, payload]` and a ROUTER replay socket, or (with
//! `--kv-event-transport nats`) to the worker's NATS subjects.
//!
//! Two commands run it:
//!
//! - `infera worker mock` joins the fleet like any worker ([`super::run`]); its KV endpoints are
//!   derived from the HTTP port so that mocks on consecutive ports never collide:
//!   events on `--port + 10000`, replay on `--port + 20000`.
//! - `infera mock-engine ARGS…` is the engine alone, taking the command line the launchers give
//!   vLLM, SGLang or ATOM ([`MockEngineArgs`]): `infera worker vllm --engine-cmd "infera
//!   mock-engine"` runs the real launcher over a GPU-free engine.
//!
//! With `--infera-kvd-socket` (for `infera mock-engine`: `INFERA_KVD_SOCKET`, as a launcher
//! sets it), the mock checks that kvd answers `hello`, then saves and loads its KV blocks there
//! ([`infera_adapters::mock::MockKvStore`] on [`KvdBlockStore`]) and registers as kvd-backed, naming
//! where that kvd publishes its inventory.
//!
//! With a model path naming an existing tokenizer directory or `tokenizer.json`, the tokenizer is
//! loaded (a failed load stops startup); any other model name runs with the byte fallback.

use crate::config::WorkerConfig;
use crate::config::worker::{LaunchConfig, MockEngineConfig};
use crate::kvd_store::KvdBlockStore;
use crate::net::{socket_addr, url_host};
use crate::signals::Signals;
use crate::wiring::{Backend, NatsLink, mock_kv_sink};
use anyhow::{Context, bail};
use clap::Args;
use infera_adapters::mock::{MockConfig, MockKvStore, MockPd, MockServer};
use infera_adapters::tokenize::Tokenizer;
use infera_core::engine::{EngineConfig, TimingModel};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Offset of the KV-event PUB port from the HTTP port of `infera worker mock`.
pub const KV_EVENTS_PORT_OFFSET: u16 = 10_000;
/// Offset of the KV-event replay port from the HTTP port of `infera worker mock`.
pub const KV_REPLAY_PORT_OFFSET: u16 = 20_000;

/// Where the mock binds its KV-event sockets (`tcp://HOST:PORT`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBind {
    /// The PUB socket.
    pub events: String,
    /// The replay ROUTER socket, if any.
    pub replay: Option<String>,
}

impl KvBind {
    /// The sockets of `infera worker mock`: `--port + 10000` and `--port + 20000` on `host`.
    ///
    /// # Errors
    /// `port` is too high for the offsets.
    pub fn from_port(host: &str, port: u16) -> anyhow::Result<Self> {
        let offset = |offset: u16| {
            port.checked_add(offset).with_context(|| {
                format!(
                    "the mock's kv-event ports are --port + {KV_EVENTS_PORT_OFFSET} and + \
                     {KV_REPLAY_PORT_OFFSET}; --port {port} is too high for that"
                )
            })
        };
        Ok(Self {
            events: format!(
                "tcp://{}",
                socket_addr(host, offset(KV_EVENTS_PORT_OFFSET)?)
            ),
            replay: Some(format!(
                "tcp://{}",
                socket_addr(host, offset(KV_REPLAY_PORT_OFFSET)?)
            )),
        })
    }
}

/// Where the mock's KV events go.
#[derive(Debug)]
pub enum KvOut {
    /// A ZeroMQ publisher bound on these sockets (`--kv-event-transport zmq`).
    Zmq(KvBind),
    /// NATS subjects (`--kv-event-transport nats`), each batch encoded as vLLM does.
    Nats {
        /// The worker's NATS connection.
        link: NatsLink,
        /// The worker id the subjects derive from.
        worker_id: String,
        /// The publisher epoch (differs across the worker's restarts).
        epoch: u64,
    },
}

/// A mock engine serving in the background.
#[derive(Debug)]
pub struct RunningMock {
    extra: serde_json::Map<String, serde_json::Value>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl RunningMock {
    /// Binds the HTTP port and the KV-event sockets and starts serving.
    ///
    /// # Errors
    /// A tokenizer that does not load, invalid engine parameters, or a port that cannot be bound.
    pub async fn start(
        config: &WorkerConfig,
        mock: &MockEngineConfig,
        served_model: &str,
        kv: Option<KvOut>,
    ) -> anyhow::Result<Self> {
        let mut mock_config = MockConfig::new(served_model, engine_config(mock));
        mock_config.lora_adapters = mock.lora_adapters.clone();
        mock_config.tokenizer = load_tokenizer(&config.model)?;
        mock_config.drain_timeout = config.drain_timeout.0;
        mock_config.pd = mock.pd.as_ref().map(|pd| MockPd {
            role: pd.role,
            protocol: pd.protocol,
            engine_id: super::launch::default_engine_id(config),
            host: config.advertise_host.clone(),
            port: config.port,
        });
        let mut kvd_fields = serde_json::Map::new();
        if let Some(socket) = &config.kvd_socket {
            let ack = crate::kvd_store::preflight(socket, "infera-mock").await?;
            kvd_fields = crate::kvd_store::registration_fields(&ack);
            mock_config.kv_store = Some(MockKvStore {
                store: Arc::new(KvdBlockStore::new(socket.clone())),
                compat_key: String::new(),
            });
        }
        let (sink, forwarder) = match kv {
            Some(kv) => {
                let (sink, forwarder) = mock_kv_sink(kv).await?;
                (Some(sink), Some(forwarder))
            }
            None => (None, None),
        };
        let server =
            MockServer::bind(&socket_addr(&config.host, config.port), mock_config, sink).await?;
        let addr = server.local_addr();
        let mut extra = server.registration_extra();
        extra.extend(kvd_fields);
        tracing::info!(%addr, model = served_model, "mock engine serving");
        stall_on_sigusr1(server.stall_switch())?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .serve(async move {
                    // A dropped sender stops the engine too.
                    let _ = stopped.await;
                })
                .await?;
            if let Some(forwarder) = forwarder {
                // Ends once the engine loop dropped the sink (it has: `serve` joined it).
                forwarder
                    .await
                    .context("the kv-event publisher task failed")?;
            }
            Ok(())
        });
        Ok(Self { extra, stop, task })
    }

    /// The mock's extra registration fields.
    pub fn registration_extra(&self) -> serde_json::Map<String, serde_json::Value> {
        self.extra.clone()
    }

    /// Completes if the engine stops on its own (its HTTP server failed).
    pub async fn failed(&mut self) -> anyhow::Result<()> {
        match (&mut self.task).await {
            Ok(Ok(())) => bail!("the mock engine stopped serving"),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(e).context("the mock engine task failed"),
        }
    }

    /// Stops accepting requests, drains in-flight ones (bounded by the drain timeout) and stops.
    ///
    /// # Errors
    /// The HTTP server or the publisher failed.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await.context("the mock engine task failed")?
    }
}

/// Arguments of `infera mock-engine`: an engine command line as the launchers build it.
#[derive(Debug, Args)]
#[command(
    after_help = "Understood: --model / --model-path, --served-model-name, --host, \
    --port (or ATOM's --server-port), --lora-modules, --kv-events-config JSON (endpoint, \
    replay_endpoint), \
    ATOM_KV_EVENTS_ENABLE / ATOM_KV_EVENTS_ENDPOINT, --block-size / --page-size, \
    --num-gpu-blocks-override, --max-num-seqs, --max-num-batched-tokens, INFERA_KVD_SOCKET \
    (saves and loads KV blocks through that kvd, as a launcher's --infera-kvd-socket asks). \
    Other engine flags are ignored. Example: infera worker vllm --engine-cmd \"infera \
    mock-engine\" --model m --discovery-backend etcd --etcd-endpoint 127.0.0.1:2379 \
    --request-transport http --kv-event-transport zmq"
)]
pub struct MockEngineArgs {
    /// The engine's arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ENGINE_ARGS"
    )]
    pub args: Vec<String>,
}

/// SIGUSR1 stops the mock's scheduler, or starts it again, while its HTTP server (`/health`
/// included) keeps answering: the chaos suite's engine that answers but makes no progress.
fn stall_on_sigusr1(switch: infera_adapters::mock::StallSwitch) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut usr1 = signal(SignalKind::user_defined1()).context("cannot listen for SIGUSR1")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            let stalled = switch.toggle();
            tracing::warn!(
                stalled,
                "SIGUSR1: the mock engine's scheduler is {}",
                if stalled {
                    "stopped (it still answers /health)"
                } else {
                    "running again"
                }
            );
        }
    });
    Ok(())
}

/// Runs `infera mock-engine` until SIGTERM or Ctrl-C.
///
/// # Errors
/// Arguments the mock cannot serve with, or a failure while serving.
pub fn run_engine(args: MockEngineArgs) -> anyhow::Result<()> {
    let (config, served, kv) = standalone_config(&args.args, &|key| std::env::var(key).ok())?;
    let LaunchConfig::Mock(mock) = &config.launch else {
        bail!("internal: mock-engine built a non-mock configuration");
    };
    let mock = mock.clone();
    runtime()?.block_on(async move {
        let mut signals = Signals::register()?;
        let mut running = RunningMock::start(&config, &mock, &served, kv.map(KvOut::Zmq)).await?;
        tokio::select! {
            () = signals.recv() => running.stop().await,
            failed = running.failed() => failed,
        }
    })
}

/// Translates an engine command line into the mock's configuration, the model name it serves
/// and its KV sockets.
fn standalone_config(
    args: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(WorkerConfig, String, Option<KvBind>)> {
    use super::launch::flag_value;
    let value = |flags: &[&str]| flag_value(args, flags).map(str::to_owned);
    let model =
        value(&["--model", "--model-path"]).context("mock-engine needs --model or --model-path")?;
    let port = value(&["--server-port"]).or_else(|| value(&["--port"]));
    let mut argv: Vec<String> = ["infera", "worker", "mock", "--model-path"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    argv.push(model);
    let translated: [(&[&str], &str); 6] = [
        (&["--host"], "--host"),
        (&["--block-size", "--page-size"], "--block-size"),
        (&["--num-gpu-blocks-override"], "--gpu-blocks"),
        (&["--max-num-seqs"], "--max-seqs"),
        (&["--max-num-batched-tokens"], "--max-batched-tokens"),
        (&["--mock-speedup"], "--speedup"),
    ];
    for (from, to) in translated {
        if let Some(v) = value(from) {
            argv.extend([to.to_owned(), v]);
        }
    }
    if let Some(port) = port {
        argv.extend(["--port".to_owned(), port]);
    }
    // vLLM's `--lora-modules A=p B=p` (or repeated flags): every value up to the next flag.
    let modules = lora_modules(args);
    if !modules.is_empty() {
        argv.push("--lora-modules".to_owned());
        argv.extend(modules);
    }
    // What a launcher's `--infera-kvd-socket` gives the engine.
    if let Some(socket) = env(super::launch::KVD_SOCKET_ENV).filter(|s| !s.is_empty()) {
        argv.extend(["--infera-kvd-socket".to_owned(), socket]);
    }
    // The mock engine registers nothing, takes no NATS requests and publishes its KV events
    // where its own --kv-events-config says: the worker's transport flags only have to validate,
    // with a discovery backend this build has.
    let discovery: &[&str] = if Backend::Etcd.built() {
        &["--discovery-backend", "etcd", "--etcd-endpoint", "unused"]
    } else if Backend::Kubernetes.built() {
        &["--discovery-backend", "kubernetes"]
    } else {
        bail!(
            "mock-engine validates its flags as a worker's, which needs a discovery backend: \
             this infera was built with neither (Cargo features \"etcd\", \"kubernetes\"); \
             rebuild with --features etcd"
        );
    };
    argv.extend(
        discovery
            .iter()
            .chain(&["--request-transport", "http", "--no-enable-kv-events"])
            .map(|arg| (*arg).to_owned()),
    );
    let cli = crate::cli::parse_from(&argv).map_err(|e| anyhow::anyhow!("{e}"))?;
    let crate::cli::Command::Worker(command) = cli.command else {
        bail!("internal: mock-engine did not parse as a worker");
    };
    let config = WorkerConfig::try_from(command)?;
    // The tokenizer stays the model path's; requests name the served model.
    let served = value(&["--served-model-name"]).unwrap_or_else(|| config.model.clone());
    let host = config.host.clone();
    let wildcard =
        |endpoint: &str| endpoint.replace("tcp://*:", &format!("tcp://{}:", url_host(&host)));
    let kv = if let Some(text) = value(&["--kv-events-config"]) {
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("--kv-events-config is not JSON: {text}"))?;
        let endpoint = json
            .get("endpoint")
            .and_then(|v| v.as_str())
            .context("--kv-events-config has no endpoint")?;
        Some(KvBind {
            events: wildcard(endpoint),
            replay: json
                .get("replay_endpoint")
                .and_then(|v| v.as_str())
                .map(wildcard),
        })
    } else if env("ATOM_KV_EVENTS_ENABLE").as_deref() == Some("1") {
        let endpoint =
            env("ATOM_KV_EVENTS_ENDPOINT").context("ATOM_KV_EVENTS_ENDPOINT is not set")?;
        Some(KvBind {
            events: wildcard(&endpoint),
            replay: None,
        })
    } else {
        None
    };
    Ok((config, served, kv))
}

/// The values of every `--lora-modules` in an engine command line.
fn lora_modules(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut taking = false;
    for arg in args {
        if let Some(value) = arg.strip_prefix("--lora-modules=") {
            out.push(value.to_owned());
            taking = true;
        } else if arg == "--lora-modules" {
            taking = true;
        } else if arg.starts_with("--") {
            taking = false;
        } else if taking {
            out.push(arg.clone());
        }
    }
    out
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

/// A multi-threaded runtime for the worker commands.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-worker")
        .build()
        .context("cannot start the tokio runtime")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_vllm_command_line_configures_the_mock() {
        let args = strings(&[
            "--model",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            "8123",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "100",
            "--tensor-parallel-size",
            "8",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv-events"}"#,
        ]);
        let (config, served, kv) = standalone_config(&args, &|_| None).unwrap();
        assert_eq!(served, "m");
        assert_eq!(config.port, 8123);
        let LaunchConfig::Mock(mock) = &config.launch else {
            panic!()
        };
        assert_eq!((mock.block_size, mock.gpu_blocks), (32, 100));
        assert_eq!(
            kv,
            Some(KvBind {
                events: "tcp://127.0.0.1:5557".to_owned(),
                replay: Some("tcp://127.0.0.1:5558".to_owned()),
            })
        );
    }

    #[test]
    fn atom_serves_http_on_server_port_and_events_from_the_environment() {
        let args = strings(&["--model", "m", "--server-port", "8200", "--port", "29500"]);
        let env = |key: &str| match key {
            "ATOM_KV_EVENTS_ENABLE" => Some("1".to_owned()),
            "ATOM_KV_EVENTS_ENDPOINT" => Some("tcp://*:6000".to_owned()),
            _ => None,
        };
        let (config, _, kv) = standalone_config(&args, &env).unwrap();
        assert_eq!(config.port, 8200);
        assert_eq!(kv.unwrap().events, "tcp://0.0.0.0:6000");
    }
}
