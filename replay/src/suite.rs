//! The routing-quality suite (`cargo xtask bench routing`): standard traces through the
//! simulator under each policy, against two bounds, as one markdown table.
//!
//! For each [`SuiteTrace`] and each [`POLICIES`] entry the suite reports the hit rate, TTFT p50
//! and p99 and the busiest worker's share over the mean, and measures the hit rate against:
//! - the **ideal**: every block that any earlier request of the trace used is a hit (unlimited
//!   cache, arrival order; [`crate::trace::summarize`]);
//! - the **capacity-aware bound**: the same trace replayed on one worker that holds the whole
//!   fleet's pooled capacity (GPU blocks, batch tokens and sequences times the worker count), so
//!   no routing decision can split a prefix; what the fleet's memory allows, evictions
//!   included.
//!
//! Every configuration is independent and deterministic; they run on the caller's rayon pool and
//! come back in trace, then policy, order.

use crate::report::Summary;
use crate::sim::{self, SimConfig, SimError};
use crate::trace::{Trace, summarize};
use infera_core::policy::PolicyKind;
use rayon::prelude::*;
use std::fmt::Write as _;

/// One trace of the suite and the fleet it is replayed on.
#[derive(Debug, Clone)]
pub struct SuiteTrace {
    pub name: String,
    pub trace: Trace,
    pub base: SimConfig,
}

/// The policies compared: round-robin, then KV-aware at the default weight and two higher ones.
pub const POLICIES: [(&str, PolicyKind, f64); 4] = [
    ("round-robin", PolicyKind::RoundRobin, 1.0),
    ("kv-aware, weight 1 (default)", PolicyKind::KvAware, 1.0),
    ("kv-aware, weight 4", PolicyKind::KvAware, 4.0),
    ("kv-aware, weight 16", PolicyKind::KvAware, 16.0),
];

/// One line of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteRow {
    pub trace: String,
    pub workers: usize,
    pub policy: String,
    pub hit_rate: f64,
    pub ideal: f64,
    pub bound: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// The busiest worker's share over the mean share.
    pub max_share: f64,
}

/// One worker holding the fleet's pooled capacity (see the module docs).
pub fn pooled(base: &SimConfig) -> SimConfig {
    let n = base.pd.map_or(base.workers, |(p, d)| p + d).max(1);
    let mut c = base.clone();
    c.workers = 1;
    c.pd = None;
    c.router.policy = PolicyKind::RoundRobin;
    c.engine.gpu_blocks = base.engine.gpu_blocks.saturating_mul(n);
    c.engine.max_batched_tokens = base
        .engine
        .max_batched_tokens
        .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX));
    c.engine.max_seqs = base
        .engine
        .max_seqs
        .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX));
    c
}

/// Runs every trace under every policy, and each trace's bound, on the current rayon pool.
///
/// # Errors
/// The first configuration the simulator refuses, naming the trace.
pub fn run(traces: &[SuiteTrace]) -> Result<Vec<SuiteRow>, SimError> {
    // Job `(t, None)` is trace t's bound; `(t, Some(p))` its run under policy p.
    let jobs: Vec<(usize, Option<usize>)> = (0..traces.len())
        .flat_map(|t| {
            std::iter::once((t, None)).chain((0..POLICIES.len()).map(move |p| (t, Some(p))))
        })
        .collect();
    let results: Vec<Result<Summary, SimError>> = jobs
        .par_iter()
        .map(|&(t, policy)| {
            let st = &traces[t];
            let cfg = match policy {
                None => pooled(&st.base),
                Some(p) => {
                    let mut c = st.base.clone();
                    c.router.policy = POLICIES[p].1;
                    c.router.overlap_weight = POLICIES[p].2;
                    c
                }
            };
            sim::run(&st.trace, &cfg)
                .map(|r| Summary::of(&r, 0.0))
                .map_err(|e| SimError::Invalid(format!("{}: {e}", st.name)))
        })
        .collect();
    let ideals: Vec<f64> = traces
        .iter()
        .map(|t| summarize(&t.trace).ideal_hit_rate)
        .collect();
    let mut rows = Vec::new();
    let mut bound = 0.0;
    for ((t, policy), result) in jobs.into_iter().zip(results) {
        let s = result?;
        let st = &traces[t];
        let Some(p) = policy else {
            bound = s.hit_rate;
            continue;
        };
        rows.push(SuiteRow {
            trace: st.name.clone(),
            workers: st.base.pd.map_or(st.base.workers, |(p, d)| p + d),
            policy: POLICIES[p].0.to_owned(),
            hit_rate: s.hit_rate,
            ideal: ideals[t],
            bound,
            ttft_p50_ms: s.ttft_p50_ms,
            ttft_p99_ms: s.ttft_p99_ms,
            max_share: s.imbalance,
        });
    }
    Ok(rows)
}

/// The rows as a GitHub-flavoured markdown table.
pub fn markdown(rows: &[SuiteRow]) -> String {
    let mut out = String::from(
        "| trace | workers | policy | hit rate | of ideal | of capacity bound | TTFT p50 | TTFT p99 | max share / mean |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let pct = |x: f64, of: f64| {
        if of > 0.0 {
            format!("{:.0} %", x / of * 100.0)
        } else {
            "–".to_owned()
        }
    };
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} % | {} (ideal {:.1} %) | {} (bound {:.1} %) | {:.0} ms | {:.0} ms | {:.2}× |",
            r.trace,
            r.workers,
            r.policy,
            r.hit_rate * 100.0,
            pct(r.hit_rate, r.ideal),
            r.ideal * 100.0,
            pct(r.hit_rate, r.bound),
            r.bound * 100.0,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.max_share
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::synth::{SynthConfig, synthesize};

    #[test]
    fn the_pooled_worker_holds_the_fleets_capacity() {
        let mut base = SimConfig {
            workers: 4,
            ..SimConfig::default()
        };
        base.engine.gpu_blocks = 100;
        let p = pooled(&base);
        assert_eq!((p.workers, p.pd, p.engine.gpu_blocks), (1, None, 400));
        assert_eq!(p.engine.max_seqs, base.engine.max_seqs * 4);
        let pd = pooled(&SimConfig {
            pd: Some((1, 2)),
            ..base
        });
        assert_eq!(pd.engine.gpu_blocks, 300);
    }

    #[test]
    fn a_small_suite_reports_each_policy_against_both_bounds() {
        let trace = synthesize(&SynthConfig {
            sessions: 8,
            concurrency: 3.0,
            min_turns: 3,
            max_turns: 6,
            ..SynthConfig::default()
        })
        .expect("trace");
        let mut base = SimConfig {
            workers: 2,
            ..SimConfig::default()
        };
        base.engine.gpu_blocks = 4096;
        let rows = run(&[SuiteTrace {
            name: "agentic".into(),
            trace,
            base,
        }])
        .expect("suite");
        assert_eq!(rows.len(), POLICIES.len());
        for r in &rows {
            assert!(r.hit_rate <= r.ideal + 1e-9, "{r:?}");
            assert!(r.bound > 0.0 && r.bound <= r.ideal + 1e-9, "{r:?}");
        }
        assert!(
            rows[1].hit_rate > rows[0].hit_rate,
            "kv-aware beats round-robin"
        );
        let table = markdown(&rows);
        assert_eq!(table.lines().count(), 2 + POLICIES.len());
        assert!(table.contains("| agentic | 2 | round-robin |"), "{table}");
    }
}
