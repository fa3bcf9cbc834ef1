//! Tenants and the router's queue in the simulator.

use super::*;
use crate::report::Summary;

/// A noisy tenant `a` sending long distinct prompts far faster than two workers prefill them,
/// and a quiet tenant `b` sending short ones now and then.
fn flood() -> Trace {
    let mut requests = Vec::new();
    let mut push = |i: u64, at: u64, tenant: &str, blocks: u64| {
        requests.push(TraceRequest {
            arrival_us: at,
            request_id: format!("{tenant}-{i}"),
            model: "m".into(),
            input_length: blocks as u32 * 16,
            output_length: 8,
            block_size: 16,
            block_hashes: (0..blocks).map(|b| (i + 1) * 1_000_000 + b).collect(),
            tenant: Some(tenant.to_owned()),
            ..TraceRequest::default()
        });
    };
    for i in 0..600 {
        push(i, i * 1_000, "a", 128);
    }
    for i in 0..60 {
        push(10_000 + i, 5_000 + i * 10_000, "b", 4);
    }
    requests.sort_by_key(|r| r.arrival_us);
    Trace {
        requests,
        source: "flood".into(),
        notes: vec![],
    }
}

fn quiet(result: &SimResult) -> (f64, f64) {
    let s = Summary::of(result, 0.0);
    let b = s.by_tenant.iter().find(|t| t.tenant == "b").expect("b");
    (b.ttft_p50_ms, b.ttft_p99_ms)
}

#[test]
fn the_router_queue_keeps_a_quiet_tenant_ahead_of_a_flood() {
    let trace = flood();
    let with = run(&trace, &cfg(2, 100_000)).expect("run");
    let without = run(
        &trace,
        &SimConfig {
            queue_threshold: None,
            ..cfg(2, 100_000)
        },
    )
    .expect("run");
    for r in [&with, &without] {
        assert!(r.requests.iter().all(|q| !q.rejected && q.finish_us > 0));
    }
    let (q, n) = (quiet(&with), quiet(&without));
    eprintln!("quiet tenant's ttft p50/p99 with the queue {q:?} ms, without {n:?} ms");
    assert!(q.1 * 4.0 < n.1, "with {q:?}, without {n:?}");
    // The flood waited in the router instead.
    assert!(with.requests.iter().any(|r| r.router_queue_us > 0));
    assert!(without.requests.iter().all(|r| r.router_queue_us == 0));
}

/// The flood's key file: `a` limited as given, `b` at `b_priority`.
fn keys(a_limits: &str, b_priority: i32) -> String {
    format!(
        r#"{{"tenants": [
            {{"name": "a", "keys": ["sk-a-0123456789abcdef"], "limits": {a_limits}}},
            {{"name": "b", "keys": ["sk-b-0123456789abcdef"], "default_priority": {b_priority},
              "priority_floor": {b_priority}}}
        ]}}"#
    )
}

