//! Flags of `infera replay`; `crate::replay_cmd` runs them.

use clap::{Args, Subcommand, ValueEnum};
use infera_core::policy::{AffinityMode, PolicyKind};
use infera_replay::shard::Shard;
use infera_replay::sim::DEFAULT_FRONTEND_US;
use std::path::PathBuf;

/// `--playback` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PlaybackArg {
    /// Session turns that carry a think time (`infera trace synth` writes them) leave when
    /// their predecessor finished plus that time; every other request at its recorded arrival.
    Sessions,
    /// Every request at its recorded arrival (open loop).
    Timeline,
}

/// Arguments of `infera replay`.
#[derive(Debug, Args)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Example: infera replay fixtures/traces/conversation_trace.parquet \
    --kv-prefill-overlap-weight 20 --sweep kv-overlap-weight=0,1,4,16 --out results.parquet"
)]
pub struct ReplayArgs {
    #[command(subcommand)]
    pub command: Option<ReplayCommand>,

    /// Trace to replay: `.parquet`, Mooncake `.jsonl`, Azure `.csv`, or a directory of recorded
    /// Parquet segments.
    #[arg(required = true)]
    pub trace: Option<PathBuf>,

    /// Routing policy, as `infera server --router-policy`.
    #[arg(long, value_parser = super::policy_parser(), default_value_t)]
    pub router_policy: PolicyKind,
    /// The defaults of the router's tunables not given, as `infera server --router-profile`.
    #[arg(long, value_enum, default_value = "python")]
    pub router_profile: crate::config::RouterProfile,
    /// KV-aware: cache locality vs load balance, as `infera server`. [default: 1.0] (16 with
    /// --router-profile infera)
    #[arg(long)]
    pub kv_overlap_weight: Option<f64>,
    /// KV-aware PD: prefill-side weight. Without --prefill-workers/--decode-workers, a PD fleet is
    /// simulated with a quarter of --workers as prefill workers.
    #[arg(long)]
    pub kv_prefill_overlap_weight: Option<f64>,
    /// KV-aware PD: decode-side weight (same default split as above).
    #[arg(long)]
    pub kv_decode_overlap_weight: Option<f64>,
    /// 0: cheapest worker wins; above 0: softmax over normalised costs (Infera extension).
    #[arg(long, default_value_t = 0.0)]
    pub router_temperature: f64,
    /// Load per block of the other conversations resident on a worker between their turns, as
    /// `infera server` (Infera extension).
    #[arg(long, default_value_t = 0.0)]
    pub router_resident_weight: f64,
    /// Tokens to prefill that each recent pick a worker took above the fleet's mean costs it,
    /// as `infera server` (Infera extension). [default: 0] (512 with --router-profile infera)
    #[arg(long)]
    pub router_balance_tokens: Option<u32>,
    /// What a prompt block in a worker's kvd host RAM (--host-blocks) is worth against a GPU
    /// hit, 0 to 1, as `infera server` (Infera extension). [default: measured: 1 − the engine
    /// model's load time over its prefill time]
    #[arg(long, value_name = "W")]
    pub router_host_cache_hit_weight: Option<f64>,
    /// The same for a block on the kvd's disk (--disk-blocks) (Infera extension). [default:
    /// measured]
    #[arg(long, value_name = "W")]
    pub router_disk_cache_hit_weight: Option<f64>,
    /// How a trace's sessions keep to their workers, as `infera server`: tie-break, override
    /// or off (Infera extension).
    #[arg(long, default_value = "tie-break", value_name = "MODE")]
    pub router_session_affinity: AffinityMode,
    /// How long after its last request a session stays with its worker, in seconds, as
    /// `infera server` (Infera extension).
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub router_session_ttl: u64,
    /// The router's queue, as `infera server`: while every worker has this many prefill
    /// budgets (--max-batched-tokens) of prompt tokens routed and not yet prefilled, requests
    /// wait in the router and leave by weighted fair share between the trace's tenants
    /// (`tenant` column); `off` never queues (Infera extension).
    #[arg(long, default_value = "4", value_name = "BUDGETS", value_parser = super::server::queue_threshold)]
    pub router_queue_threshold: super::server::QueueThreshold,
    /// A tenant's weight in the router's queue, as its `weight` in `--api-keys`: NAME=WEIGHT,
    /// repeatable; else the key file's, else 1 (Infera extension).
    #[arg(long = "tenant-weight", value_name = "NAME=WEIGHT", value_parser = tenant_weight)]
    pub tenant_weights: Vec<(String, u32)>,
    /// The server's key file (as `infera server --api-keys`): each trace tenant named in it is
    /// held to its limits (a refused request is answered 429 at once and counted per tenant)
    /// and queued at its weight, each request at the priority it asked for (the trace's
    /// `priority` column) within the tenant's floor, else the tenant's default; --tenant-weight
    /// overrides its weights (Infera extension).
    #[arg(long, value_name = "FILE")]
    pub api_keys: Option<PathBuf>,
    /// Scale a tenant's traffic before the replay: NAME=FACTOR, repeatable. Above 1 each of its
    /// requests gets copies spread until its next request, each copy a new prompt of the same
    /// shape (sharing its prefixes with the other copies of its rank, not with the original),
    /// its sessions new sessions; below 1 a deterministic share of its requests is kept
    /// (Infera extension: "what does B's TTFT become if A doubles").
    #[arg(long = "tenant-scale", value_name = "NAME=FACTOR", value_parser = tenant_scale)]
    pub tenant_scales: Vec<(String, f64)>,

