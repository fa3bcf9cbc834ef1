//! The server's shadow replay (`infera server --auto-tune`): its own recent traffic, replayed
//! through the simulator under the router's current tunables and their neighbours, set against
//! what the fleet really did.
//!
//! # The window
//! [`Window`] keeps the requests that finished well (`status` ok) in the last
//! [`ShadowOptions::window_us`] as trace rows, assembled from the committed events exactly as the
//! trace recorder assembles them ([`crate::record`]), beside what their engines reported: the
//! prompt tokens served from cache (`cached_tokens`) and the TTFT. It is bounded by time and by
//! [`ShadowOptions::max_bytes`]; past either, the oldest rows go first (counted in
//! [`Window::evicted`]). A row's session is the client's session key as the router saw it.
//!
//! # An assessment
//! [`assess`] replays the window's busiest model on a simulated copy of the fleet
//! ([`fleet_config`]: as many engines, of the registered capacity, prefill budget and speed) once
//! for the current tunables and once for each neighbour on the `infera replay --tune` grid (one
//! step along one axis: [`neighbours`]). Hit rates count prompt tokens served from cache, as the
//! engines report them. The simulated caches start empty while the real ones were warm, so the
//! first [`WARMUP`] of the window only warms them and is not scored, for the replay nor for the
//! realised figures.
//!
//! **Noise.** The scored part is cut into [`SLICES`] consecutive slices of time; a candidate's
//! gain over the current tunables is resampled over them ([`RESAMPLES`] bootstrap draws, seeded),
//! and [`Candidate::gain_p5`] is its 5th percentile: a gain whose `gain_p5` is above 0 is beyond
//! the window's own noise. **Fidelity** is the current tunables' predicted hit rate minus the
//! realised one ([`Assessment::fidelity_gap`], with the same resampling's spread): a wrong block
//! size, an engine that drops events, or a tokenizer that is not the engine's shows here first.
//!
//! [`adopt`] turns a series of assessments into changes (`--auto-tune apply`).

use crate::record::assemble::{Assembler, Row};
use crate::report::{Summary, percentile};
use crate::sim::{self, SimConfig, SimError};
use crate::sweep;
use crate::trace::{Trace, TraceRequest};
use crate::tune::{self, Objectives};
use infera_core::engine::EngineConfig;
use infera_core::event::{
    Envelope, PREFILL_TOKENS_PER_S, RequestStatus, Role, Tunables, WorkerRecord,
};
use infera_core::rng::Rng;
use std::collections::VecDeque;

pub mod adopt;

/// The share of the window (by time) that only warms the simulated caches.
pub const WARMUP: f64 = 0.25;
/// Slices of the scored part that the noise is resampled over.
pub const SLICES: usize = 10;
/// Bootstrap draws per estimate.
pub const RESAMPLES: usize = 200;

/// How much traffic the window keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShadowOptions {
    /// Requests that arrived longer ago than this leave the window.
    pub window_us: u64,
    /// The most the window's rows may hold (their size, hashes, strings and prompts).
    pub max_bytes: u64,
}

impl Default for ShadowOptions {
    /// Ten minutes, 256 MiB (about 45k requests of 10k prompt tokens at 16 tokens per block).
    fn default() -> Self {
        Self {
            window_us: 600_000_000,
            max_bytes: 256 << 20,
        }
    }
}

/// One finished request and what its engine reported.
#[derive(Debug, Clone)]
pub struct Observed {
    pub request: TraceRequest,
    pub cached_tokens: Option<u32>,
    pub ttft_us: Option<u64>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Window {
    opts: ShadowOptions,
    assembler: Assembler,
    rows: VecDeque<Observed>,
    bytes: u64,
    /// Rows that left the window for its byte budget, before their time.
    pub evicted: u64,
    /// Rows that ever entered the window.
    pub added: u64,
}

impl Window {
    pub fn new(opts: ShadowOptions) -> Self {
        Self {
            opts,
            assembler: Assembler::default(),
            rows: VecDeque::new(),
            bytes: 0,
            evicted: 0,
            added: 0,
        }
    }

