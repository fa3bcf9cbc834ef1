//! `FleetState`: the router's whole view of the fleet, as a projection of the event log.
//!
//! It owns the workers (by model and role, with their block sizes), the [`KvIndex`], and the load
//! the router itself put on each worker rank, counted exactly from `RequestRouted` to
//! `RequestFinished` and keyed by the router's own request identity (the server makes it unique
//! per attempt; a client-supplied id never merges two requests):
//! - `inflight_blocks`: the blocks of the requests in flight on the rank, summed over requests
//!   (two identical prompts count twice: each is its own work) — the load the cost charges;
//! - `active_blocks`: the same blocks counted once each (refcounted per block): the blocks the
//!   rank holds or is computing for its requests;
//! - `queued_prefill_tokens`: prompt tokens routed to a rank and not yet prefilled.
//!
//! # Expected cache
//! Between a pick and the engine's KV events the index does not know yet what the pick put on
//! the rank. [`FleetState::expected_overlap_at`] extends the index's prefix with the rank's
//! active blocks, so that a follow-up turn or the next prompt of a burst sees the prefix the
//! rank is computing. The expectation needs no bookkeeping of its own: it is confirmed when the
//! KV events arrive (the index holds the blocks) and dropped when the request ends (its blocks
//! leave the active set). A finished request leaves no load and no expectation behind: charging
//! a rank for work it has completed would make sequential turns of one conversation ping-pong
//! between workers.
//!
//! # Resident conversations
//! A finished request leaves a *tip* on each rank it ran on: its prompt's length in blocks, its
//! last block and when it finished (at most [`MAX_TIPS`] per rank, newest kept). A request
//! whose prompt extends a tip (the same block at the tip's last position; hashes are chained)
//! continues that conversation. [`FleetState::resident_blocks_at`] sums the tips on a rank that
//! the request at hand does not continue and that finished within [`RESIDENT_HORIZON_US`]: the
//! other conversations that live there between their turns (an agent's tool call, a user
//! reading). Each counts only beyond the prefix the request shares with the rank (its overlap
//! there), so that requests sharing a long system prompt with different questions are not
//! each other's load: what differs between them is their own part. The router charges them
//! only with `--router-resident-weight` above 0, so that new sessions spread over workers while
//! each session's own turns, never charged for their own history, stay where their cache is.
//! A request routed to a rank retires the tips it continues there. Tips are soft state: a snapshot does not carry them, so a rebuild starts
//! without them (they come back as requests finish) and [`PartialEq`] ignores them.
//!
//! # Recent picks
//! The fleet also remembers where its last legs went (a number per routable rank, see
//! [`recent`]); [`FleetState::recent_picks`] counts them per rank, leaving out the request's own
//! conversation. The router charges a rank for its picks above the candidates' mean only with
//! `--router-balance-tokens` above 0. Like tips, the window is soft state.
//!
//! # Sessions
//! A request that names its conversation pins it to the ranks it was routed to
//! ([`FleetState::session_pin`], see [`sessions`]); the router keeps a session there by
//! `--router-session-affinity`. Soft state too.
//!
//! # Node kvds
//! A worker that names its node's kvd (its registration's `kvd_events_endpoint`) can load what
//! that kvd holds; the kvd's inventory is indexed under its pseudo worker rank for as long as a
//! registered worker names it, and its measured speeds kept per tier (`fleet/kvd.rs`):
//! [`FleetState::lower_tier_run`] is what the cost credits.
//!
//! # Draining
//! A `WorkerDraining` marks a registered worker as shutting down: it stays listed
//! ([`FleetState::workers`], [`FleetState::worker`]), keeps its index entries and the load of its
//! in-flight requests (they finish there), but leaves the routing candidates and is not counted by
//! [`FleetState::worker_count`]. A later `WorkerRegistered` for it un-drains it; a
//! `WorkerDeregistered` forgets it. A `WorkerDraining` for a worker that is not registered changes
//! nothing.
//!
//! # Snapshots of format v3
//! Format v3 dumps ended with a [`RecentLoad`](crate::event::RecentLoad) (the decayed recent-pick window of an older load
//! model). It still parses and folds as nothing: this state keeps no window.
//!
//! Invariants: only [`Projection::apply`] mutates it; the draining workers are a subset of the
//! registered ones; the state depends only on the events folded, never on a clock, so a rebuild
//! from a dump is identical and replay is deterministic.

