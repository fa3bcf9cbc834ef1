//! `infera replay` (offline replay of a trace through the real router) and `infera trace`
//! (import, inspect and synthesize traces). Flag parsing and wiring only; the work is in
//! `infera-replay`.

mod present;

use crate::cli::replay::{PlaybackArg, ReplayArgs, ReplayCommand};
use crate::cli::trace::{TraceArgs, TraceCmd};
use anyhow::{Context, bail};
use infera_core::engine::TimingModel;
use infera_replay::plot;
use infera_replay::report::Summary;
use infera_replay::rules::RetentionRule;
use infera_replay::shard::{Shard, SweepMeta};
use infera_replay::sim::{Playback, SessionLinks, SimConfig, TierConfig};
use infera_replay::sweep::{self, SweepAxis};
use infera_replay::{output, trace, tune};
use present::{Outputs, Run};
use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The default simulated GPU KV cache: about what one 80–141 GB accelerator holds for a large
/// MLA model after weights.
const DEFAULT_GPU_TOKENS: usize = 1 << 20;

fn parse_coeffs(flag: &str, s: &str) -> anyhow::Result<[f64; 3]> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--{flag} {s:?}: expected three numbers A,B,C"))?;
    match v.as_slice() {
        [a, b, c] if v.iter().all(|x| x.is_finite()) => Ok([*a, *b, *c]),
        _ => bail!("--{flag} {s:?}: expected three finite numbers A,B,C"),
    }
}

/// Builds the base simulation configuration from the flags (the only conversion path).
fn base_config(a: &ReplayArgs, trace_block_size: u32) -> anyhow::Result<SimConfig> {
    let nonneg = |flag: &str, v: f64| -> anyhow::Result<()> {
        if !(v.is_finite() && v >= 0.0) {
            bail!("--{flag} must be a non-negative number (got {v})");
        }
        Ok(())
    };
    let overlap_weight = a
        .kv_overlap_weight
        .unwrap_or(a.router_profile.overlap_weight());
    nonneg("kv-overlap-weight", overlap_weight)?;
    nonneg("router-temperature", a.router_temperature)?;
    nonneg("router-resident-weight", a.router_resident_weight)?;
    nonneg("kv-event-delay-ms", a.kv_event_delay_ms)?;
    nonneg("frontend-ms", a.frontend_ms)?;
    nonneg("load-ms-per-block", a.load_ms_per_block)?;
    if let Some(w) = a.kv_prefill_overlap_weight {
        nonneg("kv-prefill-overlap-weight", w)?;
    }
    if let Some(w) = a.kv_decode_overlap_weight {
        nonneg("kv-decode-overlap-weight", w)?;
    }
    if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if a.prefill_workers == Some(0) || a.decode_workers == Some(0) {
        bail!("--prefill-workers and --decode-workers must be at least 1");
    }
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup must be above 0 (got {})", a.speedup);
    }
    let block_size = a.block_size.unwrap_or(trace_block_size).max(1);
    if a.block_size == Some(0) {
        bail!("--block-size must be at least 1");
    }
    let gpu_blocks = a
        .gpu_blocks
        .unwrap_or_else(|| (DEFAULT_GPU_TOKENS / block_size as usize).max(1));
    if gpu_blocks == 0 {
        bail!("--gpu-blocks must be at least 1");
    }
    let [pa, pb, pc] = parse_coeffs("prefill-coeffs", &a.prefill_coeffs)?;
    let [da, db, dc] = parse_coeffs("decode-coeffs", &a.decode_coeffs)?;
    let rules = a
        .retention_rules
        .iter()
        .map(|r| r.parse::<RetentionRule>())
        .collect::<Result<Vec<_>, _>>()
        .context("--retention-rule")?;
    let mut cfg = SimConfig::default();
    cfg.router.policy = a.router_policy;
    cfg.router.overlap_weight = overlap_weight;
    cfg.router.prefill_overlap_weight = a.kv_prefill_overlap_weight;
    cfg.router.decode_overlap_weight = a.kv_decode_overlap_weight;
    cfg.router.temperature = a.router_temperature;
    cfg.router.resident_weight = a.router_resident_weight;
    cfg.router.balance_tokens = a
        .router_balance_tokens
        .unwrap_or(a.router_profile.balance_tokens());
    for (flag, w) in [
        (
            "--router-host-cache-hit-weight",
            a.router_host_cache_hit_weight,
        ),
        (
            "--router-disk-cache-hit-weight",
            a.router_disk_cache_hit_weight,
        ),
    ] {
        if w.is_some_and(|w| !(0.0..=1.0).contains(&w)) {
            anyhow::bail!(
                "{flag} must be between 0 and 1: a lower tier's hit is worth at most a GPU hit"
            );
        }
    }
    cfg.router.tier_weights.host = a.router_host_cache_hit_weight;
    cfg.router.tier_weights.disk = a.router_disk_cache_hit_weight;
    cfg.router.sessions.mode = a.router_session_affinity;
    cfg.router.sessions.ttl_s = a.router_session_ttl;
    cfg.router.seed = a.seed;
    cfg.workers = a.workers;
    cfg.pd = a.prefill_workers.zip(a.decode_workers);
    cfg.engine.gpu_blocks = gpu_blocks;
    cfg.engine.block_size = block_size;
    cfg.engine.max_batched_tokens = a.max_batched_tokens;
    cfg.engine.max_seqs = a.max_seqs;
    cfg.engine.timing = TimingModel {
        prefill_a: pa,
        prefill_b: pb,
        prefill_c: pc,
        decode_a: da,
        decode_b: db,
        decode_c: dc,
        load_ms_per_block: a.load_ms_per_block,
    };
    cfg.tiers = TierConfig {
        host_blocks: a.host_blocks,
        disk_blocks: a.disk_blocks,
    };
    cfg.rules = rules;
    cfg.speedup = a.speedup;
    cfg.playback = match a.playback {
        PlaybackArg::Sessions => Playback::Sessions,
        PlaybackArg::Timeline => Playback::Timeline,
    };
    cfg.kv_event_delay_us = (a.kv_event_delay_ms * 1000.0) as u64;
    cfg.frontend_us = (a.frontend_ms * 1000.0).round() as u64;
    cfg.identity_blind = a.identity_blind;
    cfg.queue_threshold = a.router_queue_threshold.0;
    cfg.tenant_weights = a.tenant_weights.clone();
    if let Some(path) = &a.api_keys {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--api-keys {}", path.display()))?;
        infera_core::tenancy::Tenants::parse(&text, None, 0)
            .with_context(|| format!("--api-keys {}", path.display()))?;
        cfg.api_keys = Some(text);
    }
    cfg.engine.validate().context("engine settings")?;
    Ok(cfg)
}

