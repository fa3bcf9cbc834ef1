//! [`WorkerConfig`]: the validated configuration of `infera worker {vllm,sglang,atom,mock}`.
//!
//! Built only by `TryFrom<WorkerCommand>`. For a real engine the config holds the complete
//! engine command line: the engine command (`--engine-cmd`), then the model, host and port
//! re-emitted in the engine's own spelling, then every forwarded argument in its original
//! order. The engine's block size and parallel sizes are read from the forwarded arguments
//! (not removed from them) so registration can carry `kv_block_size` and `dp_size`; they are
//! read as the engine's parser reads them, which for SGLang includes argparse's unambiguous
//! prefixes (`--dp 8` is `--dp-size 8`; see [`engine_flag_value`]).
//! For `mock` the config holds the simulated engine's parameters instead. A discovery backend
//! or transport this build lacks is refused with the Cargo feature that builds it.
//!
//! The discovery backend, request transport and KV-event publishing default per engine, as the
//! Python launchers do: vLLM, SGLang and the mock register through Kubernetes, take requests
//! over NATS and publish KV events; ATOM's launcher (infera/engine/atom/args.py) has neither
//! `--discovery-backend` nor `--request-transport`: it registers in etcd (`--etcd-endpoint` is
//! required), is reached over HTTP, and publishes KV events only with `--enable-kv-events`. Our
//! flags still override those defaults for ATOM when given.
//!
//! [`EngineKind`] is the one place that knows each engine's spelling of its flags.

use crate::cli::worker::{EngineWorkerArgs, MockWorkerArgs, WorkerArgs, WorkerCommand};
use crate::config::units::HumanDuration;
use crate::config::{
    ConfigError, DiscoveryBackend, DiscoveryConfig, KvEventTransport, RequestTransport, non_empty,
    positive, positive_f64,
};
use serde::{Deserialize, Serialize};
use std::str::FromStr;

mod engine;

pub use engine::EngineKind;
pub(crate) use engine::{engine_flag_given, engine_flag_value, last_flag_value};

/// Whether and how the worker publishes KV-cache events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// `--enable-kv-events` / `--no-enable-kv-events`.
    pub enabled: bool,
    /// How events reach the router.
    pub transport: KvEventTransport,
}

/// A real engine, run as a child process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineProcessConfig {
    /// The engine command (`--engine-cmd`, split on whitespace).
    pub command: Vec<String>,
    /// The engine's arguments: model, host and port in the engine's spelling, then
    /// `passthrough`.
    pub args: Vec<String>,
    /// The arguments forwarded verbatim, in their original order.
    pub passthrough: Vec<String>,
    /// The engine's KV block size, if given (`--block-size`, SGLang `--page-size`).
    pub kv_block_size: Option<u32>,
    /// The engine's tensor-parallel size, if given.
    pub tensor_parallel_size: Option<u32>,
    /// The engine's data-parallel size, if given.
    pub data_parallel_size: Option<u32>,
    /// How long the engine may take to become healthy (`--engine-ready-timeout`).
    pub ready_timeout: HumanDuration,
    /// Start a PD worker without an RDMA transport (`--disaggregation-allow-tcp`).
    pub allow_tcp: bool,
    /// The KV-event publisher's bind endpoint (`--kv-events-bind`); `None` is a free port.
    pub kv_events_bind: Option<String>,
    /// `--index-block-size` (accepted for the Python launchers; not used by this router).
    pub index_block_size: u32,
}

/// Quadratic timing coefficients `A,B,C`: `A·x² + B·x + C` milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimingCoeffs(pub [f64; 3]);

impl FromStr for TimingCoeffs {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        let [a, b, c] = parts.as_slice() else {
            return Err(format!(
                "'{text}' is not three comma-separated numbers A,B,C"
            ));
        };
        let number = |part: &str| -> Result<f64, String> {
            part.parse::<f64>()
                .ok()
                .filter(|value| value.is_finite())
                .ok_or_else(|| format!("'{part}' in '{text}' is not a finite number"))
        };
        Ok(Self([number(a)?, number(b)?, number(c)?]))
    }
}

