//! `infera trace synth`: traces of agentic, multi-turn sessions, generated from a seed.
//!
//! # The model
//! A session is one agent (or one user) working on one task. Its first turn sends a shared
//! prefix — tool definitions common to every session, then one of [`SynthConfig::system_prompts`]
//! system prompts — followed by the task ([`SynthConfig::first_input_tokens`]). Every later turn's
//! prompt is the previous prompt, plus the previous answer, plus new input: a tool's result
//! ([`SynthConfig::tool_call_fraction`] of the turns; [`SynthConfig::turn_input_tokens`]) or the
//! user's next message (as long as a task, [`SynthConfig::first_input_tokens`]). Its client sends it a think time after the previous answer arrived: the
//! tool's run time ([`SynthConfig::tool_think_ms`]) or the user's reading and typing time
//! ([`SynthConfig::user_think_s`]). A session ends after its turn count
//! ([`SynthConfig::min_turns`]`..=`[`SynthConfig::max_turns`]) or when the next prompt would pass
//! [`SynthConfig::max_context_tokens`]. Sessions start as a Poisson process whose rate keeps
//! about [`SynthConfig::concurrency`] sessions open at once.
//!
//! Lengths and think times are exponential around their means (capped at 8× the mean), turn
//! counts uniform, the system prompt uniform among its variants. The defaults follow public
//! descriptions of coding-agent traffic: a large shared prefix of tool definitions and
//! instructions, tens of turns per task, most of them tool calls answered in seconds, contexts
//! growing to tens of thousands of tokens, and so prefix reuse above 90 %.
//!
//! # The rows
//! One row per turn, in nominal arrival order: `session_id` `synth-s{session}`, `request_id`
//! `synth-s{session}-t{turn}` (both zero-padded), `think_time_us` on every turn but the first.
//! `block_hashes` hold one chained hash per complete block: a block made only of tool-definition
//! tokens hashes the same in every session, one that reaches into the system prompt the same in
//! every session with that prompt, and the rest are the session's own; since a turn's prompt
//! extends its predecessor's, the turn repeats every complete block of the previous prompt.
//! `arrival_us` is a nominal timeline (the previous turn's arrival plus a nominal service time,
//! [`NOMINAL_FIRST_TOKEN_US`] + [`NOMINAL_TOKEN_US`] per output token, plus the think time), what
//! an open-loop replay (`--playback timeline`) uses; session playback issues each turn after its
//! predecessor really finished instead.
//!
//! With [`SynthConfig::adapters`], each session also names a LoRA adapter (`lora`
//! `adapter-{a}`); the engines key its blocks by it, so the tool definitions are shared within
//! an adapter only.
//!
//! With [`SynthConfig::images`], each session's prompt carries one of that many images (a
//! product photo, a screenshot the agent works on), uniformly, right after the system prompt:
//! [`SynthConfig::image_tokens`] placeholder tokens, the same tokens for every image, which the
//! engines key by the image (`images`, id `image-{k}`). Sessions with the same system prompt
//! and image share those blocks; another image's are other blocks.
//!
//! Determinism: the same configuration gives the same trace on every platform; session `s` draws
//! from its own stream (seeded by the seed and `s`), so adding sessions keeps the earlier ones.

use super::{Trace, TraceError, TraceImage, TraceRequest};
use infera_core::rng::{Rng, splitmix64};

/// The nominal time from a turn's arrival to its first token, for the written timeline.
pub const NOMINAL_FIRST_TOKEN_US: u64 = 200_000;
/// The nominal time per output token, for the written timeline.
pub const NOMINAL_TOKEN_US: u64 = 20_000;

