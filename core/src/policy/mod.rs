//! Routing policies: which worker rank serves a request.
//!
//! - `kv-aware`: for each candidate `w` (lower is better)
//!   ```text
//!   prefill_blocks(w) = request_blocks − overlap(w) − credited(w) + queued_prefill_blocks(w)
//!   load(w)           = inflight_blocks(w) + resident_weight × resident_blocks(w)
//!                       + weight × balance_tokens / block_size × above_mean_picks(w)
//!   cost(w)           = weight × prefill_blocks(w) + load(w)
//!   ```
//!   `overlap(w)` is the prefix the engine announced, extended by the blocks of `w`'s requests in
//!   flight (the expected cache, [`FleetState::expected_overlap_at`]); `credited(w)` counts the
//!   blocks after that prefix that `w`'s node kvd can load (host RAM, NVMe, the shared store),
//!   each at its tier's credit ([`tiers`]: 0 to 1 of a GPU hit, by how much faster loading it
//!   is than prefilling it) — PD's prefill legs included; `inflight_blocks(w)` sums
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
//! Each policy is a [`Policy`] in a module of its own, registered by name in [`POLICIES`].
//!
//! The [`Router`] is the only code that decides, live and in replay; it reads a [`FleetState`] and
//! returns a [`RequestRouted`] event for the caller to append to the log. It never mutates state.

mod affinity;
mod cost;
mod kv_aware;
mod round_robin;
pub mod tiers;

pub use affinity::{AffinityMode, SessionAffinity};
pub use cost::{Scored, Scratch, Weights, score_candidates};
pub use tiers::TierWeights;

use crate::clock::Micros;
use crate::event::{CandidateScore, RequestRouted, Retention, Role, RoutedLeg, Tunables};
use crate::fleet::{Candidate, FleetState};
use crate::ids::{BlockHash, RequestId, SessionKey, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};

/// A routing policy's entry in [`POLICIES`].
#[derive(Debug)]
pub struct PolicySpec {
    /// Its `--router-policy` value.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Whether it reads the prompt's cached prefix; the service does not tokenize requests for
    /// a policy that does not.
    pub needs_prefix: bool,
    /// A fresh instance for `config`.
    pub build: fn(&RouterConfig) -> Box<dyn Policy>,
}

/// Every routing policy, the default first. A new policy is a module of this directory and its
/// line here; the CLI, `infera replay`, its sweeps and its suite read this list
/// (`docs/extending.md` walks through one).
pub static POLICIES: &[PolicySpec] = &[kv_aware::SPEC, round_robin::SPEC];

/// A policy: picks one of a leg's candidates. One instance lives as long as its [`Router`], so
/// it may keep state between decisions (cursors, a seeded random source, scratch buffers).
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// Picks one of `leg.candidates` (never empty).
    ///
    /// # Errors
    /// A [`RouteError`] when the request cannot be routed (a missing block size, say).
    fn pick(&mut self, leg: &Leg<'_>) -> Result<Pick, RouteError>;
}

/// What a policy decides one leg from.
#[derive(Debug)]
pub struct Leg<'a> {
    pub fleet: &'a FleetState,
    pub req: &'a RouteRequest,
    /// The model's workers of the leg's role, the request's failed ones left out; never empty.
    pub candidates: &'a [Candidate],
    pub role: Role,
    /// `--kv-overlap-weight` for the leg's role, scaled by the request's retention hint.
    pub overlap_weight: f64,
    pub now_us: Micros,
    /// The candidate the request's session is pinned to, which wins the policy's ties
    /// (`--router-session-affinity tie-break`, see [`affinity`]).
    pub session: Option<usize>,
}

/// A policy's choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// Index into [`Leg::candidates`].
    pub candidate: usize,
    /// The chosen candidate's cached prefix in blocks, where the policy computed it; the router
    /// computes it otherwise.
    pub overlap_blocks: Option<u32>,
    /// The best-scored candidates, for the `RequestRouted` event (empty for a policy that does
    /// not score).
    pub top: Vec<CandidateScore>,
}