    /// Takes one committed event.
    pub fn feed(&mut self, env: &Envelope) {
        self.assembler.feed(env);
    }

    /// Moves the requests finished by `now_us` into the window and lets the old ones go.
    pub fn advance(&mut self, now_us: u64) {
        let ready = self
            .assembler
            .take_ready(now_us, self.opts.window_us, false);
        for row in ready.into_iter().filter(|r| r.status == RequestStatus::Ok) {
            self.push_row(row);
        }
        let horizon = now_us.saturating_sub(self.opts.window_us);
        while let Some(front) = self.rows.front() {
            let recent = front.request.arrival_us >= horizon;
            if recent && self.bytes <= self.opts.max_bytes {
                break;
            }
            self.evicted += u64::from(recent);
            self.bytes -= bytes_of(&front.request);
            self.rows.pop_front();
        }
    }

    fn push_row(&mut self, row: Row) {
        let Row {
            mut request,
            cached_tokens,
            ttft_us,
            session,
            ..
        } = row;
        if request.session_id.is_none() {
            request.session_id = session.map(|s| format!("{:016x}", s.0));
        }
        self.push(Observed {
            request,
            cached_tokens,
            ttft_us,
        });
    }

    /// Adds one finished request (in arrival order), as [`Window::advance`] adds those the
    /// events finished; the bounds apply at the next [`Window::advance`].
    pub fn push(&mut self, o: Observed) {
        self.bytes += bytes_of(&o.request);
        self.added += 1;
        self.rows.push_back(o);
    }

    /// Forgets every row (after the router's tunables changed: the next assessment judges the
    /// new ones on their own traffic).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.bytes = 0;
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// About what the rows hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn rows(&self) -> impl Iterator<Item = &Observed> {
        self.rows.iter()
    }
}

/// What a row holds on the heap and in the window: its own size, its hashes, prompt (when the
/// server records prompts) and strings.
fn bytes_of(r: &TraceRequest) -> u64 {
    let strings = [
        Some(&r.request_id),
        Some(&r.model),
        r.session_id.as_ref(),
        r.lora.as_ref(),
        r.cache_salt.as_ref(),
        r.tenant.as_ref(),
    ];
    let text: usize = strings.into_iter().flatten().map(String::capacity).sum();
    (std::mem::size_of::<Observed>()
        + 8 * r.block_hashes.capacity()
        + 4 * r.token_ids.as_ref().map_or(0, Vec::capacity)
        + text
        + r.images.iter().map(|i| 64 + i.id.capacity()).sum::<usize>()) as u64
}

/// The model with the most requests in `rows`.
fn busiest_model<'a>(rows: impl Iterator<Item = &'a Observed>) -> Option<String> {
    let mut counts: std::collections::HashMap<&str, usize> = Default::default();
    for o in rows {
        *counts.entry(o.request.model.as_str()).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(a.0)))
        .map(|(m, _)| m.to_owned())
}