use crate::clock::Micros;
use crate::event::{
    Envelope, Event, RequestFinished, RequestPrefilled, RequestRouted, Role, WorkerDraining,
    WorkerRecord, WorkerRegistered,
};
use crate::ids::{BlockHash, RequestId, SessionKey, WorkerId, WorkerRank};
use crate::index::{KvIndex, WorkerSlot};
use crate::kv_events::kvd::KvdLink;
use crate::projection::Projection;
use kvd::Kvds;
pub use kvd::TierLoad;
use recent::{PromptEnd, RecentPicks};
use rustc_hash::FxHashMap;
use sessions::Sessions;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Tunables of the load accounting. It has none today: the load is what is in flight, exactly
/// (see the module docs); the type stays so that every caller builds the state one way.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct FleetConfig {}

/// One routable unit as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub rank: WorkerRank,
    pub slot: WorkerSlot,
    pub role: Role,
    pub block_size: u32,
    /// The prompt tokens its engine prefills in one step ([`WorkerRecord::prefill_budget`]).
    pub prefill_budget: u32,
}

/// A routable rank's node kvd ([`FleetState::kvd_at`]): the kvd's index slot, the namespace
/// compat key the rank's connector writes under, and the rank's prefill speed
/// ([`WorkerRecord::prefill_tokens_per_s`]) against which loading from it is weighed.
#[derive(Debug, Clone, PartialEq)]
pub struct KvdAt {
    pub slot: WorkerSlot,
    pub compat_key: Arc<str>,
    pub prefill_tokens_per_s: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct RankLoad {
    /// Block → number of in-flight requests on this rank that contain it.
    active: FxHashMap<BlockHash, u32>,
    /// The sum of `active`'s counts: blocks of in-flight requests, per request.
    inflight_blocks: u64,
    queued_prefill_tokens: u64,
    /// Conversations that finished a request here, oldest first (see the module docs).
    tips: VecDeque<Tip>,
}

/// The last request of a conversation on a rank (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tip {
    end: PromptEnd,
    at_us: Micros,
}

/// A model or adapter the fleet serves.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Served {
    /// The base model, for an adapter (the `parent` of `/v1/models`).
    pub parent: Option<String>,
    /// The block sizes of its workers, sorted, without repeats.
    pub block_sizes: Vec<u32>,
    /// Whether it has dedicated prefill and decode pools.
    pub disaggregated: bool,
}

/// Every model and adapter `workers` serve. A name that is one worker's base model and another's
/// adapter is taken as a base model: requests for it run without the adapter.
fn served_models<'a>(workers: impl Iterator<Item = &'a WorkerRecord>) -> FxHashMap<String, Served> {
    let mut served: FxHashMap<String, Served> = FxHashMap::default();
    let mut roles: FxHashMap<String, (bool, bool)> = FxHashMap::default();
    for w in workers {
        let adapters = w.lora_adapters().map(|a| (a, Some(w.model_name.as_str())));
        for (name, parent) in std::iter::once((w.model_name.as_str(), None)).chain(adapters) {
            let entry = served.entry(name.to_owned()).or_insert_with(|| Served {
                parent: parent.map(str::to_owned),
                ..Served::default()
            });
            if parent.is_none() {
                entry.parent = None;
            }
            entry.block_sizes.push(w.kv_block_size);
            let r = roles.entry(name.to_owned()).or_default();
            r.0 |= w.disagg_mode == Role::Prefill;
            r.1 |= w.disagg_mode == Role::Decode;
        }
    }
    for (name, s) in &mut served {
        s.block_sizes.sort_unstable();
        s.block_sizes.dedup();
        s.disaggregated = roles.get(name).is_some_and(|(p, d)| *p && *d);
    }
    served
}

/// Tips kept per rank.
pub const MAX_TIPS: usize = 32;
/// How long after its request finished a conversation counts as resident.
pub const RESIDENT_HORIZON_US: Micros = 60_000_000;

#[derive(Debug, Clone, PartialEq)]
struct InFlight {
    routed: RequestRouted,
    /// Per leg: the prompt tokens this leg still has to prefill.
    queued_tokens: Vec<u64>,
    prefilled: bool,
    order: u64,
}

