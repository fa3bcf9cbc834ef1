//! [`ServerConfig`]: the validated configuration of `infera server`.
//!
//! Built only by `TryFrom<ServerArgs>`, which checks, in this order: the breaker cooldowns
//! (finite, ≥ 0, the ceiling not below the first), the tokenizer path (required; a directory
//! with `tokenizer.json` or a readable file; it is read, not loaded), discovery (etcd needs an
//! endpoint), the transports, routing weights and temperature (finite, ≥ 0), the HTTP front
//! (body size and connection cap > 0, an admin token fit for a header), the event log
//! location, trace recording and the chat template. A discovery backend, transport or event
//! log this build was compiled without is refused with the Cargo feature that builds it.
//! Durations of 0 become `None` ("off" / "forever"), as the seed documents them.

use crate::cli::server::ServerArgs;
use crate::config::units::{ByteSize, HumanDuration};
use crate::config::{
    ConfigError, DiscoveryConfig, KvEventTransport, RequestTransport, non_empty, non_negative_f64,
    positive, readable_file,
};
use crate::wiring::{
    Backend, EventLogConfig, InvalidEventLogSpec, JetStreamLogConfig, SqliteLogConfig,
};
use infera_core::policy::{AffinityMode, PolicyKind};
use infera_core::service::OutlierConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// `--enable-scaling-api`: the pools of the InferaDeployment the server's Pod belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScalingApiConfig {
    /// Its namespace (`--k8s-namespace`); `None` is the Pod's own.
    pub namespace: Option<String>,
}

/// Who picks the worker for a request (`--router-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterMode {
    /// The in-process routing policy.
    Auto,
    /// An external endpoint picker, through the x-worker-instance-id header.
    Direct,
}

/// Where and what the server records for `infera replay`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecordingConfig {
    /// Directory of the Parquet segments.
    pub dir: PathBuf,
    /// Whether prompt text is recorded too.
    pub prompts: bool,
    /// A segment is closed once it holds about this many bytes.
    pub segment_bytes: ByteSize,
    /// A segment is closed once it is this old.
    pub segment_age: HumanDuration,
}

/// The HTTP front.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Bind address.
    pub host: String,
    /// Bind port.
    pub port: u16,
    /// Largest accepted request body.
    pub max_body_bytes: ByteSize,
    /// Deadline of a request head; `None` is off.
    pub client_header_timeout: Option<HumanDuration>,
    /// Deadline of an idle keep-alive connection; `None` is off.
    pub client_idle_timeout: Option<HumanDuration>,
    /// Deadline of a request body; `None` is off.
    pub client_body_timeout: Option<HumanDuration>,
    /// Deadline of a write to a client that stopped reading; `None` is off.
    pub client_write_timeout: Option<HumanDuration>,
    /// Client connections at once; `None`: three quarters of the open-file limit.
    pub max_connections: Option<u32>,
    /// Bytes of request bodies in parse at once; 0 is unlimited.
    pub parse_budget: ByteSize,
    /// Bearer token of the admin endpoints and `/v1/workers`; `None` leaves them open.
    #[serde(default)]
    pub admin_token: Option<AdminToken>,
    /// `--api-keys`: the key file (checked to parse; reloaded by the server as it changes).
    #[serde(default)]
    pub api_keys: Option<PathBuf>,
}

/// `--admin-token`: printed and serialized as `<redacted>`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct AdminToken(String);

impl AdminToken {
    /// The token itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for AdminToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("<redacted>")
    }
}

/// `--admin-token` must be usable in an `Authorization` header: visible ASCII, no spaces.
fn admin_token(token: Option<String>) -> Result<Option<AdminToken>, ConfigError> {
    match token {
        Some(t) if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) => {
            Err(ConfigError::new(
                "--admin-token",
                "must be non-empty visible ASCII without spaces (it is sent as \
                 Authorization: Bearer <token>); check INFERA_ADMIN_TOKEN",
            ))
        }
        t => Ok(t.map(AdminToken)),
    }
}