/// `base` sized like the workers that serve `model`: mixed engines or prefill and decode pools,
/// each with the median registered GPU capacity, the first one's prefill budget and the median
/// registered prefill speed (as a speed-up of the simulator's timing model). `None` when no
/// worker serves it.
pub fn fleet_config(base: &SimConfig, workers: &[WorkerRecord], model: &str) -> Option<SimConfig> {
    let serving: Vec<&WorkerRecord> = workers.iter().filter(|w| w.serves(model)).collect();
    let first = serving.first()?;
    let count = |role: Role| serving.iter().filter(|w| w.disagg_mode == role).count();
    let (prefill, decode) = (count(Role::Prefill), count(Role::Decode));
    let mut cfg = base.clone();
    if prefill > 0 && decode > 0 {
        cfg.pd = Some((prefill, decode));
    } else {
        cfg.pd = None;
        cfg.workers = serving.len();
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let capacity = median(
        serving
            .iter()
            .filter_map(|w| w.kv_capacity_blocks())
            .map(|b| b as f64)
            .collect(),
    );
    if let Some(blocks) = capacity {
        cfg.engine.gpu_blocks = blocks as usize;
    }
    cfg.engine.max_batched_tokens = first.prefill_budget();
    let speed = median(
        serving
            .iter()
            .filter(|w| w.extra.contains_key(PREFILL_TOKENS_PER_S))
            .map(|w| w.prefill_tokens_per_s())
            .collect(),
    );
    let modelled = EngineConfig {
        speedup: 1.0,
        ..cfg.engine.clone()
    }
    .prefill_tokens_per_s();
    if let (Some(speed), Some(modelled)) = (speed, modelled) {
        cfg.engine.speedup = speed / modelled;
    }
    Some(cfg)
}

/// The current tunables of `base` and each neighbour on the `--tune` grid: for each axis of
/// [`tune::default_axes`], the nearest grid value below and above the current one. The current
/// tunables come first.
pub fn neighbours(base: &SimConfig) -> Vec<Tunables> {
    let current = base.router.tunables();
    let mut out = vec![current];
    for axis in tune::default_axes(base) {
        let now = match axis.key.as_str() {
            "kv-overlap-weight" => current.overlap_weight,
            "kv-prefill-overlap-weight" => current
                .prefill_overlap_weight
                .unwrap_or(current.overlap_weight),
            "router-resident-weight" => current.resident_weight,
            "router-balance-tokens" => f64::from(current.balance_tokens),
            _ => continue,
        };
        let grid: Vec<(f64, &String)> = axis
            .values
            .iter()
            .filter_map(|v| v.parse::<f64>().ok().map(|x| (x, v)))
            .collect();
        let below = grid
            .iter()
            .filter(|(x, _)| *x < now - 1e-9)
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let above = grid
            .iter()
            .filter(|(x, _)| *x > now + 1e-9)
            .min_by(|a, b| a.0.total_cmp(&b.0));
        for (_, value) in below.into_iter().chain(above) {
            let mut cfg = base.clone();
            if sweep::apply(&mut cfg, &axis.key, value).is_ok() {
                let t = cfg.router.tunables();
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
    }
    out
}

/// A replay's CPU budget: a share of one core averaged over the interval between replays. Each
/// replay covers as many of the window's latest requests as the last one's speed says fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Seconds of replay per interval.
    seconds: f64,
    /// The most requests the next replay covers.
    pub limit: usize,
    /// The fewest it may cover.
    floor: usize,
}

impl Budget {
    /// `share` of a core over `interval`; the first replay covers at most `first` requests, none
    /// fewer than `floor`.
    pub fn new(share: f64, interval: std::time::Duration, first: usize, floor: usize) -> Self {
        Self {
            seconds: share * interval.as_secs_f64(),
            limit: first.max(floor),
            floor,
        }
    }

    /// A replay of `requests` took `seconds`: sizes the next one.
    pub fn spent(&mut self, requests: usize, seconds: f64) {
        if requests > 0 && seconds > 0.0 {
            let per_request = seconds / requests as f64;
            self.limit = ((self.seconds / per_request) as usize).max(self.floor);
        }
    }
}

/// Hit rate and TTFT over the scored part of the window.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Figures {
    /// Prompt tokens served from cache over prompt tokens; `None` when no engine reported it.
    pub hit_rate: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
}

/// One setting the shadow replay tried.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Candidate {
    pub tunables: Tunables,
    /// The setting as `infera server` flags.
    pub flags: String,
    /// The replay's hit rate over the scored part (prompt tokens).
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    /// The busiest worker's share of the requests over the mean.
    pub imbalance: f64,
    /// `hit_rate` minus the current tunables' (0 for them).
    pub gain: f64,
    /// The gain's 5th percentile over resampled slices of the window.
    pub gain_p5: f64,
    /// On the Pareto front of hit rate, TTFT p50 and balance among the candidates.
    pub on_front: bool,
}