/// A progress bar on stderr that appears only when stderr is a terminal and the run lasts more
/// than a second.
struct Progress {
    bar: indicatif::ProgressBar,
    done: Arc<AtomicBool>,
}

impl Progress {
    fn new(total: u64, what: &str) -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::hidden(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{spinner} {msg} [{elapsed}] {bar:30} {pos}/{len}",
        ) {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        let done = Arc::new(AtomicBool::new(false));
        if std::io::stderr().is_terminal() {
            let (b, d) = (bar.clone(), done.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(1));
                if !d.load(Ordering::Acquire) {
                    b.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                    b.enable_steady_tick(Duration::from_millis(120));
                }
            });
        }
        Self { bar, done }
    }

    fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.bar.finish_and_clear();
    }
}

/// How `infera replay` / `infera trace` failed: bad flags (exit 2, nothing was read or written)
/// or a failure while running (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum ReplayFailure {
    #[error("{0:#}")]
    Invalid(anyhow::Error),
    #[error("{0:#}")]
    Failed(#[from] anyhow::Error),
}

/// Flags of `infera replay` checked before the trace is read.
struct Validated {
    axes: Vec<SweepAxis>,
    plot_format: Option<plot::Format>,
}

fn validate(args: &ReplayArgs) -> anyhow::Result<Validated> {
    let axes: Vec<SweepAxis> = args
        .sweeps
        .iter()
        .map(|s| s.parse::<SweepAxis>())
        .collect::<Result<_, _>>()?;
    check_output_path(args.out.as_deref(), "parquet", "--out")?;
    let plot_format = plot_format(args.plot.as_deref())?;
    if args.limit == Some(0) {
        bail!("--limit must be at least 1");
    }
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    // Every flag-only check of the simulation settings (the block size is the trace's later).
    base_config(args, 16)?;
    Ok(Validated { axes, plot_format })
}

