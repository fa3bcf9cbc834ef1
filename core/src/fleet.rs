//! `FleetState`: the router's whole view of the fleet, as a projection of the event log.
//!
//! It owns the workers (by model and role, with their block sizes), the [`KvIndex`], and the load
//! the router itself put on each worker rank:
//! - `active_blocks`: distinct blocks of in-flight requests (a prefix shared by two requests on the
//!   same rank counts once; refcounted per block);
//! - `recent_blocks`: a decayed charge of recent picks (half-life [`FleetConfig::recent_half_life_us`]),
//!   so that a burst decided before any KV event arrives still spreads;
//! - `queued_prefill_tokens`: prompt tokens routed to a rank and not yet prefilled.
//!
//! The recent charge is kept per time bucket and rank, never per request: a finished request
//! leaves nothing behind but its share of a bucket, and a dump writes the window as one
//! `RecentLoad`, so memory and snapshots scale with the fleet, not with the request rate.
//!
//! # Draining
//! A `WorkerDraining` marks a registered worker as shutting down: it stays listed
//! ([`FleetState::workers`], [`FleetState::worker`]), keeps its index entries and the load of its
//! in-flight requests (they finish there), but leaves the routing candidates and is not counted by
//! [`FleetState::worker_count`]. A later `WorkerRegistered` for it un-drains it; a
//! `WorkerDeregistered` forgets it. A `WorkerDraining` for a worker that is not registered changes
//! nothing.
//!
//! Invariants: only [`Projection::apply`] mutates it; the draining workers are a subset of the
//! registered ones; decay is evaluated from event timestamps carried in the events themselves
//! (`RequestRouted::at_us`), never from a wall clock, so a rebuild from a dump is identical and
//! replay is deterministic.

use crate::event::{
    Envelope, Event, RecentCharge, RecentLoad, RecentLoadBucket, RequestFinished, RequestPrefilled,
    RequestRouted, Role, WorkerDraining, WorkerRecord, WorkerRegistered,
};
use crate::ids::{BlockHash, RequestId, WorkerId, WorkerRank};
use crate::index::{KvIndex, WorkerSlot};
use crate::projection::Projection;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};

/// Tunables of the load accounting.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct FleetConfig {
    /// Half-life of the charge a pick leaves on its worker rank.
    pub recent_half_life_us: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            recent_half_life_us: 1_000_000,
        }
    }
}

/// How many half-lives a pick is remembered for (after that its charge is < 0.4 %).
const RECENT_HORIZON_HALF_LIVES: u64 = 8;

