//! Routing policies: which worker rank serves a request.
//!
//! - `kv-aware`: for each candidate `w` (lower is better)
//!   ```text
//!   prefill_blocks(w) = request_blocks − overlap(w) + queued_prefill_blocks(w)
//!   load(w)           = inflight_blocks(w) + resident_weight × resident_blocks(w)
//!                       + weight × balance_tokens / block_size × above_mean_picks(w)
//!   cost(w)           = weight × prefill_blocks(w) + load(w)
//!   ```
//!   `overlap(w)` is the prefix the engine announced, extended by the blocks of `w`'s requests in
//!   flight (the expected cache, [`FleetState::expected_overlap_at`]); `inflight_blocks(w)` sums
//!   the blocks of `w`'s requests in flight, per request. Nothing outlives a request: sequential
//!   turns of one conversation stay on the worker that holds their prefix, and a burst of
//!   identical prompts spreads because each one in flight loads its worker.
//!   `resident_blocks(w)` (`--router-resident-weight`, default 0: off) counts the other
//!   conversations living on `w` between their turns ([`FleetState::resident_blocks_at`]): an
//!   agent's next turn may come seconds after its last answer, and a fleet that sees only what
//!   is in flight stacks new sessions on the worker that happens to be idle in that moment. A
//!   request is never charged for its own conversation's history, so sequential turns stay.
//!   `above_mean_picks(w)` (`--router-balance-tokens`, default 0: off) is how many of the fleet's
//!   recent picks ([`FleetState::recent_picks`]) went to `w` above the candidates' mean, the
//!   request's own conversation left out: a worker holding a hot prefix would otherwise take
//!   every request that shares it, idle again before each one arrives. Each such pick costs as
//!   much as prefilling `balance_tokens` tokens, so another worker pays a hot prefix's prefill
//!   once and shares its traffic when its holder is ahead by more picks than the prefix is long
//!   in `balance_tokens`, while a conversation's long history still outweighs it.
//!   `weight` is `--kv-overlap-weight`, or the prefill / decode weight for PD roles, scaled by the
//!   request's retention hint (`long` ×2, `none` ×0.1). With `--router-temperature 0` the cheapest
//!   candidate wins; ties go to the lower load, then to a seeded random choice (never list order).
//!   Above 0, a candidate is drawn with probability ∝ `exp(−ĉ / T)` where `ĉ` is its cost normalised
//!   by the decision's cost range.
//! - `round-robin`: rotates through each distinct candidate set independently.
//! - direct mode ([`resolve_direct`]): the worker named by the request's headers, no failover.
//!
//! The [`Router`] is the only code that decides, live and in replay; it reads a [`FleetState`] and
//! returns a [`RequestRouted`] event for the caller to append to the log. It never mutates state.

mod cost;

pub use cost::{Scored, Scratch, Weights, score_candidates};

use crate::clock::Micros;
use crate::event::{CandidateScore, RequestRouted, Retention, Role, RoutedLeg};
use crate::fleet::{Candidate, FleetState};
use crate::ids::{BlockHash, RequestId, WorkerId, WorkerRank};
use crate::rng::Rng;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// `--router-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    KvAware,
    RoundRobin,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::KvAware => "kv-aware",
            PolicyKind::RoundRobin => "round-robin",
        }
    }
}

/// Everything that shapes a decision (from `infera server`'s or `infera replay`'s flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    pub policy: PolicyKind,
    /// `--kv-overlap-weight`.
    pub overlap_weight: f64,
    /// `--kv-prefill-overlap-weight` (overrides the global weight for prefill legs).
    pub prefill_overlap_weight: Option<f64>,
    /// `--kv-decode-overlap-weight` (overrides the global weight for decode legs).
    pub decode_overlap_weight: Option<f64>,
    /// `--router-temperature`.
    pub temperature: f64,
    /// Seed of the tie-breaking / sampling random source.
    pub seed: u64,
    /// How many scored candidates a `RequestRouted` event keeps.
    pub record_top: usize,
    /// `--router-resident-weight`: the load of the other conversations resident on a worker,
    /// per block of their last prompts (0: not counted).
    #[serde(default)]
    pub resident_weight: f64,
    /// `--router-balance-tokens`: the tokens to prefill that each recent pick a worker took
    /// above the candidates' mean costs it (0: not counted).
    #[serde(default)]
    pub balance_tokens: u32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::KvAware,
            overlap_weight: 1.0,
            prefill_overlap_weight: None,
            decode_overlap_weight: None,
            temperature: 0.0,
            seed: 0,
            record_top: 4,
            resident_weight: 0.0,
            balance_tokens: 0,
        }
    }
}

