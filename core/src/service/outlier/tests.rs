use super::*;

const S: Micros = 1_000_000;

fn ids(names: &[&str]) -> Vec<WorkerId> {
    names.iter().map(|n| WorkerId::new(*n)).collect()
}

fn members<'a>(workers: &'a [WorkerId], model: &'a str, role: Role) -> Vec<Member<'a>> {
    workers
        .iter()
        .map(|worker| Member {
            worker,
            model,
            role,
            out: false,
        })
        .collect()
}

/// `n` first bytes on `worker` at `now`, each after `ms` with `tokens` of work.
fn ttft(o: &Outliers, worker: &WorkerId, n: usize, ms: u64, tokens: u64, now: Micros) {
    for _ in 0..n {
        o.first_byte(worker, tokens, Duration::from_millis(ms), now);
    }
}

/// `n` outcomes on `worker` at `now`, one in `every` failed (0: none).
fn outcomes(o: &Outliers, worker: &WorkerId, n: usize, every: usize, now: Micros) {
    for i in 0..n {
        o.outcome(worker, every > 0 && i % every == 0, now);
    }
}

fn ejected(done: &Evaluation) -> Vec<(&str, Reason)> {
    done.ejected
        .iter()
        .map(|e| (e.worker.as_str(), e.reason))
        .collect()
}

#[test]
fn a_worker_twenty_times_slower_than_its_peers_is_ejected_and_a_fleet_wide_slowdown_is_not() {
    let o = Outliers::default();
    let w = ids(&["a", "b", "c"]);
    let m = members(&w, "m", Role::Mixed);
    ttft(&o, &w[0], 10, 40, 100, 0);
    ttft(&o, &w[1], 10, 40, 100, 0);
    ttft(&o, &w[2], 10, 800, 100, 0);
    let done = o.evaluate(&m, 50, S);
    assert_eq!(ejected(&done), [("c", Reason::Ttft)]);
    assert!((done.ejected[0].value / done.ejected[0].peers - 20.0).abs() < 1e-3);
    assert_eq!(done.ejected[0].until, 31 * S, "30 s the first time");
    assert_eq!(o.ejected(), ids(&["c"]));
    let ratios: FxHashMap<WorkerId, f64> = o.ratios().into_iter().collect();
    assert!((ratios[&w[2]] - 20.0).abs() < 1e-3, "{ratios:?}");
    // a's and b's peers' samples of like work are half 40 ms and half 800 ms: median 420.
    assert!((ratios[&w[0]] - 40.0 / 420.0).abs() < 1e-3, "{ratios:?}");

    // Everyone 20 times slower: nobody is an outlier.
    let o = Outliers::default();
    for worker in &w {
        ttft(&o, worker, 10, 800, 100, 0);
    }
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());
    assert!(o.ejected().is_empty());
}

#[test]
fn work_is_compared_with_like_work_so_long_prefills_eject_nobody() {
    let o = Outliers::default();
    let w = ids(&["long", "short", "mixed"]);
    let m = members(&w, "m", Role::Mixed);
    // Attention is quadratic: a 128k-token prefill costs six times as much per token as a
    // 1k-token one (12 s against 32 ms). A worker that gets only the long prompts is not
    // slower than one that gets only the short ones.
    ttft(&o, &w[0], 20, 12_000, 128_000, 0);
    ttft(&o, &w[1], 20, 32, 1_000, 0);
    assert_eq!(o.evaluate(&m[..2], 50, S), Evaluation::default());
    // Nor with a third worker serving both.
    ttft(&o, &w[2], 10, 32, 1_000, 0);
    ttft(&o, &w[2], 10, 12_000, 128_000, 0);
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());
    // Against like work, the long-prompt worker turning 20 times slower is found.
    ttft(&o, &w[0], 20, 240_000, 128_000, S);
    let done = o.evaluate(&m, 50, 2 * S);
    assert_eq!(ejected(&done), [("long", Reason::Ttft)]);
    assert!((done.ejected[0].value / done.ejected[0].peers - 20.0).abs() < 1e-3);
}