/// The fleet as the router knows it. See the module docs.
#[derive(Debug, Clone, Default)]
pub struct FleetState {
    config: FleetConfig,
    workers: BTreeMap<WorkerId, WorkerRecord>,
    /// Registered workers that take no new requests, with the reason they drain.
    draining: BTreeMap<WorkerId, String>,
    index: KvIndex,
    /// Load per rank, indexed by the rank's index slot.
    load: Vec<RankLoad>,
    /// Routable ranks per (model or adapter, role), rebuilt when the worker set changes.
    candidates: FxHashMap<(String, Role), Vec<Candidate>>,
    /// Every model and adapter a registered worker serves, rebuilt with the candidates.
    served: FxHashMap<String, Served>,
    inflight: FxHashMap<RequestId, InFlight>,
    picks: u64,
    /// Routable ranks (the recent-pick window keeps a number of picks per rank).
    ranks: usize,
    recent: RecentPicks,
    sessions: Sessions,
    /// The kvds workers name, and the speeds of the tiers they load from.
    kvds: Kvds,
    /// The index slots of every named kvd (L4 is shared: any of them may hold a block there).
    kvd_slots: Vec<WorkerSlot>,
    /// Each routable rank's node kvd, by the rank's slot (kept beside the candidates, so that a
    /// fleet without kvds copies nothing more per candidate).
    kvd_at: Vec<Option<KvdAt>>,
}

impl FleetState {
    pub fn new(config: FleetConfig) -> Self {
        Self {
            config,
            ..Default::default()
        }
    }

    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The KV index (read-only: only events change it).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    pub fn worker(&self, id: &WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(id)
    }

