//! `infera replay --tune`: a search of the router's tunables over one trace, its Pareto front and
//! the flags to use.
//!
//! The search is a [`crate::sweep`] grid: the caller's `--sweep` axes when given, otherwise
//! [`default_axes`] (the KV-overlap weight, or the PD prefill weight on a PD fleet, against the
//! resident-conversation weight and the balance charge in tokens; the router temperature is searched when
//! asked for with `--sweep`: no trace of the routing suite preferred a temperature above 0). Every configuration is scored on three objectives ([`Objectives`]): hit
//! rate (higher is better), TTFT p50 (lower) and balance, the busiest worker's share over the
//! mean (lower). A configuration is on the [`front`] when no other is at least as good on all
//! three and better on one. [`recommend`] picks, among the configurations whose busiest worker
//! takes at most [`MAX_IMBALANCE`] of the mean share, the best hit rate, preferring the lower TTFT
//! p50 among those within [`HIT_RATE_TIE`] of it; when none is that balanced, the most balanced.
//! Everything is a pure function of the summaries, so a seeded replay tunes deterministically.

use crate::plot::ParetoPoint;
use crate::report::Summary;
use crate::sim::SimConfig;
use crate::sweep::SweepAxis;
use std::fmt::Write as _;

/// The balance a recommendation must keep: the busiest worker's share over the mean.
pub const MAX_IMBALANCE: f64 = 1.2;
/// Hit rates this close to the best (as a fraction) count as a tie, broken by TTFT p50.
pub const HIT_RATE_TIE: f64 = 0.002;

/// Overlap weights searched by default.
const WEIGHTS: &str = "0,0.5,1,2,4,8,16,32";
/// Resident-conversation weights searched by default.
const RESIDENT_WEIGHTS: &str = "0,0.5,1";
/// Balance charges (tokens to prefill per recent pick above the mean) searched by default.
const BALANCE_TOKENS: &str = "0,256,512,1024";

/// The default search: the weight the fleet's router uses against the resident-conversation
/// weight and the balance charge.
pub fn default_axes(base: &SimConfig) -> Vec<SweepAxis> {
    let weight = if base.pd.is_some() {
        "kv-prefill-overlap-weight"
    } else {
        "kv-overlap-weight"
    };
    let axis = |key: &str, values: &str| SweepAxis {
        key: key.to_owned(),
        values: values.split(',').map(str::to_owned).collect(),
    };
    vec![
        axis(weight, WEIGHTS),
        axis("router-resident-weight", RESIDENT_WEIGHTS),
        axis("router-balance-tokens", BALANCE_TOKENS),
    ]
}

/// What a configuration is scored on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objectives {
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    /// The busiest worker's share over the mean share.
    pub imbalance: f64,
}

impl Objectives {
    pub fn of(s: &Summary) -> Self {
        Self {
            hit_rate: s.hit_rate,
            ttft_p50_ms: s.ttft_p50_ms,
            imbalance: s.imbalance,
        }
    }

    /// At least as good on every objective and better on one.
    fn dominates(&self, o: &Self) -> bool {
        let ge = self.hit_rate >= o.hit_rate
            && self.ttft_p50_ms <= o.ttft_p50_ms
            && self.imbalance <= o.imbalance;
        let gt = self.hit_rate > o.hit_rate
            || self.ttft_p50_ms < o.ttft_p50_ms
            || self.imbalance < o.imbalance;
        ge && gt
    }
}

/// Whether each configuration is on the Pareto front of all three objectives.
pub fn front(objs: &[Objectives]) -> Vec<bool> {
    objs.iter()
        .map(|a| !objs.iter().any(|b| b.dominates(a)))
        .collect()
}

/// Whether each configuration is on the front of hit rate against balance alone (the chart's).
pub fn front_2d(objs: &[Objectives]) -> Vec<bool> {
    let flat: Vec<Objectives> = objs
        .iter()
        .map(|o| Objectives {
            ttft_p50_ms: 0.0,
            ..*o
        })
        .collect();
    front(&flat)
}

/// The configuration to recommend (see the module docs); `None` only for an empty list.
pub fn recommend(objs: &[Objectives]) -> Option<usize> {
    let balanced: Vec<usize> = (0..objs.len())
        .filter(|&i| objs[i].imbalance <= MAX_IMBALANCE)
        .collect();
    if balanced.is_empty() {
        return (0..objs.len()).min_by(|&a, &b| objs[a].imbalance.total_cmp(&objs[b].imbalance));
    }
    let best = balanced
        .iter()
        .map(|&i| objs[i].hit_rate)
        .fold(f64::NEG_INFINITY, f64::max);
    balanced
        .into_iter()
        .filter(|&i| objs[i].hit_rate >= best - HIT_RATE_TIE)
        .min_by(|&a, &b| {
            objs[a]
                .ttft_p50_ms
                .total_cmp(&objs[b].ttft_p50_ms)
                .then(objs[b].hit_rate.total_cmp(&objs[a].hit_rate))
        })
}