#[test]
fn a_worker_failing_half_its_requests_is_ejected_and_a_fleet_wide_error_is_not() {
    let o = Outliers::default();
    let w = ids(&["a", "b", "c"]);
    let m = members(&w, "m", Role::Mixed);
    outcomes(&o, &w[0], 20, 0, 0);
    outcomes(&o, &w[1], 20, 10, 0); // 10 %
    outcomes(&o, &w[2], 20, 5, 0); // 20 %: within the margin
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());
    // Three in five failed, never three in a row (the breaker's count never trips).
    for i in 0..20 {
        o.outcome(&w[2], i % 5 % 2 == 0, S);
    }
    let done = o.evaluate(&m, 50, 2 * S);
    assert_eq!(ejected(&done), [("c", Reason::Errors)]);
    assert_eq!(done.ejected[0].value, 0.6);
    assert_eq!(done.ejected[0].peers, 0.05, "the median of 0 % and 10 %");

    let o = Outliers::default();
    for worker in &w {
        outcomes(&o, worker, 20, 1, 0);
    }
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());
}

#[test]
fn too_few_samples_no_peer_or_old_samples_judge_nobody() {
    let config = OutlierConfig::default();
    let o = Outliers::default();
    let w = ids(&["a", "b"]);
    let m = members(&w, "m", Role::Mixed);
    ttft(&o, &w[0], 10, 10, 0, 0);
    ttft(&o, &w[1], 9, 1_000, 0, 0);
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default(), "9 samples");
    // Alone in its group: no peer to compare with.
    let alone = members(&w[1..], "m", Role::Mixed);
    ttft(&o, &w[1], 1, 1_000, 0, S);
    assert_eq!(o.evaluate(&alone, 50, S), Evaluation::default(), "no peer");
    // Samples older than three intervals are forgotten: the peer's are gone.
    let o = Outliers::default();
    ttft(&o, &w[0], 10, 10, 0, 0);
    let later = us(config.interval) * WINDOW_INTERVALS + 1;
    ttft(&o, &w[1], 10, 1_000, 0, later);
    assert_eq!(o.evaluate(&m, 50, later), Evaluation::default());
}

#[test]
fn peers_are_the_same_model_and_role() {
    let o = Outliers::default();
    let prefill = ids(&["p1", "p2"]);
    let decode = ids(&["d1", "d2"]);
    let other = ids(&["x1"]);
    let mut m = members(&prefill, "m", Role::Prefill);
    m.extend(members(&decode, "m", Role::Decode));
    m.extend(members(&other, "other", Role::Mixed));
    // Prefill workers are slow by nature, and so is the other model: neither is an outlier.
    for worker in &prefill {
        ttft(&o, worker, 10, 500, 0, 0);
    }
    ttft(&o, &decode[0], 10, 10, 0, 0);
    ttft(&o, &decode[1], 10, 12, 0, 0);
    ttft(&o, &other[0], 10, 5_000, 0, 0);
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());
    ttft(&o, &decode[1], 10, 200, 0, S);
    let done = o.evaluate(&m, 50, 2 * S);
    assert_eq!(ejected(&done), [("d2", Reason::Ttft)]);
}

#[test]
fn ejections_never_exceed_the_cap_counting_workers_out_for_their_health() {
    let o = Outliers::default();
    let w = ids(&["a", "b", "c", "d", "e"]);
    let mut m = members(&w, "m", Role::Mixed);
    for worker in &w[..3] {
        ttft(&o, worker, 10, 10, 0, 0);
    }
    ttft(&o, &w[3], 10, 500, 0, 0);
    ttft(&o, &w[4], 10, 600, 0, 0);
    // 40 % of five is two: both outliers go.
    let done = o.evaluate(&m, 40, S);
    assert_eq!(done.ejected.len(), 2);
    assert_eq!(done.capped, 0);

    // With one worker out for its health, only one of them goes.
    let o = Outliers::default();
    for worker in &w[..3] {
        ttft(&o, worker, 10, 10, 0, 0);
    }
    ttft(&o, &w[3], 10, 500, 0, 0);
    ttft(&o, &w[4], 10, 600, 0, 0);
    m[0].out = true;
    let done = o.evaluate(&m, 40, S);
    assert_eq!(done.ejected.len(), 1);
    assert_eq!(done.capped, 1);
    assert_eq!(o.ejected().len(), 1);
    // At least one, whatever the percentage.
    let o = Outliers::default();
    for worker in &w[..4] {
        ttft(&o, worker, 10, 10, 0, 0);
    }
    ttft(&o, &w[4], 10, 600, 0, 0);
    m[0].out = false;
    assert_eq!(ejected(&o.evaluate(&m, 0, S)), [("e", Reason::Ttft)]);
}