    /// Every registered worker, by id, draining ones included.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerRecord> {
        self.workers.values()
    }

    /// Workers that take new requests: registered and not draining.
    pub fn worker_count(&self) -> usize {
        // `draining` is a subset of `workers`.
        self.workers.len().saturating_sub(self.draining.len())
    }

    /// Registered workers that are draining.
    pub fn draining_count(&self) -> usize {
        self.draining.len()
    }

    /// Whether `worker` is registered and draining.
    pub fn is_draining(&self, worker: &WorkerId) -> bool {
        self.draining.contains_key(worker)
    }

    /// Why `worker` drains, if it does.
    pub fn drain_reason(&self, worker: &WorkerId) -> Option<&str> {
        self.draining.get(worker).map(String::as_str)
    }

    /// Models and adapters served by at least one registered worker, sorted by name.
    pub fn models(&self) -> Vec<(&str, &Served)> {
        let mut m: Vec<(&str, &Served)> =
            self.served.iter().map(|(k, v)| (k.as_str(), v)).collect();
        m.sort_unstable_by_key(|(k, _)| *k);
        m
    }

    /// What the fleet knows of `model` (a base model or an adapter), if a worker serves it.
    pub fn served(&self, model: &str) -> Option<&Served> {
        self.served.get(model)
    }

    /// Whether the model has dedicated prefill and decode pools (PD disaggregation).
    pub fn is_disaggregated(&self, model: &str) -> bool {
        self.served.get(model).is_some_and(|s| s.disaggregated)
    }

    /// The routable ranks of `model` with `role`, in a stable order (by worker id, then rank).
    /// Draining workers are not among them.
    pub fn candidates(&self, model: &str, role: Role) -> &[Candidate] {
        // One entry per (model, role): a scan avoids allocating an owned key per lookup.
        self.candidates
            .iter()
            .find(|((m, r), _)| m == model && *r == role)
            .map(|(_, c)| c.as_slice())
            .unwrap_or(&[])
    }

    fn rebuild_candidates(&mut self) {
        self.candidates.clear();
        self.kvd_slots = (self.kvds.sources().iter())
            .filter_map(|l| self.index.slot(&l.source()))
            .collect();
        self.kvd_at.clear();
        self.served = served_models(self.workers.values());
        self.ranks = 0;
        let routable = self
            .workers
            .values()
            .filter(|w| !self.draining.contains_key(&w.worker_id));
        for w in routable {
            for r in rank_range(w) {
                let rank = WorkerRank::new(w.worker_id.clone(), r);
                if let Some(slot) = self.index.slot(&rank) {
                    let role = w.disagg_mode;
                    let c = Candidate {
                        rank,
                        slot,
                        role,
                        block_size: w.kv_block_size,
                        prefill_budget: w.prefill_budget(),
                    };
                    if let Some(kvd) = kvd_at(&self.index, self.kvds.of(&w.worker_id), w) {
                        if self.kvd_at.len() <= slot.index() {
                            self.kvd_at.resize(slot.index() + 1, None);
                        }
                        self.kvd_at[slot.index()] = Some(kvd);
                    }
                    // A name that is also a base model is served as the base model.
                    let adapters = w
                        .lora_adapters()
                        .filter(|a| self.served.get(*a).is_some_and(|s| s.parent.is_some()));
                    for name in adapters {
                        let key = (name.to_owned(), role);
                        self.candidates.entry(key).or_default().push(c.clone());
                    }
                    let key = (w.model_name.clone(), role);
                    self.candidates.entry(key).or_default().push(c);
                    self.ranks += 1;
                }
            }
        }
    }

    fn load_at(&self, slot: WorkerSlot) -> Option<&RankLoad> {
        self.load.get(slot.index())
    }

    fn load_mut(&mut self, slot: WorkerSlot) -> &mut RankLoad {
        if self.load.len() <= slot.index() {
            self.load.resize_with(slot.index() + 1, RankLoad::default);
        }
        &mut self.load[slot.index()]
    }

    /// Distinct blocks of in-flight requests on the rank at `slot`.
    pub fn active_blocks_at(&self, slot: WorkerSlot) -> u64 {
        self.load_at(slot)
            .map(|l| l.active.len() as u64)
            .unwrap_or(0)
    }

    /// Prompt tokens routed to the rank at `slot` and not yet prefilled.
    pub fn queued_prefill_tokens_at(&self, slot: WorkerSlot) -> u64 {
        self.load_at(slot)
            .map(|l| l.queued_prefill_tokens)
            .unwrap_or(0)
    }

    /// Whether `c` is saturated at `threshold`: the prompt tokens routed to it and not yet
    /// prefilled are at least `threshold` of its prefill budgets.
    pub fn saturated(&self, c: &Candidate, threshold: f64) -> bool {
        self.queued_prefill_tokens_at(c.slot) as f64 >= threshold * f64::from(c.prefill_budget)
    }

    /// Whether the router's queue lets a request for `model` through at `threshold`: some
    /// candidate (of the prefill role, when disaggregated) is not [`saturated`](Self::saturated),
    /// or none exists (the decision then says why).
    pub fn has_room(&self, model: &str, threshold: f64) -> bool {
        let role = if self.is_disaggregated(model) {
            Role::Prefill
        } else {
            Role::Mixed
        };
        let candidates = self.candidates(model, role);
        candidates.is_empty() || candidates.iter().any(|c| !self.saturated(c, threshold))
    }

    /// The slot `session`'s `role` leg was last routed to, if that was at most `ttl_us` before
    /// `now_us` (see [`sessions`]).
    pub fn session_pin(
        &self,
        session: SessionKey,
        role: Role,
        now_us: Micros,
        ttl_us: Micros,
    ) -> Option<WorkerSlot> {
        self.sessions.pinned(session, role, now_us, ttl_us)
    }

    /// Sessions pinned (live or lapsed, not yet dropped).
    pub fn sessions_pinned(&self) -> usize {
        self.sessions.len()
    }

    /// Distinct blocks of in-flight requests on `rank`.
    pub fn active_blocks(&self, rank: &WorkerRank) -> u64 {
        self.index
            .slot(rank)
            .map(|s| self.active_blocks_at(s))
            .unwrap_or(0)
    }

    /// Prompt tokens routed to `rank` and not yet prefilled.
    pub fn queued_prefill_tokens(&self, rank: &WorkerRank) -> u64 {
        self.index
            .slot(rank)
            .map(|s| self.queued_prefill_tokens_at(s))
            .unwrap_or(0)
    }

    /// Blocks of the requests in flight on the rank at `slot`, summed over requests: its load.
    pub fn inflight_blocks_at(&self, slot: WorkerSlot) -> u64 {
        self.load_at(slot).map(|l| l.inflight_blocks).unwrap_or(0)
    }

    /// Blocks of the conversations resident on the rank at `slot` at `now_us` that a prompt of
    /// `blocks` does not continue, each beyond the `overlap` the prompt has there (see the
    /// module docs).
    pub fn resident_blocks_at(
        &self,
        slot: WorkerSlot,
        blocks: &[BlockHash],
        overlap: u32,
        now_us: Micros,
    ) -> u64 {
        self.load_at(slot).map_or(0, |l| {
            l.tips
                .iter()
                .filter(|t| {
                    now_us.saturating_sub(t.at_us) <= RESIDENT_HORIZON_US
                        && !t.end.continued_by(blocks)
                })
                .map(|t| u64::from(t.end.blocks().saturating_sub(overlap)))
                .sum()
        })
    }

    /// Of the last legs routed ([`recent::PICKS_PER_RANK`] per routable rank), how many went to
    /// each slot (indexed by slot), leaving out those of the conversation a prompt of `blocks`
    /// continues: the balance term's count (see [`recent`]).
    pub fn recent_picks(&self, blocks: &[BlockHash], out: &mut Vec<u32>) {
        self.recent.count(blocks, out);
    }

    /// Blocks of the requests in flight on `rank`, summed over requests.
    pub fn inflight_blocks(&self, rank: &WorkerRank) -> u64 {
        self.index
            .slot(rank)
            .map(|s| self.inflight_blocks_at(s))
            .unwrap_or(0)
    }

    /// How many leading `blocks` the rank at `slot` holds or is computing: the `indexed` prefix
    /// its engine announced (the index's overlap), extended by the blocks of its in-flight
    /// requests (the expected cache, see the module docs). Never less than `indexed`.
    pub fn expected_overlap_at(&self, slot: WorkerSlot, blocks: &[BlockHash], indexed: u32) -> u32 {
        let Some(load) = self.load_at(slot).filter(|l| !l.active.is_empty()) else {
            return indexed;
        };
        let start = (indexed as usize).min(blocks.len());
        // Block hashes are chained: an active block implies the prefix it ends.
        let extra = blocks[start..]
            .iter()
            .take_while(|b| load.active.contains_key(b))
            .count();
        indexed.saturating_add(extra as u32)
    }

    /// Requests routed and not finished.
    pub fn inflight_requests(&self) -> usize {
        self.inflight.len()
    }

    /// In-flight requests per rank (for metrics and `/v1/workers`).
    pub fn inflight_on(&self, rank: &WorkerRank) -> usize {
        self.inflight
            .values()
            .filter(|f| f.routed.legs.iter().any(|l| &l.worker == rank))
            .count()
    }

    fn register(&mut self, record: &WorkerRecord) {
        if let Some(old) = self.workers.get(&record.worker_id) {
            // Ranks the worker no longer has leave routing (a re-registration may shrink dp_size).
            let (old_ranks, new_ranks) = (rank_range(old), rank_range(record));
            let id = record.worker_id.clone();
            self.drop_ranks(|r| {
                r.worker == id && old_ranks.contains(&r.dp_rank) && !new_ranks.contains(&r.dp_rank)
            });
        }
        for r in rank_range(record) {
            self.index
                .ensure_slot(&WorkerRank::new(record.worker_id.clone(), r));
        }
        if let Some(gone) = self.kvds.link(record) {
            self.index.remove_worker(&gone.worker);
        }
        if let Some(link) = self.kvds.of(&record.worker_id) {
            self.index.ensure_slot(&link.source());
        }
        self.workers
            .insert(record.worker_id.clone(), record.clone());
        // A registration cancels a drain.
        self.draining.remove(&record.worker_id);
        self.rebuild_candidates();
    }

    fn drain(&mut self, d: &WorkerDraining) {
        if !self.workers.contains_key(&d.worker) {
            return;
        }
        let was_routable = self
            .draining
            .insert(d.worker.clone(), d.reason.clone())
            .is_none();
        if was_routable {
            self.rebuild_candidates();
        }
    }

    fn deregister(&mut self, worker: &WorkerId) {
        self.workers.remove(worker);
        self.draining.remove(worker);
        // Forget the load before the index frees the slots.
        self.drop_ranks(|r| &r.worker == worker);
        self.index.remove_worker(worker);
        self.kvds.forget(worker);
        if let Some(gone) = self.kvds.unlink(worker) {
            self.index.remove_worker(&gone.worker);
        }
        self.rebuild_candidates();
    }

    /// Forgets the load on ranks that left routing. Decisions that involved them no longer load
    /// them: their legs are stripped from the stored decisions, so that a dump (which re-applies the
    /// stored decisions) reproduces exactly this state.
    fn drop_ranks(&mut self, gone: impl Fn(&WorkerRank) -> bool) {
        let index = &self.index;
        self.recent
            .forget(|slot| index.worker_of(slot).is_some_and(&gone));
        for (slot, l) in self.load.iter_mut().enumerate() {
            if self
                .index
                .worker_of(WorkerSlot(slot as u32))
                .is_some_and(&gone)
            {
                *l = RankLoad::default();
            }
        }
        for f in self.inflight.values_mut() {
            let keep: Vec<bool> = f.routed.legs.iter().map(|l| !gone(&l.worker)).collect();
            let mut k = keep.iter();
            f.routed.legs.retain(|_| k.next().copied().unwrap_or(true));
            let mut k = keep.iter();
            f.queued_tokens
                .retain(|_| k.next().copied().unwrap_or(true));
        }
    }

    fn serves(&self, rank: &WorkerRank) -> bool {
        self.workers
            .get(&rank.worker)
            .is_some_and(|w| rank_range(w).contains(&rank.dp_rank))
    }

    fn routed(&mut self, r: &RequestRouted) {
        if self.inflight.contains_key(&r.request_id) {
            return; // duplicate delivery
        }
        self.picks += 1;
        let order = self.picks;
        let mut routed = r.clone();
        // A leg to a worker that is not registered (it left before the decision was applied)
        // puts no load anywhere.
        routed.legs.retain(|l| self.serves(&l.worker));
        let mut queued_tokens = Vec::with_capacity(routed.legs.len());
        for leg in &routed.legs {
            let bs = self
                .workers
                .get(&leg.worker.worker)
                .map(|w| w.kv_block_size)
                .unwrap_or(0);
            let Some(slot) = self.index.slot(&leg.worker) else {
                queued_tokens.push(0);
                continue;
            };
            self.recent.push(slot, &r.blocks, self.ranks);
            if let Some(session) = r.session {
                self.sessions.pin(session, leg.role, slot, r.at_us);
            }
            let load = self.load_mut(slot);
            load.tips.retain(|t| !t.end.continued_by(&r.blocks));
            for b in &r.blocks {
                *load.active.entry(*b).or_default() += 1;
            }
            load.inflight_blocks += r.blocks.len() as u64;
            let queued = if leg.role == Role::Decode {
                0
            } else {
                let cached = leg.overlap_blocks as u64 * bs as u64;
                (r.prompt_tokens as u64).saturating_sub(cached)
            };
            load.queued_prefill_tokens += queued;
            queued_tokens.push(queued);
        }
        let entry = InFlight {
            routed,
            queued_tokens,
            prefilled: false,
            order,
        };
        self.inflight.insert(r.request_id.clone(), entry);
    }

    fn prefilled(&mut self, p: &RequestPrefilled) {
        let Some(f) = self.inflight.get_mut(&p.request_id) else {
            return;
        };
        if f.prefilled {
            return;
        }
        f.prefilled = true;
        for (leg, queued) in f.routed.legs.iter().zip(&f.queued_tokens) {
            if let Some(load) = self
                .index
                .slot(&leg.worker)
                .and_then(|s| self.load.get_mut(s.index()))
            {
                load.queued_prefill_tokens = load.queued_prefill_tokens.saturating_sub(*queued);
            }
        }
    }

    fn finished(&mut self, fin: &RequestFinished, now_us: Micros) {
        let Some(f) = self.inflight.remove(&fin.request_id) else {
            return;
        };
        for (leg, queued) in f.routed.legs.iter().zip(&f.queued_tokens) {
            let Some(load) = self
                .index
                .slot(&leg.worker)
                .and_then(|s| self.load.get_mut(s.index()))
            else {
                continue;
            };
            if !f.prefilled {
                load.queued_prefill_tokens = load.queued_prefill_tokens.saturating_sub(*queued);
            }
            for b in &f.routed.blocks {
                if let Some(n) = load.active.get_mut(b) {
                    *n -= 1;
                    if *n == 0 {
                        load.active.remove(b);
                    }
                }
            }
            load.inflight_blocks = load
                .inflight_blocks
                .saturating_sub(f.routed.blocks.len() as u64);
            if let Some(end) = PromptEnd::of(&f.routed.blocks) {
                if load.tips.len() >= MAX_TIPS {
                    load.tips.pop_front();
                }
                load.tips.push_back(Tip { end, at_us: now_us });
            }
        }
    }
}

