//! The discrete-event simulator behind `infera replay`.
//!
//! A fleet of simulated engines ([`EngineModel`]: paged KV cache, batch scheduler, timing model)
//! runs on a virtual clock. Requests arrive at their trace times and are routed by the same
//! [`Kernel`] that `infera server` uses (fleet projection, router, in-memory log, with the same
//! compaction); engines emit their KV changes as `KvBlocksStored` / `KvBlocksRemoved` events
//! committed on it, and the fleet state is the fold of that log, exactly as live. Nothing here
//! decides where a request goes.
//!
//! Timeline of one request: arrival → `RequestRouted` (appended and applied) → submitted to its
//! engine(s) → prefilled at the end of some step (`RequestPrefilled`; TTFT, plus the front end's
//! [`SimConfig::frontend_us`]) → finished (`RequestFinished`). KV events become visible to the
//! router `kv_event_delay_us` after the step that produced them, as a real engine's ZMQ events
//! would. In PD mode the prefill leg runs with one output token, then the decode leg starts on its
//! decode engine with the prompt's KV transferred. Under [`Playback::Sessions`] a session's turn
//! arrives when its predecessor finished plus its think time instead (see [`sessions`]).
//!
//! The router's queue ([`SimConfig::queue_threshold`]) is the server's: a request that arrives
//! while every worker of its model is saturated, or while others wait, waits in a
//! [`FairQueue`] (by tenant, deficit round robin on prompt tokens) and is routed when an event
//! leaves a worker below the threshold; its TTFT counts the wait. Before it, the tenants'
//! limits of `--api-keys` refuse what the server would answer 429 (see [`tenants`]).
//!
//! Conservation laws checked by the tests: every request finishes exactly once; per engine, blocks
//! stored = blocks resident + blocks removed.

mod config;
mod kvd;
mod sessions;
mod tenants;
mod tiers;

pub use config::{
    DEFAULT_FRONTEND_US, RequestOutcome, SimConfig, SimError, SimResult, default_pd_split,
};
pub use sessions::{Playback, SessionLinks};
pub use tiers::{LowerHits, TierChange, TierConfig, Tiers};

use crate::rules::{RequestShape, classify};
use crate::trace::Trace;
use infera_core::clock::{Clock, VirtualClock};
use infera_core::engine::{EngineConfig, EngineModel, KvChange, SimRequest, StepReport};
use infera_core::event::{
    Engine, Event, KvBlocksRemoved, KvBlocksStored, RequestFinished, RequestPrefilled,
    RequestStatus, RequestTransport, Retention, Role, Tier, WorkerRecord, WorkerRegistered,
};
use infera_core::ids::{BlockHash, EngineHash, RequestId, SessionKey, WorkerId, WorkerRank};
use infera_core::kernel::{Compaction, Kernel};
use infera_core::log::NewEvent;
use infera_core::policy::RouteRequest;
use infera_core::tenancy::queue::{FairQueue, QUANTUM};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    StepDone(usize),
    KvVisible(usize),
    /// The end of a run of quiet decode steps (engine, generation).
    QuietDone(usize, u64),
}