/// `--api-keys` must name a valid key file (the server loads it again at start).
fn api_keys(path: PathBuf) -> Result<PathBuf, ConfigError> {
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ConfigError::new("--api-keys", format!("{}: {e}", path.display())))?;
    infera_core::tenancy::Tenants::parse(&text, None, 0)
        .map_err(|e| ConfigError::new("--api-keys", format!("{}: {e}", path.display())))?;
    Ok(path)
}

/// Routing: tokenizer, policy and its weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// `--router-tokenizer-path` as given.
    pub tokenizer_path: PathBuf,
    /// The tokenizer.json file it resolved to (checked readable, not yet loaded).
    pub tokenizer_file: PathBuf,
    /// `--model-tokenizer`: each base model with its own tokenizer, as the path given and the
    /// tokenizer.json file it resolved to.
    pub model_tokenizers: Vec<(String, PathBuf, PathBuf)>,
    /// `--lora-load-path` and its companions: load unknown adapters on demand.
    pub lora_loading: Option<infera_adapters::server::LoraLoading>,
    /// Chat template replacing the tokenizer's own, if any.
    pub chat_template: Option<PathBuf>,
    /// Who picks the worker.
    pub mode: RouterMode,
    /// The in-process policy.
    pub policy: PolicyKind,
    /// Weight of blocks to prefill against load.
    pub kv_overlap_weight: f64,
    /// Prefill-role weight in PD mode; `None` uses `kv_overlap_weight`.
    pub kv_prefill_overlap_weight: Option<f64>,
    /// Decode-role weight in PD mode; `None` uses `kv_overlap_weight`.
    pub kv_decode_overlap_weight: Option<f64>,
    /// 0: argmin; above 0: softmax sampling over range-normalised costs.
    pub temperature: f64,
    /// `--router-resident-weight`: load per block of the conversations resident on a worker.
    #[serde(default)]
    pub resident_weight: f64,
    /// `--router-balance-tokens`: tokens to prefill per recent pick above the mean.
    #[serde(default)]
    pub balance_tokens: u32,
    /// `--router-{host,disk,remote}-cache-hit-weight`: fixed credits of a kvd tier's hit.
    #[serde(default)]
    pub tier_weights: infera_core::policy::TierWeights,
    /// Failovers before the first response byte.
    pub request_max_retries: u32,
    /// The retention of a request that asks for none.
    pub default_retention: infera_core::event::Retention,
    /// `--kv-default-chat-template-kwargs`: what the workers' engines merge into every chat
    /// request before rendering.
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// `--kv-per-worker-template-kwargs`: each SGLang worker's own defaults, probed at
    /// registration, win over `default_chat_template_kwargs` for its chats.
    pub per_worker_template_kwargs: bool,
    /// `--router-queue-threshold`: prefill budgets per worker before requests queue; `None`
    /// never queues.
    pub queue_threshold: Option<f64>,
    /// `--router-queue-timeout`.
    pub queue_timeout: HumanDuration,
    /// `--router-queue-max`.
    pub queue_max: u32,
    /// `--router-session-affinity`.
    pub session_affinity: AffinityMode,
    /// `--router-session-ttl`.
    pub session_ttl: HumanDuration,
}

/// The NATS broker and the limits of NATS requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Broker URL.
    pub server: String,
    /// Longest gap between reply chunks; `None` waits forever.
    pub req_idle_timeout: Option<HumanDuration>,
    /// Longest whole request; `None` is unlimited.
    pub req_max_duration: Option<HumanDuration>,
    /// In-flight requests per worker before 429; `None` is unlimited.
    pub req_max_pending: Option<u32>,
}

/// `--http-req-first-byte-timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FirstByteTimeout {
    /// Each request's own, from its uncached prompt tokens and the worker's prefill rate (the
    /// default; see `infera_core::service::deadline`).
    Derived,
    /// Waits forever (`0`).
    Off,
    /// The same for every request.
    Fixed(HumanDuration),
}

