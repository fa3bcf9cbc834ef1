//! Flags of `infera worker {vllm,sglang,atom,mock}` (the seed's `python -m infera.engine.*`).
//!
//! Every engine shares [`WorkerArgs`]; the model and port flags take each engine's spelling
//! (see [`EngineKind`]) with the other spelling as an alias. Where the Python launchers differ
//! in a default (ATOM's registers in etcd, over HTTP, without KV events), the flag is an
//! `Option` resolved per engine in [`crate::config::worker`], and each subcommand's help states
//! its engine's default. Real engines add `--engine-cmd` and forward every argument that is not
//! Infera's (see [`super::passthrough`]); the mock engine adds its simulation parameters and
//! accepts nothing else.

use crate::config::units::HumanDuration;
use crate::config::worker::{EngineKind, TimingCoeffs};
use crate::config::{DiscoveryBackend, KvEventTransport, RequestTransport};
use clap::{Arg, Args, Subcommand, ValueEnum};

const EXTENSIONS: &str = "Infera extensions";
const MOCK: &str = "Mock engine";

const ETCD_ENDPOINT_HELP: &str = "Shared etcd endpoint(s): host:port, host (port 2379), \
    http(s)://host:port, or a comma-separated list of members to fail over along; required for \
    --discovery-backend etcd";

const FORWARDING: &str = "Every argument that is not listed above is forwarded verbatim, in \
    order, to the engine (e.g. --tensor-parallel-size, --block-size, --kv-transfer-config); \
    arguments after `--` are always forwarded. The model, host and port are passed to the \
    engine in its own spelling. --discovery-backend, --request-transport and \
    --kv-event-transport must match the server's.";

/// The engine a worker launches.
#[derive(Debug, Clone, Subcommand)]
pub enum WorkerCommand {
    /// Launch vLLM (`vllm serve`) and join it to the fleet.
    #[command(
        after_help = FORWARDING,
        mut_arg("model", |arg| model_arg(arg, EngineKind::Vllm)),
        mut_arg("port", |arg| port_arg(arg, EngineKind::Vllm)),
        mut_args(|arg| engine_default_arg(arg, EngineKind::Vllm)),
        mut_arg("engine_cmd", |arg| engine_cmd_arg(arg, EngineKind::Vllm)),
    )]
    Vllm(EngineWorkerArgs),

    /// Launch SGLang (`python3 -m sglang.launch_server`) and join it to the fleet.
    #[command(
        after_help = FORWARDING,
        mut_arg("model", |arg| model_arg(arg, EngineKind::Sglang)),
        mut_arg("port", |arg| port_arg(arg, EngineKind::Sglang)),
        mut_args(|arg| engine_default_arg(arg, EngineKind::Sglang)),
        mut_arg("engine_cmd", |arg| engine_cmd_arg(arg, EngineKind::Sglang)),
    )]
    Sglang(EngineWorkerArgs),

    /// Launch AMD ATOM (`python3 -m atom.entrypoints.openai_server`) and join it to the fleet.
    #[command(
        after_help = FORWARDING,
        mut_arg("model", |arg| model_arg(arg, EngineKind::Atom)),
        mut_arg("port", |arg| port_arg(arg, EngineKind::Atom)),
        mut_args(|arg| engine_default_arg(arg, EngineKind::Atom)),
        mut_arg("engine_cmd", |arg| engine_cmd_arg(arg, EngineKind::Atom)),
    )]
    Atom(EngineWorkerArgs),

    /// Run Infera's GPU-free simulated engine (registers as vllm, speaks its formats).
    #[command(
        mut_arg("model", |arg| model_arg(arg, EngineKind::Mock)),
        mut_arg("port", |arg| port_arg(arg, EngineKind::Mock)),
        mut_args(|arg| engine_default_arg(arg, EngineKind::Mock)),
    )]
    Mock(MockWorkerArgs),
}

impl WorkerCommand {
    /// The subcommands whose unknown arguments are forwarded to an engine.
    pub fn forwarding_engine(name: &str) -> Option<EngineKind> {
        match name {
            "vllm" => Some(EngineKind::Vllm),
            "sglang" => Some(EngineKind::Sglang),
            "atom" => Some(EngineKind::Atom),
            _ => None,
        }
    }