/// What `infera trace synth` generates (see the module docs for the model).
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    pub seed: u64,
    /// Sessions in the trace.
    pub sessions: usize,
    /// Mean number of sessions open at once (sets the sessions' start rate).
    pub concurrency: f64,
    /// Turns per session, uniform in `min_turns..=max_turns`.
    pub min_turns: u32,
    pub max_turns: u32,
    /// Tool-definition tokens at the start of every prompt, shared by every session.
    pub tool_tokens: u32,
    /// Distinct system prompts; each session uses one, uniformly at random.
    pub system_prompts: u32,
    /// Tokens per system prompt (after the tool definitions).
    pub system_tokens: u32,
    /// Mean tokens of a session's first input (the task).
    pub first_input_tokens: u32,
    /// Mean new input tokens of a later turn (a tool result or a user message).
    pub turn_input_tokens: u32,
    /// Mean tokens of an answer.
    pub output_tokens: u32,
    /// Share of later turns that are tool calls (the rest are user turns).
    pub tool_call_fraction: f64,
    /// Mean think time before a tool-call turn (the tool's run time), in milliseconds.
    pub tool_think_ms: f64,
    /// Mean think time before a user turn, in seconds.
    pub user_think_s: f64,
    /// A session ends when its next prompt would be longer than this.
    pub max_context_tokens: u32,
    /// Tokens per block of the written hashes.
    pub block_size: u32,
    pub model: String,
    /// LoRA adapters over `model` (0: none). Each session runs under one, uniformly at random,
    /// with that adapter's own system prompt (in place of the `system_prompts` variants); the
    /// tool definitions are the same tokens for every adapter, which the engines key apart.
    pub adapters: u32,
    /// Distinct images (0: none); each session's prompt carries one, uniformly at random.
    pub images: u32,
    /// Placeholder tokens of an image (1,024: a 896 × 896 image for Qwen2-VL).
    pub image_tokens: u32,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            sessions: 100,
            concurrency: 16.0,
            min_turns: 5,
            max_turns: 35,
            tool_tokens: 6_000,
            system_prompts: 4,
            system_tokens: 2_000,
            first_input_tokens: 1_500,
            turn_input_tokens: 1_200,
            output_tokens: 250,
            tool_call_fraction: 0.85,
            tool_think_ms: 2_000.0,
            user_think_s: 30.0,
            max_context_tokens: 128_000,
            block_size: 64,
            model: "default".to_owned(),
            adapters: 0,
            images: 0,
            image_tokens: 1_024,
        }
    }
}

impl SynthConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// [`TraceError::InvalidSynth`] naming the first setting out of range.
    pub fn validate(&self) -> Result<(), TraceError> {
        let bad = |what: &str| Err(TraceError::InvalidSynth(what.to_owned()));
        if self.sessions == 0 {
            return bad("sessions must be at least 1");
        }
        if !(self.concurrency.is_finite() && self.concurrency > 0.0) {
            return bad("concurrency must be above 0");
        }
        if self.min_turns == 0 || self.min_turns > self.max_turns {
            return bad("turns must be a range MIN..MAX with 1 <= MIN <= MAX");
        }
        if self.system_prompts == 0 {
            return bad("system prompts must be at least 1");
        }
        if self.block_size == 0 {
            return bad("the block size must be positive");
        }
        if !(0.0..=1.0).contains(&self.tool_call_fraction) {
            return bad("the tool-call fraction must be between 0 and 1");
        }
        for (name, v) in [
            ("tool think time", self.tool_think_ms),
            ("user think time", self.user_think_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(TraceError::InvalidSynth(format!(
                    "the {name} must be a non-negative number"
                )));
            }
        }
        if self.images > 0 && self.image_tokens == 0 {
            return bad("an image must have at least one token");
        }
        let prefix = u64::from(self.tool_tokens)
            + u64::from(self.system_tokens)
            + u64::from(self.image_tokens) * u64::from(self.images > 0)
            + u64::from(self.first_input_tokens.max(1));
        if prefix > u64::from(self.max_context_tokens) {
            return Err(TraceError::InvalidSynth(format!(
                "the max context ({} tokens) must hold the tool definitions, the system prompt, \
                 the image and the first input ({prefix} tokens)",
                self.max_context_tokens
            )));
        }
        Ok(())
    }

    /// The mean nominal length of a session, for the sessions' start rate.
    fn mean_session_us(&self) -> f64 {
        let turns = f64::from(self.min_turns + self.max_turns) / 2.0;
        let service = NOMINAL_FIRST_TOKEN_US as f64
            + (u64::from(self.output_tokens) * NOMINAL_TOKEN_US) as f64;
        let think = self.tool_call_fraction * self.tool_think_ms * 1e3
            + (1.0 - self.tool_call_fraction) * self.user_think_s * 1e6;
        turns * service + (turns - 1.0).max(0.0) * think
    }
}