/// Deadlines of HTTP requests to workers, the circuit breaker and stream migration
/// (`--http-req-*`, `--breaker-*`, `--migration-limit`); a `None` deadline is off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEdgeConfig {
    /// TCP connect to a worker; `None` leaves it to the OS.
    pub connect_timeout: Option<HumanDuration>,
    /// Request sent → first response body byte.
    pub first_byte_timeout: FirstByteTimeout,
    /// Longest gap between response chunks; `None` waits forever.
    pub idle_timeout: Option<HumanDuration>,
    /// Longest whole request; `None` is unlimited.
    pub max_duration: Option<HumanDuration>,
    /// Consecutive pre-first-byte failures that open a worker's breaker; 0 disables it.
    pub breaker_failure_threshold: u32,
    /// First cooldown of an open breaker, in seconds.
    pub breaker_cooldown_s: f64,
    /// Ceiling of the doubling cooldown, in seconds.
    pub breaker_max_cooldown_s: f64,
    /// Times one stream may move to another worker mid-stream; 0 is off.
    pub migration_limit: u32,
    /// Between two rounds of health probes.
    pub health_check_interval: HumanDuration,
    /// The longest one probe may take.
    pub health_check_timeout: HumanDuration,
    /// Consecutive failed probes that take a worker out of routing; 0 disables the checks.
    pub health_check_unhealthy_threshold: u32,
    /// Consecutive passed probes that bring it back.
    pub health_check_healthy_threshold: u32,
    /// How long a worker's streams may all relay nothing before its probes fail; 0 is off.
    pub health_check_stall_timeout: HumanDuration,
    /// The most of a model's workers out of routing at once, in percent.
    pub max_ejection_percent: u32,
    /// How outliers are found and ejected.
    pub outliers: OutlierSettings,
}

/// `--outlier-*`, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutlierSettings {
    /// Between two evaluations.
    pub interval: HumanDuration,
    /// Requests a worker and its peers need to be judged.
    pub min_requests: u32,
    /// Times the peers' median time per unit of work; 0 is off.
    pub ttft_factor: f64,
    /// Points above the peers' failure rate; 0 is off.
    pub error_margin_percent: u32,
    /// The first ejection.
    pub base_ejection_time: HumanDuration,
    /// The longest.
    pub max_ejection_time: HumanDuration,
}

impl OutlierSettings {
    fn from_args(args: &ServerArgs) -> Result<Self, ConfigError> {
        let base = not_zero(
            "--outlier-base-ejection-time",
            args.outlier_base_ejection_time,
        )?;
        let max = not_zero(
            "--outlier-max-ejection-time",
            args.outlier_max_ejection_time,
        )?;
        if max.0 < base.0 {
            return Err(ConfigError::new(
                "--outlier-max-ejection-time",
                format!("must be at least --outlier-base-ejection-time ({base}), got {max}"),
            ));
        }
        Ok(Self {
            interval: not_zero("--outlier-interval", args.outlier_interval)?,
            min_requests: args.outlier_min_requests,
            ttft_factor: non_negative_f64("--outlier-ttft-factor", args.outlier_ttft_factor)?,
            error_margin_percent: args.outlier_error_margin,
            base_ejection_time: base,
            max_ejection_time: max,
        })
    }

    /// The service's settings.
    pub fn config(&self) -> OutlierConfig {
        OutlierConfig {
            interval: self.interval.0,
            min_requests: self.min_requests,
            ttft_factor: self.ttft_factor,
            error_margin: f64::from(self.error_margin_percent) / 100.0,
            base_ejection: self.base_ejection_time.0,
            max_ejection: self.max_ejection_time.0,
        }
    }
}

/// A duration that must not be zero.
fn not_zero(flag: &'static str, value: HumanDuration) -> Result<HumanDuration, ConfigError> {
    value
        .non_zero()
        .ok_or_else(|| ConfigError::new(flag, "must be greater than 0".to_owned()))
}

