//! The routing-quality suite (`cargo xtask bench routing`): standard traces through the
//! simulator under each policy, against two bounds, as one markdown table.
//!
//! For each [`SuiteTrace`], each of [`policies`] and `--tune`'s pick (the configuration
//! [`crate::tune::recommend`] chooses from the [`crate::tune::default_axes`] grid, labelled with
//! its flags) the suite reports the hit rate, TTFT p50 and p99 and the busiest worker's share over
//! the mean, and measures the hit rate against:
//! - the **ideal**: every block that any earlier request of the trace used is a hit (unlimited
//!   cache, arrival order; [`crate::trace::summarize`]);
//! - the **capacity-aware bound**: the same trace replayed on one worker that holds the whole
//!   fleet's pooled capacity (GPU blocks, batch tokens and sequences times the worker count), so
//!   no routing decision can split a prefix; what the fleet's memory allows, evictions
//!   included. It is itself a replay with its own timing (one engine's steps), so a fleet can
//!   beat it by a fraction of a point.
//!
//! Every configuration is independent and deterministic; they run on the caller's rayon pool and
//! come back in trace, then policy, order.

use crate::report::Summary;
use crate::sim::{self, SimConfig, SimError};
use crate::sweep::{self, Point};
use crate::trace::{Trace, summarize};
use crate::tune;
use infera_core::policy::{INFERA_PROFILE, PYTHON_PROFILE, PolicyKind};
use rayon::prelude::*;
use std::fmt::Write as _;

/// One trace of the suite and the fleet it is replayed on.
#[derive(Debug, Clone)]
pub struct SuiteTrace {
    pub name: String,
    pub trace: Trace,
    pub base: SimConfig,
}

/// One policy the suite compares: its label and the router settings it changes.
#[derive(Debug, Clone)]
pub struct Policy {
    pub label: String,
    pub kind: PolicyKind,
    pub overlap_weight: f64,
    pub resident_weight: f64,
    pub balance_tokens: u32,
    /// Credits nothing for blocks in a worker's kvd tiers (the GPU-only cost), where the
    /// default credits them by their measured load speed.
    pub gpu_only: bool,
}

/// The policies compared: every registered policy at the default tunables (the Python
/// Infera's, `--router-profile python`), then KV-aware at `--router-profile infera`'s, at two
/// other weights, with resident conversations counted, and with the GPU-only cost (no credit
/// for kvd tiers: the same as the default on a fleet without them).
pub fn policies() -> Vec<Policy> {
    let at = |label: String, kind, overlap_weight, resident_weight, balance_tokens| Policy {
        label,
        kind,
        overlap_weight,
        resident_weight,
        balance_tokens,
        gpu_only: false,
    };
    let d = PYTHON_PROFILE;
    let mut out: Vec<Policy> = PolicyKind::all()
        .map(|kind| {
            let label = if kind == PolicyKind::default() {
                format!("{kind} (default)")
            } else {
                kind.to_string()
            };
            at(
                label,
                kind,
                d.overlap_weight,
                d.resident_weight,
                d.balance_tokens,
            )
        })
        .collect();
    let kv = PolicyKind::KV_AWARE;
    let infera = INFERA_PROFILE;
    for (label, overlap, resident, balance) in [
        (
            "kv-aware, --router-profile infera (weight 16, balance 512 tokens)",
            infera.overlap_weight,
            infera.resident_weight,
            infera.balance_tokens,
        ),
        ("kv-aware, weight 4", 4.0, 0.0, 0),
        ("kv-aware, weight 16", 16.0, 0.0, 0),
        ("kv-aware, weight 4, resident weight 1", 4.0, 1.0, 0),
    ] {
        out.push(at(label.to_owned(), kv, overlap, resident, balance));
    }
    out.push(Policy {
        gpu_only: true,
        ..at(
            "kv-aware, GPU-only cost".to_owned(),
            kv,
            d.overlap_weight,
            d.resident_weight,
            d.balance_tokens,
        )
    });
    out
}

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
    c.router.policy = PolicyKind::ROUND_ROBIN;
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

/// One simulation of the suite: trace `t`'s bound, one of its [`policies`], or a point of its
/// `--tune` grid.
enum Job {
    Bound,
    Policy(usize),
    Tune(Box<Point>),
}

/// What one trace's simulations gave: its bound, its policies' and its grid's summaries.
#[derive(Default, Clone)]
struct Outcomes {
    bound: f64,
    policies: Vec<(String, Summary)>,
    grid: Vec<(String, Summary)>,
}

