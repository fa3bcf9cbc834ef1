//! The engine simulation model: a paged GPU KV cache with prefix caching, a continuous-batching
//! scheduler and a step timing model, shared by `infera replay` (on a virtual clock) and the mock
//! engine (on the wall clock).
//!
//! The model emits the KV cache changes a real engine would publish ([`KvChange`]), so the router
//! can be fed by it exactly as by vLLM. It owns no clock: the caller calls [`EngineModel::step`] at
//! time `t` and schedules the next step at `t + duration_us`.
//!
//! # Submodules
//! - `cache`: the paged block cache (prefix reuse, leaf-first LRU eviction, anonymous blocks).
//! - `scheduler`: [`EngineModel`], the vLLM-like batch scheduler driving the cache.
//! - `timing`: [`TimingModel`], how long a step takes.
//!
//! # What a request looks like to the model
//! A [`SimRequest`] carries the router hashes of its prompt's complete blocks (chained, so a block
//! implies its prefix), its prompt length in tokens and how many tokens it will generate. Prompt
//! blocks with a hash are *published* blocks: allocating one emits [`KvChange::Stored`], evicting
//! one emits [`KvChange::Removed`]. Everything else a sequence holds — the trailing partial prompt
//! block and the blocks of generated tokens — is *anonymous*: it counts toward capacity and
//! utilisation, is freed when the sequence finishes, and is never published (an engine only
//! publishes full blocks of prompt tokens that other requests could reuse).
//!
//! # Outcomes
//! Every submitted request ends in exactly one [`Finished`]. A request whose largest footprint
//! (`ceil((prompt_tokens + max(output_tokens, 1) - 1) / block_size)` blocks) exceeds the whole
//! cache could never run; it is rejected at once, reported as `Finished { rejected: true,
//! output_tokens: 0 }` in the next step, and never blocks the queue behind it.

mod cache;
mod scheduler;
mod seq;
mod timing;

#[cfg(test)]
mod tests;

pub use scheduler::EngineModel;
pub use timing::TimingModel;

use crate::ids::BlockHash;
use serde::{Deserialize, Serialize};

/// Static parameters of one simulated engine (one data-parallel rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Capacity of the GPU KV cache, in blocks.
    pub gpu_blocks: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Per-step token budget (prefill tokens computed plus one per decoding sequence).
    pub max_batched_tokens: u32,
    /// Most sequences running at once.
    pub max_seqs: u32,
    pub timing: TimingModel,
    /// Every step duration is divided by this (2.0 = a twice faster GPU).
    pub speedup: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            gpu_blocks: 16_384,
            block_size: 16,
            max_batched_tokens: 8192,
            max_seqs: 256,
            timing: TimingModel::default(),
            speedup: 1.0,
        }
    }
}

impl EngineConfig {
    /// Prompt tokens per second it prefills at its step budget (what a worker registers as
    /// `prefill_tokens_per_s`); `None` for a step that takes no time.
    pub fn prefill_tokens_per_s(&self) -> Option<f64> {
        let budget = u64::from(self.max_batched_tokens.max(1));
        let step_ms = self.timing.prefill_ms(budget) / self.speedup;
        (step_ms > 0.0 && step_ms.is_finite()).then(|| budget as f64 * 1000.0 / step_ms)
    }

    /// Checks every field; the error names the first one that is wrong.
    ///
    /// # Errors
    /// [`EngineConfigError::Invalid`] for a zero size or budget, more blocks than the model can
    /// address, or a non-finite / non-positive `speedup` or timing coefficient. Not retryable: fix
    /// the configuration.
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        let bad = |field: &'static str, problem: String| {
            Err(EngineConfigError::Invalid { field, problem })
        };
        if self.gpu_blocks == 0 {
            return bad("gpu_blocks", "must be at least 1".into());
        }
        if self.gpu_blocks >= u32::MAX as usize {
            return bad(
                "gpu_blocks",
                format!("must be below {} (got {})", u32::MAX, self.gpu_blocks),
            );
        }
        if self.block_size == 0 {
            return bad("block_size", "must be at least 1".into());
        }
        if self.max_batched_tokens == 0 {
            return bad("max_batched_tokens", "must be at least 1".into());
        }
        if self.max_seqs == 0 {
            return bad("max_seqs", "must be at least 1".into());
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return bad(
                "speedup",
                format!("must be a finite number above 0 (got {})", self.speedup),
            );
        }
        self.timing.validate()
    }
}

