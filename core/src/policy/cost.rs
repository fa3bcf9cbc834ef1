//! The kv-aware cost of each candidate, and the choice among them (argmin or softmax).

use super::tiers::TierWeights;
use super::{RouteError, RouteRequest};
use crate::clock::Micros;
use crate::event::Tier;
use crate::fleet::{Candidate, FleetState};
use crate::ids::BlockHash;
use crate::index::WorkerSlot;
use crate::rng::Rng;

/// One candidate with its overlap, load and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub candidate: Candidate,
    /// Leading blocks the candidate holds or is computing (index + expected cache).
    pub overlap: u32,
    /// Blocks of its in-flight requests, summed over requests, plus the weighted blocks of the
    /// other conversations resident on it, plus the charge for its recent picks above the mean.
    pub load: f64,
    /// Blocks to prefill: the request's past `overlap`, less those its kvd tiers can load (at
    /// their credit, [`super::tiers`]), plus its queued prefill.
    pub prefill_blocks: f64,
    pub cost: f64,
}

/// Buffers reused across decisions.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    slots: Vec<WorkerSlot>,
    overlaps: Vec<u32>,
    picks: Vec<u32>,
}

/// The weights of a decision's cost terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Of the blocks to prefill (the overlap weight, scaled for the leg's role and retention).
    pub overlap: f64,
    /// Of the blocks of the other conversations resident on a candidate.
    pub resident: f64,
    /// Tokens to prefill that each recent pick a candidate took above the candidates' mean
    /// costs it (at the overlap weight).
    pub balance_tokens: f64,
    /// What a block found in a lower tier is worth ([`super::tiers`]).
    pub tiers: TierWeights,
}

/// Scores every candidate for `req` at `now_us` with the given weights.
pub fn score_candidates(
    fleet: &FleetState,
    req: &RouteRequest,
    cands: &[Candidate],
    weights: Weights,
    now_us: Micros,
    scratch: &mut Scratch,
) -> Result<Vec<Scored>, RouteError> {
    let mut out: Vec<Scored> = Vec::with_capacity(cands.len());
    // Candidates usually share one block size and rendering; group them so the index walks
    // each set of hashes once.
    let key = |c: &Candidate| (c.block_size, req.per_worker.variant_of(&c.rank.worker));
    let mut keys: Vec<(u32, Option<u32>)> = cands.iter().map(key).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut overlap_of = vec![0u32; cands.len()];
    for (bs, variant) in keys {
        let blocks: &[BlockHash] = req
            .blocks_of(variant, bs)
            .ok_or(RouteError::MissingBlockSize(bs))?;
        scratch.slots.clear();
        let members: Vec<usize> = (0..cands.len())
            .filter(|i| key(&cands[*i]) == (bs, variant))
            .collect();
        scratch.slots.extend(members.iter().map(|i| cands[*i].slot));
        fleet
            .index()
            .overlap(Tier::Gpu, blocks, &scratch.slots, &mut scratch.overlaps);
        for (k, i) in members.iter().enumerate() {
            let indexed = scratch.overlaps.get(k).copied().unwrap_or(0);
            overlap_of[*i] = fleet.expected_overlap_at(cands[*i].slot, blocks, indexed);
        }
    }
    let mean_picks = if weights.balance_tokens > 0.0 {
        let own = cands
            .first()
            .and_then(|c| req.blocks_for(&c.rank.worker, c.block_size))
            .unwrap_or(&[]);
        fleet.recent_picks(own, &mut scratch.picks);
        let picks = |c: &Candidate| scratch.picks.get(c.slot.index()).copied().unwrap_or(0);
        let total: u32 = cands.iter().map(picks).sum();
        f64::from(total) / cands.len().max(1) as f64
    } else {
        0.0
    };
    for (c, overlap) in cands.iter().zip(overlap_of) {
        let blocks = req.blocks_for(&c.rank.worker, c.block_size).unwrap_or(&[]);
        let request_blocks = blocks.len() as f64;
        let queued_blocks =
            fleet.queued_prefill_tokens_at(c.slot) as f64 / c.block_size.max(1) as f64;
        let credited = lower_tier_credit(fleet, req, c, overlap, &weights.tiers);
        let prefill_blocks = request_blocks - overlap as f64 - credited + queued_blocks;
        let mut load = fleet.inflight_blocks_at(c.slot) as f64;
        if weights.resident > 0.0 {
            load +=
                weights.resident * fleet.resident_blocks_at(c.slot, blocks, overlap, now_us) as f64;
        }
        if weights.balance_tokens > 0.0 {
            let picks = scratch.picks.get(c.slot.index()).copied().unwrap_or(0);
            let above = (f64::from(picks) - mean_picks).max(0.0);
            let per_pick = weights.balance_tokens / f64::from(c.block_size.max(1));
            load += weights.overlap * per_pick * above;
        }
        let cost = weights.overlap * prefill_blocks + load;
        out.push(Scored {
            candidate: c.clone(),
            overlap,
            load,
            prefill_blocks,
            cost,
        });
    }
    Ok(out)
}

/// The credited blocks of `req` past the GPU prefix `overlap` that `c`'s node kvd can load
/// (0 for a candidate without one, or a request without inventory hashes).
fn lower_tier_credit(
    fleet: &FleetState,
    req: &RouteRequest,
    c: &Candidate,
    overlap: u32,
    weights: &TierWeights,
) -> f64 {
    let Some(kvd) = fleet.kvd_at(c.slot) else {
        return 0.0;
    };
    let Some(blocks) = req.kvd_blocks(c.block_size, &kvd.compat_key) else {
        return 0.0;
    };
    let run = fleet.lower_tier_run(kvd.slot, blocks, overlap as usize);
    [Tier::Host, Tier::Disk, Tier::External]
        .into_iter()
        .filter(|t| run[t.index()] > 0)
        .map(|t| {
            let load = fleet.tier_load(kvd.slot, t);
            let credit = weights.credit(t, load, c.block_size, kvd.prefill_tokens_per_s);
            f64::from(run[t.index()]) * credit
        })
        .sum()
}

/// Relative tolerance under which two costs are a tie.
const TIE_EPS: f64 = 1e-9;

/// Picks an index into `scored` (non-empty). Temperature 0: the cheapest, ties to `session` (the
/// candidate the request's session is pinned to), then to the lower load, then uniformly at
/// random. Above 0: softmax over costs normalised by the cost range.
pub(super) fn choose(
    scored: &[Scored],
    temperature: f64,
    session: Option<usize>,
    rng: &mut Rng,
) -> usize {
    let min = scored.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
    let max = scored
        .iter()
        .map(|s| s.cost)
        .fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    if temperature > 0.0 && range > 0.0 {
        let weights: Vec<f64> = scored
            .iter()
            .map(|s| (-((s.cost - min) / range) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.next_f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        return scored.len() - 1;
    }
    let tol = TIE_EPS * min.abs().max(1.0);
    let tied: Vec<usize> = (0..scored.len())
        .filter(|i| scored[*i].cost <= min + tol)
        .collect();
    if let Some(s) = session.filter(|s| tied.contains(s)) {
        return s;
    }
    let min_load = tied
        .iter()
        .map(|i| scored[*i].load)
        .fold(f64::INFINITY, f64::min);
    let ltol = TIE_EPS * min_load.abs().max(1.0);
    let least: Vec<usize> = tied
        .into_iter()
        .filter(|i| scored[*i].load <= min_load + ltol)
        .collect();
    match least.len() {
        0 => 0, // only reachable with NaN costs, which validated weights cannot produce
        n => least[rng.below(n as u64) as usize],
    }
}