/// What one shadow replay found. See the module docs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Assessment {
    pub model: String,
    /// Requests replayed, and those scored (after the warm-up).
    pub requests: usize,
    pub scored: usize,
    /// The window's span, first to last arrival.
    pub span_s: f64,
    /// What the fleet did over the scored part.
    pub realised: Figures,
    /// The current tunables first, then their neighbours.
    pub candidates: Vec<Candidate>,
    /// The candidate `infera replay --tune`'s rule picks ([`tune::recommend`]).
    pub recommended: usize,
    /// The current tunables' predicted hit rate minus the realised one.
    pub fidelity_gap: Option<f64>,
    /// Half the 90 % interval of that gap over resampled slices.
    pub fidelity_noise: Option<f64>,
}

impl Assessment {
    pub fn current(&self) -> &Candidate {
        &self.candidates[0]
    }

    pub fn recommendation(&self) -> &Candidate {
        &self.candidates[self.recommended]
    }
}

/// Per slice of the scored part: (prompt tokens served from cache, prompt tokens).
type Slices = [(f64, f64); SLICES];

fn ratio(s: &Slices, pick: &[usize]) -> f64 {
    let (hit, all) = pick
        .iter()
        .fold((0.0, 0.0), |(h, a), &i| (h + s[i].0, a + s[i].1));
    if all > 0.0 { hit / all } else { 0.0 }
}

/// The 5th and 95th percentiles of `f` over bootstrap draws of the slices.
fn resampled(rng: &mut Rng, f: impl Fn(&[usize]) -> f64) -> (f64, f64) {
    let mut draws: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let pick: Vec<usize> = (0..SLICES)
                .map(|_| rng.below(SLICES as u64) as usize)
                .collect();
            f(&pick)
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    (percentile(&draws, 0.05), percentile(&draws, 0.95))
}

