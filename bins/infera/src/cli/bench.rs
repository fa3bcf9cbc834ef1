//! Flags of `infera bench`: play a trace against a live OpenAI endpoint on the trace's timeline
//! (session turns after their predecessors' answers).
//!
//! Only the shape of the command line lives here; `crate::bench` checks the values and runs it.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// `--api` values: which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Api {
    /// `POST /v1/completions` with the prompt as token ids (exact prefix sharing).
    Completions,
    /// `POST /v1/chat/completions` with the prompt as one user message of text.
    Chat,
}

/// Arguments of `infera bench`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Example: infera bench fixtures/traces/mooncake_trace_1000.jsonl \
    --target http://127.0.0.1:8000 --model mock --speedup 10 --max-concurrency 256 \
    --out live.parquet"
)]
pub struct BenchArgs {
    /// Trace to play: `.parquet` (Infera's trace schema), Mooncake `.jsonl`, Azure `.csv`, or a
    /// directory of recorded Parquet segments.
    pub trace: PathBuf,

    /// Base URL of the OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000 (a trailing /v1
    /// is accepted).
    #[arg(long, value_name = "URL")]
    pub target: String,

    /// Endpoint to call: completions sends token ids, chat sends text.
    #[arg(long, value_enum, default_value = "completions")]
    pub api: Api,

    /// Model name sent with every request [default: each trace row's model].
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,

    /// Play the trace this many times faster (arrival offsets and think times are divided by it).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub speedup: f64,

    /// How requests are released: a session's turn after its predecessor's answer plus its
    /// think time (rows with `think_time_us`, as `infera trace synth` writes), or every request
    /// at its recorded arrival.
    #[arg(long, value_enum, default_value = "sessions")]
    pub playback: crate::cli::replay::PlaybackArg,

    /// Most requests in flight at once; later ones wait for a slot, in arrival order, and are
    /// counted [default: unbounded, pure open loop].
    #[arg(long, value_name = "N")]
    pub max_concurrency: Option<usize>,

    /// Send only the requests scheduled in the first SECONDS of the (sped-up) run; in-flight
    /// requests still finish.
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Send only the first N requests of the trace.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,

    /// Generate this many tokens per request [default: each trace row's output length].
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u32>,

    /// Do not send `ignore_eos: true` (sent by default so that engines generate exactly
    /// max_tokens, as the trace did).
    #[arg(long)]
    pub no_ignore_eos: bool,

    /// Give up on a request after this many seconds (counted as a transport error).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    pub timeout: f64,

    /// Seed for spreading arrivals within Mooncake's timestamp buckets (as `infera replay`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Keep Mooncake's ~3 s timestamp buckets instead of spreading arrivals within them.
    #[arg(long)]
    pub no_spread: bool,

    /// Tokens per block of the trace's hash ids, as `infera trace import --trace-block-size`
    /// [default: the format's].
    #[arg(long, value_name = "TOKENS")]
    pub trace_block_size: Option<u32>,

    /// Print the summary as one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Write per-request rows (the columns of `infera replay --out`) to this Parquet file and a
    /// summary to FILE.summary.parquet.
    #[arg(long, value_name = "FILE.parquet")]
    pub out: Option<PathBuf>,
}
