//! The mock's Prometheus metrics: `prometheus_client` counters, gauges and histograms written by
//! the engine loop and the handlers, in one registry per mock engine, rendered on
//! `GET /metrics` as the server renders its own ([`infera_core::service::metrics::text::render`]).
//!
//! Names follow vLLM's (`vllm:` prefix, the same meanings) so that dashboards and the launcher's
//! block-size probe (`vllm:cache_config_info{block_size=…}`) work against the mock unchanged;
//! what only the mock has is under `infera_mock_`. Every series but `vllm:cache_config_info`
//! carries one label, `model_name`, as vLLM's do.

use infera_core::engine::EngineModel;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Upper bounds (seconds) of `vllm:time_to_first_token_seconds`, as vLLM has them.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// The families of one mock engine, and the registry that renders them.
#[derive(Debug)]
pub(crate) struct MockMetrics {
    registry: Registry,
    /// Requests accepted and handed to the engine.
    pub requests: Counter,
    /// Requests that left the engine (finished or rejected).
    pub finished: Counter,
    /// Requests whose client went away before they finished (aborted in the engine).
    pub detached: Counter,
    /// Requests answered with an error status (4xx/5xx).
    pub http_errors: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    /// Prompt tokens looked up in the prefix cache (at first admission).
    pub prefix_queries: Counter,
    /// Prompt tokens found in the prefix cache (`cached_tokens`).
    pub prefix_hits: Counter,
    pub running: Gauge,
    pub waiting: Gauge,
    /// KV-cache utilisation in [0, 1].
    pub kv_usage: Gauge<f64, AtomicU64>,
    pub resident_blocks: Gauge,
    pub kv_batches: Counter,
    pub kv_events: Counter,
    /// Stored blocks left out of events for want of their token ids (a bug if ever non-zero).
    pub kv_missing_tokens: Counter,
    /// 1 once the kv-event sink closed (events are no longer published).
    pub kv_sink_closed: Gauge,
    /// From the handler's start (body read) to the first token published to its response.
    pub ttft: Histogram,
    /// How much later than the model said they end the steps' results were published.
    pub step_lateness: Histogram,
    /// Prompt tokens of `cached_tokens` that came from the block store (kvd), not the GPU.
    pub kvd_hit_tokens: Counter,
    /// Blocks the block store answered for at admission (leading, with the expected bytes).
    pub kvd_loaded_blocks: Counter,
    /// Blocks saved to the block store (accepted by it).
    pub kvd_saved_blocks: Counter,
    /// Block-store calls that failed or timed out (the request went on without the store).
    pub kvd_errors: Counter,
}

impl MockMetrics {
    /// The families of the mock engine serving `model_name`, registered with `info`'s facts
    /// (help texts end without a period: the encoder adds one; counter names without `_total`:
    /// the encoder adds it).
    pub(crate) fn new(model_name: &str, info: &StaticInfo) -> Self {
        let mut m = MockMetrics {
            registry: Registry::default(),
            requests: Counter::default(),
            finished: Counter::default(),
            detached: Counter::default(),
            http_errors: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            resident_blocks: Gauge::default(),
            kv_batches: Counter::default(),
            kv_events: Counter::default(),
            kv_missing_tokens: Counter::default(),
            kv_sink_closed: Gauge::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            // Sum and count only (the `+Inf` bucket is the count): prometheus_client has no
            // summary type.
            step_lateness: Histogram::new([]),
            kvd_hit_tokens: Counter::default(),
            kvd_loaded_blocks: Counter::default(),
            kvd_saved_blocks: Counter::default(),
            kvd_errors: Counter::default(),
        };
        m.registry = m.registered(model_name, info);
        m
    }