    /// Where the forwarded engine arguments go, for the engines that take them.
    pub fn engine_args_mut(&mut self) -> Option<&mut Vec<String>> {
        match self {
            Self::Vllm(args) | Self::Sglang(args) | Self::Atom(args) => Some(&mut args.engine_args),
            Self::Mock(_) => None,
        }
    }

    /// Whether `--check-config` was given.
    pub fn check_config(&self) -> bool {
        match self {
            Self::Vllm(args) | Self::Sglang(args) | Self::Atom(args) => args.common.check_config,
            Self::Mock(args) => args.common.check_config,
        }
    }
}

fn model_arg(arg: Arg, engine: EngineKind) -> Arg {
    arg.long(long_name(engine.model_flag()))
        .visible_alias(long_name(engine.model_alias()))
}

fn port_arg(arg: Arg, engine: EngineKind) -> Arg {
    let arg = arg.long(long_name(engine.port_flag())).help(format!(
        "Engine HTTP port. [default: the engine's own, {}]",
        engine.default_port()
    ));
    match engine.port_alias() {
        Some(alias) => arg.visible_alias(long_name(alias)),
        None => arg,
    }
}

/// States the engine's default in the help of the flags whose default depends on the engine.
fn engine_default_arg(arg: Arg, engine: EngineKind) -> Arg {
    let help = match arg.get_id().as_str() {
        "discovery_backend" => format!(
            "How this worker registers. [default: {}]",
            value_name(engine.default_discovery_backend())
        ),
        "request_transport" => format!(
            "How the router reaches this worker. [default: {}]",
            value_name(engine.default_request_transport())
        ),
        "enable_kv_events" => format!(
            "Publish KV events for KV-aware routing. [default: {}]",
            if engine.default_kv_events() {
                "on"
            } else {
                "off"
            }
        ),
        "etcd_endpoint" if engine.default_discovery_backend() == DiscoveryBackend::Etcd => {
            format!(
                "{ETCD_ENDPOINT_HELP}, {engine}'s default (so required unless --discovery-backend \
                 kubernetes)"
            )
        }
        _ => return arg,
    };
    arg.help(help)
}

/// The command-line spelling of `value`.
fn value_name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned())
}

fn engine_cmd_arg(arg: Arg, engine: EngineKind) -> Arg {
    match engine.default_command() {
        Some(command) => arg.default_value(command),
        None => arg,
    }
}