/// Where `link`'s kvd sits in `index`, for worker `w`.
fn kvd_at(index: &KvIndex, link: Option<&KvdLink>, w: &WorkerRecord) -> Option<KvdAt> {
    let link = link?;
    Some(KvdAt {
        slot: index.slot(&link.source())?,
        compat_key: Arc::from(link.compat_key.as_str()),
        prefill_tokens_per_s: w.prefill_tokens_per_s(),
    })
}

fn rank_range(w: &WorkerRecord) -> std::ops::Range<u32> {
    w.dp_rank..w.dp_rank + w.dp_size.max(1)
}

impl Projection for FleetState {
    fn apply(&mut self, env: &Envelope) {
        match &env.event {
            Event::WorkerRegistered(r) => self.register(&r.record),
            Event::WorkerDeregistered(d) => self.deregister(&d.worker),
            Event::WorkerDraining(d) => self.drain(d),
            Event::KvBlocksStored(_) | Event::KvBlocksRemoved(_) | Event::KvCacheCleared(_) => {
                self.index.apply(env)
            }
            Event::RequestRouted(r) => self.routed(r),
            Event::RequestPrefilled(p) => self.prefilled(p),
            Event::RequestFinished(f) => self.finished(f, env.ts_us),
            // A v3 snapshot's recent-pick window: nothing to fold (see the module docs).
            Event::RecentLoad(_) => {}
            Event::TierLoadMeasured(m) => self.tier_load_measured(m),
            // The router's, not the fleet's (`Kernel::commit_with`).
            Event::RouterRetuned(_) => {}
        }
    }

