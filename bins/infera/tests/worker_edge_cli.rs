//! The flags of the server's edge toward workers, against the real binary: the HTTP request
//! deadlines (`--http-req-*`), the Python Infera's circuit-breaker flags (`--breaker-*`) and the
//! active health checks (`--health-check-*`) are listed in `--help` with their defaults, resolve into the printed configuration, and bad
//! values fail on one line naming the flag.
#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};
use std::process::{Command, Output};

fn infera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(args)
        .env_remove("NATS_SERVER")
        .env_remove("INFERA_K8S_LABEL_SELECTOR")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// `infera server --check-config` with a readable tokenizer and `extra`.
fn server(extra: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
    let mut args = vec![
        "server",
        "--router-tokenizer-path",
        dir.path().to_str().unwrap(),
        "--k8s-label-selector",
        "app=infera-worker",
        "--check-config",
    ];
    args.extend_from_slice(extra);
    infera(&args)
}

fn edge_config(extra: &[&str]) -> Value {
    let output = server(extra);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let config: Value = serde_json::from_slice(&output.stdout).unwrap();
    config["worker_edge"].clone()
}

#[test]
fn help_lists_the_deadlines_and_breaker_flags_with_their_defaults() {
    let output = infera(&["server", "--help"]);
    assert_eq!(output.status.code(), Some(0));
    let help = String::from_utf8_lossy(&output.stdout);
    // One whitespace-collapsed text, so a flag's help may wrap over lines.
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for (flag, default) in [
        ("--http-req-connect-timeout", "[default: 10s]"),
        (
            "--http-req-first-byte-timeout",
            "[default: derived per request",
        ),
        ("--http-req-idle-timeout", "[default: 900s]"),
        ("--http-req-max-duration", "[default: 0]"),
        ("--breaker-failure-threshold", "[default: 3]"),
        ("--breaker-cooldown-s", "[default: 5]"),
        ("--breaker-max-cooldown-s", "[default: 60]"),
        ("--migration-limit", "[default: 0]"),
        ("--health-check-interval", "[default: 2s]"),
        ("--health-check-timeout", "[default: 2s]"),
        ("--health-check-unhealthy-threshold", "[default: 3]"),
        ("--health-check-healthy-threshold", "[default: 2]"),
        ("--max-ejection-percent", "[default: 50]"),
        ("--outlier-interval", "[default: 10s]"),
        ("--outlier-min-requests", "[default: 10]"),
        ("--outlier-ttft-factor", "[default: 5]"),
        ("--outlier-error-margin", "[default: 50]"),
        ("--outlier-base-ejection-time", "[default: 30s]"),
        ("--outlier-max-ejection-time", "[default: 300s]"),
    ] {
        let at = help
            .find(&format!("{flag} <"))
            .unwrap_or_else(|| panic!("--help lacks {flag}: {help}"));
        // The entry's default is the first one after its name.
        let entry = &help[at..];
        let shown = entry.find("[default:").map(|i| &entry[i..]);
        assert!(
            shown.is_some_and(|d| d.starts_with(default)),
            "{flag} should show {default}: {entry}"
        );
    }
}

#[test]
fn defaults_and_values_resolve_into_the_configuration() {
    assert_eq!(
        edge_config(&[]),
        json!({
            "connect_timeout": "10s",
            "first_byte_timeout": "derived",
            "idle_timeout": "15m",
            "max_duration": null,
            "breaker_failure_threshold": 3,
            "breaker_cooldown_s": 5.0,
            "breaker_max_cooldown_s": 60.0,
            "migration_limit": 0,
            "health_check_interval": "2s",
            "health_check_timeout": "2s",
            "health_check_unhealthy_threshold": 3,
            "health_check_healthy_threshold": 2,
            "health_check_stall_timeout": "6s",
            "max_ejection_percent": 50,
            "outliers": {
                "interval": "10s",
                "min_requests": 10,
                "ttft_factor": 5.0,
                "error_margin_percent": 50,
                "base_ejection_time": "30s",
                "max_ejection_time": "5m",
            },
        })
    );
    // The Python launcher passes floats; 0 turns a deadline off, and the breaker.
    let config = edge_config(&[
        "--http-req-connect-timeout",
        "0",
        "--http-req-first-byte-timeout",
        "2m",
        "--http-req-idle-timeout",
        "30s",
        "--http-req-max-duration",
        "1h",
        "--breaker-failure-threshold",
        "0",
        "--breaker-cooldown-s",
        "0.5",
        "--breaker-max-cooldown-s",
        "2.5",
        "--migration-limit",
        "2",
        "--health-check-interval",
        "500ms",
        "--health-check-unhealthy-threshold",
        "0",
        "--max-ejection-percent",
        "100",
        "--outlier-ttft-factor",
        "0",
        "--outlier-error-margin",
        "20",
        "--outlier-base-ejection-time",
        "1m",
    ]);
    assert_eq!(config["connect_timeout"], Value::Null);
    assert_eq!(config["first_byte_timeout"], json!({"fixed": "2m"}));
    assert_eq!(config["idle_timeout"], "30s");
    assert_eq!(config["max_duration"], "1h");
    assert_eq!(config["breaker_failure_threshold"], 0);
    assert_eq!(config["breaker_cooldown_s"], 0.5);
    assert_eq!(config["breaker_max_cooldown_s"], 2.5);
    assert_eq!(config["migration_limit"], 2);
    assert_eq!(config["health_check_interval"], "500ms");
    assert_eq!(config["health_check_unhealthy_threshold"], 0);
    assert_eq!(config["max_ejection_percent"], 100);
    assert_eq!(config["outliers"]["ttft_factor"], 0.0);
    assert_eq!(config["outliers"]["error_margin_percent"], 20);
    assert_eq!(config["outliers"]["base_ejection_time"], "1m");
    let off = edge_config(&["--http-req-first-byte-timeout", "0"]);
    assert_eq!(off["first_byte_timeout"], "off");
}

#[test]
fn bad_values_fail_on_one_line_naming_the_flag() {
    for (args, flag) in [
        (&["--breaker-cooldown-s", "-1"][..], "--breaker-cooldown-s"),
        (
            &[
                "--breaker-cooldown-s",
                "10",
                "--breaker-max-cooldown-s",
                "5",
            ][..],
            "--breaker-max-cooldown-s",
        ),
        (&["--breaker-cooldown-s", "inf"][..], "--breaker-cooldown-s"),
        (
            &["--http-req-idle-timeout", "soon"][..],
            "--http-req-idle-timeout",
        ),
        (
            &["--breaker-failure-threshold", "x"][..],
            "--breaker-failure-threshold",
        ),
        (
            &["--max-ejection-percent", "101"][..],
            "--max-ejection-percent",
        ),
        (
            &["--health-check-timeout", "0"][..],
            "--health-check-timeout",
        ),
        (
            &["--outlier-max-ejection-time", "10s"][..],
            "--outlier-max-ejection-time",
        ),
        (
            &["--outlier-ttft-factor", "-1"][..],
            "--outlier-ttft-factor",
        ),
        (
            &["--outlier-min-requests", "21"][..],
            "--outlier-min-requests",
        ),
        (&["--outlier-interval", "0"][..], "--outlier-interval"),
    ] {
        let output = server(args);
        let message = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {message}");
        let lines: Vec<&str> = message.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(
            lines.iter().any(|l| l.contains(flag)),
            "{args:?}: {message} does not name {flag}"
        );
        assert!(output.stdout.is_empty(), "{args:?} printed to stdout");
    }
}
