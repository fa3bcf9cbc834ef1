//! `round-robin`: each distinct candidate set takes its workers in turn. It needs no prefix, so
//! the service does not tokenize its requests.

use super::{Leg, Pick, Policy, PolicySpec, RouteError, RouterConfig};
use crate::fleet::Candidate;
use rustc_hash::FxHashMap;

pub(super) const SPEC: PolicySpec = PolicySpec {
    name: "round-robin",
    about: "Each worker in turn.",
    needs_prefix: false,
    build,
};

fn build(_: &RouterConfig) -> Box<dyn Policy> {
    Box::<RoundRobin>::default()
}

/// One cursor per candidate set: a model's set changes as workers join and leave, and two
/// models' sets rotate independently.
#[derive(Debug, Default)]
struct RoundRobin {
    cursors: FxHashMap<u64, u64>,
}

impl Policy for RoundRobin {
    fn pick(&mut self, leg: &Leg<'_>) -> Result<Pick, RouteError> {
        let cursor = self.cursors.entry(set_key(leg.candidates)).or_default();
        let candidate = (*cursor % leg.candidates.len() as u64) as usize;
        *cursor = cursor.wrapping_add(1);
        Ok(Pick {
            candidate,
            overlap_blocks: None,
            top: Vec::new(),
        })
    }
}

fn set_key(cands: &[Candidate]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for c in cands {
        h.update(c.rank.worker.as_str().as_bytes());
        h.update(&c.rank.dp_rank.to_le_bytes());
        h.update(&[0xff]);
    }
    h.digest()
}