impl RouterConfig {
    /// The overlap weight for a leg of `role`, before retention scaling.
    pub fn weight_for(&self, role: Role) -> f64 {
        match role {
            Role::Mixed => self.overlap_weight,
            Role::Prefill => self.prefill_overlap_weight.unwrap_or(self.overlap_weight),
            Role::Decode => self.decode_overlap_weight.unwrap_or(self.overlap_weight),
        }
    }
}

/// Scales the overlap weight by the client's retention hint.
pub fn retention_scale(hint: Option<Retention>) -> f64 {
    match hint {
        Some(Retention::Long) => 2.0,
        Some(Retention::None) => 0.1,
        Some(Retention::Short | Retention::Ephemeral) | None => 1.0,
    }
}

/// A request as the router sees it: already tokenized and hashed.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRequest {
    pub request_id: RequestId,
    pub model: String,
    pub prompt_tokens: u32,
    /// The prompt's router hashes at each block size used by the model's workers.
    pub hashes: Vec<(u32, Vec<BlockHash>)>,
    /// The prompt hashed for the workers that render it differently (empty for a uniform fleet,
    /// the common case).
    pub per_worker: WorkerHashes,
    pub retention: Option<Retention>,
    /// Ranks that already failed this request (retries go elsewhere).
    pub exclude: Vec<WorkerRank>,
}

impl RouteError {
    /// The 404 for `model`, listing what `fleet` serves.
    pub fn unknown_model(fleet: &FleetState, model: &str) -> Self {
        RouteError::UnknownModel {
            model: model.to_owned(),
            served: fleet
                .models()
                .into_iter()
                .map(|(m, _)| m.to_owned())
                .collect(),
        }
    }
}

/// At most 32 names, then how many more.
fn served_list(served: &[String]) -> String {
    const SHOWN: usize = 32;
    if served.is_empty() {
        return "none".to_owned();
    }
    let mut s = served
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if served.len() > SHOWN {
        s.push_str(&format!(" and {} more", served.len() - SHOWN));
    }
    s
}

impl RouteRequest {
    /// The hashes `worker` caches this prompt under at `block_size`, if the caller computed
    /// them: its own rendering's ([`WorkerHashes`]) or the fleet's. A request with no hashes at
    /// all was not tokenized (round-robin needs no prefix): it has no blocks at any size.
    pub fn blocks_for(&self, worker: &WorkerId, block_size: u32) -> Option<&[BlockHash]> {
        self.blocks_of(self.per_worker.variant_of(worker), block_size)
    }

    /// The hashes of rendering `variant` (`None`: the fleet's) at `block_size`.
    fn blocks_of(&self, variant: Option<u32>, block_size: u32) -> Option<&[BlockHash]> {
        if block_size == 0 || self.hashes.is_empty() {
            // A worker of unknown block size cannot hold a known prefix: load only.
            return Some(&[]);
        }
        match variant {
            None => self
                .hashes
                .iter()
                .find(|(bs, _)| *bs == block_size)
                .map(|(_, h)| h.as_slice()),
            Some(variant) => self
                .per_worker
                .hashes
                .iter()
                .find(|(v, bs, _)| *v == variant && *bs == block_size)
                .map(|(_, _, h)| h.as_slice()),
        }
    }
}