/// The simulated engine of `infera worker mock`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockEngineConfig {
    /// KV blocks of simulated GPU memory.
    pub gpu_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Token budget of one scheduler step.
    pub max_batched_tokens: u32,
    /// Sequences running at once.
    pub max_seqs: u32,
    /// Simulated time runs this many times faster than the timing model.
    pub speedup: f64,
    /// Prefill step time over the step's new prompt tokens x.
    pub prefill_coeffs: TimingCoeffs,
    /// Decode step time over the fraction x of KV blocks in use.
    pub decode_coeffs: TimingCoeffs,
    /// The leg of a PD pair the mock plays (`--disaggregation-mode`); `None`: mixed.
    #[serde(default)]
    pub pd: Option<MockPdConfig>,
    /// LoRA adapters served (`--lora-modules`), by name.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

/// A PD-role mock (`--disaggregation-mode prefill|decode`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockPdConfig {
    /// Prefill or decode.
    pub role: infera_core::event::Role,
    /// `--disaggregation-protocol`.
    pub protocol: infera_core::pd::PdProtocol,
    /// `--disaggregation-bootstrap-port`.
    pub bootstrap_port: u16,
}

/// How the engine is run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LaunchConfig {
    /// A real engine as a child process.
    Process(EngineProcessConfig),
    /// The simulated engine, in process.
    Mock(MockEngineConfig),
}

/// The validated configuration of `infera worker`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The engine.
    pub engine: EngineKind,
    /// The served model.
    pub model: String,
    /// The engine's bind address.
    pub host: String,
    /// The engine's HTTP port.
    pub port: u16,
    /// The routable host published in the worker record (`--advertise-host`, else `--host`).
    pub advertise_host: String,
    /// How the worker registers.
    pub discovery: DiscoveryConfig,
    /// How the router reaches this worker.
    pub request_transport: RequestTransport,
    /// KV-event publishing.
    pub kv_events: KvEventsConfig,
    /// NATS broker URL.
    pub nats_server: String,
    /// The worker's own cap on each NATS request (`--nats-req-max-duration`); `None` is off.
    pub nats_req_max_duration: Option<HumanDuration>,
    /// The worker's local read timeout of NATS requests (`--nats-req-idle-timeout`); `None` is
    /// off.
    pub nats_req_idle_timeout: Option<HumanDuration>,
    /// NATS requests admitted at once (`--nats-req-max-pending`); `None` is no limit.
    pub nats_req_max_pending: Option<u32>,
    /// How long in-flight requests may finish on shutdown; 0 = do not wait.
    pub drain_timeout: HumanDuration,
    /// TTL of the etcd lease the registration is attached to.
    pub etcd_lease_ttl: HumanDuration,
    /// How the engine is run.
    pub launch: LaunchConfig,
    /// The kvd socket the engine saves and loads KV blocks through (`--infera-kvd-socket`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvd_socket: Option<std::path::PathBuf>,
}

impl TryFrom<WorkerCommand> for WorkerConfig {
    type Error = ConfigError;

    fn try_from(command: WorkerCommand) -> Result<Self, ConfigError> {
        let config = match command {
            WorkerCommand::Vllm(args) => from_engine(EngineKind::Vllm, args),
            WorkerCommand::Sglang(args) => from_engine(EngineKind::Sglang, args),
            WorkerCommand::Atom(args) => from_engine(EngineKind::Atom, args),
            WorkerCommand::Mock(args) => from_mock(args),
        }?;
        super::require_worker_transports(&config)?;
        Ok(config)
    }
}

fn from_engine(engine: EngineKind, args: EngineWorkerArgs) -> Result<WorkerConfig, ConfigError> {
    let mut shared = Shared::try_new(engine, args.common)?;
    if args.kv_events == crate::cli::worker::KvEventsMode::Off {
        shared.kv_events.enabled = false;
    }
    if args.index_block_size == 0 {
        return Err(ConfigError::new("--index-block-size", "must be at least 1"));
    }
    if let Some(bind) = &args.kv_events_bind
        && !bind.starts_with("tcp://")
    {
        return Err(ConfigError::new(
            "--kv-events-bind",
            format!("{bind}: expected a ZMQ endpoint tcp://HOST:PORT"),
        ));
    }
    let command_line = args
        .engine_cmd
        .or_else(|| engine.default_command().map(str::to_owned))
        .unwrap_or_default();
    let command: Vec<String> = command_line.split_whitespace().map(str::to_owned).collect();
    if command.is_empty() {
        return Err(ConfigError::new(
            "--engine-cmd",
            format!("must name the {engine} executable (it is empty)"),
        ));
    }
    let passthrough = args.engine_args;
    let mut engine_args = vec![
        engine.model_flag().to_owned(),
        shared.model.clone(),
        "--host".to_owned(),
        shared.host.clone(),
        engine.port_flag().to_owned(),
        shared.port.to_string(),
    ];
    engine_args.extend(passthrough.iter().cloned());
    let launch = LaunchConfig::Process(EngineProcessConfig {
        command,
        args: engine_args,
        kv_block_size: peek(engine, &passthrough, engine.block_size_flags())?,
        tensor_parallel_size: peek(engine, &passthrough, engine.tensor_parallel_flags())?,
        data_parallel_size: peek(engine, &passthrough, engine.data_parallel_flags())?,
        ready_timeout: args.engine_ready_timeout,
        allow_tcp: args.disaggregation_allow_tcp,
        kv_events_bind: args.kv_events_bind,
        index_block_size: args.index_block_size,
        passthrough,
    });
    Ok(shared.into_config(engine, launch))
}

