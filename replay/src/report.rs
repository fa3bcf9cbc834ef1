//! Summaries of a simulation run and the tables `infera replay` prints.
//!
//! Block hit rate counts, over all requests, prompt blocks served from any cache tier (GPU prefix
//! hit, or loaded from the simulated host / disk tiers) divided by all prompt blocks. The ideal is
//! the unlimited-cache bound of the trace (see `trace::summary`). Share is the fraction of requests
//! (prefill legs in PD mode) each worker served; imbalance is the largest share over the mean.

use crate::sim::{RequestOutcome, SimResult};
use infera_core::event::Retention;
use std::fmt::Write as _;

/// Percentiles with linear interpolation; `q` in 0..=1. Empty input gives 0.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Hit counts for one retention class.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ClassHits {
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
}

/// The headline numbers of one configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    pub requests: u64,
    pub rejected: u64,
    pub blocks: u64,
    pub hit_rate: f64,
    pub ideal_hit_rate: f64,
    /// Of the blocks the router predicted cached on the worker it picked, the share that worker
    /// did not serve from any cache tier (evicted before the request ran, or never cached there:
    /// what a router blind to adapters and salts predicts).
    pub false_hit_rate: f64,
    pub gpu_hit_rate: f64,
    pub host_hit_rate: f64,
    pub disk_hit_rate: f64,
    /// none, ephemeral, short, long, and requests without a class.
    pub by_class: [ClassHits; 5],
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p50_ms: f64,
    pub queue_p50_ms: f64,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub shares: Vec<(String, f64)>,
    pub imbalance: f64,
    pub makespan_s: f64,
    /// Per tenant, when the trace names tenants (by name).
    pub by_tenant: Vec<TenantStats>,
}

/// One tenant's requests.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TenantStats {
    pub tenant: String,
    /// Served (not refused).
    pub requests: u64,
    /// Refused by the tenant's limits (429).
    pub limited: u64,
    pub prompt_tokens: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Time in the router's queue.
    pub router_queue_p99_ms: f64,
}

pub fn class_slot(c: Option<Retention>) -> usize {
    c.map(|c| c as usize).unwrap_or(4)
}

pub const CLASS_NAMES: [&str; 5] = ["none", "ephemeral", "short", "long", "unset"];