fn long_name(flag: &'static str) -> &'static str {
    flag.trim_start_matches('-')
}

/// The flags every worker takes.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Served model (required).
    #[arg(long = "model-path", value_name = "MODEL")]
    pub model: Option<String>,

    /// Engine HTTP port (the help of each engine states its default).
    #[arg(long = "port", value_name = "PORT")]
    pub port: Option<u16>,

    /// Bind address (passed to the engine).
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,

    /// Shared etcd endpoint(s); required for --discovery-backend etcd.
    #[arg(long, value_name = "ENDPOINT", help = ETCD_ENDPOINT_HELP)]
    pub etcd_endpoint: Option<String>,

    /// Routable host/IP published for cross-node access. [default: = --host]
    #[arg(long, value_name = "HOST")]
    pub advertise_host: Option<String>,

    /// How this worker registers. [default: the engine's, stated in its help]
    #[arg(long, value_enum)]
    pub discovery_backend: Option<DiscoveryBackend>,

    /// How the router reaches this worker. [default: the engine's, stated in its help]
    #[arg(long, value_enum)]
    pub request_transport: Option<RequestTransport>,

    /// Publish KV events for KV-aware routing. [default: the engine's, stated in its help]
    #[arg(long, overrides_with = "no_enable_kv_events")]
    pub enable_kv_events: bool,

    /// Do not publish KV events.
    #[arg(long, overrides_with = "enable_kv_events")]
    pub no_enable_kv_events: bool,

    /// How KV events reach the router.
    #[arg(long, value_enum, default_value = "nats")]
    pub kv_event_transport: KvEventTransport,

    /// Infera extension: on SIGTERM, how long in-flight requests may finish after
    /// deregistration before the engine is stopped (0 = do not wait).
    #[arg(
        long,
        env = "INFERA_DRAIN_TIMEOUT",
        default_value = "30s",
        value_name = "DURATION",
        help_heading = EXTENSIONS
    )]
    pub drain_timeout: HumanDuration,

    /// Infera extension: TTL of the worker's etcd lease (renewed every third of it). A worker
    /// that dies without deregistering leaves routing within this time.
    #[arg(long, default_value = "30s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub etcd_lease_ttl: HumanDuration,

    /// Infera extension: etcd key prefix the worker registers under.
    #[arg(
        long,
        default_value = "/infera/workers/",
        value_name = "PREFIX",
        help_heading = EXTENSIONS
    )]
    pub etcd_prefix: String,

    /// Infera extension: NATS broker URL.
    #[arg(
        long,
        env = "NATS_SERVER",
        default_value = "nats://127.0.0.1:4222",
        value_name = "URL",
        help_heading = EXTENSIONS
    )]
    pub nats_server: String,

    /// Infera extension: NATS requests: the worker's own wall-clock cap per request (0 = off).
    /// Past it the engine request is cancelled and the reply ends with a 504 error, even if the
    /// server that sent it died or its cancel was lost.
    #[arg(
        long,
        env = "INFERA_NATS_REQ_MAX_DURATION",
        default_value = "0",
        value_name = "DURATION",
        help_heading = EXTENSIONS
    )]
    pub nats_req_max_duration: HumanDuration,

    /// NATS requests: the worker's local read timeout: a request whose engine sends nothing (no
    /// response head, no chunk) for this long is cancelled in the engine and ends with a 504
    /// error (0 = off).
    #[arg(
        long,
        env = "INFERA_NATS_REQ_IDLE_TIMEOUT",
        default_value = "900s",
        value_name = "DURATION"
    )]
    pub nats_req_idle_timeout: HumanDuration,

    /// NATS requests: when > 0 (set it on the servers too), take requests from this worker's
    /// durable consumer on the JetStream work queue INFERA_REQUESTS instead of core NATS,
    /// acking each when it ends; the servers refuse this worker with 429 once N requests are
    /// queued or in flight on it (0 = core NATS, no limit).
    #[arg(
        long,
        env = "INFERA_NATS_REQ_MAX_PENDING",
        default_value_t = 0,
        value_name = "N"
    )]
    pub nats_req_max_pending: u32,

    /// Infera extension: namespace of this worker's Pod (kubernetes discovery).
    /// [default: the Pod's own namespace]
    #[arg(long, value_name = "NAMESPACE", help_heading = EXTENSIONS)]
    pub k8s_namespace: Option<String>,

    /// Infera extension: label selector of worker Pods (kubernetes discovery).
    #[arg(
        long,
        env = "INFERA_K8S_LABEL_SELECTOR",
        value_name = "SELECTOR",
        help_heading = EXTENSIONS
    )]
    pub k8s_label_selector: Option<String>,

    /// Infera extension: the Unix socket of the kvd daemon the engine saves and loads KV blocks
    /// through (vllm, sglang, mock; not atom). vLLM gets the kvd connector in
    /// --kv-transfer-config (merged into a given one), SGLang the HiCache storage backend; kvd
    /// must answer `hello` before the engine starts, and the worker registers as kvd-backed.
    /// A decode leg of a PD pair does not use it (it never reads from kvd).
    #[arg(long, value_name = "PATH", help_heading = EXTENSIONS)]
    pub infera_kvd_socket: Option<std::path::PathBuf>,

    /// Validate, print the resolved configuration as JSON on stdout and exit.
    #[arg(long)]
    pub check_config: bool,
}

/// The flags of a worker that runs a real engine.
#[derive(Debug, Clone, Args)]
pub struct EngineWorkerArgs {
    #[command(flatten)]
    pub common: WorkerArgs,

    /// Infera extension: the engine command, split on whitespace (tests run a stand-in).
    #[arg(long, env = "INFERA_ENGINE_CMD", value_name = "COMMAND", help_heading = EXTENSIONS)]
    pub engine_cmd: Option<String>,