fn from_mock(args: MockWorkerArgs) -> Result<WorkerConfig, ConfigError> {
    let shared = Shared::try_new(EngineKind::Mock, args.common)?;
    let launch = LaunchConfig::Mock(MockEngineConfig {
        gpu_blocks: positive("--gpu-blocks", args.gpu_blocks)?,
        block_size: positive("--block-size", args.block_size)?,
        max_batched_tokens: positive("--max-batched-tokens", args.max_batched_tokens)?,
        max_seqs: positive("--max-seqs", args.max_seqs)?,
        speedup: positive_f64("--speedup", args.speedup)?,
        prefill_coeffs: args.prefill_coeffs,
        decode_coeffs: args.decode_coeffs,
        pd: mock_pd(
            &args.disaggregation_mode,
            &args.disaggregation_protocol,
            args.disaggregation_bootstrap_port,
        )?,
        lora_adapters: args
            .lora_modules
            .iter()
            .map(|m| lora_module_name(m))
            .collect::<Result<_, _>>()?,
    });
    Ok(shared.into_config(EngineKind::Mock, launch))
}

/// The adapter name of one vLLM `--lora-modules` value: `NAME=PATH` or
/// `{"name": NAME, "path": PATH, …}`.
pub(crate) fn lora_module_name(module: &str) -> Result<String, ConfigError> {
    let bad = |why: &str| ConfigError::new("--lora-modules", format!("{module}: {why}"));
    let name = if module.trim_start().starts_with('{') {
        let json: serde_json::Value =
            serde_json::from_str(module).map_err(|e| bad(&format!("not JSON: {e}")))?;
        json.get("name")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("the JSON form needs a string `name`"))?
            .to_owned()
    } else {
        let (name, _path) = module
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=PATH or JSON"))?;
        name.to_owned()
    };
    if name.trim().is_empty() {
        return Err(bad("the adapter name is empty"));
    }
    Ok(name)
}

fn mock_pd(mode: &str, protocol: &str, port: u16) -> Result<Option<MockPdConfig>, ConfigError> {
    use infera_core::event::Role;
    let role = match mode {
        "null" | "mixed" => return Ok(None),
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => {
            return Err(ConfigError::new(
                "--disaggregation-mode",
                format!("{other}: expected prefill, decode or null"),
            ));
        }
    };
    let protocol = protocol
        .parse()
        .map_err(|e| ConfigError::new("--disaggregation-protocol", format!("{e}")))?;
    Ok(Some(MockPdConfig {
        role,
        protocol,
        bootstrap_port: port,
    }))
}

/// The validated flags every engine shares.
#[derive(Debug)]
struct Shared {
    model: String,
    host: String,
    port: u16,
    advertise_host: String,
    discovery: DiscoveryConfig,
    request_transport: RequestTransport,
    kv_events: KvEventsConfig,
    nats_server: String,
    nats_req_max_duration: Option<HumanDuration>,
    nats_req_idle_timeout: Option<HumanDuration>,
    nats_req_max_pending: Option<u32>,
    drain_timeout: HumanDuration,
    etcd_lease_ttl: HumanDuration,
    kvd_socket: Option<std::path::PathBuf>,
}