/// An exponential draw around `mean`, capped at 8× the mean.
fn exp(rng: &mut Rng, mean: f64) -> f64 {
    let u = rng.next_f64();
    (-(1.0 - u).ln() * mean).min(8.0 * mean)
}

/// A token count: an exponential draw around `mean`, at least 1.
fn tokens(rng: &mut Rng, mean: u32) -> u32 {
    (exp(rng, f64::from(mean)).round() as u32).max(1)
}

/// Tags of the three kinds of block content.
const TOOLS_TAG: u64 = 0x7001_5000_0000_0000;
const SYSTEM_TAG: u64 = 0x5957_0000_0000_0000;
const SESSION_TAG: u64 = 0x5E55_0000_0000_0000;
/// Adapter `a`'s system prompt is variant `SYSTEM_PER_ADAPTER ^ a` (apart from the shared ones).
const SYSTEM_PER_ADAPTER: u64 = 0xADA0_0000;

/// The chained block hashes of one session, extended as its context grows.
struct Chain<'a> {
    cfg: &'a SynthConfig,
    system: u64,
    session: u64,
    hashes: Vec<u64>,
}

impl Chain<'_> {
    /// Makes sure the hashes cover `blocks` complete blocks. An image's placeholder tokens are
    /// the same whatever the image: hashed as tokens, they belong to the system prompt's span.
    fn extend_to(&mut self, blocks: usize) {
        let bs = u64::from(self.cfg.block_size);
        let tools = u64::from(self.cfg.tool_tokens);
        let image = if self.cfg.images > 0 {
            u64::from(self.cfg.image_tokens)
        } else {
            0
        };
        let shared = tools + u64::from(self.cfg.system_tokens) + image;
        while self.hashes.len() < blocks {
            let i = self.hashes.len() as u64;
            let end = (i + 1) * bs;
            let content = if end <= tools {
                TOOLS_TAG
            } else if end <= shared {
                SYSTEM_TAG ^ self.system
            } else {
                SESSION_TAG ^ self.session.wrapping_mul(0x1_0000_0001)
            };
            let mut state = content ^ i.wrapping_mul(0x9E37_79B9);
            let block = splitmix64(&mut state);
            let mut chained = self.hashes.last().copied().unwrap_or(0x1EAF) ^ block;
            self.hashes.push(splitmix64(&mut chained));
        }
    }
}

