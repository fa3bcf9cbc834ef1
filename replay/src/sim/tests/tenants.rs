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