/// A run of quiet decode steps in progress on one engine: `steps` steps of `step_us` from
/// `start_us`. A submission to the engine cuts it short at the next step boundary.
#[derive(Debug, Clone, Copy)]
struct QuietRun {
    start_us: u64,
    steps: u64,
    step_us: u64,
    generation: u64,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    trace: &'a Trace,
    clock: Arc<VirtualClock>,
    kernel: Kernel,
    engines: Vec<EngineModel>,
    tiers: Vec<Tiers>,
    /// Each worker's node kvd (its pseudo worker rank), when lower tiers are simulated.
    kvds: Vec<Option<WorkerRank>>,
    names: Vec<WorkerRank>,
    index_of: rustc_hash::FxHashMap<WorkerRank, usize>,
    busy: Vec<bool>,
    quiet: Vec<Option<QuietRun>>,
    quiet_generation: u64,
    pending: Vec<Option<StepReport>>,
    kv_batches: Vec<Option<Vec<NewEvent>>>,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    out: Vec<RequestOutcome>,
    /// For PD: the decode engine of each request, started when its prefill leg finishes.
    decode_of: Vec<Option<usize>>,
    done: Vec<bool>,
    first_token_us: Vec<u64>,
    ledger: Vec<(u64, u64)>,
    events: u64,
    makespan_us: u64,
    block_size: u32,
    links: SessionLinks,
    /// With [`SimConfig::identity_blind`]: each engine block's id as the blind router hashes
    /// it (identity-free), to translate the engines' KV events into its view.
    blind_view: rustc_hash::FxHashMap<BlockHash, BlockHash>,
    /// The router's queue, per model (see the module docs), and how many wait in it.
    waiting: rustc_hash::FxHashMap<String, FairQueue<usize>>,
    waiters: usize,
    /// The tenants' limits, priorities and weights (see [`tenants`]).
    gate: tenants::Gate,
}

/// Runs one configuration over `trace`.
pub fn run(trace: &Trace, cfg: &SimConfig) -> Result<SimResult, SimError> {
    if trace.requests.is_empty() {
        return Err(SimError::EmptyTrace);
    }
    if let Some(w) = trace
        .requests
        .windows(2)
        .find(|w| w[1].arrival_us < w[0].arrival_us)
    {
        return Err(SimError::Invalid(format!(
            "trace arrivals must not decrease: {} at {} us comes after {} at {} us",
            w[1].request_id, w[1].arrival_us, w[0].request_id, w[0].arrival_us
        )));
    }
    let block_size = if cfg.engine.block_size == 0 {
        trace.requests[0].block_size.max(1)
    } else {
        cfg.engine.block_size
    };
    let engine_cfg = EngineConfig {
        block_size,
        ..cfg.engine.clone()
    };
    engine_cfg
        .validate()
        .map_err(|e| SimError::Invalid(e.to_string()))?;
    if !(cfg.speedup.is_finite() && cfg.speedup > 0.0) {
        return Err(SimError::Invalid(format!(
            "speedup must be above 0 (got {})",
            cfg.speedup
        )));
    }
    let pools: Vec<(Role, usize)> = match cfg.pd {
        Some((p, d)) => vec![(Role::Prefill, p), (Role::Decode, d)],
        None => vec![(Role::Mixed, cfg.workers)],
    };
    if pools.iter().any(|(_, n)| *n == 0) {
        return Err(SimError::Invalid(
            "every worker pool needs at least one worker".into(),
        ));
    }
    let clock = Arc::new(VirtualClock::new(0));
    let kernel = Kernel::new(
        cfg.fleet,
        cfg.router.clone(),
        clock.clone(),
        Compaction::Auto,
    );
    let n = trace.requests.len();
    let mut sim = Sim {
        cfg,
        trace,
        clock,
        kernel,
        engines: Vec::new(),
        tiers: Vec::new(),
        kvds: Vec::new(),
        names: Vec::new(),
        index_of: Default::default(),
        busy: Vec::new(),
        quiet: Vec::new(),
        quiet_generation: 0,
        pending: Vec::new(),
        kv_batches: Vec::new(),
        queue: BinaryHeap::new(),
        seq: 0,
        out: vec![RequestOutcome::default(); n],
        decode_of: vec![None; n],
        done: vec![false; n],
        first_token_us: vec![0; n],
        ledger: Vec::new(),
        events: 0,
        makespan_us: 0,
        block_size,
        links: SessionLinks::new(&trace.requests, cfg.playback),
        blind_view: rustc_hash::FxHashMap::default(),
        waiting: rustc_hash::FxHashMap::default(),
        waiters: 0,
        gate: tenants::Gate::new(cfg.api_keys.as_deref(), &cfg.tenant_weights, n)?,
    };
    let mut registrations = Vec::new();
    for (role, count) in pools {
        for i in 0..count {
            let id = format!("sim-{}-{i}:8000", role.as_str());
            let mut record = WorkerRecord {
                worker_id: WorkerId::new(id.clone()),
                url: format!("http://{id}"),
                model_name: trace_model(trace),
                engine: Engine::Vllm,
                disagg_mode: role,
                disagg_meta: None,
                kv_events_endpoint: None,
                kv_block_size: block_size,
                dp_rank: 0,
                dp_size: 1,
                request_transport: RequestTransport::Http,
                kv: None,
                extra: Default::default(),
            };
            record.set_prefill_budget(engine_cfg.max_batched_tokens);
            // Every worker serves every adapter of the trace.
            record.set_lora_adapters(&trace_adapters(trace));
            let tiers = Tiers::new(cfg.tiers);
            let kvd = tiers
                .enabled()
                .then(|| kvd::link(&mut record, &engine_cfg))
                .flatten();
            registrations.push(NewEvent::new(Event::WorkerRegistered(WorkerRegistered {
                record,
            })));
            if let Some(source) = &kvd {
                let speeds = kvd::speeds(source, &engine_cfg);
                registrations.extend(speeds.into_iter().map(NewEvent::new));
            }
            sim.kvds.push(kvd);
            let rank = WorkerRank::new(id, 0);
            sim.index_of.insert(rank.clone(), sim.names.len());
            sim.names.push(rank);
            sim.engines.push(
                EngineModel::try_new(engine_cfg.clone())
                    .map_err(|e| SimError::Invalid(e.to_string()))?,
            );
            sim.tiers.push(tiers);
            sim.busy.push(false);
            sim.quiet.push(None);
            sim.pending.push(None);
            sim.ledger.push((0, 0));
        }
    }
    sim.append(registrations);
    sim.run_loop();
    let block_ledger = sim
        .engines
        .iter()
        .zip(&sim.ledger)
        .map(|(e, (stored, removed))| (*stored, e.resident_blocks() as u64, *removed))
        .collect();
    Ok(SimResult {
        requests: sim.out,
        workers: sim.names.iter().map(|n| n.worker.0.clone()).collect(),
        block_ledger,
        events: sim.events,
        steps: sim.engines.iter().map(|e| e.stats().steps).sum(),
        makespan_us: sim.makespan_us,
        block_size,
    })
}