/// `--plot`'s format, from its extension.
fn plot_format(path: Option<&Path>) -> anyhow::Result<Option<plot::Format>> {
    let Some(p) = path else { return Ok(None) };
    let format = plot::Format::from_path(p)
        .with_context(|| format!("--plot {}: expected a .svg or .png file", p.display()))?;
    check_output_path(Some(p), format.extension(), "--plot")?;
    Ok(Some(format))
}

pub fn run_replay(mut args: ReplayArgs) -> Result<(), ReplayFailure> {
    if let Some(ReplayCommand::Merge(merge)) = args.command.take() {
        return present::run_merge(merge);
    }
    let Some(trace) = args.trace.clone() else {
        return Err(ReplayFailure::Invalid(anyhow::anyhow!(
            "give the trace to replay"
        )));
    };
    let v = validate(&args).map_err(ReplayFailure::Invalid)?;
    Ok(replay(args, &trace, v)?)
}

fn replay(args: ReplayArgs, trace_path: &Path, v: Validated) -> anyhow::Result<()> {
    let Validated { axes, plot_format } = v;
    let started = Instant::now();
    let opts = trace::LoadOptions {
        seed: args.seed,
        spread_buckets: !args.no_spread,
        block_size: args.trace_block_size,
        ..Default::default()
    };
    let mut tr = trace::load(trace_path, &opts)?;
    if let Some(n) = args.limit {
        tr.requests.truncate(n);
    }
    for (tenant, factor) in &args.tenant_scales {
        tr.scale_tenant(tenant, *factor);
    }

    let trace_bs = tr.requests.first().map(|r| r.block_size).unwrap_or(16);
    let mut base = base_config(&args, trace_bs)?;
    let mut notes = tr.notes.clone();
    notes.extend(sweep::resolve_pd(&mut base));
    let axes = if args.tune && axes.is_empty() {
        tune::default_axes(&base)
    } else {
        axes
    };
    let mut points = sweep::grid(&base, &axes)?;
    for p in &mut points {
        // Sweeping a PD weight on a mixed fleet implies the default split too.
        if let Some(n) = sweep::resolve_pd(&mut p.config)
            && !notes.contains(&n)
        {
            notes.push(n);
        }
    }
    let summary = trace::summarize(&tr);
    println!(
        "trace: {} — {} requests over {:.1} min ({:.2} req/s), block size {}, {} blocks",
        trace_path.display(),
        summary.requests,
        summary.span_s / 60.0,
        summary.rate_per_s.unwrap_or(0.0),
        trace_bs,
        summary.blocks_total
    );
    if base.playback == Playback::Sessions {
        let links = SessionLinks::new(&tr.requests, Playback::Sessions);
        let turns = (0..tr.requests.len()).filter(|&i| links.follows(i)).count();
        if turns > 0 {
            notes.push(format!(
                "{turns} session turns leave when their predecessor finished plus their think \
                 time (--playback sessions); the others at their recorded arrival"
            ));
        }
    }
    for n in &notes {
        println!("note: {n}");
    }
    describe_fleet(&base);

    let shard = args.shard.unwrap_or(Shard::WHOLE);
    let meta = SweepMeta::new(
        &trace_path.display().to_string(),
        &tr,
        &points,
        &axes,
        args.tune,
        shard,
    );
    let total = points.len();
    let (indices, points): (Vec<usize>, Vec<sweep::Point>) = points
        .into_iter()
        .enumerate()
        .filter(|(i, _)| shard.holds(*i))
        .unzip();
    if shard.count > 1 {
        println!(
            "slice {shard}: {} of the sweep's {total} configurations",
            points.len()
        );
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()?;
    let progress = Progress::new(points.len() as u64, "replaying");
    let bar = progress.bar.clone();
    let sim_started = Instant::now();
    let results = pool.install(|| sweep::run_all(&tr, &points, &|| bar.inc(1)));
    progress.finish();
    let sim_secs = sim_started.elapsed().as_secs_f64();
    let mut runs: Vec<Run> = Vec::with_capacity(points.len());
    for ((p, r), index) in points.into_iter().zip(results).zip(indices) {
        let result = r.with_context(|| format!("configuration {}", p.label))?;
        runs.push(Run {
            summary: Summary::of(&result, summary.ideal_hit_rate),
            index,
            params: output::params(&p.config),
            label: p.label,
            values: p.values,
            result,
        });
    }
    let count = runs.len();
    let timing = |best: &Run| {
        format!(
            "simulated {count} configuration(s) in {sim_secs:.2} s on {threads} thread(s) ({:.2} s per configuration; the best: {} engine steps, {} events in its log)",
            sim_secs * threads.min(count).max(1) as f64 / count.max(1) as f64,
            best.result.steps,
            best.result.events
        )
    };
    let outputs = Outputs {
        meta: &meta,
        out: args.out.as_deref(),
        plot: args.plot.as_deref().zip(plot_format),
    };
    present::present(&runs, &outputs, &timing)?;
    tracing::debug!(elapsed_s = started.elapsed().as_secs_f64(), "replay done");
    Ok(())
}

fn describe_fleet(c: &SimConfig) {
    let fleet = match c.pd {
        Some((p, d)) => format!("{p} prefill + {d} decode workers"),
        None => format!("{} workers", c.workers),
    };
    let tiers = if c.tiers.host_blocks + c.tiers.disk_blocks > 0 {
        format!(
            ", kvd tiers host {} / disk {} blocks",
            c.tiers.host_blocks, c.tiers.disk_blocks
        )
    } else {
        String::new()
    };
    println!(
        "fleet: {fleet}, {} GPU blocks of {} tokens each{tiers}; policy {}",
        c.engine.gpu_blocks,
        c.engine.block_size,
        c.router.policy.as_str()
    );
}

pub(crate) fn check_output_path(p: Option<&Path>, ext: &str, flag: &str) -> anyhow::Result<()> {
    let Some(p) = p else { return Ok(()) };
    if p.extension().and_then(|e| e.to_str()) != Some(ext) {
        bail!("{flag} {}: expected a .{ext} file", p.display());
    }
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        bail!(
            "{flag} {}: directory {} does not exist",
            p.display(),
            dir.display()
        );
    }
    Ok(())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

pub fn run_trace(args: TraceArgs) -> Result<(), ReplayFailure> {
    match &args.cmd {
        TraceCmd::Import { output, .. } => {
            check_output_path(Some(output), "parquet", "output").map_err(ReplayFailure::Invalid)?;
        }
        TraceCmd::Synth(synth) => {
            check_output_path(Some(&synth.output), "parquet", "output")
                .and_then(|()| synth.config().map(drop))
                .map_err(ReplayFailure::Invalid)?;
        }
        TraceCmd::Inspect { .. } => {}
    }
    Ok(trace_cmd(args)?)
}

fn trace_cmd(args: TraceArgs) -> anyhow::Result<()> {
    match args.cmd {
        TraceCmd::Import {
            input,
            output,
            load,
        } => {
            let tr = trace::load(&input, &load.options())?;
            for n in &tr.notes {
                println!("note: {n}");
            }
            trace::write_parquet(&tr, &output)?;
            println!(
                "wrote {} ({} requests)",
                output.display(),
                tr.requests.len()
            );
            Ok(())
        }
        TraceCmd::Synth(synth) => {
            let tr = trace::synth::synthesize(&synth.config()?)?;
            trace::write_parquet(&tr, &synth.output)?;
            println!(
                "wrote {} ({} turns of {} sessions)",
                synth.output.display(),
                tr.requests.len(),
                synth.sessions
            );
            print!("{}", trace::summarize(&tr));
            Ok(())
        }
        TraceCmd::Inspect { input, load } => {
            let tr = trace::load(&input, &load.options())?;
            for n in &tr.notes {
                println!("note: {n}");
            }
            print!("{}", trace::summarize(&tr));
            Ok(())
        }
    }
}