    /// Infera extension: how long the engine may take to answer `GET /health` after it was
    /// started (model download and load, kernel compilation).
    #[arg(
        long,
        env = "INFERA_ENGINE_READY_TIMEOUT",
        default_value = "30m",
        value_name = "DURATION",
        help_heading = EXTENSIONS
    )]
    pub engine_ready_timeout: HumanDuration,

    /// Benchmark-only: start a prefill or decode worker without an RDMA KV transport (SGLang:
    /// no explicit RDMA --disaggregation-transfer-backend; vLLM: no Mooncake, MoRIIO or NIXL
    /// connector), which the launcher otherwise refuses as a silent TCP fallback.
    #[arg(long)]
    pub disaggregation_allow_tcp: bool,

    /// KV events: `off` starts the engine without them (the router then balances this worker
    /// by load alone); `on` and `auto` leave them to --enable-kv-events.
    #[arg(long, value_enum, default_value = "auto", value_name = "MODE")]
    pub kv_events: KvEventsMode,

    /// ZMQ endpoint the engine's KV-event publisher binds, e.g. tcp://0.0.0.0:5557; its port
    /// is advertised with --advertise-host. [default: a free port]
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_bind: Option<String>,

    /// The Python router's coalescing unit, in tokens (not the engine's block size). Accepted
    /// for the Python launchers' command lines; Infera's router indexes at the engine's own
    /// block size, which the worker registers as kv_block_size.
    #[arg(long, default_value_t = 64, value_name = "TOKENS")]
    pub index_block_size: u32,

    /// The arguments forwarded to the engine, filled in by the argument splitter.
    #[arg(skip)]
    pub engine_args: Vec<String>,
}

/// `--kv-events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvEventsMode {
    On,
    Off,
    Auto,
}

/// The flags of `infera worker mock`.
#[derive(Debug, Clone, Args)]
pub struct MockWorkerArgs {
    #[command(flatten)]
    pub common: WorkerArgs,

    /// KV blocks of simulated GPU memory.
    #[arg(long, default_value_t = 16384, value_name = "N", help_heading = MOCK)]
    pub gpu_blocks: u32,

    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_name = "N", help_heading = MOCK)]
    pub block_size: u32,

    /// Token budget of one scheduler step.
    #[arg(long, default_value_t = 8192, value_name = "N", help_heading = MOCK)]
    pub max_batched_tokens: u32,

    /// Sequences running at once.
    #[arg(long, default_value_t = 256, value_name = "N", help_heading = MOCK)]
    pub max_seqs: u32,

    /// Run simulated time this many times faster than the timing model.
    #[arg(
        long,
        default_value = "1.0",
        value_name = "X",
        allow_negative_numbers = true,
        help_heading = MOCK
    )]
    pub speedup: f64,

    /// Prefill step time in ms: A·t² + B·t + C over the step's new prompt tokens t.
    #[arg(
        long,
        default_value = "4.21e-7,0.01518,16.5",
        value_name = "A,B,C",
        allow_hyphen_values = true,
        help_heading = MOCK
    )]
    pub prefill_coeffs: TimingCoeffs,

    /// Decode step time in ms: A·u² + B·u + C over the fraction u of KV blocks in use.
    #[arg(
        long,
        default_value = "-25.74,54.01,5.74",
        value_name = "A,B,C",
        allow_hyphen_values = true,
        help_heading = MOCK
    )]
    pub decode_coeffs: TimingCoeffs,

    /// Play one leg of a prefill/decode pair: `prefill`, `decode`, or `null` (mixed), as
    /// SGLang spells it. A PD-role mock checks each request carries its leg's PD fields (400
    /// otherwise) and registers `disagg_mode` and `disagg_meta` as the launcher does for the
    /// protocol's engine.
    #[arg(long, default_value = "null", value_name = "MODE", help_heading = MOCK)]
    pub disaggregation_mode: String,

    /// The PD protocol a PD-role mock speaks and registers: sglang-bootstrap, vllm-mooncake,
    /// vllm-nixl, vllm-mori-read, vllm-mori-write or atom-mooncake.
    #[arg(long, default_value = "sglang-bootstrap", value_name = "PROTOCOL", help_heading = MOCK)]
    pub disaggregation_protocol: String,

    /// The bootstrap (SGLang, vLLM Mooncake) or handshake (MoRI, ATOM) port a PD-role mock
    /// registers; nothing listens there.
    #[arg(long, default_value_t = 8998, value_name = "PORT", help_heading = MOCK)]
    pub disaggregation_bootstrap_port: u16,

    /// LoRA adapters to serve on top of the model, as vLLM takes them: `NAME=PATH` (the path is
    /// not read) or vLLM's JSON `{"name": …, "path": …}`, several after one flag. The mock lists
    /// them in `/v1/models` with the model as `parent`, answers requests for them, keys their KV
    /// blocks by the adapter's name as vLLM does, and loads and unloads more at run time
    /// (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`).
    #[arg(long, num_args = 1.., value_name = "NAME=PATH", help_heading = MOCK)]
    pub lora_modules: Vec<String>,
}