/// Replays the latest `max_requests` of `window` (the caller's CPU budget) for the current
/// tunables of `base` and their [`neighbours`] on the fleet of `workers` (see the module docs).
/// `None` when the window is empty or no worker serves its busiest model.
///
/// # Errors
/// A [`SimError`] when the simulator refuses the configuration.
pub fn assess(
    window: &Window,
    base: &SimConfig,
    workers: &[WorkerRecord],
    max_requests: usize,
) -> Result<Option<Assessment>, SimError> {
    let Some(model) = busiest_model(window.rows()) else {
        return Ok(None);
    };
    let Some(base) = fleet_config(base, workers, &model) else {
        return Ok(None);
    };
    let mut rows: Vec<&Observed> = window.rows().filter(|o| o.request.model == model).collect();
    rows.drain(..rows.len().saturating_sub(max_requests.max(1)));
    let t0 = rows[0].request.arrival_us;
    let span_us = rows[rows.len() - 1].request.arrival_us - t0;
    let cut_us = (span_us as f64 * WARMUP) as u64;
    let slice_of = |arrival_us: u64| -> Option<usize> {
        let at = arrival_us.checked_sub(cut_us)?;
        let len = (span_us - cut_us).max(1);
        Some(((at as u128 * SLICES as u128 / len as u128) as usize).min(SLICES - 1))
    };
    let trace = Trace {
        requests: rows
            .iter()
            .map(|o| TraceRequest {
                arrival_us: o.request.arrival_us - t0,
                ..o.request.clone()
            })
            .collect(),
        source: "infera server shadow window".into(),
        notes: Vec::new(),
    };
    let mut realised: Slices = [(0.0, 0.0); SLICES];
    let mut realised_ttft = Vec::new();
    let mut scored = 0;
    for (o, r) in rows.iter().zip(&trace.requests) {
        let Some(s) = slice_of(r.arrival_us) else {
            continue;
        };
        scored += 1;
        if let Some(cached) = o.cached_tokens {
            realised[s].0 += f64::from(cached.min(r.input_length));
            realised[s].1 += f64::from(r.input_length);
        }
        if let Some(t) = o.ttft_us {
            realised_ttft.push(t as f64 / 1000.0);
        }
    }
    realised_ttft.sort_by(f64::total_cmp);
    let all: Vec<usize> = (0..SLICES).collect();
    let reported = realised.iter().any(|s| s.1 > 0.0);
    let realised_figures = Figures {
        hit_rate: reported.then(|| ratio(&realised, &all)),
        ttft_p50_ms: (!realised_ttft.is_empty()).then(|| percentile(&realised_ttft, 0.5)),
    };

    let tried = neighbours(&base);
    let mut slices: Vec<Slices> = Vec::with_capacity(tried.len());
    let mut objectives = Vec::with_capacity(tried.len());
    for t in &tried {
        let cfg = SimConfig {
            router: base.router.with_tunables(t),
            ..base.clone()
        };
        let result = sim::run(&trace, &cfg)?;
        let mut s: Slices = [(0.0, 0.0); SLICES];
        let mut ttft = Vec::new();
        for out in result.requests.iter().filter(|o| !o.rejected) {
            let Some(i) = slice_of(trace.requests[out.index].arrival_us) else {
                continue;
            };
            s[i].0 += f64::from(out.cached_tokens.min(out.input_tokens));
            s[i].1 += f64::from(out.input_tokens);
            ttft.push(out.ttft_us as f64 / 1000.0);
        }
        ttft.sort_by(f64::total_cmp);
        objectives.push(Objectives {
            hit_rate: ratio(&s, &all),
            ttft_p50_ms: if ttft.is_empty() {
                0.0
            } else {
                percentile(&ttft, 0.5)
            },
            imbalance: Summary::of(&result, 0.0).imbalance,
        });
        slices.push(s);
    }
    let on_front = tune::front(&objectives);
    let recommended = tune::recommend(&objectives).unwrap_or(0);
    let mut rng = Rng::new(0x5ad0_7e91);
    let candidates = tried
        .iter()
        .zip(&objectives)
        .enumerate()
        .map(|(i, (t, o))| {
            let gain = o.hit_rate - objectives[0].hit_rate;
            let gain_p5 = if i == 0 {
                0.0
            } else {
                resampled(&mut rng, |pick| {
                    ratio(&slices[i], pick) - ratio(&slices[0], pick)
                })
                .0
            };
            Candidate {
                tunables: *t,
                flags: flags(t),
                hit_rate: o.hit_rate,
                ttft_p50_ms: o.ttft_p50_ms,
                imbalance: o.imbalance,
                gain,
                gain_p5,
                on_front: on_front[i],
            }
        })
        .collect();
    let (fidelity_gap, fidelity_noise) = match realised_figures.hit_rate {
        Some(real) => {
            let (lo, hi) = resampled(&mut rng, |pick| {
                ratio(&slices[0], pick) - ratio(&realised, pick)
            });
            (Some(objectives[0].hit_rate - real), Some((hi - lo) / 2.0))
        }
        None => (None, None),
    };
    Ok(Some(Assessment {
        model,
        requests: trace.requests.len(),
        scored,
        span_s: span_us as f64 / 1e6,
        realised: realised_figures,
        candidates,
        recommended,
        fidelity_gap,
        fidelity_noise,
    }))
}

/// `t` as `infera server` flags.
pub fn flags(t: &Tunables) -> String {
    let mut out = format!("--kv-overlap-weight {}", t.overlap_weight);
    if let Some(w) = t.prefill_overlap_weight {
        out += &format!(" --kv-prefill-overlap-weight {w}");
    }
    out + &format!(
        " --router-resident-weight {} --router-balance-tokens {}",
        t.resident_weight, t.balance_tokens
    )
}

#[cfg(test)]
mod tests;
