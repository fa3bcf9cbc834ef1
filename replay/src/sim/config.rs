//! The simulator's inputs and outputs: [`SimConfig`] (the fleet, the router, the engines and
//! the time scale), [`SimResult`] with one [`RequestOutcome`] per request, and [`SimError`].

use super::Playback;
use super::tiers::TierConfig;
use crate::rules::RetentionRule;
use infera_core::engine::EngineConfig;
use infera_core::event::Retention;
use infera_core::fleet::FleetConfig;
use infera_core::policy::RouterConfig;

/// The default PD split when a PD weight is given without pool sizes: a quarter prefill.
pub fn default_pd_split(workers: usize) -> (usize, usize) {
    let prefill = (workers / 4).max(1);
    (prefill, workers.saturating_sub(prefill).max(1))
}

/// The simulated fleet and router.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimConfig {
    pub router: RouterConfig,
    /// Mixed workers (ignored when `pd` is set).
    pub workers: usize,
    /// Prefill and decode pool sizes for a disaggregated fleet.
    pub pd: Option<(usize, usize)>,
    /// Per engine; `block_size` 0 means "the trace's".
    pub engine: EngineConfig,
    pub tiers: TierConfig,
    /// Retention rules for requests whose trace row has no class.
    #[serde(skip)]
    pub rules: Vec<RetentionRule>,
    /// Arrival times are divided by this (2 = replay the trace twice as fast).
    pub speedup: f64,
    /// Delay between an engine step storing blocks and the router seeing the event.
    pub kv_event_delay_us: u64,
    /// The serving front end's cost per request, in wall time (not divided by `speedup`): the
    /// client's request through the router (HTTP, parsing, hashing, routing) to its engine plus
    /// the first token's way back. The engines start each request the instant it arrives and
    /// reach its first token at the end of its prefill step; a real fleet's clients wait for
    /// these hops too, and at 5× compression the same hop is five times larger a share of a
    /// step. The hops are the same for every request, so they shift a request's whole timeline
    /// at the engine (and the router's decision with it) without changing what the engines do:
    /// they are added to each request's `ttft_us` and `finish_us` (and so `queue_us`, `tpot_us`,
    /// routing, hits and [`SimResult::makespan_us`] do not include them).
    pub frontend_us: u64,
    pub fleet: FleetConfig,
    /// Simulate quiet decode steps one by one instead of as one event (same results, slower;
    /// the tests use it to prove that).
    pub step_by_step: bool,
    /// Whether session turns wait for their predecessor ([`Playback`]).
    pub playback: Playback,
    /// Model a router that ignores the requests' adapters, salts and images (as routers did before they
    /// keyed blocks by identity): it hashes and indexes blocks by their tokens alone while the
    /// engines key them by identity, so it predicts hits the engines cannot give.
    pub identity_blind: bool,
    /// The router's queue, as `infera server --router-queue-threshold`: while every worker of
    /// a request's model has this many prefill budgets of prompt tokens routed and not yet
    /// prefilled, requests wait in the router, leaving by weighted fair share between the
    /// trace's tenants (`tenant` column); `None` never queues.
    pub queue_threshold: Option<f64>,
    /// Each tenant's weight in the queue, over the key file's; else the key file's, else 1.
    pub tenant_weights: Vec<(String, u32)>,
    /// The server's key file (`--api-keys`), as text: each trace tenant named in it is held
    /// to its limits and queued at its priority and weight.
    pub api_keys: Option<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            workers: 8,
            pd: None,
            engine: EngineConfig {
                block_size: 0,
                ..EngineConfig::default()
            },
            tiers: TierConfig::default(),
            rules: Vec::new(),
            speedup: 1.0,
            kv_event_delay_us: 1_000,
            frontend_us: DEFAULT_FRONTEND_US,
            fleet: FleetConfig::default(),
            step_by_step: false,
            playback: Playback::default(),
            identity_blind: false,
            queue_threshold: Some(4.0),
            tenant_weights: Vec::new(),
            api_keys: None,
        }
    }
}

/// The default of [`SimConfig::frontend_us`]: what `infera up` (the server and four mock engines
/// in one process, on loopback) costs a Mooncake request (~10k prompt tokens sent as token ids,
/// streamed back) on the 2-core development VM, shared with other builds. Measured by
/// `cargo bench -p infera --bench fidelity` (1,000 requests at `--speedup 5`) as the clients' mean
/// TTFT minus the mocks' own mean TTFT (`vllm:time_to_first_token_seconds`, from the handler's
/// start to the first token), the median of three runs rounded (`docs/benchmarks.md`). It covers the request's way through the server to its engine and the first token's way
/// back, CPU contention with the fleet's own streaming included; a faster machine or a separate
/// router host changes it, so measure yours the same way and pass `--frontend-ms`.
pub const DEFAULT_FRONTEND_US: u64 = 1_400;

/// A configuration the simulator cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error("invalid simulation setting: {0}")]
    Invalid(String),
    #[error("the trace is empty")]
    EmptyTrace,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestOutcome {
    pub index: usize,
    pub request_id: String,
    pub arrival_us: u64,
    /// The worker that prefilled it (the only one outside PD).
    pub worker: String,
    /// The decode worker in PD mode.
    pub decode_worker: Option<String>,
    /// Prefix blocks the router believed the chosen worker held.
    pub overlap_blocks: u32,
    pub blocks: u32,
    pub gpu_hit_blocks: u32,
    pub host_hit_blocks: u32,
    pub disk_hit_blocks: u32,
    pub cached_tokens: u32,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Arrival to admission into a batch.
    pub queue_us: u64,
    pub ttft_us: u64,
    pub finish_us: u64,
    /// Mean time per output token after the first (0 with one output token).
    pub tpot_us: f64,
    pub retention: Option<Retention>,
    pub rejected: bool,
    /// The tenant's limit that refused it (429), if one did.
    pub limited: Option<&'static str>,
    /// The trace's tenant of the request.
    pub tenant: Option<String>,
    /// Time spent in the router's queue before routing.
    pub router_queue_us: u64,
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct SimResult {
    pub requests: Vec<RequestOutcome>,
    /// Worker names in fleet order (prefill pool first in PD mode).
    pub workers: Vec<String>,
    /// Per engine: (blocks stored, blocks resident, blocks removed).
    pub block_ledger: Vec<(u64, u64, u64)>,
    /// Events appended to the log.
    pub events: u64,
    /// Engine steps simulated, over all engines.
    pub steps: u64,
    /// Virtual time of the engines' last completion (without [`SimConfig::frontend_us`]).
    pub makespan_us: u64,
    pub block_size: u32,
}