/// Generates the trace described by `cfg` (see the module docs).
///
/// # Errors
/// [`TraceError::InvalidSynth`] when a setting is out of range ([`SynthConfig::validate`]).
pub fn synthesize(cfg: &SynthConfig) -> Result<Trace, TraceError> {
    cfg.validate()?;
    let mut starts = Rng::new(cfg.seed ^ 0x5747_0000_0000_0001);
    let start_gap_us = cfg.mean_session_us() / cfg.concurrency;
    let width = cfg.sessions.to_string().len().max(4);
    let mut start_us = 0.0f64;
    let mut requests = Vec::new();
    for s in 0..cfg.sessions {
        if s > 0 {
            start_us += exp(&mut starts, start_gap_us);
        }
        let mut seed = cfg.seed ^ (s as u64).wrapping_mul(0xA24B_AED4_963E_E407);
        let mut rng = Rng::new(splitmix64(&mut seed));
        let session_id = format!("synth-s{s:0width$}");
        let turns = cfg.min_turns + rng.below(u64::from(cfg.max_turns - cfg.min_turns) + 1) as u32;
        let (system, lora) = if cfg.adapters > 0 {
            let a = rng.below(u64::from(cfg.adapters));
            (SYSTEM_PER_ADAPTER ^ a, Some(format!("adapter-{a:02}")))
        } else {
            (rng.below(u64::from(cfg.system_prompts)), None)
        };
        let images: Vec<TraceImage> = if cfg.images > 0 {
            let k = rng.below(u64::from(cfg.images));
            vec![TraceImage {
                offset: cfg.tool_tokens + cfg.system_tokens,
                length: cfg.image_tokens,
                id: format!("image-{k:03}"),
            }]
        } else {
            Vec::new()
        };
        let mut chain = Chain {
            cfg,
            system,
            session: s as u64,
            hashes: Vec::new(),
        };
        let image_tokens = images.first().map_or(0, |i| i.length);
        let mut context = cfg.tool_tokens
            + cfg.system_tokens
            + image_tokens
            + tokens(&mut rng, cfg.first_input_tokens);
        let mut arrival = start_us as u64;
        let mut think = None;
        for t in 0..turns {
            chain.extend_to((context / cfg.block_size) as usize);
            let output = tokens(&mut rng, cfg.output_tokens);
            requests.push(TraceRequest {
                arrival_us: arrival,
                request_id: format!("{session_id}-t{t:03}"),
                model: cfg.model.clone(),
                input_length: context,
                output_length: output,
                block_size: cfg.block_size,
                block_hashes: chain.hashes[..(context / cfg.block_size) as usize].to_vec(),
                token_ids: None,
                session_id: Some(session_id.clone()),
                retention: None,
                ttl_seconds: None,
                think_time_us: think,
                lora: lora.clone(),
                cache_salt: None,
                images: images.clone(),
                tenant: None,
                priority: None,
            });
            let tool = rng.next_f64() < cfg.tool_call_fraction;
            let (input, pause_us) = if tool {
                (
                    tokens(&mut rng, cfg.turn_input_tokens),
                    exp(&mut rng, cfg.tool_think_ms * 1e3),
                )
            } else {
                (
                    tokens(&mut rng, cfg.first_input_tokens),
                    exp(&mut rng, cfg.user_think_s * 1e6),
                )
            };
            let next = u64::from(context) + u64::from(output) + u64::from(input);
            if next > u64::from(cfg.max_context_tokens) {
                break;
            }
            context = next as u32;
            let pause_us = pause_us as u64;
            arrival += NOMINAL_FIRST_TOKEN_US + u64::from(output) * NOMINAL_TOKEN_US + pause_us;
            think = Some(pause_us);
        }
    }
    // Nominal arrival order; ties keep session order, so a session's turns stay in turn order.
    requests.sort_by_key(|r| r.arrival_us);
    let sessions = cfg.sessions;
    let n = requests.len();
    Ok(Trace {
        requests,
        source: format!("infera trace synth (seed {})", cfg.seed),
        notes: vec![format!(
            "synthesized agentic sessions: {sessions} sessions, {n} turns, about {} open at once, \
             {}..={} turns, {} tool-definition + {} system-prompt tokens ({}), \
             {}{:.0} % tool-call turns, block size {}",
            cfg.concurrency,
            cfg.min_turns,
            cfg.max_turns,
            cfg.tool_tokens,
            cfg.system_tokens,
            if cfg.adapters > 0 {
                format!("{} LoRA adapters, one system prompt each", cfg.adapters)
            } else {
                format!("{} variants", cfg.system_prompts)
            },
            if cfg.images > 0 {
                format!("{} images of {} tokens, ", cfg.images, cfg.image_tokens)
            } else {
                String::new()
            },
            cfg.tool_call_fraction * 100.0,
            cfg.block_size
        )],
    })
}

#[cfg(test)]
mod tests;
