//! Regenerates the committed Parquet fixtures from the public JSONL traces, prints their
//! summaries, and times loading each format.
//!
//! ```text
//! cargo run --release -p infera-replay --example convert_fixtures            # write + report
//! cargo run --release -p infera-replay --example convert_fixtures -- --check # report only
//! ```
//!
//! Each `fixtures/traces/<name>.parquet` is `load(<name>.jsonl, &LoadOptions::default())` (seed 0,
//! bucket spreading on) plus one note saying so, written with `write_parquet`.

use infera_replay::trace::{LoadOptions, load, summarize, write_parquet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The fixtures converted, by file stem.
const FIXTURES: [&str; 2] = ["conversation_trace", "mooncake_trace_1000"];

/// The note added to each converted fixture (tests expect exactly this text).
const CONVERSION_NOTE: &str = "converted from {file} by replay/examples/convert_fixtures.rs with \
                               LoadOptions::default() (seed 0, bucket spreading on)";

fn best_of<T>(runs: u32, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let out = f();
        best = best.min(start.elapsed());
        last = Some(out);
    }
    match last {
        Some(out) => (best, out),
        None => (Duration::ZERO, f()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let check_only = std::env::args().any(|a| a == "--check");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/traces");
    let opts = LoadOptions::default();
    for stem in FIXTURES {
        let jsonl = dir.join(format!("{stem}.jsonl"));
        let parquet = dir.join(format!("{stem}.parquet"));
        if !check_only {
            let mut trace = load(&jsonl, &opts)?;
            trace
                .notes
                .push(CONVERSION_NOTE.replace("{file}", &format!("{stem}.jsonl")));
            write_parquet(&trace, &parquet)?;
            println!(
                "wrote {} ({} bytes)",
                parquet.display(),
                std::fs::metadata(&parquet)?.len()
            );
        }
        let (t_jsonl, from_jsonl) = best_of(5, || load(&jsonl, &opts));
        let (t_parquet, from_parquet) = best_of(5, || load(&parquet, &opts));
        let (from_jsonl, from_parquet) = (from_jsonl?, from_parquet?);
        if from_jsonl.requests != from_parquet.requests {
            return Err(
                format!("{stem}: the Parquet fixture differs from the JSONL import").into(),
            );
        }
        println!("{}", summarize(&from_parquet));
        println!(
            "load time (best of 5): {stem}.jsonl {:.1} ms, {stem}.parquet {:.1} ms\n",
            t_jsonl.as_secs_f64() * 1e3,
            t_parquet.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