/// The prompt as hashed for workers whose engines render chat templates with their own server
/// defaults (`--default-chat-template-kwargs`), which the fleet's hashes would never match.
/// Renderings are numbered per request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerHashes {
    /// Each such worker with the number of its rendering.
    pub workers: Vec<(WorkerId, u32)>,
    /// (rendering, block size) → the prompt's hashes.
    pub hashes: Vec<(u32, u32, Vec<BlockHash>)>,
}

impl WorkerHashes {
    /// The rendering `worker` uses, `None` for the fleet's.
    pub fn variant_of(&self, worker: &WorkerId) -> Option<u32> {
        if self.workers.is_empty() {
            return None;
        }
        self.workers
            .iter()
            .find(|(w, _)| w == worker)
            .map(|(_, v)| *v)
    }
}

/// One leg's outcome: the leg, the request's hashes at its block size, the top candidates and
/// the overlap weight used.
type LegDecision<'r> = (RoutedLeg, &'r [BlockHash], Vec<CandidateScore>, f64);

/// Why no worker could be chosen. Each maps to one HTTP status at the edge.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// No worker serves this model or adapter at all (→ 404); `served` lists what the fleet
    /// serves, for the client's error.
    #[error(
        "model {model:?} is not served by any worker; served: {}",
        served_list(served)
    )]
    UnknownModel { model: String, served: Vec<String> },
    /// The model exists but no worker of the needed role is available (→ 503, retry later).
    #[error("no available {role} worker for model {model:?}")]
    NoWorker { model: String, role: &'static str },
    /// Direct mode named a worker that is not registered (→ 503, never failed over).
    #[error("worker {0:?} named by the request is not registered")]
    UnknownWorker(String),
    /// Direct mode named a dp rank the worker does not have (→ 503).
    #[error("worker {worker:?} has no dp rank {rank}")]
    UnknownRank { worker: String, rank: u32 },
    /// Direct mode named a worker that is draining: it finishes its work but takes no new
    /// requests (→ 503).
    #[error("worker {0:?} named by the request is draining")]
    Draining(String),
    /// Direct mode named a worker that serves another model (→ 400).
    #[error("worker {worker:?} named by the request does not serve model {model:?}")]
    WrongModel { worker: String, model: String },
    /// The request was hashed at none of the candidates' block sizes (a caller bug; → 500).
    #[error("request was not hashed at block size {0}")]
    MissingBlockSize(u32),
}

impl RouteError {
    /// Whether the same request may succeed later without changes.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RouteError::NoWorker { .. })
    }
}

/// The decider. Holds only the policy's own state (seeded RNG, round-robin cursors).
#[derive(Debug, Clone)]
pub struct Router {
    config: RouterConfig,
    rng: Rng,
    rr_cursors: FxHashMap<u64, u64>,
    scratch: cost::Scratch,
}

