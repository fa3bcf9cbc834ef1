//! Importer for Mooncake-format JSONL traces (FAST'25 `conversation_trace.jsonl`,
//! `synthetic_trace.jsonl`, the arXiv trace, Dynamo's `mooncake_trace_1000.jsonl`).
//!
//! One JSON object per line (blank lines are skipped):
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `timestamp` | non-negative integer | arrival, milliseconds since the trace start |
//! | `input_length` | `u32` | prompt tokens |
//! | `output_length` | `u32` | generated tokens |
//! | `hash_ids` | array of `u64` | chained prefix block ids, one per block of [`LoadOptions::block_size`] tokens (default [`MOONCAKE_BLOCK_SIZE`]) |
//!
//! Types are strict (a float, string or negative number where an integer is due is an error), but
//! unknown keys are ignored, provided the line is well-formed JSON. Each line must satisfy
//! `len(hash_ids) == ceil(input_length / block_size)`, and timestamps must never decrease; a line
//! that does not, but would at another power-of-two block size, says which.
//!
//! Output rows: `arrival_us = timestamp × 1000` (then bucket-spread when
//! [`LoadOptions::spread_buckets`], see [`crate::trace::spread`]), `request_id =
//! "{file_stem}-{line}"` (1-based physical line), `model` = [`LoadOptions::model`], `block_size`
//! as above, `block_hashes = hash_ids`; the nullable columns are null.

use super::{LoadOptions, Trace, TraceError, TraceRequest, blocks_for, spread_buckets};
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// Tokens per `hash_ids` block in Mooncake's own traces.
pub const MOONCAKE_BLOCK_SIZE: u32 = 512;

#[derive(Deserialize)]
struct Line {
    timestamp: i64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSONL file (see the module docs).
///
/// # Errors
/// [`TraceError::Line`] for malformed lines, missing keys, wrong types, negative timestamps and
/// inconsistent `hash_ids`; [`TraceError::NotMonotonic`] naming both lines when a timestamp
/// decreases; [`TraceError::Empty`] when no line holds a request; [`TraceError::InvalidOption`]
/// for a zero block size; [`TraceError::Io`] when the file cannot be read.
pub fn import(path: &Path, opts: &LoadOptions) -> Result<Trace, TraceError> {
    let bs = opts.block_size.unwrap_or(MOONCAKE_BLOCK_SIZE);
    if bs == 0 {
        return Err(TraceError::InvalidOption(
            "the trace block size must be positive".to_owned(),
        ));
    }
    let text = super::read_text(path)?;
    let lines: Vec<(usize, &str)> = super::numbered_lines(&text).collect();
    // Parsing dominates; do it in parallel and check order-dependent facts sequentially after.
    let parsed: Vec<Result<Line, String>> = lines.par_iter().map(|(_, l)| parse_line(l)).collect();

    let stem = super::file_stem(path);
    let mut requests = Vec::with_capacity(lines.len());
    let mut previous: Option<(i64, usize)> = None;
    for (&(line_no, _), result) in lines.iter().zip(parsed) {
        let rec = result.map_err(|m| TraceError::line(path, line_no, m))?;
        if rec.timestamp < 0 {
            return Err(TraceError::line(
                path,
                line_no,
                format!("negative timestamp {} ms", rec.timestamp),
            ));
        }
        if let Some((prev_ts, prev_line)) = previous
            && rec.timestamp < prev_ts
        {
            return Err(TraceError::NotMonotonic {
                path: path.to_path_buf(),
                line: line_no,
                value: format!("{} ms", rec.timestamp),
                previous_line: prev_line,
                previous: format!("{prev_ts} ms"),
            });
        }
        previous = Some((rec.timestamp, line_no));
        let want = blocks_for(rec.input_length, bs);
        let have = rec.hash_ids.len() as u64;
        if have != want {
            let hint = fitting_block_size(rec.input_length, have)
                .map(|b| format!(" (they fit a trace block size of {b}: give that instead)"))
                .unwrap_or_default();
            return Err(TraceError::line(
                path,
                line_no,
                format!(
                    "`hash_ids` has {have} ids but `input_length` {} needs ceil({}/{bs}) = \
                     {want} at trace block size {bs}{hint}",
                    rec.input_length, rec.input_length
                ),
            ));
        }
        let arrival_us = (rec.timestamp as u64).checked_mul(1000).ok_or_else(|| {
            TraceError::line(
                path,
                line_no,
                format!("timestamp {} ms overflows microseconds", rec.timestamp),
            )
        })?;
        requests.push(TraceRequest {
            arrival_us,
            request_id: format!("{stem}-{line_no}"),
            model: opts.model.clone(),
            input_length: rec.input_length,
            output_length: rec.output_length,
            block_size: bs,
            block_hashes: rec.hash_ids,
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
        });
    }
    if requests.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }

