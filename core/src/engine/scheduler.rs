//! [`EngineModel`]: a continuous-batching scheduler (vLLM v1 style) over the paged cache.
//!
//! # A step
//! 1. **Running** sequences, in admission order, each get work while the token budget
//!    (`max_batched_tokens`) lasts: a decoding sequence computes one token (its KV grows by one
//!    token); a sequence still in prefill computes its next chunk, `min(remaining, budget)` tokens.
//!    Blocks are allocated as the KV grows (a new block every `block_size` tokens). If the cache
//!    cannot supply one even after evicting every unreferenced block, the most recently admitted
//!    running sequence is *preempted* (all its blocks released, pushed back to the front of the
//!    waiting queue, recomputed later from its prompt plus the tokens generated so far); if that
//!    is the sequence itself, scheduling of running sequences stops for this step.
//! 2. **Waiting** sequences are admitted FCFS while fewer than `max_seqs` run, budget remains and
//!    nothing was preempted in this step. Admission looks up the longest resident prefix of the
//!    prompt (`k` GPU hit blocks, referenced and refreshed), then asks the lower-tier hook for the
//!    next blocks (`m` loaded blocks, stored into the GPU and costed as loads, not compute);
//!    `cached = min((k + m)·block_size, ⌊(prefill_len − 1) / block_size⌋·block_size)` tokens are skipped and the first chunk is
//!    scheduled. If its blocks do not fit, the head waits and nothing behind it is admitted.
//! 3. The step's duration comes from [`super::TimingModel`]; sequences whose prefill completed
//!    produce their first token ([`super::Prefilled`] the first time), decoding sequences one more;
//!    a sequence that reached `max(output_tokens, 1)` tokens finishes and releases its blocks.
//!
//! # Block accounting of a sequence
//! A sequence with `kv_len` tokens of KV owns `ceil(kv_len / block_size)` blocks: first `held`, a
//! chain of published blocks from a root (its complete prompt blocks, once full), then `anon`
//! anonymous ones (a block still being filled, the partial prompt tail, generated tokens). A
//! prompt block is published when it becomes full: if the same hash is already resident under the
//! same parent (another sequence computed it meanwhile) the sequence shares it and frees its own;
//! if it is resident under another parent (inconsistent hashes from the caller) the sequence stops
//! publishing and keeps the rest anonymous. Nothing here can over-allocate: every growth checks
//! `needed <= free + unreferenced` (exact, see [`super::cache`]) before touching anything.
//!
//! # Progress
//! Requests whose largest footprint exceeds the cache are rejected at submission, so the oldest
//! running sequence can always grow (it preempts younger ones), and an engine with nothing running
//! can always admit its queue head. Hence every request finishes.

use super::cache::BlockCache;
use super::seq::{Seq, grow, release};
use super::timing::scaled_us;
use super::{
    EngineConfig, EngineConfigError, EngineStats, Finished, KvChange, Prefilled, SimRequest,
    StepReport,
};
use crate::ids::BlockHash;
use std::collections::VecDeque;

/// One simulated engine (one data-parallel rank): see the module docs.
#[derive(Debug)]
pub struct EngineModel {
    config: EngineConfig,
    cache: BlockCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Rejections not reported yet.
    rejected: Vec<Finished>,
    stats: EngineStats,
}

impl EngineModel {
    /// Builds an engine with an empty cache.
    ///
    /// # Panics
    /// If `config` is invalid (see [`EngineConfig::validate`]); use [`EngineModel::try_new`] for
    /// configurations that come from users.
    pub fn new(config: EngineConfig) -> Self {
        match Self::try_new(config) {
            Ok(engine) => engine,
            Err(e) => panic!("{e}"),
        }
    }