impl Router {
    pub fn new(config: RouterConfig) -> Self {
        let rng = Rng::new(config.seed);
        Self {
            config,
            rng,
            rr_cursors: FxHashMap::default(),
            scratch: cost::Scratch::default(),
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Decides where `req` goes: one leg, or a prefill and a decode leg when the model runs
    /// disaggregated. The returned event is what the caller appends to the log.
    pub fn decide(
        &mut self,
        fleet: &FleetState,
        req: &RouteRequest,
        now_us: Micros,
    ) -> Result<RequestRouted, RouteError> {
        if fleet.served(&req.model).is_none() {
            return Err(RouteError::unknown_model(fleet, &req.model));
        }
        let roles: &[Role] = if fleet.is_disaggregated(&req.model) {
            &[Role::Prefill, Role::Decode]
        } else {
            &[Role::Mixed]
        };
        let mut legs = Vec::with_capacity(roles.len());
        let mut weights = Vec::with_capacity(roles.len());
        let mut top = Vec::new();
        let mut blocks: Vec<BlockHash> = Vec::new();
        for &role in roles {
            let (leg, leg_blocks, leg_top, weight) = self.decide_leg(fleet, req, role, now_us)?;
            if blocks.is_empty() {
                blocks = leg_blocks.to_vec();
            }
            legs.push(leg);
            weights.push((role, weight));
            top.extend(leg_top);
        }
        Ok(RequestRouted {
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            legs,
            blocks,
            prompt_tokens: req.prompt_tokens,
            policy: self.config.policy.as_str().to_owned(),
            weights,
            top,
            retention: req.retention,
            at_us: now_us,
        })
    }

    /// Direct mode: records the legs an external picker named (see [`resolve_direct`]) as a
    /// `RequestRouted` with policy `direct`, with each leg's cached overlap for accounting.
    ///
    /// # Errors
    /// [`RouteError::UnknownWorker`] / [`RouteError::UnknownRank`] for a name or rank the fleet
    /// does not have, [`RouteError::Draining`] for a draining worker, [`RouteError::WrongModel`]
    /// for a worker of another model.
    pub fn decide_direct(
        &self,
        fleet: &FleetState,
        req: &RouteRequest,
        pick: &DirectPick,
        now_us: Micros,
    ) -> Result<RequestRouted, RouteError> {
        let mut legs = resolve_direct(fleet, &pick.worker, pick.prefill.as_deref(), pick.dp_rank)?;
        let mut blocks: Vec<BlockHash> = Vec::new();
        for leg in &mut legs {
            let record = fleet
                .worker(&leg.worker.worker)
                .ok_or_else(|| RouteError::UnknownWorker(leg.worker.worker.to_string()))?;
            if fleet.is_draining(&leg.worker.worker) {
                return Err(RouteError::Draining(leg.worker.worker.to_string()));
            }
            if !record.serves(&req.model) {
                return Err(RouteError::WrongModel {
                    worker: leg.worker.worker.to_string(),
                    model: req.model.clone(),
                });
            }
            let Some(leg_blocks) = req.blocks_for(&leg.worker.worker, record.kv_block_size) else {
                continue;
            };
            if let Some(slot) = fleet.index().slot(&leg.worker) {
                let mut overlap = Vec::with_capacity(1);
                fleet
                    .index()
                    .overlap(crate::event::Tier::Gpu, leg_blocks, &[slot], &mut overlap);
                let indexed = overlap.first().copied().unwrap_or(0);
                leg.overlap_blocks = fleet.expected_overlap_at(slot, leg_blocks, indexed);
            }
            if blocks.is_empty() {
                blocks = leg_blocks.to_vec();
            }
        }
        Ok(RequestRouted {
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            legs,
            blocks,
            prompt_tokens: req.prompt_tokens,
            policy: "direct".to_owned(),
            weights: Vec::new(),
            top: Vec::new(),
            retention: req.retention,
            at_us: now_us,
        })
    }

    fn decide_leg<'r>(
        &mut self,
        fleet: &FleetState,
        req: &'r RouteRequest,
        role: Role,
        now_us: Micros,
    ) -> Result<LegDecision<'r>, RouteError> {
        let all = fleet.candidates(&req.model, role);
        let filtered: Vec<Candidate>;
        let cands: &[Candidate] = if req.exclude.is_empty() {
            all
        } else {
            filtered = all
                .iter()
                .filter(|c| !req.exclude.contains(&c.rank))
                .cloned()
                .collect();
            &filtered
        };
        if cands.is_empty() {
            return Err(RouteError::NoWorker {
                model: req.model.clone(),
                role: role.as_str(),
            });
        }
        let weight = self.config.weight_for(role) * retention_scale(req.retention);
        match self.config.policy {
            PolicyKind::RoundRobin => {
                let key = candidate_set_key(cands);
                let cursor = self.rr_cursors.entry(key).or_default();
                let c = &cands[(*cursor % cands.len() as u64) as usize];
                *cursor = cursor.wrapping_add(1);
                let blocks = req
                    .blocks_for(&c.rank.worker, c.block_size)
                    .ok_or(RouteError::MissingBlockSize(c.block_size))?;
                let mut ov = Vec::with_capacity(1);
                fleet
                    .index()
                    .overlap(crate::event::Tier::Gpu, blocks, &[c.slot], &mut ov);
                let indexed = ov.first().copied().unwrap_or(0);
                let overlap_blocks = fleet.expected_overlap_at(c.slot, blocks, indexed);
                let leg = RoutedLeg {
                    worker: c.rank.clone(),
                    role,
                    overlap_blocks,
                };
                Ok((leg, blocks, Vec::new(), weight))
            }
            PolicyKind::KvAware => {
                let weights = Weights {
                    overlap: weight,
                    resident: self.config.resident_weight,
                    balance_tokens: f64::from(self.config.balance_tokens),
                };
                let scored =
                    score_candidates(fleet, req, cands, weights, now_us, &mut self.scratch)?;
                let pick = cost::choose(&scored, self.config.temperature, &mut self.rng);
                let chosen = &scored[pick];
                let blocks = req
                    .blocks_for(&chosen.candidate.rank.worker, chosen.candidate.block_size)
                    .ok_or(RouteError::MissingBlockSize(chosen.candidate.block_size))?;
                let leg = RoutedLeg {
                    worker: chosen.candidate.rank.clone(),
                    role,
                    overlap_blocks: chosen.overlap,
                };
                let mut order: Vec<usize> = (0..scored.len()).collect();
                order.sort_by(|a, b| scored[*a].cost.total_cmp(&scored[*b].cost));
                let top = order
                    .into_iter()
                    .take(self.config.record_top)
                    .map(|i| CandidateScore {
                        worker: scored[i].candidate.rank.clone(),
                        overlap_blocks: scored[i].overlap,
                        cost: scored[i].cost,
                    })
                    .collect();
                Ok((leg, blocks, top, weight))
            }
        }
    }
}

