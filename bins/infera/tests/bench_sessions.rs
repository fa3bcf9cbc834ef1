//! `infera bench` plays a synthesized agentic trace as sessions against a live `infera up`: each
//! turn leaves one think time after its predecessor's answer ended, and later turns find their
//! conversation's prefix in the cache.
#![allow(clippy::unwrap_used)]

mod common;
mod fidelity_harness;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use fidelity_harness::{Setup, start_fleet};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::collections::HashMap;
use std::process::Command;

const INFERA: &str = env!("CARGO_BIN_EXE_infera");
const SPEEDUP: f64 = 10.0;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One measured request: (arrival = scheduled send, finish, cached tokens, prompt tokens).
type Row = (u64, u64, u32, u32);

fn read_rows(path: &std::path::Path) -> HashMap<String, Row> {
    let file = std::fs::File::open(path).unwrap();
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .unwrap()
        .build()
        .unwrap();
    let mut rows = HashMap::new();
    for batch in reader {
        let batch = batch.unwrap();
        let col = |name: &str| batch.column_by_name(name).unwrap().clone();
        let (ids, arrival, finish, cached, input) = (
            col("request_id"),
            col("arrival_us"),
            col("finish_us"),
            col("cached_tokens"),
            col("input_tokens"),
        );
        for i in 0..batch.num_rows() {
            rows.insert(
                ids.as_string::<i32>().value(i).to_owned(),
                (
                    arrival.as_primitive::<UInt64Type>().value(i),
                    finish.as_primitive::<UInt64Type>().value(i),
                    cached.as_primitive::<UInt32Type>().value(i),
                    input.as_primitive::<UInt32Type>().value(i),
                ),
            );
        }
    }
    rows
}

#[test]
fn session_turns_leave_after_the_previous_answer_and_hit_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("agentic.parquet");
    let synth = Command::new(INFERA)
        .args(["trace", "synth"])
        .arg(&trace)
        .args(["--sessions", "4", "--concurrency", "2", "--turns", "3..5"])
        .args(["--tool-tokens", "256", "--system-tokens", "128"])
        .args(["--first-input-tokens", "200", "--turn-input-tokens", "100"])
        .args(["--output-tokens", "8", "--tool-think-ms", "300"])
        .args(["--user-think-s", "1", "--block-size", "16", "--seed", "2"])
        .output()
        .unwrap();
    assert!(synth.status.success(), "{}", text(&synth.stderr));

    let setup = Setup {
        trace: trace.clone(),
        limit: 100,
        workers: 2,
        gpu_blocks: 4096,
        block_size: 16,
        speedup: SPEEDUP,
    };
    let mut fleet = start_fleet(INFERA, &setup);
    let out = dir.path().join("live.parquet");
    let run = Command::new(INFERA)
        .arg("bench")
        .arg(&trace)
        .args(["--target", &format!("http://{}", fleet.server)])
        .args(["--model", "mock", "--speedup", &SPEEDUP.to_string()])
        .arg("--out")
        .arg(&out)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", text(&run.stderr));
    assert!(
        stdout.contains("session turns after their predecessors"),
        "{stdout}"
    );
    assert!(fleet.proc.terminate().success());

    let rows = read_rows(&out);
    let synth_rows = infera_replay::trace::load(&trace, &Default::default()).unwrap();
    assert_eq!(rows.len(), synth_rows.requests.len(), "every turn was sent");
    let mut previous: HashMap<&str, &str> = HashMap::new();
    let (mut later, mut cached, mut prompt) = (0, 0u64, 0u64);
    for r in &synth_rows.requests {
        let session = r.session_id.as_deref().unwrap();
        if let Some(prev) = previous.insert(session, &r.request_id) {
            let (arrival, ..) = rows[&r.request_id];
            let (_, prev_finish, ..) = rows[prev];
            let think = (r.think_time_us.unwrap() as f64 / SPEEDUP) as u64;
            assert!(
                arrival + 1 >= prev_finish + think,
                "{} left at {arrival} us, before {prev} ended at {prev_finish} us + {think} us",
                r.request_id
            );
            let (.., c, p) = rows[&r.request_id];
            later += 1;
            cached += u64::from(c);
            prompt += u64::from(p);
        }
    }
    assert!(later > 4);
    let hit = cached as f64 / prompt as f64;
    assert!(hit > 0.5, "later turns' server-reported hit rate {hit}");
}