/// `--router-policy`: one of [`POLICIES`], by name.
#[derive(Clone, Copy)]
pub struct PolicyKind(&'static PolicySpec);

impl PolicyKind {
    /// The default policy.
    pub const KV_AWARE: PolicyKind = PolicyKind(&kv_aware::SPEC);
    pub const ROUND_ROBIN: PolicyKind = PolicyKind(&round_robin::SPEC);

    /// The registered policy called `name`.
    ///
    /// # Errors
    /// [`UnknownPolicy`], naming the registered ones.
    pub fn parse(name: &str) -> Result<Self, UnknownPolicy> {
        POLICIES
            .iter()
            .find(|p| p.name == name)
            .map(PolicyKind)
            .ok_or_else(|| UnknownPolicy(name.to_owned()))
    }

    /// Every registered policy, the default first.
    pub fn all() -> impl Iterator<Item = PolicyKind> {
        POLICIES.iter().map(PolicyKind)
    }

    pub fn as_str(self) -> &'static str {
        self.0.name
    }

    pub fn spec(self) -> &'static PolicySpec {
        self.0
    }
}

impl Default for PolicyKind {
    fn default() -> Self {
        PolicyKind(&POLICIES[0])
    }
}

impl PartialEq for PolicyKind {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for PolicyKind {}

impl std::fmt::Debug for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for PolicyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.name)
    }
}

impl<'de> Deserialize<'de> for PolicyKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::parse(&name).map_err(serde::de::Error::custom)
    }
}

/// A `--router-policy` no policy is registered under.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy {0:?}; registered: {names}", names = policy_names())]
pub struct UnknownPolicy(pub String);

fn policy_names() -> String {
    POLICIES
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
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
    /// `--router-session-affinity` and `--router-session-ttl`.
    #[serde(default)]
    pub sessions: SessionAffinity,
    /// `--router-host-cache-hit-weight`, `--router-disk-cache-hit-weight`,
    /// `--router-remote-cache-hit-weight` (unset: measured, [`tiers`]).
    #[serde(default)]
    pub tier_weights: TierWeights,
}

/// The tunables of `--router-profile infera`: near-best on every trace of the routing-quality
/// suite without tuning (docs/benchmarks.md).
pub const INFERA_PROFILE: Tunables = Tunables {
    overlap_weight: 16.0,
    prefill_overlap_weight: None,
    resident_weight: 0.0,
    balance_tokens: 512,
};

/// The tunables of `--router-profile python`, the default: the Python Infera's defaults, and
/// [`RouterConfig::default`]'s.
pub const PYTHON_PROFILE: Tunables = Tunables {
    overlap_weight: 1.0,
    prefill_overlap_weight: None,
    resident_weight: 0.0,
    balance_tokens: 0,
};

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::default(),
            overlap_weight: 1.0,
            prefill_overlap_weight: None,
            decode_overlap_weight: None,
            temperature: 0.0,
            seed: 0,
            record_top: 4,
            resident_weight: 0.0,
            balance_tokens: 0,
            sessions: SessionAffinity::default(),
            tier_weights: TierWeights::default(),
        }
    }
}

impl RouterConfig {
    /// The settings `--auto-tune` searches, as they are.
    pub fn tunables(&self) -> Tunables {
        Tunables {
            overlap_weight: self.overlap_weight,
            prefill_overlap_weight: self.prefill_overlap_weight,
            resident_weight: self.resident_weight,
            balance_tokens: self.balance_tokens,
        }
    }

    /// This configuration with `t` in place of its tunables.
    pub fn with_tunables(&self, t: &Tunables) -> Self {
        Self {
            overlap_weight: t.overlap_weight,
            prefill_overlap_weight: t.prefill_overlap_weight,
            resident_weight: t.resident_weight,
            balance_tokens: t.balance_tokens,
            ..self.clone()
        }
    }

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
    /// The conversation the client named, if any (see [`affinity`]).
    pub session: Option<SessionKey>,
    /// The prompt's kvd inventory hashes, per namespace the candidates' connectors write
    /// ([`crate::kv_events::kvd::request_hashes`]); empty when no candidate names a kvd.
    pub kvd: Vec<KvdHashes>,
}