impl Shared {
    fn try_new(engine: EngineKind, args: WorkerArgs) -> Result<Self, ConfigError> {
        let model = non_empty(args.model).ok_or_else(|| {
            ConfigError::new(
                engine.model_flag(),
                format!(
                    "is required: the model the engine serves ({} is accepted too)",
                    engine.model_alias()
                ),
            )
        })?;
        let port = args.port.unwrap_or_else(|| engine.default_port());
        if port == 0 {
            return Err(ConfigError::new(
                engine.port_flag(),
                "must be a port between 1 and 65535 (got 0)",
            ));
        }
        let discovery_backend = args
            .discovery_backend
            .unwrap_or_else(|| engine.default_discovery_backend());
        if args.discovery_backend.is_none()
            && discovery_backend == DiscoveryBackend::Etcd
            && non_empty(args.etcd_endpoint.clone()).is_none()
        {
            return Err(ConfigError::new(
                "--etcd-endpoint",
                format!(
                    "is required: {engine} workers register in etcd (e.g. --etcd-endpoint \
                     127.0.0.1:2379), unless --discovery-backend kubernetes is given"
                ),
            ));
        }
        let discovery = DiscoveryConfig::try_from(crate::cli::DiscoveryArgs {
            discovery_backend,
            etcd_endpoint: args.etcd_endpoint,
            etcd_prefix: args.etcd_prefix,
            k8s_namespace: args.k8s_namespace,
            k8s_label_selector: args.k8s_label_selector,
        })?;
        let advertise_host = non_empty(args.advertise_host).unwrap_or_else(|| args.host.clone());
        if engine == EngineKind::Atom && args.infera_kvd_socket.is_some() {
            let why = "ATOM has no kvd connector; use vllm or sglang, or drop the flag";
            return Err(ConfigError::new("--infera-kvd-socket", why));
        }
        Ok(Self {
            kvd_socket: args.infera_kvd_socket.filter(|p| !p.as_os_str().is_empty()),
            model,
            host: args.host,
            port,
            advertise_host,
            discovery,
            request_transport: args
                .request_transport
                .unwrap_or_else(|| engine.default_request_transport()),
            kv_events: KvEventsConfig {
                // The two flags override each other: at most one of them is set.
                enabled: if args.enable_kv_events {
                    true
                } else if args.no_enable_kv_events {
                    false
                } else {
                    engine.default_kv_events()
                },
                transport: args.kv_event_transport,
            },
            nats_server: args.nats_server,
            nats_req_max_duration: args.nats_req_max_duration.non_zero(),
            nats_req_idle_timeout: args.nats_req_idle_timeout.non_zero(),
            nats_req_max_pending: (args.nats_req_max_pending > 0)
                .then_some(args.nats_req_max_pending),
            drain_timeout: args.drain_timeout,
            etcd_lease_ttl: positive_duration("--etcd-lease-ttl", args.etcd_lease_ttl, 1)?,
        })
    }

    fn into_config(self, engine: EngineKind, launch: LaunchConfig) -> WorkerConfig {
        WorkerConfig {
            engine,
            model: self.model,
            host: self.host,
            port: self.port,
            advertise_host: self.advertise_host,
            discovery: self.discovery,
            request_transport: self.request_transport,
            kv_events: self.kv_events,
            nats_server: self.nats_server,
            nats_req_max_duration: self.nats_req_max_duration,
            nats_req_idle_timeout: self.nats_req_idle_timeout,
            nats_req_max_pending: self.nats_req_max_pending,
            drain_timeout: self.drain_timeout,
            etcd_lease_ttl: self.etcd_lease_ttl,
            launch,
            kvd_socket: self.kvd_socket,
        }
    }
}

/// A duration of at least `min_secs` whole seconds (etcd leases have a granularity of 1 s).
fn positive_duration(
    flag: &'static str,
    value: HumanDuration,
    min_secs: u64,
) -> Result<HumanDuration, ConfigError> {
    if value.0.as_secs() < min_secs {
        return Err(ConfigError::new(
            flag,
            format!("must be at least {min_secs}s (got {value})"),
        ));
    }
    Ok(value)
}

/// Reads the last value given to any spelling in `flags` from the forwarded arguments (which
/// keep it), as `engine` reads them. The value must be a positive integer.
fn peek(
    engine: EngineKind,
    args: &[String],
    flags: &'static [&'static str],
) -> Result<Option<u32>, ConfigError> {
    engine_flag_value(engine, args, flags)
        .map(|(flag, value)| {
            value
                .parse::<u32>()
                .ok()
                .filter(|size| *size > 0)
                .ok_or_else(|| {
                    ConfigError::new(flag, format!("must be a positive integer (got '{value}')"))
                })
        })
        .transpose()
}

#[cfg(test)]
mod tests;
