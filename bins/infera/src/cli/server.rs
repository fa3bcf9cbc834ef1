//! Flags of `infera server` (the seed's `python -m infera.server`), plus Infera's extensions.
//!
//! Only the shape of the command line lives here: names, defaults, help and the syntax of
//! each value. Everything else is checked by `TryFrom<ServerArgs> for ServerConfig`.

use crate::config::server::{AutoTuneMode, RouterMode};
use crate::config::units::{ByteSize, HumanDuration};
use crate::config::{KvEventTransport, RequestTransport};
use clap::Args;
use infera_core::policy::{AffinityMode, PolicyKind};
use std::path::PathBuf;

const EXTENSIONS: &str = "Infera extensions";
const ROUTING: &str = "Routing";
const TRANSPORT: &str = "Transport";

/// Arguments of `infera server`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "--discovery-backend, --request-transport and --kv-event-transport must \
    be the same on the server and on every worker."
)]
pub struct ServerArgs {
    /// OpenAI-compatible HTTP bind address.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,

    /// OpenAI-compatible HTTP port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Infera extension: close a client connection whose request head is not complete this
    /// long after it connected (first request) or after the head's first byte (later ones):
    /// slow or stalled headers; 0 = off. e.g. 10s.
    #[arg(long, default_value = "10s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub client_header_timeout: HumanDuration,

    /// Infera extension: close a keep-alive client connection that sends nothing this long
    /// after its last response; 0 = off.
    #[arg(long, default_value = "60s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub client_idle_timeout: HumanDuration,

    /// Infera extension: answer 408 when a request body has not arrived whole this long after
    /// its head; 0 = off.
    #[arg(long, default_value = "60s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub client_body_timeout: HumanDuration,

    /// Infera extension: close a client connection whose writes make no progress this long
    /// (the client stopped reading a response: its stream ends and its worker is freed);
    /// 0 = off.
    #[arg(long, default_value = "60s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub client_write_timeout: HumanDuration,

    /// Infera extension: client connections served at once; a connection beyond it is
    /// answered 503 with Retry-After and closed at once. [default: three quarters of the
    /// open-file limit (ulimit -n)]
    #[arg(long, value_name = "N", help_heading = EXTENSIONS)]
    pub max_connections: Option<u32>,

    /// Infera extension: bytes of request bodies being read and parsed at once, server-wide
    /// (parsing holds about 3x a body's size); a body beyond it is answered 503 with
    /// Retry-After instead of growing memory; 0 = unlimited. e.g. 512MiB, 2GiB.
    #[arg(long, default_value = "512MiB", value_name = "SIZE", help_heading = EXTENSIONS)]
    pub parse_budget: ByteSize,