/// The distinct adapters the trace's requests run under, sorted.
fn trace_adapters(trace: &Trace) -> Vec<String> {
    let mut adapters: Vec<String> = trace
        .requests
        .iter()
        .filter_map(|r| r.lora.clone())
        .collect();
    adapters.sort_unstable();
    adapters.dedup();
    adapters
}

fn trace_model(trace: &Trace) -> String {
    trace
        .requests
        .first()
        .map(|r| r.model.clone())
        .unwrap_or_default()
}

impl Sim<'_> {
    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    fn append(&mut self, batch: Vec<NewEvent>) {
        self.events += batch.len() as u64;
        self.kernel.commit(batch);
    }

    fn arrival_us(&self, i: usize) -> u64 {
        (self.trace.requests[i].arrival_us as f64 / self.cfg.speedup) as u64
    }

    /// Timeline arrivals come straight from the (sorted) trace; the heap holds engine steps, KV
    /// deliveries and released session turns, so it stays as small as the fleet plus the open
    /// sessions. At equal times timeline arrivals go first.
    fn run_loop(&mut self) {
        let mut next_arrival = 0usize;
        let n = self.trace.requests.len();
        loop {
            while next_arrival < n && self.links.follows(next_arrival) {
                next_arrival += 1;
            }
            let heap_next = self.queue.peek().map(|Reverse((at, _, _))| *at);
            let arrival_next = (next_arrival < n).then(|| self.arrival_us(next_arrival));
            let ev = match (arrival_next, heap_next) {
                (None, None) => break,
                (Some(a), h) if h.is_none_or(|h| a <= h) => {
                    next_arrival += 1;
                    self.clock.set(a);
                    Ev::Arrive(next_arrival - 1)
                }
                _ => match self.queue.pop() {
                    Some(Reverse((at, _, ev))) => {
                        self.clock.set(at);
                        ev
                    }
                    None => break,
                },
            };
            match ev {
                Ev::Arrive(i) => self.arrive(i),
                Ev::StepDone(w) => {
                    self.step_done(w);
                    self.pump();
                }
                Ev::QuietDone(w, generation) => self.quiet_done(w, generation),
                Ev::KvVisible(b) => {
                    if let Some(batch) = self.kv_batches.get_mut(b).and_then(Option::take) {
                        self.append(batch);
                    }
                }
            }
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_us()
    }

    /// Engine blocks as the router hashes them (see [`SimConfig::identity_blind`]).
    fn router_view(&self, blocks: &[BlockHash]) -> Vec<BlockHash> {
        if self.cfg.identity_blind {
            blocks
                .iter()
                .map(|b| self.blind_view.get(b).copied().unwrap_or(*b))
                .collect()
        } else {
            blocks.to_vec()
        }
    }

    /// Request `i` arrives: it is refused by its tenant's limits, routed, or waits in the
    /// router's queue.
    fn arrive(&mut self, i: usize) {
        let now = self.now();
        let trace = self.trace;
        let r = &trace.requests[i];
        let out = &mut self.out[i];
        out.arrival_us = now;
        out.tenant = r.tenant.clone();
        let place = match self.gate.admit(i, r, now) {
            Ok(place) => place,
            Err(limit) => {
                // 429 at once, before the router's queue, as the server answers.
                out.index = i;
                out.request_id = r.request_id.clone();
                out.blocks = r.block_hashes.len() as u32;
                out.input_tokens = r.input_length;
                out.rejected = true;
                out.limited = Some(limit);
                out.finish_us = now + self.cfg.frontend_us;
                let finish_us = out.finish_us;
                self.done[i] = true;
                self.release_next(i, finish_us);
                return;
            }
        };
        if let Some(threshold) = self.cfg.queue_threshold {
            // An adapter's request names the adapter.
            let model = r.lora.as_deref().unwrap_or(&r.model);
            let busy = self.waiting.get(model).is_some_and(|q| !q.is_empty());
            if busy || !self.kernel.fleet().has_room(model, threshold) {
                let queue = self
                    .waiting
                    .entry(model.to_owned())
                    .or_insert_with(|| FairQueue::new(QUANTUM));
                queue.push(
                    place.priority,
                    &place.tenant,
                    place.weight,
                    u64::from(r.input_length),
                    i,
                );
                self.waiters += 1;
                return;
            }
        }
        self.route(i);
    }

    /// Routes the waiters of every model that has room again, in the queue's order.
    fn pump(&mut self) {
        let Some(threshold) = self.cfg.queue_threshold else {
            return;
        };
        if self.waiters == 0 {
            return;
        }
        let mut models: Vec<String> = self.waiting.keys().cloned().collect();
        models.sort();
        for model in models {
            while self.kernel.fleet().has_room(&model, threshold) {
                let Some(i) = self.waiting.get_mut(&model).and_then(FairQueue::pop) else {
                    break;
                };
                self.waiters -= 1;
                self.route(i);
            }
        }
    }

    /// Routes request `i` and submits it to its engine(s).
    fn route(&mut self, i: usize) {
        let now = self.now();
        let r = &self.trace.requests[i];
        let blocks = complete_blocks(r);
        // What the router hashes: the engine's blocks, or, for a router blind to adapters and
        // salts, the identity-free ids (the engines still key by identity).
        let routed = if self.cfg.identity_blind {
            let plain: Vec<BlockHash> = r
                .block_hashes
                .iter()
                .take(blocks.len())
                .map(|&h| BlockHash(h))
                .collect();
            self.blind_view
                .extend(blocks.iter().copied().zip(plain.iter().copied()));
            plain
        } else {
            blocks.clone()
        };
        let shape = RequestShape {
            input_length: r.input_length,
            output_length: r.output_length,
            blocks: r.block_hashes.len() as u32,
        };
        let (retention, ttl) = classify(&self.cfg.rules, r.retention, r.ttl_seconds, &shape);
        let kvd = if self.kvds.iter().any(Option::is_some) {
            kvd::request_hashes(self.block_size, &routed)
        } else {
            Vec::new()
        };
        let req = RouteRequest {
            request_id: RequestId::new(r.request_id.clone()),
            // An adapter's request names the adapter.
            model: r.lora.clone().unwrap_or_else(|| r.model.clone()),
            prompt_tokens: r.input_length,
            hashes: vec![(self.block_size, routed)],
            retention,
            per_worker: Default::default(),
            exclude: Vec::new(),
            session: r.session_id.as_deref().map(SessionKey::of),
            kvd,
        };
        let out = &mut self.out[i];
        out.index = i;
        out.request_id = r.request_id.clone();
        out.router_queue_us = now - out.arrival_us;
        out.blocks = r.block_hashes.len() as u32;
        out.input_tokens = r.input_length;
        out.output_tokens = r.output_length;
        out.retention = retention;
        let decision = match self.kernel.route(&req, None, now) {
            Ok(d) => d,
            Err(_) => {
                // Unreachable with a registered fleet serving the trace's model; count it as rejected.
                out.rejected = true;
                self.done[i] = true;
                self.gate.finish(i, now, 0);
                self.release_next(i, now);
                return;
            }
        };
        let legs = decision.legs.clone();
        self.append(vec![NewEvent::new(Event::RequestRouted(decision))]);
        let class = retention.unwrap_or(Retention::Long);
        let expires = ttl.map(|s| now + s as u64 * 1_000_000);
        let first = &legs[0];
        let w = self.index_of.get(&first.worker).copied().unwrap_or(0);
        self.out[i].worker = first.worker.worker.0.clone();
        self.out[i].overlap_blocks = first.overlap_blocks;
        if let Some(decode) = legs.get(1) {
            let d = self.index_of.get(&decode.worker).copied().unwrap_or(0);
            self.decode_of[i] = Some(d);
            self.out[i].decode_worker = Some(decode.worker.worker.0.clone());
        }
        self.tiers[w].note_use(&blocks, class, expires);
        let output = if self.decode_of[i].is_some() {
            1
        } else {
            r.output_length
        };
        let req = SimRequest {
            id: i as u64,
            blocks,
            prompt_tokens: r.input_length,
            output_tokens: output,
        };
        self.submit(w, req);
    }

    /// Hands a request to engine `w` and makes sure it will be considered at the next step
    /// boundary (cutting a quiet decode run short if one is in progress).
    fn submit(&mut self, w: usize, req: SimRequest) {
        self.engines[w].submit(req);
        if let Some(run) = self.quiet[w] {
            let now = self.now();
            // Steps started before now complete; the next one would have seen the request.
            let done = now
                .saturating_sub(run.start_us)
                .div_ceil(run.step_us.max(1))
                .max(1)
                .min(run.steps);
            if done < run.steps {
                self.quiet_generation += 1;
                let cut = QuietRun {
                    steps: done,
                    generation: self.quiet_generation,
                    ..run
                };
                self.quiet[w] = Some(cut);
                self.push(
                    run.start_us + done * run.step_us,
                    Ev::QuietDone(w, cut.generation),
                );
            }
        }
        self.kick(w);
    }

    /// Schedules the session turn waiting for request `i`, which its client saw end at `at`.
    fn release_next(&mut self, i: usize, at: u64) {
        if let Some(j) = self.links.next(i) {
            let think = self.trace.requests[j].think_time_us.unwrap_or(0);
            let think = (think as f64 / self.cfg.speedup) as u64;
            self.push(at.saturating_add(think), Ev::Arrive(j));
        }
    }

    fn quiet_done(&mut self, w: usize, generation: u64) {
        let Some(run) = self.quiet[w].filter(|r| r.generation == generation) else {
            return;
        };
        self.quiet[w] = None;
        self.engines[w].skip_quiet_steps(run.steps);
        self.busy[w] = false;
        self.makespan_us = self.makespan_us.max(self.now());
        self.kick(w);
    }

    /// Starts a step on an idle engine; a run of quiet decode steps is simulated as one event.
    fn kick(&mut self, w: usize) {
        if self.busy[w] {
            return;
        }
        let now = self.now();
        if !self.cfg.step_by_step
            && let Some((steps, step_us)) = self.engines[w].quiet_steps()
            && steps > 1
            && step_us > 0
        {
            self.quiet_generation += 1;
            let run = QuietRun {
                start_us: now,
                steps,
                step_us,
                generation: self.quiet_generation,
            };
            self.quiet[w] = Some(run);
            self.busy[w] = true;
            self.push(now + steps * step_us, Ev::QuietDone(w, run.generation));
            return;
        }
        let tiers = &mut self.tiers[w];
        let out = &mut self.out;
        let decode_of = &self.decode_of;
        let first_token_us = &self.first_token_us;
        let mut lookup = |id: u64, blocks: &[BlockHash]| {
            let i = id as usize;
            if decode_of[i] == Some(w) && first_token_us[i] > 0 {
                // The decode leg receives the whole prompt's KV from its prefill worker.
                return blocks.len();
            }
            let hits = tiers.lookup(blocks, now);
            out[i].host_hit_blocks = hits.host;
            out[i].disk_hit_blocks = hits.disk;
            (hits.host + hits.disk) as usize
        };
        match self.engines[w].step(&mut lookup) {
            Some(report) => {
                for id in &report.admitted {
                    let o = &mut self.out[*id as usize];
                    if o.queue_us == 0
                        && !(self.decode_of[*id as usize] == Some(w)
                            && self.first_token_us[*id as usize] > 0)
                    {
                        o.queue_us = now.saturating_sub(o.arrival_us);
                    }
                }
                self.busy[w] = true;
                let at = now + report.duration_us.max(1);
                self.pending[w] = Some(report);
                self.push(at, Ev::StepDone(w));
            }
            None => self.busy[w] = false,
        }
    }

    fn step_done(&mut self, w: usize) {
        self.busy[w] = false;
        let now = self.now();
        self.makespan_us = self.makespan_us.max(now);
        let Some(report) = self.pending[w].take() else {
            return;
        };
        let rank = self.names[w].clone();
        let mut kv = Vec::new();
        for change in &report.kv {
            match change {
                KvChange::Stored { parent, blocks } => {
                    self.ledger[w].0 += blocks.len() as u64;
                    kv.push(NewEvent::new(Event::KvBlocksStored(KvBlocksStored {
                        worker: rank.clone(),
                        tier: Tier::Gpu,
                        block_size: self.block_size,
                        engine_hashes: blocks.iter().map(|b| engine_hash(w, *b)).collect(),
                        router_hashes: self.router_view(blocks),
                        parent: parent.map(|p| engine_hash(w, p)),
                    })));
                }
                KvChange::Removed { blocks } => {
                    self.ledger[w].1 += blocks.len() as u64;
                    self.tiers[w].gpu_evicted(blocks, now);
                    kv.push(NewEvent::new(Event::KvBlocksRemoved(KvBlocksRemoved {
                        worker: rank.clone(),
                        tier: Tier::Gpu,
                        engine_hashes: blocks.iter().map(|b| engine_hash(w, *b)).collect(),
                        router_hashes: self.router_view(blocks),
                    })));
                }
                KvChange::Cleared => {}
            }
        }
        if let Some(source) = &self.kvds[w] {
            let changes = self.tiers[w].take_changes();
            let view = |b: BlockHash| self.router_view(&[b])[0];
            let events = kvd::events(source, &changes, view);
            kv.extend(events.into_iter().map(NewEvent::new));
        }
        if !kv.is_empty() {
            if self.cfg.kv_event_delay_us == 0 {
                self.append(kv);
            } else {
                self.kv_batches.push(Some(kv));
                let b = self.kv_batches.len() - 1;
                self.push(now + self.cfg.kv_event_delay_us, Ev::KvVisible(b));
            }
        }
        let mut lifecycle = Vec::new();
        for p in &report.prefilled {
            let i = p.id as usize;
            let is_decode_leg = self.decode_of[i] == Some(w) && self.first_token_us[i] > 0;
            if is_decode_leg {
                continue;
            }
            self.first_token_us[i] = now;
            let o = &mut self.out[i];
            o.ttft_us = now.saturating_sub(o.arrival_us) + self.cfg.frontend_us;
            o.gpu_hit_blocks = p.gpu_hit_blocks;
            o.cached_tokens = p.cached_tokens;
            // The engine loads at most what it had room for: trust its count, host first.
            o.host_hit_blocks = o.host_hit_blocks.min(p.lower_hit_blocks);
            o.disk_hit_blocks = o
                .disk_hit_blocks
                .min(p.lower_hit_blocks - o.host_hit_blocks);
            lifecycle.push(NewEvent::new(Event::RequestPrefilled(RequestPrefilled {
                request_id: RequestId::new(o.request_id.clone()),
            })));
        }
        for f in &report.finished {
            let i = f.id as usize;
            if let Some(d) = self.decode_of[i]
                && d != w
                && !f.rejected
                && !self.done[i]
                && self.first_token_us[i] > 0
                && !self.out[i].rejected
            {
                // Prefill leg done: the decode leg starts with the prompt's KV transferred.
                self.decode_of[i] = Some(d);
                let r = &self.trace.requests[i];
                let blocks = complete_blocks(r);
                let req = SimRequest {
                    id: i as u64,
                    blocks,
                    prompt_tokens: r.input_length,
                    output_tokens: r.output_length,
                };
                self.submit(d, req);
                continue;
            }
            if self.done[i] {
                continue;
            }
            self.done[i] = true;
            self.gate.finish(i, now, u64::from(f.output_tokens));
            let o = &mut self.out[i];
            o.rejected = f.rejected;
            o.finish_us = now + self.cfg.frontend_us;
            let finish_us = o.finish_us;
            self.release_next(i, finish_us);
            let o = &mut self.out[i];
            if o.output_tokens > 1 && !f.rejected {
                o.tpot_us = now.saturating_sub(self.first_token_us[i]) as f64
                    / (o.output_tokens - 1) as f64;
            }
            let status = if f.rejected {
                RequestStatus::Rejected
            } else {
                RequestStatus::Ok
            };
            lifecycle.push(NewEvent::new(Event::RequestFinished(RequestFinished {
                request_id: RequestId::new(o.request_id.clone()),
                status,
                ttft_us: (!f.rejected).then_some(o.ttft_us),
                tokens_in: o.input_tokens,
                tokens_out: f.output_tokens,
                cached_tokens: Some(o.cached_tokens),
            })));
        }
        if !lifecycle.is_empty() {
            self.append(lifecycle);
        }
        self.kick(w);
    }
}

/// The hashes of a request's complete prompt blocks: what a real engine caches, publishes and
/// matches (a trailing partial block, which Mooncake traces hash too, stays anonymous, as the
/// engine model's contract and the mock engine have it). Hit rates still count every block of
/// the trace in their denominator.
fn complete_blocks(r: &crate::trace::TraceRequest) -> Vec<BlockHash> {
    let complete = (r.input_length / r.block_size.max(1)) as usize;
    r.engine_blocks()
        .iter()
        .take(complete)
        .map(|h| BlockHash(*h))
        .collect()
}

/// The engine's own key for a block: salted per engine, as vLLM salts per process, so that the
/// index must resolve removals through its engine → router map exactly as it does live.
fn engine_hash(worker: usize, b: BlockHash) -> EngineHash {
    EngineHash(
        b.0 ^ (0xA5A5_0000_0000_0000u64
            .wrapping_add(worker as u64)
            .rotate_left(17)),
    )
}

#[cfg(test)]
mod tests;