#[test]
fn an_outlier_returns_after_its_ejection_which_grows_each_time_and_shrinks_back() {
    let o = Outliers::default();
    let w = ids(&["a", "b"]);
    let m = members(&w, "m", Role::Mixed);
    let interval = us(OutlierConfig::default().interval);
    let mut now = 0;
    for (round, length) in [(1, 30), (2, 60), (3, 90)] {
        ttft(&o, &w[0], 10, 10, 0, now);
        ttft(&o, &w[1], 10, 500, 0, now);
        let done = o.evaluate(&m, 50, now);
        assert_eq!(ejected(&done), [("b", Reason::Ttft)], "round {round}");
        assert_eq!(done.ejected[0].until, now + length * S, "round {round}");
        // Still out just before the end, back at it.
        assert!(o.evaluate(&m, 50, now + length * S - 1).returned.is_empty());
        assert_eq!(o.ejected(), ids(&["b"]));
        now += length * S;
        assert_eq!(o.evaluate(&m, 50, now).returned, ids(&["b"]));
        assert!(o.ejected().is_empty());
    }
    // Three intervals in routing without an ejection take three off the count: the next is
    // 30 s again.
    for _ in 0..3 {
        now += interval;
        assert_eq!(o.evaluate(&m, 50, now), Evaluation::default());
    }
    ttft(&o, &w[0], 10, 10, 0, now);
    ttft(&o, &w[1], 10, 500, 0, now);
    let done = o.evaluate(&m, 50, now);
    assert_eq!(done.ejected[0].until, now + 30 * S);
    // The longest ejection is 300 s.
    let o = Outliers::default();
    o.configure(OutlierConfig {
        base_ejection: Duration::from_secs(200),
        ..OutlierConfig::default()
    });
    for round in 0..2 {
        let now = round * 1_000 * S;
        ttft(&o, &w[0], 10, 10, 0, now);
        ttft(&o, &w[1], 10, 500, 0, now);
        let done = o.evaluate(&m, 50, now);
        assert_eq!(done.ejected[0].until, now + [200, 300][round as usize] * S);
        o.evaluate(&m, 50, now + 300 * S);
    }
}

#[test]
fn rules_turned_off_eject_nobody_and_deregistered_workers_are_forgotten() {
    let o = Outliers::default();
    o.configure(OutlierConfig {
        ttft_factor: 0.0,
        error_margin: 0.0,
        ..OutlierConfig::default()
    });
    let w = ids(&["a", "b"]);
    let m = members(&w, "m", Role::Mixed);
    ttft(&o, &w[0], 10, 10, 0, 0);
    ttft(&o, &w[1], 10, 5_000, 0, 0);
    outcomes(&o, &w[1], 10, 1, 0);
    assert_eq!(o.evaluate(&m, 50, S), Evaluation::default());

    let o = Outliers::default();
    ttft(&o, &w[0], 10, 10, 0, 0);
    ttft(&o, &w[1], 10, 500, 0, 0);
    assert_eq!(o.evaluate(&m, 50, S).ejected.len(), 1);
    o.evaluate(&m[..1], 50, 2 * S);
    assert!(o.ejected().is_empty(), "b deregistered: forgotten");
    assert_eq!(o.state().workers.len(), 1);
}