    /// Builds an engine with an empty cache.
    ///
    /// # Errors
    /// [`EngineConfigError`] naming the first invalid field.
    pub fn try_new(config: EngineConfig) -> Result<Self, EngineConfigError> {
        config.validate()?;
        Ok(Self {
            cache: BlockCache::new(config.gpu_blocks),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            rejected: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request; it is considered at the next step. A request that can never fit in the
    /// cache is rejected and reported (`Finished { rejected: true }`) by the next step.
    pub fn submit(&mut self, req: SimRequest) {
        self.stats.requests_submitted += 1;
        let seq = Seq::new(req, u64::from(self.config.block_size));
        let footprint = seq.max_kv_len().div_ceil(u64::from(self.config.block_size));
        if footprint > self.config.gpu_blocks as u64 {
            self.rejected.push(Finished {
                id: seq.id,
                output_tokens: 0,
                rejected: true,
            });
        } else {
            self.waiting.push_back(seq);
        }
    }

    /// Nothing waiting, running or left to report: [`EngineModel::step`] would return `None`.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.rejected.is_empty()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Published blocks resident in the GPU cache (referenced or cached).
    pub fn resident_blocks(&self) -> usize {
        self.cache.resident()
    }

    /// Anonymous blocks held by running sequences (prompt tails, generated tokens).
    pub fn anonymous_blocks(&self) -> usize {
        self.cache.anonymous()
    }

    /// Blocks occupied: resident published plus anonymous; never above `gpu_blocks`.
    pub fn used_blocks(&self) -> usize {
        self.cache.resident() + self.cache.anonymous()
    }

    /// KV-cache utilisation in `[0, 1]`: blocks referenced by sequences (published and anonymous)
    /// over `gpu_blocks`. Cached blocks nobody references do not count, as in vLLM.
    pub fn utilisation(&self) -> f64 {
        self.cache.utilisation()
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Drops every unreferenced published block, like a prefix-cache reset.
    ///
    /// Returns `[Cleared]` when no block was referenced (the cache is now empty), otherwise one
    /// `Removed` with the dropped blocks (leaves before parents), or nothing if none was dropped.
    pub fn clear(&mut self) -> Vec<KvChange> {
        let all = self.cache.unreferenced() == self.cache.resident();
        let mut removed = Vec::new();
        self.cache.evict_all_unreferenced(&mut removed);
        self.stats.blocks_removed += removed.len() as u64;
        if all {
            vec![KvChange::Cleared]
        } else if removed.is_empty() {
            Vec::new()
        } else {
            vec![KvChange::Removed { blocks: removed }]
        }
    }

    /// Runs one step. `lower` is asked, at each admission (with the request's id), how many of the given blocks (those
    /// after the GPU prefix hit) are available contiguously from lower tiers; it must be a pure
    /// query, as a request that has to wait may ask again at a later step.
    ///
    /// Returns `None` when idle.
    pub fn step(
        &mut self,
        lower: &mut dyn FnMut(u64, &[BlockHash]) -> usize,
    ) -> Option<StepReport> {
        if self.is_idle() {
            return None;
        }
        let bs = u64::from(self.config.block_size);
        let mut report = StepReport {
            finished: std::mem::take(&mut self.rejected),
            ..StepReport::default()
        };
        let mut budget = u64::from(self.config.max_batched_tokens);
        let mut prefill_tokens = 0u64;
        let mut decodes = 0u64;
        let mut loaded = 0u64;
        let preempted = self.schedule_running(
            bs,
            &mut budget,
            &mut prefill_tokens,
            &mut decodes,
            &mut report,
        );
        if !preempted {
            self.admit_waiting(
                bs,
                lower,
                &mut budget,
                &mut prefill_tokens,
                &mut loaded,
                &mut report,
            );
        }

        let ms =
            self.config
                .timing
                .step_ms(prefill_tokens, decodes, self.cache.utilisation(), loaded);
        report.duration_us = scaled_us(ms, self.config.speedup);
        report.batch_tokens = u32::try_from(prefill_tokens + decodes).unwrap_or(u32::MAX);
        self.complete_step(&mut report);

        self.stats.steps += 1;
        self.stats.busy_us += report.duration_us;
        self.stats.prefill_tokens_computed += prefill_tokens;
        self.stats.decode_tokens += decodes;
        self.stats.blocks_loaded += loaded;
        self.stats.requests_finished += report.finished.len() as u64;
        self.stats.requests_rejected +=
            report.finished.iter().filter(|f| f.rejected).count() as u64;
        Some(report)
    }

    /// Drops request `id` because its client went away: out of the queue, or out of the running
    /// batch with its blocks released (its published blocks stay cached, unreferenced, as in an
    /// engine that aborts a request). It is never reported as finished. Returns whether it was
    /// found (a request already finished, or unknown, is not).
    pub fn abort(&mut self, id: u64) -> bool {
        let seq = if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos)
        } else if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(pos))
        } else if let Some(pos) = self.rejected.iter().position(|f| f.id == id) {
            self.rejected.remove(pos);
            self.stats.requests_aborted += 1;
            return true;
        } else {
            None
        };
        let Some(mut seq) = seq else {
            return false;
        };
        release(&mut self.cache, &mut seq);
        self.stats.requests_aborted += 1;
        true
    }