#[test]
fn a_tenants_limits_refuse_what_the_server_would_and_spare_the_others() {
    let trace = flood();
    // 600 requests of `a` in 0.6 s against 60 a minute: the bucket's burst and no more.
    let limited = SimConfig {
        api_keys: Some(keys(r#"{"requests_per_minute": 60}"#, 0)),
        ..cfg(2, 100_000)
    };
    let result = run(&trace, &limited).expect("run");
    let a: Vec<&RequestOutcome> = result
        .requests
        .iter()
        .filter(|r| r.tenant.as_deref() == Some("a"))
        .collect();
    let served = a.iter().filter(|r| !r.rejected).count();
    assert!(
        (60..=61).contains(&served),
        "a minute's worth and what 0.6 s refills: {served}"
    );
    assert!(
        a.iter()
            .filter(|r| r.rejected)
            .all(|r| r.limited == Some("requests") && r.ttft_us == 0)
    );
    let b_refused = result
        .requests
        .iter()
        .filter(|r| r.tenant.as_deref() == Some("b") && r.rejected)
        .count();
    assert_eq!(b_refused, 0, "b has no limits");
    let s = Summary::of(&result, 0.0);
    let row = s.by_tenant.iter().find(|t| t.tenant == "a").expect("a");
    assert_eq!(
        (row.requests, row.limited),
        (served as u64, 600 - served as u64)
    );
    assert!(crate::report::tenant_table(&s).contains("limited (429)"));

    // A concurrency limit: never more than 3 of a's requests between arrival and finish.
    let result = run(
        &trace,
        &SimConfig {
            api_keys: Some(keys(r#"{"concurrent_requests": 3}"#, 0)),
            ..cfg(2, 100_000)
        },
    )
    .expect("run");
    let spans: Vec<(u64, u64)> = result
        .requests
        .iter()
        .filter(|r| r.tenant.as_deref() == Some("a") && !r.rejected)
        .map(|r| (r.arrival_us, r.finish_us - cfg(2, 100_000).frontend_us))
        .collect();
    assert!(spans.len() >= 3);
    for (start, _) in &spans {
        let open = spans
            .iter()
            .filter(|(s, f)| s <= start && start < f)
            .count();
        assert!(open <= 3, "{open} of a's requests in flight at {start}");
    }
    assert!(
        result
            .requests
            .iter()
            .any(|r| r.limited == Some("concurrency"))
    );
}

/// 600 distinct 2,048-token prompts, one a millisecond (far more than two workers prefill), of
/// the tenant and priority `tenant` and `priority` give request `i`.
fn long_flood(
    tenant: impl Fn(u64) -> &'static str,
    priority: impl Fn(u64) -> Option<i32>,
) -> Trace {
    let requests = (0..600u64)
        .map(|i| TraceRequest {
            arrival_us: i * 1_000,
            request_id: format!("r{i}"),
            model: "m".into(),
            input_length: 128 * 16,
            output_length: 8,
            block_size: 16,
            block_hashes: (0..128).map(|b| (i + 1) * 1_000_000 + b).collect(),
            tenant: Some(tenant(i).to_owned()),
            priority: priority(i),
            ..TraceRequest::default()
        })
        .collect();
    Trace {
        requests,
        source: "flood".into(),
        notes: vec![],
    }
}

#[test]
fn a_more_urgent_tenant_leaves_the_queue_first() {
    // Two tenants flooding alike, their requests interleaved.
    let trace = long_flood(|i| if i % 2 == 0 { "a" } else { "b" }, |_| None);
    let mean_wait_ms = |priority: i32, tenant: &str| {
        let result = run(
            &trace,
            &SimConfig {
                api_keys: Some(keys("{}", priority)),
                ..cfg(2, 100_000)
            },
        )
        .expect("run");
        let waits: Vec<u64> = result
            .requests
            .iter()
            .filter(|r| r.tenant.as_deref() == Some(tenant))
            .map(|r| r.router_queue_us)
            .collect();
        waits.iter().sum::<u64>() as f64 / waits.len() as f64 / 1e3
    };
    let same = (mean_wait_ms(0, "a"), mean_wait_ms(0, "b"));
    let urgent = (mean_wait_ms(-1, "a"), mean_wait_ms(-1, "b"));
    eprintln!("mean router queue time (a, b) ms: same priority {same:?}, b more urgent {urgent:?}");
    assert!(
        same.0 > 0.0 && (same.1 / same.0 - 1.0).abs() < 0.25,
        "{same:?}"
    );
    // b still waits behind its own backlog, never behind a's.
    assert!(
        urgent.1 * 2.0 < urgent.0 && urgent.1 * 2.0 < same.1,
        "b is served first: {urgent:?} against {same:?}"
    );
}

#[test]
fn a_request_that_asked_for_priority_leaves_the_queue_first_within_its_floor() {
    // One tenant's flood; every fifth request asked to be more urgent (lower is sooner).
    let trace = long_flood(|_| "a", |i| (i % 5 == 0).then_some(-5));
    // Mean router-queue wait (ms) of the requests that asked, and of the others.
    let waits = |api_keys: Option<String>| {
        let result = run(
            &trace,
            &SimConfig {
                api_keys,
                ..cfg(2, 100_000)
            },
        )
        .expect("run");
        let mean = |asked: bool| {
            let w: Vec<u64> = result
                .requests
                .iter()
                .zip(&trace.requests)
                .filter(|(_, t)| t.priority.is_some() == asked)
                .map(|(r, _)| r.router_queue_us)
                .collect();
            w.iter().sum::<u64>() as f64 / w.len() as f64 / 1e3
        };
        (mean(true), mean(false))
    };
    let anonymous = waits(None);
    // A key file whose floor (0) does not let `a` ask for more than the default.
    let floored = waits(Some(
        r#"{"tenants": [{"name": "a", "keys": ["sk-a-0123456789abcdef"], "priority_floor": 0}]}"#
            .to_owned(),
    ));
    eprintln!("mean router queue time (asked, others) ms: {anonymous:?}; at floor 0 {floored:?}");
    assert!(
        anonymous.0 * 4.0 < anonymous.1,
        "the urgent requests wait less: {anonymous:?}"
    );
    assert!(
        (floored.0 / floored.1 - 1.0).abs() < 0.5,
        "the floor holds them to the default: {floored:?}"
    );
}
