//! Sweeps: `--sweep KEY=V1,V2,...` (repeatable; several axes form a grid), run in parallel.
//!
//! Every numeric simulation option can be swept by its flag name (without `--`), plus
//! `router-policy`. Configurations run on a rayon pool (all cores by default) and come back in grid
//! order; ranking is the caller's.

use crate::sim::{self, SimConfig, SimError, SimResult, default_pd_split};
use crate::trace::Trace;
use infera_core::policy::PolicyKind;
use rayon::prelude::*;

/// One swept option and its values.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepAxis {
    pub key: String,
    pub values: Vec<String>,
}

/// The options `--sweep` accepts.
pub const SWEEPABLE: &[&str] = &[
    "kv-overlap-weight",
    "kv-prefill-overlap-weight",
    "kv-decode-overlap-weight",
    "router-temperature",
    "router-resident-weight",
    "router-balance-tokens",
    "router-policy",
    "workers",
    "prefill-workers",
    "decode-workers",
    "gpu-blocks",
    "host-blocks",
    "disk-blocks",
    "block-size",
    "max-batched-tokens",
    "max-seqs",
    "speedup",
    "seed",
    "kv-event-delay-ms",
    "frontend-ms",
];

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SweepError {
    #[error("invalid --sweep {0:?}: expected KEY=V1,V2,... (e.g. kv-overlap-weight=0,1,2)")]
    Syntax(String),
    #[error("--sweep cannot vary {key:?}; sweepable options: {}", SWEEPABLE.join(", "))]
    UnknownKey { key: String },
    #[error("--sweep {key}: {value:?} is not a valid value ({why})")]
    BadValue {
        key: String,
        value: String,
        why: String,
    },
    #[error("--sweep {0} is given twice")]
    Duplicate(String),
}

impl std::str::FromStr for SweepAxis {
    type Err = SweepError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (key, values) = s
            .split_once('=')
            .ok_or_else(|| SweepError::Syntax(s.to_owned()))?;
        let key = key.trim().trim_start_matches("--").to_owned();
        if !SWEEPABLE.contains(&key.as_str()) {
            return Err(SweepError::UnknownKey { key });
        }
        let values: Vec<String> = values
            .split(',')
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .collect();
        if values.is_empty() {
            return Err(SweepError::Syntax(s.to_owned()));
        }
        let axis = SweepAxis { key, values };
        // Validate every value now, before anything runs.
        let mut probe = SimConfig::default();
        for v in &axis.values {
            apply(&mut probe, &axis.key, v)?;
        }
        Ok(axis)
    }
}

fn num<T>(key: &str, value: &str, positive: bool) -> Result<T, SweepError>
where
    T: std::str::FromStr + PartialOrd + Default,
{
    let bad = |why: &str| SweepError::BadValue {
        key: key.into(),
        value: value.into(),
        why: why.into(),
    };
    let v: T = value
        .parse()
        .map_err(|_| bad("not a number of the right kind"))?;
    if positive && v <= T::default() {
        return Err(bad("must be positive"));
    }
    if v < T::default() {
        return Err(bad("must not be negative"));
    }
    Ok(v)
}

/// Sets one option on `cfg`.
pub fn apply(cfg: &mut SimConfig, key: &str, value: &str) -> Result<(), SweepError> {
    match key {
        "kv-overlap-weight" => cfg.router.overlap_weight = num(key, value, false)?,
        "kv-prefill-overlap-weight" => {
            cfg.router.prefill_overlap_weight = Some(num(key, value, false)?)
        }
        "kv-decode-overlap-weight" => {
            cfg.router.decode_overlap_weight = Some(num(key, value, false)?)
        }
        "router-temperature" => cfg.router.temperature = num(key, value, false)?,
        "router-resident-weight" => cfg.router.resident_weight = num(key, value, false)?,
        "router-balance-tokens" => cfg.router.balance_tokens = num(key, value, false)?,
        "router-policy" => {
            cfg.router.policy = PolicyKind::parse(value).map_err(|e| SweepError::BadValue {
                key: key.into(),
                value: value.into(),
                why: e.to_string(),
            })?
        }
        "workers" => cfg.workers = num(key, value, true)?,
        "prefill-workers" => {
            let p = num(key, value, true)?;
            cfg.pd = Some((p, cfg.pd.map(|x| x.1).unwrap_or(p)));
        }
        "decode-workers" => {
            let d = num(key, value, true)?;
            cfg.pd = Some((cfg.pd.map(|x| x.0).unwrap_or(d), d));
        }
        "gpu-blocks" => cfg.engine.gpu_blocks = num(key, value, true)?,
        "host-blocks" => cfg.tiers.host_blocks = num(key, value, false)?,
        "disk-blocks" => cfg.tiers.disk_blocks = num(key, value, false)?,
        "block-size" => cfg.engine.block_size = num(key, value, true)?,
        "max-batched-tokens" => cfg.engine.max_batched_tokens = num(key, value, true)?,
        "max-seqs" => cfg.engine.max_seqs = num(key, value, true)?,
        "speedup" => cfg.speedup = num(key, value, true)?,
        "seed" => cfg.router.seed = num(key, value, false)?,
        "kv-event-delay-ms" => {
            cfg.kv_event_delay_us = (num::<f64>(key, value, false)? * 1000.0) as u64
        }
        "frontend-ms" => cfg.frontend_us = (num::<f64>(key, value, false)? * 1000.0).round() as u64,
        _ => return Err(SweepError::UnknownKey { key: key.into() }),
    }
    Ok(())
}