    /// How many of the upcoming steps are *quiet* — pure decode steps in which nothing is admitted,
    /// allocated, published, evicted or finished, only token counts move — and the duration of
    /// each (they are all equal: utilisation cannot change without an allocation). `None` when the
    /// next step is not quiet. [`EngineModel::skip_quiet_steps`] applies them at once, with exactly
    /// the effect of calling [`EngineModel::step`] that many times; a simulator uses this to jump
    /// over long decode phases.
    pub fn quiet_steps(&self) -> Option<(u64, u64)> {
        if !self.waiting.is_empty() || !self.rejected.is_empty() || self.running.is_empty() {
            return None;
        }
        if self.running.len() as u64 > u64::from(self.config.max_batched_tokens) {
            return None;
        }
        let bs = u64::from(self.config.block_size);
        let mut n = u64::MAX;
        for seq in &self.running {
            if !seq.decoding || (seq.hash_ok && seq.blocks.len() > seq.held.len()) {
                return None;
            }
            let owned = (seq.held.len() + seq.anon) as u64;
            let room = (owned * bs).saturating_sub(seq.kv_len);
            let to_finish =
                u64::from(seq.target_output().saturating_sub(seq.generated)).saturating_sub(1);
            n = n.min(room).min(to_finish);
        }
        if n == 0 || n == u64::MAX {
            return None;
        }
        let ms =
            self.config
                .timing
                .step_ms(0, self.running.len() as u64, self.cache.utilisation(), 0);
        Some((n, scaled_us(ms, self.config.speedup)))
    }

    /// Applies up to `n` quiet steps (see [`EngineModel::quiet_steps`]); returns how many it applied.
    pub fn skip_quiet_steps(&mut self, n: u64) -> u64 {
        let Some((max, duration_us)) = self.quiet_steps() else {
            return 0;
        };
        let n = n.min(max);
        let tokens = u32::try_from(n).unwrap_or(u32::MAX);
        for seq in &mut self.running {
            seq.kv_len += n;
            seq.generated += tokens;
        }
        self.stats.steps += n;
        self.stats.busy_us += n * duration_us;
        self.stats.decode_tokens += n * self.running.len() as u64;
        n
    }