/// A prompt's inventory hashes at one block size and compat key.
#[derive(Debug, Clone, PartialEq)]
pub struct KvdHashes {
    pub block_size: u32,
    pub compat_key: std::sync::Arc<str>,
    pub hashes: Vec<BlockHash>,
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
    /// The inventory hashes for a connector writing under `compat_key` at `block_size`.
    pub fn kvd_blocks(&self, block_size: u32, compat_key: &str) -> Option<&[BlockHash]> {
        self.kvd
            .iter()
            .find(|k| k.block_size == block_size && *k.compat_key == *compat_key)
            .map(|k| k.hashes.as_slice())
    }

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
    /// A policy picked outside its candidates (a policy bug; → 500).
    #[error("policy {policy} picked candidate {index} of {candidates}")]
    BadPick {
        policy: &'static str,
        index: usize,
        candidates: usize,
    },
}

impl RouteError {
    /// Whether the same request may succeed later without changes.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RouteError::NoWorker { .. })
    }
}

/// The decider. Holds only the policy's own state (see [`Policy`]).
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    policy: Box<dyn Policy>,
}

impl Router {
    pub fn new(config: RouterConfig) -> Self {
        let policy = (config.policy.spec().build)(&config);
        Self { config, policy }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Decides with `t` from now on (a fresh policy instance: policies keep only caches and
    /// their random source, see [`Policy`]).
    pub fn retune(&mut self, t: &Tunables) {
        *self = Self::new(self.config.with_tunables(t));
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
            tenant: None,
            session: req.session,
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
                leg.overlap_blocks = cached_overlap(fleet, slot, leg_blocks);
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
            tenant: None,
            session: req.session,
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
        let overlap_weight = self.config.weight_for(role) * retention_scale(req.retention);
        let pinned = self
            .config
            .sessions
            .pinned(fleet, req.session, role, cands, now_us);
        let pick = match pinned {
            affinity::Pinned::Take(candidate) => Pick {
                candidate,
                overlap_blocks: None,
                top: Vec::new(),
            },
            affinity::Pinned::TieBreak(_) | affinity::Pinned::None => self.policy.pick(&Leg {
                fleet,
                req,
                candidates: cands,
                role,
                overlap_weight,
                now_us,
                session: match pinned {
                    affinity::Pinned::TieBreak(i) => Some(i),
                    _ => None,
                },
            })?,
        };
        let Some(c) = cands.get(pick.candidate) else {
            return Err(RouteError::BadPick {
                policy: self.config.policy.as_str(),
                index: pick.candidate,
                candidates: cands.len(),
            });
        };
        let blocks = req
            .blocks_for(&c.rank.worker, c.block_size)
            .ok_or(RouteError::MissingBlockSize(c.block_size))?;
        let overlap_blocks = pick
            .overlap_blocks
            .unwrap_or_else(|| cached_overlap(fleet, c.slot, blocks));
        let leg = RoutedLeg {
            worker: c.rank.clone(),
            role,
            overlap_blocks,
        };
        Ok((leg, blocks, pick.top, overlap_weight))
    }
}

/// The leading `blocks` the worker at `slot` holds or is computing (the index, extended by its
/// requests in flight: [`FleetState::expected_overlap_at`]).
fn cached_overlap(fleet: &FleetState, slot: crate::index::WorkerSlot, blocks: &[BlockHash]) -> u32 {
    let mut overlap = Vec::with_capacity(1);
    fleet
        .index()
        .overlap(crate::event::Tier::Gpu, blocks, &[slot], &mut overlap);
    let indexed = overlap.first().copied().unwrap_or(0);
    fleet.expected_overlap_at(slot, blocks, indexed)
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