    /// Mixed (non-PD) workers in the simulated fleet.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Prefill workers of a PD fleet (with --decode-workers).
    #[arg(long, requires = "decode_workers")]
    pub prefill_workers: Option<usize>,
    /// Decode workers of a PD fleet (with --prefill-workers).
    #[arg(long, requires = "prefill_workers")]
    pub decode_workers: Option<usize>,
    /// GPU KV-cache capacity per worker, in blocks [default: 1,048,576 tokens' worth at the block size]
    #[arg(long)]
    pub gpu_blocks: Option<usize>,
    /// Simulated kvd host-RAM (L2) tier per worker, in blocks (0 = none).
    #[arg(long, default_value_t = 0)]
    pub host_blocks: u64,
    /// Simulated kvd NVMe (L3) tier per worker, in blocks (0 = none).
    #[arg(long, default_value_t = 0)]
    pub disk_blocks: u64,
    /// Tokens per KV block [default: the trace's]
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Engine per-step token budget.
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: u32,
    /// Engine maximum running sequences.
    #[arg(long, default_value_t = 256)]
    pub max_seqs: u32,
    /// Prefill time model, ms = A·t² + B·t + C for t new prompt tokens in a step.
    #[arg(long, value_name = "A,B,C", default_value = "4.21e-7,0.01518,16.5")]
    pub prefill_coeffs: String,
    /// Decode step time model, ms = A·u² + B·u + C for KV-cache utilisation u in 0..1.
    #[arg(long, value_name = "A,B,C", default_value = "-25.74,54.01,5.74")]
    pub decode_coeffs: String,
    /// Cost of loading one block from the host/disk tiers into the GPU.
    #[arg(long, default_value_t = 0.02)]
    pub load_ms_per_block: f64,
    /// Play the trace this many times faster (arrival and think times are divided by it).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// How requests are released: a session's turn after its predecessor's answer plus its
    /// think time, or every request at its recorded arrival.
    #[arg(long, value_enum, default_value = "sessions")]
    pub playback: PlaybackArg,
    /// Seed for tie-breaking, sampling and arrival spreading.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Delay between an engine storing blocks and the router seeing the KV event.
    #[arg(long, default_value_t = 1.0)]
    pub kv_event_delay_ms: f64,
    /// Front-end cost of every request, in wall time (not divided by --speedup): the client's
    /// request through the router to its engine (HTTP, parsing, hashing, routing) and the first
    /// token's way back. Added to every request's TTFT and finish time; the engines and the
    /// routing are not affected. The default was measured through `infera up` on loopback
    /// (docs/benchmarks.md: the fidelity bench); 0 reports the engines alone.
    #[arg(long, default_value_t = DEFAULT_FRONTEND_US as f64 / 1000.0)]
    pub frontend_ms: f64,
    /// Model a router that ignores adapters (`lora`), cache salts (`cache_salt`) and images
    /// (`images`), as routers did before they keyed blocks by identity: it predicts hits on
    /// blocks the engines keyed under another adapter, salt or image (the table's "false hits"
    /// column shows how many).
    #[arg(long)]
    pub identity_blind: bool,
    /// Retention class rule COND:CLASS[:ttl=SECONDS], first match wins, e.g.
    /// 'input_length<2048:short' or '*:long:ttl=600' (repeatable; the trace's own column wins).
    #[arg(long = "retention-rule", value_name = "RULE")]
    pub retention_rules: Vec<String>,
    /// Sweep an option over values, KEY=V1,V2,... (repeatable: a grid), e.g.
    /// kv-overlap-weight=0,0.5,1,2,4,8,16,32.
    #[arg(long = "sweep", value_name = "KEY=V1,V2,...")]
    pub sweeps: Vec<String>,
    /// Search the router's tunables and print the Pareto front of hit rate, TTFT p50 and balance
    /// with the flags to use. Searches the --sweep axes when given [default: kv-overlap-weight
    /// (the prefill weight on a PD fleet) 0..32 against router-resident-weight 0, 0.5, 1 and
    /// router-balance-tokens 0, 256, 512, 1024]; with
    /// --plot, charts hit rate against balance with the recommended point marked.
    #[arg(long)]
    pub tune: bool,
    /// Worker threads for sweeps [default: all cores]
    #[arg(long)]
    pub threads: Option<usize>,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Keep Mooncake's ~3 s timestamp buckets instead of spreading arrivals within them.
    #[arg(long)]
    pub no_spread: bool,
    /// Tokens per block of the trace's hash ids, as `infera trace import --trace-block-size`
    /// [default: the format's]. The simulated engines' block size is --block-size.
    #[arg(long, value_name = "TOKENS")]
    pub trace_block_size: Option<u32>,
    /// Write per-request rows to this Parquet file and a summary to FILE.summary.parquet.
    #[arg(long, value_name = "FILE.parquet")]
    pub out: Option<PathBuf>,
    /// Chart each metric (hit rate, TTFT p50 and p99, TPOT, tokens/s, imbalance) against the
    /// swept value, one line per value of the other --sweep (.svg or .png); with --tune, the
    /// Pareto front.
    #[arg(long, value_name = "FILE.svg|FILE.png")]
    pub plot: Option<PathBuf>,
    /// Run slice I of N (from 0) of the --sweep or --tune grid, every Nth configuration from
    /// the Ith, and write it to --out; `infera replay merge` joins the N slices' files into the
    /// table, front and files one unsharded run gives. For sweeps that outgrow one machine: a
    /// Kubernetes Indexed Job runs the N slices (bins/deploy/kubernetes/replay-sweep).
    #[arg(long, value_name = "I/N", requires = "out", conflicts_with = "plot")]
    pub shard: Option<Shard>,
}

