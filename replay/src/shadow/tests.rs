use super::adopt::{Reason, Tuner};
use super::*;
use crate::sim::RequestOutcome;
use crate::trace::synth::{SynthConfig, synthesize};
use infera_core::event::Engine;
use infera_core::ids::WorkerId;

/// The suite's agentic trace at `concurrency` sessions open at once.
fn agentic(concurrency: f64, sessions: usize, seed: u64) -> Trace {
    synthesize(&SynthConfig {
        seed,
        sessions,
        concurrency,
        ..SynthConfig::default()
    })
    .expect("synthesized")
}

/// The suite's fleet of `workers` engines for `trace`, and their registrations.
fn fleet(trace: &Trace, workers: usize) -> (SimConfig, Vec<WorkerRecord>) {
    let block_size = trace.requests[0].block_size;
    let mut base = SimConfig {
        workers,
        ..SimConfig::default()
    };
    base.engine.gpu_blocks = (1 << 20) / block_size as usize;
    let records = (0..workers)
        .map(|i| {
            let mut r = WorkerRecord::mixed(
                WorkerId::new(format!("w{i}:8000")),
                format!("http://w{i}:8000"),
                &trace.requests[0].model,
                Engine::Vllm,
                block_size,
            );
            r.extra.insert(
                infera_core::event::KV_CAPACITY_BLOCKS.into(),
                base.engine.gpu_blocks.into(),
            );
            r
        })
        .collect();
    (base, records)
}

/// The trace's requests cut into `n` windows of about equal counts, each starting at 0.
fn windows(trace: &Trace, n: usize) -> Vec<Trace> {
    let per = trace.requests.len().div_ceil(n);
    trace
        .requests
        .chunks(per)
        .map(|chunk| {
            let t0 = chunk[0].arrival_us;
            Trace {
                requests: chunk
                    .iter()
                    .map(|r| TraceRequest {
                        arrival_us: r.arrival_us - t0,
                        ..r.clone()
                    })
                    .collect(),
                source: trace.source.clone(),
                notes: Vec::new(),
            }
        })
        .collect()
}

/// What a fleet routed by `router` does with `trace`: the simulator stands in for it.
fn realise(trace: &Trace, base: &SimConfig, t: &Tunables) -> Vec<RequestOutcome> {
    let cfg = SimConfig {
        router: base.router.with_tunables(t),
        ..base.clone()
    };
    sim::run(trace, &cfg).expect("simulated").requests
}

/// A window holding `trace` as the fleet served it.
fn observed(trace: &Trace, outcomes: &[RequestOutcome]) -> Window {
    let mut w = Window::new(ShadowOptions::default());
    for (r, o) in trace.requests.iter().zip(outcomes) {
        w.push(Observed {
            request: r.clone(),
            cached_tokens: Some(o.cached_tokens),
            ttft_us: Some(o.ttft_us),
        });
    }
    w
}

fn token_hit_rate(outcomes: &[RequestOutcome]) -> f64 {
    let (hit, all) = outcomes.iter().fold((0u64, 0u64), |(h, a), o| {
        (
            h + u64::from(o.cached_tokens),
            a + u64::from(o.input_tokens),
        )
    });
    hit as f64 / all as f64
}

/// The token hit rate and the busiest worker's share over the mean of a run.
fn objectives(trace: &Trace, base: &SimConfig) -> Objectives {
    let result = sim::run(trace, base).expect("simulated");
    let mut ttft: Vec<f64> = result
        .requests
        .iter()
        .map(|o| o.ttft_us as f64 / 1000.0)
        .collect();
    ttft.sort_by(f64::total_cmp);
    Objectives {
        hit_rate: token_hit_rate(&result.requests),
        ttft_p50_ms: percentile(&ttft, 0.5),
        imbalance: Summary::of(&result, 0.0).imbalance,
    }
}

/// `infera replay --tune`'s pick on `trace`: its default grid, its rule.
fn offline_best(trace: &Trace, base: &SimConfig) -> f64 {
    let points = sweep::grid(base, &tune::default_axes(base)).expect("grid");
    let objs: Vec<Objectives> = points
        .iter()
        .map(|p| objectives(trace, &p.config))
        .collect();
    objs[tune::recommend(&objs).expect("a pick")].hit_rate
}

