//! Flags of `infera trace` (import, inspect, synth); `crate::replay_cmd` runs them.

use clap::{Args, Subcommand};
use infera_replay::trace;
use std::path::PathBuf;

/// Arguments of `infera trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub cmd: TraceCmd,
}

#[derive(Debug, Subcommand)]
pub enum TraceCmd {
    /// Convert a Mooncake JSONL or Azure CSV trace (or a Parquet trace) to Infera's Parquet schema.
    Import {
        /// Source trace (.jsonl, .csv, .parquet or a directory of segments).
        input: PathBuf,
        /// Destination Parquet file (written atomically).
        output: PathBuf,
        #[command(flatten)]
        load: LoadArgs,
    },
    /// Generate a trace of agentic multi-turn sessions: turns that extend a growing prompt
    /// after a think time, shared tool definitions and system prompts.
    Synth(super::synth::SynthArgs),
    /// Summarise a trace: counts, span, rate, length percentiles, ideal hit rate.
    Inspect {
        /// Trace (.parquet, .jsonl, .csv or a directory of segments).
        input: PathBuf,
        #[command(flatten)]
        load: LoadArgs,
    },
}

#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Seed for spreading arrivals within Mooncake's timestamp buckets.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep the timestamp buckets as they are.
    #[arg(long)]
    pub no_spread: bool,
    /// Tokens per block of the trace's hash ids [default: the format's: Mooncake JSONL 512,
    /// Azure CSV 16 (the invented ids); a Parquet trace's own, which a value here must match].
    #[arg(long, alias = "azure-block-size", value_name = "TOKENS")]
    pub trace_block_size: Option<u32>,
    /// Model name for traces that carry none.
    #[arg(long, default_value = "default")]
    pub model: String,
}

impl LoadArgs {
    pub fn options(&self) -> trace::LoadOptions {
        trace::LoadOptions {
            seed: self.seed,
            spread_buckets: !self.no_spread,
            block_size: self.trace_block_size,
            model: self.model.clone(),
        }
    }
}
