//! `infera bench` as a user runs it: the text report and `--out` files against a live
//! `infera up`, a clear failure when nothing answers, and exit 2 for invalid flags.
#![allow(clippy::unwrap_used)]

mod common;
mod fidelity_harness;

use fidelity_harness::{Setup, mooncake_trace, start_fleet};
use std::process::Command;

const INFERA: &str = env!("CARGO_BIN_EXE_infera");

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn reports_latencies_and_hit_rate_and_writes_replay_columns() {
    let setup = Setup {
        trace: mooncake_trace(),
        limit: 40,
        workers: 2,
        gpu_blocks: 2048,
        block_size: 512,
        speedup: 20.0,
    };
    let mut fleet = start_fleet(INFERA, &setup);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("live.parquet");
    let run = Command::new(INFERA)
        .arg("bench")
        .arg(&setup.trace)
        .args(["--target", &format!("http://{}/v1", fleet.server)])
        .args(["--model", "mock", "--limit", "40", "--speedup", "20"])
        .args([
            "--max-concurrency",
            "8",
            "--max-tokens",
            "4",
            "--api",
            "chat",
        ])
        .arg("--out")
        .arg(&out)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", text(&run.stderr));
    for expected in [
        "40 sent, 40 ok, 0 errors",
        "hit rate",
        "ttft",
        "itl",
        "send lag",
        "output tok/s",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing from:\n{stdout}"
        );
    }
    assert!(out.is_file() && dir.path().join("live.summary.parquet").is_file());
    assert!(fleet.proc.terminate().success());
}

#[test]
fn nothing_listening_fails_with_the_reason_and_bad_flags_exit_2() {
    let port = common::free_port();
    let run = Command::new(INFERA)
        .arg("bench")
        .arg(mooncake_trace())
        .args(["--target", &format!("http://127.0.0.1:{port}")])
        .args(["--limit", "3", "--speedup", "1000"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("infera bench: error: no request succeeded")
            && stderr.contains("127.0.0.1"),
        "{stderr}"
    );
    for bad in [
        &["--target", "https://example.com"][..],
        &["--target", "http://127.0.0.1:1", "--speedup", "0"],
        &["--target", "http://127.0.0.1:1", "--out", "x.csv"],
    ] {
        let run = Command::new(INFERA)
            .arg("bench")
            .arg(mooncake_trace())
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(run.status.code(), Some(2), "{bad:?}: {}", text(&run.stderr));
    }
}