/// Runs the loop the server runs, with the simulator as the fleet: each window is served under
/// the current tunables (`serve` says how the fleet really routes them), assessed, and the
/// tuner's change applied before the next. Returns the realised hit rate of each window and
/// the changes.
fn closed_loop(
    windows: &[Trace],
    base: &SimConfig,
    records: &[WorkerRecord],
    start: Tunables,
    serve: impl Fn(&Tunables) -> Tunables,
) -> (Vec<f64>, Vec<super::adopt::Change>, Tunables) {
    let mut tuner = Tuner::default();
    let mut current = start;
    let mut realised = Vec::new();
    let mut changes = Vec::new();
    for w in windows {
        let outcomes = realise(w, base, &serve(&current));
        let window = observed(w, &outcomes);
        let cfg = SimConfig {
            router: base.router.with_tunables(&current),
            ..base.clone()
        };
        let a = assess(&window, &cfg, records, usize::MAX)
            .expect("assessed")
            .expect("a window");
        realised.push(a.realised.hit_rate.expect("reported"));
        if let Some(change) = tuner.decide(&a) {
            assert_eq!(change.from, current);
            assert!(
                neighbours(&cfg).contains(&change.to),
                "one step at a time: {change:?}"
            );
            current = change.to;
            changes.push(change);
        }
    }
    (realised, changes, current)
}

#[test]
fn apply_follows_a_shift_to_within_three_points_of_the_offline_best() {
    let agentic = agentic(48.0, 144, 0);
    let mut mooncake = crate::trace::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/traces/mooncake_trace_1000.parquet"),
        &crate::trace::LoadOptions::default(),
    )
    .expect("fixture");
    for r in &mut mooncake.requests {
        r.model = agentic.requests[0].model.clone();
    }
    let (base, records) = fleet(&agentic, 4);
    let start = base.router.tunables();

    // Phase one: the Mooncake slice, in two windows.
    let first = windows(&mooncake, 2);
    let (_, early, settled) = closed_loop(&first, &base, &records, start, |t| *t);
    // Phase two: agentic sessions, whose reuse the default under-uses.
    let second = windows(&agentic, 8);
    let (realised, changes, last) = closed_loop(&second, &base, &records, settled, |t| *t);
    assert!(
        !changes.is_empty() && changes.iter().all(|c| c.reason == Reason::Adopt),
        "the shift is followed: {early:?} then {changes:?}"
    );
    assert!(
        last.resident_weight > 0.0,
        "the sessions' reuse moved the resident weight: {last:?}"
    );
    let final_window = second.last().expect("windows");
    let best = offline_best(
        final_window,
        &SimConfig {
            router: base.router.with_tunables(&start),
            ..base.clone()
        },
    );
    let reached = *realised.last().expect("realised");
    assert!(
        reached >= best - 0.03,
        "realised {reached:.3} within 3 points of the offline best {best:.3}; windows {realised:?}"
    );
    assert!(
        reached > realised[0] + 0.03,
        "better than where it started: {realised:?}"
    );
}

#[test]
fn a_gain_that_does_not_materialise_is_rolled_back_and_held() {
    let trace = agentic(48.0, 144, 0);
    let (base, records) = fleet(&trace, 4);
    let start = base.router.tunables();
    // The fleet ignores the change (an engine that routes its own way, say): the replay
    // predicts a gain that never comes.
    let (_, changes, last) =
        closed_loop(&windows(&trace, 6)[..4], &base, &records, start, |_| start);
    assert_eq!(changes[0].reason, Reason::Adopt, "{changes:?}");
    assert_eq!(changes[1].reason, Reason::Rollback, "{changes:?}");
    assert_eq!(changes[1].to, start);
    assert_eq!(changes[1].from, changes[0].to);
    assert!(
        changes[2..].iter().all(|c| c.to != changes[0].to),
        "a rolled-back setting is held: {changes:?}"
    );
    let _ = last;
}

#[test]
fn with_the_simulator_as_the_fleet_the_replay_predicts_exactly() {
    let trace = agentic(48.0, 144, 0);
    let (base, records) = fleet(&trace, 4);
    let w = &windows(&trace, 8)[0];
    let window = observed(w, &realise(w, &base, &base.router.tunables()));
    let a = assess(&window, &base, &records, usize::MAX)
        .expect("assessed")
        .expect("a window");
    assert_eq!(a.fidelity_gap, Some(0.0));
    assert_eq!(a.current().tunables, base.router.tunables());
    assert_eq!(a.requests, w.requests.len());
    assert!(
        a.scored < a.requests && a.scored > a.requests / 2,
        "{}",
        a.scored
    );
    // A fleet that serves a tenth fewer tokens from cache than the replay: the gap shows it.
    let mut worse = window;
    for o in worse.rows.iter_mut() {
        o.cached_tokens = o.cached_tokens.map(|c| c * 9 / 10);
    }
    let a = assess(&worse, &base, &records, usize::MAX)
        .expect("assessed")
        .expect("a window");
    let gap = a.fidelity_gap.expect("a gap");
    assert!(gap > 0.05 && gap < 0.15, "{gap}");
}