/// Fills in what the flags imply: a PD weight without pool sizes simulates a PD fleet with the
/// default split of `workers`. Returns a note saying so, for the output.
pub fn resolve_pd(cfg: &mut SimConfig) -> Option<String> {
    let pd_weight =
        cfg.router.prefill_overlap_weight.is_some() || cfg.router.decode_overlap_weight.is_some();
    if cfg.pd.is_none() && pd_weight {
        let (p, d) = default_pd_split(cfg.workers);
        cfg.pd = Some((p, d));
        return Some(format!(
            "a PD weight was given without --prefill-workers/--decode-workers: simulating a PD fleet of {p} prefill + {d} decode workers (a quarter of --workers {} prefill)",
            cfg.workers
        ));
    }
    None
}

/// One point of the grid.
#[derive(Debug, Clone)]
pub struct Point {
    /// `key=value` pairs, or `base` without axes.
    pub label: String,
    pub values: Vec<(String, String)>,
    pub config: SimConfig,
}

/// The cartesian product of the axes over `base`, in order (last axis fastest).
pub fn grid(base: &SimConfig, axes: &[SweepAxis]) -> Result<Vec<Point>, SweepError> {
    for (i, a) in axes.iter().enumerate() {
        if axes[..i].iter().any(|b| b.key == a.key) {
            return Err(SweepError::Duplicate(a.key.clone()));
        }
    }
    let mut points = vec![Point {
        label: String::new(),
        values: Vec::new(),
        config: base.clone(),
    }];
    for axis in axes {
        let mut next = Vec::with_capacity(points.len() * axis.values.len());
        for p in &points {
            for v in &axis.values {
                let mut config = p.config.clone();
                apply(&mut config, &axis.key, v)?;
                let mut values = p.values.clone();
                values.push((axis.key.clone(), v.clone()));
                next.push(Point {
                    label: String::new(),
                    values,
                    config,
                });
            }
        }
        points = next;
    }
    for p in &mut points {
        p.label = if p.values.is_empty() {
            "base".into()
        } else {
            p.values
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
    }
    Ok(points)
}

/// Runs every point on the rayon pool; `done` is called as each finishes (for progress).
pub fn run_all(
    trace: &Trace,
    points: &[Point],
    done: &(dyn Fn() + Sync),
) -> Vec<Result<SimResult, SimError>> {
    points
        .par_iter()
        .map(|p| {
            let r = sim::run(trace, &p.config);
            done();
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_axes_and_rejects_bad_ones() {
        let a: SweepAxis = "kv-overlap-weight=0,0.5,1".parse().expect("axis");
        assert_eq!(a.values, vec!["0", "0.5", "1"]);
        assert!(matches!(
            "nope=1".parse::<SweepAxis>(),
            Err(SweepError::UnknownKey { .. })
        ));
        assert!(matches!(
            "workers".parse::<SweepAxis>(),
            Err(SweepError::Syntax(_))
        ));
        assert!(matches!(
            "workers=0".parse::<SweepAxis>(),
            Err(SweepError::BadValue { .. })
        ));
        assert!(matches!(
            "kv-overlap-weight=-1".parse::<SweepAxis>(),
            Err(SweepError::BadValue { .. })
        ));
        assert!(matches!(
            "router-policy=random".parse::<SweepAxis>(),
            Err(SweepError::BadValue { .. })
        ));
    }

    #[test]
    fn grid_is_a_cartesian_product_in_order() {
        let axes: Vec<SweepAxis> = ["kv-overlap-weight=0,1", "workers=2,4,8"]
            .iter()
            .map(|s| s.parse().expect("axis"))
            .collect();
        let g = grid(&SimConfig::default(), &axes).expect("grid");
        assert_eq!(g.len(), 6);
        assert_eq!(g[0].label, "kv-overlap-weight=0 workers=2");
        assert_eq!(g[5].label, "kv-overlap-weight=1 workers=8");
        assert_eq!(g[5].config.workers, 8);
        assert_eq!(g[5].config.router.overlap_weight, 1.0);
        let dup: Vec<SweepAxis> = ["workers=1", "workers=2"]
            .iter()
            .map(|s| s.parse().expect("a"))
            .collect();
        assert_eq!(
            grid(&SimConfig::default(), &dup).err(),
            Some(SweepError::Duplicate("workers".into()))
        );
    }

    #[test]
    fn pd_weight_without_pools_gets_the_default_split() {
        let mut c = SimConfig {
            workers: 8,
            ..Default::default()
        };
        c.router.prefill_overlap_weight = Some(20.0);
        let note = resolve_pd(&mut c).expect("note");
        assert_eq!(c.pd, Some((2, 6)));
        assert!(note.contains("2 prefill + 6 decode"));
        assert_eq!(resolve_pd(&mut c), None);
    }
}