    /// Workers (each draining one followed by its `WorkerDraining`), then the index, then the
    /// requests in flight in pick order (each followed by its `RequestPrefilled` when it had
    /// one), so that rebuilding reproduces the drains and the in-flight load exactly. Its size is
    /// the fleet's state (workers, cached blocks, requests in flight), not the request rate.
    fn dump(&self) -> Vec<Event> {
        let mut out: Vec<Event> = Vec::with_capacity(self.workers.len() + self.draining.len());
        for w in self.workers.values() {
            out.push(Event::WorkerRegistered(WorkerRegistered {
                record: w.clone(),
            }));
            if let Some(reason) = self.draining.get(&w.worker_id) {
                out.push(Event::WorkerDraining(WorkerDraining {
                    worker: w.worker_id.clone(),
                    reason: reason.clone(),
                }));
            }
        }
        out.extend(self.index.dump());
        out.extend(self.kvds.dump().map(Event::TierLoadMeasured));
        let mut picks: Vec<&InFlight> = self.inflight.values().collect();
        picks.sort_by_key(|f| f.order);
        out.reserve(2 * picks.len() + 1);
        for f in picks {
            out.push(Event::RequestRouted(f.routed.clone()));
            if f.prefilled {
                out.push(Event::RequestPrefilled(RequestPrefilled {
                    request_id: f.routed.request_id.clone(),
                }));
            }
        }
        out
    }
}