impl WorkerEdgeConfig {
    fn from_args(args: &ServerArgs) -> Result<Self, ConfigError> {
        let cooldown = non_negative_f64("--breaker-cooldown-s", args.breaker_cooldown_s)?;
        let max = non_negative_f64("--breaker-max-cooldown-s", args.breaker_max_cooldown_s)?;
        if max < cooldown {
            return Err(ConfigError::new(
                "--breaker-max-cooldown-s",
                format!("must be at least --breaker-cooldown-s ({cooldown}), got {max}"),
            ));
        }
        Ok(Self {
            connect_timeout: args.http_req_connect_timeout.non_zero(),
            first_byte_timeout: match args.http_req_first_byte_timeout {
                None => FirstByteTimeout::Derived,
                Some(d) => d
                    .non_zero()
                    .map_or(FirstByteTimeout::Off, FirstByteTimeout::Fixed),
            },
            idle_timeout: args.http_req_idle_timeout.non_zero(),
            max_duration: args.http_req_max_duration.non_zero(),
            breaker_failure_threshold: args.breaker_failure_threshold,
            breaker_cooldown_s: cooldown,
            breaker_max_cooldown_s: max,
            migration_limit: args.migration_limit,
            health_check_interval: not_zero("--health-check-interval", args.health_check_interval)?,
            health_check_timeout: not_zero("--health-check-timeout", args.health_check_timeout)?,
            health_check_unhealthy_threshold: args.health_check_unhealthy_threshold,
            health_check_healthy_threshold: args.health_check_healthy_threshold.max(1),
            health_check_stall_timeout: args.health_check_stall_timeout,
            max_ejection_percent: args.max_ejection_percent,
            outliers: OutlierSettings::from_args(args)?,
        })
    }
}

/// The validated configuration of `infera server`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The OpenAI-compatible HTTP front.
    pub http: HttpConfig,
    /// Routing.
    pub router: RouterConfig,
    /// Worker discovery.
    pub discovery: DiscoveryConfig,
    /// How requests reach workers.
    pub request_transport: RequestTransport,
    /// How KV events reach the router.
    pub kv_event_transport: KvEventTransport,
    /// NATS settings (used by whichever of the above is `nats`, and by a `nats` event log).
    pub nats: NatsConfig,
    /// kvd socket for prewarm; `None` makes prewarm answer 503.
    pub kvd_socket_path: Option<PathBuf>,
    /// Whether the profiler endpoints are enabled.
    pub enable_profiling: bool,
    /// `--enable-sla-metrics`: the SLA planner's histograms.
    pub enable_sla_metrics: bool,
    /// `--enable-scaling-api`: where `/v1/admin/scale` finds the deployment; `None` when off.
    pub scaling_api: Option<ScalingApiConfig>,
    /// Where router events are kept.
    pub event_log: EventLogConfig,
    /// Trace recording, if enabled.
    pub record_trace: Option<TraceRecordingConfig>,
    /// `--auto-tune` and its window.
    pub auto_tune: AutoTuneConfig,
    /// Deadlines toward workers over HTTP and the circuit breaker.
    pub worker_edge: WorkerEdgeConfig,
}

impl TryFrom<ServerArgs> for ServerConfig {
    type Error = ConfigError;

