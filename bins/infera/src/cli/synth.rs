//! Flags of `infera trace synth`: a trace of agentic multi-turn sessions generated from a seed.
//!
//! The model and the defaults are documented in `infera_replay::trace::synth`; this file holds the
//! command line and its one conversion to [`SynthConfig`].

use anyhow::{Context as _, bail};
use clap::Args;
use infera_replay::trace::synth::SynthConfig;
use std::path::PathBuf;

/// Arguments of `infera trace synth` (defaults: those of [`SynthConfig::default`]).
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Example: infera trace synth agentic.parquet --sessions 200 --concurrency 32 \
    --seed 1 && infera replay agentic.parquet --workers 4"
)]
pub struct SynthArgs {
    /// Destination Parquet file (written atomically).
    pub output: PathBuf,
    /// Seed: the same flags and seed always write the same trace.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sessions (conversations, agent tasks) in the trace.
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Mean number of sessions open at once; sessions start as a Poisson process at the rate
    /// that keeps about this many open.
    #[arg(long, default_value_t = 16.0)]
    pub concurrency: f64,
    /// Turns per session, uniform in MIN..MAX (inclusive).
    #[arg(long, value_name = "MIN..MAX", default_value = "5..35")]
    pub turns: String,
    /// Tool-definition tokens at the start of every prompt, shared by every session.
    #[arg(long, default_value_t = 6_000, value_name = "TOKENS")]
    pub tool_tokens: u32,
    /// Distinct system prompts after the tool definitions; each session uses one.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub system_prompts: u32,
    /// Tokens per system prompt.
    #[arg(long, default_value_t = 2_000, value_name = "TOKENS")]
    pub system_tokens: u32,
    /// Mean tokens of a session's first input (the task) and of a user turn (exponential).
    #[arg(long, default_value_t = 1_500, value_name = "TOKENS")]
    pub first_input_tokens: u32,
    /// Mean new tokens of a tool-call turn (the tool's result; exponential): the context
    /// growth per turn, with the previous answer.
    #[arg(long, default_value_t = 1_200, value_name = "TOKENS")]
    pub turn_input_tokens: u32,
    /// Mean answer tokens (exponential).
    #[arg(long, default_value_t = 250, value_name = "TOKENS")]
    pub output_tokens: u32,
    /// Share of later turns that are tool calls; the rest are user turns.
    #[arg(long, default_value_t = 0.85, value_name = "0..1")]
    pub tool_call_fraction: f64,
    /// Mean think time before a tool-call turn (the tool's run time; exponential).
    #[arg(long, default_value_t = 2_000.0, value_name = "MS")]
    pub tool_think_ms: f64,
    /// Mean think time before a user turn (exponential).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub user_think_s: f64,
    /// A session ends when its next prompt would be longer than this.
    #[arg(long, default_value_t = 128_000, value_name = "TOKENS")]
    pub max_context_tokens: u32,
    /// Tokens per block of the written block hashes.
    #[arg(long, default_value_t = 64, value_name = "TOKENS")]
    pub block_size: u32,
    /// Model name of every request (the base model, with --adapters).
    #[arg(long, default_value = "default")]
    pub model: String,
    /// LoRA adapters over the model (0: none): each session runs under one, chosen uniformly,
    /// with its own system prompt (replacing --system-prompts); the tool definitions are the
    /// same tokens under every adapter, which the engines (and the replay) key apart. Written
    /// in the `lora` column.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub adapters: u32,
    /// Distinct images (0: none): each session's prompt carries one, chosen uniformly, after
    /// the system prompt; its placeholder tokens are the same for every image, which the
    /// engines (and the replay) key apart. Written in the `images` column.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub images: u32,
    /// Placeholder tokens of each image (1,024: a 896 × 896 image for Qwen2-VL).
    #[arg(long, default_value_t = 1_024, value_name = "TOKENS")]
    pub image_tokens: u32,
}

impl SynthArgs {
    /// The generator's configuration (the only conversion from these flags).
    ///
    /// # Errors
    /// A `--turns` that is not `MIN..MAX`; every other range is checked by the generator.
    pub fn config(&self) -> anyhow::Result<SynthConfig> {
        let (min, max) = self
            .turns
            .split_once("..")
            .with_context(|| format!("--turns {:?}: expected MIN..MAX, e.g. 5..35", self.turns))?;
        let parse = |s: &str| {
            s.trim()
                .parse::<u32>()
                .with_context(|| format!("--turns {:?}: expected MIN..MAX, e.g. 5..35", self.turns))
        };
        let (min_turns, max_turns) = (parse(min)?, parse(max)?);
        if min_turns == 0 || min_turns > max_turns {
            bail!("--turns {}: expected 1 <= MIN <= MAX", self.turns);
        }
        let cfg = SynthConfig {
            seed: self.seed,
            sessions: self.sessions,
            concurrency: self.concurrency,
            min_turns,
            max_turns,
            tool_tokens: self.tool_tokens,
            system_prompts: self.system_prompts,
            system_tokens: self.system_tokens,
            first_input_tokens: self.first_input_tokens,
            turn_input_tokens: self.turn_input_tokens,
            output_tokens: self.output_tokens,
            tool_call_fraction: self.tool_call_fraction,
            tool_think_ms: self.tool_think_ms,
            user_think_s: self.user_think_s,
            max_context_tokens: self.max_context_tokens,
            block_size: self.block_size,
            model: self.model.clone(),
            adapters: self.adapters,
            images: self.images,
            image_tokens: self.image_tokens,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::trace::TraceCmd;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use infera_replay::trace::synth::SynthConfig;

    #[test]
    fn the_flags_defaults_are_the_generators() {
        let cli = Cli::try_parse_from(["infera", "trace", "synth", "x.parquet"]).unwrap();
        let Command::Trace(trace) = cli.command else {
            panic!("not trace");
        };
        let TraceCmd::Synth(synth) = trace.cmd else {
            panic!("not synth");
        };
        assert_eq!(synth.config().unwrap(), SynthConfig::default());
    }
}