/// Subcommands of `infera replay`.
#[derive(Debug, Subcommand)]
pub enum ReplayCommand {
    /// Join the --out files of `infera replay --shard I/N` slices: prints the table (and with
    /// --tune the Pareto front) of the whole sweep and writes its files, as one unsharded run.
    Merge(MergeArgs),
}

/// Arguments of `infera replay merge`.
#[derive(Debug, Args)]
#[command(after_help = "Example: infera replay merge --out sweep.parquet slices/")]
pub struct MergeArgs {
    /// The slices' --out files (FILE.parquet, with FILE.summary.parquet beside it) or folders
    /// holding them.
    #[arg(required = true, value_name = "SLICE")]
    pub slices: Vec<PathBuf>,
    /// Write the whole sweep's per-request rows to this Parquet file and its summary to
    /// FILE.summary.parquet, as `infera replay --out`.
    #[arg(long, value_name = "FILE.parquet")]
    pub out: Option<PathBuf>,
    /// Chart the whole sweep, as `infera replay --plot` (.svg or .png).
    #[arg(long, value_name = "FILE.svg|FILE.png")]
    pub plot: Option<PathBuf>,
}

/// `--tenant-weight NAME=WEIGHT`.
fn tenant_weight(text: &str) -> Result<(String, u32), String> {
    let (name, weight) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not NAME=WEIGHT"))?;
    match weight.parse::<u32>() {
        Ok(w) if w > 0 && !name.is_empty() => Ok((name.to_owned(), w)),
        _ => Err(format!(
            "`{text}`: the weight is a whole number of at least 1"
        )),
    }
}

/// `--tenant-scale NAME=FACTOR`.
fn tenant_scale(text: &str) -> Result<(String, f64), String> {
    let (name, factor) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not NAME=FACTOR"))?;
    match factor.parse::<f64>() {
        Ok(f) if (0.0..=100.0).contains(&f) && !name.is_empty() => Ok((name.to_owned(), f)),
        _ => Err(format!("`{text}`: the factor is a number from 0 to 100")),
    }
}