/// One routable unit as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub rank: WorkerRank,
    pub slot: WorkerSlot,
    pub role: Role,
    pub block_size: u32,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct RankLoad {
    /// Block → number of in-flight requests on this rank that contain it.
    active: FxHashMap<BlockHash, u32>,
    queued_prefill_tokens: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct InFlight {
    routed: RequestRouted,
    /// Per leg: the prompt tokens this leg still has to prefill.
    queued_tokens: Vec<u64>,
    prefilled: bool,
    order: u64,
}

/// Picks aggregated per time bucket (width = half-life / [`BUCKETS_PER_HALF_LIFE`]) and rank, so the
/// recent charge costs O(buckets × ranks) per decision, whatever the request rate.
#[derive(Debug, Clone, PartialEq)]
struct RecentBucket {
    bucket: u64,
    per_slot: Vec<(WorkerSlot, u64)>,
}

/// Resolution of the recent-pick window.
const BUCKETS_PER_HALF_LIFE: u64 = 8;

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
    /// Routable ranks per (model, role), rebuilt when the worker set changes.
    candidates: FxHashMap<(String, Role), Vec<Candidate>>,
    inflight: FxHashMap<RequestId, InFlight>,
    recent: VecDeque<RecentBucket>,
    latest_bucket: u64,
    picks: u64,
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

    /// Models served by at least one worker, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self
            .workers
            .values()
            .map(|w| w.model_name.clone())
            .collect();
        m.sort();
        m.dedup();
        m
    }

    /// Whether the model has dedicated prefill and decode pools (PD disaggregation).
    pub fn is_disaggregated(&self, model: &str) -> bool {
        let mut prefill = false;
        let mut decode = false;
        for w in self.workers.values().filter(|w| w.model_name == model) {
            prefill |= w.disagg_mode == Role::Prefill;
            decode |= w.disagg_mode == Role::Decode;
        }
        prefill && decode
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
                    };
                    let key = (w.model_name.clone(), role);
                    self.candidates.entry(key).or_default().push(c);
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

    /// The decayed charge of recent picks of `rank`, evaluated at `now_us`.
    pub fn recent_blocks(&self, rank: &WorkerRank, now_us: u64) -> f64 {
        let Some(slot) = self.index.slot(rank) else {
            return 0.0;
        };
        self.recent_by_slot(now_us)
            .get(slot.index())
            .copied()
            .unwrap_or(0.0)
    }

    /// Recent charges of every rank at once, indexed by slot (one pass; used per decision).
    pub fn recent_by_slot(&self, now_us: u64) -> Vec<f64> {
        let width = self.bucket_width_us();
        let hl = self.config.recent_half_life_us.max(1) as f64;
        let mut out = vec![0.0; self.load.len()];
        for b in &self.recent {
            let age = now_us.saturating_sub(b.bucket * width) as f64;
            let factor = (-age / hl * std::f64::consts::LN_2).exp();
            for (slot, blocks) in &b.per_slot {
                if out.len() <= slot.index() {
                    out.resize(slot.index() + 1, 0.0);
                }
                out[slot.index()] += *blocks as f64 * factor;
            }
        }
        out
    }

    fn bucket_width_us(&self) -> u64 {
        (self.config.recent_half_life_us / BUCKETS_PER_HALF_LIFE).max(1)
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
        self.rebuild_candidates();
    }

    /// Forgets the load on ranks that left routing. Decisions that involved them no longer load
    /// them: their legs are stripped from the stored decisions, so that a dump (which re-applies the
    /// stored decisions) reproduces exactly this state.
    fn drop_ranks(&mut self, gone: impl Fn(&WorkerRank) -> bool) {
        // Every slot that carries load: in-flight load, or a recent charge only (a window
        // restored from a snapshot charges ranks that have no request in flight).
        let charged = self.recent.iter().flat_map(|b| &b.per_slot);
        let slots = charged
            .map(|(s, _)| s.index() + 1)
            .max()
            .unwrap_or(0)
            .max(self.load.len());
        let gone_slots: Vec<WorkerSlot> = (0..slots as u32)
            .map(WorkerSlot)
            .filter(|s| self.index.worker_of(*s).is_some_and(&gone))
            .collect();
        for s in &gone_slots {
            if let Some(l) = self.load.get_mut(s.index()) {
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
        for b in self.recent.iter_mut() {
            b.per_slot.retain(|(slot, _)| !gone_slots.contains(slot));
        }
        self.recent.retain(|b| !b.per_slot.is_empty());
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
        self.latest_bucket = self.latest_bucket.max(r.at_us / self.bucket_width_us());
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
            self.charge_recent(r.at_us, slot, r.blocks.len() as u64);
            let load = self.load_mut(slot);
            for b in &r.blocks {
                *load.active.entry(*b).or_default() += 1;
            }
            let queued = if leg.role == Role::Decode {
                0
            } else {
                let cached = leg.overlap_blocks as u64 * bs as u64;
                (r.prompt_tokens as u64).saturating_sub(cached)
            };
            load.queued_prefill_tokens += queued;
            queued_tokens.push(queued);
        }
        self.prune_recent();
        let entry = InFlight {
            routed,
            queued_tokens,
            prefilled: false,
            order,
        };
        self.inflight.insert(r.request_id.clone(), entry);
    }

    fn charge_recent(&mut self, at_us: u64, slot: WorkerSlot, blocks: u64) {
        if blocks == 0 {
            return;
        }
        let bucket = at_us / self.bucket_width_us();
        // Buckets stay sorted; a late pick (older timestamp) lands in its own bucket.
        let pos = self.recent.partition_point(|b| b.bucket < bucket);
        if self.recent.get(pos).is_none_or(|b| b.bucket != bucket) {
            let fresh = RecentBucket {
                bucket,
                per_slot: Vec::new(),
            };
            self.recent.insert(pos, fresh);
        }
        if let Some(b) = self.recent.get_mut(pos) {
            match b.per_slot.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, n)) => *n += blocks,
                None => b.per_slot.push((slot, blocks)),
            }
        }
    }

    fn window_start_bucket(&self) -> u64 {
        self.latest_bucket
            .saturating_sub(BUCKETS_PER_HALF_LIFE * RECENT_HORIZON_HALF_LIVES)
    }

    fn prune_recent(&mut self) {
        let start = self.window_start_bucket();
        while self.recent.front().is_some_and(|b| b.bucket < start) {
            self.recent.pop_front();
        }
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

    fn finished(&mut self, fin: &RequestFinished) {
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
        }
    }

    /// Replaces the recent window with a snapshot's (see [`RecentLoad`]).
    fn recent_load(&mut self, r: &RecentLoad) {
        let width = self.bucket_width_us();
        self.latest_bucket = self.latest_bucket.max(r.latest_us / width);
        self.recent.clear();
        for b in &r.buckets {
            for c in &b.charges {
                if let Some(slot) = self.index.slot(&c.worker)
                    && self.serves(&c.worker)
                {
                    self.charge_recent(b.at_us, slot, c.blocks);
                }
            }
        }
        self.prune_recent();
    }
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
            Event::RequestFinished(f) => self.finished(f),
            Event::RecentLoad(r) => self.recent_load(r),
        }
    }

    /// Workers (each draining one followed by its `WorkerDraining`), then the index, then the
    /// requests in flight in pick order (each followed by its `RequestPrefilled` when it had
    /// one), then the recent-pick window ([`RecentLoad`]), so that rebuilding reproduces the
    /// drains, the in-flight load and the recent window exactly. Its size is the fleet's state
    /// (workers, cached blocks, requests in flight), not the request rate.
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
        if self.latest_bucket > 0 || !self.recent.is_empty() {
            let width = self.bucket_width_us();
            let buckets = self
                .recent
                .iter()
                .map(|b| RecentLoadBucket {
                    at_us: b.bucket * width,
                    charges: b
                        .per_slot
                        .iter()
                        .filter_map(|(slot, blocks)| {
                            Some(RecentCharge {
                                worker: self.index.worker_of(*slot)?.clone(),
                                blocks: *blocks,
                            })
                        })
                        .collect(),
                })
                .collect();
            out.push(Event::RecentLoad(RecentLoad {
                latest_us: self.latest_bucket * width,
                buckets,
            }));
        }
        out
    }
}