    fn try_from(args: ServerArgs) -> Result<Self, ConfigError> {
        let worker_edge = WorkerEdgeConfig::from_args(&args)?;
        let auto_tune = AutoTuneConfig::from_args(&args)?;
        let (tokenizer_path, tokenizer_file) = tokenizer(args.router_tokenizer_path)?;
        let model_tokenizers = model_tokenizers(&args.model_tokenizer)?;
        let lora_loading = lora_loading(
            args.lora_load_path.clone(),
            args.lora_load_base.clone(),
            &args.lora_load_timeout,
        )?;
        let scaling_api = if args.enable_scaling_api {
            Backend::Kubernetes.require("--enable-scaling-api", "on")?;
            Some(ScalingApiConfig {
                namespace: non_empty(args.discovery.k8s_namespace.clone()),
            })
        } else {
            None
        };
        let discovery = args.discovery.for_router()?;
        args.request_transport.require_built()?;
        args.kv_event_transport.require_built()?;
        let profile = args.weights.router_profile;
        let (kv_overlap_weight, kv_prefill_overlap_weight, kv_decode_overlap_weight) =
            args.weights.validated()?;
        let router = RouterConfig {
            tokenizer_path,
            tokenizer_file,
            model_tokenizers,
            lora_loading,
            chat_template: chat_template(args.chat_template)?,
            mode: args.router_mode,
            policy: args.router_policy,
            kv_overlap_weight,
            kv_prefill_overlap_weight,
            kv_decode_overlap_weight,
            temperature: non_negative_f64("--router-temperature", args.router_temperature)?,
            resident_weight: non_negative_f64(
                "--router-resident-weight",
                args.router_resident_weight,
            )?,
            balance_tokens: args
                .router_balance_tokens
                .unwrap_or(profile.balance_tokens()),
            tier_weights: infera_core::policy::TierWeights {
                host: unit_weight(
                    "--router-host-cache-hit-weight",
                    args.router_host_cache_hit_weight,
                )?,
                disk: unit_weight(
                    "--router-disk-cache-hit-weight",
                    args.router_disk_cache_hit_weight,
                )?,
                external: unit_weight(
                    "--router-remote-cache-hit-weight",
                    args.router_remote_cache_hit_weight,
                )?,
            },
            request_max_retries: args.request_max_retries,
            default_retention: args.default_retention.into(),
            default_chat_template_kwargs: template_kwargs(
                args.kv_default_chat_template_kwargs.as_deref(),
            )?,
            per_worker_template_kwargs: !args.no_kv_per_worker_template_kwargs,
            queue_threshold: args.router_queue_threshold.0,
            queue_timeout: not_zero("--router-queue-timeout", args.router_queue_timeout)?,
            queue_max: positive("--router-queue-max", args.router_queue_max)?,
            session_affinity: args.router_session_affinity,
            session_ttl: not_zero("--router-session-ttl", args.router_session_ttl)?,
        };
        let http = HttpConfig {
            host: args.host,
            port: args.port,
            max_body_bytes: positive("--max-body-bytes", args.max_body_bytes.bytes())
                .map(ByteSize)?,
            client_header_timeout: args.client_header_timeout.non_zero(),
            client_idle_timeout: args.client_idle_timeout.non_zero(),
            client_body_timeout: args.client_body_timeout.non_zero(),
            client_write_timeout: args.client_write_timeout.non_zero(),
            max_connections: args
                .max_connections
                .map(|n| positive("--max-connections", n))
                .transpose()?,
            parse_budget: args.parse_budget,
            admin_token: admin_token(args.admin_token)?,
            api_keys: args.api_keys.map(api_keys).transpose()?,
        };
        let event_log = event_log(&args.event_log, &args.nats_server)?;
        Ok(Self {
            http,
            router,
            discovery,
            request_transport: args.request_transport,
            kv_event_transport: args.kv_event_transport,
            nats: NatsConfig {
                server: args.nats_server,
                req_idle_timeout: args.nats_req_idle_timeout.non_zero(),
                req_max_duration: args.nats_req_max_duration.non_zero(),
                req_max_pending: (args.nats_req_max_pending > 0)
                    .then_some(args.nats_req_max_pending),
            },
            kvd_socket_path: args.kvd_socket_path,
            enable_profiling: args.enable_profiling,
            enable_sla_metrics: args.enable_sla_metrics,
            scaling_api,
            event_log,
            record_trace: record_trace(
                args.record_trace,
                args.record_prompts,
                args.record_segment_bytes,
                args.record_segment_age,
            )?,
            auto_tune,
            worker_edge,
        })
    }
}

/// Resolves `--router-tokenizer-path` to its tokenizer.json, checking only that it is readable.
/// `--lora-load-path` (with `{name}`), `--lora-load-base`, `--lora-load-timeout`.
fn lora_loading(
    template: Option<String>,
    base: Option<String>,
    timeout: &HumanDuration,
) -> Result<Option<infera_adapters::server::LoraLoading>, ConfigError> {
    let Some(template) = template else {
        return Ok(None);
    };
    if !template.contains("{name}") {
        return Err(ConfigError::new(
            "--lora-load-path",
            format!(
                "{template}: put {{name}} where the adapter's name goes, e.g. /adapters/{{name}}"
            ),
        ));
    }
    if timeout.is_zero() {
        return Err(ConfigError::new(
            "--lora-load-timeout",
            "must be more than 0: every load has a deadline",
        ));
    }
    Ok(Some(infera_adapters::server::LoraLoading {
        path_template: template,
        base,
        timeout: timeout.0,
    }))
}