/// Runs every trace under every policy, its `--tune` grid and its bound, on the current rayon
/// pool. Rows come in trace order: the policies, then `--tune`'s pick.
///
/// # Errors
/// The first configuration the simulator refuses, naming the trace.
pub fn run(traces: &[SuiteTrace]) -> Result<Vec<SuiteRow>, SimError> {
    let compared = policies();
    let mut jobs: Vec<(usize, Job)> = Vec::new();
    for (t, st) in traces.iter().enumerate() {
        jobs.push((t, Job::Bound));
        jobs.extend((0..compared.len()).map(|p| (t, Job::Policy(p))));
        let grid = sweep::grid(&st.base, &tune::default_axes(&st.base))
            .map_err(|e| SimError::Invalid(format!("{}: {e}", st.name)))?;
        jobs.extend(grid.into_iter().map(|p| (t, Job::Tune(Box::new(p)))));
    }
    let results: Vec<Result<Summary, SimError>> = jobs
        .par_iter()
        .map(|(t, job)| {
            let st = &traces[*t];
            let cfg = match job {
                Job::Bound => pooled(&st.base),
                Job::Policy(p) => {
                    let policy = &compared[*p];
                    let mut c = st.base.clone();
                    c.router.policy = policy.kind;
                    c.router.overlap_weight = policy.overlap_weight;
                    c.router.resident_weight = policy.resident_weight;
                    c.router.balance_tokens = policy.balance_tokens;
                    if policy.gpu_only {
                        c.router.tier_weights.host = Some(0.0);
                        c.router.tier_weights.disk = Some(0.0);
                        c.router.tier_weights.external = Some(0.0);
                    }
                    c
                }
                Job::Tune(point) => point.config.clone(),
            };
            sim::run(&st.trace, &cfg)
                .map(|r| Summary::of(&r, 0.0))
                .map_err(|e| SimError::Invalid(format!("{}: {e}", st.name)))
        })
        .collect();
    let mut rows = Vec::new();
    let mut by_trace = vec![Outcomes::default(); traces.len()];
    for ((t, job), result) in jobs.into_iter().zip(results) {
        let s = result?;
        match job {
            Job::Bound => by_trace[t].bound = s.hit_rate,
            Job::Policy(p) => by_trace[t].policies.push((compared[p].label.clone(), s)),
            Job::Tune(point) => by_trace[t].grid.push((tune::flags(&point.values), s)),
        }
    }
    for (st, outcomes) in traces.iter().zip(by_trace) {
        let Outcomes {
            bound,
            policies,
            grid,
        } = outcomes;
        let ideal = summarize(&st.trace).ideal_hit_rate;
        let objs: Vec<tune::Objectives> =
            grid.iter().map(|(_, s)| tune::Objectives::of(s)).collect();
        let pick = tune::recommend(&objs).map(|i| {
            let (flags, s) = &grid[i];
            (format!("--tune's pick: {flags}"), s.clone())
        });
        for (policy, s) in policies.into_iter().chain(pick) {
            rows.push(SuiteRow {
                trace: st.name.clone(),
                workers: st.base.pd.map_or(st.base.workers, |(p, d)| p + d),
                policy,
                hit_rate: s.hit_rate,
                ideal,
                bound,
                ttft_p50_ms: s.ttft_p50_ms,
                ttft_p99_ms: s.ttft_p99_ms,
                max_share: s.imbalance,
            });
        }
    }
    Ok(rows)
}

/// The rows as a GitHub-flavoured markdown table.
pub fn markdown(rows: &[SuiteRow]) -> String {
    let mut out = String::from(
        "| trace | workers | policy | hit rate | ideal | capacity bound | of ideal | of bound | TTFT p50 | TTFT p99 | max share / mean |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
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
            "| {} | {} | {} | {:.1} % | {:.1} % | {:.1} % | {} | {} | {:.0} ms | {:.0} ms | {:.2}× |",
            r.trace,
            r.workers,
            r.policy,
            r.hit_rate * 100.0,
            r.ideal * 100.0,
            r.bound * 100.0,
            pct(r.hit_rate, r.ideal),
            pct(r.hit_rate, r.bound),
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
        assert_eq!(rows.len(), policies().len() + 1);
        assert!(
            rows[policies().len()]
                .policy
                .starts_with("--tune's pick: --kv-overlap-weight ")
        );
        for r in &rows {
            assert!(r.hit_rate <= r.ideal + 1e-9, "{r:?}");
            assert!(r.bound > 0.0 && r.bound <= r.ideal + 1e-9, "{r:?}");
        }
        let row = |label: &str| {
            rows.iter()
                .find(|r| r.policy == label)
                .unwrap_or_else(|| panic!("no {label} row"))
        };
        assert!(
            row("kv-aware (default)").hit_rate > row("round-robin").hit_rate,
            "kv-aware beats round-robin"
        );
        let table = markdown(&rows);
        assert_eq!(table.lines().count(), 3 + policies().len());
        assert!(table.contains("| agentic | 2 | round-robin |"), "{table}");
    }
}
