//! What `infera replay` prints and writes once its configurations ran, and `infera replay
//! merge`, which prints and writes the same from the files of a sweep's slices.

use super::{ReplayFailure, check_output_path, plot_format, write_atomic};
use crate::cli::replay::MergeArgs;
use anyhow::Context;
use infera_replay::report::{self, Row, Summary};
use infera_replay::shard::SweepMeta;
use infera_replay::sim::SimResult;
use infera_replay::{merge, output, plot, tune};
use std::path::Path;

/// One configuration that ran (or was read back from a slice).
pub(super) struct Run {
    /// Its place in the whole grid.
    pub index: usize,
    pub label: String,
    pub values: Vec<(String, String)>,
    /// The configuration as JSON (the summary file's `params`).
    pub params: String,
    pub result: SimResult,
    pub summary: Summary,
}

/// Where the results go.
pub(super) struct Outputs<'a> {
    pub meta: &'a SweepMeta,
    pub out: Option<&'a Path>,
    pub plot: Option<(&'a Path, plot::Format)>,
}

/// The table's order: TTFT p50 first (what users feel), then hit rate.
fn ranking(a: &Summary, b: &Summary) -> std::cmp::Ordering {
    a.ttft_p50_ms
        .total_cmp(&b.ttft_p50_ms)
        .then(b.hit_rate.total_cmp(&a.hit_rate))
}

/// Ranks `runs` (grid order) by TTFT p50, then hit rate, prints the table, the best
/// configuration's details and the line `timing` makes of it, writes `--out`, and for a whole grid the `--tune` front
/// and the `--plot` chart.
pub(super) fn present(
    runs: &[Run],
    o: &Outputs<'_>,
    timing: &dyn Fn(&Run) -> String,
) -> anyhow::Result<()> {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|a, b| ranking(&runs[*a].summary, &runs[*b].summary));
    let rows: Vec<Row> = order
        .iter()
        .map(|i| Row {
            label: runs[*i].label.clone(),
            summary: runs[*i].summary.clone(),
        })
        .collect();
    println!();
    print!("{}", report::table(&rows));
    let Some(best) = order.first().map(|i| &runs[*i]) else {
        println!("no configuration in this slice");
        return write_out(runs, &order, o);
    };
    println!();
    println!("best: {} (ranked by TTFT p50, then hit rate)", best.label);
    // Only worth a table when some request has a retention class.
    if best.summary.by_class[..4].iter().any(|c| c.requests > 0) {
        println!("hits by retention class:");
        print!("{}", report::class_table(&best.summary));
    }
    let tenants = report::tenant_table(&best.summary);
    if !tenants.is_empty() {
        println!("per tenant:");
        print!("{tenants}");
    }
    let shares: Vec<String> = best
        .summary
        .shares
        .iter()
        .map(|(w, s)| format!("{}={:.1}%", short_worker(w), s * 100.0))
        .collect();
    println!("per-worker share: {}", shares.join(" "));
    println!("{}", timing(best));
    write_out(runs, &order, o)?;
    if o.meta.shard.count > 1 {
        println!(
            "slice {} of the sweep: `infera replay merge` of the {} slices' files gives the \
             whole ranking{}",
            o.meta.shard,
            o.meta.shard.count,
            if o.meta.tune {
                " and the Pareto front"
            } else {
                ""
            }
        );
        return Ok(());
    }
    let values: Vec<Vec<(String, String)>> = runs.iter().map(|r| r.values.clone()).collect();
    let summaries: Vec<Summary> = runs.iter().map(|r| r.summary.clone()).collect();
    if o.meta.tune {
        println!();
        print!("{}", tune::report(&values, &summaries));
    }
    let Some((path, format)) = o.plot else {
        return Ok(());
    };
    if o.meta.tune {
        let pts = tune::chart_points(&values, &summaries);
        let objs: Vec<tune::Objectives> = summaries.iter().map(tune::Objectives::of).collect();
        let name = Path::new(&o.meta.trace)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| o.meta.trace.clone());
        let title = format!("--tune on {name}");
        let chart = plot::Pareto {
            title: &title,
            x_label: "busiest worker's share / mean share",
            y_label: "hit rate (%)",
            points: &pts,
            recommended: tune::recommend(&objs),
        };
        write_atomic(path, &plot::pareto(&chart, format)?)?;
    } else {
        let axes = o.meta.sweep_axes()?;
        let runs: Vec<plot::SweepRun<'_>> = runs
            .iter()
            .map(|r| plot::SweepRun {
                values: &r.values,
                summary: &r.summary,
            })
            .collect();
        write_atomic(path, &plot::sweep(&axes, &runs, format)?)?;
    }
    println!("wrote {}", path.display());
    Ok(())
}

/// `--out`: every run in grid order, with its rank.
fn write_out(runs: &[Run], order: &[usize], o: &Outputs<'_>) -> anyhow::Result<()> {
    let Some(out) = o.out else { return Ok(()) };
    let mut rank_of = vec![0usize; runs.len()];
    for (rank, i) in order.iter().enumerate() {
        rank_of[*i] = rank + 1;
    }
    let written: Vec<output::Written<'_>> = runs
        .iter()
        .zip(rank_of)
        .map(|(r, rank)| output::Written {
            label: &r.label,
            index: r.index,
            rank,
            params: &r.params,
            values: &r.values,
            result: &r.result,
            summary: &r.summary,
        })
        .collect();
    output::write(out, &written, o.meta)?;
    println!(
        "wrote {} and {}",
        out.display(),
        output::summary_path(out).display()
    );
    Ok(())
}

fn short_worker(w: &str) -> &str {
    w.strip_suffix(":8000")
        .unwrap_or(w)
        .trim_start_matches("sim-")
}

/// `infera replay merge`.
pub fn run_merge(args: MergeArgs) -> Result<(), ReplayFailure> {
    let checked = check_output_path(args.out.as_deref(), "parquet", "--out")
        .and_then(|()| plot_format(args.plot.as_deref()));
    let plot = checked.map_err(ReplayFailure::Invalid)?;
    Ok(merge_slices(&args, plot)?)
}

fn merge_slices(args: &MergeArgs, plot: Option<plot::Format>) -> anyhow::Result<()> {
    let merged = merge::merge(&args.slices)?;
    for f in &merged.files {
        if args.out.as_deref() == Some(f.as_path()) {
            anyhow::bail!("--out {} is one of the slices", f.display());
        }
    }
    let meta = &merged.meta;
    println!(
        "merged {} slice file(s) of a sweep of {} configuration(s) over {}",
        merged.files.len(),
        meta.configs,
        meta.trace
    );
    let runs: Vec<Run> = merged
        .configs
        .into_iter()
        .map(|c| Run {
            summary: Summary::of(&c.result, c.ideal_hit_rate),
            index: c.index,
            label: c.label,
            values: c.values,
            params: c.params,
            result: c.result,
        })
        .collect();
    let outputs = Outputs {
        meta,
        out: args.out.as_deref(),
        plot: args.plot.as_deref().zip(plot),
    };
    let files = merged.files.len();
    let timing = |_: &Run| format!("merged from {files} file(s)");
    present(&runs, &outputs, &timing).context("merged sweep")
}