    /// Phase 1: running sequences decode or continue their prefill. Returns whether any sequence
    /// was preempted.
    fn schedule_running(
        &mut self,
        bs: u64,
        budget: &mut u64,
        prefill_tokens: &mut u64,
        decodes: &mut u64,
        report: &mut StepReport,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        'running: while i < self.running.len() && *budget > 0 {
            let seq = &self.running[i];
            let tokens = if seq.decoding {
                1
            } else {
                (seq.prefill_len() - seq.kv_len).min(*budget)
            };
            let new_len = seq.kv_len + tokens;
            while !grow(
                &mut self.cache,
                &mut self.running[i],
                new_len,
                bs,
                &mut report.kv,
                &mut self.stats,
            ) {
                let Some(mut victim) = self.running.pop() else {
                    break 'running;
                };
                preempted = true;
                self.stats.preemptions += 1;
                release(&mut self.cache, &mut victim);
                victim.decoding = false;
                victim.step_tokens = 0;
                self.waiting.push_front(victim);
                if self.running.len() == i {
                    break 'running;
                }
            }
            let seq = &mut self.running[i];
            seq.step_tokens = tokens;
            if seq.decoding {
                *decodes += 1;
            } else {
                *prefill_tokens += tokens;
            }
            *budget -= tokens;
            i += 1;
        }
        preempted
    }

    /// Phase 2: FCFS admission of waiting sequences.
    fn admit_waiting(
        &mut self,
        bs: u64,
        lower: &mut dyn FnMut(u64, &[BlockHash]) -> usize,
        budget: &mut u64,
        prefill_tokens: &mut u64,
        loaded: &mut u64,
        report: &mut StepReport,
    ) {
        while *budget > 0 && self.running.len() < self.config.max_seqs as usize {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            let (gpu_hits, conflict) = self.cache.prefix_match(&seq.blocks);
            let rest = &seq.blocks[gpu_hits..];
            let lower_hits = if conflict || rest.is_empty() {
                0
            } else {
                lower(seq.id, rest).min(rest.len())
            };
            let prefill_len = seq.prefill_len();
            let cached = ((gpu_hits + lower_hits) as u64 * bs).min((prefill_len - 1) / bs * bs);
            let tokens = (prefill_len - cached).min(*budget);
            if !grow(
                &mut self.cache,
                seq,
                cached + tokens,
                bs,
                &mut report.kv,
                &mut self.stats,
            ) {
                release(&mut self.cache, seq);
                break;
            }
            if seq.first.is_none() {
                let cached_tokens = u32::try_from(cached).unwrap_or(u32::MAX);
                seq.first = Some(Prefilled {
                    id: seq.id,
                    gpu_hit_blocks: gpu_hits as u32,
                    lower_hit_blocks: lower_hits as u32,
                    cached_tokens,
                });
                self.stats.prompt_blocks += seq.blocks.len() as u64;
                self.stats.gpu_hit_blocks += gpu_hits as u64;
                self.stats.lower_hit_blocks += lower_hits as u64;
                self.stats.cached_tokens += u64::from(cached_tokens);
            }
            seq.step_tokens = tokens;
            *loaded += lower_hits as u64;
            *prefill_tokens += tokens;
            *budget -= tokens;
            if let Some(seq) = self.waiting.pop_front() {
                report.admitted.push(seq.id);
                self.running.push(seq);
            }
        }
    }

    /// Phase 3: tokens come out, finished sequences release their blocks.
    fn complete_step(&mut self, report: &mut StepReport) {
        let cache = &mut self.cache;
        self.running.retain_mut(|seq| {
            if seq.step_tokens == 0 {
                return true;
            }
            seq.step_tokens = 0;
            if seq.decoding {
                seq.generated += 1;
            } else if seq.kv_len == seq.prefill_len() {
                seq.generated += 1;
                seq.decoding = true;
                if !seq.prefilled_sent {
                    seq.prefilled_sent = true;
                    if let Some(p) = seq.first {
                        report.prefilled.push(p);
                    }
                }
            }
            if seq.decoding && seq.generated >= seq.target_output() {
                release(cache, seq);
                report.finished.push(Finished {
                    id: seq.id,
                    output_tokens: seq.generated.min(seq.output),
                    rejected: false,
                });
                return false;
            }
            true
        });
    }
}