fn candidate_set_key(cands: &[Candidate]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for c in cands {
        h.update(c.rank.worker.as_str().as_bytes());
        h.update(&c.rank.dp_rank.to_le_bytes());
        h.update(&[0xff]);
    }
    h.digest()
}

/// The workers an external picker (a Gateway API Inference Extension EPP) named for a request:
/// `x-worker-instance-id`, `x-prefill-instance-id` and `x-dp-rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectPick {
    /// The (decode, or only) worker.
    pub worker: String,
    /// The prefill worker of a disaggregated pair.
    pub prefill: Option<String>,
    /// The dp rank on the named worker(s).
    pub dp_rank: Option<u32>,
}

/// Direct mode: the legs named by `x-worker-instance-id` (and `x-prefill-instance-id`,
/// `x-dp-rank`). No policy, no failover: an unknown worker or rank is an error.
pub fn resolve_direct(
    fleet: &FleetState,
    worker_id: &str,
    prefill_id: Option<&str>,
    dp_rank: Option<u32>,
) -> Result<Vec<RoutedLeg>, RouteError> {
    let leg = |id: &str, role_if_pd: Role| -> Result<RoutedLeg, RouteError> {
        let rec = fleet
            .worker(&WorkerId::new(id))
            .ok_or_else(|| RouteError::UnknownWorker(id.to_owned()))?;
        let rank = dp_rank.unwrap_or(rec.dp_rank);
        if rank < rec.dp_rank || rank >= rec.dp_rank + rec.dp_size.max(1) {
            return Err(RouteError::UnknownRank {
                worker: id.to_owned(),
                rank,
            });
        }
        let role = if prefill_id.is_some() {
            role_if_pd
        } else {
            rec.disagg_mode
        };
        Ok(RoutedLeg {
            worker: WorkerRank::new(id, rank),
            role,
            overlap_blocks: 0,
        })
    };
    let mut legs = Vec::with_capacity(2);
    if let Some(p) = prefill_id {
        legs.push(leg(p, Role::Prefill)?);
    }
    legs.push(leg(worker_id, Role::Decode)?);
    Ok(legs)
}

#[cfg(test)]
mod tests;
