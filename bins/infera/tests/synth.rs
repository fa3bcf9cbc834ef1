//! `infera trace synth` and `infera replay --tune` end to end, through the real binary: the same
//! seed writes the same trace, the trace replays as sessions and as a timeline, `--tune` prints
//! its Pareto front with the flags to use and charts it, and bad flags fail before anything is
//! written.

use std::path::Path;
use std::process::{Command, Output};

fn infera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run infera")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn synth(path: &Path, extra: &[&str]) -> Output {
    let p = path.display().to_string();
    let mut args = vec![
        "trace",
        "synth",
        p.as_str(),
        "--sessions",
        "8",
        "--turns",
        "3..8",
    ];
    args.extend_from_slice(extra);
    infera(&args)
}

#[test]
fn synth_is_deterministic_for_a_seed_and_replays_as_sessions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, c) = (
        dir.path().join("a.parquet"),
        dir.path().join("b.parquet"),
        dir.path().join("c.parquet"),
    );
    let out = synth(&a, &["--seed", "5"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("of 8 sessions"), "{stdout}");
    assert!(stdout.contains("ideal hit rate"), "{stdout}");
    assert!(synth(&b, &["--seed", "5"]).status.success());
    assert!(synth(&c, &["--seed", "6"]).status.success());
    let read = |p: &Path| std::fs::read(p).expect("read");
    assert_eq!(read(&a), read(&b), "same seed, same file");
    assert_ne!(read(&a), read(&c), "another seed, another trace");

    let trace = a.display().to_string();
    for playback in ["sessions", "timeline"] {
        let out = infera(&["replay", &trace, "--workers", "2", "--playback", playback]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(stdout.contains("best: base"), "{stdout}");
        assert_eq!(
            stdout.contains("session turns leave when their predecessor finished"),
            playback == "sessions",
            "{stdout}"
        );
    }
}

#[test]
fn tune_prints_the_front_with_flags_and_charts_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("t.parquet");
    assert!(synth(&trace, &[]).status.success());
    let chart = dir.path().join("front.svg");
    let out = infera(&[
        "replay",
        &trace.display().to_string(),
        "--workers",
        "2",
        "--tune",
        "--plot",
        &chart.display().to_string(),
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("Pareto front ("), "{stdout}");
    let recommended = stdout
        .split("recommended (")
        .nth(1)
        .and_then(|rest| rest.lines().nth(1))
        .expect("a recommended line");
    assert!(
        recommended.contains("--kv-overlap-weight ")
            && recommended.contains("--router-resident-weight ")
            && recommended.contains("--router-balance-tokens "),
        "{recommended}"
    );
    let svg = std::fs::read_to_string(&chart).expect("chart written");
    assert!(
        svg.contains("<svg") && svg.contains("recommended"),
        "{svg:.200}"
    );

    // The --sweep axes, when given, are the search space.
    let custom = infera(&[
        "replay",
        &trace.display().to_string(),
        "--workers",
        "2",
        "--tune",
        "--sweep",
        "kv-overlap-weight=0,4",
    ]);
    let custom = text(&custom.stdout);
    assert!(custom.contains("of 2 configurations"), "{custom}");
    assert!(!custom.contains("--router-balance-tokens"), "{custom}");

    // Deterministic: the same search recommends the same flags.
    let again = infera(&[
        "replay",
        &trace.display().to_string(),
        "--workers",
        "2",
        "--tune",
    ]);
    assert!(
        text(&again.stdout).contains(recommended),
        "{}",
        text(&again.stdout)
    );
}

#[test]
fn bad_synth_flags_exit_2_and_write_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("x.parquet");
    for (flags, needle) in [
        (&["--turns", "7"][..], "MIN..MAX"),
        (&["--turns", "9..3"][..], "MIN <= MAX"),
        (&["--concurrency", "0"][..], "concurrency"),
        (&["--tool-call-fraction", "2"][..], "tool-call fraction"),
        (&["--block-size", "0"][..], "block size"),
    ] {
        let p = path.display().to_string();
        let mut args = vec!["trace", "synth", p.as_str()];
        args.extend_from_slice(flags);
        let out = infera(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
        assert!(!path.exists(), "{flags:?} wrote a file");
    }
    let out = infera(&[
        "trace",
        "synth",
        &dir.path().join("x.csv").display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(2));
}