    let mut notes = Vec::new();
    if opts.spread_buckets {
        let mut arrivals: Vec<u64> = requests.iter().map(|r| r.arrival_us).collect();
        if let Some(report) = spread_buckets(&mut arrivals, opts.seed) {
            for (r, a) in requests.iter_mut().zip(arrivals) {
                r.arrival_us = a;
            }
            notes.push(report.note());
        }
    } else {
        notes.push("timestamps kept as recorded (bucket spreading off)".to_owned());
    }
    Ok(Trace {
        requests,
        source: format!(
            "{} (Mooncake JSONL, block size {bs})",
            super::file_name(path)
        ),
        notes,
    })
}

/// The power-of-two block size (1 to 2^20 tokens) at which `ids` hash ids span `input_length`
/// tokens, if there is one.
fn fitting_block_size(input_length: u32, ids: u64) -> Option<u32> {
    (0..=20)
        .map(|p| 1u32 << p)
        .find(|b| blocks_for(input_length, *b) == ids)
}

/// Parses one line; on failure, says which key is wrong and how.
fn parse_line(line: &str) -> Result<Line, String> {
    match serde_json::from_str::<Line>(line) {
        Ok(rec) => Ok(rec),
        Err(typed) => Err(diagnose(line).unwrap_or_else(|| typed.to_string())),
    }
}

/// A precise message for a line the typed parser rejected, or `None` to use serde's.
fn diagnose(line: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return Some(format!("malformed JSON: {e}")),
    };
    let Some(obj) = value.as_object() else {
        return Some(format!("expected a JSON object, found {}", kind(&value)));
    };
    let check_int = |key: &str, max: u64, what: &str| -> Option<String> {
        let Some(v) = obj.get(key) else {
            return Some(format!("missing key `{key}`"));
        };
        if let Some(i) = v.as_i64()
            && i < 0
        {
            return Some(format!("`{key}` is negative ({i}); expected {what}"));
        }
        match v.as_u64() {
            Some(u) if u <= max => None,
            Some(u) => Some(format!("`{key}` is {u}, more than {max}")),
            None => Some(format!("`{key}` must be {what}, found {}", kind(v))),
        }
    };
    let problem = check_int(
        "timestamp",
        i64::MAX as u64,
        "an integer number of milliseconds",
    )
    .or_else(|| check_int("input_length", u64::from(u32::MAX), "a token count (u32)"))
    .or_else(|| check_int("output_length", u64::from(u32::MAX), "a token count (u32)"));
    if problem.is_some() {
        return problem;
    }
    match obj.get("hash_ids") {
        None => Some("missing key `hash_ids`".to_owned()),
        Some(Value::Array(ids)) => ids.iter().enumerate().find_map(|(i, v)| {
            v.as_u64().is_none().then(|| {
                format!(
                    "`hash_ids[{i}]` must be a non-negative integer (u64), found {}",
                    kind(v)
                )
            })
        }),
        Some(v) => Some(format!("`hash_ids` must be an array, found {}", kind(v))),
    }
}

/// How a JSON value reads in an error message: its kind and, for scalars, the value.
fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_line_and_ignores_unknown_keys() {
        let rec = parse_line(
            r#"{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2], "extra": {"x": [1]}}"#,
        )
        .expect("valid line");
        assert_eq!(
            (rec.timestamp, rec.input_length, rec.hash_ids),
            (5, 600, vec![1, 2])
        );
    }

    #[test]
    fn diagnoses_each_kind_of_bad_line() {
        let cases = [
            (r#"{"timestamp": 5, "input_length": 1"#, "malformed JSON"),
            (r#"[1, 2]"#, "expected a JSON object"),
            (
                r#"{"input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "missing key `timestamp`",
            ),
            (
                r#"{"timestamp": 1.5, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "`timestamp` must be",
            ),
            (
                r#"{"timestamp": 1, "input_length": "7", "output_length": 1, "hash_ids": [1]}"#,
                "`input_length` must be",
            ),
            (
                r#"{"timestamp": 1, "input_length": -7, "output_length": 1, "hash_ids": [1]}"#,
                "`input_length` is negative",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 4294967296, "hash_ids": [1]}"#,
                "more than 4294967295",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 1}"#,
                "missing key `hash_ids`",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": 3}"#,
                "must be an array",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, -2]}"#,
                "`hash_ids[1]`",
            ),
            (
                r#"{"timestamp": 1, "timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "duplicate field",
            ),
        ];
        for (line, want) in cases {
            let err = parse_line(line).err().unwrap_or_default();
            assert!(err.contains(want), "{line}: {err:?} lacks {want:?}");
        }
    }
}
