//! The mock's Prometheus metrics: plain atomics written by the engine loop and the handlers,
//! rendered as text on `GET /metrics`.
//!
//! Names follow vLLM's (`vllm:` prefix, the same meanings) so that dashboards and the launcher's
//! block-size probe (`vllm:cache_config_info{block_size=…}`) work against the mock unchanged;
//! what only the mock has is under `infera_mock_`. Every series carries one label,
//! `model_name`, as vLLM's do.

use infera_core::engine::EngineModel;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters and gauges of one mock engine.
#[derive(Debug, Default)]
pub(crate) struct MockMetrics {
    /// Requests accepted and handed to the engine.
    pub requests: AtomicU64,
    /// Requests that left the engine (finished or rejected).
    pub finished: AtomicU64,
    /// Requests whose client went away before they finished (aborted in the engine).
    pub detached: AtomicU64,
    /// Requests answered with an error status (4xx/5xx).
    pub http_errors: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (at first admission).
    pub prefix_queries: AtomicU64,
    /// Prompt tokens found in the prefix cache (`cached_tokens`).
    pub prefix_hits: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// KV-cache utilisation in [0, 1], as `f64` bits.
    pub kv_usage_bits: AtomicU64,
    pub resident_blocks: AtomicU64,
    pub kv_batches: AtomicU64,
    pub kv_events: AtomicU64,
    /// Stored blocks left out of events for want of their token ids (a bug if ever non-zero).
    pub kv_missing_tokens: AtomicU64,
    /// 1 once the kv-event sink closed (events are no longer published).
    pub kv_sink_closed: AtomicU64,
    /// From the handler's start (body read) to the first token published to its response.
    pub ttft: Histogram,
    /// Steps whose results were published, and by how much later than the model said they end.
    pub steps: AtomicU64,
    pub step_late_us: AtomicU64,
}

/// Upper bounds (seconds) of `vllm:time_to_first_token_seconds`, as vLLM has them.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// A fixed-bucket Prometheus histogram of durations, in plain atomics (microsecond sum).
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    /// Observations per bucket of [`TTFT_BUCKETS`] (not cumulative); the last slot is `+Inf`.
    buckets: [AtomicU64; TTFT_BUCKETS.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe_us(&self, us: u64) {
        let secs = us as f64 / 1e6;
        let slot = TTFT_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(TTFT_BUCKETS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, slot) in self.buckets.iter().enumerate() {
            cumulative += slot.load(Ordering::Relaxed);
            let le = TTFT_BUCKETS
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{label}}} {sum}");
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_count{{{label}}} {count}");
    }
}

impl MockMetrics {
    /// Copies the model's gauges (called by the engine loop after every step).
    pub(crate) fn observe_engine(&self, model: &EngineModel) {
        self.running
            .store(model.running() as u64, Ordering::Relaxed);
        self.waiting
            .store(model.waiting() as u64, Ordering::Relaxed);
        self.kv_usage_bits
            .store(model.utilisation().to_bits(), Ordering::Relaxed);
        self.resident_blocks
            .store(model.resident_blocks() as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self, model_name: &str, static_info: &StaticInfo) -> String {
        let label = format!("model_name=\"{}\"", escape_label(model_name));
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::with_capacity(4096);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{{label}}} {value}");
        };
        let usage = f64::from_bits(get(&self.kv_usage_bits));
        let rows: [(&str, &str, &str, String); 16] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests in the running batch.",
                get(&self.running).to_string(),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests waiting to be admitted.",
                get(&self.waiting).to_string(),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage (1 = full).",
                usage.to_string(),
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "KV-cache usage (1 = full); older name.",
                usage.to_string(),
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                get(&self.prefix_queries).to_string(),
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                get(&self.prefix_hits).to_string(),
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                get(&self.prompt_tokens).to_string(),
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Tokens generated.",
                get(&self.generation_tokens).to_string(),
            ),
            (
                "vllm:request_success_total",
                "counter",
                "Requests that left the engine.",
                get(&self.finished).to_string(),
            ),
            (
                "infera_mock_requests_total",
                "counter",
                "Requests accepted by the mock engine.",
                get(&self.requests).to_string(),
            ),
            (
                "infera_mock_requests_detached_total",
                "counter",
                "Requests whose client disconnected before the end (aborted in the engine).",
                get(&self.detached).to_string(),
            ),
            (
                "infera_mock_http_errors_total",
                "counter",
                "Requests answered with an error status.",
                get(&self.http_errors).to_string(),
            ),
            (
                "infera_mock_resident_blocks",
                "gauge",
                "Published blocks resident in the simulated GPU cache.",
                get(&self.resident_blocks).to_string(),
            ),
            (
                "infera_mock_kv_event_batches_total",
                "counter",
                "KV-event batches handed to the sink.",
                get(&self.kv_batches).to_string(),
            ),
            (
                "infera_mock_kv_events_total",
                "counter",
                "KV events handed to the sink.",
                get(&self.kv_events).to_string(),
            ),
            (
                "infera_mock_kv_sink_closed",
                "gauge",
                "1 when the kv-event sink closed and events are no longer published.",
                get(&self.kv_sink_closed).to_string(),
            ),
        ];
        for (name, kind, help, value) in rows {
            metric(name, kind, help, value);
        }
        metric(
            "infera_mock_kv_events_missing_tokens_total",
            "counter",
            "Stored blocks left out of events for want of their token ids.",
            get(&self.kv_missing_tokens).to_string(),
        );
        metric(
            "infera_mock_tokenizer_loaded",
            "gauge",
            "1 when prompts are tokenized with the model's tokenizer, 0 for the byte fallback.",
            u8::from(static_info.tokenizer_loaded).to_string(),
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            &label,
        );
        let _ = writeln!(
            out,
            "# HELP infera_mock_step_lateness_seconds How much later than the model's step end \
             each step's results were published (timer precision and CPU contention).\n\
             # TYPE infera_mock_step_lateness_seconds summary\n\
             infera_mock_step_lateness_seconds_sum{{{label}}} {}\n\
             infera_mock_step_lateness_seconds_count{{{label}}} {}",
            get(&self.step_late_us) as f64 / 1e6,
            get(&self.steps),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",\
             num_gpu_blocks=\"{}\"}} 1.0",
            static_info.block_size, static_info.gpu_blocks
        );
        out
    }
}

/// Facts fixed at startup that `/metrics` reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StaticInfo {
    pub block_size: u32,
    pub gpu_blocks: usize,
    pub tokenizer_loaded: bool,
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