/// A grid point's values as command-line flags: `--kv-overlap-weight 4 --router-balance-tokens 512`.
pub fn flags(values: &[(String, String)]) -> String {
    values
        .iter()
        .map(|(k, v)| format!("--{k} {v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The front and the recommendation as text: one line per front configuration (best hit rate
/// first), then the flags to use.
pub fn report(values: &[Vec<(String, String)>], summaries: &[Summary]) -> String {
    let objs: Vec<Objectives> = summaries.iter().map(Objectives::of).collect();
    let on_front = front(&objs);
    let mut order: Vec<usize> = (0..objs.len()).filter(|&i| on_front[i]).collect();
    order.sort_by(|&a, &b| objs[b].hit_rate.total_cmp(&objs[a].hit_rate));
    let ideal = summaries.first().map_or(0.0, |s| s.ideal_hit_rate);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Pareto front ({} of {} configurations; hit rate up, TTFT p50 down, max share down):",
        order.len(),
        objs.len()
    );
    let _ = writeln!(
        out,
        "  {:>6}  {:>9}  {:>9}  {:>9}  flags",
        "hit", "of ideal", "ttft p50", "max share"
    );
    for &i in &order {
        let _ = writeln!(out, "  {}  {}", figures(&objs[i], ideal), flags(&values[i]));
    }
    if let Some(r) = recommend(&objs) {
        let why = if objs[r].imbalance <= MAX_IMBALANCE {
            format!(
                "the best hit rate with no worker above {MAX_IMBALANCE}x the mean share, the \
                 lower TTFT p50 among near ties"
            )
        } else {
            format!(
                "no configuration keeps every worker within {MAX_IMBALANCE}x the mean share; the most balanced"
            )
        };
        let _ = writeln!(out, "recommended ({why}):");
        let _ = writeln!(out, "  {}  {}", figures(&objs[r], ideal), flags(&values[r]));
    }
    out
}

fn figures(o: &Objectives, ideal: f64) -> String {
    let of_ideal = if ideal > 0.0 {
        format!("{:.1}%", o.hit_rate / ideal * 100.0)
    } else {
        "-".to_owned()
    };
    format!(
        "{:>5.1}%  {:>9}  {:>7.0}ms  {:>8.2}x",
        o.hit_rate * 100.0,
        of_ideal,
        o.ttft_p50_ms,
        o.imbalance
    )
}

/// The chart's points: balance on x, hit rate (percent) on y, labelled with the flags and TTFT.
pub fn chart_points(values: &[Vec<(String, String)>], summaries: &[Summary]) -> Vec<ParetoPoint> {
    let objs: Vec<Objectives> = summaries.iter().map(Objectives::of).collect();
    let on_front = front_2d(&objs);
    objs.iter()
        .zip(values)
        .zip(on_front)
        .map(|((o, v), on_front)| ParetoPoint {
            label: format!("{} (TTFT p50 {:.0} ms)", flags(v), o.ttft_p50_ms),
            x: o.imbalance,
            y: o.hit_rate * 100.0,
            on_front,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(hit_rate: f64, ttft_p50_ms: f64, imbalance: f64) -> Objectives {
        Objectives {
            hit_rate,
            ttft_p50_ms,
            imbalance,
        }
    }

    #[test]
    fn the_front_keeps_exactly_the_undominated() {
        let objs = [
            o(0.9, 50.0, 1.1),
            o(0.8, 60.0, 1.2), // dominated by the first
            o(0.95, 40.0, 1.5),
            o(0.7, 80.0, 1.0),
            o(0.9, 50.0, 1.1), // equal to the first: neither dominates
        ];
        assert_eq!(front(&objs), [true, false, true, true, true]);
        assert_eq!(front_2d(&objs), [true, false, true, true, true]);
    }

    #[test]
    fn recommend_prefers_hit_rate_within_balance_then_ttft() {
        let objs = [
            o(0.95, 40.0, 1.5),  // best hit rate, too unbalanced
            o(0.90, 55.0, 1.15), // best balanced hit rate
            o(0.899, 45.0, 1.1), // within the tie: faster wins
            o(0.80, 30.0, 1.0),
        ];
        assert_eq!(recommend(&objs), Some(2));
        let unbalanced = [o(0.9, 50.0, 1.6), o(0.8, 50.0, 1.3)];
        assert_eq!(recommend(&unbalanced), Some(1));
        assert_eq!(recommend(&[]), None);
    }

    #[test]
    fn default_axes_follow_the_fleet() {
        let mixed = default_axes(&SimConfig::default());
        assert_eq!(mixed[0].key, "kv-overlap-weight");
        assert_eq!(mixed[1].key, "router-resident-weight");
        assert_eq!(mixed[2].key, "router-balance-tokens");
        let pd = default_axes(&SimConfig {
            pd: Some((1, 3)),
            ..SimConfig::default()
        });
        assert_eq!(pd[0].key, "kv-prefill-overlap-weight");
        for axis in mixed.iter().chain(&pd) {
            let parsed: SweepAxis = format!("{}={}", axis.key, axis.values.join(","))
                .parse()
                .expect("valid axis");
            assert_eq!(&parsed, axis);
        }
        assert_eq!(
            flags(&[("kv-overlap-weight".into(), "4".into())]),
            "--kv-overlap-weight 4"
        );
    }
}
