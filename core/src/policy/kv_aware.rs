//! `kv-aware`: the cheapest candidate by the cost in the [module docs](super), or one drawn by
//! a softmax over the costs when `--router-temperature` is above 0.

use super::cost::{self, Scratch, Weights, score_candidates};
use super::{Leg, Pick, Policy, PolicySpec, RouteError, RouterConfig};
use crate::event::CandidateScore;
use crate::rng::Rng;

pub(super) const SPEC: PolicySpec = PolicySpec {
    name: "kv-aware",
    about: "Lowest cost: blocks to prefill (weighted) plus current load.",
    needs_prefix: true,
    build,
};

fn build(config: &RouterConfig) -> Box<dyn Policy> {
    Box::new(KvAware {
        resident_weight: config.resident_weight,
        balance_tokens: f64::from(config.balance_tokens),
        tiers: config.tier_weights,
        temperature: config.temperature,
        record_top: config.record_top,
        rng: Rng::new(config.seed),
        scratch: Scratch::default(),
    })
}

#[derive(Debug)]
struct KvAware {
    resident_weight: f64,
    balance_tokens: f64,
    tiers: super::TierWeights,
    temperature: f64,
    record_top: usize,
    rng: Rng,
    scratch: Scratch,
}

impl Policy for KvAware {
    fn pick(&mut self, leg: &Leg<'_>) -> Result<Pick, RouteError> {
        let weights = Weights {
            overlap: leg.overlap_weight,
            resident: self.resident_weight,
            balance_tokens: self.balance_tokens,
            tiers: self.tiers,
        };
        let scored = score_candidates(
            leg.fleet,
            leg.req,
            leg.candidates,
            weights,
            leg.now_us,
            &mut self.scratch,
        )?;
        let candidate = cost::choose(&scored, self.temperature, leg.session, &mut self.rng);
        let mut order: Vec<usize> = (0..scored.len()).collect();
        order.sort_by(|a, b| scored[*a].cost.total_cmp(&scored[*b].cost));
        let top = order
            .into_iter()
            .take(self.record_top)
            .map(|i| CandidateScore {
                worker: scored[i].candidate.rank.clone(),
                overlap_blocks: scored[i].overlap,
                cost: scored[i].cost,
            })
            .collect();
        Ok(Pick {
            candidate,
            overlap_blocks: Some(scored[candidate].overlap),
            top,
        })
    }
}