impl Summary {
    pub fn of(result: &SimResult, ideal_hit_rate: f64) -> Self {
        let reqs: Vec<&RequestOutcome> = result.requests.iter().filter(|r| !r.rejected).collect();
        let blocks: u64 = result.requests.iter().map(|r| r.blocks as u64).sum();
        let gpu: u64 = reqs.iter().map(|r| r.gpu_hit_blocks as u64).sum();
        let host: u64 = reqs.iter().map(|r| r.host_hit_blocks as u64).sum();
        let disk: u64 = reqs.iter().map(|r| r.disk_hit_blocks as u64).sum();
        let rate = |x: u64| {
            if blocks == 0 {
                0.0
            } else {
                x as f64 / blocks as f64
            }
        };
        let predicted: u64 = reqs.iter().map(|r| r.overlap_blocks as u64).sum();
        let false_hits: u64 = reqs
            .iter()
            .map(|r| {
                let served = r.gpu_hit_blocks + r.host_hit_blocks + r.disk_hit_blocks;
                u64::from(r.overlap_blocks.saturating_sub(served))
            })
            .sum();
        let mut by_class = [ClassHits::default(); 5];
        for r in &result.requests {
            let c = &mut by_class[class_slot(r.retention)];
            c.requests += 1;
            c.blocks += r.blocks as u64;
            c.hit_blocks += (r.gpu_hit_blocks + r.host_hit_blocks + r.disk_hit_blocks) as u64;
        }
        let sorted = |f: &dyn Fn(&RequestOutcome) -> f64| {
            let mut v: Vec<f64> = reqs.iter().map(|r| f(r)).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let ttft = sorted(&|r| r.ttft_us as f64 / 1000.0);
        let tpot: Vec<f64> = {
            let mut v: Vec<f64> = reqs
                .iter()
                .filter(|r| r.output_tokens > 1)
                .map(|r| r.tpot_us / 1000.0)
                .collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let queue = sorted(&|r| r.queue_us as f64 / 1000.0);
        let first = result
            .requests
            .iter()
            .map(|r| r.arrival_us)
            .min()
            .unwrap_or(0);
        let span_s = (result.makespan_us.saturating_sub(first)) as f64 / 1e6;
        let out_tokens: u64 = reqs.iter().map(|r| r.output_tokens as u64).sum();
        let mut counts: Vec<(String, u64)> =
            result.workers.iter().map(|w| (w.clone(), 0)).collect();
        for r in &reqs {
            if let Some(c) = counts.iter_mut().find(|(w, _)| *w == r.worker) {
                c.1 += 1;
            }
        }
        // Share over the pool that takes first legs (the prefill pool in PD mode).
        counts.retain(|(w, _)| !w.starts_with("sim-decode"));
        let total: u64 = counts.iter().map(|c| c.1).sum::<u64>().max(1);
        let shares: Vec<(String, f64)> = counts
            .iter()
            .map(|(w, c)| (w.clone(), *c as f64 / total as f64))
            .collect();
        let mean = 1.0 / shares.len().max(1) as f64;
        let max = shares.iter().map(|s| s.1).fold(0.0, f64::max);
        Summary {
            requests: result.requests.len() as u64,
            rejected: (result.requests.len() - reqs.len()) as u64,
            blocks,
            hit_rate: rate(gpu + host + disk),
            ideal_hit_rate,
            false_hit_rate: if predicted == 0 {
                0.0
            } else {
                false_hits as f64 / predicted as f64
            },
            gpu_hit_rate: rate(gpu),
            host_hit_rate: rate(host),
            disk_hit_rate: rate(disk),
            by_class,
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p90_ms: percentile(&ttft, 0.9),
            ttft_p99_ms: percentile(&ttft, 0.99),
            tpot_p50_ms: percentile(&tpot, 0.5),
            queue_p50_ms: percentile(&queue, 0.5),
            output_tokens_per_s: if span_s > 0.0 {
                out_tokens as f64 / span_s
            } else {
                0.0
            },
            requests_per_s: if span_s > 0.0 {
                reqs.len() as f64 / span_s
            } else {
                0.0
            },
            imbalance: if mean > 0.0 { max / mean } else { 0.0 },
            shares,
            makespan_s: span_s,
            by_tenant: by_tenant(&result.requests),
        }
    }
}

/// [`TenantStats`] of the requests that name a tenant, by name: the served ones' figures,
/// and how many its limits refused.
fn by_tenant(all: &[RequestOutcome]) -> Vec<TenantStats> {
    let mut groups: std::collections::BTreeMap<&str, (Vec<&RequestOutcome>, u64)> =
        Default::default();
    for r in all {
        if let Some(t) = &r.tenant {
            let (served, limited) = groups.entry(t).or_default();
            if r.limited.is_some() {
                *limited += 1;
            } else if !r.rejected {
                served.push(r);
            }
        }
    }
    groups
        .into_iter()
        .map(|(tenant, (rs, limited))| {
            let ms = |f: &dyn Fn(&RequestOutcome) -> u64| {
                let mut v: Vec<f64> = rs.iter().map(|r| f(r) as f64 / 1000.0).collect();
                v.sort_by(f64::total_cmp);
                v
            };
            let ttft = ms(&|r| r.ttft_us);
            TenantStats {
                tenant: tenant.to_owned(),
                requests: rs.len() as u64,
                limited,
                prompt_tokens: rs.iter().map(|r| u64::from(r.input_tokens)).sum(),
                ttft_p50_ms: percentile(&ttft, 0.5),
                ttft_p99_ms: percentile(&ttft, 0.99),
                router_queue_p99_ms: percentile(&ms(&|r| r.router_queue_us), 0.99),
            }
        })
        .collect()
}

/// The tenants' table of one configuration (empty when the trace names none).
pub fn tenant_table(s: &Summary) -> String {
    if s.by_tenant.is_empty() {
        return String::new();
    }
    let mut cells = vec![vec![
        "tenant".to_string(),
        "requests".into(),
        "limited (429)".into(),
        "prompt tokens".into(),
        "ttft p50".into(),
        "ttft p99".into(),
        "router queue p99".into(),
    ]];
    for t in &s.by_tenant {
        cells.push(vec![
            t.tenant.clone(),
            t.requests.to_string(),
            t.limited.to_string(),
            t.prompt_tokens.to_string(),
            format!("{:.0}ms", t.ttft_p50_ms),
            format!("{:.0}ms", t.ttft_p99_ms),
            format!("{:.0}ms", t.router_queue_p99_ms),
        ]);
    }
    render(&cells)
}

/// One row of the comparison table: a label for the configuration and its summary.
#[derive(Debug, Clone)]
pub struct Row {
    pub label: String,
    pub summary: Summary,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The comparison table, one line per configuration, in the given order.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "#",
        "config",
        "hit",
        "ideal",
        "false hits",
        "gpu",
        "host",
        "disk",
        "ttft p50",
        "p90",
        "p99",
        "tpot p50",
        "tok/s",
        "max share",
        "imbal",
    ];
    let mut cells: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for (i, r) in rows.iter().enumerate() {
        let s = &r.summary;
        let max_share = s.shares.iter().map(|x| x.1).fold(0.0, f64::max);
        cells.push(vec![
            (i + 1).to_string(),
            r.label.clone(),
            pct(s.hit_rate),
            pct(s.ideal_hit_rate),
            pct(s.false_hit_rate),
            pct(s.gpu_hit_rate),
            pct(s.host_hit_rate),
            pct(s.disk_hit_rate),
            format!("{:.0}ms", s.ttft_p50_ms),
            format!("{:.0}ms", s.ttft_p90_ms),
            format!("{:.0}ms", s.ttft_p99_ms),
            format!("{:.1}ms", s.tpot_p50_ms),
            format!("{:.0}", s.output_tokens_per_s),
            pct(max_share),
            format!("{:.2}x", s.imbalance),
        ]);
    }
    render(&cells)
}

/// Hits by retention class for one configuration (only classes that occur).
pub fn class_table(s: &Summary) -> String {
    let mut cells = vec![vec![
        "class".to_string(),
        "requests".into(),
        "blocks".into(),
        "hit".into(),
    ]];
    for (i, c) in s.by_class.iter().enumerate() {
        if c.requests == 0 {
            continue;
        }
        let rate = if c.blocks == 0 {
            0.0
        } else {
            c.hit_blocks as f64 / c.blocks as f64
        };
        cells.push(vec![
            CLASS_NAMES[i].into(),
            c.requests.to_string(),
            c.blocks.to_string(),
            pct(rate),
        ]);
    }
    render(&cells)
}

fn render(cells: &[Vec<String>]) -> String {
    let cols = cells.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            cells
                .iter()
                .map(|r| r.get(c).map(|s| s.chars().count()).unwrap_or(0))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (ri, row) in cells.iter().enumerate() {
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 1 || (ri == 0 && c <= 1) {
                let _ = write!(out, "{cell}{}  ", " ".repeat(pad));
            } else {
                let _ = write!(out, "{}{cell}  ", " ".repeat(pad));
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        if ri == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.5);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 4.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn table_aligns_columns() {
        let cells = vec![
            vec!["a".to_string(), "bb".into()],
            vec!["ccc".into(), "d".into()],
        ];
        let t = render(&cells);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].chars().all(|c| c == '-'));
    }
}