/// `--model-tokenizer MODEL=PATH`s: each model once, each path resolved as
/// `--router-tokenizer-path`'s.
fn model_tokenizers(args: &[String]) -> Result<Vec<(String, PathBuf, PathBuf)>, ConfigError> {
    const FLAG: &str = "--model-tokenizer";
    let mut out: Vec<(String, PathBuf, PathBuf)> = Vec::with_capacity(args.len());
    for arg in args {
        let Some((model, path)) = arg
            .split_once('=')
            .filter(|(m, p)| !m.is_empty() && !p.is_empty())
        else {
            return Err(ConfigError::new(
                FLAG,
                format!("{arg}: expected MODEL=PATH"),
            ));
        };
        if out.iter().any(|(m, _, _)| m == model) {
            return Err(ConfigError::new(FLAG, format!("{model} is given twice")));
        }
        let (path, file) = resolve_tokenizer(FLAG, PathBuf::from(path))?;
        out.push((model.to_owned(), path, file));
    }
    Ok(out)
}

pub(crate) fn tokenizer(path: Option<PathBuf>) -> Result<(PathBuf, PathBuf), ConfigError> {
    const FLAG: &str = "--router-tokenizer-path";
    let path = path.ok_or_else(|| {
        ConfigError::new(
            FLAG,
            "is required: a directory containing tokenizer.json, or a tokenizer.json file, \
             for the same model as the workers",
        )
    })?;
    resolve_tokenizer(FLAG, path)
}

/// A tokenizer `path` given to `flag`: a directory holding tokenizer.json, that file, or a
/// Hugging Face model id (from the local cache, or downloaded into it); the path as given and
/// the file it resolved to.
fn resolve_tokenizer(flag: &'static str, path: PathBuf) -> Result<(PathBuf, PathBuf), ConfigError> {
    if path.is_dir() {
        let file = path.join("tokenizer.json");
        if !file.exists() {
            return Err(ConfigError::new(
                flag,
                format!(
                    "names {}, a directory without tokenizer.json",
                    path.display()
                ),
            ));
        }
        readable_file(flag, &file)?;
        return Ok((path, file));
    }
    if !path.exists() {
        // A Hugging Face model id, as the Python server takes it: from the local cache, or
        // downloaded into it.
        if let Some(id) = path.to_str().filter(|p| super::hf::is_model_id(p)) {
            let env = |key: &str| std::env::var(key).ok();
            let file = super::hf::tokenizer(id, &env)
                .map_err(|message| ConfigError::new(flag, message))?;
            readable_file(flag, &file)?;
            return Ok((path, file));
        }
        return Err(ConfigError::new(
            flag,
            format!(
                "names {}, which does not exist (expected a directory containing \
                 tokenizer.json, a tokenizer.json file, or a Hugging Face model id in the \
                 local cache)",
                path.display()
            ),
        ));
    }
    readable_file(flag, &path)?;
    Ok((path.clone(), path))
}

/// `--kv-default-chat-template-kwargs`: a JSON object, or nothing.
fn template_kwargs(
    raw: Option<&str>,
) -> Result<serde_json::Map<String, serde_json::Value>, ConfigError> {
    const FLAG: &str = "--kv-default-chat-template-kwargs";
    match raw.map(serde_json::from_str::<serde_json::Value>) {
        None => Ok(serde_json::Map::new()),
        Some(Ok(serde_json::Value::Object(map))) => Ok(map),
        Some(Ok(other)) => Err(ConfigError::new(
            FLAG,
            format!("must be a JSON object like '{{\"enable_thinking\": false}}', got {other}"),
        )),
        Some(Err(e)) => Err(ConfigError::new(FLAG, format!("is not JSON: {e}"))),
    }
}

fn chat_template(path: Option<PathBuf>) -> Result<Option<PathBuf>, ConfigError> {
    if let Some(path) = &path {
        readable_file("--chat-template", path)?;
    }
    Ok(path)
}