/// An engine configuration that cannot be simulated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineConfigError {
    #[error("invalid engine config: {field} {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
}

/// One request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    /// Caller's id, echoed in [`Prefilled`] and [`Finished`]. Not checked for uniqueness.
    pub id: u64,
    /// Router hashes of the prompt's complete blocks, in order (chained prefix hashes).
    pub blocks: Vec<BlockHash>,
    /// Prompt length. Raised to `blocks.len() * block_size` if smaller, and to at least 1.
    pub prompt_tokens: u32,
    /// Tokens to generate. 0 and 1 both finish right after prefill (which produces one token).
    pub output_tokens: u32,
}

/// A change of the GPU cache's published blocks, as an engine's KV events would report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvChange {
    /// Consecutive blocks of one sequence, newly resident; `parent` is the block before the first
    /// (resident at that moment), `None` at the start of a prompt.
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<BlockHash>,
    },
    /// Blocks evicted (always leaves: a block is removed only after all its children).
    Removed { blocks: Vec<BlockHash> },
    /// Every published block was dropped (see [`EngineModel::clear`]).
    Cleared,
}

/// A request finished its (first) prefill in this step: its first token is out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefilled {
    pub id: u64,
    /// Leading prompt blocks found in the GPU cache at admission.
    pub gpu_hit_blocks: u32,
    /// Blocks after those loaded from lower tiers at admission.
    pub lower_hit_blocks: u32,
    /// `(gpu_hit_blocks + lower_hit_blocks) * block_size`, capped at the whole blocks of
    /// `prompt_tokens - 1` (the last prompt token is always recomputed, and vLLM's prefix cache
    /// hits whole blocks), as vLLM reports `cached_tokens`.
    pub cached_tokens: u32,
}

/// A request left the engine in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub id: u64,
    /// Tokens generated: `output_tokens` as requested (0 for a rejected request).
    pub output_tokens: u32,
    /// The request can never fit in this engine's cache and was not run.
    pub rejected: bool,
}

/// What one step did. Everything in it happens at the end of the step (`now + duration_us`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    pub duration_us: u64,
    /// Cache changes in the order the engine made them.
    pub kv: Vec<KvChange>,
    pub prefilled: Vec<Prefilled>,
    pub finished: Vec<Finished>,
    /// Prefill tokens computed plus one per decoding sequence.
    pub batch_tokens: u32,
    /// Requests admitted into the running batch at the start of this step (again after a
    /// preemption), in admission order.
    pub admitted: Vec<u64>,
}

/// Cumulative counters since the model was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps that returned a report.
    pub steps: u64,
    /// Sum of step durations.
    pub busy_us: u64,
    pub requests_submitted: u64,
    pub requests_finished: u64,
    /// Included in `requests_finished`.
    pub requests_rejected: u64,
    /// Dropped by [`EngineModel::abort`]; never finished.
    pub requests_aborted: u64,
    /// Running sequences evicted to make room for an earlier one's growth (recomputed later).
    pub preemptions: u64,
    /// Published blocks allocated (hashed prompt blocks computed or loaded).
    pub blocks_stored: u64,
    /// Published blocks evicted or cleared.
    pub blocks_removed: u64,
    /// Prompt tokens computed by prefill (including recomputation after preemption).
    pub prefill_tokens_computed: u64,
    /// Decode tokens generated.
    pub decode_tokens: u64,
    /// Prompt blocks (with a hash) of requests admitted for the first time.
    pub prompt_blocks: u64,
    /// GPU prefix hits at first admission.
    pub gpu_hit_blocks: u64,
    /// Lower-tier hits at first admission.
    pub lower_hit_blocks: u64,
    /// Blocks loaded from lower tiers, including on re-admission after preemption.
    pub blocks_loaded: u64,
    /// `cached_tokens` summed over first admissions.
    pub cached_tokens: u64,
}

/// A lower-tier hook with no tiers behind the engine: nothing is ever available.
pub fn no_lower_tiers(_id: u64, _blocks: &[BlockHash]) -> usize {
    0
}