/// A rank's load as compared by [`PartialEq`]: sorted active blocks and queued prefill tokens.
type LoadView = (Vec<(BlockHash, u32)>, u64);

/// Logical equality: same workers (and drains), index content and in-flight load. Internal
/// counters (pick numbers) may differ between a state and its rebuild.
impl PartialEq for FleetState {
    fn eq(&self, other: &Self) -> bool {
        let inflight = |s: &Self| -> BTreeMap<RequestId, (RequestRouted, Vec<u64>, bool)> {
            s.inflight
                .iter()
                .map(|(k, f)| {
                    (
                        k.clone(),
                        (f.routed.clone(), f.queued_tokens.clone(), f.prefilled),
                    )
                })
                .collect()
        };
        let load = |s: &Self| -> BTreeMap<Option<WorkerRank>, LoadView> {
            s.load
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.active.is_empty() || l.queued_prefill_tokens > 0)
                .map(|(slot, l)| {
                    let mut a: Vec<(BlockHash, u32)> =
                        l.active.iter().map(|(b, n)| (*b, *n)).collect();
                    a.sort();
                    let rank = s.index.worker_of(WorkerSlot(slot as u32)).cloned();
                    (rank, (a, l.queued_prefill_tokens))
                })
                .collect()
        };
        self.config == other.config
            && self.workers == other.workers
            && self.draining == other.draining
            && self.index == other.index
            && self.kvds == other.kvds
            && inflight(self) == inflight(other)
            && load(self) == load(other)
    }
}

mod kvd;
mod recent;
pub mod sessions;
#[cfg(test)]
mod tests;