/// `--event-log`: `nats` is the JetStream log on `--nats-server` with the default stream and
/// bounds; every other form is [`EventLogConfig`]'s (which takes its own `nats://…` URL too).
fn event_log(spec: &str, nats_server: &str) -> Result<EventLogConfig, ConfigError> {
    const FLAG: &str = "--event-log";
    let log = if spec.trim() == "nats" {
        EventLogConfig::Jetstream(JetStreamLogConfig::new(nats_server))
    } else {
        spec.parse()
            .map_err(|e: InvalidEventLogSpec| ConfigError::new(FLAG, e.to_string()))?
    };
    match &log {
        EventLogConfig::Memory => {}
        EventLogConfig::Jetstream(_) => Backend::Nats.require(FLAG, "nats")?,
        EventLogConfig::Sqlite(_) => Backend::Sql.require(FLAG, "sqlite")?,
        EventLogConfig::Postgres(_) => Backend::Sql.require(FLAG, "postgres")?,
    }
    if let EventLogConfig::Sqlite(SqliteLogConfig { path }) = &log {
        let parent = path.parent().filter(|dir| !dir.as_os_str().is_empty());
        if let Some(dir) = parent.filter(|dir| !dir.is_dir()) {
            return Err(ConfigError::new(
                FLAG,
                format!(
                    "names sqlite:{}, whose directory {} does not exist",
                    path.display(),
                    dir.display()
                ),
            ));
        }
    }
    Ok(log)
}

/// `--auto-tune`: what the shadow replay may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoTuneMode {
    /// No shadow replay.
    Off,
    /// Replay and publish the advice; never change the router.
    Advise,
    /// Replay, publish, and adopt what the replay shows is better.
    Apply,
}

/// `--auto-tune` and its window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AutoTuneConfig {
    pub mode: AutoTuneMode,
    pub window: Duration,
    pub interval: Duration,
    pub max_bytes: u64,
}

impl AutoTuneConfig {
    fn from_args(args: &ServerArgs) -> Result<Self, ConfigError> {
        let positive = |flag: &'static str, d: &HumanDuration| {
            if d.is_zero() {
                Err(ConfigError::new(flag, "must be positive"))
            } else {
                Ok(d.0)
            }
        };
        if args.auto_tune_memory.bytes() == 0 {
            return Err(ConfigError::new("--auto-tune-memory", "must be positive"));
        }
        Ok(Self {
            mode: args.auto_tune,
            window: positive("--auto-tune-window", &args.auto_tune_window)?,
            interval: positive("--auto-tune-interval", &args.auto_tune_interval)?,
            max_bytes: args.auto_tune_memory.bytes(),
        })
    }
}

fn record_trace(
    dir: Option<PathBuf>,
    prompts: bool,
    segment_bytes: ByteSize,
    segment_age: HumanDuration,
) -> Result<Option<TraceRecordingConfig>, ConfigError> {
    match dir {
        None if prompts => Err(ConfigError::new(
            "--record-prompts",
            "needs --record-trace DIR (prompts are recorded into the trace)",
        )),
        None => Ok(None),
        Some(dir) if dir.exists() && !dir.is_dir() => Err(ConfigError::new(
            "--record-trace",
            format!(
                "names {}, which exists and is not a directory",
                dir.display()
            ),
        )),
        Some(_) if segment_bytes.bytes() == 0 => Err(ConfigError::new(
            "--record-segment-bytes",
            "must be positive",
        )),
        Some(_) if segment_age.is_zero() => {
            Err(ConfigError::new("--record-segment-age", "must be positive"))
        }
        Some(dir) => Ok(Some(TraceRecordingConfig {
            dir,
            prompts,
            segment_bytes,
            segment_age,
        })),
    }
}

/// A credit between 0 and 1, when given.
fn unit_weight(flag: &'static str, value: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match value {
        Some(w) if !(0.0..=1.0).contains(&w) => Err(ConfigError::new(
            flag,
            format!(
                "must be between 0 and 1 (got {w}): a lower tier's hit is worth at most a GPU hit"
            ),
        )),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests;
