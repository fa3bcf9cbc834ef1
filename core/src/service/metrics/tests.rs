use super::*;

#[test]
fn every_family_a_failure_path_feeds_renders_with_its_type_and_labels() {
    let m = Metrics::default();
    m.pick("prefill", "w#dp1".into(), 3, 8);
    m.pd_bootstrap_failure("prefill_5xx");
    m.migration_failed("limit");
    m.migrations_by_reason
        .get_or_create(&[("reason", "stream_broken")])
        .inc();
    m.pd_dispatch_duration
        .get_or_create(&[("leg", "decode".into()), ("worker_id", "w".into())])
        .observe(0.3);
    m.worker_breaker_trips
        .get_or_create(&[("worker_id", "w".into())])
        .inc();
    let text = m.render(|_| {});
    let picks = r#"infera_router_picks_total{role="prefill",worker_id="w#dp1"} 1"#;
    let hits = r#"infera_router_pick_cache_hits_bucket{role="prefill",le="4.0"} 1"#;
    let leg =
        r#"infera_pd_dispatch_duration_seconds_bucket{leg="decode",worker_id="w",le="0.5"} 1"#;
    for (family, kind, sample) in [
        ("infera_router_picks_total", "counter", picks),
        ("infera_router_pick_cache_hits", "histogram", hits),
        ("infera_pd_dispatch_duration_seconds", "histogram", leg),
        (
            "infera_migrations_total",
            "counter",
            r#"infera_migrations_total{reason="stream_broken"} 1"#,
        ),
        (
            "infera_migrations_failed_total",
            "counter",
            r#"infera_migrations_failed_total{reason="limit"} 1"#,
        ),
        (
            "infera_pd_bootstrap_failures_total",
            "counter",
            r#"infera_pd_bootstrap_failures_total{reason="prefill_5xx"} 1"#,
        ),
        (
            "infera_router_worker_breaker_trips_total",
            "counter",
            r#"infera_router_worker_breaker_trips_total{worker_id="w"} 1"#,
        ),
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} {kind}\n")),
            "{family}:\n{text}"
        );
        assert!(text.contains(&format!("{sample}\n")), "{sample}:\n{text}");
    }
}