/// A worker's registration, then `n` requests of `prompt_tokens` arriving `every_us` apart, each
/// finished as it arrives (the recorder tests' events).
fn meta_free_events(n: u64, prompt_tokens: u32, every_us: u64) -> Vec<Envelope> {
    use crate::record::tests::{env, finished, registered, routed};
    let mut out = vec![env(1, 0, registered("w:1"))];
    for i in 0..n {
        let at_us = 1 + i * every_us;
        let id = format!("r{i}");
        out.push(env(
            2 + 2 * i,
            at_us,
            routed(&id, "w:1", at_us, prompt_tokens),
        ));
        out.push(env(3 + 2 * i, at_us, finished(&id, RequestStatus::Ok)));
    }
    out
}

#[test]
fn the_window_is_bounded_by_time_and_by_bytes_under_a_burst() {
    // A minute's window over rows of 128 block hashes, with room for 1,000 of them.
    let probe = meta_free_events(1, 2048, 1);
    let mut one = Window::new(ShadowOptions::default());
    probe.iter().for_each(|e| one.feed(e));
    one.advance(2);
    let row = one.bytes();
    assert!(row > 8 * 128 && row < 8 * 128 + 512, "{row}");
    let opts = ShadowOptions {
        window_us: 60_000_000,
        max_bytes: 1_000 * row,
    };
    let mut w = Window::new(opts);
    // A steady 10 requests/s for two minutes: only the last minute stays.
    for e in meta_free_events(1_200, 2048, 100_000) {
        w.feed(&e);
    }
    w.advance(120_000_001);
    assert!((595..=605).contains(&w.len()), "{}", w.len());
    assert_eq!(w.evicted, 0);
    // A ten times larger burst: the budget holds and the oldest rows go first.
    let mut w = Window::new(opts);
    for e in meta_free_events(12_000, 2048, 5_000) {
        w.feed(&e);
    }
    w.advance(60_000_000);
    assert!(w.bytes() <= opts.max_bytes, "{}", w.bytes());
    // (Later ids are a few bytes longer than the probe's.)
    assert!((990..=1_000).contains(&w.len()), "{}", w.len());
    assert_eq!(w.evicted, 12_000 - w.len() as u64);
    assert!(w.rows().all(|o| o.request.arrival_us > 55_000_000));
    w.clear();
    assert!(w.is_empty() && w.bytes() == 0);
}

#[test]
fn the_budget_sizes_the_next_replay_by_the_last_ones_speed() {
    let mut b = Budget::new(0.1, std::time::Duration::from_secs(60), 50_000, 200);
    assert_eq!(b.limit, 50_000);
    // 50,000 requests in 12 s: 6 s a minute fits 25,000.
    b.spent(50_000, 12.0);
    assert_eq!(b.limit, 25_000);
    // Never below the floor, and a replay that took no time changes nothing.
    b.spent(100, 60.0);
    assert_eq!(b.limit, 200);
    b.spent(100, 0.0);
    assert_eq!(b.limit, 200);
}

#[test]
fn neighbours_are_one_grid_step_along_one_axis() {
    let base = SimConfig::default();
    let n = neighbours(&base);
    let t = |w: f64, r: f64, b: u32| Tunables {
        overlap_weight: w,
        prefill_overlap_weight: None,
        resident_weight: r,
        balance_tokens: b,
    };
    assert_eq!(
        n,
        [
            t(1.0, 0.0, 0),
            t(0.5, 0.0, 0),
            t(2.0, 0.0, 0),
            t(1.0, 0.5, 0),
            t(1.0, 0.0, 256)
        ]
    );
    // Off the grid: the nearest grid values on each side.
    let mut off = base.clone();
    off.router.overlap_weight = 3.0;
    let n = neighbours(&off);
    assert_eq!(n[1].overlap_weight, 2.0);
    assert_eq!(n[2].overlap_weight, 4.0);
}