/// A recent-pick bucket as compared by [`PartialEq`]: ranks instead of slot numbers.
type RecentView = (u64, Vec<(Option<WorkerRank>, u64)>);
/// A rank's load as compared by [`PartialEq`]: sorted active blocks and queued prefill tokens.
type LoadView = (Vec<(BlockHash, u32)>, u64);

/// Logical equality: same workers (and drains), index content, in-flight load and recent window. Internal
/// counters (pick numbers) may differ between a state and its rebuild.
impl PartialEq for FleetState {
    fn eq(&self, other: &Self) -> bool {
        let recent = |s: &Self| -> Vec<RecentView> {
            s.recent
                .iter()
                .map(|b| {
                    let mut per_rank: Vec<(Option<WorkerRank>, u64)> = b
                        .per_slot
                        .iter()
                        .map(|(slot, n)| (s.index.worker_of(*slot).cloned(), *n))
                        .collect();
                    per_rank.sort();
                    (b.bucket, per_rank)
                })
                .collect()
        };
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
            && self.latest_bucket == other.latest_bucket
            && self.workers == other.workers
            && self.draining == other.draining
            && self.index == other.index
            && recent(self) == recent(other)
            && inflight(self) == inflight(other)
            && load(self) == load(other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{
        Engine, KvBlocksStored, RequestStatus, RequestTransport, RoutedLeg, Tier,
        WorkerDeregistered,
    };
    use crate::ids::EngineHash;

    pub(crate) fn record(id: &str, model: &str, role: Role, dp_size: u32) -> WorkerRecord {
        WorkerRecord {
            worker_id: WorkerId::new(id),
            url: format!("http://{id}"),
            model_name: model.to_owned(),
            engine: Engine::Vllm,
            disagg_mode: role,
            disagg_meta: None,
            kv_events_endpoint: None,
            kv_block_size: 16,
            dp_rank: 0,
            dp_size,
            request_transport: RequestTransport::Http,
            kv: None,
            extra: Default::default(),
        }
    }

    fn env(seq: u64, event: Event) -> Envelope {
        Envelope {
            v: 1,
            seq,
            ts_us: seq,
            source: None,
            event,
        }
    }

    fn routed(id: &str, rank: &WorkerRank, blocks: &[u64], at_us: u64) -> Event {
        Event::RequestRouted(RequestRouted {
            request_id: RequestId::new(id),
            model: "m".into(),
            legs: vec![RoutedLeg {
                worker: rank.clone(),
                role: Role::Mixed,
                overlap_blocks: 1,
            }],
            blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
            prompt_tokens: blocks.len() as u32 * 16,
            policy: "kv-aware".into(),
            weights: vec![],
            top: vec![],
            retention: None,
            at_us,
        })
    }

    /// A successful `RequestFinished` of `id` with no usage.
    fn finished(id: &str) -> Event {
        Event::RequestFinished(RequestFinished {
            request_id: RequestId::new(id),
            status: RequestStatus::Ok,
            ttft_us: None,
            tokens_in: 0,
            tokens_out: 0,
            cached_tokens: None,
        })
    }

    fn fleet_with_two() -> (FleetState, WorkerRank, WorkerRank) {
        let mut f = FleetState::new(FleetConfig::default());
        for (i, id) in ["a:1", "b:1"].iter().enumerate() {
            let ev = Event::WorkerRegistered(WorkerRegistered {
                record: record(id, "m", Role::Mixed, 1),
            });
            f.apply(&env(i as u64 + 1, ev));
        }
        (f, WorkerRank::new("a:1", 0), WorkerRank::new("b:1", 0))
    }

    #[test]
    fn candidates_follow_model_role_and_dp_ranks() {
        let mut f = FleetState::new(FleetConfig::default());
        let recs = [
            record("a:1", "m", Role::Mixed, 2),
            record("p:1", "m", Role::Prefill, 1),
            record("d:1", "m", Role::Decode, 1),
            record("x:1", "other", Role::Mixed, 1),
        ];
        for (i, r) in recs.iter().enumerate() {
            let ev = Event::WorkerRegistered(WorkerRegistered { record: r.clone() });
            f.apply(&env(i as u64 + 1, ev));
        }
        let mixed = f.candidates("m", Role::Mixed);
        assert_eq!(mixed.len(), 2);
        assert_eq!(mixed[1].rank, WorkerRank::new("a:1", 1));
        assert_eq!(f.candidates("m", Role::Prefill).len(), 1);
        assert!(f.is_disaggregated("m"));
        assert!(!f.is_disaggregated("other"));
        assert_eq!(f.models(), vec!["m".to_owned(), "other".to_owned()]);
        let gone = Event::WorkerDeregistered(WorkerDeregistered {
            worker: WorkerId::new("a:1"),
            reason: "test".into(),
        });
        f.apply(&env(9, gone));
        assert!(f.candidates("m", Role::Mixed).is_empty());
    }

    #[test]
    fn active_blocks_count_shared_prefixes_once_and_drain_on_finish() {
        let (mut f, a, _) = fleet_with_two();
        f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 10)));
        f.apply(&env(4, routed("r2", &a, &[1, 2, 4], 20)));
        assert_eq!(f.active_blocks(&a), 4);
        assert_eq!(f.queued_prefill_tokens(&a), 2 * (48 - 16));
        f.apply(&env(
            5,
            Event::RequestPrefilled(RequestPrefilled {
                request_id: RequestId::new("r1"),
            }),
        ));
        assert_eq!(f.queued_prefill_tokens(&a), 32);
        f.apply(&env(6, finished("r1")));
        assert_eq!(f.active_blocks(&a), 3);
        f.apply(&env(7, finished("r2")));
        assert_eq!(f.active_blocks(&a), 0);
        assert_eq!(f.queued_prefill_tokens(&a), 0);
        assert_eq!(f.inflight_requests(), 0);
    }

    #[test]
    fn recent_charge_decays_by_half_life() {
        let (mut f, a, b) = fleet_with_two();
        f.apply(&env(3, routed("r1", &a, &[1, 2, 3, 4], 0)));
        assert!((f.recent_blocks(&a, 0) - 4.0).abs() < 1e-9);
        assert!((f.recent_blocks(&a, 1_000_000) - 2.0).abs() < 1e-9);
        assert_eq!(f.recent_blocks(&b, 0), 0.0);
        let slot = f.index().slot(&a).expect("slot");
        let all = f.recent_by_slot(2_000_000);
        assert!((all[slot.index()] - 1.0).abs() < 1e-9);
    }

    #[test]
    fn dump_rebuilds_an_equal_state() {
        let (mut f, a, b) = fleet_with_two();
        let stored = Event::KvBlocksStored(KvBlocksStored {
            worker: a.clone(),
            tier: Tier::Gpu,
            block_size: 16,
            engine_hashes: vec![EngineHash(7), EngineHash(8)],
            router_hashes: vec![BlockHash(1), BlockHash(2)],
            parent: None,
        });
        f.apply(&env(3, stored));
        f.apply(&env(4, routed("r1", &a, &[1, 2, 3], 10)));
        f.apply(&env(5, routed("r2", &b, &[9], 20)));
        f.apply(&env(
            6,
            Event::RequestPrefilled(RequestPrefilled {
                request_id: RequestId::new("r2"),
            }),
        ));
        f.apply(&env(
            7,
            Event::RequestFinished(RequestFinished {
                request_id: RequestId::new("r1"),
                status: RequestStatus::Ok,
                ttft_us: Some(5),
                tokens_in: 48,
                tokens_out: 3,
                cached_tokens: Some(16),
            }),
        ));
        f.apply(&env(8, drain("b:1", "pod deleted")));
        let mut g = FleetState::new(FleetConfig::default());
        for (i, e) in f.dump().into_iter().enumerate() {
            g.apply(&env(i as u64 + 1, e));
        }
        assert_eq!(f, g);
        assert!((f.recent_blocks(&a, 50) - g.recent_blocks(&a, 50)).abs() < 1e-12);
        assert_eq!(g.drain_reason(&WorkerId::new("b:1")), Some("pod deleted"));
        assert_eq!(
            g.candidates("m", Role::Mixed),
            f.candidates("m", Role::Mixed)
        );
    }

    #[test]
    fn a_dump_keeps_finished_requests_only_as_their_recent_charge() {
        let (mut f, a, b) = fleet_with_two();
        // 10k requests over 2 s (inside the 8 s window), every one finished but the last.
        let mut seq = 3;
        for i in 0..10_000u64 {
            let rank = if i % 3 == 0 { &b } else { &a };
            f.apply(&env(
                seq,
                routed(&format!("r{i}"), rank, &[i, i + 1], i * 200),
            ));
            if i < 9_999 {
                f.apply(&env(seq + 1, finished(&format!("r{i}"))));
            }
            seq += 2;
        }
        let dump = f.dump();
        // Two workers, the one request in flight, and the window.
        assert_eq!(
            dump.len(),
            4,
            "{:?}",
            dump.iter().map(Event::kind).collect::<Vec<_>>()
        );
        let Some(Event::RecentLoad(window)) = dump.last() else {
            panic!("the dump ends with the recent window: {:?}", dump.last());
        };
        let charged: u64 = window
            .buckets
            .iter()
            .flat_map(|b| &b.charges)
            .map(|c| c.blocks)
            .sum();
        assert_eq!(charged, 20_000);
        let mut g = FleetState::new(FleetConfig::default());
        for (i, e) in dump.into_iter().enumerate() {
            g.apply(&env(i as u64 + 1, e));
        }
        assert_eq!(f, g);
        for rank in [&a, &b] {
            let (live, rebuilt) = (
                f.recent_blocks(rank, 2_500_000),
                g.recent_blocks(rank, 2_500_000),
            );
            assert!(
                live > 1_000.0 && (live - rebuilt).abs() < 1e-9,
                "{live} vs {rebuilt}"
            );
        }
        // The window keeps moving in the rebuilt state as in the live one.
        f.apply(&env(seq, routed("late", &a, &[1], 30_000_000)));
        g.apply(&env(seq, routed("late", &a, &[1], 30_000_000)));
        assert_eq!(f, g);
        assert!(g.recent_blocks(&b, 30_000_000) < 1e-9);
    }

    fn drain(id: &str, reason: &str) -> Event {
        Event::WorkerDraining(WorkerDraining {
            worker: WorkerId::new(id),
            reason: reason.into(),
        })
    }

    fn candidate_workers(f: &FleetState) -> Vec<&str> {
        f.candidates("m", Role::Mixed)
            .iter()
            .map(|c| c.rank.worker.as_str())
            .collect()
    }

    fn listed(f: &FleetState) -> Vec<&str> {
        f.workers().map(|w| w.worker_id.as_str()).collect()
    }

    #[test]
    fn a_draining_worker_stays_listed_and_loaded_but_is_no_candidate() {
        let (mut f, a, _) = fleet_with_two();
        f.apply(&env(3, routed("r1", &a, &[1, 2, 3], 10)));
        f.apply(&env(4, drain("a:1", "pod deleted")));
        assert_eq!(candidate_workers(&f), ["b:1"]);
        assert_eq!(listed(&f), ["a:1", "b:1"]);
        assert!(f.worker(&WorkerId::new("a:1")).is_some());
        assert!(f.is_draining(&WorkerId::new("a:1")));
        assert!(!f.is_draining(&WorkerId::new("b:1")));
        assert_eq!((f.worker_count(), f.draining_count()), (1, 1));
        // Its in-flight request still loads it, and finishes there.
        assert_eq!(f.active_blocks(&a), 3);
        assert_eq!(f.inflight_on(&a), 1);
        f.apply(&env(
            5,
            Event::RequestFinished(RequestFinished {
                request_id: RequestId::new("r1"),
                status: RequestStatus::Ok,
                ttft_us: None,
                tokens_in: 0,
                tokens_out: 0,
                cached_tokens: None,
            }),
        ));
        assert_eq!(f.active_blocks(&a), 0);
        // A second drain only updates the reason.
        f.apply(&env(6, drain("a:1", "again")));
        assert_eq!(f.drain_reason(&WorkerId::new("a:1")), Some("again"));
        assert_eq!(f.worker_count(), 1);
    }

    #[test]
    fn a_draining_worker_keeps_its_cached_blocks() {
        let (mut f, a, _) = fleet_with_two();
        let stored = Event::KvBlocksStored(KvBlocksStored {
            worker: a.clone(),
            tier: Tier::Gpu,
            block_size: 16,
            engine_hashes: vec![EngineHash(7)],
            router_hashes: vec![BlockHash(1)],
            parent: None,
        });
        f.apply(&env(3, stored));
        f.apply(&env(4, drain("a:1", "pod deleted")));
        assert_eq!(f.index().blocks_of(&a, Tier::Gpu), 1);
    }

    #[test]
    fn a_registration_cancels_a_drain() {
        let (mut f, _, _) = fleet_with_two();
        f.apply(&env(3, drain("a:1", "pod deleted")));
        let again = Event::WorkerRegistered(WorkerRegistered {
            record: record("a:1", "m", Role::Mixed, 1),
        });
        f.apply(&env(4, again));
        assert!(!f.is_draining(&WorkerId::new("a:1")));
        assert_eq!(candidate_workers(&f), ["a:1", "b:1"]);
        assert_eq!(f.worker_count(), 2);
    }

    #[test]
    fn deregistering_a_draining_worker_forgets_the_drain() {
        let (mut f, _, _) = fleet_with_two();
        f.apply(&env(3, drain("a:1", "pod deleted")));
        let gone = Event::WorkerDeregistered(WorkerDeregistered {
            worker: WorkerId::new("a:1"),
            reason: "pod deleted".into(),
        });
        f.apply(&env(4, gone));
        assert_eq!(listed(&f), ["b:1"]);
        assert_eq!((f.worker_count(), f.draining_count()), (1, 0));
        // Back under the same id, it is routable.
        let back = Event::WorkerRegistered(WorkerRegistered {
            record: record("a:1", "m", Role::Mixed, 1),
        });
        f.apply(&env(5, back));
        assert_eq!(candidate_workers(&f), ["a:1", "b:1"]);
    }

    #[test]
    fn draining_an_unknown_worker_changes_nothing() {
        let (mut f, _, _) = fleet_with_two();
        let before = f.clone();
        f.apply(&env(3, drain("z:1", "pod deleted")));
        assert_eq!(f, before);
        assert_eq!(f.draining_count(), 0);
        // It does not pre-drain a worker that registers later.
        let z = Event::WorkerRegistered(WorkerRegistered {
            record: record("z:1", "m", Role::Mixed, 1),
        });
        f.apply(&env(4, z));
        assert!(!f.is_draining(&WorkerId::new("z:1")));
        assert_eq!(candidate_workers(&f), ["a:1", "b:1", "z:1"]);
    }

    #[test]
    fn states_that_differ_only_in_a_drain_are_not_equal() {
        let (f, _, _) = fleet_with_two();
        let mut g = f.clone();
        g.apply(&env(3, drain("a:1", "pod deleted")));
        assert_ne!(f, g);
    }
}
