//! Trace format and importers against the real public fixtures, round trips, and bad input.

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use infera_core::event::Retention;
use infera_replay::trace::schema::{META_VERSION, col, to_record_batch, trace_schema};
use infera_replay::trace::{
    LoadOptions, Trace, TraceError, TraceRequest, load, spread_buckets, summarize, write_parquet,
};
use parquet::arrow::arrow_writer::ArrowWriter;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/traces")
        .join(name)
}

fn as_is() -> LoadOptions {
    LoadOptions {
        spread_buckets: false,
        ..LoadOptions::default()
    }
}

fn load_ok(path: &Path, opts: &LoadOptions) -> Trace {
    match load(path, opts) {
        Ok(t) => t,
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

fn close(actual: f64, expected: f64, tolerance: f64, what: &str) {
    assert!(
        (actual - expected).abs() <= tolerance,
        "{what}: {actual} is not within {tolerance} of {expected}"
    );
}

// ---------------------------------------------------------------------------------------------
// Importers on the real fixtures (figures from fixtures/traces/README.md).

#[test]
fn conversation_trace_matches_the_readme() {
    let trace = load_ok(&fixture("conversation_trace.jsonl"), &as_is());
    let s = summarize(&trace);
    assert_eq!(s.requests, 12_031);
    close(s.span_s, 3_536.999, 1e-9, "span");
    close(s.rate_per_s.unwrap_or_default(), 3.40, 0.005, "rate");
    assert_eq!((s.blocks_total, s.blocks_distinct), (288_500, 182_790));
    assert_eq!(s.block_sizes, vec![512]);
    close(s.ideal_hit_rate * 100.0, 36.6, 0.05, "hit rate");
    close(s.ideal_token_hit_rate * 100.0, 37.4, 0.05, "token hit rate");
    close(
        s.requests_with_hit as f64 / 12_031.0 * 100.0,
        99.99,
        0.005,
        "requests with a hit",
    );
    close(s.input.mean, 12_035.0, 0.5, "input mean");
    close(s.input.p50, 6_909.0, 0.5, "input p50");
    close(s.input.p99, 85_400.0, 0.5, "input p99");
    assert_eq!(s.input.max, 126_195);
    close(s.output.mean, 343.0, 0.5, "output mean");
    close(s.output.p50, 350.0, 0.5, "output p50");
    close(s.output.p99, 1_119.0, 0.5, "output p99");
    assert!(
        s.to_string()
            .contains("36.6 % of blocks (37.4 % of tokens)"),
        "{s}"
    );

    let first = &trace.requests[0];
    assert_eq!(first.request_id, "conversation_trace-1");
    assert_eq!(
        (first.arrival_us, first.input_length, first.output_length),
        (0, 6758, 500)
    );
    assert_eq!(first.block_hashes, (0..14).collect::<Vec<u64>>());
    assert_eq!(first.model, "default");
    assert_eq!(
        trace.requests[12_030].request_id,
        "conversation_trace-12031"
    );
}

#[test]
fn mooncake_trace_1000_matches_the_readme() {
    let trace = load_ok(&fixture("mooncake_trace_1000.jsonl"), &as_is());
    let s = summarize(&trace);
    assert_eq!(s.requests, 1_000);
    close(s.span_s, 177.098, 1e-9, "span");
    close(s.rate_per_s.unwrap_or_default(), 5.65, 0.005, "rate");
    close(s.ideal_hit_rate * 100.0, 38.0, 0.05, "hit rate");
    close(s.ideal_token_hit_rate * 100.0, 39.1, 0.05, "token hit rate");
    close(s.input.mean, 9_792.0, 0.5, "input mean");
    close(s.input.p50, 6_558.0, 0.5, "input p50");
    close(s.input.p99, 77_828.0, 0.5, "input p99");
    close(s.output.mean, 199.0, 0.5, "output mean");
    close(s.output.p50, 34.0, 0.5, "output p50");
    close(s.output.p99, 831.0, 0.5, "output p99");
    assert_eq!(
        s.blocks_total,
        trace
            .requests
            .iter()
            .map(|r| r.block_hashes.len() as u64)
            .sum::<u64>()
    );
    assert!(
        s.to_string()
            .contains("38.0 % of blocks (39.1 % of tokens)"),
        "{s}"
    );
}

#[test]
fn synthetic_trace_matches_the_readme() {
    let s = summarize(&load_ok(&fixture("synthetic_trace.jsonl"), &as_is()));
    assert_eq!(s.requests, 3_993);
    close(s.span_s, 1_022.025, 1e-9, "span");
    close(s.ideal_hit_rate * 100.0, 64.0, 0.05, "hit rate");
    close(s.ideal_token_hit_rate * 100.0, 65.1, 0.05, "token hit rate");
    close(
        s.requests_with_hit as f64 / 3_993.0 * 100.0,
        44.6,
        0.05,
        "requests with a hit",
    );
}

#[test]
fn azure_conv_trace_matches_the_readme() {
    let path = fixture("AzureLLMInferenceTrace_conv.csv");
    let trace = load_ok(&path, &LoadOptions::default());
    let s = summarize(&trace);
    assert_eq!(s.requests, 19_366);
    // 18:15:46.6805900 to 19:14:08.4025270.
    close(s.span_s, 3_501.721_937, 1e-6, "span");
    close(s.span_s / 60.0, 58.4, 0.05, "span in minutes");
    close(s.rate_per_s.unwrap_or_default(), 5.53, 0.005, "rate");
    close(s.input.mean, 1_155.0, 0.5, "input mean");
    close(s.input.p50, 1_020.0, 0.5, "input p50");
    close(s.input.p99, 4_142.0, 0.5, "input p99");
    close(s.output.mean, 211.0, 0.5, "output mean");
    close(s.output.p50, 129.0, 0.5, "output p50");
    close(s.output.p99, 601.0, 0.5, "output p99");
    // No prefix sharing: every block id is unique.
    assert_eq!(s.block_sizes, vec![16]);
    assert_eq!(s.blocks_total, s.blocks_distinct);
    assert_eq!(s.hit_blocks, 0);
    for r in &trace.requests {
        assert_eq!(r.block_hashes.len() as u32, r.input_length.div_ceil(16));
    }
    assert_eq!(trace.requests[0].arrival_us, 0);
    assert_eq!(trace.requests[1].arrival_us, 4_314_579); // 50.9951690 − 46.6805900 s
    assert_eq!(
        trace.requests[0].request_id,
        "AzureLLMInferenceTrace_conv-2"
    );

    let coarse = load_ok(
        &path,
        &LoadOptions {
            block_size: Some(64),
            model: "llama".into(),
            ..LoadOptions::default()
        },
    );
    assert_eq!(coarse.requests[0].block_hashes.len(), 374usize.div_ceil(64));
    assert_eq!(coarse.requests[0].model, "llama");
}

// ---------------------------------------------------------------------------------------------
// Bucket spreading.

/// `(original arrival, spread arrival)` of every request, checked against its bucket's bounds.
fn assert_within_buckets(original: &[u64], spread: &[u64]) {
    let mut distinct: Vec<u64> = original.to_vec();
    distinct.dedup();
    let gaps: Vec<u64> = distinct.windows(2).map(|w| w[1] - w[0]).collect();
    let mut sorted = gaps.clone();
    sorted.sort_unstable();
    let median = match sorted.len() {
        0 => 0,
        n if n % 2 == 1 => sorted[n / 2],
        n => sorted[n / 2 - 1] + (sorted[n / 2] - sorted[n / 2 - 1]) / 2,
    };
    for (&o, &s) in original.iter().zip(spread) {
        let k = distinct.partition_point(|&d| d < o);
        let width = gaps.get(k).copied().unwrap_or(median).max(1);
        assert!(o <= s && s < o + width, "{s} outside [{o}, {})", o + width);
    }
    assert!(spread.windows(2).all(|w| w[0] <= w[1]), "not monotonic");
}

#[test]
fn bucket_spreading_is_deterministic_monotonic_and_bounded() {
    let path = fixture("conversation_trace.jsonl");
    let raw = load_ok(&path, &as_is());
    let original: Vec<u64> = raw.requests.iter().map(|r| r.arrival_us).collect();
    let spread_with = |seed| {
        load_ok(
            &path,
            &LoadOptions {
                seed,
                ..LoadOptions::default()
            },
        )
    };
    let a = spread_with(0);
    let b = spread_with(0);
    let c = spread_with(1);
    let arrivals = |t: &Trace| t.requests.iter().map(|r| r.arrival_us).collect::<Vec<_>>();
    assert_eq!(arrivals(&a), arrivals(&b), "same seed, same arrivals");
    assert_ne!(arrivals(&a), arrivals(&c), "another seed, other arrivals");
    assert_within_buckets(&original, &arrivals(&a));
    assert_within_buckets(&original, &arrivals(&c));
    // Only arrivals change; file order and everything else are kept.
    for (x, y) in raw.requests.iter().zip(&a.requests) {
        assert_eq!(
            (&x.request_id, &x.block_hashes),
            (&y.request_id, &y.block_hashes)
        );
    }
    // The spread trace no longer releases a whole bucket at once.
    let mut distinct = arrivals(&a);
    distinct.dedup();
    assert!(
        distinct.len() > 12_000,
        "{} distinct arrivals",
        distinct.len()
    );
    let note = a.notes.join("\n");
    assert!(note.contains("seed 0"), "{note}");
    assert!(
        note.contains("12031 requests sharing 1180 of 1180"),
        "{note}"
    );
    assert!(note.contains("median 3.000 s"), "{note}");
    // The ideal hit rate does not depend on spreading (order within buckets is kept).
    close(
        summarize(&a).ideal_hit_rate,
        summarize(&raw).ideal_hit_rate,
        1e-12,
        "hit rate",
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn spreading_keeps_order_and_bounds(
        deltas in prop::collection::vec(prop_oneof![Just(0u64), 1u64..5_000_000], 0..200),
        seed in any::<u64>(),
    ) {
        let mut original = Vec::with_capacity(deltas.len());
        let mut t = 0u64;
        for d in deltas {
            t += d;
            original.push(t);
        }
        let mut spread = original.clone();
        let report = spread_buckets(&mut spread, seed);
        prop_assert!(report.is_some());
        assert_within_buckets(&original, &spread);
        let mut again = original.clone();
        spread_buckets(&mut again, seed);
        prop_assert_eq!(spread, again);
    }
}

// ---------------------------------------------------------------------------------------------
// Parquet.

fn request_strategy() -> impl Strategy<Value = (u64, TraceRequest)> {
    (
        (
            0u64..10_000_000,
            "[a-z0-9-]{0,12}",
            "\\PC{0,8}",
            0u32..300,
            any::<u32>(),
            1u32..64,
        ),
        (
            any::<bool>(),
            prop::option::of(any::<u32>()),
            prop::option::of("\\PC{0,10}"),
            prop::option::of(prop::sample::select(Retention::ALL.to_vec())),
            prop::option::of(any::<u32>()),
            any::<u64>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (delta, request_id, model, input, output, bs),
                (partial, tok, session, ret, ttl, h, keep),
            )| {
                let full = input / bs;
                let n = if partial { input.div_ceil(bs) } else { full };
                let token_ids = tok
                    .filter(|_| keep)
                    .map(|t| (0..input).map(|i| t ^ i).collect());
                let block_hashes = (0..u64::from(n)).map(|i| h.wrapping_add(i)).collect();
                (
                    delta,
                    TraceRequest {
                        arrival_us: 0,
                        request_id,
                        model,
                        input_length: input,
                        output_length: output,
                        block_size: bs,
                        block_hashes,
                        token_ids,
                        session_id: session,
                        retention: ret,
                        ttl_seconds: ttl,
                        think_time_us: None,
                        lora: None,
                        cache_salt: None,
                        images: Vec::new(),
                        tenant: None,
                        // Negative and positive priorities, and none.
                        priority: ttl.map(|t| (t % 7) as i32 - 3),
                    },
                )
            },
        )
}

fn trace_strategy() -> impl Strategy<Value = Trace> {
    (
        prop::collection::vec(request_strategy(), 1..40),
        "\\PC{0,30}",
        prop::collection::vec("\\PC{0,20}", 0..3),
    )
        .prop_map(|(rows, source, notes)| {
            let mut t = 0u64;
            let requests = rows
                .into_iter()
                .map(|(delta, mut r)| {
                    t += delta;
                    r.arrival_us = t;
                    r
                })
                .collect();
            Trace {
                requests,
                source,
                notes,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn parquet_round_trip(trace in trace_strategy()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.parquet");
        write_parquet(&trace, &path).expect("write");
        let back = load(&path, &LoadOptions::default()).expect("read");
        prop_assert_eq!(back, trace);
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
        prop_assert_eq!(names.len(), 1, "no temporary file left");
    }
}

#[test]
fn committed_parquet_fixtures_match_a_fresh_import() {
    for stem in ["conversation_trace", "mooncake_trace_1000"] {
        let jsonl = load_ok(&fixture(&format!("{stem}.jsonl")), &LoadOptions::default());
        let parquet = load_ok(
            &fixture(&format!("{stem}.parquet")),
            &LoadOptions::default(),
        );
        assert_eq!(parquet.requests.len(), jsonl.requests.len(), "{stem}");
        assert!(parquet.requests == jsonl.requests, "{stem}: rows differ");
        assert_eq!(parquet.source, jsonl.source);
        assert!(
            parquet.notes.starts_with(&jsonl.notes),
            "{:?}",
            parquet.notes
        );
        assert!(
            parquet
                .notes
                .iter()
                .any(|n| n.contains("convert_fixtures.rs") && n.contains("seed 0")),
            "{:?}",
            parquet.notes
        );
    }
}

#[test]
fn a_directory_is_read_as_segments_in_name_order() {
    let trace = load_ok(
        &fixture("mooncake_trace_1000.jsonl"),
        &LoadOptions::default(),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let parts: Vec<&[TraceRequest]> = vec![
        &trace.requests[..300],
        &trace.requests[300..301],
        &trace.requests[301..],
    ];
    for (i, part) in parts.iter().enumerate() {
        let segment = Trace {
            requests: part.to_vec(),
            source: trace.source.clone(),
            notes: trace.notes.clone(),
        };
        write_parquet(&segment, &dir.path().join(format!("seg-{i:04}.parquet"))).expect("write");
    }
    std::fs::write(dir.path().join("README.txt"), "not a segment").expect("write");
    let back = load_ok(dir.path(), &LoadOptions::default());
    assert!(back.requests == trace.requests);
    assert_eq!(back.source, trace.source);
    assert!(
        back.notes.iter().any(|n| n.contains("3 segment(s)")),
        "{:?}",
        back.notes
    );

    // A segment that starts before the previous one ended is named.
    std::fs::rename(
        dir.path().join("seg-0000.parquet"),
        dir.path().join("seg-9999.parquet"),
    )
    .expect("rename");
    let err = load(dir.path(), &LoadOptions::default()).expect_err("out of order");
    let msg = err.to_string();
    assert!(
        msg.contains("seg-9999.parquet") && msg.contains("column `arrival_us`, row 0"),
        "{msg}"
    );

    let empty = tempfile::tempdir().expect("tempdir");
    let err = load(empty.path(), &LoadOptions::default()).expect_err("no segments");
    assert!(matches!(err, TraceError::Empty { .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Bad input: every error names the file and the line or column.

const GOOD: &str =
    r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;

fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write fixture");
    path
}

fn expect_line_error(name: &str, text: &str, line: usize, needle: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_file(dir.path(), name, text);
    let err = load(&path, &LoadOptions::default()).expect_err(needle);
    let msg = err.to_string();
    let at = format!("{}:{line}: ", path.display());
    assert!(msg.starts_with(&at), "{msg:?} does not start with {at:?}");
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    assert!(!err.is_retryable());
}

#[test]
fn bad_mooncake_lines_are_named() {
    let cases: &[(&str, usize, &str)] = &[
        ("{\"timestamp\": 0, ", 2, "malformed JSON"),
        (
            r#"{"timestamp": 5, "input_length": "600", "output_length": 5, "hash_ids": [1, 2]}"#,
            2,
            "`input_length` must be a token count",
        ),
        (
            r#"{"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}"#,
            2,
            "missing key `output_length`",
        ),
        (
            r#"{"timestamp": -5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#,
            2,
            "negative timestamp -5 ms",
        ),
        (
            r#"{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}"#,
            2,
            "`hash_ids` has 3 ids but `input_length` 600 needs ceil(600/512) = 2",
        ),
        (
            r#"{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, "x"]}"#,
            2,
            "`hash_ids[1]`",
        ),
    ];
    for &(bad, line, needle) in cases {
        expect_line_error("t.jsonl", &format!("{GOOD}\n{bad}\n{GOOD}\n"), line, needle);
    }
    // Blank lines keep physical numbering.
    expect_line_error(
        "t.jsonl",
        &format!("{GOOD}\n\n\n[]\n"),
        4,
        "expected a JSON object",
    );
}

#[test]
fn the_trace_block_size_is_an_option_of_every_reader() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A Mooncake-format trace hashed in 64-token blocks: 1,000 tokens are 16 ids.
    let ids = |n: u64, base: u64| (0..n).map(|i| (base + i).to_string()).collect::<Vec<_>>();
    let text = format!(
        "{{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 4, \"hash_ids\": [{}]}}\n\
         {{\"timestamp\": 3, \"input_length\": 64, \"output_length\": 4, \"hash_ids\": [{}]}}\n",
        ids(16, 0).join(", "),
        ids(1, 0).join(", ")
    );
    let jsonl = write_file(dir.path(), "small.jsonl", &text);
    let err = load(&jsonl, &as_is()).expect_err("512-token blocks do not fit");
    let msg = err.to_string();
    assert!(
        msg.contains("`hash_ids` has 16 ids but `input_length` 1000 needs ceil(1000/512) = 2")
            && msg.contains("fit a trace block size of 64"),
        "{msg}"
    );
    let at = |bs: u32| LoadOptions {
        block_size: Some(bs),
        ..as_is()
    };
    let t = load_ok(&jsonl, &at(64));
    assert!(t.requests.iter().all(|r| r.block_size == 64));
    assert_eq!(t.requests[0].block_hashes.len(), 16);
    assert!(t.source.contains("block size 64"), "{}", t.source);
    // Its shared first block is a hit at 64 tokens per block.
    let summary = summarize(&t);
    assert!(summary.ideal_hit_rate > 0.0, "{summary:?}");
    // 16-token blocks too.
    let text16 = format!(
        "{{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
        ids(7, 0).join(", ")
    );
    let jsonl16 = write_file(dir.path(), "tiny.jsonl", &text16);
    assert_eq!(load_ok(&jsonl16, &at(16)).requests[0].block_size, 16);
    // Azure: the size of the invented blocks.
    let csv = write_file(
        dir.path(),
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,100,4\n",
    );
    assert_eq!(load_ok(&csv, &at(16)).requests[0].block_hashes.len(), 7);
    // Parquet carries its own: the same value loads, another is a clear error.
    let parquet = dir.path().join("small.parquet");
    write_parquet(&t, &parquet).expect("write");
    assert_eq!(load_ok(&parquet, &at(64)), load_ok(&parquet, &as_is()));
    let err = load(&parquet, &at(512)).expect_err("mismatch");
    assert!(
        matches!(
            err,
            TraceError::BlockSizeMismatch {
                found: 64,
                given: 512,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("has block size 64"), "{err}");
    // Zero is refused by every reader.
    for path in [&jsonl, &csv, &parquet] {
        assert!(matches!(
            load(path, &at(0)),
            Err(TraceError::InvalidOption(_))
        ));
    }
}

#[test]
fn decreasing_timestamps_name_both_lines() {
    let later = GOOD.replace("\"timestamp\": 0", "\"timestamp\": 9000");
    let earlier = GOOD.replace("\"timestamp\": 0", "\"timestamp\": 3000");
    let text = format!("{GOOD}\n{later}\n{earlier}\n");
    expect_line_error(
        "t.jsonl",
        &text,
        3,
        "timestamp 3000 ms is earlier than 9000 ms on line 2",
    );
    let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
               2023-11-16 18:15:46.6805900,374,44\n\
               2023-11-16 18:15:50.0000000,10,1\n\
               2023-11-16 18:15:49.9999999,10,1\n";
    expect_line_error(
        "t.csv",
        csv,
        4,
        "timestamp 2023-11-16 18:15:49.9999999 is earlier than 2023-11-16 18:15:50.0000000 on line 3",
    );
}

#[test]
fn bad_azure_lines_are_named() {
    let head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n";
    let cases: &[(&str, usize, &str)] = &[
        ("2023-11-16 18:15:47.0,374\n", 3, "expected 3 fields"),
        ("2023-11-16 18:75:47.0,374,4\n", 3, "bad `TIMESTAMP`"),
        ("yesterday,374,4\n", 3, "bad `TIMESTAMP`"),
        (
            "2023-11-16 18:15:47.0,-374,4\n",
            3,
            "`ContextTokens` is negative",
        ),
        (
            "2023-11-16 18:15:47.0,374,4.5\n",
            3,
            "`GeneratedTokens` must be a token count",
        ),
    ];
    for &(bad, line, needle) in cases {
        expect_line_error("t.csv", &format!("{head}{bad}"), line, needle);
    }
    expect_line_error(
        "t.csv",
        "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n",
        1,
        "header lacks column `ContextTokens`",
    );
}

#[test]
fn empty_traces_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in [
        ("a.jsonl", ""),
        ("b.jsonl", "\n  \n"),
        ("c.csv", ""),
        ("d.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"),
    ] {
        let path = write_file(dir.path(), name, text);
        let err = load(&path, &LoadOptions::default()).expect_err(name);
        assert!(matches!(err, TraceError::Empty { .. }), "{name}: {err}");
        assert!(err.to_string().contains(name), "{err}");
    }
    let empty = Trace {
        requests: vec![],
        source: "s".into(),
        notes: vec![],
    };
    let path = dir.path().join("e.parquet");
    assert!(matches!(
        write_parquet(&empty, &path),
        Err(TraceError::Empty { .. })
    ));
    assert!(!path.exists());
    // A Parquet file with the schema but no rows.
    write_batches(&path, trace_schema(), &[], true);
    let err = load(&path, &LoadOptions::default()).expect_err("empty parquet");
    assert!(matches!(err, TraceError::Empty { .. }), "{err}");
}

#[test]
fn unsupported_extensions_and_unreadable_paths_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let txt = write_file(dir.path(), "trace.txt", GOOD);
    let err = load(&txt, &LoadOptions::default()).expect_err("txt");
    assert!(matches!(err, TraceError::UnsupportedFormat { .. }), "{err}");
    assert!(err.to_string().contains("trace.txt") && err.to_string().contains(".txt"));
    let none = write_file(dir.path(), "trace", GOOD);
    assert!(matches!(
        load(&none, &LoadOptions::default()),
        Err(TraceError::UnsupportedFormat { .. })
    ));

    let missing = dir.path().join("missing.jsonl");
    let err = load(&missing, &LoadOptions::default()).expect_err("missing");
    assert!(matches!(err, TraceError::Io { .. }), "{err}");
    assert!(err.to_string().contains("missing.jsonl"), "{err}");
    assert!(err.is_retryable());

    let latin1 = dir.path().join("latin1.jsonl");
    std::fs::write(&latin1, [GOOD.as_bytes(), b"\n\xff\n"].concat()).expect("write");
    let err = load(&latin1, &LoadOptions::default()).expect_err("not utf-8");
    assert!(
        err.to_string().contains("latin1.jsonl:2: invalid UTF-8"),
        "{err}"
    );

    let bad_opts = LoadOptions {
        block_size: Some(0),
        ..LoadOptions::default()
    };
    let csv = write_file(
        dir.path(),
        "z.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n",
    );
    assert!(matches!(
        load(&csv, &bad_opts),
        Err(TraceError::InvalidOption(_))
    ));
}

/// Writes record batches with the given schema as a Parquet file, with or without the version.
fn write_batches(path: &Path, schema: Arc<Schema>, batches: &[RecordBatch], versioned: bool) {
    let meta = versioned.then(|| vec![KeyValue::new(META_VERSION.to_owned(), "1".to_owned())]);
    let props = WriterProperties::builder()
        .set_key_value_metadata(meta)
        .build();
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, schema, Some(props)).expect("writer");
    for b in batches {
        writer.write(b).expect("write batch");
    }
    writer.close().expect("close");
}

fn sample_rows(n: u64) -> Vec<TraceRequest> {
    (0..n)
        .map(|i| TraceRequest {
            arrival_us: i * 10,
            request_id: format!("r{i}"),
            model: "m".into(),
            input_length: 20,
            output_length: 3,
            block_size: 16,
            block_hashes: vec![i, i + 100],
            token_ids: None,
            session_id: None,
            retention: None,
            ttl_seconds: None,
            think_time_us: None,
            lora: None,
            cache_salt: None,
            images: Vec::new(),
            tenant: None,
            priority: None,
        })
        .collect()
}

/// The sample batch with column `name` replaced (or removed when `array` is `None`).
fn replace_column(name: &str, field: Option<Field>, array: Option<ArrayRef>) -> RecordBatch {
    let batch = to_record_batch(&sample_rows(3)).expect("batch");
    let schema = batch.schema();
    let mut fields = Vec::new();
    let mut columns = Vec::new();
    for (f, c) in schema.fields().iter().zip(batch.columns()) {
        if f.name() == name {
            if let (Some(field), Some(array)) = (&field, &array) {
                fields.push(field.clone());
                columns.push(array.clone());
            }
        } else {
            fields.push(f.as_ref().clone());
            columns.push(c.clone());
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("batch")
}

fn expect_column_error(batch: RecordBatch, needle: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.parquet");
    write_batches(&path, batch.schema(), &[batch], true);
    let err = load(&path, &LoadOptions::default()).expect_err(needle);
    let msg = err.to_string();
    assert!(matches!(err, TraceError::Column { .. }), "{msg}");
    assert!(msg.starts_with(&path.display().to_string()), "{msg}");
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
}

#[test]
fn bad_parquet_columns_are_named() {
    expect_column_error(
        replace_column(
            col::ARRIVAL_US,
            Some(Field::new(col::ARRIVAL_US, DataType::Int64, false)),
            Some(Arc::new(Int64Array::from(vec![0, 10, 20]))),
        ),
        "column `arrival_us`: expected type UInt64, found Int64",
    );
    expect_column_error(
        replace_column(col::BLOCK_HASHES, None, None),
        "column `block_hashes`: missing required column",
    );
    expect_column_error(
        replace_column(
            col::RETENTION,
            Some(Field::new(col::RETENTION, DataType::Utf8, true)),
            Some(Arc::new(StringArray::from(vec![
                None,
                None,
                Some("forever"),
            ]))),
        ),
        "column `retention`, row 2: unknown retention \"forever\"",
    );
    expect_column_error(
        replace_column(
            col::ARRIVAL_US,
            Some(Field::new(col::ARRIVAL_US, DataType::UInt64, false)),
            Some(Arc::new(UInt64Array::from(vec![0, 30, 20]))),
        ),
        "column `arrival_us`, row 2: arrival 20 us is earlier",
    );
    expect_column_error(
        replace_column(
            col::MODEL,
            Some(Field::new(col::MODEL, DataType::Utf8, true)),
            Some(Arc::new(StringArray::from(vec![
                Some("m"),
                None,
                Some("m"),
            ]))),
        ),
        "column `model`, row 1: null in a required column",
    );
    expect_column_error(
        replace_column(
            col::INPUT_LENGTH,
            Some(Field::new(col::INPUT_LENGTH, DataType::UInt32, false)),
            Some(Arc::new(arrow_array::UInt32Array::from(vec![20, 2000, 20]))),
        ),
        "column `block_hashes`, row 1: 2 block hashes for input_length 2000 at block size 16",
    );
}

#[test]
fn foreign_parquet_files_are_tolerated_where_documented() {
    // No version metadata, an extra column, optional columns absent, LargeUtf8 strings.
    let batch = replace_column(col::TOKEN_IDS, None, None);
    let batch = {
        let schema = batch.schema();
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
        let mut columns = batch.columns().to_vec();
        let i = fields
            .iter()
            .position(|f| f.name() == col::MODEL)
            .expect("model");
        fields[i] = Field::new(col::MODEL, DataType::LargeUtf8, false);
        columns[i] = Arc::new(arrow_array::LargeStringArray::from(vec!["m", "m", "m"]));
        fields.push(Field::new("client_region", DataType::Utf8, true));
        columns.push(Arc::new(StringArray::from(vec![
            Some("eu"),
            None,
            Some("us"),
        ])));
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("batch")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("duckdb.parquet");
    write_batches(&path, batch.schema(), &[batch], false);
    let trace = load_ok(&path, &LoadOptions::default());
    assert_eq!(trace.requests, sample_rows(3));
    assert_eq!(trace.source, "duckdb.parquet");
    assert!(
        trace.notes.iter().any(|n| n.contains("read as version 1")),
        "{:?}",
        trace.notes
    );
}

#[test]
fn unreadable_parquet_files_are_errors_not_panics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let junk = write_file(dir.path(), "junk.parquet", "this is not parquet at all");
    let err = load(&junk, &LoadOptions::default()).expect_err("junk");
    assert!(matches!(err, TraceError::Parquet { .. }), "{err}");
    assert!(err.to_string().contains("junk.parquet"), "{err}");

    let path = dir.path().join("v2.parquet");
    let batch = to_record_batch(&sample_rows(2)).expect("batch");
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(vec![KeyValue::new(
            META_VERSION.to_owned(),
            "2".to_owned(),
        )]))
        .build();
    let mut w = ArrowWriter::try_new(
        std::fs::File::create(&path).expect("create"),
        batch.schema(),
        Some(props),
    )
    .expect("writer");
    w.write(&batch).expect("write");
    w.close().expect("close");
    let err = load(&path, &LoadOptions::default()).expect_err("v2");
    assert!(
        err.to_string()
            .contains("unsupported trace format version \"2\""),
        "{err}"
    );

    // Every truncation of a valid file fails cleanly.
    let good = std::fs::read(fixture("mooncake_trace_1000.parquet")).expect("fixture");
    let cut = dir.path().join("cut.parquet");
    for len in (0..good.len())
        .step_by(good.len() / 97 + 1)
        .chain([good.len() - 1])
    {
        std::fs::write(&cut, &good[..len]).expect("write");
        assert!(
            load(&cut, &LoadOptions::default()).is_err(),
            "truncated at {len} loaded"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Arbitrary bytes never panic any importer.
    #[test]
    fn arbitrary_input_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400), text in "\\PC{0,200}") {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["x.jsonl", "x.csv", "x.parquet"] {
            std::fs::write(dir.path().join(name), &bytes).expect("write");
            let _ = load(&dir.path().join(name), &LoadOptions::default());
            let csv_like = format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{text}");
            std::fs::write(dir.path().join(name), csv_like).expect("write");
            let _ = load(&dir.path().join(name), &LoadOptions::default());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Atomic writes.

#[test]
fn a_failed_write_leaves_nothing_behind() {
    let trace = Trace {
        requests: sample_rows(5),
        source: "s".into(),
        notes: vec![],
    };
    let dir = tempfile::tempdir().expect("tempdir");

    let missing = dir.path().join("no/such/dir/t.parquet");
    let err = write_parquet(&trace, &missing).expect_err("missing directory");
    assert!(matches!(err, TraceError::Write { .. }), "{err}");
    assert!(err.to_string().contains("t.parquet"), "{err}");
    assert!(!missing.exists());

    // An invalid trace is rejected before anything is written, and an existing file survives.
    let path = dir.path().join("t.parquet");
    write_parquet(&trace, &path).expect("first write");
    let before = std::fs::read(&path).expect("read");
    let mut bad = trace.clone();
    bad.requests[3].arrival_us = 1;
    let err = write_parquet(&bad, &path).expect_err("unsorted");
    let msg = err.to_string();
    assert!(
        msg.contains("request 3 (\"r3\"), field `arrival_us`"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).expect("read"), before);
    bad.requests[3].arrival_us = 30;
    bad.requests[2].block_hashes.push(7);
    assert!(matches!(
        write_parquet(&bad, &path),
        Err(TraceError::InvalidRequest {
            field: "block_hashes",
            ..
        })
    ));
    let entries: Vec<String> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        entries,
        vec!["t.parquet".to_owned()],
        "no temporary file left"
    );
    assert_eq!(
        load_ok(&path, &LoadOptions::default()).requests,
        trace.requests
    );
}