    /// A registry holding every family of `self`: `vllm:cache_config_info` with the cache
    /// config's labels only, as vLLM's, and the rest under the `model_name` label.
    fn registered(&self, model_name: &str, info: &StaticInfo) -> Registry {
        let mut root = Registry::default();
        root.register(
            "vllm:cache_config",
            "Information of the LLMEngine CacheConfig",
            Info::new([
                ("block_size", info.block_size.to_string()),
                ("enable_prefix_caching", "True".to_owned()),
                ("num_gpu_blocks", info.gpu_blocks.to_string()),
            ]),
        );
        let r = root.sub_registry_with_label(("model_name".into(), model_name.to_owned().into()));
        let gauges: [(&str, &str, &Gauge); 4] = [
            (
                "vllm:num_requests_running",
                "Requests in the running batch",
                &self.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting to be admitted",
                &self.waiting,
            ),
            (
                "infera_mock_resident_blocks",
                "Published blocks resident in the simulated GPU cache",
                &self.resident_blocks,
            ),
            (
                "infera_mock_kv_sink_closed",
                "1 when the kv-event sink closed and events are no longer published",
                &self.kv_sink_closed,
            ),
        ];
        for (name, help, gauge) in gauges {
            r.register(name, help, gauge.clone());
        }
        r.register(
            "infera_mock_tokenizer_loaded",
            "1 when prompts are tokenized with the model's tokenizer, 0 for the byte fallback",
            ConstGauge::new(i64::from(info.tokenizer_loaded)),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage (1 = full)",
            self.kv_usage.clone(),
        );
        r.register(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage (1 = full); older name",
            self.kv_usage.clone(),
        );
        let counters: [(&str, &str, &Counter); 15] = [
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                &self.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens served from the prefix cache",
                &self.prefix_hits,
            ),
            (
                "vllm:prompt_tokens",
                "Prompt tokens of accepted requests",
                &self.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Tokens generated",
                &self.generation_tokens,
            ),
            (
                "vllm:request_success",
                "Requests that left the engine",
                &self.finished,
            ),
            (
                "infera_mock_requests",
                "Requests accepted by the mock engine",
                &self.requests,
            ),
            (
                "infera_mock_requests_detached",
                "Requests whose client disconnected before the end (aborted in the engine)",
                &self.detached,
            ),
            (
                "infera_mock_http_errors",
                "Requests answered with an error status",
                &self.http_errors,
            ),
            (
                "infera_mock_kv_event_batches",
                "KV-event batches handed to the sink",
                &self.kv_batches,
            ),
            (
                "infera_mock_kv_events",
                "KV events handed to the sink",
                &self.kv_events,
            ),
            (
                "infera_mock_kv_events_missing_tokens",
                "Stored blocks left out of events for want of their token ids",
                &self.kv_missing_tokens,
            ),
            (
                "infera_mock_kvd_hit_tokens",
                "Prompt tokens of cached_tokens served from kvd, not from the GPU prefix cache",
                &self.kvd_hit_tokens,
            ),
            (
                "infera_mock_kvd_loaded_blocks",
                "Blocks kvd held, read at admission",
                &self.kvd_loaded_blocks,
            ),
            (
                "infera_mock_kvd_saved_blocks",
                "Blocks saved to kvd and accepted by it",
                &self.kvd_saved_blocks,
            ),
            (
                "infera_mock_kvd_errors",
                "kvd calls that failed or timed out (the request went on without kvd)",
                &self.kvd_errors,
            ),
        ];
        for (name, help, counter) in counters {
            r.register(name, help, counter.clone());
        }
        r.register(
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first token",
            self.ttft.clone(),
        );
        r.register(
            "infera_mock_step_lateness_seconds",
            "How much later than the model's step end each step's results were published (timer \
             precision and CPU contention)",
            self.step_lateness.clone(),
        );
        root
    }

    /// Copies the model's gauges (called by the engine loop after every step).
    pub(crate) fn observe_engine(&self, model: &EngineModel) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.running.set(count(model.running()));
        self.waiting.set(count(model.waiting()));
        self.kv_usage.set(model.utilisation());
        self.resident_blocks.set(count(model.resident_blocks()));
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        infera_core::service::metrics::text::render(&self.registry)
    }
}

/// Facts fixed at startup that `/metrics` reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StaticInfo {
    pub block_size: u32,
    pub gpu_blocks: usize,
    pub tokenizer_loaded: bool,
}