    /// Infera extension: bearer token required by the admin endpoints (/v1/admin/*) and the
    /// workers view (/v1/workers), answered 401 without it; every other endpoint stays open.
    /// Prefer the environment variable: a flag shows in the process list.
    /// [default: unset, nothing is asked]
    #[arg(
        long,
        env = "INFERA_ADMIN_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        help_heading = EXTENSIONS
    )]
    pub admin_token: Option<String>,

    /// Infera extension: the tenants' API keys, weights, priorities and limits (JSON; see
    /// docs/tenants.md), reloaded when the file changes. With it, /v1/completions,
    /// /v1/chat/completions and /v1/messages need a key (Authorization: Bearer or x-api-key;
    /// 401 without one), and a tenant over a limit is answered 429. [default: unset, no key is
    /// asked and every request is one anonymous tenant's]
    #[arg(long, env = "INFERA_API_KEYS", value_name = "FILE", help_heading = EXTENSIONS)]
    pub api_keys: Option<PathBuf>,

    /// Tokenizer for prefix hashing (required): a directory containing tokenizer.json, a
    /// tokenizer.json file, or a Hugging Face model id (e.g. Qwen/Qwen3-0.6B) from the local
    /// Hugging Face cache (HF_HUB_CACHE, HF_HOME) or downloaded into it (HF_ENDPOINT, HF_TOKEN;
    /// not with HF_HUB_OFFLINE). Must match the workers' model.
    #[arg(long, value_name = "PATH", help_heading = ROUTING)]
    pub router_tokenizer_path: Option<PathBuf>,

    /// A base model whose workers use another tokenizer than --router-tokenizer-path, as
    /// MODEL=PATH (PATH as for --router-tokenizer-path; its chat template is its own), once per
    /// such model: one server routes several base models on their own prefixes. An adapter is
    /// tokenized as its base model.
    #[arg(long, value_name = "MODEL=PATH", help_heading = ROUTING)]
    pub model_tokenizer: Vec<String>,

    /// Load a LoRA adapter that no worker serves when a request names it: the least loaded
    /// worker of the base model is asked to load it (vLLM's POST /v1/load_lora_adapter; the
    /// engine needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) from this path, `{name}` replaced
    /// by the adapter's name (letters, digits, `-`, `_`, `.` only), e.g. /adapters/{name}.
    /// Off by default: an unknown model is a 404.
    #[arg(long, value_name = "TEMPLATE", help_heading = ROUTING)]
    pub lora_load_path: Option<String>,

    /// The base model adapters are loaded onto with --lora-load-path [default: the fleet's
    /// only base model].
    #[arg(long, value_name = "MODEL", requires = "lora_load_path", help_heading = ROUTING)]
    pub lora_load_base: Option<String>,

    /// How long an engine may take to load an adapter for --lora-load-path.
    #[arg(long, default_value = "60s", value_name = "DURATION", help_heading = ROUTING)]
    pub lora_load_timeout: HumanDuration,

    /// auto: the in-process policy picks each request's worker; direct: use the worker named
    /// in the x-worker-instance-id header (set by a Gateway API Inference Extension endpoint
    /// picker), the policy's pick when a request has none.
    #[arg(long, env = "INFERA_ROUTER_MODE", value_enum, default_value = "auto", help_heading = ROUTING)]
    pub router_mode: RouterMode,

    /// The Python Infera's data-plane choice: python (its asyncio router) or rust (its separate
    /// router binary). Accepted for its command lines; Infera has one router, this one.
    #[arg(
        long,
        env = "INFERA_ROUTER_BACKEND",
        value_enum,
        default_value = "python",
        help_heading = ROUTING
    )]
    pub router_backend: RouterBackend,

    /// Infera extension: the retention class stamped on a request that asks for none (no
    /// kv_transfer_params.infera_retention or prompt_cache_retention): none, short or long.
    #[arg(
        long,
        env = "INFERA_ROUTER_DEFAULT_RETENTION",
        value_enum,
        default_value = "long",
        value_name = "CLASS",
        help_heading = ROUTING
    )]
    pub default_retention: DefaultRetention,

    /// Routing policy used when --router-mode auto.
    #[arg(long, value_parser = super::policy_parser(), default_value_t, help_heading = ROUTING)]
    pub router_policy: PolicyKind,

    #[command(flatten)]
    pub weights: super::OverlapWeightArgs,

    /// Retry on an alternate worker on a failure before the response starts (never
    /// mid-stream); 0 disables.
    #[arg(long, env = "INFERA_REQUEST_MAX_RETRIES", default_value_t = 1, value_name = "N", help_heading = ROUTING)]
    pub request_max_retries: u32,

    #[command(flatten)]
    pub discovery: super::DiscoveryArgs,

    /// How requests reach workers.
    #[arg(long, value_enum, default_value = "nats", help_heading = TRANSPORT)]
    pub request_transport: RequestTransport,

    /// How KV-cache events reach the router.
    #[arg(long, value_enum, default_value = "nats", help_heading = TRANSPORT)]
    pub kv_event_transport: KvEventTransport,

    /// NATS broker URL.
    #[arg(
        long,
        env = "NATS_SERVER",
        default_value = "nats://127.0.0.1:4222",
        value_name = "URL",
        help_heading = TRANSPORT
    )]
    pub nats_server: String,

    /// NATS requests: per-chunk inactivity timeout (0 = forever); e.g. 900s, 15m.
    #[arg(long, env = "INFERA_NATS_REQ_IDLE_TIMEOUT", default_value = "900s", value_name = "DURATION", help_heading = TRANSPORT)]
    pub nats_req_idle_timeout: HumanDuration,

    /// NATS requests: hard wall-clock cap per request (0 = off).
    #[arg(long, env = "INFERA_NATS_REQ_MAX_DURATION", default_value = "0", value_name = "DURATION", help_heading = TRANSPORT)]
    pub nats_req_max_duration: HumanDuration,

    /// NATS requests: per-worker backlog limit (0 = off). When > 0 (set it on the workers too),
    /// requests go through the JetStream work queue INFERA_REQUESTS, and a worker whose queued
    /// plus in-flight requests, counted across all server replicas, reach N gets 429 (failed
    /// over to another worker).
    #[arg(long, env = "INFERA_NATS_REQ_MAX_PENDING", default_value_t = 0, value_name = "N", help_heading = TRANSPORT)]
    pub nats_req_max_pending: u32,

    /// HTTP requests to workers: TCP connect timeout; a worker not connected by then is
    /// tried elsewhere (0 = the OS's own); e.g. 10s, 500ms.
    #[arg(long, default_value = "10s", value_name = "DURATION", help_heading = TRANSPORT)]
    pub http_req_connect_timeout: HumanDuration,

    /// HTTP requests to workers: longest wait from sending a request to the first byte of its
    /// response body (time to first token; a whole non-streamed answer); past it the request
    /// is cancelled and tried on another worker within --request-max-retries (0 = forever).
    /// [default: derived per request: 30 s plus 4 times the time its uncached prompt tokens
    /// and the worker's queue take at the worker's measured prefill rate, at most 900 s]
    #[arg(long, value_name = "DURATION", help_heading = TRANSPORT)]
    pub http_req_first_byte_timeout: Option<HumanDuration>,

    /// HTTP requests to workers: longest gap between response chunks once the first came; past
    /// it the stream ends with an error event (504) and the request is cancelled (0 = forever).
    #[arg(long, default_value = "900s", value_name = "DURATION", help_heading = TRANSPORT)]
    pub http_req_idle_timeout: HumanDuration,

    /// HTTP requests to workers: hard wall-clock cap per request (0 = off).
    #[arg(long, default_value = "0", value_name = "DURATION", help_heading = TRANSPORT)]
    pub http_req_max_duration: HumanDuration,

    /// Consecutive failures of a worker before its first response byte (unreachable, timeout,
    /// 5xx; 4xx and 429 excluded) that take it out of routing for a cooldown; 0 disables the
    /// circuit breaker.
    #[arg(long, env = "INFERA_BREAKER_FAILURE_THRESHOLD", default_value_t = 3, value_name = "N", help_heading = ROUTING)]
    pub breaker_failure_threshold: u32,

    /// Seconds a tripped worker is excluded before one probe request is admitted; a successful
    /// probe closes the breaker.
    #[arg(
        long,
        env = "INFERA_BREAKER_COOLDOWN_S",
        default_value = "5",
        value_name = "SECONDS",
        allow_negative_numbers = true,
        help_heading = ROUTING
    )]
    pub breaker_cooldown_s: f64,

    /// Ceiling of the breaker cooldown, which doubles on each failed probe.
    #[arg(
        long,
        env = "INFERA_BREAKER_MAX_COOLDOWN_S",
        default_value = "60",
        value_name = "SECONDS",
        allow_negative_numbers = true,
        help_heading = ROUTING
    )]
    pub breaker_max_cooldown_s: f64,

    /// Active health checks: how often the server probes every worker's engine (`GET /health`;
    /// over NATS through the worker; not in JetStream mode).
    #[arg(long, env = "INFERA_HEALTH_CHECK_INTERVAL", default_value = "2s", value_name = "DURATION", help_heading = ROUTING)]
    pub health_check_interval: HumanDuration,

    /// The longest one health probe may take; a slower answer is a failed probe.
    #[arg(long, env = "INFERA_HEALTH_CHECK_TIMEOUT", default_value = "2s", value_name = "DURATION", help_heading = ROUTING)]
    pub health_check_timeout: HumanDuration,

    /// Consecutive failed health probes that take a worker out of routing; the requests it
    /// holds fail over at once (not yet streaming: retried elsewhere; streaming: migrated
    /// where --migration-limit allows, else ended with an error event). 0 disables the checks.
    #[arg(long, env = "INFERA_HEALTH_CHECK_UNHEALTHY_THRESHOLD", default_value_t = 3, value_name = "N", help_heading = ROUTING)]
    pub health_check_unhealthy_threshold: u32,

    /// Consecutive passed health probes that bring a worker back into routing.
    #[arg(long, env = "INFERA_HEALTH_CHECK_HEALTHY_THRESHOLD", default_value_t = 2, value_name = "N", help_heading = ROUTING)]
    pub health_check_healthy_threshold: u32,

    /// A health probe fails, whatever `/health` answers, when the worker holds streams past
    /// their first byte and none has relayed a chunk for this long (an engine that answers
    /// but makes no progress; at the defaults it leaves routing within about 12 s). 0 = off.
    #[arg(long, env = "INFERA_HEALTH_CHECK_STALL_TIMEOUT", default_value = "6s", value_name = "DURATION", help_heading = ROUTING)]
    pub health_check_stall_timeout: HumanDuration,

    /// The most of a model's workers kept out of routing at once, by health checks, outlier
    /// ejection and circuit breakers together, in percent (at least one worker): past it the workers ejected last
    /// are routed again, so a fleet-wide slowdown never ejects every worker.
    #[arg(long, env = "INFERA_MAX_EJECTION_PERCENT", default_value_t = 50, value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(0..=100), help_heading = ROUTING)]
    pub max_ejection_percent: u32,

    /// Outlier ejection: how often each worker is compared with its peers (same model and
    /// role) by its time to first byte per unit of work and its failure rate, over its last 20
    /// requests of the last three intervals. An outlier leaves routing; the requests it holds
    /// go on.
    #[arg(long, env = "INFERA_OUTLIER_INTERVAL", default_value = "10s", value_name = "DURATION", help_heading = ROUTING)]
    pub outlier_interval: HumanDuration,

    /// Requests a worker, and each peer it is compared with, needs within the window to be
    /// judged.
    #[arg(long, env = "INFERA_OUTLIER_MIN_REQUESTS", default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=20), help_heading = ROUTING)]
    pub outlier_min_requests: u32,

    /// A worker whose median time to first byte per unit of work (its uncached and queued
    /// prompt tokens plus 1,024) is more than FACTOR times its peers' median is an outlier.
    /// 0 turns the rule off.
    #[arg(long, env = "INFERA_OUTLIER_TTFT_FACTOR", default_value_t = 5.0, value_name = "FACTOR", allow_negative_numbers = true, help_heading = ROUTING)]
    pub outlier_ttft_factor: f64,

    /// A worker whose failure rate (connection errors, timeouts and 5xx before the first byte)
    /// is at least PERCENT points above its peers' median is an outlier. 0 turns the rule off.
    #[arg(long, env = "INFERA_OUTLIER_ERROR_MARGIN", default_value_t = 50, value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(0..=100), help_heading = ROUTING)]
    pub outlier_error_margin: u32,

    /// How long an outlier's first ejection lasts; the n-th lasts n times as long, and each
    /// interval in routing without one takes one off n.
    #[arg(long, env = "INFERA_OUTLIER_BASE_EJECTION_TIME", default_value = "30s", value_name = "DURATION", help_heading = ROUTING)]
    pub outlier_base_ejection_time: HumanDuration,

    /// The longest ejection.
    #[arg(long, env = "INFERA_OUTLIER_MAX_EJECTION_TIME", default_value = "300s", value_name = "DURATION", help_heading = ROUTING)]
    pub outlier_max_ejection_time: HumanDuration,

    /// Continue a stream whose worker fails mid-stream on another worker (the text so far is
    /// carried in the prompt, the token budget reduced), at most N times per request and never
    /// on a worker that already failed it; mixed streams of one choice only. 0 disables.
    #[arg(long, env = "INFERA_MIGRATION_LIMIT", default_value_t = 0, value_name = "N", help_heading = ROUTING)]
    pub migration_limit: u32,

    /// kvd Unix socket; enables POST /v1/cache/prewarm (L3 prefetch), which answers 503
    /// without it.
    #[arg(long, value_name = "PATH")]
    pub kvd_socket_path: Option<PathBuf>,

    /// Enable the torch-profiler control plane (POST /v1/admin/profile/{start,stop}).
    /// [default: off]
    #[arg(
        long,
        env = "INFERA_ENABLE_PROFILING",
        value_parser = python_truthy
    )]
    pub enable_profiling: bool,

    /// Record the SLA planner's four signals per router and model: time to first token,
    /// inter-token latency, input and output sequence tokens (successful requests only).
    /// [default: off]
    #[arg(
        long,
        env = "INFERA_ENABLE_SLA_METRICS",
        value_parser = python_truthy
    )]
    pub enable_sla_metrics: bool,

    /// Serve GET/POST /v1/admin/scale: read and resize the worker pools of the InferaDeployment
    /// this server's Pod belongs to (its infera.amd.com/deployment label; needs POD_NAME and
    /// RBAC to get its Pod and get/patch inferadeployments). Answers 403 without it.
    /// [default: off]
    #[arg(
        long,
        env = "INFERA_ENABLE_SCALING_API",
        value_parser = python_truthy
    )]
    pub enable_scaling_api: bool,

    /// Infera extension: 0 picks the cheapest worker (argmin); above 0 picks at random with
    /// softmax weights over the costs, normalised by the decision's cost range.
    #[arg(
        long,
        default_value = "0",
        value_name = "T",
        allow_negative_numbers = true,
        help_heading = EXTENSIONS
    )]
    pub router_temperature: f64,

    /// Infera extension: load per block of the other conversations living on a worker between
    /// their turns (finished within the last minute, not continued yet); 0 counts only what is
    /// in flight. Above 0, new sessions spread over workers while each session's own turns stay
    /// with their cache (agentic traffic: try 1; `infera replay --tune` searches it).
    #[arg(long, default_value = "0", value_name = "W", allow_negative_numbers = true, help_heading = EXTENSIONS)]
    pub router_resident_weight: f64,

    /// Infera extension: each recent pick a worker took above the fleet's mean costs it as
    /// much as prefilling this many tokens, times --kv-overlap-weight (the last 64 picks per
    /// worker, a request's own conversation left out); 0 does not count them. Above 0, a hot
    /// prefix shared by many requests spreads over a few workers instead of piling onto its
    /// first holder, while a prefix longer than the charge stays (`infera replay --tune`
    /// searches it). [default: 0] (512 with --router-profile infera)
    #[arg(long, value_name = "TOKENS", help_heading = EXTENSIONS)]
    pub router_balance_tokens: Option<u32>,

    /// Infera extension: what a prompt block found in a worker's node kvd's host RAM (L2) is
    /// worth against one in its GPU cache, 0 to 1. [default: measured: 1 − the time kvd takes
    /// to load a block over the time the worker takes to prefill it; 0.75 until kvd reports]
    #[arg(long, value_name = "W", help_heading = EXTENSIONS)]
    pub router_host_cache_hit_weight: Option<f64>,

    /// Infera extension: the same for a block on the node kvd's NVMe (L3). [default: measured;
    /// 0.25 until kvd reports]
    #[arg(long, value_name = "W", help_heading = EXTENSIONS)]
    pub router_disk_cache_hit_weight: Option<f64>,

    /// Infera extension: the same for a block in the fleet's shared kvd store (L4: Redis,
    /// Mooncake, S3), which every kvd-backed worker can load. [default: measured; 0.1 until kvd
    /// reports]
    #[arg(long, value_name = "W", help_heading = EXTENSIONS)]
    pub router_remote_cache_hit_weight: Option<f64>,

    /// Infera extension: how a conversation the client names (`x-session-id` header, or the
    /// body's `prompt_cache_key` or `session_id`) keeps to the worker its last request went to,
    /// fleet-wide: tie-break (the routing policy decides; among equally good workers the
    /// session's wins), override (the session's worker while it is healthy and below
    /// --router-queue-threshold; the policy otherwise) or off.
    #[arg(long, env = "INFERA_ROUTER_SESSION_AFFINITY", default_value = "tie-break", value_name = "MODE", help_heading = EXTENSIONS)]
    pub router_session_affinity: AffinityMode,

    /// Infera extension: how long after its last request a session stays with its worker.
    #[arg(long, env = "INFERA_ROUTER_SESSION_TTL", default_value = "10m", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub router_session_ttl: HumanDuration,

    /// Infera extension: queue requests in the router, instead of piling them onto the
    /// engines, while every worker of their model has this many prefill budgets of prompt
    /// tokens routed and not yet prefilled (a budget: the max_num_batched_tokens its launcher
    /// registered, 8192 when none); waiters leave by priority, then by weighted fair share
    /// between tenants. `off` never queues.
    #[arg(long, env = "INFERA_ROUTER_QUEUE_THRESHOLD", default_value = "4", value_name = "BUDGETS", value_parser = queue_threshold, help_heading = EXTENSIONS)]
    pub router_queue_threshold: QueueThreshold,

    /// Infera extension: the longest a request waits in the router's queue; then it is
    /// answered 503 with Retry-After.
    #[arg(long, env = "INFERA_ROUTER_QUEUE_TIMEOUT", default_value = "60s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub router_queue_timeout: HumanDuration,

    /// Infera extension: requests waiting in the router's queue at most, over all models;
    /// past it a request is answered 503 with Retry-After at once.
    #[arg(long, env = "INFERA_ROUTER_QUEUE_MAX", default_value_t = 10_000, value_name = "N", help_heading = EXTENSIONS)]
    pub router_queue_max: u32,

    /// Infera extension: where router events are kept, so a restarted server keeps its KV
    /// index and replicas share load: memory, nats (JetStream on --nats-server),
    /// nats://HOST:PORT[?stream=NAME&max_age=7d&max_bytes=8GiB], sqlite:PATH or
    /// postgres://USER@HOST/DB.
    #[arg(long, default_value = "memory", value_name = "LOG", help_heading = EXTENSIONS)]
    pub event_log: String,

    /// Infera extension: record the event log as Parquet trace segments in DIR, for
    /// `infera replay`.
    #[arg(long, value_name = "DIR", help_heading = EXTENSIONS)]
    pub record_trace: Option<PathBuf>,

    /// Infera extension: also record prompt text in the trace (needs --record-trace).
    /// [default: off]
    #[arg(long, help_heading = EXTENSIONS)]
    pub record_prompts: bool,

    /// Infera extension: start a new trace segment once the open one holds about this much
    /// (needs --record-trace); e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_name = "SIZE", help_heading = EXTENSIONS)]
    pub record_segment_bytes: ByteSize,

    /// Infera extension: start a new trace segment once the open one is this old (needs
    /// --record-trace); a crash loses at most this much of the recording. e.g. 60s, 5m.
    #[arg(long, default_value = "60s", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub record_segment_age: HumanDuration,

    /// Infera extension: shadow replay of the server's own traffic. Every
    /// --auto-tune-interval the last --auto-tune-window of finished requests is replayed
    /// through the simulator (on one niced thread, off the request path) with the current
    /// router tunables and their neighbours on `infera replay --tune`'s grid, and set against
    /// what the engines reported. advise: publish the front, the recommendation and the
    /// predicted-against-realised hit rate at GET /v1/admin/tuning and as infera_tuning_*
    /// metrics. apply: also adopt a neighbour whose predicted gain is beyond the window's
    /// noise, one step at a time, and roll it back when the next window does not realise it;
    /// every change is a RouterRetuned event in the log. off: none of it.
    #[arg(long, value_enum, default_value = "advise", help_heading = EXTENSIONS)]
    pub auto_tune: AutoTuneMode,

    /// Infera extension: the traffic each shadow replay covers (--auto-tune).
    #[arg(long, default_value = "10m", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub auto_tune_window: HumanDuration,

    /// Infera extension: how often the shadow replay runs (--auto-tune).
    #[arg(long, default_value = "1m", value_name = "DURATION", help_heading = EXTENSIONS)]
    pub auto_tune_interval: HumanDuration,

    /// Infera extension: the most memory the shadow replay's window holds (--auto-tune); past
    /// it the oldest requests leave first. About 5 KiB per 10k-token request.
    #[arg(long, default_value = "256MiB", value_name = "SIZE", help_heading = EXTENSIONS)]
    pub auto_tune_memory: ByteSize,

    /// Infera extension: chat template file (Jinja) used to tokenize chat requests for
    /// prefix hashing. [default: the tokenizer's own template]
    #[arg(long, value_name = "FILE", help_heading = EXTENSIONS)]
    pub chat_template: Option<PathBuf>,

    /// kv-aware: JSON object matching the workers' engine `--default-chat-template-kwargs`, e.g.
    /// '{"enable_thinking": false}'. The engine merges these into every chat request before its
    /// template runs and nothing tells the router: without this flag the router renders a
    /// different prompt than the workers and every prefix lookup misses. A request's own
    /// `chat_template_kwargs` win over it.
    #[arg(long, value_name = "JSON")]
    pub kv_default_chat_template_kwargs: Option<String>,

    /// kv-aware: ask each SGLang worker at registration (GET /get_server_info) which template
    /// defaults its engine merges in, and hash chats for a worker whose defaults differ from
    /// --kv-default-chat-template-kwargs the way it renders them (a worker that cannot be asked
    /// keeps the flag's). [default: on]
    #[arg(long, overrides_with = "no_kv_per_worker_template_kwargs")]
    pub kv_per_worker_template_kwargs: bool,

    /// Pin the whole fleet to --kv-default-chat-template-kwargs (no per-worker probe).
    #[arg(long, overrides_with = "kv_per_worker_template_kwargs")]
    pub no_kv_per_worker_template_kwargs: bool,

    /// Infera extension: largest accepted request body (413 beyond); e.g. 32MiB, 1G.
    #[arg(long, default_value = "32MiB", value_name = "SIZE", help_heading = EXTENSIONS)]
    pub max_body_bytes: ByteSize,

    /// Infera extension: export each request's spans (parse, tokenize, route with its
    /// candidates, every attempt with its worker and time to first byte) over OTLP/gRPC to
    /// this collector, e.g. http://localhost:4317; a client's W3C `traceparent` is the
    /// request's parent, and each attempt passes its own to the engine (HTTP and NATS). Off
    /// by default; the standard OTEL_EXPORTER_OTLP_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turn it on too, and OTEL_SERVICE_NAME,
    /// OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG) and OTEL_BSP_* apply.
    #[arg(long, value_name = "URL", help_heading = EXTENSIONS)]
    pub otlp_endpoint: Option<String>,

    /// Infera extension: the share of new traces exported, 0 to 1 (a client's sampled flag is
    /// followed). [default: OTEL_TRACES_SAMPLER's, else every trace]
    #[arg(long, value_name = "RATIO", help_heading = EXTENSIONS)]
    pub otlp_sample_ratio: Option<f64>,

    /// Validate, print the resolved configuration as JSON on stdout and exit.
    #[arg(long)]
    pub check_config: bool,
}

/// `--default-retention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DefaultRetention {
    None,
    Short,
    Long,
}

impl From<DefaultRetention> for infera_core::event::Retention {
    fn from(r: DefaultRetention) -> Self {
        match r {
            DefaultRetention::None => Self::None,
            DefaultRetention::Short => Self::Short,
            DefaultRetention::Long => Self::Long,
        }
    }
}

/// `--router-backend` (accepted; see its help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RouterBackend {
    Python,
    Rust,
}

/// A switch's environment variable as the Python Infera reads it: on for `1`, `true` or `yes`
/// (any case), off for anything else, the empty value included.
fn python_truthy(value: &str) -> Result<bool, std::convert::Infallible> {
    Ok(matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes"
    ))
}

/// `--router-queue-threshold`: a positive number of prefill budgets, or `off` (`None`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueThreshold(pub Option<f64>);

pub(crate) fn queue_threshold(text: &str) -> Result<QueueThreshold, String> {
    if text.eq_ignore_ascii_case("off") {
        return Ok(QueueThreshold(None));
    }
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(QueueThreshold(Some(x))),
        _ => Err(format!("`{text}` is neither a positive number nor `off`")),
    }
}
